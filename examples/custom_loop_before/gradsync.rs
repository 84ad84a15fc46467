//! The "before" of the guide's training-loop migration for Burn 0.22 and 0.23 (section 5): a
//! training loop of its own, shaped like Burn's own custom-loop examples (a config holding the
//! model's config and Adam's, the model built from its config, data generated in the program
//! with `rand`, a training and a validation loader, the epoch's loss and accuracy printed after
//! each pass, validation on `model.valid()`, the model saved at the end).
//! `examples/custom_loop_after/gradsync.rs` is the same program on several processes;
//! `tests/gradsync/custom_loop.rs` counts the lines between the two and runs the result on 2
//! ranks. The same source builds on Burn 0.22.1 and 0.23.0-pre.1.
//!
//! It runs as it is: `cargo run --release --example custom_loop_before --no-default-features --features burn-0-22`
//! (or `burn-0-23`).

use burn::data::dataloader::batcher::Batcher;
use burn::data::dataloader::DataLoaderBuilder;
use burn::data::dataset::InMemDataset;
use burn::nn::loss::CrossEntropyLoss;
use burn::nn::{Linear, LinearConfig, Relu};
use burn::optim::{AdamConfig, GradientsParams};
use burn::prelude::*;
use rand::prelude::*;

#[derive(Config, Debug)]
pub struct TrainingConfig {
    #[config(default = 4)]
    pub num_epochs: usize,
    #[config(default = 64)]
    pub batch_size: usize,
    #[config(default = 2)]
    pub num_workers: usize,
    #[config(default = 42)]
    pub seed: u64,
    #[config(default = 1e-2)]
    pub lr: f64,
    pub model: ModelConfig,
    pub optimizer: AdamConfig,
}

#[derive(Config, Debug)]
pub struct ModelConfig {
    #[config(default = 32)]
    hidden_size: usize,
}

impl ModelConfig {
    pub fn init(&self, device: &Device) -> Model {
        Model {
            hidden: LinearConfig::new(2, self.hidden_size).init(device),
            output: LinearConfig::new(self.hidden_size, 2).init(device),
            activation: Relu::new(),
        }
    }
}

#[derive(Module, Debug)]
pub struct Model {
    hidden: Linear,
    output: Linear,
    activation: Relu,
}

impl Model {
    pub fn forward(&self, points: Tensor<2>) -> Tensor<2> {
        let hidden = self.activation.forward(self.hidden.forward(points));
        self.output.forward(hidden)
    }
}

/// A point in the plane and whether it lies inside the unit circle.
#[derive(Clone, Debug)]
pub struct Point {
    xy: [f32; 2],
    inside: bool,
}

/// `n` points drawn uniformly from `[-1.5, 1.5]²`.
fn points(n: usize, rng: &mut impl Rng) -> InMemDataset<Point> {
    let items = (0..n)
        .map(|_| {
            let xy = [rng.random_range(-1.5..1.5), rng.random_range(-1.5..1.5)];
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

/// The loss summed over a batch's items, its correct predictions, and its items.
fn score(output: Tensor<2>, targets: Tensor<1, Int>, loss: &Tensor<1>) -> [f64; 3] {
    let items = targets.dims()[0] as f64;
    let predictions = output.argmax(1).squeeze_dim(1);
    let correct = predictions.equal(targets).int().sum().into_scalar::<i64>() as f64;
    [loss.clone().into_scalar::<f64>() * items, correct, items]
}

pub fn run(device: Device, artifact_dir: &str) {
    let config = TrainingConfig::new(ModelConfig::new(), AdamConfig::new());
    let device = device.autodiff();
    device.seed(config.seed);
    let mut rng = rand::rng();

    // Create the model and optimizer.
    let mut model = config.model.init(&device);
    let mut optim = config.optimizer.init();

    // Create the datasets and dataloaders.
    let dataset_train = points(2048, &mut rng);
    let dataset_valid = points(512, &mut rng);
    let dataloader_train = DataLoaderBuilder::new(PointBatcher)
        .batch_size(config.batch_size)
        .shuffle(config.seed)
        .num_workers(config.num_workers)
        .build(dataset_train);
    let dataloader_valid = DataLoaderBuilder::new(PointBatcher)
        .batch_size(config.batch_size)
        .num_workers(config.num_workers)
        .build(dataset_valid);

    for epoch in 1..config.num_epochs + 1 {
        let mut train = [0.0; 3];
        for batch in dataloader_train.iter().map(Result::unwrap) {
            let output = model.forward(batch.points);
            let loss = CrossEntropyLoss::new(None, &output.device())
                .forward(output.clone(), batch.targets.clone());
            let scored = score(output, batch.targets, &loss);
            train.iter_mut().zip(scored).for_each(|(sum, x)| *sum += x);
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            model = optim.step(config.lr, model, grads);
        }
        let [loss, correct, items] = train;
        println!(
            "[Train - Epoch {epoch}] Loss {:.3} | Accuracy {:.3} % of {items} points",
            loss / items,
            100.0 * correct / items,
        );

        // Get the model without autodiff.
        let model_valid = model.valid();
        let mut valid = [0.0; 3];
        for batch in dataloader_valid.iter().map(Result::unwrap) {
            let output = model_valid.forward(batch.points);
            let loss = CrossEntropyLoss::new(None, &output.device())
                .forward(output.clone(), batch.targets.clone());
            let scored = score(output, batch.targets, &loss);
            valid.iter_mut().zip(scored).for_each(|(sum, x)| *sum += x);
        }
        let [loss, correct, items] = valid;
        println!(
            "[Valid - Epoch {epoch}] Loss {:.3} | Accuracy {:.3} % of {items} points",
            loss / items,
            100.0 * correct / items,
        );
    }

    std::fs::create_dir_all(artifact_dir).expect("the artifact directory can be created");
    model
        .save_file(format!("{artifact_dir}/model.bpk"))
        .expect("Trained model should be saved successfully");
}

pub fn main() {
    run(Device::default(), "artifacts");
}
