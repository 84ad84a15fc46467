//! Burn 0.22's Learner with burn-ddp's `DdpStrategy`, in the in-process mode (one thread per
//! rank, real Burn training): a run that fails in the middle of its second epoch is summarised
//! by Burn as one epoch, on rank 0.

use burn_ddp_burn022 as line;

include!("../shared/learner.rs");
