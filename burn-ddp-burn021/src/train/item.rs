//! Global metrics: each step's output items of every rank, merged into one item on rank 0.

use burn::tensor::backend::Backend;
use burn::tensor::{Device, Int, Tensor, TensorData};
use burn::train::{ClassificationOutput, MultiLabelClassificationOutput, RegressionOutput};

use crate::Result;

/// An output item that can be merged across ranks, so that the metrics on rank 0's dashboard are
/// those of the whole job: the merged item holds every rank's examples (accuracy over the global
/// batch, item counts summed) and the loss averaged over them.
///
/// Implemented for burn-train's [`ClassificationOutput`], [`MultiLabelClassificationOutput`]
/// and [`RegressionOutput`]. For an output of your own, list its tensors in
/// [`into_parts`](Self::into_parts) and rebuild one item from every rank's list in
/// [`merge`](Self::merge); [`Part`] does the concatenation and the weighted mean.
pub trait DistributedItem: Sized {
    /// The backend of the item's tensors.
    type Backend: Backend;

    /// This rank's item as host data, always the same parts in the same order.
    fn into_parts(self) -> Vec<Part>;

    /// One item from the parts of every rank that had an item this step, in rank order (at
    /// least one).
    ///
    /// # Errors
    /// Parts that do not fit together (a rank sent a different kind of item).
    fn merge(ranks: Vec<Vec<Part>>, device: &Device<Self::Backend>) -> Result<Self>;
}

pub use burn_ddp_comm::train::parts::Part;

/// Burn 0.21 tensors to and from [`Part`]s (`use burn_ddp::train::TensorParts` to call
/// `Part::float(tensor)` and the others).
pub trait TensorParts: Sized {
    /// A float tensor's values.
    fn float<B: Backend, const D: usize>(tensor: Tensor<B, D>) -> Self;

    /// An integer tensor's values.
    fn int<B: Backend, const D: usize>(tensor: Tensor<B, D, Int>) -> Self;

    /// The float parts concatenated along the first dimension.
    ///
    /// # Errors
    /// A part that is not a float tensor of rank `D`, or whose trailing dimensions differ.
    fn cat_float<B: Backend, const D: usize>(
        parts: &[&Self],
        device: &B::Device,
    ) -> Result<Tensor<B, D>>;

    /// The integer parts concatenated along the first dimension.
    ///
    /// # Errors
    /// As [`cat_float`](Self::cat_float), for integer tensors.
    fn cat_int<B: Backend, const D: usize>(
        parts: &[&Self],
        device: &B::Device,
    ) -> Result<Tensor<B, D, Int>>;

    /// The mean of one-element float parts (per-rank mean losses) weighted by `weights` (the
    /// ranks' batch sizes): the mean over the global batch, as a one-element tensor.
    ///
    /// # Errors
    /// A part that is not a float tensor.
    fn weighted_mean<B: Backend>(
        parts: &[&Self],
        weights: &[usize],
        device: &B::Device,
    ) -> Result<Tensor<B, 1>>;
}

impl TensorParts for Part {
    fn float<B: Backend, const D: usize>(tensor: Tensor<B, D>) -> Self {
        let data = tensor.into_data().convert::<f32>();
        Part::Float {
            shape: data.shape.to_vec(),
            values: data.to_vec().unwrap_or_default(),
        }
    }

    fn int<B: Backend, const D: usize>(tensor: Tensor<B, D, Int>) -> Self {
        let data = tensor.into_data().convert::<i64>();
        Part::Int {
            shape: data.shape.to_vec(),
            values: data.to_vec().unwrap_or_default(),
        }
    }

    fn cat_float<B: Backend, const D: usize>(
        parts: &[&Part],
        device: &B::Device,
    ) -> Result<Tensor<B, D>> {
        let (shape, values) = Part::cat_floats(parts, D)?;
        Ok(Tensor::from_data(TensorData::new(values, shape), device))
    }

    fn cat_int<B: Backend, const D: usize>(
        parts: &[&Part],
        device: &B::Device,
    ) -> Result<Tensor<B, D, Int>> {
        let (shape, values) = Part::cat_ints(parts, D)?;
        Ok(Tensor::from_data(TensorData::new(values, shape), device))
    }

    fn weighted_mean<B: Backend>(
        parts: &[&Part],
        weights: &[usize],
        device: &B::Device,
    ) -> Result<Tensor<B, 1>> {
        let mean = Part::weighted_mean_value(parts, weights)?;
        Ok(Tensor::from_data(TensorData::new(vec![mean], [1]), device))
    }
}

macro_rules! loss_output_targets {
    ($ty:ident, $targets:ident, $target_dims:literal) => {
        impl<B: Backend> DistributedItem for $ty<B> {
            type Backend = B;

            fn into_parts(self) -> Vec<Part> {
                vec![
                    Part::float(self.loss),
                    Part::float(self.output),
                    Part::$targets(self.targets),
                ]
            }

            fn merge(ranks: Vec<Vec<Part>>, device: &B::Device) -> Result<Self> {
                let outputs = Part::column(&ranks, 1)?;
                let weights: Vec<usize> = outputs.iter().map(|p| p.rows()).collect();
                Ok($ty {
                    loss: Part::weighted_mean(&Part::column(&ranks, 0)?, &weights, device)?,
                    output: Part::cat_float::<B, 2>(&outputs, device)?,
                    targets: loss_output_targets!(@cat $targets, $target_dims, Part::column(&ranks, 2)?, device),
                })
            }
        }
    };
    (@cat int, $d:literal, $parts:expr, $device:expr) => {
        Part::cat_int::<B, $d>(&$parts, $device)?
    };
    (@cat float, $d:literal, $parts:expr, $device:expr) => {
        Part::cat_float::<B, $d>(&$parts, $device)?
    };
}

loss_output_targets!(ClassificationOutput, int, 1);
loss_output_targets!(MultiLabelClassificationOutput, int, 2);
loss_output_targets!(RegressionOutput, float, 2);

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::NdArray;
    use burn::tensor::TensorData;
    use burn_ddp_dev::adapters;

    type B = NdArray;

    #[test]
    fn classification_outputs_merge_into_the_global_batch() {
        let dev = Default::default();
        adapters::classification_outputs_merge_into_the_global_batch(|ranks| {
            let mut parts = Vec::new();
            for (loss, rows, targets) in ranks {
                let n = rows.len();
                let item = ClassificationOutput::<B>::new(
                    Tensor::from_floats([loss], &dev),
                    Tensor::from_data(TensorData::new(rows.concat(), [n, 2]), &dev),
                    Tensor::from_data(TensorData::new(targets, [n]), &dev),
                );
                parts.push(item.into_parts());
            }
            let m = ClassificationOutput::<B>::merge(parts, &dev).unwrap();
            let targets = m.targets.into_data().convert::<i64>().to_vec::<i64>();
            (m.loss.into_scalar(), m.output.dims(), targets.unwrap())
        });
    }

    #[test]
    fn items_of_different_kinds_do_not_merge() {
        let dev = Default::default();
        let a = RegressionOutput::<B>::new(
            Tensor::from_floats([0.5], &dev),
            Tensor::from_floats([[1.0]], &dev),
            Tensor::from_floats([[1.0]], &dev),
        );
        let b = ClassificationOutput::<B>::new(
            Tensor::from_floats([0.5], &dev),
            Tensor::from_floats([[1.0]], &dev),
            Tensor::from_ints([0], &dev),
        );
        let err = RegressionOutput::<B>::merge(vec![a.into_parts(), b.into_parts()], &dev);
        assert!(err.is_err());
    }
}
