//! ZeRO stages 1 and 2 on Burn 0.22 and 0.23: the optimizer state sharded over the ranks
//! (stage 1, PyTorch's `ZeroRedundancyOptimizer`), and the reduced gradients too (stage 2,
//! DeepSpeed's, FSDP2's `reshard_after_forward=False`), on the core's `ZeroPlan` (the same
//! ownership rule as the Burn 0.21 line's `DdpSession::zero`).
//!
//! Stage 1: every rank still all-reduces the whole gradient ([`GradSync::sync`]); each then
//! steps, with Burn's own `ModuleOptimizer`, only the parameters it owns: the gradients of the
//! others are dropped before the step, so Burn's optimizer never creates state for them. Stage
//! 2 ([`GradSync::zero2`]): the buckets are reduce-scattered instead, so `sync` hands back only
//! the reduced gradients this rank owns (the others' leave with their bucket). Either way the
//! stepped parameters are all-gathered, so every rank ends the step with the same model while
//! holding about `1/N` of the optimizer state (and, in stage 2, of the reduced gradients).
//!
//! Checkpoints go through bytes. Burn's `OptimizerRecord` keeps its entries private, but
//! its burnpack encoding is public (`burn-pack`): each entry is keyed by the parameter's
//! `ParamId` (tensors `"{id}.{field}"` with the id beside them, scalars `"{id}.{field}"`, the
//! parameter's path under `"{id}"`). [`ZeroOptimizer::gather_record`] rewrites every rank's
//! shard with the parameter's *position* (its index among the model's trainable parameters in
//! visit order) in place of its id, which is the same on every rank and in every run of the
//! model, and merges the shards; [`ZeroOptimizer::load_full_record`] keeps the positions this
//! rank owns and puts its own ids back. So a whole state saved at one world size loads at any
//! other.

use std::collections::HashSet;
use std::ops::Range;
use std::sync::Arc;

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::optim::{GradientsParams, LearningRate, ModuleOptimizer, OptimizerRecord};
use burn::tensor::{Bytes, DType as BurnDType, Device, Tensor};
use burn_ddp_comm::grad::{ReadValues, RunLayout, RunParts, ZeroShards};
use burn_ddp_comm::{DdpError, ProcessGroup, Rank, Result};

use crate::grads::filled_like;
use crate::GradSync;

/// An optimizer whose state is sharded over the ranks (ZeRO stage 1, PyTorch's
/// `ZeroRedundancyOptimizer`); made by [`GradSync::zero`], or by [`GradSync::zero2`] for stage
/// 2 (the gradients sharded too).
///
/// [`step`](Self::step) takes the gradients [`GradSync::sync`] returned, steps with the wrapped
/// `ModuleOptimizer` the parameters this rank owns, and all-gathers the stepped parameters, so
/// every rank holds the same model afterwards. A parameter is owned by one rank (balanced by
/// size, largest first).
///
/// Checkpoints: [`to_record`](Self::to_record) and [`load_record`](Self::load_record) are this
/// rank's shard (keyed by this process's `ParamId`s, as Burn keys them);
/// [`gather_record`](Self::gather_record) (every rank) gives rank 0 the whole state, keyed by
/// parameter position, and [`load_full_record`](Self::load_full_record) loads such a whole state
/// on any world size, each rank keeping its own shard.
pub struct ZeroOptimizer {
    inner: ModuleOptimizer,
    pg: ProcessGroup,
    /// The trainable parameters (this process's ids, in visit order) with their owner, size
    /// and place in the all-gathered values.
    shards: ZeroShards,
    /// 1, or 2 when the gradients are sharded too.
    stage: u8,
    /// The elements of the parameters all-gathered at a time (the bucket cap's).
    chunk: usize,
    /// Where the stepped parameters are all-gathered on the device (NCCL, when the gradients
    /// travel through it); `None`: through the host.
    device: Option<Arc<dyn BlockGather>>,
}

impl std::fmt::Debug for ZeroOptimizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ZeroOptimizer")
            .field("stage", &self.stage)
            .field("rank", &self.pg.rank())
            .field("on_device", &self.device.is_some())
            .field("params", &self.shards.ids().len())
            .field(
                "owned_elements",
                &self.shards.plan().elements_of(self.pg.rank()),
            )
            .finish()
    }
}

/// The trainable parameters of a model (those [`GradSync`] synchronises): (id, elements), in
/// visit order.
struct Trainable(Vec<(ParamId, usize)>);

impl ModuleVisitor for Trainable {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if param.is_require_grad() {
            self.0.push((param.id, param.shape().num_elements()));
        }
    }
}

/// Removes the gradients of the parameters this rank does not step (at each parameter's own
/// rank `D`: Burn's container is typed by it).
struct DropGrads<'a> {
    grads: &'a mut GradientsParams,
    drop: &'a dyn Fn(ParamId) -> bool,
}

impl ModuleVisitor for DropGrads<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if (self.drop)(param.id) {
            drop(self.grads.remove::<D>(param.id));
        }
    }
}

/// This rank's owned parameters' values, concatenated in visit order.
struct Gather<'a> {
    owned: &'a dyn Fn(ParamId) -> bool,
    read: ReadValues,
}

impl ModuleVisitor for Gather<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if !(self.owned)(param.id) {
            return;
        }
        let n = param.shape().num_elements();
        self.read.push(
            n,
            param
                .val()
                .into_data()
                .convert::<f32>()
                .try_into_vec::<f32>(),
        );
    }
}

/// Writes the gathered values of the trainable parameters of one run back, keeping each one's id
/// and gradient requirement.
struct Scatter<'a> {
    shards: &'a ZeroShards,
    /// The positions whose values these are.
    range: std::ops::Range<usize>,
    values: &'a [f32],
}

impl ModuleMapper for Scatter<'_> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let n = param.shape().num_elements();
        let (id, range) = (param.id.val(), self.range.clone());
        let Some(values) = self.shards.gathered_in(id, n, range, self.values) else {
            return param;
        };
        let (id, tensor, mapper) = param.consume();
        Param::from_mapped_value(id, filled_like(&tensor, values), mapper)
    }
}

/// The all-gather of a ZeRO run's stepped parameters on a device path (NCCL's, `cuda.rs`; a
/// stand-in over the host in this module's tests): every rank's `send` (`block` f32 elements on
/// the parameters' device, without autodiff), concatenated in rank order.
pub(crate) trait BlockGather: Send + Sync {
    /// `what` names the run in errors.
    ///
    /// # Errors
    /// The collective's failures.
    fn all_gather(&self, what: &str, send: Tensor<1>, block: usize) -> Result<Tensor<1>>;
}

#[cfg(feature = "cuda")]
impl BlockGather for std::sync::Mutex<crate::cuda::DevicePath> {
    fn all_gather(&self, what: &str, send: Tensor<1>, block: usize) -> Result<Tensor<1>> {
        // A panic while it was held left no state half changed that this call reads.
        let path = self.lock().unwrap_or_else(|p| p.into_inner());
        path.all_gather(what, send, block)
    }
}

/// Where a ZeRO optimizer over `sync` all-gathers the stepped parameters on the device: NCCL,
/// when the gradients travel through it.
fn block_gather(sync: &GradSync) -> Option<Arc<dyn BlockGather>> {
    #[cfg(feature = "cuda")]
    if let Some(device) = sync.device_path() {
        return Some(device as Arc<dyn BlockGather>);
    }
    let _ = sync;
    None
}

/// This rank's owned parameters of one run, flattened to f32 where they are (without autodiff),
/// and the device of the run's parameters.
struct Pack<'a> {
    owned: &'a dyn Fn(ParamId) -> bool,
    within: &'a dyn Fn(ParamId) -> bool,
    run: RunParts<Tensor<1>, Device>,
}

impl ModuleVisitor for Pack<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if !(self.within)(param.id) {
            return;
        }
        let value = param.val().inner();
        self.run.device.get_or_insert_with(|| value.device());
        if !(self.owned)(param.id) {
            return;
        }
        let n = value.shape().num_elements();
        let flat: Tensor<1> = value.reshape([n]);
        let flat = if flat.dtype() == BurnDType::F32 {
            flat
        } else {
            flat.cast(BurnDType::F32)
        };
        self.run.parts.push((flat, n));
    }
}

/// Puts the parameters of one run back from their all-gather on the device (`all`, laid out as
/// `layout`): each a view of it, shaped, typed and given autodiff as the parameter was.
struct Place<'a> {
    shards: &'a ZeroShards,
    range: Range<usize>,
    layout: &'a RunLayout,
    all: &'a Tensor<1>,
}

impl ModuleMapper for Place<'_> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let Some(at) = (self.shards).gathered_at(param.id.val(), &self.range, self.layout) else {
            return param;
        };
        let n = param.shape().num_elements();
        let (id, tensor, mapper) = param.consume();
        let flat = self.all.clone().slice(at..at + n);
        let fresh: Tensor<D> = flat.reshape(tensor.shape());
        let fresh = if fresh.dtype() == tensor.dtype() {
            fresh
        } else {
            fresh.cast(tensor.dtype())
        };
        Param::from_mapped_value(id, with_context_of(fresh, &tensor), mapper)
    }
}

/// `fresh` (a tensor without autodiff) with `like`'s autodiff: its gradient-checkpointing
/// strategy, and its gradient requirement (a fresh leaf, as `filled_like` makes).
fn with_context_of<const D: usize>(fresh: Tensor<D>, like: &Tensor<D>) -> Tensor<D> {
    let fresh = match like.gradient_checkpointing_strategy() {
        Some(strategy) => fresh
            .autodiff()
            .with_gradient_checkpointing_strategy(strategy),
        None => fresh,
    };
    if like.is_require_grad() {
        fresh.require_grad()
    } else {
        fresh
    }
}

impl GradSync {
    /// `optim` (a Burn optimizer, e.g. `AdamConfig::new().init()`) with its state sharded over
    /// the ranks (ZeRO stage 1, PyTorch's `ZeroRedundancyOptimizer`): each rank keeps the state
    /// of the parameters it owns, about `1/N` of the whole. `model` is the prepared model; every
    /// rank must call this with the same model. Step with [`ZeroOptimizer::step`] after
    /// [`sync`](Self::sync), on every rank.
    ///
    /// # Errors
    /// [`prepare`](Self::prepare) was not called, or `model` has other trainable parameters
    /// than the prepared one; a fault-tolerant job ([`MembershipError::NotFaultTolerant`](burn_ddp_comm::MembershipError::NotFaultTolerant): a lost
    /// rank would take its shard of the optimizer state with it).
    pub fn zero<M: Module>(&self, optim: ModuleOptimizer, model: &M) -> Result<ZeroOptimizer> {
        burn_ddp_comm::grad::NotCarried::Zero.refuse_on(self.group())?;
        let rank = self.group().rank();
        let prepared = self.trainable_count().ok_or_else(|| {
            DdpError::model_access(
                rank,
                "sharding the optimizer state",
                "GradSync::prepare was not called: prepare the model first, then \
                     GradSync::zero(optimizer, &model)",
            )
        })?;
        let mut trainable = Trainable(Vec::new());
        model.visit(&mut trainable);
        if trainable.0.len() != prepared {
            return Err(DdpError::model_access(
                rank,
                "sharding the optimizer state",
                format!(
                    "the model has {} trainable parameters, the prepared one {prepared}: pass \
                     the model prepare returned",
                    trainable.0.len()
                ),
            ));
        }
        let params: Vec<(u64, usize)> = trainable.0.iter().map(|(id, n)| (id.val(), *n)).collect();
        Ok(ZeroOptimizer {
            inner: optim,
            pg: self.group().clone(),
            shards: ZeroShards::new(&params, self.group().world_size().as_usize()),
            stage: 1,
            chunk: (self.config().bucket_cap_bytes / 4).max(1),
            device: block_gather(self),
        })
    }

    /// ZeRO stage 2 (DeepSpeed's; FSDP2 with `reshard_after_forward=False`): as
    /// [`zero`](Self::zero), and from the next step on the gradient buckets are
    /// reduce-scattered rather than all-reduced, so that [`sync`](Self::sync) returns only the
    /// reduced gradients of the parameters this rank owns, the ones its [`ZeroOptimizer`]
    /// steps. A replica then keeps about `4 + 12/N` bytes per parameter with Adam in f32
    /// (weights, and `1/N` of the gradients and moments) instead of stage 1's `8 + 8/N`; the
    /// bytes on the wire are an all-reduce's (a reduce-scatter, then the all-gather of the
    /// stepped parameters), each bucket padded to equal blocks of whole parameters. On either
    /// transport: host-staged buckets are reduce-scattered by the communication thread, NCCL's
    /// device buckets by `ncclReduceScatter` into a block-sized output. The overlapped steps ([`overlapped`](Self::overlapped)) and accumulation work as without it;
    /// a later [`prepare`](Self::prepare) of the same model keeps it.
    ///
    /// Use the returned optimizer for every step, on every rank: the other gradients are gone,
    /// so a plain optimizer would step only this rank's parameters. Checkpoints as stage 1's
    /// ([`ZeroOptimizer::gather_record`], loadable at any world size and either stage).
    ///
    /// # Errors
    /// As [`zero`](Self::zero); a configuration stage 2 cannot run with (a communication hook,
    /// PowerSGD: `ConfigError::InvalidConfig` says what to change); an overlapped step still
    /// open.
    pub fn zero2<M: Module>(&mut self, optim: ModuleOptimizer, model: &M) -> Result<ZeroOptimizer> {
        let mut zero = self.zero(optim, model)?;
        self.shard_gradients(zero.shards.owners())?;
        zero.stage = 2;
        Ok(zero)
    }
}

impl ZeroOptimizer {
    fn rank(&self) -> Rank {
        self.pg.rank()
    }

    fn owns(&self, id: ParamId) -> bool {
        self.shards.owns(id.val(), self.rank())
    }

    /// The number of parameter elements this rank owns (whose optimizer state it keeps), and
    /// the number sharded over all ranks.
    pub fn owned_elements(&self) -> (usize, usize) {
        self.shards.plan().owned_elements(self.rank())
    }

    /// 1, or 2 where the gradients are sharded too ([`GradSync::zero2`]).
    pub fn stage(&self) -> u8 {
        self.stage
    }

    /// One step: the wrapped optimizer steps the parameters this rank owns, then the stepped
    /// parameters are all-gathered, a run of about `DdpConfig::bucket_cap_bytes` at a time. `grads` are the synchronised gradients
    /// ([`GradSync::sync`]). Every rank must call it.
    ///
    /// # Errors
    /// A parameter that cannot be read as f32 (after the all-gather, so no rank is left
    /// waiting); collective failures.
    pub fn step<M: Module>(
        &mut self,
        lr: LearningRate,
        module: M,
        mut grads: GradientsParams,
    ) -> Result<M> {
        let rank = self.rank();
        let others = |id: ParamId| self.shards.owned_elsewhere(id.val(), rank);
        module.visit(&mut DropGrads {
            grads: &mut grads,
            drop: &others,
        });
        let module = self.inner.step(lr, module, grads);
        self.gather_params(module)
    }

    /// All-gathers the stepped parameters, a run of about a bucket's size at a time
    /// ([`ZeroShards::gather_in_runs`]).
    fn gather_params<M: Module>(&self, module: M) -> Result<M> {
        if let Some(device) = &self.device {
            return self.gather_on_device(&**device, module);
        }
        if self.pg.world_size().as_usize() == 1 {
            return Ok(module);
        }
        let shards = &self.shards;
        let read = |module: &M, range: &std::ops::Range<usize>| {
            let owned = |id: ParamId| self.owns(id) && shards.within(id.val(), range);
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
        shards.gather_in_runs(&self.pg, self.chunk, module, read, write)
    }

    /// [`gather_params`](Self::gather_params) on the device: per run, this rank's owned
    /// parameters flattened into one block (padded), all-gathered by `link`, and every
    /// parameter of the run put back as a view of the result; nothing goes through the host.
    /// At world size 1 too (a copy), so that the one-GPU check runs the collective. A rank whose
    /// owned parameters do not fill its block as the plan says (another model than the
    /// planned one) sends zeros and fails after every run went, so no rank waits in a run
    /// another left.
    fn gather_on_device<M: Module>(&self, link: &dyn BlockGather, module: M) -> Result<M> {
        let shards = &self.shards;
        let pack = |module: &M, range: &Range<usize>| {
            let owned = |id: ParamId| self.owns(id) && shards.within(id.val(), range);
            let within = |id: ParamId| shards.within(id.val(), range);
            let mut pack = Pack {
                owned: &owned,
                within: &within,
                run: RunParts::default(),
            };
            module.visit(&mut pack);
            pack.run
        };
        let zeros = |n: usize, device: &Device| Tensor::<1>::zeros([n], (device, BurnDType::F32));
        let gather = |what: &str, parts: Vec<Tensor<1>>, block| {
            link.all_gather(what, Tensor::cat(parts, 0), block)
        };
        let place = |module: M, range, layout: &RunLayout, all: &Tensor<1>| {
            module.map(&mut Place {
                shards,
                range,
                layout,
                all,
            })
        };
        let (rank, chunk) = (self.rank(), self.chunk);
        shards.gather_runs_on_device(rank, chunk, module, pack, zeros, gather, place)
    }

    /// This rank's shard of the optimizer state (keyed by this process's `ParamId`s).
    pub fn to_record(&self) -> OptimizerRecord {
        self.inner.to_record()
    }

    /// Loads this rank's shard (as [`to_record`](Self::to_record) gave it, in this process).
    pub fn load_record(mut self, record: OptimizerRecord) -> Self {
        self.inner = self.inner.load_record(record);
        self
    }

    /// The whole optimizer state, on rank 0 (`None` on the others): every rank's shard,
    /// gathered (PyTorch's `consolidate_state_dict(to=0)` then `state_dict()`), keyed by
    /// parameter position. Save it with `OptimizerRecord::save` or `into_bytes`; load it with
    /// [`load_full_record`](Self::load_full_record), at any world size. Every rank must call it.
    ///
    /// # Errors
    /// A shard that cannot be (de)serialised; collective failures.
    pub fn gather_record(&self) -> Result<Option<OptimizerRecord>> {
        let rank = self.rank();
        let fail = |what: &'static str, e: String| DdpError::model_access(rank, what, e);
        let mine = self
            .inner
            .into_bytes()
            .map_err(|e| fail("serialising this rank's optimizer state", e.to_string()))?;
        let shards = &self.shards;
        let mine = rewrite(vec![mine], |id| shards.position(id).map(|i| i as u64))
            .map_err(|e| fail("serialising this rank's optimizer state", e))?;
        let all = self.pg.all_gather_bytes(&mine)?;
        if rank != Rank(0) {
            return Ok(None);
        }
        let shards = all.into_iter().map(Bytes::from_bytes_vec).collect();
        let whole =
            rewrite(shards, Some).map_err(|e| fail("merging the ranks' optimizer states", e))?;
        OptimizerRecord::from_bytes(Bytes::from_bytes_vec(whole))
            .map(Some)
            .map_err(|e| fail("merging the ranks' optimizer states", e.to_string()))
    }

    /// Loads a whole optimizer state, as [`gather_record`](Self::gather_record) gives it (saved
    /// at any world size): this rank keeps the state of the parameters it owns, under its own
    /// ids, and drops the rest.
    ///
    /// # Errors
    /// A record that cannot be read, or one that names a parameter position the model does not
    /// have (another model's state).
    pub fn load_full_record(mut self, record: OptimizerRecord) -> Result<Self> {
        let rank = self.rank();
        let fail = |e: String| DdpError::model_access(rank, "loading the whole optimizer state", e);
        let bytes = record.into_bytes().map_err(|e| fail(e.to_string()))?;
        let n = self.shards.ids().len() as u64;
        let mut beyond = None;
        let mine = rewrite(vec![bytes], |pos| {
            if pos >= n {
                beyond.get_or_insert(pos);
                return None;
            }
            let i = pos as usize;
            (self.shards.plan().owner(i) == rank).then(|| self.shards.ids()[i])
        })
        .map_err(fail)?;
        if let Some(pos) = beyond {
            return Err(fail(format!(
                "it holds the state of parameter {pos}, the model has {n} trainable parameters: \
                 the state of another model"
            )));
        }
        let record = OptimizerRecord::from_bytes(Bytes::from_bytes_vec(mine))
            .map_err(|e| fail(e.to_string()))?;
        self.inner = self.inner.load_record(record);
        Ok(self)
    }

    /// The wrapped optimizer.
    pub fn inner(&self) -> &ModuleOptimizer {
        &self.inner
    }
}

/// The parameter an entry of an optimizer record belongs to: the number before the first `.` of
/// its key (`"{id}.{field}"`, or `"{id}"` for the parameter's path).
fn key_param(key: &str) -> Option<u64> {
    key.split('.').next()?.parse().ok()
}

/// The key with its parameter number replaced.
fn rekey(key: &str, to: u64) -> String {
    match key.split_once('.') {
        Some((_, rest)) => format!("{to}.{rest}"),
        None => to.to_string(),
    }
}

/// One burnpack optimizer record from `parts`: each entry's parameter number mapped by `map`
/// (dropped where it gives `None`), an entry of a parameter that an earlier part already holds
/// left out, and entries of no parameter kept once.
fn rewrite(
    parts: Vec<Bytes>,
    map: impl FnMut(u64) -> Option<u64>,
) -> std::result::Result<Vec<u8>, String> {
    let mut map = map;
    let mut claimed: HashSet<u64> = HashSet::new();
    let mut tensors = Vec::new();
    let mut scalars = Vec::new();
    let mut metadata = Vec::new();
    let mut plain: HashSet<String> = HashSet::new();
    for part in parts {
        let reader = burn_pack::Reader::from_bytes(part).map_err(|e| format!("{e:?}"))?;
        let mut here: HashSet<u64> = HashSet::new();
        let mut target = |key_id: Option<u64>, key: &str| -> Option<Option<u64>> {
            match key_id {
                None => plain.insert(key.to_string()).then_some(None),
                Some(id) => {
                    let to = map(id)?;
                    if claimed.contains(&to) {
                        return None;
                    }
                    here.insert(to);
                    Some(Some(to))
                }
            }
        };
        for (key, value) in reader.scalars().clone() {
            if let Some(to) = target(key_param(&key), &key) {
                scalars.push((to.map_or(key.clone(), |to| rekey(&key, to)), value));
            }
        }
        for (key, value) in reader.metadata().clone() {
            if let Some(to) = target(key_param(&key), &key) {
                metadata.push((to.map_or(key.clone(), |to| rekey(&key, to)), value));
            }
        }
        for tensor in reader.into_tensors().map_err(|e| format!("{e:?}"))? {
            let (name, dtype, shape, param_id, bytes) =
                tensor.into_parts().map_err(|e| format!("{e:?}"))?;
            let id = param_id.or_else(|| key_param(&name));
            if let Some(to) = target(id, &name) {
                let name = to.map_or(name.clone(), |to| rekey(&name, to));
                tensors.push(burn_pack::Tensor::new(name, dtype, shape, to, bytes));
            }
        }
        claimed.extend(here);
    }
    let mut writer = burn_pack::Writer::new(tensors);
    for (key, value) in scalars {
        writer = writer.with_scalar(&key, value);
    }
    for (key, value) in metadata {
        writer = writer.with_metadata(&key, &value);
    }
    writer
        .into_bytes()
        .map(|b| b.to_vec())
        .map_err(|e| format!("{e:?}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn record_keys_name_their_parameter() {
        assert_eq!(key_param("1234.moment_1"), Some(1234));
        assert_eq!(key_param("77"), Some(77));
        assert_eq!(key_param("lr.step"), None);
        assert_eq!(rekey("1234.moment_1.x", 3), "3.moment_1.x");
        assert_eq!(rekey("77", 0), "0");
    }

    use burn::nn::{Linear, LinearConfig};
    use burn::optim::AdamConfig;
    use burn::tensor::TensorData;
    use burn_ddp_comm::DdpConfig;
    use burn_ddp_dev::device::on_thread_ranks;

    /// The all-gather NCCL's link does, over the host: the block read, all-gathered by the
    /// process group, uploaded where it was (without autodiff, as NCCL's output is).
    struct HostGather(ProcessGroup);

    impl BlockGather for HostGather {
        fn all_gather(&self, _what: &str, send: Tensor<1>, block: usize) -> Result<Tensor<1>> {
            let device = send.device();
            assert!(!device.is_autodiff(), "the block carries autodiff");
            let mine = send
                .into_data()
                .convert::<f32>()
                .try_to_vec::<f32>()
                .unwrap();
            assert_eq!(mine.len(), block, "a block of the wrong length");
            let mut all = vec![0.0; block * self.0.world_size().as_usize()];
            self.0.all_gather(&mine, &mut all)?;
            let n = all.len();
            Ok(Tensor::from_data(TensorData::new(all, [n]), &device))
        }
    }

    #[derive(Module, Debug)]
    struct Net {
        a: Linear,
        b: Linear,
        c: Linear,
    }

    /// Every parameter's values, in visit order, and whether it requires a gradient.
    fn values(model: &Net) -> Vec<(Vec<f32>, bool)> {
        struct All(Vec<(Vec<f32>, bool)>);
        impl ModuleVisitor for All {
            fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
                let v = p.val();
                let grad = v.is_require_grad() && v.is_autodiff();
                self.0
                    .push((v.into_data().try_to_vec::<f32>().unwrap(), grad));
            }
        }
        let mut all = All(Vec::new());
        model.visit(&mut all);
        all.0
    }

    /// Two thread ranks train the same model with two ZeRO optimizers in each stage: one
    /// all-gathering through the host, one through the device path's all-gather (the stand-in
    /// above): runs of one layer or less (small buckets), some where a rank owns nothing. Both
    /// must end with the same parameters, bit for bit, still leaves that require a gradient.
    #[test]
    fn the_device_all_gather_puts_back_what_the_host_one_does() {
        for stage in [1, 2] {
            on_thread_ranks(2, |pg| {
                let device = Device::flex().autodiff();
                let layer = |i, o| LinearConfig::new(i, o).init(&device);
                let config = DdpConfig {
                    bucket_cap_bytes: 200,
                    first_bucket_cap_bytes: 200,
                    ..DdpConfig::default()
                };
                let mut sync = GradSync::new(pg.clone(), config).unwrap();
                let model = Net {
                    a: layer(4, 8),
                    b: layer(8, 6),
                    c: layer(6, 2),
                };
                let model = sync.prepare(model).unwrap();
                let zero = |sync: &mut GradSync| match stage {
                    1 => sync.zero(AdamConfig::new().init(), &model).unwrap(),
                    _ => sync.zero2(AdamConfig::new().init(), &model).unwrap(),
                };
                let mut host = zero(&mut sync);
                let mut on_device = zero(&mut sync);
                assert!(
                    host.device.is_none(),
                    "a host-staged sync gathered on a device"
                );
                on_device.device = Some(Arc::new(HostGather(pg.clone())));
                let (mut a, mut b) = (model.clone(), model);
                let rank = pg.rank().index() as f32;
                for step in 0..3 {
                    let x = [[rank + step as f32, 1.0, -2.0, 0.5]];
                    let x = Tensor::<2>::from_floats(x, &device);
                    let loss = |m: &Net| m.c.forward(m.b.forward(m.a.forward(x.clone()))).sum();
                    let g = GradientsParams::from_grads(loss(&a).backward(), &a);
                    let g = sync.sync(&a, g).unwrap();
                    a = host.step(0.01, a, g).unwrap();
                    let g = GradientsParams::from_grads(loss(&b).backward(), &b);
                    let g = sync.sync(&b, g).unwrap();
                    b = on_device.step(0.01, b, g).unwrap();
                }
                let (a, b) = (values(&a), values(&b));
                assert!(
                    a.iter().all(|(_, grad)| *grad),
                    "a parameter lost its autodiff"
                );
                assert_eq!(a, b, "stage {stage}, rank {rank}");
            });
        }
    }
}
