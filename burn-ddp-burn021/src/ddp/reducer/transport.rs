//! The transports of the 0.21 line's passes: host-staged buckets (the core's [`HostBuckets`],
//! over its communication thread [`HostComm`]) or device buckets (`gpu.rs`'s
//! [`DeviceStep`](super::super::gpu::DeviceStep), over NCCL), chosen per pass. The engine that
//! drives them is the core's [`Pass`](burn_ddp_comm::grad::Pass); this is the one place that
//! chooses between them.

use burn_backend::distributed::DistributedParamId;
use burn_ddp_comm::grad::{BucketPlan, BucketTransport, HostBuckets, HostComm, Reduced};

use crate::group::Rank;
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
    /// Device buckets for a pass over `plan`, when `device` (the pass's gradients are CUDA
    /// tensors and NCCL is set up); `None`: the pass is host-staged.
    pub(super) fn device(device: bool, plan: &Plan) -> Option<Self> {
        #[cfg(feature = "cuda")]
        if device {
            let step = super::super::gpu::DeviceStep::new(plan.slots.len(), plan.buckets.len());
            return Some(Buckets::Device(step));
        }
        let _ = (device, plan);
        None
    }

    /// Whether the buckets are on the GPU.
    pub(super) fn is_device(&self) -> bool {
        !matches!(self, Buckets::Host(_))
    }

    /// The host-staged buckets, if these are.
    pub(super) fn host(&mut self) -> Option<&mut HostBuckets> {
        match self {
            Buckets::Host(h) => Some(h),
            #[cfg(feature = "cuda")]
            Buckets::Device(_) => None,
        }
    }

    /// After the communicator was aborted by its owner (a membership change): a device pass
    /// takes every answer and drains NCCL's stream (bounded) before its buffers go.
    #[cfg(feature = "cuda")]
    pub(super) fn settle_aborted(
        &mut self,
        launcher: &super::super::gpu::NcclLauncher,
        wait: std::time::Duration,
    ) {
        if let Buckets::Device(d) = self {
            d.settle_aborted(launcher, wait);
        }
    }
}

/// A final gradient, as the pass's transport takes it.
pub(crate) enum Grad<'g> {
    /// Its values as f32 (host-staged).
    Host(&'g [f32]),
    /// The CUDA tensor itself.
    #[cfg(feature = "cuda")]
    Device(burn_backend::tensor::FloatTensor<burn::backend::Cuda>),
}

/// What a finished pass gives back.
#[derive(Debug)]
pub(crate) enum Output {
    Host(Reduced<'static>),
    #[cfg(feature = "cuda")]
    Device(super::super::gpu::DeviceResults),
}

/// What the pass's transport needs from the reducer: the long-lived parts of each.
pub(crate) struct Links<'a> {
    pub(super) rank: Rank,
    /// The host-staged transport's communication thread (started by the host pass's `begin`).
    pub(super) host: Option<&'a mut HostComm>,
    /// The NCCL communicator and its launcher thread (set up by `prepare`).
    #[cfg(feature = "cuda")]
    pub(super) nccl: Option<super::super::gpu::NcclLink<'a>>,
}

impl<'a> Links<'a> {
    fn host(&mut self) -> Result<&mut &'a mut HostComm> {
        let rank = self.rank;
        self.host.as_mut().ok_or(DdpError::Internal {
            rank,
            what: "a host bucket was sent before its pass began",
        })
    }

    #[cfg(feature = "cuda")]
    fn nccl(&mut self) -> Result<&mut super::super::gpu::NcclLink<'a>> {
        self.nccl.as_mut().ok_or(DdpError::Collective(
            burn_ddp_comm::CollectiveError::NotInitialized {
                what: "the NCCL communicator of the device path",
                fix: "call DdpSession::prepare (or train through DdpStrategy) before backward",
            },
        ))
    }
}

/// A gradient for the other transport than the pass's.
#[cfg(feature = "cuda")]
fn mismatched(rank: Rank) -> DdpError {
    DdpError::Internal {
        rank,
        what: "a gradient was given to a pass of the other transport",
    }
}

type Plan = BucketPlan<DistributedParamId>;

impl BucketTransport<DistributedParamId> for Buckets {
    type Grad<'g> = Grad<'g>;
    type Link<'l> = Links<'l>;
    type Output = Output;

    fn keep(
        &mut self,
        links: &mut Links<'_>,
        plan: &Plan,
        slot: usize,
        grad: Grad<'_>,
    ) -> Result<()> {
        match (self, grad) {
            (Buckets::Host(h), Grad::Host(values)) => h.keep(links.host()?, plan, slot, values),
            #[cfg(feature = "cuda")]
            (Buckets::Device(d), Grad::Device(t)) => d.keep(links.nccl()?, plan, slot, t),
            #[cfg(feature = "cuda")]
            _ => Err(mismatched(links.rank)),
        }
    }

    fn send(&mut self, links: &mut Links<'_>, plan: &Plan, bucket: usize) -> Result<()> {
        match self {
            Buckets::Host(h) => h.send(links.host()?, plan, bucket),
            #[cfg(feature = "cuda")]
            Buckets::Device(d) => d.send(links.nccl()?, plan, bucket),
        }
    }

    fn finish(&mut self, links: &mut Links<'_>, plan: &Plan, local: &[bool]) -> Result<Output> {
        match self {
            Buckets::Host(h) => h.finish(links.host()?, plan, local).map(Output::Host),
            #[cfg(feature = "cuda")]
            Buckets::Device(d) => d.finish(links.nccl()?, plan, local).map(Output::Device),
        }
    }

    fn abandon(&mut self, links: &mut Links<'_>, e: DdpError) -> DdpError {
        match self {
            Buckets::Host(h) => match links.host.as_mut() {
                Some(comm) => {
                    <HostBuckets as BucketTransport<DistributedParamId>>::abandon(h, comm, e)
                }
                None => e,
            },
            #[cfg(feature = "cuda")]
            Buckets::Device(d) => match links.nccl.as_mut() {
                Some(nccl) => d.abandon(nccl, e),
                None => e,
            },
        }
    }
}
