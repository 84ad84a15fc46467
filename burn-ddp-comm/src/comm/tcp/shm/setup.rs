//! Whether a group moves its collectives through shared memory, and handing the segment to
//! every rank.
//!
//! 1. Every rank counts itself under its transport choice and under its host's identity
//!    (`sys::shared::host_identity`), and publishes its choice and process id. A choice that
//!    differs is a `TransportMismatch` on every rank; a group not all on one host uses TCP (or
//!    fails, when `shm` was asked for).
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

use super::{chunk_for, segment_len, Shm};
use crate::comm::tcp::link::{wait_published, LinkSetup};
use crate::config::Transport;
use crate::error::ConfigError;
use crate::sys::shared::{self, Mapping};
use crate::types::Rank;
use crate::{DdpError, Result};

/// How long place 0 waits for a connected rank to say which it is.
const HELLO: Duration = Duration::from_secs(10);

/// The group's segment, when it uses one: every rank's `transport` must be the same; `Auto`
/// uses shared memory when the whole group is on one host and it can be set up, `Shm` insists.
///
/// # Errors
/// `TransportMismatch`; `SharedMemory` (for `Shm`) naming what failed; store and rendezvous
/// errors as when opening links.
pub(crate) fn open(setup: &LinkSetup<'_>, transport: Transport) -> Result<Option<Shm>> {
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
        format!("{transport} {}", std::process::id()).as_bytes(),
    )?;
    let keys: Vec<String> = (0..n).map(key).collect();
    wait_published(setup, &keys)?;
    let published = |peer: usize| -> Result<(Option<Transport>, u32)> {
        let raw = String::from_utf8_lossy(&store.get(&keys[peer])?).into_owned();
        let (choice, pid) = raw.split_once(' ').unwrap_or((raw.as_str(), ""));
        Ok((Transport::parse(choice), pid.parse().unwrap_or(0)))
    };
    if store.add(&count_key, 0)? != n as i64 {
        for peer in 0..n {
            match published(peer)?.0 {
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
    let refuse = |reason: String| -> Result<Option<Shm>> {
        match transport {
            Transport::Shm => Err(DdpError::Config(ConfigError::SharedMemory { rank, reason })),
            _ => {
                tracing::warn!("[rank {rank}] collectives go over TCP: {reason}");
                Ok(None)
            }
        }
    };
    if transport == Transport::Tcp {
        return Ok(None);
    }
    let together = store.add(&host_key, 0)?;
    if together != n as i64 {
        return refuse(format!(
            "{together} of the group's {n} ranks run on this host ({}); shared memory needs \
             them all on one (same kernel, host name, network and process namespaces)",
            crate::sys::node_name()
        ));
    }

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
                serve(setup, &listener, fd.as_fd(), &published, &fail_key)
                    .map(|()| Shm::new(map, 0, n, chunk))
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
    // Everyone says whether it attached; only when all did is the segment used.
    let done_key = |r: usize| format!("{tag}/shm-attached/{r}");
    let ok_key = format!("{tag}/shm-ok");
    match &attached {
        Ok(_) => {
            store.add(&ok_key, 1)?;
            store.set(&done_key(rank.index()), b"ok")?;
        }
        Err(why) => {
            store.add(&fail_key, 1)?;
            store.set(&done_key(rank.index()), why.as_bytes())?;
        }
    }
    let done: Vec<String> = (0..n).map(done_key).collect();
    wait_published(setup, &done)?;
    if store.add(&ok_key, 0)? == n as i64 {
        return Ok(attached.ok());
    }
    for (r, key) in done.iter().enumerate() {
        let said = store.get(key)?;
        if said != b"ok" {
            let why = String::from_utf8_lossy(&said).into_owned();
            return refuse(format!("rank {r} could not attach the segment: {why}"));
        }
    }
    refuse("a rank could not attach the segment".into())
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
    published: &impl Fn(usize) -> Result<(Option<Transport>, u32)>,
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
                let place = match hello(&sock, published) {
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
    published: &impl Fn(usize) -> Result<(Option<Transport>, u32)>,
) -> std::result::Result<usize, String> {
    sock.set_nonblocking(false).map_err(|e| e.to_string())?;
    sock.set_read_timeout(Some(HELLO))
        .map_err(|e| e.to_string())?;
    let mut claim = [0u8; 4];
    (&*sock)
        .read_exact(&mut claim)
        .map_err(|e| format!("no rank said: {e}"))?;
    let place = u32::from_le_bytes(claim) as usize;
    let (pid, uid) = shared::peer(sock).map_err(|e| e.to_string())?;
    let (_, expected) = published(place).map_err(|e| e.to_string())?;
    if uid != shared::user() || pid == 0 || pid != expected {
        return Err(format!(
            "a process (pid {pid}, uid {uid}) claimed rank {place}, whose pid is {expected}"
        ));
    }
    Ok(place)
}

/// Connects to place 0's socket `name`, says this rank's place, and maps the segment it is
/// handed: the mapping, and the world and chunk it was laid out for.
fn attach(
    setup: &LinkSetup<'_>,
    name: &str,
) -> std::result::Result<(Mapping, usize, usize), String> {
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
    Ok((map, world, chunk))
}
