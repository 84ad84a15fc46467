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
        let rel = (g - w).abs() / w.abs().max(tol.floor);
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
