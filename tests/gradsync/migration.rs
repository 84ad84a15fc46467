//! The guide's promise for Burn 0.22 and 0.23 users (`docs/guide.md`, sections 5 and 5b): a
//! program of the release this binary is built for that trains with the Learner and then runs
//! Burn's evaluator (`examples/learner_before/burn022.rs`, `burn023.rs`) moves to burn-ddp
//! in at most 15 changed lines (`examples/learner_after/burn022.rs`, `burn023.rs`, each marked
//! `// ddp:`), and the result trains on 2 processes with the evaluation on rank 0 alone.

/// The pair's programs of this release, in `examples/learner_before/` and `examples/learner_after/`.
#[cfg(feature = "burn-0-22")]
const PROGRAM: &str = "burn022.rs";
#[cfg(feature = "burn-0-23")]
const PROGRAM: &str = "burn023.rs";
#[cfg(feature = "burn-0-22")]
const ARTIFACTS: &str = "target/learner022-example";
#[cfg(feature = "burn-0-23")]
const ARTIFACTS: &str = "target/learner023-example";
const EVALUATED: &str = "[test]  items 512/512";

use burn_ddp_dev::diff::{self, changed, code};

#[test]
fn the_guides_migration_changes_at_most_15_lines_each_marked() {
    let before = code(&format!("examples/learner_before/{PROGRAM}"));
    let after = code(&format!("examples/learner_after/{PROGRAM}"));
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
/// writes into the training directory: the 2 ranks write exactly the files one process writes
/// (Burn's metric logs, its checkpoints, its application log, the evaluator's logs, the
/// progress logger's file), and the progress logger's file once.
#[test]
fn the_migrated_program_trains_on_two_ranks_and_writes_what_one_process_writes() {
    let runs = diff::MigrationRuns::start("learner_before", "learner_after");
    let stdout = &runs.stdout;
    let done: Vec<&str> = stdout.lines().filter(|l| l.contains("done: ")).collect();
    assert_eq!(done, [format!("[rank 0] done: {ARTIFACTS}")], "{stdout}");
    // Burn's evaluator's lines (no terminal here) name the split and no epoch.
    assert!(stdout.contains(EVALUATED), "{stdout}");
    assert!(!stdout.contains("[test] epoch"), "{stdout}");
    // Burn's summaries, the training's included, show the model as one process's do.
    diff::assert_summaries_name_the_model(stdout);
    let files = runs.assert_same_files();
    println!("{files:#?}");
    for f in [
        "experiment.log",
        "training_progress.log",
        "checkpoint/model-3.bpk",
    ] {
        let f = format!("{ARTIFACTS}/{f}");
        assert!(files.contains(&f), "no {f}");
    }
    // One process's events, once: rank 1's progress logger wrote nothing.
    let events = |log: &str, event: &str| log.lines().filter(|l| l.contains(event)).count();
    let [one, two] = runs.read(&format!("{ARTIFACTS}/training_progress.log"));
    for event in [
        "[Training] start ",
        "split_start ",
        "split_end",
        "[Training] end",
    ] {
        assert_eq!(events(&two, event), events(&one, event), "{event}:\n{two}");
    }
    assert_eq!(events(&two, "[Training] start "), 1, "{two}");
}
