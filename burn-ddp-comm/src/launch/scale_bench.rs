//! `burn-ddp bench scale`: what a job of N ranks costs the built-in store, measured on one
//! machine. Ranks are threads of a few host processes, each running the real thing: the store
//! client, the rendezvous, the group's start-up (address exchange, its ring links), its heartbeat
//! and failure detection; the data plane is the one-float all-reduces the measurement needs.
//! Rank 0, which serves the store (two connections a rank), has a process of its own; the others
//! are hosted as many to a process as its open-file limit holds (a process's limits on
//! descriptors and memory maps are per process); one rank (the middle one, far from rank
//! 0) runs alone in a process, which the benchmark kills. Every 8 ranks are a node with an
//! address of their own (`127.1.0.0`, `127.1.0.1`, ...: [`MasterAddr::local`]), as on machines
//! of 8 GPUs. For each N it prints
//!
//! ```text
//! scale ranks=N init_s=X hb_requests_per_interval=Y hb_bytes_per_interval=Z detect_s=W
//! ```
//!
//! - `init_s`: from the first rank's start to the last one's `ProcessGroup::init` returning;
//! - `hb_requests_per_interval`, `hb_bytes_per_interval`: the requests (and their bytes, both
//!   ways) that the store served on the ranks' heartbeat connections, per heartbeat check
//!   interval, over a window of idle intervals after start-up (read from rank 0's served store,
//!   [`ProcessGroup::served_store_traffic`]);
//! - `detect_s`: from the kill (SIGKILL) of the lone rank, while every rank waits in an
//!   all-reduce, to the last of the others failing with an error that names it.
//!
//! and, after the rows, how the heartbeat traffic grew against the ranks between the first row
//! and each other (`scale growth ...`): linear is a ratio equal to the ranks'.

use std::io::Write;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use crate::config::{Algorithm, GroupConfig, JobToken, MasterAddr, Timeouts, Transport};
use crate::error::ConfigError;
use crate::{DdpError, ProcessGroup, Rank, ReduceOp, Result, WorldSize};

/// What `burn-ddp bench scale` measures.
#[derive(Debug, Clone)]
pub struct ScaleBench {
    /// The world sizes, each its own job (at least 3 ranks each).
    pub ranks: Vec<u32>,
    /// The heartbeat bound of the jobs (the check interval is a fifth of it, at most 2 s).
    pub heartbeat: Duration,
    /// Idle check intervals over which the heartbeat traffic is counted.
    pub window: u32,
    /// Fault-tolerant jobs: the store is a lighthouse the benchmark serves (as `burn-ddp run
    /// --fault-tolerant`'s launcher does), and after the kill the others agree on a membership
    /// without the killed rank (`change_s`).
    pub fault_tolerant: bool,
    /// Where the jobs' store is: the built-in one, or a 3-member etcd cluster the benchmark
    /// starts (Debian's `etcd`; fault-tolerant jobs only, as in `burn-ddp run`).
    pub store: ScaleStore,
}

/// Where `burn-ddp bench scale`'s jobs keep their store.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ScaleStore {
    /// Rank 0's store, or with `--fault-tolerant` a lighthouse the benchmark serves.
    #[default]
    Builtin,
    /// A 3-member etcd cluster on this machine, started and stopped by the benchmark; the
    /// heartbeat columns are then every unary request and every byte of gRPC that etcd
    /// counted over the idle window (its `/metrics`), not the heartbeats' alone.
    Etcd,
}

/// One job's measurements.
#[derive(Debug, Clone, Copy)]
pub struct ScaleRow {
    /// The world size.
    pub ranks: u32,
    /// Start-up: the first rank's start to the last `init` returning.
    pub init: Duration,
    /// Heartbeat requests the store served per check interval.
    pub hb_requests_per_interval: f64,
    /// Heartbeat bytes (both ways) per check interval.
    pub hb_bytes_per_interval: f64,
    /// The kill of one rank to the last other rank naming it.
    pub detect: Duration,
    /// In a fault-tolerant job: the kill to the last other rank in the membership without it
    /// (`ProcessGroup::recover` returned), checked by an all-reduce on it.
    pub change: Option<Duration>,
}

impl ScaleRow {
    /// The row as `burn-ddp bench scale` prints it.
    pub fn line(&self) -> String {
        let change = self
            .change
            .map(|c| format!(" change_s={:.2}", c.as_secs_f64()))
            .unwrap_or_default();
        format!(
            "scale ranks={} init_s={:.2} hb_requests_per_interval={:.0} \
             hb_bytes_per_interval={:.0} detect_s={:.2}{change}",
            self.ranks,
            self.init.as_secs_f64(),
            self.hb_requests_per_interval,
            self.hb_bytes_per_interval,
            self.detect.as_secs_f64()
        )
    }

    /// How the heartbeat traffic grew from `base` to this row, against the ranks.
    pub fn growth_line(&self, base: &ScaleRow) -> String {
        let ratio = |a: f64, b: f64| if b > 0.0 { a / b } else { f64::NAN };
        format!(
            "scale growth ranks={}->{} ranks_x={:.2} hb_requests_x={:.2} hb_bytes_x={:.2}",
            base.ranks,
            self.ranks,
            f64::from(self.ranks) / f64::from(base.ranks),
            ratio(self.hb_requests_per_interval, base.hb_requests_per_interval),
            ratio(self.hb_bytes_per_interval, base.hb_bytes_per_interval),
        )
    }
}

impl ScaleBench {
    /// The check interval of the jobs' heartbeats (as `group/heartbeat.rs` derives it).
    fn interval(&self) -> Duration {
        (self.heartbeat / 5).clamp(Duration::from_millis(50), Duration::from_secs(2))
    }

    /// Checks the options.
    ///
    /// # Errors
    /// `InvalidOption` naming the option and the fix.
    pub fn check(&self) -> Result<()> {
        let invalid = |option, reason: String| {
            Err(DdpError::Config(ConfigError::InvalidOption {
                option,
                reason,
            }))
        };
        if self.ranks.is_empty() {
            return invalid("--ranks", "give at least one world size".into());
        }
        if let Some(n) = self.ranks.iter().find(|n| !(3..=65_536).contains(*n)) {
            return invalid(
                "--ranks",
                format!("{n} ranks: each job needs 3 to 65536 (one is killed, two watch it)"),
            );
        }
        if self.store == ScaleStore::Etcd && !self.fault_tolerant {
            return invalid(
                "--store etcd",
                "etcd keeps the store of fault-tolerant jobs only (as `burn-ddp run \
                 --rdzv-backend etcd`): add --fault-tolerant"
                    .into(),
            );
        }
        if self.store == ScaleStore::Etcd && !cfg!(feature = "etcd") {
            return invalid(
                "--store etcd",
                "needs a burn-ddp built with etcd support: `cargo build --release -p \
                 burn-ddp-comm --features cli,etcd`"
                    .into(),
            );
        }
        if self.heartbeat < Duration::from_millis(250) || self.window == 0 {
            return invalid(
                "--heartbeat-s / --window",
                "the heartbeat bound must be at least 0.25 s and the window at least one \
                 interval"
                    .into(),
            );
        }
        Ok(())
    }

    /// Runs every job in turn, printing each row as it is measured, then the growth lines.
    ///
    /// # Errors
    /// A job that failed to start or to detect the kill (with what went wrong).
    pub fn run(&self, out: &mut impl Write) -> Result<Vec<ScaleRow>> {
        self.check()?;
        let mut rows = Vec::new();
        for &n in &self.ranks {
            let row = self.run_one(n)?;
            writeln!(out, "{}", row.line())?;
            out.flush()?;
            rows.push(row);
        }
        if let Some((base, rest)) = rows.split_first() {
            for row in rest {
                writeln!(out, "{}", row.growth_line(base))?;
            }
        }
        Ok(rows)
    }

    fn run_one(&self, n: u32) -> Result<ScaleRow> {
        let world = WorldSize::new(n).ok_or_else(|| config_error("--ranks", "0 ranks"))?;
        check_threads(n, self.fault_tolerant)?;
        warn_listen_queue(n);
        let victim = Rank(n / 2);
        let cluster = match self.store {
            ScaleStore::Etcd => Some(EtcdCluster::start(3)?),
            ScaleStore::Builtin => None,
        };
        let job = Job {
            world,
            port: free_port()?,
            token: JobToken::generate(),
            heartbeat: self.heartbeat,
            fault_tolerant: self.fault_tolerant,
            etcd: cluster.as_ref().map(|c| c.endpoints.join(";")),
        };
        // A fault-tolerant job's store: a lighthouse in this process, as the launcher's.
        let lighthouse = match self.fault_tolerant && cluster.is_none() {
            true => {
                let addr = std::net::SocketAddr::from(([127, 0, 0, 1], job.port));
                raise_open_files(u64::from(n) * 3 + 1024)?;
                Some(crate::store::StoreServer::bind_lighthouse(
                    addr,
                    job.token.clone(),
                    world,
                )?)
            }
            false => None,
        };
        // Rank 0 alone (it serves the store), the killed rank alone, the others in chunks.
        let mut hosts: Vec<Vec<Rank>> = vec![vec![Rank(0)], vec![victim]];
        let rest: Vec<Rank> = world.ranks().filter(|r| r.0 != 0 && *r != victim).collect();
        hosts.extend(
            rest.chunks(ranks_per_host(n, self.fault_tolerant, job.etcd.is_some())?)
                .map(<[Rank]>::to_vec),
        );
        let started = unix_ns();
        let (tx, rx) = mpsc::channel::<(usize, String)>();
        let mut procs = Vec::with_capacity(hosts.len());
        for (i, ranks) in hosts.iter().enumerate() {
            procs.push(Host::spawn(&job, i, ranks, tx.clone())?);
        }
        drop(tx);
        let others: Vec<usize> = (0..procs.len()).filter(|i| *i != 1).collect();
        let mut run = Run {
            rx,
            queued: vec![Default::default(); hosts.len()],
            procs,
            n,
            deadline: Instant::now() + job.timeouts().rendezvous + Duration::from_secs(30),
        };
        // Start-up: every rank's `init`, then one all-reduce of every rank.
        let ready = run.expect(&(0..hosts.len()).collect::<Vec<_>>(), "ready")?;
        let init_end = ready.iter().filter_map(|w| w.get(2)?.parse().ok()).max();
        let init = Duration::from_nanos(init_end.unwrap_or(started).saturating_sub(started));
        eprintln!("scale: {n} ranks started in {:.2} s", init.as_secs_f64());
        run.expect(&(0..hosts.len()).collect::<Vec<_>>(), "synced")?;
        eprintln!(
            "scale: {n} ranks through their first all-reduce {:.2} s after the start",
            Duration::from_nanos(unix_ns().saturating_sub(started)).as_secs_f64()
        );
        // The heartbeats of the idle job, counted by rank 0's store.
        let interval = self.interval();
        let traffic = match (&lighthouse, &cluster) {
            (Some(store), _) => vec![measure(interval, self.window, || store.traffic())],
            (None, Some(cluster)) => vec![measure(interval, self.window, || cluster.traffic())],
            (None, None) => {
                run.send(
                    0,
                    &format!("measure {} {}", interval.as_millis(), self.window),
                )?;
                run.deadline =
                    Instant::now() + interval * (self.window + 2) + Duration::from_secs(30);
                run.expect(&[0], "traffic")?
            }
        };
        let num = |i: usize| -> f64 {
            traffic[0]
                .get(i)
                .and_then(|v| v.parse().ok())
                .unwrap_or(f64::NAN)
        };
        let intervals = num(3) / interval.as_nanos() as f64;
        let (hb_requests_per_interval, hb_bytes_per_interval) =
            (num(1) / intervals, num(2) / intervals);
        // Every other rank in the second all-reduce, which the lone rank never enters; the kill.
        for &i in &others {
            run.send(i, "go")?;
        }
        std::thread::sleep(interval * 2 + Duration::from_millis(500));
        let killed = unix_ns();
        run.procs[1].kill();
        run.deadline = Instant::now() + self.heartbeat * 4 + Duration::from_secs(30);
        let named = run.expect(&others, "named")?;
        let (mut detect, mut change) = (0u64, 0u64);
        for w in &named {
            let field = |i: usize| w.get(i).and_then(|v| v.parse::<u64>().ok());
            if field(2) != Some(0) {
                return Err(job_failed(
                    n,
                    &format!("a rank blamed another than rank {victim}: {}", w.join(" ")),
                ));
            }
            detect = detect.max(field(3).unwrap_or(u64::MAX).saturating_sub(killed));
            change = change.max(field(4).unwrap_or(u64::MAX).saturating_sub(killed));
        }
        for &i in &others {
            let _ = run.send(i, "end");
        }
        for p in &mut run.procs {
            p.finish(Duration::from_secs(30));
        }
        Ok(ScaleRow {
            ranks: n,
            init,
            hb_requests_per_interval,
            hb_bytes_per_interval,
            detect: Duration::from_nanos(detect),
            change: self.fault_tolerant.then(|| Duration::from_nanos(change)),
        })
    }
}

/// `traffic AUX_REQUESTS AUX_BYTES NANOSECONDS`: what `traffic` (a store's counts) grew by over
/// `window` check intervals of `interval`, after one interval to settle.
fn measure(
    interval: Duration,
    window: u32,
    traffic: impl Fn() -> crate::StoreTraffic,
) -> Vec<String> {
    std::thread::sleep(interval);
    let (before, from) = (traffic(), Instant::now());
    std::thread::sleep(interval * window);
    let (after, took) = (traffic(), from.elapsed());
    [
        "traffic".to_string(),
        (after.aux_requests - before.aux_requests).to_string(),
        (after.aux_bytes - before.aux_bytes).to_string(),
        took.as_nanos().to_string(),
    ]
    .to_vec()
}

/// Descriptors a rank of an `n`-rank job may hold in a host process: 17 + 2 log2 n measured
/// here (store and heartbeat connections, ring links, listeners, and the links of recursive
/// doubling, the default algorithm's for small all-reduces, which the measurement's use: the
/// ring's 2(n − 1) steps would wake every rank's thread 2(n − 1) times), with a margin.
///
/// A rank of a fault-tolerant job holds more: its membership service's connection, its join
/// watcher's, its epoch's group and heartbeat connections besides its presence, and through a
/// change both epochs' links for a while (a host of 1,000 such ranks ran out of its 20,000).
/// On etcd, each of its store connections is a connection to every member of the cluster: 128
/// fault-tolerant ranks held at most 4,541 descriptors on the built-in store and 9,323 on a
/// 3-member etcd (sampled every 0.5 s), and a host of 279 ranks at 512 ran out of its 20,000
/// in the change.
fn descriptors_per_rank(n: u32, fault_tolerant: bool, etcd: bool) -> u64 {
    let links = 2 * u64::from(n.next_power_of_two().trailing_zeros());
    let store = if etcd { 48 } else { 0 };
    store
        + match fault_tolerant {
            true => 32 + 2 * links,
            false => 24 + links,
        }
}

/// How many ranks one host process takes: as many as its open-file limit (raised to the hard
/// limit) holds, with 1,024 descriptors to spare, at most [`MAX_RANKS_PER_HOST`] (a rank holds
/// about 20 memory maps, and the default limit is 65,530 a process).
///
/// # Errors
/// The limit holds fewer than 16 ranks.
fn ranks_per_host(n: u32, fault_tolerant: bool, etcd: bool) -> Result<usize> {
    let (soft, _) = crate::sys::raise_open_files(1 << 20)?;
    let fit = soft.saturating_sub(1024) / descriptors_per_rank(n, fault_tolerant, etcd);
    if fit < 16 {
        return Err(config_error(
            "--ranks",
            &format!("this process may open {soft} files, too few to host ranks: raise the limit"),
        ));
    }
    Ok(usize::try_from(fit)
        .unwrap_or(usize::MAX)
        .min(MAX_RANKS_PER_HOST))
}

/// The most ranks one host process takes (memory maps: about 20 a rank).
pub const MAX_RANKS_PER_HOST: usize = 1000;

/// Ranks a simulated node holds: its ranks share one address.
const RANKS_PER_NODE: u32 = 8;

/// The loopback address of `rank`'s simulated node (`127.1.0.0` for the first): the ranks of a
/// job across machines listen and connect from their own machine's address, and one machine's
/// thousands of listeners on one address made every bind search the machine's ports (the
/// kernel's port search was most of a 8,192-rank start-up's work here).
fn node_address(rank: Rank) -> std::net::IpAddr {
    let [_, a, b, c] = (rank.0 / RANKS_PER_NODE).to_be_bytes();
    std::net::IpAddr::from([127, a.saturating_add(1), b, c])
}

/// What a rank of the job needs to join it.
#[derive(Debug, Clone)]
struct Job {
    world: WorldSize,
    port: u16,
    token: JobToken,
    heartbeat: Duration,
    fault_tolerant: bool,
    /// The etcd cluster that keeps the store, its endpoints separated by `;`.
    etcd: Option<String>,
}

impl Job {
    /// The job's timeouts: the heartbeat bound as asked; the stall bound and the collective
    /// deadline far beyond it, so that only the kill can end the measured all-reduce.
    fn timeouts(&self) -> Timeouts {
        Timeouts {
            rendezvous: Duration::from_secs(300),
            store: Duration::from_secs(300),
            collective: Duration::from_secs(600),
            heartbeat: self.heartbeat,
            stall: Duration::from_secs(600),
        }
    }

    fn config(&self, rank: Rank) -> GroupConfig {
        let mut master = MasterAddr::new("127.0.0.1", self.port).with_local(node_address(rank));
        if let Some(store) = self
            .etcd
            .as_ref()
            .and_then(|e| crate::config::EtcdStore::parse(&e.replace(';', ",")).ok())
        {
            master = master.with_etcd(store);
        }
        let config = GroupConfig::new(rank, self.world, self.token.clone())
            .with_master(master)
            .with_timeouts(self.timeouts())
            .with_algorithm(Algorithm::Auto)
            .with_transport(Transport::Tcp)
            .with_debug_desync(false);
        match self.fault_tolerant {
            true => config.with_fault_tolerance(crate::config::FaultTolerance::default()),
            false => config,
        }
    }
}

/// The host processes of one job and what they say, with the deadline of the next answer.
struct Run {
    rx: mpsc::Receiver<(usize, String)>,
    /// Lines received and not yet expected, by host.
    queued: Vec<std::collections::VecDeque<String>>,
    procs: Vec<Host>,
    n: u32,
    deadline: Instant,
}

impl Run {
    /// The next line of each host of `hosts` (in their order), by the deadline, which must be
    /// `word ...`; a host that says anything else (`failed ...`), ends, or is late fails the job.
    fn expect(&mut self, hosts: &[usize], word: &str) -> Result<Vec<Vec<String>>> {
        let mut got = Vec::with_capacity(hosts.len());
        for &host in hosts {
            let line = loop {
                if let Some(line) = self.queued[host].pop_front() {
                    break line;
                }
                let left = self.deadline.saturating_duration_since(Instant::now());
                let (from, line) = self.rx.recv_timeout(left).map_err(|_| {
                    job_failed(self.n, &format!("host process {host} never said `{word}`"))
                })?;
                // A host that failed or ended fails the job at once, whoever was awaited.
                if line.starts_with("failed") || (line == "ended" && from != 1) {
                    let hint = machine_hint(&line);
                    return Err(job_failed(
                        self.n,
                        &format!("host process {from}: {line}{hint}"),
                    ));
                }
                self.queued[from].push_back(line);
            };
            let words: Vec<String> = line.split_whitespace().map(str::to_owned).collect();
            if words.first().map(String::as_str) != Some(word) {
                return Err(job_failed(self.n, &format!("host process {host}: {line}")));
            }
            got.push(words);
        }
        Ok(got)
    }

    fn send(&mut self, host: usize, line: &str) -> Result<()> {
        self.procs[host].say(line)
    }
}

/// One host process: its ranks as threads (`--host`), told what to do on its stdin, answering
/// on its stdout (forwarded, line by line, to the benchmark's channel).
struct Host {
    child: Child,
    stdin: Option<std::process::ChildStdin>,
}

impl Host {
    fn spawn(
        job: &Job,
        index: usize,
        ranks: &[Rank],
        tx: mpsc::Sender<(usize, String)>,
    ) -> Result<Self> {
        use std::os::unix::process::CommandExt;
        let list: Vec<String> = ranks.iter().map(|r| r.0.to_string()).collect();
        let spec = format!(
            "{},{},{},{},{},{}",
            job.world,
            job.port,
            job.heartbeat.as_millis(),
            u8::from(job.fault_tolerant),
            job.etcd.as_deref().unwrap_or("-"),
            list.join(":")
        );
        let mut cmd = Command::new(std::env::current_exe()?);
        cmd.args(["bench", "scale", "--host", &spec])
            .env(crate::config::env::JOB_TOKEN, job.token.expose())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            // The ranks' logs, when asked for (`RUST_LOG`), on the benchmark's own stderr.
            .stderr(match crate::config::env::logs_asked() {
                true => Stdio::inherit(),
                false => Stdio::null(),
            });
        // SAFETY: the closure runs in the child between fork and exec and only makes one
        // async-signal-safe system call (prctl), touching no memory shared with the parent.
        unsafe {
            cmd.pre_exec(crate::sys::die_with_parent);
        }
        let mut child = cmd.spawn()?;
        let stdin = child.stdin.take();
        if let Some(out) = child.stdout.take() {
            std::thread::spawn(move || {
                use std::io::BufRead;
                for line in std::io::BufReader::new(out).lines().map_while(|l| l.ok()) {
                    if tx.send((index, line)).is_err() {
                        break;
                    }
                }
                let _ = tx.send((index, "ended".into()));
            });
        }
        Ok(Self { child, stdin })
    }

    fn say(&mut self, line: &str) -> Result<()> {
        match &mut self.stdin {
            Some(stdin) => Ok(writeln!(stdin, "{line}")?),
            None => Ok(()),
        }
    }

    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Waits up to `grace` for the process to end (its stdin closed), then kills it.
    fn finish(&mut self, grace: Duration) {
        self.stdin = None;
        let until = Instant::now() + grace;
        while Instant::now() < until {
            if matches!(self.child.try_wait(), Ok(Some(_)) | Err(_)) {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        self.kill();
    }
}

impl Drop for Host {
    fn drop(&mut self) {
        self.kill();
    }
}

/// What a rank's thread reports to its host process.
enum Report {
    Ready(u64, Option<ProcessGroup>),
    Synced,
    /// The rank it blamed, when, what it said; in a fault-tolerant job, when it was in the
    /// membership without the killed rank.
    Named(Option<Rank>, u64, String, Option<u64>),
    Failed(Rank, String),
}

/// One rank of the job, on a thread of its host process.
fn rank_task(job: &Job, rank: Rank, tx: &mpsc::Sender<Report>, go: &Barrier, end: &Barrier) {
    let pg = match ProcessGroup::init(job.config(rank)) {
        Ok(pg) => pg,
        Err(e) => {
            let _ = tx.send(Report::Failed(rank, e.to_string()));
            return;
        }
    };
    let handed = (rank == Rank(0)).then(|| pg.clone());
    let _ = tx.send(Report::Ready(unix_ns(), handed));
    let mut x = [1.0f32];
    if let Err(e) = pg.all_reduce(&mut x, ReduceOp::Sum) {
        let _ = tx.send(Report::Failed(rank, e.to_string()));
        return;
    }
    let _ = tx.send(Report::Synced);
    go.wait();
    let report = match pg.all_reduce(&mut x, ReduceOp::Sum) {
        Ok(()) => Report::Failed(
            rank,
            "the all-reduce without the killed rank completed".into(),
        ),
        Err(e) if job.fault_tolerant => {
            let named = unix_ns();
            match changed(&pg, &e, job.world.get() - 1) {
                Ok(at) => Report::Named(e.culprit(), named, e.to_string(), Some(at)),
                Err(why) => Report::Failed(rank, why),
            }
        }
        Err(e) => Report::Named(e.culprit(), unix_ns(), e.to_string(), None),
    };
    let _ = tx.send(report);
    // The group lives until every rank has named the killed one: a rank that left early would
    // be named by its neighbours instead.
    end.wait();
}

/// After `cause`, the membership without the killed rank (`survivors` ranks): when
/// `ProcessGroup::recover` returned; an all-reduce on it must count every survivor.
fn changed(
    pg: &ProcessGroup,
    cause: &DdpError,
    survivors: u32,
) -> std::result::Result<u64, String> {
    pg.recover(cause, Some(1))
        .map_err(|e| format!("the membership change failed: {e}"))?;
    let at = unix_ns();
    let mut one = [1.0f32];
    pg.all_reduce(&mut one, ReduceOp::Sum)
        .map_err(|e| format!("the first all-reduce of the new membership failed: {e}"))?;
    if one[0] != survivors as f32 || pg.world_size().get() != survivors {
        return Err(format!(
            "the new membership has {} ranks and its all-reduce counted {}, not {survivors}",
            pg.world_size(),
            one[0]
        ));
    }
    Ok(at)
}

/// A host process (`--host WORLD,PORT,HEARTBEAT_MS,FT,ETCD,R1:R2:...`, ETCD the endpoints
/// separated by `;` or `-`, the token in
/// `BURN_DDP_JOB_TOKEN`): its ranks as threads. It says `ready COUNT LAST_INIT_NS` once every
/// rank joined, `synced` after the first all-reduce, and on `go` runs the second and says
/// `named COUNT OTHERS LAST_FAILURE_NS LAST_CHANGE_NS` (OTHERS: ranks that blamed another than
/// the lone rank of the job, the middle one; LAST_CHANGE_NS: in a fault-tolerant job, the last
/// rank in the membership without it, else 0); rank 0's host answers `measure INTERVAL_MS WINDOW` with
/// `traffic AUX_REQUESTS AUX_BYTES NANOSECONDS`. `end` (or its stdin closing) ends it; a rank's
/// failure is said as `failed RANK: ERROR`.
///
/// # Errors
/// A malformed spec; this process's limits too low for its ranks.
pub fn run_host(spec: &str) -> Result<()> {
    let hosted = host(spec);
    if let Err(e) = &hosted {
        println!("failed host: {e}");
    }
    hosted
}

fn host(spec: &str) -> Result<()> {
    use std::io::BufRead;
    let bad = || {
        config_error(
            "--host",
            "expected WORLD,PORT,HEARTBEAT_MS,FT,ETCD,R1:R2:...",
        )
    };
    let parts: Vec<&str> = spec.split(',').collect();
    let [world, port, heartbeat_ms, fault_tolerant, etcd, list] = parts[..] else {
        return Err(bad());
    };
    let world = WorldSize::new(world.parse().map_err(|_| bad())?).ok_or_else(bad)?;
    let ranks: Vec<Rank> = list
        .split(':')
        .map(|r| r.parse().map(Rank).map_err(|_| bad()))
        .collect::<Result<_>>()?;
    let token = crate::config::env::job_token().ok_or_else(bad)?;
    let job = Job {
        world,
        port: port.parse().map_err(|_| bad())?,
        token: JobToken::new(token),
        heartbeat: Duration::from_millis(heartbeat_ms.parse().map_err(|_| bad())?),
        fault_tolerant: fault_tolerant == "1",
        etcd: (etcd != "-").then(|| etcd.to_owned()),
    };
    // Rank 0's process holds the store's side of every connection too (not a fault-tolerant
    // job's: the benchmark serves it).
    let serves = ranks.contains(&Rank(0)) && !job.fault_tolerant;
    let per_rank = descriptors_per_rank(world.get(), job.fault_tolerant, job.etcd.is_some());
    let fds = ranks.len() as u64 * per_rank
        + if serves {
            u64::from(world.get()) * 2
        } else {
            0
        };
    raise_open_files(fds + 1024)?;
    let lone = ranks.len() == 1 && ranks[0] == Rank(world.get() / 2);
    let (tx, rx) = mpsc::channel::<Report>();
    let go = Arc::new(Barrier::new(ranks.len() + 1));
    let end = Arc::new(Barrier::new(ranks.len() + 1));
    let mut out = std::io::stdout().lock();
    for &r in &ranks {
        let (job, tx, go, end) = (job.clone(), tx.clone(), Arc::clone(&go), Arc::clone(&end));
        let spawned = std::thread::Builder::new()
            .name(format!("scale-rank-{r}"))
            .stack_size(512 * 1024)
            .spawn(move || rank_task(&job, r, &tx, &go, &end));
        if let Err(e) = spawned {
            writeln!(
                out,
                "failed {r}: no thread for it ({e}): this machine's thread limits \
                           (kernel.threads-max, vm.max_map_count, RLIMIT_NPROC) are too low"
            )?;
            return Ok(());
        }
    }
    drop(tx);
    let next = |want: usize| -> Vec<Report> {
        rx.iter()
            .take(want)
            .inspect(|r| {
                if let Report::Failed(rank, e) = r {
                    let _ = writeln!(std::io::stdout(), "failed {rank}: {e}");
                }
            })
            .collect()
    };
    let ready = next(ranks.len());
    if ready.iter().any(|r| matches!(r, Report::Failed(..))) {
        return Ok(());
    }
    let last = ready.iter().filter_map(|r| match r {
        Report::Ready(at, _) => Some(*at),
        _ => None,
    });
    writeln!(out, "ready {} {}", ranks.len(), last.max().unwrap_or(0))?;
    let rank0 = ready.into_iter().find_map(|r| match r {
        Report::Ready(_, pg) => pg,
        _ => None,
    });
    if next(ranks.len())
        .iter()
        .any(|r| matches!(r, Report::Failed(..)))
    {
        return Ok(());
    }
    writeln!(out, "synced")?;
    out.flush()?;
    let lines = std::io::stdin().lock().lines().map_while(|l| l.ok());
    for line in lines {
        let words: Vec<&str> = line.split_whitespace().collect();
        match words[..] {
            ["measure", interval_ms, window] => {
                let interval = Duration::from_millis(interval_ms.parse().unwrap_or(2000));
                let window: u32 = window.parse().unwrap_or(1);
                let traffic = || {
                    rank0
                        .as_ref()
                        .and_then(ProcessGroup::served_store_traffic)
                        .unwrap_or_default()
                };
                writeln!(out, "{}", measure(interval, window, traffic).join(" "))?;
            }
            ["go"] if !lone => {
                go.wait();
                let named = next(ranks.len());
                let lone_rank = Rank(world.get() / 2);
                let (mut last, mut changed, mut others, mut said) = (0, 0, 0, String::new());
                for r in &named {
                    if let Report::Named(culprit, at, text, change) = r {
                        last = last.max(*at);
                        changed = changed.max(change.unwrap_or(0));
                        if *culprit != Some(lone_rank) {
                            others += 1;
                            said.clone_from(text);
                        }
                    }
                }
                if named.iter().any(|r| matches!(r, Report::Failed(..))) {
                    return Ok(());
                }
                writeln!(
                    out,
                    "named {} {others} {last} {changed} {said}",
                    named.len()
                )?;
            }
            ["end"] => break,
            _ => {}
        }
        out.flush()?;
    }
    if !lone {
        drop(rank0);
        end.wait();
    }
    Ok(())
}

/// A cluster of etcd members on this machine (Debian's `etcd`), each stopped by its PID when
/// dropped, with its data directory removed.
struct EtcdCluster {
    members: Vec<Child>,
    dirs: Vec<std::path::PathBuf>,
    endpoints: Vec<String>,
}

impl EtcdCluster {
    /// Starts `size` members and waits (up to 30 s) until every one reports itself healthy.
    fn start(size: usize) -> Result<Self> {
        let ports: Vec<(u16, u16)> = (0..size)
            .map(|_| Ok((free_port()?, free_port()?)))
            .collect::<Result<_>>()?;
        let initial: Vec<String> = ports
            .iter()
            .enumerate()
            .map(|(i, (_, peer))| format!("m{i}=http://127.0.0.1:{peer}"))
            .collect();
        let mut cluster = Self {
            members: Vec::new(),
            dirs: Vec::new(),
            endpoints: ports
                .iter()
                .map(|(client, _)| format!("127.0.0.1:{client}"))
                .collect(),
        };
        for (i, (client, peer)) in ports.iter().enumerate() {
            let dir = std::env::temp_dir().join(format!(
                "burn-ddp-scale-etcd-{}-{client}",
                std::process::id()
            ));
            let _ = std::fs::remove_dir_all(&dir);
            let member = Command::new("etcd")
                .args(["--name", &format!("m{i}"), "--data-dir"])
                .arg(&dir)
                .args([
                    "--listen-client-urls",
                    &format!("http://127.0.0.1:{client}"),
                    "--advertise-client-urls",
                    &format!("http://127.0.0.1:{client}"),
                    "--listen-peer-urls",
                    &format!("http://127.0.0.1:{peer}"),
                    "--initial-advertise-peer-urls",
                    &format!("http://127.0.0.1:{peer}"),
                    "--initial-cluster",
                    &initial.join(","),
                    "--initial-cluster-state",
                    "new",
                ])
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .map_err(|e| {
                    config_error(
                        "--store etcd",
                        &format!(
                            "could not start etcd ({e}): install it (Debian: `apt-get install \
                             etcd-server`)"
                        ),
                    )
                })?;
            cluster.members.push(member);
            cluster.dirs.push(dir);
        }
        let until = Instant::now() + Duration::from_secs(30);
        for e in &cluster.endpoints {
            while !http_get(e, "/health").is_some_and(|b| b.contains("\"health\":\"true\"")) {
                if Instant::now() >= until {
                    return Err(config_error(
                        "--store etcd",
                        &format!("the etcd member at {e} was not healthy within 30 s"),
                    ));
                }
                std::thread::sleep(Duration::from_millis(200));
            }
        }
        Ok(cluster)
    }

    /// What the members served so far, from their `/metrics`: unary gRPC requests handled
    /// (as `aux_requests`) and gRPC bytes received and sent (as `aux_bytes`).
    fn traffic(&self) -> crate::StoreTraffic {
        let mut t = crate::StoreTraffic::default();
        for e in &self.endpoints {
            let text = http_get(e, "/metrics").unwrap_or_default();
            for line in text.lines().filter(|l| !l.starts_with('#')) {
                let Some((name, value)) = line.rsplit_once(' ') else {
                    continue;
                };
                let value = value.parse::<f64>().unwrap_or(0.0) as u64;
                if name.starts_with("grpc_server_handled_total{") && name.contains("unary") {
                    t.aux_requests += value;
                } else if name == "etcd_network_client_grpc_received_bytes_total"
                    || name == "etcd_network_client_grpc_sent_bytes_total"
                {
                    t.aux_bytes += value;
                }
            }
        }
        t
    }
}

impl Drop for EtcdCluster {
    fn drop(&mut self) {
        for m in &mut self.members {
            let _ = m.kill();
            let _ = m.wait();
        }
        for d in &self.dirs {
            let _ = std::fs::remove_dir_all(d);
        }
    }
}

/// The body of `GET path` from `host:port` (HTTP/1.0, a second to connect and 5 to read).
fn http_get(endpoint: &str, path: &str) -> Option<String> {
    use std::io::Read;
    let addr: std::net::SocketAddr = endpoint.parse().ok()?;
    let mut s = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(1)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: {endpoint}\r\n\r\n").ok()?;
    let mut text = String::new();
    s.read_to_string(&mut text).ok()?;
    text.split_once("\r\n\r\n").map(|(_, body)| body.to_owned())
}

/// Nanoseconds since the Unix epoch: one clock for every process of this machine.
fn unix_ns() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
}

/// Raises this process's open-file limit to at least `want`.
///
/// # Errors
/// The limit cannot reach `want` (the hard limit is lower and this process may not raise it):
/// the error says how to raise it.
fn raise_open_files(want: u64) -> Result<()> {
    let (soft, hard) = crate::sys::raise_open_files(want)?;
    if soft >= want {
        return Ok(());
    }
    Err(config_error(
        "--ranks",
        &format!(
            "this many ranks need {want} open files and this process may open {soft} (hard \
             limit {hard}): raise it (`ulimit -Hn {want}` as root, or LimitNOFILE in a \
             systemd unit)"
        ),
    ))
}

/// Threads a rank of the benchmark runs (its own, its heartbeat's, its point-to-point
/// endpoint's, its links' acceptor while it starts; a fault-tolerant one its membership
/// service's and join watcher's too), with a margin.
fn threads_per_rank(fault_tolerant: bool) -> u64 {
    match fault_tolerant {
        true => 8,
        false => 5,
    }
}

/// Checks that this machine can run the threads of `n` ranks: every thread takes a process id,
/// and the kernel's `pid_max` (32,768 by default) is a limit for the whole machine.
///
/// # Errors
/// Too few ids, naming the fix.
fn check_threads(n: u32, fault_tolerant: bool) -> Result<()> {
    let read =
        |path: &str| -> Option<u64> { std::fs::read_to_string(path).ok()?.trim().parse().ok() };
    let need = u64::from(n) * threads_per_rank(fault_tolerant) + 2_000;
    for (path, name) in [
        ("/proc/sys/kernel/pid_max", "kernel.pid_max"),
        ("/proc/sys/kernel/threads-max", "kernel.threads-max"),
    ] {
        match read(path) {
            Some(have) if have < need => {
                return Err(config_error(
                    "--ranks",
                    &format!(
                        "{n} ranks run about {need} threads and this machine allows {have} \
                         ({name}): raise it (as root: `sysctl -w {name}={}`)",
                        need.next_power_of_two()
                    ),
                ))
            }
            _ => {}
        }
    }
    Ok(())
}

/// Says (on stderr) when the kernel caps the store's listen queue below the connections `n`
/// ranks open at once (a member connection and a heartbeat connection each): the ones past it
/// wait for the kernel's retries, and the benchmark measures the machine's limit, not the
/// store.
fn warn_listen_queue(n: u32) {
    let want = u64::from(n) * 2 + 64;
    if let Some(cap) = crate::sys::listen_queue_cap().filter(|&cap| u64::from(cap) < want) {
        eprintln!(
            "note: {n} ranks open up to {want} store connections at once and this machine \
             queues {cap} (net.core.somaxconn): raise it (as root: `sysctl -w \
             net.core.somaxconn={}`)",
            want.next_power_of_two()
        );
    }
}

/// What the machine says about a host's failure that its limits explain: ephemeral ports (a
/// job of thousands of ranks on one machine holds tens of thousands of connections and
/// listeners, and the connections of the previous jobs wait out TIME_WAIT for a minute), or
/// threads.
fn machine_hint(line: &str) -> String {
    if line.contains("os error 98") || line.contains("os error 99") {
        let range = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
            .map(|r| r.split_whitespace().collect::<Vec<_>>().join("-"))
            .unwrap_or_else(|_| "?".into());
        let waiting = std::fs::read_to_string("/proc/net/sockstat")
            .ok()
            .and_then(|s| {
                let tcp = s.lines().find(|l| l.starts_with("TCP:"))?;
                let words: Vec<&str> = tcp.split_whitespace().collect();
                let i = words.iter().position(|w| *w == "tw")?;
                words.get(i + 1).map(|w| (*w).to_string())
            })
            .unwrap_or_else(|| "?".into());
        return format!(
            " (this machine ran out of ports: its ephemeral range is {range} and {waiting} \
             connections wait in TIME_WAIT; wait a minute after a large job, or widen the range \
             as root: `sysctl -w net.ipv4.ip_local_port_range=\"10000 65535\"`)"
        );
    }
    if line.contains("os error 11") {
        return " (a thread could not start: see kernel.pid_max, kernel.threads-max and \
                 `ulimit -u`)"
            .into();
    }
    String::new()
}

/// A port free on this machine now.
fn free_port() -> Result<u16> {
    let l = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok(l.local_addr()?.port())
}

fn config_error(option: &'static str, reason: &str) -> DdpError {
    DdpError::Config(ConfigError::InvalidOption {
        option,
        reason: reason.to_owned(),
    })
}

fn job_failed(n: u32, what: &str) -> DdpError {
    config_error("--ranks", &format!("the job of {n} ranks failed: {what}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bench(ranks: Vec<u32>) -> ScaleBench {
        ScaleBench {
            ranks,
            heartbeat: Duration::from_secs(3),
            window: 3,
            fault_tolerant: false,
            store: ScaleStore::Builtin,
        }
    }

    #[test]
    fn options_out_of_range_are_refused_naming_the_fix() {
        for ranks in [vec![], vec![2], vec![8, 70_000]] {
            let e = bench(ranks).check().unwrap_err().to_string();
            assert!(e.contains("--ranks"), "{e}");
        }
        assert!(bench(vec![3, 8192]).check().is_ok());
        let fast = ScaleBench {
            heartbeat: Duration::from_millis(10),
            ..bench(vec![4])
        };
        assert!(fast.check().unwrap_err().to_string().contains("heartbeat"));
        let etcd = ScaleBench {
            store: ScaleStore::Etcd,
            ..bench(vec![4])
        };
        let e = etcd.check().unwrap_err().to_string();
        assert!(e.contains("add --fault-tolerant"), "{e}");
        let etcd = ScaleBench {
            fault_tolerant: true,
            ..etcd
        };
        assert_eq!(etcd.check().is_ok(), cfg!(feature = "etcd"));
    }

    #[test]
    fn rows_print_in_the_issue_format_and_growth_against_the_ranks() {
        let row = |ranks, req: f64| ScaleRow {
            ranks,
            init: Duration::from_millis(1500),
            hb_requests_per_interval: req,
            hb_bytes_per_interval: req * 50.0,
            detect: Duration::from_millis(2250),
            change: None,
        };
        let (a, b) = (row(256, 1024.0), row(1024, 4096.0));
        assert_eq!(
            b.line(),
            "scale ranks=1024 init_s=1.50 hb_requests_per_interval=4096 \
             hb_bytes_per_interval=204800 detect_s=2.25"
        );
        assert_eq!(
            b.growth_line(&a),
            "scale growth ranks=256->1024 ranks_x=4.00 hb_requests_x=4.00 hb_bytes_x=4.00"
        );
    }

    /// A host that ran out of ports or threads is told which of the machine's limits and how to
    /// raise it; other failures are left as they are.
    #[test]
    fn a_host_failure_the_machine_explains_names_its_limit() {
        let ports = machine_hint("failed 12: Address already in use (os error 98)");
        assert!(ports.contains("ip_local_port_range"), "{ports}");
        assert!(ports.contains("TIME_WAIT"), "{ports}");
        let threads = machine_hint("failed 3: Resource temporarily unavailable (os error 11)");
        assert!(threads.contains("kernel.pid_max"), "{threads}");
        assert_eq!(machine_hint("failed 5: rank 0 stopped answering"), "");
    }
}
