//! [`LaunchOrder`]: the rule by which every transport launches a pass's buckets.

use super::plan::BucketPlan;

/// Which slots of a pass are final, and which bucket launches next: buckets strictly in index
/// order, each as soon as all its slots are final. Every rank launches the same buckets in the
/// same order, whatever order its gradients arrive in, so the collectives match across ranks
/// (PyTorch's reducer keeps the same rule). The gradient engine ([`super::Pass`]) follows it
/// for every transport of every line.
#[derive(Debug, Clone)]
pub struct LaunchOrder {
    /// Each slot's bucket.
    bucket_of: Vec<usize>,
    /// Whether each slot is final (its gradient delivered, or counted absent).
    done: Vec<bool>,
    /// Slots of each bucket not final yet.
    missing: Vec<usize>,
    /// The next bucket to launch.
    next: usize,
}

impl LaunchOrder {
    /// A pass over `plan` in which no slot is final yet.
    pub fn new<K>(plan: &BucketPlan<K>) -> Self {
        Self {
            bucket_of: plan.slots.iter().map(|s| s.bucket).collect(),
            done: vec![false; plan.slots.len()],
            missing: plan.buckets.iter().map(|(s, _)| s.len()).collect(),
            next: 0,
        }
    }

    /// Whether `slot` is final (`false` for a slot beyond the plan).
    pub fn is_final(&self, slot: usize) -> bool {
        self.done.get(slot).copied().unwrap_or(false)
    }

    /// Marks `slot` final; `false` if it already was, or is beyond the plan (nothing changes).
    pub fn mark_final(&mut self, slot: usize) -> bool {
        match self.done.get_mut(slot) {
            Some(done) if !*done => {
                *done = true;
                self.missing[self.bucket_of[slot]] -= 1;
                true
            }
            _ => false,
        }
    }

    /// The close of a pass: every slot not final yet counts as final (absent on this rank), so
    /// that every bucket can launch and no rank waits for a gradient that never comes.
    pub fn mark_rest_final(&mut self) {
        for slot in 0..self.done.len() {
            self.mark_final(slot);
        }
    }

    /// The next bucket to launch, taken: the lowest not launched yet, if all its slots are
    /// final. Call it until `None` after each change.
    pub fn next_ready(&mut self) -> Option<usize> {
        let bucket = self.next;
        if self.missing.get(bucket) == Some(&0) {
            self.next += 1;
            Some(bucket)
        } else {
            None
        }
    }

    /// How many buckets have been launched (taken from [`LaunchOrder::next_ready`]).
    pub fn launched(&self) -> usize {
        self.next
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Three buckets of two parameters each (8 bytes each, caps of 16 bytes).
    fn plan() -> BucketPlan<u64> {
        super::super::plan::test_plan(6, 2, 16, 16)
    }

    fn drain(order: &mut LaunchOrder) -> Vec<usize> {
        std::iter::from_fn(|| order.next_ready()).collect()
    }

    #[test]
    fn buckets_launch_in_index_order_whatever_order_their_slots_become_final() {
        let plan = plan();
        assert_eq!(plan.buckets.len(), 3, "{:?}", plan.bucket_names());
        let mut order = LaunchOrder::new(&plan);
        // The last bucket completes first: nothing launches before bucket 0 has.
        for &slot in &plan.buckets[2].0 {
            assert!(order.mark_final(slot));
        }
        assert_eq!(drain(&mut order), Vec::<usize>::new());
        let first = plan.buckets[0].0.clone();
        assert!(order.mark_final(first[0]));
        assert_eq!(drain(&mut order), Vec::<usize>::new());
        assert!(order.mark_final(first[1]));
        assert_eq!(drain(&mut order), vec![0]);
        // A slot marked twice, or beyond the plan, changes nothing.
        assert!(!order.mark_final(first[1]));
        assert!(!order.mark_final(99));
        // The close counts bucket 1's slots absent: it launches, then bucket 2.
        order.mark_rest_final();
        assert_eq!(drain(&mut order), vec![1, 2]);
        assert_eq!(order.launched(), 3);
        assert_eq!(order.next_ready(), None);
        assert!((0..6).all(|s| order.is_final(s)));
    }
}
