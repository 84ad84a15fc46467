//! A small convolutional classifier for 28×28 grey images (Burn 0.22 and 0.23 modules), with a BatchNorm
//! (whose running statistics every rank keeps equal), the steps burn-train's Learner calls, and
//! its data batches.

use burn::data::dataloader::batcher::Batcher;
use burn::nn::conv::{Conv2d, Conv2dConfig};
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::pool::{MaxPool2d, MaxPool2dConfig};
use burn::nn::{BatchNorm, BatchNormConfig, Linear, LinearConfig, Relu};
use burn::prelude::*;
use burn::train::{ClassificationOutput, InferenceStep, TrainOutput, TrainStep};

use super::images::{Item, Pace, SIDE};

#[derive(Module, Debug)]
pub struct Cnn {
    conv1: Conv2d,
    /// Running statistics that each rank updates from its own batches: burn-ddp sends rank 0's
    /// to every rank before each step (PyTorch's `broadcast_buffers`).
    norm1: BatchNorm,
    conv2: Conv2d,
    pool: MaxPool2d,
    fc1: Linear,
    fc2: Linear,
    act: Relu,
}

impl Cnn {
    pub fn new(classes: usize, device: &Device) -> Self {
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
    pub fn forward(&self, x: Tensor<4>) -> Tensor<2> {
        let x = self.conv1.forward(x);
        let x = self.pool.forward(self.act.forward(self.norm1.forward(x))); // [n, 8, 13, 13]
        let x = self.pool.forward(self.act.forward(self.conv2.forward(x))); // [n, 16, 5, 5]
        let x = x.flatten(1, 3);
        self.fc2.forward(self.act.forward(self.fc1.forward(x)))
    }

    pub fn classify(&self, batch: Batch) -> ClassificationOutput {
        let output = self.forward(batch.images);
        let loss = CrossEntropyLossConfig::new()
            .init(&output.device())
            .forward(output.clone(), batch.targets.clone());
        ClassificationOutput::new(loss, output, batch.targets)
    }
}

impl TrainStep for Cnn {
    type Input = Batch;
    type Output = ClassificationOutput;

    fn step(&self, batch: Batch) -> TrainOutput<ClassificationOutput> {
        let item = self.classify(batch);
        // burn-ddp's strategy reduces these gradients across the ranks after backward.
        TrainOutput::new(self, item.loss.backward(), item)
    }
}

impl InferenceStep for Cnn {
    type Input = Batch;
    type Output = ClassificationOutput;

    fn step(&self, batch: Batch) -> ClassificationOutput {
        self.classify(batch)
    }
}

#[derive(Debug, Clone)]
pub struct Batch {
    /// `[n, 1, 28, 28]`.
    pub images: Tensor<4>,
    /// `[n]`.
    pub targets: Tensor<1, Int>,
}

/// Its batches are made at most one per the pace's period (training's: `--min-step-ms`).
#[derive(Debug, Clone, Default)]
pub struct ImageBatcher(pub Pace);

impl Batcher<Item, Batch> for ImageBatcher {
    fn batch(&self, items: Vec<Item>, device: &Device) -> Batch {
        self.0.wait();
        let n = items.len();
        let pixels: Vec<f32> = items
            .iter()
            .flat_map(|i| i.pixels.iter().copied())
            .collect();
        let labels: Vec<i64> = items.iter().map(|i| i.label as i64).collect();
        let images =
            Tensor::<1>::from_floats(pixels.as_slice(), device).reshape([n, 1, SIDE, SIDE]);
        // The usual MNIST normalisation; harmless for the shapes.
        let images = (images - 0.1307) / 0.3081;
        Batch {
            images,
            targets: Tensor::from_ints(labels.as_slice(), device),
        }
    }
}
