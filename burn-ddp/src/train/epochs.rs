//! The epoch loops of [`DdpStrategy`]: burn-train's `SupervisedLearningStrategy` (start,
//! resume, fit), one training epoch and one validation epoch, each step preceded by the ranks'
//! vote (`consensus.rs`).

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::Ordering;

use burn::data::dataloader::Progress;
use burn::module::{AutodiffModule, Module};
use burn::optim::GradientsAccumulator;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::train::checkpoint::{AsyncCheckpointer, KeepLastNCheckpoints};
use burn::train::{EventProcessorTraining, LearnerSummary};
use burn::train::{
    InferenceStep, Learner, LearnerEvent, LearnerModelRecord, LearnerOptimizerRecord,
    LearnerSchedulerRecord, LearningCheckpointer, LearningComponentsTypes, LearningResult,
    SupervisedLearningStrategy, SupervisedTrainingEventProcessor, TrainLoader, TrainStep,
    TrainingComponents, TrainingItem, TrainingModel, ValidLoader,
};
use burn_backend::BackendTypes;

use burn_ddp_comm::train::files::{self, RecordFiles};
use burn_ddp_comm::train::run;
use burn_ddp_comm::train::vote::{self, panic_text, Aside, FailureSlot, Flow, Split, Turn, Vote};

use super::checkpoint::{self, RankCheckpointer};
use super::fault::{Change, Cursor, Phase};
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

/// How a split (or an epoch's end) ended.
#[derive(Debug)]
enum Ended {
    /// Its last step is done.
    Done,
    /// Training stops on every rank.
    Stop,
    /// The membership changes (fault-tolerant jobs only).
    Change(Change),
}

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

        // A process that joined a running fault-tolerant job takes the state and the place of
        // the job from a rank that has them, at the start of `fit`.
        let admission = self.session.group().take_admission();
        let start = if admission.is_some() {
            1
        } else {
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
            start
        };

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
        let (model, mut processor) = self.fit_from(
            components,
            learner,
            dataloader_train,
            dataloader_valid,
            start,
            admission,
        );
        let summary = summary_config
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

    /// The epoch loops from `starting_epoch`, at a [`Cursor`]: training, validation, the end of
    /// each epoch. In a fault-tolerant job, a failure of the group (or a process asking to join,
    /// or this process's `admission` into the running job) changes the membership, moves the
    /// state to the ranks behind, re-deals the rest of the epoch over the new ranks, and goes on
    /// from where the ranks are (no restart, no checkpoint reload); each split's loader is then
    /// sliced anew (a multi-threaded loader splits its dataset once). Elsewhere a failure stops
    /// training.
    #[allow(clippy::type_complexity)]
    fn fit_from<LC>(
        &self,
        components: TrainingComponents<LC>,
        mut learner: Learner<LC>,
        dataloader_train: TrainLoader<LC>,
        dataloader_valid: ValidLoader<LC>,
        starting_epoch: usize,
        admission: Option<burn_ddp_comm::Recovery>,
    ) -> (TrainingModel<LC>, SupervisedTrainingEventProcessor<LC>)
    where
        LC: LearningComponentsTypes,
        LC::Backend: AutodiffBackend<InnerBackend = Ddp<B>> + BackendTypes<Device = B::Device>,
        LC::TrainingModel: DdpModule,
        TrainOut<LC>: DistributedItem<Backend = LC::Backend>,
        ValidOut<LC>: DistributedItem<Backend = Ddp<B>>,
    {
        let ft = self.session.group().is_fault_tolerant();
        let dataloader_train = dataloader_train.to_device(&self.device);
        let dataloader_valid = dataloader_valid.to_device(&self.device);
        let mut processor = components.event_processor;
        let mut checkpointer = components.checkpointer;
        let mut early_stopping = components.early_stopping;
        let interrupter = components.interrupter;
        let store = components.event_store;
        let epochs = components.num_epochs;
        let mut cursor = Cursor::start(starting_epoch);
        self.completed.store(starting_epoch - 1, Ordering::Relaxed);
        let mut change = admission.map(Change::Admitted);
        // Whether this rank's dashboard was started (rank 0's was; a rank that becomes rank 0
        // starts its own).
        let mut shown = self.is_main();
        loop {
            if let Some(c) = change.take() {
                let began = std::time::Instant::now();
                match self.change(c, &mut learner, &mut cursor, &store) {
                    Ok(rec) => {
                        if self.is_main() && !shown {
                            processor.process_train(LearnerEvent::Start);
                            shown = true;
                        }
                        self.board.changed(&rec, &cursor.describe());
                        if self.is_main() {
                            // The dashboard of this mode is the progress lines, on rank 0.
                            println!("[membership] {} (at {})", rec.summary(), cursor.describe());
                        }
                        *self.first_step.lock().unwrap_or_else(|p| p.into_inner()) =
                            Some((rec.epoch, began));
                        self.changed
                            .lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .push(rec);
                    }
                    Err(e) => {
                        self.stop_with(e, &interrupter);
                        break;
                    }
                }
            }
            if cursor.epoch > epochs {
                break;
            }
            let global = Progress {
                items_processed: cursor.epoch,
                items_total: epochs,
            };
            let ended = match cursor.phase {
                Phase::Train | Phase::Valid if ft => {
                    if let Err(e) = self.deal(&cursor) {
                        self.stop_with(e, &interrupter);
                        break;
                    }
                    if cursor.phase == Phase::Train {
                        let view = dataloader_train.slice(0, dataloader_train.num_items());
                        self.train_epoch(
                            &mut learner,
                            &view,
                            &global,
                            components.grad_accumulation,
                            &mut processor,
                            &interrupter,
                            Some(&mut cursor),
                        )
                    } else {
                        let view = dataloader_valid.slice(0, dataloader_valid.num_items());
                        self.valid_epoch(
                            &learner,
                            &view,
                            &global,
                            &mut processor,
                            &interrupter,
                            Some(&mut cursor),
                        )
                    }
                }
                Phase::Train => {
                    self.set_epoch(cursor.epoch);
                    self.train_epoch(
                        &mut learner,
                        &dataloader_train,
                        &global,
                        components.grad_accumulation,
                        &mut processor,
                        &interrupter,
                        None,
                    )
                }
                Phase::Valid => self.valid_epoch(
                    &learner,
                    &dataloader_valid,
                    &global,
                    &mut processor,
                    &interrupter,
                    None,
                ),
                Phase::End => self.end_epoch(
                    cursor.epoch,
                    &learner,
                    &mut checkpointer,
                    &mut early_stopping,
                    &store,
                    &interrupter,
                    ft,
                ),
            };
            match ended {
                Ended::Done => {
                    if cursor.phase == Phase::Valid {
                        self.completed.store(cursor.epoch, Ordering::Relaxed);
                    }
                    cursor.next_phase()
                }
                Ended::Stop => break,
                Ended::Change(c) => change = Some(c),
            }
        }
        drop(checkpointer);
        // The samplers deal their whole epoch over the last membership again, for what the
        // program does after training (an evaluation over the validation data).
        let whole = Cursor::start(cursor.epoch.min(epochs));
        if let Err(e) = self.deal(&whole) {
            tracing::warn!(
                "[rank {}] re-dealing the data after training: {e}",
                self.rank()
            );
        }
        // One last vote, so that a checkpoint rank 0 could not write fails every rank. Ranks
        // lost at this point no longer matter: training is over.
        if self.failure.message().is_some() {
            // This rank's training failed already (it could not rejoin, say): no last vote.
            return (learner.model(), processor);
        }
        let last = match self.written.message() {
            Some(e) => Vote::Failed(e),
            None => Vote::Item,
        };
        match self.agree(last) {
            Err(e) if e.is_peer_failure() => tracing::warn!(
                "[rank {}] training is over; the last vote failed ({e}): not waiting for the \
                 ranks lost meanwhile",
                self.rank()
            ),
            decision => {
                self.apply_decision(decision, &interrupter);
            }
        }
        (learner.model(), processor)
    }

    /// The end of an epoch: rank 0 writes the checkpoint and asks early stopping; then every
    /// rank's vote (a stop, an interrupter, a failed checkpoint stop every rank).
    #[allow(clippy::too_many_arguments)]
    fn end_epoch<LC>(
        &self,
        epoch: usize,
        learner: &Learner<LC>,
        checkpointer: &mut Option<burn::train::LearningCheckpointer<LC>>,
        early_stopping: &mut Option<Box<dyn burn::train::CloneEarlyStoppingStrategy>>,
        store: &burn::train::metric::store::EventStoreClient,
        interrupter: &burn::train::Interrupter,
        fault_tolerant: bool,
    ) -> Ended
    where
        LC: LearningComponentsTypes,
    {
        let mut vote = Vote::Item;
        if self.is_main() {
            if let Some(c) = checkpointer {
                c.checkpoint(learner, epoch, store);
            }
            if let Some(es) = early_stopping {
                if es.should_stop(epoch, store) {
                    vote = Vote::Stop(format!("early stopping after epoch {epoch}"));
                }
            }
        }
        if interrupter.should_stop() {
            vote = interrupted(interrupter, &self.written);
        }
        match self.agree(vote) {
            Err(e) if fault_tolerant && e.is_peer_failure() => Ended::Change(Change::Failed(e)),
            decision => match self.apply_decision(decision, interrupter) {
                Flow::Continue => Ended::Done,
                Flow::Stop => Ended::Stop,
            },
        }
    }

    /// What an error of a collective in a split does: changes the membership in a
    /// fault-tolerant job (when it is a failure of the group), stops training otherwise.
    fn failed(
        &self,
        e: DdpError,
        interrupter: &burn::train::Interrupter,
        fault_tolerant: bool,
    ) -> Ended {
        if fault_tolerant && e.is_peer_failure() {
            return Ended::Change(Change::Failed(e));
        }
        self.stop_with(e, interrupter);
        Ended::Stop
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
            self.session.group(),
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
        self.board.resumed(epoch);
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

    /// One split of training. In a fault-tolerant job (`cursor`), it starts at the cursor
    /// (the loader deals the rest of the epoch), moves the cursor on with every optimizer step,
    /// and ends with a change of membership when the group fails or a process asks to join.
    #[allow(clippy::too_many_arguments)]
    fn train_epoch<LC>(
        &self,
        learner: &mut Learner<LC>,
        loader: &TrainLoader<LC>,
        global: &Progress,
        accumulation: Option<usize>,
        processor: &mut SupervisedTrainingEventProcessor<LC>,
        interrupter: &burn::train::Interrupter,
        mut cursor: Option<&mut Cursor>,
    ) -> Ended
    where
        LC: LearningComponentsTypes,
        LC::Backend: AutodiffBackend<InnerBackend = Ddp<B>> + BackendTypes<Device = B::Device>,
        TrainOut<LC>: DistributedItem<Backend = LC::Backend>,
    {
        let ft = cursor.is_some();
        let pg = self.session.group().clone();
        let epoch = global.items_processed;
        let mut iter = loader.iter();
        let mut iteration = cursor.as_ref().map_or(0, |c| c.iteration);
        let base = cursor.as_ref().map_or(0, |c| c.done);
        let mut accumulator = GradientsAccumulator::new();
        let mut accumulated = 0;
        // Positions of the epoch's order used by the micro-steps since the last optimizer step.
        let mut pending = 0u64;
        loop {
            let before = iter.progress().items_processed;
            let (item, vote) = next_batch(&mut *iter, interrupter, &self.written, "training");
            let interrupt = |m: &str| interrupter.stop(Some(m));
            let (turn, batch) = if ft {
                let aside = Aside {
                    items: (iter.progress().items_processed.saturating_sub(before)) as u64,
                    join: pg.join_pending(),
                };
                match vote::try_turn(
                    &pg,
                    &vote,
                    aside,
                    Split::Training,
                    epoch,
                    &self.failure,
                    interrupt,
                ) {
                    Ok((Turn::Step, heard)) if heard.join && accumulated == 0 => {
                        return Ended::Change(Change::Grow)
                    }
                    Ok((turn, heard)) => (turn, heard.items),
                    Err(e) => return self.failed(e, interrupter, ft),
                }
            } else {
                let turn = vote::turn(&pg, &vote, Split::Training, epoch, &self.failure, interrupt);
                (turn, 0)
            };
            match turn {
                Turn::Step => {}
                Turn::End => break,
                Turn::Stop => return Ended::Stop,
            }
            let Some(item) = item else { break };
            if let Err(e) = self.sync_buffers(learner) {
                return self.failed(e, interrupter, ft);
            }
            iteration += 1;
            let progress = self.global(iter.progress(), base);
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
                    return Ended::Stop;
                }
            };
            if let Err(e) = self.session.check() {
                return self.failed(e, interrupter, ft);
            }
            pending += batch * u64::from(pg.world_size().get());
            let stepped = match accumulation {
                Some(k) => {
                    learner.lr_step();
                    accumulator.accumulate(&learner.model(), out.grads);
                    accumulated += 1;
                    if accumulated >= k {
                        let grads = self
                            .session
                            .sync_gradients(&learner.model(), accumulator.grads());
                        match grads {
                            Ok(g) => learner.optimizer_step(g),
                            Err(e) => return self.failed(e, interrupter, ft),
                        }
                        accumulated = 0;
                        true
                    } else {
                        false
                    }
                }
                // Parameters this rank's batch did not use but others' did get the average.
                None => match self.session.complete(&learner.model(), out.grads) {
                    Ok(g) => {
                        // After the synchronisation: a step that failed leaves the schedule
                        // where it was.
                        learner.lr_step();
                        learner.optimizer_step(g);
                        true
                    }
                    Err(e) => return self.failed(e, interrupter, ft),
                },
            };
            if let (true, Some(c)) = (stepped, cursor.as_deref_mut()) {
                c.done += std::mem::take(&mut pending);
                c.iteration = iteration;
                c.progress += 1;
                let first = self
                    .first_step
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .take();
                if let (Some((membership, since)), true) = (first, self.is_main()) {
                    println!(
                        "[membership] the first step of membership epoch {membership} is done, \
                         {} ms after the change began",
                        since.elapsed().as_millis()
                    );
                }
            }
            match item::gather(&pg, Some(out.item), &self.device) {
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
                Err(e) => return self.failed(e, interrupter, ft),
            }
        }
        // Validation and the checkpoint see rank 0's buffers on every rank.
        if let Err(e) = self.sync_buffers(learner) {
            return self.failed(e, interrupter, ft);
        }
        if self.is_main() {
            processor.process_train(LearnerEvent::EndEpoch(epoch));
        }
        Ended::Done
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

    /// One split of validation (resumable at `cursor` in a fault-tolerant job, as
    /// [`train_epoch`](Self::train_epoch)).
    fn valid_epoch<LC>(
        &self,
        learner: &Learner<LC>,
        loader: &ValidLoader<LC>,
        global: &Progress,
        processor: &mut SupervisedTrainingEventProcessor<LC>,
        interrupter: &burn::train::Interrupter,
        mut cursor: Option<&mut Cursor>,
    ) -> Ended
    where
        LC: LearningComponentsTypes,
        LC::Backend: AutodiffBackend<InnerBackend = Ddp<B>> + BackendTypes<Device = B::Device>,
        ValidOut<LC>: DistributedItem<Backend = Ddp<B>>,
    {
        let ft = cursor.is_some();
        let pg = self.session.group().clone();
        let epoch = global.items_processed;
        let model = learner.model().valid();
        let mut iter = loader.iter();
        let mut iteration = cursor.as_ref().map_or(0, |c| c.iteration);
        let base = cursor.as_ref().map_or(0, |c| c.done);
        loop {
            let before = iter.progress().items_processed;
            let (item, vote) = next_batch(&mut *iter, interrupter, &self.written, "validation");
            let interrupt = |m: &str| interrupter.stop(Some(m));
            let (turn, batch) = if ft {
                let aside = Aside {
                    items: (iter.progress().items_processed.saturating_sub(before)) as u64,
                    join: false,
                };
                match vote::try_turn(
                    &pg,
                    &vote,
                    aside,
                    Split::Validation,
                    epoch,
                    &self.failure,
                    interrupt,
                ) {
                    Ok((turn, heard)) => (turn, heard.items),
                    Err(e) => return self.failed(e, interrupter, ft),
                }
            } else {
                let turn = vote::turn(
                    &pg,
                    &vote,
                    Split::Validation,
                    epoch,
                    &self.failure,
                    interrupt,
                );
                (turn, 0)
            };
            match turn {
                Turn::Step => {}
                Turn::End => break,
                Turn::Stop => return Ended::Stop,
            }
            iteration += 1;
            let progress = self.global(iter.progress(), base);
            let out = match item.map(|i| catch_unwind(AssertUnwindSafe(|| model.step(i)))) {
                Some(Ok(out)) => Some(out),
                Some(Err(p)) => {
                    self.fail_alone(
                        &format!("the validation step panicked: {}", panic_text(&*p)),
                        interrupter,
                    );
                    return Ended::Stop;
                }
                None => None,
            };
            match item::gather(&pg, out, &self.device) {
                Ok(Some(merged)) => processor.process_valid(LearnerEvent::ProcessedItem(
                    TrainingItem::new(merged, progress, global.clone(), Some(iteration), None),
                )),
                Ok(None) => {}
                Err(e) => return self.failed(e, interrupter, ft),
            }
            if let Some(c) = cursor.as_deref_mut() {
                c.done += batch * u64::from(pg.world_size().get());
                c.iteration = iteration;
                c.progress += 1;
            }
        }
        if self.is_main() {
            processor.process_valid(LearnerEvent::EndEpoch(epoch));
        }
        Ended::Done
    }
}
