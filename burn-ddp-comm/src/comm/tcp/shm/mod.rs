//! Collectives through memory shared by the ranks of one host (see Note [Shared-memory
//! collectives]).
//!
//! - `mod.rs`: the segment's layout, the counters the ranks wait on, the collectives
//! - `setup.rs`: whether a group uses it, and handing the segment to every rank
//! - a group spread over hosts with as many ranks on each uses a segment per host and rings
//!   across hosts for its large all-reduces ([`Hierarchy`], Note [Hierarchical all-reduce])
//!
//! The group keeps its TCP links: they carry nothing here, but a peer that dies closes them,
//! which is how a waiting rank learns it at once, and a failure closes them to stop the others
//! (`tcp/mod.rs` turns every failure into the error to report, as for the ring).

mod setup;

pub(crate) use setup::open;

use std::io;
use std::net::TcpStream;
use std::ops::Range;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::{Duration, Instant};

use super::header;
use super::link::Ring;
use crate::comm::reduce::{combine, split, Finish};
use crate::sys::shared::{self, Mapping};
use crate::sys::{self, Peeked};
use crate::types::{CollectiveDesc, CollectiveSeq, DType, ReduceOp};
use crate::wire::WireError;

// Note [Shared-memory collectives]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The segment holds, after a header, one control line per rank (its counter, a futex word, and
// the descriptors of its last two collectives) and one slot per rank of two halves of `chunk`
// bytes. A collective moves its buffer chunk by chunk; each chunk goes through the next half of
// every rank's slot (they alternate over the life of the group).
//
// A rank writes only its own slot and control line. It tells the others "what I wrote is there"
// by raising its counter (a sync), and reads another rank's slot only after seeing that rank's
// counter reach the same sync. Every sync waits for every rank, so when a rank writes a half
// again (two chunks later) every other rank has passed a later sync, which it raises only after
// reading what that half held. A rank that dies mid-write never raises its counter: nobody reads
// what it left.
//
// - all-reduce, per chunk: write the chunk except the part this rank reduces; sync; reduce that
//   part (this rank's value, then every other rank's in rank order: the order of summation
//   depends on the world size only, and each element is computed by one rank, so every rank
//   ends with the same bits); write the result; sync; copy the other parts' results.
// - broadcast: the root writes; sync; the others copy.
// - all-gather: each writes its block's chunk; sync; each copies the others'.
// - reduce-scatter: each writes the chunk of every block but its own; sync; each reduces its
//   block.
// - barrier: one sync.
//
// The first sync of a collective also compares every rank's descriptor (kept by sequence
// number's parity, since a fast rank may write its next one while a slow one still reads),
// which catches ranks calling different collectives before any byte is misread.
//
// Waiting spins for `spin`, then sleeps on the peer's futex in slices of `SLICE`, looking
// between slices at the deadline, the abort flag (the heartbeat's verdict sets it), and the
// group's TCP links (a closed link is a dead peer).

// Note [Hierarchical all-reduce]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A group of H hosts with L ranks each (L >= 2, H >= 2) has a segment per host and L rings
// across hosts: ring i joins the ranks of local index i of every host, in host order (hosts in
// the order of their first rank). An all-reduce of `count` elements, above the size recursive
// doubling takes:
//
// 1. Inside each host, a reduce-scatter in the segment: the buffer is split into L contiguous
//    parts (sizes differ by at most one element); local rank i reduces part i, its own value
//    first, then the other local ranks' in local order (the shared-memory order above).
// 2. Ring i all-reduces part i across hosts: the TCP ring's order, which depends on the number
//    of hosts only (`ring.rs`). A mean sums in both steps and divides by the whole world once, at
//    the last addition of step 2, as the flat ring does.
// 3. Inside each host, an all-gather of the parts in the segment.
//
// So every element is the same sum on every rank, in an order fixed by the layout (H, L, and
// which ranks share a host): run to run, the same job gives the same bits. Against the flat ring
// the order differs, so float sums agree to rounding only; integers, max, min, and floats whose
// partial sums are exact agree bit for bit (the test compares both).
//
// In step 2 each rank sends 2(H-1)/H of its part, so a host sends 2(H-1)/H of the buffer, about
// what the flat ring sends out of a host whose ranks are adjacent on it, but over L streams at
// once instead of one, in 2(H-1) steps instead of 2(n-1), and with no loopback TCP inside the
// host: the shared-memory steps move memory at memory speed. The other collectives (and small
// all-reduces) run on the flat TCP links.

/// Longest sleep between two looks at the deadline, the abort flag and the links.
const SLICE: Duration = Duration::from_millis(2);
/// Bytes before the control lines.
const HEADER: usize = 4096;
/// Bytes of one rank's control line (two cache lines).
const LINE: usize = 128;
/// Where in a control line the descriptors are (after the counter and the sleepers' count).
const DESC_AT: usize = 64;
const MAGIC: u64 = u64::from_le_bytes(*b"BDDSHM01");
/// The largest half a rank's slot has, and the most the whole segment's slots hold.
const CHUNK_MAX: usize = 1 << 20;
const SLOTS_MAX: usize = 64 << 20;
/// The smallest half (a reduce-scatter puts a piece of every block in one).
const CHUNK_MIN: usize = 64 << 10;

/// How big each half of a rank's slot is for `world` ranks: 1 MiB, less when the slots would
/// pass 64 MiB together, at least 64 KiB and 64 bytes per rank.
pub(crate) fn chunk_for(world: usize) -> usize {
    let fair = SLOTS_MAX / (2 * world.max(1));
    let chunk = fair.clamp(CHUNK_MIN, CHUNK_MAX).max(64 * world);
    chunk / 64 * 64
}

/// The segment's size for `world` ranks with halves of `chunk` bytes.
pub(crate) fn segment_len(world: usize, chunk: usize) -> usize {
    data_at(world) + world * 2 * chunk
}

fn data_at(world: usize) -> usize {
    (HEADER + world * LINE).next_multiple_of(4096)
}

/// Which side of a chunk's sync a collective's step is on.
#[derive(Debug, Clone, Copy)]
enum Phase {
    /// Before: this rank writes its half.
    Write,
    /// After: this rank reads the others' halves.
    Read,
}

/// What a reduction does after the last combine: divide by the world for a mean.
fn finish(op: ReduceOp, world: usize) -> Finish {
    match op {
        ReduceOp::Mean => Finish::DivideBy(world as u32),
        _ => Finish::None,
    }
}

/// Why a shared-memory collective stopped.
#[derive(Debug)]
pub(crate) enum ShmError {
    /// The group's TCP link to the rank at this place closed or failed.
    Link(usize, io::Error),
    /// The deadline passed while waiting for the rank at this place.
    Timeout(usize),
    /// The rank at this place runs another collective.
    Mismatch(usize, CollectiveSeq, CollectiveDesc),
    /// The rank at this place wrote a descriptor that does not decode.
    Protocol(usize, WireError),
    /// The group was aborted from outside while this rank waited.
    Aborted,
}

/// What a wait looks at besides the counters.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Watch<'a> {
    pub deadline: Instant,
    pub abort: &'a AtomicBool,
    pub spin: Duration,
    /// The group's TCP links: the ring's and recursive doubling's, with the place at
    /// the other end.
    pub links: &'a [(&'a TcpStream, usize)],
    /// Whether bytes may arrive on those links while this rank waits here (a [`Hierarchy`]'s
    /// links carry its other collectives): then they say only that the peer lives.
    pub busy: bool,
}

/// The shared memory a group uses.
#[derive(Debug)]
pub(crate) enum Segment {
    /// Every rank is on this host: every collective runs in the segment.
    Whole(Shm),
    /// The ranks are spread over several hosts, as many on each.
    PerHost(Hierarchy),
}

/// A group spread over several hosts with as many ranks on each: this host's segment and this
/// rank's ring across hosts (Note [Hierarchical all-reduce]).
#[derive(Debug)]
pub(crate) struct Hierarchy {
    /// The segment of this host's ranks (its places are their local indices).
    pub shm: Shm,
    /// The ring of this rank's local index across hosts (its places are the hosts).
    pub cross: Ring,
    /// The group places of this host's ranks, by local index.
    pub local: Vec<usize>,
    /// The group places of the ranks on `cross`, by host.
    pub across: Vec<usize>,
    /// This rank's host (its place on `cross`).
    pub host: usize,
}

/// Bytes `range` of `part` (a part's own offsets), clipped to the part.
fn clip(part: &Range<usize>, range: &Range<usize>) -> Range<usize> {
    (part.start + range.start).min(part.end)..(part.start + range.end).min(part.end)
}

/// This rank's view of the segment.
#[derive(Debug)]
pub(crate) struct Shm {
    map: Mapping,
    /// The segment's memory file, which [`Shm::allocate`] extends.
    file: OwnedFd,
    place: usize,
    world: usize,
    chunk: usize,
    /// This rank's syncs so far (what its counter holds).
    count: u32,
    /// Chunks moved so far (the next one's half is its parity).
    chunks: u64,
}

impl Shm {
    /// Takes a mapping of a segment laid out for `world` ranks (checked by `setup.rs`).
    fn new((map, file): (Mapping, OwnedFd), place: usize, world: usize, chunk: usize) -> Self {
        debug_assert!(map.len() >= segment_len(world, chunk));
        Self {
            map,
            file,
            place,
            world,
            chunk,
            count: 0,
            chunks: 0,
        }
    }

    /// This rank's place in the segment.
    pub(crate) fn place(&self) -> usize {
        self.place
    }

    /// How many ranks share the segment.
    pub(crate) fn world(&self) -> usize {
        self.world
    }

    /// Writes the header of a fresh segment.
    fn init(map: &Mapping, world: usize, chunk: usize) {
        let base = map.base();
        // SAFETY: the header's first 16 bytes are in the mapping (at least one page), aligned,
        // and no other process maps it yet.
        unsafe {
            base.cast::<u64>().write(MAGIC);
            base.add(8).cast::<u32>().write(world as u32);
            base.add(12).cast::<u32>().write(chunk as u32);
        }
    }

    /// Reads a segment's header: its world and chunk, or `None` when it is no segment.
    fn read_header(map: &Mapping) -> Option<(usize, usize)> {
        let base = map.base();
        if map.len() < HEADER {
            return None;
        }
        // SAFETY: the first 16 bytes are mapped and aligned; the creator wrote them before
        // handing the segment over and never writes them again.
        let (magic, world, chunk) = unsafe {
            (
                base.cast::<u64>().read(),
                base.add(8).cast::<u32>().read() as usize,
                base.add(12).cast::<u32>().read() as usize,
            )
        };
        (magic == MAGIC && world > 0 && map.len() >= segment_len(world, chunk))
            .then_some((world, chunk))
    }

    fn line(&self, place: usize) -> *mut u8 {
        // SAFETY: `place < world`, so the line is inside the control area.
        unsafe { self.map.base().add(HEADER + place * LINE) }
    }

    fn counter(&self, place: usize) -> &AtomicU32 {
        // SAFETY: the first word of a control line: aligned, inside the mapping for its life,
        // and only ever accessed atomically by every process.
        unsafe { &*self.line(place).cast::<AtomicU32>() }
    }

    fn sleepers(&self, place: usize) -> &AtomicU32 {
        // SAFETY: as `counter`, the line's second word.
        unsafe { &*self.line(place).add(4).cast::<AtomicU32>() }
    }

    /// Half `half` of `place`'s slot.
    fn half(&self, place: usize, half: usize) -> *mut u8 {
        let at = data_at(self.world) + (2 * place + half) * self.chunk;
        // SAFETY: `place < world` and `half < 2`: inside the slots.
        unsafe { self.map.base().add(at) }
    }

    /// The half the next chunk uses.
    fn next_half(&mut self) -> usize {
        let h = (self.chunks % 2) as usize;
        self.chunks += 1;
        h
    }

    /// Bytes `range` of half `half` of this rank's slot, to write.
    fn mine(&mut self, half: usize, range: std::ops::Range<usize>) -> &mut [u8] {
        debug_assert!(range.end <= self.chunk);
        // SAFETY: this rank's own slot, which only it writes; others read it only between the
        // sync that follows this write and the next (Note [Shared-memory collectives]), during
        // which this rank does not write it. `&mut self` keeps this the only borrow here.
        unsafe {
            std::slice::from_raw_parts_mut(
                self.half(self.place, half).add(range.start),
                range.len(),
            )
        }
    }

    /// Bytes `range` of half `half` of `place`'s slot, to read after a sync that `place` passed
    /// after writing them.
    fn theirs(&self, place: usize, half: usize, range: std::ops::Range<usize>) -> &[u8] {
        debug_assert!(range.end <= self.chunk);
        // SAFETY: `place` wrote these bytes before raising its counter to the sync this rank
        // passed (acquire), and writes the half again only after this rank's next sync.
        unsafe { std::slice::from_raw_parts(self.half(place, half).add(range.start), range.len()) }
    }

    /// Records the descriptor of collective `seq`, for the others' check at its first sync.
    fn begin(&self, seq: CollectiveSeq, desc: &CollectiveDesc) {
        let h = header::encode(seq, desc);
        let at = DESC_AT + (seq.0 % 2) as usize * header::LEN;
        // SAFETY: inside this rank's control line; read by others only after this rank's next
        // sync, and written again only for collective seq + 2, after a sync every rank passes
        // after reading this one.
        unsafe {
            std::ptr::copy_nonoverlapping(h.as_ptr(), self.line(self.place).add(at), h.len());
        }
    }

    /// Checks every other rank's descriptor of collective `seq` against `desc`.
    fn check(&self, seq: CollectiveSeq, desc: &CollectiveDesc) -> Result<(), ShmError> {
        let at = DESC_AT + (seq.0 % 2) as usize * header::LEN;
        for q in (0..self.world).filter(|&q| q != self.place) {
            let mut h = [0u8; header::LEN];
            // SAFETY: `q` wrote it before the sync just passed (see `begin`).
            unsafe {
                std::ptr::copy_nonoverlapping(self.line(q).add(at), h.as_mut_ptr(), h.len());
            }
            let (their_seq, theirs) = header::decode(&h).map_err(|e| ShmError::Protocol(q, e))?;
            if their_seq != seq || theirs != *desc {
                return Err(ShmError::Mismatch(q, their_seq, theirs));
            }
        }
        Ok(())
    }

    /// Raises this rank's counter and waits until every other rank's reached it.
    fn sync(&mut self, watch: &Watch<'_>) -> Result<(), ShmError> {
        self.count = self.count.wrapping_add(1);
        let me = self.counter(self.place);
        me.store(self.count, Ordering::SeqCst);
        if self.sleepers(self.place).load(Ordering::SeqCst) > 0 {
            shared::wake(me);
        }
        let target = self.count;
        let reached = |v: u32| (v.wrapping_sub(target) as i32) >= 0;
        let started = Instant::now();
        for q in (0..self.world).filter(|&q| q != self.place) {
            let word = self.counter(q);
            let mut spins = 0u32;
            loop {
                let v = word.load(Ordering::Acquire);
                if reached(v) {
                    break;
                }
                spins = spins.wrapping_add(1);
                if !spins.is_multiple_of(64) {
                    std::hint::spin_loop();
                    continue;
                }
                if watch.abort.load(Ordering::Relaxed) {
                    return Err(ShmError::Aborted);
                }
                let now = Instant::now();
                if now.duration_since(started) < watch.spin {
                    continue;
                }
                let failed = if now >= watch.deadline {
                    Err(ShmError::Timeout(q))
                } else {
                    look_at_links(watch.links, watch.busy)
                };
                if let Err(e) = failed {
                    // A peer raises its counter before it can end: one that passed this sync,
                    // finished its last collective and closed its links between this rank's
                    // look at its counter and at the links has not failed (seen once, the 0.23
                    // frozen-rank-zero scenario: the last rank to the job's last all-reduce was
                    // told rank 0 had left mid-collective). A peer that did not reach the sync
                    // is the failure; the loop looks at every later peer the same way.
                    if reached(word.load(Ordering::SeqCst)) {
                        break;
                    }
                    return Err(e);
                }
                let sleepers = self.sleepers(q);
                sleepers.fetch_add(1, Ordering::SeqCst);
                let v = word.load(Ordering::SeqCst);
                if !reached(v) {
                    shared::wait(word, v, SLICE.min(watch.deadline - now));
                }
                sleepers.fetch_sub(1, Ordering::SeqCst);
            }
        }
        std::sync::atomic::fence(Ordering::Acquire);
        Ok(())
    }

    /// Runs collective `seq` over `total` bytes in chunks of at most `per` (at least one, so
    /// that an empty one still checks the descriptors): for each, `step` writes this rank's
    /// half ([`Phase::Write`]), a sync (the first also compares every rank's descriptor, unless
    /// `checked`: a later part of a collective whose first part did), then `step` reads the
    /// others' halves ([`Phase::Read`]). `step` gets the chunk's range and half.
    fn chunks(
        &mut self,
        ((seq, desc), checked): ((CollectiveSeq, &CollectiveDesc), bool),
        (total, per): (usize, usize),
        watch: &Watch<'_>,
        mut step: impl FnMut(&mut Self, Phase, Range<usize>, usize) -> Result<(), ShmError>,
    ) -> Result<(), ShmError> {
        if !checked {
            self.begin(seq, desc);
        }
        let mut first = !checked;
        let mut started = false;
        let mut start = 0;
        while !started || start < total {
            started = true;
            let range = start..start + per.min(total - start);
            let h = self.next_half();
            step(self, Phase::Write, range.clone(), h)?;
            self.sync(watch)?;
            if first {
                self.check(seq, desc)?;
                first = false;
            }
            start = range.end;
            step(self, Phase::Read, range, h)?;
        }
        Ok(())
    }

    /// All-reduces `buf` (whole elements of `dtype`) with `op`.
    pub(crate) fn all_reduce(
        &mut self,
        collective: (CollectiveSeq, &CollectiveDesc),
        buf: &mut [u8],
        (dtype, op): (DType, ReduceOp),
        watch: &Watch<'_>,
    ) -> Result<(), ShmError> {
        let elem = dtype.size();
        let per = self.chunk / elem * elem;
        let (me, world) = (self.place, self.world);
        let finish = finish(op, world);
        let mut parts = Vec::new();
        self.chunks(
            (collective, false),
            (buf.len(), per),
            watch,
            |shm, phase, range, h| {
                let chunk = &mut buf[range];
                match phase {
                    // The chunk, but for the part this rank reduces.
                    Phase::Write => {
                        parts = split(chunk.len() / elem, elem, world);
                        for (_, r) in parts.iter().enumerate().filter(|&(q, _)| q != me) {
                            shm.mine(h, r.clone()).copy_from_slice(&chunk[r.clone()]);
                        }
                    }
                    // That part reduced (this rank's value first, then the others' in rank
                    // order) and shared, then the other parts' results.
                    Phase::Read => {
                        let mine = parts[me].clone();
                        shm.fold(
                            h,
                            mine.clone(),
                            &mut chunk[mine.clone()],
                            (dtype, op, finish),
                        );
                        shm.mine(h, mine.clone()).copy_from_slice(&chunk[mine]);
                        shm.sync(watch)?;
                        for (q, r) in parts.iter().enumerate().filter(|&(q, _)| q != me) {
                            chunk[r.clone()].copy_from_slice(shm.theirs(q, h, r.clone()));
                        }
                    }
                }
                Ok(())
            },
        )
    }

    /// Combines every other rank's bytes `range` of half `h` into `acc`, in rank order, then
    /// `finish`.
    fn fold(
        &self,
        h: usize,
        range: Range<usize>,
        acc: &mut [u8],
        (dtype, op, finish): (DType, ReduceOp, Finish),
    ) {
        let others: Vec<usize> = (0..self.world).filter(|&q| q != self.place).collect();
        for (i, &q) in others.iter().enumerate() {
            let last = if i + 1 == others.len() {
                finish
            } else {
                Finish::None
            };
            combine(dtype, op, acc, self.theirs(q, h, range.clone()), last);
        }
    }

    /// Copies `root`'s `buf` to every rank.
    pub(crate) fn broadcast(
        &mut self,
        collective: (CollectiveSeq, &CollectiveDesc),
        buf: &mut [u8],
        root: usize,
        watch: &Watch<'_>,
    ) -> Result<(), ShmError> {
        let me = self.place;
        let per = self.chunk;
        self.chunks(
            (collective, false),
            (buf.len(), per),
            watch,
            |shm, phase, range, h| {
                let len = range.len();
                match phase {
                    Phase::Write if me == root => shm.mine(h, 0..len).copy_from_slice(&buf[range]),
                    Phase::Read if me != root => {
                        buf[range].copy_from_slice(shm.theirs(root, h, 0..len))
                    }
                    _ => {}
                }
                Ok(())
            },
        )
    }

    /// Concatenates every rank's block of `recv` (this rank's is in place already) into every
    /// rank's `recv`.
    pub(crate) fn all_gather(
        &mut self,
        collective: (CollectiveSeq, &CollectiveDesc),
        recv: &mut [u8],
        watch: &Watch<'_>,
    ) -> Result<(), ShmError> {
        let blocks = split(recv.len(), 1, self.world);
        self.gather_parts((collective, false), recv, &blocks, watch)
    }

    /// Copies every other rank's part of `buf` (`parts`, one per rank, of any sizes) into
    /// this rank's `buf`; `checked` as for [`Shm::chunks`].
    pub(crate) fn gather_parts(
        &mut self,
        collective: ((CollectiveSeq, &CollectiveDesc), bool),
        buf: &mut [u8],
        parts: &[Range<usize>],
        watch: &Watch<'_>,
    ) -> Result<(), ShmError> {
        let (me, world) = (self.place, self.world);
        let longest = parts.iter().map(Range::len).max().unwrap_or(0);
        let per = self.chunk;
        self.chunks(collective, (longest, per), watch, |shm, phase, range, h| {
            match phase {
                Phase::Write => {
                    let piece = clip(&parts[me], &range);
                    shm.mine(h, 0..piece.len()).copy_from_slice(&buf[piece]);
                }
                Phase::Read => {
                    for q in (0..world).filter(|&q| q != me) {
                        let piece = clip(&parts[q], &range);
                        let len = piece.len();
                        buf[piece].copy_from_slice(shm.theirs(q, h, 0..len));
                    }
                }
            }
            Ok(())
        })
    }

    /// Reduces `send` (a block per rank) with `op`; this rank's block of the result goes to
    /// `recv`.
    pub(crate) fn reduce_scatter(
        &mut self,
        collective: (CollectiveSeq, &CollectiveDesc),
        send: &[u8],
        recv: &mut [u8],
        (dtype, op): (DType, ReduceOp),
        watch: &Watch<'_>,
    ) -> Result<(), ShmError> {
        let (me, world) = (self.place, self.world);
        let blocks = split(send.len() / dtype.size(), dtype.size(), world);
        recv.copy_from_slice(&send[blocks[me].clone()]);
        let finish = finish(op, world);
        self.reduce_parts(collective, send, &blocks, recv, (dtype, op, finish), watch)
    }

    /// Reduces `src` split into `parts` (one per rank, of any sizes in whole elements) with
    /// `op`: this rank's part of the result into `acc`, which holds this rank's own values of
    /// it on entry (the others' are combined in rank order, then `finish`).
    pub(crate) fn reduce_parts(
        &mut self,
        collective: (CollectiveSeq, &CollectiveDesc),
        src: &[u8],
        parts: &[Range<usize>],
        acc: &mut [u8],
        reduce: (DType, ReduceOp, Finish),
        watch: &Watch<'_>,
    ) -> Result<(), ShmError> {
        let (me, world) = (self.place, self.world);
        let elem = reduce.0.size();
        let longest = parts.iter().map(Range::len).max().unwrap_or(0);
        // A piece of every part goes in one half.
        let per = (self.chunk / world / elem * elem).max(elem);
        self.chunks(
            (collective, false),
            (longest, per),
            watch,
            |shm, phase, range, h| {
                match phase {
                    Phase::Write => {
                        for p in (0..world).filter(|&p| p != me) {
                            let piece = clip(&parts[p], &range);
                            let at = p * per..p * per + piece.len();
                            shm.mine(h, at).copy_from_slice(&src[piece]);
                        }
                    }
                    Phase::Read => {
                        let piece = clip(&parts[me], &range);
                        let at = me * per..me * per + piece.len();
                        let start = piece.start - parts[me].start;
                        let mine = &mut acc[start..start + piece.len()];
                        shm.fold(h, at, mine, reduce);
                    }
                }
                Ok(())
            },
        )
    }

    /// Allocates `bytes` for every rank in memory they all map (collective `Allocate`, Note
    /// [Shared buckets]): place 0 extends the segment's memory file by a region per rank and
    /// says where; every rank maps the regions and says whether it could. `Ok(Err(why))` when
    /// some rank could not (every rank gets the same answer).
    pub(crate) fn allocate(
        &mut self,
        (seq, desc): (CollectiveSeq, &CollectiveDesc),
        bytes: usize,
        watch: &Watch<'_>,
    ) -> Result<Result<SharedArena, String>, ShmError> {
        let world = self.world;
        let per = bytes.max(1).next_multiple_of(shared::page_size());
        let total = per.checked_mul(world);
        self.begin(seq, desc);
        // Where the regions start, or u64::MAX and why not (an errno, 0: too large).
        let h = self.next_half();
        if self.place == 0 {
            let said = match total.map(|t| shared::grow(self.file.as_fd(), t)) {
                Some(Ok(at)) => [at as u64, 0],
                Some(Err(e)) => [u64::MAX, e.raw_os_error().unwrap_or(-1) as u64],
                None => [u64::MAX, 0],
            };
            self.mine(h, 0..16)
                .copy_from_slice(bytemuck::cast_slice(&said));
        }
        self.sync(watch)?;
        self.check(seq, desc)?;
        let mut said = [0u64; 2];
        bytemuck::cast_slice_mut(&mut said).copy_from_slice(self.theirs(0, h, 0..16));
        let mib = |b: usize| b.div_ceil(1 << 20);
        let mapped = match (said, total) {
            ([at, _], Some(total)) if at != u64::MAX => self
                .file
                .try_clone()
                .and_then(|file| {
                    let map = Mapping::map_at(self.file.as_fd(), at as usize, total)?;
                    Ok((map, file, at as usize))
                })
                .map_err(|e| format!("mapping {} MiB failed: {e}", mib(total))),
            ([_, errno], Some(total)) if errno != 0 => Err(format!(
                "the host could not reserve {} MiB of shared memory for {world} ranks' buckets \
                 ({}); free memory, raise the memory limit of the job's container or cgroup, \
                 or turn shared buckets off (DdpConfig::with_shared_buckets(false))",
                mib(total),
                io::Error::from_raw_os_error(errno as i32)
            )),
            _ => Err(format!(
                "{bytes} bytes for each of {world} ranks is too large"
            )),
        };
        // Whether this rank mapped them.
        let h = self.next_half();
        let failed = u64::from(mapped.is_err());
        self.mine(h, 0..8).copy_from_slice(&failed.to_le_bytes());
        self.sync(watch)?;
        let first_failed = (0..world).find(|&q| self.theirs(q, h, 0..8) != [0u8; 8]);
        Ok(match (mapped, first_failed) {
            (Ok((map, file, at)), None) => Ok(SharedArena {
                map,
                per,
                place: self.place,
                file,
                at,
            }),
            (Err(why), _) => Err(why),
            (Ok(_), Some(q)) => Err(format!("the rank at place {q} could not map them")),
        })
    }

    /// All-reduces bytes `at` of every rank's region of `arena` (whole elements of `dtype`)
    /// with `op`, where they lie (collective `AllReduceShared`, Note [Shared buckets]): the
    /// same chunks and parts as [`Shm::all_reduce`], and so the same bits.
    pub(crate) fn all_reduce_shared(
        &mut self,
        (seq, desc): (CollectiveSeq, &CollectiveDesc),
        arena: &SharedArena,
        at: Range<usize>,
        (dtype, op): (DType, ReduceOp),
        watch: &Watch<'_>,
    ) -> Result<(), ShmError> {
        let (me, world) = (self.place, self.world);
        let elem = dtype.size();
        let per = self.chunk / elem * elem;
        let last = finish(op, world);
        self.begin(seq, desc);
        // Every rank's values are in place.
        self.sync(watch)?;
        self.check(seq, desc)?;
        let others: Vec<usize> = (0..world).filter(|&q| q != me).collect();
        let mut start = at.start;
        while start < at.end {
            let end = (start + per).min(at.end);
            let part = split((end - start) / elem, elem, world)[me].clone();
            let part = start + part.start..start + part.end;
            // SAFETY: only this rank touches bytes `part` of any region during this
            // collective (each part has one reducer), and the others wrote their values
            // before the sync just passed.
            let acc = unsafe { arena.bytes_mut(me, part.clone()) };
            for (i, &q) in others.iter().enumerate() {
                let f = if i + 1 == others.len() {
                    last
                } else {
                    Finish::None
                };
                // SAFETY: as above; `q`'s region is another part of the mapping than `acc`.
                combine(dtype, op, acc, unsafe { arena.bytes(q, part.clone()) }, f);
            }
            for &q in &others {
                // SAFETY: as above.
                unsafe { arena.bytes_mut(q, part.clone()) }.copy_from_slice(acc);
            }
            start = end;
        }
        // Every part's result is in every region.
        self.sync(watch)
    }

    /// Returns once every rank has entered the barrier.
    pub(crate) fn barrier(
        &mut self,
        collective: (CollectiveSeq, &CollectiveDesc),
        watch: &Watch<'_>,
    ) -> Result<(), ShmError> {
        self.chunks((collective, false), (0, 1), watch, |_, _, _, _| Ok(()))
    }
}

/// Buffers in memory that every rank of a host maps (the group's shared segment extends its
/// memory file for them, Note [Shared buckets] in `grad/shared.rs`): a region of the same size
/// per rank, which only that rank writes, but during a shared all-reduce. Dropping
/// it gives this rank's region's memory back (no other rank touches it outside a shared
/// all-reduce, which this rank no longer joins).
#[derive(Debug)]
pub struct SharedArena {
    map: Mapping,
    /// Bytes of each region (a multiple of the page size).
    per: usize,
    /// This rank's region.
    place: usize,
    /// The segment's memory file, and where in it the regions start.
    file: OwnedFd,
    at: usize,
}

impl Drop for SharedArena {
    fn drop(&mut self) {
        let mine = self.at + self.place * self.per;
        if let Err(e) = shared::punch(self.file.as_fd(), mine, self.per) {
            tracing::debug!("the memory of a shared arena stays reserved: {e}");
        }
    }
}

impl SharedArena {
    /// Bytes in each rank's region.
    pub(crate) fn len(&self) -> usize {
        self.per
    }

    /// This rank's place among the regions.
    pub(crate) fn place(&self) -> usize {
        self.place
    }

    /// The start of `place`'s region.
    pub(crate) fn region(&self, place: usize) -> *mut u8 {
        assert!(
            (place + 1) * self.per <= self.map.len(),
            "region {place} is outside the arena"
        );
        // SAFETY: inside the mapping (checked above).
        unsafe { self.map.base().add(place * self.per) }
    }

    /// Bytes `range` of `place`'s region, to read.
    ///
    /// # Safety
    /// No process writes those bytes while the slice lives.
    pub(crate) unsafe fn bytes(&self, place: usize, range: Range<usize>) -> &[u8] {
        assert!(range.start <= range.end && range.end <= self.per);
        // SAFETY: inside the region (checked above); the caller rules out writers.
        unsafe { std::slice::from_raw_parts(self.region(place).add(range.start), range.len()) }
    }

    /// Bytes `range` of `place`'s region, to write.
    ///
    /// # Safety
    /// No process reads or writes those bytes while the slice lives, and no other slice of
    /// them does in this one.
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn bytes_mut(&self, place: usize, range: Range<usize>) -> &mut [u8] {
        assert!(range.start <= range.end && range.end <= self.per);
        // SAFETY: inside the region (checked above); the caller rules out every other access.
        unsafe { std::slice::from_raw_parts_mut(self.region(place).add(range.start), range.len()) }
    }
}

/// Fails when one of the group's TCP links was closed or failed (its peer died or stopped the
/// group); a link with bytes on it is a protocol failure, as nothing travels there now, unless
/// the links are `busy` (a [`Hierarchy`]'s, which carry its other collectives).
fn look_at_links(links: &[(&TcpStream, usize)], busy: bool) -> Result<(), ShmError> {
    for &(s, place) in links {
        let e = match sys::peek_state(s.as_fd()) {
            Peeked::Quiet => continue,
            Peeked::Bytes if busy => continue,
            Peeked::Closed => {
                io::Error::new(io::ErrorKind::UnexpectedEof, "the peer closed the link")
            }
            Peeked::Bytes => io::Error::new(
                io::ErrorKind::InvalidData,
                "bytes on a link that carries none while collectives run in shared memory",
            ),
            Peeked::Failed(e) => e,
        };
        return Err(ShmError::Link(place, e));
    }
    Ok(())
}
