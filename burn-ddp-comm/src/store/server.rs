//! The store server, run by rank 0 on `MASTER_ADDR:MASTER_PORT`.
//!
//! One thread accepts; one thread serves each connection. Shared state is a map behind a mutex
//! with a condition variable for blocking `get`/`wait`. A connection that sends anything invalid
//! (garbage, a truncated or oversized frame, a wrong token) is answered if possible, logged,
//! and closed; the server keeps serving everyone else.
//!
//! What an unauthenticated peer can hold is bounded: at most [`MAX_PENDING`] connections in
//! their handshake at once, or twice the world size in a larger job, whose ranks and their
//! heartbeats all connect at once (a new one closes the oldest: idle or trickling connections
//! cannot keep a rank out; a connection closed so is never admitted, even if its handshake
//! was just ending, so that its client's retry is no second claim of its rank), each for at most [`HANDSHAKE_TIMEOUT`] in all, with frames of at most a
//! few hundred bytes. Authenticated connections (which hold the job token) have their own
//! limit. Refusals are logged at a bounded rate and kept (for error messages) up to a bound.

use crate::error::RendezvousError;
use std::collections::{HashMap, VecDeque};
use std::io::{self, ErrorKind};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use super::protocol::{self, Reply, Request, MAX_FRAME};
use crate::config::JobToken;
use crate::store::auth::{self, Purpose, RefuseReason, ServerHandshakeError};
use crate::types::{AbortRecord, Rank, WorldSize};
use crate::wire::{self, FrameError};
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
/// How often the accept loop checks for shutdown.
const ACCEPT_POLL: Duration = Duration::from_millis(100);
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
    members: HashMap<Rank, (SocketAddr, u64)>,
    /// Ranks that said goodbye or disconnected, with the address they had.
    departed: HashMap<Rank, SocketAddr>,
    refusals: Vec<(String, String)>,
    abort: Option<AbortRecord>,
    /// The first failure of each scope (a fault-tolerant job's membership epochs, `ft/<n>`):
    /// it ends the waits on keys under `scope/`, not the job.
    scoped: HashMap<String, AbortRecord>,
    /// The keys blocked requests wait for, each with its waiters: a change of a key wakes the
    /// requests waiting for it and nobody else (one condition variable for all made every change
    /// wake every blocked request: n ranks waiting on their ring neighbours' addresses while n
    /// addresses arrive were n² wake-ups, 20 s of a 2,048-rank start-up here).
    awaited: HashMap<String, Waiters>,
}

/// The requests blocked on one key.
#[derive(Debug)]
struct Waiters {
    count: usize,
    woken: Arc<Condvar>,
}

impl State {
    /// Counts a blocked request's wait on `key`: the condition variable its changes notify.
    fn await_key(&mut self, key: &str) -> Arc<Condvar> {
        let w = self
            .awaited
            .entry(key.to_owned())
            .or_insert_with(|| Waiters {
                count: 0,
                woken: Arc::new(Condvar::new()),
            });
        w.count += 1;
        Arc::clone(&w.woken)
    }

    /// The end of a wait counted by [`await_key`](Self::await_key).
    fn stop_awaiting(&mut self, key: &str) {
        if let Some(w) = self.awaited.get_mut(key) {
            w.count -= 1;
            if w.count == 0 {
                self.awaited.remove(key);
            }
        }
    }

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

#[derive(Debug)]
struct ServerState {
    state: Mutex<State>,
    changed: Condvar,
    token: JobToken,
    world: WorldSize,
    rank: Rank,
    shutdown: AtomicBool,
    next_conn: AtomicU64,
    /// Requests blocked in `get`/`wait` that still owe their client a reply.
    blocked: AtomicUsize,
    conns: Mutex<HashMap<u64, Arc<TcpStream>>>,
    /// Connections still in their handshake, oldest first (their streams are in `conns`).
    pending: Mutex<VecDeque<u64>>,
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
        // A poisoned lock only means a serving thread panicked mid-update of plain data;
        // the map is still consistent enough to keep serving.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// `key` changed: wakes the blocked requests that wait for it.
    fn key_changed(&self, st: &State, key: &str) {
        if let Some(w) = st.awaited.get(key) {
            w.woken.notify_all();
        }
    }

    /// Wakes every blocked request and every waiter on the server's state (an abort, a
    /// departure, shutdown).
    fn wake_all(&self, st: &State) {
        for w in st.awaited.values() {
            w.woken.notify_all();
        }
        self.changed.notify_all();
    }

    fn abort(&self, st: &mut State, record: AbortRecord) {
        if st.abort.is_none() {
            tracing::error!("[rank {}] store: job aborted: {record}", self.rank);
            st.abort = Some(record);
        }
        self.wake_all(st);
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
        self.wake_all(st);
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

    /// A connection finished its handshake (or failed it): it no longer holds a pending slot.
    /// Whether it still held one: `false` when a newer connection evicted it (under the same
    /// lock, which closed it), so that it is not admitted after all.
    fn handshake_over(&self, conn: u64) -> bool {
        let Ok(mut p) = self.pending.lock() else {
            return false;
        };
        let held = p.len();
        p.retain(|id| *id != conn);
        p.len() < held
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
}

/// A running store server. Dropping it stops the server and closes every connection.
#[derive(Debug)]
pub(crate) struct StoreServer {
    addr: SocketAddr,
    shared: Arc<ServerState>,
    accept: Option<JoinHandle<()>>,
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
            next_conn: AtomicU64::new(0),
            blocked: AtomicUsize::new(0),
            conns: Mutex::new(HashMap::new()),
            pending: Mutex::new(VecDeque::new()),
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
        let s = Arc::clone(&shared);
        let accept = thread::Builder::new()
            .name("burn-ddp-store".into())
            .spawn(move || accept_loop(listener, s))?;
        tracing::debug!("[rank {rank}] store: serving on {addr}");
        Ok(Self {
            addr,
            shared,
            accept: Some(accept),
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
        let all = self.shared.conns.lock().map(|c| c.len()).unwrap_or(0);
        let pending = self.shared.pending.lock().map(|p| p.len()).unwrap_or(0);
        (all, pending)
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
        self.shared.shutdown.store(true, Ordering::SeqCst);
        self.shared.wake_all(&self.shared.lock());
        // Let blocked requests answer (with the abort record, if any) before the sockets close.
        let deadline = Instant::now() + REPLY_GRACE;
        while self.shared.blocked.load(Ordering::SeqCst) > 0 && Instant::now() < deadline {
            thread::sleep(Duration::from_millis(5));
        }
        tracing::debug!("store on {} stopping", self.addr);
        if let Ok(conns) = self.shared.conns.lock() {
            for c in conns.values() {
                let _ = c.shutdown(Shutdown::Both);
            }
        }
        if let Some(h) = self.accept.take() {
            if h.join().is_err() {
                tracing::error!("[rank {}] store: accept thread panicked", self.shared.rank);
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
    let queue = world
        .as_usize()
        .saturating_mul(2)
        .saturating_add(64)
        .clamp(1024, 65_535);
    socket.listen(i32::try_from(queue).unwrap_or(65_535))?;
    Ok(socket.into())
}

fn accept_loop(listener: TcpListener, shared: Arc<ServerState>) {
    use std::os::fd::AsFd;
    let readable = crate::sys::Ready {
        read: true,
        write: false,
    };
    while !shared.shutdown.load(Ordering::SeqCst) {
        match listener.accept() {
            Ok((stream, peer)) => {
                let id = shared.next_conn.fetch_add(1, Ordering::Relaxed);
                let pending = shared.pending.lock().map(|p| p.len()).unwrap_or(0);
                let all = shared.conns.lock().map(|c| c.len()).unwrap_or(0);
                if all.saturating_sub(pending) >= shared.max_conns {
                    shared.refuse(
                        peer,
                        format!(
                            "limit of {} authenticated connections reached",
                            shared.max_conns
                        ),
                    );
                    continue;
                }
                // One descriptor a connection, shared with the map that can shut it down (a
                // clone would take a second: a job of 8,192 ranks holds 16,384 connections).
                let stream = Arc::new(stream);
                if let Ok(mut p) = shared.pending.lock() {
                    if p.len() >= shared.max_pending() {
                        // The oldest handshake in progress makes room: a flood of idle or
                        // slow connections cannot hold every slot against a rank.
                        if let Some(oldest) = p.pop_front() {
                            if let Some(s) = shared
                                .conns
                                .lock()
                                .ok()
                                .as_ref()
                                .and_then(|c| c.get(&oldest))
                            {
                                let _ = s.shutdown(Shutdown::Both);
                            }
                        }
                    }
                    p.push_back(id);
                }
                if let Ok(mut conns) = shared.conns.lock() {
                    conns.insert(id, Arc::clone(&stream));
                }
                let s = Arc::clone(&shared);
                let spawned = thread::Builder::new()
                    .name("burn-ddp-store-conn".into())
                    .spawn(move || {
                        serve(stream, peer, id, &s);
                        if let Ok(mut conns) = s.conns.lock() {
                            conns.remove(&id);
                        }
                    });
                if let Err(e) = spawned {
                    tracing::error!(
                        "[rank {}] store: cannot spawn a connection thread: {e}",
                        shared.rank
                    );
                }
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                // A failed wait ends early; the loop accepts again and backs off below.
                let _ = crate::sys::poll([(listener.as_fd(), readable)], ACCEPT_POLL);
            }
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => {
                // EMFILE and friends: back off instead of spinning.
                tracing::warn!("[rank {}] store: accept failed: {e}", shared.rank);
                thread::sleep(ACCEPT_POLL);
            }
        }
    }
}

/// Serves one connection until it closes, misbehaves, or the server shuts down.
fn serve(stream: Arc<TcpStream>, peer: SocketAddr, conn: u64, shared: &ServerState) {
    let stream: &TcpStream = &stream;
    if stream.set_nonblocking(false).is_err() {
        return;
    }
    let _ = stream.set_nodelay(true);
    let deadline = Instant::now() + shared.handshake;
    let handshake = auth::server_handshake(
        stream,
        &[Purpose::Store, Purpose::StoreAux],
        &shared.token,
        deadline,
    );
    if !shared.handshake_over(conn) {
        // Evicted while it ended: closed already, and not admitted (its client retries).
        return;
    }
    let hello = match handshake {
        Ok(h) => h,
        Err(ServerHandshakeError::WrongToken) => {
            shared.refuse(
                peer,
                "wrong job token (another job, or a different BURN_DDP_JOB_TOKEN)".into(),
            );
            return;
        }
        Err(ServerHandshakeError::Wire(e)) => {
            shared.refuse(peer, format!("not a burn-ddp peer of this version ({e})"));
            return;
        }
        Err(ServerHandshakeError::Io(e)) => {
            if !shared.shutdown.load(Ordering::SeqCst) {
                shared.refuse(peer, format!("handshake failed: {e}"));
            }
            return;
        }
    };

    let member = match admit(stream, peer, conn, hello, shared) {
        Some(member) => member,
        None => return,
    };
    let mut said_bye = false;
    let outcome = request_loop(stream, peer, shared, member, &mut said_bye);

    let mut st = shared.lock();
    if let Some(rank) = member {
        if st.members.get(&rank).map(|m| m.1) == Some(conn) {
            st.members.remove(&rank);
            st.departed.insert(rank, peer);
            let shutting_down = shared.shutdown.load(Ordering::SeqCst);
            if !said_bye && !shutting_down {
                let why = match &outcome {
                    Err(FrameError::Io(e)) if e.kind() == ErrorKind::UnexpectedEof => {
                        "its process exited or crashed".to_string()
                    }
                    Err(e) => e.to_string(),
                    Ok(()) => "it closed the connection".to_string(),
                };
                if shared.lighthouse {
                    tracing::info!("store: member {rank} ({peer}) is gone: {why}");
                    st.map.insert(gone_key(rank), why.into_bytes());
                } else {
                    let record = AbortRecord {
                        reporter: shared.rank,
                        culprit: Some(rank),
                        collective: None,
                        reason: format!(
                            "rank {rank} ({peer}) lost its connection to the store without leaving: {why}"
                        ),
                    };
                    shared.abort(&mut st, record);
                }
            }
        }
    }
    shared.wake_all(&st);
}

/// Applies membership rules to an authenticated client. Returns `None` when it was refused,
/// `Some(Some(rank))` for a member and `Some(None)` for an auxiliary connection.
fn admit(
    stream: &TcpStream,
    peer: SocketAddr,
    conn: u64,
    hello: auth::ClientHello,
    shared: &ServerState,
) -> Option<Option<Rank>> {
    let mut st = shared.lock();
    let refusal = if shared.lighthouse && hello.purpose != Purpose::Store {
        None
    } else if shared.lighthouse {
        lighthouse_refusal(&st, &hello, peer)
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
        if let Some((first, _)) = st.members.get(&hello.rank) {
            let first = *first;
            Some((
                RefuseReason::DuplicateRank {
                    first,
                    second: peer,
                },
                format!(
                    "rank {} was claimed by two processes ({first} and {peer}); give every process a distinct RANK",
                    hello.rank
                ),
            ))
        } else if let Some(first) = st.departed.get(&hello.rank) {
            let first = *first;
            Some((
                RefuseReason::DuplicateRank {
                    first,
                    second: peer,
                },
                format!(
                    "rank {} was claimed again by {peer} after {first} left; a job cannot re-admit a rank (restart the whole job)",
                    hello.rank
                ),
            ))
        } else {
            None
        }
    } else {
        None
    };

    if let Some((reason, message)) = refusal {
        let _ = auth::refuse(stream, &reason);
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
        }
        return None;
    }
    if auth::welcome(stream).is_err() {
        return None;
    }
    if hello.purpose == Purpose::Store {
        st.members.insert(hello.rank, (peer, conn));
        let joined = protocol::joined_key(hello.rank);
        st.map.insert(joined.clone(), peer.to_string().into_bytes());
        shared.key_changed(&st, &joined);
        tracing::debug!(
            "[rank {}] store: rank {} joined from {peer}",
            shared.rank,
            hello.rank
        );
        Some(Some(hello.rank))
    } else {
        Some(None)
    }
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

fn request_loop(
    mut stream: &TcpStream,
    peer: SocketAddr,
    shared: &ServerState,
    member: Option<Rank>,
    said_bye: &mut bool,
) -> std::result::Result<(), FrameError> {
    loop {
        let (kind, payload) = wire::read_frame(&mut stream, MAX_FRAME)?;
        let request = match Request::decode(kind, &payload) {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(
                    "[rank {}] store: malformed request from {peer}: {e}; closing that connection",
                    shared.rank
                );
                let (k, p) = Reply::Error(format!("malformed request: {e}")).encode();
                let _ = wire::write_frame(&mut stream, k, &p);
                return Err(FrameError::Wire(e));
            }
        };
        let bye = matches!(request, Request::Bye);
        let blocking = matches!(
            request,
            Request::Get { .. } | Request::Wait { .. } | Request::GetMany { .. }
        );
        if blocking {
            shared.blocked.fetch_add(1, Ordering::SeqCst);
        }
        let reply = handle(request, shared, member);
        let (k, p) = reply.encode();
        let counted = &shared.traffic[usize::from(member.is_none())];
        counted.requests.fetch_add(1, Ordering::Relaxed);
        let moved = payload.len() + p.len() + 2 * wire::HEADER_LEN;
        counted.bytes.fetch_add(moved as u64, Ordering::Relaxed);
        let written = wire::write_frame(&mut stream, k, &p);
        if blocking {
            shared.blocked.fetch_sub(1, Ordering::SeqCst);
        }
        written?;
        if bye {
            *said_bye = true;
            return Ok(());
        }
    }
}

/// Waits until every one of `keys` exists (up to `timeout`), then answers with `ready` of
/// the map (`get`, `wait` and `get_many` alike); else the keys still missing, or the abort record that ended the wait.
fn wait_all<'a>(
    shared: &'a ServerState,
    mut st: MutexGuard<'a, State>,
    keys: Vec<String>,
    timeout: Duration,
    ready: impl Fn(&State, &[String]) -> Reply,
) -> Reply {
    let deadline = Instant::now() + timeout;
    loop {
        if keys.iter().all(|k| st.map.contains_key(k)) {
            return ready(&st, &keys);
        }
        match wait(shared, st, deadline, &keys) {
            Ok(g) => st = g,
            Err(reply) => {
                return reply.unwrap_or_else(|| {
                    let st = shared.lock();
                    Reply::Timeout {
                        missing: keys
                            .iter()
                            .filter(|k| !st.map.contains_key(*k))
                            .cloned()
                            .collect(),
                    }
                });
            }
        }
    }
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

fn handle(request: Request, shared: &ServerState, member: Option<Rank>) -> Reply {
    let mut st = shared.lock();
    match request {
        Request::Set { key, value } => {
            shared.key_changed(&st, &key);
            st.map.insert(key, value);
            Reply::Ok
        }
        Request::Get { key, timeout } => wait_all(shared, st, vec![key], timeout, |st, keys| {
            Reply::Value(st.map[&keys[0]].clone())
        }),
        Request::Add { key, delta } => {
            let current = match st.map.get(&key) {
                None => 0,
                Some(v) => match <[u8; 8]>::try_from(v.as_slice()) {
                    Ok(bytes) => i64::from_le_bytes(bytes),
                    Err(_) => {
                        return Reply::Rejected(format!(
                            "`add` on key {key:?}, which holds a {}-byte value, not a counter \
                             set by `add`; use a different key",
                            v.len()
                        ))
                    }
                },
            };
            let next = current.wrapping_add(delta);
            shared.key_changed(&st, &key);
            st.map.insert(key, next.to_le_bytes().to_vec());
            Reply::Int(next)
        }
        Request::Wait { keys, timeout } => wait_all(shared, st, keys, timeout, |_, _| Reply::Ok),
        Request::GetMany { keys, timeout } => wait_all(shared, st, keys, timeout, values_of),
        Request::CompareSet {
            key,
            expected,
            desired,
        } => {
            let current = st.map.get(&key).cloned();
            if current == expected {
                shared.key_changed(&st, &key);
                st.map.insert(key, desired.clone());
                Reply::Value(desired)
            } else {
                Reply::Value(current.unwrap_or_default())
            }
        }
        Request::Delete { key } => Reply::Bool(st.map.remove(&key).is_some()),
        Request::Abort { scope, record } => {
            shared.abort_scope(&mut st, scope, record);
            Reply::Ok
        }
        Request::GetAbort { scope } => match st.abort.as_ref().or_else(|| st.scoped.get(&scope)) {
            Some(r) => Reply::Aborted(r.clone()),
            None => Reply::NoAbort,
        },
        Request::Refusals => Reply::Refusals(st.refusals.clone()),
        Request::Bye => {
            if let Some(rank) = member {
                if let Some((addr, _)) = st.members.remove(&rank) {
                    st.departed.insert(rank, addr);
                    if shared.lighthouse {
                        // Gone all the same: it will not take part in a membership again.
                        st.map.insert(gone_key(rank), b"it left the job".to_vec());
                    }
                }
                shared.wake_all(&st);
            }
            Reply::Ok
        }
    }
}

/// Waits for a change until `deadline`. `Err(Some(reply))` when the wait must end with that
/// reply (an abort of the job or of a scope of `keys`, or shutdown), `Err(None)` on timeout.
fn wait<'a>(
    shared: &'a ServerState,
    st: MutexGuard<'a, State>,
    deadline: Instant,
    keys: &[String],
) -> std::result::Result<MutexGuard<'a, State>, Option<Reply>> {
    if let Some(r) = st.abort_for(keys.iter().map(String::as_str)) {
        return Err(Some(Reply::Aborted(r.clone())));
    }
    if shared.shutdown.load(Ordering::SeqCst) {
        return Err(Some(Reply::Aborted(AbortRecord {
            reporter: shared.rank,
            culprit: Some(shared.rank),
            collective: None,
            reason: format!(
                "rank {} stopped the rendezvous store (it is exiting); see its output for why",
                shared.rank
            ),
        })));
    }
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Err(None);
    }
    // Woken by a change of the first key still missing (the others are checked again then), or
    // by an abort, a departure, shutdown.
    let mut st = st;
    let Some(missing) = keys.iter().find(|k| !st.map.contains_key(*k)) else {
        return Ok(st);
    };
    let woken = st.await_key(missing);
    let mut g = match woken.wait_timeout(st, left) {
        Ok((g, _)) => g,
        Err(p) => p.into_inner().0,
    };
    g.stop_awaiting(missing);
    if let Some(r) = g.abort_for(keys.iter().map(String::as_str)) {
        return Err(Some(Reply::Aborted(r.clone())));
    }
    Ok(g)
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
