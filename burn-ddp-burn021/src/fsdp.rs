//! Fully sharded data parallelism (FSDP, ZeRO stage 3; PyTorch FSDP2's `fully_shard`) on Burn
//! 0.21: every rank holds a shard of every parameter (its first dimension cut among the ranks,
//! `burn_ddp_comm::grad::ShardLayout`), hence of its gradient and of the optimizer's state, and
//! a block's whole parameters exist only while the block computes.
//!
//! ```text
//! type B = Autodiff<Ddp<NdArray>, BalancedCheckpointing>;   // resharding needs checkpointing
//! let fsdp = FullyShard::new(pg, FsdpConfig::default())?;
//! let mut model = fsdp.shard::<B, _>(model)?;   // rank 0's weights, cut; this rank's shard
//! // in the model's forward (`impl<B: FsdpBackend> MyModel<B>`), one changed line per block:
//! //     let x = fsdp::gather(&self.block).forward(x);
//! let grads = GradientsParams::from_grads(loss.backward(), &model);
//! let grads = fsdp.sync(&model, grads)?;        // backward's failures; unsharded params' mean
//! model = optim.step(lr, model, grads);         // Burn's optimizer on the shards, unchanged
//! ```
//!
//! The same design as the Burn 0.22/0.23 line's (`docs/design.md`, "FSDP"), on the core's
//! `FsdpState`: [`gather`] is an autodiff operation of this crate's on `Autodiff<Ddp<B>, C>`
//! (burn-autodiff 0.21's public `Backward`), whose backward reduce-scatters the whole gradient
//! to the ranks' shards; with `reshard_after_forward` it is registered memory-bound with a
//! retro-forward that gathers again, which Burn's `BalancedCheckpointing` runs when the block's
//! backward reads the whole parameter. The backend names the strategy here (`C`), so
//! [`FullyShard::shard`] refuses resharding under `NoCheckpointing` (Burn's default).

use std::any::TypeId;
use std::collections::HashMap;
use std::sync::Arc;

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::retro_forward::RetroForward;
use burn::backend::autodiff::checkpoint::state::BackwardStates;
use burn::backend::autodiff::checkpoint::strategy::{BalancedCheckpointing, CheckpointStrategy};
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{unary, Backward, Ops, OpsKind};
use burn::backend::autodiff::NodeId;
use burn::backend::Autodiff;
use burn::module::{AutodiffModule, Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::optim::momentum::MomentumState;
use burn::optim::record::AdaptorRecord;
use burn::optim::{
    Adam, AdamW, AdaptiveMomentumState, GradientsParams, Sgd, SgdState, SimpleOptimizer,
};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{DType, Tensor, TensorMetadata, TensorPrimitive};
use burn_backend::tensor::FloatTensor;
use burn_backend::FloatDType;
use burn_ddp_comm::grad::{self, FsdpState, Held, ShardedParam};
pub use burn_ddp_comm::grad::{FsdpConfig, Precision};
use burn_ddp_comm::{ConfigError, DdpError, ProcessGroup, ReduceOp, Result};

#[cfg(feature = "cuda")]
use crate::ddp::gpu;
use crate::ddp::{float_dtype, param_infos, read_f32, write_f32};
use crate::Ddp;

mod sealed {
    pub trait Sealed {}
}

/// One gather: the sharding, the parameter, how it is gathered. What a [`FsdpBackend`] is
/// handed (its fields are this crate's).
#[derive(Debug)]
pub struct Gathering<'a> {
    fsdp: &'a FullyShard,
    param: &'a ShardedParam,
    precision: Precision,
}

/// The backends FSDP runs on: `Autodiff<Ddp<B>, C>` (training: the gather is differentiable,
/// its backward reduce-scatters) and `Ddp<B>` (validation and inference: the gather alone). A
/// model whose `forward` calls [`gather`] is generic over `B: FsdpBackend`.
pub trait FsdpBackend: Backend + sealed::Sealed {
    /// Whether the backend's autodiff can gather a parameter again in backward (Burn's
    /// `BalancedCheckpointing`); true without autodiff, where there is no backward.
    fn regathers() -> bool;

    /// The whole parameter from `shard`.
    #[doc(hidden)]
    fn gather_whole(how: &Gathering<'_>, shard: FloatTensor<Self>) -> FloatTensor<Self>;
}

impl<B: Backend> sealed::Sealed for Ddp<B> {}
impl<B: Backend, C: CheckpointStrategy> sealed::Sealed for Autodiff<Ddp<B>, C> {}

impl<B: Backend> FsdpBackend for Ddp<B> {
    fn regathers() -> bool {
        true
    }

    fn gather_whole(how: &Gathering<'_>, shard: FloatTensor<Self>) -> FloatTensor<Self> {
        how.fsdp.gather_one::<Self>(how.param, shard, how.precision)
    }
}

impl<B: Backend, C: CheckpointStrategy> FsdpBackend for Autodiff<Ddp<B>, C> {
    fn regathers() -> bool {
        TypeId::of::<C>() == TypeId::of::<BalancedCheckpointing>()
    }

    fn gather_whole(how: &Gathering<'_>, shard: FloatTensor<Self>) -> FloatTensor<Self> {
        let fsdp = how.fsdp;
        let shard_dtype = shard.primitive.dtype();
        let whole = fsdp.gather_one::<Ddp<B>>(how.param, shard.primitive.clone(), how.precision);
        let state = State {
            fsdp: fsdp.clone(),
            param: how.param.clone(),
            shard_dtype,
            precision: how.precision,
        };
        let prep = GatherOp.prepare::<C>([shard.node.clone()]);
        let kind = match fsdp.state.config().reshard_after_forward {
            true => prep
                .memory_bound()
                .retro_forward(Regather::<B> {
                    shard: shard.node.id,
                    state: state.clone(),
                    _backend: std::marker::PhantomData,
                })
                .parents([&shard])
                .stateful(),
            false => prep.compute_bound().stateful(),
        };
        match kind {
            OpsKind::Tracked(prep) => prep.finish(state, whole),
            OpsKind::UnTracked(prep) => prep.finish(whole),
        }
    }
}

/// What rewrites a state tensor of a sharded parameter: given the parameter, the tensor's dims
/// and device, and the tensor.
type StateMap<'a, B> = dyn FnMut(
        &ShardedParam,
        &[usize],
        &<B as burn::tensor::backend::BackendTypes>::Device,
        FloatTensor<<B as AutodiffBackend>::InnerBackend>,
    ) -> FloatTensor<<B as AutodiffBackend>::InnerBackend>
    + 'a;

/// An optimizer record by parameter (`OptimizerAdaptor`'s record, whatever map it is kept in):
/// what [`FullyShard::full_optimizer_record`] gathers and
/// [`FullyShard::shard_optimizer_record`] cuts.
type OptimState<O, B> = HashMap<ParamId, AdaptorRecord<O, B>>;

/// Burn's optimizers whose state FSDP gathers and cuts on Burn 0.21, whose optimizer records
/// are typed by the state's rank (each `O::State<D>`): each says where its per-parameter
/// tensors are. Adam and AdamW (their moments); SGD (its momentum's velocity, if any).
pub trait FsdpOptimizer<B: Backend>: SimpleOptimizer<B> {
    /// `state` (of a parameter on `device`) with each of its per-parameter tensors mapped by
    /// `f`.
    ///
    /// # Errors
    /// A state whose tensors this crate cannot reach.
    fn map_state<const D: usize>(
        state: Self::State<D>,
        device: &B::Device,
        f: &mut dyn FnMut(Tensor<B, D>) -> Tensor<B, D>,
    ) -> std::result::Result<Self::State<D>, String>;
}

/// Adam's and AdamW's moments mapped by `f`.
fn map_moments<B: Backend, const D: usize>(
    m: &mut AdaptiveMomentumState<B, D>,
    f: &mut dyn FnMut(Tensor<B, D>) -> Tensor<B, D>,
) {
    m.moment_1 = f(m.moment_1.clone());
    m.moment_2 = f(m.moment_2.clone());
    m.max_moment_2 = m.max_moment_2.take().map(&mut *f);
}

impl<B: Backend> FsdpOptimizer<B> for Adam {
    fn map_state<const D: usize>(
        mut state: Self::State<D>,
        _device: &B::Device,
        f: &mut dyn FnMut(Tensor<B, D>) -> Tensor<B, D>,
    ) -> std::result::Result<Self::State<D>, String> {
        map_moments(&mut state.momentum, f);
        Ok(state)
    }
}

impl<B: Backend> FsdpOptimizer<B> for AdamW {
    fn map_state<const D: usize>(
        mut state: Self::State<D>,
        _device: &B::Device,
        f: &mut dyn FnMut(Tensor<B, D>) -> Tensor<B, D>,
    ) -> std::result::Result<Self::State<D>, String> {
        map_moments(&mut state.momentum, f);
        Ok(state)
    }
}

impl<B: Backend> FsdpOptimizer<B> for Sgd<B> {
    fn map_state<const D: usize>(
        state: Self::State<D>,
        device: &B::Device,
        f: &mut dyn FnMut(Tensor<B, D>) -> Tensor<B, D>,
    ) -> std::result::Result<Self::State<D>, String> {
        use burn::record::{FullPrecisionSettings, Record};
        let Some(momentum) = state.momentum else {
            return Ok(state);
        };
        // `MomentumState::velocity` is private (burn-optim 0.21.0 `optim/momentum.rs` line
        // 26), but the item of its record is not (burn-derive 0.21.0 `record/item/
        // codegen_struct.rs` line 42 makes every field of a record's item `pub`) and
        // `MomentumState::new` is public (`derive(new)`, line 24): the velocity goes out
        // through the item, at full precision, and back through `new`.
        let item = momentum.into_item::<FullPrecisionSettings>();
        let velocity = Tensor::<B, D>::from_item::<FullPrecisionSettings>(item.velocity, device);
        Ok(SgdState::new(Some(MomentumState::new(f(velocity)))))
    }
}

/// The ids of `model`'s float parameters, in visit order.
fn param_ids<B: Backend, M: Module<B>>(model: &M) -> Vec<ParamId> {
    struct Ids(Vec<ParamId>);
    impl<B: Backend> ModuleVisitor<B> for Ids {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            self.0.push(param.id);
        }
    }
    let mut ids = Ids(Vec::new());
    model.visit(&mut ids);
    ids.0
}

/// The dtype a parameter of `shard_dtype` is gathered in under `precision`.
fn gathered_dtype(precision: Precision, shard_dtype: DType) -> DType {
    match precision {
        Precision::F32 => shard_dtype,
        Precision::F16 => DType::F16,
        Precision::Bf16 => DType::BF16,
    }
}

/// `t` (of `len` elements) flattened, as f32.
fn f32_flat<B2: Backend>(t: FloatTensor<B2>, len: usize) -> FloatTensor<B2> {
    cast::<B2>(B2::float_reshape(t, [len].into()), DType::F32)
}

/// `t` cast to `dtype` (itself where it is of it).
fn cast<B2: Backend>(t: FloatTensor<B2>, dtype: DType) -> FloatTensor<B2> {
    match t.dtype() == dtype {
        true => t,
        false => B2::float_cast(t, float_dtype(dtype)),
    }
}

/// The collectives of sharded parameters on a device path: NCCL's on the GPU (`ddp/gpu.rs`,
/// set by [`FullyShard::shard`] for a model on `Ddp<Cuda>`'s GPU), a stand-in over the host in
/// this module's tests. f32 blocks of `B2`'s tensors (`B2` is the gathers' backend, `Ddp<B>`),
/// without autodiff.
pub(crate) trait ShardLink<B2: Backend>: Send + Sync {
    /// Whether tensors on `device` go this way.
    fn serves(&self, device: &B2::Device) -> bool;

    /// Every rank's `send` (`block` elements), concatenated in rank order.
    ///
    /// # Errors
    /// The collective's failures.
    fn all_gather(
        &self,
        what: &str,
        send: FloatTensor<B2>,
        block: usize,
    ) -> Result<FloatTensor<B2>>;

    /// `send` (the ranks' blocks of `block` elements, in rank order) reduced by `op` over the
    /// ranks: this rank's block.
    ///
    /// # Errors
    /// The collective's failures.
    fn reduce_scatter(
        &self,
        what: &str,
        send: FloatTensor<B2>,
        block: usize,
        op: ReduceOp,
    ) -> Result<FloatTensor<B2>>;
}

/// NCCL's collectives for `Ddp<Cuda>`'s tensors (whose float tensors are `Cuda`'s), on the
/// communicator's GPU.
#[cfg(feature = "cuda")]
impl ShardLink<Ddp<gpu::Gpu>> for burn_ddp_comm::cuda::NcclComm {
    fn serves(&self, device: &gpu::GpuDevice) -> bool {
        device.index == self.device_ordinal()
    }

    fn all_gather(&self, what: &str, send: gpu::CudaFloat, block: usize) -> Result<gpu::CudaFloat> {
        gpu::all_gather_run(self, what, send, block)
    }

    fn reduce_scatter(
        &self,
        what: &str,
        send: gpu::CudaFloat,
        block: usize,
        op: ReduceOp,
    ) -> Result<gpu::CudaFloat> {
        gpu::reduce_scatter_run(self, what, send, block, op)
    }
}

/// What the backward needs: the sharding, the parameter, the shard's dtype, the precision.
#[derive(Debug, Clone)]
struct State {
    fsdp: FullyShard,
    param: ShardedParam,
    shard_dtype: DType,
    precision: Precision,
}

/// The gather: its backward reduce-scatters the whole gradient to the shards.
#[derive(Debug)]
struct GatherOp;

impl<B: Backend> Backward<Ddp<B>, 1> for GatherOp {
    type State = State;

    fn backward(
        self,
        ops: Ops<Self::State, 1>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let state = ops.state;
        unary::<Ddp<B>, _>(ops.parents, ops.node, grads, |grad| {
            state
                .fsdp
                .reduce_scatter_one::<Ddp<B>>(&state.param, grad, state.shard_dtype)
        });
    }
}

/// The gather run again in backward, when a reshard dropped the whole parameter.
#[derive(Debug)]
struct Regather<B> {
    shard: NodeId,
    state: State,
    _backend: std::marker::PhantomData<fn() -> B>,
}

impl<B: Backend> RetroForward for Regather<B> {
    fn forward(&self, states: &mut BackwardStates, out_node: NodeId) {
        let shard = states.get_state::<FloatTensor<Ddp<B>>>(&self.shard);
        let s = &self.state;
        let whole = s.fsdp.gather_one::<Ddp<B>>(&s.param, shard, s.precision);
        states.save(out_node, whole);
    }
}

/// A job's fully sharded parameters (the core's `FsdpState`): how each was cut, the group they
/// are gathered over, the failures of the gathers in forward and backward, kept for
/// [`FullyShard::sync`]. Cheap to clone. Made on a thread, it is that thread's (and, for
/// threads that made none, the process's) current sharding, the one the free function
/// [`gather`] uses, so that a model's `forward` needs no handle to it.
#[derive(Debug, Clone)]
pub struct FullyShard {
    state: Arc<FsdpState>,
}

/// The whole parameters of `block`'s sharded parameters, for its forward (FSDP2's
/// pre-forward all-gather), through the current [`FullyShard`]; `block` itself where there is
/// none, or where its parameters are whole (a model loaded from
/// [`full_model`](FullyShard::full_model)'s record). Call it on every rank, in the same order:
/// it is a collective per sharded parameter. Differentiable under autodiff: the gradient of
/// each whole parameter is reduce-scattered to the ranks' shards in backward.
pub fn gather<B: FsdpBackend, M: Module<B>>(block: &M) -> M {
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
    /// A fault-tolerant group (a lost rank takes its shards with it).
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

    /// Whether the parameter `id` is sharded here.
    pub(crate) fn shards(&self, id: &ParamId) -> bool {
        self.state.param(id.val()).is_some()
    }

    /// `model` with every float parameter replaced by this rank's shard of rank 0's value (its
    /// first dimension cut among the ranks, padded with zero rows where it does not divide;
    /// a parameter of one row stays whole): the model is first checked across the ranks, then
    /// each parameter's value is rank 0's, broadcast and cut one parameter at a time (buffers
    /// stay this rank's). The shards keep
    /// their parameters' ids and whether they are trainable, so Burn's optimizers and
    /// `GradientsParams` work on them unchanged. At world size 1 the model is returned as it is.
    ///
    /// # Errors
    /// [`ModelError::ModelMismatch`](burn_ddp_comm::ModelError::ModelMismatch) for models that
    /// differ; `reshard_after_forward` on a backend without gradient checkpointing (the fix in
    /// the message); collective failures.
    pub fn shard<B, M>(&self, model: M) -> Result<M>
    where
        B: FsdpBackend + AutodiffBackend,
        M: AutodiffModule<B>,
    {
        if self.state.config().reshard_after_forward && !B::regathers() {
            return Err(DdpError::Config(ConfigError::InvalidOption {
                option: "FsdpConfig::reshard_after_forward",
                reason: format!(
                    "the backend {} keeps every gathered parameter until its backward is done \
                     (Burn's NoCheckpointing): train on `Autodiff<Ddp<_>, \
                     BalancedCheckpointing>`, which gathers each block's parameters again in \
                     its backward, or keep the gathered parameters with \
                     `FsdpConfig::default().with_reshard_after_forward(false)`",
                    std::any::type_name::<B>()
                ),
            }));
        }
        // The same parameters on every rank (names, shapes, dtypes), then rank 0's values one
        // parameter at a time, each cut as it arrives: the whole model is never held twice.
        grad::check_same_params(self.state.group(), &param_infos::<B, M>(&model))?;
        #[cfg(feature = "cuda")]
        self.connect::<B, M>(&model)?;
        struct Cut<'a> {
            state: &'a FsdpState,
            failed: Option<DdpError>,
        }
        impl<B: Backend> ModuleMapper<B> for Cut<'_> {
            fn map_float<const D: usize>(
                &mut self,
                param: Param<Tensor<B, D>>,
            ) -> Param<Tensor<B, D>> {
                let (id, t, mapper) = param.consume();
                let trainable = t.is_require_grad();
                let (device, dims) = (t.device(), t.dims());
                let prim = t.clone().into_primitive().tensor();
                let dtype = prim.dtype();
                match self
                    .state
                    .take_root_and_cut(id.val(), &dims, read_f32::<B>(prim))
                {
                    Ok((root_id, mine, shape)) => {
                        let prim = write_f32::<B>(mine, shape.into(), dtype, &device);
                        let kept = Tensor::from_primitive(TensorPrimitive::Float(prim));
                        let kept = match trainable {
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
            state: &self.state,
            failed: None,
        };
        let model = model.map(&mut cut);
        match cut.failed {
            Some(e) => Err(e),
            None => Ok(model),
        }
    }

    /// NCCL for the gathers and reduce-scatters of a model on `Ddp<Cuda>`'s GPU, once per
    /// sharding: a collective, as [`shard`](Self::shard) is (every rank learns whether the
    /// others' models are on a GPU too; `burn_ddp_comm::cuda::connect_where_placed`).
    ///
    /// # Errors
    /// Some ranks' models are on a GPU and others' not; what NCCL's set-up fails with.
    #[cfg(feature = "cuda")]
    fn connect<B: AutodiffBackend, M: Module<B>>(&self, model: &M) -> Result<()> {
        if self.state.link().is_some() {
            return Ok(());
        }
        let device = model.devices().into_iter().next();
        let ordinal = device
            .as_ref()
            .filter(|_| gpu::is_ddp_cuda::<B::InnerBackend>())
            .and_then(gpu::cuda_ordinal);
        let placed = device.map_or_else(|| "no parameters".to_owned(), |d| format!("{d:?}"));
        let auto = burn_ddp_comm::config::GradTransport::Auto;
        let pg = self.state.group();
        if let Some(comm) = burn_ddp_comm::cuda::connect_where_placed(pg, auto, ordinal, &placed)? {
            self.set_link::<Ddp<gpu::Gpu>>(Arc::new(comm));
        }
        Ok(())
    }

    /// `block` with each of its sharded parameters replaced by the whole parameter, gathered
    /// from every rank's shard (see the free function [`gather`], which calls this on the
    /// current sharding). A gather that fails gives a parameter of zeros and keeps the error
    /// for [`sync`](Self::sync).
    pub fn gather<B: FsdpBackend, M: Module<B>>(&self, block: &M) -> M {
        self.gather_as(block, self.state.config().param_dtype)
    }

    /// [`gather`](Self::gather) in `precision`.
    fn gather_as<B: FsdpBackend, M: Module<B>>(&self, block: &M, precision: Precision) -> M {
        struct Whole<'a>(&'a FullyShard, Precision);
        impl<B: FsdpBackend> ModuleMapper<B> for Whole<'_> {
            fn map_float<const D: usize>(
                &mut self,
                param: Param<Tensor<B, D>>,
            ) -> Param<Tensor<B, D>> {
                // Already whole (a copy loaded from `full_model`'s record, which keeps the
                // ids) or not sharded: as it is, so the same forward runs on both.
                let p = match self.0.state.held_as(param.id.val(), &param.val().dims()) {
                    Held::Shard(p) => p,
                    Held::Whole | Held::NotSharded => return param,
                };
                let how = Gathering {
                    fsdp: self.0,
                    param: &p,
                    precision: self.1,
                };
                param.map(|shard| {
                    let whole = B::gather_whole(&how, shard.into_primitive().tensor());
                    Tensor::from_primitive(TensorPrimitive::Float(whole))
                })
            }
        }
        block.clone().map(&mut Whole(self, precision))
    }

    /// The whole parameter from `shard`, gathered in `precision`, on `shard`'s device: on the
    /// device path `shard` set for that device (NCCL on the GPU), else through the host; zeros
    /// (and the error kept for `sync`) when the gather fails.
    fn gather_one<B2: Backend>(
        &self,
        p: &ShardedParam,
        shard: FloatTensor<B2>,
        precision: Precision,
    ) -> FloatTensor<B2> {
        match self.link_for::<B2>(&B2::float_device(&shard)) {
            Some(link) => self.device_gather(&*link, p, shard, precision),
            None => self.host_gather::<B2>(p, shard, precision),
        }
    }

    /// The gradient `whole` of a whole parameter reduce-scattered to this rank's shard, as
    /// [`gather_one`](Self::gather_one) chooses the path.
    fn reduce_scatter_one<B2: Backend>(
        &self,
        p: &ShardedParam,
        whole: FloatTensor<B2>,
        shard_dtype: DType,
    ) -> FloatTensor<B2> {
        match self.link_for::<B2>(&B2::float_device(&whole)) {
            Some(link) => self.device_reduce_scatter(&*link, p, whole, shard_dtype),
            None => self.host_reduce_scatter::<B2>(p, whole, shard_dtype),
        }
    }

    /// Makes `link` the device path of this sharding's collectives for `B2`'s tensors (the
    /// first one set stays).
    #[cfg(any(test, feature = "cuda"))]
    fn set_link<B2: Backend>(&self, link: Arc<dyn ShardLink<B2>>) {
        self.state.set_link(Arc::new(link));
    }

    /// The device path `shard` set for `B2`'s tensors on `device`, if any.
    fn link_for<B2: Backend>(&self, device: &B2::Device) -> Option<Arc<dyn ShardLink<B2>>> {
        let link = self
            .state
            .link()?
            .downcast_ref::<Arc<dyn ShardLink<B2>>>()?;
        link.serves(device).then(|| Arc::clone(link))
    }

    /// The gather on `link`: the shard flattened to f32 on its device (one block), all-gathered
    /// into every rank's block in rank order, the padding rows cut off, reshaped and cast to the
    /// gathered dtype. Nothing goes through the host. The wire is f32 (a `param_dtype` of bf16
    /// or f16 is the cast after it).
    fn device_gather<B2: Backend>(
        &self,
        link: &dyn ShardLink<B2>,
        p: &ShardedParam,
        shard: FloatTensor<B2>,
        precision: Precision,
    ) -> FloatTensor<B2> {
        self.state.count_gather();
        let device = B2::float_device(&shard);
        let dtype = gathered_dtype(precision, shard.dtype());
        let block = p.layout.shard_len();
        let flat = f32_flat::<B2>(shard, block);
        let whole = link
            .all_gather("a sharded parameter", flat, block)
            .and_then(|all| self.fit::<B2>(all, p.layout.full_len(), &p.shape));
        match whole {
            Ok(whole) => cast::<B2>(whole, dtype),
            Err(e) => {
                self.state.fail(e);
                B2::float_zeros(p.shape.clone().into(), &device, float_dtype(dtype))
            }
        }
    }

    /// The reduce-scatter on `link`: the whole gradient flattened to f32 on its device, padded
    /// with zeros to the ranks' blocks, reduced (the mean or the sum, as configured) and
    /// scattered; this rank's block reshaped to its shard and cast to the shard's dtype. The
    /// wire is f32 (a `reduce_dtype` of bf16 or f16 is not applied on this path).
    fn device_reduce_scatter<B2: Backend>(
        &self,
        link: &dyn ShardLink<B2>,
        p: &ShardedParam,
        whole: FloatTensor<B2>,
        shard_dtype: DType,
    ) -> FloatTensor<B2> {
        let device = B2::float_device(&whole);
        let (block, full) = (p.layout.shard_len(), p.layout.full_len());
        let padding = block * p.layout.world - full;
        let mut flat = f32_flat::<B2>(whole, full);
        if padding > 0 {
            let zeros = B2::float_zeros([padding].into(), &device, FloatDType::F32);
            flat = B2::float_cat(vec![flat, zeros], 0);
        }
        let op = self.state.config().reduction.op();
        let mine = link
            .reduce_scatter("a sharded parameter's gradient", flat, block, op)
            .and_then(|mine| self.fit::<B2>(mine, block, &p.shard_shape()));
        match mine {
            Ok(mine) => cast::<B2>(mine, shard_dtype),
            Err(e) => {
                self.state.fail(e);
                B2::float_zeros(p.shard_shape().into(), &device, float_dtype(shard_dtype))
            }
        }
    }

    /// The first `len` values of `flat` in `shape`, or the error of a link that gave fewer.
    fn fit<B2: Backend>(
        &self,
        flat: FloatTensor<B2>,
        len: usize,
        shape: &[usize],
    ) -> Result<FloatTensor<B2>> {
        let got = flat.shape().num_elements();
        if got < len || shape.iter().product::<usize>() != len {
            return Err(self.state.error(
                "putting back a sharded parameter from the device path",
                format!("{got} values came back where {len} in the shape {shape:?} were expected"),
            ));
        }
        let kept = B2::float_slice(flat, &[burn_backend::Slice::from(0..len)]);
        Ok(B2::float_reshape(kept, shape.to_vec().into()))
    }

    /// The whole parameter from `shard`, gathered in `precision` through the host, on `shard`'s
    /// device; zeros (and the error kept for `sync`) when the gather fails.
    fn host_gather<B2: Backend>(
        &self,
        p: &ShardedParam,
        shard: FloatTensor<B2>,
        precision: Precision,
    ) -> FloatTensor<B2> {
        let device = B2::float_device(&shard);
        let dtype = gathered_dtype(precision, shard.dtype());
        let whole = self.state.gather(p, read_f32::<B2>(shard), precision);
        write_f32::<B2>(whole, p.shape.clone().into(), dtype, &device)
    }

    /// The gradient `whole` of a whole parameter reduce-scattered through the host: this rank's
    /// shard of the ranks' mean (or sum), of `shard_dtype`; zeros (and the error kept) when it
    /// fails.
    fn host_reduce_scatter<B2: Backend>(
        &self,
        p: &ShardedParam,
        whole: FloatTensor<B2>,
        shard_dtype: DType,
    ) -> FloatTensor<B2> {
        let device = B2::float_device(&whole);
        let mine = self.state.reduce_scatter(p, read_f32::<B2>(whole));
        write_f32::<B2>(mine, p.shard_shape().into(), shard_dtype, &device)
    }

    /// The gradients of `model`'s parameters ready for Burn's optimizer: the first failure of
    /// this step's gathers and reduce-scatters returned, and the gradients of the parameters
    /// that are not sharded averaged over the ranks (one all-reduce). The sharded parameters'
    /// gradients are already their shards of the mean.
    ///
    /// # Errors
    /// A gather or reduce-scatter of this step that failed (a lost rank, a deadline); the
    /// all-reduce's failures.
    pub fn sync<B, M>(&self, model: &M, grads: GradientsParams) -> Result<GradientsParams>
    where
        B: AutodiffBackend,
        M: AutodiffModule<B>,
    {
        if let Some(e) = self.state.take_failure() {
            return Err(e);
        }
        let pg = self.state.group();
        if pg.world_size().as_usize() == 1 {
            return Ok(grads);
        }
        struct Read<'a, B: AutodiffBackend> {
            state: &'a FsdpState,
            grads: &'a mut GradientsParams,
            flat: Vec<f32>,
            parts: Vec<(ParamId, usize, usize, DType, Vec<usize>)>,
            failed: Option<String>,
            _b: std::marker::PhantomData<B>,
        }
        impl<B: AutodiffBackend> ModuleVisitor<B> for Read<'_, B> {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
                if self.state.param(param.id.val()).is_some() || !param.is_require_grad() {
                    return;
                }
                // Every rank sends every replicated parameter (zeros where it has no
                // gradient), so the all-reduce has one size everywhere.
                let dims = param.val().dims().to_vec();
                let len: usize = dims.iter().product();
                let offset = self.flat.len();
                match self.grads.remove::<B::InnerBackend, D>(param.id) {
                    Some(g) => {
                        let prim = g.into_primitive().tensor();
                        let dtype = prim.dtype();
                        match read_f32::<B::InnerBackend>(prim) {
                            Ok(v) => self.flat.extend(v),
                            Err(e) => {
                                self.failed = Some(e);
                                self.flat.resize(offset + len, 0.0);
                            }
                        }
                        self.parts.push((param.id, offset, len, dtype, dims));
                    }
                    None => self.flat.resize(offset + len, 0.0),
                }
            }
        }
        let mut grads = grads;
        let mut read = Read::<B> {
            state: &self.state,
            grads: &mut grads,
            flat: Vec::new(),
            parts: Vec::new(),
            failed: None,
            _b: std::marker::PhantomData,
        };
        model.visit(&mut read);
        let (mut flat, parts, failed) = (read.flat, read.parts, read.failed);
        pg.all_reduce(&mut flat, self.state.config().reduction.op())?;
        if let Some(e) = failed {
            return Err(self.state.error("reading a gradient", e));
        }
        // Back as each parameter's gradient, of its shape, dtype and device.
        struct Put<'a, B> {
            flat: &'a [f32],
            parts: std::collections::HashMap<ParamId, (usize, usize, DType, Vec<usize>)>,
            grads: &'a mut GradientsParams,
            _b: std::marker::PhantomData<B>,
        }
        impl<B: AutodiffBackend> ModuleVisitor<B> for Put<'_, B> {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
                let Some((offset, len, dtype, dims)) = self.parts.remove(&param.id) else {
                    return;
                };
                let values = self.flat[offset..offset + len].to_vec();
                let device = param.val().device();
                let prim = write_f32::<B::InnerBackend>(values, dims.into(), dtype, &device);
                let grad = Tensor::from_primitive(TensorPrimitive::Float(prim));
                self.grads.register::<B::InnerBackend, D>(param.id, grad);
            }
        }
        let parts = parts
            .into_iter()
            .map(|(id, offset, len, dtype, dims)| (id, (offset, len, dtype, dims)))
            .collect();
        model.visit(&mut Put::<B> {
            flat: &flat,
            parts,
            grads: &mut grads,
            _b: std::marker::PhantomData,
        });
        Ok(grads)
    }

    /// Clips the gradients (the shards' and the replicated parameters') so that their global
    /// L2 norm, over the whole model, is at most `max_norm` (PyTorch's `clip_grad_norm_` on an
    /// FSDP model); returns the norm before clipping. One all-reduce of one value. Call it
    /// after [`sync`](Self::sync), on every rank.
    ///
    /// # Errors
    /// A `max_norm` that is not finite and positive; the all-reduce's failures.
    pub fn clip_grad_norm<B, M>(
        &self,
        model: &M,
        grads: GradientsParams,
        max_norm: f64,
    ) -> Result<(GradientsParams, f64)>
    where
        B: AutodiffBackend,
        M: AutodiffModule<B>,
    {
        struct Squares<'a, B> {
            state: &'a FsdpState,
            grads: &'a GradientsParams,
            sharded: f64,
            replicated: f64,
            failed: Option<String>,
            _b: std::marker::PhantomData<B>,
        }
        impl<B: AutodiffBackend> ModuleVisitor<B> for Squares<'_, B> {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
                let Some(g) = self.grads.get::<B::InnerBackend, D>(param.id) else {
                    return;
                };
                match read_f32::<B::InnerBackend>(g.into_primitive().tensor()) {
                    Ok(v) => {
                        let sq: f64 = v.iter().map(|&x| f64::from(x) * f64::from(x)).sum();
                        match self.state.param(param.id.val()) {
                            Some(_) => self.sharded += sq,
                            None => self.replicated += sq,
                        }
                    }
                    Err(e) => self.failed = Some(e),
                }
            }
        }
        let mut sq = Squares::<B> {
            state: &self.state,
            grads: &grads,
            sharded: 0.0,
            replicated: 0.0,
            failed: None,
            _b: std::marker::PhantomData,
        };
        model.visit(&mut sq);
        let (sharded, replicated) = match sq.failed {
            // Still take part in the all-reduce, so no rank waits; then fail.
            Some(_) => (0.0, 0.0),
            None => (sq.sharded, sq.replicated),
        };
        let (norm, coef) = grad::global_norm(self.state.group(), sharded, replicated, max_norm)?;
        if let Some(e) = sq.failed {
            return Err(self.state.error("reading a gradient", e));
        }
        if coef >= 1.0 {
            return Ok((grads, norm));
        }
        struct Scale<'a, B> {
            grads: &'a mut GradientsParams,
            coef: f64,
            _b: std::marker::PhantomData<B>,
        }
        impl<B: AutodiffBackend> ModuleVisitor<B> for Scale<'_, B> {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
                if let Some(g) = self.grads.remove::<B::InnerBackend, D>(param.id) {
                    self.grads
                        .register::<B::InnerBackend, D>(param.id, g.mul_scalar(self.coef));
                }
            }
        }
        let mut grads = grads;
        model.visit(&mut Scale::<B> {
            grads: &mut grads,
            coef,
            _b: std::marker::PhantomData,
        });
        Ok((grads, norm))
    }

    /// The whole model from this rank's sharded `model` (every sharded parameter gathered in
    /// f32, without autodiff): for a checkpoint of one record that loads at any world size
    /// (shard it again with [`shard`](Self::shard)), or for evaluation. A collective: every
    /// rank calls it.
    ///
    /// # Errors
    /// The gathers' failures.
    pub fn full_model<B: FsdpBackend + AutodiffBackend, M: AutodiffModule<B>>(
        &self,
        model: &M,
    ) -> Result<M> {
        let model = model.clone().no_grad();
        let whole = self.gather_as(&model, Precision::F32);
        match self.state.take_failure() {
            Some(e) => Err(e),
            None => Ok(whole),
        }
    }

    /// The whole optimizer state from this rank's `record` (Burn's optimizer's, made by
    /// stepping the shards: `Optimizer::to_record`): the state tensors of every sharded
    /// parameter (Adam's and AdamW's moments) all-gathered into the parameter's whole shape, in
    /// `model`'s visit order; the rest as they are. Every rank gets it; save it with
    /// `full_model`'s record (the parameters keep their ids there, which key this state), and
    /// load it at any world size with [`shard_optimizer_record`](Self::shard_optimizer_record).
    /// A collective: every rank calls it, with the same parameters' state.
    ///
    /// # Errors
    /// Ranks whose records hold the state of other parameters; an optimizer whose state cannot
    /// be reached (SGD with momentum on Burn 0.21); collective failures.
    pub fn full_optimizer_record<B, M, O, R>(&self, model: &M, record: R) -> Result<R>
    where
        B: AutodiffBackend,
        M: AutodiffModule<B>,
        O: FsdpOptimizer<B::InnerBackend>,
        R: IntoIterator<Item = (ParamId, AdaptorRecord<O, B>)>
            + FromIterator<(ParamId, AdaptorRecord<O, B>)>,
    {
        let record: OptimState<O, B> = record.into_iter().collect();
        // The same parameters' state on every rank, or no rank gathers.
        let held: Vec<u8> = param_ids::<B, M>(model)
            .iter()
            .map(|id| u8::from(record.contains_key(id)))
            .collect();
        self.state.same_state_everywhere(&held)?;
        let whole = self.map_record::<B, M, O>(model, record, &mut |p, dims, _, t| {
            if dims != p.shard_shape().as_slice() {
                return t;
            }
            self.gather_one::<B::InnerBackend>(p, t, Precision::F32)
        })?;
        match self.state.take_failure() {
            Some(e) => Err(e),
            None => Ok(whole.into_iter().collect()),
        }
    }

    /// This rank's shard of a whole optimizer state (as
    /// [`full_optimizer_record`](Self::full_optimizer_record) gives it, saved at any world size),
    /// for Burn's optimizer on this rank's shards (`Optimizer::load_record`): every state tensor
    /// of a sharded parameter cut as the parameter is. Call it after [`shard`](Self::shard), on a
    /// model loaded from the record saved with this state.
    ///
    /// # Errors
    /// An optimizer whose state cannot be reached; a state tensor that cannot be read.
    pub fn shard_optimizer_record<B, M, O, R>(&self, model: &M, record: R) -> Result<R>
    where
        B: AutodiffBackend,
        M: AutodiffModule<B>,
        O: FsdpOptimizer<B::InnerBackend>,
        R: IntoIterator<Item = (ParamId, AdaptorRecord<O, B>)>
            + FromIterator<(ParamId, AdaptorRecord<O, B>)>,
    {
        let record: OptimState<O, B> = record.into_iter().collect();
        let rank = self.state.group().rank().index();
        let mut unread = None;
        let mine = self.map_record::<B, M, O>(model, record, &mut |p, dims, device, t| {
            if dims != p.shape.as_slice() {
                return t;
            }
            let dtype = t.dtype();
            match read_f32::<B::InnerBackend>(t.clone()) {
                Ok(whole) => {
                    let shard = p.layout.shard_of(rank, &whole);
                    write_f32::<B::InnerBackend>(shard, p.shard_shape().into(), dtype, device)
                }
                Err(e) => {
                    unread.get_or_insert(e);
                    t
                }
            }
        })?;
        match unread {
            Some(e) => Err(self.state.error("cutting the optimizer state", e)),
            None => Ok(mine.into_iter().collect()),
        }
    }

    /// `record` with every state tensor of a sharded parameter replaced by what `f` gives, in
    /// `model`'s visit order (where each parameter's rank is known).
    fn map_record<B, M, O>(
        &self,
        model: &M,
        record: OptimState<O, B>,
        f: &mut StateMap<'_, B>,
    ) -> Result<OptimState<O, B>>
    where
        B: AutodiffBackend,
        M: AutodiffModule<B>,
        O: FsdpOptimizer<B::InnerBackend>,
    {
        struct Map<'a, O: FsdpOptimizer<B::InnerBackend>, B: AutodiffBackend> {
            state: &'a FsdpState,
            record: OptimState<O, B>,
            f: &'a mut StateMap<'a, B>,
            failed: Option<String>,
        }
        impl<O: FsdpOptimizer<B::InnerBackend>, B: AutodiffBackend> ModuleVisitor<B> for Map<'_, O, B> {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
                let Some(p) = self.state.param(param.id.val()) else {
                    return;
                };
                let Some(entry) = self.record.remove(&param.id) else {
                    return;
                };
                let f = &mut *self.f;
                let device = param.device();
                let mapped = O::map_state::<D>(entry.into_state::<D>(), &device, &mut |t| {
                    let (dims, device) = (t.dims(), t.device());
                    let whole = f(&p, &dims, &device, t.into_primitive().tensor());
                    Tensor::from_primitive(TensorPrimitive::Float(whole))
                });
                match mapped {
                    Ok(state) => {
                        self.record
                            .insert(param.id, AdaptorRecord::from_state::<D>(state));
                    }
                    Err(e) => {
                        self.failed.get_or_insert(e);
                    }
                }
            }
        }
        let mut map = Map::<O, B> {
            state: &self.state,
            record,
            f,
            failed: None,
        };
        model.visit(&mut map);
        match map.failed {
            Some(e) => Err(self.state.error("rewriting the optimizer state", e)),
            None => Ok(map.record),
        }
    }

    /// How many values of `model`'s float parameters this rank holds (its shards, padding
    /// included, and the parameters that are not sharded) and how many the whole model has.
    pub fn held_values<B: Backend, M: Module<B>>(&self, model: &M) -> (usize, usize) {
        struct Count<'a> {
            state: &'a FsdpState,
            held: usize,
            whole: usize,
        }
        impl<B: Backend> ModuleVisitor<B> for Count<'_> {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
                let here: usize = param.val().dims().iter().product();
                self.held += here;
                self.whole += match self.state.param(param.id.val()) {
                    Some(p) => p.layout.full_len(),
                    None => here,
                };
            }
        }
        let mut count = Count {
            state: &self.state,
            held: 0,
            whole: 0,
        };
        model.visit(&mut count);
        (count.held, count.whole)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::NdArray;
    use burn::nn::LinearConfig;
    use burn_ddp_comm::DdpConfig;
    use burn_ddp_dev::device::on_thread_ranks;

    type Plain = Autodiff<Ddp<NdArray>>;

    #[test]
    fn resharding_without_checkpointing_is_refused_with_both_fixes() {
        let errors = on_thread_ranks(2, |pg| {
            let fsdp = FullyShard::new(pg, FsdpConfig::default()).unwrap();
            let model = LinearConfig::new(5, 3).init::<Plain>(&Default::default());
            fsdp.shard::<Plain, _>(model).unwrap_err().to_string()
        });
        for e in errors {
            assert!(e.contains("BalancedCheckpointing"), "{e}");
            assert!(e.contains("with_reshard_after_forward(false)"), "{e}");
        }
    }

    #[test]
    fn a_sharded_model_is_refused_by_ddp_session() {
        let errors = on_thread_ranks(2, |pg| {
            let keep = FsdpConfig::default().with_reshard_after_forward(false);
            let fsdp = FullyShard::new(pg.clone(), keep).unwrap();
            let model = LinearConfig::new(5, 3).init::<Plain>(&Default::default());
            let model = fsdp.shard::<Plain, _>(model).unwrap();
            let session = crate::DdpSession::new(pg, DdpConfig::default()).unwrap();
            session.prepare(model).unwrap_err().to_string()
        });
        for e in errors {
            assert!(e.contains("weight is a shard of FullyShard::shard"), "{e}");
        }
    }

    /// The device path's stand-in: the same collectives over the process group, with the
    /// tensors read to the host (the NCCL path is `ddp/gpu.rs`'s, run by the GPU check). It
    /// counts its calls.
    struct HostLink {
        pg: ProcessGroup,
        calls: std::sync::atomic::AtomicUsize,
    }

    type Inner = Ddp<NdArray>;
    use burn_backend::ops::FloatTensorOps;

    impl HostLink {
        fn tensor(&self, values: Vec<f32>, like: &FloatTensor<Inner>) -> FloatTensor<Inner> {
            self.calls
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let n = values.len();
            write_f32::<Inner>(values, [n].into(), DType::F32, &Inner::float_device(like))
        }
    }

    impl ShardLink<Inner> for HostLink {
        fn serves(&self, _device: &burn::backend::ndarray::NdArrayDevice) -> bool {
            true
        }

        fn all_gather(
            &self,
            _what: &str,
            send: FloatTensor<Inner>,
            block: usize,
        ) -> Result<FloatTensor<Inner>> {
            assert_eq!(send.dtype(), DType::F32);
            let mine = read_f32::<Inner>(send.clone()).unwrap();
            assert_eq!(mine.len(), block);
            let mut all = vec![0.0f32; block * self.pg.world_size().as_usize()];
            self.pg.all_gather(&mine, &mut all)?;
            Ok(self.tensor(all, &send))
        }

        fn reduce_scatter(
            &self,
            _what: &str,
            send: FloatTensor<Inner>,
            block: usize,
            op: ReduceOp,
        ) -> Result<FloatTensor<Inner>> {
            assert_eq!(send.dtype(), DType::F32);
            let all = read_f32::<Inner>(send.clone()).unwrap();
            let mut mine = vec![0.0f32; block];
            self.pg.reduce_scatter(&all, &mut mine, op)?;
            Ok(self.tensor(mine, &send))
        }
    }

    /// The device path's packing (each shard one f32 block, the padding rows cut off after the
    /// gather, the whole gradient padded with zeros before the reduce-scatter, reshaped back)
    /// gives what the host path gives: the forward's output and every gradient of a 5x3 layer
    /// over 2 ranks (uneven: one padding row of the weight, one of the bias), with resharding
    /// and its gather in backward, and without.
    #[test]
    fn the_device_path_packs_and_unpacks_as_the_host_path_computes() {
        type Ck = Autodiff<Inner, BalancedCheckpointing>;
        let device = Default::default();
        let wave = |n: usize, step: f32| (0..n).map(|i| (i as f32 * step).sin()).collect();
        let tensor = |values: Vec<f32>, shape: Vec<usize>| {
            Tensor::<Ck, 2>::from_data(burn::tensor::TensorData::new(values, shape), &device)
        };
        for config in [
            FsdpConfig::default(),
            FsdpConfig::default().with_reshard_after_forward(false),
        ] {
            let run = |linked: bool| {
                on_thread_ranks(2, |pg| {
                    let fsdp = FullyShard::new(pg.clone(), config).unwrap();
                    let link = Arc::new(HostLink {
                        pg,
                        calls: Default::default(),
                    });
                    if linked {
                        fsdp.set_link::<Inner>(link.clone());
                    }
                    let mut model = LinearConfig::new(5, 3).init::<Ck>(&device);
                    model.weight = Param::from_tensor(tensor(wave(15, 0.37), vec![5, 3]));
                    model.bias = Some(Param::from_tensor(
                        tensor(wave(3, 1.1), vec![1, 3]).reshape([3]),
                    ));
                    let model = fsdp.shard::<Ck, _>(model).unwrap();
                    let out = gather(&model).forward(tensor(wave(20, 0.23), vec![4, 5]));
                    let grads = GradientsParams::from_grads(out.clone().sum().backward(), &model);
                    let grads = fsdp.sync(&model, grads).unwrap();
                    let read = |g: Option<Tensor<Inner, 1>>| {
                        read_f32::<Inner>(g.unwrap().into_primitive().tensor()).unwrap()
                    };
                    let weight = grads
                        .get::<Inner, 2>(model.weight.id)
                        .map(|g| g.reshape([-1]));
                    let bias = grads.get::<Inner, 1>(model.bias.as_ref().unwrap().id);
                    let got = (
                        read_f32::<Inner>(out.inner().reshape([12]).into_primitive().tensor())
                            .unwrap(),
                        read(weight),
                        read(bias),
                    );
                    let calls = link.calls.load(std::sync::atomic::Ordering::Relaxed);
                    (got, (calls, fsdp.gathers()))
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

    /// The velocity of parameter `id` in an SGD record (through its record's item, as
    /// `map_state` reaches it): its dims and values.
    fn velocity<R>(record: R, id: ParamId) -> (Vec<usize>, Vec<f32>)
    where
        R: IntoIterator<Item = (ParamId, AdaptorRecord<Sgd<Inner>, Plain>)>,
    {
        use burn::record::{FullPrecisionSettings, Record};
        let (_, entry) = record.into_iter().find(|(k, _)| *k == id).unwrap();
        let momentum = entry.into_state::<2>().momentum.unwrap();
        let item = momentum.into_item::<FullPrecisionSettings>();
        let v = Tensor::<Inner, 2>::from_item::<FullPrecisionSettings>(
            item.velocity,
            &Default::default(),
        );
        (v.dims().to_vec(), v.into_data().to_vec::<f32>().unwrap())
    }

    /// SGD's momentum (its velocity private on Burn 0.21, reached through its record's item) is
    /// gathered whole and cut back: the whole velocity of a 5x3 weight over 2 ranks is the
    /// ranks' shards in rank order, the padding row cut off, and cutting it again gives each
    /// rank its own velocity back.
    #[test]
    fn sgd_momentum_is_gathered_whole_and_cut_back() {
        use burn::optim::momentum::MomentumConfig;
        use burn::optim::{Optimizer, SgdConfig};
        let results = on_thread_ranks(2, |pg| {
            let keep = FsdpConfig::default().with_reshard_after_forward(false);
            let fsdp = FullyShard::new(pg.clone(), keep).unwrap();
            let device = Default::default();
            let model = LinearConfig::new(5, 3).init::<Plain>(&device);
            let mut model = fsdp.shard::<Plain, _>(model).unwrap();
            let mut optim = SgdConfig::new()
                .with_momentum(Some(MomentumConfig::new()))
                .init::<Plain, burn::nn::Linear<Plain>>();
            for step in 0..2 {
                let rank = pg.rank().index() as f32;
                let x = Tensor::<Plain, 2>::full([4, 5], 1.0 + rank + step as f32, &device);
                let loss = gather(&model).forward(x).powi_scalar(2).sum();
                let grads = GradientsParams::from_grads(loss.backward(), &model);
                let grads = fsdp.sync::<Plain, _>(&model, grads).unwrap();
                model = optim.step(0.01, model, grads);
            }
            let id = model.weight.id;
            let record = optim.to_record();
            let mine = velocity(record.clone(), id);
            let whole = fsdp.full_optimizer_record(&model, record).unwrap();
            let all = velocity(whole.clone(), id);
            let back = fsdp.shard_optimizer_record(&model, whole).unwrap();
            (mine, all, velocity(back, id))
        });
        let (r0, r1) = (&results[0].0, &results[1].0);
        assert_eq!(
            (r0.0.as_slice(), r1.0.as_slice()),
            ([3, 3].as_slice(), [3, 3].as_slice())
        );
        assert!(
            r0.1.iter().chain(&r1.1).any(|v| *v != 0.0),
            "no velocity: the test cannot fail"
        );
        let expected: Vec<f32> = r0.1.iter().chain(&r1.1[..6]).copied().collect();
        for (mine, all, back) in &results {
            assert_eq!(all, &(vec![5, 3], expected.clone()));
            assert_eq!(back, mine);
        }
    }
}
