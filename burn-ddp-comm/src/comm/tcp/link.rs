//! Establishing the ring's TCP links: listen, publish the address in the store, connect to the
//! next rank and accept the previous one, each link authenticated with the job token.

use crate::error::{ConfigError, RendezvousError};
use std::io::ErrorKind;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::thread;
use std::time::{Duration, Instant};

use crate::config::JobToken;
use crate::store::auth::{self, Purpose, RefuseReason, ServerHandshakeError};
use crate::store::{StoreClient, WaitOutcome};
use crate::types::{Rank, RankList, WorldSize};
use crate::{DdpError, Result};

/// What a rank needs to open its links.
#[derive(Debug, Clone)]
pub(crate) struct LinkSetup<'a> {
    pub store: &'a StoreClient,
    pub rank: Rank,
    pub world: WorldSize,
    pub token: &'a JobToken,
    /// Prefix of the store keys (distinguishes groups sharing a store).
    pub tag: &'a str,
    pub deadline: Instant,
}

/// The established links. `prev` is `None` when it is the same connection as `next` (world 2).
#[derive(Debug)]
pub(crate) struct Ring {
    pub next: TcpStream,
    pub prev: Option<TcpStream>,
}

fn tune(stream: &TcpStream) -> std::io::Result<()> {
    stream.set_nodelay(true)?;
    let sock = socket2::SockRef::from(stream);
    // Detect a peer machine that vanished without closing the connection (power loss, network
    // partition) even if no collective is running.
    let keepalive = socket2::TcpKeepalive::new()
        .with_time(Duration::from_secs(10))
        .with_interval(Duration::from_secs(2))
        .with_retries(5);
    sock.set_tcp_keepalive(&keepalive)?;
    Ok(())
}

/// Opens the links of a ring of `world >= 2`.
///
/// # Errors
/// Rendezvous timeouts naming the ranks that never published an address, handshake errors, and
/// I/O errors.
pub(crate) fn open_ring(setup: &LinkSetup<'_>) -> Result<Ring> {
    let LinkSetup {
        store,
        rank,
        world,
        tag,
        deadline,
        ..
    } = *setup;
    let n = world.get();
    let next = Rank((rank.0 + 1) % n);
    let prev = Rank((rank.0 + n - 1) % n);

    let local_ip = store.local_addr()?.ip();
    let listener = TcpListener::bind(SocketAddr::new(local_ip, 0))?;
    let addr = listener.local_addr()?;
    store.set(&format!("{tag}/addr/{rank}"), addr.to_string().as_bytes())?;

    let keys: Vec<String> = [next, prev]
        .iter()
        .map(|r| format!("{tag}/addr/{r}"))
        .collect();
    let started = Instant::now();
    let left = deadline.saturating_duration_since(started);
    if let WaitOutcome::Missing(missing) = store.wait(&keys, left)? {
        let missing: Vec<Rank> = missing
            .iter()
            .filter_map(|k| k.rsplit('/').next()?.parse().ok().map(Rank))
            .collect();
        return Err(DdpError::Rendezvous(RendezvousError::RendezvousTimeout {
            rank,
            addr: store.addr().to_string(),
            waited: started.elapsed(),
            joined: (n as usize).saturating_sub(missing.len()),
            world,
            missing: RankList(missing),
            refused_note: String::new(),
        }));
    }

    if n == 2 {
        // One full-duplex connection: rank 0 connects, rank 1 accepts.
        let stream = if rank.0 == 0 {
            connect(setup, next)?
        } else {
            accept(&listener, setup, prev)?
        };
        return Ok(Ring {
            next: stream,
            prev: None,
        });
    }

    // Everyone connects forward and accepts from behind; accepting on a thread avoids the
    // cycle in which every rank waits for its successor's handshake.
    let token = setup.token.clone();
    let acceptor = {
        let listener = listener.try_clone()?;
        let setup_owned = (rank, world, deadline);
        thread::Builder::new()
            .name("burn-ddp-accept".into())
            .spawn(move || accept_owned(&listener, &token, setup_owned, prev))?
    };
    let next_stream = connect(setup, next);
    let prev_stream = acceptor.join().map_err(|_| {
        DdpError::Config(ConfigError::InvalidConfig {
            field: "transport",
            reason: "accept thread panicked",
        })
    })?;
    Ok(Ring {
        next: next_stream?,
        prev: Some(prev_stream?),
    })
}

fn connect(setup: &LinkSetup<'_>, peer: Rank) -> Result<TcpStream> {
    let raw = setup.store.get(&format!("{}/addr/{peer}", setup.tag))?;
    let addr: SocketAddr = std::str::from_utf8(&raw)
        .ok()
        .and_then(|s| s.parse().ok())
        .ok_or(DdpError::Rendezvous(RendezvousError::Protocol {
            rank: setup.rank,
            peer: setup.store.addr(),
            error: crate::wire::WireError::InvalidValue {
                what: "published transport address",
            },
        }))?;
    let mut last = std::io::Error::new(ErrorKind::TimedOut, "no attempt");
    let started = Instant::now();
    loop {
        let left = setup.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(DdpError::Rendezvous(RendezvousError::PeerUnreachable {
                rank: setup.rank,
                peer,
                addr,
                waited: started.elapsed(),
                last_error: last,
            }));
        }
        match TcpStream::connect_timeout(&addr, left.min(Duration::from_secs(5))) {
            Ok(mut s) => {
                tune(&s)?;
                auth::client_handshake(
                    &mut s,
                    Purpose::Transport,
                    setup.token,
                    setup.rank,
                    setup.world,
                    setup.deadline,
                )?;
                return Ok(s);
            }
            Err(e) => {
                last = e;
                thread::sleep(Duration::from_millis(20));
            }
        }
    }
}

fn accept(listener: &TcpListener, setup: &LinkSetup<'_>, expected: Rank) -> Result<TcpStream> {
    accept_owned(
        listener,
        setup.token,
        (setup.rank, setup.world, setup.deadline),
        expected,
    )
}

fn accept_owned(
    listener: &TcpListener,
    token: &JobToken,
    (rank, world, deadline): (Rank, WorldSize, Instant),
    expected: Rank,
) -> Result<TcpStream> {
    listener.set_nonblocking(true)?;
    let started = Instant::now();
    loop {
        match listener.accept() {
            Ok((mut s, peer)) => {
                s.set_nonblocking(false)?;
                let hs_deadline = deadline.min(Instant::now() + Duration::from_secs(10));
                match auth::server_handshake(&mut s, &[Purpose::Transport], token, hs_deadline) {
                    Ok(hello) if hello.rank == expected && hello.world == world => {
                        auth::welcome(&mut s)?;
                        tune(&s)?;
                        return Ok(s);
                    }
                    Ok(hello) => {
                        let _ = auth::refuse(&mut s, &RefuseReason::UnexpectedPeer { expected });
                        tracing::warn!(
                            "[rank {rank}] refused a transport link from {peer}: it claims rank {} (world {}), expected rank {expected}",
                            hello.rank,
                            hello.world
                        );
                    }
                    Err(ServerHandshakeError::WrongToken) => tracing::warn!(
                        "[rank {rank}] refused a transport link from {peer}: wrong job token"
                    ),
                    Err(e) => {
                        tracing::warn!("[rank {rank}] refused a transport link from {peer}: {e}")
                    }
                }
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    return Err(DdpError::Rendezvous(RendezvousError::RendezvousTimeout {
                        rank,
                        addr: listener
                            .local_addr()
                            .map(|a| a.to_string())
                            .unwrap_or_default(),
                        waited: started.elapsed(),
                        joined: world.as_usize() - 1,
                        world,
                        missing: RankList(vec![expected]),
                        refused_note: format!(
                            " (rank {expected} published its address but never connected to this rank)"
                        ),
                    }));
                }
                thread::sleep(Duration::from_millis(5));
            }
            Err(e) => return Err(e.into()),
        }
    }
}
