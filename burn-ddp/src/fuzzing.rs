//! Entry points for the fuzz targets in `fuzz/` (feature `fuzzing`; not a public API): the
//! decoders of the communication layer (from burn-ddp-comm), and the metric items ranks send to
//! rank 0 during training.

pub use burn_ddp_comm::fuzzing::{handshake_and_abort, store_frame, transport_header};

/// Heartbeats read from the store, and the metric items ranks send to rank 0.
pub fn heartbeat_and_items(data: &[u8]) {
    burn_ddp_comm::fuzzing::heartbeat(data);
    burn_ddp_comm::fuzzing::output_items(data);
}
