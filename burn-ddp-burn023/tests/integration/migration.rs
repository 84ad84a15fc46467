//! The guide's promise for Burn 0.23 users (`docs/guide.md`, section 5): a Burn 0.23 program
//! that trains with the Learner and then runs Burn's evaluator (`examples/learner023_before.rs`,
//! a regression shaped like Burn's `examples/simple-regression`) moves to burn-ddp in at most 15
//! changed lines (`examples/learner023_after.rs`, each marked `// ddp:`), and the result trains
//! on 2 processes with the evaluation on rank 0 alone. The tests are burn-ddp-burn022's
//! (`tests/shared/migration.rs` there).

const BEFORE: &str = "learner023_before";
const AFTER: &str = "learner023_after";
const ARTIFACTS: &str = "target/learner023-example";
const EVALUATED: &str = "[test]  items 512/512";

include!("../../../burn-ddp-burn022/tests/shared/migration.rs");
