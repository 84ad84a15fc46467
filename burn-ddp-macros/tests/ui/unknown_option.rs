// Stands in for burn::module::Module (this crate does not depend on Burn); #[ddp] only looks at the name.
use std::hash::Hash as Module;

#[burn_ddp_macros::ddp]
#[derive(Debug, Module)]
struct Net {
    body: u32,
    #[ddp(frozen)]
    head: u32,
}

fn main() {}
