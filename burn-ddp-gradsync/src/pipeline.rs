//! Pipeline parallelism on Burn 0.22.1 and 0.23: a model split into stages, one per rank of a
//! pipeline group, micro-batches run with the GPipe or 1F1B schedule; and hybrid parallelism, the
//! pipeline replicated data-parallel ([`HybridLayout`], [`Pipeline::step_synced`] with a
//! [`GradSync`] on the stage's replica group).
//!
//! The core's step (burn-ddp-comm's `StagePlan::run`, as for the Burn 0.21 line) over Burn
//! tensors (`StageOps`), with the core's schedules, tags and activation framing: the first
//! stage cuts its batch into micro-batches; activations go downstream and their gradients
//! upstream as point-to-point messages; the last stage scales each micro-batch's loss by its
//! share of the batch; every stage sums its parameter gradients over the micro-batches, which
//! makes them the unsplit model's gradients on the whole batch.
//! A micro-batch's forward is recomputed at its backward unless the backward follows it directly
//! (Burn's autodiff frees the graphs that share parameters with the one whose backward runs, so
//! several graphs cannot wait for their backward at once).

use std::ops::{Deref, Range};

use burn::module::Module;
use burn::optim::{GradientsAccumulator, GradientsParams};
use burn::tensor::{DType as BurnDType, Device, Tensor, TensorData};
use burn_ddp_comm::pipeline::{self as core, Activation, StageOps, StagePlan};
pub use burn_ddp_comm::pipeline::{ideal_busy_fraction, HybridLayout, Schedule};
use burn_ddp_comm::{DdpError, ProcessGroup, Rank, Result};

use crate::GradSync;

/// One rank's stage of a pipeline: the core's [`StagePlan`] (stage, schedule, group; its
/// accessors are this type's through `Deref`) and the executor on Burn tensors.
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
/// [`core::StageInput`] of a Burn tensor.
pub type StageInput<const D: usize> = core::StageInput<Tensor<D>>;

/// What one pipeline step produced on this rank: the core's [`core::StepOutput`] of Burn's
/// gradients.
pub type StepOutput = core::StepOutput<GradientsParams>;

impl Pipeline {
    /// This rank's stage of a pipeline whose stages are the ranks of `group`, in rank order.
    ///
    /// # Errors
    /// [`ConfigError::InvalidOption`](burn_ddp_comm::ConfigError::InvalidOption) for zero micro-batches.
    pub fn new(group: ProcessGroup, schedule: Schedule, micro_batches: usize) -> Result<Self> {
        Ok(Self {
            plan: StagePlan::new(group, schedule, micro_batches)?,
        })
    }

    /// One step's forwards and backwards of this stage over every micro-batch, in the order of
    /// the schedule; see `burn_ddp::pipeline::Pipeline::step` (the Burn 0.21 line) for the
    /// contract, which is the same. `device` is where this stage's module and inputs live.
    ///
    /// # Errors
    /// A first stage without the batch (or a later stage with it), a batch smaller than the
    /// number of micro-batches, an activation that cannot travel (an element type other than
    /// f64/f32/f16/bf16), and every error of [`ProcessGroup::recv`] and [`ProcessGroup::send`].
    pub fn step<M: Module, const DI: usize, const DO: usize>(
        &self,
        module: &M,
        device: &Device,
        input: StageInput<DI>,
        mut forward: impl FnMut(&M, Tensor<DI>) -> Tensor<DO>,
        mut loss: impl FnMut(Tensor<DO>, Range<usize>) -> Tensor<1>,
    ) -> Result<StepOutput> {
        let (rows, batch) = input.split(|t| t.dims()[0]);
        let plan = self.plan.step_plan(rows, batch.is_some())?;
        let mut ops = Ops {
            rank: self.group().global_rank(),
            module,
            device,
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

    /// [`Pipeline::step`] for hybrid parallelism: `sync` (a [`GradSync`] over this stage's
    /// replicas, see [`HybridLayout`], prepared with this stage's module) averages the summed
    /// gradients across the replicas once the stage's last backward is done.
    ///
    /// # Errors
    /// As [`Pipeline::step`] and [`GradSync::sync`].
    pub fn step_synced<M: Module, const DI: usize, const DO: usize>(
        &self,
        sync: &mut GradSync,
        module: &M,
        device: &Device,
        input: StageInput<DI>,
        forward: impl FnMut(&M, Tensor<DI>) -> Tensor<DO>,
        loss: impl FnMut(Tensor<DO>, Range<usize>) -> Tensor<1>,
    ) -> Result<StepOutput> {
        let out = self.step(module, device, input, forward, loss)?;
        Ok(StepOutput {
            grads: sync.sync(module, out.grads)?,
            loss: out.loss,
        })
    }
}

/// One step's tensors for the core's engine ([`StagePlan::run`]).
struct Ops<'a, M: Module, F, L, const DI: usize> {
    rank: Rank,
    module: &'a M,
    device: &'a Device,
    /// The batch, on the first stage.
    batch: Option<Tensor<DI>>,
    forward: &'a mut F,
    loss: &'a mut L,
    acc: GradientsAccumulator<M>,
}

impl<M, F, L, const DI: usize, const DO: usize> StageOps for Ops<'_, M, F, L, DI>
where
    M: Module,
    F: FnMut(&M, Tensor<DI>) -> Tensor<DO>,
    L: FnMut(Tensor<DO>, Range<usize>) -> Tensor<1>,
{
    type In = Tensor<DI>;
    type Out = Tensor<DO>;
    type Scalar = Tensor<1>;

    fn dims(&self) -> (usize, usize) {
        (DI, DO)
    }

    fn slice(&mut self, rows: Range<usize>) -> Option<Tensor<DI>> {
        let batch = self.batch.as_ref()?;
        Some(batch.clone().narrow(0, rows.start, rows.len()))
    }

    fn input(&mut self, a: Activation) -> Result<Tensor<DI>> {
        tensor(self.rank, a, self.device)
    }

    fn forward(&mut self, x: &Tensor<DI>, grad: bool) -> (Tensor<DI>, Tensor<DO>) {
        let leaf = x.clone().detach();
        let leaf = if grad { leaf.require_grad() } else { leaf };
        let y = (self.forward)(self.module, leaf.clone());
        (leaf, y)
    }

    fn activation(&mut self, y: &Tensor<DO>) -> Result<Activation> {
        activation(self.rank, y.clone())
    }

    fn loss(&mut self, y: Tensor<DO>, rows: Range<usize>, share: f64) -> (Tensor<1>, f64) {
        let l = (self.loss)(y, rows) * share;
        let value = l.clone().into_scalar::<f64>();
        (l, value)
    }

    fn surrogate(&mut self, y: Tensor<DO>, grad: Activation) -> Result<Tensor<1>> {
        Ok((y * tensor::<DO>(self.rank, grad, self.device)?).sum())
    }

    fn backward(
        &mut self,
        surrogate: Tensor<1>,
        x: &Tensor<DI>,
        input_grad: bool,
    ) -> Result<Option<Activation>> {
        let grads = surrogate.backward();
        let dx = match input_grad.then(|| x.grad(&grads)).flatten() {
            Some(dx) => Some(activation(self.rank, dx)?),
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

fn activation<const D: usize>(rank: Rank, t: Tensor<D>) -> Result<Activation> {
    let data = t.try_into_data().map_err(|e| {
        let what = "sending an activation to a neighbouring stage";
        DdpError::model_access(rank, what, e.to_string())
    })?;
    let shape = data.shape().as_slice().to_vec();
    Activation::of(rank, shape, data.dtype().name(), data.as_bytes().to_vec())
}

/// A received activation as a tensor on `device` (its length was checked on receipt).
fn tensor<const D: usize>(rank: Rank, a: Activation, device: &Device) -> Result<Tensor<D>> {
    let dtype = dtype_of(a.dtype);
    let data = TensorData::try_from_bytes_vec(a.bytes, a.shape, dtype).map_err(|e| {
        DdpError::model_access(
            rank,
            "receiving an activation from a neighbouring stage",
            format!("{e:?}"),
        )
    })?;
    Ok(Tensor::from_data(data, (device, dtype)))
}
