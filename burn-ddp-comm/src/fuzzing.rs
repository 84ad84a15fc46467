//! Entry points for the fuzz targets in `fuzz/` (feature `fuzzing`; not a public API): every
//! decoder of bytes that arrive from the network. Each one must refuse bad input with an error,
//! never panic or allocate what the input claims, and give back what it was given when the
//! input is valid.

use crate::comm::tcp::header;
use crate::store::auth::RefuseReason;
use crate::store::protocol::{Reply, Request, MAX_FRAME};
use crate::types::AbortRecord;
use crate::wire::{self, Reader, Writer};

/// Store traffic: a frame (header and payload) as read from a socket, then the request or
/// reply it carries.
pub fn store_frame(data: &[u8]) {
    let mut stream = data;
    let Ok((kind, payload)) = wire::read_frame(&mut stream, MAX_FRAME) else {
        return;
    };
    if let Ok(req) = Request::decode(kind, &payload) {
        let (k, p) = req.encode();
        assert_eq!(Request::decode(k, &p).ok(), Some(req), "request round trip");
    }
    if let Ok(rep) = Reply::decode(kind, &payload) {
        let (k, p) = rep.encode();
        assert_eq!(Reply::decode(k, &p).ok(), Some(rep), "reply round trip");
    }
}

/// The header at the start of every collective on a ring link.
pub fn transport_header(data: &[u8]) {
    let Some(h) = data.get(..header::LEN) else {
        return;
    };
    let mut buf = [0u8; header::LEN];
    buf.copy_from_slice(h);
    if let Ok((seq, desc)) = header::decode(&buf) {
        assert_eq!(header::encode(seq, &desc), buf, "header round trip");
    }
}

/// Handshake refusals and the abort records the store hands out.
pub fn handshake_and_abort(data: &[u8]) {
    if let Ok(reason) = RefuseReason::decode(data) {
        assert_eq!(
            RefuseReason::decode(&reason.encode()).ok(),
            Some(reason),
            "refusal round trip"
        );
    }
    let mut r = Reader::new(data);
    if let Ok(record) = AbortRecord::decode(&mut r) {
        let mut w = Writer::new();
        record.encode(&mut w);
        let bytes = w.finish();
        let mut r = Reader::new(&bytes);
        assert_eq!(
            AbortRecord::decode(&mut r).ok(),
            Some(record),
            "abort round trip"
        );
    }
}

/// Heartbeats read from the store.
pub fn heartbeat(data: &[u8]) {
    crate::group::heartbeat::fuzz_decode(data);
}

/// The output items ranks send to rank 0 for the metrics during training.
pub fn output_items(data: &[u8]) {
    use crate::train::parts::Part;
    if let Some(parts) = Part::decode(data) {
        let mut again = Vec::new();
        Part::encode(&parts, &mut again);
        assert_eq!(again, data, "item round trip");
    }
}
