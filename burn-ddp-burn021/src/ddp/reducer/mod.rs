//! The gradient reducer of the 0.21 line: a fixed bucket plan, and per backward pass the core's
//! gradient engine ([`Pass`]) over the pass's transport (`transport.rs`: host-staged buckets,
//! or device buckets on NCCL), fed by Burn's backward hooks (`hooks.rs`) as gradients become
//! final.
//!
//! Invariant that keeps ranks in step (the engine's): buckets are sent strictly in index
//! order, on every rank, and every bucket is sent in every synchronised backward — parameters
//! that get no gradient on this rank count as absent (zeros) from the start. What is the 0.21
//! line's own: which parameters a pass synchronises (Burn's distributed parameter ids), where
//! each reduced gradient goes back (its origin in Burn's gradient container), the choice of
//! transport, and the foreign gradients that `DdpSession::complete` registers.

use std::collections::HashMap;

use burn_backend::distributed::DistributedParamId;

use burn_ddp_comm::grad::{BucketOrder, BucketPlan, HostSync, Pass, ANSWER_SLACK};

use super::{DdpConfig, GradReduction, ParamInfo};
use crate::group::ProcessGroup;
use crate::GradTransport;
use crate::{DdpError, Result};

mod transport;
pub(crate) use transport::Grad;
use transport::{Buckets, Links, Nccl, Output};

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
pub(crate) type WriteBack = (Origin, Vec<f32>, Vec<usize>);

/// A final gradient as a hook reads it (see [`Reducer::gradient_ready`]).
pub(crate) enum GradValue {
    /// Its values as f32.
    Host(Vec<f32>),
    /// The CUDA tensor itself (a device pass).
    #[cfg(feature = "cuda")]
    Device(burn_backend::tensor::FloatTensor<burn::backend::Cuda>),
}

/// The end of a pass (see [`Reducer::finish_backward`]): each local gradient's reduced value
/// and where it goes back.
pub(crate) enum Finished {
    /// Host values, with the gradient's shape.
    Host(Vec<WriteBack>),
    /// Views of the reduced device buckets, shaped and typed as the gradients were.
    #[cfg(feature = "cuda")]
    Device(
        Vec<(
            Origin,
            burn_backend::tensor::FloatTensor<burn::backend::Cuda>,
        )>,
    ),
}

/// Where a gradient came from, to write the result back.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Origin {
    /// Address of the backend's tensor primitive inside the running backward's gradient container.
    pub ptr: usize,
}

/// One backward pass: the engine over its transport, and where each local gradient goes back.
#[derive(Debug)]
struct Step {
    pass: Pass<Buckets>,
    origin: Vec<Option<Origin>>,
}

/// The reducer of one session.
#[derive(Debug)]
pub(crate) struct Reducer {
    pg: ProcessGroup,
    /// The session's options (with the transport `DdpSession::new` settled).
    config: DdpConfig,
    plan: Option<Plan>,
    step: Option<Step>,
    error: Option<DdpError>,
    enabled: bool,
    /// The host-staged transport (its communication thread), started at the first host pass.
    host: Option<HostSync>,
    /// Parameters with no local gradient that some other rank had a gradient for, last
    /// backward, until `DdpSession::complete` takes them.
    foreign: Vec<Foreign>,
    /// A failure to report after the running pass, which still runs (see [`Reducer::begin`]).
    deferred: Option<DdpError>,
    /// The device transport (NCCL), set up at `prepare`.
    nccl: Nccl,
    /// ZeRO stage 2 (`DdpSession::zero2`): each synchronised parameter's owner, by slot; the
    /// plans' buckets are reduce-scattered to them.
    zero_owners: burn_ddp_comm::grad::StageTwo,
}

impl Reducer {
    pub(crate) fn new(pg: &ProcessGroup, config: &DdpConfig) -> Self {
        Self {
            pg: pg.clone(),
            config: config.clone(),
            plan: None,
            step: None,
            error: None,
            enabled: true,
            host: None,
            foreign: Vec::new(),
            deferred: None,
            nccl: Nccl::default(),
            zero_owners: Default::default(),
        }
    }

    /// The plan, the running pass and what its transport needs: disjoint parts of the reducer.
    fn split(&mut self) -> (Option<&Plan>, Option<&mut Step>, Links<'_>) {
        let host = self.host.as_mut().map(HostSync::comm);
        let links = self.nccl.links(&self.pg, &self.config, host);
        (self.plan.as_ref(), self.step.as_mut(), links)
    }

    /// Whether this backward pass over backend `B`, whose tensors are on `device`, keeps its
    /// buckets on the GPU ([`Nccl::choose`]); a refusal is recorded.
    fn use_device<B: burn_backend::Backend>(&mut self, device: &B::Device) -> bool {
        let chosen = self
            .nccl
            .choose::<B>(&self.pg, self.config.transport, device);
        chosen.unwrap_or_else(|e| {
            self.record_error(e);
            false
        })
    }

    /// Sets up the device transport at `prepare`, collectively, for a model over backend `B`
    /// whose parameters are on `device` ([`Nccl::prepare`]).
    ///
    /// # Errors
    /// A rank's GPU is not its local rank's; with `GradTransport::Nccl`, any rank that cannot
    /// use NCCL.
    pub(crate) fn prepare_device<B: burn_backend::Backend>(
        &mut self,
        device: Option<&B::Device>,
    ) -> Result<()> {
        self.nccl
            .prepare::<B>(&self.pg, self.config.transport, device)
    }

    /// Aborts the device transport of a membership that changed ([`Nccl::abort`]) and drops the
    /// running pass.
    pub(crate) fn abort_transports(&mut self) {
        let wait = self.pg.timeouts().collective + ANSWER_SLACK;
        let mut step = self.step.take();
        let pass = step.as_mut().map(|s| s.pass.transport_mut());
        self.nccl.abort(pass, wait);
    }

    /// The host-staged transport: the session's one communication thread, for the passes of
    /// backward and for `DdpSession::sync_gradients` (each plan reduced by a hook of its own),
    /// started on first use.
    ///
    /// # Errors
    /// The thread cannot be started.
    pub(crate) fn host_sync(&mut self) -> Result<&mut HostSync> {
        started(&mut self.host, &self.pg, &self.config)
    }

    pub(crate) fn set_plan(&mut self, plan: Plan) {
        self.discard_step();
        // ZeRO stage 2 carries over to the same model prepared again.
        self.plan = Some(self.sharded(plan));
    }

    /// `plan` reduce-scattered to the owners of ZeRO stage 2, when it is on (the overlapped
    /// plan and each after-backward plan: both list the synchronised parameters in visit
    /// order).
    pub(crate) fn sharded<K>(&self, plan: BucketPlan<K>) -> BucketPlan<K> {
        (self.zero_owners).apply(plan, self.pg.world_size().as_usize())
    }

    /// ZeRO stage 2 from the next pass on: parameter `slot` is owned by `owners[slot]`.
    ///
    /// # Errors
    /// What stage 2 cannot run with; `prepare` not called.
    pub(crate) fn shard(&mut self, owners: Vec<crate::group::Rank>) -> Result<()> {
        burn_ddp_comm::grad::check_stage2(&self.config)?;
        let Some(plan) = self.plan.take() else {
            return Err(DdpError::Internal {
                rank: self.pg.rank(),
                what: "ZeRO stage 2 asked for before the model was prepared",
            });
        };
        self.discard_step();
        self.zero_owners.set(owners);
        self.plan = Some(self.sharded(plan));
        Ok(())
    }

    pub(crate) fn set_enabled(&mut self, on: bool) {
        self.enabled = on;
    }

    pub(crate) fn take_error(&mut self) -> Option<DdpError> {
        self.error.take().or_else(|| self.deferred.take())
    }

    /// Records failure `e`: the running pass's (which still sends every bucket, then is given
    /// up: see [`Pass`]), else the reducer's; `DdpSession::check` reports it.
    pub(crate) fn record_error(&mut self, e: DdpError) {
        match self.step.as_mut() {
            Some(step) => step.pass.fail(e),
            None => {
                tracing::debug!("gradient synchronisation failed: {e}");
                self.error.get_or_insert(e);
            }
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
    fn active(&self) -> bool {
        self.enabled
            && self.plan.is_some()
            && self.error.is_none()
            && (self.pg.world_size().get() > 1
                || (cfg!(feature = "cuda") && self.config.transport == GradTransport::Nccl))
    }

    /// Burn's `register_sync_parameters`: a backward pass over `B` starts on `device`, in
    /// which the parameters `used` will receive gradients. When the reducer synchronises,
    /// `announce` runs first (inside a join, the ranks that ran out learn of this pass and
    /// shadow it), then the pass's transport is chosen and the pass begins.
    pub(crate) fn begin_backward<B: burn_backend::Backend>(
        &mut self,
        device: &B::Device,
        used: impl Iterator<Item = DistributedParamId>,
        announce: impl FnOnce() -> Result<()>,
    ) {
        if !self.active() {
            return;
        }
        if let Err(e) = announce() {
            self.record_error(e);
            return;
        }
        let on_gpu = self.use_device::<B>(device);
        // `use_device` may have recorded an error (gradients on another GPU than NCCL's): then
        // this pass is not synchronised, and `DdpSession::backward` reports the error.
        if self.active() {
            self.begin(used, on_gpu);
        }
    }

    /// Burn's `submit_gradient_sync`: the gradient of `id`, which goes back to `origin`, is
    /// final. If the pass synchronises it, `read(on_gpu)` gives its value (the CUDA tensor on a
    /// device pass, else f32 values), handed to the pass. Returns whether the container's
    /// copy may be released (`gradient_as_bucket_view` or ZeRO stage 2 on a host pass: the
    /// bucket holds it, and the end of the pass writes every such gradient back).
    pub(crate) fn gradient_ready(
        &mut self,
        id: DistributedParamId,
        origin: Origin,
        read: impl FnOnce(bool) -> Result<GradValue>,
    ) -> bool {
        if !self.active() {
            return false;
        }
        let Some(slot) = self.slot_of(id) else {
            return false;
        };
        let on_gpu = self.device_pass();
        match read(on_gpu) {
            Ok(GradValue::Host(values)) => {
                self.fill(slot, Grad::Host(&values), origin);
                self.releases()
            }
            #[cfg(feature = "cuda")]
            Ok(GradValue::Device(t)) => {
                self.fill(slot, Grad::Device(t), origin);
                false
            }
            Err(e) => {
                self.record_error(e);
                false
            }
        }
    }

    /// Whether a host pass releases each gradient once it is in its bucket:
    /// `gradient_as_bucket_view`, and always under ZeRO stage 2 (a sharded plan), whose point is
    /// that a rank does not keep the gradients it does not own.
    fn releases(&self) -> bool {
        self.config.gradient_as_bucket_view
            || (self.plan.as_ref()).is_some_and(|p| p.sharding.is_some())
    }

    /// Burn's `submit_sync_collective`: ends the pass and gives each local gradient's reduced
    /// value with its origin (a failure is recorded: `DdpSession::check` reports it).
    pub(crate) fn finish_backward(&mut self) -> Finished {
        #[cfg(feature = "cuda")]
        if self.device_pass() {
            return Finished::Device(self.finish_device().unwrap_or_else(|e| {
                self.record_error(e);
                Vec::new()
            }));
        }
        Finished::Host(self.finish().unwrap_or_else(|e| {
            self.record_error(e);
            Vec::new()
        }))
    }

    /// Starts a backward pass in which the parameters `used` will receive gradients; `device`:
    /// its buckets stay on the GPU (see [`Reducer::use_device`]).
    fn begin(&mut self, used: impl Iterator<Item = DistributedParamId>, device: bool) {
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
        let buckets = match Buckets::device(device, plan, &self.nccl) {
            Some(b) => b,
            None => {
                // Values, then the presence flags (`BucketPlan::buffer_len`): in memory shared
                // with the host's other ranks when the group has it (a collective the first
                // time: every rank's pass begins here), else on the heap.
                let host = match started(&mut self.host, &self.pg, &self.config) {
                    Ok(host) => host,
                    Err(e) => {
                        self.error.get_or_insert(e);
                        return;
                    }
                };
                match host.buckets(plan) {
                    Ok(b) => Buckets::Host(b),
                    Err(e) => {
                        self.error.get_or_insert(e);
                        Buckets::Host(host.heap_buckets(plan))
                    }
                }
            }
        };
        let pass = Pass::new(self.pg.rank(), plan, buckets, self.config.overlap);
        self.step = Some(Step {
            pass,
            origin: vec![None; used_slots.len()],
        });
        let absent = used_slots
            .iter()
            .enumerate()
            .filter(|(_, used)| !**used)
            .map(|(i, _)| i);
        let (Some(plan), Some(step), mut links) = self.split() else {
            return;
        };
        step.pass
            .absent(&mut links, plan, absent.collect::<Vec<_>>());
    }

    /// Where gradient `id` goes in the plan (its slot), or `None` if it is not synchronised in
    /// this pass (not in the plan, counted absent, or given already).
    fn slot_of(&self, id: DistributedParamId) -> Option<usize> {
        let step = self.step.as_ref()?;
        let i = *self.plan.as_ref()?.by_id.get(&id)?;
        step.pass.is_open(i).then_some(i)
    }

    /// Slot `slot`'s final gradient (as f32 values on the host, or the CUDA tensor on a device
    /// pass), which goes back to `origin`: handed to the pass, which sends what became ready.
    fn fill(&mut self, slot: usize, grad: Grad<'_>, origin: Origin) {
        let (Some(plan), Some(step), mut links) = self.split() else {
            return;
        };
        step.pass.push(&mut links, plan, slot, Some(grad));
        if let Some(o) = step.origin.get_mut(slot) {
            *o = Some(origin);
        }
    }

    /// Whether the running pass keeps its buckets on the GPU.
    fn device_pass(&mut self) -> bool {
        self.step
            .as_mut()
            .is_some_and(|s| s.pass.transport_mut().is_device())
    }

    /// Ends the pass: every bucket sent (parameters never given count as absent here), the
    /// answers taken, or, after a failure, the pass given up. `None` without a pass.
    fn close(&mut self) -> Option<(Result<Output>, Vec<Option<Origin>>)> {
        let Step { pass, origin } = self.step.take()?;
        let (Some(plan), _, mut links) = self.split() else {
            return None;
        };
        Some((pass.finish(&mut links, plan), origin))
    }

    /// The device path's [`Reducer::finish`]: sends the remaining buckets, waits for NCCL and
    /// returns each local gradient's origin with its averaged value (on the GPU).
    #[cfg(feature = "cuda")]
    #[allow(clippy::type_complexity)]
    fn finish_device(
        &mut self,
    ) -> Result<
        Vec<(
            Origin,
            burn_backend::tensor::FloatTensor<burn::backend::Cuda>,
        )>,
    > {
        let Some((result, origin)) = self.close() else {
            return Ok(Vec::new());
        };
        let Output::Device((reduced, foreign)) = result? else {
            // A host pass ends in `finish`.
            return Ok(Vec::new());
        };
        let Some(plan) = self.plan.as_ref() else {
            return Ok(Vec::new());
        };
        self.foreign = foreign
            .into_iter()
            .map(|(slot, t)| Foreign {
                slot,
                name: plan.slots[slot].info.name.clone(),
                values: ForeignValues::Device(Box::new(t)),
            })
            .collect();
        let reduced = reduced
            .into_iter()
            .filter_map(|(slot, t)| origin[slot].map(|o| (o, t)))
            .collect();
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

    /// The NCCL communicator, once `prepare` (or a backward) set it up: where a ZeRO
    /// optimizer all-gathers its stepped parameters on the GPU.
    #[cfg(feature = "cuda")]
    pub(crate) fn nccl_comm(&self) -> Option<std::sync::Arc<burn_ddp_comm::cuda::NcclComm>> {
        self.nccl.comm()
    }

    /// What the device transport's passes cost so far; `None` without NCCL.
    pub(crate) fn device_counts(&self) -> Option<burn_ddp_comm::grad::DeviceCounts> {
        self.nccl.counts()
    }

    /// PowerSGD's counts (elements all-reduced, elements uncompressed, steps), when it is on.
    pub(crate) fn power_sgd_totals(&self) -> Option<(u64, u64, u64)> {
        match self.host.as_ref() {
            Some(host) => host.power_sgd_totals(),
            None => self.config.power_sgd.is_some().then_some((0, 0, 0)),
        }
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
        let device = self.nccl.is_ready() && self.config.transport != GradTransport::Host;
        self.begin(std::iter::empty(), device);
        let result = self.close().map_or(Ok(()), |(r, _)| r.map(drop));
        // The others' gradients are not this rank's to register: it no longer steps.
        self.foreign.clear();
        result
    }

    /// Ends the backward pass: sends every bucket (in order), waits for all of them and
    /// returns, for each slot with a local gradient, its origin and averaged values.
    fn finish(&mut self) -> Result<Vec<WriteBack>> {
        let Some((result, origin)) = self.close() else {
            return Ok(Vec::new());
        };
        let bucket_view = self.releases();
        let mut reduced = match result {
            Ok(Output::Host(reduced)) => reduced,
            #[cfg(feature = "cuda")]
            Ok(Output::Device(_)) => return Ok(Vec::new()),
            Err(e) if bucket_view => {
                // The gradients were released into the buckets: they come back as zeros of
                // their shape (never a tensor of the wrong shape), and `check` reports the
                // failure.
                self.error.get_or_insert(e);
                let Some(plan) = self.plan.as_ref() else {
                    return Ok(Vec::new());
                };
                return Ok(origin
                    .iter()
                    .zip(&plan.slots)
                    .filter_map(|(o, s)| {
                        Some((
                            o.as_ref().copied()?,
                            vec![0.0; s.info.numel],
                            s.info.shape.clone(),
                        ))
                    })
                    .collect());
            }
            Err(e) => return Err(e),
        };
        let Some(plan) = self.plan.as_ref() else {
            return Ok(Vec::new());
        };
        let mut out = Vec::new();
        self.foreign.clear();
        // Slot by slot (a bucket's slots are contiguous): each bucket released as soon as its
        // values are out, so at most one bucket is alive beside the results; a bucket of one
        // gradient becomes it without a copy.
        for (i, slot) in plan.slots.iter().enumerate() {
            let Some(values) = reduced.take(i) else {
                // ZeRO stage 2: another rank owns it; this rank's own gradient goes (an empty
                // tensor of the parameter's rank in Burn's container, which the ZeRO optimizer
                // drops before its step).
                if let (Some(o), Some(owner)) = (origin[i], plan.owner(i)) {
                    if owner != self.pg.rank() {
                        out.push((o, Vec::new(), vec![0; slot.info.shape.len()]));
                    }
                }
                continue;
            };
            match origin[i] {
                Some(o) => out.push((o, values, slot.info.shape.clone())),
                None => self.foreign.push(Foreign {
                    slot: i,
                    name: slot.info.name.clone(),
                    values: ForeignValues::Host(values),
                }),
            }
        }
        // Kept for the next pass, unless the memory is the point.
        let spare = reduced.into_spare();
        if let (Some(host), false) = (self.host.as_mut(), bucket_view) {
            host.recycle(spare);
        }
        self.warn_foreign();
        Ok(out)
    }

    /// An all-reduce of `data` issued while this backward pass's host buckets are in flight
    /// (a differentiable all-reduce's backward, e.g. `SyncBatchNorm`'s): it goes through the
    /// communication thread behind them (`HostBuckets::all_reduce_in_order`), so that every
    /// rank runs the collectives in the same order. It gives `data` back untouched (`Err`) when
    /// no bucket is in flight: the caller all-reduces directly, and nothing can overtake it.
    pub(crate) fn all_reduce_in_order(
        &mut self,
        data: Vec<f32>,
        reduction: GradReduction,
    ) -> std::result::Result<Result<Vec<f32>>, Vec<f32>> {
        let (_, Some(step), links) = self.split() else {
            return Err(data);
        };
        match (step.pass.transport_mut().host(), links.host) {
            (Some(buckets), Some(comm)) => buckets.all_reduce_in_order(comm, data, reduction),
            _ => Err(data),
        }
    }

    /// Drops a backward pass that never finished (its backward panicked), settling what its
    /// transport still does so that the next pass starts clean. A device pass is abandoned:
    /// NCCL stopped (the others told), every answer taken and the stream drained before any of
    /// its buffers goes; this rank is out of step, which `check` reports.
    fn discard_step(&mut self) {
        let Some(Step { mut pass, .. }) = self.step.take() else {
            return;
        };
        let device = pass.transport_mut().is_device();
        let rank = self.pg.rank();
        let (_, _, mut links) = self.split();
        let e = pass.discard(&mut links, abandoned(rank));
        if device {
            self.record_error(e);
        }
    }
}

impl Drop for Reducer {
    fn drop(&mut self) {
        self.discard_step();
        // Then the communication threads stop and are joined (the workers' own drop).
    }
}

/// Why a pass that never reached its end (its backward panicked, or the membership changed
/// under it) was abandoned: what the other ranks are told (on NCCL).
fn abandoned(rank: crate::group::Rank) -> DdpError {
    DdpError::model_access(
        rank,
        "synchronising gradients on the GPU",
        "a backward pass ended before its gradient buckets were all launched (it \
                 panicked, or the job's membership changed): NCCL was stopped so that no rank \
                 waits for buckets that will not come",
    )
}

/// The session's host transport, started (its communication thread) the first time it is needed.
///
/// # Errors
/// The thread cannot be started.
fn started<'h>(
    host: &'h mut Option<HostSync>,
    pg: &ProcessGroup,
    config: &DdpConfig,
) -> Result<&'h mut HostSync> {
    match host {
        Some(h) => Ok(h),
        None => Ok(host.insert(HostSync::start(pg, config)?)),
    }
}
