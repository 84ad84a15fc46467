//! # burn-ddp
//!
//! Distributed data-parallel training for [Burn](https://burn.dev): one process per device, on one
//! machine or many, gradients all-reduced across processes, started by `burn-ddp run`, torchrun,
//! Slurm or `mpirun`; a deadline on every wait, and an error that names the rank at fault.
//!
//! **One crate for every supported Burn release.** A feature chooses the release, and the same
//! paths (`use burn_ddp::{DistributedSampler, ProcessGroup, ...}`) serve each:
//!
//! | Burn | feature | `Cargo.toml` | gradients |
//! |---|---|---|---|
//! | 0.22.1 | `burn-0-22` (default) | `burn-ddp = "0.1"` | `GradSync` after backward, in buckets |
//! | 0.23.0-pre.1 | `burn-0-23` | `burn-ddp = { version = "0.1", default-features = false, features = ["burn-0-23", "train", "hold-systemstat"] }` | the 0.22 API |
//! | 0.21.0 | `burn-0-21` | `burn-ddp = { version = "0.1", default-features = false, features = ["burn-0-21", "train", "hold-systemstat"] }` | `Autodiff<Ddp<B>>` during backward |
//!
//! Exactly one release feature is on in a build; two (a dependency of yours asking for another
//! release, or the default `burn-0-22` left on beside yours) is a compile error that says which.
//! This crate compiles nothing of its own: it re-exports the chosen release's line
//! (`burn-ddp-burn021` for Burn 0.21, `burn-ddp-gradsync` for 0.22 and 0.23, one source built for
//! either), whose items and documentation follow, and passes its other features (`train`, `tui`, `etcd`, `cuda`, `fusion`, `cuda-cpp`,
//! `flex`, `ndarray`, `hold-systemstat`) to that line alone.
//!
//! On the default release (Burn 0.22.1), a custom training loop:
//!
//! ```no_run
//! # #[cfg(feature = "burn-0-22")] mod with_0_22 {
//! use burn::module::Module;
//! use burn::optim::{GradientsParams, Optimizer, SgdConfig};
//! use burn_ddp::{main_println, GradSync};
//! # fn model() -> burn::nn::Linear { burn::nn::LinearConfig::new(4, 1).init(&Default::default()) }
//! # fn loss(m: &burn::nn::Linear) -> burn::Tensor<1> {
//! #     m.forward(burn::Tensor::<2>::zeros([2, 4], &Default::default())).mean()
//! # }
//!
//! # pub fn run() {
//! // One process per rank, started by `burn-ddp run` (or torchrun, or srun).
//! let mut sync = GradSync::from_env().expect("joining the job");
//! let mut model = sync.prepare(model()).expect("one model"); // rank 0's weights everywhere
//! let mut optim = SgdConfig::new().init();
//! for epoch in 1..=2 {
//!     sync.set_epoch(epoch); // every sampler of the job deals this epoch's shards
//!     let grads = GradientsParams::from_grads(loss(&model).backward(), &model);
//!     let grads = sync.sync(&model, grads).expect("gradients"); // the mean over every rank
//!     model = optim.step(0.1, model, grads);
//!     main_println!("epoch {epoch} done"); // rank 0 alone
//! }
//! # } }
//! # fn main() {}
//! ```
//!
//! The guide (`docs/guide.md`) moves an existing Burn program over, on each release.

#![warn(missing_docs)]

#[cfg(not(any(feature = "burn-0-21", feature = "gradsync")))]
compile_error!(
    "burn-ddp: no Burn release is chosen. Turn on one of the features `burn-0-21`, `burn-0-22` \
     (the default) or `burn-0-23`, the release of the `burn` your project depends on: for \
     example `burn-ddp = { version = \"0.1\", default-features = false, features = \
     [\"burn-0-23\", \"train\", \"hold-systemstat\"] }`"
);

#[cfg(all(feature = "burn-0-21", feature = "gradsync"))]
compile_error!(
    "burn-ddp: feature `burn-0-21` is on beside `burn-0-22` or `burn-0-23`, but one build serves \
     one Burn release. `burn-0-22` is a default feature: for Burn 0.21 write `burn-ddp = { version = \
     \"0.1\", default-features = false, features = [\"burn-0-21\", \"train\", \
     \"hold-systemstat\"] }` (`cargo tree -e features -i burn-ddp` shows which of your \
     dependencies turns on each)"
);

#[cfg(all(feature = "burn-0-21", any(feature = "flex", feature = "ndarray")))]
compile_error!(
    "burn-ddp: features `flex` and `ndarray` are for Burn 0.22 and 0.23 (the backends their \
     `SyncBatchNorm` runs on); on Burn 0.21 (`burn-0-21`) `SyncBatchNorm` runs on every backend: \
     remove them"
);

#[cfg(all(feature = "burn-0-21", feature = "cuda-cpp"))]
compile_error!(
    "burn-ddp: feature `cuda-cpp` is for Burn 0.22 and 0.23; Burn 0.21's CUDA backend \
     (`burn-0-21` with `cuda` or `fusion`) has no such choice: remove it"
);

#[cfg(feature = "burn-0-21")]
#[doc(inline)]
pub use burn_ddp_burn021::*;

// Burn 0.22 and 0.23: one crate, built for the release that `burn-0-22` or `burn-0-23` chose
// (it refuses neither and both with errors of its own).
#[cfg(all(feature = "gradsync", not(feature = "burn-0-21")))]
#[doc(inline)]
pub use burn_ddp_gradsync::*;
