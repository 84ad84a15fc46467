//! The "after" of the guide's Burn 0.23 section: `examples/learner_before/burn023.rs` on several processes,
//! changed as the guide says (`tests/gradsync/migration.rs` counts the lines; each changed line is
//! marked `// ddp:`). Every rank trains on its shard of the data with gradients averaged after
//! each backward; rank 0 shows Burn's dashboard, writes the metrics and runs Burn's evaluator,
//! as the single process did.
//!
//! `cargo build --release --example learner_after --no-default-features --features burn-0-23`, then
//! `cargo run --release -p burn-ddp-comm -- run --nproc-per-node 2 -- target/release/examples/learner_after`
//! (or under torchrun or Slurm).

use burn::data::dataloader::batcher::Batcher;
use burn::data::dataloader::{DataLoaderBuilder, Progress};
use burn::data::dataset::InMemDataset;
use burn::nn::loss::{MseLoss, Reduction};
use burn::nn::{Linear, LinearConfig, Relu};
use burn::optim::AdamConfig;
use burn::prelude::*;
use burn::train::logger::TrainingProgressLogger;
use burn::train::metric::LossMetric;
use burn::train::{
    EvaluatorBuilder, InferenceStep, Learner, RegressionOutput, SupervisedTraining, TrainOutput,
    TrainStep,
};
use burn_ddp::train::{DdpStrategy, DdpTraining}; // ddp:
use burn_ddp::{DistributedSampler, ProcessGroup}; // ddp:
use std::io::Write;

const ARTIFACT_DIR: &str = "target/learner023-example";
const FEATURES: usize = 8;

#[derive(Module, Debug)]
pub struct RegressionModel {
    input_layer: Linear,
    output_layer: Linear,
    activation: Relu,
}

impl RegressionModel {
    pub fn new(device: &Device) -> Self {
        Self {
            input_layer: LinearConfig::new(FEATURES, 64).init(device),
            output_layer: LinearConfig::new(64, 1).init(device),
            activation: Relu::new(),
        }
    }

    pub fn forward(&self, input: Tensor<2>) -> Tensor<2> {
        let x = self.activation.forward(self.input_layer.forward(input));
        self.output_layer.forward(x)
    }

    pub fn forward_step(&self, item: HousingBatch) -> RegressionOutput {
        let targets = item.targets.unsqueeze_dim(1);
        let output = self.forward(item.inputs);
        let loss = MseLoss::new().forward(output.clone(), targets.clone(), Reduction::Mean);
        RegressionOutput {
            loss,
            output,
            targets,
        }
    }
}

impl TrainStep for RegressionModel {
    type Input = HousingBatch;
    type Output = RegressionOutput;

    fn step(&self, item: HousingBatch) -> TrainOutput<RegressionOutput> {
        let item = self.forward_step(item);
        TrainOutput::new(self, item.loss.backward(), item)
    }
}

impl InferenceStep for RegressionModel {
    type Input = HousingBatch;
    type Output = RegressionOutput;

    fn step(&self, item: HousingBatch) -> RegressionOutput {
        self.forward_step(item)
    }
}

/// A district: its features (income, age, rooms, ... scaled to about `[-1, 1]`) and its value.
#[derive(Clone, Debug)]
pub struct HousingItem {
    features: [f32; FEATURES],
    value: f32,
}

/// `n` districts from a deterministic sequence: a smooth value of the features plus a ripple.
fn districts(n: usize, offset: usize) -> InMemDataset<HousingItem> {
    let items = (offset..offset + n)
        .map(|i| {
            let t = i as f32 * 0.618_034;
            let features: [f32; FEATURES] =
                std::array::from_fn(|k| ((k as f32 + 1.0) * 1.7 * t).sin());
            let value = 2.0 * features[0] + features[1] * features[2] - 0.5 * features[3]
                + 0.1 * (3.0 * features[4]).sin();
            HousingItem { features, value }
        })
        .collect();
    InMemDataset::new(items)
}

#[derive(Clone, Debug)]
pub struct HousingBatch {
    inputs: Tensor<2>,
    targets: Tensor<1>,
}

#[derive(Clone, Default)]
struct HousingBatcher;

impl Batcher<HousingItem, HousingBatch> for HousingBatcher {
    fn batch(&self, items: Vec<HousingItem>, device: &Device) -> HousingBatch {
        let inputs: Vec<f32> = items.iter().flat_map(|d| d.features).collect();
        let targets: Vec<f32> = items.iter().map(|d| d.value).collect();
        HousingBatch {
            inputs: Tensor::<1>::from_floats(inputs.as_slice(), device)
                .reshape([items.len(), FEATURES]),
            targets: Tensor::from_floats(targets.as_slice(), device),
        }
    }
}

/// Burn's training progress, one line per event, appended to a file (as Burn's examples'
/// progress loggers do), with Burn 0.23's `Progress`.
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
    fn start_split(&mut self, split: &str, progress: &Progress) {
        self.write(format_args!(
            "[Training] split_start  split={split} progress={progress}"
        ));
    }
    fn update_split(&mut self, progress: &Progress) {
        self.write(format_args!("[Training] split_update  progress={progress}"));
    }
    fn end_split(&mut self, progress: &Progress) {
        self.write(format_args!("[Training] split_end  progress={progress}"));
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
    let model = RegressionModel::new(&device);

    let dataloader_train = DataLoaderBuilder::new(HousingBatcher)
        .batch_size(64)
        .build(DistributedSampler::new(districts(2048, 0), &pg)); // ddp:
    let dataloader_valid = DataLoaderBuilder::new(HousingBatcher)
        .batch_size(128)
        .build(DistributedSampler::evaluation(districts(512, 10_000), &pg)); // ddp:

    let training = SupervisedTraining::new(ARTIFACT_DIR, dataloader_train, dataloader_valid)
        .metrics((LossMetric::new(),))
        .with_default_checkpointers()
        .with_progress_logger(
            FileProgressLogger::new(format!("{ARTIFACT_DIR}/training_progress.log"))
                .expect("Failed to create training progress log"),
        )
        .num_epochs(3)
        .summary();
    let ddp = DdpStrategy::for_group(pg, device.clone()).expect("a process group"); // ddp:
    let learner = Learner::new(model, AdamConfig::new().init(), 1e-3);
    let result = training.ddp(&ddp).launch_main(learner); // ddp:
    let result = result.expect("training failed"); // ddp:
    let Some(result) = result else { return }; // ddp: the other ranks are done

    let dataloader_test = DataLoaderBuilder::new(HousingBatcher)
        .batch_size(128)
        .build(districts(512, 20_000));
    let evaluator = EvaluatorBuilder::new(ARTIFACT_DIR)
        .renderer(result.renderer)
        .metrics((LossMetric::new(),))
        .summary()
        .build(result.model);
    let result = evaluator.eval("test", dataloader_test);
    drop(result);
    println!("done: {ARTIFACT_DIR}");
}

pub fn main() {
    run(Device::default().autodiff());
}
