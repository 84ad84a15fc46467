//! Checkpoints of the Learner (model, optimizer, LR scheduler) for [`DdpStrategy`](super::DdpStrategy):
//! Burn 0.21's records as bytes, moved by burn-ddp-comm's [`RecordFiles`] (written by rank 0
//! alone, atomically; restored on every rank from rank 0's files).

use burn::record::{BinBytesRecorder, FullPrecisionSettings, Record, Recorder};
use burn::tensor::backend::Backend;
use burn::train::checkpoint::{Checkpointer, CheckpointerError};
use burn_ddp_comm::train::files::{self, RecordFiles};
use burn_ddp_comm::train::vote::FailureSlot;
use burn_ddp_comm::JobError;

/// One of the three records, for burn-train's `AsyncCheckpointer`. Burn's checkpointer thread
/// turns an error into a stop of the interrupter, which would end training as if asked to; so
/// the error is also kept in `failed`, where the epoch loops find it and fail the job.
pub(crate) struct RankCheckpointer {
    pub(crate) files: RecordFiles,
    pub(crate) failed: FailureSlot,
}

impl RankCheckpointer {
    fn keep<T>(&self, result: crate::Result<T>) -> Result<T, CheckpointerError> {
        result.map_err(|e| {
            let message = e.to_string();
            self.failed.fail(e);
            CheckpointerError::Unknown(message)
        })
    }
}

fn failed(e: impl std::fmt::Display) -> CheckpointerError {
    CheckpointerError::Unknown(e.to_string())
}

impl<R: Record<B>, B: Backend> Checkpointer<R, B> for RankCheckpointer {
    fn save(&self, epoch: usize, record: R) -> Result<(), CheckpointerError> {
        self.keep(files::unless_superseded(self.files.save(epoch, || {
            BinBytesRecorder::<FullPrecisionSettings>::default().record(record, ())
        })))
    }

    fn delete(&self, epoch: usize) -> Result<(), CheckpointerError> {
        let path = self.files.path(epoch);
        self.keep(self.files.delete(epoch).map_err(|e| {
            crate::DdpError::Job(JobError::CheckpointIo {
                path,
                what: "deleting an old checkpoint",
                source: e,
            })
        }))
    }

    /// Collective: every rank restores the same epoch; rank 0 reads the file and sends it.
    fn restore(&self, epoch: usize, device: &B::Device) -> Result<R, CheckpointerError> {
        restore(&self.files, epoch, device).map_err(failed)
    }
}

/// Collective: the record of `epoch` on every rank, from rank 0's file.
pub(crate) fn restore<R: Record<B>, B: Backend>(
    files: &RecordFiles,
    epoch: usize,
    device: &B::Device,
) -> crate::Result<R> {
    // Burn 0.21's recorder panics on bytes it cannot decode: `restore_with` catches it.
    files.restore_with(epoch, |bytes| {
        BinBytesRecorder::<FullPrecisionSettings>::default().load(bytes, device)
    })
}
