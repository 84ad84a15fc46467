//! A job started by a test (a launcher, an example), with a deadline, stopped when the test ends.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// The thread that reads one of a job's pipes to its end.
type Reader = JoinHandle<Vec<u8>>;

/// A job started by a test, with a deadline. Its output is read on threads; it is stopped when
/// it outlives its deadline, and when the test ends or fails first (SIGTERM, which the launcher
/// and `spawn` forward to their ranks; SIGKILL 10 s later), so no job outlives its test.
pub struct Spawned {
    child: Child,
    /// stdout's and stderr's.
    readers: Option<(Reader, Reader)>,
    deadline: Instant,
}

impl Spawned {
    pub fn start(cmd: &mut Command, limit: Duration) -> Self {
        let mut child = cmd
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let read = |mut pipe: Box<dyn Read + Send>| {
            std::thread::spawn(move || {
                let mut buf = Vec::new();
                let _ = pipe.read_to_end(&mut buf);
                buf
            })
        };
        let out = read(Box::new(child.stdout.take().unwrap()));
        let err = read(Box::new(child.stderr.take().unwrap()));
        Self {
            child,
            readers: Some((out, err)),
            deadline: Instant::now() + limit,
        }
    }

    pub fn id(&self) -> u32 {
        self.child.id()
    }

    /// Waits for the job to end, at most until its deadline (then it is stopped and the test
    /// fails with what it printed).
    pub fn finish(mut self) -> Output {
        let status = loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                break status;
            }
            if Instant::now() >= self.deadline {
                let status = self.stop();
                let (out, err) = self.output();
                panic!(
                    "the job passed its deadline and was stopped ({status:?})\nstdout:\n{}\nstderr:\n{}",
                    String::from_utf8_lossy(&out),
                    String::from_utf8_lossy(&err)
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        let (stdout, stderr) = self.output();
        Output {
            status,
            stdout,
            stderr,
        }
    }

    fn output(&mut self) -> (Vec<u8>, Vec<u8>) {
        let (out, err) = self.readers.take().unwrap();
        (out.join().unwrap(), err.join().unwrap())
    }

    fn stop(&mut self) -> Option<std::process::ExitStatus> {
        let pid = rustix::process::Pid::from_raw(self.child.id() as i32)?;
        let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
        let grace = Instant::now() + Duration::from_secs(10);
        while Instant::now() < grace {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        self.child.wait().ok()
    }
}

impl Drop for Spawned {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            self.stop();
        }
    }
}

/// The target folder of this test binary's profile, where cargo puts the workspace's binaries
/// and examples: a test binary lies in `target/<profile>/deps/`.
pub fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("the running test binary has a path");
    exe.parent()
        .and_then(|d| d.parent())
        .expect("a test binary lies in target/<profile>/deps/")
        .to_path_buf()
}

/// The workspace's root package, which holds the examples (the repository's top-level
/// `examples/`), for the Burn release its features choose.
pub const ROOT_PACKAGE: &str = "burn-ddp-workspace";

/// The cargo package selection and features of the run that built the tests under way, from
/// `BURN_DDP_TEST_RUN` (scripts/test.sh sets it for each of its runs, e.g. `--workspace
/// --features ...` or `-p burn-ddp-workspace --no-default-features --features burn-0-22`), else
/// `default`. A build made here with them finds every unit that run built current and builds
/// nothing more; with other features cargo would resolve Burn's features afresh and compile it
/// again in the middle of a test.
pub fn test_run(default: &[&str]) -> Vec<String> {
    match std::env::var("BURN_DDP_TEST_RUN") {
        Ok(run) if !run.trim().is_empty() => run.split_whitespace().map(String::from).collect(),
        _ => default.iter().map(|a| a.to_string()).collect(),
    }
}

/// The built example `name` (the root package's), from `target/<profile>/examples/`. `cargo
/// test` builds every example of the packages it tests, for the release its features choose, so
/// the example found there is the run's own; `cargo test --test X` builds none, and a missing one
/// is built here with the run's selection ([`test_run`]; without it, the root package's
/// defaults: Burn 0.21). An example has one name on every release: run the tests of one release
/// after `cargo test`'s build for that release, not after another release's (scripts/test.sh
/// runs the releases one after another, each run building its examples first).
pub fn example(name: &str) -> PathBuf {
    let path = profile_dir().join("examples").join(name);
    if !path.exists() {
        let run = test_run(&["-p", ROOT_PACKAGE]);
        let mut args: Vec<&str> = run.iter().map(String::as_str).collect();
        args.extend(["--example", name]);
        cargo_build(&args, &format!("the {name} example"));
    }
    path
}

/// The least time a classifier step takes (`--min-step-ms`) in the scenarios that inject their
/// fault a moment after an epoch starts: its 32 steps then outlast that moment, and what must
/// follow the fault before the job ends (a replacement joining, a frozen rank rejoining), on a
/// machine or build however fast. A step that takes longer anyway is not delayed.
pub const FAULT_PACE: std::time::Duration = std::time::Duration::from_millis(150);

/// `args` with `--min-step-ms` of `step`.
pub fn paced(mut args: Vec<String>, step: std::time::Duration) -> Vec<String> {
    args.extend(["--min-step-ms".into(), step.as_millis().to_string()]);
    args
}

/// The classifier example's arguments for a test job: `epochs` over `train` generated images
/// in batches of 16 per rank, `test` test images, the parameter digest printed at the end
/// ([`digest`]), its files in `out`.
pub fn classifier_args(out: &Path, epochs: u32, train: u32, test: u32) -> Vec<String> {
    let mut args: Vec<String> = ["--epochs", "--batch-size", "--train-size", "--test-size"]
        .iter()
        .zip([epochs, 16, train, test])
        .flat_map(|(name, value)| [name.to_string(), value.to_string()])
        .collect();
    args.extend([
        "--print-digest".into(),
        "--out".into(),
        out.display().to_string(),
    ]);
    args
}

/// Runs the classifier example `name` on 2 ranks, small and fast (96 training images, 32 test
/// images, batch 16, 2 epochs), writing into `out`, with `args` after the defaults (a later
/// option wins): its output, stdout and stderr. Its logs into a pipe carry no colour codes.
pub fn small_run(name: &str, out: &Path, args: &[&str]) -> (Output, String, String) {
    let mut cmd = Command::new(example(name));
    cmd.args(["--nproc", "2", "--batch-size", "16", "--train-size", "96"])
        .args(["--test-size", "32", "--epochs", "2", "--out"])
        .arg(out)
        .args(args)
        .env_remove("RANK")
        .env_remove("SLURM_PROCID")
        .env_remove("RUST_LOG");
    let output = Spawned::start(&mut cmd, Duration::from_secs(300)).finish();
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert!(
        !stderr.contains('\x1b'),
        "colour codes in piped logs:\n{stderr}"
    );
    (output, stdout, stderr)
}

/// The parameter digest rank `rank` printed last in `log` (the classifier's `--print-digest`,
/// `[rank N] parameter digest: ...`).
pub fn digest(log: &str, rank: u32) -> String {
    let prefix = format!("[rank {rank}] parameter digest: ");
    log.lines()
        .rev()
        .find_map(|l| l.strip_prefix(&prefix))
        .unwrap_or_else(|| panic!("no digest from rank {rank}:\n{log}"))
        .to_string()
}

/// Every parameter digest line of `log`, with its `[rank N]` prefix, in order.
pub fn digests(log: &str) -> Vec<(String, String)> {
    log.lines()
        .filter_map(|l| {
            let (who, rest) = l.split_once("] parameter digest: ")?;
            Some((who.to_string() + "]", rest.trim().to_string()))
        })
        .collect()
}

/// The `burn-ddp` launcher (built from burn-ddp-comm when missing).
pub fn launcher() -> PathBuf {
    let path = profile_dir().join("burn-ddp");
    if !path.exists() {
        cargo_build(
            &["-p", "burn-ddp-comm", "--bin", "burn-ddp"],
            "the launcher",
        );
    }
    path
}

/// `cargo build ARGS` in the package under test's directory, with the cargo that runs the test;
/// a failed build fails the test, naming `what` and the command.
pub fn cargo_build(args: &[&str], what: &str) {
    let status = Command::new(env!("CARGO"))
        .arg("build")
        .args(args)
        .current_dir(crate::package_dir())
        .status()
        .expect("cargo, which runs this test, can be started again to build");
    assert!(
        status.success(),
        "building {what} failed (cargo build {})",
        args.join(" ")
    );
}

/// Pids of `parent`'s direct children.
pub fn children(parent: u32) -> Vec<u32> {
    let mut out = Vec::new();
    for task in std::fs::read_dir(format!("/proc/{parent}/task"))
        .into_iter()
        .flatten()
    {
        let path = task.unwrap().path().join("children");
        if let Ok(s) = std::fs::read_to_string(path) {
            out.extend(s.split_whitespace().filter_map(|p| p.parse::<u32>().ok()));
        }
    }
    out
}

/// The `RANK` a process was started with.
pub fn rank_of(pid: u32) -> Option<u32> {
    let env = std::fs::read(format!("/proc/{pid}/environ")).ok()?;
    env.split(|&b| b == 0)
        .find_map(|kv| kv.strip_prefix(b"RANK="))
        .and_then(|v| std::str::from_utf8(v).ok()?.parse().ok())
}

/// The files below `dir`, as sorted paths relative to it.
pub fn files_under(dir: &std::path::Path) -> Vec<String> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else {
                out.push(p.strip_prefix(dir).unwrap().display().to_string());
            }
        }
    }
    out.sort();
    out
}

/// Checks that Burn's summary in `stdout`, if one was printed, counts the epochs that were
/// completed (the last `[valid] epoch K/N  items T/T` line of the progress lines), not the
/// epoch a failure interrupted.
pub fn assert_summary_counts_completed_epochs(stdout: &str) {
    let Some(total) = stdout
        .lines()
        .find_map(|l| l.split("Total Epochs: ").nth(1))
        .map(|n| n.trim().parse::<usize>().expect("Total Epochs: <n>"))
    else {
        return;
    };
    let completed = stdout
        .lines()
        .filter_map(|l| {
            let rest = l.split("[valid] epoch ").nth(1)?;
            let epoch: usize = rest.split('/').next()?.parse().ok()?;
            let items = rest.split("items ").nth(1)?.split_whitespace().next()?;
            let (done, all) = items.split_once('/')?;
            (done == all).then_some(epoch)
        })
        .max()
        .unwrap_or(0);
    assert_eq!(
        total, completed,
        "Burn's summary counts {total} epochs, {completed} were completed:\n{stdout}"
    );
}

/// For a test that must read what rank 0 prints (Burn's summary, on stdout): runs test `name`
/// of this test binary again in a child process, with `var` set to `dir`, and returns its
/// stdout after checking that it passed. The test does its real work when it finds `var` set.
pub fn rerun_in_child(name: &str, var: &str, dir: &std::path::Path) -> String {
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(crate::procs::rerun_args(name))
        .env(var, dir)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    stdout
}

/// What a run that failed in the middle of epoch 2, with rank 0's metric logs in
/// `dir/rank-0`, must have printed: a summary of one epoch.
pub fn assert_summarised_as_one_epoch(stdout: &str, dir: &std::path::Path) {
    assert!(
        dir.join("rank-0/train/epoch-2").is_dir(),
        "rank 0 logged nothing of epoch 2: the run failed too early to test anything"
    );
    assert!(
        stdout.contains("Total Epochs: 1\n"),
        "expected one completed epoch in the summary:\n{stdout}"
    );
}

/// Waits until `log` contains `needle` (or `deadline` passes: then panics with the log).
pub fn wait_for(log: &Path, needle: &str, limit: Duration) -> Instant {
    let deadline = Instant::now() + limit;
    loop {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        if text.contains(needle) {
            return Instant::now();
        }
        assert!(
            Instant::now() < deadline,
            "{needle:?} not in {} within {limit:?}:\n{text}",
            log.display()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Waits until `log` contains `needle`, which `job` (a launcher writing `log`) is to print;
/// panics with the log when `limit` passes or when `job` ends first (at once: a launcher that
/// failed prints nothing more).
pub fn wait_for_job(job: &mut Child, log: &Path, needle: &str, limit: Duration) -> Instant {
    let deadline = Instant::now() + limit;
    loop {
        let ended = job.try_wait().unwrap();
        let text = std::fs::read_to_string(log).unwrap_or_default();
        if text.contains(needle) {
            return Instant::now();
        }
        if let Some(status) = ended {
            panic!(
                "the job ended ({status}) before {needle:?} was in {}:\n{text}",
                log.display()
            );
        }
        assert!(
            Instant::now() < deadline,
            "{needle:?} not in {} within {limit:?}:\n{text}",
            log.display()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Waits until every path exists.
pub fn wait_for_files(paths: &[PathBuf], limit: Duration) {
    let deadline = Instant::now() + limit;
    while !paths.iter().all(|p| p.exists()) {
        assert!(
            Instant::now() < deadline,
            "{paths:?} not written within {limit:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Waits for `child` to end within `limit` (else kills it and panics with `log`).
pub fn finish(child: &mut Child, log: &Path, limit: Duration) -> (bool, String) {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return (
                status.success(),
                std::fs::read_to_string(log).unwrap_or_default(),
            );
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "{} did not end within {limit:?}:\n{}",
                log.display(),
                std::fs::read_to_string(log).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The pipeline example (`examples/pipeline/`, the run's release) on 2 stages x 2 replicas in 4
/// processes through `burn-ddp run`: it says so, one rank prints one line per epoch, and the
/// loss falls over the 3 epochs.
pub fn pipeline_example_trains_two_stages_by_two_replicas() {
    let mut cmd = Command::new(launcher());
    cmd.args(["run", "--standalone", "--nproc-per-node", "4", "--"])
        .arg(example("pipeline"))
        .args(["--epochs", "3", "--train-size", "512", "--batch-size", "32"])
        .env_remove("RANK")
        .env_remove("SLURM_PROCID");
    let run = Spawned::start(&mut cmd, Duration::from_secs(600)).finish();
    let stdout = String::from_utf8_lossy(&run.stdout);
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(run.status.success(), "stdout:\n{stdout}\nstderr:\n{stderr}");
    assert!(
        stdout.contains("4 ranks = 2 stages x 2 replicas, 1f1b with 4 micro-batches"),
        "{stdout}"
    );
    let losses: Vec<f64> = stdout
        .lines()
        .filter_map(|l| l.split("loss ").nth(1)?.split(',').next()?.parse().ok())
        .collect();
    assert_eq!(
        losses.len(),
        3,
        "one line per epoch from one rank:\n{stdout}"
    );
    assert!(
        losses[2] < losses[0],
        "the loss must fall: {losses:?}\n{stdout}"
    );
}
