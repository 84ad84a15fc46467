//! The Burn 0.22.1 line's NCCL path on a real GPU, at world size 1 with `GradTransport::Nccl`:
//! `GradSync` takes the device path, f32 gradients come back bit for bit, compressed ones within
//! the wire type's rounding, absent ones stay absent, and 20 steps through NCCL train like plain
//! Burn.
//!
//! Needs an NVIDIA GPU, its driver and NCCL, and Burn 0.22's CUDA runtime, which links LLVM (its
//! build script downloads the bundle unless `scripts/offline-llvm.sh` put it in place). Built
//! and linked in CI (`--features fusion`), run by `scripts/gpu-check.sh`; on a machine without a
//! GPU these tests fail, naming what is missing (`required-features = ["cuda"]`: plain `cargo
//! test` does not build it). The tests are burn-ddp-burn022's (`tests/shared/cuda.rs` there),
//! compiled against this line.

use burn_ddp_burn022 as line;

include!("shared/cuda.rs");
