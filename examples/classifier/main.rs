//! Data-parallel training of an image classifier on CPU with burn-ddp.
//!
//! ```text
//! cargo run --release --example classifier                  # 2 ranks, generated shapes
//! cargo run --release --example classifier -- --nproc 3 --epochs 2
//! cargo run --release --example classifier -- --mnist path/to/mnist   # the four IDX files
//! burn-ddp run --nproc-per-node 2 -- target/release/examples/classifier   # same, via the launcher
//! ```
//!
//! Each rank trains on its shard of every epoch (`DistributedSampler`); gradients are averaged
//! during backward (`Autodiff<Ddp<NdArray>>`); loss and accuracy are reduced over all ranks;
//! rank 0 alone prints, logs and writes the checkpoint.

mod data;
mod model;

use std::fs::OpenOptions;
use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

use burn::backend::{Autodiff, NdArray};
use burn::data::dataloader::DataLoaderBuilder;
use burn::data::dataset::Dataset;
use burn::module::AutodiffModule;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::optim::{AdamConfig, GradientsParams, Optimizer};
use burn::prelude::*;
use burn::record::{BinBytesRecorder, FullPrecisionSettings, Recorder};
use burn_ddp::{
    checkpoint, Ddp, DdpConfig, DdpSession, DistributedSampler, ProcessGroup, ReduceOp,
};
use clap::Parser;

use data::ImageBatcher;
use model::Cnn;

type B = Autodiff<Ddp<NdArray>>;
/// The backend of evaluation (no gradients).
type Inner = Ddp<NdArray>;

#[derive(Debug, Parser)]
#[command(about = "Data-parallel image classifier on CPU (burn-ddp example)")]
struct Args {
    /// Ranks to start when not already launched by `burn-ddp run`, torchrun or srun.
    #[arg(long, default_value_t = 2)]
    nproc: u32,
    #[arg(long, default_value_t = 3)]
    epochs: usize,
    /// Images per rank per step (the global batch is this times the number of ranks).
    #[arg(long, default_value_t = 32)]
    batch_size: usize,
    #[arg(long, default_value_t = 2e-3)]
    lr: f64,
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Generated training images (ignored with --mnist).
    #[arg(long, default_value_t = 8000)]
    train_size: usize,
    /// Generated test images (ignored with --mnist).
    #[arg(long, default_value_t = 2000)]
    test_size: usize,
    /// Train on MNIST: a directory with the four uncompressed IDX files.
    #[arg(long)]
    mnist: Option<PathBuf>,
    /// Where rank 0 writes `checkpoint.bin` and `train.log`.
    #[arg(long, default_value = "target/classifier-run")]
    out: PathBuf,
    /// Stop after this many steps (for quick checks).
    #[arg(long)]
    max_steps: Option<usize>,
    /// Print progress every N steps.
    #[arg(long, default_value_t = 25)]
    log_every: usize,
    /// Every rank prints a digest of its final parameters (to check that they agree).
    #[arg(long)]
    print_digest: bool,
}

/// Rank 0's output: the terminal and `train.log`.
struct Log {
    file: Option<std::fs::File>,
}

impl Log {
    fn line(&mut self, text: &str) {
        println!("{text}");
        if let Some(f) = self.file.as_mut() {
            let _ = writeln!(f, "{text}");
        }
    }
}

/// Sums `values` over all ranks.
fn global(pg: &ProcessGroup, values: [f64; 3]) -> Result<[f64; 3], burn_ddp::DdpError> {
    let mut v = values;
    pg.all_reduce(&mut v, ReduceOp::Sum)?;
    Ok(v)
}

fn train(args: &Args, pg: ProcessGroup) -> Result<(), Box<dyn std::error::Error>> {
    let main = pg.is_main();
    let world = pg.world_size().get() as usize;
    let data = match &args.mnist {
        Some(dir) => data::mnist(dir)?,
        None => data::generated(args.train_size, args.test_size, args.seed),
    };
    let mut log = Log { file: None };
    if main {
        std::fs::create_dir_all(&args.out)?;
        let path = args.out.join("train.log");
        log.file = Some(
            OpenOptions::new()
                .create(true)
                .write(true)
                .truncate(true)
                .open(path)?,
        );
        log.line(&format!(
            "{}: {} training / {} test images, {} classes; {world} ranks × batch {} = global batch {}",
            data.name,
            data.train.len(),
            data.test.len(),
            data.classes,
            args.batch_size,
            world * args.batch_size
        ));
    }

    let session = DdpSession::new(pg.clone(), DdpConfig::default())?;
    let device = Default::default();
    <B as Backend>::seed(&device, args.seed);
    // Same architecture everywhere; `prepare` checks it and copies rank 0's weights.
    let mut model = session.prepare(Cnn::<B>::new(data.classes, &device))?;
    let mut optim = AdamConfig::new().init();
    let loss_fn = CrossEntropyLossConfig::new().init(&device);

    let train_set = Arc::new(DistributedSampler::new(data.train, &pg).with_seed(args.seed));
    let test_set = Arc::new(DistributedSampler::new(data.test, &pg).with_shuffle(false));
    let train_loader = DataLoaderBuilder::new(ImageBatcher)
        .batch_size(args.batch_size)
        .build(Arc::clone(&train_set));
    let test_loader = DataLoaderBuilder::<Inner, _, _>::new(ImageBatcher)
        .batch_size(256)
        .build(Arc::clone(&test_set));

    let started = Instant::now();
    let mut step = 0usize;
    let mut test_acc = 0.0;
    'epochs: for epoch in 1..=args.epochs {
        train_set.set_epoch(epoch as u64);
        let batches = train_set.len().div_ceil(args.batch_size);
        let (mut loss_sum, mut correct, mut seen) = (0.0, 0.0, 0.0);
        let epoch_start = Instant::now();
        for (i, batch) in train_loader.iter().enumerate() {
            let n = batch.targets.dims()[0] as f64;
            let logits = model.forward(batch.images);
            let loss = loss_fn.forward(logits.clone(), batch.targets.clone());
            loss_sum += f64::from(loss.clone().into_scalar()) * n;
            correct += f64::from(
                logits
                    .argmax(1)
                    .squeeze::<1>()
                    .equal(batch.targets)
                    .int()
                    .sum()
                    .into_scalar() as i32,
            );
            seen += n;
            let grads = session.backward(loss)?;
            let grads = GradientsParams::from_grads(grads, &model);
            model = optim.step(args.lr, model, grads);
            step += 1;
            let last = i + 1 == batches;
            let stop = args.max_steps.is_some_and(|m| step >= m);
            if (i + 1) % args.log_every == 0 || last || stop {
                let [l, c, s] = global(&pg, [loss_sum, correct, seen])?;
                if main {
                    log.line(&format!(
                        "epoch {epoch}/{} [{:>4}/{batches}] loss {:.4}  train acc {:5.1}%  {:.0} img/s",
                        args.epochs,
                        i + 1,
                        l / s,
                        100.0 * c / s,
                        s / epoch_start.elapsed().as_secs_f64()
                    ));
                }
            }
            if stop {
                break 'epochs;
            }
        }
        test_acc = evaluate(&model.valid(), &test_loader, &test_set, &pg)?;
        if main {
            log.line(&format!(
                "epoch {epoch}: test accuracy {:.2}%",
                100.0 * test_acc
            ));
            checkpoint::save_module(&model, &args.out.join("checkpoint.bin"))?;
        }
    }
    if args.max_steps.is_some() {
        test_acc = evaluate(&model.valid(), &test_loader, &test_set, &pg)?;
        if main {
            checkpoint::save_module(&model, &args.out.join("checkpoint.bin"))?;
        }
    }
    if main {
        log.line(&format!(
            "final test accuracy: {:.2}% ({} steps, {:.1} s, checkpoint in {})",
            100.0 * test_acc,
            step,
            started.elapsed().as_secs_f64(),
            args.out.join("checkpoint.bin").display()
        ));
    }
    if args.print_digest {
        let bytes =
            BinBytesRecorder::<FullPrecisionSettings>::default().record(model.into_record(), ())?;
        let mut h = std::hash::DefaultHasher::new();
        std::hash::Hasher::write(&mut h, &bytes);
        println!("parameter digest: {:016x}", std::hash::Hasher::finish(&h));
    }
    Ok(())
}

/// Accuracy over the whole test set: each rank scores its shard (padding excluded), then the
/// counts are summed over ranks.
fn evaluate(
    model: &Cnn<Inner>,
    loader: &Arc<dyn burn::data::dataloader::DataLoader<Inner, data::Batch<Inner>>>,
    set: &DistributedSampler<burn::data::dataset::InMemDataset<data::Item>>,
    pg: &ProcessGroup,
) -> Result<f64, burn_ddp::DdpError> {
    let (mut correct, mut total) = (0.0, 0.0);
    let mut index = 0;
    for batch in loader.iter() {
        let pred = model.forward(batch.images).argmax(1).squeeze::<1>();
        let hits = pred
            .equal(batch.targets)
            .into_data()
            .to_vec::<bool>()
            .unwrap_or_default();
        for hit in hits {
            if !set.is_padding(index) {
                correct += f64::from(u8::from(hit));
                total += 1.0;
            }
            index += 1;
        }
    }
    let [c, t, _] = global(pg, [correct, total, 0.0])?;
    Ok(if t > 0.0 { c / t } else { 0.0 })
}

fn main() -> ExitCode {
    let args = Args::parse();
    burn_ddp::launch::cli::init_logging();
    match burn_ddp::spawn(args.nproc, |pg| train(&args, pg)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("classifier: {e}");
            ExitCode::FAILURE
        }
    }
}
