//! The "before" of the guide's training-loop migration: a training loop of its own, shaped like Burn's
//! custom-loop examples, in one process, on the Burn release the features choose: the program of
//! that release beside this file (`burn021.rs`, `gradsync.rs`).
//!
//! ```text
//! cargo run --release --example custom_loop_before                    # Burn 0.21
//! cargo run --release --example custom_loop_before --no-default-features --features burn-0-22
//! cargo run --release --example custom_loop_before --no-default-features --features burn-0-23
//! ```

include!("../../src/release.rs");

#[cfg(feature = "burn-0-21")]
#[path = "burn021.rs"]
mod program;
#[cfg(feature = "gradsync")]
#[path = "gradsync.rs"]
mod program;

use program::main;
