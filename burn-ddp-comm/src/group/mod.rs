//! The process group: who this process is in the job, and the collectives it can call.
//!
//! - `mod.rs`: [`ProcessGroup`], its collectives (typed and on bytes), [`PeerWait`]
//! - `rendezvous.rs`: joining the job through the store on rank 0
//! - `desync.rs`: the check before every collective (`BURN_DDP_DEBUG_DESYNC`)
//! - `heartbeat.rs`: the heartbeat, a group service handed to the TCP communicator
//! - `sub.rs`: sub-groups ([`ProcessGroup::new_group`], [`ProcessGroup::split`])
//! - `p2p.rs`: point-to-point ([`ProcessGroup::send`], [`ProcessGroup::recv`],
//!   [`ProcessGroup::batch_send_recv`])
//!
//! The ids ([`Rank`], [`WorldSize`], ...) and [`AbortRecord`] are defined in [`crate::types`] and
//! re-exported here; the store is `store/`.

mod desync;
pub(crate) mod heartbeat;
mod p2p;
mod rendezvous;
mod sub;

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

pub use crate::config::env::DEBUG_DESYNC;
pub use crate::types::{
    AbortRecord, CollectiveSeq, LocalRank, Rank, RankList, StallDiagnosis, WorldSize,
};
use desync::DesyncCheck;
use p2p::P2p;
pub use p2p::P2pOp;
use sub::SubInfo;

use self::heartbeat::{Heartbeat, Progress};
use crate::comm::{Communicator, LocalCommunicator, TcpCommunicator};
use crate::config::{GroupConfig, JobToken, Timeouts};
use crate::types::{CollectiveDesc, CollectiveOp, Element, ReduceOp};
use crate::{DdpError, Result};

pub use crate::store::Store;
use crate::store::{StoreClient, StoreServer};

/// How long rank 0 keeps the store up at exit for ranks that are still finishing.
const DEPARTURE_GRACE: Duration = Duration::from_secs(30);

struct Inner {
    rank: Rank,
    world: WorldSize,
    local_rank: LocalRank,
    local_world: WorldSize,
    timeouts: Timeouts,
    token: JobToken,
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
    inner: Arc<Inner>,
}

impl fmt::Debug for ProcessGroup {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ProcessGroup")
            .field("rank", &self.inner.rank)
            .field("world_size", &self.inner.world)
            .field("local_rank", &self.inner.local_rank)
            .field("transport", &self.inner.comm.transport())
            .finish()
    }
}

impl ProcessGroup {
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
        config.validate()?;
        if config.world_size == WorldSize::ONE {
            return Ok(Self::single_with(config.timeouts, config.restart_count));
        }
        let desync = DesyncCheck::new(crate::config::env::debug_desync(config.debug_desync)?);
        let deadline = Instant::now() + config.timeouts.rendezvous;
        let joined = rendezvous::join(&config, deadline)?;
        let mut comm = TcpCommunicator::connect(
            Arc::clone(&joined.client),
            config.rank,
            config.world_size,
            &config.token,
            WORLD_TAG,
            deadline,
            config.timeouts,
        )
        .inspect_err(|e| rendezvous::publish(&joined.client, config.rank, None, e))?;
        let heartbeat = Heartbeat::start(
            &joined.client,
            config.rank,
            config.world_size,
            &config.token,
            config.timeouts,
            deadline,
            comm.stopper()?,
        )
        .map(Arc::new);
        if let Some(h) = &heartbeat {
            comm.watch_with(Arc::clone(h) as Arc<dyn crate::comm::PeerWatch>);
        }
        let p2p = P2p::tcp(
            &joined.client,
            &config.token,
            config.rank,
            config.world_size,
            WORLD_TAG,
        )
        .inspect_err(|e| rendezvous::publish(&joined.client, config.rank, None, e))?;
        tracing::info!(
            "[rank {}] process group ready: {} ranks over tcp (store {})",
            config.rank,
            config.world_size,
            joined.client.addr()
        );
        Ok(Self {
            inner: Arc::new(Inner {
                rank: config.rank,
                world: config.world_size,
                local_rank: config.local_rank,
                local_world: config.local_world_size,
                timeouts: config.timeouts,
                token: config.token,
                restart_count: config.restart_count,
                desync,
                tag: WORLD_TAG.into(),
                subgroups: Default::default(),
                sub: None,
                p2p,
                comm: Box::new(comm),
                heartbeat,
                store: Some(joined.client),
                server: joined.server,
            }),
        })
    }

    /// A group of one process: every collective returns at once (a mean divides by one).
    pub fn single() -> Self {
        Self::single_with(Timeouts::default(), 0)
    }

    fn single_with(timeouts: Timeouts, restart_count: u32) -> Self {
        let comm = LocalCommunicator::group(WorldSize::ONE, timeouts.collective)
            .pop()
            .map(|c| Box::new(c) as Box<dyn Communicator>);
        let comm = match comm {
            Some(c) => c,
            None => unreachable!("a local group of one has one communicator"),
        };
        Self {
            inner: Arc::new(Inner {
                rank: Rank::ZERO,
                world: WorldSize::ONE,
                local_rank: LocalRank(0),
                local_world: WorldSize::ONE,
                timeouts,
                token: JobToken::new("single"),
                restart_count,
                desync: None,
                tag: WORLD_TAG.into(),
                subgroups: Default::default(),
                sub: None,
                p2p: P2p::none(),
                comm,
                heartbeat: None,
                store: None,
                server: None,
            }),
        }
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
                Self {
                    inner: Arc::new(Inner {
                        rank,
                        world,
                        local_rank: LocalRank(rank.0),
                        local_world: world,
                        timeouts,
                        token: JobToken::new("local"),
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
                    }),
                }
            })
            .collect()
    }

    /// This process's rank.
    pub fn rank(&self) -> Rank {
        self.inner.rank
    }

    /// Number of ranks.
    pub fn world_size(&self) -> WorldSize {
        self.inner.world
    }

    /// This process's rank on its node.
    pub fn local_rank(&self) -> LocalRank {
        self.inner.local_rank
    }

    /// Number of ranks on this node.
    pub fn local_world_size(&self) -> WorldSize {
        self.inner.local_world
    }

    /// How many times the launcher restarted the job before this attempt (0: the first), from
    /// [`GroupConfig::restart_count`].
    pub fn restart_count(&self) -> u32 {
        self.inner.restart_count
    }

    /// Whether this is rank 0 (the one that logs, renders and writes checkpoints).
    pub fn is_main(&self) -> bool {
        self.inner.rank.is_zero()
    }

    /// The deadlines this group uses.
    pub fn timeouts(&self) -> Timeouts {
        self.inner.timeouts
    }

    /// The transport's name (`"tcp"`, `"local"`).
    pub fn transport(&self) -> &'static str {
        self.inner.comm.transport()
    }

    /// The prefix of this group's store keys (distinct for every sub-group).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn tag(&self) -> &str {
        &self.inner.tag
    }

    pub(crate) fn token(&self) -> &JobToken {
        &self.inner.token
    }

    pub(crate) fn store_client(&self) -> Option<&StoreClient> {
        self.inner.store.as_deref()
    }

    /// The job's rendezvous store, for small coordination data of your own (keys are kept apart
    /// from burn-ddp's). `None` for groups without a store: [`ProcessGroup::single`] and
    /// in-process groups from [`ProcessGroup::local`].
    pub fn store(&self) -> Option<Store<'_>> {
        self.store_client().map(Store::new)
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
            self.inner
                .comm
                .all_reduce(bytemuck::cast_slice_mut(buf), T::DTYPE, op),
        )
    }

    /// Copies `root`'s `buf` into every rank's `buf` (all must have the same length).
    ///
    /// # Errors
    /// `InvalidRoot`, and the errors of [`ProcessGroup::all_reduce`].
    #[track_caller]
    pub fn broadcast<T: Element>(&self, buf: &mut [T], root: Rank) -> Result<()> {
        if !self.inner.world.contains(root) {
            return Err(DdpError::InvalidRoot {
                rank: self.inner.rank,
                root,
                world: self.inner.world,
            });
        }
        self.desync(CollectiveDesc::new(CollectiveOp::Broadcast, T::DTYPE, buf.len()).root(root))?;
        self.scoped(
            self.inner
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
        let expected = send.len() * self.inner.world.as_usize();
        if recv.len() != expected {
            return Err(DdpError::BufferSize {
                rank: self.inner.rank,
                op: crate::comm::CollectiveOp::AllGather,
                what: "recv (world_size x send)",
                expected,
                got: recv.len(),
            });
        }
        self.desync(CollectiveDesc::new(
            CollectiveOp::AllGather,
            T::DTYPE,
            send.len(),
        ))?;
        self.scoped(self.inner.comm.all_gather(
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
        let world = self.inner.world.as_usize();
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
        let expected = recv.len() * self.inner.world.as_usize();
        if send.len() != expected {
            return Err(DdpError::BufferSize {
                rank: self.inner.rank,
                op: crate::comm::CollectiveOp::ReduceScatter,
                what: "send (world_size x recv)",
                expected,
                got: send.len(),
            });
        }
        self.desync(
            CollectiveDesc::new(CollectiveOp::ReduceScatter, T::DTYPE, recv.len()).reduce(op),
        )?;
        self.scoped(self.inner.comm.reduce_scatter(
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
        self.scoped(self.inner.comm.barrier())
    }

    /// The desync check of `BURN_DDP_DEBUG_DESYNC` (nothing when it is off).
    #[track_caller]
    fn desync(&self, desc: CollectiveDesc) -> Result<()> {
        match &self.inner.desync {
            Some(check) => {
                self.scoped(check.check(&*self.inner.comm, &desc, std::panic::Location::caller()))
            }
            None => Ok(()),
        }
    }

    /// Marks the group failed and closes its connections, so that every peer stops promptly.
    /// Aborting the world group aborts its sub-groups too.
    pub fn abort(&self) {
        self.inner.comm.abort();
        self.inner.p2p.close();
        if self.inner.sub.is_none() {
            if let Some(h) = &self.inner.heartbeat {
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
        let progress = self.inner.heartbeat.as_ref().map(|h| h.progress());
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
