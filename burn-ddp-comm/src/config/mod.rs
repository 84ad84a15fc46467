//! Configuration of a process group: who this process is, where the master is, how long to wait.
//!
//! - `mod.rs`: [`GroupConfig`], [`Timeouts`], [`MasterAddr`], [`JobToken`], [`GradTransport`], [`Algorithm`], [`Transport`]
//! - `env/`: [`env`](mod@env), the one module of burn-ddp (both crates) that reads environment
//!   variables: it turns `RANK`, `WORLD_SIZE`, `MASTER_ADDR`, ... into a [`GroupConfig`]
//!   (`env/placement.rs`: which launcher started the process and where it put it), and resolves
//!   each setting that a variable can change (explicit configuration first, then the variable,
//!   then the default).

pub mod env;

use crate::error::ConfigError;
use std::fmt;
use std::time::Duration;

use crate::types::{LocalRank, Rank, WorldSize};

/// The torchrun default for `MASTER_PORT`.
pub const DEFAULT_MASTER_PORT: u16 = 29500;

/// Deadlines for every blocking wait. The defaults are 10 minutes, PyTorch's NCCL default.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timeouts {
    /// Joining the job: reaching the store on rank 0 and waiting for every rank to arrive.
    pub rendezvous: Duration,
    /// A single request to the key-value store (including `wait` for a key).
    pub store: Duration,
    /// One collective operation, from its start on this rank to its completion.
    pub collective: Duration,
    /// A rank whose heartbeat stops changing for this long while another waits for it in a
    /// collective is reported dead or frozen (default 15 s).
    pub heartbeat: Duration,
    /// A rank that is alive but has not reached a collective others have waited in for this
    /// long, without progressing, is reported stuck (default 3 min: long enough for rank-0-only
    /// work such as writing a checkpoint; raise it if such work takes longer).
    pub stall: Duration,
}

impl Timeouts {
    /// The heartbeat bound's default.
    pub const DEFAULT_HEARTBEAT: Duration = Duration::from_secs(15);
    /// The stall bound's default.
    pub const DEFAULT_STALL: Duration = Duration::from_secs(180);

    /// The same deadline for everything (handy in tests and scripts); the liveness bounds keep
    /// their defaults where those are shorter.
    pub fn uniform(d: Duration) -> Self {
        Self {
            rendezvous: d,
            store: d,
            collective: d,
            heartbeat: d.min(Self::DEFAULT_HEARTBEAT),
            stall: d.min(Self::DEFAULT_STALL),
        }
    }
}

impl Default for Timeouts {
    fn default() -> Self {
        Self::uniform(Duration::from_secs(600))
    }
}

/// The secret shared by the processes of one job.
///
/// Peers prove knowledge of it (HMAC challenge-response, the token itself never crosses the
/// network), so a stranger or a second job on the same port is refused. `Debug` does not print it.
#[derive(Clone, PartialEq, Eq)]
pub struct JobToken(String);

impl JobToken {
    /// Wraps a token string.
    pub fn new(token: impl Into<String>) -> Self {
        Self(token.into())
    }

    /// A fresh random token (what the launcher gives each job).
    pub fn generate() -> Self {
        use rand::Rng;
        let bytes: [u8; 16] = rand::rng().random();
        Self(bytes.iter().map(|b| format!("{b:02x}")).collect())
    }

    /// The token's bytes, as used in the HMAC.
    pub fn as_bytes(&self) -> &[u8] {
        self.0.as_bytes()
    }

    /// The token string (to hand to child processes).
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for JobToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("JobToken(<redacted>)")
    }
}

/// Where the job's store is: served by rank 0 (or by a fault-tolerant job's launcher) on
/// `MASTER_ADDR:MASTER_PORT`, or, for a fault-tolerant job, kept by an etcd cluster
/// ([`MasterAddr::etcd`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MasterAddr {
    /// Host name or IP address.
    pub host: String,
    /// TCP port.
    pub port: u16,
    /// The etcd cluster that keeps the store of a fault-tolerant job instead
    /// (`BURN_DDP_ETCD_ENDPOINTS`, set by `burn-ddp run --rdzv-backend etcd`); `host` and `port`
    /// are then unused.
    pub etcd: Option<EtcdStore>,
    /// This host's address for the job's connections (`BURN_DDP_LOCAL_ADDR`): the store
    /// connections of its ranks come from it and their links and point-to-point endpoints
    /// listen on it. `None`: the address the route to the store picks, which on a host with
    /// several networks may be one the other hosts cannot reach.
    pub local: Option<std::net::IpAddr>,
}

/// An etcd cluster that keeps a fault-tolerant job's store: no process of the job serves it,
/// so the job survives the loss of any node (and of a minority of etcd's members). The job's
/// keys lie under a prefix derived from its job token.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EtcdStore {
    /// The members' client endpoints, `host:port` (or `http://host:port`, or `https://host:port`
    /// for a cluster that serves TLS: then [`EtcdSecurity::ca`] is needed).
    pub endpoints: Vec<String>,
    /// TLS and authentication, as etcd provides them (none by default).
    pub security: EtcdSecurity,
}

/// How a process checks an etcd cluster and proves itself to it, with etcd's own means: TLS
/// (`https://` endpoints, checked against a CA), a client certificate (for a cluster started
/// with `--client-cert-auth`), a user and password (for a cluster with authentication enabled,
/// `etcdctl auth enable`). A job whose store is reachable by anyone but its own processes (an
/// etcd cluster on a shared network) needs TLS with client certificates, or a user: without
/// them, whoever reaches the endpoints can read and write the job's keys.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct EtcdSecurity {
    /// The CA certificate (PEM) that signed the members' server certificates (`--etcd-ca`,
    /// `BURN_DDP_ETCD_CA`); needed by `https://` endpoints.
    pub ca: Option<std::path::PathBuf>,
    /// This process's client certificate (PEM) (`--etcd-cert`, `BURN_DDP_ETCD_CERT`), with
    /// [`key`](Self::key).
    pub cert: Option<std::path::PathBuf>,
    /// The private key (PEM) of [`cert`](Self::cert) (`--etcd-key`, `BURN_DDP_ETCD_KEY`).
    pub key: Option<std::path::PathBuf>,
    /// An etcd user (`--etcd-user`, `BURN_DDP_ETCD_USER`), with [`password`](Self::password).
    pub user: Option<String>,
    /// The user's password (`BURN_DDP_ETCD_PASSWORD`: never on a command line, where other
    /// users of the machine would see it). Not shown by `Debug`.
    pub password: Option<String>,
}

impl fmt::Debug for EtcdSecurity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EtcdSecurity")
            .field("ca", &self.ca)
            .field("cert", &self.cert)
            .field("key", &self.key)
            .field("user", &self.user)
            .field("password", &self.password.as_ref().map(|_| "<hidden>"))
            .finish()
    }
}

impl EtcdSecurity {
    /// Whether any TLS option is set.
    fn any_tls(&self) -> bool {
        self.ca.is_some() || self.cert.is_some() || self.key.is_some()
    }
}

impl EtcdStore {
    /// Parses a comma-separated endpoint list (`--rdzv-endpoint`, `BURN_DDP_ETCD_ENDPOINTS`).
    ///
    /// # Errors
    /// The reason, when the list is empty or an endpoint has no port.
    pub fn parse(list: &str) -> std::result::Result<Self, String> {
        let endpoints: Vec<String> = list
            .split(',')
            .map(str::trim)
            .filter(|e| !e.is_empty())
            .map(str::to_owned)
            .collect();
        if endpoints.is_empty() {
            return Err("no endpoint: give host:port[,host:port...]".into());
        }
        for e in &endpoints {
            let hostport = e.split_once("://").map_or(e.as_str(), |(_, r)| r);
            let port = hostport
                .rsplit_once(':')
                .map(|(_, p)| p.trim_end_matches('/'));
            if port.and_then(|p| p.parse::<u16>().ok()).is_none() {
                return Err(format!(
                    "endpoint {e:?} has no port: give host:port (etcd's client port is 2379 by default)"
                ));
            }
        }
        let schemes: Vec<&str> = endpoints
            .iter()
            .map(|e| e.split_once("://").map_or("http", |(scheme, _)| scheme))
            .collect();
        if let Some(bad) = schemes.iter().find(|s| !matches!(**s, "http" | "https")) {
            return Err(format!(
                "endpoint scheme {bad:?} is not etcd's: give host:port, http://host:port or \
                 https://host:port"
            ));
        }
        if schemes.contains(&"https") && schemes.contains(&"http") {
            return Err(
                "some endpoints are https and some are not: a cluster serves its \
                        clients TLS on every member or on none; give one scheme"
                    .into(),
            );
        }
        Ok(Self {
            endpoints,
            security: EtcdSecurity::default(),
        })
    }

    /// Whether the endpoints are `https://` (the cluster serves TLS).
    pub fn is_tls(&self) -> bool {
        self.endpoints.iter().any(|e| e.starts_with("https://"))
    }

    /// The store with `security`, checked against the endpoints.
    ///
    /// # Errors
    /// What does not fit, and the fix: `https://` endpoints without a CA, TLS options with
    /// plain endpoints, a certificate without its key (or the reverse), a user without a
    /// password (or the reverse).
    pub fn with_security(mut self, security: EtcdSecurity) -> std::result::Result<Self, String> {
        if self.is_tls() && security.ca.is_none() {
            return Err(
                "the endpoints are https://: give the CA certificate that signed the \
                        etcd members' certificates (--etcd-ca FILE, or BURN_DDP_ETCD_CA)"
                    .into(),
            );
        }
        if !self.is_tls() && security.any_tls() {
            return Err(
                "--etcd-ca, --etcd-cert and --etcd-key are for a cluster that serves \
                        TLS: give its endpoints as https://host:port"
                    .into(),
            );
        }
        if security.cert.is_some() != security.key.is_some() {
            return Err(
                "a client certificate needs its key: give both --etcd-cert and \
                        --etcd-key (BURN_DDP_ETCD_CERT, BURN_DDP_ETCD_KEY)"
                    .into(),
            );
        }
        if security.user.is_some() != security.password.is_some() {
            return Err(
                "an etcd user needs its password and a password its user: give both \
                        --etcd-user (BURN_DDP_ETCD_USER) and BURN_DDP_ETCD_PASSWORD"
                    .into(),
            );
        }
        self.security = security;
        Ok(self)
    }
}

impl fmt::Display for EtcdStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "etcd cluster {}", self.endpoints.join(","))
    }
}

impl MasterAddr {
    /// A master address from host and port.
    pub fn new(host: impl Into<String>, port: u16) -> Self {
        Self {
            host: host.into(),
            port,
            etcd: None,
            local: None,
        }
    }

    /// The job's connections of this host from (and its listeners on) `ip`, one of its own
    /// addresses ([`MasterAddr::local`]).
    pub fn with_local(mut self, ip: std::net::IpAddr) -> Self {
        self.local = Some(ip);
        self
    }

    /// The store kept by the etcd cluster `store` instead.
    pub fn with_etcd(mut self, store: EtcdStore) -> Self {
        self.etcd = Some(store);
        self
    }
}

impl fmt::Display for MasterAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(etcd) = &self.etcd {
            return etcd.fmt(f);
        }
        if self.host.contains(':') && !self.host.starts_with('[') {
            write!(f, "[{}]:{}", self.host, self.port)
        } else {
            write!(f, "{}:{}", self.host, self.port)
        }
    }
}

/// How gradient buckets of GPU tensors travel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum GradTransport {
    /// NCCL for Burn's CUDA backend when NCCL can be loaded (with the `cuda` feature), with a
    /// warning and the host-staged transport otherwise; the host transport for other backends.
    /// `Auto` is also the only choice that `BURN_DDP_GRAD_TRANSPORT=host|nccl|auto` may
    /// replace: an explicit `Host` or `Nccl` wins over the environment.
    #[default]
    Auto,
    /// Gradients are read to host memory and reduced by the process group's transport (TCP
    /// between processes). Works for every backend, and lets several ranks share one GPU, which
    /// NCCL refuses.
    Host,
    /// Buckets stay on the GPU and NCCL reduces them there (`Autodiff<Ddp<Cuda>>` with the
    /// `cuda` feature). Fails with a clear error where that is impossible, instead of falling
    /// back.
    Nccl,
}

impl GradTransport {
    /// Parses `auto`, `host` (or `tcp`) and `nccl`, in any case.
    pub fn parse(v: &str) -> Option<Self> {
        match v.trim().to_ascii_lowercase().as_str() {
            "auto" | "" => Some(Self::Auto),
            "host" | "tcp" => Some(Self::Host),
            "nccl" => Some(Self::Nccl),
            _ => None,
        }
    }
}

pub use crate::types::{Algorithm, Transport};

/// The largest all-reduce, in bytes, that [`Algorithm::Auto`] runs by recursive doubling in a
/// group of three or more (in a group of two, [`TREE_MAX_BYTES_2`]). The crossover measured
/// with `burn-ddp bench all-reduce --algo ring,tree` (docs/design.md).
pub const TREE_MAX_BYTES: usize = 64 << 10;

/// [`TREE_MAX_BYTES`] in a group of two, where the ring is already one exchange each way (of
/// halves, pipelined) and only saves its second hop's latency.
pub const TREE_MAX_BYTES_2: usize = 16 << 10;

/// Everything a process needs to join a job.
#[derive(Debug, Clone)]
pub struct GroupConfig {
    /// This process's global rank.
    pub rank: Rank,
    /// Number of processes in the job.
    pub world_size: WorldSize,
    /// This process's rank on its node (selects the GPU).
    pub local_rank: LocalRank,
    /// Number of processes on this node.
    pub local_world_size: WorldSize,
    /// The rendezvous store served by rank 0.
    pub master: MasterAddr,
    /// The job's shared secret.
    pub token: JobToken,
    /// Deadlines.
    pub timeouts: Timeouts,
    /// Check before every collective that all ranks call the same one (costs one small
    /// all-gather per collective). `None`: `BURN_DDP_DEBUG_DESYNC` decides, off when unset.
    pub debug_desync: Option<bool>,
    /// How many times the launcher restarted the job before this attempt (0: the first). Read
    /// from `BURN_DDP_RESTART_COUNT` (or torchrun's `TORCHELASTIC_RESTART_COUNT`) by
    /// [`env::group_config_from_env`].
    pub restart_count: u32,
    /// Where the store's port came from, when it is not `MASTER_PORT` itself (said in the
    /// error when the port is taken).
    pub port_origin: Option<String>,
    /// Fault-tolerant mode (`burn-ddp run --fault-tolerant`): the job survives the loss of
    /// ranks without restarting anyone. `None`: a failure ends the job.
    pub fault_tolerance: Option<FaultTolerance>,
    /// The launcher whose variables [`env::group_config_from_env`] read, for its advice in
    /// messages; `None` otherwise.
    pub launcher: Option<Launcher>,
    /// How collectives between processes run; every rank must choose the same. `Auto`:
    /// `BURN_DDP_ALGO` decides, by size when unset.
    pub algorithm: Algorithm,
    /// How ranks of one host move the bytes of collectives; every rank must choose the same.
    /// `Auto`: `BURN_DDP_TRANSPORT` decides, shared memory when the whole group shares a host.
    pub transport: Transport,
}

/// Who started the process, as its environment tells ([`env::group_config_from_env`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Launcher {
    /// torchrun's variables (`RANK`, `WORLD_SIZE`, ...), also set by `burn-ddp run`, `spawn`
    /// and Kubeflow's PyTorchJob.
    Torchrun,
    /// Open MPI's `mpirun`.
    OpenMpi,
    /// MPICH's or Intel MPI's `mpiexec` (the Hydra process manager).
    Hydra,
    /// Slurm's `srun`.
    Slurm,
}

impl Launcher {
    /// The launcher's name in messages.
    pub fn name(self) -> &'static str {
        match self {
            Launcher::Torchrun => "torchrun",
            Launcher::OpenMpi => "Open MPI (mpirun)",
            Launcher::Hydra => "MPICH/Intel MPI (mpiexec)",
            Launcher::Slurm => "Slurm",
        }
    }
}

/// The settings of a fault-tolerant job (see `ProcessGroup::recover`).
///
/// The job's store is served by its launcher (`MASTER_ADDR:MASTER_PORT`), not by rank 0, so
/// that any rank may die. Each process has a member id, unique for the job's life: the
/// first processes take their `RANK`, later ones a fresh id from the store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FaultTolerance {
    /// Join a running job (a replacement, or a process started later) instead of forming it
    /// with the others: wait to be admitted at a step boundary, then receive the state of a
    /// rank that has it.
    pub join: bool,
    /// The member id to claim (the launcher gives one to the processes it starts); `None`:
    /// `RANK` for the processes that form the job, a fresh id for a joining one.
    pub member: Option<u32>,
    /// The fewest ranks the job goes on with (default 1): below it, the survivors wait for
    /// processes to join, up to the rendezvous timeout.
    pub min_ranks: u32,
}

impl Default for FaultTolerance {
    fn default() -> Self {
        Self {
            join: false,
            member: None,
            min_ranks: 1,
        }
    }
}

impl GroupConfig {
    /// A single-node configuration: local rank = rank, master on `127.0.0.1:29500`.
    pub fn new(rank: Rank, world_size: WorldSize, token: JobToken) -> Self {
        Self {
            rank,
            world_size,
            local_rank: LocalRank(rank.0),
            local_world_size: world_size,
            master: MasterAddr::new("127.0.0.1", DEFAULT_MASTER_PORT),
            token,
            timeouts: Timeouts::default(),
            debug_desync: None,
            restart_count: 0,
            port_origin: None,
            fault_tolerance: None,
            launcher: None,
            algorithm: Algorithm::Auto,
            transport: Transport::Auto,
        }
    }

    /// Makes the group fault-tolerant (the store must be served by a launcher:
    /// `burn-ddp run --fault-tolerant`, or [`crate::launch::lighthouse::Lighthouse`]).
    pub fn with_fault_tolerance(mut self, ft: FaultTolerance) -> Self {
        self.fault_tolerance = Some(ft);
        self
    }

    /// Turns the cross-rank check before every collective on or off, whatever
    /// `BURN_DDP_DEBUG_DESYNC` says.
    pub fn with_debug_desync(mut self, on: bool) -> Self {
        self.debug_desync = Some(on);
        self
    }

    /// Chooses how collectives between processes run, whatever `BURN_DDP_ALGO` says (every
    /// rank must choose the same).
    pub fn with_algorithm(mut self, algorithm: Algorithm) -> Self {
        self.algorithm = algorithm;
        self
    }

    /// Chooses how ranks of one host move the bytes of collectives, whatever
    /// `BURN_DDP_TRANSPORT` says (every rank must choose the same).
    pub fn with_transport(mut self, transport: Transport) -> Self {
        self.transport = transport;
        self
    }

    /// Sets which attempt of a restarted job this is.
    pub fn with_restart_count(mut self, restart_count: u32) -> Self {
        self.restart_count = restart_count;
        self
    }

    /// Sets the master address.
    pub fn with_master(mut self, master: MasterAddr) -> Self {
        self.master = master;
        self
    }

    /// Sets the deadlines.
    pub fn with_timeouts(mut self, timeouts: Timeouts) -> Self {
        self.timeouts = timeouts;
        self
    }

    /// Sets the node-local rank and node size.
    pub fn with_local(mut self, local_rank: LocalRank, local_world_size: WorldSize) -> Self {
        self.local_rank = local_rank;
        self.local_world_size = local_world_size;
        self
    }

    /// Checks the invariants between the fields.
    ///
    /// # Errors
    /// [`ConfigError::RankOutOfRange`] or
    /// [`ConfigError::LocalRankOutOfRange`] naming the field.
    pub fn validate(&self) -> crate::Result<()> {
        if !self.world_size.contains(self.rank) {
            return Err(crate::DdpError::Config(ConfigError::RankOutOfRange {
                rank: self.rank,
                world: self.world_size,
            }));
        }
        if self.local_rank.0 >= self.local_world_size.get() {
            return Err(crate::DdpError::Config(ConfigError::LocalRankOutOfRange {
                rank: self.rank,
                local_rank: self.local_rank,
                local_world: self.local_world_size,
            }));
        }
        Ok(())
    }
}

/// The batch size of each of `world` ranks for a global batch of `global` items
/// ([`ProcessGroup::per_rank_batch`](crate::ProcessGroup::per_rank_batch)).
///
/// ```
/// use burn_ddp_comm::{data::per_rank_batch, WorldSize};
///
/// assert_eq!(per_rank_batch(256, WorldSize::new(4).unwrap())?, 64);
/// let e = per_rank_batch(100, WorldSize::new(3).unwrap()).unwrap_err();
/// assert!(e.to_string().contains("99 or 102"), "{e}");
/// # Ok::<(), burn_ddp_comm::DdpError>(())
/// ```
///
/// # Errors
/// [`ConfigError::UnevenGlobalBatch`] when `global` is not a positive multiple of `world`,
/// naming the nearest ones that are.
pub fn per_rank_batch(global: usize, world: WorldSize) -> crate::Result<usize> {
    let w = world.as_usize();
    if global > 0 && global.is_multiple_of(w) {
        return Ok(global / w);
    }
    let below = global / w * w;
    let above = below.saturating_add(w);
    let nearest = if below == 0 {
        format!("at least {above}")
    } else {
        format!("{below} or {above}")
    };
    Err(ConfigError::UnevenGlobalBatch {
        global,
        world,
        nearest,
    }
    .into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_is_redacted_in_debug() {
        let t = JobToken::new("secret-value");
        assert!(!format!("{t:?}").contains("secret"));
    }

    /// Options that do not fit the endpoints are refused, each naming the option to give.
    #[test]
    fn etcd_security_that_does_not_fit_its_endpoints_is_refused_with_the_fix() {
        let tls = EtcdStore::parse("https://a:2379,https://b:2379").unwrap();
        let plain = EtcdStore::parse("a:2379,http://b:2379").unwrap();
        assert!(tls.is_tls() && !plain.is_tls());
        let err = EtcdStore::parse("https://a:2379,b:2379").unwrap_err();
        assert!(err.contains("one scheme"), "{err}");
        let err = EtcdStore::parse("grpc://a:2379").unwrap_err();
        assert!(err.contains("https://host:port"), "{err}");
        let file = |f: &str| Some(std::path::PathBuf::from(f));
        let ca = EtcdSecurity {
            ca: file("ca.pem"),
            ..EtcdSecurity::default()
        };
        let refusals = [
            (&tls, EtcdSecurity::default(), "--etcd-ca"),
            (&plain, ca.clone(), "https://host:port"),
            (
                &tls,
                EtcdSecurity {
                    cert: file("c.pem"),
                    ..ca.clone()
                },
                "--etcd-key",
            ),
            (
                &plain,
                EtcdSecurity {
                    user: Some("root".into()),
                    ..EtcdSecurity::default()
                },
                "BURN_DDP_ETCD_PASSWORD",
            ),
        ];
        for (store, security, fix) in refusals {
            let err = store.clone().with_security(security).unwrap_err();
            assert!(err.contains(fix), "{err}");
        }
        let full = EtcdSecurity {
            cert: file("c.pem"),
            key: file("c.key"),
            user: Some("root".into()),
            password: Some("s3cret".into()),
            ..ca
        };
        let store = tls.with_security(full.clone()).unwrap();
        assert_eq!(store.security, full);
        assert!(!format!("{store:?}").contains("s3cret"));
    }

    #[test]
    fn generated_tokens_differ() {
        assert_ne!(JobToken::generate(), JobToken::generate());
    }

    #[test]
    fn master_display_brackets_ipv6() {
        assert_eq!(MasterAddr::new("::1", 5).to_string(), "[::1]:5");
        assert_eq!(MasterAddr::new("node01", 29500).to_string(), "node01:29500");
    }

    #[test]
    fn validate_names_the_bad_field() {
        let w = WorldSize::new(2).unwrap();
        let cfg = GroupConfig::new(Rank(2), w, JobToken::new("t"));
        assert!(matches!(
            cfg.validate(),
            Err(crate::DdpError::Config(ConfigError::RankOutOfRange { .. }))
        ));
        let cfg = GroupConfig::new(Rank(1), w, JobToken::new("t")).with_local(LocalRank(3), w);
        assert!(matches!(
            cfg.validate(),
            Err(crate::DdpError::Config(
                ConfigError::LocalRankOutOfRange { .. }
            ))
        ));
    }
}
