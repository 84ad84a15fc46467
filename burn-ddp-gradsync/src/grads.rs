//! Taking a model's gradients out of Burn's `GradientsParams` in a fixed order (the
//! trainable parameters in visit order, checked against the bucket plan), and putting the
//! reduced ones back: what the host-staged and the NCCL paths of
//! [`GradSync::sync`](crate::GradSync::sync) share; and a tensor made anew from f32 values,
//! which the buffer broadcast and ZeRO's all-gather write back.

use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::{DType, Device, Shape, Tensor, TensorData};
use burn_ddp_comm::grad::{BucketPlan, ParamInfo};
use burn_ddp_comm::ModelError;
use burn_ddp_comm::{DdpError, Rank, Result};

/// The error for a model whose trainable parameters differ from the prepared one's.
pub(crate) fn changed(rank: Rank, how: &str) -> DdpError {
    DdpError::model_access(
        rank,
        "synchronising gradients",
        format!(
            "the model {how} the one given to GradSync::prepare (its trainable parameters must \
             not change after prepare; call prepare again after freezing or adding layers)"
        ),
    )
}

/// Where a reduced gradient goes back: the device and dtype of the gradient (or of the
/// parameter, where this rank had none), and the shape.
pub(crate) struct Target {
    pub(crate) device: Device,
    pub(crate) dtype: DType,
    shape: Vec<usize>,
}

/// What takes each trainable parameter's gradient, by slot: flattened, or `None` where this
/// rank has none.
pub(crate) type Sink<'s> = dyn FnMut(usize, Option<Tensor<1>>) -> Result<()> + 's;

/// Takes the gradients of `model`'s trainable parameters out of `grads`, in visit order
/// (slot order), checked against `plan`, and hands each to `sink`; returns where each reduced
/// gradient goes back.
///
/// # Errors
/// The model's trainable parameters differ from the plan's; what `sink` fails with.
pub(crate) fn take_grads<M: Module>(
    rank: Rank,
    plan: &BucketPlan<usize>,
    model: &M,
    grads: &mut GradientsParams,
    sink: &mut Sink<'_>,
) -> Result<Vec<Target>> {
    let mut take = Take {
        grads,
        plan,
        sink,
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
    Ok(take.targets)
}

/// Registers the reduced gradients in `grads`: every trainable parameter for which `value`
/// gives one (flattened, on the device and in the dtype of its target), reshaped.
pub(crate) fn put_grads<M: Module>(
    model: &M,
    grads: &mut GradientsParams,
    targets: &[Target],
    value: &mut dyn FnMut(usize, &Target) -> Option<Tensor<1>>,
) {
    model.visit(&mut Put {
        grads,
        value,
        targets,
        index: 0,
    });
}

/// Flattens the trainable parameters' gradients in visit order and hands them to the sink.
struct Take<'a, 's> {
    grads: &'a mut GradientsParams,
    plan: &'a BucketPlan<usize>,
    sink: &'a mut Sink<'s>,
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
        let grad = match self.grads.remove::<D>(param.id) {
            Some(g) => {
                self.targets.push(Target {
                    device: g.device(),
                    dtype: g.dtype(),
                    shape: g.dims().to_vec(),
                });
                let numel = g.shape().num_elements();
                if numel != expected.info.numel {
                    return Err(DdpError::Model(ModelError::GradientSize {
                        rank: self.rank,
                        param: name,
                        expected: expected.info.numel,
                        got: numel,
                    }));
                }
                Some(g.reshape([numel]))
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
        (self.sink)(slot, grad)
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
    value: &'a mut dyn FnMut(usize, &Target) -> Option<Tensor<1>>,
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
        let Some(target) = self.targets.get(slot) else {
            return;
        };
        let Some(flat) = (self.value)(slot, target) else {
            return;
        };
        let flat = if flat.dtype() == target.dtype {
            flat
        } else {
            flat.cast(target.dtype)
        };
        let grad: Tensor<D> = flat.reshape(Shape::from(target.shape.clone()));
        self.grads.register::<D>(param.id, grad);
    }
}

/// A tensor of `like`'s shape, element type and device holding `values`: a fresh leaf that
/// requires a gradient when `like` does.
pub(crate) fn filled_like<const D: usize>(like: &Tensor<D>, values: &[f32]) -> Tensor<D> {
    let data = TensorData::new(values.to_vec(), like.shape()).convert_dtype(like.dtype());
    let fresh = Tensor::from_data(data, &like.device());
    if like.is_require_grad() {
        fresh.require_grad()
    } else {
        fresh
    }
}

/// One float parameter of a model, found by [`params_by_path`].
pub(crate) struct PathParam {
    /// Its path in the model (`fc1.weight`).
    pub(crate) path: String,
    pub(crate) id: ParamId,
    pub(crate) dims: Vec<usize>,
    pub(crate) dtype: DType,
    /// Whether it takes a gradient.
    pub(crate) trainable: bool,
}

/// `model`'s float parameters in visit order, each with its path.
pub(crate) fn params_by_path<M: Module>(model: &M) -> Vec<PathParam> {
    struct Paths {
        path: Vec<String>,
        out: Vec<PathParam>,
    }
    impl ModuleVisitor for Paths {
        fn enter_module(&mut self, name: &str, _container: &str) {
            self.path.push(name.to_owned());
        }
        fn exit_module(&mut self, _name: &str, _container: &str) {
            self.path.pop();
        }
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let t = param.val();
            self.out.push(PathParam {
                path: self.path.join("."),
                id: param.id,
                dims: t.dims().to_vec(),
                dtype: t.dtype(),
                trainable: param.is_require_grad(),
            });
        }
    }
    let mut paths = Paths {
        path: Vec::new(),
        out: Vec::new(),
    };
    model.visit(&mut paths);
    paths.out
}

/// Float parameters in visit order: (what they are, whether they are trainable).
pub(crate) fn describe<M: Module>(model: &M) -> Vec<(ParamInfo, bool)> {
    params_by_path(model)
        .into_iter()
        .map(|p| {
            let info = ParamInfo::new(p.path, p.dims, format!("{:?}", p.dtype));
            (info, p.trainable)
        })
        .collect()
}

/// Refuses a model that FSDP sharded (`FullyShard::shard`) where `what` would treat its
/// parameters as whole replicas.
pub(crate) fn refuse_fsdp_shards<M: Module>(
    model: &M,
    rank: Rank,
    what: &'static str,
) -> Result<()> {
    struct Ids {
        path: Vec<String>,
        out: Vec<(String, u64)>,
    }
    impl ModuleVisitor for Ids {
        fn enter_module(&mut self, name: &str, _container: &str) {
            self.path.push(name.to_owned());
        }
        fn exit_module(&mut self, _name: &str, _container: &str) {
            self.path.pop();
        }
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            self.out.push((self.path.join("."), param.id.val()));
        }
    }
    if burn_ddp_comm::grad::FsdpState::current().is_none() {
        return Ok(());
    }
    let mut ids = Ids {
        path: Vec::new(),
        out: Vec::new(),
    };
    model.visit(&mut ids);
    burn_ddp_comm::grad::FsdpState::refuse_shards(rank, what, ids.out)
}
