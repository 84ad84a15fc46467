//! [`GradSync`]: a model prepared on every rank, and its gradients reduced after backward.

use burn_ddp_comm::ConfigError;
use std::sync::{Arc, Mutex};

use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::store::ModuleRecord;
#[cfg(feature = "cuda")]
use burn::tensor::Device;
use burn::tensor::{Bytes, Tensor, TensorData};
use burn_ddp_comm::config::GradTransport;
use burn_ddp_comm::grad::{
    check_and_load, compare_replicas, load_from, BucketOrder, BucketPlan, DeviceDrain, HostSync,
    JoinCall, JoinSlot, NotCarried, ParamInfo, Pass, Reduced, Replica, ReplicaCheck,
    DEVICE_DRAIN_LIMIT,
};
use burn_ddp_comm::train::vote::FailureSlot;
use burn_ddp_comm::{DdpConfig, DdpError, ProcessGroup, Rank, Result};

use crate::grads::{describe, put_grads, take_grads, Target};
use crate::hook::GradSink;
use crate::overlap::{hook_model, lock, Anchors, Open, OpenPass};

/// Gradient synchronisation for one rank: [`prepare`](Self::prepare) the model once, then
/// [`sync`](Self::sync) the gradients of every step before the optimizer sees them.
///
/// Every rank must make the same calls in the same order (each is a collective).
pub struct GradSync {
    pg: ProcessGroup,
    config: DdpConfig,
    /// The host-staged transport (shared with an overlapped step's pass while it is open).
    host: Arc<Mutex<HostSync>>,
    /// The prepared model's trainable parameters (slot = position in visit order).
    plan: Option<Arc<BucketPlan<usize>>>,
    /// ZeRO stage 2 ([`GradSync::zero2`]): each trainable parameter's owner, by slot; the
    /// plan's buckets are reduce-scattered to them.
    zero_owners: burn_ddp_comm::grad::StageTwo,
    /// The pass of an overlapped step ([`GradSync::overlapped`]), until [`GradSync::sync`].
    open: Option<Arc<OpenPass>>,
    /// The overlapped steps' hook anchors.
    anchors: Anchors,
    /// Of the last step: how many buckets left during backward, of how many (`None`: the last
    /// step was not overlapped).
    last_overlap: Option<(usize, usize)>,
    /// Gradients accumulated before a step that [`GradSync::overlapped_after`] could not
    /// overlap: added to the step's own by [`GradSync::sync`].
    earlier: Option<GradientsParams>,
    /// Counts synchronised steps for the periodic comparison of the replicas.
    replicas: ReplicaCheck,
    /// Uneven-input mode, inside [`GradSync::join`] (shared with the shadow loop, which makes
    /// this sync's calls).
    pub(crate) join: Arc<JoinSlot>,
    /// What this process's `SyncBatchNorm` layers could not all-reduce (`nn`).
    layers: FailureSlot,
    /// What their all-reduces go behind: an overlapped step's buckets in flight.
    behind: crate::nn::Behind,
    /// NCCL for a model on a GPU (set up by `prepare`).
    #[cfg(feature = "cuda")]
    device: Option<Arc<Mutex<crate::cuda::DevicePath>>>,
    /// Waits for the work queued on the prepared model's devices, run when this is dropped.
    drain: DeviceDrain,
}

impl Drop for GradSync {
    /// Waits (at most [`DEVICE_DRAIN_LIMIT`]) for the work still queued on the prepared model's
    /// devices, so that a program that returns right after queueing GPU work does not unload
    /// the CUDA compiler under the device thread still using it.
    fn drop(&mut self) {
        self.drain.run(self.pg.rank(), DEVICE_DRAIN_LIMIT);
    }
}

impl std::fmt::Debug for GradSync {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GradSync")
            .field("rank", &self.pg.rank())
            .field("world_size", &self.pg.world_size())
            .field("config", &self.config)
            .field("params", &self.plan.as_ref().map_or(0, |p| p.slots.len()))
            .field("nccl", &self.uses_nccl())
            .finish()
    }
}

impl GradSync {
    /// Joins the job this process was launched into ([`ProcessGroup::from_env`]: our issuer,
    /// torchrun, Slurm or mpirun) and synchronises gradients over it with the default
    /// [`DdpConfig`] and the environment's choices ([`DdpConfig::from_env`]:
    /// `BURN_DDP_GRAD_TRANSPORT`): `GradSync::new(ProcessGroup::from_env()?, DdpConfig::from_env()?)`.
    ///
    /// # Errors
    /// As [`ProcessGroup::from_env`] (a issuer's variables missing or wrong, an unreachable
    /// master), [`DdpConfig::from_env`] and [`GradSync::new`].
    pub fn from_env() -> Result<Self> {
        Self::new(ProcessGroup::from_env()?, DdpConfig::from_env()?)
    }

    /// Sets the epoch of every training sampler made on this group
    /// ([`DistributedSampler::new`](crate::DistributedSampler::new)), which selects its
    /// shuffle, as the Learner strategy does: call it at the start of each epoch of a loop of
    /// your own (any integer the loop counts in). Same value on every rank.
    pub fn set_epoch(&self, epoch: impl burn_ddp_comm::data::EpochNumber) {
        burn_ddp_comm::data::set_training_epoch(&self.pg, epoch);
    }

    /// Gradient synchronisation over `pg` (this process's rank of the job), with `config`
    /// (bucket sizes, mean or sum, compression, transport; its `overlap` does not apply to this
    /// line: it reduces after backward). With the `cuda` feature, a model on a CUDA device has
    /// its gradients reduced by NCCL on the GPU (`GradTransport::Auto`, the default, falls back
    /// to the host-staged transport with a warning where NCCL cannot be used on every rank;
    /// `GradTransport::Nccl` fails instead); everything else is host-staged. No environment
    /// variable is read here ([`DdpConfig::from_env`] and [`GradSync::from_env`] do).
    ///
    /// # Errors
    /// An invalid `config`; `GradTransport::Nccl` without the
    /// `cuda` feature; PowerSGD in a fault-tolerant job ([`MembershipError::NotFaultTolerant`](burn_ddp_comm::MembershipError::NotFaultTolerant)); the
    /// communication thread cannot be started.
    pub fn new(pg: ProcessGroup, mut config: DdpConfig) -> Result<Self> {
        config.transport = config.effective_transport();
        config.validate()?;
        if !cfg!(feature = "cuda") && config.transport == GradTransport::Nccl {
            return Err(DdpError::Config(ConfigError::InvalidConfig {
                field: "DdpConfig::transport",
                reason: "GradTransport::Nccl needs burn-ddp's `cuda` feature",
            }));
        }
        if config.power_sgd.is_some() {
            NotCarried::PowerSgd.refuse_on(&pg)?;
        }
        let host = Arc::new(Mutex::new(HostSync::start(&pg, &config)?));
        let (layers, behind) = crate::nn::LayerGroup::register(&pg);
        Ok(Self {
            layers,
            behind,
            pg,
            replicas: ReplicaCheck::new(config.check_replicas_every),
            config,
            host,
            plan: None,
            zero_owners: Default::default(),
            open: None,
            anchors: Anchors::default(),
            last_overlap: None,
            earlier: None,
            join: Arc::default(),
            #[cfg(feature = "cuda")]
            device: None,
            drain: DeviceDrain::default(),
        })
    }

    /// Whether gradients travel through NCCL on the GPU (a model on a CUDA device, prepared
    /// with the `cuda` feature, NCCL usable on every rank), rather than host-staged.
    pub fn uses_nccl(&self) -> bool {
        #[cfg(feature = "cuda")]
        {
            self.device.is_some()
        }
        #[cfg(not(feature = "cuda"))]
        {
            false
        }
    }

    /// NCCL's device path, when the gradients travel through it (a ZeRO optimizer all-gathers
    /// its stepped parameters there too).
    #[cfg(feature = "cuda")]
    pub(crate) fn device_path(&self) -> Option<Arc<Mutex<crate::cuda::DevicePath>>> {
        self.device.clone()
    }

    /// What the NCCL path's steps have cost so far (operations Burn ran to pack and unpack
    /// buckets, transfers to the host, waits, hand-offs between threads, fusion drains and
    /// device synchronisations on the issuer thread: `burn_ddp_comm::grad::DeviceCounts`
    /// says what each counts); `None` on the host-staged path. Take two readings and
    /// [`DeviceCounts::since`](burn_ddp_comm::grad::DeviceCounts::since) for what steps between
    /// them cost.
    pub fn device_counts(&self) -> Option<burn_ddp_comm::grad::DeviceCounts> {
        #[cfg(feature = "cuda")]
        {
            self.device.as_ref().map(|d| lock(d).counts())
        }
        #[cfg(not(feature = "cuda"))]
        {
            None
        }
    }

    /// With PowerSGD on: (f32 elements all-reduced, elements the same buckets hold
    /// uncompressed, steps) since the start, on this rank.
    pub fn power_sgd_totals(&self) -> Option<(u64, u64, u64)> {
        lock(&self.host).power_sgd_totals()
    }

    /// The process group.
    pub fn group(&self) -> &ProcessGroup {
        &self.pg
    }

    /// Whether this is rank 0, the rank that prints and saves
    /// ([`main_println!`](crate::main_println)).
    pub fn is_main(&self) -> bool {
        self.pg.is_main()
    }

    /// The configuration.
    pub fn config(&self) -> &DdpConfig {
        &self.config
    }

    /// The prepared model's synchronised parameters, in visit order (empty before
    /// [`prepare`](Self::prepare)).
    pub fn params(&self) -> Vec<ParamInfo> {
        self.plan
            .as_ref()
            .map(|p| p.slots.iter().map(|s| s.info.clone()).collect())
            .unwrap_or_default()
    }

    /// The bucket layout: for each bucket, in launch order, its parameters' names.
    pub fn buckets(&self) -> Vec<Vec<String>> {
        self.plan
            .as_ref()
            .map(|p| p.bucket_names())
            .unwrap_or_default()
    }

    /// Makes `model` the same on every rank, and the model whose gradients [`sync`](Self::sync)
    /// reduces:
    ///
    /// 1. checks that every rank has the same float parameters (names, shapes, dtypes, in
    ///    order), failing with the first that differs and what each rank has there;
    /// 2. loads rank 0's whole record (parameters and buffers) on every other rank;
    /// 3. plans the buckets of its trainable parameters;
    /// 4. with the `cuda` feature, for a model on a CUDA device, sets NCCL up on every rank
    ///    together (the first `prepare` only; see [`GradSync::new`] for the fallback rules).
    ///
    /// # Errors
    /// [`ModelError::ModelMismatch`](burn_ddp_comm::ModelError::ModelMismatch); a record that cannot be written or read; some ranks' models
    /// on a CUDA device and others' not; NCCL set-up failures that `GradTransport::Auto` does
    /// not fall back from; collective failures.
    pub fn prepare<M: Module>(&mut self, model: M) -> Result<M> {
        self.prepare_with(model, true)
    }

    /// After a change of membership of a fault-tolerant job (`burn-ddp run --fault-tolerant`),
    /// on every rank of the new one, with the ranks' models equal (the ranks behind took the
    /// state of the rank ahead): drops what belonged to the membership before (the host
    /// thread's partial step, the NCCL communicator, the count of steps between replica
    /// checks), then checks the model across the new ranks and plans its buckets (and NCCL) as
    /// [`prepare`](Self::prepare) does, without loading rank 0's weights.
    ///
    /// # Errors
    /// As [`prepare`](Self::prepare).
    pub fn reprepare<M: Module>(&mut self, model: M) -> Result<M> {
        self.open = None;
        self.behind.set(None);
        self.earlier = None;
        self.host = Arc::new(Mutex::new(HostSync::start(&self.pg, &self.config)?));
        self.replicas = ReplicaCheck::new(self.config.check_replicas_every);
        self.join.clear();
        #[cfg(feature = "cuda")]
        if let Some(device) = self.device.take() {
            lock(&device).abort();
        }
        self.prepare_with(model, false)
    }

    /// [`prepare`](Self::prepare), loading rank 0's record on every rank when `load`.
    fn prepare_with<M: Module>(&mut self, model: M, load: bool) -> Result<M> {
        let rank = self.pg.rank();
        crate::grads::refuse_fsdp_shards(&model, rank, "GradSync::prepare")?;
        let devices = model.devices();
        self.drain.set(move || {
            devices
                .iter()
                .try_for_each(|device| device.sync().map_err(|e| e.to_string()))
        });
        let AsReplica(model) = check_and_load(&self.pg, AsReplica(model), load)?;

        let trainable = describe(&model)
            .into_iter()
            .filter(|(_, grad)| *grad)
            .enumerate()
            .map(|(slot, (info, _))| (info, slot))
            .collect();
        // Overlapped, the last parameters' gradients come first: their buckets go first.
        let order = match self.config.overlap {
            true => BucketOrder::Reverse,
            false => BucketOrder::Forward,
        };
        let plan = BucketPlan::build(trainable, &self.config, order);
        // ZeRO stage 2 carries over to the same model prepared again.
        let plan = (self.zero_owners).apply(plan, self.pg.world_size().as_usize());
        tracing::debug!(
            "[rank {rank}] ddp: {} parameters in {} buckets",
            plan.slots.len(),
            plan.buckets.len()
        );
        self.plan = Some(Arc::new(plan));
        #[cfg(feature = "cuda")]
        if self.device.is_none() {
            let device = first_device(&model);
            self.device =
                crate::cuda::DevicePath::connect(&self.pg, self.config.transport, device.as_ref())?
                    .map(|d| Arc::new(Mutex::new(d)));
        }
        Ok(model)
    }

    /// Reduces `grads` (this rank's gradients of `model`, as `GradientsParams::from_grads`
    /// makes them) across every rank, and returns them for the optimizer: the mean (or sum, as
    /// configured) of every parameter that some rank has a gradient for.
    ///
    /// Every `DdpConfig::check_replicas_every` calls, it first compares the ranks' parameters
    /// ([`check_replicas`](Self::check_replicas)).
    ///
    /// # Errors
    /// [`ModelError::ReplicasDiverged`](burn_ddp_comm::ModelError::ReplicasDiverged); [`prepare`](Self::prepare) was not called, or the
    /// model's trainable parameters changed since; a gradient of the wrong size; collective
    /// failures, naming the rank at fault, this step's `SyncBatchNorm` all-reduces' included.
    pub fn sync<M: Module>(
        &mut self,
        model: &M,
        grads: GradientsParams,
    ) -> Result<GradientsParams> {
        self.require_plan()?;
        // An overlapped step's buckets are in flight: they end first, before any other
        // collective of the group could overtake them.
        let overlapped = self.open.take();
        self.behind.set(None);
        self.last_overlap = None;
        // Accumulated before a step that could not be overlapped: part of this one.
        let grads = match self.earlier.take() {
            Some(earlier) => {
                let mut acc = burn::optim::GradientsAccumulator::<M>::new();
                acc.accumulate(model, earlier);
                acc.accumulate(model, grads);
                acc.grads()
            }
            None => grads,
        };
        let grads = match &overlapped {
            Some(open) => self.finish_open(open, model, grads),
            None => Ok(grads),
        };
        if let Some(e) = self.layers.take() {
            return Err(e);
        }
        let grads = grads?;
        // The datasets of samplers made since the last step, compared across the ranks.
        burn_ddp_comm::data::check_datasets(&self.pg)?;
        // Inside a join: announced first; no comparison of replicas (the ranks that ran out
        // no longer step), and the mean is over the ranks still training. Elsewhere the
        // replicas are compared after the gradients' reduction, on every path: a step may be
        // overlapped on some ranks and not on others (the Learner's partial last step, where a
        // rank without a batch has no backward), and their collectives must come in the same
        // order.
        if overlapped.is_some() {
            // Never inside a join (`overlapped` leaves the model as it is there).
            self.replicas_if_due(model)?;
            return Ok(grads);
        }
        let Some(round) = self.join.announce(&self.pg, JoinCall::Gradients)? else {
            let grads = self.reduce(model, grads)?;
            self.replicas_if_due(model)?;
            return Ok(grads);
        };
        let grads = self.reduce(model, grads)?;
        Ok(match round.scale(self.config.reduction) {
            Some(factor) => scale(model, grads, factor),
            None => grads,
        })
    }

    /// `model` for one step whose gradient communication overlaps its backward (PyTorch DDP's
    /// default; [`DdpConfig::overlap`], on by default): run this step's forward on the model it
    /// returns, then backward, then [`sync`](Self::sync) as usual. During backward, each
    /// trainable parameter's gradient is handed over as soon as it is complete (a backward
    /// hook of ours, docs/design.md "The parameter seam"), and every bucket whose gradients are
    /// all in is all-reduced while backward goes on; `sync` then waits for what is left.
    ///
    /// ```no_run
    /// # #[cfg(feature = "burn-0-22")] extern crate burn022 as burn;
    /// # #[cfg(feature = "burn-0-23")] extern crate burn023 as burn;
    /// # use burn::module::Module;
    /// # use burn::nn::{Linear, LinearConfig};
    /// # use burn::optim::{GradientsParams, Optimizer, SgdConfig};
    /// # use burn::tensor::{Device, Tensor};
    /// # use burn_ddp::{DdpConfig, GradSync, ProcessGroup};
    /// # fn main() -> burn_ddp::Result<()> {
    /// # let device = Device::default().autodiff();
    /// let mut sync = GradSync::new(ProcessGroup::from_env()?, DdpConfig::default())?;
    /// let mut model = sync.prepare(LinearConfig::new(4, 1).init(&device))?;
    /// # let mut optim = SgdConfig::new().init();
    /// # let x = Tensor::<2>::zeros([8, 4], &device);
    /// let loss = sync.overlapped(&model)?.forward(x).sum(); // the one line that changes
    /// let grads = GradientsParams::from_grads(loss.backward(), &model);
    /// let grads = sync.sync(&model, grads)?;
    /// model = optim.step(0.1, model, grads);
    /// # Ok(()) }
    /// ```
    ///
    /// The returned model is for this step only: one forward and one backward, then `sync` (a
    /// second backward through it fails the step). Between that backward and `sync`, the
    /// buckets may still be in flight on the communication thread: make no collective of the
    /// group yourself there (`sync` first): the ranks could order it differently from the
    /// buckets. The hooks hand over the gradients of that
    /// one backward: with gradient accumulation over several micro-batches, use `model` itself
    /// and `sync` the accumulated gradients after the last backward, as without overlap. The
    /// hooks take each gradient (neither the returned model's parameters nor `model`'s keep one
    /// in Burn's gradients, so reading it copies nothing): take the gradients with
    /// `GradientsParams::from_grads(.., &model)` as usual, or give `sync` an empty
    /// `GradientsParams`; `sync` writes the reduced gradients either way. `model` itself comes
    /// back unchanged (and `sync` reduces after backward, as without this call) where overlap
    /// does not apply: [`DdpConfig::overlap`] off, one rank on the host-staged transport,
    /// inside [`join`](Self::join), or a backend without autodiff hooks in this build (Flex,
    /// NdArray or CUDA, as `SyncBatchNorm`).
    ///
    /// # Errors
    /// [`prepare`](Self::prepare) was not called; the previous overlapped step was never
    /// synchronised; the host transport's earlier failure.
    pub fn overlapped<M: Module>(&mut self, model: &M) -> Result<M> {
        self.open_step(model, None)
    }

    /// [`overlapped`](Self::overlapped) for the last micro-batch of gradient accumulation:
    /// `earlier` are the gradients accumulated over the micro-batches before it (run on `model`
    /// itself, e.g. `GradientsAccumulator::grads`), which the hooks add to each parameter's
    /// gradient before handing it over (a parameter the last micro-batch does not use is
    /// handed over with its earlier gradient alone), as PyTorch DDP's hooks read the
    /// accumulated `.grad` after its `no_sync` micro-batches. Where the step cannot be
    /// overlapped, `sync` adds them to the gradients it is given.
    ///
    /// # Errors
    /// As [`overlapped`](Self::overlapped); `earlier` not of the prepared model's parameters.
    pub fn overlapped_after<M: Module>(
        &mut self,
        model: &M,
        earlier: GradientsParams,
    ) -> Result<M> {
        self.open_step(model, Some(earlier))
    }

    /// [`overlapped`](Self::overlapped), with the gradients accumulated before (`earlier`).
    fn open_step<M: Module>(&mut self, model: &M, earlier: Option<GradientsParams>) -> Result<M> {
        let rank = self.pg.rank();
        let plan = Arc::clone(self.plan.as_ref().ok_or_else(|| not_prepared(rank))?);
        if let Some(open) = self.open.take() {
            // Given up: what it sent is settled when its pass is dropped.
            drop(open.close());
            return Err(DdpError::model_access(
                rank,
                "overlapping gradient communication with backward",
                "the previous step's overlapped model was never synchronised: call \
                 GradSync::sync after the backward of each model GradSync::overlapped returns, \
                 before asking for the next",
            ));
        }
        #[cfg(feature = "cuda")]
        let device_link = self.device.clone();
        #[cfg(not(feature = "cuda"))]
        let device_link: Option<std::convert::Infallible> = None;
        let host_alone = device_link.is_none() && self.pg.world_size().get() == 1;
        // Not overlapped: `sync` reduces after backward, the earlier gradients added.
        if !self.config.overlap || host_alone || self.join.joining() {
            self.earlier = earlier;
            return Ok(model.clone());
        }
        let Some(levels) = self.anchors.for_model(model, plan.slots.len()) else {
            self.earlier = earlier;
            return Ok(model.clone());
        };
        let step = Arc::new(OpenPass::new(rank, Arc::clone(&plan)));
        let Some(hooked) = hook_model(model, &levels, Arc::clone(&step) as Arc<dyn GradSink>)
        else {
            // A parameter in another autodiff context than the first: not overlapped.
            self.earlier = earlier;
            return Ok(model.clone());
        };
        let mut by_slot: Vec<Option<Tensor<1>>> = (0..plan.slots.len()).map(|_| None).collect();
        if let Some(mut earlier) = earlier {
            take_grads(rank, &plan, model, &mut earlier, &mut |slot, g| {
                by_slot[slot] = g;
                Ok(())
            })?;
        }
        let open = match device_link {
            #[cfg(feature = "cuda")]
            Some(link) => {
                let how = (self.config.reduction, self.config.compression);
                let pass = crate::device::begin(&*lock(&link), &self.pg, &plan, how);
                Open::Device { link, pass }
            }
            #[cfg(not(feature = "cuda"))]
            Some(never) => match never {},
            None => {
                let buckets = lock(&self.host).buckets(&plan)?;
                Open::Host {
                    host: Arc::clone(&self.host),
                    pass: Pass::new(rank, &*plan, buckets, true),
                }
            }
        };
        step.begin(open, by_slot);
        // `SyncBatchNorm`'s backward all-reduces go behind the buckets in flight.
        let behind: Arc<dyn crate::nn::InOrder> = Arc::clone(&step) as _;
        self.behind.set(Some(Arc::downgrade(&behind)));
        self.open = Some(step);
        Ok(hooked)
    }

    /// Ends an overlapped step's pass: what the hooks never handed over counts as absent on
    /// this rank, the buckets left go, the answers come, and the reduced gradients are written
    /// into `grads` (replacing this rank's own, if it took them).
    fn finish_open<M: Module>(
        &mut self,
        open: &OpenPass,
        model: &M,
        mut grads: GradientsParams,
    ) -> Result<GradientsParams> {
        let rank = self.pg.rank();
        let plan = Arc::clone(open.plan());
        let state = open.close().ok_or(DdpError::Internal {
            rank,
            what: "an overlapped step's pass was ended twice",
        })?;
        // Where each reduced gradient goes (this rank's own gradients, taken from `grads`, are
        // what the hooks handed over).
        let taken = take_grads(rank, &plan, model, &mut grads, &mut |_, _| Ok(()));
        self.last_overlap = Some((open.early(), plan.buckets.len()));
        match state {
            Open::Host { host, mut pass } => {
                let mut host = lock(&host);
                let targets = match taken {
                    Ok(t) => Some(t),
                    Err(e) => {
                        pass.fail(e);
                        None
                    }
                };
                let reduced = pass.finish(&mut host.comm(), &*plan)?;
                let targets = targets.ok_or(DdpError::Internal {
                    rank,
                    what: "a failed gradient step was not reported",
                })?;
                let spare = put_host(model, &mut grads, &targets, reduced);
                host.recycle(spare);
                Ok(grads)
            }
            #[cfg(feature = "cuda")]
            Open::Device { link, pass } => {
                let link = lock(&link);
                crate::device::finish(rank, pass, &*link, &plan, (model, grads), taken)
            }
        }
    }

    /// Of the last synchronised step, if it was overlapped ([`overlapped`](Self::overlapped)):
    /// how many of its buckets were sent while backward still had work to do (before the last
    /// gradient came), of how many. All but the last when the model's parameters are visited
    /// in the order its forward uses them (Burn's modules declared in order); fewer means that
    /// some buckets waited for the end of backward (a parameter visited before the ones
    /// forward uses earlier, or one this rank did not use: its bucket, and every later one,
    /// waits for the end of the step).
    pub fn sent_during_backward(&self) -> Option<(usize, usize)> {
        self.last_overlap
    }

    /// ZeRO stage 2: from the next step on, the buckets are reduce-scattered so that this rank
    /// receives (and `sync` returns) only the reduced gradients of the parameters `owners` (by
    /// slot) gives it.
    ///
    /// # Errors
    /// What stage 2 cannot run with ([`check_stage2`](burn_ddp_comm::grad::check_stage2));
    /// an overlapped step still open; `prepare` not called.
    pub(crate) fn shard_gradients(&mut self, owners: Vec<Rank>) -> Result<()> {
        let rank = self.pg.rank();
        burn_ddp_comm::grad::check_stage2(&self.config)?;
        if self.open.is_some() {
            return Err(DdpError::model_access(
                rank,
                "sharding the gradients (ZeRO stage 2)",
                "an overlapped step is open: call GradSync::zero2 before GradSync::overlapped \
                 or after GradSync::sync, not between them",
            ));
        }
        let plan = self.plan.as_ref().ok_or_else(|| not_prepared(rank))?;
        let world = self.pg.world_size().as_usize();
        self.zero_owners.set(owners);
        let sharded = self.zero_owners.apply(BucketPlan::clone(plan), world);
        self.plan = Some(Arc::new(sharded));
        Ok(())
    }

    /// The number of trainable parameters of the prepared model; `None` before `prepare`.
    pub(crate) fn trainable_count(&self) -> Option<usize> {
        self.plan.as_ref().map(|p| p.slots.len())
    }

    fn require_plan(&self) -> Result<()> {
        match self.plan {
            Some(_) => Ok(()),
            None => Err(not_prepared(self.pg.rank())),
        }
    }

    /// The gradient all-reduce of [`GradSync::sync`], without the comparison of replicas
    /// and the announcement of a join.
    fn reduce<M: Module>(
        &mut self,
        model: &M,
        mut grads: GradientsParams,
    ) -> Result<GradientsParams> {
        let rank = self.pg.rank();
        let plan = self.plan.as_ref().ok_or_else(|| not_prepared(rank))?;
        #[cfg(feature = "cuda")]
        if let Some(device) = self.device.as_ref() {
            let how = (self.config.reduction, self.config.compression);
            return crate::device::sync(&*lock(device), &self.pg, plan, how, model, grads);
        }
        // At world size 1 the mean is the gradient itself: nothing is read or copied
        // (compression, too, is skipped), as on the Burn 0.21 line. Reading every gradient to
        // the host and back cost an H200 18 ms a step (+1082 % on a 1024x4 MLP,
        // docs/gpu-verification.md).
        if self.pg.world_size().get() == 1 {
            return Ok(grads);
        }
        let mut host = lock(&self.host);
        let mut step = host.begin(plan)?;
        let taken = take_grads(rank, plan, model, &mut grads, &mut |slot, grad| {
            let values = grad
                .map(|g| {
                    g.try_into_data()
                        .map_err(|e| DdpError::model_access(rank, "reading a gradient", e))?
                        .convert::<f32>()
                        .try_into_vec::<f32>()
                        .map_err(|e| {
                            DdpError::model_access(rank, "reading a gradient", format!("{e:?}"))
                        })
                })
                .transpose()?;
            step.push(slot, values.as_deref());
            Ok(())
        });
        // A failure still sends every bucket (no other rank waits for one), then is reported.
        let targets = match taken {
            Ok(targets) => Some(targets),
            Err(e) => {
                step.fail(e);
                None
            }
        };
        // Each bucket freed once its gradients are out; one of a single gradient becomes it.
        let reduced = step.finish()?;
        let targets = targets.ok_or(DdpError::Internal {
            rank,
            what: "a failed gradient step was not reported",
        })?;
        let spare = put_host(model, &mut grads, &targets, reduced);
        host.recycle(spare);
        Ok(grads)
    }
}

impl GradSync {
    /// Trains with **uneven inputs** (PyTorch's `Join`): `train` runs this rank's loop, which
    /// may have more or fewer batches than the other ranks'. Inside it, [`sync`](Self::sync)
    /// and [`sync_buffers`](Self::sync_buffers) first tell every rank which ranks still train
    /// (one small all-reduce). When `train` returns, this rank shadows the others' calls until
    /// every rank has returned: it joins their gradient all-reduce with zeros and no presence,
    /// and their broadcast of buffers. So:
    ///
    /// - a mean of gradients is over the ranks still training (the ranks that ran out are
    ///   counted out of the average; PyTorch's `divide_by_initial_world_size=False`): with
    ///   equal shards, a step in which only some ranks train is the step one process would
    ///   take on those ranks' batches;
    /// - buffers are broadcast by the lowest rank still training;
    /// - at the end, every rank takes the whole model (parameters and buffers) of the rank that
    ///   trained longest (the lowest such), so the replicas are equal again; `join` returns it.
    ///
    /// Optimizer state is each rank's own: a rank that ran out did not step, so a stateful
    /// optimizer's moments (Adam's) lag by the steps it sat out, as with PyTorch's `Join`.
    /// The periodic comparison of replicas pauses inside a join. Without `join`, ranks with
    /// different numbers of batches fail: the first rank to finish leaves the job, and the
    /// others' next collective names it.
    ///
    /// ```no_run
    /// # #[cfg(feature = "burn-0-22")] extern crate burn022 as burn;
    /// # #[cfg(feature = "burn-0-23")] extern crate burn023 as burn;
    /// # use burn::optim::{GradientsParams, Optimizer, SgdConfig};
    /// # use burn_ddp::{DdpConfig, GradSync, ProcessGroup};
    /// # fn main() -> burn_ddp::Result<()> {
    /// # let device = Default::default();
    /// # let mut sync = GradSync::new(ProcessGroup::from_env()?, DdpConfig::default())?;
    /// # let model = sync.prepare(burn::nn::LinearConfig::new(4, 1).init(&device))?;
    /// # let my_batches: Vec<burn::Tensor<2>> = Vec::new();
    /// let mut optim = SgdConfig::new().init();
    /// let model = sync.join(model, |sync, mut model| {
    ///     for x in my_batches {                    // as many as this rank has
    ///         let loss = model.forward(x).mean();
    ///         let grads = GradientsParams::from_grads(loss.backward(), &model);
    ///         let grads = sync.sync(&model, grads)?;
    ///         model = optim.step(0.1, model, grads);
    ///     }
    ///     Ok(model)
    /// })?;
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// What `train` returns (this rank then leaves the join at once, and the other ranks'
    /// next collective fails naming it); ranks that make different calls inside the join
    /// (naming who calls what); a nested `join`; a fault-tolerant job
    /// ([`MembershipError::NotFaultTolerant`](burn_ddp_comm::MembershipError::NotFaultTolerant)); collective failures.
    pub fn join<M, F>(&mut self, model: M, train: F) -> Result<M>
    where
        M: Module,
        F: FnOnce(&mut Self, M) -> Result<M>,
    {
        NotCarried::Join.refuse_on(&self.pg)?;
        self.join.enter(&self.pg, "GradSync", self.plan.is_some())?;
        let finished = train(self, model).and_then(|model| {
            self.shadow(&model)?;
            Ok(model)
        });
        let (model, authority) = self.join.leave(&self.pg, finished)?;
        let AsReplica(model) = load_from(&self.pg, AsReplica(model), authority)?;
        Ok(model)
    }

    /// After this rank's loop inside [`GradSync::join`]: the others' calls, shadowed until
    /// every rank has run out.
    fn shadow<M: Module>(&mut self, model: &M) -> Result<()> {
        let (slot, pg) = (self.join.clone(), self.pg.clone());
        slot.shadow(&pg, |round| match round.call() {
            Some(JoinCall::Gradients) => self.reduce(model, GradientsParams::new()).map(drop),
            Some(JoinCall::Buffers) => self
                .broadcast_buffers(model.clone(), round.root())
                .map(drop),
            Some(JoinCall::Backward) | None => Err(DdpError::Internal {
                rank: pg.rank(),
                what: "a join announced a call this line never makes",
            }),
        })
    }
}

/// `grads` of `model`'s trainable parameters multiplied by `factor`.
fn scale<M: Module>(model: &M, mut grads: GradientsParams, factor: f32) -> GradientsParams {
    struct Scale<'a> {
        grads: &'a mut GradientsParams,
        factor: f32,
    }
    impl ModuleVisitor for Scale<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if let Some(g) = self.grads.remove::<D>(param.id) {
                self.grads.register(param.id, g.mul_scalar(self.factor));
            }
        }
    }
    model.visit(&mut Scale {
        grads: &mut grads,
        factor,
    });
    grads
}

/// This line's [`Replica`]: a Burn module, every float parameter compared, its record as
/// Burn's module record bytes.
pub(crate) struct AsReplica<M>(pub(crate) M);

impl<M: Module> Replica for AsReplica<M> {
    fn params(&self) -> Vec<(ParamInfo, bool)> {
        describe(&self.0)
    }

    fn record_bytes(&self, rank: Rank) -> Result<Vec<u8>> {
        // `valid()` folds running statistics' pending updates in (see `sync_buffers`).
        drop(self.0.valid());
        Ok(self
            .0
            .clone()
            .into_record()
            .into_bytes()
            .map_err(|e| DdpError::model_access(rank, "serialising the model to send", e))?
            .to_vec())
    }

    fn load_record_bytes(self, rank: Rank, bytes: Vec<u8>) -> Result<Self> {
        drop(self.0.valid());
        let record = ModuleRecord::from_bytes(Bytes::from_bytes_vec(bytes))
            .map_err(|e| DdpError::model_access(rank, "reading the model received", e))?;
        self.0
            .try_load_record(record)
            .map(AsReplica)
            .map_err(|e| DdpError::model_access(rank, "loading the model received", e))
    }

    fn param_values(&self, keep: &dyn Fn(&str) -> bool, each: &mut dyn FnMut(String, &[u8])) {
        struct Values<'a> {
            path: Vec<String>,
            keep: &'a dyn Fn(&str) -> bool,
            each: &'a mut dyn FnMut(String, &[u8]),
        }
        impl ModuleVisitor for Values<'_> {
            fn enter_module(&mut self, name: &str, _container: &str) {
                self.path.push(name.to_owned());
            }
            fn exit_module(&mut self, _name: &str, _container: &str) {
                self.path.pop();
            }
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
                let name = self.path.join(".");
                if (self.keep)(&name) {
                    (self.each)(name, param.val().into_data().as_bytes());
                }
            }
        }
        self.0.visit(&mut Values {
            path: Vec::new(),
            keep,
            each,
        });
    }
}

impl GradSync {
    /// Compares `model`'s synchronised parameters across ranks (a digest of each, read to the
    /// host), failing with [`ModelError::ReplicasDiverged`](burn_ddp_comm::ModelError::ReplicasDiverged) naming the first that differs. Every
    /// rank must call it at the same point; [`sync`](Self::sync) does every
    /// `DdpConfig::check_replicas_every` steps. Buffers (BatchNorm's running statistics, which
    /// each rank updates from its own batches) are left out.
    ///
    /// # Errors
    /// [`ModelError::ReplicasDiverged`](burn_ddp_comm::ModelError::ReplicasDiverged); collective failures.
    pub fn check_replicas<M: Module>(&self, model: &M) -> Result<()> {
        self.compare_replicas(model, 0)
    }

    /// The prepared plan's parameters (none before `prepare`) compared across ranks.
    /// Counts one synchronised step, and compares the replicas when a check is due.
    fn replicas_if_due<M: Module>(&mut self, model: &M) -> Result<()> {
        match self.replicas.due() {
            Some(step) => self.compare_replicas(model, step),
            None => Ok(()),
        }
    }

    fn compare_replicas<M: Module>(&self, model: &M, step: u64) -> Result<()> {
        let synced = self
            .plan
            .iter()
            .flat_map(|p| &p.slots)
            .map(|s| s.info.name.clone())
            .collect();
        compare_replicas(&self.pg, step, &AsReplica(model.clone()), &synced)
    }
}

/// Registers the host-staged step's reduced gradients in `grads` (each on its target's device
/// and in its dtype); returns the step's heap buckets for the next one.
fn put_host<M: Module>(
    model: &M,
    grads: &mut GradientsParams,
    targets: &[Target],
    mut reduced: Reduced<'_>,
) -> Vec<Vec<f32>> {
    put_grads(model, grads, targets, &mut |slot, target| {
        let values = reduced.take(slot)?;
        let len = values.len();
        let data = TensorData::new(values, [len]);
        Some(Tensor::<1>::from_data(data, (&target.device, target.dtype)))
    });
    reduced.into_spare()
}

/// The device of `model`'s first trainable parameter.
#[cfg(feature = "cuda")]
pub(crate) fn first_device<M: Module>(model: &M) -> Option<Device> {
    struct First(Option<Device>);
    impl ModuleVisitor for First {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if self.0.is_none() && param.is_require_grad() {
                self.0 = Some(param.val().device());
            }
        }
    }
    let mut first = First(None);
    model.visit(&mut first);
    first.0
}

/// The error for a call that needs [`GradSync::prepare`] first.
fn not_prepared(rank: Rank) -> DdpError {
    DdpError::model_access(
        rank,
        "synchronising gradients",
        "GradSync::prepare was not called: prepare the model once, on every rank, \
                 before training",
    )
}
