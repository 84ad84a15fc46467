//! Communicators: how bytes move between the ranks of a group.
//!
//! - `mod.rs`: the [`Communicator`] trait, the `PeerWatch` a communicator is handed (the heartbeat)
//! - `memory.rs`: large host buffers for the collectives (transparent huge pages, touched up front)
//! - `reduce.rs`: element-wise reduction kernels shared by the host transports, and `split`
//! - `tcp/`: ring collectives between processes over TCP
//! - `local.rs`: collectives between the threads of one process
//! - `p2p.rs`: point-to-point messages (send/recv), between processes and between threads
//! - `pipe.rs`: a byte stream through shared memory between two processes of one host (the
//!   point-to-point messages of a group that shares memory)
//! - `queue.rs`: [`Queue`], a stream of device collectives as the release of their buffers
//!   needs it (waited for, stopped, drained)
//!
//! Every implementation of [`Communicator`] works on host memory, checks that all ranks call
//! the same collective (a [`CollectiveDesc`] per call), and never waits without a deadline.
//! The typed, user-facing API is on [`ProcessGroup`](crate::ProcessGroup).

use std::fmt;
use std::time::Duration;

use crate::types::{CollectiveSeq, Rank, WorldSize};
use crate::Result;

mod local;
pub(crate) mod memory;
pub(crate) mod p2p;
mod pipe;
mod queue;
pub(crate) mod reduce;
pub(crate) mod tcp;

pub use crate::types::{CollectiveDesc, CollectiveOp, DType, Element, ReduceOp};
pub use local::LocalCommunicator;
pub use queue::{Queue, DRAIN_LIMIT};
pub(crate) use tcp::Tuning;
pub use tcp::{SharedArena, TcpCommunicator};

/// Collectives on host memory. Buffers are raw bytes holding whole elements of the given
/// [`DType`]; lengths are validated by [`ProcessGroup`](crate::ProcessGroup) before they get here.
///
/// All ranks must call the same collectives in the same order. Implementations compare each
/// call's [`CollectiveDesc`] across ranks and fail with `CollectiveMismatch` when they differ.
pub trait Communicator: Send + Sync + fmt::Debug {
    /// This rank.
    fn rank(&self) -> Rank;

    /// Number of ranks.
    fn world_size(&self) -> WorldSize;

    /// Short name of the transport (`"shm"`, `"tcp"`, `"local"`).
    fn transport(&self) -> &'static str;

    /// Reduces `buf` across ranks in place.
    ///
    /// # Errors
    /// Peer failure, timeout, mismatch, or an earlier failure of this group.
    fn all_reduce(&self, buf: &mut [u8], dtype: DType, op: ReduceOp) -> Result<()>;

    /// Copies `root`'s `buf` to every rank.
    ///
    /// # Errors
    /// As [`Communicator::all_reduce`].
    fn broadcast(&self, buf: &mut [u8], dtype: DType, root: Rank) -> Result<()>;

    /// Concatenates every rank's `send` into `recv` (`world_size * send.len()` bytes), in rank order.
    ///
    /// # Errors
    /// As [`Communicator::all_reduce`].
    fn all_gather(&self, send: &[u8], recv: &mut [u8], dtype: DType) -> Result<()>;

    /// Reduces `send` (`world_size` blocks of `recv.len()` bytes) across ranks; rank r receives
    /// block r of the result.
    ///
    /// # Errors
    /// As [`Communicator::all_reduce`].
    fn reduce_scatter(
        &self,
        send: &[u8],
        recv: &mut [u8],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<()>;

    /// Returns once every rank has entered the barrier.
    ///
    /// # Errors
    /// As [`Communicator::all_reduce`].
    fn barrier(&self) -> Result<()>;

    /// Allocates `bytes` for every rank in memory that all ranks map (a collective): `None`
    /// when the group does not run its collectives in one shared segment now, or the memory
    /// could not be had (every rank gets the same answer, and a warning says why).
    ///
    /// # Errors
    /// As [`Communicator::all_reduce`].
    fn allocate_shared(&self, bytes: usize) -> Result<Option<SharedArena>> {
        let _ = bytes;
        Ok(None)
    }

    /// Reduces bytes `at` of every rank's region of `arena` (whole elements of `dtype`) with
    /// `op`, where they lie: every rank's region ends with the result.
    ///
    /// # Errors
    /// As [`Communicator::all_reduce`].
    fn all_reduce_shared(
        &self,
        arena: &SharedArena,
        at: std::ops::Range<usize>,
        dtype: DType,
        op: ReduceOp,
    ) -> Result<()> {
        all_reduce_own_region(self, arena, at, dtype, op)
    }

    /// Marks the group failed and releases its connections so that peers fail fast too.
    /// Later calls return `GroupAborted`.
    fn abort(&self);

    /// Runs the following collectives with `algorithm`; every rank must switch at the same
    /// point of its sequence. Transports with one algorithm ignore it.
    ///
    /// # Errors
    /// The transport cannot run `algorithm` (a TCP group connected for the ring only).
    fn set_algorithm(&self, algorithm: crate::config::Algorithm) -> Result<()> {
        let _ = algorithm;
        Ok(())
    }

    /// Moves the following collectives over `transport` (`Auto`: shared memory when the group
    /// has a segment); every rank must switch at the same point of its sequence. Transports
    /// with one way of moving bytes ignore it.
    ///
    /// # Errors
    /// `Shm` asked of a group without a shared segment.
    fn set_transport(&self, transport: crate::config::Transport) -> Result<()> {
        let _ = transport;
        Ok(())
    }
}

/// A watch on the other ranks that the process group hands a communicator (its heartbeat, see
/// `group/heartbeat.rs`). The communicator reports when each collective starts and ends; when a
/// collective fails, the watch says whether it had found a peer dead or stuck, and stopped the
/// collective for that reason.
pub(crate) trait PeerWatch: Send + Sync + fmt::Debug {
    /// Collective `seq` starts on this rank.
    fn enter(&self, seq: CollectiveSeq);
    /// Collective `seq` ended on this rank, completed if `ok`.
    fn leave(&self, seq: CollectiveSeq, ok: bool);
    /// Why the watch stopped this rank's collectives, if it did.
    fn verdict(&self) -> Option<Verdict>;
    /// How long after a peer falls silent the watch reaches its verdict, at most.
    fn bound(&self) -> Duration;
}

/// Why a [`PeerWatch`] stopped this rank's collectives: the rank at fault, as its heartbeat showed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Verdict {
    pub(crate) culprit: Rank,
    pub(crate) host: String,
    pub(crate) last_completed: CollectiveSeq,
    pub(crate) what: String,
    /// The verdict is that the store went silent (so it cannot be published there).
    pub(crate) store_silent: bool,
}

/// All-reduces bytes `at` of this rank's region of `arena` as a buffer of its own, for a
/// communicator whose collectives do not run in the arena's segment (one that never allocates
/// arenas, or a group moved over TCP since).
///
/// # Errors
/// As [`Communicator::all_reduce`].
pub(crate) fn all_reduce_own_region<C: Communicator + ?Sized>(
    comm: &C,
    arena: &SharedArena,
    at: std::ops::Range<usize>,
    dtype: DType,
    op: ReduceOp,
) -> Result<()> {
    // SAFETY: other ranks touch an arena's regions only inside a shared all-reduce in its
    // segment, which this communicator does not run.
    let buf = unsafe { arena.bytes_mut(arena.place(), at) };
    comm.all_reduce(buf, dtype, op)
}
