//! The guide's training-loop migration for Burn 0.22 users (`docs/guide.md`, section 5): a loop
//! of its own shaped like Burn's `examples/custom-training-loop`
//! (`examples/custom_loop022_before.rs`) moves to `GradSync` in at most 15 changed lines
//! (`examples/custom_loop022_after.rs`, each marked `// ddp:`), and the result trains on 2
//! processes holding one model.

use burn_ddp_dev::diff::{self, changed, code};

#[test]
fn the_training_loop_migration_changes_at_most_15_lines_each_marked() {
    let before = code("examples/custom_loop022_before.rs");
    let after = code("examples/custom_loop022_after.rs");
    let (added, removed) = changed(&before, &after);
    println!("{added} lines added or modified, {removed} removed");
    assert!(added <= 15, "the migration takes {added} changed lines");
    let marked = after.iter().filter(|l| l.contains("// ddp:")).count();
    assert_eq!(
        marked, added,
        "every added or modified line is marked `// ddp:`"
    );
    assert!(before.iter().any(|l| l.contains("optim.step(")));
    assert!(!before.iter().any(|l| l.contains("burn_ddp")));
}

#[test]
fn the_migrated_loop_trains_on_two_ranks_holding_one_model() {
    diff::assert_custom_loop_on_two_ranks("custom_loop022_after");
}
