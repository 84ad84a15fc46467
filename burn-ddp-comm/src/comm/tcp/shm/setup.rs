//! Whether a group moves its collectives through shared memory, and handing the segment to
//! every rank.
//!
//! 1. Every rank counts itself under its transport choice and under its host's identity
//!    (`sys::shared::host_identity`), and publishes its choice, process id and host. A choice
//!    that differs is a `TransportMismatch` on every rank.
//!    - All on one host: steps 2 to 4 for the group.
//!    - The same number (at least 2) on each of several hosts: steps 2 to 4 for the ranks of
//!      each host (a segment per host), every rank of the group says whether its host's
//!      segment is attached, and only when all are does each open its ring across hosts (the
//!      ranks of its local index on every host): a [`Hierarchy`].
//!    - Otherwise TCP (or an error, when `shm` was asked for; silently when no two ranks share a
//!      host).
//! 2. Place 0 creates the segment (an anonymous memory file), listens on an abstract Unix socket
//!    with a random name, and publishes the name (or why it could not).
//! 3. The others connect and say their place; place 0 hands the memory file over only to a
//!    process of its own user whose process id (which the kernel vouches for) is the one that
//!    place published in the job's authenticated store.
//! 4. Every rank counts itself attached (or publishes why not); only when all are does the
//!    group use the segment, so that all ranks decide alike.

use std::ffi::CString;
use std::io::{ErrorKind, Read};
use std::os::fd::AsFd;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::time::{Duration, Instant};

use sha2::Digest;

use super::{chunk_for, segment_len, Hierarchy, Segment, Shm};
use crate::comm::tcp::link::{self, wait_published, LinkSetup};
use crate::config::Transport;
use crate::error::ConfigError;
use crate::sys::shared::{self, Mapping};
use crate::types::{Rank, WorldSize};
use crate::{DdpError, Result};

/// How long place 0 waits for a connected rank to say which it is.
const HELLO: Duration = Duration::from_secs(10);

/// The group's segment, when it uses one: every rank's `transport` must be the same; `Auto`
/// uses shared memory when the whole group is on one host and it can be set up, `Shm` insists.
///
/// # Errors
/// `TransportMismatch`; `SharedMemory` (for `Shm`) naming what failed; store and rendezvous
/// errors as when opening links.
pub(crate) fn open(setup: &LinkSetup<'_>, transport: Transport) -> Result<Option<Segment>> {
    let LinkSetup {
        store,
        rank,
        world,
        tag,
        ..
    } = *setup;
    let n = world.as_usize();
    let identity = shared::host_identity();
    let host = hex(&sha2::Sha256::digest(identity.as_bytes())[..12]);
    let count_key = format!("{tag}/transport-count/{transport}");
    let host_key = format!("{tag}/host-count/{host}");
    store.add(&count_key, 1)?;
    store.add(&host_key, 1)?;
    let key = |r: usize| format!("{tag}/transport/{r}");
    store.set(
        &key(rank.index()),
        format!("{transport} {} {host}", std::process::id()).as_bytes(),
    )?;
    link::wait_all_published(setup, &format!("{tag}/transport-barrier"), key)?;
    let parse = |raw: &[u8]| {
        let raw = String::from_utf8_lossy(raw).into_owned();
        let mut words = raw.split_whitespace();
        Published {
            transport: words.next().and_then(Transport::parse),
            pid: words.next().and_then(|p| p.parse().ok()).unwrap_or(0),
            host: words.next().unwrap_or_default().to_string(),
        }
    };
    let published = |peer: usize| -> Result<Published> { Ok(parse(&store.get(&key(peer))?)) };
    // Every rank's, in as few requests as the store allows (not one a peer: n² in all).
    let everyone = || -> Result<Vec<Published>> {
        let keys: Vec<String> = (0..n).map(key).collect();
        Ok(store.get_many(&keys)?.iter().map(|v| parse(v)).collect())
    };
    if store.add(&count_key, 0)? != n as i64 {
        for (peer, theirs) in everyone()?.into_iter().enumerate() {
            match theirs.transport {
                Some(theirs) if theirs == transport => {}
                theirs => {
                    return Err(DdpError::Config(ConfigError::TransportMismatch {
                        rank,
                        ours: transport,
                        peer: Rank(peer as u32),
                        theirs: theirs.unwrap_or(Transport::Auto),
                    }))
                }
            }
        }
    }
    if transport == Transport::Tcp {
        return Ok(None);
    }
    let refuse = refusal(rank, transport);
    let together = store.add(&host_key, 0)?;
    if together == n as i64 {
        let pid = |peer: usize| published(peer).map(|p| p.pid);
        return match one_host(setup, &pid)? {
            Ok(shm) => Ok(Some(Segment::Whole(shm))),
            Err(why) => refuse(why).map(|()| None),
        };
    }
    let hosts: Vec<String> = everyone()?.into_iter().map(|p| p.host).collect();
    let layout = Layout::of(&hosts, rank.index());
    let Some(layout) = layout.filter(|l| l.hosts() >= 2 && l.local.len() >= 2) else {
        return match hosts_share_nothing(&hosts) {
            // One rank per host: nothing to share, nothing to warn of.
            true if transport == Transport::Auto => Ok(None),
            _ => refuse(format!(
                "{together} of the group's {n} ranks run on this host ({}); shared memory needs \
                 them all on one host (same kernel, host name, network and process namespaces), \
                 or the same number, at least 2, on every host",
                crate::sys::node_name()
            ))
            .map(|()| None),
        };
    };
    match per_host(setup, &layout, &published)? {
        Ok(hierarchy) => Ok(Some(Segment::PerHost(hierarchy))),
        Err(why) => refuse(why).map(|()| None),
    }
}

/// What a rank published about itself.
struct Published {
    transport: Option<Transport>,
    pid: u32,
    /// Its host's identity (hashed).
    host: String,
}

/// What to do when shared memory cannot be used: fail under `shm`, warn under `auto` (the group
/// then goes over TCP).
fn refusal(rank: Rank, transport: Transport) -> impl Fn(String) -> Result<()> {
    move |reason: String| match transport {
        Transport::Shm => Err(DdpError::Config(ConfigError::SharedMemory { rank, reason })),
        _ => {
            tracing::warn!("[rank {rank}] collectives go over TCP: {reason}");
            Ok(())
        }
    }
}

/// Whether no two of `hosts` are the same.
fn hosts_share_nothing(hosts: &[String]) -> bool {
    let mut sorted: Vec<&String> = hosts.iter().collect();
    sorted.sort();
    sorted.windows(2).all(|w| w[0] != w[1])
}

/// The segment of a group whose ranks all run on one host: steps 2 to 4. `pid(place)` is what that place published as its process id.
/// `Ok(Err(why))` when some rank could not attach it (every rank gets the same answer).
fn one_host(
    setup: &LinkSetup<'_>,
    pid: &impl Fn(usize) -> Result<u32>,
) -> Result<std::result::Result<Shm, String>> {
    let LinkSetup {
        store,
        rank,
        world,
        tag,
        ..
    } = *setup;
    let n = world.as_usize();
    let seg_key = format!("{tag}/shm-segment");
    let fail_key = format!("{tag}/shm-failed");
    let chunk = chunk_for(n);
    let len = segment_len(n, chunk);
    let attached: std::result::Result<Shm, String> = if rank.index() == 0 {
        match create(len, n, chunk) {
            Err(why) => {
                store.set(&seg_key, format!("error {why}").as_bytes())?;
                Err(why)
            }
            Ok((fd, map, listener, name)) => {
                store.set(&seg_key, format!("ok {name}").as_bytes())?;
                serve(setup, &listener, fd.as_fd(), pid, &fail_key)
                    .map(|()| Shm::new((map, fd), 0, n, chunk))
            }
        }
    } else {
        wait_published(setup, std::slice::from_ref(&seg_key))?;
        let raw = String::from_utf8_lossy(&store.get(&seg_key)?).into_owned();
        match raw.split_once(' ') {
            Some(("ok", name)) => attach(setup, name)
                .map(|(map, world, chunk)| Shm::new(map, rank.index(), world, chunk)),
            Some((_, why)) => Err(format!("rank 0 could not create it: {why}")),
            None => Err("rank 0 published no segment".into()),
        }
        .and_then(|shm| match shm.world == n {
            true => Ok(shm),
            false => Err(format!(
                "rank 0's segment is for {} ranks, not {n}",
                shm.world
            )),
        })
    };
    if let Err(why) = &attached {
        store.add(&fail_key, 1)?;
        tracing::debug!("[rank {rank}] could not attach the shared segment: {why}");
    }
    let why = agree(
        setup,
        "shm-attached",
        attached.as_ref().err().map(String::as_str),
    )?;
    Ok(match why {
        None => attached,
        Some((r, why)) => Err(format!("rank {r} could not attach the segment: {why}")),
    })
}

/// Every rank of `setup`'s group says whether its step `what` succeeded (`failed`: why not) and
/// learns whether all did: `None`, or the first rank that failed and why.
fn agree(
    setup: &LinkSetup<'_>,
    what: &str,
    failed: Option<&str>,
) -> Result<Option<(usize, String)>> {
    let LinkSetup {
        store,
        rank,
        world,
        tag,
        ..
    } = *setup;
    let n = world.as_usize();
    let done_key = |r: usize| format!("{tag}/{what}/{r}");
    let ok_key = format!("{tag}/{what}-ok");
    match failed {
        None => {
            store.add(&ok_key, 1)?;
            store.set(&done_key(rank.index()), b"ok")?;
        }
        Some(why) => store.set(&done_key(rank.index()), why.as_bytes())?,
    }
    let done: Vec<String> = (0..n).map(done_key).collect();
    wait_published(setup, &done)?;
    if store.add(&ok_key, 0)? == n as i64 {
        return Ok(None);
    }
    for (r, key) in done.iter().enumerate() {
        let said = store.get(key)?;
        if said != b"ok" {
            return Ok(Some((r, String::from_utf8_lossy(&said).into_owned())));
        }
    }
    Ok(Some((0, "a rank did not say".into())))
}

/// Where the ranks of a group spread over hosts are: by host (in the order of each host's first
/// place), the places on it in order.
#[derive(Debug)]
struct Layout {
    by_host: Vec<Vec<usize>>,
    /// This rank's host.
    host: usize,
    /// The places on this rank's host.
    local: Vec<usize>,
}

impl Layout {
    /// The layout of places whose hosts are `hosts`, seen from `place`; `None` unless every
    /// host has as many ranks.
    fn of(hosts: &[String], place: usize) -> Option<Self> {
        let mut names: Vec<&str> = Vec::new();
        let mut by_host: Vec<Vec<usize>> = Vec::new();
        for (p, h) in hosts.iter().enumerate() {
            match names.iter().position(|n| n == h) {
                Some(i) => by_host[i].push(p),
                None => {
                    names.push(h);
                    by_host.push(vec![p]);
                }
            }
        }
        let host = names.iter().position(|n| *n == hosts[place])?;
        let per = by_host[0].len();
        if by_host.iter().any(|h| h.len() != per) {
            return None;
        }
        let local = by_host[host].clone();
        Some(Self {
            by_host,
            host,
            local,
        })
    }

    fn hosts(&self) -> usize {
        self.by_host.len()
    }
}

/// The shared segment of this rank's host and its ring across hosts (see
/// [`Hierarchy`]); `Ok(Err(why))` when some rank of the group could not attach its host's
/// segment (every rank of the group gets the same answer).
fn per_host(
    setup: &LinkSetup<'_>,
    layout: &Layout,
    published: &impl Fn(usize) -> Result<Published>,
) -> Result<std::result::Result<Hierarchy, String>> {
    let me = setup.rank.index();
    let index = layout.local.iter().position(|&p| p == me).unwrap_or(0);
    let across: Vec<usize> = layout.by_host.iter().map(|h| h[index]).collect();
    let (Some(per_host), Some(hosts)) = (
        WorldSize::new(layout.local.len() as u32),
        WorldSize::new(across.len() as u32),
    ) else {
        return Ok(Err("a host without ranks".into()));
    };
    let host_tag = format!("{}/host{}", setup.tag, layout.host);
    let host_setup = LinkSetup {
        rank: Rank(index as u32),
        world: per_host,
        tag: &host_tag,
        ..setup.clone()
    };
    let pid = |q: usize| published(layout.local[q]).map(|p| p.pid);
    let attached = one_host(&host_setup, &pid)?;
    let why = attached.as_ref().err().map(String::as_str);
    if let Some((r, why)) = agree(setup, "host-shm-attached", why)? {
        return Ok(Err(format!(
            "rank {r} could not attach its host's segment: {why}"
        )));
    }
    let shm = match attached {
        Ok(shm) => shm,
        Err(why) => return Ok(Err(why)),
    };
    // One ring per local index, through the ranks of that index on every host.
    let cross_tag = format!("{}/across{index}", setup.tag);
    let cross = link::open_ring(&LinkSetup {
        rank: Rank(layout.host as u32),
        world: hosts,
        tag: &cross_tag,
        ..setup.clone()
    })?;
    Ok(Ok(Hierarchy {
        shm,
        cross,
        local: layout.local.clone(),
        across,
        host: layout.host,
    }))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

type Created = (std::os::fd::OwnedFd, Mapping, UnixListener, String);

/// Place 0's segment of `len` bytes for `world` ranks, and the socket that hands it over.
fn create(len: usize, world: usize, chunk: usize) -> std::result::Result<Created, String> {
    let name = CString::new("burn-ddp").unwrap_or_default();
    let fd = shared::memory_file(&name, len).map_err(|e| match e.raw_os_error() {
        Some(libc::ENOSPC | libc::ENOMEM) => format!(
            "the host could not reserve {} MiB of shared memory for {world} ranks ({e}); free \
             memory, or raise the memory limit of the job's container or cgroup",
            len >> 20
        ),
        Some(libc::ENOSYS | libc::EPERM) => format!(
            "memfd_create is not available here ({e}): a kernel before 3.17, or a seccomp \
             profile that forbids it (allow memfd_create in the container's profile)"
        ),
        _ => format!("memfd_create of {} MiB failed: {e}", len >> 20),
    })?;
    let map = Mapping::map(fd.as_fd(), len)
        .map_err(|e| format!("mapping {} MiB failed: {e}", len >> 20))?;
    Shm::init(&map, world, chunk);
    let name = format!("burn-ddp-{}", hex(&rand::random::<[u8; 16]>()));
    let listener = SocketAddr::from_abstract_name(name.as_bytes())
        .and_then(|a| UnixListener::bind_addr(&a))
        .map_err(|e| format!("an abstract Unix socket could not be bound: {e}"))?;
    Ok((fd, map, listener, name))
}

/// Hands `fd` to each other rank of the group that connects to `listener` and proves to be it;
/// stops early when one reports that it failed.
fn serve(
    setup: &LinkSetup<'_>,
    listener: &UnixListener,
    fd: std::os::fd::BorrowedFd<'_>,
    pid: &impl Fn(usize) -> Result<u32>,
    fail_key: &str,
) -> std::result::Result<(), String> {
    let n = setup.world.as_usize();
    let mut served = vec![false; n];
    served[0] = true;
    listener
        .set_nonblocking(true)
        .map_err(|e| format!("socket: {e}"))?;
    let mut last_look = Instant::now();
    while served.iter().any(|s| !s) {
        match listener.accept() {
            Ok((sock, _)) => {
                let place = match hello(&sock, n, pid) {
                    Ok(place) if !served[place] => place,
                    Ok(place) => {
                        tracing::warn!("[rank 0] refused the segment to a second rank {place}");
                        continue;
                    }
                    Err(why) => {
                        tracing::warn!("[rank 0] refused the shared-memory segment: {why}");
                        continue;
                    }
                };
                shared::send_fd(&sock, fd)
                    .map_err(|e| format!("handing it to rank {place}: {e}"))?;
                served[place] = true;
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                if Instant::now() >= setup.deadline {
                    let missing: Vec<String> = (0..n)
                        .filter(|&r| !served[r])
                        .map(|r| r.to_string())
                        .collect();
                    return Err(format!(
                        "ranks {} never came for it before the rendezvous deadline",
                        missing.join(", ")
                    ));
                }
                if last_look.elapsed() >= Duration::from_millis(50) {
                    last_look = Instant::now();
                    if setup.store.add(fail_key, 0).unwrap_or(0) > 0 {
                        return Err("another rank failed to attach it".into());
                    }
                }
                std::thread::sleep(Duration::from_millis(2));
            }
            Err(e) => return Err(format!("accepting: {e}")),
        }
    }
    Ok(())
}

/// Reads which place a connected process claims to be, and checks the claim: the kernel's
/// record of its user and process id must be this user and the id that place published.
fn hello(
    sock: &UnixStream,
    world: usize,
    pid: &impl Fn(usize) -> Result<u32>,
) -> std::result::Result<usize, String> {
    sock.set_nonblocking(false).map_err(|e| e.to_string())?;
    sock.set_read_timeout(Some(HELLO))
        .map_err(|e| e.to_string())?;
    let mut claim = [0u8; 4];
    (&*sock)
        .read_exact(&mut claim)
        .map_err(|e| format!("no rank said: {e}"))?;
    let place = u32::from_le_bytes(claim) as usize;
    if place == 0 || place >= world {
        return Err(format!(
            "a process claimed rank {place} of a group of {world}"
        ));
    }
    let (theirs, uid) = shared::peer(sock).map_err(|e| e.to_string())?;
    let expected = pid(place).map_err(|e| e.to_string())?;
    if uid != shared::user() || theirs == 0 || theirs != expected {
        return Err(format!(
            "a process (pid {theirs}, uid {uid}) claimed rank {place}, whose pid is {expected}"
        ));
    }
    Ok(place)
}

/// Connects to place 0's socket `name`, says this rank's place, and maps the segment it is
/// handed: the mapping with its memory file, and the world and chunk it was laid out for.
fn attach(
    setup: &LinkSetup<'_>,
    name: &str,
) -> std::result::Result<((Mapping, std::os::fd::OwnedFd), usize, usize), String> {
    use std::io::Write;
    let addr = SocketAddr::from_abstract_name(name.as_bytes()).map_err(|e| e.to_string())?;
    let sock = UnixStream::connect_addr(&addr).map_err(|e| {
        format!("rank 0's socket is out of reach ({e}): not the same network namespace?")
    })?;
    let left = setup.deadline.saturating_duration_since(Instant::now());
    sock.set_read_timeout(Some(left.max(Duration::from_millis(1))))
        .map_err(|e| e.to_string())?;
    (&sock)
        .write_all(&(setup.rank.0).to_le_bytes())
        .map_err(|e| format!("saying which rank this is: {e}"))?;
    let fd = shared::recv_fd(&sock).map_err(|e| format!("receiving it: {e}"))?;
    let len = shared::file_len(fd.as_fd()).map_err(|e| e.to_string())?;
    let map = Mapping::map(fd.as_fd(), len).map_err(|e| format!("mapping it: {e}"))?;
    let (world, chunk) =
        Shm::read_header(&map).ok_or_else(|| "it is not a segment of this version".to_string())?;
    Ok(((map, fd), world, chunk))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hosts(names: &str) -> Vec<String> {
        names.chars().map(String::from).collect()
    }

    #[test]
    fn hosts_are_ordered_by_their_first_rank_and_ranks_by_their_place() {
        let l = Layout::of(&hosts("abab"), 3).unwrap();
        assert_eq!(l.by_host, vec![vec![0, 2], vec![1, 3]]);
        assert_eq!((l.host, l.local.as_slice()), (1, &[1, 3][..]));
        let l = Layout::of(&hosts("bbaacc"), 2).unwrap();
        assert_eq!(l.by_host, vec![vec![0, 1], vec![2, 3], vec![4, 5]]);
        assert_eq!((l.host, l.local.as_slice(), l.hosts()), (1, &[2, 3][..], 3));
    }

    #[test]
    fn hosts_of_unequal_ranks_have_no_layout() {
        assert!(Layout::of(&hosts("aab"), 0).is_none());
        assert!(Layout::of(&hosts("abbb"), 0).is_none());
        // One rank per host is a layout, of nothing to share.
        assert_eq!(Layout::of(&hosts("abc"), 1).unwrap().local, vec![1]);
        assert!(hosts_share_nothing(&hosts("abc")));
        assert!(!hosts_share_nothing(&hosts("abca")));
    }
}
