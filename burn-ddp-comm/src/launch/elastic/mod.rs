//! Elastic jobs: `burn-ddp run --nnodes MIN:MAX` (torchrun's elastic launch).
//!
//! One launcher per node. The launcher that can bind the rendezvous endpoint
//! (`--master-addr:--master-port`) is the *host*: it serves a rendezvous store there and runs
//! the coordinator; every launcher, the host's included, takes part in *rounds*:
//!
//! 1. It arrives in the current round (a counter and a key per arrival: `nproc`, node id).
//! 2. The coordinator closes the round once at least MIN nodes, the host among them, have
//!    arrived, the join window has passed since then, and every node of the previous round has
//!    arrived or is lost (its launcher silent for the node timeout); or at once when MAX have
//!    arrived. It writes the round's plan: the nodes in node-rank order, the host first
//!    (rank 0, and its store, live there), or why no job can be formed.
//! 3. Each node in the plan starts its ranks with the round's world size, node rank and job
//!    token (`<token>/round-<r>`, so a rank of an older round is refused), the round number as
//!    the restart count (so every rank resumes from the newest complete checkpoint after the
//!    first round) and the first and previous rounds' world sizes. Rank 0's store takes the next port.
//! 4. A round ends when its ranks end. If a rank failed, its launcher moves the job to the next
//!    round (a compare-and-set on the round number). The coordinator does too when a node of
//!    the round goes silent, or when a node waits to join and the job has fewer than MAX
//!    nodes. Every launcher watches the round number and stops its ranks when it moves.
//!
//! Every round after the first is a restart and counts against `--max-restarts`, whatever
//! caused it (as the issue asks; torchrun does not count membership changes). Every wait has a
//! deadline: the rendezvous timeout for too few nodes, the node timeout for a lost node.
//!
//! What this cannot survive: the loss of the host's node (the rendezvous and rank 0 live
//! there), as with torchrun's c10d rendezvous.

use crate::error::{ConfigError, JobError, MembershipError, RendezvousError};
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use super::spawn::{self, LocalJob};
use crate::config::{env, JobToken, MasterAddr};
use crate::store::{resolve_bind, StoreServer};
use crate::types::Rank;
use crate::{DdpError, Result};
use background::{beat, watch};
use coordinator::coordinate;
use rdzv::{
    arrival_key, arrivals_key, finished_key, max_world, plan_key, Plan, Rdzv, END, REQUEST, ROUND,
};

mod background;
mod coordinator;
mod rdzv;

/// How often a launcher says it is alive, and the coordinator looks at the rendezvous.
const BEAT: Duration = Duration::from_millis(250);
/// How often a node waiting for a round's plan looks whether the job ended.
const PLAN_POLL: Duration = Duration::from_millis(500);
/// How long the host keeps the rendezvous up after its own ranks finished, for the other
/// nodes to record that theirs did too.
const FINISH_GRACE: Duration = Duration::from_secs(30);

/// `--nnodes`: a number of nodes, or a range `MIN:MAX` for an elastic job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NodeRange {
    /// The fewest nodes the job runs with.
    pub min: u32,
    /// The most nodes the job admits.
    pub max: u32,
}

impl NodeRange {
    /// Whether the job is elastic (`MIN < MAX`).
    pub fn is_elastic(self) -> bool {
        self.min != self.max
    }
}

impl FromStr for NodeRange {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        let count = |v: &str| v.trim().parse::<u32>().ok().filter(|n| *n >= 1);
        let bad = || {
            format!("{s:?} is neither a number of nodes (1 or more) nor a range MIN:MAX (e.g. 1:4)")
        };
        match s.split_once(':') {
            None => count(s).map(|n| Self { min: n, max: n }).ok_or_else(bad),
            Some((a, b)) => match (count(a), count(b)) {
                (Some(min), Some(max)) if min <= max => Ok(Self { min, max }),
                (Some(min), Some(max)) => Err(format!("MIN ({min}) is above MAX ({max})")),
                _ => Err(bad()),
            },
        }
    }
}

/// The settings of an elastic job (`burn-ddp run --nnodes MIN:MAX`).
#[derive(Debug, Clone)]
pub struct ElasticConfig {
    /// How many nodes the job may have.
    pub nodes: NodeRange,
    /// Rounds after the first that the job may start (each a restart of every rank).
    pub max_restarts: u32,
    /// Once MIN nodes are there, how long more may join before a round starts (torchrun's
    /// last call).
    pub join_window: Duration,
    /// How long a round waits for MIN nodes before the job fails.
    pub rendezvous_timeout: Duration,
    /// A node whose launcher is silent this long is lost.
    pub node_timeout: Duration,
    /// This node's name in the rendezvous and in logs (unique per launcher).
    pub node_id: String,
}

impl ElasticConfig {
    /// The default node id: host name and launcher process id.
    pub fn default_node_id() -> String {
        format!("{}:{}", crate::sys::node_name(), std::process::id())
    }
}

/// One round of an elastic job, as a node sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ElasticRound {
    /// The round number (0 for the first; also the restart count).
    pub number: u32,
    /// The round's nodes in node-rank order.
    pub nodes: Vec<String>,
    /// This node's rank among them.
    pub node_rank: u32,
    /// Ranks per node.
    pub nproc_per_node: u32,
    /// The world size of the job's first round.
    pub first_world: u32,
    /// The world size of the job's round before this one, if any (the same on every node,
    /// a node that joins included).
    pub previous_world: Option<u32>,
}

impl ElasticRound {
    /// The round's world size.
    pub fn world(&self) -> u32 {
        self.nodes.len() as u32 * self.nproc_per_node
    }
}

/// How a round ended on this node.
#[derive(Debug)]
pub enum ElasticRoundEnd {
    /// Every rank of this node finished.
    Finished,
    /// A rank of this node failed.
    Failed(DdpError),
    /// The job moved to another round; this node's ranks were stopped.
    Halted,
    /// The launcher was interrupted.
    Interrupted,
}

/// What runs a round's ranks on this node (the launcher's processes; a test's stand-in).
pub trait RoundRunner {
    /// The ranks this node starts per round (announced at arrival; every node must agree).
    fn nproc_per_node(&self) -> u32;

    /// Runs `round` until its ranks end, or stops them once `halt` is set.
    ///
    /// # Errors
    /// The ranks could not be started.
    fn run_round(
        &mut self,
        round: &ElasticRound,
        halt: &Arc<AtomicBool>,
    ) -> Result<ElasticRoundEnd>;
}

/// Runs the ranks of each round as child processes of this launcher.
#[derive(Debug)]
pub struct ProcessRunner {
    /// The node's job; its world, node rank, token and restart count are set per round.
    pub job: LocalJob,
    /// `--max-restarts`, passed on as `TORCHELASTIC_MAX_RESTARTS`.
    pub max_restarts: u32,
}

impl RoundRunner for ProcessRunner {
    fn nproc_per_node(&self) -> u32 {
        self.job.nproc_per_node
    }

    fn run_round(
        &mut self,
        round: &ElasticRound,
        halt: &Arc<AtomicBool>,
    ) -> Result<ElasticRoundEnd> {
        let mut job = self.job.clone();
        job.nnodes = round.nodes.len() as u32;
        job.node_rank = round.node_rank;
        job.token = JobToken::new(format!(
            "{}/round-{}",
            self.job.token.expose(),
            round.number
        ));
        job.halt = Some(Arc::clone(halt));
        let store_port =
            self.job
                .master
                .port
                .checked_add(1)
                .ok_or(DdpError::Config(ConfigError::InvalidConfig {
                field: "--master-port",
                reason:
                    "must be below 65535 for an elastic job (rank 0's store takes the next port)",
            }))?;
        let round_no = round.number.to_string();
        let mut vars = vec![
            (env::RESTART_COUNT, round_no.clone()),
            (env::TORCHELASTIC_RESTART_COUNT, round_no),
            ("TORCHELASTIC_MAX_RESTARTS", self.max_restarts.to_string()),
            (env::STORE_PORT, store_port.to_string()),
        ];
        vars.push((env::FIRST_WORLD_SIZE, round.first_world.to_string()));
        if let Some(prev) = round.previous_world {
            vars.push((env::PREVIOUS_WORLD_SIZE, prev.to_string()));
        }
        job.env
            .extend(vars.into_iter().map(|(k, v)| (k.into(), v.into())));
        let report = spawn::run(&job)?;
        Ok(match report.failure {
            None if report.halted => ElasticRoundEnd::Halted,
            None => ElasticRoundEnd::Finished,
            Some(DdpError::Job(JobError::Interrupted)) => ElasticRoundEnd::Interrupted,
            Some(e) if report.halted => {
                tracing::debug!("a rank failed while the round was being stopped: {e}");
                ElasticRoundEnd::Halted
            }
            Some(e) => ElasticRoundEnd::Failed(e),
        })
    }
}

/// Runs an elastic job on this node: serves the rendezvous if this node can bind its endpoint,
/// takes part in rounds until the job finishes, fails, or runs out of restarts.
///
/// # Errors
/// `Elastic` (too few nodes, settings that differ between nodes, restarts used up, the host
/// lost), `Interrupted`, or the last rank failure when no restart is left.
pub fn run(job: LocalJob, elastic: ElasticConfig) -> Result<()> {
    let endpoint = job.master.clone();
    let token = job.token.clone();
    let mut runner = ProcessRunner {
        job,
        max_restarts: elastic.max_restarts,
    };
    run_with(&endpoint, &token, &elastic, &mut runner).map(|_| ())
}

/// [`run`] with another runner of each round's ranks. Returns the round that finished.
///
/// # Errors
/// As [`run`].
pub fn run_with(
    endpoint: &MasterAddr,
    token: &JobToken,
    elastic: &ElasticConfig,
    runner: &mut dyn RoundRunner,
) -> Result<ElasticRound> {
    let (endpoint, token) = (endpoint.clone(), token.clone());
    let server = serve(&endpoint, elastic, &token)?;
    let done = Arc::new(AtomicBool::new(false));
    let coordinator = match &server {
        Some(_) => {
            let rdzv = Rdzv::connect(&endpoint, elastic.nodes.max, &token, REQUEST)?;
            rdzv.client
                .set(ROUND, b"0")
                .map_err(|e| rdzv.lost("opening round 0", e))?;
            let cfg = elastic.clone();
            let done = Arc::clone(&done);
            Some(
                thread::Builder::new()
                    .name("burn-ddp-rdzv".into())
                    .spawn(move || coordinate(&rdzv, &cfg, &done))?,
            )
        }
        None => None,
    };
    let result = participate(&endpoint, &token, elastic, server.is_some(), runner);
    let host_rdzv = server
        .as_ref()
        .and_then(|_| Rdzv::connect(&endpoint, elastic.nodes.max, &token, REQUEST).ok());
    if let Some(rdzv) = host_rdzv {
        // Nodes still waiting to be admitted learn that the job is over, and how.
        let how = match &result {
            Ok(round) => format!("it finished in round {}", round.number),
            Err(e) => format!("its host's node failed: {e}"),
        };
        let _ = rdzv.client.set(END, how.as_bytes());
        // Waiting nodes look every PLAN_POLL: keep the rendezvous up long enough to be read.
        let next = match &result {
            Ok(round) => round.number + 1,
            Err(_) => rdzv.round().map_or(0, |r| r + 1),
        };
        if rdzv.count(&arrivals_key(next)).is_ok_and(|n| n > 0) {
            thread::sleep(PLAN_POLL * 3);
        }
        // The other nodes of the last round record their end; keep the rendezvous up for them.
        if let Ok(round) = &result {
            let deadline = Instant::now() + FINISH_GRACE;
            while Instant::now() < deadline
                && rdzv
                    .count(&finished_key(round.number))
                    .is_ok_and(|n| n < round.nodes.len() as i64)
            {
                thread::sleep(BEAT);
            }
        }
    }
    done.store(true, Ordering::SeqCst);
    if let Some(h) = coordinator {
        if let Ok(Err(e)) = h.join() {
            tracing::warn!("elastic coordinator: {e}");
        }
    }
    drop(server);
    result
}

/// Serves the rendezvous when this node holds the endpoint's address and the port is free.
fn serve(
    endpoint: &MasterAddr,
    elastic: &ElasticConfig,
    token: &JobToken,
) -> Result<Option<StoreServer>> {
    let addr = resolve_bind(endpoint, Rank(0))?;
    match StoreServer::bind_rendezvous(addr, max_world(elastic.nodes.max)?, token.clone()) {
        Ok(s) => {
            eprintln!(
                "burn-ddp run: node {} hosts the elastic rendezvous on {addr}",
                elastic.node_id
            );
            Ok(Some(s))
        }
        // Another launcher serves it (this machine), or the address is another node's.
        Err(
            DdpError::Rendezvous(RendezvousError::PortInUse { .. })
            | DdpError::Rendezvous(RendezvousError::StoreBind { .. }),
        ) => Ok(None),
        Err(e) => Err(e),
    }
}

/// A launcher's part: arrive, run each round it is admitted to, move on when the job does.
/// Returns the round that finished.
///
/// # Errors
/// As [`run`].
fn participate(
    endpoint: &MasterAddr,
    token: &JobToken,
    elastic: &ElasticConfig,
    is_host: bool,
    runner: &mut dyn RoundRunner,
) -> Result<ElasticRound> {
    let rdzv = Rdzv::connect(
        endpoint,
        elastic.nodes.max,
        token,
        elastic.rendezvous_timeout,
    )?;
    let _beat = beat(endpoint, elastic, token)?;
    let id = &elastic.node_id;
    let nproc = runner.nproc_per_node();
    let mut number = rdzv.round()?;
    if rdzv.plan(number)?.is_some() {
        // The job runs already: wait to be admitted in the next round.
        number += 1;
        eprintln!(
            "burn-ddp run: node {id} asks to join the running job (round {})",
            number - 1
        );
    }
    let mut previous: Option<ElasticRound> = None;
    let mut last_change: Option<String> = None;
    loop {
        if number > elastic.max_restarts && previous.is_none() && last_change.is_none() {
            return Err(DdpError::Membership(MembershipError::Elastic {
                addr: rdzv.addr.clone(),
                reason: format!(
                    "the job runs in round {}: admitting node {id} would take restart {number}, \
                     above --max-restarts {}",
                    number - 1,
                    elastic.max_restarts
                ),
            }));
        }
        if number > elastic.max_restarts {
            let why = last_change
                .take()
                .unwrap_or_else(|| "the job's membership changed".into());
            return Err(DdpError::Membership(MembershipError::Elastic {
                addr: rdzv.addr.clone(),
                reason: format!(
                    "round {number} would be restart {number}, above --max-restarts {}; the \
                     last change: {why}",
                    elastic.max_restarts
                ),
            }));
        }
        let i = rdzv
            .client
            .add(&arrivals_key(number), 1)
            .map_err(|e| rdzv.lost("arriving", e))?
            - 1;
        rdzv.client
            .set(&arrival_key(number, i), format!("{nproc}\t{id}").as_bytes())
            .map_err(|e| rdzv.lost("arriving", e))?;
        let plan = wait_plan(&rdzv, number, elastic)?;
        let (plan_nproc, nodes, first_world, previous_world) = match plan {
            Plan::Failed(why) => {
                return Err(DdpError::Membership(MembershipError::Elastic {
                    addr: rdzv.addr.clone(),
                    reason: why,
                }))
            }
            Plan::Nodes {
                nproc,
                nodes,
                first_world,
                previous_world,
            } => (nproc, nodes, first_world, previous_world),
        };
        let Some(node_rank) = nodes.iter().position(|n| n == id) else {
            let why = if nodes.len() >= elastic.nodes.max as usize {
                format!("its maximum of {} nodes", elastic.nodes.max)
            } else {
                format!(
                    "{} node(s) ({}), decided before this node asked",
                    nodes.len(),
                    nodes.join(", ")
                )
            };
            eprintln!(
                "burn-ddp run: round {number} started with {why}, without node {id}; it waits \
                 for the next round"
            );
            number += 1;
            continue;
        };
        debug_assert!(!is_host || node_rank == 0);
        let round = ElasticRound {
            number,
            nodes,
            node_rank: node_rank as u32,
            nproc_per_node: plan_nproc,
            first_world,
            previous_world,
        };
        eprintln!(
            "burn-ddp run: {}",
            describe_change(previous.as_ref(), &round, id)
        );
        let halt = Arc::new(AtomicBool::new(false));
        let watcher = watch(endpoint, elastic, token, number, &halt)?;
        let end = runner.run_round(&round, &halt);
        drop(watcher);
        match end? {
            ElasticRoundEnd::Finished => {
                let _ = rdzv.client.add(&finished_key(number), 1);
                eprintln!("burn-ddp run: round {number} finished on node {id}");
                return Ok(round);
            }
            ElasticRoundEnd::Interrupted => return Err(DdpError::Job(JobError::Interrupted)),
            ElasticRoundEnd::Failed(e) => {
                let why = format!("on node {id}: {e}");
                eprintln!(
                    "burn-ddp run: round {number} failed {why}; the job moves to round {}",
                    number + 1
                );
                rdzv.bump(number, &why)?;
                last_change = Some(why);
            }
            ElasticRoundEnd::Halted => {
                let why = rdzv.why(number).unwrap_or_else(|| "unknown".into());
                eprintln!(
                    "burn-ddp run: the job left round {number} ({why}); node {id} stopped its \
                     ranks"
                );
                last_change = Some(why);
            }
        }
        number = rdzv.round()?.max(number + 1);
        previous = Some(round);
    }
}

/// Waits for the plan of round `number`, within the longest time the coordinator may take.
fn wait_plan(rdzv: &Rdzv, number: u32, elastic: &ElasticConfig) -> Result<Plan> {
    let started = Instant::now();
    let limit = elastic.rendezvous_timeout + elastic.join_window + elastic.node_timeout + REQUEST;
    let mut said = Instant::now();
    loop {
        match rdzv.client.get_timeout(&plan_key(number), PLAN_POLL) {
            Ok(v) => {
                return Plan::decode(&v).ok_or_else(|| {
                    DdpError::Membership(MembershipError::Elastic {
                        addr: rdzv.addr.clone(),
                        reason: format!("the plan of round {number} is malformed"),
                    })
                })
            }
            Err(DdpError::Rendezvous(RendezvousError::StoreTimeout { .. })) => {}
            Err(e) => return Err(rdzv.lost("waiting for a round to start", e)),
        }
        if let Ok(how) = rdzv.client.get_timeout(END, Duration::ZERO) {
            return Err(DdpError::Membership(MembershipError::Elastic {
                addr: rdzv.addr.clone(),
                reason: format!(
                    "the job ended before node {} was admitted: {}",
                    elastic.node_id,
                    String::from_utf8_lossy(&how)
                ),
            }));
        }
        if started.elapsed() >= limit {
            return Err(DdpError::Membership(MembershipError::Elastic {
                addr: rdzv.addr.clone(),
                reason: format!(
                    "round {number} did not start within {limit:.0?}: the job runs with its \
                     maximum of {} nodes (this node could join only when a node leaves), or \
                     its host stopped coordinating",
                    elastic.nodes.max
                ),
            }));
        }
        if said.elapsed() >= Duration::from_secs(10) {
            said = Instant::now();
            eprintln!(
                "burn-ddp run: node {} waits for round {number} to start ({:.0?} so far)",
                elastic.node_id,
                started.elapsed()
            );
        }
    }
}

/// The line every launcher prints when a round starts: who left, who joined, the world size.
fn describe_change(previous: Option<&ElasticRound>, round: &ElasticRound, id: &str) -> String {
    let first = round.node_rank * round.nproc_per_node;
    let mut line = format!(
        "round {}: {} node(s) [{}], world size {}",
        round.number,
        round.nodes.len(),
        round.nodes.join(", "),
        round.world()
    );
    if let Some(w) = round.previous_world {
        line.push_str(&format!(" (was {w})"));
    }
    if let Some(prev) = previous {
        // The nodes of `a` that are not in `b`.
        let minus = |a: &[String], b: &[String]| -> String {
            let only: Vec<&str> = a
                .iter()
                .filter(|n| !b.contains(n))
                .map(String::as_str)
                .collect();
            only.join(", ")
        };
        line.push_str(&format!(
            "; left: [{}]; joined: [{}]",
            minus(&prev.nodes, &round.nodes),
            minus(&round.nodes, &prev.nodes)
        ));
    }
    line.push_str(&format!(
        "; node {id} is node rank {}, ranks {first}..{}",
        round.node_rank,
        first + round.nproc_per_node
    ));
    line
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    /// What a stand-in node does in one round.
    #[derive(Debug, Clone, Copy)]
    enum Act {
        /// Its ranks finish after this long (unless halted first).
        Finish(u64),
        /// A rank fails after this long (unless halted first).
        Fail(u64),
        /// The whole node disappears after this long (its launcher ends, its beat stops).
        Vanish(u64),
        /// Its ranks run until the job moves on.
        UntilHalt,
    }

    struct Fake {
        nproc: u32,
        script: Vec<Act>,
        seen: Arc<Mutex<Vec<ElasticRound>>>,
    }

    fn halted_within(halt: &AtomicBool, ms: u64) -> bool {
        let end = Instant::now() + Duration::from_millis(ms);
        while Instant::now() < end {
            if halt.load(Ordering::SeqCst) {
                return true;
            }
            thread::sleep(Duration::from_millis(10));
        }
        false
    }

    impl RoundRunner for Fake {
        fn nproc_per_node(&self) -> u32 {
            self.nproc
        }

        fn run_round(
            &mut self,
            round: &ElasticRound,
            halt: &Arc<AtomicBool>,
        ) -> Result<ElasticRoundEnd> {
            self.seen.lock().unwrap().push(round.clone());
            let act = if self.script.is_empty() {
                Act::UntilHalt
            } else {
                self.script.remove(0)
            };
            Ok(match act {
                Act::Finish(ms) if !halted_within(halt, ms) => ElasticRoundEnd::Finished,
                Act::Fail(ms) if !halted_within(halt, ms) => {
                    ElasticRoundEnd::Failed(DdpError::Job(JobError::RankFailed {
                        rank: Rank(round.node_rank * round.nproc_per_node),
                        pid: 0,
                        status: "exited with status 1".into(),
                    }))
                }
                Act::Vanish(ms) => {
                    halted_within(halt, ms);
                    return Err(DdpError::Io(std::io::Error::other("the node vanished")));
                }
                Act::UntilHalt if !halted_within(halt, 60_000) => {
                    panic!("round {} was never left", round.number)
                }
                _ => ElasticRoundEnd::Halted,
            })
        }
    }

    fn settings(id: &str, min: u32, max: u32, max_restarts: u32) -> ElasticConfig {
        ElasticConfig {
            nodes: NodeRange { min, max },
            max_restarts,
            join_window: Duration::from_millis(800),
            rendezvous_timeout: Duration::from_secs(20),
            node_timeout: Duration::from_millis(1500),
            node_id: id.into(),
        }
    }

    type Node = (
        thread::JoinHandle<Result<ElasticRound>>,
        Arc<Mutex<Vec<ElasticRound>>>,
    );

    fn node(endpoint: &MasterAddr, cfg: ElasticConfig, nproc: u32, script: Vec<Act>) -> Node {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let mut fake = Fake {
            nproc,
            script,
            seen: Arc::clone(&seen),
        };
        let endpoint = endpoint.clone();
        let handle = thread::spawn(move || {
            run_with(&endpoint, &JobToken::new("elastic-test"), &cfg, &mut fake)
        });
        (handle, seen)
    }

    /// Starts the host's launcher and waits until it serves the rendezvous, so that it is the
    /// host (on one machine, the first launcher to bind the endpoint is).
    fn host(cfg: ElasticConfig, nproc: u32, script: Vec<Act>) -> (MasterAddr, Node) {
        let endpoint = MasterAddr::new("127.0.0.1", spawn::free_port().unwrap());
        let n = node(&endpoint, cfg, nproc, script);
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", endpoint.port)).is_err() {
            assert!(Instant::now() < deadline, "the host never served");
            thread::sleep(Duration::from_millis(10));
        }
        (endpoint, n)
    }

    fn nodes_of(seen: &Arc<Mutex<Vec<ElasticRound>>>) -> Vec<(u32, Vec<String>, Option<u32>)> {
        seen.lock()
            .unwrap()
            .iter()
            .map(|r| (r.number, r.nodes.clone(), r.previous_world))
            .collect()
    }

    fn v(ids: &[&str]) -> Vec<String> {
        ids.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn node_ranges_parse_like_torchrun() {
        assert_eq!("3".parse(), Ok(NodeRange { min: 3, max: 3 }));
        assert_eq!("1:4".parse(), Ok(NodeRange { min: 1, max: 4 }));
        assert!(!NodeRange { min: 2, max: 2 }.is_elastic());
        for bad in ["0", "0:2", "3:2", "a", "1:", ":2", "1:2:3", ""] {
            let e = bad.parse::<NodeRange>().unwrap_err();
            assert!(
                e.contains("MIN") || e.contains("number of nodes"),
                "{bad}: {e}"
            );
        }
    }

    /// A, B train; B vanishes (its launcher gone): after the node timeout A goes on alone in
    /// round 1. C starts: the job has fewer than MAX nodes, so it moves to round 2 with A and
    /// C, which finish. Every round's membership and previous world size is as described.
    #[test]
    fn a_lost_node_is_dropped_and_a_newcomer_joins_in_the_next_round() {
        let (endpoint, a) = host(
            settings("a", 1, 3, 5),
            1,
            vec![Act::UntilHalt, Act::UntilHalt, Act::Finish(300)],
        );
        let b = node(&endpoint, settings("b", 1, 3, 5), 1, vec![Act::Vanish(300)]);
        let deadline = Instant::now() + Duration::from_secs(30);
        while a.1.lock().unwrap().len() < 2 {
            assert!(
                Instant::now() < deadline,
                "A never reached round 1: {:?}",
                nodes_of(&a.1)
            );
            thread::sleep(Duration::from_millis(20));
        }
        let c = node(&endpoint, settings("c", 1, 3, 5), 1, vec![Act::Finish(300)]);
        let c_end = c.0.join().unwrap().unwrap();
        let a_end = a.0.join().unwrap().unwrap();
        let b_end = b.0.join().unwrap();
        assert!(b_end.is_err(), "{b_end:?}");
        assert_eq!(
            nodes_of(&a.1),
            vec![
                (0, v(&["a", "b"]), None),
                (1, v(&["a"]), Some(2)),
                (2, v(&["a", "c"]), Some(1)),
            ]
        );
        assert_eq!(nodes_of(&c.1), vec![(2, v(&["a", "c"]), Some(1))]);
        assert_eq!(c.1.lock().unwrap()[0].first_world, 2);
        assert_eq!((a_end.node_rank, c_end.node_rank), (0, 1));
        assert_eq!(c_end.world(), 2);
    }

    /// A rank failure on B moves both nodes to round 1 (restart 1), where they finish; with
    /// no restart allowed, both fail naming the rank failure.
    #[test]
    fn a_failed_rank_restarts_every_node_within_max_restarts() {
        let (endpoint, a) = host(
            settings("a", 2, 3, 1),
            1,
            vec![Act::UntilHalt, Act::Finish(200)],
        );
        let b = node(
            &endpoint,
            settings("b", 2, 3, 1),
            1,
            vec![Act::Fail(300), Act::Finish(200)],
        );
        a.0.join().unwrap().unwrap();
        b.0.join().unwrap().unwrap();
        for seen in [&a.1, &b.1] {
            let rounds: Vec<u32> = nodes_of(seen).iter().map(|r| r.0).collect();
            assert_eq!(rounds, vec![0, 1]);
        }

        let (endpoint, a) = host(settings("a", 2, 3, 0), 1, vec![Act::UntilHalt]);
        let b = node(&endpoint, settings("b", 2, 3, 0), 1, vec![Act::Fail(300)]);
        for (n, name) in [(a, "a"), (b, "b")] {
            let e = n.0.join().unwrap().unwrap_err().to_string();
            assert!(
                e.contains("above --max-restarts 0")
                    && e.contains("rank 1 (pid 0) exited with status 1"),
                "{name}: {e}"
            );
        }
    }

    /// A node that asks to join a job with its maximum of nodes waits; when the job finishes
    /// it is told so, at once, instead of waiting out its timeout.
    #[test]
    fn a_node_waiting_for_a_full_job_learns_that_it_ended() {
        let (endpoint, a) = host(settings("a", 1, 2, 3), 1, vec![Act::Finish(4000)]);
        let b = node(
            &endpoint,
            settings("b", 1, 2, 3),
            1,
            vec![Act::Finish(4000)],
        );
        let deadline = Instant::now() + Duration::from_secs(20);
        while a.1.lock().unwrap().is_empty() {
            assert!(Instant::now() < deadline, "round 0 never started");
            thread::sleep(Duration::from_millis(20));
        }
        let started = Instant::now();
        let c = node(&endpoint, settings("c", 1, 2, 3), 1, vec![]);
        a.0.join().unwrap().unwrap();
        b.0.join().unwrap().unwrap();
        let e = c.0.join().unwrap().unwrap_err().to_string();
        assert!(
            e.contains("the job ended before node c was admitted: it finished in round 0"),
            "{e}"
        );
        assert!(started.elapsed() < Duration::from_secs(15));
        assert!(c.1.lock().unwrap().is_empty());
    }

    /// With no restart left, a node asking to join is refused, and the running job goes on.
    #[test]
    fn a_newcomer_never_ends_a_job_that_has_no_restart_left() {
        let (endpoint, a) = host(settings("a", 1, 2, 0), 1, vec![Act::Finish(3000)]);
        let deadline = Instant::now() + Duration::from_secs(20);
        while a.1.lock().unwrap().is_empty() {
            assert!(Instant::now() < deadline, "round 0 never started");
            thread::sleep(Duration::from_millis(20));
        }
        let c = node(&endpoint, settings("c", 1, 2, 0), 1, vec![]);
        let e = c.0.join().unwrap().unwrap_err().to_string();
        assert!(
            e.contains("admitting node c would take restart 1, above --max-restarts 0"),
            "{e}"
        );
        let end = a.0.join().unwrap().unwrap();
        assert_eq!((end.number, end.nodes.clone()), (0, v(&["a"])));
    }

    #[test]
    fn too_few_nodes_fail_the_rendezvous_saying_how_many_came() {
        let mut cfg = settings("a", 2, 3, 0);
        cfg.rendezvous_timeout = Duration::from_secs(1);
        let (_, a) = host(cfg, 1, vec![]);
        let e = a.0.join().unwrap().unwrap_err().to_string();
        assert!(
            e.contains("1 of the at least 2 node(s) arrived") && e.contains("[a]"),
            "{e}"
        );
    }

    #[test]
    fn nodes_that_disagree_are_refused_naming_the_option() {
        // Ranks per node.
        let (endpoint, a) = host(settings("a", 1, 2, 0), 1, vec![]);
        let b = node(&endpoint, settings("b", 1, 2, 0), 2, vec![]);
        for n in [a, b] {
            let e = n.0.join().unwrap().unwrap_err().to_string();
            assert!(e.contains("same --nproc-per-node"), "{e}");
        }
        // The most nodes.
        let (endpoint, a) = host(settings("a", 1, 2, 0), 1, vec![Act::Finish(3000)]);
        let b = node(&endpoint, settings("b", 1, 3, 0), 1, vec![]);
        let e = b.0.join().unwrap().unwrap_err().to_string();
        assert!(
            e.contains("same --nnodes") && e.contains("up to 2 nodes"),
            "{e}"
        );
        a.0.join().unwrap().unwrap();
    }
}
