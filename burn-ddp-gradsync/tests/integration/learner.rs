//! Burn 0.22's or 0.23's Learner (the release this binary is built for) with burn-ddp's `DdpStrategy`, in the in-process mode (one thread per
//! rank, real Burn training): a run that fails in the middle of its second epoch is summarised
//! by Burn as one epoch, on rank 0.

use burn_ddp as line;

#[allow(dead_code)]
use burn_ddp_dev::spawned;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::Duration;

use burn::data::dataloader::batcher::Batcher;
use burn::data::dataloader::DataLoaderBuilder;
use burn::data::dataset::{Dataset, DatasetError, InMemDataset};
use burn::module::Module;
use burn::nn::loss::{MseLoss, Reduction};
use burn::nn::{Linear, LinearConfig};
use burn::optim::AdamConfig;
use burn::prelude::*;
use burn::train::metric::LossMetric;
use burn::train::{
    InferenceStep, Learner, RegressionOutput, SupervisedTraining, TrainOutput, TrainStep,
};
use burn_ddp_dev::compare::{assert_close, F32};
use line::fsdp::gather;
use line::train::{DdpStrategy, DdpTraining};
use line::{
    DdpConfig, DdpError, DistributedSampler, FsdpConfig, FullyShard, GradSync, ProcessGroup,
    ShardPlan, Timeouts, WorldSize,
};

#[derive(Module, Debug)]
struct Reg {
    fc: Linear,
}

#[derive(Debug, Clone)]
struct Batch {
    x: Tensor<2>,
    y: Tensor<2>,
}

impl Reg {
    fn regress(&self, b: Batch) -> RegressionOutput {
        let out = self.fc.forward(b.x);
        let loss = MseLoss::new().forward(out.clone(), b.y.clone(), Reduction::Mean);
        RegressionOutput::new(loss.reshape([1]), out, b.y)
    }
}

impl TrainStep for Reg {
    type Input = Batch;
    type Output = RegressionOutput;
    fn step(&self, b: Batch) -> TrainOutput<RegressionOutput> {
        let item = self.regress(b);
        TrainOutput::new(self, item.loss.backward(), item)
    }
}

impl InferenceStep for Reg {
    type Input = Batch;
    type Output = RegressionOutput;
    fn step(&self, b: Batch) -> RegressionOutput {
        self.regress(b)
    }
}

type Item = [f32; 3];

#[derive(Clone, Default)]
struct Rows;

impl Batcher<Item, Batch> for Rows {
    fn batch(&self, items: Vec<Item>, device: &Device) -> Batch {
        let n = items.len();
        let x: Vec<f32> = items.iter().flat_map(|r| r[..2].to_vec()).collect();
        let y: Vec<f32> = items.iter().map(|r| r[2]).collect();
        Batch {
            x: Tensor::<1>::from_floats(x.as_slice(), device).reshape([n, 2]),
            y: Tensor::<1>::from_floats(y.as_slice(), device).reshape([n, 1]),
        }
    }
}

fn rows(n: usize) -> Vec<Item> {
    (0..n)
        .map(|i| {
            let a = (i % 7) as f32 / 7.0;
            let b = (i % 5) as f32 / 5.0;
            [a, b, 0.5 * a - b]
        })
        .collect()
}

/// Panics at its read number `fail_after + 1` (a data error), when set.
struct Failing {
    inner: InMemDataset<Item>,
    fail_after: Option<usize>,
    reads: AtomicUsize,
}

impl Dataset<Item> for Failing {
    fn get(&self, index: usize) -> Result<Item, DatasetError> {
        let read = self.reads.fetch_add(1, Ordering::Relaxed);
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

/// 2 ranks, 3 epochs of 48 items per rank; rank 1's data fails at its read `fail_after + 1`.
fn run(dir: &Path, fail_after: usize) -> Vec<Result<(), DdpError>> {
    let groups = ProcessGroup::local(
        WorldSize::new(2).unwrap(),
        Timeouts::uniform(Duration::from_secs(60)),
    );
    let handles: Vec<_> = groups
        .into_iter()
        .map(|pg| {
            let dir = dir.to_path_buf();
            thread::spawn(move || -> Result<(), DdpError> {
                let rank = pg.rank().0;
                let device = Device::default().autodiff();
                // `with_plan`: `new` would read items for its dataset check, which count
                // towards `fail_after`.
                let train = Arc::new(
                    DistributedSampler::with_plan(
                        Failing {
                            inner: InMemDataset::new(rows(96)),
                            fail_after: (rank == 1).then_some(fail_after),
                            reads: AtomicUsize::new(0),
                        },
                        ShardPlan::new(&pg),
                    )
                    .with_seed(3),
                );
                let valid = Arc::new(
                    DistributedSampler::new(InMemDataset::new(rows(20)), &pg)
                        .with_shuffle(false)
                        .with_even_shards(false),
                );
                let train_loader = DataLoaderBuilder::new(Rows)
                    .batch_size(4)
                    .build(Arc::clone(&train));
                let valid_loader = DataLoaderBuilder::new(Rows)
                    .batch_size(8)
                    .build(Arc::clone(&valid));
                let sync = GradSync::new(pg, DdpConfig::default())?;
                let ddp = DdpStrategy::new(sync, device.clone())
                    .with_sampler(train)
                    .with_sampler(valid);
                let model = Reg {
                    fc: LinearConfig::new(2, 1).init(&device),
                };
                SupervisedTraining::new(
                    dir.join(format!("rank-{rank}")),
                    train_loader,
                    valid_loader,
                )
                .metric_train_numeric(LossMetric::new())
                .metric_valid_numeric(LossMetric::new())
                .num_epochs(3)
                .with_application_logger(None)
                .summary()
                .launch_ddp(Learner::new(model, AdamConfig::new().init(), 1e-2), &ddp)?;
                Ok(())
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "{}-learner-{name}-{}",
        env!("CARGO_PKG_NAME"),
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// Rank 1's data fails at its 11th item of epoch 2, after rank 0 logged steps of it: Burn's
/// summary on rank 0 counts the one completed epoch, where Burn alone counts the highest epoch
/// it finds logs of. The run is a child process of this test binary, whose output (rank 0's
/// progress lines and summary) is read.
#[test]
fn a_run_that_fails_in_epoch_2_is_summarised_as_one_epoch() {
    const NAME: &str = "a_run_that_fails_in_epoch_2_is_summarised_as_one_epoch";
    const CHILD: &str = "BURN_DDP_TEST_SUMMARY_DIR";
    if let Some(dir) = std::env::var_os(CHILD) {
        for (r, res) in run(Path::new(&dir), 48 + 10).into_iter().enumerate() {
            assert!(res.is_err(), "rank {r} did not fail");
        }
        return;
    }
    let dir = scratch("summary");
    let stdout = spawned::rerun_in_child(NAME, CHILD, &dir);
    spawned::assert_summarised_as_one_epoch(&stdout, &dir);
    let _ = std::fs::remove_dir_all(&dir);
}

/// The final weight and bias of each rank after 2 epochs of the strategy on 2 thread ranks,
/// with overlap on or off and with or without accumulation over 2 micro-steps.
fn trained(overlap: bool, accumulation: Option<usize>) -> Vec<Vec<f32>> {
    let groups = ProcessGroup::local(
        WorldSize::new(2).unwrap(),
        Timeouts::uniform(Duration::from_secs(60)),
    );
    let name = format!("overlap-{overlap}-{accumulation:?}");
    let dir = scratch(&name);
    let handles: Vec<_> = groups
        .into_iter()
        .map(|pg| {
            let dir = dir.clone();
            thread::spawn(move || -> Vec<f32> {
                let rank = pg.rank().0;
                let device = Device::default().autodiff();
                let train = Arc::new(
                    DistributedSampler::new(InMemDataset::new(rows(64)), &pg).with_seed(5),
                );
                let valid = Arc::new(
                    DistributedSampler::new(InMemDataset::new(rows(16)), &pg).with_shuffle(false),
                );
                let train_loader = DataLoaderBuilder::new(Rows)
                    .batch_size(4)
                    .build(Arc::clone(&train));
                let valid_loader = DataLoaderBuilder::new(Rows)
                    .batch_size(8)
                    .build(Arc::clone(&valid));
                let config = DdpConfig::default().with_overlap(overlap);
                let sync = GradSync::new(pg, config).unwrap();
                let ddp = DdpStrategy::new(sync, device.clone())
                    .with_sampler(train)
                    .with_sampler(valid);
                // The same start in every run (thread ranks share the device's generator).
                let model = Reg {
                    fc: LinearConfig::new(2, 1)
                        .with_initializer(burn::nn::Initializer::Constant { value: 0.1 })
                        .init(&device),
                };
                let mut training = SupervisedTraining::new(
                    dir.join(format!("rank-{rank}")),
                    train_loader,
                    valid_loader,
                )
                .metric_train_numeric(LossMetric::new())
                .num_epochs(2)
                .with_application_logger(None);
                if let Some(k) = accumulation {
                    training = training.grads_accumulation(k);
                }
                let result = training
                    .launch_ddp(Learner::new(model, AdamConfig::new().init(), 1e-2), &ddp)
                    .unwrap();
                assert_eq!(ddp.sent_during_backward().is_some(), overlap, "overlapped");
                let fc = result.model.fc;
                let values = |data: TensorData| data.convert::<f32>().try_to_vec::<f32>().unwrap();
                let mut all = values(fc.weight.val().into_data());
                all.extend(values(fc.bias.unwrap().val().into_data()));
                all
            })
        })
        .collect();
    let out = handles.into_iter().map(|h| h.join().unwrap()).collect();
    let _ = std::fs::remove_dir_all(&dir);
    out
}

/// The strategy's steps overlapped (the default) train the same model, bit for bit, as after
/// backward, with and without accumulation; every rank ends with it.
#[test]
fn overlapped_steps_train_as_steps_reduced_after_backward() {
    let mut finals = Vec::new();
    for accumulation in [None, Some(2)] {
        let after = trained(false, accumulation);
        let overlapped = trained(true, accumulation);
        assert_eq!(
            after[0], after[1],
            "replicas, after backward, {accumulation:?}"
        );
        assert_eq!(
            overlapped, after,
            "overlapped against after backward, {accumulation:?}"
        );
        finals.push(after);
    }
    // The control: the two schedules train differently (so both trained).
    assert_ne!(finals[0], finals[1]);
}

/// Two layers, a regression: the model of the FSDP runs below, and of their reference.
#[derive(Module, Debug)]
struct Two {
    fc1: Linear,
    fc2: Linear,
}

/// [`Two`] whose forward gathers each layer (`fsdp::gather`, one line per block), for
/// [`DdpStrategy::fsdp`]. (Its own type: `gather` uses the process's last sharding on a
/// thread that made none, and the reference runs on threads of its own.)
#[derive(Module, Debug)]
struct Sharded {
    two: Two,
}

impl Two {
    /// The same start in every run, and no two hidden units alike.
    fn new(device: &Device) -> Self {
        let values = |n: usize, k: f32| -> Vec<f32> {
            (0..n).map(|i| ((i as f32 + 1.0) * k).sin() * 0.5).collect()
        };
        let matrix = |v: Vec<f32>, rows: usize, cols: usize| {
            burn::module::Param::from_tensor(
                Tensor::<1>::from_floats(v.as_slice(), device).reshape([rows, cols]),
            )
        };
        let vector = |v: Vec<f32>| {
            burn::module::Param::from_tensor(Tensor::<1>::from_floats(v.as_slice(), device))
        };
        let linear = |d_in: usize, d_out: usize, k: f32| Linear {
            weight: matrix(values(d_in * d_out, k), d_in, d_out),
            bias: Some(vector(values(d_out, k + 0.3))),
        };
        Two {
            fc1: linear(2, 8, 0.7),
            fc2: linear(8, 1, 1.3),
        }
    }

    fn values(&self) -> Vec<f32> {
        let v = |t: Tensor<2>| t.into_data().convert::<f32>().try_to_vec::<f32>().unwrap();
        let b = |t: Tensor<1>| t.into_data().convert::<f32>().try_to_vec::<f32>().unwrap();
        let mut all = v(self.fc1.weight.val());
        all.extend(b(self.fc1.bias.as_ref().unwrap().val()));
        all.extend(v(self.fc2.weight.val()));
        all.extend(b(self.fc2.bias.as_ref().unwrap().val()));
        all
    }
}

fn regress_two(fc1: &Linear, fc2: &Linear, b: Batch) -> RegressionOutput {
    let out = fc2.forward(burn::tensor::activation::relu(fc1.forward(b.x)));
    let loss = MseLoss::new().forward(out.clone(), b.y.clone(), Reduction::Mean);
    RegressionOutput::new(loss.reshape([1]), out, b.y)
}

impl TrainStep for Two {
    type Input = Batch;
    type Output = RegressionOutput;
    fn step(&self, b: Batch) -> TrainOutput<RegressionOutput> {
        let item = regress_two(&self.fc1, &self.fc2, b);
        TrainOutput::new(self, item.loss.backward(), item)
    }
}

impl InferenceStep for Two {
    type Input = Batch;
    type Output = RegressionOutput;
    fn step(&self, b: Batch) -> RegressionOutput {
        regress_two(&self.fc1, &self.fc2, b)
    }
}

impl TrainStep for Sharded {
    type Input = Batch;
    type Output = RegressionOutput;
    fn step(&self, b: Batch) -> TrainOutput<RegressionOutput> {
        let item = regress_two(&gather(&self.two.fc1), &gather(&self.two.fc2), b);
        TrainOutput::new(self, item.loss.backward(), item)
    }
}

impl InferenceStep for Sharded {
    type Input = Batch;
    type Output = RegressionOutput;
    fn step(&self, b: Batch) -> RegressionOutput {
        regress_two(&gather(&self.two.fc1), &gather(&self.two.fc2), b)
    }
}

/// One Learner run of [`Two`] on `world` thread ranks, each with batches of `batch` (a global
/// batch of `world × batch`), `epochs` epochs over 64 training rows; sharded by FSDP or
/// replicated with DDP; with checkpoints in `checkpoints`, resuming from the newest when
/// `resume`. Each rank's final model, whole.
struct LearnerRun<'a> {
    world: usize,
    batch: usize,
    epochs: usize,
    fsdp: Option<FsdpConfig>,
    checkpoints: Option<&'a Path>,
    resume: bool,
}

impl LearnerRun<'_> {
    fn run(&self) -> Vec<Vec<f32>> {
        let groups = ProcessGroup::local(
            WorldSize::new(self.world as u32).unwrap(),
            Timeouts::uniform(Duration::from_secs(60)),
        );
        let dir = scratch(&format!("two-{}-{:?}", self.world, self.fsdp.is_some()));
        let handles: Vec<_> = groups
            .into_iter()
            .map(|pg| {
                let dir = dir.clone();
                let (batch, epochs, fsdp, resume) =
                    (self.batch, self.epochs, self.fsdp, self.resume);
                let checkpoints = self.checkpoints.map(Path::to_path_buf);
                thread::spawn(move || -> Vec<f32> {
                    let rank = pg.rank().0;
                    let device = Device::default().autodiff().gradient_checkpointing();
                    let train = Arc::new(
                        DistributedSampler::new(InMemDataset::new(rows(64)), &pg).with_seed(5),
                    );
                    let valid = Arc::new(
                        DistributedSampler::new(InMemDataset::new(rows(16)), &pg)
                            .with_shuffle(false),
                    );
                    let train_loader = DataLoaderBuilder::new(Rows)
                        .batch_size(batch)
                        .build(Arc::clone(&train));
                    let valid_loader = DataLoaderBuilder::new(Rows)
                        .batch_size(4)
                        .build(Arc::clone(&valid));
                    let with = |ddp: DdpStrategy| {
                        let ddp = ddp.with_sampler(train).with_sampler(valid);
                        match &checkpoints {
                            Some(c) => ddp.with_checkpoints(c, 5).with_resume(resume),
                            None => ddp,
                        }
                    };
                    let adam = || AdamConfig::new().init();
                    if let Some(config) = fsdp {
                        let fsdp = FullyShard::new(pg, config).unwrap();
                        let ddp = with(DdpStrategy::fsdp(fsdp.clone(), device.clone()).unwrap());
                        let model = fsdp
                            .shard(Sharded {
                                two: Two::new(&device),
                            })
                            .unwrap();
                        return SupervisedTraining::new(
                            dir.join(format!("rank-{rank}")),
                            train_loader,
                            valid_loader,
                        )
                        .metric_train_numeric(LossMetric::new())
                        .metric_valid_numeric(LossMetric::new())
                        .num_epochs(epochs)
                        .with_application_logger(None)
                        .launch_ddp(Learner::new(model, adam(), 1e-2), &ddp)
                        .unwrap()
                        .model
                        .two
                        .values();
                    }
                    let sync = GradSync::new(pg, DdpConfig::default()).unwrap();
                    let ddp = with(DdpStrategy::new(sync, device.clone()));
                    SupervisedTraining::new(
                        dir.join(format!("rank-{rank}")),
                        train_loader,
                        valid_loader,
                    )
                    .metric_train_numeric(LossMetric::new())
                    .metric_valid_numeric(LossMetric::new())
                    .num_epochs(epochs)
                    .with_application_logger(None)
                    .launch_ddp(Learner::new(Two::new(&device), adam(), 1e-2), &ddp)
                    .unwrap()
                    .model
                    .values()
                })
            })
            .collect();
        let out = handles.into_iter().map(|h| h.join().unwrap()).collect();
        let _ = std::fs::remove_dir_all(&dir);
        out
    }
}

/// The Learner over a model sharded by FSDP (`DdpStrategy::fsdp`; fc1's two rows of weights
/// cut one a rank, fc2's bias of one row left whole and averaged) trains as DDP's Learner does
/// on the same ranks, within f32 rounding (the reduce-scatter sums in another order than the
/// all-reduce), with resharding after forward and without; every rank ends with the whole
/// model, the same everywhere.
#[test]
fn the_learner_over_fsdp_shards_trains_as_over_ddp_replicas() {
    let ddp = LearnerRun {
        world: 2,
        batch: 4,
        epochs: 2,
        fsdp: None,
        checkpoints: None,
        resume: false,
    }
    .run();
    assert_eq!(ddp[0], ddp[1], "DDP's replicas");
    assert_ne!(ddp[0], Two::new(&Device::default()).values(), "DDP trained");
    for reshard in [true, false] {
        let fsdp = LearnerRun {
            fsdp: Some(FsdpConfig::default().with_reshard_after_forward(reshard)),
            ..LearnerRun {
                world: 2,
                batch: 4,
                epochs: 2,
                fsdp: None,
                checkpoints: None,
                resume: false,
            }
        }
        .run();
        assert_eq!(
            fsdp[0], fsdp[1],
            "every rank's whole model, reshard {reshard}"
        );
        assert_close(0, &fsdp[0], &ddp[0], F32);
    }
}

/// FSDP's checkpoints are whole records gathered from the shards: 2 ranks train an epoch and
/// write its checkpoint, then 4 ranks (the same global batch) resume from it and train the
/// second (fc1's 2 rows cut over 4 ranks: two of them hold padding), as 2 ranks train both
/// epochs without a checkpoint (the optimizer's state and step count cut and rekeyed with the
/// model's parameters); the whole record loads into a model that is not sharded.
#[test]
fn fsdp_checkpoints_resume_at_another_world_size() {
    let dir = scratch("fsdp-checkpoints");
    let config = Some(FsdpConfig::default());
    let run = |world: usize, batch: usize, epochs: usize, resume: bool| LearnerRun {
        world,
        batch,
        epochs,
        fsdp: config,
        checkpoints: Some(&dir),
        resume,
    };
    let whole = LearnerRun {
        checkpoints: None,
        ..run(2, 4, 2, false)
    }
    .run();
    let first = run(2, 4, 1, false).run();
    // Epoch 1's checkpoint is the whole model, as the ranks ended it: it loads into the model
    // as it is, not sharded.
    let bytes = std::fs::read(dir.join("model-1.bin")).unwrap();
    let bytes = burn_ddp_comm::train::files::unseal(bytes).unwrap();
    let record =
        <burn::store::ModuleRecord as burn::train::checkpoint::Checkpoint>::checkpoint_from_bytes(
            burn::tensor::Bytes::from_bytes_vec(bytes),
        )
        .unwrap();
    let device = Device::default();
    let loaded = (Sharded {
        two: Two::new(&device),
    })
    .try_load_record(record)
    .unwrap();
    assert_eq!(loaded.two.values(), first[0], "the checkpoint of epoch 1");
    assert_ne!(first[0], whole[0], "(epoch 2 trained on)");
    let resumed = run(4, 2, 2, true).run();
    for r in &resumed {
        assert_close(0, r, &whole[0], F32);
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A Learner built with the whole model for `DdpStrategy::fsdp` is refused on every rank,
/// naming a whole parameter and the fix, before any step.
#[test]
fn a_learner_whose_model_fsdp_did_not_shard_is_refused() {
    let groups = ProcessGroup::local(
        WorldSize::new(2).unwrap(),
        Timeouts::uniform(Duration::from_secs(60)),
    );
    let dir = scratch("fsdp-unsharded");
    let handles: Vec<_> = groups
        .into_iter()
        .map(|pg| {
            let dir = dir.clone();
            thread::spawn(move || -> String {
                let rank = pg.rank().0;
                let device = Device::default().autodiff().gradient_checkpointing();
                let train = Arc::new(DistributedSampler::new(InMemDataset::new(rows(16)), &pg));
                let valid = Arc::new(DistributedSampler::new(InMemDataset::new(rows(8)), &pg));
                let fsdp = FullyShard::new(pg, FsdpConfig::default()).unwrap();
                let ddp = DdpStrategy::fsdp(fsdp, device.clone())
                    .unwrap()
                    .with_sampler(train.clone())
                    .with_sampler(valid.clone());
                let model = Sharded {
                    two: Two::new(&device),
                };
                SupervisedTraining::new(
                    dir.join(format!("rank-{rank}")),
                    DataLoaderBuilder::new(Rows).batch_size(4).build(train),
                    DataLoaderBuilder::new(Rows).batch_size(4).build(valid),
                )
                .num_epochs(1)
                .with_application_logger(None)
                .launch_ddp(Learner::new(model, AdamConfig::new().init(), 1e-2), &ddp)
                .map(|_| ())
                .unwrap_err()
                .to_string()
            })
        })
        .collect();
    for (rank, h) in handles.into_iter().enumerate() {
        let e = h.join().unwrap();
        assert!(
            e.contains("`two.fc1.weight` whole") && e.contains("fsdp.shard(model)?"),
            "rank {rank}: {e}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}
