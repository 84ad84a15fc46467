//! The decorator's step overhead on the GPU (run by `scripts/gpu-check.sh`; `--features cuda`):
//! in one process, interleaved round by round,
//!
//! - plain `Autodiff<Cuda>` (the baseline),
//! - `Autodiff<Ddp<Cuda>>` at world size 1 with the default transport (nothing to synchronise:
//!   the decorator's own cost),
//! - `Autodiff<Ddp<Cuda>>` at world size 1 with `GradTransport::Nccl` (the zero-copy bucket path
//!   runs in full: packing, sync, NCCL all-reduce, write-back), with the default buckets, with
//!   one bucket for the whole model, and with 64 KiB buckets.
//!
//! The issuer resolves every bucket on its own (with fusion: a drain of Burn's fusion stream
//! up to that point, and a sync of cubecl's stream), so the cost per bucket is the difference
//! between the last two columns divided by the difference in bucket count; run under both Burn
//! builds (`cuda`, `fusion`), the two tables separate what fusion's drain adds.
//!
//! ```text
//! cargo bench -p burn-ddp-burn021 --features cuda --bench cuda_step -- --rounds 5
//! ```

// This package is `burn-ddp-burn021`; users reach it as `burn_ddp` (the `burn-ddp` crate with
// feature `burn-0-21`), and so does this program.
extern crate burn_ddp_burn021 as burn_ddp;

use burn_ddp_dev::args::{self, median};

use std::process::ExitCode;

use burn::backend::{Autodiff, Cuda};
use burn::module::AutodiffModule;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::Tensor;
use burn_ddp::grad::DeviceCounts;
use burn_ddp::{Ddp, DdpConfig, DdpSession, GradTransport, ProcessGroup};

use burn_ddp_step_model::{time_steps, Trainer, Which};

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

/// One side of the comparison.
#[derive(Clone, Copy)]
enum Side {
    Plain,
    /// The decorator with this transport and, for NCCL, these bucket caps (bytes; first, rest).
    Ddp(GradTransport, Option<(usize, usize)>),
}

const SIDES: [(Side, &str); 5] = [
    (Side::Plain, "plain step"),
    (Side::Ddp(GradTransport::Auto, None), "Ddp, nothing to sync"),
    (
        Side::Ddp(GradTransport::Nccl, None),
        "NCCL, default buckets",
    ),
    (
        Side::Ddp(GradTransport::Nccl, Some((usize::MAX / 2, usize::MAX / 2))),
        "NCCL, one bucket",
    ),
    (
        Side::Ddp(GradTransport::Nccl, Some((64 << 10, 64 << 10))),
        "NCCL, 64 KiB buckets",
    ),
];

/// Seconds per step of `side`, how many buckets its session had (0: none), and on the NCCL
/// path what its passes (warm-up included) cost (`DdpSession::device_counts`).
fn side_steps(
    side: Side,
    which: Which,
    batch: usize,
    steps: usize,
) -> (Vec<f64>, usize, Option<DeviceCounts>) {
    let (transport, caps) = match side {
        Side::Plain => {
            let t = time_steps::<Plain>(which, batch, WARMUP, steps, &mut PlainTrainer);
            return (t, 0, None);
        }
        Side::Ddp(t, caps) => (t, caps),
    };
    let mut config = DdpConfig::default().with_transport(transport);
    if let Some((first, rest)) = caps {
        config.first_bucket_cap_bytes = first;
        config.bucket_cap_bytes = rest;
    }
    let session = DdpSession::new(ProcessGroup::single(), config).expect("session");
    let mut trainer = DdpTrainer(session);
    let t = time_steps::<Decorated>(which, batch, WARMUP, steps, &mut trainer);
    let counts = trainer.0.device_counts();
    (t, trainer.0.buckets().len(), counts)
}

fn main() -> ExitCode {
    let rounds = match args::parse(&[]) {
        Ok(a) => a.rounds,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::FAILURE;
        }
    };
    println!(
        "# Autodiff<Ddp<Cuda>> vs Autodiff<Cuda>, world size 1 ({rounds} rounds, medians of \
         per-round medians; in brackets: the time against plain, and the number of buckets)"
    );
    let head: Vec<&str> = SIDES.iter().map(|(_, name)| *name).collect();
    println!("| model | {} (ms) |", head.join(" (ms) | "));
    println!("|---|{}", "---|".repeat(SIDES.len()));
    let mut notes = Vec::new();
    for (which, batch, steps) in [(Which::Mlp, 256, 200), (Which::Many, 64, 60)] {
        let mut times: Vec<Vec<f64>> = vec![Vec::new(); SIDES.len()];
        let mut buckets = vec![0; SIDES.len()];
        let mut counts = vec![None; SIDES.len()];
        for round in 0..rounds {
            // Rotate the order so drift in the machine's speed hits every side alike.
            for k in 0..SIDES.len() {
                let s = (round + k) % SIDES.len();
                let (t, b, c) = side_steps(SIDES[s].0, which, batch, steps);
                times[s].push(median(&t));
                buckets[s] = b;
                counts[s] = counts[s].or(c);
            }
        }
        for ((_, name), c) in SIDES.iter().zip(&counts) {
            if let Some(c) = c {
                notes.push(format!("- {}, {name}: {c}", which.name()));
            }
        }
        let medians: Vec<f64> = times.iter().map(|t| median(t)).collect();
        let cells: Vec<String> = medians
            .iter()
            .zip(&buckets)
            .enumerate()
            .map(|(i, (m, b))| match i {
                0 => format!("{:.3}", m * 1e3),
                _ if *b == 0 => {
                    format!("{:.3} ({:+.2} %)", m * 1e3, (m / medians[0] - 1.0) * 100.0)
                }
                _ => format!(
                    "{:.3} ({:+.2} %, {b} buckets)",
                    m * 1e3,
                    (m / medians[0] - 1.0) * 100.0
                ),
            })
            .collect();
        println!(
            "| {} (batch {batch}) | {} |",
            which.name(),
            cells.join(" | ")
        );
    }
    if !notes.is_empty() {
        println!(
            "\nWhat the NCCL path did (DdpSession::device_counts, one round, warm-up included):"
        );
        notes.iter().for_each(|n| println!("{n}"));
    }
    ExitCode::SUCCESS
}
