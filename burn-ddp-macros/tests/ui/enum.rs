#[burn_ddp_macros::ddp]
#[derive(Debug)]
enum Net {
    Small,
    Large,
}

fn main() {}
