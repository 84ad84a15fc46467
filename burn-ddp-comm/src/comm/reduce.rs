//! Element-wise reduction kernels shared by the host transports, and how a buffer is split into
//! per-rank segments.
//!
//! `dst[i] = op(dst[i], src[i])` on byte slices holding elements of a [`DType`]. The loops are
//! written so that the compiler vectorises them; half-precision types are widened to f32 in
//! small blocks (so each step rounds once, as NCCL does) and narrowed back.

use std::ops::Range;

use half::{bf16, f16, slice::HalfFloatSliceExt};

use super::{DType, ReduceOp};

/// Splits `count` elements of `elem` bytes into `parts` contiguous byte ranges whose sizes differ
/// by at most one element.
pub(crate) fn split(count: usize, elem: usize, parts: usize) -> Vec<Range<usize>> {
    let base = count / parts;
    let extra = count % parts;
    let mut out = Vec::with_capacity(parts);
    let mut start = 0;
    for i in 0..parts {
        let n = base + usize::from(i < extra);
        out.push(start * elem..(start + n) * elem);
        start += n;
    }
    out
}

/// What to do after combining: nothing, or divide by the world size (the last step of a mean).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Finish {
    /// Leave the combined value.
    None,
    /// Divide the combined value by this (integers divide towards zero).
    DivideBy(u32),
}

trait Num: bytemuck::Pod {
    fn add(self, o: Self) -> Self;
    fn max(self, o: Self) -> Self;
    fn min(self, o: Self) -> Self;
    fn div(self, n: u32) -> Self;
}

/// The NaN of `a` and `b` (`a` when both are and `a_above`, its bit pattern being the larger).
#[inline(always)]
fn nan_of<T: Copy + PartialEq>(a: T, b: T, a_above: bool) -> T {
    #[allow(clippy::eq_op)]
    let a_nan = a != a;
    #[allow(clippy::eq_op)]
    let b_nan = b != b;
    match (a_nan, b_nan) {
        (true, true) if a_above => a,
        (true, true) => b,
        (true, false) => a,
        _ => b,
    }
}

macro_rules! float_num {
    ($($t:ty),*) => {$(
        impl Num for $t {
            #[inline(always)] fn add(self, o: Self) -> Self { self + o }
            // Symmetric in its arguments, bit for bit, because recursive doubling combines
            // in both directions at once (`a ⊕ b` on one rank, `b ⊕ a` on its partner): NaN
            // wins (the larger bit pattern of two), and +0 is above -0.
            #[inline(always)] fn max(self, o: Self) -> Self {
                if self.is_nan() || o.is_nan() { nan_of(self, o, self.to_bits() > o.to_bits()) }
                else if o > self { o } else if self > o { self }
                else if self.is_sign_negative() { o } else { self }
            }
            #[inline(always)] fn min(self, o: Self) -> Self {
                if self.is_nan() || o.is_nan() { nan_of(self, o, self.to_bits() > o.to_bits()) }
                else if o < self { o } else if self < o { self }
                else if self.is_sign_negative() { self } else { o }
            }
            #[inline(always)] fn div(self, n: u32) -> Self { self / (n as $t) }
        }
    )*};
}
float_num!(f32, f64);

macro_rules! int_num {
    ($($t:ty),*) => {$(
        impl Num for $t {
            #[inline(always)] fn add(self, o: Self) -> Self { self.wrapping_add(o) }
            #[inline(always)] fn max(self, o: Self) -> Self { Ord::max(self, o) }
            #[inline(always)] fn min(self, o: Self) -> Self { Ord::min(self, o) }
            #[inline(always)] fn div(self, n: u32) -> Self { self.wrapping_div(Ord::max(<$t>::try_from(n).unwrap_or(<$t>::MAX), 1)) }
        }
    )*};
}
int_num!(i32, i64);

impl Num for u8 {
    #[inline(always)]
    fn add(self, o: Self) -> Self {
        self.wrapping_add(o)
    }
    #[inline(always)]
    fn max(self, o: Self) -> Self {
        Ord::max(self, o)
    }
    #[inline(always)]
    fn min(self, o: Self) -> Self {
        Ord::min(self, o)
    }
    #[inline(always)]
    fn div(self, n: u32) -> Self {
        u8::try_from(u32::from(self) / n.max(1)).unwrap_or(u8::MAX)
    }
}

fn combine_typed<T: Num>(dst: &mut [T], src: &[T], op: ReduceOp, finish: Finish) {
    match op {
        ReduceOp::Sum | ReduceOp::Mean => {
            for (d, s) in dst.iter_mut().zip(src) {
                *d = d.add(*s);
            }
        }
        ReduceOp::Max => {
            for (d, s) in dst.iter_mut().zip(src) {
                *d = d.max(*s);
            }
        }
        ReduceOp::Min => {
            for (d, s) in dst.iter_mut().zip(src) {
                *d = d.min(*s);
            }
        }
    }
    if let Finish::DivideBy(n) = finish {
        for d in dst.iter_mut() {
            *d = d.div(n);
        }
    }
}

/// Views bytes as `T`s when aligned; otherwise `None` (callers then copy).
fn typed_mut<T: bytemuck::Pod>(b: &mut [u8]) -> Option<&mut [T]> {
    bytemuck::try_cast_slice_mut(b).ok()
}

fn typed<T: bytemuck::Pod>(b: &[u8]) -> Option<&[T]> {
    bytemuck::try_cast_slice(b).ok()
}

fn combine_num<T: Num>(dst: &mut [u8], src: &[u8], op: ReduceOp, finish: Finish) {
    match (typed::<T>(src), typed_mut::<T>(dst)) {
        (Some(s), Some(d)) => combine_typed(d, s, op, finish),
        _ => {
            // Unaligned views (never produced by the transports, which keep element alignment):
            // copy into aligned blocks.
            const BLOCK: usize = 256;
            let size = std::mem::size_of::<T>();
            for (dc, sc) in dst.chunks_mut(BLOCK * size).zip(src.chunks(BLOCK * size)) {
                let mut d: Vec<T> = bytemuck::pod_collect_to_vec(dc);
                let s: Vec<T> = bytemuck::pod_collect_to_vec(sc);
                combine_typed(&mut d, &s, op, finish);
                dc.copy_from_slice(bytemuck::cast_slice(&d));
            }
        }
    }
}

/// Half-precision types reduce in f32: widen a block, combine, round back.
trait Half: bytemuck::Pod {
    fn widen(src: &[Self], dst: &mut [f32]);
    fn narrow(src: &[f32], dst: &mut [Self]);
}

impl Half for f16 {
    fn widen(src: &[Self], dst: &mut [f32]) {
        src.convert_to_f32_slice(dst);
    }
    fn narrow(src: &[f32], dst: &mut [Self]) {
        dst.convert_from_f32_slice(src);
    }
}

impl Half for bf16 {
    fn widen(src: &[Self], dst: &mut [f32]) {
        src.convert_to_f32_slice(dst);
    }
    fn narrow(src: &[f32], dst: &mut [Self]) {
        dst.convert_from_f32_slice(src);
    }
}

fn combine_half<H: Half>(dst: &mut [u8], src: &[u8], op: ReduceOp, finish: Finish) {
    const BLOCK: usize = 512;
    let size = std::mem::size_of::<H>();
    let mut a = [0f32; BLOCK];
    let mut b = [0f32; BLOCK];
    let mut step = |d: &mut [H], s: &[H]| {
        let n = d.len();
        H::widen(d, &mut a[..n]);
        H::widen(s, &mut b[..n]);
        combine_typed(&mut a[..n], &b[..n], op, finish);
        H::narrow(&a[..n], d);
    };
    for (dc, sc) in dst.chunks_mut(BLOCK * size).zip(src.chunks(BLOCK * size)) {
        match (typed::<H>(sc), typed_mut::<H>(dc)) {
            (Some(s), Some(d)) => step(d, s),
            (s, _) => {
                // Unaligned views: work on aligned copies.
                let s: Vec<H> = match s {
                    Some(s) => s.to_vec(),
                    None => bytemuck::pod_collect_to_vec(sc),
                };
                let mut d: Vec<H> = bytemuck::pod_collect_to_vec(dc);
                step(&mut d, &s);
                dc.copy_from_slice(bytemuck::cast_slice(&d));
            }
        }
    }
}

/// `dst = op(dst, src)` element-wise, then `finish`. `dst` and `src` hold the same number of
/// whole elements of `dtype`.
pub(crate) fn combine(dtype: DType, op: ReduceOp, dst: &mut [u8], src: &[u8], finish: Finish) {
    debug_assert_eq!(dst.len(), src.len());
    debug_assert_eq!(dst.len() % dtype.size(), 0);
    match dtype {
        DType::F32 => combine_num::<f32>(dst, src, op, finish),
        DType::F64 => combine_num::<f64>(dst, src, op, finish),
        DType::I32 => combine_num::<i32>(dst, src, op, finish),
        DType::I64 => combine_num::<i64>(dst, src, op, finish),
        DType::U8 => combine_num::<u8>(dst, src, op, finish),
        DType::F16 => combine_half::<f16>(dst, src, op, finish),
        DType::BF16 => combine_half::<bf16>(dst, src, op, finish),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_balances_and_covers() {
        let s = split(10, 4, 3);
        assert_eq!(s, vec![0..16, 16..28, 28..40]);
        let s = split(1, 4, 3);
        assert_eq!(s, vec![0..4, 4..4, 4..4]);
        let s = split(0, 2, 2);
        assert_eq!(s, vec![0..0, 0..0]);
    }

    fn bytes<T: bytemuck::Pod>(v: &[T]) -> Vec<u8> {
        bytemuck::cast_slice(v).to_vec()
    }

    #[test]
    fn f32_ops() {
        let mut d = bytes(&[1f32, 5.0, -2.0]);
        let s = bytes(&[2f32, 3.0, -4.0]);
        combine(DType::F32, ReduceOp::Sum, &mut d, &s, Finish::None);
        assert_eq!(bytemuck::cast_slice::<u8, f32>(&d), &[3.0, 8.0, -6.0]);
        combine(DType::F32, ReduceOp::Max, &mut d, &s, Finish::None);
        assert_eq!(bytemuck::cast_slice::<u8, f32>(&d), &[3.0, 8.0, -4.0]);
        combine(DType::F32, ReduceOp::Min, &mut d, &s, Finish::None);
        assert_eq!(bytemuck::cast_slice::<u8, f32>(&d), &[2.0, 3.0, -4.0]);
        combine(DType::F32, ReduceOp::Mean, &mut d, &s, Finish::DivideBy(2));
        assert_eq!(bytemuck::cast_slice::<u8, f32>(&d), &[2.0, 3.0, -4.0]);
    }

    #[test]
    fn float_max_and_min_are_symmetric_bit_for_bit() {
        let values = [
            0.0f32,
            -0.0,
            1.0,
            -1.0,
            f32::NAN,
            -f32::NAN,
            f32::from_bits(0x7fc0_0001),
            f32::INFINITY,
            f32::NEG_INFINITY,
        ];
        for op in [ReduceOp::Max, ReduceOp::Min] {
            for &a in &values {
                for &b in &values {
                    let mut ab = bytes(&[a]);
                    combine(DType::F32, op, &mut ab, &bytes(&[b]), Finish::None);
                    let mut ba = bytes(&[b]);
                    combine(DType::F32, op, &mut ba, &bytes(&[a]), Finish::None);
                    assert_eq!(ab, ba, "{op:?} of {a:?} and {b:?}");
                    let r = bytemuck::cast_slice::<u8, f32>(&ab)[0];
                    assert_eq!(r.is_nan(), a.is_nan() || b.is_nan(), "{op:?} {a} {b}");
                }
            }
        }
        let mut d = bytes(&[-0.0f32]);
        combine(
            DType::F32,
            ReduceOp::Max,
            &mut d,
            &bytes(&[0.0f32]),
            Finish::None,
        );
        assert_eq!(bytemuck::cast_slice::<u8, f32>(&d)[0].to_bits(), 0);
    }

    #[test]
    fn integer_mean_truncates_towards_zero() {
        let mut d = bytes(&[3i64, -3]);
        let s = bytes(&[0i64, 0]);
        combine(DType::I64, ReduceOp::Mean, &mut d, &s, Finish::DivideBy(2));
        assert_eq!(bytemuck::cast_slice::<u8, i64>(&d), &[1, -1]);
        let mut d = bytes(&[7i32]);
        combine(
            DType::I32,
            ReduceOp::Mean,
            &mut d,
            &bytes(&[0i32]),
            Finish::DivideBy(3),
        );
        assert_eq!(bytemuck::cast_slice::<u8, i32>(&d), &[2]);
    }

    #[test]
    fn half_types_reduce_through_f32() {
        let a: Vec<f16> = [1.5f32, 2.0, 1000.0]
            .iter()
            .map(|x| f16::from_f32(*x))
            .collect();
        let b: Vec<f16> = [0.25f32, -4.0, 24.0]
            .iter()
            .map(|x| f16::from_f32(*x))
            .collect();
        let mut d = bytes(&a);
        combine(DType::F16, ReduceOp::Sum, &mut d, &bytes(&b), Finish::None);
        let out: Vec<f32> = bytemuck::cast_slice::<u8, f16>(&d)
            .iter()
            .map(|x| x.to_f32())
            .collect();
        assert_eq!(out, vec![1.75, -2.0, 1024.0]);

        let a: Vec<bf16> = (0..1000).map(|i| bf16::from_f32(i as f32)).collect();
        let mut d = bytes(&a);
        combine(DType::BF16, ReduceOp::Max, &mut d, &bytes(&a), Finish::None);
        assert_eq!(d, bytes(&a));
    }

    #[test]
    fn unaligned_views_still_reduce() {
        let mut d = [0u8; 4 * 3 + 1];
        let mut s = [0u8; 4 * 3 + 1];
        d[1..].copy_from_slice(&bytes(&[1i32, 2, 3]));
        s[1..].copy_from_slice(&bytes(&[10i32, 20, 30]));
        combine(
            DType::I32,
            ReduceOp::Sum,
            &mut d[1..],
            &s[1..],
            Finish::None,
        );
        let out: Vec<i32> = bytemuck::pod_collect_to_vec(&d[1..]);
        assert_eq!(out, vec![11, 22, 33]);
    }
}
