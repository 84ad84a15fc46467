//! [`DdpStrategy`]'s run on burn-train (0.22, 0.23) as the core's epoch loop drives it
//! (burn-ddp-comm's `train::epoch::fit`): each split over the Learner's loaders
//! (`splits.rs`) between burn-train's split events, the end of an epoch (rank 0's checkpoint
//! and early stop, then every rank's vote), and in a fault-tolerant job the Learner's state
//! moved after a change of membership (`handover.rs`).

use std::sync::MutexGuard;
use std::time::Instant;

use burn::data::dataloader::{DataLoader, Progress};
use burn::optim::GradientsAccumulator;
use burn::train::metric::store::EventStoreClient;
use burn::train::{
    CloneEarlyStoppingStrategy, EventProcessorTraining, Interrupter, Learner, LearnerEvent,
    LearnerModel, LearningCheckpointer, SupervisedTrainingEventProcessor, TrainLoader,
    TrainingComponents, ValidLoader,
};
use burn_ddp_comm::group::handover::RecordSlot;
use burn_ddp_comm::train::epoch::{self, Cursor, Ended, EpochDriver, Handover};
use burn_ddp_comm::train::files::{RecordFiles, SavedLog, PARTS};
use burn_ddp_comm::train::vote::{self, FailureSlot, Split, Vote};
use burn_ddp_comm::Recovery;

use super::handover;
use super::splits::{interrupted, SplitParts, TrainOut, TrainSplit, ValidOut, ValidSplit};
use super::{DdpStrategy, DistributedItem};
use crate::{GradSync, ProcessGroup, ReduceOp, Result};

/// One run of [`DdpStrategy`]'s `fit`: the Learner, its loaders and its components.
pub(super) struct Run<'s, M: LearnerModel> {
    pub(super) strategy: &'s DdpStrategy,
    pub(super) sync: MutexGuard<'s, GradSync>,
    pub(super) learner: Learner<M>,
    pub(super) train: TrainLoader<M>,
    pub(super) valid: ValidLoader<M>,
    pub(super) processor: SupervisedTrainingEventProcessor<M>,
    pub(super) checkpointer: Option<LearningCheckpointer<M>>,
    pub(super) early_stopping: Option<Box<dyn CloneEarlyStoppingStrategy>>,
    pub(super) interrupter: Interrupter,
    pub(super) store: std::sync::Arc<EventStoreClient>,
    pub(super) accumulation: Option<usize>,
    /// Every rank's items of the training and the validation split, counted at the start of a
    /// job whose membership does not change.
    pub(super) totals: Option<[usize; 2]>,
    /// The epoch burn-train's event processor (and so rank 0's progress lines) is at.
    pub(super) shown: usize,
    /// A sharded model's checkpoint files (model, optimizer, scheduler), written at every
    /// epoch's end by every rank's part ([`DdpStrategy::fsdp`]).
    pub(super) fsdp_files: Option<[RecordFiles; 3]>,
}

/// The loader of a split at `cursor`, sliced anew when the samplers were re-dealt
/// (burn-ddp-comm's `StrategyState::before_split`).
fn loader_at<I: 'static>(
    strategy: &DdpStrategy,
    loader: &std::sync::Arc<dyn DataLoader<I>>,
    cursor: &Cursor,
    fault_tolerant: bool,
) -> Result<std::sync::Arc<dyn DataLoader<I>>> {
    Ok(if strategy.state.before_split(cursor, fault_tolerant)? {
        loader.slice(0, loader.num_items())
    } else {
        loader.clone()
    })
}

/// burn-train's event for the end of a split of `total` items at `epoch` that `ended`: `last`,
/// the job's progress at its last step (none taken: none of its items).
fn end_event<T>(
    epoch: usize,
    last: Option<Progress>,
    total: usize,
    ended: &Ended,
) -> LearnerEvent<T> {
    let last = last.unwrap_or_else(|| crate::release::progress(0, Some(total), None));
    crate::release::end_split(epoch, last, matches!(ended, Ended::Done))
}

impl<M: LearnerModel> Run<'_, M> {
    /// A split's count of every rank's items for burn-train's events
    /// ([`StrategyState::job_progress`](burn_ddp_comm::train::strategy::StrategyState)): the
    /// epoch's items once each, else counted at the start, else (a fault-tolerant job) this
    /// rank's share times the world size.
    fn total(&self, split: usize, mine: usize) -> usize {
        let counted = self.totals.map(|t| t[split]);
        self.strategy.state.job_progress((0, mine), None, counted).1
    }

    /// Tells burn-train's event processor that the epochs before `epoch` ended, when it was
    /// not told: a rank left out of a fault-tolerant job that joins it again resumes at the
    /// job's epoch, which may be later than the one it was in (its progress lines, as rank 0,
    /// would name that one).
    fn show_epoch(&mut self, epoch: usize) {
        if self.shown != epoch && epoch > 0 {
            self.interrupter.fail_on_error(
                self.processor
                    .process_train(LearnerEvent::EndEpoch(epoch - 1)),
            );
            self.shown = epoch;
        }
    }
}

impl<M> EpochDriver for Run<'_, M>
where
    M: LearnerModel,
    TrainOut<M>: DistributedItem,
    ValidOut<M>: DistributedItem,
{
    fn group(&self) -> &ProcessGroup {
        self.strategy.group()
    }

    fn failure(&self) -> &FailureSlot {
        &self.strategy.state.failure
    }

    fn saved(&self) -> &SavedLog {
        &self.strategy.state.saved
    }

    fn train(&mut self, cursor: &mut Cursor, fault_tolerant: bool) -> Ended {
        let epoch = cursor.epoch;
        self.show_epoch(epoch);
        let loader = match loader_at(self.strategy, &self.train, cursor, fault_tolerant) {
            Ok(loader) => loader,
            Err(e) => {
                self.stop_with(e);
                return Ended::Stop;
            }
        };
        let total = self.total(0, loader.num_items());
        let start = crate::release::start_split(epoch, total);
        self.interrupter
            .fail_on_error(self.processor.process_train(start));
        let Run {
            strategy,
            sync,
            learner,
            processor,
            interrupter,
            accumulation,
            totals,
            ..
        } = self;
        let mut split = TrainSplit {
            parts: SplitParts {
                strategy,
                processor,
                interrupter,
                total: totals.map(|t| t[0]),
                everywhere: fault_tolerant,
                last: None,
            },
            learner,
            sync,
            iter: loader.iter(),
            accumulation: *accumulation,
            accumulator: GradientsAccumulator::<M>::new(),
            accumulated: 0,
            item: None,
        };
        let at = strategy
            .state
            .split_at(Split::Training, cursor, fault_tolerant);
        let ended = epoch::run_split(&mut split, at);
        let last = split.parts.last.take();
        drop(split);
        // A change of membership ends the split's loop, not the split: the rest of the epoch
        // follows, and the epoch's metrics go on.
        if !matches!(ended, Ended::Change(_)) {
            let end = end_event(epoch, last, total, &ended);
            interrupter.fail_on_error(processor.flush());
            interrupter.fail_on_error(processor.process_train(end));
        }
        ended
    }

    fn valid(&mut self, cursor: &mut Cursor, fault_tolerant: bool) -> Ended {
        let epoch = cursor.epoch;
        self.show_epoch(epoch);
        let loader = match loader_at(self.strategy, &self.valid, cursor, fault_tolerant) {
            Ok(loader) => loader,
            Err(e) => {
                self.stop_with(e);
                return Ended::Stop;
            }
        };
        let total = self.total(1, loader.num_items());
        let start = crate::release::start_split(epoch, total);
        self.interrupter
            .fail_on_error(self.processor.process_valid(start));
        let strategy = self.strategy;
        let mut split = ValidSplit {
            parts: SplitParts {
                strategy,
                processor: &mut self.processor,
                interrupter: &self.interrupter,
                total: self.totals.map(|t| t[1]),
                everywhere: fault_tolerant,
                last: None,
            },
            model: self.learner.model().valid(),
            iter: loader.iter(),
            item: None,
        };
        let at = strategy
            .state
            .split_at(Split::Validation, cursor, fault_tolerant);
        let ended = epoch::run_split(&mut split, at);
        let last = split.parts.last.take();
        drop(split);
        if matches!(ended, Ended::Change(_)) {
            return ended;
        }
        let end = end_event(epoch, last, total, &ended);
        let p = &mut self.processor;
        self.interrupter.fail_on_error(p.flush());
        self.interrupter.fail_on_error(p.process_valid(end));
        self.interrupter
            .fail_on_error(p.process_train(LearnerEvent::EndEpoch(epoch)));
        self.shown = epoch + 1;
        ended
    }

    fn every_rank_epoch_end(&mut self, epoch: usize) -> Result<()> {
        let (Some(fsdp), Some(files)) = (&self.strategy.fsdp, &self.fsdp_files) else {
            return Ok(());
        };
        let keep = self.strategy.state.keep;
        super::fsdp::checkpoint(fsdp, &self.learner, epoch, &self.store, files, keep)
    }

    fn main_epoch_end(&mut self, epoch: usize) -> bool {
        if self.checkpointer.is_some() || self.early_stopping.is_some() {
            // The metrics of this epoch, for the checkpointing strategy and the early stop.
            self.interrupter.fail_on_error(self.processor.flush());
        }
        if let Some(c) = &mut self.checkpointer {
            c.checkpoint(&self.learner, epoch, &self.store);
        }
        (self.early_stopping.as_mut()).is_some_and(|es| es.should_stop(epoch, &self.store))
    }

    fn interrupted(&self) -> Option<Vote> {
        self.interrupter
            .should_stop()
            .then(|| interrupted(&self.interrupter))
    }

    fn interrupt(&self, message: &str) {
        self.interrupter.stop(Some(message));
    }

    fn close(&mut self) -> Vote {
        // Dropping the checkpointer waits for rank 0's last write.
        drop(self.checkpointer.take());
        self.interrupter
            .error()
            .map_or(Vote::Item, |e| Vote::Failed(e.to_string()))
    }
}

impl<M> Handover for Run<'_, M>
where
    M: LearnerModel,
    TrainOut<M>: DistributedItem,
    ValidOut<M>: DistributedItem,
{
    fn save_records(&mut self, epoch: usize, slots: &[RecordSlot; 3]) {
        handover::save_records(&self.learner, epoch, &self.store, slots);
    }

    fn load_records(&mut self, records: [Vec<u8>; 3]) -> Result<()> {
        // The metrics of the epoch under way were processed elsewhere until now.
        self.strategy.state.metrics.took_state();
        handover::load_records(&mut self.learner, records, self.strategy.rank())
    }

    fn reprepare(&mut self) -> Result<()> {
        let model = self.sync.reprepare(self.learner.model())?;
        self.learner.load_model(model.into_record());
        Ok(())
    }

    fn changed(&mut self, rec: Recovery, cursor: &Cursor, began: Instant) {
        let ddp = self.strategy;
        ddp.state
            .changes
            .changed(rec, cursor, began, &ddp.state.board, ddp.is_main());
    }
}

impl DdpStrategy {
    /// The epoch loops from `starting_epoch` (burn-ddp-comm's `train::epoch::fit`): training,
    /// validation, the end of each epoch. In a fault-tolerant job, a failure of the group (or a
    /// process asking to join, or this process's `admission` into the running job) changes the
    /// membership, moves the state to the ranks behind, re-deals the rest of the epoch over the
    /// new ranks, and goes on from where the ranks are (no restart, no checkpoint reload).
    /// Elsewhere a failure stops training.
    pub(super) fn fit_from<M>(
        &self,
        components: TrainingComponents<M>,
        learner: Learner<M>,
        dataloader_train: TrainLoader<M>,
        dataloader_valid: ValidLoader<M>,
        starting_epoch: usize,
        admission: Option<Recovery>,
    ) -> (M, SupervisedTrainingEventProcessor<M>)
    where
        M: LearnerModel,
        TrainOut<M>: DistributedItem,
        ValidOut<M>: DistributedItem,
    {
        let ft = self.group().is_fault_tolerant();
        let train = dataloader_train.to_device(&self.device);
        let valid = dataloader_valid.to_device(&self.device.clone().inner());
        let interrupter = components.interrupter;
        // Every rank's items, for the progress of the whole job (a collective: not in a
        // fault-tolerant job, where a joining process starts here while the others train).
        let totals = if ft {
            None
        } else {
            let mut totals = [train.num_items() as i64, valid.num_items() as i64];
            if let Err(e) = self.group().all_reduce(&mut totals, ReduceOp::Sum) {
                vote::stop_with(e, &self.state.failure, |m| interrupter.stop(Some(m)));
                return (learner.model(), components.event_processor);
            }
            Some(totals.map(|t| t as usize))
        };
        let epochs = components.num_epochs;
        let fsdp_files = (self.fsdp.as_ref())
            .and(self.state.checkpoints.as_ref())
            .map(|dir| {
                PARTS.map(|name| {
                    let files = RecordFiles::new(dir.clone(), name, self.group().clone());
                    files.with_log(self.state.saved.clone())
                })
            });
        let mut run = Run {
            strategy: self,
            sync: self.lock_sync(),
            learner,
            train,
            valid,
            processor: components.event_processor,
            checkpointer: components.checkpointer,
            early_stopping: components.early_stopping,
            interrupter,
            store: components.event_store,
            accumulation: components.grad_accumulation,
            totals,
            shown: starting_epoch,
            fsdp_files,
        };
        self.state.fit(&mut run, starting_epoch, epochs, admission);
        let Run {
            learner,
            processor,
            interrupter,
            ..
        } = run;
        let model = learner.model();
        // A sharded model is handed back whole (every rank gathers it), unless training
        // failed: then as this rank's shards.
        let model = match &self.fsdp {
            Some(fsdp) if self.state.failure.message().is_none() => match fsdp.full_model(&model) {
                Ok(whole) => whole,
                Err(e) => {
                    vote::stop_with(e, &self.state.failure, |m| interrupter.stop(Some(m)));
                    model
                }
            },
            _ => model,
        };
        (model, processor)
    }
}
