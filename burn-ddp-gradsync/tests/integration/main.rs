//! The integration tests of burn-ddp-gradsync, the line of Burn 0.22.1 and 0.23, one test binary
//! (one link of the Burn release it is built for: `cargo test -p burn-ddp-gradsync` is Burn
//! 0.22.1, `--no-default-features --features burn-0-23,train,hold-systemstat` Burn 0.23) with a
//! module per scenario file. Tests that run in several processes re-execute this binary with the
//! test's full name (`burn_ddp_dev::procs::test_path` finds `module::name` from the function's
//! name). The NCCL path is a binary of its own, `cuda` (a GPU and NCCL, feature `cuda`). The
//! end-to-end tests, which run the examples as a user does (the classifier under the launcher and
//! under faults, the migration pairs, multi-node jobs, the etcd store), are the root package's
//! (the repository's top-level `tests/`).

// This package is built for one Burn release (feature `burn-0-22` or `burn-0-23`): `burn` is
// that release. A project of yours depends on its own `burn` and has no need of these lines.
#[cfg(feature = "burn-0-22")]
extern crate burn022 as burn;
#[cfg(feature = "burn-0-23")]
extern crate burn023 as burn;
// ZeRO's optimizer records are read back through the release's burnpack reader.
#[cfg(feature = "burn-0-22")]
extern crate burn_pack022 as burn_pack;
#[cfg(feature = "burn-0-23")]
extern crate burn_pack023 as burn_pack;

mod equivalence;
mod fsdp_memory;
mod learner;
mod pipeline;
