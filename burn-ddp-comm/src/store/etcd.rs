//! The store of a fault-tolerant job on an etcd cluster (`burn-ddp run --fault-tolerant
//! --rdzv-backend etcd --rdzv-endpoint …`): no process of the job serves it, so the job
//! survives the loss of any node, and etcd's Raft keeps it while a majority of its members live.
//!
//! [`EtcdLink`] answers the store's [`Request`]s with the same [`Reply`]s as the launcher's
//! store (`server.rs`, lighthouse mode), so everything above `StoreClient` is the same on both:
//!
//! - a key `k` is `<prefix>k/<k>`, where the prefix comes from the job token (one per job id);
//! - a wait (`get`, `wait`) reads its keys and the abort records in one transaction and, while
//!   something is missing, watches the job's prefix for the next change, up to its deadline;
//! - `add` puts a part of its own into the counter's folder and reads the folder in the same
//!   transaction (no compare-and-swap that n processes adding at once retry n times each);
//!   `compare_set` is a transaction on the key's value;
//! - the first abort record of the job or of a scope is a put guarded by the key's absence;
//! - **presence**: a process's presence connection (`Purpose::Store`) is a lease kept alive
//!   from this process: `<prefix>member/<id>` records that the id was claimed (once, for the
//!   job's life), `<prefix>present/<id>` lives with the lease. [`gone_key`] of an id reads as
//!   present when the process said goodbye (a real key) or when its lease expired or was
//!   revoked (the process exited, crashed, or was stopped longer than [`LEASE_TTL`]).
//!
//! Every call is bounded: each RPC attempt by [`ATTEMPT`], failed attempts (a dead member, a
//! leader election) are retried on the other endpoints until the request's own deadline.

use std::collections::{HashMap, HashSet};
use std::io::{self, ErrorKind};
use std::net::{SocketAddr, ToSocketAddrs, UdpSocket};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, DeleteOptions, GetOptions, KeyValue, PutOptions,
    Txn, TxnOp, TxnOpResponse, WatchOptions,
};
use sha2::{Digest, Sha256};
use tokio::runtime::Runtime;

use super::protocol::{not_a_counter, Reply, Request};
use super::server::gone_key;
use crate::config::{EtcdStore, JobToken};
use crate::types::{AbortRecord, Rank};

/// How long a process's presence lease lives without a keep-alive: a process stopped (SIGSTOP)
/// for longer is gone for the job, as one that exited.
pub(crate) const LEASE_TTL: Duration = Duration::from_secs(10);
/// The interval of the connections' HTTP/2 keep-alive pings: above etcd's
/// `--grpc-keepalive-min-time` default (5 s), below which etcd closes the connection.
const KEEP_ALIVE: Duration = Duration::from_secs(10);
/// The bound of one RPC attempt; a failed one is retried until the request's deadline.
pub(crate) const ATTEMPT: Duration = Duration::from_secs(2);
/// The least time a request is given, however short its own wait: one attempt stuck on a member
/// that is cut off or dead ([`ATTEMPT`]; the client may route a request there until its
/// keep-alive finds it gone), the remaining majority's election of a leader (etcd's default
/// election timeout is 1 s, randomised up to twice that), and an attempt on the new leader. With
/// [`ATTEMPT`] alone, a process's first request after a member's loss could time out on that
/// member and the process take itself for cut off from a majority that was there (seen in the
/// chaos run on etcd: ranks 0 and 2 "cannot reach the job's store" while only node 1 was cut).
pub(crate) const FAILOVER: Duration = Duration::from_secs(5);

/// The time a request of its own `wait`, whose reply may take `slack` beyond it, is given in all
/// (what [`EtcdLink::execute`] waits, and what its timeout reports).
pub(crate) fn allowed(wait: Duration, slack: Duration) -> Duration {
    wait + slack.max(FAILOVER)
}
/// The longest a wait watches before it reads its keys again (a watch whose member died
/// stays silent).
const WATCH_SLICE: Duration = Duration::from_secs(1);
/// etcd refuses transactions of more than 128 operations (`--max-txn-ops`).
const TXN_OPS: usize = 100;
/// Keys of one folder (up to their last `/`) a wait watches one by one; more are watched as
/// the folder, with one watcher (a wait on every member's key would otherwise make a watcher
/// for each, one round trip each).
const WATCH_ONE_BY_ONE: usize = 8;
/// Parts of a counter (one per `add`) at whose multiples the `add` that finds them folds them
/// into the counter's base, so that a counter's folder stays small however often it is added to.
const COUNTER_FOLD: usize = 64;
/// What the key of a counter holds on etcd: its count is the sum of its folder
/// ([`EtcdLink::counter`]). Not 8 bytes, so never taken for a count.
const COUNTER: &[u8] = b"\0burn-ddp counter: the sum of its folder\0";

/// Why a request got no reply.
#[derive(Debug)]
pub(crate) enum EtcdFailure {
    /// No member answered within the request's deadline (with the last attempt's error, if
    /// one failed rather than stayed silent).
    Timeout(Option<String>),
    /// The cluster refused it or cannot be reached.
    Lost(io::Error),
}

impl EtcdFailure {
    /// The connection's I/O error for this failure.
    fn into_io(self) -> io::Error {
        match self {
            EtcdFailure::Timeout(None) => io::Error::new(
                ErrorKind::TimedOut,
                "no member of the etcd cluster answered",
            ),
            EtcdFailure::Timeout(Some(last)) => io::Error::new(
                ErrorKind::TimedOut,
                format!("no member of the etcd cluster answered; the last attempt: {last}"),
            ),
            EtcdFailure::Lost(e) => e,
        }
    }
}

type Outcome<T> = std::result::Result<T, EtcdFailure>;

fn runtime() -> io::Result<&'static Runtime> {
    static RT: OnceLock<std::result::Result<Runtime, String>> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("burn-ddp-etcd")
            .enable_all()
            .build()
            .map_err(|e| e.to_string())
    })
    .as_ref()
    .map_err(|e| io::Error::other(format!("could not start the etcd client's runtime: {e}")))
}

/// The key prefix of the job whose token is `token` (the token itself never reaches etcd).
pub(crate) fn job_prefix(token: &JobToken) -> String {
    let mut h = Sha256::new();
    h.update(b"burn-ddp etcd job prefix\0");
    h.update(token.expose().as_bytes());
    let digest = h.finalize();
    let hex: String = digest[..12].iter().map(|b| format!("{b:02x}")).collect();
    format!("burn-ddp/{hex}/")
}

/// Whether an etcd error may pass on another attempt (a member down, no leader yet).
fn transient(e: &etcd_client::Error) -> bool {
    use tonic::Code;
    match e {
        etcd_client::Error::GRpcStatus(s) => matches!(
            s.code(),
            Code::Unavailable
                // etcd's "too many requests" (its rate limit while it applies a backlog)
                | Code::ResourceExhausted
                | Code::DeadlineExceeded
                | Code::Unknown
                | Code::Internal
                | Code::Cancelled
                | Code::Aborted
        ),
        etcd_client::Error::TransportError(_)
        | etcd_client::Error::IoError(_)
        | etcd_client::Error::WatchError(_)
        | etcd_client::Error::LeaseKeepAliveError(_) => true,
        _ => false,
    }
}

/// Whether a failed attempt's error (its [`chain`]) is a connection the other side closed or
/// a TLS failure, rather than no answer.
fn closed_by_peer(error: &str) -> bool {
    let e = error.to_ascii_lowercase();
    [
        "broken pipe",
        "connection reset",
        "tls",
        "certificate",
        "handshake",
    ]
    .iter()
    .any(|m| e.contains(m))
}

/// Whether a TCP connection to `addr` opens (within a second).
fn reachable(addr: SocketAddr) -> bool {
    std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(1)).is_ok()
}

/// Why a cluster that accepts TCP connections closes this process's, and the fix, by what
/// this process gave (`last`: the last attempt's error).
fn refusal(store: &EtcdStore, last: &str) -> String {
    let sec = &store.security;
    let fix = if last.contains("invalid peer certificate") {
        "the members' certificates are not signed by the CA this process was given (--etcd-ca, \
         BURN_DDP_ETCD_CA): give the CA that signed them"
    } else if !store.is_tls() {
        "if the cluster serves TLS (etcd --cert-file), give its endpoints as https://host:port \
         and the CA that signed its certificates (--etcd-ca, BURN_DDP_ETCD_CA)"
    } else if sec.cert.is_none() {
        "if the cluster requires client certificates (etcd --client-cert-auth), give this \
         process one signed by the CA the cluster trusts (etcd --trusted-ca-file): --etcd-cert \
         and --etcd-key (BURN_DDP_ETCD_CERT, BURN_DDP_ETCD_KEY); if it does not serve TLS, give \
         its endpoints as host:port"
    } else {
        "the cluster does not accept this process's certificate (--etcd-cert, \
         BURN_DDP_ETCD_CERT): give one signed by the CA the cluster trusts (etcd \
         --trusted-ca-file), and check that --etcd-ca is the CA of the members' certificates"
    };
    format!("{store} accepts TCP connections but closes this process's ({last}): {fix}")
}

/// Why a cluster refused this process's requests (`error`: etcd's answer), and the fix when
/// it is about authentication.
fn refused(store: &EtcdStore, error: &str) -> String {
    let e = error.to_ascii_lowercase();
    let fix = if e.contains("user name is empty") || e.contains("token") {
        ": the cluster has authentication enabled; give an etcd user with --etcd-user \
         (BURN_DDP_ETCD_USER) and its password in BURN_DDP_ETCD_PASSWORD"
    } else if e.contains("authentication failed") {
        ": the cluster did not accept this user and password (--etcd-user, \
         BURN_DDP_ETCD_PASSWORD)"
    } else if e.contains("permission denied") {
        ": the user may not read and write the job's keys (burn-ddp/): grant its role \
         readwrite on them (etcdctl role grant-permission --prefix)"
    } else {
        ""
    };
    format!("{store} refused this process: {error}{fix}")
}

/// `e` and its sources, as one line.
fn chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let more = s.to_string();
        if !text.contains(&more) {
            text = format!("{text}: {more}");
        }
        source = s.source();
    }
    text
}

fn lost(what: &str, endpoints: &str, e: impl std::fmt::Display) -> EtcdFailure {
    EtcdFailure::Lost(io::Error::other(format!(
        "etcd cluster {endpoints}: {what}: {e}"
    )))
}

/// A presence lease of this process's member id.
#[derive(Debug)]
struct Presence {
    member: u32,
    lease: i64,
    keeper: tokio::task::JoinHandle<()>,
    said_bye: AtomicBool,
    /// The lease expired: the job counts this process as gone, for good.
    expired: Arc<AtomicBool>,
}

/// `options` with `store`'s TLS (its CA, and this process's certificate and key, read from
/// their files) and user.
///
/// `Err`: a file that cannot be read or holds no PEM, naming it and the option.
fn secured(
    mut options: ConnectOptions,
    store: &EtcdStore,
) -> std::result::Result<ConnectOptions, String> {
    use etcd_client::{Certificate, Identity, TlsOptions};
    let sec = &store.security;
    let read = |path: &std::path::Path, what: &str, option: &str| {
        let bytes = std::fs::read(path)
            .map_err(|e| format!("cannot read the {what} {} ({option}): {e}", path.display()))?;
        if !bytes.windows(11).any(|w| w == b"-----BEGIN ") {
            return Err(format!(
                "the {what} {} ({option}) is not a PEM file (-----BEGIN ...-----)",
                path.display()
            ));
        }
        Ok(bytes)
    };
    if store.is_tls() {
        let mut tls = TlsOptions::new();
        if let Some(ca) = &sec.ca {
            let pem = read(ca, "CA certificate", "--etcd-ca, BURN_DDP_ETCD_CA")?;
            tls = tls.ca_certificate(Certificate::from_pem(pem));
        }
        if let (Some(cert), Some(key)) = (&sec.cert, &sec.key) {
            let cert = read(
                cert,
                "client certificate",
                "--etcd-cert, BURN_DDP_ETCD_CERT",
            )?;
            let key = read(key, "client key", "--etcd-key, BURN_DDP_ETCD_KEY")?;
            tls = tls.identity(Identity::from_pem(cert, key));
        }
        options = options.with_tls(tls);
    }
    if let (Some(user), Some(password)) = (&sec.user, &sec.password) {
        // etcd's tokens expire (5 minutes by default): the client authenticates again.
        options = options
            .with_user(user.clone(), password.clone())
            .with_auto_token_refresh(true);
    }
    Ok(options)
}

/// One process's connection to the job's keys on an etcd cluster.
pub(crate) struct EtcdLink {
    client: Client,
    store: EtcdStore,
    prefix: String,
    endpoints: String,
    addr: SocketAddr,
    presence: Option<Presence>,
    adder: Adder,
}

/// The names of this connection's parts of counters: `{id:016x}-{n:x}`, `n` counting its
/// `add`s (the id is random; the part's put is guarded by its absence all the same).
struct Adder {
    id: u64,
    next: AtomicU64,
}

impl std::fmt::Debug for EtcdLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdLink")
            .field("endpoints", &self.endpoints)
            .field("prefix", &self.prefix)
            .field("presence", &self.presence.as_ref().map(|p| p.member))
            .finish()
    }
}

/// What a wait read: the job's or a scope's abort record, and each key's value.
struct Snapshot {
    revision: i64,
    abort: Option<AbortRecord>,
    values: Vec<Option<Vec<u8>>>,
}

impl EtcdLink {
    /// Connects to `store`'s cluster, trying until `deadline`; with `member`, claims that member
    /// id's presence (refused when the id was claimed before: ids are never reused).
    ///
    /// `Err(Ok(reason))`: refused; `Err(Err(e))`: unreachable until the deadline.
    pub(crate) fn connect(
        store: &EtcdStore,
        token: &JobToken,
        member: Option<Rank>,
        deadline: Instant,
    ) -> std::result::Result<Self, std::result::Result<String, io::Error>> {
        let rt = runtime().map_err(Err)?;
        let endpoints = store.endpoints.join(",");
        let addr = store
            .endpoints
            .iter()
            .map(|e| e.split_once("://").map_or(e.as_str(), |(_, rest)| rest))
            .find_map(|e| {
                let e = e.trim_end_matches('/');
                e.to_socket_addrs().ok().and_then(|mut a| a.next())
            })
            .ok_or_else(|| {
                Err(io::Error::new(
                    ErrorKind::NotFound,
                    format!("none of the etcd endpoints {endpoints} resolves"),
                ))
            })?;
        let urls: Vec<String> = store
            .endpoints
            .iter()
            .map(|e| {
                if e.contains("://") {
                    e.clone()
                } else {
                    format!("http://{e}")
                }
            })
            .collect();
        let options = secured(
            ConnectOptions::new()
                .with_connect_timeout(ATTEMPT)
                .with_timeout(ATTEMPT)
                // etcd sends GOAWAY ("too_many_pings") to a client that pings more often than
                // its --grpc-keepalive-min-time (5 s by default), which failed every request
                // on that connection (seen at 256 ranks); a dead member is found by each
                // request's own bound (ATTEMPT) anyway.
                .with_keep_alive(KEEP_ALIVE, ATTEMPT),
            store,
        )
        .map_err(Ok)?;
        let client = loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let attempt = rt.block_on(async {
                tokio::time::timeout(
                    left.min(ATTEMPT * 2),
                    Client::connect(urls.clone(), Some(options.clone())),
                )
                .await
            });
            let error = match attempt {
                Ok(Ok(c)) => break c,
                // With a user, connecting authenticates: a wrong user or password is final.
                Ok(Err(e)) if !transient(&e) => return Err(Ok(refused(store, &chain(&e)))),
                Ok(Err(e)) => chain(&e),
                Err(_) => "no answer".to_string(),
            };
            if Instant::now() >= deadline {
                return Err(Err(io::Error::new(ErrorKind::TimedOut, error)));
            }
            std::thread::sleep(Duration::from_millis(200).min(left));
        };
        let mut link = Self {
            client,
            store: store.clone(),
            prefix: job_prefix(token),
            endpoints,
            addr,
            presence: None,
            adder: Adder {
                id: rand::random(),
                next: AtomicU64::new(0),
            },
        };
        // A first read proves that a member answers (the client connects lazily). A cluster
        // that accepts TCP connections but closes this process's refuses it (TLS on one side
        // only, a client certificate missing or not trusted): said within FAILOVER, with the
        // fix, instead of at the deadline as an unreachable store.
        let first_read = |until| {
            link.run(until, |mut c, p| async move {
                c.get(format!("{p}abort"), None).await.map(|_| ())
            })
        };
        match first_read((Instant::now() + FAILOVER).min(deadline)) {
            Ok(()) => {}
            Err(EtcdFailure::Timeout(Some(last))) if closed_by_peer(&last) && reachable(addr) => {
                return Err(Ok(refusal(store, &last)));
            }
            Err(EtcdFailure::Timeout(_)) => first_read(deadline).map_err(|f| Err(f.into_io()))?,
            Err(EtcdFailure::Lost(e)) => return Err(Ok(refused(store, &e.to_string()))),
        }
        if let Some(member) = member {
            link.claim(member, deadline)?;
        }
        Ok(link)
    }

    /// Stops renewing this process's presence lease, as a stopped process would.
    #[cfg(test)]
    pub(crate) fn freeze_presence(&self) {
        if let Some(p) = &self.presence {
            p.keeper.abort();
        }
    }

    /// Whether this process's presence lease expired (it was stopped or cut off for longer
    /// than [`LEASE_TTL`]): the job counts it as gone for good.
    pub(crate) fn presence_expired(&self) -> bool {
        self.presence
            .as_ref()
            .is_some_and(|p| p.expired.load(Ordering::SeqCst))
    }

    /// The cluster, to connect to it again.
    pub(crate) fn master(&self) -> crate::config::MasterAddr {
        crate::config::MasterAddr::new(self.addr.ip().to_string(), self.addr.port())
            .with_etcd(self.store.clone())
    }

    /// An address of the cluster (the first endpoint), for messages.
    pub(crate) fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// This host's address on the route to the cluster: the interface the transport listens on.
    pub(crate) fn local_addr(&self) -> io::Result<SocketAddr> {
        let bind: SocketAddr = if self.addr.is_ipv4() {
            "0.0.0.0:0".parse().expect("a literal address")
        } else {
            "[::]:0".parse().expect("a literal address")
        };
        let s = UdpSocket::bind(bind)?;
        s.connect(self.addr)?;
        s.local_addr()
    }

    fn key(&self, key: &str) -> String {
        format!("{}k/{key}", self.prefix)
    }

    fn abort_key(&self, scope: &str) -> String {
        if scope.is_empty() {
            format!("{}abort", self.prefix)
        } else {
            format!("{}scope/{scope}", self.prefix)
        }
    }

    /// Runs `op` (given a client and the job prefix) until it succeeds, fails for good, or
    /// `deadline` passes; each attempt bounded by [`ATTEMPT`].
    fn run<T, F, Fut>(&self, deadline: Instant, op: F) -> Outcome<T>
    where
        F: Fn(Client, String) -> Fut,
        Fut: std::future::Future<Output = Result<T, etcd_client::Error>>,
    {
        let rt = runtime().map_err(EtcdFailure::Lost)?;
        rt.block_on(self.attempts(deadline, op))
    }

    async fn attempts<T, F, Fut>(&self, deadline: Instant, op: F) -> Outcome<T>
    where
        F: Fn(Client, String) -> Fut,
        Fut: std::future::Future<Output = Result<T, etcd_client::Error>>,
    {
        let mut backoff = Duration::from_millis(20);
        let mut last = None;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(EtcdFailure::Timeout(last));
            }
            let attempt = tokio::time::timeout(
                left.min(ATTEMPT),
                op(self.client.clone(), self.prefix.clone()),
            )
            .await;
            match attempt {
                Ok(Ok(v)) => return Ok(v),
                Ok(Err(e)) if !transient(&e) => {
                    return Err(lost("request refused", &self.endpoints, e))
                }
                Ok(Err(e)) => last = Some(chain(&e)),
                Err(_) => {}
            }
            let left = deadline.saturating_duration_since(Instant::now());
            tokio::time::sleep(backoff.min(left)).await;
            backoff = (backoff * 2).min(Duration::from_millis(400));
        }
    }

    /// Claims the presence of member id `member`: a lease kept alive from this process.
    fn claim(
        &mut self,
        member: Rank,
        deadline: Instant,
    ) -> std::result::Result<(), std::result::Result<String, io::Error>> {
        let failure = |f: EtcdFailure| Err(f.into_io());
        let ttl = i64::try_from(LEASE_TTL.as_secs()).unwrap_or(10);
        let lease = self
            .run(deadline, |mut c, _| async move {
                c.lease_grant(ttl, None).await.map(|r| r.id())
            })
            .map_err(failure)?;
        let id = member.0;
        let here = self.local_addr().map(|a| a.to_string()).unwrap_or_default();
        let claimed = self
            .run(deadline, |mut c, p| {
                let here = here.clone();
                async move {
                    let member_key = format!("{p}member/{id}");
                    let txn = Txn::new()
                        .when([Compare::create_revision(
                            member_key.clone(),
                            CompareOp::Equal,
                            0,
                        )])
                        .and_then([
                            TxnOp::put(member_key.clone(), here, None),
                            TxnOp::put(
                                format!("{p}present/{id}"),
                                "",
                                Some(PutOptions::new().with_lease(lease)),
                            ),
                        ])
                        .or_else([TxnOp::get(member_key, None)]);
                    let r = c.txn(txn).await?;
                    let first = match r.op_responses().into_iter().next() {
                        Some(TxnOpResponse::Get(g)) => g
                            .kvs()
                            .first()
                            .map(|kv| String::from_utf8_lossy(kv.value()).into_owned()),
                        _ => None,
                    };
                    Ok((r.succeeded(), first))
                }
            })
            .map_err(failure)?;
        if let (false, first) = claimed {
            let _ = self.run(Instant::now() + ATTEMPT, |mut c, _| async move {
                c.lease_revoke(lease).await.map(|_| ())
            });
            return Err(Ok(format!(
                "member id {id} was claimed by two processes ({} and {here}); a process that \
                 joins a running fault-tolerant job takes a fresh id (leave BURN_DDP_MEMBER_ID \
                 unset)",
                first.unwrap_or_else(|| "an earlier one".into())
            )));
        }
        let client = self.client.clone();
        let expired = Arc::new(AtomicBool::new(false));
        let keeper = runtime().map_err(Err)?.spawn(keep_alive(
            client,
            lease,
            id,
            self.endpoints.clone(),
            Arc::clone(&expired),
        ));
        self.presence = Some(Presence {
            member: id,
            lease,
            keeper,
            said_bye: AtomicBool::new(false),
            expired,
        });
        Ok(())
    }

    /// The etcd keys a wait on `keys` reads, and the index of the first of `keys`' own: first
    /// the abort records that end the wait (the job's, then each enclosing scope's), then per
    /// key its value and, for a [`gone_key`], its member and presence records.
    fn wait_reads(&self, keys: &[String]) -> (Vec<String>, usize) {
        let mut reads: Vec<String> = vec![self.abort_key("")];
        for k in keys {
            let mut at = 0;
            while let Some(i) = k[at..].find('/') {
                let scope = self.abort_key(&k[..at + i]);
                if !reads.contains(&scope) {
                    reads.push(scope);
                }
                at += i + 1;
            }
        }
        let first_key = reads.len();
        for k in keys {
            reads.push(self.key(k));
            if let Some(id) = gone_id(k) {
                reads.push(format!("{}member/{id}", self.prefix));
                reads.push(format!("{}present/{id}", self.prefix));
            }
        }
        (reads, first_key)
    }

    /// Reads `keys` (etcd keys) in as few transactions as etcd allows: the revision of the
    /// first, and each key's value.
    async fn read(
        &self,
        keys: &[String],
        deadline: Instant,
    ) -> Outcome<(i64, Vec<Option<Vec<u8>>>)> {
        let mut found: Vec<Option<Vec<u8>>> = Vec::with_capacity(keys.len());
        let mut revision = None;
        for chunk in keys.chunks(TXN_OPS) {
            let (rev, values) = self
                .attempts(deadline, |mut c, _| {
                    let ops: Vec<TxnOp> =
                        chunk.iter().map(|k| TxnOp::get(k.clone(), None)).collect();
                    async move {
                        let r = c.txn(Txn::new().and_then(ops)).await?;
                        let rev = r.header().map(|h| h.revision()).unwrap_or(0);
                        let values = r
                            .op_responses()
                            .into_iter()
                            .map(|op| match op {
                                TxnOpResponse::Get(g) => {
                                    g.kvs().first().map(|kv| kv.value().to_vec())
                                }
                                _ => None,
                            })
                            .collect::<Vec<_>>();
                        Ok((rev, values))
                    }
                })
                .await?;
            revision.get_or_insert(rev);
            found.extend(values);
        }
        Ok((revision.unwrap_or(0), found))
    }

    /// Reads what a wait on `keys` needs (`reads` and `first_key` from [`Self::wait_reads`]).
    async fn snapshot(
        &self,
        keys: &[String],
        reads: &[String],
        first_key: usize,
        deadline: Instant,
    ) -> Outcome<Snapshot> {
        let (revision, mut found) = self.read(reads, deadline).await?;
        let abort = found[..first_key]
            .iter()
            .flatten()
            .find_map(|v| decode_record(v));
        let mut values = Vec::with_capacity(keys.len());
        let mut at = first_key;
        for k in keys {
            let own = found[at].take();
            at += 1;
            let value = if gone_id(k).is_some() {
                let (claimed, present) = (found[at].is_some(), found[at + 1].is_some());
                at += 2;
                own.or_else(|| {
                    (claimed && !present).then(|| {
                        b"its presence lease expired or was revoked: its process exited, \
                          crashed, or was stopped longer than the lease"
                            .to_vec()
                    })
                })
            } else {
                own
            };
            values.push(value);
        }
        Ok(Snapshot {
            revision,
            abort,
            values,
        })
    }

    /// Waits until one of `keys` (etcd keys) changes after `revision`, for at most `wait`.
    async fn changed_after(&self, keys: &[String], revision: i64, wait: Duration) {
        let end = tokio::time::Instant::now() + wait;
        let pause = || {
            tokio::time::sleep_until(
                end.min(tokio::time::Instant::now() + Duration::from_millis(50)),
            )
        };
        let options = |folder: bool| {
            let o = WatchOptions::new().with_start_revision(revision + 1);
            if folder {
                o.with_prefix()
            } else {
                o
            }
        };
        let watches = watches(keys);
        let Some(((first, folder), rest)) = watches.split_first() else {
            return pause().await;
        };
        // One stream, one watcher per key (or folder of many keys): a write elsewhere in the
        // job (a heartbeat) does not wake this wait.
        let mut client = self.client.clone();
        let watched = tokio::time::timeout_at(end, async {
            let mut stream = client
                .watch(first.to_string(), Some(options(*folder)))
                .await?;
            for (k, folder) in rest {
                stream.watch(k.to_string(), Some(options(*folder))).await?;
            }
            Ok::<_, etcd_client::Error>(stream)
        })
        .await;
        let mut stream = match watched {
            Ok(Ok(s)) => s,
            _ => return pause().await,
        };
        loop {
            match tokio::time::timeout_at(end, stream.message()).await {
                Ok(Ok(Some(r))) if r.events().is_empty() && !r.canceled() => continue,
                Ok(Ok(Some(_))) | Err(_) => return,
                Ok(Ok(None)) | Ok(Err(_)) => {
                    // The watch broke (its member died): read again after a short pause.
                    return pause().await;
                }
            }
        }
    }

    /// Waits up to `timeout` until every key exists; `Ok(Ok(values))` or `Ok(Err(reply))`
    /// (an abort record, or the keys still missing at the deadline).
    async fn wait_for(
        &self,
        keys: &[String],
        timeout: Duration,
        deadline: Instant,
    ) -> Outcome<std::result::Result<Vec<Vec<u8>>, Reply>> {
        let until = Instant::now() + timeout;
        let (reads, first_key) = self.wait_reads(keys);
        loop {
            let snap = self.snapshot(keys, &reads, first_key, deadline).await?;
            if snap.values.iter().all(Option::is_some) {
                return Ok(Ok(snap.values.into_iter().flatten().collect()));
            }
            if let Some(record) = snap.abort {
                return Ok(Err(Reply::Aborted(record)));
            }
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                let missing = keys
                    .iter()
                    .zip(&snap.values)
                    .filter(|(_, v)| v.is_none())
                    .map(|(k, _)| k.clone())
                    .collect();
                return Ok(Err(Reply::Timeout { missing }));
            }
            self.changed_after(&reads, snap.revision, left.min(WATCH_SLICE))
                .await;
        }
    }

    /// Answers `request` as the launcher's store would; `wait` is the request's own wait,
    /// `slack` the time a reply may take beyond it.
    pub(crate) fn execute(
        &self,
        request: &Request,
        wait: Duration,
        slack: Duration,
    ) -> Outcome<Reply> {
        let deadline = Instant::now() + allowed(wait, slack);
        let rt = runtime().map_err(EtcdFailure::Lost)?;
        rt.block_on(async { self.answer(request, deadline).await })
    }

    async fn answer(&self, request: &Request, deadline: Instant) -> Outcome<Reply> {
        match request {
            Request::Set { key, value } => {
                let (k, v) = (self.key(key), value.clone());
                self.attempts(deadline, |mut c, _| {
                    let (k, v) = (k.clone(), v.clone());
                    async move { c.put(k, v, None).await.map(|_| ()) }
                })
                .await?;
                Ok(Reply::Ok)
            }
            Request::Get { key, timeout } => {
                let keys = std::slice::from_ref(key);
                match self.wait_for(keys, *timeout, deadline).await? {
                    Ok(values) => {
                        let mut values = self.counted(keys, values, deadline).await?;
                        Ok(Reply::Value(values.remove(0)))
                    }
                    Err(reply) => Ok(reply),
                }
            }
            Request::Wait { keys, timeout } => match self.wait_for(keys, *timeout, deadline).await?
            {
                Ok(_) => Ok(Reply::Ok),
                Err(reply) => Ok(reply),
            },
            // The keys are read in transactions of up to TXN_OPS gets each.
            Request::GetMany { keys, timeout } => {
                match self.wait_for(keys, *timeout, deadline).await? {
                    Ok(values) => Ok(Reply::Values(self.counted(keys, values, deadline).await?)),
                    Err(reply) => Ok(reply),
                }
            }
            Request::Add { key, delta } => self.add(key, *delta, deadline).await,
            Request::CompareSet {
                key,
                expected,
                desired,
            } => {
                let k = self.key(key);
                let (succeeded, current) = self
                    .attempts(deadline, |mut c, _| {
                        let k = k.clone();
                        let compare = match expected {
                            Some(v) => Compare::value(k.clone(), CompareOp::Equal, v.clone()),
                            None => Compare::create_revision(k.clone(), CompareOp::Equal, 0),
                        };
                        let txn = Txn::new()
                            .when([compare])
                            .and_then([TxnOp::put(k.clone(), desired.clone(), None)])
                            .or_else([TxnOp::get(k, None)]);
                        async move {
                            let r = c.txn(txn).await?;
                            let current = match r.op_responses().into_iter().next() {
                                Some(TxnOpResponse::Get(g)) => {
                                    g.kvs().first().map(|kv| kv.value().to_vec())
                                }
                                _ => None,
                            };
                            Ok((r.succeeded(), current))
                        }
                    })
                    .await?;
                Ok(Reply::Value(if succeeded {
                    desired.clone()
                } else {
                    current.unwrap_or_default()
                }))
            }
            // The key's own value and, for a counter, its folder.
            Request::Delete { key } => {
                let (k, folder) = (self.key(key), self.counter(key));
                let deleted = self
                    .attempts(deadline, |mut c, _| {
                        let txn = Txn::new().and_then([
                            TxnOp::delete(k.clone(), None),
                            TxnOp::delete(folder.clone(), Some(DeleteOptions::new().with_prefix())),
                        ]);
                        async move {
                            let r = c.txn(txn).await?;
                            Ok(r.op_responses()
                                .into_iter()
                                .map(|op| match op {
                                    TxnOpResponse::Delete(d) => d.deleted(),
                                    _ => 0,
                                })
                                .sum::<i64>())
                        }
                    })
                    .await?;
                Ok(Reply::Bool(deleted > 0))
            }
            Request::Abort { scope, record } => {
                let k = self.abort_key(scope);
                let v = encode_record(record);
                self.attempts(deadline, |mut c, _| {
                    let txn = Txn::new()
                        .when([Compare::create_revision(k.clone(), CompareOp::Equal, 0)])
                        .and_then([TxnOp::put(k.clone(), v.clone(), None)]);
                    async move { c.txn(txn).await.map(|_| ()) }
                })
                .await?;
                Ok(Reply::Ok)
            }
            Request::GetAbort { scope } => {
                let keys = [self.abort_key(""), self.abort_key(scope)];
                let (_, values) = self.read(&keys, deadline).await?;
                let found = values.into_iter().flatten().next();
                Ok(match found.as_deref().and_then(decode_record) {
                    Some(r) => Reply::Aborted(r),
                    None => Reply::NoAbort,
                })
            }
            // etcd refuses nobody on the job's behalf (its own authentication is etcd's).
            Request::Refusals => Ok(Reply::Refusals(Vec::new())),
            Request::Bye => {
                if let Some(p) = &self.presence {
                    let (gone, present) = (
                        self.key(&gone_key(Rank(p.member))),
                        format!("{}present/{}", self.prefix, p.member),
                    );
                    let lease = p.lease;
                    self.attempts(deadline, |mut c, _| {
                        let txn = Txn::new().and_then([
                            TxnOp::put(gone.clone(), "it left the job", None),
                            TxnOp::delete(present.clone(), None),
                        ]);
                        async move {
                            c.txn(txn).await?;
                            c.lease_revoke(lease).await.map(|_| ())
                        }
                    })
                    .await?;
                    p.said_bye.store(true, Ordering::SeqCst);
                    p.keeper.abort();
                }
                Ok(Reply::Ok)
            }
        }
    }

    /// The folder of counter `key`: its `base` and one part per `add` (`p/…`). The key's
    /// length comes first, so that no counter's folder holds another's.
    fn counter(&self, key: &str) -> String {
        format!("{}n/{}/{key}/", self.prefix, key.len())
    }

    /// `add` without a compare-and-swap: each `add` puts a part of its own (its `delta`) into
    /// the counter's folder and, in the same transaction, reads the folder, whose sum is the
    /// counter after this `add`. n processes that add at once take n transactions; a
    /// compare-and-swap on one key took up to n each (at 256 processes, 40,000 transactions a
    /// member in 20 s at each start-up barrier, read from etcd's metrics). `delta` 0 reads.
    ///
    /// The key itself holds [`COUNTER`] from the first `add` on, so that `get` and `wait` find
    /// the counter as on the launcher's store (a `get` sums its folder: [`Self::counted`]). A
    /// key that holds a value of its own (set by `set`) is added to as that value, by a
    /// compare-and-swap, or refused when it is not 8 bytes, as on the launcher's store. An
    /// attempt retried after its first landed finds its part there and answers the sum then.
    async fn add(&self, key: &str, delta: i64, deadline: Instant) -> Outcome<Reply> {
        let (plain, folder) = (self.key(key), self.counter(key));
        let part = (delta != 0).then(|| {
            let n = self.adder.next.fetch_add(1, Ordering::Relaxed);
            format!("{folder}p/{:016x}-{n:x}", self.adder.id)
        });
        let read = || [TxnOp::get(plain.clone(), None), folder_read(&folder)];
        let (added, own, parts): (bool, Option<Vec<u8>>, Vec<KeyValue>) = self
            .attempts(deadline, |mut c, _| {
                let txn = match &part {
                    None => Txn::new().and_then(read()),
                    Some(p) => {
                        let absent = Compare::create_revision(p.clone(), CompareOp::Equal, 0);
                        let add = TxnOp::put(p.clone(), delta.to_le_bytes().to_vec(), None);
                        let first = Compare::version(plain.clone(), CompareOp::Equal, 0);
                        let counter = Compare::value(plain.clone(), CompareOp::Equal, COUNTER);
                        // The first add marks the key; later ones find the mark.
                        Txn::new()
                            .when([first, absent.clone()])
                            .and_then([
                                TxnOp::put(plain.clone(), COUNTER, None),
                                add.clone(),
                                folder_read(&folder),
                            ])
                            .or_else([TxnOp::txn(
                                Txn::new()
                                    .when([counter, absent])
                                    .and_then([add, folder_read(&folder)])
                                    .or_else(read()),
                            )])
                    }
                };
                let added = part.is_some();
                async move {
                    let mut r = c.txn(txn).await?;
                    if !r.succeeded() && added {
                        match r.op_responses().into_iter().next() {
                            Some(TxnOpResponse::Txn(inner)) => r = inner,
                            _ => return Ok((false, None, Vec::new())),
                        }
                    }
                    let mut gets: Vec<Vec<KeyValue>> = r
                        .op_responses()
                        .into_iter()
                        .filter_map(|op| match op {
                            TxnOpResponse::Get(g) => Some(g.kvs().to_vec()),
                            _ => None,
                        })
                        .collect();
                    let parts = gets.pop().unwrap_or_default();
                    let own = gets.pop().and_then(|kvs| kvs.into_iter().next());
                    Ok((
                        added && r.succeeded(),
                        own.map(|kv| kv.value().to_vec()),
                        parts,
                    ))
                }
            })
            .await?;
        // A value of the key's own (not the mark; none: a counter not added to yet, or this
        // add's retried attempt that found its part).
        if own.as_deref().is_some_and(|v| v != COUNTER) {
            return self.add_to_value(&plain, key, delta, deadline).await;
        }
        let Some(total) = sum(&parts) else {
            return Ok(Reply::Rejected(damaged(key)));
        };
        let count = parts.len();
        if added && count >= COUNTER_FOLD && count % COUNTER_FOLD == 0 {
            self.fold(&folder, &parts).await;
        }
        Ok(Reply::Int(total))
    }

    /// `values` (read for `keys`) with each counter's mark ([`COUNTER`]) replaced by its
    /// count (8 bytes, as the launcher's store holds it), read in one more transaction.
    async fn counted(
        &self,
        keys: &[String],
        mut values: Vec<Vec<u8>>,
        deadline: Instant,
    ) -> Outcome<Vec<Vec<u8>>> {
        let marked: Vec<usize> = (0..values.len())
            .filter(|&i| values[i] == COUNTER)
            .collect();
        for chunk in marked.chunks(TXN_OPS) {
            let folders: Vec<String> = chunk.iter().map(|&i| self.counter(&keys[i])).collect();
            let sums = self
                .attempts(deadline, |mut c, _| {
                    let ops: Vec<TxnOp> = folders.iter().map(|f| folder_read(f)).collect();
                    async move {
                        let r = c.txn(Txn::new().and_then(ops)).await?;
                        Ok(r.op_responses()
                            .into_iter()
                            .map(|op| match op {
                                TxnOpResponse::Get(g) => sum(g.kvs()),
                                _ => None,
                            })
                            .collect::<Vec<_>>())
                    }
                })
                .await?;
            for (&i, total) in chunk.iter().zip(sums) {
                // A damaged part leaves the mark, which no reader takes for a count.
                if let Some(total) = total {
                    values[i] = total.to_le_bytes().to_vec();
                }
            }
        }
        Ok(values)
    }

    /// Folds up to [`TXN_OPS`] − 1 parts of a counter (read as `read`) into its base, in one
    /// transaction that fails (and changes nothing) when another fold or a delete came between.
    /// Best effort: a later `add` folds what this one did not.
    async fn fold(&self, folder: &str, read: &[KeyValue]) {
        let base = format!("{folder}base");
        let (bases, parts): (Vec<&KeyValue>, Vec<&KeyValue>) =
            read.iter().partition(|kv| kv.key() == base.as_bytes());
        let base_revision = bases.first().map_or(0, |kv| kv.mod_revision());
        let parts = &parts[..parts.len().min(TXN_OPS - 1)];
        let Some(total) = sum(bases.iter().chain(parts).copied()) else {
            return;
        };
        let mut when = vec![Compare::mod_revision(
            base.clone(),
            CompareOp::Equal,
            base_revision,
        )];
        when.extend(parts.iter().map(|kv| {
            Compare::create_revision(kv.key().to_vec(), CompareOp::Equal, kv.create_revision())
        }));
        let mut then = vec![TxnOp::put(base, total.to_le_bytes().to_vec(), None)];
        then.extend(
            parts
                .iter()
                .map(|kv| TxnOp::delete(kv.key().to_vec(), None)),
        );
        let mut c = self.client.clone();
        let txn = Txn::new().when(when).and_then(then);
        if let Ok(Err(e)) = tokio::time::timeout(ATTEMPT, c.txn(txn)).await {
            tracing::debug!(
                "folding the parts of counter {folder} failed: {}",
                chain(&e)
            );
        }
    }

    /// `add` on a key that holds a value of its own (set by `set`): a compare-and-swap on the
    /// key's revision.
    async fn add_to_value(
        &self,
        k: &str,
        key: &str,
        delta: i64,
        deadline: Instant,
    ) -> Outcome<Reply> {
        loop {
            let read = self
                .attempts(deadline, |mut c, _| {
                    let k = k.to_string();
                    async move {
                        let r = c.get(k, None).await?;
                        Ok(r.kvs()
                            .first()
                            .map(|kv| (kv.mod_revision(), kv.value().to_vec())))
                    }
                })
                .await?;
            let Some((revision, current)) = read else {
                // Deleted meanwhile: a counter again.
                return Box::pin(self.add(key, delta, deadline)).await;
            };
            let Ok(bytes) = <[u8; 8]>::try_from(current.as_slice()) else {
                return Ok(Reply::Rejected(not_a_counter(key, current.len())));
            };
            let next = i64::from_le_bytes(bytes).wrapping_add(delta);
            let swapped = self
                .attempts(deadline, |mut c, _| {
                    let txn = Txn::new()
                        .when([Compare::mod_revision(k, CompareOp::Equal, revision)])
                        .and_then([TxnOp::put(k, next.to_le_bytes().to_vec(), None)]);
                    async move { c.txn(txn).await.map(|r| r.succeeded()) }
                })
                .await?;
            if swapped {
                return Ok(Reply::Int(next));
            }
        }
    }
}

impl Drop for EtcdLink {
    fn drop(&mut self) {
        let Some(p) = self.presence.take() else {
            return;
        };
        p.keeper.abort();
        if !p.said_bye.load(Ordering::SeqCst) {
            // As a store connection closed without goodbye: the process is gone for the job
            // now, not when the lease would expire.
            let lease = p.lease;
            let _ = self.run(Instant::now() + ATTEMPT, |mut c, _| async move {
                c.lease_revoke(lease).await.map(|_| ())
            });
        }
    }
}

/// The refusal of an `add` on counter `key` whose folder holds a part that is not a count.
fn damaged(key: &str) -> String {
    format!(
        "counter {key:?} holds a part that is not 8 bytes (written by another program?); use a \
         different key"
    )
}

/// A read of everything in counter folder `folder` (its base and parts).
fn folder_read(folder: &str) -> TxnOp {
    TxnOp::get(folder, Some(GetOptions::new().with_prefix()))
}

/// The sum of a counter's base and parts (8-byte little-endian integers each); `None` when one
/// is not 8 bytes.
fn sum<'a>(kvs: impl IntoIterator<Item = &'a KeyValue>) -> Option<i64> {
    kvs.into_iter().try_fold(0i64, |total, kv| {
        let v = <[u8; 8]>::try_from(kv.value()).ok()?;
        Some(total.wrapping_add(i64::from_le_bytes(v)))
    })
}

/// Keeps lease `lease` alive until it is revoked or expires (then says so once).
async fn keep_alive(
    mut client: Client,
    lease: i64,
    member: u32,
    endpoints: String,
    expired: Arc<AtomicBool>,
) {
    let period = LEASE_TTL / 4;
    loop {
        if let Ok((mut keeper, mut stream)) = client.lease_keep_alive(lease).await {
            loop {
                if keeper.keep_alive().await.is_err() {
                    break;
                }
                match tokio::time::timeout(period, stream.message()).await {
                    Ok(Ok(Some(r))) if r.ttl() > 0 => {}
                    Ok(Ok(Some(_))) => {
                        expired.store(true, Ordering::SeqCst);
                        tracing::warn!(
                            "member {member}: its presence lease on the etcd cluster \
                             {endpoints} expired (this process was stopped or cut off for \
                             longer than {LEASE_TTL:?}): the job counts it as gone"
                        );
                        return;
                    }
                    _ => break,
                }
                tokio::time::sleep(period).await;
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The member id of a [`gone_key`], if `key` is one.
/// What a wait on `keys` watches: each key, or (`true`) the folder of more than
/// [`WATCH_ONE_BY_ONE`] of them, in the order they first come.
fn watches(keys: &[String]) -> Vec<(&str, bool)> {
    fn folder(k: &str) -> Option<&str> {
        k.rfind('/').map(|i| &k[..=i])
    }
    let mut counts: HashMap<&str, usize> = HashMap::new();
    for f in keys.iter().filter_map(|k| folder(k)) {
        *counts.entry(f).or_default() += 1;
    }
    let (mut out, mut taken) = (Vec::new(), HashSet::new());
    for k in keys {
        match folder(k).filter(|f| counts[f] > WATCH_ONE_BY_ONE) {
            Some(f) if taken.insert(f) => out.push((f, true)),
            Some(_) => {}
            None => out.push((k.as_str(), false)),
        }
    }
    out
}

fn gone_id(key: &str) -> Option<u32> {
    key.strip_prefix("ft/gone/")?.parse().ok()
}

fn encode_record(record: &AbortRecord) -> Vec<u8> {
    let (kind, payload) = Reply::Aborted(record.clone()).encode();
    let mut v = Vec::with_capacity(payload.len() + 1);
    v.push(kind);
    v.extend(payload);
    v
}

fn decode_record(v: &[u8]) -> Option<AbortRecord> {
    let (kind, payload) = v.split_first()?;
    match Reply::decode(*kind, payload) {
        Ok(Reply::Aborted(r)) => Some(r),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{EtcdSecurity, MasterAddr};
    use crate::store::auth::Purpose;
    use crate::store::{StoreClient, WaitOutcome};
    use crate::types::WorldSize;
    use crate::{CollectiveError, DdpError, RendezvousError};
    use std::process::{Child, Command, Stdio};

    /// One etcd member on loopback (Debian's etcd-server), stopped by PID when dropped.
    struct Member {
        child: Child,
        dir: std::path::PathBuf,
        client: u16,
    }

    impl Member {
        fn start() -> Self {
            Self::start_serving("http", &[])
        }

        /// A member serving its clients over `scheme` (`http`, `https`), with `extra`
        /// arguments (its TLS files).
        fn start_serving(scheme: &str, extra: &[std::ffi::OsString]) -> Self {
            let port = || {
                std::net::TcpListener::bind("127.0.0.1:0")
                    .unwrap()
                    .local_addr()
                    .unwrap()
                    .port()
            };
            let (client, peer) = (port(), port());
            let dir =
                std::env::temp_dir().join(format!("burn-ddp-etcd-{}-{client}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            let child = Command::new("etcd")
                .args(["--name", "t", "--data-dir"])
                .arg(&dir)
                .args([
                    "--listen-client-urls",
                    &format!("{scheme}://127.0.0.1:{client}"),
                    "--advertise-client-urls",
                    &format!("{scheme}://127.0.0.1:{client}"),
                    "--listen-peer-urls",
                    &format!("http://127.0.0.1:{peer}"),
                    "--initial-advertise-peer-urls",
                    &format!("http://127.0.0.1:{peer}"),
                    "--initial-cluster",
                    &format!("t=http://127.0.0.1:{peer}"),
                ])
                .args(extra)
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .unwrap_or_else(|e| {
                    panic!(
                        "these tests need etcd on PATH (Debian: `apt-get install etcd-server`; \
                         .ci/run installs it): {e}"
                    )
                });
            Self { child, dir, client }
        }

        fn master(&self) -> MasterAddr {
            MasterAddr::new("127.0.0.1", self.client)
                .with_etcd(EtcdStore::parse(&format!("127.0.0.1:{}", self.client)).unwrap())
        }
    }

    impl Drop for Member {
        fn drop(&mut self) {
            let _ = self.child.kill();
            let _ = self.child.wait();
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }

    fn connect(
        master: &MasterAddr,
        purpose: Purpose,
        rank: u32,
        token: &str,
    ) -> crate::Result<StoreClient> {
        StoreClient::connect(
            master,
            purpose,
            Rank(rank),
            WorldSize::new(3).unwrap(),
            &JobToken::new(token),
            Duration::from_secs(5),
            Instant::now() + Duration::from_secs(30),
        )
    }

    /// The requests everything above the store client uses, answered by etcd as by the
    /// launcher's store: values, counters, compare-and-set, waits that time out naming what is
    /// missing, and a wait woken by the value it waits for.
    #[test]
    fn etcd_answers_the_stores_requests() {
        let m = Member::start();
        let a = connect(&m.master(), Purpose::StoreAux, 0, "job-a").unwrap();
        let b = connect(&m.master(), Purpose::StoreAux, 1, "job-a").unwrap();
        a.set("k", b"v").unwrap();
        assert_eq!(b.get("k").unwrap(), b"v");
        assert_eq!(a.add("n", 2).unwrap(), 2);
        assert_eq!(b.add("n", 5).unwrap(), 7);
        assert!(matches!(
            a.add("k", 1),
            Err(DdpError::Rendezvous(RendezvousError::StoreRequest { .. }))
        ));
        assert_eq!(a.compare_set("c", None, b"1").unwrap(), b"1");
        assert_eq!(
            b.compare_set("c", None, b"2").unwrap(),
            b"1",
            "absent expected, present found"
        );
        assert_eq!(b.compare_set("c", Some(b"1"), b"3").unwrap(), b"3");
        // Many keys at once: more than one etcd transaction holds (TXN_OPS).
        let many: Vec<String> = (0..TXN_OPS + 50).map(|i| format!("many/{i}")).collect();
        for (i, k) in many.iter().enumerate() {
            a.set(k, i.to_string().as_bytes()).unwrap();
        }
        let mut asked = vec!["k".to_string(), "c".to_string()];
        asked.extend(many.iter().cloned());
        let values = b.get_many(&asked).unwrap();
        assert_eq!(values[..2], [b"v".to_vec(), b"3".to_vec()]);
        assert!((0..many.len()).all(|i| values[i + 2] == i.to_string().as_bytes()));
        assert!(a.delete("c").unwrap());
        assert!(!a.delete("c").unwrap());
        let t = Instant::now();
        assert_eq!(
            a.wait(&["k".into(), "missing".into()], Duration::from_millis(300))
                .unwrap(),
            WaitOutcome::Missing(vec!["missing".into()])
        );
        assert!(t.elapsed() >= Duration::from_millis(300));
        let waiter = std::thread::spawn(move || b.get_timeout("late", Duration::from_secs(20)));
        std::thread::sleep(Duration::from_millis(300));
        a.set("late", b"here").unwrap();
        let t = Instant::now();
        assert_eq!(waiter.join().unwrap().unwrap(), b"here");
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "the watch did not wake the wait"
        );
        // Another job (token) sees none of these keys.
        let other = connect(&m.master(), Purpose::StoreAux, 0, "job-b").unwrap();
        assert!(matches!(
            other.get_timeout("k", Duration::from_millis(100)),
            Err(DdpError::Rendezvous(RendezvousError::StoreTimeout { .. }))
        ));
    }

    /// Processes that add to one counter at once each count once (every `add` answers a
    /// different total, the totals are 1..=n, the counter reads n, by `add` of 0 and by `get`),
    /// however its parts are folded meanwhile; the folder keeps few parts; a counter is deleted
    /// with its folder; a wait on a counter ends at its first add; a key set to 8 bytes of its
    /// own is added to as that value.
    #[test]
    fn concurrent_adds_count_once_each_and_fold() {
        const PROCESSES: usize = 6;
        const ADDS: usize = 50;
        let m = Member::start();
        let adders: Vec<_> = (0..PROCESSES)
            .map(|r| {
                let c = connect(&m.master(), Purpose::StoreAux, r as u32, "job-n").unwrap();
                std::thread::spawn(move || {
                    (0..ADDS)
                        .map(|_| c.add("n", 1).unwrap())
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        let mut totals: Vec<i64> = adders.into_iter().flat_map(|t| t.join().unwrap()).collect();
        totals.sort_unstable();
        let n = (PROCESSES * ADDS) as i64;
        assert_eq!(
            totals,
            (1..=n).collect::<Vec<_>>(),
            "an add counted twice or not at all"
        );
        let a = connect(&m.master(), Purpose::StoreAux, 0, "job-n").unwrap();
        assert_eq!(a.add("n", 0).unwrap(), n);
        // Read as on the launcher's store: its 8 bytes, by `get` too, one key or many.
        assert_eq!(a.get("n").unwrap(), n.to_le_bytes());
        a.set("plain", b"p").unwrap();
        let many = a.get_many(&["plain".into(), "n".into()]).unwrap();
        assert_eq!(many, [b"p".to_vec(), n.to_le_bytes().to_vec()]);
        let store = EtcdStore::parse(&format!("127.0.0.1:{}", m.client)).unwrap();
        let token = JobToken::new("job-n");
        let link = EtcdLink::connect(
            &store,
            &token,
            None,
            Instant::now() + Duration::from_secs(10),
        )
        .unwrap();
        let folder = link.counter("n");
        let held = |link: &EtcdLink| {
            let folder = folder.clone();
            link.run(Instant::now() + Duration::from_secs(10), move |mut c, _| {
                let folder = folder.clone();
                async move {
                    let r = c
                        .get(
                            folder,
                            Some(GetOptions::new().with_prefix().with_count_only()),
                        )
                        .await?;
                    Ok(r.count())
                }
            })
            .unwrap()
        };
        let parts = held(&link);
        assert!(
            parts > 0 && parts < (PROCESSES * ADDS) as i64 / 2,
            "{parts} parts and base after {n} adds: not folded"
        );
        assert!(a.delete("n").unwrap());
        assert_eq!(held(&link), 0, "the counter's folder outlived its delete");
        assert_eq!(a.add("n", 0).unwrap(), 0);
        // A wait on a counter ends at its first add.
        let b = connect(&m.master(), Purpose::StoreAux, 1, "job-n").unwrap();
        let waiter = std::thread::spawn(move || b.get_timeout("n", Duration::from_secs(20)));
        std::thread::sleep(Duration::from_millis(300));
        assert_eq!(a.add("n", 3).unwrap(), 3);
        assert_eq!(waiter.join().unwrap().unwrap(), 3i64.to_le_bytes());
        a.set("eight", &40i64.to_le_bytes()).unwrap();
        assert_eq!(a.add("eight", 2).unwrap(), 42);
        assert_eq!(a.get("eight").unwrap(), 42i64.to_le_bytes());
    }

    /// A certificate authority, a server certificate for 127.0.0.1 and client certificates,
    /// made by Debian's `openssl` in a directory removed when dropped.
    struct Pki {
        dir: std::path::PathBuf,
    }

    impl Pki {
        fn new(name: &str) -> Self {
            let dir =
                std::env::temp_dir().join(format!("burn-ddp-pki-{name}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).unwrap();
            let pki = Self { dir };
            pki.authority("ca");
            pki.signed(
                "server",
                "ca",
                "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth",
            );
            pki.signed("client", "ca", "extendedKeyUsage=clientAuth");
            pki
        }

        fn file(&self, name: &str) -> std::path::PathBuf {
            self.dir.join(name)
        }

        fn openssl(&self, args: &[&str]) {
            let out = Command::new("openssl")
                .args(args)
                .current_dir(&self.dir)
                .output()
                .unwrap_or_else(|e| {
                    panic!(
                        "these tests need openssl on PATH (Debian: `apt-get install openssl`): {e}"
                    )
                });
            assert!(
                out.status.success(),
                "openssl {args:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }

        /// A new P-256 key `name.key` and a request for `/CN=name` with it (`openssl req`),
        /// `out` saying what becomes of the request (`-x509`: a self-signed certificate).
        fn new_key(&self, name: &str, out: &[&str]) {
            let (key, subj) = (format!("{name}.key"), format!("/CN={name}"));
            let mut args = vec![
                "req",
                "-newkey",
                "ec",
                "-pkeyopt",
                "ec_paramgen_curve:prime256v1",
                "-nodes",
                "-keyout",
                &key,
                "-subj",
                &subj,
            ];
            args.extend_from_slice(out);
            self.openssl(&args);
        }

        /// A self-signed CA `name` (`name.pem`, `name.key`).
        fn authority(&self, name: &str) {
            let pem = format!("{name}.pem");
            self.new_key(name, &["-x509", "-out", &pem, "-days", "2"]);
        }

        /// A key and certificate `name`, signed by CA `ca`, with the extensions `ext`.
        fn signed(&self, name: &str, ca: &str, ext: &str) {
            let (csr, pem) = (format!("{name}.csr"), format!("{name}.pem"));
            let ext_file = format!("{name}.ext");
            std::fs::write(self.dir.join(&ext_file), ext).unwrap();
            self.new_key(name, &["-out", &csr]);
            self.openssl(&[
                "x509",
                "-req",
                "-in",
                &csr,
                "-CA",
                &format!("{ca}.pem"),
                "-CAkey",
                &format!("{ca}.key"),
                "-CAcreateserial",
                "-out",
                &pem,
                "-days",
                "2",
                "-extfile",
                &ext_file,
            ]);
        }

        /// The arguments of a member that serves TLS with the server certificate and admits
        /// only clients with a certificate of this CA.
        fn member_args(&self) -> Vec<std::ffi::OsString> {
            let mut args: Vec<std::ffi::OsString> = Vec::new();
            for (flag, file) in [
                ("--cert-file", "server.pem"),
                ("--key-file", "server.key"),
                ("--trusted-ca-file", "ca.pem"),
            ] {
                args.push(flag.into());
                args.push(self.file(file).into());
            }
            args.push("--client-cert-auth".into());
            args
        }
    }

    impl Drop for Pki {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }

    /// A process of `master`'s store is refused within FAILOVER (not at its 30 s deadline),
    /// with an error that names `fix`.
    fn assert_refused(master: &MasterAddr, fix: &str) {
        let t = Instant::now();
        let err = connect(master, Purpose::StoreAux, 1, "job").unwrap_err();
        let text = err.to_string();
        assert!(
            matches!(
                err,
                DdpError::Rendezvous(RendezvousError::StoreRefused { .. })
            ),
            "{text}"
        );
        assert!(text.contains(fix), "{text}");
        assert!(t.elapsed() < FAILOVER + ATTEMPT * 2, "{:?}", t.elapsed());
    }

    /// A cluster that serves TLS and requires client certificates (etcd `--client-cert-auth`):
    /// a process with the CA and a certificate it signed uses the store; one without a
    /// certificate, one with a stranger's certificate, and one that speaks plain TCP are
    /// refused, each with an error that says what to give.
    #[test]
    fn a_cluster_with_client_certificates_admits_only_processes_with_one() {
        let pki = Pki::new("tls");
        let m = Member::start_serving("https", &pki.member_args());
        let endpoint = format!("https://127.0.0.1:{}", m.client);
        let master = |security: EtcdSecurity| {
            let store = EtcdStore::parse(&endpoint).unwrap();
            MasterAddr::new("127.0.0.1", m.client).with_etcd(store.with_security(security).unwrap())
        };
        let ca = Some(pki.file("ca.pem"));
        let full = EtcdSecurity {
            ca: ca.clone(),
            cert: Some(pki.file("client.pem")),
            key: Some(pki.file("client.key")),
            ..EtcdSecurity::default()
        };
        let a = connect(&master(full), Purpose::StoreAux, 0, "job").unwrap();
        a.set("k", b"v").unwrap();
        assert_eq!(a.get("k").unwrap(), b"v");

        let no_cert = EtcdSecurity {
            ca: ca.clone(),
            ..EtcdSecurity::default()
        };
        assert_refused(&master(no_cert), "--etcd-cert and --etcd-key");
        // A stranger: a certificate from a CA of its own.
        pki.authority("stranger");
        pki.signed("intruder", "stranger", "extendedKeyUsage=clientAuth");
        let stranger = EtcdSecurity {
            ca: ca.clone(),
            cert: Some(pki.file("intruder.pem")),
            key: Some(pki.file("intruder.key")),
            ..EtcdSecurity::default()
        };
        assert_refused(
            &master(stranger),
            "does not accept this process's certificate",
        );
        // The right certificate, checked against another CA than the members'.
        let wrong_ca = EtcdSecurity {
            ca: Some(pki.file("stranger.pem")),
            cert: Some(pki.file("client.pem")),
            key: Some(pki.file("client.key")),
            ..EtcdSecurity::default()
        };
        assert_refused(&master(wrong_ca), "give the CA that signed them");
        let plain = MasterAddr::new("127.0.0.1", m.client)
            .with_etcd(EtcdStore::parse(&format!("127.0.0.1:{}", m.client)).unwrap());
        assert_refused(&plain, "give its endpoints as https://host:port");
        // The admitted process still uses the store.
        assert_eq!(a.get("k").unwrap(), b"v");
    }

    /// A cluster with authentication enabled (`etcdctl auth enable`): a process with the user
    /// and its password uses the store (and its presence lease); one without a user and one
    /// with a wrong password are refused at once, each told what to give.
    #[test]
    fn a_cluster_with_authentication_admits_only_its_users() {
        let m = Member::start();
        let endpoint = format!("http://127.0.0.1:{}", m.client);
        let etcdctl = |args: &[&str]| {
            let out = Command::new("etcdctl")
                .env("ETCDCTL_API", "3")
                .args(["--endpoints", &endpoint, "--dial-timeout", "10s"])
                .args(args)
                .output()
                .unwrap();
            assert!(
                out.status.success(),
                "etcdctl {args:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        };
        // The member answers before etcdctl is used.
        drop(connect(&m.master(), Purpose::StoreAux, 0, "setup").unwrap());
        etcdctl(&["user", "add", "root:s3cret"]);
        etcdctl(&["user", "grant-role", "root", "root"]);
        etcdctl(&["auth", "enable"]);
        let master = |user: Option<&str>, password: Option<&str>| {
            let security = EtcdSecurity {
                user: user.map(str::to_owned),
                password: password.map(str::to_owned),
                ..EtcdSecurity::default()
            };
            let store = EtcdStore::parse(&endpoint)
                .unwrap()
                .with_security(security)
                .unwrap();
            MasterAddr::new("127.0.0.1", m.client).with_etcd(store)
        };
        let a = connect(
            &master(Some("root"), Some("s3cret")),
            Purpose::Store,
            0,
            "job",
        )
        .unwrap();
        a.set("k", b"v").unwrap();
        assert_eq!(a.get("k").unwrap(), b"v");
        for (master, fix) in [
            (master(None, None), "give an etcd user with --etcd-user"),
            (
                master(Some("root"), Some("wrong")),
                "did not accept this user and password",
            ),
        ] {
            assert_refused(&master, fix);
        }
        assert!(!format!("{:?}", master(Some("root"), Some("s3cret"))).contains("s3cret"));
    }

    /// A cluster that stops answering is a lost store, not a missing key: readers that take a
    /// `StoreTimeout` for "absent" (the launcher's reading of the last membership) must not
    /// read an unreachable cluster as an empty job.
    #[test]
    fn an_unreachable_cluster_is_a_lost_store_not_a_missing_key() {
        let m = Member::start();
        let a = connect(&m.master(), Purpose::StoreAux, 0, "job").unwrap();
        assert!(matches!(
            a.get_timeout("absent", Duration::ZERO),
            Err(DdpError::Rendezvous(RendezvousError::StoreTimeout { .. }))
        ));
        drop(m);
        let t = Instant::now();
        match a.get_timeout("absent", Duration::ZERO) {
            Err(DdpError::Rendezvous(RendezvousError::StoreLost { source, .. })) => {
                assert_eq!(source.kind(), ErrorKind::TimedOut, "{source}")
            }
            other => panic!("expected a lost store, got {other:?}"),
        }
        assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
    }

    /// An abort record of a scope ends the waits on its keys, and only those; the job's ends
    /// every wait; the first record of each stays.
    #[test]
    fn abort_records_end_the_waits_of_their_scope() {
        let m = Member::start();
        let a = connect(&m.master(), Purpose::StoreAux, 0, "job").unwrap();
        let scoped = connect(&m.master(), Purpose::StoreAux, 1, "job")
            .unwrap()
            .with_scope(Some("ft/4".into()));
        let record = |why: &str| AbortRecord {
            reporter: Rank(0),
            culprit: Some(Rank(2)),
            collective: None,
            reason: why.into(),
        };
        let waiter = std::thread::spawn(move || {
            let r = scoped.get_timeout("never", Duration::from_secs(20));
            (r, scoped)
        });
        std::thread::sleep(Duration::from_millis(300));
        a.end_scope("ft/4", record("rank 2 died")).unwrap();
        a.end_scope("ft/4", record("second")).unwrap();
        let (r, scoped) = waiter.join().unwrap();
        match r {
            Err(DdpError::Collective(CollectiveError::JobAborted { record, .. })) => {
                assert_eq!(record.reason, "rank 2 died")
            }
            other => panic!("expected the scope's abort, got {other:?}"),
        }
        assert_eq!(
            scoped.abort_record().unwrap().unwrap().reason,
            "rank 2 died"
        );
        // Keys outside the scope are not ended by it.
        assert!(matches!(
            a.get_timeout("ft/5/x", Duration::from_millis(200)),
            Err(DdpError::Rendezvous(RendezvousError::StoreTimeout { .. }))
        ));
        assert_eq!(a.abort_record().unwrap(), None);
        a.abort(record("the job")).unwrap();
        assert!(matches!(
            a.get_timeout("ft/5/x", Duration::from_secs(5)),
            Err(DdpError::Collective(CollectiveError::JobAborted { .. }))
        ));
    }

    /// Presence: a member id is claimed once; a process that says goodbye, or whose client is
    /// dropped without it (a crash), reads as gone at once; one that stops renewing its lease
    /// (frozen, cut off) reads as gone when the lease expires.
    #[test]
    fn presence_is_a_lease_and_gone_reads_when_it_ends() {
        let m = Member::start();
        let watcher = connect(&m.master(), Purpose::StoreAux, 0, "job").unwrap();
        let gone = |id| {
            matches!(
                watcher.wait(&[gone_key(Rank(id))], Duration::ZERO).unwrap(),
                WaitOutcome::Ready
            )
        };
        let p1 = connect(&m.master(), Purpose::Store, 1, "job").unwrap();
        let p2 = connect(&m.master(), Purpose::Store, 2, "job").unwrap();
        assert!(!gone(1) && !gone(2) && !gone(9));
        match connect(&m.master(), Purpose::Store, 1, "job") {
            Err(DdpError::Rendezvous(RendezvousError::StoreRefused { reason, .. })) => {
                assert!(
                    reason.contains("member id 1 was claimed by two processes"),
                    "{reason}"
                )
            }
            other => panic!("a second claim of id 1 was not refused: {other:?}"),
        }
        p1.bye(Duration::from_secs(5));
        assert_eq!(watcher.get(&gone_key(Rank(1))).unwrap(), b"it left the job");
        drop(p2);
        assert!(gone(2), "a presence dropped without goodbye is not gone");
        // Frozen: the keep-alive task stops (as in a stopped process); the lease expires.
        let p3 = connect(&m.master(), Purpose::Store, 3, "job").unwrap();
        p3.freeze_presence();
        let t = Instant::now();
        watcher
            .get_timeout(&gone_key(Rank(3)), LEASE_TTL + Duration::from_secs(10))
            .unwrap();
        assert!(
            t.elapsed() <= LEASE_TTL + Duration::from_secs(3),
            "{:?}",
            t.elapsed()
        );
    }

    #[test]
    fn a_wait_on_many_keys_of_a_folder_watches_the_folder() {
        let keys: Vec<String> = ["p/abort", "p/ft/in/0/7"]
            .into_iter()
            .map(String::from)
            .chain((0..20).map(|r| format!("p/ft/in/1/{r}")))
            .chain(["p/ft/in/1/all".to_string(), "top".to_string()])
            .collect();
        assert_eq!(
            watches(&keys),
            [
                ("p/abort", false),
                ("p/ft/in/0/7", false),
                ("p/ft/in/1/", true),
                ("top", false)
            ]
        );
        let few: Vec<String> = (0..WATCH_ONE_BY_ONE).map(|r| format!("p/k/{r}")).collect();
        assert!(watches(&few).iter().all(|(_, folder)| !folder));
    }

    #[test]
    fn gone_keys_are_recognised() {
        assert_eq!(gone_id(&gone_key(Rank(7))), Some(7));
        assert_eq!(gone_id("ft/3/gone/7"), None);
        assert_eq!(gone_id("ft/gone/x"), None);
    }

    #[test]
    fn abort_records_round_trip_and_garbage_is_none() {
        let r = AbortRecord {
            reporter: Rank(1),
            culprit: Some(Rank(2)),
            collective: None,
            reason: "rank 2 died".into(),
        };
        assert_eq!(decode_record(&encode_record(&r)), Some(r));
        assert_eq!(decode_record(b""), None);
        assert_eq!(decode_record(b"\x25garbage"), None);
    }

    #[test]
    fn a_job_prefix_depends_on_the_token_only_and_hides_it() {
        let a = job_prefix(&JobToken::new("rdzv:job-a"));
        assert_eq!(a, job_prefix(&JobToken::new("rdzv:job-a")));
        assert_ne!(a, job_prefix(&JobToken::new("rdzv:job-b")));
        assert!(a.starts_with("burn-ddp/") && a.ends_with('/') && !a.contains("job-a"));
    }
}
