//! Fault-tolerant training on the Burn 0.22.1 line (`burn-ddp run --fault-tolerant`): the
//! `classifier022` example through burn-train 0.22's Learner and this line's `DdpStrategy`, in
//! real processes under the real launcher, ranks SIGKILLed mid-epoch, a replacement joining
//! live: the scenarios the 0.21 line passes (`burn_ddp_dev::fault`), a custom loop on
//! `GradSync::loop_state` losing a rank and taking in a joiner, and the refusals of what a
//! change of membership cannot carry.

use burn_ddp_burn022 as line;

const EXAMPLE: &str = "classifier022";

include!("../shared/fault_tolerant.rs");
