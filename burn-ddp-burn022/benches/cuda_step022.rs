//! The Burn 0.22.1 line's step time on the GPU (run by `scripts/gpu-check.sh`; `--features cuda`
//! or `fusion`): in one process, interleaved round by round, an MLP trained by
//!
//! - plain Burn 0.22.1 on the GPU (the baseline: backward, SGD step),
//! - the same with `GradSync::sync` between backward and the step, world size 1, the default
//!   transport (nothing to synchronise: the line's own cost),
//! - the same with `GradTransport::Nccl` (the device path runs in full: packing on the GPU, the
//!   launcher thread, NCCL's all-reduce on cubecl's pointers, the presence flags read back).
//!
//! Every step ends with the device synchronised, so each side is timed to completion. The
//! benchmark is burn-ddp-burn022's (`benches/shared/cuda_step.rs` there), compiled against this
//! line.
//!
//! ```text
//! cargo bench -p burn-ddp-burn022 --features cuda --bench cuda_step022 -- --rounds 5
//! ```

use burn_ddp_burn022 as line;

/// The Burn release this line is for, in the report's title.
const RELEASE: &str = "0.22.1";

include!("shared/cuda_step.rs");
