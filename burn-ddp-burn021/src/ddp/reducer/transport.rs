//! How a complete bucket travels, the one thing the host and the device paths do differently in
//! the reducer's state machine (the parent module): [`BucketTransport`], the host-staged buckets
//! (handed to the core's [`HostComm`], the communication thread every host-staged pass of both
//! Burn lines uses, which reduces them in launch order through a communication hook), and the
//! links a launch needs from the reducer. The device path's buckets are `gpu.rs`'s.

use burn_ddp_comm::grad::{BucketBuf, HostComm};

#[cfg(feature = "cuda")]
use super::super::{Compression, GradReduction};
use crate::group::ProcessGroup;
#[cfg(feature = "cuda")]
use crate::DdpError;
#[cfg(feature = "cuda")]
use crate::ReduceOp;
use crate::Result;

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

/// A host pass's buckets: being packed (taken when launched), and the answers that came back.
#[derive(Debug)]
pub(super) struct HostBuckets {
    pub(super) buffers: Vec<Option<BucketBuf>>,
    pub(super) results: Vec<Option<BucketBuf>>,
}

/// What launching a bucket needs from the reducer: the transports' long-lived parts.
pub(crate) struct Links<'a> {
    pub(super) pg: &'a ProcessGroup,
    /// Mean or sum, and the wire format, for the device path (the host path's hook has them).
    #[cfg(feature = "cuda")]
    pub(super) reduction: GradReduction,
    #[cfg(feature = "cuda")]
    pub(super) compression: Compression,
    /// The host-staged transport's communication thread, started at the first launch.
    pub(super) comm: &'a mut Option<HostComm>,
    /// The pass's plan (for the layout of a bucket, when the hook reads it).
    pub(super) plan: &'a super::Plan,
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
        self.nccl.ok_or(DdpError::Collective(
            burn_ddp_comm::CollectiveError::NotInitialized {
                what: "the NCCL communicator of the device path",
                fix: "call DdpSession::prepare (or train through DdpStrategy) before backward",
            },
        ))
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
        // Started by the pass's `begin`, which lays the buckets out.
        let Some(comm) = links.comm.as_mut() else {
            return Err(crate::DdpError::Internal {
                rank: links.pg.rank(),
                what: "a host bucket was launched before its pass began",
            });
        };
        let layout = comm.wants_layout().then(|| links.plan.bucket_shape(bucket));
        comm.launch(bucket, data, layout)
    }
}
