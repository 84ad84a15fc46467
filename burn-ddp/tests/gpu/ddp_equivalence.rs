//! The Burn 0.21 line's equivalence suite (`tests/integration/ddp_equivalence.rs`) as a binary
//! of its own, built with `cuda` for the GPU check (`scripts/gpu-bundle.sh`, archive `021`): on
//! `Autodiff<Ddp<Cuda>>` with NCCL. CPU builds run the same module inside `tests/integration`.

#[path = "../integration/common/mod.rs"]
mod common;
#[path = "../integration/ddp_equivalence.rs"]
mod ddp_equivalence;
