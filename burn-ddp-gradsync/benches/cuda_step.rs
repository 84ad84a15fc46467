//! burn-ddp-gradsync's step time on the GPU, on the Burn release it is built for (run by `scripts/gpu-check.sh`; `--features cuda`
//! or `fusion`): in one process, interleaved round by round, an MLP trained by
//!
//! - plain Burn on the GPU (the baseline: backward, SGD step),
//! - the same with `GradSync::sync` between backward and the step, world size 1, the default
//!   transport (nothing to synchronise: the line's own cost),
//! - the same with `GradTransport::Nccl` (the device path runs in full: packing on the GPU, the
//!   issuer thread, NCCL's all-reduce on cubecl's pointers, the presence flags read back).
//!
//! Every step ends with the device synchronised, so each side is timed to completion. For Burn 0.23, `--no-default-features --features
//! burn-0-23,train,cuda`.
//!
//! ```text
//! cargo bench -p burn-ddp-gradsync --features cuda --bench cuda_step -- --rounds 5
//! ```

// This package is built for one Burn release (feature `burn-0-22` or `burn-0-23`): `burn` is
// that release. A project of yours depends on its own `burn` and has no need of these lines.
#[cfg(feature = "burn-0-22")]
extern crate burn022 as burn;
#[cfg(feature = "burn-0-23")]
extern crate burn023 as burn;

use burn_ddp as line;

/// The Burn release this build is for, in the report's title.
#[cfg(feature = "burn-0-22")]
const RELEASE: &str = "0.22.1";
/// The Burn release this build is for, in the report's title.
#[cfg(feature = "burn-0-23")]
const RELEASE: &str = "0.23.0-pre.1";

use burn_ddp_dev::args::{self, median};

use std::process::ExitCode;
use std::time::Instant;

use burn::module::Module;
use burn::nn::{Linear, LinearConfig, Relu};
use burn::optim::{GradientsParams, SgdConfig};
use burn::tensor::{Device, Distribution, Tensor};
use line::config::GradTransport;
use line::grad::DeviceCounts;
use line::{DdpConfig, GradSync, ProcessGroup};

const WARMUP: usize = 10;

#[derive(Module, Debug)]
struct Mlp {
    layers: Vec<Linear>,
    act: Relu,
}

impl Mlp {
    /// `depth` hidden layers of `width` (many parameters: several buckets at the defaults).
    fn new(device: &Device, width: usize, depth: usize) -> Self {
        let mut layers = vec![LinearConfig::new(64, width).init(device)];
        layers.extend((0..depth).map(|_| LinearConfig::new(width, width).init(device)));
        layers.push(LinearConfig::new(width, 10).init(device));
        Self {
            layers,
            act: Relu::new(),
        }
    }

    fn loss(&self, x: Tensor<2>, y: Tensor<2>) -> Tensor<1> {
        let mut h = x;
        let last = self.layers.len() - 1;
        for (i, l) in self.layers.iter().enumerate() {
            h = l.forward(h);
            if i < last {
                h = self.act.forward(h);
            }
        }
        (h - y).square().mean()
    }
}

/// How a side reaches its gradients' final values.
enum Side {
    Plain,
    Sync(GradTransport),
}

/// Seconds per step of `steps` SGD steps (after `WARMUP`), each synchronised with the device,
/// and on the NCCL path what its timed steps cost (`GradSync::device_counts`).
fn time_steps(
    side: &Side,
    device: &Device,
    (width, depth, batch): (usize, usize, usize),
    steps: usize,
) -> (Vec<f64>, Option<DeviceCounts>) {
    let mut sync = match side {
        Side::Plain => None,
        Side::Sync(t) => Some(
            GradSync::new(
                ProcessGroup::single(),
                DdpConfig {
                    transport: *t,
                    ..DdpConfig::default()
                },
            )
            .expect("GradSync"),
        ),
    };
    let model = Mlp::new(device, width, depth);
    let mut model = match sync.as_mut() {
        Some(s) => s.prepare(model).expect("prepare"),
        None => model,
    };
    if let (Some(s), Side::Sync(GradTransport::Nccl)) = (&sync, side) {
        assert!(
            s.uses_nccl(),
            "GradTransport::Nccl did not take the NCCL path"
        );
    }
    let mut optim = SgdConfig::new().init();
    let x = Tensor::<2>::random([batch, 64], Distribution::Normal(0.0, 1.0), device);
    let y = Tensor::<2>::random([batch, 10], Distribution::Normal(0.0, 1.0), device);
    let mut times = Vec::with_capacity(steps);
    let mut counted = None;
    for step in 0..WARMUP + steps {
        if step == WARMUP {
            counted = sync.as_ref().and_then(GradSync::device_counts);
        }
        let t0 = Instant::now();
        let grads =
            GradientsParams::from_grads(model.loss(x.clone(), y.clone()).backward(), &model);
        let grads = match sync.as_mut() {
            Some(s) => s.sync(&model, grads).expect("sync"),
            None => grads,
        };
        model = optim.step(0.01, model, grads);
        device.sync().expect("device sync");
        if step >= WARMUP {
            times.push(t0.elapsed().as_secs_f64());
        }
    }
    let counts = sync.as_ref().and_then(GradSync::device_counts);
    (
        times,
        counts.zip(counted).map(|(now, before)| now.since(&before)),
    )
}

fn main() -> ExitCode {
    let rounds = match args::parse(&[]) {
        Ok(a) => a.rounds,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::FAILURE;
        }
    };
    let device = match line::cuda::rank_device(&ProcessGroup::single()) {
        Ok(d) => d.autodiff(),
        Err(e) => {
            eprintln!("no GPU for this benchmark: {e}");
            return ExitCode::FAILURE;
        }
    };
    println!("# Burn {RELEASE} on {device:?}: plain vs GradSync, world size 1 ({rounds} rounds, medians of per-round medians)");
    println!("| model | plain step (ms) | GradSync, nothing to sync (ms) | overhead | GradSync, NCCL device path (ms) | overhead |");
    println!("|---|---|---|---|---|---|");
    let sides = [
        Side::Plain,
        Side::Sync(GradTransport::Auto),
        Side::Sync(GradTransport::Nccl),
    ];
    let mut notes = Vec::new();
    for (name, shape, steps) in [
        ("MLP 1024x4", (1024, 4, 256), 200),
        ("MLP 256x24", (256, 24, 64), 100),
    ] {
        let mut per_side: [Vec<f64>; 3] = Default::default();
        let mut counts = None;
        for round in 0..rounds {
            // Rotate the order so drift in the machine's speed hits every side alike.
            for k in 0..3 {
                let s = (round + k) % 3;
                let (times, c) = time_steps(&sides[s], &device, shape, steps);
                per_side[s].push(median(&times));
                counts = counts.or(c);
            }
        }
        let [p, a, n] = per_side.map(|v| median(&v));
        println!(
            "| {name} (batch {}) | {:.3} | {:.3} | {:+.2} % | {:.3} | {:+.2} % |",
            shape.2,
            p * 1e3,
            a * 1e3,
            (a / p - 1.0) * 100.0,
            n * 1e3,
            (n / p - 1.0) * 100.0
        );
        if let Some(c) = counts {
            notes.push(format!("- NCCL path, {name}, {steps} timed steps: {c}"));
        }
    }
    if !notes.is_empty() {
        println!("\nWhat the NCCL path did (GradSync::device_counts, one round):");
        notes.iter().for_each(|n| println!("{n}"));
    }
    ExitCode::SUCCESS
}
