//! [`DdpStrategy`]'s run on burn-train 0.21 as the core's epoch loop drives it
//! (burn-ddp-comm's `train::epoch::fit`): each split over the Learner's loaders
//! (`splits.rs`), the end of an epoch (rank 0's checkpoint and early stop, then every rank's
//! vote), and in a fault-tolerant job the Learner's state moved after a change of membership
//! (`handover.rs`).

use std::sync::Arc;
use std::time::Instant;

use burn::data::dataloader::DataLoader;
use burn::module::{AutodiffModule, Module};
use burn::optim::GradientsAccumulator;
use burn::record::{BinBytesRecorder, FullPrecisionSettings, Recorder};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::train::metric::store::EventStoreClient;
use burn::train::LearnerOptimizerRecord;
use burn::train::{
    CloneEarlyStoppingStrategy, EventProcessorTraining, Interrupter, Learner, LearnerEvent,
    LearningCheckpointer, LearningComponentsTypes, SupervisedTrainingEventProcessor, TrainLoader,
    TrainingComponents, TrainingModel, ValidLoader,
};
use burn_backend::BackendTypes;
use burn_ddp_comm::group::handover::saved_records;
use burn_ddp_comm::group::handover::RecordSlot;
use burn_ddp_comm::train::epoch::{self, Cursor, Ended, EpochDriver, Handover};
use burn_ddp_comm::train::files::{self, RecordFiles, SavedLog, PARTS};
use burn_ddp_comm::train::vote::{self, FailureSlot, Split, Vote};
use burn_ddp_comm::DdpError;

use super::handover;
use super::splits::{interrupted, SplitParts, TrainOut, TrainSplit, ValidOut, ValidSplit};
use super::{DdpStrategy, DistributedItem};
use crate::{Ddp, DdpModule, ProcessGroup, Recovery, Result};

/// One run of [`DdpStrategy::fit_from`]: the Learner, its loaders and its components.
struct Run<'s, B: Backend, LC: LearningComponentsTypes> {
    strategy: &'s DdpStrategy<B>,
    learner: Learner<LC>,
    train: TrainLoader<LC>,
    valid: ValidLoader<LC>,
    processor: SupervisedTrainingEventProcessor<LC>,
    checkpointer: Option<LearningCheckpointer<LC>>,
    early_stopping: Option<Box<dyn CloneEarlyStoppingStrategy>>,
    interrupter: Interrupter,
    store: std::sync::Arc<EventStoreClient>,
    accumulation: Option<usize>,
    epochs: usize,
    /// Whether this rank's dashboard was started (rank 0's was; a rank that becomes rank 0
    /// starts its own).
    shown: bool,
    /// The epoch burn-train's metric store is at, for each split (training, validation): it
    /// counts the ends of epochs it was told of, and names the metric files' directories by it.
    at: [usize; 2],
    /// A sharded model's checkpoint files (model, optimizer, scheduler), written at every
    /// epoch's end by every rank's part ([`DdpStrategy::fsdp`]).
    fsdp_files: Option<[RecordFiles; 3]>,
}

/// The loader of a split at `cursor`, sliced anew when the samplers were re-dealt
/// (burn-ddp-comm's `StrategyState::before_split`).
fn loader_at<B: Backend, BB: Backend, I: 'static>(
    ddp: &DdpStrategy<B>,
    loader: &Arc<dyn DataLoader<BB, I>>,
    cursor: &Cursor,
    fault_tolerant: bool,
) -> Result<Arc<dyn DataLoader<BB, I>>> {
    Ok(if ddp.state.before_split(cursor, fault_tolerant)? {
        loader.slice(0, loader.num_items())
    } else {
        loader.clone()
    })
}

impl<B: Backend, LC: LearningComponentsTypes> Run<'_, B, LC> {
    /// Tells burn-train's event processor that the epochs of split `split` (0: training, 1:
    /// validation) before `epoch` ended, when it was not told: a process that joined a running
    /// fault-tolerant job, or rejoined it, starts at the job's epoch, and its metric store (whose
    /// count of epochs names the metric files it writes as rank 0) must be there too.
    fn show_epoch(&mut self, split: usize, epoch: usize) {
        if self.at[split] < epoch && self.shown {
            if split == 0 {
                self.processor
                    .process_train(LearnerEvent::EndEpoch(epoch - 1));
            } else {
                self.processor
                    .process_valid(LearnerEvent::EndEpoch(epoch - 1));
            }
        }
        self.at[split] = self.at[split].max(epoch);
    }

    /// The split's end of epoch was processed (`SplitSteps::finish`) when it ended well.
    fn ended(&mut self, split: usize, epoch: usize, ended: &Ended) {
        if matches!(ended, Ended::Done) {
            self.at[split] = epoch + 1;
        }
    }
}

impl<B, LC> EpochDriver for Run<'_, B, LC>
where
    B: Backend,
    LC: LearningComponentsTypes,
    LC::Backend: AutodiffBackend<InnerBackend = Ddp<B>> + BackendTypes<Device = B::Device>,
    LC::TrainingModel: DdpModule,
    TrainOut<LC>: DistributedItem<Backend = LC::Backend>,
    ValidOut<LC>: DistributedItem<Backend = Ddp<B>>,
{
    fn group(&self) -> &ProcessGroup {
        self.strategy.session.group()
    }

    fn failure(&self) -> &FailureSlot {
        &self.strategy.state.failure
    }

    fn saved(&self) -> &SavedLog {
        &self.strategy.state.saved
    }

    fn train(&mut self, cursor: &mut Cursor, fault_tolerant: bool) -> Ended {
        self.show_epoch(0, cursor.epoch);
        let ddp = self.strategy;
        let loader = match loader_at(ddp, &self.train, cursor, fault_tolerant) {
            Ok(loader) => loader,
            Err(e) => {
                self.stop_with(e);
                return Ended::Stop;
            }
        };
        let Run {
            learner,
            processor,
            interrupter,
            accumulation,
            epochs,
            ..
        } = self;
        let mut split = TrainSplit {
            parts: SplitParts::new(ddp, processor, interrupter, cursor, *epochs, fault_tolerant),
            learner,
            iter: loader.iter(),
            accumulation: *accumulation,
            accumulator: GradientsAccumulator::new(),
            accumulated: 0,
            item: None,
        };
        let at = ddp.state.split_at(Split::Training, cursor, fault_tolerant);
        let ended = epoch::run_split(&mut split, at);
        drop(split);
        self.ended(0, cursor.epoch, &ended);
        ended
    }

    fn valid(&mut self, cursor: &mut Cursor, fault_tolerant: bool) -> Ended {
        self.show_epoch(1, cursor.epoch);
        let ddp = self.strategy;
        let loader = match loader_at(ddp, &self.valid, cursor, fault_tolerant) {
            Ok(loader) => loader,
            Err(e) => {
                self.stop_with(e);
                return Ended::Stop;
            }
        };
        let epochs = self.epochs;
        let mut split: ValidSplit<'_, B, LC> = ValidSplit {
            model: self.learner.model().valid(),
            parts: SplitParts::new(
                ddp,
                &mut self.processor,
                &self.interrupter,
                cursor,
                epochs,
                fault_tolerant,
            ),
            iter: loader.iter(),
            item: None,
        };
        let at = ddp
            .state
            .split_at(Split::Validation, cursor, fault_tolerant);
        let ended = epoch::run_split(&mut split, at);
        drop(split);
        self.ended(1, cursor.epoch, &ended);
        ended
    }

    fn every_rank_epoch_end(&mut self, epoch: usize) -> Result<()> {
        let (Some(fsdp), Some(files)) = (&self.strategy.fsdp, &self.fsdp_files) else {
            return Ok(());
        };
        let rank = self.strategy.rank();
        // The Learner's records of this rank's shards, through burn-train's checkpointer.
        let slots: [RecordSlot; 3] = Default::default();
        handover::save_records(&self.learner, epoch, &self.store, &slots);
        let [_, optim, sched] = saved_records(&slots, rank)?;
        let optim: LearnerOptimizerRecord<LC> = handover::load(optim, &self.strategy.device, rank)?;
        let model = self.learner.model();
        let whole = fsdp.full_model(&model)?;
        let whole: TrainingModel<LC> = super::fsdp::back(whole, rank, "checkpointing")?;
        let optim = fsdp.full_optimizer_record(&model, Box::new(optim))?;
        let optim: LearnerOptimizerRecord<LC> = super::fsdp::back(optim, rank, "checkpointing")?;
        let [model_files, optim_files, sched_files] = files;
        let recorder = BinBytesRecorder::<FullPrecisionSettings>::default;
        model_files.save(epoch, || recorder().record(whole.into_record(), ()))?;
        optim_files.save(epoch, || recorder().record(optim, ()))?;
        sched_files.save(epoch, || Ok::<_, DdpError>(sched))?;
        files::delete_behind(files, epoch, self.strategy.state.keep)
    }

    fn main_epoch_end(&mut self, epoch: usize) -> bool {
        if let Some(c) = &mut self.checkpointer {
            c.checkpoint(&self.learner, epoch, &self.store);
        }
        (self.early_stopping.as_mut()).is_some_and(|es| es.should_stop(epoch, &self.store))
    }

    fn interrupted(&self) -> Option<Vote> {
        let written = &self.strategy.state.written;
        (self.interrupter.should_stop()).then(|| interrupted(&self.interrupter, written))
    }

    fn interrupt(&self, message: &str) {
        self.interrupter.stop(Some(message));
    }

    fn close(&mut self) -> Vote {
        // Dropping the checkpointer waits for rank 0's last write.
        drop(self.checkpointer.take());
        self.strategy
            .state
            .written
            .message()
            .map_or(Vote::Item, Vote::Failed)
    }
}

impl<B, LC> Handover for Run<'_, B, LC>
where
    B: Backend,
    LC: LearningComponentsTypes,
    LC::Backend: AutodiffBackend<InnerBackend = Ddp<B>> + BackendTypes<Device = B::Device>,
    LC::TrainingModel: DdpModule,
    TrainOut<LC>: DistributedItem<Backend = LC::Backend>,
    ValidOut<LC>: DistributedItem<Backend = Ddp<B>>,
{
    fn save_records(&mut self, epoch: usize, slots: &[RecordSlot; 3]) {
        handover::save_records(&self.learner, epoch, &self.store, slots);
    }

    fn load_records(&mut self, records: [Vec<u8>; 3]) -> Result<()> {
        // The metrics of the epoch under way were processed elsewhere until now.
        self.strategy.state.metrics.took_state();
        self.strategy.load_records(&mut self.learner, records)
    }

    fn reprepare(&mut self) -> Result<()> {
        let model = self.strategy.session.reprepare(self.learner.model())?;
        self.learner.load_model(model.into_record());
        Ok(())
    }

    fn changed(&mut self, rec: Recovery, cursor: &Cursor, began: Instant) {
        let ddp = self.strategy;
        if ddp.is_main() && !self.shown {
            self.processor.process_train(LearnerEvent::Start);
            self.shown = true;
        }
        ddp.state
            .changes
            .changed(rec, cursor, began, &ddp.state.board, ddp.is_main());
    }
}

impl<B: Backend> DdpStrategy<B> {
    /// The epoch loops from `starting_epoch` (burn-ddp-comm's `train::epoch::fit`): training,
    /// validation, the end of each epoch. In a fault-tolerant job, a failure of the group (or a
    /// process asking to join, or this process's `admission` into the running job) changes the
    /// membership, moves the state to the ranks behind, re-deals the rest of the epoch over the
    /// new ranks, and goes on from where the ranks are (no restart, no checkpoint reload).
    /// Elsewhere a failure stops training.
    #[allow(clippy::type_complexity)]
    pub(super) fn fit_from<LC>(
        &self,
        components: TrainingComponents<LC>,
        learner: Learner<LC>,
        dataloader_train: TrainLoader<LC>,
        dataloader_valid: ValidLoader<LC>,
        starting_epoch: usize,
        admission: Option<Recovery>,
    ) -> (TrainingModel<LC>, SupervisedTrainingEventProcessor<LC>)
    where
        LC: LearningComponentsTypes,
        LC::Backend: AutodiffBackend<InnerBackend = Ddp<B>> + BackendTypes<Device = B::Device>,
        LC::TrainingModel: DdpModule,
        TrainOut<LC>: DistributedItem<Backend = LC::Backend>,
        ValidOut<LC>: DistributedItem<Backend = Ddp<B>>,
    {
        let epochs = components.num_epochs;
        let mut run = Run {
            strategy: self,
            learner,
            train: dataloader_train.to_device(&self.device),
            valid: dataloader_valid.to_device(&self.device),
            processor: components.event_processor,
            checkpointer: components.checkpointer,
            early_stopping: components.early_stopping,
            interrupter: components.interrupter,
            store: components.event_store,
            accumulation: components.grad_accumulation,
            epochs,
            // Every rank of a fault-tolerant job processes the events (`train`).
            shown: self.is_main() || self.session.group().is_fault_tolerant(),
            at: [starting_epoch; 2],
            fsdp_files: (self.fsdp.as_ref())
                .and(self.state.checkpoints.as_ref())
                .map(|dir| {
                    PARTS.map(|name| {
                        let files =
                            RecordFiles::new(dir.clone(), name, self.session.group().clone());
                        files.with_log(self.state.saved.clone())
                    })
                }),
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
        let whole = match &self.fsdp {
            Some(fsdp) if self.state.failure.message().is_none() => fsdp
                .full_model(&model)
                .and_then(|w| super::fsdp::back::<TrainingModel<LC>>(w, self.rank(), "ending"))
                .map(Some),
            _ => Ok(None),
        };
        let model = match whole {
            Ok(whole) => whole.unwrap_or(model),
            Err(e) => {
                vote::stop_with(e, &self.state.failure, |m| interrupter.stop(Some(m)));
                model
            }
        };
        (model, processor)
    }
}
