//! The "after" of the guide's training-loop migration: `custom_loop_before` on several processes,
//! changed as the guide says (each changed line marked `// ddp:`; `tests/burn021/custom_loop.rs` and
//! `tests/gradsync/custom_loop.rs` count them), on the Burn release the features choose: the program of
//! that release beside this file (`burn021.rs`, `gradsync.rs`).
//!
//! ```text
//! cargo run --release --example custom_loop_after                    # Burn 0.21
//! cargo run --release --example custom_loop_after --no-default-features --features burn-0-22
//! cargo run --release --example custom_loop_after --no-default-features --features burn-0-23
//! ```

include!("../../src/release.rs");

#[cfg(feature = "burn-0-21")]
#[path = "burn021.rs"]
mod program;
#[cfg(feature = "gradsync")]
#[path = "gradsync.rs"]
mod program;

use program::main;
