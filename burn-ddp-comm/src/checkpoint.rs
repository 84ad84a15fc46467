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
/// stays until it resumes; it then renames it only if its fence lets it
/// ([`write_atomic_fenced`]), and never once the file was removed ([`remove_fenced`]).
///
/// # Errors
/// The I/O error, with the path.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    write_atomic_fenced(path, bytes, || Ok(()))
}

/// [`write_atomic`], with `fence` asked once the temporary is on disk, just before the rename:
/// an error of `fence` removes the temporary and is returned, and the file is not touched. In a
/// fault-tolerant job the fence asks the store whether the writer's membership still stands
/// ([`ProcessGroup::membership_stands`](crate::ProcessGroup::membership_stands)), so that a
/// rank 0 left out while it wrote does not put its file in place.
///
/// A check cannot fence a rename that follows it (a writer frozen between the two renames once
/// continued): what closes that window is [`remove_fenced`], which the deleter of a file uses. It
/// removes every temporary of the file before the file itself, so a writer that passed its fence
/// and renames later finds no temporary to rename, and one that renamed first had its file
/// removed after it: in no order of the two does a removed file come back.
///
/// # Errors
/// `fence`'s error; the I/O error, with the path (a temporary removed by [`remove_fenced`] while
/// this writer waited is "renaming into place", not found).
pub fn write_atomic_fenced(
    path: &Path,
    bytes: &[u8],
    fence: impl FnOnce() -> Result<()>,
) -> Result<()> {
    let io = |what: &'static str, source: std::io::Error| {
        DdpError::Job(JobError::CheckpointIo {
            path: path.to_path_buf(),
            what,
            source,
        })
    };
    let dir = parent(path);
    fs::create_dir_all(dir).map_err(|e| io("creating its directory", e))?;
    let name = file_name(path);
    let tmp = dir.join(format!(".{name}.tmp-{}", std::process::id()));
    let result = (|| {
        let mut f = locked_temporary(&tmp).map_err(|e| io("creating the temporary file", e))?;
        f.write_all(bytes).map_err(|e| io("writing", e))?;
        f.sync_all().map_err(|e| io("flushing to disk", e))?;
        fence()?;
        fs::rename(&tmp, path).map_err(|e| io("renaming into place", e))?;
        // The rename is durable once the directory entry is.
        if let Ok(d) = File::open(dir) {
            let _ = d.sync_all();
        }
        remove_temporaries(dir, &name, Temporaries::OfDeadWriters);
        Ok(())
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result
}

/// Removes `path` (absent is fine) so that no writer of it brings it back: every temporary of
/// `path` first, its writers' live or not, then the file (see [`write_atomic_fenced`]). For a
/// file no writer may write again: an older epoch's checkpoint, which only a superseded rank 0
/// still writing it would.
///
/// # Errors
/// The file exists and cannot be removed.
pub fn remove_fenced(path: &Path) -> std::io::Result<()> {
    remove_temporaries(parent(path), &file_name(path), Temporaries::All);
    match fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

fn parent(path: &Path) -> &Path {
    match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    }
}

fn file_name(path: &Path) -> String {
    path.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// Creates the temporary file `tmp` and locks it for this writer. Another writer's
/// [`remove_temporaries`] may hold its lock or remove it between its creation and the
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

/// Which temporaries of a file [`remove_temporaries`] removes.
#[derive(Clone, Copy, PartialEq)]
enum Temporaries {
    /// Those whose lock this process can take: their writer died mid-write. A live writer's,
    /// frozen or not, holds its lock and stays.
    OfDeadWriters,
    /// Every one: the file is removed, and no writer may put it back.
    All,
}

/// Removes the temporaries of `name` in `dir` that `which` says.
fn remove_temporaries(dir: &Path, name: &str, which: Temporaries) {
    let prefix = format!(".{name}.tmp-");
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        if !entry.file_name().to_string_lossy().starts_with(&prefix) {
            continue;
        }
        if which == Temporaries::All {
            let _ = fs::remove_file(entry.path());
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

    /// A fence that refuses (a writer whose membership ended) leaves the file as it was and no
    /// temporary behind.
    #[test]
    fn a_refused_fence_renames_nothing() {
        let dir = std::env::temp_dir().join(format!("burn-ddp-ckpt-fence-{}", std::process::id()));
        let path = dir.join("model-3.bin");
        let refused = || {
            Err(DdpError::Membership(crate::MembershipError::Superseded {
                member: 0,
                epoch: 1,
                what: "model-3.bin".into(),
                why: "rank 0 sent no heartbeat".into(),
            }))
        };
        let err = write_atomic_fenced(&path, b"late", refused).unwrap_err();
        assert!(
            err.to_string().contains("membership epoch 1 has ended"),
            "{err}"
        );
        assert_eq!(fs::read_dir(&dir).unwrap().count(), 0);
        fs::remove_dir_all(&dir).unwrap();
    }

    /// A writer that passed its fence and froze before its rename (here: held inside the fence
    /// until the file was removed) cannot bring the removed file back: its temporary went with
    /// it. A removal that kept live writers' temporaries, as a write's cleanup does, fails this.
    #[test]
    fn a_writer_frozen_after_its_fence_cannot_bring_back_a_removed_file() {
        let dir = std::env::temp_dir().join(format!("burn-ddp-ckpt-back-{}", std::process::id()));
        let path = dir.join("model-1.bin");
        write_atomic(&path, b"epoch 1").unwrap();
        let (passed, fenced) = std::sync::mpsc::channel();
        let (thaw, frozen) = std::sync::mpsc::channel::<()>();
        std::thread::scope(|s| {
            let writer = s.spawn(|| {
                write_atomic_fenced(&path, b"epoch 1", move || {
                    passed.send(()).unwrap();
                    frozen.recv().unwrap();
                    Ok(())
                })
            });
            fenced.recv().unwrap();
            remove_fenced(&path).unwrap();
            thaw.send(()).unwrap();
            let err = writer.join().unwrap().unwrap_err().to_string();
            assert!(err.contains("renaming into place"), "{err}");
        });
        assert_eq!(fs::read_dir(&dir).unwrap().count(), 0, "the file came back");
        remove_fenced(&path).unwrap();
        fs::remove_dir_all(&dir).unwrap();
    }
}
