//! The guide's promise (`docs/guide.md`): a generic Burn program that trains with the Learner
//! and then runs Burn's evaluator (the repository's top-level `examples/learner_before/burn021.rs`, the
//! root package's, shaped like Burn's own examples) moves to burn-ddp in at most 15 changed
//! lines (`examples/learner_after/burn021.rs`), and the result trains on 2 processes with the evaluation
//! on rank 0 alone.

use crate::common;

use common::diff::{self, changed, code};

#[test]
fn the_guides_migration_changes_at_most_15_lines() {
    let before = code("examples/learner_before/burn021.rs");
    let after = code("examples/learner_after/burn021.rs");
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
/// writes into the training directory: the 2 ranks write exactly the files one process writes
/// (Burn's metric logs, its checkpoints, its application log, the evaluator's logs).
#[test]
fn the_migrated_program_trains_on_two_ranks_and_writes_what_one_process_writes() {
    let runs = diff::MigrationRuns::start("learner_before", "learner_after");
    let stdout = &runs.stdout;
    let done: Vec<&str> = stdout.lines().filter(|l| l.contains("done: ")).collect();
    assert_eq!(done, ["[rank 0] done: target/learner-example"], "{stdout}");
    // Burn's evaluator's lines (no terminal here) name the split and no epoch.
    assert!(stdout.contains("[test]  items 512/512"), "{stdout}");
    assert!(!stdout.contains("[test] epoch"), "{stdout}");
    // Burn's summaries, the training's included, show the model as one process's do.
    diff::assert_summaries_name_the_model(stdout);
    let files = runs.assert_same_files();
    println!("{files:#?}");
    for f in [
        "experiment.log",
        "checkpoint/model-3.mpk",
        "test/test/epoch-1/Loss.log",
    ] {
        let f = format!("target/learner-example/{f}");
        assert!(files.contains(&f), "no {f}");
    }
}
