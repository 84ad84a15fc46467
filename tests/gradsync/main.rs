//! The end-to-end tests of the Burn 0.22/0.23 line (`burn-ddp` with `burn-0-22` or `burn-0-23`,
//! `GradSync`), on the release the features choose: the top-level examples run as a user runs
//! them, on real processes through the real launcher, under faults, across network namespaces;
//! the guide's migration pairs counted and run. One test binary (one link of that Burn release),
//! a module per scenario file: `cargo test --no-default-features --features burn-0-22 --test
//! gradsync` (or `burn-0-23`). The line's own tests (equivalence, the Learner strategy, ZeRO,
//! pipelines) are `burn-ddp-gradsync`'s; the etcd store's scenarios are `tests/etcd_store.rs`.

include!("../../src/release.rs");

/// The classifier example (`examples/classifier/`), built by the same cargo run for the same
/// release.
const CLASSIFIER: &str = "classifier";

mod classifier;
mod custom_loop;
mod fault_tolerant;
mod migration;
mod multinode;
mod pipeline;
