//! [`ConfigError`]: the process's configuration: environment variables, ranks, options.

use crate::types::{LocalRank, Rank, WorldSize};

/// The process's configuration: environment variables, ranks, options. Nested in
/// [`DdpError::Config`](crate::DdpError::Config); messages start with the rank that saw the
/// problem.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// A required environment variable is not set.
    #[error("environment variable {var} is not set. {hint}")]
    MissingEnv {
        /// The variable.
        var: &'static str,
        /// How to provide it.
        hint: &'static str,
    },

    /// A launcher's variables are present but do not describe a job this process can join
    /// (some of them missing, a batch script instead of its tasks, ranks on several hosts
    /// without `MASTER_ADDR`).
    #[error("{launcher}: {problem}. {fix}")]
    Launch {
        /// The launcher whose variables were read.
        launcher: &'static str,
        /// What is wrong, with the values seen.
        problem: String,
        /// How to launch instead.
        fix: String,
    },

    /// An environment variable holds a value that cannot be used.
    #[error("environment variable {var}={value:?} is invalid: expected {expected}")]
    InvalidEnv {
        /// The variable.
        var: &'static str,
        /// What it held.
        value: String,
        /// What it should hold.
        expected: &'static str,
    },

    /// The rank does not belong to the world.
    #[error(
        "rank {rank} is outside the world of {world} processes (valid ranks are 0..{world}). \
         Check RANK and WORLD_SIZE: every process must use the same WORLD_SIZE and a distinct RANK below it"
    )]
    RankOutOfRange {
        /// The rank given.
        rank: Rank,
        /// The world size given.
        world: WorldSize,
    },

    /// The local rank does not belong to the node.
    #[error(
        "[rank {rank}] LOCAL_RANK={local_rank} is outside LOCAL_WORLD_SIZE={local_world}. \
         Check the launcher's --nproc-per-node"
    )]
    LocalRankOutOfRange {
        /// The global rank.
        rank: Rank,
        /// The local rank given.
        local_rank: LocalRank,
        /// The node size given.
        local_world: WorldSize,
    },

    /// Ranks of one group chose different collective algorithms, which would wait on
    /// different links.
    #[error(
        "[rank {rank}] this rank runs collectives with algorithm {ours}, rank {peer} with {theirs}: \
         every rank of a group must use the same. Set BURN_DDP_ALGO (auto, ring or tree) to the \
         same value for every rank, or leave it unset everywhere, and give GroupConfig::algorithm \
         the same value on every rank"
    )]
    AlgorithmMismatch {
        /// This rank.
        rank: Rank,
        /// This rank's algorithm.
        ours: crate::types::Algorithm,
        /// The first rank that chose another.
        peer: Rank,
        /// Its algorithm.
        theirs: crate::types::Algorithm,
    },

    /// Ranks of one group chose different transports.
    #[error(
        "[rank {rank}] this rank moves collectives over transport {ours}, rank {peer} over \
         {theirs}: every rank of a group must use the same. Set BURN_DDP_TRANSPORT (auto, tcp or \
         shm) to the same value for every rank, or leave it unset everywhere, and give \
         GroupConfig::transport the same value on every rank"
    )]
    TransportMismatch {
        /// This rank.
        rank: Rank,
        /// This rank's transport.
        ours: crate::types::Transport,
        /// The first rank that chose another.
        peer: Rank,
        /// Its transport.
        theirs: crate::types::Transport,
    },

    /// Shared memory was asked for (`BURN_DDP_TRANSPORT=shm`) and cannot be used.
    #[error(
        "[rank {rank}] shared memory cannot carry this group's collectives: {reason}. Fix that, \
         or let the group fall back to TCP (BURN_DDP_TRANSPORT=auto, the default) or ask for it \
         (BURN_DDP_TRANSPORT=tcp)"
    )]
    SharedMemory {
        /// This rank.
        rank: Rank,
        /// What failed, and on which rank.
        reason: String,
    },

    /// A configuration value is out of its valid range.
    #[error("invalid configuration: {field} {reason}")]
    InvalidConfig {
        /// The field.
        field: &'static str,
        /// What is wrong with it.
        reason: &'static str,
    },

    /// A global batch size the ranks cannot share evenly
    /// ([`ProcessGroup::per_rank_batch`](crate::ProcessGroup::per_rank_batch)).
    #[error(
        "a global batch of {global} items does not split evenly over {world} ranks: give a \
         multiple of {world} ({nearest}), or set each rank's batch size yourself"
    )]
    UnevenGlobalBatch {
        /// The global batch size asked for.
        global: usize,
        /// The world size.
        world: WorldSize,
        /// The nearest global batch sizes that do split.
        nearest: String,
    },

    /// An option of a tool (the bandwidth tool's) is out of its valid range.
    #[error("invalid option {option}: {reason}")]
    InvalidOption {
        /// The option.
        option: &'static str,
        /// What is wrong with its value, and what is accepted.
        reason: String,
    },

    /// The ranks' datasets of a `DistributedSampler` differ (their lengths, or a sample of
    /// their items): the sampler deals shards as if every rank held the same dataset
    /// ([`check_datasets`](crate::data::check_datasets)).
    #[error("[rank {rank}] the dataset of DistributedSampler {sampler} (the samplers counted in the order they were made on the group) differs between ranks: {detail}. A DistributedSampler deals shards of one dataset that every rank holds alike: build it the same way on every rank (seed any random generator that makes it, e.g. `StdRng::seed_from_u64(42)` instead of `rand::rng()`, and read the same files)")]
    DatasetsDiffer {
        /// This rank.
        rank: Rank,
        /// The sampler, counted from 1 in the order the samplers were made on the group.
        sampler: usize,
        /// What differs, and on which ranks.
        detail: String,
    },
}

impl ConfigError {
    /// The rank that reported this error, when it names one.
    pub fn rank(&self) -> Option<Rank> {
        match self {
            Self::RankOutOfRange { rank, .. }
            | Self::LocalRankOutOfRange { rank, .. }
            | Self::AlgorithmMismatch { rank, .. }
            | Self::TransportMismatch { rank, .. }
            | Self::SharedMemory { rank, .. }
            | Self::DatasetsDiffer { rank, .. } => Some(*rank),
            _ => None,
        }
    }

    /// Whether the group failed around this rank
    /// ([`DdpError::is_peer_failure`](crate::DdpError::is_peer_failure)).
    pub fn is_peer_failure(&self) -> bool {
        false
    }
}
