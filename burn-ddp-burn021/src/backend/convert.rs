//! Moves values of Burn's backend-parameterised structs between `Ddp<B>` and `B`. The two
//! backends share every tensor primitive type, so these only re-label the type parameter; the
//! generated forwards (`forward.rs`) call them where a signature names such a struct.

use burn_backend::ops::{
    DeformConv2dBackward, MaxPool1dBackward, MaxPool1dWithIndices, MaxPool2dBackward,
    MaxPool2dWithIndices,
};
use burn_backend::quantization::QuantizationParametersPrimitive;
use burn_backend::{Backend, TensorPrimitive};

/// A backend with the same tensor primitives as `A`.
pub(super) trait Same<A: Backend>:
    Backend<
    FloatTensorPrimitive = A::FloatTensorPrimitive,
    IntTensorPrimitive = A::IntTensorPrimitive,
    BoolTensorPrimitive = A::BoolTensorPrimitive,
    QuantizedTensorPrimitive = A::QuantizedTensorPrimitive,
>
{
}

impl<A: Backend, C> Same<A> for C where
    C: Backend<
        FloatTensorPrimitive = A::FloatTensorPrimitive,
        IntTensorPrimitive = A::IntTensorPrimitive,
        BoolTensorPrimitive = A::BoolTensorPrimitive,
        QuantizedTensorPrimitive = A::QuantizedTensorPrimitive,
    >
{
}

pub(super) fn tensor_primitive<A: Backend, C: Same<A>>(
    x: TensorPrimitive<A>,
) -> TensorPrimitive<C> {
    match x {
        TensorPrimitive::Float(t) => TensorPrimitive::Float(t),
        TensorPrimitive::QFloat(t) => TensorPrimitive::QFloat(t),
    }
}

pub(super) fn qparams<A: Backend, C: Same<A>>(
    x: QuantizationParametersPrimitive<A>,
) -> QuantizationParametersPrimitive<C> {
    QuantizationParametersPrimitive { scales: x.scales }
}

pub(super) fn max_pool1d_backward<A: Backend, C: Same<A>>(
    x: MaxPool1dBackward<A>,
) -> MaxPool1dBackward<C> {
    MaxPool1dBackward { x_grad: x.x_grad }
}

pub(super) fn max_pool2d_backward<A: Backend, C: Same<A>>(
    x: MaxPool2dBackward<A>,
) -> MaxPool2dBackward<C> {
    MaxPool2dBackward { x_grad: x.x_grad }
}

pub(super) fn max_pool1d_with_indices<A: Backend, C: Same<A>>(
    x: MaxPool1dWithIndices<A>,
) -> MaxPool1dWithIndices<C> {
    MaxPool1dWithIndices {
        output: x.output,
        indices: x.indices,
    }
}

pub(super) fn max_pool2d_with_indices<A: Backend, C: Same<A>>(
    x: MaxPool2dWithIndices<A>,
) -> MaxPool2dWithIndices<C> {
    MaxPool2dWithIndices {
        output: x.output,
        indices: x.indices,
    }
}

pub(super) fn deform_conv2d_backward<A: Backend, C: Same<A>>(
    x: DeformConv2dBackward<A>,
) -> DeformConv2dBackward<C> {
    DeformConv2dBackward {
        x_grad: x.x_grad,
        offset_grad: x.offset_grad,
        weight_grad: x.weight_grad,
        mask_grad: x.mask_grad,
        bias_grad: x.bias_grad,
    }
}
