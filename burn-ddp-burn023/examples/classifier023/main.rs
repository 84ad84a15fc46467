//! Data-parallel training of an image classifier on CPU with burn-ddp's **Burn 0.23** line.
//!
//! ```text
//! cargo run --release -p burn-ddp-burn023 --example classifier023        # 2 ranks, generated shapes
//! cargo run --release -p burn-ddp-burn023 --example classifier023 -- --nproc 3 --epochs 2
//! cargo run --release -p burn-ddp-burn023 --example classifier023 -- --mnist path/to/mnist
//! burn-ddp run --nproc-per-node 2 -- target/release/examples/classifier023   # via the launcher
//! ```
//!
//! Burn's `SupervisedTraining` (the Learner) drives training through burn-ddp's Burn 0.23
//! `DdpStrategy`: each rank trains on its shard of every epoch (`DistributedSampler`); after
//! each backward the gradients are averaged across the ranks (`GradSync`); the dashboard on
//! rank 0 (progress lines when its output is not a terminal) shows loss and accuracy of the
//! whole job; rank 0 alone writes the logs, metrics and checkpoints into `--out`. `--resume`
//! continues from the newest complete checkpoint. The program is the Burn 0.22 line's
//! `classifier022` (burn-ddp-burn022's `examples/shared/`), compiled against Burn 0.23.

#[path = "../../../burn-ddp-burn022/examples/shared/classifier_model.rs"]
mod model;

use burn_ddp_burn023 as line;

include!("../../../burn-ddp-burn022/examples/shared/classifier.rs");
