//! Training with burn-train's `SupervisedTraining` (the Learner, its dashboard, metrics and
//! checkpoints) on several processes: [`DdpStrategy`], a `SupervisedLearningStrategy` for
//! `TrainingStrategy::Custom`.
//!
//! ```no_run
//! # #[cfg(feature = "burn-0-22")] extern crate burn022 as burn;
//! # #[cfg(feature = "burn-0-23")] extern crate burn023 as burn;
//! # use burn::train::{Learner, LearnerModel, SupervisedTraining};
//! # fn doc<M: LearnerModel>(training: SupervisedTraining<M>, learner: Learner<M>,
//! #     ddp: burn_ddp::train::DdpStrategy) -> burn_ddp::Result<()>
//! # where burn_ddp::train::DdpStrategy: burn::train::SupervisedLearningStrategy<M> {
//! use burn_ddp::train::DdpTraining;
//! // `ddp` = DdpStrategy::for_group(ProcessGroup::from_env()?, device)?, once per process.
//! let result = training.launch_ddp(learner, &ddp)?; // an error if any rank failed
//! # Ok(()) }
//! ```
//!
//! - `mod.rs`: [`DdpStrategy`] (its options), [`DdpTraining::launch_ddp`]
//! - `epochs.rs`: burn-train's `SupervisedLearningStrategy`: start, resume, the summary
//! - `driver.rs`: the run as burn-ddp-comm's epoch loop (`train::epoch::fit`) drives it
//! - `splits.rs`: the training and validation splits (`train::epoch::SplitSteps`)
//! - `handover.rs`: the Learner's state as bytes after a change of membership
//! - `fsdp.rs`: a model sharded by FSDP ([`DdpStrategy::fsdp`]): whole checkpoints from the
//!   shards, resume at any world size
//! - `item.rs`: [`DistributedItem`], the step outputs gathered to rank 0 for the metrics
//! - `checkpoint.rs`: checkpoints written by rank 0 and read back for every rank
//! - `render.rs`: what ranks other than 0 show and log ([`Headless`], [`NoMetricLogger`]), and
//!   [`ProgressLines`]
//!
//! What the strategy does on every rank, per step: one small all-reduce in which every rank
//! says whether it has a batch, wants to stop (a quit in the dashboard, an interrupter) or
//! failed (a data error, a checkpoint rank 0 could not write); then the training step
//! (forward and backward on this rank's batch); then the gradients reduced across the ranks
//! ([`GradSync`], after backward: Burn 0.22 and 0.23 leave no way to start during it)
//! and the optimizer step; then the step's output items gathered to rank 0, which merges them
//! ([`DistributedItem`]) so that the dashboard's metrics are those of the whole job. Validation
//! is sharded the same way and merged the same way. A decision to stop — by any rank, for any
//! reason — is taken by every rank at the same step, so no rank is left waiting in a
//! collective. The Burn-free half of all this is burn-ddp-comm's `train` module, shared with
//! the Burn 0.21 line.

mod checkpoint;
mod driver;
mod epochs;
mod fsdp;
mod handover;
mod item;
mod render;
mod splits;

use std::sync::{Arc, Mutex};

use burn::data::dataloader::Progress;
use burn::tensor::Device;
#[cfg(feature = "tui")]
use burn::train::renderer::tui::TuiMetricsRendererWrapper;
use burn::train::{
    Learner, LearnerModel, LearningResult, SupervisedLearningStrategy, SupervisedTraining,
    TrainingStrategy,
};
use burn_ddp_comm::train::strategy::StrategyState;
use burn_ddp_comm::train::terminal::{RankOutput, Renderer};

pub use burn_ddp_comm::train::public::*;
pub use item::{DistributedItem, Part, TensorParts};
#[cfg(test)]
pub(crate) use render::tests as render_tests;
pub use render::{Headless, JobMetricLogger, NoMetricLogger, ProgressLines, WithMembership};

use crate::fsdp::FullyShard;
use crate::{ConfigError, DdpConfig, DdpError, GradSync, ProcessGroup, Rank, Result};

/// burn-train's `SupervisedLearningStrategy` for one process per rank: use it through
/// [`DdpTraining::launch_ddp`], or pass `TrainingStrategy::Custom(Arc::new(strategy))` to
/// `SupervisedTraining` yourself.
///
/// The output items of the model's training and validation steps must be
/// [`DistributedItem`]s (burn-train's classification and regression outputs are).
///
/// - **Start**: every rank resumes from the same checkpoint epoch (if any), then the model is
///   checked across ranks and rank 0's weights are loaded everywhere
///   ([`GradSync::prepare`]).
/// - **Steps**: forward and backward on this rank's batch, the gradients reduced across every
///   rank ([`GradSync::sync`]: bucketed, each bucket all-reduced while the next is packed), the
///   optimizer step. With `grads_accumulation(k)` the micro-steps' gradients are summed
///   locally and reduced once per optimizer step.
#[doc = burn_ddp_comm::strategy_docs!()]
#[derive(Clone, Debug)]
pub struct DdpStrategy {
    sync: Arc<Mutex<GradSync>>,
    /// The model is sharded ([`DdpStrategy::fsdp`]): its gradients come reduce-scattered
    /// from backward, `sync` is not used for them.
    fsdp: Option<FullyShard>,
    /// The global-norm clipping of a sharded model's gradients ([`DdpStrategy::with_clip_grad_norm`]).
    clip: Option<f64>,
    device: Device,
    state: StrategyState,
}

burn_ddp_comm::strategy_options!(DdpStrategy, state);

impl DdpStrategy {
    /// The strategy of this process's rank, reducing gradients with `sync`, training on
    /// `device` (made an autodiff device if it is not one).
    pub fn new(sync: GradSync, device: Device) -> Self {
        let device = if device.is_autodiff() {
            device
        } else {
            device.autodiff()
        };
        Self {
            state: StrategyState::new(sync.group()),
            sync: Arc::new(Mutex::new(sync)),
            fsdp: None,
            clip: None,
            device,
        }
    }

    /// The strategy for a model sharded by `fsdp` (fully sharded data parallelism, FSDP2's
    /// `fully_shard`; [`crate::fsdp`]), training on `device`. Build the Learner with this
    /// rank's shards, as FSDP2 shards before the optimizer is made:
    ///
    /// ```text
    /// let fsdp = FullyShard::new(pg, FsdpConfig::default())?;
    /// let ddp = DdpStrategy::fsdp(fsdp.clone(), device.clone())?;
    /// let learner = Learner::new(fsdp.shard(model)?, optimizer, scheduler);
    /// training.launch_ddp(learner, &ddp)?;
    /// ```
    ///
    /// - **Steps**: forward and backward on this rank's batch; each block's parameters are
    ///   gathered in forward (`fsdp::gather` in the model's code) and its gradients
    ///   reduce-scattered to the shards in backward; [`FullyShard::sync`] then returns the
    ///   step's failures and averages the few parameters left whole; Burn's optimizer steps the
    ///   shards. Accumulation sums the micro-steps' shards. Burn's own gradient clipping
    ///   (`GradientClipping` in the optimizer's config) would clip each shard by its own norm:
    ///   leave it off and use [`with_clip_grad_norm`](Self::with_clip_grad_norm), the norm of
    ///   the whole model over every rank's shards.
    /// - **Checkpoints** (`with_checkpoints`): at each epoch's end every rank's shards of the
    ///   model and of the optimizer state are gathered, on the host, into one whole record
    ///   each, which rank 0 writes (no rank holds the whole model on its device). A resume
    ///   (`with_resume`, or Burn's `checkpoint(epoch)`) at any world size cuts them again.
    /// - **The result**: the trained model gathered whole on every rank
    ///   (`LearningResult::model`), one whole model on each rank's device at the end.
    ///
    /// Each rank must run every step: give every loader a [`DistributedSampler`](crate::DistributedSampler) (its shards are
    /// padded to even ones). A fault-tolerant job is refused by [`FullyShard::new`].
    ///
    /// `device` is made an autodiff device if it is not one, with gradient checkpointing when
    /// the parameters are resharded after forward (`FsdpConfig::reshard_after_forward`, the
    /// default: Burn's checkpointing gathers them again in backward).
    ///
    /// # Errors
    /// As [`GradSync::new`]; resharding after forward on an autodiff `device` without gradient
    /// checkpointing (the fixes in the message).
    pub fn fsdp(fsdp: FullyShard, device: Device) -> Result<Self> {
        let reshard = fsdp.config().reshard_after_forward;
        let device = match (device.is_autodiff(), reshard) {
            (false, true) => device.autodiff().gradient_checkpointing(),
            (false, false) => device.autodiff(),
            (true, _) => device,
        };
        let balanced = Some(burn::tensor::GradientCheckpointingStrategy::Balanced);
        if reshard && device.gradient_checkpointing_strategy() != balanced {
            return Err(DdpError::Config(ConfigError::InvalidConfig {
                field: "DdpStrategy::fsdp",
                reason: "resharding after forward needs a device with gradient checkpointing, \
                         whose backward gathers each block's parameters again: pass \
                         `device.autodiff().gradient_checkpointing()` (or the plain device), \
                         or keep the gathered parameters with \
                         `FsdpConfig::default().with_reshard_after_forward(false)`",
            }));
        }
        let sync = GradSync::new(fsdp.group().clone(), DdpConfig::default())?;
        let mut strategy = Self::new(sync, device);
        strategy.fsdp = Some(fsdp);
        Ok(strategy)
    }

    /// With [`fsdp`](Self::fsdp): clips the gradients so that their L2 norm over the whole
    /// model (every rank's shards) is at most `max_norm` before each optimizer step
    /// ([`FullyShard::clip_grad_norm`], PyTorch's `clip_grad_norm_` on an FSDP model).
    ///
    /// # Errors
    /// A strategy without FSDP (Burn's optimizer clipping does it there: the gradients are
    /// whole); a `max_norm` that is not finite and positive.
    pub fn with_clip_grad_norm(mut self, max_norm: f64) -> Result<Self> {
        let sharded = self.fsdp.is_some();
        self.clip = Some(burn_ddp_comm::grad::checked_clip_norm(sharded, max_norm)?);
        Ok(self)
    }

    /// The strategy with [`DdpConfig::default`] (PyTorch DDP's bucket sizes, the mean) on
    /// process group `pg`, training on `device`.
    ///
    /// # Errors
    /// As [`GradSync::new`].
    pub fn for_group(pg: ProcessGroup, device: Device) -> Result<Self> {
        Ok(Self::new(GradSync::new(pg, DdpConfig::default())?, device))
    }

    /// The process group.
    pub fn group(&self) -> &ProcessGroup {
        self.state.group()
    }

    /// Of the last training step, if its communication overlapped its backward (the default,
    /// `DdpConfig::overlap`): how many of its buckets left before backward ended, of how many
    /// ([`GradSync::sent_during_backward`]).
    pub fn sent_during_backward(&self) -> Option<(usize, usize)> {
        self.sync
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .sent_during_backward()
    }

    fn rank(&self) -> Rank {
        self.state.rank()
    }

    /// Progress of this rank's loader counted for the whole job
    /// ([`StrategyState::job_progress`]): `total`, every rank's items, when counted (a job
    /// whose membership does not change); `done`, the step's count in a fault-tolerant job.
    fn global(&self, p: Progress, total: Option<usize>, done: Option<u64>) -> Progress {
        let (processed, mine) = crate::release::counts(&p);
        let (done, total) =
            self.state
                .job_progress((processed, mine.unwrap_or(processed)), done, total);
        // A total this rank's loader does not know stays unknown for the job.
        crate::release::progress(done, mine.map(|_| total), p.unit)
    }
}

/// [`DdpStrategy`] on burn-train's `SupervisedTraining`: sets what each rank shows and
/// logs, launches, and reports a failure of any rank as an error.
pub trait DdpTraining<M: LearnerModel> {
    /// Trains with `ddp`. Rank 0 shows Burn's dashboard when its output is a terminal and
    /// [`ProgressLines`] otherwise, and writes into the training directory: the metrics
    /// (`train/`, `valid/`), the progress logger's file (`with_progress_logger`), Burn's
    /// `experiment.log` (unless the program installed its own `tracing` subscriber) and the
    /// checkpoints. The other ranks show nothing and write nothing there ([`Headless`] as their
    /// renderer and progress logger, [`NoMetricLogger`], no application log, no checkpoint).
    /// What a program makes before it launches (a directory, a progress logger's file, Burn's
    /// file checkpointer's `checkpoint/` directory) it makes on every rank: make the training
    /// directory with [`ProcessGroup::on_main`] first.
    ///
    /// # Errors
    /// Training stopped because a rank failed ([`JobError::TrainingFailed`](crate::JobError::TrainingFailed), naming it), a
    /// collective failed, or a checkpoint could not be restored. (An error of Burn's own on
    /// this rank, such as a metric that failed, stays in the result's `error`, as with
    /// `launch`.)
    fn launch_ddp(self, learner: Learner<M>, ddp: &DdpStrategy) -> Result<LearningResult<M>>
    where
        DdpStrategy: SupervisedLearningStrategy<M>;

    /// [`launch_ddp`](Self::launch_ddp) for programs whose work after training is rank 0's
    /// alone (saving the model, Burn's evaluator, which writes into the training directory):
    /// every rank trains; rank 0 gets the result, the other ranks `None`, so that
    /// `let Some(result) = training.launch_ddp_main(learner, &ddp)? else { return Ok(()) };`
    /// keeps the rest of the program on rank 0.
    ///
    /// # Errors
    /// As [`launch_ddp`](Self::launch_ddp), on every rank.
    fn launch_ddp_main(
        self,
        learner: Learner<M>,
        ddp: &DdpStrategy,
    ) -> Result<Option<LearningResult<M>>>
    where
        Self: Sized,
        DdpStrategy: SupervisedLearningStrategy<M>,
    {
        let main = ddp.is_main();
        let result = self.launch_ddp(learner, ddp)?;
        Ok(main.then_some(result))
    }

    /// This training with `ddp`, to launch as Burn's `launch` is: a program's
    /// `training.launch(Learner::new(...))` becomes
    /// `training.ddp(&ddp).launch_main(Learner::new(...))` (or `.launch(...)`).
    fn ddp(self, ddp: &DdpStrategy) -> DdpLaunch<'_, Self>
    where
        Self: Sized,
    {
        DdpLaunch {
            training: self,
            ddp,
        }
    }
}

/// A training and the strategy it trains with ([`DdpTraining::ddp`]).
#[derive(Debug)]
pub struct DdpLaunch<'a, T> {
    training: T,
    ddp: &'a DdpStrategy,
}

impl<T> DdpLaunch<'_, T> {
    /// [`DdpTraining::launch_ddp`].
    ///
    /// # Errors
    /// As [`DdpTraining::launch_ddp`].
    pub fn launch<M>(self, learner: Learner<M>) -> Result<LearningResult<M>>
    where
        M: LearnerModel,
        T: DdpTraining<M>,
        DdpStrategy: SupervisedLearningStrategy<M>,
    {
        self.training.launch_ddp(learner, self.ddp)
    }

    /// [`DdpTraining::launch_ddp_main`]: the result on rank 0, `None` on the other ranks.
    ///
    /// # Errors
    /// As [`DdpTraining::launch_ddp`].
    pub fn launch_main<M>(self, learner: Learner<M>) -> Result<Option<LearningResult<M>>>
    where
        M: LearnerModel,
        T: DdpTraining<M>,
        DdpStrategy: SupervisedLearningStrategy<M>,
    {
        self.training.launch_ddp_main(learner, self.ddp)
    }
}

impl<M: LearnerModel> DdpTraining<M> for SupervisedTraining<M> {
    fn launch_ddp(self, learner: Learner<M>, ddp: &DdpStrategy) -> Result<LearningResult<M>>
    where
        DdpStrategy: SupervisedLearningStrategy<M>,
    {
        let strategy: Arc<dyn SupervisedLearningStrategy<M>> = Arc::new(ddp.clone());
        let training = self.with_training_strategy(TrainingStrategy::Custom(strategy));
        let board = &ddp.state.board;
        let pg = ddp.group();
        let fault_tolerant = pg.is_fault_tolerant();
        let out = RankOutput::choose(ddp.is_main(), fault_tolerant, board.get().is_some());
        let mut lines = ProgressLines::default().showing_model(ddp.state.model.clone());
        if fault_tolerant {
            lines = lines.while_main_of(pg.clone());
        }
        let mut training = match out.renderer {
            Renderer::Lines => {
                training.renderer(Box::new(WithMembership::new(lines, board.clone())))
            }
            #[cfg(feature = "tui")]
            Renderer::DashboardWithMembership => {
                // Burn's terminal dashboard, as burn-train would make it (without the epoch
                // of an explicit `SupervisedTraining::checkpoint`, which only its time
                // estimate uses).
                let tui = TuiMetricsRendererWrapper::new(training.interrupter(), None);
                training.renderer(Box::new(WithMembership::new(tui, board.clone())))
            }
            // Without this crate's `tui` feature Burn's dashboard is not compiled in (Burn's
            // own `tui` may be, for its choice below): progress lines with the membership.
            #[cfg(not(feature = "tui"))]
            Renderer::DashboardWithMembership => {
                training.renderer(Box::new(WithMembership::new(lines, board.clone())))
            }
            Renderer::Burn => training,
            Renderer::Headless => training.renderer(Box::new(Headless)),
        };
        if !out.application_log {
            training = training.with_application_logger(None);
        }
        // In a fault-tolerant job every rank records the metrics and the one that is rank 0
        // writes them (where the strategy knows the training directory).
        let metric_dir = ddp.state.metric_dir().filter(|_| fault_tolerant);
        if let Some(dir) = metric_dir {
            let log = ddp.state.metrics.clone();
            training = training.with_metric_logger(JobMetricLogger::new(dir, log, pg.clone()));
        } else if !out.metric_files {
            // Burn's own loggers write into the training directory: rank 0's alone.
            training = training.with_metric_logger(NoMetricLogger);
        }
        if !out.metric_files {
            training = training.with_progress_logger(Headless);
        }
        ddp.state.failure.or_result(training.launch(learner))
    }
}
