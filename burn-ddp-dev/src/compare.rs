//! Comparing a data-parallel model with its single-process reference (both Burn lines' equivalence
//! tests use this file; it knows no Burn type).

/// `|ddp - single| <= rel * max(|single|, floor)`: relative, except for values near zero, where
/// a relative difference says nothing (summing per-rank means rounds differently from one mean).
#[derive(Clone, Copy, Debug)]
pub struct Tolerance {
    pub rel: f32,
    pub floor: f32,
}

/// f32: 1e-5 relative, for values of magnitude 0.05 and more (5e-7 absolute below). The
/// parameters in the tests start at magnitudes up to 0.35; Adam normalises each update, so the
/// rounding difference between a sum of per-rank means and one mean shows most on the smallest
/// values.
pub const F32: Tolerance = Tolerance {
    rel: 1e-5,
    floor: 0.05,
};

/// f32 on a GPU: 1e-2 relative, for values of magnitude 0.05 and more. cubecl runs f32 matrix
/// products on tensor cores in TF32 (10 bits of mantissa, a rounding of up to 2^-11 ≈ 4.9e-4
/// relative per product: cubek-matmul's `adjust_dtypes`) whenever it picks an accelerated kernel,
/// and which kernel it picks depends on the shapes (a rank's batch against the whole batch) and,
/// with autotune, on timings. On an H200 (2026-11-25, docs/gpu-verification.md) the DDP models
/// of 2 and 3 processes differed from one process by up to 2.2e-3 relative after 20 steps, with
/// every rank's model bit-identical to the others'. A synchronisation that is wrong (a rank
/// missing from a mean, a sum for a mean) is off by tens of percent; [`assert_discriminates`]
/// checks, in each test, that training without synchronisation is beyond this tolerance.
pub const F32_GPU: Tolerance = Tolerance {
    rel: 1e-2,
    floor: 0.05,
};

/// `|got - want|` relative to `max(|want|, floor)`: what a [`Tolerance`] bounds.
fn relative(got: f32, want: f32, floor: f32) -> f32 {
    (got - want).abs() / want.abs().max(floor)
}

/// The largest relative difference (as [`assert_close`] measures it) between `got` and `want`.
pub fn worst_relative(got: &[f32], want: &[f32], floor: f32) -> f32 {
    got.iter()
        .zip(want)
        .map(|(g, w)| relative(*g, *w, floor))
        .fold(0.0, f32::max)
}

/// The negative control of an equivalence test: `alone` (rank `rank`'s model trained on its own
/// shard, without synchronisation) must differ from `want` (the single-process reference) by
/// more than 3 × `tol`, or the test could not tell synchronised training from none.
pub fn assert_discriminates(rank: usize, alone: &[f32], want: &[f32], tol: Tolerance) {
    let worst = worst_relative(alone, want, tol.floor);
    assert!(
        worst > 3.0 * tol.rel,
        "rank {rank}: this test cannot fail: a model trained on this rank's shard alone is within \
         {worst:e} relative of the single-process reference, not beyond 3 × the tolerance {tol:?}"
    );
}

/// Every rank's model is bit-identical to this one: `all` is every rank's [`f32_bytes`] (an
/// all-gather of `mine`, this rank's).
pub fn assert_replicas_equal(rank: usize, mine: &[u8], all: &[Vec<u8>]) {
    for (other, theirs) in all.iter().enumerate() {
        assert!(
            theirs.as_slice() == mine,
            "rank {rank}: rank {other}'s model is not bit-identical to this rank's"
        );
    }
}

/// `values` as little-endian bytes.
pub fn f32_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// Asserts that every value of `got` (rank `rank`'s model) is within `tol` of `want` (the
/// single-process reference), naming the first that is not; prints and returns the worst
/// relative difference.
pub fn assert_close(rank: usize, got: &[f32], want: &[f32], tol: Tolerance) -> f32 {
    assert_eq!(
        got.len(),
        want.len(),
        "rank {rank}: parameter counts differ"
    );
    let mut worst = 0.0f32;
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let rel = relative(*g, *w, tol.floor);
        worst = worst.max(rel);
        assert!(
            rel <= tol.rel,
            "rank {rank}: parameter element {i}: ddp {g} vs single process {w} (relative {rel:e}, {tol:?})"
        );
    }
    println!(
        "rank {rank}: worst relative difference {worst:e} over {} values",
        got.len()
    );
    worst
}
