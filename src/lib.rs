//! The burn-ddp workspace package: it hosts the step benchmarks (`benches/ddp_step`), which
//! compare burn-ddp with plain Burn and, with feature `lines`, the two Burn lines in one run,
//! and the Burn 0.21 line's light examples (`examples/`: the guide's migration pairs,
//! `migration`, `pipeline`), built unoptimised in the dev profile (the root Cargo.toml says why).
//! The libraries are `burn-ddp` (the crate users add), `burn-ddp-comm`, `burn-ddp-burn021` and
//! `burn-ddp-gradsync`, each
//! line's tests, examples and other benchmarks in its own directory.
