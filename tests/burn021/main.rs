//! The end-to-end tests of the Burn 0.21 line (`burn-ddp` with `burn-0-21`, `Autodiff<Ddp<B>>`):
//! the top-level examples run as a user runs them, on 2 to 4 real processes through the real
//! launcher, under faults, across network namespaces; the guide's migration pairs counted and
//! run. One test binary (one link of Burn 0.21), a module per scenario file; built when the
//! features choose Burn 0.21 (`cargo test --test burn021`, the default). The line's own tests
//! (equivalence, the Learner strategy, the reducer, pipelines in one process) are
//! `burn-ddp-burn021`'s; the etcd store's scenarios are `tests/etcd_store.rs`.

// The Burn 0.21 line is the package `burn-ddp-burn021` here; a program of yours reaches it as
// `burn_ddp` (the `burn-ddp` crate with feature `burn-0-21`), and so does this one.
extern crate burn_ddp_burn021 as burn_ddp;

// The 0.21 line's test helpers, shared with its own integration tests.
#[path = "../../burn-ddp-burn021/tests/integration/common/mod.rs"]
mod common;

mod classifier_example;
mod classifier_runs;
mod custom_loop;
mod fault_tolerant_training;
mod migration;
mod multinode;
mod pipeline;
