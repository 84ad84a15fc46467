//! Burn 0.22 on W processes, each with a batch of `b` and its gradients reduced by `GradSync`
//! after backward, must train exactly like one process on the whole batch of `W·b`: the
//! conformance suite every line runs (`burn_ddp_dev::conformance`: after 20 optimizer steps
//! every parameter matches within 1e-5 relative (f32), every rank's model is bit-identical to
//! the others', and a model trained without synchronisation is beyond the tolerance), then this
//! line's own cases. Real processes, real TCP, real Burn training (Burn 0.22's Flex CPU
//! backend).
//!
//! The reference runs in every rank's process, from the weights that `prepare` broadcast.

use burn_ddp_burn022 as line;

include!("../shared/equivalence.rs");
