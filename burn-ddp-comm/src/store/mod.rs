//! The key-value store that bootstraps a job, served by rank 0 (like c10d's `TCPStore`).
//!
//! - `protocol.rs`: request and reply messages and their bounded decoding
//! - `server.rs`: the server thread(s) on rank 0
//! - `client.rs`: a rank's connection to it
//! - `auth.rs`: the job-token handshake of every connection (store and ring links)
//! - `handle.rs`: [`Store`], the store as users see it
//!
//! Every connection is authenticated with the job token (`auth.rs`). Membership connections
//! (one per rank) tell the store who joined; a member that disconnects without saying goodbye
//! aborts the job, so every other rank learns at once which rank died.

pub(crate) mod auth;
mod client;
#[cfg(feature = "etcd")]
mod etcd;
mod handle;
pub(crate) mod protocol;
mod server;

pub(crate) use client::{resolve_bind, StoreClient, WaitOutcome};
pub use handle::Store;
pub use server::StoreTraffic;
pub(crate) use server::{gone_key, StoreServer};

/// The store key a rank sets when its group is dropped normally, before its links close: a
/// neighbour still in a collective then reports that this rank finished (uneven inputs), not
/// that it crashed.
pub(crate) fn finished_key(rank: crate::types::Rank) -> String {
    format!("finished/{rank}")
}

#[cfg(test)]
mod tests;
