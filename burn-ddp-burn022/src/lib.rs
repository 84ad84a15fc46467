//! # burn-ddp for Burn 0.22.1
//!
//! Multi-process, multi-node data-parallel training for programs on **Burn 0.22.1**, on the same
//! process group, launcher, store, transports, deadlines and errors as burn-ddp's Burn 0.21
//! line (all from `burn-ddp-comm`).
//!
//! Burn 0.22 routes every tensor through its closed `Dispatch` enum, so a backend decorator
//! such as burn-ddp's `Autodiff<Ddp<B>>` cannot exist there, and gradients cannot be reduced
//! while backward still runs. This line works where 0.22 leaves room: **after backward**, on the
//! `GradientsParams` handed to the optimizer.
//!
//! ```no_run
//! use burn::module::Module;
//! use burn::optim::{GradientsParams, Optimizer, SgdConfig};
//! use burn_ddp_burn022::{DdpConfig, GradSync, ProcessGroup};
//! # fn model() -> burn::nn::Linear { burn::nn::LinearConfig::new(4, 1).init(&Default::default()) }
//! # fn loss(m: &burn::nn::Linear) -> burn::Tensor<1> {
//! #     m.forward(burn::Tensor::<2>::zeros([2, 4], &Default::default())).mean()
//! # }
//!
//! # fn main() -> burn_ddp_burn022::Result<()> {
//! // One process per rank, started by `burn-ddp run` (or torchrun, or srun).
//! let mut sync = GradSync::new(ProcessGroup::from_env()?, DdpConfig::default())?;
//! let mut model = sync.prepare(model())?; // checked across ranks; rank 0's weights everywhere
//! let mut optim = SgdConfig::new().init();
//! // Per step, on this rank's shard of the global batch:
//! let grads = GradientsParams::from_grads(loss(&model).backward(), &model);
//! let grads = sync.sync(&model, grads)?; // the mean over every rank
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
//! gradients locally (Burn's `GradientsAccumulator`) and call `sync` once.
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

mod buffers;
#[cfg(feature = "cuda")]
pub mod cuda;
mod data;
mod fault;
mod grads;
pub mod nn;
pub mod pipeline;
#[cfg(feature = "train")]
mod progress;
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
pub use sync::GradSync;
pub use zero::ZeroOptimizer;
