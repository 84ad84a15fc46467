//! Uneven inputs (PyTorch's `Join`): ranks with different numbers of batches finish together.
//!
//! Inside a join, every synchronising call of a rank that still trains starts with one small
//! all-reduce, the *announcement*: a one-hot vector saying which rank makes which call
//! ([`JoinCall`]). A rank that ran out of batches keeps announcing "nothing" and *shadows* what
//! the others announced: it joins their gradient all-reduce with zeros (and presence flags of
//! zero), or their broadcast of buffers, so their collectives complete. Every rank learns from
//! each announcement how many ranks still train, so a mean of gradients is taken over those
//! ranks only (the ranks that ran out are counted out of the average, PyTorch's
//! `divide_by_initial_world_size=False`), and the buffers are sent by the lowest rank still
//! training. When an announcement comes back empty every rank has run out; the ranks then
//! count their steps and take the model of the rank that trained longest (the lowest such), so
//! that every replica ends equal.
//!
//! The Burn lines drive this from their synchronising calls ([`Join::step`]) and from their
//! shadow loop ([`Join::next_shadow`], then [`Join::finish`]).

use crate::group::ProcessGroup;
use crate::types::{Rank, ReduceOp};
use crate::{DdpError, GradReduction, Result};

/// A synchronising call that the ranks still training make, and the ranks that ran out shadow.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum JoinCall {
    /// A backward pass whose gradients are reduced while it runs (the Burn 0.21 line's
    /// overlapped reducer).
    Backward,
    /// Gradients reduced after backward (the 0.21 line's `sync_gradients`, the 0.22 line's
    /// `GradSync::sync`).
    Gradients,
    /// Buffers broadcast from the lowest rank still training (`sync_buffers`).
    Buffers,
}

const CALLS: [JoinCall; 3] = [JoinCall::Backward, JoinCall::Gradients, JoinCall::Buffers];

impl JoinCall {
    fn index(self) -> usize {
        match self {
            JoinCall::Backward => 0,
            JoinCall::Gradients => 1,
            JoinCall::Buffers => 2,
        }
    }

    fn describe(self) -> &'static str {
        match self {
            JoinCall::Backward => "a synchronised backward",
            JoinCall::Gradients => "a gradient synchronisation after backward",
            JoinCall::Buffers => "a synchronisation of buffers",
        }
    }
}

/// One announcement, as every rank sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Round {
    /// Which ranks still train.
    active: Vec<bool>,
    /// What they call (`None`: every rank has run out).
    call: Option<JoinCall>,
}

impl Round {
    /// How many ranks still train.
    pub fn active(&self) -> usize {
        self.active.iter().filter(|a| **a).count()
    }

    /// What the ranks still training call; `None` when every rank has run out.
    pub fn call(&self) -> Option<JoinCall> {
        self.call
    }

    /// The lowest rank still training: the root of a broadcast of buffers.
    pub fn root(&self) -> Rank {
        let first = self.active.iter().position(|a| *a).unwrap_or(0);
        Rank(first as u32)
    }

    /// The factor that turns a mean over every rank (what the gradient all-reduce gives, the
    /// ranks that ran out contributing zeros) into the mean over the ranks still training:
    /// `world / active` for [`GradReduction::Mean`] when some rank ran out; `None` otherwise.
    pub fn scale(&self, reduction: GradReduction) -> Option<f32> {
        let active = self.active();
        let world = self.active.len();
        (reduction == GradReduction::Mean && active > 0 && active < world)
            .then(|| world as f32 / active as f32)
    }
}

/// The outcome of a join: how many synchronising calls each rank made, and whose model every
/// rank takes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct JoinSummary {
    /// Synchronising calls each rank made itself (not counting those it shadowed), by rank.
    pub calls: Vec<u64>,
    /// The rank that made the most (the lowest such): its model is every rank's at the end.
    pub authority: Rank,
}

/// Uneven-input mode on one rank (see the module documentation).
#[derive(Debug)]
pub struct Join {
    /// Synchronising calls this rank made itself.
    calls: u64,
    /// Calls of the others this rank shadowed.
    shadowed: u64,
    /// Set once an announcement came back empty.
    done: bool,
}

impl Default for Join {
    fn default() -> Self {
        Self::new()
    }
}

impl Join {
    /// A rank entering uneven-input mode. Every rank must enter it at the same point.
    pub fn new() -> Self {
        Self {
            calls: 0,
            shadowed: 0,
            done: false,
        }
    }

    /// For a rank that still trains, before the collectives of `call`: announces it and
    /// returns the round (how many ranks still train, the root of a broadcast, the scale of a
    /// mean).
    ///
    /// # Errors
    /// The ranks still training announced different calls (naming which rank calls what);
    /// this rank already announced that it ran out; collective failures.
    pub fn step(&mut self, pg: &ProcessGroup, call: JoinCall) -> Result<Round> {
        if self.done {
            return Err(DdpError::Model {
                rank: pg.rank(),
                what: "training with uneven inputs",
                reason: format!(
                    "{} after every rank had run out of batches: make the synchronising calls \
                     inside the join, and none after it",
                    call.describe()
                ),
            });
        }
        let round = announce(pg, Some(call))?;
        self.calls += 1;
        Ok(round)
    }

    /// For a rank that ran out of batches: waits for the next call of the ranks still training
    /// and returns it (to be shadowed), or `None` once every rank has run out.
    ///
    /// # Errors
    /// As [`Join::step`].
    pub fn next_shadow(&mut self, pg: &ProcessGroup) -> Result<Option<Round>> {
        if self.done {
            return Ok(None);
        }
        let round = announce(pg, None)?;
        if round.call.is_none() {
            self.done = true;
            return Ok(None);
        }
        self.shadowed += 1;
        Ok(Some(round))
    }

    /// After [`Join::next_shadow`] returned `None` on every rank: how many calls each rank
    /// made, and whose model every rank takes (one all-reduce; rank 0 logs it when the ranks
    /// made different numbers).
    ///
    /// # Errors
    /// Collective failures.
    pub fn finish(self, pg: &ProcessGroup) -> Result<JoinSummary> {
        let world = pg.world_size().as_usize();
        let mut calls = vec![0i64; world];
        calls[pg.rank().index()] = self.calls as i64;
        pg.all_reduce(&mut calls, ReduceOp::Sum)?;
        let calls: Vec<u64> = calls.into_iter().map(|c| c.max(0) as u64).collect();
        let most = calls.iter().copied().max().unwrap_or(0);
        let authority = calls.iter().position(|&c| c == most).unwrap_or(0);
        tracing::debug!(
            "[rank {}] join: this rank made {} synchronising calls and shadowed {}",
            pg.rank(),
            self.calls,
            self.shadowed
        );
        if calls.iter().any(|c| *c != most) && pg.is_main() {
            tracing::info!(
                "uneven inputs: synchronising calls per rank {calls:?}; every rank takes rank \
                 {authority}'s model"
            );
        }
        Ok(JoinSummary {
            calls,
            authority: Rank(authority as u32),
        })
    }
}

/// The announcement all-reduce: `call` is this rank's (`None`: it ran out).
fn announce(pg: &ProcessGroup, call: Option<JoinCall>) -> Result<Round> {
    let world = pg.world_size().as_usize();
    let rank = pg.rank().index();
    // One-hot by (call, rank): every rank learns who calls what.
    let mut v = vec![0i64; world * CALLS.len()];
    if let Some(c) = call {
        v[c.index() * world + rank] = 1;
    }
    pg.all_reduce(&mut v, ReduceOp::Sum)?;
    let callers = |c: JoinCall| -> Vec<usize> {
        (0..world)
            .filter(|&r| v[c.index() * world + r] > 0)
            .collect()
    };
    let made: Vec<(JoinCall, Vec<usize>)> = CALLS
        .iter()
        .map(|&c| (c, callers(c)))
        .filter(|(_, ranks)| !ranks.is_empty())
        .collect();
    if made.len() > 1 {
        let what = made
            .iter()
            .map(|(c, ranks)| format!("rank(s) {ranks:?} make {}", c.describe()))
            .collect::<Vec<_>>()
            .join("; ");
        return Err(DdpError::Model {
            rank: pg.rank(),
            what: "training with uneven inputs",
            reason: format!(
                "the ranks still training make different calls: {what}. Every rank must make \
                 the same synchronising calls in the same order"
            ),
        });
    }
    let mut active = vec![false; world];
    let mut which = None;
    if let Some((c, ranks)) = made.into_iter().next() {
        which = Some(c);
        for r in ranks {
            active[r] = true;
        }
    }
    Ok(Round {
        active,
        call: which,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::group::on_local_ranks;

    /// Rank r makes 3 - r gradient calls (3, 2, 1), then shadows: every rank sees the same
    /// rounds, the mean's scale follows the number still training, and rank 0 is the
    /// authority.
    #[test]
    fn rounds_count_the_ranks_still_training() {
        let seen = on_local_ranks(3, |pg| {
            let mut join = Join::new();
            let mine = 3 - pg.rank().index();
            let mut rounds = Vec::new();
            for _ in 0..mine {
                rounds.push(join.step(&pg, JoinCall::Gradients).unwrap());
            }
            while let Some(r) = join.next_shadow(&pg).unwrap() {
                rounds.push(r);
            }
            let summary = join.finish(&pg).unwrap();
            (rounds, summary)
        });
        for (rounds, summary) in &seen {
            assert_eq!(rounds, &seen[0].0);
            assert_eq!(summary.calls, [3, 2, 1]);
            assert_eq!(summary.authority, Rank(0));
        }
        let rounds = &seen[0].0;
        assert_eq!(
            rounds.iter().map(Round::active).collect::<Vec<_>>(),
            [3, 2, 1]
        );
        let mean = GradReduction::Mean;
        assert_eq!(rounds[0].scale(mean), None);
        assert_eq!(rounds[1].scale(mean), Some(1.5));
        assert_eq!(rounds[2].scale(mean), Some(3.0));
        assert_eq!(rounds[2].scale(GradReduction::Sum), None);
        assert!(rounds.iter().all(|r| r.call() == Some(JoinCall::Gradients)));
    }

    /// Rank 0 runs out first: the buffers' root moves to the lowest rank still training, and
    /// the authority is the rank that trained longest.
    #[test]
    fn the_root_and_the_authority_follow_the_ranks_still_training() {
        let seen = on_local_ranks(3, |pg| {
            let mut join = Join::new();
            let mine = [1, 3, 3][pg.rank().index()];
            let mut roots = Vec::new();
            for _ in 0..mine {
                roots.push(join.step(&pg, JoinCall::Buffers).unwrap().root());
            }
            while let Some(r) = join.next_shadow(&pg).unwrap() {
                roots.push(r.root());
            }
            (roots, join.finish(&pg).unwrap().authority)
        });
        for (roots, authority) in seen {
            assert_eq!(roots, [Rank(0), Rank(1), Rank(1)]);
            assert_eq!(authority, Rank(1));
        }
    }

    /// Ranks that announce different calls fail together, each told who calls what.
    #[test]
    fn different_calls_are_named() {
        let errors = on_local_ranks(2, |pg| {
            let call = if pg.rank() == Rank(0) {
                JoinCall::Gradients
            } else {
                JoinCall::Buffers
            };
            Join::new().step(&pg, call).unwrap_err().to_string()
        });
        for e in errors {
            assert!(
                e.contains("rank(s) [0] make a gradient synchronisation"),
                "{e}"
            );
            assert!(
                e.contains("rank(s) [1] make a synchronisation of buffers"),
                "{e}"
            );
        }
    }

    /// A call after the join's end is refused without a collective.
    #[test]
    fn a_call_after_the_end_is_refused() {
        let pg = ProcessGroup::single();
        let mut join = Join::new();
        assert_eq!(join.next_shadow(&pg).unwrap(), None);
        let e = join.step(&pg, JoinCall::Gradients).unwrap_err().to_string();
        assert!(e.contains("after every rank had run out"), "{e}");
    }
}
