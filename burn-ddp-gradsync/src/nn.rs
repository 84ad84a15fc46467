//! Layers that need the whole job: [`SyncBatchNorm`], Burn's `BatchNorm` with the
//! statistics of the global batch (PyTorch's `SyncBatchNorm`).
//!
//! Burn 0.22 and 0.23 have no backend of ours to carry a collective inside autodiff, so the
//! all-reduce of the statistics is an autodiff operation of this module's own, on Burn's extension
//! API: the tensor's autodiff primitive taken out of `Dispatch` (`Tensor::try_into_primitive` for
//! `Autodiff<B, C>`), an operation registered with burn-autodiff's public `Backward` whose backward
//! all-reduces the incoming gradient, and the result put back (`Tensor::from_primitive`). `B` is
//! each backend this crate is built for: `Flex` (feature `flex`), `NdArray` (`ndarray`), Burn's
//! `Cube` (`cuda`, with or without `fusion`) (`crate::autodiff`). Built for none of them, the
//! all-reduce is never reached (a layer's sum fails, saying which feature to enable), so what
//! only it reads is unused.
#![cfg_attr(
    not(any(feature = "flex", feature = "ndarray", feature = "cuda")),
    allow(dead_code)
)]

use std::cell::RefCell;
use std::ops::ControlFlow;
use std::sync::{Arc, Mutex, Weak};

use burn::config::Config;
use burn::module::{Flag, Module, Param, RunningState};
use burn::nn::{BatchNorm, BatchNormConfig};
use burn::tensor::Tensor;
use burn_ddp_comm::train::vote::FailureSlot;
use burn_ddp_comm::{DdpError, ProcessGroup, Result, WeakGroup};

/// [`SyncBatchNorm`]'s configuration: the same fields, defaults and checks as Burn's
/// `BatchNormConfig`.
#[derive(Config, Debug)]
pub struct SyncBatchNormConfig {
    /// The number of features (channels). Must be greater than zero.
    pub num_features: usize,
    /// A finite, positive value required for numerical stability. Default: 1e-5
    #[config(default = 1e-5)]
    pub epsilon: f64,
    /// A finite momentum in `[0, 1]` used to update the running statistics. Default: 0.1
    #[config(default = 0.1)]
    pub momentum: f64,
}

impl SyncBatchNormConfig {
    /// A new [`SyncBatchNorm`], initialised as Burn's `BatchNorm` (γ = 1, β = 0, running mean
    /// 0, running variance 1).
    ///
    /// # Panics
    /// As `BatchNormConfig::init`: `num_features` zero, `epsilon` not finite and positive, or
    /// `momentum` not finite and within `[0, 1]`.
    pub fn init(&self, device: &burn::tensor::Device) -> SyncBatchNorm {
        burn_ddp_comm::nn::made_collective_layer();
        BatchNormConfig::new(self.num_features)
            .with_epsilon(self.epsilon)
            .with_momentum(self.momentum)
            .init(device)
            .into()
    }
}

/// Batch normalization over the **global** batch (PyTorch's `SyncBatchNorm`): in training,
/// each channel's mean and variance are those of every rank's batch together, so the
/// normalization (and the running statistics) do not depend on how the batch is split over the
/// ranks, nor on small per-rank batches. Two small all-reduces per forward (the sums and counts,
/// then the sums of squared deviations from the global mean: two passes, as Burn's `BatchNorm`,
/// so the same precision), and their backward all-reduces the gradients of the statistics,
/// which makes the gradients those of one process on the global batch. Ranks may have different
/// batch sizes (the counts are reduced too). In validation and inference (a device without
/// autodiff, or the layer's `training` flag off) it is `BatchNorm` on the running statistics,
/// with no collective.
///
/// A drop-in for Burn's `BatchNorm` (input `[batch, channels, ...]`): the same fields, so
/// the same record, and `SyncBatchNorm::from(batch_norm)` / [`SyncBatchNorm::into_batch_norm`]
/// convert a built layer. Change the field's type and config; nothing else.
///
/// - **The group**: the all-reduces run over the group of the
///   [`GradSync`](crate::GradSync) made on the forward's thread, else the process's last (one
///   rank per process, or per thread of an in-process group; `DdpStrategy` makes one). Without
///   one (one process, or world size 1), `SyncBatchNorm` is `BatchNorm`.
/// - **Backends**: the ones this crate is built for: feature `flex` for Burn's `Flex`,
///   `ndarray` for `NdArray`, `cuda` (or `fusion`) for Burn's CUDA backend. On another, the
///   forward is this rank's `BatchNorm` and the next `GradSync::sync` fails saying which feature
///   to enable.
/// - **Failures**: a collective that fails in the forward or the backward (a rank lost, a
///   deadline) leaves this rank's statistics in place and is returned by the next
///   `GradSync::sync`, as every collective failure is.
///
/// Every rank must run the same number of `SyncBatchNorm` forwards per step (they are
/// collectives); not inside `GradSync::join` (as PyTorch's `Join` does not support it).
#[derive(Module, Debug)]
pub struct SyncBatchNorm {
    /// The learnable scale γ.
    pub gamma: Param<Tensor<1>>,
    /// The learnable shift β.
    pub beta: Param<Tensor<1>>,
    /// Whether training behavior is enabled for this layer (`BatchNorm`'s flag).
    pub training: Param<Flag>,
    /// The running mean.
    pub running_mean: RunningState<Tensor<1>>,
    /// The running variance (of the global batch, biased, as `BatchNorm`'s).
    pub running_var: RunningState<Tensor<1>>,
    /// Momentum of the running statistics.
    pub momentum: f64,
    /// A value required for numerical stability.
    pub epsilon: f64,
}

impl From<BatchNorm> for SyncBatchNorm {
    fn from(bn: BatchNorm) -> Self {
        burn_ddp_comm::nn::made_collective_layer();
        Self {
            gamma: bn.gamma,
            beta: bn.beta,
            training: bn.training,
            running_mean: bn.running_mean,
            running_var: bn.running_var,
            momentum: bn.momentum,
            epsilon: bn.epsilon,
        }
    }
}

impl SyncBatchNorm {
    /// The same layer as Burn's `BatchNorm` (for a program without a job).
    pub fn into_batch_norm(self) -> BatchNorm {
        BatchNorm {
            gamma: self.gamma,
            beta: self.beta,
            training: self.training,
            running_mean: self.running_mean,
            running_var: self.running_var,
            momentum: self.momentum,
            epsilon: self.epsilon,
        }
    }

    /// Normalizes `input` (`[batch, channels, ...]`, `D >= 2`, checked at compile time): with
    /// the global batch's statistics in training, the running ones otherwise.
    ///
    /// # Panics
    /// As `BatchNorm::forward`: an input whose second axis is not `num_features`.
    pub fn forward<const D: usize>(&self, input: Tensor<D>) -> Tensor<D> {
        const {
            assert!(
                D >= 2,
                "SyncBatchNorm needs an input [batch, channels, ...]"
            )
        };
        burn_ddp_comm::nn::made_collective_layer();
        let [channels] = self.gamma.shape().dims();
        assert_eq!(
            input.dims()[1],
            channels,
            "SyncBatchNorm with {channels} features got an input of shape {:?}",
            input.dims()
        );
        let device = input.device();
        let (mean, var) = if device.is_autodiff() && self.training.is_enabled() {
            self.global_statistics(input.clone())
        } else {
            let running = (self.running_mean.value(), self.running_var.value());
            (running.0.to_device(&device), running.1.to_device(&device))
        };
        // Burn's normalisation with the given statistics: under autodiff, a composition of
        // tensor operations, so the gradient reaches the global statistics (and, through their
        // all-reduce, every rank's batch).
        let (gamma, beta) = (self.gamma.val(), self.beta.val());
        burn::tensor::module::batch_norm(input, gamma, beta, mean, var, self.epsilon)
    }

    /// The mean and (biased) variance of each channel over every rank's batch, and the
    /// running statistics updated with them.
    fn global_statistics<const D: usize>(&self, input: Tensor<D>) -> (Tensor<1>, Tensor<1>) {
        let dims = input.dims();
        let channels = dims[1];
        let per_channel = dims.iter().product::<usize>() / channels;
        let device = input.device();
        let x = input.swap_dims(0, 1).reshape([channels, per_channel]);

        // Sums and this rank's count, summed over the ranks.
        let count = Tensor::<1>::from_floats([per_channel as f32], &device);
        let sums = Tensor::cat(vec![x.clone().sum_dim(1).reshape([channels]), count], 0);
        let sums = group_sum(sums);
        let total = sums.clone().narrow(0, channels, 1);
        let mean = sums.narrow(0, 0, channels).div(total.clone());

        // Squared deviations from the global mean, summed over the ranks.
        let centred = x.sub(mean.clone().reshape([channels, 1]));
        let var = group_sum(centred.square().sum_dim(1).reshape([channels])).div(total);

        let momentum = self.momentum;
        let update = |state: &RunningState<Tensor<1>>, batch: &Tensor<1>| {
            let running = state.value_sync().to_device(&device);
            let batch = batch.clone().detach().mul_scalar(momentum);
            state.update(running.mul_scalar(1.0 - momentum).add(batch).detach());
        };
        update(&self.running_mean, &mean);
        update(&self.running_var, &var);
        (mean, var)
    }
}

/// The group this process's layers all-reduce over, where their failures wait, and what their
/// all-reduces must go behind.
#[derive(Debug, Clone)]
pub(crate) struct LayerGroup {
    pg: ProcessGroup,
    failure: FailureSlot,
    behind: Behind,
}

/// A registered group: weak, so that the registry never keeps a group alive (the last
/// `ProcessGroup` handle dropped is what tells the other ranks that this one finished).
type Registered = (WeakGroup, FailureSlot, Behind);

/// What a layer's all-reduce must go behind: the gradient buckets an overlapped step has in
/// flight on the communication thread (`GradSync::overlapped`), so that every rank runs the
/// group's collectives in one order.
pub(crate) trait InOrder: Send + Sync {
    /// `data` summed over the group behind the buckets in flight; `Err(data)` when none is
    /// (the caller all-reduces directly: nothing can overtake it).
    fn sum_in_order(&self, data: Vec<f32>) -> std::result::Result<Result<Vec<f32>>, Vec<f32>>;
}

/// The step the layers of a `GradSync` go behind while it is open (weak: the step's end
/// drops it).
#[derive(Clone, Default)]
pub(crate) struct Behind(Arc<Mutex<Option<Weak<dyn InOrder>>>>);

impl std::fmt::Debug for Behind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Behind")
    }
}

impl Behind {
    /// Makes `step` what the layers go behind (`None`: nothing).
    pub(crate) fn set(&self, step: Option<Weak<dyn InOrder>>) {
        *self.0.lock().unwrap_or_else(|p| p.into_inner()) = step;
    }

    fn current(&self) -> Option<Arc<dyn InOrder>> {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .and_then(Weak::upgrade)
    }
}

/// Set by [`LayerGroup::register`] (each `GradSync::new`): the process's last, for a forward
/// on another thread than its `GradSync`'s.
static LAYERS: Mutex<Option<Registered>> = Mutex::new(None);

thread_local! {
    /// The group of the `GradSync` made on this thread: the ranks of an in-process group, one
    /// thread each, keep theirs apart.
    static THREAD_LAYERS: RefCell<Option<Registered>> = const { RefCell::new(None) };
}

impl LayerGroup {
    /// Makes `pg` the group of the layers of this thread (and of the process, for threads that
    /// made none); returns where their failures are kept.
    pub(crate) fn register(pg: &ProcessGroup) -> (FailureSlot, Behind) {
        let (failure, behind) = (FailureSlot::default(), Behind::default());
        let registered = (pg.downgrade(), failure.clone(), behind.clone());
        THREAD_LAYERS.with(|t| *t.borrow_mut() = Some(registered.clone()));
        *LAYERS.lock().unwrap_or_else(|p| p.into_inner()) = Some(registered);
        (failure, behind)
    }

    /// This thread's group, else the process's, while it lives; none at world size 1.
    fn current() -> Option<Self> {
        let alive = |r: Option<Registered>| {
            let (weak, failure, behind) = r?;
            Some(Self {
                pg: weak.upgrade()?,
                failure,
                behind,
            })
        };
        let group = alive(THREAD_LAYERS.with(|t| t.borrow().clone()))
            .or_else(|| alive(LAYERS.lock().unwrap_or_else(|p| p.into_inner()).clone()))?;
        (group.pg.world_size().as_usize() > 1).then_some(group)
    }

    /// Keeps a failure of this module's own for the next `GradSync::sync`.
    fn fail(&self, reason: String) {
        self.failure.fail(self.model_error(reason));
    }

    fn model_error(&self, reason: String) -> DdpError {
        DdpError::model_access(
            self.pg.rank(),
            "all-reducing SyncBatchNorm's statistics",
            reason,
        )
    }
}

/// `t` summed over the group of this process's layers, differentiably (its gradient is the
/// incoming gradient summed over the group); `t` itself without a group.
fn group_sum(t: Tensor<1>) -> Tensor<1> {
    let Some(group) = LayerGroup::current() else {
        return t;
    };
    match tracked::sum(&group, t) {
        ControlFlow::Break(sum) => sum,
        ControlFlow::Continue(t) => {
            group.fail(format!(
                "the tensor is on a backend that burn-ddp was not built for ({:?}): enable its \
                 feature for that backend ({})",
                t.device(),
                crate::release::BACKEND_FEATURES
            ));
            t
        }
    }
}

/// The all-reduce as an autodiff operation, for each backend this crate is built for.
mod tracked {
    use std::ops::ControlFlow;

    use super::LayerGroup;
    use crate::autodiff::{self, AutodiffOp};
    use burn::tensor::Tensor;

    /// `t` summed over `group` with a backward that sums the gradient over it (`Break`), from
    /// the backend among those this crate is built for that `t` is on; `Continue(t)` when it is
    /// on none of them.
    pub(super) fn sum(group: &LayerGroup, t: Tensor<1>) -> ControlFlow<Tensor<1>, Tensor<1>> {
        autodiff::apply(&Sum(group), t)
    }

    /// The sum over a group.
    struct Sum<'a>(&'a LayerGroup);

    impl AutodiffOp<Tensor<1>> for Sum<'_> {
        #[cfg(any(feature = "flex", feature = "ndarray", feature = "cuda"))]
        fn on<B, C>(&self, t: Tensor<1>) -> ControlFlow<Tensor<1>, Tensor<1>>
        where
            B: autodiff::Backend,
            C: autodiff::CheckpointStrategy,
            autodiff::DispatchTensor: autodiff::DispatchKindConversion<B>
                + autodiff::DispatchKindConversion<autodiff::Autodiff<B, C>>,
        {
            ad::sum::<B, C>(self.0, t)
        }
    }

    #[cfg(any(feature = "flex", feature = "ndarray", feature = "cuda"))]
    mod ad {
        use std::ops::ControlFlow::{self, Break, Continue};

        use crate::autodiff::{
            self, Autodiff, Backend, Backward, CheckpointStrategy, Checkpointer,
            DispatchKindConversion, DispatchTensor, Gradients, Ops,
        };
        use burn::backend::autodiff::ops::unary;
        use burn::tensor::{Tensor, TensorData};
        use burn_ddp_comm::{ReduceOp, Result};

        use super::LayerGroup;

        /// The operation: its state is the group, its backward the gradient's sum over it.
        #[derive(Debug)]
        struct GroupSum;

        impl<B: Backend> Backward<B, 1> for GroupSum
        where
            DispatchTensor: DispatchKindConversion<B>,
        {
            type State = LayerGroup;

            fn backward(
                self,
                ops: Ops<Self::State, 1>,
                grads: &mut Gradients,
                _checkpointer: &mut Checkpointer,
            ) {
                let group = ops.state;
                unary::<B, _>(ops.parents, ops.node, grads, |grad| {
                    inner_sum::<B>(&group, grad)
                });
            }
        }

        /// The sum (`Break`) when `t` is an `Autodiff<B, C>` tensor; `Continue(t)` otherwise.
        pub(super) fn sum<B, C>(
            group: &LayerGroup,
            t: Tensor<1>,
        ) -> ControlFlow<Tensor<1>, Tensor<1>>
        where
            B: Backend,
            C: CheckpointStrategy,
            DispatchTensor: DispatchKindConversion<B> + DispatchKindConversion<Autodiff<B, C>>,
        {
            let Ok(tensor) = t.clone().try_into_primitive::<Autodiff<B, C>>() else {
                return Continue(t);
            };
            let (primitive, node) = tensor.into_parts();
            let sum = inner_sum::<B>(group, primitive);
            Break(autodiff::finish::<B, C, _, 1, 1>(
                GroupSum,
                [node],
                group.clone(),
                sum,
            ))
        }

        /// The sum over `group` of a tensor of the inner backend `B`.
        fn inner_sum<B>(group: &LayerGroup, t: B::FloatTensorPrimitive) -> B::FloatTensorPrimitive
        where
            B: Backend,
            DispatchTensor: DispatchKindConversion<B>,
        {
            let sum = host_sum(group, Tensor::<1>::from_primitive::<B>(t.clone()));
            // The sum is made on the input's device, so of its backend: a failure here would be
            // Burn's, kept as any other for the next `GradSync::sync`.
            sum.try_into_primitive::<B>().unwrap_or_else(|e| {
                group.fail(format!(
                    "Burn gave the sum back on another backend than {}: {e:?}",
                    std::any::type_name::<B>()
                ));
                t
            })
        }

        /// `t`'s element-wise sum over the group, on `t`'s device and dtype; `t` itself (and the
        /// error kept for the next `GradSync::sync`) when that fails.
        fn host_sum<const D: usize>(group: &LayerGroup, t: Tensor<D>) -> Tensor<D> {
            match try_host_sum(group, t.clone()) {
                Ok(sum) => sum,
                Err(e) => {
                    group.failure.fail(e);
                    t
                }
            }
        }

        fn try_host_sum<const D: usize>(group: &LayerGroup, t: Tensor<D>) -> Result<Tensor<D>> {
            let (device, dtype) = (t.device(), t.dtype());
            let data = t
                .try_into_data()
                .map_err(|e| group.model_error(e.to_string()))?;
            let shape = data.shape().clone();
            let values = data
                .convert_dtype(burn::tensor::DType::F32)
                .try_into_vec::<f32>()
                .map_err(|e| group.model_error(format!("{e:?}")))?;
            let values = match group.behind.current() {
                Some(step) => match step.sum_in_order(values) {
                    Ok(summed) => summed?,
                    Err(mut values) => {
                        group.pg.all_reduce(&mut values, ReduceOp::Sum)?;
                        values
                    }
                },
                None => {
                    let mut values = values;
                    group.pg.all_reduce(&mut values, ReduceOp::Sum)?;
                    values
                }
            };
            let data = TensorData::new(values, shape).convert_dtype(dtype);
            Ok(Tensor::from_data(data, (&device, dtype)))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::{Device, Distribution};

    fn values<const D: usize>(t: Tensor<D>) -> Vec<f32> {
        t.into_data().convert::<f32>().try_to_vec().unwrap()
    }

    fn close(a: &[f32], b: &[f32]) -> bool {
        a.len() == b.len()
            && a.iter()
                .zip(b)
                .all(|(x, y)| (x - y).abs() <= 1e-5 * (1.0 + y.abs()))
    }

    #[test]
    fn without_a_job_it_is_batch_norm_in_training_and_inference() {
        let _ = LayerGroup::register(&ProcessGroup::single());
        let device = Device::default().autodiff();
        let sync = SyncBatchNormConfig::new(3).init(&device);
        let plain = BatchNormConfig::new(3).init(&device);
        for step in 0..3 {
            device.seed(step);
            let x = Tensor::<4>::random([5, 3, 2, 2], Distribution::Normal(1.0, 2.0), &device);
            let (got, want) = (sync.forward(x.clone()), plain.forward(x));
            assert!(close(&values(got), &values(want)), "step {step}");
        }
        let stats = |mean: &RunningState<Tensor<1>>, var: &RunningState<Tensor<1>>| {
            [values(mean.value_sync()), values(var.value_sync())].concat()
        };
        let (got, want) = (
            stats(&sync.running_mean, &sync.running_var),
            stats(&plain.running_mean, &plain.running_var),
        );
        assert!(close(&got, &want), "{got:?} vs {want:?}");
        // Inference: the running statistics, as BatchNorm (and the same layer back).
        let x = Tensor::<2>::random([4, 3], Distribution::Default, &Device::default());
        let plain = plain.valid();
        let back = sync.valid().into_batch_norm();
        assert_eq!(values(back.forward(x.clone())), values(plain.forward(x)));
    }
}
