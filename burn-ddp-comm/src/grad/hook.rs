//! [`CommHook`]: how one host-staged gradient bucket is all-reduced, as PyTorch's
//! communication hooks (`register_comm_hook`) decide it there. The transports pack and launch
//! buckets; a hook only reduces one. Built in: [`AllReduce`] (full precision, or cast to
//! fp16/bf16 on the wire) and [`PowerSgdState`] (low-rank, with error feedback);
//! [`builtin_hook`] picks the one a [`DdpConfig`](super::DdpConfig) asks for.

use std::sync::Arc;

use half::{bf16, f16};

use super::{BucketShape, Compression, GradReduction, PowerSgd, PowerSgdState, PowerSgdStats};
use crate::group::ProcessGroup;
use crate::{DdpError, Result};

/// How a bucket is all-reduced. The communication thread calls it for every bucket of every
/// step, in index order, on every rank (bucket 0 starts a step), so a hook may keep state
/// across steps as long as every rank keeps the same.
pub trait CommHook: Send {
    /// Whether [`reduce`](Self::reduce) reads the bucket's layout (the transports build it only
    /// then).
    fn wants_layout(&self) -> bool {
        false
    }

    /// All-reduces bucket `bucket` in place: `data` holds its values, then one presence flag
    /// per parameter (reduced like the values); `layout` is its parameters' matrices when
    /// [`wants_layout`](Self::wants_layout) says so.
    ///
    /// # Errors
    /// Collective failures, naming the rank at fault; a hook that needs a layout it was not
    /// given.
    fn reduce(
        &mut self,
        pg: &ProcessGroup,
        bucket: usize,
        data: &mut [f32],
        layout: Option<&BucketShape>,
    ) -> Result<()>;
}

/// The default hook: one all-reduce of the bucket, in f32 or cast to the wire format of
/// `compression` (PyTorch's `allreduce_hook`, `fp16_compress_hook`, `bf16_compress_hook`).
#[derive(Debug, Clone, Copy)]
pub struct AllReduce {
    /// Mean or sum.
    pub reduction: GradReduction,
    /// The wire format.
    pub compression: Compression,
}

impl CommHook for AllReduce {
    fn reduce(
        &mut self,
        pg: &ProcessGroup,
        _bucket: usize,
        data: &mut [f32],
        _layout: Option<&BucketShape>,
    ) -> Result<()> {
        reduce_bucket(pg, data, self.reduction, self.compression)
    }
}

impl CommHook for PowerSgdState {
    fn wants_layout(&self) -> bool {
        true
    }

    fn reduce(
        &mut self,
        pg: &ProcessGroup,
        bucket: usize,
        data: &mut [f32],
        layout: Option<&BucketShape>,
    ) -> Result<()> {
        let Some(layout) = layout else {
            return Err(DdpError::Internal {
                rank: pg.rank(),
                what: "a PowerSGD bucket was launched without its layout",
            });
        };
        PowerSgdState::reduce(self, pg, bucket, data, layout)
    }
}

/// The hook a configuration asks for: PowerSGD (counting into `power_sgd`'s statistics) when
/// given, else [`AllReduce`] with `reduction` and `compression`.
pub fn builtin_hook(
    reduction: GradReduction,
    compression: Compression,
    power_sgd: Option<(PowerSgd, Arc<PowerSgdStats>)>,
) -> Box<dyn CommHook> {
    match power_sgd {
        Some((config, stats)) => Box::new(PowerSgdState::new(config, reduction, stats)),
        None => Box::new(AllReduce {
            reduction,
            compression,
        }),
    }
}

/// All-reduces one bucket in place, cast to the wire format of `compression` if asked.
///
/// # Errors
/// Collective failures, naming the rank at fault.
pub fn reduce_bucket(
    pg: &ProcessGroup,
    data: &mut [f32],
    reduction: GradReduction,
    compression: Compression,
) -> Result<()> {
    let op = reduction.op();
    match compression {
        Compression::None => pg.all_reduce(data, op),
        Compression::F16 => {
            let mut c: Vec<f16> = data.iter().map(|&v| f16::from_f32(v)).collect();
            pg.all_reduce(&mut c, op)?;
            data.iter_mut().zip(&c).for_each(|(d, v)| *d = v.to_f32());
            Ok(())
        }
        Compression::Bf16 => {
            let mut c: Vec<bf16> = data.iter().map(|&v| bf16::from_f32(v)).collect();
            pg.all_reduce(&mut c, op)?;
            data.iter_mut().zip(&c).for_each(|(d, v)| *d = v.to_f32());
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn power_sgd_without_a_layout_is_an_internal_error_not_a_panic() {
        let pg = ProcessGroup::single();
        let stats = Arc::new(PowerSgdStats::default());
        let mut hook = builtin_hook(
            GradReduction::Mean,
            Compression::None,
            Some((PowerSgd::new(1), stats)),
        );
        assert!(hook.wants_layout());
        let err = hook.reduce(&pg, 0, &mut [1.0, 1.0], None).unwrap_err();
        assert!(matches!(err, DdpError::Internal { .. }), "{err:?}");
    }

    #[test]
    fn the_default_hook_reduces_without_a_layout() {
        let pg = ProcessGroup::single();
        let mut hook = builtin_hook(GradReduction::Sum, Compression::Bf16, None);
        assert!(!hook.wants_layout());
        let mut data = [1.5f32, 2.0];
        hook.reduce(&pg, 0, &mut data, None).unwrap();
        assert_eq!(data, [1.5, 2.0]);
    }
}
