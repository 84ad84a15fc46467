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
//!
//! ## What a Burn line implements
//!
//! A Burn release is supported by a crate of glue over these modules (`burn-ddp-burn021` for Burn
//! 0.21, `burn-ddp-gradsync` for 0.22.1 and 0.23.0-pre.1; `burn-ddp`, the crate users add,
//! re-exports the one its features choose); everything else is here. The glue is, file by file
//! as in `burn-ddp-gradsync/src/` (most of it Burn's own traits implemented), below. A release
//! whose APIs have the shape of one already supported does not copy it: `burn-ddp-gradsync` is
//! one source built against Burn 0.22 or 0.23 (its features `burn-0-22`, `burn-0-23`), and what
//! differs between the two releases is one file per release in its `src/release/` and
//! `src/progress/`:
//!
//! | What | Over | In the 0.22 line |
//! |---|---|---|
//! | [`grad::Replica`] over the release's module: its float parameters in visit order ([`ParamInfo`]: name, shape, dtype, trainable), their values as bytes, and its record to and from bytes; the core checks them across ranks, loads one rank's record everywhere ([`grad::check_and_load`], [`grad::load_from`]) and compares the replicas' values ([`grad::compare_replicas`]) | [`grad::Replica`] | `sync.rs` (`AsReplica`) |
//! | the wait for the prepared model's devices when the sync ends (a closure over the release's device sync) | [`grad::DeviceDrain`] | `sync.rs` |
//! | uneven inputs: the line's synchronising calls announce, its `join` shadows the others' calls with its own collectives | [`grad::JoinSlot`] | `sync.rs`, `buffers.rs` |
//! | a custom loop in a fault-tolerant job: the model's and optimizer's records as bytes, `prepare` and `reprepare` | [`grad::LoopSync`], [`grad::LoopState`] | `loop_state.rs` (0.21: `ddp/membership.rs`) |
//! | gradients taken and put back by bucket slot, reduced host-staged or on the device | [`grad::BucketPlan`], [`grad::HostSync`], [`grad::ReplicaCheck`] | `sync.rs`, `grads.rs` |
//! | buffers (BatchNorm's running statistics) broadcast, and written back tensor after tensor | [`grad::broadcast_buffers`], [`grad::FlatValues`] | `buffers.rs` |
//! | ZeRO-1: which rank owns which parameters (by id), gradients dropped before the step, gathered values written back, the sharded optimizer state as bytes | [`grad::ZeroShards`], [`grad::ReadValues`] | `zero.rs` |
//! | the NCCL path on the release's device tensors (feature `cuda`): the device pointer behind a cubecl tensor as a `cuda::DeviceSpan`; the core checks the spans and queues the bucket's all-reduce (`cuda::all_reduce_bucket`) | `cuda::connect`, [`grad::BucketLauncher`], `cuda::DeviceSpan` | `cuda.rs` |
//! | `DistributedSampler`: the release's `Dataset` trait | [`distributed_sampler!`], [`data::ShardPlan`] | `data.rs` |
//! | `SyncBatchNorm`: the layer, its forward and the all-reduce of its statistics in the release's autodiff; its configuration from the core | [`sync_batch_norm_config!`] | `nn.rs` |
//! | the pipeline step's tensor work ([`pipeline::StageOps`]: slice, forward, loss, surrogate, backward); the core walks the schedule ([`pipeline::StagePlan::run`]) | [`pipeline`] | `pipeline.rs` |
//! | its tests, in its own `tests/`: the conformance suite (burn-ddp-dev's `conformance::Line`: the four nets and one training run per scenario: plain, accumulated, under the line's `join`, with its ZeRO-1 optimizer; `conformance_suite!` makes the tests), the adapters' checks (burn-ddp-dev's `adapters`: a closure per check in the line's unit tests), the fault-tolerant and multi-node scenarios (`burn_ddp_dev::fault`, `burn_ddp_dev::netns`: the classifier example's, the custom loop's child) | burn-ddp-dev | `tests/integration/` (`equivalence.rs`, `fault_tolerant.rs`, `multinode.rs`), `data.rs`, `train/item.rs` |
//! | the Learner strategy: the epoch loop's traits ([`train::epoch::EpochDriver`]: the two splits, rank 0's checkpoint and early stop, the interrupter; [`train::epoch::SplitSteps`]; [`train::epoch::Handover`] for fault-tolerant jobs: the three records saved into the core's slots and loaded back), step outputs as host parts, checkpoint records as bytes, the renderers of rank 0 and the others | [`train::epoch`], [`train::vote`], [`train::parts`], [`train::files`], [`train::run`], [`train::board`], [`train::progress_text`] | `train/` |
//!
//! Between Burn 0.22's and 0.23's files a duplicate-code scan finds, as unavoidable: the two
//! `progress/` files' progress-logger impls (the same trait methods of two releases, with
//! different signatures: counts against `Progress`) and the migration examples, each a whole user
//! program of its release. Between releases of different shapes the glue is
//! written per line, and a duplicate-code scan finds those places as pairs between the
//! lines (4 between `burn-ddp-burn021/src` and `burn-ddp-gradsync/src`, six or more lines alike). Each
//! is a Burn trait implemented, or a Burn API called, over that release's own types, which no
//! code of the core can name: the renderers (`train/render.rs`: `MetricsRenderer` and its
//! loggers for three types), the `SupervisedLearningStrategy` body (`train/epochs.rs`: the
//! checkpointer, the start, burn-train's events), and the pipeline's `Pipeline` (a type of the
//! line's own, so that its step can be an inherent method) with its step over `StageOps`
//! (`pipeline.rs`), and `DdpTraining::ddp` with its `DdpLaunch` (`train/mod.rs`: a type of the
//! line's own over its `SupervisedTraining`, so that `launch_main` is an inherent method). The logic under each is the core's: what each rank shows and writes
//! ([`train::terminal::RankOutput`]), the batch vote ([`train::vote::load_batch`]), the
//! outputs gathered and merged ([`train::parts::gather_merged`]), the schedule's walk
//! ([`pipeline::StagePlan::run`]). Where the items themselves are the same in every release, a
//! macro of the core writes them in the line's crate ([`distributed_sampler!`],
//! [`sync_batch_norm_config!`]).
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
    Algorithm, EtcdStore, FaultTolerance, GradTransport, GroupConfig, JobToken, MasterAddr,
    Timeouts, Transport,
};
pub use error::{
    CollectiveError, ConfigError, CudaError, DdpError, JobError, MembershipError, ModelError,
    RendezvousError, Result,
};
pub use grad::{Compression, DdpConfig, GradReduction, ParamInfo};
pub use group::{P2pOp, PeerWait, ProcessGroup, Recovery, WeakGroup};
pub use launch::spawn;
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
