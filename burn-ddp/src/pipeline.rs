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

use std::collections::HashMap;
use std::ops::Range;

use burn::module::AutodiffModule;
use burn::optim::{GradientsAccumulator, GradientsParams};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{DType as BurnDType, ElementConversion, Tensor, TensorData};
use burn_ddp_comm::pipeline::{self as core, Action, Activation};
pub use burn_ddp_comm::pipeline::{ideal_busy_fraction, HybridLayout, Schedule};
use burn_ddp_comm::{DdpError, ProcessGroup, Rank, Result};

use crate::ddp::DdpSession;

/// One rank's stage of a pipeline.
#[derive(Debug, Clone)]
pub struct Pipeline {
    group: ProcessGroup,
    schedule: Schedule,
    micro_batches: usize,
}

/// What the first stage feeds the pipeline, and what the others know of the batch.
#[derive(Debug)]
pub enum StageInput<B: Backend, const D: usize> {
    /// The first stage: the whole batch (rows along dimension 0).
    Batch(Tensor<B, D>),
    /// Any later stage: the number of rows of the batch (the same on every stage).
    Rows(usize),
}

/// What one pipeline step produced on this rank.
#[derive(Debug)]
pub struct StepOutput {
    /// This stage's parameter gradients, summed over the micro-batches: the gradients of the
    /// whole batch's loss.
    pub grads: GradientsParams,
    /// The loss of the whole batch (the last stage only).
    pub loss: Option<f64>,
}

impl Pipeline {
    /// This rank's stage of a pipeline whose stages are the ranks of `group`, in rank order
    /// (stage `s` is the group's rank `s`).
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

    /// The schedule.
    pub fn schedule(&self) -> Schedule {
        self.schedule
    }

    /// Micro-batches per step.
    pub fn micro_batches(&self) -> usize {
        self.micro_batches
    }

    /// The pipeline's group.
    pub fn group(&self) -> &ProcessGroup {
        &self.group
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
        let device = module.devices().into_iter().next().unwrap_or_default();
        let (prev, next) = core::neighbours(self.stage(), self.stages());
        // Per micro-batch in flight: this stage's input (untracked), and its output with the
        // graph behind it when its backward comes right after its forward.
        type Kept<B, const DI: usize, const DO: usize> = (Tensor<B, DI>, Tensor<B, DO>);
        let mut live: HashMap<usize, (Tensor<B, DI>, Option<Kept<B, DI, DO>>)> = HashMap::new();
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
                                decode::<B, DI>(rank, p, msg, &device)?
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
                        let bytes = encode(rank, y.clone().into_data())?;
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
                    // Burn frees the graph steps of every graph that shares the parameters when
                    // one of them runs backward, so only the graph of this micro-batch may be
                    // alive here: recompute the forward unless it ran just before.
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
                            total_loss += l.clone().into_scalar().elem::<f64>();
                            l
                        }
                        Some(n) => {
                            let msg = self.group.recv_bytes(n, core::gradient_tag(i))?;
                            let dy = decode::<B, DO>(rank, n, msg, &device)?;
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
                        let bytes = encode(rank, dx.into_data())?;
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

/// `x` as the input of a graph: a fresh leaf that requires grad when `grad` (the stage's input
/// gradient is wanted), else untracked.
fn track<B: AutodiffBackend, const D: usize>(x: &Tensor<B, D>, grad: bool) -> Tensor<B, D> {
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

/// The wire code of an activation's element type.
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

fn encode(rank: Rank, data: TensorData) -> Result<Vec<u8>> {
    let dtype = dtype_code(data.dtype).ok_or_else(|| DdpError::Model {
        rank,
        what: "sending an activation to the next stage",
        reason: format!(
            "its element type {:?} cannot travel between stages (f64, f32, f16, bf16 can)",
            data.dtype
        ),
    })?;
    Ok(Activation {
        shape: data.shape.as_slice().to_vec(),
        dtype,
        bytes: data.as_bytes().to_vec(),
    }
    .encode())
}

fn decode<B: Backend, const D: usize>(
    rank: Rank,
    from: Rank,
    msg: Vec<u8>,
    device: &B::Device,
) -> Result<Tensor<B, D>> {
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
    let expected = a
        .elements()
        .and_then(|n| n.checked_mul(dtype.size()))
        .unwrap_or(usize::MAX);
    if expected != a.bytes.len() {
        return Err(bad(format!(
            "shape {:?} of {dtype:?} needs {expected} bytes, the message has {}",
            a.shape,
            a.bytes.len()
        )));
    }
    let data = TensorData::from_bytes_vec(a.bytes, a.shape, dtype);
    Ok(Tensor::from_data(data, device))
}
