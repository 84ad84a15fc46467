//! The Burn glue this crate shares with burn-ddp-burn022 (`src/lib.rs`) names a feature of that
//! crate that this one does not have: `ndarray` (Burn 0.23 has no NdArray backend). It is off
//! here; declaring it keeps rustc's check of `cfg` names quiet about code that is compiled out.

fn main() {
    println!("cargo::rustc-check-cfg=cfg(feature, values(\"ndarray\"))");
}
