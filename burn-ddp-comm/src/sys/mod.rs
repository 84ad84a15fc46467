//! The few system calls this crate makes beyond `std`, as safe functions over `libc` (Linux):
//! readiness waits, non-blocking socket reads and writes, the host name, signals to a child,
//! the parent-death signal and huge-page advice.
//!
//! `libc` and not a higher-level wrapper such as rustix: a user's Burn already builds `libc`
//! with the features used here, while rustix is in Burn's tree with other features (through
//! `tempfile` and `crossterm`), so asking for more of them would rebuild it and every Burn crate
//! above it the first time a Burn project adds burn-ddp (CI checks the feature sets,
//! `scripts/feature-check.sh`).

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::time::Duration;

pub(crate) mod shared;

/// What a [`poll_set`] waits for on one descriptor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Ready {
    /// Bytes to read (or a connection to accept, or the peer's end).
    pub(crate) read: bool,
    /// Room to write.
    pub(crate) write: bool,
}

/// Most descriptors [`poll_set`] waits on.
pub(crate) const POLL_SET_MAX: usize = 64;

/// Waits until one of `fds` (up to [`POLL_SET_MAX`]; those after are not waited on) is ready
/// for what it asks, or an error or hang-up is pending on it, for at most `timeout` (to the
/// nanosecond); returns which are, as a bit per entry. An interrupted wait returns early, as a
/// ready one does (no bit set): callers look at their sockets again either way.
///
/// # Errors
/// `ppoll` failed for another reason than an interruption.
pub(crate) fn poll_set(fds: &[(BorrowedFd<'_>, Ready)], timeout: Duration) -> io::Result<u64> {
    let n = fds.len().min(POLL_SET_MAX);
    let mut raw = [libc::pollfd {
        fd: -1,
        events: 0,
        revents: 0,
    }; POLL_SET_MAX];
    for (slot, (fd, ready)) in raw.iter_mut().zip(&fds[..n]) {
        slot.fd = fd.as_raw_fd();
        slot.events =
            if ready.read { libc::POLLIN } else { 0 } | if ready.write { libc::POLLOUT } else { 0 };
    }
    let ts = libc::timespec {
        tv_sec: libc::time_t::try_from(timeout.as_secs()).unwrap_or(libc::time_t::MAX),
        // Below 1e9: fits every c_long.
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: `raw` holds `n` initialised `pollfd`s whose descriptors are open (borrowed for the
    // call) and lives across it; `ts` is a valid timespec; a null signal mask leaves the
    // thread's as it is. The kernel writes only the `revents` fields of the first `n`.
    let got = unsafe { libc::ppoll(raw.as_mut_ptr(), n as libc::nfds_t, &ts, std::ptr::null()) };
    match got {
        0.. => Ok(raw[..n]
            .iter()
            .enumerate()
            .filter(|(_, p)| p.revents != 0)
            .fold(0u64, |mask, (i, _)| mask | 1 << i)),
        _ => match io::Error::last_os_error() {
            e if e.kind() == io::ErrorKind::Interrupted => Ok(0),
            e => Err(e),
        },
    }
}

/// Lets a socket bound to an address with port 0 take its port only when it connects
/// (`IP_BIND_ADDRESS_NO_PORT`), as a socket that connects unbound does: the port may then be
/// one that other connections to other peers use too, and the bind does not search the
/// machine's ports for one no socket holds.
///
/// # Errors
/// The option is not known (a kernel before 4.2): the bind then picks a port itself.
pub(crate) fn port_at_connect(fd: BorrowedFd<'_>) -> io::Result<()> {
    let on: libc::c_int = 1;
    // SAFETY: `fd` is an open socket; `on` is a valid `c_int` for the call and its size is
    // passed.
    let r = unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            libc::IPPROTO_IP,
            libc::IP_BIND_ADDRESS_NO_PORT,
            std::ptr::from_ref(&on).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// A flag that wakes the thread asleep in [`poll_set`] on its [`fd`](Self::fd) when it is
/// raised: a thread that waits for a socket and for a word from another thread sleeps until
/// either comes, instead of waking now and then to look at the flag.
#[derive(Debug)]
pub(crate) struct Alarm {
    raised: std::sync::Arc<std::sync::atomic::AtomicBool>,
    /// Shut down when raised, which makes `woken` readable (its end of the pair closed).
    wake: std::os::unix::net::UnixStream,
    woken: std::os::unix::net::UnixStream,
}

impl Alarm {
    /// A flag not raised yet.
    ///
    /// # Errors
    /// The socket pair could not be made (out of descriptors).
    pub(crate) fn new() -> io::Result<Self> {
        let (wake, woken) = std::os::unix::net::UnixStream::pair()?;
        Ok(Self {
            raised: std::sync::Arc::default(),
            wake,
            woken,
        })
    }

    /// Raises the flag and wakes its waiter (for good: a raised alarm stays raised).
    pub(crate) fn raise(&self) {
        self.raised.store(true, std::sync::atomic::Ordering::SeqCst);
        let _ = self.wake.shutdown(std::net::Shutdown::Both);
    }

    /// Whether it was raised.
    pub(crate) fn is_raised(&self) -> bool {
        self.raised.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// The flag alone, for a thread that looks at it between reads without sleeping on the
    /// alarm.
    pub(crate) fn flag(&self) -> std::sync::Arc<std::sync::atomic::AtomicBool> {
        std::sync::Arc::clone(&self.raised)
    }

    /// What to wait on, for reading, beside the sockets: ready once raised.
    pub(crate) fn fd(&self) -> BorrowedFd<'_> {
        std::os::fd::AsFd::as_fd(&self.woken)
    }
}

/// Copies what `fd` has now into `buf` without taking it off the socket (0: the peer closed).
///
/// # Errors
/// The socket's error: `WouldBlock` when nothing is there, `Interrupted`, a reset.
pub(crate) fn peek(fd: BorrowedFd<'_>, buf: &mut [u8]) -> io::Result<usize> {
    // SAFETY: `buf` is valid for writes of `buf.len()` bytes for the call (the kernel writes at
    // most that many); `fd` is open.
    let n = unsafe {
        libc::recv(
            fd.as_raw_fd(),
            buf.as_mut_ptr().cast(),
            buf.len(),
            libc::MSG_PEEK | libc::MSG_DONTWAIT,
        )
    };
    usize::try_from(n).map_err(|_| io::Error::last_os_error())
}

/// What a socket shows now, seen without taking anything off it.
#[derive(Debug)]
pub(crate) enum Peeked {
    /// Nothing to read.
    Quiet,
    /// Bytes to read.
    Bytes,
    /// The peer's end: it closed the connection (or its process exited).
    Closed,
    /// The socket's error (a reset).
    Failed(io::Error),
}

/// Looks at `fd` without waiting and without taking its bytes ([`peek`]).
pub(crate) fn peek_state(fd: BorrowedFd<'_>) -> Peeked {
    match peek(fd, &mut [0u8]) {
        Ok(0) => Peeked::Closed,
        Ok(_) => Peeked::Bytes,
        Err(e)
            if matches!(
                e.kind(),
                io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
            ) =>
        {
            Peeked::Quiet
        }
        Err(e) => Peeked::Failed(e),
    }
}

/// Writes what `fd` takes of `buf` now, without raising SIGPIPE on a closed connection.
///
/// # Errors
/// The socket's error: `WouldBlock` when it has no room, `Interrupted`, `BrokenPipe` when the
/// peer closed.
pub(crate) fn send(fd: BorrowedFd<'_>, buf: &[u8]) -> io::Result<usize> {
    // SAFETY: `buf` is valid for reads of `buf.len()` bytes for the call; `fd` is open.
    let n = unsafe {
        libc::send(
            fd.as_raw_fd(),
            buf.as_ptr().cast(),
            buf.len(),
            libc::MSG_NOSIGNAL,
        )
    };
    usize::try_from(n).map_err(|_| io::Error::last_os_error())
}

/// Reads what `fd` has now into `buf` (0: the peer closed).
///
/// # Errors
/// The socket's error: `WouldBlock` when nothing is there, `Interrupted`, a reset.
pub(crate) fn recv(fd: BorrowedFd<'_>, buf: &mut [u8]) -> io::Result<usize> {
    // SAFETY: `buf` is valid for writes of `buf.len()` bytes for the call (the kernel writes at
    // most that many); `fd` is open.
    let n = unsafe { libc::recv(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
    usize::try_from(n).map_err(|_| io::Error::last_os_error())
}

/// This machine's host name (`uname`'s node name); empty if the kernel does not say.
pub(crate) fn node_name() -> String {
    // SAFETY: `utsname` is plain old data (arrays of `c_char`), for which all zeroes is valid.
    let mut name: libc::utsname = unsafe { std::mem::zeroed() };
    // SAFETY: `name` is a valid, writable `utsname` for the call.
    if unsafe { libc::uname(&mut name) } != 0 {
        return String::new();
    }
    let bytes: Vec<u8> = name
        .nodename
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// The kernel's cap on a listening socket's queue of connections not accepted yet
/// (`net.core.somaxconn`; Linux), `None` where it cannot be read.
pub(crate) fn listen_queue_cap() -> Option<u32> {
    std::fs::read_to_string("/proc/sys/net/core/somaxconn")
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// Raises this process's open-file limit (`RLIMIT_NOFILE`) to at least `want`, the hard limit
/// too where the process may (a privileged one). The limits afterwards: `(soft, hard)`
/// (`u64::MAX` for unlimited).
#[allow(clippy::unnecessary_cast)] // `rlim_t` is `u64` on Linux, not on every Unix
pub(crate) fn raise_open_files(want: u64) -> io::Result<(u64, u64)> {
    let mut now = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `now` is a valid, writable `rlimit` for the call.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut now) } != 0 {
        return Err(io::Error::last_os_error());
    }
    let want = libc::rlim_t::try_from(want).unwrap_or(libc::RLIM_INFINITY);
    if now.rlim_cur == libc::RLIM_INFINITY || now.rlim_cur >= want {
        return Ok((now.rlim_cur as u64, now.rlim_max as u64));
    }
    for next in [
        libc::rlimit {
            rlim_cur: want,
            rlim_max: now.rlim_max.max(want),
        },
        libc::rlimit {
            rlim_cur: now.rlim_max.min(want),
            rlim_max: now.rlim_max,
        },
    ] {
        // SAFETY: `next` is a valid `rlimit`; the call only reads it.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &next) } == 0 {
            return Ok((next.rlim_cur as u64, next.rlim_max as u64));
        }
    }
    Ok((now.rlim_cur as u64, now.rlim_max as u64))
}

/// A signal the launcher sends to its ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Signal {
    /// SIGTERM: end cleanly.
    Term,
    /// SIGCONT: wake a stopped process (so that it can take a SIGTERM).
    Cont,
}

/// Sends `signal` to the process `pid` (a child of this process); nothing for a pid that
/// cannot be one (0 or beyond `i32`, which `kill` would read as a process group). A process
/// that already ended is no error worth reporting: the caller is ending it anyway.
pub(crate) fn signal(pid: u32, signal: Signal) {
    let Ok(pid) = libc::pid_t::try_from(pid) else {
        return;
    };
    if pid <= 0 {
        return;
    }
    let sig = match signal {
        Signal::Term => libc::SIGTERM,
        Signal::Cont => libc::SIGCONT,
    };
    // SAFETY: `kill` takes plain integers; `pid` names one process (positive), not a group.
    unsafe {
        libc::kill(pid, sig);
    }
}

/// Asks the kernel to SIGKILL this process when its parent (the thread that forked it) dies.
/// Async-signal-safe: made between `fork` and `exec`.
///
/// # Errors
/// `prctl` refused.
pub(crate) fn die_with_parent() -> io::Result<()> {
    // SAFETY: PR_SET_PDEATHSIG takes the signal number as its one argument; the others are
    // ignored and passed as zero. No memory is read or written.
    let r = unsafe {
        libc::prctl(
            libc::PR_SET_PDEATHSIG,
            libc::SIGKILL as libc::c_ulong,
            0 as libc::c_ulong,
            0 as libc::c_ulong,
            0 as libc::c_ulong,
        )
    };
    match r {
        0 => Ok(()),
        _ => Err(io::Error::last_os_error()),
    }
}

/// Advises the kernel to back `[start, start + len)` with transparent huge pages.
///
/// # Safety
/// The range must lie inside one allocation of the caller's (page-aligned, as `madvise`
/// requires, else it fails with `EINVAL`). The advice changes only how the kernel backs the
/// pages, never their contents or validity, so no Rust invariant depends on it.
///
/// # Errors
/// The kernel declined (huge pages off, an unaligned range).
pub(crate) unsafe fn advise_huge_pages(start: *mut u8, len: usize) -> io::Result<()> {
    // SAFETY: the caller's contract: the range is its own allocation's; MADV_HUGEPAGE does not
    // change the memory's contents.
    match unsafe { libc::madvise(start.cast(), len, libc::MADV_HUGEPAGE) } {
        0 => Ok(()),
        _ => Err(io::Error::last_os_error()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{TcpListener, TcpStream};
    use std::os::fd::AsFd;
    use std::time::Instant;

    fn pair() -> (TcpStream, TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let a = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (b, _) = listener.accept().unwrap();
        a.set_nonblocking(true).unwrap();
        b.set_nonblocking(true).unwrap();
        (a, b)
    }

    const READ: Ready = Ready {
        read: true,
        write: false,
    };

    #[test]
    fn bytes_sent_are_received_and_an_empty_socket_would_block() {
        let (a, b) = pair();
        let mut buf = [0u8; 8];
        let e = recv(b.as_fd(), &mut buf).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::WouldBlock);
        assert_eq!(send(a.as_fd(), b"hello").unwrap(), 5);
        poll_set(&[(b.as_fd(), READ)], Duration::from_secs(5)).unwrap();
        assert_eq!(recv(b.as_fd(), &mut buf).unwrap(), 5);
        assert_eq!(&buf[..5], b"hello");
        drop(a);
        poll_set(&[(b.as_fd(), READ)], Duration::from_secs(5)).unwrap();
        assert_eq!(
            recv(b.as_fd(), &mut buf).unwrap(),
            0,
            "the peer's end reads as 0"
        );
    }

    #[test]
    fn a_send_to_a_closed_peer_fails() {
        let (a, b) = pair();
        drop(b);
        // The first write may still be taken; a later one sees the reset or the closed pipe.
        let failed = (0..100).any(|_| {
            std::thread::sleep(Duration::from_millis(5));
            send(a.as_fd(), &[0u8; 1024]).is_err()
        });
        assert!(failed, "writes to a closed peer kept succeeding");
    }

    #[test]
    fn poll_waits_at_most_its_timeout() {
        let (_a, b) = pair();
        let started = Instant::now();
        poll_set(&[(b.as_fd(), READ)], Duration::from_millis(50)).unwrap();
        assert!(started.elapsed() >= Duration::from_millis(40));
    }

    #[test]
    fn the_node_name_is_the_kernels() {
        let name = node_name();
        let kernel = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap();
        assert_eq!(name, kernel.trim());
    }

    #[test]
    fn a_signal_to_a_pid_that_is_no_process_is_ignored() {
        // 0 and values beyond i32 would name process groups: never sent.
        signal(0, Signal::Cont);
        signal(u32::MAX, Signal::Term);
    }
}
