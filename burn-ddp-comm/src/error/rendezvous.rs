//! [`RendezvousError`]: finding the peers: the store on rank 0, its address, the handshake, the
//! rendezvous.

use std::io;
use std::net::SocketAddr;
use std::time::Duration;

use crate::types::{Rank, RankList, WorldSize};
use crate::wire::WireError;

/// Finding the peers: the store on rank 0, its address, the handshake, the rendezvous. Nested in
/// [`DdpError::Rendezvous`](crate::DdpError::Rendezvous); messages start with the rank that saw the
/// problem.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RendezvousError {
    /// Rank 0 cannot serve the store because the port is taken.
    #[error(
        "[rank {rank}] cannot serve the rendezvous store on {addr}{origin}: the port is already \
         in use (another job, or an earlier run still shutting down). Pick another MASTER_PORT \
         (or `burn-ddp run --standalone`) or stop the other job"
    )]
    PortInUse {
        /// The rank (0).
        rank: Rank,
        /// The address it tried to bind.
        addr: SocketAddr,
        /// Where the port came from, when not `MASTER_PORT` itself (` (…)`, or empty).
        origin: String,
    },

    /// Rank 0 cannot bind the store address for another reason.
    #[error(
        "[rank {rank}] cannot serve the rendezvous store on {addr}: {source}. MASTER_ADDR must be \
         an address of rank 0's own machine"
    )]
    StoreBind {
        /// The rank (0).
        rank: Rank,
        /// The address it tried to bind.
        addr: SocketAddr,
        /// The OS error.
        source: io::Error,
    },

    /// `MASTER_ADDR` does not resolve.
    #[error("[rank {rank}] cannot resolve MASTER_ADDR {host:?}: {source}. Use an IP address or a host name every node can resolve")]
    MasterUnresolvable {
        /// This rank.
        rank: Rank,
        /// The host name.
        host: String,
        /// The resolver error.
        source: io::Error,
    },

    /// Nobody answered at the master address within the rendezvous deadline.
    #[error(
        "[rank {rank}] the rendezvous store at {addr} was unreachable for {waited:?} (last error: {last_error}). \
         Check that rank 0 is running, that MASTER_ADDR/MASTER_PORT point to it, and that no firewall \
         blocks the port; or raise the rendezvous timeout (BURN_DDP_RENDEZVOUS_TIMEOUT)"
    )]
    MasterUnreachable {
        /// This rank.
        rank: Rank,
        /// The master address.
        addr: String,
        /// How long it tried.
        waited: Duration,
        /// The last connection error.
        last_error: io::Error,
    },

    /// Not every rank joined within the rendezvous deadline.
    #[error(
        "[rank {rank}] rendezvous at {addr} timed out after {waited:?}: {joined}/{world} ranks joined, \
         missing {missing}{refused_note}. Check that every rank uses the same MASTER_ADDR/MASTER_PORT, \
         WORLD_SIZE and job token (BURN_DDP_JOB_TOKEN), or raise the rendezvous timeout"
    )]
    RendezvousTimeout {
        /// This rank.
        rank: Rank,
        /// The master address.
        addr: String,
        /// How long it waited.
        waited: Duration,
        /// How many ranks had joined.
        joined: usize,
        /// The expected world size.
        world: WorldSize,
        /// The ranks that never joined.
        missing: RankList,
        /// A note on refused connections, if any ("; 1 connection was refused ...").
        refused_note: String,
    },

    /// The peer does not share our job token.
    #[error(
        "[rank {rank}] {peer} refused the handshake: it does not hold this job's token. It belongs to \
         another job, or this process was started with a different BURN_DDP_JOB_TOKEN; start every rank \
         from the same launcher (or give them the same token)"
    )]
    TokenMismatch {
        /// This rank.
        rank: Rank,
        /// The peer.
        peer: SocketAddr,
    },

    /// The peer speaks another version of the protocol.
    #[error(
        "[rank {rank}] {peer} speaks burn-ddp protocol version {theirs}, this process speaks {ours}. \
         Build every rank from the same burn-ddp version"
    )]
    ProtocolMismatch {
        /// This rank.
        rank: Rank,
        /// The peer.
        peer: SocketAddr,
        /// Our version.
        ours: u8,
        /// Theirs.
        theirs: u8,
    },

    /// Ranks disagree on the world size.
    #[error(
        "[rank {rank}] WORLD_SIZE mismatch: rank {other} uses WORLD_SIZE={theirs}, this process uses {ours}. \
         Every process of a job must be started with the same WORLD_SIZE"
    )]
    WorldSizeMismatch {
        /// This rank.
        rank: Rank,
        /// The other rank.
        other: Rank,
        /// Our world size.
        ours: WorldSize,
        /// Theirs.
        theirs: WorldSize,
    },

    /// Two processes claimed the same rank.
    #[error(
        "[rank {rank}] rank {claimed} was claimed by two processes ({first} and {second}). \
         Give every process a distinct RANK (and check that two jobs do not share MASTER_PORT)"
    )]
    DuplicateRank {
        /// This rank.
        rank: Rank,
        /// The rank claimed twice.
        claimed: Rank,
        /// Address of the first claimant.
        first: SocketAddr,
        /// Address of the second claimant.
        second: SocketAddr,
    },

    /// A store request did not complete in time.
    #[error("[rank {rank}] store {op} of key {key:?} timed out after {waited:?}. Some rank did not publish it; raise the store timeout if that rank is just slow")]
    StoreTimeout {
        /// This rank.
        rank: Rank,
        /// The store operation.
        op: &'static str,
        /// The key.
        key: String,
        /// How long it waited.
        waited: Duration,
    },

    /// A peer's published transport address does not answer.
    #[error(
        "[rank {rank}] cannot connect to rank {peer} at {addr} (last error: {last_error}) after {waited:?}. \
         Check that the ranks can reach each other on that interface (firewalls, BURN_DDP_SOCKET_IFADDR)"
    )]
    PeerUnreachable {
        /// This rank.
        rank: Rank,
        /// The peer.
        peer: Rank,
        /// The address it published.
        addr: SocketAddr,
        /// How long this rank tried.
        waited: Duration,
        /// The last connection error.
        last_error: io::Error,
    },

    /// The connection to the store broke.
    #[error(
        "[rank {rank}] lost the connection to the rendezvous store at {addr} ({source}): its host \
         (rank 0; in a fault-tolerant job, node 0's launcher) has exited or crashed, or the \
         network to it is down. See that process's output for the cause"
    )]
    StoreLost {
        /// This rank.
        rank: Rank,
        /// The store address.
        addr: SocketAddr,
        /// The I/O error.
        source: io::Error,
    },

    /// A peer sent bytes that are not a valid frame.
    #[error("[rank {rank}] {peer} sent a malformed frame: {error}")]
    Protocol {
        /// This rank.
        rank: Rank,
        /// The peer.
        peer: SocketAddr,
        /// What was wrong.
        error: WireError,
    },

    /// The store refused a request for a reason it gave.
    #[error("[rank {rank}] the store refused the request: {reason}")]
    StoreRefused {
        /// This rank.
        rank: Rank,
        /// The store's explanation.
        reason: String,
    },

    /// The store could not carry out one request; the connection and the job go on.
    #[error("[rank {rank}] store `{op}` on key {key:?} failed: {reason}")]
    StoreRequest {
        /// This rank.
        rank: Rank,
        /// The request.
        op: &'static str,
        /// The key.
        key: String,
        /// Why.
        reason: String,
    },
}

impl RendezvousError {
    /// The rank that reported this error, when it names one.
    pub fn rank(&self) -> Option<Rank> {
        match self {
            Self::PortInUse { rank, .. }
            | Self::StoreBind { rank, .. }
            | Self::MasterUnresolvable { rank, .. }
            | Self::MasterUnreachable { rank, .. }
            | Self::RendezvousTimeout { rank, .. }
            | Self::TokenMismatch { rank, .. }
            | Self::ProtocolMismatch { rank, .. }
            | Self::WorldSizeMismatch { rank, .. }
            | Self::DuplicateRank { rank, .. }
            | Self::StoreTimeout { rank, .. }
            | Self::PeerUnreachable { rank, .. }
            | Self::StoreLost { rank, .. }
            | Self::Protocol { rank, .. }
            | Self::StoreRefused { rank, .. }
            | Self::StoreRequest { rank, .. } => Some(*rank),
        }
    }

    /// Whether the group failed around this rank
    /// ([`DdpError::is_peer_failure`](crate::DdpError::is_peer_failure)).
    pub fn is_peer_failure(&self) -> bool {
        matches!(
            self,
            Self::RendezvousTimeout { .. }
                | Self::StoreTimeout { .. }
                | Self::PeerUnreachable { .. }
                | Self::StoreLost { .. }
        )
    }

    /// The rank this error blames ([`DdpError::culprit`](crate::DdpError::culprit)).
    pub fn culprit(&self) -> Option<Rank> {
        match self {
            Self::PeerUnreachable { peer, .. } => Some(*peer),
            Self::RendezvousTimeout { missing, .. } => missing.0.first().copied(),
            _ => None,
        }
    }
}
