//! Checkpoints of the Learner (model, optimizer, LR scheduler) for [`DdpStrategy`](super::DdpStrategy):
//! Burn 0.21's records as bytes, moved by burn-ddp-comm's [`RecordFiles`] (written by rank 0
//! alone, atomically; restored on every rank from rank 0's files).

use burn::record::{BinBytesRecorder, FullPrecisionSettings, Record, Recorder};
use burn::tensor::backend::Backend;
use burn::train::checkpoint::{Checkpointer, CheckpointerError};
use burn_ddp_comm::train::files::RecordFiles;

pub use burn_ddp_comm::train::files::newest_complete;

/// One of the three records, for burn-train's `AsyncCheckpointer`.
pub(crate) struct RankCheckpointer(pub(crate) RecordFiles);

fn failed(e: impl std::fmt::Display) -> CheckpointerError {
    CheckpointerError::Unknown(e.to_string())
}

impl<R: Record<B>, B: Backend> Checkpointer<R, B> for RankCheckpointer {
    fn save(&self, epoch: usize, record: R) -> Result<(), CheckpointerError> {
        self.0
            .save(epoch, || {
                BinBytesRecorder::<FullPrecisionSettings>::default().record(record, ())
            })
            .map_err(failed)
    }

    fn delete(&self, epoch: usize) -> Result<(), CheckpointerError> {
        self.0.delete(epoch).map_err(CheckpointerError::IOError)
    }

    /// Collective: every rank restores the same epoch; rank 0 reads the file and sends it.
    fn restore(&self, epoch: usize, device: &B::Device) -> Result<R, CheckpointerError> {
        restore(&self.0, epoch, device).map_err(failed)
    }
}

/// Collective: the record of `epoch` on every rank, from rank 0's file.
pub(crate) fn restore<R: Record<B>, B: Backend>(
    files: &RecordFiles,
    epoch: usize,
    device: &B::Device,
) -> crate::Result<R> {
    let bytes = files.restore(epoch)?;
    BinBytesRecorder::<FullPrecisionSettings>::default()
        .load(bytes, device)
        .map_err(|e| crate::DdpError::Checkpoint {
            path: files.path(epoch).display().to_string(),
            what: "restoring",
            reason: e.to_string(),
        })
}
