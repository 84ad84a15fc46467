//! Global metrics: each step's output items of every rank, merged into one item on rank 0
//! (burn-ddp-comm's `train::parts` moves them; this module turns Burn tensors into parts and
//! back).

use burn::tensor::{Device, Int, Tensor, TensorData};
use burn::train::{ClassificationOutput, MultiLabelClassificationOutput, RegressionOutput};

use crate::Result;

pub use burn_ddp_comm::train::parts::Part;

/// An output item that can be merged across ranks, so that the metrics on rank 0's dashboard are
/// those of the whole job: the merged item holds every rank's examples (accuracy over the global
/// batch, item counts summed) and the loss averaged over them.
///
/// Implemented for burn-train's [`ClassificationOutput`], [`MultiLabelClassificationOutput`]
/// and [`RegressionOutput`]. For an output of your own, list its tensors in
/// [`into_parts`](Self::into_parts) and rebuild one item from every rank's list in
/// [`merge`](Self::merge); [`TensorParts`] does the concatenation and the weighted mean.
pub trait DistributedItem: Sized {
    /// This rank's item as host data, always the same parts in the same order.
    fn into_parts(self) -> Vec<Part>;

    /// One item on `device` from the parts of every rank that had an item this step, in rank
    /// order (at least one).
    ///
    /// # Errors
    /// Parts that do not fit together (a rank sent a different kind of item).
    fn merge(ranks: Vec<Vec<Part>>, device: &Device) -> Result<Self>;
}

/// Burn tensors to and from [`Part`]s (`use burn_ddp::train::TensorParts` to call
/// `Part::float(tensor)` and the others).
pub trait TensorParts: Sized {
    /// A float tensor's values.
    fn float<const D: usize>(tensor: Tensor<D>) -> Self;

    /// An integer tensor's values.
    fn int<const D: usize>(tensor: Tensor<D, Int>) -> Self;

    /// The float parts concatenated along the first dimension.
    ///
    /// # Errors
    /// A part that is not a float tensor of rank `D`, or whose trailing dimensions differ.
    fn cat_float<const D: usize>(parts: &[&Self], device: &Device) -> Result<Tensor<D>>;

    /// The integer parts concatenated along the first dimension.
    ///
    /// # Errors
    /// As [`cat_float`](Self::cat_float), for integer tensors.
    fn cat_int<const D: usize>(parts: &[&Self], device: &Device) -> Result<Tensor<D, Int>>;

    /// The mean of float parts (per-rank mean losses) weighted by `weights` (the ranks' batch
    /// sizes): the mean over the global batch, as a one-element tensor.
    ///
    /// # Errors
    /// A part that is not a float tensor.
    fn weighted_mean(parts: &[&Self], weights: &[usize], device: &Device) -> Result<Tensor<1>>;
}

impl TensorParts for Part {
    fn float<const D: usize>(tensor: Tensor<D>) -> Self {
        let shape = tensor.dims().to_vec();
        let data = tensor.into_data().convert::<f32>();
        Part::Float {
            shape,
            // Values that cannot be read make an empty part, which the merge refuses.
            values: data.try_into_vec().unwrap_or_default(),
        }
    }

    fn int<const D: usize>(tensor: Tensor<D, Int>) -> Self {
        let shape = tensor.dims().to_vec();
        let data = tensor.into_data().convert::<i64>();
        Part::Int {
            shape,
            values: data.try_into_vec().unwrap_or_default(),
        }
    }

    fn cat_float<const D: usize>(parts: &[&Part], device: &Device) -> Result<Tensor<D>> {
        let (shape, values) = Part::cat_floats(parts, D)?;
        Ok(Tensor::from_data(TensorData::new(values, shape), device))
    }

    fn cat_int<const D: usize>(parts: &[&Part], device: &Device) -> Result<Tensor<D, Int>> {
        let (shape, values) = Part::cat_ints(parts, D)?;
        Ok(Tensor::from_data(TensorData::new(values, shape), device))
    }

    fn weighted_mean(parts: &[&Part], weights: &[usize], device: &Device) -> Result<Tensor<1>> {
        let mean = Part::weighted_mean_value(parts, weights)?;
        Ok(Tensor::from_data(TensorData::new(vec![mean], [1]), device))
    }
}

macro_rules! loss_output_targets {
    ($ty:ident, $targets:ident, $cat:ident, $target_dims:literal) => {
        impl DistributedItem for $ty {
            fn into_parts(self) -> Vec<Part> {
                vec![
                    Part::float(self.loss),
                    Part::float(self.output),
                    Part::$targets(self.targets),
                ]
            }

            fn merge(ranks: Vec<Vec<Part>>, device: &Device) -> Result<Self> {
                let outputs = Part::column(&ranks, 1)?;
                let weights: Vec<usize> = outputs.iter().map(|p| p.rows()).collect();
                Ok($ty {
                    loss: Part::weighted_mean(&Part::column(&ranks, 0)?, &weights, device)?,
                    output: Part::cat_float::<2>(&outputs, device)?,
                    targets: Part::$cat::<$target_dims>(&Part::column(&ranks, 2)?, device)?,
                })
            }
        }
    };
}

loss_output_targets!(ClassificationOutput, int, cat_int, 1);
loss_output_targets!(MultiLabelClassificationOutput, int, cat_int, 2);
loss_output_targets!(RegressionOutput, float, cat_float, 2);

#[cfg(test)]
mod tests {
    use super::*;
    use burn_ddp_dev::adapters;

    #[test]
    fn classification_outputs_merge_into_the_global_batch() {
        let dev = Device::default();
        adapters::classification_outputs_merge_into_the_global_batch(|ranks| {
            let parts = ranks.into_iter().map(|(loss, rows, targets)| {
                let output = TensorData::new(rows.concat(), [rows.len(), 2]);
                let targets = TensorData::new(targets.clone(), [targets.len()]);
                let loss = Tensor::from_floats([loss], &dev);
                let item = ClassificationOutput::new(
                    loss,
                    Tensor::from_data(output, &dev),
                    Tensor::from_data(targets, &dev),
                );
                item.into_parts()
            });
            let m = ClassificationOutput::merge(parts.collect(), &dev).unwrap();
            let targets = m.targets.into_data().convert::<i64>();
            let loss: f32 = m.loss.into_scalar();
            (loss, m.output.dims(), targets.try_to_vec().unwrap())
        });
    }

    #[test]
    fn items_of_different_kinds_do_not_merge() {
        let dev = Device::default();
        let a = RegressionOutput::new(
            Tensor::from_floats([0.5], &dev),
            Tensor::from_floats([[1.0]], &dev),
            Tensor::from_floats([[1.0]], &dev),
        );
        let b = ClassificationOutput::new(
            Tensor::from_floats([0.5], &dev),
            Tensor::from_floats([[1.0]], &dev),
            Tensor::from_ints([0], &dev),
        );
        assert!(RegressionOutput::merge(vec![a.into_parts(), b.into_parts()], &dev).is_err());
    }
}
