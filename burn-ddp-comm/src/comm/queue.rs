//! [`Queue`]: a stream of collectives on device memory (an NCCL communicator's), as far as
//! releasing the buffers it works on needs it. The gradient issuer (`grad/issue.rs`) holds
//! those buffers until a queue says they are no longer in use; `cuda/nccl/` implements it.

use std::time::Duration;

use crate::error::{DdpError, Result};

/// How long a stopped queue may take to go idle before the buffers it used are leaked.
pub const DRAIN_LIMIT: Duration = Duration::from_secs(10);

/// The stream collectives are queued on (an NCCL communicator's), as far as the release of the
/// buffers they work on needs it.
pub trait Queue: Send + Sync {
    /// Waits, with the collective deadline, for everything queued so far.
    ///
    /// # Errors
    /// The deadline, or the work failed: nothing is known finished then.
    fn wait(&self) -> Result<()>;

    /// Stops the queue after failure `e` (NCCL: `ncclCommAbort`, which ends kernels waiting
    /// for peers), telling the other ranks. Nothing queued later runs.
    fn fail_with(&self, e: &DdpError);

    /// After [`Queue::fail_with`]: waits at most `limit` for the work queued before to finish or
    /// stop. `true`: none of it runs any more.
    fn drain(&self, limit: Duration) -> bool;
}
