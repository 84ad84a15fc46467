//! Sharding a dataset over the ranks of a job, without Burn: [`ShardPlan`] says which items of
//! a dataset of `n` items are this rank's in an epoch. Each Burn line wraps it in its own
//! `DistributedSampler`, a Burn `Dataset`, whose methods come from
//! [`distributed_sampler_api!`](crate::distributed_sampler_api).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use crate::group::ProcessGroup;
use crate::types::{Rank, WorldSize};
use crate::{DdpError, Result};

/// This rank's share of a dataset, reshuffled every epoch — the logic of PyTorch's
/// `DistributedSampler`.
///
/// Every epoch the indices `0..n` are permuted with a generator seeded by `(seed, epoch)` (or
/// left in order with [`with_shuffle(false)`](Self::with_shuffle)), made a multiple of the world
/// size, and dealt out with a stride: rank `r` gets positions `r, r + W, r + 2W, ...`. So every
/// rank computes the same permutation without communicating, shards are disjoint, and every rank
/// has the same number of items, hence of batches — no rank waits in a collective for a batch
/// another rank never has.
///
/// Making the length a multiple of `W`: by default the permutation is padded with its own first
/// items (PyTorch's default; a few items are seen twice per epoch); with
/// [`with_drop_last(true)`](Self::with_drop_last) the tail is dropped instead (a few items are
/// skipped this epoch, different ones each epoch when shuffling).
///
/// ```
/// use burn_ddp_comm::data::ShardPlan;
/// use burn_ddp_comm::{Rank, WorldSize};
///
/// let plan = ShardPlan::with_replicas(Rank(1), WorldSize::new(3).unwrap())?.with_seed(42);
/// plan.set_epoch(3);
/// assert_eq!(plan.len(10), 4); // ceil(10 / 3): padded
/// assert!(plan.index(10, 3).is_some());
/// # Ok::<(), burn_ddp_comm::DdpError>(())
/// ```
#[derive(Debug)]
pub struct ShardPlan {
    rank: u32,
    world: u32,
    seed: u64,
    shuffle: bool,
    drop_last: bool,
    even: bool,
    epoch: AtomicU64,
    cache: Mutex<Option<Cached>>,
}

/// This rank's indices, and the epoch and dataset length they were computed for.
#[derive(Debug)]
struct Cached {
    epoch: u64,
    n: usize,
    indices: Arc<[usize]>,
}

impl ShardPlan {
    /// The share of this process's rank in `group`. Defaults as PyTorch: shuffled, seed 0,
    /// padded (not `drop_last`), epoch 0.
    pub fn new(group: &ProcessGroup) -> Self {
        Self::build(group.rank().0, group.world_size().get())
    }

    /// The share of this process's rank for validation or evaluation: every item exactly once
    /// over all ranks, in order (no shuffle, shards that differ by at most one item).
    pub fn evaluation(group: &ProcessGroup) -> Self {
        Self::new(group).with_shuffle(false).with_even_shards(false)
    }

    /// The share of `rank` in a world of `world` ranks (PyTorch's `num_replicas`, `rank`).
    ///
    /// # Errors
    /// `RankOutOfRange` if `rank` is not below `world`.
    pub fn with_replicas(rank: Rank, world: WorldSize) -> Result<Self> {
        if rank.0 >= world.get() {
            return Err(DdpError::RankOutOfRange { rank, world });
        }
        Ok(Self::build(rank.0, world.get()))
    }

    fn build(rank: u32, world: u32) -> Self {
        Self {
            rank,
            world,
            seed: 0,
            shuffle: true,
            drop_last: false,
            even: true,
            epoch: AtomicU64::new(0),
            cache: Mutex::new(None),
        }
    }

    /// The seed of the shuffle; must be the same on every rank.
    pub fn with_seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self.invalidate();
        self
    }

    /// Whether to permute the indices every epoch (default `true`).
    pub fn with_shuffle(mut self, shuffle: bool) -> Self {
        self.shuffle = shuffle;
        self.invalidate();
        self
    }

    /// Drop the tail instead of padding to a multiple of the world size (default `false`).
    pub fn with_drop_last(mut self, drop_last: bool) -> Self {
        self.drop_last = drop_last;
        self.invalidate();
        self
    }

    /// Whether every rank gets the same number of items (default `true`, by padding or
    /// dropping). With `false`, every item is dealt exactly once and shards differ in length by
    /// at most one: for validation, whose metrics should count every item once. Training needs
    /// even shards, since every step is a collective.
    pub fn with_even_shards(mut self, even: bool) -> Self {
        self.even = even;
        self.invalidate();
        self
    }

    /// Sets the epoch, which selects the permutation. Same value on every rank.
    pub fn set_epoch(&self, epoch: u64) {
        self.epoch.store(epoch, Ordering::Relaxed);
    }

    /// The current epoch.
    pub fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::Relaxed)
    }

    fn invalidate(&mut self) {
        *self.cache.get_mut().unwrap_or_else(|p| p.into_inner()) = None;
    }

    /// Items of this rank's share of a dataset of `n` items.
    pub fn len(&self, n: usize) -> usize {
        let w = self.world as usize;
        if !self.even {
            n.saturating_sub(self.rank as usize).div_ceil(w)
        } else if self.drop_last {
            n / w
        } else {
            n.div_ceil(w)
        }
    }

    /// Whether this rank's share of a dataset of `n` items is empty.
    pub fn is_empty(&self, n: usize) -> bool {
        self.len(n) == 0
    }

    /// The dataset index of this rank's item `i` in the current epoch.
    pub fn index(&self, n: usize, i: usize) -> Option<usize> {
        self.indices(n).get(i).copied()
    }

    /// Whether this rank's item `i` is padding (a repeat added to even out the shards), for
    /// evaluations that must count every item once.
    pub fn is_padding(&self, n: usize, i: usize) -> bool {
        self.rank as usize + i * self.world as usize >= n
    }

    /// This rank's indices into a dataset of `n` items for the current epoch, in order.
    pub fn indices(&self, n: usize) -> Arc<[usize]> {
        let epoch = self.epoch();
        let mut cache = self.cache.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(c) = cache.as_ref() {
            if c.epoch == epoch && c.n == n {
                return Arc::clone(&c.indices);
            }
        }
        let idx: Arc<[usize]> = shard(
            n,
            self.rank as usize,
            self.world as usize,
            self.shuffle.then_some((self.seed, epoch)),
            if self.even {
                Tail::Even {
                    drop_last: self.drop_last,
                }
            } else {
                Tail::Uneven
            },
        )
        .into();
        *cache = Some(Cached {
            epoch,
            n,
            indices: Arc::clone(&idx),
        });
        idx
    }
}

/// The methods of a Burn line's `DistributedSampler<D>` (a struct with fields `dataset: D` and
/// `plan: ShardPlan`): constructors, builders, epoch and indices, delegated to the plan, so that
/// both lines offer the same API from one definition. `$dataset` is that line's `Dataset` trait.
/// Use it inside `impl<D> DistributedSampler<D> { ... }`.
#[macro_export]
macro_rules! distributed_sampler_api {
    ($dataset:path) => {
        /// The share of `dataset` of this process's rank in `group`. Defaults as PyTorch:
        /// shuffled, seed 0, padded (not `drop_last`), epoch 0.
        pub fn new(dataset: D, group: &$crate::ProcessGroup) -> Self {
            Self {
                dataset,
                plan: $crate::data::ShardPlan::new(group),
            }
        }

        /// The share of `dataset` of this process's rank for validation or evaluation: every
        /// item exactly once over all ranks, in order (no shuffle, shards that differ by at most
        /// one item). The same as `new(..).with_shuffle(false).with_even_shards(false)`; its
        /// epoch never matters, so a training strategy need not set it.
        pub fn evaluation(dataset: D, group: &$crate::ProcessGroup) -> Self {
            Self {
                dataset,
                plan: $crate::data::ShardPlan::evaluation(group),
            }
        }

        /// The share of `rank` in a world of `world` ranks (PyTorch's `num_replicas`, `rank`).
        ///
        /// # Errors
        /// `RankOutOfRange` if `rank` is not below `world`.
        pub fn with_replicas(
            dataset: D,
            rank: $crate::Rank,
            world: $crate::WorldSize,
        ) -> $crate::Result<Self> {
            Ok(Self {
                dataset,
                plan: $crate::data::ShardPlan::with_replicas(rank, world)?,
            })
        }

        /// The seed of the shuffle; must be the same on every rank.
        pub fn with_seed(mut self, seed: u64) -> Self {
            self.plan = self.plan.with_seed(seed);
            self
        }

        /// Whether to permute the indices every epoch (default `true`). Validation sets usually
        /// don't.
        pub fn with_shuffle(mut self, shuffle: bool) -> Self {
            self.plan = self.plan.with_shuffle(shuffle);
            self
        }

        /// Drop the tail instead of padding to a multiple of the world size (default `false`).
        pub fn with_drop_last(mut self, drop_last: bool) -> Self {
            self.plan = self.plan.with_drop_last(drop_last);
            self
        }

        /// Whether every rank gets the same number of items (default `true`, by padding or
        /// dropping as `with_drop_last` says). With `false`, every item is dealt exactly once
        /// and shards differ in length by at most one: for validation, whose metrics should
        /// count every item once (the training strategy goes on while any rank has a batch).
        /// Training needs even shards, since every step is a collective.
        pub fn with_even_shards(mut self, even: bool) -> Self {
            self.plan = self.plan.with_even_shards(even);
            self
        }

        /// Sets the epoch, which selects the permutation. Same value on every rank.
        pub fn set_epoch(&self, epoch: u64) {
            self.plan.set_epoch(epoch);
        }

        /// The current epoch.
        pub fn epoch(&self) -> u64 {
            self.plan.epoch()
        }

        /// How items are dealt to this rank.
        pub fn plan(&self) -> &$crate::data::ShardPlan {
            &self.plan
        }

        /// The wrapped dataset.
        pub fn inner(&self) -> &D {
            &self.dataset
        }

        /// This rank's indices into the wrapped dataset for the current epoch, in order.
        pub fn indices<I>(&self) -> ::std::sync::Arc<[usize]>
        where
            D: $dataset,
        {
            self.plan.indices(self.dataset.len())
        }

        /// Whether this rank's item `index` is padding (a repeat added to even out the shards),
        /// for evaluations that must count every item once.
        pub fn is_padding<I>(&self, index: usize) -> bool
        where
            D: $dataset,
        {
            self.plan.is_padding(self.dataset.len(), index)
        }
    };
}

/// How the end of the permutation is dealt.
#[derive(Debug, Clone, Copy)]
enum Tail {
    /// Same count on every rank: drop the tail, or pad with the first items.
    Even { drop_last: bool },
    /// Every item once; the first `n % world` ranks get one more.
    Uneven,
}

/// Something whose contents depend on the epoch (a `DistributedSampler`), for a training
/// strategy to set at the start of every epoch.
pub trait DataEpoch: Send + Sync {
    /// Selects the epoch (the same value on every rank).
    fn set_epoch(&self, epoch: u64);
}

impl DataEpoch for ShardPlan {
    fn set_epoch(&self, epoch: u64) {
        ShardPlan::set_epoch(self, epoch);
    }
}

/// Rank `rank`'s indices among `0..n` in a world of `world`, shuffled with `(seed, epoch)` if
/// given.
fn shard(
    n: usize,
    rank: usize,
    world: usize,
    shuffle: Option<(u64, u64)>,
    tail: Tail,
) -> Vec<usize> {
    let mut order: Vec<usize> = (0..n).collect();
    if let Some((seed, epoch)) = shuffle {
        permute(&mut order, seed, epoch);
    }
    let total = match tail {
        Tail::Uneven => n,
        Tail::Even { drop_last: true } => n / world * world,
        Tail::Even { drop_last: false } => n.div_ceil(world) * world,
    };
    // Padding repeats the permutation from its start (cycling when n < world).
    (rank..total).step_by(world).map(|i| order[i % n]).collect()
}

/// Fisher–Yates with SplitMix64: a generator with a fixed definition, so that every rank (and
/// every build, on any machine) derives the same permutation from `(seed, epoch)`.
fn permute(v: &mut [usize], seed: u64, epoch: u64) {
    let mut state = seed ^ epoch.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0xD1B5_4A32_D192_ED03;
    let mut next = || {
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    };
    for i in (1..v.len()).rev() {
        // Lemire's multiply-shift: an index in 0..=i without modulo bias worth measuring.
        let j = ((u128::from(next()) * (i as u128 + 1)) >> 64) as usize;
        v.swap(i, j);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A plan over a dataset of `n` items, as a sampler sees it.
    struct Sampler {
        plan: ShardPlan,
        n: usize,
    }

    impl Sampler {
        fn len(&self) -> usize {
            self.plan.len(self.n)
        }
        fn get(&self, i: usize) -> Option<usize> {
            self.plan.index(self.n, i)
        }
        fn set_epoch(&self, epoch: u64) {
            self.plan.set_epoch(epoch);
        }
        fn with_even_shards(self, even: bool) -> Self {
            Self {
                plan: self.plan.with_even_shards(even),
                ..self
            }
        }
        fn with_shuffle(self, shuffle: bool) -> Self {
            Self {
                plan: self.plan.with_shuffle(shuffle),
                ..self
            }
        }
    }

    fn samplers(n: usize, world: u32, seed: u64, drop_last: bool) -> Vec<Sampler> {
        let w = WorldSize::new(world).unwrap();
        (0..world)
            .map(|r| Sampler {
                plan: ShardPlan::with_replicas(Rank(r), w)
                    .unwrap()
                    .with_seed(seed)
                    .with_drop_last(drop_last),
                n,
            })
            .collect()
    }

    fn items(s: &Sampler) -> Vec<usize> {
        (0..s.len()).map(|i| s.get(i).unwrap()).collect()
    }

    proptest! {
        #[test]
        fn shards_are_equal_sized_disjoint_and_complete(
            n in 0usize..300, world in 1u32..9, seed in any::<u64>(), epoch in 0u64..1000,
            drop_last in any::<bool>(),
        ) {
            let ss = samplers(n, world, seed, drop_last);
            ss.iter().for_each(|s| s.set_epoch(epoch));
            let w = world as usize;
            let per = if drop_last { n / w } else { n.div_ceil(w) };
            let mut count = vec![0usize; n];
            for s in &ss {
                prop_assert_eq!(s.len(), per);
                let it = items(s);
                prop_assert_eq!(it.len(), per);
                prop_assert_eq!(s.get(per), None);
                for i in it {
                    count[i] += 1;
                }
            }
            if drop_last {
                // Disjoint: nobody appears twice; exactly n - n % w items are used.
                prop_assert!(count.iter().all(|&c| c <= 1));
                prop_assert_eq!(count.iter().sum::<usize>(), per * w);
            } else {
                // Complete: everyone appears; only the padding (fewer than w items, or the
                // cycling of a dataset smaller than the world) appears again.
                prop_assert!(count.iter().all(|&c| c >= 1));
                prop_assert_eq!(count.iter().sum::<usize>(), per * w);
                if n >= w {
                    prop_assert!(count.iter().all(|&c| c <= 2));
                    prop_assert_eq!(count.iter().filter(|&&c| c == 2).count(), per * w - n);
                }
            }
        }

        #[test]
        fn uneven_shards_deal_every_item_exactly_once(
            n in 0usize..300, world in 1u32..9, seed in any::<u64>(), epoch in 0u64..1000,
            shuffle in any::<bool>(),
        ) {
            let ss: Vec<_> = samplers(n, world, seed, false)
                .into_iter()
                .map(|s| s.with_even_shards(false).with_shuffle(shuffle))
                .collect();
            let mut count = vec![0usize; n];
            let lens: Vec<usize> = ss.iter().map(|s| { s.set_epoch(epoch); s.len() }).collect();
            for s in &ss {
                let it = items(s);
                prop_assert_eq!(it.len(), s.len());
                prop_assert_eq!(s.get(s.len()), None);
                for i in it {
                    count[i] += 1;
                }
            }
            prop_assert!(count.iter().all(|&c| c == 1));
            // Rank 0 has the most; no two ranks differ by more than one item.
            prop_assert!(lens.windows(2).all(|p| p[0] >= p[1] && p[0] - p[1] <= 1));
            prop_assert!(lens.first().is_none_or(|&l0| lens.iter().all(|&l| l0 - l <= 1)));
        }

        #[test]
        fn same_seed_and_epoch_give_the_same_shard_anywhere(
            n in 1usize..300, world in 1u32..9, seed in any::<u64>(), epoch in any::<u64>(),
        ) {
            // Two independent instances (two processes, two builds) agree.
            let a = samplers(n, world, seed, false);
            let b = samplers(n, world, seed, false);
            for (x, y) in a.iter().zip(&b) {
                x.set_epoch(epoch);
                y.set_epoch(epoch);
                prop_assert_eq!(items(x), items(y));
            }
        }

        #[test]
        fn every_epoch_reshuffles(n in 20usize..300, world in 1u32..5, seed in any::<u64>(), epoch in 0u64..1_000_000) {
            let ss = samplers(n, world, seed, true);
            let s = &ss[0];
            s.set_epoch(epoch);
            let first = items(s);
            s.set_epoch(epoch + 1);
            prop_assert_ne!(first, items(s));
        }
    }

    #[test]
    fn without_shuffle_shards_are_strided() {
        let w = WorldSize::new(3).unwrap();
        let plan = ShardPlan::with_replicas(Rank(1), w)
            .unwrap()
            .with_shuffle(false);
        assert_eq!(&*plan.indices(8), &[1, 4, 7]);
        let plan = ShardPlan::with_replicas(Rank(2), w)
            .unwrap()
            .with_shuffle(false);
        // Padded with the first item, which is padding.
        assert_eq!(&*plan.indices(8), &[2, 5, 0]);
        assert!(plan.is_padding(8, 2) && !plan.is_padding(8, 1));
    }

    #[test]
    fn a_rank_outside_the_world_is_an_error() {
        let w = WorldSize::new(2).unwrap();
        let Err(err) = ShardPlan::with_replicas(Rank(2), w) else {
            panic!("rank 2 of 2 was accepted");
        };
        assert!(matches!(err, DdpError::RankOutOfRange { .. }), "{err}");
    }

    #[test]
    fn the_permutation_is_fixed_forever() {
        // SplitMix64-based Fisher–Yates: these values must never change, or resumed multi-node
        // jobs built at different times would disagree about their shards.
        let mut v: Vec<usize> = (0..10).collect();
        permute(&mut v, 42, 3);
        assert_eq!(v, PERMUTATION_42_3);
    }

    // Computed independently from the SplitMix64 and Lemire definitions (a short Python script).
    const PERMUTATION_42_3: [usize; 10] = [8, 2, 0, 4, 6, 3, 7, 5, 1, 9];
}
