//! The watcher of joining processes: a thread per fault-tolerant process that reads, each
//! heartbeat interval, the store's count of processes that asked to join.

use std::ops::ControlFlow;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::record::keys;
use crate::config::GroupConfig;
use crate::periodic::Periodic;
use crate::store::auth::Purpose;
use crate::store::StoreClient;

/// Whether a process asked to join since the current epoch began.
#[derive(Debug, Default)]
pub(super) struct JoinWatch {
    pub(super) pending: AtomicBool,
    /// The join counter when the epoch was decided.
    pub(super) seen: AtomicI64,
}

/// The thread that reads, each heartbeat interval, whether a process asked to join (it stops
/// when dropped). `None` (with a warning) if its store connection cannot be opened: joining
/// processes then wait until the rendezvous timeout.
pub(super) fn watch_joins(
    config: &GroupConfig,
    joins: Arc<JoinWatch>,
    id: u32,
    deadline: Instant,
) -> Option<Periodic> {
    let interval =
        (config.timeouts.heartbeat / 5).clamp(Duration::from_millis(50), Duration::from_secs(2));
    let store = match StoreClient::connect(
        &config.master,
        Purpose::StoreAux,
        config.rank,
        config.world_size,
        &config.token,
        interval.max(Duration::from_millis(200)),
        deadline,
    ) {
        Ok(s) => s.with_reply_slack(interval.max(Duration::from_millis(200))),
        Err(e) => {
            tracing::warn!(
                "[member {id}] cannot watch for joining processes (its store connection \
                     failed: {e}); none will be let in"
            );
            return None;
        }
    };
    let thread = Periodic::spawn(format!("burn-ddp-ft-watch-{id}"), interval, move || {
        if let Ok(n) = store.add(keys::JOINS, 0) {
            if n > joins.seen.load(Ordering::SeqCst) {
                joins.pending.store(true, Ordering::SeqCst);
            }
        }
        ControlFlow::Continue(())
    });
    Some(thread)
}
