// The Burn release the build's features choose, under the names a program of yours has through
// `burn-ddp`: that release's Burn as `burn`, its burn-ddp line as `burn_ddp`. Included at the root
// of each example and test of this package (an `extern crate` at a crate root puts the name in
// every module's scope); a program without burn-ddp (a migration pair's "before") uses only
// `burn`. On Burn 0.21 `burn` is this package's dependency by that name.
#[cfg(feature = "burn-0-22")]
#[allow(unused_extern_crates)]
extern crate burn022 as burn;
#[cfg(feature = "burn-0-23")]
#[allow(unused_extern_crates)]
extern crate burn023 as burn;
#[cfg(feature = "burn-0-21")]
#[allow(unused_extern_crates)]
extern crate burn_ddp_burn021 as burn_ddp;
#[cfg(feature = "gradsync")]
#[allow(unused_extern_crates)]
extern crate burn_ddp_gradsync as burn_ddp;
