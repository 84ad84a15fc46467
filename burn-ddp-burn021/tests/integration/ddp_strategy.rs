//! `DdpStrategy` under burn-train's `SupervisedTraining`, in the in-process mode (one thread per
//! rank, real Burn training): equivalence with one rank on the global batch, bit-exact resume
//! from rank 0's checkpoints, and stop decisions (quit, early stop, data error) taken by every
//! rank.

use crate::common;

use burn_ddp_comm::JobError;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use burn::backend::autodiff::checkpoint::strategy::BalancedCheckpointing;
use burn::backend::{Autodiff, NdArray};
use burn::data::dataloader::batcher::Batcher;
use burn::data::dataloader::DataLoaderBuilder;
use burn::data::dataset::{Dataset, InMemDataset};
use burn::module::Module;
use burn::nn::loss::{MseLoss, Reduction};
use burn::nn::{BatchNorm, BatchNormConfig, Linear, LinearConfig};
use burn::optim::{Adam, AdamConfig};
use burn::prelude::*;
use burn::tensor::backend::AutodiffBackend;
use burn::train::metric::store::EventStoreClient;
use burn::train::metric::LossMetric;
use burn::train::{
    EarlyStoppingStrategy, InferenceStep, Learner, RegressionOutput, SupervisedTraining,
    TrainOutput, TrainStep,
};
use burn_ddp::fsdp::{gather, FsdpBackend, FsdpConfig, FullyShard};
use burn_ddp::train::{DdpStrategy, DdpTraining};
use burn_ddp::{
    ddp, Ddp, DdpConfig, DdpError, DdpSession, DistributedSampler, ProcessGroup, Rank, ShardPlan,
    Timeouts, WorldSize,
};

type B = Autodiff<Ddp<NdArray>>;

#[ddp]
#[derive(Module, Debug)]
struct Reg<B: Backend> {
    fc1: Linear<B>,
    fc2: Linear<B>,
    /// BatchNorm after `fc1`, for the buffer tests.
    norm: Option<BatchNorm<B>>,
}

#[derive(Debug, Clone)]
struct Batch<B: Backend> {
    x: Tensor<B, 2>,
    y: Tensor<B, 2>,
}

impl<B: Backend> Reg<B> {
    fn new(device: &B::Device, batch_norm: bool) -> Self {
        Self {
            fc1: LinearConfig::new(4, 8).init(device),
            fc2: LinearConfig::new(8, 1).init(device),
            norm: batch_norm.then(|| BatchNormConfig::new(8).init(device)),
        }
    }

    fn regress(&self, b: Batch<B>) -> RegressionOutput<B> {
        let h = self.fc1.forward(b.x);
        let h = match &self.norm {
            Some(norm) => {
                let [n, c] = h.dims();
                norm.forward(h.reshape([n, c, 1])).reshape([n, c])
            }
            None => h,
        };
        let out = self.fc2.forward(h.tanh());
        let loss = MseLoss::new().forward(out.clone(), b.y.clone(), Reduction::Mean);
        RegressionOutput::new(loss.reshape([1]), out, b.y)
    }
}

impl<B: AutodiffBackend> TrainStep for Reg<B> {
    type Input = Batch<B>;
    type Output = RegressionOutput<B>;
    fn step(&self, b: Batch<B>) -> TrainOutput<RegressionOutput<B>> {
        let item = self.regress(b);
        TrainOutput::new(self, item.loss.backward(), item)
    }
}

impl<B: Backend> InferenceStep for Reg<B> {
    type Input = Batch<B>;
    type Output = RegressionOutput<B>;
    fn step(&self, b: Batch<B>) -> RegressionOutput<B> {
        self.regress(b)
    }
}

type Item = [f32; 5];

#[derive(Clone, Default)]
struct Rows;

impl<B: Backend> Batcher<B, Item, Batch<B>> for Rows {
    fn batch(&self, items: Vec<Item>, device: &B::Device) -> Batch<B> {
        let n = items.len();
        let x: Vec<f32> = items.iter().flat_map(|r| r[..4].to_vec()).collect();
        let y: Vec<f32> = items.iter().map(|r| r[4]).collect();
        Batch {
            x: Tensor::<B, 1>::from_floats(x.as_slice(), device).reshape([n, 4]),
            y: Tensor::<B, 1>::from_floats(y.as_slice(), device).reshape([n, 1]),
        }
    }
}

fn rows(n: usize) -> Vec<Item> {
    (0..n)
        .map(|i| {
            let f = |k: usize| (((i * 7 + k * 13) % 17) as f32 - 8.0) / 8.0;
            let x = [f(0), f(1), f(2), f(3)];
            [
                x[0],
                x[1],
                x[2],
                x[3],
                0.5 * x[0] - x[1] * x[2] + 0.25 * x[3],
            ]
        })
        .collect()
}

/// A dataset whose item `bad` panics when read, or which panics at its read number
/// `fail_after + 1`: a data error on one rank.
struct Broken {
    inner: InMemDataset<Item>,
    bad: Option<usize>,
    fail_after: Option<usize>,
    reads: std::sync::atomic::AtomicUsize,
}

impl Dataset<Item> for Broken {
    fn get(&self, index: usize) -> Option<Item> {
        assert!(Some(index) != self.bad, "corrupt record {index}");
        let read = self
            .reads
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        assert!(
            self.fail_after.is_none_or(|n| read < n),
            "the disk went away at read {read}"
        );
        self.inner.get(index)
    }
    fn len(&self) -> usize {
        self.inner.len()
    }
}

/// Stops after a given epoch; set on rank 0 only (it has the metrics), which must stop all.
#[derive(Clone)]
struct StopAfter(usize);

impl EarlyStoppingStrategy for StopAfter {
    fn should_stop(&mut self, epoch: usize, _store: &EventStoreClient) -> bool {
        epoch >= self.0
    }
}

#[derive(Clone)]
struct Run {
    world: u32,
    batch: usize,
    epochs: usize,
    dir: PathBuf,
    resume: bool,
    bad_item_on_rank_1: Option<usize>,
    /// Rank 1's dataset fails after this many reads.
    fail_on_rank_1_after: Option<usize>,
    /// Burn's summary after training (printed by rank 0).
    summary: bool,
    early_stop_after: Option<usize>,
    quit_on_rank_0: bool,
    seed: u64,
    batch_norm: bool,
    broadcast_buffers: bool,
}

impl Run {
    fn new(world: u32, batch: usize, epochs: usize, dir: &Path) -> Self {
        Self {
            world,
            batch,
            epochs,
            dir: dir.to_path_buf(),
            resume: false,
            bad_item_on_rank_1: None,
            fail_on_rank_1_after: None,
            summary: false,
            early_stop_after: None,
            quit_on_rank_0: false,
            seed: 7,
            batch_norm: false,
            broadcast_buffers: true,
        }
    }

    /// Every rank's final parameters (or error), in rank order.
    fn train(&self) -> Vec<Result<Vec<f32>, DdpError>> {
        let groups = ProcessGroup::local(
            WorldSize::new(self.world).unwrap(),
            Timeouts::uniform(Duration::from_secs(60)),
        );
        // Burn's NdArray generator is one per process: initialise in rank order, here, and one
        // test at a time, so that initial weights do not depend on how threads interleave.
        static INIT: std::sync::Mutex<()> = std::sync::Mutex::new(());
        let device = Default::default();
        let lock = INIT.lock().unwrap_or_else(|p| p.into_inner());
        let models: Vec<Reg<B>> = (0..self.world)
            .map(|r| {
                // Different initial weights on every rank: the strategy must start from rank 0's.
                <B as Backend>::seed(&device, self.seed + u64::from(r));
                let model = Reg::<B>::new(&device, self.batch_norm);
                // Parameters are initialised lazily, on first use: draw them now.
                let _ = common::params(&burn::module::AutodiffModule::valid(&model));
                model
            })
            .collect();
        drop(lock);
        let handles: Vec<_> = groups
            .into_iter()
            .zip(models)
            .map(|(pg, model)| {
                let run = self.clone();
                thread::spawn(move || run.rank(pg, model))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    }

    fn rank(&self, pg: ProcessGroup, model: Reg<B>) -> Result<Vec<f32>, DdpError> {
        let rank = pg.rank();
        let device = Default::default();
        let (bad, fail_after) = if rank == Rank(1) {
            (self.bad_item_on_rank_1, self.fail_on_rank_1_after)
        } else {
            (None, None)
        };
        // `with_plan`: `new` would read items for its dataset check, which count towards
        // `fail_after`.
        let train = Arc::new(
            DistributedSampler::with_plan(
                Broken {
                    inner: InMemDataset::new(rows(96)),
                    bad,
                    fail_after,
                    reads: Default::default(),
                },
                ShardPlan::new(&pg),
            )
            .with_seed(3),
        );
        let valid = Arc::new(
            DistributedSampler::new(InMemDataset::new(rows(21)), &pg)
                .with_shuffle(false)
                .with_even_shards(false),
        );
        let train_loader = DataLoaderBuilder::new(Rows)
            .batch_size(self.batch)
            .build(Arc::clone(&train));
        let valid_loader = DataLoaderBuilder::<Ddp<NdArray>, _, _>::new(Rows)
            .batch_size(8)
            .build(Arc::clone(&valid));
        let config = DdpConfig::default().with_broadcast_buffers(self.broadcast_buffers);
        let session = DdpSession::new(pg, config)?;
        // The training sampler is not given to `with_sampler`: a `DistributedSampler::new` of
        // the strategy's group is found by the strategy.
        let ddp = DdpStrategy::<NdArray>::new(session, device)
            .with_sampler(valid)
            .with_checkpoints(self.dir.join("checkpoint"), 3)
            .with_resume(self.resume);
        let mut training = SupervisedTraining::new(
            self.dir.join(format!("rank-{rank}")),
            train_loader,
            valid_loader,
        )
        .metric_train_numeric(LossMetric::new())
        .metric_valid_numeric(LossMetric::new())
        .num_epochs(self.epochs)
        .with_application_logger(None);
        if self.summary {
            training = training.summary();
        }
        if rank == Rank(0) {
            if let Some(e) = self.early_stop_after {
                training = training.early_stopping(StopAfter(e));
            }
            if self.quit_on_rank_0 {
                // What the dashboard's quit does: stop rank 0's interrupter.
                training.interrupter().stop(Some("quit from the dashboard"));
            }
        }
        let learner = Learner::new(model, AdamConfig::new().init(), 1e-2);
        let result = training.launch_ddp(learner, &ddp)?;
        if self.early_stop_after.is_none() && !self.quit_on_rank_0 {
            assert_eq!(
                train.epoch(),
                self.epochs as u64,
                "the training sampler's epoch"
            );
        }
        Ok(common::params(&result.model))
    }
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("burn-ddp-strategy-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

fn ok(results: Vec<Result<Vec<f32>, DdpError>>) -> Vec<Vec<f32>> {
    results
        .into_iter()
        .enumerate()
        .map(|(r, p)| p.unwrap_or_else(|e| panic!("rank {r} failed: {e}")))
        .collect()
}

fn max_rel_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs() / x.abs().max(y.abs()).max(1e-3))
        .fold(0.0, f32::max)
}

#[test]
fn two_ranks_train_like_one_rank_on_the_global_batch() {
    let dir = scratch("equiv");
    let one = ok(Run::new(1, 8, 2, &dir.join("one")).train());
    let two = ok(Run::new(2, 4, 2, &dir.join("two")).train());
    assert_eq!(two[0], two[1], "the ranks' parameters differ");
    let diff = max_rel_diff(&one[0], &two[0]);
    assert!(diff < 1e-4, "2 ranks × batch 4 vs 1 rank × batch 8: {diff}");
    // Rank 0 alone wrote the checkpoints; only rank 0's directory holds metrics.
    for epoch in 1..=2 {
        for part in ["model", "optim", "scheduler"] {
            assert!(dir
                .join(format!("two/checkpoint/{part}-{epoch}.bin"))
                .is_file());
        }
    }
    assert!(dir.join("two/rank-0/train/epoch-2/Loss.log").is_file());
    assert!(!dir.join("two/rank-1").exists(), "rank 1 wrote files");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn resuming_from_a_checkpoint_matches_an_unbroken_run_bit_for_bit() {
    let dir = scratch("resume");
    let unbroken = ok(Run::new(2, 4, 3, &dir.join("a")).train());
    // Interrupted after epoch 1 (its checkpoint is the newest), then resumed to epoch 3.
    let _ = ok(Run::new(2, 4, 1, &dir.join("b")).train());
    let mut resumed = Run::new(2, 4, 3, &dir.join("b"));
    resumed.resume = true;
    // Other initial weights: only a real resume can end where the unbroken run ends.
    resumed.seed = 1234;
    let resumed = ok(resumed.train());
    assert_eq!(resumed[0], resumed[1]);
    assert!(
        unbroken[0] == resumed[0],
        "resumed run differs from the unbroken one by {}",
        max_rel_diff(&unbroken[0], &resumed[0])
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn an_early_stop_on_rank_0_stops_every_rank() {
    let dir = scratch("early");
    let mut run = Run::new(2, 4, 5, &dir);
    run.early_stop_after = Some(2);
    let params = ok(run.train());
    assert_eq!(params[0], params[1]);
    assert!(dir.join("checkpoint/model-2.bin").is_file());
    assert!(
        !dir.join("checkpoint/model-3.bin").exists(),
        "training went on after the early stop"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_quit_on_rank_0_stops_every_rank_before_the_first_step() {
    let dir = scratch("quit");
    let mut run = Run::new(2, 4, 5, &dir);
    run.quit_on_rank_0 = true;
    let params = ok(run.train());
    // Nobody trained: both hold rank 0's initial weights.
    assert_eq!(params[0], params[1]);
    assert!(!dir.join("checkpoint/model-1.bin").exists());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_data_error_on_rank_1_stops_every_rank_naming_it() {
    let dir = scratch("data-error");
    let mut run = Run::new(2, 4, 3, &dir);
    run.bad_item_on_rank_1 = Some(50);
    let started = Instant::now();
    let results = run.train();
    assert!(started.elapsed() < Duration::from_secs(30));
    for (r, res) in results.into_iter().enumerate() {
        match res {
            Err(DdpError::Job(JobError::TrainingFailed {
                culprit, reason, ..
            })) => {
                assert_eq!(culprit, Rank(1), "rank {r}: {reason}");
                assert!(reason.contains("corrupt record 50"), "rank {r}: {reason}");
            }
            other => panic!("rank {r}: expected TrainingFailed, got {other:?}"),
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A run that fails in its second epoch (rank 1's data fails at its 11th item of that epoch,
/// after rank 0 logged steps of it): Burn's summary on rank 0 counts the one completed epoch,
/// where Burn alone counts the highest epoch it finds logs of. The run is a child process of
/// this test binary, whose output (rank 0's progress lines and summary) is read.
#[test]
fn a_run_that_fails_in_epoch_2_is_summarised_as_one_epoch() {
    const NAME: &str = "a_run_that_fails_in_epoch_2_is_summarised_as_one_epoch";
    const CHILD: &str = "BURN_DDP_TEST_SUMMARY_DIR";
    if let Some(dir) = std::env::var_os(CHILD) {
        let mut run = Run::new(2, 4, 3, Path::new(&dir));
        // 48 items per rank and epoch: the 59th read is in epoch 2.
        run.fail_on_rank_1_after = Some(48 + 10);
        run.summary = true;
        for (r, res) in run.train().into_iter().enumerate() {
            assert!(res.is_err(), "rank {r} did not fail");
        }
        return;
    }
    let dir = scratch("summary");
    let stdout = common::spawned::rerun_in_child(NAME, CHILD, &dir);
    common::spawned::assert_summarised_as_one_epoch(&stdout, &dir);
    let _ = std::fs::remove_dir_all(&dir);
}

/// BatchNorm's running statistics, which each rank updates from its own shard, end equal on
/// every rank (rank 0's, sent before every step and at the end of each epoch: PyTorch's
/// `broadcast_buffers`), so validation and the checkpoint see one set; with the switch off they
/// differ (the test is not vacuous).
#[test]
fn batch_norm_statistics_end_equal_on_every_rank() {
    let dir = scratch("buffers");
    let mut run = Run::new(2, 4, 2, &dir.join("on"));
    run.batch_norm = true;
    let on = ok(run.train());
    assert_eq!(on[0], on[1], "the ranks' parameters or buffers differ");
    run.broadcast_buffers = false;
    run.dir = dir.join("off");
    let off = ok(run.train());
    assert_ne!(
        off[0], off[1],
        "without broadcasting, the buffers should differ"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// [`Reg`] without BatchNorm whose forward gathers each layer (`fsdp::gather`), on the
/// checkpointing backend (resharding after forward), for `DdpStrategy::fsdp`.
#[ddp]
#[derive(Module, Debug)]
struct Sharded<B: Backend> {
    fc1: Linear<B>,
    fc2: Linear<B>,
}

type Bc = Autodiff<Ddp<NdArray>, BalancedCheckpointing>;

impl<B: FsdpBackend> Sharded<B> {
    /// The same draws, in the same order, as `Reg::new(device, false)`.
    fn new(device: &B::Device) -> Self {
        Self {
            fc1: LinearConfig::new(4, 8).init(device),
            fc2: LinearConfig::new(8, 1).init(device),
        }
    }

    fn regress(&self, b: Batch<B>) -> RegressionOutput<B> {
        let h = gather(&self.fc1).forward(b.x);
        let out = gather(&self.fc2).forward(h.tanh());
        let loss = MseLoss::new().forward(out.clone(), b.y.clone(), Reduction::Mean);
        RegressionOutput::new(loss.reshape([1]), out, b.y)
    }
}

impl TrainStep for Sharded<Bc> {
    type Input = Batch<Bc>;
    type Output = RegressionOutput<Bc>;
    fn step(&self, b: Batch<Bc>) -> TrainOutput<RegressionOutput<Bc>> {
        let item = self.regress(b);
        TrainOutput::new(self, item.loss.backward(), item)
    }
}

impl InferenceStep for Sharded<Ddp<NdArray>> {
    type Input = Batch<Ddp<NdArray>>;
    type Output = RegressionOutput<Ddp<NdArray>>;
    fn step(&self, b: Batch<Ddp<NdArray>>) -> RegressionOutput<Ddp<NdArray>> {
        self.regress(b)
    }
}

/// A Learner run of [`Sharded`] under `DdpStrategy::fsdp` on `world` thread ranks of batch
/// `batch`, `epochs` epochs over `Run`'s 96 training rows (even validation shards: a sharded
/// forward runs on every rank together), checkpoints in `dir`, resumed when `resume`. Every
/// rank's final parameters; rank 0's initial weights are `Run`'s (seed 7). With `shard` off, the
/// Learner is built with the whole model (which the strategy refuses).
fn fsdp_run(
    world: u32,
    batch: usize,
    epochs: usize,
    dir: &Path,
    resume: bool,
    shard: bool,
) -> Vec<Result<Vec<f32>, DdpError>> {
    let groups = ProcessGroup::local(
        WorldSize::new(world).unwrap(),
        Timeouts::uniform(Duration::from_secs(60)),
    );
    static INIT: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let device = Default::default();
    let lock = INIT.lock().unwrap_or_else(|p| p.into_inner());
    let models: Vec<Sharded<Bc>> = (0..world)
        .map(|r| {
            <Bc as Backend>::seed(&device, 7 + u64::from(r));
            let model = Sharded::<Bc>::new(&device);
            let _ = common::params(&burn::module::AutodiffModule::valid(&model));
            model
        })
        .collect();
    drop(lock);
    let handles: Vec<_> = groups
        .into_iter()
        .zip(models)
        .map(|(pg, model)| {
            let dir = dir.to_path_buf();
            thread::spawn(move || -> Result<Vec<f32>, DdpError> {
                let rank = pg.rank();
                let train = Arc::new(
                    DistributedSampler::new(InMemDataset::new(rows(96)), &pg).with_seed(3),
                );
                let valid = Arc::new(
                    DistributedSampler::new(InMemDataset::new(rows(16)), &pg).with_shuffle(false),
                );
                let train_loader = DataLoaderBuilder::new(Rows)
                    .batch_size(batch)
                    .build(Arc::clone(&train));
                let valid_loader = DataLoaderBuilder::<Ddp<NdArray>, _, _>::new(Rows)
                    .batch_size(4)
                    .build(Arc::clone(&valid));
                let fsdp = FullyShard::new(pg, FsdpConfig::default()).unwrap();
                let ddp = DdpStrategy::<NdArray>::fsdp::<Bc, Sharded<Bc>, Adam>(
                    fsdp.clone(),
                    Default::default(),
                )
                .unwrap()
                .with_sampler(valid)
                .with_checkpoints(dir.join("checkpoint"), 3)
                .with_resume(resume);
                let model = match shard {
                    true => fsdp.shard::<Bc, _>(model).unwrap(),
                    false => model,
                };
                let learner = Learner::new(model, AdamConfig::new().init(), 1e-2);
                let result = SupervisedTraining::new(
                    dir.join(format!("rank-{rank}")),
                    train_loader,
                    valid_loader,
                )
                .metric_train_numeric(LossMetric::new())
                .metric_valid_numeric(LossMetric::new())
                .num_epochs(epochs)
                .with_application_logger(None)
                .launch_ddp(learner, &ddp)?;
                Ok(common::params(&result.model))
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

/// Burn 0.21's Learner over a model sharded by FSDP (`DdpStrategy::fsdp::<Bc, Sharded<Bc>,
/// Adam>`, resharding after forward) trains as the DDP strategy does on the same ranks and
/// data, within f32 rounding, every rank ending with the whole model; its whole checkpoint of
/// epoch 1, written by 2 ranks, resumes at 4 (fc2's 8 rows two a rank, fc1's bias likewise)
/// and ends where 2 ranks training both epochs end.
#[test]
fn the_learner_over_fsdp_shards_trains_as_ddp_and_resumes_at_another_world_size() {
    let dir = scratch("fsdp");
    let ddp = ok(Run::new(2, 4, 2, &dir.join("ddp")).train());
    let fsdp = ok(fsdp_run(2, 4, 2, &dir.join("fsdp"), false, true));
    assert_eq!(fsdp[0], fsdp[1], "every rank's whole model");
    let diff = max_rel_diff(&ddp[0], &fsdp[0]);
    assert!(diff < 1e-4, "FSDP vs DDP: {diff}");
    let _ = ok(fsdp_run(2, 4, 1, &dir.join("resume"), false, true));
    for part in ["model", "optim", "scheduler"] {
        assert!(dir
            .join(format!("resume/checkpoint/{part}-1.bin"))
            .is_file());
    }
    let resumed = ok(fsdp_run(4, 2, 2, &dir.join("resume"), true, true));
    for r in &resumed {
        let diff = max_rel_diff(&fsdp[0], r);
        assert!(
            diff < 1e-4,
            "resumed at 4 ranks vs 2 ranks unbroken: {diff}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A Learner built with the whole model for `DdpStrategy::fsdp` is refused on every rank before
/// any step, naming a whole parameter and the fix.
#[test]
fn a_learner_whose_model_fsdp_did_not_shard_is_refused() {
    let dir = scratch("fsdp-unsharded");
    for (rank, r) in fsdp_run(2, 4, 1, &dir, false, false)
        .into_iter()
        .enumerate()
    {
        let e = r.unwrap_err().to_string();
        assert!(
            e.contains("`fc1.weight` whole") && e.contains("fsdp.shard(model)?"),
            "rank {rank}: {e}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}
