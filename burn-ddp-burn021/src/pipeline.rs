//! Pipeline parallelism: a model split into stages, one stage per rank of a pipeline group,
//! micro-batches run with the GPipe or 1F1B schedule (`torch.distributed.pipelining`'s
//! `ScheduleGPipe` and `Schedule1F1B`).
//!
//! Each rank builds only its own stage (a Burn module) and calls [`Pipeline::step`] once per
//! optimizer step with the same batch size as the other stages. The first stage cuts its input
//! into micro-batches and sends each one's output downstream; each later stage receives it,
//! runs its forward and passes its own output on; the last stage computes the loss of each
//! micro-batch (scaled by its share of the batch, so that the sum over micro-batches is the
//! loss of the whole batch). Backward goes the other way: the last stage differentiates the loss,
//! every other stage differentiates the surrogate `(y * dy).sum()` with the gradient `dy` it
//! receives for its output `y`, and every stage after the first sends the gradient of its input
//! upstream. Each stage's parameter gradients are summed over the micro-batches; the step
//! returns them for the optimizer, exactly the gradients of the unsplit model on the whole batch.
//! The schedule is walked by burn-ddp-comm's `StagePlan::run`, the same for every Burn line;
//! this module gives it Burn 0.21's tensors (`StageOps`).
//!
//! The messages are point-to-point ([`ProcessGroup::send_bytes`]) on the pipeline's group: a
//! group of processes (one stage per process, over TCP), or an in-process group
//! ([`ProcessGroup::local`]) for stages on several devices of one machine, one thread per device.
//! A stage that dies is named on every other rank within the heartbeat bound, as for any
//! collective.
//!
//! Hybrid (stages x replicas): [`HybridLayout`] splits the world into pipelines and, per stage,
//! the group of its replicas; run the pipeline step under a [`DdpSession`] of the replica group
//! with [`Pipeline::step_synced`], which averages each stage's gradients across its replicas.

use std::ops::{Deref, Range};

use burn::module::AutodiffModule;
use burn::optim::{GradientsAccumulator, GradientsParams};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{DType as BurnDType, ElementConversion, Tensor, TensorData};
use burn_ddp_comm::pipeline::{self as core, Activation, StageOps, StagePlan};
pub use burn_ddp_comm::pipeline::{ideal_busy_fraction, HybridLayout, Schedule};
use burn_ddp_comm::{ProcessGroup, Rank, Result};

use crate::ddp::DdpSession;

/// One rank's stage of a pipeline: the core's [`StagePlan`] (stage, schedule, group; its
/// accessors are this type's through `Deref`) and the executor on Burn 0.21 tensors.
#[derive(Debug, Clone)]
pub struct Pipeline {
    plan: StagePlan,
}

impl Deref for Pipeline {
    type Target = StagePlan;

    fn deref(&self) -> &StagePlan {
        &self.plan
    }
}

/// What the first stage feeds the pipeline (the batch, or its number of rows): the core's
/// [`core::StageInput`] of a Burn 0.21 tensor.
pub type StageInput<B, const D: usize> = core::StageInput<Tensor<B, D>>;

/// What one pipeline step produced on this rank: the core's [`core::StepOutput`] of Burn
/// 0.21's gradients.
pub type StepOutput = core::StepOutput<GradientsParams>;

impl Pipeline {
    /// This rank's stage of a pipeline whose stages are the ranks of `group`, in rank order
    /// (stage `s` is the group's rank `s`).
    ///
    /// # Errors
    /// [`ConfigError::InvalidOption`](burn_ddp_comm::ConfigError::InvalidOption) for zero micro-batches.
    pub fn new(group: ProcessGroup, schedule: Schedule, micro_batches: usize) -> Result<Self> {
        Ok(Self {
            plan: StagePlan::new(group, schedule, micro_batches)?,
        })
    }

    /// One step's forwards and backwards of this stage over every micro-batch, in the order of
    /// the schedule. `forward` is this stage's forward; `loss` (called on the last stage only)
    /// gets the last stage's output for the micro-batch of the given rows of the batch, and
    /// returns its mean loss (the step scales it by the micro-batch's share of the batch).
    ///
    /// Every stage must call it with the same batch size; the first with
    /// [`StageInput::Batch`], the others with [`StageInput::Rows`].
    ///
    /// # Errors
    /// A first stage without the batch (or a later stage with it), a batch smaller than the
    /// number of micro-batches, an activation that cannot travel (an element type other than
    /// f64/f32/f16/bf16), and every error of [`ProcessGroup::recv`] and
    /// [`ProcessGroup::send`] (a stage that died or stalls is named).
    pub fn step<B, M, const DI: usize, const DO: usize>(
        &self,
        module: &M,
        input: StageInput<B, DI>,
        mut forward: impl FnMut(&M, Tensor<B, DI>) -> Tensor<B, DO>,
        mut loss: impl FnMut(Tensor<B, DO>, Range<usize>) -> Tensor<B, 1>,
    ) -> Result<StepOutput>
    where
        B: AutodiffBackend,
        M: AutodiffModule<B>,
    {
        let (rows, batch) = input.split(|t| t.dims()[0]);
        let plan = self.plan.step_plan(rows, batch.is_some())?;
        let mut ops = Ops {
            rank: self.group().global_rank(),
            module,
            device: module.devices().into_iter().next().unwrap_or_default(),
            batch,
            forward: &mut forward,
            loss: &mut loss,
            acc: GradientsAccumulator::<M>::new(),
        };
        let total = self.plan.run(&plan, &mut ops)?;
        Ok(StepOutput {
            grads: ops.acc.grads(),
            loss: self.is_last().then_some(total),
        })
    }

    /// [`Pipeline::step`] for hybrid parallelism: the step runs without synchronisation
    /// ([`DdpSession::no_sync`]), then `session` (over this stage's replicas, see
    /// [`HybridLayout`]) averages the summed gradients across the replicas in buckets
    /// ([`DdpSession::sync_gradients`]). Each stage synchronises as soon as its own last
    /// backward is done, while the stages before it still run theirs.
    ///
    /// # Errors
    /// As [`Pipeline::step`] and [`DdpSession::sync_gradients`].
    pub fn step_synced<B, M, const DI: usize, const DO: usize>(
        &self,
        session: &DdpSession,
        module: &M,
        input: StageInput<B, DI>,
        forward: impl FnMut(&M, Tensor<B, DI>) -> Tensor<B, DO>,
        loss: impl FnMut(Tensor<B, DO>, Range<usize>) -> Tensor<B, 1>,
    ) -> Result<StepOutput>
    where
        B: AutodiffBackend,
        M: AutodiffModule<B>,
    {
        let out = {
            let _no_sync = session.no_sync();
            self.step(module, input, forward, loss)?
        };
        Ok(StepOutput {
            grads: session.sync_gradients(module, out.grads)?,
            loss: out.loss,
        })
    }
}

/// One step's tensors for the core's engine ([`StagePlan::run`]).
struct Ops<'a, B: AutodiffBackend, M: AutodiffModule<B>, F, L, const DI: usize> {
    rank: Rank,
    module: &'a M,
    device: B::Device,
    /// The batch, on the first stage.
    batch: Option<Tensor<B, DI>>,
    forward: &'a mut F,
    loss: &'a mut L,
    acc: GradientsAccumulator<M>,
}

impl<B, M, F, L, const DI: usize, const DO: usize> StageOps for Ops<'_, B, M, F, L, DI>
where
    B: AutodiffBackend,
    M: AutodiffModule<B>,
    F: FnMut(&M, Tensor<B, DI>) -> Tensor<B, DO>,
    L: FnMut(Tensor<B, DO>, Range<usize>) -> Tensor<B, 1>,
{
    type In = Tensor<B, DI>;
    type Out = Tensor<B, DO>;
    type Scalar = Tensor<B, 1>;

    fn dims(&self) -> (usize, usize) {
        (DI, DO)
    }

    fn slice(&mut self, rows: Range<usize>) -> Option<Tensor<B, DI>> {
        let batch = self.batch.as_ref()?;
        Some(batch.clone().narrow(0, rows.start, rows.len()))
    }

    fn input(&mut self, a: Activation) -> Result<Tensor<B, DI>> {
        Ok(tensor(a, &self.device))
    }

    fn forward(&mut self, x: &Tensor<B, DI>, grad: bool) -> (Tensor<B, DI>, Tensor<B, DO>) {
        let leaf = x.clone().detach();
        let leaf = if grad { leaf.require_grad() } else { leaf };
        let y = (self.forward)(self.module, leaf.clone());
        (leaf, y)
    }

    fn activation(&mut self, y: &Tensor<B, DO>) -> Result<Activation> {
        activation(self.rank, y.clone().into_data())
    }

    fn loss(&mut self, y: Tensor<B, DO>, rows: Range<usize>, share: f64) -> (Tensor<B, 1>, f64) {
        let l = (self.loss)(y, rows) * share;
        let value = l.clone().into_scalar().elem::<f64>();
        (l, value)
    }

    fn surrogate(&mut self, y: Tensor<B, DO>, grad: Activation) -> Result<Tensor<B, 1>> {
        Ok((y * tensor::<B, DO>(grad, &self.device)).sum())
    }

    fn backward(
        &mut self,
        surrogate: Tensor<B, 1>,
        x: &Tensor<B, DI>,
        input_grad: bool,
    ) -> Result<Option<Activation>> {
        let grads = surrogate.backward();
        let dx = match input_grad.then(|| x.grad(&grads)).flatten() {
            Some(dx) => Some(activation(self.rank, dx.into_data())?),
            None => None,
        };
        let module = self.module;
        self.acc
            .accumulate(module, GradientsParams::from_grads(grads, module));
        Ok(dx)
    }
}

/// Burn's float element type of wire code `code` (f32 for a code it does not know: the
/// receipt checked the length against the code's element size already).
fn dtype_of(code: u8) -> BurnDType {
    use BurnDType::{BF16, F16, F32, F64};
    core::float_type(code, &[F64, F32, F16, BF16], BurnDType::name).unwrap_or(F32)
}

fn activation(rank: Rank, data: TensorData) -> Result<Activation> {
    let shape = data.shape.as_slice().to_vec();
    Activation::of(rank, shape, data.dtype.name(), data.as_bytes().to_vec())
}

/// A received activation as a tensor on `device` (its length was checked on receipt).
fn tensor<B: Backend, const D: usize>(a: Activation, device: &B::Device) -> Tensor<B, D> {
    let dtype = dtype_of(a.dtype);
    Tensor::from_data(TensorData::from_bytes_vec(a.bytes, a.shape, dtype), device)
}
