//! The one place that reads the environment: turns the variables set by `burn-ddp run`, torchrun
//! or Slurm into a [`GroupConfig`], and resolves every other setting a variable can change.
//! Library code elsewhere calls a function here instead of `std::env::var`.
//!
//! Precedence, for every setting that also has a configuration field: the explicit
//! configuration, then the variable, then the default. [`GroupConfig::debug_desync`] `= Some(_)`
//! wins over `BURN_DDP_DEBUG_DESYNC`; [`GradTransport::Host`] or [`GradTransport::Nccl`] win
//! over `BURN_DDP_GRAD_TRANSPORT`, which replaces only [`GradTransport::Auto`].
//!
//! | variable | meaning | default |
//! |---|---|---|
//! | `RANK`, `WORLD_SIZE` | global rank and job size (torchrun) | single process when neither is set |
//! | `LOCAL_RANK`, `LOCAL_WORLD_SIZE` | rank and size on this node | `RANK`, `WORLD_SIZE` |
//! | `MASTER_ADDR`, `MASTER_PORT` | rank 0's store | host: the first of Slurm's node list; loopback when every rank is on this host (required under `mpirun` across hosts). Port: derived from the job under Slurm and Open MPI ([`job_port`]), else `29500` |
//! | `BURN_DDP_ETCD_ENDPOINTS` | a fault-tolerant job's store is kept by this etcd cluster (`host:port,...`; set by `burn-ddp run --rdzv-backend etcd`; needs the `etcd` feature) | unset: the launcher's store |
//! | `BURN_DDP_ETCD_CA`, `BURN_DDP_ETCD_CERT`, `BURN_DDP_ETCD_KEY` | TLS to the etcd cluster (`https://` endpoints): the CA that signed its members' certificates, this process's client certificate and key (PEM files; set by `burn-ddp run --etcd-ca/--etcd-cert/--etcd-key`) | plain TCP |
//! | `BURN_DDP_ETCD_USER`, `BURN_DDP_ETCD_PASSWORD` | an etcd user and its password, for a cluster with authentication enabled (the password only ever from the environment) | no user |
//! | `BURN_DDP_LOCAL_ADDR` | this host's address for the job: its ranks' store connections come from it and their links listen on it (a host on several networks: the one the other hosts reach) | the address the route to the store picks |
//! | `BURN_DDP_STORE_PORT` | the store's port, overriding the rest | `MASTER_PORT + 1` under torchrun (`TORCHELASTIC_USE_AGENT_STORE=True`), else `MASTER_PORT` |
//! | `OMPI_COMM_WORLD_RANK`, `OMPI_COMM_WORLD_SIZE`, `OMPI_COMM_WORLD_LOCAL_RANK`, `OMPI_COMM_WORLD_LOCAL_SIZE`, `PMIX_NAMESPACE`, `OMPI_MCA_ess_base_jobid` | Open MPI's `mpirun` (when `RANK` is not set); `PMIX_RANK` must agree | |
//! | `PMI_RANK`, `PMI_SIZE`, `MPI_LOCALRANKID`, `MPI_LOCALNRANKS` | MPICH's and Intel MPI's `mpiexec` (Hydra), when neither `RANK` nor Open MPI's are set | |
//! | `SLURM_PROCID`, `SLURM_STEP_NUM_TASKS` (else `SLURM_NTASKS`), `SLURM_LOCALID`, `SLURM_STEP_TASKS_PER_NODE`, `SLURM_STEP_NODELIST`, `SLURM_STEP_ID` | Slurm (`srun`), when none of the above is set; a batch script (no `SLURM_STEP_ID`) of several tasks is refused | |
//! | `BURN_DDP_JOB_TOKEN` | job secret | `TORCHELASTIC_RUN_ID`, then the MPI job (`PMIX_NAMESPACE`, `OMPI_MCA_ess_base_jobid`), then `SLURM_JOB_ID.SLURM_STEP_ID` |
//! | `BURN_DDP_TIMEOUT` | every deadline (`90`, `2.5s`, `10m`) | 10 min |
//! | `BURN_DDP_RENDEZVOUS_TIMEOUT`, `BURN_DDP_STORE_TIMEOUT`, `BURN_DDP_COLLECTIVE_TIMEOUT` | one deadline each | `BURN_DDP_TIMEOUT` |
//! | `BURN_DDP_HEARTBEAT_TIMEOUT` | silence after which a rank is reported dead or frozen | 15 s (or `BURN_DDP_TIMEOUT` if shorter) |
//! | `BURN_DDP_STALL_TIMEOUT` | wait after which a live rank that is elsewhere is reported stuck | 3 min (or `BURN_DDP_TIMEOUT` if shorter) |
//! | `BURN_DDP_DEBUG_DESYNC=1` | check before every collective that all ranks call the same one (`1`/`true`/`yes`/`on`, `0`/`false`/`no`/`off`) | off |
//! | `BURN_DDP_RESTART_COUNT`, `TORCHELASTIC_RESTART_COUNT`, `SLURM_RESTART_COUNT` | which attempt of a restarted (or requeued) job this is, the first set | 0 |
//! | `BURN_DDP_RUN_ID`, `TORCHELASTIC_RUN_ID`, `SLURM_JOB_ID`, `LSB_JOBID`, `PBS_JOBID` | the job's identity across its restarts and requeues, recorded with its checkpoints ([`run_id`]) | none |
//! | `BURN_DDP_FIRST_WORLD_SIZE`, `BURN_DDP_PREVIOUS_WORLD_SIZE` | an elastic job's world size in its first round and in the round before this one (set by `burn-ddp run --nnodes MIN:MAX`) | unset |
//! | `BURN_DDP_ALGO` | how collectives between processes run: `auto` (recursive doubling for small all-reduces and barriers, the ring above), `ring`, `tree`; the same on every rank | `auto` |
//! | `BURN_DDP_TRANSPORT` | how ranks of one host move the bytes of collectives: `auto` (shared memory when every rank of the group is on one host; two levels, shared memory then TCP, for large all-reduces when every host has as many ranks; TCP otherwise), `tcp`, `shm`; the same on every rank | `auto` |
//! | `BURN_DDP_GRAD_TRANSPORT` | how GPU gradient buckets travel: `auto`, `host`, `nccl`; read by `DdpConfig::from_env` / `with_env` (and so by `DdpSession::from_env`, `GradSync::from_env`), not by a session made with `new` | `auto` |
//! | `BURN_DDP_FAULT_TOLERANT=1` | a fault-tolerant job: the ranks survive the loss of others (set by `burn-ddp run --fault-tolerant`, whose launcher serves the store) | off |
//! | `BURN_DDP_FT_JOIN=1` | this process joins a running fault-tolerant job | off |
//! | `BURN_DDP_MEMBER_ID` | the member id this process claims in a fault-tolerant job | `RANK`, or a fresh id when joining |
//! | `BURN_DDP_MIN_RANKS` | the fewest ranks a fault-tolerant job goes on with | 1 |
//! | `BURN_DDP_RANK_MARKERS=1` | the launcher prefixes this process's output with its rank: a fault-tolerant process tells it its rank after each change of membership, in a line the launcher swallows (set by `burn-ddp run` when it prefixes) | off |
//! | `CUDA_VISIBLE_DEVICES` | the GPUs this process sees (read for choosing and naming a rank's GPU) | all |
//! | `LD_LIBRARY_PATH`, `VIRTUAL_ENV`, `CONDA_PREFIX`, `HOME` | where to look for `libnccl` when it is missing, for the message | |
//! | `OMP_NUM_THREADS` | left as set; the launcher sets it to 1 for several ranks per node when unset | |

use crate::error::ConfigError;
use std::time::Duration;

use std::ffi::OsString;

use crate::config::{
    Algorithm, EtcdStore, FaultTolerance, GradTransport, GroupConfig, JobToken, Launcher,
    MasterAddr, Timeouts, Transport, DEFAULT_MASTER_PORT,
};
use crate::types::{LocalRank, Rank, WorldSize};
use crate::{DdpError, Result};

mod placement;
pub use placement::{group_config_from, job_port, launched};

/// Variables of the torchrun contract.
pub const RANK: &str = "RANK";
/// Job size.
pub const WORLD_SIZE: &str = "WORLD_SIZE";
/// Rank on this node.
pub const LOCAL_RANK: &str = "LOCAL_RANK";
/// Ranks on this node.
pub const LOCAL_WORLD_SIZE: &str = "LOCAL_WORLD_SIZE";
/// Host of rank 0's store.
pub const MASTER_ADDR: &str = "MASTER_ADDR";
/// Port of rank 0's store.
pub const MASTER_PORT: &str = "MASTER_PORT";
/// Port of burn-ddp's store when it must differ from `MASTER_PORT` (default under torchrun:
/// `MASTER_PORT + 1`, since torchrun's agent serves its own store on `MASTER_PORT`).
pub const STORE_PORT: &str = "BURN_DDP_STORE_PORT";
/// This host's address for the job's connections ([`MasterAddr::local`]).
pub const LOCAL_ADDR: &str = "BURN_DDP_LOCAL_ADDR";
/// The etcd cluster that keeps a fault-tolerant job's store (`host:port,...`), instead of the
/// launcher on `MASTER_ADDR:MASTER_PORT` (set by `burn-ddp run --rdzv-backend etcd`).
pub const ETCD_ENDPOINTS: &str = "BURN_DDP_ETCD_ENDPOINTS";
/// The CA certificate (PEM) that signed the etcd members' certificates (`https://` endpoints).
pub const ETCD_CA: &str = "BURN_DDP_ETCD_CA";
/// This process's client certificate (PEM) for the etcd cluster.
pub const ETCD_CERT: &str = "BURN_DDP_ETCD_CERT";
/// The private key (PEM) of [`ETCD_CERT`].
pub const ETCD_KEY: &str = "BURN_DDP_ETCD_KEY";
/// An etcd user, with [`ETCD_PASSWORD`].
pub const ETCD_USER: &str = "BURN_DDP_ETCD_USER";
/// The password of [`ETCD_USER`] (read from the environment only, never from a command line).
pub const ETCD_PASSWORD: &str = "BURN_DDP_ETCD_PASSWORD";
/// The job secret.
pub const JOB_TOKEN: &str = "BURN_DDP_JOB_TOKEN";
/// All deadlines at once.
pub const TIMEOUT: &str = "BURN_DDP_TIMEOUT";
/// Rendezvous deadline.
pub const RENDEZVOUS_TIMEOUT: &str = "BURN_DDP_RENDEZVOUS_TIMEOUT";
/// Store request deadline.
pub const STORE_TIMEOUT: &str = "BURN_DDP_STORE_TIMEOUT";
/// Collective deadline.
pub const COLLECTIVE_TIMEOUT: &str = "BURN_DDP_COLLECTIVE_TIMEOUT";
/// How many times `burn-ddp run --max-restarts` restarted the group before this attempt (0 at
/// first); torchrun's `TORCHELASTIC_RESTART_COUNT` is read too.
pub const RESTART_COUNT: &str = "BURN_DDP_RESTART_COUNT";
/// Heartbeat silence bound.
pub const HEARTBEAT_TIMEOUT: &str = "BURN_DDP_HEARTBEAT_TIMEOUT";
/// Stall bound.
pub const STALL_TIMEOUT: &str = "BURN_DDP_STALL_TIMEOUT";

/// Reads the process environment into a [`GroupConfig`].
///
/// # Errors
/// `MissingEnv`/`InvalidEnv` naming the variable, or `RankOutOfRange`.
pub fn group_config_from_env() -> Result<GroupConfig> {
    group_config_from(|k| std::env::var(k).ok())
}

/// Fault-tolerant mode ([`GroupConfig::fault_tolerance`]): `1` (set by `burn-ddp run
/// --fault-tolerant`).
pub const FAULT_TOLERANT: &str = "BURN_DDP_FAULT_TOLERANT";
/// In a fault-tolerant job: this process joins the running job (a replacement) instead of
/// forming it ([`FaultTolerance::join`]).
pub const FT_JOIN: &str = "BURN_DDP_FT_JOIN";
/// In a fault-tolerant job: the member id this process claims ([`FaultTolerance::member`]).
pub const MEMBER_ID: &str = "BURN_DDP_MEMBER_ID";
/// In a fault-tolerant job: the fewest ranks it goes on with ([`FaultTolerance::min_ranks`]).
pub const MIN_RANKS: &str = "BURN_DDP_MIN_RANKS";

/// The launcher prefixes this process's output lines with its rank and follows its changes: a
/// fault-tolerant process writes a marker line (`group/membership/marker.rs`) when a
/// change of membership gives it another rank. Set by `burn-ddp run` for the ranks it prefixes.
pub const RANK_MARKERS: &str = "BURN_DDP_RANK_MARKERS";

/// Whether this process's launcher follows its rank through marker lines ([`RANK_MARKERS`]).
pub fn rank_markers() -> bool {
    std::env::var(RANK_MARKERS).is_ok_and(|v| v == "1")
}

/// The variable that turns on the check before every collective ([`GroupConfig::debug_desync`]).
pub const DEBUG_DESYNC: &str = "BURN_DDP_DEBUG_DESYNC";
/// How collectives between processes run ([`Algorithm`]).
pub const ALGO: &str = "BURN_DDP_ALGO";
/// How ranks of one host move the bytes of collectives ([`Transport`]).
pub const TRANSPORT: &str = "BURN_DDP_TRANSPORT";
/// How GPU gradient buckets travel ([`GradTransport`]).
pub const GRAD_TRANSPORT: &str = "BURN_DDP_GRAD_TRANSPORT";
/// The world size of the round before this one in an elastic job (`burn-ddp run --nnodes
/// MIN:MAX`), set by the launcher from the second round on; see [`previous_world_size`].
pub const PREVIOUS_WORLD_SIZE: &str = "BURN_DDP_PREVIOUS_WORLD_SIZE";

/// The world size of an elastic job's first round, set by the launcher in every round; see
/// [`first_world_size`].
pub const FIRST_WORLD_SIZE: &str = "BURN_DDP_FIRST_WORLD_SIZE";

fn world_var(var: &str) -> Option<u32> {
    std::env::var(var)
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .filter(|n| *n > 0)
}

/// In an elastic job restarted at another size, the world size of the round before
/// ([`PREVIOUS_WORLD_SIZE`], the same on every rank); `None` in the first round or outside an
/// elastic job. For saying what changed.
pub fn previous_world_size() -> Option<u32> {
    world_var(PREVIOUS_WORLD_SIZE)
}

/// In an elastic job, the world size of its first round ([`FIRST_WORLD_SIZE`], the same on
/// every rank, a node that joined later included); `None` outside an elastic job.
///
/// This is the hook for what a new world size should change. The per-rank batch stays the
/// same, so the global batch scales with the world size. A program that wants the same
/// optimisation per sample scales its learning rate by `world / first` (the linear scaling
/// rule, from the learning rate it was given for the first round), or keeps the global batch
/// by changing the per-rank batch instead.
pub fn first_world_size() -> Option<u32> {
    world_var(FIRST_WORLD_SIZE)
}

/// A learning rate scaled by the linear rule to an elastic round's world size
/// ([`linear_scaled_lr`]). Shown as the line a program prints once, on rank 0.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LinearScaledLr {
    /// `given × world / first`.
    pub lr: f64,
    /// The learning rate the program was given (for the first round).
    pub given: f64,
    /// This round's world size.
    pub world: u32,
    /// The first round's world size.
    pub first: u32,
}

impl LinearScaledLr {
    /// `given` scaled from a first round of `first` ranks to a round of `world`.
    pub fn new(given: f64, world: u32, first: u32) -> Self {
        Self {
            lr: given * f64::from(world) / f64::from(first.max(1)),
            given,
            world,
            first,
        }
    }
}

impl std::fmt::Display for LinearScaledLr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "learning rate {:.2e}: {:.2e} scaled by world size {} / {}",
            self.lr, self.given, self.world, self.first
        )
    }
}

/// In an elastic job, `lr` (the learning rate for its first round) scaled by the linear rule
/// to this round's `world` size (see [`first_world_size`]); `None` outside an elastic job.
pub fn linear_scaled_lr(lr: f64, world: u32) -> Option<LinearScaledLr> {
    first_world_size().map(|first| LinearScaledLr::new(lr, world, first))
}

/// torchrun's restart counter, read when [`RESTART_COUNT`] is not set.
pub const TORCHELASTIC_RESTART_COUNT: &str = "TORCHELASTIC_RESTART_COUNT";

/// Slurm's count of a job's requeues (`sbatch --requeue`, preemption, `scontrol requeue`),
/// read when neither [`RESTART_COUNT`] nor [`TORCHELASTIC_RESTART_COUNT`] is set.
pub const SLURM_RESTART_COUNT: &str = "SLURM_RESTART_COUNT";

/// The restart counters, in the order they are read: the first one set counts.
pub const RESTART_COUNTERS: [&str; 3] = [
    RESTART_COUNT,
    TORCHELASTIC_RESTART_COUNT,
    SLURM_RESTART_COUNT,
];

/// How many times the launcher restarted the group before this attempt (0: the first):
/// `burn-ddp run --max-restarts`, torchrun's restarts, or Slurm's requeues.
pub fn restart_count() -> u32 {
    restart_count_from(&|k: &str| std::env::var(k).ok())
}

fn restart_count_from(get: &impl Fn(&str) -> Option<String>) -> u32 {
    RESTART_COUNTERS
        .iter()
        .find_map(|v| get(v)?.trim().parse().ok())
        .unwrap_or(0)
}

/// The job's identity when the program or a launcher other than those below gives one; kept
/// across the job's restarts.
pub const RUN_ID: &str = "BURN_DDP_RUN_ID";

/// The variables that name a job across its restarts and requeues, in the order they are read,
/// with the prefix the id gets (so that ids of different schedulers never match).
const RUN_IDS: [(&str, &str); 5] = [
    (RUN_ID, ""),
    ("TORCHELASTIC_RUN_ID", "torchelastic:"),
    ("SLURM_JOB_ID", "slurm:"),
    ("LSB_JOBID", "lsf:"),
    ("PBS_JOBID", "pbs:"),
];

/// The job's identity, the same in every attempt of a restarted or requeued job: `BURN_DDP_RUN_ID`,
/// else torchrun's run id (not its `none`), else Slurm's, LSF's or PBS's job id (which a
/// requeue keeps). `None` when nothing names the job (a single process, `spawn`, `mpirun`).
///
/// Recorded with a run's checkpoints: a run that finds checkpoints of its own job id resumes
/// from them instead of starting again, whatever its restart counter says.
pub fn run_id() -> Option<String> {
    run_id_from(&|k: &str| std::env::var(k).ok())
}

fn run_id_from(get: &impl Fn(&str) -> Option<String>) -> Option<String> {
    RUN_IDS.iter().find_map(|(var, prefix)| {
        let v = get(var)?;
        let v = v.trim();
        (!v.is_empty() && v != "none").then(|| format!("{prefix}{v}"))
    })
}

/// Whether to check before every collective that all ranks call the same one: `explicit` if
/// set, else `BURN_DDP_DEBUG_DESYNC`, else off.
///
/// # Errors
/// `InvalidEnv` when the variable holds something other than a yes or a no.
pub fn debug_desync(explicit: Option<bool>) -> Result<bool> {
    match explicit {
        Some(on) => Ok(on),
        None => debug_desync_from(&|k: &str| std::env::var(k).ok()),
    }
}

fn debug_desync_from(get: &impl Fn(&str) -> Option<String>) -> Result<bool> {
    flag(get, DEBUG_DESYNC)
}

/// A yes-or-no variable (unset: no).
fn flag(get: &impl Fn(&str) -> Option<String>, var: &'static str) -> Result<bool> {
    let Some(v) = get(var) else {
        return Ok(false);
    };
    match v.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" | "detail" => Ok(true),
        "" | "0" | "false" | "no" | "off" => Ok(false),
        _ => Err(DdpError::Config(ConfigError::InvalidEnv {
            var,
            value: v,
            expected: "1, true, yes or on (or 0, false, no, off)",
        })),
    }
}

/// The fault-tolerant settings, when [`FAULT_TOLERANT`] is on.
fn fault_tolerance_from(get: &impl Fn(&str) -> Option<String>) -> Result<Option<FaultTolerance>> {
    if !flag(get, FAULT_TOLERANT)? {
        for var in [FT_JOIN, MEMBER_ID, MIN_RANKS] {
            if get(var).is_some() {
                tracing::warn!("{var} is set but {FAULT_TOLERANT} is not: {var} is ignored");
            }
        }
        return Ok(None);
    }
    let min_ranks = parse_u32(get, MIN_RANKS, "a number of ranks, 1 or more")?.unwrap_or(1);
    if min_ranks == 0 {
        return Err(DdpError::Config(ConfigError::InvalidEnv {
            var: MIN_RANKS,
            value: "0".into(),
            expected: "a number of ranks, 1 or more",
        }));
    }
    Ok(Some(FaultTolerance {
        join: flag(get, FT_JOIN)?,
        member: parse_u32(get, MEMBER_ID, "a non-negative integer")?,
        min_ranks,
    }))
}

/// The collective algorithm: `explicit` when it is `Ring` or `Tree`, else `BURN_DDP_ALGO` when
/// set, else `Auto`.
///
/// # Errors
/// `InvalidEnv` when the variable holds something other than `auto`, `ring` or `tree`.
pub fn algorithm(explicit: Algorithm) -> Result<Algorithm> {
    algorithm_from(explicit, &|k: &str| std::env::var(k).ok())
}

fn algorithm_from(explicit: Algorithm, get: &impl Fn(&str) -> Option<String>) -> Result<Algorithm> {
    choice_from(
        explicit,
        Algorithm::Auto,
        ALGO,
        Algorithm::parse,
        "auto, ring or tree",
        get,
    )
}

/// The transport between ranks of one host: `explicit` when it is `Tcp` or `Shm`, else
/// `BURN_DDP_TRANSPORT` when set, else `Auto`.
///
/// # Errors
/// `InvalidEnv` when the variable holds something other than `auto`, `tcp` or `shm`.
pub fn transport(explicit: Transport) -> Result<Transport> {
    transport_from(explicit, &|k: &str| std::env::var(k).ok())
}

fn transport_from(explicit: Transport, get: &impl Fn(&str) -> Option<String>) -> Result<Transport> {
    choice_from(
        explicit,
        Transport::Auto,
        TRANSPORT,
        Transport::parse,
        "auto, tcp or shm",
        get,
    )
}

/// The gradient transport: `explicit` when it is `Host` or `Nccl`, else
/// `BURN_DDP_GRAD_TRANSPORT` when set, else `Auto`.
///
/// # Errors
/// `InvalidEnv` when the variable holds something other than `auto`, `host` or `nccl`.
pub fn grad_transport(explicit: GradTransport) -> Result<GradTransport> {
    grad_transport_from(explicit, &|k: &str| std::env::var(k).ok())
}

fn grad_transport_from(
    explicit: GradTransport,
    get: &impl Fn(&str) -> Option<String>,
) -> Result<GradTransport> {
    let parse = GradTransport::parse;
    choice_from(
        explicit,
        GradTransport::Auto,
        GRAD_TRANSPORT,
        parse,
        "auto, host or nccl",
        get,
    )
}

/// A choice of the code's (`explicit`) unless it is `auto`, else the variable `var` when set
/// (read by `parse`), else `auto`.
fn choice_from<T: Copy + PartialEq>(
    explicit: T,
    auto: T,
    var: &'static str,
    parse: fn(&str) -> Option<T>,
    expected: &'static str,
    get: &impl Fn(&str) -> Option<String>,
) -> Result<T> {
    if explicit != auto {
        return Ok(explicit);
    }
    match get(var) {
        None => Ok(auto),
        Some(v) => parse(&v).ok_or(DdpError::Config(ConfigError::InvalidEnv {
            var,
            value: v,
            expected,
        })),
    }
}

/// `BURN_DDP_JOB_TOKEN`, when set and not empty (the launcher's default job token).
pub fn job_token() -> Option<String> {
    std::env::var(JOB_TOKEN).ok().filter(|t| !t.is_empty())
}

/// The etcd options of the environment ([`ETCD_CA`], [`ETCD_CERT`], [`ETCD_KEY`],
/// [`ETCD_USER`], [`ETCD_PASSWORD`]); unset or empty ones are `None`.
pub fn etcd_security() -> crate::config::EtcdSecurity {
    etcd_security_from(|k| std::env::var(k).ok())
}

/// [`etcd_security`] from `get`.
pub(crate) fn etcd_security_from(
    get: impl Fn(&str) -> Option<String>,
) -> crate::config::EtcdSecurity {
    let get = |k| get(k).filter(|v| !v.is_empty());
    crate::config::EtcdSecurity {
        ca: get(ETCD_CA).map(Into::into),
        cert: get(ETCD_CERT).map(Into::into),
        key: get(ETCD_KEY).map(Into::into),
        user: get(ETCD_USER),
        password: get(ETCD_PASSWORD),
    }
}

/// Whether `RANK` is set: the process runs as one rank of a job rather than as its launcher.
pub fn rank_is_set() -> bool {
    std::env::var_os(RANK).is_some()
}

/// Whether the user asked for logs (`RUST_LOG`): `burn-ddp bench scale` then keeps its host
/// processes' (they are silent otherwise).
pub fn logs_asked() -> bool {
    std::env::var_os("RUST_LOG").is_some()
}

/// Whether the user chose `OMP_NUM_THREADS` (the launcher then leaves it alone).
pub fn omp_num_threads_set() -> bool {
    std::env::var_os("OMP_NUM_THREADS").is_some()
}

/// Where to look for a missing `libnccl`: the directories of `LD_LIBRARY_PATH`, and the
/// active virtual environment (`VIRTUAL_ENV`, else `CONDA_PREFIX`) and home directory.
#[derive(Debug, Clone, Default)]
pub struct LibrarySearch {
    /// `LD_LIBRARY_PATH`, split.
    pub ld_library_path: Vec<std::path::PathBuf>,
    /// The active Python environment's prefix.
    pub python_env: Option<OsString>,
    /// `HOME`.
    pub home: Option<OsString>,
}

/// Reads [`LibrarySearch`] from the environment.
pub fn library_search() -> LibrarySearch {
    LibrarySearch {
        ld_library_path: std::env::var_os("LD_LIBRARY_PATH")
            .map(|v| std::env::split_paths(&v).collect())
            .unwrap_or_default(),
        python_env: std::env::var_os("VIRTUAL_ENV").or_else(|| std::env::var_os("CONDA_PREFIX")),
        home: std::env::var_os("HOME"),
    }
}

/// `CUDA_VISIBLE_DEVICES`, when set (for choosing a rank's GPU, and in messages about it).
pub fn cuda_visible_devices() -> Option<String> {
    std::env::var("CUDA_VISIBLE_DEVICES").ok()
}

fn parse_u32(
    get: &impl Fn(&str) -> Option<String>,
    var: &'static str,
    expected: &'static str,
) -> Result<Option<u32>> {
    match get(var) {
        None => Ok(None),
        Some(v) => v.trim().parse().map(Some).map_err(|_| {
            DdpError::Config(ConfigError::InvalidEnv {
                var,
                value: v.clone(),
                expected,
            })
        }),
    }
}

/// Parses `90`, `2.5`, `2.5s`, `500ms`, `10m`, `1h`.
pub(crate) fn parse_duration(v: &str) -> Option<Duration> {
    let v = v.trim();
    let (num, scale) = if let Some(n) = v.strip_suffix("ms") {
        (n, 0.001)
    } else if let Some(n) = v.strip_suffix('s') {
        (n, 1.0)
    } else if let Some(n) = v.strip_suffix('m') {
        (n, 60.0)
    } else if let Some(n) = v.strip_suffix('h') {
        (n, 3600.0)
    } else {
        (v, 1.0)
    };
    let secs: f64 = num.trim().parse().ok()?;
    (secs.is_finite() && secs > 0.0).then(|| Duration::from_secs_f64(secs * scale))
}

fn duration(get: &impl Fn(&str) -> Option<String>, var: &'static str) -> Result<Option<Duration>> {
    match get(var) {
        None => Ok(None),
        Some(v) => parse_duration(&v)
            .map(Some)
            .ok_or(DdpError::Config(ConfigError::InvalidEnv {
                var,
                value: v.clone(),
                expected: "a positive duration such as 90, 2.5s, 500ms or 10m",
            })),
    }
}

fn timeouts(get: &impl Fn(&str) -> Option<String>) -> Result<Timeouts> {
    let base = duration(get, TIMEOUT)?
        .map(Timeouts::uniform)
        .unwrap_or_default();
    Ok(Timeouts {
        rendezvous: duration(get, RENDEZVOUS_TIMEOUT)?.unwrap_or(base.rendezvous),
        store: duration(get, STORE_TIMEOUT)?.unwrap_or(base.store),
        collective: duration(get, COLLECTIVE_TIMEOUT)?.unwrap_or(base.collective),
        heartbeat: duration(get, HEARTBEAT_TIMEOUT)?.unwrap_or(base.heartbeat),
        stall: duration(get, STALL_TIMEOUT)?.unwrap_or(base.stall),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_linear_rule_scales_by_the_world_size_over_the_first() {
        let s = LinearScaledLr::new(0.01, 3, 2);
        assert!((s.lr - 0.015).abs() < 1e-12, "{}", s.lr);
        assert_eq!(
            s.to_string(),
            "learning rate 1.50e-2: 1.00e-2 scaled by world size 3 / 2"
        );
        assert!((LinearScaledLr::new(0.01, 1, 2).lr - 0.005).abs() < 1e-12);
    }
    use std::collections::HashMap;

    /// An environment of `pairs` only, for the `*_from` functions (also `placement.rs`'s tests).
    pub(super) fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let m: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| m.get(k).cloned()
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("90"), Some(Duration::from_secs(90)));
        assert_eq!(parse_duration("2.5s"), Some(Duration::from_millis(2500)));
        assert_eq!(parse_duration("500ms"), Some(Duration::from_millis(500)));
        assert_eq!(parse_duration("10m"), Some(Duration::from_secs(600)));
        assert_eq!(parse_duration("-1"), None);
        assert_eq!(parse_duration("x"), None);
    }

    #[test]
    fn timeouts_from_environment() {
        let cfg = group_config_from(env(&[
            ("BURN_DDP_TIMEOUT", "20"),
            ("BURN_DDP_COLLECTIVE_TIMEOUT", "3s"),
        ]))
        .unwrap();
        assert_eq!(cfg.timeouts.rendezvous, Duration::from_secs(20));
        assert_eq!(cfg.timeouts.collective, Duration::from_secs(3));
    }

    #[test]
    fn the_algorithm_variable_replaces_only_auto() {
        let get = env(&[("BURN_DDP_ALGO", " Tree ")]);
        assert_eq!(
            algorithm_from(Algorithm::Auto, &get).unwrap(),
            Algorithm::Tree
        );
        assert_eq!(
            algorithm_from(Algorithm::Ring, &get).unwrap(),
            Algorithm::Ring
        );
        assert_eq!(
            algorithm_from(Algorithm::Auto, &env(&[])).unwrap(),
            Algorithm::Auto
        );
        let err = algorithm_from(Algorithm::Auto, &env(&[("BURN_DDP_ALGO", "star")]))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("BURN_DDP_ALGO") && err.contains("auto, ring or tree"),
            "{err}"
        );
    }

    #[test]
    fn the_transport_variable_replaces_only_auto() {
        let get = env(&[("BURN_DDP_TRANSPORT", "SHM")]);
        assert_eq!(
            transport_from(Transport::Auto, &get).unwrap(),
            Transport::Shm
        );
        assert_eq!(
            transport_from(Transport::Tcp, &get).unwrap(),
            Transport::Tcp
        );
        assert_eq!(
            transport_from(Transport::Auto, &env(&[])).unwrap(),
            Transport::Auto
        );
        let err = transport_from(Transport::Auto, &env(&[("BURN_DDP_TRANSPORT", "rdma")]))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("BURN_DDP_TRANSPORT") && err.contains("auto, tcp or shm"),
            "{err}"
        );
    }
}
