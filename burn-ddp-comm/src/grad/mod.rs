//! Gradient synchronisation without Burn: what both Burn lines (0.21's `Ddp<B>` and 0.22's
//! gradient sync) share.
//!
//! - `mod.rs`: [`DdpConfig`] and its options ([`GradReduction`], [`Compression`])
//! - `plan.rs`: [`ParamInfo`] and the [`BucketPlan`]: which parameter goes in which bucket
//! - `check.rs`: [`check_same_params`], the cross-rank check of a model's parameters, and
//!   [`ReplicaCheck`], the periodic comparison of their values
//! - `replica.rs`: [`Replica`], what a Burn line gives for a model to be made the same on
//!   every rank, and [`check_and_load`] / [`load_from`], which do it
//! - `join.rs`: [`Join`], uneven inputs: ranks that ran out of batches shadow the others'
//!   collectives until every rank has
//! - `reducer.rs`: [`Pass`], the gradient engine of one synchronised backward pass, over a
//!   [`BucketTransport`] (how a complete bucket travels): every line and transport runs it
//! - `host.rs`: the host-staged transport: [`HostComm`], its communication thread, which
//!   reduces buckets in launch order; [`HostBuckets`], one pass's buckets, packed as f32 and
//!   read back ([`Reduced`]); [`HostSync`], a rank's transport, and [`HostStep`], a step
//!   synchronised after backward
//! - `shared.rs`: [`BucketBuf`], a bucket on the heap or in memory the ranks of a host share,
//!   reduced where it lies (Note [Shared buckets])
//! - `hook.rs`: [`CommHook`], how one bucket is all-reduced (PyTorch's communication hooks):
//!   [`AllReduce`] in f32, fp16 or bf16, or [`PowerSgdState`]; [`reduce_bucket`] for one bucket
//! - `order.rs`: [`LaunchOrder`], the rule by which every transport launches a pass's buckets
//! - `worker.rs`: [`Worker`], the in-order thread each transport's communication runs on
//! - `fsdp.rs`: [`ShardLayout`], FSDP's cut of one parameter on its first dimension among the
//!   ranks, its all-gather ([`gather_in`]) and its gradient's reduce-scatter
//!   ([`reduce_scatter_in`]) in a [`Precision`]; [`FsdpConfig`]; [`global_norm`] over shards;
//!   [`FsdpState`], the sharded parameters by id and the failures kept, which both lines'
//!   `FullyShard` wrap
//! - `zero.rs`: [`ZeroPlan`], ZeRO's owner of each parameter and the all-gather of the
//!   stepped parameters; [`ZeroShards`], the plan by parameter id; [`check_stage2`], what
//!   stage 2 (buckets reduce-scattered over a [sharded](BucketPlan::sharded) plan) refuses
//! - `powersgd.rs`: [`PowerSgd`], low-rank compression of host-staged buckets with error
//!   feedback
//! - `counts.rs`: [`DeviceCounts`], what the device transports' passes cost (operations, host
//!   reads, waits, hand-offs), counted where the work is issued
//! - `drain.rs`: [`DeviceDrain`], the wait for the devices' queued work when a line's gradient
//!   sync ends (with a deadline)
//! - `loop_state.rs`: [`LoopState`], a custom loop's state carried across changes of
//!   membership in a fault-tolerant job, over a line's [`LoopSync`]
//! - `issue.rs`: [`BucketIssuer`] and [`InFlight`], the device transports' issuer thread and the
//!   buckets a pass has handed it, with the rule that a pinned buffer goes only once its
//!   transfer on the [`Queue`] is known finished

mod buffers;
mod check;
mod counts;
mod drain;
mod fsdp;
mod hook;
mod host;
mod issue;
mod join;
mod loop_state;
mod order;
mod plan;
mod powersgd;
mod reducer;
mod replica;
mod shared;
mod worker;
mod zero;

pub use crate::comm::{Queue, DRAIN_LIMIT};
use crate::error::{ConfigError, MembershipError};
pub use buffers::broadcast_buffers;
pub use check::{check_same_params, digest, ReplicaCheck};
pub use counts::{DeviceCounters, DeviceCounts, DeviceWork};
pub use drain::{DeviceDrain, DrainOutcome, DEVICE_DRAIN_LIMIT};
pub use fsdp::{
    checked_clip_norm, gather_in, global_norm, made_sharded_model, reduce_scatter_in,
    refuse_whole_learner, sharded_models, FsdpConfig, FsdpState, Held, Precision, ShardLayout,
    ShardedParam, StateTensor,
};
pub use hook::{reduce_bucket, scatter_bucket, AllReduce, CommHook, CommHookFactory, HookChoice};
pub use host::{plan_key, HostBuckets, HostComm, HostStep, HostSync, Reduced, ANSWER_SLACK};
pub use issue::{BucketIssuer, InFlight};
pub use join::{Join, JoinCall, JoinSlot, JoinSummary, Round};
pub use loop_state::{LoopState, LoopSync};
pub use order::LaunchOrder;
pub use plan::{BucketOrder, BucketPlan, ParamInfo, Piece, Sharding, Slot, StageTwo};
pub use powersgd::{BucketShape, PowerSgd, PowerSgdState, PowerSgdStats};
pub use reducer::{BucketTransport, Pass};
pub use replica::{check_and_load, compare_replicas, load_from, Replica};
pub use shared::BucketBuf;
pub use worker::Worker;
pub use zero::{check_stage2, FlatValues, ReadValues, RunLayout, RunParts, ZeroPlan, ZeroShards};

/// What a fault-tolerant job cannot carry across a change of membership: both lines refuse it
/// at once, saying why and what to use instead.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NotCarried {
    /// PowerSGD compression.
    PowerSgd,
    /// ZeRO-1's sharded optimizer state.
    Zero,
    /// Uneven inputs (`join`).
    Join,
    /// FSDP's sharded parameters.
    Fsdp,
}

impl NotCarried {
    /// Refuses `self` when `pg` is fault-tolerant.
    ///
    /// # Errors
    /// [`MembershipError::NotFaultTolerant`] in a fault-tolerant
    /// group.
    pub fn refuse_on(self, pg: &crate::ProcessGroup) -> crate::Result<()> {
        if !pg.is_fault_tolerant() {
            return Ok(());
        }
        let (what, reason) = match self {
            Self::PowerSgd => (
                "PowerSGD (DdpConfig::with_power_sgd)",
                "its per-rank state (error feedback, the step count that starts compression) \
                 would differ between a joining rank and the others; train uncompressed, or \
                 without --fault-tolerant",
            ),
            Self::Zero => (
                "ZeRO (zero)",
                "each rank holds its own shard of the optimizer state, which a lost rank takes \
                 with it; use the whole optimizer on every rank",
            ),
            Self::Fsdp => (
                "FSDP (FullyShard)",
                "each rank holds the only copy of its shard of every parameter, which a lost \
                 rank takes with it; train with whole replicas (GradSync) under \
                 --fault-tolerant, or FSDP without it",
            ),
            Self::Join => (
                "uneven inputs (join)",
                "a rank that ran out shadows the others' collectives, which a change of \
                 membership would leave unmatched; give every rank the same number of steps \
                 (DistributedSampler)",
            ),
        };
        Err(crate::DdpError::Membership(
            MembershipError::NotFaultTolerant { what, reason },
        ))
    }
}

use crate::config::GradTransport;
use crate::types::ReduceOp;
use crate::{DdpError, Result};

/// How gradients are combined across ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum GradReduction {
    /// The average over ranks (PyTorch DDP's behaviour): the same update as one process on the
    /// whole batch when the loss is a mean over the batch.
    #[default]
    Mean,
    /// The sum over ranks.
    Sum,
}

impl GradReduction {
    /// The collective's reduce operation.
    pub fn op(self) -> ReduceOp {
        match self {
            Self::Mean => ReduceOp::Mean,
            Self::Sum => ReduceOp::Sum,
        }
    }
}

/// Wire format of gradient buckets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Compression {
    /// Full precision (f32).
    #[default]
    None,
    /// Buckets travel and are reduced as IEEE half precision (like PyTorch's fp16 comm hook).
    F16,
    /// Buckets travel and are reduced as bfloat16 (like PyTorch's bf16 comm hook).
    Bf16,
}

/// Options of gradient synchronisation (burn-ddp's `DdpSession` on Burn 0.21, `GradSync` on
/// Burn 0.22). The defaults are PyTorch DDP's.
#[derive(Debug, Clone, PartialEq)]
pub struct DdpConfig {
    /// Largest bucket, in bytes of f32 gradient (PyTorch's `bucket_cap_mb`, 25 MiB).
    pub bucket_cap_bytes: usize,
    /// Largest first bucket (the last parameters, whose gradients are ready first), 1 MiB, so
    /// that communication starts early in backward.
    pub first_bucket_cap_bytes: usize,
    /// Mean or sum.
    pub reduction: GradReduction,
    /// Bucket compression.
    pub compression: Compression,
    /// All-reduce buckets while backward runs (default). `false` all-reduces every bucket, in
    /// order, after backward: slower, but simple to reason about when debugging. (Burn 0.22
    /// cannot overlap backward: its line always synchronises after it.)
    pub overlap: bool,
    /// How buckets of GPU gradients travel (NCCL or host-staged).
    pub transport: GradTransport,
    /// Every this many synchronised steps, the ranks compare digests of their parameters and
    /// fail with [`ModelError::ReplicasDiverged`](crate::ModelError::ReplicasDiverged), naming the first parameter that differs, if
    /// the replicas have drifted apart (0: never). Each check reads every parameter to the host
    /// once and all-reduces two integers per parameter.
    pub check_replicas_every: u64,
    /// Rank 0's buffers (float tensors that take no gradient: BatchNorm's running statistics)
    /// are sent to every rank at each synchronisation of buffers (PyTorch's
    /// `broadcast_buffers=True`, the default); `false` leaves each rank its own.
    pub broadcast_buffers: bool,
    /// PowerSGD compression of the host-staged buckets (`None`: off, the default). Exclusive
    /// with `compression`; buckets then always travel host-staged (`GradTransport::Nccl` is
    /// refused with it).
    pub power_sgd: Option<PowerSgd>,
    /// No second copy of the gradients during synchronisation (PyTorch's
    /// `gradient_as_bucket_view`, default off): on the Burn 0.21 line's host-staged
    /// backward, each gradient's memory is released as soon as it is copied into its bucket,
    /// and a bucket that holds one gradient becomes that gradient again without a copy. (The
    /// Burn 0.22 line's host-staged sync, after backward, always does so: the option changes
    /// nothing there.)
    pub gradient_as_bucket_view: bool,
    /// Your own reduction of each host-staged bucket (PyTorch's `register_comm_hook`; `None`,
    /// the default: the built-in one that `compression` or `power_sgd` choose). Exclusive with
    /// both; buckets then always travel host-staged, as with PowerSGD.
    pub comm_hook: Option<CommHookFactory>,
    /// Host-staged buckets in memory shared by the ranks of a host (default off): when every
    /// rank of the group runs on one host and its collectives go through shared memory, each
    /// gradient is packed straight into a bucket that the other ranks read and write in place,
    /// so a bucket's all-reduce copies nothing into or out of the segment (1.3–4.8× faster
    /// below 16 MiB, about 1.1× above on the 2-core VM; see `docs/design.md`, which also says
    /// why it is not the default). Only with the plain all-reduce (no `compression`,
    /// `power_sgd` or `comm_hook`, which keep heap buckets); elsewhere (TCP, several hosts)
    /// buckets stay on the heap.
    pub shared_buckets: bool,
}

impl Default for DdpConfig {
    fn default() -> Self {
        Self {
            bucket_cap_bytes: 25 << 20,
            first_bucket_cap_bytes: 1 << 20,
            reduction: GradReduction::Mean,
            compression: Compression::None,
            overlap: true,
            transport: GradTransport::Auto,
            check_replicas_every: 100,
            broadcast_buffers: true,
            power_sgd: None,
            gradient_as_bucket_view: false,
            comm_hook: None,
            shared_buckets: false,
        }
    }
}

impl DdpConfig {
    /// Sets the bucket cap in MiB (PyTorch's `bucket_cap_mb`).
    pub fn with_bucket_cap_mb(mut self, mib: f64) -> Self {
        self.bucket_cap_bytes = (mib * (1 << 20) as f64) as usize;
        self
    }

    /// Sets the reduction.
    pub fn with_reduction(mut self, reduction: GradReduction) -> Self {
        self.reduction = reduction;
        self
    }

    /// Sets the compression.
    pub fn with_compression(mut self, compression: Compression) -> Self {
        self.compression = compression;
        self
    }

    /// Chooses between overlapped (default) and after-backward synchronisation.
    pub fn with_overlap(mut self, overlap: bool) -> Self {
        self.overlap = overlap;
        self
    }

    /// Compares the ranks' parameters every `steps` synchronised steps (0: never; default 100).
    pub fn with_replica_check(mut self, steps: u64) -> Self {
        self.check_replicas_every = steps;
        self
    }

    /// Whether rank 0's buffers replace every rank's at each synchronisation of buffers
    /// (default `true`, as PyTorch's `broadcast_buffers`).
    pub fn with_broadcast_buffers(mut self, on: bool) -> Self {
        self.broadcast_buffers = on;
        self
    }

    /// Compresses gradient buckets with PowerSGD (PyTorch's `powerSGD_hook`): see
    /// [`PowerSgd`].
    pub fn with_power_sgd(mut self, power_sgd: PowerSgd) -> Self {
        self.power_sgd = Some(power_sgd);
        self
    }

    /// Whether gradients are released into their buckets (PyTorch's
    /// `gradient_as_bucket_view`; see [`DdpConfig::gradient_as_bucket_view`]).
    pub fn with_gradient_as_bucket_view(mut self, on: bool) -> Self {
        self.gradient_as_bucket_view = on;
        self
    }

    /// Whether host-staged buckets may lie in memory shared by the ranks of a host (default
    /// `false`; see [`DdpConfig::shared_buckets`]).
    pub fn with_shared_buckets(mut self, on: bool) -> Self {
        self.shared_buckets = on;
        self
    }

    /// Reduces every host-staged bucket with your own [`CommHook`] (PyTorch's
    /// `register_comm_hook`): `make` is called for a fresh hook each time a communication
    /// thread starts. The hook is called for every bucket of every step, in index order, on
    /// every rank, with the bucket's values, then one presence flag per parameter (and its
    /// layout, if [`CommHook::wants_layout`] says so); it must all-reduce all of it (flags
    /// included) the same way on every rank.
    pub fn with_comm_hook(
        mut self,
        make: impl Fn() -> Box<dyn CommHook> + Send + Sync + 'static,
    ) -> Self {
        self.comm_hook = Some(CommHookFactory::new(make));
        self
    }

    /// The transport gradients take: `transport`, except that PowerSGD and users' hooks run
    /// on the host-staged buckets, so `Auto` means `Host` with them.
    pub fn effective_transport(&self) -> GradTransport {
        let host_only = self.power_sgd.is_some() || self.comm_hook.is_some();
        match (host_only, self.transport) {
            (true, GradTransport::Auto) => GradTransport::Host,
            (_, t) => t,
        }
    }

    /// Chooses how GPU gradient buckets travel.
    pub fn with_transport(mut self, transport: GradTransport) -> Self {
        self.transport = transport;
        self
    }

    /// The defaults, with what the environment chooses: `BURN_DDP_GRAD_TRANSPORT` (`auto`,
    /// `host` or `nccl`) sets the transport. What the `from_env` constructors (`DdpSession`'s,
    /// `GradSync`'s) use; `new` reads no environment variable.
    ///
    /// # Errors
    /// `BURN_DDP_GRAD_TRANSPORT` holds something else.
    pub fn from_env() -> Result<Self> {
        Self::default().with_env()
    }

    /// `self`, with the environment's choices where `self` leaves them open:
    /// `BURN_DDP_GRAD_TRANSPORT` replaces the transport when it is [`GradTransport::Auto`] (an
    /// explicit `Host` or `Nccl` wins).
    ///
    /// # Errors
    /// `BURN_DDP_GRAD_TRANSPORT` holds something other than `auto`, `host` or `nccl`.
    pub fn with_env(mut self) -> Result<Self> {
        self.transport = crate::config::env::grad_transport(self.transport)?;
        Ok(self)
    }

    /// Checks the options.
    ///
    /// # Errors
    /// [`ConfigError::InvalidConfig`] for a bucket cap below one f32; for a communication hook or
    /// PowerSGD beside each other, beside fp16/bf16 compression, or on `GradTransport::Nccl`;
    /// PowerSGD's own settings out of range.
    pub fn validate(&self) -> Result<()> {
        if self.bucket_cap_bytes < 4 || self.first_bucket_cap_bytes < 4 {
            return Err(DdpError::Config(ConfigError::InvalidConfig {
                field: "DdpConfig::bucket_cap_bytes / first_bucket_cap_bytes",
                reason: "a bucket must hold at least one f32 gradient (4 bytes)",
            }));
        }
        // A user's hook and PowerSGD reduce host-staged buckets themselves: one of them at a
        // time, without fp16/bf16 (the built-in hook they replace), never on NCCL's buckets.
        let host_hook = if self.comm_hook.is_some() {
            if self.power_sgd.is_some() {
                return Err(DdpError::Config(ConfigError::InvalidConfig {
                    field: "DdpConfig::comm_hook",
                    reason: "a communication hook and PowerSGD cannot be combined: choose one",
                }));
            }
            Some((
                "DdpConfig::comm_hook",
                "a communication hook and fp16/bf16 compression cannot be combined: cast inside \
                 the hook",
                "a communication hook runs on host-staged buckets: use GradTransport::Host or \
                 Auto with it, not Nccl",
            ))
        } else if let Some(p) = &self.power_sgd {
            p.validate()?;
            Some((
                "DdpConfig::power_sgd",
                "PowerSGD and fp16/bf16 compression cannot be combined: choose one",
                "PowerSGD runs on host-staged buckets: use GradTransport::Host or Auto with it, \
                 not Nccl",
            ))
        } else {
            None
        };
        if let Some((field, with_compression, with_nccl)) = host_hook {
            let reason = if self.compression != Compression::None {
                Some(with_compression)
            } else if self.transport == GradTransport::Nccl {
                Some(with_nccl)
            } else {
                None
            };
            if let Some(reason) = reason {
                return Err(DdpError::Config(ConfigError::InvalidConfig {
                    field,
                    reason,
                }));
            }
        }
        Ok(())
    }
}
