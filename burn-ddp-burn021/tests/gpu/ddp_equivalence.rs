//! The Burn 0.21 line's equivalence suite (`tests/integration/ddp_equivalence.rs`) as a binary
//! of its own, built with `cuda` for the GPU check (`scripts/gpu-bundle.sh`, archive `021`): on
//! `Autodiff<Ddp<Cuda>>` with NCCL. CPU builds run the same module inside `tests/integration`.

// This package is `burn-ddp-burn021`; users reach it as `burn_ddp` (the `burn-ddp` crate with
// feature `burn-0-21`), and so does this program.
extern crate burn_ddp_burn021 as burn_ddp;

#[path = "../integration/common/mod.rs"]
mod common;
#[path = "../integration/ddp_equivalence.rs"]
mod ddp_equivalence;
