//! [`DdpStrategy`] as burn-train's `SupervisedLearningStrategy`: the start (checkpointers,
//! the epoch to resume after, the model prepared), `fit` (the epoch loop of `driver.rs`), and
//! the summary of a run that failed.

use burn::module::{AutodiffModule, Module};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::train::checkpoint::{AsyncCheckpointer, KeepLastNCheckpoints};
use burn::train::{EventProcessorTraining, LearnerSummary};
use burn::train::{
    Learner, LearnerEvent, LearnerModelRecord, LearnerOptimizerRecord, LearnerSchedulerRecord,
    LearningCheckpointer, LearningComponentsTypes, LearningResult, SupervisedLearningStrategy,
    SupervisedTrainingEventProcessor, TrainLoader, TrainingComponents, TrainingModel, ValidLoader,
};
use burn_backend::BackendTypes;

use burn_ddp_comm::train::files::RecordFiles;

use super::checkpoint::{self, RankCheckpointer};
use super::splits::{TrainOut, ValidOut};
use super::{DdpStrategy, DistributedItem};
use crate::{Ddp, DdpError, DdpModule, Result};

impl<B, LC> SupervisedLearningStrategy<LC> for DdpStrategy<B>
where
    B: Backend,
    LC: LearningComponentsTypes,
    LC::Backend: AutodiffBackend<InnerBackend = Ddp<B>> + BackendTypes<Device = B::Device>,
    LC::TrainingModel: DdpModule,
    TrainOut<LC>: DistributedItem<Backend = LC::Backend>,
    ValidOut<LC>: DistributedItem<Backend = Ddp<B>>,
{
    fn train(
        &self,
        mut learner: Learner<LC>,
        dataloader_train: TrainLoader<LC>,
        dataloader_valid: ValidLoader<LC>,
        mut components: TrainingComponents<LC>,
    ) -> LearningResult<LC::InferenceModel> {
        learner.fork(&self.device);
        // A sharded model's checkpoints are gathered from every rank's shards at each epoch's
        // end (`fsdp.rs`), not through burn-train's checkpointer, which would write rank 0's.
        if let Some(dir) = self
            .state
            .checkpoints
            .as_ref()
            .filter(|_| self.fsdp.is_none())
        {
            let pg = self.session.group().clone();
            let part = |name| RankCheckpointer {
                files: RecordFiles::new(dir.clone(), name, pg.clone())
                    .with_log(self.state.saved.clone()),
                failed: self.state.written.clone(),
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
        let admission = self.session.group().take_admission();
        // A sharded model's whole count: the same at every world size (a resume checks it).
        let parameters = match &self.fsdp {
            Some(fsdp) => fsdp.whole_values(&learner.model()),
            None => Ok(learner.model().num_params()),
        };
        let started = parameters.and_then(|parameters| {
            self.state.start(
                admission.is_some(),
                components.checkpoint,
                components.num_epochs,
                parameters,
                |epoch| {
                    if let Some(fsdp) = &self.fsdp {
                        fsdp.check_sharded(&learner.model())?;
                    }
                    if let Some(epoch) = epoch {
                        self.restore(&mut learner, epoch)?;
                    }
                    if self.fsdp.is_none() {
                        let model = self.session.prepare_module(learner.model())?;
                        learner.load_model(model.into_record());
                    }
                    Ok(())
                },
            )
        });
        let start = match started {
            Ok(start) => start,
            Err(e) => return self.abandon(e, learner, components),
        };

        // Burn's summary reads rank 0's metric logs: the rank that is rank 0 when training ends
        // prints it (in a fault-tolerant job, not always the one that began as rank 0). Every
        // rank of a fault-tolerant job processes every event, so that the one that becomes rank
        // 0 holds the whole run's metrics (its output shows only while it is rank 0).
        let summary_config = components.summary.take();
        if self.is_main() || self.session.group().is_fault_tolerant() {
            components
                .event_processor
                .process_train(LearnerEvent::Start);
            if start > 1 {
                // burn-train's metric store numbers epochs from 1 and counts its own ends of
                // epochs: without these, a resumed run's epochs would be logged as epoch 1, 2,
                // … over the files of the epochs before the checkpoint.
                let done = start - 1;
                components
                    .event_processor
                    .process_train(LearnerEvent::EndEpoch(done));
                components
                    .event_processor
                    .process_valid(LearnerEvent::EndEpoch(done));
            }
        }
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
        processor.process_train(LearnerEvent::End(summary));
        LearningResult {
            model: model.valid(),
            renderer: processor.renderer(),
        }
    }

    fn fit(
        &self,
        components: TrainingComponents<LC>,
        learner: Learner<LC>,
        dataloader_train: TrainLoader<LC>,
        dataloader_valid: ValidLoader<LC>,
        starting_epoch: usize,
    ) -> (TrainingModel<LC>, SupervisedTrainingEventProcessor<LC>) {
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

impl<B: Backend> DdpStrategy<B> {
    /// Burn's summary, of the epochs completed when training failed (burn-ddp-comm's
    /// `StrategyState::trim_summary`).
    fn completed_only(&self, mut summary: LearnerSummary) -> Option<LearnerSummary> {
        let m = &mut summary.metrics;
        let splits = [&mut m.train, &mut m.valid];
        let state = &self.state;
        let kept = state.trim_summary(&mut summary.epochs, splits, |m| &mut m.entries, |e| e.step);
        kept.then_some(summary)
    }

    fn restore<LC>(&self, learner: &mut Learner<LC>, epoch: usize) -> Result<()>
    where
        LC: LearningComponentsTypes,
        LC::Backend: AutodiffBackend<InnerBackend = Ddp<B>> + BackendTypes<Device = B::Device>,
    {
        let part = |name| self.state.record_files(name, epoch);
        let model: LearnerModelRecord<LC> =
            checkpoint::restore(&part("model")?, epoch, &self.device)?;
        let optim: LearnerOptimizerRecord<LC> =
            checkpoint::restore(&part("optim")?, epoch, &self.device)?;
        let sched: LearnerSchedulerRecord<LC> =
            checkpoint::restore(&part("scheduler")?, epoch, &self.device)?;
        let Some(fsdp) = &self.fsdp else {
            learner.load_model(model);
            learner.load_optim(optim);
            learner.load_scheduler(sched);
            return Ok(());
        };
        // The whole records of a sharded run, written at any world size: the whole model
        // loaded (Burn 0.21 takes a record of any shape), sharded again (rank 0's values, its
        // ids: the record's), then the optimizer state cut for it.
        let rank = self.rank();
        learner.load_model(model);
        let sharded = fsdp.shard(Box::new(learner.model()))?;
        let sharded: TrainingModel<LC> = super::fsdp::back(sharded, rank, "resuming")?;
        learner.load_model(sharded.into_record());
        let optim = fsdp.shard_optimizer_record(&learner.model(), Box::new(optim))?;
        learner.load_optim(super::fsdp::back(optim, rank, "resuming")?);
        learner.load_scheduler(sched);
        Ok(())
    }

    /// Training cannot start on this rank: record why and return the untrained model.
    fn abandon<LC: LearningComponentsTypes>(
        &self,
        e: DdpError,
        learner: Learner<LC>,
        components: TrainingComponents<LC>,
    ) -> LearningResult<LC::InferenceModel> {
        components.interrupter.stop(Some(&e.to_string()));
        self.state.failure.fail(e);
        LearningResult {
            model: learner.model().valid(),
            renderer: components.event_processor.renderer(),
        }
    }
}
