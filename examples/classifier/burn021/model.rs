//! A small convolutional classifier for 28×28 grey images, with a BatchNorm (whose running
//! statistics every rank keeps equal), and the steps burn-train's Learner calls.

use burn::nn::conv::{Conv2d, Conv2dConfig};
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::pool::{MaxPool2d, MaxPool2dConfig};
use burn::nn::{BatchNorm, BatchNormConfig, Linear, LinearConfig, Relu};
use burn::prelude::*;
use burn::tensor::backend::AutodiffBackend;
use burn::train::{ClassificationOutput, InferenceStep, TrainOutput, TrainStep};
use burn_ddp::ddp;

use super::data::Batch;

/// `#[ddp]`: the parameters burn-ddp synchronises, in a stable order (all of them here).
#[ddp]
#[derive(Module, Debug)]
pub struct Cnn<B: Backend> {
    conv1: Conv2d<B>,
    /// Running statistics that each rank updates from its own batches: burn-ddp sends rank 0's
    /// to every rank before each step (PyTorch's `broadcast_buffers`).
    norm1: BatchNorm<B>,
    conv2: Conv2d<B>,
    pool: MaxPool2d,
    fc1: Linear<B>,
    fc2: Linear<B>,
    act: Relu,
}

impl<B: Backend> Cnn<B> {
    pub fn new(classes: usize, device: &B::Device) -> Self {
        Self {
            conv1: Conv2dConfig::new([1, 8], [3, 3]).init(device),
            norm1: BatchNormConfig::new(8).init(device),
            conv2: Conv2dConfig::new([8, 16], [3, 3]).init(device),
            pool: MaxPool2dConfig::new([2, 2]).with_strides([2, 2]).init(),
            fc1: LinearConfig::new(16 * 5 * 5, 64).init(device),
            fc2: LinearConfig::new(64, classes).init(device),
            act: Relu::new(),
        }
    }

    /// `[n, 1, 28, 28]` → logits `[n, classes]`.
    pub fn forward(&self, x: Tensor<B, 4>) -> Tensor<B, 2> {
        let x = self.conv1.forward(x);
        let x = self.pool.forward(self.act.forward(self.norm1.forward(x))); // [n, 8, 13, 13]
        let x = self.pool.forward(self.act.forward(self.conv2.forward(x))); // [n, 16, 5, 5]
        let x = x.flatten(1, 3);
        self.fc2.forward(self.act.forward(self.fc1.forward(x)))
    }

    pub fn classify(&self, batch: Batch<B>) -> ClassificationOutput<B> {
        let output = self.forward(batch.images);
        let loss = CrossEntropyLossConfig::new()
            .init(&output.device())
            .forward(output.clone(), batch.targets.clone());
        ClassificationOutput::new(loss, output, batch.targets)
    }
}

impl<B: AutodiffBackend> TrainStep for Cnn<B> {
    type Input = Batch<B>;
    type Output = ClassificationOutput<B>;

    fn step(&self, batch: Batch<B>) -> TrainOutput<ClassificationOutput<B>> {
        let item = self.classify(batch);
        // With `Autodiff<Ddp<_>>`, this backward all-reduces the gradients as they are made.
        TrainOutput::new(self, item.loss.backward(), item)
    }
}

impl<B: Backend> InferenceStep for Cnn<B> {
    type Input = Batch<B>;
    type Output = ClassificationOutput<B>;

    fn step(&self, batch: Batch<B>) -> ClassificationOutput<B> {
        self.classify(batch)
    }
}
