//! Pipeline parallelism on Burn 0.22.1: a model split into stages, one per rank of a pipeline
//! group, micro-batches run with the GPipe or 1F1B schedule; and hybrid parallelism, the
//! pipeline replicated data-parallel ([`HybridLayout`], [`Pipeline::step_synced`] with a
//! [`GradSync`] on the stage's replica group).
//!
//! The same executor as the Burn 0.21 line (`burn_ddp::pipeline`) on the core's schedules,
//! tags and activation framing: the first stage cuts its batch into micro-batches; activations
//! go downstream and their gradients upstream as point-to-point messages; the last stage scales
//! each micro-batch's loss by its share of the batch; every stage sums its parameter gradients
//! over the micro-batches, which makes them the unsplit model's gradients on the whole batch.
//! A micro-batch's forward is recomputed at its backward unless the backward follows it directly
//! (Burn's autodiff frees the graphs that share parameters with the one whose backward runs, so
//! several graphs cannot wait for their backward at once).

use std::collections::HashMap;
use std::ops::Range;

use burn::module::Module;
use burn::optim::{GradientsAccumulator, GradientsParams};
use burn::tensor::{DType as BurnDType, Device, Tensor, TensorData};
use burn_ddp_comm::pipeline::{self as core, Action, Activation};
pub use burn_ddp_comm::pipeline::{ideal_busy_fraction, HybridLayout, Schedule};
use burn_ddp_comm::{DdpError, ProcessGroup, Rank, Result};

use crate::GradSync;

/// One rank's stage of a pipeline (stage `s` is rank `s` of the pipeline's group).
#[derive(Debug, Clone)]
pub struct Pipeline {
    group: ProcessGroup,
    schedule: Schedule,
    micro_batches: usize,
}

/// What the first stage feeds the pipeline, and what the others know of the batch.
// Made once per step and moved into `step`: boxing the tensor would only burden the caller.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub enum StageInput<const D: usize> {
    /// The first stage: the whole batch (rows along dimension 0).
    Batch(Tensor<D>),
    /// Any later stage: the number of rows of the batch (the same on every stage).
    Rows(usize),
}

/// What one pipeline step produced on this rank.
#[derive(Debug)]
pub struct StepOutput {
    /// This stage's parameter gradients, summed over the micro-batches.
    pub grads: GradientsParams,
    /// The loss of the whole batch (the last stage only).
    pub loss: Option<f64>,
}

impl Pipeline {
    /// This rank's stage of a pipeline whose stages are the ranks of `group`, in rank order.
    ///
    /// # Errors
    /// [`DdpError::InvalidOption`] for zero micro-batches.
    pub fn new(group: ProcessGroup, schedule: Schedule, micro_batches: usize) -> Result<Self> {
        if micro_batches == 0 {
            return Err(DdpError::InvalidOption {
                option: "micro_batches",
                reason: "0: a pipeline step needs at least one micro-batch".into(),
            });
        }
        Ok(Self {
            group,
            schedule,
            micro_batches,
        })
    }

    /// This rank's stage (0: the first).
    pub fn stage(&self) -> usize {
        self.group.rank().index()
    }

    /// The number of stages.
    pub fn stages(&self) -> usize {
        self.group.world_size().as_usize()
    }

    /// Whether this is the first stage (it feeds the batch).
    pub fn is_first(&self) -> bool {
        self.stage() == 0
    }

    /// Whether this is the last stage (it computes the loss).
    pub fn is_last(&self) -> bool {
        self.stage() + 1 == self.stages()
    }

    /// The pipeline's group.
    pub fn group(&self) -> &ProcessGroup {
        &self.group
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
        let rank = self.group.global_rank();
        let (batch_rows, batch) = match (input, self.is_first()) {
            (StageInput::Batch(t), true) => (t.dims()[0], Some(t)),
            (StageInput::Rows(n), false) => (n, None),
            (StageInput::Batch(_), false) => {
                return Err(misuse(rank, "only the first stage feeds the batch: pass StageInput::Rows(batch size) on this stage"))
            }
            (StageInput::Rows(_), true) => {
                return Err(misuse(rank, "the first stage must feed the batch: pass StageInput::Batch(tensor)"))
            }
        };
        let ranges = core::micro_batches(batch_rows, self.micro_batches)?;
        let (prev, next) = core::neighbours(self.stage(), self.stages());
        type Kept<const DI: usize, const DO: usize> = (Tensor<DI>, Tensor<DO>);
        let mut live: HashMap<usize, (Tensor<DI>, Option<Kept<DI, DO>>)> = HashMap::new();
        let mut acc = GradientsAccumulator::<M>::new();
        let mut total_loss = 0.0f64;
        let actions = self
            .schedule
            .actions(self.stage(), self.stages(), self.micro_batches);
        for (k, &action) in actions.iter().enumerate() {
            match action {
                Action::Forward(i) => {
                    let rows = ranges[i].clone();
                    let x =
                        match (&batch, prev) {
                            (Some(b), _) => b.clone().narrow(0, rows.start, rows.len()),
                            (None, Some(p)) => {
                                let msg = self.group.recv_bytes(p, core::activation_tag(i))?;
                                decode::<DI>(rank, p, msg, device)?
                            }
                            (None, None) => return Err(DdpError::Internal {
                                rank,
                                what:
                                    "a pipeline stage has neither the batch nor a stage before it",
                            }),
                        };
                    let keep = actions.get(k + 1) == Some(&Action::Backward(i));
                    let leaf = track(&x, keep && prev.is_some());
                    let y = forward(module, leaf.clone());
                    if let Some(n) = next {
                        let bytes = encode(rank, y.clone())?;
                        self.group.send_bytes(&bytes, n, core::activation_tag(i))?;
                    }
                    live.insert(i, (x, keep.then_some((leaf, y))));
                }
                Action::Backward(i) => {
                    let Some((x, kept)) = live.remove(&i) else {
                        return Err(DdpError::Internal {
                            rank,
                            what: "a pipeline backward ran before its forward",
                        });
                    };
                    let (x, y) = match kept {
                        Some(kept) => kept,
                        None => {
                            let leaf = track(&x, prev.is_some());
                            let y = forward(module, leaf.clone());
                            (leaf, y)
                        }
                    };
                    let surrogate = match next {
                        None => {
                            let rows = ranges[i].clone();
                            let share = rows.len() as f64 / batch_rows as f64;
                            let l = loss(y, rows) * share;
                            total_loss += l.clone().into_scalar::<f64>();
                            l
                        }
                        Some(n) => {
                            let msg = self.group.recv_bytes(n, core::gradient_tag(i))?;
                            let dy = decode::<DO>(rank, n, msg, device)?;
                            (y * dy).sum()
                        }
                    };
                    let grads = surrogate.backward();
                    if let Some(p) = prev {
                        let dx = x.grad(&grads).ok_or_else(|| {
                            misuse(
                                rank,
                                "this stage's output does not depend on its input, so no \
                                 gradient can flow to the stages before it",
                            )
                        })?;
                        let bytes = encode(rank, dx)?;
                        self.group.send_bytes(&bytes, p, core::gradient_tag(i))?;
                    }
                    acc.accumulate(module, GradientsParams::from_grads(grads, module));
                }
            }
        }
        Ok(StepOutput {
            grads: acc.grads(),
            loss: self.is_last().then_some(total_loss),
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

/// `x` as the input of a graph: a fresh leaf that requires grad when `grad`, else untracked.
fn track<const D: usize>(x: &Tensor<D>, grad: bool) -> Tensor<D> {
    let x = x.clone().detach();
    if grad {
        x.require_grad()
    } else {
        x
    }
}

fn misuse(rank: Rank, reason: &str) -> DdpError {
    DdpError::InvalidGroupCall {
        rank,
        what: "Pipeline::step",
        reason: reason.into(),
    }
}

fn dtype_code(dtype: BurnDType) -> Option<u8> {
    Some(match dtype {
        BurnDType::F64 => 1,
        BurnDType::F32 => 2,
        BurnDType::F16 => 3,
        BurnDType::BF16 => 4,
        _ => return None,
    })
}

fn dtype_of(code: u8) -> Option<BurnDType> {
    Some(match code {
        1 => BurnDType::F64,
        2 => BurnDType::F32,
        3 => BurnDType::F16,
        4 => BurnDType::BF16,
        _ => return None,
    })
}

fn encode<const D: usize>(rank: Rank, t: Tensor<D>) -> Result<Vec<u8>> {
    let bad = |reason: String| DdpError::Model {
        rank,
        what: "sending an activation to a neighbouring stage",
        reason,
    };
    let data = t.try_into_data().map_err(|e| bad(e.to_string()))?;
    let dtype = dtype_code(data.dtype()).ok_or_else(|| {
        bad(format!(
            "its element type {:?} cannot travel between stages (f64, f32, f16, bf16 can)",
            data.dtype()
        ))
    })?;
    Ok(Activation {
        shape: data.shape().as_slice().to_vec(),
        dtype,
        bytes: data.as_bytes().to_vec(),
    }
    .encode())
}

fn decode<const D: usize>(
    rank: Rank,
    from: Rank,
    msg: Vec<u8>,
    device: &Device,
) -> Result<Tensor<D>> {
    let bad = |reason: String| DdpError::Model {
        rank,
        what: "receiving an activation from a neighbouring stage",
        reason,
    };
    let a = Activation::decode(msg)
        .ok_or_else(|| bad(format!("the message from stage {from} is malformed")))?;
    let dtype =
        dtype_of(a.dtype).ok_or_else(|| bad(format!("unknown element type code {}", a.dtype)))?;
    if a.shape.len() != D {
        return Err(bad(format!(
            "stage {from} sent a tensor of {} dimensions, this stage takes {D}: the stages' \
             outputs and inputs must match",
            a.shape.len()
        )));
    }
    let data = TensorData::try_from_bytes_vec(a.bytes, a.shape, dtype)
        .map_err(|e| bad(format!("{e:?}")))?;
    Ok(Tensor::from_data(data, (device, dtype)))
}
