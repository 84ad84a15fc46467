//! One gradient bucket on a device path, as both Burn lines hand it to NCCL: each buffer as a
//! [`DeviceSpan`] (its device pointer and size, and what keeps the allocation alive), checked
//! and reduced by [`reduce_bucket`] (all-reduced, or reduce-scattered under ZeRO stage 2), then
//! held by the issuer until NCCL's stream is done with it. A line only finds the pointer behind its release's tensor type.

use crate::error::CudaError;
use std::any::Any;
use std::fmt;

use super::nccl::{check_bucket_span, NcclComm};
use crate::comm::DRAIN_LIMIT;
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

/// One of a bucket's two buffers on a device path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BucketBuffer {
    /// The packed gradients and flags, which NCCL reads.
    Input,
    /// The fresh tensor NCCL writes.
    Output,
}

impl BucketBuffer {
    /// How errors name it.
    pub fn name(self) -> &'static str {
        match self {
            BucketBuffer::Input => "packed input",
            BucketBuffer::Output => "output buffer",
        }
    }
}

/// One bucket's reduction, as a device path's issuer thread receives it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BucketCall {
    /// The bucket's index in the plan.
    pub bucket: usize,
    /// Its elements (the packed input's).
    pub count: usize,
    /// Set when the bucket is reduce-scattered (a sharded plan, ZeRO stage 2): the elements of
    /// each rank's block, `count / world`, which is all this rank receives
    /// (`BucketPlan::block`). `None`: the bucket is all-reduced.
    pub block: Option<usize>,
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

    /// The elements of the bucket's `which` buffer.
    pub fn len(&self, which: BucketBuffer) -> usize {
        match which {
            BucketBuffer::Input => self.count,
            BucketBuffer::Output => self.block.unwrap_or(self.count),
        }
    }
}

/// Checks that `send` (the bucket's packed gradients, `call.count` elements of `call.dtype`)
/// and `recv` (its output: as many, or `call.block`) fit the call, and queues the bucket's
/// reduction on `comm`'s stream: an all-reduce, or, for a bucket of blocks (a sharded plan), a
/// reduce-scatter that leaves rank `r` the reduced block `r` (at world size 1 too, where that is
/// the whole bucket). Returns both spans: hold them
/// until a wait on `comm` has succeeded, or its abort has drained.
///
/// # Safety
/// `send` and `recv` must be on `comm`'s GPU and distinct allocations; the work that wrote
/// `send` must be complete (or ordered before `comm`'s stream).
///
/// # Errors
/// A span too small, or blocks that do not divide the bucket among the communicator's ranks
/// ([`DdpError::bucket_layout`]); the reduction is not available for the type, or NCCL refuses
/// the call.
pub unsafe fn reduce_bucket(
    comm: &NcclComm,
    call: &BucketCall,
    [send, recv]: [DeviceSpan; 2],
) -> Result<[DeviceSpan; 2]> {
    let rank = comm.rank();
    for (span, which) in [(&send, BucketBuffer::Input), (&recv, BucketBuffer::Output)] {
        let what = call.what(which.name());
        check_bucket_span(rank, &what, span.bytes, call.len(which), call.dtype)?;
    }
    let BucketCall {
        count,
        block,
        dtype,
        op,
        ..
    } = *call;
    let Some(block) = block else {
        // SAFETY: both spans address `count` elements of `dtype` (checked above) on this GPU,
        // distinct, `send` written (the caller's contract); both stay allocated until the
        // caller drops the spans, after NCCL's stream is known done with them.
        unsafe { comm.all_reduce_raw(send.ptr, recv.ptr, count, dtype, op) }?;
        return Ok([send, recv]);
    };
    check_blocks(rank, call, block, comm.world_size().as_usize())?;
    // SAFETY: as above, `send` holding `world` blocks of `block` elements (checked).
    unsafe { comm.reduce_scatter_raw(send.ptr, recv.ptr, block, dtype, op) }?;
    Ok([send, recv])
}

/// Checks that `send` holds `block` elements of `dtype` and `recv` `world` times as many,
/// all-gathers them on `comm`'s stream (every rank's block, in rank order) and waits for it,
/// with the collective deadline: the stepped parameters of one ZeRO run
/// ([`RunLayout`](crate::grad::RunLayout)) on a device path. `what` names the run in errors.
/// The spans go once NCCL's stream is done with them; after a failure, if it never goes idle,
/// they are leaked rather than handed back to the pool under a transfer.
///
/// # Safety
/// `send` and `recv` must be on `comm`'s GPU and distinct allocations; the work that wrote
/// `send` must be complete (or ordered before `comm`'s stream).
///
/// # Errors
/// A span too small ([`DdpError::bucket_layout`]); NCCL refuses the call; the wait's failures
/// (the deadline, a failure another rank published): the communicator is then aborted.
pub unsafe fn all_gather_blocks(
    comm: &NcclComm,
    what: &str,
    (block, dtype): (usize, DType),
    [send, recv]: [DeviceSpan; 2],
) -> Result<()> {
    let rank = comm.rank();
    let world = comm.world_size().as_usize();
    check_bucket_span(rank, &format!("block of {what}"), send.bytes, block, dtype)?;
    let all = block * world;
    check_bucket_span(rank, &format!("gathered {what}"), recv.bytes, all, dtype)?;
    // SAFETY: `send` addresses `block` and `recv` `world * block` elements of `dtype` (checked
    // above) on this GPU, distinct, `send` written (the caller's contract); both stay allocated
    // until NCCL's stream is known done with them (below).
    unsafe { comm.all_gather_raw(send.ptr, recv.ptr, block, dtype) }?;
    wait_or_leak(comm, what, [send, recv])
}

/// Waits for `comm`'s stream (with the collective deadline), then lets `spans` go; after a
/// failure whose abort never leaves the stream idle, they are leaked rather than handed back to
/// the pool under a transfer.
fn wait_or_leak(comm: &NcclComm, what: &str, spans: [DeviceSpan; 2]) -> Result<()> {
    let waited = comm.wait();
    if waited.is_err() && !comm.drain(DRAIN_LIMIT) {
        tracing::error!(
            "[rank {}] NCCL's stream did not go idle within {DRAIN_LIMIT:?} of its abort: \
             leaking the buffers of {what} rather than handing memory a transfer may still use \
             to other tensors",
            comm.rank()
        );
        std::mem::forget(spans);
    }
    waited
}

/// Checks that `send` holds `world` blocks of `block` elements of `dtype` and `recv` one,
/// reduce-scatters them on `comm`'s stream (rank `r` receives block `r` reduced by `op` over the
/// ranks) and waits for it, with the collective deadline: a sharded parameter's whole gradient
/// (FSDP's backward) on a device path. `what` names it in errors. The spans go as with
/// [`all_gather_blocks`].
///
/// # Safety
/// As [`all_gather_blocks`].
///
/// # Errors
/// A span too small ([`DdpError::bucket_layout`]); the reduction is not available for the type,
/// or NCCL refuses the call; the wait's failures: the communicator is then aborted.
pub unsafe fn reduce_scatter_blocks(
    comm: &NcclComm,
    what: &str,
    (block, dtype, op): (usize, DType, ReduceOp),
    [send, recv]: [DeviceSpan; 2],
) -> Result<()> {
    let rank = comm.rank();
    let world = comm.world_size().as_usize();
    let all = block * world;
    check_bucket_span(rank, &format!("whole {what}"), send.bytes, all, dtype)?;
    check_bucket_span(rank, &format!("shard of {what}"), recv.bytes, block, dtype)?;
    // SAFETY: `send` addresses `world * block` and `recv` `block` elements of `dtype` (checked
    // above) on this GPU, distinct, `send` written (the caller's contract); both stay allocated
    // until NCCL's stream is known done with them (below).
    unsafe { comm.reduce_scatter_raw(send.ptr, recv.ptr, block, dtype, op) }?;
    wait_or_leak(comm, what, [send, recv])
}

/// Checks that a reduce-scattered bucket is `world` blocks of `block` elements.
fn check_blocks(rank: Rank, call: &BucketCall, block: usize, world: usize) -> Result<()> {
    if block * world == call.count {
        return Ok(());
    }
    Err(DdpError::bucket_layout(
        rank,
        format!(
            "bucket {} has {} elements, not {world} blocks of {block}: the ranks' plans are \
             sharded over another number of ranks than the communicator's",
            call.bucket, call.count
        ),
    ))
}

/// The error of a device path that could not complete Burn's queued work (the gradients) before
/// a bucket's all-reduce.
pub fn queued_work_failed(rank: Rank, e: impl fmt::Debug) -> DdpError {
    DdpError::Cuda(CudaError::Driver {
        rank,
        what: "completing Burn's queued work before the bucket's reduction".into(),
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
    use crate::cuda::check_bucket_tensor;

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
            block: Some(4),
            dtype: DType::F32,
            op: ReduceOp::Sum,
        };
        assert_eq!(call.what("packed input"), "packed input of bucket 3");
        assert_eq!(call.len(BucketBuffer::Output), 4);
        // As both lines check a buffer before pinning it (`check_bucket_tensor`).
        let what = call.what(BucketBuffer::Output.name());
        let want = (call.len(BucketBuffer::Output), "F32");
        let e = check_bucket_tensor(Rank(1), &what, true, (8, "F32"), want).unwrap_err();
        assert!(e.to_string().contains("output buffer of bucket 3"), "{e}");
        assert!(check_blocks(Rank(1), &call, 4, 2).is_ok());
        let e = check_blocks(Rank(1), &call, 4, 4).unwrap_err().to_string();
        assert!(e.contains("not 4 blocks of 4"), "{e}");
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
