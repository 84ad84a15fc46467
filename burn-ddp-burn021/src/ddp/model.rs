//! How a model joins a session: `prepare` (check, broadcast, mark, plan) and the plain,
//! after-backward path `sync_gradients`.

use core::marker::PhantomData;
use std::collections::HashMap;

use burn::module::{AutodiffModule, Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::record::{BinBytesRecorder, FullPrecisionSettings, Recorder};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Tensor, TensorData};
use burn_backend::distributed::DistributedParamId;

use burn_ddp_comm::grad::{
    check_and_load, load_from, BucketOrder, BucketPlan, HostStep, JoinCall, Reduced, Replica,
};

use super::reducer;
use super::{DdpSession, ParamInfo};
use crate::group::Rank;
use crate::{DdpError, Result};

/// What `#[ddp]` generates for a module struct; [`DdpSession::prepare_module`] uses it.
///
/// Implement it by hand only if you cannot use the attribute.
pub trait DdpModule {
    /// The struct's name, for messages.
    const DDP_NAME: &'static str;
    /// Its fields, in declaration order (Burn visits parameters in this order, which fixes
    /// the order of gradient buckets on every rank).
    const DDP_FIELDS: &'static [&'static str];
    /// The fields marked `#[ddp(skip)]`: their parameters are rank-local — not compared
    /// across ranks, not overwritten by rank 0's, never synchronised (PyTorch's
    /// `_set_params_and_buffers_to_ignore_for_model`). Frozen or per-rank parts go here.
    const DDP_SKIP: &'static [&'static str];
}

/// Where a visitor is in a module: the field names from the root.
#[derive(Default)]
pub(super) struct Path(pub(super) Vec<String>);

impl Path {
    /// Whether the parameter at this path lies under one of the `skip` top-level fields.
    pub(super) fn skipped(&self, skip: &[String]) -> bool {
        self.0.first().is_some_and(|f| is_skipped(f, skip))
    }

    fn info<B: Backend, const D: usize>(&self, tensor: &Tensor<B, D>) -> ParamInfo {
        ParamInfo::new(
            self.0.join("."),
            tensor.dims().to_vec(),
            format!("{:?}", tensor.dtype()),
        )
    }
}

/// Lists float parameters in visit order: (info, id, requires grad).
struct Describe {
    path: Path,
    out: Vec<(ParamInfo, ParamId, bool)>,
}

impl<B: Backend> ModuleVisitor<B> for Describe {
    fn enter_module(&mut self, name: &str, _container: &str) {
        self.path.0.push(name.to_owned());
    }
    fn exit_module(&mut self, _name: &str, _container: &str) {
        self.path.0.pop();
    }
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let t = param.val();
        self.out
            .push((self.path.info(&t), param.id, t.is_require_grad()));
    }
}

fn describe<B: Backend, M: Module<B>>(model: &M) -> Vec<(ParamInfo, ParamId, bool)> {
    let mut d = Describe {
        path: Path::default(),
        out: Vec::new(),
    };
    model.visit(&mut d);
    d.out
}

/// Marks trainable parameters for synchronisation (Burn then hands their gradients to `Ddp`),
/// except those under skipped fields.
pub(super) struct Mark<'a> {
    pub(super) path: Path,
    pub(super) skip: &'a [String],
}

impl<B: AutodiffBackend> ModuleMapper<B> for Mark<'_> {
    fn enter_module(&mut self, name: &str, _container: &str) {
        self.path.0.push(name.to_owned());
    }
    fn exit_module(&mut self, _name: &str, _container: &str) {
        self.path.0.pop();
    }
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let (id, tensor, mapper) = param.consume();
        let tensor = if tensor.is_require_grad() && !self.path.skipped(self.skip) {
            tensor.set_distributed(DistributedParamId::from(id.val()))
        } else {
            tensor
        };
        Param::from_mapped_value(id, tensor, mapper)
    }
}

/// Copies the values of parameters under skipped fields, by path.
struct Save<'a> {
    path: Path,
    skip: &'a [String],
    saved: Vec<(String, TensorData)>,
}

impl<B: Backend> ModuleVisitor<B> for Save<'_> {
    fn enter_module(&mut self, name: &str, _container: &str) {
        self.path.0.push(name.to_owned());
    }
    fn exit_module(&mut self, _name: &str, _container: &str) {
        self.path.0.pop();
    }
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if self.path.skipped(self.skip) {
            self.saved
                .push((self.path.0.join("."), param.val().into_data()));
        }
    }
}

/// Puts back what `Save` copied (after rank 0's record was loaded over everything).
struct Restore {
    path: Path,
    saved: Vec<(String, TensorData)>,
}

impl<B: Backend> ModuleMapper<B> for Restore {
    fn enter_module(&mut self, name: &str, _container: &str) {
        self.path.0.push(name.to_owned());
    }
    fn exit_module(&mut self, _name: &str, _container: &str) {
        self.path.0.pop();
    }
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let name = self.path.0.join(".");
        let Some(i) = self.saved.iter().position(|(n, _)| *n == name) else {
            return param;
        };
        let (_, data) = self.saved.swap_remove(i);
        let (id, tensor, mapper) = param.consume();
        let grad = tensor.is_require_grad();
        let local = Tensor::<B, D>::from_data(data, &tensor.device()).set_require_grad(grad);
        Param::from_mapped_value(id, local, mapper)
    }
}

/// Whether the parameter at dotted path `name` lies under one of the `skip` top-level fields.
fn is_skipped(name: &str, skip: &[String]) -> bool {
    let field = name.split('.').next().unwrap_or_default();
    skip.iter().any(|s| s == field)
}

/// `model`'s float parameters described (name, shape, dtype), in visit order: what
/// `FullyShard::shard` checks across the ranks.
pub(crate) fn param_infos<B: Backend, M: Module<B>>(model: &M) -> Vec<ParamInfo> {
    describe::<B, M>(model)
        .into_iter()
        .map(|(info, _, _)| info)
        .collect()
}

/// This line's [`Replica`]: a Burn 0.21 module whose parameters under the `skip` fields stay
/// rank-local (not compared, not overwritten); its record as `BinBytesRecorder` bytes.
struct AsReplica<'s, B, M> {
    model: M,
    skip: &'s [String],
    _b: PhantomData<B>,
}

impl<'s, B, M> AsReplica<'s, B, M> {
    fn new(model: M, skip: &'s [String]) -> Self {
        Self {
            model,
            skip,
            _b: PhantomData,
        }
    }
}

impl<B: AutodiffBackend, M: AutodiffModule<B>> Replica for AsReplica<'_, B, M> {
    fn params(&self) -> Vec<(ParamInfo, bool)> {
        describe::<B, M>(&self.model)
            .into_iter()
            .filter(|(i, _, _)| !is_skipped(&i.name, self.skip))
            .map(|(i, _, grad)| (i, grad))
            .collect()
    }

    fn record_bytes(&self, rank: Rank) -> Result<Vec<u8>> {
        // `into_record` folds running statistics' pending updates in (on a clone that shares
        // them), so the record sent is current.
        let recorder = BinBytesRecorder::<FullPrecisionSettings>::default();
        Recorder::<B>::record(&recorder, self.model.clone().into_record(), ())
            .map_err(|e| DdpError::model_access(rank, "serialising the model to send", e))
    }

    fn load_record_bytes(self, rank: Rank, bytes: Vec<u8>) -> Result<Self> {
        drop(self.model.clone().into_record());
        let mut save = Save {
            path: Path::default(),
            skip: self.skip,
            saved: Vec::new(),
        };
        self.model.visit(&mut save);
        let device = self.model.devices().into_iter().next().unwrap_or_default();
        let recorder = BinBytesRecorder::<FullPrecisionSettings>::default();
        let record = Recorder::<B>::load(&recorder, bytes, &device)
            .map_err(|e| DdpError::model_access(rank, "loading the model received", e))?;
        let model = self.model.load_record(record).map(&mut Restore {
            path: Path::default(),
            saved: save.saved,
        });
        Ok(Self { model, ..self })
    }

    fn param_values(&self, keep: &dyn Fn(&str) -> bool, each: &mut dyn FnMut(String, &[u8])) {
        self.model.visit(&mut Values {
            path: Path::default(),
            keep,
            each,
        });
    }
}

impl DdpSession {
    /// Makes `model` a data-parallel model of this session, on every rank:
    ///
    /// 1. checks that every rank has the same parameters (names, shapes, dtypes), failing with
    ///    the first parameter that differs and the ranks on each side;
    /// 2. loads rank 0's parameters and buffers on every other rank (the whole module record),
    ///    so all ranks start from the same weights;
    /// 3. marks the trainable parameters so that `Autodiff<Ddp<B>>` hands their gradients to
    ///    the reducer, and builds the bucket plan.
    ///
    /// Every rank must call it, with the same model architecture.
    ///
    /// # Errors
    /// [`ModelError::ModelMismatch`](burn_ddp_comm::ModelError::ModelMismatch); collective failures; a record that cannot be (de)serialised.
    pub fn prepare<B: AutodiffBackend, M: AutodiffModule<B>>(&self, model: M) -> Result<M> {
        self.prepare_with(model, &[], true)
    }

    /// [`prepare`](Self::prepare) for a `#[ddp]` struct: its `#[ddp(skip)]` fields stay
    /// rank-local (see [`DdpModule::DDP_SKIP`]).
    ///
    /// # Errors
    /// As [`prepare`](Self::prepare).
    pub fn prepare_module<B: AutodiffBackend, M: AutodiffModule<B> + DdpModule>(
        &self,
        model: M,
    ) -> Result<M> {
        tracing::debug!(
            "ddp: preparing {} (fields {:?}, skipped {:?})",
            M::DDP_NAME,
            M::DDP_FIELDS,
            M::DDP_SKIP
        );
        self.prepare_with(model, M::DDP_SKIP, true)
    }

    /// [`prepare`](Self::prepare) with `skip` as the rank-local fields; without loading rank
    /// 0's weights unless `from_root` (after a change of membership, the ranks' models are
    /// equal already).
    pub(super) fn prepare_with<B: AutodiffBackend, M: AutodiffModule<B>>(
        &self,
        model: M,
        skip: &[&str],
        from_root: bool,
    ) -> Result<M> {
        let ids = describe::<B, M>(&model)
            .into_iter()
            .map(|(info, id, _)| (info.name, id.val()));
        burn_ddp_comm::grad::FsdpState::refuse_shards(
            self.shared.pg.rank(),
            "DdpSession::prepare",
            ids,
        )?;
        let skip: Vec<String> = skip.iter().map(|s| (*s).to_owned()).collect();
        *self.shared.skip.lock().unwrap_or_else(|p| p.into_inner()) = skip.clone();
        let devices = model.devices();
        self.shared.drain.set(move || {
            devices
                .iter()
                .try_for_each(|device| B::sync(device).map_err(|e| e.to_string()))
        });
        let pg = &self.shared.pg;
        let rank = pg.rank();
        let model = check_and_load(pg, AsReplica::<B, M>::new(model, &skip), from_root)?.model;

        let model = model.map(&mut Mark {
            path: Path::default(),
            skip: &skip,
        });
        let params = describe::<B, M>(&model)
            .into_iter()
            .filter(|(info, _, grad)| *grad && !is_skipped(&info.name, &skip))
            .map(|(info, id, _)| (info, DistributedParamId::from(id.val())))
            .collect();
        let plan = reducer::plan(params, &self.shared.config);
        tracing::debug!(
            "[rank {rank}] ddp: {} parameters in {} buckets",
            plan.slots.len(),
            plan.buckets.len()
        );
        let mut reducer = self.shared.reducer();
        reducer.set_plan(plan);
        // `Autodiff<Ddp<Cuda>>`: NCCL is set up now, on the model's GPU (no-op otherwise).
        reducer.prepare_device::<B::InnerBackend>(model.devices().first())?;
        drop(reducer);
        Ok(model)
    }

    /// `root`'s record (parameters and buffers, outside the `skip` fields, which keep this
    /// rank's values) loaded into every other rank's `model`. The loaded tensors are not
    /// marked for synchronisation: the caller marks them.
    pub(super) fn load_from<B: AutodiffBackend, M: AutodiffModule<B>>(
        &self,
        model: M,
        root: Rank,
        skip: &[String],
    ) -> Result<M> {
        let replica = AsReplica::<B, M>::new(model, skip);
        Ok(load_from(&self.shared.pg, replica, root)?.model)
    }

    /// Averages `grads` across ranks after backward, bucket by bucket in a fixed order: the
    /// plain path, for gradients accumulated under [`DdpSession::no_sync`] (or whenever you
    /// prefer to synchronise explicitly). Parameters that have a gradient on some ranks only
    /// get the average on every rank.
    ///
    /// # Errors
    /// Collective failures, naming the rank at fault.
    pub fn sync_gradients<B: AutodiffBackend, M: AutodiffModule<B>>(
        &self,
        model: &M,
        grads: GradientsParams,
    ) -> Result<GradientsParams> {
        // Inside a join: announced first; the mean is over the ranks still training.
        // Elsewhere the replicas are compared after the reduction, as `complete` does after
        // the overlapped backward's: their collectives come in the same order on every path.
        let Some(round) = self.shared.announce(JoinCall::Gradients)? else {
            let grads = self.reduce_after_backward(model, grads)?;
            self.replica_check_due(model)?;
            return Ok(grads);
        };
        let grads = self.reduce_after_backward(model, grads)?;
        Ok(match round.scale(self.shared.config.reduction) {
            Some(factor) => scale(model, grads, factor),
            None => grads,
        })
    }

    /// The all-reduce of [`DdpSession::sync_gradients`], without the comparison of replicas
    /// and the announcement of a join.
    pub(super) fn reduce_after_backward<B: AutodiffBackend, M: AutodiffModule<B>>(
        &self,
        model: &M,
        mut grads: GradientsParams,
    ) -> Result<GradientsParams> {
        let config = &self.shared.config;
        let skip = self
            .shared
            .skip
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let plan = BucketPlan::build(
            describe::<B, M>(model)
                .into_iter()
                .filter(|(info, _, grad)| *grad && !is_skipped(&info.name, &skip))
                .map(|(info, id, _)| (info, id))
                .collect(),
            config,
            BucketOrder::Forward,
        );
        // The session's one communication thread (the reducer's), with a hook of this plan's.
        let mut reducer = self.shared.reducer();
        let plan = reducer.sharded(plan);
        let host = reducer.host_sync()?;
        let mut step = host.begin(&plan)?;
        model.visit(&mut Take::<B> {
            grads: &mut grads,
            plan: &plan,
            step: &mut step,
            _b: PhantomData,
        });
        let mut reduced = step.finish()?;
        model.visit(&mut Put::<B> {
            grads: &mut grads,
            plan: &plan,
            reduced: &mut reduced,
            _b: PhantomData,
        });
        let spare = reduced.into_spare();
        host.recycle(spare);
        Ok(grads)
    }
}

impl DdpSession {
    /// Registers in `grads` (this step's gradients of `model`, as `GradientsParams::from_grads`
    /// makes them after a synchronised backward) the averaged gradient of every parameter that
    /// had no gradient on this rank but one on some other rank (a branch this rank's batch did
    /// not take). Burn's gradient container only holds gradients of this rank's own graph, so
    /// the overlapped path cannot put them there during backward; without them this rank's
    /// optimizer would skip parameters the others update, and the replicas would differ (PyTorch
    /// DDP with `find_unused_parameters=True` averages them with zeros for the ranks that did
    /// not use them; so does this). [`DdpSession::gradients`] does the whole step;
    /// `DdpStrategy` calls this for you.
    ///
    /// A backward whose foreign gradients were not taken by the next backward is an error there
    /// (never a silent divergence). Every `DdpConfig::check_replicas_every` synchronised steps
    /// (calls of this or of [`DdpSession::sync_gradients`]), it also compares the ranks'
    /// parameters ([`DdpSession::check_replicas`]).
    ///
    /// # Errors
    /// `model` is not the prepared model (it lacks a parameter the reducer has a gradient for);
    /// [`ModelError::ReplicasDiverged`](burn_ddp_comm::ModelError::ReplicasDiverged).
    pub fn complete<B: AutodiffBackend, M: AutodiffModule<B>>(
        &self,
        model: &M,
        grads: GradientsParams,
    ) -> Result<GradientsParams> {
        let grads = self.register_foreign(model, grads)?;
        // Inside a join: the mean over the ranks still training.
        if let Some(factor) = self.shared.join.take_scale() {
            return Ok(scale(model, grads, factor));
        }
        Ok(grads)
    }

    /// [`DdpSession::complete`] without the join's mean: the foreign gradients registered.
    fn register_foreign<B: AutodiffBackend, M: AutodiffModule<B>>(
        &self,
        model: &M,
        mut grads: GradientsParams,
    ) -> Result<GradientsParams> {
        if !self.shared.join.joining() {
            self.replica_check_due(model)?;
        }
        let foreign = self.shared.reducer().take_foreign();
        if foreign.is_empty() {
            return Ok(grads);
        }
        let mut register = Register::<B> {
            grads: &mut grads,
            foreign,
            _b: PhantomData,
        };
        model.visit(&mut register);
        if !register.foreign.is_empty() {
            let mut names: Vec<String> = register.foreign.into_values().map(|f| f.name).collect();
            names.sort();
            return Err(DdpError::model_access(
                self.shared.pg.rank(),
                "completing the step's gradients",
                format!(
                    "the model given to DdpSession::complete has no parameter {names:?}, which \
                     other ranks had gradients for: pass the prepared model"
                ),
            ));
        }
        Ok(grads)
    }

    /// One synchronised backward of `loss`, as `GradientsParams` of `model` for the optimizer:
    /// [`DdpSession::backward`], `GradientsParams::from_grads`, then
    /// [`DdpSession::complete`].
    ///
    /// # Errors
    /// As [`DdpSession::backward`] and [`DdpSession::complete`].
    pub fn gradients<B: AutodiffBackend, M: AutodiffModule<B>>(
        &self,
        model: &M,
        loss: Tensor<B, 1>,
    ) -> Result<GradientsParams> {
        let grads = self.backward(loss)?;
        self.complete(model, GradientsParams::from_grads(grads, model))
    }
}

impl DdpSession {
    /// Compares `model`'s synchronised parameters across ranks (a digest of each, read to the
    /// host), failing with [`ModelError::ReplicasDiverged`](burn_ddp_comm::ModelError::ReplicasDiverged) naming the first that differs. Every
    /// rank must call it at the same point; [`DdpSession::complete`] and
    /// [`DdpSession::sync_gradients`] do every `DdpConfig::check_replicas_every` steps. Buffers
    /// (BatchNorm's running statistics, which each rank updates from its own batches) and
    /// rank-local fields (`#[ddp(skip)]`) are left out.
    ///
    /// # Errors
    /// [`ModelError::ReplicasDiverged`](burn_ddp_comm::ModelError::ReplicasDiverged); a parameter that cannot be read; collective failures.
    pub fn check_replicas<B: AutodiffBackend, M: AutodiffModule<B>>(
        &self,
        model: &M,
    ) -> Result<()> {
        self.compare_replicas(model, 0)
    }

    /// Counts one synchronised step ([`DdpSession::complete`] or
    /// [`DdpSession::sync_gradients`]) and compares the replicas when a check is due.
    fn replica_check_due<B: AutodiffBackend, M: AutodiffModule<B>>(&self, model: &M) -> Result<()> {
        let due = self
            .shared
            .replicas
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .due();
        match due {
            Some(step) => self.compare_replicas(model, step),
            None => Ok(()),
        }
    }

    fn compare_replicas<B: AutodiffBackend, M: AutodiffModule<B>>(
        &self,
        model: &M,
        step: u64,
    ) -> Result<()> {
        // The parameters gradient synchronisation keeps equal: the prepared plan's (the same on
        // every rank), not buffers such as BatchNorm's running statistics, which each rank
        // updates from its own batches, nor rank-local fields.
        let synced = self
            .shared
            .reducer()
            .params()
            .into_iter()
            .map(|p| p.name)
            .collect();
        let model = AsReplica::<B, M>::new(model.clone(), &[]);
        burn_ddp_comm::grad::compare_replicas(&self.shared.pg, step, &model, &synced)
    }
}

/// Each float parameter `keep` selects, its name and value bytes handed to `each` (for
/// [`Replica::param_values`]).
struct Values<'a> {
    path: Path,
    keep: &'a dyn Fn(&str) -> bool,
    each: &'a mut dyn FnMut(String, &[u8]),
}

impl<B: Backend> ModuleVisitor<B> for Values<'_> {
    fn enter_module(&mut self, name: &str, _container: &str) {
        self.path.0.push(name.to_owned());
    }
    fn exit_module(&mut self, _name: &str, _container: &str) {
        self.path.0.pop();
    }
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let name = self.path.0.join(".");
        if (self.keep)(&name) {
            (self.each)(name, param.val().into_data().as_bytes());
        }
    }
}

/// Registers the averaged gradients of parameters this rank had none for.
struct Register<'a, B> {
    grads: &'a mut GradientsParams,
    foreign: HashMap<DistributedParamId, reducer::Foreign>,
    _b: PhantomData<B>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for Register<'_, B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let Some(f) = self
            .foreign
            .remove(&DistributedParamId::from(param.id.val()))
        else {
            return;
        };
        let p = param.val();
        let (shape, dtype, device) = (p.dims(), p.dtype(), p.device());
        let t = match f.values {
            reducer::ForeignValues::Host(values) => Tensor::<B::InnerBackend, D>::from_data(
                TensorData::new(values, shape).convert_dtype(dtype),
                &device,
            ),
            #[cfg(feature = "cuda")]
            reducer::ForeignValues::Device(t) => {
                match super::gpu::from_cuda::<B::InnerBackend>(*t) {
                    Some(t) => Tensor::<B::InnerBackend, 1>::from_primitive(
                        burn::tensor::TensorPrimitive::Float(t),
                    )
                    .reshape(shape)
                    .cast(dtype),
                    // A device pass only runs on `Ddp<Cuda>`, whose tensors these are.
                    None => return,
                }
            }
        };
        self.grads.register::<B::InnerBackend, D>(param.id, t);
    }
}

/// Packs the synchronised parameters' gradients (as f32, in visit order) into the step's
/// buckets; a bucket leaves as soon as it is full.
struct Take<'a, 'p, B> {
    grads: &'a mut GradientsParams,
    plan: &'a BucketPlan<ParamId>,
    step: &'a mut HostStep<'p, ParamId>,
    _b: PhantomData<B>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for Take<'_, '_, B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let Some(&slot) = self.plan.by_id.get(&param.id) else {
            return;
        };
        let g = self.grads.remove::<B::InnerBackend, D>(param.id);
        let v = g.and_then(|t| t.into_data().convert::<f32>().into_vec::<f32>().ok());
        self.step.push(slot, v.as_deref());
    }
}

/// Puts the reduced gradients back into `grads`: every parameter some rank had a gradient for.
struct Put<'a, 'h, B> {
    grads: &'a mut GradientsParams,
    plan: &'a BucketPlan<ParamId>,
    /// Taken slot by slot: each bucket freed once its gradients are out.
    reduced: &'a mut Reduced<'h>,
    _b: PhantomData<B>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for Put<'_, '_, B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let Some(values) = self
            .plan
            .by_id
            .get(&param.id)
            .and_then(|&slot| self.reduced.take(slot))
        else {
            return;
        };
        let p = param.val();
        let data = TensorData::new(values, p.dims()).convert_dtype(p.dtype());
        let t = Tensor::<B::InnerBackend, D>::from_data(data, &p.device());
        self.grads.register::<B::InnerBackend, D>(param.id, t);
    }
}

/// `grads` of `model`'s parameters multiplied by `factor`.
pub(super) fn scale<B: AutodiffBackend, M: AutodiffModule<B>>(
    model: &M,
    mut grads: GradientsParams,
    factor: f32,
) -> GradientsParams {
    struct Scale<'a, B> {
        grads: &'a mut GradientsParams,
        factor: f32,
        _b: std::marker::PhantomData<B>,
    }
    impl<B: AutodiffBackend> ModuleVisitor<B> for Scale<'_, B> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            if let Some(g) = self.grads.remove::<B::InnerBackend, D>(param.id) {
                self.grads.register(param.id, g.mul_scalar(self.factor));
            }
        }
    }
    model.visit(&mut Scale::<B> {
        grads: &mut grads,
        factor,
        _b: std::marker::PhantomData,
    });
    grads
}
