//! Establishing the ring's TCP links: listen, publish the address in the store, connect to the
//! next rank and accept the previous one, each link authenticated with the job token.

use crate::error::{ConfigError, RendezvousError};
use std::io::ErrorKind;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsFd;
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use super::tree;
use crate::config::{Algorithm, JobToken};
use crate::store::auth::{self, Purpose, RefuseReason, ServerHandshakeError};
use crate::store::{StoreClient, WaitOutcome};
use crate::types::{Rank, RankList, WorldSize};
use crate::{sys, DdpError, Result};

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

    let local_ip = store.local_ip()?;
    let listener = TcpListener::bind(SocketAddr::new(local_ip, 0))?;
    let addr = listener.local_addr()?;
    store.set(&format!("{tag}/addr/{rank}"), addr.to_string().as_bytes())?;

    let keys: Vec<String> = [next, prev]
        .iter()
        .map(|r| format!("{tag}/addr/{r}"))
        .collect();
    wait_published(setup, &keys)?;

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

/// Waits until every key of `keys` (each ending in `/{rank}`) is in the store.
///
/// # Errors
/// `RendezvousTimeout` naming the ranks whose keys are missing at the deadline.
pub(crate) fn wait_published(setup: &LinkSetup<'_>, keys: &[String]) -> Result<()> {
    let started = Instant::now();
    let left = setup.deadline.saturating_duration_since(started);
    if let WaitOutcome::Missing(missing) = setup.store.wait(keys, left)? {
        let missing: Vec<Rank> = missing
            .iter()
            .filter_map(|k| k.rsplit('/').next()?.parse().ok().map(Rank))
            .collect();
        return Err(DdpError::Rendezvous(RendezvousError::RendezvousTimeout {
            rank: setup.rank,
            addr: setup.store.addr().to_string(),
            waited: started.elapsed(),
            joined: setup.world.as_usize().saturating_sub(missing.len()),
            world: setup.world,
            missing: RankList(missing),
            refused_note: String::new(),
        }));
    }
    Ok(())
}

/// Waits until every rank of the group has published its key of `keys` (one per rank),
/// counting arrivals at the store barrier `barrier` once it has published
/// ([`StoreClient::arrive`]) rather than reading every key. Past the deadline, the ranks whose
/// keys are missing are named as [`wait_published`] names them.
///
/// # Errors
/// `RendezvousTimeout` naming the ranks whose keys are missing at the deadline.
pub(crate) fn wait_all_published(
    setup: &LinkSetup<'_>,
    barrier: &str,
    key: impl Fn(usize) -> String,
) -> Result<()> {
    let all = setup.store.arrive(barrier, setup.world.get())?;
    let left = setup.deadline.saturating_duration_since(Instant::now());
    match setup.store.wait(std::slice::from_ref(&all), left)? {
        WaitOutcome::Ready => Ok(()),
        // The deadline passed: name who is missing (a zero-time check of every key). Only
        // then are the keys made: every rank making every rank's is n² strings in all.
        WaitOutcome::Missing(_) => {
            let keys: Vec<String> = (0..setup.world.as_usize()).map(key).collect();
            wait_published(setup, &keys)
        }
    }
}

/// A transport address published in the store.
fn parse_addr(setup: &LinkSetup<'_>, raw: &[u8]) -> Result<SocketAddr> {
    std::str::from_utf8(raw)
        .ok()
        .and_then(|s| s.parse().ok())
        .ok_or(DdpError::Rendezvous(RendezvousError::Protocol {
            rank: setup.rank,
            peer: setup.store.addr(),
            error: crate::wire::WireError::InvalidValue {
                what: "published transport address",
            },
        }))
}

/// Opens the links of recursive doubling (`tree.rs`) for `algorithm`, after checking that every
/// rank of the group chose the same one: one link per partner, by place (`None` elsewhere; all
/// `None` for [`Algorithm::Ring`]).
///
/// # Errors
/// `AlgorithmMismatch` naming a rank that chose another algorithm; as [`open_ring`].
pub(crate) fn open_tree(
    setup: &LinkSetup<'_>,
    algorithm: Algorithm,
) -> Result<Vec<Option<TcpStream>>> {
    let LinkSetup {
        store,
        rank,
        world,
        tag,
        deadline,
        ..
    } = *setup;
    let n = world.as_usize();
    let listener = if algorithm == Algorithm::Ring {
        None
    } else {
        Some(TcpListener::bind(SocketAddr::new(store.local_ip()?, 0))?)
    };
    let addr = match &listener {
        Some(l) => l.local_addr()?.to_string(),
        None => "-".into(),
    };
    // Every rank counts itself under its algorithm before it publishes its address: once every
    // address is there, a count short of the world means some rank chose another algorithm.
    let count_key = format!("{tag}/algo-count/{algorithm}");
    store.add(&count_key, 1)?;
    store.set(
        &format!("{tag}/tree/{rank}"),
        format!("{algorithm} {addr}").as_bytes(),
    )?;
    let key = |r: usize| format!("{tag}/tree/{r}");
    wait_all_published(setup, &format!("{tag}/tree-barrier"), key)?;
    let parse = |raw: &[u8]| {
        let text = String::from_utf8_lossy(raw).into_owned();
        let (algo, addr) = text.split_once(' ').unwrap_or((text.as_str(), ""));
        (Algorithm::parse(algo), addr.as_bytes().to_vec())
    };
    let published = |peer: usize| -> Result<(Option<Algorithm>, Vec<u8>)> {
        Ok(parse(&store.get(&key(peer))?))
    };
    if store.add(&count_key, 0)? != n as i64 {
        let keys: Vec<String> = (0..n).map(key).collect();
        for (peer, raw) in store.get_many(&keys)?.into_iter().enumerate() {
            match parse(&raw).0 {
                Some(theirs) if theirs == algorithm => {}
                theirs => {
                    return Err(DdpError::Config(ConfigError::AlgorithmMismatch {
                        rank,
                        ours: algorithm,
                        peer: Rank(peer as u32),
                        theirs: theirs.unwrap_or(Algorithm::Auto),
                    }))
                }
            }
        }
    }
    let mut links: Vec<Option<TcpStream>> = (0..n).map(|_| None).collect();
    let Some(listener) = listener else {
        return Ok(links);
    };
    let me = rank.index();
    let partners = tree::partners(me, n);
    // Each pair's lower rank accepts, the higher one connects; accepting on a thread lets a rank
    // do both at once.
    let higher: Vec<Rank> = partners
        .iter()
        .filter(|&&p| p > me)
        .map(|&p| Rank(p as u32))
        .collect();
    let give_up = Arc::new(sys::Alarm::new()?);
    let acceptor = {
        let token = setup.token.clone();
        let give_up = Arc::clone(&give_up);
        thread::Builder::new()
            .name("burn-ddp-accept".into())
            .spawn(move || {
                accept_all(
                    &listener,
                    &token,
                    (rank, world, deadline),
                    &higher,
                    Some(&give_up),
                )
            })?
    };
    let mut failed = None;
    for &p in partners.iter().filter(|&&p| p < me) {
        let peer = Rank(p as u32);
        let linked = published(p)
            .and_then(|(_, raw)| parse_addr(setup, &raw))
            .and_then(|addr| connect_to(setup, peer, addr));
        match linked {
            Ok(s) => links[p] = Some(s),
            Err(e) => {
                give_up.raise();
                failed = Some(e);
                break;
            }
        }
    }
    let accepted = acceptor.join().map_err(|_| {
        DdpError::Config(ConfigError::InvalidConfig {
            field: "transport",
            reason: "accept thread panicked",
        })
    })?;
    if let Some(e) = failed {
        return Err(e);
    }
    for (r, s) in accepted? {
        links[r.index()] = Some(s);
    }
    Ok(links)
}

fn connect(setup: &LinkSetup<'_>, peer: Rank) -> Result<TcpStream> {
    let raw = setup.store.get(&format!("{}/addr/{peer}", setup.tag))?;
    connect_to(setup, peer, parse_addr(setup, &raw)?)
}

fn connect_to(setup: &LinkSetup<'_>, peer: Rank, addr: SocketAddr) -> Result<TcpStream> {
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
    who: (Rank, WorldSize, Instant),
    expected: Rank,
) -> Result<TcpStream> {
    let mut got = accept_all(listener, token, who, &[expected], None)?;
    match got.pop() {
        Some((_, s)) => Ok(s),
        None => unreachable!("accept_all returns one link per expected rank"),
    }
}

/// Accepts one authenticated link from each rank of `expected`, in any order; returns them with
/// their rank. Stops early, with what it has, once `give_up` is raised.
fn accept_all(
    listener: &TcpListener,
    token: &JobToken,
    (rank, world, deadline): (Rank, WorldSize, Instant),
    expected: &[Rank],
    give_up: Option<&sys::Alarm>,
) -> Result<Vec<(Rank, TcpStream)>> {
    listener.set_nonblocking(true)?;
    let started = Instant::now();
    let mut got: Vec<(Rank, TcpStream)> = Vec::with_capacity(expected.len());
    while got.len() < expected.len() {
        let waiting = |got: &[(Rank, TcpStream)]| -> Vec<Rank> {
            expected
                .iter()
                .copied()
                .filter(|r| !got.iter().any(|(g, _)| g == r))
                .collect()
        };
        match listener.accept() {
            Ok((s, peer)) => {
                s.set_nonblocking(false)?;
                let hs_deadline = deadline.min(Instant::now() + Duration::from_secs(10));
                let missing = waiting(&got);
                match auth::server_handshake(&s, &[Purpose::Transport], token, hs_deadline) {
                    Ok(hello) if missing.contains(&hello.rank) && hello.world == world => {
                        auth::welcome(&s)?;
                        tune(&s)?;
                        got.push((hello.rank, s));
                    }
                    Ok(hello) => {
                        let expected = missing.first().copied().unwrap_or(hello.rank);
                        let _ = auth::refuse(&s, &RefuseReason::UnexpectedPeer { expected });
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
                if give_up.is_some_and(sys::Alarm::is_raised) {
                    break;
                }
                if Instant::now() >= deadline {
                    let missing = waiting(&got);
                    let who = match missing.as_slice() {
                        [one] => format!("rank {one} published its address"),
                        many => format!(
                            "ranks {} published their addresses",
                            RankList(many.to_vec())
                        ),
                    };
                    return Err(DdpError::Rendezvous(RendezvousError::RendezvousTimeout {
                        rank,
                        addr: listener
                            .local_addr()
                            .map(|a| a.to_string())
                            .unwrap_or_default(),
                        waited: started.elapsed(),
                        joined: world.as_usize() - missing.len(),
                        world,
                        missing: RankList(missing),
                        refused_note: format!(" ({who} but never connected to this rank)"),
                    }));
                }
                // Asleep until a peer connects or `give_up` is raised: a rank of a large job
                // waits here while thousands of others start, and waking to look (every few
                // milliseconds, later every 100) made those waits most of the machine's work.
                let readable = sys::Ready {
                    read: true,
                    write: false,
                };
                let mut fds = vec![(listener.as_fd(), readable)];
                fds.extend(give_up.map(|g| (g.fd(), readable)));
                sys::poll_set(&fds, deadline.saturating_duration_since(Instant::now()))?;
            }
            Err(e) => return Err(e.into()),
        }
    }
    Ok(got)
}
