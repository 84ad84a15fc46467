//! Training with burn-train's `SupervisedTraining` (the Learner, its dashboard, metrics and
//! checkpoints) on several processes: [`DdpStrategy`].
//!
//! ```no_run
//! # extern crate burn_ddp_burn021 as burn_ddp;
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
//! - `mod.rs`: [`DdpStrategy`] (its options), [`DdpTraining::launch_ddp`]
//! - `epochs.rs`: burn-train's `SupervisedLearningStrategy`: start, resume, the summary
//! - `driver.rs`: the run as burn-ddp-comm's epoch loop (`train::epoch::fit`) drives it
//! - `splits.rs`: the training and validation splits (`train::epoch::SplitSteps`)
//! - `handover.rs`: the Learner's state as bytes after a change of membership
//! - `item.rs`: [`DistributedItem`], the step outputs gathered to rank 0 for the metrics
//! - `checkpoint.rs`: checkpoints written by rank 0 and read back for every rank
//! - `render.rs`: what ranks other than 0 show and log ([`Headless`], [`NoMetricLogger`]), and
//!   [`ProgressLines`]
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
mod driver;
mod epochs;
mod fsdp;
mod handover;
mod item;
mod render;
mod splits;

use std::sync::Arc;

use burn_ddp_comm::train::strategy::StrategyState;
use burn_ddp_comm::train::terminal::{RankOutput, Renderer};

use burn::data::dataloader::Progress;
use burn::tensor::backend::Backend;
#[cfg(feature = "tui")]
use burn::train::renderer::tui::TuiMetricsRendererWrapper;
use burn::train::{
    Learner, LearningComponentsTypes, LearningResult, SupervisedLearningStrategy,
    SupervisedTraining,
};

pub use burn_ddp_comm::train::public::*;
pub use item::{DistributedItem, Part, TensorParts};
pub use render::{Headless, JobMetricLogger, NoMetricLogger, ProgressLines, WithMembership};

use crate::{DdpSession, Rank, Result};

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
#[doc = burn_ddp_comm::strategy_docs!()]
#[derive(Clone, Debug)]
pub struct DdpStrategy<B: Backend> {
    session: DdpSession,
    /// The model is sharded ([`DdpStrategy::fsdp`]): its gradients come reduce-scattered from
    /// backward, the session does not reduce them.
    fsdp: Option<std::sync::Arc<dyn fsdp::ShardedLearner>>,
    /// The global-norm clipping of a sharded model's gradients.
    clip: Option<f64>,
    device: B::Device,
    state: StrategyState,
}

burn_ddp_comm::strategy_options!(DdpStrategy<B: Backend>, state);

impl<B: Backend> DdpStrategy<B> {
    /// The strategy of this process's rank in `session`, training on `device` (for CUDA, the
    /// device of the rank's `LOCAL_RANK`).
    pub fn new(session: DdpSession, device: B::Device) -> Self {
        Self {
            state: StrategyState::new(session.group()),
            session,
            fsdp: None,
            clip: None,
            device,
        }
    }

    /// The strategy for a model sharded by `fsdp` (fully sharded data parallelism;
    /// [`crate::fsdp`]), training on `device`: `AB` is the Learner's autodiff backend
    /// (`Autodiff<Ddp<B>, BalancedCheckpointing>` to reshard after forward), `M` its model, `O`
    /// its optimizer (Adam, AdamW, or SGD without momentum: [`FsdpOptimizer`](crate::fsdp::FsdpOptimizer)), which
    /// the strategy, generic over any Learner, cannot name itself. Build the Learner with this
    /// rank's shards:
    ///
    /// ```text
    /// let fsdp = FullyShard::new(pg, FsdpConfig::default())?;
    /// let ddp = DdpStrategy::fsdp::<Train, Model<Train>, Adam>(fsdp.clone(), device.clone())?;
    /// let learner = Learner::new(fsdp.shard::<Train, _>(model)?, optimizer, scheduler);
    /// training.launch_ddp(learner, &ddp)?;
    /// ```
    ///
    /// As on Burn 0.22/0.23: each step's gradients come reduce-scattered from backward
    /// ([`FullyShard::sync`](crate::fsdp::FullyShard::sync), then
    /// [`with_clip_grad_norm`](Self::with_clip_grad_norm)'s clipping); each epoch's checkpoint
    /// is the whole model and optimizer state, written by rank 0 and resumed at any world size;
    /// the trained model is handed back whole. Here the checkpoint's model is gathered on the
    /// device (one whole model on each rank's device while it is written; the optimizer state
    /// goes through the host). Give every loader a [`DistributedSampler`](crate::DistributedSampler).
    ///
    /// # Errors
    /// As [`DdpSession::new`].
    pub fn fsdp<AB, M, O>(fsdp: crate::fsdp::FullyShard, device: B::Device) -> Result<Self>
    where
        AB: crate::fsdp::FsdpBackend + burn::tensor::backend::AutodiffBackend,
        M: burn::module::AutodiffModule<AB> + 'static,
        O: crate::fsdp::FsdpOptimizer<AB::InnerBackend> + 'static,
    {
        let session = DdpSession::new(fsdp.group().clone(), crate::DdpConfig::default())?;
        let mut strategy = Self::new(session, device);
        strategy.fsdp = Some(std::sync::Arc::new(fsdp::Typed::<AB, M, O> {
            fsdp,
            _types: std::marker::PhantomData,
        }));
        Ok(strategy)
    }

    /// With [`fsdp`](Self::fsdp): clips the gradients so that their L2 norm over the whole
    /// model (every rank's shards) is at most `max_norm` before each optimizer step.
    ///
    /// # Errors
    /// A strategy without FSDP (Burn's optimizer clipping does it there); a `max_norm` that is
    /// not finite and positive.
    pub fn with_clip_grad_norm(mut self, max_norm: f64) -> Result<Self> {
        let sharded = self.fsdp.is_some();
        self.clip = Some(burn_ddp_comm::grad::checked_clip_norm(sharded, max_norm)?);
        Ok(self)
    }

    /// The strategy with [`DdpConfig::default`](crate::DdpConfig) (PyTorch DDP's defaults) on
    /// process group `pg`, training on `device`.
    ///
    /// # Errors
    /// As [`DdpSession::new`].
    pub fn for_group(pg: crate::ProcessGroup, device: B::Device) -> Result<Self> {
        Ok(Self::new(
            DdpSession::new(pg, crate::DdpConfig::default())?,
            device,
        ))
    }

    /// The session.
    pub fn session(&self) -> &DdpSession {
        &self.session
    }

    fn rank(&self) -> Rank {
        self.state.rank()
    }

    /// Progress of this rank's loader, counted for the whole job
    /// ([`StrategyState::job_progress`]; `done`: the step's count in a fault-tolerant job).
    fn global(&self, p: Progress, done: Option<u64>) -> Progress {
        let (items_processed, items_total) =
            self.state
                .job_progress((p.items_processed, p.items_total), done, None);
        Progress {
            items_processed,
            items_total,
        }
    }
}

/// [`DdpStrategy`] on burn-train's `SupervisedTraining`: sets what each rank shows and logs,
/// launches, and reports a failure of any rank as an error.
pub trait DdpTraining<LC: LearningComponentsTypes> {
    /// Trains with `ddp`. Rank 0 shows Burn's dashboard when its output is a terminal and
    /// [`ProgressLines`] otherwise, and writes into the training directory: the metrics
    /// (`train/`, `valid/`), Burn's `experiment.log` (unless the program installed its own
    /// `tracing` subscriber) and the checkpoints. The other ranks show nothing and write
    /// nothing there ([`Headless`], [`NoMetricLogger`], no application log, no checkpoint).
    /// What a program makes before it launches (a directory, Burn's file checkpointer's
    /// `checkpoint/` directory) it makes on every rank: make the training directory with
    /// [`ProcessGroup::on_main`](crate::ProcessGroup::on_main) first.
    ///
    /// # Errors
    /// Training stopped because a rank failed ([`JobError::TrainingFailed`](crate::JobError::TrainingFailed), naming it), a
    /// collective failed, or a checkpoint could not be restored.
    fn launch_ddp<B: Backend>(
        self,
        learner: Learner<LC>,
        ddp: &DdpStrategy<B>,
    ) -> Result<LearningResult<LC::InferenceModel>>
    where
        DdpStrategy<B>: SupervisedLearningStrategy<LC>;

    /// [`launch_ddp`](Self::launch_ddp) for programs whose work after training is rank 0's
    /// alone (saving the model, Burn's evaluator, which writes into the training directory):
    /// every rank trains; rank 0 gets the result, the other ranks `None`, so that
    /// `let Some(result) = training.launch_ddp_main(learner, &ddp)? else { return Ok(()) };`
    /// keeps the rest of the program on rank 0.
    ///
    /// # Errors
    /// As [`launch_ddp`](Self::launch_ddp), on every rank.
    fn launch_ddp_main<B: Backend>(
        self,
        learner: Learner<LC>,
        ddp: &DdpStrategy<B>,
    ) -> Result<Option<LearningResult<LC::InferenceModel>>>
    where
        Self: Sized,
        DdpStrategy<B>: SupervisedLearningStrategy<LC>,
    {
        let main = ddp.is_main();
        let result = self.launch_ddp(learner, ddp)?;
        Ok(main.then_some(result))
    }

    /// This training with `ddp`, to launch as Burn's `launch` is: a program's
    /// `training.launch(Learner::new(...))` becomes
    /// `training.ddp(&ddp).launch_main(Learner::new(...))` (or `.launch(...)`).
    fn ddp<B: Backend>(self, ddp: &DdpStrategy<B>) -> DdpLaunch<'_, Self, B>
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
pub struct DdpLaunch<'a, T, B: Backend> {
    training: T,
    ddp: &'a DdpStrategy<B>,
}

impl<T, B: Backend> DdpLaunch<'_, T, B> {
    /// [`DdpTraining::launch_ddp`].
    ///
    /// # Errors
    /// As [`DdpTraining::launch_ddp`].
    pub fn launch<LC>(self, learner: Learner<LC>) -> Result<LearningResult<LC::InferenceModel>>
    where
        LC: LearningComponentsTypes,
        T: DdpTraining<LC>,
        DdpStrategy<B>: SupervisedLearningStrategy<LC>,
    {
        self.training.launch_ddp(learner, self.ddp)
    }

    /// [`DdpTraining::launch_ddp_main`]: the result on rank 0, `None` on the other ranks.
    ///
    /// # Errors
    /// As [`DdpTraining::launch_ddp`].
    pub fn launch_main<LC>(
        self,
        learner: Learner<LC>,
    ) -> Result<Option<LearningResult<LC::InferenceModel>>>
    where
        LC: LearningComponentsTypes,
        T: DdpTraining<LC>,
        DdpStrategy<B>: SupervisedLearningStrategy<LC>,
    {
        self.training.launch_ddp_main(learner, self.ddp)
    }
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
        // What this rank shows (with the job's membership where it can change: two more
        // metrics, `World size` and `Membership`) and writes.
        let board = &ddp.state.board;
        let fault_tolerant = ddp.session().group().is_fault_tolerant();
        let out = RankOutput::choose(ddp.is_main(), fault_tolerant, board.get().is_some());
        let pg = ddp.session().group();
        let mut lines = ProgressLines::default().showing_model(ddp.state.model.clone());
        if fault_tolerant {
            lines = lines.while_main_of(pg.clone());
        }
        let mut training = match out.renderer {
            Renderer::Lines => training.renderer(WithMembership::new(lines, board.clone())),
            #[cfg(feature = "tui")]
            Renderer::DashboardWithMembership => {
                // Burn's terminal dashboard, as burn-train would make it (without the epoch
                // of an explicit `SupervisedTraining::checkpoint`, which only its time
                // estimate uses).
                let tui = TuiMetricsRendererWrapper::new(training.interrupter(), None);
                training.renderer(WithMembership::new(tui, board.clone()))
            }
            // Without this crate's `tui` feature Burn's dashboard is not compiled in (Burn's
            // own `tui` may be, for its choice below): progress lines with the membership.
            #[cfg(not(feature = "tui"))]
            Renderer::DashboardWithMembership => {
                training.renderer(WithMembership::new(lines, board.clone()))
            }
            Renderer::Burn => training,
            Renderer::Headless => training.renderer(Headless),
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
            training = training.with_metric_logger(NoMetricLogger);
        }
        ddp.state.failure.or_result(training.launch(learner))
    }
}
