//! The store's event loop: one thread accepts, authenticates and serves every connection
//! (epoll, through mio), so that a job of thousands of ranks costs its store one thread and not
//! one per connection. (A rank holds two connections: 8,192 ranks held 16,384 threads in rank
//! 0's process, and at 4,096 ranks on 2 cores its store went 16 s without answering a
//! heartbeat.)
//!
//! Each connection's bytes are read as they come and its frames handled in order, a few at a
//! time before the next connection's turn. A request that waits for keys is parked under the
//! first key it misses and looked at again when that key changes, when the job or a scope
//! aborts, when its deadline passes, or when the server stops; the connection's next frames
//! wait behind it (a client sends one request at a time). Replies are buffered; a connection is
//! not read from while its client has replies left to read, so a client that sends without
//! reading holds at most one reply in the server.

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::io::{self, ErrorKind, Write};
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use mio::net::{TcpListener, TcpStream};
use mio::{Events, Interest, Poll, Token, Waker};

use super::{admit, Awaited, Outcome, ServerState, Wake, ACCEPT_BACKOFF, MAX_FRAME, REPLY_GRACE};
use crate::store::auth::{self, Purpose, ServerChallenge, ServerHandshakeError};
use crate::store::protocol::{Reply, Request};
use crate::types::Rank;
use crate::wire::{self, FrameError, WireError};

const LISTENER: Token = Token(usize::MAX);
const WAKER: Token = Token(usize::MAX - 1);
/// Events taken from the kernel at once (a batch, whose heartbeats are served first).
const EVENTS: usize = 1024;
/// Bytes read from a socket at once.
const READ_CHUNK: usize = 64 * 1024;
/// Bytes read from a connection while its request is parked, at most (its client sends one
/// request at a time; a stray one is read, a flood is not).
const PARKED_INPUT: usize = READ_CHUNK;
/// Reads and frames of one connection before the next connection's turn.
const STEPS_PER_TURN: usize = 64;
/// How long to wait for a deadline at most: a deadline past this (a waiting request's timeout
/// is its client's to choose) is checked again then.
const LONGEST_WAIT: Duration = Duration::from_secs(3600);

/// The event loop of one store server, run on its own thread by [`EventLoop::run`].
pub(super) struct EventLoop {
    poll: Poll,
    listener: TcpListener,
    shared: Arc<ServerState>,
    conns: HashMap<usize, Conn>,
    next_id: usize,
    /// Connections in their handshake, oldest first.
    pending: VecDeque<usize>,
    /// Parked requests, by the key each waits for.
    parked: HashMap<String, Vec<usize>>,
    /// The deadlines of handshakes and of parked requests (one a connection at most).
    deadlines: BTreeSet<(Instant, usize)>,
    /// Connections to serve again without an event: a parked request answered, a turn ended.
    again: Vec<usize>,
    /// When to accept again after an accept failed (out of descriptors, say).
    accept_again: Option<Instant>,
}

/// One connection and where it stands.
struct Conn {
    stream: TcpStream,
    peer: SocketAddr,
    phase: Phase,
    /// Bytes read and not handled yet.
    input: Vec<u8>,
    /// Bytes to send, of which `sent` are sent.
    output: Vec<u8>,
    sent: usize,
    parked: Option<Parked>,
    /// Its entry in [`EventLoop::deadlines`].
    deadline: Option<Instant>,
    /// Close it once its output is sent, for this.
    ending: Option<Ending>,
}

enum Phase {
    /// Waiting for the client's hello.
    Hello,
    /// Challenged; waiting for the client's proof.
    Proof(ServerChallenge),
    /// Authenticated and admitted: a member's connection (its rank) or an auxiliary one.
    Serving(Option<Rank>),
}

/// A request waiting for keys.
struct Parked {
    awaited: Awaited,
    /// The key it is parked under.
    on: String,
    /// The size of the request's payload, for the traffic counts.
    request_bytes: usize,
}

/// Why a connection ends.
enum Ending {
    /// Its member said goodbye.
    Bye,
    /// The server refused it (told it why, when it could, and logged it).
    Refused,
    /// It closed, failed, or broke the protocol.
    Failed(FrameError),
}

impl Conn {
    fn max_frame(&self) -> u32 {
        match self.phase {
            Phase::Serving(_) => MAX_FRAME,
            _ => auth::MAX_HANDSHAKE_FRAME,
        }
    }

    /// The next whole frame read, if any.
    fn frame(&mut self) -> Result<Option<(u8, Vec<u8>)>, WireError> {
        let max = self.max_frame();
        wire::take_frame(&mut self.input, max)
    }

    /// Reads what the socket has: whether it had anything (`false`: nothing yet).
    fn fill(&mut self) -> Result<bool, FrameError> {
        let closed = "the connection closed";
        match wire::read_more::<READ_CHUNK>(&mut self.stream, &mut self.input, closed) {
            Ok(_) => Ok(true),
            Err(e) if e.kind() == ErrorKind::WouldBlock => Ok(false),
            Err(e) => Err(FrameError::Io(e)),
        }
    }

    /// Sends what it can of the output: whether all of it is sent.
    fn flush(&mut self) -> io::Result<bool> {
        while self.sent < self.output.len() {
            match self.stream.write(&self.output[self.sent..]) {
                Ok(0) => return Err(ErrorKind::WriteZero.into()),
                Ok(n) => self.sent += n,
                Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(false),
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        self.output.clear();
        self.sent = 0;
        Ok(true)
    }

    /// Queues a frame.
    fn send(&mut self, (kind, payload): auth::Frame) {
        // Replies are bounded by the store (its values by the request frames that set them).
        let len = u32::try_from(payload.len()).unwrap_or(u32::MAX);
        self.output
            .extend_from_slice(&wire::encode_header(kind, len));
        self.output.extend_from_slice(&payload);
    }
}

impl EventLoop {
    /// A loop serving `listener` (non-blocking), and what wakes it to stop.
    pub(super) fn new(
        listener: std::net::TcpListener,
        shared: Arc<ServerState>,
    ) -> io::Result<(Self, Arc<Waker>)> {
        let poll = Poll::new()?;
        let mut listener = TcpListener::from_std(listener);
        poll.registry()
            .register(&mut listener, LISTENER, Interest::READABLE)?;
        let waker = Arc::new(Waker::new(poll.registry(), WAKER)?);
        let serve = Self {
            poll,
            listener,
            shared,
            conns: HashMap::new(),
            next_id: 0,
            pending: VecDeque::new(),
            parked: HashMap::new(),
            deadlines: BTreeSet::new(),
            again: Vec::new(),
            accept_again: None,
        };
        Ok((serve, waker))
    }

    /// Serves until the server is dropped; then answers the parked requests, lets the last
    /// replies go out (at most [`REPLY_GRACE`]), and closes every connection.
    pub(super) fn run(mut self) {
        let mut events = Events::with_capacity(EVENTS);
        let mut ready = Vec::with_capacity(EVENTS);
        let mut stopping: Option<Instant> = None;
        loop {
            if let Err(e) = self.poll.poll(&mut events, self.timeout(stopping)) {
                if e.kind() != ErrorKind::Interrupted {
                    tracing::error!(
                        "[rank {}] store: cannot wait for its connections: {e}",
                        self.shared.rank
                    );
                    break;
                }
            }
            let mut accept = false;
            ready.clear();
            for event in events.iter() {
                match event.token() {
                    LISTENER => accept = stopping.is_none(),
                    WAKER => {}
                    Token(id) => ready.push(id),
                }
            }
            // Liveness first: the auxiliary connections (heartbeats, watchdogs) are served
            // before the others, so that a heartbeat is not kept waiting past its bound behind
            // thousands of ranks starting up.
            ready.sort_by_key(|id| !self.is_auxiliary(*id));
            for &id in &ready {
                self.serve(id);
            }
            let backed_off = self.accept_again.is_some_and(|at| at <= Instant::now());
            if accept || (backed_off && stopping.is_none()) {
                self.accept();
            }
            for id in std::mem::take(&mut self.again) {
                self.serve(id);
            }
            self.expire(Instant::now());
            if stopping.is_none() && self.shared.shutdown.load(Ordering::SeqCst) {
                stopping = Some(Instant::now() + REPLY_GRACE);
                let _ = self.poll.registry().deregister(&mut self.listener);
                // Every parked request is answered: the server's stop ends its wait.
                self.wake(Wake::All);
                for id in std::mem::take(&mut self.again) {
                    self.serve(id);
                }
            }
            if let Some(end) = stopping {
                let quiet = self
                    .conns
                    .values()
                    .all(|c| c.parked.is_none() && c.output.is_empty());
                if quiet || Instant::now() >= end {
                    break;
                }
            }
        }
        self.conns.clear();
        self.pending.clear();
        self.count();
    }

    /// Whether connection `id` is an admitted auxiliary one.
    fn is_auxiliary(&self, id: usize) -> bool {
        self.conns
            .get(&id)
            .is_some_and(|c| matches!(c.phase, Phase::Serving(None)))
    }

    /// How long to wait for events: until the first deadline.
    fn timeout(&self, stopping: Option<Instant>) -> Option<Duration> {
        if !self.again.is_empty() {
            return Some(Duration::ZERO);
        }
        let first = [
            self.deadlines.first().map(|(at, _)| *at),
            self.accept_again,
            stopping,
        ]
        .into_iter()
        .flatten()
        .min()?;
        Some(
            first
                .saturating_duration_since(Instant::now())
                .min(LONGEST_WAIT),
        )
    }

    /// Accepts every connection waiting.
    fn accept(&mut self) {
        self.accept_again = None;
        loop {
            match self.listener.accept() {
                Ok((stream, peer)) => self.open(stream, peer),
                Err(e) if e.kind() == ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => {
                    // EMFILE and friends: try again a little later.
                    tracing::warn!("[rank {}] store: accept failed: {e}", self.shared.rank);
                    self.accept_again = Some(Instant::now() + ACCEPT_BACKOFF);
                    return;
                }
            }
        }
    }

    fn open(&mut self, mut stream: TcpStream, peer: SocketAddr) {
        let shared = &self.shared;
        if self.conns.len() - self.pending.len() >= shared.max_conns {
            shared.refuse(
                peer,
                format!(
                    "limit of {} authenticated connections reached",
                    shared.max_conns
                ),
            );
            return;
        }
        if self.pending.len() >= shared.max_pending() {
            // The oldest handshake in progress makes room: a flood of idle or slow
            // connections cannot hold every slot against a rank.
            if let Some(oldest) = self.pending.pop_front() {
                self.remove(oldest);
            }
        }
        let id = self.next_id;
        self.next_id = self.next_id.wrapping_add(1) % WAKER.0;
        if let Err(e) = self.poll.registry().register(
            &mut stream,
            Token(id),
            Interest::READABLE | Interest::WRITABLE,
        ) {
            tracing::warn!(
                "[rank {}] store: cannot serve {peer}: {e}",
                self.shared.rank
            );
            return;
        }
        let _ = stream.set_nodelay(true);
        let deadline = Instant::now() + self.shared.handshake;
        self.conns.insert(
            id,
            Conn {
                stream,
                peer,
                phase: Phase::Hello,
                input: Vec::new(),
                output: Vec::new(),
                sent: 0,
                parked: None,
                deadline: Some(deadline),
                ending: None,
            },
        );
        self.deadlines.insert((deadline, id));
        self.pending.push_back(id);
        self.count();
    }

    /// Publishes the connection counts.
    fn count(&self) {
        self.shared.open.store(self.conns.len(), Ordering::SeqCst);
        self.shared
            .handshaking
            .store(self.pending.len(), Ordering::SeqCst);
    }

    /// Sends, reads and handles what connection `id` has, until it waits for its socket, for
    /// keys, or its turn ends.
    fn serve(&mut self, id: usize) {
        for _ in 0..STEPS_PER_TURN {
            let Some(conn) = self.conns.get_mut(&id) else {
                return;
            };
            match conn.flush() {
                Err(e) => return self.close(id, Ending::Failed(FrameError::Io(e))),
                Ok(false) => return,
                Ok(true) => {}
            }
            if let Some(ending) = conn.ending.take() {
                return self.close(id, ending);
            }
            if conn.parked.is_none() {
                match conn.frame() {
                    Ok(Some((kind, payload))) => {
                        self.handle(id, kind, payload);
                        continue;
                    }
                    Ok(None) => {}
                    Err(e) => {
                        self.unreadable(id, e);
                        continue;
                    }
                }
            } else if conn.input.len() >= PARKED_INPUT {
                // Its next frames wait behind its parked request; no more of them is read.
                return;
            }
            // Read on while a request is parked too: a client that dies while it waits (a
            // rank killed in its rendezvous) is found at once, not at the end of its wait.
            match conn.fill() {
                Ok(true) => {}
                Ok(false) => return,
                Err(e) => return self.close(id, Ending::Failed(e)),
            }
        }
        self.again.push(id);
    }

    /// A frame whose header is invalid: the connection ends (a client of another protocol
    /// version is told which the server speaks).
    fn unreadable(&mut self, id: usize, e: WireError) {
        let Some(conn) = self.conns.get_mut(&id) else {
            return;
        };
        match conn.phase {
            Phase::Serving(_) => conn.ending = Some(Ending::Failed(FrameError::Wire(e))),
            Phase::Hello | Phase::Proof(_) => {
                if let (Phase::Hello, Some(answer)) =
                    (&conn.phase, auth::answer_to_unreadable_hello(&e))
                {
                    conn.send(answer);
                }
                self.refused(id, ServerHandshakeError::Wire(e));
            }
        }
    }

    fn handle(&mut self, id: usize, kind: u8, payload: Vec<u8>) {
        let Some(conn) = self.conns.get_mut(&id) else {
            return;
        };
        let token = &self.shared.token;
        match std::mem::replace(&mut conn.phase, Phase::Hello) {
            Phase::Hello => {
                let accepted = [Purpose::Store, Purpose::StoreAux];
                match auth::server_challenge(kind, &payload, &accepted, token) {
                    Ok((challenge, frame)) => {
                        conn.send(frame);
                        conn.phase = Phase::Proof(challenge);
                    }
                    Err(e) => self.refused(id, e),
                }
            }
            Phase::Proof(challenge) => match challenge.check_proof(kind, &payload, token) {
                Ok(hello) => self.admit(id, &hello),
                Err((e, answer)) => {
                    if let Some(answer) = answer {
                        conn.send(answer);
                    }
                    self.refused(id, e);
                }
            },
            Phase::Serving(member) => {
                conn.phase = Phase::Serving(member);
                self.request(id, member, kind, &payload);
            }
        }
    }

    /// The end of a handshake that failed: logged and kept as a refusal; the connection closes
    /// once what it was told is sent.
    fn refused(&mut self, id: usize, e: ServerHandshakeError) {
        let Some(conn) = self.conns.get_mut(&id) else {
            return;
        };
        let peer = conn.peer;
        conn.ending = Some(Ending::Refused);
        self.handshake_over(id);
        self.log_handshake_failure(peer, e);
    }

    /// Keeps and logs why a handshake failed (a connection that failed while the server stops
    /// is not a refusal).
    fn log_handshake_failure(&self, peer: SocketAddr, e: ServerHandshakeError) {
        let why = match e {
            ServerHandshakeError::WrongToken => {
                "wrong job token (another job, or a different BURN_DDP_JOB_TOKEN)".into()
            }
            ServerHandshakeError::Wire(e) => format!("not a burn-ddp peer of this version ({e})"),
            ServerHandshakeError::Io(_) if self.shared.shutdown.load(Ordering::SeqCst) => return,
            ServerHandshakeError::Io(e) => format!("handshake failed: {e}"),
        };
        self.shared.refuse(peer, why);
    }

    /// A connection is out of its handshake: it no longer holds a pending slot or its bound.
    fn handshake_over(&mut self, id: usize) {
        self.pending.retain(|p| *p != id);
        self.clear_deadline(id);
        self.count();
    }

    fn clear_deadline(&mut self, id: usize) {
        if let Some(at) = self.conns.get_mut(&id).and_then(|c| c.deadline.take()) {
            self.deadlines.remove(&(at, id));
        }
    }

    /// An authenticated client: welcomed as a member or an auxiliary connection, or refused.
    fn admit(&mut self, id: usize, hello: &auth::ClientHello) {
        self.handshake_over(id);
        let Some(conn) = self.conns.get_mut(&id) else {
            return;
        };
        let (admitted, wake) = admit(conn.peer, id, hello, &self.shared);
        match admitted {
            Ok(member) => {
                conn.send(auth::welcome_frame());
                conn.phase = Phase::Serving(member);
            }
            Err(reason) => {
                conn.send(auth::refusal_frame(&reason));
                conn.ending = Some(Ending::Refused);
            }
        }
        self.wake(wake);
    }

    /// One request of an admitted connection: answered, or parked.
    fn request(&mut self, id: usize, member: Option<Rank>, kind: u8, payload: &[u8]) {
        let request = match Request::decode(kind, payload) {
            Ok(r) => r,
            Err(e) => {
                let Some(conn) = self.conns.get_mut(&id) else {
                    return;
                };
                tracing::warn!(
                    "[rank {}] store: malformed request from {}: {e}; closing that connection",
                    self.shared.rank,
                    conn.peer
                );
                conn.send(Reply::Error(format!("malformed request: {e}")).encode());
                conn.ending = Some(Ending::Failed(FrameError::Wire(e)));
                return;
            }
        };
        let bye = matches!(request, Request::Bye);
        let outcome = self.shared.handle(&mut self.shared.lock(), request, member);
        match outcome {
            Outcome::Reply(reply, wake) => {
                self.reply(id, payload.len(), reply);
                if let (true, Some(conn)) = (bye, self.conns.get_mut(&id)) {
                    conn.ending = Some(Ending::Bye);
                }
                self.wake(wake);
            }
            Outcome::Park(awaited, timeout) => {
                let deadline = Instant::now()
                    .checked_add(timeout)
                    .unwrap_or_else(|| Instant::now() + LONGEST_WAIT);
                self.park(id, awaited, payload.len(), deadline);
            }
        }
    }

    /// Queues the reply to a request of `request_bytes` and counts both.
    fn reply(&mut self, id: usize, request_bytes: usize, reply: Reply) {
        let Some(conn) = self.conns.get_mut(&id) else {
            return;
        };
        let (k, p) = reply.encode();
        let aux = matches!(conn.phase, Phase::Serving(None));
        let counted = &self.shared.traffic[usize::from(aux)];
        counted.requests.fetch_add(1, Ordering::Relaxed);
        let moved = request_bytes + p.len() + 2 * wire::HEADER_LEN;
        counted.bytes.fetch_add(moved as u64, Ordering::Relaxed);
        conn.send((k, p));
    }

    /// Queues the reply to a request that waited, and serves its connection again (its next
    /// frames waited behind it).
    fn answered(&mut self, id: usize, request_bytes: usize, reply: Reply) {
        self.reply(id, request_bytes, reply);
        self.again.push(id);
    }

    /// Parks a request under the first key it misses, until `deadline`.
    fn park(&mut self, id: usize, awaited: Awaited, request_bytes: usize, deadline: Instant) {
        let st = self.shared.lock();
        let Some(on) = awaited.missing(&st).cloned() else {
            // Set since it was looked at: answered now.
            let reply = self.shared.timed_out(&st, &awaited);
            drop(st);
            return self.answered(id, request_bytes, reply);
        };
        drop(st);
        let Some(conn) = self.conns.get_mut(&id) else {
            return;
        };
        self.parked.entry(on.clone()).or_default().push(id);
        conn.parked = Some(Parked {
            awaited,
            on,
            request_bytes,
        });
        conn.deadline = Some(deadline);
        self.deadlines.insert((deadline, id));
    }

    /// Takes connection `id`'s parked request out of the parked ones.
    fn unpark(&mut self, id: usize) -> Option<Parked> {
        let parked = self.conns.get_mut(&id)?.parked.take()?;
        if let Some(ids) = self.parked.get_mut(&parked.on) {
            ids.retain(|p| *p != id);
            if ids.is_empty() {
                self.parked.remove(&parked.on);
            }
        }
        self.clear_deadline(id);
        Some(parked)
    }

    /// Looks again at the requests that `wake` concerns: those answered are sent, the others
    /// parked again (under the key they miss now).
    fn wake(&mut self, wake: Wake) {
        let ids = match wake {
            Wake::Nothing => return,
            Wake::Key(key) => match self.parked.get(&key) {
                Some(ids) => ids.clone(),
                None => return,
            },
            Wake::All => self.parked.values().flatten().copied().collect(),
        };
        for id in ids {
            self.look_again(id, false);
        }
    }

    /// Answers connection `id`'s parked request if it can be (or, once its deadline passed,
    /// with the keys it still misses), else parks it again.
    fn look_again(&mut self, id: usize, expired: bool) {
        let deadline = self.conns.get(&id).and_then(|c| c.deadline);
        let Some(parked) = self.unpark(id) else {
            return;
        };
        let reply = {
            let st = self.shared.lock();
            match (expired, deadline) {
                (false, Some(_)) => self.shared.answer(&st, &parked.awaited),
                // A parked request always has a deadline; without one it is answered now.
                _ => Some(self.shared.timed_out(&st, &parked.awaited)),
            }
        };
        match (reply, deadline) {
            (Some(reply), _) => self.answered(id, parked.request_bytes, reply),
            (None, Some(deadline)) => self.park(id, parked.awaited, parked.request_bytes, deadline),
            // Not reached: without a deadline the request was answered above.
            (None, None) => {}
        }
    }

    /// Ends the handshakes and waits whose deadlines passed by `now`.
    fn expire(&mut self, now: Instant) {
        while let Some(&(at, id)) = self.deadlines.first() {
            if at > now {
                return;
            }
            let Some(conn) = self.conns.get(&id) else {
                self.deadlines.pop_first();
                continue;
            };
            match conn.phase {
                Phase::Serving(_) => self.look_again(id, true),
                Phase::Hello | Phase::Proof(_) => {
                    let timed_out = io::Error::new(
                        ErrorKind::TimedOut,
                        format!("no handshake within {:?}", self.shared.handshake),
                    );
                    self.refused(id, ServerHandshakeError::Io(timed_out));
                    self.close(id, Ending::Refused);
                }
            }
            // Whatever happened, this deadline is spent.
            self.deadlines.remove(&(at, id));
        }
    }

    /// Closes connection `id` for `ending`; a member's departure is recorded.
    fn close(&mut self, id: usize, ending: Ending) {
        let Some((peer, phase)) = self.remove(id) else {
            return;
        };
        match (phase, ending) {
            (Phase::Serving(Some(rank)), ending) => {
                let lost = match ending {
                    Ending::Bye => None,
                    Ending::Failed(FrameError::Io(e)) if e.kind() == ErrorKind::UnexpectedEof => {
                        Some("its process exited or crashed".to_string())
                    }
                    Ending::Failed(e) => Some(e.to_string()),
                    Ending::Refused => Some("it closed the connection".to_string()),
                };
                let wake = self.shared.departed(rank, peer, id, lost);
                self.wake(wake);
            }
            (Phase::Hello | Phase::Proof(_), Ending::Failed(e)) => {
                self.log_handshake_failure(peer, e.into());
            }
            _ => {}
        }
    }

    /// Drops connection `id` and everything the loop holds for it: its peer and phase.
    fn remove(&mut self, id: usize) -> Option<(SocketAddr, Phase)> {
        self.unpark(id);
        self.clear_deadline(id);
        self.pending.retain(|p| *p != id);
        let mut conn = self.conns.remove(&id)?;
        let _ = self.poll.registry().deregister(&mut conn.stream);
        self.count();
        Some((conn.peer, conn.phase))
    }
}
