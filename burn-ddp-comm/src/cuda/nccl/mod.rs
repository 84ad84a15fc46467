//! [`NcclComm`]: an NCCL communicator for one rank of a [`ProcessGroup`], on the GPU that holds
//! the rank's tensors (by default the one its `LOCAL_RANK` names).
//!
//! - Created once per group and reused. Rank 0 makes the NCCL unique id and shares it through
//!   the job's rendezvous store (in-process groups: a broadcast over the group).
//! - Collectives are queued on the communicator's own stream (not the default stream, not Burn's
//!   compute stream); [`NcclComm::wait`] waits for them with the collective deadline.
//! - Nothing blocks without a deadline. The communicator is *non-blocking*
//!   (`ncclCommInitRankConfig` with `blocking = 0`): creation, and any call during which NCCL
//!   still connects to peers (NCCL 2.19+ connects inside the first collective of each algorithm),
//!   return `ncclInProgress` at once and are polled (`ncclCommGetAsyncError`) with a deadline,
//!   the job's abort record and the heartbeat watching, and no lock held while waiting. A
//!   deadline, an error or another rank's failure aborts the communicator (`ncclCommAbort`),
//!   which frees the GPU from kernels that wait for a dead peer; later calls fail at once.
//!   Dropping it finalizes with a deadline too (`ncclCommFinalize`, then destroy; abort if a peer
//!   never answers).

use crate::error::{CollectiveError, ConfigError, CudaError};
use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_uint, CStr};
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use cudarc::driver::{CudaContext, CudaStream};
use cudarc::nccl::result::{self, NcclStatus};
use cudarc::nccl::sys::{self, ncclResult_t};

use super::library::{usable_nccl, NcclVersion};
use super::status::{driver_error, nccl_error};
use super::wait::{wait_for, Poll, Stop};
pub(crate) use ops::check_bucket_span;
pub use ops::check_bucket_tensor;
pub use ops::NcclP2p;

mod ops;
use crate::comm::{CollectiveOp, Queue, ReduceOp, DRAIN_LIMIT};
use crate::error::{DdpError, Result};
use crate::group::ProcessGroup;
use crate::types::{AbortRecord, CollectiveSeq, Rank, WorldSize};

/// How often a wait asks the store whether another rank reported a failure.
const JOB_CHECK: Duration = Duration::from_millis(500);

/// Longest wait for `ncclCommFinalize` when a communicator is dropped; past it, it is aborted.
const FINALIZE_LIMIT: Duration = Duration::from_secs(30);

/// Communicators created by this process, by group (its store-key prefix), to give each its own
/// key in the store: every rank of a group creates that group's communicators in the same order,
/// whatever it creates for other groups.
static CREATED: Mutex<Option<HashMap<String, u64>>> = Mutex::new(None);

/// `ncclConfig_t` as NCCL 2.17 laid it out (`nccl.h`'s `NCCL_CONFIG_INITIALIZER` fills it the
/// same way). NCCL copies a config by its leading `size` field and defaults every field past it,
/// so this layout, which holds all we set, works with every NCCL from 2.17 on, whatever layout
/// the cudarc bindings were generated from.
#[repr(C)]
struct Config {
    size: usize,
    magic: c_uint,
    version: c_uint,
    blocking: c_int,
    cga_cluster_size: c_int,
    min_ctas: c_int,
    max_ctas: c_int,
    net_name: *const c_char,
    split_share: c_int,
}

/// `NCCL_CONFIG_UNDEF_INT`: "use NCCL's default".
const CONFIG_UNDEF: c_int = c_int::MIN;

impl Config {
    /// A non-blocking communicator, everything else NCCL's default.
    fn non_blocking() -> Self {
        Self {
            size: std::mem::size_of::<Self>(),
            magic: 0xcafe_beef,
            version: 21_700, // NCCL_VERSION(2, 17, 0)
            blocking: 0,
            cga_cluster_size: CONFIG_UNDEF,
            min_ctas: CONFIG_UNDEF,
            max_ctas: CONFIG_UNDEF,
            net_name: std::ptr::null(),
            split_share: CONFIG_UNDEF,
        }
    }
}

/// The raw communicator handle; null once aborted or destroyed.
struct Handle(sys::ncclComm_t);

// SAFETY: an NCCL communicator may be used from any thread; `NcclComm` serialises the calls that
// need it (its `issue` lock), and `ncclCommGetAsyncError` / `ncclCommAbort` are documented as
// callable concurrently with a call in progress on a non-blocking communicator.
unsafe impl Send for Handle {}

#[derive(Default)]
struct State {
    seq: u64,
    /// What failed first; every later call reports it.
    failed: Option<String>,
    /// The last operation queued, for messages.
    last: Option<(CollectiveOp, CollectiveSeq, String)>,
}

/// An NCCL communicator for one rank, bound to one GPU. See the module documentation.
pub struct NcclComm {
    /// The handle and the state; held only for the length of one NCCL call, never while waiting.
    handle: Mutex<(Handle, State)>,
    /// Held from issuing a call until NCCL has taken it (`ncclInProgress` settled), so that no
    /// second call reaches the communicator meanwhile (NCCL's rule for non-blocking ones).
    issue: Mutex<()>,
    stream: Arc<CudaStream>,
    ctx: Arc<CudaContext>,
    pg: ProcessGroup,
    rank: Rank,
    world: WorldSize,
    version: NcclVersion,
    timeout: Duration,
    /// Whether a failure is published to the job (its abort record). Off while the
    /// communicator is only being tried for gradients ([`NcclComm::probe`]): a rank that
    /// cannot use NCCL then falls back with the others instead of ending the job.
    publishing: AtomicBool,
}

impl fmt::Debug for NcclComm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NcclComm")
            .field("rank", &self.rank)
            .field("world_size", &self.world)
            .field("device", &self.ctx.ordinal())
            .field("nccl", &self.version.to_string())
            .finish()
    }
}

impl NcclComm {
    /// Creates the communicator of `pg` on this rank's GPU: the only one it sees, or the one its
    /// `LOCAL_RANK` names (see [`rank_ordinal`](super::rank_ordinal)). Every rank of the group must
    /// call it (collectively, like any collective).
    ///
    /// # Errors
    /// NCCL missing ([`CudaError::NcclUnavailable`](crate::CudaError::NcclUnavailable), saying what to install or link), no GPU for
    /// this rank, NCCL or driver failures with their text, or the rendezvous deadline.
    pub fn new(pg: &ProcessGroup) -> Result<Self> {
        let ordinal = super::device::ordinal_for(pg.rank(), pg.local_rank(), None)?;
        Self::on(pg, super::device::context(pg.rank(), ordinal)?)
    }

    /// As [`NcclComm::new`], on GPU `ordinal` (where this rank's tensors are), checked against
    /// the GPU its `LOCAL_RANK` names when the process sees several.
    ///
    /// # Errors
    /// As [`NcclComm::new`], and [`CudaError::DeviceMismatch`](crate::CudaError::DeviceMismatch) naming both GPUs.
    pub fn on_device(pg: &ProcessGroup, ordinal: usize) -> Result<Self> {
        Self::on_gpu(pg, ordinal, true)
    }

    /// [`NcclComm::on_device`] and [`NcclComm::probe`]: GPU `ordinal`, checked against the
    /// rank's `LOCAL_RANK`, failures published to the job or not.
    fn on_gpu(pg: &ProcessGroup, ordinal: usize, publishing: bool) -> Result<Self> {
        let ordinal = super::device::ordinal_for(pg.rank(), pg.local_rank(), Some(ordinal))?;
        Self::create(pg, super::device::context(pg.rank(), ordinal)?, publishing)
    }

    /// As [`NcclComm::new`], on the GPU of `ctx` (which must be the same on no two ranks).
    ///
    /// # Errors
    /// As [`NcclComm::new`].
    pub fn on(pg: &ProcessGroup, ctx: Arc<CudaContext>) -> Result<Self> {
        Self::create(pg, ctx, true)
    }

    /// As [`NcclComm::on_device`], for a trial: a failure (creation, and every call until
    /// [`NcclComm::accept`]) aborts this communicator only and is *not* published to the job,
    /// so that the other ranks' host collectives go on and a vote can drop NCCL everywhere
    /// (what [`connect_for_grads`](super::connect_for_grads) does).
    ///
    /// # Errors
    /// As [`NcclComm::on_device`].
    pub fn probe(pg: &ProcessGroup, ordinal: usize) -> Result<Self> {
        Self::on_gpu(pg, ordinal, false)
    }

    /// Ends the trial of [`NcclComm::probe`]: from now on a failure is published to the job,
    /// as with any communicator.
    pub fn accept(&self) {
        self.publishing.store(true, Ordering::SeqCst);
    }

    fn create(pg: &ProcessGroup, ctx: Arc<CudaContext>, publishing: bool) -> Result<Self> {
        let version = usable_nccl()?;
        let rank = pg.rank();
        let world = pg.world_size();
        let timeouts = pg.timeouts();
        ctx.bind_to_thread()
            .map_err(|e| driver_error(rank, "binding the CUDA context", e))?;
        let stream = ctx
            .new_stream()
            .map_err(|e| driver_error(rank, "creating the NCCL stream", e))?;
        let id = share_unique_id(pg)?;
        let nranks = i32::try_from(world.get()).map_err(|_| {
            DdpError::Config(ConfigError::InvalidConfig {
                field: "WORLD_SIZE",
                reason: "NCCL takes at most 2^31 - 1 ranks",
            })
        })?;
        let mut raw: sys::ncclComm_t = std::ptr::null_mut();
        let mut config = Config::non_blocking();
        // SAFETY: `raw` is written by NCCL; the id came from rank 0's `ncclGetUniqueId`; rank and
        // size are validated; `config` is a complete 2.17-layout config (see `Config`) that
        // outlives the call. Non-blocking: returns at once, creation goes on inside NCCL.
        let code = unsafe {
            sys::ncclCommInitRankConfig(
                &mut raw,
                nranks,
                id,
                rank.0 as i32,
                (&mut config as *mut Config).cast::<sys::ncclConfig_t>(),
            )
        };
        let comm = Self {
            handle: Mutex::new((Handle(raw), State::default())),
            issue: Mutex::new(()),
            stream,
            ctx,
            pg: pg.clone(),
            rank,
            world,
            version,
            timeout: timeouts.collective,
            publishing: AtomicBool::new(publishing),
        };
        if !matches!(
            code,
            ncclResult_t::ncclSuccess | ncclResult_t::ncclInProgress
        ) {
            let e = nccl_error(rank, "ncclCommInitRankConfig", code, last_error(raw));
            comm.fail(e.to_string());
            return Err(e);
        }
        // Every rank must join before creation completes: a rank that dies or freezes first is
        // named by the heartbeat (in the abort record) long before the deadline.
        let wait = timeouts
            .rendezvous
            .max(timeouts.collective.min(timeouts.rendezvous * 4));
        comm.wait_done("communicator creation (ncclCommInitRankConfig)", wait)?;
        tracing::info!(
            "[rank {rank}] NCCL {version} communicator ready on GPU {} ({} ranks)",
            comm.ctx.ordinal(),
            world
        );
        Ok(comm)
    }

    /// This rank.
    pub fn rank(&self) -> Rank {
        self.rank
    }

    /// Number of ranks.
    pub fn world_size(&self) -> WorldSize {
        self.world
    }

    /// The NCCL version in use.
    pub fn version(&self) -> NcclVersion {
        self.version
    }

    /// The stream the collectives run on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The GPU's context (its primary context: the one Burn's CUDA backend uses too).
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The GPU ordinal (among the visible devices) this communicator works on.
    pub fn device_ordinal(&self) -> usize {
        self.ctx.ordinal()
    }

    fn lock(&self) -> MutexGuard<'_, (Handle, State)> {
        self.handle.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The error every call after a failure returns.
    fn failed_error(&self, state: &State, first: &str) -> DdpError {
        DdpError::Collective(CollectiveError::GroupAborted {
            rank: self.rank,
            first: Box::new(AbortRecord {
                reporter: self.rank,
                culprit: None,
                collective: state.last.as_ref().map(|l| (l.0, l.1)),
                reason: first.to_owned(),
            }),
        })
    }

    /// Issues one NCCL call on the stream; `f` gets the communicator and the stream. If NCCL
    /// answers `ncclInProgress` (it is still connecting to peers), waits for it to take the call,
    /// with the collective deadline and without holding the handle's lock.
    fn issue(
        &self,
        op: CollectiveOp,
        what: String,
        call: &'static str,
        f: impl FnOnce(
            sys::ncclComm_t,
            sys::cudaStream_t,
        ) -> std::result::Result<NcclStatus, result::NcclError>,
    ) -> Result<CollectiveSeq> {
        let _issuing = self.issue.lock().unwrap_or_else(|p| p.into_inner());
        let (seq, what, status) = {
            let mut guard = self.lock();
            let (handle, state) = &mut *guard;
            if let Some(first) = &state.failed {
                return Err(self.failed_error(state, first));
            }
            self.ctx
                .bind_to_thread()
                .map_err(|e| driver_error(self.rank, "binding the CUDA context", e))?;
            state.seq += 1;
            let seq = CollectiveSeq(state.seq);
            let what = format!("{op} {seq}, {what}");
            match f(handle.0, self.stream.cu_stream() as sys::cudaStream_t) {
                Ok(status) => {
                    state.last = Some((op, seq, what.clone()));
                    (seq, what, status)
                }
                Err(code) => {
                    let e = nccl_error(
                        self.rank,
                        format!("{call} ({what})"),
                        code.0,
                        last_error(handle.0),
                    );
                    drop(guard);
                    self.fail(e.to_string());
                    return Err(e);
                }
            }
        };
        if matches!(status, NcclStatus::InProgress) {
            self.wait_done(&what, self.timeout)?;
        }
        Ok(seq)
    }

    /// Waits until NCCL has finished what `what` started on the host side (`ncclInProgress`
    /// became `ncclSuccess`): polls `ncclCommGetAsyncError` with a deadline of `limit`, the job's
    /// abort record, and the heartbeat's verdict on the peers. On a failure or the deadline, the
    /// failure is published and the communicator aborted.
    fn wait_done(&self, what: &str, limit: Duration) -> Result<()> {
        let _watched = self.pg.waiting_on_peers();
        let outcome = wait_for(
            Instant::now() + limit,
            JOB_CHECK,
            || self.async_state(),
            || self.abort_elsewhere(),
        );
        self.conclude(outcome, || what.to_owned(), limit)
    }

    /// Turns the end of a wait into the caller's result; failures abort the communicator.
    fn conclude(
        &self,
        outcome: std::result::Result<(), Stop>,
        what: impl FnOnce() -> String,
        waited: Duration,
    ) -> Result<()> {
        let e = match outcome {
            Ok(()) => return Ok(()),
            Err(Stop::TimedOut) => {
                let e = DdpError::Cuda(CudaError::NcclTimeout {
                    rank: self.rank,
                    what: what(),
                    waited,
                });
                self.publish(&e);
                e
            }
            Err(Stop::Failed(e)) => {
                self.publish(&e);
                e
            }
            Err(Stop::Aborted(e)) => e,
        };
        self.fail(e.to_string());
        Err(e)
    }

    /// Another rank's failure, as the job's abort record holds it.
    fn abort_elsewhere(&self) -> Option<DdpError> {
        let record = self.pg.abort_record().ok().flatten()?;
        Some(DdpError::Collective(CollectiveError::JobAborted {
            rank: self.rank,
            during: self.lock().1.last.as_ref().map(|l| (l.0, l.1)),
            record,
        }))
    }

    /// Marks the communicator failed and aborts it (`ncclCommAbort`): kernels waiting for peers
    /// stop, later calls fail at once naming `reason`.
    fn fail(&self, reason: String) {
        let mut guard = self.lock();
        let (handle, state) = &mut *guard;
        state.failed.get_or_insert(reason);
        if !handle.0.is_null() {
            // SAFETY: a valid communicator; aborting is allowed while a non-blocking call on it
            // is in progress (that is what it is for).
            let _ = unsafe { result::comm_abort(handle.0) };
            handle.0 = std::ptr::null_mut();
        }
    }

    /// Publishes `e` as this rank's failure (so the other ranks stop waiting) and aborts the
    /// communicator.
    pub fn fail_with(&self, e: &DdpError) {
        self.publish(e);
        self.fail(e.to_string());
    }

    /// Aborts the communicator (as after a failure). Every later call fails.
    pub fn abort(&self) {
        self.fail(format!("rank {} aborted its NCCL communicator", self.rank));
    }

    /// Waits, with the collective deadline, for everything queued so far on the stream.
    ///
    /// On a failure the communicator is aborted, and the wait then goes on (at most
    /// [`DRAIN_LIMIT`]) until the stream is idle, so that buffers the caller frees next are no
    /// longer in use; the log says so if it never is. Likewise on a communicator aborted
    /// before the call.
    ///
    /// # Errors
    /// The deadline ([`CudaError::NcclTimeout`](crate::CudaError::NcclTimeout)), an NCCL or CUDA error, or a failure another
    /// rank published; the communicator is then aborted.
    pub fn wait(&self) -> Result<()> {
        let aborted = {
            let guard = self.lock();
            guard.0 .0.is_null().then(|| {
                let first = guard.1.failed.clone().unwrap_or_else(|| "aborted".into());
                self.failed_error(&guard.1, &first)
            })
        };
        if let Some(e) = aborted {
            self.drain_or_say(DRAIN_LIMIT);
            return Err(e);
        }
        let event = self
            .stream
            .record_event(None)
            .map_err(|e| driver_error(self.rank, "cuEventRecord on the NCCL stream", e))?;
        // The heartbeat names a peer that dies or freezes meanwhile in the abort record, which
        // the wait below polls: well before the deadline.
        let _watched = self.pg.waiting_on_peers();
        let outcome = wait_for(
            Instant::now() + self.timeout,
            JOB_CHECK,
            || match event.try_is_complete() {
                Ok(true) => Poll::Done,
                Ok(false) => match self.async_state() {
                    Poll::Failed(e) => Poll::Failed(e),
                    Poll::Done | Poll::Pending => Poll::Pending,
                },
                Err(e) => Poll::Failed(driver_error(self.rank, "waiting for NCCL's stream", e)),
            },
            || self.abort_elsewhere(),
        );
        let what = || {
            self.lock()
                .1
                .last
                .as_ref()
                .map(|l| l.2.clone())
                .unwrap_or_else(|| "the queued work".into())
        };
        let result = self.conclude(outcome, what, self.timeout);
        if result.is_err() {
            self.drain_or_say(DRAIN_LIMIT);
        }
        result
    }

    /// Waits at most `limit` until everything queued on the stream so far has finished (or,
    /// after an abort, stopped), without NCCL calls: a CUDA event on the stream, polled.
    /// `true` once it has; `false` at the limit or if the driver fails.
    pub fn drain(&self, limit: Duration) -> bool {
        let Ok(event) = self.stream.record_event(None) else {
            return false;
        };
        wait_for(
            Instant::now() + limit,
            limit,
            || match event.try_is_complete() {
                Ok(true) => Poll::Done,
                Ok(false) => Poll::Pending,
                Err(e) => Poll::Failed(driver_error(self.rank, "polling NCCL's stream", e)),
            },
            || None,
        )
        .is_ok()
    }

    /// [`NcclComm::drain`], saying in the log when the stream did not go idle.
    fn drain_or_say(&self, limit: Duration) -> bool {
        let idle = self.drain(limit);
        if !idle {
            tracing::error!(
                "[rank {}] NCCL's stream on GPU {} is still busy {limit:?} after its                  communicator was aborted: buffers it used must not be reused",
                self.rank,
                self.ctx.ordinal()
            );
        }
        idle
    }

    /// One all-reduce of a few KiB, waited for: NCCL (2.19+) connects peers inside the first
    /// collective of each algorithm, so doing it here, with its deadline, moves that out of the
    /// first backward pass and proves the communicator works end to end.
    ///
    /// # Errors
    /// As [`NcclComm::all_reduce`].
    pub fn warm_up(&self) -> Result<()> {
        let mut buf = self
            .stream
            .alloc_zeros::<f32>(1024)
            .map_err(|e| driver_error(self.rank, "allocating the warm-up buffer", e))?;
        self.all_reduce(&mut buf, ReduceOp::Sum)
    }

    /// Tells the other ranks (through the store) that this rank's NCCL work failed; on a
    /// communicator still on trial ([`NcclComm::probe`]), only the log hears of it.
    fn publish(&self, e: &DdpError) {
        if !self.publishing.load(Ordering::SeqCst) {
            tracing::debug!(
                "[rank {}] NCCL failed on trial, not published: {e}",
                self.rank
            );
            return;
        }
        if let Some(store) = self.pg.store_client() {
            let last = self.lock().1.last.as_ref().map(|l| (l.0, l.1));
            let _ = store.abort(AbortRecord {
                reporter: self.rank,
                culprit: None,
                collective: last,
                reason: e.to_string(),
            });
        }
    }

    /// Where the communicator's host-side work stands (`ncclCommGetAsyncError`): done
    /// (`ncclSuccess`), still going (`ncclInProgress`), or failed.
    fn async_state(&self) -> Poll {
        let guard = self.lock();
        let handle = guard.0 .0;
        if handle.is_null() {
            let first = guard.1.failed.clone().unwrap_or_else(|| "aborted".into());
            return Poll::Failed(self.failed_error(&guard.1, &first));
        }
        let mut code = ncclResult_t::ncclSuccess;
        // SAFETY: a valid communicator; `code` is written by NCCL. Thread-safe by NCCL's
        // contract for non-blocking communicators.
        let r = unsafe { sys::ncclCommGetAsyncError(handle, &mut code) };
        let code = if r == ncclResult_t::ncclSuccess {
            code
        } else {
            r
        };
        match code {
            ncclResult_t::ncclSuccess => Poll::Done,
            ncclResult_t::ncclInProgress => Poll::Pending,
            code => Poll::Failed(nccl_error(
                self.rank,
                "asynchronous error (ncclCommGetAsyncError)",
                code,
                last_error(handle),
            )),
        }
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        let raw = self.lock().0 .0;
        if raw.is_null() {
            return;
        }
        // Finished work is torn down cleanly: `ncclCommFinalize` (non-blocking, waited for with
        // a deadline), then `ncclCommDestroy`. Work still queued (a peer gone), a finalize that
        // fails or outlasts its deadline: abort, which never waits for peers.
        let idle = self
            .stream
            .record_event(None)
            .ok()
            .is_some_and(|e| e.try_is_complete().unwrap_or(false));
        let finalized = idle
            && self.ctx.bind_to_thread().is_ok()
            // SAFETY: a valid communicator that nothing else uses any more.
            && unsafe { sys::ncclCommFinalize(raw) }.result().is_ok()
            && wait_for(
                Instant::now() + self.timeout.min(FINALIZE_LIMIT),
                FINALIZE_LIMIT,
                || self.async_state(),
                || None,
            )
            .is_ok();
        let mut guard = self.lock();
        let handle = &mut guard.0;
        // SAFETY: a valid communicator that nothing else uses any more; after a completed
        // finalize, destroy only frees local resources.
        let _ = unsafe {
            if finalized {
                result::comm_destroy(handle.0)
            } else {
                result::comm_abort(handle.0)
            }
        };
        handle.0 = std::ptr::null_mut();
    }
}

impl Queue for NcclComm {
    fn wait(&self) -> Result<()> {
        NcclComm::wait(self)
    }

    fn fail_with(&self, e: &DdpError) {
        NcclComm::fail_with(self, e);
    }

    fn drain(&self, limit: Duration) -> bool {
        self.drain_or_say(limit)
    }
}

/// `ncclGetLastError`'s text for `comm`.
fn last_error(comm: sys::ncclComm_t) -> Option<String> {
    // SAFETY: NCCL returns a pointer to a NUL-terminated string it owns (or null); `comm` may be
    // null (the last error of the process).
    unsafe {
        let p = sys::ncclGetLastError(comm);
        (!p.is_null()).then(|| CStr::from_ptr(p).to_string_lossy().into_owned())
    }
}

/// Rank 0 creates the NCCL unique id; every rank returns it. Through the store when the group
/// has one (under a key per communicator), else by a broadcast over the group.
fn share_unique_id(pg: &ProcessGroup) -> Result<sys::ncclUniqueId> {
    let rank = pg.rank();
    let n = {
        let mut created = CREATED.lock().unwrap_or_else(|p| p.into_inner());
        let count = created
            .get_or_insert_with(HashMap::new)
            .entry(pg.tag().to_string())
            .or_insert(0);
        *count += 1;
        *count
    };
    let key = format!("{}/nccl/{n}/unique-id", pg.tag());
    let mine = if rank == Rank(0) {
        let id = result::get_uniqueid().map_err(|e| {
            nccl_error(
                rank,
                "ncclGetUniqueId",
                e.0,
                last_error(std::ptr::null_mut()),
            )
        })?;
        Some(id_to_bytes(&id))
    } else {
        None
    };
    let bytes = match (pg.store_client(), mine) {
        (Some(store), Some(bytes)) => {
            store.set(&key, &bytes)?;
            bytes
        }
        (Some(store), None) => store.get_timeout(&key, pg.timeouts().rendezvous)?,
        (None, mine) => pg.broadcast_bytes(mine.unwrap_or_default(), Rank(0))?,
    };
    id_from_bytes(&bytes).ok_or(DdpError::Cuda(CudaError::NcclIdMalformed {
        rank,
        len: bytes.len(),
    }))
}

pub(crate) fn id_to_bytes(id: &sys::ncclUniqueId) -> Vec<u8> {
    id.internal.iter().map(|&c| c as u8).collect()
}

pub(crate) fn id_from_bytes(bytes: &[u8]) -> Option<sys::ncclUniqueId> {
    let internal: [std::ffi::c_char; 128] =
        std::array::from_fn(|i| bytes.get(i).copied().unwrap_or(0) as std::ffi::c_char);
    (bytes.len() == 128).then_some(sys::ncclUniqueId { internal })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// At world size 1 every reduction is the identity, so no GPU run can tell a Max mapped to
    /// Sum: the table itself is checked, down to the values of NCCL's `nccl.h` enums, which is
    /// what crosses the C ABI.

    #[test]
    fn the_config_is_ncclh_2_17s_non_blocking_initializer() {
        let c = Config::non_blocking();
        // size_t size; unsigned magic, version; int blocking, cgaClusterSize, minCTAs, maxCTAs;
        // const char* netName; int splitShare (padded to 8).
        assert_eq!(c.size, 48);
        assert_eq!(std::mem::size_of::<Config>(), 48);
        assert_eq!(std::mem::offset_of!(Config, net_name), 32);
        assert_eq!(std::mem::offset_of!(Config, split_share), 40);
        assert_eq!((c.magic, c.version, c.blocking), (0xcafe_beef, 21_700, 0));
        assert_eq!(c.min_ctas, i32::MIN);
        assert!(c.net_name.is_null());
        // cudarc's binding of the newest layout starts the same way: NCCL reads a config by
        // these leading fields.
        assert_eq!(std::mem::offset_of!(sys::ncclConfig_t, blocking), 16);
        assert_eq!(std::mem::offset_of!(sys::ncclConfig_t, netName), 32);
        assert!(std::mem::size_of::<sys::ncclConfig_t>() >= 48);
        assert!(NcclVersion::from_code(21_400).has_nonblocking());
        assert!(!NcclVersion::from_code(21_304).has_nonblocking());
    }

    #[test]
    fn unique_ids_survive_the_store_and_bad_ones_are_refused() {
        let mut id = sys::ncclUniqueId { internal: [0; 128] };
        for (i, c) in id.internal.iter_mut().enumerate() {
            *c = (i as u8).wrapping_mul(37) as std::ffi::c_char;
        }
        let bytes = id_to_bytes(&id);
        assert_eq!(bytes.len(), 128);
        assert_eq!(id_from_bytes(&bytes).map(|b| b.internal), Some(id.internal));
        assert!(id_from_bytes(&bytes[..127]).is_none());
        assert!(id_from_bytes(&[]).is_none());
    }
}
