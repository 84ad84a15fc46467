//! The `burn-ddp` command: `burn-ddp run` (launcher) and `burn-ddp bench all-reduce`.

fn main() -> std::process::ExitCode {
    burn_ddp_comm::launch::cli::main()
}
