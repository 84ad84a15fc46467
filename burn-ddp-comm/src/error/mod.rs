//! [`DdpError`]: every way burn-ddp can fail, each message saying what happened, the values seen
//! (and on which rank), and what to change. One error type per layer, each in its file, nested
//! in `DdpError`:
//!
//! - `config.rs`: [`ConfigError`], the process's configuration (environment, ranks, options)
//! - `rendezvous.rs`: [`RendezvousError`], finding the peers (the store, its address, the
//!   handshake)
//! - `collective.rs`: [`CollectiveError`], collectives and point-to-point calls on a group
//! - `cuda.rs`: [`CudaError`], CUDA and NCCL
//! - `model.rs`: [`ModelError`], the model and its gradients
//! - `job.rs`: [`JobError`], the launcher's processes, training, checkpoints
//! - `membership.rs`: [`MembershipError`], elastic and fault-tolerant jobs
//!
//! [`DdpError::rank`], [`DdpError::culprit`] and [`DdpError::is_peer_failure`] answer for any
//! layer.

use std::io;

use crate::types::{CollectiveOp, CollectiveSeq, Rank};

/// `Result` with [`DdpError`].
pub type Result<T, E = DdpError> = std::result::Result<T, E>;

mod collective;
mod config;
mod cuda;
mod job;
mod membership;
mod model;
mod rendezvous;

pub use collective::CollectiveError;
pub use config::ConfigError;
pub use cuda::CudaError;
pub use job::JobError;
pub use membership::MembershipError;
pub use model::ModelError;
pub use rendezvous::RendezvousError;

/// Every error burn-ddp reports: the layer's error, its message unchanged (messages start with
/// the rank that saw the problem). Match the layer, then the case:
///
/// ```
/// use burn_ddp_comm::{CollectiveError, DdpError};
///
/// fn lost_peer(e: &DdpError) -> Option<burn_ddp_comm::Rank> {
///     match e {
///         DdpError::Collective(CollectiveError::PeerLost { peer, .. }) => Some(*peer),
///         _ => e.culprit(),
///     }
/// }
/// ```
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DdpError {
    /// The process's configuration: environment variables, ranks, options.
    #[error(transparent)]
    Config(#[from] ConfigError),

    /// Finding the peers: the store on rank 0, its address, the handshake, the rendezvous.
    #[error(transparent)]
    Rendezvous(#[from] RendezvousError),

    /// A collective or point-to-point call on a group: a peer lost, finished or frozen, a deadline,
    /// a mismatch, a wrong call.
    #[error(transparent)]
    Collective(#[from] CollectiveError),

    /// CUDA and NCCL: the libraries, the driver, the rank's GPU, NCCL's calls.
    #[error(transparent)]
    Cuda(#[from] CudaError),

    /// The model and its gradients: replicas that differ, gradients of the wrong size, a step that
    /// did not finish.
    #[error(transparent)]
    Model(#[from] ModelError),

    /// The job: the launcher's processes, training stopped by a rank, checkpoints, an interruption.
    #[error(transparent)]
    Job(#[from] JobError),

    /// Elastic and fault-tolerant jobs: rounds, exclusions, joins, too few ranks.
    #[error(transparent)]
    Membership(#[from] MembershipError),

    /// An invariant of burn-ddp itself does not hold: a bug.
    #[error("[rank {rank}] internal error in burn-ddp: {what}. Please report it, with the output of every rank")]
    Internal {
        /// This rank.
        rank: Rank,
        /// What did not hold.
        what: &'static str,
    },

    /// An I/O error outside the cases above.
    #[error(transparent)]
    Io(#[from] io::Error),
}

impl DdpError {
    /// [`ModelError::Access`]: on `rank`, `what` failed because of `reason` (a Burn error, a
    /// message). The one constructor of the case, for every line.
    pub fn model_access(rank: Rank, what: &'static str, reason: impl std::fmt::Display) -> Self {
        ModelError::Access {
            rank,
            what,
            reason: reason.to_string(),
        }
        .into()
    }

    /// A gradient bucket that the device paths (both Burn lines) cannot hand to NCCL: a buffer
    /// that is not contiguous, of the wrong size or type, or without a device pointer.
    pub fn bucket_layout(rank: Rank, reason: String) -> Self {
        Self::model_access(rank, "handing a gradient bucket to NCCL", reason)
    }

    /// The rank that reported this error, when it names one.
    pub fn rank(&self) -> Option<Rank> {
        match self {
            DdpError::Config(e) => e.rank(),
            DdpError::Rendezvous(e) => e.rank(),
            DdpError::Collective(e) => e.rank(),
            DdpError::Cuda(e) => e.rank(),
            DdpError::Model(e) => e.rank(),
            DdpError::Job(e) => e.rank(),
            DdpError::Membership(e) => e.rank(),
            DdpError::Internal { rank, .. } => Some(*rank),
            DdpError::Io(_) => None,
        }
    }

    /// Whether this error says that the group failed around this rank (a rank died, froze,
    /// was cut off or stopped the group; a collective or the store did not answer in time)
    /// rather than that this rank's own call was wrong: what a fault-tolerant job recovers
    /// from by agreeing on a new membership
    /// ([`ProcessGroup::recover`](crate::ProcessGroup::recover)).
    /// Configuration errors, mismatched models or collectives, and bad arguments are not.
    pub fn is_peer_failure(&self) -> bool {
        match self {
            DdpError::Config(e) => e.is_peer_failure(),
            DdpError::Rendezvous(e) => e.is_peer_failure(),
            DdpError::Collective(e) => e.is_peer_failure(),
            DdpError::Cuda(e) => e.is_peer_failure(),
            DdpError::Model(e) => e.is_peer_failure(),
            DdpError::Job(e) => e.is_peer_failure(),
            DdpError::Membership(e) => e.is_peer_failure(),
            DdpError::Internal { .. } => false,
            DdpError::Io(_) => true,
        }
    }

    /// The rank this error blames, when it names one other than the reporter (a rank that
    /// died, froze or did not answer).
    pub fn culprit(&self) -> Option<Rank> {
        match self {
            DdpError::Rendezvous(e) => e.culprit(),
            DdpError::Collective(e) => e.culprit(),
            _ => None,
        }
    }
}

pub(crate) fn during_prefix(during: &Option<(CollectiveOp, CollectiveSeq)>) -> String {
    match during {
        Some((op, seq)) => format!("{op} {seq} stopped: "),
        None => String::new(),
    }
}
