//! The zero-copy gradient path of `Autodiff<Ddp<Cuda>>`: buckets live on the GPU and NCCL reads
//! and writes Burn's own device memory.
//!
//! Per bucket, when its last gradient is final (in bucket order, as on the host path):
//! 1. its gradients are packed into one contiguous device tensor by Burn itself (`cat` of the
//!    flattened gradients, zeros for parameters without a gradient on this rank; a cast for
//!    compression): one device-to-device copy, as PyTorch DDP's bucket copy;
//! 2. Burn's queued compute is flushed and completed (`Backend::sync`): the gradients exist
//!    before NCCL reads them (cubecl does not expose its stream, so an event cannot order the
//!    two streams instead);
//! 3. the bucket's device pointer comes from cubecl's resource (resolving Burn's fusion tensor
//!    first when Burn runs with `fusion`), checked against the bucket's size, and an in-place
//!    all-reduce is queued on the communicator's stream. The resource guard and the tensor stay
//!    in the step until the reduction is complete, so the memory cannot be reused meanwhile.
//!
//! Backward continues while NCCL runs. At the end of backward every queued reduction is waited
//! for (with the collective deadline), then each gradient is replaced by its slice of the
//! reduced bucket (a view: no copy), so the optimizer only ever sees averaged values. No byte
//! of a gradient crosses to the host.

use std::any::Any;

use burn::backend::Cuda;
use burn_backend::ops::FloatTensorOps;
use burn_backend::tensor::FloatTensor;
use burn_backend::{Backend, DType as BurnDType, Shape, TensorMetadata};
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeBackend;
use cubecl::cuda::CudaRuntime;

use super::NcclComm;
use crate::comm::{DType, ReduceOp};
use crate::error::{DdpError, Result};
use crate::group::Rank;

type Cube = CubeBackend<CudaRuntime, f32, i32, u8>;
/// `Cuda` with its default element types (an alias in type position applies them).
type Gpu = Cuda;
type CudaFloat = FloatTensor<Cuda>;
type Fused = burn_fusion::FusionTensor<burn_cubecl::fusion::FusionCubeRuntime<CudaRuntime>>;

/// Whether `B` is Burn's CUDA backend (with or without `fusion`), whose tensors this path takes.
pub(crate) fn is_cuda<B: Backend>() -> bool {
    std::any::TypeId::of::<B>() == std::any::TypeId::of::<Cuda>()
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

/// Keeps a device allocation alive (and unreused) while NCCL works on it.
struct Pinned {
    _tensor: CubeTensor<CudaRuntime>,
    _resource: Box<dyn Any>,
}

// SAFETY: the guard only holds cubecl's reference to the allocation and a copy of its pointer;
// it is never dereferenced, only dropped, which cubecl allows from any thread (its server
// processes the release).
unsafe impl Send for Pinned {}

/// Checks that a device resource of `bytes` bytes holds `count` elements of `dtype`.
pub(crate) fn check_span(
    bytes: u64,
    count: usize,
    dtype: DType,
) -> std::result::Result<(), String> {
    let need = count as u64 * dtype.size() as u64;
    if bytes >= need {
        Ok(())
    } else {
        Err(format!(
            "the bucket's device buffer has {bytes} bytes but {count} x {dtype} need {need}"
        ))
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

/// One bucket queued on the NCCL stream.
struct Queued {
    tensor: CudaFloat,
    _pin: Pinned,
}

/// The device state of one backward pass.
#[derive(Default)]
pub(crate) struct DeviceStep {
    /// Each slot's flattened gradient, until its bucket is packed.
    grads: Vec<Option<CudaFloat>>,
    /// Each slot's original shape and dtype (to write the result back).
    shapes: Vec<Option<(Shape, BurnDType)>>,
    queued: Vec<Option<Queued>>,
    device: Option<<Cuda as burn_backend::BackendTypes>::Device>,
}

impl std::fmt::Debug for DeviceStep {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceStep")
            .field("grads", &self.grads.iter().filter(|g| g.is_some()).count())
            .field(
                "queued",
                &self.queued.iter().filter(|q| q.is_some()).count(),
            )
            .finish()
    }
}

impl DeviceStep {
    pub(crate) fn new(slots: usize, buckets: usize) -> Self {
        Self {
            grads: (0..slots).map(|_| None).collect(),
            shapes: vec![None; slots],
            queued: (0..buckets).map(|_| None).collect(),
            device: None,
        }
    }

    /// Keeps slot `slot`'s final gradient (flattened) for its bucket.
    pub(crate) fn keep(&mut self, slot: usize, grad: CudaFloat) {
        let shape = grad.shape();
        let dtype = grad.dtype();
        self.device.get_or_insert_with(|| Gpu::float_device(&grad));
        let flat = Gpu::float_reshape(grad, Shape::new([shape.num_elements()]));
        let flat = if dtype == BurnDType::F32 {
            flat
        } else {
            Gpu::float_cast(flat, burn_backend::FloatDType::F32)
        };
        self.grads[slot] = Some(flat);
        self.shapes[slot] = Some((shape, dtype));
    }

    /// Packs bucket `bucket` (its slots in offset order, with their lengths) and queues its
    /// all-reduce on `comm`'s stream.
    pub(crate) fn launch(
        &mut self,
        comm: &NcclComm,
        bucket: usize,
        slots: &[(usize, usize)],
        op: ReduceOp,
        compression: crate::Compression,
    ) -> Result<()> {
        let rank = comm.rank();
        // No gradient at all on this rank yet: the bucket is zeros on the communicator's GPU.
        let device = self.device.clone().unwrap_or(cubecl::cuda::CudaDevice {
            index: comm.context().ordinal(),
        });
        let device = &device;
        let parts: Vec<CudaFloat> = slots
            .iter()
            .map(|&(slot, numel)| {
                self.grads[slot].take().unwrap_or_else(|| {
                    Gpu::float_zeros(Shape::new([numel]), device, burn_backend::FloatDType::F32)
                })
            })
            .collect();
        let count: usize = slots.iter().map(|s| s.1).sum();
        let packed = if parts.len() == 1 {
            parts
                .into_iter()
                .next()
                .unwrap_or_else(|| unreachable!("one part"))
        } else {
            Gpu::float_cat(parts, 0)
        };
        let (dtype, burn_dtype) = bucket_dtype(compression);
        let packed = if burn_dtype == BurnDType::F32 {
            packed
        } else {
            Gpu::float_cast(packed, float_dtype(burn_dtype))
        };
        // The gradients must exist before NCCL reads them.
        Gpu::sync(device).map_err(|e| DdpError::Cuda {
            rank,
            what: "completing Burn's queued work before the bucket's all-reduce".into(),
            detail: format!("{e:?}"),
        })?;
        let cube = packed.clone().resolve();
        if !cube.is_contiguous() {
            return Err(layout_error(
                rank,
                "the packed bucket is not contiguous".into(),
            ));
        }
        let resource = cube
            .client
            .get_resource(cube.handle.clone())
            .map_err(|e| layout_error(rank, format!("cubecl has no resource for it: {e:?}")))?;
        let (ptr, bytes) = (resource.resource().ptr, resource.resource().size);
        check_span(bytes, count, dtype).map_err(|m| layout_error(rank, m))?;
        // SAFETY: `ptr` addresses `bytes` >= count * size bytes of this GPU's memory, written by
        // work that `sync` above completed; the tensor and its resource are pinned in the step
        // until `finish` has waited for the stream.
        unsafe { comm.all_reduce_raw(ptr, ptr, count, dtype, op) }?;
        self.queued[bucket] = Some(Queued {
            tensor: packed,
            _pin: Pinned {
                _tensor: cube,
                _resource: Box::new(resource),
            },
        });
        Ok(())
    }

    /// Waits for every queued reduction and returns, per slot with a local gradient, the
    /// reduced values (a view of the bucket, shaped and typed as the gradient was).
    pub(crate) fn finish(
        &mut self,
        comm: &NcclComm,
        slots: impl Iterator<Item = (usize, usize, usize, usize)>,
    ) -> Result<Vec<(usize, CudaFloat)>> {
        comm.wait()?;
        let mut out = Vec::new();
        for (slot, bucket, offset, numel) in slots {
            let (Some(q), Some((shape, dtype))) = (&self.queued[bucket], self.shapes[slot].clone())
            else {
                continue;
            };
            let part = Gpu::float_slice(
                q.tensor.clone(),
                &[burn_backend::Slice::from(offset..offset + numel)],
            );
            let part = if part.dtype() == dtype {
                part
            } else {
                Gpu::float_cast(part, float_dtype(dtype))
            };
            out.push((slot, Gpu::float_reshape(part, shape)));
        }
        self.queued.iter_mut().for_each(|q| *q = None);
        Ok(out)
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

fn layout_error(rank: Rank, reason: String) -> DdpError {
    DdpError::Model {
        rank,
        what: "handing a gradient bucket to NCCL",
        reason,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bucket_must_fit_its_device_buffer() {
        assert!(check_span(4096, 1024, DType::F32).is_ok());
        assert!(check_span(4096, 2048, DType::F16).is_ok());
        let e = check_span(4092, 1024, DType::F32).unwrap_err();
        assert!(e.contains("4092 bytes but 1024 x float need 4096"), "{e}");
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
