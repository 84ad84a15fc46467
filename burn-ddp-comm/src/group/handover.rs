//! The state handed over after a change of membership: the rank with the most progress (the
//! [`Recovery`]'s source) sends its state, framed as byte blocks, to the ranks behind it, point
//! to point and only to them. What the state holds is the caller's (a Learner's records and its
//! cursor, a custom loop's model and optimizer).

use super::{ProcessGroup, Recovery};
use crate::Result;

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
}
