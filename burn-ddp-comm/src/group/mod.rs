//! The process group: who this process is in the job, and the collectives it can call.
//!
//! - `mod.rs`: [`ProcessGroup`], its collectives (typed and on bytes), [`PeerWait`]
//! - `rendezvous.rs`: joining the job through the store on rank 0
//! - `desync.rs`: the check before every collective (`BURN_DDP_DEBUG_DESYNC`)
//! - `heartbeat.rs`: the heartbeat, a group service handed to the TCP communicator
//! - `sub.rs`: sub-groups ([`ProcessGroup::new_group`], [`ProcessGroup::split`])
//! - `p2p.rs`: point-to-point ([`ProcessGroup::send`], [`ProcessGroup::recv`],
//!   [`ProcessGroup::batch_send_recv`])
//! - `membership/`: fault-tolerant membership (the rule, its store records, the watcher)
//! - `handover.rs`: the state the rank ahead sends to the ranks behind after a change
//!
//! The ids ([`Rank`], [`WorldSize`], ...) and [`AbortRecord`] are defined in [`crate::types`] and
//! re-exported here; the store is `store/`.

mod desync;
pub mod handover;
pub(crate) mod heartbeat;
mod membership;
mod p2p;
mod rendezvous;
mod sub;

use crate::error::CollectiveError;
use std::fmt;
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

pub use crate::config::env::DEBUG_DESYNC;
pub use crate::types::{
    AbortRecord, CollectiveSeq, LocalRank, Rank, RankList, StallDiagnosis, WorldSize,
};
use desync::DesyncCheck;
#[cfg(test)]
pub(crate) use membership::marker_line;
pub use membership::Recovery;
pub(crate) use membership::{
    any_admitted, fresh_member_id, last_membership, marked_rank, member_list, record_first_world,
    LastMembership,
};
use p2p::P2p;
pub use p2p::P2pOp;
use sub::SubInfo;

use self::heartbeat::{Heartbeat, Progress};
use crate::comm::{Communicator, LocalCommunicator, TcpCommunicator, Tuning};
use crate::config::{Algorithm, GroupConfig, JobToken, Timeouts, Transport};
use crate::types::{CollectiveDesc, CollectiveOp, Element, ReduceOp};
use crate::{DdpError, Result};

pub use crate::store::Store;
use crate::store::{StoreClient, StoreServer};

/// The group this process joined last with [`ProcessGroup::init`] (or `from_env`), for
/// [`is_main_process`].
static PROCESS_GROUP: RwLock<Option<WeakGroup>> = RwLock::new(None);

/// Whether this process is rank 0 of the job it joined last ([`ProcessGroup::init`] or
/// `from_env`, while that group lives; in a fault-tolerant job, of the current membership), or
/// has joined none (a program run as one process). What
/// [`main_println!`](crate::main_println) asks.
pub fn is_main_process() -> bool {
    let joined = PROCESS_GROUP.read().unwrap_or_else(|p| p.into_inner());
    match joined.as_ref().and_then(WeakGroup::upgrade) {
        Some(group) => group.is_main(),
        None => true,
    }
}

/// How long rank 0 keeps the store up at exit for ranks that are still finishing.
const DEPARTURE_GRACE: Duration = Duration::from_secs(30);

struct Inner {
    rank: Rank,
    world: WorldSize,
    local_rank: LocalRank,
    local_world: WorldSize,
    timeouts: Timeouts,
    token: JobToken,
    /// How collectives between processes run (sub-groups run theirs the same way).
    algorithm: Algorithm,
    /// How ranks of one host move their bytes (sub-groups choose theirs the same way).
    transport: Transport,
    /// Which attempt of a restarted job this is.
    restart_count: u32,
    /// `BURN_DDP_DEBUG_DESYNC`: compare every collective across all ranks before running it.
    desync: Option<DesyncCheck>,
    /// The prefix of this group's store keys (`tcp/0` for the world group).
    tag: String,
    /// How many sub-groups were made from this group (their tags' numbers).
    subgroups: std::sync::atomic::AtomicU64,
    /// For a sub-group: its name, members and parent.
    sub: Option<SubInfo>,
    // Field order is drop order: links close first (so peers blocked on this rank fail at once),
    // then the store connection says goodbye, then rank 0's server stops.
    p2p: P2p,
    comm: Box<dyn Communicator>,
    /// The heartbeat, which the communicator was handed too (TCP groups only).
    heartbeat: Option<Arc<Heartbeat>>,
    store: Option<Arc<StoreClient>>,
    server: Option<StoreServer>,
}

/// The store-key prefix of the world group (its ring's keys, its point-to-point endpoints).
const WORLD_TAG: &str = "tcp/0";

/// Who serves the store a group meets through, which says what the store falling silent means.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum StoreHost {
    /// Rank 0 (a plain job): a silent store is rank 0 gone.
    RankZero,
    /// The launcher (a fault-tolerant job): a silent store means this rank is cut off from the
    /// job.
    Launcher,
}

impl Inner {
    /// The world group of `config`'s rank over the store `client` (joined already): the ring,
    /// the heartbeat, the point-to-point endpoint.
    pub(crate) fn connect(
        config: &GroupConfig,
        client: Arc<StoreClient>,
        server: Option<StoreServer>,
        host: StoreHost,
        deadline: Instant,
    ) -> Result<Self> {
        let desync = DesyncCheck::new(crate::config::env::debug_desync(config.debug_desync)?);
        let algorithm = crate::config::env::algorithm(config.algorithm)?;
        let transport = crate::config::env::transport(config.transport)?;
        let mut comm = TcpCommunicator::connect(
            Arc::clone(&client),
            config.rank,
            config.world_size,
            &config.token,
            WORLD_TAG,
            deadline,
            config.timeouts,
            Tuning {
                algorithm,
                local_world: config.local_world_size,
                transport,
            },
        )
        .inspect_err(|e| {
            rendezvous::publish(&client, config.rank, None, e);
            // As after a failed rendezvous: rank 0's store stays up until the others have read
            // the record (a rank that failed the same check, or waits for a link from this one).
            if let Some(server) = &server {
                server.linger_after_abort(config.rank);
            }
        })?;
        let heartbeat = Heartbeat::start(
            &client,
            config.rank,
            config.world_size,
            &config.token,
            config.timeouts,
            deadline,
            comm.stopper()?,
            host,
        )
        .map(Arc::new);
        if let Some(h) = &heartbeat {
            comm.watch_with(Arc::clone(h) as Arc<dyn crate::comm::PeerWatch>);
        }
        let p2p = P2p::tcp(
            &client,
            &config.token,
            (config.rank, config.world_size),
            WORLD_TAG,
            &comm.same_host(),
        )
        .inspect_err(|e| rendezvous::publish(&client, config.rank, None, e))?;
        tracing::info!(
            "[rank {}] process group ready: {} ranks over {} (store {}{})",
            config.rank,
            config.world_size,
            comm.transport(),
            client.addr(),
            client.scope().map(|s| format!(", {s}")).unwrap_or_default()
        );
        Ok(Inner {
            rank: config.rank,
            world: config.world_size,
            local_rank: config.local_rank,
            local_world: config.local_world_size,
            timeouts: config.timeouts,
            token: config.token.clone(),
            algorithm,
            transport,
            restart_count: config.restart_count,
            desync,
            tag: WORLD_TAG.into(),
            subgroups: Default::default(),
            sub: None,
            p2p,
            comm: Box::new(comm),
            heartbeat,
            store: Some(client),
            server,
        })
    }

    /// A group of one process (collectives return at once), with `store` for a fault-tolerant
    /// job's membership of one.
    pub(crate) fn single(
        timeouts: Timeouts,
        restart_count: u32,
        store: Option<(Arc<StoreClient>, LocalRank, WorldSize, JobToken)>,
    ) -> Self {
        let comm = LocalCommunicator::group(WorldSize::ONE, timeouts.collective)
            .pop()
            .map(|c| Box::new(c) as Box<dyn Communicator>);
        let comm = match comm {
            Some(c) => c,
            None => unreachable!("a local group of one has one communicator"),
        };
        let (store, local_rank, local_world, token) = match store {
            Some((s, lr, lw, t)) => (Some(s), lr, lw, t),
            None => (None, LocalRank(0), WorldSize::ONE, JobToken::new("single")),
        };
        Inner {
            rank: Rank::ZERO,
            world: WorldSize::ONE,
            local_rank,
            local_world,
            timeouts,
            token,
            algorithm: Algorithm::Auto,
            transport: Transport::Auto,
            restart_count,
            desync: None,
            tag: WORLD_TAG.into(),
            subgroups: Default::default(),
            sub: None,
            p2p: P2p::none(),
            comm,
            heartbeat: None,
            store,
            server: None,
        }
    }
}

/// How long a rank that ends normally waits for the store to take its mark of a normal end.
const FINISHED_MARK_WAIT: Duration = Duration::from_secs(2);

impl Drop for Inner {
    fn drop(&mut self) {
        if self.sub.is_some() {
            // A sub-group's links close with it; the job goes on.
            self.p2p.close();
            return;
        }
        if let Some(store) = &self.store {
            if !std::thread::panicking() {
                let _ = store.set_bounded(
                    &crate::store::finished_key(self.rank),
                    b"1",
                    FINISHED_MARK_WAIT,
                );
            }
            if std::thread::panicking() {
                let record = AbortRecord {
                    reporter: self.rank,
                    culprit: Some(self.rank),
                    collective: None,
                    reason: format!("rank {} panicked; see its output", self.rank),
                };
                let _ = store.abort(record);
            }
            self.comm.abort();
            self.p2p.close();
            if let Some(server) = &self.server {
                server.wait_for_departures(self.rank, DEPARTURE_GRACE.min(self.timeouts.store));
            }
            store.bye(Duration::from_secs(2));
        }
    }
}

/// A group of processes (or threads) that run collectives together.
///
/// Cheap to clone; all clones share the same connections. Collectives from several threads are
/// serialised in call order, and every rank must issue the same collectives in the same order.
///
/// ```no_run
/// use burn_ddp_comm::{ProcessGroup, ReduceOp};
///
/// let pg = ProcessGroup::from_env()?; // RANK, WORLD_SIZE, MASTER_ADDR, ... as torchrun sets them
/// let mut grads = vec![1.0f32; 1024];
/// pg.all_reduce(&mut grads, ReduceOp::Mean)?;
/// # Ok::<(), burn_ddp_comm::DdpError>(())
/// ```
#[derive(Clone)]
pub struct ProcessGroup {
    shared: Arc<GroupState>,
}

/// A [`ProcessGroup`] that does not keep the group alive ([`ProcessGroup::downgrade`]).
#[derive(Clone)]
pub struct WeakGroup(std::sync::Weak<GroupState>);

impl WeakGroup {
    /// The group, while some [`ProcessGroup`] handle of it is still alive.
    pub fn upgrade(&self) -> Option<ProcessGroup> {
        self.0.upgrade().map(|shared| ProcessGroup { shared })
    }

    /// Whether this is a handle on `group` (on one of its clones).
    pub fn is(&self, group: &ProcessGroup) -> bool {
        std::ptr::eq(self.0.as_ptr(), Arc::as_ptr(&group.shared))
    }
}

impl std::fmt::Debug for WeakGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self.0.strong_count() {
            0 => "WeakGroup(ended)",
            _ => "WeakGroup(alive)",
        })
    }
}

/// What every clone of a group shares: the group's current membership ([`Inner`]), which a
/// fault-tolerant group replaces when ranks leave or join (so that every clone, the reducer's
/// threads' included, moves to the new membership together), and the fault-tolerant job's
/// membership service.
struct GroupState {
    current: RwLock<Arc<Inner>>,
    membership: Option<membership::MembershipService>,
}

impl fmt::Debug for ProcessGroup {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let inner = self.inner();
        f.debug_struct("ProcessGroup")
            .field("rank", &inner.rank)
            .field("world_size", &inner.world)
            .field("local_rank", &inner.local_rank)
            .field("transport", &inner.comm.transport())
            .field("fault_tolerant", &self.shared.membership.is_some())
            .finish()
    }
}

impl ProcessGroup {
    fn from_inner(inner: Inner) -> Self {
        Self {
            shared: Arc::new(GroupState {
                current: RwLock::new(Arc::new(inner)),
                membership: None,
            }),
        }
    }

    /// The group's current membership: its ranks, links and heartbeat.
    fn inner(&self) -> Arc<Inner> {
        Arc::clone(
            &self
                .shared
                .current
                .read()
                .unwrap_or_else(|p| p.into_inner()),
        )
    }

    /// Joins the job described by the environment (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
    /// `LOCAL_WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`, as set by `burn-ddp run`, torchrun or
    /// Slurm's `srun`). Without any of them, this is a single-process group.
    ///
    /// # Errors
    /// Invalid environment values (naming the variable), and every error of [`ProcessGroup::init`].
    pub fn from_env() -> Result<Self> {
        let cfg = crate::config::env::group_config_from_env()?;
        Self::init(cfg)
    }

    /// Joins the job described by `config`: rank 0 serves the rendezvous store, every rank
    /// connects, and the ring transport is opened. A world of one needs no network.
    ///
    /// # Errors
    /// `RankOutOfRange`, `PortInUse`, `MasterUnreachable`, `TokenMismatch`, `WorldSizeMismatch`,
    /// `DuplicateRank`, `RendezvousTimeout`, ... each naming the fix.
    pub fn init(config: GroupConfig) -> Result<Self> {
        let group = Self::init_with(config)?;
        *PROCESS_GROUP.write().unwrap_or_else(|p| p.into_inner()) = Some(group.downgrade());
        Ok(group)
    }

    fn init_with(config: GroupConfig) -> Result<Self> {
        config.validate()?;
        if let Some(ft) = config.fault_tolerance.clone() {
            return membership::start(config, ft);
        }
        if config.world_size == WorldSize::ONE {
            return Ok(Self::single_with(config.timeouts, config.restart_count));
        }
        let deadline = Instant::now() + config.timeouts.rendezvous;
        let joined = rendezvous::join(&config, deadline)?;
        let inner = Inner::connect(
            &config,
            joined.client,
            joined.server,
            StoreHost::RankZero,
            deadline,
        )?;
        Ok(Self::from_inner(inner))
    }

    /// A group of one process: every collective returns at once (a mean divides by one).
    pub fn single() -> Self {
        Self::single_with(Timeouts::default(), 0)
    }

    fn single_with(timeouts: Timeouts, restart_count: u32) -> Self {
        Self::from_inner(Inner::single(timeouts, restart_count, None))
    }

    /// A group of `world` ranks inside this process, one per thread (hand each thread one
    /// element). Collectives go through shared memory.
    ///
    /// `BURN_DDP_DEBUG_DESYNC` applies as for [`ProcessGroup::init`]; a value that is neither a
    /// yes nor a no leaves the check off, with a warning.
    pub fn local(world: WorldSize, timeouts: Timeouts) -> Vec<Self> {
        let desync = crate::config::env::debug_desync(None).unwrap_or_else(|e| {
            tracing::warn!("{e}; the desync check stays off");
            false
        });
        LocalCommunicator::group(world, timeouts.collective)
            .into_iter()
            .zip(crate::comm::p2p::LocalP2p::group(world))
            .map(|(comm, p2p)| {
                let rank = comm.rank();
                Self::from_inner(Inner {
                    rank,
                    world,
                    local_rank: LocalRank(rank.0),
                    local_world: world,
                    timeouts,
                    token: JobToken::new("local"),
                    algorithm: Algorithm::Auto,
                    transport: Transport::Auto,
                    restart_count: 0,
                    desync: DesyncCheck::new(desync),
                    tag: WORLD_TAG.into(),
                    subgroups: Default::default(),
                    sub: None,
                    p2p: P2p::local(p2p),
                    comm: Box::new(comm),
                    heartbeat: None,
                    store: None,
                    server: None,
                })
            })
            .collect()
    }

    /// This process's rank.
    pub fn rank(&self) -> Rank {
        self.inner().rank
    }

    /// A handle on this group that does not keep it alive (for a registry of groups, such as
    /// the one a Burn line's layers look their group up in): the group still ends, and tells
    /// the others it finished, when the program drops its last [`ProcessGroup`].
    pub fn downgrade(&self) -> WeakGroup {
        WeakGroup(Arc::downgrade(&self.shared))
    }

    /// Number of ranks.
    pub fn world_size(&self) -> WorldSize {
        self.inner().world
    }

    /// This process's rank on its node.
    pub fn local_rank(&self) -> LocalRank {
        self.inner().local_rank
    }

    /// Number of ranks on this node.
    pub fn local_world_size(&self) -> WorldSize {
        self.inner().local_world
    }

    /// How many times the launcher restarted the job before this attempt (0: the first), from
    /// [`GroupConfig::restart_count`].
    pub fn restart_count(&self) -> u32 {
        self.inner().restart_count
    }

    /// Each rank's batch size for a global batch of `global` items: `global / world size`.
    ///
    /// With it (and the line's `DistributedSampler`), a job takes as many optimizer steps per
    /// epoch, each over `global` items, as one process with a batch of `global`: the learning
    /// rate and its schedule stay as they were. A per-rank batch of `global` instead makes the
    /// global batch `global × world size` and the steps per epoch `1 / world size` as many
    /// (scale the learning rate as for a larger batch). In an elastic job, call it again after
    /// the world size changed.
    ///
    /// # Errors
    /// [`ConfigError::UnevenGlobalBatch`](crate::ConfigError::UnevenGlobalBatch) when the ranks
    /// cannot share `global` evenly, naming the nearest sizes they can
    /// ([`config::per_rank_batch`](crate::config::per_rank_batch)).
    pub fn per_rank_batch(&self, global: usize) -> Result<usize> {
        crate::config::per_rank_batch(global, self.world_size())
    }

    /// Whether this is rank 0 (the one that logs, renders and writes checkpoints). A loop of
    /// your own prints with [`main_println!`](crate::main_println) and saves under `if
    /// group.is_main()`, so that a job prints each line and writes each file once.
    pub fn is_main(&self) -> bool {
        self.inner().rank.is_zero()
    }

    /// The mean over the ranks of `value`, each rank's own (the loss or a metric of its shard),
    /// on every rank: the job's value, which is what a loop prints. With the training sampler
    /// every rank has as many batches, so the mean of the ranks' per-batch means is the job's
    /// mean; for counts over shards of different sizes (an evaluation), use
    /// [`sum`](Self::sum). A collective: every rank calls it, rank 0 included where only it
    /// prints (`main_println!` evaluates its arguments on every rank).
    ///
    /// # Errors
    /// As [`all_reduce`](Self::all_reduce).
    #[track_caller]
    pub fn mean(&self, value: impl Into<f64>) -> Result<f64> {
        let [sum] = self.sum([value.into()])?;
        Ok(sum / f64::from(self.world_size().get()))
    }

    /// The sums over the ranks of `values` (each rank's counts, or sums of a loss over its
    /// items), on every rank: `let [correct, seen] = group.sum([correct, seen])?;` gives the
    /// job's accuracy of a sharded evaluation as `correct / seen`. A collective, as
    /// [`mean`](Self::mean).
    ///
    /// # Errors
    /// As [`all_reduce`](Self::all_reduce).
    #[track_caller]
    pub fn sum<const N: usize>(&self, mut values: [f64; N]) -> Result<[f64; N]> {
        self.all_reduce(&mut values, ReduceOp::Sum)?;
        Ok(values)
    }

    /// The deadlines this group uses.
    pub fn timeouts(&self) -> Timeouts {
        self.inner().timeouts
    }

    /// The transport's name (`"shm"`, `"tcp"`, `"local"`).
    pub fn transport(&self) -> &'static str {
        self.inner().comm.transport()
    }

    /// Runs the following collectives with `algorithm` (the bench's comparison: every rank
    /// switches at the same point).
    ///
    /// # Errors
    /// As [`Communicator::set_algorithm`].
    pub(crate) fn set_algorithm(&self, algorithm: Algorithm) -> Result<()> {
        self.inner().comm.set_algorithm(algorithm)
    }

    /// Moves the following collectives over `transport` (the bench's comparison: every rank
    /// switches at the same point).
    ///
    /// # Errors
    /// As [`Communicator::set_transport`].
    pub(crate) fn set_transport(&self, transport: Transport) -> Result<()> {
        self.inner().comm.set_transport(transport)?;
        self.inner().p2p.send_by_shm(self.transport() != "tcp");
        Ok(())
    }

    /// The prefix of this group's store keys (distinct for every sub-group).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    /// The prefix of this group's store keys, with the scope of its store connection (a
    /// fault-tolerant job's membership epoch): unique for the job's lifetime, whatever the
    /// membership.
    pub(crate) fn tag(&self) -> String {
        let inner = self.inner();
        match inner.store.as_ref().and_then(|s| s.scope()) {
            Some(scope) => format!("{scope}/{}", inner.tag),
            None => inner.tag.clone(),
        }
    }

    pub(crate) fn token(&self) -> JobToken {
        self.inner().token.clone()
    }

    /// The store connection of the group's current membership.
    pub(crate) fn store_client(&self) -> Option<Arc<StoreClient>> {
        self.inner().store.clone()
    }

    /// The job's rendezvous store, for small coordination data of your own (keys are kept apart
    /// from burn-ddp's). `None` for groups without a store: [`ProcessGroup::single`] and
    /// in-process groups from [`ProcessGroup::local`].
    pub fn store(&self) -> Option<Store> {
        match &self.shared.membership {
            // A fault-tolerant job's user keys outlive its memberships.
            Some(e) => Some(Store::new(e.store())),
            None => self.store_client().map(Store::new),
        }
    }

    /// What the store this process serves has answered so far (requests and bytes on the
    /// ranks' own connections and on their heartbeats'): rank 0 of a job whose store rank 0
    /// serves; `None` elsewhere (other ranks, a launcher's or etcd's store, groups without a
    /// store). What `burn-ddp bench scale` reads to count the store traffic of liveness.
    pub fn served_store_traffic(&self) -> Option<crate::StoreTraffic> {
        self.inner().server.as_ref().map(StoreServer::traffic)
    }

    /// Reduces `buf` across all ranks, in place: every rank ends with the same values.
    ///
    /// # Errors
    /// A dead or stalled peer, a collective mismatch, the deadline, or an earlier failure; the
    /// error names the rank at fault.
    #[track_caller]
    pub fn all_reduce<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        self.desync(CollectiveDesc::new(CollectiveOp::AllReduce, T::DTYPE, buf.len()).reduce(op))?;
        self.scoped(
            self.inner()
                .comm
                .all_reduce(bytemuck::cast_slice_mut(buf), T::DTYPE, op),
        )
    }

    /// Allocates `bytes` for every rank in memory that all ranks of this host map (a
    /// collective): `None` when the group does not run its collectives in one shared segment,
    /// or the memory could not be had (every rank gets the same answer). A rank's region is
    /// reserved until that rank drops its arena, which gives the memory back to the system.
    ///
    /// # Errors
    /// As [`ProcessGroup::all_reduce`].
    #[track_caller]
    pub(crate) fn allocate_shared(
        &self,
        bytes: usize,
    ) -> Result<Option<Arc<crate::comm::SharedArena>>> {
        self.desync(CollectiveDesc::new(
            CollectiveOp::Allocate,
            crate::DType::U8,
            bytes,
        ))?;
        self.scoped(self.inner().comm.allocate_shared(bytes))
            .map(|a| a.map(Arc::new))
    }

    /// Reduces bytes `at` (whole `T`s) of every rank's region of `arena`, where they lie: every
    /// rank's region ends with the result, as [`ProcessGroup::all_reduce`] of those values
    /// would give.
    ///
    /// # Errors
    /// As [`ProcessGroup::all_reduce`].
    #[track_caller]
    pub(crate) fn all_reduce_shared<T: Element>(
        &self,
        arena: &crate::comm::SharedArena,
        at: std::ops::Range<usize>,
        op: ReduceOp,
    ) -> Result<()> {
        let count = at.len() / T::DTYPE.size();
        self.desync(
            CollectiveDesc::new(CollectiveOp::AllReduceShared, T::DTYPE, count).reduce(op),
        )?;
        self.scoped(self.inner().comm.all_reduce_shared(arena, at, T::DTYPE, op))
    }

    /// Copies `root`'s `buf` into every rank's `buf` (all must have the same length).
    ///
    /// # Errors
    /// `InvalidRoot`, and the errors of [`ProcessGroup::all_reduce`].
    #[track_caller]
    pub fn broadcast<T: Element>(&self, buf: &mut [T], root: Rank) -> Result<()> {
        if !self.inner().world.contains(root) {
            return Err(DdpError::Collective(CollectiveError::InvalidRoot {
                rank: self.inner().rank,
                root,
                world: self.inner().world,
            }));
        }
        self.desync(CollectiveDesc::new(CollectiveOp::Broadcast, T::DTYPE, buf.len()).root(root))?;
        self.scoped(
            self.inner()
                .comm
                .broadcast(bytemuck::cast_slice_mut(buf), T::DTYPE, root),
        )
    }

    /// Gathers every rank's `send` into `recv` (`world_size * send.len()` elements, rank order).
    ///
    /// # Errors
    /// `BufferSize` if `recv` has the wrong length, and the errors of [`ProcessGroup::all_reduce`].
    #[track_caller]
    pub fn all_gather<T: Element>(&self, send: &[T], recv: &mut [T]) -> Result<()> {
        let expected = send.len() * self.inner().world.as_usize();
        if recv.len() != expected {
            return Err(DdpError::Collective(CollectiveError::BufferSize {
                rank: self.inner().rank,
                op: crate::comm::CollectiveOp::AllGather,
                what: "recv (world_size x send)",
                expected,
                got: recv.len(),
            }));
        }
        self.desync(CollectiveDesc::new(
            CollectiveOp::AllGather,
            T::DTYPE,
            send.len(),
        ))?;
        self.scoped(self.inner().comm.all_gather(
            bytemuck::cast_slice(send),
            bytemuck::cast_slice_mut(recv),
            T::DTYPE,
        ))
    }

    /// Every rank's `bytes`, in rank order; the ranks' lengths may differ. Two collectives: the
    /// lengths, then the bytes padded to the longest.
    ///
    /// # Errors
    /// The errors of [`ProcessGroup::all_gather`].
    #[track_caller]
    pub fn all_gather_bytes(&self, bytes: &[u8]) -> Result<Vec<Vec<u8>>> {
        let world = self.inner().world.as_usize();
        let mut lens = vec![0i64; world];
        self.all_gather(&[byte_len(bytes)], &mut lens)?;
        let lens: Vec<usize> = lens
            .iter()
            .map(|&l| usize::try_from(l).unwrap_or(0))
            .collect();
        let longest = lens.iter().copied().max().unwrap_or(0);
        let mut mine = bytes.to_vec();
        mine.resize(longest, 0);
        let mut all = vec![0u8; longest * world];
        self.all_gather(&mine, &mut all)?;
        Ok(lens
            .iter()
            .enumerate()
            .map(|(r, &len)| all[r * longest..r * longest + len].to_vec())
            .collect())
    }

    /// `root`'s `bytes` on every rank (the other ranks' `bytes` are ignored). Two collectives:
    /// the length, then the bytes.
    ///
    /// # Errors
    /// The errors of [`ProcessGroup::broadcast`].
    #[track_caller]
    pub fn broadcast_bytes(&self, mut bytes: Vec<u8>, root: Rank) -> Result<Vec<u8>> {
        let mut len = [byte_len(&bytes)];
        self.broadcast(&mut len, root)?;
        bytes.resize(usize::try_from(len[0]).unwrap_or(0), 0);
        self.broadcast(&mut bytes, root)?;
        Ok(bytes)
    }

    /// Reduces `send` (`world_size` blocks of `recv.len()` elements) across ranks; rank r
    /// receives block r of the result.
    ///
    /// # Errors
    /// `BufferSize` if `send` has the wrong length, and the errors of [`ProcessGroup::all_reduce`].
    #[track_caller]
    pub fn reduce_scatter<T: Element>(
        &self,
        send: &[T],
        recv: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        let expected = recv.len() * self.inner().world.as_usize();
        if send.len() != expected {
            return Err(DdpError::Collective(CollectiveError::BufferSize {
                rank: self.inner().rank,
                op: crate::comm::CollectiveOp::ReduceScatter,
                what: "send (world_size x recv)",
                expected,
                got: send.len(),
            }));
        }
        self.desync(
            CollectiveDesc::new(CollectiveOp::ReduceScatter, T::DTYPE, recv.len()).reduce(op),
        )?;
        self.scoped(self.inner().comm.reduce_scatter(
            bytemuck::cast_slice(send),
            bytemuck::cast_slice_mut(recv),
            T::DTYPE,
            op,
        ))
    }

    /// Returns once every rank has called `barrier`.
    ///
    /// # Errors
    /// As [`ProcessGroup::all_reduce`].
    #[track_caller]
    pub fn barrier(&self) -> Result<()> {
        self.desync(CollectiveDesc::new(
            CollectiveOp::Barrier,
            crate::comm::DType::I64,
            0,
        ))?;
        self.scoped(self.inner().comm.barrier())
    }

    /// The desync check of `BURN_DDP_DEBUG_DESYNC` (nothing when it is off).
    #[track_caller]
    fn desync(&self, desc: CollectiveDesc) -> Result<()> {
        match &self.inner().desync {
            Some(check) => {
                self.scoped(check.check(&*self.inner().comm, &desc, std::panic::Location::caller()))
            }
            None => Ok(()),
        }
    }

    /// Marks the group failed and closes its connections, so that every peer stops promptly.
    /// Aborting the world group aborts its sub-groups too.
    pub fn abort(&self) {
        self.inner().comm.abort();
        self.inner().p2p.close();
        if self.inner().sub.is_none() {
            if let Some(h) = &self.inner().heartbeat {
                h.stop_subgroups();
            }
        }
    }

    /// Marks this rank as waiting on its peers outside burn-ddp's host collectives (NCCL work,
    /// or your own out-of-band exchange) until the guard is dropped.
    ///
    /// Meanwhile the heartbeat watches the other ranks as it does during a collective: a rank
    /// whose heartbeat stops for the heartbeat bound (dead or frozen), or rank 0's store going
    /// silent, is named in the job's abort record, and the group's host connections are closed.
    /// A waiter that polls [`ProcessGroup::abort_record`] therefore stops within that bound
    /// instead of at its own timeout. Groups without a heartbeat (one process, threads) ignore
    /// it. Guards may nest.
    pub fn waiting_on_peers(&self) -> PeerWait {
        let progress = self.inner().heartbeat.as_ref().map(|h| h.progress());
        if let Some(p) = &progress {
            p.enter_outside();
        }
        PeerWait { progress }
    }

    /// The job's abort record, if some rank has published one.
    ///
    /// # Errors
    /// The store is unreachable.
    pub fn abort_record(&self) -> Result<Option<AbortRecord>> {
        match self.store_client() {
            Some(s) => s.abort_record(),
            None => Ok(None),
        }
    }
}

/// A byte length as the `i64` the length collectives carry (a slice never exceeds `isize::MAX`).
fn byte_len(bytes: &[u8]) -> i64 {
    i64::try_from(bytes.len()).unwrap_or(i64::MAX)
}

/// Returned by [`ProcessGroup::waiting_on_peers`]; the wait ends when it is dropped.
#[derive(Debug)]
#[must_use = "the wait is watched only while the guard lives"]
pub struct PeerWait {
    progress: Option<Arc<Progress>>,
}

impl Drop for PeerWait {
    fn drop(&mut self) {
        if let Some(p) = &self.progress {
            p.leave_outside();
        }
    }
}

/// Runs `f` on every rank of an in-process group of `world` (20-second deadlines), one thread
/// each, and returns every rank's result in rank order (a rank's panic is the caller's).
#[cfg(test)]
pub(crate) fn on_local_ranks<T: Send>(world: u32, f: impl Fn(ProcessGroup) -> T + Sync) -> Vec<T> {
    let world = WorldSize::new(world).expect("a world of at least one rank");
    let groups = ProcessGroup::local(world, Timeouts::uniform(Duration::from_secs(20)));
    std::thread::scope(|s| {
        let handles: Vec<_> = groups
            .into_iter()
            .map(|pg| {
                let f = &f;
                s.spawn(move || f(pg))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
            .collect()
    })
}

#[cfg(test)]
mod weak_tests {
    use super::*;

    #[test]
    fn a_weak_group_does_not_keep_the_group_alive() {
        let pg = ProcessGroup::single();
        let weak = pg.downgrade();
        assert_eq!(weak.upgrade().map(|g| g.rank()), Some(Rank::ZERO));
        drop(pg);
        assert!(weak.upgrade().is_none(), "{weak:?}");
    }
}
