//! Waiting for GPU work with a deadline.
//!
//! NCCL collectives are queued on a stream and complete on the GPU; a peer that dies leaves them
//! spinning forever. So nothing here blocks in the driver: the waiter polls the stream's
//! completion, NCCL's asynchronous error, and the job's abort record (which the store holds as
//! soon as any rank reports a failure or the heartbeat names a dead rank), and gives up at the
//! deadline. The caller then aborts the communicator, which stops the kernels.

use std::time::{Duration, Instant};

use crate::error::DdpError;

/// What one poll of the GPU work found.
#[derive(Debug)]
pub(crate) enum Poll {
    /// Everything waited for has completed.
    Done,
    /// Still running.
    Pending,
    /// It failed (a CUDA or NCCL error).
    Failed(DdpError),
}

/// How a wait ended without completion.
#[derive(Debug)]
pub(crate) enum Stop {
    /// The deadline passed.
    TimedOut,
    /// The work failed.
    Failed(DdpError),
    /// Another rank reported a failure of the job.
    Aborted(DdpError),
}

/// Polls `work` until it is done, fails, `job` reports an abort (checked every `job_every`), or
/// `deadline` passes. Sleeps grow from a few microseconds to 1 ms, so short collectives return
/// promptly and long ones cost no CPU.
pub(crate) fn wait_for(
    deadline: Instant,
    job_every: Duration,
    mut work: impl FnMut() -> Poll,
    mut job: impl FnMut() -> Option<DdpError>,
) -> Result<(), Stop> {
    let mut sleep = Duration::from_micros(2);
    let mut next_job_check = Instant::now();
    loop {
        match work() {
            Poll::Done => return Ok(()),
            Poll::Failed(e) => return Err(Stop::Failed(e)),
            Poll::Pending => {}
        }
        let now = Instant::now();
        if now >= next_job_check {
            if let Some(e) = job() {
                return Err(Stop::Aborted(e));
            }
            next_job_check = now + job_every;
        }
        if now >= deadline {
            return Err(Stop::TimedOut);
        }
        std::thread::sleep(sleep.min(deadline - now));
        sleep = (sleep * 2).min(Duration::from_millis(1));
    }
}

#[cfg(test)]
mod tests {
    use crate::error::CudaError;
    use std::cell::Cell;

    use super::*;
    use crate::types::Rank;

    fn far() -> Instant {
        Instant::now() + Duration::from_secs(60)
    }

    #[test]
    fn returns_when_the_work_completes() {
        let polls = Cell::new(0);
        let r = wait_for(
            far(),
            Duration::from_secs(1),
            || {
                polls.set(polls.get() + 1);
                if polls.get() == 5 {
                    Poll::Done
                } else {
                    Poll::Pending
                }
            },
            || None,
        );
        assert!(r.is_ok());
        assert_eq!(polls.get(), 5);
    }

    #[test]
    fn a_deadline_ends_the_wait() {
        let start = Instant::now();
        let r = wait_for(
            start + Duration::from_millis(50),
            Duration::from_secs(1),
            || Poll::Pending,
            || None,
        );
        assert!(matches!(r, Err(Stop::TimedOut)), "{r:?}");
        let took = start.elapsed();
        assert!(took >= Duration::from_millis(50), "{took:?}");
    }

    #[test]
    fn an_abort_elsewhere_ends_the_wait_and_failures_pass_through() {
        let checks = Cell::new(0);
        let r = wait_for(
            far(),
            Duration::from_millis(1),
            || Poll::Pending,
            || {
                checks.set(checks.get() + 1);
                (checks.get() == 3).then_some(DdpError::Internal {
                    rank: Rank(0),
                    what: "x",
                })
            },
        );
        assert!(matches!(r, Err(Stop::Aborted(_))), "{r:?}");
        let r = wait_for(
            far(),
            Duration::from_secs(1),
            || {
                Poll::Failed(DdpError::Cuda(CudaError::Driver {
                    rank: Rank(0),
                    what: "cuStreamQuery".into(),
                    detail: "CUDA_ERROR_ILLEGAL_ADDRESS".into(),
                }))
            },
            || None,
        );
        assert!(
            matches!(
                r,
                Err(Stop::Failed(DdpError::Cuda(CudaError::Driver { .. })))
            ),
            "{r:?}"
        );
    }
}
