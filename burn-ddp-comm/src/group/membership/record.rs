//! The fault-tolerant job's records in the store: the keys outside every epoch's scope, how
//! member lists and counters are encoded, the world size the job started with, fresh member
//! ids, and the last decided membership (which the launcher reads).

use crate::error::RendezvousError;
use std::time::Duration;

use crate::store::{StoreClient, WaitOutcome};
use crate::types::Rank;
use crate::{DdpError, Result};

/// The store keys of the membership (outside every epoch's scope).
pub(super) mod keys {
    /// The members of epoch `e`, once decided (`"0,1,3"`).
    pub(crate) fn members(e: u64) -> String {
        format!("ft/m/{e}")
    }
    /// Member `id` checked in for epoch `e` (its host).
    pub(crate) fn checkin(e: u64, id: u32) -> String {
        format!("ft/in/{e}/{id}")
    }
    /// The count of the processes that checked in for epoch 0 (`StoreClient::arrive`).
    pub(crate) fn first_arrivals() -> &'static str {
        "ft/in-count/0"
    }
    /// The scope of epoch `e`'s group: its keys, its abort record.
    pub(crate) fn scope(e: u64) -> String {
        format!("ft/{e}")
    }
    /// Member `id` finished normally.
    pub(crate) fn finished(id: u32) -> String {
        format!("ft/finished/{id}")
    }
    /// Member `id` was let into the job (a member of some epoch).
    pub(crate) fn admitted(id: u32) -> String {
        format!("ft/admitted/{id}")
    }
    /// The newest decided epoch.
    pub(crate) const EPOCH: &str = "ft/epoch";
    /// How many member ids were handed to joining processes (counter).
    pub(crate) const NEXT_ID: &str = "ft/next-id";
    /// The world size the job started with (member ids below it are its first processes').
    pub(crate) const FIRST_WORLD: &str = "ft/first-world";
    /// How many times a process asked to join (counter the members watch).
    pub(crate) const JOINS: &str = "ft/joins";
}

pub(super) fn encode(ids: &[u32]) -> Vec<u8> {
    ids.iter()
        .map(u32::to_string)
        .collect::<Vec<_>>()
        .join(",")
        .into_bytes()
}

/// Parses a member list from the store (it came over the network: anything malformed is
/// `None`).
pub(super) fn decode(bytes: &[u8]) -> Option<Vec<u32>> {
    let text = std::str::from_utf8(bytes).ok()?;
    if text.is_empty() {
        return Some(Vec::new());
    }
    text.split(',').map(|t| t.parse().ok()).collect()
}

/// The value of `key` now, `None` when the store does not hold it (an error when the store
/// does not answer).
pub(super) fn get_now(store: &StoreClient, key: &str) -> Result<Option<Vec<u8>>> {
    get_within(store, key, Duration::ZERO)
}

/// The value of `key`, waiting up to `wait` for it (woken when it is set); `None` when it did
/// not appear.
pub(super) fn get_within(
    store: &StoreClient,
    key: &str,
    wait: Duration,
) -> Result<Option<Vec<u8>>> {
    match store.get_timeout(key, wait) {
        Ok(v) => Ok(Some(v)),
        // The store's own answer that the key is absent (not a reply that never came).
        Err(DdpError::Rendezvous(RendezvousError::StoreTimeout { .. })) if !store.is_broken() => {
            Ok(None)
        }
        Err(e) => Err(e),
    }
}

/// Records the world size the job starts with (the same from every process and launcher;
/// the first record stays). Member ids below it are the first processes' (`RANK`); joining
/// processes take ids above.
pub(crate) fn record_first_world(store: &StoreClient, world: u32) -> Result<u32> {
    let after = store.compare_set(keys::FIRST_WORLD, None, &world.to_le_bytes())?;
    Ok(<[u8; 4]>::try_from(after.as_slice()).map_or(world, u32::from_le_bytes))
}

/// The world size the job started with (waiting for it, within the store timeout).
pub(super) fn first_world(store: &StoreClient) -> Result<u32> {
    let v = store.get(keys::FIRST_WORLD)?;
    <[u8; 4]>::try_from(v.as_slice())
        .map(u32::from_le_bytes)
        .map_err(|_| {
            DdpError::Rendezvous(RendezvousError::StoreRequest {
                rank: store.rank(),
                op: "get",
                key: keys::FIRST_WORLD.into(),
                reason: "not a world size (another burn-ddp version?)".into(),
            })
        })
}

/// How many member ids were handed to joining processes so far (above the first world size).
pub(super) fn ids_handed_out(store: &StoreClient) -> Result<u32> {
    // A counter read by adding 0: one request on etcd too (a `get` of it takes two there).
    let n = store.add(keys::NEXT_ID, 0)?;
    Ok(u32::try_from(n.max(0)).unwrap_or(u32::MAX))
}

/// Member ids as the membership lines write them (`[m0, m2]`).
pub(crate) fn member_list(ids: &[u32]) -> String {
    let named: Vec<String> = ids.iter().map(|m| format!("m{m}")).collect();
    format!("[{}]", named.join(", "))
}

/// A fresh member id for a process joining the job.
pub(crate) fn fresh_member_id(store: &StoreClient) -> Result<u32> {
    let first = first_world(store)?;
    let n = store.add(keys::NEXT_ID, 1)?;
    Ok(first.saturating_add(u32::try_from(n - 1).unwrap_or(u32::MAX)))
}

/// The newest decided membership of a fault-tolerant job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct LastMembership {
    pub(crate) epoch: u64,
    pub(crate) members: Vec<u32>,
    /// For each member, whether it ended (finished normally, or gone).
    pub(crate) ended: Vec<bool>,
    /// For each member, whether it finished normally.
    pub(crate) finished: Vec<bool>,
}

impl LastMembership {
    /// Whether the job finished: every member of its last membership ended, one of them
    /// normally.
    pub(crate) fn finished_well(&self) -> bool {
        self.outcome().is_some() && self.finished.iter().any(|f| *f)
    }

    /// How the job ended, once every member ended: `None` while some member has not.
    pub(crate) fn outcome(&self) -> Option<String> {
        if self.members.is_empty() || !self.ended.iter().all(|e| *e) {
            return None;
        }
        Some(if self.finished.iter().any(|f| *f) {
            "the job finished (every member of its last membership ended)".into()
        } else {
            format!(
                "the job failed: every member of its last membership (epoch {}, members {:?}) \
                 failed or was lost",
                self.epoch, self.members
            )
        })
    }
}

/// Whether any of member ids `ids` was ever let into the job on `store`.
pub(crate) fn any_admitted(store: &StoreClient, ids: &[u32]) -> Result<bool> {
    if ids.is_empty() {
        return Ok(false);
    }
    let keys: Vec<String> = ids.iter().map(|m| keys::admitted(*m)).collect();
    Ok(match store.wait(&keys, Duration::ZERO)? {
        WaitOutcome::Ready => true,
        WaitOutcome::Missing(missing) => missing.len() < keys.len(),
    })
}

/// The newest decided membership of the job on `store`; `None` before the job formed.
pub(crate) fn last_membership(store: &StoreClient) -> Result<Option<LastMembership>> {
    let epoch = get_now(store, keys::EPOCH)?.and_then(|v| {
        std::str::from_utf8(&v)
            .ok()
            .and_then(|t| t.parse::<u64>().ok())
    });
    let Some(epoch) = epoch else {
        return Ok(None);
    };
    let Some(members) = get_now(store, &keys::members(epoch))? else {
        return Ok(None);
    };
    let members = decode(&members).unwrap_or_default();
    let keys: Vec<String> = members
        .iter()
        .flat_map(|m| [keys::finished(*m), crate::store::gone_key(Rank(*m))])
        .collect();
    let present = match store.wait(&keys, Duration::ZERO)? {
        WaitOutcome::Ready => vec![true; keys.len()],
        WaitOutcome::Missing(missing) => keys.iter().map(|k| !missing.contains(k)).collect(),
    };
    let ended = present.chunks(2).map(|c| c[0] || c[1]).collect();
    let finished = present.chunks(2).map(|c| c[0]).collect();
    Ok(Some(LastMembership {
        epoch,
        members,
        ended,
        finished,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn member_lists_round_trip_and_garbage_is_refused() {
        assert_eq!(decode(&encode(&[0, 2, 7])), Some(vec![0, 2, 7]));
        assert_eq!(decode(b""), Some(vec![]));
        assert_eq!(decode(b"1,x"), None);
        assert_eq!(decode(b"1,,2"), None);
        assert_eq!(decode(&[0xff]), None);
    }
}
