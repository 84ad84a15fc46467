//! The Burn-free state of a line's `DdpStrategy` ([`StrategyState`], shared by the strategy's
//! clones) and its options and accessors, written once for every line
//! ([`strategy_options!`](crate::strategy_options)): the samplers whose epoch it sets, where
//! rank 0 writes checkpoints and whether a run resumes from them, the run's settings, the first
//! failure, the membership board and changes, the last epoch completed.

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use super::board::MembershipBoard;
use super::epoch::{self, ChangeLog, Cursor, Handover, SplitAt};
use super::files::{self, RecordFiles, SavedLog};
use super::metric_log::MetricLog;
use super::run::{self, RunSettings};
use super::vote::{FailureSlot, Split};
use crate::data::DataEpoch;
use crate::{ProcessGroup, Rank, Recovery, Result};

/// What a line's `DdpStrategy` keeps besides its Burn types (the session or `GradSync`, the
/// device): cloned with the strategy, its slots shared by the clones (burn-train runs a clone).
#[derive(Clone)]
pub struct StrategyState {
    pg: ProcessGroup,
    /// Where rank 0 writes checkpoints (`with_checkpoints`).
    pub checkpoints: Option<PathBuf>,
    /// How many epochs' checkpoints rank 0 keeps.
    pub keep: usize,
    /// Whether to resume from the newest complete checkpoint (`with_resume`).
    pub resume: bool,
    /// What makes a checkpoint this run's (`with_run_settings`).
    pub run: RunSettings,
    /// The samplers whose epoch the strategy sets (`with_sampler`).
    pub samplers: Vec<Arc<dyn DataEpoch>>,
    /// The first error that stopped training on this rank.
    pub failure: FailureSlot,
    /// A checkpoint rank 0 could not write (where the line's checkpointer reports it apart).
    pub written: FailureSlot,
    /// The epochs whose checkpoint rank 0 has written (its checkpointers' records go through
    /// it: `RecordFiles::with_log`).
    pub saved: SavedLog,
    /// The world size and the last change of membership, for rank 0's dashboard.
    pub board: MembershipBoard,
    /// The changes of membership of a fault-tolerant job, in order.
    pub changes: ChangeLog,
    /// The trained model's text, for the summary rank 0's progress lines print.
    pub model: crate::train::progress_text::ModelText,
    /// The training directory (`with_training_dir`), where the rank that is rank 0 of a
    /// fault-tolerant job writes the metrics.
    pub training_dir: Option<PathBuf>,
    /// A fault-tolerant job's metric lines on this process ([`MetricLog`]).
    pub metrics: MetricLog,
    /// The last epoch whose training and validation both ended (for the summary of a run that
    /// failed in the middle of the next).
    completed: Arc<AtomicUsize>,
}

impl std::fmt::Debug for StrategyState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StrategyState")
            .field("rank", &self.pg.rank())
            .field("world_size", &self.pg.world_size())
            .field("checkpoints", &self.checkpoints)
            .field("resume", &self.resume)
            .field("samplers", &self.samplers.len())
            .finish_non_exhaustive()
    }
}

impl StrategyState {
    /// The state of a strategy on `pg`: no samplers, no checkpoints (2 kept once set), no
    /// resume, no run settings.
    pub fn new(pg: &ProcessGroup) -> Self {
        Self {
            saved: SavedLog::default(),
            board: MembershipBoard::at_start(pg),
            pg: pg.clone(),
            checkpoints: None,
            keep: 2,
            resume: false,
            run: RunSettings::new(),
            samplers: Vec::new(),
            failure: FailureSlot::default(),
            written: FailureSlot::default(),
            changes: ChangeLog::default(),
            model: Default::default(),
            completed: Arc::default(),
            training_dir: None,
            metrics: MetricLog::default(),
        }
    }

    /// Where a fault-tolerant job's rank 0 writes the metrics: the training directory given
    /// to `with_training_dir`, else the one that holds the checkpoint directory given to
    /// `with_checkpoints` (Burn's layout, `{dir}/checkpoint`), else none (then only the
    /// process that starts as rank 0 writes them, through Burn's own logger).
    pub fn metric_dir(&self) -> Option<PathBuf> {
        (self.training_dir.clone())
            .or_else(|| Some(self.checkpoints.as_ref()?.parent()?.to_path_buf()))
    }

    /// The group the strategy trains on.
    pub fn group(&self) -> &ProcessGroup {
        &self.pg
    }

    /// This process's rank (which may change in a fault-tolerant job).
    pub fn rank(&self) -> Rank {
        self.pg.rank()
    }

    /// Whether this is rank 0, which shows the dashboard, writes the metrics and checkpoints.
    pub fn is_main(&self) -> bool {
        self.rank() == Rank::ZERO
    }

    /// Where the split `split` of `cursor`'s epoch runs ([`epoch::run_split`]): on this
    /// group, recording a failure in [`failure`](Self::failure); in a fault-tolerant job
    /// (`fault_tolerant`) the cursor moves with the steps and the first step after a change
    /// of membership is reported.
    pub fn split_at<'a>(
        &'a self,
        split: Split,
        cursor: &'a mut Cursor,
        fault_tolerant: bool,
    ) -> SplitAt<'a> {
        SplitAt {
            pg: &self.pg,
            split,
            epoch: cursor.epoch,
            failure: &self.failure,
            cursor: fault_tolerant.then_some(cursor),
            changes: fault_tolerant.then_some(&self.changes),
        }
    }

    /// Whether training resumes from the newest complete checkpoint: when asked to, and
    /// always in a group restarted by `burn-ddp run --max-restarts` (or torchrun's).
    pub fn resumes(&self) -> bool {
        self.resume || self.pg.restart_count() > 0
    }

    /// The samplers whose epoch the strategy sets: those given to `with_sampler`, and the
    /// group's training samplers (made by a line's `DistributedSampler::new` on it,
    /// [`data::training_plans`](crate::data::training_plans)).
    fn samplers(&self) -> Vec<Arc<dyn DataEpoch>> {
        let mut all = self.samplers.clone();
        all.extend(crate::data::training_plans(&self.pg));
        all
    }

    /// The job's progress through a split, from this rank's loader (`processed` of `total`
    /// items): every rank has as many items, or one fewer, by the sampler's construction.
    /// Counted once each when the split's sampler knows the epoch's items (burn-ddp's
    /// `DistributedSampler`): not the padding that evens out the training shards, nor the
    /// ranks with one item fewer in an evaluation; else `counted` (every rank's items, when the
    /// line counted them), else this rank's times the world size. In a fault-tolerant job the
    /// step says how far the split is, every rank's items counted once
    /// ([`StepAt::done`](super::epoch::StepAt::done)): that count is the progress, not capped,
    /// so that an item trained twice would show as more items than the epoch has.
    /// `(done, total)`.
    pub fn job_progress(
        &self,
        (processed, total): (usize, usize),
        step_done: Option<u64>,
        counted: Option<usize>,
    ) -> (usize, usize) {
        let w = self.pg.world_size().as_usize();
        let done = processed.saturating_mul(w);
        let exact = step_done.map(|d| usize::try_from(d).unwrap_or(usize::MAX));
        match crate::data::items_of_share(&self.pg, total).or(counted) {
            Some(n) => (exact.unwrap_or(done.min(n)), n),
            None => (exact.unwrap_or(done), total.saturating_mul(w)),
        }
    }

    /// Every sampler at `epoch` (from 1).
    pub fn set_epoch(&self, epoch: usize) {
        for s in self.samplers() {
            s.set_epoch(epoch as u64);
        }
    }

    /// The samplers before the split at `cursor`: in a fault-tolerant job they deal the rest of
    /// the epoch over the current membership, and the line must slice its loader anew (a
    /// multi-threaded loader splits its dataset once): `true`; elsewhere they take the epoch at
    /// the start of its training: `false`.
    ///
    /// # Errors
    /// A sampler that cannot be dealt again ([`epoch::deal`]).
    pub fn before_split(&self, cursor: &Cursor, fault_tolerant: bool) -> Result<bool> {
        if fault_tolerant {
            epoch::deal(&self.samplers(), &self.pg, cursor)?;
            return Ok(true);
        }
        if cursor.phase == epoch::Phase::Train {
            self.set_epoch(cursor.epoch);
        }
        Ok(false)
    }

    /// The checkpoint epoch to resume after, the same on every rank: `explicit`, else (when
    /// [`resumes`](Self::resumes)) the newest complete checkpoint rank 0 finds, once rank 0 has
    /// checked that it belongs to this run ([`run::start_epoch`]). Collective.
    ///
    /// # Errors
    /// As [`run::start_epoch`].
    fn start_epoch(
        &self,
        explicit: Option<usize>,
        epochs: usize,
        parameters: usize,
    ) -> Result<Option<usize>> {
        let job = crate::config::env::run_id();
        run::start_epoch(
            &self.pg,
            &run::StartAsk {
                explicit,
                dir: self.checkpoints.as_deref(),
                resume: self.resumes(),
                epochs,
                parameters,
                settings: &self.run,
                job: job.as_deref(),
            },
        )
    }

    /// The epoch this rank's training starts at. 1 for a process `admitted` to a running
    /// fault-tolerant job: it takes the state and the place of the job from a rank that has them
    /// when the epoch loop starts. Otherwise every rank agrees on the checkpoint epoch to resume
    /// after (`explicit`, else the newest complete checkpoint that belongs to this run, checked
    /// by rank 0: [`run::start_epoch`]); `ready` restores it when there is one (its argument) and
    /// prepares the model (checked across ranks, rank 0's weights loaded everywhere); the board
    /// and the log say which epoch was resumed; training starts at the epoch after it, or at 1.
    /// Collective, except when admitted.
    ///
    /// # Errors
    /// As [`run::start_epoch`], and what `ready` returns.
    pub fn start(
        &self,
        admitted: bool,
        explicit: Option<usize>,
        epochs: usize,
        parameters: usize,
        ready: impl FnOnce(Option<usize>) -> Result<()>,
    ) -> Result<usize> {
        if admitted {
            return Ok(1);
        }
        let epoch = self.start_epoch(explicit, epochs, parameters)?;
        ready(epoch)?;
        Ok(match epoch {
            Some(epoch) => {
                self.resumed(epoch);
                epoch + 1
            }
            None => 1,
        })
    }

    /// The files of the checkpoint record `name` (`model`, `optim`, `scheduler`) to restore
    /// `epoch` from.
    ///
    /// # Errors
    /// No checkpoint directory was given ([`files::no_directory`]).
    pub fn record_files(&self, name: &'static str, epoch: usize) -> Result<RecordFiles> {
        let Some(dir) = &self.checkpoints else {
            return Err(files::no_directory(epoch, "DdpStrategy::with_checkpoints"));
        };
        Ok(RecordFiles::new(dir.clone(), name, self.pg.clone()))
    }

    /// Training resumed from the checkpoint of `epoch`: the board and the log say so.
    fn resumed(&self, epoch: usize) {
        self.board.resumed(epoch);
        tracing::info!(
            "[rank {}] resumed from the checkpoint of epoch {epoch}",
            self.rank()
        );
    }

    /// The epoch loops of a Learner run from `start` to `epochs` ([`epoch::fit`], or
    /// [`epoch::fit_fault_tolerant`] in a fault-tolerant job, where `admission` is this
    /// process's entry into the running job), then the end of training: the driver closed
    /// ([`close`](epoch::EpochDriver::close): rank 0's last checkpoint written), in a
    /// fault-tolerant job the samplers' whole epoch dealt over the last membership again (for
    /// what the program does after training, an evaluation over the validation data), and the
    /// last vote ([`epoch::last_vote`]), so that a checkpoint rank 0 could not write fails
    /// every rank. Returns where training ended.
    pub fn fit<D: Handover + ?Sized>(
        &self,
        driver: &mut D,
        start: usize,
        epochs: usize,
        admission: Option<Recovery>,
    ) -> Cursor {
        let fault_tolerant = self.pg.is_fault_tolerant();
        let cursor = if fault_tolerant {
            epoch::fit_fault_tolerant(driver, start, epochs, admission)
        } else {
            epoch::fit(driver, start, epochs)
        };
        self.completed.store(cursor.completed(), Ordering::Relaxed);
        let last = driver.close();
        if fault_tolerant {
            let whole = Cursor::start(cursor.epoch.min(epochs));
            if let Err(e) = epoch::deal(&self.samplers(), &self.pg, &whole) {
                tracing::warn!(
                    "[rank {}] re-dealing the data after training: {e}",
                    self.rank()
                );
            }
        }
        let agreed = epoch::last_vote(&self.pg, &last, &self.failure, fault_tolerant, |m| {
            driver.interrupt(m);
        });
        // The metric lines rank 0 held back while it could not tell whether its membership
        // stood are the job's: every rank of it agreed on the end.
        if fault_tolerant && agreed {
            self.metrics.settle(self.is_main());
        }
        cursor
    }

    /// Burn's summary of the run, cut to what it may show: all of it when training did not
    /// fail; else the epochs it completed (Burn counts the highest epoch whose metric logs it
    /// finds, and the epoch the run failed in has logs): `epochs` (the summary's count) lowered
    /// to them, and in each of `splits` (a split's metrics, with their `entries` and each
    /// entry's `step`, its epoch) only their entries kept, and the metrics left without any
    /// dropped. Returns false, for no summary, when the failed run completed no epoch.
    pub fn trim_summary<M, E>(
        &self,
        epochs: &mut usize,
        splits: [&mut Vec<M>; 2],
        entries: impl Fn(&mut M) -> &mut Vec<E>,
        step: impl Fn(&E) -> usize,
    ) -> bool {
        if self.failure.message().is_none() {
            return true;
        }
        let done = self.completed.load(Ordering::Relaxed);
        if done == 0 {
            return false;
        }
        *epochs = (*epochs).min(done);
        for split in splits {
            for metric in split.iter_mut() {
                entries(metric).retain(|e| step(e) <= done);
            }
            split.retain_mut(|m| !entries(m).is_empty());
        }
        true
    }
}

/// The options and accessors of a line's `DdpStrategy` over its [`StrategyState`] field, with
/// their documentation, written once for every line: `with_sampler`, `with_checkpoints`,
/// `with_run_settings`, `with_resume`, `membership_changes`, `membership_board`, `failure`,
/// `is_main`.
///
/// ```ignore
/// burn_ddp_comm::strategy_options!(DdpStrategy<B: Backend>, state);
/// burn_ddp_comm::strategy_options!(DdpStrategy, state);
/// ```
#[macro_export]
macro_rules! strategy_options {
    ($name:ident $(< $g:ident : $bound:path >)?, $state:ident) => {
        impl $(<$g: $bound>)? $name $(<$g>)? {
            /// A sampler whose epoch the strategy sets at the start of every epoch, shared with
            /// its data loader through an `Arc`. Not needed for a `DistributedSampler::new` of
            /// the strategy's process group: the strategy finds those itself. Needed for the
            /// others (a sampler of your own, one of `with_replicas`, and, in a fault-tolerant
            /// job, the validation sampler, which is dealt again over a new membership).
            pub fn with_sampler(
                mut self,
                sampler: std::sync::Arc<dyn $crate::data::DataEpoch>,
            ) -> Self {
                self.$state.samplers.push(sampler);
                self
            }

            /// Rank 0 writes a checkpoint (model, optimizer, scheduler) at the end of every
            /// epoch into `dir` — `model-{epoch}.bin`, `optim-{epoch}.bin`,
            /// `scheduler-{epoch}.bin`, each renamed into place once complete — keeping the
            /// newest `keep` epochs.
            pub fn with_checkpoints(
                mut self,
                dir: impl Into<std::path::PathBuf>,
                keep: usize,
            ) -> Self {
                self.$state.checkpoints = Some(dir.into());
                self.$state.keep = keep.max(1);
                self
            }

            /// The training directory the program gives Burn (`SupervisedTraining::new(dir, ..)`,
            /// which keeps it to itself): in a fault-tolerant job, the process that becomes
            /// rank 0 writes the metrics there (all of them: every rank computes every step's
            /// metrics). Needed only when the checkpoints given to `with_checkpoints` are not
            /// in its `checkpoint/` directory; without either, only the process that starts as
            /// rank 0 writes metrics.
            pub fn with_training_dir(mut self, dir: impl Into<std::path::PathBuf>) -> Self {
                self.$state.training_dir = Some(dir.into());
                self
            }

            /// The settings that make a checkpoint this run's (learning rate, batch size,
            /// data, seed: whatever a resume must not change), recorded by rank 0 in the
            /// checkpoint directory (`run.txt`) with the model's number of parameters, the
            /// world size and the number of epochs. A resume whose settings or model differ is
            /// refused, naming each difference; a world size or a number of epochs that differ
            /// are allowed (and said). A fresh run refuses a directory that holds another
            /// run's checkpoints.
            pub fn with_run_settings(mut self, settings: $crate::train::run::RunSettings) -> Self {
                self.$state.run = settings;
                self
            }

            /// Whether to resume from the newest complete checkpoint in the checkpoint
            /// directory (default `false`, but a group restarted by `burn-ddp run
            /// --max-restarts` always resumes; an explicit `SupervisedTraining::checkpoint(epoch)`
            /// wins).
            pub fn with_resume(mut self, resume: bool) -> Self {
                self.$state.resume = resume;
                self
            }

            /// In a fault-tolerant job (`burn-ddp run --fault-tolerant`), the changes of
            /// membership training went through on this rank, in order: who left and joined,
            /// the new world size, why, how long the change took.
            pub fn membership_changes(&self) -> Vec<$crate::Recovery> {
                self.$state.changes.changes()
            }

            /// What rank 0's dashboard shows about the job's membership (its world size and
            /// round, or the last change of a fault-tolerant job's; empty in a job whose
            /// membership cannot change and that was not restarted): for a renderer of the
            /// program's own, wrap it in `WithMembership` with this board.
            pub fn membership_board(&self) -> &$crate::train::board::MembershipBoard {
                &self.$state.board
            }

            /// The error that stopped training, if any (also returned by `launch_ddp`).
            pub fn failure(&self) -> Option<String> {
                self.$state.failure.message()
            }

            /// Whether this is rank 0, which shows the dashboard, writes the metrics and
            /// checkpoints (in a fault-tolerant job, rank 0 may change).
            pub fn is_main(&self) -> bool {
                self.$state.is_main()
            }
        }
    };
}

/// The part of a line's `DdpStrategy` documentation that holds on every line (data, metrics,
/// checkpoints, the schedule, stops, fault tolerance), for `#[doc = strategy_docs!()]` under the
/// line's own paragraphs.
#[macro_export]
macro_rules! strategy_docs {
    () => {
        concat!(
            "- **Data**: build the training loader over a [`DistributedSampler::new`](super::DistributedSampler::new)\n",
            "  of the strategy's group (without the loader's own `shuffle`): the strategy sets its epoch\n",
            "  (other samplers: [`with_sampler`](Self::with_sampler)).\n",
            "- **Metrics**: rank 0's dashboard shows the whole job (losses averaged over the global batch,\n",
            "  accuracy over it, item counts summed); progress counts every rank's items.\n",
            "- **Checkpoints** ([`with_checkpoints`](Self::with_checkpoints)): written by rank 0 alone,\n",
            "  atomically, model + optimizer + scheduler per epoch; [`with_resume`](Self::with_resume)\n",
            "  restarts from the newest complete one, which rank 0 reads and sends to every rank. A\n",
            "  checkpoint rank 0 cannot write fails the job, naming the file.\n",
            "- **LR schedule**: one scheduler step per optimizer step (every rank steps together).\n",
            "- **Stopping**: a dashboard quit, an early stop (decided on rank 0, which has the metrics),\n",
            "  a data error or a failed rank stops every rank at the same step.\n",
            "- **Fault tolerance** (`burn-ddp run --fault-tolerant`): a lost rank does not stop the job;\n",
            "  the others agree on a new membership and go on from the step they were at, and a process\n",
            "  that joins takes the Learner's state from a rank that has it\n",
            "  ([`membership_changes`](Self::membership_changes)).\n",
        )
    };
}

#[cfg(test)]
mod tests {
    use crate::error::ConfigError;
    use std::cell::Cell;

    use super::*;

    #[test]
    fn the_strategy_sets_the_epoch_of_its_groups_training_samplers_and_no_others() {
        use crate::data::ShardPlan;
        let pg = ProcessGroup::single();
        let other = ProcessGroup::single();
        let train = ShardPlan::new(&pg);
        let valid = ShardPlan::evaluation(&pg);
        let elsewhere = ShardPlan::new(&other);
        let given = Arc::new(ShardPlan::evaluation(&pg));
        let mut state = StrategyState::new(&pg);
        state.samplers.push(given.clone());
        state.set_epoch(3);
        assert_eq!(train.epoch(), 3, "a DistributedSampler::new of the group");
        assert_eq!(given.epoch(), 3, "a sampler given to with_sampler");
        assert_eq!(valid.epoch(), 0, "an evaluation sampler is dealt once");
        assert_eq!(elsewhere.epoch(), 0, "a sampler of another group");
        drop(train);
        assert_eq!(
            crate::data::training_plans(&pg).len(),
            0,
            "a dropped sampler is gone"
        );
        assert_eq!(crate::data::training_plans(&other).len(), 1);
    }

    #[test]
    fn an_admitted_process_starts_at_epoch_1_without_restoring_or_preparing() {
        let state = StrategyState::new(&ProcessGroup::single());
        let called = Cell::new(false);
        let start = state.start(true, Some(4), 10, 100, |_| {
            called.set(true);
            Ok(())
        });
        assert_eq!(start.unwrap(), 1);
        assert!(
            !called.get(),
            "an admitted process takes the state of a running rank"
        );
    }

    #[test]
    fn a_fresh_run_prepares_and_starts_at_epoch_1() {
        let state = StrategyState::new(&ProcessGroup::single());
        let mut asked = Vec::new();
        let start = state.start(false, None, 10, 100, |epoch| {
            asked.push(epoch);
            Ok(())
        });
        assert_eq!(start.unwrap(), 1);
        assert_eq!(asked, vec![None]);
    }

    #[test]
    fn a_resumed_run_restores_the_epoch_and_starts_after_it() {
        let state = StrategyState::new(&ProcessGroup::single());
        let mut asked = Vec::new();
        let start = state.start(false, Some(3), 10, 100, |epoch| {
            asked.push(epoch);
            Ok(())
        });
        assert_eq!(start.unwrap(), 4);
        assert_eq!(asked, vec![Some(3)]);
    }

    /// A split's metric in Burn's summary: its entries as epochs.
    struct Metric(Vec<usize>);

    fn trimmed(state: &StrategyState, epochs: &mut usize, splits: &mut [Vec<Metric>; 2]) -> bool {
        let [train, valid] = splits;
        state.trim_summary(epochs, [train, valid], |m| &mut m.0, |e| *e)
    }

    #[test]
    fn the_summary_of_a_run_that_did_not_fail_is_whole() {
        let state = StrategyState::new(&ProcessGroup::single());
        let (mut epochs, mut splits) = (3, [vec![Metric(vec![1, 2, 3])], vec![]]);
        assert!(trimmed(&state, &mut epochs, &mut splits));
        assert_eq!((epochs, splits[0][0].0.len()), (3, 3));
    }

    #[test]
    fn the_summary_of_a_failed_run_keeps_the_epochs_it_completed() {
        let state = StrategyState::new(&ProcessGroup::single());
        state
            .failure
            .fail(crate::DdpError::Config(ConfigError::InvalidConfig {
                field: "f",
                reason: "lost",
            }));
        let splits = || {
            [
                vec![Metric(vec![1, 2, 3]), Metric(vec![3])],
                vec![Metric(vec![3])],
            ]
        };
        let (mut epochs, mut none) = (3, splits());
        assert!(
            !trimmed(&state, &mut epochs, &mut none),
            "no epoch completed"
        );
        state.completed.store(2, Ordering::Relaxed);
        let mut kept = splits();
        assert!(trimmed(&state, &mut epochs, &mut kept));
        assert_eq!(epochs, 2);
        let entries = |s: &[Metric]| s.iter().map(|m| m.0.clone()).collect::<Vec<_>>();
        assert_eq!(entries(&kept[0]), [vec![1, 2]]);
        assert!(kept[1].is_empty());
    }

    #[test]
    fn a_failure_to_restore_or_prepare_is_returned() {
        let state = StrategyState::new(&ProcessGroup::single());
        let err = state
            .start(false, Some(3), 10, 100, |_| {
                Err(files::no_directory(3, "DdpStrategy::with_checkpoints"))
            })
            .unwrap_err();
        assert!(err.to_string().contains("with_checkpoints"), "{err}");
    }
}
