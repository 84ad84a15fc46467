//! The "after" of the guide's training-loop migration (section 2): `custom_loop_before.rs` on
//! several processes, changed as the guide says (each changed line is marked `// ddp:`;
//! `tests/burn021/custom_loop.rs` counts them). Every rank trains on its shard of
//! the data with the gradients averaged over the ranks during backward; rank 0 alone prints the
//! job's training loss and accuracy (the ranks' sums added) and its validation of the whole
//! validation set, and saves the model.
//!
//! `cargo build --release --example custom_loop_after`, then
//! `cargo run --release -p burn-ddp-comm -- run --nproc-per-node 2 -- target/release/examples/custom_loop_after`.

use burn::backend::{Autodiff, NdArray};
use burn::data::dataloader::batcher::Batcher;
use burn::data::dataloader::DataLoaderBuilder;
use burn::data::dataset::InMemDataset;
use burn::module::AutodiffModule;
use burn::nn::loss::CrossEntropyLoss;
use burn::nn::{Linear, LinearConfig, Relu};
use burn::optim::{AdamConfig, Optimizer}; // ddp:
use burn::prelude::*;
use burn::record::CompactRecorder;
use burn_ddp::{main_println, Ddp, DdpAutodiffBackend, DdpSession, DistributedSampler}; // ddp:

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
    pub fn init<B: Backend>(&self, device: &B::Device) -> Model<B> {
        Model {
            hidden: LinearConfig::new(2, self.hidden_size).init(device),
            output: LinearConfig::new(self.hidden_size, 2).init(device),
            activation: Relu::new(),
        }
    }
}

#[derive(Module, Debug)]
pub struct Model<B: Backend> {
    hidden: Linear<B>,
    output: Linear<B>,
    activation: Relu,
}

impl<B: Backend> Model<B> {
    pub fn forward(&self, points: Tensor<B, 2>) -> Tensor<B, 2> {
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

/// `n` points on a deterministic spiral over `[-1.5, 1.5]²`.
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

/// The loss summed over a batch's items, its correct predictions, and its items.
fn score<B: Backend>(
    output: Tensor<B, 2>,
    targets: Tensor<B, 1, Int>,
    loss: &Tensor<B, 1>,
) -> [f64; 3] {
    let items = targets.dims()[0] as f64;
    let predictions = output.argmax(1).squeeze_dim(1);
    let correct: f64 = predictions.equal(targets).int().sum().into_scalar().elem();
    let loss: f64 = loss.clone().into_scalar().elem();
    [loss * items, correct, items]
}

pub fn run<B: DdpAutodiffBackend>(device: B::Device, artifact_dir: &str) {
    // ddp:
    let config = TrainingConfig::new(ModelConfig::new(), AdamConfig::new());
    B::seed(&device, config.seed);
    let session = DdpSession::from_env().expect("joining the job"); // ddp:

    // Create the model and optimizer.
    let mut model = config.model.init::<B>(&device);
    model = session.prepare(model).expect("preparing the model"); // ddp:
    let mut optim = config.optimizer.init();

    // Create the datasets and dataloaders.
    let dataset_train = points(2048, 0);
    let dataset_valid = points(512, 10_000);
    let dataloader_train = DataLoaderBuilder::new(PointBatcher)
        .batch_size(config.batch_size)
        .num_workers(config.num_workers)
        .build(DistributedSampler::new(dataset_train, session.group())); // ddp:
    let dataloader_valid = DataLoaderBuilder::<B::InnerBackend, _, _>::new(PointBatcher)
        .batch_size(config.batch_size)
        .num_workers(config.num_workers)
        .build(dataset_valid);

    for epoch in 1..config.num_epochs + 1 {
        session.set_epoch(epoch); // ddp:
        let mut train = [0.0; 3];
        for batch in dataloader_train.iter() {
            let output = model.forward(batch.points);
            let loss = CrossEntropyLoss::new(None, &output.device())
                .forward(output.clone(), batch.targets.clone());
            let scored = score(output, batch.targets, &loss);
            train.iter_mut().zip(scored).for_each(|(sum, x)| *sum += x);
            let grads = session.gradients(&model, loss).expect("gradients"); // ddp:
            model = optim.step(config.lr, model, grads);
        }
        let [loss, correct, items] = session.group().sum(train).expect("the job's sums"); // ddp:
        main_println!(
            // ddp:
            "[Train - Epoch {epoch}] Loss {:.3} | Accuracy {:.3} % of {items} points",
            loss / items,
            100.0 * correct / items,
        );

        // Get the model without autodiff.
        let model_valid = model.valid();
        let mut valid = [0.0; 3];
        for batch in dataloader_valid.iter() {
            let output = model_valid.forward(batch.points);
            let loss = CrossEntropyLoss::new(None, &output.device())
                .forward(output.clone(), batch.targets.clone());
            let scored = score(output, batch.targets, &loss);
            valid.iter_mut().zip(scored).for_each(|(sum, x)| *sum += x);
        }
        let [loss, correct, items] = valid;
        main_println!(
            // ddp:
            "[Valid - Epoch {epoch}] Loss {:.3} | Accuracy {:.3} % of {items} points",
            loss / items,
            100.0 * correct / items,
        );
    }

    if !session.is_main() {
        // ddp:
        return; // ddp:
    } // ddp:
    model
        .save_file(format!("{artifact_dir}/model"), &CompactRecorder::new())
        .expect("Trained model should be saved successfully");
}

pub fn main() {
    run::<Autodiff<Ddp<NdArray>>>(Default::default(), "artifacts");
}
