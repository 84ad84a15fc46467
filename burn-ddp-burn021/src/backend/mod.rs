//! How [`Ddp<B>`](crate::Ddp), the backend decorator, implements Burn's backend traits.
//!
//! - `forward.rs`: every tensor operation forwarded to `B` (generated)
//! - `convert.rs`: the conversions those forwards need
//! - `mod.rs`: the `DistributedBackend` hooks
//!
//! Every tensor operation is `B`'s own (the forwards in `forward.rs` are generated from Burn's
//! trait sources by `scripts/gen_forward.py`), so `Ddp<B>` computes exactly what `B` computes, with
//! `B`'s kernels. What `Ddp` adds is Burn's `DistributedBackend` hooks: under `Autodiff<Ddp<B>>`,
//! Burn hands each parameter's gradient to [`Ddp::submit_gradient_sync`] as soon as it is final,
//! and calls [`Ddp::submit_sync_collective`] at the end of `backward()`. Those hooks feed the
//! session's reducer (`ddp/`), which buckets, all-reduces while backward continues, and
//! writes the averaged gradients back before `backward()` returns.

mod convert;
mod forward;

use burn_backend::distributed::{
    CollectiveTensor, DistributedBackend, DistributedParams, ReduceOperation, TensorRef,
};
use burn_backend::tensor::FloatTensor;
use burn_backend::{Backend, BackendTypes, DeviceId};

use crate::ddp::{hooks, Ddp};

impl<B: Backend> BackendTypes for Ddp<B> {
    type Device = B::Device;
    type FloatTensorPrimitive = B::FloatTensorPrimitive;
    type FloatElem = B::FloatElem;
    type IntTensorPrimitive = B::IntTensorPrimitive;
    type IntElem = B::IntElem;
    type BoolTensorPrimitive = B::BoolTensorPrimitive;
    type BoolElem = B::BoolElem;
    type QuantizedTensorPrimitive = B::QuantizedTensorPrimitive;
}

impl<B: Backend> DistributedBackend for Ddp<B> {
    fn register_sync_parameters(device: &Self::Device, params: Vec<DistributedParams>) {
        hooks::begin_backward::<B>(device, params.iter().map(|p| p.param_id));
    }

    fn submit_gradient_sync(tensor: TensorRef<Self>, params: DistributedParams) {
        // The pointer is into the gradient container of the running backward pass; it stays
        // valid until `backward()` returns, after `submit_sync_collective`.
        hooks::gradient_ready::<B>(tensor.0, params.param_id);
    }

    fn submit_sync_collective(_device: &Self::Device) {
        hooks::finish_backward::<B>();
    }

    fn all_reduce(
        tensor: FloatTensor<Self>,
        op: ReduceOperation,
        _device_ids: Vec<DeviceId>,
    ) -> CollectiveTensor<Self> {
        CollectiveTensor::new(hooks::all_reduce_tensor::<B>(tensor, op))
    }

    fn sync_collective(_device: &Self::Device) {
        // Collectives complete before `all_reduce` returns: nothing is in flight here.
    }
}

const _: () = assert!(forward::FORWARDED > 400);

/// `Ddp` over Burn's CUDA backend (`Autodiff<DdpCuda>` is the training backend).
///
/// Gradient buckets stay on the GPU and are all-reduced in place by NCCL (see
/// [`GradTransport`](crate::GradTransport) for the host-staged alternative).
#[cfg(feature = "cuda")]
pub type DdpCuda = Ddp<burn::backend::Cuda>;

// `Ddp<Cuda>` must stay a complete backend, and `Autodiff` of it a training backend: this fails
// to compile (in every CI run, which builds the `cuda` feature) if a forward goes missing.
#[cfg(feature = "cuda")]
const _: fn() = || {
    fn training_backend<B: burn::tensor::backend::AutodiffBackend>() {}
    training_backend::<burn::backend::Autodiff<DdpCuda>>();
};
