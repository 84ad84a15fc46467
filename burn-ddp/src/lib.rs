//! # burn-ddp
//!
//! Distributed data parallel training for [Burn](https://burn.dev): one process per device, on one
//! machine or many, with PyTorch-DDP semantics and torchrun-compatible launching.
//!
//! ## Quick start
//!
//! 1. Join the job: [`ProcessGroup::from_env`] reads `RANK`, `WORLD_SIZE`, `MASTER_ADDR`, ... as
//!    set by `burn-ddp run`, `torchrun --no-python` or Slurm's `srun`.
//! 2. Run collectives: [`ProcessGroup::all_reduce`], [`ProcessGroup::broadcast`],
//!    [`ProcessGroup::all_gather`], [`ProcessGroup::reduce_scatter`], [`ProcessGroup::barrier`].
//!
//! ```no_run
//! use burn_ddp::{ProcessGroup, ReduceOp};
//!
//! let pg = ProcessGroup::from_env()?;
//! let mut x = vec![pg.rank().0 as f32; 4];
//! pg.all_reduce(&mut x, ReduceOp::Sum)?;
//! # Ok::<(), burn_ddp::DdpError>(())
//! ```
//!
//! ## Modules
//!
//! - [`group`] — ranks, the process group, the rendezvous store
//! - [`comm`] — communicators (TCP ring between processes, shared memory between threads)
//! - [`launch`] — the environment contract and the `burn-ddp` launcher
//! - [`config`] — configuration types
//! - [`checkpoint`] — atomic checkpoint files
//! - [`data`] — [`DistributedSampler`]: each rank's shard of a Burn dataset
//! - `cuda` — CUDA and NCCL through cudarc (feature `cuda`)
//!
//! ## Never a silent hang
//!
//! Every blocking wait has a deadline ([`Timeouts`], 10 minutes by default, `BURN_DDP_TIMEOUT` to
//! change). A rank that dies, stalls or calls a different collective is reported on every other
//! rank by name, with the collective's sequence number.

#![warn(
    missing_docs,
    missing_debug_implementations,
    unreachable_pub,
    rust_2018_idioms
)]
#![deny(unused_must_use)]

mod backend;
pub mod checkpoint;
pub mod comm;
pub mod config;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod data;
mod ddp;
mod error;
#[cfg(feature = "fuzzing")]
#[doc(hidden)]
pub mod fuzzing;
pub mod group;
pub mod launch;
#[cfg(feature = "train")]
pub mod train;
pub(crate) mod wire;

pub use backend::Ddp;
#[cfg(feature = "cuda")]
pub use backend::DdpCuda;
/// `#[ddp]`: see [`DdpModule`].
pub use burn_ddp_macros::ddp;
pub use comm::{CollectiveOp, DType, Element, ReduceOp};
pub use config::{GroupConfig, JobToken, MasterAddr, Timeouts};
pub use data::{DataEpoch, DistributedSampler};
pub use ddp::{
    Compression, DdpConfig, DdpModule, DdpSession, GradReduction, GradTransport, NoSyncGuard,
    ParamInfo,
};
pub use error::{DdpError, Result};
pub use group::{LocalRank, PeerWait, ProcessGroup, Rank, WorldSize};
pub use launch::spawn;
pub use wire::WireError;
