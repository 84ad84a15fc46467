//! The example's data as Burn 0.21 datasets and batches (the images themselves:
//! `images.rs`, shared with the Burn 0.22 example).

use std::path::Path;

use burn::data::dataloader::batcher::Batcher;
use burn::data::dataset::InMemDataset;
use burn::prelude::*;

use super::images::Pace;
pub use super::images::{Item, SHAPES, SIDE};

pub struct Data {
    pub train: InMemDataset<Item>,
    pub test: InMemDataset<Item>,
    pub classes: usize,
    pub name: String,
}

pub fn generated(train: usize, test: usize, seed: u64) -> Data {
    Data {
        train: InMemDataset::new(super::images::shapes(train, seed)),
        test: InMemDataset::new(super::images::shapes(test, seed ^ 0x5EED)),
        classes: SHAPES.len(),
        name: format!("generated shapes ({})", SHAPES.join(", ")),
    }
}

/// MNIST from the four IDX files in `dir` (as distributed, after `gunzip`).
pub fn mnist(dir: &Path) -> Result<Data, String> {
    let (train, test) = super::images::mnist(dir)?;
    Ok(Data {
        train: InMemDataset::new(train),
        test: InMemDataset::new(test),
        classes: 10,
        name: format!("MNIST from {}", dir.display()),
    })
}

// ------------------------------------------------------------------ batches

#[derive(Debug, Clone)]
pub struct Batch<B: Backend> {
    /// `[n, 1, 28, 28]`.
    pub images: Tensor<B, 4>,
    /// `[n]`.
    pub targets: Tensor<B, 1, Int>,
}

/// Its batches are made at most one per the pace's period (training's: `--min-step-ms`).
#[derive(Debug, Clone, Default)]
pub struct ImageBatcher(pub Pace);

impl<B: Backend> Batcher<B, Item, Batch<B>> for ImageBatcher {
    fn batch(&self, items: Vec<Item>, device: &B::Device) -> Batch<B> {
        self.0.wait();
        let n = items.len();
        let pixels: Vec<f32> = items
            .iter()
            .flat_map(|i| i.pixels.iter().copied())
            .collect();
        let labels: Vec<i64> = items.iter().map(|i| i.label as i64).collect();
        let images =
            Tensor::<B, 1>::from_floats(pixels.as_slice(), device).reshape([n, 1, SIDE, SIDE]);
        // The usual MNIST normalisation; harmless for the shapes.
        let images = (images - 0.1307) / 0.3081;
        Batch {
            images,
            targets: Tensor::from_ints(labels.as_slice(), device),
        }
    }
}
