//! Sharding a Burn dataset over the ranks of a job: [`DistributedSampler`] (the dealing
//! itself is burn-ddp-comm's `ShardPlan`, shared with the Burn 0.21 line).

use burn::data::dataset::{Dataset, DatasetError};

burn_ddp_comm::distributed_sampler! {
    /// This rank's share of a dataset, reshuffled every epoch — PyTorch's `DistributedSampler`,
    /// as a Burn [`Dataset`] that wraps another.
    ///
    /// Every epoch the indices `0..len` are permuted with a generator seeded by `(seed, epoch)` (or
    /// left in order with `with_shuffle(false)`), made a multiple of the world size (padded with the
    /// permutation's first items, or cut with `with_drop_last(true)`), and dealt out with a stride:
    /// rank `r` gets positions `r, r + W, r + 2W, ...`. Every rank computes the same permutation
    /// without communicating and has the same number of items, hence of batches. Call
    /// `set_epoch` at the start of every epoch, as in PyTorch, or the same order repeats.
    ///
    /// The permutation is the same as the Burn 0.21 line's for the same seed and epoch.
    ///
    /// ```
    /// # #[cfg(feature = "burn-0-22")] extern crate burn022 as burn;
    /// # #[cfg(feature = "burn-0-23")] extern crate burn023 as burn;
    /// use burn::data::dataset::{Dataset, InMemDataset};
    /// use burn_ddp::{DistributedSampler, Rank, WorldSize};
    ///
    /// let data = InMemDataset::new((0..10).collect::<Vec<u32>>());
    /// let shard = DistributedSampler::with_replicas(data, Rank(1), WorldSize::new(3).unwrap())?
    ///     .with_seed(42);
    /// shard.set_epoch(3);
    /// assert_eq!(shard.len(), 4); // ceil(10 / 3): padded
    /// # Ok::<(), burn_ddp::DdpError>(())
    /// ```
    pub struct DistributedSampler<D>; dataset: Dataset<I>
}

impl<D: Dataset<I>, I> Dataset<I> for DistributedSampler<D> {
    fn get(&self, index: usize) -> std::result::Result<I, DatasetError> {
        let n = self.dataset.len();
        match self.plan.index(n, index) {
            Some(i) => self.dataset.get(i),
            None => Err(DatasetError::new(std::io::Error::other(format!(
                "item {index} of this rank's shard does not exist: the shard has {} items (of {n})",
                self.plan.len(n)
            )))),
        }
    }

    fn len(&self) -> usize {
        self.plan.len(self.dataset.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::data::dataset::InMemDataset;
    use burn_ddp_comm::{Rank, WorldSize};
    use burn_ddp_dev::adapters;

    #[test]
    fn past_its_end_the_sampler_says_how_many_items_the_shard_has() {
        let w = WorldSize::new(3).unwrap();
        let data = InMemDataset::new((10..18).collect::<Vec<u32>>());
        let s = DistributedSampler::with_replicas(data, Rank(2), w).unwrap();
        assert!(s.is_padding(2) && !s.is_padding(1));
        let err = s.get(3).unwrap_err().to_string();
        assert!(err.contains("the shard has 3 items (of 8)"), "{err}");
    }

    #[test]
    fn the_sampler_deals_the_plans_items() {
        adapters::sampler_deals_the_plans_items(|ask| {
            let s = DistributedSampler::with_plan(InMemDataset::new(ask.data.clone()), ask.plan());
            adapters::dealt(s.len(), |i| s.get(i).ok())
        });
    }
}
