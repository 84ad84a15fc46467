//! Checkpoints of a Learner (model, optimizer, LR scheduler records) on several processes:
//! written by rank 0 alone, each file renamed into place once complete; restored on every
//! rank from rank 0's files, which rank 0 reads and broadcasts (so nodes need no shared file
//! system). Each Burn line turns its records into bytes and back; this module moves the bytes.

use crate::error::JobError;
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::checkpoint::{remove_fenced, write_atomic_fenced};
use crate::{DdpError, MembershipError, ProcessGroup, Rank, Result};

/// The three records of one epoch's checkpoint, in the order burn-train saves them.
pub const PARTS: [&str; 3] = ["model", "optim", "scheduler"];

/// The file of record `name` (`model`, `optim`, `scheduler`) of `epoch` in `dir`.
pub fn path(dir: &Path, name: &str, epoch: usize) -> PathBuf {
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

/// The first bytes of a checkpoint file written by burn-ddp: then the record's length (8 bytes,
/// little-endian), its SHA-256 (32 bytes), and the record as the Burn line made it.
const MAGIC: &[u8; 8] = b"BURNDDP\x01";
const HEADER: usize = MAGIC.len() + 8 + 32;

/// A record as written to its file: [`MAGIC`], its length and digest, the record.
fn seal(record: &[u8]) -> Vec<u8> {
    use sha2::Digest;
    let mut bytes = Vec::with_capacity(HEADER + record.len());
    bytes.extend_from_slice(MAGIC);
    bytes.extend_from_slice(&(record.len() as u64).to_le_bytes());
    bytes.extend_from_slice(&sha2::Sha256::digest(record));
    bytes.extend_from_slice(record);
    bytes
}

/// The record in the bytes of a checkpoint file, checked: what is wrong with them otherwise.
/// Files without the header (written before burn-ddp wrote one) are passed on as they are.
pub fn unseal(mut bytes: Vec<u8>) -> std::result::Result<Vec<u8>, String> {
    use sha2::Digest;
    if !bytes.starts_with(MAGIC) {
        return Ok(bytes);
    }
    if bytes.len() < HEADER {
        return Err(format!(
            "it is truncated: {} bytes, shorter than the {HEADER}-byte header",
            bytes.len()
        ));
    }
    let len = u64::from_le_bytes(bytes[8..16].try_into().unwrap_or_default());
    let held = (bytes.len() - HEADER) as u64;
    if len != held {
        return Err(format!(
            "it is truncated or was appended to: its header announces a record of {len} bytes, \
             the file holds {held}"
        ));
    }
    if sha2::Sha256::digest(&bytes[HEADER..])[..] != bytes[16..HEADER] {
        return Err("it is corrupt: the record does not match the digest written with it".into());
    }
    bytes.drain(..HEADER);
    Ok(bytes)
}

/// The error of a resume asked for without a checkpoint directory.
pub fn no_directory(epoch: usize, how: &str) -> DdpError {
    DdpError::Job(JobError::Checkpoint {
        path: format!("epoch {epoch}"),
        what: "resuming",
        reason: format!(
            "asks to resume from epoch {epoch}, but the strategy has no checkpoint \
             directory: call {how}"
        ),
    })
}

/// Which epochs' records rank 0 has written (the line's checkpointers write them on threads of
/// their own): in a fault-tolerant job rank 0 waits, at the end of an epoch, until the epoch's
/// three records are on disk before the ranks agree the epoch is over. If rank 0 dies while it
/// writes, the others are still at the end of that epoch, and their new rank 0 writes the
/// checkpoint again: no epoch's checkpoint is lost to a change of membership.
#[derive(Debug, Clone, Default)]
pub struct SavedLog(Arc<(Mutex<Saved>, Condvar)>);

#[derive(Debug, Default)]
struct Saved {
    /// Whether records are written through this log (a strategy with checkpoints).
    armed: bool,
    /// For each of [`PARTS`], the newest epoch written.
    newest: [Option<usize>; 3],
    /// A record that could not be written.
    failed: Option<String>,
    /// The epoch whose record this rank 0 did not write because its fence refused it (its
    /// membership had ended, and a newer membership's rank 0 writes it; or the store could not
    /// say), with the error: not a failure of the record, so it fails the wait for that epoch
    /// alone (the process may join again, and be rank 0 again).
    superseded: Option<(usize, String)>,
}

impl SavedLog {
    fn lock(&self) -> std::sync::MutexGuard<'_, Saved> {
        self.0 .0.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn record(&self, f: impl FnOnce(&mut Saved)) {
        f(&mut self.lock());
        self.0 .1.notify_all();
    }

    /// Waits until rank 0 has written every record of `epoch`, within `limit`. Returns at
    /// once when no records are written through this log (no checkpoints).
    ///
    /// # Errors
    /// A record could not be written (its message), or `limit` passed.
    pub fn wait(&self, epoch: usize, limit: Duration) -> std::result::Result<(), String> {
        let deadline = Instant::now() + limit;
        let mut saved = self.lock();
        loop {
            if !saved.armed || saved.newest.iter().all(|e| e.is_some_and(|e| e >= epoch)) {
                return Ok(());
            }
            if let Some(failed) = &saved.failed {
                return Err(failed.clone());
            }
            if let Some((_, why)) = saved.superseded.as_ref().filter(|(e, _)| *e == epoch) {
                return Err(why.clone());
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(format!(
                    "rank 0 did not finish writing the checkpoint of epoch {epoch} within \
                     {limit:?} (BURN_DDP_TIMEOUT)"
                ));
            }
            saved = self
                .0
                 .1
                .wait_timeout(saved, left.min(Duration::from_millis(100)))
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }
}

/// Rank 0 removes the records (`files`: one per part) of the epoch `keep` before `epoch` (none
/// below epoch 1), as burn-train's `KeepLastNCheckpoints` does, for checkpoints written without
/// burn-train's checkpointer (a sharded model's, gathered by every rank).
///
/// # Errors
/// A file that exists and cannot be removed.
pub fn delete_behind(files: &[RecordFiles], epoch: usize, keep: usize) -> Result<()> {
    let Some(old) = epoch.checked_sub(keep).filter(|e| *e > 0) else {
        return Ok(());
    };
    for f in files {
        f.delete(old).map_err(|source| {
            DdpError::Job(JobError::CheckpointIo {
                path: f.path(old),
                what: "removing an older epoch's file",
                source,
            })
        })?;
    }
    Ok(())
}

/// What a Burn line's checkpointer (run by burn-train's checkpointer thread, which stops or
/// fails the Learner on an error) is told of [`RecordFiles::save`]: a write fenced off because
/// rank 0's membership ended ([`MembershipError::Superseded`]) is no failure of the job's, and
/// stopping the Learner would keep this process from joining again, so it is `Ok` (the epoch
/// loop learns it from the [`SavedLog`], where the wait for that epoch fails with it); any other
/// result as it is.
///
/// # Errors
/// `result`'s, but [`MembershipError::Superseded`].
pub fn unless_superseded(result: Result<()>) -> Result<()> {
    match result {
        Err(DdpError::Membership(MembershipError::Superseded { .. })) => {
            tracing::info!("{}", result.unwrap_err());
            Ok(())
        }
        other => other,
    }
}

/// One of the three records of every epoch, in one directory, for one rank of a group.
#[derive(Debug, Clone)]
pub struct RecordFiles {
    dir: PathBuf,
    name: &'static str,
    pg: ProcessGroup,
    log: Option<SavedLog>,
}

impl RecordFiles {
    /// Record `name` (one of [`PARTS`]) in `dir`, on `pg`.
    pub fn new(dir: impl Into<PathBuf>, name: &'static str, pg: ProcessGroup) -> Self {
        Self {
            dir: dir.into(),
            name,
            pg,
            log: None,
        }
    }

    /// Records in `log` each epoch written (and a record that could not be).
    pub fn with_log(mut self, log: SavedLog) -> Self {
        log.record(|s| s.armed = true);
        self.log = Some(log);
        self
    }

    /// The file of `epoch`.
    pub fn path(&self, epoch: usize) -> PathBuf {
        path(&self.dir, self.name, epoch)
    }

    /// Rank 0 writes the record of `epoch`, made by `bytes`, atomically; the other ranks do
    /// nothing (and do not make it). In a fault-tolerant job the file is renamed into place
    /// only while rank 0's membership stands ([`write_atomic_fenced`],
    /// [`ProcessGroup::membership_stands`]): a rank 0 left out while it wrote does not put its
    /// file in place.
    ///
    /// # Errors
    /// The record could not be made ([`JobError::Checkpoint`]) or written
    /// ([`JobError::CheckpointIo`], with the path and the OS error); rank 0's membership ended
    /// ([`MembershipError::Superseded`]).
    pub fn save<E: std::fmt::Display>(
        &self,
        epoch: usize,
        bytes: impl FnOnce() -> std::result::Result<Vec<u8>, E>,
    ) -> Result<()> {
        if self.pg.rank() != Rank(0) {
            return Ok(());
        }
        let file = self.path(epoch);
        let written = bytes()
            .map_err(|e| {
                DdpError::Job(JobError::Checkpoint {
                    path: file.display().to_string(),
                    what: "serialising the record",
                    reason: e.to_string(),
                })
            })
            .and_then(|bytes| {
                write_atomic_fenced(&file, &seal(&bytes), || {
                    let what = format!("rank 0's checkpoint file {}", file.display());
                    self.pg.membership_stands(&what)
                })
            });
        if let Some(log) = &self.log {
            let part = PARTS.iter().position(|p| *p == self.name);
            match (&written, part) {
                (Ok(()), Some(i)) => log.record(|s| s.newest[i] = s.newest[i].max(Some(epoch))),
                (Ok(()), None) => {}
                // The record's own failures (serialising, writing) hold for every epoch after.
                (Err(e @ DdpError::Job(_)), _) => log.record(|s| s.failed = Some(e.to_string())),
                // The fence's (the membership ended, the store did not answer): this epoch's.
                (Err(e), _) => log.record(|s| s.superseded = Some((epoch, e.to_string()))),
            }
        }
        written
    }

    /// Rank 0 removes the record of `epoch` (absent is fine), and every temporary of it first
    /// ([`remove_fenced`]): a superseded rank 0 frozen between its fence and its rename cannot
    /// bring the file back.
    ///
    /// # Errors
    /// The file exists and cannot be removed.
    pub fn delete(&self, epoch: usize) -> std::io::Result<()> {
        if self.pg.rank() != Rank(0) {
            return Ok(());
        }
        remove_fenced(&self.path(epoch))
    }

    /// Collective: every rank gets the record of `epoch` (rank 0 reads the file and sends its
    /// bytes), as `decode` (the Burn line's recorder) makes it from the bytes. A panic of
    /// `decode` (Burn's decoders may panic on bytes they cannot read) is an error too.
    ///
    /// # Errors
    /// As [`RecordFiles::restore`]; `decode` failed or panicked
    /// ([`JobError::Checkpoint`], naming the file).
    pub fn restore_with<R, E: std::fmt::Display>(
        &self,
        epoch: usize,
        decode: impl FnOnce(Vec<u8>) -> std::result::Result<R, E>,
    ) -> Result<R> {
        let bytes = self.restore(epoch)?;
        let bad = |reason: String| {
            DdpError::Job(JobError::Checkpoint {
                path: self.path(epoch).display().to_string(),
                what: "restoring",
                reason,
            })
        };
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| decode(bytes))) {
            Ok(Ok(record)) => Ok(record),
            Ok(Err(e)) => Err(bad(e.to_string())),
            Err(panic) => Err(bad(format!(
                "Burn could not decode it ({}): it is corrupt, or holds a record of another \
                 model or optimizer. Resume with the program that wrote it, or start afresh in \
                 another directory",
                super::vote::panic_text(&*panic)
            ))),
        }
    }

    /// Collective: every rank gets the bytes of the record of `epoch`, which rank 0 reads and
    /// sends.
    ///
    /// # Errors
    /// Rank 0 cannot read the file (every rank gets its message, with the path); the
    /// broadcast failed.
    pub fn restore(&self, epoch: usize) -> Result<Vec<u8>> {
        let file = self.path(epoch);
        // First byte: 1 = the record follows, 0 = rank 0's error message follows.
        let mine = if self.pg.rank() == Rank(0) {
            let read = fs::read(&file).map_err(|e| format!("rank 0 cannot read it: {e}"));
            match read.and_then(|b| {
                unseal(b).map_err(|why| {
                    format!(
                        "{why}. Resume from an earlier epoch's checkpoint (remove this epoch's \
                         files), or start afresh in another directory"
                    )
                })
            }) {
                Ok(mut b) => {
                    b.insert(0, 1);
                    b
                }
                Err(e) => {
                    let mut m = vec![0];
                    m.extend_from_slice(e.as_bytes());
                    m
                }
            }
        } else {
            Vec::new()
        };
        let mut bytes = self.pg.broadcast_bytes(mine, Rank(0))?;
        match bytes.first() {
            Some(1) => {
                bytes.remove(0);
                Ok(bytes)
            }
            _ => Err(DdpError::Job(JobError::Checkpoint {
                path: file.display().to_string(),
                what: "restoring",
                reason: String::from_utf8_lossy(bytes.get(1..).unwrap_or_default()).into_owned(),
            })),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Timeouts, WorldSize};
    use std::time::Duration;

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("burn-ddp-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn newest_complete_skips_epochs_missing_a_record() {
        let dir = scratch("newest");
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

    proptest::proptest! {
        /// A sealed record comes back as it was; cut short, extended, or with any byte after
        /// the magic changed, it is refused; any bytes are read or refused without a panic.
        #[test]
        fn sealed_records_round_trip_and_damage_is_refused(
            record in proptest::collection::vec(proptest::num::u8::ANY, 0..300),
            flip in proptest::num::usize::ANY,
            cut in proptest::num::usize::ANY,
            junk in proptest::collection::vec(proptest::num::u8::ANY, 0..80),
        ) {
            let sealed = seal(&record);
            proptest::prop_assert_eq!(unseal(sealed.clone()), Ok(record.clone()));
            let mut flipped = sealed.clone();
            let at = MAGIC.len() + flip % (flipped.len() - MAGIC.len());
            flipped[at] ^= 0x20;
            proptest::prop_assert!(unseal(flipped).is_err());
            let short = MAGIC.len() + cut % (sealed.len() - MAGIC.len());
            proptest::prop_assert!(unseal(sealed[..short].to_vec()).is_err());
            let mut long = sealed.clone();
            long.push(0);
            proptest::prop_assert!(unseal(long).is_err());
            let mut any = MAGIC.to_vec();
            any.extend(&junk);
            let _ = unseal(any);
            let _ = unseal(junk);
        }
    }

    /// The log of written epochs: nothing to wait for without checkpoints; with them, the wait
    /// ends once the three records of the epoch are written (by a writer thread, as burn-train's
    /// checkpointers write), at the first record that could not be, or at its limit.
    #[test]
    fn the_saved_log_waits_for_every_record_of_the_epoch() {
        let dir = scratch("saved-log");
        let pg = ProcessGroup::local(WorldSize::ONE, Timeouts::uniform(Duration::from_secs(20)))
            .remove(0);
        let log = SavedLog::default();
        assert_eq!(log.wait(1, Duration::ZERO), Ok(()), "no checkpoints");
        let parts: Vec<RecordFiles> = PARTS
            .iter()
            .map(|p| RecordFiles::new(&dir, p, pg.clone()).with_log(log.clone()))
            .collect();
        let late = log.wait(1, Duration::from_millis(50)).unwrap_err();
        assert!(late.contains("checkpoint of epoch 1 within"), "{late}");
        let started = Instant::now();
        std::thread::scope(|s| {
            s.spawn(|| {
                for part in &parts {
                    std::thread::sleep(Duration::from_millis(100));
                    part.save(1, || Ok::<_, String>(vec![1])).unwrap();
                }
            });
            assert_eq!(log.wait(1, Duration::from_secs(20)), Ok(()));
        });
        assert!(started.elapsed() >= Duration::from_millis(300));
        assert!(PARTS.iter().all(|p| path(&dir, p, 1).is_file()));
        parts[0]
            .save(2, || Err::<Vec<u8>, _>("the record does not serialise"))
            .unwrap_err();
        let failed = log.wait(2, Duration::from_secs(20)).unwrap_err();
        assert!(failed.contains("the record does not serialise"), "{failed}");
        fs::remove_dir_all(&dir).unwrap();
    }

    /// Rank 0's checkpoint is fenced on its membership: written while it stands; once a rank
    /// recorded its end, not put in place (no temporary left), and the wait for that epoch's
    /// checkpoint fails at once with the reason, not at its limit; burn-train's checkpointer
    /// thread is told no error.
    #[test]
    fn a_superseded_rank_0_does_not_put_its_checkpoint_in_place() {
        use crate::config::{FaultTolerance, GroupConfig, JobToken, MasterAddr};
        use crate::store::StoreServer;
        let dir = scratch("fenced");
        let token = JobToken::new("fenced-test");
        let server = StoreServer::bind_lighthouse(
            "127.0.0.1:0".parse().unwrap(),
            token.clone(),
            WorldSize::ONE,
        )
        .unwrap();
        let master = MasterAddr::new("127.0.0.1", server.local_addr().port());
        let config = GroupConfig::new(Rank(0), WorldSize::ONE, token)
            .with_master(master)
            .with_timeouts(Timeouts::uniform(Duration::from_secs(5)))
            .with_fault_tolerance(FaultTolerance::default());
        let pg = ProcessGroup::init(config).unwrap();
        let log = SavedLog::default();
        let files = RecordFiles::new(&dir, "model", pg.clone()).with_log(log.clone());
        files.save(1, || Ok::<_, String>(vec![1])).unwrap();
        assert!(files.path(1).is_file());
        pg.end_membership("rank 0 sent no heartbeat");
        let err = files.save(2, || Ok::<_, String>(vec![2])).unwrap_err();
        assert!(
            matches!(
                err,
                DdpError::Membership(MembershipError::Superseded { .. })
            ),
            "{err}"
        );
        assert!(err.to_string().contains("model-2.bin"), "{err}");
        let names: Vec<_> = fs::read_dir(&dir)
            .unwrap()
            .flatten()
            .map(|e| e.file_name())
            .collect();
        assert_eq!(names, ["model-1.bin"], "a file or a temporary was left");
        let started = Instant::now();
        let waited = log.wait(2, Duration::from_secs(30)).unwrap_err();
        assert!(waited.contains("rank 0 sent no heartbeat"), "{waited}");
        assert!(started.elapsed() < Duration::from_secs(10));
        let told = unless_superseded(files.save(3, || Ok::<_, String>(vec![3])));
        assert!(told.is_ok(), "{told:?}");
        assert!(log.wait(3, Duration::from_secs(30)).is_err());
        // Another epoch's wait is not failed by it.
        let other = log.wait(2, Duration::ZERO).unwrap_err();
        assert!(other.contains("did not finish writing"), "{other}");
        drop(pg);
        fs::remove_dir_all(&dir).unwrap();
    }

    /// Rank 0 alone writes; every rank restores rank 0's bytes; a missing file is an error on
    /// every rank naming the file.
    #[test]
    fn rank_0_writes_and_every_rank_restores_its_bytes() {
        let dir = scratch("record-files");
        let groups = ProcessGroup::local(
            WorldSize::new(3).unwrap(),
            Timeouts::uniform(Duration::from_secs(20)),
        );
        let results: Vec<_> = std::thread::scope(|s| {
            let handles: Vec<_> = groups
                .into_iter()
                .map(|pg| {
                    let dir = dir.clone();
                    s.spawn(move || {
                        let me = pg.rank().0 as u8;
                        let files = RecordFiles::new(&dir, "model", pg.clone());
                        files.save(1, || Ok::<_, String>(vec![me; 4])).unwrap();
                        let got = files.restore(1).unwrap();
                        let missing = files.restore(2).unwrap_err().to_string();
                        for p in ["optim", "scheduler"] {
                            RecordFiles::new(&dir, p, pg.clone())
                                .save(1, || Ok::<_, String>(vec![0]))
                                .unwrap();
                        }
                        (got, missing)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (got, missing) in results {
            assert_eq!(got, [0, 0, 0, 0]);
            assert!(
                missing.contains("model-2.bin") && missing.contains("rank 0 cannot read"),
                "{missing}"
            );
        }
        let err = RecordFiles::new(&dir, "model", ProcessGroup::single())
            .save(3, || Err::<Vec<u8>, _>("no bytes"))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("no bytes") && err.contains("model-3.bin"),
            "{err}"
        );
        fs::remove_dir_all(&dir).unwrap();
    }
}
