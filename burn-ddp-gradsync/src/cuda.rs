//! NCCL for gradients of CUDA tensors (feature `cuda`): [`rank_device`], the Burn device of a
//! rank, everything of `burn_ddp_comm::cuda` re-exported, and the device path of
//! [`GradSync::sync`](crate::GradSync::sync).
//!
//! The device path, per step, after backward (the same device, stream and lifetime rules as
//! the Burn 0.21 line's overlapped path):
//! 1. each trainable parameter's gradient is flattened where it is; every bucket is packed into
//!    one contiguous device tensor by Burn itself (`cat` of the flattened gradients, zeros for
//!    parameters without a gradient on this rank, then one presence flag per parameter; a cast
//!    for compression): one device-to-device copy, as PyTorch DDP's bucket copy;
//! 2. as soon as a bucket is packed (still queued work), it goes with a fresh output buffer to
//!    the launcher thread, with the cubecl `StreamId` of the thread that packed it, and packing
//!    goes on with the next bucket. The launcher, running as that stream, takes both tensors
//!    out of Burn's `Dispatch` (`Tensor::try_into_primitive::<Cube>`), resolves them (Burn's
//!    fusion tensors to cubecl's), waits for cubecl's stream (cubecl does not expose it, so an
//!    event cannot order the two streams instead), and takes the device pointers from cubecl's
//!    resources, checked against the bucket's element count and type;
//! 3. the all-reduce is queued on the communicator's stream *out of place*: NCCL reads the
//!    packed bucket and writes the fresh output, never memory Burn may still read. Both buffers
//!    stay pinned until NCCL's stream has been waited for (with the collective deadline).
//!
//! Then each parameter that some rank had a gradient for (its reduced flag is not zero) gets its
//! slice of the reduced output (a view, cast back to its gradient's dtype). Only the flags of
//! parameters without a gradient on this rank are read to the host (a parameter with one here is
//! present on every rank): none in a step where every parameter had a gradient.

use burn_ddp_comm::{ConfigError, CudaError};
use std::sync::Arc;
use std::time::Duration;

use burn::backend::{BackendTypes, Cube, DispatchDevice, StreamId};
use burn::module::Module;
use burn::optim::GradientsParams;
use burn::tensor::{DType as BurnDType, Device, Tensor};
// The chosen release's burn-cubecl, burn-fusion and cubecl, which Burn does not re-export
// (`burn-ddp-cubecl` names them for whichever release this crate is built for).
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{CubeBackend, CubeDevice};
use burn_ddp_comm::comm::DType;
use burn_ddp_comm::grad::{
    BucketLauncher, BucketPlan, BucketTransport, InFlight, Pass, Queue, ANSWER_SLACK,
};
use burn_ddp_comm::{Compression, GradReduction, ProcessGroup, Rank, ReduceOp};
use burn_ddp_cubecl::{burn_cubecl, burn_fusion, cubecl, cubecl_runtime};
use cubecl::cuda::CudaRuntime;
use cubecl_runtime::runtime::Runtime;

pub use burn_ddp_comm::cuda::*;

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
    /// The cubecl tensor; `Err`: what Burn said when running the fused work that makes it.
    fn resolve(self) -> std::result::Result<CubeTensor, String>;
}

impl<B> Resolve<B> for CubeTensor {
    fn resolve(self) -> std::result::Result<CubeTensor, String> {
        Ok(self)
    }
}

impl<R, B> Resolve<B> for burn_fusion::FusionTensor<R>
where
    R: burn_fusion::FusionRuntime,
    B: burn_fusion::FusionBackend<FusionRuntime = R, FloatTensorPrimitive = CubeTensor>,
{
    fn resolve(self) -> std::result::Result<CubeTensor, String> {
        let client = self.client.clone();
        crate::release::fusion_resolved(client.resolve_tensor_float::<B>(self))
    }
}

/// The cubecl tensor behind `t` (a tensor on a CUDA device).
fn cube_tensor(rank: Rank, t: Tensor<1>, what: &str) -> Result<CubeTensor> {
    let primitive: Primitive = t.try_into_primitive::<Cube>().map_err(|e| {
        DdpError::bucket_layout(rank, format!("the {what} is not a cubecl tensor: {e:?}"))
    })?;
    <Primitive as Resolve<CubeBackend>>::resolve(primitive).map_err(|e| queued_work_failed(rank, e))
}

/// The bucket element type for a compression setting: NCCL's, and Burn's.
fn bucket_dtype(c: Compression) -> (DType, BurnDType) {
    match c {
        Compression::None => (DType::F32, BurnDType::F32),
        Compression::F16 => (DType::F16, BurnDType::F16),
        Compression::Bf16 => (DType::BF16, BurnDType::BF16),
    }
}

/// One bucket for the launcher thread: its packed input and fresh output (both still queued
/// work on the stream `stream`), and how to reduce it.
struct DeviceBucketJob {
    call: BucketCall,
    input: Tensor<1>,
    output: Tensor<1>,
    burn_dtype: BurnDType,
    stream: StreamId,
}

/// On the launcher thread, running as the packing thread's stream: completes the bucket's
/// input, pins both buffers and queues the all-reduce.
fn enqueue(comm: &NcclComm, job: DeviceBucketJob) -> Result<[DeviceSpan; 2]> {
    let rank = comm.rank();
    let call = &job.call;
    let input = cube_tensor(rank, job.input, &call.what("packed input"))?;
    let output = cube_tensor(rank, job.output, &call.what("output buffer"))?;
    // NCCL reads one contiguous span (cat and cast results are; a lone gradient may be a view).
    let input = burn_cubecl::kernel::into_contiguous(input);
    // The gradients must exist before NCCL reads them (cubecl does not expose its CUDA stream,
    // so this sync stands in for an event between the two streams). Resolving drained Burn's
    // fusion queue up to both tensors; the sync is cubecl's own, not Fusion's.
    <CubeBackend as burn::backend::Backend>::sync(&input.device)
        .map_err(|e| queued_work_failed(rank, e))?;
    // The allocation behind the bucket's `which` buffer (contiguous, on this GPU,
    // `call.count` elements of `burn_dtype`), kept alive with its tensor.
    let span = |cube: CubeTensor, which: &str| -> Result<DeviceSpan> {
        let found = (cube.meta.shape().num_elements(), cube.dtype);
        call.check_tensor(rank, which, cube.is_contiguous(), found, job.burn_dtype)?;
        let resource = (cube.client)
            .get_resource::<<CudaRuntime as Runtime>::Server>(cube.handle.clone())
            .map_err(|e| no_device_resource(rank, &call.what(which), e))?;
        let (ptr, bytes) = (resource.resource().ptr, resource.resource().size);
        // SAFETY: cubecl's resource guard keeps the allocation (`bytes` at `ptr`) from being
        // freed or reused while held, with the tensor; both may be dropped from any thread
        // (the release goes through cubecl's server).
        Ok(unsafe { DeviceSpan::new(ptr, bytes, (cube, resource)) })
    };
    let send = span(input, "packed input")?;
    let recv = span(output, "output buffer")?;
    // SAFETY: both on this GPU, distinct (`recv` is fresh); the input was written by work that
    // `sync` above completed. Both spans are held until the step has waited for NCCL's stream.
    unsafe { all_reduce_bucket(comm, call, [send, recv]) }
}

/// The device path of one rank: the communicator and its launcher thread, on one GPU.
pub(crate) struct DevicePath {
    comm: Arc<NcclComm>,
    launcher: BucketLauncher<DeviceBucketJob, [DeviceSpan; 2]>,
    device: Device,
}

impl std::fmt::Debug for DevicePath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DevicePath")
            .field("comm", &self.comm)
            .field("device", &self.device)
            .finish()
    }
}

impl DevicePath {
    /// The device path for a model on `device`, if gradient synchronisation over `pg` uses
    /// NCCL for it (see [`connect_for_grads`]); `None`: host-staged. Collective: every rank
    /// calls it in `prepare`, and learns whether the others' models are on a GPU too.
    ///
    /// # Errors
    /// Some ranks' models are on a GPU and others' not; `transport` is `Nccl` for a model that
    /// is not on a CUDA device; what [`connect_for_grads`] fails with.
    pub(crate) fn connect(
        pg: &ProcessGroup,
        transport: burn_ddp_comm::config::GradTransport,
        device: Option<&Device>,
    ) -> Result<Option<Self>> {
        use burn_ddp_comm::config::GradTransport;
        if !wants_nccl(pg, transport) {
            return Ok(None);
        }
        let rank = pg.rank();
        let ordinal = device.and_then(cuda_ordinal);
        let mut votes = [i64::from(ordinal.is_some()), i64::from(ordinal.is_none())];
        pg.all_reduce(&mut votes, ReduceOp::Sum)?;
        if votes[0] > 0 && votes[1] > 0 {
            return Err(DdpError::model_access(
                rank,
                "choosing how gradients travel",
                format!(
                    "{} rank(s) prepared a model on a CUDA device and {} on another device \
                     (this rank: {}); put every rank's model on its GPU \
                     (burn_ddp::cuda::rank_device), or every rank's on the CPU",
                    votes[0],
                    votes[1],
                    device.map_or_else(|| "no parameters".to_owned(), |d| format!("{d:?}")),
                ),
            ));
        }
        let Some(ordinal) = ordinal else {
            if transport == GradTransport::Nccl {
                return Err(DdpError::Config(ConfigError::InvalidConfig {
                    field: "DdpConfig::transport",
                    reason: "GradTransport::Nccl needs a model on a CUDA device (Device::cuda, \
                             see burn_ddp::cuda::rank_device); other devices use \
                             GradTransport::Host or Auto",
                }));
            }
            return Ok(None);
        };
        let Some(comm) = connect_for_grads(pg, transport, Some(ordinal))? else {
            return Ok(None);
        };
        let comm = Arc::new(comm);
        let queue = Arc::clone(&comm);
        let launcher = BucketLauncher::start(
            rank,
            Arc::clone(&comm) as Arc<dyn Queue>,
            move |job: DeviceBucketJob| {
                let stream = job.stream;
                stream.executes(|| enqueue(&queue, job))
            },
        )?;
        Ok(Some(Self {
            comm,
            launcher,
            device: Device::cuda(ordinal),
        }))
    }

    /// Aborts the communicator (after a change of membership: its peers may be gone), without
    /// publishing an abort record (the job's belongs to the new membership); the launcher
    /// thread ends when the path is dropped.
    pub(crate) fn abort(self) {
        self.comm.abort();
    }

    /// Reduces `grads` of `model` over the GPU path (see the module documentation).
    ///
    /// # Errors
    /// A gradient on another device than the communicator's; a gradient of the wrong size; a
    /// model that changed since `prepare`; NCCL failures, naming the rank at fault.
    pub(crate) fn sync<M: Module>(
        &self,
        pg: &ProcessGroup,
        plan: &BucketPlan<usize>,
        (reduction, compression): (GradReduction, Compression),
        model: &M,
        mut grads: GradientsParams,
    ) -> Result<GradientsParams> {
        let rank = pg.rank();
        let buckets = DeviceBuckets {
            op: reduction.op(),
            dtype: bucket_dtype(compression),
            parts: (0..plan.slots.len()).map(|_| None).collect(),
            outputs: (0..plan.buckets.len()).map(|_| None).collect(),
            in_flight: InFlight::new(),
            rank,
            wait: pg.timeouts().collective + ANSWER_SLACK,
        };
        let mut pass = Pass::new(rank, plan, buckets, true);
        let mut link = self;
        let taken = crate::grads::take_grads(rank, plan, model, &mut grads, &mut |slot, grad| {
            pass.push(&mut link, plan, slot, grad);
            Ok(())
        });
        // A failure still sends every bucket, then stops NCCL (the other ranks are told) and is
        // reported; the pins go only once NCCL is known done with them.
        let targets = match taken {
            Ok(t) => Some(t),
            Err(e) => {
                pass.fail(e);
                None
            }
        };
        let mut reduced = pass.finish(&mut link, plan)?;
        let targets = targets.ok_or(DdpError::Internal {
            rank,
            what: "a failed gradient step was not reported",
        })?;
        crate::grads::put_grads(model, &mut grads, &targets, &mut |slot, _| {
            reduced[slot].take()
        });
        Ok(grads)
    }
}

/// The device transport of one step: the flattened gradients until their bucket is packed, and
/// the buckets' outputs.
struct DeviceBuckets {
    op: ReduceOp,
    dtype: (DType, BurnDType),
    /// Each slot's flattened f32 gradient (`None`: none on this rank, or packed already).
    parts: Vec<Option<Tensor<1>>>,
    /// Each sent bucket's output: its values, then one presence flag per slot.
    outputs: Vec<Option<Tensor<1>>>,
    in_flight: InFlight<[DeviceSpan; 2]>,
    rank: Rank,
    /// How long to wait for the launcher's answers and NCCL's stream.
    wait: Duration,
}

impl BucketTransport<usize> for DeviceBuckets {
    type Grad<'g> = Tensor<1>;
    type Link<'l> = &'l DevicePath;
    type Output = Vec<Option<Tensor<1>>>;

    /// Keeps slot `slot`'s flattened gradient, checked to be on the communicator's GPU.
    fn keep(
        &mut self,
        path: &mut &DevicePath,
        plan: &BucketPlan<usize>,
        slot: usize,
        g: Tensor<1>,
    ) -> Result<()> {
        let found = g.device();
        let name = &plan.slots[slot].info.name;
        match cuda_ordinal(&found) {
            Some(o) if Some(o) == cuda_ordinal(&path.device) => {}
            Some(o) => {
                return Err(DdpError::Cuda(CudaError::DeviceMismatch {
                    rank: self.rank,
                    what: "the gradients",
                    found: o,
                    expected_why: format!(
                        "NCCL was set up on GPU {} (where the model was at `prepare`; \
                         `{name}`'s gradient is on {found:?})",
                        path.comm.device_ordinal()
                    ),
                }))
            }
            None => {
                return Err(DdpError::model_access(
                    self.rank,
                    "synchronising gradients",
                    format!(
                        "the gradient of `{name}` is on {found:?}, not on a CUDA device, but \
                         the model was on GPU {} at `prepare`, where NCCL was set up; keep \
                         the model on that GPU for the whole training",
                        path.comm.device_ordinal()
                    ),
                ))
            }
        }
        let g = if g.dtype() == BurnDType::F32 {
            g
        } else {
            g.cast(BurnDType::F32)
        };
        self.parts[slot] = Some(g);
        Ok(())
    }

    /// Packs bucket `bucket` and hands it to the launcher (nothing waits here).
    fn send(
        &mut self,
        path: &mut &DevicePath,
        plan: &BucketPlan<usize>,
        bucket: usize,
    ) -> Result<()> {
        let device = &path.device;
        let slots = &plan.buckets[bucket].0;
        let mut flags = vec![0.0f32; slots.len()];
        let mut parts = Vec::with_capacity(slots.len() + 1);
        for (position, &slot) in slots.iter().enumerate() {
            let numel = plan.slots[slot].info.numel;
            parts.push(match self.parts[slot].take() {
                Some(g) => {
                    flags[position] = 1.0;
                    g
                }
                None => Tensor::<1>::zeros([numel], (device, BurnDType::F32)),
            });
        }
        // The flags: a fill on the device when they are all alike (no upload from the host).
        let n = flags.len();
        parts.push(match flags.iter().filter(|&&f| f != 0.0).count() {
            0 => Tensor::<1>::zeros([n], (device, BurnDType::F32)),
            k if k == n => Tensor::<1>::ones([n], (device, BurnDType::F32)),
            _ => Tensor::<1>::from_floats(flags.as_slice(), device),
        });
        let count = plan.buffer_len(bucket);
        let packed = Tensor::cat(parts, 0);
        let (dtype, burn_dtype) = self.dtype;
        let input = if burn_dtype == BurnDType::F32 {
            packed
        } else {
            packed.cast(burn_dtype)
        };
        let output = Tensor::<1>::empty([count], (device, burn_dtype));
        self.outputs[bucket] = Some(output.clone());
        self.in_flight.send(
            &path.launcher,
            DeviceBucketJob {
                call: BucketCall {
                    bucket,
                    count,
                    dtype,
                    op: self.op,
                },
                input,
                output,
                burn_dtype,
                stream: StreamId::current(),
            },
        )
    }

    /// Waits for every answer, then NCCL's stream; returns each slot's reduced gradient
    /// (flattened f32 on the GPU), `None` where no rank had one: the presence flags of every
    /// bucket, read to the host in one transfer.
    fn finish(
        &mut self,
        path: &mut &DevicePath,
        plan: &BucketPlan<usize>,
        local: &[bool],
    ) -> Result<Vec<Option<Tensor<1>>>> {
        self.in_flight.finish(&path.launcher, self.wait)?;
        let mut outputs = Vec::with_capacity(self.outputs.len());
        for o in &mut self.outputs {
            outputs.push(o.take().ok_or(DdpError::Internal {
                rank: self.rank,
                what: "a gradient bucket was not launched",
            })?);
        }
        // A slot with this rank's gradient is present on every rank (its reduced flag is at
        // least 1/world): only the flags of the slots absent here are read to the host, in one
        // transfer, and none when every slot has a local gradient (the usual step: no host
        // synchronisation at its end beyond NCCL's).
        let absent: Vec<usize> = (0..plan.slots.len()).filter(|&i| !local[i]).collect();
        let mut present = local.to_vec();
        if !absent.is_empty() {
            let flags: Vec<Tensor<1>> = absent
                .iter()
                .map(|&i| {
                    let flag = plan.flag_index(i);
                    outputs[plan.slots[i].bucket].clone().slice(flag..flag + 1)
                })
                .collect();
            let flags = Tensor::cat(flags, 0)
                .cast(BurnDType::F32)
                .try_into_data()
                .map_err(|e| {
                    DdpError::Cuda(CudaError::Driver {
                        rank: self.rank,
                        what: "reading the reduced buckets' presence flags".into(),
                        detail: format!("{e:?}"),
                    })
                })?
                .try_to_vec::<f32>()
                .map_err(|e| {
                    DdpError::model_access(
                        self.rank,
                        "reading the reduced buckets' presence flags",
                        format!("{e:?}"),
                    )
                })?;
            for (&i, flag) in absent.iter().zip(flags) {
                present[i] = flag != 0.0;
            }
        }
        Ok(plan
            .slots
            .iter()
            .zip(present)
            .map(|(s, had)| {
                had.then(|| {
                    outputs[s.bucket]
                        .clone()
                        .slice(s.offset..s.offset + s.info.numel)
                })
            })
            .collect())
    }

    /// NCCL is stopped (the other ranks' waits end with this rank named), the launcher's
    /// answers are taken and NCCL's stream drained (bounded) before any buffer of the step
    /// goes, so that their memory is not reused under NCCL (see [`InFlight::abandon`]).
    fn abandon(&mut self, path: &mut &DevicePath, e: DdpError) -> DdpError {
        self.in_flight.abandon(&path.launcher, e, self.wait)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compression_picks_the_bucket_type() {
        assert_eq!(
            bucket_dtype(Compression::None),
            (DType::F32, BurnDType::F32)
        );
        assert_eq!(bucket_dtype(Compression::F16), (DType::F16, BurnDType::F16));
        assert_eq!(
            bucket_dtype(Compression::Bf16),
            (DType::BF16, BurnDType::BF16)
        );
    }

    #[test]
    fn only_cuda_devices_have_an_ordinal() {
        assert_eq!(cuda_ordinal(&Device::cuda(3)), Some(3));
        assert_eq!(cuda_ordinal(&Device::cuda(1).autodiff()), Some(1));
        assert_eq!(cuda_ordinal(&Device::flex()), None);
    }
}
