//! [`MembershipError`]: elastic and fault-tolerant jobs: rounds, exclusions, joins, too few ranks.

use std::time::Duration;

use crate::types::Rank;

/// Elastic and fault-tolerant jobs: rounds, exclusions, joins, too few ranks. Nested in
/// [`DdpError::Membership`](crate::DdpError::Membership); messages start with the rank that saw the
/// problem.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MembershipError {
    /// The elastic rendezvous of `burn-ddp run --nnodes MIN:MAX` could not form or keep a
    /// job: too few nodes came, the nodes disagree on their settings, the rendezvous host was
    /// lost, or the job used up its restarts.
    #[error("elastic rendezvous at {addr}: {reason}")]
    Elastic {
        /// The rendezvous endpoint.
        addr: String,
        /// What went wrong, and what to do about it.
        reason: String,
    },

    /// This process was left out of a fault-tolerant job's new membership: the other ranks
    /// agreed without it (it was named as the cause of the failure, or it was too slow to
    /// answer). It may join again ([`ProcessGroup::rejoin`](crate::ProcessGroup::rejoin):
    /// `DdpStrategy` does).
    #[error(
        "[member {member}] this process was left out of the job's membership epoch {epoch} \
         (ranks {members:?} go on without it): {why}"
    )]
    Excluded {
        /// This process's member id.
        member: u32,
        /// The membership it is not in.
        epoch: u64,
        /// The members that go on.
        members: Vec<u32>,
        /// Why, as far as this process can tell.
        why: String,
    },

    /// What this process would write for a fault-tolerant job (rank 0's checkpoint) is not
    /// written: its membership ended meanwhile, and a newer membership's rank 0 writes it. The
    /// process learns at its next collective that it was left out, and may join again.
    #[error(
        "[member {member}] {what} is not written: this process's membership epoch {epoch} has \
         ended ({why}); the job goes on without it and the new membership's rank 0 writes it"
    )]
    Superseded {
        /// This process's member id.
        member: u32,
        /// The membership that ended.
        epoch: u64,
        /// What was not written.
        what: String,
        /// Why the membership ended, as recorded in the store.
        why: String,
    },

    /// Too few ranks are left in a fault-tolerant job to go on, and not enough joined in
    /// time.
    #[error(
        "[member {member}] the job cannot go on: {have} rank(s) left after {why}, fewer than \
         the {min} it needs (BURN_DDP_MIN_RANKS), and not enough processes joined within \
         {waited:?}. Start replacements (burn-ddp run --fault-tolerant --max-restarts, or \
         `burn-ddp run --fault-tolerant --join`), or lower the minimum"
    )]
    TooFewRanks {
        /// This process's member id.
        member: u32,
        /// Ranks that were left.
        have: usize,
        /// The minimum.
        min: u32,
        /// What ended the last membership.
        why: String,
        /// How long the survivors waited.
        waited: Duration,
    },

    /// A process of a fault-tolerant job lost the job's store (its link is down, or the
    /// launcher that serves the store is gone): it cannot take part in any membership.
    #[error(
        "[member {member}] cannot reach the job's store, {addr} ({reason}): {meaning} (when its \
         network is back, a replacement can join the running job: burn-ddp run \
         --fault-tolerant --join, or --max-restarts)"
    )]
    StoreUnreachable {
        /// This process's member id.
        member: u32,
        /// The store: where it is served, or the etcd cluster that keeps it.
        addr: String,
        /// The store request that failed.
        reason: String,
        /// What it means, by the kind of store.
        meaning: String,
    },

    /// A process that asked to join a running fault-tolerant job was not admitted.
    #[error("[member {member}] could not join the running job within {waited:?}: {why}")]
    JoinFailed {
        /// This process's member id.
        member: u32,
        /// How long it waited.
        waited: Duration,
        /// What it saw.
        why: String,
    },

    /// A node of a fault-tolerant job failed: a rank of the job's last membership failed, every
    /// rank of the node was lost, or the node lost the job's store.
    #[error("fault-tolerant job: {reason}")]
    FaultTolerantJob {
        /// What happened to the node's ranks.
        reason: String,
    },

    /// A launcher of a fault-tolerant job (without `--join`) found that its ranks are not the
    /// job's: the job is already running (its first processes were started, and their member
    /// ids cannot be taken again), or it was started with another world size.
    #[error(
        "this launcher's ranks {first}..={last} are not the fault-tolerant job's: {reason}. To add \
         this node's processes to the running job, start its launcher with `--join` (they take \
         fresh member ids); to start a new job, give it another --master-port (or --rdzv-id)"
    )]
    NotThisJob {
        /// The first rank this launcher would start.
        first: u32,
        /// The last.
        last: u32,
        /// What the job's store shows.
        reason: String,
    },

    /// A feature that a fault-tolerant job cannot offer (its state would not survive a change
    /// of membership).
    #[error("{what} is not available in a fault-tolerant job: {reason}")]
    NotFaultTolerant {
        /// The feature.
        what: &'static str,
        /// Why, and what to use instead.
        reason: &'static str,
    },
}

impl MembershipError {
    /// The rank that reported this error, when it names one.
    pub fn rank(&self) -> Option<Rank> {
        None
    }

    /// Whether the group failed around this rank
    /// ([`DdpError::is_peer_failure`](crate::DdpError::is_peer_failure)).
    pub fn is_peer_failure(&self) -> bool {
        false
    }
}
