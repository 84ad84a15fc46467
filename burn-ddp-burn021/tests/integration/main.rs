//! The integration tests of the Burn 0.21 line (`burn-ddp-burn021`), one test binary (one link
//! of Burn 0.21) with a module per scenario file. Tests that run in several processes re-execute
//! this binary with the test's full name (`burn_ddp_dev::procs::test_path` finds `module::name`
//! from the function's name). The tests that need a feature or a machine this binary does not
//! assume are binaries of their own: `cuda_nccl` and `ddp_equivalence` (a GPU and NCCL, feature
//! `cuda`). The end-to-end tests, which run the examples as a user does (the classifier under the
//! launcher and under faults, the migration pairs, multi-node jobs, the etcd store), are the root
//! package's (the repository's top-level `tests/`).

// This package is `burn-ddp-burn021`; users reach it as `burn_ddp` (the `burn-ddp` crate with
// feature `burn-0-21`), and so does this program.
extern crate burn_ddp_burn021 as burn_ddp;

mod common;

mod checkpoint_crash;
mod ddp_equivalence;
mod ddp_macro;
#[cfg(feature = "train")]
mod ddp_strategy;
mod fault_tolerance;
mod pipeline;
mod soak;
