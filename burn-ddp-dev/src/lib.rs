//! Development-only helpers of burn-ddp, without Burn, shared by both Burn lines' tests,
//! examples and benches (a dev-dependency of `burn-ddp-burn021`, `burn-ddp-gradsync` and the root
//! package's step benchmarks; never published):
//!
//! - [`procs`]: the multi-process test harness (a test function run as the ranks of a real job)
//! - [`conformance`]: the conformance suite every line runs (`conformance_suite!`): DDP
//!   training equal to one process on the whole batch, scenario by scenario
//! - [`adapters`]: the checks every line's sampler and output items pass (their unit tests
//!   hand each check a closure in the release's API)
//! - [`compare`]: models compared with a stated tolerance, replicas compared bit for bit, and
//!   the negative control that an unsynchronised model is beyond the tolerance
//! - [`device`]: what both lines' device-transport tests share (the stand-in link's queue,
//!   thread ranks, the gradients checked against the host's mean)
//! - [`spawned`]: jobs started through the launcher and read as they run
//! - [`fault_tolerance`]: fault-tolerant jobs, and the Learner scenarios every line's classifier passes
//! - [`chaos`]: the chaos run, a seeded random schedule of faults on fault-tolerant jobs
//! - [`netns`]: several "nodes" on one machine (network namespaces), and the two-node
//!   scenario every line's classifier passes
//! - [`cgroup`]: a memory limit on one rank (a cgroup), for FSDP's over-limit test
//! - [`damage`]: damaged checkpoint and run files, refused on resume (both lines' classifiers)
//! - [`diff`]: the lines a migration changed
//! - [`hooks`]: a communication hook the equivalence tests train with
//! - [`args`]: the step benchmarks' command line
//! - [`images`]: the classifier examples' generated images and MNIST reader

pub mod adapters;
pub mod args;
pub mod cgroup;
pub mod chaos;
pub mod compare;
pub mod conformance;
pub mod damage;
pub mod device;
pub mod diff;
pub mod etcd;
pub mod fault_tolerance;
pub mod hooks;
pub mod images;
pub mod netns;
pub mod procs;
pub mod spawned;

/// The package whose tests, examples or benches are running: `cargo test`, `cargo run` and
/// `cargo bench` give their processes its directory in `CARGO_MANIFEST_DIR` (this crate's own,
/// known when it is compiled, is not the one meant).
///
/// # Panics
/// Outside cargo, where the variable is not set: the message says so.
pub fn package_dir() -> std::path::PathBuf {
    std::env::var_os("CARGO_MANIFEST_DIR")
        .map(std::path::PathBuf::from)
        .expect(
            "CARGO_MANIFEST_DIR is not set: run this test through cargo (cargo test), which names \
             the package whose examples and files it uses",
        )
}
