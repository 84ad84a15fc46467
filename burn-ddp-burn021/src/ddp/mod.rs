//! Data-parallel training: the [`Ddp`] backend type, the session that owns the gradient reducer,
//! and how a model joins it. (How `Ddp<B>` implements Burn's backend traits is `backend/`, one
//! layer up: it calls the hooks here.)
//!
//! - `mod.rs`: [`Ddp`], [`DdpSession`], [`DdpConfig`] and its options
//! - `hooks.rs`: what `Ddp<B>`'s `DistributedBackend` hooks do (find the session, copy gradients
//!   into buckets, write the averaged gradients back)
//! - `reducer/`: the bucket plan and the per-backward state (`mod.rs`); how a bucket travels
//!   (`transport.rs`: `BucketTransport`, the host-staged buckets and their communication thread)
//! - `model.rs`: `DdpSession::prepare` (cross-rank check, broadcast from rank 0, marking)
//! - `buffers.rs`: `DdpSession::sync_buffers` (rank 0's buffers on every rank)
//! - `join.rs`: `DdpSession::join` (uneven inputs: ranks that ran out shadow the others)
//! - `zero.rs`: `DdpSession::zero`, the [`ZeroOptimizer`] (optimizer state sharded, ZeRO-1)
//! - `device.rs`: the device transport (`DeviceStep`): gradient buckets packed, flagged and
//!   unpacked by Burn where the gradients are, over a `DeviceLink`, counted
//! - `gpu.rs`: the NCCL link of the zero-copy path of `Autodiff<Ddp<Cuda>>` (feature `cuda`)
//!
//! A session is installed when it is created: for the whole process when its group spans
//! processes, for the creating thread when it is an in-process group (one thread per rank).

mod buffers;
// The device transport: NCCL's with `cuda`; over a stand-in link in this crate's tests.
#[cfg(any(feature = "cuda", test))]
pub(crate) mod device;
#[cfg(feature = "cuda")]
pub(crate) mod gpu;
pub(crate) mod hooks;
mod join;
mod membership;
mod model;
pub(crate) mod reducer;
mod values;
mod zero;

use std::cell::RefCell;
use std::marker::PhantomData;
use std::sync::{Arc, Mutex, MutexGuard, RwLock};

use crate::group::ProcessGroup;
use crate::Result;

pub use burn_ddp_comm::grad::{
    Compression, DdpConfig, GradReduction, LoopState, ParamInfo, PowerSgd,
};

pub(crate) use model::param_infos;
pub use model::DdpModule;
pub(crate) use reducer::Reducer;
pub(crate) use values::{float_dtype, read_f32, write_f32};
pub use zero::ZeroOptimizer;

/// The data-parallel backend decorator: `Autodiff<Ddp<B>>` trains like `Autodiff<B>`, with
/// gradients averaged across the ranks of the installed [`DdpSession`].
///
/// Every tensor operation is `B`'s own, so `Ddp<B>` computes exactly what `B` computes, with
/// `B`'s kernels. What `Ddp` adds is Burn's `DistributedBackend` hooks: under `Autodiff<Ddp<B>>`,
/// Burn hands each parameter's gradient to the session's reducer as soon as it is final, which
/// buckets, all-reduces while backward continues, and writes the averaged gradients back before
/// `backward()` returns.
#[derive(Debug, Clone, Copy, Default)]
pub struct Ddp<B>(PhantomData<B>);

/// The training backends `Autodiff<Ddp<B>>`, as one bound that generic training code can name:
/// where Burn's examples write `fn run<B: AutodiffBackend>(device: B::Device)`, write
/// `fn run<B: DdpAutodiffBackend>(device: B::Device)`, and the body keeps compiling
/// (`B::InnerBackend` is `Ddp<B::Base>`; `DdpStrategy<B::Base>` trains it).
pub trait DdpAutodiffBackend:
    burn::tensor::backend::AutodiffBackend<InnerBackend = Ddp<<Self as DdpAutodiffBackend>::Base>>
    + burn_backend::BackendTypes<
        Device = <<Self as DdpAutodiffBackend>::Base as burn_backend::BackendTypes>::Device,
    >
{
    /// The backend under `Ddp` (`NdArray`, `Cuda`, ...).
    type Base: burn_backend::Backend;
}

impl<B: burn_backend::Backend> DdpAutodiffBackend for burn::backend::Autodiff<Ddp<B>> {
    type Base = B;
}

/// A data-parallel training session: the process group, the gradient reducer, and the hooks that
/// `Autodiff<Ddp<B>>` calls during backward.
///
/// ```no_run
/// # extern crate burn_ddp_burn021 as burn_ddp;
/// # use burn::backend::{Autodiff, NdArray};
/// # use burn::module::Module;
/// # fn model<B: burn::tensor::backend::Backend>() -> burn::nn::Linear<B> {
/// #     burn::nn::LinearConfig::new(4, 4).init(&Default::default())
/// # }
/// use burn_ddp::{Ddp, DdpConfig, DdpSession, ProcessGroup};
/// type B = Autodiff<Ddp<NdArray>>;
///
/// # fn main() -> burn_ddp::Result<()> {
/// let session = DdpSession::new(ProcessGroup::from_env()?, DdpConfig::default())?;
/// let model = session.prepare(model::<B>())?; // same model on every rank, rank 0's weights
/// // ... forward on this rank's shard of the batch, then:
/// // let grads = session.backward(loss)?;      // gradients averaged over all ranks
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct DdpSession {
    shared: Arc<SessionState>,
}

#[derive(Debug)]
pub(crate) struct SessionState {
    pub(crate) pg: ProcessGroup,
    pub(crate) config: DdpConfig,
    reducer: Mutex<Reducer>,
    /// Top-level fields of the prepared model that are not synchronised (`#[ddp(skip)]`).
    pub(crate) skip: Mutex<Vec<String>>,
    /// Counts synchronised steps for the periodic comparison of the replicas.
    pub(crate) replicas: Mutex<burn_ddp_comm::grad::ReplicaCheck>,
    /// Uneven-input mode, inside [`DdpSession::join`].
    join: burn_ddp_comm::grad::JoinSlot,
    /// Waits for the work queued on the prepared model's devices (set by `prepare`), run when
    /// the last handle is dropped.
    pub(crate) drain: burn_ddp_comm::grad::DeviceDrain,
}

impl SessionState {
    pub(crate) fn reducer(&self) -> MutexGuard<'_, Reducer> {
        // A panic while the reducer is locked (in a user's backward) leaves a step half done;
        // the next `begin` discards it, so the state is safe to reuse.
        self.reducer.lock().unwrap_or_else(|p| p.into_inner())
    }
}

static GLOBAL: RwLock<Option<Arc<SessionState>>> = RwLock::new(None);

thread_local! {
    static LOCAL: RefCell<Option<Arc<SessionState>>> = const { RefCell::new(None) };
}

/// The session the hooks of this thread use: the thread's own, else the process's.
pub(crate) fn current() -> Option<Arc<SessionState>> {
    LOCAL
        .with(|l| l.borrow().clone())
        .or_else(|| GLOBAL.read().unwrap_or_else(|p| p.into_inner()).clone())
}

impl DdpSession {
    /// Joins the job this process was launched into ([`ProcessGroup::from_env`]: our issuer,
    /// torchrun, Slurm or mpirun) and creates the session over it with the default
    /// [`DdpConfig`] and the environment's choices ([`DdpConfig::from_env`]:
    /// `BURN_DDP_GRAD_TRANSPORT`): `DdpSession::new(ProcessGroup::from_env()?, DdpConfig::from_env()?)`.
    ///
    /// # Errors
    /// As [`ProcessGroup::from_env`] (a issuer's variables missing or wrong, an unreachable
    /// master), [`DdpConfig::from_env`] and [`DdpSession::new`].
    pub fn from_env() -> Result<Self> {
        Self::new(ProcessGroup::from_env()?, DdpConfig::from_env()?)
    }

    /// Sets the epoch of every training sampler made on this session's group
    /// ([`DistributedSampler::new`](crate::DistributedSampler::new)), which selects its
    /// shuffle, as the Learner strategy does: call it at the start of each epoch of a loop of
    /// your own (any integer the loop counts in). Same value on every rank.
    pub fn set_epoch(&self, epoch: impl burn_ddp_comm::data::EpochNumber) {
        burn_ddp_comm::data::set_training_epoch(&self.shared.pg, epoch);
    }

    /// Creates the session and installs it: for this process when `pg` spans processes, for
    /// this thread when `pg` is a rank of an in-process group ([`ProcessGroup::local`]). No
    /// environment variable is read here ([`DdpConfig::from_env`] and
    /// [`DdpSession::from_env`] do).
    ///
    /// # Errors
    /// An invalid configuration.
    pub fn new(pg: ProcessGroup, mut config: DdpConfig) -> Result<Self> {
        config.transport = config.effective_transport();
        config.validate()?;
        if config.power_sgd.is_some() {
            burn_ddp_comm::grad::NotCarried::PowerSgd.refuse_on(&pg)?;
        }
        let reducer = Reducer::new(&pg, &config);
        let replicas = burn_ddp_comm::grad::ReplicaCheck::new(config.check_replicas_every);
        let shared = Arc::new(SessionState {
            pg,
            config,
            reducer: Mutex::new(reducer),
            skip: Mutex::new(Vec::new()),
            replicas: Mutex::new(replicas),
            join: Default::default(),
            drain: Default::default(),
        });
        if shared.pg.transport() == "local" {
            LOCAL.with(|l| *l.borrow_mut() = Some(Arc::clone(&shared)));
        } else {
            *GLOBAL.write().unwrap_or_else(|p| p.into_inner()) = Some(Arc::clone(&shared));
        }
        Ok(Self { shared })
    }

    /// The session's process group.
    pub fn group(&self) -> &ProcessGroup {
        &self.shared.pg
    }

    /// Whether this is rank 0, the rank that prints and saves
    /// ([`main_println!`](crate::main_println)).
    pub fn is_main(&self) -> bool {
        self.shared.pg.is_main()
    }

    /// The session's configuration.
    pub fn config(&self) -> &DdpConfig {
        &self.shared.config
    }

    /// Compares across the ranks the datasets of the `DistributedSampler`s made on the group
    /// since the last comparison (`burn_ddp_comm::data::check_datasets`; nothing when none
    /// was made). [`DdpSession::backward`] and the Learner strategy call it before each step.
    ///
    /// # Errors
    /// [`ConfigError::DatasetsDiffer`](crate::ConfigError::DatasetsDiffer) naming the sampler
    /// and the ranks whose datasets differ; a failed all-gather.
    pub fn check_datasets(&self) -> Result<()> {
        burn_ddp_comm::data::check_datasets(&self.shared.pg)
    }

    /// The error of the last gradient synchronisation, if it failed. Burn's hooks cannot return
    /// errors, so a failed all-reduce during `backward()` is kept here (the gradients are then
    /// this rank's own, not averaged). [`DdpSession::backward`] checks it for you.
    ///
    /// # Errors
    /// The failure of the last synchronisation.
    pub fn check(&self) -> Result<()> {
        match self.shared.reducer().take_error() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Runs `loss.backward()` with gradient synchronisation and reports its failure, if any.
    ///
    /// # Errors
    /// A failed all-reduce (a dead or stalled rank, a timeout), naming the rank at fault.
    pub fn backward<B: burn::tensor::backend::AutodiffBackend>(
        &self,
        loss: burn::tensor::Tensor<B, 1>,
    ) -> Result<B::Gradients> {
        self.check_datasets()?;
        let grads = loss.backward();
        self.check()?;
        Ok(grads)
    }

    /// Suspends gradient synchronisation until the guard is dropped (PyTorch's `no_sync`), for
    /// gradient accumulation: run the micro-steps under the guard, accumulate their
    /// `GradientsParams`, then average the sum once with [`DdpSession::sync_gradients`].
    pub fn no_sync(&self) -> NoSyncGuard<'_> {
        self.shared.reducer().set_enabled(false);
        NoSyncGuard { session: self }
    }

    /// With PowerSGD on (`DdpConfig::with_power_sgd`): (f32 elements all-reduced, elements the
    /// same buckets hold uncompressed, steps) since the start, on this rank, for the reducer
    /// of backward passes and for [`DdpSession::sync_gradients`] together.
    pub fn power_sgd_totals(&self) -> Option<(u64, u64, u64)> {
        self.shared.reducer().power_sgd_totals()
    }

    /// What the NCCL path's backward passes have cost so far (operations Burn ran to pack and
    /// unpack buckets, transfers to the host, waits, hand-offs between threads, fusion drains
    /// and device synchronisations on the issuer thread: `burn_ddp_comm::grad::DeviceCounts`
    /// says what each counts); `None` when NCCL is not set up (host-staged). Take two readings
    /// and [`DeviceCounts::since`](burn_ddp_comm::grad::DeviceCounts::since) for what the steps
    /// between them cost.
    pub fn device_counts(&self) -> Option<burn_ddp_comm::grad::DeviceCounts> {
        self.shared.reducer().device_counts()
    }

    /// Parameters of the prepared model, in the order the reducer knows them.
    pub fn params(&self) -> Vec<ParamInfo> {
        self.shared.reducer().params()
    }

    /// Parameters that had no gradient on this rank in the last backward but one on other
    /// ranks, whose average [`DdpSession::complete`] has not registered yet.
    pub fn unsynced_params(&self) -> Vec<String> {
        self.shared.reducer().foreign()
    }

    /// Bucket layout of the prepared model: for each bucket, in launch order, the names of its
    /// parameters.
    pub fn buckets(&self) -> Vec<Vec<String>> {
        self.shared.reducer().bucket_names()
    }
}

impl Drop for DdpSession {
    fn drop(&mut self) {
        // The last handle uninstalls the session (the hooks' own Arc clones are transient).
        if Arc::strong_count(&self.shared) > 2 {
            return;
        }
        LOCAL.with(|l| {
            let mut l = l.borrow_mut();
            if l.as_ref().is_some_and(|s| Arc::ptr_eq(s, &self.shared)) {
                *l = None;
            }
        });
        let mut g = GLOBAL.write().unwrap_or_else(|p| p.into_inner());
        if g.as_ref().is_some_and(|s| Arc::ptr_eq(s, &self.shared)) {
            *g = None;
        }
        drop(g);
        self.shared.drain.run(
            self.shared.pg.rank(),
            burn_ddp_comm::grad::DEVICE_DRAIN_LIMIT,
        );
    }
}

/// While alive, backward passes keep their gradients local. See [`DdpSession::no_sync`].
#[derive(Debug)]
#[must_use = "synchronisation resumes when the guard is dropped"]
pub struct NoSyncGuard<'a> {
    session: &'a DdpSession,
}

impl Drop for NoSyncGuard<'_> {
    fn drop(&mut self) {
        self.session.shared.reducer().set_enabled(true);
    }
}

#[cfg(test)]
mod tests {
    use crate::GradTransport;

    #[test]
    fn transport_names_parse() {
        assert_eq!(GradTransport::parse("NCCL"), Some(GradTransport::Nccl));
        assert_eq!(GradTransport::parse(" host"), Some(GradTransport::Host));
        assert_eq!(GradTransport::parse("auto"), Some(GradTransport::Auto));
        assert_eq!(GradTransport::parse("gloo"), None);
    }
}
