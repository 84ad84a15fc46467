//! The decorator's step overhead on the GPU (run by `scripts/gpu-check.sh`; `--features cuda`):
//! in one process, interleaved round by round,
//!
//! - plain `Autodiff<Cuda>` (the baseline),
//! - `Autodiff<Ddp<Cuda>>` at world size 1 with the default transport (nothing to synchronise:
//!   the decorator's own cost),
//! - `Autodiff<Ddp<Cuda>>` at world size 1 with `GradTransport::Nccl` (the zero-copy bucket path
//!   runs in full: packing, sync, NCCL all-reduce, write-back).
//!
//! ```text
//! cargo bench --features cuda --bench cuda_step -- --rounds 5
//! ```

#[path = "common/step_model.rs"]
#[allow(dead_code)] // shared with ddp_step.rs, which uses the rest
mod step_model;

use std::process::ExitCode;

use burn::backend::{Autodiff, Cuda};
use burn::module::AutodiffModule;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::Tensor;
use burn_ddp::{Ddp, DdpConfig, DdpSession, GradTransport, ProcessGroup};

use step_model::{time_steps, Trainer, Which};

type Plain = Autodiff<Cuda>;
type Decorated = Autodiff<Ddp<Cuda>>;
const WARMUP: usize = 10;

struct PlainTrainer;

impl Trainer<Plain> for PlainTrainer {
    fn prepare<M: AutodiffModule<Plain>>(&mut self, model: M) -> M {
        model
    }
    fn backward(&mut self, loss: Tensor<Plain, 1>) -> <Plain as AutodiffBackend>::Gradients {
        loss.backward()
    }
}

struct DdpTrainer(DdpSession);

impl Trainer<Decorated> for DdpTrainer {
    fn prepare<M: AutodiffModule<Decorated>>(&mut self, model: M) -> M {
        self.0.prepare(model).expect("prepare")
    }
    fn backward(
        &mut self,
        loss: Tensor<Decorated, 1>,
    ) -> <Decorated as AutodiffBackend>::Gradients {
        self.0.backward(loss).expect("synchronised backward")
    }
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn ddp_steps(transport: GradTransport, which: Which, batch: usize, steps: usize) -> Vec<f64> {
    let session = DdpSession::new(
        ProcessGroup::single(),
        DdpConfig::default().with_transport(transport),
    )
    .expect("session");
    time_steps::<Decorated>(which, batch, WARMUP, steps, &mut DdpTrainer(session))
}

fn main() -> ExitCode {
    let mut rounds = 5;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--bench" => {}
            "--rounds" => match args.next().and_then(|n| n.parse().ok()) {
                Some(n) if n > 0 => rounds = n,
                _ => {
                    eprintln!("--rounds needs a positive number");
                    return ExitCode::FAILURE;
                }
            },
            other => {
                eprintln!("unknown argument {other}: expected --rounds N");
                return ExitCode::FAILURE;
            }
        }
    }
    println!("# Autodiff<Ddp<Cuda>> vs Autodiff<Cuda>, world size 1 ({rounds} rounds, medians of per-round medians)");
    println!("| model | plain step (ms) | Ddp, nothing to sync (ms) | overhead | Ddp, NCCL bucket path (ms) | overhead |");
    println!("|---|---|---|---|---|---|");
    for (which, batch, steps) in [(Which::Mlp, 256, 200), (Which::Many, 64, 60)] {
        let (mut plain, mut auto, mut nccl) = (Vec::new(), Vec::new(), Vec::new());
        for round in 0..rounds {
            // Rotate the order so drift in the machine's speed hits every side alike.
            for k in 0..3 {
                match (round + k) % 3 {
                    0 => plain.push(median(&mut time_steps::<Plain>(
                        which,
                        batch,
                        WARMUP,
                        steps,
                        &mut PlainTrainer,
                    ))),
                    1 => auto.push(median(&mut ddp_steps(
                        GradTransport::Auto,
                        which,
                        batch,
                        steps,
                    ))),
                    _ => nccl.push(median(&mut ddp_steps(
                        GradTransport::Nccl,
                        which,
                        batch,
                        steps,
                    ))),
                }
            }
        }
        let (p, a, n) = (median(&mut plain), median(&mut auto), median(&mut nccl));
        println!(
            "| {} (batch {batch}) | {:.3} | {:.3} | {:+.2} % | {:.3} | {:+.2} % |",
            which.name(),
            p * 1e3,
            a * 1e3,
            (a / p - 1.0) * 100.0,
            n * 1e3,
            (n / p - 1.0) * 100.0
        );
    }
    ExitCode::SUCCESS
}
