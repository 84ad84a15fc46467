//! [`Launcher`] and [`InFlight`]: the device transports' launcher thread, without Burn and
//! without CUDA. Both Burn lines' NCCL paths hand it their packed buckets (Burn's queued
//! tensors, which only that line can name) with a function that makes them exist and queues
//! the all-reduce; it answers with what must stay alive until NCCL is done (the "pins").
//!
//! Answers carry the number of the synchronisation pass they belong to: a pass abandoned after
//! a failure can leave answers behind, and the next pass skips them instead of taking them as
//! its own.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::RecvTimeoutError;
use std::time::{Duration, Instant};

use super::Worker;
use crate::types::Rank;
use crate::{DdpError, Result};

/// What the launcher thread is called in errors.
const WHAT: &str = "the NCCL launcher thread";

/// Numbers the passes of every launcher of this process.
static PASSES: AtomicU64 = AtomicU64::new(0);

/// One bucket for the launcher thread, tagged with its pass.
struct Tagged<J> {
    pass: u64,
    job: J,
}

/// The launcher's answer for one bucket: what to keep alive while NCCL works, or why the
/// bucket could not be queued.
struct Answer<P> {
    pass: u64,
    result: Result<P>,
}

/// A thread that takes packed buckets in launch order and queues their collectives (one
/// thread: every rank queues its NCCL calls in the same order). The function it runs gets each
/// job and returns what must outlive the collective.
pub struct Launcher<J, P> {
    worker: Worker<Tagged<J>, Answer<P>>,
    rank: Rank,
}

impl<J, P> std::fmt::Debug for Launcher<J, P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Launcher")
            .field("rank", &self.rank)
            .finish()
    }
}

impl<J: Send + 'static, P: Send + 'static> Launcher<J, P> {
    /// Starts the thread `burn-ddp-nccl-<rank>`, running `queue` on every job.
    ///
    /// # Errors
    /// [`DdpError::Io`] if the thread cannot be started.
    pub fn start(
        rank: Rank,
        mut queue: impl FnMut(J) -> Result<P> + Send + 'static,
    ) -> Result<Self> {
        let worker = Worker::start(format!("burn-ddp-nccl-{rank}"), move |t: Tagged<J>| {
            Answer {
                pass: t.pass,
                result: queue(t.job),
            }
        })?;
        Ok(Self { worker, rank })
    }

    /// Hands `job` (a bucket of pass `pass`) over.
    ///
    /// # Errors
    /// [`DdpError::WorkerStopped`] if the thread has stopped.
    pub fn send(&self, pass: u64, job: J) -> Result<()> {
        if self.worker.send(Tagged { pass, job }) {
            return Ok(());
        }
        Err(DdpError::WorkerStopped {
            rank: self.rank,
            what: WHAT,
        })
    }

    /// The next answer of pass `pass` (older passes' stragglers are dropped), waiting at most
    /// `wait`.
    ///
    /// # Errors
    /// [`DdpError::GradSyncTimeout`] if none comes in time; [`DdpError::WorkerStopped`].
    fn receive(&self, pass: u64, wait: Duration) -> Result<Result<P>> {
        let deadline = Instant::now() + wait;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.worker.receive(left) {
                Ok(a) if a.pass == pass => return Ok(a.result),
                Ok(_) => continue,
                Err(RecvTimeoutError::Timeout) => {
                    return Err(DdpError::GradSyncTimeout {
                        rank: self.rank,
                        waited: wait,
                    })
                }
                Err(RecvTimeoutError::Disconnected) => {
                    return Err(DdpError::WorkerStopped {
                        rank: self.rank,
                        what: WHAT,
                    })
                }
            }
        }
    }
}

/// The buckets one synchronisation pass handed to a [`Launcher`]: how many have not been
/// answered yet, and the pins of those queued (kept until the communicator's stream has been
/// waited for).
pub struct InFlight<P> {
    pass: u64,
    waiting: usize,
    pins: Vec<P>,
}

impl<P> std::fmt::Debug for InFlight<P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InFlight")
            .field("pass", &self.pass)
            .field("waiting", &self.waiting)
            .field("queued", &self.pins.len())
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
            waiting: 0,
            pins: Vec::new(),
        }
    }

    /// This pass's number (tag its jobs with it).
    pub fn pass(&self) -> u64 {
        self.pass
    }

    /// Hands `job` to `launcher` as one of this pass's buckets.
    ///
    /// # Errors
    /// [`DdpError::WorkerStopped`] if the launcher thread has stopped.
    pub fn send<J: Send + 'static>(&mut self, launcher: &Launcher<J, P>, job: J) -> Result<()>
    where
        P: Send + 'static,
    {
        launcher.send(self.pass, job)?;
        self.waiting += 1;
        Ok(())
    }

    /// Buckets handed over and not answered yet.
    pub fn waiting(&self) -> usize {
        self.waiting
    }

    /// Waits (at most `wait` per bucket) until the launcher has answered for every bucket of
    /// this pass, keeping what it queued pinned. The first failure is returned after every
    /// answer is in (or one never comes), so that nothing queued loses its pins early.
    ///
    /// # Errors
    /// The first bucket that could not be queued; [`DdpError::GradSyncTimeout`];
    /// [`DdpError::WorkerStopped`].
    pub fn collect<J: Send + 'static>(
        &mut self,
        launcher: &Launcher<J, P>,
        wait: Duration,
    ) -> Result<()>
    where
        P: Send + 'static,
    {
        let mut first = None;
        while self.waiting > 0 {
            match launcher.receive(self.pass, wait) {
                Ok(result) => {
                    self.waiting -= 1;
                    match result {
                        Ok(pins) => self.pins.push(pins),
                        Err(e) => {
                            first.get_or_insert(e);
                        }
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

    /// Drops the pins: call only after the communicator's stream has been waited for.
    pub fn release(&mut self) {
        self.pins.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pass_takes_its_own_answers_and_skips_stragglers() {
        let launcher = Launcher::start(Rank(0), |n: u32| {
            if n == 13 {
                Err(DdpError::Internal {
                    rank: Rank(0),
                    what: "unlucky bucket",
                })
            } else {
                Ok(n * 2)
            }
        })
        .unwrap();
        // An abandoned pass leaves two answers behind.
        let mut old = InFlight::new();
        old.send(&launcher, 1).unwrap();
        old.send(&launcher, 2).unwrap();

        let mut pass = InFlight::new();
        assert_ne!(pass.pass(), old.pass());
        pass.send(&launcher, 3).unwrap();
        pass.send(&launcher, 4).unwrap();
        assert_eq!(pass.waiting(), 2);
        pass.collect(&launcher, Duration::from_secs(10)).unwrap();
        assert_eq!(pass.waiting(), 0);
        assert_eq!(pass.pins, vec![6, 8]);
        pass.release();
        assert!(pass.pins.is_empty());

        // A failed bucket is reported once every answer is in; the others stay pinned.
        let mut pass = InFlight::new();
        for n in [5, 13, 7] {
            pass.send(&launcher, n).unwrap();
        }
        let e = pass
            .collect(&launcher, Duration::from_secs(10))
            .unwrap_err();
        assert!(e.to_string().contains("unlucky bucket"), "{e}");
        assert_eq!(pass.pins, vec![10, 14]);
    }

    #[test]
    fn a_missing_answer_is_a_timeout_not_a_hang() {
        let launcher = Launcher::start(Rank(3), |n: u64| {
            std::thread::sleep(Duration::from_millis(n));
            Ok(())
        })
        .unwrap();
        let mut pass = InFlight::new();
        pass.send(&launcher, 2_000).unwrap();
        let e = pass
            .collect(&launcher, Duration::from_millis(50))
            .unwrap_err();
        assert!(
            matches!(e, DdpError::GradSyncTimeout { rank: Rank(3), .. }),
            "{e:?}"
        );
    }
}
