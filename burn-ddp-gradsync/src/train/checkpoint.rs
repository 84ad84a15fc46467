//! Checkpoints of the Learner (model, optimizer, LR scheduler) for
//! [`DdpStrategy`](super::DdpStrategy): Burn's records as bytes, moved by burn-ddp-comm's
//! [`RecordFiles`] (written by rank 0 alone, atomically; restored on every rank from rank 0's
//! files).

use burn::tensor::Bytes;
use burn::train::checkpoint::{Checkpoint, Checkpointer, CheckpointerError};
use burn_ddp_comm::train::files::{self, RecordFiles};

/// One of the three records, for burn-train's `AsyncCheckpointer`.
pub(crate) struct RankCheckpointer(pub(crate) RecordFiles);

fn failed(e: impl std::fmt::Display) -> CheckpointerError {
    CheckpointerError::Unknown(e.to_string())
}

impl<R: Checkpoint> Checkpointer<R> for RankCheckpointer {
    fn save(&self, epoch: usize, record: R) -> Result<(), CheckpointerError> {
        let saved = (self.0).save(epoch, || record.checkpoint_into_bytes().map(|b| b.to_vec()));
        files::unless_superseded(saved).map_err(failed)
    }

    fn delete(&self, epoch: usize) -> Result<(), CheckpointerError> {
        self.0.delete(epoch).map_err(CheckpointerError::IOError)
    }

    /// Collective: every rank restores the same epoch; rank 0 reads the file and sends it.
    fn restore(&self, epoch: usize) -> Result<R, CheckpointerError> {
        restore(&self.0, epoch).map_err(failed)
    }
}

/// Collective: the record of `epoch` on every rank, from rank 0's file.
pub(crate) fn restore<R: Checkpoint>(files: &RecordFiles, epoch: usize) -> crate::Result<R> {
    files.restore_with(epoch, |bytes| {
        R::checkpoint_from_bytes(Bytes::from_bytes_vec(bytes))
    })
}
