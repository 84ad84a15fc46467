//! Pipeline parallelism without Burn: which micro-batch each stage runs forward or backward when
//! (the GPipe and 1F1B schedules), how a batch is cut into micro-batches, the tags of the
//! messages between stages, and the framing of an activation (shape and element type ahead of
//! its bytes), and the step that runs the schedule ([`StagePlan::run`]) over a line's tensors
//! ([`StageOps`]: `burn_ddp::pipeline` on every Burn release).
//!
//! Stages exchange activations downstream and their gradients upstream with point-to-point
//! messages ([`ProcessGroup::send_bytes`](crate::ProcessGroup::send_bytes)). Sends never wait
//! for the receiver, so each stage simply runs its list of actions in order; the schedules below
//! are deadlock-free under that rule (checked by a simulation in the tests).

use crate::error::{CollectiveError, ConfigError};
use std::collections::HashMap;
use std::ops::Range;

use crate::types::Rank;
use crate::{DdpError, ProcessGroup, Result};

/// The order in which a stage runs its micro-batches.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Schedule {
    /// All forwards, then all backwards, last micro-batch first (GPipe, Huang et al. 2019).
    /// Each stage holds the activations of every micro-batch until its backward: memory grows
    /// with the number of micro-batches.
    GPipe,
    /// One forward, one backward (PipeDream-Flush, Narayanan et al. 2021): after a warm-up of
    /// `stages - stage - 1` forwards, each stage alternates, so it holds at most
    /// `stages - stage` micro-batches' activations. Same bubble as GPipe, far less memory.
    OneFOneB,
}

/// One step of a stage's schedule.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Action {
    /// The forward of micro-batch `i`.
    Forward(usize),
    /// The backward of micro-batch `i`.
    Backward(usize),
}

impl Schedule {
    /// The actions of `stage` (0-based) of `stages`, for `micro_batches` micro-batches.
    pub fn actions(self, stage: usize, stages: usize, micro_batches: usize) -> Vec<Action> {
        let m = micro_batches;
        match self {
            // Backwards in reverse: the last micro-batch's backward directly follows its forward,
            // so its graph is kept (the others are recomputed, see `StepPlan::backward_follows`).
            Schedule::GPipe => (0..m)
                .map(Action::Forward)
                .chain((0..m).rev().map(Action::Backward))
                .collect(),
            Schedule::OneFOneB => {
                let warmup = stages.saturating_sub(stage + 1).min(m);
                let mut out: Vec<Action> = (0..warmup).map(Action::Forward).collect();
                let mut backward = 0;
                for f in warmup..m {
                    out.push(Action::Forward(f));
                    out.push(Action::Backward(backward));
                    backward += 1;
                }
                out.extend((backward..m).map(Action::Backward));
                out
            }
        }
    }

    /// The most micro-batches whose activations `stage` holds at once (forward done, backward
    /// not yet): what the schedule costs in activation memory.
    pub fn in_flight(self, stage: usize, stages: usize, micro_batches: usize) -> usize {
        let mut live = 0usize;
        let mut most = 0;
        for a in self.actions(stage, stages, micro_batches) {
            match a {
                Action::Forward(_) => {
                    live += 1;
                    most = most.max(live);
                }
                Action::Backward(_) => live = live.saturating_sub(1),
            }
        }
        most
    }

    /// The name, as the command-line flags spell it (`gpipe`, `1f1b`).
    pub fn name(self) -> &'static str {
        match self {
            Schedule::GPipe => "gpipe",
            Schedule::OneFOneB => "1f1b",
        }
    }
}

impl std::str::FromStr for Schedule {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "gpipe" => Ok(Schedule::GPipe),
            "1f1b" | "onefoneb" => Ok(Schedule::OneFOneB),
            other => Err(format!("unknown schedule {other:?}: use gpipe or 1f1b")),
        }
    }
}

/// The fraction of the time a stage is busy when every forward and every backward of a
/// micro-batch takes the same time on every stage: `m / (m + p - 1)` for both schedules (the
/// bubble is `p - 1` slots of `m + p - 1`).
pub fn ideal_busy_fraction(stages: usize, micro_batches: usize) -> f64 {
    if stages == 0 || micro_batches == 0 {
        return 0.0;
    }
    micro_batches as f64 / (micro_batches + stages - 1) as f64
}

/// The rows of each of `micro_batches` micro-batches of a batch of `batch` rows: as even as
/// possible, the first ones one row longer when it does not divide.
///
/// # Errors
/// [`ConfigError::InvalidOption`] when there are fewer rows than micro-batches, or no micro-batch.
pub fn micro_batches(batch: usize, micro_batches: usize) -> Result<Vec<Range<usize>>> {
    if micro_batches == 0 || batch < micro_batches {
        return Err(DdpError::Config(ConfigError::InvalidOption {
            option: "micro_batches",
            reason: format!(
                "{micro_batches} micro-batches of a batch of {batch} rows: use between 1 and the \
                 batch size"
            ),
        }));
    }
    let (base, extra) = (batch / micro_batches, batch % micro_batches);
    let mut start = 0;
    Ok((0..micro_batches)
        .map(|i| {
            let len = base + usize::from(i < extra);
            let r = start..start + len;
            start += len;
            r
        })
        .collect())
}

/// The tag of micro-batch `i`'s activation, sent from a stage to the next.
pub fn activation_tag(i: usize) -> u32 {
    (i as u32) & 0x7fff_ffff
}

/// The tag of the gradient of micro-batch `i`'s activation, sent from a stage to the previous.
pub fn gradient_tag(i: usize) -> u32 {
    activation_tag(i) | 0x8000_0000
}

/// The stage before and after `stage` of `stages`, as ranks of the pipeline's group.
pub fn neighbours(stage: usize, stages: usize) -> (Option<Rank>, Option<Rank>) {
    let prev = stage.checked_sub(1).map(|s| Rank(s as u32));
    let next = (stage + 1 < stages).then(|| Rank(stage as u32 + 1));
    (prev, next)
}

/// An activation (or its gradient) on the wire: its shape and element type, then its bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Activation {
    /// The tensor's shape.
    pub shape: Vec<usize>,
    /// The element type's code: the Burn line's own mapping (it is checked end to end only by
    /// that line).
    pub dtype: u8,
    /// The elements, little-endian.
    pub bytes: Vec<u8>,
}

/// Largest number of dimensions an activation may have on the wire.
const MAX_DIMS: usize = 16;

impl Activation {
    /// The activation of a tensor of `shape` whose elements (`bytes`, little-endian) are of
    /// Burn's float type named `dtype` (`DType::name`: `f64`, `f32`, `f16`, `bf16`).
    ///
    /// # Errors
    /// [`ModelError::Access`](crate::ModelError::Access) for `rank` when the element type cannot travel between stages.
    pub fn of(rank: Rank, shape: Vec<usize>, dtype: &str, bytes: Vec<u8>) -> Result<Self> {
        let code = float_code(dtype).ok_or_else(|| {
            DdpError::model_access(
                rank,
                "sending an activation to a neighbouring stage",
                format!(
                "its element type {dtype} cannot travel between stages (f64, f32, f16, bf16 can)"
            ),
            )
        })?;
        Ok(Self {
            shape,
            dtype: code,
            bytes,
        })
    }

    /// The message: dimension count, type code, the dimensions (u64 little-endian), the bytes.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(2 + 8 * self.shape.len() + self.bytes.len());
        out.push(self.shape.len() as u8);
        out.push(self.dtype);
        for d in &self.shape {
            out.extend_from_slice(&(*d as u64).to_le_bytes());
        }
        out.extend_from_slice(&self.bytes);
        out
    }

    /// Decodes a message of [`Activation::encode`]; `None` for anything malformed.
    pub fn decode(mut msg: Vec<u8>) -> Option<Self> {
        let (&dims, rest) = msg.split_first()?;
        let (&dtype, rest) = rest.split_first()?;
        let dims = usize::from(dims);
        if dims > MAX_DIMS || rest.len() < 8 * dims {
            return None;
        }
        let shape: Vec<usize> = rest[..8 * dims]
            .chunks_exact(8)
            .map(|c| {
                let mut b = [0u8; 8];
                b.copy_from_slice(c);
                usize::try_from(u64::from_le_bytes(b)).ok()
            })
            .collect::<Option<_>>()?;
        let header = 2 + 8 * dims;
        let bytes = msg.split_off(header);
        Some(Self {
            shape,
            dtype,
            bytes,
        })
    }

    /// The number of elements its shape holds.
    pub fn elements(&self) -> Option<usize> {
        self.shape
            .iter()
            .try_fold(1usize, |acc, &d| acc.checked_mul(d))
    }
}

/// One rank's stage of a pipeline, without Burn: its group (stage `s` is the group's rank `s`),
/// the schedule and the number of micro-batches. Both Burn lines' `Pipeline` deref to it.
#[derive(Debug, Clone)]
pub struct StagePlan {
    group: ProcessGroup,
    schedule: Schedule,
    micro_batches: usize,
}

/// What a stage needs to run one step: the batch's micro-batch ranges, its neighbours and its
/// actions in order.
#[derive(Debug, Clone)]
pub struct StepPlan {
    /// Rows of each micro-batch.
    pub ranges: Vec<Range<usize>>,
    /// The stage before this one (`None` on the first).
    pub prev: Option<Rank>,
    /// The stage after this one (`None` on the last).
    pub next: Option<Rank>,
    /// This stage's actions, in order.
    pub actions: Vec<Action>,
}

impl StepPlan {
    /// Whether the forward of micro-batch `i` at position `k` of the actions is directly
    /// followed by its backward (then its graph is kept; otherwise it is recomputed).
    pub fn backward_follows(&self, k: usize, i: usize) -> bool {
        self.actions.get(k + 1) == Some(&Action::Backward(i))
    }

    /// The share of the batch's rows that micro-batch `i` holds (its loss is scaled by it).
    pub fn share(&self, i: usize) -> f64 {
        let total: usize = self.ranges.iter().map(|r| r.len()).sum();
        self.ranges[i].len() as f64 / total.max(1) as f64
    }
}

impl StagePlan {
    /// This rank's stage of a pipeline over the ranks of `group`.
    ///
    /// # Errors
    /// [`ConfigError::InvalidOption`] for zero micro-batches.
    pub fn new(group: ProcessGroup, schedule: Schedule, micro_batches: usize) -> Result<Self> {
        if micro_batches == 0 {
            return Err(DdpError::Config(ConfigError::InvalidOption {
                option: "micro_batches",
                reason: "0: a pipeline step needs at least one micro-batch".into(),
            }));
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

    /// The plan of one step over a batch of `rows` rows; `fed` says whether the caller gave
    /// this stage the batch (only the first stage may, and it must).
    ///
    /// # Errors
    /// [`CollectiveError::InvalidGroupCall`] when `fed` does not match the stage; the errors of
    /// [`micro_batches`].
    pub fn step_plan(&self, rows: usize, fed: bool) -> Result<StepPlan> {
        let reason = match (fed, self.is_first()) {
            (true, false) => Some(
                "only the first stage feeds the batch: pass StageInput::Rows(batch size) on \
                 this stage",
            ),
            (false, true) => {
                Some("the first stage must feed the batch: pass StageInput::Batch(tensor)")
            }
            _ => None,
        };
        if let Some(reason) = reason {
            return Err(self.misuse(reason));
        }
        let (prev, next) = neighbours(self.stage(), self.stages());
        Ok(StepPlan {
            ranges: micro_batches(rows, self.micro_batches)?,
            prev,
            next,
            actions: self
                .schedule
                .actions(self.stage(), self.stages(), self.micro_batches),
        })
    }

    /// A misuse of the step by this rank's program.
    pub fn misuse(&self, reason: &str) -> DdpError {
        DdpError::Collective(CollectiveError::InvalidGroupCall {
            rank: self.group.global_rank(),
            what: "Pipeline::step",
            reason: reason.into(),
        })
    }

    /// The error for a stage whose output does not depend on its input.
    pub fn no_input_gradient(&self) -> DdpError {
        self.misuse(
            "this stage's output does not depend on its input, so no gradient can flow to the \
             stages before it",
        )
    }

    /// The error for a step whose actions went out of order (a bug of burn-ddp).
    pub fn out_of_order(&self) -> DdpError {
        DdpError::Internal {
            rank: self.group.global_rank(),
            what: "a pipeline backward ran before its forward",
        }
    }

    /// Sends an encoded activation (or its gradient) of micro-batch `i` to `to`.
    ///
    /// # Errors
    /// As [`ProcessGroup::send_bytes`].
    pub fn send(&self, a: &Activation, to: Rank, i: usize, gradient: bool) -> Result<()> {
        let tag = if gradient {
            gradient_tag(i)
        } else {
            activation_tag(i)
        };
        self.group.send_bytes(&a.encode(), to, tag)
    }

    /// Receives micro-batch `i`'s activation (or its gradient) from `from`, checked to have `dims`
    /// dimensions and as many bytes as its shape and element type need.
    ///
    /// # Errors
    /// As [`ProcessGroup::recv_bytes`]; [`ModelError::Access`](crate::ModelError::Access) for a malformed message.
    pub fn recv(&self, from: Rank, i: usize, gradient: bool, dims: usize) -> Result<Activation> {
        let tag = if gradient {
            gradient_tag(i)
        } else {
            activation_tag(i)
        };
        let msg = self.group.recv_bytes(from, tag)?;
        let bad = |reason: String| {
            DdpError::model_access(
                self.group.global_rank(),
                "receiving an activation from a neighbouring stage",
                reason,
            )
        };
        let a = Activation::decode(msg)
            .ok_or_else(|| bad(format!("the message from stage {from} is malformed")))?;
        let size = float_of(a.dtype)
            .map(|(_, size)| size)
            .ok_or_else(|| bad(format!("unknown element type code {}", a.dtype)))?;
        if a.shape.len() != dims {
            return Err(bad(format!(
                "stage {from} sent a tensor of {} dimensions, this stage takes {dims}: the \
                 stages' outputs and inputs must match",
                a.shape.len()
            )));
        }
        let expected = a
            .elements()
            .and_then(|n| n.checked_mul(size))
            .unwrap_or(usize::MAX);
        if expected != a.bytes.len() {
            return Err(bad(format!(
                "shape {:?} needs {expected} bytes, the message has {}",
                a.shape,
                a.bytes.len()
            )));
        }
        Ok(a)
    }
}

/// What the first stage feeds the pipeline (`T`: a line's tensor), and what the others know of
/// the batch.
// Made once per step and moved into the step: boxing the tensor would only burden the caller.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub enum StageInput<T> {
    /// The first stage: the whole batch (rows along dimension 0).
    Batch(T),
    /// Any later stage: the number of rows of the batch (the same on every stage).
    Rows(usize),
}

impl<T> StageInput<T> {
    /// The batch's rows (`rows_of` the batch on the first stage), and the batch.
    pub fn split(self, rows_of: impl FnOnce(&T) -> usize) -> (usize, Option<T>) {
        match self {
            StageInput::Batch(t) => (rows_of(&t), Some(t)),
            StageInput::Rows(n) => (n, None),
        }
    }
}

/// What one pipeline step produced on this rank (`G`: a line's gradients).
#[derive(Debug)]
pub struct StepOutput<G> {
    /// This stage's parameter gradients, summed over the micro-batches: the gradients of the
    /// whole batch's loss.
    pub grads: G,
    /// The loss of the whole batch (the last stage only).
    pub loss: Option<f64>,
}

/// What a Burn line gives [`StagePlan::run`] for one step of its stage: its tensors and the
/// few graph operations the schedule needs. The engine walks the schedule (which micro-batch
/// runs forward or backward, what is kept, received and sent); the line only does tensor work.
pub trait StageOps {
    /// The stage's input: a micro-batch of the batch, or an activation received.
    type In;
    /// The stage's output, with the graph behind it.
    type Out;
    /// A one-element tensor whose backward gives a micro-batch's gradients.
    type Scalar;

    /// The dimensions of the stage's input and of its output (checked on receipt).
    fn dims(&self) -> (usize, usize);

    /// Rows `rows` of the batch (the first stage; None on a stage without the batch).
    fn slice(&mut self, rows: Range<usize>) -> Option<Self::In>;

    /// An activation received from the previous stage, as the stage's input.
    ///
    /// # Errors
    /// It cannot be made a tensor.
    fn input(&mut self, a: Activation) -> Result<Self::In>;

    /// The stage's forward of `x` as a fresh leaf (its gradient tracked when `grad`): the leaf
    /// and the output.
    fn forward(&mut self, x: &Self::In, grad: bool) -> (Self::In, Self::Out);

    /// The output `y` as an activation for the next stage.
    ///
    /// # Errors
    /// Its element type cannot travel.
    fn activation(&mut self, y: &Self::Out) -> Result<Activation>;

    /// The last stage: the loss of micro-batch `rows`, scaled by its `share` of the batch, and
    /// its value.
    fn loss(&mut self, y: Self::Out, rows: Range<usize>, share: f64) -> (Self::Scalar, f64);

    /// Any other stage: the surrogate whose backward passes on the gradient of `y` that the
    /// next stage sent (`grad`).
    ///
    /// # Errors
    /// It cannot be made a tensor.
    fn surrogate(&mut self, y: Self::Out, grad: Activation) -> Result<Self::Scalar>;

    /// The backward of `surrogate`: the parameters' gradients are accumulated, and the
    /// gradient of the leaf `x` returned as an activation when `input_grad` (None when the
    /// graph has none).
    ///
    /// # Errors
    /// The gradient's element type cannot travel.
    fn backward(
        &mut self,
        surrogate: Self::Scalar,
        x: &Self::In,
        input_grad: bool,
    ) -> Result<Option<Activation>>;
}

impl StagePlan {
    /// One step of this stage over every micro-batch of `plan`, in the order of the schedule,
    /// with `ops`' tensors: each forward's input taken from the batch or received, its output
    /// sent on; each backward run on the graph kept when it follows its forward directly, else
    /// on a recomputed one (Burn frees the graph steps of every graph that shares the
    /// parameters when one of them runs backward, so only one micro-batch's graph may be
    /// alive), its input's gradient sent back. Returns the sum of the micro-batches' scaled
    /// losses (the batch's loss, on the last stage; 0 elsewhere).
    ///
    /// # Errors
    /// [`StagePlan::recv`] and [`StagePlan::send`]'s; a micro-batch out of order; an input
    /// without a gradient; what `ops` returns.
    pub fn run<S: StageOps>(&self, plan: &StepPlan, ops: &mut S) -> Result<f64> {
        let (dims_in, dims_out) = ops.dims();
        // Per micro-batch in flight: this stage's input (untracked), and its leaf and output
        // with the graph behind it when its backward comes right after its forward.
        type Kept<S> = (<S as StageOps>::In, <S as StageOps>::Out);
        let mut live: HashMap<usize, (S::In, Option<Kept<S>>)> = HashMap::new();
        let mut total = 0.0f64;
        for (k, &action) in plan.actions.iter().enumerate() {
            match action {
                Action::Forward(i) => {
                    let x = match (ops.slice(plan.ranges[i].clone()), plan.prev) {
                        (Some(x), _) => x,
                        (None, Some(p)) => ops.input(self.recv(p, i, false, dims_in)?)?,
                        (None, None) => return Err(self.out_of_order()),
                    };
                    let keep = plan.backward_follows(k, i);
                    let (leaf, y) = ops.forward(&x, keep && plan.prev.is_some());
                    if let Some(n) = plan.next {
                        self.send(&ops.activation(&y)?, n, i, false)?;
                    }
                    live.insert(i, (x, keep.then_some((leaf, y))));
                }
                Action::Backward(i) => {
                    let (x, kept) = live.remove(&i).ok_or_else(|| self.out_of_order())?;
                    let (x, y) = match kept {
                        Some(kept) => kept,
                        None => ops.forward(&x, plan.prev.is_some()),
                    };
                    let surrogate = match plan.next {
                        None => {
                            let (l, value) = ops.loss(y, plan.ranges[i].clone(), plan.share(i));
                            total += value;
                            l
                        }
                        Some(n) => ops.surrogate(y, self.recv(n, i, true, dims_out)?)?,
                    };
                    let dx = ops.backward(surrogate, &x, plan.prev.is_some())?;
                    if let Some(p) = plan.prev {
                        let dx = dx.ok_or_else(|| self.no_input_gradient())?;
                        self.send(&dx, p, i, true)?;
                    }
                }
            }
        }
        Ok(total)
    }
}

/// The wire code of a float element type by its name (`f64`, `f32`, `f16`, `bf16`), and back:
/// each Burn line maps its own `DType` through these.
pub fn float_code(name: &str) -> Option<u8> {
    FLOATS
        .iter()
        .position(|(n, _)| *n == name)
        .map(|i| i as u8 + 1)
}

/// Which of a Burn line's float types (`candidates`, named by `name`: Burn's `DType::name`)
/// wire code `code` stands for; None for a code of no float type, or one not among them.
pub fn float_type<T: Copy>(
    code: u8,
    candidates: &[T],
    name: impl Fn(&T) -> &'static str,
) -> Option<T> {
    let (wanted, _) = float_of(code)?;
    candidates.iter().copied().find(|d| name(d) == wanted)
}

/// The name and element size of wire code `code` (see [`float_code`]).
pub fn float_of(code: u8) -> Option<(&'static str, usize)> {
    FLOATS.get(usize::from(code).checked_sub(1)?).copied()
}

const FLOATS: [(&str, usize); 4] = [("f64", 8), ("f32", 4), ("f16", 2), ("bf16", 2)];

/// Where this rank sits in a job of `stages` x `replicas` ranks (hybrid parallelism): the ranks
/// `r * stages .. (r + 1) * stages` form replica `r`'s pipeline (consecutive ranks, so a
/// pipeline stays on one node when it fits), and the ranks holding stage `s` form its replica
/// group, over which that stage's gradients are averaged.
#[derive(Debug, Clone)]
pub struct HybridLayout {
    /// This rank's stage.
    pub stage: usize,
    /// This rank's replica (which pipeline).
    pub replica: usize,
    /// The ranks of this rank's pipeline, stage order.
    pub pipeline: ProcessGroup,
    /// The ranks holding this rank's stage, replica order.
    pub replicas: ProcessGroup,
}

impl HybridLayout {
    /// Splits `world` into pipelines of `stages` ranks. Every rank must call it.
    ///
    /// # Errors
    /// A world size that `stages` does not divide, and the errors of [`ProcessGroup::split`].
    pub fn new(world: &ProcessGroup, stages: usize) -> Result<Self> {
        let n = world.world_size().as_usize();
        if stages == 0 || !n.is_multiple_of(stages) {
            return Err(DdpError::Config(ConfigError::InvalidOption {
                option: "stages",
                reason: format!(
                    "{stages} stages do not divide the world of {n} ranks: the world size must \
                     be stages x replicas"
                ),
            }));
        }
        let me = world.rank().index();
        let (stage, replica) = (me % stages, me / stages);
        let pipeline = world.split(Some(replica as u32))?;
        let replicas = world.split(Some(stage as u32))?;
        match (pipeline, replicas) {
            (Some(pipeline), Some(replicas)) => Ok(Self {
                stage,
                replica,
                pipeline,
                replicas,
            }),
            _ => Err(DdpError::Internal {
                rank: world.global_rank(),
                what: "a rank that passed a color was left out of its group",
            }),
        }
    }

    /// The number of replicas (pipelines).
    pub fn replica_count(&self) -> usize {
        self.replicas.world_size().as_usize()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Plays the actions of every stage with unit-time forwards and backwards under the rules of
    /// the executor (a stage after the first needs the activation from the stage before; one
    /// before the last needs the gradient from the stage after; sends never wait) and returns
    /// the time of the last action, or `None` on a deadlock.
    fn simulate(schedule: Schedule, stages: usize, m: usize) -> Option<usize> {
        let plans: Vec<Vec<Action>> = (0..stages)
            .map(|s| schedule.actions(s, stages, m))
            .collect();
        let mut next = vec![0usize; stages];
        let mut act_done = vec![vec![None::<usize>; m]; stages];
        let mut grad_done = vec![vec![None::<usize>; m]; stages];
        let mut clock = vec![0usize; stages];
        loop {
            let mut moved = false;
            for s in 0..stages {
                let Some(&a) = plans[s].get(next[s]) else {
                    continue;
                };
                let ready = match a {
                    Action::Forward(i) if s > 0 => act_done[s - 1][i],
                    Action::Forward(_) => Some(0),
                    Action::Backward(i) if s + 1 < stages => grad_done[s + 1][i],
                    Action::Backward(i) => act_done[s][i],
                };
                let Some(t) = ready else { continue };
                let end = clock[s].max(t) + 1;
                clock[s] = end;
                match a {
                    Action::Forward(i) => act_done[s][i] = Some(end),
                    Action::Backward(i) => grad_done[s][i] = Some(end),
                }
                next[s] += 1;
                moved = true;
            }
            if (0..stages).all(|s| next[s] == plans[s].len()) {
                return clock.into_iter().max();
            }
            if !moved {
                return None;
            }
        }
    }

    #[test]
    fn both_schedules_run_every_micro_batch_forward_then_backward_once() {
        for schedule in [Schedule::GPipe, Schedule::OneFOneB] {
            for stages in 1..6 {
                for m in 1..9 {
                    for s in 0..stages {
                        let a = schedule.actions(s, stages, m);
                        assert_eq!(a.len(), 2 * m);
                        for i in 0..m {
                            let f = a.iter().position(|x| *x == Action::Forward(i)).unwrap();
                            let b = a.iter().position(|x| *x == Action::Backward(i)).unwrap();
                            assert!(f < b, "{schedule:?} stage {s}/{stages} m {m}: {a:?}");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn the_schedules_never_deadlock_and_take_the_ideal_time() {
        for schedule in [Schedule::GPipe, Schedule::OneFOneB] {
            for stages in 1..6 {
                for m in 1..12 {
                    let t = simulate(schedule, stages, m)
                        .unwrap_or_else(|| panic!("{schedule:?} {stages} stages, {m}: deadlock"));
                    // 2m slots of work per stage, plus the bubble of 2(p - 1).
                    assert_eq!(t, 2 * (m + stages - 1), "{schedule:?} p={stages} m={m}");
                    let busy = (2 * m) as f64 / t as f64;
                    assert!((busy - ideal_busy_fraction(stages, m)).abs() < 1e-12);
                }
            }
        }
    }

    #[test]
    fn one_f_one_b_bounds_the_activations_held() {
        for stages in 1..6 {
            for m in 1..12 {
                for s in 0..stages {
                    assert_eq!(Schedule::GPipe.in_flight(s, stages, m), m);
                    assert_eq!(
                        Schedule::OneFOneB.in_flight(s, stages, m),
                        (stages - s).min(m),
                        "p={stages} s={s} m={m}"
                    );
                }
            }
        }
    }

    #[test]
    fn micro_batches_cover_the_batch_evenly() {
        let r = micro_batches(10, 4).unwrap();
        assert_eq!(r, vec![0..3, 3..6, 6..8, 8..10]);
        assert_eq!(micro_batches(4, 4).unwrap().len(), 4);
        assert!(micro_batches(3, 4).is_err());
        assert!(micro_batches(3, 0).is_err());
    }

    #[test]
    fn float_codes_round_trip_and_unknown_ones_are_refused() {
        for name in ["f64", "f32", "f16", "bf16"] {
            let code = float_code(name).unwrap();
            assert_eq!(float_of(code).map(|(n, _)| n), Some(name));
        }
        assert_eq!(float_of(2), Some(("f32", 4)));
        assert_eq!(
            float_type(float_code("bf16").unwrap(), &["f32", "bf16"], |n| *n),
            Some("bf16")
        );
        assert_eq!(
            float_type(float_code("f64").unwrap(), &["f32"], |n| *n),
            None
        );

        assert_eq!(float_code("i32"), None);
        assert_eq!(float_of(0), None);
        assert_eq!(float_of(5), None);
    }

    #[test]
    fn a_step_plan_keeps_graphs_only_when_the_backward_follows() {
        let group = ProcessGroup::local(crate::WorldSize::new(2).unwrap(), Default::default());
        let last = StagePlan::new(group[1].clone(), Schedule::OneFOneB, 3).unwrap();
        let plan = last.step_plan(10, false).unwrap();
        assert_eq!((plan.prev, plan.next), (Some(Rank(0)), None));
        // The last stage under 1F1B: F0 B0 F1 B1 F2 B2, every forward kept.
        assert!((0..3).all(|i| plan.backward_follows(2 * i, i)));
        assert!((plan.share(0) - 0.4).abs() < 1e-12 && (plan.share(2) - 0.3).abs() < 1e-12);
        let first = StagePlan::new(group[0].clone(), Schedule::GPipe, 3).unwrap();
        let plan = first.step_plan(10, true).unwrap();
        // GPipe: only the last forward is followed by its backward.
        assert!(!plan.backward_follows(0, 0) && plan.backward_follows(2, 2));
        let e = first.step_plan(10, false).unwrap_err();
        assert!(
            e.to_string()
                .contains("the first stage must feed the batch"),
            "{e}"
        );
        let e = last.step_plan(10, true).unwrap_err();
        assert!(
            e.to_string()
                .contains("only the first stage feeds the batch"),
            "{e}"
        );
        assert!(StagePlan::new(group[0].clone(), Schedule::GPipe, 0).is_err());
    }

    /// A stage whose tensors are one f64: forward multiplies by `factor`; the log says what
    /// ran, with which input.
    struct Scalars {
        rank: Rank,
        factor: f64,
        log: Vec<String>,
    }

    fn wire(rank: Rank, v: f64) -> Activation {
        Activation::of(rank, vec![1], "f64", v.to_le_bytes().to_vec()).unwrap()
    }

    fn value(a: &Activation) -> f64 {
        f64::from_le_bytes(a.bytes[..8].try_into().unwrap())
    }

    impl StageOps for Scalars {
        type In = f64;
        type Out = f64;
        type Scalar = f64;

        fn dims(&self) -> (usize, usize) {
            (1, 1)
        }
        fn slice(&mut self, rows: Range<usize>) -> Option<f64> {
            (self.rank == Rank(0)).then_some(rows.start as f64 + 1.0)
        }
        fn input(&mut self, a: Activation) -> Result<f64> {
            Ok(value(&a))
        }
        fn forward(&mut self, x: &f64, grad: bool) -> (f64, f64) {
            self.log.push(format!("fwd {x} {grad}"));
            (*x, x * self.factor)
        }
        fn activation(&mut self, y: &f64) -> Result<Activation> {
            Ok(wire(self.rank, *y))
        }
        fn loss(&mut self, y: f64, _rows: Range<usize>, share: f64) -> (f64, f64) {
            (y * share, y * share)
        }
        fn surrogate(&mut self, y: f64, grad: Activation) -> Result<f64> {
            self.log.push(format!("grad {}", value(&grad)));
            Ok(y * value(&grad))
        }
        fn backward(&mut self, s: f64, x: &f64, input_grad: bool) -> Result<Option<Activation>> {
            self.log.push(format!("bwd {x}"));
            Ok(input_grad.then(|| wire(self.rank, s * self.factor)))
        }
    }

    #[test]
    fn a_step_runs_the_schedule_over_a_lines_tensors() {
        let group = ProcessGroup::local(crate::WorldSize::new(2).unwrap(), Default::default());
        fn run(pg: &ProcessGroup, factor: f64) -> (f64, Vec<String>) {
            let stage = StagePlan::new(pg.clone(), Schedule::GPipe, 2).unwrap();
            let rank = pg.rank();
            let plan = stage.step_plan(4, rank == Rank(0)).unwrap();
            let mut ops = Scalars {
                rank,
                factor,
                log: Vec::new(),
            };
            let total = stage.run(&plan, &mut ops).unwrap();
            (total, ops.log)
        }
        let (first, last) = std::thread::scope(|s| {
            let a = s.spawn(|| run(&group[0], 2.0));
            let b = s.spawn(|| run(&group[1], 3.0));
            (a.join().unwrap(), b.join().unwrap())
        });
        // Micro-batches of rows 0..2 and 2..4 (inputs 1 and 3, half the batch each): the last
        // stage's loss is (1 * 2 * 3 + 3 * 2 * 3) / 2.
        assert_eq!(last.0, 12.0);
        assert_eq!(first.0, 0.0);
        // GPipe: F0 F1 B1 B0; micro-batch 1's graph is kept, micro-batch 0's recomputed; the
        // first stage tracks no input gradient, the last does and sends it back (the fake's:
        // its surrogate times its factor, 9 * 3 and 3 * 3).
        assert_eq!(
            first.1,
            [
                "fwd 1 false",
                "fwd 3 false",
                "grad 27",
                "bwd 3",
                "fwd 1 false",
                "grad 9",
                "bwd 1"
            ]
        );
        assert_eq!(
            last.1,
            ["fwd 2 false", "fwd 6 true", "bwd 6", "fwd 2 true", "bwd 2"]
        );
    }

    #[test]
    fn tags_of_activations_and_gradients_never_collide() {
        assert_ne!(activation_tag(5), gradient_tag(5));
        assert_eq!(gradient_tag(5) & 0x7fff_ffff, activation_tag(5));
    }

    proptest! {
        #[test]
        fn activations_round_trip(shape in prop::collection::vec(0usize..9, 0..5), dtype: u8, bytes in prop::collection::vec(any::<u8>(), 0..64)) {
            let a = Activation { shape, dtype, bytes };
            prop_assert_eq!(Activation::decode(a.encode()), Some(a));
        }

        /// Messages come from the network: anything decodes or is refused, never panics.
        #[test]
        fn decoding_arbitrary_messages_never_panics(bytes in prop::collection::vec(any::<u8>(), 0..96)) {
            let _ = Activation::decode(bytes);
        }
    }
}
