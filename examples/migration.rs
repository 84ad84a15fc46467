//! An existing single-device Burn training script, turned into a DDP one. Every line that
//! changed carries a `// DDP:` comment; `docs/guide.md` shows the same change as a diff.
//!
//! ```text
//! cargo run --release --example migration            # 2 ranks on this machine
//! ```
//!
//! The task: fit y = 3·x₀ − 2·x₁ + 1 with a small MLP, from a dataset of 4,096 points.

// The Burn 0.21 line is the package `burn-ddp-burn021` here; a program of yours reaches it as
// `burn_ddp` (the `burn-ddp` crate with feature `burn-0-21`), and so does this one.
extern crate burn_ddp_burn021 as burn_ddp;

use burn::backend::{Autodiff, NdArray};
use burn::data::dataloader::batcher::Batcher;
use burn::data::dataloader::DataLoaderBuilder;
use burn::data::dataset::InMemDataset;
use burn::nn::{Linear, LinearConfig, Relu};
use burn::optim::{AdamConfig, Optimizer};
use burn::prelude::*;
use std::sync::Arc; // DDP: the sampler is shared with the data loader

type B = Autodiff<Ddp<NdArray>>; // DDP: was Autodiff<NdArray>

use burn_ddp::{ddp, Ddp, DdpConfig, DdpSession, DistributedSampler, ProcessGroup, ReduceOp}; // DDP

#[ddp] // DDP: registers the model's fields (and #[ddp(skip)] ones) with burn-ddp
#[derive(Module, Debug)]
struct Mlp<B: Backend> {
    fc1: Linear<B>,
    fc2: Linear<B>,
    act: Relu,
}

impl<B: Backend> Mlp<B> {
    fn new(device: &B::Device) -> Self {
        Self {
            fc1: LinearConfig::new(2, 32).init(device),
            fc2: LinearConfig::new(32, 1).init(device),
            act: Relu::new(),
        }
    }
    fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        self.fc2.forward(self.act.forward(self.fc1.forward(x)))
    }
}

#[derive(Debug, Clone)]
struct Point {
    x: [f32; 2],
    y: f32,
}

#[derive(Debug, Clone)]
struct Pairs<B: Backend> {
    x: Tensor<B, 2>,
    y: Tensor<B, 2>,
}

#[derive(Clone, Default)]
struct PointBatcher;

impl<B: Backend> Batcher<B, Point, Pairs<B>> for PointBatcher {
    fn batch(&self, items: Vec<Point>, device: &B::Device) -> Pairs<B> {
        let n = items.len();
        let x: Vec<f32> = items.iter().flat_map(|p| p.x).collect();
        let y: Vec<f32> = items.iter().map(|p| p.y).collect();
        Pairs {
            x: Tensor::<B, 1>::from_floats(x.as_slice(), device).reshape([n, 2]),
            y: Tensor::<B, 1>::from_floats(y.as_slice(), device).reshape([n, 1]),
        }
    }
}

fn dataset() -> InMemDataset<Point> {
    let points = (0..4096)
        .map(|i| {
            let a = ((i * 37) % 101) as f32 / 50.0 - 1.0;
            let b = ((i * 59) % 103) as f32 / 51.0 - 1.0;
            Point {
                x: [a, b],
                y: 3.0 * a - 2.0 * b + 1.0,
            }
        })
        .collect();
    InMemDataset::new(points)
}

fn train(pg: ProcessGroup) -> burn_ddp::Result<()> {
    // DDP: was fn train()
    let device = Default::default();
    let session = DdpSession::new(pg.clone(), DdpConfig::default())?; // DDP
    let mut model = session.prepare_module(Mlp::<B>::new(&device))?; // DDP: was Mlp::new(&device)
    let mut optim = AdamConfig::new().init();
    let data = Arc::new(DistributedSampler::new(dataset(), &pg).with_seed(7)); // DDP: was dataset()
    let loader = DataLoaderBuilder::new(PointBatcher)
        .batch_size(64) // per rank now: the global batch is 64 × world size
        .build(Arc::clone(&data)); // DDP: was .build(dataset())
    for epoch in 1..=5 {
        data.set_epoch(epoch); // DDP: a new shuffle each epoch, the same on every rank
        let (mut sum, mut n) = (0.0, 0.0);
        for batch in loader.iter() {
            let loss = (model.forward(batch.x) - batch.y).powi_scalar(2).mean();
            sum += f64::from(loss.clone().into_scalar());
            n += 1.0;
            // DDP: was loss.backward() and GradientsParams::from_grads(grads, &model)
            let grads = session.gradients(&model, loss)?;
            model = optim.step(1e-2, model, grads);
        }
        let mut mean = [sum, n];
        pg.all_reduce(&mut mean, ReduceOp::Sum)?; // DDP: the loss over all ranks
        if pg.is_main() {
            // DDP: only rank 0 prints
            println!("epoch {epoch}: mse {:.5}", mean[0] / mean[1]);
        }
    }
    Ok(())
}

fn main() -> std::process::ExitCode {
    // DDP: was train(); 2 ranks here, or whatever burn-ddp run / torchrun / srun started
    match burn_ddp::spawn(2, train) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{e}");
            std::process::ExitCode::FAILURE
        }
    }
}
