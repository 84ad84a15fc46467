//! The "before" of the guide's Learner migration: a Burn program shaped like Burn's own examples, trained
//! with Burn's Learner and dashboard, then evaluated by Burn's evaluator, in one process, on the Burn release the features choose: the program of
//! that release beside this file (`burn021.rs`, `burn022.rs`, `burn023.rs`).
//!
//! ```text
//! cargo run --release --example learner_before                    # Burn 0.21
//! cargo run --release --example learner_before --no-default-features --features burn-0-22
//! cargo run --release --example learner_before --no-default-features --features burn-0-23
//! ```

include!("../../src/release.rs");

#[cfg(feature = "burn-0-21")]
#[path = "burn021.rs"]
mod program;
#[cfg(feature = "burn-0-22")]
#[path = "burn022.rs"]
mod program;
#[cfg(feature = "burn-0-23")]
#[path = "burn023.rs"]
mod program;

use program::main;
