//! Starting jobs.
//!
//! - `env.rs`: the environment contract (torchrun and Slurm variables) -> `GroupConfig`
//! - `spawn.rs`: starting and supervising a node's ranks
//! - `bench.rs`: the bandwidth tool
//! - `cli.rs`: the `burn-ddp` command line

pub mod bench;
pub mod cli;
pub mod env;
pub mod spawn;
