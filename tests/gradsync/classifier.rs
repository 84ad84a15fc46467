//! End to end on Burn 0.22.1 or 0.23 (the release this binary is built for): the classifier
//! example (`examples/classifier/`, built by `cargo test` for the same release with the other
//! examples) trains with that release's Learner and burn-ddp's `DdpStrategy`
//! on 2 real processes through `burn-ddp run`; a killed rank ends the job naming it; a
//! restarted group resumes bit for bit; a checkpoint rank 0 cannot write fails the job.

use crate::CLASSIFIER as EXAMPLE;

#[allow(dead_code)]
use burn_ddp_dev::spawned;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use spawned::{children, files_under, rank_of, Spawned};

fn example() -> PathBuf {
    spawned::example(EXAMPLE)
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "{}-{name}-{}",
        env!("CARGO_CRATE_NAME"),
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// The example through the launcher on 2 ranks with `args`, stopped after `limit`.
fn launched(args: &[&str], out: &Path, max_restarts: u32) -> Spawned {
    let mut cmd = Command::new(spawned::launcher());
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
    .args(["--batch-size", "16", "--test-size", "64", "--print-digest"])
    .args(args)
    .arg("--out")
    .arg(out)
    .env_remove("RANK")
    .env_remove("SLURM_PROCID")
    .env("BURN_DDP_TIMEOUT", "10m") // bounds must come from failure detection
    .env("RUST_LOG", "burn_ddp=info"); // to see where training resumed (every burn-ddp crate)
    Spawned::start(&mut cmd, Duration::from_secs(900))
}

fn digests(stdout: &str) -> Vec<String> {
    (0..2)
        .map(|rank| {
            let prefix = format!("[rank {rank}] parameter digest: ");
            stdout
                .lines()
                .rev()
                .find_map(|l| l.strip_prefix(&prefix))
                .unwrap_or_else(|| panic!("no digest from rank {rank}:\n{stdout}"))
                .to_string()
        })
        .collect()
}

/// Through `burn-ddp run`: both ranks end with the same parameters; rank 0 prints the
/// progress of the whole job and the accuracy, and alone writes metrics and checkpoints.
#[test]
fn two_ranks_agree_and_only_rank_0_writes() {
    let out = scratch("classifier");
    let job = launched(
        // Neither split divides evenly over 2 ranks: the training shards are padded.
        &["--epochs", "1", "--train-size", "191", "--test-size", "63"],
        &out.join("rank-{rank}"),
        0,
    );
    let run = job.finish();
    let stdout = String::from_utf8_lossy(&run.stdout);
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(run.status.success(), "stdout:\n{stdout}\nstderr:\n{stderr}");
    let d = digests(&stdout);
    assert_eq!(d[0], d[1], "the ranks' parameters differ:\n{stdout}");
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
        "validation is sharded and merged: {stdout}"
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
    assert!(!out.join("rank-1").exists(), "rank 1 wrote files");
    std::fs::remove_dir_all(&out).unwrap();
}

/// Runs 3 short epochs (resuming from the checkpoints when restarted); kills rank `victim`
/// with SIGKILL once the checkpoint of epoch 1 is complete. Returns (success, stdout, stderr,
/// seconds from the kill to the launcher's exit).
fn killed_run(
    out: &Path,
    max_restarts: u32,
    victim: Option<u32>,
) -> (bool, String, String, Duration) {
    let job = launched(
        &["--epochs", "3", "--train-size", "768", "--resume"],
        out,
        max_restarts,
    );
    let mut killed_at = None;
    if let Some(victim) = victim {
        let deadline = Instant::now() + Duration::from_secs(300);
        let pid = loop {
            assert!(Instant::now() < deadline, "epoch 1 never finished");
            let ready = ["model", "optim", "scheduler"]
                .iter()
                .all(|p| out.join(format!("checkpoint/{p}-1.bin")).exists());
            let ranks: Vec<(u32, u32)> = children(job.id())
                .into_iter()
                .filter_map(|p| Some((p, rank_of(p)?)))
                .collect();
            match ranks.iter().find(|&&(_, r)| r == victim) {
                Some(&(pid, _)) if ready => break pid,
                _ => std::thread::sleep(Duration::from_millis(20)),
            }
        };
        Command::new("kill")
            .args(["-9", &pid.to_string()])
            .status()
            .unwrap();
        killed_at = Some(Instant::now());
    }
    let result = job.finish();
    (
        result.status.success(),
        String::from_utf8_lossy(&result.stdout).into_owned(),
        String::from_utf8_lossy(&result.stderr).into_owned(),
        killed_at.map(|t| t.elapsed()).unwrap_or_default(),
    )
}

/// A killed rank is named within 30 s; with `--max-restarts 1` the group restarts, resumes
/// from rank 0's newest complete checkpoint and ends with exactly the parameters of a run that
/// was never interrupted.
#[test]
fn a_killed_rank_is_named_and_one_restart_resumes_bit_for_bit() {
    let base = scratch("elastic");
    let (ok, stdout, stderr, _) = killed_run(&base.join("unbroken"), 0, None);
    assert!(ok, "stdout:\n{stdout}\nstderr:\n{stderr}");
    let unbroken = digests(&stdout);
    assert_eq!(unbroken[0], unbroken[1], "{stdout}");

    let (ok, stdout, stderr, took) = killed_run(&base.join("fail"), 0, Some(1));
    assert!(!ok, "rank 1 was killed, yet:\n{stdout}\n{stderr}");
    // Rank 0's summary, when it printed one before the launcher stopped it, counts the
    // epochs completed before the kill, not the one it stopped.
    spawned::assert_summary_counts_completed_epochs(&stdout);
    assert!(took < Duration::from_secs(30), "took {took:?}");
    assert!(
        stderr.contains("rank 1 (pid") && stderr.contains("SIGKILL"),
        "the failure does not name rank 1 and how it died:\n{stderr}"
    );

    let (ok, stdout, stderr, _) = killed_run(&base.join("restart"), 1, Some(0));
    assert!(ok, "stdout:\n{stdout}\nstderr:\n{stderr}");
    assert!(
        stderr.contains("restarting the whole group (restart 1 of 1)"),
        "{stderr}"
    );
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
        "killed rank 0, restarted: parameters differ from the unbroken run"
    );
    let _ = std::fs::remove_dir_all(&base);
}

/// A checkpoint rank 0 cannot write (a directory stands where its file must go, which stops
/// root too) fails the job with a non-zero exit that names rank 0, the file and the OS error,
/// instead of ending training early with success.
#[test]
fn a_checkpoint_that_cannot_be_written_fails_the_job_naming_it() {
    let out = scratch("unwritable");
    std::fs::create_dir_all(out.join("checkpoint/model-1.bin/x")).unwrap();
    // --resume keeps the directory (a fresh run would clear it first); there is nothing to
    // resume from.
    let job = launched(
        &["--epochs", "2", "--train-size", "192", "--resume"],
        &out,
        0,
    );
    let run = job.finish();
    let stdout = String::from_utf8_lossy(&run.stdout);
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(
        !run.status.success(),
        "stdout:\n{stdout}\nstderr:\n{stderr}"
    );
    assert!(
        stderr.contains("rank 0 failed")
            && stderr.contains("checkpoint/model-1.bin")
            && stderr.contains("os error"),
        "the failure does not name the file and rank 0:\n{stderr}"
    );
    assert!(!stdout.contains("final test accuracy"), "{stdout}");
    let _ = std::fs::remove_dir_all(&out);
}

/// Damaged checkpoint files and run files are refused on every rank naming the file, what is
/// wrong and the fix; never a panic (Burn's own decoder panics on bytes it cannot read).
#[test]
fn damaged_checkpoints_are_refused_naming_the_file_and_the_fix() {
    burn_ddp_dev::damage::damaged_checkpoints_are_refused(EXAMPLE);
}
