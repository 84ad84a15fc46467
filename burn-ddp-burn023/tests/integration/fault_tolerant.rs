//! Fault-tolerant training on the Burn 0.23 line (`burn-ddp run --fault-tolerant`): the
//! `classifier023` example through burn-train 0.23's Learner and this line's `DdpStrategy`, in
//! real processes under the real launcher, ranks SIGKILLed mid-epoch, a replacement joining
//! live: the scenarios the 0.21 line passes (`burn_ddp_dev::fault`), a custom loop on
//! `GradSync::loop_state` losing a rank and taking in a joiner, and the refusals of what a
//! change of membership cannot carry.
//!
//! The tests are burn-ddp-burn022's (`tests/shared/fault_tolerant.rs` there), compiled against this line.

use burn_ddp_burn023 as line;

const EXAMPLE: &str = "classifier023";

include!("../../../burn-ddp-burn022/tests/shared/fault_tolerant.rs");
