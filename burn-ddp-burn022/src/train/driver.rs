//! [`DdpStrategy`]'s run on burn-train 0.22 as the core's epoch loop drives it
//! (burn-ddp-comm's `train::epoch::fit`): each split over the Learner's loaders
//! (`splits.rs`) between burn-train's split events, and the end of an epoch (rank 0's
//! checkpoint and early stop, then every rank's vote).

use std::sync::atomic::Ordering;
use std::sync::MutexGuard;

use burn::optim::GradientsAccumulator;
use burn::train::metric::store::EventStoreClient;
use burn::train::{
    CloneEarlyStoppingStrategy, EventProcessorTraining, Interrupter, Learner, LearnerEvent,
    LearnerModel, LearningCheckpointer, SupervisedTrainingEventProcessor, TrainLoader, ValidLoader,
};
use burn_ddp_comm::train::epoch::{self, Cursor, Ended, EpochDriver, SplitAt};
use burn_ddp_comm::train::vote::{Split, Vote};

use super::splits::{interrupted, SplitParts, TrainOut, TrainSplit, ValidOut, ValidSplit};
use super::{DdpStrategy, DistributedItem};
use crate::{DdpError, GradSync, ProcessGroup};

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
    /// Every rank's items of the training and the validation split.
    pub(super) totals: [usize; 2],
}

impl<M> EpochDriver for Run<'_, M>
where
    M: LearnerModel,
    TrainOut<M>: DistributedItem,
    ValidOut<M>: DistributedItem,
{
    fn group(&self) -> &ProcessGroup {
        &self.strategy.pg
    }

    fn train(&mut self, cursor: &mut Cursor, _fault_tolerant: bool) -> Ended {
        let epoch = cursor.epoch;
        self.strategy.set_epoch(epoch);
        let start = LearnerEvent::StartSplit {
            epoch_number: epoch,
            total_items: self.totals[0],
        };
        self.interrupter
            .fail_on_error(self.processor.process_train(start));
        let loader = self.train.clone();
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
                total: totals[0],
            },
            learner,
            sync,
            iter: loader.iter(),
            accumulation: *accumulation,
            accumulator: GradientsAccumulator::<M>::new(),
            accumulated: 0,
            item: None,
            out: None,
        };
        let ended = epoch::run_split(
            &mut split,
            SplitAt {
                pg: &strategy.pg,
                split: Split::Training,
                epoch,
                failure: &strategy.failure,
                cursor: None,
            },
        );
        drop(split);
        interrupter.fail_on_error(processor.process_train(LearnerEvent::EndSplit(epoch)));
        ended
    }

    fn valid(&mut self, cursor: &mut Cursor, _fault_tolerant: bool) -> Ended {
        let epoch = cursor.epoch;
        let start = LearnerEvent::StartSplit {
            epoch_number: epoch,
            total_items: self.totals[1],
        };
        self.interrupter
            .fail_on_error(self.processor.process_valid(start));
        let loader = self.valid.clone();
        let strategy = self.strategy;
        let mut split = ValidSplit {
            parts: SplitParts {
                strategy,
                processor: &mut self.processor,
                interrupter: &self.interrupter,
                total: self.totals[1],
            },
            model: self.learner.model().valid(),
            iter: loader.iter(),
            item: None,
            out: None,
        };
        let ended = epoch::run_split(
            &mut split,
            SplitAt {
                pg: &strategy.pg,
                split: Split::Validation,
                epoch,
                failure: &strategy.failure,
                cursor: None,
            },
        );
        drop(split);
        let p = &mut self.processor;
        self.interrupter
            .fail_on_error(p.process_valid(LearnerEvent::EndSplit(epoch)));
        self.interrupter
            .fail_on_error(p.process_train(LearnerEvent::EndEpoch(epoch)));
        ended
    }

    fn end_epoch(&mut self, epoch: usize, fault_tolerant: bool) -> Ended {
        let mut vote = Vote::Item;
        if self.strategy.is_main() {
            if self.checkpointer.is_some() || self.early_stopping.is_some() {
                // The metrics of this epoch, for the checkpointing strategy and the early stop.
                self.interrupter.fail_on_error(self.processor.flush());
            }
            if let Some(c) = &mut self.checkpointer {
                c.checkpoint(&self.learner, epoch, &self.store);
            }
            if let Some(es) = &mut self.early_stopping {
                if es.should_stop(epoch, &self.store) {
                    vote = Vote::Stop(format!("early stopping after epoch {epoch}"));
                }
            }
        }
        if self.interrupter.should_stop() {
            vote = interrupted(&self.interrupter);
        }
        let interrupter = &self.interrupter;
        epoch::end_epoch(
            &self.strategy.pg,
            &vote,
            &self.strategy.failure,
            fault_tolerant,
            |m| interrupter.stop(Some(m)),
        )
    }

    fn validated(&mut self, epoch: usize) {
        self.strategy.completed.store(epoch, Ordering::Relaxed);
    }

    fn stop_with(&mut self, e: DdpError) {
        burn_ddp_comm::train::vote::stop_with(e, &self.strategy.failure, |m| {
            self.interrupter.stop(Some(m));
        });
    }
}
