//! Identities of the processes in a job: [`Rank`], [`WorldSize`], [`LocalRank`], [`CollectiveSeq`].
//!
//! Conversions go through `TryFrom`, never `as`, so a negative or oversized value read from the
//! environment is an error instead of a silently wrapped number.

use std::fmt;
use std::num::NonZeroU32;

/// The global index of a process in the job, `0..world_size`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Rank(pub u32);

impl Rank {
    /// Rank 0, which hosts the rendezvous store and is the source of the initial broadcast.
    pub const ZERO: Rank = Rank(0);

    /// The rank as an index into per-rank arrays.
    pub fn index(self) -> usize {
        self.0 as usize
    }

    /// Whether this is rank 0.
    pub fn is_zero(self) -> bool {
        self.0 == 0
    }
}

impl fmt::Display for Rank {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

impl TryFrom<usize> for Rank {
    type Error = std::num::TryFromIntError;
    fn try_from(value: usize) -> Result<Self, Self::Error> {
        u32::try_from(value).map(Rank)
    }
}

/// The number of processes in the job (never zero).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct WorldSize(pub NonZeroU32);

impl WorldSize {
    /// A world of one process: every collective is a no-op.
    pub const ONE: WorldSize = WorldSize(NonZeroU32::MIN);

    /// Builds a world size, `None` for zero.
    pub fn new(n: u32) -> Option<Self> {
        NonZeroU32::new(n).map(WorldSize)
    }

    /// The number of processes.
    pub fn get(self) -> u32 {
        self.0.get()
    }

    /// The number of processes as a `usize`.
    pub fn as_usize(self) -> usize {
        self.0.get() as usize
    }

    /// Whether `rank` belongs to this world.
    pub fn contains(self, rank: Rank) -> bool {
        rank.0 < self.0.get()
    }

    /// All ranks of this world, in order.
    pub fn ranks(self) -> impl Iterator<Item = Rank> {
        (0..self.0.get()).map(Rank)
    }
}

impl fmt::Display for WorldSize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

impl TryFrom<usize> for WorldSize {
    type Error = &'static str;
    fn try_from(value: usize) -> Result<Self, Self::Error> {
        let n = u32::try_from(value).map_err(|_| "world size does not fit in 32 bits")?;
        WorldSize::new(n).ok_or("world size must be at least 1")
    }
}

/// The index of a process among the processes of its node (`LOCAL_RANK`); selects the GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct LocalRank(pub u32);

impl fmt::Display for LocalRank {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// The sequence number of a collective within a group: the n-th collective every rank calls.
///
/// Every rank must issue collectives in the same order; the sequence number travels with each
/// collective on the wire so that a rank that skipped or reordered one is reported, not hung.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct CollectiveSeq(pub u64);

impl fmt::Display for CollectiveSeq {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "#{}", self.0)
    }
}

/// A list of ranks, displayed as `[1, 3]`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RankList(pub Vec<Rank>);

impl fmt::Display for RankList {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "[")?;
        for (i, r) in self.0.iter().enumerate() {
            if i > 0 {
                write!(f, ", ")?;
            }
            write!(f, "{r}")?;
        }
        write!(f, "]")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn world_size_rejects_zero_and_overflow() {
        assert!(WorldSize::try_from(0usize).is_err());
        assert!(WorldSize::try_from(usize::MAX).is_err());
        assert_eq!(WorldSize::try_from(3usize).unwrap().get(), 3);
    }

    #[test]
    fn world_contains_only_its_ranks() {
        let w = WorldSize::new(2).unwrap();
        assert!(w.contains(Rank(1)));
        assert!(!w.contains(Rank(2)));
        assert_eq!(w.ranks().collect::<Vec<_>>(), vec![Rank(0), Rank(1)]);
    }

    #[test]
    fn rank_list_display() {
        assert_eq!(RankList(vec![Rank(1), Rank(3)]).to_string(), "[1, 3]");
        assert_eq!(RankList(vec![]).to_string(), "[]");
    }
}
