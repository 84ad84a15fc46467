//! Soak: 10,000 small all-reduces and 1,000 DDP training steps on 2 real processes; resident
//! memory after the run may exceed what it was after warm-up by less than 5 %. Catches buffers,
//! threads or per-step bookkeeping that accumulate.

use crate::common;

use burn::backend::{Autodiff, NdArray};
use burn::module::Module;
use burn::nn::{Linear, LinearConfig, Relu};
use burn::optim::{GradientsParams, Optimizer, SgdConfig};
use burn::tensor::backend::Backend;
use burn::tensor::{Distribution, Tensor};
use burn_ddp::{Ddp, DdpConfig, DdpSession, ReduceOp};

type B = Autodiff<Ddp<NdArray>>;

/// Resident set size of this process, in bytes (Linux).
fn rss() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS in /proc/self/status");
    kib * 1024
}

#[derive(Module, Debug)]
struct Mlp<B: Backend> {
    fc1: Linear<B>,
    fc2: Linear<B>,
    act: Relu,
}

fn growth(label: &str, base: u64, end: u64, rank: usize) -> f64 {
    let g = (end as f64 - base as f64) / base as f64;
    println!(
        "rank {rank} {label}: rss {:.1} MiB -> {:.1} MiB ({:+.2} %)",
        base as f64 / 1048576.0,
        end as f64 / 1048576.0,
        g * 100.0
    );
    g
}

#[test]
fn memory_stays_flat_over_10k_all_reduces_and_1k_steps() {
    const NAME: &str = "memory_stays_flat_over_10k_all_reduces_and_1k_steps";
    if let Some(pg) = common::child_group(NAME) {
        let rank = pg.rank().index();
        // 10,000 all-reduces of 256 f32 (1 KiB); the first 1,000 are warm-up.
        let mut buf = vec![1.0f32; 256];
        let mut base = 0;
        for i in 0..10_000 {
            if i == 1_000 {
                base = rss();
            }
            buf.fill(rank as f32 + 1.0);
            pg.all_reduce(&mut buf, ReduceOp::Sum).unwrap();
            assert_eq!(buf[0], 3.0);
        }
        let collectives = growth("10k all-reduces", base, rss(), rank);

        // 1,000 DDP steps (overlapped path); the first 100 are warm-up.
        let device = Default::default();
        let session = DdpSession::new(pg.clone(), DdpConfig::default()).unwrap();
        let mut model = session
            .prepare(Mlp::<B> {
                fc1: LinearConfig::new(16, 64).init(&device),
                fc2: LinearConfig::new(64, 4).init(&device),
                act: Relu::new(),
            })
            .unwrap();
        let mut optim = SgdConfig::new().init();
        let x = Tensor::<B, 2>::random([8, 16], Distribution::Normal(0.0, 1.0), &device);
        let y = Tensor::<B, 2>::random([8, 4], Distribution::Normal(0.0, 1.0), &device);
        for step in 0..1_000 {
            if step == 100 {
                base = rss();
            }
            let out = model
                .fc2
                .forward(model.act.forward(model.fc1.forward(x.clone())));
            let loss = (out - y.clone()).powi_scalar(2).mean();
            let grads = session.backward(loss).unwrap();
            let grads = GradientsParams::from_grads(grads, &model);
            model = optim.step(1e-3, model, grads);
        }
        let training = growth("1k training steps", base, rss(), rank);
        assert!(
            collectives < 0.05,
            "all-reduces grew memory by {:.2} %",
            collectives * 100.0
        );
        assert!(
            training < 0.05,
            "training grew memory by {:.2} %",
            training * 100.0
        );
        return;
    }
    if !common::is_any_child() {
        let out = common::TestJob::new(2, NAME).run();
        for o in &out.0 {
            for line in o.output.lines().filter(|l| l.contains("rss")) {
                println!("{line}");
            }
        }
        out.assert_all_ok();
    }
}
