//! The public face of the rendezvous store: a small key-value store shared by every rank.

use crate::error::RendezvousError;
use std::sync::Arc;
use std::time::Duration;

use super::client::{StoreClient, WaitOutcome};
use crate::error::{DdpError, Result};

/// Keys written through [`Store`] live under this prefix, apart from burn-ddp's own keys.
const USER_PREFIX: &str = "user/";

/// A handle on the job's rendezvous store (served by rank 0), like `torch.distributed.Store`.
///
/// Keys are namespaced: what users write here cannot clash with the keys burn-ddp itself uses
/// for rendezvous and transport set-up. Every call that waits is bounded by the group's store
/// timeout or by the timeout it is given.
///
/// ```no_run
/// # fn main() -> burn_ddp_comm::Result<()> {
/// let pg = burn_ddp_comm::ProcessGroup::from_env()?;
/// if let Some(store) = pg.store() {
///     if pg.is_main() {
///         store.set("dataset-version", b"v3")?;
///     }
///     let version = store.get("dataset-version")?;
///     let arrivals = store.add("arrived", 1)?;
///     # let _ = (version, arrivals);
/// }
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct Store {
    client: Arc<StoreClient>,
}

impl Store {
    pub(crate) fn new(client: Arc<StoreClient>) -> Self {
        Self { client }
    }

    fn key(key: &str) -> String {
        format!("{USER_PREFIX}{key}")
    }

    /// Sets `key` to `value`, replacing any earlier value.
    ///
    /// # Errors
    /// The store is unreachable, the job was aborted, or the key or value exceeds the frame limit.
    pub fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.client.set(&Self::key(key), value)
    }

    /// Returns the value of `key`, waiting for it to be set (at most the group's store timeout).
    ///
    /// # Errors
    /// [`RendezvousError::StoreTimeout`](crate::RendezvousError::StoreTimeout) if nobody sets the key in time; store or job failures.
    pub fn get(&self, key: &str) -> Result<Vec<u8>> {
        self.client.get(&Self::key(key))
    }

    /// Like [`Store::get`], waiting at most `timeout`.
    ///
    /// # Errors
    /// As [`Store::get`].
    pub fn get_timeout(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        self.client.get_timeout(&Self::key(key), timeout)
    }

    /// Atomically adds `delta` to the integer counter `key` (absent counts as 0) and returns the
    /// new value.
    ///
    /// # Errors
    /// The key holds something that is not a counter; store or job failures.
    pub fn add(&self, key: &str, delta: i64) -> Result<i64> {
        self.client.add(&Self::key(key), delta)
    }

    /// Waits until every key in `keys` exists, at most `timeout`.
    ///
    /// # Errors
    /// [`RendezvousError::StoreTimeout`](crate::RendezvousError::StoreTimeout) naming the first missing key; store or job failures.
    pub fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        let full: Vec<String> = keys.iter().map(|k| Self::key(k)).collect();
        match self.client.wait(&full, timeout)? {
            WaitOutcome::Ready => Ok(()),
            WaitOutcome::Missing(missing) => {
                let first = missing
                    .first()
                    .map_or("", |k| k.strip_prefix(USER_PREFIX).unwrap_or(k.as_str()));
                Err(DdpError::Rendezvous(RendezvousError::StoreTimeout {
                    rank: self.client.rank(),
                    op: "wait",
                    key: first.to_owned(),
                    waited: timeout,
                }))
            }
        }
    }

    /// Sets `key` to `desired` if its current value is `expected` (`None`: the key is absent),
    /// and returns the value the key holds afterwards — `desired` if the swap happened.
    ///
    /// # Errors
    /// Store or job failures.
    pub fn compare_set(
        &self,
        key: &str,
        expected: Option<&[u8]>,
        desired: &[u8],
    ) -> Result<Vec<u8>> {
        self.client.compare_set(&Self::key(key), expected, desired)
    }

    /// Removes `key`; returns whether it existed.
    ///
    /// # Errors
    /// Store or job failures.
    pub fn delete(&self, key: &str) -> Result<bool> {
        self.client.delete(&Self::key(key))
    }
}
