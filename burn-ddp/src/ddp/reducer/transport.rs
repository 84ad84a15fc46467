//! How a complete bucket travels, the one thing the host and the device paths do differently in
//! the reducer's state machine (the parent module): [`BucketTransport`], the host-staged buckets
//! and their communication thread (which all-reduces them one after another, in launch order),
//! and the links a launch needs from the reducer. The device path's buckets are `gpu.rs`'s.

use std::sync::Arc;

use burn_ddp_comm::grad::{self, BucketShape, PowerSgd, PowerSgdState, PowerSgdStats, Worker};

use super::super::{Compression, GradReduction};
use crate::group::ProcessGroup;
#[cfg(feature = "cuda")]
use crate::ReduceOp;
use crate::{DdpError, Result};

/// The buckets of one pass, by how they travel.
#[derive(Debug)]
pub(super) enum Buckets {
    /// Host-staged: f32 buffers filled from each gradient, reduced by the communication thread
    /// over the process group's transport.
    Host(HostBuckets),
    /// On the GPU: Burn's tensors packed per bucket and reduced by NCCL (`gpu.rs`).
    #[cfg(feature = "cuda")]
    Device(super::super::gpu::DeviceStep),
}

impl Buckets {
    pub(super) fn transport(&mut self) -> &mut dyn BucketTransport {
        match self {
            Buckets::Host(h) => h,
            #[cfg(feature = "cuda")]
            Buckets::Device(d) => d,
        }
    }
}

#[derive(Debug)]
pub(super) struct HostBuckets {
    pub(super) buffers: Vec<Option<Vec<f32>>>,
    pub(super) results: Vec<Option<Vec<f32>>>,
    pub(super) outstanding: usize,
}

/// What launching a bucket needs from the reducer: the transports' long-lived parts.
pub(crate) struct Links<'a> {
    pub(super) pg: &'a ProcessGroup,
    pub(super) reduction: GradReduction,
    pub(super) compression: Compression,
    pub(super) comm: &'a mut Option<Comm>,
    /// PowerSGD's settings and counts, when it is on (for the communication thread).
    pub(super) power_sgd: Option<(PowerSgd, Arc<PowerSgdStats>)>,
    /// The layout of the bucket being launched, for PowerSGD.
    pub(super) shape: Option<BucketShape>,
    #[cfg(feature = "cuda")]
    pub(super) nccl: Option<(
        &'a burn_ddp_comm::cuda::NcclComm,
        &'a super::super::gpu::NcclLauncher,
    )>,
}

#[cfg(feature = "cuda")]
impl Links<'_> {
    pub(crate) fn op(&self) -> ReduceOp {
        self.reduction.op()
    }

    pub(crate) fn compression(&self) -> Compression {
        self.compression
    }

    /// The NCCL communicator and its launcher thread (set up by `prepare`).
    #[cfg(feature = "cuda")]
    pub(crate) fn nccl(
        &self,
    ) -> Result<(
        &burn_ddp_comm::cuda::NcclComm,
        &super::super::gpu::NcclLauncher,
    )> {
        self.nccl.ok_or(DdpError::NotInitialized {
            what: "the NCCL communicator of the device path",
            fix: "call DdpSession::prepare (or train through DdpStrategy) before backward",
        })
    }
}

/// How a complete bucket travels: the one thing the host and the device paths do differently
/// in the reducer's state machine.
pub(crate) trait BucketTransport {
    /// Hands over bucket `bucket`, whose slots (with their lengths, in offset order) are all
    /// final. Buckets come strictly in index order.
    fn launch(
        &mut self,
        links: &mut Links<'_>,
        bucket: usize,
        slots: &[(usize, usize)],
    ) -> Result<()>;
}

/// The device path (`gpu.rs`): the bucket is queued on the NCCL launcher thread.
#[cfg(feature = "cuda")]
impl BucketTransport for super::super::gpu::DeviceStep {
    fn launch(
        &mut self,
        links: &mut Links<'_>,
        bucket: usize,
        slots: &[(usize, usize)],
    ) -> Result<()> {
        let (comm, launcher) = links.nccl()?;
        let ordinal = comm.device_ordinal();
        self.queue(
            launcher,
            ordinal,
            bucket,
            slots,
            links.op(),
            links.compression(),
        )
    }
}

impl BucketTransport for HostBuckets {
    fn launch(
        &mut self,
        links: &mut Links<'_>,
        bucket: usize,
        _slots: &[(usize, usize)],
    ) -> Result<()> {
        let Some(data) = self.buffers[bucket].take() else {
            return Ok(());
        };
        if links.comm.is_none() {
            *links.comm = Some(start_comm(
                links.pg.clone(),
                links.reduction,
                links.compression,
                links.power_sgd.clone(),
            )?);
        }
        let shape = links.shape.take();
        let sent = links.comm.as_ref().is_some_and(|c| {
            c.send(HostBucketJob {
                bucket,
                data,
                plain: None,
                shape,
            })
        });
        if !sent {
            return Err(DdpError::WorkerStopped {
                rank: links.pg.rank(),
                what: "the gradient communication thread",
            });
        }
        self.outstanding += 1;
        Ok(())
    }
}

pub(super) struct HostBucketJob {
    pub(super) bucket: usize,
    pub(super) data: Vec<f32>,
    /// Not a bucket: one all-reduce of a tensor during a backward pass (`all_reduce_in_order`),
    /// uncompressed, with this reduction.
    pub(super) plain: Option<GradReduction>,
    /// The bucket's layout, for PowerSGD.
    pub(super) shape: Option<BucketShape>,
}

/// The bucket number of a [`HostBucketJob`] that is not a bucket.
pub(super) const PLAIN: usize = usize::MAX;

pub(super) struct Done {
    pub(super) bucket: usize,
    pub(super) result: Result<Vec<f32>>,
}

/// The host transport's communication thread: all-reduces buckets one after another.
pub(super) type Comm = Worker<HostBucketJob, Done>;

impl std::fmt::Debug for HostBucketJob {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "HostBucketJob(bucket {}, {} elements)",
            self.bucket,
            self.data.len()
        )
    }
}

/// Starts the host transport's communication thread.
pub(super) fn start_comm(
    pg: ProcessGroup,
    reduction: GradReduction,
    compression: Compression,
    power_sgd: Option<(PowerSgd, Arc<PowerSgdStats>)>,
) -> Result<Comm> {
    let name = format!("burn-ddp-grad-{}", pg.rank());
    let mut power = power_sgd.map(|(p, stats)| PowerSgdState::new(p, stats));
    Ok(Worker::start(
        name,
        move |HostBucketJob {
                  bucket,
                  mut data,
                  plain,
                  shape,
              }| {
            let result = match (plain, power.as_mut(), shape) {
                (Some(r), _, _) => grad::reduce_bucket(&pg, &mut data, r, Compression::None),
                (None, Some(p), Some(shape)) => p.reduce(&pg, bucket, &mut data, &shape, reduction),
                _ => grad::reduce_bucket(&pg, &mut data, reduction, compression),
            }
            .map(|()| data);
            Done { bucket, result }
        },
    )?)
}
