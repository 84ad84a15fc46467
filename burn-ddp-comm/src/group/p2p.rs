//! Point-to-point on a process group: [`ProcessGroup::send`], [`ProcessGroup::recv`] and the
//! batched [`ProcessGroup::batch_send_recv`] (the transports are `comm/p2p.rs`).
//!
//! A receive waits with the collective deadline. Meanwhile the heartbeat watches the other
//! ranks, so a sender that died or froze is named within the heartbeat bound; a sender whose
//! connection closes is named at once (as ended normally if it left its mark of a normal end,
//! as lost otherwise); and a failure another rank published ends the wait with that report.
//! Any point-to-point failure is published as the job's abort record and aborts the job's
//! groups, so that every rank stops with the culprit's name instead of waiting.

use crate::error::CollectiveError;
use std::cell::Cell;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::ProcessGroup;
use crate::comm::p2p::{Closed, LocalP2p, Mailbox, SendError, Take, TcpP2p, SLICE};
use crate::types::{AbortRecord, CollectiveOp, CollectiveSeq, DType, Element, Rank};
use crate::{DdpError, Result};

/// How often a wait asks the store whether another rank published a failure.
const RECORD_POLL: Duration = Duration::from_millis(500);
/// How long a receiver whose sender closed its connection looks for the sender's mark of a
/// normal end (set before its connections close).
const FINISHED_WAIT: Duration = Duration::from_millis(100);

/// A group's point-to-point transport, and how many messages this rank sent to and received
/// from each rank (the numbers errors give).
#[derive(Debug)]
pub(super) struct P2p {
    kind: Kind,
    counts: Mutex<HashMap<(CollectiveOp, Rank), u64>>,
}

#[derive(Debug)]
enum Kind {
    /// A group of one: there is no one to send to.
    None,
    /// Threads of one process.
    Local(LocalP2p),
    /// Processes: this rank's endpoint.
    Tcp(Arc<TcpP2p>),
}

impl P2p {
    fn new(kind: Kind) -> Self {
        Self {
            kind,
            counts: Mutex::new(HashMap::new()),
        }
    }

    pub(super) fn none() -> Self {
        Self::new(Kind::None)
    }

    pub(super) fn local(l: LocalP2p) -> Self {
        Self::new(Kind::Local(l))
    }

    /// A group of processes' transport with this rank's endpoint open and published: a sender
    /// never waits for the receiver to reach its first point-to-point call. Messages go through
    /// shared memory when `shm` (the group's collectives do).
    pub(super) fn tcp(
        store: &Arc<crate::store::StoreClient>,
        token: &crate::config::JobToken,
        (place, size): (Rank, crate::types::WorldSize),
        tag: &str,
        same_host: &[Rank],
    ) -> Result<Self> {
        let endpoint = TcpP2p::open(
            Arc::clone(store),
            token.clone(),
            (place, size),
            tag,
            same_host,
        )?;
        Ok(Self::new(Kind::Tcp(Arc::new(endpoint))))
    }

    /// The number of the next message of `op` with `peer`.
    fn next(&self, op: CollectiveOp, peer: Rank) -> CollectiveSeq {
        let mut c = self.counts.lock().unwrap_or_else(|p| p.into_inner());
        let n = c.entry((op, peer)).or_insert(0);
        *n += 1;
        CollectiveSeq(*n)
    }

    /// Sends the following messages through shared memory (when the endpoint has it) or over
    /// TCP: the bench's comparison.
    pub(super) fn send_by_shm(&self, on: bool) {
        if let Kind::Tcp(e) = &self.kind {
            e.send_by_shm(on);
        }
    }

    pub(super) fn close(&self) {
        if let Kind::Tcp(e) = &self.kind {
            e.close();
        }
    }
}

/// A message of a batch, to one destination: bytes, element type, tag.
type Outgoing<'a> = (&'a [u8], DType, u32);

/// One transfer of [`ProcessGroup::batch_send_recv`].
#[derive(Debug)]
pub enum P2pOp<'a> {
    /// Send these bytes of elements of `dtype` to `peer` with `tag`.
    Send {
        /// The bytes.
        bytes: &'a [u8],
        /// Their element type (checked by the receiver).
        dtype: DType,
        /// The receiving rank (in this group).
        peer: Rank,
        /// The message's tag.
        tag: u32,
    },
    /// Receive `peer`'s message with `tag` into these bytes (its length and type must match).
    Recv {
        /// Where the message goes.
        bytes: &'a mut [u8],
        /// The expected element type.
        dtype: DType,
        /// The sending rank (in this group).
        peer: Rank,
        /// The message's tag.
        tag: u32,
    },
}

impl<'a> P2pOp<'a> {
    /// Sends `buf` to `peer` with `tag`.
    pub fn send<T: Element>(buf: &'a [T], peer: Rank, tag: u32) -> Self {
        P2pOp::Send {
            bytes: bytemuck::cast_slice(buf),
            dtype: T::DTYPE,
            peer,
            tag,
        }
    }

    /// Receives `peer`'s message with `tag` into `buf`.
    pub fn recv<T: Element>(buf: &'a mut [T], peer: Rank, tag: u32) -> Self {
        P2pOp::Recv {
            bytes: bytemuck::cast_slice_mut(buf),
            dtype: T::DTYPE,
            peer,
            tag,
        }
    }
}

impl ProcessGroup {
    /// Sends `buf` to rank `dst` of this group, with `tag` (PyTorch's `send`). Returns once the
    /// bytes are handed to the transport: it does not wait for the matching [`ProcessGroup::recv`],
    /// so two ranks may send to each other at the same time. Messages from one rank to another
    /// with the same tag arrive in the order they were sent.
    ///
    /// # Errors
    /// [`CollectiveError::InvalidGroupCall`] for `dst` outside the group or this rank itself;
    /// `dst` gone ([`CollectiveError::PeerLost`]), dead or frozen ([`CollectiveError::RankUnresponsive`]), a
    /// failure elsewhere ([`CollectiveError::JobAborted`]), or the collective deadline.
    pub fn send<T: Element>(&self, buf: &[T], dst: Rank, tag: u32) -> Result<()> {
        self.batch_send_recv(&mut [P2pOp::send(buf, dst, tag)])
    }

    /// Receives rank `src`'s message with `tag` into `buf` (PyTorch's `recv`): its oldest one
    /// with that tag, waiting up to the collective deadline. The message must have `buf`'s
    /// length and element type.
    ///
    /// # Errors
    /// [`CollectiveError::P2pMismatch`] when the message does not fit `buf`; `src` gone
    /// ([`CollectiveError::PeerLost`], or [`CollectiveError::PeerFinished`] if it ended normally), dead or
    /// frozen ([`CollectiveError::RankUnresponsive`], within the heartbeat bound), a failure elsewhere
    /// ([`CollectiveError::JobAborted`]), nothing within the deadline ([`CollectiveError::P2pTimeout`]).
    pub fn recv<T: Element>(&self, buf: &mut [T], src: Rank, tag: u32) -> Result<()> {
        self.batch_send_recv(&mut [P2pOp::recv(buf, src, tag)])
    }

    /// Sends `bytes` (of any length) to `dst` with `tag`; receive them with
    /// [`ProcessGroup::recv_bytes`].
    ///
    /// # Errors
    /// As [`ProcessGroup::send`].
    pub fn send_bytes(&self, bytes: &[u8], dst: Rank, tag: u32) -> Result<()> {
        self.send(bytes, dst, tag)
    }

    /// Receives `src`'s next message with `tag`, whatever its length.
    ///
    /// # Errors
    /// As [`ProcessGroup::recv`].
    pub fn recv_bytes(&self, src: Rank, tag: u32) -> Result<Vec<u8>> {
        let result = self
            .check_peer(src, "recv")
            .and_then(|()| self.receive(src, tag));
        self.scoped(result.map(|m| m.bytes).map_err(|e| self.fail_p2p(e)))
    }

    /// Runs several sends and receives together (PyTorch's `batch_isend_irecv`): the sends to
    /// different ranks go out concurrently, then the receives complete in any order of arrival.
    /// Use it where a rank both sends and receives in one step (a pipeline stage passing
    /// activations on while taking gradients back), so that no transfer waits for another.
    ///
    /// # Errors
    /// The first error of [`ProcessGroup::send`] or [`ProcessGroup::recv`].
    pub fn batch_send_recv(&self, ops: &mut [P2pOp<'_>]) -> Result<()> {
        let result = self.run_batch(ops);
        self.scoped(result.map_err(|e| self.fail_p2p(e)))
    }

    fn run_batch(&self, ops: &mut [P2pOp<'_>]) -> Result<()> {
        for op in ops.iter() {
            match op {
                P2pOp::Send { peer, .. } => self.check_peer(*peer, "send")?,
                P2pOp::Recv { peer, .. } => self.check_peer(*peer, "recv")?,
            }
        }
        // Sends, grouped by destination: one thread per destination beyond the first.
        let mut by_dst: HashMap<Rank, Vec<Outgoing<'_>>> = HashMap::new();
        for op in ops.iter() {
            if let P2pOp::Send {
                bytes,
                dtype,
                peer,
                tag,
            } = op
            {
                by_dst
                    .entry(*peer)
                    .or_default()
                    .push((&**bytes, *dtype, *tag));
            }
        }
        let send_all = |dst: Rank, msgs: &[Outgoing<'_>]| -> Result<()> {
            for &(bytes, dtype, tag) in msgs {
                self.transmit(dst, tag, dtype, bytes)?;
            }
            Ok(())
        };
        let mut dsts: Vec<_> = by_dst.into_iter().collect();
        dsts.sort_by_key(|(d, _)| *d);
        if dsts.len() <= 1 {
            for (dst, msgs) in &dsts {
                send_all(*dst, msgs)?;
            }
        } else {
            std::thread::scope(|s| {
                let handles: Vec<_> = dsts
                    .iter()
                    .map(|(dst, msgs)| s.spawn(move || send_all(*dst, msgs)))
                    .collect();
                let mut first = Ok(());
                for h in handles {
                    let r = h.join().unwrap_or_else(|_| {
                        Err(DdpError::Internal {
                            rank: self.global_rank(),
                            what: "a point-to-point send thread panicked",
                        })
                    });
                    if first.is_ok() {
                        first = r;
                    }
                }
                first
            })?;
        }
        for op in ops.iter_mut() {
            if let P2pOp::Recv {
                bytes,
                dtype,
                peer,
                tag,
            } = op
            {
                let m = self.receive(*peer, *tag)?;
                if m.bytes.len() != bytes.len() || m.dtype != *dtype {
                    return Err(DdpError::Collective(CollectiveError::P2pMismatch {
                        rank: self.global_rank(),
                        peer: self.to_global(*peer),
                        tag: *tag,
                        ours: format!("{} bytes of {}", bytes.len(), dtype),
                        theirs: format!("{} bytes of {}", m.bytes.len(), m.dtype),
                    }));
                }
                bytes.copy_from_slice(&m.bytes);
                self.recycle(m.bytes);
            }
        }
        Ok(())
    }

    /// Hands the buffer of a message copied out back to the mailbox, for the next one.
    fn recycle(&self, bytes: Vec<u8>) {
        match &self.inner().p2p.kind {
            Kind::Local(l) => l.mailbox().recycle(bytes),
            Kind::Tcp(endpoint) => endpoint.mailbox().recycle(bytes),
            Kind::None => {}
        }
    }

    fn check_peer(&self, peer: Rank, what: &'static str) -> Result<()> {
        let reason = if !self.inner().world.contains(peer) {
            format!(
                "rank {peer} is not in this group of {} ranks",
                self.inner().world
            )
        } else if peer == self.inner().rank {
            "a rank cannot send to or receive from itself".into()
        } else {
            return Ok(());
        };
        Err(DdpError::Collective(CollectiveError::InvalidGroupCall {
            rank: self.global_rank(),
            what,
            reason,
        }))
    }

    /// What ends a wait early: the heartbeat's verdict, or a failure another rank published.
    fn interrupt(
        &self,
        op: CollectiveOp,
        seq: CollectiveSeq,
        next_poll: &Cell<Instant>,
    ) -> Option<DdpError> {
        let rank = self.global_rank();
        if let Some(v) = self
            .inner()
            .heartbeat
            .as_ref()
            .and_then(|h| crate::comm::PeerWatch::verdict(&**h))
        {
            return Some(DdpError::Collective(CollectiveError::RankUnresponsive {
                rank,
                culprit: v.culprit,
                host: v.host,
                last_completed: v.last_completed,
                op,
                seq,
                what: v.what,
            }));
        }
        if Instant::now() >= next_poll.get() {
            next_poll.set(Instant::now() + RECORD_POLL);
            if let Ok(Some(record)) = self.abort_record() {
                if record.reporter != rank || record.culprit.is_some() {
                    return Some(DdpError::Collective(CollectiveError::JobAborted {
                        rank,
                        during: Some((op, seq)),
                        record,
                    }));
                }
            }
        }
        None
    }

    fn transmit(&self, dst: Rank, tag: u32, dtype: DType, bytes: &[u8]) -> Result<()> {
        let seq = self.inner().p2p.next(CollectiveOp::Send, dst);
        match &self.inner().p2p.kind {
            Kind::Local(l) => {
                l.send(dst, tag, dtype, bytes);
                Ok(())
            }
            Kind::None => Err(self.no_peers("send")),
            Kind::Tcp(endpoint) => {
                let started = Instant::now();
                let deadline = started + self.inner().timeouts.collective;
                let next_poll = Cell::new(started + RECORD_POLL);
                let _wait = self.waiting_on_peers();
                let interrupt = || self.interrupt(CollectiveOp::Send, seq, &next_poll);
                endpoint
                    .send(dst, tag, dtype, bytes, deadline, &interrupt)
                    .map(|_| ())
                    .map_err(|e| match e {
                        SendError::Interrupted(e) | SendError::Setup(e) => e,
                        SendError::Link(cause) => self.lost(dst, CollectiveOp::Send, seq, cause),
                        SendError::Timeout => DdpError::Collective(CollectiveError::P2pTimeout {
                            rank: self.global_rank(),
                            peer: self.to_global(dst),
                            tag,
                            waited: started.elapsed(),
                        }),
                    })
            }
        }
    }

    fn receive(&self, src: Rank, tag: u32) -> Result<crate::comm::p2p::Message> {
        let inner = self.inner();
        let mailbox: &Mailbox = match &inner.p2p.kind {
            Kind::Local(l) => l.mailbox(),
            Kind::None => return Err(self.no_peers("recv")),
            Kind::Tcp(endpoint) => endpoint.mailbox(),
        };
        let seq = self.inner().p2p.next(CollectiveOp::Recv, src);
        let started = Instant::now();
        let deadline = started + self.inner().timeouts.collective;
        let next_poll = Cell::new(started + RECORD_POLL);
        let _wait = self.waiting_on_peers();
        loop {
            match mailbox.take(src, tag, SLICE) {
                Take::Got(m) => return Ok(m),
                Take::Closed(Closed::Link(cause)) => {
                    return Err(self.lost(src, CollectiveOp::Recv, seq, cause))
                }
                Take::Closed(Closed::Protocol(why)) => {
                    return Err(DdpError::Collective(CollectiveError::PeerLost {
                        rank: self.global_rank(),
                        peer: self.to_global(src),
                        op: CollectiveOp::Recv,
                        seq,
                        cause: std::io::ErrorKind::InvalidData,
                    }))
                    .inspect_err(|_| {
                        tracing::error!(
                            "[rank {}] rank {} broke the point-to-point protocol: {why}",
                            self.global_rank(),
                            self.to_global(src)
                        )
                    });
                }
                Take::Empty => {
                    if let Some(e) = self.interrupt(CollectiveOp::Recv, seq, &next_poll) {
                        return Err(e);
                    }
                    if Instant::now() >= deadline {
                        return Err(DdpError::Collective(CollectiveError::P2pTimeout {
                            rank: self.global_rank(),
                            peer: self.to_global(src),
                            tag,
                            waited: started.elapsed(),
                        }));
                    }
                }
            }
        }
    }

    /// The error for a peer whose connection closed: the failure another rank published first,
    /// else a normal end if the peer left its mark, else a lost peer.
    fn lost(
        &self,
        peer: Rank,
        op: CollectiveOp,
        seq: CollectiveSeq,
        cause: std::io::ErrorKind,
    ) -> DdpError {
        let rank = self.global_rank();
        let global_peer = self.to_global(peer);
        if let Ok(Some(record)) = self.abort_record() {
            if record.reporter != rank || record.culprit.is_some() {
                return DdpError::Collective(CollectiveError::JobAborted {
                    rank,
                    during: Some((op, seq)),
                    record,
                });
            }
        }
        let finished = self.store_client().is_some_and(|s| {
            s.get_timeout(&crate::store::finished_key(global_peer), FINISHED_WAIT)
                .is_ok()
        });
        if finished {
            DdpError::Collective(CollectiveError::PeerFinished {
                rank,
                peer: global_peer,
                op,
                seq,
            })
        } else {
            DdpError::Collective(CollectiveError::PeerLost {
                rank,
                peer: global_peer,
                op,
                seq,
                cause,
            })
        }
    }

    fn no_peers(&self, what: &'static str) -> DdpError {
        DdpError::Collective(CollectiveError::InvalidGroupCall {
            rank: self.global_rank(),
            what,
            reason: "this group has one rank: there is no other rank to exchange with".into(),
        })
    }

    /// Publishes a point-to-point failure (unless it repeats another rank's, or is a bad
    /// argument) and aborts the job's groups, so that every rank stops naming the culprit.
    fn fail_p2p(&self, e: DdpError) -> DdpError {
        let culprit = match &e {
            DdpError::Collective(CollectiveError::InvalidGroupCall { .. })
            | DdpError::Collective(CollectiveError::JobAborted { .. }) => return e,
            DdpError::Collective(CollectiveError::PeerLost { peer, .. })
            | DdpError::Collective(CollectiveError::PeerFinished { peer, .. })
            | DdpError::Collective(CollectiveError::P2pTimeout { peer, .. }) => Some(*peer),
            DdpError::Collective(CollectiveError::RankUnresponsive { culprit, .. }) => {
                Some(*culprit)
            }
            _ => None,
        };
        if let Some(store) = self.store_client() {
            let _ = store.abort(AbortRecord {
                reporter: self.global_rank(),
                culprit,
                collective: None,
                reason: e.to_string(),
            });
        }
        tracing::debug!("{e}");
        self.abort();
        self.root().abort();
        e
    }

    /// The world group this group was made from.
    pub(super) fn root(&self) -> ProcessGroup {
        match &self.inner().sub {
            Some(sub) => sub.parent.root(),
            None => self.clone(),
        }
    }
}
