//! Burn 0.22.1 or 0.23: pipeline and hybrid parallelism train exactly like the unsplit model in one
//! process (real processes, real TCP, Burn's Flex backend): a 4-layer MLP in 2 and 4 stages,
//! GPipe and 1F1B, 10 SGD steps on batches of 10 rows in 4 uneven micro-batches, and 2 stages x 2
//! replicas with `GradSync` on each stage's replicas; every parameter within 1e-5 relative.

use burn_ddp as line;

use burn_ddp_dev::procs;

use burn_ddp_dev::compare;

use std::ops::Range;

use burn::module::{Module, ModuleVisitor, Param};
use burn::nn::{Linear, LinearConfig};
use burn::optim::{GradientsParams, SgdConfig};
use burn::tensor::activation::relu;
use burn::tensor::{Device, Distribution, Tensor};
use compare::{assert_close, F32};
use line::pipeline::{HybridLayout, Pipeline, Schedule, StageInput};
use line::{DdpConfig, GradSync, ProcessGroup};

const STEPS: usize = 10;
const ROWS: usize = 10;
const MICRO: usize = 4;
const WIDTHS: [usize; 5] = [6, 8, 8, 8, 3];
const LR: f64 = 0.1;

fn device() -> Device {
    Device::default().autodiff()
}

#[derive(Module, Debug)]
struct Layers {
    layers: Vec<Linear>,
}

impl Layers {
    fn full(device: &Device) -> Self {
        device.seed(7);
        let model = Self {
            layers: WIDTHS
                .windows(2)
                .map(|w| LinearConfig::new(w[0], w[1]).init(device))
                .collect(),
        };
        // Parameters are initialised lazily: read them while the generator holds this seed.
        let _ = params(&model);
        model
    }

    fn part(self, range: Range<usize>) -> Self {
        Self {
            layers: self.layers[range].to_vec(),
        }
    }

    fn forward(&self, mut x: Tensor<2>, last: bool) -> Tensor<2> {
        let n = self.layers.len();
        for (i, l) in self.layers.iter().enumerate() {
            x = l.forward(x);
            if !(last && i + 1 == n) {
                x = relu(x);
            }
        }
        x
    }
}

fn params<M: Module>(m: &M) -> Vec<f32> {
    struct Collect<'a>(&'a mut Vec<f32>);
    impl ModuleVisitor for Collect<'_> {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
            self.0.extend(
                p.val()
                    .into_data()
                    .convert::<f32>()
                    .try_to_vec::<f32>()
                    .unwrap(),
            );
        }
    }
    let mut out = Vec::new();
    m.visit(&mut Collect(&mut out));
    out
}

fn batch(step: usize, replica: usize, device: &Device) -> (Tensor<2>, Tensor<2>) {
    device.seed(1000 + 10 * step as u64 + replica as u64);
    (
        Tensor::random([ROWS, WIDTHS[0]], Distribution::Normal(0.0, 1.0), device),
        Tensor::random([ROWS, WIDTHS[4]], Distribution::Normal(0.0, 1.0), device),
    )
}

fn mse(y: Tensor<2>, t: Tensor<2>) -> Tensor<1> {
    (y - t).powi_scalar(2).mean()
}

fn layers_of(stage: usize, stages: usize) -> Range<usize> {
    let per = (WIDTHS.len() - 1) / stages;
    stage * per..(stage + 1) * per
}

/// The unsplit model trained on the batches of `replicas` replicas concatenated; layers `range`.
fn reference(replicas: usize, range: Range<usize>) -> Vec<f32> {
    let device = device();
    let mut model = Layers::full(&device);
    let mut opt = SgdConfig::new().init();
    for step in 0..STEPS {
        let (xs, ts): (Vec<_>, Vec<_>) = (0..replicas).map(|r| batch(step, r, &device)).unzip();
        let loss = mse(model.forward(Tensor::cat(xs, 0), true), Tensor::cat(ts, 0));
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = opt.step(LR, model, grads);
    }
    params(&model.part(range))
}

fn train_stage(
    pipeline: &Pipeline,
    replica: usize,
    mut stage: Layers,
    mut sync: Option<&mut GradSync>,
) -> Vec<f32> {
    let device = device();
    let last = pipeline.is_last();
    let mut opt = SgdConfig::new().init();
    for step in 0..STEPS {
        let (x, t) = batch(step, replica, &device);
        let input = if pipeline.is_first() {
            StageInput::Batch(x)
        } else {
            StageInput::Rows(ROWS)
        };
        let forward = |m: &Layers, x| m.forward(x, last);
        let loss = |y, rows: Range<usize>| mse(y, t.clone().narrow(0, rows.start, rows.len()));
        let out = match sync.as_deref_mut() {
            Some(s) => pipeline.step_synced(s, &stage, &device, input, forward, loss),
            None => pipeline.step(&stage, &device, input, forward, loss),
        }
        .unwrap();
        assert_eq!(out.loss.is_some(), last);
        stage = opt.step(LR, stage, out.grads);
    }
    params(&stage)
}

fn pipeline_matches(pg: ProcessGroup, schedule: Schedule) {
    let stages = pg.world_size().as_usize();
    let s = pg.rank().index();
    let range = layers_of(s, stages);
    let pipeline = Pipeline::new(pg, schedule, MICRO).unwrap();
    let got = train_stage(
        &pipeline,
        0,
        Layers::full(&device()).part(range.clone()),
        None,
    );
    assert_close(s, &got, &reference(1, range), F32);
}

macro_rules! pipeline_test {
    ($name:ident, $world:expr, $schedule:expr) => {
        #[test]
        fn $name() {
            if let Some(pg) = procs::child_group(stringify!($name)) {
                return pipeline_matches(pg, $schedule);
            }
            procs::TestJob::new($world, stringify!($name))
                .run()
                .assert_all_ok();
        }
    };
}

pipeline_test!(
    two_stages_gpipe_train_like_the_unsplit_model,
    2,
    Schedule::GPipe
);
pipeline_test!(
    two_stages_1f1b_train_like_the_unsplit_model,
    2,
    Schedule::OneFOneB
);
pipeline_test!(
    four_stages_gpipe_train_like_the_unsplit_model,
    4,
    Schedule::GPipe
);
pipeline_test!(
    four_stages_1f1b_train_like_the_unsplit_model,
    4,
    Schedule::OneFOneB
);

#[test]
fn two_stages_by_two_replicas_train_like_one_process_on_the_global_batch() {
    const NAME: &str = "two_stages_by_two_replicas_train_like_one_process_on_the_global_batch";
    if let Some(pg) = procs::child_group(NAME) {
        let layout = HybridLayout::new(&pg, 2).unwrap();
        let range = layers_of(layout.stage, 2);
        let mut sync = GradSync::new(layout.replicas.clone(), DdpConfig::default()).unwrap();
        let stage = sync
            .prepare(Layers::full(&device()).part(range.clone()))
            .unwrap();
        let pipeline = Pipeline::new(layout.pipeline.clone(), Schedule::OneFOneB, MICRO).unwrap();
        let got = train_stage(&pipeline, layout.replica, stage, Some(&mut sync));
        assert_close(pg.rank().index(), &got, &reference(2, range), F32);
        return;
    }
    procs::TestJob::new(4, NAME).run().assert_all_ok();
}
