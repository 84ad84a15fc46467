//! NCCL for gradients of CUDA tensors (feature `cuda`): [`rank_device`], the Burn device of a
//! rank, everything of `burn_ddp_comm::cuda` re-exported, and the NCCL link of the device
//! transport of [`GradSync::sync`](crate::GradSync::sync) (`device.rs`: packing, flags and
//! unpacking; the same device, stream and lifetime rules as the Burn 0.21 line's overlapped
//! path).
//!
//! How a packed bucket reaches NCCL: the issuer thread, running as the stream of the thread
//! that packed it, takes the packed input and the fresh output out of Burn's `Dispatch`
//! (`Tensor::try_into_primitive::<Cube>`), resolves them (Burn's fusion tensors to cubecl's:
//! one drain of the fusion stream), waits for cubecl's stream (cubecl does not expose it, so an
//! event cannot order the two streams instead), and takes the device pointers from cubecl's
//! resources, checked against the bucket's element count and type. The all-reduce (under ZeRO
//! stage 2, the reduce-scatter that leaves this rank its block of the sharded bucket) is queued
//! on the communicator's stream *out of place*: NCCL reads the packed bucket and writes the
//! fresh output, never memory Burn may still read. Both buffers stay pinned until NCCL's stream has
//! been waited for (with the collective deadline).

use burn_ddp_comm::CudaError;
use std::sync::Arc;

use burn::backend::{BackendTypes, Cube, DispatchDevice};
use burn::tensor::{DType as BurnDType, Device, Tensor};
// The chosen release's burn-cubecl, burn-fusion and cubecl, which Burn does not re-export
// (`burn-ddp-cubecl` names them for whichever release this crate is built for).
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{CubeBackend, CubeDevice};
use burn_ddp_comm::grad::{BucketIssuer, DeviceCounters, DeviceCounts, DeviceWork, Queue};
use burn_ddp_comm::{DType, ProcessGroup, Rank, ReduceOp};
use burn_ddp_cubecl::{burn_cubecl, burn_fusion, cubecl, cubecl_runtime};
use cubecl::cuda::CudaRuntime;
use cubecl_runtime::runtime::Runtime;

pub use burn_ddp_comm::cuda::*;

use crate::device::{BucketJob, DeviceLink, LinkCore};
use crate::{DdpError, Result};

/// The Burn CUDA device of this rank: where to build its model and put its batches. One
/// visible GPU per process: that GPU; several: the one `LOCAL_RANK` names.
///
/// ```no_run
/// # fn main() -> burn_ddp::Result<()> {
/// let group = burn_ddp::ProcessGroup::from_env()?;
/// let device = burn_ddp::cuda::rank_device(&group)?; // Device::cuda(ordinal)
/// # Ok(()) }
/// ```
///
/// # Errors
/// No driver, or no GPU for this rank.
pub fn rank_device(pg: &ProcessGroup) -> Result<Device> {
    Ok(Device::cuda(rank_ordinal(pg)?))
}

/// The ordinal of the GPU `device` names, if it is a CUDA device (with or without autodiff).
pub(crate) fn cuda_ordinal(device: &Device) -> Option<usize> {
    match device.clone().inner().as_dispatch() {
        DispatchDevice::Cube(CubeDevice::Cuda(d)) => Some(d.index),
        _ => None,
    }
}

/// Burn's float tensor primitive of the `Cube` backend: a cubecl tensor, or a fusion handle to
/// one when Burn's `fusion` feature is on.
type Primitive = <Cube as BackendTypes>::FloatTensorPrimitive;

/// The cubecl tensor behind a `Cube` primitive (draining its fusion stream first, which
/// materialises it). Generic over the backend `B` that resolves fusion handles, so that both
/// impls compile whether or not Burn's `fusion` feature is on: it is always used with
/// [`CubeBackend`], which is a fusion backend exactly when `Cube`'s primitive is a fusion
/// handle.
trait Resolve<B> {
    /// Whether resolving drains Burn's fusion stream (counted as a fusion drain).
    const DRAINS: bool;
    /// The cubecl tensor; `Err`: what Burn said when running the fused work that makes it.
    fn resolve(self) -> std::result::Result<CubeTensor, String>;
}

impl<B> Resolve<B> for CubeTensor {
    const DRAINS: bool = false;
    fn resolve(self) -> std::result::Result<CubeTensor, String> {
        Ok(self)
    }
}

impl<R, B> Resolve<B> for burn_fusion::FusionTensor<R>
where
    R: burn_fusion::FusionRuntime,
    B: burn_fusion::FusionBackend<FusionRuntime = R, FloatTensorPrimitive = CubeTensor>,
{
    const DRAINS: bool = true;
    fn resolve(self) -> std::result::Result<CubeTensor, String> {
        let client = self.client.clone();
        crate::release::fusion_resolved(client.resolve_tensor_float::<B>(self))
    }
}

/// The cubecl tensor behind `t` (a tensor on a CUDA device).
fn cube_tensor(
    rank: Rank,
    t: Tensor<1>,
    what: &str,
    counters: &DeviceCounters,
) -> Result<CubeTensor> {
    let primitive: Primitive = t.try_into_primitive::<Cube>().map_err(|e| {
        DdpError::bucket_layout(rank, format!("the {what} is not a cubecl tensor: {e:?}"))
    })?;
    if <Primitive as Resolve<CubeBackend>>::DRAINS {
        counters.one(DeviceWork::FusionDrain);
    }
    <Primitive as Resolve<CubeBackend>>::resolve(primitive).map_err(|e| queued_work_failed(rank, e))
}

/// On the issuer thread, running as the packing thread's stream: completes the bucket's
/// input, pins both buffers and queues the reduction (all-reduce, or reduce-scatter for a
/// sharded bucket).
fn enqueue(comm: &NcclComm, job: BucketJob, counters: &DeviceCounters) -> Result<[DeviceSpan; 2]> {
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
    let output = cube_tensor(rank, job.output, &call.what("output buffer"), counters)?;
    let input = cube_tensor(rank, job.input, &call.what("packed input"), counters)?;
    // NCCL reads one contiguous span (cat and cast results are).
    let input = burn_cubecl::kernel::into_contiguous(input);
    // The gradients must exist before NCCL reads them (cubecl does not expose its CUDA stream,
    // so this sync stands in for an event between the two streams). Resolving drained Burn's
    // fusion queue up to both tensors; the sync is cubecl's own, not Fusion's.
    counters.one(DeviceWork::IssuerSync);
    <CubeBackend as burn::backend::Backend>::sync(&input.device)
        .map_err(|e| queued_work_failed(rank, e))?;
    // The allocation behind the bucket's `which` buffer (contiguous, on this GPU,
    // `call.len(which)` elements of `burn_dtype`), kept alive with its tensor.
    let span = |cube: CubeTensor, which: BucketBuffer| -> Result<DeviceSpan> {
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
    // `sync` above completed. Both spans are held until the step has waited for NCCL's stream.
    unsafe { reduce_bucket(comm, call, [send, recv]) }
}

/// The allocation behind `cube` (on this GPU), checked to be contiguous and to hold `want`
/// (elements, type), kept alive and unreused with its tensor while the span lives; `what` names
/// it in errors.
fn pin(rank: Rank, cube: CubeTensor, what: &str, want: (usize, BurnDType)) -> Result<DeviceSpan> {
    let found = (cube.meta.shape().num_elements(), cube.dtype);
    check_bucket_tensor(rank, what, cube.is_contiguous(), found, want)?;
    let resource = (cube.client)
        .get_resource::<<CudaRuntime as Runtime>::Server>(cube.handle.clone())
        .map_err(|e| no_device_resource(rank, what, e))?;
    let (ptr, bytes) = (resource.resource().ptr, resource.resource().size);
    // SAFETY: cubecl's resource guard keeps the allocation (`bytes` at `ptr`) from being freed
    // or reused while held, with the tensor; both may be dropped from any thread (the release
    // goes through cubecl's server).
    Ok(unsafe { DeviceSpan::new(ptr, bytes, (cube, resource)) })
}

/// The device path of one rank: the communicator and its issuer thread, on one GPU.
pub(crate) struct DevicePath {
    comm: Arc<NcclComm>,
    core: LinkCore<[DeviceSpan; 2]>,
}

impl std::fmt::Debug for DevicePath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DevicePath")
            .field("comm", &self.comm)
            .field("core", &self.core)
            .finish()
    }
}

impl DevicePath {
    /// The device path for a model on `device`, if gradient synchronisation over `pg` uses
    /// NCCL for it (see [`connect_where_placed`]); `None`: host-staged. Collective: every rank
    /// calls it in `prepare` (FSDP: in `shard`), and learns whether the others' models are on
    /// a GPU too.
    ///
    /// # Errors
    /// Some ranks' models are on a GPU and others' not; `transport` is `Nccl` for a model that
    /// is not on a CUDA device; what [`connect_for_grads`] fails with.
    pub(crate) fn connect(
        pg: &ProcessGroup,
        transport: burn_ddp_comm::config::GradTransport,
        device: Option<&Device>,
    ) -> Result<Option<Self>> {
        let rank = pg.rank();
        let ordinal = device.and_then(cuda_ordinal);
        let placed = device.map_or_else(|| "no parameters".to_owned(), |d| format!("{d:?}"));
        let Some(comm) = connect_where_placed(pg, transport, ordinal, &placed)? else {
            return Ok(None);
        };
        let ordinal = comm.device_ordinal();
        let comm = Arc::new(comm);
        let queue = Arc::clone(&comm);
        let counters = Arc::new(DeviceCounters::default());
        let counting = Arc::clone(&counters);
        let issuer = BucketIssuer::start(
            rank,
            Arc::clone(&comm) as Arc<dyn Queue>,
            move |job: BucketJob| {
                let stream = job.stream;
                stream.executes(|| enqueue(&queue, job, &counting))
            },
        )?;
        Ok(Some(Self {
            comm,
            core: LinkCore::new(issuer, Device::cuda(ordinal), counters),
        }))
    }

    /// Aborts the communicator (after a change of membership: its peers may be gone), without
    /// publishing an abort record (the job's belongs to the new membership); the issuer
    /// thread ends when the path is dropped.
    pub(crate) fn abort(&self) {
        self.comm.abort();
    }

    /// The GPU this path's communicator is on.
    pub(crate) fn ordinal(&self) -> Option<usize> {
        cuda_ordinal(&self.core.device)
    }

    /// What this path's passes cost so far.
    pub(crate) fn counts(&self) -> DeviceCounts {
        self.core.counters.read()
    }
}

impl DevicePath {
    /// A ZeRO run's all-gather on the device (`zero.rs`'s `BlockGather`): on
    /// the step's thread, after its optimizer step (no bucket is in flight then, so the
    /// communicator's calls keep one order on every rank). As [`blocks`](Self::blocks) with the
    /// streams.
    pub(crate) fn all_gather(
        &self,
        what: &str,
        send: Tensor<1>,
        block: usize,
    ) -> Result<Tensor<1>> {
        let all = block * self.comm.world_size().as_usize();
        let names = (format!("block of {what}"), format!("gathered {what}"));
        self.blocks(send, (block, all), names, |comm, spans| {
            // SAFETY: both on this GPU, distinct (`recv` is fresh), `send` written by work
            // `blocks` synchronised; the call holds both until NCCL's stream is done with them.
            unsafe { all_gather_blocks(comm, what, (block, DType::F32), spans) }
        })
    }

    /// A sharded parameter's whole gradient reduce-scattered on the device (FSDP's backward,
    /// `fsdp.rs`'s `ShardLink`): `send`, `world` blocks of `block` f32 elements, reduced by `op`
    /// over the ranks; this rank receives its block. On the thread of the backward that reached
    /// the parameter's gather (every rank's backward runs the same graph, so the calls keep
    /// one order); as [`blocks`](Self::blocks) with the streams.
    pub(crate) fn reduce_scatter(
        &self,
        what: &str,
        send: Tensor<1>,
        block: usize,
        op: ReduceOp,
    ) -> Result<Tensor<1>> {
        let all = block * self.comm.world_size().as_usize();
        let names = (format!("whole {what}"), format!("shard of {what}"));
        self.blocks(send, (all, block), names, |comm, spans| {
            // SAFETY: as in `all_gather`.
            unsafe { reduce_scatter_blocks(comm, what, (block, DType::F32, op), spans) }
        })
    }

    /// One collective of f32 blocks on the device: `send` (`lens.0` elements) made contiguous,
    /// a fresh output of `lens.1`, cubecl's stream synchronised (the input must exist before
    /// NCCL reads it), both pinned (named `names` in errors) and handed to `call`, which queues
    /// the collective and waits for NCCL's stream before the output is handed back.
    fn blocks(
        &self,
        send: Tensor<1>,
        (send_len, recv_len): (usize, usize),
        (send_what, recv_what): (String, String),
        call: impl FnOnce(&NcclComm, [DeviceSpan; 2]) -> Result<()>,
    ) -> Result<Tensor<1>> {
        let comm = &self.comm;
        let rank = comm.rank();
        let counters = &self.core.counters;
        let output = Tensor::<1>::empty([recv_len], (&send.device(), BurnDType::F32));
        let result = output.clone();
        let recv = cube_tensor(rank, output, &recv_what, counters)?;
        let send =
            burn_cubecl::kernel::into_contiguous(cube_tensor(rank, send, &send_what, counters)?);
        <CubeBackend as burn::backend::Backend>::sync(&send.device)
            .map_err(|e| queued_work_failed(rank, e))?;
        let spans = [
            pin(rank, send, &send_what, (send_len, BurnDType::F32))?,
            pin(rank, recv, &recv_what, (recv_len, BurnDType::F32))?,
        ];
        call(comm, spans)?;
        Ok(result)
    }
}

impl DeviceLink for DevicePath {
    type Pins = [DeviceSpan; 2];

    fn core(&self) -> &LinkCore<[DeviceSpan; 2]> {
        &self.core
    }

    fn check_device(&self, rank: Rank, name: &str, found: &Device) -> Result<()> {
        match cuda_ordinal(found) {
            Some(o) if Some(o) == cuda_ordinal(&self.core.device) => Ok(()),
            Some(o) => Err(DdpError::Cuda(CudaError::DeviceMismatch {
                rank,
                what: "the gradients",
                found: o,
                expected_why: format!(
                    "NCCL was set up on GPU {} (where the model was at `prepare`; \
                     `{name}`'s gradient is on {found:?})",
                    self.comm.device_ordinal()
                ),
            })),
            None => Err(DdpError::model_access(
                rank,
                "synchronising gradients",
                format!(
                    "the gradient of `{name}` is on {found:?}, not on a CUDA device, but the \
                     model was on GPU {} at `prepare`, where NCCL was set up; keep the model \
                     on that GPU for the whole training",
                    self.comm.device_ordinal()
                ),
            )),
        }
    }

    /// NCCL wrote the output in place.
    fn reduced(&self, _rank: Rank, _bucket: usize, output: Tensor<1>) -> Result<Tensor<1>> {
        Ok(output)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_cuda_devices_have_an_ordinal() {
        assert_eq!(cuda_ordinal(&Device::cuda(3)), Some(3));
        assert_eq!(cuda_ordinal(&Device::cuda(1).autodiff()), Some(1));
        assert_eq!(cuda_ordinal(&Device::flex()), None);
    }
}
