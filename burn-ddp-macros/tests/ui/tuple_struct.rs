#[burn_ddp_macros::ddp]
#[derive(Debug)]
struct Net(u32, u32);

fn main() {}
