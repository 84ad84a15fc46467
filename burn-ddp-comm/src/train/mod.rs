//! The Burn-free half of training with a Learner on several processes, shared by every Burn
//! line's strategy (`burn_ddp::train::DdpStrategy` for Burn 0.21,
//! `burn_ddp::train::DdpStrategy` for Burn 0.22.1 and 0.23):
//!
//! - [`epoch`]: the epoch loop itself ([`fit`](epoch::fit), [`run_split`](epoch::run_split)),
//!   over the two traits a line implements ([`EpochDriver`](epoch::EpochDriver),
//!   [`SplitSteps`](epoch::SplitSteps)), with a fault-tolerant job's [`Cursor`](epoch::Cursor)
//!   and its change of membership between two steps;
//! - [`vote`]: before every step each rank votes (a batch, none left, a stop, a failure) and
//!   one small all-reduce turns the votes into the same [`Decision`](vote::Decision) everywhere;
//! - [`parts`]: a step's output item as host [`Part`](parts::Part)s, gathered to rank 0 and
//!   merged there so that the metrics are those of the whole job;
//! - [`files`]: checkpoints written by rank 0 alone, atomically, and read back by rank 0 for
//!   every rank (no shared file system needed);
//! - [`run`]: the run's settings recorded beside its checkpoints, and where a run starts
//!   (a resume refuses checkpoints that are not the run's own);
//! - [`strategy`]: what a line's `DdpStrategy` keeps besides its Burn types
//!   ([`StrategyState`](strategy::StrategyState)), and its options written once for every line
//!   ([`strategy_options!`](crate::strategy_options));
//! - [`board`]: the world size and the last change of membership, for rank 0's dashboard;
//! - [`terminal`]: whether rank 0's stdout is a terminal the dashboard can drive.
//!
//! What each line adds is only what touches its Burn types: burn-train's events, loaders and
//! steps behind the two traits, the tensors of an item, the records of a checkpoint.

pub mod board;
pub mod epoch;
pub mod files;
pub mod metric_log;
pub mod parts;
pub mod progress_text;
pub mod run;
pub mod strategy;
pub mod terminal;
pub mod vote;

/// What each Burn line's `train` module re-exports from here as its own public API
/// (`pub use burn_ddp_comm::train::public::*;`): the membership board, the newest complete
/// checkpoint, the output directory and its run settings.
pub mod public {
    pub use super::board::{MembershipBoard, MembershipNote};
    pub use super::files::newest_complete;
    pub use super::run::{prepare_output, RunSettings};
}
