//! [`digest`]: a 64-bit digest of bytes with one definition in every process, for comparing
//! what ranks hold (the replica check's parameters, a sampler's dataset).

/// A 64-bit digest of bytes (a parameter's, a dataset's sampled items), the same in every
/// process: words of 8 bytes mixed
/// by multiplication and rotation (several GB/s), then the length. For telling equal values
/// from different ones, not against an adversary.
pub fn digest(bytes: &[u8]) -> u64 {
    const K: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut h: u64 = 0xCBF2_9CE4_8422_2325;
    let mut words = bytes.chunks_exact(8);
    for w in &mut words {
        let v = u64::from_le_bytes(w.try_into().unwrap_or([0; 8]));
        h = (h ^ v).wrapping_mul(K).rotate_left(29);
    }
    for &b in words.remainder() {
        h = (h ^ u64::from(b)).wrapping_mul(K).rotate_left(29);
    }
    (h ^ bytes.len() as u64).wrapping_mul(K)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digests_tell_values_apart_and_repeat() {
        let a: Vec<u8> = (0..1003u32)
            .flat_map(|v| (v as f32).to_le_bytes())
            .collect();
        let mut b = a.clone();
        b[517] ^= 1;
        assert_eq!(digest(&a), digest(&a.clone()));
        assert_ne!(digest(&a), digest(&b));
        assert_ne!(digest(&a[..8]), digest(&a[..9]));
        assert_ne!(digest(&[]), digest(&[0]));
    }
}
