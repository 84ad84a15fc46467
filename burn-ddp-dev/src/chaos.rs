//! The chaos run: fault-tolerant jobs of a Burn line's classifier example under the real
//! launcher (`burn-ddp run --fault-tolerant`), hit by a seeded random schedule of faults, each
//! checked as it is survived and every job checked when it ends. `cargo bench -p burn-ddp-dev
//! --bench chaos` runs a long schedule; both lines' tests run a short one.
//!
//! Faults, one at a time on a job at full strength (every slot a member that has trained a
//! step), every kind once in each round of six in a random order: a rank SIGKILLed; SIGTERMed; frozen (SIGSTOP) for less than the heartbeat bound,
//! which the job must absorb without a change; frozen for longer, then resumed (SIGCONT), so
//! that it is left out, or absorbed when no survivor waited on it in a collective past the
//! bound before it was back ([`Report::absorbed`]); a rank killed and then its replacement killed while it joins; two ranks
//! killed at once. Any rank may be hit, rank 0 included.
//!
//! With [`Chaos::etcd`], each job runs on as many nodes (network namespaces) as it has ranks,
//! one rank and one member of a three-or-more-member etcd cluster on each, its store on that
//! cluster (`--rdzv-backend etcd`), and two more kinds join the rounds (eight): a node's link
//! cut for longer than the heartbeat bound, then restored; a node lost whole (its launcher, its
//! rank and its etcd member, which may lead the cluster: the store's host), then started again
//! (the member with its data, a launcher with `--join`). A node whose launcher ended because
//! its node was cut off gets a new one with `--join` once its link is back, as an operator or a
//! cluster's requeue would.
//!
//! Checked after each fault: the survivors complete a step within [`Chaos::bound`] (in a new
//! membership, or in the same one after a fault that ended by itself and went unnoticed; the
//! recovery time is measured from the signal to rank 0's line saying so) and the job is back
//! to full strength within the same bound, or has ended. No fault once rank 0 printed the final
//! accuracy. Checked when a job ends: the launcher exits with success (or fails naming a rank a
//! fault killed after the last change of membership: its collectives were done, what else it
//! had to do the launcher cannot know, so it must fail); every rank that ends prints the same parameter digest (the ranks also
//! compare their replicas every 100 steps as they train, and fail if they differ); every epoch's
//! training and validation count every item once (`items N/N`); the metric files (written by
//! whichever process was rank 0) hold every epoch's items, none twice, less at most one step
//! per change; the checkpoints of the last two epochs are complete, their seals intact, and no
//! temporary file is left.

use std::collections::BTreeMap;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

use crate::spawned::children;

/// A chaos run's settings.
#[derive(Debug, Clone)]
pub struct Chaos {
    /// The classifier example of the line under test.
    pub program: PathBuf,
    /// The `burn-ddp` launcher.
    pub launcher: PathBuf,
    /// Ranks of each job.
    pub nproc: u32,
    /// Faults to inject in all (the run stops at the first job end after this many).
    pub faults: usize,
    /// The run stops injecting after this long (and lets its job end).
    pub limit: Duration,
    /// The seed of the schedule (kinds, victims, gaps, freeze lengths).
    pub seed: u64,
    /// Epochs of each job, and its generated training and test images.
    pub epochs: u32,
    pub train: u32,
    pub test: u32,
    /// The failure-detection bound given to the ranks (`BURN_DDP_HEARTBEAT_TIMEOUT`).
    pub heartbeat: Duration,
    /// The bound on every wait of the harness: recovery, return to full strength.
    pub bound: Duration,
    /// Where the jobs write their logs and checkpoints.
    pub dir: PathBuf,
    /// Each job on `nproc` nodes (network namespaces, root needed) with its store on an etcd
    /// cluster of one member per node; the launcher and the program built with `etcd`.
    pub etcd: bool,
}

impl Chaos {
    /// The kinds of fault of this run: [`KINDS`], and with etcd [`NODE_KINDS`] too.
    pub fn kinds(&self) -> Vec<&'static str> {
        let mut kinds = KINDS.to_vec();
        if self.etcd {
            kinds.extend(NODE_KINDS);
        }
        kinds
    }
}

/// The kinds of fault, in the order the report lists them.
pub const KINDS: [&str; 6] = [
    "SIGKILL",
    "SIGTERM",
    "frozen under the heartbeat bound",
    "frozen past the heartbeat bound, then resumed",
    "replacement killed while it joined",
    "two ranks killed at once",
];

/// The kinds of fault on nodes, in a run on etcd and network namespaces.
pub const NODE_KINDS: [&str; 2] = [
    "link cut past the heartbeat bound, then restored",
    "node lost whole (launcher, rank, etcd member), then started again",
];

/// What a chaos run saw.
#[derive(Debug, Default)]
pub struct Report {
    /// Processes hit, by kind of fault ([`KINDS`]).
    pub faults: BTreeMap<&'static str, usize>,
    /// From each fault that changed the membership to the survivors' first step, by kind.
    pub recoveries: BTreeMap<&'static str, Vec<Duration>>,
    /// Faults past the heartbeat bound (a freeze, a cut link) that the job absorbed without a
    /// change, by kind: a rank is left out only when a peer waited on it in a collective longer
    /// than the bound while it was silent, and no survivor did before it was back. The job
    /// stepped on in the same membership.
    pub absorbed: BTreeMap<&'static str, usize>,
    /// From each such fault to the job's return to full strength.
    pub restored: Vec<Duration>,
    /// Jobs run, and their splits checked (training and validation of every epoch).
    pub jobs: usize,
    pub splits_checked: usize,
    /// Splits whose last step trained (or evaluated) but whose outputs never reached rank 0:
    /// a rank failed between the step and the gather of its outputs, and the change of
    /// membership found the split over. Their progress line never reached `items N/N`, and
    /// rank 0's metrics of that split miss that step.
    pub unshown: usize,
    /// Waits of the harness, each within the bound.
    pub waits: usize,
    /// Launchers that failed, as they must, because a fault killed a member of the job's last
    /// membership: a rank whose collectives were all done, killed before it ended (what it
    /// still had to do may be lost, so the launcher cannot call the job a success). The job's
    /// other invariants held.
    pub killed_in_the_end: usize,
    /// Node launchers lost with their node or ended by a cut link, each followed by one that
    /// joined.
    pub rejoined: usize,
    /// How long the run took.
    pub took: Duration,
    /// Every fault injected, in order, with when (from the run's start): what a failure names.
    pub schedule: Vec<String>,
}

impl Report {
    /// Faults injected in all (processes hit).
    pub fn total(&self) -> usize {
        self.faults.values().sum()
    }

    /// The report's text.
    pub fn text(&self, chaos: &Chaos) -> String {
        let mut out = format!(
            "chaos: {} faults survived in {} jobs of {} ranks{} of {} (seed {}, heartbeat bound {:?}, {:.1} min)\n",
            self.total(),
            self.jobs,
            chaos.nproc,
            if chaos.etcd {
                " (one per node, the store on an etcd member per node)"
            } else {
                ""
            },
            chaos
                .program
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default(),
            chaos.seed,
            chaos.heartbeat,
            self.took.as_secs_f64() / 60.0
        );
        out += "  faults (processes or nodes hit), by kind:\n";
        for kind in chaos.kinds() {
            out += &format!(
                "    {kind}: {}\n",
                self.faults.get(kind).copied().unwrap_or(0)
            );
        }
        let all: Vec<Duration> = self.recoveries.values().flatten().copied().collect();
        out += &format!(
            "  fault -> the survivors' first step ({} changes): {}\n",
            all.len(),
            percentiles(&all)
        );
        for kind in chaos.kinds() {
            if let Some(times) = self.recoveries.get(kind) {
                out += &format!("    {kind}: {}\n", percentiles(times));
            }
        }
        if !self.absorbed.is_empty() {
            out += "  faults past the bound absorbed without a change (no survivor waited on \
                    the victim past the bound before it was back):\n";
            for (kind, n) in &self.absorbed {
                out += &format!("    {kind}: {n}\n");
            }
        }
        out += &format!(
            "  fault -> full strength again: {}\n",
            percentiles(&self.restored)
        );
        out += &format!(
            "  invariants held: {} waits within {:?}; every job exited 0 with bit-identical \
             replicas; {} splits (training and validation of every epoch) counted every item \
             once, {} of them ended by a change after their last step, whose outputs (metrics) \
             never reached rank 0; the metric files of every split held its items, none twice; \
             the last two checkpoints of every job complete and sealed, \
             no temporary left\n",
            self.waits, chaos.bound, self.splits_checked, self.unshown
        );
        if self.killed_in_the_end > 0 {
            out += &format!(
                "  {} launchers failed, naming a rank a fault killed after the job's last change \
                 of membership, before it ended\n",
                self.killed_in_the_end
            );
        }
        if chaos.etcd {
            out += &format!(
                "  on etcd: {} node launchers lost with their node or ended by a cut link, each \
                 followed by one that joined the running job (--join)\n",
                self.rejoined
            );
        }
        out
    }
}

/// `p50 / p90 / p99 / max` of `times`, in ms.
fn percentiles(times: &[Duration]) -> String {
    if times.is_empty() {
        return "none".into();
    }
    let mut ms: Vec<u128> = times.iter().map(Duration::as_millis).collect();
    ms.sort_unstable();
    let at = |q: f64| ms[((ms.len() - 1) as f64 * q).round() as usize];
    format!(
        "p50 {} ms, p90 {} ms, p99 {} ms, max {} ms",
        at(0.5),
        at(0.9),
        at(0.99),
        ms[ms.len() - 1]
    )
}

/// Runs the schedule: jobs one after the other until `chaos.faults` faults were injected or
/// `chaos.limit` passed. Any invariant that does not hold ends the run with what was seen
/// (the job's log included).
///
/// # Errors
/// The invariant that did not hold, and the job's log.
pub fn run(chaos: &Chaos) -> Result<Report, String> {
    let started = Instant::now();
    let mut rng = StdRng::seed_from_u64(chaos.seed);
    let mut report = Report::default();
    std::fs::create_dir_all(&chaos.dir).map_err(|e| format!("{}: {e}", chaos.dir.display()))?;
    while report.total() < chaos.faults && started.elapsed() < chaos.limit {
        let mut job = Job::start(chaos, report.jobs)
            .map_err(|e| format!("job {} could not start: {e}", report.jobs))?;
        report.jobs += 1;
        let ended = job.inject(chaos, &mut rng, &mut report, started);
        let checked = ended.and_then(|()| job.check(chaos));
        job.stop();
        match checked {
            Ok((splits, unshown, late)) => {
                report.splits_checked += splits;
                report.unshown += unshown;
                report.killed_in_the_end += late;
            }
            Err(e) => {
                let log = job.text();
                // The causes last: a report cut to its end (CI's) still says why.
                return Err(format!(
                    "an invariant did not hold in job {} (logs in {}): {e}\n{log}\n\
                     ---- the faults injected, in order ----\n{}\n\
                     ---- what the logs say went wrong ----\n{}\n\
                     ---- the broken invariant ----\n{e}",
                    job.index,
                    chaos.dir.display(),
                    report.schedule.join("\n"),
                    causes(&log, &chaos.program).join("\n"),
                ));
            }
        }
        let _ = std::fs::remove_dir_all(&job.out);
        let _ = std::fs::remove_dir_all(chaos.dir.join(format!("job-{}-etcd", job.index)));
    }
    report.took = started.elapsed();
    Ok(report)
}

/// One fault-tolerant job under the launcher (one per node).
struct Job {
    index: usize,
    /// Every launcher started, in order; `nodes[n]` is the index of node `n`'s current one.
    launchers: Vec<Launcher>,
    nodes: Vec<usize>,
    out: PathBuf,
    /// The network namespaces and etcd cluster of a job on etcd.
    cluster: Option<(crate::netns::Net, crate::etcd::EtcdCluster)>,
    /// The launcher's arguments after `run` (without `--node-rank`) and the program's.
    args: Vec<String>,
    /// Bytes of the log parsed for membership epochs so far, and what they said.
    memberships: Memberships,
    /// Every process a fault killed (signalled, or lost with its node); not those frozen or
    /// cut off, which are meant to live on.
    killed: Vec<u32>,
}

/// One launcher of a job: its process and its log.
struct Launcher {
    child: Child,
    log: PathBuf,
    /// Its node was cut off or killed: it may end with failure.
    faulted: bool,
}

/// What rank 0 said about membership epochs: each epoch's world size, and the epochs whose
/// first step is done.
#[derive(Debug, Default, Clone)]
struct Memberships {
    worlds: BTreeMap<u64, u32>,
    stepped: Vec<u64>,
    replacements: usize,
    /// Rank 0's progress lines (training and validation) so far.
    progress: usize,
}

impl Memberships {
    fn parse(text: &str) -> Self {
        let mut m = Self::default();
        for line in text.lines() {
            if let Some(rest) = line.split("[membership] membership epoch ").nth(1) {
                let epoch = rest.split(':').next().and_then(|k| k.parse().ok());
                let world = rest
                    .split("world size ")
                    .nth(1)
                    .and_then(|w| w.split_whitespace().next())
                    .and_then(|w| w.parse().ok());
                if let (Some(epoch), Some(world)) = (epoch, world) {
                    m.worlds.insert(epoch, world);
                }
            }
            if let Some(rest) = line.split("the first step of membership epoch ").nth(1) {
                if let Some(k) = rest.split_whitespace().next().and_then(|k| k.parse().ok()) {
                    m.stepped.push(k);
                }
            }
            if line.contains("in its place (local rank") {
                m.replacements += 1;
            }
            if line.contains("] [train] epoch ") || line.contains("] [valid] epoch ") {
                m.progress += 1;
            }
        }
        m
    }

    /// The newest membership epoch (0: the first).
    fn newest(&self) -> u64 {
        self.worlds.keys().next_back().copied().unwrap_or(0)
    }

    /// Whether a membership epoch after `epoch` took its first step.
    fn stepped_after(&self, epoch: u64) -> bool {
        self.stepped.iter().any(|&k| k > epoch)
    }

    /// Whether the job absorbed a fault in membership `epoch` without a change: no membership
    /// began after it, and rank 0 showed progress past `progress` (its count of progress lines
    /// once the fault was over).
    fn absorbed(&self, epoch: u64, progress: usize) -> bool {
        self.newest() == epoch && self.progress > progress
    }

    /// Whether the newest membership has `nproc` ranks and took a step.
    fn full(&self, nproc: u32) -> bool {
        match self.worlds.iter().next_back() {
            None => true,
            Some((&k, &w)) => w == nproc && self.stepped.contains(&k),
        }
    }
}

impl Job {
    fn start(chaos: &Chaos, index: usize) -> Result<Self, String> {
        let out = chaos.dir.join(format!("job-{index}"));
        let _ = std::fs::remove_dir_all(&out);
        let program = crate::spawned::classifier_args(&out, chaos.epochs, chaos.train, chaos.test);
        let mut job = Self {
            index,
            launchers: Vec::new(),
            nodes: Vec::new(),
            out,
            cluster: None,
            args: Vec::new(),
            memberships: Memberships::default(),
            killed: Vec::new(),
        };
        let id = format!("chaos-{}-{index}", std::process::id());
        let mut args: Vec<String> = ["--fault-tolerant", "--rdzv-id", &id]
            .iter()
            .map(|s| s.to_string())
            .collect();
        args.extend(["--max-restarts".into(), "1000000".into()]);
        if chaos.etcd {
            let net = crate::netns::Net::new(chaos.nproc as usize);
            // Not under the job's output, which the program clears when it starts.
            let data = chaos.dir.join(format!("job-{index}-etcd"));
            let _ = std::fs::remove_dir_all(&data);
            std::fs::create_dir_all(&data).map_err(|e| format!("{}: {e}", data.display()))?;
            let nodes: Vec<usize> = (0..chaos.nproc as usize).collect();
            let cluster = crate::etcd::EtcdCluster::start(&net, &nodes, &data);
            args.extend([
                "--nnodes".into(),
                chaos.nproc.to_string(),
                "--nproc-per-node".into(),
                "1".into(),
                "--rdzv-backend".into(),
                "etcd".into(),
                "--rdzv-endpoint".into(),
                cluster.endpoints(),
                "--rdzv-timeout".into(),
                "120".into(),
            ]);
            job.cluster = Some((net, cluster));
        } else {
            let port = burn_ddp_comm::launch::spawn::free_port().map_err(|e| e.to_string())?;
            args.extend([
                "--master-port".into(),
                port.to_string(),
                "--nproc-per-node".into(),
                chaos.nproc.to_string(),
            ]);
        }
        args.push("--".into());
        args.push(chaos.program.display().to_string());
        args.extend(program);
        job.args = args;
        let nodes = if chaos.etcd { chaos.nproc as usize } else { 1 };
        for node in 0..nodes {
            job.launch(chaos, node, false)?;
        }
        Ok(job)
    }

    /// Starts a launcher on `node` (`join`: one that joins the running job).
    fn launch(&mut self, chaos: &Chaos, node: usize, join: bool) -> Result<(), String> {
        let log = chaos.dir.join(format!(
            "job-{}-launcher-{}.log",
            self.index,
            self.launchers.len()
        ));
        let mut args = vec!["run".to_string()];
        if self.cluster.is_some() {
            args.extend(["--node-rank".into(), node.to_string()]);
        }
        if join {
            args.push("--join".into());
        }
        args.extend(self.args.iter().cloned());
        let env = [
            ("BURN_DDP_TIMEOUT", "10m".to_string()),
            (
                "BURN_DDP_HEARTBEAT_TIMEOUT",
                format!("{}ms", chaos.heartbeat.as_millis()),
            ),
        ];
        let mut command = match &self.cluster {
            Some((net, _)) => net.command(node, &chaos.launcher, &args, &log),
            None => {
                let file =
                    std::fs::File::create(&log).map_err(|e| format!("{}: {e}", log.display()))?;
                let err = file.try_clone().map_err(|e| e.to_string())?;
                let mut c = Command::new(&chaos.launcher);
                c.args(&args).stdin(Stdio::null()).stdout(file).stderr(err);
                c
            }
        };
        let child = command
            .envs(env)
            .env_remove("RANK")
            .env_remove("BURN_DDP_JOB_TOKEN")
            .env_remove("RUST_LOG")
            // Its own process group, as a shell's job control gives it: a group whose member's
            // parent is outside it is not orphaned, so a rank stopped in it never brings the
            // kernel's SIGHUP to the launcher.
            .process_group(0)
            .spawn()
            .map_err(|e| format!("{}: {e}", chaos.launcher.display()))?;
        let launcher = Launcher {
            child,
            log,
            faulted: false,
        };
        if node < self.nodes.len() {
            self.nodes[node] = self.launchers.len();
        } else {
            self.nodes.push(self.launchers.len());
        }
        self.launchers.push(launcher);
        Ok(())
    }

    /// Every launcher's log, in the order they started.
    fn text(&self) -> String {
        self.launchers
            .iter()
            .map(|l| std::fs::read_to_string(&l.log).unwrap_or_default())
            .collect::<Vec<_>>()
            .join("\n")
    }

    fn refresh(&mut self) -> &Memberships {
        self.memberships = Memberships::parse(&self.text());
        &self.memberships
    }

    /// Whether every node's current launcher has exited.
    fn ended(&mut self) -> bool {
        let current: Vec<usize> = self.nodes.clone();
        current
            .into_iter()
            .all(|i| !matches!(self.launchers[i].child.try_wait(), Ok(None)))
    }

    /// Starts a joining launcher on each node whose launcher ended after its node's fault,
    /// while the job goes on.
    fn revive(&mut self, chaos: &Chaos, report: &mut Report) -> Result<(), String> {
        if self.cluster.is_none() {
            return Ok(());
        }
        for node in 0..self.nodes.len() {
            let l = &mut self.launchers[self.nodes[node]];
            let exited = !matches!(l.child.try_wait(), Ok(None));
            if l.faulted && exited && !self.ended_job() {
                self.launch(chaos, node, true)?;
                report.rejoined += 1;
            }
        }
        Ok(())
    }

    /// Whether the job has finished (a rank printed the final accuracy).
    fn ended_job(&self) -> bool {
        self.text().contains("final test accuracy")
    }

    /// The ranks' pids: the launchers' children that run the program (with `RANK` set), not
    /// one being started (forked, not yet the program).
    fn ranks(&self) -> Vec<u32> {
        self.nodes
            .iter()
            .flat_map(|&i| children(self.launchers[i].child.id()))
            .filter(|&pid| crate::spawned::rank_of(pid).is_some())
            .collect()
    }

    /// The node whose launcher is the parent of rank process `pid`.
    fn node_of(&self, pid: u32) -> Option<usize> {
        (0..self.nodes.len())
            .find(|&n| children(self.launchers[self.nodes[n]].child.id()).contains(&pid))
    }

    /// Waits until `done` holds on the job's memberships, or the job ends (`false`), for at most
    /// the run's bound; nodes whose launcher ended with their fault get a new one meanwhile.
    fn wait(
        &mut self,
        chaos: &Chaos,
        report: &mut Report,
        what: &str,
        mut done: impl FnMut(&Memberships) -> bool,
    ) -> Result<bool, String> {
        report.waits += 1;
        let deadline = Instant::now() + chaos.bound;
        loop {
            if done(self.refresh()) {
                return Ok(true);
            }
            if self.ended() {
                return Ok(false);
            }
            self.revive(chaos, report)?;
            if Instant::now() > deadline {
                return Err(format!("a hang: {what} not within {:?}", chaos.bound));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Injects faults until the run has its count or its time, then lets the job end.
    fn inject(
        &mut self,
        chaos: &Chaos,
        rng: &mut StdRng,
        report: &mut Report,
        started: Instant,
    ) -> Result<(), String> {
        // Faults start once training does.
        let deadline = Instant::now() + chaos.bound.max(Duration::from_secs(300));
        while !self.text().contains("[train] epoch 1/") {
            if self.ended() || Instant::now() > deadline {
                return Err("the job did not start training".into());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        // Every kind once in each round, in a random order.
        let mut bag: Vec<&'static str> = Vec::new();
        // No fault once rank 0 has printed the final accuracy: the job's training is over.
        while report.total() < chaos.faults
            && started.elapsed() < chaos.limit
            && !self.ended()
            && !self.ended_job()
        {
            std::thread::sleep(Duration::from_millis(rng.random_range(100..1000)));
            self.revive(chaos, report)?;
            // A fault hits a job at full strength whose processes are all members: a process
            // more is one waiting to join (a node's old rank, back after its link was cut, and
            // its `--join` launcher's), whose loss would change nothing to wait for.
            let pids = self.ranks();
            if pids.len() != chaos.nproc as usize {
                continue;
            }
            let before = self.refresh().newest();
            if bag.is_empty() {
                bag = chaos.kinds();
                bag.shuffle(rng);
            }
            let kind = bag.pop().unwrap_or(KINDS[0]);
            let at = Instant::now();
            let victim = pids[rng.random_range(0..pids.len())];
            // Named in a broken invariant's message.
            let fault = format!(
                "{kind}: process {victim} (started as rank {}) on node {:?}, in membership \
                 epoch {before}",
                crate::spawned::rank_of(victim).map_or("?".into(), |r| r.to_string()),
                self.node_of(victim),
            );
            report.schedule.push(format!(
                "{:>7.1} s  {fault}",
                started.elapsed().as_secs_f64()
            ));
            // How long a fault that ends by itself (a freeze, a cut link) lasts.
            let mut lapse = None;
            // A membership epoch the job's return to full strength must come after (below).
            let mut restored_after = None;
            if !kind.starts_with("frozen") && !kind.starts_with("link cut") {
                self.killed.push(victim);
            }
            let changes = match kind {
                "SIGKILL" => signal(victim, rustix::process::Signal::KILL),
                "SIGTERM" => signal(victim, rustix::process::Signal::TERM),
                "frozen under the heartbeat bound" => {
                    signal(victim, rustix::process::Signal::STOP);
                    std::thread::sleep(chaos.heartbeat.mul_f64(rng.random_range(0.1..0.5)));
                    signal(victim, rustix::process::Signal::CONT);
                    false
                }
                "frozen past the heartbeat bound, then resumed" => {
                    // Resumed meanwhile, while the survivors' recovery is timed.
                    let frozen = chaos.heartbeat.mul_f64(rng.random_range(1.3..2.5));
                    lapse = Some(frozen);
                    let sent = signal(victim, rustix::process::Signal::STOP);
                    std::thread::spawn(move || {
                        std::thread::sleep(frozen);
                        signal(victim, rustix::process::Signal::CONT);
                    });
                    sent
                }
                "replacement killed while it joined" => {
                    let replaced = self.memberships.replacements;
                    signal(victim, rustix::process::Signal::KILL);
                    let fresh = self.wait(chaos, report, "a replacement", |m| {
                        m.replacements > replaced
                    })?;
                    if fresh {
                        std::thread::sleep(Duration::from_millis(rng.random_range(0..800)));
                        if let Some(&joiner) = self.ranks().iter().find(|p| !pids.contains(p)) {
                            let replaced = self.memberships.replacements;
                            self.killed.push(joiner);
                            signal(joiner, rustix::process::Signal::KILL);
                            *report.faults.entry(kind).or_default() += 1;
                            report.schedule.push(format!(
                                "{:>7.1} s  {kind}: its replacement, process {joiner}",
                                started.elapsed().as_secs_f64()
                            ));
                            // The joiner may have joined already: until the survivors notice
                            // its loss, the newest membership is the full one it is in, and a
                            // fault let in then would hit a job of two members and a process
                            // still joining (two ranks killed at once would end it, as it
                            // must). So full strength counts again only in a membership that
                            // began after the joiner's own replacement was started.
                            if self.wait(chaos, report, "the joiner's replacement", |m| {
                                m.replacements > replaced
                            })? {
                                restored_after = Some(self.memberships.newest());
                            }
                        }
                    }
                    true
                }
                "two ranks killed at once" => {
                    let other = pids[(pids.iter().position(|&p| p == victim).unwrap_or(0)
                        + rng.random_range(1..pids.len()))
                        % pids.len()];
                    self.killed.push(other);
                    signal(victim, rustix::process::Signal::KILL);
                    signal(other, rustix::process::Signal::KILL);
                    *report.faults.entry(kind).or_default() += 1;
                    report.schedule.push(format!(
                        "{:>7.1} s  {kind}: with it process {other}",
                        started.elapsed().as_secs_f64()
                    ));
                    true
                }
                "link cut past the heartbeat bound, then restored" => {
                    let cut = chaos.heartbeat.mul_f64(rng.random_range(1.3..2.5));
                    lapse = Some(cut);
                    self.cut(victim, cut)?
                }
                _ => {
                    let lost = self.lose_node(chaos, rng, victim)?;
                    report.rejoined += usize::from(lost);
                    lost
                }
            };
            *report.faults.entry(kind).or_default() += 1;
            if !changes {
                continue;
            }
            // A fault that ends by itself may go unnoticed (see `Report::absorbed`): the job
            // then shows progress in the same membership once the fault is over and a
            // heartbeat bound more has passed, by when no survivor can still judge the victim
            // silent.
            let settled = lapse.map(|d| at + d + chaos.heartbeat);
            let mut mark = None;
            let mut absorbed = false;
            let stepped = self.wait(
                chaos,
                report,
                &format!("the survivors' first step after the fault ({fault})"),
                |m| {
                    if m.stepped_after(before) {
                        return true;
                    }
                    if settled.is_some_and(|t| Instant::now() >= t) {
                        let mark = *mark.get_or_insert(m.progress);
                        absorbed = m.absorbed(before, mark);
                    }
                    absorbed
                },
            )?;
            if absorbed {
                *report.absorbed.entry(kind).or_default() += 1;
            } else if stepped {
                report
                    .recoveries
                    .entry(kind)
                    .or_default()
                    .push(at.elapsed());
            }
            let what = format!("the job's return to full strength after the fault ({fault})");
            // A change may still follow an absorbed fault (the victim's own side giving up).
            let full = |m: &Memberships| {
                m.full(chaos.nproc) && restored_after.is_none_or(|e| m.newest() > e)
            };
            if self.wait(chaos, report, &what, full)? && !absorbed {
                report.restored.push(at.elapsed());
            }
        }
        // The job ends on its own: its remaining epochs are not bounded by the fault bound.
        let deadline = Instant::now() + Duration::from_secs(1800);
        while !self.ended() {
            if Instant::now() > deadline {
                return Err(
                    "a hang: the job did not end within 30 minutes of the last fault".into(),
                );
            }
            self.revive(chaos, report)?;
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(())
    }

    /// Cuts the link of the node of rank process `victim` for `cut` (restored meanwhile, while
    /// the survivors' recovery is timed): whether it was cut.
    fn cut(&mut self, victim: u32, cut: Duration) -> Result<bool, String> {
        let (Some(node), Some((net, _))) = (self.node_of(victim), &self.cluster) else {
            return Ok(false);
        };
        net.link(node, false);
        let current = self.nodes[node];
        self.launchers[current].faulted = true;
        let ns = net.ns(node);
        std::thread::spawn(move || {
            std::thread::sleep(cut);
            let up = Command::new("ip")
                .args(["-n", &ns, "link", "set", "eth0", "up"])
                .status();
            if !up.as_ref().is_ok_and(|s| s.success()) {
                eprintln!("chaos: the link of {ns} could not be set up again: {up:?}");
            }
        });
        Ok(true)
    }

    /// Kills the node of rank process `victim` whole (its launcher, its rank, its etcd member,
    /// made the cluster's leader first half of the time), then starts it again: its etcd member
    /// with its data, a launcher that joins the running job. Whether a node was lost.
    fn lose_node(&mut self, chaos: &Chaos, rng: &mut StdRng, victim: u32) -> Result<bool, String> {
        let Some(node) = self.node_of(victim) else {
            return Ok(false);
        };
        let Some((net, cluster)) = &mut self.cluster else {
            return Ok(false);
        };
        if rng.random_bool(0.5) {
            let other = (node + 1) % chaos.nproc as usize;
            cluster.make_leader(net, node, other);
        }
        net.kill(node);
        let killed = Instant::now();
        while cluster.running(node) {
            if killed.elapsed() > Duration::from_secs(10) {
                return Err(format!(
                    "node {node}'s etcd member still runs 10 s after its node was killed"
                ));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        cluster.restart(net, node);
        let current = self.nodes[node];
        self.launchers[current].faulted = true;
        let _ = self.launchers[current].child.wait();
        self.launch(chaos, node, true)?;
        Ok(true)
    }

    /// The end-of-job invariants: the splits checked, those of them whose last step's
    /// outputs never reached rank 0 ([`ended_by_a_change`]), and the launchers that failed
    /// because a fault killed a member of the job's last membership ([`killed_in_the_end`]).
    fn check(&mut self, chaos: &Chaos) -> Result<(usize, usize, usize), String> {
        let mut late = 0;
        for (node, &i) in self.nodes.iter().enumerate() {
            let status = self.launchers[i].child.wait().map_err(|e| e.to_string())?;
            if !status.success() {
                let log = std::fs::read_to_string(&self.launchers[i].log).unwrap_or_default();
                if killed_in_the_end(&log, &self.killed).is_some() {
                    late += 1;
                    continue;
                }
                // Its own last words first: a report cut to its start (CI's) still says why.
                let said: Vec<&str> = log.lines().filter(|l| l.starts_with("burn-ddp")).collect();
                return Err(format!(
                    "the launcher of node {node} ({}) exited with {status}, its last lines: {}",
                    self.launchers[i].log.display(),
                    said[said.len().saturating_sub(4)..].join(" | ")
                ));
            }
        }
        let text = self.text();
        let digests = crate::spawned::digests(&text);
        if digests.is_empty() || digests.iter().any(|(_, d)| *d != digests[0].1) {
            return Err(format!(
                "the replicas differ (or none printed a digest): {digests:?}"
            ));
        }
        if !text.contains("final test accuracy") {
            return Err("no final test accuracy".into());
        }
        let epochs = chaos.epochs;
        let mut unshown = 0;
        for e in 1..=epochs {
            for (split, n) in [("train", chaos.train), ("valid", chaos.test)] {
                let line = crate::fault_tolerance::every_item_once(split, e, epochs, n);
                if text.contains(&line) {
                    continue;
                }
                if !ended_by_a_change(&text, e, split) {
                    return Err(format!("no line {line:?}: not every item counted once"));
                }
                unshown += 1;
            }
        }
        check_metric_files(&self.out, &text, chaos)?;
        check_checkpoints(&self.out.join("checkpoint"), epochs as usize)?;
        Ok((2 * epochs as usize, unshown, late))
    }

    /// Ends what is left of the job (after a failed check): its ranks, its launchers, its
    /// nodes and etcd cluster.
    fn stop(&mut self) {
        for pid in self.ranks() {
            signal(pid, rustix::process::Signal::KILL);
        }
        for l in &mut self.launchers {
            let _ = l.child.kill();
            let _ = l.child.wait();
        }
        self.cluster = None;
    }
}

/// The lines of a job's logs that say why something failed: the library's errors, failed
/// changes of membership, panics, `program`'s own error line (`<name>: <error>`), the
/// launcher's verdicts on its ranks.
fn causes<'a>(log: &'a str, program: &Path) -> Vec<&'a str> {
    const SIGNS: [&str; 6] = [
        " ERROR ",
        "panicked at",
        "error:",
        "exited with",
        "was left out",
        "failed",
    ];
    let own = program
        .file_stem()
        .map(|n| format!("{}: ", n.to_string_lossy()));
    let lines: Vec<&str> = log
        .lines()
        .filter(|l| {
            SIGNS.iter().any(|s| l.contains(s)) || own.as_ref().is_some_and(|o| l.contains(o))
        })
        .collect();
    // The last ones: a failure ends a job.
    lines[lines.len().saturating_sub(80)..].to_vec()
}

/// Whether `split` (`train`, `valid`) of `epoch` ended with a change of membership after its
/// last step (rank 0's line `[membership] membership epoch K: ... (at epoch E, training, ...)`,
/// then the first step of epoch K in the next split, or the end of training; the phases it may
/// name are [`changed_within`]'s): the step ran on every survivor, but its outputs, or the line
/// that shows the split's end, were lost with the rank that failed. The metric files
/// ([`check_metric_files`]) still bound what was lost.
fn ended_by_a_change(text: &str, epoch: u32, split: &str) -> bool {
    let next = match split {
        "train" => "(a validation step)",
        _ => "(a training step)",
    };
    let at = changed_within(epoch, split);
    text.lines()
        .filter(|l| {
            l.contains("[membership] membership epoch ") && at.iter().any(|a| l.contains(a))
        })
        .filter_map(|l| {
            let rest = l.split("[membership] membership epoch ").nth(1)?;
            rest.split(':').next()?.parse::<u64>().ok()
        })
        .any(|k| {
            let first = format!("the first step of membership epoch {k} is done ");
            let stepped = text.lines().find(|l| l.contains(&first));
            // No first step: the change came after the last split of training.
            stepped.is_none_or(|l| l.contains(next))
        })
}

/// What rank 0's line of a change of membership says when the change came in `split`
/// (`train`, `valid`) of `epoch`: its phase, or the next one not begun (`validation, 0 steps
/// in`; `end`), when the ranks had all done the split's last step but the change came before
/// its end was shown (the progress line `items N/N` is printed after the split's last vote).
fn changed_within(epoch: u32, split: &str) -> [String; 2] {
    match split {
        "train" => [
            format!("(at epoch {epoch}, training, "),
            format!("(at epoch {epoch}, validation, 0 steps in)"),
        ],
        _ => [
            format!("(at epoch {epoch}, validation, "),
            format!("(at epoch {epoch}, end, "),
        ],
    }
}

/// The job's metric files in `out` (Burn's, written by whichever process was rank 0) hold every
/// epoch's items of both splits, none twice: as many as the split has, less at most one step's
/// per change of membership in it (a step whose outputs were lost with a rank that failed
/// before they were gathered).
fn check_metric_files(out: &Path, text: &str, chaos: &Chaos) -> Result<(), String> {
    // Per rank and step: the classifier's training batch (`classifier_args`) and its
    // validation batch.
    let splits = [
        ("train", "training", chaos.train, 16),
        ("valid", "validation", chaos.test, 256),
    ];
    for e in 1..=chaos.epochs {
        for (split, phase, n, batch) in splits {
            let at = changed_within(e, split);
            let changes = text
                .lines()
                .filter(|l| {
                    l.contains("[membership] membership epoch ") && at.iter().any(|a| l.contains(a))
                })
                .count() as u32;
            let file = out.join(format!("{split}/epoch-{e}/Accuracy.log"));
            let (logged, _) = crate::fault_tolerance::logged(&file)?;
            if logged > n || logged + changes * batch * chaos.nproc < n {
                return Err(format!(
                    "{}: {logged} items logged of the {n} of epoch {e}'s {phase} \
                     ({changes} changes of membership in it): the metrics are not the epoch's",
                    file.display()
                ));
            }
        }
    }
    Ok(())
}

/// The checkpoints of the last two of `epochs`: complete, sealed, no temporary file beside.
fn check_checkpoints(dir: &Path, epochs: usize) -> Result<(), String> {
    for epoch in epochs.saturating_sub(1).max(1)..=epochs {
        for part in burn_ddp_comm::train::files::PARTS {
            let file = burn_ddp_comm::train::files::path(dir, part, epoch);
            let bytes = std::fs::read(&file).map_err(|e| format!("{}: {e}", file.display()))?;
            burn_ddp_comm::train::files::unseal(bytes)
                .map_err(|e| format!("{}: {e}", file.display()))?;
        }
    }
    let entries = std::fs::read_dir(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.contains(".tmp") {
            return Err(format!("a temporary checkpoint file was left: {name}"));
        }
    }
    Ok(())
}

/// A seed from the clock (seconds since 1970), for a schedule not given one.
pub fn clock_seed() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// The process of `killed` whose death failed a launcher whose log is `log`: the launcher's
/// error says a member of the job's last membership was killed, and its line on that member
/// names a process a fault killed. A rank killed after the job's last change of membership (its collectives
/// all done, its end not yet recorded) fails the job, as it must: the launcher cannot know what
/// the program still had to do.
fn killed_in_the_end(log: &str, killed: &[u32]) -> Option<u32> {
    let error = log
        .lines()
        .rev()
        .find(|l| l.starts_with("burn-ddp: error: "))?;
    let member = error
        .split_once("(member ")?
        .1
        .split_once("), a member of the job's last membership, was killed by signal")?
        .0;
    log.lines().find_map(|l| {
        let pid = l
            .strip_prefix("burn-ddp run: rank ")?
            .split_once(&format!("(member {member}, pid "))?
            .1
            .split_once(") was killed by signal")?
            .0
            .parse()
            .ok()?;
        killed.contains(&pid).then_some(pid)
    })
}

/// Sends `sig` to `pid`: whether it was sent (the process may have just exited).
pub fn signal(pid: u32, sig: rustix::process::Signal) -> bool {
    rustix::process::Pid::from_raw(pid as i32)
        .is_some_and(|p| rustix::process::kill_process(p, sig).is_ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn membership_lines_are_read_as_rank_0_prints_them() {
        let text = "\
[rank 0] [train] epoch 1/3  items 48/1536\n\
burn-ddp run: starting member 3 in its place (local rank 1; replacement 1 of 9); it joins\n\
[rank 2] [membership] membership epoch 1: world size 2 (was 3); left: [m1]; joined: []\n\
[rank 2] [membership] the first step of membership epoch 1 is done (a training step), 5 ms\n\
[rank 2] [membership] membership epoch 2: world size 3 (was 2); left: []; joined: [m3]\n";
        let m = Memberships::parse(text);
        assert_eq!(m.newest(), 2);
        assert_eq!(m.replacements, 1);
        assert!(m.stepped_after(0) && !m.stepped_after(1));
        // Epoch 2 has all three ranks but has not stepped yet: not full strength.
        assert!(!m.full(3));
        let m = Memberships::parse(&format!(
            "{text}[rank 0] [membership] the first step of membership epoch 2 is done\n"
        ));
        assert!(m.full(3) && !m.full(4));
        assert!(
            Memberships::parse("").full(3),
            "a job that never changed is whole"
        );
    }

    #[test]
    fn a_fault_is_absorbed_only_by_progress_in_the_same_membership() {
        // A link cut in membership epoch 0 that no survivor waited on past the bound (seen in a
        // chaos run on etcd under load, seed 1796187236): rank 0 goes on in epoch 0.
        let before = "\
[rank 0] [train] epoch 2/3  items 1248/1537  Accuracy epoch 71.55 %\n\
[rank 0] [train] epoch 2/3  items 1537/1537  Accuracy epoch 72.41 %\n";
        let mark = Memberships::parse(before).progress;
        assert_eq!(mark, 2);
        assert!(
            !Memberships::parse(before).absorbed(0, mark),
            "no progress yet"
        );
        let on = format!("{before}[rank 0] [valid] epoch 2/3  items 128/128\n");
        assert!(Memberships::parse(&on).absorbed(0, mark));
        // A change began: its first step is awaited, however far rank 0 got before it.
        let changed = format!(
            "{on}[rank 2] [membership] membership epoch 1: world size 2 (was 3); left: [m1]; joined: []\n"
        );
        let m = Memberships::parse(&changed);
        assert!(!m.absorbed(0, mark) && !m.stepped_after(0));
    }

    #[test]
    fn a_launcher_failed_by_a_kill_after_the_last_change_is_told_apart() {
        // Seen in a chaos run on the 0.23 line (seed 1796192229): rank 1 SIGKILLed after its
        // last collective, the others finished.
        let log = "\
[rank 1] parameter digest: 7552cd257d8cb00d\n\
burn-ddp run: rank 1 (member 1, pid 18147) was killed by signal 9 (SIGKILL); after the job ended: the job finished (every member of its last membership ended)\n\
burn-ddp: error: fault-tolerant job: rank 1 (member 1), a member of the job's last membership, was killed by signal 9 (SIGKILL)\n";
        assert_eq!(killed_in_the_end(log, &[5, 18147]), Some(18147));
        assert_eq!(killed_in_the_end(log, &[5]), None, "not a fault's process");
        let failed = log.replace(
            "was killed by signal 9 (SIGKILL)\n",
            "exited with status 1\n",
        );
        assert_eq!(
            killed_in_the_end(&failed, &[18147]),
            None,
            "a failure of its own"
        );
        let other = log.replace("(member 1), a member", "(member 4), a member");
        assert_eq!(killed_in_the_end(&other, &[18147]), None, "another member");
    }

    #[test]
    fn the_causes_of_a_failure_are_picked_from_the_logs() {
        let log = "\
[rank 0] [train] epoch 1/3  items 48/1536 | Loss epoch 1.37\n\
[rank 1] 2026-11-29T11:59:34Z  WARN [rank 1] the change of membership failed (x); agreeing again\n\
[rank 2] classifier022: the sampler could not be dealt again\n\
[rank 2] classifier: not this program's line\n\
burn-ddp run: rank 2 (member 8, pid 9) exited with status 1; the job goes on without it\n\
[rank 0] final test accuracy: 99.00%\n";
        let picked = causes(log, Path::new("target/debug/examples/classifier022"));
        assert_eq!(picked.len(), 3, "{picked:?}");
        assert!(picked[0].contains("membership failed"));
        assert!(picked[1].contains("classifier022: the sampler"));
        assert!(picked[2].contains("exited with status 1"));
    }

    #[test]
    fn a_split_ended_by_a_change_is_told_from_one_cut_short() {
        let ended = "\
[rank 2] [membership] membership epoch 36: world size 2 (was 3); left: [m32] (at epoch 5, training, 76 steps in)\n\
[rank 2] [membership] the first step of membership epoch 36 is done (a validation step), 304 ms\n";
        assert!(ended_by_a_change(ended, 5, "train"));
        assert!(!ended_by_a_change(ended, 4, "train"));
        assert!(!ended_by_a_change(ended, 5, "valid"));
        let mid = ended.replace("(a validation step)", "(a training step)");
        assert!(!ended_by_a_change(&mid, 5, "train"), "the split went on");
        let last = "[rank 0] [membership] membership epoch 3: world size 2 (was 3); left: [m1] (at epoch 6, validation, 1 steps in)\n";
        assert!(
            ended_by_a_change(last, 6, "valid"),
            "training ended with the change"
        );
        // The split's last step done everywhere, its end not yet shown: the change is at the
        // next phase, not begun (seen in a chaos run on the 0.22 line, seed 1795962286).
        let shown_late = "\
[rank 0] [membership] membership epoch 13: world size 3 (was 3); left: [m12] (at epoch 2, end, 0 steps in)\n\
[rank 0] [membership] the first step of membership epoch 13 is done (a training step), 1287 ms\n";
        assert!(ended_by_a_change(shown_late, 2, "valid"));
        assert!(!ended_by_a_change(shown_late, 2, "train"));
        assert!(!ended_by_a_change(shown_late, 3, "valid"));
        let train_late = "\
[rank 0] [membership] membership epoch 4: world size 2 (was 3); left: [m1] (at epoch 1, validation, 0 steps in)\n\
[rank 0] [membership] the first step of membership epoch 4 is done (a validation step), 80 ms\n";
        assert!(ended_by_a_change(train_late, 1, "train"));
        assert!(!ended_by_a_change(
            &train_late.replace("0 steps in", "1 steps in"),
            1,
            "train"
        ));
    }

    #[test]
    fn percentiles_are_taken_from_the_sorted_times() {
        let times: Vec<Duration> = (1..=100).rev().map(Duration::from_millis).collect();
        assert_eq!(
            percentiles(&times),
            "p50 51 ms, p90 90 ms, p99 99 ms, max 100 ms"
        );
        assert_eq!(percentiles(&[]), "none");
    }
}
