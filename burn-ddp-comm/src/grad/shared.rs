//! Gradient buckets in memory that the ranks of one host share (Note [Shared buckets]): the
//! host-staged transport packs each gradient straight into this rank's region of a shared
//! arena, and the bucket is all-reduced where it lies, with no copy into or out of the segment.

use std::ops::{Deref, DerefMut};
use std::sync::Arc;

use crate::comm::SharedArena;
use crate::group::ProcessGroup;
use crate::types::ReduceOp;
use crate::{DdpError, Result};

// Note [Shared buckets]
// ~~~~~~~~~~~~~~~~~~~~~
// When every rank of a group runs on one host and its collectives run in the shared segment
// (Note [Shared-memory collectives]), the host-staged transport asks the group, once per bucket
// plan, for an arena: the segment's memory file is extended by a region per rank (collective
// `Allocate`: place 0 extends it and says where, every rank maps the regions and says whether it
// could; all fall back to heap buckets alike when one could not). Each pass's buckets are then
// laid out in this rank's region, 64-byte aligned, in bucket order: the same offsets on every
// rank, since the plan is the same.
//
// A bucket's all-reduce (collective `AllReduceShared`) runs where the buckets lie: a sync (every
// rank packed its bucket), then each rank reduces its part of every chunk (the same chunks and
// parts as the copying all-reduce, so the same bits) reading the other ranks' regions directly,
// and writes the result into every rank's region; a sync (every part is everywhere). Only the
// part's reducer touches a part during the collective, and nobody touches another rank's region
// outside one, so the owner packs and reads its buckets freely between collectives. Against the
// copying all-reduce this saves the copy of the bucket into the segment and the copy of the
// results out of it (2(n-1)/n of the bucket each, per rank).
//
// Regions are reused pass after pass (zeroed at the start of each); a new plan that does not fit
// gets a new arena, and each rank gives its region of the old one back to the system when it
// drops it (a hole punched in the memory file). A pass's buffers must be dropped before the next
// pass asks for its own (a lease says so).

/// A gradient bucket's values: on the heap, or in this rank's region of an arena shared with
/// the other ranks of its host (Note [Shared buckets]).
pub struct BucketBuf(Buf);

enum Buf {
    Heap(Vec<f32>),
    Shared(SharedBucket),
}

/// A bucket in an arena: bytes `at..at + 4 * len` of this rank's region.
struct SharedBucket {
    arena: Arc<SharedArena>,
    at: usize,
    len: usize,
    /// Held while the bucket lives (see [`SharedBuckets::buffers`]).
    _lease: Arc<()>,
}

impl std::fmt::Debug for BucketBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.0 {
            Buf::Heap(v) => f.debug_tuple("Heap").field(&v.len()).finish(),
            Buf::Shared(s) => f
                .debug_struct("Shared")
                .field("at", &s.at)
                .field("len", &s.len)
                .finish(),
        }
    }
}

impl From<Vec<f32>> for BucketBuf {
    fn from(v: Vec<f32>) -> Self {
        Self(Buf::Heap(v))
    }
}

impl Deref for BucketBuf {
    type Target = [f32];

    fn deref(&self) -> &[f32] {
        match &self.0 {
            Buf::Heap(v) => v,
            // SAFETY: this rank's region; the other ranks touch it only during a shared
            // all-reduce of this bucket, which takes the bucket by `&mut` (so no borrow of it
            // lives meanwhile). `at` is 64-byte aligned and the bucket inside the region.
            Buf::Shared(s) => unsafe {
                std::slice::from_raw_parts(s.arena.region(s.arena.place()).add(s.at).cast(), s.len)
            },
        }
    }
}

impl DerefMut for BucketBuf {
    fn deref_mut(&mut self) -> &mut [f32] {
        match &mut self.0 {
            Buf::Heap(v) => v,
            // SAFETY: as for `deref`; `&mut self` makes this the only borrow in this process.
            Buf::Shared(s) => unsafe {
                std::slice::from_raw_parts_mut(
                    s.arena.region(s.arena.place()).add(s.at).cast(),
                    s.len,
                )
            },
        }
    }
}

impl BucketBuf {
    /// Whether the values lie in memory shared with the other ranks of the host.
    pub fn is_shared(&self) -> bool {
        matches!(self.0, Buf::Shared(_))
    }

    /// The first `len` values, owned: the heap buffer itself (truncated, no copy), or a copy of
    /// a shared bucket's.
    pub fn into_vec(self, len: usize) -> Vec<f32> {
        match self.0 {
            Buf::Heap(mut v) => {
                v.truncate(len);
                v
            }
            Buf::Shared(_) => self[..len.min(self.len())].to_vec(),
        }
    }

    /// Zeroed heap buckets of `lens` values each, reusing buffers of `spare` large enough
    /// (those taken leave it).
    pub fn on_heap(lens: &[usize], spare: &mut Vec<Vec<f32>>) -> Vec<BucketBuf> {
        lens.iter()
            .map(|&len| {
                let mut v = spare
                    .iter()
                    .position(|s| s.capacity() >= len)
                    .map(|i| spare.swap_remove(i))
                    .unwrap_or_default();
                v.clear();
                v.resize(len, 0.0);
                v.into()
            })
            .collect()
    }

    /// The heap buffer, to reuse; `None` for a shared bucket (which goes back to its arena).
    pub fn into_heap(self) -> Option<Vec<f32>> {
        match self.0 {
            Buf::Heap(v) => Some(v),
            Buf::Shared(_) => None,
        }
    }

    /// All-reduces the bucket with `op` across `pg`: where it lies when it is shared (the
    /// group's shared all-reduce), as any buffer otherwise.
    ///
    /// # Errors
    /// As [`ProcessGroup::all_reduce`].
    pub(crate) fn all_reduce(&mut self, pg: &ProcessGroup, op: ReduceOp) -> Result<()> {
        if let Buf::Shared(s) = &self.0 {
            return pg.all_reduce_shared::<f32>(&s.arena, s.at..s.at + 4 * s.len, op);
        }
        pg.all_reduce(&mut self[..], op)
    }
}

/// Where a `HostComm`'s buckets go: an arena shared by the ranks of the host, when the group
/// has one and the configuration allows it (Note [Shared buckets]).
#[derive(Debug)]
pub(crate) struct SharedBuckets {
    /// Shared buckets are wanted (the configuration, and a hook that is a plain all-reduce).
    wanted: bool,
    arena: Option<Arc<SharedArena>>,
    /// Cloned into every bucket handed out; alone when none lives.
    lease: Arc<()>,
}

/// Alignment of a bucket in its region.
const ALIGN: usize = 64;

/// Offsets (bytes) of buckets of `lens` f32s laid out one after another, and the bytes they take.
fn layout(lens: &[usize]) -> (Vec<usize>, usize) {
    let mut at = 0;
    let offsets = lens
        .iter()
        .map(|&l| {
            let here = at;
            at += (4 * l).next_multiple_of(ALIGN);
            here
        })
        .collect();
    (offsets, at)
}

impl SharedBuckets {
    pub(crate) fn new(wanted: bool) -> Self {
        Self {
            wanted,
            arena: None,
            lease: Arc::new(()),
        }
    }

    /// Zeroed buckets of `lens` f32s in this rank's region of the arena (a collective when the
    /// arena must be allocated: call it at the same point on every rank), or `None` when they
    /// stay on the heap.
    ///
    /// # Errors
    /// The group's failure while allocating; an internal error when buckets handed out by the
    /// last call still live.
    pub(crate) fn buffers(
        &mut self,
        pg: &ProcessGroup,
        lens: &[usize],
    ) -> Result<Option<Vec<BucketBuf>>> {
        if !self.wanted || pg.world_size().get() == 1 {
            return Ok(None);
        }
        if Arc::strong_count(&self.lease) > 1 {
            return Err(DdpError::Internal {
                rank: pg.rank(),
                what: "shared gradient buckets were asked for while the last pass's still live",
            });
        }
        let (offsets, bytes) = layout(lens);
        let arena = match &self.arena {
            Some(a) if a.len() >= bytes => Arc::clone(a),
            _ => {
                // Room for a plan of the same parameters in other buckets (alignment only).
                match pg.allocate_shared(bytes + bytes / 64 + (64 << 10))? {
                    Some(a) => {
                        tracing::debug!(
                            "[rank {}] gradient buckets in shared memory: {} KiB per rank",
                            pg.rank(),
                            a.len() >> 10
                        );
                        Arc::clone(self.arena.insert(a))
                    }
                    None => {
                        // Every rank got the same answer: heap buckets from now on.
                        self.wanted = false;
                        return Ok(None);
                    }
                }
            }
        };
        let buckets = offsets
            .into_iter()
            .zip(lens)
            .map(|(at, &len)| {
                let mut b = BucketBuf(Buf::Shared(SharedBucket {
                    arena: Arc::clone(&arena),
                    at,
                    len,
                    _lease: Arc::clone(&self.lease),
                }));
                b.fill(0.0);
                b
            })
            .collect();
        Ok(Some(buckets))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_aligned_one_after_another() {
        let (at, bytes) = layout(&[1, 16, 17, 0, 3]);
        assert_eq!(at, vec![0, 64, 128, 256, 256]);
        assert_eq!(bytes, 320);
    }

    #[test]
    fn heap_buckets_give_their_buffer_back_without_a_copy() {
        let v = vec![1.0f32, 2.0, 3.0];
        let p = v.as_ptr();
        let b = BucketBuf::from(v);
        assert!(!b.is_shared());
        let out = b.into_vec(2);
        assert_eq!((out.as_slice(), out.as_ptr()), (&[1.0, 2.0][..], p));
    }
}
