//! The job's vocabulary, used by every layer above: who a process is, what a collective is, and
//! the record of a job's first failure.
//!
//! - `rank.rs`: [`Rank`], [`WorldSize`], [`LocalRank`], [`CollectiveSeq`], [`RankList`]
//! - `collective.rs`: [`CollectiveOp`], [`ReduceOp`], [`DType`], [`Element`], [`CollectiveDesc`]
//! - `abort.rs`: [`AbortRecord`] (the job's first failure, shared through the store) and
//!   [`StallDiagnosis`]

mod abort;
mod collective;
mod digest;
mod rank;

pub use abort::{AbortRecord, StallDiagnosis};
pub use collective::{
    Algorithm, CollectiveDesc, CollectiveOp, DType, Element, ReduceOp, Transport,
};
pub use digest::digest;
pub use rank::{CollectiveSeq, LocalRank, Rank, RankList, WorldSize};
