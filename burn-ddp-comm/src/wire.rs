//! Framing shared by every byte stream burn-ddp reads from the network (store requests and
//! replies, transport handshakes, collective headers).
//!
//! A frame is a 12-byte header followed by a payload:
//!
//! ```text
//! magic "BDDP" (4) | version (1) | kind (1) | reserved = 0 (2) | payload length, LE (4) | payload
//! ```
//!
//! The length is checked against a per-stream limit *before* anything is allocated, so a peer
//! that announces a 4 GiB frame costs nothing. Payload fields are decoded with [`Reader`], whose
//! every read is bounds-checked; nothing here panics on any input.

use std::fmt;
use std::io::{self, Read, Write};

/// Protocol version spoken by this build. Peers with another version are refused with a clear
/// error (`RendezvousError::ProtocolMismatch`).
pub(crate) const PROTOCOL_VERSION: u8 = 2;

/// The four bytes every frame starts with.
pub(crate) const MAGIC: [u8; 4] = *b"BDDP";

/// Size of the frame header.
pub(crate) const HEADER_LEN: usize = 12;

/// Why bytes received from a peer are not a valid frame.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum WireError {
    /// The stream does not start with `BDDP`: not a burn-ddp peer.
    #[error("bad magic {found:02x?} (not a burn-ddp peer)")]
    BadMagic {
        /// The bytes found.
        found: [u8; 4],
    },
    /// The peer speaks another protocol version.
    #[error("protocol version {theirs}, expected {PROTOCOL_VERSION}")]
    VersionMismatch {
        /// The peer's version.
        theirs: u8,
    },
    /// The announced payload exceeds the limit for this stream.
    #[error("frame of {len} bytes exceeds the limit of {max} bytes")]
    TooLong {
        /// Announced length.
        len: u64,
        /// Limit.
        max: u64,
    },
    /// A field needs more bytes than the payload holds.
    #[error("truncated payload: {what} needs {needed} bytes, {available} left")]
    Truncated {
        /// The field being read.
        what: &'static str,
        /// Bytes needed.
        needed: u64,
        /// Bytes available.
        available: u64,
    },
    /// The frame kind is unknown in this context.
    #[error("unexpected frame kind {kind}")]
    UnknownKind {
        /// The kind byte.
        kind: u8,
    },
    /// A string field is not UTF-8.
    #[error("{what} is not valid UTF-8")]
    InvalidUtf8 {
        /// The field.
        what: &'static str,
    },
    /// The payload has bytes left after the last field.
    #[error("{count} unexpected bytes after the last field")]
    TrailingBytes {
        /// How many.
        count: u64,
    },
    /// A field holds a value outside its domain.
    #[error("invalid value for {what}")]
    InvalidValue {
        /// The field.
        what: &'static str,
    },
    /// The reserved header bytes are not zero.
    #[error("reserved header bytes are {found:#06x}, expected 0")]
    Reserved {
        /// What they held.
        found: u16,
    },
}

/// Reading a frame failed: the stream broke, or the bytes were invalid.
#[derive(Debug)]
pub(crate) enum FrameError {
    /// The stream failed or closed (`UnexpectedEof` when the peer closed it).
    Io(io::Error),
    /// The bytes are not a valid frame.
    Wire(WireError),
}

impl fmt::Display for FrameError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FrameError::Io(e) => write!(f, "{e}"),
            FrameError::Wire(e) => write!(f, "{e}"),
        }
    }
}

impl From<io::Error> for FrameError {
    fn from(e: io::Error) -> Self {
        FrameError::Io(e)
    }
}

impl From<WireError> for FrameError {
    fn from(e: WireError) -> Self {
        FrameError::Wire(e)
    }
}

/// A decoded frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct FrameHeader {
    /// Frame kind (meaning depends on the stream).
    pub(crate) kind: u8,
    /// Payload length.
    pub(crate) len: u32,
}

/// Encodes a frame header.
pub(crate) fn encode_header(kind: u8, len: u32) -> [u8; HEADER_LEN] {
    let mut h = [0u8; HEADER_LEN];
    h[..4].copy_from_slice(&MAGIC);
    h[4] = PROTOCOL_VERSION;
    h[5] = kind;
    h[8..12].copy_from_slice(&len.to_le_bytes());
    h
}

/// Checks the first five bytes every burn-ddp header starts with: `magic`, then the protocol
/// version. `h` must hold at least five bytes.
pub(crate) fn check_preamble(h: &[u8], magic: [u8; 4]) -> Result<(), WireError> {
    let mut found = [0u8; 4];
    found.copy_from_slice(&h[..4]);
    if found != magic {
        return Err(WireError::BadMagic { found });
    }
    if h[4] != PROTOCOL_VERSION {
        return Err(WireError::VersionMismatch { theirs: h[4] });
    }
    Ok(())
}

/// Decodes and validates a frame header against a payload limit.
///
/// # Errors
/// Bad magic, another protocol version, non-zero reserved bytes, or a length above `max_len`.
pub(crate) fn decode_header(h: &[u8; HEADER_LEN], max_len: u32) -> Result<FrameHeader, WireError> {
    check_preamble(h, MAGIC)?;
    let reserved = u16::from_le_bytes([h[6], h[7]]);
    if reserved != 0 {
        return Err(WireError::Reserved { found: reserved });
    }
    let len = u32::from_le_bytes([h[8], h[9], h[10], h[11]]);
    if len > max_len {
        return Err(WireError::TooLong {
            len: len.into(),
            max: max_len.into(),
        });
    }
    Ok(FrameHeader { kind: h[5], len })
}

/// Writes one frame (header and payload) with a single `write_all`.
///
/// # Errors
/// The stream's I/O error; `InvalidInput` if the payload exceeds 4 GiB.
pub(crate) fn write_frame(w: &mut impl Write, kind: u8, payload: &[u8]) -> io::Result<()> {
    let len = u32::try_from(payload.len())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "frame payload over 4 GiB"))?;
    let mut buf = Vec::with_capacity(HEADER_LEN + payload.len());
    buf.extend_from_slice(&encode_header(kind, len));
    buf.extend_from_slice(payload);
    w.write_all(&buf)
}

/// Reads one frame whose payload may be at most `max_len` bytes.
///
/// # Errors
/// [`FrameError::Io`] if the stream fails or closes, [`FrameError::Wire`] for invalid bytes.
pub(crate) fn read_frame(r: &mut impl Read, max_len: u32) -> Result<(u8, Vec<u8>), FrameError> {
    let mut h = [0u8; HEADER_LEN];
    r.read_exact(&mut h)?;
    let header = decode_header(&h, max_len)?;
    let mut payload = vec![0u8; header.len as usize];
    r.read_exact(&mut payload)?;
    Ok((header.kind, payload))
}

/// Takes the first whole frame out of `input` (bytes read so far from a stream), if it holds
/// one: a reader that reads what has arrived, with timeouts or without blocking, keeps a frame
/// that came in parts until its last part.
///
/// # Errors
/// Invalid header bytes (see [`decode_header`]).
pub(crate) fn take_frame(
    input: &mut Vec<u8>,
    max_len: u32,
) -> Result<Option<(u8, Vec<u8>)>, WireError> {
    let Some(h) = input.first_chunk::<HEADER_LEN>() else {
        return Ok(None);
    };
    let header = decode_header(h, max_len)?;
    let end = HEADER_LEN + header.len as usize;
    if input.len() < end {
        return Ok(None);
    }
    let payload = input[HEADER_LEN..end].to_vec();
    input.drain(..end);
    Ok(Some((header.kind, payload)))
}

/// One read of what has arrived on `stream` (at most `CHUNK` bytes, retried when interrupted)
/// onto the end of `input`, for [`take_frame`]: the bytes read; the end of the stream is an
/// [`io::ErrorKind::UnexpectedEof`] error saying `closed`. `input` grows by what came only (a
/// server's thousands of idle connections keep small buffers).
pub(crate) fn read_more<const CHUNK: usize>(
    stream: &mut impl Read,
    input: &mut Vec<u8>,
    closed: &'static str,
) -> io::Result<usize> {
    let mut buf = [0u8; CHUNK];
    loop {
        return match stream.read(&mut buf) {
            Ok(0) => Err(io::Error::new(io::ErrorKind::UnexpectedEof, closed)),
            Ok(n) => {
                input.extend_from_slice(&buf[..n]);
                Ok(n)
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => Err(e),
        };
    }
}

/// Builds a payload.
#[derive(Debug, Default, Clone)]
pub(crate) struct Writer {
    buf: Vec<u8>,
}

impl Writer {
    /// An empty payload.
    pub(crate) fn new() -> Self {
        Self::default()
    }

    /// Appends a byte.
    pub(crate) fn u8(&mut self, v: u8) -> &mut Self {
        self.buf.push(v);
        self
    }

    /// Appends a little-endian u32.
    pub(crate) fn u32(&mut self, v: u32) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }

    /// Appends a little-endian u64.
    pub(crate) fn u64(&mut self, v: u64) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }

    /// Appends a little-endian i64.
    pub(crate) fn i64(&mut self, v: i64) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }

    /// Appends fixed-size bytes (no length prefix).
    pub(crate) fn raw(&mut self, v: &[u8]) -> &mut Self {
        self.buf.extend_from_slice(v);
        self
    }

    /// Appends length-prefixed bytes. Lengths over 4 GiB are truncated to fit (callers keep
    /// payloads far below the frame limit).
    pub(crate) fn bytes(&mut self, v: &[u8]) -> &mut Self {
        let len = u32::try_from(v.len()).unwrap_or(u32::MAX);
        self.u32(len);
        self.buf.extend_from_slice(&v[..len as usize]);
        self
    }

    /// Appends a length-prefixed UTF-8 string.
    pub(crate) fn str(&mut self, v: &str) -> &mut Self {
        self.bytes(v.as_bytes())
    }

    /// The payload.
    pub(crate) fn finish(&mut self) -> Vec<u8> {
        std::mem::take(&mut self.buf)
    }
}

/// Decodes a payload; every read checks the remaining length.
#[derive(Debug)]
pub(crate) struct Reader<'a> {
    buf: &'a [u8],
}

impl<'a> Reader<'a> {
    /// Reads from `buf`.
    pub(crate) fn new(buf: &'a [u8]) -> Self {
        Self { buf }
    }

    fn take(&mut self, n: usize, what: &'static str) -> Result<&'a [u8], WireError> {
        if self.buf.len() < n {
            return Err(WireError::Truncated {
                what,
                needed: n as u64,
                available: self.buf.len() as u64,
            });
        }
        let (head, tail) = self.buf.split_at(n);
        self.buf = tail;
        Ok(head)
    }

    /// Reads a byte.
    pub(crate) fn u8(&mut self, what: &'static str) -> Result<u8, WireError> {
        Ok(self.take(1, what)?[0])
    }

    /// Reads a little-endian u32.
    pub(crate) fn u32(&mut self, what: &'static str) -> Result<u32, WireError> {
        let b = self.take(4, what)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    /// Reads a little-endian u64.
    pub(crate) fn u64(&mut self, what: &'static str) -> Result<u64, WireError> {
        let b = self.take(8, what)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }

    /// Reads a little-endian i64.
    pub(crate) fn i64(&mut self, what: &'static str) -> Result<i64, WireError> {
        Ok(self.u64(what)? as i64)
    }

    /// Reads `N` fixed bytes.
    pub(crate) fn array<const N: usize>(
        &mut self,
        what: &'static str,
    ) -> Result<[u8; N], WireError> {
        let b = self.take(N, what)?;
        let mut a = [0u8; N];
        a.copy_from_slice(b);
        Ok(a)
    }

    /// Reads length-prefixed bytes (the length is checked against what is left).
    pub(crate) fn bytes(&mut self, what: &'static str) -> Result<&'a [u8], WireError> {
        let len = self.u32(what)?;
        self.take(len as usize, what)
    }

    /// Reads a length-prefixed UTF-8 string.
    pub(crate) fn str(&mut self, what: &'static str) -> Result<&'a str, WireError> {
        std::str::from_utf8(self.bytes(what)?).map_err(|_| WireError::InvalidUtf8 { what })
    }

    /// Bytes left.
    pub(crate) fn remaining(&self) -> usize {
        self.buf.len()
    }

    /// Checks that the whole payload was consumed.
    ///
    /// # Errors
    /// [`WireError::TrailingBytes`] if bytes are left.
    pub(crate) fn finish(self) -> Result<(), WireError> {
        if self.buf.is_empty() {
            Ok(())
        } else {
            Err(WireError::TrailingBytes {
                count: self.buf.len() as u64,
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn frame_round_trip() {
        let mut out = Vec::new();
        write_frame(&mut out, 7, b"hello").unwrap();
        let (kind, payload) = read_frame(&mut &out[..], 64).unwrap();
        assert_eq!((kind, payload.as_slice()), (7, &b"hello"[..]));
    }

    #[test]
    fn oversized_frame_is_refused_before_allocation() {
        let h = encode_header(1, u32::MAX);
        let err = decode_header(&h, 1024).unwrap_err();
        assert_eq!(
            err,
            WireError::TooLong {
                len: u32::MAX as u64,
                max: 1024
            }
        );
    }

    #[test]
    fn wrong_magic_and_version() {
        let mut h = encode_header(1, 0);
        h[0] = b'X';
        assert!(matches!(
            decode_header(&h, 8),
            Err(WireError::BadMagic { .. })
        ));
        let mut h = encode_header(1, 0);
        h[4] = 99;
        assert_eq!(
            decode_header(&h, 8),
            Err(WireError::VersionMismatch { theirs: 99 })
        );
    }

    #[test]
    fn reader_reports_truncation_and_trailing() {
        let mut w = Writer::new();
        w.u32(5).str("ab");
        let p = w.finish();
        let mut r = Reader::new(&p);
        assert_eq!(r.u32("x").unwrap(), 5);
        assert_eq!(r.str("s").unwrap(), "ab");
        r.finish().unwrap();

        let mut r = Reader::new(&[2, 0, 0, 0, 9]);
        assert!(matches!(r.bytes("b"), Err(WireError::Truncated { .. })));
        let r = Reader::new(&[1]);
        assert_eq!(r.finish(), Err(WireError::TrailingBytes { count: 1 }));
    }

    proptest! {
        #[test]
        fn decode_header_never_panics(bytes in proptest::array::uniform12(any::<u8>()), max in any::<u32>()) {
            let _ = decode_header(&bytes, max);
        }

        #[test]
        fn reader_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
            let mut r = Reader::new(&bytes);
            let _ = r.str("s");
            let _ = r.u64("u");
            let _ = r.bytes("b");
            let _ = r.array::<3>("a");
        }
    }
}
