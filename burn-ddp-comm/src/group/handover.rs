//! The state handed over after a change of membership: the rank with the most progress (the
//! [`Recovery`]'s source) sends its state, framed as byte blocks, to the ranks behind it, point
//! to point and only to them. What the state holds is the caller's (a Learner's records and its
//! cursor, a custom loop's model and optimizer).

use std::sync::{Arc, Mutex};

use super::{ProcessGroup, Recovery};
use crate::{DdpError, Rank, Result};

/// The tag of state transfers between ranks after a change of membership.
const STATE_TAG: u32 = 0x5354_4154;

/// Frames byte blocks: a count, then each block's length and bytes.
pub fn frame(parts: &[&[u8]]) -> Vec<u8> {
    let mut out = (parts.len() as u64).to_le_bytes().to_vec();
    for p in parts {
        out.extend_from_slice(&(p.len() as u64).to_le_bytes());
        out.extend_from_slice(p);
    }
    out
}

/// The `N` blocks of [`frame`]; `None` for anything malformed (it came over the network),
/// another number of blocks included.
pub fn unframe<const N: usize>(mut bytes: &[u8]) -> Option<[Vec<u8>; N]> {
    let take8 = |b: &mut &[u8]| -> Option<u64> {
        let (head, rest) = b.split_first_chunk::<8>()?;
        *b = rest;
        Some(u64::from_le_bytes(*head))
    };
    if usize::try_from(take8(&mut bytes)?).ok()? != N {
        return None;
    }
    let mut out: [Vec<u8>; N] = std::array::from_fn(|_| Vec::new());
    for part in &mut out {
        let len = usize::try_from(take8(&mut bytes)?).ok()?;
        if len > bytes.len() {
            return None;
        }
        let (head, rest) = bytes.split_at(len);
        *part = head.to_vec();
        bytes = rest;
    }
    bytes.is_empty().then_some(out)
}

/// After the change `rec`: the source sends `make()`'s bytes to every rank behind it; a rank
/// behind returns what it received; the others `None` (`make` runs on the source only, and
/// only when some rank is behind).
///
/// # Errors
/// `make` failed, or a transfer did (it names the rank at fault).
pub fn move_state(
    pg: &ProcessGroup,
    rec: &Recovery,
    make: impl FnOnce() -> Result<Vec<u8>>,
) -> Result<Option<Vec<u8>>> {
    if rec.needs_state() {
        return pg.recv_bytes(rec.source, STATE_TAG).map(Some);
    }
    if pg.rank() == rec.source && !rec.behind.is_empty() {
        let bytes = make()?;
        for r in &rec.behind {
            pg.send_bytes(&bytes, *r, STATE_TAG)?;
        }
        tracing::info!(
            "[rank {}] sent the state ({} bytes) to rank(s) {:?}",
            pg.rank(),
            bytes.len(),
            rec.behind
        );
    }
    Ok(None)
}

/// One of a Learner's records as bytes, filled by a line's in-memory checkpointer (burn-train
/// keeps the optimizer's and the scheduler's records private: its checkpointer is the one way
/// to them).
#[derive(Debug, Clone, Default)]
pub struct RecordSlot(Arc<Mutex<Option<Vec<u8>>>>);

impl RecordSlot {
    /// Keeps `bytes` (the last saved).
    pub fn put(&self, bytes: Vec<u8>) {
        *self.0.lock().unwrap_or_else(|p| p.into_inner()) = Some(bytes);
    }

    /// What was saved, once.
    pub fn take(&self) -> Option<Vec<u8>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).take()
    }
}

/// The names of a Learner's three records, in the order of [`saved_records`].
const RECORDS: [&str; 3] = ["model", "optimizer", "scheduler"];

/// A Learner's three records (model, optimizer, scheduler), once a line's checkpointer saved
/// them into `slots`.
///
/// # Errors
/// A slot the checkpointer did not fill ([`ModelError::Access`](crate::ModelError::Access), on `rank`).
pub fn saved_records(slots: &[RecordSlot; 3], rank: Rank) -> Result<[Vec<u8>; 3]> {
    let mut records: [Vec<u8>; 3] = Default::default();
    for ((slot, record), name) in slots.iter().zip(&mut records).zip(RECORDS) {
        *record = slot.take().ok_or_else(|| {
            DdpError::model_access(
                rank,
                "serialising the Learner's state for the ranks behind",
                format!("burn-train's checkpointer did not save the {name} record"),
            )
        })?;
    }
    Ok(records)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip_and_garbage_is_refused() {
        let f = frame(&[b"ab", b"", b"xyz"]);
        assert_eq!(
            unframe::<3>(&f),
            Some([b"ab".to_vec(), Vec::new(), b"xyz".to_vec()])
        );
        assert_eq!(unframe::<4>(&f), None);
        assert_eq!(unframe::<2>(&f), None);
        assert_eq!(unframe::<3>(&f[..f.len() - 1]), None);
        assert_eq!(unframe::<3>(&[f.as_slice(), b"!"].concat()), None);
        assert_eq!(unframe::<3>(&u64::MAX.to_le_bytes()), None);
        assert_eq!(unframe::<0>(&[]), None);
    }

    #[test]
    fn a_learner_state_needs_its_three_records() {
        let slots: [RecordSlot; 3] = Default::default();
        slots[0].put(b"m".to_vec());
        slots[2].put(b"s".to_vec());
        let e = saved_records(&slots, Rank(1)).unwrap_err().to_string();
        assert!(e.contains("did not save the optimizer record"), "{e}");
        slots[0].put(b"m".to_vec());
        slots[1].put(b"o".to_vec());
        slots[2].put(b"s".to_vec());
        assert_eq!(
            saved_records(&slots, Rank(1)).unwrap(),
            [b"m".to_vec(), b"o".to_vec(), b"s".to_vec()]
        );
        // Taken once: a second state needs a second save.
        assert!(saved_records(&slots, Rank(1)).is_err());
    }
}
