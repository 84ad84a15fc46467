//! Pipeline throughput against the ideal, in one run: an MLP of 4 layers of 1024 x 1024 on CPU,
//! split into `--stages` processes (one compute thread each), GPipe and 1F1B with 1 to 16
//! micro-batches, each step's time against the unsplit model's step on the same batch in one
//! process (measured first, in the same run).
//!
//! The measured busy fraction is `T1 / (p x Tp)`: `T1` is the unsplit model's step on the same
//! batch cut into the same `m` micro-batches with their gradients accumulated (the same work,
//! in one process, measured in the same run), divided evenly over `p` stages; `Tp` is the
//! pipeline's step. With free communication and no extra work it would be the ideal
//! `m / (m + p - 1)`. (On CPU a micro-batch's backward has a large fixed cost, full-size weight
//! gradients whatever its rows, so `T1` grows with `m`: comparing against the same
//! micro-batches keeps that out of the pipeline's score.) burn-ddp's stages recompute a micro-batch's forward at its backward
//! unless the two run back to back (see `burn_ddp::pipeline`), which costs up to one forward per
//! micro-batch: about a third of a step, so expect the ratio to the ideal to sit near 0.75 for
//! many micro-batches on stages that recompute.
//!
//! ```text
//! cargo bench --bench pipeline                  # 2 stages
//! cargo bench --bench pipeline -- --stages 4    # 4 stages (needs 4 cores to mean anything)
//! ```

// This package is `burn-ddp-burn021`; users reach it as `burn_ddp` (the `burn-ddp` crate with
// feature `burn-0-21`), and so does this program.
extern crate burn_ddp_burn021 as burn_ddp;

use std::process::ExitCode;
use std::time::Instant;

use burn::backend::{Autodiff, NdArray};
use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::optim::{GradientsAccumulator, GradientsParams};
use burn::tensor::activation::relu;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Distribution, Tensor};
use burn_ddp::pipeline::{ideal_busy_fraction, Pipeline, Schedule, StageInput};
use burn_ddp::{Ddp, ProcessGroup, ReduceOp};

type B = Autodiff<Ddp<NdArray>>;

const WIDTH: usize = 1024;
const LAYERS: usize = 4;
const ROWS: usize = 64;
const STEPS: usize = 6;

#[derive(Module, Debug)]
struct Mlp<B: Backend> {
    layers: Vec<Linear<B>>,
}

impl<B: Backend> Mlp<B> {
    fn new(n: usize, device: &B::Device) -> Self {
        Self {
            layers: (0..n)
                .map(|_| LinearConfig::new(WIDTH, WIDTH).init(device))
                .collect(),
        }
    }

    fn forward(&self, mut x: Tensor<B, 2>) -> Tensor<B, 2> {
        for l in &self.layers {
            x = relu(l.forward(x));
        }
        x
    }
}

fn loss<B: Backend>(y: Tensor<B, 2>) -> Tensor<B, 1> {
    y.powi_scalar(2).mean()
}

/// Median seconds per step of `step`, after one warm-up step.
fn median_step(mut step: impl FnMut()) -> f64 {
    step();
    let t: Vec<f64> = (0..STEPS)
        .map(|_| {
            let s = Instant::now();
            step();
            s.elapsed().as_secs_f64()
        })
        .collect();
    burn_ddp_dev::args::median(&t)
}

/// The unsplit model's step on the whole batch cut into `m` micro-batches whose gradients are
/// accumulated: the same work as the pipeline's, in one process.
fn unsplit_step<A: AutodiffBackend>(model: &Mlp<A>, m: usize, device: &A::Device) {
    let mut acc = GradientsAccumulator::<Mlp<A>>::new();
    let x = Tensor::<A, 2>::random([ROWS, WIDTH], Distribution::Default, device);
    for r in burn_ddp_comm::pipeline::micro_batches(ROWS, m).unwrap_or_default() {
        let g = loss(model.forward(x.clone().narrow(0, r.start, r.len()))).backward();
        acc.accumulate(model, GradientsParams::from_grads(g, model));
    }
    let _ = acc.grads();
}

fn run(pg: ProcessGroup) -> burn_ddp::Result<()> {
    let p = pg.world_size().as_usize();
    let device = Default::default();
    let full = Mlp::<B>::new(LAYERS, &device);
    if pg.is_main() {
        println!(
            "pipeline bench: {LAYERS} layers of {WIDTH} x {WIDTH}, batch {ROWS}, {p} stages (one \
             process and one thread each); baseline: the unsplit model on rank 0 alone, the \
             same micro-batches accumulated"
        );
        println!(
            "{:>9} {:>6} {:>14} {:>12} {:>14} {:>8} {:>10}",
            "schedule", "micro", "unsplit (ms)", "step (ms)", "busy fraction", "ideal", "of ideal"
        );
    }
    let stage = Mlp::<B>::new(LAYERS / p, &device);
    for m in [1, 2, 4, 8, 16] {
        // The baseline for this number of micro-batches, on rank 0 while the others wait.
        let mut t1 = [0.0f64];
        if pg.is_main() {
            t1[0] = median_step(|| unsplit_step(&full, m, &device));
        }
        pg.broadcast(&mut t1, burn_ddp::Rank(0))?;
        for schedule in [Schedule::GPipe, Schedule::OneFOneB] {
            let pipeline = Pipeline::new(pg.clone(), schedule, m)?;
            let mut failed = None;
            pg.barrier()?;
            let tp = median_step(|| {
                let input = if pipeline.is_first() {
                    StageInput::Batch(Tensor::random(
                        [ROWS, WIDTH],
                        Distribution::Default,
                        &device,
                    ))
                } else {
                    StageInput::Rows(ROWS)
                };
                if let Err(e) = pipeline.step(&stage, input, |m, x| m.forward(x), |y, _| loss(y)) {
                    failed.get_or_insert(e);
                }
            });
            if let Some(e) = failed {
                return Err(e);
            }
            let mut worst = [tp];
            pg.all_reduce(&mut worst, ReduceOp::Max)?;
            let busy = t1[0] / (p as f64 * worst[0]);
            let ideal = ideal_busy_fraction(p, m);
            if pg.is_main() {
                println!(
                    "{:>9} {:>6} {:>14.1} {:>12.1} {:>14.3} {:>8.3} {:>10.2}",
                    schedule.name(),
                    m,
                    t1[0] * 1e3,
                    worst[0] * 1e3,
                    busy,
                    ideal,
                    busy / ideal
                );
            }
        }
    }
    Ok(())
}

fn main() -> ExitCode {
    // One compute thread per process, so that stages do not share cores.
    std::env::set_var("RAYON_NUM_THREADS", "1");
    std::env::set_var("OMP_NUM_THREADS", "1");
    let args: Vec<String> = std::env::args().collect();
    let stages = args
        .iter()
        .position(|a| a == "--stages")
        .and_then(|i| args.get(i + 1)?.parse().ok())
        .unwrap_or(2u32);
    if !(1..=LAYERS as u32).contains(&stages) || !(LAYERS as u32).is_multiple_of(stages) {
        eprintln!("--stages must divide {LAYERS}");
        return ExitCode::FAILURE;
    }
    match burn_ddp::spawn(stages, run) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("pipeline bench: {e}");
            ExitCode::FAILURE
        }
    }
}
