//! Pipeline throughput against the ideal, in one run: an MLP of 4 layers of 1024 x 1024 on CPU,
//! split into `--stages` processes (one compute thread each), GPipe and 1F1B with 1 to 16
//! micro-batches, each step's time against the unsplit model's step on the same batch in one
//! process (measured first, in the same run).
//!
//! The measured busy fraction is `T1 / (p x Tp)` (the unsplit step divided evenly over `p`
//! stages, over the pipeline's step): with free communication and no extra work it would be the
//! ideal `m / (m + p - 1)`. burn-ddp's stages recompute a micro-batch's forward at its backward
//! unless the two run back to back (see `burn_ddp::pipeline`), which costs up to one forward per
//! micro-batch: about a third of a step, so expect the ratio to the ideal to sit near 0.75 for
//! many micro-batches on stages that recompute.
//!
//! ```text
//! cargo bench --bench pipeline                  # 2 stages
//! cargo bench --bench pipeline -- --stages 4    # 4 stages (needs 4 cores to mean anything)
//! ```

use std::process::ExitCode;
use std::time::Instant;

use burn::backend::{Autodiff, NdArray};
use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::optim::GradientsParams;
use burn::tensor::activation::relu;
use burn::tensor::backend::Backend;
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
    let mut t: Vec<f64> = (0..STEPS)
        .map(|_| {
            let s = Instant::now();
            step();
            s.elapsed().as_secs_f64()
        })
        .collect();
    t.sort_by(f64::total_cmp);
    t[t.len() / 2]
}

fn run(pg: ProcessGroup) -> burn_ddp::Result<()> {
    let p = pg.world_size().as_usize();
    let device = Default::default();
    // The baseline: the unsplit model on the whole batch, on rank 0 alone.
    let mut t1 = [0.0f64];
    if pg.is_main() {
        let model = Mlp::<B>::new(LAYERS, &device);
        t1[0] = median_step(|| {
            let x = Tensor::<B, 2>::random([ROWS, WIDTH], Distribution::Default, &device);
            let g = loss(model.forward(x)).backward();
            let _ = GradientsParams::from_grads(g, &model);
        });
    }
    pg.broadcast(&mut t1, burn_ddp::Rank(0))?;
    if pg.is_main() {
        println!(
            "pipeline bench: {LAYERS} layers of {WIDTH} x {WIDTH}, batch {ROWS}, {p} stages (one \
             process and one thread each); unsplit step {:.1} ms",
            t1[0] * 1e3
        );
        println!(
            "{:>9} {:>6} {:>12} {:>14} {:>8} {:>10}",
            "schedule", "micro", "step (ms)", "busy fraction", "ideal", "of ideal"
        );
    }
    let stage = Mlp::<B>::new(LAYERS / p, &device);
    for schedule in [Schedule::GPipe, Schedule::OneFOneB] {
        for m in [1, 2, 4, 8, 16] {
            let pipeline = Pipeline::new(pg.clone(), schedule, m)?;
            let mut failed = None;
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
                    "{:>9} {:>6} {:>12.1} {:>14.3} {:>8.3} {:>10.2}",
                    schedule.name(),
                    m,
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
