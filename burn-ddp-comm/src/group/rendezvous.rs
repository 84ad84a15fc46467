//! Joining a job: rank 0 serves the store, every rank connects to it, waits until all ranks have
//! joined, then opens the transport.

use crate::error::RendezvousError;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{AbortRecord, Rank, RankList};
use crate::config::{GroupConfig, Launcher};
use crate::store::auth::Purpose;
use crate::store::{protocol, resolve_bind, StoreClient, StoreServer, WaitOutcome};
use crate::{DdpError, Result};

/// The store side of a joined job.
#[derive(Debug)]
pub(crate) struct Joined {
    pub client: Arc<StoreClient>,
    pub server: Option<StoreServer>,
}

/// Publishes `err` as the job's abort record (best effort: the first record wins).
pub(crate) fn publish(client: &StoreClient, rank: Rank, culprit: Option<Rank>, err: &DdpError) {
    let record = AbortRecord {
        reporter: rank,
        culprit,
        collective: None,
        reason: err.to_string(),
    };
    if let Err(e) = client.abort(record) {
        tracing::debug!("[rank {rank}] could not publish the failure: {e}");
    }
}

/// Serves (rank 0) and joins the store, then waits for every rank.
///
/// # Errors
/// `PortInUse`/`StoreBind` on rank 0; `MasterUnreachable`, `TokenMismatch`, `ProtocolMismatch`,
/// `WorldSizeMismatch`, `DuplicateRank`; `RendezvousTimeout` naming the ranks that never came;
/// `JobAborted` when another rank's misconfiguration ended the rendezvous.
pub(crate) fn join(cfg: &GroupConfig, deadline: Instant) -> Result<Joined> {
    let server = serve(cfg)?;
    match meet(cfg, deadline) {
        Ok(client) => Ok(Joined {
            client: Arc::new(client),
            server,
        }),
        Err(e) => {
            // Rank 0's store goes with this error: the ranks still waiting read the abort
            // record first (a rank between two requests would otherwise find the store gone).
            if let Some(server) = &server {
                server.linger_after_abort(cfg.rank);
            }
            Err(e)
        }
    }
}

/// The store, on rank 0.
fn serve(cfg: &GroupConfig) -> Result<Option<StoreServer>> {
    Ok(if cfg.rank.is_zero() {
        let addr = resolve_bind(&cfg.master, cfg.rank)?;
        let served = StoreServer::bind(addr, cfg.rank, cfg.world_size, cfg.token.clone());
        Some(served.map_err(|e| match (e, &cfg.port_origin) {
            (DdpError::Rendezvous(RendezvousError::PortInUse { rank, addr, .. }), Some(from)) => {
                DdpError::Rendezvous(RendezvousError::PortInUse {
                    rank,
                    addr,
                    origin: format!(" ({from})"),
                })
            }
            (e, _) => e,
        })?)
    } else {
        None
    })
}

/// Joins the store and waits for every rank.
fn meet(cfg: &GroupConfig, deadline: Instant) -> Result<StoreClient> {
    let started = Instant::now();
    let client = StoreClient::connect(
        &cfg.master,
        Purpose::Store,
        cfg.rank,
        cfg.world_size,
        &cfg.token,
        cfg.timeouts.store,
        deadline,
    )?;
    let keys: Vec<String> = cfg.world_size.ranks().map(protocol::joined_key).collect();
    let missing_ranks = |missing: &[String]| -> Vec<Rank> {
        cfg.world_size
            .ranks()
            .filter(|r| missing.contains(&protocol::joined_key(*r)))
            .collect()
    };
    let refused_note = || {
        let refusals = client.refusals().unwrap_or_default();
        if refusals.is_empty() {
            String::new()
        } else {
            let list: Vec<String> = refusals
                .iter()
                .map(|(addr, why)| format!("{addr}: {why}"))
                .collect();
            format!(
                "; the store refused {} connection(s) ({})",
                refusals.len(),
                list.join("; ")
            )
        }
    };
    // Who is still missing is said at intervals (a quarter of the wait, 1 s to 30 s), as
    // torchrun does, instead of silence until the deadline.
    let every = (deadline.saturating_duration_since(started) / 4)
        .clamp(Duration::from_secs(1), Duration::from_secs(30));
    // Arrivals are counted (`StoreClient::arrive`); every rank's key is read only to say who
    // is missing.
    let all = [client.arrive(protocol::JOINED_BARRIER, cfg.world_size.get())?];
    let poll = |wait: Duration| -> Result<WaitOutcome> {
        match client.wait(&all, wait)? {
            WaitOutcome::Ready => Ok(WaitOutcome::Ready),
            WaitOutcome::Missing(_) => client.wait(&keys, Duration::ZERO),
        }
    };
    let outcome = loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match poll(left.min(every))? {
            WaitOutcome::Missing(missing) if left > every => tracing::warn!(
                "[rank {}] waiting for rank(s) {} to join the job at {} ({} of {} joined after \
                 {:.0?}; giving up in {:.0?}){}{}",
                cfg.rank,
                RankList(missing_ranks(&missing)),
                cfg.master,
                keys.len() - missing.len(),
                cfg.world_size,
                started.elapsed(),
                deadline.saturating_duration_since(Instant::now()),
                refused_note(),
                launcher_note(cfg.launcher)
            ),
            outcome => break outcome,
        }
    };
    match outcome {
        WaitOutcome::Ready => {}
        WaitOutcome::Missing(missing) => {
            let missing = missing_ranks(&missing);
            let refused_note = refused_note();
            let culprit = missing.first().copied();
            let err = DdpError::Rendezvous(RendezvousError::RendezvousTimeout {
                rank: cfg.rank,
                addr: cfg.master.to_string(),
                waited: started.elapsed(),
                joined: cfg.world_size.as_usize() - missing.len(),
                world: cfg.world_size,
                missing: RankList(missing),
                refused_note,
            });
            // The ranks still waiting learn why at once (and rank 0's store may be about to go).
            publish(&client, cfg.rank, culprit, &err);
            return Err(err);
        }
    }
    tracing::debug!(
        "[rank {}] joined the job at {} ({} ranks)",
        cfg.rank,
        cfg.master,
        cfg.world_size
    );
    Ok(client)
}

/// What the launcher can tell about ranks that never join, for the waiting message.
fn launcher_note(launcher: Option<Launcher>) -> &'static str {
    match launcher {
        // Nothing in a task's environment says that another task of its step died before it
        // joined: Slurm can end the step instead.
        Some(Launcher::Slurm) => {
            ". Under srun, a task that exited before it joined leaves the others waiting \
             here (srun prints its exit code): `srun --kill-on-bad-exit=1` ends the step at once"
        }
        _ => "",
    }
}
