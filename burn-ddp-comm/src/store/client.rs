//! The store client: one authenticated connection to rank 0's store (or a fault-tolerant
//! job's launcher), requests serialised; or, for a fault-tolerant job whose store an etcd
//! cluster keeps, the same requests answered by etcd (`etcd.rs`).

use crate::error::{CollectiveError, RendezvousError};
use std::io::{self, ErrorKind};
use std::net::{IpAddr, SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::thread;
use std::time::{Duration, Instant};

use super::protocol::{Reply, Request, MAX_FRAME};
use crate::config::{JobToken, MasterAddr};
use crate::store::auth::{self, Purpose};
use crate::types::{AbortRecord, Rank, WorldSize};
use crate::wire::{self, FrameError, WireError};
use crate::{DdpError, Result};

/// Extra time a client waits for the reply to a blocking request beyond the request's own
/// deadline (the server answers `Timeout` at the deadline).
const REPLY_SLACK: Duration = Duration::from_secs(5);
/// Wait used for requests on a failure path (publishing or reading the abort record): they never
/// block on the server, and a failing job must not linger on them.
const FAILURE_WAIT: Duration = Duration::from_secs(1);

/// The outcome of a [`StoreClient::wait`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum WaitOutcome {
    /// Every key exists.
    Ready,
    /// The deadline passed; these keys are still missing.
    Missing(Vec<String>),
}

/// What carries a client's requests.
#[derive(Debug)]
enum Link {
    /// A connection to a store served by a burn-ddp process.
    Tcp(Mutex<TcpConn>),
    /// The job's keys on an etcd cluster.
    #[cfg(feature = "etcd")]
    Etcd(Box<super::etcd::EtcdLink>),
}

/// A connection to a burn-ddp store and what was read from it.
#[derive(Debug)]
struct TcpConn {
    stream: TcpStream,
    /// Bytes read and not taken as a reply yet (a reply may arrive in parts).
    input: Vec<u8>,
    /// Since when the reply to a request that got none in time is awaited, on a client that
    /// keeps its connection for late replies ([`StoreClient::keeping_late_replies`]).
    late: Option<Instant>,
    /// When a reply (late ones included) was last taken.
    answered: Option<Instant>,
}

impl TcpConn {
    fn new(stream: TcpStream) -> Self {
        Self {
            stream,
            input: Vec::new(),
            late: None,
            answered: None,
        }
    }

    /// Reads what has arrived, without waiting.
    fn read_arrived(&mut self) -> io::Result<()> {
        self.stream.set_nonblocking(true)?;
        let read = loop {
            match self.read_some() {
                Ok(()) => {}
                Err(e) if e.kind() == ErrorKind::WouldBlock => break Ok(()),
                Err(e) => break Err(e),
            }
        };
        self.stream.set_nonblocking(false)?;
        read
    }

    /// Reads until `input` holds a whole frame, and takes it; each read bounded by `deadline`.
    fn read_frame(&mut self, deadline: Instant) -> std::result::Result<(u8, Vec<u8>), FrameError> {
        loop {
            if let Some(frame) = self.take()? {
                return Ok(frame);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(FrameError::Io(ErrorKind::TimedOut.into()));
            }
            self.stream.set_read_timeout(Some(left))?;
            self.read_some()?;
        }
    }

    /// The first whole reply read, if any.
    fn take(&mut self) -> std::result::Result<Option<(u8, Vec<u8>)>, WireError> {
        let frame = wire::take_frame(&mut self.input, MAX_FRAME)?;
        if frame.is_some() {
            self.answered = Some(Instant::now());
        }
        Ok(frame)
    }

    /// One read into `input`.
    fn read_some(&mut self) -> io::Result<()> {
        let closed = "the store closed the connection";
        wire::read_more::<{ 16 * 1024 }>(&mut self.stream, &mut self.input, closed).map(drop)
    }
}

/// The most keys one [`StoreClient::get_many`] request carries: their values must fit one
/// reply frame (4 MiB), which 1,024 values of up to 4 KiB do.
pub(crate) const GET_MANY_KEYS: usize = 1024;

/// A connection to the store.
#[derive(Debug)]
pub(crate) struct StoreClient {
    addr: SocketAddr,
    rank: Rank,
    timeout: Duration,
    /// Extra time for a reply beyond the request's own wait.
    slack: Duration,
    /// A request got no reply in time or its connection failed: a late reply could still
    /// arrive and be taken for the next one's, so no request is sent on it again.
    broken: AtomicBool,
    /// How long a late reply is awaited on the same connection before it counts as broken;
    /// `None`: a request without a reply in time breaks it at once.
    keep_late: Option<Duration>,
    link: Link,
    /// The address its connection comes from, when the job chose one ([`MasterAddr::local`]).
    local: Option<IpAddr>,
    /// Every key of this client lies under `scope/`, and its abort record is the scope's (a
    /// fault-tolerant job's membership epoch, `ft/<n>`): `None` for the job's own keys.
    scope: Option<String>,
}

impl StoreClient {
    /// Connects to the store at `master`, retrying until `deadline` while nobody listens there.
    ///
    /// # Errors
    /// `MasterUnresolvable`, `MasterUnreachable` at the deadline, or the handshake's definitive
    /// errors (`TokenMismatch`, `ProtocolMismatch`, `WorldSizeMismatch`, `DuplicateRank`, ...).
    pub(crate) fn connect(
        master: &MasterAddr,
        purpose: Purpose,
        rank: Rank,
        world: WorldSize,
        token: &JobToken,
        timeout: Duration,
        deadline: Instant,
    ) -> Result<Self> {
        if let Some(etcd) = &master.etcd {
            return Self::connect_etcd(master, etcd, purpose, rank, token, timeout, deadline);
        }
        let started = Instant::now();
        let addrs = resolve(master, rank)?;
        if let Some(ip) = master.local {
            check_local(ip)?;
        }
        let mut backoff = Duration::from_millis(20);
        let mut last_error = io::Error::new(ErrorKind::TimedOut, "no connection attempt finished");
        loop {
            for addr in &addrs {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    break;
                }
                let attempt = left.min(Duration::from_secs(2));
                match connect_from(master.local, addr, attempt) {
                    Ok(mut stream) => {
                        stream.set_nodelay(true)?;
                        let hs_deadline = deadline.min(Instant::now() + Duration::from_secs(30));
                        match auth::client_handshake(
                            &mut stream,
                            purpose,
                            token,
                            rank,
                            world,
                            hs_deadline,
                        ) {
                            Ok(()) => {
                                return Ok(Self {
                                    addr: *addr,
                                    rank,
                                    timeout,
                                    slack: REPLY_SLACK,
                                    broken: AtomicBool::new(false),
                                    keep_late: None,
                                    link: Link::Tcp(Mutex::new(TcpConn::new(stream))),
                                    local: master.local,
                                    scope: None,
                                })
                            }
                            // The server went away mid-handshake (e.g. still starting): retry.
                            Err(DdpError::Io(e)) => last_error = e,
                            Err(definitive) => return Err(definitive),
                        }
                    }
                    Err(e) => last_error = e,
                }
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(DdpError::Rendezvous(RendezvousError::MasterUnreachable {
                    rank,
                    addr: master.to_string(),
                    waited: started.elapsed(),
                    last_error,
                }));
            }
            thread::sleep(backoff.min(left));
            backoff = (backoff * 2).min(Duration::from_millis(500));
        }
    }

    /// A client of the job's keys on the etcd cluster `etcd` (`master`'s); a presence
    /// connection ([`Purpose::Store`]) claims member id `rank` for this process.
    #[cfg(feature = "etcd")]
    fn connect_etcd(
        master: &MasterAddr,
        etcd: &crate::config::EtcdStore,
        purpose: Purpose,
        rank: Rank,
        token: &JobToken,
        timeout: Duration,
        deadline: Instant,
    ) -> Result<Self> {
        let started = Instant::now();
        let member = (purpose == Purpose::Store).then_some(rank);
        match super::etcd::EtcdLink::connect(etcd, token, member, deadline) {
            Ok(link) => Ok(Self {
                addr: link.addr(),
                rank,
                timeout,
                slack: REPLY_SLACK,
                broken: AtomicBool::new(false),
                keep_late: None,
                link: Link::Etcd(Box::new(link)),
                local: master.local,
                scope: None,
            }),
            Err(Ok(reason)) => Err(DdpError::Rendezvous(RendezvousError::StoreRefused {
                rank,
                reason,
            })),
            Err(Err(last_error)) => Err(DdpError::Rendezvous(RendezvousError::MasterUnreachable {
                rank,
                addr: etcd.to_string(),
                waited: started.elapsed(),
                last_error,
            })),
        }
    }

    /// Without the `etcd` feature, a store on etcd is refused, saying how to build with it.
    #[cfg(not(feature = "etcd"))]
    fn connect_etcd(
        _: &MasterAddr,
        _: &crate::config::EtcdStore,
        _: Purpose,
        _: Rank,
        _: &JobToken,
        _: Duration,
        _: Instant,
    ) -> Result<Self> {
        Err(DdpError::Config(crate::error::ConfigError::InvalidConfig {
            field: crate::config::env::ETCD_ENDPOINTS,
            reason: "names an etcd cluster, but this program was built without etcd support: \
                     enable the `etcd` feature of burn-ddp (or of burn-ddp-comm) and build \
                     again",
        }))
    }

    /// The client with `slack` as the extra time a reply may take beyond its request's wait
    /// (default 5 s): short for a client that must notice a silent store quickly.
    pub(crate) fn with_reply_slack(mut self, slack: Duration) -> Self {
        self.slack = slack;
        self
    }

    /// The client keeping its connection when a reply comes late, for up to `limit`: the
    /// request fails (`StoreLost`, timed out), a later one first takes the late reply (or fails
    /// at once while it has not come), and the connection breaks only when it has not come
    /// within `limit`. For a client whose requests are bounded well below what a busy store may
    /// take (the heartbeat's): thousands of such clients replacing their connections at once
    /// would only add to the store's load. A burn-ddp store's connection only; an etcd link
    /// has its own retries.
    pub(crate) fn keeping_late_replies(mut self, limit: Duration) -> Self {
        self.keep_late = Some(limit);
        self
    }

    /// The client with `timeout` as the bound of its requests that do not say their own
    /// (`set`, `add`, ...): short for a client that must notice a store it cannot reach.
    pub(crate) fn with_request_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// The client with every key under `scope/` and the scope's abort record for the job's (a
    /// group whose failures must not end the job: a fault-tolerant job's membership epoch).
    pub(crate) fn with_scope(mut self, scope: Option<String>) -> Self {
        self.scope = scope;
        self
    }

    /// The scope of this client's keys, if any.
    pub(crate) fn scope(&self) -> Option<&str> {
        self.scope.as_deref()
    }

    /// `key` as the store holds it.
    fn full(&self, key: &str) -> String {
        match &self.scope {
            Some(scope) => format!("{scope}/{key}"),
            None => key.to_owned(),
        }
    }

    /// `key` as this client's callers know it (without the scope).
    fn short(&self, key: String) -> String {
        match &self.scope {
            Some(scope) => match key.strip_prefix(scope.as_str()) {
                Some(rest) if rest.starts_with('/') => rest[1..].to_owned(),
                _ => key,
            },
            None => key,
        }
    }

    /// Whether a request failed in a way that leaves the connection unusable (no reply in time,
    /// an I/O error): every later request fails at once; connect again.
    pub(crate) fn is_broken(&self) -> bool {
        self.broken.load(Ordering::SeqCst)
    }

    /// When the store last answered this client (a late reply included, counted when taken);
    /// `None` before its first reply, and on etcd.
    pub(crate) fn last_answer(&self) -> Option<Instant> {
        match &self.link {
            Link::Tcp(conn) => lock(conn).answered,
            #[cfg(feature = "etcd")]
            Link::Etcd(_) => None,
        }
    }

    /// This client's rank.
    pub(crate) fn rank(&self) -> Rank {
        self.rank
    }

    /// The store's address.
    pub(crate) fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops renewing this client's presence lease on etcd, as a stopped process would.
    #[cfg(all(test, feature = "etcd"))]
    pub(crate) fn freeze_presence(&self) {
        if let Link::Etcd(etcd) = &self.link {
            etcd.freeze_presence();
        }
    }

    /// Whether this presence connection's lease on etcd expired (its process was stopped or
    /// cut off for longer than the lease): the job counts the process as gone for good. Never
    /// for a connection to a burn-ddp store (it closes with its process).
    pub(crate) fn presence_expired(&self) -> bool {
        match &self.link {
            Link::Tcp(_) => false,
            #[cfg(feature = "etcd")]
            Link::Etcd(etcd) => etcd.presence_expired(),
        }
    }

    /// Where to connect again to the same store: the address this client reached (no second
    /// name lookup), or the same etcd cluster; from the same local address.
    pub(crate) fn master(&self) -> MasterAddr {
        let master = match &self.link {
            Link::Tcp(_) => MasterAddr::new(self.addr.ip().to_string(), self.addr.port()),
            #[cfg(feature = "etcd")]
            Link::Etcd(etcd) => etcd.master(),
        };
        MasterAddr {
            local: self.local,
            ..master
        }
    }

    /// This host's address for the job: this end's address of the store connection (the one
    /// it chose, [`MasterAddr::local`], else the interface that reaches the master). The rank's
    /// listeners bind it.
    pub(crate) fn local_ip(&self) -> io::Result<IpAddr> {
        match &self.link {
            Link::Tcp(conn) => lock(conn).stream.local_addr().map(|a| a.ip()),
            #[cfg(feature = "etcd")]
            Link::Etcd(etcd) => match self.local {
                Some(ip) => Ok(ip),
                None => etcd.local_addr().map(|a| a.ip()),
            },
        }
    }

    fn lost(&self, source: io::Error) -> DdpError {
        DdpError::Rendezvous(RendezvousError::StoreLost {
            rank: self.rank,
            addr: self.addr,
            source,
        })
    }

    /// No reply in time (`what`): a lost store, not `StoreTimeout`, which readers take for the
    /// store's answer that a key is absent.
    fn unanswered(&self, what: String) -> DdpError {
        self.lost(io::Error::new(ErrorKind::TimedOut, what))
    }

    /// Sends a request and reads its reply; `wait` (plus the client's slack) bounds the reply
    /// time.
    fn call(
        &self,
        request: &Request,
        op: &'static str,
        key: &str,
        wait: Duration,
    ) -> Result<Reply> {
        self.exchange(request, op, key, wait, self.slack)
    }

    /// A request on a failure path (the abort record), which the server answers at once: a
    /// failing job must not linger on a store that went silent with its rank 0.
    fn call_on_failure(&self, request: &Request, op: &'static str) -> Result<Reply> {
        self.exchange(request, op, "", FAILURE_WAIT, FAILURE_WAIT.min(self.slack))
    }

    fn exchange(
        &self,
        request: &Request,
        op: &'static str,
        key: &str,
        wait: Duration,
        slack: Duration,
    ) -> Result<Reply> {
        let reply = match &self.link {
            Link::Tcp(conn) => self.tcp_exchange(conn, request, op, key, wait, slack)?,
            #[cfg(feature = "etcd")]
            Link::Etcd(etcd) => etcd.execute(request, wait, slack).map_err(|f| match f {
                // No reply at all: not the store's answer that a key is missing (a
                // `StoreTimeout`, which readers take for "absent").
                super::etcd::EtcdFailure::Timeout(last) => self.unanswered(format!(
                    "no member of the etcd cluster answered the store {op} within {:?}{}",
                    super::etcd::allowed(wait, slack),
                    last.map(|l| format!("; the last attempt: {l}"))
                        .unwrap_or_default()
                )),
                super::etcd::EtcdFailure::Lost(e) => self.lost(e),
            })?,
        };
        match reply {
            Reply::Aborted(record) => Err(DdpError::Collective(CollectiveError::JobAborted {
                rank: self.rank,
                during: None,
                record,
            })),
            Reply::Error(reason) => Err(DdpError::Rendezvous(RendezvousError::StoreRefused {
                rank: self.rank,
                reason,
            })),
            Reply::Rejected(reason) => Err(DdpError::Rendezvous(RendezvousError::StoreRequest {
                rank: self.rank,
                op,
                key: key.to_owned(),
                reason,
            })),
            other => Ok(other),
        }
    }

    /// One request and its reply on a connection to a burn-ddp store.
    fn tcp_exchange(
        &self,
        conn: &Mutex<TcpConn>,
        request: &Request,
        op: &'static str,
        key: &str,
        wait: Duration,
        slack: Duration,
    ) -> Result<Reply> {
        let mut conn = lock(conn);
        if self.is_broken() {
            return Err(self.lost(io::Error::new(
                ErrorKind::BrokenPipe,
                "an earlier request on this connection failed or got no reply in time",
            )));
        }
        let broken = |e| {
            self.broken.store(true, Ordering::SeqCst);
            e
        };
        if let Some(since) = conn.late {
            self.take_late_reply(&mut conn, since)?;
        }
        let (k, payload) = request.encode();
        conn.stream.set_write_timeout(Some(self.timeout))?;
        wire::write_frame(&mut conn.stream, k, &payload).map_err(|e| broken(self.lost(e)))?;
        let (k, payload) = match conn.read_frame(Instant::now() + wait + slack) {
            Ok(frame) => frame,
            Err(FrameError::Io(e))
                if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) =>
            {
                if self.keep_late.is_some() {
                    conn.late = Some(Instant::now());
                    return Err(self.unanswered(format!(
                        "no reply to the store {op} within {:?} (the connection is kept for \
                         its late reply)",
                        wait + slack
                    )));
                }
                return Err(broken(DdpError::Rendezvous(
                    RendezvousError::StoreTimeout {
                        rank: self.rank,
                        op,
                        key: key.to_owned(),
                        waited: wait + slack,
                    },
                )));
            }
            Err(FrameError::Io(e)) => return Err(broken(self.lost(e))),
            Err(FrameError::Wire(error)) => return Err(broken(self.protocol(error))),
        };
        Reply::decode(k, &payload).map_err(|error| self.protocol(error))
    }

    /// Takes the late reply to an earlier request if it has come (dropping it: its request
    /// already failed). Without waiting: while the reply is awaited within the client's limit,
    /// the request fails at once (the connection kept), so that a client whose store is slow
    /// or silent spends no more than one request's bound per check; past the limit, or when
    /// the connection failed, it is broken.
    fn take_late_reply(&self, conn: &mut TcpConn, since: Instant) -> Result<()> {
        let broken = |e| {
            self.broken.store(true, Ordering::SeqCst);
            e
        };
        let limit = self.keep_late.unwrap_or_default();
        conn.read_arrived().map_err(|e| broken(self.lost(e)))?;
        match conn.take() {
            Ok(Some(_)) => {
                conn.late = None;
                Ok(())
            }
            Ok(None) if since.elapsed() < limit => Err(self.unanswered(format!(
                "the reply to an earlier request has not come yet (awaited for {:?}, up to \
                 {limit:?})",
                since.elapsed()
            ))),
            Ok(None) => Err(broken(self.unanswered(format!(
                "the reply to an earlier request did not come within {limit:?}"
            )))),
            Err(error) => Err(broken(self.protocol(error))),
        }
    }

    /// A reply whose bytes are not a valid frame or reply.
    fn protocol(&self, error: WireError) -> DdpError {
        DdpError::Rendezvous(RendezvousError::Protocol {
            rank: self.rank,
            peer: self.addr,
            error,
        })
    }

    fn unexpected(&self, reply: &Reply) -> DdpError {
        let _ = reply;
        DdpError::Rendezvous(RendezvousError::Protocol {
            rank: self.rank,
            peer: self.addr,
            error: WireError::InvalidValue {
                what: "reply kind for this request",
            },
        })
    }

    /// Stores `value` under `key`.
    pub(crate) fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        let req = Request::Set {
            key: self.full(key),
            value: value.to_vec(),
        };
        match self.call(&req, "set", key, self.timeout)? {
            Reply::Ok => Ok(()),
            other => Err(self.unexpected(&other)),
        }
    }

    /// Stores `value` under `key`, waiting at most `wait` for the reply (a rank on its way
    /// out must not linger on a silent store).
    pub(crate) fn set_bounded(&self, key: &str, value: &[u8], wait: Duration) -> Result<()> {
        let req = Request::Set {
            key: self.full(key),
            value: value.to_vec(),
        };
        match self.exchange(&req, "set", key, wait, Duration::ZERO)? {
            Reply::Ok => Ok(()),
            other => Err(self.unexpected(&other)),
        }
    }

    /// Returns the value of `key`, waiting up to the store timeout for it to appear.
    pub(crate) fn get(&self, key: &str) -> Result<Vec<u8>> {
        self.get_timeout(key, self.timeout)
    }

    /// Returns the value of `key`, waiting up to `timeout` for it to appear.
    pub(crate) fn get_timeout(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        let req = Request::Get {
            key: self.full(key),
            timeout,
        };
        match self.call(&req, "get", key, timeout)? {
            Reply::Value(v) => Ok(v),
            Reply::Timeout { .. } => Err(DdpError::Rendezvous(RendezvousError::StoreTimeout {
                rank: self.rank,
                op: "get",
                key: key.to_owned(),
                waited: timeout,
            })),
            other => Err(self.unexpected(&other)),
        }
    }

    /// Returns the values of `keys`, in order, waiting up to the client's request timeout for
    /// every one to appear: one request for up to [`GET_MANY_KEYS`] keys (one transaction of
    /// etcd's per 100), where a `get` each made a rank's start-up cost one round trip a peer.
    pub(crate) fn get_many(&self, keys: &[String]) -> Result<Vec<Vec<u8>>> {
        let mut values = Vec::with_capacity(keys.len());
        for chunk in keys.chunks(GET_MANY_KEYS) {
            let req = Request::GetMany {
                keys: chunk.iter().map(|k| self.full(k)).collect(),
                timeout: self.timeout,
            };
            let first = chunk.first().map(String::as_str).unwrap_or("");
            match self.call(&req, "get", first, self.timeout)? {
                Reply::Values(v) if v.len() == chunk.len() => values.extend(v),
                Reply::Timeout { missing } => {
                    return Err(DdpError::Rendezvous(RendezvousError::StoreTimeout {
                        rank: self.rank,
                        op: "get",
                        key: missing
                            .into_iter()
                            .map(|k| self.short(k))
                            .collect::<Vec<_>>()
                            .join(", "),
                        waited: self.timeout,
                    }))
                }
                other => return Err(self.unexpected(&other)),
            }
        }
        Ok(values)
    }

    /// Adds `delta` to the counter `key` and returns the new value.
    pub(crate) fn add(&self, key: &str, delta: i64) -> Result<i64> {
        let req = Request::Add {
            key: self.full(key),
            delta,
        };
        match self.call(&req, "add", key, self.timeout)? {
            Reply::Int(v) => Ok(v),
            other => Err(self.unexpected(&other)),
        }
    }

    /// Waits up to `timeout` for every key to exist.
    pub(crate) fn wait(&self, keys: &[String], timeout: Duration) -> Result<WaitOutcome> {
        let req = Request::Wait {
            keys: keys.iter().map(|k| self.full(k)).collect(),
            timeout,
        };
        let first = keys.first().map(String::as_str).unwrap_or("");
        match self.call(&req, "wait", first, timeout)? {
            Reply::Ok => Ok(WaitOutcome::Ready),
            Reply::Timeout { missing } => Ok(WaitOutcome::Missing(
                missing.into_iter().map(|k| self.short(k)).collect(),
            )),
            other => Err(self.unexpected(&other)),
        }
    }

    /// Counts this process's arrival at the barrier `name` of `n` participants (the counter
    /// `{name}/arrived`); the last to arrive sets `{name}/all`, the one key every participant
    /// then waits for, which this returns. One `add` a participant whatever `n`, where waiting
    /// on every participant's own key made the store check n keys for each of n waiters.
    pub(crate) fn arrive(&self, name: &str, n: u32) -> Result<String> {
        let all = format!("{name}/all");
        if self.add(&format!("{name}/arrived"), 1)? == i64::from(n) {
            self.set(&all, b"")?;
        }
        Ok(all)
    }

    /// Sets `key` to `desired` if it currently equals `expected` (`None` = absent) and returns
    /// the value after the operation.
    pub(crate) fn compare_set(
        &self,
        key: &str,
        expected: Option<&[u8]>,
        desired: &[u8],
    ) -> Result<Vec<u8>> {
        let req = Request::CompareSet {
            key: self.full(key),
            expected: expected.map(<[u8]>::to_vec),
            desired: desired.to_vec(),
        };
        match self.call(&req, "compare_set", key, self.timeout)? {
            Reply::Value(v) => Ok(v),
            other => Err(self.unexpected(&other)),
        }
    }

    /// Removes `key`; returns whether it existed.
    pub(crate) fn delete(&self, key: &str) -> Result<bool> {
        let req = Request::Delete {
            key: self.full(key),
        };
        match self.call(&req, "delete", key, self.timeout)? {
            Reply::Bool(b) => Ok(b),
            other => Err(self.unexpected(&other)),
        }
    }

    /// Publishes the job's first failure (ignored if one is already recorded); for a scoped
    /// client, the scope's.
    pub(crate) fn abort(&self, record: AbortRecord) -> Result<()> {
        let scope = self.scope.clone().unwrap_or_default();
        match self.call_on_failure(&Request::Abort { scope, record }, "abort") {
            Ok(_) | Err(DdpError::Collective(CollectiveError::JobAborted { .. })) => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// The job's abort record, if any (for a scoped client: the job's, else the scope's).
    pub(crate) fn abort_record(&self) -> Result<Option<AbortRecord>> {
        let scope = self.scope.clone().unwrap_or_default();
        match self.call_on_failure(&Request::GetAbort { scope }, "get_abort") {
            Ok(Reply::NoAbort) => Ok(None),
            Err(DdpError::Collective(CollectiveError::JobAborted { record, .. })) => {
                Ok(Some(record))
            }
            Ok(other) => Err(self.unexpected(&other)),
            Err(e) => Err(e),
        }
    }

    /// The abort record of `scope` (a fault-tolerant job's membership epoch), if any: why it
    /// ended.
    pub(crate) fn scope_record(&self, scope: &str) -> Result<Option<AbortRecord>> {
        let req = Request::GetAbort {
            scope: scope.to_owned(),
        };
        match self.call_on_failure(&req, "get_abort") {
            Ok(Reply::NoAbort) => Ok(None),
            Err(DdpError::Collective(CollectiveError::JobAborted { record, .. })) => {
                Ok(Some(record))
            }
            Ok(other) => Err(self.unexpected(&other)),
            Err(e) => Err(e),
        }
    }

    /// Records the first failure of `scope` (ignored if it has one).
    pub(crate) fn end_scope(&self, scope: &str, record: AbortRecord) -> Result<()> {
        let req = Request::Abort {
            scope: scope.to_owned(),
            record,
        };
        match self.call_on_failure(&req, "abort") {
            Ok(_) | Err(DdpError::Collective(CollectiveError::JobAborted { .. })) => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// Connections the store refused so far: (peer, reason).
    pub(crate) fn refusals(&self) -> Result<Vec<(String, String)>> {
        match self.call(&Request::Refusals, "refusals", "", self.timeout)? {
            Reply::Refusals(list) => Ok(list),
            other => Err(self.unexpected(&other)),
        }
    }

    /// Tells the store this rank leaves cleanly. Best effort, bounded by `timeout`.
    pub(crate) fn bye(&self, timeout: Duration) {
        // Without the `etcd` feature the match has one arm.
        #[allow(clippy::infallible_destructuring_match)]
        let conn = match &self.link {
            Link::Tcp(conn) => conn,
            #[cfg(feature = "etcd")]
            Link::Etcd(etcd) => {
                let _ = etcd.execute(&Request::Bye, timeout, Duration::ZERO);
                return;
            }
        };
        let mut conn = lock(conn);
        let deadline = Instant::now() + timeout;
        if self.is_broken() {
            return;
        }
        // A late reply first, so that the goodbye's is the one read after it.
        if conn.late.is_some() && conn.read_frame(deadline).is_err() {
            return;
        }
        let (k, p) = Request::Bye.encode();
        let _ = conn.stream.set_write_timeout(Some(timeout));
        if wire::write_frame(&mut conn.stream, k, &p).is_ok() {
            let _ = conn.read_frame(deadline);
        }
    }
}

fn lock(conn: &Mutex<TcpConn>) -> MutexGuard<'_, TcpConn> {
    // The connection holds no invariant a panic could break mid-way that a later request
    // would trust: each request writes a whole frame and reads whole replies.
    conn.lock().unwrap_or_else(|p| p.into_inner())
}

/// Whether `ip` is an address of this host, which connections can come from.
///
/// # Errors
/// It is not, naming the setting and the fix.
fn check_local(ip: IpAddr) -> Result<()> {
    std::net::UdpSocket::bind(SocketAddr::new(ip, 0))
        .map(drop)
        .map_err(|e| {
            DdpError::Config(crate::error::ConfigError::InvalidOption {
                option: "the local address (MasterAddr::local, BURN_DDP_LOCAL_ADDR)",
                reason: format!(
                    "{ip} cannot be used on this host ({e}): give one of this host's own \
                     addresses (`ip -brief address` lists them), or leave it unset"
                ),
            })
        })
}

/// A connection to `addr`, from `local` when given (bound before it connects).
fn connect_from(
    local: Option<IpAddr>,
    addr: &SocketAddr,
    timeout: Duration,
) -> io::Result<TcpStream> {
    let Some(local) = local else {
        return TcpStream::connect_timeout(addr, timeout);
    };
    use socket2::{Domain, Socket, Type};
    let socket = Socket::new(Domain::for_address(*addr), Type::STREAM, None)?;
    // Best effort: without it the bind picks the port.
    let _ = crate::sys::port_at_connect(std::os::fd::AsFd::as_fd(&socket));
    socket.bind(&SocketAddr::new(local, 0).into())?;
    socket.connect_timeout(&(*addr).into(), timeout)?;
    Ok(socket.into())
}

fn resolve(master: &MasterAddr, rank: Rank) -> Result<Vec<SocketAddr>> {
    let addrs: Vec<SocketAddr> = (master.host.as_str(), master.port)
        .to_socket_addrs()
        .map_err(|source| {
            DdpError::Rendezvous(RendezvousError::MasterUnresolvable {
                rank,
                host: master.host.clone(),
                source,
            })
        })?
        .collect();
    if addrs.is_empty() {
        return Err(DdpError::Rendezvous(RendezvousError::MasterUnresolvable {
            rank,
            host: master.host.clone(),
            source: io::Error::new(ErrorKind::NotFound, "no address"),
        }));
    }
    Ok(addrs)
}

/// Resolves the master address to the address rank 0 binds.
pub(crate) fn resolve_bind(master: &MasterAddr, rank: Rank) -> Result<SocketAddr> {
    let addrs = resolve(master, rank)?;
    // Prefer IPv4 (what most clusters' host names resolve to first for clients too).
    Ok(addrs
        .iter()
        .find(|a| a.is_ipv4())
        .copied()
        .unwrap_or(addrs[0]))
}
