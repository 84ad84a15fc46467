//! Mutual authentication of a new TCP connection with the job token.
//!
//! Both ends prove that they hold the token without sending it (HMAC-SHA256 over fresh nonces):
//!
//! ```text
//! client                                   server
//!   HELLO  {purpose, nonce_c, rank, world}  ->
//!       <- CHALLENGE {nonce_s, mac_s = HMAC(token, "server" | purpose | nonce_c | nonce_s)}
//!   (client checks mac_s: a stranger's server is detected here)
//!   PROOF  {mac_c = HMAC(token, "client" | purpose | nonce_c | nonce_s | rank | world)} ->
//!       <- WELCOME {}  or  REFUSE {reason}
//! ```
//!
//! A peer with another protocol version fails at the frame header (`VersionMismatch`), which both
//! sides report as `RendezvousError::ProtocolMismatch`.

use crate::error::{ConfigError, RendezvousError};
use std::io;
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::config::JobToken;
use crate::types::{Rank, WorldSize};
use crate::wire::{self, FrameError, Reader, WireError, Writer};
use crate::{DdpError, Result};

/// Largest handshake frame.
pub(crate) const MAX_HANDSHAKE_FRAME: u32 = 4096;

const HELLO: u8 = 0x01;
const CHALLENGE: u8 = 0x02;
const PROOF: u8 = 0x03;
const WELCOME: u8 = 0x04;
const REFUSE: u8 = 0x05;

/// What a connection is for; part of the MAC so a transport handshake cannot be replayed to the store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum Purpose {
    /// A rank joining the key-value store.
    Store = 1,
    /// A data-plane link between two ranks.
    Transport = 2,
    /// The bandwidth tool's loopback measurement link.
    Bench = 3,
    /// An auxiliary store connection of a rank (watchdog, heartbeats); not a membership claim.
    StoreAux = 4,
}

impl Purpose {
    fn from_code(code: u8) -> Option<Self> {
        Some(match code {
            1 => Purpose::Store,
            2 => Purpose::Transport,
            3 => Purpose::Bench,
            4 => Purpose::StoreAux,
            _ => return None,
        })
    }
}

/// Why a server refused a client, as sent on the wire.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum RefuseReason {
    /// The client's proof did not verify.
    WrongToken,
    /// The client's world size differs from the server's.
    WorldSize {
        /// The server's rank.
        server_rank: Rank,
        /// The server's world size.
        server_world: WorldSize,
    },
    /// Another live connection already claimed this rank.
    DuplicateRank {
        /// Address of the first claimant.
        first: SocketAddr,
        /// Address of this (second) claimant.
        second: SocketAddr,
    },
    /// The rank is outside the world.
    RankOutOfRange {
        /// The server's world size.
        world: WorldSize,
    },
    /// The transport expected another rank on this link.
    UnexpectedPeer {
        /// The rank it expected.
        expected: Rank,
    },
    /// The server has reached its connection limit.
    Busy,
}

impl RefuseReason {
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut w = Writer::new();
        match self {
            RefuseReason::WrongToken => w.u8(1),
            RefuseReason::WorldSize {
                server_rank,
                server_world,
            } => w.u8(2).u32(server_rank.0).u32(server_world.get()),
            RefuseReason::DuplicateRank { first, second } => {
                w.u8(3).str(&first.to_string()).str(&second.to_string())
            }
            RefuseReason::RankOutOfRange { world } => w.u8(4).u32(world.get()),
            RefuseReason::UnexpectedPeer { expected } => w.u8(5).u32(expected.0),
            RefuseReason::Busy => w.u8(6),
        };
        w.finish()
    }

    pub(crate) fn decode(payload: &[u8]) -> std::result::Result<Self, WireError> {
        let mut r = Reader::new(payload);
        let reason = match r.u8("refuse reason")? {
            1 => RefuseReason::WrongToken,
            2 => RefuseReason::WorldSize {
                server_rank: Rank(r.u32("server rank")?),
                server_world: world(r.u32("server world")?)?,
            },
            3 => RefuseReason::DuplicateRank {
                first: addr(r.str("first claimant")?)?,
                second: addr(r.str("second claimant")?)?,
            },
            4 => RefuseReason::RankOutOfRange {
                world: world(r.u32("world")?)?,
            },
            5 => RefuseReason::UnexpectedPeer {
                expected: Rank(r.u32("expected rank")?),
            },
            6 => RefuseReason::Busy,
            _ => {
                return Err(WireError::InvalidValue {
                    what: "refuse reason",
                })
            }
        };
        r.finish()?;
        Ok(reason)
    }
}

fn world(n: u32) -> std::result::Result<WorldSize, WireError> {
    WorldSize::new(n).ok_or(WireError::InvalidValue { what: "world size" })
}

fn addr(s: &str) -> std::result::Result<SocketAddr, WireError> {
    s.parse().map_err(|_| WireError::InvalidValue {
        what: "socket address",
    })
}

type HmacSha256 = Hmac<Sha256>;

fn mac(token: &JobToken, parts: &[&[u8]]) -> HmacSha256 {
    // HMAC accepts keys of any length; `new_from_slice` cannot fail for HMAC.
    let mut m = match HmacSha256::new_from_slice(token.as_bytes()) {
        Ok(m) => m,
        Err(_) => unreachable!("HMAC-SHA256 accepts keys of every length"),
    };
    for p in parts {
        m.update(p);
    }
    m
}

fn nonce() -> [u8; 32] {
    use rand::Rng;
    rand::rng().random()
}

/// What the server learned about a client that proved it holds the token.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ClientHello {
    /// What the connection is for.
    pub purpose: Purpose,
    /// The rank the client claims.
    pub rank: Rank,
    /// The world size the client was started with.
    pub world: WorldSize,
}

/// The stream of a handshake: every read and write is bounded by what is left of one deadline
/// for the whole handshake, so a peer that trickles its bytes cannot stretch it.
struct Deadlined<'a> {
    stream: &'a TcpStream,
    deadline: Instant,
}

impl Deadlined<'_> {
    fn left(&self) -> io::Result<Duration> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "the handshake's deadline passed",
            ));
        }
        Ok(left)
    }
}

impl io::Read for Deadlined<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.stream.set_read_timeout(Some(self.left()?))?;
        io::Read::read(&mut &*self.stream, buf)
    }
}

impl io::Write for Deadlined<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.stream.set_write_timeout(Some(self.left()?))?;
        io::Write::write(&mut &*self.stream, buf)
    }

    fn flush(&mut self) -> io::Result<()> {
        io::Write::flush(&mut &*self.stream)
    }
}

fn client_error(rank: Rank, peer: SocketAddr, e: FrameError) -> DdpError {
    match e {
        FrameError::Wire(WireError::VersionMismatch { theirs }) => {
            DdpError::Rendezvous(RendezvousError::ProtocolMismatch {
                rank,
                peer,
                ours: wire::PROTOCOL_VERSION,
                theirs,
            })
        }
        FrameError::Wire(error) => {
            DdpError::Rendezvous(RendezvousError::Protocol { rank, peer, error })
        }
        FrameError::Io(e) => DdpError::Io(e),
    }
}

/// Runs the client side of the handshake on a connected stream.
///
/// # Errors
/// `TokenMismatch` if the server does not hold the token (or refuses ours), `ProtocolMismatch`,
/// the refusal translated to its `DdpError` (`WorldSizeMismatch`, `DuplicateRank`, ...), or I/O
/// errors (including the deadline, as `WouldBlock`/`TimedOut`).
pub(crate) fn client_handshake(
    stream: &mut TcpStream,
    purpose: Purpose,
    token: &JobToken,
    rank: Rank,
    world: WorldSize,
    deadline: Instant,
) -> Result<()> {
    let peer = stream.peer_addr()?;
    let mut io = Deadlined {
        stream: &*stream,
        deadline,
    };
    let nonce_c = nonce();
    let mut w = Writer::new();
    w.u8(purpose as u8)
        .raw(&nonce_c)
        .u32(rank.0)
        .u32(world.get());
    wire::write_frame(&mut io, HELLO, &w.finish())?;

    let (kind, payload) =
        wire::read_frame(&mut io, MAX_HANDSHAKE_FRAME).map_err(|e| client_error(rank, peer, e))?;
    if kind == REFUSE {
        return Err(refusal(rank, world, peer, &payload));
    }
    if kind != CHALLENGE {
        return Err(client_error(
            rank,
            peer,
            FrameError::Wire(WireError::UnknownKind { kind }),
        ));
    }
    let mut r = Reader::new(&payload);
    let parsed = (|| -> std::result::Result<_, WireError> {
        let nonce_s = r.array::<32>("server nonce")?;
        let mac_s = r.array::<32>("server mac")?;
        Ok((nonce_s, mac_s))
    })();
    let (nonce_s, mac_s) = parsed.map_err(|e| client_error(rank, peer, FrameError::Wire(e)))?;
    let p = [purpose as u8];
    if mac(token, &[b"burn-ddp/server", &p, &nonce_c, &nonce_s])
        .verify_slice(&mac_s)
        .is_err()
    {
        // Tell the server why we hang up, so that it can report the stranger precisely.
        let _ = wire::write_frame(&mut io, REFUSE, &RefuseReason::WrongToken.encode());
        return Err(DdpError::Rendezvous(RendezvousError::TokenMismatch {
            rank,
            peer,
        }));
    }
    let proof = mac(
        token,
        &[
            b"burn-ddp/client",
            &p,
            &nonce_c,
            &nonce_s,
            &rank.0.to_le_bytes(),
            &world.get().to_le_bytes(),
        ],
    )
    .finalize()
    .into_bytes();
    wire::write_frame(&mut io, PROOF, &proof)?;

    let (kind, payload) =
        wire::read_frame(&mut io, MAX_HANDSHAKE_FRAME).map_err(|e| client_error(rank, peer, e))?;
    match kind {
        WELCOME => {
            stream.set_read_timeout(None)?;
            stream.set_write_timeout(None)?;
            Ok(())
        }
        REFUSE => Err(refusal(rank, world, peer, &payload)),
        kind => Err(client_error(
            rank,
            peer,
            FrameError::Wire(WireError::UnknownKind { kind }),
        )),
    }
}

fn refusal(rank: Rank, world: WorldSize, peer: SocketAddr, payload: &[u8]) -> DdpError {
    match RefuseReason::decode(payload) {
        Ok(RefuseReason::WrongToken) => {
            DdpError::Rendezvous(RendezvousError::TokenMismatch { rank, peer })
        }
        Ok(RefuseReason::WorldSize {
            server_rank,
            server_world,
        }) => DdpError::Rendezvous(RendezvousError::WorldSizeMismatch {
            rank,
            other: server_rank,
            ours: world,
            theirs: server_world,
        }),
        Ok(RefuseReason::DuplicateRank { first, second }) => {
            DdpError::Rendezvous(RendezvousError::DuplicateRank {
                rank,
                claimed: rank,
                first,
                second,
            })
        }
        Ok(RefuseReason::RankOutOfRange { world }) => {
            DdpError::Config(ConfigError::RankOutOfRange { rank, world })
        }
        Ok(RefuseReason::UnexpectedPeer { expected }) => {
            DdpError::Rendezvous(RendezvousError::StoreRefused {
                rank,
                reason: format!("{peer} expected rank {expected} on this link, not rank {rank}"),
            })
        }
        Ok(RefuseReason::Busy) => DdpError::Rendezvous(RendezvousError::StoreRefused {
            rank,
            reason: format!("{peer} has too many open connections"),
        }),
        Err(error) => DdpError::Rendezvous(RendezvousError::Protocol { rank, peer, error }),
    }
}

/// Why the server side of a handshake failed.
#[derive(Debug)]
pub(crate) enum ServerHandshakeError {
    /// The client is not a burn-ddp peer of this version, or sent garbage.
    Wire(WireError),
    /// The client does not hold the token (already told so).
    WrongToken,
    /// The connection failed or timed out.
    Io(io::Error),
}

impl std::fmt::Display for ServerHandshakeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ServerHandshakeError::Wire(e) => write!(f, "invalid handshake: {e}"),
            ServerHandshakeError::WrongToken => f.write_str("it does not hold this job's token"),
            ServerHandshakeError::Io(e) => write!(f, "{e}"),
        }
    }
}

impl From<FrameError> for ServerHandshakeError {
    fn from(e: FrameError) -> Self {
        match e {
            FrameError::Io(e) => ServerHandshakeError::Io(e),
            FrameError::Wire(e) => ServerHandshakeError::Wire(e),
        }
    }
}

/// Runs the server side of the handshake up to (and including) the proof check.
/// The caller then admits the client with [`welcome`] or refuses it with [`refuse`].
///
/// On a wrong token the client is told (`REFUSE WrongToken`) before this returns.
pub(crate) fn server_handshake(
    stream: &TcpStream,
    accepted: &[Purpose],
    token: &JobToken,
    deadline: Instant,
) -> std::result::Result<ClientHello, ServerHandshakeError> {
    let mut io = Deadlined { stream, deadline };
    let (kind, payload) = match wire::read_frame(&mut io, MAX_HANDSHAKE_FRAME) {
        Ok(f) => f,
        Err(FrameError::Wire(e)) => {
            if let Some((k, p)) = answer_to_unreadable_hello(&e) {
                let _ = wire::write_frame(&mut io, k, &p);
            }
            return Err(ServerHandshakeError::Wire(e));
        }
        Err(e) => return Err(e.into()),
    };
    let (challenge, (k, p)) = server_challenge(kind, &payload, accepted, token)?;
    wire::write_frame(&mut io, k, &p).map_err(ServerHandshakeError::Io)?;
    let (kind, payload) = wire::read_frame(&mut io, MAX_HANDSHAKE_FRAME)?;
    challenge
        .check_proof(kind, &payload, token)
        .map_err(|(e, answer)| {
            if let Some((k, p)) = answer {
                let _ = wire::write_frame(&mut io, k, &p);
            }
            e
        })
}

/// A frame to send: its kind and payload.
pub(crate) type Frame = (u8, Vec<u8>);

/// What the server tells a client whose first frame it could not read: one of another protocol
/// version is told which version the server speaks (it reports `ProtocolMismatch`).
pub(crate) fn answer_to_unreadable_hello(e: &WireError) -> Option<Frame> {
    matches!(e, WireError::VersionMismatch { .. }).then(|| refusal_frame(&RefuseReason::WrongToken))
}

/// The server's side of a handshake between the client's hello and its proof (for a server
/// that reads its frames itself, as the store's event loop does: [`server_challenge`], then
/// [`ServerChallenge::check_proof`]).
#[derive(Debug)]
pub(crate) struct ServerChallenge {
    purpose: Purpose,
    nonce_c: [u8; 32],
    nonce_s: [u8; 32],
    rank: Rank,
    world: WorldSize,
}

/// Answers a client's first frame (`HELLO`) with the server's challenge: the frame to send.
pub(crate) fn server_challenge(
    kind: u8,
    payload: &[u8],
    accepted: &[Purpose],
    token: &JobToken,
) -> std::result::Result<(ServerChallenge, Frame), ServerHandshakeError> {
    if kind != HELLO {
        return Err(ServerHandshakeError::Wire(WireError::UnknownKind { kind }));
    }
    let mut r = Reader::new(payload);
    let hello = (|| -> std::result::Result<_, WireError> {
        let p = r.u8("purpose")?;
        let nonce_c = r.array::<32>("client nonce")?;
        let rank = Rank(r.u32("rank")?);
        let world = world(r.u32("world size")?)?;
        Ok((p, nonce_c, rank, world))
    })();
    let (p, nonce_c, rank, world) = hello.map_err(ServerHandshakeError::Wire)?;
    let purpose = match Purpose::from_code(p) {
        Some(purpose) if accepted.contains(&purpose) => purpose,
        _ => {
            return Err(ServerHandshakeError::Wire(WireError::InvalidValue {
                what: "connection purpose",
            }))
        }
    };
    let nonce_s = nonce();
    let mac_s = mac(token, &[b"burn-ddp/server", &[p], &nonce_c, &nonce_s])
        .finalize()
        .into_bytes();
    let mut w = Writer::new();
    w.raw(&nonce_s).raw(&mac_s);
    let challenge = ServerChallenge {
        purpose,
        nonce_c,
        nonce_s,
        rank,
        world,
    };
    Ok((challenge, (CHALLENGE, w.finish())))
}

impl ServerChallenge {
    /// Checks the client's second frame (`PROOF`): the client it authenticates, or why not,
    /// with the frame to send the client before closing, if any (a wrong proof is told
    /// `REFUSE WrongToken`; a client that refused the server's own proof is not answered).
    pub(crate) fn check_proof(
        &self,
        kind: u8,
        payload: &[u8],
        token: &JobToken,
    ) -> std::result::Result<ClientHello, (ServerHandshakeError, Option<Frame>)> {
        if kind == REFUSE {
            // The client could not verify our proof: it holds another token.
            return Err((ServerHandshakeError::WrongToken, None));
        }
        if kind != PROOF {
            return Err((
                ServerHandshakeError::Wire(WireError::UnknownKind { kind }),
                None,
            ));
        }
        let ok = mac(
            token,
            &[
                b"burn-ddp/client",
                &[self.purpose as u8],
                &self.nonce_c,
                &self.nonce_s,
                &self.rank.0.to_le_bytes(),
                &self.world.get().to_le_bytes(),
            ],
        )
        .verify_slice(payload)
        .is_ok();
        if !ok {
            return Err((
                ServerHandshakeError::WrongToken,
                Some(refusal_frame(&RefuseReason::WrongToken)),
            ));
        }
        Ok(ClientHello {
            purpose: self.purpose,
            rank: self.rank,
            world: self.world,
        })
    }
}

/// The frame that admits a client after its proof.
pub(crate) fn welcome_frame() -> Frame {
    (WELCOME, Vec::new())
}

/// The frame that refuses a client after its proof, telling it why.
pub(crate) fn refusal_frame(reason: &RefuseReason) -> Frame {
    (REFUSE, reason.encode())
}

/// Admits a client after a successful [`server_handshake`].
pub(crate) fn welcome(mut stream: &TcpStream) -> io::Result<()> {
    wire::write_frame(&mut stream, WELCOME, &[])?;
    stream.set_read_timeout(None)?;
    stream.set_write_timeout(None)
}

/// Refuses a client after a successful [`server_handshake`], telling it why.
pub(crate) fn refuse(mut stream: &TcpStream, reason: &RefuseReason) -> io::Result<()> {
    wire::write_frame(&mut stream, REFUSE, &reason.encode())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;
    use std::thread;

    fn pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let c = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (s, _) = l.accept().unwrap();
        (c, s)
    }

    fn deadline() -> Instant {
        Instant::now() + Duration::from_secs(5)
    }

    #[test]
    fn same_token_is_welcomed() {
        let (mut c, s) = pair();
        let server = thread::spawn(move || {
            let hello =
                server_handshake(&s, &[Purpose::Store], &JobToken::new("t"), deadline()).unwrap();
            welcome(&s).unwrap();
            hello.rank
        });
        client_handshake(
            &mut c,
            Purpose::Store,
            &JobToken::new("t"),
            Rank(3),
            WorldSize::new(4).unwrap(),
            deadline(),
        )
        .unwrap();
        assert_eq!(server.join().unwrap(), Rank(3));
    }

    #[test]
    fn wrong_token_fails_on_both_sides() {
        let (mut c, s) = pair();
        let server = thread::spawn(move || {
            server_handshake(&s, &[Purpose::Store], &JobToken::new("a"), deadline())
        });
        let err = client_handshake(
            &mut c,
            Purpose::Store,
            &JobToken::new("b"),
            Rank(1),
            WorldSize::new(2).unwrap(),
            deadline(),
        )
        .unwrap_err();
        assert!(
            matches!(
                err,
                DdpError::Rendezvous(RendezvousError::TokenMismatch { .. })
            ),
            "{err}"
        );
        // The client detects the foreign server first and tells it why it leaves.
        assert!(matches!(
            server.join().unwrap(),
            Err(ServerHandshakeError::WrongToken)
        ));
    }

    #[test]
    fn purposes_are_not_interchangeable() {
        let (mut c, s) = pair();
        let server = thread::spawn(move || {
            server_handshake(&s, &[Purpose::Store], &JobToken::new("t"), deadline())
        });
        let _ = client_handshake(
            &mut c,
            Purpose::Transport,
            &JobToken::new("t"),
            Rank(1),
            WorldSize::new(2).unwrap(),
            deadline(),
        );
        assert!(matches!(
            server.join().unwrap(),
            Err(ServerHandshakeError::Wire(WireError::InvalidValue { .. }))
        ));
    }

    #[test]
    fn refuse_reasons_round_trip() {
        let reasons = [
            RefuseReason::WrongToken,
            RefuseReason::WorldSize {
                server_rank: Rank(0),
                server_world: WorldSize::new(4).unwrap(),
            },
            RefuseReason::DuplicateRank {
                first: "127.0.0.1:1".parse().unwrap(),
                second: "127.0.0.1:2".parse().unwrap(),
            },
            RefuseReason::RankOutOfRange {
                world: WorldSize::new(2).unwrap(),
            },
            RefuseReason::UnexpectedPeer { expected: Rank(2) },
            RefuseReason::Busy,
        ];
        for r in reasons {
            assert_eq!(RefuseReason::decode(&r.encode()).unwrap(), r);
        }
    }
}
