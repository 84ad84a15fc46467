//! Data-parallel training of an image classifier on CPU with burn-ddp's **Burn 0.23** line.
//!
//! ```text
//! cargo run --release -p burn-ddp-gradsync --no-default-features --features burn-0-23,train --example classifier023   # 2 ranks, generated shapes
//! cargo run --release -p burn-ddp-gradsync --no-default-features --features burn-0-23,train --example classifier023 -- --nproc 3 --epochs 2
//! cargo run --release -p burn-ddp-gradsync --no-default-features --features burn-0-23,train --example classifier023 -- --mnist path/to/mnist
//! burn-ddp run --nproc-per-node 2 -- target/release/examples/classifier023   # via the launcher
//! ```
//!
//! Burn's `SupervisedTraining` (the Learner) drives training through burn-ddp's Burn 0.23
//! `DdpStrategy`: each rank trains on its shard of every epoch (`DistributedSampler`); after
//! each backward the gradients are averaged across the ranks (`GradSync`); the dashboard on
//! rank 0 (progress lines when its output is not a terminal) shows loss and accuracy of the
//! whole job; rank 0 alone writes the logs, metrics and checkpoints into `--out`. `--resume`
//! continues from the newest complete checkpoint. The program is the Burn 0.22 line's
//! `classifier022` (`examples/shared/`), compiled against Burn 0.23.

// This package is built for one Burn release: `burn` is Burn 0.23. A project of yours depends on
// its own `burn` and has no need of this line.
extern crate burn023 as burn;

#[path = "../shared/classifier_model.rs"]
mod model;

use burn_ddp as line;

include!("../shared/classifier.rs");
