//! A communication hook for both lines' equivalence tests: [`MeanBySum`] averages over the
//! ranks by a sum and a scale of its own, whatever the configuration's reduction says. A test
//! that configures `GradReduction::Sum` with it and still trains like one process on the mean
//! shows that the hook, not the built-in reduction, reduced every bucket.

use burn_ddp_comm::grad::{BucketShape, CommHook};
use burn_ddp_comm::types::ReduceOp;
use burn_ddp_comm::{DdpError, ProcessGroup, Result};

/// The mean over the ranks as a sum, then a scale by one over the world size; it checks that
/// buckets come in index order and with their layout.
#[derive(Debug, Default)]
pub struct MeanBySum {
    /// The bucket expected next (0 also starts a new step).
    next: usize,
}

impl MeanBySum {
    /// A fresh hook, boxed for `DdpConfig::with_comm_hook`.
    pub fn boxed() -> Box<dyn CommHook> {
        Box::new(Self::default())
    }
}

impl CommHook for MeanBySum {
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
        let what = if bucket != 0 && bucket != self.next {
            Some("MeanBySum was given a bucket out of index order")
        } else if layout.is_none_or(|l| l.len > data.len()) {
            Some("MeanBySum was given no layout, or one that does not fit its bucket")
        } else {
            None
        };
        if let Some(what) = what {
            return Err(DdpError::Internal {
                rank: pg.rank(),
                what,
            });
        }
        self.next = bucket + 1;
        pg.all_reduce(data, ReduceOp::Sum)?;
        let scale = 1.0 / pg.world_size().as_usize() as f32;
        data.iter_mut().for_each(|v| *v *= scale);
        Ok(())
    }
}
