//! FSDP where DDP does not fit: each of 4 ranks runs under a memory limit of its own (a cgroup,
//! `burn_ddp_dev::cgroup`), set by this test at 3 times the model's f32 parameters. Adam on a
//! whole replica needs 4 times them on every rank (parameters, gradients, two moments), so DDP's
//! ranks are killed by the kernel at the limit; FSDP's hold a quarter of each, plus one layer
//! gathered at a time, and train within it, ending equal to one process trained on the whole
//! batch without a limit (this test's own). Real processes, real Burn training (Flex), the
//! kernel's own accounting.

use burn::module::{Module, ModuleVisitor, Param};
use burn::nn::{Linear, LinearConfig};
use burn::optim::{AdamConfig, GradientsParams};
use burn::tensor::{Device, Distribution, Tensor};
use burn_ddp as line;
use burn_ddp_comm::grad::ShardLayout;
use burn_ddp_dev::cgroup::MemoryLimit;
use burn_ddp_dev::compare::{assert_close, F32};
use burn_ddp_dev::procs::{self, TestJob};
use line::fsdp::gather;
use line::{DdpConfig, FsdpConfig, FullyShard, GradSync, ProcessGroup};

const WORLD: u32 = 4;
const LAYERS: usize = 8;
const WIDTH: usize = 1024;
/// Rows of each rank's batch.
const ROWS: usize = 8;
const STEPS: usize = 3;
const TEST: &str = "fsdp_trains_under_a_per_rank_memory_limit_that_ddp_exceeds";
const FSDP_JOB: &str = "fsdp_memory_fsdp";
const DDP_JOB: &str = "fsdp_memory_ddp";
/// The cgroup a rank joins, and where it writes its shards.
const CGROUP: &str = "BURN_DDP_TEST_CGROUP";
const OUT: &str = "BURN_DDP_TEST_OUT";

/// 8 linear layers of 1024 × 1024 (33.6 MB of f32 parameters).
#[derive(Module, Debug)]
struct Deep {
    layers: Vec<Linear>,
}

impl Deep {
    fn new(device: &Device) -> Self {
        Self {
            layers: (0..LAYERS)
                .map(|_| LinearConfig::new(WIDTH, WIDTH).init(device))
                .collect(),
        }
    }

    /// Each layer gathered for its forward (the layer itself outside FSDP).
    fn loss(&self, x: Tensor<2>, y: Tensor<2>) -> Tensor<1> {
        let h = self
            .layers
            .iter()
            .fold(x, |h, l| gather(l).forward(h).tanh());
        (h - y).powi_scalar(2).mean()
    }
}

/// The f32 bytes of `Deep`'s parameters.
fn param_bytes() -> u64 {
    (LAYERS * (WIDTH * WIDTH + WIDTH) * 4) as u64
}

/// Each rank's memory limit: 3 × the parameters' bytes. DDP with Adam holds 4 (and its
/// buckets besides); FSDP at 4 ranks holds 1 (a quarter of the four), the whole model while it
/// is built and cut, and a layer at a time: its peak was 71 MiB of the 96.
fn limit() -> u64 {
    param_bytes() * 3
}

/// The whole batch of step `step` on `device`.
fn batch(step: usize, device: &Device) -> (Tensor<2>, Tensor<2>) {
    let n = WORLD as usize * ROWS;
    device.seed(1000 + step as u64);
    let x = Tensor::<2>::random([n, WIDTH], Distribution::Normal(0.0, 1.0), device);
    let y = Tensor::<2>::random([n, WIDTH], Distribution::Normal(0.0, 0.5), device);
    (x, y)
}

/// This rank's rows of `t`.
fn mine(t: &Tensor<2>, rank: usize) -> Tensor<2> {
    t.clone().narrow(0, rank * ROWS, ROWS)
}

/// Every float parameter of `m`, in visit order: its shape and values.
fn params<M: Module>(m: &M) -> Vec<(Vec<usize>, Vec<f32>)> {
    struct Collect<'a>(&'a mut Vec<(Vec<usize>, Vec<f32>)>);
    impl ModuleVisitor for Collect<'_> {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
            let t = p.val();
            let shape = t.dims().to_vec();
            let values = t.into_data().convert::<f32>().try_to_vec::<f32>().unwrap();
            self.0.push((shape, values));
        }
    }
    let mut out = Vec::new();
    m.visit(&mut Collect(&mut out));
    out
}

/// Joins the cgroup the parent made for this rank: from here on, what it allocates counts.
fn join_limit() {
    let dir = std::env::var(CGROUP).expect("the parent names this rank's cgroup");
    MemoryLimit::join(std::path::Path::new(&dir)).unwrap();
}

/// An FSDP rank: shards `Deep` (rank 0's initialisation), trains it with Adam under the limit,
/// and writes its shards, in visit order, as f32 bytes.
fn fsdp_rank(pg: ProcessGroup) {
    join_limit();
    let rank = pg.rank().index();
    let device = Device::default().autodiff().gradient_checkpointing();
    device.seed(7 + rank as u64);
    let fsdp = FullyShard::new(pg, FsdpConfig::default()).unwrap();
    let mut model = fsdp.shard(Deep::new(&device)).unwrap();
    let mut optim = AdamConfig::new().init();
    for step in 0..STEPS {
        let (x, y) = batch(step, &device);
        let loss = model.loss(mine(&x, rank), mine(&y, rank));
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        let grads = fsdp.sync(&model, grads).unwrap();
        model = optim.step(1e-3, model, grads);
    }
    let bytes: Vec<u8> = params(&model)
        .into_iter()
        .flat_map(|(_, v)| v)
        .flat_map(f32::to_le_bytes)
        .collect();
    let out = std::path::PathBuf::from(std::env::var(OUT).unwrap());
    std::fs::write(out.join(format!("rank{rank}.bin")), bytes).unwrap();
}

/// A DDP rank: the same training with whole replicas (expected to be killed at the limit).
fn ddp_rank(pg: ProcessGroup) {
    join_limit();
    let rank = pg.rank().index();
    let device = Device::default().autodiff();
    device.seed(7 + rank as u64);
    let mut sync = GradSync::new(pg, DdpConfig::default()).unwrap();
    let mut model = sync.prepare(Deep::new(&device)).unwrap();
    let mut optim = AdamConfig::new().init();
    for step in 0..STEPS {
        let (x, y) = batch(step, &device);
        let loss = model.loss(mine(&x, rank), mine(&y, rank));
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        let grads = sync.sync(&model, grads).unwrap();
        model = optim.step(1e-3, model, grads);
    }
}

/// A job of `WORLD` ranks of `job`, each in a cgroup of its own limited to [`limit`].
fn limited_job(job: &str, out: &std::path::Path) -> (procs::Outcomes, Vec<MemoryLimit>) {
    let limits: Vec<MemoryLimit> = (0..WORLD)
        .map(|r| MemoryLimit::new(&format!("{job}-{}-{r}", std::process::id()), limit()))
        .collect::<Result<_, _>>()
        .unwrap_or_else(|e| panic!("{e}"));
    let mut run = TestJob::new(WORLD, job)
        .function(TEST)
        .env(OUT, out.display())
        .timeout(std::time::Duration::from_secs(300));
    for (r, l) in limits.iter().enumerate() {
        run = run.rank_env(r as u32, CGROUP, l.dir().display());
    }
    (run.run(), limits)
}

#[test]
fn fsdp_trains_under_a_per_rank_memory_limit_that_ddp_exceeds() {
    if let Some(pg) = procs::child_group(FSDP_JOB) {
        return fsdp_rank(pg);
    }
    if let Some(pg) = procs::child_group(DDP_JOB) {
        return ddp_rank(pg);
    }
    if procs::is_any_child() {
        return;
    }
    let out = std::env::temp_dir().join(format!("burn-ddp-fsdp-memory-{}", std::process::id()));
    std::fs::create_dir_all(&out).unwrap();
    let mib = |b: u64| b as f64 / (1024.0 * 1024.0);

    let (outcomes, limits) = limited_job(FSDP_JOB, &out);
    outcomes.assert_all_ok();
    let peaks: Vec<u64> = limits.iter().map(|l| l.peak().unwrap_or(0)).collect();
    assert!(limits.iter().all(|l| l.oom_kills() == 0));
    eprintln!(
        "FSDP at {WORLD} ranks, each limited to {:.0} MiB ({:.1} MiB of parameters): peak {:?} MiB",
        mib(limit()),
        mib(param_bytes()),
        peaks.iter().map(|&p| mib(p).round()).collect::<Vec<_>>()
    );
    drop(limits);

    // One process without a limit, from rank 0's initialisation, on the whole batch. Burn
    // initialises a parameter when it is first read: read them all now, in visit order (as
    // rank 0's `shard` did), before the batches reseed the generator.
    let device = Device::default().autodiff();
    device.seed(7);
    let mut reference = Deep::new(&device);
    let _ = params(&reference);
    let mut optim = AdamConfig::new().init();
    for step in 0..STEPS {
        let (x, y) = batch(step, &device);
        let grads = GradientsParams::from_grads(reference.loss(x, y).backward(), &reference);
        reference = optim.step(1e-3, reference, grads);
    }
    // The ranks' shards put back together, parameter by parameter.
    let shards: Vec<Vec<f32>> = (0..WORLD)
        .map(|r| {
            let bytes = std::fs::read(out.join(format!("rank{r}.bin"))).unwrap();
            bytes
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect()
        })
        .collect();
    let (mut got, mut want) = (Vec::new(), Vec::new());
    let mut at = vec![0usize; WORLD as usize];
    for (shape, values) in params(&reference) {
        let layout = ShardLayout::new(&shape, WORLD as usize);
        let mut whole = Vec::new();
        for (r, shard) in shards.iter().enumerate() {
            whole.extend_from_slice(&shard[at[r]..at[r] + layout.shard_len()]);
            at[r] += layout.shard_len();
        }
        whole.truncate(layout.full_len());
        got.extend(whole);
        want.extend(values);
    }
    assert!(
        at.iter().zip(&shards).all(|(a, s)| *a == s.len()),
        "shard files of another model"
    );
    assert_close(0, &got, &want, F32);

    // The negative control: DDP's whole replicas under the same limits.
    let (outcomes, limits) = limited_job(DDP_JOB, &out);
    let killed: u64 = limits.iter().map(MemoryLimit::oom_kills).sum();
    assert!(
        !outcomes.0.iter().all(procs::Outcome::ok) && killed > 0,
        "DDP trained within {:.0} MiB a rank (OOM kills: {killed}):\n{}",
        mib(limit()),
        outcomes.report()
    );
    eprintln!("DDP under the same limits: {killed} rank(s) killed by the kernel at the limit");
    let _ = std::fs::remove_dir_all(&out);
}
