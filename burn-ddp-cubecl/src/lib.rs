//! Internal to [burn-ddp](https://docs.rs/burn-ddp): the crates of Burn's CUDA backend that Burn
//! does not re-export, for the release a feature chooses (`burn-0-22`: burn-cubecl 0.22.1,
//! burn-fusion 0.22.1, cubecl 0.11.3; `burn-0-23`: 0.23.0-pre.1 and cubecl 0.12.0-pre.1), under
//! release-free names. `burn-ddp-gradsync`'s NCCL path (its `cuda` feature) is the one user:
//! depend on `burn-ddp` instead. Without a release feature this crate is empty (`burn-ddp-gradsync`
//! turns one on, weakly, with its own release).

#![no_std]

#[cfg(all(feature = "burn-0-22", feature = "burn-0-23"))]
compile_error!(
    "burn-ddp-cubecl: features `burn-0-22` and `burn-0-23` are both on, but one build serves one \
     Burn release (`cargo tree -e features -i burn-ddp-cubecl` shows who turns on each)"
);

#[cfg(feature = "burn-0-22")]
pub use {
    burn_cubecl022 as burn_cubecl, burn_fusion022 as burn_fusion, cubecl022 as cubecl,
    cubecl_runtime022 as cubecl_runtime,
};

#[cfg(all(feature = "burn-0-23", not(feature = "burn-0-22")))]
pub use {
    burn_cubecl023 as burn_cubecl, burn_fusion023 as burn_fusion, cubecl023 as cubecl,
    cubecl_runtime023 as cubecl_runtime,
};
