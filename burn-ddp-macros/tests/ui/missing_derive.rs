#[burn_ddp_macros::ddp]
#[derive(Debug)]
struct Net {
    body: u32,
}

fn main() {}
