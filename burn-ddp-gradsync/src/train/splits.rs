//! The two splits of an epoch on burn-train 0.22 and 0.23, as the core's epoch loop runs them
//! (burn-ddp-comm's `train::epoch::run_split`): loading a batch and voting on it, one step,
//! the step's outputs gathered for rank 0's metrics, the end of the split.

use burn::data::dataloader::{DataLoaderIterator, Progress};
use burn::optim::{GradientsAccumulator, GradientsParams};
use burn::train::{
    EventProcessorTraining, InferenceStep, Interrupter, Learner, LearnerEvent, LearnerModel,
    SupervisedTrainingEventProcessor, TrainStep, TrainingItem,
};
use burn_ddp_comm::train::epoch::{guarded, SplitSteps, StepAt, StepFault, StepResult, Stepped};
use burn_ddp_comm::train::parts::gather_merged;
use burn_ddp_comm::train::vote::{self, Vote};

use super::{DdpStrategy, DistributedItem};
use crate::fsdp::FullyShard;
use crate::{GradSync, Result};

pub(super) type TrainOut<M> = <M as TrainStep>::Output;
pub(super) type ValidOut<M> = <M as InferenceStep>::Output;

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
    vote::load_batch(split, || iter.next())
}

/// The vote of a rank whose interrupter was set: a failure if it holds an error (Burn's
/// checkpointer and event processor report theirs there), else a stop with its message.
pub(super) fn interrupted(interrupter: &Interrupter) -> Vote {
    let failed = interrupter.error().map(|e| e.to_string());
    vote::interrupted(failed, interrupter.get_message())
}

/// Rank 0's buffers (BatchNorm's running statistics) in every rank's model, when
/// `DdpConfig::broadcast_buffers` is on (the default). Not for a sharded model (`fsdp`), whose
/// buffers stay each rank's, as FSDP2's do.
fn sync_buffers<M: LearnerModel>(
    learner: &mut Learner<M>,
    sync: &mut GradSync,
    fsdp: Option<&FullyShard>,
) -> Result<()> {
    if fsdp.is_some() {
        return Ok(());
    }
    let model = learner.model();
    if !sync.buffers_to_sync(&model) {
        return Ok(());
    }
    let model = sync.sync_buffers(model)?;
    learner.load_model(model.into_record());
    Ok(())
}

/// The gradients reduced across the ranks (a sharded model's: reduce-scattered in backward,
/// then [`FullyShard::sync`] and the strategy's clipping by global norm), then one scheduler
/// and optimizer step.
fn optimizer_step<M: LearnerModel>(
    learner: &mut Learner<M>,
    sync: &mut GradSync,
    strategy: &DdpStrategy,
    grads: GradientsParams,
) -> Result<()> {
    let model = learner.model();
    let grads = match &strategy.fsdp {
        Some(fsdp) => {
            let grads = fsdp.sync(&model, grads)?;
            match strategy.clip {
                Some(max_norm) => fsdp.clip_grad_norm(&model, grads, max_norm)?.0,
                None => grads,
            }
        }
        None => sync.sync(&model, grads)?,
    };
    learner.lr_step();
    learner.optimizer_step(grads);
    Ok(())
}

/// What both splits hold besides their model.
pub(super) struct SplitParts<'r, M: LearnerModel> {
    pub(super) strategy: &'r DdpStrategy,
    pub(super) processor: &'r mut SupervisedTrainingEventProcessor<M>,
    pub(super) interrupter: &'r Interrupter,
    /// Every rank's items of the split (counted where the membership does not change).
    pub(super) total: Option<usize>,
    /// Whether every rank processes every step's outputs (a fault-tolerant job: any rank may
    /// become rank 0, and then shows and writes the whole epoch's metrics).
    pub(super) everywhere: bool,
    /// The progress of the split's last step, for the whole job (its end event carries it).
    pub(super) last: Option<Progress>,
}

impl<M: LearnerModel> SplitParts<'_, M> {
    /// The job's progress at this step (kept as the split's last).
    fn global(&mut self, p: Progress, done: Option<u64>) -> Progress {
        let p = self.strategy.global(p, self.total, done);
        self.last = Some(p.clone());
        p
    }

    fn load<I>(&self, iter: &mut dyn DataLoaderIterator<I>, split: &str) -> (Option<I>, Vote, u64) {
        let before = iter.progress().items_processed;
        let (item, vote) = next_batch(iter, self.interrupter, split);
        let used = iter.progress().items_processed.saturating_sub(before);
        (item, vote, used as u64)
    }
}

/// The training split: burn-train's learner, its loader, gradient accumulation.
pub(super) struct TrainSplit<'r, M: LearnerModel> {
    pub(super) parts: SplitParts<'r, M>,
    pub(super) learner: &'r mut Learner<M>,
    pub(super) sync: &'r mut GradSync,
    pub(super) iter: Box<dyn DataLoaderIterator<<M as TrainStep>::Input> + 'r>,
    pub(super) accumulation: Option<usize>,
    pub(super) accumulator: GradientsAccumulator<M>,
    pub(super) accumulated: usize,
    pub(super) item: Option<<M as TrainStep>::Input>,
}

impl<M> SplitSteps for TrainSplit<'_, M>
where
    M: LearnerModel,
    TrainOut<M>: DistributedItem,
{
    type Out = (Option<TrainOut<M>>, Progress, usize);

    fn load(&mut self) -> (Vote, u64) {
        let (item, vote, used) = self.parts.load(&mut *self.iter, "training");
        self.item = item;
        (vote, used)
    }

    fn step(&mut self, at: StepAt) -> StepResult<Self::Out> {
        let Some(item) = at.batch(self.item.take()) else {
            return Ok((Stepped::NoBatch, None));
        };
        let strategy = self.parts.strategy;
        sync_buffers(self.learner, self.sync, strategy.fsdp.as_ref())?;
        let progress = self.parts.global(self.iter.progress(), at.done);
        let learner = &mut *self.learner;
        // The step whose gradients are reduced runs on the overlapped model (`DdpConfig::
        // overlap`, on by default): its buckets go during backward, the micro-steps
        // accumulated before it added by the hooks. Its own `GradientsParams` come back empty
        // (the hooked parameters keep no gradient); `sync` writes the reduced ones.
        // A sharded model's gradients come reduce-scattered from backward: nothing to overlap.
        let syncs_now = self.accumulation.is_none_or(|k| self.accumulated + 1 >= k);
        let overlapped = match (&item, syncs_now && strategy.fsdp.is_none()) {
            (Some(_), true) => {
                let model = learner.model();
                Some(match self.accumulation {
                    Some(_) => self
                        .sync
                        .overlapped_after(&model, self.accumulator.grads())?,
                    None => self.sync.overlapped(&model)?,
                })
            }
            _ => None,
        };
        let out = item
            .map(|item| {
                guarded("the training step", item, |item| match &overlapped {
                    Some(model) => TrainStep::step(model, item),
                    None => learner.train_step(item),
                })
            })
            .transpose()?;
        let (grads, out) = match out {
            Some(o) => (o.grads, Some(o.item)),
            None => (GradientsParams::new(), None),
        };
        let stepped = match self.accumulation {
            Some(k) => {
                if out.is_some() {
                    self.accumulator.accumulate(&learner.model(), grads);
                }
                self.accumulated += 1;
                if self.accumulated >= k {
                    self.accumulated = 0;
                    optimizer_step(learner, self.sync, strategy, self.accumulator.grads())?;
                    Stepped::Moved
                } else {
                    Stepped::Accumulated
                }
            }
            None => {
                optimizer_step(learner, self.sync, strategy, grads)?;
                Stepped::Moved
            }
        };
        Ok((stepped, Some((out, progress, at.iteration))))
    }

    fn report(&mut self, (out, progress, iteration): Self::Out) -> Result<()> {
        let p = &mut self.parts;
        let device = p.strategy.device.clone().inner();
        if let Some(merged) = gather_merged(
            p.strategy.group(),
            out.map(DistributedItem::into_parts),
            p.everywhere,
            |r| DistributedItem::merge(r, &device),
        )? {
            let event = LearnerEvent::ProcessedItem(TrainingItem::new(
                merged,
                progress,
                Some(iteration),
                Some(self.learner.lr_current()),
            ));
            p.interrupter
                .fail_on_error(p.processor.process_train(event));
        }
        Ok(())
    }

    fn finish(&mut self) -> std::result::Result<(), StepFault> {
        // The last micro-steps of the epoch: every rank ran as many (the loop goes on only
        // while every rank has a batch, or, a partial step, counts one on the ranks without),
        // so every rank steps here, or none.
        let strategy = self.parts.strategy;
        if self.accumulated > 0 {
            self.accumulated = 0;
            optimizer_step(self.learner, self.sync, strategy, self.accumulator.grads())?;
        }
        // Validation and the checkpoint see rank 0's buffers on every rank.
        sync_buffers(self.learner, self.sync, strategy.fsdp.as_ref())?;
        Ok(())
    }

    fn asks_join(&self) -> bool {
        self.parts.strategy.group().join_pending()
    }

    fn mid_accumulation(&self) -> bool {
        self.accumulated != 0
    }

    fn interrupt(&self, message: &str) {
        self.parts.interrupter.stop(Some(message));
    }
}

/// The validation split: the model in inference mode over its loader.
pub(super) struct ValidSplit<'r, M: LearnerModel> {
    pub(super) parts: SplitParts<'r, M>,
    pub(super) model: M,
    pub(super) iter: Box<dyn DataLoaderIterator<<M as InferenceStep>::Input> + 'r>,
    pub(super) item: Option<<M as InferenceStep>::Input>,
}

impl<M> SplitSteps for ValidSplit<'_, M>
where
    M: LearnerModel,
    ValidOut<M>: DistributedItem,
{
    type Out = (Option<ValidOut<M>>, Progress, usize);

    fn load(&mut self) -> (Vote, u64) {
        let (item, vote, used) = self.parts.load(&mut *self.iter, "validation");
        self.item = item;
        (vote, used)
    }

    fn step(&mut self, at: StepAt) -> StepResult<Self::Out> {
        let iteration = at.iteration;
        let progress = self.parts.global(self.iter.progress(), at.done);
        let model = &self.model;
        let out = self
            .item
            .take()
            .map(|i| guarded("the validation step", i, |i| InferenceStep::step(model, i)))
            .transpose()?;
        Ok((Stepped::Moved, Some((out, progress, iteration))))
    }

    fn report(&mut self, (out, progress, iteration): Self::Out) -> Result<()> {
        let p = &mut self.parts;
        let device = p.strategy.device.clone().inner();
        if let Some(merged) = gather_merged(
            p.strategy.group(),
            out.map(DistributedItem::into_parts),
            p.everywhere,
            |r| DistributedItem::merge(r, &device),
        )? {
            let event = LearnerEvent::ProcessedItem(TrainingItem::new(
                merged,
                progress,
                Some(iteration),
                None,
            ));
            p.interrupter
                .fail_on_error(p.processor.process_valid(event));
        }
        Ok(())
    }

    fn interrupt(&self, message: &str) {
        self.parts.interrupter.stop(Some(message));
    }
}
