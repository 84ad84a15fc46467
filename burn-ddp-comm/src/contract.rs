//! The contract between the core and a Burn line's crate (`burn-ddp-burn021` for Burn 0.21,
//! `burn-ddp-gradsync` for 0.22.1 and 0.23.0-pre.1): what a line implements over its release's
//! types, and what of the core it calls. **Not part of the stable API.** These items are public
//! because the line crates are other crates; they change with the lines, in any release, and
//! wherever else they can be reached (`grad`, `train`, `pipeline`, `cuda`) they are the same
//! items under the same rule. A program that trains with burn-ddp uses `burn-ddp`'s API, never
//! these.
//!
//! A release whose APIs have the shape of one already supported does not copy a line:
//! `burn-ddp-gradsync` is one source built against Burn 0.22 or 0.23 (its features `burn-0-22`,
//! `burn-0-23`), and what differs between the two releases is one file per release in its
//! `src/release/` and `src/progress/`. The glue, file by file as in `burn-ddp-gradsync/src/`
//! (most of it Burn's own traits implemented):
//!
//! | What | Over | In the 0.22 line |
//! |---|---|---|
//! | [`grad::Replica`](crate::grad::Replica) over the release's module: its float parameters in visit order ([`ParamInfo`]: name, shape, dtype, trainable), their values as bytes, and its record to and from bytes; the core checks them across ranks, loads one rank's record everywhere ([`grad::check_and_load`](crate::grad::check_and_load), [`grad::load_from`](crate::grad::load_from)) and compares the replicas' values ([`grad::compare_replicas`](crate::grad::compare_replicas)) | [`grad::Replica`](crate::grad::Replica) | `sync.rs` (`AsReplica`) |
//! | the wait for the prepared model's devices when the sync ends (a closure over the release's device sync) | [`grad::DeviceDrain`](crate::grad::DeviceDrain) | `sync.rs` |
//! | uneven inputs: the line's synchronising calls announce, its `join` shadows the others' calls with its own collectives | [`grad::JoinSlot`](crate::grad::JoinSlot) | `sync.rs`, `buffers.rs` |
//! | a custom loop in a fault-tolerant job: the model's and optimizer's records as bytes, `prepare` and `reprepare` | [`grad::LoopSync`](crate::grad::LoopSync), [`grad::LoopState`](crate::grad::LoopState) | `loop_state.rs` (0.21: `ddp/membership.rs`) |
//! | gradients taken and put back by bucket slot, reduced host-staged or on the device | [`grad::BucketPlan`](crate::grad::BucketPlan), [`grad::HostSync`](crate::grad::HostSync), [`grad::ReplicaCheck`](crate::grad::ReplicaCheck) | `sync.rs`, `grads.rs` |
//! | buffers (BatchNorm's running statistics) broadcast, and written back tensor after tensor | [`grad::broadcast_buffers`](crate::grad::broadcast_buffers), [`grad::FlatValues`](crate::grad::FlatValues) | `buffers.rs` |
//! | ZeRO-1 and 2: which rank owns which parameters (by id), gradients dropped before the step, gathered values written back (a run's layout on a device path), the sharded optimizer state as bytes | [`grad::ZeroShards`](crate::grad::ZeroShards), [`grad::ReadValues`](crate::grad::ReadValues), [`grad::RunLayout`](crate::grad::RunLayout) | `zero.rs` |
//! | the NCCL path on the release's device tensors (feature `cuda`): the device pointer behind a cubecl tensor as a `cuda::DeviceSpan`; the core checks the spans and queues the bucket's all-reduce or reduce-scatter (`cuda::reduce_bucket`), and a ZeRO run's all-gather (`cuda::all_gather_blocks`) | `cuda::connect_for_grads`, [`grad::BucketIssuer`](crate::grad::BucketIssuer), `cuda::DeviceSpan` | `cuda.rs` |
//! | the device transport: buckets packed, flagged and unpacked in the release's tensors, over a link (NCCL's; the unit tests' stand-in on a CPU backend), its work counted | [`grad::BucketTransport`](crate::grad::BucketTransport), [`grad::Pass`](crate::grad::Pass), [`grad::DeviceCounters`](crate::grad::DeviceCounters) | `device.rs` (0.21: `ddp/device.rs`) |
//! | `DistributedSampler`: the release's `Dataset` trait | [`distributed_sampler!`](crate::distributed_sampler!), [`data::ShardPlan`](crate::data::ShardPlan) | `data.rs` |
//! | `SyncBatchNorm`: the layer, its forward and the all-reduce of its statistics in the release's autodiff; its configuration from the core | [`sync_batch_norm_config!`](crate::sync_batch_norm_config!) | `nn.rs` |
//! | the pipeline step's tensor work ([`pipeline::StageOps`](crate::pipeline::StageOps): slice, forward, loss, surrogate, backward); the core walks the schedule ([`pipeline::StagePlan::run`](crate::pipeline::StagePlan::run)) | [`pipeline`](crate::pipeline) | `pipeline.rs` |
//! | its tests, in its own `tests/`: the conformance suite (burn-ddp-dev's `conformance::Line`: the nets and one training run per scenario: plain, accumulated, under the line's `join`, with its ZeRO-1 optimizer; `conformance_suite!` makes the tests), the adapters' checks (burn-ddp-dev's `adapters`: a closure per check in the line's unit tests), the fault-tolerant and multi-node scenarios (`burn_ddp_dev::fault_tolerance`, `burn_ddp_dev::netns`: the classifier example's, the custom loop's child) | burn-ddp-dev | `tests/integration/` (`equivalence.rs`, `fault_tolerant.rs`, `multinode.rs`), `data.rs`, `train/item.rs` |
//! | the Learner strategy: the epoch loop's traits ([`train::epoch::EpochDriver`](crate::train::epoch::EpochDriver): the two splits, rank 0's checkpoint and early stop, the interrupter; [`train::epoch::SplitSteps`](crate::train::epoch::SplitSteps); [`train::epoch::Handover`](crate::train::epoch::Handover) for fault-tolerant jobs: the three records saved into the core's slots and loaded back), step outputs as host parts, checkpoint records as bytes, the renderers of rank 0 and the others | [`train::epoch`](crate::train::epoch), [`train::vote`](crate::train::vote), [`train::parts`](crate::train::parts), [`train::files`](crate::train::files), [`train::run`](crate::train::run), [`train::board`](crate::train::board), [`train::progress_text`](crate::train::progress_text) | `train/` |
//!
//! The gradient path in particular: a line gives each final gradient to the core's engine
//! ([`Pass`]) over a [`BucketTransport`]: the core's host-staged [`HostSync`], or the line's
//! device transport (packing, presence flags and unpacking in the release's tensors, over a
//! link whose issuer is the core's [`BucketIssuer`]), which counts its work in
//! [`DeviceCounters`]. The two macros a line writes its items with are at the crate's root
//! ([`distributed_sampler!`](crate::distributed_sampler!),
//! [`sync_batch_norm_config!`](crate::sync_batch_norm_config!)).

pub use crate::data::ShardPlan;
pub use crate::grad::{
    broadcast_buffers, check_and_load, compare_replicas, load_from, BucketIssuer, BucketPlan,
    BucketTransport, DeviceCounters, DeviceCounts, DeviceDrain, DeviceWork, FlatValues, HostSync,
    InFlight, JoinSlot, LoopState, LoopSync, Pass, Queue, ReadValues, Replica, ReplicaCheck,
    ZeroShards,
};
pub use crate::pipeline::{StageOps, StagePlan};
pub use crate::train::epoch::{EpochDriver, Handover, SplitSteps};
pub use crate::train::{board, epoch, files, parts, progress_text, run, vote};
pub use crate::ParamInfo;

/// The NCCL half of the contract (feature `cuda`): a line finds the device pointer behind its
/// release's tensor and hands it over as a [`DeviceSpan`](crate::cuda::DeviceSpan); the core
/// checks it and queues the bucket's reduction, or a ZeRO run's all-gather.
#[cfg(feature = "cuda")]
pub mod cuda {
    pub use crate::cuda::{
        all_gather_blocks, connect_for_grads, reduce_bucket, BucketBuffer, BucketCall, DeviceSpan,
    };
}
