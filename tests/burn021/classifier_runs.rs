//! The `classifier` example (2 real processes through its own `burn_ddp::spawn`) as a user can
//! misuse it: a checkpoint that cannot be written, a resume from checkpoints that are not the
//! run's own or that leave nothing to do, edge-case sizes and options. Every one either
//! finishes correctly or fails non-zero saying why; none ends quietly with exit 0.

use crate::common;

use std::path::{Path, PathBuf};
use std::process::Output;

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("burn-ddp-runs-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// The example on 2 ranks, small and fast, writing into `out` (`spawned::small_run`).
fn run(out: &Path, args: &[&str]) -> (Output, String, String) {
    common::spawned::small_run("classifier", out, args)
}

fn finished(out: &(Output, String, String)) -> bool {
    out.0.status.success() && out.1.contains("final test accuracy")
}

fn failed(out: &(Output, String, String)) -> bool {
    !out.0.status.success() && !out.1.contains("final test accuracy")
}

/// A checkpoint rank 0 cannot write, in the middle of the run (epoch 2 of 3: found at the
/// next step) and at its end (epoch 1 of 1: found when the last write is waited for), fails
/// the job non-zero naming rank 0, the file and the OS error; it is never an early stop.
#[test]
fn a_checkpoint_that_cannot_be_written_fails_the_job_naming_the_file() {
    for (epoch, epochs) in [(2, "3"), (1, "1")] {
        let out = scratch(&format!("unwritable-{epoch}"));
        // A directory where the file must go: renaming the written file into place fails,
        // whoever runs the test (root ignores file permissions).
        std::fs::create_dir_all(out.join(format!("checkpoint/model-{epoch}.bin/x"))).unwrap();
        // --resume keeps the directory (a fresh run clears it first); there is nothing to
        // resume from, so training starts at epoch 1.
        let run = run(&out, &["--epochs", epochs, "--resume"]);
        let (_, stdout, stderr) = &run;
        assert!(failed(&run), "stdout:\n{stdout}\nstderr:\n{stderr}");
        assert!(
            stderr.contains("rank 0 failed")
                && stderr.contains(&format!("checkpoint/model-{epoch}.bin"))
                && stderr.contains("os error"),
            "the failure does not name rank 0, the file and the OS error:\n{stderr}"
        );
        // Said once per rank, not once per layer that saw it.
        let file = format!("model-{epoch}.bin");
        let lines = stderr.lines().filter(|l| l.contains(&file)).count();
        assert!(lines <= 2, "the failure is repeated:\n{stderr}");
        let _ = std::fs::remove_dir_all(&out);
    }
}

/// A resume uses only its own run's checkpoints: other settings or checkpoints without a
/// record of their run are refused naming the difference; a finished run says there is
/// nothing left to do; an extended run says what it resumes, and the metric logs of every
/// epoch stay in that epoch's files (a killed run's partial epoch is rewritten, the earlier
/// epochs are left alone).
#[test]
fn a_resume_uses_only_its_own_runs_checkpoints_and_keeps_the_logs_right() {
    let out = scratch("resume");
    let first = run(&out, &[]);
    assert!(finished(&first), "{}\n{}", first.1, first.2);
    let epoch_log = |e: usize| out.join(format!("train/epoch-{e}/Loss.log"));
    let epoch_1 = std::fs::read(epoch_log(1)).unwrap();

    let other = run(&out, &["--resume", "--epochs", "3", "--lr", "0.01"]);
    assert!(failed(&other), "{}\n{}", other.1, other.2);
    assert!(
        other.2.contains("learning rate = 0.002 there, 0.01 here"),
        "the refusal does not name the difference:\n{}",
        other.2
    );

    let done = run(&out, &["--resume"]);
    assert!(finished(&done), "{}\n{}", done.1, done.2);
    assert!(
        done.2
            .contains("nothing left to do: the checkpoint of epoch 2"),
        "{}",
        done.2
    );

    // As if killed during epoch 2: its checkpoint is missing and its logs are partial.
    for part in ["model", "optim", "scheduler"] {
        std::fs::remove_file(out.join(format!("checkpoint/{part}-2.bin"))).unwrap();
    }
    std::fs::write(epoch_log(2), "stale").unwrap();
    let resumed = run(&out, &["--resume", "--epochs", "3"]);
    assert!(finished(&resumed), "{}\n{}", resumed.1, resumed.2);
    assert!(
        resumed.2.contains("resuming after epoch 1 of 3 from") && resumed.2.contains("checkpoint"),
        "{}",
        resumed.2
    );
    assert_eq!(
        std::fs::read(epoch_log(1)).unwrap(),
        epoch_1,
        "epoch 1's log changed"
    );
    assert_ne!(std::fs::read(epoch_log(2)).unwrap(), b"stale");
    assert!(epoch_log(3).is_file());
    assert!(!out.join("train/epoch-4").exists());

    // Checkpoints with no record of their run (another program's, an older burn-ddp's).
    std::fs::remove_file(out.join("checkpoint/run.txt")).unwrap();
    let foreign = run(&out, &["--resume", "--epochs", "4"]);
    assert!(failed(&foreign), "{}\n{}", foreign.1, foreign.2);
    assert!(foreign.2.contains("no record of the run"), "{}", foreign.2);
    let _ = std::fs::remove_dir_all(&out);
}

/// Damaged checkpoint files and run files are refused on every rank naming the file, what is
/// wrong and the fix; never a panic (Burn's own decoder panics on bytes it cannot read).
#[test]
fn damaged_checkpoints_are_refused_naming_the_file_and_the_fix() {
    burn_ddp_dev::damage::damaged_checkpoints_are_refused("classifier");
}

/// Sizes that leave a rank a last batch of one image, or no test image at all, train and
/// report; sizes and options that leave nothing to train on are refused before training.
#[test]
fn edge_case_sizes_finish_and_empty_ones_are_refused() {
    let out = scratch("sizes");
    for test_size in ["1", "3", "514"] {
        let r = run(&out, &["--epochs", "1", "--test-size", test_size]);
        assert!(finished(&r), "--test-size {test_size}:\n{}\n{}", r.1, r.2);
    }
    // One rank: said in the singular.
    let r = run(&out, &["--epochs", "1", "--nproc", "1"]);
    assert!(finished(&r), "--nproc 1:\n{}\n{}", r.1, r.2);
    assert!(r.1.contains("; 1 rank × batch 16"), "{}", r.1);
    for (option, value, says) in [
        ("--epochs", "0", "must be at least 1"),
        ("--batch-size", "0", "must be at least 1"),
        ("--test-size", "0", "must be at least 1"),
        ("--lr", "nan", "finite number above 0"),
        ("--train-size", "1", "every rank needs at least one"),
    ] {
        let r = run(&out, &[option, value]);
        assert!(failed(&r), "{option} {value}:\n{}\n{}", r.1, r.2);
        assert!(r.2.contains(says), "{option} {value}:\n{}", r.2);
    }
    let _ = std::fs::remove_dir_all(&out);
}
