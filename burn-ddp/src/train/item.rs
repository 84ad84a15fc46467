//! Global metrics: each step's output items of every rank, merged into one item on rank 0.

use burn::tensor::backend::Backend;
use burn::tensor::{Device, Int, Tensor, TensorData};
use burn::train::{ClassificationOutput, MultiLabelClassificationOutput, RegressionOutput};

use crate::group::ProcessGroup;
use crate::{DdpError, Rank, Result};

/// An output item that can be merged across ranks, so that the metrics on rank 0's dashboard are
/// those of the whole job: the merged item holds every rank's examples (accuracy over the global
/// batch, item counts summed) and the loss averaged over them.
///
/// Implemented for burn-train's [`ClassificationOutput`], [`MultiLabelClassificationOutput`]
/// and [`RegressionOutput`]. For an output of your own, list its tensors in
/// [`into_parts`](Self::into_parts) and rebuild one item from every rank's list in
/// [`merge`](Self::merge); [`Part`] does the concatenation and the weighted mean.
pub trait DistributedItem: Sized {
    /// The backend of the item's tensors.
    type Backend: Backend;

    /// This rank's item as host data, always the same parts in the same order.
    fn into_parts(self) -> Vec<Part>;

    /// One item from the parts of every rank that had an item this step, in rank order (at
    /// least one).
    ///
    /// # Errors
    /// Parts that do not fit together (a rank sent a different kind of item).
    fn merge(ranks: Vec<Vec<Part>>, device: &Device<Self::Backend>) -> Result<Self>;
}

/// One tensor of an item, on the host: float parts travel as `f32`, integer parts as `i64`.
#[derive(Debug, Clone, PartialEq)]
pub enum Part {
    /// A float tensor.
    Float {
        /// Its shape.
        shape: Vec<usize>,
        /// Its values, row-major.
        values: Vec<f32>,
    },
    /// An integer tensor.
    Int {
        /// Its shape.
        shape: Vec<usize>,
        /// Its values, row-major.
        values: Vec<i64>,
    },
}

impl Part {
    /// A float tensor's values.
    pub fn float<B: Backend, const D: usize>(tensor: Tensor<B, D>) -> Self {
        let data = tensor.into_data().convert::<f32>();
        Part::Float {
            shape: data.shape.to_vec(),
            values: data.to_vec().unwrap_or_default(),
        }
    }

    /// An integer tensor's values.
    pub fn int<B: Backend, const D: usize>(tensor: Tensor<B, D, Int>) -> Self {
        let data = tensor.into_data().convert::<i64>();
        Part::Int {
            shape: data.shape.to_vec(),
            values: data.to_vec().unwrap_or_default(),
        }
    }

    fn shape(&self) -> &[usize] {
        match self {
            Part::Float { shape, .. } | Part::Int { shape, .. } => shape,
        }
    }

    /// Rows in the first dimension (the batch size of a `[batch, ...]` tensor).
    pub fn rows(&self) -> usize {
        self.shape().first().copied().unwrap_or(1)
    }

    /// The float parts concatenated along the first dimension.
    ///
    /// # Errors
    /// A part that is not a float tensor of rank `D`, or whose trailing dimensions differ.
    pub fn cat_float<B: Backend, const D: usize>(
        parts: &[&Part],
        device: &B::Device,
    ) -> Result<Tensor<B, D>> {
        let (shape, values) = cat(parts, D, |p| match p {
            Part::Float { shape, values } => Some((shape, values)),
            Part::Int { .. } => None,
        })?;
        Ok(Tensor::from_data(TensorData::new(values, shape), device))
    }

    /// The integer parts concatenated along the first dimension.
    ///
    /// # Errors
    /// As [`cat_float`](Self::cat_float), for integer tensors.
    pub fn cat_int<B: Backend, const D: usize>(
        parts: &[&Part],
        device: &B::Device,
    ) -> Result<Tensor<B, D, Int>> {
        let (shape, values) = cat(parts, D, |p| match p {
            Part::Int { shape, values } => Some((shape, values)),
            Part::Float { .. } => None,
        })?;
        Ok(Tensor::from_data(TensorData::new(values, shape), device))
    }

    /// The mean of one-element float parts (per-rank mean losses) weighted by `weights` (the
    /// ranks' batch sizes): the mean over the global batch, as a one-element tensor.
    ///
    /// # Errors
    /// A part that is not a one-element float tensor.
    pub fn weighted_mean<B: Backend>(
        parts: &[&Part],
        weights: &[usize],
        device: &B::Device,
    ) -> Result<Tensor<B, 1>> {
        let mut sum = 0.0f64;
        let mut total = 0usize;
        for (p, w) in parts.iter().zip(weights) {
            let Part::Float { values, .. } = p else {
                return Err(mismatch("expected a float loss"));
            };
            if values.is_empty() {
                return Err(mismatch("empty loss tensor"));
            }
            let mean = values.iter().map(|v| f64::from(*v)).sum::<f64>() / values.len() as f64;
            sum += mean * *w as f64;
            total += w;
        }
        let mean = if total == 0 { 0.0 } else { sum / total as f64 };
        Ok(Tensor::from_data(
            TensorData::new(vec![mean as f32], [1]),
            device,
        ))
    }

    pub(crate) fn encode(parts: &[Part], out: &mut Vec<u8>) {
        out.extend_from_slice(&(parts.len() as u32).to_le_bytes());
        for p in parts {
            let (tag, shape) = match p {
                Part::Float { shape, .. } => (0u8, shape),
                Part::Int { shape, .. } => (1u8, shape),
            };
            out.push(tag);
            out.push(shape.len() as u8);
            for d in shape {
                out.extend_from_slice(&(*d as u64).to_le_bytes());
            }
            match p {
                Part::Float { values, .. } => {
                    out.extend_from_slice(&(values.len() as u64).to_le_bytes());
                    out.extend(values.iter().flat_map(|v| v.to_le_bytes()));
                }
                Part::Int { values, .. } => {
                    out.extend_from_slice(&(values.len() as u64).to_le_bytes());
                    out.extend(values.iter().flat_map(|v| v.to_le_bytes()));
                }
            }
        }
    }

    /// Decodes what [`encode`](Self::encode) wrote, refusing anything inconsistent (the bytes
    /// came from another process).
    pub(crate) fn decode(mut bytes: &[u8]) -> Option<Vec<Part>> {
        fn take<'a>(b: &mut &'a [u8], n: usize) -> Option<&'a [u8]> {
            if b.len() < n {
                return None;
            }
            let (head, tail) = b.split_at(n);
            *b = tail;
            Some(head)
        }
        fn u64_(b: &mut &[u8]) -> Option<u64> {
            Some(u64::from_le_bytes(take(b, 8)?.try_into().ok()?))
        }
        let count = u32::from_le_bytes(take(&mut bytes, 4)?.try_into().ok()?) as usize;
        let mut parts = Vec::with_capacity(count.min(64));
        for _ in 0..count {
            let tag = take(&mut bytes, 1)?[0];
            let rank = take(&mut bytes, 1)?[0] as usize;
            let mut shape = Vec::with_capacity(rank);
            for _ in 0..rank {
                shape.push(usize::try_from(u64_(&mut bytes)?).ok()?);
            }
            let len = usize::try_from(u64_(&mut bytes)?).ok()?;
            let elems = shape.iter().try_fold(1usize, |a, d| a.checked_mul(*d))?;
            let width = if tag == 0 { 4 } else { 8 };
            if elems != len || len.checked_mul(width)? > bytes.len() {
                return None;
            }
            let raw = take(&mut bytes, len * width)?;
            parts.push(match tag {
                0 => Part::Float {
                    shape,
                    values: raw
                        .chunks_exact(4)
                        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                        .collect(),
                },
                1 => Part::Int {
                    shape,
                    values: raw
                        .chunks_exact(8)
                        .map(|c| i64::from_le_bytes(c.try_into().unwrap_or([0; 8])))
                        .collect(),
                },
                _ => return None,
            });
        }
        bytes.is_empty().then_some(parts)
    }
}

type Flat<'a, T> = (&'a Vec<usize>, &'a Vec<T>);

fn cat<T: Clone>(
    parts: &[&Part],
    rank: usize,
    pick: impl for<'a> Fn(&'a Part) -> Option<Flat<'a, T>>,
) -> Result<(Vec<usize>, Vec<T>)> {
    let mut shape: Option<Vec<usize>> = None;
    let mut values = Vec::new();
    for p in parts {
        let (s, v) = pick(p).ok_or_else(|| mismatch("a part has the wrong kind (float/int)"))?;
        if s.len() != rank {
            return Err(mismatch(&format!(
                "a part has {} dimensions, expected {rank}",
                s.len()
            )));
        }
        match &mut shape {
            None => shape = Some(s.clone()),
            Some(acc) => {
                if acc[1..] != s[1..] {
                    return Err(mismatch(&format!(
                        "parts of shapes {acc:?} and {s:?} cannot be stacked"
                    )));
                }
                acc[0] += s[0];
            }
        }
        values.extend_from_slice(v);
    }
    let shape = shape.ok_or_else(|| mismatch("no rank sent an item"))?;
    Ok((shape, values))
}

fn mismatch(what: &str) -> DdpError {
    DdpError::Model {
        rank: Rank(0),
        what: "merging the ranks' output items for the metrics",
        reason: what.to_owned(),
    }
}

/// Columns of every rank's `i`-th part, and the batch sizes (rows of part `rows_of`).
fn column(ranks: &[Vec<Part>], i: usize) -> Result<Vec<&Part>> {
    ranks
        .iter()
        .map(|r| {
            r.get(i)
                .ok_or_else(|| mismatch(&format!("a rank's item has no part {i}")))
        })
        .collect()
}

macro_rules! loss_output_targets {
    ($ty:ident, $targets:ident, $target_dims:literal) => {
        impl<B: Backend> DistributedItem for $ty<B> {
            type Backend = B;

            fn into_parts(self) -> Vec<Part> {
                vec![
                    Part::float(self.loss),
                    Part::float(self.output),
                    Part::$targets(self.targets),
                ]
            }

            fn merge(ranks: Vec<Vec<Part>>, device: &B::Device) -> Result<Self> {
                let outputs = column(&ranks, 1)?;
                let weights: Vec<usize> = outputs.iter().map(|p| p.rows()).collect();
                Ok($ty {
                    loss: Part::weighted_mean(&column(&ranks, 0)?, &weights, device)?,
                    output: Part::cat_float::<B, 2>(&outputs, device)?,
                    targets: loss_output_targets!(@cat $targets, $target_dims, column(&ranks, 2)?, device),
                })
            }
        }
    };
    (@cat int, $d:literal, $parts:expr, $device:expr) => {
        Part::cat_int::<B, $d>(&$parts, $device)?
    };
    (@cat float, $d:literal, $parts:expr, $device:expr) => {
        Part::cat_float::<B, $d>(&$parts, $device)?
    };
}

loss_output_targets!(ClassificationOutput, int, 1);
loss_output_targets!(MultiLabelClassificationOutput, int, 2);
loss_output_targets!(RegressionOutput, float, 2);

/// Gathers every rank's item (or its absence) and returns the merged item on rank 0, `None`
/// on the other ranks and when no rank had an item.
pub(crate) fn gather<I: DistributedItem>(
    pg: &ProcessGroup,
    item: Option<I>,
    device: &Device<I::Backend>,
) -> Result<Option<I>> {
    let mut bytes = Vec::new();
    if let Some(item) = item {
        Part::encode(&item.into_parts(), &mut bytes);
    }
    let all = pg.all_gather_bytes(&bytes)?;
    if pg.rank() != Rank(0) {
        return Ok(None);
    }
    let mut ranks = Vec::new();
    for (r, b) in all.iter().enumerate() {
        if b.is_empty() {
            continue;
        }
        let parts = Part::decode(b).ok_or_else(|| DdpError::Model {
            rank: pg.rank(),
            what: "decoding an output item",
            reason: format!("rank {r} sent {} malformed bytes", b.len()),
        })?;
        ranks.push(parts);
    }
    if ranks.is_empty() {
        return Ok(None);
    }
    I::merge(ranks, device).map(Some)
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::NdArray;
    use proptest::prelude::*;

    type B = NdArray;

    #[test]
    fn classification_outputs_merge_into_the_global_batch() {
        let dev = Default::default();
        let a = ClassificationOutput::<B>::new(
            Tensor::from_floats([0.5], &dev),
            Tensor::from_floats([[1.0, 0.0], [0.0, 1.0]], &dev),
            Tensor::from_ints([0, 1], &dev),
        );
        let b = ClassificationOutput::<B>::new(
            Tensor::from_floats([2.0], &dev),
            Tensor::from_floats([[0.3, 0.7]], &dev),
            Tensor::from_ints([0], &dev),
        );
        let m =
            ClassificationOutput::<B>::merge(vec![a.into_parts(), b.into_parts()], &dev).unwrap();
        assert_eq!(m.output.dims(), [3, 2]);
        assert_eq!(
            m.targets
                .into_data()
                .convert::<i64>()
                .to_vec::<i64>()
                .unwrap(),
            vec![0, 1, 0]
        );
        // (0.5 * 2 + 2.0 * 1) / 3
        let loss: f32 = m.loss.into_scalar();
        assert!((loss - 1.0).abs() < 1e-6, "{loss}");
    }

    #[test]
    fn items_of_different_kinds_do_not_merge() {
        let dev = Default::default();
        let a = RegressionOutput::<B>::new(
            Tensor::from_floats([0.5], &dev),
            Tensor::from_floats([[1.0]], &dev),
            Tensor::from_floats([[1.0]], &dev),
        );
        let b = ClassificationOutput::<B>::new(
            Tensor::from_floats([0.5], &dev),
            Tensor::from_floats([[1.0]], &dev),
            Tensor::from_ints([0], &dev),
        );
        let err = RegressionOutput::<B>::merge(vec![a.into_parts(), b.into_parts()], &dev);
        assert!(err.is_err());
    }

    fn part() -> impl Strategy<Value = Part> {
        (0usize..4, 0usize..4, any::<bool>()).prop_flat_map(|(r, c, float)| {
            let n = r * c;
            if float {
                prop::collection::vec(-1e6f32..1e6, n)
                    .prop_map(move |values| Part::Float {
                        shape: vec![r, c],
                        values,
                    })
                    .boxed()
            } else {
                prop::collection::vec(any::<i64>(), n)
                    .prop_map(move |values| Part::Int {
                        shape: vec![r, c],
                        values,
                    })
                    .boxed()
            }
        })
    }

    proptest! {
        #[test]
        fn parts_round_trip(parts in prop::collection::vec(part(), 0..5)) {
            let mut bytes = Vec::new();
            Part::encode(&parts, &mut bytes);
            prop_assert_eq!(Part::decode(&bytes), Some(parts));
        }

        /// Bytes from the network: any input decodes or is refused, never panics, and a
        /// truncated or extended encoding is refused.
        #[test]
        fn decoding_arbitrary_bytes_never_panics(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
            let _ = Part::decode(&bytes);
        }

        #[test]
        fn truncated_encodings_are_refused(parts in prop::collection::vec(part(), 1..4), cut in 1usize..16) {
            let mut bytes = Vec::new();
            Part::encode(&parts, &mut bytes);
            let keep = bytes.len().saturating_sub(cut);
            prop_assert_eq!(Part::decode(&bytes[..keep]), None);
            bytes.push(0);
            prop_assert_eq!(Part::decode(&bytes), None);
        }
    }
}
