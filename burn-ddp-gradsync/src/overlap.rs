//! Gradient communication overlapped with backward ([`GradSync::overlapped`](crate::GradSync::overlapped)):
//! the model's trainable parameters go through the hooks of `hook.rs` for one forward and
//! backward, and each hook pushes its parameter's complete gradient into the step's pass (the
//! core's engine, `Pass`) over the line's transport (host-staged, or the device transport over
//! NCCL), which sends every bucket whose gradients are all in, in bucket order, while backward
//! goes on. [`GradSync::sync`](crate::GradSync::sync) then finishes the pass: the buckets left,
//! the answers, the reduced gradients written into the caller's `GradientsParams`.

use std::sync::{Arc, Mutex, MutexGuard};

use std::ops::ControlFlow;

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::tensor::{Device, Tensor};
use burn_ddp_comm::grad::{BucketPlan, HostBuckets, HostSync, Pass};
use burn_ddp_comm::{DdpError, Rank};

use crate::hook::{hooked, level, GradSink, Levels};

/// Locks `m`, whatever a panic left in it (the pass records failures itself).
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The transport a step's pass runs over.
pub(crate) enum Open {
    /// Host-staged: the rank's host transport (shared with the after-backward path).
    Host {
        host: Arc<Mutex<HostSync>>,
        pass: Pass<HostBuckets>,
    },
    /// On the GPU, over NCCL.
    #[cfg(feature = "cuda")]
    Device {
        link: Arc<Mutex<crate::cuda::DevicePath>>,
        pass: Pass<crate::device::DeviceBuckets<crate::cuda::DevicePath>>,
    },
}

/// The pass of one overlapped step, which its hooks push into during backward.
pub(crate) struct OpenPass {
    rank: Rank,
    plan: Arc<BucketPlan<usize>>,
    state: Mutex<State>,
}

/// What the hooks change as they come.
struct State {
    /// The pass (`None` once ended).
    open: Option<Open>,
    /// The slots handed over so far.
    pushed: Vec<bool>,
    /// Gradients accumulated before this step's backward (flattened), added to the slot's
    /// gradient when it comes, or handed over alone at the end if it never does.
    earlier: Vec<Option<Tensor<1>>>,
    /// The buckets already sent when the latest gradient came: at the end, those that left
    /// while backward still had work to do.
    early: usize,
}

impl std::fmt::Debug for OpenPass {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = lock(&self.state);
        f.debug_struct("OpenPass")
            .field("rank", &self.rank)
            .field("open", &state.open.is_some())
            .field("pushed", &state.pushed.iter().filter(|p| **p).count())
            .finish()
    }
}

impl OpenPass {
    /// A step over `plan` whose pass has not begun (its hooks hand over nothing until
    /// [`begin`](Self::begin)).
    pub(crate) fn new(rank: Rank, plan: Arc<BucketPlan<usize>>) -> Self {
        let slots = plan.slots.len();
        Self {
            rank,
            plan,
            state: Mutex::new(State {
                open: None,
                pushed: vec![false; slots],
                earlier: (0..slots).map(|_| None).collect(),
                early: 0,
            }),
        }
    }

    /// Begins the pass `open`, with the gradients accumulated before (`earlier`, by slot).
    pub(crate) fn begin(&self, open: Open, earlier: Vec<Option<Tensor<1>>>) {
        let mut state = lock(&self.state);
        state.open = Some(open);
        state.earlier = earlier;
    }

    /// The pass, for its end (`None`: already taken): the earlier gradients of the slots the
    /// hooks never handed over go first.
    pub(crate) fn close(&self) -> Option<Open> {
        let mut state = lock(&self.state);
        let State {
            open,
            pushed,
            earlier,
            ..
        } = &mut *state;
        let pass = open.as_mut()?;
        for (slot, e) in earlier.iter_mut().enumerate() {
            if let (false, Some(g)) = (pushed[slot], e.take()) {
                pushed[slot] = true;
                push(pass, self.rank, &self.plan, slot, g);
            }
        }
        state.open.take()
    }

    /// The buckets sent before the step's last gradient came from backward.
    pub(crate) fn early(&self) -> usize {
        lock(&self.state).early
    }

    /// The plan the pass runs over.
    pub(crate) fn plan(&self) -> &Arc<BucketPlan<usize>> {
        &self.plan
    }
}

/// Pushes parameter `slot`'s gradient into `open`'s pass; a gradient that cannot be read fails
/// the pass (the buckets still go).
fn push(open: &mut Open, rank: Rank, plan: &BucketPlan<usize>, slot: usize, grad: Tensor<1>) {
    match open {
        Open::Host { host, pass } => {
            let what = "reading a gradient";
            let values = grad
                .try_into_data()
                .map_err(|e| DdpError::model_access(rank, what, e))
                .and_then(|d| {
                    d.convert::<f32>()
                        .try_into_vec::<f32>()
                        .map_err(|e| DdpError::model_access(rank, what, format!("{e:?}")))
                });
            let mut host = lock(host);
            match values {
                Ok(v) => pass.push(&mut host.comm(), plan, slot, Some(&v[..])),
                Err(e) => {
                    pass.fail(e);
                    pass.push(&mut host.comm(), plan, slot, None);
                }
            }
        }
        #[cfg(feature = "cuda")]
        Open::Device { link, pass } => pass.push(&mut &*lock(link), plan, slot, Some(grad)),
    }
}

impl GradSink for OpenPass {
    /// Pushes parameter `slot`'s gradient (plus the earlier one, if any) into the pass, on the
    /// backward thread; a failure (a gradient that cannot be read, of the wrong size, a second
    /// backward through the same overlapped model) is kept by the pass and reported by
    /// `GradSync::sync`, the buckets still going to every rank.
    fn ready(&self, slot: usize, grad: Tensor<1>) {
        let mut state = lock(&self.state);
        let State {
            open,
            pushed,
            earlier,
            early,
        } = &mut *state;
        let Some(pass) = open.as_mut() else {
            return;
        };
        *early = match pass {
            Open::Host { pass, .. } => pass.sent(),
            #[cfg(feature = "cuda")]
            Open::Device { pass, .. } => pass.sent(),
        };
        if std::mem::replace(&mut pushed[slot], true) {
            let e = DdpError::model_access(
                self.rank,
                "overlapping gradient communication with backward",
                "a second backward ran through the model GradSync::overlapped returned for \
                 this step: ask for it again for each step (and, to accumulate gradients over \
                 micro-batches, run the earlier ones on the model itself and hand their sum to \
                 GradSync::overlapped_after for the last)",
            );
            match pass {
                Open::Host { pass, .. } => pass.fail(e),
                #[cfg(feature = "cuda")]
                Open::Device { pass, .. } => pass.fail(e),
            }
            return;
        }
        let grad = match earlier[slot].take() {
            Some(e) => grad + e,
            None => grad,
        };
        push(pass, self.rank, &self.plan, slot, grad);
    }

    /// The step's pass takes each gradient alone: `sync` writes the reduced one into the
    /// caller's `GradientsParams`, so the parameter's own would only be copied for nothing.
    fn leaves_gradient(&self) -> bool {
        false
    }
}

impl crate::nn::InOrder for OpenPass {
    /// Behind the host-staged buckets in flight (`HostBuckets::all_reduce_in_order`); a device
    /// pass's buckets travel over NCCL, which orders its own collectives apart from the
    /// group's, so nothing waits behind them.
    fn sum_in_order(
        &self,
        data: Vec<f32>,
    ) -> std::result::Result<burn_ddp_comm::Result<Vec<f32>>, Vec<f32>> {
        let mut state = lock(&self.state);
        match state.open.as_mut() {
            Some(Open::Host { host, pass }) => {
                let mut host = lock(host);
                pass.transport_mut().all_reduce_in_order(
                    host.comm(),
                    data,
                    burn_ddp_comm::GradReduction::Sum,
                )
            }
            _ => Err(data),
        }
    }
}

/// The anchors of the hooks, for the device (and number of parameters) they were made for.
#[derive(Default)]
pub(crate) struct Anchors(Option<(Device, usize, Arc<Levels>)>);

impl std::fmt::Debug for Anchors {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Anchors")
            .field(&self.0.as_ref().map(|(d, n, _)| (d, n)))
            .finish()
    }
}

impl Anchors {
    /// The anchors for `model`'s `slots` trainable parameters, in the autodiff context of its
    /// first one (made the first time, or when its device or the number of parameters
    /// changed); `None` when it is not an autodiff tensor of a backend this crate is built for.
    pub(crate) fn for_model<M: Module>(&mut self, model: &M, slots: usize) -> Option<Arc<Levels>> {
        let seed = first_trainable(model)?;
        let device = seed.device();
        match &self.0 {
            Some((d, n, levels)) if *d == device && *n >= slots => Some(Arc::clone(levels)),
            _ => {
                let levels = Arc::new(Levels::from_seed(seed, level(slots))?);
                self.0 = Some((device, slots, Arc::clone(&levels)));
                Some(levels)
            }
        }
    }
}

/// A fresh untracked tensor of one element in the autodiff context of `model`'s first
/// trainable parameter (its backend and checkpointing strategy), holding nothing of it.
fn first_trainable<M: Module>(model: &M) -> Option<Tensor<1>> {
    struct First(Option<Tensor<1>>);
    impl ModuleVisitor for First {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if self.0.is_none() && param.is_require_grad() {
                let t = param.val().detach();
                let n = t.shape().num_elements();
                if n > 0 {
                    self.0 = Some(t.reshape([n]).slice(0..1).zeros_like());
                }
            }
        }
    }
    let mut first = First(None);
    model.visit(&mut first);
    first.0
}

/// `model` with every trainable parameter through a hook into `sink` (slot: its position
/// among the trainable parameters in visit order, as in the plan); `None` when one of them
/// could not be hooked (not an autodiff tensor of the anchors' context).
pub(crate) fn hook_model<M: Module>(
    model: &M,
    levels: &Levels,
    sink: Arc<dyn GradSink>,
) -> Option<M> {
    struct Hook<'a> {
        levels: &'a Levels,
        sink: Arc<dyn GradSink>,
        slot: usize,
        missed: bool,
    }
    impl ModuleMapper for Hook<'_> {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            if !param.is_require_grad() {
                return param;
            }
            let slot = self.slot;
            self.slot += 1;
            let mut missed = false;
            let param = param.map(|t| match hooked(t, slot, self.levels, &self.sink) {
                ControlFlow::Break(h) => h,
                ControlFlow::Continue(t) => {
                    missed = true;
                    t
                }
            });
            self.missed |= missed;
            param
        }
    }
    let mut hook = Hook {
        levels,
        sink,
        slot: 0,
        missed: false,
    };
    let hooked = model.clone().map(&mut hook);
    (!hook.missed).then_some(hooked)
}
