//! ZeRO without Burn: which rank owns (steps, and keeps the optimizer state of) which parameter,
//! the all-gather that gives every rank the parameters the others stepped, and what stage 2
//! (gradients reduce-scattered to their owners over a [sharded](super::BucketPlan::sharded)
//! bucket plan) cannot run with.
//!
//! Ownership is by parameter, balanced by size: the parameters, largest first (ties in their
//! order), each go to the rank that owns the fewest elements so far (the lowest such). Every
//! rank computes the same assignment from the same list, so no collective is needed, and a
//! parameter's state lives on one rank only.

use crate::error::CollectiveError;
use std::collections::HashMap;
use std::ops::Range;

use super::DdpConfig;
use crate::group::ProcessGroup;
use crate::types::Rank;
use crate::{DdpError, Result};

/// The owner of each parameter (by position in the list the ranks agreed on).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ZeroPlan {
    owners: Vec<Rank>,
    sizes: Vec<usize>,
    world: usize,
}

impl ZeroPlan {
    /// Assigns parameters of `sizes` elements (in an order every rank shares) to `world`
    /// ranks, balanced by elements.
    pub fn balance(sizes: &[usize], world: usize) -> Self {
        let world = world.max(1);
        let mut order: Vec<usize> = (0..sizes.len()).collect();
        order.sort_by(|&a, &b| sizes[b].cmp(&sizes[a]).then(a.cmp(&b)));
        let mut load = vec![0usize; world];
        let mut owners = vec![Rank(0); sizes.len()];
        for i in order {
            let (rank, _) = load
                .iter()
                .enumerate()
                .min_by(|a, b| a.1.cmp(b.1).then(a.0.cmp(&b.0)))
                .unwrap_or((0, &0));
            owners[i] = Rank(rank as u32);
            load[rank] += sizes[i];
        }
        Self {
            owners,
            sizes: sizes.to_vec(),
            world,
        }
    }

    /// The owner of parameter `i`.
    pub fn owner(&self, i: usize) -> Rank {
        self.owners.get(i).copied().unwrap_or(Rank(0))
    }

    /// How many parameters there are.
    pub fn len(&self) -> usize {
        self.owners.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.owners.is_empty()
    }

    /// The elements `rank` owns.
    pub fn elements_of(&self, rank: Rank) -> usize {
        self.owners
            .iter()
            .zip(&self.sizes)
            .filter(|(o, _)| **o == rank)
            .map(|(_, s)| s)
            .sum()
    }

    /// The offset of each parameter (by position) in the values [`all_gather`](Self::all_gather)
    /// returns.
    pub fn offsets(&self) -> Vec<usize> {
        self.sizes
            .iter()
            .scan(0, |at, n| {
                let o = *at;
                *at += n;
                Some(o)
            })
            .collect()
    }

    /// The elements `rank` owns, and the elements of every parameter together.
    pub fn owned_elements(&self, rank: Rank) -> (usize, usize) {
        (self.elements_of(rank), self.sizes.iter().sum())
    }

    /// The parameters (by position, in list order) in runs of at most `cap` elements each (a
    /// larger parameter alone): the stepped parameters are all-gathered one run at a time
    /// ([`share_range`](Self::share_range)), so that what the gather holds beside the model is
    /// about one run, not the whole model (DeepSpeed's `allgather_bucket_size`).
    pub fn chunks(&self, cap: usize) -> Vec<Range<usize>> {
        let mut out = Vec::new();
        let (mut start, mut len) = (0, 0usize);
        for (i, &n) in self.sizes.iter().enumerate() {
            if i > start && len + n > cap {
                out.push(start..i);
                (start, len) = (i, 0);
            }
            len += n;
        }
        if start < self.sizes.len() {
            out.push(start..self.sizes.len());
        }
        out
    }

    /// [`all_gather_range`](Self::all_gather_range) of what a Burn line read from the
    /// parameters of `range` this rank stepped: a parameter it could not read (`mine.error`)
    /// fails this rank after the all-gather, so that no rank waits in it for one that failed.
    ///
    /// # Errors
    /// As `all_gather_range`; [`ModelError::Access`](crate::ModelError::Access) naming what could not be read.
    pub fn share_range(
        &self,
        pg: &ProcessGroup,
        range: Range<usize>,
        mine: ReadValues,
    ) -> Result<Vec<f32>> {
        let all = self.all_gather_range(pg, range, &mine.values)?;
        match mine.error {
            Some(e) => Err(DdpError::model_access(
                pg.rank(),
                "sharing the stepped parameters",
                format!("a parameter cannot be read as f32: {e}"),
            )),
            None => Ok(all),
        }
    }

    /// [`share_range`](Self::share_range) of every parameter at once.
    ///
    /// # Errors
    /// As `share_range`.
    pub fn share(&self, pg: &ProcessGroup, mine: ReadValues) -> Result<Vec<f32>> {
        self.share_range(pg, 0..self.len(), mine)
    }

    /// Every rank's owned parameters' values after its step, for every rank: `mine` holds this
    /// rank's owned parameters' values, concatenated in list order; the result holds every
    /// parameter's, in list order (one all-gather of equal, padded blocks).
    ///
    /// # Errors
    /// `mine` is not as long as this rank's owned elements; collective failures.
    pub fn all_gather(&self, pg: &ProcessGroup, mine: &[f32]) -> Result<Vec<f32>> {
        self.all_gather_range(pg, 0..self.len(), mine)
    }

    /// [`all_gather`](Self::all_gather) of the parameters of `range` (positions): `mine` holds
    /// this rank's owned ones of the range, the result every one of the range, in list order.
    ///
    /// # Errors
    /// As `all_gather`.
    pub fn all_gather_range(
        &self,
        pg: &ProcessGroup,
        range: Range<usize>,
        mine: &[f32],
    ) -> Result<Vec<f32>> {
        let rank = pg.rank();
        if pg.world_size().as_usize() != self.world {
            return Err(DdpError::Internal {
                rank,
                what: "a ZeRO shard plan made for another world size",
            });
        }
        let layout = self.run_layout(range.clone());
        let own = layout.owned(rank);
        if mine.len() != own {
            return Err(DdpError::Collective(CollectiveError::BufferSize {
                rank,
                op: crate::types::CollectiveOp::AllGather,
                what: "this rank's stepped parameters",
                expected: own,
                got: mine.len(),
            }));
        }
        let mut send = mine.to_vec();
        send.resize(layout.block, 0.0);
        let mut all = vec![0.0f32; layout.block * self.world];
        pg.all_gather(&send, &mut all)?;
        drop(send);
        let mut out = Vec::with_capacity(layout.sizes.iter().sum());
        for (&at, &size) in layout.at.iter().zip(&layout.sizes) {
            out.extend_from_slice(&all[at..at + size]);
        }
        Ok(out)
    }

    /// Where the parameters of `range` (positions) lie in the all-gather of one run: every
    /// rank sends a block of its owned ones (list order), padded to the largest rank's.
    pub fn run_layout(&self, range: Range<usize>) -> RunLayout {
        let range = range.start.min(self.len())..range.end.min(self.len());
        let owners = self.owners[range.clone()].to_vec();
        let sizes = self.sizes[range].to_vec();
        let mut owned = vec![0usize; self.world];
        for (o, s) in owners.iter().zip(&sizes) {
            owned[o.index()] += s;
        }
        let block = owned.iter().copied().max().unwrap_or(0);
        let mut next = vec![0usize; self.world];
        let at = (owners.iter().zip(&sizes))
            .map(|(o, s)| {
                let r = o.index();
                let at = r * block + next[r];
                next[r] += s;
                at
            })
            .collect();
        RunLayout {
            block,
            at,
            sizes,
            owned,
        }
    }
}

/// The all-gather of one run of parameters ([`ZeroPlan::run_layout`]): each rank's block, and
/// where each parameter of the run lies in the gathered values (`world` blocks, rank order).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RunLayout {
    /// The elements each rank sends: the largest rank's owned elements of the run.
    pub block: usize,
    /// Each parameter's offset in the gathered values (its owner's block, then the owner's
    /// earlier parameters of the run).
    pub at: Vec<usize>,
    /// Each parameter's elements.
    pub sizes: Vec<usize>,
    /// Each rank's owned elements of the run (the rest of its block is padding).
    owned: Vec<usize>,
}

impl RunLayout {
    /// The elements `rank` owns in the run: what it sends before its padding.
    pub fn owned(&self, rank: Rank) -> usize {
        self.owned.get(rank.index()).copied().unwrap_or(0)
    }
}

/// A [`ZeroPlan`] over a model's trainable parameters named by their ids (Burn's `ParamId`
/// value): what a Burn line's ZeRO optimizer asks of a parameter it visits (whether this rank
/// steps it, where its all-gathered value is) without keeping positions and offsets itself.
#[derive(Clone, Debug)]
pub struct ZeroShards {
    plan: ZeroPlan,
    /// Each parameter's id, by position.
    ids: Vec<u64>,
    /// Each id's position.
    index: HashMap<u64, usize>,
    /// Each parameter's offset (by position) in the all-gathered values.
    offsets: Vec<usize>,
}

impl ZeroShards {
    /// The plan of `params` (id, elements) in the order every rank shares (the model's visit
    /// order), over `world` ranks.
    pub fn new(params: &[(u64, usize)], world: usize) -> Self {
        let sizes: Vec<usize> = params.iter().map(|(_, n)| *n).collect();
        let plan = ZeroPlan::balance(&sizes, world);
        let ids: Vec<u64> = params.iter().map(|(id, _)| *id).collect();
        let index = ids.iter().enumerate().map(|(i, id)| (*id, i)).collect();
        Self {
            offsets: plan.offsets(),
            plan,
            ids,
            index,
        }
    }

    /// The plan, by position.
    pub fn plan(&self) -> &ZeroPlan {
        &self.plan
    }

    /// Each parameter's owner, by position: what a [sharded](super::BucketPlan::sharded)
    /// bucket plan (ZeRO stage 2) takes, when the bucket plan's slots are these positions.
    pub fn owners(&self) -> Vec<Rank> {
        (0..self.plan.len()).map(|i| self.plan.owner(i)).collect()
    }

    /// Each parameter's id, by position.
    pub fn ids(&self) -> &[u64] {
        &self.ids
    }

    /// The position of parameter `id`; None for a parameter that is not sharded.
    pub fn position(&self, id: u64) -> Option<usize> {
        self.index.get(&id).copied()
    }

    /// Whether `rank` owns parameter `id` (steps it, keeps its state).
    pub fn owns(&self, id: u64, rank: Rank) -> bool {
        self.position(id)
            .is_some_and(|i| self.plan.owner(i) == rank)
    }

    /// Whether parameter `id` is sharded and another rank than `rank` owns it: its gradient is
    /// dropped before `rank`'s optimizer step.
    pub fn owned_elsewhere(&self, id: u64, rank: Rank) -> bool {
        self.position(id)
            .is_some_and(|i| self.plan.owner(i) != rank)
    }

    /// The ids of the parameters another rank than `rank` owns, in visit order: the gradients
    /// `rank` drops before its optimizer step.
    pub fn owned_by_others(&self, rank: Rank) -> impl Iterator<Item = u64> + '_ {
        (self.ids.iter().enumerate())
            .filter(move |(i, _)| self.plan.owner(*i) != rank)
            .map(|(_, id)| *id)
    }

    /// Parameter `id`'s `n` values in `values` ([`ZeroPlan::all_gather`]'s result); None for
    /// a parameter that is not sharded, or values too short.
    pub fn gathered<'v>(&self, id: u64, n: usize, values: &'v [f32]) -> Option<&'v [f32]> {
        self.gathered_in(id, n, 0..self.ids.len(), values)
    }

    /// Parameter `id`'s `n` values in `values`, the all-gather of the parameters of `range`
    /// ([`ZeroPlan::all_gather_range`]); None for a parameter outside the range or not
    /// sharded, or values too short.
    pub fn gathered_in<'v>(
        &self,
        id: u64,
        n: usize,
        range: Range<usize>,
        values: &'v [f32],
    ) -> Option<&'v [f32]> {
        let i = self.position(id).filter(|i| range.contains(i))?;
        let at = self.offsets[i] - self.offsets.get(range.start).copied().unwrap_or(0);
        values.get(at..at + n)
    }

    /// Where parameter `id` lies in the gathered values of the run `range`, laid out as
    /// `layout` ([`ZeroPlan::run_layout`] of the same range): the offset of its values in the
    /// `world` blocks; None for a parameter outside the run or not sharded.
    pub fn gathered_at(&self, id: u64, range: &Range<usize>, layout: &RunLayout) -> Option<usize> {
        let i = self.position(id).filter(|i| range.contains(i))?;
        layout.at.get(i - range.start).copied()
    }

    /// Whether parameter `id` is at a position of `range`.
    pub fn within(&self, id: u64, range: &Range<usize>) -> bool {
        self.position(id).is_some_and(|i| range.contains(&i))
    }

    /// The stepped parameters of `model` all-gathered a run of at most `chunk` elements at a
    /// time ([`ZeroPlan::chunks`]), so that the gather holds about one run beside the model:
    /// for each run, `read` gives this rank's owned parameters of it (in list order) and
    /// `write` puts every parameter of it back from the gathered values (found with
    /// [`gathered_in`](Self::gathered_in)). A value that could not be read fails the call
    /// after every run went, so that no rank waits in a run another left.
    ///
    /// # Errors
    /// The first run's failure: a parameter that could not be read, a collective failure.
    pub fn gather_in_runs<M>(
        &self,
        pg: &ProcessGroup,
        chunk: usize,
        mut model: M,
        read: impl Fn(&M, &Range<usize>) -> ReadValues,
        write: impl Fn(M, Range<usize>, &[f32]) -> M,
    ) -> Result<M> {
        let mut failed = None;
        for range in self.plan.chunks(chunk) {
            match self
                .plan
                .share_range(pg, range.clone(), read(&model, &range))
            {
                Ok(values) => model = write(model, range, &values),
                Err(e) => {
                    failed.get_or_insert(e);
                }
            }
        }
        match failed {
            Some(e) => Err(e),
            None => Ok(model),
        }
    }
}

/// What a Burn line packed of one run for the all-gather on a device path
/// ([`ZeroShards::gather_runs_on_device`]): this rank's owned parameters of the run, each
/// flattened to f32, in list order; the device of the run's parameters (`None`: the model has
/// none of them); a parameter that could not be packed.
#[derive(Debug)]
pub struct RunParts<T, D> {
    /// The flattened owned parameters, and their elements.
    pub parts: Vec<(T, usize)>,
    /// Where the run's parameters are.
    pub device: Option<D>,
    /// Why a parameter of the run could not be packed.
    pub error: Option<String>,
}

impl<T, D> Default for RunParts<T, D> {
    fn default() -> Self {
        Self {
            parts: Vec::new(),
            device: None,
            error: None,
        }
    }
}

impl ZeroShards {
    /// The stepped parameters of `model` all-gathered on a device path, a run at a time
    /// ([`ZeroPlan::chunks`] of `chunk` elements, [`ZeroPlan::run_layout`]): for each run,
    /// `pack` gives this rank's owned parameters of it, `zeros(n, device)` pads them to the
    /// run's block, `gather(what, parts, block)` concatenates and all-gathers the blocks of every
    /// rank, and `place(model, range, layout, gathered)` puts every parameter of the run back.
    /// At world size 1 too (a copy). A rank whose packed parameters are not what the plan says
    /// sends zeros and fails after every run went, so that no rank waits in a run another left.
    ///
    /// # Errors
    /// The run's parameters are not in the model (every rank finds that, before the
    /// collective); a parameter that could not be packed, or not the plan's elements; the
    /// collective's failures.
    #[allow(clippy::too_many_arguments)]
    pub fn gather_runs_on_device<M, T, D>(
        &self,
        rank: Rank,
        chunk: usize,
        mut model: M,
        pack: impl Fn(&M, &Range<usize>) -> RunParts<T, D>,
        zeros: impl Fn(usize, &D) -> T,
        gather: impl Fn(&str, Vec<T>, usize) -> Result<T>,
        place: impl Fn(M, Range<usize>, &RunLayout, &T) -> M,
    ) -> Result<M> {
        let action = "all-gathering the stepped parameters";
        let mut failed = None;
        for range in self.plan.chunks(chunk) {
            let layout = self.plan.run_layout(range.clone());
            if layout.block == 0 {
                continue;
            }
            let packed = pack(&model, &range);
            let what = format!("the stepped parameters {}..{}", range.start, range.end);
            let Some(device) = packed.device else {
                let why = format!("{what} are not in the model the ZeRO optimizer was made for");
                return Err(DdpError::model_access(rank, action, why));
            };
            let own: usize = packed.parts.iter().map(|(_, n)| n).sum();
            let wrong = match packed.error {
                Some(e) => Some(format!("{what}: {e}")),
                None => (own != layout.owned(rank)).then(|| {
                    format!(
                        "this rank has {own} elements of {what} to send, the plan {}: step the \
                         model the ZeRO optimizer was made for",
                        layout.owned(rank)
                    )
                }),
            };
            let mut parts: Vec<T> = packed.parts.into_iter().map(|(t, _)| t).collect();
            let mut filled = own;
            if let Some(why) = wrong {
                failed.get_or_insert(DdpError::model_access(rank, action, why));
                (parts, filled) = (Vec::new(), 0);
            }
            if filled < layout.block {
                parts.push(zeros(layout.block - filled, &device));
            }
            let all = gather(&what, parts, layout.block)?;
            if failed.is_none() {
                model = place(model, range, &layout, &all);
            }
        }
        match failed {
            Some(e) => Err(e),
            None => Ok(model),
        }
    }
}

/// Refuses ZeRO stage 2 (gradients reduce-scattered to their owners) where it cannot run: beside
/// a communication hook or PowerSGD (each reduces whole buckets on every rank). Both
/// transports reduce-scatter: the host-staged one on its communication thread, NCCL's device
/// buckets with `ncclReduceScatter` (`cuda::reduce_bucket`, feature
/// `cuda`).
///
/// # Errors
/// [`ConfigError::InvalidConfig`](crate::ConfigError::InvalidConfig) saying what to change.
pub fn check_stage2(config: &DdpConfig) -> Result<()> {
    let refuse = |field, reason| {
        Err(DdpError::Config(crate::ConfigError::InvalidConfig {
            field,
            reason,
        }))
    };
    if config.comm_hook.is_some() {
        return refuse(
            "DdpConfig::comm_hook",
            "a communication hook reduces whole buckets on every rank, ZeRO stage 2 \
             reduce-scatters them: drop the hook, or use ZeRO stage 1 (zero)",
        );
    }
    if config.power_sgd.is_some() {
        return refuse(
            "DdpConfig::power_sgd",
            "PowerSGD compresses whole buckets on every rank, ZeRO stage 2 reduce-scatters \
             them: drop PowerSGD, or use ZeRO stage 1 (zero)",
        );
    }
    Ok(())
}

/// Values a Burn line reads from its tensors as f32, one tensor after another; a tensor it
/// cannot read leaves zeros in its place and its first error, for the caller to report after
/// the collective the values are for.
#[derive(Debug, Default)]
pub struct ReadValues {
    /// The values read, tensor after tensor.
    pub values: Vec<f32>,
    /// The first tensor that could not be read, and why.
    pub error: Option<String>,
}

impl ReadValues {
    /// Appends a tensor of `n` elements: its values, or `n` zeros and the error.
    pub fn push<E: std::fmt::Debug>(&mut self, n: usize, read: std::result::Result<Vec<f32>, E>) {
        match read {
            Ok(v) => self.values.extend(v),
            Err(e) => {
                self.values.extend(std::iter::repeat_n(0.0, n));
                self.error.get_or_insert(format!("{e:?}"));
            }
        }
    }
}

/// Values a Burn line writes back into its tensors, one tensor after another (the inverse of
/// [`ReadValues`]: a broadcast's or an all-gather's result).
#[derive(Debug)]
pub struct FlatValues<'a> {
    values: &'a [f32],
    at: usize,
}

impl<'a> FlatValues<'a> {
    /// `values`, from the first.
    pub fn new(values: &'a [f32]) -> Self {
        Self { values, at: 0 }
    }

    /// The next tensor's `n` values; None (and nothing taken) when fewer are left.
    pub fn next(&mut self, n: usize) -> Option<&'a [f32]> {
        let values = self.values.get(self.at..self.at + n)?;
        self.at += n;
        Some(values)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Timeouts, WorldSize};

    #[test]
    fn flat_values_go_back_tensor_after_tensor() {
        let values = [1.0, 2.0, 3.0];
        let mut flat = FlatValues::new(&values);
        assert_eq!(flat.next(2), Some(&values[..2]));
        assert_eq!(flat.next(2), None);
        assert_eq!(flat.next(1), Some(&values[2..]));
        assert_eq!(flat.next(0), Some(&values[3..]));
    }

    #[test]
    fn shards_name_the_owner_and_the_gathered_values_of_each_parameter_by_id() {
        // Ids in visit order; sizes 2, 5, 3: rank 0 owns id 20 (5), rank 1 ids 30 and 10.
        let s = ZeroShards::new(&[(10, 2), (20, 5), (30, 3)], 2);
        assert_eq!(s.ids(), [10, 20, 30]);
        assert!(s.owns(20, Rank(0)) && s.owns(10, Rank(1)) && s.owns(30, Rank(1)));
        assert!(s.owned_elsewhere(10, Rank(0)) && !s.owned_elsewhere(20, Rank(0)));
        assert_eq!(s.owned_by_others(Rank(0)).collect::<Vec<_>>(), [10, 30]);
        assert_eq!(s.owned_by_others(Rank(1)).collect::<Vec<_>>(), [20]);
        // A parameter that is not sharded is nobody's and never dropped.
        assert!(!s.owns(99, Rank(0)) && !s.owned_elsewhere(99, Rank(0)));
        let values: Vec<f32> = (0..10).map(|v| v as f32).collect();
        assert_eq!(s.gathered(20, 5, &values), Some(&values[2..7]));
        assert_eq!(s.gathered(30, 3, &values), Some(&values[7..10]));
        assert_eq!(s.gathered(30, 4, &values), None);
        assert_eq!(s.gathered(99, 1, &values), None);
    }

    #[test]
    fn balance_puts_the_largest_first_on_the_least_loaded() {
        let plan = ZeroPlan::balance(&[10, 1, 7, 3, 3], 2);
        // 10 → 0; 7 → 1; 3 (index 3) → 1; 3 (index 4) → 0; 1 → 1.
        assert_eq!(
            (0..5).map(|i| plan.owner(i).index()).collect::<Vec<_>>(),
            [0, 1, 1, 1, 0]
        );
        assert_eq!(plan.elements_of(Rank(0)), 13);
        assert_eq!(plan.elements_of(Rank(1)), 11);
        // Many equal parameters split evenly.
        let even = ZeroPlan::balance(&[64; 12], 3);
        for r in 0..3 {
            assert_eq!(even.elements_of(Rank(r)), 256);
        }
    }

    #[test]
    fn all_gather_puts_every_parameter_back_in_order() {
        let sizes = [5, 2, 4, 1, 3];
        let groups = ProcessGroup::local(WorldSize::new(3).unwrap(), Timeouts::default());
        let handles: Vec<_> = groups
            .into_iter()
            .map(|pg| {
                std::thread::spawn(move || {
                    let plan = ZeroPlan::balance(&sizes, 3);
                    // Parameter i's values are i*10 + k; each rank sends its own.
                    let mine: Vec<f32> = (0..sizes.len())
                        .filter(|&i| plan.owner(i) == pg.rank())
                        .flat_map(|i| (0..sizes[i]).map(move |k| (i * 10 + k) as f32))
                        .collect();
                    plan.all_gather(&pg, &mine).unwrap()
                })
            })
            .collect();
        let want: Vec<f32> = (0..sizes.len())
            .flat_map(|i| (0..sizes[i]).map(move |k| (i * 10 + k) as f32))
            .collect();
        for h in handles {
            assert_eq!(h.join().unwrap(), want);
        }
    }

    /// Three thread ranks all-gather a "model" of plain vectors through the device-path driver
    /// (the blocks as vectors, the all-gather the process group's): every parameter comes back
    /// everywhere; a rank that packs the wrong elements fails after every run, and the others
    /// get through every run (nobody waits on it).
    #[test]
    fn the_device_runs_put_every_parameter_back_and_a_wrong_pack_fails_its_rank_alone() {
        let sizes = [5, 2, 4, 1, 3, 9];
        let ids: Vec<(u64, usize)> = (0..6).map(|i| (100 + i as u64, sizes[i])).collect();
        for wrong_rank in [None, Some(1)] {
            let groups = ProcessGroup::local(WorldSize::new(3).unwrap(), Timeouts::default());
            let ids = &ids;
            let results: Vec<_> = std::thread::scope(|s| {
                let ranks: Vec<_> = (groups.into_iter())
                    .map(|pg| {
                        s.spawn(move || {
                            let shards = ZeroShards::new(ids, 3);
                            let rank = pg.rank();
                            // Parameter i's values: i*10 + k on its owner, stale (-1) elsewhere.
                            let model: Vec<Vec<f32>> = (0..6)
                                .map(|i| match shards.plan().owner(i) == rank {
                                    true => (0..sizes[i]).map(|k| (i * 10 + k) as f32).collect(),
                                    false => vec![-1.0; sizes[i]],
                                })
                                .collect();
                            let pack = |m: &Vec<Vec<f32>>, range: &Range<usize>| {
                                let mut run = RunParts {
                                    device: Some(()),
                                    ..RunParts::default()
                                };
                                for i in range.clone() {
                                    if shards.plan().owner(i) == rank {
                                        run.parts.push((m[i].clone(), m[i].len()));
                                    }
                                }
                                if wrong_rank == Some(rank.index()) {
                                    run.parts.push((vec![0.0], 1));
                                }
                                run
                            };
                            let zeros = |n: usize, _: &()| vec![0.0; n];
                            let gather = |_: &str, parts: Vec<Vec<f32>>, block: usize| {
                                let send: Vec<f32> = parts.concat();
                                assert_eq!(send.len(), block);
                                let mut all = vec![0.0; block * 3];
                                pg.all_gather(&send, &mut all)?;
                                Ok(all)
                            };
                            let place = |mut m: Vec<Vec<f32>>,
                                         range: Range<usize>,
                                         layout: &RunLayout,
                                         all: &Vec<f32>| {
                                for i in range.clone() {
                                    let at =
                                        shards.gathered_at(100 + i as u64, &range, layout).unwrap();
                                    m[i] = all[at..at + sizes[i]].to_vec();
                                }
                                m
                            };
                            shards.gather_runs_on_device(rank, 6, model, pack, zeros, gather, place)
                        })
                    })
                    .collect();
                ranks.into_iter().map(|h| h.join().unwrap()).collect()
            });
            let want: Vec<Vec<f32>> = (0..6)
                .map(|i| (0..sizes[i]).map(|k| (i * 10 + k) as f32).collect())
                .collect();
            for (rank, got) in results.into_iter().enumerate() {
                match (wrong_rank, got) {
                    (None, Ok(model)) => assert_eq!(model, want, "rank {rank}"),
                    // The others went through every run (as on the host path, they hold zeros
                    // for the failed rank's parameters; its failure stops the job).
                    (Some(w), Ok(_)) if w != rank => {}
                    (Some(w), Err(e)) if w == rank => {
                        assert!(e.to_string().contains("to send, the plan"), "{e}")
                    }
                    (wrong, got) => panic!("rank {rank} (wrong: {wrong:?}): {got:?}"),
                }
            }
        }
    }

    #[test]
    fn runs_of_parameters_gather_alone_what_the_whole_gather_gives() {
        let sizes = [5, 2, 4, 1, 3, 9];
        let plan = ZeroPlan::balance(&sizes, 1);
        // Runs of at most 6 elements; the 9 alone.
        assert_eq!(plan.chunks(6), [0..1, 1..3, 3..5, 5..6]);
        assert_eq!(plan.chunks(100), vec![(0..6)]);
        let groups = ProcessGroup::local(WorldSize::new(3).unwrap(), Timeouts::default());
        let handles: Vec<_> = groups
            .into_iter()
            .map(|pg| {
                std::thread::spawn(move || {
                    let plan = ZeroPlan::balance(&sizes, 3);
                    let ids: Vec<(u64, usize)> = sizes
                        .iter()
                        .enumerate()
                        .map(|(i, &n)| (i as u64, n))
                        .collect();
                    let shards = ZeroShards::new(&ids, 3);
                    let value = |i: usize, k: usize| (i * 10 + k) as f32;
                    let mut got = vec![Vec::new(); sizes.len()];
                    for range in plan.chunks(6) {
                        let mine: Vec<f32> = range
                            .clone()
                            .filter(|&i| plan.owner(i) == pg.rank())
                            .flat_map(|i| (0..sizes[i]).map(move |k| value(i, k)))
                            .collect();
                        let all = plan.all_gather_range(&pg, range.clone(), &mine).unwrap();
                        for i in 0..sizes.len() {
                            let n = sizes[i];
                            if let Some(v) = shards.gathered_in(i as u64, n, range.clone(), &all) {
                                assert!(shards.within(i as u64, &range));
                                got[i] = v.to_vec();
                            }
                        }
                    }
                    got
                })
            })
            .collect();
        for h in handles {
            let got = h.join().unwrap();
            for (i, v) in got.iter().enumerate() {
                let want: Vec<f32> = (0..sizes[i]).map(|k| (i * 10 + k) as f32).collect();
                assert_eq!(v, &want, "parameter {i}");
            }
        }
    }

    #[test]
    fn offsets_and_totals_follow_the_list_and_an_unreadable_value_fails_after_the_gather() {
        let plan = ZeroPlan::balance(&[4, 2, 3], 1);
        assert_eq!(plan.offsets(), [0, 4, 6]);
        assert_eq!(plan.owned_elements(Rank(0)), (9, 9));
        let mut read = ReadValues::default();
        read.push(4, Ok::<_, String>(vec![1.0; 4]));
        read.push(2, Err("a bool tensor"));
        read.push(3, Err("another"));
        assert_eq!(read.values, [1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0]);
        let e = plan.share(&ProcessGroup::single(), read).unwrap_err();
        assert!(e.to_string().contains("\"a bool tensor\""), "{e}");
    }

    #[test]
    fn stage_2_refuses_what_reduces_whole_buckets_and_names_the_fix() {
        use crate::grad::{AllReduce, Compression, GradReduction, PowerSgd};
        assert!(check_stage2(&DdpConfig::default()).is_ok());
        let hook = DdpConfig::default().with_comm_hook(|| {
            Box::new(AllReduce {
                reduction: GradReduction::Mean,
                compression: Compression::None,
            })
        });
        let cases = [
            (
                DdpConfig::default().with_power_sgd(PowerSgd::new(1)),
                "drop PowerSGD",
            ),
            (hook, "drop the hook"),
        ];
        for (config, fix) in cases {
            let e = check_stage2(&config).unwrap_err().to_string();
            assert!(e.contains(fix), "{e}");
        }
    }

    #[test]
    fn a_runs_layout_puts_each_parameter_in_its_owners_padded_block() {
        // Largest first onto the least loaded: 4 to rank 0, 3 then 2 to rank 1.
        let plan = ZeroPlan::balance(&[4, 2, 3], 2);
        let layout = plan.run_layout(0..3);
        assert_eq!(
            (layout.block, layout.owned(Rank(0)), layout.owned(Rank(1))),
            (5, 4, 5)
        );
        assert_eq!(layout.at, [0, 5, 7]);
        // A run of the last two: rank 0 owns nothing of it and sends a block of padding.
        let layout = plan.run_layout(1..3);
        assert_eq!((layout.block, layout.owned(Rank(0))), (5, 0));
        assert_eq!(layout.at, [5, 7]);
        let shards = ZeroShards::new(&[(10, 4), (11, 2), (12, 3)], 2);
        assert_eq!(shards.gathered_at(12, &(1..3), &layout), Some(7));
        assert_eq!(shards.gathered_at(10, &(1..3), &layout), None);
    }

    #[test]
    fn a_wrong_length_is_refused_before_the_collective() {
        let plan = ZeroPlan::balance(&[4, 4], 1);
        let e = plan
            .all_gather(&ProcessGroup::single(), &[0.0; 3])
            .unwrap_err();
        assert!(e.to_string().contains("expected 8"), "{e}");
    }
}
