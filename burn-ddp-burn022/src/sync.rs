//! [`GradSync`]: a model prepared on every rank, and its gradients reduced after backward.

use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::store::ModuleRecord;
use burn::tensor::{Bytes, DType, Device, Tensor, TensorData};
use burn_ddp_comm::grad::{
    check_same_params, BucketOrder, BucketPlan, HostStep, HostSync, ParamInfo, Reduced,
};
use burn_ddp_comm::{DdpConfig, DdpError, ProcessGroup, Rank, Result};

/// Gradient synchronisation for one rank: [`prepare`](Self::prepare) the model once, then
/// [`sync`](Self::sync) the gradients of every step before the optimizer sees them.
///
/// Every rank must make the same calls in the same order (each is a collective).
pub struct GradSync {
    pg: ProcessGroup,
    config: DdpConfig,
    host: HostSync,
    /// The prepared model's trainable parameters (slot = position in visit order).
    plan: Option<BucketPlan<usize>>,
}

impl std::fmt::Debug for GradSync {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GradSync")
            .field("rank", &self.pg.rank())
            .field("world_size", &self.pg.world_size())
            .field("config", &self.config)
            .field("params", &self.plan.as_ref().map_or(0, |p| p.slots.len()))
            .finish()
    }
}

impl GradSync {
    /// Gradient synchronisation over `pg` (this process's rank of the job), with `config`
    /// (bucket sizes, mean or sum, compression; its `overlap` and `transport` do not apply to
    /// this line: it reduces after backward, host-staged).
    ///
    /// # Errors
    /// An invalid `config`; the communication thread cannot be started.
    pub fn new(pg: ProcessGroup, config: DdpConfig) -> Result<Self> {
        config.validate()?;
        let host = HostSync::start(&pg, &config)?;
        Ok(Self {
            pg,
            config,
            host,
            plan: None,
        })
    }

    /// The process group.
    pub fn group(&self) -> &ProcessGroup {
        &self.pg
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
            .map(BucketPlan::bucket_names)
            .unwrap_or_default()
    }

    /// Makes `model` the same on every rank, and the model whose gradients [`sync`](Self::sync)
    /// reduces:
    ///
    /// 1. checks that every rank has the same float parameters (names, shapes, dtypes, in
    ///    order), failing with the first that differs and what each rank has there;
    /// 2. loads rank 0's whole record (parameters and buffers) on every other rank;
    /// 3. plans the buckets of its trainable parameters.
    ///
    /// # Errors
    /// [`DdpError::ModelMismatch`]; a record that cannot be written or read; collective
    /// failures.
    pub fn prepare<M: Module>(&mut self, model: M) -> Result<M> {
        let rank = self.pg.rank();
        let described = describe(&model);
        let all: Vec<ParamInfo> = described.iter().map(|(i, _)| i.clone()).collect();
        check_same_params(&self.pg, &all)?;

        let model = if self.pg.world_size().as_usize() > 1 {
            let bytes = if rank == Rank(0) {
                model
                    .clone()
                    .into_record()
                    .into_bytes()
                    .map_err(|e| model_error(rank, "serialising rank 0's model", e))?
                    .to_vec()
            } else {
                Vec::new()
            };
            let bytes = self.pg.broadcast_bytes(bytes, Rank(0))?;
            if rank == Rank(0) {
                model
            } else {
                let record = ModuleRecord::from_bytes(Bytes::from_bytes_vec(bytes))
                    .map_err(|e| model_error(rank, "reading rank 0's model", e))?;
                model
                    .try_load_record(record)
                    .map_err(|e| model_error(rank, "loading rank 0's model", e))?
            }
        } else {
            model
        };

        let trainable = describe(&model)
            .into_iter()
            .filter(|(_, grad)| *grad)
            .enumerate()
            .map(|(slot, (info, _))| (info, slot))
            .collect();
        let plan = BucketPlan::build(trainable, &self.config, BucketOrder::Forward);
        tracing::debug!(
            "[rank {rank}] ddp: {} parameters in {} buckets",
            plan.slots.len(),
            plan.buckets.len()
        );
        self.plan = Some(plan);
        Ok(model)
    }

    /// Reduces `grads` (this rank's gradients of `model`, as `GradientsParams::from_grads`
    /// makes them) across every rank, and returns them for the optimizer: the mean (or sum, as
    /// configured) of every parameter that some rank has a gradient for.
    ///
    /// # Errors
    /// [`prepare`](Self::prepare) was not called, or the model's trainable parameters changed
    /// since; a gradient of the wrong size; collective failures, naming the rank at fault.
    pub fn sync<M: Module>(
        &mut self,
        model: &M,
        mut grads: GradientsParams,
    ) -> Result<GradientsParams> {
        let rank = self.pg.rank();
        let Some(plan) = self.plan.as_ref() else {
            return Err(DdpError::Model {
                rank,
                what: "synchronising gradients",
                reason: "GradSync::prepare was not called: prepare the model once, on every \
                         rank, before training"
                    .into(),
            });
        };
        let mut step = self.host.begin(plan)?;
        let mut take = Take {
            grads: &mut grads,
            plan,
            step: &mut step,
            path: Vec::new(),
            index: 0,
            targets: Vec::with_capacity(plan.slots.len()),
            error: None,
            rank,
        };
        model.visit(&mut take);
        if let Some(e) = take.error {
            return Err(e);
        }
        if take.index != plan.slots.len() {
            return Err(changed(rank, "has fewer trainable parameters than"));
        }
        let targets = take.targets;
        let reduced = step.finish()?;
        model.visit(&mut Put {
            grads: &mut grads,
            reduced: &reduced,
            targets: &targets,
            index: 0,
        });
        Ok(grads)
    }
}

fn model_error(rank: Rank, what: &'static str, e: impl std::fmt::Display) -> DdpError {
    DdpError::Model {
        rank,
        what,
        reason: e.to_string(),
    }
}

fn changed(rank: Rank, how: &str) -> DdpError {
    DdpError::Model {
        rank,
        what: "synchronising gradients",
        reason: format!(
            "the model {how} the one given to GradSync::prepare (its trainable parameters must \
             not change after prepare; call prepare again after freezing or adding layers)"
        ),
    }
}

/// Float parameters in visit order: (what they are, whether they are trainable).
fn describe<M: Module>(model: &M) -> Vec<(ParamInfo, bool)> {
    struct Describe {
        path: Vec<String>,
        out: Vec<(ParamInfo, bool)>,
    }
    impl ModuleVisitor for Describe {
        fn enter_module(&mut self, name: &str, _container: &str) {
            self.path.push(name.to_owned());
        }
        fn exit_module(&mut self, _name: &str, _container: &str) {
            self.path.pop();
        }
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let t = param.val();
            let info = ParamInfo::new(
                self.path.join("."),
                t.dims().to_vec(),
                format!("{:?}", t.dtype()),
            );
            self.out.push((info, param.is_require_grad()));
        }
    }
    let mut d = Describe {
        path: Vec::new(),
        out: Vec::new(),
    };
    model.visit(&mut d);
    d.out
}

/// Where a reduced gradient goes back: the device and dtype of the gradient (or of the
/// parameter, where this rank had none), and the shape.
struct Target {
    device: Device,
    dtype: DType,
    shape: Vec<usize>,
}

/// Packs the trainable parameters' gradients, as f32 in visit order, into the step's buckets;
/// a bucket leaves for the communication thread as soon as it is full.
struct Take<'a, 'p> {
    grads: &'a mut GradientsParams,
    plan: &'a BucketPlan<usize>,
    step: &'a mut HostStep<'p, usize>,
    path: Vec<String>,
    index: usize,
    targets: Vec<Target>,
    error: Option<DdpError>,
    rank: Rank,
}

impl Take<'_, '_> {
    fn take<const D: usize>(&mut self, param: &Param<Tensor<D>>) -> Result<()> {
        let slot = self.index;
        self.index += 1;
        let Some(expected) = self.plan.slots.get(slot) else {
            return Err(changed(self.rank, "has more trainable parameters than"));
        };
        let name = self.path.join(".");
        if expected.info.name != name {
            return Err(changed(
                self.rank,
                &format!(
                    "has `{name}` where `{}` was in",
                    expected.info.name.as_str()
                ),
            ));
        }
        let values = match self.grads.remove::<D>(param.id) {
            Some(g) => {
                self.targets.push(Target {
                    device: g.device(),
                    dtype: g.dtype(),
                    shape: g.dims().to_vec(),
                });
                let data = g
                    .try_into_data()
                    .map_err(|e| model_error(self.rank, "reading a gradient", e))?;
                let values = data
                    .convert::<f32>()
                    .try_into_vec::<f32>()
                    .map_err(|e| model_error(self.rank, "reading a gradient", format!("{e:?}")))?;
                Some(values)
            }
            None => {
                let p = param.val().inner();
                self.targets.push(Target {
                    device: p.device(),
                    dtype: p.dtype(),
                    shape: p.dims().to_vec(),
                });
                None
            }
        };
        self.step.push(slot, values.as_deref())
    }
}

impl ModuleVisitor for Take<'_, '_> {
    fn enter_module(&mut self, name: &str, _container: &str) {
        self.path.push(name.to_owned());
    }
    fn exit_module(&mut self, _name: &str, _container: &str) {
        self.path.pop();
    }
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if self.error.is_some() || !param.is_require_grad() {
            return;
        }
        if let Err(e) = self.take(param) {
            self.error = Some(e);
        }
    }
}

/// Registers the reduced gradients: every trainable parameter that some rank had a gradient
/// for, on the device and in the dtype its gradient had.
struct Put<'a> {
    grads: &'a mut GradientsParams,
    reduced: &'a Reduced,
    targets: &'a [Target],
    index: usize,
}

impl ModuleVisitor for Put<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if !param.is_require_grad() {
            return;
        }
        let slot = self.index;
        self.index += 1;
        let (Some(values), Some(target)) = (self.reduced.get(slot), self.targets.get(slot)) else {
            return;
        };
        let data = TensorData::new(values.to_vec(), target.shape.clone());
        let grad = Tensor::<D>::from_data(data, (&target.device, target.dtype));
        self.grads.register::<D>(param.id, grad);
    }
}
