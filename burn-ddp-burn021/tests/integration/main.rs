//! The integration tests of the Burn 0.21 line (`burn-ddp`), one test binary (one link of Burn
//! 0.21) with a module per scenario file. Tests that run in several processes re-execute this
//! binary with the test's full name (`burn_ddp_dev::procs::test_path` finds `module::name` from the
//! function's name). The tests that need a feature or a machine this binary does not assume are
//! binaries of their own: `cuda_nccl` (a GPU and NCCL, feature `cuda`) and `etcd_store` (feature
//! `etcd`, root, Debian's etcd-server).

// This package is `burn-ddp-burn021`; users reach it as `burn_ddp` (the `burn-ddp` crate with
// feature `burn-0-21`), and so does this program.
extern crate burn_ddp_burn021 as burn_ddp;

mod common;

mod checkpoint_crash;
#[cfg(feature = "train")]
mod classifier_example;
#[cfg(feature = "train")]
mod classifier_runs;
mod custom_loop;
mod ddp_equivalence;
mod ddp_macro;
#[cfg(feature = "train")]
mod ddp_strategy;
mod fault_tolerance;
#[cfg(feature = "train")]
mod fault_tolerant_training;
#[cfg(feature = "train")]
mod migration;
#[cfg(feature = "train")]
mod multinode;
mod pipeline;
mod soak;
