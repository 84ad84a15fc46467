//! [`CudaError`]: cUDA and NCCL: the libraries, the driver, the rank's GPU, NCCL's calls.

use std::time::Duration;

use crate::types::{LocalRank, Rank};

/// CUDA and NCCL: the libraries, the driver, the rank's GPU, NCCL's calls. Nested in
/// [`DdpError::Cuda`](crate::DdpError::Cuda); messages start with the rank that saw the problem.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CudaError {
    /// The NCCL library could not be loaded (the `cuda` feature loads it at run time).
    #[error("NCCL is not available: {detail}")]
    NcclUnavailable {
        /// What was tried, and what to install or link.
        detail: String,
    },

    /// The CUDA driver failed or is missing.
    #[error("[rank {rank}] CUDA: {what} failed: {detail}")]
    Driver {
        /// This rank.
        rank: Rank,
        /// The call that failed.
        what: String,
        /// The driver's error, and what to check.
        detail: String,
    },

    /// This process's local rank has no GPU.
    #[error("[rank {rank}] no GPU for local rank {local_rank}: this node shows {count} CUDA device(s){visible}. Start at most {count} rank(s) per node (`--nproc-per-node {count}`), or give each rank its own GPU through CUDA_VISIBLE_DEVICES")]
    NoGpuForRank {
        /// This rank.
        rank: Rank,
        /// Its local rank (the GPU it would use).
        local_rank: LocalRank,
        /// Devices visible to this process.
        count: usize,
        /// `" (CUDA_VISIBLE_DEVICES=...)"` when set.
        visible: String,
    },

    /// The GPU that holds this rank's tensors is not the GPU its `LOCAL_RANK` names, or gradients
    /// arrived on another GPU than the one NCCL was set up on.
    #[error("[rank {rank}] {what} are on GPU {found}, but {expected_why}: NCCL would read memory of another device. Build the model on this rank's GPU (`burn_ddp::cuda::rank_device(&group)` gives it), or give each process one GPU through CUDA_VISIBLE_DEVICES")]
    DeviceMismatch {
        /// This rank.
        rank: Rank,
        /// What was found where (`the model's parameters`, `the gradients of this backward`).
        what: &'static str,
        /// The GPU (ordinal among the visible devices) it is on.
        found: usize,
        /// Which GPU was expected, and why (`LOCAL_RANK 1 means GPU 1 of the 2 this process sees`).
        expected_why: String,
    },

    /// An NCCL call failed.
    #[error("[rank {rank}] NCCL {call} failed: {code}{detail}. {hint}")]
    Nccl {
        /// This rank.
        rank: Rank,
        /// The NCCL call and what it was doing (`ncclAllReduce (all_reduce #12, 4096 x float)`).
        call: String,
        /// The `ncclResult_t` NCCL returned: its name and NCCL's text for it.
        code: String,
        /// `ncclGetLastError`'s message, when NCCL gave one (starts with ": ").
        detail: String,
        /// What usually causes it and what to do.
        hint: &'static str,
    },

    /// The loaded NCCL cannot run a collective as asked (an operation or element type it does
    /// not support).
    #[error("[rank {rank}] NCCL cannot run {what}: {reason}")]
    NcclUnsupported {
        /// This rank.
        rank: Rank,
        /// The collective (`all_reduce #3 (mean of bfloat16)`).
        what: String,
        /// Why, and what would work.
        reason: String,
    },

    /// Rank 0's NCCL unique id arrived with the wrong size.
    #[error("[rank {rank}] rank 0's NCCL unique id has {len} bytes, not 128: every rank must run the same burn-ddp version")]
    NcclIdMalformed {
        /// This rank.
        rank: Rank,
        /// The size that arrived.
        len: usize,
    },

    /// An NCCL operation did not complete in time; the communicator was aborted.
    #[error("[rank {rank}] NCCL {what} did not complete within {waited:?}; the communicator was aborted (ncclCommAbort) so that nothing waits forever. A rank that died or stalls, or ranks that call different collectives, cause this: look at the other ranks' output, and run with BURN_DDP_DEBUG_DESYNC=1 to compare the calls. Raise BURN_DDP_COLLECTIVE_TIMEOUT if the work is only slow")]
    NcclTimeout {
        /// This rank.
        rank: Rank,
        /// The operation (`all_reduce #12`, `communicator creation`).
        what: String,
        /// The deadline.
        waited: Duration,
    },
}

impl CudaError {
    /// The rank that reported this error, when it names one.
    pub fn rank(&self) -> Option<Rank> {
        match self {
            Self::Driver { rank, .. }
            | Self::NoGpuForRank { rank, .. }
            | Self::DeviceMismatch { rank, .. }
            | Self::Nccl { rank, .. }
            | Self::NcclUnsupported { rank, .. }
            | Self::NcclIdMalformed { rank, .. }
            | Self::NcclTimeout { rank, .. } => Some(*rank),
            _ => None,
        }
    }

    /// Whether the group failed around this rank
    /// ([`DdpError::is_peer_failure`](crate::DdpError::is_peer_failure)).
    pub fn is_peer_failure(&self) -> bool {
        matches!(self, Self::Nccl { .. } | Self::NcclTimeout { .. })
    }
}
