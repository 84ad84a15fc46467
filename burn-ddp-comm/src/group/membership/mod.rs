//! Fault-tolerant groups: a job that loses ranks and goes on without restarting anyone, and
//! takes in new processes while it runs (torchft's model, on a store the launcher serves).
//!
//! The job's store outlives every rank: `burn-ddp run --fault-tolerant` serves it (a
//! *lighthouse*, `StoreServer::bind_lighthouse`). Each process has a **member id** for the
//! job's life and one *presence* connection to the store; when its process dies, the store
//! records the id as gone at once. The ranks of a job form a sequence of **membership epochs**:
//! epoch `e` is a list of member ids (rank `r` of the epoch is the `r`-th), with a world group
//! of its own whose store keys and abort record lie under the scope `ft/<e>`, so that ending an
//! epoch stops its rings and its waits and nothing else.
//!
//! **Losing ranks.** A rank whose collective fails because of a peer ([`DdpError::is_peer_failure`])
//! calls [`ProcessGroup::recover`]: it ends epoch `e` (the scope's first abort record says why
//! and blames a rank, if one was named), which stops every other rank's collectives of that
//! epoch within one heartbeat interval, so they recover too. Each checks in for `e + 1`.
//! The **rule** that decides epoch `e + 1`, applied by whichever decider gets there first and
//! recorded once by compare-and-set in the store (the store is the one arbiter: a rank that
//! cannot reach it is out, whatever it sees). Every member of a membership of up to 15 is a
//! decider; in larger ones eight, spread over it (each decider reads every member's keys at
//! every poll), and the others wait on the decision, applying the rule themselves only once
//! the deciders took twice the heartbeat bound:
//!
//! - the members of `e` that checked in, in their order, then the processes waiting to join,
//!   by id, minus the members the store saw go (their presence connection closed) and the rank
//!   that the end of `e` blamed (a dead, frozen or cut-off rank; when two ranks blame each
//!   other, the first report wins, so the job goes on with one side);
//! - decided as soon as every other member of `e` has checked in or is gone or blamed, or
//!   when the heartbeat bound has passed since this rank checked in (a live rank is told of
//!   the end within one heartbeat interval);
//! - never with fewer than [`FaultTolerance::min_ranks`] ranks: below it the survivors wait
//!   for joiners, up to the rendezvous timeout ([`MembershipError::TooFewRanks`](crate::MembershipError::TooFewRanks));
//! - a rank that is blamed waits for the bound before it proposes, so that the others, if
//!   they can reach the store, decide without it.
//!
//! A process left out ([`MembershipError::Excluded`](crate::MembershipError::Excluded): blamed, or too slow) may join again
//! ([`ProcessGroup::rejoin`]). The members then open the epoch's ring among themselves and
//! exchange their **progress** (a number the caller gives, e.g. its count of optimizer
//! steps): the rank with the most is the source of the state that the ranks behind it adopt
//! ([`Recovery::behind`]). A failure during any of this ends that epoch too, and the rule runs
//! again.
//!
//! **Growing.** A new process ([`FaultTolerance::join`]) checks in for the next epoch and bumps
//! a counter that every member's watcher reads each interval ([`ProcessGroup::join_pending`]);
//! the members agree at a step boundary (a collective of their own) to call
//! [`ProcessGroup::grow`], which ends the epoch without blaming anyone; the newcomer is in the
//! next epoch and is behind (it has no state), so it receives the source's.
//!
//! The module's files: `rule.rs`, the membership rule alone (pure: what a rank proposes from
//! what the store shows); `record.rs`, the store protocol (the keys, their encodings, the
//! first world size, member ids, the last membership for the launcher); `watch.rs`, the
//! thread that notices processes asking to join; this file, the service that runs the rule
//! through the store and rebuilds the group.

mod group;
pub(crate) mod marker;
mod record;
mod rule;
mod watch;

use crate::error::{MembershipError, RendezvousError};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::{GroupState, Inner, ProcessGroup, StoreHost};
use crate::config::{FaultTolerance, GroupConfig};
use crate::periodic::Periodic;
use crate::store::auth::Purpose;
use crate::store::{StoreClient, WaitOutcome};
use crate::types::{AbortRecord, LocalRank, Rank, WorldSize};
use crate::{DdpError, Result};
pub(crate) use marker::marked as marked_rank;
#[cfg(test)]
pub(crate) use marker::marker as marker_line;
use record::ids_handed_out;
pub(crate) use record::{
    any_admitted, fresh_member_id, last_membership, member_list, record_first_world, LastMembership,
};
use record::{decode, encode, first_world, get_now, get_within, keys};
use rule::{minus, Ballot};
use watch::{watch_joins, JoinWatch};

/// How often a rank waiting on the store for a membership decision looks again.
const POLL: Duration = Duration::from_millis(20);
/// How often a rank waiting for a membership says who it waits for.
const SAY_EVERY: Duration = Duration::from_secs(5);

/// The longest a decider waits, between two reads of a ballot of `members` members, on the
/// check-ins it still misses (woken when they come): [`POLL`] for a few members, up to a second
/// for thousands, so that the deciders' reads stay about 2,000 keys a second each whatever the
/// size (every 20 ms, 8 deciders of 1,024 members read 800,000 keys a second, and the etcd
/// cluster stopped answering other requests within their bound).
fn ballot_wait(members: usize) -> Duration {
    (POLL / 40 * members as u32).clamp(POLL, Duration::from_secs(1))
}

/// What a change of membership did, on this rank.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Recovery {
    /// The new membership epoch.
    pub epoch: u64,
    /// Its members' ids, by rank.
    pub members: Vec<u32>,
    /// The members of the epoch before (empty for a process that joined).
    pub previous: Vec<u32>,
    /// Members that left.
    pub left: Vec<u32>,
    /// Members that joined.
    pub joined: Vec<u32>,
    /// Why the epoch before ended.
    pub reason: String,
    /// This process's rank in the new epoch.
    pub rank: Rank,
    /// The new world size.
    pub world: WorldSize,
    /// The rank whose state is the job's: the most progress, the lowest rank among equals.
    pub source: Rank,
    /// The ranks with less progress than the source's (a joining process's included): they
    /// take the source's state.
    pub behind: Vec<Rank>,
    /// The source's progress.
    pub progress: u64,
    /// From the call to the new group's first collective.
    pub took: Duration,
}

impl Recovery {
    /// Whether this rank must take the source's state.
    pub fn needs_state(&self) -> bool {
        self.behind.contains(&self.rank)
    }

    /// One line for logs and dashboards: who left and joined, the new world size, why.
    pub fn summary(&self) -> String {
        let ids = member_list;
        if self.previous.is_empty() {
            return format!(
                "membership epoch {}: this process joined the running job as rank {} of {} \
                 (members {}); it takes the state of rank {} at progress {}; {:.0?} after: {}",
                self.epoch,
                self.rank,
                self.world,
                ids(&self.members),
                self.source,
                self.progress,
                self.took,
                self.reason
            );
        }
        format!(
            "membership epoch {}: world size {} (was {}); left: {}; joined: {}; resumed at \
             progress {} from rank {}; {:.0?} after: {}",
            self.epoch,
            self.world,
            self.previous.len(),
            ids(&self.left),
            ids(&self.joined),
            self.progress,
            self.source,
            self.took,
            self.reason
        )
    }
}

/// A fault-tolerant process's membership service: its member id, its connections to the job's
/// store, the current epoch, and the watcher that notices processes asking to join.
pub(super) struct MembershipService {
    id: u32,
    /// The process's settings (rank and world size are those it was started with).
    config: GroupConfig,
    min_ranks: u32,
    /// The world size the job was started with: joining processes took ids from it on.
    initial_world: u32,
    /// The store without a scope, for the membership's keys: its requests are bounded by the
    /// heartbeat bound (at least 5 s), so that a process cut off from the store knows it soon.
    store: Arc<StoreClient>,
    /// The store for users' keys (they outlive memberships), with the store timeout.
    user: Arc<StoreClient>,
    /// This process's presence: the store marks the id gone when it closes unannounced.
    presence: StoreClient,
    current: Mutex<Epoch>,
    /// One change of membership at a time.
    changing: Mutex<()>,
    joins: Arc<JoinWatch>,
    watcher: Option<Periodic>,
    /// A joining process's admission, for the caller to take.
    admission: Mutex<Option<Recovery>>,
    /// Training is over ([`ProcessGroup::close_joins`]): the memberships this process decides
    /// let no process in (a joiner would start training while the members evaluate).
    closed: std::sync::atomic::AtomicBool,
    /// The process ends with a failure ([`ProcessGroup::mark_failed`]): it leaves the job
    /// without being recorded as finished.
    failed: std::sync::atomic::AtomicBool,
}

impl std::fmt::Debug for MembershipService {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MembershipService")
            .field("id", &self.id)
            .field("epoch", &self.epoch().0)
            .finish()
    }
}

#[derive(Debug, Clone)]
struct Epoch {
    number: u64,
    members: Vec<u32>,
}

impl Drop for MembershipService {
    fn drop(&mut self) {
        // Finished: it ended without a panic or an error. A process that failed only leaves
        // (gone), so the job's record does not count it as one that finished.
        if !std::thread::panicking() && !self.failed.load(Ordering::SeqCst) {
            let _ = self
                .store
                .set_bounded(&keys::finished(self.id), b"1", Duration::from_secs(2));
        }
        self.watcher = None;
        self.presence.bye(Duration::from_secs(2));
        self.store.bye(Duration::from_secs(2));
        self.user.bye(Duration::from_secs(2));
    }
}

/// Starts a fault-tolerant process: joins the store, then forms the job's first epoch with
/// the others, or waits to be admitted into the running job.
pub(super) fn start(config: GroupConfig, ft: FaultTolerance) -> Result<ProcessGroup> {
    let started = Instant::now();
    let deadline = started + config.timeouts.rendezvous;
    let connect = |purpose, rank| {
        StoreClient::connect(
            &config.master,
            purpose,
            rank,
            config.world_size,
            &config.token,
            config.timeouts.store,
            deadline,
        )
    };
    let store = connect(Purpose::StoreAux, config.rank).map_err(|e| match e {
        DdpError::Rendezvous(RendezvousError::MasterUnreachable {
            rank,
            addr,
            waited,
            last_error,
        }) => DdpError::Rendezvous(RendezvousError::MasterUnreachable {
            rank,
            addr: format!(
                "{addr} (a fault-tolerant job meets at the store its launcher serves: start it \
                 with `burn-ddp run --fault-tolerant`)"
            ),
            waited,
            last_error,
        }),
        e => e,
    })?;
    let formed = matches!(
        store.wait(&[keys::members(0)], Duration::ZERO)?,
        WaitOutcome::Ready
    );
    let join = ft.join || formed;
    let initial_world = if join {
        first_world(&store)?
    } else {
        record_first_world(&store, config.world_size.get())?
    };
    if !join && initial_world != config.world_size.get() {
        return Err(DdpError::Rendezvous(RendezvousError::WorldSizeMismatch {
            rank: config.rank,
            other: Rank::ZERO,
            ours: config.world_size,
            theirs: WorldSize::new(initial_world).unwrap_or(WorldSize::ONE),
        }));
    }
    let id = match ft.member {
        Some(id) => id,
        None if join => fresh_member_id(&store)?,
        None => config.rank.0,
    };
    if let (true, Some(id)) = (join, ft.member) {
        // Only ids the job handed out are ever admitted (the rule reads the known ids): any
        // other would ask to join for ever, ending a membership epoch at each request.
        let handed = ids_handed_out(&store)?;
        if id >= initial_world.saturating_add(handed) {
            return Err(DdpError::Membership(MembershipError::JoinFailed {
                member: id,
                waited: started.elapsed(),
                why: format!(
                    "member id {id} is not one of the running job's (it started with {} \
                     processes, ids 0..{initial_world}, and handed {} more to joining ones): a \
                     process that joins takes a fresh id. Leave BURN_DDP_MEMBER_ID unset, or \
                     start it with `burn-ddp run --fault-tolerant --join`",
                    initial_world, handed
                ),
            }));
        }
    }
    if formed && !ft.join {
        tracing::warn!(
            "[member {id}] the job was already running: this process joins it (as \
             BURN_DDP_FT_JOIN=1 would)"
        );
    }
    let presence = connect(Purpose::Store, Rank(id))?;
    let user = connect(Purpose::StoreAux, config.rank)?;
    let quick = config
        .timeouts
        .heartbeat
        .max(Duration::from_secs(5))
        .min(config.timeouts.store);
    let store = Arc::new(
        store
            .with_request_timeout(quick)
            .with_reply_slack(Duration::from_secs(2)),
    );
    let user = Arc::new(user);
    let joins = Arc::new(JoinWatch::default());
    let watcher = watch_joins(&config, Arc::clone(&joins), id, deadline);
    let service = MembershipService {
        id,
        min_ranks: ft.min_ranks,
        initial_world,
        store,
        user,
        presence,
        current: Mutex::new(Epoch {
            number: 0,
            members: Vec::new(),
        }),
        changing: Mutex::new(()),
        joins,
        watcher,
        admission: Mutex::new(None),
        closed: std::sync::atomic::AtomicBool::new(false),
        failed: std::sync::atomic::AtomicBool::new(false),
        config,
    };
    if join {
        let (epoch, members) = service.admit(deadline)?;
        let inner = service.connect_epoch(epoch, &members, deadline)?;
        let group = ProcessGroup::with_membership(inner, service);
        let e = group.service()?;
        let recovery = e.exchange_progress(
            &group,
            epoch,
            Vec::new(),
            members,
            None,
            "it asked to join".into(),
            started,
        );
        let recovery = match recovery {
            Ok(r) => r,
            Err(err) => {
                // The first collective of the new epoch failed: the members recover, and so
                // does this process, still without state.
                group.recover(&err, None)?
            }
        };
        *e.admission.lock().unwrap_or_else(|p| p.into_inner()) = Some(recovery);
        return Ok(group);
    }
    let members = service.form_first(deadline)?;
    let inner = service.connect_epoch(0, &members, deadline)?;
    Ok(ProcessGroup::with_membership(inner, service))
}

impl MembershipService {
    /// The store for users' keys (they outlive memberships).
    pub(super) fn store(&self) -> Arc<StoreClient> {
        Arc::clone(&self.user)
    }

    fn epoch(&self) -> (u64, Vec<u32>) {
        let e = self.current.lock().unwrap_or_else(|p| p.into_inner());
        (e.number, e.members.clone())
    }

    fn host(&self) -> Vec<u8> {
        super::heartbeat::host_name().into_bytes()
    }

    /// Epoch 0: every process the job was started with, in `RANK` order.
    fn form_first(&self, deadline: Instant) -> Result<Vec<u32>> {
        let started = Instant::now();
        let world = self.initial_world;
        self.store.set(&keys::checkin(0, self.id), &self.host())?;
        // Arrivals are counted: a wait on one key, not on every process's (a wait on n keys
        // of each of n processes, and on etcd a watch of each key: 65,000 watches made one by
        // one for 256 processes).
        let all = [self.store.arrive(keys::first_arrivals(), world)?];
        let keys: Vec<String> = (0..world).map(|r| keys::checkin(0, r)).collect();
        let first: Vec<u32> = (0..world).collect();
        // Once the count is full, the deciders (a few, spread) read every check-in and decide;
        // the others wait on the decision, one key (every process reading every check-in is
        // n² keys: 1,024 processes on etcd took longer than a request's bound). A process that
        // waited twice SAY_EVERY on the decision decides too.
        let decider = is_decider(&first, self.id);
        let mut full: Option<Instant> = None;
        let decision = [keys::members(0)];
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let slice = left.min(SAY_EVERY);
            let outcome = match self.store.wait(&all, slice)? {
                WaitOutcome::Ready => {
                    let since = *full.get_or_insert_with(Instant::now);
                    if decider || since.elapsed() >= SAY_EVERY * 2 {
                        // Every key is read once the count is full (a process restarted before
                        // the job formed counts twice and must not stand for one that never
                        // came), waited on while one is missing.
                        self.store.wait(&keys, slice)?
                    } else {
                        match self.store.wait(&decision, slice)? {
                            WaitOutcome::Ready => break,
                            WaitOutcome::Missing(_) if left > SAY_EVERY => continue,
                            // At the deadline: who is missing, to say so.
                            WaitOutcome::Missing(_) => self.store.wait(&keys, Duration::ZERO)?,
                        }
                    }
                }
                // Who is missing, to say so (the count is short: a process did not start).
                WaitOutcome::Missing(_) => self.store.wait(&keys, Duration::ZERO)?,
            };
            match outcome {
                WaitOutcome::Ready => break,
                WaitOutcome::Missing(missing) if left > SAY_EVERY => tracing::warn!(
                    "[member {}] waiting for {} of the job's {world} processes to start ({:.0?} \
                     so far): {}",
                    self.id,
                    missing.len(),
                    started.elapsed(),
                    missing.join(", ")
                ),
                WaitOutcome::Missing(missing) => {
                    return Err(DdpError::Rendezvous(RendezvousError::RendezvousTimeout {
                        rank: self.config.rank,
                        addr: self.config.master.to_string(),
                        waited: started.elapsed(),
                        joined: keys.len() - missing.len(),
                        world: self.config.world_size,
                        missing: crate::types::RankList(
                            (0..world)
                                .filter(|r| missing.contains(&keys::checkin(0, *r)))
                                .map(Rank)
                                .collect(),
                        ),
                        refused_note: String::new(),
                    }))
                }
            }
        }
        let decided = self
            .store
            .compare_set(&keys::members(0), None, &encode(&first))?;
        let members = decode(&decided)
            .filter(|m| !m.is_empty())
            .ok_or_else(|| self.corrupt("the first membership"))?;
        self.raise_epoch(0)?;
        self.begin(0, members.clone())?;
        Ok(members)
    }

    fn corrupt(&self, what: &str) -> DdpError {
        DdpError::Rendezvous(RendezvousError::StoreRequest {
            rank: Rank(self.id),
            op: "get",
            key: what.to_owned(),
            reason: "the store holds something that is not a member list (another burn-ddp \
                     version, or another program writing under ft/)"
                .into(),
        })
    }

    /// `e`, or, when it says the store did not answer, that this process is cut off.
    fn cut_off(&self, e: DdpError) -> DdpError {
        let reason = match &e {
            DdpError::Rendezvous(RendezvousError::StoreLost { source, .. }) => source.to_string(),
            DdpError::Rendezvous(RendezvousError::StoreTimeout { op, waited, .. }) => {
                format!("a store {op} got no reply within {waited:?}")
            }
            _ => return e,
        };
        let master = &self.config.master;
        let (addr, meaning) = match master.etcd {
            Some(_) => (
                format!("the {master}"),
                "this process is cut off from a majority of its members (or a majority is \
                 down), and the job goes on without it",
            ),
            None => (
                format!("at {master}, which node 0's launcher serves"),
                "either this process is cut off from it, and the job goes on without it, or \
                 node 0's launcher is gone, and the job with it (the launcher's store does not \
                 survive its host; --rdzv-backend etcd does)",
            ),
        };
        DdpError::Membership(MembershipError::StoreUnreachable {
            member: self.id,
            addr,
            reason,
            meaning: meaning.into(),
        })
    }

    /// Makes `number` the current epoch (this process is let into the job: the first
    /// membership, or a join), and starts counting join requests from now.
    fn begin(&self, number: u64, members: Vec<u32>) -> Result<()> {
        // Its launcher tells a node whose processes were never let in from one that lost them.
        self.store.set(&keys::admitted(self.id), b"1")?;
        let joins = self.joins_now()?;
        self.joins.seen.store(joins, Ordering::SeqCst);
        self.joins.pending.store(false, Ordering::SeqCst);
        *self.current.lock().unwrap_or_else(|p| p.into_inner()) = Epoch { number, members };
        Ok(())
    }

    fn joins_now(&self) -> Result<i64> {
        // A counter read by adding 0: one request on etcd too (a `get` of it takes two there).
        self.store.add(keys::JOINS, 0)
    }

    /// Records that epoch `e` was decided, unless a later one was.
    fn raise_epoch(&self, e: u64) -> Result<()> {
        loop {
            let now = get_now(&self.store, keys::EPOCH)?;
            let current = now
                .as_deref()
                .and_then(|v| std::str::from_utf8(v).ok()?.parse::<u64>().ok());
            if current.is_some_and(|c| c >= e) {
                return Ok(());
            }
            let mine = e.to_string().into_bytes();
            let after = self.store.compare_set(keys::EPOCH, now.as_deref(), &mine)?;
            if after == mine {
                return Ok(());
            }
        }
    }

    /// The newest decided epoch (0 when the job has formed its first one).
    fn latest_epoch(&self) -> Result<Option<u64>> {
        Ok(get_now(&self.store, keys::EPOCH)?
            .and_then(|v| std::str::from_utf8(&v).ok().and_then(|t| t.parse().ok())))
    }

    /// The members of epoch `e`, if decided.
    fn decided(&self, e: u64) -> Result<Option<Vec<u32>>> {
        self.decided_within(e, Duration::ZERO)
    }

    /// [`Self::decided`], waiting up to `wait` for the decision (woken when it is made).
    fn decided_within(&self, e: u64, wait: Duration) -> Result<Option<Vec<u32>>> {
        match get_within(&self.store, &keys::members(e), wait)? {
            Some(v) => decode(&v)
                .map(Some)
                .ok_or_else(|| self.corrupt(&keys::members(e))),
            None => Ok(None),
        }
    }

    /// Which of `keys` the store holds.
    fn present(&self, keys: &[String]) -> Result<Vec<bool>> {
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        Ok(match self.store.wait(keys, Duration::ZERO)? {
            WaitOutcome::Ready => vec![true; keys.len()],
            WaitOutcome::Missing(missing) => keys.iter().map(|k| !missing.contains(k)).collect(),
        })
    }

    /// Whether every member of the newest epoch finished normally or is gone: the job is over.
    fn job_over(&self) -> Result<Option<String>> {
        Ok(last_membership(&self.store)?.and_then(|m| m.outcome()))
    }

    /// Every member id handed out so far: the first processes' and the joining ones' (a
    /// process left out of a membership may ask to join again under its id).
    fn known_ids(&self) -> Result<Vec<u32>> {
        let n = ids_handed_out(&self.store)?;
        Ok((0..self.initial_world.saturating_add(n)).collect())
    }

    /// The store's view of the epoch after `members` (`next`): no joiners once this process
    /// closed the job to them.
    fn ballot(&self, next: u64, members: &[u32]) -> Result<Ballot> {
        let joiners: Vec<u32> = if self.closed.load(Ordering::SeqCst) {
            Vec::new()
        } else {
            minus(&self.known_ids()?, members)
        };
        let everyone: Vec<u32> = members.iter().chain(&joiners).copied().collect();
        let mut keys: Vec<String> = everyone.iter().map(|m| keys::checkin(next, *m)).collect();
        keys.extend(everyone.iter().map(|m| crate::store::gone_key(Rank(*m))));
        let present = self.present(&keys)?;
        let n = everyone.len();
        let (checked, gone) = present.split_at(n);
        let status = |i: usize| (checked[i], gone[i]);
        let mut ballot = Ballot {
            checked: Vec::new(),
            missing: Vec::new(),
            joiners: Vec::new(),
        };
        for (i, m) in everyone.iter().enumerate() {
            match (i < members.len(), status(i)) {
                (_, (_, true)) => {}
                (true, (true, false)) => ballot.checked.push(*m),
                (true, (false, false)) => ballot.missing.push(*m),
                (false, (true, false)) => ballot.joiners.push(*m),
                (false, (false, false)) => {}
            }
        }
        ballot.joiners.sort_unstable();
        Ok(ballot)
    }

    /// The member blamed for the end of epoch `e` (its abort record's culprit), if any.
    fn blamed(&self, e: u64, members: &[u32]) -> Result<(Option<u32>, String)> {
        Ok(match self.store.scope_record(&keys::scope(e))? {
            Some(r) => (
                r.culprit
                    .filter(|c| *c != r.reporter || members.len() == 1)
                    .and_then(|c| members.get(c.index()).copied()),
                r.reason,
            ),
            None => (None, String::from("no reason recorded")),
        })
    }

    /// Whether this process's current epoch has ended (a rank recorded its end) or the store
    /// does not answer (a process cut off from the store is out of the job, whatever it sees).
    fn current_ended(&self) -> bool {
        let (e, _) = self.epoch();
        !matches!(self.store.scope_record(&keys::scope(e)), Ok(None))
    }

    /// `Ok` while this process's current epoch stands; [`MembershipError::Superseded`] (with
    /// `what`, and the reason recorded) once a rank recorded its end; the store's error when it
    /// does not answer.
    fn current_stands(&self, what: &str) -> Result<()> {
        let (e, _) = self.epoch();
        match self.store.scope_record(&keys::scope(e))? {
            None => Ok(()),
            Some(record) => Err(DdpError::Membership(MembershipError::Superseded {
                member: self.id,
                epoch: e,
                what: what.to_owned(),
                why: record.reason,
            })),
        }
    }

    /// Ends epoch `e` (its first record says why; its rings and waits stop).
    fn end(&self, e: u64, rank: Rank, culprit: Option<Rank>, reason: String) {
        let record = AbortRecord {
            reporter: rank,
            culprit,
            collective: None,
            reason,
        };
        if let Err(err) = self.store.end_scope(&keys::scope(e), record) {
            tracing::debug!(
                "[member {}] could not record the end of epoch {e}: {err}",
                self.id
            );
        }
    }

    /// Checks in for the epoch after `e` (members `members`) and waits until it is decided,
    /// applying the rule (module docs) itself when it gets there first.
    fn decide(&self, e: u64, members: &[u32], overall: Instant) -> Result<Vec<u32>> {
        let next = e + 1;
        let checked_in = Instant::now();
        self.store
            .set(&keys::checkin(next, self.id), &self.host())?;
        let window = self.config.timeouts.heartbeat;
        let (blamed, why) = self.blamed(e, members)?;
        let mut said = Instant::now();
        let decider = is_decider(members, self.id);
        loop {
            // The deciders read the ballot every POLL; the others wait on the decision (woken
            // when it is made), and decide too once the deciders took twice the window: each
            // ballot reads every member's keys, so n members polling it cost the store n² keys
            // a poll (a change among 1,024 ranks failed so: requests got no reply in time).
            let deciding = decider || checked_in.elapsed() >= window * 2;
            let wait = match deciding {
                true => Duration::ZERO,
                false => (window * 2)
                    .saturating_sub(checked_in.elapsed())
                    .min(overall.saturating_duration_since(Instant::now()))
                    // The client is this process's membership connection, which other
                    // threads ask too (`membership_ended`): held a second at most.
                    .min(Duration::from_secs(1)),
            };
            if let Some(decided) = self.decided_within(next, wait)? {
                if decided.contains(&self.id) {
                    return Ok(decided);
                }
                return Err(DdpError::Membership(MembershipError::Excluded {
                    member: self.id,
                    epoch: next,
                    members: decided,
                    why: if blamed == Some(self.id) {
                        format!("the end of epoch {e} was blamed on it: {why}")
                    } else {
                        format!(
                            "it checked in {:.0?} after the others decided (epoch {e} ended: \
                             {why})",
                            checked_in.elapsed()
                        )
                    },
                }));
            }
            if !deciding && Instant::now() < overall {
                continue;
            }
            let ballot = self.ballot(next, members)?;
            let passed = checked_in.elapsed() >= window;
            if let Some(proposal) = ballot.proposal(self.id, blamed, passed) {
                if proposal.len() >= self.min_ranks as usize {
                    let after =
                        self.store
                            .compare_set(&keys::members(next), None, &encode(&proposal))?;
                    let decided = decode(&after).ok_or_else(|| self.corrupt("a membership"))?;
                    if decided == proposal {
                        self.raise_epoch(next)?;
                    }
                    continue;
                }
                if Instant::now() >= overall {
                    return Err(DdpError::Membership(MembershipError::TooFewRanks {
                        member: self.id,
                        have: proposal.len(),
                        min: self.min_ranks,
                        why: format!("epoch {e} ended: {why}"),
                        waited: checked_in.elapsed(),
                    }));
                }
            }
            if Instant::now() >= overall {
                return Err(DdpError::Membership(MembershipError::JoinFailed {
                    member: self.id,
                    waited: checked_in.elapsed(),
                    why: format!(
                        "the next membership was not decided; still waiting for members {:?}",
                        ballot.missing
                    ),
                }));
            }
            if said.elapsed() >= SAY_EVERY {
                said = Instant::now();
                let mut state = vec![format!("checked in {:?}", ballot.checked)];
                if !ballot.missing.is_empty() {
                    state.push(format!("waiting for {:?}", ballot.missing));
                }
                if !ballot.joiners.is_empty() {
                    state.push(format!("joining {:?}", ballot.joiners));
                }
                let have = ballot.checked.len() + ballot.joiners.len();
                if ballot.missing.is_empty() && have < self.min_ranks as usize {
                    state.push(format!(
                        "{have} rank(s), fewer than the {} it needs (BURN_DDP_MIN_RANKS): \
                         waiting for processes to join",
                        self.min_ranks
                    ));
                }
                tracing::warn!(
                    "[member {}] epoch {e} ended ({why}); deciding epoch {next}: {}",
                    self.id,
                    state.join("; ")
                );
            }
            // Until the check-ins it misses come (the blamed member's is not awaited), at most
            // until the window passes.
            let missing: Vec<String> = ballot
                .missing
                .iter()
                .filter(|m| Some(**m) != blamed)
                .map(|m| keys::checkin(next, *m))
                .collect();
            let wait = ballot_wait(members.len() + ballot.joiners.len())
                .min(window.saturating_sub(checked_in.elapsed()))
                .max(POLL);
            if missing.is_empty() {
                std::thread::sleep(wait);
            } else {
                self.store.wait(&missing, wait)?;
            }
        }
    }

    /// A joining process: checks in for the epoch after the newest and asks to be let in, until
    /// a decided epoch holds it.
    fn admit(&self, deadline: Instant) -> Result<(u64, Vec<u32>)> {
        let started = Instant::now();
        let mut said = Instant::now();
        let mut asked_for: Option<u64> = None;
        loop {
            let Some(latest) = self.latest_epoch()? else {
                // The job has not formed yet.
                if Instant::now() >= deadline {
                    return Err(DdpError::Membership(MembershipError::JoinFailed {
                        member: self.id,
                        waited: started.elapsed(),
                        why: "the job never formed its first membership".into(),
                    }));
                }
                std::thread::sleep(POLL * 5);
                continue;
            };
            // The epoch this process asked for, if decided: in it, or ask for a later one.
            if let Some(asked) = asked_for {
                if let Some(members) = self.decided(asked)? {
                    if members.contains(&self.id) {
                        self.raise_epoch(asked)?;
                        self.begin(asked, members.clone())?;
                        return Ok((asked, members));
                    }
                    asked_for = None;
                }
            }
            let next = latest + 1;
            if asked_for.is_none() {
                self.store
                    .set(&keys::checkin(next, self.id), &self.host())?;
                self.store.add(keys::JOINS, 1)?;
                asked_for = Some(next);
                tracing::info!(
                    "[member {}] asks to join the running job (membership epoch {latest}); \
                     waiting for a step boundary",
                    self.id
                );
            }
            if let Some(outcome) = self.job_over()? {
                return Err(DdpError::Membership(MembershipError::JoinFailed {
                    member: self.id,
                    waited: started.elapsed(),
                    why: format!(
                        "{outcome} before it reached a step boundary that let this process in"
                    ),
                }));
            }
            if self.presence.presence_expired() {
                return Err(DdpError::Membership(MembershipError::JoinFailed {
                    member: self.id,
                    waited: started.elapsed(),
                    why: "its presence lease on the job's etcd cluster expired (this process \
                          was stopped or cut off for longer than the lease): the job counts \
                          it as gone for good and never lets it in again; its launcher starts \
                          a replacement when --max-restarts allows"
                        .into(),
                }));
            }
            if Instant::now() >= deadline {
                return Err(DdpError::Membership(MembershipError::JoinFailed {
                    member: self.id,
                    waited: started.elapsed(),
                    why: format!(
                        "the job (membership epoch {latest}) did not reach a step boundary that \
                         let this process in; its ranks may be stuck. Raise \
                         BURN_DDP_RENDEZVOUS_TIMEOUT if their steps are that long"
                    ),
                }));
            }
            if said.elapsed() >= SAY_EVERY {
                said = Instant::now();
                tracing::warn!(
                    "[member {}] still waiting to join the job ({:.0?})",
                    self.id,
                    started.elapsed()
                );
            }
            std::thread::sleep(POLL * 2);
        }
    }

    /// The world group of epoch `e` (members `members`) on this process.
    fn connect_epoch(&self, e: u64, members: &[u32], deadline: Instant) -> Result<Inner> {
        let position =
            members
                .iter()
                .position(|m| *m == self.id)
                .ok_or_else(|| DdpError::Internal {
                    rank: Rank(self.id),
                    what: "a membership without this process was opened",
                })?;
        let rank = Rank(position as u32);
        let world = WorldSize::try_from(members.len()).map_err(|_| DdpError::Internal {
            rank,
            what: "an empty membership was opened",
        })?;
        // The launcher's `[rank N]` prefix follows the rank this process has now.
        marker::announce_rank(rank);
        let client = StoreClient::connect(
            &self.config.master,
            Purpose::StoreAux,
            rank,
            world,
            &self.config.token,
            self.config.timeouts.store,
            deadline,
        )?
        .with_scope(Some(keys::scope(e)));
        let client = Arc::new(client);
        if world == WorldSize::ONE {
            return Ok(Inner::single(
                self.config.timeouts,
                self.config.restart_count,
                Some((
                    client,
                    self.config.local_rank,
                    self.config.local_world_size,
                    self.config.token.clone(),
                )),
            ));
        }
        let mut cfg = self.config.clone();
        cfg.rank = rank;
        cfg.world_size = world;
        cfg.local_rank = LocalRank(self.config.local_rank.0);
        Inner::connect(&cfg, client, None, StoreHost::Launcher, deadline)
    }

    /// The deadline for opening a new epoch's ring: its members checked in moments ago, so
    /// one that does not publish its address within twice the heartbeat bound (at least 5 s)
    /// died since.
    fn connect_deadline(&self, overall: Instant) -> Instant {
        let window = (2 * self.config.timeouts.heartbeat).max(Duration::from_secs(5));
        (Instant::now() + window).min(overall)
    }

    /// The first collective of a new epoch: every rank's progress, and what follows from it.
    #[allow(clippy::too_many_arguments)]
    fn exchange_progress(
        &self,
        group: &ProcessGroup,
        epoch: u64,
        previous: Vec<u32>,
        members: Vec<u32>,
        progress: Option<u64>,
        reason: String,
        started: Instant,
    ) -> Result<Recovery> {
        let mine = progress.map_or(-1, |p| i64::try_from(p).unwrap_or(i64::MAX));
        let mut all = vec![0i64; members.len()];
        group.all_gather(&[mine], &mut all)?;
        let best = all.iter().copied().max().unwrap_or(-1);
        if best < 0 {
            return Err(DdpError::Membership(MembershipError::JoinFailed {
                member: self.id,
                waited: started.elapsed(),
                why: "no rank of the new membership has any state to share (every one of them \
                      is joining)"
                    .into(),
            }));
        }
        let source = all.iter().position(|p| *p == best).unwrap_or(0);
        let behind = all
            .iter()
            .enumerate()
            .filter(|(_, p)| **p < best)
            .map(|(r, _)| Rank(r as u32))
            .collect();
        let rank = group.rank();
        let recovery = Recovery {
            epoch,
            left: minus(&previous, &members),
            joined: minus(&members, &previous),
            previous,
            world: group.world_size(),
            members,
            reason,
            rank,
            source: Rank(source as u32),
            behind,
            progress: u64::try_from(best).unwrap_or(0),
            took: started.elapsed(),
        };
        tracing::warn!("[rank {rank}] {}", recovery.summary());
        Ok(recovery)
    }
}

impl ProcessGroup {
    fn with_membership(inner: Inner, service: MembershipService) -> Self {
        Self {
            shared: Arc::new(GroupState {
                current: std::sync::RwLock::new(Arc::new(inner)),
                membership: Some(service),
            }),
        }
    }

    fn service(&self) -> Result<&MembershipService> {
        self.shared.membership.as_ref().ok_or(DdpError::Membership(
            MembershipError::NotFaultTolerant {
                what: "changing the membership of a group",
                reason: "this group is not fault-tolerant: start the job with `burn-ddp run \
                         --fault-tolerant` (or set BURN_DDP_FAULT_TOLERANT=1 with a store \
                         served by a launcher)",
            },
        ))
    }
}

/// How many members read the ballot of a membership change at every poll (the others wait on
/// the decision): spread over the members, so that the loss of a node (consecutive ranks) leaves
/// some.
const DECIDERS: usize = 8;

/// Whether member `id` of `members` reads the ballot at every poll: one member in
/// `len / DECIDERS`, from the first; every member of a small membership.
fn is_decider(members: &[u32], id: u32) -> bool {
    let stride = (members.len() / DECIDERS).max(1);
    members
        .iter()
        .position(|m| *m == id)
        .is_none_or(|p| p % stride == 0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{JobToken, MasterAddr, Timeouts};
    use crate::error::CollectiveError;
    use crate::store::StoreServer;

    /// A fault-tolerant job's store in this process, and a client of it.
    fn lighthouse() -> (StoreServer, MasterAddr, JobToken, StoreClient) {
        let token = JobToken::new("elastic-test");
        let server = StoreServer::bind_lighthouse(
            "127.0.0.1:0".parse().unwrap(),
            token.clone(),
            WorldSize::ONE,
        )
        .unwrap();
        let master = MasterAddr::new("127.0.0.1", server.local_addr().port());
        let client = StoreClient::connect(
            &master,
            Purpose::StoreAux,
            Rank(0),
            WorldSize::ONE,
            &token,
            Duration::from_secs(5),
            Instant::now() + Duration::from_secs(5),
        )
        .unwrap();
        (server, master, token, client)
    }

    /// Records in `store` a job of one process (member 0) that formed its first membership.
    fn formed_job_of_one(store: &StoreClient) {
        record_first_world(store, 1).unwrap();
        store.set(&keys::members(0), b"0").unwrap();
        store.set(keys::EPOCH, b"0").unwrap();
    }

    fn config(master: &MasterAddr, token: &JobToken, join: bool) -> GroupConfig {
        GroupConfig::new(Rank(0), WorldSize::ONE, token.clone())
            .with_master(master.clone())
            .with_timeouts(Timeouts::uniform(Duration::from_secs(2)))
            .with_fault_tolerance(FaultTolerance {
                join,
                ..FaultTolerance::default()
            })
    }

    /// What rank 0's metric logger asks before it writes: whether a rank recorded the end of
    /// this process's membership (a frozen rank 0 continued after the others went on).
    #[test]
    fn the_end_of_the_current_membership_is_seen_in_the_store() {
        assert!(!ProcessGroup::single().membership_ended());
        let (_server, master, token, store) = lighthouse();
        let pg = ProcessGroup::init(config(&master, &token, false)).unwrap();
        assert_eq!(pg.membership().map(|(_, e)| e), Some(0));
        assert!(!pg.membership_ended());
        let record = AbortRecord {
            reporter: Rank(1),
            culprit: Some(Rank(0)),
            collective: None,
            reason: "rank 0 sent no heartbeat".into(),
        };
        store.end_scope(&keys::scope(0), record).unwrap();
        assert!(pg.membership_ended());
    }

    /// What rank 0's checkpoint writer asks before its rename: `Ok` while the membership
    /// stands, then the error naming the write and the reason recorded.
    #[test]
    fn a_write_is_refused_once_the_membership_ended() {
        ProcessGroup::single()
            .membership_stands("a test write")
            .unwrap();
        let (_server, master, token, _store) = lighthouse();
        let pg = ProcessGroup::init(config(&master, &token, false)).unwrap();
        pg.membership_stands("a test write").unwrap();
        pg.end_membership("rank 0 sent no heartbeat");
        let err = pg.membership_stands("a test write").unwrap_err();
        assert!(
            matches!(
                err,
                DdpError::Membership(MembershipError::Superseded { epoch: 0, .. })
            ),
            "{err}"
        );
        let text = err.to_string();
        assert!(text.contains("a test write is not written"), "{text}");
        assert!(text.contains("rank 0 sent no heartbeat"), "{text}");
    }

    /// Small memberships: every member reads the ballot. Larger ones: eight, spread, so that
    /// the loss of one node's consecutive ranks leaves deciders.
    #[test]
    fn the_deciders_of_a_change_are_few_and_spread() {
        let members: Vec<u32> = (0..12).collect();
        assert!(members.iter().all(|m| is_decider(&members, *m)));
        let members: Vec<u32> = (100..1124).collect();
        let deciders: Vec<u32> = members
            .iter()
            .copied()
            .filter(|m| is_decider(&members, *m))
            .collect();
        assert_eq!(deciders, [100, 228, 356, 484, 612, 740, 868, 996]);
        assert!(is_decider(&members, 5000), "not a member: decides");
    }

    #[test]
    fn deciders_of_large_memberships_read_their_ballot_less_often() {
        assert_eq!(ballot_wait(3), POLL);
        assert_eq!(ballot_wait(1024), Duration::from_millis(512));
        assert_eq!(ballot_wait(8192), Duration::from_secs(1));
    }

    #[test]
    fn a_joining_process_is_told_that_the_job_is_over() {
        let (_server, master, token, store) = lighthouse();
        // A job of one process that formed and finished.
        formed_job_of_one(&store);
        store.set(&keys::finished(0), b"1").unwrap();
        let started = Instant::now();
        let err = ProcessGroup::init(config(&master, &token, true)).unwrap_err();
        assert!(
            matches!(&err, DdpError::Membership(MembershipError::JoinFailed { why, .. }) if why.contains("the job finished")),
            "{err}"
        );
        assert!(started.elapsed() < Duration::from_secs(5));
    }

    /// A process that ends well is recorded as finished; one that ends with a failure
    /// ([`ProcessGroup::mark_failed`]) only as gone: the launcher must not read the end of a
    /// job whose last members all failed as one that finished.
    #[test]
    fn a_process_that_failed_is_not_recorded_as_finished() {
        for failed in [false, true] {
            let (_server, master, token, store) = lighthouse();
            let pg = ProcessGroup::init(config(&master, &token, false)).unwrap();
            if failed {
                pg.mark_failed();
            }
            drop(pg);
            let last = record::last_membership(&store).unwrap().unwrap();
            assert_eq!(last.finished, vec![!failed], "failed: {failed}");
            assert_eq!(last.ended, vec![true], "failed: {failed}");
            let outcome = last.outcome().unwrap();
            let expected = if failed {
                "the job failed"
            } else {
                "the job finished"
            };
            assert!(outcome.starts_with(expected), "{outcome}");
        }
    }

    #[test]
    fn a_joining_process_is_told_that_the_job_failed_when_every_member_was_lost() {
        let (_server, master, token, store) = lighthouse();
        formed_job_of_one(&store);
        store.set(&crate::store::gone_key(Rank(0)), b"").unwrap();
        let err = ProcessGroup::init(config(&master, &token, true)).unwrap_err();
        assert!(
            matches!(&err, DdpError::Membership(MembershipError::JoinFailed { why, .. }) if why.contains("the job failed: every member of its last membership")),
            "{err}"
        );
    }

    /// A member id the job never handed out is refused at once: it would ask to join for ever
    /// (the rule admits known ids only), ending a membership epoch at each request.
    #[test]
    fn a_member_id_the_job_never_handed_out_is_refused_at_once() {
        let (_server, master, token, store) = lighthouse();
        formed_job_of_one(&store);
        let mut config = config(&master, &token, true);
        if let Some(ft) = config.fault_tolerance.as_mut() {
            ft.member = Some(5);
        }
        let started = Instant::now();
        let err = ProcessGroup::init(config).unwrap_err();
        assert!(
            matches!(&err, DdpError::Membership(MembershipError::JoinFailed { why, .. }) if why.contains("member id 5 is not one of the running job's") && why.contains("--join")),
            "{err}"
        );
        assert!(started.elapsed() < Duration::from_secs(1));
        assert_eq!(store.add(keys::JOINS, 0).unwrap(), 0, "it asked to join");
    }

    #[test]
    fn a_joining_process_gives_up_when_no_job_forms() {
        let (_server, master, token, store) = lighthouse();
        record_first_world(&store, 2).unwrap();
        let started = Instant::now();
        let err = ProcessGroup::init(config(&master, &token, true)).unwrap_err();
        assert!(
            matches!(&err, DdpError::Membership(MembershipError::JoinFailed { why, .. }) if why.contains("never formed")),
            "{err}"
        );
        // The rendezvous timeout (2 s) bounds it.
        assert!(
            started.elapsed() < Duration::from_secs(6),
            "{:?}",
            started.elapsed()
        );
    }

    #[test]
    fn a_job_of_one_forms_recovers_alone_and_refuses_subgroups() {
        let (_server, master, token, _store) = lighthouse();
        let pg = ProcessGroup::init(config(&master, &token, false)).unwrap();
        assert!(pg.is_fault_tolerant());
        assert_eq!(pg.membership(), Some((0, 0)));
        let refused = pg.new_group(&[Rank(0)]).unwrap_err();
        assert!(
            matches!(
                refused,
                DdpError::Membership(MembershipError::NotFaultTolerant { .. })
            ),
            "{refused}"
        );
        let cause = DdpError::Collective(CollectiveError::GroupAborted {
            rank: Rank(0),
            first: Box::new(AbortRecord {
                reporter: Rank(0),
                culprit: None,
                collective: None,
                reason: "a test".into(),
            }),
        });
        let rec = pg.recover(&cause, Some(5)).unwrap();
        assert_eq!(
            (rec.epoch, rec.members.clone(), rec.progress),
            (1, vec![0], 5)
        );
        assert!(!rec.needs_state());
        assert_eq!(pg.membership(), Some((0, 1)));
        // Outside a fault-tolerant job there is nothing to recover.
        let plain = ProcessGroup::single().recover(&cause, None).unwrap_err();
        assert!(
            matches!(
                plain,
                DdpError::Membership(MembershipError::NotFaultTolerant { .. })
            ),
            "{plain}"
        );
    }
}
