//! Point-to-point messages: tagged byte messages from one rank of a group to another.
//!
//! Every rank has a [`Mailbox`] of the messages sent to it, queued by sender. Between threads of
//! one process ([`LocalP2p`]) a send puts the message straight into the receiver's mailbox.
//! Between processes ([`TcpP2p`]) every rank listens on an endpoint of its own, opened with the
//! group (its address in the store under the group's tag); a sender opens one authenticated
//! connection per receiver, on first use, and writes framed messages to it; on the receiver a thread per incoming connection
//! reads them into the mailbox as they come. Receives therefore never wait on the order in which
//! the two programs reach their calls: a send completes once its bytes are written, whether or
//! not the receiver has reached its `recv`, so two ranks that send to each other at the same time
//! cannot deadlock, and one connection per direction keeps every pair's messages in order.
//!
//! Messages with the same sender and tag are received in the order they were sent; a receive
//! takes the oldest message of its sender with its tag. Each carries its element type, and a
//! receive into a buffer of another length or type fails naming both.
//!
//! Between processes of one host whose group moves its collectives through shared memory, the
//! same framed messages travel through a shared-memory pipe instead (`pipe.rs`): the sender
//! creates it on first use and hands it over the receiver's abstract Unix socket, to a receiver
//! that checks who connected (its user and process id, as the kernel records them, against the
//! id that rank published in the job's store).
//!
//! Nothing here waits without a deadline: the caller (the process group) passes the deadline
//! and an `interrupt` check (the heartbeat's verdict, the job's abort record) that every wait
//! calls between short slices.

use crate::error::RendezvousError;
use std::collections::{HashMap, VecDeque};
use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsFd;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::pipe::{PipeReader, PipeWriter};
use crate::config::JobToken;
use crate::store::auth::{self, Purpose, RefuseReason};
use crate::store::StoreClient;
use crate::types::{DType, Rank, WorldSize};
use crate::{DdpError, Result};

/// How long one wait lasts before the caller's interrupt check runs again.
pub(crate) const SLICE: Duration = Duration::from_millis(50);

/// How long an idle endpoint sleeps at most (a closing endpoint wakes it at once, a new
/// sender too: the bound only keeps a wait from being endless).
const ACCEPT_IDLE: Duration = Duration::from_secs(30);

/// The header before every message on a connection: tag, element type, sequence number, length.
const MSG_HEADER: usize = 24;
/// The largest message a receiver accepts (a corrupt length is refused before it allocates).
const MAX_MESSAGE: u64 = 1 << 40;

/// A message as it arrived.
#[derive(Debug)]
pub(crate) struct Message {
    pub(crate) tag: u32,
    pub(crate) dtype: DType,
    pub(crate) bytes: Vec<u8>,
}

/// Why a sender's messages stopped coming.
#[derive(Debug, Clone)]
pub(crate) enum Closed {
    /// The connection ended or failed (the sender exited, crashed, or its node went away).
    Link(ErrorKind),
    /// The sender broke the message protocol.
    Protocol(String),
}

#[derive(Debug, Default)]
struct MailState {
    queues: HashMap<Rank, VecDeque<Message>>,
    closed: HashMap<Rank, Closed>,
}

/// The messages sent to one rank, by sender (its place in the group).
#[derive(Debug, Default)]
pub(crate) struct Mailbox {
    state: Mutex<MailState>,
    arrived: Condvar,
    /// Buffers of large messages already received, for the next ones (a fresh one costs a page
    /// fault per 4 KiB as it fills).
    spare: Mutex<Vec<Vec<u8>>>,
}

/// Messages below this size get fresh buffers.
const SPARE_MIN: usize = 64 << 10;
/// Most spare buffers a mailbox keeps.
const SPARE_MAX: usize = 4;

/// What [`Mailbox::take`] found.
#[derive(Debug)]
pub(crate) enum Take {
    /// The oldest message of the sender with the tag.
    Got(Message),
    /// No such message, and the sender's messages stopped coming.
    Closed(Closed),
    /// No such message yet.
    Empty,
}

impl Mailbox {
    fn lock(&self) -> MutexGuard<'_, MailState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A buffer of `len` bytes for an arriving message (contents unspecified).
    pub(crate) fn buffer(&self, len: usize) -> Vec<u8> {
        if len >= SPARE_MIN {
            let mut spare = self.spare.lock().unwrap_or_else(|p| p.into_inner());
            let fits = spare
                .iter()
                .position(|b| b.len() == len)
                .or_else(|| spare.iter().position(|b| b.capacity() >= len));
            if let Some(i) = fits {
                let mut b = spare.swap_remove(i);
                b.resize(len, 0);
                return b;
            }
        }
        vec![0u8; len]
    }

    /// Takes back the buffer of a message its receiver has copied out.
    pub(crate) fn recycle(&self, bytes: Vec<u8>) {
        if bytes.len() >= SPARE_MIN {
            let mut spare = self.spare.lock().unwrap_or_else(|p| p.into_inner());
            if spare.len() < SPARE_MAX {
                spare.push(bytes);
            }
        }
    }

    pub(crate) fn deliver(&self, from: Rank, msg: Message) {
        self.lock().queues.entry(from).or_default().push_back(msg);
        self.arrived.notify_all();
    }

    pub(crate) fn close(&self, from: Rank, why: Closed) {
        self.lock().closed.entry(from).or_insert(why);
        self.arrived.notify_all();
    }

    /// Takes the oldest message from `from` with `tag`, waiting up to `wait` for it.
    pub(crate) fn take(&self, from: Rank, tag: u32, wait: Duration) -> Take {
        let deadline = Instant::now() + wait;
        let mut st = self.lock();
        loop {
            if let Some(q) = st.queues.get_mut(&from) {
                if let Some(i) = q.iter().position(|m| m.tag == tag) {
                    if let Some(m) = q.remove(i) {
                        return Take::Got(m);
                    }
                }
            }
            if let Some(c) = st.closed.get(&from) {
                return Take::Closed(c.clone());
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Take::Empty;
            }
            st = self
                .arrived
                .wait_timeout(st, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }
}

/// Point-to-point between the threads of one process: every rank's mailbox, shared.
#[derive(Debug)]
pub(crate) struct LocalP2p {
    place: Rank,
    boxes: Arc<[Mailbox]>,
}

impl LocalP2p {
    /// One per rank of an in-process group of `world`.
    pub(crate) fn group(world: WorldSize) -> Vec<Self> {
        let boxes: Arc<[Mailbox]> = world.ranks().map(|_| Mailbox::default()).collect();
        world
            .ranks()
            .map(|place| Self {
                place,
                boxes: Arc::clone(&boxes),
            })
            .collect()
    }

    pub(crate) fn send(&self, dst: Rank, tag: u32, dtype: DType, bytes: &[u8]) {
        if let Some(b) = self.boxes.get(dst.index()) {
            b.deliver(
                self.place,
                Message {
                    tag,
                    dtype,
                    bytes: bytes.to_vec(),
                },
            );
        }
    }

    pub(crate) fn mailbox(&self) -> &Mailbox {
        &self.boxes[self.place.index()]
    }
}

impl Drop for LocalP2p {
    fn drop(&mut self) {
        // This rank's messages stop: every other rank sees it closed (threads that exit).
        for (i, b) in self.boxes.iter().enumerate() {
            if i != self.place.index() {
                b.close(self.place, Closed::Link(ErrorKind::ConnectionAborted));
            }
        }
    }
}

/// How a send failed, for the process group to name.
#[derive(Debug)]
pub(crate) enum SendError {
    /// Connecting or writing failed (the receiver is gone).
    Link(ErrorKind),
    /// The deadline passed while the receiver did not take the bytes.
    Timeout,
    /// The interrupt check stopped the send.
    Interrupted(DdpError),
    /// The endpoint could not be reached or refused this rank (setup errors, named).
    Setup(DdpError),
}

/// A connection that sends take in turn.
type Locked<T> = Arc<Mutex<T>>;

/// Where an outgoing connection's bytes go.
#[derive(Debug)]
enum Link {
    Tcp(TcpStream),
    Pipe(PipeWriter),
}

impl Link {
    fn shutdown(&self) {
        match self {
            Self::Tcp(s) => {
                let _ = s.shutdown(Shutdown::Both);
            }
            Self::Pipe(p) => p.shutdown(),
        }
    }
}

impl Write for Link {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        match self {
            Self::Tcp(s) => s.write(buf),
            Self::Pipe(p) => p.write(buf),
        }
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// One outgoing connection and its next sequence number.
#[derive(Debug)]
struct Outgoing {
    stream: Link,
    seq: u64,
    broken: Option<ErrorKind>,
}

/// Point-to-point between processes (see the module docs).
#[derive(Debug)]
pub(crate) struct TcpP2p {
    place: Rank,
    size: WorldSize,
    tag: String,
    store: Arc<StoreClient>,
    token: JobToken,
    mailbox: Arc<Mailbox>,
    /// Outgoing connections by receiver, over shared memory or not.
    outgoing: Mutex<HashMap<(Rank, bool), Locked<Outgoing>>>,
    /// The places this endpoint reaches through shared memory, by place (those of its host,
    /// when the group's collectives use shared memory there); none without a shared-memory
    /// socket.
    shm: Vec<bool>,
    /// Whether sends go through shared memory now (`shm`, unless the bench switched to TCP).
    sends_by_shm: AtomicBool,
    /// Clones of the incoming connections, so that dropping the endpoint ends their readers.
    incoming: Arc<Mutex<Vec<TcpStream>>>,
    /// Raised by [`close`](Self::close), which wakes the acceptor: it sleeps until a sender or
    /// this arrives (thousands of ranks polling their endpoints every few milliseconds were
    /// most of a large job's work on one machine).
    stop: Arc<crate::sys::Alarm>,
    acceptor: Option<JoinHandle<()>>,
}

/// The store key under which place `place` of the group tagged `tag` publishes its endpoint.
fn endpoint_key(tag: &str, place: Rank) -> String {
    format!("{tag}/p2p/{place}")
}

/// The store key of place `place`'s shared-memory socket.
fn pipe_key(tag: &str, place: Rank) -> String {
    format!("{tag}/p2p-shm/{place}")
}

/// The process id that place `place` published with its transport (`comm/tcp/shm/setup.rs`).
fn published_pid(store: &StoreClient, tag: &str, place: Rank) -> Option<u32> {
    let raw = store.get(&format!("{tag}/transport/{place}")).ok()?;
    let text = String::from_utf8_lossy(&raw).into_owned();
    text.split_whitespace().nth(1)?.parse().ok()
}

impl TcpP2p {
    /// Opens this rank's endpoint: listens (on a shared-memory socket too when `same_host` has
    /// other places: those of this host, when the group's collectives go through shared memory
    /// there), publishes the address, accepts senders on a thread.
    pub(crate) fn open(
        store: Arc<StoreClient>,
        token: JobToken,
        (place, size): (Rank, WorldSize),
        tag: &str,
        same_host: &[Rank],
    ) -> Result<Self> {
        let listener = TcpListener::bind(SocketAddr::new(store.local_ip()?, 0))?;
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let mut shm = vec![false; size.as_usize()];
        for r in same_host.iter().filter(|&&r| r != place) {
            if let Some(s) = shm.get_mut(r.index()) {
                *s = true;
            }
        }
        let any = shm.contains(&true);
        let pipes = if any {
            let name = format!("burn-ddp-p2p-{:032x}", rand::random::<u128>());
            let l = UnixListener::bind_addr(&std::os::unix::net::SocketAddr::from_abstract_name(
                name.as_bytes(),
            )?)?;
            l.set_nonblocking(true)?;
            store.set(&pipe_key(tag, place), name.as_bytes())?;
            Some(l)
        } else {
            None
        };
        let mailbox = Arc::new(Mailbox::default());
        let incoming = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(crate::sys::Alarm::new()?);
        let acceptor = {
            let ends = Ends {
                token: token.clone(),
                size,
                mailbox: Arc::clone(&mailbox),
                incoming: Arc::clone(&incoming),
                stop: Arc::clone(&stop),
                store: Arc::clone(&store),
                tag: tag.to_string(),
            };
            std::thread::Builder::new()
                .name(format!("burn-ddp-p2p-{place}"))
                .spawn(move || accept_loop(&listener, pipes.as_ref(), &ends))?
        };
        store.set(&endpoint_key(tag, place), addr.to_string().as_bytes())?;
        Ok(Self {
            place,
            size,
            tag: tag.to_string(),
            store,
            token,
            mailbox,
            outgoing: Mutex::new(HashMap::new()),
            shm,
            sends_by_shm: AtomicBool::new(any),
            incoming,
            stop,
            acceptor: Some(acceptor),
        })
    }

    pub(crate) fn mailbox(&self) -> &Mailbox {
        &self.mailbox
    }

    /// Sends the following messages through shared memory or over TCP (the bench's
    /// comparison); returns whether shared memory is used.
    pub(crate) fn send_by_shm(&self, on: bool) -> bool {
        let on = on && self.shm.contains(&true);
        self.sends_by_shm.store(on, Ordering::SeqCst);
        on
    }

    /// Whether sends go through shared memory now.
    pub(crate) fn sends_by_shm(&self) -> bool {
        self.sends_by_shm.load(Ordering::SeqCst)
    }

    /// The value of `key` in the store, waited for in slices.
    fn published(
        &self,
        key: &str,
        deadline: Instant,
        interrupt: &dyn Fn() -> Option<DdpError>,
    ) -> std::result::Result<Vec<u8>, SendError> {
        loop {
            match self.store.get_timeout(key, SLICE) {
                Ok(raw) => return Ok(raw),
                Err(DdpError::Rendezvous(RendezvousError::StoreTimeout { .. })) => {
                    if let Some(e) = interrupt() {
                        return Err(SendError::Interrupted(e));
                    }
                    if Instant::now() >= deadline {
                        return Err(SendError::Timeout);
                    }
                }
                Err(e) => return Err(SendError::Setup(e)),
            }
        }
    }

    /// A shared-memory pipe to `dst`: connects to its socket, says which rank this is, and
    /// hands it the pipe.
    fn pipe_to(
        &self,
        dst: Rank,
        deadline: Instant,
        interrupt: &dyn Fn() -> Option<DdpError>,
    ) -> std::result::Result<Link, SendError> {
        let raw = self.published(&pipe_key(&self.tag, dst), deadline, interrupt)?;
        let link = |e: std::io::Error| SendError::Link(e.kind());
        let addr = std::os::unix::net::SocketAddr::from_abstract_name(&raw).map_err(link)?;
        let mut sock = UnixStream::connect_addr(&addr).map_err(link)?;
        sock.write_all(&self.place.0.to_le_bytes()).map_err(link)?;
        PipeWriter::create(sock).map(Link::Pipe).map_err(link)
    }

    /// The connection to `dst` (through shared memory if `by_shm`), opened on first use.
    fn connection(
        &self,
        dst: Rank,
        by_shm: bool,
        deadline: Instant,
        interrupt: &dyn Fn() -> Option<DdpError>,
    ) -> std::result::Result<Arc<Mutex<Outgoing>>, SendError> {
        let mut map = self.outgoing.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(c) = map.get(&(dst, by_shm)) {
            return Ok(Arc::clone(c));
        }
        if by_shm {
            let c = Arc::new(Mutex::new(Outgoing {
                stream: self.pipe_to(dst, deadline, interrupt)?,
                seq: 0,
                broken: None,
            }));
            map.insert((dst, true), Arc::clone(&c));
            return Ok(c);
        }
        let key = endpoint_key(&self.tag, dst);
        let raw = self.published(&key, deadline, interrupt)?;
        let addr: SocketAddr = std::str::from_utf8(&raw)
            .ok()
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| {
                SendError::Setup(DdpError::Rendezvous(RendezvousError::Protocol {
                    rank: self.place,
                    peer: self.store.addr(),
                    error: crate::wire::WireError::InvalidValue {
                        what: "published point-to-point address",
                    },
                }))
            })?;
        let left = deadline.saturating_duration_since(Instant::now());
        let mut stream = TcpStream::connect_timeout(&addr, left.max(Duration::from_millis(1)))
            .map_err(|e| SendError::Link(e.kind()))?;
        stream
            .set_nodelay(true)
            .map_err(|e| SendError::Link(e.kind()))?;
        auth::client_handshake(
            &mut stream,
            Purpose::Transport,
            &self.token,
            self.place,
            self.size,
            deadline.min(Instant::now() + Duration::from_secs(10)),
        )
        .map_err(SendError::Setup)?;
        stream
            .set_write_timeout(Some(SLICE))
            .map_err(|e| SendError::Link(e.kind()))?;
        let c = Arc::new(Mutex::new(Outgoing {
            stream: Link::Tcp(stream),
            seq: 0,
            broken: None,
        }));
        map.insert((dst, false), Arc::clone(&c));
        Ok(c)
    }

    /// Sends `bytes` to `dst` with `tag`; returns the message's sequence number on the link.
    pub(crate) fn send(
        &self,
        dst: Rank,
        tag: u32,
        dtype: DType,
        bytes: &[u8],
        deadline: Instant,
        interrupt: &dyn Fn() -> Option<DdpError>,
    ) -> std::result::Result<u64, SendError> {
        let by_shm = self.sends_by_shm() && self.shm.get(dst.index()).copied().unwrap_or(false);
        let conn = self.connection(dst, by_shm, deadline, interrupt)?;
        let mut out = conn.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(kind) = out.broken {
            return Err(SendError::Link(kind));
        }
        out.seq += 1;
        let seq = out.seq;
        let mut header = [0u8; MSG_HEADER];
        header[0..4].copy_from_slice(&tag.to_le_bytes());
        header[4] = dtype.code();
        header[8..16].copy_from_slice(&seq.to_le_bytes());
        header[16..24].copy_from_slice(&(bytes.len() as u64).to_le_bytes());
        let result = write_all(&mut out.stream, &header, deadline, interrupt)
            .and_then(|()| write_all(&mut out.stream, bytes, deadline, interrupt));
        if let Err(e) = &result {
            // A message cut short cannot be resumed: the link is unusable.
            out.broken = Some(match e {
                SendError::Link(kind) => *kind,
                _ => ErrorKind::Interrupted,
            });
            out.stream.shutdown();
        }
        result.map(|()| seq)
    }

    /// Closes every connection (the peers see this rank's messages end).
    pub(crate) fn close(&self) {
        self.stop.raise();
        let out = self.outgoing.lock().unwrap_or_else(|p| p.into_inner());
        for c in out.values() {
            c.lock()
                .unwrap_or_else(|p| p.into_inner())
                .stream
                .shutdown();
        }
        for s in self
            .incoming
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
        {
            let _ = s.shutdown(Shutdown::Both);
        }
    }
}

impl Drop for TcpP2p {
    fn drop(&mut self) {
        self.close();
        if let Some(a) = self.acceptor.take() {
            let _ = a.join();
        }
    }
}

/// Writes all of `bytes` before `deadline`, calling `interrupt` between slices.
fn write_all(
    stream: &mut Link,
    mut bytes: &[u8],
    deadline: Instant,
    interrupt: &dyn Fn() -> Option<DdpError>,
) -> std::result::Result<(), SendError> {
    while !bytes.is_empty() {
        match stream.write(bytes) {
            Ok(0) => return Err(SendError::Link(ErrorKind::WriteZero)),
            Ok(n) => bytes = &bytes[n..],
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                if let Some(e) = interrupt() {
                    return Err(SendError::Interrupted(e));
                }
                if Instant::now() >= deadline {
                    return Err(SendError::Timeout);
                }
            }
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(SendError::Link(e.kind())),
        }
    }
    Ok(())
}

/// What the endpoint's accepting thread needs.
struct Ends {
    token: JobToken,
    size: WorldSize,
    mailbox: Arc<Mailbox>,
    incoming: Arc<Mutex<Vec<TcpStream>>>,
    stop: Arc<crate::sys::Alarm>,
    store: Arc<StoreClient>,
    tag: String,
}

/// Starts a thread that reads `from`'s messages from `link` into the mailbox.
fn spawn_reader(ends: &Ends, from: Rank, link: impl Read + Send + 'static) {
    let mailbox = Arc::clone(&ends.mailbox);
    let spawned = std::thread::Builder::new()
        .name(format!("burn-ddp-p2p-from-{from}"))
        .spawn(move || read_loop(link, from, &mailbox));
    if let Err(e) = spawned {
        tracing::warn!("point-to-point endpoint: no reader thread for rank {from}: {e}");
    }
}

/// Accepts senders (over TCP, and through shared memory when `pipes`) until `stop`; each gets
/// a reader thread.
fn accept_loop(listener: &TcpListener, pipes: Option<&UnixListener>, ends: &Ends) {
    let readable = crate::sys::Ready {
        read: true,
        write: false,
    };
    while !ends.stop.is_raised() {
        let mut idle = true;
        if let Some(pipes) = pipes {
            match pipes.accept() {
                Ok((sock, _)) => {
                    idle = false;
                    match accept_pipe(sock, ends) {
                        Ok((from, reader)) => spawn_reader(ends, from, reader),
                        Err(why) => tracing::warn!("refused a shared-memory pipe: {why}"),
                    }
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => {}
                Err(e) => tracing::debug!("point-to-point endpoint: accept failed: {e}"),
            }
        }
        match listener.accept() {
            Ok((s, peer)) => {
                idle = false;
                if let Some((from, s)) = accept_tcp(s, peer, ends) {
                    spawn_reader(ends, from, s);
                }
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => {}
            Err(e) => tracing::debug!("point-to-point endpoint: accept failed: {e}"),
        }
        if idle {
            let mut fds = vec![(listener.as_fd(), readable), (ends.stop.fd(), readable)];
            fds.extend(pipes.map(|p| (p.as_fd(), readable)));
            if let Err(e) = crate::sys::poll_set(&fds, ACCEPT_IDLE) {
                tracing::debug!("point-to-point endpoint: cannot wait for senders: {e}");
                std::thread::sleep(SLICE);
            }
        }
    }
}

/// A shared-memory pipe from the process at the other end of `sock`, if it proves to be the
/// rank it claims: the kernel's record of its user and process id must be this user and the id
/// that rank published in the store.
fn accept_pipe(sock: UnixStream, ends: &Ends) -> std::result::Result<(Rank, PipeReader), String> {
    sock.set_nonblocking(false).map_err(|e| e.to_string())?;
    sock.set_read_timeout(Some(Duration::from_secs(10)))
        .map_err(|e| e.to_string())?;
    let mut claim = [0u8; 4];
    (&sock)
        .read_exact(&mut claim)
        .map_err(|e| format!("no rank said: {e}"))?;
    let from = Rank(u32::from_le_bytes(claim));
    if !ends.size.contains(from) {
        return Err(format!("{from} is no rank of this group of {}", ends.size));
    }
    let (pid, uid) = crate::sys::shared::peer(&sock).map_err(|e| e.to_string())?;
    let expected = published_pid(&ends.store, &ends.tag, from);
    if uid != crate::sys::shared::user() || Some(pid) != expected {
        return Err(format!(
            "a process (pid {pid}, uid {uid}) claimed rank {from}, whose pid is {expected:?}"
        ));
    }
    let reader = PipeReader::accept(sock, ends.stop.flag())
        .map_err(|e| format!("rank {from}'s pipe: {e}"))?;
    Ok((from, reader))
}

/// The authenticated sender at the other end of `s`, or `None` (refused, logged).
fn accept_tcp(s: TcpStream, peer: SocketAddr, ends: &Ends) -> Option<(Rank, TcpStream)> {
    let size = ends.size;
    s.set_nonblocking(false).ok()?;
    let deadline = Instant::now() + Duration::from_secs(10);
    let from = match auth::server_handshake(&s, &[Purpose::Transport], &ends.token, deadline) {
        Ok(hello) if hello.world == size && size.contains(hello.rank) => {
            auth::welcome(&s).ok()?;
            hello.rank
        }
        Ok(hello) => {
            let _ = auth::refuse(&s, &RefuseReason::RankOutOfRange { world: size });
            tracing::warn!(
                "refused a point-to-point link from {peer}: it claims rank {} of {}, this \
                 group has {size} ranks",
                hello.rank,
                hello.world
            );
            return None;
        }
        Err(e) => {
            tracing::warn!("refused a point-to-point link from {peer}: {e}");
            return None;
        }
    };
    let _ = s.set_nodelay(true);
    if let Ok(clone) = s.try_clone() {
        ends.incoming
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(clone);
    }
    Some((from, s))
}

/// Reads `from`'s messages into `mailbox` until its connection ends.
fn read_loop(mut s: impl Read, from: Rank, mailbox: &Mailbox) {
    let mut expected = 1u64;
    loop {
        let mut header = [0u8; MSG_HEADER];
        if let Err(e) = s.read_exact(&mut header) {
            let kind = if e.kind() == ErrorKind::UnexpectedEof {
                ErrorKind::ConnectionAborted
            } else {
                e.kind()
            };
            mailbox.close(from, Closed::Link(kind));
            return;
        }
        let field = |r: std::ops::Range<usize>| {
            let mut b = [0u8; 8];
            b[..r.len()].copy_from_slice(&header[r]);
            u64::from_le_bytes(b)
        };
        let (tag, seq, len) = (field(0..4) as u32, field(8..16), field(16..24));
        let Some(dtype) = DType::from_code(header[4]) else {
            mailbox.close(
                from,
                Closed::Protocol(format!(
                    "message {seq} has unknown element type {}",
                    header[4]
                )),
            );
            return;
        };
        if seq != expected || len > MAX_MESSAGE {
            mailbox.close(
                from,
                Closed::Protocol(format!(
                    "message {seq} (expected {expected}) of {len} bytes (at most {MAX_MESSAGE})"
                )),
            );
            return;
        }
        expected += 1;
        let mut bytes = mailbox.buffer(len as usize);
        if let Err(e) = s.read_exact(&mut bytes) {
            mailbox.close(from, Closed::Link(e.kind()));
            return;
        }
        mailbox.deliver(from, Message { tag, dtype, bytes });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(tag: u32, b: u8) -> Message {
        Message {
            tag,
            dtype: DType::U8,
            bytes: vec![b],
        }
    }

    #[test]
    fn a_receive_takes_the_oldest_message_of_its_sender_and_tag() {
        let m = Mailbox::default();
        m.deliver(Rank(1), msg(7, 1));
        m.deliver(Rank(1), msg(8, 2));
        m.deliver(Rank(1), msg(7, 3));
        m.deliver(Rank(2), msg(7, 4));
        let got = |t: Take| match t {
            Take::Got(m) => m.bytes[0],
            other => panic!("{other:?}"),
        };
        assert_eq!(got(m.take(Rank(1), 8, Duration::ZERO)), 2);
        assert_eq!(got(m.take(Rank(1), 7, Duration::ZERO)), 1);
        assert_eq!(got(m.take(Rank(2), 7, Duration::ZERO)), 4);
        assert_eq!(got(m.take(Rank(1), 7, Duration::ZERO)), 3);
        assert!(matches!(m.take(Rank(1), 7, Duration::ZERO), Take::Empty));
    }

    #[test]
    fn messages_that_arrived_before_the_sender_left_are_still_received() {
        let m = Mailbox::default();
        m.deliver(Rank(0), msg(1, 9));
        m.close(Rank(0), Closed::Link(ErrorKind::ConnectionAborted));
        assert!(matches!(m.take(Rank(0), 1, Duration::ZERO), Take::Got(_)));
        assert!(matches!(
            m.take(Rank(0), 1, Duration::ZERO),
            Take::Closed(Closed::Link(ErrorKind::ConnectionAborted))
        ));
    }

    #[test]
    fn a_waiting_receive_wakes_when_the_message_arrives() {
        let m = Arc::new(Mailbox::default());
        let sender = {
            let m = Arc::clone(&m);
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(30));
                m.deliver(Rank(3), msg(5, 42));
            })
        };
        match m.take(Rank(3), 5, Duration::from_secs(10)) {
            Take::Got(msg) => assert_eq!(msg.bytes, [42]),
            other => panic!("{other:?}"),
        }
        sender.join().unwrap();
    }
}
