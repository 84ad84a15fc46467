//! What `Ddp<B>`'s `DistributedBackend` hooks do. They run in the thread that calls
//! `backward()`, cannot return errors (Burn's hook signatures), and so record failures in the
//! session, where `DdpSession::check` and `DdpSession::backward` report them.

use std::sync::atomic::{AtomicBool, Ordering};

use burn_backend::distributed::{DistributedParamId, ReduceOperation};
use burn_backend::tensor::FloatTensor;
use burn_backend::{Backend, Shape, TensorMetadata};

use super::reducer::{Finished, GradValue, Origin};
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
    let announce = || {
        session
            .announce(burn_ddp_comm::grad::JoinCall::Backward)
            .map(drop)
    };
    session
        .reducer()
        .begin_backward::<B>(device, used, announce);
}

/// `submit_gradient_sync`: the gradient of `id` is final.
pub(crate) fn gradient_ready<B: Backend>(ptr: *mut FloatTensor<B>, id: DistributedParamId) {
    let Some(session) = current() else {
        return;
    };
    let rank = session.pg.rank();
    let mut r = session.reducer();
    let origin = Origin { ptr: ptr as usize };
    let released = r.gradient_ready(id, origin, |on_gpu| {
        // SAFETY: Burn passes a pointer into the gradient container of the backward pass that
        // is running in this thread; the container outlives the pass, and nothing else touches
        // the entry until `backward()` returns. Cloning a primitive shares or copies its
        // storage.
        let tensor = unsafe { (*ptr).clone() };
        #[cfg(feature = "cuda")]
        let tensor = match on_gpu {
            true => match super::gpu::to_cuda::<B>(tensor) {
                Ok(t) => return Ok(GradValue::Device(t)),
                Err(t) => t,
            },
            false => tensor,
        };
        #[cfg(not(feature = "cuda"))]
        let _ = on_gpu;
        read_f32::<B>(tensor)
            .map(GradValue::Host)
            .map_err(|reason| DdpError::model_access(rank, "reading a gradient", reason))
    });
    if released {
        // The bucket holds the gradient now: release the container's copy (an empty tensor
        // until `finish_backward` writes the reduced one back).
        // SAFETY: as above; nothing reads the entry before `finish_backward`.
        unsafe {
            let old = &*ptr;
            let (device, dtype) = (B::float_device(old), old.dtype());
            *ptr = write_f32::<B>(Vec::new(), Shape::new([0]), dtype, &device);
        }
    }
}

/// `submit_sync_collective`: backward is done; finish every bucket and write the results back.
pub(crate) fn finish_backward<B: Backend>() {
    let Some(session) = current() else {
        return;
    };
    let finished = session.reducer().finish_backward();
    match finished {
        Finished::Host(results) => {
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
        #[cfg(feature = "cuda")]
        Finished::Device(results) => {
            for (origin, t) in results {
                let ptr = origin.ptr as *mut FloatTensor<B>;
                if let Some(t) = super::gpu::from_cuda::<B>(t) {
                    // SAFETY: as above.
                    unsafe { *ptr = t };
                }
            }
        }
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
