//! [`ModelError`]: the model and its gradients: replicas that differ, gradients of the wrong size,
//! a step that did not finish.

use std::time::Duration;

use crate::types::Rank;

/// The model and its gradients: replicas that differ, gradients of the wrong size, a step that did
/// not finish. Nested in [`DdpError::Model`](crate::DdpError::Model); messages start with the rank
/// that saw the problem.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ModelError {
    /// The ranks' models differ: a parameter's name, shape or dtype is not the same everywhere.
    #[error("[rank {rank}] the model differs between ranks at parameter {index} `{param}`: {detail}. Every rank must build the same model (same layer sizes, same order of fields)")]
    ModelMismatch {
        /// This rank.
        rank: Rank,
        /// Position of the first mismatching parameter in visit order.
        index: usize,
        /// Its name on rank 0.
        param: String,
        /// What differs, and on which ranks.
        detail: String,
    },

    /// The ranks' parameters are no longer the same: some rank updated its replica
    /// differently (see [`DdpConfig::check_replicas_every`](crate::DdpConfig)).
    #[error("[rank {rank}] the replicas differ at synchronised step {step}: parameter {index} `{param}` {detail}. Every rank must apply the same averaged gradients: look for a parameter changed on some ranks only (a rank-local update, a gradient left out of the optimizer step), or non-deterministic operations on weights")]
    ReplicasDiverged {
        /// This rank.
        rank: Rank,
        /// The synchronised step the check ran at (1 = the first).
        step: u64,
        /// Position of the first differing parameter in visit order.
        index: usize,
        /// Its name.
        param: String,
        /// Which ranks hold which digest.
        detail: String,
    },

    /// The gradient communication thread did not answer in time.
    #[error("[rank {rank}] gradient synchronisation got no answer within {waited:?} (the communication thread is stuck)")]
    GradSyncTimeout {
        /// This rank.
        rank: Rank,
        /// How long it waited.
        waited: Duration,
    },

    /// A gradient's size is not its parameter's (a custom op or backend produced a gradient of
    /// the wrong shape).
    #[error("[rank {rank}] the gradient of `{param}` has {got} elements, but the parameter has {expected}: the operation that produced it returned a gradient of the wrong shape")]
    GradientSize {
        /// This rank.
        rank: Rank,
        /// The parameter's name.
        param: String,
        /// The parameter's element count.
        expected: usize,
        /// The gradient's element count.
        got: usize,
    },

    /// A model's parameters could not be read, written or (de)serialised.
    #[error("[rank {rank}] {what}: {reason}")]
    Access {
        /// This rank.
        rank: Rank,
        /// What was being done.
        what: &'static str,
        /// Why it failed.
        reason: String,
    },
}

impl ModelError {
    /// The rank that reported this error, when it names one.
    pub fn rank(&self) -> Option<Rank> {
        match self {
            Self::ModelMismatch { rank, .. }
            | Self::ReplicasDiverged { rank, .. }
            | Self::GradSyncTimeout { rank, .. }
            | Self::GradientSize { rank, .. }
            | Self::Access { rank, .. } => Some(*rank),
        }
    }

    /// Whether the group failed around this rank
    /// ([`DdpError::is_peer_failure`](crate::DdpError::is_peer_failure)).
    pub fn is_peer_failure(&self) -> bool {
        matches!(self, Self::GradSyncTimeout { .. })
    }
}
