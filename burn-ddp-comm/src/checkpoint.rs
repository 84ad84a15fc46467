//! Writing checkpoint files so that a crash never leaves a truncated file behind.

use crate::error::JobError;
use std::fs::{self, File};
use std::io::Write;
use std::path::Path;

use crate::{DdpError, Result};

/// Writes `bytes` to `path` atomically: into a temporary file in the same directory, flushed to
/// disk, then renamed over `path` (and the directory synced). A reader sees the old file or the
/// new one, never a mix; a crash mid-write leaves the old file intact.
///
/// # Errors
/// The I/O error, with the path.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let io = |what: &'static str, source: std::io::Error| {
        DdpError::Job(JobError::CheckpointIo {
            path: path.to_path_buf(),
            what,
            source,
        })
    };
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    fs::create_dir_all(dir).map_err(|e| io("creating its directory", e))?;
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = dir.join(format!(".{name}.tmp-{}", std::process::id()));
    let result = (|| {
        let mut f = File::create(&tmp).map_err(|e| io("creating the temporary file", e))?;
        f.write_all(bytes).map_err(|e| io("writing", e))?;
        f.sync_all().map_err(|e| io("flushing to disk", e))?;
        fs::rename(&tmp, path).map_err(|e| io("renaming into place", e))?;
        // The rename is durable once the directory entry is.
        if let Ok(d) = File::open(dir) {
            let _ = d.sync_all();
        }
        remove_stale_temporaries(dir, &name);
        Ok(())
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result
}

/// Removes temporaries of `name` left by writers that were killed mid-write (one process
/// writes a given checkpoint, so after its own rename no other temporary of it is live).
fn remove_stale_temporaries(dir: &Path, name: &str) {
    let prefix = format!(".{name}.tmp-");
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        if entry.file_name().to_string_lossy().starts_with(&prefix) {
            let _ = fs::remove_file(entry.path());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn atomic_write_replaces_and_leaves_no_temporary() {
        let dir = std::env::temp_dir().join(format!("burn-ddp-ckpt-{}", std::process::id()));
        let path = dir.join("latest.bin");
        write_atomic(&path, b"first").unwrap();
        write_atomic(&path, b"second").unwrap();
        assert_eq!(fs::read(&path).unwrap(), b"second");
        let names: Vec<_> = fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from("latest.bin")]);
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_killed_writers_temporary_is_removed_by_the_next_write() {
        let dir = std::env::temp_dir().join(format!("burn-ddp-ckpt-stale-{}", std::process::id()));
        let path = dir.join("latest.bin");
        fs::create_dir_all(&dir).unwrap();
        fs::write(dir.join(".latest.bin.tmp-999999"), b"torn").unwrap();
        fs::write(dir.join(".other.bin.tmp-999999"), b"not ours").unwrap();
        write_atomic(&path, b"new").unwrap();
        let mut names: Vec<_> = fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        assert_eq!(names, [".other.bin.tmp-999999", "latest.bin"]);
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_failed_write_keeps_the_old_file() {
        let dir = std::env::temp_dir().join(format!("burn-ddp-ckpt-fail-{}", std::process::id()));
        let path = dir.join("latest.bin");
        write_atomic(&path, b"good").unwrap();
        // Renaming a file over a non-empty directory fails after the data was written.
        let blocker = dir.join("blocked");
        fs::create_dir_all(blocker.join("inner")).unwrap();
        let err = write_atomic(&blocker, b"new").unwrap_err().to_string();
        assert!(err.contains("renaming into place"), "{err}");
        assert_eq!(fs::read(&path).unwrap(), b"good");
        let tmp_left = fs::read_dir(&dir)
            .unwrap()
            .any(|e| e.unwrap().file_name().to_string_lossy().contains(".tmp-"));
        assert!(!tmp_left);
        fs::remove_dir_all(&dir).unwrap();
    }
}
