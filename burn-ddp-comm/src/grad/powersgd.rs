//! PowerSGD gradient compression (Vogels et al., 2019; PyTorch's `powerSGD_hook`), on the
//! host-staged buckets.
//!
//! Each gradient matrix `M` (a parameter's gradient viewed as `rows × cols`, `rows` its first
//! dimension) whose rank-`r` factors are at least `min_compression_rate` times smaller than
//! itself travels as two thin matrices instead of itself:
//!
//! 1. `M += e` (error feedback: what the previous steps' approximations left out, per rank);
//! 2. `P = M Q`, summed over the ranks, its columns orthonormalised;
//! 3. `Q = Mᵀ P`, averaged over the ranks;
//! 4. the mean gradient is approximated by `P Qᵀ`, and `e = M − P Qᵀ`.
//!
//! `Q` starts from the same pseudo-random matrix on every rank and is reused from the previous
//! step (warm start). Everything else in the bucket (vectors, small matrices, the presence
//! flags) is all-reduced uncompressed, in the same collective as the `P`s. The first
//! `start_step` steps are not compressed at all (PyTorch's `start_powerSGD_iter`): early
//! gradients change fast, and compressing them costs accuracy.

use crate::error::ConfigError;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use super::{reduce_bucket, BucketPlan, Compression, GradReduction};
use crate::group::ProcessGroup;
use crate::types::ReduceOp;
use crate::{DdpError, Result};

/// PowerSGD's settings ([`DdpConfig::with_power_sgd`](super::DdpConfig::with_power_sgd)).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PowerSgd {
    /// The rank `r` of the approximation (PyTorch's `matrix_approximation_rank`; 1 by
    /// default there, often enough; 2–4 are safer).
    pub rank: usize,
    /// Steps all-reduced uncompressed before compression starts (PyTorch's
    /// `start_powerSGD_iter`, 1000 by default there and here).
    pub start_step: u64,
    /// A matrix is compressed only if its factors are at least this many times smaller than
    /// it (PyTorch's `min_compression_rate`, 2).
    pub min_compression_rate: f32,
}

impl PowerSgd {
    /// Rank-`rank` PowerSGD with PyTorch's defaults: compression from step 1001, matrices
    /// that shrink at least twofold.
    pub fn new(rank: usize) -> Self {
        Self {
            rank,
            start_step: 1000,
            min_compression_rate: 2.0,
        }
    }

    /// Compression starts after `steps` uncompressed steps.
    pub fn with_start_step(mut self, steps: u64) -> Self {
        self.start_step = steps;
        self
    }

    /// Whether a `rows × cols` matrix is compressed.
    fn compresses(&self, rows: usize, cols: usize) -> bool {
        rows >= 2
            && cols >= 2
            && (rows * cols) as f64
                >= f64::from(self.min_compression_rate) * ((rows + cols) * self.rank) as f64
    }

    pub(crate) fn validate(&self) -> Result<()> {
        if self.rank == 0 {
            return Err(DdpError::Config(ConfigError::InvalidConfig {
                field: "PowerSgd::rank",
                reason: "must be at least 1",
            }));
        }
        if self.min_compression_rate.is_nan() || self.min_compression_rate < 1.0 {
            return Err(DdpError::Config(ConfigError::InvalidConfig {
                field: "PowerSgd::min_compression_rate",
                reason: "must be at least 1 (a matrix is compressed only if that saves bytes)",
            }));
        }
        Ok(())
    }
}

/// Where each parameter's gradient lies in one bucket, as a matrix: `(offset, rows, cols)`;
/// the presence flags follow the values, from `len` on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BucketShape {
    /// Each parameter: (offset in the bucket, rows, columns).
    pub matrices: Vec<(usize, usize, usize)>,
    /// The number of values (the flags start here).
    pub len: usize,
}

impl<K> BucketPlan<K> {
    /// Bucket `bucket`'s parameters as matrices (a parameter of shape `[d0, d1, ...]` is
    /// `d0 × (d1·...)`; a vector is `n × 1`), for PowerSGD.
    pub fn bucket_shape(&self, bucket: usize) -> BucketShape {
        let (slots, len) = &self.buckets[bucket];
        let matrices = slots
            .iter()
            .map(|&i| {
                let s = &self.slots[i];
                let rows = s.info.shape.first().copied().unwrap_or(1).max(1);
                (s.offset, rows, s.info.numel / rows)
            })
            .collect();
        BucketShape {
            matrices,
            len: *len,
        }
    }
}

/// Elements all-reduced, and elements the same buckets hold uncompressed, since the start.
#[derive(Debug, Default)]
pub struct PowerSgdStats {
    sent: AtomicU64,
    dense: AtomicU64,
    steps: AtomicU64,
}

impl PowerSgdStats {
    /// (elements all-reduced, elements uncompressed, steps), since the start.
    pub fn totals(&self) -> (u64, u64, u64) {
        (
            self.sent.load(Ordering::Relaxed),
            self.dense.load(Ordering::Relaxed),
            self.steps.load(Ordering::Relaxed),
        )
    }
}

/// One matrix's memory across steps: its `Q` (warm start) and its error.
struct Memory {
    rows: usize,
    cols: usize,
    q: Vec<f32>,
    error: Vec<f32>,
}

/// A rank's PowerSGD state (kept by the communication thread).
pub struct PowerSgdState {
    config: PowerSgd,
    /// Mean or sum over the ranks.
    reduction: GradReduction,
    steps: u64,
    memory: HashMap<(usize, usize), Memory>,
    stats: Arc<PowerSgdStats>,
}

impl std::fmt::Debug for PowerSgdState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PowerSgdState")
            .field("config", &self.config)
            .field("steps", &self.steps)
            .field("matrices", &self.memory.len())
            .finish()
    }
}

impl PowerSgdState {
    /// A fresh state reducing as `reduction` says, counting into `stats`.
    pub fn new(config: PowerSgd, reduction: GradReduction, stats: Arc<PowerSgdStats>) -> Self {
        Self {
            config,
            reduction,
            steps: 0,
            memory: HashMap::new(),
            stats,
        }
    }

    /// All-reduces bucket `bucket` (`data`: values then presence flags, laid out as `shape`),
    /// compressed after the warm-up. Buckets must come in index order every step (bucket 0
    /// starts a step), as the transports send them.
    ///
    /// # Errors
    /// A `shape` that does not fit `data`; collective failures.
    pub fn reduce(
        &mut self,
        pg: &ProcessGroup,
        bucket: usize,
        data: &mut [f32],
        shape: &BucketShape,
    ) -> Result<()> {
        let reduction = self.reduction;
        if bucket == 0 {
            self.steps += 1;
            self.stats.steps.fetch_add(1, Ordering::Relaxed);
        }
        self.stats
            .dense
            .fetch_add(data.len() as u64, Ordering::Relaxed);
        let fits = shape.len <= data.len()
            && shape
                .matrices
                .iter()
                .all(|&(o, r, c)| o + r * c <= shape.len);
        if !fits {
            return Err(DdpError::Internal {
                rank: pg.rank(),
                what: "a PowerSGD bucket layout that does not fit its bucket",
            });
        }
        if self.steps <= self.config.start_step {
            self.stats
                .sent
                .fetch_add(data.len() as u64, Ordering::Relaxed);
            return reduce_bucket(pg, data, reduction, Compression::None);
        }
        let world = pg.world_size().as_usize() as f32;
        let r = self.config.rank;
        let compressed: Vec<(usize, usize, usize)> = shape
            .matrices
            .iter()
            .copied()
            .filter(|&(_, rows, cols)| self.config.compresses(rows, cols))
            .collect();

        // Everything not compressed, in bucket order, then the Ps: one all-reduce (sum).
        let mut in_matrix = vec![false; data.len()];
        for &(o, rows, cols) in &compressed {
            in_matrix[o..o + rows * cols].fill(true);
        }
        let mut first: Vec<f32> = data
            .iter()
            .zip(&in_matrix)
            .filter(|(_, m)| !**m)
            .map(|(v, _)| *v)
            .collect();
        let rest = first.len();
        let mut ms = Vec::with_capacity(compressed.len());
        for &(o, rows, cols) in &compressed {
            let mem = self
                .memory
                .entry((bucket, o))
                .or_insert_with(|| Memory::new(rows, cols, r, (bucket, o)));
            if mem.rows != rows || mem.cols != cols {
                *mem = Memory::new(rows, cols, r, (bucket, o));
            }
            let mut m = data[o..o + rows * cols].to_vec();
            m.iter_mut().zip(&mem.error).for_each(|(v, e)| *v += e);
            first.extend(matmul(&m, &mem.q, rows, cols, r));
            ms.push(m);
        }
        pg.all_reduce(&mut first, ReduceOp::Sum)?;

        // Orthonormal Ps; Qs = Mᵀ P, averaged: the second all-reduce.
        let mut ps = Vec::with_capacity(compressed.len());
        let mut second = Vec::new();
        let mut at = rest;
        for (&(_, rows, cols), m) in compressed.iter().zip(&ms) {
            let mut p = first[at..at + rows * r].to_vec();
            at += rows * r;
            orthonormalise(&mut p, rows, r);
            second.extend(matmul_t(m, &p, rows, cols, r));
            ps.push(p);
        }
        if !second.is_empty() {
            pg.all_reduce(&mut second, ReduceOp::Sum)?;
        }
        self.stats
            .sent
            .fetch_add((first.len() + second.len()) as u64, Ordering::Relaxed);

        // The uncompressed part back, as the reduction asks.
        let scale = match reduction {
            GradReduction::Mean => 1.0 / world,
            GradReduction::Sum => 1.0,
        };
        let mut plain = first[..rest].iter();
        for (v, _) in data.iter_mut().zip(&in_matrix).filter(|(_, m)| !**m) {
            if let Some(x) = plain.next() {
                *v = x * scale;
            }
        }
        // Each compressed matrix: the mean approximated by P Qᵀ; the error kept.
        let mut at = 0;
        for ((&(o, rows, cols), m), p) in compressed.iter().zip(ms).zip(ps) {
            let q: Vec<f32> = second[at..at + cols * r]
                .iter()
                .map(|x| x / world)
                .collect();
            at += cols * r;
            let approx = matmul_bt(&p, &q, rows, cols, r);
            let mem = self
                .memory
                .get_mut(&(bucket, o))
                .ok_or(DdpError::Internal {
                    rank: pg.rank(),
                    what: "PowerSGD memory lost between two passes of one bucket",
                })?;
            mem.error = m.iter().zip(&approx).map(|(a, b)| a - b).collect();
            mem.q = q;
            let out = match reduction {
                GradReduction::Mean => 1.0,
                GradReduction::Sum => world,
            };
            data[o..o + rows * cols]
                .iter_mut()
                .zip(&approx)
                .for_each(|(d, a)| *d = a * out);
        }
        Ok(())
    }
}

impl Memory {
    fn new(rows: usize, cols: usize, r: usize, key: (usize, usize)) -> Self {
        // The same pseudo-random start on every rank (seeded by the bucket and offset).
        let mut state = (key.0 as u64)
            .wrapping_mul(0x9E37_79B9_7F4A_7C15)
            .wrapping_add(key.1 as u64)
            .wrapping_add(1);
        let mut q: Vec<f32> = (0..cols * r)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                (state >> 40) as f32 / (1u64 << 24) as f32 - 0.5
            })
            .collect();
        orthonormalise(&mut q, cols, r);
        Self {
            rows,
            cols,
            q,
            error: vec![0.0; rows * cols],
        }
    }
}

/// `A B` for `A` `n × k`... here `M` (`rows × cols`) times `Q` (`cols × r`): `rows × r`.
fn matmul(m: &[f32], q: &[f32], rows: usize, cols: usize, r: usize) -> Vec<f32> {
    let mut out = vec![0.0f32; rows * r];
    for i in 0..rows {
        let row = &m[i * cols..(i + 1) * cols];
        for (k, mv) in row.iter().enumerate() {
            let qk = &q[k * r..(k + 1) * r];
            for j in 0..r {
                out[i * r + j] += mv * qk[j];
            }
        }
    }
    out
}

/// `Mᵀ P`: `M` `rows × cols`, `P` `rows × r`; `cols × r`.
fn matmul_t(m: &[f32], p: &[f32], rows: usize, cols: usize, r: usize) -> Vec<f32> {
    let mut out = vec![0.0f32; cols * r];
    for i in 0..rows {
        let row = &m[i * cols..(i + 1) * cols];
        let pi = &p[i * r..(i + 1) * r];
        for (k, mv) in row.iter().enumerate() {
            for j in 0..r {
                out[k * r + j] += mv * pi[j];
            }
        }
    }
    out
}

/// `P Qᵀ`: `P` `rows × r`, `Q` `cols × r`; `rows × cols`.
fn matmul_bt(p: &[f32], q: &[f32], rows: usize, cols: usize, r: usize) -> Vec<f32> {
    let mut out = vec![0.0f32; rows * cols];
    for i in 0..rows {
        let pi = &p[i * r..(i + 1) * r];
        for k in 0..cols {
            let qk = &q[k * r..(k + 1) * r];
            out[i * cols + k] = pi.iter().zip(qk).map(|(a, b)| a * b).sum();
        }
    }
    out
}

/// Gram–Schmidt on the `r` columns of the row-major `n × r` matrix `a`; a column that
/// vanishes stays zero.
fn orthonormalise(a: &mut [f32], n: usize, r: usize) {
    for j in 0..r {
        for k in 0..j {
            let dot: f32 = (0..n).map(|i| a[i * r + j] * a[i * r + k]).sum();
            for i in 0..n {
                a[i * r + j] -= dot * a[i * r + k];
            }
        }
        let norm = (0..n).map(|i| a[i * r + j].powi(2)).sum::<f32>().sqrt();
        if norm > 1e-20 {
            for i in 0..n {
                a[i * r + j] /= norm;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Timeouts, WorldSize};

    /// Each rank's result of every step, and its counts.
    type Run = Vec<(Vec<Vec<f32>>, (u64, u64, u64))>;

    fn run(world: u32, config: PowerSgd, steps: usize) -> Run {
        // One bucket: a 16 × 8 matrix (compressed at rank 1 or 2), a vector of 8, a 2 × 2
        // matrix (too small), then 3 presence flags.
        let shape = BucketShape {
            matrices: vec![(0, 16, 8), (128, 8, 1), (136, 2, 2)],
            len: 140,
        };
        let groups = ProcessGroup::local(WorldSize::new(world).unwrap(), Timeouts::default());
        let handles: Vec<_> = groups
            .into_iter()
            .map(|pg| {
                let shape = shape.clone();
                std::thread::spawn(move || {
                    let stats = Arc::new(PowerSgdStats::default());
                    let mut state =
                        PowerSgdState::new(config, GradReduction::Mean, Arc::clone(&stats));
                    let rank = pg.rank().index() as f32;
                    let mut out = Vec::new();
                    for step in 0..steps {
                        let mut data: Vec<f32> = (0..140)
                            .map(|i| ((i as f32 * 0.37 + step as f32).sin() + rank) * 0.1)
                            .chain([1.0; 3])
                            .collect();
                        state.reduce(&pg, 0, &mut data, &shape).unwrap();
                        out.push(data);
                    }
                    (out, stats.totals())
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    }

    /// Every rank gets the same result; before the start step it is the exact mean; after, the
    /// small and 1-D parts stay exact, the matrix is approximated, and fewer elements travel.
    #[test]
    fn ranks_agree_and_only_large_matrices_are_approximated() {
        let config = PowerSgd::new(2).with_start_step(1);
        let got = run(2, config, 4);
        assert_eq!(got[0].0, got[1].0, "the ranks' results differ");
        let exact = |step: usize, i: usize| -> f32 {
            (0..2)
                .map(|rank| ((i as f32 * 0.37 + step as f32).sin() + rank as f32) * 0.1)
                .sum::<f32>()
                / 2.0
        };
        let steps = &got[0].0;
        for (i, v) in steps[0].iter().take(140).enumerate() {
            assert!((v - exact(0, i)).abs() < 1e-6, "warm-up step, element {i}");
        }
        for (i, v) in steps[2].iter().enumerate().take(140).skip(128) {
            assert!((v - exact(2, i)).abs() < 1e-6, "uncompressed element {i}");
        }
        assert_eq!(
            &steps[2][140..],
            &[1.0; 3],
            "the presence flags are averaged exactly"
        );
        let off: f32 = (0..128).map(|i| (steps[2][i] - exact(2, i)).abs()).sum();
        assert!(off > 0.0, "the large matrix was not approximated");
        let (sent, dense, count) = got[0].1;
        assert_eq!(count, 4);
        // Warm-up: 143; then 3 × (12 uncompressed + 3 flags + 16·2 + 8·2).
        assert_eq!(dense, 4 * 143);
        assert_eq!(sent, 143 + 3 * (15 + 32 + 16));
    }

    /// A matrix of rank 1 is recovered exactly at rank 1 once the warm start has converged,
    /// and the error feedback keeps the sum of what was applied close to the sum of the
    /// gradients.
    #[test]
    fn a_rank_one_gradient_is_recovered() {
        let shape = BucketShape {
            matrices: vec![(0, 6, 5)],
            len: 30,
        };
        let stats = Arc::new(PowerSgdStats::default());
        let mut state = PowerSgdState::new(
            PowerSgd::new(1).with_start_step(0),
            GradReduction::Mean,
            stats,
        );
        let pg = ProcessGroup::single();
        let u = [1.0f32, -2.0, 0.5, 3.0, -1.0, 2.0];
        let v = [0.3f32, 0.1, -0.4, 0.2, 0.5];
        let m: Vec<f32> = u
            .iter()
            .flat_map(|a| v.iter().map(move |b| a * b))
            .chain([1.0])
            .collect();
        let mut last = Vec::new();
        for _ in 0..3 {
            let mut data = m.clone();
            state.reduce(&pg, 0, &mut data, &shape).unwrap();
            last = data;
        }
        for (a, b) in last.iter().zip(&m).take(30) {
            assert!((a - b).abs() < 1e-5, "{a} vs {b}");
        }
    }

    #[test]
    fn settings_are_checked() {
        assert!(PowerSgd::new(0).validate().is_err());
        let mut bad = PowerSgd::new(1);
        bad.min_compression_rate = 0.5;
        assert!(bad.validate().is_err());
        assert!(PowerSgd::new(1).validate().is_ok());
        assert!(PowerSgd::new(1).compresses(64, 64));
        assert!(!PowerSgd::new(1).compresses(64, 1));
        assert!(!PowerSgd::new(4).compresses(4, 4));
    }
}
