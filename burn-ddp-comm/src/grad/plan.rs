//! Which parameter goes in which bucket: one plan, the same on every rank, built from the
//! model's parameters in visit order.

use std::collections::HashMap;
use std::hash::Hash;

use super::DdpConfig;

/// What gradient synchronisation knows of one parameter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParamInfo {
    /// Path in the module tree, e.g. `fc1.weight`.
    pub name: String,
    /// Shape.
    pub shape: Vec<usize>,
    /// Element type, as Burn names it.
    pub dtype: String,
    /// Number of elements.
    pub numel: usize,
}

impl ParamInfo {
    /// A parameter of `shape` (its element count is their product).
    pub fn new(name: impl Into<String>, shape: Vec<usize>, dtype: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            numel: shape.iter().product(),
            shape,
            dtype: dtype.into(),
        }
    }

    /// One line naming the parameter, its shape and dtype: what ranks compare.
    pub(crate) fn line(&self) -> String {
        format!("{}\t{:?}\t{}", self.name, self.shape, self.dtype)
    }
}

/// The order buckets are filled and launched in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BucketOrder {
    /// From the last parameter to the first: during backward, the gradients of the last
    /// layers are final first (Burn 0.21's overlapped path, like PyTorch DDP).
    Reverse,
    /// From the first parameter to the last: after backward, in the order a module visitor
    /// reads the gradients (Burn 0.22's line, explicit synchronisation).
    Forward,
}

/// A parameter's place in the plan.
#[derive(Debug, Clone)]
pub struct Slot {
    /// The parameter.
    pub info: ParamInfo,
    /// Index of its bucket (buckets are launched in index order).
    pub bucket: usize,
    /// Offset in the bucket, in elements.
    pub offset: usize,
    /// Its place among its bucket's parameters (the bucket's slot list, in fill order).
    pub position: usize,
}

/// Parameters (slots, in visit order) grouped into buckets: the first capped at
/// [`DdpConfig::first_bucket_cap_bytes`] so that communication starts early, the others at
/// [`DdpConfig::bucket_cap_bytes`]; a parameter larger than the cap gets a bucket of its own.
/// `K` is the Burn line's parameter id.
#[derive(Debug, Clone)]
pub struct BucketPlan<K> {
    /// The parameters, in visit order.
    pub slots: Vec<Slot>,
    /// Slot of each parameter id.
    pub by_id: HashMap<K, usize>,
    /// Slots of each bucket (in fill order), and the bucket's length in elements.
    pub buckets: Vec<(Vec<usize>, usize)>,
}

impl<K> Default for BucketPlan<K> {
    fn default() -> Self {
        Self {
            slots: Vec::new(),
            by_id: HashMap::new(),
            buckets: Vec::new(),
        }
    }
}

impl<K> BucketPlan<K> {
    /// The length of bucket `bucket`'s buffer on the wire: its values, then one presence flag
    /// per parameter (1 where a rank has the parameter's gradient), reduced with them, so every
    /// rank learns which parameters some rank had a gradient for.
    pub fn buffer_len(&self, bucket: usize) -> usize {
        let (slots, len) = &self.buckets[bucket];
        len + slots.len()
    }

    /// Every bucket's [`buffer_len`](Self::buffer_len), in bucket order.
    pub fn buffer_lens(&self) -> Vec<usize> {
        (0..self.buckets.len())
            .map(|b| self.buffer_len(b))
            .collect()
    }

    /// Where slot `slot`'s presence flag is in its bucket's buffer (see
    /// [`BucketPlan::buffer_len`]).
    pub fn flag_index(&self, slot: usize) -> usize {
        let s = &self.slots[slot];
        self.buckets[s.bucket].1 + s.position
    }
}

/// For tests: `n` f32 parameters `p0`, `p1`, ... of `numel` elements each, in buckets filled
/// forward under the given caps (in bytes).
#[cfg(test)]
pub(crate) fn test_plan(n: u64, numel: usize, first_cap: usize, cap: usize) -> BucketPlan<u64> {
    let params = (0..n)
        .map(|i| (ParamInfo::new(format!("p{i}"), vec![numel], "F32"), i))
        .collect();
    let config = DdpConfig {
        first_bucket_cap_bytes: first_cap,
        bucket_cap_bytes: cap,
        ..DdpConfig::default()
    };
    BucketPlan::build(params, &config, BucketOrder::Forward)
}

impl<K: Hash + Eq> BucketPlan<K> {
    /// The plan of `params` (in visit order) under `config`'s caps, filled in `order`.
    pub fn build(params: Vec<(ParamInfo, K)>, config: &DdpConfig, order: BucketOrder) -> Self {
        let mut plan = Self::default();
        let n = params.len();
        for (info, id) in params {
            plan.by_id.insert(id, plan.slots.len());
            plan.slots.push(Slot {
                info,
                bucket: 0,
                offset: 0,
                position: 0,
            });
        }
        let sequence: Box<dyn Iterator<Item = usize>> = match order {
            BucketOrder::Reverse => Box::new((0..n).rev()),
            BucketOrder::Forward => Box::new(0..n),
        };
        let mut current: Vec<usize> = Vec::new();
        let mut len = 0usize;
        for idx in sequence {
            let numel = plan.slots[idx].info.numel;
            let cap = if plan.buckets.is_empty() {
                config.first_bucket_cap_bytes
            } else {
                config.bucket_cap_bytes
            } / 4;
            if !current.is_empty() && len + numel > cap {
                plan.buckets.push((std::mem::take(&mut current), len));
                len = 0;
            }
            let bucket = plan.buckets.len();
            plan.slots[idx].bucket = bucket;
            plan.slots[idx].offset = len;
            plan.slots[idx].position = current.len();
            current.push(idx);
            len += numel;
        }
        if !current.is_empty() {
            plan.buckets.push((current, len));
        }
        plan
    }

    /// The names of each bucket's parameters, in launch order.
    pub fn bucket_names(&self) -> Vec<Vec<String>> {
        self.buckets
            .iter()
            .map(|(slots, _)| {
                slots
                    .iter()
                    .map(|&i| self.slots[i].info.name.clone())
                    .collect()
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(name: &str, numel: usize) -> ParamInfo {
        ParamInfo::new(name, vec![numel], "F32")
    }

    fn caps(first: usize, rest: usize) -> DdpConfig {
        DdpConfig {
            bucket_cap_bytes: rest,
            first_bucket_cap_bytes: first,
            ..DdpConfig::default()
        }
    }

    #[test]
    fn reverse_buckets_start_from_the_last_parameter_with_a_small_first_bucket() {
        let params = (0..6u64).map(|i| (info(&format!("p{i}"), 2), i)).collect();
        let plan = BucketPlan::build(params, &caps(8, 40), BucketOrder::Reverse);
        assert_eq!(
            plan.bucket_names(),
            vec![vec!["p5"], vec!["p4", "p3", "p2", "p1", "p0"]]
        );
        assert_eq!(plan.slots[3].offset, 2);
        assert_eq!(plan.slots[3].position, 1);
        assert_eq!(plan.by_id[&3], 3);
    }

    #[test]
    fn forward_buckets_start_from_the_first_parameter() {
        let params = (0..6u64).map(|i| (info(&format!("p{i}"), 2), i)).collect();
        let plan = BucketPlan::build(params, &caps(8, 40), BucketOrder::Forward);
        assert_eq!(
            plan.bucket_names(),
            vec![vec!["p0"], vec!["p1", "p2", "p3", "p4", "p5"]]
        );
        assert_eq!(plan.slots[2].offset, 2);
        assert_eq!(plan.buckets[1].1, 10);
    }

    #[test]
    fn a_parameter_larger_than_the_cap_gets_its_own_bucket() {
        let params = vec![
            (info("a", 1), 1u64),
            (info("big", 100), 2),
            (info("c", 1), 3),
        ];
        let plan = BucketPlan::build(params, &caps(16, 16), BucketOrder::Reverse);
        let lens: Vec<usize> = plan.buckets.iter().map(|(_, l)| *l).collect();
        assert_eq!(lens, vec![1, 100, 1]);
    }
}
