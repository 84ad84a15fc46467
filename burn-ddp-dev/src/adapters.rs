//! The adapters' part of the conformance suite: what every line's `DistributedSampler` (its
//! `Dataset` impl over the core's `ShardPlan`) and `DistributedItem` (Burn's outputs as the
//! core's parts and back) must give, checked here once. A line's unit test hands each check a
//! closure that does the one thing in its release's API.

use burn_ddp_comm::data::ShardPlan;
use burn_ddp_comm::{Rank, WorldSize};

/// A shard asked of a line's sampler: the dataset's items, the rank, the world, and the seed
/// and epoch of the shuffle (`None`: not shuffled).
#[derive(Debug, Clone)]
pub struct ShardAsk {
    /// The dataset's items (`0..n` shifted, so that an item differs from its index).
    pub data: Vec<u32>,
    /// This rank.
    pub rank: Rank,
    /// The world.
    pub world: WorldSize,
    /// Seed and epoch of the shuffle; `None` for an unshuffled sampler.
    pub shuffle: Option<(u64, u64)>,
}

impl ShardAsk {
    /// The epoch (0 when there is no shuffle).
    pub fn epoch(&self) -> u64 {
        self.shuffle.map_or(0, |(_, epoch)| epoch)
    }

    /// The core's plan of this shard (for a sampler's `with_plan`), at its epoch.
    ///
    /// # Panics
    /// A rank not below the world (the check never asks one).
    pub fn plan(&self) -> ShardPlan {
        let plan = ShardPlan::with_replicas(self.rank, self.world).unwrap();
        let plan = match self.shuffle {
            Some((seed, _)) => plan.with_seed(seed),
            None => plan.with_shuffle(false),
        };
        plan.set_epoch(self.epoch());
        plan
    }
}

/// What a sampler of `len` items gives, read through `get` (`None` for nothing).
pub fn dealt(len: usize, get: impl Fn(usize) -> Option<u32>) -> Dealt {
    Dealt {
        items: (0..len)
            .map(|i| get(i).expect("an item within the shard"))
            .collect(),
        past_end_refused: get(len).is_none(),
    }
}

/// What the sampler's `Dataset` gave: each of its items by index, then whether the index just
/// past its end was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Dealt {
    /// `get(0..len)`.
    pub items: Vec<u32>,
    /// `get(len)` found nothing (an error or `None`).
    pub past_end_refused: bool,
}

/// Checks a line's sampler: for shuffled and unshuffled shards of several worlds, its items
/// are the dataset's items at the core plan's indices, in order, padded as the plan pads, and
/// nothing is given past the end.
///
/// # Panics
/// The first shard that differs, with the ask.
pub fn sampler_deals_the_plans_items(sample: impl Fn(ShardAsk) -> Dealt) {
    let data: Vec<u32> = (10..47).collect();
    for world in 1..=4 {
        let w = WorldSize::new(world).unwrap();
        for rank in 0..world {
            for shuffle in [None, Some((9, 5))] {
                let ask = ShardAsk {
                    data: data.clone(),
                    rank: Rank(rank),
                    world: w,
                    shuffle,
                };
                let indices = ask.plan().indices(data.len());
                let want = Dealt {
                    items: indices.iter().map(|&i| data[i]).collect(),
                    past_end_refused: true,
                };
                assert_eq!(sample(ask.clone()), want, "{ask:?}");
            }
        }
    }
    // A shard padded with the first item: 8 items over 3 ranks, rank 2 gets 2, 5 and 0.
    let w = WorldSize::new(3).unwrap();
    let ask = ShardAsk {
        data: (10..18).collect(),
        rank: Rank(2),
        world: w,
        shuffle: None,
    };
    assert_eq!(sample(ask).items, [12, 15, 10]);
}

/// One rank's classification output: its mean loss, its output rows (two classes), its
/// targets.
pub type Classified = (f32, Vec<[f32; 2]>, Vec<i64>);

/// What a merged classification output holds: its loss, the dimensions of its output, its
/// targets.
pub type MergedClassified = (f32, [usize; 2], Vec<i64>);

/// Checks a line's `DistributedItem` for Burn's classification output: two ranks' outputs
/// (`merge` builds each as the release's `ClassificationOutput`, takes it apart into parts
/// and merges the parts) become one output over the global batch, with the loss averaged
/// over every example.
///
/// # Panics
/// A merged output other than the global batch's.
pub fn classification_outputs_merge_into_the_global_batch(
    merge: impl Fn(Vec<Classified>) -> MergedClassified,
) {
    let (loss, dims, targets) = merge(vec![
        (0.5, vec![[1.0, 0.0], [0.0, 1.0]], vec![0, 1]),
        (2.0, vec![[0.3, 0.7]], vec![0]),
    ]);
    assert_eq!(dims, [3, 2]);
    assert_eq!(targets, [0, 1, 0]);
    // (0.5 * 2 + 2.0 * 1) / 3
    assert!((loss - 1.0).abs() < 1e-6, "{loss}");
}
