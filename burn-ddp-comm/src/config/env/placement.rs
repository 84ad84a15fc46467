//! Which launcher started this process, and where it put it: torchrun's, Open MPI's, MPICH's
//! and Intel MPI's (Hydra), and Slurm's variables read into a rank, a world size, a place on the
//! node, rank 0's host and the job's id ([`group_config_from`]), with the rules that differ per
//! launcher (which variables win, how a batch script or an incomplete launch is refused, the
//! store's port derived from the job). The other settings a variable can change are the
//! parent module's.

use super::*;
use crate::error::ConfigError;

/// Whether this process was started as one rank of a job (by `burn-ddp run`, torchrun, `srun`,
/// `mpirun`/`mpiexec` or [`spawn`](crate::launch::spawn())), rather than as a single process.
pub fn launched() -> bool {
    launched_from(&|k: &str| std::env::var(k).ok().filter(|v| !v.trim().is_empty()))
}

/// [`launched`], reading non-empty variables through `get`.
fn launched_from(get: &impl Fn(&str) -> Option<String>) -> bool {
    [RANK, WORLD_SIZE, "SLURM_PROCID"]
        .iter()
        .chain(OPEN_MPI.iter())
        .chain(HYDRA.iter())
        .chain(std::iter::once(&PMIX_RANK))
        .any(|v| get(v).is_some())
}

/// Open MPI's variables (`mpirun`, 4.x and 5.x).
const OPEN_MPI: [&str; 4] = [
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_SIZE",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "OMPI_COMM_WORLD_LOCAL_SIZE",
];
/// MPICH's and Intel MPI's (the Hydra process manager of `mpiexec`).
const HYDRA: [&str; 4] = ["PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"];
/// PMIx's rank (Open MPI, `srun --mpi=pmix`), which gives no world size of its own.
const PMIX_RANK: &str = "PMIX_RANK";

/// What every refusal of an incomplete launch names.
const LAUNCHERS: &str =
    "Launch with `burn-ddp run`, torchrun, `srun` (Slurm), or `mpirun`/`mpiexec` \
    (Open MPI, MPICH, Intel MPI), which set all of them; or set RANK and WORLD_SIZE yourself";

/// Where a launcher put this process.
struct Placement {
    launcher: Launcher,
    rank: Rank,
    world: WorldSize,
    local_rank: LocalRank,
    local_world: WorldSize,
    /// Rank 0's host, when the launcher's variables tell it.
    master_host: Option<String>,
    /// The job's id, for the token and messages: `(variable, value)`.
    job: Option<(&'static str, String)>,
    /// The store's port when `MASTER_PORT` is not set, when the launcher derives it otherwise
    /// than [`job_port`] of the job's id.
    job_port: Option<u16>,
    /// Whether rank 0's host must be given (`MASTER_ADDR`): ranks on several hosts, and the
    /// launcher does not say which is rank 0's.
    needs_master: bool,
}

/// The port of a job's store when `MASTER_PORT` is not set, derived from its id (Slurm's
/// `SLURM_JOB_ID` and step, Open MPI's job), so that two jobs sharing a node do not both take
/// 29500: 20000 plus the id modulo 12000, below Linux's ephemeral ports (32768 and up).
pub fn job_port(id: &str) -> u16 {
    let n = match id.trim().parse::<u64>() {
        Ok(n) => n,
        // FNV-1a: stable across builds and platforms, unlike std's hasher.
        Err(_) => id.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
        }),
    };
    20_000 + (n % 12_000) as u16
}

/// Like [`group_config_from_env`], reading variables through `get` (for tests and embedding).
///
/// # Errors
/// As [`group_config_from_env`].
pub fn group_config_from(get: impl Fn(&str) -> Option<String>) -> Result<GroupConfig> {
    let get = |k: &str| get(k).filter(|v| !v.trim().is_empty());
    let timeouts = timeouts(&get)?;

    if !launched_from(&get) {
        return Ok(
            GroupConfig::new(Rank(0), WorldSize::ONE, JobToken::new("single"))
                .with_timeouts(timeouts)
                .with_restart_count(restart_count_from(&get)),
        );
    }
    let at = placement(&get)?;
    let host = match (get(MASTER_ADDR), at.master_host) {
        (Some(h), _) => h,
        (None, Some(h)) => h,
        (None, None) if at.needs_master => {
            return Err(DdpError::Config(ConfigError::Launch {
                launcher: at.launcher.name(),
                problem: format!(
                    "its {} ranks run on more than one host ({} on this one) and {MASTER_ADDR} \
                     is not set, so no rank knows where rank 0's store is",
                    at.world, at.local_world
                ),
                fix: format!(
                    "Pass rank 0's host to every rank: `mpirun -x {MASTER_ADDR}=<host of rank 0> \
                     ...` (Open MPI) or `mpiexec -genv {MASTER_ADDR} <host> ...` (MPICH), and \
                     {MASTER_PORT} the same way if its default is taken"
                ),
            }));
        }
        (None, None) => "127.0.0.1".to_string(),
    };
    let (rank, world, local_rank, local_world) = (at.rank, at.world, at.local_rank, at.local_world);
    let parse_port = |var: &'static str, v: String| -> Result<u16> {
        v.trim()
            .parse::<u16>()
            .ok()
            .filter(|p| *p != 0)
            .ok_or(DdpError::Config(ConfigError::InvalidEnv {
                var,
                value: v,
                expected: "a TCP port number (1-65535)",
            }))
    };
    let mut port_origin = None;
    let port = match (get(STORE_PORT), get(MASTER_PORT)) {
        (Some(v), _) => {
            port_origin = Some(format!("{STORE_PORT}={v}"));
            parse_port(STORE_PORT, v)?
        }
        (None, None) => match &at.job {
            Some((var, id)) => {
                port_origin = Some(format!(
                    "derived from the job ({var}={id}) so that jobs sharing a node differ; \
                     set {MASTER_PORT} to choose another"
                ));
                at.job_port.unwrap_or_else(|| job_port(id))
            }
            None => DEFAULT_MASTER_PORT,
        },
        (None, Some(v)) => {
            let port = parse_port(MASTER_PORT, v.clone())?;
            // torchrun's agent already serves its own store on MASTER_PORT (its workers connect
            // to it); ours takes the next port, the same choice on every node.
            let agent_store =
                get("TORCHELASTIC_USE_AGENT_STORE").is_some_and(|v| v.eq_ignore_ascii_case("true"));
            if agent_store {
                port_origin = Some(format!(
                    "MASTER_PORT + 1: under torchrun its agent serves its own store on \
                     MASTER_PORT={port}; set {STORE_PORT} to choose another port"
                ));
                port.checked_add(1).ok_or(DdpError::Config(ConfigError::InvalidEnv {
                    var: MASTER_PORT,
                    value: v,
                    expected: "a port below 65535 under torchrun (burn-ddp's store uses MASTER_PORT + 1; or set BURN_DDP_STORE_PORT)",
                }))?
            } else {
                port
            }
        }
    };
    let mut master = MasterAddr::new(host, port);
    if let Some(list) = get(ETCD_ENDPOINTS) {
        let store = EtcdStore::parse(&list).map_err(|_| {
            DdpError::Config(ConfigError::InvalidEnv {
                var: ETCD_ENDPOINTS,
                value: list.clone(),
                expected: "a comma-separated list of etcd client endpoints, host:port each",
            })
        })?;
        let store = store
            .with_security(super::etcd_security_from(get))
            .map_err(|reason| {
                DdpError::Config(ConfigError::InvalidOption {
                    option: "BURN_DDP_ETCD_* (the etcd store)",
                    reason,
                })
            })?;
        master = master.with_etcd(store);
    }
    if let Some(v) = get(LOCAL_ADDR) {
        let ip = v.trim().parse().map_err(|_| {
            DdpError::Config(ConfigError::InvalidEnv {
                var: LOCAL_ADDR,
                value: v.clone(),
                expected: "an IP address of this host (such as 10.0.0.5), not a name",
            })
        })?;
        master = master.with_local(ip);
    }
    let token = token(&get, at.job.as_ref(), &master);
    let mut cfg = GroupConfig::new(rank, world, token)
        .with_master(master)
        .with_local(local_rank, local_world)
        .with_timeouts(timeouts)
        .with_restart_count(restart_count_from(&get));
    cfg.port_origin = port_origin;
    cfg.launcher = Some(at.launcher);
    cfg.debug_desync = get(DEBUG_DESYNC)
        .is_some()
        .then(|| debug_desync_from(&get))
        .transpose()?;
    cfg.fault_tolerance = fault_tolerance_from(&get)?;
    if cfg.master.etcd.is_some() && cfg.fault_tolerance.is_none() {
        return Err(DdpError::Config(ConfigError::InvalidConfig {
            field: ETCD_ENDPOINTS,
            reason: "keeps the store of a fault-tolerant job only (BURN_DDP_FAULT_TOLERANT=1, \
                     as `burn-ddp run --fault-tolerant --rdzv-backend etcd` sets); a job \
                     without it ends with any rank, so rank 0's store is no weaker: unset it",
        }));
    }
    cfg.validate()?;
    Ok(cfg)
}

/// Reads who launched this process, in order: torchrun's contract (also `burn-ddp run`'s and
/// `spawn`'s), Open MPI, MPICH/Intel MPI (Hydra), Slurm. An MPI launcher comes before Slurm:
/// `mpirun` inside an allocation starts its ranks from daemons that Slurm sees as one task
/// per node.
fn placement(get: &impl Fn(&str) -> Option<String>) -> Result<Placement> {
    if get(RANK).is_some() || get(WORLD_SIZE).is_some() {
        return torchrun(get);
    }
    if OPEN_MPI.iter().any(|v| get(v).is_some()) {
        return open_mpi(get);
    }
    if HYDRA.iter().any(|v| get(v).is_some()) {
        return hydra(get);
    }
    if get("SLURM_PROCID").is_some() {
        return slurm(get);
    }
    let rank = get(PMIX_RANK).unwrap_or_default();
    Err(DdpError::Config(ConfigError::Launch {
        launcher: "PMIx",
        problem: format!(
            "{PMIX_RANK}={rank} is set, but nothing gives the job's size (neither \
             OMPI_COMM_WORLD_SIZE, PMI_SIZE, SLURM_NTASKS nor WORLD_SIZE), so this process \
             cannot tell which job it belongs to"
        ),
        fix: LAUNCHERS.to_string(),
    }))
}

fn torchrun(get: &impl Fn(&str) -> Option<String>) -> Result<Placement> {
    let rank = Rank(
        parse_u32(get, RANK, "a non-negative integer")?.ok_or(DdpError::Config(
            ConfigError::MissingEnv {
                var: RANK,
                hint: "WORLD_SIZE is set, so every process also needs its RANK (0..WORLD_SIZE)",
            },
        ))?,
    );
    let world = world(get, WORLD_SIZE)?.ok_or(DdpError::Config(ConfigError::MissingEnv {
        var: WORLD_SIZE,
        hint: "RANK is set, so the job size WORLD_SIZE must be set too",
    }))?;
    let local_world = world_or(get, LOCAL_WORLD_SIZE, world)?;
    let local_rank = LocalRank(
        parse_u32(get, LOCAL_RANK, "a non-negative integer")?.unwrap_or(rank.0 % local_world.get()),
    );
    Ok(Placement {
        launcher: Launcher::Torchrun,
        rank,
        world,
        local_rank,
        local_world,
        master_host: None,
        job: None,
        job_port: None,
        needs_master: false,
    })
}

/// The variables of an MPI launcher: rank and size required, local rank and size optional.
struct MpiVars {
    launcher: Launcher,
    rank: &'static str,
    size: &'static str,
    local_rank: &'static str,
    local_size: &'static str,
}

fn mpi(get: &impl Fn(&str) -> Option<String>, v: &MpiVars) -> Result<Placement> {
    let missing: Vec<&str> = [v.rank, v.size]
        .into_iter()
        .filter(|var| get(var).is_none())
        .collect();
    if !missing.is_empty() {
        let present: Vec<String> = [v.rank, v.size, v.local_rank, v.local_size]
            .into_iter()
            .filter_map(|var| get(var).map(|val| format!("{var}={val}")))
            .collect();
        return Err(DdpError::Config(ConfigError::Launch {
            launcher: v.launcher.name(),
            problem: format!(
                "{} {} set but {} not, so this process would start a job of its own",
                present.join(", "),
                if present.len() == 1 { "is" } else { "are" },
                missing.join(" and ")
            ),
            fix: LAUNCHERS.to_string(),
        }));
    }
    let rank = Rank(parse_u32(get, v.rank, "a non-negative integer")?.unwrap_or(0));
    let local_world = world(get, v.local_size)?;
    let local_rank = parse_u32(get, v.local_rank, "a non-negative integer")?;
    let world = world(get, v.size)?.unwrap_or(WorldSize::ONE);
    if let Some(pmix) = get(PMIX_RANK).filter(|r| r.trim() != rank.0.to_string()) {
        return Err(DdpError::Config(ConfigError::Launch {
            launcher: v.launcher.name(),
            problem: format!(
                "{}={} but {PMIX_RANK}={pmix}: two launchers' variables disagree about this \
                 process's rank",
                v.rank, rank.0
            ),
            fix: "Start the program with one launcher (the variables of an outer one may have \
                  leaked into its environment)"
                .to_string(),
        }));
    }
    // Every rank on this host: rank 0's store is on loopback.
    let one_host = local_world == Some(world);
    Ok(Placement {
        launcher: v.launcher,
        rank,
        world,
        local_rank: LocalRank(local_rank.unwrap_or(if one_host { rank.0 } else { 0 })),
        local_world: local_world.unwrap_or(if one_host { world } else { WorldSize::ONE }),
        master_host: one_host.then(|| "127.0.0.1".to_string()),
        job: None,
        job_port: None,
        needs_master: !one_host,
    })
}

fn open_mpi(get: &impl Fn(&str) -> Option<String>) -> Result<Placement> {
    let mut at = mpi(
        get,
        &MpiVars {
            launcher: Launcher::OpenMpi,
            rank: "OMPI_COMM_WORLD_RANK",
            size: "OMPI_COMM_WORLD_SIZE",
            local_rank: "OMPI_COMM_WORLD_LOCAL_RANK",
            local_size: "OMPI_COMM_WORLD_LOCAL_SIZE",
        },
    )?;
    // Open MPI 5 names the job by its PMIx namespace; 4.x also by a numeric job id.
    at.job = ["PMIX_NAMESPACE", "OMPI_MCA_ess_base_jobid"]
        .into_iter()
        .find_map(|var| Some((var, get(var)?)));
    Ok(at)
}

fn hydra(get: &impl Fn(&str) -> Option<String>) -> Result<Placement> {
    let mut at = mpi(
        get,
        &MpiVars {
            launcher: Launcher::Hydra,
            rank: "PMI_RANK",
            size: "PMI_SIZE",
            local_rank: "MPI_LOCALRANKID",
            local_size: "MPI_LOCALNRANKS",
        },
    )?;
    // `srun --mpi=pmi2` sets PMI_RANK and PMI_SIZE too: Slurm then also tells the node's
    // share and rank 0's host.
    if get("MPI_LOCALNRANKS").is_none() && get("SLURM_STEP_ID").is_some() {
        if let Ok(slurm) = slurm(get) {
            if slurm.world == at.world && slurm.rank == at.rank {
                return Ok(slurm);
            }
        }
    }
    at.job = get("PMI_JOBID").map(|id| ("PMI_JOBID", id));
    Ok(at)
}

fn slurm(get: &impl Fn(&str) -> Option<String>) -> Result<Placement> {
    let rank = Rank(parse_u32(get, "SLURM_PROCID", "a non-negative integer")?.unwrap_or(0));
    let step = get("SLURM_STEP_ID").or_else(|| get("SLURM_STEPID"));
    let world = match world(get, "SLURM_STEP_NUM_TASKS")? {
        Some(w) => w,
        None => world(get, "SLURM_NTASKS")?.ok_or(DdpError::Config(ConfigError::MissingEnv {
            var: "SLURM_NTASKS",
            hint: "launch with `srun --ntasks=N` (or set RANK and WORLD_SIZE yourself)",
        }))?,
    };
    if step.is_none() && world.get() > 1 {
        // The batch script of `sbatch -n N` (or an `salloc` shell) is one process of the
        // allocation, not one of its N tasks: the other N - 1 never start.
        let job = get("SLURM_JOB_ID").unwrap_or_else(|| "?".into());
        return Err(DdpError::Config(ConfigError::Launch {
            launcher: Launcher::Slurm.name(),
            problem: format!(
                "this process is the batch script of job {job} (SLURM_NTASKS={world} but no \
                 SLURM_STEP_ID: it was not started by srun), so the other {} ranks will never \
                 start",
                world.get() - 1
            ),
            fix: "Start the ranks with srun inside the script: `srun <program> [args]` (one \
                  task per rank; add --kill-on-bad-exit=1 so that a rank that fails ends the \
                  step at once)"
                .to_string(),
        }));
    }
    let local_rank =
        LocalRank(parse_u32(get, "SLURM_LOCALID", "a non-negative integer")?.unwrap_or(0));
    let node = parse_u32(get, "SLURM_NODEID", "a non-negative integer")?.unwrap_or(0);
    let per_node = get("SLURM_STEP_TASKS_PER_NODE")
        .or_else(|| get("SLURM_TASKS_PER_NODE"))
        .and_then(|spec| tasks_on_node(&spec, node as usize))
        .or_else(|| {
            get("SLURM_NTASKS_PER_NODE")
                .and_then(|v| v.trim().parse().ok())
                .and_then(WorldSize::new)
        })
        .unwrap_or(world);
    let master_host = get("SLURM_STEP_NODELIST")
        .or_else(|| get("SLURM_JOB_NODELIST"))
        .and_then(|list| first_host(&list));
    // The port: the job and its step, so that two steps running at once differ too.
    let job = get("SLURM_JOB_ID").map(|id| ("SLURM_JOB_ID", id));
    let job_port = job.as_ref().map(|(_, id)| {
        let step: u64 = step
            .as_deref()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(0);
        match id.trim().parse::<u64>() {
            // Consecutive jobs 8 ports apart, their first 8 steps in between.
            Ok(j) => job_port(&j.wrapping_mul(8).wrapping_add(step % 8).to_string()),
            Err(_) => job_port(&format!("{id}.{step}")),
        }
    });
    Ok(Placement {
        launcher: Launcher::Slurm,
        rank,
        world,
        local_rank,
        local_world: per_node,
        master_host,
        job,
        job_port,
        needs_master: false,
    })
}

/// The number of tasks on node `node` from Slurm's `2(x3),1` notation.
pub(crate) fn tasks_on_node(spec: &str, node: usize) -> Option<WorldSize> {
    let mut seen = 0usize;
    for part in spec.split(',') {
        let part = part.trim();
        let (count, repeat) = match part.split_once("(x") {
            Some((c, r)) => (c, r.trim_end_matches(')').parse::<usize>().ok()?),
            None => (part, 1),
        };
        let count: u32 = count.parse().ok()?;
        if node < seen + repeat {
            return WorldSize::new(count);
        }
        seen += repeat;
    }
    None
}

/// The first host of a Slurm host list (`node[01-04,07],gpu5` -> `node01`).
pub(crate) fn first_host(list: &str) -> Option<String> {
    let list = list.trim();
    let mut depth = 0;
    let end = list
        .char_indices()
        .find(|&(_, c)| {
            match c {
                '[' => depth += 1,
                ']' => depth -= 1,
                ',' if depth == 0 => return true,
                _ => {}
            }
            false
        })
        .map(|(i, _)| i)
        .unwrap_or(list.len());
    let first = &list[..end];
    match first.split_once('[') {
        None => (!first.is_empty()).then(|| first.to_string()),
        Some((prefix, rest)) => {
            let inner = rest.trim_end_matches(']');
            let range = inner.split(',').next()?;
            let start = range.split('-').next()?;
            Some(format!("{prefix}{start}"))
        }
    }
}

/// The job's token when none is given: torchrun's run id, else Slurm's job and step (whoever
/// launched the ranks inside it: they share them), else the MPI job's id, else the master's
/// address.
fn token(
    get: &impl Fn(&str) -> Option<String>,
    job: Option<&(&'static str, String)>,
    master: &MasterAddr,
) -> JobToken {
    if let Some(t) = get(JOB_TOKEN) {
        return JobToken::new(t);
    }
    if let Some(id) = get("TORCHELASTIC_RUN_ID").filter(|v| v != "none") {
        return JobToken::new(format!("torchelastic:{id}"));
    }
    if let Some(job) = get("SLURM_JOB_ID") {
        let step = get("SLURM_STEP_ID").unwrap_or_default();
        return JobToken::new(format!("slurm:{job}.{step}"));
    }
    if let Some((var, id)) = job {
        return JobToken::new(format!("{var}:{id}"));
    }
    // No secret was provided: anyone who can guess the address can join. `burn-ddp run`
    // always sets a token. The world size is not part of it: a rank started with another one
    // must be told that (WorldSizeMismatch), not that its token differs.
    tracing::debug!("no {JOB_TOKEN} set; using a token derived from the master address");
    JobToken::new(format!("burn-ddp:{master}"))
}

fn world(get: &impl Fn(&str) -> Option<String>, var: &'static str) -> Result<Option<WorldSize>> {
    match parse_u32(get, var, "a positive integer")? {
        None => Ok(None),
        Some(n) => WorldSize::new(n)
            .map(Some)
            .ok_or(DdpError::Config(ConfigError::InvalidEnv {
                var,
                value: n.to_string(),
                expected: "a positive integer",
            })),
    }
}

fn world_or(
    get: &impl Fn(&str) -> Option<String>,
    var: &'static str,
    default: WorldSize,
) -> Result<WorldSize> {
    Ok(world(get, var)?.unwrap_or(default))
}

#[cfg(test)]
mod tests {
    use super::super::tests::env;
    use super::*;

    #[test]
    fn empty_environment_is_a_single_process() {
        let cfg = group_config_from(env(&[])).unwrap();
        assert_eq!(cfg.world_size, WorldSize::ONE);
        assert_eq!(cfg.rank, Rank(0));
    }

    #[test]
    fn launched_means_the_variables_group_config_reads() {
        let launched = |vars: &[(&str, &str)]| {
            let get = env(vars);
            launched_from(&|k: &str| get(k).filter(|v| !v.trim().is_empty()))
        };
        assert!(!launched(&[]));
        assert!(!launched(&[("RANK", " ")]));
        assert!(launched(&[("WORLD_SIZE", "2")]));
        assert!(launched(&[("SLURM_PROCID", "0")]));
        assert!(launched(&[("OMPI_COMM_WORLD_RANK", "0")]));
        assert!(launched(&[("PMI_SIZE", "2")]));
        assert!(launched(&[("PMIX_RANK", "0")]));
    }

    #[test]
    fn a_local_address_is_read_and_checked() {
        let vars = [
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "node01"),
        ];
        let with = |v: &str| {
            let mut all = vars.to_vec();
            all.push(("BURN_DDP_LOCAL_ADDR", v));
            group_config_from(env(&all))
        };
        assert_eq!(group_config_from(env(&vars)).unwrap().master.local, None);
        assert_eq!(
            with(" 10.0.0.5 ").unwrap().master.local,
            Some("10.0.0.5".parse().unwrap())
        );
        let err = with("node07").unwrap_err().to_string();
        assert!(
            err.contains("BURN_DDP_LOCAL_ADDR") && err.contains("an IP address"),
            "{err}"
        );
    }

    #[test]
    fn under_torchruns_agent_store_the_next_port_is_used() {
        let vars = [
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "localhost"),
            ("MASTER_PORT", "33491"),
            ("TORCHELASTIC_RUN_ID", "abc"),
            ("TORCHELASTIC_USE_AGENT_STORE", "True"),
        ];
        let cfg = group_config_from(env(&vars)).unwrap();
        assert_eq!(cfg.master, MasterAddr::new("localhost", 33492));
        // Said when that port is taken.
        let origin = cfg.port_origin.unwrap();
        assert!(
            origin.contains("MASTER_PORT + 1") && origin.contains("MASTER_PORT=33491"),
            "{origin}"
        );
        let mut with_override = vars.to_vec();
        with_override.push(("BURN_DDP_STORE_PORT", "40000"));
        let cfg = group_config_from(env(&with_override)).unwrap();
        assert_eq!(cfg.master, MasterAddr::new("localhost", 40000));
        assert_eq!(
            cfg.port_origin.as_deref(),
            Some("BURN_DDP_STORE_PORT=40000")
        );
        // Without torchrun's agent store the port is MASTER_PORT itself.
        let cfg = group_config_from(env(&vars[..5])).unwrap();
        assert_eq!(cfg.port_origin, None);
    }

    #[test]
    fn torchrun_variables() {
        let cfg = group_config_from(env(&[
            ("RANK", "5"),
            ("WORLD_SIZE", "8"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "4"),
            ("MASTER_ADDR", "node01"),
            ("MASTER_PORT", "1234"),
            ("TORCHELASTIC_RUN_ID", "abc"),
        ]))
        .unwrap();
        assert_eq!(cfg.rank, Rank(5));
        assert_eq!(cfg.world_size.get(), 8);
        assert_eq!(cfg.local_rank, LocalRank(1));
        assert_eq!(cfg.local_world_size.get(), 4);
        assert_eq!(cfg.master, MasterAddr::new("node01", 1234));
        assert_eq!(cfg.token, JobToken::new("torchelastic:abc"));
    }

    #[test]
    fn defaults_fill_in_local_values_and_master() {
        let cfg = group_config_from(env(&[("RANK", "1"), ("WORLD_SIZE", "2")])).unwrap();
        assert_eq!(cfg.local_rank, LocalRank(1));
        assert_eq!(cfg.local_world_size.get(), 2);
        assert_eq!(cfg.master, MasterAddr::new("127.0.0.1", 29500));
    }

    #[test]
    fn errors_name_the_variable() {
        let e = group_config_from(env(&[("RANK", "x"), ("WORLD_SIZE", "2")])).unwrap_err();
        assert!(e.to_string().contains("RANK=\"x\""), "{e}");
        let e = group_config_from(env(&[("WORLD_SIZE", "2")])).unwrap_err();
        assert!(
            matches!(
                e,
                DdpError::Config(ConfigError::MissingEnv { var: "RANK", .. })
            ),
            "{e}"
        );
        let e = group_config_from(env(&[("RANK", "0")])).unwrap_err();
        assert!(
            matches!(
                e,
                DdpError::Config(ConfigError::MissingEnv {
                    var: "WORLD_SIZE",
                    ..
                })
            ),
            "{e}"
        );
        let e = group_config_from(env(&[("RANK", "2"), ("WORLD_SIZE", "2")])).unwrap_err();
        assert!(
            matches!(e, DdpError::Config(ConfigError::RankOutOfRange { .. })),
            "{e}"
        );
        let e = group_config_from(env(&[("RANK", "0"), ("WORLD_SIZE", "0")])).unwrap_err();
        assert!(e.to_string().contains("WORLD_SIZE"), "{e}");
        let e = group_config_from(env(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("MASTER_PORT", "99999"),
        ]))
        .unwrap_err();
        assert!(e.to_string().contains("MASTER_PORT"), "{e}");
        let e = group_config_from(env(&[("BURN_DDP_TIMEOUT", "soon")])).unwrap_err();
        assert!(e.to_string().contains("BURN_DDP_TIMEOUT"), "{e}");
    }

    #[test]
    fn slurm_fallback() {
        let cfg = group_config_from(env(&[
            ("SLURM_PROCID", "6"),
            ("SLURM_NTASKS", "8"),
            ("SLURM_LOCALID", "2"),
            ("SLURM_NODEID", "1"),
            ("SLURM_STEP_TASKS_PER_NODE", "4(x2)"),
            ("SLURM_STEP_NODELIST", "gpu[07-08]"),
            ("SLURM_JOB_ID", "991"),
            ("SLURM_STEP_ID", "0"),
        ]))
        .unwrap();
        assert_eq!(cfg.rank, Rank(6));
        assert_eq!(cfg.world_size.get(), 8);
        assert_eq!(cfg.local_rank, LocalRank(2));
        assert_eq!(cfg.local_world_size.get(), 4);
        // The port is the job's: 20000 + (991 * 8 + step 0) mod 12000.
        assert_eq!(cfg.master, MasterAddr::new("gpu07", 27928));
        assert!(cfg.port_origin.unwrap().contains("SLURM_JOB_ID=991"));
        assert_eq!(cfg.token, JobToken::new("slurm:991.0"));
    }

    fn slurm_step(job: &str, step: &str) -> Vec<(&'static str, String)> {
        vec![
            ("SLURM_PROCID", "0".into()),
            ("SLURM_NTASKS", "2".into()),
            ("SLURM_STEP_NUM_TASKS", "2".into()),
            ("SLURM_LOCALID", "0".into()),
            ("SLURM_JOB_ID", job.into()),
            ("SLURM_STEP_ID", step.into()),
            ("SLURM_JOB_NODELIST", "vm".into()),
        ]
    }

    fn owned(pairs: &[(&'static str, String)]) -> impl Fn(&str) -> Option<String> {
        let pairs: Vec<(&str, &str)> = pairs.iter().map(|(k, v)| (*k, v.as_str())).collect();
        env(&pairs)
    }

    #[test]
    fn each_slurm_job_and_step_gets_its_own_port_unless_one_is_given() {
        let port = |job: &str, step: &str| {
            group_config_from(owned(&slurm_step(job, step)))
                .unwrap()
                .master
                .port
        };
        let ports = [
            port("41", "0"),
            port("42", "0"),
            port("42", "1"),
            port("43", "0"),
        ];
        for (i, a) in ports.iter().enumerate() {
            assert!((20_000..32_000).contains(a), "{a}");
            for b in &ports[i + 1..] {
                assert_ne!(a, b, "{ports:?}");
            }
        }
        let mut given = slurm_step("41", "0");
        given.push(("MASTER_PORT", "29600".into()));
        let cfg = group_config_from(owned(&given)).unwrap();
        assert_eq!(cfg.master.port, 29600);
        assert_eq!(cfg.port_origin, None);
    }

    #[test]
    fn a_slurm_batch_script_is_told_to_use_srun() {
        // What `sbatch -n2` gives the script itself: no step, SLURM_PROCID=0.
        let batch = [
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "2"),
            ("SLURM_LOCALID", "0"),
            ("SLURM_JOB_ID", "2"),
            ("SLURM_JOB_NODELIST", "vm"),
        ];
        let e = group_config_from(env(&batch)).unwrap_err();
        let msg = e.to_string();
        assert!(
            matches!(e, DdpError::Config(ConfigError::Launch { .. })),
            "{msg}"
        );
        assert!(
            msg.contains("srun <program>") && msg.contains("job 2"),
            "{msg}"
        );
        // One task needs no step.
        let mut one = batch.to_vec();
        one[1] = ("SLURM_NTASKS", "1");
        assert_eq!(group_config_from(env(&one)).unwrap().world_size.get(), 1);
        // The step's task count wins over the allocation's (`srun -n1` in a 2-task job).
        let mut step = slurm_step("7", "0");
        step[2] = ("SLURM_STEP_NUM_TASKS", "1".into());
        assert_eq!(group_config_from(owned(&step)).unwrap().world_size.get(), 1);
    }

    /// What Open MPI 4.1's `mpirun -np 2` gave rank 1 on one host (read off a real run).
    fn open_mpi_rank1() -> Vec<(&'static str, &'static str)> {
        vec![
            ("OMPI_COMM_WORLD_RANK", "1"),
            ("OMPI_COMM_WORLD_SIZE", "2"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
            ("OMPI_MCA_ess_base_jobid", "286982145"),
            ("PMIX_NAMESPACE", "286982145"),
            ("PMIX_RANK", "1"),
        ]
    }

    #[test]
    fn open_mpi_on_one_host() {
        let cfg = group_config_from(env(&open_mpi_rank1())).unwrap();
        assert_eq!(cfg.rank, Rank(1));
        assert_eq!(cfg.world_size.get(), 2);
        assert_eq!(cfg.local_rank, LocalRank(1));
        assert_eq!(cfg.local_world_size.get(), 2);
        assert_eq!(cfg.master.host, "127.0.0.1");
        assert_eq!(cfg.master.port, job_port("286982145"));
        assert_eq!(cfg.token, JobToken::new("PMIX_NAMESPACE:286982145"));
        // Inside a Slurm allocation, mpirun's ranks carry its daemons' Slurm variables too:
        // Open MPI's win.
        let mut inside = open_mpi_rank1();
        inside.extend([
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "1"),
            ("SLURM_STEP_ID", "0"),
        ]);
        let cfg = group_config_from(env(&inside)).unwrap();
        assert_eq!((cfg.rank, cfg.world_size.get()), (Rank(1), 2));
    }

    #[test]
    fn open_mpi_across_hosts_needs_master_addr() {
        let mut vars = open_mpi_rank1();
        vars[1] = ("OMPI_COMM_WORLD_SIZE", "4");
        let e = group_config_from(env(&vars)).unwrap_err();
        let msg = e.to_string();
        assert!(
            msg.contains("mpirun -x MASTER_ADDR=") && msg.contains("4 ranks"),
            "{msg}"
        );
        vars.push(("MASTER_ADDR", "node01"));
        let cfg = group_config_from(env(&vars)).unwrap();
        assert_eq!(cfg.master.host, "node01");
        assert_eq!(
            (cfg.local_rank, cfg.local_world_size.get()),
            (LocalRank(1), 2)
        );
    }

    #[test]
    fn mpich_hydra() {
        let cfg = group_config_from(env(&[
            ("PMI_RANK", "2"),
            ("PMI_SIZE", "3"),
            ("MPI_LOCALRANKID", "2"),
            ("MPI_LOCALNRANKS", "3"),
        ]))
        .unwrap();
        assert_eq!((cfg.rank, cfg.world_size.get()), (Rank(2), 3));
        assert_eq!(cfg.local_rank, LocalRank(2));
        assert_eq!(
            cfg.master,
            MasterAddr::new("127.0.0.1", DEFAULT_MASTER_PORT)
        );
        // `srun --mpi=pmi2`: PMI's rank and size, Slurm's node list and port.
        let mut pmi2 = slurm_step("9", "0");
        pmi2.extend([("PMI_RANK", "0".into()), ("PMI_SIZE", "2".into())]);
        let cfg = group_config_from(owned(&pmi2)).unwrap();
        assert_eq!(cfg.master.host, "vm");
        assert_eq!(cfg.token, JobToken::new("slurm:9.0"));
    }

    #[test]
    fn a_partial_launch_is_refused_naming_the_launchers() {
        for vars in [
            vec![("OMPI_COMM_WORLD_RANK", "0")],
            vec![
                ("OMPI_COMM_WORLD_LOCAL_RANK", "0"),
                ("OMPI_COMM_WORLD_SIZE", "2"),
            ],
            vec![("PMI_SIZE", "2")],
            vec![("PMIX_RANK", "0")],
        ] {
            let e = group_config_from(env(&vars)).unwrap_err();
            let msg = e.to_string();
            assert!(
                matches!(e, DdpError::Config(ConfigError::Launch { .. })),
                "{vars:?}: {msg}"
            );
            assert!(
                msg.contains("torchrun") && msg.contains("srun") && msg.contains("mpirun"),
                "{msg}"
            );
        }
        let mut disagree = open_mpi_rank1();
        disagree[6] = ("PMIX_RANK", "0");
        let msg = group_config_from(env(&disagree)).unwrap_err().to_string();
        assert!(msg.contains("PMIX_RANK=0"), "{msg}");
    }

    /// docs/guide.md's PyTorchJob: what Kubeflow's operator sets in a worker pod, plus the
    /// two variables the guide adds for one process per pod.
    #[test]
    fn a_pytorchjob_pod_needs_nothing_more() {
        let cfg = group_config_from(env(&[
            ("MASTER_ADDR", "train-master-0"),
            ("MASTER_PORT", "23456"),
            ("WORLD_SIZE", "4"),
            ("RANK", "3"),
            ("LOCAL_RANK", "0"),
            ("LOCAL_WORLD_SIZE", "1"),
            ("PYTHONUNBUFFERED", "0"),
        ]))
        .unwrap();
        assert_eq!((cfg.rank, cfg.world_size.get()), (Rank(3), 4));
        assert_eq!(
            (cfg.local_rank, cfg.local_world_size.get()),
            (LocalRank(0), 1)
        );
        assert_eq!(cfg.master, MasterAddr::new("train-master-0", 23456));
    }

    #[test]
    fn torchrun_variables_win_over_slurm() {
        let cfg = group_config_from(env(&[
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("SLURM_PROCID", "7"),
            ("SLURM_NTASKS", "16"),
            ("SLURM_JOB_ID", "5"),
            ("SLURM_STEP_ID", "0"),
        ]))
        .unwrap();
        assert_eq!(cfg.rank, Rank(1));
        assert_eq!(cfg.world_size.get(), 2);
        assert_eq!(cfg.launcher, Some(Launcher::Torchrun));
        // RANK set by hand inside srun: the token is still the Slurm step's, not the address's.
        assert_eq!(cfg.token, JobToken::new("slurm:5.0"));
    }

    #[test]
    fn slurm_task_counts() {
        assert_eq!(tasks_on_node("2(x3),1", 0).map(|w| w.get()), Some(2));
        assert_eq!(tasks_on_node("2(x3),1", 2).map(|w| w.get()), Some(2));
        assert_eq!(tasks_on_node("2(x3),1", 3).map(|w| w.get()), Some(1));
        assert_eq!(tasks_on_node("2(x3),1", 4), None);
        assert_eq!(tasks_on_node("garbage", 0), None);
    }

    #[test]
    fn slurm_host_lists() {
        assert_eq!(first_host("node[01-04,07],gpu5").as_deref(), Some("node01"));
        assert_eq!(first_host("gpu5,node[1-2]").as_deref(), Some("gpu5"));
        assert_eq!(first_host("a").as_deref(), Some("a"));
        assert_eq!(first_host("").as_deref(), None);
    }

    #[test]
    fn restarts_and_run_ids() {
        let count = |vars: &[(&str, &str)]| restart_count_from(&env(vars));
        assert_eq!(count(&[]), 0);
        assert_eq!(count(&[("SLURM_RESTART_COUNT", "2")]), 2);
        assert_eq!(
            count(&[
                ("TORCHELASTIC_RESTART_COUNT", "1"),
                ("SLURM_RESTART_COUNT", "3")
            ]),
            1
        );
        let cfg = group_config_from(owned(&{
            let mut v = slurm_step("5", "0");
            v.push(("SLURM_RESTART_COUNT", "1".into()));
            v
        }))
        .unwrap();
        assert_eq!(cfg.restart_count, 1);
        let id = |vars: &[(&str, &str)]| run_id_from(&env(vars));
        assert_eq!(id(&[]), None);
        assert_eq!(id(&[("TORCHELASTIC_RUN_ID", "none")]), None);
        assert_eq!(id(&[("SLURM_JOB_ID", "17")]).as_deref(), Some("slurm:17"));
        assert_eq!(
            id(&[("TORCHELASTIC_RUN_ID", "r1"), ("SLURM_JOB_ID", "17")]).as_deref(),
            Some("torchelastic:r1")
        );
        assert_eq!(
            id(&[("BURN_DDP_RUN_ID", "mine"), ("LSB_JOBID", "3")]).as_deref(),
            Some("mine")
        );
        assert_eq!(
            id(&[("PBS_JOBID", "12.pbs")]).as_deref(),
            Some("pbs:12.pbs")
        );
    }
}
