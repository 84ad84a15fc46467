//! The guide's promise (`docs/guide.md`): a generic Burn program that trains with the Learner
//! and then runs Burn's evaluator (`examples/learner_before.rs`, shaped like Burn's own
//! examples) moves to burn-ddp in at most 15 changed lines (`examples/learner_after.rs`), and
//! the result trains on 2 processes with the evaluation on rank 0 alone.

mod common;

use std::process::Command;
use std::time::Duration;

use common::diff::{changed, code};
use common::spawned::{example, launcher, Spawned};

#[test]
fn the_guides_migration_changes_at_most_15_lines() {
    let before = code("examples/learner_before.rs");
    let after = code("examples/learner_after.rs");
    let (added, removed) = changed(&before, &after);
    // Plus one line that both files already hold: the backend in `main`, `Autodiff<NdArray>`
    // in Burn's examples, `Autodiff<Ddp<NdArray>>` here (step 1 of the guide).
    let lines = added + 1;
    println!("{added} lines added or modified, {removed} removed, plus the backend line");
    assert!(lines <= 15, "the migration takes {lines} changed lines");
    assert!(
        before
            .iter()
            .any(|l| l.contains("fn run<B: AutodiffBackend>")),
        "the before program is generic over the backend, as Burn's examples are"
    );
    assert!(before.iter().any(|l| l.contains("EvaluatorBuilder::new")));
}

#[test]
fn changed_counts_modifications_once_per_side() {
    let v = |s: &[&str]| s.iter().map(|l| l.to_string()).collect::<Vec<_>>();
    assert_eq!(
        changed(&v(&["a", "b", "c"]), &v(&["a", "x", "c", "d"])),
        (2, 1)
    );
    assert_eq!(changed(&v(&["a"]), &v(&["a"])), (0, 0));
}

/// The after program trains on 2 processes through the launcher; only rank 0 evaluates and
/// writes into the training directory.
#[test]
fn the_migrated_program_trains_on_two_ranks_and_evaluates_on_rank_0() {
    let dir = std::env::temp_dir().join(format!("burn-ddp-migration-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut cmd = Command::new(launcher());
    cmd.args(["run", "--standalone", "--nproc-per-node", "2", "--"])
        .arg(example("learner_after"))
        .current_dir(&dir)
        .env_remove("RANK")
        .env_remove("SLURM_PROCID");
    let run = Spawned::start(&mut cmd, Duration::from_secs(600)).finish();
    let stdout = String::from_utf8_lossy(&run.stdout);
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(run.status.success(), "stdout:\n{stdout}\nstderr:\n{stderr}");
    let done: Vec<&str> = stdout.lines().filter(|l| l.contains("done: ")).collect();
    assert_eq!(done, ["[rank 0] done: target/learner-example"], "{stdout}");
    // Burn's evaluator's lines (no terminal here) name the split and no epoch.
    assert!(stdout.contains("[test]  items 512/512"), "{stdout}");
    assert!(!stdout.contains("[test] epoch"), "{stdout}");
    let artifacts = dir.join("target/learner-example");
    for sub in ["train", "valid", "test"] {
        assert!(artifacts.join(sub).is_dir(), "no {sub}/ in {artifacts:?}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
