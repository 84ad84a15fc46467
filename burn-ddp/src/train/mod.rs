//! Training with burn-train's `SupervisedTraining` (the Learner, its dashboard, metrics and
//! checkpoints) on several processes: [`DdpStrategy`].
//!
//! ```no_run
//! # use burn::train::{Learner, SupervisedTraining, LearningComponentsTypes};
//! # fn doc<LC: LearningComponentsTypes<Backend = burn::backend::Autodiff<burn_ddp::Ddp<burn::backend::NdArray>>> + Send + 'static>(
//! #     training: SupervisedTraining<LC>, learner: Learner<LC>,
//! #     ddp: burn_ddp::train::DdpStrategy<burn::backend::NdArray>) -> burn_ddp::Result<()>
//! # where burn_ddp::train::DdpStrategy<burn::backend::NdArray>: burn::train::SupervisedLearningStrategy<LC> {
//! use burn_ddp::train::DdpTraining;
//! // `ddp` = DdpStrategy::new(session, device), built once per process.
//! let result = training.launch_ddp(learner, &ddp)?; // an error if any rank failed
//! # Ok(()) }
//! ```
//!
//! What the strategy does on every rank, per step: one small all-reduce in which every rank
//! says whether it has a batch, wants to stop (a quit in the dashboard, an interrupter) or
//! failed (a data error); then the training step, whose gradients `Autodiff<Ddp<B>>`
//! all-reduces during backward; then the step's output items gathered to rank 0, which merges
//! them ([`DistributedItem`]) so that the dashboard's metrics are those of the whole job.
//! Validation is sharded the same way and merged the same way. A decision to stop — by any
//! rank, for any reason — is taken by every rank at the same step, so no rank is left waiting
//! in a collective.

mod checkpoint;
mod item;
mod render;

use std::io::IsTerminal;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use burn::backend::Autodiff;
use burn::data::dataloader::Progress;
use burn::module::{AutodiffModule, Module};
use burn::optim::GradientsAccumulator;
use burn::tensor::backend::Backend;
use burn::train::checkpoint::{AsyncCheckpointer, Checkpointer, KeepLastNCheckpoints};
use burn::train::EventProcessorTraining;
use burn::train::{
    InferenceStep, Learner, LearnerEvent, LearnerModelRecord, LearnerOptimizerRecord,
    LearnerSchedulerRecord, LearningCheckpointer, LearningComponentsTypes, LearningResult,
    SupervisedLearningStrategy, SupervisedTraining, SupervisedTrainingEventProcessor, TrainLoader,
    TrainStep, TrainingComponents, TrainingItem, TrainingModel, ValidLoader,
};

pub use checkpoint::newest_complete;

/// For the fuzz target: decode, and re-encode what decodes.
#[cfg(feature = "fuzzing")]
pub(crate) fn fuzz_decode_parts(data: &[u8]) {
    if let Some(parts) = Part::decode(data) {
        let mut again = Vec::new();
        Part::encode(&parts, &mut again);
        assert_eq!(again, data, "item round trip");
    }
}
pub use item::{DistributedItem, Part};
pub use render::{Headless, NoMetricLogger, ProgressLines};

use crate::{DataEpoch, Ddp, DdpError, DdpModule, DdpSession, Rank, ReduceOp, Result};

/// burn-train's `SupervisedLearningStrategy` for one process per rank (or one thread per rank
/// of an in-process group): use it through [`DdpTraining::launch_ddp`], or pass
/// `TrainingStrategy::Custom(Arc::new(strategy))` to `SupervisedTraining` yourself.
///
/// The model must be `Autodiff<Ddp<B>>` and `#[ddp]` (its `#[ddp(skip)]` fields stay
/// rank-local); the output items of its training and validation steps must be
/// [`DistributedItem`]s (burn-train's classification and regression outputs are).
///
/// - **Start**: every rank resumes from the same checkpoint epoch (if any), then the model is
///   checked across ranks and rank 0's weights are loaded everywhere (as
///   [`DdpSession::prepare_module`]).
/// - **Data**: build the data loaders over [`DistributedSampler`](crate::DistributedSampler)s
///   (without the loader's own `shuffle`) and register them with
///   [`with_sampler`](Self::with_sampler): the strategy sets their epoch.
/// - **Metrics**: rank 0's dashboard shows the whole job (losses averaged over the global batch,
///   accuracy over it, item counts summed); progress counts every rank's items.
/// - **Checkpoints** ([`with_checkpoints`](Self::with_checkpoints)): written by rank 0 alone,
///   atomically, model + optimizer + scheduler per epoch; [`with_resume`](Self::with_resume)
///   restarts from the newest complete one, which rank 0 reads and sends to every rank.
/// - **LR schedule**: one scheduler step per global step (every rank steps together).
/// - **Stopping**: a dashboard quit, an early stop (decided on rank 0, which has the metrics),
///   a data error or a failed rank stops every rank at the same step.
#[derive(Clone)]
pub struct DdpStrategy<B: Backend> {
    session: DdpSession,
    device: B::Device,
    checkpoints: Option<PathBuf>,
    keep: usize,
    resume: bool,
    samplers: Vec<Arc<dyn DataEpoch>>,
    failure: Arc<Mutex<Option<DdpError>>>,
}

impl<B: Backend> std::fmt::Debug for DdpStrategy<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DdpStrategy")
            .field("rank", &self.session.group().rank())
            .field("world_size", &self.session.group().world_size())
            .field("device", &self.device)
            .field("checkpoints", &self.checkpoints)
            .field("resume", &self.resume)
            .field("samplers", &self.samplers.len())
            .finish()
    }
}

impl<B: Backend> DdpStrategy<B> {
    /// The strategy of this process's rank in `session`, training on `device` (for CUDA, the
    /// device of the rank's `LOCAL_RANK`).
    pub fn new(session: DdpSession, device: B::Device) -> Self {
        Self {
            session,
            device,
            checkpoints: None,
            keep: 2,
            resume: false,
            samplers: Vec::new(),
            failure: Arc::new(Mutex::new(None)),
        }
    }

    /// A sampler whose epoch the strategy sets at the start of every epoch (the training and
    /// the validation samplers; share them with the data loaders through an `Arc`).
    pub fn with_sampler(mut self, sampler: Arc<dyn DataEpoch>) -> Self {
        self.samplers.push(sampler);
        self
    }

    /// Rank 0 writes a checkpoint (model, optimizer, scheduler) at the end of every epoch into
    /// `dir` — `model-{epoch}.bin`, `optim-{epoch}.bin`, `scheduler-{epoch}.bin`, each renamed
    /// into place once complete — keeping the newest `keep` epochs.
    pub fn with_checkpoints(mut self, dir: impl Into<PathBuf>, keep: usize) -> Self {
        self.checkpoints = Some(dir.into());
        self.keep = keep.max(1);
        self
    }

    /// Whether to resume from the newest complete checkpoint in the checkpoint directory
    /// (default `false`, but a group restarted by `burn-ddp run --max-restarts` always resumes;
    /// an explicit `SupervisedTraining::checkpoint(epoch)` wins).
    pub fn with_resume(mut self, resume: bool) -> Self {
        self.resume = resume;
        self
    }

    /// Whether training resumes from the newest complete checkpoint: when asked to, and
    /// always in a group restarted by `burn-ddp run --max-restarts` (or torchrun's).
    fn resumes(&self) -> bool {
        self.resume || self.session.group().restart_count() > 0
    }

    /// The session.
    pub fn session(&self) -> &DdpSession {
        &self.session
    }

    /// The error that stopped training, if any (also returned by
    /// [`DdpTraining::launch_ddp`]).
    pub fn failure(&self) -> Option<String> {
        self.failure
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .map(ToString::to_string)
    }

    fn take_failure(&self) -> Option<DdpError> {
        self.failure
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
    }

    fn fail(&self, e: DdpError) {
        tracing::error!("{e}");
        let mut slot = self.failure.lock().unwrap_or_else(|p| p.into_inner());
        if slot.is_none() {
            *slot = Some(e);
        }
    }

    fn rank(&self) -> Rank {
        self.session.group().rank()
    }

    fn is_main(&self) -> bool {
        self.rank() == Rank(0)
    }

    /// Progress of this rank's loader, counted for the whole job (every rank has as many
    /// items, or one fewer, by the sampler's construction).
    fn global(&self, p: Progress) -> Progress {
        let w = self.session.group().world_size().as_usize();
        Progress {
            items_processed: p.items_processed * w,
            items_total: p.items_total * w,
        }
    }

    /// One small all-reduce: every rank's vote, and what they decide together.
    fn agree(&self, vote: Vote) -> Result<Decision> {
        let pg = self.session.group();
        let (has, stop, failed) = match &vote {
            Vote::Item => (1, 0, 0),
            Vote::NoItem => (0, 0, 0),
            Vote::Stop(_) => (0, 1, 0),
            Vote::Failed(_) => (0, 0, 1),
        };
        // Max of (has, 1 - has, stop, failed): any rank has an item, any has none, any stops,
        // any failed.
        let mut flags = [has, 1 - has, stop, failed];
        pg.all_reduce(&mut flags, ReduceOp::Max)?;
        if flags[2] == 0 && flags[3] == 0 {
            return Ok(Decision::Go {
                any_item: flags[0] == 1,
                all_items: flags[1] == 0,
            });
        }
        let mine = match &vote {
            Vote::Stop(m) | Vote::Failed(m) => m.as_bytes(),
            _ => &[],
        };
        let reasons = pg.all_gather_bytes(mine)?;
        let (culprit, reason) = reasons
            .iter()
            .enumerate()
            .find(|(_, r)| !r.is_empty())
            .map(|(r, m)| (Rank(r as u32), String::from_utf8_lossy(m).into_owned()))
            .unwrap_or((Rank(0), String::from("no reason given")));
        Ok(if flags[3] == 1 {
            Decision::Failed { culprit, reason }
        } else {
            Decision::Stop { culprit, reason }
        })
    }

    /// Applies a stop or failure decision on this rank; `true` when training must stop.
    fn settle(&self, decision: Result<Decision>, interrupter: &burn::train::Interrupter) -> Flow {
        match decision {
            Ok(Decision::Go { .. }) => Flow::Continue,
            Ok(Decision::Stop { culprit, reason }) => {
                tracing::info!(
                    "[rank {}] stopping: rank {culprit} asked: {reason}",
                    self.rank()
                );
                interrupter.stop(Some(&format!("rank {culprit}: {reason}")));
                Flow::Stop
            }
            Ok(Decision::Failed { culprit, reason }) => {
                interrupter.stop(Some(&format!("rank {culprit} failed: {reason}")));
                self.fail(DdpError::TrainingFailed {
                    rank: self.rank(),
                    culprit,
                    reason,
                });
                Flow::Stop
            }
            Err(e) => self.stop_with(e, interrupter),
        }
    }

    /// Stops this rank on an error it got itself (a failed collective names the rank at fault).
    fn stop_with(&self, e: DdpError, interrupter: &burn::train::Interrupter) -> Flow {
        interrupter.stop(Some(&e.to_string()));
        self.fail(e);
        Flow::Stop
    }

    /// A failure of this rank alone, in the middle of a step (the others may be inside a
    /// collective): abort the group so that they stop at once, naming this rank.
    fn fail_alone(&self, what: &str, interrupter: &burn::train::Interrupter) {
        let reason = what.to_owned();
        interrupter.stop(Some(&reason));
        self.fail(DdpError::TrainingFailed {
            rank: self.rank(),
            culprit: self.rank(),
            reason,
        });
        self.session.group().abort();
    }

    fn set_epoch(&self, epoch: usize) {
        for s in &self.samplers {
            s.set_epoch(epoch as u64);
        }
    }
}

/// What one rank says before a step.
enum Vote {
    Item,
    NoItem,
    Stop(String),
    Failed(String),
}

enum Decision {
    Go { any_item: bool, all_items: bool },
    Stop { culprit: Rank, reason: String },
    Failed { culprit: Rank, reason: String },
}

#[derive(PartialEq, Eq)]
enum Flow {
    Continue,
    Stop,
}

fn panic_text(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| String::from("(no message)"))
}

/// The next batch of `iter` and this rank's vote about it: a batch, none left, a stop asked
/// for (the interrupter), or a data error (a panic while loading it).
fn next_batch<I>(
    iter: &mut dyn burn::data::dataloader::DataLoaderIterator<I>,
    interrupter: &burn::train::Interrupter,
    split: &str,
) -> (Option<I>, Vote) {
    match catch_unwind(AssertUnwindSafe(|| iter.next())) {
        Ok(Some(item)) if !interrupter.should_stop() => (Some(item), Vote::Item),
        Ok(Some(_)) => (
            None,
            Vote::Stop(
                interrupter
                    .get_message()
                    .unwrap_or_else(|| "interrupted".into()),
            ),
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

type TrainOut<LC> = <<LC as LearningComponentsTypes>::TrainingModel as TrainStep>::Output;
type ValidOut<LC> = <<LC as LearningComponentsTypes>::InferenceModel as InferenceStep>::Output;

impl<B, LC> SupervisedLearningStrategy<LC> for DdpStrategy<B>
where
    B: Backend,
    LC: LearningComponentsTypes<Backend = Autodiff<Ddp<B>>>,
    LC::TrainingModel: DdpModule,
    TrainOut<LC>: DistributedItem<Backend = Autodiff<Ddp<B>>>,
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
            let part = |name| checkpoint::RankCheckpointer {
                dir: dir.clone(),
                name,
                pg: pg.clone(),
            };
            let interrupter = components.interrupter.clone();
            components.checkpointer = Some(LearningCheckpointer::new(
                AsyncCheckpointer::new(part("model")).with_interrupter(interrupter.clone()),
                AsyncCheckpointer::new(part("optim")).with_interrupter(interrupter.clone()),
                AsyncCheckpointer::new(part("scheduler")).with_interrupter(interrupter),
                Box::new(KeepLastNCheckpoints::new(self.keep)),
            ));
        }

        let start = match self.resume_point(components.checkpoint) {
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
                vote = Vote::Stop(interrupter.get_message().unwrap_or_default());
            }
            if self.settle(self.agree(vote), &interrupter) == Flow::Stop {
                break;
            }
        }
        // Dropping the checkpointer waits for rank 0's last write.
        drop(checkpointer);
        (learner.model(), processor)
    }
}

impl<B: Backend> DdpStrategy<B> {
    /// The epoch to resume from, the same on every rank: an explicit one, else (with
    /// `with_resume`) the newest complete checkpoint rank 0 finds.
    fn resume_point(&self, explicit: Option<usize>) -> Result<Option<usize>> {
        let mine = match (explicit, &self.checkpoints) {
            (Some(e), _) => e as i64,
            (None, Some(dir)) if self.resumes() && self.is_main() => {
                checkpoint::newest_complete(dir).map_or(0, |e| e as i64)
            }
            _ => 0,
        };
        let mut epoch = [mine];
        self.session.group().broadcast(&mut epoch, Rank(0))?;
        Ok((epoch[0] > 0).then_some(epoch[0] as usize))
    }

    fn restore<LC: LearningComponentsTypes<Backend = Autodiff<Ddp<B>>>>(
        &self,
        learner: &mut Learner<LC>,
        epoch: usize,
    ) -> Result<()> {
        let Some(dir) = &self.checkpoints else {
            return Err(DdpError::Checkpoint {
                path: format!("epoch {epoch}"),
                what: "resuming",
                reason: format!(
                    "asks to resume from epoch {epoch}, but the strategy has no checkpoint \
                     directory: call DdpStrategy::with_checkpoints"
                ),
            });
        };
        let part = |name| checkpoint::RankCheckpointer {
            dir: dir.clone(),
            name,
            pg: self.session.group().clone(),
        };
        let err =
            |name: &str, e: burn::train::checkpoint::CheckpointerError| DdpError::Checkpoint {
                path: checkpoint::path(dir, name, epoch).display().to_string(),
                what: "restoring",
                reason: e.to_string(),
            };
        let model: LearnerModelRecord<LC> = part("model")
            .restore(epoch, &self.device)
            .map_err(|e| err("model", e))?;
        let optim: LearnerOptimizerRecord<LC> = part("optim")
            .restore(epoch, &self.device)
            .map_err(|e| err("optim", e))?;
        let sched: LearnerSchedulerRecord<LC> = part("scheduler")
            .restore(epoch, &self.device)
            .map_err(|e| err("scheduler", e))?;
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
        LC: LearningComponentsTypes<Backend = Autodiff<Ddp<B>>>,
        TrainOut<LC>: DistributedItem<Backend = Autodiff<Ddp<B>>>,
    {
        let epoch = global.items_processed;
        let mut iter = loader.iter();
        let mut iteration = 0;
        let mut accumulator = GradientsAccumulator::new();
        let mut accumulated = 0;
        loop {
            let (item, vote) = next_batch(&mut *iter, interrupter, "training");
            let decision = self.agree(vote);
            if let Ok(Decision::Go { all_items, .. }) = &decision {
                if !all_items {
                    if item.is_some() {
                        tracing::warn!(
                            "[rank {}] epoch {epoch}: another rank ran out of training batches \
                             first; the rest of this rank's are skipped (use a \
                             DistributedSampler so that every rank has as many)",
                            self.rank()
                        );
                    }
                    break;
                }
            }
            if self.settle(decision, interrupter) == Flow::Stop {
                return Flow::Stop;
            }
            let Some(item) = item else { break };
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
                None => learner.optimizer_step(out.grads),
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
        if self.is_main() {
            processor.process_train(LearnerEvent::EndEpoch(epoch));
        }
        Flow::Continue
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
        LC: LearningComponentsTypes<Backend = Autodiff<Ddp<B>>>,
        ValidOut<LC>: DistributedItem<Backend = Ddp<B>>,
    {
        let epoch = global.items_processed;
        let model = learner.model().valid();
        let mut iter = loader.iter();
        let mut iteration = 0;
        loop {
            let (item, vote) = next_batch(&mut *iter, interrupter, "validation");
            let decision = self.agree(vote);
            // Shards may differ by one item: go on while any rank has a batch.
            if let Ok(Decision::Go {
                any_item: false, ..
            }) = &decision
            {
                break;
            }
            if self.settle(decision, interrupter) == Flow::Stop {
                return Flow::Stop;
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

/// [`DdpStrategy`] on burn-train's `SupervisedTraining`: sets what each rank shows and logs,
/// launches, and reports a failure of any rank as an error.
pub trait DdpTraining<LC: LearningComponentsTypes> {
    /// Trains with `ddp`. Rank 0 shows Burn's dashboard when its output is a terminal and
    /// [`ProgressLines`] otherwise, and writes the metrics (and Burn's `experiment.log`, unless
    /// the program installed its own `tracing` subscriber) into the training directory; the
    /// other ranks show nothing and write nothing there ([`Headless`], [`NoMetricLogger`], no
    /// application log).
    ///
    /// # Errors
    /// Training stopped because a rank failed ([`DdpError::TrainingFailed`], naming it), a
    /// collective failed, or a checkpoint could not be restored.
    fn launch_ddp<B: Backend>(
        self,
        learner: Learner<LC>,
        ddp: &DdpStrategy<B>,
    ) -> Result<LearningResult<LC::InferenceModel>>
    where
        DdpStrategy<B>: SupervisedLearningStrategy<LC>;
}

impl<LC: LearningComponentsTypes + Send + 'static> DdpTraining<LC> for SupervisedTraining<LC> {
    fn launch_ddp<B: Backend>(
        self,
        learner: Learner<LC>,
        ddp: &DdpStrategy<B>,
    ) -> Result<LearningResult<LC::InferenceModel>>
    where
        DdpStrategy<B>: SupervisedLearningStrategy<LC>,
    {
        let strategy: Arc<dyn SupervisedLearningStrategy<LC>> = Arc::new(ddp.clone());
        let training = self.with_training_strategy(burn::train::TrainingStrategy::Custom(strategy));
        let training = if ddp.is_main() {
            let training = if std::io::stdout().is_terminal() {
                training
            } else {
                training.renderer(ProgressLines::default())
            };
            if tracing::dispatcher::has_been_set() {
                // The program logs already (a tracing subscriber of its own, say); Burn's
                // file logger could not install itself and would only warn.
                training.with_application_logger(None)
            } else {
                training
            }
        } else {
            training
                .renderer(Headless)
                .with_application_logger(None)
                .with_metric_logger(NoMetricLogger)
        };
        let result = training.launch(learner);
        match ddp.take_failure() {
            Some(e) => Err(e),
            None => Ok(result),
        }
    }
}
