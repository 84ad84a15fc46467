//! The models and the timed training loop shared by `benches/ddp_step` (which runs them on
//! `Autodiff<Ddp<NdArray>>`) and `benches/plain-autodiff` (which runs them on plain
//! `Autodiff<NdArray>`, in a build without Burn's `distributed` feature). One source, so the two
//! sides of every ratio execute the same model code.

use std::time::Instant;

use burn::module::{AutodiffModule, Module};
use burn::nn::{Linear, LinearConfig, Relu};
use burn::optim::{GradientsParams, Optimizer, SgdConfig};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Distribution, Tensor};

/// Which model a benchmark trains.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Which {
    /// 784 → 512 → 256 → 10 MLP (535 k parameters, 6 tensors): compute-bound.
    Mlp,
    /// 200 bias-free 32×32 layers: 200 gradients of 4 KiB each, little compute.
    Many,
}

impl Which {
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "mlp" => Some(Self::Mlp),
            "many" => Some(Self::Many),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Mlp => "mlp",
            Self::Many => "many",
        }
    }
}

/// Width of each layer of [`Which::Many`]: 32×32 f32 = 4 KiB.
pub const MANY_WIDTH: usize = 32;
/// Layers of [`Which::Many`].
pub const MANY_LAYERS: usize = 200;

#[derive(Module, Debug)]
pub struct Mlp<B: Backend> {
    fc1: Linear<B>,
    fc2: Linear<B>,
    fc3: Linear<B>,
    act: Relu,
}

#[derive(Module, Debug)]
pub struct Many<B: Backend> {
    layers: Vec<Linear<B>>,
}

/// A model that can compute a loss on a batch.
pub trait StepModel<B: AutodiffBackend>: AutodiffModule<B> + Sized {
    /// Input and target widths.
    const IN: usize;
    const OUT: usize;
    fn build(device: &B::Device) -> Self;
    fn loss(&self, x: Tensor<B, 2>, y: Tensor<B, 2>) -> Tensor<B, 1>;
}

impl<B: AutodiffBackend> StepModel<B> for Mlp<B> {
    const IN: usize = 784;
    const OUT: usize = 10;
    fn build(device: &B::Device) -> Self {
        Self {
            fc1: LinearConfig::new(784, 512).init(device),
            fc2: LinearConfig::new(512, 256).init(device),
            fc3: LinearConfig::new(256, 10).init(device),
            act: Relu::new(),
        }
    }

    fn loss(&self, x: Tensor<B, 2>, y: Tensor<B, 2>) -> Tensor<B, 1> {
        let h = self.act.forward(self.fc1.forward(x));
        let h = self.act.forward(self.fc2.forward(h));
        (self.fc3.forward(h) - y).powi_scalar(2).mean()
    }
}

impl<B: AutodiffBackend> StepModel<B> for Many<B> {
    const IN: usize = MANY_WIDTH;
    const OUT: usize = MANY_WIDTH;
    fn build(device: &B::Device) -> Self {
        let layers = (0..MANY_LAYERS)
            .map(|_| {
                LinearConfig::new(MANY_WIDTH, MANY_WIDTH)
                    .with_bias(false)
                    .init(device)
            })
            .collect();
        Self { layers }
    }

    fn loss(&self, x: Tensor<B, 2>, y: Tensor<B, 2>) -> Tensor<B, 1> {
        // tanh keeps activations bounded through 200 layers.
        let h = self.layers.iter().fold(x, |h, l| l.forward(h).tanh());
        (h - y).powi_scalar(2).mean()
    }
}

/// How one side of a comparison trains: what it does to a fresh model, and how it computes
/// gradients.
pub trait Trainer<B: AutodiffBackend> {
    /// Runs once on the fresh model (DDP wraps it here).
    fn prepare<M: AutodiffModule<B>>(&mut self, model: M) -> M;
    /// The gradients of `loss`.
    fn backward(&mut self, loss: Tensor<B, 1>) -> B::Gradients;
}

/// Trains model `which` for `warmup + steps` SGD steps on a fixed synthetic batch of `batch`
/// rows and returns the wall time of each timed step, in seconds.
pub fn time_steps<B: AutodiffBackend>(
    which: Which,
    batch: usize,
    warmup: usize,
    steps: usize,
    trainer: &mut impl Trainer<B>,
) -> Vec<f64> {
    match which {
        Which::Mlp => time_model::<B, Mlp<B>>(batch, warmup, steps, trainer),
        Which::Many => time_model::<B, Many<B>>(batch, warmup, steps, trainer),
    }
}

fn time_model<B: AutodiffBackend, M: StepModel<B>>(
    batch: usize,
    warmup: usize,
    steps: usize,
    trainer: &mut impl Trainer<B>,
) -> Vec<f64> {
    let device = B::Device::default();
    B::seed(&device, 7);
    let mut model = trainer.prepare(M::build(&device));
    let x = Tensor::<B, 2>::random([batch, M::IN], Distribution::Normal(0.0, 1.0), &device);
    let y = Tensor::<B, 2>::random([batch, M::OUT], Distribution::Normal(0.0, 1.0), &device);
    let mut optim = SgdConfig::new().init::<B, M>();
    let mut times = Vec::with_capacity(steps);
    for i in 0..warmup + steps {
        let start = Instant::now();
        let loss = model.loss(x.clone(), y.clone());
        let grads = trainer.backward(loss);
        let grads = GradientsParams::from_grads(grads, &model);
        model = optim.step(1e-3, model, grads);
        B::sync(&device).expect("device sync");
        if i >= warmup {
            times.push(start.elapsed().as_secs_f64());
        }
    }
    times
}

/// The line a worker prints with its step times; the driver parses it.
pub const RESULT_TAG: &str = "BURN_DDP_BENCH_STEPS";

pub fn print_result(label: &str, times: &[f64]) {
    let list: Vec<String> = times.iter().map(|t| format!("{t:.9}")).collect();
    println!("{RESULT_TAG} {label} {}", list.join(","));
}
