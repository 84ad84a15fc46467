//! Burn 0.23 on W processes, each with a batch of `b` and its gradients reduced by `GradSync`
//! after backward, must train exactly like one process on the whole batch of `W·b`: the
//! conformance suite every line runs (`burn_ddp_dev::conformance`), then the line's own cases,
//! which are burn-ddp-burn022's (`tests/shared/equivalence.rs` there) compiled against this
//! line, as its sources are. Real processes, real TCP and shared memory, real Burn training
//! (Burn 0.23's Flex CPU backend).

use burn_ddp_burn023 as line;

include!("../../../burn-ddp-burn022/tests/shared/equivalence.rs");
