//! [`Worker`]: a thread that takes jobs in order and answers each, in order. The gradient
//! transports' communication threads (host-staged and NCCL) are workers, so buckets leave every
//! rank in the order they were launched.

use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::thread::JoinHandle;
use std::time::Duration;

/// A named thread running `f` on each job sent to it; answers come back in job order. Dropping
/// it closes the job channel and joins the thread (after the job in hand).
pub struct Worker<J, R> {
    jobs: Option<Sender<J>>,
    done: Receiver<R>,
    thread: Option<JoinHandle<()>>,
}

impl<J, R> std::fmt::Debug for Worker<J, R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Worker")
            .field("running", &self.jobs.is_some())
            .finish()
    }
}

impl<J: Send + 'static, R: Send + 'static> Worker<J, R> {
    /// Starts the thread.
    ///
    /// # Errors
    /// The operating system's, if the thread cannot be spawned.
    pub fn start(
        name: String,
        mut f: impl FnMut(J) -> R + Send + 'static,
    ) -> std::io::Result<Self> {
        let (jobs, rx) = mpsc::channel::<J>();
        let (tx, done) = mpsc::channel::<R>();
        let thread = std::thread::Builder::new().name(name).spawn(move || {
            for job in rx {
                if tx.send(f(job)).is_err() {
                    break;
                }
            }
        })?;
        Ok(Self {
            jobs: Some(jobs),
            done,
            thread: Some(thread),
        })
    }

    /// Hands `job` over; `false` if the thread has stopped.
    pub fn send(&self, job: J) -> bool {
        self.jobs.as_ref().is_some_and(|tx| tx.send(job).is_ok())
    }

    /// The next answer, waiting at most `wait`.
    pub fn receive(&self, wait: Duration) -> Result<R, RecvTimeoutError> {
        self.done.recv_timeout(wait)
    }
}

impl<J, R> Worker<J, R> {
    /// Closes the job channel, joins the thread (after the jobs already sent) and returns the
    /// answers nobody took.
    pub fn stop(mut self) -> Vec<R> {
        self.join();
        self.done.try_iter().collect()
    }

    fn join(&mut self) {
        self.jobs = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl<J, R> Drop for Worker<J, R> {
    fn drop(&mut self) {
        self.join();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_come_back_in_job_order_and_drop_joins() {
        let w = Worker::start("test-worker".into(), |n: u32| {
            std::thread::sleep(Duration::from_millis(u64::from(5 - n)));
            n * 10
        })
        .unwrap();
        for n in 0..5 {
            assert!(w.send(n));
        }
        let got: Vec<u32> = (0..5)
            .map(|_| w.receive(Duration::from_secs(10)).unwrap())
            .collect();
        assert_eq!(got, vec![0, 10, 20, 30, 40]);
        assert!(matches!(
            w.receive(Duration::from_millis(10)),
            Err(RecvTimeoutError::Timeout)
        ));
        drop(w);
    }
}
