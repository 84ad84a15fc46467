//! A thread that does something every interval until it is told to stop: the heartbeat's
//! watcher, a fault-tolerant process's watch for joining processes, and the elastic launcher's
//! beat and watch of its round. The one periodic-thread helper of the crate.

use std::ops::ControlFlow;
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

/// The thread; dropping this stops it (waking it at once) and waits for it.
#[derive(Debug)]
pub(crate) struct Periodic {
    stop: Arc<(Mutex<bool>, Condvar)>,
    thread: Option<JoinHandle<()>>,
}

impl Periodic {
    /// Runs `tick` at once on a thread named `name`, then every `interval`, until `tick`
    /// breaks or this value is dropped. A thread the system cannot start runs nothing.
    pub(crate) fn spawn(
        name: String,
        interval: Duration,
        tick: impl FnMut() -> ControlFlow<()> + Send + 'static,
    ) -> Self {
        Self::try_spawn(name, interval, tick).unwrap_or_else(|_| Self {
            stop: Arc::default(),
            thread: None,
        })
    }

    /// As [`Periodic::spawn`], failing when the system cannot start the thread.
    ///
    /// # Errors
    /// The operating system's, if the thread cannot be spawned.
    pub(crate) fn try_spawn(
        name: String,
        interval: Duration,
        mut tick: impl FnMut() -> ControlFlow<()> + Send + 'static,
    ) -> std::io::Result<Self> {
        let stop = Arc::new((Mutex::new(false), Condvar::new()));
        let flag = Arc::clone(&stop);
        let thread = std::thread::Builder::new().name(name).spawn(move || {
            let (lock, cv) = &*flag;
            while tick().is_continue() {
                let guard = lock.lock().unwrap_or_else(|p| p.into_inner());
                let (guard, _) = cv
                    .wait_timeout_while(guard, interval, |stopped| !*stopped)
                    .unwrap_or_else(|p| p.into_inner());
                if *guard {
                    return;
                }
            }
        })?;
        Ok(Self {
            stop,
            thread: Some(thread),
        })
    }
}

impl Drop for Periodic {
    fn drop(&mut self) {
        let (lock, cv) = &*self.stop;
        *lock.lock().unwrap_or_else(|p| p.into_inner()) = true;
        cv.notify_all();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::time::Instant;

    use super::*;

    #[test]
    fn ticks_until_dropped_and_a_drop_does_not_wait_out_the_interval() {
        let n = Arc::new(AtomicU32::new(0));
        let p = {
            let n = Arc::clone(&n);
            Periodic::spawn("t".into(), Duration::from_secs(3600), move || {
                n.fetch_add(1, Ordering::SeqCst);
                ControlFlow::Continue(())
            })
        };
        while n.load(Ordering::SeqCst) == 0 {
            std::thread::yield_now();
        }
        let dropped = Instant::now();
        drop(p);
        assert!(dropped.elapsed() < Duration::from_secs(60));
        assert_eq!(n.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn a_tick_that_breaks_ends_the_thread() {
        let n = Arc::new(AtomicU32::new(0));
        let p = {
            let n = Arc::clone(&n);
            Periodic::spawn("t".into(), Duration::from_millis(1), move || {
                if n.fetch_add(1, Ordering::SeqCst) == 2 {
                    ControlFlow::Break(())
                } else {
                    ControlFlow::Continue(())
                }
            })
        };
        let mut p = p;
        p.thread.take().unwrap().join().unwrap();
        assert_eq!(n.load(Ordering::SeqCst), 3);
    }
}
