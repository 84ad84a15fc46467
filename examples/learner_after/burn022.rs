//! The "after" of the guide's Burn 0.22 section: `examples/learner_before/burn022.rs` on several processes,
//! changed as the guide says (`tests/gradsync/migration.rs` counts the lines; each changed line is
//! marked `// ddp:`). Every rank trains on its shard of the data with gradients averaged after
//! each backward; rank 0 shows Burn's dashboard, writes the metrics and runs Burn's evaluator,
//! as the single process did.
//!
//! `cargo build --release --example learner_after --no-default-features --features burn-0-22`, then
//! `cargo run --release -p burn-ddp-comm -- run --nproc-per-node 2 -- target/release/examples/learner_after`
//! (or under torchrun or Slurm).

use burn::data::dataloader::batcher::Batcher;
use burn::data::dataloader::DataLoaderBuilder;
use burn::data::dataset::InMemDataset;
use burn::lr_scheduler::composed::ComposedLrSchedulerConfig;
use burn::lr_scheduler::cosine::CosineAnnealingLrSchedulerConfig;
use burn::lr_scheduler::linear::LinearLrSchedulerConfig;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{Linear, LinearConfig, Relu};
use burn::optim::AdamWConfig;
use burn::prelude::*;
use burn::train::logger::TrainingProgressLogger;
use burn::train::metric::store::{Aggregate, Direction, Split};
use burn::train::metric::{AccuracyMetric, LearningRateMetric, LossMetric};
use burn::train::{
    ClassificationOutput, EvaluatorBuilder, InferenceStep, Learner, MetricEarlyStoppingStrategy,
    StoppingCondition, SupervisedTraining, TrainOutput, TrainStep,
};
use burn_ddp::train::{DdpStrategy, DdpTraining}; // ddp:
use burn_ddp::{DistributedSampler, ProcessGroup}; // ddp:
use std::io::Write;

const ARTIFACT_DIR: &str = "target/learner022-example";

#[derive(Module, Debug)]
pub struct Model {
    hidden: Linear,
    output: Linear,
    activation: Relu,
}

impl Model {
    pub fn new(device: &Device) -> Self {
        Self {
            hidden: LinearConfig::new(2, 32).init(device),
            output: LinearConfig::new(32, 2).init(device),
            activation: Relu::new(),
        }
    }

    pub fn forward_classification(&self, batch: PointBatch) -> ClassificationOutput {
        let hidden = self.activation.forward(self.hidden.forward(batch.points));
        let output = self.output.forward(hidden);
        let loss = CrossEntropyLossConfig::new()
            .init(&output.device())
            .forward(output.clone(), batch.targets.clone());
        ClassificationOutput::new(loss, output, batch.targets)
    }
}

impl TrainStep for Model {
    type Input = PointBatch;
    type Output = ClassificationOutput;

    fn step(&self, batch: PointBatch) -> TrainOutput<ClassificationOutput> {
        let item = self.forward_classification(batch);
        TrainOutput::new(self, item.loss.backward(), item)
    }
}

impl InferenceStep for Model {
    type Input = PointBatch;
    type Output = ClassificationOutput;

    fn step(&self, batch: PointBatch) -> ClassificationOutput {
        self.forward_classification(batch)
    }
}

/// A point in the plane and whether it lies inside the unit circle.
#[derive(Clone, Debug)]
pub struct Point {
    xy: [f32; 2],
    inside: bool,
}

/// `n` points on a deterministic grid-like spiral over `[-1.5, 1.5]²`.
fn points(n: usize, offset: usize) -> InMemDataset<Point> {
    let items = (offset..offset + n)
        .map(|i| {
            let t = i as f32 * 0.618_034;
            let xy = [1.5 * (t * 7.0).sin(), 1.5 * (t * 3.0).cos()];
            let inside = xy[0] * xy[0] + xy[1] * xy[1] < 1.0;
            Point { xy, inside }
        })
        .collect();
    InMemDataset::new(items)
}

#[derive(Clone, Debug)]
pub struct PointBatch {
    points: Tensor<2>,
    targets: Tensor<1, Int>,
}

#[derive(Clone, Default)]
struct PointBatcher;

impl Batcher<Point, PointBatch> for PointBatcher {
    fn batch(&self, items: Vec<Point>, device: &Device) -> PointBatch {
        let xy: Vec<f32> = items.iter().flat_map(|p| p.xy).collect();
        let labels: Vec<i64> = items.iter().map(|p| i64::from(p.inside)).collect();
        PointBatch {
            points: Tensor::<1>::from_floats(xy.as_slice(), device).reshape([items.len(), 2]),
            targets: Tensor::from_ints(labels.as_slice(), device),
        }
    }
}

/// Burn's training progress, one line per event, appended to a file (as Burn's mnist example's
/// progress logger does).
struct FileProgressLogger(std::fs::File);

impl FileProgressLogger {
    fn new(path: impl AsRef<std::path::Path>) -> std::io::Result<Self> {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)?;
        Ok(Self(file))
    }

    fn write(&mut self, line: std::fmt::Arguments<'_>) {
        if let Err(e) = writeln!(self.0, "{line}") {
            eprintln!("training progress log: {e}");
        }
    }
}

impl TrainingProgressLogger for FileProgressLogger {
    fn start(&mut self, epochs: usize, start: usize, _items: Option<usize>, _: Option<&str>) {
        self.write(format_args!(
            "[Training] start  epochs={epochs} starting_epoch={start}"
        ));
    }
    fn update_epoch(&mut self, epoch: usize) {
        self.write(format_args!("[Training] epoch_complete  epoch={epoch}"));
    }
    fn start_split(&mut self, split: &str, total_items: usize) {
        self.write(format_args!(
            "[Training] split_start  split={split} total_items={total_items}"
        ));
    }
    fn update_split(&mut self, items_processed: usize) {
        self.write(format_args!(
            "[Training] split_update  items_processed={items_processed}"
        ));
    }
    fn end_split(&mut self) {
        self.write(format_args!("[Training] split_end"));
    }
    fn end(&mut self) {
        self.write(format_args!("[Training] end"));
    }
    fn log_event_training(&mut self, event: String) {
        self.write(format_args!("[Training] event  {event}"));
    }
}

fn create_artifact_dir(artifact_dir: &str) {
    // Remove existing artifacts before to get an accurate learner summary
    std::fs::remove_dir_all(artifact_dir).ok();
    std::fs::create_dir_all(artifact_dir).ok();
}

pub fn run(device: Device) {
    let pg = ProcessGroup::from_env().expect("joining the job"); // ddp:
    pg.on_main(|| create_artifact_dir(ARTIFACT_DIR)) // ddp:
        .expect("the job"); // ddp:
    device.seed(42);
    let model = Model::new(&device);

    let dataset_train = DistributedSampler::new(points(2048, 0), &pg); // ddp:
    let dataset_valid = points(512, 10_000);
    let dataloader_train = DataLoaderBuilder::new(PointBatcher)
        .batch_size(64)
        .build(dataset_train);
    let dataloader_valid = DataLoaderBuilder::new(PointBatcher)
        .batch_size(128)
        .build(DistributedSampler::evaluation(dataset_valid, &pg)); // ddp:

    let lr_scheduler = ComposedLrSchedulerConfig::new()
        .cosine(CosineAnnealingLrSchedulerConfig::new(1.0, 100))
        // Warmup
        .linear(LinearLrSchedulerConfig::new(1e-8, 1.0, 10))
        .linear(LinearLrSchedulerConfig::new(1e-2, 1e-6, 100));
    let optimizer = AdamWConfig::new()
        .with_cautious_weight_decay(true)
        .with_weight_decay(5e-5);

    let training = SupervisedTraining::new(ARTIFACT_DIR, dataloader_train, dataloader_valid)
        .metrics((AccuracyMetric::new(), LossMetric::new()))
        .metric_train_numeric(LearningRateMetric::new())
        .with_default_checkpointers()
        .early_stopping(MetricEarlyStoppingStrategy::new(
            &LossMetric::new(),
            Aggregate::Mean,
            Direction::Lowest,
            Split::Valid,
            StoppingCondition::NoImprovementSince { n_epochs: 5 },
        ))
        .with_progress_logger(
            FileProgressLogger::new(format!("{ARTIFACT_DIR}/training_progress.log"))
                .expect("Failed to create training progress log"),
        )
        .num_epochs(3)
        .summary();
    let ddp = DdpStrategy::for_group(pg, device.clone()).expect("a process group"); // ddp:
    let result = training.ddp(&ddp).launch_main(Learner::new(
        // ddp:
        model,
        optimizer.init(),
        lr_scheduler.init().unwrap(),
    ));
    let result = result.expect("training failed"); // ddp:
    let Some(result) = result else { return }; // ddp: the other ranks are done

    let dataloader_test = DataLoaderBuilder::new(PointBatcher)
        .batch_size(128)
        .build(points(512, 20_000));
    let evaluator = EvaluatorBuilder::new(ARTIFACT_DIR)
        .renderer(result.renderer)
        .metrics((AccuracyMetric::new(), LossMetric::new()))
        .summary()
        .build(result.model);
    let result = evaluator.eval("test", dataloader_test);
    drop(result);
    println!("done: {ARTIFACT_DIR}");
}

pub fn main() {
    run(Device::default().autodiff());
}
