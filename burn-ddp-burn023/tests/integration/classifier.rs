//! End to end on the Burn 0.23 line: the `classifier023` example (built by `cargo test` with
//! the other examples) trains with Burn 0.23's Learner and burn-ddp's Burn 0.23 `DdpStrategy`
//! on 2 real processes through `burn-ddp run`; a killed rank ends the job naming it; a
//! restarted group resumes bit for bit; a checkpoint rank 0 cannot write fails the job.
//!
//! The tests are burn-ddp-burn022's (`tests/shared/classifier.rs` there), compiled against this line.

const EXAMPLE: &str = "classifier023";

include!("../../../burn-ddp-burn022/tests/shared/classifier.rs");
