//! A backward hook per parameter on Burn 0.22 and 0.23, which give none: the parameter's tensor
//! goes through an autodiff operation of our own (burn-autodiff's public `Backward`, as
//! `SyncBatchNorm`'s all-reduce in `nn.rs`) before forward, an identity whose backward hands the
//! parameter's gradient to a [`GradSink`] and passes it on unchanged.
//!
//! **When it runs.** burn-autodiff runs backward by depth, not by readiness: every step of a
//! node of depth `d` (its `order`: one more than its deepest parent's) runs after every step of
//! a deeper node (burn-autodiff 0.22.1 `src/runtime/server.rs`, `build_tape` and
//! `execute_steps`: the tape is one list per depth, run from the deepest; 0.23.0-pre.1 the
//! same). An identity over a parameter (a leaf, depth 0) has depth 1 and would run last, after
//! the whole backward. So each hook also takes, as a second parent that is not tracked (it gets
//! no gradient, and backward never visits it), an *anchor*: a node of a chosen depth
//! ([`Levels`]), made once by a chain of untracked identities that run no kernel. The hook of
//! parameter `slot` (in visit order) gets depth `SPACING · (slot + 1)`, so its consumers in
//! forward get a depth above it, and its step runs right after theirs: for a model whose
//! parameters are visited in the order forward uses them (Burn's modules, declared in order),
//! the last layer's gradients are handed over while the earlier layers' backward is still to
//! run, as PyTorch DDP's autograd hooks do. Every depth is consistent with the graph (a node is
//! deeper than each of its parents), so Burn computes the same gradients; only the order in
//! which independent steps run changes.
//!
//! **What it sees.** The gradient of the hook's node is complete when its step runs (all the
//! hooked tensor's consumers ran before), so a parameter used several times is handed over
//! once, with the sum. The parameter (the leaf) gets that gradient as without the hook (unless
//! the sink takes it alone, [`GradSink::leaves_gradient`], as an overlapped step's does), so
//! `GradientsParams::from_grads` over the original model finds it; over the hooked model it
//! finds none (Burn keeps gradients of leaves only: `Tensor::grad` asks
//! `float_is_require_grad`, false for the hook's node, burn-tensor 0.22.1
//! `src/tensor/api/autodiff.rs` line 135), which is why what the hooks hand over, not what the
//! caller's `GradientsParams` holds, is what an overlapped step reduces.

use std::ops::ControlFlow::{self, Break, Continue};
use std::sync::Arc;

use burn::tensor::Tensor;

/// Where a hook hands each parameter's complete gradient, on the backward thread.
pub(crate) trait GradSink: Send + Sync + std::fmt::Debug {
    /// `grad` is the complete gradient of parameter `slot`, in its shape, flattened.
    #[cfg_attr(
        not(any(feature = "flex", feature = "ndarray", feature = "cuda")),
        allow(dead_code)
    )]
    fn ready(&self, slot: usize, grad: Tensor<1>);

    /// Whether the parameter still gets its gradient in Burn's gradient container, as without
    /// the hook (the default). A sink that says no takes the gradient alone: its storage is
    /// shared with nothing, so reading it needs no copy (Flex copies shared storage when it is
    /// read), and `GradientsParams::from_grads` finds no gradient for the parameter.
    #[cfg_attr(
        not(any(feature = "flex", feature = "ndarray", feature = "cuda")),
        allow(dead_code)
    )]
    fn leaves_gradient(&self) -> bool {
        true
    }
}

/// How far apart the hooks of consecutive parameters are, in depth: more than the operations
/// forward runs between two parameters' first uses, for their hooks to run right after their
/// consumers. The cost is Burn's tape, one list per depth (`SPACING · slots` lists).
pub(crate) const SPACING: usize = 32;

/// The depth a hook of parameter `slot` is given.
pub(crate) fn level(slot: usize) -> usize {
    SPACING * (slot + 1)
}

/// Untracked anchors by depth, on one autodiff device: `anchor(d)` is a tensor of one element
/// whose node has depth `d`. Made once (a chain of identities that copy no data), kept.
pub(crate) struct Levels {
    chain: Vec<Tensor<1>>,
}

impl Levels {
    /// The anchors up to depth `deepest` on `device` (an autodiff device); `None` when the
    /// device's backend is none this crate is built for (the hooks are then not applied).
    #[cfg(test)]
    pub(crate) fn new(device: &burn::tensor::Device, deepest: usize) -> Option<Self> {
        Self::from_seed(Tensor::<1>::zeros([1], device), deepest)
    }

    /// The anchors up to depth `deepest`, in `seed`'s autodiff context (its backend and
    /// checkpointing strategy: those of the tensors to hook), `seed` being an untracked tensor
    /// of one element; `None` when it is not an autodiff tensor of a backend this crate is
    /// built for.
    pub(crate) fn from_seed(seed: Tensor<1>, deepest: usize) -> Option<Self> {
        let mut t = seed;
        let mut chain = Vec::with_capacity(deepest + 1);
        chain.push(t.clone());
        for _ in 0..deepest {
            t = match backends::relevel(t) {
                Break(next) => next,
                Continue(_) => return None,
            };
            chain.push(t.clone());
        }
        Some(Self { chain })
    }

    /// The anchor of depth `depth`, if made.
    fn anchor(&self, depth: usize) -> Option<&Tensor<1>> {
        self.chain.get(depth)
    }
}

/// `t` (parameter `slot`'s tensor) through a hook that hands its gradient to `sink` (see the
/// module documentation), at depth [`level`]`(slot)`: `Break`; `Continue(t)` when it is not an
/// autodiff tensor of the anchors' context, or `levels` is not deep enough.
pub(crate) fn hooked<const D: usize>(
    t: Tensor<D>,
    slot: usize,
    levels: &Levels,
    sink: &Arc<dyn GradSink>,
) -> ControlFlow<Tensor<D>, Tensor<D>> {
    hooked_above(t, level(slot) - 1, (slot, levels), sink)
}

/// `t` through a hook for `slot` whose depth is at least one more than `depth` (and than
/// `t`'s own), as [`hooked`].
pub(crate) fn hooked_above<const D: usize>(
    t: Tensor<D>,
    depth: usize,
    (slot, levels): (usize, &Levels),
    sink: &Arc<dyn GradSink>,
) -> ControlFlow<Tensor<D>, Tensor<D>> {
    let Some(anchor) = levels.anchor(depth) else {
        return Continue(t);
    };
    backends::hook(t, anchor.clone(), (Arc::clone(sink), slot))
}

/// The tensor of a hook, applied or not.
#[cfg(test)]
fn either<T>(f: ControlFlow<T, T>) -> T {
    match f {
        Break(t) | Continue(t) => t,
    }
}

mod backends {
    use super::*;
    use crate::autodiff::{self, AutodiffOp};

    /// The hook's state: where the gradient goes, and whose it is.
    pub(super) type HookState = (Arc<dyn GradSink>, usize);

    /// The hook on the backend `t` is on (`Continue(t)`: none this crate is built for).
    pub(super) fn hook<const D: usize>(
        t: Tensor<D>,
        anchor: Tensor<1>,
        state: HookState,
    ) -> ControlFlow<Tensor<D>, Tensor<D>> {
        autodiff::apply(&Hook { anchor, state }, t)
    }

    /// One more depth than `t`'s, no data copied (`Continue(t)`: no backend of this crate).
    pub(super) fn relevel(t: Tensor<1>) -> ControlFlow<Tensor<1>, Tensor<1>> {
        autodiff::apply(&Relevel, t)
    }

    /// An identity over a parameter, with an anchor as a second, untracked parent.
    #[cfg_attr(
        not(any(feature = "flex", feature = "ndarray", feature = "cuda")),
        allow(dead_code)
    )]
    struct Hook {
        anchor: Tensor<1>,
        state: HookState,
    }

    /// An identity one depth above its input, never tracked.
    struct Relevel;

    impl<const D: usize> AutodiffOp<Tensor<D>> for Hook {
        #[cfg(any(feature = "flex", feature = "ndarray", feature = "cuda"))]
        fn on<B, C>(&self, t: Tensor<D>) -> ControlFlow<Tensor<D>, Tensor<D>>
        where
            B: autodiff::Backend,
            C: autodiff::CheckpointStrategy,
            autodiff::DispatchTensor: autodiff::DispatchKindConversion<B>
                + autodiff::DispatchKindConversion<autodiff::Autodiff<B, C>>,
        {
            let Ok(tensor) = t.clone().try_into_primitive::<autodiff::Autodiff<B, C>>() else {
                return Continue(t);
            };
            let Ok(anchor) = self
                .anchor
                .clone()
                .try_into_primitive::<autodiff::Autodiff<B, C>>()
            else {
                return Continue(t);
            };
            let (primitive, node) = tensor.into_parts();
            let (_, anchor) = anchor.into_parts();
            let parents = [node, anchor];
            Break(autodiff::finish::<B, C, _, 2, D>(
                ad::GradHook::<D>,
                parents,
                self.state.clone(),
                primitive,
            ))
        }
    }

    impl AutodiffOp<Tensor<1>> for Relevel {
        #[cfg(any(feature = "flex", feature = "ndarray", feature = "cuda"))]
        fn on<B, C>(&self, t: Tensor<1>) -> ControlFlow<Tensor<1>, Tensor<1>>
        where
            B: autodiff::Backend,
            C: autodiff::CheckpointStrategy,
            autodiff::DispatchTensor: autodiff::DispatchKindConversion<B>
                + autodiff::DispatchKindConversion<autodiff::Autodiff<B, C>>,
        {
            let Ok(tensor) = t.clone().try_into_primitive::<autodiff::Autodiff<B, C>>() else {
                return Continue(t);
            };
            let (primitive, node) = tensor.into_parts();
            Break(autodiff::finish::<B, C, _, 1, 1>(
                ad::Level,
                [node],
                (),
                primitive,
            ))
        }
    }

    #[cfg(any(feature = "flex", feature = "ndarray", feature = "cuda"))]
    mod ad {
        use crate::autodiff::{
            Backend, Backward, Checkpointer, DispatchKindConversion, DispatchTensor, Gradients, Ops,
        };
        use burn::tensor::Tensor;

        use super::HookState;

        /// The hook: an identity whose backward hands the gradient (of `D` dimensions) over.
        #[derive(Debug)]
        pub(super) struct GradHook<const D: usize>;

        impl<B: Backend, const D: usize> Backward<B, 2> for GradHook<D>
        where
            DispatchTensor: DispatchKindConversion<B>,
        {
            type State = HookState;

            fn backward(
                self,
                ops: Ops<Self::State, 2>,
                grads: &mut Gradients,
                _checkpointer: &mut Checkpointer,
            ) {
                let (sink, slot) = ops.state;
                let grad = grads.consume::<B>(&ops.node);
                let [param, _anchor] = ops.parents;
                if let Some(param) = param.filter(|_| sink.leaves_gradient()) {
                    grads.register::<B>(param.id, grad.clone());
                }
                let grad_d = Tensor::<D>::from_primitive::<B>(grad);
                let numel = grad_d.shape().num_elements();
                sink.ready(slot, grad_d.reshape([numel]));
            }
        }

        /// A depth more, no data: only ever untracked (its backward never runs).
        #[derive(Debug)]
        pub(super) struct Level;

        impl<B: Backend> Backward<B, 1> for Level {
            type State = ();

            fn backward(
                self,
                ops: Ops<Self::State, 1>,
                grads: &mut Gradients,
                _checkpointer: &mut Checkpointer,
            ) {
                burn::backend::autodiff::ops::unary::<B, _>(ops.parents, ops.node, grads, |g| g);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    use burn::module::{Module, ModuleMapper, Param};
    use burn::nn::{Linear, LinearConfig, Relu};
    use burn::optim::GradientsParams;
    use burn::tensor::Device;

    /// What reached the sink, in order: (slot, gradient values).
    #[derive(Debug, Default)]
    struct Record(Mutex<Vec<(usize, Vec<f32>)>>);

    impl GradSink for Record {
        fn ready(&self, slot: usize, grad: Tensor<1>) {
            let values = grad.into_data().convert::<f32>().try_to_vec().unwrap();
            self.0.lock().unwrap().push((slot, values));
        }
    }

    fn values<const D: usize>(t: Tensor<D>) -> Vec<f32> {
        t.into_data().convert::<f32>().try_to_vec().unwrap()
    }

    fn recorder() -> (Arc<Record>, Arc<dyn GradSink>) {
        let record = Arc::new(Record::default());
        let sink: Arc<dyn GradSink> = record.clone();
        (record, sink)
    }

    #[test]
    fn a_parameter_used_twice_is_handed_over_once_with_its_whole_gradient() {
        let device = Device::flex().autodiff();
        let w = Tensor::<2>::from_floats([[1.0, 2.0], [3.0, -4.0]], &device).require_grad();
        let x = Tensor::<2>::from_floats([[0.5, -1.0]], &device);
        let plain = x
            .clone()
            .matmul(w.clone())
            .matmul(w.clone())
            .sum()
            .backward();
        let want = values(w.grad(&plain).unwrap());

        let levels = Levels::new(&device, level(0)).unwrap();
        let (record, sink) = recorder();
        let h = either(hooked(w.clone(), 0, &levels, &sink));
        let grads = x.matmul(h.clone()).matmul(h.clone()).sum().backward();
        assert_eq!(*record.0.lock().unwrap(), vec![(0, want.clone())]);
        // The parameter's gradient is the whole one; the hooked tensor keeps none.
        assert_eq!(values(w.grad(&grads).unwrap()), want);
        assert!(h.grad(&grads).is_none());
    }

    #[derive(Module, Debug)]
    struct Mlp {
        a: Linear,
        b: Linear,
        c: Linear,
    }

    /// Puts every float parameter through a hook, in visit order (its slot).
    struct Hook<'a> {
        levels: &'a Levels,
        sink: &'a Arc<dyn GradSink>,
        slot: usize,
    }

    impl ModuleMapper for Hook<'_> {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let slot = self.slot;
            self.slot += 1;
            param.map(|t| either(hooked(t, slot, self.levels, self.sink)))
        }
    }

    /// A probe between layers: an identity that says when backward reached it.
    const PROBE: usize = 100;

    /// The MLP's loss, with the probes `PROBE + 1` after layer a and `PROBE + 2` after b when
    /// `probes` is given.
    fn loss(model: &Mlp, x: Tensor<2>, probes: Option<(&Levels, &Arc<dyn GradSink>)>) -> Tensor<1> {
        let probe = |t: Tensor<2>, id: usize| match probes {
            // Depth 0: the probe's depth is its input's, plus one.
            Some((levels, sink)) => either(hooked_above(t, 0, (PROBE + id, levels), sink)),
            None => t,
        };
        let h1 = probe(Relu.forward(model.a.forward(x)), 1);
        let h2 = probe(Relu.forward(model.b.forward(h1)), 2);
        model.c.forward(h2).sum()
    }

    fn mlp(device: &Device) -> Mlp {
        let layer = |i, o| LinearConfig::new(i, o).init(device);
        Mlp {
            a: layer(4, 8),
            b: layer(8, 8),
            c: layer(8, 2),
        }
    }

    #[test]
    fn each_layers_gradients_are_handed_over_before_the_layer_below_is_differentiated() {
        let device = Device::flex().autodiff();
        let model = mlp(&device);
        let x = Tensor::<2>::from_floats([[1.0, -0.5, 0.25, 2.0], [0.0, 1.0, -1.0, 0.5]], &device);
        let levels = Levels::new(&device, level(6)).unwrap();
        let (record, sink) = recorder();
        let hooked_model = model.clone().map(&mut Hook {
            levels: &levels,
            sink: &sink,
            slot: 0,
        });
        let _ = loss(&hooked_model, x, Some((&levels, &sink))).backward();
        let order: Vec<usize> = record.0.lock().unwrap().iter().map(|(s, _)| *s).collect();
        // Slots: a.weight 0, a.bias 1, b.weight 2, b.bias 3, c.weight 4, c.bias 5. Layer c's
        // gradients come before the probe after b (before b's backward ran), b's before the
        // probe after a: as PyTorch's hooks fire, last layer first.
        assert_eq!(order, vec![5, 4, PROBE + 2, 3, 2, PROBE + 1, 1, 0]);
    }

    /// The negative control: hooks at the depth their parameter gives them (one) all run at
    /// the end of backward, after every layer's.
    #[test]
    fn without_anchors_every_hook_runs_after_the_whole_backward() {
        struct Unanchored<'a>(&'a Levels, &'a Arc<dyn GradSink>, usize);
        impl ModuleMapper for Unanchored<'_> {
            fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
                let slot = self.2;
                self.2 += 1;
                param.map(|t| either(hooked_above(t, 0, (slot, self.0), self.1)))
            }
        }
        let device = Device::flex().autodiff();
        let model = mlp(&device);
        let x = Tensor::<2>::from_floats([[1.0, -0.5, 0.25, 2.0], [0.0, 1.0, -1.0, 0.5]], &device);
        let levels = Levels::new(&device, 1).unwrap();
        let (record, sink) = recorder();
        let hooked_model = model.map(&mut Unanchored(&levels, &sink, 0));
        let _ = loss(&hooked_model, x, Some((&levels, &sink))).backward();
        let order: Vec<usize> = record.0.lock().unwrap().iter().map(|(s, _)| *s).collect();
        assert_eq!(&order[..2], &[PROBE + 2, PROBE + 1], "{order:?}");
        assert_eq!(order.len(), 8);
    }

    #[test]
    fn the_hooks_change_no_gradient_and_hand_over_every_one() {
        let device = Device::flex().autodiff();
        let model = mlp(&device);
        let x = Tensor::<2>::from_floats([[1.0, -0.5, 0.25, 2.0], [0.0, 1.0, -1.0, 0.5]], &device);
        let plain = GradientsParams::from_grads(loss(&model, x.clone(), None).backward(), &model);

        let levels = Levels::new(&device, level(6)).unwrap();
        let (record, sink) = recorder();
        let hooked_model = model.clone().map(&mut Hook {
            levels: &levels,
            sink: &sink,
            slot: 0,
        });
        let grads = loss(&hooked_model, x, None).backward();
        let handed: Vec<Vec<f32>> = {
            let mut r = record.0.lock().unwrap().clone();
            r.sort_by_key(|(s, _)| *s);
            r.into_iter().map(|(_, v)| v).collect()
        };
        let through_model = GradientsParams::from_grads(grads, &model);
        let params = |m: &Mlp| {
            [&m.a, &m.b, &m.c]
                .into_iter()
                .flat_map(|l| [l.weight.id, l.bias.as_ref().unwrap().id])
                .collect::<Vec<_>>()
        };
        for (slot, id) in params(&model).into_iter().enumerate() {
            let want = if slot % 2 == 0 {
                values(plain.get::<2>(id).unwrap())
            } else {
                values(plain.get::<1>(id).unwrap())
            };
            let got = if slot % 2 == 0 {
                values(through_model.get::<2>(id).unwrap())
            } else {
                values(through_model.get::<1>(id).unwrap())
            };
            assert_eq!(got, want, "slot {slot}");
            assert_eq!(handed[slot], want, "slot {slot}, as handed over");
        }
    }
}
