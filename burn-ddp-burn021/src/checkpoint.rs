//! Checkpoints of Burn modules, written so that a crash never leaves a truncated file behind
//! ([`write_atomic`] comes from burn-ddp-comm).

use burn_ddp_comm::JobError;
use std::fs;
use std::path::Path;

use burn::module::Module;
use burn::record::{BinBytesRecorder, FullPrecisionSettings, Recorder};
use burn::tensor::backend::Backend;

pub use burn_ddp_comm::checkpoint::write_atomic;

use crate::{DdpError, Result};

/// Saves `module`'s record (full precision, Burn's binary format) atomically at `path`.
///
/// # Errors
/// Serialising the record or writing the file failed.
pub fn save_module<B: Backend, M: Module<B>>(module: &M, path: &Path) -> Result<()> {
    let bytes = BinBytesRecorder::<FullPrecisionSettings>::default()
        .record(module.clone().into_record(), ())
        .map_err(|e| {
            DdpError::Job(JobError::Checkpoint {
                path: path.display().to_string(),
                what: "serialising the module",
                reason: e.to_string(),
            })
        })?;
    write_atomic(path, &bytes)
}

/// Loads a record written by [`save_module`] into `module`.
///
/// # Errors
/// The file is missing, unreadable or not a record of this module.
pub fn load_module<B: Backend, M: Module<B>>(
    module: M,
    path: &Path,
    device: &B::Device,
) -> Result<M> {
    let err = |what: &'static str, reason: String| {
        DdpError::Job(JobError::Checkpoint {
            path: path.display().to_string(),
            what,
            reason,
        })
    };
    let bytes = fs::read(path).map_err(|source| {
        DdpError::Job(JobError::CheckpointIo {
            path: path.to_path_buf(),
            what: "reading",
            source,
        })
    })?;
    let record = BinBytesRecorder::<FullPrecisionSettings>::default()
        .load(bytes, device)
        .map_err(|e| {
            err(
                "decoding (is it a checkpoint of this model?)",
                e.to_string(),
            )
        })?;
    Ok(module.load_record(record))
}
