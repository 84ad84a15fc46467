//! Data-parallel training of an image classifier on CPU with burn-ddp's **Burn 0.22.1** line.
//!
//! ```text
//! cargo run --release -p burn-ddp-gradsync --example classifier022   # 2 ranks, generated shapes
//! cargo run --release -p burn-ddp-gradsync --example classifier022 -- --nproc 3 --epochs 2
//! cargo run --release -p burn-ddp-gradsync --example classifier022 -- --mnist path/to/mnist
//! burn-ddp run --nproc-per-node 2 -- target/release/examples/classifier022   # via the launcher
//! ```
//!
//! Burn's `SupervisedTraining` (the Learner) drives training through burn-ddp's Burn 0.22
//! `DdpStrategy`: each rank trains on its shard of every epoch (`DistributedSampler`); after
//! each backward the gradients are averaged across the ranks (`GradSync`); the dashboard on
//! rank 0 (progress lines when its output is not a terminal) shows loss and accuracy of the
//! whole job; rank 0 alone writes the logs, metrics and checkpoints into `--out`. `--resume`
//! continues from the newest complete checkpoint. The same program as the Burn 0.21 example
//! (`examples/classifier/`), on the same images.

// This package is built for one Burn release: `burn` is Burn 0.22. A project of yours depends on
// its own `burn` and has no need of this line.
extern crate burn022 as burn;

#[path = "../shared/classifier_model.rs"]
mod model;

use burn_ddp as line;

include!("../shared/classifier.rs");
