//! Test harnesses without Burn (both Burn lines' tests use this file): run a test body in
//! several real processes (like PyTorch's `MultiProcessTestCase`) with a hard deadline, and
//! report which rank failed.
//!
//! A multi-process test re-executes the test binary once per rank with `--exact <test name>` and
//! the torchrun environment; the child sees `BURN_DDP_TEST_CHILD=<test name>` and runs the body.

use std::collections::HashMap;
use std::ffi::OsString;
use std::io::Read;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use burn_ddp_comm::launch::spawn::{describe, LocalJob, Output};
use burn_ddp_comm::{CollectiveError, DdpError, ProcessGroup, Rank, ReduceOp};

/// Environment variable that marks a child process and names its test.
pub const CHILD: &str = "BURN_DDP_TEST_CHILD";

/// In a child process of any test: `true`.
#[allow(dead_code)]
pub fn is_any_child() -> bool {
    std::env::var_os(CHILD).is_some()
}

/// Whether tests that run at several world sizes should run `world` (`BURN_DDP_TEST_WORLDS`,
/// a comma-separated list, when set: the GPU checks run NCCL at 1 and the host path at 2 and 3).
pub fn world_selected(world: usize) -> bool {
    match std::env::var("BURN_DDP_TEST_WORLDS") {
        Ok(list) => list.split(',').any(|w| w.trim().parse() == Ok(world)),
        Err(_) => true,
    }
}

/// The full name of test `name` in this test binary, for `--exact`: a crate's integration tests
/// are one binary with a module per former file, so the harness knows test `conv_sgd` as
/// `equivalence::conv_sgd`. `name` is a test function's name (or a path ending in one): the
/// binary lists its tests once (`--list`), and the one test whose path ends in `::name` is
/// returned. A name that no test or several tests end in panics, naming them (qualify it with
/// its module then).
pub fn test_path(name: &str) -> String {
    static LIST: std::sync::OnceLock<Vec<String>> = std::sync::OnceLock::new();
    let list = LIST.get_or_init(|| {
        let exe = std::env::current_exe().expect("test binary path");
        let out = Command::new(&exe)
            .args(["--list", "--format", "terse"])
            .env_remove(CHILD)
            .output()
            .unwrap_or_else(|e| panic!("listing the tests of {}: {e}", exe.display()));
        assert!(
            out.status.success(),
            "listing the tests of {} failed: {}",
            exe.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| l.strip_suffix(": test"))
            .map(str::to_string)
            .collect()
    });
    resolve_test(list, name)
}

/// The arguments that make this test binary run test `name` ([`test_path`]) alone, its output
/// not captured: what every harness that re-runs a test in a child process passes.
pub fn rerun_args(name: &str) -> Vec<String> {
    let mut args = vec![test_path(name)];
    args.extend(["--exact", "--nocapture", "--test-threads=1"].map(String::from));
    args
}

/// [`test_path`]'s choice among the tests `list` (full paths).
fn resolve_test(list: &[String], name: &str) -> String {
    if list.iter().any(|t| t == name) {
        return name.to_string();
    }
    let suffix = format!("::{name}");
    let found: Vec<&String> = list.iter().filter(|t| t.ends_with(&suffix)).collect();
    match found.as_slice() {
        [one] => one.to_string(),
        [] => panic!("this test binary has no test named {name:?} (its tests: {list:?})"),
        many => panic!(
            "several tests of this test binary end in {name:?}: {many:?}; name one by its \
             module path"
        ),
    }
}

/// In a child process of test `name`: `true`.
pub fn is_child(name: &str) -> bool {
    std::env::var(CHILD).is_ok_and(|v| v == name)
}

/// In a child process of test `name`: its process group.
pub fn child_group(name: &str) -> Option<ProcessGroup> {
    if !is_child(name) {
        return None;
    }
    burn_ddp_comm::launch::cli::init_logging();
    Some(ProcessGroup::from_env().unwrap_or_else(|e| panic!("joining the job failed: {e}")))
}

/// How one rank of a test job ended.
#[derive(Debug)]
pub struct Outcome {
    pub rank: u32,
    pub status: ExitStatus,
    pub output: String,
    pub elapsed: Duration,
}

impl Outcome {
    pub fn ok(&self) -> bool {
        self.status.success()
    }
}

/// The outcomes of every rank.
#[derive(Debug)]
pub struct Outcomes(pub Vec<Outcome>);

impl Outcomes {
    /// Panics, with every rank's output, unless every rank succeeded.
    pub fn assert_all_ok(&self) {
        // A child that matched no test function would "pass" without running anything.
        if self
            .0
            .iter()
            .all(|o| o.ok() && o.output.contains("test result: ok. 1 passed"))
        {
            return;
        }
        panic!("{}", self.report());
    }

    /// Every rank's status and output.
    pub fn report(&self) -> String {
        let mut s = String::new();
        for o in &self.0 {
            s.push_str(&format!(
                "---- rank {} {} after {:?} ----\n{}\n",
                o.rank,
                describe(o.status),
                o.elapsed,
                o.output
            ));
        }
        s
    }

    pub fn rank(&self, r: u32) -> &Outcome {
        self.0.iter().find(|o| o.rank == r).expect("no such rank")
    }
}

/// A multi-process test job.
pub struct TestJob {
    world: u32,
    test: String,
    timeout: Duration,
    env: Vec<(String, String)>,
    per_rank: HashMap<u32, Vec<(String, String)>>,
    unset: Vec<String>,
    skip: Vec<u32>,
    master_port: Option<u16>,
    /// The test function the children run, when it is not `test` itself.
    function: Option<String>,
    /// The network namespace of each rank (`ip netns exec`), by rank.
    namespaces: Vec<String>,
}

impl TestJob {
    /// `world` ranks running test `test` of this binary.
    pub fn new(world: u32, test: &str) -> Self {
        Self {
            world,
            test: test.to_string(),
            timeout: Duration::from_secs(120),
            env: vec![("RUST_BACKTRACE".into(), "0".into())],
            per_rank: HashMap::new(),
            unset: Vec::new(),
            skip: Vec::new(),
            master_port: None,
            function: None,
            namespaces: Vec::new(),
        }
    }

    /// Runs rank `r` in node `node_of(r)` of `net` (its own network namespace: another "host"
    /// to the ranks), meeting at the store of rank 0's node.
    pub fn on_nodes(mut self, net: &crate::netns::Net, node_of: impl Fn(u32) -> usize) -> Self {
        self.namespaces = (0..self.world).map(|r| net.ns(node_of(r))).collect();
        let master = net.addr(node_of(0));
        self.env("MASTER_ADDR", master)
    }

    /// Children run test function `f` (for tests that start several jobs, each tagged by `test`).
    #[allow(dead_code)]
    pub fn function(mut self, f: &str) -> Self {
        self.function = Some(f.to_string());
        self
    }

    /// Sets a variable for every rank.
    pub fn env(mut self, k: &str, v: impl ToString) -> Self {
        self.env.push((k.into(), v.to_string()));
        self
    }

    /// Sets a variable for one rank (overrides the launcher's value).
    pub fn rank_env(mut self, rank: u32, k: &str, v: impl ToString) -> Self {
        self.per_rank
            .entry(rank)
            .or_default()
            .push((k.into(), v.to_string()));
        self
    }

    /// Removes a variable the launcher would set (every rank).
    #[allow(dead_code)]
    pub fn unset(mut self, k: &str) -> Self {
        self.unset.push(k.into());
        self
    }

    /// Does not start this rank (a rank that never arrives).
    pub fn skip(mut self, rank: u32) -> Self {
        self.skip.push(rank);
        self
    }

    /// Uses this port for the store.
    pub fn master_port(mut self, port: u16) -> Self {
        self.master_port = Some(port);
        self
    }

    /// Hard deadline for the whole job; exceeded, every rank is killed and the test fails.
    pub fn timeout(mut self, d: Duration) -> Self {
        self.timeout = d;
        self
    }

    /// Starts the ranks and waits for all of them (no fail-fast: every rank reports itself).
    ///
    /// The store's port is picked free just before rank 0 binds it, so another job on this
    /// machine can take it in between (nextest runs many at once). When rank 0 then fails
    /// because the port is taken, the other ranks are stopped and the job starts again on
    /// another port, up to 3 times (like PyTorch's `retry_on_connect_failures`); not with a
    /// port chosen by [`TestJob::master_port`].
    ///
    /// With `BURN_DDP_TEST_CHILD_WRAPPER` set (a command and its arguments, split at spaces; a
    /// script for arguments with spaces), each rank runs under it. scripts/gpu-check.sh runs
    /// ranks under a script that runs `cuda-gdb -batch -return-child-result -ex run -ex
    /// "thread apply all bt" --args "$@"`, which puts the stacks of a rank that dies of a
    /// signal into its output and fails that rank.
    pub fn run(self) -> Outcomes {
        const TRIES: u32 = 3;
        let started = Instant::now();
        for attempt in 1..=TRIES {
            let retry = self.master_port.is_none() && attempt < TRIES;
            match self.run_once(started, retry) {
                Attempt::Ended(outcomes) => {
                    if std::env::var_os("BURN_DDP_TEST_SHOW").is_some() {
                        eprintln!("==== {} ====\n{}", self.test, outcomes.report());
                    }
                    return outcomes;
                }
                Attempt::PortTaken(port) => {
                    eprintln!(
                        "test job {}: another process took port {port} before rank 0 served the \
                         store on it; starting the job again on another port",
                        self.test
                    );
                }
            }
        }
        unreachable!("the last attempt does not retry")
    }

    /// One start of the job. With `retry`, a rank 0 that fails because its store's port is
    /// taken ends the attempt early ([`Attempt::PortTaken`]), the other ranks killed.
    fn run_once(&self, started: Instant, retry: bool) -> Attempt {
        let exe = std::env::current_exe().expect("test binary path");
        let args: Vec<OsString> = rerun_args(self.function.as_deref().unwrap_or(&self.test))
            .into_iter()
            .map(OsString::from)
            .collect();
        let mut job =
            LocalJob::standalone(exe.clone(), args.clone(), self.world).expect("free port");
        job.output = Output::Capture;
        if let Some(p) = self.master_port {
            job.master.port = p;
        }
        let mut children: Vec<RankProcess> = Vec::new();
        for local in 0..self.world {
            if self.skip.contains(&local) {
                continue;
            }
            let mut cmd = match self.namespaces.get(local as usize) {
                Some(ns) => {
                    let mut cmd = Command::new("ip");
                    cmd.args(["netns", "exec", ns]).arg(&exe);
                    cmd
                }
                None => child_command(&exe),
            };
            cmd.args(&args)
                .envs(job.rank_env(local))
                .env(CHILD, &self.test)
                .envs(self.env.iter().map(|(k, v)| (k, v)))
                .envs(
                    self.per_rank
                        .get(&local)
                        .into_iter()
                        .flatten()
                        .map(|(k, v)| (k, v)),
                )
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
            for k in &self.unset {
                cmd.env_remove(k);
            }
            children.push(RankProcess::spawn(local, cmd));
        }
        let mut done: Vec<Option<(ExitStatus, Duration)>> = vec![None; children.len()];
        while done.iter().any(Option::is_none) {
            for (i, child) in children.iter_mut().enumerate() {
                if done[i].is_none() {
                    if let Ok(Some(st)) = child.child.try_wait() {
                        done[i] = Some((st, started.elapsed()));
                        if retry && child.rank == 0 && !st.success() && child.lost_its_port() {
                            for other in &mut children {
                                other.kill();
                            }
                            return Attempt::PortTaken(job.master.port);
                        }
                    }
                }
            }
            if started.elapsed() > self.timeout {
                let partial: Vec<String> = children
                    .into_iter()
                    .map(|mut c| {
                        c.kill();
                        let output = c.output();
                        format!("---- rank {} ----\n{output}", c.rank)
                    })
                    .collect();
                panic!(
                    "test job {} did not finish within {:?} (a hang); every rank was killed.\n{}",
                    self.test,
                    self.timeout,
                    partial.join("\n")
                );
            }
            thread::sleep(Duration::from_millis(20));
        }
        Attempt::Ended(Outcomes(
            children
                .into_iter()
                .zip(done)
                .map(|(mut c, d)| {
                    let (status, elapsed) = d.expect("every child has exited");
                    Outcome {
                        rank: c.rank,
                        status,
                        elapsed,
                        output: c.output(),
                    }
                })
                .collect(),
        ))
    }
}

/// How one start of a [`TestJob`] ended.
enum Attempt {
    /// Every rank ended.
    Ended(Outcomes),
    /// Rank 0 could not serve the store: this port was taken.
    PortTaken(u16),
}

/// One rank's process and the threads that collect its output.
struct RankProcess {
    rank: u32,
    child: Child,
    stdout: Option<thread::JoinHandle<String>>,
    stderr: Option<thread::JoinHandle<String>>,
    /// Its output, once collected.
    collected: Option<String>,
}

impl RankProcess {
    fn spawn(rank: u32, mut cmd: Command) -> Self {
        let mut child = cmd.spawn().expect("spawn test child");
        let mut out = child.stdout.take().expect("stdout");
        let mut err = child.stderr.take().expect("stderr");
        let stdout = thread::spawn(move || {
            let mut s = String::new();
            let _ = out.read_to_string(&mut s);
            s
        });
        let stderr = thread::spawn(move || {
            let mut s = String::new();
            let _ = err.read_to_string(&mut s);
            s
        });
        Self {
            rank,
            child,
            stdout: Some(stdout),
            stderr: Some(stderr),
            collected: None,
        }
    }

    /// Kills it (if still running) and reaps it.
    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Its whole output (stdout, then stderr), once it has exited.
    fn output(&mut self) -> String {
        if self.collected.is_none() {
            let join = |h: Option<thread::JoinHandle<String>>| {
                h.map(|h| h.join().unwrap_or_default()).unwrap_or_default()
            };
            let out = join(self.stdout.take());
            let err = join(self.stderr.take());
            self.collected = Some(format!("{out}{err}"));
        }
        self.collected.clone().unwrap_or_default()
    }

    /// Whether it failed because its store's port was taken (the text of
    /// `RendezvousError::PortInUse`).
    fn lost_its_port(&mut self) -> bool {
        says_store_port_taken(&self.output())
    }
}

/// Whether a rank's output has `RendezvousError::PortInUse`'s message.
fn says_store_port_taken(output: &str) -> bool {
    output.contains("cannot serve the rendezvous store on")
        && output.contains("the port is already in use")
}

/// Runs a `world`-rank job of test `name` in which rank `killed` kills itself (SIGKILL) mid-run,
/// with a 10-minute collective deadline and a 3 s heartbeat bound, and asserts that it died and
/// that every other rank ended successfully (having checked the error it got) within 30 s: only
/// prompt failure detection can meet that.
#[allow(dead_code)]
pub fn assert_killed_rank_named_fast(world: u32, name: &str, killed: u32) {
    assert_killed_rank_named_fast_with(world, name, killed, &[]);
}

/// [`assert_killed_rank_named_fast`] with more variables for every rank (`env`).
pub fn assert_killed_rank_named_fast_with(
    world: u32,
    name: &str,
    killed: u32,
    env: &[(&str, &str)],
) {
    let job = env
        .iter()
        .fold(TestJob::new(world, name), |job, (k, v)| job.env(k, v));
    assert_killed_rank_named_fast_in(job, killed);
}

/// [`assert_killed_rank_named_fast`] for the job `job` as set up by the caller.
pub fn assert_killed_rank_named_fast_in(job: TestJob, killed: u32) {
    let world = job.world;
    let out = job
        .env("BURN_DDP_COLLECTIVE_TIMEOUT", "600")
        .env("BURN_DDP_HEARTBEAT_TIMEOUT", "3")
        .run();
    assert!(!out.rank(killed).ok(), "{}", out.report());
    for r in (0..world).filter(|&r| r != killed) {
        assert!(out.rank(r).ok(), "{}", out.report());
        assert!(
            out.rank(r).elapsed < Duration::from_secs(30),
            "rank {r} took {:?}:\n{}",
            out.rank(r).elapsed,
            out.report()
        );
    }
}

/// Kills this process with `SIGKILL` after `delay` (from a thread of its own): a rank that dies
/// mid-run, with no chance to say goodbye.
pub fn kill_self_after(delay: Duration) {
    thread::spawn(move || {
        thread::sleep(delay);
        let me = rustix::process::getpid();
        let _ = rustix::process::kill_process(me, rustix::process::Signal::KILL);
    });
}

/// Runs all-reduces of `len` f32 on `pg` until one fails (a rank died), prints the error, and
/// checks that it names `culprit` (as the peer lost, in the job's abort record, or by the
/// heartbeat's verdict) and the all-reduce it stopped. Returns the error's text.
pub fn all_reduces_fail_naming(pg: &ProcessGroup, len: usize, culprit: Rank) -> String {
    let mut buf = vec![1.0f32; len];
    let err = (0..100_000_000)
        .map(|_| pg.all_reduce(&mut buf, ReduceOp::Sum))
        .find_map(Result::err)
        .unwrap_or_else(|| {
            panic!("the all-reduces cannot all succeed once rank {culprit} is dead")
        });
    assert_names(pg, &err, culprit, "all_reduce #")
}

/// Prints `err` (a collective's failure on `pg`'s rank) and checks that it names `culprit` (as
/// the peer lost, in the job's abort record, or by the heartbeat's verdict) and the collective
/// it stopped (`stopped`, e.g. `all_reduce #`). Returns the error's text.
pub fn assert_names(pg: &ProcessGroup, err: &DdpError, culprit: Rank, stopped: &str) -> String {
    let text = err.to_string();
    println!("rank {} error: {text}", pg.rank());
    let named = match err {
        DdpError::Collective(CollectiveError::PeerLost { peer, .. }) => Some(*peer),
        DdpError::Collective(CollectiveError::JobAborted { record, .. }) => record.culprit,
        DdpError::Collective(CollectiveError::RankUnresponsive { culprit, .. }) => Some(*culprit),
        other => panic!("unexpected error: {other}"),
    };
    assert_eq!(named, Some(culprit), "{text}");
    assert!(text.contains(stopped), "{text}");
    text
}

/// Runs `body` on every rank of a `world`-rank job of test `name`; all ranks must succeed.
/// Returns `true` in the parent after the job passed, `false` in children (which already ran).
pub fn multi_process(world: u32, name: &str, body: impl FnOnce(ProcessGroup)) {
    if let Some(pg) = child_group(name) {
        body(pg);
        return;
    }
    TestJob::new(world, name).run().assert_all_ok();
}

/// `exe`, or `exe` under the command of `BURN_DDP_TEST_CHILD_WRAPPER`.
fn child_command(exe: &std::path::Path) -> Command {
    let wrapper = std::env::var("BURN_DDP_TEST_CHILD_WRAPPER").unwrap_or_default();
    let mut words = wrapper.split_whitespace();
    match words.next() {
        Some(program) => {
            let mut cmd = Command::new(program);
            cmd.args(words).arg(exe);
            cmd
        }
        None => Command::new(exe),
    }
}

#[cfg(test)]
mod tests {
    use super::{resolve_test, says_store_port_taken};

    #[test]
    fn a_taken_store_port_is_recognised_by_its_error_message() {
        let taken = burn_ddp_comm::DdpError::from(burn_ddp_comm::RendezvousError::PortInUse {
            rank: burn_ddp_comm::Rank(0),
            addr: "127.0.0.1:29500".parse().unwrap(),
            origin: String::new(),
        });
        let output = format!("joining the job failed: {taken}\n");
        assert!(says_store_port_taken(&output), "{output}");
        assert!(!says_store_port_taken(
            "joining the job failed: [rank 1] cannot reach the rendezvous store"
        ));
    }

    fn list() -> Vec<String> {
        [
            "equivalence::conv_sgd",
            "equivalence::conv_sgd_join",
            "a::same",
            "b::same",
            "top",
        ]
        .map(String::from)
        .to_vec()
    }

    #[test]
    fn a_function_name_resolves_to_its_one_module_path() {
        assert_eq!(resolve_test(&list(), "conv_sgd"), "equivalence::conv_sgd");
        assert_eq!(
            resolve_test(&list(), "conv_sgd_join"),
            "equivalence::conv_sgd_join"
        );
        assert_eq!(resolve_test(&list(), "a::same"), "a::same");
        assert_eq!(resolve_test(&list(), "top"), "top");
    }

    #[test]
    #[should_panic(expected = "several tests of this test binary end in \"same\"")]
    fn a_name_two_modules_share_must_be_qualified() {
        resolve_test(&list(), "same");
    }

    #[test]
    #[should_panic(expected = "has no test named \"sgd\"")]
    fn a_name_no_test_has_is_refused() {
        resolve_test(&list(), "sgd");
    }
}
