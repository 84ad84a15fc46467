//! Layers that need the whole job: [`SyncBatchNorm`], Burn's `BatchNorm` with the statistics of
//! the global batch (PyTorch's `SyncBatchNorm`).

use burn::backend::Autodiff;
use burn::config::Config;
use burn::module::{Initializer, Module, Param, RunningState};
use burn::nn::BatchNorm;
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorPrimitive};
use burn_backend::distributed::{DistributedBackend, ReduceOperation};
use burn_backend::tensor::FloatTensor;

use crate::Ddp;

mod sealed {
    pub trait Sealed {}
}

/// The backends [`SyncBatchNorm`] runs on: `Autodiff<Ddp<B>>` (training: the statistics are
/// all-reduced with a differentiable all-reduce, whose backward all-reduces the gradients) and
/// `Ddp<B>` (validation and inference: the running statistics, no collective). Without a
/// session (one process) the all-reduce is the identity, and `SyncBatchNorm` is `BatchNorm`.
pub trait SyncNormBackend: Backend + sealed::Sealed {
    /// The sum of `tensor` over every rank of the session (differentiable under autodiff).
    fn all_reduce_sum(tensor: FloatTensor<Self>) -> FloatTensor<Self>;
}

impl<B: Backend> sealed::Sealed for Ddp<B> {}
impl<B: Backend> sealed::Sealed for Autodiff<Ddp<B>> {}

impl<B: Backend> SyncNormBackend for Ddp<B> {
    fn all_reduce_sum(tensor: FloatTensor<Self>) -> FloatTensor<Self> {
        <Self as DistributedBackend>::all_reduce(tensor, ReduceOperation::Sum, Vec::new()).resolve()
    }
}

impl<B: Backend> SyncNormBackend for Autodiff<Ddp<B>> {
    fn all_reduce_sum(tensor: FloatTensor<Self>) -> FloatTensor<Self> {
        <Self as DistributedBackend>::all_reduce(tensor, ReduceOperation::Sum, Vec::new()).resolve()
    }
}

burn_ddp_comm::sync_batch_norm_config! {
    /// [`SyncBatchNorm`]'s configuration: the same fields and defaults as Burn's
    /// `BatchNormConfig`.
    pub struct SyncBatchNormConfig
}

impl SyncBatchNormConfig {
    /// A new [`SyncBatchNorm`] (γ = 1, β = 0, running mean 0, running variance 1, as
    /// `BatchNorm`).
    pub fn init<B: Backend>(&self, device: &B::Device) -> SyncBatchNorm<B> {
        burn_ddp_comm::nn::made_collective_layer();
        SyncBatchNorm {
            gamma: Initializer::Ones.init([self.num_features], device),
            beta: Initializer::Zeros.init([self.num_features], device),
            running_mean: RunningState::new(Tensor::zeros([self.num_features], device)),
            running_var: RunningState::new(Tensor::ones([self.num_features], device)),
            momentum: self.momentum,
            epsilon: self.epsilon,
        }
    }
}

/// Batch normalization over the **global** batch (PyTorch's `SyncBatchNorm`): in training,
/// each channel's mean and variance are those of every rank's batch together, so the
/// normalization (and the running statistics) do not depend on how the batch is split over
/// the ranks, nor on small per-rank batches. Two small all-reduces per forward (the sums and
/// counts, then the sums of squared deviations from the global mean: the same two passes as
/// `BatchNorm`, so the same precision), and their backward all-reduces the gradients of the
/// statistics, which makes the gradients those of one process on the global batch. Ranks may
/// have different batch sizes (the counts are reduced too). In validation (a backend without
/// autodiff) it uses the running statistics, with no collective.
///
/// A drop-in for Burn's `BatchNorm` (input `[batch, channels, ...]`, 1-D and 2-D alike): the
/// same fields, so the same record (a `BatchNorm` checkpoint loads into it and back), and
/// `SyncBatchNorm::from(batch_norm)` / [`SyncBatchNorm::into_batch_norm`] convert a built layer.
/// Rust fixes a model's layer types at compile time, so where PyTorch's
/// `convert_sync_batchnorm` swaps modules at run time, change the field's type
/// (`BatchNorm<B>` → `SyncBatchNorm<B>`) and its config, and add `B: SyncNormBackend` to the
/// bounds of the model's `forward`.
///
/// Every rank must run the same number of `SyncBatchNorm` forwards per step (they are
/// collectives); it is not supported inside `DdpSession::join` (as PyTorch's `Join` does not
/// support it).
#[derive(Module, Debug)]
pub struct SyncBatchNorm<B: Backend> {
    /// The learnable scale γ.
    pub gamma: Param<Tensor<B, 1>>,
    /// The learnable shift β.
    pub beta: Param<Tensor<B, 1>>,
    /// The running mean.
    pub running_mean: RunningState<Tensor<B, 1>>,
    /// The running variance (of the global batch, biased, as `BatchNorm`'s).
    pub running_var: RunningState<Tensor<B, 1>>,
    /// Momentum of the running statistics.
    pub momentum: f64,
    /// A value required for numerical stability.
    pub epsilon: f64,
}

impl<B: Backend> From<BatchNorm<B>> for SyncBatchNorm<B> {
    fn from(bn: BatchNorm<B>) -> Self {
        burn_ddp_comm::nn::made_collective_layer();
        Self {
            gamma: bn.gamma,
            beta: bn.beta,
            running_mean: bn.running_mean,
            running_var: bn.running_var,
            momentum: bn.momentum,
            epsilon: bn.epsilon,
        }
    }
}

impl<B: Backend> SyncBatchNorm<B> {
    /// The same layer as Burn's `BatchNorm` (for inference on a backend without `Ddp`).
    pub fn into_batch_norm(self) -> BatchNorm<B> {
        BatchNorm {
            gamma: self.gamma,
            beta: self.beta,
            running_mean: self.running_mean,
            running_var: self.running_var,
            momentum: self.momentum,
            epsilon: self.epsilon,
        }
    }
}

impl<B: SyncNormBackend> SyncBatchNorm<B> {
    /// Normalizes `input` (`[batch, channels, ...]`, `D >= 2`, checked at compile time): with
    /// the global batch's statistics in training, the running ones otherwise.
    pub fn forward<const D: usize>(&self, input: Tensor<B, D>) -> Tensor<B, D> {
        const {
            assert!(
                D >= 2,
                "SyncBatchNorm needs an input [batch, channels, ...]"
            )
        };
        burn_ddp_comm::nn::made_collective_layer();
        let channels = input.dims()[1];
        let mut shape = [1; D];
        shape[1] = channels;
        let (mean, var) = match B::ad_enabled(&input.device()) {
            true => self.global_statistics(input.clone()),
            false => {
                let device = input.device();
                (
                    self.running_mean.value().to_device(&device),
                    self.running_var.value().to_device(&device),
                )
            }
        };
        let std = var.add_scalar(self.epsilon).sqrt().reshape(shape);
        input
            .sub(mean.reshape(shape))
            .div(std)
            .mul(self.gamma.val().reshape(shape))
            .add(self.beta.val().reshape(shape))
    }

    /// The mean and (biased) variance of each channel over every rank's batch, and the
    /// running statistics updated with them.
    fn global_statistics<const D: usize>(
        &self,
        input: Tensor<B, D>,
    ) -> (Tensor<B, 1>, Tensor<B, 1>) {
        let dims = input.dims();
        let channels = dims[1];
        let per_channel: usize = dims
            .iter()
            .enumerate()
            .filter(|(i, _)| *i != 1)
            .map(|(_, d)| d)
            .product();
        let device = input.device();
        let x = input.swap_dims(0, 1).reshape([channels, per_channel]);

        // Sums and this rank's count, summed over the ranks.
        let count = Tensor::<B, 1>::from_floats([per_channel as f32], &device);
        let sums = Tensor::cat(vec![x.clone().sum_dim(1).reshape([channels]), count], 0);
        let sums = all_reduce_sum(sums);
        let total = sums.clone().narrow(0, channels, 1);
        let mean = sums.narrow(0, 0, channels).div(total.clone());

        // Squared deviations from the global mean, summed over the ranks.
        let deviations = x
            .sub(mean.clone().reshape([channels, 1]))
            .square()
            .sum_dim(1)
            .reshape([channels]);
        let var = all_reduce_sum(deviations).div(total);

        let running_mean = self.running_mean.value_sync().to_device(&device);
        let running_var = self.running_var.value_sync().to_device(&device);
        self.running_mean.update(
            running_mean
                .mul_scalar(1.0 - self.momentum)
                .add(mean.clone().detach().mul_scalar(self.momentum))
                .detach(),
        );
        self.running_var.update(
            running_var
                .mul_scalar(1.0 - self.momentum)
                .add(var.clone().detach().mul_scalar(self.momentum))
                .detach(),
        );
        (mean, var)
    }
}

fn all_reduce_sum<B: SyncNormBackend>(t: Tensor<B, 1>) -> Tensor<B, 1> {
    let primitive = t.into_primitive().tensor();
    Tensor::from_primitive(TensorPrimitive::Float(B::all_reduce_sum(primitive)))
}
