//! Collectives between the threads of one process (single-process, multi-device mode, and
//! cheap multi-rank tests).
//!
//! Ranks meet on a shared [`Board`]: each round every rank posts an owned contribution, the last
//! to arrive publishes the full set, and everyone reads it. Contributions are owned (`Arc`), so a
//! rank that times out or panics can leave at any moment without leaving others reading its memory.
//! An all-reduce takes two rounds: each rank reduces its own chunk (reduce-scatter), then all
//! chunks are shared (all-gather).

use crate::error::CollectiveError;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::reduce::{combine, Finish};
use super::{CollectiveDesc, CollectiveOp, Communicator, DType, ReduceOp};
use crate::comm::reduce::split;
use crate::types::{AbortRecord, CollectiveSeq, Rank, RankList, StallDiagnosis, WorldSize};
use crate::{DdpError, Result};

#[derive(Debug, Clone)]
struct Post {
    seq: CollectiveSeq,
    desc: CollectiveDesc,
    data: Arc<Vec<u8>>,
}

#[derive(Debug, Default)]
struct BoardState {
    round: u64,
    slots: Vec<Option<Post>>,
    arrived: usize,
    published: Option<Arc<Vec<Post>>>,
    failed: Option<AbortRecord>,
}

#[derive(Debug)]
struct Board {
    state: Mutex<BoardState>,
    changed: Condvar,
    world: usize,
}

impl Board {
    fn lock(&self) -> MutexGuard<'_, BoardState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn fail(&self, st: &mut BoardState, record: AbortRecord) {
        if st.failed.is_none() {
            st.failed = Some(record);
        }
        self.changed.notify_all();
    }
}

/// One rank of an in-process group. Create a whole group with [`LocalCommunicator::group`].
#[derive(Debug)]
pub struct LocalCommunicator {
    rank: Rank,
    world: WorldSize,
    board: Arc<Board>,
    seq: Mutex<u64>,
    timeout: Duration,
}

impl LocalCommunicator {
    /// One communicator per rank of a group of `world` threads.
    pub fn group(world: WorldSize, timeout: Duration) -> Vec<LocalCommunicator> {
        let board = Arc::new(Board {
            state: Mutex::new(BoardState {
                slots: vec![None; world.as_usize()],
                ..BoardState::default()
            }),
            changed: Condvar::new(),
            world: world.as_usize(),
        });
        world
            .ranks()
            .map(|rank| LocalCommunicator {
                rank,
                world,
                board: Arc::clone(&board),
                seq: Mutex::new(0),
                timeout,
            })
            .collect()
    }

    fn next_seq(&self) -> CollectiveSeq {
        let mut s = self.seq.lock().unwrap_or_else(|p| p.into_inner());
        *s += 1;
        CollectiveSeq(*s)
    }

    fn aborted(&self, record: &AbortRecord) -> DdpError {
        DdpError::Collective(CollectiveError::GroupAborted {
            rank: self.rank,
            first: Box::new(record.clone()),
        })
    }

    /// Posts `data` and returns every rank's post, in rank order, once all have posted.
    fn exchange(
        &self,
        seq: CollectiveSeq,
        desc: &CollectiveDesc,
        data: Vec<u8>,
    ) -> Result<Arc<Vec<Post>>> {
        let board = &*self.board;
        let deadline = Instant::now() + self.timeout;
        let mut st = board.lock();
        if let Some(f) = &st.failed {
            return Err(self.aborted(f));
        }
        let round = st.round;
        st.slots[self.rank.index()] = Some(Post {
            seq,
            desc: *desc,
            data: Arc::new(data),
        });
        st.arrived += 1;
        if st.arrived == board.world {
            let posts: Vec<Post> = st.slots.iter_mut().filter_map(Option::take).collect();
            st.published = Some(Arc::new(posts));
            st.arrived = 0;
            st.round += 1;
            board.changed.notify_all();
        } else {
            while st.round == round {
                if let Some(f) = &st.failed {
                    return Err(self.aborted(f));
                }
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    let waiting_for = st
                        .slots
                        .iter()
                        .position(Option::is_none)
                        .and_then(|i| Rank::try_from(i).ok())
                        .unwrap_or(self.rank);
                    let stalled: Vec<Rank> = st
                        .slots
                        .iter()
                        .enumerate()
                        .filter(|(_, s)| s.is_none())
                        .filter_map(|(i, _)| Rank::try_from(i).ok())
                        .collect();
                    let err = DdpError::Collective(CollectiveError::CollectiveTimeout {
                        rank: self.rank,
                        op: desc.op,
                        seq,
                        waited: self.timeout,
                        diagnosis: StallDiagnosis::Stalled(RankList(stalled)),
                    });
                    let record = AbortRecord {
                        reporter: self.rank,
                        culprit: Some(waiting_for),
                        collective: Some((desc.op, seq)),
                        reason: err.to_string(),
                    };
                    board.fail(&mut st, record);
                    return Err(err);
                }
                st = match board.changed.wait_timeout(st, left) {
                    Ok((g, _)) => g,
                    Err(p) => p.into_inner().0,
                };
            }
        }
        let posts = match &st.published {
            Some(p) => Arc::clone(p),
            None => {
                return Err(DdpError::Internal {
                    rank: self.rank,
                    what: "an in-process collective round completed without its contributions",
                })
            }
        };
        drop(st);
        self.check(seq, desc, &posts)?;
        Ok(posts)
    }

    /// Every rank must have posted the same collective.
    fn check(&self, seq: CollectiveSeq, desc: &CollectiveDesc, posts: &[Post]) -> Result<()> {
        for (i, p) in posts.iter().enumerate() {
            if p.seq != seq || p.desc != *desc {
                let peer = Rank::try_from(i).unwrap_or(self.rank);
                let err = DdpError::Collective(CollectiveError::CollectiveMismatch {
                    rank: self.rank,
                    peer,
                    seq,
                    their_seq: p.seq,
                    ours: *desc,
                    theirs: p.desc,
                });
                let mut st = self.board.lock();
                let record = AbortRecord {
                    reporter: self.rank,
                    culprit: None,
                    collective: Some((desc.op, seq)),
                    reason: err.to_string(),
                };
                self.board.fail(&mut st, record);
                return Err(err);
            }
        }
        Ok(())
    }
}

impl Communicator for LocalCommunicator {
    fn rank(&self) -> Rank {
        self.rank
    }

    fn world_size(&self) -> WorldSize {
        self.world
    }

    fn transport(&self) -> &'static str {
        "local"
    }

    fn all_reduce(&self, buf: &mut [u8], dtype: DType, op: ReduceOp) -> Result<()> {
        let count = buf.len() / dtype.size();
        let desc = CollectiveDesc::new(CollectiveOp::AllReduce, dtype, count).reduce(op);
        let seq = self.next_seq();
        let world = self.world.as_usize();
        let posts = self.exchange(seq, &desc, buf.to_vec())?;
        // Reduce-scatter: this rank reduces its chunk over all ranks, in rank order.
        let chunks = split(count, dtype.size(), world);
        let mine = chunks[self.rank.index()].clone();
        let mut acc = posts[0].data[mine.clone()].to_vec();
        for (i, p) in posts.iter().enumerate().skip(1) {
            let finish = if i == world - 1 && op == ReduceOp::Mean {
                Finish::DivideBy(world as u32)
            } else {
                Finish::None
            };
            combine(dtype, op, &mut acc, &p.data[mine.clone()], finish);
        }
        // All-gather of the reduced chunks.
        let seq2 = self.next_seq();
        let posts = self.exchange(seq2, &desc, acc)?;
        for (chunk, p) in chunks.iter().zip(posts.iter()) {
            buf[chunk.clone()].copy_from_slice(&p.data);
        }
        Ok(())
    }

    fn broadcast(&self, buf: &mut [u8], dtype: DType, root: Rank) -> Result<()> {
        let desc = CollectiveDesc::new(CollectiveOp::Broadcast, dtype, buf.len() / dtype.size())
            .root(root);
        let seq = self.next_seq();
        let mine = if self.rank == root {
            buf.to_vec()
        } else {
            Vec::new()
        };
        let posts = self.exchange(seq, &desc, mine)?;
        if self.rank != root {
            buf.copy_from_slice(&posts[root.index()].data);
        }
        Ok(())
    }

    fn all_gather(&self, send: &[u8], recv: &mut [u8], dtype: DType) -> Result<()> {
        let desc = CollectiveDesc::new(CollectiveOp::AllGather, dtype, send.len() / dtype.size());
        let seq = self.next_seq();
        let posts = self.exchange(seq, &desc, send.to_vec())?;
        for (dst, p) in recv.chunks_mut(send.len().max(1)).zip(posts.iter()) {
            dst.copy_from_slice(&p.data);
        }
        Ok(())
    }

    fn reduce_scatter(
        &self,
        send: &[u8],
        recv: &mut [u8],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<()> {
        let block = recv.len();
        let desc = CollectiveDesc::new(CollectiveOp::ReduceScatter, dtype, block / dtype.size())
            .reduce(op);
        let seq = self.next_seq();
        let world = self.world.as_usize();
        let posts = self.exchange(seq, &desc, send.to_vec())?;
        let mine = self.rank.index() * block..(self.rank.index() + 1) * block;
        recv.copy_from_slice(&posts[0].data[mine.clone()]);
        for (i, p) in posts.iter().enumerate().skip(1) {
            let finish = if i == world - 1 && op == ReduceOp::Mean {
                Finish::DivideBy(world as u32)
            } else {
                Finish::None
            };
            combine(dtype, op, recv, &p.data[mine.clone()], finish);
        }
        Ok(())
    }

    fn barrier(&self) -> Result<()> {
        let desc = CollectiveDesc::new(CollectiveOp::Barrier, DType::U8, 0);
        let seq = self.next_seq();
        self.exchange(seq, &desc, Vec::new()).map(|_| ())
    }

    fn abort(&self) {
        let mut st = self.board.lock();
        let record = AbortRecord {
            reporter: self.rank,
            culprit: Some(self.rank),
            collective: None,
            reason: format!("rank {} aborted the group", self.rank),
        };
        self.board.fail(&mut st, record);
    }
}

impl Drop for LocalCommunicator {
    fn drop(&mut self) {
        // A rank that goes away (its thread finished or panicked) must not leave the others
        // waiting for it until the timeout.
        let mut st = self.board.lock();
        if st.failed.is_none() && (std::thread::panicking() || st.arrived > 0) {
            let record = AbortRecord {
                reporter: self.rank,
                culprit: Some(self.rank),
                collective: None,
                reason: if std::thread::panicking() {
                    format!("rank {} panicked", self.rank)
                } else {
                    format!(
                        "rank {} left while other ranks waited in a collective",
                        self.rank
                    )
                },
            };
            self.board.fail(&mut st, record);
        }
    }
}
