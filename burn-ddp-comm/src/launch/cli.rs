//! The `burn-ddp` command line: `run` (a torchrun-like launcher) and `bench all-reduce`.

use crate::error::{ConfigError, JobError};
use std::ffi::OsString;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};

use super::bench::{AllReduceBench, BenchDType, BenchError, BenchResult};
use super::elastic::{ElasticConfig, NodeRange};
use super::spawn::{self, LocalJob, Output};
use crate::config::{Algorithm, JobToken, MasterAddr, Transport, DEFAULT_MASTER_PORT};
use crate::{DdpError, ReduceOp, Result};

/// Distributed data parallel training for Burn.
#[derive(Debug, Parser)]
#[command(name = "burn-ddp", version, about)]
pub struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Start a job's ranks on this node (like `torchrun --no-python`).
    Run(RunArgs),
    /// Measure the collectives' bandwidth (like nccl-tests).
    #[command(subcommand)]
    Bench(BenchCommand),
    /// List the GPUs the CUDA driver shows this process (like `nvidia-smi -L`, straight from
    /// `libcuda.so.1`, for machines without the driver's tools).
    Gpus,
}

/// What keeps a fault-tolerant job's store (`--rdzv-backend`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum RdzvBackend {
    /// Node 0's launcher serves it.
    Builtin,
    /// An etcd cluster keeps it.
    Etcd,
}

/// Options of `burn-ddp run`.
#[derive(Debug, Args)]
pub struct RunArgs {
    /// Processes to start on this node (one per GPU).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    nproc_per_node: u32,
    /// Number of nodes in the job, or `MIN:MAX` for an elastic job (torchrun's syntax): it
    /// starts once MIN nodes are there (and the join window has passed), admits up to MAX,
    /// and restarts every rank at the new size when a node is lost or joins.
    #[arg(long, default_value = "1")]
    nnodes: NodeRange,
    /// This node's index, 0..nnodes (assigned by the rendezvous in an elastic job).
    #[arg(long)]
    node_rank: Option<u32>,
    /// Address of node 0, where rank 0 serves the rendezvous store (in an elastic job: the
    /// node whose launcher hosts the rendezvous, and rank 0).
    #[arg(long, default_value = "127.0.0.1")]
    master_addr: String,
    /// Port of the rendezvous store (in an elastic job: of the launchers' rendezvous; rank
    /// 0's store takes the next port).
    #[arg(long, default_value_t = DEFAULT_MASTER_PORT)]
    master_port: u16,
    /// Elastic job: seconds more nodes may join once MIN are there, before a round starts.
    #[arg(long, default_value_t = 10.0)]
    rdzv_join_window: f64,
    /// Elastic job: seconds a round waits for MIN nodes before the job fails. Fault-tolerant
    /// job: seconds a launcher tries to reach the job's store.
    #[arg(long, default_value_t = 600.0)]
    rdzv_timeout: f64,
    /// Elastic job: seconds of silence after which a node's launcher is taken as lost.
    #[arg(long, default_value_t = 10.0)]
    node_timeout: f64,
    /// Elastic job: this node's name in the rendezvous and the logs (default: host name and
    /// launcher pid).
    #[arg(long)]
    node_id: Option<String>,
    /// Single node: pick a free port on 127.0.0.1 (ignores --master-addr/--master-port).
    #[arg(long)]
    standalone: bool,
    /// Job id shared by the launchers of every node; becomes the job token. Defaults to
    /// BURN_DDP_JOB_TOKEN, or a fresh random token on a single node.
    #[arg(long)]
    rdzv_id: Option<String>,
    /// Do not prefix output lines with `[rank N]`. (On a terminal, rank 0 writes to it
    /// unprefixed anyway, so that Burn's dashboard can draw; the other ranks are prefixed.)
    #[arg(long)]
    no_prefix: bool,
    /// Seconds the other ranks get to exit after one failed, before they are killed.
    #[arg(long, default_value_t = 5.0)]
    grace: f64,
    /// Restart the whole group up to this many times after a rank fails (torchrun's
    /// `--max-restarts`). Each attempt sees `BURN_DDP_RESTART_COUNT` and
    /// `TORCHELASTIC_RESTART_COUNT`; `DdpStrategy` then resumes from the newest complete
    /// checkpoint. With several nodes, every node's launcher must be given the same value.
    #[arg(long, default_value_t = 0)]
    max_restarts: u32,
    /// Fault-tolerant job: a rank that dies does not stop the others, which agree on a new
    /// membership and go on from the current step (no restart, no checkpoint reload); up to
    /// --max-restarts replacements start in place of failed ranks and join the running job.
    /// Node 0's launcher serves the job's store (at --master-addr:--master-port) until the
    /// job's last members end.
    #[arg(long)]
    fault_tolerant: bool,
    /// Fault-tolerant job: the fewest ranks it goes on with (below it, the survivors wait
    /// for replacements, up to the rendezvous timeout).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..), requires = "fault_tolerant")]
    min_ranks: u32,
    /// Fault-tolerant job: this node's ranks join the running job (started by other
    /// launchers with the same --rdzv-id and --master-addr) instead of forming it.
    #[arg(long, requires = "fault_tolerant")]
    join: bool,
    /// Fault-tolerant job: what keeps the job's store. `builtin`: node 0's launcher serves it
    /// (the job ends if node 0 is lost). `etcd`: an etcd cluster (--rdzv-endpoint) keeps it,
    /// so the job survives the loss of any node; the ranks need burn-ddp's `etcd` feature.
    #[arg(
        long,
        value_enum,
        default_value = "builtin",
        requires = "fault_tolerant"
    )]
    rdzv_backend: RdzvBackend,
    /// With --rdzv-backend etcd: the etcd members' client endpoints, `host:port,...` (give
    /// every member, so that any one may be lost). Give every job its own --rdzv-id: the job's
    /// keys lie under a prefix derived from it.
    #[arg(long)]
    rdzv_endpoint: Option<String>,
    /// With https:// etcd endpoints: the CA certificate (PEM) that signed the members'
    /// certificates. Default: BURN_DDP_ETCD_CA.
    #[arg(long, requires = "rdzv_endpoint")]
    etcd_ca: Option<std::path::PathBuf>,
    /// This node's client certificate (PEM), for an etcd cluster that requires one (etcd
    /// --client-cert-auth); with --etcd-key. Default: BURN_DDP_ETCD_CERT.
    #[arg(long, requires = "rdzv_endpoint")]
    etcd_cert: Option<std::path::PathBuf>,
    /// The private key (PEM) of --etcd-cert. Default: BURN_DDP_ETCD_KEY.
    #[arg(long, requires = "rdzv_endpoint")]
    etcd_key: Option<std::path::PathBuf>,
    /// An etcd user, for a cluster with authentication enabled; its password is read from
    /// BURN_DDP_ETCD_PASSWORD (never from the command line). Default: BURN_DDP_ETCD_USER.
    #[arg(long, requires = "rdzv_endpoint")]
    etcd_user: Option<String>,
    /// The program and its arguments.
    #[arg(required = true, trailing_var_arg = true, allow_hyphen_values = true)]
    command: Vec<OsString>,
}

#[derive(Debug, Subcommand)]
enum BenchCommand {
    /// All-reduce bus bandwidth over message sizes, next to the single-stream TCP throughput.
    AllReduce(BenchArgs),
    /// Point-to-point throughput (one way, both ways at once) next to the all-reduce bus
    /// bandwidth of the same group, over message sizes.
    P2p(P2pArgs),
    /// What N ranks cost the built-in store on this machine: start-up, heartbeat requests and
    /// bytes per check interval, and the time for every rank to name a killed one (ranks as
    /// threads of a few host processes; rank 0 and the killed one each in a process of its own).
    Scale(ScaleArgs),
}

/// Options of `burn-ddp bench scale`.
#[derive(Debug, Args)]
pub struct ScaleArgs {
    /// World sizes, each a job of its own (3 to 65536 ranks).
    #[arg(long, value_delimiter = ',', default_value = "256,1024")]
    ranks: Vec<u32>,
    /// The jobs' heartbeat bound in seconds (their check interval is a fifth, at most 2 s).
    #[arg(long, default_value_t = 15.0)]
    heartbeat_s: f64,
    /// Idle check intervals over which the heartbeat traffic is counted.
    #[arg(long, default_value_t = 5)]
    window: u32,
    /// Fault-tolerant jobs (the store a lighthouse the benchmark serves): after the kill, the
    /// others agree on a membership without the killed rank, measured as change_s.
    #[arg(long)]
    fault_tolerant: bool,
    /// Where the jobs keep their store: `builtin`, or `etcd` (a 3-member etcd cluster the
    /// benchmark starts: Debian's etcd on PATH, a burn-ddp built with `etcd`,
    /// --fault-tolerant).
    #[arg(long, value_enum, default_value = "builtin")]
    store: ScaleStoreArg,
    /// A process hosting some of the ranks (internal: the benchmark starts them).
    #[arg(long, hide = true)]
    host: Option<String>,
}

/// `burn-ddp bench scale --store`.
#[derive(Debug, Clone, Copy, ValueEnum)]
enum ScaleStoreArg {
    Builtin,
    Etcd,
}

/// Options of `burn-ddp bench p2p`.
#[derive(Debug, Args)]
pub struct P2pArgs {
    /// Local ranks to start (ignored when RANK is set: then this process is one rank of a job).
    #[arg(long, short = 'n', default_value_t = 2, value_parser = clap::value_parser!(u32).range(2..=256))]
    nproc: u32,
    /// Smallest message size (bytes; K, M, G suffixes).
    #[arg(long, short = 'b', default_value = "64K", value_parser = parse_size)]
    min_bytes: usize,
    /// Largest message size (at most 1G); sizes grow 4x.
    #[arg(long, short = 'e', default_value = "64M", value_parser = parse_size)]
    max_bytes: usize,
    /// Rounds per size (the median is reported).
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// Milliseconds of one burst of transfers (1 to 10000).
    #[arg(long, default_value_t = 100)]
    target_ms: u64,
    /// Transports to compare in interleaved rounds (`tcp,shm`; each row names its own).
    /// Unset: the group's own choice (shared memory between ranks of one host).
    #[arg(long, value_enum, value_delimiter = ',')]
    transport: Vec<P2pTransportArg>,
}

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum P2pTransportArg {
    Tcp,
    Shm,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum DTypeArg {
    F32,
    F64,
    F16,
    Bf16,
    I32,
    I64,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum OpArg {
    Sum,
    Mean,
    Max,
    Min,
}

/// Options of `burn-ddp bench all-reduce`.
#[derive(Debug, Args)]
pub struct BenchArgs {
    /// Local ranks to start (ignored when RANK is set: then this process is one rank of a job).
    #[arg(long, short = 'n', default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..=256))]
    nproc: u32,
    /// Smallest message size (bytes; K, M, G suffixes).
    #[arg(long, short = 'b', default_value = "1K", value_parser = parse_size)]
    min_bytes: usize,
    /// Largest message size (at most 1G over the host transport, 8G over NCCL).
    #[arg(long, short = 'e', default_value = "256M", value_parser = parse_size)]
    max_bytes: usize,
    /// Multiplier between sizes (2 or more).
    #[arg(long, short = 'f', default_value_t = 2)]
    step_factor: usize,
    /// Element type.
    #[arg(long, short = 'd', value_enum, default_value = "f32")]
    dtype: DTypeArg,
    /// Reduce operation.
    #[arg(long, short = 'o', value_enum, default_value = "sum")]
    op: OpArg,
    /// Milliseconds of measurement per size (1 to 10000).
    #[arg(long, default_value_t = 400)]
    target_ms: u64,
    /// Skip the single-stream TCP measurement.
    #[arg(long)]
    no_loopback: bool,
    /// Transport to measure: the process group's own choice (`host`: shared memory between
    /// ranks of one host, TCP otherwise), several compared in interleaved rounds within each
    /// size (`tcp,shm`: each row names its transport, the ratios to the first and the share of
    /// single-core memcpy are printed at the end), or NCCL on each rank's GPU (`nccl`, alone;
    /// `LOCAL_RANK`; needs the `cuda` feature). `shm-in-place` (measured after the others):
    /// shared memory with each rank's buffer in memory every rank maps, reduced where it lies,
    /// as shared gradient buckets are.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "host")]
    transport: Vec<TransportArg>,
    /// Collective algorithms to compare, interleaved in rounds within each size (`ring,tree`):
    /// each row then names its algorithm, and the ratios to the first are printed at the end.
    /// Unset: the group's own choice (`BURN_DDP_ALGO`, by size when unset).
    #[arg(long, value_enum, value_delimiter = ',')]
    algo: Vec<AlgoArg>,
}

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum TransportArg {
    Host,
    Nccl,
    Tcp,
    Shm,
    ShmInPlace,
}

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum AlgoArg {
    Auto,
    Ring,
    Tree,
}

fn parse_size(s: &str) -> std::result::Result<usize, String> {
    let s = s.trim();
    let (num, mult) = match s.char_indices().last() {
        Some((i, 'K' | 'k')) => (&s[..i], 1usize << 10),
        Some((i, 'M' | 'm')) => (&s[..i], 1 << 20),
        Some((i, 'G' | 'g')) => (&s[..i], 1 << 30),
        _ => (s, 1),
    };
    num.parse::<usize>()
        .ok()
        .and_then(|n| n.checked_mul(mult))
        .ok_or_else(|| format!("{s:?} is not a size (examples: 4096, 64K, 256M, 1G)"))
}

/// Entry point of the `burn-ddp` binary.
pub fn main() -> ExitCode {
    init_logging();
    let cli = Cli::parse();
    let result: std::result::Result<ExitCode, Box<dyn std::error::Error>> = match cli.command {
        Command::Run(args) => run(args).map_err(Into::into),
        Command::Bench(BenchCommand::AllReduce(args)) => bench(args).map_err(Into::into),
        Command::Bench(BenchCommand::P2p(args)) => bench_p2p(args).map_err(Into::into),
        Command::Bench(BenchCommand::Scale(args)) => bench_scale(args).map_err(Into::into),
        Command::Gpus => gpus().map_err(Into::into),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("burn-ddp: error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// `burn-ddp gpus`: the driver's CUDA version and one line per GPU; fails without a driver.
#[cfg(feature = "cuda")]
fn gpus() -> Result<ExitCode> {
    let (cuda, lines) = crate::cuda::describe_gpus()?;
    println!("CUDA driver {cuda}");
    for line in &lines {
        println!("{line}");
    }
    Ok(if lines.is_empty() {
        eprintln!("burn-ddp: the CUDA driver shows no GPU to this process");
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    })
}

#[cfg(not(feature = "cuda"))]
fn gpus() -> Result<ExitCode> {
    Err(crate::DdpError::Config(ConfigError::InvalidConfig {
        field: "burn-ddp gpus",
        reason: "this burn-ddp was built without the `cuda` feature: rebuild it with \
                 `--features cuda`",
    }))
}

/// Logs to stderr, `warn` by default; `RUST_LOG` overrides.
pub fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr)
        .with_target(false)
        .try_init();
}

fn seconds(field: &'static str, v: f64) -> Result<Duration> {
    Duration::try_from_secs_f64(v).map_err(|_| {
        DdpError::Config(ConfigError::InvalidConfig {
            field,
            reason: "must be a number of seconds, 0 or more",
        })
    })
}

fn run(args: RunArgs) -> Result<ExitCode> {
    let range = args.nnodes;
    if range.is_elastic() && args.fault_tolerant {
        return Err(DdpError::Config(ConfigError::InvalidConfig {
            field: "--fault-tolerant",
            reason: "does not go with an elastic --nnodes MIN:MAX (which restarts every rank \
                     on a change of nodes): a fault-tolerant job keeps its ranks and changes \
                     its membership live; give --nnodes N",
        }));
    }
    if range.is_elastic() && args.node_rank.is_some() {
        return Err(DdpError::Config(ConfigError::InvalidConfig {
            field: "--node-rank",
            reason:
                "is assigned by the rendezvous in an elastic job (--nnodes MIN:MAX): leave it out",
        }));
    }
    let node_rank = args.node_rank.unwrap_or(0);
    if node_rank >= range.min {
        return Err(DdpError::Config(ConfigError::InvalidConfig {
            field: "--node-rank",
            reason: "must be below --nnodes",
        }));
    }
    let (program, rest) = match args.command.split_first() {
        Some((p, r)) => (p.clone(), r.to_vec()),
        None => {
            return Err(DdpError::Config(ConfigError::InvalidConfig {
                field: "command",
                reason: "is required: burn-ddp run [OPTIONS] -- PROGRAM [ARGS]",
            }))
        }
    };
    let master = if args.standalone {
        MasterAddr::new("127.0.0.1", spawn::free_port()?)
    } else {
        MasterAddr::new(args.master_addr, args.master_port)
    };
    let etcd: Option<crate::config::EtcdStore> = match (args.rdzv_backend, &args.rdzv_endpoint) {
        (RdzvBackend::Etcd, Some(list)) => {
            let store = crate::config::EtcdStore::parse(list).map_err(|why| {
                DdpError::Config(ConfigError::InvalidOption {
                    option: "--rdzv-endpoint",
                    reason: format!(
                        "must list the etcd members' client endpoints, host:port each, \
                         separated by commas (etcd's client port is 2379 by default): {why}"
                    ),
                })
            })?;
            let env = crate::config::env::etcd_security();
            let security = crate::config::EtcdSecurity {
                ca: args.etcd_ca.clone().or(env.ca),
                cert: args.etcd_cert.clone().or(env.cert),
                key: args.etcd_key.clone().or(env.key),
                user: args.etcd_user.clone().or(env.user),
                password: env.password,
            };
            let store = store.with_security(security).map_err(|reason| {
                DdpError::Config(ConfigError::InvalidOption {
                    option: "--rdzv-endpoint with --etcd-*",
                    reason,
                })
            })?;
            if !cfg!(feature = "etcd") {
                return Err(DdpError::Config(ConfigError::InvalidConfig {
                    field: "--rdzv-backend etcd",
                    reason: "needs a launcher built with etcd support: `cargo install \
                             burn-ddp-comm --features cli,etcd` (or `cargo run -p burn-ddp-comm \
                             --features cli,etcd -- run ...`); the ranks need burn-ddp's `etcd` \
                             feature too",
                }));
            }
            Some(store)
        }
        (RdzvBackend::Etcd, None) => {
            return Err(DdpError::Config(ConfigError::InvalidConfig {
                field: "--rdzv-backend etcd",
                reason: "needs --rdzv-endpoint host:port[,host:port...]: the etcd members' \
                         client endpoints",
            }))
        }
        (RdzvBackend::Builtin, Some(_)) => {
            return Err(DdpError::Config(ConfigError::InvalidConfig {
                field: "--rdzv-endpoint",
                reason: "names an etcd cluster: add --rdzv-backend etcd (the builtin store is \
                         served by node 0's launcher at --master-addr:--master-port)",
            }))
        }
        (RdzvBackend::Builtin, None) => None,
    };
    let master = match etcd {
        Some(store) => master.with_etcd(store),
        None => master,
    };
    let token = match (args.rdzv_id, super::env::job_token()) {
        (Some(id), _) => JobToken::new(format!("rdzv:{id}")),
        (None, Some(t)) => JobToken::new(t),
        _ if range.max == 1 => JobToken::generate(),
        _ => {
            return Err(DdpError::Config(ConfigError::MissingEnv {
                var: super::env::JOB_TOKEN,
                hint: "with --nnodes > 1 every node's launcher needs the same job token: pass --rdzv-id <ID> (or set BURN_DDP_JOB_TOKEN) on every node",
            }))
        }
    };
    let mut job = LocalJob {
        program: program.into(),
        args: rest,
        env: Vec::new(),
        nproc_per_node: args.nproc_per_node,
        nnodes: range.min,
        node_rank,
        master,
        token,
        output: if args.no_prefix {
            Output::Inherit
        } else {
            Output::auto()
        },
        grace: seconds("--grace", args.grace)?,
        deadline: None,
        stop: Some(spawn::stop_flag()?),
        halt: None,
    };
    if range.is_elastic() {
        let elastic = ElasticConfig {
            nodes: range,
            max_restarts: args.max_restarts,
            join_window: seconds("--rdzv-join-window", args.rdzv_join_window)?,
            rendezvous_timeout: seconds("--rdzv-timeout", args.rdzv_timeout)?,
            node_timeout: seconds("--node-timeout", args.node_timeout)?,
            node_id: args.node_id.unwrap_or_else(ElasticConfig::default_node_id),
        };
        super::elastic::run(job, elastic)?;
        return Ok(ExitCode::SUCCESS);
    }
    if args.fault_tolerant {
        // On etcd no launcher serves the store: node 0 is no different from the others.
        let serving = node_rank == 0 && !args.join && job.master.etcd.is_none();
        let _lighthouse = if serving {
            Some(super::lighthouse::Lighthouse::serve(&job)?)
        } else {
            None
        };
        let ft = super::lighthouse::FaultTolerantLaunch {
            max_restarts: args.max_restarts,
            min_ranks: args.min_ranks,
            join: args.join,
            store_connect: seconds("--rdzv-timeout", args.rdzv_timeout)?,
        };
        let report = super::lighthouse::run(&job, ft, serving)?;
        return match report.failure {
            None => Ok(ExitCode::SUCCESS),
            Some(e) => Err(e),
        };
    }
    let base_env = job.env.clone();
    let mut attempt = 0;
    loop {
        job.env = base_env.clone();
        for var in [
            super::env::RESTART_COUNT,
            super::env::TORCHELASTIC_RESTART_COUNT,
        ] {
            job.env.push((var.into(), attempt.to_string().into()));
        }
        job.env.push((
            "TORCHELASTIC_MAX_RESTARTS".into(),
            args.max_restarts.to_string().into(),
        ));
        match spawn::run(&job)?.into_result() {
            Ok(_) => return Ok(ExitCode::SUCCESS),
            Err(DdpError::Job(JobError::Interrupted)) => {
                return Err(DdpError::Job(JobError::Interrupted))
            }
            Err(e) if attempt < args.max_restarts => {
                eprintln!(
                    "burn-ddp run: {e}; restarting the whole group (restart {} of {})",
                    attempt + 1,
                    args.max_restarts
                );
                attempt += 1;
            }
            Err(e) => return Err(e),
        }
    }
}

fn bench_scale(args: ScaleArgs) -> BenchResult<ExitCode> {
    if let Some(spec) = &args.host {
        super::scale_bench::run_host(spec)?;
        return Ok(ExitCode::SUCCESS);
    }
    let heartbeat = Duration::try_from_secs_f64(args.heartbeat_s).map_err(|e| {
        BenchError::from(DdpError::Config(ConfigError::InvalidOption {
            option: "--heartbeat-s",
            reason: format!("{}: {e}", args.heartbeat_s),
        }))
    })?;
    let bench = super::scale_bench::ScaleBench {
        ranks: args.ranks,
        heartbeat,
        window: args.window,
        fault_tolerant: args.fault_tolerant,
        store: match args.store {
            ScaleStoreArg::Builtin => super::scale_bench::ScaleStore::Builtin,
            ScaleStoreArg::Etcd => super::scale_bench::ScaleStore::Etcd,
        },
    };
    bench.run(&mut std::io::stdout().lock())?;
    Ok(ExitCode::SUCCESS)
}

fn bench_p2p(args: P2pArgs) -> BenchResult<ExitCode> {
    let opts = super::p2p_bench::P2pBench {
        min_bytes: args.min_bytes,
        max_bytes: args.max_bytes,
        rounds: args.rounds,
        target: Duration::from_millis(args.target_ms),
        transports: args
            .transport
            .iter()
            .map(|t| match t {
                P2pTransportArg::Tcp => Transport::Tcp,
                P2pTransportArg::Shm => Transport::Shm,
            })
            .collect(),
    };
    opts.check()?;
    if super::env::rank_is_set() {
        super::p2p_bench::run_worker(&opts)?;
        return Ok(ExitCode::SUCCESS);
    }
    Ok(standalone(args.nproc)?)
}

/// Starts `nproc` ranks of this same command on this machine and waits for them.
fn standalone(nproc: u32) -> Result<ExitCode> {
    let exe = std::env::current_exe()?;
    let argv: Vec<OsString> = std::env::args_os().skip(1).collect();
    let mut job = LocalJob::standalone(exe, argv, nproc)?;
    job.output = Output::Inherit;
    job.stop = Some(spawn::stop_flag()?);
    spawn::run(&job)?.into_result()?;
    Ok(ExitCode::SUCCESS)
}

fn bench(args: BenchArgs) -> BenchResult<ExitCode> {
    let opts = AllReduceBench {
        min_bytes: args.min_bytes,
        max_bytes: args.max_bytes,
        step_factor: args.step_factor,
        dtype: match args.dtype {
            DTypeArg::F32 => BenchDType::F32,
            DTypeArg::F64 => BenchDType::F64,
            DTypeArg::F16 => BenchDType::F16,
            DTypeArg::Bf16 => BenchDType::BF16,
            DTypeArg::I32 => BenchDType::I32,
            DTypeArg::I64 => BenchDType::I64,
        },
        op: match args.op {
            OpArg::Sum => ReduceOp::Sum,
            OpArg::Mean => ReduceOp::Mean,
            OpArg::Max => ReduceOp::Max,
            OpArg::Min => ReduceOp::Min,
        },
        target: Duration::from_millis(args.target_ms),
        skip_loopback: args.no_loopback,
        nccl: args
            .transport
            .iter()
            .any(|t| matches!(t, TransportArg::Nccl)),
        transports: args
            .transport
            .iter()
            .filter_map(|t| match t {
                TransportArg::Tcp => Some(Transport::Tcp),
                TransportArg::Shm => Some(Transport::Shm),
                TransportArg::Host | TransportArg::Nccl | TransportArg::ShmInPlace => None,
            })
            .collect(),
        shm_in_place: args
            .transport
            .iter()
            .any(|t| matches!(t, TransportArg::ShmInPlace)),
        algorithms: args
            .algo
            .iter()
            .map(|a| match a {
                AlgoArg::Auto => Algorithm::Auto,
                AlgoArg::Ring => Algorithm::Ring,
                AlgoArg::Tree => Algorithm::Tree,
            })
            .collect(),
    };
    // Refused here, before any rank starts.
    opts.check()?;
    if super::env::rank_is_set() {
        super::bench::run_worker(&opts)?;
        return Ok(ExitCode::SUCCESS);
    }
    // Standalone: start `nproc` ranks of this same command on this machine.
    Ok(standalone(args.nproc)?)
}
