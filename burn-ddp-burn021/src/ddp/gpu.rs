//! The zero-copy gradient path of `Autodiff<Ddp<Cuda>>`: buckets live on the GPU and NCCL reads
//! Burn's own device memory; no byte of a gradient crosses to the host.
//!
//! Per bucket, when its last gradient is final (in bucket order, as on the host path):
//! 1. its gradients are packed into one contiguous device tensor by Burn itself (`cat` of the
//!    flattened gradients, zeros for parameters without a gradient on this rank, then one
//!    presence flag per parameter; a cast for compression): one device-to-device copy, as
//!    PyTorch DDP's bucket copy;
//! 2. backward hands both tensors (still queued work) to the launcher thread with its cubecl
//!    `StreamId` and goes on at once. The launcher, running as that stream, resolves them (Burn's
//!    fusion tensors to cubecl's), waits for cubecl's stream (cubecl does not expose it, so an
//!    event cannot order the two streams instead; the wait blocks the launcher, not backward),
//!    and takes the device pointers from cubecl's resources, checked against the bucket's element
//!    count and type;
//! 3. the all-reduce is queued on the communicator's stream *out of place*: NCCL reads the packed
//!    bucket and writes a fresh output buffer of its own. NCCL never writes memory Burn may
//!    still read: Burn's autodiff hands the same buffer to two parents (`add` with equal
//!    shapes), so a single gradient's buffer can be an input of later backward kernels. Both
//!    buffers stay pinned until the reduction is complete.
//!
//! Backward continues while NCCL runs. At the end of backward every queued reduction is waited
//! for (with the collective deadline), then each gradient is replaced by its slice of the
//! reduced output (a view), so the optimizer only ever sees averaged values. Parameters without
//! a gradient here whose reduced flag is not zero (other ranks used them) keep their slice for
//! `DdpSession::complete`; the flags are the only bytes read to the host.
//!
//! The path takes Burn's `Cuda` with its default element types (`Cuda<f32, i32>`, what
//! `burn::backend::Cuda` means); other element types use the host-staged transport.

use burn_ddp_comm::ModelError;
use std::any::Any;
use std::sync::Arc;
use std::time::Duration;

use burn::backend::Cuda;
use burn_backend::ops::FloatTensorOps;
use burn_backend::tensor::FloatTensor;
use burn_backend::{Backend, DType as BurnDType, Shape, TensorMetadata};
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeBackend;
use cubecl::cuda::{CudaDevice, CudaRuntime};
use cubecl::stream_id::StreamId;

use crate::comm::{DType, ReduceOp};
use crate::ddp::values::read_f32;
use crate::group::Rank;
use crate::{DdpError, Result};
use burn_ddp_comm::cuda::{
    all_reduce_bucket, no_device_resource, queued_work_failed, BucketCall, DeviceSpan, NcclComm,
};
use burn_ddp_comm::grad::{BucketLauncher, BucketTransport, InFlight, Queue};

type Cube = CubeBackend<CudaRuntime, f32, i32, u8>;
/// `Cuda` with its default element types (an alias in type position applies them).
type Gpu = Cuda;
type CudaFloat = FloatTensor<Cuda>;
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
    fn resolve(self) -> CubeTensor<CudaRuntime>;
}

impl Resolve for CubeTensor<CudaRuntime> {
    fn resolve(self) -> CubeTensor<CudaRuntime> {
        self
    }
}

impl Resolve for Fused {
    fn resolve(self) -> CubeTensor<CudaRuntime> {
        let client = self.client.clone();
        client.resolve_tensor_float::<Cube>(self)
    }
}

/// The bucket element type for a compression setting.
pub(crate) fn bucket_dtype(c: crate::Compression) -> (DType, BurnDType) {
    match c {
        crate::Compression::None => (DType::F32, BurnDType::F32),
        crate::Compression::F16 => (DType::F16, BurnDType::F16),
        crate::Compression::Bf16 => (DType::BF16, BurnDType::BF16),
    }
}

/// What a finished device pass gives back: each local gradient's reduced value by slot, and the
/// slots without a local gradient that some other rank had one for, with their average
/// (flattened, f32).
pub(crate) type DeviceResults = (Vec<(usize, CudaFloat)>, Vec<(usize, CudaFloat)>);

/// One bucket for the launcher thread: its packed input and fresh output (both still queued work
/// on Burn's stream `stream`), and how to reduce it.
struct DeviceBucketJob {
    call: BucketCall,
    input: CudaFloat,
    output: CudaFloat,
    /// The bucket's element type for Burn (`call.dtype` is NCCL's).
    burn_dtype: BurnDType,
    stream: StreamId,
    device: CudaDevice,
}

/// The device path's communication thread. Backward hands it each bucket as soon as the bucket
/// is packed (queued work, not yet done); the thread waits for Burn's stream there — it runs on
/// the producing thread's cubecl `StreamId`, so the sync covers exactly the stream that computes
/// the gradients, and it blocks this thread, not backward — then pins both buffers and queues the
/// all-reduce on NCCL's stream. One thread, buckets in launch order: every rank queues its
/// NCCL calls in the same order.
#[derive(Debug)]
pub(crate) struct NcclLauncher(BucketLauncher<DeviceBucketJob, [DeviceSpan; 2]>);

impl NcclLauncher {
    pub(crate) fn start(comm: Arc<NcclComm>) -> Result<Self> {
        let rank = comm.rank();
        let queue: Arc<dyn Queue> = Arc::clone(&comm) as Arc<dyn Queue>;
        BucketLauncher::start(rank, queue, move |job: DeviceBucketJob| {
            let stream = job.stream;
            stream.executes(|| enqueue(&comm, job))
        })
        .map(Self)
    }
}

/// On the launcher thread, on Burn's stream: completes the bucket's inputs, pins them and
/// queues the all-reduce.
fn enqueue(comm: &NcclComm, job: DeviceBucketJob) -> Result<[DeviceSpan; 2]> {
    let rank = comm.rank();
    // NCCL reads one contiguous span: a lone gradient that is a strided or expanded view is
    // copied (a fresh tensor, cat and cast results are contiguous already).
    let input = burn_cubecl::kernel::into_contiguous(job.input.resolve());
    let output = job.output.resolve();
    // The gradients must exist before NCCL reads them (cubecl does not expose its CUDA stream,
    // so this sync stands in for an event between the two streams). Resolving drained Burn's
    // fusion queue up to both tensors; the sync is cubecl's own, not Fusion's, which would hold
    // the fusion server (and so backward) for as long as the GPU takes.
    <Cube as Backend>::sync(&job.device).map_err(|e| queued_work_failed(rank, e))?;
    let call = &job.call;
    // The allocation behind the bucket's `which` buffer (contiguous, on this GPU,
    // `call.count` elements of `burn_dtype`), kept alive with its tensor.
    let span = |cube: CubeTensor<CudaRuntime>, which: &str| -> Result<DeviceSpan> {
        let found = (cube.meta.shape().num_elements(), cube.dtype);
        call.check_tensor(rank, which, cube.is_contiguous(), found, job.burn_dtype)?;
        let resource = cube.client.get_resource(cube.handle.clone());
        let resource = resource.map_err(|e| no_device_resource(rank, &call.what(which), e))?;
        let (ptr, bytes) = (resource.resource().ptr, resource.resource().size);
        // SAFETY: cubecl's resource guard keeps the allocation (`bytes` at `ptr`) from being
        // freed or reused while held, with the tensor; both may be dropped from any thread
        // (the release goes through cubecl's server).
        Ok(unsafe { DeviceSpan::new(ptr, bytes, (cube, resource)) })
    };
    let send = span(input, "packed input")?;
    let recv = span(output, "output buffer")?;
    // SAFETY: both on this GPU, distinct (`recv` is fresh); the input was written by work that
    // `sync` above completed. The launcher holds both spans until NCCL's stream is known done
    // with them: a successful wait, or a drained abort (`InFlight::finish`/`abandon`).
    unsafe { all_reduce_bucket(comm, call, [send, recv]) }
}

/// The device state of one backward pass.
pub(crate) struct DeviceStep {
    /// Each slot's flattened gradient, until its bucket is packed.
    grads: Vec<Option<CudaFloat>>,
    /// Each slot's original shape and dtype (to write the result back).
    shapes: Vec<Option<(Shape, BurnDType)>>,
    /// Each launched bucket's output (what its gradients become).
    outputs: Vec<Option<CudaFloat>>,
    /// Buckets handed to the launcher (which holds the buffers NCCL works on until its stream
    /// is known done with them).
    in_flight: InFlight<[DeviceSpan; 2]>,
    device: Option<CudaDevice>,
}

impl std::fmt::Debug for DeviceStep {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceStep")
            .field("grads", &self.grads.iter().filter(|g| g.is_some()).count())
            .field("in_flight", &self.in_flight)
            .finish()
    }
}

impl DeviceStep {
    pub(crate) fn new(slots: usize, buckets: usize) -> Self {
        Self {
            grads: (0..slots).map(|_| None).collect(),
            shapes: vec![None; slots],
            outputs: (0..buckets).map(|_| None).collect(),
            in_flight: InFlight::new(),
            device: None,
        }
    }

    /// Keeps slot `slot`'s final gradient (flattened) for its bucket, after checking it has
    /// `numel` elements of a float type (as the host path does).
    ///
    /// # Errors
    /// `GradientSize` or `Model` (a gradient that is not of floats), naming the parameter.
    fn keep_grad(
        &mut self,
        rank: Rank,
        slot: usize,
        grad: CudaFloat,
        param: &crate::ParamInfo,
    ) -> Result<()> {
        let numel = param.numel;
        let shape = grad.shape();
        let dtype = grad.dtype();
        if shape.num_elements() != numel {
            return Err(DdpError::Model(ModelError::GradientSize {
                rank,
                param: param.name.clone(),
                expected: numel,
                got: shape.num_elements(),
            }));
        }
        if !matches!(
            dtype,
            BurnDType::F32 | BurnDType::F16 | BurnDType::BF16 | BurnDType::F64
        ) {
            return Err(DdpError::model_access(
                rank,
                "reading a gradient",
                format!(
                    "the gradient of `{}` holds {dtype:?}, not floats",
                    param.name
                ),
            ));
        }
        self.device.get_or_insert_with(|| Gpu::float_device(&grad));
        let flat = Gpu::float_reshape(grad, Shape::new([numel]));
        let flat = if dtype == BurnDType::F32 {
            flat
        } else {
            Gpu::float_cast(flat, burn_backend::FloatDType::F32)
        };
        self.grads[slot] = Some(flat);
        self.shapes[slot] = Some((shape, dtype));
        Ok(())
    }

    /// Packs bucket `bucket` (its slots in offset order, with their lengths) into a fresh
    /// tensor, with a fresh output beside it (both queued work on Burn's stream: nothing waits
    /// here), and hands both to the launcher, which queues the all-reduce once they exist.
    fn queue(
        &mut self,
        launcher: &NcclLauncher,
        ordinal: usize,
        bucket: usize,
        slots: &[(usize, usize)],
        op: ReduceOp,
        compression: crate::Compression,
    ) -> Result<()> {
        // No gradient at all on this rank yet: the bucket is zeros on the communicator's GPU.
        let device = self.device.clone().unwrap_or(CudaDevice { index: ordinal });
        // Values, then one presence flag per parameter (1 where this rank has its gradient),
        // reduced with them: every rank learns which parameters some rank had a gradient for.
        let mut flags = vec![0.0f32; slots.len()];
        let mut parts: Vec<CudaFloat> = slots
            .iter()
            .enumerate()
            .map(|(position, &(slot, numel))| match self.grads[slot].take() {
                Some(g) => {
                    flags[position] = 1.0;
                    g
                }
                None => {
                    Gpu::float_zeros(Shape::new([numel]), &device, burn_backend::FloatDType::F32)
                }
            })
            .collect();
        let count = slots.iter().map(|s| s.1).sum::<usize>() + slots.len();
        // The flags: a fill on the device when they are all alike (no upload from the host).
        let n = flags.len();
        let f32 = burn_backend::FloatDType::F32;
        parts.push(match flags.iter().filter(|&&f| f != 0.0).count() {
            0 => Gpu::float_zeros(Shape::new([n]), &device, f32),
            k if k == n => Gpu::float_ones(Shape::new([n]), &device, f32),
            _ => Gpu::float_from_data(burn_backend::TensorData::new(flags, [n]), &device),
        });
        let packed = Gpu::float_cat(parts, 0);
        let (dtype, burn_dtype) = bucket_dtype(compression);
        let input = if burn_dtype == BurnDType::F32 {
            packed
        } else {
            Gpu::float_cast(packed, float_dtype(burn_dtype))
        };
        let output = Gpu::float_empty(Shape::new([count]), &device, float_dtype(burn_dtype));
        self.in_flight.send(
            &launcher.0,
            DeviceBucketJob {
                call: BucketCall {
                    bucket,
                    count,
                    dtype,
                    op,
                },
                input,
                output: output.clone(),
                burn_dtype,
                stream: StreamId::current(),
                device,
            },
        )?;
        self.outputs[bucket] = Some(output);
        Ok(())
    }

    /// After the communicator was aborted by its owner (a membership change: nobody to tell),
    /// takes every answer and drains NCCL's stream (bounded) before any buffer the pass pinned
    /// goes (`InFlight::settle_stopped`).
    pub(crate) fn settle_aborted(&mut self, launcher: &NcclLauncher, wait: Duration) {
        self.in_flight.settle_stopped(&launcher.0, wait);
    }

    /// Waits for every queued reduction and returns, per slot with a local gradient, the
    /// reduced values (a view of the bucket's output, shaped and typed as the gradient was),
    /// and the slots without a local gradient whose average is not zero (other ranks used those
    /// parameters; the caller reports them, as the host path does). `slots`: (slot, bucket,
    /// offset, length, presence flag). On a failure the pass is abandoned first
    /// (`InFlight::finish`).
    fn collect(
        &mut self,
        comm: &NcclComm,
        launcher: &NcclLauncher,
        wait: Duration,
        slots: impl Iterator<Item = (usize, usize, usize, usize, usize)>,
    ) -> Result<DeviceResults> {
        self.in_flight.finish(&launcher.0, wait)?;
        let mut out = Vec::new();
        let mut absent = Vec::new();
        for (slot, bucket, offset, numel, flag) in slots {
            let Some(output) = &self.outputs[bucket] else {
                continue;
            };
            let part = Gpu::float_slice(
                output.clone(),
                &[burn_backend::Slice::from(offset..offset + numel)],
            );
            match self.shapes[slot].clone() {
                Some((shape, dtype)) => {
                    let part = if part.dtype() == dtype {
                        part
                    } else {
                        Gpu::float_cast(part, float_dtype(dtype))
                    };
                    out.push((slot, Gpu::float_reshape(part, shape)));
                }
                None => {
                    let f = Gpu::float_slice(
                        output.clone(),
                        &[burn_backend::Slice::from(flag..flag + 1)],
                    );
                    absent.push((slot, part, f));
                }
            }
        }
        self.outputs.iter_mut().for_each(|o| *o = None);
        if absent.is_empty() {
            return Ok((out, Vec::new()));
        }
        // No gradient here: the reduced presence flags (one read for all of them) tell which
        // parameters some other rank had a gradient for.
        let flags: Vec<CudaFloat> = absent.iter().map(|(_, _, f)| f.clone()).collect();
        let flags = read_f32::<Gpu>(Gpu::float_cat(flags, 0)).map_err(|reason| {
            DdpError::model_access(
                comm.rank(),
                "reading the reduced buckets' presence flags",
                reason,
            )
        })?;
        let foreign = absent
            .into_iter()
            .zip(flags)
            .filter(|(_, f)| *f != 0.0)
            .map(|((slot, part, _), _)| {
                let part = if part.dtype() == BurnDType::F32 {
                    part
                } else {
                    Gpu::float_cast(part, burn_backend::FloatDType::F32)
                };
                (slot, part)
            })
            .collect();
        Ok((out, foreign))
    }
}

/// What the device transport needs from the reducer: the communicator, its launcher thread,
/// and how buckets are reduced.
pub(crate) struct NcclLink<'a> {
    pub(crate) comm: &'a NcclComm,
    pub(crate) launcher: &'a NcclLauncher,
    pub(crate) op: ReduceOp,
    pub(crate) compression: crate::Compression,
    /// How long to wait for the launcher's answers and NCCL's stream.
    pub(crate) wait: Duration,
}

use super::reducer::Plan;

impl BucketTransport<burn_backend::distributed::DistributedParamId> for DeviceStep {
    type Grad<'g> = CudaFloat;
    type Link<'l> = NcclLink<'l>;
    type Output = DeviceResults;

    fn keep(
        &mut self,
        link: &mut NcclLink<'_>,
        plan: &Plan,
        slot: usize,
        grad: CudaFloat,
    ) -> Result<()> {
        self.keep_grad(link.comm.rank(), slot, grad, &plan.slots[slot].info)
    }

    fn send(&mut self, link: &mut NcclLink<'_>, plan: &Plan, bucket: usize) -> Result<()> {
        let slots: Vec<(usize, usize)> = plan.buckets[bucket]
            .0
            .iter()
            .map(|&i| (i, plan.slots[i].info.numel))
            .collect();
        let ordinal = link.comm.device_ordinal();
        self.queue(
            link.launcher,
            ordinal,
            bucket,
            &slots,
            link.op,
            link.compression,
        )
    }

    fn finish(
        &mut self,
        link: &mut NcclLink<'_>,
        plan: &Plan,
        _local: &[bool],
    ) -> Result<DeviceResults> {
        let slots = plan
            .slots
            .iter()
            .enumerate()
            .map(|(i, s)| (i, s.bucket, s.offset, s.info.numel, plan.flag_index(i)));
        self.collect(link.comm, link.launcher, link.wait, slots)
    }

    fn abandon(&mut self, link: &mut NcclLink<'_>, e: DdpError) -> DdpError {
        self.in_flight.abandon(&link.launcher.0, e, link.wait)
    }
}

fn float_dtype(d: BurnDType) -> burn_backend::FloatDType {
    match d {
        BurnDType::F64 => burn_backend::FloatDType::F64,
        BurnDType::F16 => burn_backend::FloatDType::F16,
        BurnDType::BF16 => burn_backend::FloatDType::BF16,
        _ => burn_backend::FloatDType::F32,
    }
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
    fn compression_picks_the_bucket_type() {
        assert_eq!(
            bucket_dtype(crate::Compression::None),
            (DType::F32, BurnDType::F32)
        );
        assert_eq!(
            bucket_dtype(crate::Compression::Bf16),
            (DType::BF16, BurnDType::BF16)
        );
        assert_eq!(float_dtype(BurnDType::F16), burn_backend::FloatDType::F16);
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
