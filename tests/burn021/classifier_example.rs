//! End to end: the `classifier` example (built by `cargo test` with the other examples) trains
//! with Burn's Learner and `DdpStrategy` on 2 real processes, started through `burn-ddp run` and
//! through its own `burn_ddp::spawn`, and a killed rank ends the job promptly.

use crate::common;

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use common::spawned::{children, files_under, rank_of, Spawned};

fn example() -> PathBuf {
    common::spawned::example("classifier")
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("burn-ddp-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

fn launcher() -> PathBuf {
    common::spawned::launcher()
}

/// Through `burn-ddp run`, the example trains with Burn's Learner and `DdpStrategy`; each rank
/// gets its own `--out` (`{rank}`), so what a rank writes shows in its own directory.
#[test]
fn two_ranks_agree_and_only_rank_0_writes() {
    let out = scratch("classifier");
    // A fresh run starts clean: files of an older run in the same directory are gone after it.
    std::fs::create_dir_all(out.join("rank-0/train/epoch-2")).unwrap();
    std::fs::write(out.join("rank-0/train/epoch-2/Loss.log"), "stale").unwrap();
    let mut cmd = Command::new(launcher());
    cmd.args(["run", "--standalone", "--nproc-per-node", "2", "--"])
        .arg(example())
        .args(["--epochs", "1", "--batch-size", "16"])
        .args([
            // Neither split divides evenly over 2 ranks: the training shards are padded.
            "--train-size",
            "191",
            "--test-size",
            "63",
            "--print-digest",
            "--out",
        ])
        .arg(out.join("rank-{rank}"))
        .env_remove("RANK")
        .env_remove("SLURM_PROCID");
    let run = Spawned::start(&mut cmd, Duration::from_secs(600)).finish();
    let stdout = String::from_utf8_lossy(&run.stdout);
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(run.status.success(), "stdout:\n{stdout}\nstderr:\n{stderr}");

    let digest = |rank: u32| common::spawned::digest(&stdout, rank);
    assert_eq!(
        digest(0),
        digest(1),
        "the ranks' parameters differ:\n{stdout}"
    );

    // Rank 0 reports progress (global metrics) and the result; rank 1 prints only its digest.
    assert!(
        stdout.contains("[rank 0] final test accuracy: "),
        "{stdout}"
    );
    assert!(
        stdout.contains("[rank 0] [train] epoch 1/1  items 191/191"),
        "progress counts every item once, not the padding: {stdout}"
    );
    assert!(
        stdout.contains("[rank 0] [valid] epoch 1/1  items 63/63"),
        "validation counts every item once: {stdout}"
    );
    let rank1: Vec<&str> = stdout
        .lines()
        .filter(|l| l.starts_with("[rank 1]"))
        .collect();
    assert_eq!(
        rank1.len(),
        1,
        "rank 1 printed more than its digest: {rank1:?}"
    );

    assert_eq!(
        files_under(&out.join("rank-0")),
        [
            "checkpoint/model-1.bin",
            "checkpoint/optim-1.bin",
            "checkpoint/run.txt",
            "checkpoint/scheduler-1.bin",
            "train/epoch-1/Accuracy.log",
            "train/epoch-1/Loss.log",
            "valid/epoch-1/Accuracy.log",
            "valid/epoch-1/Loss.log",
        ]
    );
    assert!(
        !out.join("rank-1").exists(),
        "rank 1 wrote files: {:?}",
        files_under(&out.join("rank-1"))
    );
    std::fs::remove_dir_all(&out).unwrap();
}

#[test]
fn killing_a_rank_ends_the_job_within_30_s_naming_it() {
    let out = scratch("classifier-kill");
    let mut cmd = Command::new(example());
    cmd.args([
        "--nproc",
        "2",
        "--epochs",
        "100",
        "--train-size",
        "400",
        "--test-size",
        "64",
    ])
    .arg("--out")
    .arg(&out)
    .env_remove("RANK")
    .env_remove("SLURM_PROCID")
    .env("BURN_DDP_TIMEOUT", "10m") // the bound must come from failure detection
    .env_remove("RUST_LOG");
    let job = Spawned::start(&mut cmd, Duration::from_secs(600));
    // Wait until both ranks train (rank 0 has logged a step).
    let deadline = Instant::now() + Duration::from_secs(120);
    let victim = loop {
        assert!(Instant::now() < deadline, "the job never started training");
        // Rank 0 has logged metrics of a training step.
        let training = out.join("train/epoch-1/Loss.log").exists();
        let ranks: Vec<(u32, u32)> = children(job.id())
            .into_iter()
            .filter_map(|p| Some((p, rank_of(p)?)))
            .collect();
        if training && ranks.len() == 2 {
            break ranks.into_iter().find(|&(_, r)| r == 1).unwrap().0;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    let killed_at = Instant::now();
    Command::new("kill")
        .args(["-9", &victim.to_string()])
        .status()
        .unwrap();
    let result = job.finish();
    let took = killed_at.elapsed();
    let stderr = String::from_utf8_lossy(&result.stderr);
    assert!(
        !result.status.success(),
        "the job succeeded after a rank was killed"
    );
    assert!(took < Duration::from_secs(30), "took {took:?}");
    assert!(
        stderr.contains("rank 1") && stderr.contains("SIGKILL"),
        "the failure does not name rank 1 and how it died:\n{stderr}"
    );
    let _ = std::fs::remove_dir_all(&out);
}

/// Runs the example through `burn-ddp run` (2 ranks, 3 short epochs, resuming from its
/// checkpoints when restarted); if `victim` is given, kills that rank with SIGKILL once the
/// checkpoint of epoch 1 is complete (all three records). Returns (success, stdout, stderr, seconds from the kill to
/// the launcher's exit).
fn elastic_run(
    out: &std::path::Path,
    max_restarts: u32,
    victim: Option<u32>,
) -> (bool, String, String, Duration) {
    let mut cmd = Command::new(launcher());
    cmd.args([
            "run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "--max-restarts",
        ])
        .arg(max_restarts.to_string())
        .arg("--")
        .arg(example())
        .args(["--epochs", "3", "--batch-size", "16", "--train-size", "768"])
        .args(["--test-size", "64", "--resume", "--print-digest", "--out"])
        .arg(out)
        .env_remove("RANK")
        .env_remove("SLURM_PROCID")
        .env("BURN_DDP_TIMEOUT", "10m") // the bound must come from failure detection
        .env("RUST_LOG", "burn_ddp=info") // to see where training resumed
        ;
    let job = Spawned::start(&mut cmd, Duration::from_secs(900));
    let mut killed_at = None;
    if let Some(victim) = victim {
        let deadline = Instant::now() + Duration::from_secs(300);
        let pid = loop {
            assert!(Instant::now() < deadline, "epoch 1 never finished");
            // The three records are written by three threads: wait for the whole epoch.
            let ready = ["model", "optim", "scheduler"]
                .iter()
                .all(|p| out.join(format!("checkpoint/{p}-1.bin")).exists());
            let ranks: Vec<(u32, u32)> = children(job.id())
                .into_iter()
                .filter_map(|p| Some((p, rank_of(p)?)))
                .collect();
            if let Some(&(pid, _)) = ranks.iter().find(|&&(_, r)| r == victim) {
                if ready {
                    break pid;
                }
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        Command::new("kill")
            .args(["-9", &pid.to_string()])
            .status()
            .unwrap();
        killed_at = Some(Instant::now());
    }
    let result = job.finish();
    let took = killed_at.map(|t| t.elapsed()).unwrap_or_default();
    (
        result.status.success(),
        String::from_utf8_lossy(&result.stdout).into_owned(),
        String::from_utf8_lossy(&result.stderr).into_owned(),
        took,
    )
}

fn digests(stdout: &str) -> Vec<String> {
    (0..2)
        .map(|rank| common::spawned::digest(stdout, rank))
        .collect()
}

/// Each rank in turn is killed during training: without restarts the launcher fails within 30 s
/// naming it; with `--max-restarts 1` the group restarts, resumes from the newest complete
/// checkpoint and ends with exactly the parameters of a run that was never interrupted.
#[test]
fn a_killed_rank_is_named_and_one_restart_resumes_bit_for_bit() {
    let base = scratch("elastic");
    let (ok, stdout, stderr, _) = elastic_run(&base.join("unbroken"), 0, None);
    assert!(ok, "stdout:\n{stdout}\nstderr:\n{stderr}");
    let unbroken = digests(&stdout);
    assert_eq!(unbroken[0], unbroken[1], "{stdout}");

    for victim in [0, 1] {
        let (ok, stdout, stderr, took) =
            elastic_run(&base.join(format!("fail-{victim}")), 0, Some(victim));
        assert!(!ok, "rank {victim} was killed, yet:\n{stdout}\n{stderr}");
        // Rank 0's summary, when it printed one before the launcher stopped it, counts the
        // epochs completed before the kill, not the one it stopped.
        common::spawned::assert_summary_counts_completed_epochs(&stdout);
        assert!(took < Duration::from_secs(30), "took {took:?}");
        assert!(
            stderr.contains(&format!("rank {victim} (pid")) && stderr.contains("SIGKILL"),
            "the failure does not name rank {victim} and how it died:\n{stderr}"
        );

        let (ok, stdout, stderr, _) =
            elastic_run(&base.join(format!("restart-{victim}")), 1, Some(victim));
        assert!(ok, "stdout:\n{stdout}\nstderr:\n{stderr}");
        assert!(
            stderr.contains("restarting the whole group (restart 1 of 1)"),
            "{stderr}"
        );
        // The restarted group resumed (a full rerun would end the same way, being
        // deterministic): both ranks loaded a checkpoint written before the kill.
        for rank in 0..2 {
            assert!(
                stderr.contains(&format!(
                    "[rank {rank}] resumed from the checkpoint of epoch"
                )),
                "rank {rank} did not resume:\n{stderr}"
            );
        }
        // Rank 0's dashboard (its progress lines here) shows the restart.
        assert!(
            stdout.contains(
                "World size 2 | Membership restart 1: world size 2, from the checkpoint of epoch"
            ),
            "{stdout}"
        );
        assert_eq!(
            digests(&stdout),
            unbroken,
            "killed rank {victim}, restarted: parameters differ from the unbroken run"
        );
    }
    let _ = std::fs::remove_dir_all(&base);
}

/// Ctrl-C reaches the launcher and its ranks (one process group): under `--max-restarts` the
/// job stops, non-zero, and is not restarted, even when a rank dies of the signal before the
/// launcher notices it.
#[test]
fn ctrl_c_under_max_restarts_stops_without_restarting() {
    use std::os::unix::process::CommandExt;
    let out = scratch("ctrl-c");
    let mut cmd = Command::new(launcher());
    cmd.args([
        "run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "2",
        "--",
    ])
    .arg(example())
    .args([
        "--epochs",
        "100",
        "--train-size",
        "400",
        "--test-size",
        "64",
        "--out",
    ])
    .arg(&out)
    .env_remove("RANK")
    .env_remove("SLURM_PROCID")
    .process_group(0);
    let job = Spawned::start(&mut cmd, Duration::from_secs(300));
    let deadline = Instant::now() + Duration::from_secs(120);
    while !out.join("train/epoch-1/Loss.log").exists() {
        assert!(Instant::now() < deadline, "the job never started training");
        std::thread::sleep(Duration::from_millis(100));
    }
    // What a terminal does on Ctrl-C: SIGINT to the whole foreground process group.
    let group = rustix::process::Pid::from_raw(job.id() as i32).unwrap();
    rustix::process::kill_process_group(group, rustix::process::Signal::INT).unwrap();
    let stopped_at = Instant::now();
    let result = job.finish();
    let stderr = String::from_utf8_lossy(&result.stderr);
    assert!(!result.status.success(), "{stderr}");
    assert!(
        !stderr.contains("restarting"),
        "a Ctrl-C restarted the job:\n{stderr}"
    );
    assert!(
        stopped_at.elapsed() < Duration::from_secs(30),
        "took {:?}",
        stopped_at.elapsed()
    );
    let _ = std::fs::remove_dir_all(&out);
}
