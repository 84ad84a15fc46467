//! Operations of this crate's own inside Burn's autodiff (`SyncBatchNorm`'s all-reduce in
//! `nn.rs`, the parameter hooks of `hook.rs`), each written once over the inner backend `B` and
//! the checkpointing strategy `C` (burn-autodiff's public `Backward`, through Burn's extension
//! API), and applied here on whichever of the backends this crate is built for a tensor is on.
//!
//! Burn 0.22's and 0.23's `Tensor` is a closed enum over Burn's backends (burn-dispatch), so an
//! operation reaches the autodiff tensor by trying each `Autodiff<B, C>` in turn
//! (`try_into_primitive`): [`apply`] tries the backends of this crate's features (`flex`,
//! `ndarray`, `cuda`) under both of Burn's checkpointing strategies.

use std::ops::ControlFlow::{self, Continue};

#[cfg(any(feature = "flex", feature = "ndarray", feature = "cuda"))]
pub(crate) use imp::*;

/// An autodiff operation of this crate's, over any inner backend and checkpointing strategy.
pub(crate) trait AutodiffOp<T> {
    /// The result (`Break`) when `t` is an `Autodiff<B, C>` tensor; `Continue(t)` otherwise.
    #[cfg(any(feature = "flex", feature = "ndarray", feature = "cuda"))]
    fn on<B, C>(&self, t: T) -> ControlFlow<T, T>
    where
        B: Backend,
        C: CheckpointStrategy,
        DispatchTensor: DispatchKindConversion<B> + DispatchKindConversion<Autodiff<B, C>>;
}

/// `op` on `t` (`Break`) from the backend among those this crate is built for that `t` is on;
/// `Continue(t)` when it is on none of them (or the crate is built for none).
#[allow(clippy::let_and_return)] // without any backend feature, no attempt is made
pub(crate) fn apply<T, O: AutodiffOp<T>>(op: &O, t: T) -> ControlFlow<T, T> {
    #[cfg(feature = "flex")]
    let t = imp::each_strategy::<burn::backend::Flex, T, O>(op, t)?;
    // Burn 0.22 deprecates NdArray, but still offers it (0.23 has none).
    #[cfg(feature = "ndarray")]
    #[allow(deprecated)]
    let t = imp::each_strategy::<burn::backend::NdArray, T, O>(op, t)?;
    #[cfg(feature = "cuda")]
    let t = imp::each_strategy::<burn::backend::Cube, T, O>(op, t)?;
    let _ = op;
    Continue(t)
}

#[cfg(any(feature = "flex", feature = "ndarray", feature = "cuda"))]
mod imp {
    use std::ops::ControlFlow;

    pub(crate) use burn::backend::autodiff::checkpoint::base::Checkpointer;
    pub(crate) use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
    use burn::backend::autodiff::checkpoint::strategy::{BalancedCheckpointing, NoCheckpointing};
    pub(crate) use burn::backend::autodiff::grads::Gradients;
    use burn::backend::autodiff::ops::OpsKind;
    pub(crate) use burn::backend::autodiff::ops::{Backward, NodeGuard, Ops};
    pub(crate) use burn::backend::autodiff::Autodiff;
    pub(crate) use burn::backend::{Backend, DispatchKindConversion, DispatchTensor};
    use burn::tensor::Tensor;

    use super::AutodiffOp;

    /// `op` on `B` with autodiff, under either checkpointing strategy.
    pub(super) fn each_strategy<B, T, O: AutodiffOp<T>>(op: &O, t: T) -> ControlFlow<T, T>
    where
        B: Backend,
        DispatchTensor: DispatchKindConversion<B>
            + DispatchKindConversion<Autodiff<B, NoCheckpointing>>
            + DispatchKindConversion<Autodiff<B, BalancedCheckpointing>>,
    {
        let t = op.on::<B, NoCheckpointing>(t)?;
        op.on::<B, BalancedCheckpointing>(t)
    }

    /// The tensor that `backward` (an operation of `parents`, keeping `state` for its backward
    /// where a parent is tracked) gives for `out`, computed by the caller. Compute-bound: a
    /// checkpointing strategy keeps the output rather than running the operation again during
    /// backward.
    pub(crate) fn finish<B, C, O, const N: usize, const D: usize>(
        backward: O,
        parents: [NodeGuard; N],
        state: O::State,
        out: B::FloatTensorPrimitive,
    ) -> Tensor<D>
    where
        B: Backend,
        C: CheckpointStrategy,
        O: Backward<B, N>,
        DispatchTensor: DispatchKindConversion<Autodiff<B, C>>,
    {
        let prep = backward.prepare::<C>(parents);
        let out = match prep.compute_bound().stateful() {
            OpsKind::Tracked(prep) => prep.finish(state, out),
            OpsKind::UnTracked(prep) => prep.finish(out),
        };
        Tensor::from_primitive::<Autodiff<B, C>>(out)
    }
}
