//! What `Ddp<B>`'s `DistributedBackend` hooks do. They run in the thread that calls
//! `backward()`, cannot return errors (Burn's hook signatures), and so record failures in the
//! session, where `DdpSession::check` and `DdpSession::backward` report them.

use burn_ddp_comm::ModelError;
use std::sync::atomic::{AtomicBool, Ordering};

use burn_backend::distributed::{DistributedParamId, ReduceOperation};
use burn_backend::tensor::FloatTensor;
use burn_backend::{Backend, Shape, TensorMetadata};

use super::reducer::{Grad, Origin};
use super::values::{read_f32, write_f32};
use super::{current, GradReduction};
use crate::DdpError;

static WARNED_NO_SESSION: AtomicBool = AtomicBool::new(false);

fn warn_no_session() {
    if !WARNED_NO_SESSION.swap(true, Ordering::Relaxed) {
        tracing::warn!(
            "a backward pass has parameters marked for synchronisation but no DdpSession is \
             installed in this thread or process: gradients stay local"
        );
    }
}

/// `register_sync_parameters`: a backward pass over `B` starts on `device`; `used` get gradients
/// in it.
pub(crate) fn begin_backward<B: Backend>(
    device: &B::Device,
    used: impl Iterator<Item = DistributedParamId>,
) {
    let Some(session) = current() else {
        warn_no_session();
        return;
    };
    let mut r = session.reducer();
    if r.active() {
        // Inside a join, the ranks that ran out learn of this pass first (and shadow it).
        if let Err(e) = session.announce(burn_ddp_comm::grad::JoinCall::Backward) {
            r.record_error(e);
            return;
        }
        let on_gpu = r.use_device::<B>(device);
        // `use_device` may have recorded an error (gradients on another GPU than NCCL's): then
        // this pass is not synchronised, and `DdpSession::backward` reports the error.
        if r.active() {
            r.begin(used, on_gpu);
        }
    }
}

/// `submit_gradient_sync`: the gradient of `id` is final.
pub(crate) fn gradient_ready<B: Backend>(ptr: *mut FloatTensor<B>, id: DistributedParamId) {
    let Some(session) = current() else {
        return;
    };
    let mut r = session.reducer();
    if !r.active() {
        return;
    }
    let Some(slot) = r.slot_of(id) else {
        return;
    };
    // SAFETY: Burn passes a pointer into the gradient container of the backward pass that is
    // running in this thread; the container outlives the pass, and nothing else touches the
    // entry until `backward()` returns. Cloning a primitive shares or copies its storage.
    let tensor = unsafe { (*ptr).clone() };
    #[cfg(feature = "cuda")]
    let tensor = match r.device_pass() {
        true => match super::gpu::to_cuda::<B>(tensor) {
            Ok(t) => return r.fill(slot, Grad::Device(t), Origin { ptr: ptr as usize }),
            Err(t) => t,
        },
        false => tensor,
    };
    let expected = r.slot_info(slot).map_or(0, |s| s.info.numel);
    let (device, dtype) = (B::float_device(&tensor), tensor.dtype());
    match read_f32::<B>(tensor) {
        Ok(values) if values.len() == expected => {
            r.fill(slot, Grad::Host(&values), Origin { ptr: ptr as usize });
            if r.bucket_view() {
                drop(values);
                // The bucket holds the gradient now: release the container's copy (an empty
                // tensor until `finish_backward` writes the reduced one back).
                // SAFETY: as above; nothing reads the entry before `finish_backward`.
                unsafe { *ptr = write_f32::<B>(Vec::new(), Shape::new([0]), dtype, &device) };
            }
        }
        Ok(values) => {
            let name = r
                .slot_info(slot)
                .map(|s| s.info.name.clone())
                .unwrap_or_default();
            let rank = session.pg.rank();
            r.record_error(DdpError::Model(ModelError::GradientSize {
                rank,
                param: name,
                expected,
                got: values.len(),
            }));
        }
        Err(reason) => {
            let rank = session.pg.rank();
            r.record_error(DdpError::model_access(rank, "reading a gradient", reason));
        }
    }
}

/// `submit_sync_collective`: backward is done; finish every bucket and write the results back.
pub(crate) fn finish_backward<B: Backend>() {
    let Some(session) = current() else {
        return;
    };
    let mut r = session.reducer();
    #[cfg(feature = "cuda")]
    if r.device_pass() {
        match r.finish_device() {
            Ok(results) => {
                for (origin, t) in results {
                    let ptr = origin.ptr as *mut FloatTensor<B>;
                    if let Some(t) = super::gpu::from_cuda::<B>(t) {
                        // SAFETY: as below.
                        unsafe { *ptr = t };
                    }
                }
            }
            Err(e) => r.record_error(e),
        }
        return;
    }
    match r.finish() {
        Ok(results) => {
            for (origin, values, shape) in results {
                let ptr = origin.ptr as *mut FloatTensor<B>;
                // SAFETY: as in `gradient_ready`: the container entry is alive and unaliased
                // until `backward()` returns, which happens after this hook. (Its shape may be
                // empty: released under `gradient_as_bucket_view`; the plan has the real one.)
                unsafe {
                    let old = &*ptr;
                    *ptr = write_f32::<B>(
                        values,
                        Shape::from(shape),
                        old.dtype(),
                        &B::float_device(old),
                    );
                }
            }
        }
        Err(e) => r.record_error(e),
    }
}

/// `DistributedBackend::all_reduce` on one tensor, through the installed session's group.
/// Without a session (or after a failure, which the session then reports) the tensor is
/// returned unchanged.
pub(crate) fn all_reduce_tensor<B: Backend>(
    tensor: FloatTensor<B>,
    op: ReduceOperation,
) -> FloatTensor<B> {
    let Some(session) = current() else {
        warn_no_session();
        return tensor;
    };
    let device = B::float_device(&tensor);
    let shape = tensor.shape();
    let dtype = tensor.dtype();
    let reduction = match op {
        ReduceOperation::Sum => GradReduction::Sum,
        ReduceOperation::Mean => GradReduction::Mean,
    };
    let values = match read_f32::<B>(tensor.clone()) {
        Ok(v) => v,
        Err(reason) => {
            session.reducer().record_error(DdpError::model_access(
                session.pg.rank(),
                "reading a tensor to all-reduce",
                reason,
            ));
            return tensor;
        }
    };
    // During an overlapped backward, behind the buckets already handed to the communication
    // thread (the same order on every rank); otherwise directly.
    let routed = session.reducer().all_reduce_in_order(values, reduction);
    let reduced = match routed {
        Ok(result) => result,
        Err(mut values) => burn_ddp_comm::grad::reduce_bucket(
            &session.pg,
            &mut values,
            reduction,
            super::Compression::None,
        )
        .map(|()| values),
    };
    match reduced {
        Ok(values) => write_f32::<B>(values, shape, dtype, &device),
        Err(e) => {
            session.reducer().record_error(e);
            tensor
        }
    }
}
