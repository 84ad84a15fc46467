//! Starting jobs.
//!
//! - `spawn.rs`: starting and supervising a node's ranks
//! - `elastic/`: elastic jobs (`burn-ddp run --nnodes MIN:MAX`): rendezvous in rounds
//! - `lighthouse.rs`: fault-tolerant jobs (`burn-ddp run --fault-tolerant`): the store that outlives
//!   the ranks, replacements that join live
//! - `bench.rs`: the bandwidth tool (`burn-ddp bench all-reduce`)
//! - `p2p_bench.rs`: point-to-point against all-reduce (`burn-ddp bench p2p`)
//! - `cli.rs`: the `burn-ddp` command line (feature `cli`)
//!
//! The environment contract (torchrun and Slurm variables) lives in [`crate::config::env`], the
//! one module that reads the environment; `launch::env` is the same module.

use crate::error::{ConfigError, JobError};
use crate::{DdpError, ProcessGroup, Result};

pub mod bench;
#[cfg(feature = "cli")]
#[cfg_attr(docsrs, doc(cfg(feature = "cli")))]
pub mod cli;
pub mod elastic;
pub mod lighthouse;
pub mod p2p_bench;
pub mod scale_bench;
pub mod spawn;

pub use crate::config::env;

/// Runs `f` on `nproc` ranks of this node, like PyTorch's `mp.spawn`: the program re-executes
/// itself once per rank with the torchrun environment (and the same arguments), each child
/// joins the job and calls `f` with its process group, and this process supervises them as
/// `burn-ddp run` does — output prefixed with `[rank N]`, every rank stopped as soon as one
/// fails, Ctrl-C forwarded.
///
/// When the program already runs as one rank of a job ([`env::launched`]: under `burn-ddp run`,
/// torchrun or `srun`, or as a child of `spawn`), nothing is spawned: it joins that job and calls `f`, whatever `nproc` says. So one program runs unchanged with
/// `cargo run`, under a launcher, or under Slurm.
///
/// ```no_run
/// fn main() -> std::process::ExitCode {
///     let result = burn_ddp_comm::launch::spawn(2, |group| {
///         println!("rank {} of {}", group.rank(), group.world_size());
///         Ok::<(), burn_ddp_comm::DdpError>(())
///     });
///     match result {
///         Ok(()) => std::process::ExitCode::SUCCESS,
///         Err(e) => {
///             eprintln!("{e}");
///             std::process::ExitCode::FAILURE
///         }
///     }
/// }
/// ```
///
/// # Errors
/// In a rank: joining the job failed, or `f` failed (`RankError`, with its error as the source). In the
/// supervisor: a rank could not be started, or failed (`RankFailed`, naming it and how it
/// ended), or the job was interrupted.
pub fn spawn<E: Into<Box<dyn std::error::Error + Send + Sync>>>(
    nproc: u32,
    f: impl FnOnce(ProcessGroup) -> std::result::Result<(), E>,
) -> Result<()> {
    if env::launched() {
        let group = ProcessGroup::from_env()?;
        let rank = group.rank();
        let result = f(group.clone());
        if result.is_err() {
            group.mark_failed();
        }
        return result.map_err(|e| {
            DdpError::Job(JobError::RankError {
                rank,
                source: e.into(),
            })
        });
    }
    if nproc == 0 {
        return Err(DdpError::Config(ConfigError::InvalidConfig {
            field: "spawn(nproc)",
            reason: "at least one process is needed",
        }));
    }
    let program = std::env::current_exe()?;
    let mut job =
        spawn::LocalJob::standalone(program, std::env::args_os().skip(1).collect(), nproc)?;
    job.stop = Some(spawn::stop_flag()?);
    spawn::run(&job)?.into_result().map(|_| ())
}
