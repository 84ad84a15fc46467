//! Checkpoints of the Learner (model, optimizer, LR scheduler) for [`DdpStrategy`](super::DdpStrategy):
//! written by rank 0 alone, atomically; restored on every rank from rank 0's files, which rank 0
//! reads and broadcasts (so nodes need no shared file system).

use std::fs;
use std::path::{Path, PathBuf};

use burn::record::{BinBytesRecorder, FullPrecisionSettings, Record, Recorder};
use burn::tensor::backend::Backend;
use burn::train::checkpoint::{Checkpointer, CheckpointerError};

use crate::checkpoint::write_atomic;
use crate::group::ProcessGroup;
use crate::Rank;

/// The three records of one epoch's checkpoint, in the order burn-train saves them.
pub(crate) const PARTS: [&str; 3] = ["model", "optim", "scheduler"];

pub(crate) fn path(dir: &Path, name: &str, epoch: usize) -> PathBuf {
    dir.join(format!("{name}-{epoch}.bin"))
}

/// The newest epoch whose three records are all present. Each file is renamed into place only
/// once complete, so a present file is a complete one; an epoch whose writer died between two
/// records is skipped.
pub fn newest_complete(dir: &Path) -> Option<usize> {
    let entries = fs::read_dir(dir).ok()?;
    entries
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            name.strip_prefix("model-")?
                .strip_suffix(".bin")?
                .parse::<usize>()
                .ok()
        })
        .filter(|epoch| PARTS.iter().all(|p| path(dir, p, *epoch).is_file()))
        .max()
}

/// One of the three records, for burn-train's `AsyncCheckpointer`.
pub(crate) struct RankCheckpointer {
    pub(crate) dir: PathBuf,
    pub(crate) name: &'static str,
    pub(crate) pg: ProcessGroup,
}

fn failed(e: impl std::fmt::Display) -> CheckpointerError {
    CheckpointerError::Unknown(e.to_string())
}

impl<R: Record<B>, B: Backend> Checkpointer<R, B> for RankCheckpointer {
    fn save(&self, epoch: usize, record: R) -> Result<(), CheckpointerError> {
        if self.pg.rank() != Rank(0) {
            return Ok(());
        }
        let bytes = BinBytesRecorder::<FullPrecisionSettings>::default()
            .record(record, ())
            .map_err(CheckpointerError::RecorderError)?;
        write_atomic(&path(&self.dir, self.name, epoch), &bytes).map_err(failed)
    }

    fn delete(&self, epoch: usize) -> Result<(), CheckpointerError> {
        if self.pg.rank() != Rank(0) {
            return Ok(());
        }
        match fs::remove_file(path(&self.dir, self.name, epoch)) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(CheckpointerError::IOError(e)),
        }
    }

    /// Collective: every rank restores the same epoch; rank 0 reads the file and sends it.
    fn restore(&self, epoch: usize, device: &B::Device) -> Result<R, CheckpointerError> {
        let file = path(&self.dir, self.name, epoch);
        // First byte: 1 = the record follows, 0 = rank 0's error message follows.
        let mine = if self.pg.rank() == Rank(0) {
            match fs::read(&file) {
                Ok(mut b) => {
                    b.insert(0, 1);
                    b
                }
                Err(e) => {
                    let mut m = vec![0];
                    m.extend_from_slice(
                        format!("rank 0 cannot read {}: {e}", file.display()).as_bytes(),
                    );
                    m
                }
            }
        } else {
            Vec::new()
        };
        let mut bytes = self.pg.broadcast_bytes(mine, Rank(0)).map_err(failed)?;
        match bytes.first() {
            Some(1) => {
                bytes.remove(0);
                BinBytesRecorder::<FullPrecisionSettings>::default()
                    .load(bytes, device)
                    .map_err(CheckpointerError::RecorderError)
            }
            _ => Err(CheckpointerError::Unknown(
                String::from_utf8_lossy(bytes.get(1..).unwrap_or_default()).into_owned(),
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn newest_complete_skips_epochs_missing_a_record() {
        let dir = std::env::temp_dir().join(format!("burn-ddp-newest-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        assert_eq!(newest_complete(&dir), None);
        for epoch in [1, 2] {
            for p in PARTS {
                fs::write(path(&dir, p, epoch), b"x").unwrap();
            }
        }
        // Epoch 3: the writer died after the model and the optimizer.
        fs::write(path(&dir, "model", 3), b"x").unwrap();
        fs::write(path(&dir, "optim", 3), b"x").unwrap();
        // A killed writer's temporary is not a checkpoint.
        fs::write(dir.join(".model-4.bin.tmp-77"), b"x").unwrap();
        assert_eq!(newest_complete(&dir), Some(2));
        fs::remove_dir_all(&dir).unwrap();
    }
}
