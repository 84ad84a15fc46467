//! The integration tests of the core crate (`burn-ddp-comm`), one test binary (one link of the
//! core, without Burn) with a module per scenario file. Tests that run in several processes
//! re-execute this binary with the test's full name (`burn_ddp_dev::procs::test_path` finds
//! `module::name` from the function's name). The tests that need a feature or a machine this binary
//! does not assume are binaries of their own: none on this crate (its feature-gated code is tested
//! by its unit tests, .ci/run runs them with every feature).

mod bench_tool;
mod comm_collectives;
mod group_failures;
mod hierarchical;
mod launch_options;
mod layers;
mod shared_buckets;
mod subgroups_p2p;
