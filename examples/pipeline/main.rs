//! Hybrid parallelism on CPU: an MLP image classifier split into pipeline stages, with the
//! pipeline replicated data-parallel, on the Burn release the features choose (Burn 0.21 by
//! default; the program of each line beside this file: `burn021.rs`, `gradsync.rs`).
//!
//! ```text
//! cargo run --release --example pipeline                        # 4 ranks: 2 stages x 2 replicas
//! burn-ddp run --nproc-per-node 4 -- target/release/examples/pipeline   # same, via the launcher
//! cargo run --release --example pipeline -- --nproc 4 --stages 4 --schedule gpipe   # 4 stages
//! cargo run --release --example pipeline --no-default-features --features burn-0-22
//! ```
//!
//! Ranks `r * stages .. (r + 1) * stages` form replica `r`'s pipeline; each holds only its own
//! layers. Every step, the first stage cuts its batch into micro-batches and the 1F1B (or GPipe)
//! schedule moves activations downstream and their gradients upstream; each stage's replicas then
//! average that stage's gradients (on their sub-group) and step their optimizer. The data is
//! sharded over the replicas: both stages of a pipeline see the same batch. The last stage of
//! each replica reports loss and accuracy; replica 0's prints them.

include!("../../src/release.rs");

#[cfg(feature = "burn-0-21")]
#[path = "burn021.rs"]
mod program;
#[cfg(feature = "gradsync")]
#[path = "gradsync.rs"]
mod program;

use program::main;
