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
/// The temporary is locked (`flock`) until it is renamed, and a writer removes, after its own
/// rename, only the temporaries of `path` it can lock: those of writers that died. In a
/// fault-tolerant job two processes may write the same checkpoint: a rank 0 frozen mid-write and
/// left out, and the new membership's rank 0, which writes it again. The frozen one's temporary
/// stays until it resumes and renames it (the same epoch's record, so the same bytes).
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
        let mut f = locked_temporary(&tmp).map_err(|e| io("creating the temporary file", e))?;
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

/// Creates the temporary file `tmp` and locks it for this writer. Another writer's
/// [`remove_stale_temporaries`] may hold its lock or remove it between its creation and the
/// lock (it was not locked yet): then it is created again, for at most about 50 ms (never a
/// blocking lock: the other writer may be frozen while it holds it).
fn locked_temporary(tmp: &Path) -> std::io::Result<File> {
    use std::os::unix::fs::MetadataExt;
    for _ in 0..50 {
        let f = File::create(tmp)?;
        if f.try_lock().is_ok() {
            let (ours, there) = (f.metadata()?, fs::metadata(tmp));
            if there.is_ok_and(|m| (m.dev(), m.ino()) == (ours.dev(), ours.ino())) {
                return Ok(f);
            }
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    Err(std::io::Error::other(
        "another writer of this checkpoint kept it locked or removed it as it was created",
    ))
}

/// Removes the temporaries of `name` whose writer died mid-write: those whose lock this
/// process can take. A live writer's, frozen or not, holds its lock and stays.
fn remove_stale_temporaries(dir: &Path, name: &str) {
    let prefix = format!(".{name}.tmp-");
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        if !entry.file_name().to_string_lossy().starts_with(&prefix) {
            continue;
        }
        // Removed while the lock is held, so its writer cannot have taken it in between.
        let Ok(f) = File::open(entry.path()) else {
            continue;
        };
        if f.try_lock().is_ok() {
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

    /// A writer frozen mid-write (here: a temporary whose lock another open file holds, as
    /// the frozen process would) keeps its temporary through another writer's write, and its
    /// rename then succeeds.
    #[test]
    fn a_live_writers_temporary_survives_another_writers_cleanup() {
        let dir = std::env::temp_dir().join(format!("burn-ddp-ckpt-live-{}", std::process::id()));
        let path = dir.join("model-1.bin");
        fs::create_dir_all(&dir).unwrap();
        let frozen = dir.join(".model-1.bin.tmp-999998");
        let held = locked_temporary(&frozen).unwrap();
        fs::write(&frozen, b"same").unwrap();
        write_atomic(&path, b"same").unwrap();
        assert!(frozen.exists(), "a live writer's temporary was removed");
        fs::rename(&frozen, &path).unwrap();
        drop(held);
        assert_eq!(fs::read(&path).unwrap(), b"same");
        write_atomic(&path, b"next").unwrap();
        let names: Vec<_> = fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from("model-1.bin")]);
        fs::remove_dir_all(&dir).unwrap();
    }

    /// A temporary whose lock another holder keeps (a cleaner frozen while it holds it) fails
    /// the write with an error, at once, not a wait without end.
    #[test]
    fn a_temporary_locked_by_another_fails_the_write_instead_of_waiting() {
        let dir = std::env::temp_dir().join(format!("burn-ddp-ckpt-held-{}", std::process::id()));
        let path = dir.join("model-2.bin");
        fs::create_dir_all(&dir).unwrap();
        let tmp = dir.join(format!(".model-2.bin.tmp-{}", std::process::id()));
        let holder = File::create(&tmp).unwrap();
        holder.lock().unwrap();
        let started = std::time::Instant::now();
        let err = write_atomic(&path, b"x").unwrap_err().to_string();
        assert!(err.contains("creating the temporary file"), "{err}");
        assert!(started.elapsed() < std::time::Duration::from_secs(5));
        assert!(!path.exists());
        drop(holder);
        write_atomic(&path, b"x").unwrap();
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
