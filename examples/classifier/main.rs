//! Data-parallel training of an image classifier on CPU with burn-ddp, on the Burn release the
//! features choose (Burn 0.21 by default):
//!
//! ```text
//! cargo run --release --example classifier                  # Burn 0.21, 2 ranks, generated shapes
//! cargo run --release --example classifier --no-default-features --features burn-0-22
//! cargo run --release --example classifier --no-default-features --features burn-0-23
//! cargo run --release --example classifier -- --nproc 3 --epochs 2
//! cargo run --release --example classifier -- --mnist path/to/mnist   # the four IDX files
//! burn-ddp run --nproc-per-node 2 -- target/release/examples/classifier   # same, via the launcher
//! burn-ddp run --fault-tolerant --nproc-per-node 3 --max-restarts 1 -- target/release/examples/classifier
//! ```
//!
//! One program per line, on the same generated images and with the same options: Burn 0.21's
//! (`burn021/`: `Autodiff<Ddp<Flex>>`, gradients averaged during backward), and Burn 0.22's and
//! 0.23's (`gradsync/`: `GradSync`, gradients averaged after each backward).

include!("../../src/release.rs");

#[cfg(feature = "burn-0-21")]
#[path = "burn021/main.rs"]
mod program;
#[cfg(feature = "gradsync")]
#[path = "gradsync/main.rs"]
mod program;

use program::main;
