//! Fully sharded data parallelism (FSDP, ZeRO stage 3; PyTorch FSDP2's `fully_shard`) on Burn
//! 0.22 and 0.23: every rank holds a shard of every parameter (its first dimension cut among
//! the ranks, `burn_ddp_comm::grad::ShardLayout`), hence of its gradient and of the optimizer's
//! state, and a block's whole parameters exist only while the block computes.
//!
//! ```text
//! let fsdp = FullyShard::new(pg, FsdpConfig::default())?;
//! let mut model = fsdp.shard(model)?;            // rank 0's weights, cut; this rank's shard
//! // in the model's forward, one changed line per block:
//! //     let x = fsdp::gather(&self.block).forward(x);
//! let grads = GradientsParams::from_grads(loss.backward(), &model); // shards' gradients
//! let grads = fsdp.sync(&model, grads)?;         // backward's failures; unsharded params' mean
//! model = optim.step(lr, model, grads);          // Burn's optimizer on the shards, unchanged
//! ```
//!
//! [`gather`] is an autodiff operation of this crate's (as `SyncBatchNorm`'s all-reduce): its
//! forward all-gathers the shards into the whole parameter, its backward reduce-scatters the
//! whole gradient so that each rank receives the mean over the ranks of its own shard, while
//! backward goes on. With `reshard_after_forward` (the default, as FSDP2) the operation is
//! registered memory-bound with a retro-forward that gathers again: Burn's
//! `BalancedCheckpointing` then keeps the recipe instead of the whole parameter, and gathers it
//! again when the block's backward first reads it (docs/design.md, "FSDP"). Every rank runs the
//! same forward and the same graph, so the gathers and reduce-scatters meet in one order.
#![cfg_attr(
    not(any(feature = "flex", feature = "ndarray", feature = "cuda")),
    allow(dead_code)
)]

use std::collections::HashMap;
use std::ops::ControlFlow;
use std::sync::Arc;

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::optim::{GradientsParams, OptimizerRecord};
use burn::store::ModuleRecord;
use burn::tensor::{DType, Device, GradientCheckpointingStrategy, Tensor, TensorData};
use burn_ddp_comm::grad::{self, FsdpState, Held, ShardedParam, StateTensor};
pub use burn_ddp_comm::grad::{FsdpConfig, Precision};
use burn_ddp_comm::{ConfigError, DdpError, ProcessGroup, ReduceOp, Result};

use crate::grads::{describe, params_by_path};

/// One sharded parameter: its whole shape and how it is cut.
pub(crate) type Spec = ShardedParam;

/// A job's fully sharded parameters: how each was cut, the group they are gathered over, and
/// the failures of the gathers in forward and backward, kept for [`FullyShard::sync`]. Cheap
/// to clone (one shared state).
///
/// Made on a thread, it is that thread's (and, for threads that made none, the process's)
/// current sharding: the one the free function [`gather`] uses, so that a model's `forward`
/// needs no handle to it.
#[derive(Debug, Clone)]
pub struct FullyShard {
    state: Arc<FsdpState>,
}

/// The whole parameters of `block`'s sharded parameters, for its forward (FSDP2's
/// pre-forward all-gather), through the current [`FullyShard`] (the one made on this thread,
/// else the process's last); `block` itself where there is none or it shards none of `block`'s
/// parameters. Call it on every rank, in the same order: it is a collective per sharded
/// parameter. Differentiable: the gradient of each whole parameter is reduce-scattered to the
/// ranks' shards in backward.
pub fn gather<M: Module>(block: &M) -> M {
    match FsdpState::current() {
        Some(state) => FullyShard { state }.gather(block),
        None => block.clone(),
    }
}

impl FullyShard {
    /// FSDP over `pg`, with `config`'s options; this thread's (and the process's) current
    /// sharding from now on.
    ///
    /// # Errors
    /// Options this line cannot honour on `pg`: a fault-tolerant group (a lost rank takes its
    /// shards with it).
    pub fn new(pg: ProcessGroup, config: FsdpConfig) -> Result<Self> {
        FsdpState::new(pg, config).map(|state| Self { state })
    }

    /// The group.
    pub fn group(&self) -> &ProcessGroup {
        self.state.group()
    }

    /// The options.
    pub fn config(&self) -> &FsdpConfig {
        self.state.config()
    }

    /// How many parameters this process has all-gathered so far: one per sharded parameter
    /// of each gathered block in forward, and, with `reshard_after_forward`, one more for each
    /// that a backward read again.
    pub fn gathers(&self) -> u64 {
        self.state.gathers()
    }

    fn rank_error(&self, what: &'static str, reason: impl std::fmt::Display) -> DdpError {
        self.state.error(what, reason)
    }

    fn spec(&self, id: &ParamId) -> Option<Spec> {
        self.state.param(id.val())
    }

    /// Makes `link` the device path of this sharding's collectives (the first one set stays).
    #[cfg(any(test, feature = "cuda"))]
    pub(crate) fn set_link(&self, link: Arc<dyn ShardLink>) {
        self.state.set_link(Arc::new(link));
    }

    /// Whether the parameter `id` is sharded here.
    pub(crate) fn shards(&self, id: &ParamId) -> bool {
        self.spec(id).is_some()
    }

    /// `model` with every float parameter replaced by this rank's shard of rank 0's value (its
    /// first dimension cut among the ranks, padded with zero rows where it does not divide):
    /// the model is first checked across the ranks (the same parameters, names and shapes
    /// everywhere), then each parameter's value is rank 0's, broadcast and cut one parameter
    /// at a time (buffers, such as running statistics, stay this rank's). The
    /// shards keep their parameters' ids and whether they are trainable, so Burn's optimizers
    /// and `GradientsParams` work on them unchanged. At world size 1 the model is returned as
    /// it is.
    ///
    /// # Errors
    /// [`ModelError::ModelMismatch`](burn_ddp_comm::ModelError::ModelMismatch) for models that
    /// differ; `reshard_after_forward` on a model whose device is an autodiff device without
    /// gradient checkpointing (the fix in the message); collective failures.
    pub fn shard<M: Module>(&self, model: M) -> Result<M> {
        let pg = self.state.group();
        if self.state.config().reshard_after_forward {
            self.check_checkpointing(&model)?;
        }
        // The same parameters on every rank (names, shapes, dtypes), then rank 0's values one
        // parameter at a time, each cut as it arrives: the whole model is never held twice.
        let infos: Vec<_> = describe(&model).into_iter().map(|(info, _)| info).collect();
        grad::check_same_params(pg, &infos)?;
        // NCCL for the gathers and reduce-scatters of a model on a GPU, once per sharding (a
        // collective, as this call is: every rank learns whether the others' models are there).
        #[cfg(feature = "cuda")]
        if self.state.link().is_none() {
            let device = crate::sync::first_device(&model);
            let auto = burn_ddp_comm::config::GradTransport::Auto;
            if let Some(path) = crate::cuda::DevicePath::connect(pg, auto, device.as_ref())? {
                self.set_link(Arc::new(std::sync::Mutex::new(path)));
            }
        }
        struct Cut<'a> {
            fsdp: &'a FullyShard,
            failed: Option<DdpError>,
        }
        impl ModuleMapper for Cut<'_> {
            fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
                let (id, t, mapper) = param.consume();
                match self
                    .fsdp
                    .state
                    .take_root_and_cut(id.val(), &t.dims(), values(&t))
                {
                    Ok((root_id, mine, shape)) => {
                        let kept = made(&t, mine, shape);
                        let kept = match t.is_require_grad() {
                            true => kept.require_grad(),
                            false => kept,
                        };
                        Param::from_mapped_value(ParamId::from(root_id), kept, mapper)
                    }
                    Err(e) => {
                        if self.failed.is_none() {
                            self.failed = Some(e);
                        }
                        Param::from_mapped_value(id, t, mapper)
                    }
                }
            }
        }
        let mut cut = Cut {
            fsdp: self,
            failed: None,
        };
        let model = model.map(&mut cut);
        match cut.failed {
            Some(e) => Err(e),
            None => Ok(model),
        }
    }

    fn check_checkpointing<M: Module>(&self, model: &M) -> Result<()> {
        let plain = model.devices().into_iter().find(|d| {
            d.is_autodiff()
                && d.gradient_checkpointing_strategy()
                    != Some(GradientCheckpointingStrategy::Balanced)
        });
        match plain {
            None => Ok(()),
            Some(device) => Err(DdpError::Config(ConfigError::InvalidOption {
                option: "FsdpConfig::reshard_after_forward",
                reason: format!(
                    "the model is on {device:?}, an autodiff device without gradient \
                     checkpointing, whose backward keeps every gathered parameter until it is \
                     done: put the model on a checkpointing device \
                     (`Device::default().autodiff().gradient_checkpointing()`, which gathers \
                     each block's parameters again in its backward), or keep the gathered \
                     parameters with `FsdpConfig::default().with_reshard_after_forward(false)`"
                ),
            })),
        }
    }

    /// `block` with each of its sharded parameters replaced by the whole parameter, gathered
    /// from every rank's shard (see the free function [`gather`], which calls this on the
    /// current sharding). A gather that fails gives a parameter of zeros and keeps the error
    /// for [`sync`](Self::sync).
    pub fn gather<M: Module>(&self, block: &M) -> M {
        self.gather_as(block, self.state.config().param_dtype)
    }

    /// [`gather`](Self::gather) in `precision`.
    fn gather_as<M: Module>(&self, block: &M, precision: Precision) -> M {
        struct Whole<'a>(&'a FullyShard, Precision);
        impl ModuleMapper for Whole<'_> {
            fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
                // Already whole (a copy loaded from `full_model`'s record, which keeps the
                // ids) or not sharded: as it is, so the same forward runs on both.
                match self.0.state.held_as(param.id.val(), &param.val().dims()) {
                    Held::Shard(spec) => {
                        param.map(|shard| self.0.gather_tensor(&spec, shard, self.1))
                    }
                    Held::Whole | Held::NotSharded => param,
                }
            }
        }
        block.clone().map(&mut Whole(self, precision))
    }

    fn gather_tensor<const D: usize>(
        &self,
        spec: &Spec,
        shard: Tensor<D>,
        precision: Precision,
    ) -> Tensor<D> {
        let op = tracked::Gather {
            fsdp: self,
            spec,
            reshard: self.state.config().reshard_after_forward,
            precision,
        };
        match crate::autodiff::apply(&op, shard) {
            ControlFlow::Break(whole) => whole,
            // Untracked (inference, a frozen parameter) or on a backend this crate is not built
            // for: the gather without a backward.
            ControlFlow::Continue(shard) => {
                if shard.is_require_grad() {
                    self.state.fail(self.rank_error(
                        "gathering a sharded parameter",
                        format!(
                            "the tensor is on a backend that burn-ddp was not built for ({:?}): \
                             enable its feature for that backend ({})",
                            shard.device(),
                            crate::release::BACKEND_FEATURES
                        ),
                    ));
                }
                self.gather_whole(spec, &shard, precision)
            }
        }
    }

    /// The whole parameter from `shard`, gathered in `precision`, on `shard`'s device: by NCCL
    /// on the GPU when `shard` made a device path for it, else through the host; zeros (and
    /// the error kept for `sync`) when the gather fails.
    fn gather_whole<const D: usize>(
        &self,
        spec: &Spec,
        shard: &Tensor<D>,
        precision: Precision,
    ) -> Tensor<D> {
        match self.link_for(&shard.device()) {
            Some(link) => self.device_gather(&*link, spec, shard, precision),
            None => self.host_gather(spec, shard, precision),
        }
    }

    /// The gradient `whole` of a whole parameter reduce-scattered to this rank's shard, as
    /// [`gather_whole`](Self::gather_whole) chooses the path.
    fn reduce_scatter_whole<const D: usize>(
        &self,
        spec: &Spec,
        whole: &Tensor<D>,
        shard_dtype: DType,
    ) -> Tensor<D> {
        match self.link_for(&whole.device()) {
            Some(link) => self.device_reduce_scatter(&*link, spec, whole, shard_dtype),
            None => self.host_reduce_scatter(spec, whole, shard_dtype),
        }
    }

    /// The device path `shard` set for tensors on `device`, if any.
    fn link_for(&self, device: &Device) -> Option<Arc<dyn ShardLink>> {
        let link = self.state.link()?.downcast_ref::<Arc<dyn ShardLink>>()?;
        link.serves(device).then(|| Arc::clone(link))
    }

    /// The gather on `link`: the shard flattened to f32 on its device (one block), all-gathered
    /// into every rank's block in rank order, the padding rows cut off, reshaped and cast to the
    /// gathered dtype. Nothing goes through the host. The wire is f32 (a `param_dtype` of bf16
    /// or f16 is the cast after it).
    fn device_gather<const D: usize>(
        &self,
        link: &dyn ShardLink,
        spec: &Spec,
        shard: &Tensor<D>,
        precision: Precision,
    ) -> Tensor<D> {
        self.state.count_gather();
        let (device, dtype) = (shard.device(), gathered_dtype(precision, shard.dtype()));
        let block = spec.layout.shard_len();
        let flat = shard.clone().cast(DType::F32).reshape([block]);
        let whole = link
            .all_gather("a sharded parameter", flat, block)
            .and_then(|all| self.fit(all, spec.layout.full_len(), &spec.shape));
        match whole {
            Ok(whole) => whole.cast(dtype),
            Err(e) => {
                self.state.fail(e);
                Tensor::zeros(spec.shape.clone(), (&device, dtype))
            }
        }
    }

    /// The reduce-scatter on `link`: the whole gradient flattened to f32 on its device, padded
    /// with zeros to the ranks' blocks, reduced (the mean or the sum, as configured) and
    /// scattered; this rank's block reshaped to its shard and cast to the shard's dtype. The
    /// wire is f32 (a `reduce_dtype` of bf16 or f16 is not applied on this path).
    fn device_reduce_scatter<const D: usize>(
        &self,
        link: &dyn ShardLink,
        spec: &Spec,
        whole: &Tensor<D>,
        shard_dtype: DType,
    ) -> Tensor<D> {
        let device = whole.device();
        let (block, full) = (spec.layout.shard_len(), spec.layout.full_len());
        let padding = block * spec.layout.world - full;
        let mut flat = whole.clone().cast(DType::F32).reshape([full]);
        if padding > 0 {
            let zeros = Tensor::<1>::zeros([padding], (&device, DType::F32));
            flat = Tensor::cat(vec![flat, zeros], 0);
        }
        let op = self.state.config().reduction.op();
        let mine = link
            .reduce_scatter("a sharded parameter's gradient", flat, block, op)
            .and_then(|mine| self.fit(mine, block, &spec.shard_shape()));
        match mine {
            Ok(mine) => mine.cast(shard_dtype),
            Err(e) => {
                self.state.fail(e);
                Tensor::zeros(spec.shard_shape(), (&device, shard_dtype))
            }
        }
    }

    /// The first `len` values of `flat` in `shape`, or the error of a link that gave fewer.
    fn fit<const D: usize>(
        &self,
        flat: Tensor<1>,
        len: usize,
        shape: &[usize],
    ) -> Result<Tensor<D>> {
        let got = flat.dims()[0];
        if got < len || shape.len() != D {
            return Err(self.rank_error(
                "putting back a sharded parameter from the device path",
                format!("{got} values came back where {len} in the shape {shape:?} were expected"),
            ));
        }
        Ok(flat
            .narrow(0, 0, len)
            .reshape(burn::tensor::Shape::from(shape.to_vec())))
    }

    /// The whole parameter from `shard`, gathered in `precision` through the host.
    fn host_gather<const D: usize>(
        &self,
        spec: &Spec,
        shard: &Tensor<D>,
        precision: Precision,
    ) -> Tensor<D> {
        let dtype = gathered_dtype(precision, shard.dtype());
        let whole = self.state.gather(spec, values(shard), precision);
        let data = TensorData::new(whole, spec.shape.clone()).convert_dtype(dtype);
        Tensor::from_data(data, (&shard.device(), dtype))
    }

    /// The gradient `whole` of a whole parameter reduce-scattered through the host: this rank's
    /// shard of the ranks' mean (or sum), of `shard_dtype`; zeros (and the error kept) when it
    /// fails.
    fn host_reduce_scatter<const D: usize>(
        &self,
        spec: &Spec,
        whole: &Tensor<D>,
        shard_dtype: DType,
    ) -> Tensor<D> {
        let mine = self.state.reduce_scatter(spec, values(whole));
        let data = TensorData::new(mine, spec.shard_shape()).convert_dtype(shard_dtype);
        Tensor::from_data(data, (&whole.device(), shard_dtype))
    }

    /// The gradients of `model`'s parameters ready for Burn's optimizer: the first failure of
    /// this step's gathers and reduce-scatters returned, and the gradients of the parameters
    /// that are not sharded (replicated on every rank) averaged over the ranks (one
    /// all-reduce). The sharded parameters' gradients are already their shards of the mean.
    ///
    /// # Errors
    /// A gather or reduce-scatter of this step that failed (a lost rank, a deadline), naming
    /// the rank at fault; the all-reduce's failures.
    pub fn sync<M: Module>(&self, model: &M, grads: GradientsParams) -> Result<GradientsParams> {
        if let Some(e) = self.state.take_failure() {
            return Err(e);
        }
        let pg = self.state.group();
        if pg.world_size().as_usize() == 1 {
            return Ok(grads);
        }
        let mut grads = grads;
        let mut replicated = Replicated::read(self, model, &mut grads)?;
        pg.all_reduce(&mut replicated.flat, self.state.config().reduction.op())?;
        replicated.put_back(model, &mut grads);
        Ok(grads)
    }

    /// Clips the gradients (the shards' and the replicated parameters') so that their global
    /// L2 norm, over the whole model, is at most `max_norm` (PyTorch's `clip_grad_norm_` on an
    /// FSDP model); returns the norm before clipping. One all-reduce of one value. Call it
    /// after [`sync`](Self::sync), on every rank.
    ///
    /// # Errors
    /// A `max_norm` that is not finite and positive; the all-reduce's failures.
    pub fn clip_grad_norm<M: Module>(
        &self,
        model: &M,
        grads: GradientsParams,
        max_norm: f64,
    ) -> Result<(GradientsParams, f64)> {
        struct Squares<'a> {
            fsdp: &'a FullyShard,
            grads: &'a GradientsParams,
            sharded: f64,
            replicated: f64,
            failed: Option<String>,
        }
        impl ModuleVisitor for Squares<'_> {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
                let Some(g) = self.grads.get::<D>(param.id) else {
                    return;
                };
                match values(&g) {
                    Ok(v) => {
                        let sq: f64 = v.iter().map(|&x| f64::from(x) * f64::from(x)).sum();
                        match self.fsdp.spec(&param.id) {
                            Some(_) => self.sharded += sq,
                            None => self.replicated += sq,
                        }
                    }
                    Err(e) => self.failed = Some(e),
                }
            }
        }
        let mut sq = Squares {
            fsdp: self,
            grads: &grads,
            sharded: 0.0,
            replicated: 0.0,
            failed: None,
        };
        model.visit(&mut sq);
        let (sharded, replicated) = match sq.failed {
            // Still take part in the all-reduce, so no rank waits; then fail.
            Some(_) => (0.0, 0.0),
            None => (sq.sharded, sq.replicated),
        };
        let (norm, coef) = grad::global_norm(self.state.group(), sharded, replicated, max_norm)?;
        if let Some(e) = sq.failed {
            return Err(self.rank_error("reading a gradient", e));
        }
        if coef >= 1.0 {
            return Ok((grads, norm));
        }
        struct Scale<'a> {
            grads: &'a mut GradientsParams,
            coef: f64,
        }
        impl ModuleVisitor for Scale<'_> {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
                if let Some(g) = self.grads.remove::<D>(param.id) {
                    self.grads.register::<D>(param.id, g.mul_scalar(self.coef));
                }
            }
        }
        let mut grads = grads;
        model.visit(&mut Scale {
            grads: &mut grads,
            coef,
        });
        Ok((grads, norm))
    }

    /// The whole model from this rank's sharded `model` (every sharded parameter gathered,
    /// without autodiff): for a checkpoint of one record that loads at any world size (shard
    /// it again with [`shard`](Self::shard)), or for evaluation on one rank. A collective: every
    /// rank calls it.
    ///
    /// # Errors
    /// The gathers' failures.
    pub fn full_model<M: Module>(&self, model: &M) -> Result<M> {
        let model = model.clone().no_grad();
        let whole = self.gather_as(&model, Precision::F32);
        match self.state.take_failure() {
            Some(e) => Err(e),
            None => Ok(whole),
        }
    }

    /// The whole optimizer state from this rank's `record` (Burn's optimizer's, made by
    /// stepping the shards; `ModuleOptimizer::to_record`): every state tensor of a sharded
    /// parameter (Adam's moments, momentum) all-gathered into the parameter's whole shape, the
    /// rest (scalars, the replicated parameters' state) as they are. Every rank gets it; save
    /// it with `full_model`'s record (the parameters keep their ids there, which key this
    /// state), and load it at any world size with
    /// [`shard_optimizer_record`](Self::shard_optimizer_record). A collective: every rank
    /// calls it, with the same parameters' state.
    ///
    /// # Errors
    /// A record that cannot be read; ranks whose records name other tensors; collective
    /// failures.
    pub fn full_optimizer_record(&self, record: OptimizerRecord) -> Result<OptimizerRecord> {
        let fail = |e: String| self.rank_error("gathering the optimizer state", e);
        let bytes = record.into_bytes().map_err(|e| fail(e.to_string()))?;
        let mut pack = read_pack(bytes).map_err(fail)?;
        self.state.gather_state(&mut pack.tensors)?;
        write_optimizer(pack).map_err(fail)
    }

    /// The whole model's record from the record of this rank's sharded model
    /// (`model.into_record()`): every sharded parameter all-gathered into its whole shape on
    /// the host, so that no rank holds the whole model on its device (what the Learner
    /// strategy's checkpoints write). It loads at any world size: into a whole model
    /// (`try_load_record`), or into a sharded one with
    /// [`shard_model_record`](Self::shard_model_record). A collective: every rank calls it.
    ///
    /// # Errors
    /// A record that cannot be read; ranks whose records name other tensors; collective
    /// failures.
    pub fn full_model_record(&self, record: ModuleRecord) -> Result<ModuleRecord> {
        let fail = |e: String| self.rank_error("gathering the model's record", e);
        let bytes = record.into_bytes().map_err(|e| fail(e.to_string()))?;
        let mut pack = read_pack(bytes).map_err(fail)?;
        self.state.gather_state(&mut pack.tensors)?;
        write_model(pack).map_err(fail)
    }

    /// This rank's shards of a whole model's record (as [`full_model_record`](Self::full_model_record)
    /// or a whole model's `into_record` makes it, at any world size), for `model`, this rank's
    /// sharded model: each tensor is matched with `model`'s parameter of the same path, cut as
    /// that parameter is, and given its id, so that `model.try_load_record` takes it without
    /// gathering anything. Returns the record and, for
    /// [`shard_optimizer_record_of`](Self::shard_optimizer_record_of), the ids of the record's
    /// parameters and of `model`'s. No communication.
    ///
    /// # Errors
    /// A record that cannot be read; a tensor of the record that `model` has no parameter for,
    /// or whose shape is not that parameter's whole shape (another model's record).
    pub fn shard_model_record<M: Module>(
        &self,
        model: &M,
        record: ModuleRecord,
    ) -> Result<(ModuleRecord, RecordIds)> {
        let fail = |e: String| self.rank_error("cutting the model's record", e);
        let bytes = record.into_bytes().map_err(|e| fail(e.to_string()))?;
        let mut pack = read_pack(bytes).map_err(fail)?;
        let here: HashMap<String, (u64, Vec<usize>)> = params_by_path(model)
            .into_iter()
            .map(|p| {
                let whole = self.spec(&p.id).map_or(p.dims, |s| s.shape);
                (p.path, (p.id.val(), whole))
            })
            .collect();
        let mut ids = HashMap::new();
        for t in &mut pack.tensors {
            let Some((id, whole)) = here.get(&t.name) else {
                return Err(fail(format!(
                    "the record has a parameter `{}` that the model has not: it is another \
                     model's record",
                    t.name
                )));
            };
            if t.shape != *whole {
                return Err(fail(format!(
                    "the record's `{}` has the shape {:?}, the model's whole parameter {:?}: it \
                     is another model's record, or a shard's",
                    t.name, t.shape, whole
                )));
            }
            if let Some(old) = t.param {
                ids.insert(old, *id);
            }
            t.param = Some(*id);
        }
        self.state.cut_state(&mut pack.tensors);
        Ok((write_model(pack).map_err(fail)?, RecordIds(ids)))
    }

    /// [`shard_optimizer_record`](Self::shard_optimizer_record) of a whole optimizer state
    /// saved with a model record whose parameters had other ids than this process's model
    /// (another run's): each state tensor is given the id of its parameter here (`ids`, from
    /// [`shard_model_record`](Self::shard_model_record) of that model record), then cut.
    ///
    /// # Errors
    /// A record that cannot be read.
    pub fn shard_optimizer_record_of(
        &self,
        record: OptimizerRecord,
        ids: &RecordIds,
    ) -> Result<OptimizerRecord> {
        let fail = |e: String| self.rank_error("cutting the optimizer state", e);
        let bytes = record.into_bytes().map_err(|e| fail(e.to_string()))?;
        let mut pack = read_pack(bytes).map_err(fail)?;
        // Burn keys the state by parameter id: each tensor (`"{id}.{field}"`, the id beside
        // it), each scalar (`"{id}.momentum.time"`) and the metadata (`"{id}"`, its path).
        let rekey = |key: &str| -> Option<String> {
            let (head, field) = match key.split_once('.') {
                Some((head, field)) => (head, Some(field)),
                None => (key, None),
            };
            let new = ids.0.get(&head.parse().ok()?)?;
            Some(match field {
                Some(f) => format!("{new}.{f}"),
                None => new.to_string(),
            })
        };
        for t in &mut pack.tensors {
            let Some(new) = t.param.and_then(|old| ids.0.get(&old)) else {
                continue;
            };
            let name = rekey(&t.name).unwrap_or_else(|| t.name.clone());
            if let Some(dtype) = pack.dtypes.remove(&t.name) {
                pack.dtypes.insert(name.clone(), dtype);
            }
            t.name = name;
            t.param = Some(*new);
        }
        let keys = (pack.scalars.iter_mut().map(|(k, _)| k))
            .chain(pack.metadata.iter_mut().map(|(k, _)| k));
        for key in keys {
            if let Some(new) = rekey(key) {
                *key = new;
            }
        }
        self.state.cut_state(&mut pack.tensors);
        write_optimizer(pack).map_err(fail)
    }

    /// This rank's shard of a whole optimizer state (as
    /// [`full_optimizer_record`](Self::full_optimizer_record) gives it, saved at any world size),
    /// for Burn's optimizer on this
    /// rank's shards (`ModuleOptimizer::load_record`): every state tensor of a sharded
    /// parameter cut as the parameter is. Call it after [`shard`](Self::shard), on a model
    /// loaded from the record saved with this state.
    ///
    /// # Errors
    /// A record that cannot be read.
    pub fn shard_optimizer_record(&self, record: OptimizerRecord) -> Result<OptimizerRecord> {
        self.shard_optimizer_record_of(record, &RecordIds::default())
    }

    /// How many values of `model`'s float parameters this rank holds (its shards, padding
    /// included, and the parameters that are not sharded) and how many the whole model has:
    /// FSDP's saving, as counted (the gradients and Adam's two moments are of the same shapes).
    pub fn held_values<M: Module>(&self, model: &M) -> (usize, usize) {
        struct Count<'a> {
            fsdp: &'a FullyShard,
            held: usize,
            whole: usize,
        }
        impl ModuleVisitor for Count<'_> {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
                let here: usize = param.val().dims().iter().product();
                self.held += here;
                self.whole += match self.fsdp.spec(&param.id) {
                    Some(spec) => spec.layout.full_len(),
                    None => here,
                };
            }
        }
        let mut count = Count {
            fsdp: self,
            held: 0,
            whole: 0,
        };
        model.visit(&mut count);
        (count.held, count.whole)
    }
}

/// The collectives of sharded parameters on a device path: NCCL's on the GPU (`cuda.rs`'s
/// `DevicePath`, set by [`FullyShard::shard`] when the model is there), a stand-in over the
/// host in this module's tests. f32 blocks on the parameters' device, without autodiff.
pub(crate) trait ShardLink: Send + Sync {
    /// Whether tensors on `device` go this way.
    fn serves(&self, device: &Device) -> bool;

    /// Every rank's `send` (`block` elements), concatenated in rank order.
    ///
    /// # Errors
    /// The collective's failures.
    fn all_gather(&self, what: &str, send: Tensor<1>, block: usize) -> Result<Tensor<1>>;

    /// `send` (the ranks' blocks of `block` elements, in rank order) reduced by `op` over the
    /// ranks: this rank's block.
    ///
    /// # Errors
    /// The collective's failures.
    fn reduce_scatter(
        &self,
        what: &str,
        send: Tensor<1>,
        block: usize,
        op: ReduceOp,
    ) -> Result<Tensor<1>>;
}

#[cfg(feature = "cuda")]
impl ShardLink for std::sync::Mutex<crate::cuda::DevicePath> {
    fn serves(&self, device: &Device) -> bool {
        let path = self.lock().unwrap_or_else(|p| p.into_inner());
        crate::cuda::cuda_ordinal(device).is_some_and(|o| Some(o) == path.ordinal())
    }

    fn all_gather(&self, what: &str, send: Tensor<1>, block: usize) -> Result<Tensor<1>> {
        // A panic while it was held left no state half changed that this call reads.
        let path = self.lock().unwrap_or_else(|p| p.into_inner());
        path.all_gather(what, send, block)
    }

    fn reduce_scatter(
        &self,
        what: &str,
        send: Tensor<1>,
        block: usize,
        op: ReduceOp,
    ) -> Result<Tensor<1>> {
        let path = self.lock().unwrap_or_else(|p| p.into_inner());
        path.reduce_scatter(what, send, block, op)
    }
}

/// The ids of a record's parameters (another run's) and of this process's model's, by path
/// ([`FullyShard::shard_model_record`]).
#[derive(Debug, Clone, Default)]
pub struct RecordIds(HashMap<u64, u64>);

/// A record's burnpack contents, its tensors as f32: an optimizer's (Burn keys each state
/// tensor by its parameter's id, `"{id}.{field}"`, with the id beside it; `zero.rs` says more)
/// or a model's (each tensor named by its parameter's path, with the id beside it).
struct Pack {
    tensors: Vec<StateTensor>,
    dtypes: HashMap<String, DType>,
    scalars: Vec<(String, burn_pack::Scalar)>,
    metadata: Vec<(String, String)>,
}

fn read_pack(bytes: burn::tensor::Bytes) -> std::result::Result<Pack, String> {
    let reader = burn_pack::Reader::from_bytes(bytes).map_err(|e| format!("{e:?}"))?;
    let scalars = reader.scalars().clone().into_iter().collect();
    let metadata = reader.metadata().clone().into_iter().collect();
    let (mut tensors, mut dtypes) = (Vec::new(), HashMap::new());
    for tensor in reader.into_tensors().map_err(|e| format!("{e:?}"))? {
        let (name, dtype, shape, param, bytes) =
            tensor.into_parts().map_err(|e| format!("{e:?}"))?;
        let shape = shape.as_slice().to_vec();
        let param = param.or_else(|| name.split('.').next()?.parse().ok());
        let values = TensorData::from_bytes(bytes, shape.clone(), dtype)
            .convert::<f32>()
            .try_into_vec::<f32>()
            .map_err(|e| format!("{e:?}"))?;
        dtypes.insert(name.clone(), dtype);
        tensors.push(StateTensor {
            name,
            param,
            shape,
            values,
        });
    }
    Ok(Pack {
        tensors,
        dtypes,
        scalars,
        metadata,
    })
}

fn write_optimizer(pack: Pack) -> std::result::Result<OptimizerRecord, String> {
    OptimizerRecord::from_bytes(write_pack(pack)?).map_err(|e| e.to_string())
}

fn write_model(pack: Pack) -> std::result::Result<ModuleRecord, String> {
    ModuleRecord::from_bytes(write_pack(pack)?).map_err(|e| e.to_string())
}

fn write_pack(pack: Pack) -> std::result::Result<burn::tensor::Bytes, String> {
    let mut out = Vec::with_capacity(pack.tensors.len());
    for t in pack.tensors {
        let dtype = pack.dtypes.get(&t.name).copied().unwrap_or(DType::F32);
        let data = TensorData::new(t.values, t.shape.clone()).convert_dtype(dtype);
        out.push(burn_pack::Tensor::new(
            t.name,
            dtype,
            t.shape,
            t.param,
            data.into_bytes(),
        ));
    }
    let mut writer = burn_pack::Writer::new(out);
    for (key, value) in pack.scalars {
        writer = writer.with_scalar(&key, value);
    }
    for (key, value) in pack.metadata {
        writer = writer.with_metadata(&key, &value);
    }
    writer.into_bytes().map_err(|e| format!("{e:?}"))
}

/// The gradients of the parameters that are not sharded, flattened for one all-reduce.
struct Replicated {
    flat: Vec<f32>,
    /// (parameter, offset in `flat`, length, dtype, dims) of each that had a gradient.
    parts: Vec<(ParamId, usize, usize, DType, Vec<usize>)>,
}

impl Replicated {
    fn read<M: Module>(fsdp: &FullyShard, model: &M, grads: &mut GradientsParams) -> Result<Self> {
        struct Read<'a> {
            fsdp: &'a FullyShard,
            grads: &'a mut GradientsParams,
            out: Replicated,
            failed: Option<String>,
        }
        impl ModuleVisitor for Read<'_> {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
                if self.fsdp.spec(&param.id).is_some() || !param.is_require_grad() {
                    return;
                }
                // Every rank sends every replicated parameter (zeros where it has no
                // gradient), so the all-reduce has one size everywhere.
                let dims = param.val().dims().to_vec();
                let len: usize = dims.iter().product();
                let offset = self.out.flat.len();
                match self.grads.remove::<D>(param.id) {
                    Some(g) => {
                        let dtype = g.dtype();
                        match values(&g) {
                            Ok(v) => self.out.flat.extend(v),
                            Err(e) => {
                                self.failed = Some(e);
                                self.out.flat.resize(offset + len, 0.0);
                            }
                        }
                        self.out.parts.push((param.id, offset, len, dtype, dims));
                    }
                    None => self.out.flat.resize(offset + len, 0.0),
                }
            }
        }
        let mut read = Read {
            fsdp,
            grads,
            out: Replicated {
                flat: Vec::new(),
                parts: Vec::new(),
            },
            failed: None,
        };
        model.visit(&mut read);
        match read.failed {
            Some(e) => Err(fsdp.rank_error("reading a gradient", e)),
            None => Ok(read.out),
        }
    }

    /// The reduced gradients back into `grads`, each of its parameter's shape and dtype.
    fn put_back<M: Module>(self, model: &M, grads: &mut GradientsParams) {
        struct Put<'a> {
            flat: &'a [f32],
            parts: HashMap<ParamId, (usize, usize, DType, Vec<usize>)>,
            grads: &'a mut GradientsParams,
        }
        impl ModuleVisitor for Put<'_> {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
                if let Some((offset, len, dtype, dims)) = self.parts.remove(&param.id) {
                    let values = self.flat[offset..offset + len].to_vec();
                    let data = TensorData::new(values, dims).convert_dtype(dtype);
                    let grad = Tensor::<D>::from_data(data, (&param.val().device(), dtype));
                    self.grads.register::<D>(param.id, grad);
                }
            }
        }
        let parts = self
            .parts
            .into_iter()
            .map(|(id, offset, len, dtype, dims)| (id, (offset, len, dtype, dims)))
            .collect();
        model.visit(&mut Put {
            flat: &self.flat,
            parts,
            grads,
        });
    }
}

/// The dtype a parameter is gathered in: the shard's own for f32, else the policy's.
fn gathered_dtype(precision: Precision, shard: DType) -> DType {
    match precision {
        Precision::F32 => shard,
        Precision::F16 => DType::F16,
        Precision::Bf16 => DType::BF16,
    }
}

/// `t`'s values as f32, read to the host.
fn values<const D: usize>(t: &Tensor<D>) -> std::result::Result<Vec<f32>, String> {
    t.clone()
        .try_into_data()
        .map_err(|e| e.to_string())?
        .convert::<f32>()
        .try_into_vec::<f32>()
        .map_err(|e| format!("{e:?}"))
}

/// A tensor of `like`'s device and dtype holding `values` in `shape`.
fn made<const D: usize>(like: &Tensor<D>, values: Vec<f32>, shape: Vec<usize>) -> Tensor<D> {
    let dtype = like.dtype();
    let data = TensorData::new(values, shape).convert_dtype(dtype);
    Tensor::from_data(data, (&like.device(), dtype))
}

/// The gather as an autodiff operation, for each backend this crate is built for.
mod tracked {
    #[cfg(any(feature = "flex", feature = "ndarray", feature = "cuda"))]
    use std::ops::ControlFlow;

    use super::{FullyShard, Spec};
    #[cfg(any(feature = "flex", feature = "ndarray", feature = "cuda"))]
    use crate::autodiff;
    use crate::autodiff::AutodiffOp;
    use burn::tensor::Tensor;

    /// The gather of one sharded parameter.
    pub(super) struct Gather<'a> {
        pub(super) fsdp: &'a FullyShard,
        pub(super) spec: &'a Spec,
        pub(super) reshard: bool,
        pub(super) precision: super::Precision,
    }

    impl<const D: usize> AutodiffOp<Tensor<D>> for Gather<'_> {
        #[cfg(any(feature = "flex", feature = "ndarray", feature = "cuda"))]
        fn on<B, C>(&self, t: Tensor<D>) -> ControlFlow<Tensor<D>, Tensor<D>>
        where
            B: autodiff::Backend,
            C: autodiff::CheckpointStrategy,
            autodiff::DispatchTensor: autodiff::DispatchKindConversion<B>
                + autodiff::DispatchKindConversion<autodiff::Autodiff<B, C>>,
        {
            ad::gather::<B, C, D>(self, t)
        }
    }

    #[cfg(any(feature = "flex", feature = "ndarray", feature = "cuda"))]
    mod ad {
        use std::marker::PhantomData;
        use std::ops::ControlFlow::{self, Break, Continue};

        use crate::autodiff::{
            Autodiff, Backend, Backward, CheckpointStrategy, Checkpointer, DispatchKindConversion,
            DispatchTensor, Gradients, Ops,
        };
        use burn::backend::autodiff::checkpoint::retro_forward::RetroForward;
        use burn::backend::autodiff::checkpoint::state::BackwardStates;
        use burn::backend::autodiff::ops::{unary, OpsKind};
        use burn::backend::autodiff::NodeId;
        use burn::tensor::{DType, Tensor};

        use super::super::{FullyShard, Precision, Spec};
        use super::Gather;

        /// What the backward needs: the sharding, the parameter's spec, the shard's dtype.
        #[derive(Debug, Clone)]
        struct State {
            fsdp: FullyShard,
            spec: Spec,
            shard_dtype: DType,
            precision: Precision,
        }

        /// The operation: its backward reduce-scatters the whole gradient to the shards.
        #[derive(Debug)]
        struct GatherOp<const D: usize>;

        impl<B: Backend, const D: usize> Backward<B, 1> for GatherOp<D>
        where
            DispatchTensor: DispatchKindConversion<B>,
        {
            type State = State;

            fn backward(
                self,
                ops: Ops<Self::State, 1>,
                grads: &mut Gradients,
                _checkpointer: &mut Checkpointer,
            ) {
                let state = ops.state;
                unary::<B, _>(ops.parents, ops.node, grads, |grad| {
                    let whole = Tensor::<D>::from_primitive::<B>(grad.clone());
                    let mine =
                        state
                            .fsdp
                            .reduce_scatter_whole(&state.spec, &whole, state.shard_dtype);
                    into_inner::<B, D>(&state.fsdp, mine).unwrap_or(grad)
                });
            }
        }

        /// The gather run again in backward, when a reshard dropped the whole parameter.
        #[derive(Debug)]
        struct Regather<B, const D: usize> {
            shard: NodeId,
            state: State,
            _backend: PhantomData<fn() -> B>,
        }

        impl<B: Backend, const D: usize> RetroForward for Regather<B, D>
        where
            DispatchTensor: DispatchKindConversion<B>,
        {
            fn forward(&self, states: &mut BackwardStates, out_node: NodeId) {
                let shard = states.get_state::<B::FloatTensorPrimitive>(&self.shard);
                let shard = Tensor::<D>::from_primitive::<B>(shard);
                let state = &self.state;
                let whole = state
                    .fsdp
                    .gather_whole(&state.spec, &shard, state.precision);
                if let Some(whole) = into_inner::<B, D>(&self.state.fsdp, whole) {
                    states.save(out_node, whole);
                }
            }
        }

        /// `t` as a primitive of `B` (it was made on `B`'s device); `None`, with the error
        /// kept, if Burn gave it back on another backend.
        fn into_inner<B, const D: usize>(
            fsdp: &FullyShard,
            t: Tensor<D>,
        ) -> Option<B::FloatTensorPrimitive>
        where
            B: Backend,
            DispatchTensor: DispatchKindConversion<B>,
        {
            t.try_into_primitive::<B>()
                .map_err(|e| {
                    fsdp.state.fail(fsdp.rank_error(
                        "gathering a sharded parameter",
                        format!(
                            "Burn gave a tensor back on another backend than {}: {e:?}",
                            std::any::type_name::<B>()
                        ),
                    ))
                })
                .ok()
        }

        /// The gather (`Break`) when `t` is an `Autodiff<B, C>` tensor; `Continue(t)`
        /// otherwise.
        pub(super) fn gather<B, C, const D: usize>(
            op: &Gather<'_>,
            t: Tensor<D>,
        ) -> ControlFlow<Tensor<D>, Tensor<D>>
        where
            B: Backend,
            C: CheckpointStrategy,
            DispatchTensor: DispatchKindConversion<B> + DispatchKindConversion<Autodiff<B, C>>,
        {
            let Ok(tensor) = t.clone().try_into_primitive::<Autodiff<B, C>>() else {
                return Continue(t);
            };
            let shard_dtype = t.dtype();
            let inner = Tensor::<D>::from_primitive::<B>(tensor.primitive().clone());
            let whole = op.fsdp.gather_whole(op.spec, &inner, op.precision);
            let Some(whole) = into_inner::<B, D>(op.fsdp, whole) else {
                return Break(t);
            };
            let state = State {
                fsdp: op.fsdp.clone(),
                spec: op.spec.clone(),
                shard_dtype,
                precision: op.precision,
            };
            let prep = GatherOp::<D>.prepare::<C>([tensor.node()]);
            let kind = match op.reshard {
                true => prep
                    .memory_bound()
                    .retro_forward(Regather::<B, D> {
                        shard: tensor.id(),
                        state: state.clone(),
                        _backend: PhantomData,
                    })
                    .parents([&tensor])
                    .stateful(),
                false => prep.compute_bound().stateful(),
            };
            let out = match kind {
                OpsKind::Tracked(prep) => prep.finish(state, whole),
                OpsKind::UnTracked(prep) => prep.finish(whole),
            };
            Break(Tensor::from_primitive::<Autodiff<B, C>>(out))
        }
    }
}

#[cfg(all(test, feature = "flex"))]
mod tests {
    use super::*;
    use burn::nn::{Linear, LinearConfig};
    use burn::tensor::{Device, Distribution};
    use burn_ddp_comm::DdpConfig;
    use burn_ddp_dev::device::on_thread_ranks;

    fn keep() -> FsdpConfig {
        FsdpConfig::default().with_reshard_after_forward(false)
    }

    #[test]
    fn resharding_without_checkpointing_is_refused_with_both_fixes() {
        let errors = on_thread_ranks(2, |pg| {
            let fsdp = FullyShard::new(pg, FsdpConfig::default()).unwrap();
            let model = LinearConfig::new(5, 3).init(&Device::default().autodiff());
            fsdp.shard(model).unwrap_err().to_string()
        });
        for e in errors {
            assert!(e.contains("gradient_checkpointing()"), "{e}");
            assert!(e.contains("with_reshard_after_forward(false)"), "{e}");
        }
    }

    #[test]
    fn a_sharded_model_is_refused_by_grad_sync() {
        let errors = on_thread_ranks(2, |pg| {
            let fsdp = FullyShard::new(pg.clone(), keep()).unwrap();
            let model = fsdp
                .shard(LinearConfig::new(5, 3).init(&Device::default().autodiff()))
                .unwrap();
            let mut sync = crate::GradSync::new(pg, DdpConfig::default()).unwrap();
            sync.prepare(model).unwrap_err().to_string()
        });
        for e in errors {
            assert!(e.contains("weight is a shard of FullyShard::shard"), "{e}");
        }
    }

    /// The device path's stand-in: the same collectives over the process group, with the
    /// tensors read to the host (the NCCL path is `cuda.rs`'s `DevicePath`, run by the GPU
    /// check). It counts its calls.
    struct HostLink {
        pg: ProcessGroup,
        calls: std::sync::atomic::AtomicUsize,
    }

    impl ShardLink for HostLink {
        fn serves(&self, _device: &Device) -> bool {
            true
        }

        fn all_gather(&self, _what: &str, send: Tensor<1>, block: usize) -> Result<Tensor<1>> {
            self.calls
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let mine = values(&send).unwrap();
            assert_eq!(mine.len(), block);
            let mut all = vec![0.0f32; block * self.pg.world_size().as_usize()];
            self.pg.all_gather(&mine, &mut all)?;
            Ok(Tensor::from_data(
                TensorData::new(all, [all_len(&self.pg, block)]),
                &send.device(),
            ))
        }

        fn reduce_scatter(
            &self,
            _what: &str,
            send: Tensor<1>,
            block: usize,
            op: ReduceOp,
        ) -> Result<Tensor<1>> {
            self.calls
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let all = values(&send).unwrap();
            let mut mine = vec![0.0f32; block];
            self.pg.reduce_scatter(&all, &mut mine, op)?;
            Ok(Tensor::from_data(
                TensorData::new(mine, [block]),
                &send.device(),
            ))
        }
    }

    fn all_len(pg: &ProcessGroup, block: usize) -> usize {
        block * pg.world_size().as_usize()
    }

    /// The device path's packing (each shard one f32 block, the padding rows cut off after the
    /// gather, the whole gradient padded with zeros before the reduce-scatter, reshaped and cast
    /// back) gives what the host path gives: the forward's output and every gradient of a 5x3
    /// layer over 2 ranks (uneven: one padding row), with resharding and its gather in
    /// backward, and with bf16 gathered parameters (cast after an f32 wire).
    #[test]
    fn the_device_path_packs_and_unpacks_as_the_host_path_computes() {
        let device = Device::default().autodiff().gradient_checkpointing();
        device.seed(11);
        let record = LinearConfig::new(5, 3).init(&device).into_record();
        let x = Tensor::<2>::random([4, 5], Distribution::Default, &device);
        for config in [
            FsdpConfig::default(),
            keep(),
            keep().with_param_dtype(Precision::Bf16),
        ] {
            let run = |linked: bool| {
                on_thread_ranks(2, |pg| {
                    let fsdp = FullyShard::new(pg.clone(), config).unwrap();
                    let link = Arc::new(HostLink {
                        pg,
                        calls: Default::default(),
                    });
                    if linked {
                        fsdp.set_link(link.clone());
                    }
                    let model = LinearConfig::new(5, 3)
                        .init(&device)
                        .load_record(record.clone());
                    let model = fsdp.shard(model).unwrap();
                    let whole = gather(&model);
                    let x = x.clone().cast(whole.weight.val().dtype());
                    let out = whole.forward(x);
                    let grads = GradientsParams::from_grads(out.clone().sum().backward(), &model);
                    let grads = fsdp.sync(&model, grads).unwrap();
                    let g = |id| grads.get::<2>(id).map(|g| values(&g).unwrap());
                    let b = |id| grads.get::<1>(id).map(|g| values(&g).unwrap());
                    let calls = link.calls.load(std::sync::atomic::Ordering::Relaxed);
                    let calls = (calls, fsdp.gathers());
                    let got = (
                        values(&out).unwrap(),
                        g(model.weight.id).unwrap(),
                        b(model.bias.as_ref().unwrap().id).unwrap(),
                    );
                    (got, calls)
                })
            };
            let (host, linked) = (run(false), run(true));
            for ((h, (host_calls, host_gathers)), (l, (link_calls, gathers))) in
                host.iter().zip(&linked)
            {
                // Weight and bias: a gather each in forward (and in backward where it reads
                // them again), a reduce-scatter each; all of them on the link.
                assert_eq!((*host_calls, host_gathers), (0, gathers), "{config:?}");
                assert!(*gathers >= 2, "{config:?}");
                assert_eq!(*link_calls as u64, gathers + 2, "{config:?}");
                assert_eq!(h, l, "{config:?}");
            }
        }
    }

    /// The global norm over two ranks' shards (a 5x3 layer: 3 of the weight's 5 rows and 2 of
    /// the bias's 3 on each rank, one of them padding) is the norm of one process's gradient,
    /// and clipping scales it to `max_norm`.
    #[test]
    fn the_global_norm_is_one_process_norm_and_clipping_reaches_max_norm() {
        let device = Device::default().autodiff();
        device.seed(7);
        let whole = LinearConfig::new(5, 3).init(&device);
        let x = Tensor::<2>::random([4, 5], Distribution::Default, &device);
        let loss = |m: &Linear| gather(m).forward(x.clone()).powi_scalar(2).sum();
        let grads = GradientsParams::from_grads(loss(&whole).backward(), &whole);
        let mut want = 0.0f64;
        for g in [
            grads.get::<2>(whole.weight.id).map(|g| values(&g).unwrap()),
            grads
                .get::<1>(whole.bias.as_ref().unwrap().id)
                .map(|g| values(&g).unwrap()),
        ]
        .into_iter()
        .flatten()
        {
            want += g.iter().map(|&v| f64::from(v) * f64::from(v)).sum::<f64>();
        }
        let want = want.sqrt();
        let record = whole.clone().into_record();
        let got = on_thread_ranks(2, |pg| {
            let fsdp = FullyShard::new(pg, keep()).unwrap();
            let model = LinearConfig::new(5, 3)
                .init(&device)
                .load_record(record.clone());
            let model = fsdp.shard(model).unwrap();
            assert_eq!(fsdp.held_values(&model), (3 * 3 + 2, 15 + 3));
            let grads = GradientsParams::from_grads(loss(&model).backward(), &model);
            let grads = fsdp.sync(&model, grads).unwrap();
            let (grads, norm) = fsdp.clip_grad_norm(&model, grads, 1e-3).unwrap();
            let (_, after) = fsdp.clip_grad_norm(&model, grads, 1e9).unwrap();
            (norm, after)
        });
        for (norm, after) in got {
            assert!((norm - want).abs() <= 1e-5 * want, "{norm} vs {want}");
            assert!((after - 1e-3).abs() <= 1e-6, "{after}");
        }
    }
}
