//! The guide's promise for Burn 0.22 users (`docs/guide.md`, section 5): a Burn 0.22.1 program
//! that trains with the Learner and then runs Burn's evaluator
//! (`examples/learner022_before.rs`) moves to burn-ddp in at most 15 changed lines
//! (`examples/learner022_after.rs`, each marked `// ddp:`), and the result trains on 2
//! processes with the evaluation on rank 0 alone.

const BEFORE: &str = "learner022_before";
const AFTER: &str = "learner022_after";
const ARTIFACTS: &str = "target/learner022-example";
const EVALUATED: &str = "[test]  items 512/512";

include!("../shared/migration.rs");
