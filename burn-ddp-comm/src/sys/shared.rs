//! Shared memory between the processes of one host: an anonymous memory file (`memfd_create`)
//! mapped by every process, handed from one to another as a descriptor over a Unix socket
//! (`SCM_RIGHTS`), futex waits on words inside it, and what tells two processes that they can
//! share it (the same kernel, host name and namespaces).
//!
//! Nothing here has a name in a file system: the memory lives while a process maps it or holds
//! the descriptor, and the kernel frees it when the last one exits, however it exits.

use std::ffi::CStr;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::ptr::NonNull;
use std::sync::atomic::AtomicU32;
use std::time::Duration;

/// Creates an anonymous memory file of `len` bytes with its memory reserved up front
/// (`fallocate`), so that a host short of memory fails here with `ENOSPC`/`ENOMEM` instead of
/// killing a process with `SIGBUS` at its first touch of a page.
///
/// # Errors
/// `memfd_create` is missing (kernels before 3.17, a seccomp filter) or the memory could not be
/// reserved.
pub(crate) fn memory_file(name: &CStr, len: usize) -> io::Result<OwnedFd> {
    // SAFETY: `name` is a valid NUL-terminated string for the call; the flags are valid.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just returned open by the kernel and is owned by nothing else.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    fallocate(fd.as_fd(), 0, 0, len)?;
    Ok(fd)
}

/// `fallocate(2)` of bytes `offset..offset + len` of `fd` with `mode`.
///
/// # Errors
/// An offset or length beyond `off_t`, or the kernel refused.
fn fallocate(fd: BorrowedFd<'_>, mode: libc::c_int, offset: usize, len: usize) -> io::Result<()> {
    let (Ok(start), Ok(size)) = (libc::off_t::try_from(offset), libc::off_t::try_from(len)) else {
        return Err(io::ErrorKind::InvalidInput.into());
    };
    // SAFETY: `fd` is open; `fallocate` reads no memory of ours.
    if unsafe { libc::fallocate(fd.as_raw_fd(), mode, start, size) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// The size of a page of memory.
pub(crate) fn page_size() -> usize {
    // SAFETY: sysconf reads no memory of ours.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(p).ok().filter(|&p| p > 0).unwrap_or(4096)
}

/// Extends the memory file `fd` by `len` bytes from its size rounded up to a page, reserved up
/// front as [`memory_file`] does: the offset at which the new bytes start.
///
/// # Errors
/// The memory could not be reserved (`ENOSPC`, `ENOMEM`), or `fstat` failed.
pub(crate) fn grow(fd: BorrowedFd<'_>, len: usize) -> io::Result<usize> {
    let at = file_len(fd)?.next_multiple_of(page_size());
    fallocate(fd, 0, at, len)?;
    Ok(at)
}

/// Gives the memory of bytes `offset..offset + len` of the memory file `fd` back to the system
/// (they read as zeros after), keeping the file's size.
///
/// # Errors
/// `fallocate` refused.
pub(crate) fn punch(fd: BorrowedFd<'_>, offset: usize, len: usize) -> io::Result<()> {
    let mode = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
    fallocate(fd, mode, offset, len)
}

/// The size of the file `fd`.
///
/// # Errors
/// `fstat` failed.
pub(crate) fn file_len(fd: BorrowedFd<'_>) -> io::Result<usize> {
    // SAFETY: `stat` is plain old data, for which all zeroes is valid.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: `fd` is open and `st` writable for the call.
    if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
        return Err(io::Error::last_os_error());
    }
    usize::try_from(st.st_size).map_err(|_| io::Error::from(io::ErrorKind::InvalidData))
}

/// A shared, writable mapping of a whole memory file, unmapped on drop.
#[derive(Debug)]
pub(crate) struct Mapping {
    base: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is plain memory; every access to it goes through raw pointers whose users
// uphold the sharing rules of the protocol on top (see `comm/tcp/shm`).
unsafe impl Send for Mapping {}
// SAFETY: as for `Send`: `&Mapping` only hands out raw pointers.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Maps all `len` bytes of `fd`, shared with every other process that maps it.
    ///
    /// # Errors
    /// `mmap` refused (no address space, a file shorter than `len` is not refused but faults).
    pub(crate) fn map(fd: BorrowedFd<'_>, len: usize) -> io::Result<Self> {
        Self::map_at(fd, 0, len)
    }

    /// Maps `len` bytes of `fd` from `offset` (a multiple of the page size), shared with every
    /// other process that maps them.
    ///
    /// # Errors
    /// As [`Mapping::map`]; an offset that is no multiple of the page size.
    pub(crate) fn map_at(fd: BorrowedFd<'_>, offset: usize, len: usize) -> io::Result<Self> {
        let offset = libc::off_t::try_from(offset)
            .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
        if len == 0 {
            return Err(io::ErrorKind::InvalidInput.into());
        }
        // SAFETY: a fresh mapping chosen by the kernel (null hint), of an open descriptor; no
        // existing memory is affected.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                offset,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let base = NonNull::new(p.cast::<u8>()).ok_or(io::ErrorKind::AddrNotAvailable)?;
        Ok(Self { base, len })
    }

    /// The first byte (page-aligned).
    pub(crate) fn base(&self) -> *mut u8 {
        self.base.as_ptr()
    }

    /// Bytes mapped.
    pub(crate) fn len(&self) -> usize {
        self.len
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: `base..base + len` is this mapping, mapped in `map` and not unmapped since;
        // nothing borrows it once the owner drops it.
        unsafe {
            libc::munmap(self.base.as_ptr().cast(), self.len);
        }
    }
}

/// Sleeps while `word` holds `expected`, at most `timeout`, or until [`wake`] on it (a shared
/// futex: the word may be in memory that other processes map). Returns early, without error,
/// when the word changed before the call, on a wake, an interruption, or the timeout: callers
/// look at the word again.
pub(crate) fn wait(word: &AtomicU32, expected: u32, timeout: Duration) {
    let ts = libc::timespec {
        tv_sec: libc::time_t::try_from(timeout.as_secs()).unwrap_or(libc::time_t::MAX),
        // Below 1e9: fits every c_long.
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: `word` is a valid, aligned 4-byte atomic for the call; FUTEX_WAIT reads it and
    // `ts`, writes nothing. Its errors (EAGAIN, EINTR, ETIMEDOUT) all mean "look again".
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            expected,
            &ts as *const libc::timespec,
        );
    }
}

/// Wakes every process sleeping in [`wait`] on `word`.
pub(crate) fn wake(word: &AtomicU32) {
    // SAFETY: `word` is a valid, aligned 4-byte atomic; FUTEX_WAKE only reads its address.
    unsafe {
        libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAKE, i32::MAX);
    }
}

/// The process and user at the other end of a Unix socket, as the kernel recorded them when it
/// connected (`SO_PEERCRED`: they cannot be forged).
///
/// # Errors
/// `getsockopt` failed.
pub(crate) fn peer(sock: &UnixStream) -> io::Result<(u32, u32)> {
    // SAFETY: `ucred` is plain old data, for which all zeroes is valid.
    let mut cred: libc::ucred = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `cred` and `len` are valid and writable for the call, `len` its size.
    let r = unsafe {
        libc::getsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok((u32::try_from(cred.pid).unwrap_or(0), cred.uid))
}

/// This process's user.
pub(crate) fn user() -> u32 {
    // SAFETY: getuid cannot fail and touches no memory.
    unsafe { libc::getuid() }
}

/// Room for one descriptor in a control message, as `CMSG_SPACE` computes it (u64 for
/// alignment).
const CONTROL: usize = 4;

/// Calls `f` with a message of one byte (`byte`) and a control buffer of [`CONTROL`] words
/// (its whole length in `msg_controllen`), both living across the call.
fn one_byte_message<R>(byte: u8, f: impl FnOnce(&mut libc::msghdr) -> R) -> R {
    let mut byte = [byte];
    let mut iov = libc::iovec {
        iov_base: byte.as_mut_ptr().cast(),
        iov_len: 1,
    };
    let mut control = [0u64; CONTROL];
    // SAFETY: `msghdr` is plain old data, for which all zeroes is valid.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = std::mem::size_of_val(&control) as _;
    f(&mut msg)
}

/// Sends `fd` and one byte over `sock`.
///
/// # Errors
/// `sendmsg` failed (the peer left).
pub(crate) fn send_fd(sock: &UnixStream, fd: BorrowedFd<'_>) -> io::Result<()> {
    one_byte_message(1, |msg| send_fd_in(sock, fd, msg))
}

fn send_fd_in(sock: &UnixStream, fd: BorrowedFd<'_>, msg: &mut libc::msghdr) -> io::Result<()> {
    // SAFETY: CMSG_SPACE only computes a size.
    let space = unsafe { libc::CMSG_SPACE(std::mem::size_of::<RawFd>() as u32) } as usize;
    debug_assert!(space <= CONTROL * 8);
    msg.msg_controllen = space as _;
    // SAFETY: `msg` points at its control buffer, which has room for one header and one
    // descriptor (`space` bytes, checked above), so CMSG_FIRSTHDR is non-null and its data
    // writable.
    unsafe {
        let cmsg = libc::CMSG_FIRSTHDR(msg);
        (*cmsg).cmsg_level = libc::SOL_SOCKET;
        (*cmsg).cmsg_type = libc::SCM_RIGHTS;
        (*cmsg).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<RawFd>() as u32) as _;
        std::ptr::write_unaligned(libc::CMSG_DATA(cmsg).cast::<RawFd>(), fd.as_raw_fd());
    }
    // SAFETY: `msg` and everything it points to are valid for the call.
    let n = unsafe { libc::sendmsg(sock.as_raw_fd(), msg, libc::MSG_NOSIGNAL) };
    match n {
        1 => Ok(()),
        0 => Err(io::ErrorKind::WriteZero.into()),
        _ => Err(io::Error::last_os_error()),
    }
}

/// Receives a descriptor sent by [`send_fd`] (blocking, as `sock` is set).
///
/// # Errors
/// `recvmsg` failed or timed out, the peer closed, or the message held no descriptor.
pub(crate) fn recv_fd(sock: &UnixStream) -> io::Result<OwnedFd> {
    one_byte_message(0, |msg| recv_fd_in(sock, msg))
}

fn recv_fd_in(sock: &UnixStream, msg: &mut libc::msghdr) -> io::Result<OwnedFd> {
    // SAFETY: `msg` and the buffers it points to are valid and writable for the call.
    let n = unsafe { libc::recvmsg(sock.as_raw_fd(), msg, libc::MSG_CMSG_CLOEXEC) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    if n == 0 {
        return Err(io::ErrorKind::UnexpectedEof.into());
    }
    // SAFETY: the kernel filled `msg`'s control buffer (of the length it reports back); the
    // CMSG_* walkers stay inside it.
    unsafe {
        let mut cmsg = libc::CMSG_FIRSTHDR(msg);
        while !cmsg.is_null() {
            if (*cmsg).cmsg_level == libc::SOL_SOCKET && (*cmsg).cmsg_type == libc::SCM_RIGHTS {
                let fd = std::ptr::read_unaligned(libc::CMSG_DATA(cmsg).cast::<RawFd>());
                if fd >= 0 {
                    return Ok(OwnedFd::from_raw_fd(fd));
                }
            }
            cmsg = libc::CMSG_NXTHDR(msg, cmsg);
        }
    }
    Err(io::Error::new(
        io::ErrorKind::InvalidData,
        "the message carried no descriptor",
    ))
}

/// What two processes must share to share memory through this module: the same running kernel
/// (its boot id), host name, and network and process namespaces (the Unix socket that hands the
/// memory over is abstract, so reachable only inside one network namespace; its peer's process
/// id is checked, so it must be one both see alike). Empty parts when `/proc` does not say.
pub(crate) fn host_identity() -> String {
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    let ns = |kind: &str| {
        std::fs::read_link(format!("/proc/self/ns/{kind}"))
            .map(|p| p.to_string_lossy().into_owned())
            .unwrap_or_default()
    };
    format!(
        "{}/{}/{}/{}",
        boot.trim(),
        super::node_name(),
        ns("net"),
        ns("pid")
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;
    use std::sync::atomic::Ordering;
    use std::time::Instant;

    #[test]
    fn a_memory_file_handed_over_a_socket_is_the_same_memory() {
        let fd = memory_file(c"burn-ddp-test", 8192).unwrap();
        assert_eq!(file_len(fd.as_fd()).unwrap(), 8192);
        let (a, b) = UnixStream::pair().unwrap();
        send_fd(&a, fd.as_fd()).unwrap();
        let got = recv_fd(&b).unwrap();
        let one = Mapping::map(fd.as_fd(), 8192).unwrap();
        let two = Mapping::map(got.as_fd(), file_len(got.as_fd()).unwrap()).unwrap();
        // SAFETY: both mappings are 8192 bytes long; nothing else touches them.
        unsafe {
            one.base().add(5000).write(42);
            assert_eq!(two.base().add(5000).read(), 42);
        }
        let (pid, uid) = peer(&a).unwrap();
        assert_eq!((pid, uid), (std::process::id(), user()));
    }

    #[test]
    fn a_message_without_a_descriptor_is_refused() {
        let (a, b) = UnixStream::pair().unwrap();
        use std::io::Write;
        (&a).write_all(b"x").unwrap();
        assert_eq!(recv_fd(&b).unwrap_err().kind(), io::ErrorKind::InvalidData);
        drop(a);
        assert_eq!(
            recv_fd(&b).unwrap_err().kind(),
            io::ErrorKind::UnexpectedEof
        );
    }

    #[test]
    fn a_futex_wait_ends_on_a_wake_or_its_timeout() {
        let word = std::sync::Arc::new(AtomicU32::new(0));
        let started = Instant::now();
        wait(&word, 0, Duration::from_millis(30));
        assert!(started.elapsed() >= Duration::from_millis(25));
        // A changed word returns at once.
        word.store(1, Ordering::SeqCst);
        let started = Instant::now();
        wait(&word, 0, Duration::from_secs(10));
        assert!(started.elapsed() < Duration::from_secs(5));
        let waker = {
            let word = std::sync::Arc::clone(&word);
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(20));
                word.store(2, Ordering::SeqCst);
                wake(&word);
            })
        };
        let started = Instant::now();
        while word.load(Ordering::SeqCst) == 1 {
            wait(&word, 1, Duration::from_secs(10));
        }
        assert!(started.elapsed() < Duration::from_secs(5));
        waker.join().unwrap();
    }

    #[test]
    fn the_host_identity_is_stable_and_names_the_kernel() {
        let id = host_identity();
        assert_eq!(id, host_identity());
        let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap();
        assert!(id.starts_with(boot.trim()), "{id}");
    }
}
