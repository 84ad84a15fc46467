//! [`DdpStrategy`] as burn-train's `SupervisedLearningStrategy`: the start (checkpointers,
//! the epoch to resume after, the model prepared), `fit` (the core's epoch loop over the run of
//! `driver.rs`), and the summary of a run that failed.

use burn_ddp_comm::JobError;
use std::sync::MutexGuard;

use burn::store::ModuleRecord;
use burn::train::checkpoint::{AsyncCheckpointer, KeepLastNCheckpoints};
use burn::train::{
    EventProcessorTraining, Learner, LearnerEvent, LearnerModel, LearnerSummary,
    LearningCheckpointer, LearningResult, SupervisedLearningStrategy,
    SupervisedTrainingEventProcessor, TrainLoader, TrainingComponents, ValidLoader,
};
use burn_ddp_comm::train::files::RecordFiles;

use super::checkpoint::{self, RankCheckpointer};
use super::splits::{TrainOut, ValidOut};
use super::{DdpStrategy, DistributedItem};
use crate::{DdpError, GradSync, Result};

impl<M> SupervisedLearningStrategy<M> for DdpStrategy
where
    M: LearnerModel,
    TrainOut<M>: DistributedItem,
    ValidOut<M>: DistributedItem,
{
    fn train(
        &self,
        mut learner: Learner<M>,
        dataloader_train: TrainLoader<M>,
        dataloader_valid: ValidLoader<M>,
        mut components: TrainingComponents<M>,
    ) -> LearningResult<M> {
        learner.fork(&self.device);
        // A sharded model's checkpoints are gathered from every rank's shards at each epoch's
        // end (`fsdp.rs`), not through burn-train's checkpointer, which would write rank 0's
        // shards.
        if let Some(dir) = self
            .state
            .checkpoints
            .as_ref()
            .filter(|_| self.fsdp.is_none())
        {
            let part = |name| {
                let files = RecordFiles::new(dir.clone(), name, self.group().clone());
                RankCheckpointer(files.with_log(self.state.saved.clone()))
            };
            let interrupter = components.interrupter.clone();
            components.checkpointer = Some(LearningCheckpointer::new(
                AsyncCheckpointer::new(part("model")).with_interrupter(interrupter.clone()),
                AsyncCheckpointer::new(part("optim")).with_interrupter(interrupter.clone()),
                AsyncCheckpointer::new(part("scheduler")).with_interrupter(interrupter),
                Box::new(KeepLastNCheckpoints::new(self.state.keep)),
            ));
        }

        // A process that joined a running fault-tolerant job takes the state and the place of
        // the job from a rank that has them, at the start of `fit`.
        let admission = self.group().take_admission();
        // A sharded model's whole count: the same at every world size (a resume checks it).
        let parameters = match &self.fsdp {
            Some(fsdp) => fsdp.held_values(&learner.model()).1,
            None => learner.model().num_params(),
        };
        let started = self.state.start(
            admission.is_some(),
            components.checkpoint,
            components.num_epochs,
            parameters,
            |epoch| {
                if let Some(fsdp) = &self.fsdp {
                    super::fsdp::check_sharded(fsdp, &learner.model())?;
                }
                if let Some(epoch) = epoch {
                    self.restore(&mut learner, epoch)?;
                }
                if self.fsdp.is_none() {
                    let model = self.lock_sync().prepare(learner.model())?;
                    learner.load_model(model.into_record());
                }
                Ok(())
            },
        );
        let start = match started {
            Ok(start) => start,
            Err(e) => return self.abandon(e, learner, components),
        };

        // Burn's summary reads rank 0's metric logs: the rank that is rank 0 when training ends
        // prints it (in a fault-tolerant job, not always the one that began as rank 0).
        let summary_config = components.summary.take();
        let interrupter = components.interrupter.clone();
        interrupter.fail_on_error(
            components
                .event_processor
                .process_train(LearnerEvent::Start {
                    total_epochs: components.num_epochs,
                    starting_epoch: start,
                    label: components.label.clone(),
                }),
        );
        let (model, mut processor) = self.fit_from(
            components,
            learner,
            dataloader_train,
            dataloader_valid,
            start,
            admission,
        );
        if summary_config.is_some() {
            // For rank 0's progress lines, which print the summary with it, as Burn's own
            // strategy does (burn-train keeps a summary's model to itself).
            self.state.model.set(model.to_string());
        }
        let summary = summary_config
            .filter(|_| self.is_main() && !self.state.failure.out_of_the_job())
            .and_then(|s| s.init().ok())
            .and_then(|s| self.completed_only(s));
        interrupter.fail_on_error(processor.process_train(LearnerEvent::End(summary)));
        interrupter.fail_on_error(processor.flush());
        LearningResult {
            model: model.valid(),
            renderer: processor.renderer(),
            interrupted: interrupter.interruption(),
            error: interrupter.error(),
        }
    }

    fn fit(
        &self,
        components: TrainingComponents<M>,
        learner: Learner<M>,
        dataloader_train: TrainLoader<M>,
        dataloader_valid: ValidLoader<M>,
        starting_epoch: usize,
    ) -> (M, SupervisedTrainingEventProcessor<M>) {
        self.fit_from(
            components,
            learner,
            dataloader_train,
            dataloader_valid,
            starting_epoch,
            None,
        )
    }
}

impl DdpStrategy {
    /// Burn's summary, of the epochs completed when training failed (burn-ddp-comm's
    /// `StrategyState::trim_summary`).
    fn completed_only(&self, mut summary: LearnerSummary) -> Option<LearnerSummary> {
        let m = &mut summary.metrics;
        let splits = [&mut m.train, &mut m.valid];
        let state = &self.state;
        let kept = state.trim_summary(&mut summary.epochs, splits, |m| &mut m.entries, |e| e.step);
        kept.then_some(summary)
    }

    pub(super) fn lock_sync(&self) -> MutexGuard<'_, GradSync> {
        self.sync.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn restore<M: LearnerModel>(&self, learner: &mut Learner<M>, epoch: usize) -> Result<()> {
        let part = |name| self.state.record_files(name, epoch);
        if let Some(fsdp) = &self.fsdp {
            let files = [part("model")?, part("optim")?, part("scheduler")?];
            return super::fsdp::restore(fsdp, learner, &files, epoch);
        }
        let files = part("model")?;
        let model: ModuleRecord = checkpoint::restore(&files, epoch)?;
        let optim = checkpoint::restore(&part("optim")?, epoch)?;
        let sched = checkpoint::restore(&part("scheduler")?, epoch)?;
        let model = learner.model().try_load_record(model).map_err(|e| {
            DdpError::Job(JobError::Checkpoint {
                path: files.path(epoch).display().to_string(),
                what: "loading into the model",
                reason: e.to_string(),
            })
        })?;
        learner.load_model(model.into_record());
        learner.load_optim(optim);
        learner.load_scheduler(sched);
        Ok(())
    }

    /// Training cannot start on this rank: record why and return the untrained model.
    fn abandon<M: LearnerModel>(
        &self,
        e: DdpError,
        learner: Learner<M>,
        components: TrainingComponents<M>,
    ) -> LearningResult<M> {
        let interrupter = components.interrupter;
        interrupter.stop(Some(&e.to_string()));
        self.state.failure.fail(e);
        LearningResult {
            model: learner.model().valid(),
            renderer: components.event_processor.renderer(),
            interrupted: interrupter.interruption(),
            error: interrupter.error(),
        }
    }
}
