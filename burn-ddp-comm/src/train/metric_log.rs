//! The metric files of a fault-tolerant job, which any rank may end up writing: every rank
//! computes every step's metrics (the outputs are gathered on every rank) and keeps the lines
//! Burn's file logger would write, and the rank that is rank 0 writes them into the training
//! directory, in Burn's layout (`train/epoch-1/Accuracy.log`, one serialized entry per line),
//! so that Burn's summary and a resumed dashboard read them as Burn's own.
//!
//! A rank that becomes rank 0 mid-run writes what it holds: the epochs it saw from their start
//! are written whole (the file made anew, so a line its predecessor wrote but did not flush is
//! not lost, and none is written twice); an epoch it joined in the middle of (it took the state
//! from another rank) is appended to, from the change on, after what its predecessor wrote on
//! that machine.
//!
//! Rank 0 writes only while its membership has not ended ([`ProcessGroup::membership_ended`]:
//! the logger asks the store before each update). A rank 0 frozen past the heartbeat bound and
//! then continued can finish the step it was in from what its peers had posted before they
//! went on without it; its lines for that step are held back ([`MetricLog::hold`]), then
//! dropped if it takes another rank's state (the step was not the job's), or recorded before
//! its next line if it does not (the job went on from its state, that step included). The
//! logger runs on burn-train's event threads, a few milliseconds behind the step; a change of
//! membership takes longer (the others' decision, then the state moved), so the answer is about
//! the membership the step ran in. Should the logger reach a line only after this process took
//! another's state, it records it as a rank's that is no longer rank 0: kept here, not written
//! (a process that took a state writes an epoch under way only from its change on).
//!
//! A check cannot fence a write that follows it: a rank 0 frozen between the two (its logger
//! thread had asked, or held lines not written yet) writes once continued, whatever happened
//! meanwhile. So a rank that takes the files over does not write into its predecessor's: it
//! puts a new file under each name (what it keeps of the old one copied, then renamed into
//! place), and what the old rank 0 writes through the files it had open reaches a file no
//! longer named (seen in a run of the test step: a 0.22 chaos run's epoch 1 logged 48 items
//! over, one step twice).
//!
//! [`ProcessGroup::membership_ended`]: crate::ProcessGroup::membership_ended

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

/// One metric's lines in one split's epoch.
#[derive(Debug, Default)]
struct Lines {
    lines: Vec<String>,
    /// Open for writing (while this process is rank 0), with how many lines it has.
    out: Option<(File, usize)>,
}

/// The lines of one split's epoch, by file name (`Accuracy.log`).
#[derive(Debug, Default)]
struct EpochLines {
    /// Whether this process saw the epoch's split from its start.
    whole: bool,
    files: BTreeMap<String, Lines>,
}

#[derive(Debug, Default)]
struct Log {
    /// By directory under the training directory (`train/epoch-1`).
    epochs: BTreeMap<String, EpochLines>,
    /// Set when this process took the state from another rank: the next epoch directory it
    /// starts is not whole.
    behind: bool,
    /// Whether this process was rank 0 at the last line (its files are open).
    writing: bool,
    /// The first error writing, reported once.
    warned: bool,
    /// Lines held back while this process's membership had ended: `(dir, epoch_dir, file,
    /// line)`.
    held: Vec<(PathBuf, String, String, String)>,
    /// Training is over with this process's state the job's ([`MetricLog::settle`]): nothing
    /// is held back any more.
    settled: bool,
}

/// A fault-tolerant job's metric lines on one process, shared between the line's metric
/// logger and its strategy (cloned, one log).
#[derive(Debug, Clone, Default)]
pub struct MetricLog(Arc<Mutex<Log>>);

impl MetricLog {
    fn log(&self) -> std::sync::MutexGuard<'_, Log> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// This process took the training state from another rank (it joined the running job, or
    /// rejoined it after being left out): the epochs under way are not whole here.
    pub fn took_state(&self) {
        let mut log = self.log();
        log.behind = true;
        for e in log.epochs.values_mut() {
            e.whole = false;
        }
        // The lines held back were of a step the job did not take.
        log.held.clear();
        log.settled = false;
    }

    /// Holds back `line` of `file` in `epoch_dir`: rank 0's line of a step after its
    /// membership ended (see the module's documentation). Recorded before the next line that
    /// [`record`](Self::record) is given, unless this process takes another rank's state
    /// first ([`took_state`](Self::took_state)).
    pub fn hold(&self, dir: &Path, epoch_dir: &str, file: &str, line: String) {
        let mut log = self.log();
        if log.settled {
            log.record(dir, epoch_dir, file, line, true);
            return;
        }
        log.held
            .push((dir.to_owned(), epoch_dir.to_owned(), file.to_owned(), line));
    }

    /// Training is over, and every rank of this process's last membership agreed on its end
    /// (the fit's last vote): the steps this process took were the job's. Records what it held
    /// back, writing it when `write` (this process is rank 0), and from now on holds nothing
    /// back (burn-train's logger runs a few milliseconds behind the steps). Without it, a
    /// rank 0 whose store stopped answering near the end of training (an etcd election after
    /// a member's link came back, seen in a chaos run) held back the lines of its last steps,
    /// with no line after them to write them, and the metric files lacked them.
    pub fn settle(&self, write: bool) {
        let mut log = self.log();
        log.settled = true;
        for (dir, epoch_dir, file, line) in std::mem::take(&mut log.held) {
            log.record(&dir, &epoch_dir, &file, line, write);
        }
    }

    /// Records `line` of file `file` in `epoch_dir` (relative to `dir`, the training
    /// directory), and writes it there when `write` (this process is rank 0), after what this
    /// process holds and has not written (see the module's documentation). A file that cannot
    /// be written is warned about once; training goes on.
    pub fn record(&self, dir: &Path, epoch_dir: &str, file: &str, line: String, write: bool) {
        // Under one lock: a `took_state` cannot come between taking the held lines and
        // recording them.
        let mut log = self.log();
        for (held_dir, epoch_dir, file, line) in std::mem::take(&mut log.held) {
            log.record(&held_dir, &epoch_dir, &file, line, write);
        }
        log.record(dir, epoch_dir, file, line, write);
    }

    /// The lines this process holds of `file` in `epoch_dir`, or `None` (then the file is
    /// read).
    pub fn lines(&self, epoch_dir: &str, file: &str) -> Option<Vec<String>> {
        let log = self.log();
        let lines = &log.epochs.get(epoch_dir)?.files.get(file)?.lines;
        Some(lines.clone())
    }

    /// The lines of `path`, one entry each (what a metric logger reads back).
    pub fn read_file(path: &Path) -> Vec<String> {
        File::open(path)
            .map(|f| {
                BufReader::new(f)
                    .lines()
                    .map_while(std::result::Result::ok)
                    .filter(|l| !l.is_empty())
                    .collect()
            })
            .unwrap_or_default()
    }
}

impl Log {
    /// [`MetricLog::record`] of one line.
    fn record(&mut self, dir: &Path, epoch_dir: &str, file: &str, line: String, write: bool) {
        let behind = std::mem::take(&mut self.behind);
        let mut failed = None;
        if write != std::mem::replace(&mut self.writing, write) {
            for (name, e) in &mut self.epochs {
                if write {
                    // Became rank 0: what this process holds is written out.
                    let opened = e.open(&dir.join(name)).and_then(|()| e.flush());
                    failed = failed.or(opened.err().map(|err| (name.clone(), err)));
                } else {
                    // No longer rank 0: what another process writes is not written here.
                    e.files.values_mut().for_each(|l| l.out = None);
                }
            }
        }
        let lines = self
            .epochs
            .entry(epoch_dir.to_owned())
            .or_insert_with(|| EpochLines {
                whole: !behind,
                ..EpochLines::default()
            });
        lines.files.entry(file.to_owned()).or_default();
        if write {
            // A file new here is made anew in a whole epoch, appended to in another (after
            // what this process's predecessor wrote).
            let opened = lines.open(&dir.join(epoch_dir));
            failed = failed.or(opened.err().map(|err| (epoch_dir.to_owned(), err)));
        }
        if let Some(held) = lines.files.get_mut(file) {
            held.lines.push(line);
        }
        if write {
            let written = lines.flush();
            failed = failed.or(written.err().map(|err| (epoch_dir.to_owned(), err)));
        }
        if let (Some((name, err)), false) = (failed, self.warned) {
            self.warned = true;
            let path = dir.join(name);
            tracing::warn!(
                "burn-ddp: the metrics cannot be written into {} ({err}); training goes on",
                path.display()
            );
        }
    }
}

/// `path` to append to, emptied first when `anew`, as a file of its own: its content (none when
/// `anew`, else what `path` holds) goes into a temporary beside it, renamed over `path`. A
/// process that wrote `path` before still holds the old file open: a rank 0 frozen, then left
/// out, whose logger thread had passed its check on the membership, or held lines not written
/// yet, when it stopped. What it writes once continued goes to a file that no longer has the
/// name, not to the end of its successor's.
fn open(path: &Path, anew: bool) -> std::io::Result<File> {
    let name = path.file_name().unwrap_or_default().to_string_lossy();
    let tmp = path.with_file_name(format!(".{name}.tmp-{}", std::process::id()));
    let kept = if anew {
        Vec::new()
    } else {
        match std::fs::read(path) {
            Ok(bytes) => bytes,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
            Err(e) => return Err(e),
        }
    };
    let placed = (|| {
        let mut f = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .open(&tmp)?;
        f.write_all(&kept)?;
        std::fs::rename(&tmp, path)?;
        Ok(f)
    })();
    if placed.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    placed
}

impl EpochLines {
    /// Opens the files not open yet in `dir` (their lines go out at the next [`flush`](Self::flush)):
    /// a whole epoch's anew, from its first line; the others to append to, after the lines
    /// held now (their writer was another process).
    fn open(&mut self, dir: &Path) -> std::io::Result<()> {
        for (name, l) in &mut self.files {
            if l.out.is_some() {
                continue;
            }
            std::fs::create_dir_all(dir)?;
            let path = dir.join(name);
            let f = open(&path, self.whole)?;
            l.out = Some((f, if self.whole { 0 } else { l.lines.len() }));
        }
        Ok(())
    }

    /// Writes the lines not written yet into the open files.
    fn flush(&mut self) -> std::io::Result<()> {
        for l in self.files.values_mut() {
            if let Some((f, n)) = &mut l.out {
                for line in &l.lines[*n..] {
                    writeln!(f, "{line}")?;
                }
                *n = l.lines.len();
            }
        }
        Ok(())
    }
}

/// A line's metric logger over a [`MetricLog`], written once for every line (their Burn types
/// have the same paths, under the line's Burn crate, given by name: the core names none):
/// `JobMetricLogger::new(dir, log, group)`, Burn's file logger's layout
/// under `dir` (`train/epoch-1/Accuracy.log`), written by whichever process is the group's
/// rank 0, read back from what this process holds.
///
/// ```ignore
/// burn_ddp_comm::job_metric_logger!(burn);
/// ```
#[macro_export]
macro_rules! job_metric_logger {
    ($b:ident) => {
        /// The metric logger of every rank of a fault-tolerant job: every rank records every
        /// step's metrics (their outputs are gathered on every rank), and the one that is rank 0
        /// writes them into the training directory, in the layout of Burn's file logger, so
        /// that a rank that becomes rank 0 mid-run writes the whole run's metrics
        /// (burn-ddp-comm's `train::metric_log`).
        pub struct JobMetricLogger {
            dir: std::path::PathBuf,
            log: $crate::train::metric_log::MetricLog,
            pg: $crate::ProcessGroup,
            names: std::collections::HashMap<$b::train::metric::MetricId, String>,
        }

        impl JobMetricLogger {
            /// Writes into `dir` while this process is `pg`'s rank 0, recording into `log`.
            pub(crate) fn new(
                dir: std::path::PathBuf,
                log: $crate::train::metric_log::MetricLog,
                pg: $crate::ProcessGroup,
            ) -> Self {
                Self {
                    dir,
                    log,
                    pg,
                    names: std::collections::HashMap::new(),
                }
            }

            /// Burn's file name of metric `name`.
            fn file(name: &str) -> String {
                format!("{}.log", name.replace(' ', "_"))
            }
        }

        impl $b::train::logger::MetricLogger for JobMetricLogger {
            fn log(
                &mut self,
                update: $b::train::metric::store::MetricsUpdate,
                epoch: usize,
                split: &$b::train::metric::store::Split,
            ) {
                let dir = format!("{split}/epoch-{epoch}");
                let write = self.pg.is_main();
                // Rank 0 writes for the job only while its membership stands (the module's
                // documentation): one request to the store per update, on rank 0 alone.
                let hold = write && self.pg.membership_ended();
                let numeric = update.entries_numeric.iter().map(|u| &u.entry);
                for entry in update.entries.iter().chain(numeric) {
                    let Some(name) = self.names.get(&entry.metric_id) else {
                        continue;
                    };
                    let line = entry.serialized_entry.serialized.clone();
                    if hold {
                        self.log.hold(&self.dir, &dir, &Self::file(name), line);
                    } else {
                        self.log
                            .record(&self.dir, &dir, &Self::file(name), line, write);
                    }
                }
            }

            fn read_numeric(
                &mut self,
                name: &str,
                epoch: usize,
                split: &$b::train::metric::store::Split,
            ) -> std::result::Result<Vec<$b::train::metric::NumericEntry>, String> {
                let dir = format!("{split}/epoch-{epoch}");
                let file = Self::file(name);
                let lines = self.log.lines(&dir, &file).unwrap_or_else(|| {
                    $crate::train::metric_log::MetricLog::read_file(
                        &self.dir.join(&dir).join(&file),
                    )
                });
                lines
                    .iter()
                    .map(|l| $b::train::metric::NumericEntry::deserialize(l))
                    .collect()
            }

            fn log_metric_definition(&mut self, definition: $b::train::metric::MetricDefinition) {
                self.names
                    .insert(definition.metric_id, definition.name.to_string());
            }

            fn log_epoch_summary(&mut self, _summary: $b::train::metric::store::EpochSummary) {}
        }
    };
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    fn scratch(name: &str) -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("burn-ddp-metrics-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        dir
    }

    fn file(dir: &Path) -> Vec<String> {
        MetricLog::read_file(&dir.join("train/epoch-1/Loss.log"))
    }

    fn record(log: &MetricLog, dir: &Path, from: usize, to: usize, write: bool) {
        for i in from..to {
            log.record(dir, "train/epoch-1", "Loss.log", format!("{i},32"), write);
        }
    }

    fn lines(from: usize, to: usize) -> Vec<String> {
        (from..to).map(|i| format!("{i},32")).collect()
    }

    #[test]
    fn a_rank_that_becomes_rank_zero_writes_the_whole_epoch_once() {
        let dir = scratch("whole");
        let (old, new) = (MetricLog::default(), MetricLog::default());
        // Rank 0 writes 5 lines, and dies with its last 2 not flushed; rank 1 holds all 5.
        record(&old, &dir, 0, 3, true);
        record(&new, &dir, 0, 5, false);
        assert_eq!(file(&dir), lines(0, 3));
        // Rank 1 is rank 0 now: the epoch is written whole, then line by line.
        record(&new, &dir, 5, 8, true);
        assert_eq!(file(&dir), lines(0, 8));
        assert_eq!(new.lines("train/epoch-1", "Loss.log"), Some(lines(0, 8)));
        assert_eq!(new.lines("train/epoch-2", "Loss.log"), None);
        // A rank that never is rank 0 writes nothing.
        let other = scratch("other");
        record(&MetricLog::default(), &other, 0, 4, false);
        assert!(!&other.join("train").exists());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_process_that_joined_mid_epoch_appends_after_its_predecessor() {
        let dir = scratch("joined");
        let (old, joiner) = (MetricLog::default(), MetricLog::default());
        record(&old, &dir, 0, 6, true);
        // The joiner took the state at line 4: it holds 4 and 5, which its predecessor wrote.
        joiner.took_state();
        record(&joiner, &dir, 4, 6, false);
        record(&joiner, &dir, 6, 9, true);
        assert_eq!(file(&dir), lines(0, 9));
        // Its next epoch is whole: made anew.
        let next = &dir.join("train/epoch-2/Loss.log");
        std::fs::create_dir_all(next.parent().unwrap()).unwrap();
        std::fs::write(next, "stale,1\n").unwrap();
        joiner.record(&dir, "train/epoch-2", "Loss.log", "1,32".into(), true);
        assert_eq!(MetricLog::read_file(next), ["1,32"]);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn lines_held_back_are_dropped_with_a_state_taken_and_kept_without() {
        let dir = scratch("held");
        let log = MetricLog::default();
        record(&log, &dir, 0, 2, true);
        // Rank 0's membership ended under it: its step's line is held back, not written.
        log.hold(&dir, "train/epoch-1", "Loss.log", "2,32".into());
        assert_eq!(file(&dir), lines(0, 2));
        // It went on with its own state (the job's): the line comes before the next one.
        record(&log, &dir, 3, 4, true);
        assert_eq!(file(&dir), lines(0, 4));
        // Held back again, then it takes another rank's state: the step was not the job's.
        log.hold(&dir, "train/epoch-1", "Loss.log", "stale,32".into());
        log.took_state();
        record(&log, &dir, 4, 5, false);
        assert_eq!(log.lines("train/epoch-1", "Loss.log"), Some(lines(0, 5)));
        assert_eq!(file(&dir), lines(0, 4));
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// The store stopped answering rank 0 near the end of training: the lines of its last
    /// steps are held back with no line after them; once every rank agreed that training is
    /// over they are written, and so is a line the logger reaches only after that.
    #[test]
    fn lines_held_back_at_the_end_of_training_are_written_once_it_is_settled() {
        let dir = scratch("settled");
        let log = MetricLog::default();
        record(&log, &dir, 0, 2, true);
        log.hold(&dir, "train/epoch-1", "Loss.log", "2,32".into());
        log.hold(&dir, "train/epoch-1", "Loss.log", "3,32".into());
        assert_eq!(file(&dir), lines(0, 2));
        log.settle(true);
        assert_eq!(file(&dir), lines(0, 4));
        log.hold(&dir, "train/epoch-1", "Loss.log", "4,32".into());
        assert_eq!(file(&dir), lines(0, 5));
        assert_eq!(log.lines("train/epoch-1", "Loss.log"), Some(lines(0, 5)));
        // A state taken afterwards (another fit in a job that changed) holds back again.
        log.took_state();
        log.hold(&dir, "train/epoch-1", "Loss.log", "stale,32".into());
        assert_eq!(file(&dir), lines(0, 5));
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Rank 0's logger thread passed its check, then the process was frozen: its successor
    /// writes the epoch whole, and what the old rank 0 writes once continued stays out of it.
    #[test]
    fn a_frozen_rank_zero_writing_after_its_successor_took_over_reaches_no_file() {
        let dir = scratch("frozen");
        let (old, new) = (MetricLog::default(), MetricLog::default());
        record(&old, &dir, 0, 3, true);
        record(&new, &dir, 0, 5, false);
        // The successor takes over, then the old rank 0 writes on (its files were open).
        record(&new, &dir, 5, 6, true);
        record(&old, &dir, 3, 4, true);
        record(&new, &dir, 6, 7, true);
        assert_eq!(file(&dir), lines(0, 7));
        // A successor that took its state mid-epoch keeps its predecessor's lines.
        let joiner = MetricLog::default();
        joiner.took_state();
        record(&joiner, &dir, 6, 7, false);
        record(&joiner, &dir, 7, 8, true);
        record(&new, &dir, 7, 8, true);
        assert_eq!(file(&dir), lines(0, 8));
        let left: Vec<_> = std::fs::read_dir(dir.join("train/epoch-1"))
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(left, ["Loss.log"], "no temporary left");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_rank_zero_left_out_stops_writing() {
        let dir = scratch("left");
        let log = MetricLog::default();
        record(&log, &dir, 0, 2, true);
        record(&log, &dir, 2, 4, false);
        assert_eq!(file(&dir), lines(0, 2));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
