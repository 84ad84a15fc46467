//! Burn 0.23's Learner with burn-ddp's `DdpStrategy`, in the in-process mode (one thread per
//! rank, real Burn training): a run that fails in the middle of its second epoch is summarised
//! by Burn as one epoch, on rank 0.
//!
//! The tests are burn-ddp-burn022's (`tests/shared/learner.rs` there), compiled against this line.

use burn_ddp_burn023 as line;

include!("../../../burn-ddp-burn022/tests/shared/learner.rs");
