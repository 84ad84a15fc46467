//! Pipeline and hybrid parallelism must train exactly like the unsplit model in one process:
//! a 4-layer MLP split into 2 or 4 stages (real processes, real TCP, real Burn training), GPipe
//! and 1F1B, 10 SGD steps on batches of 10 rows in 4 uneven micro-batches, every parameter within
//! 1e-5 relative of the reference; 2 stages x 2 replicas against one process on the global batch;
//! the same pipeline on threads of one process; and a stage killed mid-step, named by the others.

use crate::common;

use burn_ddp_comm::CollectiveError;
use std::ops::Range;
use std::time::Duration;

use burn::backend::Autodiff;
use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::optim::{GradientsParams, Optimizer, SgdConfig};
use burn::tensor::activation::relu;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Distribution, Tensor};
use burn_ddp::pipeline::{HybridLayout, Pipeline, Schedule, StageInput};
use burn_ddp::{Ddp, DdpConfig, DdpError, DdpSession, ProcessGroup, Rank, Timeouts, WorldSize};
use common::compare::{assert_close, F32};

// Burn 0.21 with its `distributed` feature (which burn-ddp needs) makes every autodiff backend
// distributed: stages without replicas run on `Ddp<B>` as well, without a session.
type Plain = Autodiff<Ddp<burn::backend::NdArray>>;
type Hybrid = Plain;

const STEPS: usize = 10;
const ROWS: usize = 10;
const MICRO: usize = 4;
const WIDTHS: [usize; 5] = [6, 8, 8, 8, 3];
const LR: f64 = 0.1;

/// The backend's random generator is one per process, and tests of this binary (and the stage
/// threads of one of them) run concurrently: seeding and drawing happen under this lock, so each
/// draw depends only on its seed.
static RNG: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// A stack of linear layers with a ReLU after each, except after the model's last layer.
#[derive(Module, Debug)]
struct Layers<B: Backend> {
    layers: Vec<Linear<B>>,
}

impl<B: Backend> Layers<B> {
    /// The whole model, from a fixed seed (the same on every rank).
    fn full(device: &B::Device) -> Self {
        let _rng = RNG.lock().unwrap_or_else(|p| p.into_inner());
        B::seed(device, 7);
        let model = Self {
            layers: WIDTHS
                .windows(2)
                .map(|w| LinearConfig::new(w[0], w[1]).init(device))
                .collect(),
        };
        // Burn initialises parameters lazily, from the generator's state at first use: read
        // them now, while it holds this seed.
        let _ = common::params(&model);
        model
    }

    /// Layers `range` of the whole model.
    fn part(self, range: Range<usize>) -> Self {
        Self {
            layers: self.layers[range].to_vec(),
        }
    }

    /// `last`: this part ends the model (no ReLU after its last layer).
    fn forward(&self, mut x: Tensor<B, 2>, last: bool) -> Tensor<B, 2> {
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

/// Step `step`'s batch of `rows` rows for replica `replica` (inputs, targets).
fn batch<B: Backend>(
    step: usize,
    replica: usize,
    rows: usize,
    device: &B::Device,
) -> (Tensor<B, 2>, Tensor<B, 2>) {
    let _rng = RNG.lock().unwrap_or_else(|p| p.into_inner());
    B::seed(device, 1000 + 10 * step as u64 + replica as u64);
    (
        Tensor::random([rows, WIDTHS[0]], Distribution::Normal(0.0, 1.0), device),
        Tensor::random([rows, WIDTHS[4]], Distribution::Normal(0.0, 1.0), device),
    )
}

fn mse<B: Backend>(y: Tensor<B, 2>, t: Tensor<B, 2>) -> Tensor<B, 1> {
    (y - t).powi_scalar(2).mean()
}

/// The layers stage `stage` of `stages` holds.
fn layers_of(stage: usize, stages: usize) -> Range<usize> {
    let per = (WIDTHS.len() - 1) / stages;
    stage * per..(stage + 1) * per
}

/// The unsplit model trained for `STEPS` steps in this process on the batches of `replicas`
/// replicas concatenated (one process on the global batch); returns layers `range`.
fn reference<B: AutodiffBackend>(replicas: usize, range: Range<usize>) -> Layers<B> {
    let device = Default::default();
    let mut model = Layers::<B>::full(&device);
    let mut opt = SgdConfig::new().init::<B, Layers<B>>();
    for step in 0..STEPS {
        let (xs, ts): (Vec<_>, Vec<_>) = (0..replicas)
            .map(|r| batch::<B>(step, r, ROWS, &device))
            .unzip();
        let loss = mse(model.forward(Tensor::cat(xs, 0), true), Tensor::cat(ts, 0));
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = opt.step(LR, model, grads);
    }
    model.part(range)
}

/// Trains this rank's stage of `pipeline` for `STEPS` steps (replica `replica`'s batches),
/// with `session` averaging across replicas when given; returns the stage.
fn train_stage<B: AutodiffBackend>(
    pipeline: &Pipeline,
    replica: usize,
    mut stage: Layers<B>,
    session: Option<&DdpSession>,
) -> Layers<B> {
    let device = Default::default();
    let last = pipeline.is_last();
    let mut opt = SgdConfig::new().init::<B, Layers<B>>();
    for step in 0..STEPS {
        let (x, t) = batch::<B>(step, replica, ROWS, &device);
        let input = if pipeline.is_first() {
            StageInput::Batch(x)
        } else {
            StageInput::Rows(ROWS)
        };
        let forward = |m: &Layers<B>, x| m.forward(x, last);
        let loss = |y, rows: Range<usize>| mse(y, t.clone().narrow(0, rows.start, rows.len()));
        let out = match session {
            Some(s) => pipeline.step_synced(s, &stage, input, forward, loss),
            None => pipeline.step(&stage, input, forward, loss),
        }
        .unwrap();
        assert_eq!(out.loss.is_some(), last);
        stage = opt.step(LR, stage, out.grads);
    }
    stage
}

fn pipeline_matches_the_unsplit_model(pg: ProcessGroup, schedule: Schedule) {
    let stages = pg.world_size().as_usize();
    let stage_no = pg.rank().index();
    let range = layers_of(stage_no, stages);
    let pipeline = Pipeline::new(pg, schedule, MICRO).unwrap();
    let stage = Layers::<Plain>::full(&Default::default()).part(range.clone());
    let trained = train_stage(&pipeline, 0, stage, None);
    let want = reference::<Plain>(1, range);
    assert_close(
        stage_no,
        &common::params(&trained),
        &common::params(&want),
        F32,
    );
}

#[test]
fn two_stages_gpipe_train_like_the_unsplit_model() {
    common::multi_process(2, "two_stages_gpipe_train_like_the_unsplit_model", |pg| {
        pipeline_matches_the_unsplit_model(pg, Schedule::GPipe)
    });
}

#[test]
fn two_stages_1f1b_train_like_the_unsplit_model() {
    common::multi_process(2, "two_stages_1f1b_train_like_the_unsplit_model", |pg| {
        pipeline_matches_the_unsplit_model(pg, Schedule::OneFOneB)
    });
}

#[test]
fn four_stages_gpipe_train_like_the_unsplit_model() {
    common::multi_process(4, "four_stages_gpipe_train_like_the_unsplit_model", |pg| {
        pipeline_matches_the_unsplit_model(pg, Schedule::GPipe)
    });
}

#[test]
fn four_stages_1f1b_train_like_the_unsplit_model() {
    common::multi_process(4, "four_stages_1f1b_train_like_the_unsplit_model", |pg| {
        pipeline_matches_the_unsplit_model(pg, Schedule::OneFOneB)
    });
}

/// 2 stages x 2 replicas: each stage's replicas average their gradients through a DdpSession
/// on their sub-group; the result is one process training on both replicas' batches.
#[test]
fn two_stages_by_two_replicas_train_like_one_process_on_the_global_batch() {
    const NAME: &str = "two_stages_by_two_replicas_train_like_one_process_on_the_global_batch";
    common::multi_process(4, NAME, |pg| {
        let layout = HybridLayout::new(&pg, 2).unwrap();
        assert_eq!(layout.replica_count(), 2);
        let range = layers_of(layout.stage, 2);
        let session = DdpSession::new(layout.replicas.clone(), DdpConfig::default()).unwrap();
        let stage = Layers::<Hybrid>::full(&Default::default()).part(range.clone());
        let stage = session.prepare(stage).unwrap();
        let pipeline = Pipeline::new(layout.pipeline.clone(), Schedule::OneFOneB, MICRO).unwrap();
        let trained = train_stage(&pipeline, layout.replica, stage, Some(&session));
        let want = reference::<Hybrid>(2, range);
        assert_close(
            pg.rank().index(),
            &common::params(&trained),
            &common::params(&want),
            F32,
        );
    });
}

/// Stages on threads of one process (one per device; NdArray has one, which every thread
/// uses): the same executor over an in-process group.
#[test]
fn stages_on_threads_of_one_process_train_like_the_unsplit_model() {
    let groups = ProcessGroup::local(WorldSize::new(2).unwrap(), Timeouts::default());
    let trained: Vec<Vec<f32>> = std::thread::scope(|s| {
        let handles: Vec<_> = groups
            .into_iter()
            .map(|pg| {
                s.spawn(move || {
                    let range = layers_of(pg.rank().index(), 2);
                    let pipeline = Pipeline::new(pg, Schedule::GPipe, MICRO).unwrap();
                    let stage = Layers::<Plain>::full(&Default::default()).part(range);
                    common::params(&train_stage(&pipeline, 0, stage, None))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (s, got) in trained.iter().enumerate() {
        let want = reference::<Plain>(1, layers_of(s, 2));
        assert_close(s, got, &common::params(&want), F32);
    }
}

#[test]
fn misuse_of_the_stage_inputs_is_a_clear_error() {
    let groups = ProcessGroup::local(WorldSize::new(2).unwrap(), Timeouts::default());
    let pipeline = Pipeline::new(groups[1].clone(), Schedule::GPipe, 2).unwrap();
    let device = Default::default();
    let stage = Layers::<Plain>::full(&device).part(0..1);
    let (x, _) = batch::<Plain>(0, 0, 4, &device);
    let e = pipeline
        .step(
            &stage,
            StageInput::Batch(x),
            |m, x| m.forward(x, false),
            |y, _| y.sum(),
        )
        .unwrap_err();
    assert!(
        e.to_string()
            .contains("only the first stage feeds the batch"),
        "{e}"
    );
    let e = Pipeline::new(groups[0].clone(), Schedule::GPipe, 0).unwrap_err();
    assert!(e.to_string().contains("at least one micro-batch"), "{e}");
    let first = Pipeline::new(groups[0].clone(), Schedule::GPipe, 8).unwrap();
    let (x, _) = batch::<Plain>(0, 0, 4, &device);
    let e = first
        .step(
            &stage,
            StageInput::Batch(x),
            |m, x| m.forward(x, false),
            |y, _| y.sum(),
        )
        .unwrap_err();
    assert!(
        e.to_string()
            .contains("8 micro-batches of a batch of 4 rows"),
        "{e}"
    );
}

/// Stage 2 of 4 is killed in the middle of training: every other stage names it, long before
/// the 10-minute deadline.
#[test]
fn a_killed_stage_stops_the_pipeline_naming_it() {
    const NAME: &str = "a_killed_stage_stops_the_pipeline_naming_it";
    if let Some(pg) = common::child_group(NAME) {
        let me = pg.rank().index();
        let pipeline = Pipeline::new(pg, Schedule::OneFOneB, MICRO).unwrap();
        let device = Default::default();
        let stage = Layers::<Plain>::full(&device).part(layers_of(me, 4));
        let last = pipeline.is_last();
        let err = (0..1000)
            .find_map(|step| {
                if me == 2 && step == 3 {
                    let pid = rustix::process::getpid();
                    let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
                    std::thread::sleep(Duration::from_secs(60));
                }
                let (x, t) = batch::<Plain>(step, 0, ROWS, &device);
                let input = if me == 0 {
                    StageInput::Batch(x)
                } else {
                    StageInput::Rows(ROWS)
                };
                pipeline
                    .step(
                        &stage,
                        input,
                        |m, x| m.forward(x, last),
                        |y, r: Range<usize>| mse(y, t.clone().narrow(0, r.start, r.len())),
                    )
                    .err()
            })
            .expect("the pipeline cannot go on once stage 2 is dead");
        let text = err.to_string();
        println!("rank {me} error: {text}");
        let named = match &err {
            DdpError::Collective(CollectiveError::PeerLost { peer, .. })
            | DdpError::Collective(CollectiveError::RankUnresponsive { culprit: peer, .. }) => {
                *peer == Rank(2)
            }
            DdpError::Collective(CollectiveError::JobAborted { record, .. }) => {
                record.culprit == Some(Rank(2))
            }
            _ => false,
        };
        assert!(named, "{text}");
        return;
    }
    common::assert_killed_rank_named_fast(4, NAME, 2);
}

/// Plain data parallelism on sub-groups: the world splits into two pairs, each trains its own
/// model with the overlapped reducer (gradients averaged during backward) on its sub-group; each
/// pair's model equals one process on the pair's global batch, and the pairs do not interfere.
#[test]
fn ddp_with_the_overlapped_reducer_runs_on_a_subgroup() {
    common::multi_process(
        4,
        "ddp_with_the_overlapped_reducer_runs_on_a_subgroup",
        |pg| {
            let pair = pg.split(Some(pg.rank().0 / 2)).unwrap().unwrap();
            let replica = pair.rank().index();
            let session = DdpSession::new(pair, DdpConfig::default()).unwrap();
            let device = Default::default();
            let all = 0..WIDTHS.len() - 1;
            let mut model = session
                .prepare(Layers::<Hybrid>::full(&device).part(all.clone()))
                .unwrap();
            let mut opt = SgdConfig::new().init::<Hybrid, Layers<Hybrid>>();
            for step in 0..STEPS {
                let (x, t) = batch::<Hybrid>(step, replica, ROWS, &device);
                let grads = session
                    .gradients(&model, mse(model.forward(x, true), t))
                    .unwrap();
                model = opt.step(LR, model, grads);
            }
            let want = reference::<Hybrid>(2, all);
            assert_close(
                pg.rank().index(),
                &common::params(&model),
                &common::params(&want),
                F32,
            );
        },
    );
}
