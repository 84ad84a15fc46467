//! `BURN_DDP_DEBUG_DESYNC=1`: before every collective, all ranks exchange what they are about to
//! call (operation, element type, length, root or reduction, and the calling line) and stop at
//! the first divergence with both views — instead of a mismatch error, a hang or, worse, a
//! collective that happens to fit and mixes unrelated data. It costs one small all-gather per
//! collective; the always-on check (every frame's header carries the sequence number and the
//! descriptor, compared with the neighbour's) stays on without it.

use crate::error::CollectiveError;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::comm::Communicator;
use crate::types::{CollectiveDesc, CollectiveSeq, DType, Rank};
use crate::{DdpError, Result};

/// Bytes of one rank's view: the descriptor, then the text for the message.
const VIEW: usize = 256;
const DESC: usize = 32;

#[derive(Debug)]
pub(crate) struct DesyncCheck {
    calls: AtomicU64,
}

impl DesyncCheck {
    /// The check, when `on` (see [`GroupConfig::debug_desync`](crate::GroupConfig)).
    pub(crate) fn new(on: bool) -> Option<Self> {
        on.then(|| Self {
            calls: AtomicU64::new(0),
        })
    }

    /// Compares `desc`, called from `location`, with every rank's call.
    pub(crate) fn check(
        &self,
        comm: &dyn Communicator,
        desc: &CollectiveDesc,
        location: &std::panic::Location<'_>,
    ) -> Result<()> {
        let world = comm.world_size().as_usize();
        if world == 1 {
            return Ok(());
        }
        let call = self.calls.fetch_add(1, Ordering::Relaxed) + 1;
        let text = format!("{desc} at {}:{}", location.file(), location.line());
        let mut mine = [0u8; VIEW];
        mine[..DESC].copy_from_slice(&encode(desc));
        let t = text.as_bytes();
        let n = t.len().min(VIEW - DESC);
        mine[DESC..DESC + n].copy_from_slice(&t[..n]);
        let mut all = vec![0u8; VIEW * world];
        comm.all_gather(&mine, &mut all, DType::I64)?;
        let view = |r: usize| &all[r * VIEW..(r + 1) * VIEW];
        let text_of = |r: usize| {
            let b = &view(r)[DESC..];
            let end = b.iter().position(|&c| c == 0).unwrap_or(b.len());
            String::from_utf8_lossy(&b[..end]).into_owned()
        };
        let rank = comm.rank();
        let same = |a: usize, b: usize| view(a)[..DESC] == view(b)[..DESC];
        // The first rank that differs from rank 0; if that is this rank, compare with rank 0.
        let Some(odd) = (1..world).find(|&r| !same(0, r)) else {
            return Ok(());
        };
        let peer = if rank.index() == odd { 0 } else { odd };
        Err(DdpError::Collective(CollectiveError::Desync {
            rank,
            call: CollectiveSeq(call),
            ours: text,
            peer: Rank(peer as u32),
            theirs: text_of(peer),
        }))
    }
}

fn encode(desc: &CollectiveDesc) -> [u8; DESC] {
    let mut b = [0u8; DESC];
    b[0] = desc.op.code();
    b[1] = desc.dtype.code();
    b[2] = desc.reduce.code();
    b[8..16].copy_from_slice(&desc.count.to_le_bytes());
    b[16..20].copy_from_slice(&desc.root.0.to_le_bytes());
    b
}
