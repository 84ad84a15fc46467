//! The rendezvous store's protocol: its keys, the plan of a round and its encoding, and a
//! launcher's connection to the store with errors that say what the launcher was doing.

use crate::error::{ConfigError, MembershipError, RendezvousError};
use std::time::{Duration, Instant};

use crate::config::{JobToken, MasterAddr};
use crate::store::auth::Purpose;
use crate::store::StoreClient;
use crate::types::{Rank, WorldSize};
use crate::{DdpError, Result};

/// How long one store request of the rendezvous may take.
pub(super) const REQUEST: Duration = Duration::from_secs(10);

/// Set by whichever launcher moves the job to the next round (compare-and-set).
pub(super) const ROUND: &str = "elastic/round";
/// Set by the host when the job has ended (how), before the rendezvous closes.
pub(super) const END: &str = "elastic/end";

pub(super) fn arrivals_key(round: u32) -> String {
    format!("elastic/r{round}/arrivals")
}
pub(super) fn arrival_key(round: u32, i: i64) -> String {
    format!("elastic/r{round}/arrival/{i}")
}
pub(super) fn plan_key(round: u32) -> String {
    format!("elastic/r{round}/plan")
}
pub(super) fn finished_key(round: u32) -> String {
    format!("elastic/r{round}/finished")
}
pub(super) fn why_key(round: u32) -> String {
    format!("elastic/r{round}/why")
}
pub(super) fn beat_key(node: &str) -> String {
    format!("elastic/beat/{node}")
}

/// A round's plan, as the coordinator writes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Plan {
    Nodes {
        nproc: u32,
        nodes: Vec<String>,
        /// The world size of the job's first round.
        first_world: u32,
        /// The world size of the round before, if any.
        previous_world: Option<u32>,
    },
    Failed(String),
}

impl Plan {
    pub(super) fn encode(&self) -> Vec<u8> {
        match self {
            Plan::Nodes {
                nproc,
                nodes,
                first_world,
                previous_world,
            } => format!(
                "nodes\n{nproc}\n{first_world}\n{}\n{}",
                previous_world.map_or("-".into(), |w| w.to_string()),
                nodes.join("\n")
            ),
            Plan::Failed(why) => format!("failed\n{why}"),
        }
        .into_bytes()
    }

    pub(super) fn decode(bytes: &[u8]) -> Option<Self> {
        let text = String::from_utf8_lossy(bytes);
        let mut lines = text.split('\n');
        match lines.next()? {
            "nodes" => {
                let nproc = lines.next()?.parse().ok()?;
                let first_world = lines.next()?.parse().ok()?;
                let previous_world = match lines.next()? {
                    "-" => None,
                    w => Some(w.parse().ok()?),
                };
                let nodes: Vec<String> = lines.map(str::to_owned).collect();
                (!nodes.is_empty()).then_some(Plan::Nodes {
                    nproc,
                    nodes,
                    first_world,
                    previous_world,
                })
            }
            "failed" => Some(Plan::Failed(lines.collect::<Vec<_>>().join("\n"))),
            _ => None,
        }
    }
}

/// The rendezvous store's "world": the most nodes, each launcher a client of it.
pub(super) fn max_world(max: u32) -> Result<WorldSize> {
    WorldSize::new(max).ok_or(DdpError::Config(ConfigError::InvalidConfig {
        field: "--nnodes",
        reason: "MAX must be at least 1",
    }))
}

/// A connection to the rendezvous store, with errors that say what the launcher was doing.
pub(super) struct Rdzv {
    pub(super) client: StoreClient,
    pub(super) addr: String,
}

impl Rdzv {
    pub(super) fn connect(
        endpoint: &MasterAddr,
        max: u32,
        token: &JobToken,
        within: Duration,
    ) -> Result<Self> {
        let world = max_world(max)?;
        let client = StoreClient::connect(
            endpoint,
            Purpose::StoreAux,
            Rank(0),
            world,
            token,
            REQUEST,
            Instant::now() + within,
        )
        .map_err(|e| match e {
            DdpError::Rendezvous(RendezvousError::WorldSizeMismatch { theirs, .. }) => {
                DdpError::Membership(MembershipError::Elastic {
                    addr: endpoint.to_string(),
                    reason: format!(
                    "the rendezvous host admits up to {theirs} nodes, this launcher up to {max}: \
                     give every node's launcher the same --nnodes"
                ),
                })
            }
            other => other,
        })?;
        Ok(Self {
            client,
            addr: endpoint.to_string(),
        })
    }

    pub(super) fn lost(&self, doing: &str, e: DdpError) -> DdpError {
        DdpError::Membership(MembershipError::Elastic {
            addr: self.addr.clone(),
            reason: format!(
                "lost the rendezvous while {doing}: {e}; the job cannot go on without its \
                 host's node (the launcher that serves the rendezvous, with rank 0)"
            ),
        })
    }

    pub(super) fn round(&self) -> Result<u32> {
        let v = self
            .client
            .get_timeout(ROUND, REQUEST)
            .map_err(|e| self.lost("reading the round", e))?;
        String::from_utf8_lossy(&v).parse().map_err(|_| {
            DdpError::Membership(MembershipError::Elastic {
                addr: self.addr.clone(),
                reason: "the rendezvous holds a malformed round number".into(),
            })
        })
    }

    /// Moves the job from round `from` to the next one (no effect if it already moved),
    /// recording `why` (the first reason recorded wins).
    pub(super) fn bump(&self, from: u32, why: &str) -> Result<u32> {
        let _ = self
            .client
            .compare_set(&why_key(from), None, why.as_bytes())
            .map_err(|e| self.lost("starting the next round", e))?;
        let v = self
            .client
            .compare_set(
                ROUND,
                Some(from.to_string().as_bytes()),
                (from + 1).to_string().as_bytes(),
            )
            .map_err(|e| self.lost("starting the next round", e))?;
        Ok(String::from_utf8_lossy(&v).parse().unwrap_or(from + 1))
    }

    /// Why the job left round `round`, if it did.
    pub(super) fn why(&self, round: u32) -> Option<String> {
        self.client
            .get_timeout(&why_key(round), Duration::ZERO)
            .ok()
            .map(|v| String::from_utf8_lossy(&v).into_owned())
    }

    pub(super) fn plan(&self, round: u32) -> Result<Option<Plan>> {
        match self.client.get_timeout(&plan_key(round), Duration::ZERO) {
            Ok(v) => Ok(Some(Plan::decode(&v).ok_or_else(|| {
                DdpError::Membership(MembershipError::Elastic {
                    addr: self.addr.clone(),
                    reason: format!("the plan of round {round} is malformed"),
                })
            })?)),
            Err(DdpError::Rendezvous(RendezvousError::StoreTimeout { .. })) => Ok(None),
            Err(e) => Err(self.lost("reading a round's plan", e)),
        }
    }

    pub(super) fn count(&self, key: &str) -> Result<i64> {
        self.client
            .add(key, 0)
            .map_err(|e| self.lost("reading a counter", e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v(ids: &[&str]) -> Vec<String> {
        ids.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn plans_survive_their_encoding() {
        for plan in [
            Plan::Nodes {
                nproc: 2,
                nodes: v(&["a:1", "b:2"]),
                first_world: 4,
                previous_world: None,
            },
            Plan::Nodes {
                nproc: 1,
                nodes: v(&["a"]),
                first_world: 2,
                previous_world: Some(3),
            },
            Plan::Failed("too few\nnodes".into()),
        ] {
            assert_eq!(Plan::decode(&plan.encode()), Some(plan));
        }
        assert_eq!(
            Plan::decode(b"nodes\n2\n2\n-\n"),
            Some(Plan::Nodes {
                nproc: 2,
                nodes: v(&[""]),
                first_world: 2,
                previous_world: None
            })
        );
        assert_eq!(Plan::decode(b"nodes\nx\na"), None);
        assert_eq!(Plan::decode(b"what"), None);
    }
}
