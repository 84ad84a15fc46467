//! Fault-tolerant jobs on the launcher's side (`burn-ddp run --fault-tolerant`): the store that
//! outlives every rank ([`Lighthouse`]), and a supervisor that lets the job go on when a rank
//! dies, starts replacements that join it live, and judges the job by its last membership.
//!
//! The ranks themselves agree on each membership through the store (`group/membership/`); the
//! launcher never stops them for another rank's failure. What it adds:
//!
//! - node 0's launcher serves the store on `MASTER_ADDR:MASTER_PORT` and keeps it up until
//!   every member of the job's last membership has ended, its own ranks' end or not;
//! - every rank gets `BURN_DDP_FAULT_TOLERANT=1` and its member id (its `RANK`);
//! - a rank that fails is reported (the others go on); while `--max-restarts` allows and none of
//!   the node's ranks has finished yet, a replacement starts in its place (same local rank,
//!   hence same GPU) with `BURN_DDP_FT_JOIN=1` and a fresh member id;
//! - the node succeeds when its ranks that are members of the job's last membership all
//!   ended successfully (ranks lost on the way are said, not fatal).

use crate::error::{JobError, MembershipError, RendezvousError};
use std::ffi::OsString;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::spawn::{self, describe, LocalJob, RankExit, Running};
use crate::config::{env, JobToken, MasterAddr};
use crate::group::{
    any_admitted, fresh_member_id, last_membership, member_list as ids, record_first_world,
    LastMembership,
};
use crate::store::auth::Purpose;
use crate::store::{resolve_bind, StoreClient, StoreServer};
use crate::types::{Rank, WorldSize};
use crate::{DdpError, Result};

/// The bound of one request of the launcher to the store.
const STORE_REQUEST: Duration = Duration::from_secs(10);
/// How long node 0's launcher keeps the store up once the job ended, for the other launchers
/// to read its last membership.
const OUTCOME_GRACE: Duration = Duration::from_secs(2);
/// How long node 0's launcher waits for the rest of the last membership once some of it ended.
const ENDING_LIMIT: Duration = Duration::from_secs(120);

/// The store of a fault-tolerant job, served by node 0's launcher (torchft's lighthouse): it
/// outlives every rank, so any rank may die. Dropping it stops it.
#[derive(Debug)]
pub struct Lighthouse {
    server: StoreServer,
}

impl Lighthouse {
    /// Serves the store of the job whose token is `token` on `master`, for a job of up to
    /// about 500 processes (its connection limit: 4,096); [`Lighthouse::bind_for`] sizes it.
    ///
    /// # Errors
    /// `PortInUse` (naming the port) or `StoreBind`; an unresolvable address.
    pub fn bind(master: &MasterAddr, token: JobToken) -> Result<Self> {
        Self::bind_for(master, token, WorldSize::ONE)
    }

    /// [`Lighthouse::bind`] for a job that starts with `processes`: its connection limit is 8
    /// a process (each holds about four), 4,096 at least.
    ///
    /// # Errors
    /// As [`Lighthouse::bind`].
    pub fn bind_for(master: &MasterAddr, token: JobToken, processes: WorldSize) -> Result<Self> {
        let addr = resolve_bind(master, Rank::ZERO)?;
        Ok(Self {
            server: StoreServer::bind_lighthouse(addr, token, processes)?,
        })
    }

    /// [`Lighthouse::bind`] for node 0's launcher of `job`: when the port is taken by the
    /// store of this very job (same token), which is running, the error says so, and to add
    /// `--join` ([`MembershipError::NotThisJob`]), instead of only that the port is in use.
    ///
    /// # Errors
    /// As [`Lighthouse::bind`].
    pub fn serve(job: &LocalJob) -> Result<Self> {
        let processes =
            WorldSize::new(job.nproc_per_node.saturating_mul(job.nnodes)).unwrap_or(WorldSize::ONE);
        match Self::bind_for(&job.master, job.token.clone(), processes) {
            Err(e @ DdpError::Rendezvous(RendezvousError::PortInUse { .. })) => {
                match connect(job, Instant::now() + Duration::from_secs(2)) {
                    Ok(store) => Err(check_first_launch(&store, job).err().unwrap_or(e)),
                    Err(_) => Err(e),
                }
            }
            other => other,
        }
    }

    /// The address it listens on.
    pub fn addr(&self) -> SocketAddr {
        self.server.local_addr()
    }
}

/// The fault-tolerant settings of `burn-ddp run`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FaultTolerantLaunch {
    /// Replacements this node may start, in all, for ranks that failed.
    pub max_restarts: u32,
    /// The fewest ranks the job goes on with (`BURN_DDP_MIN_RANKS`).
    pub min_ranks: u32,
    /// This node's ranks join a running job (`burn-ddp run --fault-tolerant --join`) instead
    /// of forming it with the others.
    pub join: bool,
    /// How long this launcher tries to reach the job's store (`--rdzv-timeout`).
    pub store_connect: Duration,
}

/// How a fault-tolerant node ended.
#[derive(Debug)]
pub struct FaultTolerantReport {
    /// Every process this node started, replacements included, in the order they ended.
    pub exits: Vec<(u32, RankExit)>,
    /// The job's last membership (epoch, member ids), if it formed one.
    pub last: Option<(u64, Vec<u32>)>,
    /// Replacements started.
    pub replacements: u32,
    /// Why this node failed, if it did.
    pub failure: Option<DdpError>,
}

struct Slot {
    local: u32,
    member: u32,
    running: Running,
    /// Since when the launcher has been stopping it (SIGTERM; SIGKILL after the grace period).
    stopping: Option<Instant>,
}

/// When a job's last membership is ending: since when some of its members have ended while
/// others have not (the others end with them, the last steps being collective, or never will:
/// a process frozen after its last collective).
#[derive(Debug, Default)]
struct EndWatch {
    ending: Option<(u64, Instant)>,
}

impl EndWatch {
    /// Takes the job's last membership in; `true` once its members that have not ended are
    /// [`ENDING_LIMIT`] late.
    fn late(&mut self, m: &LastMembership) -> bool {
        let some = m.ended.iter().any(|d| *d);
        let all = m.ended.iter().all(|d| *d);
        if !some || all || self.ending.is_some_and(|(e, _)| e != m.epoch) {
            self.ending = None;
        } else if self.ending.is_none() {
            self.ending = Some((m.epoch, Instant::now()));
        }
        self.ending
            .is_some_and(|(_, t)| t.elapsed() >= ENDING_LIMIT)
    }
}

/// Why the launcher stops a rank that is still running, if it must: the job ended without it
/// (a rank left out of the membership, frozen or still asking to join: it outlived the job,
/// which did not need it), or it is a member that has not ended [`ENDING_LIMIT`] after the
/// others of the last membership (a failure of the job).
fn must_stop(member: u32, m: &LastMembership, late: bool) -> Option<Stop> {
    let place = m.members.iter().position(|id| *id == member);
    match place {
        None if m.outcome().is_some() => Some(Stop {
            why: format!(
                "is still running after the job ended (its last membership, epoch {}, was {} \
                 and did not include it: left out, frozen, or still waiting to join)",
                m.epoch,
                ids(&m.members)
            ),
            outlived: true,
        }),
        Some(i) if late && !m.ended[i] => Some(Stop {
            why: format!(
                "has not ended {ENDING_LIMIT:?} after the other members of the job's last \
                 membership (epoch {}) did (frozen?)",
                m.epoch
            ),
            outlived: false,
        }),
        _ => None,
    }
}

/// A rank the launcher stops ([`must_stop`]).
struct Stop {
    why: String,
    /// The job ended without it: a process out of the job, alive at its end, not needed.
    outlived: bool,
}

/// Runs this node's ranks of a fault-tolerant job (the store must be served already: by this
/// launcher on node 0, see [`Lighthouse`]).
///
/// # Errors
/// A rank cannot be started, or the store cannot be reached at the start.
pub fn run(job: &LocalJob, ft: FaultTolerantLaunch, serving: bool) -> Result<FaultTolerantReport> {
    let store = connect(job, Instant::now() + ft.store_connect).map_err(|e| match e {
        DdpError::Rendezvous(RendezvousError::MasterUnreachable {
            addr,
            waited,
            last_error,
            ..
        }) => DdpError::Membership(MembershipError::FaultTolerantJob {
            reason: if job.master.etcd.is_some() {
                format!(
                    "the job's store, the {addr}, was unreachable for {waited:.0?} (last \
                     error: {last_error}). Check that a majority of its members run and that \
                     --rdzv-endpoint lists their client endpoints; --rdzv-timeout sets how \
                     long to try"
                )
            } else {
                format!(
                    "the job's store at {addr} was unreachable for {waited:.0?} (last error: \
                     {last_error}). Check that node 0's launcher of the job runs and that \
                     --master-addr/--master-port point to it; --rdzv-timeout sets how long to try"
                )
            },
        }),
        e => e,
    })?;
    if !ft.join {
        check_first_launch(&store, job)?;
    }
    let common = |member: u32, join: bool| -> Vec<(OsString, OsString)> {
        let mut v: Vec<(OsString, OsString)> = vec![
            (env::FAULT_TOLERANT.into(), "1".into()),
            (env::MEMBER_ID.into(), member.to_string().into()),
            (env::MIN_RANKS.into(), ft.min_ranks.to_string().into()),
        ];
        if join {
            v.push((env::FT_JOIN.into(), "1".into()));
        }
        v
    };
    let mut slots: Vec<Slot> = Vec::new();
    for local in 0..job.nproc_per_node {
        let rank = Rank(job.node_rank * job.nproc_per_node + local);
        let member = if ft.join {
            fresh_member_id(&store)?
        } else {
            rank.0
        };
        match spawn::start_rank(job, local, rank, &common(member, ft.join)) {
            Ok(running) => slots.push(Slot {
                local,
                member,
                running,
                stopping: None,
            }),
            Err(e) => {
                for s in &mut slots {
                    let _ = s.running.child.kill();
                    let _ = s.running.child.wait();
                }
                return Err(e);
            }
        }
    }

    let mut ended: Vec<(u32, Running)> = Vec::new();
    // Whether a process of this node failed only once the job had ended (it was out of the
    // job, left out or never let in, and asked to join after training), or was stopped here
    // because the job had ended without it (still frozen, or still waiting to join).
    let mut outlived = false;
    let mut replacements = 0;
    let mut interrupted = false;
    let mut term_sent: Option<Instant> = None;
    let mut watch = EndWatch::default();
    let mut looked = Instant::now();
    loop {
        let mut i = 0;
        while i < slots.len() {
            let status = match slots[i].running.child.try_wait() {
                Ok(Some(status)) => status,
                _ => {
                    i += 1;
                    continue;
                }
            };
            let mut slot = slots.swap_remove(i);
            slot.running.exit = Some(status);
            let (local, member, rank) = (slot.local, slot.member, slot.running.rank);
            let pid = slot.running.child.id();
            ended.push((member, slot.running));
            // Ctrl-C reaches the ranks too (one process group), often before this loop sees
            // the launcher's own flag: an interrupt, not a failure to replace.
            let stop = job.stop.as_ref().is_some_and(|s| s.load(Ordering::SeqCst));
            if stop || std::os::unix::process::ExitStatusExt::signal(&status) == Some(libc::SIGINT)
            {
                if !interrupted && !status.success() {
                    eprintln!(
                        "burn-ddp run: rank {rank} (member {member}, pid {pid}) was \
                         interrupted; it is not replaced"
                    );
                }
                interrupted |= stop;
                continue;
            }
            if status.success() || interrupted || slot.stopping.is_some() {
                continue;
            }
            let outcome = last_membership(&store)
                .ok()
                .flatten()
                .and_then(|m| m.outcome());
            outlived |= outcome.is_some();
            let after = match &outcome {
                Some(outcome) => format!("after the job ended: {outcome}"),
                None => "the job goes on without it".into(),
            };
            eprintln!(
                "burn-ddp run: rank {rank} (member {member}, pid {pid}) {}; {after}",
                describe(status)
            );
            let finished = ended
                .iter()
                .any(|(_, r)| r.exit.is_some_and(|s| s.success()));
            if replacements >= ft.max_restarts || finished || outcome.is_some() {
                continue;
            }
            let fresh = match fresh_member_id(&store) {
                Ok(id) => id,
                Err(e) => {
                    eprintln!("burn-ddp run: no replacement for member {member}: {e}");
                    continue;
                }
            };
            replacements += 1;
            eprintln!(
                "burn-ddp run: starting member {fresh} in its place (local rank {local}; \
                 replacement {replacements} of {}); it joins the running job",
                ft.max_restarts
            );
            match spawn::start_rank(job, local, rank, &common(fresh, true)) {
                Ok(running) => slots.push(Slot {
                    local,
                    member: fresh,
                    running,
                    stopping: None,
                }),
                Err(e) => eprintln!("burn-ddp run: {e}"),
            }
        }
        if slots.is_empty() {
            break;
        }
        let stop = job.stop.as_ref().is_some_and(|s| s.load(Ordering::SeqCst));
        if stop && term_sent.is_none() {
            interrupted = true;
            for s in &slots {
                spawn::signal(&s.running.child, crate::sys::Signal::Term);
                spawn::signal(&s.running.child, crate::sys::Signal::Cont);
            }
            term_sent = Some(Instant::now());
        }
        if term_sent.is_some_and(|t| t.elapsed() >= job.grace) {
            for s in &mut slots {
                let _ = s.running.child.kill();
            }
        }
        // A rank the job no longer waits for is stopped: the launcher never waits for ever.
        if term_sent.is_none() && looked.elapsed() >= Duration::from_secs(1) {
            looked = Instant::now();
            if let Ok(Some(m)) = last_membership(&store) {
                let late = watch.late(&m);
                for s in slots.iter_mut().filter(|s| s.stopping.is_none()) {
                    if let Some(stop) = must_stop(s.member, &m, late) {
                        eprintln!(
                            "burn-ddp run: rank {} (member {}, pid {}) {}; stopping it",
                            s.running.rank,
                            s.member,
                            s.running.child.id(),
                            stop.why
                        );
                        outlived |= stop.outlived;
                        spawn::signal(&s.running.child, crate::sys::Signal::Cont);
                        spawn::signal(&s.running.child, crate::sys::Signal::Term);
                        s.stopping = Some(Instant::now());
                    }
                }
            }
        }
        for s in &mut slots {
            if s.stopping.is_some_and(|t| t.elapsed() >= job.grace) {
                let _ = s.running.child.kill();
            }
        }
        std::thread::sleep(Duration::from_millis(100));
    }

    // Node 0 serves the store: it stays up until the job's last members have all ended.
    if serving && !interrupted {
        let mut said = Instant::now();
        let mut watch = EndWatch::default();
        loop {
            match last_membership(&store) {
                Ok(Some(m)) if !m.members.is_empty() && !m.ended.iter().all(|d| *d) => {
                    if watch.late(&m) {
                        let waiting: Vec<u32> = m
                            .members
                            .iter()
                            .zip(&m.ended)
                            .filter(|(_, e)| !**e)
                            .map(|(id, _)| *id)
                            .collect();
                        eprintln!(
                            "burn-ddp run: members {} have not ended {ENDING_LIMIT:?} after the \
                             others of the last membership: stopping the job's store",
                            ids(&waiting)
                        );
                        break;
                    }
                    if said.elapsed() >= Duration::from_secs(30) {
                        said = Instant::now();
                        eprintln!(
                            "burn-ddp run: this node's ranks have ended; serving the job's \
                             store until its other members end"
                        );
                    }
                }
                _ => {
                    // The other nodes' launchers read how the job ended from this store.
                    std::thread::sleep(OUTCOME_GRACE);
                    break;
                }
            }
            if job.stop.as_ref().is_some_and(|s| s.load(Ordering::SeqCst)) {
                interrupted = true;
                break;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    let last = last_membership(&store);
    let exits: Vec<(u32, RankExit)> = ended.into_iter().map(|(m, r)| (m, r.into_exit())).collect();
    let ours: Vec<u32> = exits.iter().map(|(m, _)| *m).collect();
    // Unknown (the store lost): counted as let in, so that a loss is never taken for success.
    let admitted = any_admitted(&store, &ours).unwrap_or(true);
    let failure = judge(&exits, &last, admitted, outlived, interrupted);
    Ok(FaultTolerantReport {
        exits,
        last: last.ok().flatten().map(|m| (m.epoch, m.members)),
        replacements,
        failure,
    })
}

/// This launcher's connection to the job's store, tried until `until`.
fn connect(job: &LocalJob, until: Instant) -> Result<StoreClient> {
    let world = job.nproc_per_node * job.nnodes;
    StoreClient::connect(
        &job.master,
        Purpose::StoreAux,
        Rank(job.node_rank * job.nproc_per_node),
        WorldSize::new(world).unwrap_or(WorldSize::ONE),
        &job.token,
        STORE_REQUEST,
        until,
    )
}

/// A launcher that starts the first processes of a job (not `--join`): the job must not be
/// running yet (its first member ids would be taken twice, and a job that formed without this
/// node's ranks never admits them) and must have been started with the same world size.
fn check_first_launch(store: &StoreClient, job: &LocalJob) -> Result<()> {
    let world = job.nproc_per_node * job.nnodes;
    let first = record_first_world(store, world)?;
    let running = last_membership(store)?;
    let mut reasons = Vec::new();
    if let Some(m) = &running {
        reasons.push(format!(
            "the job is already running (membership epoch {}, members {})",
            m.epoch,
            ids(&m.members)
        ));
    }
    if first != world {
        reasons.push(format!(
            "the job started with a world of {first}, and this launcher's --nnodes {} × \
             --nproc-per-node {} makes {world}",
            job.nnodes, job.nproc_per_node
        ));
    }
    if reasons.is_empty() {
        return Ok(());
    }
    let from = job.node_rank * job.nproc_per_node;
    Err(DdpError::Membership(MembershipError::NotThisJob {
        first: from,
        last: from + job.nproc_per_node.saturating_sub(1),
        reason: reasons.join("; "),
    }))
}

/// This node's verdict: its ranks in the job's last membership must all have succeeded. A node
/// with none there succeeds with a job that finished when none of its processes was ever let in
/// (`admitted` false: they asked to join a job whose training was over), or when one of them was
/// still alive when the job ended and failed or was stopped only after (`outlived`: left out, cut
/// off or frozen past the heartbeat bound, it asked to join again after training, or was still
/// frozen at the end): it was not needed.
fn judge(
    exits: &[(u32, RankExit)],
    last: &Result<Option<LastMembership>>,
    admitted: bool,
    outlived: bool,
    interrupted: bool,
) -> Option<DdpError> {
    if interrupted {
        return Some(DdpError::Job(JobError::Interrupted));
    }
    let ends = || {
        exits
            .iter()
            .map(|(m, e)| format!("rank {} (member {m}) {}", e.rank, describe(e.status)))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let first_failure = || {
        exits
            .iter()
            .find(|(_, e)| !e.status.success())
            .map(|(m, e)| {
                DdpError::Membership(MembershipError::FaultTolerantJob {
                    reason: format!(
                        "rank {} (member {m}) {} before the job formed its first membership",
                        e.rank,
                        describe(e.status)
                    ),
                })
            })
    };
    let members = match last {
        Ok(Some(m)) => &m.members,
        Ok(None) => return first_failure(),
        Err(e) => {
            return Some(DdpError::Membership(MembershipError::FaultTolerantJob {
                reason: format!(
                    "this node lost the job's store ({e}); its ranks: {}",
                    ends()
                ),
            }))
        }
    };
    let mine: Vec<&(u32, RankExit)> = exits.iter().filter(|(m, _)| members.contains(m)).collect();
    if let Some((m, e)) = mine.iter().find(|(_, e)| !e.status.success()) {
        return Some(DdpError::Membership(MembershipError::FaultTolerantJob {
            reason: format!(
                "rank {} (member {m}), a member of the job's last membership, {}",
                e.rank,
                describe(e.status)
            ),
        }));
    }
    let finished_well = || {
        last.as_ref()
            .is_ok_and(|m| m.as_ref().is_some_and(|m| m.finished_well()))
    };
    if mine.is_empty() {
        if (!admitted || outlived) && finished_well() {
            let how = if admitted {
                "while this node's processes were out of it (left out after a fault, they were \
                 still frozen or asking to join again when its training was over)"
            } else {
                "before this node's processes were let in (they asked to join after its \
                 training was over)"
            };
            eprintln!(
                "burn-ddp run: the job finished with members {members:?} {how}; nothing was \
                 left for them to do ({})",
                ends()
            );
            return None;
        }
        return Some(DdpError::Membership(MembershipError::FaultTolerantJob {
            reason: format!(
                "every rank of this node was lost; the job went on with members {members:?} \
                 ({})",
                ends()
            ),
        }));
    }
    let lost: Vec<String> = exits
        .iter()
        .filter(|(m, e)| !members.contains(m) && !e.status.success())
        .map(|(m, e)| format!("member {m} {}", describe(e.status)))
        .collect();
    if !lost.is_empty() {
        eprintln!(
            "burn-ddp run: the job finished with members {members:?}; lost on the way: {}",
            lost.join(", ")
        );
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::process::ExitStatusExt;

    fn exit(rank: u32, raw: i32) -> RankExit {
        RankExit {
            rank: Rank(rank),
            status: ExitStatusExt::from_raw(raw),
            stopped: false,
            output: String::new(),
        }
    }

    /// A job that finished well with members 0 and 1.
    fn finished() -> Result<Option<LastMembership>> {
        Ok(Some(LastMembership {
            epoch: 4,
            members: vec![0, 1],
            ended: vec![true, true],
            finished: vec![true, true],
        }))
    }

    /// A node whose one process (member 2) was let in, left out after a fault, and failed when
    /// it asked to join again after the job had finished: the node succeeds when that failure
    /// came after the job's end (`outlived`), and fails when its process was lost before.
    /// (The chaos run on etcd found this: a node whose link was cut near the end of training
    /// failed, saying "every rank of this node was lost", in a job that finished.)
    #[test]
    fn a_node_left_out_that_fails_only_after_the_job_finished_succeeds() {
        let exits = [(2, exit(2, 1 << 8))];
        assert!(judge(&exits, &finished(), true, true, false).is_none());
        let lost = judge(&exits, &finished(), true, false, false).expect("a failure");
        assert!(
            lost.to_string()
                .contains("every rank of this node was lost"),
            "{lost}"
        );
        // Never let in: not needed, as before.
        assert!(judge(&exits, &finished(), false, false, false).is_none());
        // A job that failed is no success for anyone.
        let failed = Ok(Some(LastMembership {
            finished: vec![false, false],
            ..finished().unwrap().unwrap()
        }));
        assert!(judge(&exits, &failed, true, true, false).is_some());
        // A member of the last membership that failed fails its node.
        let member = [(1, exit(1, 1 << 8))];
        assert!(judge(&member, &finished(), true, true, false).is_some());
    }

    /// The launcher stops a process the finished job did not include (frozen past its end, or
    /// still waiting to join) as one that outlived the job, so its node succeeds; a member of
    /// the last membership that has not ended late after the others is stopped as a failure.
    /// (The chaos run on etcd found this: a node whose rank was frozen, left out and still
    /// frozen when training ended failed, saying "every rank of this node was lost".)
    #[test]
    fn a_process_stopped_because_the_job_ended_without_it_outlived_the_job() {
        let done = finished().unwrap().unwrap();
        let stop = must_stop(2, &done, false).expect("stopped");
        assert!(
            stop.outlived && stop.why.contains("did not include it"),
            "{}",
            stop.why
        );
        let stopped = [(2, exit(2, libc::SIGTERM))];
        assert!(judge(&stopped, &finished(), true, stop.outlived, false).is_none());
        assert!(
            must_stop(1, &done, true).is_none(),
            "a member that ended is not stopped"
        );
        let running = LastMembership {
            ended: vec![true, false],
            finished: vec![true, false],
            ..done.clone()
        };
        assert!(must_stop(1, &running, false).is_none(), "not late yet");
        let late = must_stop(1, &running, true).expect("stopped");
        assert!(
            !late.outlived && late.why.contains("frozen?"),
            "{}",
            late.why
        );
        let unfinished = LastMembership {
            ended: vec![false, false],
            finished: vec![false, false],
            ..done
        };
        assert!(
            must_stop(2, &unfinished, false).is_none(),
            "the job goes on: it may join"
        );
    }
}
