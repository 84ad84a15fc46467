//! The epoch loops of [`DdpStrategy`]: burn-train 0.22's `SupervisedLearningStrategy` (start,
//! resume, fit), one training epoch and one validation epoch, each step preceded by the ranks'
//! vote (burn-ddp-comm's `train::vote`).

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::Ordering;
use std::sync::MutexGuard;

use burn::data::dataloader::{DataLoader, DataLoaderIterator};
use burn::optim::{GradientsAccumulator, GradientsParams};
use burn::store::ModuleRecord;
use burn::train::checkpoint::{AsyncCheckpointer, KeepLastNCheckpoints};
use burn::train::{
    EventProcessorTraining, InferenceStep, Interrupter, Learner, LearnerEvent, LearnerModel,
    LearnerSummary, LearningCheckpointer, LearningResult, SupervisedLearningStrategy,
    SupervisedTrainingEventProcessor, TrainLoader, TrainStep, TrainingComponents, TrainingItem,
    ValidLoader,
};
use burn_ddp_comm::train::files::{self, RecordFiles};
use burn_ddp_comm::train::run;
use burn_ddp_comm::train::vote::{self, agree, panic_text, Decision, Flow, Split, Turn, Vote};

use super::checkpoint::{self, RankCheckpointer};
use super::{item, DdpStrategy, DistributedItem};
use crate::{DdpError, GradSync, ReduceOp, Result};

/// The next batch of `iter` and this rank's vote about it: a batch, none left, a stop asked
/// for (the interrupter, or an error it holds, such as a checkpoint that could not be
/// written), or a data error (an error or a panic while loading it).
fn next_batch<I>(
    iter: &mut dyn DataLoaderIterator<I>,
    interrupter: &Interrupter,
    split: &str,
) -> (Option<I>, Vote) {
    if interrupter.should_stop() {
        return (None, interrupted(interrupter));
    }
    match catch_unwind(AssertUnwindSafe(|| iter.next())) {
        Ok(Some(Ok(item))) => (Some(item), Vote::Item),
        Ok(Some(Err(e))) => (
            None,
            Vote::Failed(format!("loading a {split} batch failed: {e}")),
        ),
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

/// The vote of a rank whose interrupter was set: a failure if it holds an error (Burn's
/// checkpointer and event processor report theirs there), else a stop with its message.
fn interrupted(interrupter: &Interrupter) -> Vote {
    match interrupter.error() {
        Some(e) => Vote::Failed(e.to_string()),
        None => Vote::Stop(
            interrupter
                .get_message()
                .unwrap_or_else(|| "interrupted".into()),
        ),
    }
}

type TrainOut<M> = <M as TrainStep>::Output;
type ValidOut<M> = <M as InferenceStep>::Output;

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
        if !self.is_main() {
            // The summary reads rank 0's metric logs.
            components.summary = None;
        }
        if let Some(dir) = &self.checkpoints {
            let part =
                |name| RankCheckpointer(RecordFiles::new(dir.clone(), name, self.pg.clone()));
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
        let prepared = self.lock_sync().prepare(learner.model());
        match prepared {
            Ok(model) => learner.load_model(model.into_record()),
            Err(e) => return self.abandon(e, learner, components),
        }

        let summary_config = components.summary.clone();
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
        let (model, mut processor) = self.fit(
            components,
            learner,
            dataloader_train,
            dataloader_valid,
            start,
        );
        let summary = summary_config
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
        mut learner: Learner<M>,
        dataloader_train: TrainLoader<M>,
        dataloader_valid: ValidLoader<M>,
        starting_epoch: usize,
    ) -> (M, SupervisedTrainingEventProcessor<M>) {
        let loader_train = dataloader_train.to_device(&self.device);
        let loader_valid = dataloader_valid.to_device(&self.device.clone().inner());
        let mut processor = components.event_processor;
        let mut checkpointer = components.checkpointer;
        let mut early_stopping = components.early_stopping;
        let interrupter = components.interrupter;
        let epochs = components.num_epochs;
        let mut sync = self.lock_sync();

        // Every rank's items, for the progress of the whole job.
        let mut totals = [
            loader_train.num_items() as i64,
            loader_valid.num_items() as i64,
        ];
        if let Err(e) = self.pg.all_reduce(&mut totals, ReduceOp::Sum) {
            self.stop_with(e, &interrupter);
            return (learner.model(), processor);
        }
        let [train_total, valid_total] = totals.map(|t| t as usize);

        self.completed.store(starting_epoch - 1, Ordering::Relaxed);
        for epoch in starting_epoch..=epochs {
            self.set_epoch(epoch);
            interrupter.fail_on_error(processor.process_train(LearnerEvent::StartSplit {
                epoch_number: epoch,
                total_items: train_total,
            }));
            let flow = self.train_epoch(
                epoch,
                &mut learner,
                &mut sync,
                &*loader_train,
                train_total,
                components.grad_accumulation,
                &mut processor,
                &interrupter,
            );
            interrupter.fail_on_error(processor.process_train(LearnerEvent::EndSplit(epoch)));
            if flow == Flow::Stop {
                break;
            }
            interrupter.fail_on_error(processor.process_valid(LearnerEvent::StartSplit {
                epoch_number: epoch,
                total_items: valid_total,
            }));
            let flow = self.valid_epoch(
                epoch,
                &learner,
                &*loader_valid,
                valid_total,
                &mut processor,
                &interrupter,
            );
            interrupter.fail_on_error(processor.process_valid(LearnerEvent::EndSplit(epoch)));
            interrupter.fail_on_error(processor.process_train(LearnerEvent::EndEpoch(epoch)));
            if flow == Flow::Stop {
                break;
            }
            self.completed.store(epoch, Ordering::Relaxed);
            let mut vote = Vote::Item;
            if self.is_main() {
                if checkpointer.is_some() || early_stopping.is_some() {
                    // The metrics of this epoch, for the checkpointing strategy and the
                    // early stop.
                    interrupter.fail_on_error(processor.flush());
                }
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
                vote = interrupted(&interrupter);
            }
            if self.apply_decision(agree(&self.pg, &vote), &interrupter) == Flow::Stop {
                break;
            }
        }
        // Dropping the checkpointer waits for rank 0's last write; one that failed fails every
        // rank, through one last vote (which every rank reaches: each left the loop on the same
        // decision, or the group was aborted and the vote fails at once).
        drop(checkpointer);
        let last = match interrupter.error() {
            Some(e) => Vote::Failed(e.to_string()),
            None => Vote::Item,
        };
        self.apply_decision(agree(&self.pg, &last), &interrupter);
        (learner.model(), processor)
    }
}

impl DdpStrategy {
    /// Burn's summary of a run that failed counts only the epochs it completed. Burn counts
    /// the highest epoch whose metric logs it finds, and the epoch the run failed in has
    /// logs ("Total Epochs: 2" after one finished epoch). None when it completed none.
    fn completed_only(&self, mut summary: LearnerSummary) -> Option<LearnerSummary> {
        if self.failure.message().is_none() {
            return Some(summary);
        }
        let done = self.completed.load(Ordering::Relaxed);
        if done == 0 {
            return None;
        }
        summary.epochs = summary.epochs.min(done);
        for split in [&mut summary.metrics.train, &mut summary.metrics.valid] {
            for metric in split.iter_mut() {
                metric.entries.retain(|e| e.step <= done);
            }
            split.retain(|m| !m.entries.is_empty());
        }
        Some(summary)
    }

    fn lock_sync(&self) -> MutexGuard<'_, GradSync> {
        self.sync.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The checkpoint epoch to resume after, the same on every rank: an explicit one, else
    /// (with `with_resume`) the newest complete checkpoint rank 0 finds, once rank 0 has
    /// checked that it belongs to this run (burn-ddp-comm's [`run`]).
    fn start_epoch(
        &self,
        explicit: Option<usize>,
        epochs: usize,
        parameters: usize,
    ) -> Result<Option<usize>> {
        let job = burn_ddp_comm::config::env::run_id();
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

    fn restore<M: LearnerModel>(&self, learner: &mut Learner<M>, epoch: usize) -> Result<()> {
        let Some(dir) = &self.checkpoints else {
            return Err(files::no_directory(epoch, "DdpStrategy::with_checkpoints"));
        };
        let part = |name| RecordFiles::new(dir.clone(), name, self.pg.clone());
        let model: ModuleRecord = checkpoint::restore(&part("model"), epoch)?;
        let optim = checkpoint::restore(&part("optim"), epoch)?;
        let sched = checkpoint::restore(&part("scheduler"), epoch)?;
        let model = learner
            .model()
            .try_load_record(model)
            .map_err(|e| DdpError::Checkpoint {
                path: part("model").path(epoch).display().to_string(),
                what: "loading into the model",
                reason: e.to_string(),
            })?;
        learner.load_model(model.into_record());
        learner.load_optim(optim);
        learner.load_scheduler(sched);
        self.board.resumed(epoch);
        tracing::info!(
            "[rank {}] resumed from the checkpoint of epoch {epoch}",
            self.rank()
        );
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
        self.fail(e);
        LearningResult {
            model: learner.model().valid(),
            renderer: components.event_processor.renderer(),
            interrupted: interrupter.interruption(),
            error: interrupter.error(),
        }
    }

    /// Applies a decision on this rank.
    fn apply_decision(&self, decision: Result<Decision>, interrupter: &Interrupter) -> Flow {
        vote::apply_decision(decision, self.rank(), &self.failure, |m| {
            interrupter.stop(Some(m))
        })
    }

    fn stop_with(&self, e: DdpError, interrupter: &Interrupter) -> Flow {
        vote::stop_with(e, &self.failure, |m| interrupter.stop(Some(m)))
    }

    fn fail_alone(&self, what: &str, interrupter: &Interrupter) -> Flow {
        vote::fail_alone(&self.pg, what, &self.failure, |m| interrupter.stop(Some(m)))
    }

    /// The gradients reduced across the ranks, then one scheduler and optimizer step.
    fn step<M: LearnerModel>(
        &self,
        learner: &mut Learner<M>,
        sync: &mut GradSync,
        grads: GradientsParams,
    ) -> Result<()> {
        let grads = sync.sync(&learner.model(), grads)?;
        learner.lr_step();
        learner.optimizer_step(grads);
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn train_epoch<M>(
        &self,
        epoch: usize,
        learner: &mut Learner<M>,
        sync: &mut GradSync,
        loader: &dyn DataLoader<<M as TrainStep>::Input>,
        total: usize,
        accumulation: Option<usize>,
        processor: &mut SupervisedTrainingEventProcessor<M>,
        interrupter: &Interrupter,
    ) -> Flow
    where
        M: LearnerModel,
        TrainOut<M>: DistributedItem,
    {
        let mut iter = loader.iter();
        let mut iteration = 0;
        let mut accumulator = GradientsAccumulator::<M>::new();
        let mut accumulated = 0;
        loop {
            let (item, vote) = next_batch(&mut *iter, interrupter, "training");
            match vote::turn(
                &self.pg,
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
            if let Err(e) = sync_buffers(learner, sync) {
                return self.stop_with(e, interrupter);
            }
            iteration += 1;
            let progress = self.global(iter.progress(), total);
            let out = match catch_unwind(AssertUnwindSafe(|| learner.train_step(item))) {
                Ok(out) => out,
                Err(p) => {
                    return self.fail_alone(
                        &format!("the training step panicked: {}", panic_text(&*p)),
                        interrupter,
                    )
                }
            };
            let stepped = match accumulation {
                Some(k) => {
                    accumulator.accumulate(&learner.model(), out.grads);
                    accumulated += 1;
                    if accumulated >= k {
                        accumulated = 0;
                        self.step(learner, sync, accumulator.grads())
                    } else {
                        Ok(())
                    }
                }
                None => self.step(learner, sync, out.grads),
            };
            if let Err(e) = stepped {
                return self.stop_with(e, interrupter);
            }
            match item::gather(&self.pg, Some(out.item), &self.device.clone().inner()) {
                Ok(Some(merged)) => interrupter.fail_on_error(processor.process_train(
                    LearnerEvent::ProcessedItem(TrainingItem::new(
                        merged,
                        progress,
                        Some(iteration),
                        Some(learner.lr_current()),
                    )),
                )),
                Ok(None) => {}
                Err(e) => return self.stop_with(e, interrupter),
            }
        }
        // The last micro-steps of the epoch: every rank ran as many (the loop goes on only
        // while every rank has a batch), so every rank steps here, or none.
        if accumulated > 0 {
            if let Err(e) = self.step(learner, sync, accumulator.grads()) {
                return self.stop_with(e, interrupter);
            }
        }
        // Validation and the checkpoint see rank 0's buffers on every rank.
        if let Err(e) = sync_buffers(learner, sync) {
            return self.stop_with(e, interrupter);
        }
        Flow::Continue
    }

    fn valid_epoch<M>(
        &self,
        epoch: usize,
        learner: &Learner<M>,
        loader: &dyn DataLoader<<M as InferenceStep>::Input>,
        total: usize,
        processor: &mut SupervisedTrainingEventProcessor<M>,
        interrupter: &Interrupter,
    ) -> Flow
    where
        M: LearnerModel,
        ValidOut<M>: DistributedItem,
    {
        let model = learner.model().valid();
        let mut iter = loader.iter();
        let mut iteration = 0;
        loop {
            let (item, vote) = next_batch(&mut *iter, interrupter, "validation");
            match vote::turn(
                &self.pg,
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
            let progress = self.global(iter.progress(), total);
            let out = match item
                .map(|i| catch_unwind(AssertUnwindSafe(|| InferenceStep::step(&model, i))))
            {
                Some(Ok(out)) => Some(out),
                Some(Err(p)) => {
                    return self.fail_alone(
                        &format!("the validation step panicked: {}", panic_text(&*p)),
                        interrupter,
                    )
                }
                None => None,
            };
            match item::gather(&self.pg, out, &self.device.clone().inner()) {
                Ok(Some(merged)) => {
                    interrupter.fail_on_error(processor.process_valid(LearnerEvent::ProcessedItem(
                        TrainingItem::new(merged, progress, Some(iteration), None),
                    )))
                }
                Ok(None) => {}
                Err(e) => return self.stop_with(e, interrupter),
            }
        }
        Flow::Continue
    }
}

/// Rank 0's buffers (BatchNorm's running statistics) in every rank's model, when
/// `DdpConfig::broadcast_buffers` is on (the default).
fn sync_buffers<M: LearnerModel>(learner: &mut Learner<M>, sync: &mut GradSync) -> Result<()> {
    let model = learner.model();
    if !sync.buffers_to_sync(&model) {
        return Ok(());
    }
    let model = sync.sync_buffers(model)?;
    learner.load_model(model.into_record());
    Ok(())
}
