//! [`DeviceDrain`]: what a Burn line's gradient sync runs when it goes away — a wait for the
//! work still queued on the prepared model's devices, on a thread of its own, with a deadline.
//!
//! Why: a program that returns right after queueing GPU work (a failed step, a rank that leaves
//! a job) died of SIGSEGV at exit on a GPU: Burn's CUDA backend compiles queued kernels with
//! NVRTC on a device thread, and `exit` unloaded NVRTC under it (seen on an H200, 2026-11-26,
//! `docs/gpu-verification.md`). Both Burn lines compile CUDA kernels that way, so both hold one.

use std::sync::mpsc::RecvTimeoutError;
use std::sync::Mutex;
use std::time::Duration;

use crate::Rank;

/// How long a [`DeviceDrain`] waits for the devices' queued work.
pub const DEVICE_DRAIN_LIMIT: Duration = Duration::from_secs(30);

/// The wait a line sets when it prepares a model (`set`: a closure that synchronises each of
/// the model's devices) and runs once when its session ends (`run`, at most a deadline).
#[derive(Default)]
pub struct DeviceDrain(Mutex<Option<DeviceSync>>);

/// A line's wait for its devices: the first device error as text.
type DeviceSync = Box<dyn FnOnce() -> Result<(), String> + Send>;

impl std::fmt::Debug for DeviceDrain {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceDrain")
            .field("set", &self.slot().is_some())
            .finish()
    }
}

/// How a [`DeviceDrain::run`] ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DrainOutcome {
    /// Nothing was set (no model prepared, or the drain ran already).
    Nothing,
    /// The devices' queued work finished.
    Done,
    /// A device reported an error while it was waited for (the program has it from its own
    /// calls; said here for the log).
    DeviceError(String),
    /// The deadline passed first: the process goes on without it.
    TimedOut,
    /// The wait panicked (in the backend), or its thread could not be started.
    Failed(String),
}

impl DeviceDrain {
    fn slot(&self) -> std::sync::MutexGuard<'_, Option<DeviceSync>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// What to run when the session ends (replacing what was set before): synchronise the
    /// prepared model's devices, returning the first error as text.
    pub fn set(&self, sync: impl FnOnce() -> Result<(), String> + Send + 'static) {
        *self.slot() = Some(Box::new(sync));
    }

    /// Runs what was set, once, on a thread of its own, waiting at most `limit`; logs anything
    /// but a clean end as a warning from `rank`.
    pub fn run(&self, rank: Rank, limit: Duration) -> DrainOutcome {
        let Some(sync) = self.slot().take() else {
            return DrainOutcome::Nothing;
        };
        let (done, finished) = std::sync::mpsc::channel();
        let spawned = std::thread::Builder::new()
            .name("burn-ddp-drain".into())
            .spawn(move || {
                let _ = done.send(sync());
            });
        let outcome = match spawned {
            Err(e) => DrainOutcome::Failed(format!("its thread could not be started: {e}")),
            Ok(_) => match finished.recv_timeout(limit) {
                Ok(Ok(())) => DrainOutcome::Done,
                Ok(Err(e)) => DrainOutcome::DeviceError(e),
                Err(RecvTimeoutError::Timeout) => DrainOutcome::TimedOut,
                // The closure did not send: it panicked (the panic message is on stderr).
                Err(RecvTimeoutError::Disconnected) => {
                    DrainOutcome::Failed("the wait panicked in the backend".into())
                }
            },
        };
        let said = match &outcome {
            DrainOutcome::Nothing | DrainOutcome::Done => return outcome,
            DrainOutcome::DeviceError(e) => format!("a device reported an error: {e}"),
            DrainOutcome::TimedOut => format!("it did not finish in {} s", limit.as_secs()),
            DrainOutcome::Failed(why) => why.clone(),
        };
        tracing::warn!(
            "[rank {rank}] waiting for the device work queued when the gradient sync ended: \
             {said}; going on without it"
        );
        outcome
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const R: Rank = Rank(1);

    #[test]
    fn it_runs_what_was_set_once() {
        let d = DeviceDrain::default();
        assert_eq!(d.run(R, DEVICE_DRAIN_LIMIT), DrainOutcome::Nothing);
        let (tx, rx) = std::sync::mpsc::channel();
        d.set(move || {
            tx.send(()).unwrap();
            Ok(())
        });
        assert_eq!(d.run(R, DEVICE_DRAIN_LIMIT), DrainOutcome::Done);
        assert!(rx.try_recv().is_ok());
        assert_eq!(d.run(R, DEVICE_DRAIN_LIMIT), DrainOutcome::Nothing);
    }

    #[test]
    fn a_late_a_failed_and_a_panicking_wait_are_told_apart() {
        let d = DeviceDrain::default();
        d.set(|| {
            std::thread::sleep(Duration::from_secs(2));
            Ok(())
        });
        assert_eq!(d.run(R, Duration::from_millis(50)), DrainOutcome::TimedOut);
        d.set(|| Err("CUDA_ERROR_LAUNCH_FAILED".into()));
        assert_eq!(
            d.run(R, DEVICE_DRAIN_LIMIT),
            DrainOutcome::DeviceError("CUDA_ERROR_LAUNCH_FAILED".into())
        );
        d.set(|| panic!("backend bug"));
        assert!(
            matches!(d.run(R, DEVICE_DRAIN_LIMIT), DrainOutcome::Failed(w) if w.contains("panicked"))
        );
    }
}
