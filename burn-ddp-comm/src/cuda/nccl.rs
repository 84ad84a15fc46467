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

use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr};
use cudarc::nccl::result::{self, NcclStatus};
use cudarc::nccl::sys::{self, ncclDataType_t, ncclRedOp_t, ncclResult_t};

use super::library::{usable_nccl, NcclVersion};
use super::status::{driver_error, nccl_error};
use super::wait::{wait_for, Poll, Stop};
use crate::comm::{CollectiveOp, DType, Element, Queue, ReduceOp, DRAIN_LIMIT};
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

/// One transfer of [`NcclComm::send_recv_raw`]: a device pointer, its element count and type,
/// and the peer (a rank of the communicator's group).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NcclP2p {
    /// Send `count` elements at `ptr` to `peer`.
    Send {
        /// Device pointer.
        ptr: u64,
        /// Elements.
        count: usize,
        /// Their type.
        dtype: DType,
        /// The receiving rank.
        peer: Rank,
    },
    /// Receive `count` elements from `peer` into `ptr`.
    Recv {
        /// Device pointer.
        ptr: u64,
        /// Elements.
        count: usize,
        /// Their type.
        dtype: DType,
        /// The sending rank.
        peer: Rank,
    },
}

/// NCCL's element type for `dtype`.
pub(crate) fn nccl_dtype(dtype: DType) -> ncclDataType_t {
    match dtype {
        DType::F32 => ncclDataType_t::ncclFloat32,
        DType::F64 => ncclDataType_t::ncclFloat64,
        DType::F16 => ncclDataType_t::ncclFloat16,
        DType::BF16 => ncclDataType_t::ncclBfloat16,
        DType::I32 => ncclDataType_t::ncclInt32,
        DType::I64 => ncclDataType_t::ncclInt64,
        DType::U8 => ncclDataType_t::ncclUint8,
    }
}

/// NCCL's reduction for `op` on `dtype`, or why this NCCL cannot do it.
pub(crate) fn nccl_op(
    op: ReduceOp,
    dtype: DType,
    version: NcclVersion,
) -> std::result::Result<ncclRedOp_t, String> {
    Ok(match op {
        ReduceOp::Sum => ncclRedOp_t::ncclSum,
        ReduceOp::Max => ncclRedOp_t::ncclMax,
        ReduceOp::Min => ncclRedOp_t::ncclMin,
        ReduceOp::Mean => {
            if !matches!(dtype, DType::F32 | DType::F64 | DType::F16 | DType::BF16) {
                return Err(format!(
                    "mean of {dtype} values: NCCL averages floating-point types only; reduce with \
                     ReduceOp::Sum and divide by the world size"
                ));
            }
            if !version.has_avg() {
                return Err(format!(
                    "mean needs ncclAvg (NCCL 2.10 or newer); this process loaded NCCL {version}"
                ));
            }
            ncclRedOp_t::ncclAvg
        }
    })
}

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

/// Checks that a tensor of `numel` elements of type `got` (the Burn line's dtype) is a bucket
/// of `count` elements of type `want`; the message says what differs.
pub fn check_elements<T: PartialEq + fmt::Debug>(
    numel: usize,
    got: T,
    count: usize,
    want: T,
) -> std::result::Result<(), String> {
    if numel != count {
        return Err(format!("it has {numel} elements, the bucket plan {count}"));
    }
    if got != want {
        return Err(format!("its elements are {got:?}, the bucket's {want:?}"));
    }
    Ok(())
}

/// Checks that a device buffer of `bytes` bytes holds a bucket of `count` elements of `dtype`
/// (what the device paths check before handing a pointer to NCCL); the message says what does
/// not fit.
pub fn check_span(bytes: u64, count: usize, dtype: DType) -> std::result::Result<(), String> {
    let need = count as u64 * dtype.size() as u64;
    if bytes >= need {
        Ok(())
    } else {
        Err(format!(
            "the bucket's device buffer has {bytes} bytes but {count} x {dtype} need {need}"
        ))
    }
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
    /// NCCL missing ([`DdpError::NcclUnavailable`], saying what to install or link), no GPU for
    /// this rank, NCCL or driver failures with their text, or the rendezvous deadline.
    pub fn new(pg: &ProcessGroup) -> Result<Self> {
        let ordinal = super::device::ordinal_for(pg.rank(), pg.local_rank(), None)?;
        Self::on(pg, super::device::context(pg.rank(), ordinal)?)
    }

    /// As [`NcclComm::new`], on GPU `ordinal` (where this rank's tensors are), checked against
    /// the GPU its `LOCAL_RANK` names when the process sees several.
    ///
    /// # Errors
    /// As [`NcclComm::new`], and [`DdpError::DeviceMismatch`] naming both GPUs.
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
        let nranks = i32::try_from(world.get()).map_err(|_| DdpError::InvalidConfig {
            field: "WORLD_SIZE",
            reason: "NCCL takes at most 2^31 - 1 ranks",
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
        DdpError::GroupAborted {
            rank: self.rank,
            first: Box::new(AbortRecord {
                reporter: self.rank,
                culprit: None,
                collective: state.last.as_ref().map(|l| (l.0, l.1)),
                reason: first.to_owned(),
            }),
        }
    }

    /// Issues one NCCL call on the stream; `f` gets the communicator and the stream. If NCCL
    /// answers `ncclInProgress` (it is still connecting to peers), waits for it to take the call,
    /// with the collective deadline and without holding the handle's lock.
    fn launch(
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
                let e = DdpError::NcclTimeout {
                    rank: self.rank,
                    what: what(),
                    waited,
                };
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
        Some(DdpError::JobAborted {
            rank: self.rank,
            during: self.lock().1.last.as_ref().map(|l| (l.0, l.1)),
            record,
        })
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
    /// The deadline ([`DdpError::NcclTimeout`]), an NCCL or CUDA error, or a failure another
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

    fn check_len(
        &self,
        op: CollectiveOp,
        what: &'static str,
        expected: usize,
        got: usize,
    ) -> Result<()> {
        if expected == got {
            return Ok(());
        }
        Err(DdpError::BufferSize {
            rank: self.rank,
            op,
            what,
            expected,
            got,
        })
    }

    /// NCCL's reduction for `op` on `dtype`, or an error saying why it is not available.
    fn reduction(&self, op: ReduceOp, dtype: DType, call: &str) -> Result<ncclRedOp_t> {
        nccl_op(op, dtype, self.version).map_err(|reason| DdpError::NcclUnsupported {
            rank: self.rank,
            what: call.into(),
            reason,
        })
    }

    /// Queues an all-reduce of `count` elements from `send` into `recv` (equal for in place).
    ///
    /// # Safety
    /// `send` and `recv` must be device pointers on this communicator's GPU to at least
    /// `count` elements of `dtype`, and stay valid until [`NcclComm::wait`] returns. Work that
    /// writes `send` must be complete (or ordered before this stream); nothing may read `recv`
    /// before the wait.
    ///
    /// # Errors
    /// The reduction is not available for `dtype`, or NCCL refuses the call.
    pub unsafe fn all_reduce_raw(
        &self,
        send: u64,
        recv: u64,
        count: usize,
        dtype: DType,
        op: ReduceOp,
    ) -> Result<CollectiveSeq> {
        let red = self.reduction(op, dtype, "ncclAllReduce")?;
        self.launch(
            CollectiveOp::AllReduce,
            format!("{count} x {dtype}, {op}"),
            "ncclAllReduce",
            |comm, stream| {
                // SAFETY: the caller's contract covers the pointers; comm and stream are live.
                unsafe {
                    result::all_reduce(
                        send as *const c_void,
                        recv as *mut c_void,
                        count,
                        nccl_dtype(dtype),
                        red,
                        comm,
                        stream,
                    )
                }
            },
        )
    }

    /// Queues point-to-point transfers on device pointers as one NCCL group
    /// (`ncclGroupStart`, `ncclSend`/`ncclRecv` per transfer, `ncclGroupEnd`): NCCL runs them
    /// concurrently, so a rank may send to and receive from the same peer in one batch without
    /// deadlock (PyTorch's `batch_isend_irecv`). [`NcclComm::wait`] completes them. Peers are
    /// ranks of this communicator's group; every send needs the peer's matching receive (same
    /// count and type) in its own batch.
    ///
    /// # Safety
    /// Every pointer must be a device pointer on this communicator's GPU to at least its count of
    /// elements of its type, and stay valid until [`NcclComm::wait`] returns; nothing may read a
    /// receive buffer or write a send buffer before then.
    ///
    /// # Errors
    /// A peer outside the group or this rank itself ([`DdpError::InvalidGroupCall`]); bfloat16
    /// before NCCL 2.10; NCCL refuses a call.
    pub unsafe fn send_recv_raw(&self, ops: &[NcclP2p]) -> Result<CollectiveSeq> {
        for op in ops {
            let (peer, dtype) = match *op {
                NcclP2p::Send { peer, dtype, .. } | NcclP2p::Recv { peer, dtype, .. } => {
                    (peer, dtype)
                }
            };
            if peer.0 >= self.world.get() || peer == self.rank {
                return Err(DdpError::InvalidGroupCall {
                    rank: self.rank,
                    what: "NCCL send/recv",
                    reason: format!(
                        "peer {peer} is this rank or outside the group of {} ranks",
                        self.world
                    ),
                });
            }
            if dtype == DType::BF16 && !self.version.has_bf16() {
                return Err(DdpError::NcclUnsupported {
                    rank: self.rank,
                    what: "ncclSend/ncclRecv".into(),
                    reason: format!(
                        "bfloat16 needs NCCL 2.10 or later, this is {}",
                        self.version
                    ),
                });
            }
        }
        let op = if ops.iter().all(|o| matches!(o, NcclP2p::Recv { .. })) {
            CollectiveOp::Recv
        } else {
            CollectiveOp::Send
        };
        let what = ops
            .iter()
            .map(|o| match *o {
                NcclP2p::Send {
                    count, dtype, peer, ..
                } => format!("send {count} x {dtype} to {peer}"),
                NcclP2p::Recv {
                    count, dtype, peer, ..
                } => format!("recv {count} x {dtype} from {peer}"),
            })
            .collect::<Vec<_>>()
            .join(", ");
        self.launch(op, what, "ncclSend/ncclRecv", |comm, stream| {
            result::group_start()?;
            let mut first = Ok(NcclStatus::Success);
            for o in ops {
                // SAFETY: the caller's contract covers the pointers; comm and stream are live.
                let r = unsafe {
                    match *o {
                        NcclP2p::Send {
                            ptr,
                            count,
                            dtype,
                            peer,
                        } => result::send(
                            ptr as *const c_void,
                            count,
                            nccl_dtype(dtype),
                            peer.0 as c_int,
                            comm,
                            stream,
                        ),
                        NcclP2p::Recv {
                            ptr,
                            count,
                            dtype,
                            peer,
                        } => result::recv(
                            ptr as *mut c_void,
                            count,
                            nccl_dtype(dtype),
                            peer.0 as c_int,
                            comm,
                            stream,
                        ),
                    }
                };
                if first.is_ok() {
                    if let Err(e) = r {
                        first = Err(e);
                    }
                }
            }
            // The group is closed whatever happened inside it.
            let end = result::group_end();
            first.and(end)
        })
    }

    /// Sends `buf` to rank `peer` of the group and waits for the transfer (the peer must call
    /// [`NcclComm::recv`] with a buffer of the same length).
    ///
    /// # Errors
    /// As [`NcclComm::send_recv_raw`] and [`NcclComm::wait`].
    pub fn send<T: Element + DeviceRepr>(&self, buf: &CudaSlice<T>, peer: Rank) -> Result<()> {
        let count = buf.len();
        {
            let (ptr, _sync) = buf.device_ptr(&self.stream);
            let op = NcclP2p::Send {
                ptr,
                count,
                dtype: T::DTYPE,
                peer,
            };
            // SAFETY: `buf` is a live allocation of `count` T on this GPU; `_sync` orders its
            // earlier writes before this stream and this stream's read before later writes.
            unsafe { self.send_recv_raw(&[op]) }?;
        }
        self.wait()
    }

    /// Receives rank `peer`'s [`NcclComm::send`] into `buf` and waits for it.
    ///
    /// # Errors
    /// As [`NcclComm::send_recv_raw`] and [`NcclComm::wait`].
    pub fn recv<T: Element + DeviceRepr>(&self, buf: &mut CudaSlice<T>, peer: Rank) -> Result<()> {
        let count = buf.len();
        {
            let (ptr, _sync) = buf.device_ptr_mut(&self.stream);
            let op = NcclP2p::Recv {
                ptr,
                count,
                dtype: T::DTYPE,
                peer,
            };
            // SAFETY: as in `send`, for a write.
            unsafe { self.send_recv_raw(&[op]) }?;
        }
        self.wait()
    }

    /// Queues a broadcast of `count` elements from `root`'s `send` into every rank's `recv`.
    ///
    /// # Safety
    /// As [`NcclComm::all_reduce_raw`].
    ///
    /// # Errors
    /// `root` outside the group, or NCCL refuses the call.
    pub unsafe fn broadcast_raw(
        &self,
        send: u64,
        recv: u64,
        count: usize,
        dtype: DType,
        root: Rank,
    ) -> Result<CollectiveSeq> {
        if root.0 >= self.world.get() {
            return Err(DdpError::InvalidRoot {
                rank: self.rank,
                root,
                world: self.world,
            });
        }
        self.launch(
            CollectiveOp::Broadcast,
            format!("{count} x {dtype}, root {root}"),
            "ncclBroadcast",
            |comm, stream| {
                // SAFETY: as in `all_reduce_raw`.
                unsafe {
                    result::broadcast(
                        send as *const c_void,
                        recv as *mut c_void,
                        count,
                        nccl_dtype(dtype),
                        root.0 as i32,
                        comm,
                        stream,
                    )
                }
            },
        )
    }

    /// Queues an all-gather: `send` holds `count` elements, `recv` `world * count`.
    ///
    /// # Safety
    /// As [`NcclComm::all_reduce_raw`], with `recv` holding `world * count` elements.
    ///
    /// # Errors
    /// NCCL refuses the call.
    pub unsafe fn all_gather_raw(
        &self,
        send: u64,
        recv: u64,
        count: usize,
        dtype: DType,
    ) -> Result<CollectiveSeq> {
        self.launch(
            CollectiveOp::AllGather,
            format!("{count} x {dtype} per rank"),
            "ncclAllGather",
            |comm, stream| {
                // SAFETY: as in `all_reduce_raw`.
                unsafe {
                    result::all_gather(
                        send as *const c_void,
                        recv as *mut c_void,
                        count,
                        nccl_dtype(dtype),
                        comm,
                        stream,
                    )
                }
            },
        )
    }

    /// Queues a reduce-scatter: `send` holds `world * count` elements, `recv` `count`.
    ///
    /// # Safety
    /// As [`NcclComm::all_reduce_raw`], with `send` holding `world * count` elements.
    ///
    /// # Errors
    /// The reduction is not available for `dtype`, or NCCL refuses the call.
    pub unsafe fn reduce_scatter_raw(
        &self,
        send: u64,
        recv: u64,
        count: usize,
        dtype: DType,
        op: ReduceOp,
    ) -> Result<CollectiveSeq> {
        let red = self.reduction(op, dtype, "ncclReduceScatter")?;
        self.launch(
            CollectiveOp::ReduceScatter,
            format!("{count} x {dtype} per rank, {op}"),
            "ncclReduceScatter",
            |comm, stream| {
                // SAFETY: as in `all_reduce_raw`.
                unsafe {
                    result::reduce_scatter(
                        send as *const c_void,
                        recv as *mut c_void,
                        count,
                        nccl_dtype(dtype),
                        red,
                        comm,
                        stream,
                    )
                }
            },
        )
    }

    /// All-reduces `buf` in place and waits for the result.
    ///
    /// # Errors
    /// As [`NcclComm::all_reduce_raw`] and [`NcclComm::wait`].
    pub fn all_reduce<T: Element + DeviceRepr>(
        &self,
        buf: &mut CudaSlice<T>,
        op: ReduceOp,
    ) -> Result<()> {
        self.queue_all_reduce(buf, op)?;
        self.wait()
    }

    /// Queues an in-place all-reduce of `buf` (a `CudaSlice` or a view of one) on this
    /// communicator's stream and returns at once; [`NcclComm::wait`] completes it. Safe for the
    /// reason cudarc's own NCCL calls are: the write is recorded on `buf`, and cudarc orders
    /// every later use of its memory, and its release, after this stream's work.
    ///
    /// # Errors
    /// As [`NcclComm::all_reduce_raw`].
    pub fn queue_all_reduce<T: Element + DeviceRepr, B: DevicePtrMut<T>>(
        &self,
        buf: &mut B,
        op: ReduceOp,
    ) -> Result<CollectiveSeq> {
        let count = buf.len();
        let (ptr, _record) = buf.device_ptr_mut(&self.stream);
        // SAFETY: `buf` is a live allocation of `count` T on this GPU: cudarc orders its earlier
        // writes before this stream, and `_record` records this stream's write on it, so nothing
        // reads it or frees it before the all-reduce is done.
        unsafe { self.all_reduce_raw(ptr, ptr, count, T::DTYPE, op) }
    }

    /// Copies `root`'s `buf` to every rank and waits for it.
    ///
    /// # Errors
    /// As [`NcclComm::broadcast_raw`] and [`NcclComm::wait`].
    pub fn broadcast<T: Element + DeviceRepr>(
        &self,
        buf: &mut CudaSlice<T>,
        root: Rank,
    ) -> Result<()> {
        let count = buf.len();
        {
            let (ptr, _sync) = buf.device_ptr_mut(&self.stream);
            // SAFETY: as in `all_reduce`.
            unsafe { self.broadcast_raw(ptr, ptr, count, T::DTYPE, root) }?;
        }
        self.wait()
    }

    /// Concatenates every rank's `send` into `recv` (`world * send.len()`), in rank order.
    ///
    /// # Errors
    /// `recv` of the wrong length, and as [`NcclComm::all_gather_raw`] and [`NcclComm::wait`].
    pub fn all_gather<T: Element + DeviceRepr>(
        &self,
        send: &CudaSlice<T>,
        recv: &mut CudaSlice<T>,
    ) -> Result<()> {
        let count = send.len();
        self.check_len(
            CollectiveOp::AllGather,
            "recv",
            count * self.world.get() as usize,
            recv.len(),
        )?;
        {
            let (s, _s) = send.device_ptr(&self.stream);
            let (r, _r) = recv.device_ptr_mut(&self.stream);
            // SAFETY: as in `all_reduce`; lengths checked above.
            unsafe { self.all_gather_raw(s, r, count, T::DTYPE) }?;
        }
        self.wait()
    }

    /// Reduces `send` (`world` blocks of `recv.len()`) across ranks; rank r receives block r.
    ///
    /// # Errors
    /// `send` of the wrong length, and as [`NcclComm::reduce_scatter_raw`] and
    /// [`NcclComm::wait`].
    pub fn reduce_scatter<T: Element + DeviceRepr>(
        &self,
        send: &CudaSlice<T>,
        recv: &mut CudaSlice<T>,
        op: ReduceOp,
    ) -> Result<()> {
        let count = recv.len();
        self.check_len(
            CollectiveOp::ReduceScatter,
            "send",
            count * self.world.get() as usize,
            send.len(),
        )?;
        {
            let (s, _s) = send.device_ptr(&self.stream);
            let (r, _r) = recv.device_ptr_mut(&self.stream);
            // SAFETY: as in `all_reduce`; lengths checked above.
            unsafe { self.reduce_scatter_raw(s, r, count, T::DTYPE, op) }?;
        }
        self.wait()
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
    id_from_bytes(&bytes).ok_or(DdpError::NcclIdMalformed {
        rank,
        len: bytes.len(),
    })
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

    #[test]
    fn a_bucket_tensor_must_match_the_plan_in_count_and_type() {
        assert!(check_elements(1024, DType::F32, 1024, DType::F32).is_ok());
        assert!(check_elements(8, DType::BF16, 8, DType::BF16).is_ok());
        let e = check_elements(1023, DType::F32, 1024, DType::F32).unwrap_err();
        assert!(e.contains("1023 elements, the bucket plan 1024"), "{e}");
        let e = check_elements(8, DType::F32, 8, DType::F16).unwrap_err();
        assert!(e.contains("F32"), "{e}");
    }

    #[test]
    fn a_bucket_must_fit_its_device_buffer() {
        assert!(check_span(4096, 1024, DType::F32).is_ok());
        assert!(check_span(4096, 2048, DType::F16).is_ok());
        let e = check_span(4092, 1024, DType::F32).unwrap_err();
        assert!(e.contains("4092 bytes but 1024 x float need 4096"), "{e}");
    }

    #[test]
    fn every_dtype_and_op_maps_to_nccl() {
        let v = NcclVersion::from_code(22_304);
        for dtype in [
            DType::F32,
            DType::F64,
            DType::F16,
            DType::BF16,
            DType::I32,
            DType::I64,
            DType::U8,
        ] {
            let t = nccl_dtype(dtype);
            assert_ne!(t, ncclDataType_t::ncclNumTypes);
            for op in [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min] {
                assert!(nccl_op(op, dtype, v).is_ok(), "{op} {dtype}");
            }
        }
        assert_eq!(nccl_dtype(DType::BF16), ncclDataType_t::ncclBfloat16);
        assert_eq!(
            nccl_op(ReduceOp::Mean, DType::BF16, v),
            Ok(ncclRedOp_t::ncclAvg)
        );
        let int_mean = nccl_op(ReduceOp::Mean, DType::I64, v).unwrap_err();
        assert!(int_mean.contains("ReduceOp::Sum"), "{int_mean}");
        let old = nccl_op(ReduceOp::Mean, DType::F32, NcclVersion::from_code(2_804)).unwrap_err();
        assert!(old.contains("NCCL 2.8.4"), "{old}");
    }

    /// At world size 1 every reduction is the identity, so no GPU run can tell a Max mapped to
    /// Sum: the table itself is checked, down to the values of NCCL's `nccl.h` enums, which is
    /// what crosses the C ABI.
    #[test]
    fn the_op_and_type_tables_are_ncclh() {
        let v = NcclVersion::from_code(22_304);
        let ops = [
            (ReduceOp::Sum, ncclRedOp_t::ncclSum, 0),
            (ReduceOp::Max, ncclRedOp_t::ncclMax, 2),
            (ReduceOp::Min, ncclRedOp_t::ncclMin, 3),
            (ReduceOp::Mean, ncclRedOp_t::ncclAvg, 4),
        ];
        for (op, want, value) in ops {
            let got = nccl_op(op, DType::F32, v).unwrap();
            assert_eq!(got, want, "{op}");
            assert_eq!(got as u32, value, "{op}: nccl.h's value");
        }
        let types = [
            (DType::U8, 1),
            (DType::I32, 2),
            (DType::I64, 4),
            (DType::F16, 6),
            (DType::F32, 7),
            (DType::F64, 8),
            (DType::BF16, 9),
        ];
        for (dtype, value) in types {
            assert_eq!(nccl_dtype(dtype) as u32, value, "{dtype}: nccl.h's value");
        }
    }

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
