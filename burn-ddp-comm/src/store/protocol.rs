//! Request and reply messages of the key-value store, and their encoding.
//!
//! Every message is one frame (see [`crate::wire`]); the frame kind selects the message. Decoding
//! is total: any byte string either decodes or yields a [`WireError`].

use std::time::Duration;

use crate::types::{AbortRecord, Rank};
use crate::wire::{Reader, WireError, Writer};

/// Largest key, in bytes.
pub(crate) const MAX_KEY: usize = 1024;
/// Largest value, in bytes.
pub(crate) const MAX_VALUE: usize = 1 << 20;
/// Largest request or reply frame.
pub(crate) const MAX_FRAME: u32 = 4 << 20;

/// A request from a rank to the store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Request {
    /// Stores `value` under `key` (replacing any previous value) and wakes waiters.
    Set { key: String, value: Vec<u8> },
    /// Returns the value of `key`, waiting up to `timeout` for it to appear.
    Get { key: String, timeout: Duration },
    /// Adds `delta` to the i64 counter `key` (missing = 0) and returns the new value.
    Add { key: String, delta: i64 },
    /// Waits up to `timeout` until every key exists.
    Wait {
        keys: Vec<String>,
        timeout: Duration,
    },
    /// Returns the values of `keys`, in order, waiting up to `timeout` for every one to
    /// appear: one request where a rank needs many ranks' keys (start-up reads every rank's
    /// host), instead of one a key.
    GetMany {
        keys: Vec<String>,
        timeout: Duration,
    },
    /// Sets `key` to `desired` if its current value equals `expected` (`None` = absent); returns
    /// the value after the operation.
    CompareSet {
        key: String,
        expected: Option<Vec<u8>>,
        desired: Vec<u8>,
    },
    /// Removes `key`; returns whether it existed.
    Delete { key: String },
    /// Records the first failure of `scope` (`""`: the whole job); later records of that scope
    /// are ignored. Wakes every waiter: those on the job, and those on keys under `scope/`.
    Abort { scope: String, record: AbortRecord },
    /// Returns the abort record of `scope` (or of the whole job), if any, without waiting.
    GetAbort { scope: String },
    /// Returns the connection refusals seen so far.
    Refusals,
    /// This rank is leaving cleanly; its disconnection is not a failure.
    Bye,
}

/// The store's answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Reply {
    /// A value.
    Value(Vec<u8>),
    /// The values of a [`Request::GetMany`], in its keys' order.
    Values(Vec<Vec<u8>>),
    /// An integer.
    Int(i64),
    /// A boolean.
    Bool(bool),
    /// Done.
    Ok,
    /// The wait expired; these keys are still missing.
    Timeout { missing: Vec<String> },
    /// The job was aborted; nothing will be waited for any more.
    Aborted(AbortRecord),
    /// No abort record.
    NoAbort,
    /// Connections refused so far: (peer address, reason).
    Refusals(Vec<(String, String)>),
    /// The request was well-formed but cannot be done (e.g. `add` on a key that holds no
    /// counter); the connection stays open.
    Rejected(String),
    /// The request was invalid; the connection is closed after this.
    Error(String),
}

mod kind {
    pub(super) const SET: u8 = 0x10;
    pub(super) const GET: u8 = 0x11;
    pub(super) const ADD: u8 = 0x12;
    pub(super) const WAIT: u8 = 0x13;
    pub(super) const COMPARE_SET: u8 = 0x14;
    pub(super) const DELETE: u8 = 0x15;
    pub(super) const ABORT: u8 = 0x16;
    pub(super) const GET_ABORT: u8 = 0x17;
    pub(super) const REFUSALS: u8 = 0x18;
    pub(super) const BYE: u8 = 0x19;
    pub(super) const GET_MANY: u8 = 0x1a;

    pub(super) const R_VALUE: u8 = 0x20;
    pub(super) const R_INT: u8 = 0x21;
    pub(super) const R_BOOL: u8 = 0x22;
    pub(super) const R_OK: u8 = 0x23;
    pub(super) const R_TIMEOUT: u8 = 0x24;
    pub(super) const R_ABORTED: u8 = 0x25;
    pub(super) const R_NO_ABORT: u8 = 0x26;
    pub(super) const R_REFUSALS: u8 = 0x27;
    pub(super) const R_REJECTED: u8 = 0x28;
    pub(super) const R_VALUES: u8 = 0x29;
    pub(super) const R_ERROR: u8 = 0x2f;
}

/// The refusal of an `add` on `key`, which holds a `len`-byte value of its own.
pub(crate) fn not_a_counter(key: &str, len: usize) -> String {
    format!(
        "`add` on key {key:?}, which holds a {len}-byte value, not a counter set by `add`; use \
         a different key"
    )
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

fn key(r: &mut Reader<'_>) -> Result<String, WireError> {
    let k = r.str("key")?;
    if k.len() > MAX_KEY {
        return Err(WireError::InvalidValue { what: "key length" });
    }
    Ok(k.to_owned())
}

fn value(r: &mut Reader<'_>) -> Result<Vec<u8>, WireError> {
    let v = r.bytes("value")?;
    if v.len() > MAX_VALUE {
        return Err(WireError::InvalidValue {
            what: "value length",
        });
    }
    Ok(v.to_vec())
}

fn strings(r: &mut Reader<'_>, what: &'static str) -> Result<Vec<String>, WireError> {
    let n = r.u32(what)? as usize;
    // Each entry takes at least 4 bytes; refuse counts the payload cannot hold before allocating.
    if n > r.remaining() / 4 {
        return Err(WireError::Truncated {
            what,
            needed: (n as u64) * 4,
            available: r.remaining() as u64,
        });
    }
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        out.push(key(r)?);
    }
    Ok(out)
}

fn put_strings<'a>(w: &mut Writer, items: impl ExactSizeIterator<Item = &'a str>) {
    w.u32(items.len() as u32);
    for s in items {
        w.str(s);
    }
}

impl Request {
    /// Encodes into (kind, payload).
    pub(crate) fn encode(&self) -> (u8, Vec<u8>) {
        let mut w = Writer::new();
        let k = match self {
            Request::Set { key, value } => {
                w.str(key).bytes(value);
                kind::SET
            }
            Request::Get { key, timeout } => {
                w.str(key).u64(millis(*timeout));
                kind::GET
            }
            Request::Add { key, delta } => {
                w.str(key).i64(*delta);
                kind::ADD
            }
            Request::Wait { keys, timeout } => {
                w.u64(millis(*timeout));
                put_strings(&mut w, keys.iter().map(String::as_str));
                kind::WAIT
            }
            Request::GetMany { keys, timeout } => {
                w.u64(millis(*timeout));
                put_strings(&mut w, keys.iter().map(String::as_str));
                kind::GET_MANY
            }
            Request::CompareSet {
                key,
                expected,
                desired,
            } => {
                w.str(key);
                match expected {
                    Some(e) => w.u8(1).bytes(e),
                    None => w.u8(0),
                };
                w.bytes(desired);
                kind::COMPARE_SET
            }
            Request::Delete { key } => {
                w.str(key);
                kind::DELETE
            }
            Request::Abort { scope, record } => {
                w.str(scope);
                record.encode(&mut w);
                kind::ABORT
            }
            Request::GetAbort { scope } => {
                w.str(scope);
                kind::GET_ABORT
            }
            Request::Refusals => kind::REFUSALS,
            Request::Bye => kind::BYE,
        };
        (k, w.finish())
    }

    /// Decodes a request frame.
    pub(crate) fn decode(k: u8, payload: &[u8]) -> Result<Self, WireError> {
        let mut r = Reader::new(payload);
        let req = match k {
            kind::SET => Request::Set {
                key: key(&mut r)?,
                value: value(&mut r)?,
            },
            kind::GET => Request::Get {
                key: key(&mut r)?,
                timeout: Duration::from_millis(r.u64("timeout")?),
            },
            kind::ADD => Request::Add {
                key: key(&mut r)?,
                delta: r.i64("delta")?,
            },
            kind::WAIT => {
                let timeout = Duration::from_millis(r.u64("timeout")?);
                Request::Wait {
                    keys: strings(&mut r, "keys")?,
                    timeout,
                }
            }
            kind::GET_MANY => {
                let timeout = Duration::from_millis(r.u64("timeout")?);
                Request::GetMany {
                    keys: strings(&mut r, "keys")?,
                    timeout,
                }
            }
            kind::COMPARE_SET => {
                let key = key(&mut r)?;
                let expected = match r.u8("expected flag")? {
                    0 => None,
                    1 => Some(value(&mut r)?),
                    _ => {
                        return Err(WireError::InvalidValue {
                            what: "expected flag",
                        })
                    }
                };
                Request::CompareSet {
                    key,
                    expected,
                    desired: value(&mut r)?,
                }
            }
            kind::DELETE => Request::Delete { key: key(&mut r)? },
            kind::ABORT => Request::Abort {
                scope: key(&mut r)?,
                record: AbortRecord::decode(&mut r)?,
            },
            kind::GET_ABORT => Request::GetAbort {
                scope: key(&mut r)?,
            },
            kind::REFUSALS => Request::Refusals,
            kind::BYE => Request::Bye,
            kind => return Err(WireError::UnknownKind { kind }),
        };
        r.finish()?;
        Ok(req)
    }
}

impl Reply {
    /// Encodes into (kind, payload).
    pub(crate) fn encode(&self) -> (u8, Vec<u8>) {
        let mut w = Writer::new();
        let k = match self {
            Reply::Value(v) => {
                w.bytes(v);
                kind::R_VALUE
            }
            Reply::Values(values) => {
                w.u32(values.len() as u32);
                for v in values {
                    w.bytes(v);
                }
                kind::R_VALUES
            }
            Reply::Int(i) => {
                w.i64(*i);
                kind::R_INT
            }
            Reply::Bool(b) => {
                w.u8(u8::from(*b));
                kind::R_BOOL
            }
            Reply::Ok => kind::R_OK,
            Reply::Timeout { missing } => {
                put_strings(&mut w, missing.iter().map(String::as_str));
                kind::R_TIMEOUT
            }
            Reply::Aborted(record) => {
                record.encode(&mut w);
                kind::R_ABORTED
            }
            Reply::NoAbort => kind::R_NO_ABORT,
            Reply::Refusals(list) => {
                w.u32(list.len() as u32);
                for (a, why) in list {
                    w.str(a).str(why);
                }
                kind::R_REFUSALS
            }
            Reply::Rejected(msg) => {
                w.str(msg);
                kind::R_REJECTED
            }
            Reply::Error(msg) => {
                w.str(msg);
                kind::R_ERROR
            }
        };
        (k, w.finish())
    }

    /// Decodes a reply frame.
    pub(crate) fn decode(k: u8, payload: &[u8]) -> Result<Self, WireError> {
        let mut r = Reader::new(payload);
        let reply = match k {
            kind::R_VALUE => Reply::Value(value(&mut r)?),
            kind::R_VALUES => {
                let n = r.u32("values")? as usize;
                // Each value takes at least its 4-byte length.
                if n > r.remaining() / 4 {
                    return Err(WireError::InvalidValue {
                        what: "value count",
                    });
                }
                let mut values = Vec::with_capacity(n);
                for _ in 0..n {
                    values.push(value(&mut r)?);
                }
                Reply::Values(values)
            }
            kind::R_INT => Reply::Int(r.i64("int")?),
            kind::R_BOOL => match r.u8("bool")? {
                0 => Reply::Bool(false),
                1 => Reply::Bool(true),
                _ => return Err(WireError::InvalidValue { what: "bool" }),
            },
            kind::R_OK => Reply::Ok,
            kind::R_TIMEOUT => Reply::Timeout {
                missing: strings(&mut r, "missing keys")?,
            },
            kind::R_ABORTED => Reply::Aborted(AbortRecord::decode(&mut r)?),
            kind::R_NO_ABORT => Reply::NoAbort,
            kind::R_REFUSALS => {
                let n = r.u32("refusals")? as usize;
                if n > r.remaining() / 8 {
                    return Err(WireError::InvalidValue {
                        what: "refusal count",
                    });
                }
                let mut list = Vec::with_capacity(n);
                for _ in 0..n {
                    list.push((r.str("address")?.to_owned(), r.str("reason")?.to_owned()));
                }
                Reply::Refusals(list)
            }
            kind::R_REJECTED => Reply::Rejected(r.str("reason")?.to_owned()),
            kind::R_ERROR => Reply::Error(r.str("error")?.to_owned()),
            kind => return Err(WireError::UnknownKind { kind }),
        };
        r.finish()?;
        Ok(reply)
    }
}

/// The barrier of the ranks that joined the rendezvous (`StoreClient::arrive`: each counts
/// itself once connected, under `__joined/arrived`; the last sets `__joined/all`).
pub(crate) const JOINED_BARRIER: &str = "__joined";

/// The key under which the store records that `rank` has joined.
pub(crate) fn joined_key(rank: Rank) -> String {
    format!("__joined/{rank}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::CollectiveOp;
    use crate::types::CollectiveSeq;
    use proptest::prelude::*;

    fn requests() -> Vec<Request> {
        vec![
            Request::Set {
                key: "a".into(),
                value: vec![1, 2],
            },
            Request::Get {
                key: "a".into(),
                timeout: Duration::from_millis(5),
            },
            Request::Add {
                key: "n".into(),
                delta: -3,
            },
            Request::Wait {
                keys: vec!["x".into(), "y".into()],
                timeout: Duration::from_secs(1),
            },
            Request::GetMany {
                keys: vec!["x".into(), "y".into(), "z".into()],
                timeout: Duration::from_secs(2),
            },
            Request::CompareSet {
                key: "c".into(),
                expected: None,
                desired: vec![9],
            },
            Request::CompareSet {
                key: "c".into(),
                expected: Some(vec![9]),
                desired: vec![],
            },
            Request::Delete { key: "a".into() },
            Request::Abort {
                scope: "ft/3".into(),
                record: AbortRecord {
                    reporter: Rank(1),
                    culprit: Some(Rank(2)),
                    collective: Some((CollectiveOp::AllReduce, CollectiveSeq(4))),
                    reason: "gone".into(),
                },
            },
            Request::GetAbort {
                scope: String::new(),
            },
            Request::Refusals,
            Request::Bye,
        ]
    }

    #[test]
    fn requests_round_trip() {
        for req in requests() {
            let (k, p) = req.encode();
            assert_eq!(Request::decode(k, &p).unwrap(), req);
        }
    }

    #[test]
    fn replies_round_trip() {
        let replies = vec![
            Reply::Value(vec![3]),
            Reply::Values(vec![vec![1, 2], vec![], vec![3]]),
            Reply::Int(-7),
            Reply::Bool(true),
            Reply::Ok,
            Reply::Timeout {
                missing: vec!["k".into()],
            },
            Reply::NoAbort,
            Reply::Refusals(vec![("1.2.3.4:5".into(), "wrong token".into())]),
            Reply::Rejected("not a counter".into()),
            Reply::Error("bad".into()),
        ];
        for rep in replies {
            let (k, p) = rep.encode();
            assert_eq!(Reply::decode(k, &p).unwrap(), rep);
        }
    }

    #[test]
    fn huge_key_count_is_refused_without_allocating() {
        let mut w = Writer::new();
        w.u64(0).u32(u32::MAX);
        assert!(Request::decode(kind::WAIT, &w.finish()).is_err());
    }

    proptest! {
        #[test]
        fn request_decoding_never_panics(k in 0x00u8..0x30, payload in proptest::collection::vec(any::<u8>(), 0..256)) {
            let _ = Request::decode(k, &payload);
        }

        #[test]
        fn reply_decoding_never_panics(k in 0x00u8..0x30, payload in proptest::collection::vec(any::<u8>(), 0..256)) {
            let _ = Reply::decode(k, &payload);
        }
    }
}
