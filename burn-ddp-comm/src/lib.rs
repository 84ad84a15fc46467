//! # burn-ddp-comm
//!
//! The communication layer of [burn-ddp](https://docs.rs/burn-ddp), with no dependency on Burn:
//! everything that moves bytes between processes and manages them. burn-ddp builds its Burn
//! integration (`Ddp<B>`, the gradient reducer, `DdpStrategy`) on top of it, and one copy of this
//! crate serves every Burn release burn-ddp supports.
//!
//! 1. Join the job: [`ProcessGroup::from_env`] reads `RANK`, `WORLD_SIZE`, `MASTER_ADDR`, ... as
//!    set by `burn-ddp run`, `torchrun --no-python` or Slurm's `srun`.
//! 2. Run collectives: [`ProcessGroup::all_reduce`], [`ProcessGroup::broadcast`],
//!    [`ProcessGroup::all_gather`], [`ProcessGroup::reduce_scatter`], [`ProcessGroup::barrier`],
//!    and on bytes [`ProcessGroup::broadcast_bytes`], [`ProcessGroup::all_gather_bytes`].
//! 3. Sub-groups ([`ProcessGroup::new_group`], [`ProcessGroup::split`]) and point-to-point
//!    messages ([`ProcessGroup::send`], [`ProcessGroup::recv`], [`ProcessGroup::batch_send_recv`]).
//!
//! ```no_run
//! use burn_ddp_comm::{ProcessGroup, ReduceOp};
//!
//! let pg = ProcessGroup::from_env()?;
//! let mut x = vec![pg.rank().0 as f32; 4];
//! pg.all_reduce(&mut x, ReduceOp::Sum)?;
//! # Ok::<(), burn_ddp_comm::DdpError>(())
//! ```
//!
//! ## Layers
//!
//! Each module uses only the ones above it in this list:
//!
//! - `wire` — byte framing and the protocol version (internal)
//! - [`types`] — ranks, collective descriptions, element types, abort records
//! - [`error`] and [`config`] — the one error type, the settings, and [`config::env`], the only
//!   module that reads environment variables
//! - `store` — the authenticated rendezvous store ([`group::Store`]) and the job's abort record
//! - [`comm`] — communicators: the TCP ring between processes, shared memory between threads
//! - [`group`] — the process group: rendezvous, desync checks, heartbeats, byte collectives
//! - [`data`] — which items of a dataset are this rank's (`ShardPlan`, the logic of both Burn
//!   lines' `DistributedSampler`)
//! - [`grad`] — gradient synchronisation without Burn: the bucket plan, the cross-rank model
//!   check, the gradient engine of a pass ([`grad::Pass`]) over a [`grad::BucketTransport`]
//!   (every line and transport runs it), host-staged buckets reduced on a communication thread
//! - [`pipeline`] — pipeline schedules (GPipe, 1F1B), micro-batches, activations on the wire, one
//!   step over a line's tensors
//! - [`train`] — the Burn-free half of both lines' Learner strategy: the epoch loop, the ranks'
//!   votes before each step, output items gathered for the metrics, rank 0's checkpoint files
//! - `cuda` — NCCL communicators on device memory, through cudarc (feature `cuda`)
//! - [`launch`] — `spawn`, the `burn-ddp` launcher, the bandwidth tool
//! - [`checkpoint`] — atomic checkpoint files
//! - [`contract`] — the contract a Burn line's crate implements (not a stable API)
//!
//! ## What a Burn line implements
//!
//! A Burn release is supported by a crate of glue over these modules (`burn-ddp-burn021` for Burn
//! 0.21, `burn-ddp-gradsync` for 0.22.1 and 0.23.0-pre.1; `burn-ddp`, the crate users add,
//! re-exports the one its features choose); everything else is here. The glue implements the
//! core's traits over the release's types (a module's parameters and records, its device
//! tensors, its Learner's splits and renderers) and calls the core for everything else: which
//! rank holds what, what goes over the wire, in which order, with which deadline. [`contract`]
//! gathers that contract, item by item and file by file, and is **not part of the stable API**:
//! it changes with the lines that use it.
//!
//! ## Features
//!
//! - `cuda`: NCCL communicators over cudarc (loaded at run time: builds without a CUDA toolkit).
//! - `cli`: the `burn-ddp` command (`run`, `bench all-reduce`); brings clap and
//!   tracing-subscriber.
//! - `fuzzing`: entry points for the fuzz targets (not a public API).
//!
//! ## Never a silent hang
//!
//! Every blocking wait has a deadline ([`Timeouts`], 10 minutes by default, `BURN_DDP_TIMEOUT` to
//! change). A rank that dies, stalls or calls a different collective is reported on every other
//! rank by name, with the collective's sequence number.

#![cfg_attr(docsrs, feature(doc_cfg))]
#![warn(missing_docs, missing_debug_implementations, unreachable_pub)]

pub mod checkpoint;
pub mod comm;
pub mod config;
pub mod contract;
#[cfg(feature = "cuda")]
#[cfg_attr(docsrs, doc(cfg(feature = "cuda")))]
pub mod cuda;
pub mod data;
pub mod error;
#[cfg(feature = "fuzzing")]
#[doc(hidden)]
pub mod fuzzing;
pub mod grad;
pub mod group;
pub mod launch;
pub mod nn;
mod periodic;
pub mod pipeline;
mod store;
mod sys;
pub mod train;
pub mod types;
mod wire;

pub use config::{
    Algorithm, EtcdSecurity, EtcdStore, FaultTolerance, GradTransport, GroupConfig, JobToken,
    MasterAddr, Timeouts, Transport,
};
pub use error::{
    CollectiveError, ConfigError, CudaError, DdpError, JobError, MembershipError, ModelError,
    RendezvousError, Result,
};
pub use grad::{Compression, DdpConfig, GradReduction, ParamInfo};
pub use group::{P2pOp, PeerWait, ProcessGroup, Recovery, WeakGroup};
pub use launch::spawn;
pub use store::StoreTraffic;
pub use types::{CollectiveOp, DType, Element, LocalRank, Rank, ReduceOp, WorldSize};
pub use wire::WireError;

/// `println!` on rank 0 only, for a training loop of your own: the job prints each line once.
/// Rank 0 of the job this process joined ([`group::is_main_process`]: the last
/// [`ProcessGroup::init`] or `from_env`, the current membership's in a fault-tolerant job);
/// a process that has joined no job prints. The arguments are evaluated on every rank, so a
/// collective among them (the job's mean loss, [`ProcessGroup::mean`]) runs everywhere, and
/// only rank 0 prints.
///
/// ```no_run
/// # fn doc(pg: &burn_ddp_comm::ProcessGroup, epoch: usize, loss: f32) {
/// burn_ddp_comm::main_println!(
///     "[Train - Epoch {epoch}] Loss {:.3}",
///     pg.mean(loss).expect("the job's loss"),
/// );
/// # }
/// ```
#[macro_export]
macro_rules! main_println {
    ($($arg:tt)*) => {{
        let line = ::std::format!($($arg)*);
        if $crate::group::is_main_process() {
            ::std::println!("{line}");
        }
    }};
}
