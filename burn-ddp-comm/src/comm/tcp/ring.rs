//! Ring collectives as one streaming engine.
//!
//! Every collective is described by a [`Plan`]: the byte ranges of the buffer that go out to the
//! next rank, in order, and the byte ranges that arrive from the previous rank, in order, each
//! either copied in place or reduced into the buffer. A send segment may be *gated* on a receive
//! segment over the same bytes: it can only send what has already arrived (and been reduced).
//!
//! That single rule gives the pipelined ring. For an all-reduce on rank r of W, with the buffer cut
//! into W segments `seg(i)`:
//!
//! ```text
//! send k = seg(r - k)          gated on recv k-1 (k > 0)      k = 0 .. 2(W-1)
//! recv j = seg(r - j - 1)      reduce for j < W-1, copy after
//! ```
//!
//! The first W-1 steps are the reduce-scatter, the last W-1 the all-gather, and because gating is
//! per byte, a segment flows on as soon as its first bytes are reduced: no step waits for the
//! previous one to finish. See Note [Ring engine] below for the I/O loop.

use std::io::{self, ErrorKind};
use std::net::TcpStream;
use std::ops::Range;
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crate::sys::{self, Ready};

use super::header;
use crate::comm::reduce::{combine, split, Finish};
use crate::types::{CollectiveDesc, DType, ReduceOp};
use crate::types::{CollectiveSeq, Rank};
use crate::wire::WireError;

/// Largest single `send`/`recv` of payload.
const MAX_IO: usize = 1 << 20;
/// Size of the scratch buffer that receives bytes to be reduced; small enough to stay in L2.
pub(crate) const SCRATCH: usize = 256 << 10;
/// Longest sleep in `poll` before re-checking the deadline and the abort flag.
const TICK: Duration = Duration::from_millis(500);
/// How long to keep retrying without sleeping after the last byte moved, when the host has a
/// core per rank. See Note [Ring engine].
pub(crate) const SPIN: Duration = Duration::from_micros(300);

/// How received bytes are applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RecvMode {
    /// Written over the buffer.
    Copy,
    /// Combined into the buffer with `op`, then `finish`ed.
    Reduce(ReduceOp, Finish),
}

/// Bytes going to the next rank.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SendSeg {
    /// Byte range of the buffer.
    pub range: Range<usize>,
    /// The receive segment (same length) whose processed bytes this segment may send.
    pub gate: Option<usize>,
}

/// Bytes coming from the previous rank.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RecvSeg {
    /// Byte range of the buffer.
    pub range: Range<usize>,
    /// How they are applied.
    pub mode: RecvMode,
}

/// The two streams of one collective on one rank.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Plan {
    pub sends: Vec<SendSeg>,
    pub recvs: Vec<RecvSeg>,
}

fn at(segs: &[Range<usize>], i: isize) -> Range<usize> {
    let w = segs.len() as isize;
    segs[i.rem_euclid(w) as usize].clone()
}

/// All-reduce of `count` elements on rank `rank` of `world` (world >= 2).
pub(crate) fn all_reduce(
    rank: usize,
    world: usize,
    count: usize,
    dtype: DType,
    op: ReduceOp,
) -> Plan {
    let finish = match op {
        ReduceOp::Mean => Finish::DivideBy(world as u32),
        _ => Finish::None,
    };
    all_reduce_finishing(rank, world, count, (dtype, op), finish)
}

/// [`all_reduce`], with `finish` after the last combine of each segment (a hierarchy's ring
/// across hosts divides a mean by the whole world there).
pub(crate) fn all_reduce_finishing(
    rank: usize,
    world: usize,
    count: usize,
    (dtype, op): (DType, ReduceOp),
    finish: Finish,
) -> Plan {
    let segs = split(count, dtype.size(), world);
    let r = rank as isize;
    let steps = 2 * (world - 1);
    let mut plan = Plan::default();
    for k in 0..steps {
        plan.sends.push(SendSeg {
            range: at(&segs, r - k as isize),
            gate: k.checked_sub(1),
        });
        let mode = if k < world - 1 {
            let finish = if k == world - 2 { finish } else { Finish::None };
            RecvMode::Reduce(op, finish)
        } else {
            RecvMode::Copy
        };
        plan.recvs.push(RecvSeg {
            range: at(&segs, r - k as isize - 1),
            mode,
        });
    }
    plan
}

/// Reduce-scatter over a work buffer of `world` blocks of `block` elements: rank r ends with the
/// reduction of block r in place (world >= 2).
pub(crate) fn reduce_scatter(
    rank: usize,
    world: usize,
    block: usize,
    dtype: DType,
    op: ReduceOp,
) -> Plan {
    let blocks = split(block * world, dtype.size(), world);
    // seg(i) = block(i - 1), so that the segment the all-reduce's reduce-scatter leaves on rank r,
    // seg(r + 1), is block r.
    let seg = |i: isize| at(&blocks, i - 1);
    let r = rank as isize;
    let mut plan = Plan::default();
    for k in 0..world - 1 {
        plan.sends.push(SendSeg {
            range: seg(r - k as isize),
            gate: k.checked_sub(1),
        });
        let finish = if k == world - 2 && op == ReduceOp::Mean {
            Finish::DivideBy(world as u32)
        } else {
            Finish::None
        };
        plan.recvs.push(RecvSeg {
            range: seg(r - k as isize - 1),
            mode: RecvMode::Reduce(op, finish),
        });
    }
    plan
}

/// All-gather over a buffer of `world` blocks of `block` bytes whose block `rank` already holds
/// this rank's contribution (world >= 2).
pub(crate) fn all_gather(rank: usize, world: usize, block_bytes: usize) -> Plan {
    let blocks: Vec<Range<usize>> = (0..world)
        .map(|i| i * block_bytes..(i + 1) * block_bytes)
        .collect();
    let r = rank as isize;
    let mut plan = Plan::default();
    for k in 0..world - 1 {
        plan.sends.push(SendSeg {
            range: at(&blocks, r - k as isize),
            gate: k.checked_sub(1),
        });
        plan.recvs.push(RecvSeg {
            range: at(&blocks, r - k as isize - 1),
            mode: RecvMode::Copy,
        });
    }
    plan
}

/// Pipelined chain broadcast from `root` (world >= 2).
pub(crate) fn broadcast(rank: usize, world: usize, root: usize, bytes: usize) -> Plan {
    let pos = (rank + world - root) % world;
    let mut plan = Plan::default();
    if pos > 0 {
        plan.recvs.push(RecvSeg {
            range: 0..bytes,
            mode: RecvMode::Copy,
        });
    }
    if pos < world - 1 {
        plan.sends.push(SendSeg {
            range: 0..bytes,
            gate: (pos > 0).then_some(0),
        });
    }
    plan
}

/// Which link an engine failure concerns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Side {
    /// The link to the next rank (we send on it).
    Next,
    /// The link from the previous rank (we receive on it).
    Prev,
}

/// Why a ring collective stopped.
#[derive(Debug)]
pub(crate) enum RingError {
    /// A link closed or failed.
    Closed(Side, io::Error),
    /// The deadline passed while waiting on a link.
    Timeout(Side),
    /// The previous rank opened a different collective.
    Mismatch(CollectiveSeq, CollectiveDesc),
    /// The previous rank sent an invalid header.
    Protocol(WireError),
    /// The rank at this place opened this collective on a link of the other algorithm (see
    /// [`Waits::foreign`]).
    Foreign(usize, CollectiveSeq, CollectiveDesc),
    /// The group was aborted from outside (watchdog) while this collective waited.
    Aborted,
}

/// The links of a ring: equal for a world of two (one full-duplex connection).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Links<'a> {
    pub next: &'a TcpStream,
    pub prev: &'a TcpStream,
    pub same: bool,
}

/// Progress of one collective on one rank.
struct Engine<'a> {
    plan: &'a Plan,
    dtype: DType,
    hdr_out: [u8; header::LEN],
    hdr_out_sent: usize,
    hdr_in: [u8; header::LEN],
    hdr_in_got: usize,
    send_idx: usize,
    send_off: usize,
    recv_idx: usize,
    /// Bytes of each receive segment applied to the buffer.
    processed: Vec<usize>,
    /// Bytes of the current reduce segment waiting in `scratch`.
    pending: usize,
    scratch: &'a mut [u8],
}

impl Engine<'_> {
    fn send_done(&self) -> bool {
        self.hdr_out_sent == header::LEN && self.send_idx == self.plan.sends.len()
    }

    fn recv_done(&self) -> bool {
        self.hdr_in_got == header::LEN && self.recv_idx == self.plan.recvs.len()
    }

    /// Bytes of the current send segment that may go out now.
    fn sendable(&self) -> usize {
        if self.hdr_out_sent < header::LEN {
            return header::LEN - self.hdr_out_sent;
        }
        let Some(seg) = self.plan.sends.get(self.send_idx) else {
            return 0;
        };
        let limit = match seg.gate {
            None => seg.range.len(),
            Some(j) => self.processed[j],
        };
        limit.saturating_sub(self.send_off)
    }

    /// Skips finished (and empty) segments.
    fn advance(&mut self) {
        while let Some(seg) = self.plan.sends.get(self.send_idx) {
            if self.send_off < seg.range.len() {
                break;
            }
            self.send_idx += 1;
            self.send_off = 0;
        }
        while let Some(seg) = self.plan.recvs.get(self.recv_idx) {
            if self.processed[self.recv_idx] < seg.range.len() {
                break;
            }
            self.recv_idx += 1;
        }
    }

    /// One `send` syscall if anything is sendable. Returns whether bytes moved.
    fn try_send(&mut self, sock: &TcpStream, buf: &[u8]) -> Result<bool, RingError> {
        let n = self.sendable();
        if n == 0 {
            return Ok(false);
        }
        let bytes: &[u8] = if self.hdr_out_sent < header::LEN {
            &self.hdr_out[self.hdr_out_sent..]
        } else {
            let seg = &self.plan.sends[self.send_idx];
            let start = seg.range.start + self.send_off;
            &buf[start..start + n.min(MAX_IO)]
        };
        match sys::send(sock.as_fd(), bytes) {
            Ok(sent) => {
                if self.hdr_out_sent < header::LEN {
                    self.hdr_out_sent += sent;
                } else {
                    self.send_off += sent;
                }
                self.advance();
                Ok(sent > 0)
            }
            Err(e) if would_block(&e) => Ok(false),
            Err(e) => Err(RingError::Closed(Side::Next, e)),
        }
    }

    /// One `recv` syscall if anything is expected. Returns whether bytes moved.
    fn try_recv(
        &mut self,
        sock: &TcpStream,
        buf: &mut [u8],
        expect: (CollectiveSeq, &CollectiveDesc),
    ) -> Result<bool, RingError> {
        if self.recv_done() {
            return Ok(false);
        }
        if self.hdr_in_got < header::LEN {
            let got = match sys::recv(sock.as_fd(), &mut self.hdr_in[self.hdr_in_got..]) {
                Ok(n) => n,
                Err(e) if would_block(&e) => return Ok(false),
                Err(e) => return Err(RingError::Closed(Side::Prev, e)),
            };
            if got == 0 {
                return Err(RingError::Closed(
                    Side::Prev,
                    ErrorKind::UnexpectedEof.into(),
                ));
            }
            self.hdr_in_got += got;
            if self.hdr_in_got == header::LEN {
                let (seq, desc) = header::decode(&self.hdr_in).map_err(RingError::Protocol)?;
                if seq != expect.0 || desc != *expect.1 {
                    return Err(RingError::Mismatch(seq, desc));
                }
                self.advance();
            }
            return Ok(true);
        }
        let seg = &self.plan.recvs[self.recv_idx];
        let done = self.processed[self.recv_idx];
        let left = seg.range.len() - done;
        let got = match seg.mode {
            RecvMode::Copy => {
                let start = seg.range.start + done;
                let dst = &mut buf[start..start + left.min(MAX_IO)];
                match sys::recv(sock.as_fd(), dst) {
                    Ok(n) => {
                        self.processed[self.recv_idx] += n;
                        n
                    }
                    Err(e) if would_block(&e) => return Ok(false),
                    Err(e) => return Err(RingError::Closed(Side::Prev, e)),
                }
            }
            RecvMode::Reduce(op, finish) => {
                let want = (left - self.pending).min(self.scratch.len() - self.pending);
                let dst = &mut self.scratch[self.pending..self.pending + want];
                let n = match sys::recv(sock.as_fd(), dst) {
                    Ok(n) => n,
                    Err(e) if would_block(&e) => return Ok(false),
                    Err(e) => return Err(RingError::Closed(Side::Prev, e)),
                };
                self.pending += n;
                let elem = self.dtype.size();
                let whole = self.pending / elem * elem;
                if whole > 0 {
                    let start = seg.range.start + done;
                    combine(
                        self.dtype,
                        op,
                        &mut buf[start..start + whole],
                        &self.scratch[..whole],
                        finish,
                    );
                    self.processed[self.recv_idx] += whole;
                    self.scratch.copy_within(whole..self.pending, 0);
                    self.pending -= whole;
                }
                n
            }
        };
        if got == 0 {
            return Err(RingError::Closed(
                Side::Prev,
                ErrorKind::UnexpectedEof.into(),
            ));
        }
        self.advance();
        Ok(true)
    }
}

// Note [Ring engine]
// ~~~~~~~~~~~~~~~~~~
// One thread drives both directions with non-blocking sockets: each turn tries one `send` of
// whatever the plan allows and one `recv`, and only sleeps in `poll` when neither moved a byte
// for SPIN. While data streams, the peer's next chunk usually lands within microseconds; sleeping
// at once would cost a wake-up (an inter-processor interrupt in a VM) per chunk, which measured as
// ~15% of the time of a 64 MiB all-reduce between two processes on a 2-core VM. Spinning is
// bounded by time since the last progress, so a rank waiting for a slow peer still sleeps.
// Alternating at syscall granularity keeps the pipeline short (a reduced chunk goes out right
// after it is reduced) and avoids a second thread per rank, which on small machines costs more
// in context switches than it gains. Reduction happens on a small scratch buffer that the kernel
// has just written, so it reads from cache; the all-gather half receives straight into the
// destination. Sends use MSG_NOSIGNAL so a dead peer is an EPIPE error, not a SIGPIPE.

/// How a collective waits: its deadline, the flag that aborts it, how long it spins before it
/// sleeps, and the links it watches for a peer that runs the same collective with the other
/// algorithm.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Waits<'a> {
    pub deadline: Instant,
    pub abort: &'a AtomicBool,
    /// How long to keep retrying without sleeping after the last byte moved (see Note [Ring
    /// engine]); zero when this host runs more ranks than it has cores, where a spinning rank
    /// only delays the peer it waits for.
    pub spin: Duration,
    /// The links of the other algorithm (ring or recursive doubling) with the peer's place. No
    /// bytes of this collective travel on them; a header with this collective's sequence number
    /// there means the peer runs it the other way (it called another collective, whose size
    /// chose the other algorithm), which no header check on this collective's own links would
    /// ever see: both sides would wait for the deadline. See Note [Foreign headers].
    pub foreign: &'a [(&'a TcpStream, usize)],
}

// Note [Foreign headers]
// ~~~~~~~~~~~~~~~~~~~~~~
// Ring and recursive doubling use separate links. When every rank runs collective `seq` with one
// algorithm, nothing with sequence number `seq` is ever sent on the other algorithm's links: the
// previous collectives' bytes were all consumed before they ended, and a peer that has moved on
// can only send headers of later collectives there. So when the engine sleeps, it also waits for
// those links to become readable and peeks (MSG_PEEK: the bytes stay for their collective) at
// the header there: `seq` means a mismatch, reported as one naming the peer; anything else (a
// later collective, the peer's end of the link closing) takes the link off the watch for the
// rest of this collective. In any mix of algorithms some rank runs the ring while its next rank
// does not (or a rank of the tree waits for a partner on the ring), and that rank sees the
// header at once.

/// Runs one collective on a ring. `scratch` must hold at least one element and be aligned for
/// every element type (the caller allocates it as `u64`s).
///
/// # Errors
/// See [`RingError`].
pub(crate) fn run(
    links: Links<'_>,
    buf: &mut [u8],
    plan: &Plan,
    (seq, desc): (CollectiveSeq, &CollectiveDesc),
    scratch: &mut [u8],
    waits: Waits<'_>,
) -> Result<(), RingError> {
    let mut e = Engine {
        plan,
        dtype: desc.dtype,
        hdr_out: header::encode(seq, desc),
        hdr_out_sent: 0,
        hdr_in: [0; header::LEN],
        hdr_in_got: 0,
        send_idx: 0,
        send_off: 0,
        recv_idx: 0,
        processed: vec![0; plan.recvs.len()],
        pending: 0,
        scratch,
    };
    // Ranks that neither send nor receive payload still exchange headers, which keeps the
    // sequence check (and the barrier semantics of an all-reduce) uniform.
    e.advance();
    let mut watched: Vec<bool> = vec![true; waits.foreign.len()];
    let mut last_progress = Instant::now();
    loop {
        let sent = e.try_send(links.next, buf)?;
        let got = e.try_recv(links.prev, buf, (seq, desc))?;
        if e.send_done() && e.recv_done() {
            return Ok(());
        }
        if sent || got {
            last_progress = Instant::now();
            continue;
        }
        if last_progress.elapsed() < waits.spin {
            std::hint::spin_loop();
            continue;
        }
        if waits.abort.load(Ordering::Relaxed) {
            return Err(RingError::Aborted);
        }
        let now = Instant::now();
        let want_out = e.sendable() > 0;
        let want_in = !e.recv_done();
        if now >= waits.deadline {
            return Err(RingError::Timeout(if want_in {
                Side::Prev
            } else {
                Side::Next
            }));
        }
        let wait = (waits.deadline - now).min(TICK);
        let (next, prev) = (links.next.as_fd(), links.prev.as_fd());
        let mut fds = Vec::with_capacity(2 + waits.foreign.len());
        if links.same {
            fds.push((
                next,
                Ready {
                    read: want_in,
                    write: want_out,
                },
            ));
        } else {
            fds.push((
                next,
                Ready {
                    read: false,
                    write: want_out,
                },
            ));
            fds.push((
                prev,
                Ready {
                    read: want_in,
                    write: false,
                },
            ));
        }
        let base = fds.len();
        let mut watching = Vec::new();
        for (i, (link, _)) in waits.foreign.iter().enumerate() {
            if watched[i] && base + watching.len() < sys::POLL_SET_MAX {
                fds.push((
                    link.as_fd(),
                    Ready {
                        read: true,
                        write: false,
                    },
                ));
                watching.push(i);
            }
        }
        let ready = sys::poll_set(&fds, wait).map_err(|e| RingError::Closed(Side::Prev, e))?;
        for (k, &i) in watching.iter().enumerate() {
            if ready & (1 << (base + k)) == 0 {
                continue;
            }
            let (link, place) = waits.foreign[i];
            let mut h = [0u8; header::LEN];
            match sys::peek(link.as_fd(), &mut h) {
                Err(e) if would_block(&e) => {}
                Ok(header::LEN) => match header::decode(&h) {
                    Ok((their_seq, theirs)) if their_seq == seq => {
                        return Err(RingError::Foreign(place, their_seq, theirs));
                    }
                    _ => watched[i] = false,
                },
                // A later collective's partial header, the peer's end closing, an error: not
                // this collective's business (its own links report a dead peer).
                _ => watched[i] = false,
            }
        }
    }
}

/// A non-blocking socket with nothing to do now (or a call interrupted): try again later.
fn would_block(e: &io::Error) -> bool {
    matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::Interrupted)
}

/// The rank on each side of `rank` in a ring of `world`.
pub(crate) fn neighbours(rank: Rank, world: u32) -> (Rank, Rank) {
    (
        (Rank((rank.0 + 1) % world)),
        Rank((rank.0 + world - 1) % world),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn all_reduce_plan_gates_each_send_on_the_same_bytes() {
        for world in 2..6 {
            for rank in 0..world {
                let p = all_reduce(rank, world, 101, DType::F32, ReduceOp::Mean);
                assert_eq!(p.sends.len(), 2 * (world - 1));
                for (k, s) in p.sends.iter().enumerate().skip(1) {
                    assert_eq!(s.gate, Some(k - 1));
                    assert_eq!(s.range, p.recvs[k - 1].range);
                }
                // Exactly one reduce step divides, and it is the last of the reduce-scatter.
                let divides: Vec<usize> = p
                    .recvs
                    .iter()
                    .enumerate()
                    .filter(|(_, r)| matches!(r.mode, RecvMode::Reduce(_, Finish::DivideBy(_))))
                    .map(|(i, _)| i)
                    .collect();
                assert_eq!(divides, vec![world - 2]);
            }
        }
    }

    #[test]
    fn reduce_scatter_leaves_block_r_on_rank_r() {
        for world in 2..6 {
            for rank in 0..world {
                let p = reduce_scatter(rank, world, 7, DType::I32, ReduceOp::Sum);
                let last = p.recvs.last().unwrap().range.clone();
                assert_eq!(
                    last,
                    rank * 28..(rank + 1) * 28,
                    "world {world} rank {rank}"
                );
            }
        }
    }

    #[test]
    fn broadcast_chain_ends_before_root() {
        let p = broadcast(2, 3, 0, 8);
        assert!(p.sends.is_empty());
        assert_eq!(p.recvs.len(), 1);
        let p = broadcast(0, 3, 0, 8);
        assert!(p.recvs.is_empty());
        assert_eq!(p.sends[0].gate, None);
        let p = broadcast(1, 3, 0, 8);
        assert_eq!(p.sends[0].gate, Some(0));
    }

    #[test]
    fn neighbours_wrap() {
        assert_eq!(neighbours(Rank(0), 3), (Rank(1), Rank(2)));
        assert_eq!(neighbours(Rank(2), 3), (Rank(0), Rank(1)));
    }
}
