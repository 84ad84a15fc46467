//! burn-ddp-gradsync's NCCL path on a real GPU (Burn 0.22.1, or 0.23 when built for it), at world size 1 with `GradTransport::Nccl`:
//! `GradSync` takes the device path, f32 gradients come back bit for bit, compressed ones within
//! the wire type's rounding, absent ones stay absent, and 20 steps through NCCL train like plain
//! Burn; under ZeRO stage 2 the buckets are reduce-scattered (`ncclReduceScatter`, the whole
//! bucket at world size 1), the stepped parameters all-gathered on the GPU (`ncclAllGather`, a
//! copy at world size 1), and 20 steps of Adam train like plain Burn's.
//!
//! Needs an NVIDIA GPU, its driver and NCCL, and Burn's CUDA runtime, which links LLVM (its
//! build script downloads the bundle unless `scripts/offline-llvm.sh` put it in place). Built
//! and linked in CI (`--features fusion`), run by `scripts/gpu-check.sh`; on a machine without a
//! GPU these tests fail, naming what is missing (`required-features = ["cuda"]`: plain `cargo
//! test` does not build it).

// This package is built for one Burn release (feature `burn-0-22` or `burn-0-23`): `burn` is
// that release. A project of yours depends on its own `burn` and has no need of these lines.
#[cfg(feature = "burn-0-22")]
extern crate burn022 as burn;
#[cfg(feature = "burn-0-23")]
extern crate burn023 as burn;

use burn_ddp as line;

use burn::module::{Module, ModuleVisitor, Param};
use burn::nn::{Linear, LinearConfig, Relu};
use burn::optim::{AdamConfig, GradientsParams, SgdConfig};
use burn::tensor::{Device, Distribution, Tensor};
use line::config::GradTransport;
use line::{Compression, DdpConfig, GradSync, ProcessGroup};

#[derive(Module, Debug)]
struct Mlp {
    fc1: Linear,
    fc2: Linear,
    /// Never used in `forward`: gets no gradient.
    unused: Linear,
    act: Relu,
}

impl Mlp {
    fn new(device: &Device) -> Self {
        Self {
            fc1: LinearConfig::new(16, 300).init(device),
            fc2: LinearConfig::new(300, 4).init(device),
            unused: LinearConfig::new(16, 5).init(device),
            act: Relu::new(),
        }
    }

    fn loss(&self, x: Tensor<2>, y: Tensor<2>) -> Tensor<1> {
        let out = self.fc2.forward(self.act.forward(self.fc1.forward(x)));
        (out - y).square().mean()
    }
}

fn device() -> Device {
    let pg = ProcessGroup::single();
    line::cuda::rank_device(&pg)
        .unwrap_or_else(|e| panic!("no GPU for this test: {e}"))
        .autodiff()
}

fn sync(compression: Compression) -> GradSync {
    let config = DdpConfig {
        transport: GradTransport::Nccl,
        compression,
        ..DdpConfig::default()
    };
    GradSync::new(ProcessGroup::single(), config).unwrap_or_else(|e| panic!("GradSync: {e}"))
}

fn batch(device: &Device, step: usize) -> (Tensor<2>, Tensor<2>) {
    let _ = step;
    let x = Tensor::<2>::random([32, 16], Distribution::Normal(0.0, 1.0), device);
    let y = Tensor::<2>::random([32, 4], Distribution::Normal(0.0, 1.0), device);
    (x, y)
}

/// Each trainable parameter's gradient in `grads` (flattened f32 on the host), by name; `None`
/// where it has none.
fn read(model: &Mlp, grads: &GradientsParams) -> Vec<(String, Option<Vec<f32>>)> {
    struct Read<'a> {
        grads: &'a GradientsParams,
        path: Vec<String>,
        out: Vec<(String, Option<Vec<f32>>)>,
    }
    impl ModuleVisitor for Read<'_> {
        fn enter_module(&mut self, name: &str, _: &str) {
            self.path.push(name.to_owned());
        }
        fn exit_module(&mut self, _: &str, _: &str) {
            self.path.pop();
        }
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let g = self.grads.get::<D>(param.id).map(|g| {
                g.into_data()
                    .convert::<f32>()
                    .try_to_vec::<f32>()
                    .expect("f32 gradient")
            });
            self.out.push((self.path.join("."), g));
        }
    }
    let mut r = Read {
        grads,
        path: Vec::new(),
        out: Vec::new(),
    };
    model.visit(&mut r);
    r.out
}

fn params(model: &Mlp) -> Vec<f32> {
    struct All(Vec<f32>);
    impl ModuleVisitor for All {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            self.0.extend(
                param
                    .val()
                    .into_data()
                    .convert::<f32>()
                    .try_to_vec::<f32>()
                    .expect("f32 parameter"),
            );
        }
    }
    let mut all = All(Vec::new());
    model.visit(&mut all);
    all.0
}

/// A parameter's name, and its gradient before and after `GradSync::sync`.
type Trip = (String, Option<Vec<f32>>, Option<Vec<f32>>);

/// One backward, its gradients read before and after `GradSync::sync`.
fn round_trip(compression: Compression) -> Vec<Trip> {
    let device = device();
    let mut sync = sync(compression);
    let model = sync.prepare(Mlp::new(&device)).expect("prepare");
    assert!(
        sync.uses_nccl(),
        "GradSync did not take the NCCL path for a model on {device:?}"
    );
    let (x, y) = batch(&device, 0);
    let grads = GradientsParams::from_grads(model.loss(x, y).backward(), &model);
    let before = read(&model, &grads);
    let grads = sync.sync(&model, grads).expect("sync over NCCL");
    let after = read(&model, &grads);
    before
        .into_iter()
        .zip(after)
        .map(|((name, b), (_, a))| (name, b, a))
        .collect()
}

#[test]
fn f32_gradients_come_back_bit_for_bit_and_absent_ones_stay_absent() {
    for (name, before, after) in round_trip(Compression::None) {
        if name.starts_with("unused") {
            assert!(before.is_none(), "{name} had a gradient before sync");
            assert!(after.is_none(), "{name} got a gradient from sync");
            continue;
        }
        let (before, after) = (before.expect(&name), after.expect(&name));
        assert_eq!(before, after, "{name}: NCCL's mean of one rank changed it");
    }
}

#[test]
fn compressed_gradients_come_back_within_the_wire_types_rounding() {
    for (compression, relative) in [(Compression::F16, 1e-3), (Compression::Bf16, 8e-3)] {
        for (name, before, after) in round_trip(compression) {
            let (Some(before), Some(after)) = (before, after) else {
                assert!(name.starts_with("unused"), "{name} lost its gradient");
                continue;
            };
            for (b, a) in before.iter().zip(&after) {
                let bound = relative * b.abs() + 1e-6;
                assert!(
                    (a - b).abs() <= bound,
                    "{name} with {compression:?}: {b} came back as {a}"
                );
            }
        }
    }
}

#[test]
fn twenty_steps_through_nccl_train_like_plain_burn() {
    let device = device();
    let mut sync = sync(Compression::None);
    let init = Mlp::new(&device);
    let mut plain = init.clone();
    let mut ddp = sync.prepare(init).expect("prepare");
    assert!(sync.uses_nccl());
    let mut opt_plain = SgdConfig::new().init();
    let mut opt_ddp = SgdConfig::new().init();
    for step in 0..20 {
        let (x, y) = batch(&device, step);
        let g = GradientsParams::from_grads(plain.loss(x.clone(), y.clone()).backward(), &plain);
        plain = opt_plain.step(0.05, plain, g);
        let g = GradientsParams::from_grads(ddp.loss(x, y).backward(), &ddp);
        let g = sync.sync(&ddp, g).expect("sync over NCCL");
        ddp = opt_ddp.step(0.05, ddp, g);
    }
    assert_eq!(params(&plain), params(&ddp));
}

#[test]
fn zero_stage_2_reduce_scatters_through_nccl_and_trains_like_plain_adam() {
    let device = device();
    let mut sync = sync(Compression::None);
    let init = Mlp::new(&device);
    let mut plain = init.clone();
    let mut ddp = sync.prepare(init).expect("prepare");
    assert!(sync.uses_nccl());
    let mut opt_plain = AdamConfig::new().init();
    let mut opt_ddp = sync
        .zero2(AdamConfig::new().init(), &ddp)
        .expect("ZeRO stage 2 on NCCL");
    for step in 0..20 {
        let (x, y) = batch(&device, step);
        let g = GradientsParams::from_grads(plain.loss(x.clone(), y.clone()).backward(), &plain);
        plain = opt_plain.step(0.01, plain, g);
        let g = GradientsParams::from_grads(ddp.loss(x, y).backward(), &ddp);
        let before = read(&ddp, &g);
        let g = sync.sync(&ddp, g).expect("reduce-scatter over NCCL");
        if step == 0 {
            // One rank owns every parameter: each gradient comes back as it went.
            for ((name, b), (_, a)) in before.into_iter().zip(read(&ddp, &g)) {
                assert_eq!(b, a, "{name}: the reduce-scatter of one rank changed it");
            }
        }
        ddp = opt_ddp.step(0.01, ddp, g).expect("ZeRO step");
    }
    let counts = sync.device_counts().expect("the NCCL path's counts");
    assert!(counts.buckets >= 20, "{counts:?}");
    for (i, (p, d)) in params(&plain).iter().zip(params(&ddp)).enumerate() {
        assert!(
            (p - d).abs() <= 1e-5 * p.abs().max(1.0),
            "parameter value {i}: {p} vs {d}"
        );
    }
}
