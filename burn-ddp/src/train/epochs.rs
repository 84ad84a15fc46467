//! The epoch loops of [`DdpStrategy`]: burn-train's `SupervisedLearningStrategy` (start,
//! resume, fit), one training epoch and one validation epoch, each step preceded by the ranks'
//! vote (`consensus.rs`).

use std::panic::{catch_unwind, AssertUnwindSafe};

use burn::data::dataloader::Progress;
use burn::module::{AutodiffModule, Module};
use burn::optim::GradientsAccumulator;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::train::checkpoint::{AsyncCheckpointer, KeepLastNCheckpoints};
use burn::train::EventProcessorTraining;
use burn::train::{
    InferenceStep, Learner, LearnerEvent, LearnerModelRecord, LearnerOptimizerRecord,
    LearnerSchedulerRecord, LearningCheckpointer, LearningComponentsTypes, LearningResult,
    SupervisedLearningStrategy, SupervisedTrainingEventProcessor, TrainLoader, TrainStep,
    TrainingComponents, TrainingItem, TrainingModel, ValidLoader,
};
use burn_backend::BackendTypes;

use burn_ddp_comm::train::files::{self, RecordFiles};
use burn_ddp_comm::train::run;
use burn_ddp_comm::train::vote::{self, panic_text, FailureSlot, Flow, Split, Turn, Vote};

use super::checkpoint::{self, RankCheckpointer};
use super::{item, DdpStrategy, DistributedItem};
use crate::{Ddp, DdpError, DdpModule, Result};

/// The next batch of `iter` and this rank's vote about it: a batch, none left, a stop asked
/// for (the interrupter), or a failure (a checkpoint rank 0 could not write, a panic while
/// loading the batch).
fn next_batch<I>(
    iter: &mut dyn burn::data::dataloader::DataLoaderIterator<I>,
    interrupter: &burn::train::Interrupter,
    written: &FailureSlot,
    split: &str,
) -> (Option<I>, Vote) {
    if let Some(e) = written.message() {
        return (None, Vote::Failed(e));
    }
    match catch_unwind(AssertUnwindSafe(|| iter.next())) {
        Ok(Some(item)) if !interrupter.should_stop() => (Some(item), Vote::Item),
        Ok(Some(_)) => (None, interrupted(interrupter, written)),
        Ok(None) => (None, Vote::NoItem),
        Err(p) => (
            None,
            Vote::Failed(format!(
                "loading a {split} batch panicked: {}",
                panic_text(&*p)
            )),
        ),
    }
}

/// The vote of a rank whose interrupter was set: a failure if a checkpoint could not be written
/// (Burn's checkpointer reports it as a stop), else a stop with the interrupter's message.
fn interrupted(interrupter: &burn::train::Interrupter, written: &FailureSlot) -> Vote {
    match written.message() {
        Some(e) => Vote::Failed(e),
        None => Vote::Stop(
            interrupter
                .get_message()
                .unwrap_or_else(|| "interrupted".into()),
        ),
    }
}

type TrainOut<LC> = <<LC as LearningComponentsTypes>::TrainingModel as TrainStep>::Output;
type ValidOut<LC> = <<LC as LearningComponentsTypes>::InferenceModel as InferenceStep>::Output;

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
        if !self.is_main() {
            // The summary reads rank 0's metric logs.
            components.summary = None;
        }
        if let Some(dir) = &self.checkpoints {
            let pg = self.session.group().clone();
            let part = |name| RankCheckpointer {
                files: RecordFiles::new(dir.clone(), name, pg.clone()),
                failed: self.written.clone(),
            };
            let interrupter = components.interrupter.clone();
            components.checkpointer = Some(LearningCheckpointer::new(
                AsyncCheckpointer::new(part("model")).with_interrupter(interrupter.clone()),
                AsyncCheckpointer::new(part("optim")).with_interrupter(interrupter.clone()),
                AsyncCheckpointer::new(part("scheduler")).with_interrupter(interrupter),
                Box::new(KeepLastNCheckpoints::new(self.keep)),
            ));
        }

        let start = match self.start_epoch(
            components.checkpoint,
            components.num_epochs,
            learner.model().num_params(),
        ) {
            Ok(Some(epoch)) => match self.restore(&mut learner, epoch) {
                Ok(()) => epoch + 1,
                Err(e) => return self.abandon(e, learner, components),
            },
            Ok(None) => 1,
            Err(e) => return self.abandon(e, learner, components),
        };
        match self.session.prepare_module(learner.model()) {
            Ok(model) => learner.load_model(model.into_record()),
            Err(e) => return self.abandon(e, learner, components),
        }

        let summary_config = components.summary.clone();
        if self.is_main() {
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
        let (model, mut processor) = self.fit(
            components,
            learner,
            dataloader_train,
            dataloader_valid,
            start,
        );
        let summary = summary_config.and_then(|s| s.init().ok());
        processor.process_train(LearnerEvent::End(summary));
        LearningResult {
            model: model.valid(),
            renderer: processor.renderer(),
        }
    }

    fn fit(
        &self,
        components: TrainingComponents<LC>,
        mut learner: Learner<LC>,
        dataloader_train: TrainLoader<LC>,
        dataloader_valid: ValidLoader<LC>,
        starting_epoch: usize,
    ) -> (TrainingModel<LC>, SupervisedTrainingEventProcessor<LC>) {
        let dataloader_train = dataloader_train.to_device(&self.device);
        let dataloader_valid = dataloader_valid.to_device(&self.device);
        let mut processor = components.event_processor;
        let mut checkpointer = components.checkpointer;
        let mut early_stopping = components.early_stopping;
        let interrupter = components.interrupter;
        let epochs = components.num_epochs;

        for epoch in starting_epoch..=epochs {
            self.set_epoch(epoch);
            let global = Progress {
                items_processed: epoch,
                items_total: epochs,
            };
            if self.train_epoch(
                &mut learner,
                &dataloader_train,
                &global,
                components.grad_accumulation,
                &mut processor,
                &interrupter,
            ) == Flow::Stop
            {
                break;
            }
            if self.valid_epoch(
                &learner,
                &dataloader_valid,
                &global,
                &mut processor,
                &interrupter,
            ) == Flow::Stop
            {
                break;
            }
            let mut vote = Vote::Item;
            if self.is_main() {
                if let Some(c) = &mut checkpointer {
                    c.checkpoint(&learner, epoch, &components.event_store);
                }
                if let Some(es) = &mut early_stopping {
                    if es.should_stop(epoch, &components.event_store) {
                        vote = Vote::Stop(format!("early stopping after epoch {epoch}"));
                    }
                }
            }
            if interrupter.should_stop() {
                vote = interrupted(&interrupter, &self.written);
            }
            if self.settle(self.agree(vote), &interrupter) == Flow::Stop {
                break;
            }
        }
        // Dropping the checkpointer waits for rank 0's last write; one that failed fails every
        // rank, through one last vote (which every rank reaches: each left the loop on the same
        // decision, or the group was aborted and the vote fails at once).
        drop(checkpointer);
        let last = match self.written.message() {
            Some(e) => Vote::Failed(e),
            None => Vote::Item,
        };
        self.settle(self.agree(last), &interrupter);
        (learner.model(), processor)
    }
}

impl<B: Backend> DdpStrategy<B> {
    /// The checkpoint epoch to resume after, the same on every rank: an explicit one, else
    /// (with `with_resume`) the newest complete checkpoint rank 0 finds, once rank 0 has
    /// checked that it belongs to this run (burn-ddp-comm's [`run`]).
    fn start_epoch(
        &self,
        explicit: Option<usize>,
        epochs: usize,
        parameters: usize,
    ) -> Result<Option<usize>> {
        run::start_epoch(
            self.session.group(),
            &run::StartAsk {
                explicit,
                dir: self.checkpoints.as_deref(),
                resume: self.resumes(),
                epochs,
                parameters,
                settings: &self.run,
            },
        )
    }

    fn restore<LC>(&self, learner: &mut Learner<LC>, epoch: usize) -> Result<()>
    where
        LC: LearningComponentsTypes,
        LC::Backend: AutodiffBackend<InnerBackend = Ddp<B>> + BackendTypes<Device = B::Device>,
    {
        let Some(dir) = &self.checkpoints else {
            return Err(files::no_directory(epoch, "DdpStrategy::with_checkpoints"));
        };
        let part = |name| RecordFiles::new(dir.clone(), name, self.session.group().clone());
        let model: LearnerModelRecord<LC> =
            checkpoint::restore(&part("model"), epoch, &self.device)?;
        let optim: LearnerOptimizerRecord<LC> =
            checkpoint::restore(&part("optim"), epoch, &self.device)?;
        let sched: LearnerSchedulerRecord<LC> =
            checkpoint::restore(&part("scheduler"), epoch, &self.device)?;
        learner.load_model(model);
        learner.load_optim(optim);
        learner.load_scheduler(sched);
        tracing::info!(
            "[rank {}] resumed from the checkpoint of epoch {epoch}",
            self.rank()
        );
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
        self.fail(e);
        LearningResult {
            model: learner.model().valid(),
            renderer: components.event_processor.renderer(),
        }
    }

    fn train_epoch<LC>(
        &self,
        learner: &mut Learner<LC>,
        loader: &TrainLoader<LC>,
        global: &Progress,
        accumulation: Option<usize>,
        processor: &mut SupervisedTrainingEventProcessor<LC>,
        interrupter: &burn::train::Interrupter,
    ) -> Flow
    where
        LC: LearningComponentsTypes,
        LC::Backend: AutodiffBackend<InnerBackend = Ddp<B>> + BackendTypes<Device = B::Device>,
        TrainOut<LC>: DistributedItem<Backend = LC::Backend>,
    {
        let epoch = global.items_processed;
        let mut iter = loader.iter();
        let mut iteration = 0;
        let mut accumulator = GradientsAccumulator::new();
        let mut accumulated = 0;
        loop {
            let (item, vote) = next_batch(&mut *iter, interrupter, &self.written, "training");
            match vote::turn(
                self.session.group(),
                &vote,
                Split::Training,
                epoch,
                &self.failure,
                |m| interrupter.stop(Some(m)),
            ) {
                Turn::Step => {}
                Turn::End => break,
                Turn::Stop => return Flow::Stop,
            }
            let Some(item) = item else { break };
            if let Err(e) = self.sync_buffers(learner) {
                return self.stop_with(e, interrupter);
            }
            iteration += 1;
            learner.lr_step();
            let progress = self.global(iter.progress());
            let step = catch_unwind(AssertUnwindSafe(|| match accumulation {
                Some(_) => {
                    let _local = self.session.no_sync();
                    learner.train_step(item)
                }
                None => learner.train_step(item),
            }));
            let out = match step {
                Ok(out) => out,
                Err(p) => {
                    self.fail_alone(
                        &format!("the training step panicked: {}", panic_text(&*p)),
                        interrupter,
                    );
                    return Flow::Stop;
                }
            };
            if let Err(e) = self.session.check() {
                return self.stop_with(e, interrupter);
            }
            match accumulation {
                Some(k) => {
                    accumulator.accumulate(&learner.model(), out.grads);
                    accumulated += 1;
                    if accumulated >= k {
                        let grads = self
                            .session
                            .sync_gradients(&learner.model(), accumulator.grads());
                        match grads {
                            Ok(g) => learner.optimizer_step(g),
                            Err(e) => return self.stop_with(e, interrupter),
                        }
                        accumulated = 0;
                    }
                }
                // Parameters this rank's batch did not use but others' did get the average.
                None => match self.session.complete(&learner.model(), out.grads) {
                    Ok(g) => learner.optimizer_step(g),
                    Err(e) => return self.stop_with(e, interrupter),
                },
            }
            match item::gather(self.session.group(), Some(out.item), &self.device) {
                Ok(Some(merged)) => {
                    processor.process_train(LearnerEvent::ProcessedItem(TrainingItem::new(
                        merged,
                        progress,
                        global.clone(),
                        Some(iteration),
                        Some(learner.lr_current()),
                    )))
                }
                Ok(None) => {}
                Err(e) => return self.stop_with(e, interrupter),
            }
        }
        // Validation and the checkpoint see rank 0's buffers on every rank.
        if let Err(e) = self.sync_buffers(learner) {
            return self.stop_with(e, interrupter);
        }
        if self.is_main() {
            processor.process_train(LearnerEvent::EndEpoch(epoch));
        }
        Flow::Continue
    }

    /// Rank 0's buffers (BatchNorm's running statistics) in every rank's model, when
    /// `DdpConfig::broadcast_buffers` is on (the default).
    fn sync_buffers<LC>(&self, learner: &mut Learner<LC>) -> Result<()>
    where
        LC: LearningComponentsTypes,
        LC::Backend: AutodiffBackend<InnerBackend = Ddp<B>> + BackendTypes<Device = B::Device>,
    {
        let model = learner.model();
        if !self.session.buffers_to_sync(&model) {
            return Ok(());
        }
        let model = self
            .session
            .broadcast_buffers(model, crate::group::Rank(0))?;
        learner.load_model(model.into_record());
        Ok(())
    }

    fn valid_epoch<LC>(
        &self,
        learner: &Learner<LC>,
        loader: &ValidLoader<LC>,
        global: &Progress,
        processor: &mut SupervisedTrainingEventProcessor<LC>,
        interrupter: &burn::train::Interrupter,
    ) -> Flow
    where
        LC: LearningComponentsTypes,
        LC::Backend: AutodiffBackend<InnerBackend = Ddp<B>> + BackendTypes<Device = B::Device>,
        ValidOut<LC>: DistributedItem<Backend = Ddp<B>>,
    {
        let epoch = global.items_processed;
        let model = learner.model().valid();
        let mut iter = loader.iter();
        let mut iteration = 0;
        loop {
            let (item, vote) = next_batch(&mut *iter, interrupter, &self.written, "validation");
            match vote::turn(
                self.session.group(),
                &vote,
                Split::Validation,
                epoch,
                &self.failure,
                |m| interrupter.stop(Some(m)),
            ) {
                Turn::Step => {}
                Turn::End => break,
                Turn::Stop => return Flow::Stop,
            }
            iteration += 1;
            let progress = self.global(iter.progress());
            let out = match item.map(|i| catch_unwind(AssertUnwindSafe(|| model.step(i)))) {
                Some(Ok(out)) => Some(out),
                Some(Err(p)) => {
                    self.fail_alone(
                        &format!("the validation step panicked: {}", panic_text(&*p)),
                        interrupter,
                    );
                    return Flow::Stop;
                }
                None => None,
            };
            match item::gather(self.session.group(), out, &self.device) {
                Ok(Some(merged)) => processor.process_valid(LearnerEvent::ProcessedItem(
                    TrainingItem::new(merged, progress, global.clone(), Some(iteration), None),
                )),
                Ok(None) => {}
                Err(e) => return self.stop_with(e, interrupter),
            }
        }
        if self.is_main() {
            processor.process_valid(LearnerEvent::EndEpoch(epoch));
        }
        Flow::Continue
    }
}
