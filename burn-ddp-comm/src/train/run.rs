//! Which run a checkpoint directory belongs to, and where a run starts.
//!
//! Rank 0 records the run's settings in `run.txt` beside its checkpoints when training starts.
//! A resume compares them with its own and refuses checkpoints written with other settings
//! (or by a program that recorded none), naming each difference; a fresh run refuses a
//! directory that already holds checkpoints, so that the epochs found there are always its
//! own. The decision is rank 0's, sent to every rank ([`start_epoch`]).

use crate::error::JobError;
use std::fs;
use std::path::Path;

use crate::checkpoint::write_atomic;
use crate::config::env::run_id;
use crate::{DdpError, ProcessGroup, Rank, Result};

use super::files::newest_complete;

/// The file of the run's settings in the checkpoint directory.
pub const RUN_FILE: &str = "run.txt";

/// Recorded, not compared: a run may resume at another world size (the global batch changes
/// with it; the message says so).
pub const WORLD_SIZE: &str = "world size";
/// Recorded, not compared: a run may be extended to more epochs.
pub const EPOCHS: &str = "epochs";
/// Recorded and compared: the number of the model's parameters.
pub const PARAMETERS: &str = "parameters";
/// Recorded, not compared: the job that wrote the checkpoints ([`run_id`]), kept across its
/// restarts and requeues. A run of the same job that finds them resumes from them.
pub const JOB: &str = "job";

const UNCOMPARED: [&str; 3] = [WORLD_SIZE, EPOCHS, JOB];

/// Whether `dir` holds complete checkpoints written by this very job ([`run_id`]: the same
/// `SLURM_JOB_ID`, torchrun run id, ... as now): a job restarted or requeued by a launcher
/// that did not say so. A program that clears its output directory for a fresh run asks this
/// first, and resumes instead: the checkpoints are its own.
pub fn own_checkpoints(dir: &Path) -> bool {
    own_job(dir, run_id().as_deref()).is_some()
}

/// Readies a program's output directory `out` (its checkpoints in `checkpoints`) for this run,
/// and says whether the run resumes. A fresh run starts in an empty directory, as Burn's
/// examples do (otherwise Burn's summary would count an older run's epochs), so `out` is
/// removed, unless the run resumes: asked to (`resume`), restarted by its launcher
/// ([`ProcessGroup::restart_count`]), or finding this same job's checkpoints
/// ([`own_checkpoints`]), which are never removed. Call it on the rank that writes `out`
/// (rank 0) before training.
///
/// # Errors
/// `out` exists and cannot be removed ([`JobError::CheckpointIo`]).
pub fn prepare_output(
    out: &Path,
    checkpoints: &Path,
    resume: bool,
    restart_count: u32,
) -> Result<bool> {
    if resume || restart_count > 0 || own_checkpoints(checkpoints) {
        return Ok(true);
    }
    match fs::remove_dir_all(out) {
        Ok(()) => Ok(false),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(source) => Err(DdpError::Job(JobError::CheckpointIo {
            path: out.to_path_buf(),
            what: "clearing the output directory for a fresh run",
            source,
        })),
    }
}

/// The newest complete checkpoint in `dir` when its recorded job is `job`.
fn own_job(dir: &Path, job: Option<&str>) -> Option<usize> {
    let job = job?;
    let newest = newest_complete(dir)?;
    let recorded = RunSettings::read(dir).ok()??;
    (recorded.get(JOB) == Some(job)).then_some(newest)
}

/// The settings of a run, recorded with its checkpoints and compared on resume: the program's
/// (learning rate, batch size, data, seed: whatever makes a checkpoint belong to the run),
/// plus the number of the model's parameters, the world size and the number of epochs, which
/// the strategy adds. Keys and values are single lines (line breaks become spaces).
///
/// ```
/// use burn_ddp_comm::train::run::RunSettings;
/// let run = RunSettings::new().with("lr", 2e-3).with("batch size", 32);
/// assert_eq!(run.get("batch size"), Some("32"));
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RunSettings(Vec<(String, String)>);

fn one_line(s: &str) -> String {
    s.replace(['\r', '\n'], " ").trim().to_owned()
}

impl RunSettings {
    /// No settings.
    pub fn new() -> Self {
        Self::default()
    }

    /// The settings with `key` set to `value`.
    #[must_use]
    pub fn with(mut self, key: impl AsRef<str>, value: impl std::fmt::Display) -> Self {
        self.set(key, value);
        self
    }

    /// Sets `key` to `value` (replacing an earlier value). `=` in a key becomes `-`.
    pub fn set(&mut self, key: impl AsRef<str>, value: impl std::fmt::Display) {
        let key = one_line(key.as_ref()).replace('=', "-");
        let value = one_line(&value.to_string());
        match self.0.iter_mut().find(|(k, _)| *k == key) {
            Some(entry) => entry.1 = value,
            None => self.0.push((key, value)),
        }
    }

    /// The value of `key`.
    pub fn get(&self, key: &str) -> Option<&str> {
        self.0
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }

    /// Whether there are no settings.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    fn text(&self) -> String {
        let mut text = String::from(
            "# The settings of the run that wrote these checkpoints (burn-ddp); a resume with\n\
             # other settings is refused.\n",
        );
        for (k, v) in &self.0 {
            text.push_str(&format!("{k} = {v}\n"));
        }
        text
    }

    /// The settings in the text of a [`RUN_FILE`]; what is wrong with it otherwise (the first
    /// line that is not `key = value`, a comment or blank, or a key given twice).
    fn parse(text: &str) -> std::result::Result<Self, String> {
        let mut settings = Self::new();
        for (n, line) in text.lines().map(str::trim).enumerate() {
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let Some((k, v)) = line.split_once('=') else {
                return Err(format!("line {} is not `key = value`: {line:?}", n + 1));
            };
            let key = k.trim();
            if key.is_empty() || settings.get(key).is_some() {
                return Err(format!(
                    "line {} gives {} key: {line:?}",
                    n + 1,
                    if key.is_empty() { "no" } else { "a repeated" }
                ));
            }
            settings.set(key, v.trim());
        }
        Ok(settings)
    }

    /// The compared settings on which `self` (this run) and `recorded` (the checkpoints' run)
    /// differ, one line each.
    pub fn differences(&self, recorded: &RunSettings) -> Vec<String> {
        let mut keys: Vec<&str> = self.0.iter().map(|(k, _)| k.as_str()).collect();
        for (k, _) in &recorded.0 {
            if !keys.contains(&k.as_str()) {
                keys.push(k);
            }
        }
        keys.into_iter()
            .filter(|k| !UNCOMPARED.contains(k))
            .filter_map(|k| match (recorded.get(k), self.get(k)) {
                (a, b) if a == b => None,
                (Some(a), Some(b)) => Some(format!("{k} = {a} there, {b} here")),
                (Some(a), None) => Some(format!("{k} = {a} there, not set here")),
                (None, Some(b)) => Some(format!("{k} not set there, {b} here")),
                (None, None) => None,
            })
            .collect()
    }

    /// The settings recorded in `dir` (`None` when it has no [`RUN_FILE`]).
    ///
    /// # Errors
    /// The file exists but cannot be read.
    pub fn read(dir: &Path) -> Result<Option<Self>> {
        let file = dir.join(RUN_FILE);
        let damaged = |why: String| {
            DdpError::Job(JobError::Checkpoint {
                path: file.display().to_string(),
                what: "reading the run's settings",
                reason: format!(
                    "{why}. burn-ddp writes this file with the checkpoints; restore it, or \
                     start afresh in another directory"
                ),
            })
        };
        match fs::read(&file) {
            Ok(bytes) => {
                let text = String::from_utf8(bytes).map_err(|e| {
                    damaged(format!(
                        "it is not text (byte {})",
                        e.utf8_error().valid_up_to()
                    ))
                })?;
                Self::parse(&text).map(Some).map_err(damaged)
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(source) => Err(DdpError::Job(JobError::CheckpointIo {
                path: file,
                what: "reading the run's settings",
                source,
            })),
        }
    }

    /// Records the settings in `dir` (made if missing), atomically.
    ///
    /// # Errors
    /// The directory or the file cannot be written ([`JobError::CheckpointIo`]).
    pub fn write(&self, dir: &Path) -> Result<()> {
        fs::create_dir_all(dir).map_err(|source| {
            DdpError::Job(JobError::CheckpointIo {
                path: dir.to_path_buf(),
                what: "creating the checkpoint directory",
                source,
            })
        })?;
        write_atomic(&dir.join(RUN_FILE), self.text().as_bytes())
    }
}

/// What decides where a run starts.
#[derive(Debug, Clone, Copy)]
pub struct StartAsk<'a> {
    /// An epoch the program named (burn-train's `SupervisedTraining::checkpoint`).
    pub explicit: Option<usize>,
    /// The checkpoint directory, if the run writes checkpoints.
    pub dir: Option<&'a Path>,
    /// Resume from the newest complete checkpoint (asked for, or a restarted group).
    pub resume: bool,
    /// The run's number of epochs.
    pub epochs: usize,
    /// The number of the model's parameters.
    pub parameters: usize,
    /// The program's settings ([`PARAMETERS`], [`WORLD_SIZE`], [`EPOCHS`] and [`JOB`] are
    /// added).
    pub settings: &'a RunSettings,
    /// The job's identity ([`run_id`]): checkpoints recorded with the same one are this job's
    /// own, from before a restart or requeue, and are resumed from even when `resume` is off.
    pub job: Option<&'a str>,
}

/// Collective: the checkpoint epoch this run resumes after (`None`: it starts at epoch 1), the
/// same on every rank. Rank 0 decides: it checks that the checkpoints belong to this run,
/// says what it resumes (or that nothing is left to do), records the run's settings in the
/// directory, and sends the outcome to every rank.
///
/// # Errors
/// On every rank, when rank 0 refuses: the checkpoints were written with other settings or by
/// a program that recorded none, a fresh run would mix its checkpoints with an earlier run's,
/// or the settings cannot be recorded ([`JobError::Checkpoint`] on rank 0,
/// [`JobError::TrainingFailed`] naming rank 0 on the others); or the broadcast failed.
pub fn start_epoch(pg: &ProcessGroup, ask: &StartAsk<'_>) -> Result<Option<usize>> {
    // First byte: 1 = the epoch follows (0 = none), 0 = rank 0's error message follows.
    let (mine, own_error) = if pg.rank() == Rank(0) {
        match decide(ask, pg.world_size().get()) {
            Ok(epoch) => {
                let mut b = vec![1];
                b.extend_from_slice(&(epoch.unwrap_or(0) as u64).to_le_bytes());
                (b, None)
            }
            Err(e) => {
                let mut b = vec![0];
                b.extend_from_slice(e.to_string().as_bytes());
                (b, Some(e))
            }
        }
    } else {
        (Vec::new(), None)
    };
    let bytes = pg.broadcast_bytes(mine, Rank(0))?;
    if let Some(e) = own_error {
        return Err(e);
    }
    match bytes.split_first() {
        Some((1, epoch)) if epoch.len() == 8 => {
            let epoch = u64::from_le_bytes(epoch.try_into().unwrap_or_default()) as usize;
            Ok((epoch > 0).then_some(epoch))
        }
        _ => Err(DdpError::Job(JobError::TrainingFailed {
            rank: pg.rank(),
            culprit: Rank(0),
            reason: String::from_utf8_lossy(bytes.get(1..).unwrap_or_default()).into_owned(),
        })),
    }
}

fn refused(dir: &Path, what: &'static str, reason: String) -> DdpError {
    DdpError::Job(JobError::Checkpoint {
        path: dir.display().to_string(),
        what,
        reason,
    })
}

/// Rank 0's decision (see [`start_epoch`]).
fn decide(ask: &StartAsk<'_>, world: u32) -> Result<Option<usize>> {
    let Some(dir) = ask.dir else {
        // Without a directory nothing is checked; a named epoch fails where it is restored.
        return Ok(ask.explicit);
    };
    let mut settings = ask.settings.clone();
    settings.set(PARAMETERS, ask.parameters);
    let newest = newest_complete(dir);
    let own = ask.explicit.is_none() && !ask.resume && own_job(dir, ask.job).is_some();
    if own {
        tracing::warn!(
            "{} holds the checkpoints of this same job ({}), written before it was restarted \
             or requeued: resuming from them instead of starting again",
            dir.display(),
            ask.job.unwrap_or_default()
        );
    }
    let resume = ask.resume || own;
    let epoch = match ask.explicit {
        Some(e) => Some(e),
        None if resume => newest,
        None => None,
    };
    match (epoch, newest) {
        (None, Some(n)) if !resume => {
            return Err(refused(
                dir,
                "starting a fresh run",
                format!(
                    "it holds the checkpoints of an earlier run (the newest of epoch {n}); a \
                     fresh run there would mix its epochs with that run's. Resume from them \
                     (DdpStrategy::with_resume), or remove them, or write into another \
                     directory"
                ),
            ))
        }
        (None, _) if resume => tracing::info!(
            "no complete checkpoint in {}: training starts at epoch 1 of {}",
            dir.display(),
            ask.epochs
        ),
        (None, _) => {}
        (Some(e), _) => {
            let recorded = RunSettings::read(dir)?.ok_or_else(|| {
                refused(
                    dir,
                    "resuming",
                    format!(
                        "it holds checkpoints (epoch {e}) but no record of the run that wrote \
                         them ({RUN_FILE}), so they cannot be told apart from another \
                         program's; remove them, or write into another directory"
                    ),
                )
            })?;
            let differences = settings.differences(&recorded);
            if !differences.is_empty() {
                return Err(refused(
                    dir,
                    "resuming",
                    format!(
                        "its checkpoints belong to a run with other settings ({}); resume \
                         with the same settings, or start a fresh run in another directory",
                        differences.join("; ")
                    ),
                ));
            }
            let world_then = recorded
                .get(WORLD_SIZE)
                .filter(|w| *w != world.to_string())
                .map(|w| format!(", written at world size {w}: the global batch changes"))
                .unwrap_or_default();
            if e >= ask.epochs {
                tracing::warn!(
                    "nothing left to do: the checkpoint of epoch {e} in {} completes all {} \
                     epochs of this run (ask for more epochs to train further)",
                    dir.display(),
                    ask.epochs
                );
            } else {
                tracing::info!(
                    "resuming after epoch {e} of {} from {}{world_then}",
                    ask.epochs,
                    dir.display()
                );
            }
        }
    }
    settings.set(WORLD_SIZE, world);
    settings.set(EPOCHS, ask.epochs);
    if let Some(job) = ask.job {
        settings.set(JOB, job);
    }
    settings.write(dir)?;
    Ok(epoch)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::train::files::{path, PARTS};
    use crate::{Timeouts, WorldSize};
    use std::time::Duration;

    fn scratch(name: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("burn-ddp-run-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        dir
    }

    fn checkpoint(dir: &Path, epoch: usize) {
        for p in PARTS {
            fs::write(path(dir, p, epoch), b"x").unwrap();
        }
    }

    fn ask<'a>(dir: &'a Path, resume: bool, settings: &'a RunSettings) -> StartAsk<'a> {
        StartAsk {
            explicit: None,
            dir: Some(dir),
            resume,
            epochs: 3,
            parameters: 10,
            settings,
            job: None,
        }
    }

    #[test]
    fn settings_round_trip_and_differences_skip_world_size_and_epochs() {
        let a = RunSettings::new()
            .with("lr", 0.002)
            .with("data", "shapes\nx = 1")
            .with(WORLD_SIZE, 2)
            .with(EPOCHS, 3);
        let back = RunSettings::parse(&a.text()).unwrap();
        assert_eq!(back, a);
        assert_eq!(back.get("data"), Some("shapes x = 1"));
        let b = RunSettings::new()
            .with("lr", 0.001)
            .with("seed", 7)
            .with(WORLD_SIZE, 4)
            .with(EPOCHS, 9);
        assert_eq!(
            b.differences(&a),
            [
                "lr = 0.002 there, 0.001 here",
                "seed not set there, 7 here",
                "data = shapes x = 1 there, not set here"
            ]
        );
        assert!(a.differences(&back).is_empty());
    }

    /// A damaged run file is refused naming the file, the line and the fix; never read as other
    /// settings, never a panic.
    #[test]
    fn a_damaged_run_file_is_refused_naming_the_line() {
        for (text, why) in [
            ("lr = 1\ngarbage\n", "line 2 is not `key = value`"),
            ("= 3\n", "line 1 gives no key"),
            ("lr = 1\nlr = 2\n", "line 2 gives a repeated key"),
        ] {
            assert_eq!(
                RunSettings::parse(text).unwrap_err(),
                format!("{why}: {:?}", text.lines().last().unwrap())
            );
        }
        let dir = scratch("damaged-run");
        fs::write(dir.join(RUN_FILE), b"lr = \xff\xfe").unwrap();
        let e = RunSettings::read(&dir).unwrap_err().to_string();
        assert!(
            e.contains(RUN_FILE) && e.contains("it is not text (byte 5)"),
            "{e}"
        );
        assert!(e.contains("start afresh in another directory"), "{e}");
        fs::write(dir.join(RUN_FILE), b"# ok\n\nlr = 2\n").unwrap();
        assert_eq!(
            RunSettings::read(&dir).unwrap().unwrap().get("lr"),
            Some("2")
        );
        let _ = fs::remove_dir_all(&dir);
    }

    proptest::proptest! {
        /// Any settings round-trip through the file; any text parses or is refused, without a
        /// panic.
        #[test]
        fn run_files_round_trip_and_any_text_is_read_or_refused(
            pairs in proptest::collection::vec(("[a-z][a-z0-9 =\n-]{0,8}", "\\PC{0,12}"), 0..6),
            text in "\\PC{0,64}(\n\\PC{0,16}){0,4}",
        ) {
            let settings = pairs
                .iter()
                .fold(RunSettings::new(), |s, (k, v)| s.with(k, v));
            proptest::prop_assert_eq!(RunSettings::parse(&settings.text()), Ok(settings));
            let _ = RunSettings::parse(&text);
        }
    }

    /// Rank 0's decisions: a fresh run records its settings and refuses a directory holding
    /// another run's checkpoints; a resume uses its own run's newest epoch, refuses other
    /// settings or an unrecorded run naming the difference, and is fine with nothing to do.
    #[test]
    fn rank_0_checks_that_the_checkpoints_are_this_runs() {
        let dir = scratch("decide");
        let mine = RunSettings::new().with("lr", 0.002);
        assert_eq!(decide(&ask(&dir, false, &mine), 2).unwrap(), None);
        let recorded = RunSettings::read(&dir).unwrap().unwrap();
        assert_eq!(recorded.get(WORLD_SIZE), Some("2"));
        assert_eq!(recorded.get(EPOCHS), Some("3"));

        checkpoint(&dir, 1);
        checkpoint(&dir, 2);
        assert_eq!(decide(&ask(&dir, true, &mine), 3).unwrap(), Some(2));
        assert_eq!(
            RunSettings::read(&dir).unwrap().unwrap().get(WORLD_SIZE),
            Some("3")
        );
        let fresh = decide(&ask(&dir, false, &mine), 2).unwrap_err().to_string();
        assert!(
            fresh.contains("earlier run") && fresh.contains("epoch 2"),
            "{fresh}"
        );

        let other = RunSettings::new().with("lr", 0.01);
        let err = decide(&ask(&dir, true, &other), 2).unwrap_err().to_string();
        assert!(err.contains("lr = 0.002 there, 0.01 here"), "{err}");

        // Finished: resumed, nothing to train (a warning), not refused.
        checkpoint(&dir, 3);
        assert_eq!(decide(&ask(&dir, true, &mine), 2).unwrap(), Some(3));

        fs::remove_file(dir.join(RUN_FILE)).unwrap();
        let err = decide(&ask(&dir, true, &mine), 2).unwrap_err().to_string();
        assert!(err.contains("no record of the run"), "{err}");
        fs::remove_dir_all(&dir).unwrap();
    }

    /// A job restarted by a launcher that did not count it (a Slurm requeue before
    /// SLURM_RESTART_COUNT was read, a scheduler we do not know) finds its own checkpoints by
    /// its job id and resumes; another job's are still refused.
    #[test]
    fn the_same_job_resumes_from_its_own_checkpoints() {
        let dir = scratch("own");
        let mine = RunSettings::new().with("lr", 0.002);
        let job = |j| StartAsk {
            job: Some(j),
            ..ask(&dir, false, &mine)
        };
        assert_eq!(decide(&job("slurm:41"), 2).unwrap(), None);
        assert_eq!(
            RunSettings::read(&dir).unwrap().unwrap().get(JOB),
            Some("slurm:41")
        );
        assert_eq!(own_job(&dir, Some("slurm:41")), None, "no checkpoint yet");
        checkpoint(&dir, 1);
        assert_eq!(own_job(&dir, Some("slurm:41")), Some(1));
        assert_eq!(own_job(&dir, Some("slurm:42")), None);
        assert_eq!(own_job(&dir, None), None);
        // The requeued job: not told to resume, resumes.
        assert_eq!(decide(&job("slurm:41"), 2).unwrap(), Some(1));
        // Another job: refused, as any fresh run into another run's directory.
        let err = decide(&job("slurm:42"), 2).unwrap_err().to_string();
        assert!(err.contains("earlier run"), "{err}");
        // Its own checkpoints with other settings: refused, not wiped.
        let other = RunSettings::new().with("lr", 0.01);
        let err = decide(
            &StartAsk {
                job: Some("slurm:41"),
                ..ask(&dir, false, &other)
            },
            2,
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("lr = 0.002 there, 0.01 here"), "{err}");
        assert_eq!(newest_complete(&dir), Some(1));
        fs::remove_dir_all(&dir).unwrap();
    }

    /// The decision is rank 0's on every rank; a refusal names rank 0 on the others.
    #[test]
    fn every_rank_gets_rank_0s_decision() {
        let dir = scratch("start");
        checkpoint(&dir, 1);
        // The record a run with these settings and a 10-parameter model writes.
        RunSettings::new()
            .with("lr", 1)
            .with(PARAMETERS, 10)
            .write(&dir)
            .unwrap();
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
                        // Only rank 0's settings and view of the directory count.
                        let lr = if pg.rank() == Rank(0) { 1 } else { 5 };
                        let settings = RunSettings::new().with("lr", lr);
                        let ok = start_epoch(&pg, &ask(&dir, true, &settings)).unwrap();
                        let other = RunSettings::new().with("lr", 2);
                        let err = start_epoch(&pg, &ask(&dir, true, &other)).unwrap_err();
                        (ok, err.to_string())
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (rank, (ok, err)) in results.into_iter().enumerate() {
            assert_eq!(ok, Some(1));
            assert!(err.contains("lr = 1 there, 2 here"), "{err}");
            if rank > 0 {
                assert!(err.contains("rank 0 failed"), "{err}");
            }
        }
        fs::remove_dir_all(&dir).unwrap();
    }
}
