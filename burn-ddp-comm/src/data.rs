//! Sharding a dataset over the ranks of a job, without Burn: [`ShardPlan`] says which items of
//! a dataset of `n` items are this rank's in an epoch. Each Burn line wraps it in its own
//! `DistributedSampler`, a Burn `Dataset`, whose methods come from
//! [`distributed_sampler!`](crate::distributed_sampler).

use crate::error::{ConfigError, MembershipError};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use crate::group::ProcessGroup;
use crate::types::{Rank, WorldSize};
use crate::{DdpError, Result};

pub use crate::config::per_rank_batch;

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
///
/// Clones share the plan: [`set_epoch`](Self::set_epoch) on one sets the epoch of all.
#[derive(Debug, Clone)]
pub struct ShardPlan {
    /// What a training strategy changes: the epoch and this rank's place.
    state: Arc<PlanState>,
    seed: u64,
    shuffle: bool,
    drop_last: bool,
}

/// The part of a [`ShardPlan`] that changes while it is used, shared with the registry of its
/// group's training plans ([`training_plans`]).
#[derive(Debug)]
struct PlanState {
    /// This rank, and the world size (changed by [`ShardPlan::reshard`] in fault-tolerant jobs).
    rank: AtomicU32,
    world: AtomicU32,
    /// Positions of the epoch's order already used when the current dealing began.
    start: AtomicUsize,
    epoch: AtomicU64,
    /// The items of an epoch (the dataset's length) once the plan was read, when each is
    /// counted once (`usize::MAX`: not known, or a `drop_last` plan).
    items: AtomicUsize,
    /// Whether every rank gets as many items (padded).
    even: AtomicBool,
    /// Whether a fault-tolerant job deals every item once instead of padding
    /// ([`DataEpoch::set_every_item_once`]).
    once: AtomicBool,
    cache: Mutex<Option<Cached>>,
    /// The dataset of the sampler the plan was made for (its `new` or `evaluation`), to be
    /// compared across the ranks ([`check_datasets`]).
    print: Mutex<Option<DatasetPrint>>,
    /// Whether [`check_datasets`] compared it.
    checked: AtomicBool,
}

/// Plans, of any group, holding a [`DatasetPrint`] that [`check_datasets`] has not compared
/// yet (a plan dropped unchecked leaves the count).
static UNCHECKED_PRINTS: AtomicUsize = AtomicUsize::new(0);

impl Drop for PlanState {
    fn drop(&mut self) {
        let printed = self
            .print
            .get_mut()
            .unwrap_or_else(|p| p.into_inner())
            .is_some();
        if printed && !*self.checked.get_mut() {
            UNCHECKED_PRINTS.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

impl PlanState {
    fn reshard(&self, rank: Rank, world: WorldSize, start: usize) -> Result<()> {
        if rank.0 >= world.get() {
            return Err(DdpError::Config(ConfigError::RankOutOfRange {
                rank,
                world,
            }));
        }
        self.rank.store(rank.0, Ordering::SeqCst);
        self.world.store(world.get(), Ordering::SeqCst);
        self.start.store(start, Ordering::SeqCst);
        Ok(())
    }

    fn set_epoch(&self, epoch: u64) {
        self.epoch.store(epoch, Ordering::Relaxed);
        self.start.store(0, Ordering::SeqCst);
    }

    /// Whether the shards are evened out by padding (a plan that pads, unless a fault-tolerant
    /// job deals every item once); a `drop_last` plan drops instead.
    fn pads(&self) -> bool {
        self.even.load(Ordering::Relaxed) && !self.once.load(Ordering::Relaxed)
    }

    /// The epoch's items, and this rank's share of what is left of them, once known.
    fn items_and_share(&self) -> Option<(usize, usize)> {
        let n = Some(self.items.load(Ordering::Relaxed)).filter(|&n| n != usize::MAX)?;
        let m = n - self.start.load(Ordering::SeqCst).min(n);
        let w = self.world.load(Ordering::SeqCst).max(1) as usize;
        // Known only for plans that do not drop: even means padded.
        let share = if self.pads() {
            m.div_ceil(w)
        } else {
            m.saturating_sub(self.rank.load(Ordering::SeqCst) as usize)
                .div_ceil(w)
        };
        Some((n, share))
    }
}

impl DataEpoch for PlanState {
    fn set_epoch(&self, epoch: u64) {
        PlanState::set_epoch(self, epoch);
    }

    fn reshard(&self, rank: Rank, world: WorldSize, start: usize) -> Result<()> {
        PlanState::reshard(self, rank, world, start)
    }

    fn set_every_item_once(&self, once: bool) {
        self.once.store(once, Ordering::Relaxed);
    }
}

/// The plans made on a group ([`ShardPlan::new`], [`ShardPlan::evaluation`], through the line's
/// `DistributedSampler`), each with its group and whether it is a training plan, while they
/// live.
type Registry = Vec<(crate::group::WeakGroup, std::sync::Weak<PlanState>, bool)>;
static TRAINING_PLANS: Mutex<Registry> = Mutex::new(Vec::new());

/// The registry of training plans, without the plans that were dropped.
fn registry() -> std::sync::MutexGuard<'static, Registry> {
    let mut all = TRAINING_PLANS.lock().unwrap_or_else(|p| p.into_inner());
    all.retain(|(_, plan, _)| plan.strong_count() > 0);
    all
}

/// The plans of `group` that are alive, the training plans only if `training`.
fn plans(group: &ProcessGroup, training: bool) -> Vec<Arc<PlanState>> {
    registry()
        .iter()
        .filter(|(g, _, t)| g.is(group) && (*t || !training))
        .filter_map(|(_, plan, _)| plan.upgrade())
        .collect()
}

/// The training plans of `group` that are alive: those made by [`ShardPlan::new`] on it (through
/// a line's `DistributedSampler::new`). A line's training strategy sets their epoch, and deals
/// the rest of an epoch over a new membership, as it does for the samplers given to its
/// `with_sampler`.
pub fn training_plans(group: &ProcessGroup) -> Vec<Arc<dyn DataEpoch>> {
    plans(group, true)
        .into_iter()
        .map(|plan| plan as Arc<dyn DataEpoch>)
        .collect()
}

/// Sets the epoch of every training plan of `group` ([`training_plans`]: a line's
/// `DistributedSampler::new` on it), as a training strategy does at the start of each epoch:
/// what a loop of your own calls through its line's `GradSync::set_epoch` or
/// `DdpSession::set_epoch`, instead of keeping each sampler to set its epoch. Same value on
/// every rank.
pub fn set_training_epoch(group: &ProcessGroup, epoch: impl EpochNumber) {
    let epoch = epoch.epoch();
    for plan in plans(group, true) {
        plan.set_epoch(epoch);
    }
}

/// The items of an epoch of the data that `group`'s rank reads `share` items of (the
/// dataset's length, each item counted once): found among the group's plans that were read
/// (a line's `DistributedSampler`, training or evaluation) by this rank's share of what is
/// left of the epoch, when every plan with that share agrees on it.
pub fn items_of_share(group: &ProcessGroup, share: usize) -> Option<usize> {
    let all = plans(group, false);
    let mut known = all
        .iter()
        .filter_map(|p| p.items_and_share())
        .filter(|&(_, s)| s == share)
        .map(|(n, _)| n);
    let first = known.next()?;
    known.all(|n| n == first).then_some(first)
}

/// Runs `work`, a pass over the job's data that the ranks make together after training or
/// outside it (an evaluation whose counts are all-reduced), so that a fault-tolerant job
/// survives the loss of a rank during it: when `work` fails because the group failed
/// ([`DdpError::is_peer_failure`]), the ranks that can still reach the job agree on a new
/// membership ([`ProcessGroup::recover`]), every sampler made on the group (the line's
/// `DistributedSampler::new` and `::evaluation`) is dealt again over it from the start of its
/// epoch, and `work` runs again from its start, on every rank of the new membership. `work`
/// must start from nothing each time (an evaluation does). Outside fault-tolerant jobs it runs
/// `work` once.
///
/// ```no_run
/// # fn doc(pg: &burn_ddp_comm::ProcessGroup) -> burn_ddp_comm::Result<()> {
/// use burn_ddp_comm::ReduceOp;
/// let hits = burn_ddp_comm::data::surviving(pg, || {
///     let mut counts = [0.0f64; 2]; // score this rank's shard of the test set here
///     pg.all_reduce(&mut counts, ReduceOp::Sum)?;
///     Ok::<_, burn_ddp_comm::DdpError>(counts)
/// })?;
/// # Ok(()) }
/// ```
///
/// # Errors
/// What `work` returns when it is not a failure of the group (or the job is not
/// fault-tolerant); [`ProcessGroup::recover`]'s errors: this rank was left out of the new
/// membership, or too few ranks are left.
pub fn surviving<T, E>(group: &ProcessGroup, mut work: impl FnMut() -> Result<T, E>) -> Result<T, E>
where
    E: FailureOf + From<DdpError>,
{
    // A replacement let in now would start training, not this work.
    group.close_joins();
    loop {
        let e = match work() {
            Ok(done) => return Ok(done),
            Err(e) => e,
        };
        let failure = e.ddp_error();
        let Some(cause) = failure.filter(|c| group.is_fault_tolerant() && c.is_peer_failure())
        else {
            return Err(e);
        };
        // Every rank holds the state training ended with: none is behind.
        let rec = group.recover(cause, Some(0))?;
        for plan in plans(group, false) {
            plan.reshard(rec.rank, rec.world, 0)?;
        }
        if group.is_main() {
            println!(
                "[membership] {} (after training: the work the ranks were doing together runs \
                 again over the new membership)",
                rec.summary()
            );
        }
    }
}

/// An error that may be a [`DdpError`]: what [`surviving`]'s work returns, a `DdpError` or a
/// boxed error (a program's own, or a `DdpError` it passed on with `?`).
pub trait FailureOf {
    /// The [`DdpError`] this error is, if it is one.
    fn ddp_error(&self) -> Option<&DdpError>;
}

impl FailureOf for DdpError {
    fn ddp_error(&self) -> Option<&DdpError> {
        Some(self)
    }
}

impl FailureOf for Box<dyn std::error::Error + Send + Sync> {
    fn ddp_error(&self) -> Option<&DdpError> {
        self.downcast_ref()
    }
}

/// An epoch number as a training loop counts it, for `set_epoch`: `u64`, `usize`, `u32`, or
/// `i32` (an integer literal; a negative one counts as epoch 0).
pub trait EpochNumber: Copy {
    /// The epoch as the permutation's seed takes it.
    fn epoch(self) -> u64;
}

impl EpochNumber for u64 {
    fn epoch(self) -> u64 {
        self
    }
}

impl EpochNumber for usize {
    fn epoch(self) -> u64 {
        self as u64
    }
}

impl EpochNumber for u32 {
    fn epoch(self) -> u64 {
        u64::from(self)
    }
}

impl EpochNumber for i32 {
    fn epoch(self) -> u64 {
        u64::try_from(self).unwrap_or(0)
    }
}

/// What a dataset looked like when a sampler was made for it: its length, and a digest of the
/// `Debug` text of up to [`DatasetPrint::SAMPLED`] of its items, spread over it.
/// [`check_datasets`] compares the prints of the ranks' samplers: a sampler deals shards of one
/// dataset as if every rank held the same one, which a dataset generated from an unseeded
/// generator, or read from different files, is not. The items are read twice: a dataset whose
/// items change from one read to the next (random augmentation in `get`) has no digest, and
/// only its length is compared.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DatasetPrint {
    len: u64,
    digest: Option<u64>,
}

impl DatasetPrint {
    /// How many items are read (twice each) and digested.
    pub const SAMPLED: usize = 16;

    /// The print of a dataset of `len` items whose item `i` `get(i)` returns (an item that
    /// cannot be read is digested as missing).
    pub fn of<I: std::fmt::Debug, G: ItemOf<I>>(
        len: usize,
        mut get: impl FnMut(usize) -> G,
    ) -> Self {
        let mut pass = || {
            use std::fmt::Write as _;
            let mut text = String::new();
            let sampled = len.min(Self::SAMPLED);
            for k in 0..sampled {
                let i = k * len / sampled;
                // Formatting into a String cannot fail.
                let _ = match get(i).item() {
                    Some(item) => write!(text, "{i}:{item:?};"),
                    None => write!(text, "{i}:missing;"),
                };
            }
            crate::types::digest(text.as_bytes())
        };
        let (first, second) = (pass(), pass());
        Self {
            len: len as u64,
            digest: (first == second).then_some(first),
        }
    }

    /// The dataset's length.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the dataset was empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The digest of its sampled items; `None` when they changed between two reads.
    pub fn digest(&self) -> Option<u64> {
        self.digest
    }
}

/// What a Burn release's `Dataset::get` returns (`Option<I>` on Burn 0.21, `Result<I, _>` on
/// 0.22 and 0.23), as an item if there is one.
pub trait ItemOf<I> {
    /// The item, if one was read.
    fn item(self) -> Option<I>;
}

impl<I> ItemOf<I> for Option<I> {
    fn item(self) -> Option<I> {
        self
    }
}

impl<I, E> ItemOf<I> for std::result::Result<I, E> {
    fn item(self) -> Option<I> {
        self.ok()
    }
}

/// Compares across the ranks of `group` the datasets of the samplers made on it (a line's
/// `DistributedSampler::new` and `::evaluation`) since the last comparison, by their
/// [`DatasetPrint`]s: one small all-gather, and nothing at all when no sampler was made since.
/// Each line's gradient synchronisation calls it before a step, so a job whose ranks hold
/// different data (a dataset generated without a seed) fails at its first step instead of
/// training on shards of different datasets. Not in fault-tolerant jobs, whose ranks may make
/// their samplers in different memberships (a replacement makes its own when it joins).
///
/// # Errors
/// [`ConfigError::DatasetsDiffer`] naming the sampler and the ranks whose datasets differ, how,
/// and how to fix it; the all-gather's failures.
pub fn check_datasets(group: &ProcessGroup) -> Result<()> {
    // Every step of every line calls this: with no print waiting anywhere, one atomic load.
    if group.is_fault_tolerant() || UNCHECKED_PRINTS.load(Ordering::Relaxed) == 0 {
        return Ok(());
    }
    // The group's samplers in the order they were made, numbered from 1.
    let fresh: Vec<(usize, Arc<PlanState>, DatasetPrint)> = plans(group, false)
        .into_iter()
        .enumerate()
        .filter(|(_, p)| !p.checked.load(Ordering::Relaxed))
        .filter_map(|(i, p)| {
            let print = (*p.print.lock().unwrap_or_else(|e| e.into_inner()))?;
            Some((i + 1, p, print))
        })
        .collect();
    if fresh.is_empty() {
        return Ok(());
    }
    // Each sampler as [its number, length, digest, whether it has a digest].
    let mine: Vec<[u64; 4]> = fresh
        .iter()
        .map(|(n, _, print)| {
            let digest = print.digest.unwrap_or(0);
            [
                *n as u64,
                print.len,
                digest,
                u64::from(print.digest.is_some()),
            ]
        })
        .collect();
    for (_, plan, _) in &fresh {
        if !plan.checked.swap(true, Ordering::Relaxed) {
            UNCHECKED_PRINTS.fetch_sub(1, Ordering::Relaxed);
        }
    }
    let all = group.all_gather_bytes(bytemuck::cast_slice(&mine))?;
    let decode = |bytes: &[u8]| bytemuck::pod_collect_to_vec::<u8, [u64; 4]>(bytes);
    let first = decode(&all[0]);
    for (r, bytes) in all.iter().enumerate().skip(1) {
        let theirs = decode(bytes);
        if theirs.len() != first.len() {
            return Err(DdpError::Config(ConfigError::DatasetsDiffer {
                rank: group.rank(),
                sampler: first.len().min(theirs.len()) + 1,
                detail: format!(
                    "rank 0 made {} DistributedSampler(s) on the group since the last check, \
                     rank {r} made {}: every rank must make the same samplers in the same order",
                    first.len(),
                    theirs.len()
                ),
            }));
        }
        for (a, b) in first.iter().zip(&theirs) {
            let detail = if a[0] != b[0] {
                format!("rank 0's is sampler {}, rank {r}'s sampler {}", a[0], b[0])
            } else if a[1] != b[1] {
                format!("rank 0's has {} items, rank {r}'s {}", a[1], b[1])
            } else if a[3] == 1 && b[3] == 1 && a[2] != b[2] {
                format!(
                    "both have {} items, but they differ (among {} items read on each rank and \
                     compared by their Debug text)",
                    a[1],
                    (a[1] as usize).min(DatasetPrint::SAMPLED)
                )
            } else {
                continue;
            };
            return Err(DdpError::Config(ConfigError::DatasetsDiffer {
                rank: group.rank(),
                sampler: a[0] as usize,
                detail,
            }));
        }
    }
    Ok(())
}

/// This rank's indices, and what they were computed for.
#[derive(Debug)]
struct Cached {
    key: Dealing,
    indices: Arc<[usize]>,
}

/// What a dealing depends on besides the settings: the epoch, the dataset's length, this
/// rank's place and where the dealing starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Dealing {
    epoch: u64,
    n: usize,
    rank: u32,
    world: u32,
    start: usize,
    even: bool,
    /// The plan's own settings: clones of a plan share its state (and this cache) but may set
    /// their own.
    seed: Option<u64>,
    drop_last: bool,
}

impl ShardPlan {
    /// The share of this process's rank in `group` for training. Defaults as PyTorch:
    /// shuffled, seed 0, padded (not `drop_last`), epoch 0. The plan is one of the group's
    /// [`training_plans`]: a line's training strategy on `group` sets its epoch.
    pub fn new(group: &ProcessGroup) -> Self {
        Self::listed(group, true)
    }

    /// A plan of `group`'s rank, in the registry of its plans.
    fn listed(group: &ProcessGroup, training: bool) -> Self {
        let plan = Self::build(group.rank().0, group.world_size().get());
        registry().push((group.downgrade(), Arc::downgrade(&plan.state), training));
        plan
    }

    /// Whether every rank gets as many items: the plan's setting (the state's flag: the
    /// registry reads it too), unless a fault-tolerant job deals every item once instead of
    /// padding ([`DataEpoch::set_every_item_once`]; a `drop_last` plan still drops).
    fn even(&self) -> bool {
        self.state.even.load(Ordering::Relaxed)
            && (self.drop_last || !self.state.once.load(Ordering::Relaxed))
    }

    fn dealing(&self, n: usize) -> Dealing {
        if !self.drop_last {
            self.state.items.store(n, Ordering::Relaxed);
        }
        Dealing {
            epoch: self.epoch(),
            n,
            rank: self.state.rank.load(Ordering::SeqCst),
            world: self.state.world.load(Ordering::SeqCst).max(1),
            start: self.state.start.load(Ordering::SeqCst).min(n),
            even: self.even(),
            seed: self.shuffle.then_some(self.seed),
            drop_last: self.drop_last,
        }
    }

    /// Deals the rest of the current epoch over a new membership (a fault-tolerant job after
    /// ranks left or joined): this rank is `rank` of `world`, and the first `start` positions
    /// of the epoch's order (the same on every rank) were already used. Every rank of the new
    /// membership calls it with the same `world` and `start`; the remaining items are dealt as
    /// at the start of an epoch (strided, padded or dropped to even shards; each once when
    /// [`DataEpoch::set_every_item_once`] says so, as a fault-tolerant job does). The next
    /// [`set_epoch`](Self::set_epoch) keeps the membership and starts at 0 again.
    ///
    /// # Errors
    /// `RankOutOfRange` if `rank` is not below `world`.
    pub fn reshard(&self, rank: Rank, world: WorldSize, start: usize) -> Result<()> {
        self.state.reshard(rank, world, start)
    }

    /// The share of this process's rank for validation or evaluation: every item exactly once
    /// over all ranks, in order (no shuffle, shards that differ by at most one item).
    pub fn evaluation(group: &ProcessGroup) -> Self {
        Self::listed(group, false)
            .with_shuffle(false)
            .with_even_shards(false)
    }

    /// The share of `rank` in a world of `world` ranks (PyTorch's `num_replicas`, `rank`).
    ///
    /// # Errors
    /// `RankOutOfRange` if `rank` is not below `world`.
    pub fn with_replicas(rank: Rank, world: WorldSize) -> Result<Self> {
        if rank.0 >= world.get() {
            return Err(DdpError::Config(ConfigError::RankOutOfRange {
                rank,
                world,
            }));
        }
        Ok(Self::build(rank.0, world.get()))
    }

    fn build(rank: u32, world: u32) -> Self {
        Self {
            state: Arc::new(PlanState {
                rank: AtomicU32::new(rank),
                world: AtomicU32::new(world),
                start: AtomicUsize::new(0),
                epoch: AtomicU64::new(0),
                items: AtomicUsize::new(usize::MAX),
                even: AtomicBool::new(true),
                once: AtomicBool::new(false),
                cache: Mutex::new(None),
                print: Mutex::new(None),
                checked: AtomicBool::new(false),
            }),
            seed: 0,
            shuffle: true,
            drop_last: false,
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
        self.state.even.store(even, Ordering::Relaxed);
        self.invalidate();
        self
    }

    /// Sets the epoch, which selects the permutation, and deals it from its start. Same value
    /// on every rank; any integer a loop counts in ([`EpochNumber`]).
    pub fn set_epoch(&self, epoch: impl EpochNumber) {
        self.state.set_epoch(epoch.epoch());
    }

    /// Records what the dataset this plan deals looked like ([`DatasetPrint`]), for
    /// [`check_datasets`] to compare across the ranks. A line's `DistributedSampler::new` and
    /// `::evaluation` call it.
    #[doc(hidden)]
    pub fn with_dataset_print(self, print: DatasetPrint) -> Self {
        let mut slot = self.state.print.lock().unwrap_or_else(|p| p.into_inner());
        if slot.replace(print).is_none() && !self.state.checked.load(Ordering::Relaxed) {
            UNCHECKED_PRINTS.fetch_add(1, Ordering::Relaxed);
        }
        drop(slot);
        self
    }

    /// The current epoch.
    pub fn epoch(&self) -> u64 {
        self.state.epoch.load(Ordering::Relaxed)
    }

    fn invalidate(&mut self) {
        *self.state.cache.lock().unwrap_or_else(|p| p.into_inner()) = None;
    }

    /// Items of this rank's share of a dataset of `n` items (of what is left of the epoch
    /// after a [`reshard`](Self::reshard)).
    pub fn len(&self, n: usize) -> usize {
        let d = self.dealing(n);
        let (m, w) = (n - d.start, d.world as usize);
        if !self.even() {
            m.saturating_sub(d.rank as usize).div_ceil(w)
        } else if self.drop_last {
            m / w
        } else {
            m.div_ceil(w)
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
        let d = self.dealing(n);
        d.rank as usize + i * d.world as usize >= n - d.start
    }

    /// This rank's indices into a dataset of `n` items for the current epoch, in order.
    pub fn indices(&self, n: usize) -> Arc<[usize]> {
        let key = self.dealing(n);
        let mut cache = self.state.cache.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(c) = cache.as_ref() {
            if c.key == key {
                return Arc::clone(&c.indices);
            }
        }
        let idx: Arc<[usize]> = shard(
            n,
            key.start,
            key.rank as usize,
            key.world as usize,
            key.seed.map(|seed| (seed, key.epoch)),
            if key.even {
                Tail::Even {
                    drop_last: key.drop_last,
                }
            } else {
                Tail::Uneven
            },
        )
        .into();
        *cache = Some(Cached {
            key,
            indices: Arc::clone(&idx),
        });
        idx
    }
}

/// A Burn line's `DistributedSampler<D>`: the struct (fields `dataset: D` and `plan:
/// ShardPlan`), its constructors, builders, epoch and indices delegated to the plan, and its
/// [`DataEpoch`], so that every line offers the same sampler from one definition. `$dataset` is
/// that line's `Dataset` trait; the line writes only its `Dataset` impl (reading `self.dataset`
/// through `self.plan`), which differs between Burn releases.
///
/// ```ignore
/// burn_ddp_comm::distributed_sampler! {
///     /// (the line's documentation)
///     pub struct DistributedSampler<D>; dataset: Dataset<I>
/// }
/// ```
#[macro_export]
macro_rules! distributed_sampler {
    ($(#[$meta:meta])* $vis:vis struct $name:ident<D>; dataset: $dataset:path) => {
        $(#[$meta])*
        #[derive(Debug)]
        $vis struct $name<D> {
            dataset: ::std::sync::Arc<D>,
            plan: $crate::data::ShardPlan,
        }

        /// A clone shares the dataset and the plan: give a clone to the data loader and keep
        /// the sampler to set its epoch.
        impl<D> ::std::clone::Clone for $name<D> {
            fn clone(&self) -> Self {
                Self {
                    dataset: ::std::sync::Arc::clone(&self.dataset),
                    plan: self.plan.clone(),
                }
            }
        }

        impl<D> $name<D> {
            $crate::distributed_sampler!(@methods $dataset);
        }

        impl<D: Send + Sync> $crate::data::DataEpoch for $name<D> {
            fn set_epoch(&self, epoch: u64) {
                self.plan.set_epoch(epoch);
            }

            fn reshard(
                &self,
                rank: $crate::Rank,
                world: $crate::WorldSize,
                start: usize,
            ) -> $crate::Result<()> {
                self.plan.reshard(rank, world, start)
            }

            fn set_every_item_once(&self, once: bool) {
                $crate::data::DataEpoch::set_every_item_once(&self.plan, once);
            }
        }
    };
    (@methods $dataset:path) => {
        /// The share of `dataset` of this process's rank in `group`, for training. Defaults
        /// as PyTorch: shuffled, seed 0, padded (not `drop_last`), epoch 0. A training
        /// strategy on `group` sets its epoch (no `with_sampler` needed); in a loop of your
        /// own, call [`set_epoch`](Self::set_epoch) at the start of every epoch.
        ///
        /// Every rank must hold the same dataset: the sampler records its length and a digest
        /// of a few of its items (their `Debug` text), which the next gradient synchronisation
        /// compares across the ranks, failing with
        /// [`ConfigError::DatasetsDiffer`](crate::ConfigError::DatasetsDiffer) when they
        /// differ (a dataset generated from an unseeded generator). For items without `Debug`,
        /// `with_plan(dataset, ShardPlan::new(group))` makes the same sampler unchecked.
        pub fn new<I>(dataset: D, group: &$crate::ProcessGroup) -> Self
        where
            D: $dataset,
            I: ::std::fmt::Debug,
        {
            Self::printed(dataset, $crate::data::ShardPlan::new(group))
        }

        /// The share of `dataset` of this process's rank for validation or evaluation: every
        /// item exactly once over all ranks, in order (no shuffle, shards that differ by at most
        /// one item). The same as `new(..).with_shuffle(false).with_even_shards(false)`; its
        /// epoch never matters, so a training strategy need not set it.
        /// Its dataset is compared across the ranks as `new`'s is.
        pub fn evaluation<I>(dataset: D, group: &$crate::ProcessGroup) -> Self
        where
            D: $dataset,
            I: ::std::fmt::Debug,
        {
            Self::printed(dataset, $crate::data::ShardPlan::evaluation(group))
        }

        /// The sampler of `plan` over `dataset`, with the dataset's print for the comparison
        /// across the ranks.
        fn printed<I>(dataset: D, plan: $crate::data::ShardPlan) -> Self
        where
            D: $dataset,
            I: ::std::fmt::Debug,
        {
            let print = $crate::data::DatasetPrint::of(dataset.len(), |i| dataset.get(i));
            Self::with_plan(dataset, plan.with_dataset_print(print))
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
            Ok(Self::with_plan(
                dataset,
                $crate::data::ShardPlan::with_replicas(rank, world)?,
            ))
        }

        /// The share of `dataset` that `plan` deals (a plan built once for several datasets
        /// of the job, or another sampler's [`plan`](Self::plan) cloned).
        pub fn with_plan(dataset: D, plan: $crate::data::ShardPlan) -> Self {
            Self {
                dataset: ::std::sync::Arc::new(dataset),
                plan,
            }
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

        /// Sets the epoch, which selects the permutation (and so every clone's). Same value on
        /// every rank; any integer a loop counts in (`usize`, `u64`, `u32`, an integer
        /// literal).
        pub fn set_epoch(&self, epoch: impl $crate::data::EpochNumber) {
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
            &*self.dataset
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

    /// Deals the rest of the current epoch over a new membership of a fault-tolerant job
    /// (see [`ShardPlan::reshard`]).
    ///
    /// # Errors
    /// The default: this data cannot be dealt again ([`MembershipError::NotFaultTolerant`]).
    fn reshard(&self, rank: Rank, world: WorldSize, start: usize) -> Result<()> {
        let _ = (rank, world, start);
        Err(DdpError::Membership(MembershipError::NotFaultTolerant {
            what: "a sampler registered with the training strategy that cannot deal the rest \
                   of an epoch over a new membership",
            reason: "use burn-ddp's DistributedSampler, or implement DataEpoch::reshard",
        }))
    }

    /// Whether to deal a fault-tolerant job's training items every one once — shards that
    /// differ by at most one item, the training split's last step partial (the ranks without
    /// a batch take part with no gradient) — instead of evening them out by padding, which
    /// trains up to `world - 1` items twice whenever a change of membership leaves a rest
    /// that the new world size does not divide. A fault-tolerant strategy sets it before
    /// each dealing: `true`, unless the model has layers whose forward pass runs collectives
    /// (`SyncBatchNorm`), which a rank without a batch cannot join. The default ignores it
    /// (the data deals as it does).
    fn set_every_item_once(&self, once: bool) {
        let _ = once;
    }
}

impl DataEpoch for ShardPlan {
    fn set_epoch(&self, epoch: u64) {
        self.state.set_epoch(epoch);
    }

    fn reshard(&self, rank: Rank, world: WorldSize, start: usize) -> Result<()> {
        ShardPlan::reshard(self, rank, world, start)
    }

    fn set_every_item_once(&self, once: bool) {
        self.state.set_every_item_once(once);
    }
}

/// Rank `rank`'s indices among `0..n` in a world of `world`, shuffled with `(seed, epoch)` if
/// given, dealing the order from position `start` on.
fn shard(
    n: usize,
    start: usize,
    rank: usize,
    world: usize,
    shuffle: Option<(u64, u64)>,
    tail: Tail,
) -> Vec<usize> {
    let mut order: Vec<usize> = (0..n).collect();
    if let Some((seed, epoch)) = shuffle {
        permute(&mut order, seed, epoch);
    }
    let rest = &order[start.min(n)..];
    let m = rest.len();
    if m == 0 {
        return Vec::new();
    }
    let total = match tail {
        Tail::Uneven => m,
        Tail::Even { drop_last: true } => m / world * world,
        Tail::Even { drop_last: false } => m.div_ceil(world) * world,
    };
    // Padding repeats the rest of the order from its start (cycling when m < world).
    (rank..total).step_by(world).map(|i| rest[i % m]).collect()
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
        /// A fault-tolerant job that trained `k` steps of batch `b` at world `w`, then went on
        /// at world `w2`: every item of the epoch's order is dealt exactly once over the two
        /// dealings (the first's consumed prefix, then the rest), but the padding.
        #[test]
        fn a_reshard_deals_the_rest_of_the_epoch_once(
            n in 1usize..300, w in 1u32..6, w2 in 1u32..6, b in 1usize..9, k in 0usize..40,
            seed in any::<u64>(), epoch in 0u64..100, shuffle in any::<bool>(), even in any::<bool>(),
        ) {
            let build = |world: u32| -> Vec<ShardPlan> {
                let ws = WorldSize::new(world).unwrap();
                (0..world)
                    .map(|r| {
                        let p = ShardPlan::with_replicas(Rank(r), ws)
                            .unwrap()
                            .with_seed(seed)
                            .with_shuffle(shuffle)
                            .with_even_shards(even);
                        p.set_epoch(epoch);
                        p
                    })
                    .collect()
            };
            let first = build(w);
            // The first dealing's first k batches (the consumed positions form a prefix).
            let per = first[0].len(n);
            let used = (k * b).min(per);
            let mut seen = vec![0usize; n];
            for p in &first {
                for i in 0..used.min(p.len(n)) {
                    seen[p.index(n, i).unwrap()] += 1;
                }
            }
            let start = (used * w as usize).min(n);
            // The rest, at world w2 (plans of the same ranks re-dealt, others new).
            let second = build(w2);
            for (r, p) in second.iter().enumerate() {
                p.reshard(Rank(r as u32), WorldSize::new(w2).unwrap(), start).unwrap();
                for i in 0..p.len(n) {
                    if !p.is_padding(n, i) {
                        seen[p.index(n, i).unwrap()] += 1;
                    }
                }
            }
            // Every item once, except the first dealing's padding, which may repeat some.
            let padded_first = !even || used * (w as usize) <= n;
            prop_assert!(seen.iter().all(|&c| c >= 1), "an item was never dealt: {seen:?}");
            if padded_first {
                prop_assert!(seen.iter().all(|&c| c == 1), "an item was dealt twice: {seen:?}");
            }
            // Every rank of the second dealing agrees on the lengths (even shards).
            if even {
                let l0 = second[0].len(n);
                prop_assert!(second.iter().all(|p| p.len(n) == l0));
            }
        }

        /// A fault-tolerant job's dealing (every item once, `DataEpoch::set_every_item_once`):
        /// after `start` positions, the rest is dealt over `w` ranks with each item exactly
        /// once, nothing to skip as padding, shares that differ by at most one item (the
        /// largest first), strided so that full steps of any batch size use a prefix; the
        /// plans' item count is known. A `drop_last` plan still drops.
        #[test]
        fn a_fault_tolerant_dealing_deals_every_item_once(
            n in 1usize..300, w in 1u32..7, start in 0usize..300, seed in any::<u64>(),
            epoch in 0u64..100, drop_last in any::<bool>(),
        ) {
            let start = start.min(n);
            let ws = WorldSize::new(w).unwrap();
            let plans: Vec<ShardPlan> = (0..w)
                .map(|r| {
                    let p = ShardPlan::with_replicas(Rank(r), ws)
                        .unwrap()
                        .with_seed(seed)
                        .with_drop_last(drop_last);
                    DataEpoch::set_every_item_once(&p, true);
                    p.set_epoch(epoch);
                    p.reshard(Rank(r), ws, start).unwrap();
                    p
                })
                .collect();
            let m = n - start;
            let mut seen = vec![0usize; n];
            for (r, p) in plans.iter().enumerate() {
                let want = if drop_last { m / w as usize } else { m.saturating_sub(r).div_ceil(w as usize) };
                prop_assert_eq!(p.len(n), want);
                for i in 0..p.len(n) {
                    prop_assert!(!p.is_padding(n, i));
                    seen[p.index(n, i).unwrap()] += 1;
                }
                if !drop_last {
                    prop_assert_eq!(p.state.items_and_share(), Some((n, want)));
                }
            }
            prop_assert!(seen.iter().all(|&c| c <= 1), "an item dealt twice: {seen:?}");
            let dealt: usize = seen.iter().sum();
            prop_assert_eq!(dealt, if drop_last { m / w as usize * w as usize } else { m });
            // The positions dealt are the rest of the epoch's order: its first `start`
            // positions are the same dealing's, which is not dealt again.
            let mut order: Vec<usize> = (0..n).collect();
            permute(&mut order, seed, epoch);
            prop_assert!(order[..start].iter().all(|&i| seen[i] == 0));
        }
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
        assert!(
            matches!(err, DdpError::Config(ConfigError::RankOutOfRange { .. })),
            "{err}"
        );
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

    /// The print of `n` items whose item `i` is `item(i)`.
    fn print_of(n: usize, item: impl Fn(usize) -> u64) -> DatasetPrint {
        DatasetPrint::of(n, |i| Some(item(i)))
    }

    #[test]
    fn a_print_tells_datasets_apart_by_length_and_items_and_leaves_changing_items_out() {
        let same = print_of(100, |i| i as u64);
        assert_eq!(same, print_of(100, |i| i as u64));
        assert_eq!(same.len(), 100);
        assert!(same.digest().is_some());
        assert_ne!(same.digest(), print_of(101, |i| i as u64).digest());
        // Item 0 is always read: a generator seeded differently changes it.
        assert_ne!(same.digest(), print_of(100, |i| i as u64 + 7).digest());
        // Items that change between two reads (augmentation in `get`): no digest.
        let reads = std::sync::atomic::AtomicU64::new(0);
        let changing = DatasetPrint::of(100, |_| Some(reads.fetch_add(1, Ordering::Relaxed)));
        assert_eq!(changing.digest(), None);
        assert_eq!(changing.len(), 100);
        // An item that cannot be read is digested as missing, not skipped.
        let missing = DatasetPrint::of(4, |i| (i != 2).then_some(i));
        assert_ne!(missing.digest(), DatasetPrint::of(4, Some).digest());
    }

    #[test]
    fn datasets_that_differ_between_ranks_fail_the_check_naming_the_sampler_and_the_fix() {
        // Rank 1's second sampler has other items (a generator without a seed).
        let out = crate::group::on_local_ranks(2, |g| {
            let r = g.rank().0 as u64;
            let _a = ShardPlan::new(&g).with_dataset_print(print_of(64, |i| i as u64));
            let _b = ShardPlan::new(&g).with_dataset_print(print_of(64, |i| i as u64 * (1 + r)));
            check_datasets(&g).map_err(|e| e.to_string())
        });
        for (rank, out) in out.iter().enumerate() {
            let e = out.as_ref().unwrap_err();
            assert!(e.contains(&format!("[rank {rank}]")), "{e}");
            assert!(e.contains("DistributedSampler 2 "), "{e}");
            assert!(e.contains("both have 64 items, but they differ"), "{e}");
            assert!(e.contains("seed_from_u64"), "{e}");
        }
        // Lengths.
        let out = crate::group::on_local_ranks(2, |g| {
            let n = 64 + g.rank().0 as usize;
            let _a = ShardPlan::evaluation(&g).with_dataset_print(print_of(n, |i| i as u64));
            check_datasets(&g).map_err(|e| e.to_string())
        });
        let e = out[1].as_ref().unwrap_err();
        assert!(e.contains("rank 0's has 64 items, rank 1's 65"), "{e}");
    }

    #[test]
    fn the_same_datasets_pass_once_and_changing_items_are_compared_by_length() {
        let out = crate::group::on_local_ranks(3, |g| {
            let r = g.rank().0 as u64;
            let same = ShardPlan::new(&g).with_dataset_print(print_of(50, |i| i as u64));
            // Every rank's items change from one read to the next: its length alone is compared.
            let reads = std::sync::atomic::AtomicU64::new(r * 1000);
            let augmented = ShardPlan::new(&g).with_dataset_print(DatasetPrint::of(50, |_| {
                Some(reads.fetch_add(1, Ordering::Relaxed))
            }));
            check_datasets(&g)?;
            // Compared once: a second check with no new sampler runs no collective, so rank 0
            // alone calling it does not wait for the others.
            if g.is_main() {
                check_datasets(&g)?;
            }
            // Samplers made later are compared at the next check.
            let later =
                ShardPlan::new(&g).with_dataset_print(print_of(10 + r as usize, |i| i as u64));
            let e = check_datasets(&g).unwrap_err().to_string();
            drop((same, augmented, later));
            Ok::<_, DdpError>(e)
        });
        for (rank, e) in out.into_iter().enumerate() {
            let e = e.unwrap();
            assert!(e.contains("DistributedSampler 3 "), "rank {rank}: {e}");
        }
    }

    #[test]
    fn clones_share_the_epoch_and_keep_their_own_settings() {
        let plan = ShardPlan::with_replicas(Rank(0), WorldSize::new(2).unwrap()).unwrap();
        let shuffled = plan.clone().with_seed(9);
        let in_order = plan.clone().with_shuffle(false);
        // Any integer a loop counts in.
        shuffled.set_epoch(3usize);
        assert_eq!(in_order.epoch(), 3);
        plan.set_epoch(4u64);
        assert_eq!(shuffled.epoch(), 4);
        in_order.set_epoch(5);
        assert_eq!(plan.epoch(), 5);
        in_order.set_epoch(-1);
        assert_eq!(plan.epoch(), 0);
        // The shared cache does not hand one clone's order to another.
        assert_eq!(&in_order.indices(10)[..], &[0, 2, 4, 6, 8]);
        assert_ne!(&shuffled.indices(10)[..], &[0, 2, 4, 6, 8]);
        assert_eq!(&in_order.indices(10)[..], &[0, 2, 4, 6, 8]);
    }

    #[test]
    fn the_mean_and_sums_of_the_ranks_values_reach_every_rank() {
        let out = crate::group::on_local_ranks(3, |g| {
            let r = f64::from(g.rank().0);
            let mean = g.mean(r as f32 * 2.0)?;
            let sums = g.sum([r, 1.0])?;
            Ok::<_, DdpError>((mean, sums))
        });
        for o in out {
            assert_eq!(o.unwrap(), (2.0, [3.0, 3.0]));
        }
    }
}
