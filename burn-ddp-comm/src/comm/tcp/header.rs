//! The 32-byte header that opens every collective on a ring link.
//!
//! It carries the sender's sequence number and [`CollectiveDesc`]; the receiver compares it with
//! its own before touching the payload, so ranks that issue different collectives (a desync) fail
//! with `CollectiveMismatch` instead of mixing up bytes or hanging.
//!
//! ```text
//! "BDDC" (4) | version (1) | op (1) | dtype (1) | reduce (1) | seq (8) | count (8) | root (4) | 0 (4)
//! ```

use crate::types::{CollectiveDesc, CollectiveOp, DType, ReduceOp};
use crate::types::{CollectiveSeq, Rank};
use crate::wire::{self, WireError, PROTOCOL_VERSION};

/// Length of the header on the wire.
pub(crate) const LEN: usize = 32;
const MAGIC: [u8; 4] = *b"BDDC";

/// Encodes a header.
pub(crate) fn encode(seq: CollectiveSeq, desc: &CollectiveDesc) -> [u8; LEN] {
    let mut h = [0u8; LEN];
    h[..4].copy_from_slice(&MAGIC);
    h[4] = PROTOCOL_VERSION;
    h[5] = desc.op.code();
    h[6] = desc.dtype.code();
    h[7] = desc.reduce.code();
    h[8..16].copy_from_slice(&seq.0.to_le_bytes());
    h[16..24].copy_from_slice(&desc.count.to_le_bytes());
    h[24..28].copy_from_slice(&desc.root.0.to_le_bytes());
    h
}

/// Decodes a header.
///
/// # Errors
/// Bad magic, another protocol version, unknown codes, or non-zero reserved bytes.
pub(crate) fn decode(h: &[u8; LEN]) -> Result<(CollectiveSeq, CollectiveDesc), WireError> {
    wire::check_preamble(h, MAGIC)?;
    let op = CollectiveOp::from_code(h[5]).ok_or(WireError::InvalidValue {
        what: "collective op",
    })?;
    let dtype = DType::from_code(h[6]).ok_or(WireError::InvalidValue { what: "dtype" })?;
    let reduce = ReduceOp::from_code(h[7]).ok_or(WireError::InvalidValue { what: "reduce op" })?;
    let u64_at = |i: usize| {
        let mut b = [0u8; 8];
        b.copy_from_slice(&h[i..i + 8]);
        u64::from_le_bytes(b)
    };
    let seq = CollectiveSeq(u64_at(8));
    let count = u64_at(16);
    let root = Rank(u32::from_le_bytes([h[24], h[25], h[26], h[27]]));
    let reserved = u32::from_le_bytes([h[28], h[29], h[30], h[31]]);
    if reserved != 0 {
        return Err(WireError::InvalidValue {
            what: "reserved header bytes",
        });
    }
    Ok((
        seq,
        CollectiveDesc {
            op,
            dtype,
            count,
            reduce,
            root,
        },
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn round_trip() {
        let d = CollectiveDesc::new(CollectiveOp::Broadcast, DType::BF16, 77).root(Rank(3));
        let (seq, back) = decode(&encode(CollectiveSeq(9), &d)).unwrap();
        assert_eq!((seq, back), (CollectiveSeq(9), d));
    }

    proptest! {
        #[test]
        fn decoding_never_panics(bytes in proptest::collection::vec(any::<u8>(), LEN)) {
            let mut h = [0u8; LEN];
            h.copy_from_slice(&bytes);
            let _ = decode(&h);
        }
    }
}
