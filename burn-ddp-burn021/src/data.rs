//! Sharding a Burn dataset over the ranks of a job: [`DistributedSampler`] (the dealing itself
//! is burn-ddp-comm's `ShardPlan`, shared with the Burn 0.22 line).

use burn::data::dataset::Dataset;
pub use burn_ddp_comm::data::DataEpoch;

burn_ddp_comm::distributed_sampler! {
    /// This rank's share of a dataset, reshuffled every epoch — PyTorch's `DistributedSampler`,
    /// as a Burn [`Dataset`] that wraps another.
    ///
    /// Every epoch the indices `0..len` are permuted with a generator seeded by `(seed, epoch)` (or
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
    /// Call [`set_epoch`](Self::set_epoch) at the start of every epoch, as in PyTorch, or the same
    /// order repeats. Burn's data loaders share the dataset through an `Arc`, so `set_epoch` takes
    /// `&self`.
    ///
    /// ```
    /// # extern crate burn_ddp_burn021 as burn_ddp;
    /// use burn::data::dataset::{Dataset, InMemDataset};
    /// use burn_ddp::{DistributedSampler, Rank, WorldSize};
    ///
    /// let data = InMemDataset::new((0..10).collect::<Vec<u32>>());
    /// let world = WorldSize::new(3).unwrap();
    /// let shard = DistributedSampler::with_replicas(data, Rank(1), world)?.with_seed(42);
    /// shard.set_epoch(3);
    /// assert_eq!(shard.len(), 4); // ceil(10 / 3): padded
    /// # Ok::<(), burn_ddp::DdpError>(())
    /// ```
    pub struct DistributedSampler<D>; dataset: Dataset<I>
}

impl<D: Dataset<I>, I> Dataset<I> for DistributedSampler<D> {
    fn get(&self, index: usize) -> Option<I> {
        self.dataset
            .get(self.plan.index(self.dataset.len(), index)?)
    }

    fn len(&self) -> usize {
        self.plan.len(self.dataset.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::data::dataset::InMemDataset;
    use burn_ddp_dev::adapters;

    #[test]
    fn the_sampler_deals_the_plans_items() {
        adapters::sampler_deals_the_plans_items(|ask| {
            let s = DistributedSampler::with_plan(InMemDataset::new(ask.data.clone()), ask.plan());
            adapters::dealt(s.len(), |i| s.get(i))
        });
    }
}
