//! Which parameter goes in which bucket: one plan, the same on every rank, built from the
//! model's parameters in visit order.

use std::collections::HashMap;
use std::hash::Hash;

use super::DdpConfig;
use crate::types::Rank;

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
    /// Where its presence flag is in its bucket's buffer ([`BucketPlan::flag_index`]).
    pub flag: usize,
}

/// How a [sharded](BucketPlan::sharded) plan's buckets are laid out (ZeRO stage 2): each
/// bucket's buffer is `world` blocks of equal length, block `r` holding the values of the
/// parameters rank `r` owns (in fill order), then their presence flags, then zeros up to the
/// longest block, so that one reduce-scatter leaves every rank the reduced gradients of the
/// parameters it owns, and nothing else.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sharding {
    /// The ranks.
    pub world: usize,
    /// The owner of each slot.
    pub owners: Vec<Rank>,
    /// Each bucket's block length, in elements.
    pub blocks: Vec<usize>,
}

/// One run of a bucket's buffer, as [`BucketPlan::layout`] lists them in order: what a device
/// transport concatenates to pack the bucket.
#[derive(Debug, Clone, PartialEq)]
pub enum Piece {
    /// The values of slot `0` (its gradient, or zeros where this rank has none).
    Values(usize),
    /// This many presence flags, all 1: this rank has every one of their slots' gradients (the
    /// usual step; a transport can keep such a run from step to step).
    Ones(usize),
    /// Presence flags, one per slot, 1 where this rank has the gradient and 0 where it has not
    /// (at least one is 0).
    Flags(Vec<f32>),
    /// Padding: this many zeros (the end of a sharded bucket's shorter blocks).
    Zeros(usize),
}

impl Piece {
    /// The presence flags of `slots`, `present` saying which gradients this rank has.
    fn flags(slots: &[usize], present: &impl Fn(usize) -> bool) -> Piece {
        if slots.iter().all(|&s| present(s)) {
            return Piece::Ones(slots.len());
        }
        Piece::Flags(
            slots
                .iter()
                .map(|&s| f32::from(u8::from(present(s))))
                .collect(),
        )
    }
}

/// ZeRO stage 2's owner of each parameter of a prepared model (by slot), once stage 2 is on:
/// what both lines' reducers keep, so that each bucket plan they build for that model (the
/// same model prepared again, the overlapped plan and the after-backward one) is
/// [sharded](BucketPlan::sharded).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StageTwo(Option<Vec<Rank>>);

impl StageTwo {
    /// Stage 2 on, with these owners.
    pub fn set(&mut self, owners: Vec<Rank>) {
        self.0 = Some(owners);
    }

    /// Whether stage 2 is on.
    pub fn is_on(&self) -> bool {
        self.0.is_some()
    }

    /// `plan` sharded over `world` ranks to the owners, when stage 2 is on and they are as
    /// many as its slots (the model they were made for); otherwise `plan` as it is (another
    /// model's plan: its own `zero2` shards it).
    pub fn apply<K>(&self, plan: BucketPlan<K>, world: usize) -> BucketPlan<K> {
        match &self.0 {
            Some(owners) if owners.len() == plan.slots.len() => plan.sharded(owners, world),
            _ => plan,
        }
    }
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
    /// Set on a plan whose buckets are reduce-scattered (ZeRO stage 2): where each rank's
    /// block is.
    pub sharding: Option<Sharding>,
}

impl<K> Default for BucketPlan<K> {
    fn default() -> Self {
        Self {
            slots: Vec::new(),
            by_id: HashMap::new(),
            buckets: Vec::new(),
            sharding: None,
        }
    }
}

impl<K> BucketPlan<K> {
    /// The length of bucket `bucket`'s buffer on the wire: its values, then one presence flag
    /// per parameter (1 where a rank has the parameter's gradient), reduced with them, so every
    /// rank learns which parameters some rank had a gradient for.
    /// A [sharded](Self::sharded) plan's buckets are `world` blocks ([`Sharding`]).
    pub fn buffer_len(&self, bucket: usize) -> usize {
        if let Some(s) = &self.sharding {
            return s.world * s.blocks[bucket];
        }
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
        self.slots[slot].flag
    }

    /// Bucket `bucket`'s block length when the plan is [sharded](Self::sharded): each rank
    /// keeps that many elements of its reduce-scatter.
    pub fn block(&self, bucket: usize) -> Option<usize> {
        self.sharding.as_ref().map(|s| s.blocks[bucket])
    }

    /// The owner of slot `slot` in a [sharded](Self::sharded) plan.
    pub fn owner(&self, slot: usize) -> Option<Rank> {
        self.sharding.as_ref().map(|s| s.owners[slot])
    }

    /// What bucket `bucket`'s buffer holds, in order, on a rank that has the gradients of the
    /// slots `present` names: each slot's values then every flag (the slots in fill order); in
    /// a [sharded](Self::sharded) plan, block after block, each its owner's values, then their
    /// flags, then padding. The pieces' lengths add up to [`buffer_len`](Self::buffer_len), and
    /// each lies where the slots' offsets and flags say.
    pub fn layout(&self, bucket: usize, present: impl Fn(usize) -> bool) -> Vec<Piece> {
        let slots = &self.buckets[bucket].0;
        let Some(sh) = &self.sharding else {
            let mut pieces: Vec<Piece> = slots.iter().map(|&s| Piece::Values(s)).collect();
            pieces.push(Piece::flags(slots, &present));
            return pieces;
        };
        let mut pieces = Vec::new();
        for r in 0..sh.world {
            let owned: Vec<usize> = (slots.iter().copied())
                .filter(|&s| sh.owners[s].index() == r)
                .collect();
            let used: usize = owned.iter().map(|&s| self.slots[s].info.numel + 1).sum();
            pieces.extend(owned.iter().map(|&s| Piece::Values(s)));
            if !owned.is_empty() {
                pieces.push(Piece::flags(&owned, &present));
            }
            if used < sh.blocks[bucket] {
                pieces.push(Piece::Zeros(sh.blocks[bucket] - used));
            }
        }
        pieces
    }

    /// The length of what each rank receives of bucket `bucket`'s reduction: the whole buffer
    /// ([`buffer_len`](Self::buffer_len)), or, in a [sharded](Self::sharded) plan, its block.
    pub fn received_len(&self, bucket: usize) -> usize {
        self.block(bucket)
            .unwrap_or_else(|| self.buffer_len(bucket))
    }

    /// Where slot `slot`'s values and presence flag are (offsets, in elements) in what `rank`
    /// receives of its bucket ([`received_len`](Self::received_len)): where the bucket's buffer
    /// has them, or, in a [sharded](Self::sharded) plan, shifted by the blocks before `rank`'s;
    /// `None` for a slot another rank owns (this rank receives nothing of it).
    pub fn received(&self, slot: usize, rank: Rank) -> Option<(usize, usize)> {
        let s = &self.slots[slot];
        match &self.sharding {
            None => Some((s.offset, s.flag)),
            Some(sh) if sh.owners[slot] != rank => None,
            Some(sh) => {
                let shift = rank.index() * sh.blocks[s.bucket];
                Some((s.offset - shift, s.flag - shift))
            }
        }
    }

    /// The same buckets, reduce-scattered (ZeRO stage 2): parameter `slot` is owned by
    /// `owners[slot]` (of `world` ranks), and each bucket's buffer is laid out as [`Sharding`]
    /// says. The buckets keep their parameters and launch order; only where each value and
    /// flag lies changes.
    ///
    /// # Panics
    /// Never: an `owners` shorter than the plan gives the missing slots to rank 0, an owner
    /// beyond `world` is taken modulo it.
    pub fn sharded(mut self, owners: &[Rank], world: usize) -> Self {
        let world = world.max(1);
        let owners: Vec<Rank> = (0..self.slots.len())
            .map(|i| Rank(owners.get(i).map_or(0, |r| r.0) % world as u32))
            .collect();
        let mut blocks = Vec::with_capacity(self.buckets.len());
        for (slots, _) in &self.buckets {
            // Per rank: its values, then its flags.
            let mut values = vec![0usize; world];
            let mut flags = vec![0usize; world];
            for &slot in slots {
                let r = owners[slot].index();
                values[r] += self.slots[slot].info.numel;
                flags[r] += 1;
            }
            let block = (0..world).map(|r| values[r] + flags[r]).max().unwrap_or(0);
            let (mut at, mut flag) = (vec![0usize; world], vec![0usize; world]);
            for &slot in slots {
                let r = owners[slot].index();
                let s = &mut self.slots[slot];
                s.offset = r * block + at[r];
                s.flag = r * block + values[r] + flag[r];
                at[r] += s.info.numel;
                flag[r] += 1;
            }
            blocks.push(block);
        }
        self.sharding = Some(Sharding {
            world,
            owners,
            blocks,
        });
        self
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
                flag: 0,
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
                plan.close(std::mem::take(&mut current), len);
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
            plan.close(current, len);
        }
        plan
    }

    /// Appends the bucket of `slots` (`len` values): their flags follow the values.
    fn close(&mut self, slots: Vec<usize>, len: usize) {
        for (position, &slot) in slots.iter().enumerate() {
            self.slots[slot].flag = len + position;
        }
        self.buckets.push((slots, len));
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
        use Piece::{Flags, Ones, Values};
        assert_eq!(plan.layout(0, |_| true), [Values(0), Ones(1)]);
        assert_eq!(plan.layout(0, |_| false), [Values(0), Flags(vec![0.0])]);
        // Unsharded, every rank receives the whole buffer.
        assert_eq!(plan.received_len(1), 15);
        assert_eq!(plan.received(2, Rank(1)), Some((2, 11)));
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

    #[test]
    fn a_sharded_bucket_is_one_block_per_rank_each_with_its_owners_values_then_flags() {
        // One bucket of p0 (3), p1 (2), p2 (1), p3 (4): rank 0 owns p0 and p2, rank 1 p1 and p3.
        let params = [3, 2, 1, 4]
            .iter()
            .enumerate()
            .map(|(i, &n)| (info(&format!("p{i}"), n), i as u64))
            .collect();
        let plan = BucketPlan::build(params, &caps(1024, 1024), BucketOrder::Forward);
        assert_eq!(plan.flag_index(2), 10 + 2);
        let owners = [Rank(0), Rank(1), Rank(0), Rank(1)];
        let plan = plan.sharded(&owners, 2);
        // Rank 0: 3 + 1 values and 2 flags = 6; rank 1: 2 + 4 and 2 flags = 8: blocks of 8.
        assert_eq!(plan.block(0), Some(8));
        assert_eq!(plan.buffer_len(0), 16);
        let at = |i: usize| (plan.slots[i].offset, plan.flag_index(i));
        assert_eq!([at(0), at(2)], [(0, 4), (3, 5)]);
        assert_eq!([at(1), at(3)], [(8, 14), (10, 15)]);
        assert_eq!(plan.owner(3), Some(Rank(1)));
        // Packed in order: rank 0's values, flags and padding, then rank 1's; each block's
        // flags one run of ones where this rank has all its gradients (here not slot 3's).
        let layout = plan.layout(0, |slot| slot != 3);
        use Piece::{Flags, Ones, Values, Zeros};
        assert_eq!(
            layout,
            [
                Values(0),
                Values(2),
                Ones(2),
                Zeros(2),
                Values(1),
                Values(3),
                Flags(vec![1.0, 0.0])
            ]
        );
        let lens = |p: &Piece| match p {
            Values(s) => plan.slots[*s].info.numel,
            Flags(f) => f.len(),
            Ones(n) | Zeros(n) => *n,
        };
        assert_eq!(layout.iter().map(lens).sum::<usize>(), plan.buffer_len(0));
        // What each rank receives: its block, its own slots shifted to it, the others nowhere.
        assert_eq!(plan.received_len(0), 8);
        assert_eq!(plan.received(2, Rank(0)), Some((3, 5)));
        assert_eq!(plan.received(3, Rank(1)), Some((2, 7)));
        assert_eq!(
            [plan.received(1, Rank(0)), plan.received(0, Rank(1))],
            [None, None]
        );
        // Stage 2's owners shard a plan of their model's size, and leave another as it is.
        let mut two = StageTwo::default();
        two.set(owners.to_vec());
        let fresh = || {
            let params = (0..4)
                .map(|i| (info(&format!("p{i}"), 1), i as u64))
                .collect();
            BucketPlan::build(params, &caps(1024, 1024), BucketOrder::Forward)
        };
        assert!(two.apply(fresh(), 2).sharding.is_some());
        let params = vec![(info("q", 1), 9u64)];
        let other = BucketPlan::build(params, &caps(1024, 1024), BucketOrder::Forward);
        assert!(two.apply(other, 2).sharding.is_none());
        // The buckets keep their parameters and order.
        assert_eq!(plan.bucket_names(), vec![vec!["p0", "p1", "p2", "p3"]]);
    }
}
