//! The transports of the 0.21 line's passes: host-staged buckets (the core's [`HostBuckets`],
//! over its communication thread [`HostComm`]) or device buckets (`gpu.rs`'s
//! [`DeviceStep`](super::super::gpu::DeviceStep), over NCCL), chosen per pass. The engine that
//! drives them is the core's [`Pass`](burn_ddp_comm::grad::Pass); this is the one place that
//! chooses between them.

use burn_backend::distributed::DistributedParamId;
use burn_ddp_comm::grad::{BucketTransport, HostBuckets, HostComm, Reduced};
use burn_ddp_comm::ConfigError;

use super::Plan;
use crate::group::{ProcessGroup, Rank};
use crate::{DdpConfig, DdpError, GradTransport, Result};

/// The device transport's long-lived parts, set up once per session (at `prepare`): the NCCL
/// communicator and its issuer thread, with the `cuda` feature; without it, nothing, and a
/// request for NCCL is refused.
#[derive(Debug, Default)]
pub(super) struct Nccl {
    /// The communicator, once created.
    #[cfg(feature = "cuda")]
    comm: Option<std::sync::Arc<burn_ddp_comm::cuda::NcclComm>>,
    /// Its issuer thread.
    #[cfg(feature = "cuda")]
    issuer: Option<super::super::gpu::NcclIssuer>,
    /// The device path was ruled out for this session (and why was said once).
    refused: bool,
}

impl Nccl {
    /// Whether a backward pass over backend `B`, whose tensors are on `device`, keeps its
    /// buckets on the GPU (NCCL set up by `prepare`, [`Nccl::connect`], or now, collectively:
    /// every rank gets here in the same backward). `Err`: why not, to report (a refusal once per
    /// session); the pass is host-staged then.
    #[cfg_attr(not(feature = "cuda"), allow(clippy::extra_unused_type_parameters))]
    pub(super) fn choose<B: burn_backend::Backend>(
        &mut self,
        pg: &ProcessGroup,
        transport: GradTransport,
        device: &B::Device,
    ) -> Result<bool> {
        #[cfg(feature = "cuda")]
        {
            use super::super::gpu::{cuda_ordinal, is_cuda};
            if !is_cuda::<B>() || transport == GradTransport::Host {
                if transport == GradTransport::Nccl && !std::mem::replace(&mut self.refused, true) {
                    return Err(DdpError::Config(ConfigError::InvalidConfig {
                        field: "DdpConfig::transport",
                        reason: "GradTransport::Nccl needs Autodiff<Ddp<Cuda>> (Burn's CUDA \
                                 backend); other backends use GradTransport::Host or Auto",
                    }));
                }
                return Ok(false);
            }
            let ordinal = cuda_ordinal(device);
            if self.comm.is_none() && !self.refused {
                // Not set up by `prepare` (a model prepared on another backend, then moved).
                self.connect(pg, transport, ordinal)?;
            }
            let Some(comm) = self.comm.as_ref() else {
                return Ok(false);
            };
            match ordinal {
                Some(o) if o != comm.device_ordinal() => {
                    Err(DdpError::Cuda(burn_ddp_comm::CudaError::DeviceMismatch {
                        rank: pg.rank(),
                        what: "the gradients of this backward pass",
                        found: o,
                        expected_why: format!(
                            "NCCL was set up on GPU {} (where the model was at `prepare`)",
                            comm.device_ordinal()
                        ),
                    }))
                }
                _ => Ok(true),
            }
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = (pg, device);
            if transport == GradTransport::Nccl && !std::mem::replace(&mut self.refused, true) {
                return Err(DdpError::Config(ConfigError::InvalidConfig {
                    field: "DdpConfig::transport",
                    reason: "GradTransport::Nccl needs burn-ddp's `cuda` feature",
                }));
            }
            Ok(false)
        }
    }

    /// At `prepare`, for a model over backend `B` whose parameters are on `device`: with
    /// `Autodiff<Ddp<Cuda>>` (`B` being `Ddp<Cuda>`), NCCL is set up now, on the model's GPU,
    /// with a deadline and a warm-up all-reduce, rather than in the first backward (at peak
    /// memory, under Burn's locks). Collective. Otherwise, and without the `cuda` feature,
    /// nothing.
    ///
    /// # Errors
    /// As [`Nccl::connect`].
    #[cfg_attr(not(feature = "cuda"), allow(clippy::extra_unused_type_parameters))]
    pub(super) fn prepare<B: burn_backend::Backend>(
        &mut self,
        pg: &ProcessGroup,
        transport: GradTransport,
        device: Option<&B::Device>,
    ) -> Result<()> {
        #[cfg(feature = "cuda")]
        if super::super::gpu::is_ddp_cuda::<B>() {
            let ordinal = device.and_then(super::super::gpu::cuda_ordinal);
            return self.connect(pg, transport, ordinal);
        }
        let _ = (pg, transport, device);
        Ok(())
    }

    /// Sets up NCCL for a model on GPU `ordinal` (its parameters' device; `None`: the rank's
    /// default GPU), collectively, through `burn_ddp_comm::cuda::connect_for_grads` (two votes,
    /// so that every rank takes the same decision). Refused under `Auto` where some rank cannot
    /// use it: every rank uses the host-staged transport.
    ///
    /// # Errors
    /// A rank's GPU is not its local rank's; with `GradTransport::Nccl`, any rank that cannot
    /// use NCCL.
    #[cfg(feature = "cuda")]
    fn connect(
        &mut self,
        pg: &ProcessGroup,
        transport: GradTransport,
        ordinal: Option<usize>,
    ) -> Result<()> {
        {
            if !burn_ddp_comm::cuda::wants_nccl(pg, transport) || self.comm.is_some() {
                return Ok(());
            }
            match burn_ddp_comm::cuda::connect_for_grads(pg, transport, ordinal) {
                Ok(Some(comm)) => {
                    let comm = std::sync::Arc::new(comm);
                    let issuer =
                        super::super::gpu::NcclIssuer::start(std::sync::Arc::clone(&comm))?;
                    self.issuer = Some(issuer);
                    self.comm = Some(comm);
                    Ok(())
                }
                Ok(None) => {
                    self.refused = true;
                    Ok(())
                }
                Err(e) => {
                    self.refused = true;
                    Err(e)
                }
            }
        }
    }

    /// The communicator, once set up.
    #[cfg(feature = "cuda")]
    pub(super) fn comm(&self) -> Option<std::sync::Arc<burn_ddp_comm::cuda::NcclComm>> {
        self.comm.clone()
    }

    /// What the device transport's passes cost so far; `None` without NCCL.
    pub(super) fn counts(&self) -> Option<burn_ddp_comm::grad::DeviceCounts> {
        #[cfg(feature = "cuda")]
        return self
            .issuer
            .as_ref()
            .map(super::super::gpu::NcclIssuer::counts);
        #[cfg(not(feature = "cuda"))]
        None
    }

    /// Whether NCCL is set up (a join's shadow pass goes where the others' passes go).
    pub(super) fn is_ready(&self) -> bool {
        #[cfg(feature = "cuda")]
        return self.comm.is_some();
        #[cfg(not(feature = "cuda"))]
        false
    }

    /// Aborts the communicator of a membership that changed (its ranks are not all there any
    /// more: a clean finalize could wait on a dead one), without publishing (the job's abort
    /// record belongs to the new membership). A device pass in flight, `pass`, lets its buffers
    /// go once the aborted stream drained, then the issuer (what it still holds goes under the
    /// same rule).
    pub(super) fn abort(&mut self, pass: Option<&mut Buckets>, wait: std::time::Duration) {
        #[cfg(feature = "cuda")]
        if let Some(comm) = self.comm.take() {
            comm.abort();
            if let (Some(Buckets::Device(d)), Some(issuer)) = (pass, self.issuer.as_ref()) {
                d.settle_aborted(issuer, wait);
            }
            self.issuer = None;
        }
        #[cfg(not(feature = "cuda"))]
        let _ = (pass, wait);
    }

    /// What a pass's transport needs: the host thread `host`, and this.
    pub(super) fn links<'a>(
        &'a self,
        pg: &ProcessGroup,
        config: &DdpConfig,
        host: Option<&'a mut HostComm>,
    ) -> Links<'a> {
        #[cfg(not(feature = "cuda"))]
        let _ = config;
        Links {
            rank: pg.rank(),
            host,
            #[cfg(feature = "cuda")]
            nccl: self
                .comm
                .as_deref()
                .zip(self.issuer.as_ref())
                .map(|(comm, issuer)| super::super::device::PassLink {
                    rank: comm.rank(),
                    link: issuer,
                    op: config.reduction.op(),
                    compression: config.compression,
                    wait: pg.timeouts().collective + burn_ddp_comm::grad::ANSWER_SLACK,
                }),
        }
    }
}

/// The buckets of one pass, by how they travel.
#[derive(Debug)]
pub(super) enum Buckets {
    /// Host-staged: f32 buffers filled from each gradient, reduced by the communication thread
    /// over the process group's transport.
    Host(HostBuckets),
    /// On the GPU: Burn's tensors packed per bucket and reduced by NCCL (`gpu.rs`).
    #[cfg(feature = "cuda")]
    Device(super::super::device::DeviceStep<burn::backend::Cuda, super::super::gpu::NcclIssuer>),
}

impl Buckets {
    /// Device buckets for a pass over `plan`, when `device` (the pass's gradients are CUDA
    /// tensors and NCCL is set up); `None`: the pass is host-staged.
    pub(super) fn device(device: bool, plan: &Plan, nccl: &Nccl) -> Option<Self> {
        #[cfg(feature = "cuda")]
        if let (true, Some(issuer)) = (device, nccl.issuer.as_ref()) {
            let (slots, buckets) = (plan.slots.len(), plan.buckets.len());
            let step = super::super::device::DeviceStep::new(slots, buckets, issuer.home());
            return Some(Buckets::Device(step));
        }
        let _ = (device, plan, nccl);
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
    Device(super::super::device::DeviceResults<burn::backend::Cuda>),
}

/// What the pass's transport needs from the reducer: the long-lived parts of each.
pub(crate) struct Links<'a> {
    pub(super) rank: Rank,
    /// The host-staged transport's communication thread (started by the host pass's `begin`).
    pub(super) host: Option<&'a mut HostComm>,
    /// The NCCL communicator and its issuer thread (set up by `prepare`).
    #[cfg(feature = "cuda")]
    pub(super) nccl: Option<super::super::device::PassLink<'a, super::super::gpu::NcclIssuer>>,
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
    fn nccl(
        &mut self,
    ) -> Result<&mut super::super::device::PassLink<'a, super::super::gpu::NcclIssuer>> {
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
