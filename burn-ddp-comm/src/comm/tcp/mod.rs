//! Ring collectives between processes over TCP.
//!
//! - `header.rs`: the header that opens each collective (sequence number + descriptor)
//! - `ring.rs`: collective plans and the streaming engine
//! - `tree.rs`: recursive doubling, for small all-reduces and barriers (log n steps), run by the
//!   same engine over links of its own
//! - `link.rs`: connection setup through the store
//! - `shm/`: collectives through memory shared by ranks of one host, which keep their links
//!   (to learn of a peer's death, and to stop the others on a failure); for a group spread over
//!   hosts with as many ranks on each, large all-reduces in two levels: shared memory inside
//!   each host, a ring per local index across hosts
//!
//! A failure on any link (a peer died, a deadline passed, a mismatch) poisons the communicator,
//! publishes an [`AbortRecord`] in the store and closes every link, so that the other ranks stop
//! within moments with an error that names the rank at fault.

pub(crate) mod header;
mod link;
pub(crate) mod ring;
mod shm;
mod tree;

use crate::error::{CollectiveError, RendezvousError};
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use self::link::{LinkSetup, Ring};
use self::ring::{Links, Plan, RecvMode, RecvSeg, RingError, SendSeg, Side, Waits};
pub use self::shm::SharedArena;
use self::shm::{Hierarchy, Segment, Shm, ShmError};
use self::tree::Step;
use super::{CollectiveDesc, CollectiveOp, Communicator, DType, PeerWatch, ReduceOp, Verdict};
use crate::comm::reduce::{split, Finish};
use crate::config::{Algorithm, Transport, TREE_MAX_BYTES, TREE_MAX_BYTES_2};
use crate::config::{JobToken, Timeouts};
use crate::error::ConfigError;
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
    /// The links of recursive doubling, by place (`None` for ranks this one never exchanges
    /// with, and for all under [`Algorithm::Ring`]).
    tree: Vec<Option<TcpStream>>,
    /// The algorithm collectives run with now (the connected one, or the bench's choice).
    algorithm: Algorithm,
    seq: u64,
    failed: Option<AbortRecord>,
    /// Receive scratch for reductions (u64 for alignment).
    scratch: Vec<u64>,
    /// Work buffer of reduce-scatter (kept to avoid reallocating per call).
    work: Vec<u8>,
    /// Recursive doubling's buffer: the running result, then the copy of it being sent (u64 for
    /// alignment).
    exchange: Vec<u64>,
    /// The memory shared with the group's other ranks (all of them, or those of this host),
    /// when they agreed to use it.
    shm: Option<Segment>,
}

/// How a [`TcpCommunicator`] runs its collectives, the same on every rank of a group.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Tuning {
    /// The algorithm (resolved from `BURN_DDP_ALGO` already).
    pub algorithm: Algorithm,
    /// How many ranks run on this host: more than its cores, and the engine sleeps at once
    /// instead of spinning first.
    pub local_world: WorldSize,
    /// The transport between ranks of one host (resolved from `BURN_DDP_TRANSPORT` already).
    pub transport: Transport,
}

/// Where an engine failure happened: the peers on either side of the link (by place) and the
/// link it received on, whose address the error names (looked up only then).
#[derive(Debug, Clone, Copy)]
struct Hop {
    next: Rank,
    prev: Rank,
    /// The receiving link.
    prev_link: Via,
}

/// Which of a rank's links something came in on.
#[derive(Debug, Clone, Copy)]
enum Via {
    /// The ring's.
    Ring,
    /// Recursive doubling's, to this place.
    Tree(usize),
    /// The ring across hosts of a [`Hierarchy`].
    Across,
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
    /// How long the engine spins before it sleeps ([`Waits::spin`]).
    spin: Duration,
    /// Whether collectives run in the shared segment now (it exists, and the bench did not
    /// switch to TCP).
    on_shm: AtomicBool,
    /// The transport's name with the segment: `shm` (the whole group), `shm+tcp` (per host).
    shared: &'static str,
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
    /// Opens the links of a group of `world >= 2` ranks through the store: the ring's, and
    /// recursive doubling's unless `tuning` says [`Algorithm::Ring`].
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn connect(
        store: Arc<StoreClient>,
        rank: Rank,
        world: WorldSize,
        token: &JobToken,
        tag: &str,
        rendezvous_deadline: Instant,
        timeouts: Timeouts,
        tuning: Tuning,
    ) -> Result<Self> {
        let setup = LinkSetup {
            store: &store,
            rank,
            world,
            token,
            tag,
            deadline: rendezvous_deadline,
        };
        let ring = link::open_ring(&setup)?;
        let tree = link::open_tree(&setup, tuning.algorithm)?;
        let shm = shm::open(&setup, tuning.transport)?;
        ring.next.set_nonblocking(true)?;
        let mut handles = vec![ring.next.try_clone()?];
        if let Some(prev) = &ring.prev {
            prev.set_nonblocking(true)?;
            handles.push(prev.try_clone()?);
        }
        for link in tree.iter().flatten() {
            link.set_nonblocking(true)?;
            handles.push(link.try_clone()?);
        }
        if let Some(Segment::PerHost(h)) = &shm {
            for link in std::iter::once(&h.cross.next).chain(&h.cross.prev) {
                link.set_nonblocking(true)?;
                handles.push(link.try_clone()?);
            }
        }
        let on_shm = shm.is_some();
        let shared = match &shm {
            Some(Segment::PerHost(_)) => "shm+tcp",
            _ => "shm",
        };
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let spin = if tuning.local_world.as_usize() > cores {
            Duration::ZERO
        } else {
            ring::SPIN
        };
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
                tree,
                algorithm: tuning.algorithm,
                seq: 0,
                failed: None,
                scratch: vec![0u64; ring::SCRATCH / 8],
                work: Vec::new(),
                exchange: Vec::new(),
                shm,
            }),
            links: Arc::new(LinkStopper {
                abort: Arc::new(AtomicBool::new(false)),
                links: handles,
            }),
            watch: None,
            spin,
            on_shm: AtomicBool::new(on_shm),
            shared,
        })
    }

    /// Makes this the ring of a sub-group whose places hold the global ranks `members` (errors
    /// and abort records name global ranks).
    pub(crate) fn with_members(mut self, members: Arc<[Rank]>) -> Self {
        self.me = members[self.rank.index()];
        self.members = Some(members);
        self
    }

    /// The places of the group that share this rank's segment (every place, or those of its
    /// host in a hierarchy; none without one): point-to-point reaches them through shared
    /// memory.
    pub(crate) fn same_host(&self) -> Vec<Rank> {
        match &self.lock().shm {
            Some(Segment::Whole(_)) => self.world.ranks().collect(),
            Some(Segment::PerHost(h)) => h.local.iter().map(|&p| Rank(p as u32)).collect(),
            None => Vec::new(),
        }
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

    /// The ring's hop: the neighbours of this rank's place.
    fn ring_hop(&self) -> Hop {
        let (next, prev) = ring::neighbours(self.rank, self.world.get());
        Hop {
            next,
            prev,
            prev_link: Via::Ring,
        }
    }

    /// Whether an all-reduce, broadcast or all-gather of `bytes` (the whole buffer) runs by
    /// recursive doubling.
    fn by_tree(&self, st: &State, bytes: usize) -> bool {
        match st.algorithm {
            Algorithm::Ring => false,
            Algorithm::Tree => true,
            Algorithm::Auto if self.world.get() == 2 => bytes <= TREE_MAX_BYTES_2,
            Algorithm::Auto => bytes <= TREE_MAX_BYTES,
        }
    }

    /// Runs collective `desc` as `body` does it: numbers it, tells the watch, and turns a
    /// failure into the error to report.
    fn collective(
        &self,
        st: &mut State,
        desc: &CollectiveDesc,
        body: impl FnOnce(
            &mut State,
            CollectiveSeq,
            Waits<'_>,
        ) -> std::result::Result<(), (RingError, Hop)>,
    ) -> Result<()> {
        if let Some(first) = &st.failed {
            return Err(DdpError::Collective(CollectiveError::GroupAborted {
                rank: self.me,
                first: Box::new(first.clone()),
            }));
        }
        st.seq += 1;
        let seq = CollectiveSeq(st.seq);
        let span = tracing::trace_span!("collective", rank = self.me.0, seq = seq.0, op = %desc.op);
        let _enter = span.enter();
        if let Some(w) = &self.watch {
            w.enter(seq);
        }
        let waits = Waits {
            deadline: Instant::now() + self.timeout,
            abort: &self.links.abort,
            spin: self.spin,
            foreign: &[],
        };
        let result = body(st, seq, waits);
        // On failure the watch keeps judging this wait until the failure is named (`fail` may
        // wait for its verdict), then the collective ends.
        let result = result.map_err(|(e, hop)| self.fail(st, desc, seq, e, hop));
        if let Some(w) = &self.watch {
            w.leave(seq, result.is_ok());
        }
        result
    }

    /// Runs `plan` over `buf` on the ring as collective `desc`.
    fn run(
        &self,
        st: &mut State,
        desc: &CollectiveDesc,
        buf: &mut [u8],
        plan: &Plan,
    ) -> Result<()> {
        self.collective(st, desc, |st, seq, waits| {
            let hop = self.ring_hop();
            let links = engine_links(&st.ring);
            let foreign: Vec<(&TcpStream, usize)> = tree_links(&st.tree).collect();
            let scratch: &mut [u8] = bytemuck::cast_slice_mut(st.scratch.as_mut_slice());
            let waits = Waits {
                foreign: &foreign,
                ..waits
            };
            ring::run(links, buf, plan, (seq, desc), scratch, waits).map_err(|e| (e, hop))
        })
    }

    /// Runs `moves` (a broadcast or an all-gather of `tree.rs`) over `buf` as collective
    /// `desc`: each one `ring::run` over the partner's link, copying only.
    fn run_moves(
        &self,
        st: &mut State,
        desc: &CollectiveDesc,
        buf: &mut [u8],
        moves: &[tree::Move],
    ) -> Result<()> {
        self.collective(st, desc, |st, seq, waits| {
            let ring_hop = self.ring_hop();
            let State {
                ring,
                tree,
                scratch,
                ..
            } = st;
            let foreign = ring_links(ring, &ring_hop);
            let waits = Waits {
                foreign: &foreign,
                ..waits
            };
            let scratch: &mut [u8] = bytemuck::cast_slice_mut(scratch.as_mut_slice());
            for m in moves {
                let (link, hop) = partner_link(tree, m.peer)?;
                let plan = Plan {
                    sends: m
                        .send
                        .iter()
                        .map(|r| SendSeg {
                            range: r.clone(),
                            gate: None,
                        })
                        .collect(),
                    recvs: m
                        .recv
                        .iter()
                        .map(|r| RecvSeg {
                            range: r.clone(),
                            mode: RecvMode::Copy,
                        })
                        .collect(),
                };
                let links = Links {
                    next: link,
                    prev: link,
                    same: true,
                };
                ring::run(links, buf, &plan, (seq, desc), scratch, waits).map_err(|e| (e, hop))?;
            }
            Ok(())
        })
    }

    /// All-reduces `buf` (`count` elements) by recursive doubling as collective `desc` (see
    /// `tree.rs`): each step one `ring::run` over the partner's link.
    fn run_tree(&self, st: &mut State, desc: &CollectiveDesc, buf: &mut [u8]) -> Result<()> {
        let rank = self.rank.index();
        let world = self.world.as_usize();
        let op = desc.reduce;
        self.collective(st, desc, |st, seq, waits| {
            let ring_hop = self.ring_hop();
            let State {
                ring,
                tree,
                exchange,
                scratch,
                ..
            } = st;
            let len = buf.len();
            exchange.resize((2 * len).div_ceil(8).max(1), 0);
            let work: &mut [u8] = &mut bytemuck::cast_slice_mut(exchange.as_mut_slice())[..2 * len];
            work[..len].copy_from_slice(buf);
            let scratch: &mut [u8] = bytemuck::cast_slice_mut(scratch.as_mut_slice());
            let foreign = ring_links(ring, &ring_hop);
            let waits = Waits {
                foreign: &foreign,
                ..waits
            };
            let steps = tree::schedule(rank, world);
            let last_exchange = steps.iter().rposition(|s| matches!(s, Step::Exchange(_)));
            for (i, &step) in steps.iter().enumerate() {
                let (link, hop) = partner_link(tree, step.peer())?;
                let finish = match (op, Some(i) == last_exchange) {
                    (ReduceOp::Mean, true) => Finish::DivideBy(world as u32),
                    _ => Finish::None,
                };
                let whole = 0..len;
                let reduce = RecvSeg {
                    range: whole.clone(),
                    mode: RecvMode::Reduce(op, finish),
                };
                let send = |range| SendSeg { range, gate: None };
                let plan = match step {
                    Step::Give(_) | Step::Return(_) => Plan {
                        sends: vec![send(whole)],
                        recvs: vec![],
                    },
                    Step::Take(_) => Plan {
                        sends: vec![],
                        recvs: vec![reduce],
                    },
                    Step::Receive(_) => Plan {
                        sends: vec![],
                        recvs: vec![RecvSeg {
                            range: whole,
                            mode: RecvMode::Copy,
                        }],
                    },
                    // What goes out is a copy: what comes in is combined into the running
                    // result while it is still being sent.
                    Step::Exchange(_) => {
                        work.copy_within(0..len, len);
                        Plan {
                            sends: vec![send(len..2 * len)],
                            recvs: vec![reduce],
                        }
                    }
                };
                let links = Links {
                    next: link,
                    prev: link,
                    same: true,
                };
                ring::run(links, work, &plan, (seq, desc), scratch, waits).map_err(|e| (e, hop))?;
            }
            buf.copy_from_slice(&work[..len]);
            Ok(())
        })
    }

    /// Runs collective `desc` in the shared segment as `body` does it (see `shm/`); the group's
    /// links are watched for a peer's end meanwhile.
    fn run_shm(
        &self,
        st: &mut State,
        desc: &CollectiveDesc,
        body: impl FnOnce(
            &mut Shm,
            (CollectiveSeq, &CollectiveDesc),
            &shm::Watch<'_>,
        ) -> std::result::Result<(), ShmError>,
    ) -> Result<()> {
        self.collective(st, desc, |st, seq, waits| {
            let hop = self.ring_hop();
            let State {
                ring, tree, shm, ..
            } = st;
            let mut links = ring_links(ring, &hop);
            links.extend(tree_links(tree));
            let watch = shm::Watch {
                deadline: waits.deadline,
                abort: waits.abort,
                spin: waits.spin,
                links: &links,
                busy: false,
            };
            let Some(Segment::Whole(shm)) = shm else {
                let e = std::io::Error::new(std::io::ErrorKind::NotConnected, "no shared segment");
                return Err((RingError::Closed(Side::Next, e), hop));
            };
            body(shm, (seq, desc), &watch).map_err(|e| shm_failure(e, |q| q, hop))
        })
    }

    /// All-reduces `buf` in a [`Hierarchy`] as collective `desc` (Note [Hierarchical
    /// all-reduce]): reduce-scatter in this host's segment, this rank's part all-reduced on its
    /// ring across hosts, all-gather in the segment.
    fn run_hier(
        &self,
        st: &mut State,
        desc: &CollectiveDesc,
        buf: &mut [u8],
        (dtype, op): (DType, ReduceOp),
    ) -> Result<()> {
        let world = self.world.as_usize();
        self.collective(st, desc, |st, seq, waits| {
            let hop = self.ring_hop();
            let State {
                ring,
                tree,
                shm,
                work,
                scratch,
                ..
            } = st;
            let Some(Segment::PerHost(h)) = shm else {
                let e = std::io::Error::new(std::io::ErrorKind::NotConnected, "no hierarchy");
                return Err((RingError::Closed(Side::Next, e), hop));
            };
            let Hierarchy {
                shm,
                cross,
                local,
                across,
                host,
            } = h;
            let (index, per_host, hosts) = (shm.place(), shm.world(), across.len());
            let cross_hop = {
                let (next, prev) = ring::neighbours(Rank(*host as u32), hosts as u32);
                Hop {
                    next: Rank(across[next.index()] as u32),
                    prev: Rank(across[prev.index()] as u32),
                    prev_link: Via::Across,
                }
            };
            // The flat links (idle now, but a peer may already send its next collective there)
            // and the ring across hosts tell of a peer's end.
            let mut flat = ring_links(ring, &hop);
            flat.extend(tree_links(tree));
            let mut watched = flat.clone();
            watched.extend(ring_links(cross, &cross_hop));
            let watch = shm::Watch {
                deadline: waits.deadline,
                abort: waits.abort,
                spin: waits.spin,
                links: &watched,
                busy: true,
            };
            let in_host = |e| shm_failure(e, |q| local[q], hop);
            let elem = dtype.size();
            let parts = split(buf.len() / elem, elem, per_host);
            let part = parts[index].clone();
            // Sums stay sums until the last addition across hosts, which divides by the world.
            let (step_op, finish) = match op {
                ReduceOp::Mean => (ReduceOp::Sum, Finish::DivideBy(world as u32)),
                other => (other, Finish::None),
            };
            work.clear();
            work.extend_from_slice(&buf[part.clone()]);
            shm.reduce_parts(
                (seq, desc),
                buf,
                &parts,
                work,
                (dtype, step_op, Finish::None),
                &watch,
            )
            .map_err(in_host)?;
            let plan = ring::all_reduce_finishing(
                *host,
                hosts,
                work.len() / elem,
                (dtype, step_op),
                finish,
            );
            let links = engine_links(cross);
            let scratch: &mut [u8] = bytemuck::cast_slice_mut(scratch.as_mut_slice());
            let waits = Waits {
                foreign: &flat,
                ..waits
            };
            ring::run(links, work, &plan, (seq, desc), scratch, waits)
                .map_err(|e| (e, cross_hop))?;
            buf[part].copy_from_slice(work);
            shm.gather_parts(((seq, desc), true), buf, &parts, &watch)
                .map_err(in_host)
        })
    }

    /// The shared memory collectives use now.
    fn shm_now<'a>(&self, st: &'a State) -> Option<&'a Segment> {
        st.shm
            .as_ref()
            .filter(|_| self.on_shm.load(Ordering::Relaxed))
    }

    /// Whether every collective runs in a segment shared by the whole group now.
    fn whole_now(&self, st: &State) -> bool {
        matches!(self.shm_now(st), Some(Segment::Whole(_)))
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
        hop: Hop,
    ) -> DdpError {
        let neighbour = |side: Side| {
            self.global(match side {
                Side::Next => hop.next,
                Side::Prev => hop.prev,
            })
        };
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
                let peer = neighbour(side);
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
                let diagnosis = self.diagnose_stall(seq, neighbour(side));
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
                let mismatch = CollectiveError::CollectiveMismatch {
                    rank: self.me,
                    peer: neighbour(Side::Prev),
                    seq,
                    their_seq,
                    ours: *desc,
                    theirs,
                };
                (DdpError::Collective(mismatch), None)
            }
            (_, RingError::Foreign(place, their_seq, theirs)) => {
                let mismatch = CollectiveError::CollectiveMismatch {
                    rank: self.me,
                    peer: self.global(Rank(place as u32)),
                    seq,
                    their_seq,
                    ours: *desc,
                    theirs,
                };
                (DdpError::Collective(mismatch), None)
            }
            (_, RingError::Protocol(error)) => (
                DdpError::Rendezvous(RendezvousError::Protocol {
                    rank: self.me,
                    peer: match hop.prev_link {
                        Via::Ring => st.ring.prev.as_ref().unwrap_or(&st.ring.next).peer_addr(),
                        Via::Tree(p) => match st.tree.get(p).and_then(Option::as_ref) {
                            Some(link) => link.peer_addr(),
                            None => Err(std::io::ErrorKind::NotConnected.into()),
                        },
                        Via::Across => match &st.shm {
                            Some(Segment::PerHost(h)) => {
                                h.cross.prev.as_ref().unwrap_or(&h.cross.next).peer_addr()
                            }
                            _ => Err(std::io::ErrorKind::NotConnected.into()),
                        },
                    }
                    .unwrap_or_else(|_| self.store.addr()),
                    error,
                }),
                Some(neighbour(Side::Prev)),
            ),
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

/// A shared-memory collective's failure as the ring's, naming the group place of the rank at
/// fault (`place` maps the segment's places to the group's). No link is named: a protocol
/// error here is a descriptor in the segment, not bytes on a link.
fn shm_failure(e: ShmError, place: impl Fn(usize) -> usize, hop: Hop) -> (RingError, Hop) {
    let at = |p: usize| Hop {
        next: Rank(p as u32),
        prev: Rank(p as u32),
        prev_link: Via::Ring,
    };
    match e {
        // The watched links carry group places already.
        ShmError::Link(p, io) => (RingError::Closed(Side::Prev, io), at(p)),
        ShmError::Timeout(q) => (RingError::Timeout(Side::Prev), at(place(q))),
        ShmError::Mismatch(q, their_seq, theirs) => {
            (RingError::Mismatch(their_seq, theirs), at(place(q)))
        }
        ShmError::Protocol(q, w) => (RingError::Protocol(w), at(place(q))),
        ShmError::Aborted => (RingError::Aborted, hop),
    }
}

/// The ring's links with the neighbours' places: what a collective of recursive doubling
/// watches for a peer that runs it on the ring ([`Waits::foreign`]).
fn ring_links<'a>(ring: &'a Ring, hop: &Hop) -> Vec<(&'a TcpStream, usize)> {
    let mut links = vec![(&ring.next, hop.next.index())];
    if let Some(p) = &ring.prev {
        links.push((p, hop.prev.index()));
    }
    links
}

/// A ring's links as the engine takes them (one connection both ways in a ring of two).
fn engine_links(ring: &Ring) -> Links<'_> {
    Links {
        next: &ring.next,
        prev: ring.prev.as_ref().unwrap_or(&ring.next),
        same: ring.prev.is_none(),
    }
}

/// The links of recursive doubling with the partner's place.
fn tree_links(tree: &[Option<TcpStream>]) -> impl Iterator<Item = (&TcpStream, usize)> {
    tree.iter()
        .enumerate()
        .filter_map(|(place, l)| Some((l.as_ref()?, place)))
}

/// The link of recursive doubling to `peer`, and the hop to name when it fails.
fn partner_link(
    tree: &[Option<TcpStream>],
    peer: usize,
) -> std::result::Result<(&TcpStream, Hop), (RingError, Hop)> {
    let hop = Hop {
        next: Rank(peer as u32),
        prev: Rank(peer as u32),
        prev_link: Via::Tree(peer),
    };
    match tree.get(peer).and_then(Option::as_ref) {
        Some(link) => Ok((link, hop)),
        None => {
            let missing = std::io::Error::new(
                std::io::ErrorKind::NotConnected,
                "no link of recursive doubling to this rank",
            );
            Err((RingError::Closed(Side::Next, missing), hop))
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
        match self.on_shm.load(Ordering::Relaxed) {
            true => self.shared,
            false => "tcp",
        }
    }

    fn all_reduce(&self, buf: &mut [u8], dtype: DType, op: ReduceOp) -> Result<()> {
        let count = buf.len() / dtype.size();
        let desc = CollectiveDesc::new(CollectiveOp::AllReduce, dtype, count).reduce(op);
        let mut st = self.lock();
        let by_tree = self.by_tree(&st, buf.len());
        match self.shm_now(&st) {
            Some(Segment::Whole(_)) => {
                return self.run_shm(&mut st, &desc, |shm, c, w| {
                    shm.all_reduce(c, buf, (dtype, op), w)
                })
            }
            Some(Segment::PerHost(_)) if !by_tree => {
                return self.run_hier(&mut st, &desc, buf, (dtype, op))
            }
            _ => {}
        }
        if by_tree {
            return self.run_tree(&mut st, &desc, buf);
        }
        let plan = ring::all_reduce(self.rank.index(), self.world.as_usize(), count, dtype, op);
        self.run(&mut st, &desc, buf, &plan)
    }

    fn broadcast(&self, buf: &mut [u8], dtype: DType, root: Rank) -> Result<()> {
        let count = buf.len() / dtype.size();
        let desc = CollectiveDesc::new(CollectiveOp::Broadcast, dtype, count).root(root);
        let (rank, world) = (self.rank.index(), self.world.as_usize());
        let mut st = self.lock();
        if self.whole_now(&st) {
            return self.run_shm(&mut st, &desc, |shm, c, w| {
                shm.broadcast(c, buf, root.index(), w)
            });
        }
        if self.by_tree(&st, buf.len()) {
            let moves = tree::broadcast(rank, world, root.index(), buf.len());
            return self.run_moves(&mut st, &desc, buf, &moves);
        }
        let plan = ring::broadcast(rank, world, root.index(), buf.len());
        self.run(&mut st, &desc, buf, &plan)
    }

    fn all_gather(&self, send: &[u8], recv: &mut [u8], dtype: DType) -> Result<()> {
        let block = send.len();
        let r = self.rank.index();
        recv[r * block..(r + 1) * block].copy_from_slice(send);
        let desc = CollectiveDesc::new(CollectiveOp::AllGather, dtype, block / dtype.size());
        let world = self.world.as_usize();
        let mut st = self.lock();
        if self.whole_now(&st) {
            return self.run_shm(&mut st, &desc, |shm, c, w| shm.all_gather(c, recv, w));
        }
        if self.by_tree(&st, recv.len()) {
            let moves = tree::all_gather(r, world, block);
            return self.run_moves(&mut st, &desc, recv, &moves);
        }
        let plan = ring::all_gather(r, world, block);
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
        let mut st = self.lock();
        if self.whole_now(&st) {
            return self.run_shm(&mut st, &desc, |shm, c, w| {
                shm.reduce_scatter(c, send, recv, (dtype, op), w)
            });
        }
        let plan = ring::reduce_scatter(self.rank.index(), self.world.as_usize(), block, dtype, op);
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
        let mut st = self.lock();
        if self.whole_now(&st) {
            return self.run_shm(&mut st, &desc, |shm, c, w| shm.barrier(c, w));
        }
        if st.algorithm != Algorithm::Ring {
            return self.run_tree(&mut st, &desc, &mut one);
        }
        let plan = ring::all_reduce(
            self.rank.index(),
            self.world.as_usize(),
            1,
            DType::I32,
            ReduceOp::Sum,
        );
        self.run(&mut st, &desc, &mut one, &plan)
    }

    fn allocate_shared(&self, bytes: usize) -> Result<Option<SharedArena>> {
        let desc = CollectiveDesc::new(CollectiveOp::Allocate, DType::U8, bytes);
        let mut st = self.lock();
        if !self.whole_now(&st) {
            return Ok(None);
        }
        let mut made = None;
        self.run_shm(&mut st, &desc, |shm, c, w| {
            made = Some(shm.allocate(c, bytes, w)?);
            Ok(())
        })?;
        Ok(match made {
            Some(Ok(arena)) => Some(arena),
            Some(Err(why)) => {
                tracing::warn!("[rank {}] buffers stay on the heap: {why}", self.me);
                None
            }
            None => None,
        })
    }

    fn all_reduce_shared(
        &self,
        arena: &SharedArena,
        at: std::ops::Range<usize>,
        dtype: DType,
        op: ReduceOp,
    ) -> Result<()> {
        let desc = CollectiveDesc::new(
            CollectiveOp::AllReduceShared,
            dtype,
            at.len() / dtype.size(),
        )
        .reduce(op);
        let mut st = self.lock();
        if self.whole_now(&st) {
            return self.run_shm(&mut st, &desc, |shm, c, w| {
                shm.all_reduce_shared(c, arena, at, (dtype, op), w)
            });
        }
        drop(st);
        // Moved over TCP since the arena was allocated: this rank's region is a buffer as any.
        super::all_reduce_own_region(self, arena, at, dtype, op)
    }

    fn abort(&self) {
        self.links.stop();
    }

    fn set_algorithm(&self, algorithm: Algorithm) -> Result<()> {
        let mut st = self.lock();
        // Connected for the ring only: no link of recursive doubling (every other choice opens
        // one to at least one partner).
        if algorithm != Algorithm::Ring && st.tree.iter().all(Option::is_none) {
            return Err(DdpError::Config(ConfigError::InvalidConfig {
                field: "algorithm",
                reason: "this group was connected for the ring only (BURN_DDP_ALGO=ring), so it \
                         has no links for recursive doubling",
            }));
        }
        st.algorithm = algorithm;
        Ok(())
    }

    fn set_transport(&self, transport: Transport) -> Result<()> {
        let st = self.lock();
        let shm = match transport {
            Transport::Tcp => false,
            Transport::Shm | Transport::Auto => st.shm.is_some(),
        };
        if transport == Transport::Shm && !shm {
            return Err(DdpError::Config(ConfigError::InvalidConfig {
                field: "transport",
                reason: "this group has no shared segment (its ranks are neither all on one \
                         host nor as many on each host, or it was connected with \
                         BURN_DDP_TRANSPORT=tcp)",
            }));
        }
        self.on_shm.store(shm, Ordering::Relaxed);
        Ok(())
    }
}

impl Drop for TcpCommunicator {
    fn drop(&mut self) {
        self.links.close();
    }
}
