//! ZeRO stages 1 and 2: the optimizer state sharded over the ranks (stage 1, PyTorch's
//! `ZeroRedundancyOptimizer`), and the reduced gradients too (stage 2, DeepSpeed's), on the
//! core's `ZeroPlan`.
//!
//! Stage 1: every rank still all-reduces the whole gradient; each then steps only the
//! parameters it owns with Burn's own optimizer (the gradients of the others are dropped before
//! the step, so Burn's optimizer never creates state for them). Stage 2
//! ([`DdpSession::zero2`]): the buckets are reduce-scattered instead, so each rank receives only
//! the reduced gradients of the parameters it owns; its own gradient of every other parameter
//! is released at the end of backward. Either way the stepped parameters are all-gathered, so
//! every rank ends the step with the same model while holding about `1/N` of the optimizer state
//! (and, in stage 2, of the reduced gradients).

use std::marker::PhantomData;

use burn::module::{AutodiffModule, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::optim::LearningRate;
use burn::optim::{GradientsParams, MultiGradientsParams, Optimizer};
use burn::record::{BinBytesRecorder, FullPrecisionSettings, Recorder};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::Tensor;
use burn_backend::distributed::DistributedParamId;
use burn_ddp_comm::grad::{ReadValues, ZeroShards};

#[cfg(feature = "cuda")]
use super::gpu;
use super::model::Path;
use super::values::filled_like;
use super::DdpSession;
use crate::group::Rank;
use crate::{DdpError, Result};
#[cfg(feature = "cuda")]
use burn::tensor::TensorPrimitive;
#[cfg(feature = "cuda")]
use burn_backend::ops::FloatTensorOps;

/// An optimizer whose state is sharded over the ranks (ZeRO stage 1, PyTorch's
/// `ZeroRedundancyOptimizer`); made by [`DdpSession::zero`].
///
/// Its [`step`](Optimizer::step) takes the averaged gradients of a synchronised backward (as
/// every other optimizer), steps with the wrapped Burn optimizer the parameters this rank owns,
/// and all-gathers the stepped parameters, so every rank holds the same model afterwards. A
/// parameter is owned by one rank (balanced by size, largest first); rank-local (`#[ddp(skip)]`)
/// parameters are stepped by every rank for itself.
///
/// Checkpoints: [`Optimizer::to_record`] and [`Optimizer::load_record`] are this rank's shard;
/// [`gather_record`](Self::gather_record) (every rank) gives rank 0 the whole state, and
/// [`load_full_record`](Self::load_full_record) loads a whole state on any world size, each
/// rank keeping its own shard.
pub struct ZeroOptimizer<O, M, B> {
    inner: O,
    session: DdpSession,
    /// The synchronised parameters (this process's ids, in visit order) with their owner,
    /// size and place in the all-gathered values.
    shards: ZeroShards,
    /// 1, or 2 when the gradients are sharded too.
    stage: u8,
    _m: PhantomData<fn() -> (M, B)>,
}

impl<O: Clone, M, B> Clone for ZeroOptimizer<O, M, B> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            session: self.session.clone(),
            shards: self.shards.clone(),
            stage: self.stage,
            _m: PhantomData,
        }
    }
}

impl<O, M, B> std::fmt::Debug for ZeroOptimizer<O, M, B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let rank = self.session.group().rank();
        f.debug_struct("ZeroOptimizer")
            .field("stage", &self.stage)
            .field("rank", &rank)
            .field("params", &self.shards.ids().len())
            .field("owned_elements", &self.shards.plan().elements_of(rank))
            .finish()
    }
}

/// The synchronised parameters of a model: (id, elements), in visit order.
struct Synced<'a> {
    path: Path,
    skip: &'a [String],
    out: Vec<(ParamId, usize)>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for Synced<'_> {
    fn enter_module(&mut self, name: &str, _container: &str) {
        self.path.0.push(name.to_owned());
    }
    fn exit_module(&mut self, _name: &str, _container: &str) {
        self.path.0.pop();
    }
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if param.is_require_grad() && !self.path.skipped(self.skip) {
            self.out.push((param.id, param.shape().num_elements()));
        }
    }
}

/// This rank's owned parameters' values, concatenated in list order.
struct Gather<'a> {
    owned: &'a dyn Fn(ParamId) -> bool,
    read: ReadValues,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for Gather<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if !(self.owned)(param.id) {
            return;
        }
        let n = param.shape().num_elements();
        self.read.push(
            n,
            param.val().into_data().convert::<f32>().into_vec::<f32>(),
        );
    }
}

/// Writes the gathered values of the synchronised parameters of one run back (keeping each
/// one's gradient requirement and its mark for synchronisation).
struct Scatter<'a> {
    shards: &'a ZeroShards,
    /// The positions whose values these are.
    range: std::ops::Range<usize>,
    values: &'a [f32],
}

impl<B: AutodiffBackend> ModuleMapper<B> for Scatter<'_> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let n = param.shape().num_elements();
        let (id, range) = (param.id.val(), self.range.clone());
        let Some(values) = self.shards.gathered_in(id, n, range, self.values) else {
            return param;
        };
        let (id, tensor, mapper) = param.consume();
        let mut fresh = filled_like(&tensor, values);
        if tensor.is_distributed() {
            fresh = fresh.set_distributed(DistributedParamId::from(id.val()));
        }
        Param::from_mapped_value(id, fresh, mapper)
    }
}

/// This rank's owned parameters of one run as flattened f32 CUDA tensors (the ZeRO all-gather
/// on the GPU), the GPU of the run's parameters, and a parameter that is not a CUDA tensor.
#[cfg(feature = "cuda")]
struct PackGpu<'a> {
    owned: &'a dyn Fn(ParamId) -> bool,
    within: &'a dyn Fn(ParamId) -> bool,
    run: burn_ddp_comm::grad::RunParts<gpu::CudaFloat, gpu::GpuDevice>,
}

#[cfg(feature = "cuda")]
impl<B: AutodiffBackend> ModuleVisitor<B> for PackGpu<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        use burn_backend::TensorMetadata;
        if !(self.within)(param.id) {
            return;
        }
        let inner = param.val().inner().into_primitive().tensor();
        let Ok(t) = super::gpu::to_cuda::<B::InnerBackend>(inner) else {
            let why = || format!("parameter {} is not a CUDA tensor", param.id);
            self.run.error.get_or_insert_with(why);
            return;
        };
        self.run
            .device
            .get_or_insert_with(|| gpu::Gpu::float_device(&t));
        if !(self.owned)(param.id) {
            return;
        }
        let n = t.shape().num_elements();
        let flat = gpu::Gpu::float_reshape(t, burn_backend::Shape::new([n]));
        let flat = if flat.dtype() == burn_backend::DType::F32 {
            flat
        } else {
            gpu::Gpu::float_cast(flat, burn_backend::FloatDType::F32)
        };
        self.run.parts.push((flat, n));
    }
}

/// Puts the parameters of one run back from their all-gather on the GPU (`all`, laid out as
/// `layout`): each a view of it, shaped and typed as the parameter was, a fresh leaf with its
/// gradient requirement and its mark for synchronisation (as [`Scatter`]).
#[cfg(feature = "cuda")]
struct PlaceGpu<'a> {
    shards: &'a ZeroShards,
    range: std::ops::Range<usize>,
    layout: &'a burn_ddp_comm::grad::RunLayout,
    all: &'a gpu::CudaFloat,
}

#[cfg(feature = "cuda")]
impl<B: AutodiffBackend> ModuleMapper<B> for PlaceGpu<'_> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let id = param.id.val();
        let Some(at) = self.shards.gathered_at(id, &self.range, self.layout) else {
            return param;
        };
        let n = param.shape().num_elements();
        let (id, tensor, mapper) = param.consume();
        let slice = [burn_backend::Slice::from(at..at + n)];
        let part = gpu::Gpu::float_slice(self.all.clone(), &slice);
        let part = gpu::Gpu::float_reshape(part, tensor.shape());
        let dtype = tensor.dtype();
        let part = if dtype == burn_backend::DType::F32 {
            part
        } else {
            gpu::Gpu::float_cast(part, super::float_dtype(dtype))
        };
        // `B::InnerBackend` is `Ddp<Cuda>` (checked before the gather), whose tensors are
        // `Cuda`'s.
        let Some(inner) = super::gpu::from_cuda::<B::InnerBackend>(part) else {
            return Param::from_mapped_value(id, tensor, mapper);
        };
        let inner = Tensor::<B::InnerBackend, D>::from_primitive(TensorPrimitive::Float(inner));
        let mut fresh = Tensor::<B, D>::from_inner(inner);
        if tensor.is_require_grad() {
            fresh = fresh.require_grad();
        }
        if tensor.is_distributed() {
            fresh = fresh.set_distributed(DistributedParamId::from(id.val()));
        }
        Param::from_mapped_value(id, fresh, mapper)
    }
}

impl DdpSession {
    /// `optim` (a Burn optimizer, e.g. `AdamConfig::new().init()`) with its state sharded over
    /// the ranks (ZeRO stage 1, PyTorch's `ZeroRedundancyOptimizer`): each rank keeps the state
    /// of the parameters it owns, about `1/N` of the whole. `model` is the prepared model (its
    /// synchronised parameters are what is sharded); every rank must call this with the same
    /// model. Use it as any optimizer: `model = optim.step(lr, model, grads)` after a
    /// synchronised backward, on every rank.
    ///
    /// # Errors
    /// `prepare` was not called.
    pub fn zero<O, M, B>(&self, optim: O, model: &M) -> Result<ZeroOptimizer<O, M, B>>
    where
        B: AutodiffBackend,
        M: AutodiffModule<B>,
        O: Optimizer<M, B>,
    {
        burn_ddp_comm::grad::NotCarried::Zero.refuse_on(&self.shared.pg)?;
        if self.shared.reducer().params().is_empty() {
            return Err(DdpError::model_access(
                self.shared.pg.rank(),
                "sharding the optimizer state",
                "DdpSession::prepare was not called: prepare the model first, then \
                         DdpSession::zero(optimizer, &model)",
            ));
        }
        let skip = self.skip();
        let mut synced = Synced {
            path: Path::default(),
            skip: &skip,
            out: Vec::new(),
        };
        model.visit(&mut synced);
        let params: Vec<(u64, usize)> = synced.out.iter().map(|(id, n)| (id.val(), *n)).collect();
        Ok(ZeroOptimizer {
            inner: optim,
            session: self.clone(),
            shards: ZeroShards::new(&params, self.shared.pg.world_size().as_usize()),
            stage: 1,
            _m: PhantomData,
        })
    }

    /// ZeRO stage 2 (DeepSpeed's; FSDP2 with `reshard_after_forward=False`): as
    /// [`zero`](Self::zero), and from the next backward on the gradient buckets are
    /// reduce-scattered rather than all-reduced, so that this rank receives only the reduced
    /// gradients of the parameters it owns, the ones the returned optimizer steps; its own
    /// gradients of the others are released at the end of backward (they stay in Burn's
    /// container as empty tensors, which the returned optimizer drops). A replica then keeps
    /// about `4 + 12/N` bytes per parameter with Adam in f32 instead of stage 1's `8 + 8/N`;
    /// the bytes on the wire are an all-reduce's (a reduce-scatter, then the all-gather of the
    /// stepped parameters), each bucket padded to equal blocks of whole parameters. Overlap,
    /// [`DdpSession::sync_gradients`] and accumulation work as without it; a later `prepare` of
    /// the same model keeps it. On either transport: host-staged buckets are reduce-scattered
    /// by the communication thread, NCCL's device buckets (`Autodiff<Ddp<Cuda>>`) by
    /// `ncclReduceScatter` into a block-sized output.
    ///
    /// Use the returned optimizer for every step, on every rank. Checkpoints as stage 1's.
    ///
    /// # Errors
    /// As [`zero`](Self::zero); a configuration stage 2 cannot run with (a communication hook,
    /// PowerSGD: `ConfigError::InvalidConfig` says what to change).
    pub fn zero2<O, M, B>(&self, optim: O, model: &M) -> Result<ZeroOptimizer<O, M, B>>
    where
        B: AutodiffBackend,
        M: AutodiffModule<B>,
        O: Optimizer<M, B>,
    {
        let mut zero = self.zero(optim, model)?;
        self.shared.reducer().shard(zero.shards.owners())?;
        zero.stage = 2;
        Ok(zero)
    }
}

impl<O, M, B> ZeroOptimizer<O, M, B>
where
    B: AutodiffBackend,
    M: AutodiffModule<B>,
    O: Optimizer<M, B>,
{
    fn rank(&self) -> Rank {
        self.session.group().rank()
    }

    /// The synchronised parameters another rank owns, whose gradients this rank drops before
    /// its step.
    fn dropped(&self) -> impl Iterator<Item = ParamId> + '_ {
        (self.shards.owned_by_others(self.rank())).map(ParamId::from)
    }

    /// Whether this rank steps parameter `id` (and keeps its state): those it owns, and every
    /// parameter that is not sharded (rank-local ones).
    fn steps(&self, id: ParamId) -> bool {
        !self.shards.owned_elsewhere(id.val(), self.rank())
    }

    /// The number of parameter elements this rank owns (whose optimizer state it keeps), and
    /// the number sharded over all ranks.
    pub fn owned_elements(&self) -> (usize, usize) {
        self.shards.plan().owned_elements(self.rank())
    }

    /// 1, or 2 where the gradients are sharded too ([`DdpSession::zero2`]).
    pub fn stage(&self) -> u8 {
        self.stage
    }

    /// One step: the wrapped optimizer steps the parameters this rank owns (and rank-local
    /// ones), then the stepped parameters are all-gathered. Every rank must call it.
    ///
    /// # Errors
    /// A parameter that cannot be read as f32 (after the all-gather, so no rank is left
    /// waiting); collective failures.
    pub fn try_step(
        &mut self,
        lr: LearningRate,
        module: M,
        mut grads: GradientsParams,
    ) -> Result<M> {
        for id in self.dropped() {
            drop_grad::<B>(&mut grads, id);
        }
        let module = self.inner.step(lr, module, grads);
        self.gather_params(module)
    }

    /// All-gathers the stepped parameters, a run of about a bucket's size at a time
    /// ([`ZeroShards::gather_in_runs`]).
    fn gather_params(&self, module: M) -> Result<M> {
        #[cfg(feature = "cuda")]
        if super::gpu::is_ddp_cuda::<B::InnerBackend>() {
            let comm = self.session.shared.reducer().nccl_comm();
            if let Some(comm) = comm {
                return self.gather_on_gpu(&comm, module);
            }
        }
        let pg = self.session.group();
        if pg.world_size().as_usize() == 1 {
            return Ok(module);
        }
        let (rank, shards) = (self.rank(), &self.shards);
        let chunk = (self.session.config().bucket_cap_bytes / 4).max(1);
        let read = |module: &M, range: &std::ops::Range<usize>| {
            let owned = |id: ParamId| shards.owns(id.val(), rank) && shards.within(id.val(), range);
            let mut gather = Gather {
                owned: &owned,
                read: ReadValues::default(),
            };
            module.visit(&mut gather);
            gather.read
        };
        let write = |module: M, range, values: &[f32]| {
            module.map(&mut Scatter {
                shards,
                range,
                values,
            })
        };
        shards.gather_in_runs(pg, chunk, module, read, write)
    }

    /// [`gather_params`](Self::gather_params) on the GPU, when the gradients travel through
    /// NCCL (`Autodiff<Ddp<Cuda>>`): per run, this rank's owned parameters flattened into one
    /// block (padded), all-gathered by NCCL (`gpu::all_gather_run`), and every parameter of the
    /// run put back as a view of the result; nothing goes through the host. At world size 1
    /// too (a copy), so that the one-GPU check runs the collective. A rank whose owned
    /// parameters do not fill its block as the plan says sends zeros and fails after every run
    /// went, so no rank waits in a run another left.
    #[cfg(feature = "cuda")]
    fn gather_on_gpu(&self, comm: &burn_ddp_comm::cuda::NcclComm, module: M) -> Result<M> {
        let (rank, shards) = (self.rank(), &self.shards);
        let chunk = (self.session.config().bucket_cap_bytes / 4).max(1);
        let pack = |module: &M, range: &std::ops::Range<usize>| {
            let owned = |id: ParamId| shards.owns(id.val(), rank) && shards.within(id.val(), range);
            let within = |id: ParamId| shards.within(id.val(), range);
            let mut pack = PackGpu {
                owned: &owned,
                within: &within,
                run: Default::default(),
            };
            module.visit(&mut pack);
            pack.run
        };
        let zeros = |n: usize, device: &gpu::GpuDevice| {
            let f32 = burn_backend::FloatDType::F32;
            gpu::Gpu::float_zeros(burn_backend::Shape::new([n]), device, f32)
        };
        let gather = |what: &str, parts: Vec<gpu::CudaFloat>, block| {
            gpu::all_gather_run(comm, what, gpu::Gpu::float_cat(parts, 0), block)
        };
        let place = |module: M, range, layout: &burn_ddp_comm::grad::RunLayout, all: &_| {
            module.map(&mut PlaceGpu {
                shards,
                range,
                layout,
                all,
            })
        };
        shards.gather_runs_on_device(rank, chunk, module, pack, zeros, gather, place)
    }
}

impl<O, M, B, R> ZeroOptimizer<O, M, B>
where
    B: AutodiffBackend,
    M: AutodiffModule<B>,
    O: Optimizer<M, B>,
    // Burn's optimizers (`OptimizerAdaptor`) keep their state by parameter.
    O::Record: IntoIterator<Item = (ParamId, R)> + FromIterator<(ParamId, R)>,
{
    /// The whole optimizer state, on rank 0 (`None` on the others): every rank's shard,
    /// gathered (PyTorch's `consolidate_state_dict(to=0)` then `state_dict()`). Every rank must
    /// call it; save what rank 0 gets.
    ///
    /// # Errors
    /// A shard that cannot be (de)serialised; collective failures.
    pub fn gather_record(&self) -> Result<Option<O::Record>> {
        let rank = self.rank();
        let recorder = BinBytesRecorder::<FullPrecisionSettings>::default();
        let mine = Recorder::<B>::record(&recorder, self.inner.to_record(), ()).map_err(|e| {
            DdpError::model_access(rank, "serialising this rank's optimizer state", e)
        })?;
        let all = self.session.group().all_gather_bytes(&mine)?;
        if rank != Rank(0) {
            return Ok(None);
        }
        let device = Default::default();
        let mut whole: Vec<(ParamId, R)> = Vec::new();
        let mut seen = std::collections::HashSet::new();
        for (from, bytes) in all.into_iter().enumerate() {
            let shard: O::Record = Recorder::<B>::load(&recorder, bytes, &device).map_err(|e| {
                DdpError::model_access(
                    rank,
                    "reading another rank's optimizer state",
                    format!("rank {from}'s: {e}"),
                )
            })?;
            // Rank-local parameters' state is every rank's own: rank 0's is kept.
            for (id, state) in shard {
                if seen.insert(id) {
                    whole.push((id, state));
                }
            }
        }
        Ok(Some(whole.into_iter().collect()))
    }

    /// Loads a whole optimizer state (as [`gather_record`](Self::gather_record) gives, saved at
    /// any world size; or a plain optimizer's record): this rank keeps the state of the
    /// parameters it owns (and of rank-local ones), and drops the rest.
    pub fn load_full_record(mut self, record: O::Record) -> Self {
        let mine = record
            .into_iter()
            .filter(|(id, _)| self.steps(*id))
            .collect();
        self.inner = self.inner.load_record(mine);
        self
    }
}

impl<O, M, B> Optimizer<M, B> for ZeroOptimizer<O, M, B>
where
    B: AutodiffBackend,
    M: AutodiffModule<B>,
    O: Optimizer<M, B>,
{
    /// This rank's shard of the state (see [`ZeroOptimizer::gather_record`] for the whole).
    type Record = O::Record;

    /// [`ZeroOptimizer::try_step`]. A failure (a dead rank) leaves `module` as this rank
    /// stepped it and is reported by the session's next check (`DdpSession::check`, hence the
    /// next synchronised backward): Burn's optimizer interface cannot return it.
    fn step(&mut self, lr: LearningRate, module: M, grads: GradientsParams) -> M {
        let before = module.clone();
        match self.try_step(lr, module, grads) {
            Ok(m) => m,
            Err(e) => {
                tracing::debug!("{e}");
                self.session.shared.reducer().record_error(e);
                before
            }
        }
    }

    /// As [`step`](Optimizer::step), for gradients on several devices (each rank's own
    /// gradients of the parameters it does not own are dropped from every device).
    fn step_multi(&mut self, lr: LearningRate, module: M, mut grads: MultiGradientsParams) -> M {
        for id in self.dropped() {
            for (g, _) in grads.grads.iter_mut() {
                drop_grad::<B>(g, id);
            }
        }
        let before = module.clone();
        let stepped = self.inner.step_multi(lr, module, grads);
        match self.gather_params(stepped) {
            Ok(m) => m,
            Err(e) => {
                tracing::debug!("{e}");
                self.session.shared.reducer().record_error(e);
                before
            }
        }
    }

    fn to_record(&self) -> Self::Record {
        self.inner.to_record()
    }

    fn load_record(mut self, record: Self::Record) -> Self {
        self.inner = self.inner.load_record(record);
        self
    }
}

/// Removes parameter `id`'s gradient from `grads`. (Burn's container is keyed by id alone; the
/// tensor's rank given to `remove` only types the value returned, which is dropped.)
fn drop_grad<B: AutodiffBackend>(grads: &mut GradientsParams, id: ParamId) {
    drop(grads.remove::<B::InnerBackend, 1>(id));
}
