//! The pipeline example on Burn 0.22.1 or 0.23: each stage's replicas average its gradients after
//! the stage's last backward of the step through a `GradSync` on their sub-group
//! (`Pipeline::step_synced`), on Burn's Flex CPU backend.

// The classifier's generated images (its MNIST loader and run settings are not used here).
#[allow(dead_code)]
use burn_ddp_comm::ConfigError;
use burn_ddp_dev::images;

use std::ops::Range;
use std::process::ExitCode;
use std::sync::Mutex;
use std::time::Instant;

use burn::module::Module;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{Linear, LinearConfig};
use burn::optim::AdamConfig;
use burn::prelude::*;
use burn::tensor::activation::relu;
use burn_ddp::pipeline::{ideal_busy_fraction, HybridLayout, Pipeline, Schedule, StageInput};
use burn_ddp::{DdpConfig, GradSync, ProcessGroup, ReduceOp};
use burn_ddp_comm::data::ShardPlan;
use clap::Parser;

/// The widths of the whole model's layers: 784 pixels in, 4 classes out.
const WIDTHS: [usize; 5] = [images::SIDE * images::SIDE, 256, 128, 64, 4];

#[derive(Debug, Parser)]
#[command(about = "Pipeline x data-parallel image classifier on CPU (burn-ddp example)")]
struct Args {
    /// Ranks to start when not already launched by `burn-ddp run`, torchrun or srun.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..))]
    nproc: u32,
    /// Pipeline stages (1, 2 or 4: the model has 4 layers); the world size must be a multiple.
    #[arg(long, default_value_t = 2)]
    stages: usize,
    /// `1f1b` or `gpipe`.
    #[arg(long, default_value = "1f1b")]
    schedule: Schedule,
    /// Micro-batches per step.
    #[arg(long, default_value_t = 4, value_parser = images::at_least_one)]
    micro_batches: usize,
    #[arg(long, default_value_t = 10, value_parser = images::at_least_one)]
    epochs: usize,
    /// Images per replica per step.
    #[arg(long, default_value_t = 64, value_parser = images::at_least_one)]
    batch_size: usize,
    #[arg(long, default_value_t = 1e-3, value_parser = images::positive)]
    lr: f64,
    /// Generated training images.
    #[arg(long, default_value_t = 4000, value_parser = images::at_least_one)]
    train_size: usize,
    #[arg(long, default_value_t = 42)]
    seed: u64,
}

/// Some consecutive layers of the model, with a ReLU after each but the model's last.
#[derive(Module, Debug)]
struct Stage {
    layers: Vec<Linear>,
}

impl Stage {
    fn forward(&self, mut x: Tensor<2>, ends_model: bool) -> Tensor<2> {
        let n = self.layers.len();
        for (i, l) in self.layers.iter().enumerate() {
            x = l.forward(x);
            if !(ends_model && i + 1 == n) {
                x = relu(x);
            }
        }
        x
    }
}

fn train(args: &Args, world: ProcessGroup) -> burn_ddp::Result<()> {
    let layers = WIDTHS.len() - 1;
    if args.stages == 0 || !layers.is_multiple_of(args.stages) {
        return Err(burn_ddp::DdpError::Config(ConfigError::InvalidOption {
            option: "--stages",
            reason: format!(
                "{} does not divide the model's {layers} layers",
                args.stages
            ),
        }));
    }
    let layout = HybridLayout::new(&world, args.stages)?;
    let per = layers / args.stages;
    let mine = layout.stage * per..(layout.stage + 1) * per;
    let device = Device::default().autodiff();
    device.seed(args.seed);
    // Every rank draws the whole model's initial weights and keeps its stage's layers; the
    // replica group's sync checks them and gives every replica rank 0's.
    let stage = Stage {
        layers: WIDTHS
            .windows(2)
            .map(|w| LinearConfig::new(w[0], w[1]).init(&device))
            .collect::<Vec<_>>()[mine.clone()]
        .to_vec(),
    };
    let mut sync = GradSync::new(layout.replicas.clone(), DdpConfig::default())?;
    let mut stage = sync.prepare(stage)?;
    let pipeline = Pipeline::new(layout.pipeline.clone(), args.schedule, args.micro_batches)?;
    let ends_model = pipeline.is_last();
    let mut optim = AdamConfig::new().init();

    let data = images::shapes(args.train_size, args.seed);
    // Sharded over the replicas: the stages of one pipeline see the same items.
    let plan = ShardPlan::new(&layout.replicas).with_seed(args.seed);
    let report = layout.replica == 0 && ends_model;
    if world.is_main() {
        println!(
            "pipeline: {} ranks = {} stages x {} replicas, {} with {} micro-batches (ideal busy \
             fraction {:.2})",
            world.world_size(),
            args.stages,
            layout.replica_count(),
            args.schedule.name(),
            args.micro_batches,
            ideal_busy_fraction(args.stages, args.micro_batches)
        );
    }
    let started = Instant::now();
    for epoch in 0..args.epochs {
        plan.set_epoch(epoch as u64);
        let order = plan.indices(data.len());
        let batches: Vec<&[usize]> = order
            .chunks(args.batch_size)
            .filter(|c| c.len() >= args.micro_batches)
            .collect();
        // (loss sum, correct, seen) on the last stage.
        let stats = Mutex::new((0.0f64, 0.0f64, 0.0f64));
        for ids in &batches {
            let pixels: Vec<f32> = ids
                .iter()
                .flat_map(|&i| data[i].pixels.iter().copied())
                .collect();
            let labels: Vec<i64> = ids.iter().map(|&i| data[i].label as i64).collect();
            let input = if pipeline.is_first() {
                StageInput::Batch(
                    Tensor::<1>::from_floats(pixels.as_slice(), &device)
                        .reshape([ids.len(), WIDTHS[0]]),
                )
            } else {
                StageInput::Rows(ids.len())
            };
            let targets = Tensor::<1, Int>::from_ints(labels.as_slice(), &device);
            let out = pipeline.step_synced(
                &mut sync,
                &stage,
                &device,
                input,
                |m: &Stage, x| m.forward(x, ends_model),
                |logits: Tensor<2>, rows: Range<usize>| {
                    let t = targets.clone().narrow(0, rows.start, rows.len());
                    let correct = logits
                        .clone()
                        .argmax(1)
                        .squeeze_dim::<1>(1)
                        .equal(t.clone())
                        .int()
                        .sum()
                        .into_scalar::<i64>() as f64;
                    let mut s = stats.lock().unwrap_or_else(|p| p.into_inner());
                    s.1 += correct;
                    s.2 += rows.len() as f64;
                    CrossEntropyLossConfig::new()
                        .init(&logits.device())
                        .forward(logits, t)
                },
            )?;
            if let Some(loss) = out.loss {
                stats.lock().unwrap_or_else(|p| p.into_inner()).0 += loss;
            }
            stage = optim.step(args.lr, stage, out.grads);
        }
        // The last stages' numbers, averaged over the replicas (every rank takes part).
        let (loss, correct, seen) = stats.into_inner().unwrap_or_else(|p| p.into_inner());
        let mut totals = [loss, correct, seen];
        world.all_reduce(&mut totals, ReduceOp::Sum)?;
        if report {
            let replicas = layout.replica_count() as f64;
            println!(
                "epoch {}/{}: loss {:.4}, train accuracy {:.2} %, {:.1} s",
                epoch + 1,
                args.epochs,
                totals[0] / (batches.len() as f64 * replicas),
                100.0 * totals[1] / totals[2].max(1.0),
                started.elapsed().as_secs_f64()
            );
        }
    }
    Ok(())
}

pub fn main() -> ExitCode {
    let args = Args::parse();
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .with_target(false)
        .try_init();
    match burn_ddp::spawn(args.nproc, |pg| train(&args, pg)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("pipeline: {e}");
            ExitCode::FAILURE
        }
    }
}
