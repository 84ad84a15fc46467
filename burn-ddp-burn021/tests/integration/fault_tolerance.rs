//! Fault-tolerant jobs (`burn-ddp run --fault-tolerant`) without Burn: real processes under the
//! real launcher, real sockets, SIGKILL and SIGSTOP.
//!
//! The ranks run a counter job: each step all-reduces a value that depends only on the step
//! (its mean is the same whatever the membership), adds it to a state vector, and counts the
//! step. So after N steps every rank's state is one known vector, whatever happened: a step
//! applied twice, lost, or applied on some ranks only shows as a wrong or differing digest.
//! A rank that recovers with less progress than the most advanced takes its state (point to
//! point), as a joining process does.

use crate::common;

use burn_ddp_comm::MembershipError;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use burn_ddp_comm::{DdpError, ProcessGroup, Recovery, ReduceOp};
use common::netns::{finish, wait_for};

const CHILD: &str = "counter_job_child";
const STATE: usize = 4096;

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("burn-ddp-ft-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The value every rank adds at step `s` (0-based).
fn increment(s: u64) -> f64 {
    (s % 7) as f64 + 1.0
}

fn digest(state: &[f64]) -> u64 {
    use std::hash::Hasher;
    let mut h = std::hash::DefaultHasher::new();
    for x in state {
        h.write_u64(x.to_bits());
    }
    h.finish()
}

/// The state after `steps` steps, as every rank must hold it.
fn expected(steps: u64) -> u64 {
    let total: f64 = (0..steps).map(increment).sum();
    digest(&vec![total; STATE])
}

/// Moves the state from the recovery's source to the ranks behind it.
fn transfer(
    pg: &ProcessGroup,
    rec: &Recovery,
    state: &mut [f64],
    step: &mut u64,
) -> burn_ddp_comm::Result<()> {
    if rec.needs_state() {
        let bytes = pg.recv_bytes(rec.source, 7)?;
        let (head, body) = bytes.split_at(8);
        *step = u64::from_le_bytes(head.try_into().unwrap());
        for (s, c) in state.iter_mut().zip(body.chunks_exact(8)) {
            *s = f64::from_le_bytes(c.try_into().unwrap());
        }
        println!("took the state of step {step} from rank {}", rec.source);
    } else if pg.rank() == rec.source {
        let mut bytes = step.to_le_bytes().to_vec();
        for s in state.iter() {
            bytes.extend_from_slice(&s.to_le_bytes());
        }
        for r in &rec.behind {
            pg.send_bytes(&bytes, *r, 7)?;
        }
    }
    Ok(())
}

/// One rank of the counter job (run by the launcher with `BURN_DDP_TEST_CHILD` set).
#[test]
fn counter_job_child() {
    if std::env::var("BURN_DDP_TEST_CHILD").as_deref() != Ok(CHILD) {
        return;
    }
    burn_ddp_comm::launch::cli::init_logging();
    println!();
    let steps: u64 = std::env::var("FT_STEPS").unwrap().parse().unwrap();
    let pause =
        Duration::from_millis(std::env::var("FT_PAUSE_MS").map_or(20, |v| v.parse().unwrap()));
    let pg = ProcessGroup::from_env().unwrap_or_else(|e| panic!("joining: {e}"));
    let (member, _) = pg.membership().expect("a fault-tolerant group");
    println!(
        "member {member} pid {} rank {}",
        std::process::id(),
        pg.rank()
    );
    let mut state = vec![0f64; STATE];
    let mut step = 0u64;
    let mut recovering: Option<(u64, Instant)> = None;
    let mut pending = pg.take_admission();
    while step < steps {
        let result = (|| -> burn_ddp_comm::Result<()> {
            if let Some(rec) = pending.take() {
                transfer(&pg, &rec, &mut state, &mut step)?;
            }
            let mut grow = [i64::from(pg.join_pending())];
            pg.all_reduce(&mut grow, ReduceOp::Max)?;
            if grow[0] == 1 {
                let started = Instant::now();
                pending = Some(pg.grow(Some(step))?);
                recovering = Some((pg.membership().unwrap().1, started));
                return Ok(());
            }
            let mut g = vec![increment(step); STATE];
            pg.all_reduce(&mut g, ReduceOp::Mean)?;
            for (s, x) in state.iter_mut().zip(&g) {
                *s += x;
            }
            step += 1;
            println!("step {step}");
            if let Some((epoch, since)) = recovering.take() {
                println!(
                    "first step of epoch {epoch} done {} ms after the change began",
                    since.elapsed().as_millis()
                );
            }
            Ok(())
        })();
        if let Err(e) = result {
            assert!(e.is_peer_failure(), "not a peer failure: {e}");
            let started = Instant::now();
            let rec = match pg.recover(&e, Some(step)) {
                Ok(rec) => rec,
                Err(DdpError::Membership(MembershipError::Excluded { .. })) => {
                    pg.rejoin().unwrap_or_else(|e| panic!("rejoining: {e}"))
                }
                Err(e) => panic!("recovering: {e}"),
            };
            recovering = Some((rec.epoch, started));
            pending = Some(rec);
        }
        std::thread::sleep(pause);
    }
    if std::env::var_os("FT_EVAL").is_some() {
        println!("evaluation total {}", evaluate(&pg));
    }
    println!("final step {step} digest {:016x}", digest(&state));
}

/// Items of the evaluation after training.
const EVAL_ITEMS: usize = 1000;

/// An evaluation after training, as the classifier's: each rank sums its shard of the items
/// (item `i` counts `i + 1`), over 40 rounds of collectives 50 ms apart (`FT_EVAL_PAUSE_MS`),
/// then the sums are
/// all-reduced. Through `surviving`, a rank lost meanwhile is survived: the total is the sum
/// of every item once, `EVAL_ITEMS * (EVAL_ITEMS + 1) / 2`.
fn evaluate(pg: &ProcessGroup) -> f64 {
    let plan = burn_ddp_comm::data::ShardPlan::evaluation(pg);
    burn_ddp_comm::data::surviving(pg, || {
        println!("evaluating as rank {} of {}", pg.rank(), pg.world_size());
        let pause = std::env::var("FT_EVAL_PAUSE_MS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(50);
        for _ in 0..40 {
            pg.barrier()?;
            std::thread::sleep(Duration::from_millis(pause));
        }
        let shard = (0..plan.len(EVAL_ITEMS)).filter_map(|k| plan.index(EVAL_ITEMS, k));
        let mut sum = [shard.map(|i| i as f64 + 1.0).sum::<f64>()];
        pg.all_reduce(&mut sum, ReduceOp::Sum)?;
        Ok::<_, DdpError>(sum[0])
    })
    .unwrap_or_else(|e| panic!("evaluating: {e}"))
}

/// A launcher of a fault-tolerant counter job, its output in a log.
struct FtJob {
    launcher: Child,
    log: PathBuf,
    dir: PathBuf,
    port: u16,
    steps: u64,
}

/// The launcher command of a fault-tolerant counter job on `port` (`launcher` options first).
fn launcher_cmd(
    port: u16,
    launcher: &[&str],
    steps: u64,
    extra: &[(&str, &str)],
    log: &Path,
) -> Command {
    let out = std::fs::File::create(log).unwrap();
    let mut cmd = Command::new(common::spawned::launcher());
    cmd.args([
        "run",
        "--fault-tolerant",
        "--master-port",
        &port.to_string(),
    ])
    .args(["--rdzv-id", &format!("ft-test-{port}")])
    .args(launcher)
    .arg("--")
    .arg(std::env::current_exe().unwrap())
    .args(common::rerun_args(CHILD))
    .env("BURN_DDP_TEST_CHILD", CHILD)
    .env("FT_STEPS", steps.to_string())
    .env("BURN_DDP_TIMEOUT", "10m")
    .env("BURN_DDP_HEARTBEAT_TIMEOUT", "3s")
    .env("RUST_LOG", "warn")
    .env_remove("RANK")
    .env_remove("BURN_DDP_JOB_TOKEN")
    .stdin(Stdio::null())
    .stdout(out.try_clone().unwrap())
    .stderr(out);
    for (k, v) in extra {
        cmd.env(k, v);
    }
    cmd
}

impl FtJob {
    fn start(name: &str, nproc: u32, restarts: u32, steps: u64, extra: &[(&str, &str)]) -> Self {
        let dir = scratch(name);
        let log = dir.join("launcher.log");
        let port = burn_ddp_comm::launch::spawn::free_port().unwrap();
        let nproc = nproc.to_string();
        let restarts = restarts.to_string();
        let launcher = ["--nproc-per-node", &nproc, "--max-restarts", &restarts];
        Self {
            launcher: launcher_cmd(port, &launcher, steps, extra, &log)
                .spawn()
                .unwrap(),
            log,
            dir,
            port,
            steps,
        }
    }

    /// Starts a second launcher whose one rank joins this running job; its output in `name`.
    fn join(&self, name: &str) -> (Child, PathBuf) {
        let log = self.dir.join(name);
        let child = launcher_cmd(
            self.port,
            &["--join", "--nproc-per-node", "1"],
            self.steps,
            &[],
            &log,
        )
        .spawn()
        .unwrap();
        (child, log)
    }
}

impl FtJob {
    fn text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The pid of the process that printed `member {member} pid ...` as rank `rank`.
    fn pid(&self, rank: u32, member: u32) -> u32 {
        let needle = format!("member {member} pid ");
        let prefix = format!("[rank {rank}] ");
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            let found = self.text().lines().find_map(|l| {
                let rest = l.strip_prefix(&prefix)?;
                let rest = &rest[rest.find(&needle)? + needle.len()..];
                rest.split_whitespace().next()?.parse().ok()
            });
            if let Some(pid) = found {
                return pid;
            }
            assert!(
                Instant::now() < deadline,
                "no pid of rank {rank}:\n{}",
                self.text()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn finish(self, ok: bool) -> String {
        self.finish_within(ok, Duration::from_secs(300))
    }

    /// The launcher's output once it ended, as `ok` says (the test fails if it has not ended
    /// within `limit`).
    fn finish_within(mut self, ok: bool, limit: Duration) -> String {
        let (success, text) = finish(&mut self.launcher, &self.log, limit);
        if std::env::var_os("BURN_DDP_TEST_SHOW").is_some() {
            eprintln!("{text}");
        }
        assert_eq!(
            success, ok,
            "launcher ended {success}, expected {ok}:\n{text}"
        );
        let _ = std::fs::remove_dir_all(&self.dir);
        text
    }
}

fn kill(pid: u32, sig: &str) {
    let status = Command::new("kill")
        .args([sig, &pid.to_string()])
        .status()
        .unwrap();
    assert!(status.success());
}

/// The final digests, by launcher rank prefix (the rank of the process when it printed them).
fn finals(text: &str) -> Vec<(String, u64, String)> {
    text.lines()
        .filter_map(|l| {
            let (prefix, rest) = l.split_once("] final step ")?;
            let (step, digest) = rest.split_once(" digest ")?;
            Some((
                prefix.to_string() + "]",
                step.parse().ok()?,
                digest.trim().to_string(),
            ))
        })
        .collect()
}

/// Asserts that `count` processes ended, each after `steps` steps with the state of an unbroken
/// run (`log` is said on failure).
fn assert_unbroken(finals: &[(String, u64, String)], count: usize, steps: u64, log: &str) {
    assert_eq!(finals.len(), count, "{log}");
    let want = format!("{:016x}", expected(steps));
    for (who, step, d) in finals {
        assert_eq!((*step, d.as_str()), (steps, want.as_str()), "{who}:\n{log}");
    }
}

/// The time from `since` to the first step a survivor completed in a new membership.
fn first_step_after(log: &Path, since: Instant) -> Duration {
    wait_for(log, "done", Duration::from_secs(60));
    let at = wait_for(log, "first step of epoch", Duration::from_secs(60));
    at - since
}

/// 3 ranks; rank 1 is SIGKILLed mid-run. The other two agree on a membership of two, go on
/// from the step they were at (no restart: the same processes, no checkpoint), finish, and
/// hold exactly the state of an unbroken run.
#[test]
fn a_killed_rank_is_survived_without_a_restart() {
    let steps = 120;
    let job = FtJob::start("killed", 3, 0, steps, &[]);
    let victim = job.pid(1, 1);
    wait_for(&job.log, "[rank 1] step 30", Duration::from_secs(120));
    kill(victim, "-KILL");
    let killed = Instant::now();
    let took = first_step_after(&job.log, killed);
    eprintln!("SIGKILL of rank 1 -> first step of the two survivors: {took:?}");
    let text = job.finish(true);
    assert!(
        text.contains("membership epoch 1: world size 2 (was 3); left: [m1]"),
        "{text}"
    );
    assert_unbroken(&finals(&text), 2, steps, &text);
    assert!(text.contains("rank 1 (member 1, pid"), "{text}");
}

/// 3 ranks, one replacement allowed: rank 2 is SIGKILLed, the launcher starts a replacement
/// (a fresh member) that joins the running job at a step boundary and takes the state from a
/// survivor; all three end with the state of an unbroken run.
#[test]
fn a_replacement_joins_live_and_takes_the_state() {
    let steps = 150;
    let job = FtJob::start("replaced", 3, 1, steps, &[]);
    let victim = job.pid(2, 2);
    wait_for(&job.log, "[rank 2] step 20", Duration::from_secs(120));
    kill(victim, "-KILL");
    let text = job.finish(true);
    assert!(text.contains("starting member 3 in its place"), "{text}");
    assert!(text.contains("joined: [m3]"), "{text}");
    assert!(text.contains("took the state of step"), "{text}");
    assert_unbroken(&finals(&text), 3, steps, &text);
}

/// 3 ranks, no replacements: rank 2 is SIGKILLed and the two survivors go on; later a process
/// started by a second launcher (`--join`) asks to join: the members let it in at their next
/// step boundary, it takes a survivor's state, and the three end with the state of an unbroken
/// run.
#[test]
fn a_process_started_later_joins_at_a_step_boundary() {
    let steps = 300;
    let job = FtJob::start("late", 3, 0, steps, &[("FT_PAUSE_MS", "30")]);
    let victim = job.pid(2, 2);
    wait_for(&job.log, "[rank 2] step 20", Duration::from_secs(120));
    kill(victim, "-KILL");
    wait_for(&job.log, "left: [m2]", Duration::from_secs(60));
    wait_for(&job.log, "first step of epoch 1", Duration::from_secs(60));
    let (mut joiner, log) = job.join("joiner.log");
    let (ok, joined) = finish(&mut joiner, &log, Duration::from_secs(300));
    let text = job.finish(true);
    assert!(
        ok,
        "the joining launcher failed:\n{joined}\n---- job ----\n{text}"
    );
    assert!(
        joined.contains("this process joined the running job as rank 2 of 3"),
        "{joined}"
    );
    assert!(
        text.contains("membership epoch 2: world size 3 (was 2); left: []; joined: [m3]"),
        "{text}"
    );
    assert!(text.contains("a process asked to join"), "{text}");
    let mut all = finals(&text);
    all.extend(finals(&joined));
    assert_unbroken(&all, 3, steps, &format!("{text}\n{joined}"));
}

/// 3 ranks; rank 1 is frozen (SIGSTOP) mid-step: the heartbeat names it, the other two go on
/// without it. Continued (SIGCONT) later, it finds the job went on without it, joins again at
/// a step boundary, takes the state, and the three end equal.
#[test]
fn a_frozen_rank_is_left_out_then_rejoins() {
    let steps = 300;
    let job = FtJob::start("frozen", 3, 0, steps, &[("FT_PAUSE_MS", "30")]);
    let victim = job.pid(1, 1);
    wait_for(&job.log, "[rank 1] step 20", Duration::from_secs(120));
    kill(victim, "-STOP");
    let stopped = Instant::now();
    wait_for(&job.log, "left: [m1]", Duration::from_secs(60));
    let left_out = stopped.elapsed();
    wait_for(&job.log, "first step of epoch 1", Duration::from_secs(60));
    kill(victim, "-CONT");
    let text = job.finish(true);
    eprintln!("SIGSTOP of rank 1 -> the others' new membership: {left_out:?}");
    assert!(text.contains("sent no heartbeat"), "{text}");
    assert!(
        text.contains("this process was left out of the job's membership epoch 1"),
        "{text}"
    );
    assert!(text.contains("joined: [m1]"), "{text}");
    assert_unbroken(&finals(&text), 3, steps, &text);
}

/// 3 ranks; rank 1 is frozen (SIGSTOP) for good: the other two go on without it and finish,
/// and the launcher, instead of waiting for the frozen process for ever, says it is still
/// running after the job ended, stops it, and succeeds (its job did).
#[test]
fn a_rank_frozen_for_good_is_stopped_once_the_job_ended() {
    let steps = 150;
    let job = FtJob::start("frozen-for-good", 3, 0, steps, &[]);
    let victim = job.pid(1, 1);
    wait_for(&job.log, "[rank 1] step 20", Duration::from_secs(120));
    kill(victim, "-STOP");
    let stopped = Instant::now();
    wait_for(&job.log, "left: [m1]", Duration::from_secs(60));
    let done = wait_for(&job.log, "[rank 0] final step", Duration::from_secs(60));
    // The survivors finish within seconds; the launcher must end well before the test's bound.
    let text = job.finish_within(true, Duration::from_secs(90));
    eprintln!(
        "SIGSTOP for good -> the survivors' end: {:?}; -> the launcher's end: {:?}",
        done - stopped,
        stopped.elapsed()
    );
    assert!(
        text.contains(&format!(
            "rank 1 (member 1, pid {victim}) is still running after the job ended"
        )),
        "{text}"
    );
    assert!(text.contains("stopping it"), "{text}");
    assert_unbroken(&finals(&text), 2, steps, &text);
}

/// Launchers whose ranks are not the running job's are refused at once, saying to add `--join`,
/// and the job never notices them (no membership change): a stray `--nnodes 2 --node-rank 1`
/// launcher (ranks 3..=5, which the job never had), and the job's own command run again (its
/// member ids 0..=2 are taken).
#[test]
fn launchers_whose_ranks_are_not_the_jobs_are_refused_without_churning_it() {
    let steps = 200;
    let job = FtJob::start("stray", 3, 0, steps, &[("FT_PAUSE_MS", "30")]);
    wait_for(&job.log, "[rank 0] step 10", Duration::from_secs(120));
    for (name, options) in [
        (
            "stray.log",
            &["--nnodes", "2", "--node-rank", "1", "--nproc-per-node", "3"][..],
        ),
        ("again.log", &["--nproc-per-node", "3"][..]),
    ] {
        let log = job.dir.join(name);
        let mut stray = launcher_cmd(job.port, options, steps, &[], &log)
            .spawn()
            .unwrap();
        let (ok, said) = finish(&mut stray, &log, Duration::from_secs(60));
        assert!(!ok, "{said}");
        assert!(said.contains("are not the fault-tolerant job's"), "{said}");
        assert!(said.contains("the job is already running"), "{said}");
        assert!(said.contains("start its launcher with `--join`"), "{said}");
        assert!(!said.contains("[rank "), "it started ranks:\n{said}");
        if name == "stray.log" {
            assert!(said.contains("ranks 3..=5"), "{said}");
            assert!(said.contains("a world of 3"), "{said}");
        }
    }
    let text = job.finish(true);
    assert!(!text.contains("membership epoch 1"), "{text}");
    assert_unbroken(&finals(&text), 3, steps, &text);
}

/// 3 ranks train, then evaluate together (`surviving`); rank 1 is SIGKILLed during the
/// evaluation: the two others agree on a membership of two, deal the items again between
/// themselves, evaluate again, and get the total of every item once; the job succeeds.
#[test]
fn a_rank_lost_in_the_evaluation_after_training_is_survived() {
    evaluation_loses_rank_1("eval", 0);
}

/// As above with a replacement allowed: the launcher starts one at once, but it is not let
/// into a job whose training is over (it would start training while the others evaluate:
/// the chaos run found the job stuck so); the two survivors evaluate again and end, the
/// replacement waits and is stopped when the job ended, and the launcher succeeds.
#[test]
fn a_replacement_is_not_let_in_after_training() {
    let text = evaluation_loses_rank_1("eval-replaced", 1);
    assert!(text.contains("starting member 3 in its place"), "{text}");
    assert!(!text.contains("joined: [m3]"), "{text}");
}

/// A node started with `--join` while the job evaluates after training asks to join and is
/// never let in (training is over); the job finishes without it, and that node's launcher
/// succeeds, saying its processes were not needed (it said "every rank of this node was lost"
/// and failed before).
#[test]
fn a_node_that_joins_after_training_is_not_let_in_and_succeeds() {
    let steps = 40;
    let job = FtJob::start(
        "late-node",
        3,
        0,
        steps,
        &[("FT_EVAL", "1"), ("FT_EVAL_PAUSE_MS", "250")],
    );
    wait_for(
        &job.log,
        "evaluating as rank 0 of 3",
        Duration::from_secs(120),
    );
    let (mut joiner, log) = job.join("late-node.log");
    let (ok, joined) = finish(&mut joiner, &log, Duration::from_secs(120));
    let text = job.finish(true);
    assert!(
        ok,
        "the late node's launcher failed:\n{joined}\n---- the job ----\n{text}"
    );
    assert!(
        joined.contains("before this node's processes were let in"),
        "{joined}"
    );
    assert!(!text.contains("joined: [m3]"), "{text}");
    assert_unbroken(&finals(&text), 3, steps, &text);
}

/// 3 ranks of the counter job train and evaluate, `restarts` replacements allowed; rank 1 is
/// SIGKILLed during the evaluation; the two others must evaluate again and end with the total
/// of every item once. The launcher's log (the job in a directory named `name`).
fn evaluation_loses_rank_1(name: &str, restarts: u32) -> String {
    let steps = 40;
    let job = FtJob::start(name, 3, restarts, steps, &[("FT_EVAL", "1")]);
    let victim = job.pid(1, 1);
    wait_for(
        &job.log,
        "[rank 1] evaluating as rank 1 of 3",
        Duration::from_secs(120),
    );
    std::thread::sleep(Duration::from_millis(500));
    kill(victim, "-KILL");
    let killed = Instant::now();
    let again = wait_for(
        &job.log,
        "evaluating as rank 1 of 2",
        Duration::from_secs(60),
    );
    let text = job.finish(true);
    eprintln!(
        "SIGKILL during the evaluation -> the evaluation starts again: {:?}",
        again - killed
    );
    let want = format!("evaluation total {}", EVAL_ITEMS * (EVAL_ITEMS + 1) / 2);
    let totals: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("evaluation total"))
        .collect();
    assert_eq!(totals.len(), 2, "{text}");
    assert!(totals.iter().all(|l| l.ends_with(&want)), "{text}");
    assert!(text.contains("evaluating as rank 1 of 2"), "{text}");
    assert!(text.contains("left: [m1]"), "{text}");
    assert!(
        text.contains("after training: the work the ranks were doing together"),
        "{text}"
    );
    assert_unbroken(&finals(&text), 2, steps, &text);
    text
}

/// Ctrl-C in the launcher's terminal (SIGINT to its whole process group, ranks included) is an
/// interrupt: no rank is reported as failed or replaced, though replacements are allowed, and
/// the launcher ends as interrupted.
#[test]
fn ctrl_c_to_the_process_group_is_an_interrupt_not_failures_to_replace() {
    use std::os::unix::process::CommandExt;
    let dir = scratch("ctrl-c");
    let log = dir.join("launcher.log");
    let port = burn_ddp_comm::launch::spawn::free_port().unwrap();
    let mut launcher = launcher_cmd(
        port,
        &["--nproc-per-node", "3", "--max-restarts", "3"],
        100_000,
        &[],
        &log,
    )
    .process_group(0)
    .spawn()
    .unwrap();
    wait_for(&log, "[rank 2] step 10", Duration::from_secs(120));
    let group = format!("-{}", launcher.id());
    let status = Command::new("kill")
        .args(["-INT", "--", &group])
        .status()
        .unwrap();
    assert!(status.success());
    let (ok, text) = finish(&mut launcher, &log, Duration::from_secs(60));
    assert!(!ok, "{text}");
    assert!(!text.contains("starting member"), "{text}");
    assert!(!text.contains("the job goes on without it"), "{text}");
    assert!(text.contains("interrupted"), "{text}");
    if std::env::var_os("BURN_DDP_TEST_SHOW").is_some() {
        eprintln!("{text}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// 4 ranks; rank 1 is killed, and rank 2 a few milliseconds later, while the survivors are
/// still agreeing: they agree again, and the two left end equal.
#[test]
fn a_second_death_during_recovery_is_survived() {
    let steps = 150;
    let job = FtJob::start("twice", 4, 0, steps, &[]);
    let (a, b) = (job.pid(1, 1), job.pid(2, 2));
    wait_for(&job.log, "[rank 1] step 25", Duration::from_secs(120));
    kill(a, "-KILL");
    std::thread::sleep(Duration::from_millis(15));
    kill(b, "-KILL");
    let text = job.finish(true);
    assert_unbroken(&finals(&text), 2, steps, &text);
    assert!(
        text.contains("[m1, m2]") || text.contains("left: [m2]"),
        "{text}"
    );
}

/// `--min-ranks 3` and no replacements: after a rank dies the two left wait for a joiner, and
/// at the rendezvous timeout end with an error naming the minimum; the launcher fails.
#[test]
fn too_few_ranks_end_the_job_with_the_reason() {
    let dir = scratch("few");
    let log = dir.join("launcher.log");
    let port = burn_ddp_comm::launch::spawn::free_port().unwrap();
    let mut launcher = launcher_cmd(
        port,
        &["--nproc-per-node", "3", "--min-ranks", "3"],
        100_000,
        &[("BURN_DDP_RENDEZVOUS_TIMEOUT", "4s")],
        &log,
    )
    .spawn()
    .unwrap();
    let job = FtJob {
        launcher: Command::new("true").spawn().unwrap(),
        log: log.clone(),
        dir: dir.clone(),
        port,
        steps: 0,
    };
    let victim = job.pid(0, 0);
    wait_for(&log, "[rank 0] step 10", Duration::from_secs(120));
    kill(victim, "-KILL");
    let killed = Instant::now();
    let (ok, text) = finish(&mut launcher, &log, Duration::from_secs(120));
    assert!(!ok, "{text}");
    assert!(
        text.contains("fewer than the 3 it needs (BURN_DDP_MIN_RANKS)"),
        "{text}"
    );
    assert!(killed.elapsed() < Duration::from_secs(60), "{text}");
    let _ = std::fs::remove_dir_all(&dir);
}
