//! The integration tests of the Burn 0.22.1 line (`burn-ddp-burn022`), one test binary (one link of
//! Burn 0.22.1) with a module per scenario file. Tests that run in several processes re-execute
//! this binary with the test's full name (`burn_ddp_dev::procs::test_path` finds `module::name`
//! from the function's name). The tests that need a feature or a machine this binary does not
//! assume are binaries of their own: `cuda022` (a GPU and NCCL, feature `cuda`) and `etcd_store022`
//! (feature `etcd`, root, Debian's etcd-server).

mod classifier;
mod custom_loop;
mod equivalence;
mod fault_tolerant;
mod learner;
mod migration;
mod multinode;
mod pipeline;
