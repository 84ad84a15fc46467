//! The `#[ddp]` attribute for burn-ddp.
