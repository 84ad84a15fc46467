//! The NCCL link of the zero-copy gradient path of `Autodiff<Ddp<Cuda>>` (`device.rs` packs,
//! flags and unpacks the buckets, generic over the link): buckets live on the GPU and NCCL reads
//! Burn's own device memory; no byte of a gradient crosses to the host.
//!
//! How a packed bucket reaches NCCL: backward hands it (still queued work) to the issuer
//! thread with its cubecl `StreamId` and goes on at once. The issuer, running as that stream,
//! resolves the bucket's tensors (Burn's fusion tensors to cubecl's: one drain of the fusion
//! stream), waits for cubecl's stream (cubecl does not expose it, so an event cannot order the
//! two streams instead; the wait blocks the issuer, not backward), and takes the device
//! pointers from cubecl's resources, checked against the bucket's element count and type. The
//! all-reduce (under ZeRO stage 2, the reduce-scatter that leaves this rank its block of the
//! sharded bucket) is queued on the communicator's stream *out of place*: NCCL reads the packed
//! bucket and writes a fresh output buffer of its own. NCCL never writes memory Burn may still
//! read: Burn's autodiff hands the same buffer to two parents (`add` with equal shapes), so a
//! single gradient's buffer can be an input of later backward kernels. Both buffers stay pinned
//! until the reduction is complete.
//!
//! The path takes Burn's `Cuda` with its default element types (`Cuda<f32, i32>`, what
//! `burn::backend::Cuda` means); other element types use the host-staged transport.

use std::any::Any;
use std::sync::Arc;

use burn::backend::Cuda;
use burn_backend::ops::FloatTensorOps;
use burn_backend::tensor::FloatTensor;
use burn_backend::{Backend, DType, FloatDType, Shape};
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeBackend;
use cubecl::cuda::{CudaDevice, CudaRuntime};

use super::device::{BucketJob, DeviceLink, LinkCore};
use crate::group::Rank;
use crate::Result;
use burn_ddp_comm::cuda::{
    all_gather_blocks, check_bucket_tensor, no_device_resource, queued_work_failed, reduce_bucket,
    reduce_scatter_blocks, BucketBuffer, BucketCall, DeviceSpan, NcclComm,
};
use burn_ddp_comm::grad::{BucketIssuer, DeviceCounters, DeviceCounts, DeviceWork, Queue};

type Cube = CubeBackend<CudaRuntime, f32, i32, u8>;
/// `Cuda` with its default element types (an alias in type position applies them).
pub(crate) type Gpu = Cuda;
/// A float tensor of [`Gpu`].
pub(crate) type CudaFloat = FloatTensor<Cuda>;
/// The device of [`Gpu`].
pub(crate) type GpuDevice = CudaDevice;
type Fused = burn_fusion::FusionTensor<burn_cubecl::fusion::FusionCubeRuntime<CudaRuntime>>;

/// Whether `B` is Burn's CUDA backend with its default element types (`Cuda<f32, i32>`, with or
/// without `fusion`), whose tensors this path takes. Other element types use the host path.
pub(crate) fn is_cuda<B: Backend>() -> bool {
    std::any::TypeId::of::<B>() == std::any::TypeId::of::<Cuda>()
}

/// Whether `B` is `Ddp<Cuda>` (the inner backend of `Autodiff<Ddp<Cuda>>`).
pub(crate) fn is_ddp_cuda<B: Backend>() -> bool {
    std::any::TypeId::of::<B>() == std::any::TypeId::of::<crate::Ddp<Cuda>>()
}

/// The GPU ordinal of a Burn device, if it is a CUDA device.
pub(crate) fn cuda_ordinal<D: 'static>(device: &D) -> Option<usize> {
    (device as &dyn Any)
        .downcast_ref::<cubecl::cuda::CudaDevice>()
        .map(|d| d.index)
}

/// `t` as a CUDA tensor, if `B` is [`Cuda`].
pub(crate) fn to_cuda<B: Backend>(
    t: FloatTensor<B>,
) -> std::result::Result<CudaFloat, FloatTensor<B>> {
    let boxed: Box<dyn Any> = Box::new(t);
    match boxed.downcast::<CudaFloat>() {
        Ok(t) => Ok(*t),
        Err(back) => Err(*back
            .downcast::<FloatTensor<B>>()
            .unwrap_or_else(|_| unreachable!("a box holds the type it was made from"))),
    }
}

/// The inverse of [`to_cuda`] (`None` if `B` is not [`Cuda`]).
pub(crate) fn from_cuda<B: Backend>(t: CudaFloat) -> Option<FloatTensor<B>> {
    let boxed: Box<dyn Any> = Box::new(t);
    boxed.downcast::<FloatTensor<B>>().ok().map(|t| *t)
}

/// The cubecl tensor behind a Burn CUDA tensor (resolving the fusion stream first, which
/// materialises the tensor).
trait Resolve {
    /// Whether resolving drains Burn's fusion stream (counted as a fusion drain).
    const DRAINS: bool;
    fn resolve(self) -> CubeTensor<CudaRuntime>;
}

impl Resolve for CubeTensor<CudaRuntime> {
    const DRAINS: bool = false;
    fn resolve(self) -> CubeTensor<CudaRuntime> {
        self
    }
}

impl Resolve for Fused {
    const DRAINS: bool = true;
    fn resolve(self) -> CubeTensor<CudaRuntime> {
        let client = self.client.clone();
        client.resolve_tensor_float::<Cube>(self)
    }
}

/// The device path's communication thread. Backward hands it each bucket as soon as the bucket
/// is packed (queued work, not yet done); the thread waits for Burn's stream there — it runs on
/// the producing thread's cubecl `StreamId`, so the sync covers exactly the stream that computes
/// the gradients, and it blocks this thread, not backward — then pins both buffers and queues the
/// reduction on NCCL's stream. One thread, buckets in launch order: every rank queues its
/// NCCL calls in the same order.
#[derive(Debug)]
pub(crate) struct NcclIssuer {
    comm: Arc<NcclComm>,
    core: LinkCore<Gpu, [DeviceSpan; 2]>,
}

impl NcclIssuer {
    pub(crate) fn start(comm: Arc<NcclComm>) -> Result<Self> {
        let rank = comm.rank();
        let queue: Arc<dyn Queue> = Arc::clone(&comm) as Arc<dyn Queue>;
        let counters = Arc::new(DeviceCounters::default());
        let counting = Arc::clone(&counters);
        let on = Arc::clone(&comm);
        let issuer = BucketIssuer::start(rank, queue, move |job: BucketJob<Gpu>| {
            let stream = job.stream;
            stream.executes(|| enqueue(&on, job, &counting))
        })?;
        Ok(Self {
            comm,
            core: LinkCore::new(issuer, counters),
        })
    }

    /// The GPU of the communicator, where buckets go before a gradient says otherwise.
    pub(crate) fn home(&self) -> CudaDevice {
        CudaDevice {
            index: self.comm.device_ordinal(),
        }
    }

    /// What this link's passes cost so far.
    pub(crate) fn counts(&self) -> DeviceCounts {
        self.core.counters.read()
    }
}

impl DeviceLink<Gpu> for NcclIssuer {
    type Pins = [DeviceSpan; 2];

    fn core(&self) -> &LinkCore<Gpu, [DeviceSpan; 2]> {
        &self.core
    }

    /// NCCL wrote the output in place.
    fn reduced(&self, _rank: Rank, _bucket: usize, output: CudaFloat) -> Result<CudaFloat> {
        Ok(output)
    }
}

/// On the issuer thread, on Burn's stream: completes the bucket's inputs, pins them and
/// queues the reduction (all-reduce, or reduce-scatter for a sharded bucket).
fn enqueue(
    comm: &NcclComm,
    job: BucketJob<Gpu>,
    counters: &DeviceCounters,
) -> Result<[DeviceSpan; 2]> {
    let rank = comm.rank();
    let call = &BucketCall {
        bucket: job.bucket,
        count: job.count,
        block: job.block,
        dtype: job.dtype.0,
        op: job.op,
    };
    let burn_dtype = job.dtype.1;
    // The output first: it was made after the input, so resolving it runs everything queued up
    // to both, and the input's resolution finds nothing left to run.
    if <CudaFloat as Resolve>::DRAINS {
        counters.add(DeviceWork::FusionDrain, 2);
    }
    let output = job.output.resolve();
    // NCCL reads one contiguous span (cat and cast results are).
    let input = burn_cubecl::kernel::into_contiguous(job.input.resolve());
    // The gradients must exist before NCCL reads them (cubecl does not expose its CUDA stream,
    // so this sync stands in for an event between the two streams). Resolving drained Burn's
    // fusion queue up to both tensors; the sync is cubecl's own, not Fusion's, which would hold
    // the fusion server (and so backward) for as long as the GPU takes.
    counters.one(DeviceWork::IssuerSync);
    <Cube as Backend>::sync(&job.device).map_err(|e| queued_work_failed(rank, e))?;
    // The allocation behind the bucket's `which` buffer (contiguous, on this GPU,
    // `call.len(which)` elements of `burn_dtype`), kept alive with its tensor.
    let span = |cube: CubeTensor<CudaRuntime>, which: BucketBuffer| -> Result<DeviceSpan> {
        pin(
            rank,
            cube,
            &call.what(which.name()),
            (call.len(which), burn_dtype),
        )
    };
    let send = span(input, BucketBuffer::Input)?;
    let recv = span(output, BucketBuffer::Output)?;
    // SAFETY: both on this GPU, distinct (`recv` is fresh); the input was written by work that
    // `sync` above completed. The issuer holds both spans until NCCL's stream is known done
    // with them: a successful wait, or a drained abort (`InFlight::finish`/`abandon`).
    unsafe { reduce_bucket(comm, call, [send, recv]) }
}

/// The allocation behind `cube` (on this GPU), checked to be contiguous and to hold `want`
/// (elements, type), kept alive and unreused with its tensor while the span lives; `what` names
/// it in errors.
fn pin(
    rank: Rank,
    cube: CubeTensor<CudaRuntime>,
    what: &str,
    want: (usize, DType),
) -> Result<DeviceSpan> {
    let found = (cube.meta.shape().num_elements(), cube.dtype);
    check_bucket_tensor(rank, what, cube.is_contiguous(), found, want)?;
    let resource = cube.client.get_resource(cube.handle.clone());
    let resource = resource.map_err(|e| no_device_resource(rank, what, e))?;
    let (ptr, bytes) = (resource.resource().ptr, resource.resource().size);
    // SAFETY: cubecl's resource guard keeps the allocation (`bytes` at `ptr`) from being freed
    // or reused while held, with the tensor; both may be dropped from any thread (the release
    // goes through cubecl's server).
    Ok(unsafe { DeviceSpan::new(ptr, bytes, (cube, resource)) })
}

/// A ZeRO run's all-gather on the GPU (`ZeroOptimizer`'s, `zero.rs`), and FSDP's gather of a
/// sharded parameter (`fsdp.rs`): every rank's `send` (`block` f32 elements), concatenated in
/// rank order into a fresh tensor. On the step's (or the forward's) thread, where no bucket is
/// in flight on the communicator, so its calls keep one order on every rank; as [`blocks`] with
/// the streams.
///
/// # Errors
/// The block is not `block` f32 elements; the collective's failures.
pub(crate) fn all_gather_run(
    comm: &NcclComm,
    what: &str,
    send: CudaFloat,
    block: usize,
) -> Result<CudaFloat> {
    let all = block * comm.world_size().as_usize();
    let names = (format!("block of {what}"), format!("gathered {what}"));
    blocks(comm, send, (block, all), names, |spans| {
        // SAFETY: both on this GPU, distinct (`recv` is fresh), `send` written by work `blocks`
        // synchronised; the call holds both until NCCL's stream is done with them.
        unsafe { all_gather_blocks(comm, what, (block, burn_ddp_comm::DType::F32), spans) }
    })
}

/// A sharded parameter's whole gradient reduce-scattered on the GPU (FSDP's backward,
/// `fsdp.rs`): `send`, `world` blocks of `block` f32 elements, reduced by `op` over the ranks;
/// this rank receives its block. On the thread of the backward that reached the parameter's
/// gather (every rank's backward runs the same graph, so the calls keep one order).
///
/// # Errors
/// `send` is not `world` blocks of `block` f32 elements; the collective's failures.
pub(crate) fn reduce_scatter_run(
    comm: &NcclComm,
    what: &str,
    send: CudaFloat,
    block: usize,
    op: burn_ddp_comm::ReduceOp,
) -> Result<CudaFloat> {
    let all = block * comm.world_size().as_usize();
    let names = (format!("whole {what}"), format!("shard of {what}"));
    blocks(comm, send, (all, block), names, |spans| {
        // SAFETY: as in `all_gather_run`.
        unsafe { reduce_scatter_blocks(comm, what, (block, burn_ddp_comm::DType::F32, op), spans) }
    })
}

/// One collective of f32 blocks on the GPU: `send` (`lens.0` elements) made contiguous, a
/// fresh output of `lens.1`, cubecl's stream synchronised (the input must exist before NCCL
/// reads it), both pinned (named `names` in errors) and handed to `call`, which queues the
/// collective and waits for NCCL's stream before the output is handed back.
fn blocks(
    comm: &NcclComm,
    send: CudaFloat,
    (send_len, recv_len): (usize, usize),
    (send_what, recv_what): (String, String),
    call: impl FnOnce([DeviceSpan; 2]) -> Result<()>,
) -> Result<CudaFloat> {
    let rank = comm.rank();
    let device = <Gpu as FloatTensorOps<Gpu>>::float_device(&send);
    let output =
        <Gpu as FloatTensorOps<Gpu>>::float_empty(Shape::new([recv_len]), &device, FloatDType::F32);
    let result = output.clone();
    let recv = output.resolve();
    let send = burn_cubecl::kernel::into_contiguous(send.resolve());
    <Cube as Backend>::sync(&device).map_err(|e| queued_work_failed(rank, e))?;
    let spans = [
        pin(rank, send, &send_what, (send_len, DType::F32))?,
        pin(rank, recv, &recv_what, (recv_len, DType::F32))?,
    ];
    call(spans)?;
    Ok(result)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cuda_devices_give_their_ordinal_and_others_none() {
        assert_eq!(
            cuda_ordinal(&cubecl::cuda::CudaDevice { index: 3 }),
            Some(3)
        );
        assert_eq!(
            cuda_ordinal(&burn::backend::ndarray::NdArrayDevice::Cpu),
            None
        );
        assert!(is_ddp_cuda::<crate::Ddp<Cuda>>());
        assert!(!is_ddp_cuda::<Cuda>());
    }

    #[test]
    fn only_burns_cuda_backend_takes_the_device_path() {
        assert!(is_cuda::<Cuda>());
        assert!(!is_cuda::<crate::Ddp<Cuda>>());
        assert!(
            !is_cuda::<Cube>() || std::any::TypeId::of::<Cube>() == std::any::TypeId::of::<Cuda>()
        );
    }
}
