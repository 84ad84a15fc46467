//! Starting the ranks of one node as child processes and supervising them (the core of
//! `burn-ddp run`, of the bandwidth tool and of the multi-process test harness).
//!
//! Each child gets the torchrun environment. The supervisor polls the children every
//! 100 ms; the first one that fails gets named, and the others get SIGTERM, then SIGKILL after a
//! grace period, so a job never outlives one of its ranks by more than the grace period.

use crate::error::JobError;
use std::ffi::OsString;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use crate::config::env;
use crate::config::{JobToken, MasterAddr};
use crate::sys::Signal;
use crate::types::Rank;
use crate::{DdpError, Result};

/// Where the children's output goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Output {
    /// Children write to the launcher's stdout/stderr directly.
    Inherit,
    /// Each line is prefixed with `[rank N] ` (torchrun's `--tee` with a prefix).
    Prefixed,
    /// Captured; returned in [`RankExit::output`] (for tests).
    Capture,
    /// Rank 0 writes to the launcher's terminal directly, so that Burn's dashboard can take
    /// it; the other ranks' lines are prefixed. Chosen by [`Output::auto`] when stdout is a
    /// terminal.
    Dashboard,
}

impl Output {
    /// [`Dashboard`](Self::Dashboard) when the launcher's stdout is a terminal, else
    /// [`Prefixed`](Self::Prefixed).
    pub fn auto() -> Self {
        if std::io::IsTerminal::is_terminal(&std::io::stdout()) {
            Output::Dashboard
        } else {
            Output::Prefixed
        }
    }
}

/// A node's worth of ranks to start.
#[derive(Debug, Clone)]
pub struct LocalJob {
    /// The program to run.
    pub program: PathBuf,
    /// Its arguments.
    pub args: Vec<OsString>,
    /// Extra environment for every rank.
    pub env: Vec<(OsString, OsString)>,
    /// Ranks on this node.
    pub nproc_per_node: u32,
    /// Number of nodes.
    pub nnodes: u32,
    /// This node's index.
    pub node_rank: u32,
    /// Rank 0's store.
    pub master: MasterAddr,
    /// The job secret.
    pub token: JobToken,
    /// Where output goes.
    pub output: Output,
    /// How long the others get between SIGTERM and SIGKILL once a rank failed.
    pub grace: Duration,
    /// Kill everything if the job runs longer than this.
    pub deadline: Option<Duration>,
    /// Set from outside (a signal handler) to stop every rank.
    pub stop: Option<Arc<AtomicBool>>,
    /// Set from outside to stop every rank because the job's membership changes (the elastic
    /// launcher): neither a failure nor an interruption; [`JobReport::halted`] says it
    /// happened.
    pub halt: Option<Arc<AtomicBool>>,
}

impl LocalJob {
    /// A single-node job of `nproc` ranks running `program args`, on a free local port.
    ///
    /// # Errors
    /// No free port could be found.
    pub fn standalone(
        program: impl Into<PathBuf>,
        args: Vec<OsString>,
        nproc: u32,
    ) -> Result<Self> {
        Ok(Self {
            program: program.into(),
            args,
            env: Vec::new(),
            nproc_per_node: nproc,
            nnodes: 1,
            node_rank: 0,
            master: MasterAddr::new("127.0.0.1", free_port()?),
            token: JobToken::generate(),
            output: Output::auto(),
            grace: Duration::from_secs(5),
            deadline: None,
            stop: None,
            halt: None,
        })
    }

    /// The environment of local rank `local`.
    pub fn rank_env(&self, local: u32) -> Vec<(OsString, OsString)> {
        let world = self.nproc_per_node * self.nnodes;
        let rank = self.node_rank * self.nproc_per_node + local;
        let mut vars: Vec<(OsString, OsString)> = [
            (env::RANK, rank.to_string()),
            (env::WORLD_SIZE, world.to_string()),
            (env::LOCAL_RANK, local.to_string()),
            (env::LOCAL_WORLD_SIZE, self.nproc_per_node.to_string()),
            ("GROUP_RANK", self.node_rank.to_string()),
            ("ROLE_RANK", rank.to_string()),
            ("ROLE_WORLD_SIZE", world.to_string()),
            (env::MASTER_ADDR, self.master.host.clone()),
            (env::MASTER_PORT, self.master.port.to_string()),
            (env::JOB_TOKEN, self.token.expose().to_string()),
        ]
        .into_iter()
        .map(|(k, v)| (OsString::from(k), OsString::from(v)))
        .collect();
        // As torchrun: one compute thread per process unless the user chose otherwise, so N
        // ranks do not oversubscribe the cores N times over.
        if self.nproc_per_node > 1 && !env::omp_num_threads_set() {
            vars.push(("OMP_NUM_THREADS".into(), "1".into()));
        }
        if let Some(etcd) = &self.master.etcd {
            vars.push((env::ETCD_ENDPOINTS.into(), etcd.endpoints.join(",").into()));
            let sec = &etcd.security;
            let files = [
                (env::ETCD_CA, &sec.ca),
                (env::ETCD_CERT, &sec.cert),
                (env::ETCD_KEY, &sec.key),
            ];
            for (var, file) in files {
                if let Some(f) = file {
                    vars.push((var.into(), f.clone().into_os_string()));
                }
            }
            let user = [
                (env::ETCD_USER, &sec.user),
                (env::ETCD_PASSWORD, &sec.password),
            ];
            for (var, value) in user {
                if let Some(v) = value {
                    vars.push((var.into(), v.into()));
                }
            }
        }
        vars.extend(self.env.iter().cloned());
        vars
    }
}

/// How one rank ended.
#[derive(Debug)]
pub struct RankExit {
    /// Its global rank.
    pub rank: Rank,
    /// Its exit status.
    pub status: ExitStatus,
    /// Whether the launcher stopped it after another rank failed.
    pub stopped: bool,
    /// Captured stdout and stderr (only with [`Output::Capture`]).
    pub output: String,
}

/// How the job ended: every rank's exit, and the first failure if any.
#[derive(Debug)]
pub struct JobReport {
    /// One entry per local rank.
    pub exits: Vec<RankExit>,
    /// The first rank that failed, with how (what `burn-ddp run` reports).
    pub failure: Option<DdpError>,
    /// Whether [`LocalJob::halt`] stopped the ranks (before all of them had ended).
    pub halted: bool,
}

impl JobReport {
    /// `Ok` if every rank succeeded, the first failure otherwise.
    ///
    /// # Errors
    /// `RankFailed` naming the first rank that failed.
    pub fn into_result(self) -> Result<Vec<RankExit>> {
        match self.failure {
            Some(e) => Err(e),
            None => Ok(self.exits),
        }
    }
}

/// Picks a free TCP port on the loopback interface for a job's store.
///
/// The port is free when picked and bound by rank 0 a moment later. A port from the OS's
/// ephemeral range (what binding port 0 hands out) can be taken in between by any process's
/// outgoing connection, so the pick is a random port outside that range (Linux's
/// `ip_local_port_range`, 32768–60999 by default): below it from 20000, or above it, whichever
/// is wider, which only an explicit bind takes. The OS's own choice is the fallback when 64
/// tries find none free, or when the range leaves fewer than 1,024 ports outside
/// it (a machine whose range was widened: a narrow window would hand concurrent jobs the same
/// port).
///
/// # Errors
/// The OS refused to bind.
pub fn free_port() -> Result<u16> {
    if let Some((low, high)) = picked_ports(ephemeral_ports()) {
        for _ in 0..64 {
            let port = rand::random_range(low..=high);
            if TcpListener::bind(("127.0.0.1", port)).is_ok() {
                return Ok(port);
            }
        }
    }
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// The lowest port [`free_port`] picks: above the registered ports most services use by default.
const FIRST_PICKED_PORT: u16 = 20000;
/// The fewest ports [`free_port`] picks among.
const MIN_PICKED_PORTS: u16 = 1024;

/// The ports [`free_port`] picks among, `(first, last)`, given the OS's ephemeral range: the
/// wider window outside it, from [`FIRST_PICKED_PORT`] up; none when both are narrower than
/// [`MIN_PICKED_PORTS`].
fn picked_ports((start, end): (u16, u16)) -> Option<(u16, u16)> {
    let window = |first: u16, last: u16| (first <= last).then_some((first, last));
    let below = start
        .checked_sub(1)
        .and_then(|last| window(FIRST_PICKED_PORT, last));
    let above = end
        .checked_add(1)
        .and_then(|first| window(first.max(FIRST_PICKED_PORT), u16::MAX));
    let width = |w: Option<(u16, u16)>| w.map_or(0, |(a, b)| u32::from(b - a) + 1);
    let wider = if width(below) >= width(above) {
        below
    } else {
        above
    };
    wider.filter(|_| width(wider) >= u32::from(MIN_PICKED_PORTS))
}

/// The OS's ephemeral port range (`/proc/sys/net/ipv4/ip_local_port_range`), or Linux's
/// default when unknown.
fn ephemeral_ports() -> (u16, u16) {
    let read = || -> Option<(u16, u16)> {
        let s = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range").ok()?;
        let mut words = s.split_whitespace().map(str::parse);
        Some((words.next()?.ok()?, words.next()?.ok()?))
    };
    read().unwrap_or((32768, 60999))
}

/// Describes an exit status the way a user reads it.
pub fn describe(status: ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    if let Some(code) = status.code() {
        return format!("exited with status {code}");
    }
    match status.signal() {
        Some(sig) => format!("was killed by signal {sig} ({})", signal_name(sig)),
        None => "ended for an unknown reason".to_string(),
    }
}

fn signal_name(sig: i32) -> &'static str {
    match sig {
        1 => "SIGHUP",
        2 => "SIGINT",
        3 => "SIGQUIT",
        4 => "SIGILL",
        6 => "SIGABRT",
        7 => "SIGBUS",
        8 => "SIGFPE",
        9 => "SIGKILL",
        11 => "SIGSEGV",
        13 => "SIGPIPE",
        15 => "SIGTERM",
        _ => "signal",
    }
}

pub(crate) struct Running {
    pub(crate) rank: Rank,
    pub(crate) child: Child,
    pub(crate) exit: Option<ExitStatus>,
    pub(crate) stopped: bool,
    pub(crate) readers: Vec<JoinHandle<String>>,
}

impl Running {
    /// The captured output (with [`Output::Capture`]), once the process has ended.
    pub(crate) fn into_exit(self) -> RankExit {
        let output = self
            .readers
            .into_iter()
            .filter_map(|h| h.join().ok())
            .collect::<Vec<_>>()
            .join("");
        RankExit {
            rank: self.rank,
            // Every child has exited when the supervisor stops polling.
            status: self
                .exit
                .unwrap_or_else(|| std::os::unix::process::ExitStatusExt::from_raw(0)),
            stopped: self.stopped,
            output,
        }
    }
}

/// Starts local rank `local` of `job` as global rank `rank`, with `extra` on top of its
/// environment.
///
/// # Errors
/// `Spawn` if the program cannot be started.
pub(crate) fn start_rank(
    job: &LocalJob,
    local: u32,
    rank: Rank,
    extra: &[(OsString, OsString)],
) -> Result<Running> {
    let mut cmd = Command::new(&job.program);
    cmd.args(&job.args)
        .envs(job.rank_env(local))
        .envs(extra.iter().cloned())
        .stdin(Stdio::null());
    let direct =
        job.output == Output::Inherit || (job.output == Output::Dashboard && rank == Rank(0));
    if !direct {
        cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
        if job.output != Output::Capture {
            cmd.env(env::RANK_MARKERS, "1");
        }
    }
    // SAFETY: the closure runs in the child between fork and exec and only makes one
    // async-signal-safe system call (prctl), touching no memory shared with the parent.
    unsafe {
        cmd.pre_exec(|| {
            // If the launcher dies (even by SIGKILL), its ranks die with it instead of
            // lingering in a collective forever.
            crate::sys::die_with_parent()
        });
    }
    let mut child = cmd.spawn().map_err(|source| {
        DdpError::Job(JobError::Spawn {
            rank,
            program: job.program.display().to_string(),
            source,
        })
    })?;
    let mut readers = Vec::new();
    if let Some(out) = child.stdout.take() {
        readers.push(forward(rank, out, job.output, false));
    }
    if let Some(err) = child.stderr.take() {
        readers.push(forward(rank, err, job.output, true));
    }
    Ok(Running {
        rank,
        child,
        exit: None,
        stopped: false,
        readers,
    })
}

/// What the launcher prints for the line `text` of a rank's output: `[rank N] text`, or `None`
/// for a marker, which makes `rank` the rank of the lines after it.
fn prefixed(rank: &mut Rank, text: &str) -> Option<String> {
    if let Some(now) = crate::group::marked_rank(text) {
        *rank = now;
        return None;
    }
    Some(format!("[rank {rank}] {text}\n"))
}

fn forward(
    mut rank: Rank,
    stream: impl Read + Send + 'static,
    output: Output,
    to_stderr: bool,
) -> JoinHandle<String> {
    thread::spawn(move || {
        let mut captured = String::new();
        let mut reader = BufReader::new(stream);
        let mut line = Vec::new();
        loop {
            line.clear();
            match reader.read_until(b'\n', &mut line) {
                Ok(0) | Err(_) => break,
                Ok(_) => {
                    let text = String::from_utf8_lossy(&line);
                    let text = text.trim_end_matches('\n');
                    let Some(msg) = prefixed(&mut rank, text) else {
                        continue;
                    };
                    match output {
                        Output::Capture => {
                            captured.push_str(text);
                            captured.push('\n');
                        }
                        _ => {
                            let _ = if to_stderr {
                                std::io::stderr().lock().write_all(msg.as_bytes())
                            } else {
                                std::io::stdout().lock().write_all(msg.as_bytes())
                            };
                        }
                    }
                }
            }
        }
        captured
    })
}

pub(crate) fn signal(child: &Child, sig: Signal) {
    crate::sys::signal(child.id(), sig);
}

/// Starts the ranks of `job` on this node and supervises them until all have ended.
///
/// # Errors
/// `Spawn` if a rank cannot be started (the ones already started are killed).
pub fn run(job: &LocalJob) -> Result<JobReport> {
    let mut running: Vec<Running> = Vec::new();
    for local in 0..job.nproc_per_node {
        let rank = Rank(job.node_rank * job.nproc_per_node + local);
        match start_rank(job, local, rank, &[]) {
            Ok(r) => running.push(r),
            Err(e) => {
                for r in &mut running {
                    let _ = r.child.kill();
                    let _ = r.child.wait();
                }
                return Err(e);
            }
        }
    }

    let started = Instant::now();
    let mut failure: Option<DdpError> = None;
    let mut term_sent: Option<Instant> = None;
    let mut killed = false;
    let mut halted = false;
    loop {
        let mut ended = Vec::new();
        for r in running.iter_mut().filter(|r| r.exit.is_none()) {
            if let Ok(Some(status)) = r.child.try_wait() {
                r.exit = Some(status);
                if !r.stopped {
                    ended.push((r.rank, r.child.id(), status));
                }
            }
        }
        if failure.is_none() {
            failure = to_blame(&ended);
        }
        if running.iter().all(|r| r.exit.is_some()) {
            break;
        }
        let overdue = job.deadline.is_some_and(|d| started.elapsed() > d);
        let stopped = job.stop.as_ref().is_some_and(|s| s.load(Ordering::SeqCst));
        let halt = job.halt.as_ref().is_some_and(|s| s.load(Ordering::SeqCst));
        if halt && term_sent.is_none() && failure.is_none() {
            halted = true;
        }
        if (failure.is_some() || overdue || stopped || halt) && term_sent.is_none() {
            if overdue && failure.is_none() {
                tracing::error!(
                    "job exceeded its deadline of {:?}; stopping every rank",
                    job.deadline
                );
            }
            if stopped && failure.is_none() {
                failure = Some(DdpError::Job(JobError::Interrupted));
            }
            for r in running.iter_mut().filter(|r| r.exit.is_none()) {
                r.stopped = true;
                signal(&r.child, Signal::Term);
                // A rank frozen by SIGSTOP acts on the SIGTERM only once continued.
                signal(&r.child, Signal::Cont);
            }
            term_sent = Some(Instant::now());
        }
        if let Some(t) = term_sent {
            if !killed && t.elapsed() >= job.grace {
                for r in running.iter_mut().filter(|r| r.exit.is_none()) {
                    let _ = r.child.kill();
                }
                killed = true;
            }
        }
        thread::sleep(Duration::from_millis(100));
    }
    if job.stop.as_ref().is_some_and(|s| s.load(Ordering::SeqCst)) && failure.is_some() {
        // Ctrl-C reaches the ranks too (one process group), and they may die of it before
        // this loop sees the flag: the job was interrupted, not failed (which a launcher with
        // restarts left would answer by restarting).
        failure = Some(DdpError::Job(JobError::Interrupted));
    }
    if failure.is_none() {
        if let Some(limit) = job.deadline.filter(|d| started.elapsed() > *d) {
            failure = Some(DdpError::Job(JobError::RankFailed {
                rank: Rank(job.node_rank * job.nproc_per_node),
                pid: running.first().map(|r| r.child.id()).unwrap_or(0),
                status: format!("did not finish within {limit:?}"),
            }));
        }
    }

    let exits = running.into_iter().map(Running::into_exit).collect();
    Ok(JobReport {
        exits,
        failure,
        halted,
    })
}

/// The failure of the ranks found ended in one round of the supervisor's poll (every 100 ms):
/// the first killed by a signal, else the first that exited with an error, else none. A rank's
/// death makes the others fail their next collective and exit within milliseconds, naming it,
/// so both are often found in the same round, the consequence first in rank order.
fn to_blame(ended: &[(Rank, u32, ExitStatus)]) -> Option<DdpError> {
    use std::os::unix::process::ExitStatusExt;
    let failed = || ended.iter().filter(|(_, _, status)| !status.success());
    let (rank, pid, status) = failed()
        .find(|(_, _, status)| status.signal().is_some())
        .or_else(|| failed().next())?;
    Some(DdpError::Job(JobError::RankFailed {
        rank: *rank,
        pid: *pid,
        status: describe(*status),
    }))
}

/// A flag that SIGINT, SIGTERM and SIGHUP set, for [`LocalJob::stop`].
///
/// # Errors
/// The handlers could not be installed.
pub(crate) fn stop_flag() -> Result<Arc<AtomicBool>> {
    let flag = Arc::new(AtomicBool::new(false));
    for sig in [
        signal_hook::consts::SIGINT,
        signal_hook::consts::SIGTERM,
        signal_hook::consts::SIGHUP,
    ] {
        signal_hook::flag::register(sig, Arc::clone(&flag))?;
    }
    Ok(flag)
}

#[cfg(test)]
mod tests {
    use std::os::unix::process::ExitStatusExt;

    use super::*;

    /// The store's port is picked outside the OS's ephemeral range, in the wider window; a
    /// range that leaves too few ports outside it leaves the choice to the OS (a widened range
    /// once made every pick the same port, and concurrent jobs collided on it).
    #[test]
    fn ports_are_picked_outside_the_ephemeral_range_or_by_the_os() {
        assert_eq!(picked_ports((32768, 60999)), Some((20000, 32767)));
        assert_eq!(picked_ports((1024, 40000)), Some((40001, 65535)));
        assert_eq!(picked_ports((10000, 65535)), None);
        assert_eq!(picked_ports((20500, 65000)), None);
        assert_eq!(picked_ports((40000, 65535)), Some((20000, 39999)));
    }

    /// The etcd store's TLS files, user and password reach every rank through its
    /// environment, and each rank reads the same store back.
    #[test]
    fn the_etcd_stores_security_reaches_the_ranks() {
        use crate::config::{EtcdSecurity, EtcdStore};
        let security = EtcdSecurity {
            ca: Some("/pki/ca.pem".into()),
            cert: Some("/pki/node.pem".into()),
            key: Some("/pki/node.key".into()),
            user: Some("trainer".into()),
            password: Some("s3cret".into()),
        };
        let store = EtcdStore::parse("https://a:2379,https://b:2379")
            .unwrap()
            .with_security(security)
            .unwrap();
        let mut job = LocalJob::standalone("true", Vec::new(), 2).unwrap();
        job.master = job.master.clone().with_etcd(store.clone());
        let mut vars: std::collections::HashMap<String, String> = job
            .rank_env(1)
            .into_iter()
            .map(|(k, v)| (k.into_string().unwrap(), v.into_string().unwrap()))
            .collect();
        // What `burn-ddp run --fault-tolerant` adds (the etcd store is a fault-tolerant job's).
        vars.insert(env::FAULT_TOLERANT.into(), "1".into());
        let config = crate::config::env::group_config_from(|k| vars.get(k).cloned()).unwrap();
        assert_eq!(config.master.etcd, Some(store));
    }

    #[test]
    fn the_forwarder_follows_the_rank_a_process_announces() {
        // What a rank writes: a line, then the marker of its new rank, then another line.
        let mut rank = Rank(2);
        let shown: Vec<Option<String>> = ["before", &crate::group::marker_line(Rank(0)), "after"]
            .iter()
            .map(|l| prefixed(&mut rank, l))
            .collect();
        assert_eq!(
            shown,
            [
                Some("[rank 2] before\n".to_string()),
                None,
                Some("[rank 0] after\n".to_string())
            ]
        );
    }

    #[test]
    fn a_rank_killed_by_a_signal_is_blamed_before_one_that_exited_with_an_error() {
        let exited = |code: i32| ExitStatus::from_raw(code << 8);
        let killed = ExitStatus::from_raw(9);
        let blamed = |ended: &[(Rank, u32, ExitStatus)]| match to_blame(ended) {
            Some(DdpError::Job(JobError::RankFailed { rank, status, .. })) => {
                Some((rank.0, status))
            }
            _ => None,
        };
        let both = [(Rank(0), 10, exited(1)), (Rank(1), 11, killed)];
        let (rank, status) = blamed(&both).unwrap();
        assert_eq!(rank, 1, "{status}");
        assert!(status.contains("SIGKILL"), "{status}");
        let errors = [
            (Rank(0), 10, exited(0)),
            (Rank(1), 11, exited(1)),
            (Rank(2), 12, exited(2)),
        ];
        assert_eq!(blamed(&errors).map(|b| b.0), Some(1));
        assert!(blamed(&[(Rank(0), 10, exited(0))]).is_none());
    }
}
