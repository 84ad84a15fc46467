//! The "after" of the guide's Learner migration: `learner_before` on several processes, changed as the
//! guide says (each changed line marked `// ddp:`; `tests/burn021/migration.rs` and
//! `tests/gradsync/migration.rs` count them), on the Burn release the features choose: the program of
//! that release beside this file (`burn021.rs`, `burn022.rs`, `burn023.rs`).
//!
//! ```text
//! cargo run --release --example learner_after                    # Burn 0.21
//! cargo run --release --example learner_after --no-default-features --features burn-0-22
//! cargo run --release --example learner_after --no-default-features --features burn-0-23
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
