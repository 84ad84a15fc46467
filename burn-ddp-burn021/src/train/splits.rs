//! The two splits of an epoch on burn-train 0.21, as the core's epoch loop runs them
//! (burn-ddp-comm's `train::epoch::run_split`): loading a batch and voting on it, one step,
//! the step's outputs gathered for rank 0's metrics, the end of the split.

use burn::data::dataloader::{DataLoaderIterator, Progress};
use burn::module::Module;
use burn::optim::{GradientsAccumulator, GradientsParams};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::train::{
    EventProcessorTraining, InferenceStep, Interrupter, Learner, LearnerEvent,
    LearningComponentsTypes, SupervisedTrainingEventProcessor, TrainStep, TrainingItem,
};
use burn_backend::BackendTypes;
use burn_ddp_comm::train::epoch::{
    guarded, Cursor, SplitSteps, StepAt, StepFault, StepResult, Stepped,
};
use burn_ddp_comm::train::parts::gather_merged;
use burn_ddp_comm::train::vote::{self, FailureSlot, Vote};

use super::{DdpStrategy, DistributedItem};
use crate::{Ddp, Result};

pub(super) type TrainIn<LC> = <<LC as LearningComponentsTypes>::TrainingModel as TrainStep>::Input;
pub(super) type TrainOut<LC> =
    <<LC as LearningComponentsTypes>::TrainingModel as TrainStep>::Output;
pub(super) type ValidIn<LC> =
    <<LC as LearningComponentsTypes>::InferenceModel as InferenceStep>::Input;
pub(super) type ValidOut<LC> =
    <<LC as LearningComponentsTypes>::InferenceModel as InferenceStep>::Output;

/// The next batch of `iter` and this rank's vote about it: a batch, none left, a stop asked
/// for (the interrupter), or a failure (a checkpoint rank 0 could not write, a panic while
/// loading the batch).
fn next_batch<I>(
    iter: &mut dyn DataLoaderIterator<I>,
    interrupter: &Interrupter,
    written: &FailureSlot,
    split: &str,
) -> (Option<I>, Vote) {
    if let Some(e) = written.message() {
        return (None, Vote::Failed(e));
    }
    match vote::load_batch(split, || iter.next().map(Ok::<_, std::convert::Infallible>)) {
        (Some(_), Vote::Item) if interrupter.should_stop() => {
            (None, interrupted(interrupter, written))
        }
        loaded => loaded,
    }
}

/// The vote of a rank whose interrupter was set: a failure if a checkpoint could not be written
/// (Burn's checkpointer reports it as a stop), else a stop with the interrupter's message.
pub(super) fn interrupted(interrupter: &Interrupter, written: &FailureSlot) -> Vote {
    vote::interrupted(written.message(), interrupter.get_message())
}

/// The batch `iter` gives next, and the positions of the split's order it used.
fn load<I>(
    iter: &mut dyn DataLoaderIterator<I>,
    interrupter: &Interrupter,
    written: &FailureSlot,
    split: &str,
) -> (Option<I>, Vote, u64) {
    let before = iter.progress().items_processed;
    let (item, vote) = next_batch(iter, interrupter, written, split);
    let used = iter.progress().items_processed.saturating_sub(before);
    (item, vote, used as u64)
}

impl<B: Backend> DdpStrategy<B> {
    /// Rank 0's buffers (BatchNorm's running statistics) in every rank's model, when
    /// `DdpConfig::broadcast_buffers` is on (the default).
    pub(super) fn sync_buffers<LC>(&self, learner: &mut Learner<LC>) -> Result<()>
    where
        LC: LearningComponentsTypes,
        LC::Backend: AutodiffBackend<InnerBackend = Ddp<B>> + BackendTypes<Device = B::Device>,
    {
        // A sharded model's buffers stay each rank's, as FSDP2's do (no prepared session).
        if self.fsdp.is_some() {
            return Ok(());
        }
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
}

/// What both splits hold besides their model.
pub(super) struct SplitParts<'r, B: Backend, LC: LearningComponentsTypes> {
    strategy: &'r DdpStrategy<B>,
    processor: &'r mut SupervisedTrainingEventProcessor<LC>,
    interrupter: &'r Interrupter,
    /// The epoch, of how many.
    global: Progress,
    /// Whether every rank processes every step's outputs (a fault-tolerant job: any rank may
    /// become rank 0, and then shows and writes the whole epoch's metrics).
    everywhere: bool,
}

impl<'r, B: Backend, LC: LearningComponentsTypes> SplitParts<'r, B, LC> {
    /// The parts of a split of `cursor`'s epoch, of `epochs`.
    pub(super) fn new(
        strategy: &'r DdpStrategy<B>,
        processor: &'r mut SupervisedTrainingEventProcessor<LC>,
        interrupter: &'r Interrupter,
        cursor: &Cursor,
        epochs: usize,
        fault_tolerant: bool,
    ) -> Self {
        Self {
            strategy,
            processor,
            interrupter,
            global: Progress {
                items_processed: cursor.epoch,
                items_total: epochs,
            },
            everywhere: fault_tolerant,
        }
    }
}

/// The training split: burn-train's learner, its loader, gradient accumulation.
pub(super) struct TrainSplit<'r, B: Backend, LC: LearningComponentsTypes> {
    pub(super) parts: SplitParts<'r, B, LC>,
    pub(super) learner: &'r mut Learner<LC>,
    pub(super) iter: Box<dyn DataLoaderIterator<TrainIn<LC>> + 'r>,
    pub(super) accumulation: Option<usize>,
    pub(super) accumulator: GradientsAccumulator<LC::TrainingModel>,
    pub(super) accumulated: usize,
    pub(super) item: Option<TrainIn<LC>>,
}

impl<B, LC> SplitSteps for TrainSplit<'_, B, LC>
where
    B: Backend,
    LC: LearningComponentsTypes,
    LC::Backend: AutodiffBackend<InnerBackend = Ddp<B>> + BackendTypes<Device = B::Device>,
    TrainOut<LC>: DistributedItem<Backend = LC::Backend>,
{
    type Out = (Option<TrainOut<LC>>, Progress, usize);

    fn load(&mut self) -> (Vote, u64) {
        let p = &self.parts;
        let (item, vote, used) = load(
            &mut *self.iter,
            p.interrupter,
            &p.strategy.state.written,
            "training",
        );
        self.item = item;
        (vote, used)
    }

    fn step(&mut self, at: StepAt) -> StepResult<Self::Out> {
        let Some(item) = at.batch(self.item.take()) else {
            return Ok((Stepped::NoBatch, None));
        };
        let ddp = self.parts.strategy;
        let session = &ddp.session;
        session.check_datasets()?;
        ddp.sync_buffers(self.learner)?;
        // A sharded model's gradients come reduce-scattered from backward: FSDP's `sync` (and
        // clipping) in place of the session's reduction.
        let reduce = |model: &LC::TrainingModel, grads| match &ddp.fsdp {
            Some(f) => f.sync(model, grads, ddp.clip),
            None => session.sync_gradients(model, grads),
        };
        let progress = ddp.global(self.iter.progress(), at.done);
        let learner = &mut *self.learner;
        // Micro-steps of an accumulation are reduced once, at the optimizer step; a partial
        // step after its backward (a rank without a batch has no backward to join).
        let local = self.accumulation.is_some() || !at.full;
        let out = item
            .map(|item| {
                guarded("the training step", item, |item| {
                    let _local = local.then(|| session.no_sync());
                    learner.train_step(item)
                })
            })
            .transpose()?;
        session.check()?;
        let (grads, out) = match out {
            Some(o) => (o.grads, Some(o.item)),
            None => (GradientsParams::new(), None),
        };
        let stepped = match self.accumulation {
            Some(k) => {
                learner.lr_step();
                if out.is_some() {
                    self.accumulator.accumulate(&learner.model(), grads);
                }
                self.accumulated += 1;
                if self.accumulated >= k {
                    let grads = reduce(&learner.model(), self.accumulator.grads())?;
                    learner.optimizer_step(grads);
                    self.accumulated = 0;
                    Stepped::Moved
                } else {
                    Stepped::Accumulated
                }
            }
            None if !at.full || ddp.fsdp.is_some() => {
                let grads = reduce(&learner.model(), grads)?;
                learner.lr_step();
                learner.optimizer_step(grads);
                Stepped::Moved
            }
            // Parameters this rank's batch did not use but others' did get the average.
            None => {
                let grads = session.complete(&learner.model(), grads)?;
                // After the synchronisation: a step that failed leaves the schedule where it
                // was.
                learner.lr_step();
                learner.optimizer_step(grads);
                Stepped::Moved
            }
        };
        Ok((stepped, Some((out, progress, at.iteration))))
    }

    fn report(&mut self, (out, progress, iteration): Self::Out) -> Result<()> {
        let p = &mut self.parts;
        if let Some(merged) = gather_merged(
            p.strategy.session.group(),
            out.map(DistributedItem::into_parts),
            p.everywhere,
            |r| DistributedItem::merge(r, &p.strategy.device),
        )? {
            p.processor
                .process_train(LearnerEvent::ProcessedItem(TrainingItem::new(
                    merged,
                    progress,
                    p.global.clone(),
                    Some(iteration),
                    Some(self.learner.lr_current()),
                )));
        }
        Ok(())
    }

    fn finish(&mut self) -> std::result::Result<(), StepFault> {
        // Validation and the checkpoint see rank 0's buffers on every rank.
        self.parts.strategy.sync_buffers(self.learner)?;
        if self.parts.strategy.is_main() || self.parts.everywhere {
            let epoch = self.parts.global.items_processed;
            self.parts
                .processor
                .process_train(LearnerEvent::EndEpoch(epoch));
        }
        Ok(())
    }

    fn asks_join(&self) -> bool {
        self.parts.strategy.session.group().join_pending()
    }

    fn mid_accumulation(&self) -> bool {
        self.accumulated != 0
    }

    fn interrupt(&self, message: &str) {
        self.parts.interrupter.stop(Some(message));
    }
}

/// The validation split: the model in inference mode over its loader.
pub(super) struct ValidSplit<'r, B: Backend, LC: LearningComponentsTypes> {
    pub(super) parts: SplitParts<'r, B, LC>,
    pub(super) model: LC::InferenceModel,
    pub(super) iter: Box<dyn DataLoaderIterator<ValidIn<LC>> + 'r>,
    pub(super) item: Option<ValidIn<LC>>,
}

impl<B, LC> SplitSteps for ValidSplit<'_, B, LC>
where
    B: Backend,
    LC: LearningComponentsTypes,
    LC::Backend: AutodiffBackend<InnerBackend = Ddp<B>> + BackendTypes<Device = B::Device>,
    ValidOut<LC>: DistributedItem<Backend = Ddp<B>>,
{
    type Out = (Option<ValidOut<LC>>, Progress, usize);

    fn load(&mut self) -> (Vote, u64) {
        let p = &self.parts;
        let (item, vote, used) = load(
            &mut *self.iter,
            p.interrupter,
            &p.strategy.state.written,
            "validation",
        );
        self.item = item;
        (vote, used)
    }

    fn step(&mut self, at: StepAt) -> StepResult<Self::Out> {
        let iteration = at.iteration;
        let progress = self.parts.strategy.global(self.iter.progress(), at.done);
        let model = &self.model;
        let out = self
            .item
            .take()
            .map(|i| guarded("the validation step", i, |i| model.step(i)))
            .transpose()?;
        Ok((Stepped::Moved, Some((out, progress, iteration))))
    }

    fn report(&mut self, (out, progress, iteration): Self::Out) -> Result<()> {
        let p = &mut self.parts;
        if let Some(merged) = gather_merged(
            p.strategy.session.group(),
            out.map(DistributedItem::into_parts),
            p.everywhere,
            |r| DistributedItem::merge(r, &p.strategy.device),
        )? {
            p.processor
                .process_valid(LearnerEvent::ProcessedItem(TrainingItem::new(
                    merged,
                    progress,
                    p.global.clone(),
                    Some(iteration),
                    None,
                )));
        }
        Ok(())
    }

    fn finish(&mut self) -> std::result::Result<(), StepFault> {
        if self.parts.strategy.is_main() || self.parts.everywhere {
            let epoch = self.parts.global.items_processed;
            self.parts
                .processor
                .process_valid(LearnerEvent::EndEpoch(epoch));
        }
        Ok(())
    }

    fn interrupt(&self, message: &str) {
        self.parts.interrupter.stop(Some(message));
    }
}
