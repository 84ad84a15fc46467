//! The "before" of `docs/guide.md`: a Burn program shaped like Burn's own examples
//! (`examples/mnist`): generic over the backend, trained with Burn's Learner and dashboard, then
//! evaluated by Burn's evaluator, all in one directory it starts by clearing.
//! `examples/learner_after/burn021.rs` is the same program on several processes;
//! `tests/burn021/migration.rs` counts the lines between the two.
//!
//! It runs as it is: `cargo run --release --example learner_before`. (Its `main` uses
//! `Autodiff<Ddp<NdArray>>` where Burn's examples use `Autodiff<NdArray>`: with burn-ddp in the
//! build, Burn's `distributed` feature is on and the plain type no longer compiles; without a
//! `DdpSession` the two train identically. That is step 1 of the guide.)

use burn::backend::{Autodiff, NdArray};
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
use burn::record::CompactRecorder;
use burn::tensor::backend::AutodiffBackend;
use burn::train::metric::store::{Aggregate, Direction, Split};
use burn::train::metric::{AccuracyMetric, LearningRateMetric, LossMetric};
use burn::train::{
    ClassificationOutput, EvaluatorBuilder, InferenceStep, Learner, MetricEarlyStoppingStrategy,
    StoppingCondition, SupervisedTraining, TrainOutput, TrainStep,
};
use burn_ddp::Ddp;

const ARTIFACT_DIR: &str = "target/learner-example";

#[derive(Module, Debug)]
pub struct Model<B: Backend> {
    hidden: Linear<B>,
    output: Linear<B>,
    activation: Relu,
}

impl<B: Backend> Model<B> {
    pub fn new(device: &B::Device) -> Self {
        Self {
            hidden: LinearConfig::new(2, 32).init(device),
            output: LinearConfig::new(32, 2).init(device),
            activation: Relu::new(),
        }
    }

    pub fn forward_classification(&self, batch: PointBatch<B>) -> ClassificationOutput<B> {
        let hidden = self.activation.forward(self.hidden.forward(batch.points));
        let output = self.output.forward(hidden);
        let loss = CrossEntropyLossConfig::new()
            .init(&output.device())
            .forward(output.clone(), batch.targets.clone());
        ClassificationOutput::new(loss, output, batch.targets)
    }
}

impl<B: AutodiffBackend> TrainStep for Model<B> {
    type Input = PointBatch<B>;
    type Output = ClassificationOutput<B>;

    fn step(&self, batch: PointBatch<B>) -> TrainOutput<ClassificationOutput<B>> {
        let item = self.forward_classification(batch);
        TrainOutput::new(self, item.loss.backward(), item)
    }
}

impl<B: Backend> InferenceStep for Model<B> {
    type Input = PointBatch<B>;
    type Output = ClassificationOutput<B>;

    fn step(&self, batch: PointBatch<B>) -> ClassificationOutput<B> {
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
pub struct PointBatch<B: Backend> {
    points: Tensor<B, 2>,
    targets: Tensor<B, 1, Int>,
}

#[derive(Clone, Default)]
struct PointBatcher;

impl<B: Backend> Batcher<B, Point, PointBatch<B>> for PointBatcher {
    fn batch(&self, items: Vec<Point>, device: &B::Device) -> PointBatch<B> {
        let xy: Vec<f32> = items.iter().flat_map(|p| p.xy).collect();
        let labels: Vec<i64> = items.iter().map(|p| i64::from(p.inside)).collect();
        PointBatch {
            points: Tensor::<B, 1>::from_floats(xy.as_slice(), device).reshape([items.len(), 2]),
            targets: Tensor::from_ints(labels.as_slice(), device),
        }
    }
}

fn create_artifact_dir(artifact_dir: &str) {
    // Remove existing artifacts before to get an accurate learner summary
    std::fs::remove_dir_all(artifact_dir).ok();
    std::fs::create_dir_all(artifact_dir).ok();
}

pub fn run<B: AutodiffBackend>(device: B::Device) {
    create_artifact_dir(ARTIFACT_DIR);
    B::seed(&device, 42);
    let model = Model::<B>::new(&device);

    let dataset_train = points(2048, 0);
    let dataset_valid = points(512, 10_000);
    let dataloader_train = DataLoaderBuilder::new(PointBatcher)
        .batch_size(64)
        .shuffle(42)
        .build(dataset_train);
    let dataloader_valid = DataLoaderBuilder::new(PointBatcher)
        .batch_size(128)
        .build(dataset_valid);

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
        .with_file_checkpointer(CompactRecorder::new())
        .early_stopping(MetricEarlyStoppingStrategy::new(
            &LossMetric::<B>::new(),
            Aggregate::Mean,
            Direction::Lowest,
            Split::Valid,
            StoppingCondition::NoImprovementSince { n_epochs: 5 },
        ))
        .num_epochs(3)
        .summary();
    let result = training.launch(Learner::new(
        model,
        optimizer.init(),
        lr_scheduler.init().unwrap(),
    ));

    let dataloader_test = DataLoaderBuilder::new(PointBatcher)
        .batch_size(128)
        .build(points(512, 20_000));
    let evaluator = EvaluatorBuilder::new(ARTIFACT_DIR)
        .renderer(result.renderer)
        .metrics((AccuracyMetric::new(), LossMetric::new()))
        .summary()
        .build(result.model);
    let renderer = evaluator.eval("test", dataloader_test);
    drop(renderer);
    println!("done: {ARTIFACT_DIR}");
}

pub fn main() {
    run::<Autodiff<Ddp<NdArray>>>(Default::default());
}
