//! # burn-ddp for Burn 0.23
//!
//! Multi-process, multi-node data-parallel training for programs on **Burn 0.23**
//! (0.23.0-pre.1), on the same process group, launcher, store, transports, deadlines and
//! errors as burn-ddp's other lines (all from `burn-ddp-comm`).
//!
//! Burn 0.23, as 0.22, routes every tensor through its closed `Dispatch` enum, and its
//! gradient-sync hooks reach only the backends of its own catalog, so gradients cannot be
//! reduced while backward runs (`docs/design.md`, "Burn 0.23"). This line works **after
//! backward**, on the `GradientsParams` handed to the optimizer, exactly as the 0.22 line:
//!
//! ```no_run
//! use burn::module::Module;
//! use burn::optim::{GradientsParams, Optimizer, SgdConfig};
//! use burn_ddp_burn023::{DdpConfig, GradSync, ProcessGroup};
//! # fn model() -> burn::nn::Linear { burn::nn::LinearConfig::new(4, 1).init(&Default::default()) }
//! # fn loss(m: &burn::nn::Linear) -> burn::Tensor<1> {
//! #     m.forward(burn::Tensor::<2>::zeros([2, 4], &Default::default())).mean()
//! # }
//!
//! # fn main() -> burn_ddp_burn023::Result<()> {
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
//! **One source for two releases.** Burn 0.23 kept the module, gradient, record, dataset and
//! optimizer APIs this glue uses from 0.22, so this crate compiles burn-ddp-burn022's sources
//! (`../burn-ddp-burn022/src/`) against Burn 0.23; what differs between the two releases is in
//! this crate's own `release.rs` and `progress.rs` (burn-train 0.23's split events and progress
//! loggers, which carry a `Progress` instead of counts; the backends `SyncBatchNorm` can run
//! on). Everything
//! the 0.22 line offers is here: [`GradSync`] (buckets, mean or sum, fp16/bf16 on the wire,
//! presence semantics, accumulation), [`nn::SyncBatchNorm`] (on this crate's `flex` feature),
//! [`DistributedSampler`], [`train::DdpStrategy`] for burn-train's `SupervisedTraining` (rank
//! 0's dashboard showing the whole job, sharded validation, rank-0 checkpoints, resume,
//! collective stops, fault-tolerant jobs), buffers, `join`, ZeRO-1 ([`ZeroOptimizer`]) and
//! [`pipeline`]s, and the NCCL path (features `cuda`, `fusion`, `cuda-cpp`): with `cuda`, a
//! model on a CUDA device has its buckets packed on the GPU and all-reduced by NCCL there (the
//! `cuda` module). Burn 0.23's CUDA runtime links LLVM: run `scripts/offline-llvm.sh` once
//! before building it without network. That path is built and linked in CI but has not yet
//! run on a GPU on this line.
//!
//! Feature `hold-systemstat` (default) holds systemstat below 0.2.8 in your project's resolve,
//! compiling nothing: 0.2.8 breaks burn-train 0.23.0-pre.1 whenever its `sys-metrics` feature
//! is on (Burn's default features with `train`); `docs/guide.md`, section 1, says when to turn
//! it off.

#![warn(missing_docs, missing_debug_implementations, unreachable_pub)]

#[path = "../../burn-ddp-burn022/src/buffers.rs"]
mod buffers;
#[cfg(feature = "cuda")]
#[path = "../../burn-ddp-burn022/src/cuda.rs"]
pub mod cuda;
#[path = "../../burn-ddp-burn022/src/data.rs"]
mod data;
#[path = "../../burn-ddp-burn022/src/fault.rs"]
mod fault;
#[path = "../../burn-ddp-burn022/src/grads.rs"]
mod grads;
#[path = "../../burn-ddp-burn022/src/nn.rs"]
pub mod nn;
#[path = "../../burn-ddp-burn022/src/pipeline.rs"]
pub mod pipeline;
#[cfg(feature = "train")]
mod progress;
mod release;
#[path = "../../burn-ddp-burn022/src/sync.rs"]
mod sync;
#[cfg(feature = "train")]
#[path = "../../burn-ddp-burn022/src/train/mod.rs"]
pub mod train;
#[path = "../../burn-ddp-burn022/src/zero.rs"]
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
