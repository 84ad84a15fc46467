//! [`BucketIssuer`] and [`InFlight`]: the device transports' issuer thread, without Burn and
//! without CUDA. Both Burn lines' NCCL paths hand it their packed buckets (Burn's queued
//! tensors, which only that line can name) with a function that makes them exist and queues
//! the all-reduce; it answers with what must stay alive until NCCL is done (the "pins").
//!
//! The one rule here: **a pin is released only once its transfer is known to be finished**,
//! because cubecl hands released memory to the next tensor while an all-reduce could still read
//! or write it (silent corruption). A transfer is known finished when
//! - a later wait of the collective [`Queue`] succeeded (its stream runs in order), or
//! - the queue was stopped after a failure and then seen idle ([`Queue::drain`]).
//!
//! A pass that fails is abandoned ([`InFlight::abandon`]): the queue is stopped (the other ranks
//! are told), every answer the issuer still owes is taken, and the queue drained; if it never
//! drains, the pins are leaked (with an error in the log) rather than returned to the pool.
//! Answers of an abandoned pass that come later (stragglers) are held by the issuer under the
//! same rule, and so is whatever it still holds when it is dropped.
//!
//! Answers carry the number of the synchronisation pass they belong to, so that a pass never
//! takes an earlier pass's straggler as its own.

use crate::error::{CollectiveError, ModelError};
use std::marker::PhantomData;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::RecvTimeoutError;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::Worker;
use crate::comm::{Queue, DRAIN_LIMIT};
use crate::types::Rank;
use crate::{DdpError, Result};

/// What the issuer thread is called in errors.
const WHAT: &str = "the NCCL issuer thread";

/// Numbers the passes of every issuer of this process.
static PASSES: AtomicU64 = AtomicU64::new(0);

/// One bucket for the issuer thread, tagged with its pass.
struct Tagged<J> {
    pass: u64,
    job: J,
}

/// The issuer's answer for one bucket: what to keep alive while NCCL works, or why the
/// bucket could not be queued.
struct Answer<P> {
    pass: u64,
    result: Result<P>,
}

/// What became of the queue, for pins that arrive late.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fate {
    /// Working: pins wait for the next successful wait.
    Live,
    /// Stopped and seen idle: pins can go at once.
    Drained,
    /// Stopped and never seen idle: pins are leaked.
    Stuck,
}

/// Every pin the issuer's answers carried (of any pass) that is not known finished yet, and
/// the queue's fate.
struct Held<P> {
    pins: Vec<P>,
    fate: Fate,
}

/// A thread that takes packed buckets in launch order and queues their collectives (one
/// thread: every rank queues its NCCL calls in the same order). The function it runs gets each
/// job and returns what must outlive the collective.
pub struct BucketIssuer<J, P> {
    worker: Option<Worker<Tagged<J>, Answer<P>>>,
    queue: Arc<dyn Queue>,
    held: Mutex<Held<P>>,
    rank: Rank,
}

impl<J, P> std::fmt::Debug for BucketIssuer<J, P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let held = self.held();
        f.debug_struct("BucketIssuer")
            .field("rank", &self.rank)
            .field("held", &held.pins.len())
            .field("fate", &held.fate)
            .finish()
    }
}

impl<J, P> BucketIssuer<J, P> {
    fn held(&self) -> MutexGuard<'_, Held<P>> {
        self.held.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Keeps `pins` until they are known finished.
    fn hold(&self, pins: P) {
        let mut held = self.held();
        match held.fate {
            Fate::Live => held.pins.push(pins),
            Fate::Drained => drop(pins),
            Fate::Stuck => leak(self.rank, vec![pins]),
        }
    }

    /// Pins held, not known finished yet.
    pub fn held_pins(&self) -> usize {
        self.held().pins.len()
    }

    /// After a successful wait of the queue: everything held is finished.
    fn release_held(&self) {
        let pins = std::mem::take(&mut self.held().pins);
        drop(pins);
    }

    /// After the queue was stopped: drains it (bounded) and releases everything held, or leaks
    /// it if the queue never goes idle. Later stragglers follow the same fate.
    fn settle_stopped(&self) {
        let mut held = self.held();
        let pins = std::mem::take(&mut held.pins);
        if held.fate == Fate::Live {
            held.fate = if self.queue.drain(DRAIN_LIMIT) {
                Fate::Drained
            } else {
                Fate::Stuck
            };
        }
        match held.fate {
            Fate::Stuck => leak(self.rank, pins),
            Fate::Live | Fate::Drained => drop(pins),
        }
    }
}

/// Leaks `pins`: their memory may still be in use by a transfer that never ended, and must not
/// go back to the pool.
fn leak<P>(rank: Rank, pins: Vec<P>) {
    if pins.is_empty() {
        return;
    }
    tracing::error!(
        "[rank {rank}] NCCL's stream did not go idle within {DRAIN_LIMIT:?} of its abort: \
         leaking {} gradient buffer(s) rather than handing memory a transfer may still use to \
         other tensors; restart the process to get it back",
        pins.len()
    );
    for p in pins {
        std::mem::forget(p);
    }
}

impl<J: Send + 'static, P: Send + 'static> BucketIssuer<J, P> {
    /// Starts the thread `burn-ddp-nccl-<rank>`, running `queue_job` on every job; the
    /// collectives it queues run on `queue`.
    ///
    /// # Errors
    /// [`DdpError::Io`] if the thread cannot be started.
    pub fn start(
        rank: Rank,
        queue: Arc<dyn Queue>,
        mut queue_job: impl FnMut(J) -> Result<P> + Send + 'static,
    ) -> Result<Self> {
        let worker = Worker::start(format!("burn-ddp-nccl-{rank}"), move |t: Tagged<J>| {
            Answer {
                pass: t.pass,
                result: queue_job(t.job),
            }
        })?;
        Ok(Self {
            worker: Some(worker),
            queue,
            held: Mutex::new(Held {
                pins: Vec::new(),
                fate: Fate::Live,
            }),
            rank,
        })
    }

    fn stopped(&self) -> DdpError {
        DdpError::Collective(CollectiveError::WorkerStopped {
            rank: self.rank,
            what: WHAT,
        })
    }

    /// Hands `job` (a bucket of pass `pass`) over.
    ///
    /// # Errors
    /// [`CollectiveError::WorkerStopped`](crate::CollectiveError::WorkerStopped) if the thread has stopped.
    pub fn send(&self, pass: u64, job: J) -> Result<()> {
        match &self.worker {
            Some(w) if w.send(Tagged { pass, job }) => Ok(()),
            _ => Err(self.stopped()),
        }
    }

    /// The next answer of pass `pass` (whether its bucket was queued), waiting at most `wait`.
    /// Every answer's pins, older passes' stragglers included, are held until they are known
    /// finished.
    ///
    /// # Errors
    /// [`ModelError::GradSyncTimeout`](crate::ModelError::GradSyncTimeout) if none comes in time; [`CollectiveError::WorkerStopped`](crate::CollectiveError::WorkerStopped).
    fn receive(&self, pass: u64, wait: Duration) -> Result<Result<()>> {
        let Some(worker) = &self.worker else {
            return Err(self.stopped());
        };
        let deadline = Instant::now() + wait;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match worker.receive(left) {
                Ok(a) => {
                    let result = a.result.map(|pins| self.hold(pins));
                    if a.pass == pass {
                        return Ok(result);
                    }
                }
                Err(RecvTimeoutError::Timeout) => {
                    return Err(DdpError::Model(ModelError::GradSyncTimeout {
                        rank: self.rank,
                        waited: wait,
                    }))
                }
                Err(RecvTimeoutError::Disconnected) => return Err(self.stopped()),
            }
        }
    }
}

impl<J, P> Drop for BucketIssuer<J, P> {
    /// Stops the thread (after the job in hand) and takes the answers left; what was pinned is
    /// released only if the queue goes idle (bounded), else leaked.
    fn drop(&mut self) {
        let Some(worker) = self.worker.take() else {
            return;
        };
        let mut pins: Vec<P> = worker
            .stop()
            .into_iter()
            .filter_map(|a| a.result.ok())
            .collect();
        let mut held = self.held();
        pins.append(&mut held.pins);
        if pins.is_empty() {
            return;
        }
        let fate = match held.fate {
            Fate::Live if self.queue.drain(DRAIN_LIMIT) => Fate::Drained,
            Fate::Live => Fate::Stuck,
            fate => fate,
        };
        drop(held);
        match fate {
            Fate::Stuck => leak(self.rank, pins),
            Fate::Live | Fate::Drained => drop(pins),
        }
    }
}

/// The buckets one synchronisation pass handed to a [`BucketIssuer`]: how many, and how many have
/// not been answered yet. The issuer holds their pins, so dropping a pass never releases
/// memory a transfer may still use.
pub struct InFlight<P> {
    pass: u64,
    sent: usize,
    waiting: usize,
    _pins: PhantomData<fn() -> P>,
}

impl<P> std::fmt::Debug for InFlight<P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InFlight")
            .field("pass", &self.pass)
            .field("sent", &self.sent)
            .field("waiting", &self.waiting)
            .finish()
    }
}

impl<P> Default for InFlight<P> {
    fn default() -> Self {
        Self::new()
    }
}

impl<P> InFlight<P> {
    /// A new pass, with a number no earlier pass of this process had.
    pub fn new() -> Self {
        Self {
            pass: PASSES.fetch_add(1, Ordering::Relaxed),
            sent: 0,
            waiting: 0,
            _pins: PhantomData,
        }
    }

    /// This pass's number (tag its jobs with it).
    pub fn pass(&self) -> u64 {
        self.pass
    }

    /// Buckets handed over and not answered yet.
    pub fn waiting(&self) -> usize {
        self.waiting
    }

    /// Buckets handed over in all.
    pub fn sent(&self) -> usize {
        self.sent
    }
}

impl<P: Send + 'static> InFlight<P> {
    /// Hands `job` to `issuer` as one of this pass's buckets.
    ///
    /// # Errors
    /// [`CollectiveError::WorkerStopped`](crate::CollectiveError::WorkerStopped) if the issuer thread has stopped.
    pub fn send<J: Send + 'static>(&mut self, issuer: &BucketIssuer<J, P>, job: J) -> Result<()> {
        issuer.send(self.pass, job)?;
        self.sent += 1;
        self.waiting += 1;
        Ok(())
    }

    /// Waits (at most `wait` per bucket) until the issuer has answered for every bucket of
    /// this pass (the issuer holds what it queued). The first failure is returned after every
    /// answer is in (or one never comes).
    fn collect<J: Send + 'static>(
        &mut self,
        issuer: &BucketIssuer<J, P>,
        wait: Duration,
    ) -> Result<()> {
        let mut first = None;
        while self.waiting > 0 {
            match issuer.receive(self.pass, wait) {
                Ok(result) => {
                    self.waiting -= 1;
                    if let Err(e) = result {
                        first.get_or_insert(e);
                    }
                }
                Err(e) => {
                    first.get_or_insert(e);
                    break;
                }
            }
        }
        first.map_or(Ok(()), Err)
    }

    /// Ends the pass: every bucket's answer, then a wait of the queue; only then are its pins
    /// (and older passes' stragglers) released. On any failure the pass is abandoned (see
    /// [`InFlight::abandon`]) and the failure returned.
    ///
    /// # Errors
    /// The first bucket that could not be queued; [`ModelError::GradSyncTimeout`](crate::ModelError::GradSyncTimeout);
    /// [`CollectiveError::WorkerStopped`](crate::CollectiveError::WorkerStopped); the queue's wait.
    pub fn finish<J: Send + 'static>(
        &mut self,
        issuer: &BucketIssuer<J, P>,
        wait: Duration,
    ) -> Result<()> {
        match self
            .collect(issuer, wait)
            .and_then(|()| issuer.queue.wait())
        {
            Ok(()) => {
                issuer.release_held();
                Ok(())
            }
            Err(e) => Err(self.abandon(issuer, e, wait)),
        }
    }

    /// Gives the pass up after failure `e` (returned): stops the queue (the ranks are out of
    /// step: the other ranks are told, and their waits end naming this rank), takes every
    /// answer still owed (at most `wait` each), then drains the queue (bounded) before any pin
    /// goes; pins of a queue that never goes idle are leaked. Answers that never came are held
    /// by the issuer when they do, under the same fate.
    pub fn abandon<J: Send + 'static>(
        &mut self,
        issuer: &BucketIssuer<J, P>,
        e: DdpError,
        wait: Duration,
    ) -> DdpError {
        issuer.queue.fail_with(&e);
        self.settle_stopped(issuer, wait);
        e
    }

    /// For a queue its owner has already stopped without telling anyone (a membership that
    /// changed: the other ranks know, and the job's abort record now belongs to the next
    /// membership): takes every answer still owed (at most `wait` each), then drains the queue
    /// (bounded) before any pin goes, or leaks them if it never goes idle.
    pub fn settle_stopped<J: Send + 'static>(
        &mut self,
        issuer: &BucketIssuer<J, P>,
        wait: Duration,
    ) {
        let _ = self.collect(issuer, wait);
        issuer.settle_stopped();
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicUsize;

    use super::*;

    /// A stand-in for NCCL's stream: each queued transfer ends at a set time; stopping it ends
    /// running transfers shortly after (or never, when `stuck`), and refuses new ones, as
    /// `ncclCommAbort` does.
    #[derive(Default)]
    struct Stream {
        transfers: Mutex<Vec<Option<Instant>>>,
        stopped: Mutex<bool>,
        stuck: bool,
        /// Pins dropped, and pins dropped while their transfer was still running.
        released: AtomicUsize,
        early: AtomicUsize,
        fails: AtomicUsize,
    }

    impl Stream {
        fn stuck() -> Self {
            Self {
                stuck: true,
                ..Self::default()
            }
        }

        fn ended(&self, id: usize) -> bool {
            self.transfers.lock().unwrap()[id].is_some_and(|t| Instant::now() >= t)
        }

        fn all_ended(&self) -> bool {
            let now = Instant::now();
            self.transfers
                .lock()
                .unwrap()
                .iter()
                .all(|t| t.is_some_and(|t| now >= t))
        }

        fn poll(&self, limit: Duration) -> bool {
            let until = Instant::now() + limit;
            while Instant::now() < until {
                if self.all_ended() {
                    return true;
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            self.all_ended()
        }
    }

    /// What a job leaves pinned: its transfer's buffer. Dropping it while the transfer runs is
    /// the corruption this module exists to prevent.
    struct Pin {
        id: usize,
        stream: Arc<Stream>,
    }

    impl Drop for Pin {
        fn drop(&mut self) {
            if !self.stream.ended(self.id) {
                self.stream.early.fetch_add(1, Ordering::SeqCst);
            }
            self.stream.released.fetch_add(1, Ordering::SeqCst);
        }
    }

    impl Queue for Stream {
        fn wait(&self) -> Result<()> {
            if self.poll(Duration::from_secs(10)) && !*self.stopped.lock().unwrap() {
                Ok(())
            } else {
                Err(DdpError::Internal {
                    rank: Rank(0),
                    what: "the stand-in stream did not finish",
                })
            }
        }

        fn fail_with(&self, _: &DdpError) {
            self.fails.fetch_add(1, Ordering::SeqCst);
            *self.stopped.lock().unwrap() = true;
            let soon = Instant::now() + Duration::from_millis(30);
            for t in self.transfers.lock().unwrap().iter_mut() {
                if self.stuck {
                    if t.is_some_and(|t| t > Instant::now()) {
                        *t = None;
                    }
                } else if let Some(t) = t {
                    *t = (*t).min(soon);
                }
            }
        }

        fn drain(&self, limit: Duration) -> bool {
            self.poll(limit.min(Duration::from_millis(300)))
        }
    }

    /// A job: how long its transfer runs, how long the issuer takes to queue it, or a bucket
    /// that cannot be queued.
    #[derive(Clone, Copy)]
    enum FakeJob {
        Runs(u64),
        SlowToQueue(u64, u64),
        Refused,
    }

    fn issuer(stream: &Arc<Stream>) -> BucketIssuer<FakeJob, Pin> {
        let s = Arc::clone(stream);
        BucketIssuer::start(Rank(0), Arc::clone(stream) as Arc<dyn Queue>, move |job| {
            let (queue_ms, run_ms) = match job {
                FakeJob::Runs(ms) => (0, ms),
                FakeJob::SlowToQueue(q, ms) => (q, ms),
                FakeJob::Refused => {
                    return Err(DdpError::Internal {
                        rank: Rank(0),
                        what: "unlucky bucket",
                    })
                }
            };
            std::thread::sleep(Duration::from_millis(queue_ms));
            // Queued under the stream's lock, as NCCL queues under the communicator's: after a
            // stop, nothing is queued any more.
            let stopped = s.stopped.lock().unwrap();
            if *stopped {
                return Err(DdpError::Internal {
                    rank: Rank(0),
                    what: "the communicator was aborted",
                });
            }
            let mut transfers = s.transfers.lock().unwrap();
            transfers.push(Some(Instant::now() + Duration::from_millis(run_ms)));
            Ok(Pin {
                id: transfers.len() - 1,
                stream: Arc::clone(&s),
            })
        })
        .unwrap()
    }

    fn pass(issuer: &BucketIssuer<FakeJob, Pin>, jobs: &[FakeJob]) -> InFlight<Pin> {
        let mut pass = InFlight::new();
        for &j in jobs {
            pass.send(issuer, j).unwrap();
        }
        pass
    }

    const WAIT: Duration = Duration::from_secs(10);

    #[test]
    fn a_finished_pass_releases_its_pins_only_after_the_wait() {
        let stream = Arc::new(Stream::default());
        let l = issuer(&stream);
        let mut p = pass(
            &l,
            &[FakeJob::Runs(40), FakeJob::Runs(80), FakeJob::Runs(10)],
        );
        p.finish(&l, WAIT).unwrap();
        assert_eq!(p.waiting(), 0);
        assert_eq!(l.held_pins(), 0);
        assert_eq!(stream.released.load(Ordering::SeqCst), 3);
        assert_eq!(stream.early.load(Ordering::SeqCst), 0);
        assert_eq!(stream.fails.load(Ordering::SeqCst), 0);
    }

    #[test]
    fn a_bucket_that_cannot_be_queued_stops_the_stream_before_any_pin_goes() {
        let stream = Arc::new(Stream::default());
        let l = issuer(&stream);
        // Buckets 0 and 2 are queued and run for seconds; bucket 1 fails (0.21's `finish`
        // used to return here and drop the step, pins included).
        let mut p = pass(
            &l,
            &[FakeJob::Runs(5_000), FakeJob::Refused, FakeJob::Runs(5_000)],
        );
        let e = p.finish(&l, WAIT).unwrap_err();
        assert!(e.to_string().contains("unlucky bucket"), "{e}");
        assert_eq!(stream.fails.load(Ordering::SeqCst), 1);
        assert_eq!(stream.released.load(Ordering::SeqCst), 2);
        assert_eq!(stream.early.load(Ordering::SeqCst), 0);
    }

    #[test]
    fn answers_that_come_after_a_timeout_are_held_until_the_stream_drained() {
        let stream = Arc::new(Stream::default());
        let l = issuer(&stream);
        // The issuer takes 200 ms to queue the second bucket: the pass gives up at 50 ms.
        let mut p = pass(
            &l,
            &[FakeJob::Runs(2_000), FakeJob::SlowToQueue(200, 2_000)],
        );
        let e = p.finish(&l, Duration::from_millis(50)).unwrap_err();
        assert!(
            matches!(e, DdpError::Model(ModelError::GradSyncTimeout { .. })),
            "{e:?}"
        );
        // Abandoned: stopped, every answer taken (the slow one was queued before the stop, or
        // refused after it), drained, released.
        assert_eq!(stream.fails.load(Ordering::SeqCst), 1);
        std::thread::sleep(Duration::from_millis(300));
        drop(l);
        assert_eq!(stream.early.load(Ordering::SeqCst), 0);
    }

    #[test]
    fn a_dropped_pass_leaves_its_pins_to_the_launcher_and_the_next_pass_skips_its_answers() {
        let stream = Arc::new(Stream::default());
        let l = issuer(&stream);
        // Sent, never finished: the pass is simply forgotten.
        let _ = pass(&l, &[FakeJob::Runs(300), FakeJob::Runs(300)]);
        let mut p = pass(&l, &[FakeJob::Runs(5), FakeJob::Runs(5)]);
        assert_ne!(p.pass(), InFlight::<Pin>::new().pass());
        // The new pass's wait covers the old transfers too (one stream, in order): only then
        // do the old pins go.
        p.finish(&l, WAIT).unwrap();
        assert_eq!(stream.released.load(Ordering::SeqCst), 4);
        assert_eq!(stream.early.load(Ordering::SeqCst), 0);
        assert_eq!(stream.fails.load(Ordering::SeqCst), 0);
    }

    #[test]
    fn pins_of_a_stream_that_never_drains_are_leaked_not_released() {
        let stream = Arc::new(Stream::stuck());
        let l = issuer(&stream);
        let mut p = pass(&l, &[FakeJob::Runs(60_000), FakeJob::Refused]);
        let e = p.finish(&l, WAIT).unwrap_err();
        assert!(e.to_string().contains("unlucky bucket"), "{e}");
        assert_eq!(stream.fails.load(Ordering::SeqCst), 1);
        drop(l);
        assert_eq!(stream.released.load(Ordering::SeqCst), 0);
        assert_eq!(stream.early.load(Ordering::SeqCst), 0);
    }

    #[test]
    fn a_launcher_dropped_with_pins_held_waits_for_the_stream_first() {
        let stream = Arc::new(Stream::default());
        let l = issuer(&stream);
        let mut p = pass(&l, &[FakeJob::Runs(150)]);
        // Answered (held by the issuer), never finished.
        assert!(p.collect(&l, WAIT).is_ok());
        assert_eq!(l.held_pins(), 1);
        let _ = p;
        drop(l);
        assert_eq!(stream.released.load(Ordering::SeqCst), 1);
        assert_eq!(stream.early.load(Ordering::SeqCst), 0);
    }

    #[test]
    fn a_pass_that_fails_before_sending_still_stops_the_stream_and_drains_older_pins() {
        let stream = Arc::new(Stream::default());
        let l = issuer(&stream);
        let _ = pass(&l, &[FakeJob::Runs(3_000)]);
        std::thread::sleep(Duration::from_millis(50)); // queued before the stop
        let mut p = InFlight::<Pin>::new();
        let e = p.abandon(
            &l,
            DdpError::Internal {
                rank: Rank(0),
                what: "a gradient of the wrong size",
            },
            WAIT,
        );
        assert!(e.to_string().contains("wrong size"), "{e}");
        assert_eq!(stream.fails.load(Ordering::SeqCst), 1);
        drop(l);
        assert_eq!(stream.released.load(Ordering::SeqCst), 1);
        assert_eq!(stream.early.load(Ordering::SeqCst), 0);
    }

    #[test]
    fn a_stream_its_owner_stopped_is_drained_without_telling_anyone() {
        let stream = Arc::new(Stream::default());
        let l = issuer(&stream);
        let mut p = pass(&l, &[FakeJob::Runs(5_000), FakeJob::Runs(5_000)]);
        std::thread::sleep(Duration::from_millis(50)); // both queued
                                                       // The owner aborts the communicator itself (a membership change), as NCCL's abort does.
        for t in stream.transfers.lock().unwrap().iter_mut().flatten() {
            *t = (*t).min(Instant::now() + Duration::from_millis(30));
        }
        p.settle_stopped(&l, WAIT);
        assert_eq!(stream.fails.load(Ordering::SeqCst), 0, "told the others");
        assert_eq!(stream.released.load(Ordering::SeqCst), 2);
        assert_eq!(stream.early.load(Ordering::SeqCst), 0);
    }

    #[test]
    fn a_missing_answer_is_a_timeout_not_a_hang() {
        let stream = Arc::new(Stream::default());
        let l = issuer(&stream);
        let mut p = pass(&l, &[FakeJob::SlowToQueue(2_000, 1)]);
        let e = p.collect(&l, Duration::from_millis(50)).unwrap_err();
        assert!(
            matches!(
                e,
                DdpError::Model(ModelError::GradSyncTimeout { rank: Rank(0), .. })
            ),
            "{e:?}"
        );
    }
}
