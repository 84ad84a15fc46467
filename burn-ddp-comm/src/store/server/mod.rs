//! The store server, run by rank 0 on `MASTER_ADDR:MASTER_PORT` (and by the launcher of a
//! fault-tolerant job or of an elastic one).
//!
//! One thread serves every connection ([`event_loop`]): it accepts, authenticates, reads each
//! connection's requests as their bytes come and answers them in order; a request that waits
//! for keys (`get`, `wait`, `get_many`) is parked until they are set, its deadline passes, the
//! job (or the scope of its keys) aborts, or the server stops. Shared state is a map behind a
//! mutex, which the loop holds for one request at a time (the owner of the server reads it too:
//! traffic, departures). A connection that sends anything invalid (garbage, a truncated or
//! oversized frame, a wrong token) is answered if possible, logged, and closed; the server keeps
//! serving everyone else.
//!
//! What an unauthenticated peer can hold is bounded: at most [`MAX_PENDING`] connections in
//! their handshake at once, or twice the world size in a larger job, whose ranks and their
//! heartbeats all connect at once (a new one closes the oldest: idle or trickling connections
//! cannot keep a rank out), each for at most [`HANDSHAKE_TIMEOUT`] in all, with frames of at
//! most a few hundred bytes. Authenticated connections (which hold the job token) have their own
//! limit. Refusals are logged at a bounded rate and kept (for error messages) up to a bound.

mod event_loop;

use crate::error::RendezvousError;
use std::collections::HashMap;
use std::io::{self, ErrorKind};
use std::net::{SocketAddr, TcpListener};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use super::protocol::{self, not_a_counter, Reply, Request, MAX_FRAME};
use crate::config::JobToken;
use crate::store::auth::{self, Purpose, RefuseReason};
use crate::types::{AbortRecord, Rank, WorldSize};
use crate::{DdpError, Result};

/// How long a new connection may take to authenticate, in all.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Connections in their handshake at once; a new one closes the oldest.
pub(crate) const MAX_PENDING: usize = 64;
/// Refusals kept for error messages (the first ones: they name the cause).
const MAX_REFUSALS: usize = 64;
/// Refusals logged one by one before the log is rate-limited.
const LOGGED_REFUSALS: u64 = 10;
/// At most one summary line of further refusals per this interval.
const REFUSAL_LOG_INTERVAL: Duration = Duration::from_secs(10);
/// How long a stopping server lets blocked requests send their last reply.
const REPLY_GRACE: Duration = Duration::from_millis(500);
/// How long the event loop waits before it accepts again after a failed accept (out of
/// descriptors).
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);
/// How long rank 0 keeps the store up at exit after a failure, for the surviving ranks to read
/// the abort record (which names the culprit) instead of finding the store gone.
const ABORT_GRACE: Duration = Duration::from_secs(3);
/// Authenticated connections a fault-tolerant job's store holds at least (each process holds
/// about four: its presence, its membership epoch's group and heartbeat, its watcher; the
/// bound is [`LIGHTHOUSE_CONNS_PER_PROCESS`] for each process the job starts with, for the
/// processes that join and the launchers' own).
const MAX_LIGHTHOUSE_CONNS: usize = 4096;
/// The connections a fault-tolerant job's store allows for each process the job starts with.
const LIGHTHOUSE_CONNS_PER_PROCESS: usize = 8;

/// The key under which a fault-tolerant job's store records that member `id` is gone: its
/// process left, or its connection closed without a goodbye (it died), with why.
pub(crate) fn gone_key(id: Rank) -> String {
    format!("ft/gone/{id}")
}

#[derive(Debug, Default)]
struct State {
    map: HashMap<String, Vec<u8>>,
    /// Live membership connections: rank -> (peer address, connection id).
    members: HashMap<Rank, (SocketAddr, usize)>,
    /// Ranks that said goodbye or disconnected, with the address they had.
    departed: HashMap<Rank, SocketAddr>,
    refusals: Vec<(String, String)>,
    abort: Option<AbortRecord>,
    /// The first failure of each scope (a fault-tolerant job's membership epochs, `ft/<n>`):
    /// it ends the waits on keys under `scope/`, not the job.
    scoped: HashMap<String, AbortRecord>,
}

impl State {
    /// The record that ends a wait on `keys`: the job's, else that of a scope one of them lies
    /// under.
    fn abort_for<'a>(&self, mut keys: impl Iterator<Item = &'a str>) -> Option<&AbortRecord> {
        if let Some(r) = &self.abort {
            return Some(r);
        }
        if self.scoped.is_empty() {
            return None;
        }
        keys.find_map(|k| {
            self.scoped.iter().find_map(|(scope, r)| {
                k.strip_prefix(scope.as_str())
                    .is_some_and(|rest| rest.starts_with('/'))
                    .then_some(r)
            })
        })
    }
}

/// What handling a request changed, for the requests parked on the store.
#[derive(Debug, PartialEq, Eq)]
enum Wake {
    /// Nothing they wait for.
    Nothing,
    /// This key: the requests waiting for it look again.
    Key(String),
    /// An abort (of the job or a scope): every parked request looks again.
    All,
}

/// A request that waits for keys: what it answers once they are all set.
#[derive(Debug)]
enum Awaited {
    /// `get`: the key's value.
    Get(String),
    /// `wait`: that they are set.
    Wait(Vec<String>),
    /// `get_many`: their values.
    GetMany(Vec<String>),
}

impl Awaited {
    fn keys(&self) -> &[String] {
        match self {
            Awaited::Get(key) => std::slice::from_ref(key),
            Awaited::Wait(keys) | Awaited::GetMany(keys) => keys,
        }
    }

    /// The first of the keys not set yet.
    fn missing<'a>(&'a self, st: &State) -> Option<&'a String> {
        self.keys().iter().find(|k| !st.map.contains_key(*k))
    }
}

/// What a request comes to.
#[derive(Debug)]
enum Outcome {
    /// Its reply, and what it changed.
    Reply(Reply, Wake),
    /// It waits (at most `timeout`) for keys not set yet.
    Park(Awaited, Duration),
}

#[derive(Debug)]
struct ServerState {
    state: Mutex<State>,
    /// Notified when a member leaves and when the job aborts ([`StoreServer::wait_for_departures`]).
    changed: Condvar,
    token: JobToken,
    world: WorldSize,
    rank: Rank,
    shutdown: AtomicBool,
    /// Connections open, and those of them in their handshake (as the event loop last counted).
    open: AtomicUsize,
    handshaking: AtomicUsize,
    /// The limit of authenticated connections.
    max_conns: usize,
    /// Whether a refused client aborts the job (a rank's store: yes; the elastic rendezvous,
    /// where a misconfigured launcher must not end a running job: no).
    refusal_aborts: bool,
    /// The store of a fault-tolerant job (served by the launcher, not by a rank): members are
    /// processes with ids of any size and any world size; one that disconnects without
    /// saying goodbye is recorded under [`gone_key`], and the job goes on.
    lighthouse: bool,
    handshake: Duration,
    refusal_log: Mutex<RefusalLog>,
    /// Requests answered and bytes moved (requests and replies, frame headers included): on
    /// the members' own connections, and on auxiliary ones (heartbeats, watchdogs).
    traffic: [Counted; 2],
}

/// Requests and bytes, counted as they are served.
#[derive(Debug, Default)]
struct Counted {
    requests: AtomicU64,
    bytes: AtomicU64,
}

/// What a store server has answered since it started
/// ([`ProcessGroup::served_store_traffic`](crate::ProcessGroup::served_store_traffic)): requests
/// and bytes (both directions, frame headers included) on the members' connections (rendezvous, start-up, the group's store calls) and on
/// the auxiliary ones (heartbeats, watchdogs).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StoreTraffic {
    /// Requests on the members' connections.
    pub member_requests: u64,
    /// Bytes on the members' connections.
    pub member_bytes: u64,
    /// Requests on the auxiliary connections.
    pub aux_requests: u64,
    /// Bytes on the auxiliary connections.
    pub aux_bytes: u64,
}

/// The rate limit of the refusal log.
#[derive(Debug)]
struct RefusalLog {
    total: u64,
    /// Refusals not logged since the last summary line.
    quiet: u64,
    last_summary: Instant,
}

impl RefusalLog {
    /// Whether to log this refusal; a summary of the ones not logged is due when `Some`.
    fn admit(&mut self) -> (bool, Option<u64>) {
        self.total += 1;
        if self.total <= LOGGED_REFUSALS {
            return (true, None);
        }
        self.quiet += 1;
        if self.last_summary.elapsed() >= REFUSAL_LOG_INTERVAL {
            self.last_summary = Instant::now();
            let n = std::mem::take(&mut self.quiet);
            return (false, Some(n));
        }
        (false, None)
    }
}

impl ServerState {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A poisoned lock only means a thread panicked mid-update of plain data; the map is
        // still consistent enough to keep serving.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn abort(&self, st: &mut State, record: AbortRecord) {
        if st.abort.is_none() {
            tracing::error!("[rank {}] store: job aborted: {record}", self.rank);
            st.abort = Some(record);
        }
        self.changed.notify_all();
    }

    /// Records the first failure of `scope` (`""`: the job's, [`ServerState::abort`]).
    fn abort_scope(&self, st: &mut State, scope: String, record: AbortRecord) {
        if scope.is_empty() {
            return self.abort(st, record);
        }
        st.scoped.entry(scope).or_insert_with_key(|scope| {
            tracing::debug!("store: {scope} ended: {record}");
            record
        });
    }

    fn refuse(&self, peer: SocketAddr, why: String) {
        self.log_refusal(&format!("refused connection from {peer}: {why}"));
        self.keep_refusal(&mut self.lock(), peer, why);
    }

    fn keep_refusal(&self, st: &mut State, peer: SocketAddr, why: String) {
        if st.refusals.len() < MAX_REFUSALS {
            st.refusals.push((peer.to_string(), why));
        }
    }

    /// Logs a refusal: the first ones each, then one summary line per interval.
    fn log_refusal(&self, line: &str) {
        let (log, summary) = self
            .refusal_log
            .lock()
            .map(|mut l| l.admit())
            .unwrap_or((false, None));
        if log {
            tracing::warn!("[rank {}] store: {line}", self.rank);
        } else if let Some(n) = summary {
            tracing::warn!(
                "[rank {}] store: {n} more connections refused (the last: {line}); further \
                 refusals are summarised every {REFUSAL_LOG_INTERVAL:?}",
                self.rank
            );
        }
    }

    /// How many connections may be in their handshake at once: twice the world (every rank's
    /// store and heartbeat connections arriving together), at least [`MAX_PENDING`]; a
    /// fault-tolerant job's store, whose world changes, as for its connection limit's half.
    fn max_pending(&self) -> usize {
        match self.lighthouse {
            true => self.max_conns / 2,
            false => MAX_PENDING.max(self.world.as_usize().saturating_mul(2)),
        }
    }

    /// The reply that ends a wait on `keys` before they are all set: the abort record of the
    /// job or of their scope, or the server's own stop.
    fn ended(&self, st: &State, keys: &[String]) -> Option<Reply> {
        if let Some(r) = st.abort_for(keys.iter().map(String::as_str)) {
            return Some(Reply::Aborted(r.clone()));
        }
        self.shutdown.load(Ordering::SeqCst).then(|| {
            Reply::Aborted(AbortRecord {
                reporter: self.rank,
                culprit: Some(self.rank),
                collective: None,
                reason: format!(
                    "rank {} stopped the rendezvous store (it is exiting); see its output for why",
                    self.rank
                ),
            })
        })
    }

    /// The reply to a waiting request now, if it has one: its answer once every key is set,
    /// else what ended its wait; `None` while it still waits.
    fn answer(&self, st: &State, awaited: &Awaited) -> Option<Reply> {
        if awaited.missing(st).is_none() {
            return Some(match awaited {
                Awaited::Get(key) => Reply::Value(st.map[key].clone()),
                Awaited::Wait(_) => Reply::Ok,
                Awaited::GetMany(keys) => values_of(st, keys),
            });
        }
        self.ended(st, awaited.keys())
    }

    /// The reply to a waiting request whose deadline passed: the keys still missing.
    fn timed_out(&self, st: &State, awaited: &Awaited) -> Reply {
        self.answer(st, awaited).unwrap_or_else(|| Reply::Timeout {
            missing: awaited
                .keys()
                .iter()
                .filter(|k| !st.map.contains_key(*k))
                .cloned()
                .collect(),
        })
    }

    /// Handles one request of connection `conn` (of `member`, if it is one).
    fn handle(&self, st: &mut State, request: Request, member: Option<Rank>) -> Outcome {
        let (reply, wake) = match request {
            Request::Set { key, value } => {
                st.map.insert(key.clone(), value);
                (Reply::Ok, Wake::Key(key))
            }
            Request::Get { key, timeout } => return self.park(st, Awaited::Get(key), timeout),
            Request::Wait { keys, timeout } => return self.park(st, Awaited::Wait(keys), timeout),
            Request::GetMany { keys, timeout } => {
                return self.park(st, Awaited::GetMany(keys), timeout)
            }
            Request::Add { key, delta } => {
                let current = match st.map.get(&key) {
                    None => 0,
                    Some(v) => match <[u8; 8]>::try_from(v.as_slice()) {
                        Ok(bytes) => i64::from_le_bytes(bytes),
                        Err(_) => {
                            let reply = Reply::Rejected(not_a_counter(&key, v.len()));
                            return Outcome::Reply(reply, Wake::Nothing);
                        }
                    },
                };
                let next = current.wrapping_add(delta);
                st.map.insert(key.clone(), next.to_le_bytes().to_vec());
                (Reply::Int(next), Wake::Key(key))
            }
            Request::CompareSet {
                key,
                expected,
                desired,
            } => {
                let current = st.map.get(&key).cloned();
                if current == expected {
                    st.map.insert(key.clone(), desired.clone());
                    (Reply::Value(desired), Wake::Key(key))
                } else {
                    (Reply::Value(current.unwrap_or_default()), Wake::Nothing)
                }
            }
            Request::Delete { key } => (Reply::Bool(st.map.remove(&key).is_some()), Wake::Nothing),
            Request::Abort { scope, record } => {
                self.abort_scope(st, scope, record);
                (Reply::Ok, Wake::All)
            }
            Request::GetAbort { scope } => {
                let reply = match st.abort.as_ref().or_else(|| st.scoped.get(&scope)) {
                    Some(r) => Reply::Aborted(r.clone()),
                    None => Reply::NoAbort,
                };
                (reply, Wake::Nothing)
            }
            Request::Refusals => (Reply::Refusals(st.refusals.clone()), Wake::Nothing),
            Request::Bye => {
                if let Some(rank) = member {
                    if let Some((addr, _)) = st.members.remove(&rank) {
                        st.departed.insert(rank, addr);
                        if self.lighthouse {
                            // Gone all the same: it will not take part in a membership again.
                            st.map.insert(gone_key(rank), b"it left the job".to_vec());
                        }
                    }
                    self.changed.notify_all();
                }
                let wake = match (member, self.lighthouse) {
                    (Some(rank), true) => Wake::Key(gone_key(rank)),
                    _ => Wake::Nothing,
                };
                (Reply::Ok, wake)
            }
        };
        Outcome::Reply(reply, wake)
    }

    /// A request that waits for keys: its reply now if it has one, else parked.
    fn park(&self, st: &State, awaited: Awaited, timeout: Duration) -> Outcome {
        match self.answer(st, &awaited) {
            Some(reply) => Outcome::Reply(reply, Wake::Nothing),
            None if timeout.is_zero() => {
                Outcome::Reply(self.timed_out(st, &awaited), Wake::Nothing)
            }
            None => Outcome::Park(awaited, timeout),
        }
    }

    /// A member's connection closed: with a goodbye (`said_bye`), or not (`why`: its process
    /// died, or it broke the protocol), which a fault-tolerant job's store records under
    /// [`gone_key`] and any other store takes for the job's failure.
    fn departed(&self, rank: Rank, peer: SocketAddr, conn: usize, lost: Option<String>) -> Wake {
        let mut st = self.lock();
        if st.members.get(&rank).map(|m| m.1) != Some(conn) {
            return Wake::Nothing;
        }
        st.members.remove(&rank);
        st.departed.insert(rank, peer);
        self.changed.notify_all();
        let Some(why) = lost.filter(|_| !self.shutdown.load(Ordering::SeqCst)) else {
            return Wake::Nothing;
        };
        if self.lighthouse {
            tracing::info!("store: member {rank} ({peer}) is gone: {why}");
            st.map.insert(gone_key(rank), why.into_bytes());
            return Wake::Key(gone_key(rank));
        }
        let record = AbortRecord {
            reporter: self.rank,
            culprit: Some(rank),
            collective: None,
            reason: format!(
                "rank {rank} ({peer}) lost its connection to the store without leaving: {why}"
            ),
        };
        self.abort(&mut st, record);
        Wake::All
    }
}

/// A running store server. Dropping it stops the server and closes every connection.
#[derive(Debug)]
pub(crate) struct StoreServer {
    addr: SocketAddr,
    shared: Arc<ServerState>,
    waker: Arc<mio::Waker>,
    serving: Option<JoinHandle<()>>,
}

impl StoreServer {
    /// Binds `addr` and starts serving.
    ///
    /// # Errors
    /// `PortInUse` if another process holds the port, `StoreBind` for other bind failures.
    pub(crate) fn bind(
        addr: SocketAddr,
        rank: Rank,
        world: WorldSize,
        token: JobToken,
    ) -> Result<Self> {
        Self::bind_with(addr, rank, world, token, HANDSHAKE_TIMEOUT)
    }

    /// [`bind`](Self::bind) for the elastic launchers' rendezvous: a client it refuses (a
    /// launcher with other settings) is told why, and the job goes on.
    pub(crate) fn bind_rendezvous(
        addr: SocketAddr,
        world: WorldSize,
        token: JobToken,
    ) -> Result<Self> {
        Self::bind_inner(addr, Rank(0), world, token, HANDSHAKE_TIMEOUT, false, false)
    }

    /// The store of a fault-tolerant job, served by its launcher (torchft's lighthouse): it
    /// outlives any rank. Members (one connection per process, its member id as the rank) may
    /// leave and arrive; one that disconnects without saying goodbye is recorded under
    /// [`gone_key`] and nothing is aborted. Refusals do not abort either. `processes`: how many
    /// the job starts with, which sizes its connection limit and listen queue (members are not
    /// checked against it: ids are never reused).
    pub(crate) fn bind_lighthouse(
        addr: SocketAddr,
        token: JobToken,
        processes: WorldSize,
    ) -> Result<Self> {
        Self::bind_inner(
            addr,
            Rank(0),
            processes,
            token,
            HANDSHAKE_TIMEOUT,
            false,
            true,
        )
    }

    /// [`bind`](Self::bind) with another bound on a connection's handshake.
    pub(crate) fn bind_with(
        addr: SocketAddr,
        rank: Rank,
        world: WorldSize,
        token: JobToken,
        handshake: Duration,
    ) -> Result<Self> {
        Self::bind_inner(addr, rank, world, token, handshake, true, false)
    }

    fn bind_inner(
        addr: SocketAddr,
        rank: Rank,
        world: WorldSize,
        token: JobToken,
        handshake: Duration,
        refusal_aborts: bool,
        lighthouse: bool,
    ) -> Result<Self> {
        let listener = bind_listener(addr, world).map_err(|source| {
            if source.kind() == ErrorKind::AddrInUse {
                DdpError::Rendezvous(RendezvousError::PortInUse {
                    rank,
                    addr,
                    origin: String::new(),
                })
            } else {
                DdpError::Rendezvous(RendezvousError::StoreBind { rank, addr, source })
            }
        })?;
        let addr = listener.local_addr()?;
        listener.set_nonblocking(true)?;
        let shared = Arc::new(ServerState {
            state: Mutex::new(State::default()),
            changed: Condvar::new(),
            token,
            world,
            rank,
            shutdown: AtomicBool::new(false),
            open: AtomicUsize::new(0),
            handshaking: AtomicUsize::new(0),
            max_conns: if lighthouse {
                MAX_LIGHTHOUSE_CONNS.max(
                    world
                        .as_usize()
                        .saturating_mul(LIGHTHOUSE_CONNS_PER_PROCESS)
                        .saturating_add(64),
                )
            } else {
                world.as_usize().saturating_mul(4).saturating_add(64)
            },
            refusal_aborts,
            lighthouse,
            handshake,
            refusal_log: Mutex::new(RefusalLog {
                total: 0,
                quiet: 0,
                last_summary: Instant::now(),
            }),
            traffic: Default::default(),
        });
        let (serve, waker) = event_loop::EventLoop::new(listener, Arc::clone(&shared))?;
        let serving = thread::Builder::new()
            .name("burn-ddp-store".into())
            .spawn(move || serve.run())?;
        tracing::debug!("[rank {rank}] store: serving on {addr}");
        Ok(Self {
            addr,
            shared,
            waker,
            serving: Some(serving),
        })
    }

    /// The address the server listens on.
    #[cfg(test)]
    pub(crate) fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The address the server listens on.
    pub(crate) fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// What the server has answered so far.
    pub(crate) fn traffic(&self) -> StoreTraffic {
        let [member, aux] = &self.shared.traffic;
        let read = |c: &AtomicU64| c.load(Ordering::Relaxed);
        StoreTraffic {
            member_requests: read(&member.requests),
            member_bytes: read(&member.bytes),
            aux_requests: read(&aux.requests),
            aux_bytes: read(&aux.bytes),
        }
    }

    /// Connections open (in their handshake or authenticated), and those in their handshake.
    #[cfg(test)]
    pub(crate) fn connections(&self) -> (usize, usize) {
        (
            self.shared.open.load(Ordering::SeqCst),
            self.shared.handshaking.load(Ordering::SeqCst),
        )
    }

    /// After a rendezvous that failed on rank 0: while the store holds an abort record, keeps it
    /// up (at most [`ABORT_GRACE`]) until the other ranks have disconnected, so that a rank
    /// between two requests reads the record (it names the culprit) instead of finding the
    /// store gone. Without a record, returns at once.
    pub(crate) fn linger_after_abort(&self, keep: Rank) {
        if self.shared.lock().abort.is_some() {
            self.wait_for_departures(keep, ABORT_GRACE);
        }
    }

    /// Waits (at most `timeout`) until every rank other than `keep` has left or disconnected,
    /// so that rank 0 does not pull the store from under ranks that are still finishing.
    pub(crate) fn wait_for_departures(&self, keep: Rank, timeout: Duration) {
        let mut deadline = Instant::now() + timeout;
        let mut st = self.shared.lock();
        let mut aborted = false;
        loop {
            let pending = st.members.keys().filter(|r| **r != keep).count();
            if pending == 0 {
                return;
            }
            // After a failure the others only need the store to read the abort record (it names
            // the culprit): keep it up briefly, not for the whole grace.
            if st.abort.is_some() && !aborted {
                aborted = true;
                deadline = deadline.min(Instant::now() + ABORT_GRACE);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                tracing::warn!(
                    "[rank {}] store: shutting down while {pending} rank(s) are still connected",
                    self.shared.rank
                );
                return;
            }
            st = match self.shared.changed.wait_timeout(st, left) {
                Ok((g, _)) => g,
                Err(p) => p.into_inner().0,
            };
        }
    }
}

impl Drop for StoreServer {
    fn drop(&mut self) {
        // The loop answers the parked requests (with the abort record, if any), lets them send
        // their last replies for a moment, and closes every connection.
        self.shared.shutdown.store(true, Ordering::SeqCst);
        if let Err(e) = self.waker.wake() {
            tracing::error!(
                "[rank {}] store: cannot stop the store: {e}",
                self.shared.rank
            );
            return;
        }
        tracing::debug!("store on {} stopping", self.addr);
        if let Some(h) = self.serving.take() {
            if h.join().is_err() {
                tracing::error!("[rank {}] store: its thread panicked", self.shared.rank);
            }
        }
    }
}

/// The store's listening socket, whose accept queue holds every rank's two connections (its
/// own and its heartbeat's) arriving at once: a full queue drops a connection's first packet,
/// which the client sends again after a second, then three, then seven (the kernel caps the
/// queue at `net.core.somaxconn`).
fn bind_listener(addr: SocketAddr, world: WorldSize) -> io::Result<TcpListener> {
    use socket2::{Domain, Socket, Type};
    let socket = Socket::new(Domain::for_address(addr), Type::STREAM, None)?;
    // Lets a restarted job reuse the port while old connections linger in TIME_WAIT; a port held
    // by a live listener still fails with AddrInUse.
    socket.set_reuse_address(true)?;
    socket.bind(&addr.into())?;
    // A member connection and a heartbeat connection a rank, which thousands of ranks open at
    // once.
    let want = world.as_usize().saturating_mul(2).saturating_add(64);
    let queue = want.clamp(1024, 65_535);
    socket.listen(i32::try_from(queue).unwrap_or(65_535))?;
    if let Some(cap) = crate::sys::listen_queue_cap().filter(|&cap| (cap as usize) < want) {
        tracing::warn!(
            "the store's listen queue is {cap} connections (net.core.somaxconn), below the \
             {want} its {world} ranks may open at once: connections past it wait for the \
             kernel's retries, which slows start-up; raise it as root: \
             `sysctl -w net.core.somaxconn={}`",
            want.next_power_of_two()
        );
    }
    Ok(socket.into())
}

/// Applies membership rules to an authenticated client: `Ok(Some(rank))` for a member,
/// `Ok(None)` for an auxiliary connection, or why it is refused (and whether that aborted the
/// job: [`Wake::All`]).
fn admit(
    peer: SocketAddr,
    conn: usize,
    hello: &auth::ClientHello,
    shared: &ServerState,
) -> (std::result::Result<Option<Rank>, RefuseReason>, Wake) {
    let mut st = shared.lock();
    let refusal = if shared.lighthouse && hello.purpose != Purpose::Store {
        None
    } else if shared.lighthouse {
        lighthouse_refusal(&st, hello, peer)
    } else if hello.world != shared.world {
        Some((
            RefuseReason::WorldSize {
                server_rank: shared.rank,
                server_world: shared.world,
            },
            format!(
                "rank {} was started with WORLD_SIZE={} but rank {} has WORLD_SIZE={}; every process of a job must use the same WORLD_SIZE",
                hello.rank, hello.world, shared.rank, shared.world
            ),
        ))
    } else if !shared.world.contains(hello.rank) {
        Some((
            RefuseReason::RankOutOfRange {
                world: shared.world,
            },
            format!(
                "a process at {peer} claimed rank {}, outside WORLD_SIZE={}",
                hello.rank, shared.world
            ),
        ))
    } else if hello.purpose == Purpose::Store {
        let claimed = |first: SocketAddr, message: String| {
            let reason = RefuseReason::DuplicateRank {
                first,
                second: peer,
            };
            Some((reason, message))
        };
        let rank = hello.rank;
        if let Some(&(first, _)) = st.members.get(&rank) {
            claimed(
                first,
                format!(
                    "rank {rank} was claimed by two processes ({first} and {peer}); give every \
                     process a distinct RANK"
                ),
            )
        } else if let Some(&first) = st.departed.get(&rank) {
            claimed(
                first,
                format!(
                    "rank {rank} was claimed again by {peer} after {first} left; a job cannot \
                     re-admit a rank (restart the whole job)"
                ),
            )
        } else {
            None
        }
    } else {
        None
    };

    if let Some((reason, message)) = refusal {
        shared.keep_refusal(&mut st, peer, message.clone());
        shared.log_refusal(&format!("refused {peer}: {message}"));
        if shared.refusal_aborts {
            let record = AbortRecord {
                reporter: shared.rank,
                culprit: Some(hello.rank),
                collective: None,
                reason: message,
            };
            shared.abort(&mut st, record);
            return (Err(reason), Wake::All);
        }
        return (Err(reason), Wake::Nothing);
    }
    if hello.purpose != Purpose::Store {
        return (Ok(None), Wake::Nothing);
    }
    st.members.insert(hello.rank, (peer, conn));
    let joined = protocol::joined_key(hello.rank);
    st.map.insert(joined.clone(), peer.to_string().into_bytes());
    tracing::debug!(
        "[rank {}] store: rank {} joined from {peer}",
        shared.rank,
        hello.rank
    );
    (Ok(Some(hello.rank)), Wake::Key(joined))
}

/// Whether a fault-tolerant job's store refuses a process's presence: its member id is held
/// by a live connection, or was held by one that is gone (ids are never reused).
fn lighthouse_refusal(
    st: &State,
    hello: &auth::ClientHello,
    peer: SocketAddr,
) -> Option<(RefuseReason, String)> {
    let first = st
        .members
        .get(&hello.rank)
        .map(|(a, _)| *a)
        .or_else(|| st.departed.get(&hello.rank).copied())?;
    Some((
        RefuseReason::DuplicateRank {
            first,
            second: peer,
        },
        format!(
            "member id {} was claimed by two processes ({first} and {peer}); a process that \
             joins a running fault-tolerant job takes a fresh id (leave BURN_DDP_MEMBER_ID unset)",
            hello.rank
        ),
    ))
}

/// The values of `keys` (all present), or a refusal when they would not fit one reply.
fn values_of(st: &State, keys: &[String]) -> Reply {
    let values: Vec<Vec<u8>> = keys.iter().map(|k| st.map[k].clone()).collect();
    let size: usize = values.iter().map(|v| v.len() + 4).sum();
    if size + 4 > MAX_FRAME as usize {
        return Reply::Rejected(format!(
            "the values of these {} keys ({size} bytes) exceed one reply ({MAX_FRAME} bytes): \
             ask for fewer keys at once",
            keys.len()
        ));
    }
    Reply::Values(values)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The first refusals are logged one by one; then one summary line per interval, however
    /// many refusals come.
    #[test]
    fn the_refusal_log_is_rate_limited() {
        let mut log = RefusalLog {
            total: 0,
            quiet: 0,
            last_summary: Instant::now(),
        };
        let logged = (0..LOGGED_REFUSALS).filter(|_| log.admit().0).count();
        assert_eq!(logged as u64, LOGGED_REFUSALS);
        let lines = (0..10_000).filter(|_| log.admit() != (false, None)).count();
        assert_eq!(lines, 0, "a summary before its interval");
        log.last_summary -= REFUSAL_LOG_INTERVAL;
        assert_eq!(log.admit(), (false, Some(10_001)));
        assert_eq!(log.admit(), (false, None));
    }
}
