//! [`JobError`]: the job: the launcher's processes, training stopped by a rank, checkpoints, an
//! interruption.

use std::io;

use crate::types::Rank;

/// The job: the launcher's processes, training stopped by a rank, checkpoints, an interruption.
/// Nested in [`DdpError::Job`](crate::DdpError::Job); messages start with the rank that saw the
/// problem.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum JobError {
    /// Training under burn-ddp's `DdpStrategy` stopped because a rank failed
    /// (a data error, a panic in a training step, a lost peer): every rank reports the rank at
    /// fault.
    #[error("[rank {rank}] training stopped: rank {culprit} failed: {reason}")]
    TrainingFailed {
        /// This rank.
        rank: Rank,
        /// The rank that failed.
        culprit: Rank,
        /// What went wrong there.
        reason: String,
    },

    /// A rank process could not be started.
    #[error("cannot start rank {rank} ({program}): {source}")]
    Spawn {
        /// The rank.
        rank: Rank,
        /// The program.
        program: String,
        /// The OS error.
        source: io::Error,
    },

    /// A rank process failed.
    #[error("rank {rank} (pid {pid}) {status}; the other ranks were stopped")]
    RankFailed {
        /// The rank.
        rank: Rank,
        /// Its process id.
        pid: u32,
        /// How it ended ("exited with status 3", "was killed by signal 9 (SIGKILL)").
        status: String,
    },

    /// Reading or writing a checkpoint file failed.
    #[error("checkpoint {}: {what} failed: {source}", path.display())]
    CheckpointIo {
        /// The file.
        path: std::path::PathBuf,
        /// The step that failed (`writing`, `renaming into place`).
        what: &'static str,
        /// The operating system's error.
        source: io::Error,
    },

    /// A checkpoint could not be made or used (serialising, or a file that is not a record of
    /// this model).
    #[error("checkpoint {path}: {what} failed: {reason}")]
    Checkpoint {
        /// The file.
        path: String,
        /// The step that failed.
        what: &'static str,
        /// Why.
        reason: String,
    },

    /// The function a rank ran under [`spawn`](crate::launch::spawn()) returned an error.
    #[error("rank {rank} failed: {source}")]
    RankError {
        /// The rank.
        rank: Rank,
        /// The function's error.
        source: Box<dyn std::error::Error + Send + Sync>,
    },

    /// The launcher was asked to stop (SIGINT/SIGTERM/SIGHUP) and stopped every rank.
    #[error("interrupted: every rank was stopped")]
    Interrupted,
}

impl JobError {
    /// The rank that reported this error, when it names one.
    pub fn rank(&self) -> Option<Rank> {
        match self {
            Self::TrainingFailed { rank, .. }
            | Self::Spawn { rank, .. }
            | Self::RankFailed { rank, .. }
            | Self::RankError { rank, .. } => Some(*rank),
            _ => None,
        }
    }

    /// Whether the group failed around this rank
    /// ([`DdpError::is_peer_failure`](crate::DdpError::is_peer_failure)).
    pub fn is_peer_failure(&self) -> bool {
        false
    }
}
