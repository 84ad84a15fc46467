//! Ring collectives between processes over TCP.
//!
//! - `header.rs`: the header that opens each collective (sequence number + descriptor)
//! - `ring.rs`: collective plans and the streaming engine
//! - `link.rs`: connection setup through the store
//!
//! A failure on any link (a peer died, a deadline passed, a mismatch) poisons the communicator,
//! publishes an [`AbortRecord`] in the store and closes every link, so that the other ranks stop
//! within moments with an error that names the rank at fault.

pub(crate) mod header;
mod link;
pub(crate) mod ring;

use crate::error::{CollectiveError, RendezvousError};
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use self::link::{LinkSetup, Ring};
use self::ring::{Links, Plan, RingError, Side};
use super::{CollectiveDesc, CollectiveOp, Communicator, DType, PeerWatch, ReduceOp, Verdict};
use crate::config::{JobToken, Timeouts};
use crate::store::{StoreClient, WaitOutcome};
use crate::types::{AbortRecord, CollectiveSeq, Rank, RankList, StallDiagnosis, WorldSize};
use crate::{DdpError, Result};

/// How long a timed-out rank waits for the others to report that they timed out too.
const STALL_GRACE: Duration = Duration::from_secs(2);
/// How long a rank whose neighbour closed its links looks for the neighbour's mark of a normal
/// end in the store (set before the links close, so it is there already if it ever will be).
const FINISHED_WAIT: Duration = Duration::from_millis(100);

#[derive(Debug)]
struct State {
    ring: Ring,
    seq: u64,
    failed: Option<AbortRecord>,
    /// Receive scratch for reductions (u64 for alignment).
    scratch: Vec<u64>,
    /// Work buffer of reduce-scatter (kept to avoid reallocating per call).
    work: Vec<u8>,
}

/// Collectives between processes over a TCP ring (see the module docs).
#[derive(Debug)]
pub struct TcpCommunicator {
    /// This rank's place in the ring (its rank in the group).
    rank: Rank,
    world: WorldSize,
    /// This rank's global rank, which errors name.
    me: Rank,
    /// The members' global ranks, by place in the ring (`None`: the world group, place = rank).
    members: Option<Arc<[Rank]>>,
    /// The prefix of this ring's store keys.
    tag: String,
    timeout: Duration,
    store: Arc<StoreClient>,
    state: Mutex<State>,
    /// The abort flag and clones of the link sockets, so that `abort` can close them while a
    /// collective holds the state.
    links: Arc<LinkStopper>,
    /// The process group's heartbeat, once handed over ([`TcpCommunicator::watch_with`]).
    watch: Option<Arc<dyn PeerWatch>>,
}

/// What stops a [`TcpCommunicator`]'s collectives: its abort flag and clones of its link
/// sockets. The communicator holds one; the heartbeat holds another
/// ([`TcpCommunicator::stopper`]), and uses it when it finds a peer dead or stuck.
#[derive(Debug)]
pub(crate) struct LinkStopper {
    abort: Arc<AtomicBool>,
    links: Vec<TcpStream>,
}

impl LinkStopper {
    /// Marks the communicator aborted and shuts its links, which ends the collective in progress
    /// at once.
    pub(crate) fn stop(&self) {
        self.abort.store(true, Ordering::SeqCst);
        self.close();
    }

    /// Shuts the links (without marking the communicator aborted).
    fn close(&self) {
        for l in &self.links {
            let _ = l.shutdown(Shutdown::Both);
        }
    }

    /// Another handle on the same flag and links.
    fn try_clone(&self) -> std::io::Result<Self> {
        let mut links = Vec::with_capacity(self.links.len());
        for l in &self.links {
            links.push(l.try_clone()?);
        }
        Ok(Self {
            abort: Arc::clone(&self.abort),
            links,
        })
    }
}

impl TcpCommunicator {
    /// Opens the ring links of a group of `world >= 2` ranks through the store.
    pub(crate) fn connect(
        store: Arc<StoreClient>,
        rank: Rank,
        world: WorldSize,
        token: &JobToken,
        tag: &str,
        rendezvous_deadline: Instant,
        timeouts: Timeouts,
    ) -> Result<Self> {
        let ring = link::open_ring(&LinkSetup {
            store: &store,
            rank,
            world,
            token,
            tag,
            deadline: rendezvous_deadline,
        })?;
        ring.next.set_nonblocking(true)?;
        let mut handles = vec![ring.next.try_clone()?];
        if let Some(prev) = &ring.prev {
            prev.set_nonblocking(true)?;
            handles.push(prev.try_clone()?);
        }
        Ok(Self {
            rank,
            world,
            me: rank,
            members: None,
            tag: tag.to_string(),
            timeout: timeouts.collective,
            store,
            state: Mutex::new(State {
                ring,
                seq: 0,
                failed: None,
                scratch: vec![0u64; ring::SCRATCH / 8],
                work: Vec::new(),
            }),
            links: Arc::new(LinkStopper {
                abort: Arc::new(AtomicBool::new(false)),
                links: handles,
            }),
            watch: None,
        })
    }

    /// Makes this the ring of a sub-group whose places hold the global ranks `members` (errors
    /// and abort records name global ranks).
    pub(crate) fn with_members(mut self, members: Arc<[Rank]>) -> Self {
        self.me = members[self.rank.index()];
        self.members = Some(members);
        self
    }

    /// The global rank at ring place `place`.
    fn global(&self, place: Rank) -> Rank {
        match &self.members {
            Some(m) => m.get(place.index()).copied().unwrap_or(place),
            None => place,
        }
    }

    /// Hands this communicator the group's watch on the other ranks: it is told of every
    /// collective, and names the culprit when it stopped one.
    pub(crate) fn watch_with(&mut self, watch: Arc<dyn PeerWatch>) {
        self.watch = Some(watch);
    }

    /// A handle that stops this communicator's collectives from another thread.
    ///
    /// # Errors
    /// A link socket could not be cloned.
    pub(crate) fn stopper(&self) -> Result<LinkStopper> {
        Ok(self.links.try_clone()?)
    }

    /// A handle that stops this communicator's collectives while it exists (a sub-group's ring,
    /// which the process's heartbeat stops on a verdict without keeping its sockets open).
    pub(crate) fn weak_stopper(&self) -> std::sync::Weak<LinkStopper> {
        Arc::downgrade(&self.links)
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // The state's invariants are re-established at the start of every collective.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn neighbour(&self, side: Side) -> Rank {
        let (next, prev) = ring::neighbours(self.rank, self.world.get());
        self.global(match side {
            Side::Next => next,
            Side::Prev => prev,
        })
    }

    /// Runs `plan` over `buf` as collective `desc`.
    fn run(
        &self,
        st: &mut State,
        desc: &CollectiveDesc,
        buf: &mut [u8],
        plan: &Plan,
    ) -> Result<()> {
        if let Some(first) = &st.failed {
            return Err(DdpError::Collective(CollectiveError::GroupAborted {
                rank: self.me,
                first: Box::new(first.clone()),
            }));
        }
        st.seq += 1;
        let seq = CollectiveSeq(st.seq);
        let links = Links {
            next: &st.ring.next,
            prev: st.ring.prev.as_ref().unwrap_or(&st.ring.next),
            same: st.ring.prev.is_none(),
        };
        let span = tracing::trace_span!("collective", rank = self.me.0, seq = seq.0, op = %desc.op);
        let _enter = span.enter();
        let deadline = Instant::now() + self.timeout;
        let scratch: &mut [u8] = bytemuck::cast_slice_mut(st.scratch.as_mut_slice());
        if let Some(w) = &self.watch {
            w.enter(seq);
        }
        let result = ring::run(
            links,
            buf,
            plan,
            seq,
            desc,
            scratch,
            deadline,
            &self.links.abort,
        );
        // On failure the watch keeps judging this wait until the failure is named (`fail` may
        // wait for its verdict), then the collective ends.
        let result = result.map_err(|e| self.fail(st, desc, seq, e));
        if let Some(w) = &self.watch {
            w.leave(seq, result.is_ok());
        }
        result
    }

    /// The watch's verdict, waited for up to its bound (`None` without a watch).
    fn await_verdict(&self) -> Option<Verdict> {
        let w = self.watch.as_ref()?;
        let deadline = Instant::now() + w.bound();
        loop {
            if let Some(v) = w.verdict() {
                return Some(v);
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Turns an engine failure into the error to report, publishes it, and closes the links.
    fn fail(
        &self,
        st: &mut State,
        desc: &CollectiveDesc,
        seq: CollectiveSeq,
        e: RingError,
    ) -> DdpError {
        let op = desc.op;
        let unresponsive = |st: &mut State, v: Verdict| {
            let err = DdpError::Collective(CollectiveError::RankUnresponsive {
                rank: self.me,
                culprit: v.culprit,
                host: v.host,
                last_completed: v.last_completed,
                op,
                seq,
                what: v.what,
            });
            self.publish(st, op, seq, Some(v.culprit), err)
        };
        if let Some(v) = self.watch.as_ref().and_then(|w| w.verdict()) {
            return unresponsive(st, v);
        }
        // A neighbour that closed its links may only be reacting to a failure elsewhere; the
        // store holds the first report, which names the real culprit. That report may carry this
        // rank's number without coming from this collective: the store hosted here records a
        // rank whose connection dropped, and the others may have seen it and left first.
        let published = match &e {
            RingError::Closed(..) | RingError::Aborted => match self.store.abort_record() {
                Ok(record) => record,
                // The store is silent (rank 0 frozen): the neighbour left on its own heartbeat's
                // verdict, and this rank's heartbeat reaches the same one within its bound.
                Err(DdpError::Rendezvous(RendezvousError::StoreTimeout { .. })) => {
                    if let Some(v) = self.await_verdict() {
                        return unresponsive(st, v);
                    }
                    None
                }
                Err(_) => None,
            },
            _ => None,
        };
        let (err, culprit) = match (published, e) {
            (Some(record), _) if record.reporter != self.me || record.culprit.is_some() => {
                let culprit = record.culprit;
                (
                    DdpError::Collective(CollectiveError::JobAborted {
                        rank: self.me,
                        during: Some((op, seq)),
                        record,
                    }),
                    culprit,
                )
            }
            (_, RingError::Closed(side, io)) => {
                let peer = self.neighbour(side);
                // A neighbour that ended normally left its mark in the store before closing.
                let finished = self
                    .store
                    .get_timeout(&crate::store::finished_key(peer), FINISHED_WAIT)
                    .is_ok();
                if finished {
                    let err = DdpError::Collective(CollectiveError::PeerFinished {
                        rank: self.me,
                        peer,
                        op,
                        seq,
                    });
                    return self.publish(st, op, seq, Some(peer), err);
                }
                (
                    DdpError::Collective(CollectiveError::PeerLost {
                        rank: self.me,
                        peer,
                        op,
                        seq,
                        cause: io.kind(),
                    }),
                    Some(peer),
                )
            }
            (_, RingError::Timeout(side)) => {
                let diagnosis = self.diagnose_stall(seq, self.neighbour(side));
                let culprit = diagnosis.culprit();
                (
                    DdpError::Collective(CollectiveError::CollectiveTimeout {
                        rank: self.me,
                        op,
                        seq,
                        waited: self.timeout,
                        diagnosis,
                    }),
                    Some(culprit),
                )
            }
            (_, RingError::Mismatch(their_seq, theirs)) => {
                let peer = self.neighbour(Side::Prev);
                (
                    DdpError::Collective(CollectiveError::CollectiveMismatch {
                        rank: self.me,
                        peer,
                        seq,
                        their_seq,
                        ours: *desc,
                        theirs,
                    }),
                    None,
                )
            }
            (_, RingError::Protocol(error)) => {
                let peer = st
                    .ring
                    .prev
                    .as_ref()
                    .unwrap_or(&st.ring.next)
                    .peer_addr()
                    .unwrap_or_else(|_| self.store.addr());
                (
                    DdpError::Rendezvous(RendezvousError::Protocol {
                        rank: self.me,
                        peer,
                        error,
                    }),
                    Some(self.neighbour(Side::Prev)),
                )
            }
            (_, RingError::Aborted) => (
                DdpError::Collective(CollectiveError::GroupAborted {
                    rank: self.me,
                    first: Box::new(AbortRecord {
                        reporter: self.me,
                        culprit: None,
                        collective: Some((op, seq)),
                        reason: "the group was aborted locally".into(),
                    }),
                }),
                None,
            ),
        };
        self.publish(st, op, seq, culprit, err)
    }

    /// Publishes this rank's failure (unless it only repeats another rank's), marks the group
    /// failed and closes the links.
    fn publish(
        &self,
        st: &mut State,
        op: CollectiveOp,
        seq: CollectiveSeq,
        culprit: Option<Rank>,
        err: DdpError,
    ) -> DdpError {
        let record = AbortRecord {
            reporter: self.me,
            culprit,
            collective: Some((op, seq)),
            reason: err.to_string(),
        };
        if !matches!(
            err,
            DdpError::Collective(CollectiveError::JobAborted { .. })
        ) {
            if let Err(store_err) = self.store.abort(record.clone()) {
                tracing::debug!(
                    "[rank {}] could not publish the failure: {store_err}",
                    self.me
                );
            }
        }
        tracing::debug!("{err}");
        st.failed = Some(record);
        self.links.close();
        err
    }

    /// After a timeout: records in the store that this rank waited at `seq`, gives the other
    /// ranks a moment to do the same, and names those that did not: they never got there.
    fn diagnose_stall(&self, seq: CollectiveSeq, neighbour: Rank) -> StallDiagnosis {
        let key = |r: Rank| format!("{}/stall/{}/{r}", self.tag, seq.0);
        if self.store.set(&key(self.me), b"waited").is_err() {
            return StallDiagnosis::Unknown { neighbour };
        }
        let ranks: Vec<Rank> = self.world.ranks().map(|p| self.global(p)).collect();
        let keys: Vec<String> = ranks.iter().map(|&r| key(r)).collect();
        match self.store.wait(&keys, STALL_GRACE) {
            Ok(WaitOutcome::Ready) => StallDiagnosis::AllWaiting { neighbour },
            Ok(WaitOutcome::Missing(missing)) => StallDiagnosis::Stalled(RankList(
                ranks
                    .into_iter()
                    .filter(|r| missing.contains(&key(*r)))
                    .collect(),
            )),
            // The store reports the abort another rank already published (it names the culprit).
            Err(DdpError::Collective(CollectiveError::JobAborted { record, .. })) => {
                match record.culprit {
                    Some(c) => StallDiagnosis::Stalled(RankList(vec![c])),
                    None => StallDiagnosis::Unknown { neighbour },
                }
            }
            Err(_) => StallDiagnosis::Unknown { neighbour },
        }
    }
}

impl Communicator for TcpCommunicator {
    fn rank(&self) -> Rank {
        self.rank
    }

    fn world_size(&self) -> WorldSize {
        self.world
    }

    fn transport(&self) -> &'static str {
        "tcp"
    }

    fn all_reduce(&self, buf: &mut [u8], dtype: DType, op: ReduceOp) -> Result<()> {
        let count = buf.len() / dtype.size();
        let desc = CollectiveDesc::new(CollectiveOp::AllReduce, dtype, count).reduce(op);
        let plan = ring::all_reduce(self.rank.index(), self.world.as_usize(), count, dtype, op);
        let mut st = self.lock();
        self.run(&mut st, &desc, buf, &plan)
    }

    fn broadcast(&self, buf: &mut [u8], dtype: DType, root: Rank) -> Result<()> {
        let count = buf.len() / dtype.size();
        let desc = CollectiveDesc::new(CollectiveOp::Broadcast, dtype, count).root(root);
        let plan = ring::broadcast(
            self.rank.index(),
            self.world.as_usize(),
            root.index(),
            buf.len(),
        );
        let mut st = self.lock();
        self.run(&mut st, &desc, buf, &plan)
    }

    fn all_gather(&self, send: &[u8], recv: &mut [u8], dtype: DType) -> Result<()> {
        let block = send.len();
        let r = self.rank.index();
        recv[r * block..(r + 1) * block].copy_from_slice(send);
        let desc = CollectiveDesc::new(CollectiveOp::AllGather, dtype, block / dtype.size());
        let plan = ring::all_gather(r, self.world.as_usize(), block);
        let mut st = self.lock();
        self.run(&mut st, &desc, recv, &plan)
    }

    fn reduce_scatter(
        &self,
        send: &[u8],
        recv: &mut [u8],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<()> {
        let block = recv.len() / dtype.size();
        let desc = CollectiveDesc::new(CollectiveOp::ReduceScatter, dtype, block).reduce(op);
        let plan = ring::reduce_scatter(self.rank.index(), self.world.as_usize(), block, dtype, op);
        let mut st = self.lock();
        let mut work = std::mem::take(&mut st.work);
        work.clear();
        work.extend_from_slice(send);
        let result = self.run(&mut st, &desc, &mut work, &plan);
        if result.is_ok() {
            let r = self.rank.index();
            recv.copy_from_slice(&work[r * recv.len()..(r + 1) * recv.len()]);
        }
        st.work = work;
        result
    }

    fn barrier(&self) -> Result<()> {
        let mut one = 1i32.to_le_bytes();
        let desc = CollectiveDesc::new(CollectiveOp::Barrier, DType::I32, 1);
        let plan = ring::all_reduce(
            self.rank.index(),
            self.world.as_usize(),
            1,
            DType::I32,
            ReduceOp::Sum,
        );
        let mut st = self.lock();
        self.run(&mut st, &desc, &mut one, &plan)
    }

    fn abort(&self) {
        self.links.stop();
    }
}

impl Drop for TcpCommunicator {
    fn drop(&mut self) {
        self.links.close();
    }
}
