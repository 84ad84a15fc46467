//! The gradient reducer: a fixed bucket plan, and per backward pass the buckets that fill as
//! gradients become final.
//!
//! Invariant that keeps ranks in step: buckets are launched strictly in index order, on every
//! rank, and every bucket is launched in every synchronised backward — parameters that get no
//! gradient on this rank count as ready (zeros) from the start. One state machine
//! ([`Reducer::launch_ready`]) enforces it for both transports: host-staged buckets go to the
//! communication thread, which all-reduces them one after another in launch order; device
//! buckets (`gpu.rs`) go to the NCCL launcher thread, likewise in order. They differ only
//! in [`BucketTransport::launch`] and in how a pass collects its results.

use burn_ddp_comm::ConfigError;
use std::collections::HashMap;

use burn_backend::distributed::DistributedParamId;

#[cfg(feature = "cuda")]
use burn_ddp_comm::grad::ANSWER_SLACK;
use burn_ddp_comm::grad::{
    BucketBuf, BucketOrder, BucketPlan, HookChoice, HostComm, LaunchOrder, Slot,
};

#[cfg(feature = "cuda")]
use super::Compression;
use super::{DdpConfig, GradReduction, ParamInfo};
use crate::group::ProcessGroup;
use crate::GradTransport;
use crate::{DdpError, Result};

mod transport;
use transport::{Buckets, HostBuckets, Links};

/// The reducer's bucket plan: buckets from the last parameter to the first, keyed by Burn's
/// distributed parameter id.
pub(crate) type Plan = BucketPlan<DistributedParamId>;

/// The plan of `params` (visit order) for the overlapped path.
pub(crate) fn plan(params: Vec<(ParamInfo, DistributedParamId)>, config: &DdpConfig) -> Plan {
    BucketPlan::build(params, config, BucketOrder::Reverse)
}

/// A parameter that had no gradient on this rank in the last backward, but one on some other
/// rank: its averaged gradient (flattened, f32), which Burn's gradient container cannot take
/// from a hook (it only holds gradients of this rank's graph), so that
/// [`DdpSession::complete`](crate::DdpSession::complete) registers it.
#[derive(Debug)]
pub(crate) struct Foreign {
    slot: usize,
    pub(crate) name: String,
    pub(crate) values: ForeignValues,
}

/// Where a [`Foreign`] gradient's values are.
#[derive(Debug)]
pub(crate) enum ForeignValues {
    Host(Vec<f32>),
    #[cfg(feature = "cuda")]
    Device(Box<burn_backend::tensor::FloatTensor<burn::backend::Cuda>>),
}

/// A gradient's reduced values, where they go back, and its shape.
pub(crate) type Reduced = (Origin, Vec<f32>, Vec<usize>);

/// Where a gradient came from, to write the result back.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Origin {
    /// Address of the backend's tensor primitive inside the running backward's gradient container.
    pub ptr: usize,
}

/// One backward pass: which slots are final, which bucket launches next, and the buckets
/// themselves. The launch rule is the same for every transport (see [`Reducer::launch_ready`]).
#[derive(Debug)]
struct Step {
    /// Which slots are final, and which bucket launches next.
    order: LaunchOrder,
    origin: Vec<Option<Origin>>,
    buckets: Buckets,
}

/// The reducer of one session.
#[derive(Debug)]
pub(crate) struct Reducer {
    pg: ProcessGroup,
    /// Mean or sum, and the wire format, of the device path (the host path's hook has them).
    #[cfg(feature = "cuda")]
    reduction: GradReduction,
    #[cfg(feature = "cuda")]
    compression: Compression,
    overlap: bool,
    plan: Option<Plan>,
    step: Option<Step>,
    error: Option<DdpError>,
    enabled: bool,
    spare: Vec<Vec<f32>>,
    /// The host-staged transport's communication thread, started at the first launch.
    comm: Option<HostComm>,
    /// Parameters with no local gradient that some other rank had a gradient for, last
    /// backward, until `DdpSession::complete` takes them.
    foreign: Vec<Foreign>,
    /// A failure to report after the running pass, which still runs (see [`Reducer::begin`]).
    deferred: Option<DdpError>,
    transport: GradTransport,
    /// What the host-staged communication thread reduces buckets with (the configuration's
    /// hook, and PowerSGD's counts when it is on).
    hooks: HookChoice,
    /// `DdpConfig::gradient_as_bucket_view`: gradients released into their buckets.
    bucket_view: bool,
    /// `DdpConfig::shared_buckets`: host buckets in memory shared by the ranks of the host.
    shared_buckets: bool,
    /// The NCCL communicator of the device path, once created.
    #[cfg(feature = "cuda")]
    nccl: Option<std::sync::Arc<burn_ddp_comm::cuda::NcclComm>>,
    /// The device path was ruled out for this session (and why was said once).
    #[cfg(feature = "cuda")]
    nccl_refused: bool,
    /// The device path's communication thread (with the communicator).
    #[cfg(feature = "cuda")]
    launcher: Option<super::gpu::NcclLauncher>,
}

impl Reducer {
    pub(crate) fn new(pg: &ProcessGroup, config: &DdpConfig) -> Self {
        Self {
            pg: pg.clone(),
            #[cfg(feature = "cuda")]
            reduction: config.reduction,
            #[cfg(feature = "cuda")]
            compression: config.compression,
            overlap: config.overlap,
            plan: None,
            step: None,
            error: None,
            enabled: true,
            spare: Vec::new(),
            comm: None,
            foreign: Vec::new(),
            deferred: None,
            transport: config.transport,
            hooks: HookChoice::of(config),
            bucket_view: config.gradient_as_bucket_view,
            shared_buckets: config.shared_buckets,
            #[cfg(feature = "cuda")]
            nccl: None,
            #[cfg(feature = "cuda")]
            nccl_refused: false,
            #[cfg(feature = "cuda")]
            launcher: None,
        }
    }

    /// Whether this backward pass over backend `B`, whose tensors are on `device`, keeps its
    /// buckets on the GPU. The NCCL communicator was set up by `prepare`
    /// ([`Reducer::connect_cuda`]); gradients on another GPU than its are an error.
    #[cfg_attr(not(feature = "cuda"), allow(clippy::extra_unused_type_parameters))]
    pub(crate) fn use_device<B: burn_backend::Backend>(&mut self, device: &B::Device) -> bool {
        #[cfg(feature = "cuda")]
        {
            use super::gpu::{cuda_ordinal, is_cuda};
            if !is_cuda::<B>() || self.transport == GradTransport::Host {
                if self.transport == GradTransport::Nccl && !self.nccl_refused {
                    self.nccl_refused = true;
                    self.record_error(DdpError::Config(ConfigError::InvalidConfig {
                        field: "DdpConfig::transport",
                        reason: "GradTransport::Nccl needs Autodiff<Ddp<Cuda>> (Burn's CUDA \
                                 backend); other backends use GradTransport::Host or Auto",
                    }));
                }
                return false;
            }
            let ordinal = cuda_ordinal(device);
            if self.nccl.is_none() && !self.nccl_refused {
                // Not set up by `prepare` (a model prepared on another backend, then moved):
                // every rank gets here in the same backward, so the set-up stays collective.
                if let Err(e) = self.connect_cuda(ordinal) {
                    self.record_error(e);
                    return false;
                }
            }
            let Some(comm) = self.nccl.as_ref() else {
                return false;
            };
            match ordinal {
                Some(o) if o != comm.device_ordinal() => {
                    let e = DdpError::Cuda(burn_ddp_comm::CudaError::DeviceMismatch {
                        rank: self.pg.rank(),
                        what: "the gradients of this backward pass",
                        found: o,
                        expected_why: format!(
                            "NCCL was set up on GPU {} (where the model was at `prepare`)",
                            comm.device_ordinal()
                        ),
                    });
                    self.record_error(e);
                    false
                }
                _ => true,
            }
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = device;
            if self.transport == GradTransport::Nccl && self.error.is_none() {
                self.record_error(DdpError::Config(ConfigError::InvalidConfig {
                    field: "DdpConfig::transport",
                    reason: "GradTransport::Nccl needs burn-ddp's `cuda` feature",
                }));
            }
            false
        }
    }

    /// Sets up the NCCL transport for a model on GPU `ordinal` (its parameters' device; `None`:
    /// the rank's default GPU), collectively, at `prepare`, through
    /// `burn_ddp_comm::cuda::connect_for_grads` (two votes, so that every rank takes the same
    /// decision). Refused under `Auto`: every rank uses the host-staged transport.
    ///
    /// # Errors
    /// A rank's GPU is not its local rank's; with `GradTransport::Nccl`, any rank that cannot
    /// use NCCL.
    #[cfg(feature = "cuda")]
    pub(crate) fn connect_cuda(&mut self, ordinal: Option<usize>) -> Result<()> {
        if !burn_ddp_comm::cuda::wants_nccl(&self.pg, self.transport) || self.nccl.is_some() {
            return Ok(());
        }
        match burn_ddp_comm::cuda::connect_for_grads(&self.pg, self.transport, ordinal) {
            Ok(Some(comm)) => {
                let comm = std::sync::Arc::new(comm);
                self.launcher = Some(super::gpu::NcclLauncher::start(std::sync::Arc::clone(
                    &comm,
                ))?);
                self.nccl = Some(comm);
                Ok(())
            }
            Ok(None) => {
                self.nccl_refused = true;
                Ok(())
            }
            Err(e) => {
                self.nccl_refused = true;
                Err(e)
            }
        }
    }

    /// Aborts the NCCL communicator of a membership that changed (its ranks are not all there
    /// any more: a clean finalize could wait on a dead one).
    pub(crate) fn abort_transports(&mut self) {
        #[cfg(feature = "cuda")]
        if let Some(comm) = self.nccl.take() {
            // Aborted without publishing: the job's abort record belongs to the new membership.
            comm.abort();
            // A pass in flight lets its buffers go once the aborted stream drained, then the
            // launcher (what it still holds goes under the same rule).
            if let (Some(mut step), Some(launcher)) = (self.step.take(), self.launcher.as_ref()) {
                if let Buckets::Device(dev) = &mut step.buckets {
                    let wait = self.pg.timeouts().collective + ANSWER_SLACK;
                    dev.settle_aborted(launcher, wait);
                }
            }
            self.launcher = None;
        }
        self.step = None;
    }

    pub(crate) fn set_plan(&mut self, plan: Plan) {
        self.discard_step();
        self.plan = Some(plan);
    }

    pub(crate) fn set_enabled(&mut self, on: bool) {
        self.enabled = on;
    }

    pub(crate) fn take_error(&mut self) -> Option<DdpError> {
        self.error.take().or_else(|| self.deferred.take())
    }

    pub(crate) fn record_error(&mut self, e: DdpError) {
        tracing::debug!("gradient synchronisation failed: {e}");
        if self.error.is_none() {
            self.error = Some(e);
        }
    }

    pub(crate) fn params(&self) -> Vec<ParamInfo> {
        self.plan
            .as_ref()
            .map(|p| p.slots.iter().map(|s| s.info.clone()).collect())
            .unwrap_or_default()
    }

    pub(crate) fn bucket_names(&self) -> Vec<Vec<String>> {
        self.plan
            .as_ref()
            .map(BucketPlan::bucket_names)
            .unwrap_or_default()
    }

    /// Parameters that had no gradient on this rank but one on others, last backward (not yet
    /// taken by `DdpSession::complete`).
    pub(crate) fn foreign(&self) -> Vec<String> {
        self.foreign.iter().map(|f| f.name.clone()).collect()
    }

    /// Takes the averaged gradients of the last backward's [`Foreign`] parameters, by
    /// parameter id.
    pub(crate) fn take_foreign(&mut self) -> HashMap<DistributedParamId, Foreign> {
        let foreign = std::mem::take(&mut self.foreign);
        let Some(plan) = self.plan.as_ref().filter(|_| !foreign.is_empty()) else {
            return HashMap::new();
        };
        let ids: HashMap<usize, DistributedParamId> =
            plan.by_id.iter().map(|(id, &slot)| (slot, *id)).collect();
        foreign
            .into_iter()
            .filter_map(|f| Some((*ids.get(&f.slot)?, f)))
            .collect()
    }

    /// Whether a backward pass should be synchronised now. At world size 1 the average is the
    /// gradient itself, so nothing is copied (compression, too, is skipped there).
    ///
    /// An explicit `GradTransport::Nccl` synchronises at world size 1 too: NCCL refuses two
    /// ranks on one GPU, so a one-GPU machine can only exercise the device path that way.
    pub(crate) fn active(&self) -> bool {
        self.enabled
            && self.plan.is_some()
            && self.error.is_none()
            && (self.pg.world_size().get() > 1
                || (cfg!(feature = "cuda") && self.transport == GradTransport::Nccl))
    }

    /// Starts a backward pass in which the parameters `used` will receive gradients; `device`:
    /// its buckets stay on the GPU (see [`Reducer::use_device`]).
    pub(crate) fn begin(&mut self, used: impl Iterator<Item = DistributedParamId>, device: bool) {
        self.discard_step();
        if !self.foreign.is_empty() {
            // Reported after this pass (its collectives still run, so the other ranks are not
            // left waiting): `check`, and so `DdpSession::backward`, return it.
            let names = self.foreign();
            self.foreign.clear();
            let e = DdpError::model_access(
                self.pg.rank(),
                "synchronising gradients",
                format!(
                    "in the previous step, parameters without a gradient on this rank had one on \
                     other ranks ({names:?}), and their averaged gradient never reached this \
                     rank's optimizer, so the replicas now differ. Take each step's gradients \
                     through DdpSession::gradients(&model, loss), or pass them through \
                     DdpSession::complete(&model, grads) before the optimizer step \
                     (DdpStrategy does)"
                ),
            );
            tracing::debug!("{e}");
            self.deferred.get_or_insert(e);
        }
        let Some(plan) = self.plan.as_ref() else {
            return;
        };
        let mut used_slots = vec![false; plan.slots.len()];
        for id in used {
            if let Some(&i) = plan.by_id.get(&id) {
                used_slots[i] = true;
            }
        }
        let mut order = LaunchOrder::new(plan);
        for (i, used) in used_slots.iter().enumerate() {
            if !used {
                order.mark_final(i);
            }
        }
        let n = plan.buckets.len();
        #[cfg(feature = "cuda")]
        let device_buckets =
            device.then(|| Buckets::Device(super::gpu::DeviceStep::new(plan.slots.len(), n)));
        #[cfg(not(feature = "cuda"))]
        let device_buckets = {
            let _ = device;
            None
        };
        let buckets = match device_buckets {
            Some(b) => b,
            None => {
                // Values, then the presence flags (`BucketPlan::buffer_len`): in memory shared
                // with the host's other ranks when the group has it (a collective the first
                // time: every rank's pass begins here), else on the heap.
                let lens: Vec<usize> = (0..n).map(|b| plan.buffer_len(b)).collect();
                let shared = match self.comm.as_mut() {
                    Some(comm) => comm.buffers(&lens),
                    None => HostComm::start(&self.pg, self.hooks.make(), self.shared_buckets)
                        .and_then(|comm| self.comm.insert(comm).buffers(&lens)),
                };
                let buffers = match shared {
                    Ok(Some(shared)) => shared,
                    heap => {
                        if let Err(e) = heap {
                            self.error.get_or_insert(e);
                        }
                        BucketBuf::on_heap(&lens, &mut self.spare)
                    }
                };
                Buckets::Host(HostBuckets {
                    buffers: buffers.into_iter().map(Some).collect(),
                    results: (0..n).map(|_| None).collect(),
                })
            }
        };
        self.step = Some(Step {
            origin: vec![None; plan.slots.len()],
            order,
            buckets,
        });
        if self.overlap {
            self.launch_ready();
        }
    }

    /// Where gradient `id` goes in its bucket: (slot, bucket buffer, offset), or `None` if it
    /// is not synchronised in this pass.
    pub(crate) fn slot_of(&self, id: DistributedParamId) -> Option<usize> {
        let step = self.step.as_ref()?;
        let i = *self.plan.as_ref()?.by_id.get(&id)?;
        (!step.order.is_final(i)).then_some(i)
    }

    pub(crate) fn slot_info(&self, slot: usize) -> Option<&Slot> {
        self.plan.as_ref()?.slots.get(slot)
    }

    /// Copies a final gradient (as f32) into its bucket and launches what became ready.
    pub(crate) fn fill(&mut self, slot: usize, values: &[f32], origin: Origin) {
        if let (Some(plan), Some(step)) = (self.plan.as_ref(), self.step.as_mut()) {
            let s = &plan.slots[slot];
            // Without the `cuda` feature every pass is a host pass.
            #[allow(irrefutable_let_patterns)]
            if let Buckets::Host(host) = &mut step.buckets {
                if let Some(buf) = host.buffers[s.bucket].as_mut() {
                    buf[s.offset..s.offset + values.len()].copy_from_slice(values);
                    buf[plan.flag_index(slot)] = 1.0;
                }
            }
        }
        self.mark_ready(slot, origin);
    }

    /// Slot `slot`'s gradient is final (its value is with the bucket): counts it, and launches
    /// what became ready.
    fn mark_ready(&mut self, slot: usize, origin: Origin) {
        let Some(step) = self.step.as_mut() else {
            return;
        };
        step.order.mark_final(slot);
        step.origin[slot] = Some(origin);
        if self.overlap {
            self.launch_ready();
        }
    }

    /// The launch rule ([`LaunchOrder`], shared with the host-staged transport of the core):
    /// buckets strictly in index order, each as soon as all its slots are final. A
    /// failed launch is recorded and the later buckets still go, keeping the ranks in step
    /// until the failure is reported.
    fn launch_ready(&mut self) {
        let (Some(plan), Some(step)) = (self.plan.as_ref(), self.step.as_mut()) else {
            return;
        };
        let mut links = Links {
            pg: &self.pg,
            #[cfg(feature = "cuda")]
            reduction: self.reduction,
            #[cfg(feature = "cuda")]
            compression: self.compression,
            comm: &mut self.comm,
            plan,
            #[cfg(feature = "cuda")]
            nccl: self.nccl.as_deref().zip(self.launcher.as_ref()),
        };
        while let Some(bucket) = step.order.next_ready() {
            let slots: Vec<(usize, usize)> = plan.buckets[bucket]
                .0
                .iter()
                .map(|&i| (i, plan.slots[i].info.numel))
                .collect();
            if let Err(e) = step.buckets.transport().launch(&mut links, bucket, &slots) {
                tracing::debug!("gradient synchronisation failed: {e}");
                self.error.get_or_insert(e);
            }
        }
    }

    /// Whether the running pass keeps its buckets on the GPU.
    #[cfg(feature = "cuda")]
    pub(crate) fn device_pass(&self) -> bool {
        self.step
            .as_ref()
            .is_some_and(|s| matches!(s.buckets, Buckets::Device(_)))
    }

    /// The device path's [`Reducer::fill`]: keeps a final CUDA gradient for its bucket and
    /// launches what became ready.
    #[cfg(feature = "cuda")]
    pub(crate) fn fill_device(
        &mut self,
        slot: usize,
        grad: burn_backend::tensor::FloatTensor<burn::backend::Cuda>,
        origin: Origin,
    ) {
        if let (Some(plan), Some(step)) = (self.plan.as_ref(), self.step.as_mut()) {
            if let Buckets::Device(dev) = &mut step.buckets {
                let info = &plan.slots[slot].info;
                if let Err(e) = dev.keep(self.pg.rank(), slot, grad, info) {
                    tracing::debug!("gradient synchronisation failed: {e}");
                    self.error.get_or_insert(e);
                }
            }
        }
        self.mark_ready(slot, origin);
    }

    /// Ends the pass, for every transport: gradients announced but never delivered count as
    /// zeros (so that no rank waits forever), every bucket is launched in order, and the pass is
    /// taken out of the reducer.
    fn close(&mut self) -> Option<Step> {
        if let Some(step) = self.step.as_mut() {
            step.order.mark_rest_final();
        }
        self.launch_ready();
        self.step.take()
    }

    /// The device path's [`Reducer::finish`]: launches the remaining buckets, waits for NCCL and
    /// returns each local gradient's origin with its averaged value (on the GPU).
    #[cfg(feature = "cuda")]
    #[allow(clippy::type_complexity)]
    pub(crate) fn finish_device(
        &mut self,
    ) -> Result<
        Vec<(
            Origin,
            burn_backend::tensor::FloatTensor<burn::backend::Cuda>,
        )>,
    > {
        let Some(mut step) = self.close() else {
            return Ok(Vec::new());
        };
        let wait = self.pg.timeouts().collective + ANSWER_SLACK;
        let Buckets::Device(dev) = &mut step.buckets else {
            // A host pass ends in `finish`.
            return Ok(Vec::new());
        };
        if let Some(e) = self.error.take() {
            // Buckets already queued may still be in flight, and the ranks are out of step: stop
            // NCCL (and tell the others), take the launcher's answers and drain NCCL's stream
            // before any buffer of the step goes.
            return Err(match (self.launcher.as_ref(), self.nccl.as_ref()) {
                (Some(launcher), _) => dev.abandon(launcher, e, wait),
                (None, Some(comm)) => {
                    comm.fail_with(&e);
                    e
                }
                (None, None) => e,
            });
        }
        let (Some(plan), Some(comm), Some(launcher)) = (
            self.plan.as_ref(),
            self.nccl.as_ref(),
            self.launcher.as_ref(),
        ) else {
            return Ok(Vec::new());
        };
        let slots = plan
            .slots
            .iter()
            .enumerate()
            .map(|(i, s)| (i, s.bucket, s.offset, s.info.numel, plan.flag_index(i)));
        let (reduced, foreign) = dev.finish(comm, launcher, wait, slots)?;
        let foreign = foreign
            .into_iter()
            .map(|(slot, t)| Foreign {
                slot,
                name: plan.slots[slot].info.name.clone(),
                values: ForeignValues::Device(Box::new(t)),
            })
            .collect();
        let reduced = reduced
            .into_iter()
            .filter_map(|(slot, t)| step.origin[slot].map(|o| (o, t)))
            .collect();
        self.foreign = foreign;
        self.warn_foreign();
        Ok(reduced)
    }

    /// Says which parameters had no local gradient but got one elsewhere (last backward).
    fn warn_foreign(&self) {
        if !self.foreign.is_empty() {
            tracing::debug!(
                "[rank {}] parameters without a gradient on this rank got one on other ranks: {:?} \
                 (DdpSession::complete registers their average)",
                self.pg.rank(),
                self.foreign()
            );
        }
    }

    /// PowerSGD's counts (elements all-reduced, elements uncompressed, steps), when it is on.
    pub(crate) fn power_sgd_totals(&self) -> Option<(u64, u64, u64)> {
        self.hooks.power_sgd_totals()
    }

    /// Inside a join, on a rank that ran out of batches: the buckets of a synchronised backward
    /// of the ranks still training, all zeros with no presence (on the GPU where theirs are:
    /// the transport every rank took at `prepare`), reduced with theirs and the results
    /// dropped.
    ///
    /// # Errors
    /// Collective failures.
    pub(crate) fn shadow(&mut self) -> Result<()> {
        if !self.active() {
            return Ok(());
        }
        #[cfg(feature = "cuda")]
        let device = self.nccl.is_some() && self.transport != GradTransport::Host;
        #[cfg(not(feature = "cuda"))]
        let device = false;
        self.begin(std::iter::empty(), device);
        #[cfg(feature = "cuda")]
        let result = match device {
            true => self.finish_device().map(drop),
            false => self.finish().map(drop),
        };
        #[cfg(not(feature = "cuda"))]
        let result = self.finish().map(drop);
        // The others' gradients are not this rank's to register: it no longer steps.
        self.foreign.clear();
        result
    }

    /// Ends the backward pass: launches every bucket (in order), waits for all of them and
    /// returns, for each slot with a local gradient, its origin and averaged values.
    pub(crate) fn finish(&mut self) -> Result<Vec<Reduced>> {
        let Some(step) = self.close() else {
            return Ok(Vec::new());
        };
        let Step {
            origin, buckets, ..
        } = step;
        #[allow(irrefutable_let_patterns)] // without `cuda`, every pass is a host pass
        let Buckets::Host(mut host) = buckets
        else {
            // A device pass ends in `finish_device`.
            return Ok(Vec::new());
        };
        if let Err(e) = self.collect(&mut host) {
            if !self.bucket_view {
                return Err(e);
            }
            // The gradients were released into the buckets: they come back as zeros of their
            // shape (never a tensor of the wrong shape), and `check` reports the failure.
            self.error.get_or_insert(e);
        }
        let Some(plan) = self.plan.as_ref() else {
            return Ok(Vec::new());
        };
        let mut out = Vec::new();
        self.foreign.clear();
        // Bucket by bucket, each buffer reused or freed as soon as its values are out, so at
        // most one bucket is alive beside the results.
        for (b, (slots, _)) in plan.buckets.iter().enumerate() {
            let Some(bucket) = host.results[b].take() else {
                if self.bucket_view {
                    for &i in slots {
                        if let Some(o) = origin[i] {
                            let info = &plan.slots[i].info;
                            out.push((o, vec![0.0; info.numel], info.shape.clone()));
                        }
                    }
                }
                continue;
            };
            if let ([i], true) = (slots.as_slice(), self.bucket_view) {
                if let Some(o) = origin[*i] {
                    // The bucket becomes the gradient: no copy of a heap bucket.
                    let info = &plan.slots[*i].info;
                    out.push((o, bucket.into_vec(info.numel), info.shape.clone()));
                    continue;
                }
            }
            for &i in slots {
                let slot = &plan.slots[i];
                let values = &bucket[slot.offset..slot.offset + slot.info.numel];
                match origin[i] {
                    Some(o) => out.push((o, values.to_vec(), slot.info.shape.clone())),
                    None => {
                        if bucket[plan.flag_index(i)] != 0.0 {
                            self.foreign.push(Foreign {
                                slot: i,
                                name: slot.info.name.clone(),
                                values: ForeignValues::Host(values.to_vec()),
                            });
                        }
                    }
                }
            }
            // Kept for the next pass, unless the memory is the point (a shared bucket goes
            // back to its arena).
            if !self.bucket_view {
                self.spare.extend(bucket.into_heap());
            }
        }
        // In the model's order (the buckets were walked in launch order).
        self.foreign.sort_by_key(|f| f.slot);
        self.warn_foreign();
        Ok(out)
    }

    /// Whether gradients are released into their buckets (`DdpConfig::gradient_as_bucket_view`).
    pub(crate) fn bucket_view(&self) -> bool {
        self.bucket_view
    }

    /// An all-reduce of `data` issued while this backward pass's host buckets are in flight
    /// (a differentiable all-reduce's backward, e.g. `SyncBatchNorm`'s): it goes through the
    /// communication thread behind them, so that every rank runs the collectives in the same
    /// order; the answers of the buckets before it are kept for `finish`. It gives `data` back
    /// untouched (`Err`) when no bucket is in flight: the caller all-reduces directly, and
    /// nothing can overtake it.
    pub(crate) fn all_reduce_in_order(
        &mut self,
        data: Vec<f32>,
        reduction: GradReduction,
    ) -> std::result::Result<Result<Vec<f32>>, Vec<f32>> {
        let Some(step) = self.step.as_mut() else {
            return Err(data);
        };
        #[allow(irrefutable_let_patterns)] // without `cuda`, every pass is a host pass
        let Buckets::Host(host) = &mut step.buckets
        else {
            return Err(data);
        };
        match self.comm.as_mut().filter(|c| c.outstanding() > 0) {
            Some(comm) => Ok(comm.all_reduce_in_order(data, reduction, &mut host.results)),
            None => Err(data),
        }
    }

    /// Takes the communication thread's answers for every bucket of a host pass.
    fn collect(&mut self, host: &mut HostBuckets) -> Result<()> {
        match self.comm.as_mut() {
            Some(comm) => comm.collect(&mut host.results),
            None => Ok(()),
        }
    }

    /// Drops a backward pass that never finished (its backward panicked), draining what its
    /// transport still does so that the next pass starts clean.
    fn discard_step(&mut self) {
        let Some(mut step) = self.step.take() else {
            return;
        };
        match &mut step.buckets {
            Buckets::Host(host) => {
                let _ = self.collect(host);
            }
            // The pass never finished: this rank is out of step with the others, and NCCL may
            // still work on the step's device buckets. Abandon it: NCCL stopped (the others
            // told), every answer taken and the stream drained before any of its buffers goes.
            #[cfg(feature = "cuda")]
            Buckets::Device(dev) => {
                if let Some(launcher) = self.launcher.as_ref() {
                    let wait = self.pg.timeouts().collective + ANSWER_SLACK;
                    let e = dev.abandon(launcher, abandoned(self.pg.rank()), wait);
                    self.record_error(e);
                }
            }
        }
    }
}

impl Drop for Reducer {
    fn drop(&mut self) {
        self.discard_step();
        // Then the communication threads stop and are joined (the workers' own drop).
    }
}

/// Why a device pass that never reached its end (its backward panicked, or the membership
/// changed under it) was abandoned: what the other ranks are told.
#[cfg(feature = "cuda")]
fn abandoned(rank: crate::group::Rank) -> DdpError {
    DdpError::model_access(
        rank,
        "synchronising gradients on the GPU",
        "a backward pass ended before its gradient buckets were all launched (it \
                 panicked, or the job's membership changed): NCCL was stopped so that no rank \
                 waits for buckets that will not come",
    )
}
