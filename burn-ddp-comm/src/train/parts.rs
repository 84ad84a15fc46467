//! A step's output item as host data ([`Part`]s), gathered from every rank to rank 0 and merged
//! there: the Burn-free half of each line's `DistributedItem`.

use crate::{DdpError, ProcessGroup, Rank, Result};

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
    /// Its shape.
    pub fn shape(&self) -> &[usize] {
        match self {
            Part::Float { shape, .. } | Part::Int { shape, .. } => shape,
        }
    }

    /// Rows in the first dimension (the batch size of a `[batch, ...]` tensor).
    pub fn rows(&self) -> usize {
        self.shape().first().copied().unwrap_or(1)
    }

    /// The float parts concatenated along the first dimension: the shape and the values.
    ///
    /// # Errors
    /// A part that is not a float tensor of `dims` dimensions, or whose trailing dimensions
    /// differ; no part.
    pub fn cat_floats(parts: &[&Part], dims: usize) -> Result<(Vec<usize>, Vec<f32>)> {
        cat(parts, dims, |p| match p {
            Part::Float { shape, values } => Some((shape, values)),
            Part::Int { .. } => None,
        })
    }

    /// The integer parts concatenated along the first dimension.
    ///
    /// # Errors
    /// As [`cat_floats`](Self::cat_floats), for integer tensors.
    pub fn cat_ints(parts: &[&Part], dims: usize) -> Result<(Vec<usize>, Vec<i64>)> {
        cat(parts, dims, |p| match p {
            Part::Int { shape, values } => Some((shape, values)),
            Part::Float { .. } => None,
        })
    }

    /// The mean of float parts (per-rank mean losses) weighted by `weights` (the ranks' batch
    /// sizes): the mean over the global batch.
    ///
    /// # Errors
    /// A part that is not a non-empty float tensor.
    pub fn weighted_mean_value(parts: &[&Part], weights: &[usize]) -> Result<f32> {
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
        Ok(if total == 0 {
            0.0
        } else {
            (sum / total as f64) as f32
        })
    }

    /// Every rank's `i`-th part.
    ///
    /// # Errors
    /// A rank's item has no part `i`.
    pub fn column(ranks: &[Vec<Part>], i: usize) -> Result<Vec<&Part>> {
        ranks
            .iter()
            .map(|r| {
                r.get(i)
                    .ok_or_else(|| mismatch(&format!("a rank's item has no part {i}")))
            })
            .collect()
    }

    /// Appends the encoding of `parts` to `out`.
    pub fn encode(parts: &[Part], out: &mut Vec<u8>) {
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
    pub fn decode(mut bytes: &[u8]) -> Option<Vec<Part>> {
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
    dims: usize,
    pick: impl for<'a> Fn(&'a Part) -> Option<Flat<'a, T>>,
) -> Result<(Vec<usize>, Vec<T>)> {
    let mut shape: Option<Vec<usize>> = None;
    let mut values = Vec::new();
    for p in parts {
        let (s, v) = pick(p).ok_or_else(|| mismatch("a part has the wrong kind (float/int)"))?;
        if s.len() != dims {
            return Err(mismatch(&format!(
                "a part has {} dimensions, expected {dims}",
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

/// An item that cannot be merged: what is wrong with it.
pub fn mismatch(what: &str) -> DdpError {
    DdpError::model_access(
        Rank(0),
        "merging the ranks' output items for the metrics",
        what.to_owned(),
    )
}

/// Gathers every rank's item parts (or their absence, `None`) and returns, on rank 0 (on every
/// rank when `everywhere`: a fault-tolerant job, where any rank may become rank 0), the parts
/// of every rank that had an item, in rank order; `None` on the other ranks and when no rank
/// had an item.
///
/// # Errors
/// The collective failed; a rank sent bytes that do not decode.
pub fn gather(
    pg: &ProcessGroup,
    parts: Option<Vec<Part>>,
    everywhere: bool,
) -> Result<Option<Vec<Vec<Part>>>> {
    let mut bytes = Vec::new();
    if let Some(parts) = parts {
        Part::encode(&parts, &mut bytes);
    }
    let all = pg.all_gather_bytes(&bytes)?;
    if pg.rank() != Rank(0) && !everywhere {
        return Ok(None);
    }
    let mut ranks = Vec::new();
    for (r, b) in all.iter().enumerate() {
        if b.is_empty() {
            continue;
        }
        let parts = Part::decode(b).ok_or_else(|| {
            DdpError::model_access(
                pg.rank(),
                "decoding an output item",
                format!("rank {r} sent {} malformed bytes", b.len()),
            )
        })?;
        ranks.push(parts);
    }
    Ok((!ranks.is_empty()).then_some(ranks))
}

/// [`gather`], and the parts merged into one item by `merge` (a line's
/// `DistributedItem::merge`) where they were gathered: the merged item on rank 0 (on every
/// rank when `everywhere`), `None` on the other ranks and when no rank had an item.
///
/// # Errors
/// As [`gather`]; what `merge` returns.
pub fn gather_merged<T>(
    pg: &ProcessGroup,
    parts: Option<Vec<Part>>,
    everywhere: bool,
    merge: impl FnOnce(Vec<Vec<Part>>) -> Result<T>,
) -> Result<Option<T>> {
    gather(pg, parts, everywhere)?.map(merge).transpose()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn parts_concatenate_along_the_batch_and_losses_average_over_it() {
        let a = Part::Float {
            shape: vec![2, 2],
            values: vec![1.0, 0.0, 0.0, 1.0],
        };
        let b = Part::Float {
            shape: vec![1, 2],
            values: vec![0.3, 0.7],
        };
        let (shape, values) = Part::cat_floats(&[&a, &b], 2).unwrap();
        assert_eq!(shape, [3, 2]);
        assert_eq!(values, [1.0, 0.0, 0.0, 1.0, 0.3, 0.7]);
        let la = Part::Float {
            shape: vec![1],
            values: vec![0.5],
        };
        let lb = Part::Float {
            shape: vec![1],
            values: vec![2.0],
        };
        // (0.5 * 2 + 2.0 * 1) / 3
        let mean = Part::weighted_mean_value(&[&la, &lb], &[2, 1]).unwrap();
        assert!((mean - 1.0).abs() < 1e-6, "{mean}");
        let ints = Part::Int {
            shape: vec![1, 2],
            values: vec![1, 2],
        };
        assert!(Part::cat_floats(&[&a, &ints], 2).is_err());
        assert!(Part::cat_floats(&[&a, &la], 2).is_err());
        assert!(Part::cat_floats(&[], 2).is_err());
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

        /// Bytes from the network: any input decodes or is refused, never panics.
        #[test]
        fn decoding_arbitrary_bytes_never_panics(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
            let _ = Part::decode(&bytes);
        }

        /// A truncated or extended encoding is refused.
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
