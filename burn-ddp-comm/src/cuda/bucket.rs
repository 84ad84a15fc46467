//! One gradient bucket on a device path, as both Burn lines hand it to NCCL: each buffer as a
//! [`DeviceSpan`] (its device pointer and size, and what keeps the allocation alive), checked
//! and all-reduced by [`all_reduce_bucket`], then held by the issuer until NCCL's stream is
//! done with it. A line only finds the pointer behind its release's tensor type.

use crate::error::CudaError;
use std::any::Any;
use std::fmt;

use super::nccl::{check_bucket_span, check_bucket_tensor, NcclComm};
use crate::comm::{DType, ReduceOp};
use crate::error::{DdpError, Result};
use crate::types::Rank;

/// A device allocation that NCCL reads or writes: its pointer and size in bytes, and what
/// keeps it alive and unreused (the line's tensor and cubecl's guard of the allocation) until
/// the span is dropped.
pub struct DeviceSpan {
    ptr: u64,
    bytes: u64,
    _keep: Box<dyn Any>,
}

// SAFETY: a span is made only by `DeviceSpan::new`, whose caller promises that what it keeps may
// be dropped from any thread; the pointer is a copy, never dereferenced here.
unsafe impl Send for DeviceSpan {}

impl fmt::Debug for DeviceSpan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceSpan")
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("bytes", &self.bytes)
            .finish_non_exhaustive()
    }
}

impl DeviceSpan {
    /// `bytes` bytes at the device pointer `ptr`, kept valid by `keep`.
    ///
    /// # Safety
    /// `ptr` must address at least `bytes` bytes of device memory that stay allocated, and are
    /// not reused, while `keep` lives; `keep` must be safe to drop from another thread (cubecl's
    /// tensors and resource guards are: their release goes through cubecl's server).
    pub unsafe fn new(ptr: u64, bytes: u64, keep: impl Any) -> Self {
        Self {
            ptr,
            bytes,
            _keep: Box::new(keep),
        }
    }

    /// The device pointer.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// The size of the allocation, in bytes.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
}

/// One bucket's all-reduce, as a device path's issuer thread receives it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BucketCall {
    /// The bucket's index in the plan.
    pub bucket: usize,
    /// Its elements.
    pub count: usize,
    /// Their type on the wire (f32, or f16/bf16 when compressed).
    pub dtype: DType,
    /// The reduction.
    pub op: ReduceOp,
}

impl BucketCall {
    /// How errors name one of the bucket's buffers: `which` ("packed input", "output
    /// buffer") of bucket N.
    pub fn what(&self, which: &str) -> String {
        format!("{which} of bucket {}", self.bucket)
    }

    /// Checks the bucket's `which` buffer before its device pointer is taken: contiguous,
    /// `self.count` elements of the line's dtype `want` (`found`: its elements and dtype).
    ///
    /// # Errors
    /// [`DdpError::bucket_layout`] saying what differs.
    pub fn check_tensor<T: PartialEq + fmt::Debug>(
        &self,
        rank: Rank,
        which: &str,
        contiguous: bool,
        found: (usize, T),
        want: T,
    ) -> Result<()> {
        let want = (self.count, want);
        check_bucket_tensor(rank, &self.what(which), contiguous, found, want)
    }
}

/// Checks that `send` (the bucket's packed gradients) and `recv` (its output) each hold
/// `call.count` elements of `call.dtype`, and queues their all-reduce on `comm`'s stream.
/// Returns both spans: hold them until a wait on `comm` has succeeded, or its abort has
/// drained.
///
/// # Safety
/// `send` and `recv` must be on `comm`'s GPU and distinct allocations; the work that wrote
/// `send` must be complete (or ordered before `comm`'s stream).
///
/// # Errors
/// A span too small ([`DdpError::bucket_layout`]); the reduction is not available for the
/// type, or NCCL refuses the call.
pub unsafe fn all_reduce_bucket(
    comm: &NcclComm,
    call: &BucketCall,
    [send, recv]: [DeviceSpan; 2],
) -> Result<[DeviceSpan; 2]> {
    let rank = comm.rank();
    for (span, which) in [(&send, "packed input"), (&recv, "output buffer")] {
        check_bucket_span(rank, &call.what(which), span.bytes, call.count, call.dtype)?;
    }
    let BucketCall {
        count, dtype, op, ..
    } = *call;
    // SAFETY: both spans address `count` elements of `dtype` (checked above) on this GPU,
    // distinct, `send` written (the caller's contract); both stay allocated until the caller
    // drops the spans, after NCCL's stream is known done with them.
    unsafe { comm.all_reduce_raw(send.ptr, recv.ptr, count, dtype, op) }?;
    Ok([send, recv])
}

/// The error of a device path that could not complete Burn's queued work (the gradients) before
/// a bucket's all-reduce.
pub fn queued_work_failed(rank: Rank, e: impl fmt::Debug) -> DdpError {
    DdpError::Cuda(CudaError::Driver {
        rank,
        what: "completing Burn's queued work before the bucket's all-reduce".into(),
        detail: format!("{e:?}"),
    })
}

/// The error of a device path that found no CUDA allocation behind the bucket's `what`.
pub fn no_device_resource(rank: Rank, what: &str, e: impl fmt::Debug) -> DdpError {
    DdpError::bucket_layout(
        rank,
        format!("cubecl has no CUDA resource for the {what}: {e:?}"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_span_keeps_what_it_was_given_until_dropped() {
        let alive = std::sync::Arc::new(());
        // SAFETY: no device memory is addressed; the span is never handed to NCCL.
        let span = unsafe { DeviceSpan::new(0x1000, 64, std::sync::Arc::clone(&alive)) };
        assert_eq!((span.ptr(), span.bytes()), (0x1000, 64));
        assert_eq!(std::sync::Arc::strong_count(&alive), 2);
        // Sent to another thread and dropped there, as the issuer does.
        std::thread::spawn(move || drop(span)).join().unwrap();
        assert_eq!(std::sync::Arc::strong_count(&alive), 1);
    }

    #[test]
    fn the_errors_say_which_bucket_buffer_and_why() {
        let call = BucketCall {
            bucket: 3,
            count: 8,
            dtype: DType::F32,
            op: ReduceOp::Sum,
        };
        assert_eq!(call.what("packed input"), "packed input of bucket 3");
        let e = no_device_resource(Rank(1), "packed input of bucket 3", "gone");
        let text = e.to_string();
        assert!(
            text.contains("packed input of bucket 3") && text.contains("gone"),
            "{text}"
        );
        let e = queued_work_failed(Rank(1), "CUDA_ERROR_LAUNCH_FAILED");
        assert!(e.to_string().contains("CUDA_ERROR_LAUNCH_FAILED"), "{e}");
    }
}
