//! [`CommHook`]: how one host-staged gradient bucket is all-reduced, as PyTorch's
//! communication hooks (`register_comm_hook`) decide it there. The transports pack and launch
//! buckets; a hook only reduces one. Built in: [`AllReduce`] (full precision, or cast to
//! fp16/bf16 on the wire) and [`PowerSgdState`] (low-rank, with error feedback); a user's own
//! through [`DdpConfig::with_comm_hook`](super::DdpConfig::with_comm_hook). [`HookChoice`] is
//! what a [`DdpConfig`](super::DdpConfig) asks for, made into a hook each time a communication
//! thread starts.

use std::sync::Arc;

use half::{bf16, f16};

use super::{BucketShape, Compression, GradReduction, PowerSgd, PowerSgdState, PowerSgdStats};
use crate::group::ProcessGroup;
use crate::types::ReduceOp;
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

    /// `Some(op)` when [`reduce`](Self::reduce) is one all-reduce of the bucket as it is, with
    /// `op` (no compression, no layout): the transport may then run it where the bucket lies,
    /// in memory the ranks of a host share, instead of calling `reduce` (Note [Shared
    /// buckets]). `None` (the default) always calls `reduce`.
    fn plain_all_reduce(&self) -> Option<ReduceOp> {
        None
    }
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

    fn plain_all_reduce(&self) -> Option<ReduceOp> {
        (self.compression == Compression::None).then(|| self.reduction.op())
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

/// A user's communication hook for [`DdpConfig::with_comm_hook`](super::DdpConfig::with_comm_hook):
/// a function that makes a fresh [`CommHook`] each time a communication thread starts (at the
/// start, and after a change of membership of a fault-tolerant job, so every rank starts from
/// the same state). Two values are equal when they are the same function.
#[derive(Clone)]
pub struct CommHookFactory(Arc<dyn Fn() -> Box<dyn CommHook> + Send + Sync>);

impl CommHookFactory {
    /// Wraps `make`.
    pub fn new(make: impl Fn() -> Box<dyn CommHook> + Send + Sync + 'static) -> Self {
        Self(Arc::new(make))
    }

    /// A fresh hook.
    pub fn make(&self) -> Box<dyn CommHook> {
        (self.0)()
    }
}

impl std::fmt::Debug for CommHookFactory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("CommHookFactory(..)")
    }
}

impl PartialEq for CommHookFactory {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

/// The hook a [`DdpConfig`](super::DdpConfig) asks for, with PowerSGD's counts when it is on:
/// kept by a transport, and [made](Self::make) into a hook whenever its communication thread
/// starts.
#[derive(Debug, Clone)]
pub struct HookChoice {
    reduction: GradReduction,
    compression: Compression,
    power_sgd: Option<(PowerSgd, Arc<PowerSgdStats>)>,
    user: Option<CommHookFactory>,
}

impl HookChoice {
    /// What `config` asks for: its own hook ([`DdpConfig::comm_hook`](super::DdpConfig::comm_hook)),
    /// else PowerSGD, else [`AllReduce`] with its reduction and compression.
    pub fn of(config: &super::DdpConfig) -> Self {
        Self {
            reduction: config.reduction,
            compression: config.compression,
            power_sgd: config
                .power_sgd
                .map(|p| (p, Arc::new(PowerSgdStats::default()))),
            user: config.comm_hook.clone(),
        }
    }

    /// A fresh hook.
    pub fn make(&self) -> Box<dyn CommHook> {
        if let Some(user) = &self.user {
            return user.make();
        }
        match &self.power_sgd {
            Some((config, stats)) => Box::new(PowerSgdState::new(
                *config,
                self.reduction,
                Arc::clone(stats),
            )),
            None => Box::new(AllReduce {
                reduction: self.reduction,
                compression: self.compression,
            }),
        }
    }

    /// PowerSGD's counts (elements all-reduced, elements uncompressed, steps), when it is on.
    pub fn power_sgd_totals(&self) -> Option<(u64, u64, u64)> {
        self.power_sgd.as_ref().map(|(_, s)| s.totals())
    }

    /// The reduction and wire format a reduce-scattered bucket (ZeRO stage 2, which takes no
    /// hook of its own) travels with.
    pub fn wire(&self) -> (GradReduction, Compression) {
        (self.reduction, self.compression)
    }
}

/// Reduce-scatters one bucket laid out as `world` equal blocks (a [sharded](super::BucketPlan::sharded)
/// plan's, ZeRO stage 2): returns this rank's block of the reduction, cast to the wire format
/// of `compression` on the way if asked.
///
/// # Errors
/// A bucket that is not a whole number of blocks; collective failures, naming the rank at
/// fault.
pub fn scatter_bucket(
    pg: &ProcessGroup,
    data: &[f32],
    reduction: GradReduction,
    compression: Compression,
) -> Result<Vec<f32>> {
    fn on_wire<T: crate::types::Element + Default>(
        pg: &ProcessGroup,
        data: &[f32],
        op: ReduceOp,
        to: fn(f32) -> T,
        from: fn(T) -> f32,
    ) -> Result<Vec<f32>> {
        let block = data.len() / pg.world_size().as_usize();
        let send: Vec<T> = data.iter().map(|&v| to(v)).collect();
        let mut mine = vec![T::default(); block];
        pg.reduce_scatter(&send, &mut mine, op)?;
        Ok(mine.into_iter().map(from).collect())
    }
    let op = reduction.op();
    match compression {
        Compression::None => {
            let mut mine = vec![0.0f32; data.len() / pg.world_size().as_usize()];
            pg.reduce_scatter(data, &mut mine, op)?;
            Ok(mine)
        }
        Compression::F16 => on_wire(pg, data, op, f16::from_f32, f16::to_f32),
        Compression::Bf16 => on_wire(pg, data, op, bf16::from_f32, bf16::to_f32),
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
    use crate::error::ConfigError;

    use crate::grad::DdpConfig;

    #[test]
    fn power_sgd_without_a_layout_is_an_internal_error_not_a_panic() {
        let pg = ProcessGroup::single();
        let mut hook =
            HookChoice::of(&DdpConfig::default().with_power_sgd(PowerSgd::new(1))).make();
        assert!(hook.wants_layout());
        let err = hook.reduce(&pg, 0, &mut [1.0, 1.0], None).unwrap_err();
        assert!(matches!(err, DdpError::Internal { .. }), "{err:?}");
    }

    #[test]
    fn the_default_hook_reduces_without_a_layout() {
        let pg = ProcessGroup::single();
        let config = DdpConfig::default()
            .with_reduction(GradReduction::Sum)
            .with_compression(Compression::Bf16);
        let mut hook = HookChoice::of(&config).make();
        assert!(!hook.wants_layout());
        let mut data = [1.5f32, 2.0];
        hook.reduce(&pg, 0, &mut data, None).unwrap();
        assert_eq!(data, [1.5, 2.0]);
    }

    #[test]
    fn a_users_hook_is_host_staged_and_excludes_the_built_in_ones() {
        use crate::config::GradTransport;
        let hook = || {
            DdpConfig::default().with_comm_hook(|| {
                Box::new(AllReduce {
                    reduction: GradReduction::Mean,
                    compression: Compression::None,
                })
            })
        };
        hook().validate().unwrap();
        assert_eq!(hook().effective_transport(), GradTransport::Host);
        for (config, words) in [
            (hook().with_power_sgd(PowerSgd::new(1)), "PowerSGD"),
            (hook().with_compression(Compression::F16), "fp16/bf16"),
            (hook().with_transport(GradTransport::Nccl), "not Nccl"),
        ] {
            let err = config.validate().unwrap_err();
            assert!(
                matches!(&err, DdpError::Config(ConfigError::InvalidConfig { field: "DdpConfig::comm_hook", reason }) if reason.contains(words)),
                "{err:?}"
            );
        }
        let config = hook();
        assert_eq!(config.clone(), config, "a hook equals itself");
        assert_ne!(hook(), hook(), "two hooks are not equal");
    }
}
