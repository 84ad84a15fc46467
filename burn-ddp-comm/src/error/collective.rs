//! [`CollectiveError`]: a collective or point-to-point call on a group: a peer lost, finished or
//! frozen, a deadline, a mismatch, a wrong call.

use std::io;
use std::time::Duration;

use crate::types::{AbortRecord, CollectiveSeq, Rank, StallDiagnosis, WorldSize};
use crate::types::{CollectiveDesc, CollectiveOp};

use super::{during_prefix, DdpError};

/// A collective or point-to-point call on a group: a peer lost, finished or frozen, a deadline, a
/// mismatch, a wrong call. Nested in [`DdpError::Collective`](crate::DdpError::Collective);
/// messages start with the rank that saw the problem.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CollectiveError {
    /// A neighbour closed its connection in the middle of a collective.
    #[error(
        "[rank {rank}] rank {peer} closed its connection during {op} {seq} ({cause}): it exited or crashed. \
         See rank {peer}'s output for the cause"
    )]
    PeerLost {
        /// This rank.
        rank: Rank,
        /// The rank that disappeared.
        peer: Rank,
        /// The collective in progress.
        op: CollectiveOp,
        /// Its sequence number.
        seq: CollectiveSeq,
        /// What the socket reported.
        cause: io::ErrorKind,
    },

    /// A neighbour finished normally (its process group was dropped without an error) while
    /// this rank still ran collectives: the ranks made different numbers of calls, typically
    /// because they had different numbers of batches.
    #[error(
        "[rank {rank}] rank {peer} ended normally (no panic, no failure reported) and left the \
         job while this rank was in {op} {seq}: the ranks ran different numbers of steps (see \
         rank {peer}'s output if it stopped on an error of its own). With uneven inputs (ranks with different \
         numbers of batches), train inside `GradSync::join` (Burn 0.22) or `DdpSession::join` \
         (Burn 0.21); otherwise give every rank the same number of steps (DistributedSampler \
         gives every rank the same number of batches)"
    )]
    PeerFinished {
        /// This rank.
        rank: Rank,
        /// The rank that finished.
        peer: Rank,
        /// The collective in progress.
        op: CollectiveOp,
        /// Its sequence number.
        seq: CollectiveSeq,
    },

    /// Another rank reported a failure and aborted the job.
    #[error("[rank {rank}] {}the job was aborted: {record}", during_prefix(.during))]
    JobAborted {
        /// This rank.
        rank: Rank,
        /// The collective this rank was in when it learnt of the abort, if any.
        during: Option<(CollectiveOp, CollectiveSeq)>,
        /// What the first failing rank reported.
        record: AbortRecord,
    },

    /// A collective did not complete within its deadline.
    #[error(
        "[rank {rank}] {op} {seq} timed out after {waited:?}: {diagnosis}. Every rank must call the \
         same collectives in the same order; if the stalled rank is just slow (data loading, a \
         long validation), raise the collective timeout (BURN_DDP_COLLECTIVE_TIMEOUT)"
    )]
    CollectiveTimeout {
        /// This rank.
        rank: Rank,
        /// The collective.
        op: CollectiveOp,
        /// Its sequence number.
        seq: CollectiveSeq,
        /// How long it waited.
        waited: Duration,
        /// Which ranks were found stalled (or which neighbour this rank waited on).
        diagnosis: StallDiagnosis,
    },

    /// Two ranks called different collectives at the same point of the sequence.
    #[error(
        "[rank {rank}] collective mismatch at {seq}: this rank called {ours}, rank {peer} called {theirs} \
         (at its {their_seq}). Every rank must call the same collectives, with the same sizes and types, \
         in the same order"
    )]
    CollectiveMismatch {
        /// This rank.
        rank: Rank,
        /// The other rank.
        peer: Rank,
        /// Our sequence number.
        seq: CollectiveSeq,
        /// Theirs.
        their_seq: CollectiveSeq,
        /// What we called.
        ours: CollectiveDesc,
        /// What they called.
        theirs: CollectiveDesc,
    },

    /// A buffer passed to a collective has the wrong length.
    #[error("[rank {rank}] {op}: {what} has {got} elements, expected {expected}")]
    BufferSize {
        /// This rank.
        rank: Rank,
        /// The collective.
        op: CollectiveOp,
        /// Which buffer.
        what: &'static str,
        /// Expected length.
        expected: usize,
        /// Actual length.
        got: usize,
    },

    /// The root of a broadcast is not a rank of the group.
    #[error("[rank {rank}] broadcast root {root} is outside the world of {world}")]
    InvalidRoot {
        /// This rank.
        rank: Rank,
        /// The root given.
        root: Rank,
        /// The world size.
        world: WorldSize,
    },

    /// A sub-group or point-to-point call got an argument that cannot work.
    #[error("[rank {rank}] {what}: {reason}")]
    InvalidGroupCall {
        /// This rank.
        rank: Rank,
        /// The call (`new_group`, `send`, ...).
        what: &'static str,
        /// What is wrong, and what is accepted.
        reason: String,
    },

    /// A point-to-point receive waited past its deadline for a message that never came.
    #[error(
        "[rank {rank}] recv from rank {peer} (tag {tag}) got nothing within {waited:?}: rank {peer} \
         is alive but never sent it. Every recv needs a matching send with the same tag (check \
         that both ranks run the same schedule); raise BURN_DDP_COLLECTIVE_TIMEOUT if the sender \
         is only slow"
    )]
    P2pTimeout {
        /// This rank.
        rank: Rank,
        /// The rank that should have sent.
        peer: Rank,
        /// The tag waited for.
        tag: u32,
        /// How long this rank waited.
        waited: std::time::Duration,
    },

    /// A point-to-point message did not fit the receiver's buffer.
    #[error(
        "[rank {rank}] recv from rank {peer} (tag {tag}): the message is {theirs}, the receive \
         buffer {ours}. The sender and the receiver disagree on the tensor's shape or element \
         type"
    )]
    P2pMismatch {
        /// This rank.
        rank: Rank,
        /// The sender.
        peer: Rank,
        /// The message's tag.
        tag: u32,
        /// The receive buffer (bytes and element type).
        ours: String,
        /// The message (bytes and element type).
        theirs: String,
    },

    /// A failure in a sub-group (`ProcessGroup::new_group`, `ProcessGroup::split`): the group,
    /// this rank's place in it, and the failure (whose ranks are the job's global ranks).
    #[error("[group {group}, group rank {group_rank}] {inner}")]
    InGroup {
        /// The group: its name and its members' global ranks.
        group: String,
        /// This rank's rank in the group.
        group_rank: Rank,
        /// The failure, naming global ranks.
        inner: Box<DdpError>,
    },

    /// An earlier failure left the group unusable.
    #[error("[rank {rank}] the process group is unusable after an earlier failure: {first}")]
    GroupAborted {
        /// This rank.
        rank: Rank,
        /// The first failure.
        first: Box<AbortRecord>,
    },

    /// Something was used before it was set up.
    #[error("{what} is not set up: {fix}")]
    NotInitialized {
        /// What was used.
        what: &'static str,
        /// What sets it up.
        fix: &'static str,
    },

    /// A thread that this rank's collectives depend on (the gradient communication thread, the
    /// NCCL launcher) is gone: an earlier error ended it, or it panicked.
    #[error("[rank {rank}] {what} has stopped, so this step cannot finish: an earlier error ended it (the first error this rank reported says which) or it panicked. The group cannot continue: let the job end, and restart it (burn-ddp run --max-restarts)")]
    WorkerStopped {
        /// This rank.
        rank: Rank,
        /// The thread (`the gradient communication thread`).
        what: &'static str,
    },

    /// `BURN_DDP_DEBUG_DESYNC`: the ranks were about to call different collectives.
    #[error("[rank {rank}] collectives out of step at call {call} (BURN_DDP_DEBUG_DESYNC): this rank calls {ours}; rank {peer} calls {theirs}. Every rank must call the same collectives in the same order")]
    Desync {
        /// This rank.
        rank: Rank,
        /// The checked call on this rank (`#1` = the first collective).
        call: CollectiveSeq,
        /// What this rank calls, and from where.
        ours: String,
        /// The rank compared with.
        peer: Rank,
        /// What it calls, and from where.
        theirs: String,
    },

    /// The heartbeat watcher found a rank dead, frozen or stuck while this rank waited in a
    /// collective (long before the collective timeout).
    #[error("[rank {rank}] {op} {seq}: rank {culprit} (host {host}) {what}; its last completed collective was {last_completed}")]
    RankUnresponsive {
        /// This rank.
        rank: Rank,
        /// The rank at fault.
        culprit: Rank,
        /// Its host, as it reported it.
        host: String,
        /// The last collective it completed.
        last_completed: CollectiveSeq,
        /// The collective this rank waited in.
        op: CollectiveOp,
        /// Its sequence number.
        seq: CollectiveSeq,
        /// What was seen.
        what: String,
    },
}

impl CollectiveError {
    /// The rank that reported this error, when it names one.
    pub fn rank(&self) -> Option<Rank> {
        match self {
            Self::PeerLost { rank, .. }
            | Self::PeerFinished { rank, .. }
            | Self::JobAborted { rank, .. }
            | Self::CollectiveTimeout { rank, .. }
            | Self::CollectiveMismatch { rank, .. }
            | Self::BufferSize { rank, .. }
            | Self::InvalidRoot { rank, .. }
            | Self::InvalidGroupCall { rank, .. }
            | Self::P2pTimeout { rank, .. }
            | Self::P2pMismatch { rank, .. }
            | Self::GroupAborted { rank, .. }
            | Self::WorkerStopped { rank, .. }
            | Self::Desync { rank, .. }
            | Self::RankUnresponsive { rank, .. } => Some(*rank),
            Self::InGroup { inner, .. } => inner.rank(),
            _ => None,
        }
    }

    /// Whether the group failed around this rank
    /// ([`DdpError::is_peer_failure`](crate::DdpError::is_peer_failure)).
    pub fn is_peer_failure(&self) -> bool {
        match self {
            Self::PeerLost { .. }
            | Self::JobAborted { .. }
            | Self::CollectiveTimeout { .. }
            | Self::P2pTimeout { .. }
            | Self::GroupAborted { .. }
            | Self::WorkerStopped { .. }
            | Self::RankUnresponsive { .. } => true,
            Self::InGroup { inner, .. } => inner.is_peer_failure(),
            _ => false,
        }
    }

    /// The rank this error blames ([`DdpError::culprit`](crate::DdpError::culprit)).
    pub fn culprit(&self) -> Option<Rank> {
        match self {
            Self::PeerLost { peer, .. } | Self::P2pTimeout { peer, .. } => Some(*peer),
            Self::RankUnresponsive { culprit, .. } => Some(*culprit),
            Self::JobAborted { record, .. } => record.culprit,
            Self::CollectiveTimeout { diagnosis, .. } => Some(diagnosis.culprit()),
            Self::InGroup { inner, .. } => inner.culprit(),
            _ => None,
        }
    }
}
