//! The guide's promise for Burn 0.22 users (`docs/guide.md`, section 5): a Burn 0.22.1 program
//! that trains with the Learner and then runs Burn's evaluator
//! (`examples/learner022_before.rs`) moves to burn-ddp in at most 15 changed lines
//! (`examples/learner022_after.rs`, each marked `// ddp:`), and the result trains on 2
//! processes with the evaluation on rank 0 alone.

#[allow(dead_code)]
use burn_ddp_dev::diff;
#[allow(dead_code)]
use burn_ddp_dev::spawned;

use std::process::Command;
use std::time::Duration;

use diff::{changed, code};

#[test]
fn the_guides_migration_changes_at_most_15_lines_each_marked() {
    let before = code("examples/learner022_before.rs");
    let after = code("examples/learner022_after.rs");
    let (added, removed) = changed(&before, &after);
    println!("{added} lines added or modified, {removed} removed");
    assert!(added <= 15, "the migration takes {added} changed lines");
    let marked = after.iter().filter(|l| l.contains("// ddp:")).count();
    assert_eq!(
        marked, added,
        "every added or modified line is marked `// ddp:`"
    );
    assert!(before.iter().any(|l| l.contains("EvaluatorBuilder::new")));
    assert!(!before.iter().any(|l| l.contains("burn_ddp")));
}

/// The after program trains on 2 processes through the launcher; only rank 0 evaluates and
/// writes into the training directory.
#[test]
fn the_migrated_program_trains_on_two_ranks_and_evaluates_on_rank_0() {
    let dir = std::env::temp_dir().join(format!("burn-ddp-migration022-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut cmd = Command::new(spawned::launcher());
    cmd.args(["run", "--standalone", "--nproc-per-node", "2", "--"])
        .arg(spawned::example("learner022_after"))
        .current_dir(&dir)
        .env_remove("RANK")
        .env_remove("SLURM_PROCID");
    let run = spawned::Spawned::start(&mut cmd, Duration::from_secs(600)).finish();
    let stdout = String::from_utf8_lossy(&run.stdout);
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(run.status.success(), "stdout:\n{stdout}\nstderr:\n{stderr}");
    let done: Vec<&str> = stdout.lines().filter(|l| l.contains("done: ")).collect();
    assert_eq!(
        done,
        ["[rank 0] done: target/learner022-example"],
        "{stdout}"
    );
    // Burn's evaluator's lines (no terminal here) name the split and no epoch.
    assert!(stdout.contains("[test]  items 512/512"), "{stdout}");
    assert!(!stdout.contains("[test] epoch"), "{stdout}");
    let artifacts = dir.join("target/learner022-example");
    for sub in ["train", "valid", "test"] {
        assert!(artifacts.join(sub).is_dir(), "no {sub}/ in {artifacts:?}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
