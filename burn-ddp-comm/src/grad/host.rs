//! Host-staged gradient buckets: packed as f32 on the calling thread, all-reduced one after
//! another on a communication thread while the next bucket is being packed, and read back.
//!
//! Invariant that keeps ranks in step: every bucket of the plan is launched in every step, in
//! index order, on every rank; a parameter without a gradient on this rank is sent as zeros.
//! Each bucket carries one presence flag per parameter after its values (1 where this rank had
//! a gradient), reduced with them, so every rank learns which parameters some rank had a
//! gradient for: those get the reduced value on every rank; those no rank had stay absent.

use crate::error::{CollectiveError, ModelError};
use std::sync::mpsc::RecvTimeoutError;
use std::time::Duration;

use super::reducer::{BucketTransport, Pass};
use super::shared::{BucketBuf, SharedBuckets};
use super::{BucketPlan, BucketShape, CommHook, DdpConfig, GradReduction, HookChoice, Worker};
use crate::group::ProcessGroup;
use crate::{DdpError, Result};

/// Extra wait, beyond the collective timeout, for a communication thread's answer (every
/// transport's: the host-staged one here, the NCCL issuers of both lines).
pub const ANSWER_SLACK: Duration = Duration::from_secs(30);

enum HostJob {
    /// A bucket of the plan whose layout is `plan` ([`plan_key`]), reduced by that plan's hook.
    Bucket {
        plan: u64,
        bucket: usize,
        data: BucketBuf,
        layout: Option<BucketShape>,
        /// Reduce-scattered (a sharded plan's bucket, ZeRO stage 2), not reduced by the hook:
        /// the answer is this rank's block alone.
        scatter: bool,
    },
    /// Not a bucket: one all-reduce issued during a pass, uncompressed, behind the buckets
    /// already launched ([`HostComm::all_reduce_in_order`]).
    Plain {
        data: Vec<f32>,
        reduction: GradReduction,
    },
}

struct Answer {
    /// `None` for a [`HostJob::Plain`].
    bucket: Option<usize>,
    result: Result<BucketBuf>,
}

/// The host-staged transport's communication thread: buckets are reduced by a [`CommHook`]
/// one after another, in the order they are launched (so in the same order on every rank), and
/// their answers taken back by bucket number. One per process (rank); every host-staged pass of
/// both Burn lines goes through it. Each bucket layout ([`plan_key`]: a line's overlapped plan,
/// its after-backward plan, a plan made anew) has a hook of its own, made from the
/// [`HookChoice`] the first time, so that a stateful hook (PowerSGD's error feedback) never mixes
/// the buckets of two plans.
pub struct HostComm {
    pg: ProcessGroup,
    worker: Worker<HostJob, Answer>,
    /// Buckets handed over whose answers were not taken.
    outstanding: usize,
    /// Whether the hook reads each bucket's layout.
    wants_layout: bool,
    /// Where buckets may lie instead of the heap.
    shared: SharedBuckets,
    /// The first failure among the answers taken since the last [`collect`](Self::collect),
    /// which returns it.
    failed: Option<DdpError>,
}

impl std::fmt::Debug for HostComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostComm")
            .field("rank", &self.pg.rank())
            .field("outstanding", &self.outstanding)
            .finish()
    }
}

/// The key of `plan`'s bucket layout (its buckets' slots and lengths): a plan's hook is the
/// communication thread's hook for this key.
pub fn plan_key<K>(plan: &BucketPlan<K>) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    for (slots, len) in &plan.buckets {
        len.hash(&mut h);
        for &slot in slots {
            plan.slots[slot].info.numel.hash(&mut h);
        }
    }
    h.finish()
}

impl HostComm {
    /// Starts the communication thread of `pg`'s rank, reducing the buckets of each plan with a
    /// hook made by `hooks`; with `shared_buckets` (and a hook that is a [plain
    /// all-reduce](CommHook::plain_all_reduce)), [`buffers`](Self::buffers) lays buckets out in
    /// memory shared by the ranks of the host, where they are reduced in place.
    ///
    /// # Errors
    /// [`DdpError::Io`] if the thread cannot be started.
    pub fn start(pg: &ProcessGroup, hooks: HookChoice, shared_buckets: bool) -> Result<Self> {
        let comm = pg.clone();
        let probe = hooks.make();
        let wants_layout = probe.wants_layout();
        let plain = probe.plain_all_reduce();
        let mut by_plan: std::collections::HashMap<u64, Box<dyn CommHook>> =
            std::collections::HashMap::new();
        let mut probe = Some(probe);
        let (reduction, compression) = hooks.wire();
        let worker = Worker::start(
            format!("burn-ddp-grad-{}", pg.rank()),
            move |job| match job {
                // The full bucket is dropped here, as soon as this rank's block is out.
                HostJob::Bucket {
                    bucket,
                    data,
                    scatter: true,
                    ..
                } => Answer {
                    bucket: Some(bucket),
                    result: super::scatter_bucket(&comm, &data, reduction, compression)
                        .map(BucketBuf::from),
                },
                HostJob::Bucket {
                    plan,
                    bucket,
                    mut data,
                    layout,
                    scatter: false,
                } => Answer {
                    bucket: Some(bucket),
                    result: match plain {
                        // Where it lies, when shared (Note [Shared buckets]).
                        Some(op) if data.is_shared() => data.all_reduce(&comm, op),
                        _ => by_plan
                            .entry(plan)
                            .or_insert_with(|| probe.take().unwrap_or_else(|| hooks.make()))
                            .reduce(&comm, bucket, &mut data, layout.as_ref()),
                    }
                    .map(|()| data),
                },
                HostJob::Plain {
                    mut data,
                    reduction,
                } => Answer {
                    bucket: None,
                    result: super::reduce_bucket(
                        &comm,
                        &mut data,
                        reduction,
                        super::Compression::None,
                    )
                    .map(|()| data.into()),
                },
            },
        )?;
        Ok(Self {
            pg: pg.clone(),
            worker,
            outstanding: 0,
            wants_layout,
            shared: SharedBuckets::new(shared_buckets && plain.is_some()),
            failed: None,
        })
    }

    /// Zeroed buckets of `lens` f32s for one pass in memory shared by the ranks of the host,
    /// or `None` when they go on the heap (the group has no such memory, the configuration or
    /// the hook rules it out, or it could not be had). A collective the first time, and
    /// whenever a plan needs more room: call it at the same point on every rank, with no
    /// bucket in flight, and drop the buckets of one pass before asking for the next's.
    ///
    /// # Errors
    /// The group's failure; an internal error when the last pass's buckets still live.
    pub fn buffers(&mut self, lens: &[usize]) -> Result<Option<Vec<BucketBuf>>> {
        self.shared.buffers(&self.pg, lens)
    }

    /// Whether [`submit`](Self::submit) wants each bucket's layout.
    pub fn wants_layout(&self) -> bool {
        self.wants_layout
    }

    /// Buckets launched whose answers were not taken yet.
    pub fn outstanding(&self) -> usize {
        self.outstanding
    }

    fn stopped(&self) -> DdpError {
        DdpError::Collective(CollectiveError::WorkerStopped {
            rank: self.pg.rank(),
            what: "the gradient communication thread",
        })
    }

    /// Hands bucket `bucket` of the plan keyed `plan` ([`plan_key`]) over (`layout`: its
    /// matrices, when the hook [wants it](Self::wants_layout)). Buckets must come in index
    /// order, every step. `scatter`: the bucket is `world` blocks (a
    /// [sharded](super::BucketPlan::sharded) plan's), reduce-scattered with the configuration's
    /// reduction and wire format instead of reduced by the hook; its answer is this rank's
    /// block.
    ///
    /// # Errors
    /// [`CollectiveError::WorkerStopped`](crate::CollectiveError::WorkerStopped) if the communication thread has stopped.
    pub fn submit(
        &mut self,
        plan: u64,
        bucket: usize,
        data: BucketBuf,
        layout: Option<BucketShape>,
        scatter: bool,
    ) -> Result<()> {
        if !self.worker.send(HostJob::Bucket {
            plan,
            bucket,
            data,
            layout,
            scatter,
        }) {
            return Err(self.stopped());
        }
        self.outstanding += 1;
        Ok(())
    }

    /// Takes every outstanding answer into `results` (by bucket number), waiting at most the
    /// collective timeout (plus [`ANSWER_SLACK`]) for each.
    ///
    /// # Errors
    /// The first failure among the answers (or one taken earlier by
    /// [`all_reduce_in_order`](Self::all_reduce_in_order)); [`ModelError::GradSyncTimeout`](crate::ModelError::GradSyncTimeout)
    /// when the thread does not answer in time.
    pub fn collect(&mut self, results: &mut [Option<BucketBuf>]) -> Result<()> {
        while self.outstanding > 0 {
            match self.next_answer() {
                Ok(Answer {
                    bucket: Some(bucket),
                    result,
                }) => self.keep(bucket, result, results),
                Ok(Answer { bucket: None, .. }) => {}
                Err(e) => {
                    self.failed.get_or_insert(e);
                    break;
                }
            }
        }
        match self.failed.take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// All-reduces `data` behind the buckets already launched (a differentiable all-reduce's
    /// backward during an overlapped pass, e.g. `SyncBatchNorm`'s), so that every rank runs
    /// the collectives in the same order. The answers of the buckets before it go into
    /// `results`; a failure among them is returned by the next [`collect`](Self::collect).
    ///
    /// # Errors
    /// The all-reduce's failure; [`CollectiveError::WorkerStopped`](crate::CollectiveError::WorkerStopped) or
    /// [`ModelError::GradSyncTimeout`](crate::ModelError::GradSyncTimeout) when the thread cannot take it or does not answer in time.
    pub fn all_reduce_in_order(
        &mut self,
        data: Vec<f32>,
        reduction: GradReduction,
        results: &mut [Option<BucketBuf>],
    ) -> Result<Vec<f32>> {
        if !self.worker.send(HostJob::Plain { data, reduction }) {
            return Err(self.stopped());
        }
        loop {
            match self.next_answer()? {
                Answer {
                    bucket: None,
                    result,
                } => return result.map(|b| b.into_vec(usize::MAX)),
                Answer {
                    bucket: Some(bucket),
                    result,
                } => self.keep(bucket, result, results),
            }
        }
    }

    /// A bucket's answer: its values into `results`, its failure kept for `collect` (the first
    /// one wins).
    fn keep(
        &mut self,
        bucket: usize,
        result: Result<BucketBuf>,
        results: &mut [Option<BucketBuf>],
    ) {
        self.outstanding = self.outstanding.saturating_sub(1);
        match result {
            Ok(v) => {
                if let Some(r) = results.get_mut(bucket) {
                    *r = Some(v);
                }
            }
            Err(e) => {
                self.failed.get_or_insert(e);
            }
        }
    }

    fn next_answer(&self) -> Result<Answer> {
        let wait = self.pg.timeouts().collective + ANSWER_SLACK;
        self.worker.receive(wait).map_err(|e| match e {
            RecvTimeoutError::Timeout => DdpError::Model(ModelError::GradSyncTimeout {
                rank: self.pg.rank(),
                waited: wait,
            }),
            RecvTimeoutError::Disconnected => self.stopped(),
        })
    }
}

/// The host-staged transport of a rank: its communication thread ([`HostComm`]) and the heap
/// buffers kept from one pass to the next. Start it once per process (rank); each synchronised
/// pass lays out its buckets ([`buckets`](Self::buckets)) and runs the gradient engine
/// ([`Pass`]) over them, here through [`begin`](Self::begin) for a step synchronised after
/// backward.
pub struct HostSync {
    comm: HostComm,
    /// The configuration's hook (and PowerSGD's counts, when it is on).
    hooks: HookChoice,
    /// Heap buckets of earlier passes, reused by the next.
    spare: Vec<Vec<f32>>,
}

impl std::fmt::Debug for HostSync {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostSync")
            .field("comm", &self.comm)
            .finish()
    }
}

impl HostSync {
    /// Starts the communication thread of `pg`'s rank, reducing as `config` says (its
    /// [`HookChoice`]).
    ///
    /// # Errors
    /// [`DdpError::Io`] if the thread cannot be started.
    pub fn start(pg: &ProcessGroup, config: &DdpConfig) -> Result<Self> {
        let hooks = HookChoice::of(config);
        Ok(Self {
            comm: HostComm::start(pg, hooks.clone(), config.shared_buckets)?,
            hooks,
            spare: Vec::new(),
        })
    }

    /// PowerSGD's counts (elements all-reduced, elements uncompressed, steps), when it is on.
    pub fn power_sgd_totals(&self) -> Option<(u64, u64, u64)> {
        self.hooks.power_sgd_totals()
    }

    /// The communication thread: the [`Link`](BucketTransport::Link) of [`HostBuckets`].
    pub fn comm(&mut self) -> &mut HostComm {
        &mut self.comm
    }

    /// Zeroed buckets for one pass over `plan` (see [`HostComm::buffers`]: in memory shared by
    /// the ranks of the host when the group has it, a collective the first time), else on the
    /// heap, reusing earlier passes' buffers. The answers of an earlier pass that was given up
    /// are taken first.
    ///
    /// # Errors
    /// What the earlier pass's buckets still failed with; the group's failure while laying
    /// out shared buckets.
    pub fn buckets<K>(&mut self, plan: &BucketPlan<K>) -> Result<HostBuckets> {
        self.comm.collect(&mut [])?;
        let lens = plan.buffer_lens();
        // A sharded plan's buckets are reduce-scattered from the heap (the shared all-reduce
        // would give every rank every block).
        if plan.sharding.is_some() {
            return Ok(self.heap_buckets(plan));
        }
        let buffers = match self.comm.buffers(&lens)? {
            Some(shared) => shared,
            None => BucketBuf::on_heap(&lens, &mut self.spare),
        };
        Ok(HostBuckets::new(
            self.comm.pg.rank(),
            plan_key(plan),
            buffers,
        ))
    }

    /// Heap buckets for one pass over `plan`, when shared ones could not be had. A
    /// [sharded](BucketPlan::sharded) plan's are made one by one, each when its first gradient
    /// comes (or when it is sent), and dropped once reduce-scattered: only the buckets being
    /// packed or in flight take memory, which is what ZeRO stage 2 is for.
    pub fn heap_buckets<K>(&mut self, plan: &BucketPlan<K>) -> HostBuckets {
        let (rank, key, lens) = (self.comm.pg.rank(), plan_key(plan), plan.buffer_lens());
        if plan.sharding.is_some() {
            return HostBuckets::lazy(rank, key, lens);
        }
        HostBuckets::new(rank, key, BucketBuf::on_heap(&lens, &mut self.spare))
    }

    /// Keeps `spare` (the heap buckets of a finished pass, [`Reduced::into_spare`]) for the
    /// next pass.
    pub fn recycle(&mut self, spare: Vec<Vec<f32>>) {
        self.spare.extend(spare);
    }

    /// Starts one step synchronised after backward over `plan`: [`HostStep::push`] every
    /// parameter's gradient, then [`HostStep::finish`].
    ///
    /// # Errors
    /// As [`buckets`](Self::buckets).
    pub fn begin<'a, K>(&'a mut self, plan: &'a BucketPlan<K>) -> Result<HostStep<'a, K>> {
        let buckets = self.buckets(plan)?;
        Ok(HostStep {
            pass: Pass::new(self.comm.pg.rank(), plan, buckets, true),
            comm: &mut self.comm,
            plan,
        })
    }
}

/// One step synchronised after backward (see [`HostSync::begin`]): the gradient engine over
/// host buckets, each handed to the communication thread as soon as all its parameters are
/// pushed and every bucket before it has left.
pub struct HostStep<'a, K> {
    comm: &'a mut HostComm,
    plan: &'a BucketPlan<K>,
    pass: Pass<HostBuckets>,
}

impl<K> std::fmt::Debug for HostStep<'_, K> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostStep")
            .field("sent", &self.pass.sent())
            .field("buckets", &self.plan.buckets.len())
            .finish()
    }
}

impl<'a, K> HostStep<'a, K> {
    /// Packs the gradient of parameter `slot` (`None`: this rank has none); buckets that are
    /// complete leave for the communication thread. A gradient of the wrong size fails the
    /// step ([`finish`](Self::finish) reports it), the buckets still go.
    pub fn push(&mut self, slot: usize, values: Option<&[f32]>) {
        self.pass.push(&mut self.comm, self.plan, slot, values);
    }

    /// Fails the step with `e` (reported by [`finish`](Self::finish), after every bucket went,
    /// so that no other rank waits for one).
    pub fn fail(&mut self, e: DdpError) {
        self.pass.fail(e);
    }

    /// Launches what is left (parameters never pushed count as absent on this rank), waits for
    /// every bucket, and returns the reduced gradients.
    ///
    /// # Errors
    /// The first failure of the step: a gradient of the wrong size
    /// ([`ModelError::GradientSize`](crate::ModelError::GradientSize)), a collective error
    /// naming the rank at fault, or [`ModelError::GradSyncTimeout`](crate::ModelError::GradSyncTimeout)
    /// when the communication thread does not answer in time.
    pub fn finish(mut self) -> Result<Reduced<'a>> {
        self.pass.finish(&mut self.comm, self.plan)
    }
}

/// The host-staged buckets of one pass: packed as f32 on the calling thread, handed to the
/// communication thread ([`HostComm`], the transport's [`Link`](BucketTransport::Link)) as
/// they complete, and read back.
#[derive(Debug)]
pub struct HostBuckets {
    rank: crate::Rank,
    /// The plan's key ([`plan_key`]): which of the thread's hooks reduces these buckets.
    plan: u64,
    /// Being packed (taken when sent): values, then one presence flag per slot.
    packing: Vec<Option<BucketBuf>>,
    /// Buckets made when first needed ([`HostSync::heap_buckets`] of a sharded plan): each
    /// bucket's length, and whether it was sent.
    lazy: Option<(Vec<usize>, Vec<bool>)>,
    /// The answers, by bucket.
    results: Vec<Option<BucketBuf>>,
}

impl HostBuckets {
    fn new(rank: crate::Rank, plan: u64, buffers: Vec<BucketBuf>) -> Self {
        Self {
            rank,
            plan,
            results: (0..buffers.len()).map(|_| None).collect(),
            packing: buffers.into_iter().map(Some).collect(),
            lazy: None,
        }
    }

    /// Buckets of `lens` f32s, each made (zeroed, on the heap) when it is first needed.
    fn lazy(rank: crate::Rank, plan: u64, lens: Vec<usize>) -> Self {
        let n = lens.len();
        Self {
            rank,
            plan,
            results: (0..n).map(|_| None).collect(),
            packing: (0..n).map(|_| None).collect(),
            lazy: Some((lens, vec![false; n])),
        }
    }

    /// Bucket `bucket` being packed (made now if it is made when first needed); `None` once sent.
    fn open(&mut self, bucket: usize) -> Option<&mut BucketBuf> {
        if let Some((lens, sent)) = &self.lazy {
            if !sent[bucket] && self.packing[bucket].is_none() {
                self.packing[bucket] = Some(vec![0.0; lens[bucket]].into());
            }
        }
        self.packing[bucket].as_mut()
    }

    /// An all-reduce of `data` issued while this pass's buckets are in flight (a
    /// differentiable all-reduce's backward, e.g. `SyncBatchNorm`'s): it goes through the
    /// communication thread behind them, so that every rank runs the collectives in the same
    /// order; the answers of the buckets before it are kept for the pass's end. It gives `data`
    /// back untouched (`Err`) when no bucket is in flight: the caller all-reduces directly, and
    /// nothing can overtake it.
    pub fn all_reduce_in_order(
        &mut self,
        comm: &mut HostComm,
        data: Vec<f32>,
        reduction: GradReduction,
    ) -> std::result::Result<Result<Vec<f32>>, Vec<f32>> {
        if comm.outstanding() == 0 {
            return Err(data);
        }
        Ok(comm.all_reduce_in_order(data, reduction, &mut self.results))
    }
}

impl<K> BucketTransport<K> for HostBuckets {
    type Grad<'g> = &'g [f32];
    type Link<'l> = &'l mut HostComm;
    type Output = Reduced<'static>;

    fn keep(
        &mut self,
        _comm: &mut &mut HostComm,
        plan: &BucketPlan<K>,
        slot: usize,
        values: &[f32],
    ) -> Result<()> {
        let s = &plan.slots[slot];
        if values.len() != s.info.numel {
            return Err(DdpError::Model(ModelError::GradientSize {
                rank: self.rank,
                param: s.info.name.clone(),
                expected: s.info.numel,
                got: values.len(),
            }));
        }
        if let Some(bucket) = self.open(s.bucket) {
            bucket[s.offset..s.offset + values.len()].copy_from_slice(values);
            bucket[plan.flag_index(slot)] = 1.0;
        }
        Ok(())
    }

    fn send(
        &mut self,
        comm: &mut &mut HostComm,
        plan: &BucketPlan<K>,
        bucket: usize,
    ) -> Result<()> {
        self.open(bucket);
        if let Some((_, sent)) = &mut self.lazy {
            sent[bucket] = true;
        }
        let Some(data) = self.packing[bucket].take() else {
            return Ok(());
        };
        let layout = comm.wants_layout().then(|| plan.bucket_shape(bucket));
        comm.submit(self.plan, bucket, data, layout, plan.sharding.is_some())
    }

    fn finish(
        &mut self,
        comm: &mut &mut HostComm,
        plan: &BucketPlan<K>,
        _local: &[bool],
    ) -> Result<Reduced<'static>> {
        comm.collect(&mut self.results)?;
        let mut buckets = Vec::with_capacity(self.results.len());
        for (i, r) in self.results.iter_mut().enumerate() {
            match r.take() {
                Some(v) => buckets.push(v),
                None => {
                    tracing::error!("gradient bucket {i} came back without a result");
                    return Err(DdpError::Internal {
                        rank: self.rank,
                        what: "a gradient bucket came back without a result",
                    });
                }
            }
        }
        // A sharded plan's answers are this rank's blocks: its own slots lie there, shifted by
        // the blocks before it; the other ranks' slots are nowhere (never present).
        let mine = |slot: usize| plan.owner(slot).is_none_or(|o| o == self.rank);
        let layout = (plan.slots.iter().enumerate())
            .map(|(i, s)| match plan.received(i, self.rank) {
                Some((offset, flag)) => (s.bucket, offset, s.info.numel, flag),
                None => (s.bucket, 0, s.info.numel, NOWHERE),
            })
            .collect();
        let left = (plan.buckets.iter())
            .map(|(s, _)| s.iter().filter(|&&slot| mine(slot)).count())
            .collect();
        Ok(Reduced {
            buckets,
            layout,
            left,
            taken: vec![false; plan.slots.len()],
            spare: Vec::new(),
            keep: plan.sharding.is_none(),
            _sync: std::marker::PhantomData,
        })
    }

    fn abandon(&mut self, comm: &mut &mut HostComm, e: DdpError) -> DdpError {
        // Answers for what did leave are taken, so that the next pass starts clean.
        let _ = comm.collect(&mut self.results);
        e
    }
}

/// The flag index of a slot another rank owns in a sharded plan: this rank has no value for it.
const NOWHERE: usize = usize::MAX;

/// The reduced gradients of one step, by slot: read ([`get`](Self::get)) or taken
/// ([`take`](Self::take), which frees each bucket once its last gradient is out, and hands a
/// heap bucket that holds one gradient over as that gradient, without a copy). It borrows the
/// [`HostSync`] of a step synchronised after backward (whose shared buckets it may hold) until
/// it is dropped.
#[derive(Debug)]
pub struct Reduced<'a> {
    /// Each bucket's values and flags (empty once every gradient in it was taken).
    buckets: Vec<BucketBuf>,
    /// Per slot: bucket, offset, element count, index of its presence flag.
    layout: Vec<(usize, usize, usize, usize)>,
    /// Per bucket: its slots not taken yet.
    left: Vec<usize>,
    /// Per slot: taken already.
    taken: Vec<bool>,
    /// Heap buckets emptied by [`take`](Self::take), for the next pass.
    spare: Vec<Vec<f32>>,
    /// Whether emptied buckets are kept for the next pass: not a sharded plan's, whose buckets
    /// are made per pass ([`HostSync::heap_buckets`]) and never reuse one, so that a kept
    /// buffer would only add to the memory stage 2 is meant to save, pass after pass.
    keep: bool,
    _sync: std::marker::PhantomData<&'a mut HostSync>,
}

impl Reduced<'_> {
    /// The reduced gradient of parameter `slot`; `None` when no rank had a gradient for it
    /// (leave it without one, as a single process would), or when it was taken.
    pub fn get(&self, slot: usize) -> Option<&[f32]> {
        let &(bucket, offset, numel, flag) = self.layout.get(slot)?;
        let b = &self.buckets[bucket];
        (*b.get(flag)? > 0.0).then(|| &b[offset..offset + numel])
    }

    /// The reduced gradient of parameter `slot`, owned, as [`get`](Self::get) reads it (each
    /// slot once: `None` the second time). A bucket's memory is released when its last slot is
    /// taken (a heap bucket kept for [`into_spare`](Self::into_spare)); a bucket of one
    /// gradient becomes that gradient's values without a copy.
    pub fn take(&mut self, slot: usize) -> Option<Vec<f32>> {
        let &(bucket, offset, numel, flag) = self.layout.get(slot)?;
        if std::mem::replace(self.taken.get_mut(slot)?, true) || flag == NOWHERE {
            return None;
        }
        let buffer = &mut self.buckets[bucket];
        let present = buffer.get(flag).is_some_and(|&f| f > 0.0);
        self.left[bucket] = self.left[bucket].saturating_sub(1);
        if self.left[bucket] > 0 {
            return present.then(|| buffer[offset..offset + numel].to_vec());
        }
        let last = std::mem::replace(buffer, Vec::new().into());
        let values = match present {
            false => None,
            // The bucket holds this gradient alone (values, then its one flag): a heap bucket
            // becomes it.
            true if offset == 0 && last.len() == numel + 1 => return Some(last.into_vec(numel)),
            true => Some(last[offset..offset + numel].to_vec()),
        };
        if self.keep {
            self.spare.extend(last.into_heap());
        }
        values
    }

    /// The heap buckets emptied by [`take`](Self::take), for [`HostSync::recycle`] (none of a
    /// sharded plan's: they go as soon as their last slot is taken).
    pub fn into_spare(self) -> Vec<Vec<f32>> {
        self.spare
    }
}

#[cfg(test)]
mod tests {
    use super::super::{AllReduce, Compression};
    use super::*;
    use crate::group::on_local_ranks;

    fn plan() -> BucketPlan<u64> {
        super::super::plan::test_plan(5, 3, 12, 24)
    }

    /// Three in-process ranks; parameter 1 has a gradient on rank 2 only, parameter 3 on none.
    fn run(reduction: GradReduction, compression: Compression) -> Vec<Vec<Option<Vec<f32>>>> {
        run_plan(reduction, compression, None)
    }

    /// [`run`] over the plan sharded to `owners` (ZeRO stage 2) when given; each step's reduced
    /// gradients taken.
    fn run_plan(
        reduction: GradReduction,
        compression: Compression,
        owners: Option<&[crate::Rank]>,
    ) -> Vec<Vec<Option<Vec<f32>>>> {
        let config = DdpConfig {
            reduction,
            compression,
            ..DdpConfig::default()
        };
        on_local_ranks(3, |pg| {
            let r = pg.rank().index();
            let plan = match owners {
                Some(owners) => plan().sharded(owners, 3),
                None => plan(),
            };
            let mut sync = HostSync::start(&pg, &config).unwrap();
            let mut out = Vec::new();
            for step in 0..2 {
                let mut s = sync.begin(&plan).unwrap();
                for slot in [4usize, 0, 2, 1] {
                    let v = vec![(r * 10 + slot + step) as f32; 3];
                    let have = slot != 1 || r == 2;
                    s.push(slot, have.then_some(v.as_slice()));
                }
                let mut red = s.finish().unwrap();
                out = (0..5).map(|i| red.take(i)).collect();
                // A sharded plan keeps no spent bucket for the next pass (its buckets are made
                // per pass: a kept one would pile up, step after step).
                let spare = red.into_spare();
                if owners.is_some() {
                    assert!(spare.is_empty(), "{} spare buckets kept", spare.len());
                }
                sync.recycle(spare);
            }
            out
        })
    }

    #[test]
    fn every_rank_gets_the_mean_and_absent_parameters_stay_absent() {
        let got = run(GradReduction::Mean, Compression::None);
        for r in &got {
            // step 1: rank r sends r*10 + slot + 1 → mean over ranks 0..3 = 10 + slot + 1.
            assert_eq!(r[0].as_deref(), Some(&[11.0; 3][..]));
            assert_eq!(r[4].as_deref(), Some(&[15.0; 3][..]));
            // only rank 2 had parameter 1: (21 + 1) / 3, on every rank.
            let p1 = r[1]
                .as_deref()
                .expect("parameter 1 had a gradient on rank 2");
            assert!(p1.iter().all(|v| (v - 22.0 / 3.0).abs() < 1e-5), "{p1:?}");
            assert_eq!(r[3], None);
        }
    }

    /// The same three ranks and gradients over the sharded plan (ZeRO stage 2: parameter `i`
    /// owned by rank `i % 3`, so blocks of uneven fill): each rank gets the mean of the
    /// parameters it owns, as the all-reduce gives it, and nothing of the others'.
    #[test]
    fn a_sharded_plan_gives_each_rank_the_mean_of_what_it_owns_and_nothing_else() {
        let whole = run(GradReduction::Mean, Compression::None);
        let owners: Vec<crate::Rank> = (0..5).map(|i| crate::Rank(i % 3)).collect();
        for compression in [Compression::None, Compression::F16] {
            let got = run_plan(GradReduction::Mean, compression, Some(&owners));
            for (r, got) in got.iter().enumerate() {
                for (slot, g) in got.iter().enumerate() {
                    let want = if slot % 3 == r {
                        whole[r][slot].clone()
                    } else {
                        None
                    };
                    match (g, &want) {
                        (Some(g), Some(w)) => {
                            assert!(g.iter().zip(w).all(|(a, b)| (a - b).abs() < 1e-2), "{g:?}")
                        }
                        _ => assert_eq!(g, &want, "rank {r} slot {slot}"),
                    }
                }
            }
        }
    }

    #[test]
    fn sum_and_bf16_reduce_on_every_rank_alike() {
        let got = run(GradReduction::Sum, Compression::Bf16);
        for r in &got {
            assert_eq!(r[2].as_deref(), Some(&[39.0; 3][..]));
            assert_eq!(r[1].as_deref(), Some(&[22.0; 3][..]));
        }
        assert!(got.iter().all(|r| *r == got[0]));
    }

    #[test]
    fn a_gradient_of_the_wrong_size_is_named_and_the_next_step_is_clean() {
        let pg = ProcessGroup::single();
        let plan = plan();
        let mut sync = HostSync::start(&pg, &DdpConfig::default()).unwrap();
        let mut s = sync.begin(&plan).unwrap();
        s.push(2, Some(&[1.0, 2.0]));
        s.push(0, Some(&[1.0; 3]));
        let err = s.finish().unwrap_err();
        assert!(
            matches!(&err, DdpError::Model(ModelError::GradientSize { param, expected: 3, got: 2, .. }) if param == "p2"),
            "{err:?}"
        );
        // A step dropped half-way leaves the next one clean too.
        let mut s = sync.begin(&plan).unwrap();
        s.push(0, Some(&[1.0; 3]));
        drop(s);
        let mut s = sync.begin(&plan).unwrap();
        s.push(0, Some(&[1.0; 3]));
        let red = s.finish().unwrap();
        assert_eq!(red.get(0), Some(&[1.0; 3][..]));
        assert_eq!(red.get(1), None);
    }

    /// Taking every slot gives what `get` reads, once; a one-gradient bucket's buffer is
    /// handed over (no copy), and each bucket is freed after its last slot.
    #[test]
    fn taken_gradients_match_and_buckets_are_freed() {
        let pg = ProcessGroup::single();
        // Caps of 12 bytes: three f32 each, so every bucket holds one 3-element parameter.
        for (first_cap, cap) in [(12, 12), (12, 36)] {
            let plan = super::super::plan::test_plan(5, 3, first_cap, cap);
            let mut sync = HostSync::start(&pg, &DdpConfig::default()).unwrap();
            let mut s = sync.begin(&plan).unwrap();
            for slot in [0usize, 1, 3, 4] {
                s.push(slot, Some(&[slot as f32; 3]));
            }
            let mut red = s.finish().unwrap();
            let want: Vec<Option<Vec<f32>>> =
                (0..5).map(|i| red.get(i).map(<[f32]>::to_vec)).collect();
            for (slot, want) in want.into_iter().enumerate() {
                let single = plan.buckets[plan.slots[slot].bucket].0.len() == 1;
                let before = red.get(slot).map(<[f32]>::as_ptr);
                let got = red.take(slot);
                assert_eq!(got, want, "slot {slot}");
                if let (true, Some(v), Some(p)) = (single, &got, before) {
                    assert_eq!(
                        v.as_ptr(),
                        p,
                        "slot {slot}: the bucket's buffer, not a copy"
                    );
                }
                assert_eq!(red.take(slot), None, "slot {slot} taken twice");
            }
            assert!(
                red.buckets.iter().all(|b| b.is_empty()),
                "every bucket freed"
            );
        }
    }

    /// Each bucket layout gets a hook of its own on the one communication thread (made the
    /// first time the layout's buckets come), so two plans never share a stateful hook.
    #[test]
    fn each_plan_is_reduced_by_a_hook_of_its_own() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        use std::sync::Arc;
        let pg = ProcessGroup::single();
        let made = Arc::new(AtomicUsize::new(0));
        let counted = Arc::clone(&made);
        let config = DdpConfig::default().with_comm_hook(move || {
            counted.fetch_add(1, Ordering::Relaxed);
            Box::new(AllReduce {
                reduction: GradReduction::Mean,
                compression: Compression::None,
            })
        });
        let mut sync = HostSync::start(&pg, &config).unwrap();
        assert_eq!(
            made.load(Ordering::Relaxed),
            1,
            "one hook to learn what it wants"
        );
        let (a, b) = (plan(), super::super::plan::test_plan(2, 4, 16, 16));
        assert_ne!(plan_key(&a), plan_key(&b));
        for (round, plan) in [&a, &b, &a, &b].into_iter().enumerate() {
            let mut s = sync.begin(plan).unwrap();
            let n = plan.slots[0].info.numel;
            s.push(0, Some(&vec![round as f32; n]));
            let red = s.finish().unwrap();
            assert_eq!(red.get(0), Some(&vec![round as f32; n][..]));
        }
        assert_eq!(
            made.load(Ordering::Relaxed),
            2,
            "the first hook for plan a, one for b"
        );
    }

    /// A plain all-reduce issued behind launched buckets comes back in its place on every
    /// rank; the buckets' answers taken meanwhile are kept for `collect`.
    #[test]
    fn a_plain_all_reduce_runs_behind_the_buckets_in_flight() {
        on_local_ranks(2, |pg| {
            let r = pg.rank().index() as f32;
            let config = DdpConfig {
                reduction: GradReduction::Sum,
                ..DdpConfig::default()
            };
            let mut comm = HostComm::start(&pg, HookChoice::of(&config), true).unwrap();
            let mut results = vec![None, None];
            comm.submit(7, 0, vec![r + 1.0; 2].into(), None, false)
                .unwrap();
            let plain = comm
                .all_reduce_in_order(vec![10.0 * (r + 1.0)], GradReduction::Mean, &mut results)
                .unwrap();
            assert_eq!(plain, vec![15.0]);
            assert_eq!(
                results[0].as_deref(),
                Some(&[3.0; 2][..]),
                "bucket 0's answer was kept"
            );
            assert_eq!(comm.outstanding(), 0);
            comm.submit(7, 1, vec![r; 1].into(), None, false).unwrap();
            comm.collect(&mut results).unwrap();
            assert_eq!(results[1].as_deref(), Some(&[1.0][..]));
        });
    }

    /// A user's hook (here the maximum over ranks, where the configuration says mean) reduces
    /// every bucket, in index order each step, and is given each bucket's layout.
    #[test]
    fn a_users_hook_reduces_every_bucket_with_its_layout() {
        use crate::types::ReduceOp;
        use std::sync::atomic::{AtomicUsize, Ordering};

        struct Max {
            next: usize,
            buckets: usize,
            calls: Arc<AtomicUsize>,
        }
        impl CommHook for Max {
            fn wants_layout(&self) -> bool {
                true
            }
            fn reduce(
                &mut self,
                pg: &ProcessGroup,
                bucket: usize,
                data: &mut [f32],
                layout: Option<&BucketShape>,
            ) -> Result<()> {
                assert_eq!(bucket, self.next, "buckets in index order");
                self.next = (bucket + 1) % self.buckets;
                let layout = layout.expect("a hook that wants the layout is given it");
                assert!(layout.len <= data.len());
                self.calls.fetch_add(1, Ordering::Relaxed);
                pg.all_reduce(data, ReduceOp::Max)
            }
        }
        use std::sync::Arc;
        on_local_ranks(2, |pg| {
            let r = pg.rank().index();
            let plan = plan();
            let buckets = plan.buckets.len();
            assert!(buckets > 1);
            let calls = Arc::new(AtomicUsize::new(0));
            let counted = Arc::clone(&calls);
            let config = DdpConfig::default().with_comm_hook(move || {
                Box::new(Max {
                    next: 0,
                    buckets,
                    calls: Arc::clone(&counted),
                })
            });
            config.validate().unwrap();
            let mut sync = HostSync::start(&pg, &config).unwrap();
            for _ in 0..2 {
                let mut s = sync.begin(&plan).unwrap();
                for slot in 0..5 {
                    s.push(slot, Some(&[(r * 10 + slot) as f32; 3]));
                }
                let red = s.finish().unwrap();
                assert_eq!(
                    red.get(2),
                    Some(&[12.0; 3][..]),
                    "the maximum, not the mean"
                );
            }
            assert_eq!(calls.load(Ordering::Relaxed), 2 * buckets);
        });
    }
}
