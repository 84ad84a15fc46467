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
use line::train::{DdpStrategy, DdpTraining};
use line::{
    DdpConfig, DdpError, DistributedSampler, GradSync, ProcessGroup, ShardPlan, Timeouts, WorldSize,
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
