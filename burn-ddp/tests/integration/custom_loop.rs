//! The guide's training-loop migration (`docs/guide.md`, section 2): a loop of its own shaped
//! like Burn 0.21's `examples/custom-training-loop` (the repository's top-level
//! `examples/custom_loop_before.rs`, the root package's) moves to burn-ddp in at most 15 changed
//! lines (`examples/custom_loop_after.rs`), and the result trains on 2 processes holding one
//! model.

use crate::common;

use common::diff::{self, changed, code};

#[test]
fn the_training_loop_migration_changes_at_most_15_lines() {
    let before = code("../examples/custom_loop_before.rs");
    let after = code("../examples/custom_loop_after.rs");
    let (added, removed) = changed(&before, &after);
    // Plus one line that both files already hold: the backend in `main`, `Autodiff<NdArray>`
    // in Burn's examples, `Autodiff<Ddp<NdArray>>` here (step 1 of the guide).
    let lines = added + 1;
    println!("{added} lines added or modified, {removed} removed, plus the backend line");
    assert!(lines <= 15, "the migration takes {lines} changed lines");
    assert!(before
        .iter()
        .any(|l| l.contains("pub fn run<B: AutodiffBackend>")));
    assert!(before.iter().any(|l| l.contains("optim.step(")));
}

#[test]
fn the_migrated_loop_trains_on_two_ranks_holding_one_model() {
    diff::assert_custom_loop_on_two_ranks("custom_loop_after");
}
