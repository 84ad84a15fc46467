//! The classifier on Burn 0.22.1 or 0.23 (the build's release): Burn's `SupervisedTraining`
//! (the Learner) drives training through burn-ddp's `DdpStrategy`: each rank trains on its shard
//! of every epoch (`DistributedSampler`); after each backward the gradients are averaged across
//! the ranks (`GradSync`); the dashboard on rank 0 (progress lines when its output is not a
//! terminal) shows loss and accuracy of the whole job; rank 0 alone writes the logs, metrics and
//! checkpoints into `--out`. `--resume` continues from the newest complete checkpoint. The same
//! program as the Burn 0.21 one (`../burn021/`), on the same images.

mod model;
use burn_ddp_dev::images;

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use burn::data::dataloader::{DataLoader, DataLoaderBuilder};
use burn::data::dataset::{Dataset, InMemDataset};
use burn::module::{ModuleVisitor, Param};
use burn::optim::AdamConfig;
use burn::prelude::*;
use burn::train::metric::{AccuracyMetric, LossMetric};
use burn::train::{Learner, SupervisedTraining};
use burn_ddp::train::{prepare_output, DdpStrategy, DdpTraining, RunSettings};
use burn_ddp::{DdpConfig, DistributedSampler, GradSync, ProcessGroup, ReduceOp};
use clap::Parser;

use model::{Batch, Cnn, ImageBatcher};

#[derive(Debug, Parser)]
#[command(
    about = ABOUT,
    args_override_self = true
)]
struct Args {
    /// Ranks to start when not already launched by `burn-ddp run`, torchrun or srun.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..))]
    nproc: u32,
    #[arg(long, default_value_t = 3, value_parser = images::at_least_one)]
    epochs: usize,
    /// Images per rank per step (the global batch is this times the number of ranks).
    #[arg(long, default_value_t = 32, value_parser = images::at_least_one)]
    batch_size: usize,
    #[arg(long, default_value_t = 2e-3, value_parser = images::positive)]
    lr: f64,
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Generated training images (ignored with --mnist).
    #[arg(long, default_value_t = 8000, value_parser = images::at_least_one)]
    train_size: usize,
    /// Generated test images (ignored with --mnist).
    #[arg(long, default_value_t = 2000, value_parser = images::at_least_one)]
    test_size: usize,
    /// Train on MNIST: a directory with the four uncompressed IDX files.
    #[arg(long)]
    mnist: Option<PathBuf>,
    /// Rank 0's directory for logs, metrics and checkpoints (`{rank}` is replaced by the rank,
    /// to see what each rank writes).
    #[arg(long, default_value = OUT)]
    out: PathBuf,
    /// Resume from the newest complete checkpoint in `<out>/checkpoint` (without it, a run
    /// starts by clearing `<out>`).
    #[arg(long)]
    resume: bool,
    /// Every rank prints a digest of its final parameters (to check that they agree).
    #[arg(long)]
    print_digest: bool,
    /// Each training step takes at least this many milliseconds (a pause before its batch
    /// when it would be quicker): to watch a run, or to inject a fault mid-epoch on any machine.
    #[arg(long, default_value_t = 0)]
    min_step_ms: u64,
    /// In an elastic job (`burn-ddp run --nnodes MIN:MAX`), scale the learning rate with the
    /// world size: `--lr` is the first round's, each later round trains with
    /// `lr × world / first world` (the linear scaling rule for the changed global batch).
    #[arg(long)]
    scale_lr: bool,
}

#[cfg(feature = "burn-0-22")]
const ABOUT: &str = "Data-parallel image classifier on CPU, Burn 0.22.1 (burn-ddp example)";
#[cfg(feature = "burn-0-23")]
const ABOUT: &str = "Data-parallel image classifier on CPU, Burn 0.23.0-pre.1 (burn-ddp example)";
/// Each release's run in a directory of its own.
#[cfg(feature = "burn-0-22")]
const OUT: &str = "target/classifier022-run";
#[cfg(feature = "burn-0-23")]
const OUT: &str = "target/classifier023-run";

type Failure = Box<dyn std::error::Error + Send + Sync>;

fn train(args: &Args, pg: ProcessGroup) -> Result<(), Failure> {
    let main = pg.is_main();
    let world = pg.world_size().get() as usize;
    let out = PathBuf::from(
        args.out
            .to_string_lossy()
            .replace("{rank}", &pg.rank().to_string()),
    );
    // A fresh run starts in an empty directory; a resumed, restarted or requeued run keeps it
    // (its checkpoints are there). Only the rank that writes there clears it.
    if main || args.out.to_string_lossy().contains("{rank}") {
        prepare_output(
            &out,
            &out.join("checkpoint"),
            args.resume,
            pg.restart_count(),
        )?;
    }
    let (train, test, classes, name) = match &args.mnist {
        Some(dir) => {
            let (train, test) = images::mnist(dir)?;
            (train, test, 10, format!("MNIST from {}", dir.display()))
        }
        None => (
            images::shapes(args.train_size, args.seed),
            images::shapes(args.test_size, args.seed ^ 0x5EED),
            images::SHAPES.len(),
            format!("generated shapes ({})", images::SHAPES.join(", ")),
        ),
    };
    let (train, test) = (InMemDataset::new(train), InMemDataset::new(test));
    images::check_sizes(train.len(), test.len(), world)?;
    if main {
        println!(
            "{name}: {} training / {} test images, {classes} classes; {world} rank{} × batch {} = \
             global batch {}",
            train.len(),
            test.len(),
            if world == 1 { "" } else { "s" },
            args.batch_size,
            world * args.batch_size
        );
    }

    let device = Device::default().autodiff();
    device.seed(args.seed);
    let model = Cnn::new(classes, &device);

    // Training shards: reshuffled every epoch, the same length on every rank. Validation
    // shards: every test image exactly once.
    let train_set = Arc::new(DistributedSampler::new(train, &pg).with_seed(args.seed));
    let test_set = Arc::new(
        DistributedSampler::new(test, &pg)
            .with_shuffle(false)
            .with_even_shards(false),
    );
    let pace = images::Pace::new(Duration::from_millis(args.min_step_ms));
    let train_loader = DataLoaderBuilder::new(ImageBatcher(pace))
        .batch_size(args.batch_size)
        .build(Arc::clone(&train_set));
    let test_loader = DataLoaderBuilder::new(ImageBatcher::default())
        .batch_size(256)
        .build(Arc::clone(&test_set));

    let sync = GradSync::new(pg.clone(), DdpConfig::default())?;
    let ddp = DdpStrategy::new(sync, device)
        .with_sampler(train_set)
        .with_sampler(test_set)
        .with_checkpoints(out.join("checkpoint"), 2)
        .with_resume(args.resume)
        .with_run_settings(run_settings(args));

    // The elastic hook: the per-rank batch stays, so the global batch follows the world size.
    let scaled = burn_ddp::launch::env::linear_scaled_lr(args.lr, world as u32);
    let scaled = scaled.filter(|_| args.scale_lr);
    if let (Some(s), true) = (&scaled, main) {
        println!("{s}");
    }
    let lr = scaled.map_or(args.lr, |s| s.lr);
    let started = Instant::now();
    let result = SupervisedTraining::new(&out, train_loader, Arc::clone(&test_loader))
        .metric_train_numeric(AccuracyMetric::new())
        .metric_valid_numeric(AccuracyMetric::new())
        .metric_train_numeric(LossMetric::new())
        .metric_valid_numeric(LossMetric::new())
        .num_epochs(args.epochs)
        .summary()
        .launch_ddp(Learner::new(model, AdamConfig::new().init(), lr), &ddp)?;
    if let Some(e) = &result.error {
        return Err(format!("training failed: {e}").into());
    }

    // Every rank scores its shard of the test set; in a fault-tolerant job a rank lost meanwhile
    // is survived (the others deal the test set again among themselves and score it again).
    let accuracy = burn_ddp::surviving(&pg, || evaluate(&result.model, &*test_loader, &pg))?;
    // In a fault-tolerant job (`burn-ddp run --fault-tolerant`) rank 0 may have changed.
    if pg.is_main() {
        println!(
            "final test accuracy: {:.2}% ({:.1} s; logs, metrics and checkpoints in {})",
            100.0 * accuracy,
            started.elapsed().as_secs_f64(),
            out.display()
        );
    }
    if args.print_digest {
        println!("parameter digest: {:016x}", digest(&result.model));
    }
    Ok(())
}

/// What makes a checkpoint this run's: a resume with other values is refused. (`--epochs` may
/// change: a finished run can be extended.)
fn run_settings(args: &Args) -> RunSettings {
    let sizes = (args.train_size, args.test_size, args.batch_size);
    images::settings(args.mnist.as_deref(), sizes, args.lr, args.seed)
        .into_iter()
        .fold(RunSettings::new(), |s, (k, v)| s.with(k, v))
        .with("scale-lr", args.scale_lr)
}

/// A hash of the parameters' values, bit for bit, in visit order.
fn digest(model: &Cnn) -> u64 {
    struct Values(std::hash::DefaultHasher);
    impl ModuleVisitor for Values {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let data = param.val().into_data();
            std::hash::Hasher::write(&mut self.0, data.as_bytes());
        }
    }
    let mut v = Values(std::hash::DefaultHasher::new());
    model.visit(&mut v);
    std::hash::Hasher::finish(&v.0)
}

/// Accuracy over the whole test set: each rank scores its shard, the counts are summed.
fn evaluate(
    model: &Cnn,
    loader: &dyn DataLoader<Batch>,
    pg: &ProcessGroup,
) -> Result<f64, Failure> {
    let mut counts = [0.0f64; 2];
    for batch in loader.iter() {
        let batch = batch?;
        let n = batch.targets.dims()[0];
        let hits: i64 = model
            .forward(batch.images)
            .argmax(1)
            .flatten::<1>(0, 1)
            .equal(batch.targets)
            .int()
            .sum()
            .into_scalar();
        counts[0] += hits as f64;
        counts[1] += n as f64;
    }
    pg.all_reduce(&mut counts, ReduceOp::Sum)?;
    Ok(if counts[1] > 0.0 {
        counts[0] / counts[1]
    } else {
        0.0
    })
}

/// burn-ddp's warnings and errors on stderr, and what a run resumes (`RUST_LOG=info` shows
/// more); colours only on a terminal.
fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| {
        tracing_subscriber::EnvFilter::new("warn,burn_ddp_comm::train::run=info")
    });
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr)
        .with_target(false)
        .try_init();
}

pub fn main() -> ExitCode {
    let args = Args::parse();
    init_logging();
    match burn_ddp::spawn(args.nproc, |pg| train(&args, pg)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("classifier: {e}");
            ExitCode::FAILURE
        }
    }
}
