//! # burn-ddp for Burn 0.22.1 and 0.23
//!
//! Add it as `burn-ddp`, whose features `burn-0-22` (the default) and `burn-0-23` choose the
//! release (`burn-ddp = "0.1"`, or `burn-ddp = { version = "0.1", default-features = false,
//! features = ["burn-0-23", "train", "hold-systemstat"] }`): that crate re-exports this one, so
//! a program writes `use burn_ddp::...` on every Burn release.
//!
//! Multi-process, multi-node data-parallel training for programs on **Burn 0.22.1** or **Burn
//! 0.23** (0.23.0-pre.1), one source compiled against either (this crate's features `burn-0-22`
//! and `burn-0-23`, exactly one on), on the same process group, launcher, store, transports,
//! deadlines and errors as burn-ddp's Burn 0.21 line (all from `burn-ddp-comm`). Burn 0.23 kept
//! the module, gradient, record, dataset and optimizer APIs this glue uses from 0.22; what
//! differs between the two releases is in `src/release/` and `src/progress/`, one file per
//! release (burn-train 0.23's split events and progress loggers, which carry a `Progress`
//! instead of counts; the backends `SyncBatchNorm` can run on: Burn 0.23 has no NdArray).
//!
//! Burn 0.22 routes every tensor through its closed `Dispatch` enum, so a backend decorator
//! such as burn-ddp's `Autodiff<Ddp<B>>` cannot exist there. This line works on the
//! `GradientsParams` handed to the optimizer: [`GradSync::sync`] reduces them **after
//! backward**; with one more line, [`GradSync::overlapped`], the step's forward runs on a model
//! whose parameters carry a backward hook of ours (an autodiff operation, as `SyncBatchNorm`'s),
//! and each bucket is all-reduced **during backward**, as soon as its gradients are complete, as
//! PyTorch DDP does.
//!
//! ```no_run
//! # #[cfg(feature = "burn-0-22")] extern crate burn022 as burn;
//! # #[cfg(feature = "burn-0-23")] extern crate burn023 as burn;
//! use burn::module::Module;
//! use burn::optim::{GradientsParams, Optimizer, SgdConfig};
//! use burn_ddp::{DdpConfig, GradSync, ProcessGroup};
//! # fn model() -> burn::nn::Linear { burn::nn::LinearConfig::new(4, 1).init(&Default::default()) }
//! # fn loss(m: &burn::nn::Linear) -> burn::Tensor<1> {
//! #     m.forward(burn::Tensor::<2>::zeros([2, 4], &Default::default())).mean()
//! # }
//!
//! # fn main() -> burn_ddp::Result<()> {
//! // One process per rank, started by `burn-ddp run` (or torchrun, or srun).
//! let mut sync = GradSync::new(ProcessGroup::from_env()?, DdpConfig::default())?;
//! let mut model = sync.prepare(model())?; // checked across ranks; rank 0's weights everywhere
//! let mut optim = SgdConfig::new().init();
//! // Per step, on this rank's shard of the global batch:
//! let grads = GradientsParams::from_grads(loss(&model).backward(), &model);
//! let grads = sync.sync(&model, grads)?; // the mean over every rank
//! model = optim.step(0.1, model, grads);
//! // The same step with communication overlapped with backward:
//! let overlapped = sync.overlapped(&model)?; // this step's forward runs on it
//! let grads = GradientsParams::from_grads(loss(&overlapped).backward(), &model);
//! let grads = sync.sync(&model, grads)?; // waits for the buckets still in flight
//! model = optim.step(0.1, model, grads);
//! # Ok(()) }
//! ```
//!
//! What [`GradSync::sync`] does: the gradients of the prepared model's trainable parameters,
//! read in a fixed order, are packed into buckets (25 MiB, the first 1 MiB, as PyTorch DDP and
//! the 0.21 line), and each bucket is all-reduced on a communication thread as soon as it is
//! packed, while the next is being packed. Mean or sum; fp16/bf16 on the wire; a parameter that
//! has a gradient on some ranks only gets the reduced value on every rank, one that no rank has
//! a gradient for stays without one. For gradient accumulation, accumulate the micro-steps'
//! gradients locally (Burn's `GradientsAccumulator`) and call `sync` once (overlapped: run the
//! last micro-step on [`GradSync::overlapped_after`]`(&model, accumulated)`).
//!
//! [`nn::SyncBatchNorm`] is Burn's `BatchNorm` with the statistics of the global batch
//! (PyTorch's `SyncBatchNorm`), on the backends of this crate's `flex`, `ndarray` and `cuda`
//! features.
//!
//! [`DistributedSampler`] gives each rank its share of a Burn 0.22 dataset, reshuffled every
//! epoch (`set_epoch`), with the same permutation as the 0.21 line.
//!
//! With burn-train's `SupervisedTraining` (the Learner), [`train::DdpStrategy`] (feature
//! `train`, on by default) does all of this for you, with rank 0's dashboard showing the whole
//! job, sharded validation, rank-0 checkpoints, resume and collective stops:
//! `training.launch_ddp(learner, &DdpStrategy::for_group(pg, device)?)`.
//!
//! How gradients travel: with the `cuda` feature, a model on a CUDA device has its buckets
//! packed on the GPU and all-reduced by NCCL there, out of place (the `cuda` module); everything
//! else is host-staged (read from the device, reduced over the process group's TCP ring or
//! in-process transport, written back to the device), on every backend.
//!
//! Feature `hold-systemstat` (default) holds systemstat below 0.2.8 in your project's resolve,
//! compiling nothing: 0.2.8 breaks burn-train 0.22.1 whenever its `sys-metrics` feature is on
//! (Burn's default features with `train`); `docs/guide.md`, section 1, says when to turn it off.

#![warn(missing_docs, missing_debug_implementations, unreachable_pub)]

#[cfg(not(any(feature = "burn-0-22", feature = "burn-0-23")))]
compile_error!(
    "burn-ddp-gradsync: no Burn release is chosen: turn on feature `burn-0-22` or `burn-0-23` \
     (through `burn-ddp`, the crate to depend on: `burn-ddp = \"0.1\"` is Burn 0.22.1)"
);
#[cfg(all(feature = "burn-0-22", feature = "burn-0-23"))]
compile_error!(
    "burn-ddp-gradsync: features `burn-0-22` and `burn-0-23` are both on, but one build serves one \
     Burn release. `burn-0-22` is a default feature of `burn-ddp`: for Burn 0.23 write `burn-ddp = \
     { version = \"0.1\", default-features = false, features = [\"burn-0-23\", \"train\", \
     \"hold-systemstat\"] }` (`cargo tree -e features -i burn-ddp-gradsync` shows which of your \
     dependencies turns on each)"
);
#[cfg(all(feature = "burn-0-23", feature = "ndarray"))]
compile_error!(
    "burn-ddp-gradsync: Burn 0.23 has no NdArray backend, so feature `ndarray` has nothing to run \
     on with `burn-0-23`: use `flex`, Burn 0.23's CPU backend"
);

// The chosen release's crates under the names the sources use (`use burn::...`): an `extern
// crate` at the root puts its alias in every module's extern prelude.
#[cfg(feature = "burn-0-22")]
extern crate burn022 as burn;
#[cfg(all(feature = "burn-0-23", not(feature = "burn-0-22")))]
extern crate burn023 as burn;
#[cfg(feature = "burn-0-22")]
extern crate burn_pack022 as burn_pack;
#[cfg(all(feature = "burn-0-23", not(feature = "burn-0-22")))]
extern crate burn_pack023 as burn_pack;

mod autodiff;
mod buffers;
#[cfg(feature = "cuda")]
pub mod cuda;
mod data;
// The device transport: NCCL's with `cuda`; over a stand-in link in this crate's tests.
#[cfg(any(feature = "cuda", test))]
mod device;
pub mod fsdp;
mod grads;
mod hook;
mod loop_state;
pub mod nn;
mod overlap;
pub mod pipeline;
#[cfg(all(feature = "train", feature = "burn-0-22"))]
#[path = "progress/burn022.rs"]
mod progress;
#[cfg(all(feature = "train", feature = "burn-0-23", not(feature = "burn-0-22")))]
#[path = "progress/burn023.rs"]
mod progress;
#[cfg(feature = "burn-0-22")]
#[path = "release/burn022.rs"]
mod release;
#[cfg(all(feature = "burn-0-23", not(feature = "burn-0-22")))]
#[path = "release/burn023.rs"]
mod release;
mod sync;
#[cfg(feature = "train")]
pub mod train;
mod zero;

pub use burn_ddp_comm::data::{surviving, DataEpoch, EpochNumber, ShardPlan};
pub use burn_ddp_comm::main_println;
pub use burn_ddp_comm::{comm, config, grad, group, launch, types};
pub use burn_ddp_comm::{
    grad::{LoopState, PowerSgd},
    spawn, CollectiveError, Compression, ConfigError, CudaError, DdpConfig, DdpError,
    GradReduction, GroupConfig, JobError, JobToken, MasterAddr, MembershipError, ModelError,
    ParamInfo, ProcessGroup, Rank, ReduceOp, RendezvousError, Result, Timeouts, WorldSize,
};
pub use data::DistributedSampler;
pub use fsdp::{FsdpConfig, FullyShard};
pub use sync::GradSync;
pub use zero::ZeroOptimizer;
