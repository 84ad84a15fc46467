//! A byte stream from one process to another of the same host through shared memory: a ring
//! buffer in an anonymous memory file that the writer creates and hands to the reader over a
//! Unix socket, which stays open as the sign of life of both ends.
//!
//! One writer, one reader. The writer copies into the ring and advances `head`; the reader
//! copies out and advances `tail`. Each side that finds nothing to do spins briefly, then sleeps
//! on the other's futex word in short slices, looking between slices at the socket: the other
//! end's process has exited (or dropped its end) when it reads as closed. Bytes the writer
//! published before it left are still read first, as from a TCP connection.

use std::io::{self, Read, Write};
use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::sys::shared::{self, Mapping};
use crate::sys::{self, Peeked};

/// Bytes of the ring.
pub(crate) const RING: usize = 4 << 20;
/// Bytes before the ring: the two sides' counters, a cache line apart.
const HEADER: usize = 4096;
const MAGIC: u64 = u64::from_le_bytes(*b"BDDPIPE1");
/// Longest sleep between two looks at the socket.
const NAP: Duration = Duration::from_millis(2);
/// How long a side spins before it sleeps.
const SPIN: Duration = Duration::from_micros(50);
/// How long a write waits for room before it returns `TimedOut`, so that its caller can look at
/// its deadline and interrupt checks.
const WRITE_SLICE: Duration = Duration::from_millis(50);

/// The shared memory of one pipe.
#[derive(Debug)]
struct PipeState {
    map: Mapping,
}

impl PipeState {
    fn u64_at(&self, at: usize) -> &AtomicU64 {
        // SAFETY: `at` is one of the header's aligned offsets below; the mapping lives as long as
        // `self`, and every process accesses these words only atomically.
        unsafe { &*self.map.base().add(at).cast::<AtomicU64>() }
    }

    fn u32_at(&self, at: usize) -> &AtomicU32 {
        // SAFETY: as `u64_at`.
        unsafe { &*self.map.base().add(at).cast::<AtomicU32>() }
    }

    /// Bytes written so far (the writer's).
    fn head(&self) -> &AtomicU64 {
        self.u64_at(64)
    }
    /// The futex word the reader sleeps on (the low bits of `head`).
    fn written(&self) -> &AtomicU32 {
        self.u32_at(72)
    }
    fn reader_asleep(&self) -> &AtomicU32 {
        self.u32_at(76)
    }
    /// Bytes read so far (the reader's).
    fn tail(&self) -> &AtomicU64 {
        self.u64_at(128)
    }
    /// The futex word the writer sleeps on (the low bits of `tail`).
    fn freed(&self) -> &AtomicU32 {
        self.u32_at(136)
    }
    fn writer_asleep(&self) -> &AtomicU32 {
        self.u32_at(140)
    }

    fn data(&self) -> *mut u8 {
        // SAFETY: the ring follows the header inside the mapping.
        unsafe { self.map.base().add(HEADER) }
    }
}

/// Whether the other end's socket reads as closed (its process left), or failed.
fn gone(sock: &UnixStream) -> bool {
    matches!(
        sys::peek_state(sock.as_fd()),
        Peeked::Closed | Peeked::Failed(_)
    )
}

/// Sleeps on `word` (which held `seen`) for a slice, flagging `asleep` for the other side.
fn nap(word: &AtomicU32, seen: u32, asleep: &AtomicU32, still_waiting: impl Fn() -> bool) {
    asleep.store(1, Ordering::SeqCst);
    if still_waiting() {
        shared::wait(word, seen, NAP);
    }
    asleep.store(0, Ordering::SeqCst);
}

/// The writing end.
#[derive(Debug)]
pub(crate) struct PipeWriter {
    shared: PipeState,
    sock: UnixStream,
}

impl PipeWriter {
    /// Creates a pipe and hands its memory to the reader at the other end of `sock`.
    ///
    /// # Errors
    /// The memory could not be created, mapped or sent.
    pub(crate) fn create(sock: UnixStream) -> io::Result<Self> {
        let fd = shared::memory_file(c"burn-ddp-p2p", HEADER + RING)?;
        let map = Mapping::map(fd.as_fd(), HEADER + RING)?;
        // SAFETY: the first 16 bytes of a fresh mapping nobody else has yet.
        unsafe {
            map.base().cast::<u64>().write(MAGIC);
            map.base().add(8).cast::<u64>().write(RING as u64);
        }
        shared::send_fd(&sock, fd.as_fd())?;
        Ok(Self {
            shared: PipeState { map },
            sock,
        })
    }

    /// Ends the pipe: the reader sees its end once it has read what is in the ring.
    pub(crate) fn shutdown(&self) {
        let _ = self.sock.shutdown(std::net::Shutdown::Both);
    }
}

impl Write for PipeWriter {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        let s = &self.shared;
        let started = Instant::now();
        loop {
            let head = s.head().load(Ordering::Relaxed);
            let tail = s.tail().load(Ordering::Acquire);
            let free = RING - (head - tail) as usize;
            if free > 0 {
                let at = (head % RING as u64) as usize;
                let n = free.min(buf.len()).min(RING - at);
                // SAFETY: `at..at + n` is inside the ring and free: the reader has read past it
                // (acquire on `tail`) and reads it again only after `head` passes it.
                unsafe { std::ptr::copy_nonoverlapping(buf.as_ptr(), s.data().add(at), n) };
                let head = head + n as u64;
                s.head().store(head, Ordering::Release);
                s.written().store(head as u32, Ordering::SeqCst);
                if s.reader_asleep().load(Ordering::SeqCst) != 0 {
                    shared::wake(s.written());
                }
                return Ok(n);
            }
            let waited = started.elapsed();
            if waited < SPIN {
                std::hint::spin_loop();
                continue;
            }
            if gone(&self.sock) {
                return Err(io::ErrorKind::BrokenPipe.into());
            }
            if waited >= WRITE_SLICE {
                return Err(io::ErrorKind::TimedOut.into());
            }
            let seen = s.freed().load(Ordering::SeqCst);
            nap(s.freed(), seen, s.writer_asleep(), || {
                s.tail().load(Ordering::SeqCst) == tail
            });
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// The reading end.
#[derive(Debug)]
pub(crate) struct PipeReader {
    shared: PipeState,
    sock: UnixStream,
    /// Set when the endpoint closes: a waiting read ends.
    stop: Arc<AtomicBool>,
}

impl PipeReader {
    /// Receives the memory of a pipe from the writer at the other end of `sock`.
    ///
    /// # Errors
    /// Nothing was sent, or not a pipe of this version.
    pub(crate) fn accept(sock: UnixStream, stop: Arc<AtomicBool>) -> io::Result<Self> {
        let fd = shared::recv_fd(&sock)?;
        let len = shared::file_len(fd.as_fd())?;
        if len != HEADER + RING {
            return Err(io::Error::new(io::ErrorKind::InvalidData, "not a pipe"));
        }
        let map = Mapping::map(fd.as_fd(), len)?;
        // SAFETY: the first 16 bytes, written by the creator before it sent the descriptor.
        let (magic, ring) = unsafe {
            (
                map.base().cast::<u64>().read(),
                map.base().add(8).cast::<u64>().read(),
            )
        };
        if magic != MAGIC || ring != RING as u64 {
            return Err(io::Error::new(io::ErrorKind::InvalidData, "not a pipe"));
        }
        sock.set_nonblocking(true)?;
        Ok(Self {
            shared: PipeState { map },
            sock,
            stop,
        })
    }
}

impl Read for PipeReader {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        let s = &self.shared;
        let started = Instant::now();
        loop {
            let tail = s.tail().load(Ordering::Relaxed);
            let head = s.head().load(Ordering::Acquire);
            if head > tail {
                let at = (tail % RING as u64) as usize;
                let n = ((head - tail) as usize).min(buf.len()).min(RING - at);
                // SAFETY: `at..at + n` is inside the ring and written (acquire on `head`); the
                // writer writes it again only after `tail` passes it.
                unsafe { std::ptr::copy_nonoverlapping(s.data().add(at), buf.as_mut_ptr(), n) };
                let tail = tail + n as u64;
                s.tail().store(tail, Ordering::Release);
                s.freed().store(tail as u32, Ordering::SeqCst);
                if s.writer_asleep().load(Ordering::SeqCst) != 0 {
                    shared::wake(s.freed());
                }
                return Ok(n);
            }
            if started.elapsed() < SPIN {
                std::hint::spin_loop();
                continue;
            }
            if self.stop.load(Ordering::Relaxed) {
                return Err(io::ErrorKind::ConnectionAborted.into());
            }
            if gone(&self.sock) {
                // What the writer published before it left is read first.
                if s.head().load(Ordering::Acquire) > tail {
                    continue;
                }
                return Ok(0);
            }
            let seen = s.written().load(Ordering::SeqCst);
            nap(s.written(), seen, s.reader_asleep(), || {
                s.head().load(Ordering::SeqCst) == head
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair() -> (PipeWriter, PipeReader) {
        let (a, b) = UnixStream::pair().unwrap();
        let w = PipeWriter::create(a).unwrap();
        let r = PipeReader::accept(b, Arc::new(AtomicBool::new(false))).unwrap();
        (w, r)
    }

    #[test]
    fn bytes_arrive_in_order_across_the_wrap_and_then_the_end() {
        let (mut w, mut r) = pair();
        let total = 3 * RING + 12_345;
        let data: Vec<u8> = (0..total).map(|i| (i * 7 % 251) as u8).collect();
        let sent = data.clone();
        let writer = std::thread::spawn(move || {
            let mut rest = &sent[..];
            while !rest.is_empty() {
                match w.write(rest) {
                    Ok(n) => rest = &rest[n..],
                    Err(e) if e.kind() == io::ErrorKind::TimedOut => {}
                    Err(e) => panic!("{e}"),
                }
            }
            // Dropping the writer closes its socket after the last bytes.
        });
        let mut got = vec![0u8; total];
        r.read_exact(&mut got).unwrap();
        writer.join().unwrap();
        assert!(got == data, "bytes differ");
        let mut more = [0u8; 1];
        assert_eq!(r.read(&mut more).unwrap(), 0, "the writer's end reads as 0");
    }

    #[test]
    fn a_full_pipe_times_out_and_then_breaks_when_the_reader_leaves() {
        let (mut w, r) = pair();
        let big = vec![1u8; RING];
        assert_eq!(w.write(&big).unwrap(), RING);
        let e = w.write(&big).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::TimedOut);
        drop(r);
        let e = w.write(&big).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::BrokenPipe);
    }

    #[test]
    fn a_waiting_read_ends_when_the_endpoint_stops() {
        let (_w, mut r) = pair();
        let stop = Arc::clone(&r.stop);
        let t = std::thread::spawn(move || r.read(&mut [0u8; 8]).unwrap_err().kind());
        std::thread::sleep(Duration::from_millis(20));
        stop.store(true, Ordering::SeqCst);
        assert_eq!(t.join().unwrap(), io::ErrorKind::ConnectionAborted);
    }
}
