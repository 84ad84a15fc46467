//! End to end on the Burn 0.22.1 line: the `classifier022` example (built by `cargo test` with
//! the other examples) trains with Burn 0.22's Learner and burn-ddp's Burn 0.22 `DdpStrategy`
//! on 2 real processes through `burn-ddp run`; a killed rank ends the job naming it; a
//! restarted group resumes bit for bit; a checkpoint rank 0 cannot write fails the job.

const EXAMPLE: &str = "classifier022";

include!("../shared/classifier.rs");
