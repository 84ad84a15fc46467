//! The burn-ddp workspace package: it hosts the top-level `examples/`, `tests/` and `benches/`.
//! The library itself is the `burn-ddp` crate.
