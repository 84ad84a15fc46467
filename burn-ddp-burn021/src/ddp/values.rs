//! A backend's float tensors read as f32 values and made from them: what the host-staged path
//! (`hooks.rs`) and the device path's presence flags (`gpu.rs`) read and write, and what the
//! buffer broadcast and ZeRO's all-gather write back into a module's tensors.

use burn_backend::tensor::FloatTensor;
use burn_backend::{read_sync, Backend, DType, FloatDType, TensorData, TensorMetadata};

/// Reads a float tensor as f32 values, in row-major order.
pub(crate) fn read_f32<B: Backend>(tensor: FloatTensor<B>) -> Result<Vec<f32>, String> {
    // Reshaping to 1-D first hands `into_data` a fresh, contiguous tensor that nothing else
    // shares. Backends take their slow path otherwise: NdArray reads a shared or transposed
    // array (every Linear weight gradient is one) element by element through a dynamic index,
    // which measured as 60 % of a 2-rank MLP step; a reshape is one contiguous copy.
    let numel = tensor.shape().num_elements();
    let flat = B::float_reshape(tensor, burn_backend::Shape::new([numel]));
    let data = read_sync(B::float_into_data(flat)).map_err(|e| e.to_string())?;
    data.convert_dtype(DType::F32)
        .into_vec::<f32>()
        .map_err(|e| format!("{e:?}"))
}

/// The float type a float tensor of `d` is cast to or made in (`FloatDType`; a dtype that is
/// not a float, which no float tensor has, gives f32).
pub(crate) fn float_dtype(d: DType) -> FloatDType {
    match d {
        DType::F64 => FloatDType::F64,
        DType::F16 => FloatDType::F16,
        DType::BF16 => FloatDType::BF16,
        DType::Flex32 => FloatDType::Flex32,
        _ => FloatDType::F32,
    }
}

/// The inverse of `read_f32`: a tensor of `shape` and `dtype` on `device` holding `values`.
pub(crate) fn write_f32<B: Backend>(
    values: Vec<f32>,
    shape: burn_backend::Shape,
    dtype: DType,
    device: &B::Device,
) -> FloatTensor<B> {
    B::float_from_data(TensorData::new(values, shape).convert_dtype(dtype), device)
}

/// A tensor of `like`'s shape, element type and device holding `values`: a fresh leaf that
/// requires a gradient when `like` does.
pub(super) fn filled_like<B: burn::tensor::backend::Backend, const D: usize>(
    like: &burn::tensor::Tensor<B, D>,
    values: &[f32],
) -> burn::tensor::Tensor<B, D> {
    let data = TensorData::new(values.to_vec(), like.shape()).convert_dtype(like.dtype());
    let fresh = burn::tensor::Tensor::from_data(data, &like.device());
    if like.is_require_grad() {
        fresh.require_grad()
    } else {
        fresh
    }
}
