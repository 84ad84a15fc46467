//! Step-time benchmarks of the `Ddp<B>` decorator and its reducer, each a ratio against a
//! baseline measured in the same run, interleaved round by round:
//!
//! - `overhead`: `Autodiff<Ddp<NdArray>>` at world size 1 vs plain `Autodiff<NdArray>` (built by
//!   `benches/plain-autodiff` without Burn's `distributed` feature);
//! - `buckets`: 2 ranks, 200 parameters of 4 KiB: bucketed sync vs one all-reduce per parameter
//!   (how Burn's own DDP synchronises), each against the same steps with no sync at all;
//! - `scaling`: weak scaling, 2 ranks × 1 thread (over TCP, and over shared memory with the
//!   buckets in it and on the heap) vs 1 rank × 1 thread, same batch per rank;
//! - `lines` (feature `lines`, which builds Burn 0.22.1 too): 2 ranks, the MLP: the sync cost
//!   (step minus the no-sync step) of the Burn 0.22.1 line (`GradSync` on Flex) and of the 0.21
//!   line (`Autodiff<Ddp<NdArray>>`), each after backward and overlapped with it, each against
//!   its own no-sync steps, and the share of the after-backward cost that overlap hides; with
//!   `BURN_DDP_BENCH_LINK_MBIT=N` (root, iproute2), in a network namespace whose loopback is
//!   limited to N Mbit/s, the ranks over TCP, as between nodes; with feature `lines-023` instead,
//!   the same with that side built for Burn 0.23.0-pre.1 (one build serves one 0.22/0.23
//!   release);
//! - `memory`: 2 ranks, 16 linear layers of 1024 × 1024 (67 MB of f32 parameters): the peak
//!   resident memory of a process that trains 3 SGD steps with the default reducer and with
//!   `gradient_as_bucket_view`, against the same steps without synchronisation (a fresh
//!   process per run, since a peak only grows); with `lines`, the same for the Burn 0.22.1
//!   line's `GradSync` on Flex against its own unsynchronised steps;
//! - `zero` (not in the default set): Adam on the `memory` model, DDP vs ZeRO-1 vs ZeRO-2 vs
//!   FSDP at 1, 2 and 4 ranks (with `lines`, on both lines): rank 0's parameters, the gradients
//!   its optimizer is handed and its optimizer state (counted), its peak resident memory, and
//!   the step time.
//!
//! ```text
//! cargo bench --bench ddp_step                       # all but `lines`
//! cargo bench --features lines --bench ddp_step      # all five
//! cargo bench --bench ddp_step -- overhead --rounds 9
//! ```
//! Every process runs one compute thread (`RAYON_NUM_THREADS=1`, `OMP_NUM_THREADS=1`).

// The Burn 0.21 line is the package `burn-ddp-burn021` here; a program of yours reaches it as
// `burn_ddp` (the `burn-ddp` crate with feature `burn-0-21`), and so does this one.
extern crate burn_ddp_burn021 as burn_ddp;

use burn_ddp_dev::args::{self, median};
#[cfg(any(feature = "lines", feature = "lines-023"))]
mod step_model_022;

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

use burn::backend::{Autodiff, NdArray};
use burn::module::AutodiffModule;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::Tensor;
use burn_ddp::launch::spawn::{self, LocalJob, Output};
use burn_ddp::{Ddp, DdpConfig, DdpSession, ProcessGroup};

use burn_ddp_step_model::{print_result, time_steps, Trainer, Which, RESULT_TAG};

type B = Autodiff<Ddp<NdArray>>;

/// Set in worker processes: what to run (`overhead`, `buckets` or `scaling`).
const WORKER: &str = "BURN_DDP_BENCH_WORKER";
const WARMUP: usize = 5;

// ---------------------------------------------------------------- workers

struct DdpTrainer {
    session: DdpSession,
    sync: bool,
}

impl Trainer<B> for DdpTrainer {
    fn prepare<M: AutodiffModule<B>>(&mut self, model: M) -> M {
        self.session.prepare(model).expect("prepare")
    }
    fn backward(&mut self, loss: Tensor<B, 1>) -> <B as AutodiffBackend>::Gradients {
        if self.sync {
            self.session.backward(loss).expect("synchronised backward")
        } else {
            let _local = self.session.no_sync();
            loss.backward()
        }
    }
}

fn worker_steps(pg: &ProcessGroup, config: DdpConfig, sync: bool, spec: &Spec) -> Vec<f64> {
    let session = DdpSession::new(pg.clone(), config).expect("session");
    let mut trainer = DdpTrainer { session, sync };
    time_steps::<B>(spec.which, spec.batch, WARMUP, spec.steps, &mut trainer)
}

/// One all-reduce per parameter: every bucket holds one 4 KiB gradient.
fn per_parameter() -> DdpConfig {
    DdpConfig {
        bucket_cap_bytes: 4,
        first_bucket_cap_bytes: 4,
        ..DdpConfig::default()
    }
}

fn worker(kind: &str, spec: &Spec) -> anyhow::Result<()> {
    let pg = if std::env::var_os("RANK").is_some() {
        ProcessGroup::from_env()?
    } else {
        ProcessGroup::single()
    };
    let report = |label: &str, t: &[f64]| {
        if pg.is_main() {
            print_result(label, t);
        }
    };
    match kind {
        "overhead" | "scaling" => {
            let shared = std::env::var_os(HEAP_BUCKETS).is_none();
            // (`overhead` runs at world size 1, where buckets never leave the heap.)
            let config = DdpConfig::default().with_shared_buckets(shared);
            report("ddp", &worker_steps(&pg, config, true, spec));
        }
        "buckets" => {
            for _ in 0..spec.rounds {
                report(
                    "local",
                    &worker_steps(&pg, DdpConfig::default(), false, spec),
                );
                report(
                    "bucketed",
                    &worker_steps(&pg, DdpConfig::default(), true, spec),
                );
                report("per-param", &worker_steps(&pg, per_parameter(), true, spec));
            }
        }
        #[cfg(any(feature = "lines", feature = "lines-023"))]
        "lines" => {
            use step_model_022::Sync022;
            for round in 0..spec.rounds {
                // Alternate the order so drift in the machine's speed hits every side alike.
                let run_022 = |label: &str, how: Sync022| {
                    let t =
                        step_model_022::time_steps_022(&pg, how, spec.batch, WARMUP, spec.steps);
                    report(label, &t);
                };
                let run_021 = |label: &str, sync: Option<bool>| {
                    let config = DdpConfig::default().with_overlap(sync.unwrap_or(true));
                    report(label, &worker_steps(&pg, config, sync.is_some(), spec));
                };
                let sides: [&dyn Fn(); 6] = [
                    &|| run_021("local-021", None),
                    &|| run_021("after-021", Some(false)),
                    &|| run_021("overlap-021", Some(true)),
                    &|| run_022("local-022", Sync022::Local),
                    &|| run_022("after-022", Sync022::After),
                    &|| run_022("overlap-022", Sync022::Overlapped),
                ];
                for k in 0..sides.len() {
                    sides[(round + k) % sides.len()]();
                }
            }
        }
        "memory-local" => report("peak", &[memory_run(&pg, DdpConfig::default(), false)?]),
        "memory-sync" => report("peak", &[memory_run(&pg, DdpConfig::default(), true)?]),
        "memory-view" => report(
            "peak",
            &[memory_run(
                &pg,
                DdpConfig::default().with_gradient_as_bucket_view(true),
                true,
            )?],
        ),
        #[cfg(any(feature = "lines", feature = "lines-023"))]
        "memory-022-local" => report("peak", &[step_model_022::memory_run_022(&pg, false)?]),
        #[cfg(any(feature = "lines", feature = "lines-023"))]
        "memory-022-sync" => report("peak", &[step_model_022::memory_run_022(&pg, true)?]),
        zero if zero.starts_with("zero-") => {
            // `zero-<line>-<stage>`: stage 0 is DDP with the whole optimizer.
            let stage: u8 = zero[zero.len() - 1..].parse()?;
            let run = match &zero[5..8] {
                "021" => zero_run(&pg, stage)?,
                #[cfg(any(feature = "lines", feature = "lines-023"))]
                "022" => step_model_022::zero_run_022(&pg, stage)?,
                other => anyhow::bail!("no line {other} in this build"),
            };
            report("peak", &[peak_mib()?]);
            report("params", &[run.param_bytes as f64]);
            report("grads", &[run.grad_bytes as f64]);
            report("state", &[run.state_bytes as f64]);
            report("step", &run.step_s);
        }
        other => anyhow::bail!("unknown worker kind {other}"),
    }
    Ok(())
}

/// The `memory` model: 16 linear layers of 1024 × 1024 (67 MB of f32 parameters).
#[derive(burn::module::Module, Debug)]
struct Wide<B: burn::tensor::backend::Backend> {
    layers: Vec<burn::nn::Linear<B>>,
}

impl<Bk: burn_ddp::fsdp::FsdpBackend> Wide<Bk> {
    fn new(device: &<Bk as burn::tensor::backend::BackendTypes>::Device) -> Self {
        Self {
            layers: (0..16)
                .map(|_| burn::nn::LinearConfig::new(1024, 1024).init(device))
                .collect(),
        }
    }

    /// The loss of a step on a fresh batch of 8 rows.
    /// Each layer through `fsdp::gather` (the layer itself outside an FSDP run).
    fn loss(&self, device: &<Bk as burn::tensor::backend::BackendTypes>::Device) -> Tensor<Bk, 1> {
        let x = Tensor::<Bk, 2>::random([8, 1024], burn::tensor::Distribution::Default, device);
        self.layers
            .iter()
            .fold(x, |h, l| burn_ddp::fsdp::gather(l).forward(h).tanh())
            .mean()
    }
}

/// Trains `Wide` for 3 SGD steps (synchronised or not) and returns this process's peak
/// resident memory, in MiB (`VmHWM`).
fn memory_run(pg: &ProcessGroup, config: DdpConfig, sync: bool) -> anyhow::Result<f64> {
    use burn::optim::{GradientsParams, Optimizer, SgdConfig};
    let device = Default::default();
    let session = DdpSession::new(pg.clone(), config)?;
    let mut model = session.prepare(Wide::<B>::new(&device))?;
    let mut optim = SgdConfig::new().init();
    for _ in 0..3 {
        let loss = model.loss(&device);
        let grads = if sync {
            session.gradients(&model, loss)?
        } else {
            let _local = session.no_sync();
            GradientsParams::from_grads(loss.backward(), &model)
        };
        model = optim.step(1e-3, model, grads);
    }
    peak_mib()
}

/// What one rank of a `zero` run holds and takes: the bytes of the gradients its optimizer is
/// handed after synchronisation and of its optimizer's state (its record), after the last step,
/// and the wall time of each timed step.
struct ZeroRun {
    param_bytes: usize,
    grad_bytes: usize,
    state_bytes: usize,
    step_s: Vec<f64>,
}

/// Steps of a `zero` run (the first one untimed: the optimizer's state is made there).
const ZERO_STEPS: usize = 4;

/// Trains `Wide` with Adam for [`ZERO_STEPS`] overlapped steps: DDP with the whole optimizer on
/// every rank (`stage` 0), ZeRO-1 (1), ZeRO-2 (2) or FSDP (3, [`fsdp_run`]).
fn zero_run(pg: &ProcessGroup, stage: u8) -> anyhow::Result<ZeroRun> {
    if stage == 3 {
        return fsdp_run(pg);
    }
    use burn::module::{Module, ModuleVisitor, Param};
    use burn::optim::{AdamConfig, GradientsParams, Optimizer};
    use burn::record::{BinBytesRecorder, FullPrecisionSettings, Recorder};
    struct Count<'a>(&'a GradientsParams, usize);
    impl ModuleVisitor<B> for Count<'_> {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<B, D>>) {
            type Inner = <B as AutodiffBackend>::InnerBackend;
            if let Some(g) = self.0.get::<Inner, D>(p.id) {
                self.1 += 4 * g.shape().num_elements();
            }
        }
    }
    let device = Default::default();
    let session = DdpSession::new(pg.clone(), DdpConfig::default())?;
    let mut model = session.prepare(Wide::<B>::new(&device))?;
    let mut plain = AdamConfig::new().init();
    let mut zero = match stage {
        0 => None,
        1 => Some(session.zero(AdamConfig::new().init(), &model)?),
        _ => Some(session.zero2(AdamConfig::new().init(), &model)?),
    };
    let (mut grad_bytes, mut step_s) = (0, Vec::new());
    for step in 0..ZERO_STEPS {
        let start = std::time::Instant::now();
        let grads = session.gradients(&model, model.loss(&device))?;
        let mut count = Count(&grads, 0);
        model.visit(&mut count);
        grad_bytes = count.1;
        model = match zero.as_mut() {
            Some(zero) => zero.try_step(1e-3, model, grads)?,
            None => plain.step(1e-3, model, grads),
        };
        if step > 0 {
            step_s.push(start.elapsed().as_secs_f64());
        }
    }
    let recorder = BinBytesRecorder::<FullPrecisionSettings>::default();
    let record = match zero.as_ref() {
        Some(zero) => zero.to_record(),
        None => plain.to_record(),
    };
    let state_bytes = Recorder::<B>::record(&recorder, record, ())?.len();
    Ok(ZeroRun {
        param_bytes: 4 * model.num_params(),
        grad_bytes,
        state_bytes,
        step_s,
    })
}

/// The `zero` table's FSDP run on the 0.21 line: `Wide` sharded by `FullyShard` (parameters
/// gathered again for backward, on `Autodiff<Ddp<NdArray>, BalancedCheckpointing>`), trained
/// with Burn's Adam on the shards for [`ZERO_STEPS`] steps.
fn fsdp_run(pg: &ProcessGroup) -> anyhow::Result<ZeroRun> {
    use burn::backend::autodiff::checkpoint::strategy::BalancedCheckpointing;
    use burn::module::{Module, ModuleVisitor, Param};
    use burn::optim::{AdamConfig, GradientsParams, Optimizer};
    use burn::record::{BinBytesRecorder, FullPrecisionSettings, Recorder};
    use burn_ddp::fsdp::{FsdpConfig, FullyShard};
    type Bc = Autodiff<Ddp<NdArray>, BalancedCheckpointing>;
    struct Count<'a>(&'a GradientsParams, usize);
    impl ModuleVisitor<Bc> for Count<'_> {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<Bc, D>>) {
            type Inner = <Bc as AutodiffBackend>::InnerBackend;
            if let Some(g) = self.0.get::<Inner, D>(p.id) {
                self.1 += 4 * g.shape().num_elements();
            }
        }
    }
    let device = Default::default();
    let fsdp = FullyShard::new(pg.clone(), FsdpConfig::default())?;
    let mut model = fsdp.shard::<Bc, _>(Wide::<Bc>::new(&device))?;
    let mut optim = AdamConfig::new().init();
    let (mut grad_bytes, mut step_s) = (0, Vec::new());
    for step in 0..ZERO_STEPS {
        let start = std::time::Instant::now();
        let grads = GradientsParams::from_grads(model.loss(&device).backward(), &model);
        let grads = fsdp.sync::<Bc, _>(&model, grads)?;
        let mut count = Count(&grads, 0);
        model.visit(&mut count);
        grad_bytes = count.1;
        model = optim.step(1e-3, model, grads);
        if step > 0 {
            step_s.push(start.elapsed().as_secs_f64());
        }
    }
    let recorder = BinBytesRecorder::<FullPrecisionSettings>::default();
    let state_bytes = Recorder::<Bc>::record(&recorder, optim.to_record(), ())?.len();
    Ok(ZeroRun {
        param_bytes: 4 * fsdp.held_values(&model).0,
        grad_bytes,
        state_bytes,
        step_s,
    })
}

/// This process's peak resident memory, in MiB (`VmHWM`).
fn peak_mib() -> anyhow::Result<f64> {
    let status = std::fs::read_to_string("/proc/self/status")?;
    let kib: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .ok_or_else(|| anyhow::anyhow!("no VmHWM in /proc/self/status"))?;
    Ok(kib / 1024.0)
}

// ---------------------------------------------------------------- driver

#[derive(Debug, Clone, Copy)]
struct Spec {
    which: Which,
    batch: usize,
    steps: usize,
    rounds: usize,
}

impl Spec {
    fn to_env(self, kind: &str) -> String {
        format!(
            "{kind}:{}:{}:{}:{}",
            self.which.name(),
            self.batch,
            self.steps,
            self.rounds
        )
    }

    fn from_env(s: &str) -> Option<(String, Self)> {
        let mut it = s.split(':');
        let kind = it.next()?.to_string();
        let spec = Self {
            which: Which::parse(it.next()?)?,
            batch: it.next()?.parse().ok()?,
            steps: it.next()?.parse().ok()?,
            rounds: it.next()?.parse().ok()?,
        };
        Some((kind, spec))
    }
}

/// Step times per label, from every result line of `output`.
fn parse(output: &str) -> BTreeMap<String, Vec<Vec<f64>>> {
    let mut out: BTreeMap<String, Vec<Vec<f64>>> = BTreeMap::new();
    for line in output.lines() {
        let Some(rest) = line.strip_prefix(RESULT_TAG) else {
            continue;
        };
        let mut parts = rest.split_whitespace();
        let (Some(label), Some(list)) = (parts.next(), parts.next()) else {
            continue;
        };
        let times = list.split(',').filter_map(|t| t.parse().ok()).collect();
        out.entry(label.to_string()).or_default().push(times);
    }
    out
}

/// [`summary`] of the results labelled `label`; an error if the job printed none.
fn labelled(res: &BTreeMap<String, Vec<Vec<f64>>>, label: &str) -> anyhow::Result<f64> {
    let r = res
        .get(label)
        .ok_or_else(|| anyhow::anyhow!("no {label} results"))?;
    Ok(summary(r))
}

/// Median over rounds of each round's median step time.
fn summary(rounds: &[Vec<f64>]) -> f64 {
    median(&rounds.iter().map(|r| median(r)).collect::<Vec<_>>())
}

fn single_thread_env() -> Vec<(OsString, OsString)> {
    vec![
        ("RAYON_NUM_THREADS".into(), "1".into()),
        ("OMP_NUM_THREADS".into(), "1".into()),
    ]
}

/// Runs this binary as a job of `nproc` ranks in worker mode; returns rank 0's output.
fn run_job(nproc: u32, kind: &str, spec: Spec) -> anyhow::Result<String> {
    run_job_with(nproc, kind, spec, &[])
}

/// [`run_job`] with more variables for every rank.
fn run_job_with(
    nproc: u32,
    kind: &str,
    spec: Spec,
    env: &[(&str, &str)],
) -> anyhow::Result<String> {
    let exe = std::env::current_exe()?;
    let mut job = LocalJob::standalone(exe, Vec::new(), nproc)?;
    job.output = Output::Capture;
    job.env = single_thread_env();
    job.env
        .extend(env.iter().map(|(k, v)| (k.into(), v.into())));
    job.env.push((WORKER.into(), spec.to_env(kind).into()));
    let exits = spawn::run(&job)?.into_result()?;
    Ok(exits
        .into_iter()
        .find(|e| e.rank.0 == 0)
        .map(|e| e.output)
        .unwrap_or_default())
}

fn build_baseline(root: &Path) -> anyhow::Result<PathBuf> {
    let manifest = root.join("benches/plain-autodiff/Cargo.toml");
    let target = root.join("target/plain-autodiff");
    eprintln!("building the plain Autodiff<NdArray> baseline (benches/plain-autodiff) ...");
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let status = Command::new(cargo)
        .args(["build", "--release", "--quiet", "--manifest-path"])
        .arg(&manifest)
        .arg("--target-dir")
        .arg(&target)
        .status()?;
    anyhow::ensure!(status.success(), "building the baseline failed ({status})");
    Ok(target.join("release/plain-autodiff"))
}

fn run_baseline(bin: &Path, spec: Spec) -> anyhow::Result<String> {
    let out = Command::new(bin)
        .args([
            spec.which.name().to_string(),
            spec.batch.to_string(),
            WARMUP.to_string(),
            spec.steps.to_string(),
        ])
        .envs(single_thread_env())
        .output()?;
    anyhow::ensure!(
        out.status.success(),
        "the baseline failed ({}): {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn bench_overhead(root: &Path, rounds: usize) -> anyhow::Result<()> {
    let baseline = build_baseline(root)?;
    println!("\n## overhead: Autodiff<Ddp<NdArray>> at world size 1 vs plain Autodiff<NdArray>");
    println!("| model | plain step (ms) | Ddp step (ms) | overhead |");
    println!("|---|---|---|---|");
    for (which, batch, steps) in [(Which::Mlp, 64, 150), (Which::Many, 32, 40)] {
        let spec = Spec {
            which,
            batch,
            steps,
            rounds: 1,
        };
        let mut plain = Vec::new();
        let mut ddp = Vec::new();
        for round in 0..rounds {
            // Alternate the order so drift in the machine's speed hits both sides alike.
            let (a, b) = if round % 2 == 0 {
                let a = run_baseline(&baseline, spec)?;
                (a, run_job(1, "overhead", spec)?)
            } else {
                let b = run_job(1, "overhead", spec)?;
                (run_baseline(&baseline, spec)?, b)
            };
            plain.extend(parse(&a).remove("plain").unwrap_or_default());
            ddp.extend(parse(&b).remove("ddp").unwrap_or_default());
        }
        anyhow::ensure!(
            plain.len() == rounds && ddp.len() == rounds,
            "missing results"
        );
        let (p, d) = (summary(&plain), summary(&ddp));
        println!(
            "| {} (batch {batch}) | {:.3} | {:.3} | {:+.2} % |",
            which.name(),
            p * 1e3,
            d * 1e3,
            (d / p - 1.0) * 100.0
        );
    }
    Ok(())
}

fn bench_buckets(rounds: usize) -> anyhow::Result<()> {
    let spec = Spec {
        which: Which::Many,
        batch: 32,
        steps: 40,
        rounds,
    };
    let out = run_job(2, "buckets", spec)?;
    let res = parse(&out);
    let get = |l: &str| labelled(&res, l);
    let (local, bucketed, per_param) = (get("local")?, get("bucketed")?, get("per-param")?);
    println!("\n## buckets: 2 ranks, 200 parameters of 4 KiB, step time");
    println!("| variant | step (ms) | sync cost over no-sync step (ms) |");
    println!("|---|---|---|");
    println!("| no sync | {:.3} | — |", local * 1e3);
    println!(
        "| bucketed (25 MiB cap: 1 all-reduce) | {:.3} | {:.3} |",
        bucketed * 1e3,
        (bucketed - local) * 1e3
    );
    println!(
        "| one all-reduce per parameter (200) | {:.3} | {:.3} |",
        per_param * 1e3,
        (per_param - local) * 1e3
    );
    println!(
        "bucketed vs per-parameter: sync cost {:.1}× lower, step {:.2}× faster",
        (per_param - local) / (bucketed - local),
        per_param / bucketed
    );
    Ok(())
}

/// Set for a `scaling` run whose buckets stay on the heap (`DdpConfig::shared_buckets` off).
const HEAP_BUCKETS: &str = "BURN_DDP_BENCH_HEAP_BUCKETS";

fn bench_scaling(rounds: usize) -> anyhow::Result<()> {
    println!("\n## weak scaling: MLP, same batch per rank, 1 compute thread per rank; 2 ranks over TCP, and over shared memory with buckets in it (shm) and on the heap (shm heap), interleaved");
    println!("| batch per rank | 1 rank step (ms) | 2 ranks tcp (ms) | 2 ranks shm (ms) | 2 ranks shm heap (ms) | samples/s 1 → 2 tcp, shm, shm heap | efficiency tcp, shm, shm heap (t1 / t2) |");
    println!("|---|---|---|---|---|---|---|");
    // The runs of one round, rotated every round: (ranks, transport, heap buckets).
    const RUNS: [(u32, &str, bool); 4] = [
        (1, "tcp", false),
        (2, "tcp", false),
        (2, "shm", false),
        (2, "shm", true),
    ];
    for batch in [64, 256] {
        let spec = Spec {
            which: Which::Mlp,
            batch,
            steps: 40,
            rounds: 1,
        };
        let mut times: [Vec<Vec<f64>>; 4] = Default::default();
        for round in 0..rounds {
            for k in 0..RUNS.len() {
                let i = (k + round) % RUNS.len();
                let (world, transport, heap) = RUNS[i];
                let mut env = vec![("BURN_DDP_TRANSPORT", transport)];
                if heap {
                    env.push((HEAP_BUCKETS, "1"));
                }
                let mut r = parse(&run_job_with(world, "scaling", spec, &env)?)
                    .remove("ddp")
                    .unwrap_or_default();
                times[i].append(&mut r);
            }
        }
        let [t1, tcp, shm, heap] = times.map(|t| summary(&t));
        let b = batch as f64;
        println!(
            "| {batch} | {:.3} | {:.3} | {:.3} | {:.3} | {:.0} → {:.0}, {:.0}, {:.0} | {:.1} %, {:.1} %, {:.1} % |",
            t1 * 1e3,
            tcp * 1e3,
            shm * 1e3,
            heap * 1e3,
            b / t1,
            2.0 * b / tcp,
            2.0 * b / shm,
            2.0 * b / heap,
            t1 / tcp * 100.0,
            t1 / shm * 100.0,
            t1 / heap * 100.0
        );
    }
    Ok(())
}

#[cfg(not(any(feature = "lines", feature = "lines-023")))]
fn bench_lines(_rounds: usize) -> anyhow::Result<()> {
    anyhow::bail!(
        "the `lines` benchmark builds Burn 0.22.1 too: run it with \
         `cargo bench --features lines --bench ddp_step -- lines`"
    )
}

/// Set in the copy of this benchmark that runs inside a network namespace whose loopback is
/// rate-limited (`BURN_DDP_BENCH_LINK_MBIT`).
#[cfg(any(feature = "lines", feature = "lines-023"))]
const IN_NETNS: &str = "BURN_DDP_BENCH_IN_NETNS";

/// The `lines` benchmark: with `BURN_DDP_BENCH_LINK_MBIT=N`, in a network namespace of its own
/// whose loopback is limited to N Mbit/s (`tc`'s token bucket; root and iproute2 needed), the
/// ranks talking over TCP, so that communication is a visible share of the step as between
/// nodes; otherwise on this host's transport (shared memory).
#[cfg(any(feature = "lines", feature = "lines-023"))]
fn bench_lines(rounds: usize) -> anyhow::Result<()> {
    let link = std::env::var("BURN_DDP_BENCH_LINK_MBIT").ok();
    match (link, std::env::var_os(IN_NETNS)) {
        (Some(mbit), None) => lines_in_netns(&mbit, rounds),
        (link, _) => lines_here(rounds, link.as_deref()),
    }
}

/// Runs this benchmark's `lines` again inside a fresh network namespace whose loopback is
/// limited to `mbit` Mbit/s; the namespace is deleted after.
#[cfg(any(feature = "lines", feature = "lines-023"))]
fn lines_in_netns(mbit: &str, rounds: usize) -> anyhow::Result<()> {
    let ns = format!("burn-ddp-bench-{}", std::process::id());
    let ip = |args: &[&str]| -> anyhow::Result<()> {
        let status = Command::new("ip").args(args).status()?;
        anyhow::ensure!(status.success(), "ip {} failed ({status})", args.join(" "));
        Ok(())
    };
    ip(&["netns", "add", &ns])?;
    let run = || -> anyhow::Result<()> {
        ip(&["netns", "exec", &ns, "ip", "link", "set", "lo", "up"])?;
        let rate = format!("{mbit}mbit");
        ip(&[
            "netns", "exec", &ns, "tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate", &rate,
            "burst", "256kb", "latency", "100ms",
        ])?;
        let status = Command::new("ip")
            .args(["netns", "exec", &ns])
            .arg(std::env::current_exe()?)
            .args(["lines", "--rounds", &rounds.to_string()])
            .env(IN_NETNS, "1")
            .status()?;
        anyhow::ensure!(status.success(), "the benchmark in {ns} failed ({status})");
        Ok(())
    };
    let result = run();
    let _ = ip(&["netns", "delete", &ns]);
    result
}

#[cfg(any(feature = "lines", feature = "lines-023"))]
fn lines_here(rounds: usize, link: Option<&str>) -> anyhow::Result<()> {
    let spec = Spec {
        which: Which::Mlp,
        batch: 64,
        steps: 30,
        rounds,
    };
    // Over a limited link the ranks talk over TCP; here, over this host's transport.
    let env: &[(&str, &str)] = match link {
        Some(_) => &[("BURN_DDP_TRANSPORT", "tcp")],
        None => &[],
    };
    let out = run_job_with(2, "lines", spec, env)?;
    let res = parse(&out);
    let get = |l: &str| labelled(&res, l);
    let where_ = match link {
        Some(mbit) => format!("over TCP on a loopback limited to {mbit} Mbit/s"),
        None => "on this host's transport".to_string(),
    };
    println!(
        "\n## lines: 2 ranks {where_}, MLP (535 k parameters, 2.1 MB of gradients), batch 64 per \
         rank, step time"
    );
    println!(
        "| line | no-sync step (ms) | after backward (ms) | overlapped (ms) | sync cost after (ms) | sync cost overlapped (ms) | hidden |"
    );
    println!("|---|---|---|---|---|---|---|");
    let mut costs = Vec::new();
    for (line, name) in [
        ("021", "Burn 0.21, `Autodiff<Ddp<NdArray>>`"),
        ("022", step_model_022::RELEASE),
    ] {
        let local = get(&format!("local-{line}"))?;
        let after = get(&format!("after-{line}"))?;
        let overlapped = get(&format!("overlap-{line}"))?;
        let (cost_after, cost_overlapped) = (after - local, overlapped - local);
        println!(
            "| {name} | {:.3} | {:.3} | {:.3} | {:.3} | {:.3} | {:.0} % |",
            local * 1e3,
            after * 1e3,
            overlapped * 1e3,
            cost_after * 1e3,
            cost_overlapped * 1e3,
            (1.0 - cost_overlapped / cost_after) * 100.0
        );
        costs.push((cost_after, cost_overlapped));
    }
    println!(
        "hidden: the share of the after-backward sync cost that overlapping removes. 0.22/0.23 line vs \
         0.21 line, overlapped sync cost: {:.2}× (the backends differ: compare the sync costs)",
        costs[1].1 / costs[0].1
    );
    println!(
        "Burn 0.22.1's own DistributedDataParallel strategy is not in this table: it cannot run \
         on CPU. burn-backend-extension 0.22.1 (src/catalog.rs) marks only Cube and Remote as \
         distributed, and cubecl implements collectives on CUDA alone; Flex and NdArray have \
         none."
    );
    Ok(())
}

fn bench_memory(rounds: usize) -> anyhow::Result<()> {
    let spec = Spec {
        which: Which::Mlp,
        batch: 8,
        steps: 3,
        rounds: 1,
    };
    let mut variants = vec!["memory-local", "memory-sync", "memory-view"];
    if cfg!(any(feature = "lines", feature = "lines-023")) {
        variants.extend(["memory-022-local", "memory-022-sync"]);
    }
    let mut peaks: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
    for round in 0..rounds {
        // Rotate the order so drift in the machine hits every variant alike.
        for k in 0..variants.len() {
            let v = variants[(round + k) % variants.len()];
            let out = run_job(2, v, spec)?;
            let peak = labelled(&parse(&out), "peak")?;
            peaks.entry(v).or_default().push(peak);
        }
    }
    let m = |v: &str| median(&peaks[v]);
    let (local, sync, view) = (m("memory-local"), m("memory-sync"), m("memory-view"));
    println!(
        "\n## memory: 2 ranks, 16 × Linear(1024, 1024) = 67 MB of parameters, peak RSS of rank 0"
    );
    println!("| run | peak (MiB) | above the unsynchronised run (MiB) |");
    println!("|---|---|---|");
    println!("| no synchronisation | {local:.1} | — |");
    println!(
        "| synchronised (default) | {sync:.1} | {:.1} |",
        sync - local
    );
    println!(
        "| synchronised, gradient_as_bucket_view | {view:.1} | {:.1} |",
        view - local
    );
    println!(
        "gradient_as_bucket_view: {:.2}× the default's peak; synchronisation's extra memory {:.2}× the default's",
        view / sync,
        (view - local) / (sync - local)
    );
    if cfg!(any(feature = "lines", feature = "lines-023")) {
        let (local, sync) = (m("memory-022-local"), m("memory-022-sync"));
        let release = step_model_022::RELEASE;
        println!("| {release}, no synchronisation | {local:.1} | — |");
        println!(
            "| {release}, GradSync after backward | {sync:.1} | {:.1} |",
            sync - local
        );
    }
    Ok(())
}

/// DDP, ZeRO-1, ZeRO-2 and FSDP with Adam on `Wide` at 1, 2 and 4 ranks: what rank 0 keeps
/// (its parameters, the gradients its optimizer is handed, its optimizer state), its peak
/// resident memory and the step time, a fresh job per run, the runs of a round rotated.
fn bench_zero(rounds: usize) -> anyhow::Result<()> {
    let spec = Spec {
        which: Which::Mlp,
        batch: 8,
        steps: ZERO_STEPS,
        rounds: 1,
    };
    let mut lines = vec!["021"];
    if cfg!(any(feature = "lines", feature = "lines-023")) {
        lines.push("022");
    }
    let runs: Vec<(&str, u32, u8)> = (lines.iter())
        .flat_map(|&l| [1u32, 2, 4].map(|n| (l, n)))
        .flat_map(|(l, n)| [0u8, 1, 2, 3].map(|stage| (l, n, stage)))
        .collect();
    type Results = BTreeMap<String, Vec<Vec<f64>>>;
    let mut got: BTreeMap<(&str, u32, u8), Results> = BTreeMap::new();
    for round in 0..rounds {
        for k in 0..runs.len() {
            let (line, n, stage) = runs[(round + k) % runs.len()];
            let out = run_job(n, &format!("zero-{line}-{stage}"), spec)?;
            let entry = got.entry((line, n, stage)).or_default();
            for (label, values) in parse(&out) {
                entry.entry(label).or_default().extend(values);
            }
        }
    }
    println!(
        "\n## zero: Adam on 16 × Linear(1024, 1024) (16.8 M parameters, 67 MB in f32), batch 8 \
         per rank (DDP and ZeRO overlapped; FSDP gathering each layer, again for backward); \
         rank 0's parameters, gradients handed to its optimizer and optimizer record (counted), \
         its peak RSS, and the step time"
    );
    println!("| line | ranks | run | parameters (MiB) | gradients (MiB) | optimizer state (MiB) | peak RSS (MiB) | step (ms) |");
    println!("|---|---|---|---|---|---|---|---|");
    let mib = |b: f64| b / (1024.0 * 1024.0);
    for (line, n, stage) in runs {
        let r = &got[&(line, n, stage)];
        let name = ["DDP", "ZeRO-1", "ZeRO-2", "FSDP"][stage as usize];
        println!(
            "| {} | {n} | {name} | {:.1} | {:.1} | {:.1} | {:.0} | {:.0} |",
            if line == "021" {
                "0.21 (NdArray)"
            } else {
                step_model_022::RELEASE
            },
            mib(labelled(r, "params")?),
            mib(labelled(r, "grads")?),
            mib(labelled(r, "state")?),
            labelled(r, "peak")?,
            labelled(r, "step")? * 1e3,
        );
    }
    Ok(())
}

fn main() -> ExitCode {
    if let Ok(spec) = std::env::var(WORKER) {
        let Some((kind, spec)) = Spec::from_env(&spec) else {
            eprintln!("bad {WORKER}: {spec}");
            return ExitCode::FAILURE;
        };
        return match worker(&kind, &spec) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("worker failed: {e}");
                ExitCode::FAILURE
            }
        };
    }
    let (rounds, mut names) =
        match args::parse(&["overhead", "buckets", "scaling", "lines", "memory", "zero"]) {
            Ok(a) => (a.rounds, a.names),
            Err(e) => {
                eprintln!("{e}");
                return ExitCode::FAILURE;
            }
        };
    if names.is_empty() {
        names = vec!["overhead".into(), "buckets".into(), "scaling".into()];
        if cfg!(any(feature = "lines", feature = "lines-023")) {
            names.push("lines".into());
        }
        names.push("memory".into());
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    println!("# burn-ddp step benchmarks ({rounds} rounds, medians of per-round medians)");
    for name in names {
        let r = match name.as_str() {
            "overhead" => bench_overhead(root, rounds),
            "buckets" => bench_buckets(rounds),
            "lines" => bench_lines(rounds),
            "memory" => bench_memory(rounds),
            "zero" => bench_zero(rounds),
            _ => bench_scaling(rounds),
        };
        if let Err(e) = r {
            eprintln!("{name} failed: {e}");
            return ExitCode::FAILURE;
        }
    }
    ExitCode::SUCCESS
}
