//! The burn-ddp workspace package: it hosts the step benchmarks (`benches/ddp_step`), which
//! compare burn-ddp with plain Burn and, with feature `lines`, the two Burn lines in one run.
//! The libraries are the `burn-ddp-comm`, `burn-ddp` and `burn-ddp-burn022` crates, each
//! line's tests, examples and other benchmarks in its own directory.
