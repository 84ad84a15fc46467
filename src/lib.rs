//! The burn-ddp workspace package (not published): what a user runs first and what tests the
//! project end to end, for every Burn release. Its examples (`examples/`: the classifier, the
//! guide's migration pairs, `pipeline`, and Burn 0.21's `migration`), its end-to-end tests
//! (`tests/`) and its step benchmarks (`benches/ddp_step`) run on the Burn release its features
//! choose, one per build as `burn-ddp`'s: `burn-0-21` (the default), `burn-0-22` or `burn-0-23`
//! (`cargo run --example classifier --no-default-features --features burn-0-22`). The libraries
//! are `burn-ddp` (the crate users add), `burn-ddp-comm`, `burn-ddp-burn021` and
//! `burn-ddp-gradsync`, each line's own tests and benchmarks in its directory. This library is
//! empty: it refuses a build without a release or with two.

#[cfg(not(any(feature = "burn-0-21", feature = "burn-0-22", feature = "burn-0-23")))]
compile_error!(
    "no Burn release: the examples and tests build for one, chosen by feature `burn-0-21` (the \
     default), `burn-0-22` or `burn-0-23` (`--no-default-features --features burn-0-22`)"
);

#[cfg(all(
    feature = "burn-0-21",
    any(feature = "burn-0-22", feature = "burn-0-23")
))]
compile_error!(
    "two Burn releases: `burn-0-21` is the default feature; for Burn 0.22 or 0.23 turn it off \
     (`--no-default-features --features burn-0-22`)"
);
