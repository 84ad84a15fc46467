//! Fault-tolerant jobs under the real launcher (`burn-ddp run --fault-tolerant`): started on a
//! free port, ranks SIGKILLed by their rank, and the Learner scenarios every Burn line's
//! classifier example must pass (a rank lost mid-epoch; rank 0 lost and a replacement joining
//! the running job), and the custom-loop scenario every line's `loop_state` must pass, with
//! bit-identical survivors.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use burn_ddp_comm::grad::LoopState;
use burn_ddp_comm::train::files::path;
use burn_ddp_comm::DdpError;

use crate::spawned::{
    children, classifier_args, digests, example, finish, paced, rank_of, wait_for_job, FAULT_PACE,
};

/// A fresh scratch directory for the test `name`.
pub fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("burn-ddp-ftt-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The launcher, fault-tolerant, on a free port, running `program args` on `nproc` ranks with
/// `restarts` replacements allowed; its output in `log`.
pub fn launch(nproc: u32, restarts: u32, program: &Path, args: &[String], log: &Path) -> Child {
    let port = burn_ddp_comm::launch::spawn::free_port().unwrap();
    let (nproc, restarts) = (nproc.to_string(), restarts.to_string());
    launch_on(
        port,
        &["--nproc-per-node", &nproc, "--max-restarts", &restarts],
        program,
        args,
        &[],
        log,
    )
}

/// The fault-tolerant launcher of the job on `port` (`--rdzv-id` from it), with `options`, and
/// `env` for its ranks.
pub fn launch_on(
    port: u16,
    options: &[&str],
    program: &Path,
    args: &[String],
    env: &[(&str, &str)],
    log: &Path,
) -> Child {
    let out = std::fs::File::create(log).unwrap();
    Command::new(crate::spawned::launcher())
        .args([
            "run",
            "--fault-tolerant",
            "--master-port",
            &port.to_string(),
        ])
        .args(["--rdzv-id", &format!("ftt-{port}")])
        .args(options)
        .arg("--")
        .arg(program)
        .args(args)
        .envs(env.iter().copied())
        // Failure detection, not the collective deadline, must bound every wait.
        .env("BURN_DDP_TIMEOUT", "10m")
        .env("BURN_DDP_HEARTBEAT_TIMEOUT", "3s")
        .env_remove("RANK")
        .env_remove("BURN_DDP_JOB_TOKEN")
        .stdin(Stdio::null())
        .stdout(out.try_clone().unwrap())
        .stderr(out)
        .spawn()
        .unwrap()
}

/// The pid of the process of `launcher` started as `rank`.
pub fn pid_of(launcher: &Child, rank: u32) -> u32 {
    children(launcher.id())
        .into_iter()
        .find(|p| rank_of(*p) == Some(rank))
        .unwrap_or_else(|| panic!("no process of rank {rank}"))
}

/// Sends `sig` (`-KILL`, `-STOP`, `-CONT`, `-TERM`) to `pid`, which must be running
/// ([`crate::chaos::signal`] for a process that may have exited).
pub fn signal(pid: u32, sig: &str) {
    use rustix::process::Signal;
    let s = match sig {
        "-KILL" => Signal::KILL,
        "-STOP" => Signal::STOP,
        "-CONT" => Signal::CONT,
        "-TERM" => Signal::TERM,
        other => panic!("no such signal in these tests: {other}"),
    };
    assert!(crate::chaos::signal(pid, s), "kill {sig} {pid} failed");
}

/// Kills (SIGKILL) the rank of `launcher` started as `rank`.
pub fn kill_rank(launcher: &Child, rank: u32) -> Instant {
    signal(pid_of(launcher, rank), "-KILL");
    Instant::now()
}

/// Asserts that `count` processes printed their parameter digest in `text`, all equal.
fn assert_equal_replicas(text: &str, count: usize) {
    let d = digests(text);
    assert_eq!(d.len(), count, "{text}");
    assert!(
        d.iter().all(|(_, x)| *x == d[0].1),
        "the replicas differ:\n{text}"
    );
}

/// The steps into the epoch a membership line says the job went on from.
pub fn steps_in(line: &str) -> usize {
    line.split(" steps in")
        .next()
        .and_then(|h| h.rsplit(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

/// Training images of the fault scenarios: divided by no world size they run at (1 to 4), so
/// that every epoch ends with shares that differ by one item, and a padded item would show as
/// one more than the epoch has in the progress line.
const TRAIN_ITEMS: u32 = 1537;

/// The progress line of `split`'s last step in `epoch` of `epochs` when every item of its `n`
/// was counted once (a fault-tolerant job counts every rank's items, each once).
pub fn every_item_once(split: &str, epoch: u32, epochs: u32, n: u32) -> String {
    format!("[{split}] epoch {epoch}/{epochs}  items {n}/{n}  ")
}

/// The classifier example `name` on 3 fault-tolerant ranks (`restarts` replacements allowed)
/// in a fresh directory, with rank `victim` SIGKILLed 1.5 s into the first epoch: the
/// directory, the launcher's log, the launcher, and when the kill happened.
fn classifier_losing(
    name: &str,
    test: &str,
    restarts: u32,
    victim: u32,
) -> (PathBuf, PathBuf, Child, Instant) {
    let dir = scratch(test);
    let log = dir.join("launcher.log");
    let mut job = launch(
        3,
        restarts,
        &example(name),
        &paced(
            classifier_args(&dir.join("out"), 2, TRAIN_ITEMS, 128),
            FAULT_PACE,
        ),
        &log,
    );
    wait_for_job(
        &mut job,
        &log,
        "[train] epoch 1/2",
        Duration::from_secs(300),
    );
    std::thread::sleep(Duration::from_millis(1500));
    let killed = kill_rank(&job, victim);
    (dir, log, job, killed)
}

/// 3 ranks train the classifier example `name` (Burn's Learner, the line's `DdpStrategy`);
/// rank 1 is SIGKILLed in the middle of the first epoch. The other two agree on a membership
/// of two within the heartbeat bound, go on from the step they were at, re-deal the rest of
/// the epoch, finish both epochs, and hold bit-identical parameters. The time from the kill to
/// the survivors' first completed step is measured.
pub fn classifier_loses_a_rank_mid_epoch(name: &str) {
    let (dir, log, mut job, killed) = classifier_losing(name, &format!("{name}-lose"), 0, 1);
    let first = wait_for_job(
        &mut job,
        &log,
        "the first step of membership epoch 1 is done",
        Duration::from_secs(60),
    );
    let (ok, text) = finish(&mut job, &log, Duration::from_secs(600));
    assert!(ok, "{text}");
    eprintln!(
        "SIGKILL of rank 1 -> the survivors' first step (seen in the log): {:?}",
        first - killed
    );
    let line = text
        .lines()
        .find(|l| l.contains("[membership] membership epoch 1: world size 2 (was 3); left: [m1]"))
        .unwrap_or_else(|| panic!("no membership line on rank 0:\n{text}"));
    assert!(line.contains("at epoch 1, training"), "{line}");
    assert!(steps_in(line) > 0, "not mid-epoch: {line}");
    // Rank 0's dashboard (its progress lines) shows the new world size and the change.
    assert!(
        text.lines().any(|l| l.contains("[train]")
            && l.contains("World size 2 | Membership epoch 1: world size 2 (was 3); left m1; at epoch 1, training")),
        "{text}"
    );
    assert!(text.contains("final test accuracy"), "{text}");
    assert_equal_replicas(&text, 2);
    // Every item of both epochs trained once, across the change (no padding: the progress
    // counts every rank's items).
    for epoch in 1..=2 {
        let line = every_item_once("train", epoch, 2, TRAIN_ITEMS);
        assert!(text.contains(&line), "no {line:?}:\n{text}");
    }
    assert!(
        text.contains("lost on the way: member 1 was killed by signal 9"),
        "{text}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// The items behind the entries of a Burn metric file (`value,count` lines; burn-train 0.22
/// adds an epoch's `value,final`) and their mean, weighted by the counts.
///
/// # Errors
/// The file cannot be read, or a line is not an entry.
pub fn logged(file: &Path) -> Result<(u32, f64), String> {
    let text = std::fs::read_to_string(file).map_err(|e| format!("{}: {e}", file.display()))?;
    let (mut n, mut sum) = (0u32, 0.0);
    for line in text
        .lines()
        .filter(|l| !l.is_empty() && !l.ends_with(",final"))
    {
        let (v, c) = line.split_once(',').unwrap_or((line, "1"));
        let bad = || format!("{}: {line:?} is not an entry", file.display());
        let v: f64 = v.parse().map_err(|_| bad())?;
        let c: u32 = c.parse().map_err(|_| bad())?;
        n += c;
        sum += v * f64::from(c);
    }
    Ok((n, sum / f64::from(n.max(1))))
}

/// The value a progress line shows after `metric` (`Accuracy epoch 62.35 % - batch ...`).
fn shown(line: &str, metric: &str) -> f64 {
    let at = line
        .find(&format!("{metric} epoch "))
        .unwrap_or_else(|| panic!("{line}"));
    let rest = &line[at + metric.len() + 7..];
    rest.split(' ')
        .next()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("{line}"))
}

/// The job's metric files in `out` hold every epoch's items (`train` training and `test`
/// validation images; at most one step of `step` images is lost, when a rank fails between a
/// step and the gather of its outputs), whichever process wrote them, and the accuracy rank 0
/// printed at each epoch's end is theirs: a rank that became rank 0 mid-epoch shows and
/// writes the whole epoch's metrics.
fn assert_whole_metrics(out: &Path, text: &str, epochs: u32, (train, test): (u32, u32), step: u32) {
    for epoch in 1..=epochs {
        let (n, mean) = logged(&out.join(format!("train/epoch-{epoch}/Accuracy.log"))).unwrap();
        assert!(
            n <= train && n + step >= train,
            "epoch {epoch}: {n} of {train} training items logged:\n{text}"
        );
        let end = every_item_once("train", epoch, epochs, train);
        let line = text
            .lines()
            .find(|l| l.contains(&end))
            .unwrap_or_else(|| panic!("no {end:?}:\n{text}"));
        let printed = shown(line, "Accuracy");
        assert!(
            (printed - mean).abs() < 0.006,
            "epoch {epoch}: printed {printed}, logged {mean}:\n{text}"
        );
        let (n, _) = logged(&out.join(format!("valid/epoch-{epoch}/Accuracy.log"))).unwrap();
        assert!(
            n <= test && n > 0,
            "epoch {epoch}: {n} of {test} validation items logged:\n{text}"
        );
    }
}

/// Rank 0 (the dashboard's) of the classifier example `name` is SIGKILLed mid-epoch with one
/// replacement allowed: rank 1 becomes rank 0 and carries on the progress lines, the
/// replacement joins the running job, takes a survivor's Learner state and position, and the
/// three end with the same parameters.
pub fn rank_zero_is_lost_and_a_replacement_joins(name: &str) {
    let (dir, log, mut job, _) = classifier_losing(name, &format!("{name}-zero"), 1, 0);
    let (ok, text) = finish(&mut job, &log, Duration::from_secs(600));
    assert!(ok, "{text}");
    assert!(text.contains("starting member 3 in its place"), "{text}");
    assert!(text.contains("left: [m0]"), "{text}");
    assert!(
        text.contains("this process joined the running job"),
        "{text}"
    );
    // The new rank 0 (started as rank 1) shows the dashboard's lines and the result, under the
    // prefix of the rank it is now: the launcher follows the change.
    assert!(
        text.contains("[rank 0] [membership] the first step of membership epoch 1 is done"),
        "{text}"
    );
    assert!(text.contains("[rank 0] final test accuracy"), "{text}");
    assert!(!text.contains("[rank 1] final test accuracy"), "{text}");
    assert_equal_replicas(&text, 3);
    // Rank 0's successor shows and writes the whole job's metrics, the epoch it took over in
    // included (3 ranks × batch 16 per step).
    assert_whole_metrics(&dir.join("out"), &text, 2, (TRAIN_ITEMS, 128), 48);
    let _ = std::fs::remove_dir_all(&dir);
}

/// The classifier example `name` on 3 fault-tolerant ranks: rank 0 is frozen (SIGSTOP) in the
/// first epoch, left out (the process started as rank 1 becomes rank 0), then continued: it
/// rejoins the running job as another rank. At the end one summary is printed, by the rank 0 of
/// the last membership, not by the process that began as rank 0; the three end equal.
pub fn frozen_rank_zero_rejoins_and_the_new_rank_zero_prints_the_summary(name: &str) {
    let dir = scratch(&format!("{name}-summary"));
    let log = dir.join("launcher.log");
    let mut job = launch(
        3,
        0,
        &example(name),
        &paced(classifier_args(&dir.join("out"), 3, 1536, 128), FAULT_PACE),
        &log,
    );
    wait_for_job(
        &mut job,
        &log,
        "[train] epoch 1/3",
        Duration::from_secs(300),
    );
    std::thread::sleep(Duration::from_millis(1500));
    let zero = pid_of(&job, 0);
    signal(zero, "-STOP");
    wait_for_job(&mut job, &log, "left: [m0]", Duration::from_secs(60));
    signal(zero, "-CONT");
    let (ok, text) = finish(&mut job, &log, Duration::from_secs(600));
    assert!(ok, "{text}");
    assert!(text.contains("joined: [m0]"), "{text}");
    let summaries: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("Learner Summary"))
        .collect();
    assert_eq!(summaries.len(), 1, "{text}");
    // Under the prefix of its rank now, not of the slot it started in (rank 1's).
    assert!(summaries[0].starts_with("[rank 0] "), "{text}");
    assert_equal_replicas(&text, 3);
    let _ = std::fs::remove_dir_all(&dir);
}

/// The classifier example `name` on 3 fault-tolerant ranks, 2 epochs, checkpoints kept: rank 0
/// is SIGKILLed as soon as the first file of epoch 1's checkpoint appears (its writes go on
/// threads of their own). The others must still be at the end of epoch 1: their new rank 0
/// writes the checkpoint of epoch 1 again, so at the end both epochs' checkpoints are
/// complete, with no temporary file left, and the survivors are equal.
pub fn rank_zero_dies_while_it_writes_a_checkpoint(name: &str) {
    let dir = scratch(&format!("{name}-ckpt"));
    let (mut job, log, checkpoints) = checkpointing_job(&dir, name, 2);
    let zero = pid_of(&job, 0);
    let first = path(&checkpoints, "model", 1);
    let deadline = Instant::now() + Duration::from_secs(300);
    while !first.exists() {
        assert!(Instant::now() < deadline, "no checkpoint of epoch 1");
        std::thread::sleep(Duration::from_millis(1));
    }
    signal(zero, "-KILL");
    let (ok, text) = finish(&mut job, &log, Duration::from_secs(600));
    assert!(ok, "{text}");
    assert!(text.contains("left: [m0]"), "{text}");
    assert_checkpoints_complete(&checkpoints, &[1, 2], &text);
    assert_equal_replicas(&text, 2);
    let _ = std::fs::remove_dir_all(&dir);
}

/// As [`rank_zero_dies_while_it_writes_a_checkpoint`] (3 epochs), but rank 0 is frozen
/// (SIGSTOP) with a checkpoint's temporary file of epoch 1 or 2 half written, past the
/// heartbeat bound: the others leave it out and their new rank 0 writes that checkpoint again
/// (clearing the temporaries of dead writers) before they train the next epoch; then it is
/// continued. Its own write must still complete (its temporary is not a dead writer's), it
/// rejoins, and the job ends well with the last two epochs' checkpoints complete and no
/// temporary left. A write is caught only if its temporary is still there once the signal has
/// landed: the scenario tries each of those epochs' writes (three each) until one is.
pub fn rank_zero_frozen_while_it_writes_a_checkpoint(name: &str) {
    let dir = scratch(&format!("{name}-ckpt-frozen"));
    let (mut job, log, checkpoints) = checkpointing_job(&dir, name, 3);
    let zero = pid_of(&job, 0);
    let mine = format!(".tmp-{zero}");
    // A temporary of rank 0's, of epoch 1 or 2 (one of epoch 3 would leave no epoch to rejoin).
    let temporary = || {
        let entries = std::fs::read_dir(&checkpoints).ok()?;
        entries.flatten().find_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            let epoch = (1..=2).find(|k| name.contains(&format!("-{k}.bin")))?;
            name.ends_with(&mine).then(|| (e.path(), epoch))
        })
    };
    let deadline = Instant::now() + Duration::from_secs(300);
    let (caught, epoch) = loop {
        assert!(
            Instant::now() < deadline,
            "rank 0 was never frozen with a temporary file half written"
        );
        if !job.try_wait().is_ok_and(|s| s.is_none()) {
            panic!(
                "the job ended before rank 0 was frozen mid-write:\n{}",
                std::fs::read_to_string(&log).unwrap_or_default()
            );
        }
        let Some((tmp, epoch)) = temporary() else {
            std::thread::sleep(Duration::from_micros(200));
            continue;
        };
        signal(zero, "-STOP");
        if tmp.exists() {
            break (tmp, epoch);
        }
        // Renamed before the signal landed: the next write.
        signal(zero, "-CONT");
    };
    wait_for_job(&mut job, &log, "left: [m0]", Duration::from_secs(60));
    // The survivors' end of that epoch waits for their new rank 0's write of its checkpoint.
    wait_for_job(
        &mut job,
        &log,
        &format!("[train] epoch {}/3", epoch + 1),
        Duration::from_secs(60),
    );
    signal(zero, "-CONT");
    let (ok, text) = finish(&mut job, &log, Duration::from_secs(600));
    assert!(
        ok,
        "rank 0 frozen while writing {}:\n{text}",
        caught.display()
    );
    assert!(text.contains("joined: [m0]"), "{text}");
    assert_checkpoints_complete(&checkpoints, &[2, 3], &text);
    assert_equal_replicas(&text, 3);
    let _ = std::fs::remove_dir_all(&dir);
}

/// The job of the checkpoint scenarios in `dir` (`epochs` of them), once it trains: its launcher, its log and
/// its checkpoint directory.
fn checkpointing_job(dir: &Path, name: &str, epochs: u32) -> (Child, PathBuf, PathBuf) {
    let log = dir.join("launcher.log");
    let out = dir.join("out");
    let mut job = launch(
        3,
        0,
        &example(name),
        &classifier_args(&out, epochs, 1536, 128),
        &log,
    );
    wait_for_job(
        &mut job,
        &log,
        &format!("[train] epoch 1/{epochs}"),
        Duration::from_secs(300),
    );
    (job, log, out.join("checkpoint"))
}

/// The checkpoints (model, optimizer, scheduler) of `epochs` are in `checkpoints`, and no
/// temporary file.
fn assert_checkpoints_complete(checkpoints: &Path, epochs: &[usize], text: &str) {
    for &epoch in epochs {
        for part in ["model", "optim", "scheduler"] {
            let file = path(checkpoints, part, epoch);
            assert!(file.is_file(), "{} is missing:\n{text}", file.display());
        }
    }
    let temporaries: Vec<String> = std::fs::read_dir(checkpoints)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains(".tmp-"))
        .collect();
    assert!(temporaries.is_empty(), "{temporaries:?}");
}

/// The number of steps of the custom-loop scenario
/// ([`custom_loop_recovers_and_takes_in_a_joiner`]).
const LOOP_STEPS: u64 = 300;

/// In a rank of the custom-loop scenario (the test function `child` run by the launcher): its
/// group, after printing its member id and pid (the scenario kills rank 2 once it is up);
/// `None` in any other process.
pub fn loop_child(child: &str) -> Option<burn_ddp_comm::ProcessGroup> {
    if std::env::var("BURN_DDP_TEST_CHILD").as_deref() != Ok(child) {
        return None;
    }
    burn_ddp_comm::launch::cli::init_logging();
    println!();
    let pg = burn_ddp_comm::ProcessGroup::from_env().unwrap_or_else(|e| panic!("joining: {e}"));
    let member = pg.membership().map_or(0, |m| m.0);
    println!("member {member} pid {}", std::process::id());
    Some(pg)
}

/// A custom loop's rank, driven: `train` (one step, `step_boundary` first, the optimizer step
/// and `state.step += 1` last) until the scenario's step count, `recover` after a step that
/// failed; each change of membership printed, then the final step with a digest of `bits` of
/// the final model (what the scenario compares).
pub fn drive_loop<C, M: Clone, O: Clone>(
    ctx: &mut C,
    state: &mut LoopState<M, O>,
    mut train: impl FnMut(&mut C, &mut LoopState<M, O>) -> burn_ddp_comm::Result<()>,
    mut recover: impl FnMut(&mut C, DdpError, &mut LoopState<M, O>) -> burn_ddp_comm::Result<()>,
    bits: impl Fn(&M) -> Vec<u32>,
) {
    while state.step < LOOP_STEPS {
        if let Err(e) = train(ctx, state) {
            recover(ctx, e, state).unwrap_or_else(|e| panic!("recovering: {e}"));
        }
        if let Some(rec) = &state.changed {
            println!("changed: {}", rec.summary());
        }
        std::thread::sleep(Duration::from_millis(15));
    }
    let digest = bits(&state.model)
        .into_iter()
        .fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
        });
    println!("final step {} digest {digest:016x}", state.step);
}

/// A custom loop on a line's gradient sync (`loop_state`, `step_boundary`, `recover`): the
/// test function `child` of this test binary ([`loop_child`], [`drive_loop`]), run as 3
/// fault-tolerant ranks for 300 steps; rank
/// 2 is SIGKILLed; the two survivors go on; later a process started by a second launcher
/// (`--join`) is let in at a step boundary and takes a survivor's model and optimizer. The
/// three must end after all the steps with equal parameters (the digest each prints).
pub fn custom_loop_recovers_and_takes_in_a_joiner(child: &str) {
    let dir = scratch(&format!("loop-{child}"));
    let (log, log_join) = (dir.join("launcher.log"), dir.join("joiner.log"));
    let args = crate::procs::rerun_args(child);
    let env = [("BURN_DDP_TEST_CHILD", child)];
    let port = burn_ddp_comm::launch::spawn::free_port().unwrap();
    let exe = std::env::current_exe().unwrap();
    let mut job = launch_on(port, &["--nproc-per-node", "3"], &exe, &args, &env, &log);
    wait_for_job(&mut job, &log, "member 2 pid", Duration::from_secs(120));
    std::thread::sleep(Duration::from_millis(1000));
    kill_rank(&job, 2);
    wait_for_job(
        &mut job,
        &log,
        "changed: membership epoch 1",
        Duration::from_secs(60),
    );
    let mut joiner = launch_on(
        port,
        &["--join", "--nproc-per-node", "1"],
        &exe,
        &args,
        &env,
        &log_join,
    );
    let (ok_j, joined) = finish(&mut joiner, &log_join, Duration::from_secs(600));
    let (ok, text) = finish(&mut job, &log, Duration::from_secs(600));
    assert!(ok, "{text}");
    assert!(ok_j, "{joined}\n---- job ----\n{text}");
    assert!(text.contains("joined: [m3]"), "{text}");
    assert!(text.contains("a process asked to join"), "{text}");
    let finals: Vec<String> = [&text, &joined]
        .iter()
        .flat_map(|t| t.lines())
        .filter_map(|l| {
            l.split_once(&format!("final step {LOOP_STEPS} digest "))
                .map(|p| p.1.to_string())
        })
        .collect();
    assert_eq!(finals.len(), 3, "{text}\n{joined}");
    assert!(
        finals.iter().all(|d| *d == finals[0]),
        "the replicas differ:\n{text}\n{joined}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// The chaos run ([`crate::chaos`]) on the classifier example `name`: `faults` faults on jobs
/// of 3 ranks (3 epochs of 1,536 images each), seeded by `BURN_DDP_CHAOS_SEED` or else the
/// clock (the seed is printed, and named in a failure). Every invariant must hold.
pub fn chaos_schedule(name: &str, faults: usize) {
    chaos_with(name, faults, false);
}

/// [`chaos_schedule`] with each job on three nodes (network namespaces) and its store on an
/// etcd cluster of one member per node: link cuts and the loss of a whole node (with its etcd
/// member) among the faults. The example and the launcher are built with `etcd`.
pub fn chaos_schedule_on_etcd(name: &str, faults: usize) {
    chaos_with(name, faults, true);
}

fn chaos_with(name: &str, faults: usize, etcd: bool) {
    let seed = std::env::var("BURN_DDP_CHAOS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(crate::chaos::clock_seed);
    let (program, launcher) = if etcd {
        let (launcher, program) = crate::etcd::etcd_builds(name);
        (program, launcher)
    } else {
        (example(name), crate::spawned::launcher())
    };
    let chaos = crate::chaos::Chaos {
        program,
        launcher,
        nproc: 3,
        faults,
        limit: Duration::from_secs(900),
        seed,
        epochs: 3,
        train: TRAIN_ITEMS,
        test: 128,
        heartbeat: Duration::from_secs(3),
        bound: Duration::from_secs(60),
        dir: scratch(&format!("{name}-chaos{}", if etcd { "-etcd" } else { "" })),
        etcd,
    };
    eprintln!("chaos run of {faults} faults on {name}, seed {seed} (BURN_DDP_CHAOS_SEED)");
    match crate::chaos::run(&chaos) {
        Ok(report) => {
            eprintln!("{}", report.text(&chaos));
            assert!(report.total() >= faults, "{}", report.text(&chaos));
            let _ = std::fs::remove_dir_all(&chaos.dir);
        }
        Err(e) => panic!("chaos run (seed {seed}) failed: {e}"),
    }
}
