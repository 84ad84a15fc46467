//! The chaos run's long schedule (`burn_ddp_dev::chaos`): fault-tolerant jobs of a Burn line's
//! classifier example under a seeded random schedule of faults, every invariant checked.
//!
//! ```text
//! cargo bench -p burn-ddp-dev --bench chaos                            # 1,200 faults, Burn 0.21 line
//! cargo bench -p burn-ddp-dev --bench chaos -- --line 0.22 --faults 200 --seed 7
//! cargo bench -p burn-ddp-dev --bench chaos -- --etcd --faults 200   # nodes, etcd, link cuts
//! ```
//!
//! It builds the classifier example for that release (the root package's) and the launcher in the release profile first
//! (`--program`/`--launcher` take built ones instead), prints the report, and exits 1 with the
//! failing job's log when an invariant does not hold.

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use std::time::Duration;

use burn_ddp_dev::chaos::{self, Chaos};
use clap::Parser;

#[derive(Debug, Parser)]
#[command(
    about = "burn-ddp's chaos run: a seeded random schedule of faults on fault-tolerant jobs"
)]
struct Args {
    /// The Burn release whose classifier example runs: 0.21, 0.22 or 0.23.
    #[arg(long, default_value = "0.21", value_parser = ["0.21", "0.22", "0.23"])]
    line: String,
    /// Faults to inject in all.
    #[arg(long, default_value_t = 1200)]
    faults: usize,
    /// Stop injecting after this many minutes.
    #[arg(long, default_value_t = 180)]
    minutes: u64,
    /// The schedule's seed (default: the clock's seconds; printed).
    #[arg(long)]
    seed: Option<u64>,
    /// Ranks of each job.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(2..=8))]
    nproc: u32,
    /// Epochs of each job, over this many generated training images (by default a number no
    /// world size of 2 to 4 divides, so that epochs end with a partial step).
    #[arg(long, default_value_t = 6)]
    epochs: u32,
    #[arg(long, default_value_t = 3073)]
    train: u32,
    /// The ranks' failure-detection bound, in seconds.
    #[arg(long, default_value_t = 3)]
    heartbeat: u64,
    /// The bound on every recovery and return to full strength, in seconds.
    #[arg(long, default_value_t = 60)]
    bound: u64,
    /// A built classifier example to run instead of building the line's (a relative path is
    /// taken from the workspace's directory, as the next two).
    #[arg(long)]
    program: Option<PathBuf>,
    /// A built `burn-ddp` launcher to use instead of building it.
    #[arg(long)]
    launcher: Option<PathBuf>,
    /// Where the jobs write (default: a directory under the system's temporary one).
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Each job on as many nodes (network namespaces; root) as ranks, its store on an etcd
    /// cluster of one member per node (Debian's etcd-server), with two more kinds of fault: a
    /// node's link cut, a node lost whole with its etcd member. Builds the program and the
    /// launcher with `etcd` (which needs protoc).
    #[arg(long)]
    etcd: bool,
    /// Passed by `cargo bench`.
    #[arg(long, hide = true)]
    bench: bool,
}

/// The workspace's directory (`cargo bench` runs the bench in its package's).
fn workspace() -> &'static Path {
    let package = Path::new(env!("CARGO_MANIFEST_DIR"));
    package.parent().unwrap_or(package)
}

/// `cargo build --release` of `what` in the workspace: the built file under `target/release`.
fn built(what: &[&str], file: &str) -> Result<PathBuf, String> {
    let workspace = workspace();
    let status = Command::new(env!("CARGO"))
        .args(["build", "--release", "--locked"])
        .args(what)
        .current_dir(workspace)
        .status()
        .map_err(|e| format!("cargo: {e}"))?;
    if !status.success() {
        return Err(format!("cargo build --release {} failed", what.join(" ")));
    }
    // The bench runs as target/release/deps/chaos-<hash>.
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let release = exe
        .parent()
        .and_then(Path::parent)
        .ok_or("the bench is not under target/<profile>/deps")?;
    Ok(release.join(file))
}

fn main() -> ExitCode {
    let args = Args::parse();
    if args.etcd && args.nproc < 3 {
        eprintln!(
            "chaos: --etcd runs one etcd member per rank's node, and a node lost whole must leave \
             a majority of members: give --nproc 3 or more"
        );
        return ExitCode::FAILURE;
    }
    // The root package's classifier, built for the line's release (its features).
    let release = match args.line.as_str() {
        "0.22" => "burn-0-22",
        "0.23" => "burn-0-23",
        _ => "burn-0-21",
    };
    let features = if args.etcd {
        format!("{release},etcd")
    } else {
        release.to_string()
    };
    // Paths given are relative to the workspace, where `cargo bench` is run from.
    let given = |p: &Option<PathBuf>| p.as_ref().map(|p| workspace().join(p));
    let program = match given(&args.program).map(Ok).unwrap_or_else(|| {
        let what = [
            "-p",
            "burn-ddp-workspace",
            "--no-default-features",
            "--features",
            &features,
            "--example",
            "classifier",
        ];
        built(&what, "examples/classifier")
    }) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("chaos: {e}");
            return ExitCode::FAILURE;
        }
    };
    let launcher = match given(&args.launcher).map(Ok).unwrap_or_else(|| {
        let features = if args.etcd { "cli,etcd" } else { "cli" };
        built(
            &[
                "-p",
                "burn-ddp-comm",
                "--features",
                features,
                "--bin",
                "burn-ddp",
            ],
            "burn-ddp",
        )
    }) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("chaos: {e}");
            return ExitCode::FAILURE;
        }
    };
    let seed = args.seed.unwrap_or_else(burn_ddp_dev::chaos::clock_seed);
    let chaos = Chaos {
        program,
        launcher,
        nproc: args.nproc,
        faults: args.faults,
        limit: Duration::from_secs(args.minutes * 60),
        seed,
        epochs: args.epochs,
        train: args.train,
        test: 256,
        heartbeat: Duration::from_secs(args.heartbeat),
        bound: Duration::from_secs(args.bound),
        dir: given(&args.dir).unwrap_or_else(|| {
            std::env::temp_dir().join(format!("burn-ddp-chaos-{}", std::process::id()))
        }),
        etcd: args.etcd,
    };
    eprintln!(
        "chaos: {} faults on {}, seed {seed}, jobs in {}",
        chaos.faults,
        chaos.program.display(),
        chaos.dir.display()
    );
    match chaos::run(&chaos) {
        Ok(report) => {
            print!("{}", report.text(&chaos));
            if report.total() < chaos.faults {
                eprintln!(
                    "chaos: only {} of {} faults within {} minutes",
                    report.total(),
                    chaos.faults,
                    args.minutes
                );
                return ExitCode::FAILURE;
            }
            let _ = std::fs::remove_dir_all(&chaos.dir);
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("chaos (seed {seed}): {e}");
            ExitCode::FAILURE
        }
    }
}
