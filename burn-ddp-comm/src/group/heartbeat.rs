//! Liveness: every rank publishes a heartbeat in the store — a beat counter, the last collective
//! it completed, the one it is in, its host — and watches its ring neighbours' (ranks r − 1 and
//! r + 1, modulo the world). A rank that waits in a collective longer than the stall bound while
//! another rank is silent (dead, frozen) or alive but not in this collective and not
//! progressing, aborts its collective with an error naming that rank, its host and the last
//! collective it completed: long before the collective timeout.
//!
//! The store traffic is linear in the ranks: each check is one write (this rank's beat) and two
//! reads (its neighbours'), plus the abort record's read, whatever the world size; reading every
//! peer's heartbeat would make it n(n − 1) requests an interval. A neighbour that sees a watched
//! rank silent past the bound records it under one key ([`SILENT_KEY`], the first such rank
//! wins), whether or not it waits itself; a rank that has waited past the bound reads that key,
//! so a rank waiting on a far peer (a sub-group's collective, NCCL work) names it as it did when
//! it read every heartbeat. A maximal run of dead ranks is bordered by live ranks, which watch
//! its ends: some dead rank is always recorded. A rank alive but elsewhere is judged by its
//! neighbours, which wait in the same world collective; their verdict reaches every rank as the
//! job's abort record.
//!
//! The heartbeat is a service of the process group: the group starts it once the TCP
//! communicator is connected, and hands it to the communicator as its [`PeerWatch`].
//!
//! The watcher uses its own store connection (an auxiliary one, not a membership claim) and its
//! own thread, so it beats while the rank computes. Times are taken on this machine's clock
//! only (when a peer's heartbeat last *changed*), so clocks need not agree across nodes.

use std::collections::HashMap;
use std::ops::ControlFlow;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use crate::comm::tcp::LinkStopper;
use crate::comm::{PeerWatch, Verdict};
use crate::config::{JobToken, MasterAddr, Timeouts};
use crate::periodic::Periodic;
use crate::store::auth::Purpose;
use crate::store::StoreClient;
use crate::types::{AbortRecord, CollectiveSeq, Rank, WorldSize};

/// What this rank is doing, shared between the collectives and the watcher.
#[derive(Debug)]
pub(crate) struct Progress {
    /// The collective in progress (0: none).
    pub(crate) entered: AtomicU64,
    /// The last collective completed.
    pub(crate) completed: AtomicU64,
    /// When the collective in progress began.
    since: Mutex<Instant>,
    /// Waits on the peers outside the host collectives (NCCL work) in progress, and when the
    /// first of them began.
    outside: Mutex<(u32, Instant)>,
}

/// What this rank is waiting for, as the watcher judges it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Waiting {
    /// Host collective `#seq`, for this long.
    Collective(u64, Duration),
    /// Work shared with the peers outside the host collectives (NCCL), for this long.
    Outside(Duration),
}

impl Progress {
    pub(crate) fn new() -> Self {
        Self {
            entered: AtomicU64::new(0),
            completed: AtomicU64::new(0),
            since: Mutex::new(Instant::now()),
            outside: Mutex::new((0, Instant::now())),
        }
    }

    pub(crate) fn enter(&self, seq: CollectiveSeq) {
        *self.since.lock().unwrap_or_else(|p| p.into_inner()) = Instant::now();
        self.entered.store(seq.0, Ordering::SeqCst);
    }

    pub(crate) fn leave(&self, seq: CollectiveSeq, ok: bool) {
        if ok {
            self.completed.store(seq.0, Ordering::SeqCst);
        }
        self.entered.store(0, Ordering::SeqCst);
    }

    /// This rank starts waiting on its peers outside the host collectives.
    pub(crate) fn enter_outside(&self) {
        let mut o = self.outside.lock().unwrap_or_else(|p| p.into_inner());
        if o.0 == 0 {
            o.1 = Instant::now();
        }
        o.0 += 1;
    }

    /// The end of a wait begun with [`Progress::enter_outside`].
    pub(crate) fn leave_outside(&self) {
        let mut o = self.outside.lock().unwrap_or_else(|p| p.into_inner());
        o.0 = o.0.saturating_sub(1);
    }

    fn waiting(&self) -> Option<Waiting> {
        let seq = self.entered.load(Ordering::SeqCst);
        if seq != 0 {
            let since = *self.since.lock().unwrap_or_else(|p| p.into_inner());
            return Some(Waiting::Collective(seq, since.elapsed()));
        }
        let o = *self.outside.lock().unwrap_or_else(|p| p.into_inner());
        (o.0 > 0).then(|| Waiting::Outside(o.1.elapsed()))
    }
}

/// One peer's heartbeat as last read, when it last changed (it beats) and when its progress
/// last changed (it completed or entered a collective), on our clock.
#[derive(Debug)]
struct Seen {
    value: Beat,
    changed: Instant,
    moved: Instant,
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Beat {
    beat: u64,
    completed: u64,
    entered: u64,
    host: String,
}

impl Beat {
    fn encode(&self) -> Vec<u8> {
        format!(
            "{} {} {} {}",
            self.beat, self.completed, self.entered, self.host
        )
        .into_bytes()
    }

    /// Parses a heartbeat; `None` for anything malformed (it came over the network).
    fn decode(bytes: &[u8]) -> Option<Self> {
        let text = std::str::from_utf8(bytes).ok()?;
        let mut it = text.splitn(4, ' ');
        Some(Self {
            beat: it.next()?.parse().ok()?,
            completed: it.next()?.parse().ok()?,
            entered: it.next()?.parse().ok()?,
            host: it.next().unwrap_or("?").chars().take(256).collect(),
        })
    }
}

/// For the fuzz target: decode, and re-encode what decodes (heartbeats and silence records).
#[cfg(feature = "fuzzing")]
pub(crate) fn fuzz_decode(data: &[u8]) {
    if let Some(b) = Beat::decode(data) {
        assert_eq!(Beat::decode(&b.encode()), Some(b), "heartbeat round trip");
    }
    if let Some(s) = Silence::decode(data) {
        assert_eq!(
            Silence::decode(&s.encode()),
            Some(s),
            "silence record round trip"
        );
    }
}

pub(crate) fn key(rank: Rank) -> String {
    format!("heartbeat/{rank}")
}

/// The key under which a neighbour records the first watched rank it saw silent past the bound.
pub(crate) const SILENT_KEY: &str = "heartbeat/silent";

/// The ranks `rank` watches: its ring neighbours (one at world size 2, none alone).
fn neighbours(rank: Rank, world: WorldSize) -> Vec<Rank> {
    let n = world.get();
    let mut out = Vec::with_capacity(2);
    for r in [(rank.0 + n - 1) % n, (rank.0 + 1) % n] {
        if r != rank.0 && !out.contains(&Rank(r)) {
            out.push(Rank(r));
        }
    }
    out
}

/// A silent rank as its neighbour recorded it under [`SILENT_KEY`]: who, on which host, its
/// last completed collective, how long it had been silent, who saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Silence {
    culprit: Rank,
    completed: u64,
    quiet_ms: u64,
    reporter: Rank,
    host: String,
}

impl Silence {
    fn encode(&self) -> Vec<u8> {
        format!(
            "{} {} {} {} {}",
            self.culprit.0, self.completed, self.quiet_ms, self.reporter.0, self.host
        )
        .into_bytes()
    }

    /// Parses a record; `None` for anything malformed (it came over the network).
    fn decode(bytes: &[u8]) -> Option<Self> {
        let text = std::str::from_utf8(bytes).ok()?;
        let mut it = text.splitn(5, ' ');
        Some(Self {
            culprit: Rank(it.next()?.parse().ok()?),
            completed: it.next()?.parse().ok()?,
            quiet_ms: it.next()?.parse().ok()?,
            reporter: Rank(it.next()?.parse().ok()?),
            host: it.next().unwrap_or("?").chars().take(256).collect(),
        })
    }
}

/// This machine's host name, for error messages.
pub(crate) fn host_name() -> String {
    let name = crate::sys::node_name();
    if name.is_empty() {
        String::from("?")
    } else {
        name
    }
}

/// The bounds of the watcher.
#[derive(Debug, Clone, Copy)]
struct Bounds {
    /// A peer whose heartbeat does not change for this long is dead or frozen.
    silence: Duration,
    /// A collective that waited this long on a live peer that is elsewhere, not progressing.
    stall: Duration,
}

/// What a verdict stops: the world group's ring (owned) and the rings of the sub-groups that
/// still exist.
#[derive(Debug)]
struct Stoppers {
    world: LinkStopper,
    subgroups: Mutex<Vec<Weak<LinkStopper>>>,
}

impl Stoppers {
    fn stop(&self) {
        self.world.stop();
        let subs = self.subgroups.lock().unwrap_or_else(|p| p.into_inner());
        for s in subs.iter().filter_map(Weak::upgrade) {
            s.stop();
        }
    }
}

/// A rank's heartbeat: what it is doing ([`Progress`]) and the thread that publishes it and
/// watches the other ranks. Stops when dropped.
#[derive(Debug)]
pub(crate) struct Heartbeat {
    progress: Arc<Progress>,
    stoppers: Arc<Stoppers>,
    watcher: Watcher,
    /// The silence bound plus three checks (the neighbour's that records a silence, this
    /// rank's that reads it, and one of slack), each at most an interval and two store requests.
    bound: Duration,
}

impl Heartbeat {
    /// Starts the heartbeat of `rank` on its own store connection to `store`'s server. A
    /// verdict stops the communicator's collectives through `stopper`. `None` (with a warning)
    /// when that connection cannot be opened: failures of other ranks are then detected by the
    /// collective timeout only.
    #[allow(clippy::too_many_arguments)] // the group's settings, each used once
    pub(crate) fn start(
        store: &StoreClient,
        rank: Rank,
        world: WorldSize,
        token: &JobToken,
        timeouts: Timeouts,
        deadline: Instant,
        stopper: LinkStopper,
        host: super::StoreHost,
    ) -> Option<Self> {
        let master = store.master();
        let bounds = Bounds {
            silence: timeouts.heartbeat,
            stall: timeouts.stall,
        };
        let link = AuxLink {
            master,
            rank,
            world,
            token: token.clone(),
            scope: store.scope().map(str::to_owned),
            // A quarter of the check interval per store request (a live store answers in
            // milliseconds): a check stays short when the store falls silent.
            io: (bounds.interval() / 4).max(Duration::from_millis(100)),
            late: bounds.silence,
        };
        match link.connect(deadline) {
            Ok(aux) => {
                let progress = Arc::new(Progress::new());
                let bound = bounds.silence + 3 * (bounds.interval() + 2 * link.io);
                let stoppers = Arc::new(Stoppers {
                    world: stopper,
                    subgroups: Mutex::new(Vec::new()),
                });
                let watcher = Watcher::start(
                    aux,
                    link,
                    host,
                    bounds,
                    Arc::clone(&progress),
                    Arc::clone(&stoppers),
                );
                Some(Self {
                    progress,
                    stoppers,
                    watcher,
                    bound,
                })
            }
            Err(e) => {
                tracing::warn!(
                    "[rank {rank}] no heartbeat (its store connection failed: {e}); failures \
                     of other ranks are detected by the collective timeout only"
                );
                None
            }
        }
    }

    /// What this rank is doing, as the heartbeat publishes and judges it.
    pub(crate) fn progress(&self) -> Arc<Progress> {
        Arc::clone(&self.progress)
    }

    /// Stops the rings of every sub-group (when the world group is aborted).
    pub(crate) fn stop_subgroups(&self) {
        let subs = self
            .stoppers
            .subgroups
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        for s in subs.iter().filter_map(Weak::upgrade) {
            s.stop();
        }
    }

    /// A verdict stops `ring` too (a sub-group's) while it exists; stopped at once if a verdict
    /// was already reached.
    pub(crate) fn also_stop(&self, ring: Weak<LinkStopper>) {
        let mut subs = self
            .stoppers
            .subgroups
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        subs.retain(|s| s.strong_count() > 0);
        if self.watcher.verdict().is_some() {
            if let Some(r) = ring.upgrade() {
                r.stop();
            }
        }
        subs.push(ring);
    }
}

/// The heartbeat as a sub-group's ring sees it: its collectives count as waits on the peers
/// outside the world group's collectives (whose sequence numbers the heartbeat publishes), so
/// the heartbeat judges silence (a dead or frozen rank) during them, and its verdict is theirs.
#[derive(Debug)]
pub(crate) struct SubgroupWatch(pub(crate) Arc<Heartbeat>);

impl PeerWatch for SubgroupWatch {
    fn enter(&self, _seq: CollectiveSeq) {
        self.0.progress.enter_outside();
    }

    fn leave(&self, _seq: CollectiveSeq, _ok: bool) {
        self.0.progress.leave_outside();
    }

    fn verdict(&self) -> Option<Verdict> {
        self.0.watcher.verdict()
    }

    fn bound(&self) -> Duration {
        self.0.bound
    }
}

impl PeerWatch for Heartbeat {
    fn enter(&self, seq: CollectiveSeq) {
        self.progress.enter(seq);
    }

    fn leave(&self, seq: CollectiveSeq, ok: bool) {
        self.progress.leave(seq, ok);
    }

    fn verdict(&self) -> Option<Verdict> {
        self.watcher.verdict()
    }

    fn bound(&self) -> Duration {
        self.bound
    }
}

impl Bounds {
    fn interval(&self) -> Duration {
        (self.silence.min(self.stall) / 5).clamp(Duration::from_millis(50), Duration::from_secs(2))
    }
}

/// How the watcher reaches the store: its own connection, whose every request is bounded by
/// the check interval (not by the store timeout), so that a silent store (rank 0 frozen) is
/// judged on time. A reply that comes late is taken at a later check: the connection is
/// replaced only when it fails or a reply has not come within the silence bound (thousands of
/// ranks whose heartbeats a busy store answers late must not all connect again at once).
#[derive(Debug, Clone)]
struct AuxLink {
    master: MasterAddr,
    rank: Rank,
    world: WorldSize,
    token: JobToken,
    /// The scope of the group's store keys (a fault-tolerant job's membership epoch).
    scope: Option<String>,
    io: Duration,
    /// How long a late reply is awaited on the same connection.
    late: Duration,
}

impl AuxLink {
    fn connect(&self, deadline: Instant) -> crate::Result<StoreClient> {
        StoreClient::connect(
            &self.master,
            Purpose::StoreAux,
            self.rank,
            self.world,
            &self.token,
            self.io,
            deadline,
        )
        .map(|c| {
            c.with_reply_slack(self.io)
                .keeping_late_replies(self.late)
                .with_scope(self.scope.clone())
        })
    }
}

/// The watcher thread; stops when dropped.
#[derive(Debug)]
struct Watcher {
    /// Held for its drop, which stops the thread.
    _thread: Periodic,
    verdict: Arc<Mutex<Option<Verdict>>>,
}

impl Watcher {
    /// Starts beating and watching. `stopper` is the communicator's: a verdict stops its
    /// collectives, which ends the one in progress at once.
    fn start(
        store: StoreClient,
        link: AuxLink,
        host: super::StoreHost,
        bounds: Bounds,
        progress: Arc<Progress>,
        stoppers: Arc<Stoppers>,
    ) -> Self {
        let (rank, world) = (link.rank, link.world);
        let verdict = Arc::new(Mutex::new(None));
        let mut watch = Watch {
            store,
            link,
            rank,
            bounds,
            progress,
            store_host: host,
            host: host_name(),
            beat: 0,
            watched: neighbours(rank, world),
            seen: HashMap::new(),
            recorded: None,
            store_ok: Instant::now(),
        };
        // The first heartbeat is in the store before the group is handed to its user: a rank
        // that dies or freezes right after joining (before its watcher thread first ran) would
        // otherwise never have published one, and the others judge only silence they saw begin.
        watch.publish();
        let mut stopped_for_record = false;
        let thread = {
            let verdict = Arc::clone(&verdict);
            Periodic::spawn(
                format!("burn-ddp-heartbeat-{rank}"),
                bounds.interval(),
                move || {
                    // A failure another rank published ends this rank's collectives too,
                    // including those of groups that do not contain the culprit: they fail at
                    // once naming it, instead of running on until they need it.
                    if !stopped_for_record && watch.aborted_elsewhere() {
                        stoppers.stop();
                        stopped_for_record = true;
                    }
                    let Some(v) = watch.tick() else {
                        return ControlFlow::Continue(());
                    };
                    tracing::error!(
                        "[rank {rank}] rank {} ({}) {}; aborting the collective",
                        v.culprit,
                        v.host,
                        v.what
                    );
                    // Published before the links close, so that the ranks that see them close
                    // find the culprit in the store, not this rank. Not when the store is
                    // silent: rank 0's went with it, and a rank cut off from the launcher's
                    // cannot reach it.
                    if !v.store_silent {
                        let _ = watch.store.abort(AbortRecord {
                            reporter: rank,
                            culprit: Some(v.culprit),
                            collective: None,
                            reason: format!(
                                "rank {} (host {}) {}; its last completed collective was #{}",
                                v.culprit, v.host, v.what, v.last_completed.0
                            ),
                        });
                    }
                    *verdict.lock().unwrap_or_else(|p| p.into_inner()) = Some(v);
                    stoppers.stop();
                    ControlFlow::Break(())
                },
            )
        };
        Self {
            _thread: thread,
            verdict,
        }
    }

    fn verdict(&self) -> Option<Verdict> {
        self.verdict
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}

struct Watch {
    store: StoreClient,
    link: AuxLink,
    rank: Rank,
    bounds: Bounds,
    progress: Arc<Progress>,
    /// Who serves the store: what its silence means.
    store_host: super::StoreHost,
    host: String,
    beat: u64,
    /// The peers whose heartbeats this rank reads: its ring neighbours.
    watched: Vec<Rank>,
    seen: HashMap<Rank, Seen>,
    /// The watched rank this rank recorded under [`SILENT_KEY`], while it stays silent.
    recorded: Option<Rank>,
    /// When the store last answered.
    store_ok: Instant,
}

impl Watch {
    /// Whether the job's abort record names a failure elsewhere (another rank reported it, or
    /// the store on this rank recorded another rank's lost connection).
    fn aborted_elsewhere(&self) -> bool {
        matches!(self.store.abort_record(),
            Ok(Some(r)) if r.reporter != self.rank || r.culprit.is_some_and(|c| c != self.rank))
    }

    /// Publishes this rank's next heartbeat (reconnecting first when the connection broke).
    fn publish(&mut self) {
        self.beat += 1;
        let mine = Beat {
            beat: self.beat,
            completed: self.progress.completed.load(Ordering::SeqCst),
            entered: self.progress.entered.load(Ordering::SeqCst),
            host: self.host.clone(),
        };
        if self.store.is_broken() {
            // One attempt per check, bounded by the check interval.
            match self.link.connect(Instant::now() + self.link.io) {
                Ok(store) => self.store = store,
                Err(e) => tracing::debug!("[rank {}] heartbeat: reconnecting: {e}", self.rank),
            }
        }
        let now = Instant::now();
        match self.store.set(&key(self.rank), &mine.encode()) {
            Ok(()) => self.store_ok = now,
            Err(e) => tracing::debug!("[rank {}] heartbeat: publishing: {e}", self.rank),
        }
        // A late reply taken is the store answering too: a store that answers every request
        // after its bound, but within the interval, is busy, not silent.
        if let Some(answered) = self.store.last_answer() {
            self.store_ok = self.store_ok.max(answered);
        }
    }

    fn tick(&mut self) -> Option<Verdict> {
        self.publish();
        let now = Instant::now();
        for i in 0..self.watched.len() {
            let r = self.watched[i];
            let Ok(bytes) = self.store.get_timeout(&key(r), Duration::from_millis(1)) else {
                continue; // not published yet, or the store is busy: judged below
            };
            let Some(beat) = Beat::decode(&bytes) else {
                continue;
            };
            match self.seen.get_mut(&r) {
                Some(s) if s.value == beat => {}
                Some(s) => {
                    if (s.value.completed, s.value.entered) != (beat.completed, beat.entered) {
                        s.moved = now;
                    }
                    s.value = beat;
                    s.changed = now;
                }
                None => {
                    self.seen.insert(
                        r,
                        Seen {
                            value: beat,
                            changed: now,
                            moved: now,
                        },
                    );
                }
            }
        }
        self.record_silence(now);
        let waiting = self.progress.waiting()?;
        self.judge(waiting, now)
    }

    /// Records the first watched rank silent past the bound under [`SILENT_KEY`] (unless
    /// another rank's record is there), and takes this rank's record back once that rank
    /// beats again. Whether this rank waits or not: the ranks that wait on it may be far.
    fn record_silence(&mut self, now: Instant) {
        if let Some(r) = self.recorded {
            let back = self
                .seen
                .get(&r)
                .is_some_and(|s| now.duration_since(s.changed) <= self.bounds.silence);
            if back {
                if self.silence_record().is_some_and(|s| s.culprit == r) {
                    let _ = self.store.delete(SILENT_KEY);
                }
                self.recorded = None;
            }
            return;
        }
        let silent = self.watched.iter().find_map(|r| {
            let s = self.seen.get(r)?;
            let quiet = now.duration_since(s.changed);
            (quiet > self.bounds.silence).then(|| Silence {
                culprit: *r,
                completed: s.value.completed,
                quiet_ms: u64::try_from(quiet.as_millis()).unwrap_or(u64::MAX),
                reporter: self.rank,
                host: s.value.host.clone(),
            })
        });
        let Some(silence) = silent else {
            return;
        };
        let record = silence.encode();
        if self
            .store
            .compare_set(SILENT_KEY, None, &record)
            .is_ok_and(|now_there| now_there == record)
        {
            self.recorded = Some(silence.culprit);
        }
    }

    /// The silence recorded under [`SILENT_KEY`], if any (and readable).
    fn silence_record(&self) -> Option<Silence> {
        let bytes = self
            .store
            .get_timeout(SILENT_KEY, Duration::from_millis(1))
            .ok()?;
        Silence::decode(&bytes)
    }

    /// The silent rank a neighbour recorded, if any other than this one.
    fn recorded_silence(&self) -> Option<Silence> {
        self.silence_record().filter(|s| s.culprit != self.rank)
    }

    /// While this rank waits (in a host collective, or on work outside them): who is to
    /// blame, if anyone yet. Outside the host collectives there is no sequence number to
    /// compare, so only silence (a dead or frozen rank, or rank 0's store gone) is judged.
    fn judge(&self, waiting: Waiting, now: Instant) -> Option<Verdict> {
        let (seq, waited) = match waiting {
            Waiting::Collective(seq, waited) => (Some(seq), waited),
            Waiting::Outside(waited) => (None, waited),
        };
        let during = || match seq {
            Some(seq) => format!("in collective #{seq}"),
            None => "for work shared with it outside the host collectives (NCCL)".to_string(),
        };
        let store_quiet = now.duration_since(self.store_ok);
        match self.store_host {
            // Rank 0 serves the store: a store that stopped answering is rank 0 gone.
            super::StoreHost::RankZero
                if self.rank != Rank(0) && store_quiet > self.bounds.silence =>
            {
                let s = self.seen.get(&Rank(0));
                return Some(Verdict {
                    culprit: Rank(0),
                    host: s.map_or_else(|| "?".into(), |s| s.value.host.clone()),
                    last_completed: CollectiveSeq(s.map_or(0, |s| s.value.completed)),
                    what: format!(
                        "stopped answering (its store has not replied for {store_quiet:.0?})"
                    ),
                    store_silent: true,
                });
            }
            // The launcher serves it: this rank is cut off from the job.
            super::StoreHost::Launcher if store_quiet > self.bounds.silence => {
                let (store, or) = match &self.link.master.etcd {
                    Some(_) => (
                        format!("the job's store, the {}", self.link.master),
                        "or a majority of its members is down",
                    ),
                    None => (
                        format!("the launcher's store at {}", self.link.master),
                        "or node 0's launcher is gone",
                    ),
                };
                return Some(Verdict {
                    culprit: self.rank,
                    host: self.host.clone(),
                    last_completed: CollectiveSeq(self.progress.completed.load(Ordering::SeqCst)),
                    what: format!(
                        "has lost the job's store: {store} has not replied for \
                         {store_quiet:.0?} (this rank is cut off from it, {or})"
                    ),
                    store_silent: true,
                });
            }
            _ => {}
        }
        // A far rank's silence, as its neighbour recorded it (read only once this rank has
        // waited past the bound: the only time it would judge it).
        if waited > self.bounds.silence {
            let watched_silent = self
                .seen
                .values()
                .any(|s| now.duration_since(s.changed) > self.bounds.silence);
            if let Some(far) = (!watched_silent).then(|| self.recorded_silence()).flatten() {
                let quiet = Duration::from_millis(far.quiet_ms);
                return Some(Verdict {
                    culprit: far.culprit,
                    host: far.host,
                    last_completed: CollectiveSeq(far.completed),
                    what: format!(
                        "sent no heartbeat for {quiet:.0?} as its neighbour rank {} saw it \
                         (dead or frozen) while this rank waited {}",
                        far.reporter,
                        during()
                    ),
                    store_silent: false,
                });
            }
        }
        for (r, s) in &self.seen {
            let quiet = now.duration_since(s.changed);
            if quiet > self.bounds.silence && waited > self.bounds.silence {
                return Some(Verdict {
                    culprit: *r,
                    host: s.value.host.clone(),
                    last_completed: CollectiveSeq(s.value.completed),
                    what: format!(
                        "sent no heartbeat for {quiet:.0?} (dead or frozen) while this rank \
                         waited {}",
                        during()
                    ),
                    store_silent: false,
                });
            }
            let Some(seq) = seq else {
                continue;
            };
            let elsewhere = s.value.entered != seq && s.value.completed < seq;
            let still = now.duration_since(s.moved);
            if elsewhere && waited > self.bounds.stall && still > self.bounds.stall {
                return Some(Verdict {
                    culprit: *r,
                    host: s.value.host.clone(),
                    last_completed: CollectiveSeq(s.value.completed),
                    what: format!(
                        "is alive but has not reached collective #{seq} for {waited:.0?} (it is \
                         stuck outside the collectives, or called a different number of them)"
                    ),
                    store_silent: false,
                });
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn heartbeats_round_trip() {
        let b = Beat {
            beat: 7,
            completed: 41,
            entered: 42,
            host: "node 3".into(),
        };
        assert_eq!(Beat::decode(&b.encode()), Some(b));
        assert_eq!(Beat::decode(b"x 1 2 h"), None);
        assert_eq!(Beat::decode(b"1 2"), None);
    }

    #[test]
    fn silence_records_round_trip() {
        let s = Silence {
            culprit: Rank(4095),
            completed: 17,
            quiet_ms: 3100,
            reporter: Rank(4094),
            host: "node 511".into(),
        };
        assert_eq!(Silence::decode(&s.encode()), Some(s));
        assert_eq!(Silence::decode(b"1 2 x 3 h"), None);
        assert_eq!(Silence::decode(b"1 2 3"), None);
    }

    /// Every rank watches two peers (one at world size 2), and every rank is watched by two:
    /// the reads of a check are 2 per rank, 2n in all, at any world size.
    #[test]
    fn each_rank_watches_its_ring_neighbours_and_is_watched_by_them() {
        assert!(neighbours(Rank(0), WorldSize::new(1).unwrap()).is_empty());
        assert_eq!(neighbours(Rank(0), WorldSize::new(2).unwrap()), [Rank(1)]);
        for n in [3u32, 4, 7, 256, 8192] {
            let world = WorldSize::new(n).unwrap();
            let mut watchers = vec![0u32; n as usize];
            for r in world.ranks() {
                let w = neighbours(r, world);
                assert_eq!(w.len(), 2, "rank {r} of {n}");
                assert!(!w.contains(&r));
                for p in w {
                    watchers[p.index()] += 1;
                }
            }
            assert!(watchers.iter().all(|w| *w == 2), "{n}");
        }
        let world = WorldSize::new(8192).unwrap();
        assert_eq!(neighbours(Rank(0), world), [Rank(8191), Rank(1)]);
        assert_eq!(neighbours(Rank(8191), world), [Rank(8190), Rank(0)]);
    }

    proptest! {
        /// Heartbeats and silence records come from the network: anything decodes or is
        /// refused, never panics.
        #[test]
        fn decoding_arbitrary_heartbeats_never_panics(bytes in prop::collection::vec(any::<u8>(), 0..128)) {
            let _ = Beat::decode(&bytes);
            let _ = Silence::decode(&bytes);
        }
    }
}
