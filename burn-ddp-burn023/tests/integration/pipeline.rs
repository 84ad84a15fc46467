//! Burn 0.23: pipeline and hybrid parallelism train exactly like the unsplit model in one
//! process (real processes, real TCP, Burn 0.23's Flex backend): a 4-layer MLP in 2 and 4 stages,
//! GPipe and 1F1B, 10 SGD steps on batches of 10 rows in 4 uneven micro-batches, and 2 stages x 2
//! replicas with `GradSync` on each stage's replicas; every parameter within 1e-5 relative.
//!
//! The tests are burn-ddp-burn022's (`tests/shared/pipeline.rs` there), compiled against this line.

use burn_ddp_burn023 as line;

include!("../../../burn-ddp-burn022/tests/shared/pipeline.rs");
