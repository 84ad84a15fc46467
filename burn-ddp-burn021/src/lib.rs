//! # burn-ddp for Burn 0.21
//!
//! Distributed data parallel training for [Burn](https://burn.dev) 0.21: one process per device,
//! on one machine or many, with PyTorch-DDP semantics and torchrun-compatible launching.
//!
//! Add it as `burn-ddp` with feature `burn-0-21` (`burn-ddp = { version = "0.1",
//! default-features = false, features = ["burn-0-21", "train", "hold-systemstat"] }`): that crate
//! re-exports this one, so a program writes `use burn_ddp::...` on every Burn release.
//!
//! ## Quick start
//!
//! 1. Join the job: [`ProcessGroup::from_env`] reads `RANK`, `WORLD_SIZE`, `MASTER_ADDR`, ... as
//!    set by `burn-ddp run`, `torchrun --no-python` or Slurm's `srun`.
//! 2. Run collectives: [`ProcessGroup::all_reduce`], [`ProcessGroup::broadcast`],
//!    [`ProcessGroup::all_gather`], [`ProcessGroup::reduce_scatter`], [`ProcessGroup::barrier`].
//!
//! ```no_run
//! # extern crate burn_ddp_burn021 as burn_ddp;
//! use burn_ddp::{ProcessGroup, ReduceOp};
//!
//! let pg = ProcessGroup::from_env()?;
//! let mut x = vec![pg.rank().0 as f32; 4];
//! pg.all_reduce(&mut x, ReduceOp::Sum)?;
//! # Ok::<(), burn_ddp::DdpError>(())
//! ```
//!
//! ## Two crates
//!
//! Everything that moves bytes and manages processes — ranks, the rendezvous store, the TCP and
//! NCCL communicators, the process group, the launcher — lives in
//! [`burn_ddp_comm`], which does not depend on Burn. This crate
//! adds the Burn integration and re-exports what its users need, so `burn_ddp::ProcessGroup`,
//! `burn_ddp::group`, `burn_ddp::launch`, ... keep working.
//!
//! ## Modules
//!
//! Burn integration (this crate):
//!
//! - `backend/` — [`Ddp`], the backend decorator (`forward.rs`: the generated forwarding,
//!   `convert.rs`: tensor conversions, `mod.rs`: the gradient hooks)
//! - `ddp/` — [`DdpSession`], [`DdpConfig`], [`DdpModule`] (`model.rs`: checks and broadcast of
//!   the model, `reducer/`: the bucketed reducer, `hooks.rs`: the gradient hooks,
//!   `buffers.rs`: `sync_buffers`, `join.rs`: uneven inputs, `zero.rs`: [`ZeroOptimizer`])
//! - [`nn`] — [`SyncBatchNorm`](nn::SyncBatchNorm): BatchNorm over the global batch
//! - [`pipeline`] — pipeline parallelism ([`Pipeline`](pipeline::Pipeline): GPipe and 1F1B over
//!   micro-batches) and hybrid layouts ([`HybridLayout`](pipeline::HybridLayout))
//! - [`checkpoint`] — saving and loading Burn modules atomically
//! - [`data`] — [`DistributedSampler`]: each rank's shard of a Burn dataset
//! - `train` — [`DdpStrategy`](train::DdpStrategy) for burn-train's Learner (feature `train`)
//! - `cuda` — the zero-copy NCCL gradient path of `Autodiff<Ddp<Cuda>>` (feature `cuda`)
//!
//! Re-exported from burn-ddp-comm:
//!
//! - [`group`] — the process group: rendezvous, collectives, heartbeat, store handle, sub-groups
//!   ([`ProcessGroup::new_group`], [`ProcessGroup::split`]), point-to-point
//!   ([`ProcessGroup::send`], [`ProcessGroup::recv`], [`ProcessGroup::batch_send_recv`])
//! - [`comm`] — communicators (TCP ring between processes, shared memory between threads)
//! - [`types`] — ranks, collective descriptions, abort records
//! - [`config`] — configuration types, and [`config::env`], the one module that reads the
//!   environment
//! - [`launch`] — `spawn`, the launcher and the bandwidth tool
//!
//! ## Features
//!
//! - `train` (default): [`DdpStrategy`](train::DdpStrategy) for burn-train's Learner.
//! - `cuda`: NCCL through cudarc for `Autodiff<Ddp<Cuda>>`; `fusion`: the same with Burn's
//!   fusion and autotuning (what `burn = { features = ["cuda"] }` gives).
//! - `hold-systemstat` (default): holds systemstat below 0.2.8 in your project's resolve,
//!   compiling nothing: 0.2.8 breaks burn-train 0.21.0 whenever its `sys-metrics` feature is on
//!   (Burn's default features with `train`). `docs/guide.md`, section 1, says when to turn it off.
//!
//! ## Never a silent hang
//!
//! Every blocking wait has a deadline ([`Timeouts`], 10 minutes by default, `BURN_DDP_TIMEOUT` to
//! change). A rank that dies, stalls or calls a different collective is reported on every other
//! rank by name, with the collective's sequence number.

#![cfg_attr(docsrs, feature(doc_cfg))]
#![warn(missing_docs, missing_debug_implementations, unreachable_pub)]

mod backend;
pub mod checkpoint;
#[cfg(feature = "cuda")]
#[cfg_attr(docsrs, doc(cfg(feature = "cuda")))]
pub mod cuda;
pub mod data;
mod ddp;
pub mod fsdp;
pub mod nn;
#[cfg(feature = "train")]
#[cfg_attr(docsrs, doc(cfg(feature = "train")))]
pub mod train;

pub mod pipeline;

pub use burn_ddp_comm::{comm, config, grad, group, launch, types};

#[cfg(feature = "cuda")]
pub use backend::DdpCuda;
pub use burn_ddp_comm::data::{surviving, EpochNumber, ShardPlan};
pub use burn_ddp_comm::main_println;
pub use burn_ddp_comm::{
    spawn, CollectiveError, CollectiveOp, ConfigError, CudaError, DType, DdpError, Element,
    FaultTolerance, GradTransport, GroupConfig, JobError, JobToken, LocalRank, MasterAddr,
    MembershipError, ModelError, P2pOp, PeerWait, ProcessGroup, Rank, Recovery, ReduceOp,
    RendezvousError, Result, Timeouts, WireError, WorldSize,
};
/// `#[ddp]`: see [`DdpModule`].
pub use burn_ddp_macros::ddp;
pub use data::{DataEpoch, DistributedSampler};
pub use ddp::{
    Compression, Ddp, DdpAutodiffBackend, DdpConfig, DdpModule, DdpSession, GradReduction,
    LoopState, NoSyncGuard, ParamInfo, PowerSgd, ZeroOptimizer,
};
pub use fsdp::{FsdpConfig, FullyShard};

/// What a training program needs, in one import: `use burn_ddp::prelude::*;`.
pub mod prelude {
    #[cfg(feature = "train")]
    pub use crate::train::{DdpStrategy, DdpTraining};
    pub use crate::{
        ddp, Ddp, DdpAutodiffBackend, DdpConfig, DdpError, DdpModule, DdpSession,
        DistributedSampler, ProcessGroup,
    };
}
