//! The launcher's background threads, each on a rendezvous connection of its own: its beat
//! (the sign of life the coordinator watches) and the watch that halts a round's ranks when
//! the job moves to the next round.

use std::ops::ControlFlow;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use super::rdzv::{beat_key, Rdzv, REQUEST};
use super::{ElasticConfig, BEAT};
use crate::config::{JobToken, MasterAddr};
use crate::periodic::Periodic;
use crate::Result;

/// A thread of the launcher's with its own rendezvous connection, stopped (at once) and joined
/// on drop.
pub(super) struct Background {
    _thread: Periodic,
}

impl Background {
    /// Runs `tick` at once and then every [`BEAT`] on a connection of its own, until dropped or
    /// `tick` returns `false`.
    pub(super) fn every(
        name: &str,
        endpoint: &MasterAddr,
        elastic: &ElasticConfig,
        token: &JobToken,
        mut tick: impl FnMut(&Rdzv) -> bool + Send + 'static,
    ) -> Result<Self> {
        let rdzv = Rdzv::connect(endpoint, elastic.nodes.max, token, REQUEST)?;
        let thread = Periodic::try_spawn(name.into(), BEAT, move || match tick(&rdzv) {
            true => ControlFlow::Continue(()),
            false => ControlFlow::Break(()),
        })?;
        Ok(Self { _thread: thread })
    }
}

/// A thread that keeps this launcher's beat counter moving (its sign of life).
pub(super) fn beat(
    endpoint: &MasterAddr,
    elastic: &ElasticConfig,
    token: &JobToken,
) -> Result<Background> {
    let key = beat_key(&elastic.node_id);
    // When the host is gone, the participant finds out on its next request.
    Background::every("burn-ddp-beat", endpoint, elastic, token, move |rdzv| {
        rdzv.client.add(&key, 1).is_ok()
    })
}

/// A thread that sets `halt` when the job leaves round `number`.
pub(super) fn watch(
    endpoint: &MasterAddr,
    elastic: &ElasticConfig,
    token: &JobToken,
    number: u32,
    halt: &Arc<AtomicBool>,
) -> Result<Background> {
    let halt = Arc::clone(halt);
    Background::every("burn-ddp-watch", endpoint, elastic, token, move |rdzv| {
        match rdzv.round() {
            Ok(r) if r > number => {
                halt.store(true, Ordering::SeqCst);
                false
            }
            Ok(_) => true,
            // The host is gone: the ranks find out by themselves (rank 0 is there).
            Err(_) => false,
        }
    })
}
