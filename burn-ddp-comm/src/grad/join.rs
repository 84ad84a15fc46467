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
//! The Burn lines hold a [`JoinSlot`]: their synchronising calls announce through it
//! ([`JoinSlot::announce`], [`Join::step`] inside), and their `join` enters it, runs the user's
//! loop, shadows the others' calls ([`JoinSlot::shadow`], [`Join::next_shadow`]) and leaves it
//! with the rank whose model every rank loads ([`JoinSlot::leave`], [`Join::finish`]).

use std::sync::{Mutex, MutexGuard};

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
            return Err(DdpError::model_access(
                pg.rank(),
                "training with uneven inputs",
                format!(
                    "{} after every rank had run out of batches: make the synchronising calls \
                     inside the join, and none after it",
                    call.describe()
                ),
            ));
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
        return Err(DdpError::model_access(
            pg.rank(),
            "training with uneven inputs",
            format!(
                "the ranks still training make different calls: {what}. Every rank must make \
                 the same synchronising calls in the same order"
            ),
        ));
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

/// A line's uneven-input mode: this rank's [`Join`] while inside one, shared by the line's
/// synchronising calls (which [`announce`](Self::announce)) and its `join` (which
/// [`enter`](Self::enter)s, [`shadow`](Self::shadow)s and [`leave`](Self::leave)s).
#[derive(Debug, Default)]
pub struct JoinSlot(Mutex<Option<Active>>);

#[derive(Debug)]
struct Active {
    join: Join,
    /// The mean's scale announced with a synchronised backward and not yet taken
    /// ([`JoinSlot::take_scale`]), for a line that reduces gradients during backward.
    scale: Option<Option<f32>>,
}

impl JoinSlot {
    fn lock(&self) -> MutexGuard<'_, Option<Active>> {
        // A panic in a user's loop leaves the slot as it was; `leave` clears it either way.
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Enters a join on this rank (every rank must, at the same point). `api` is the line's
    /// type whose `join` and `prepare` the messages name (`"GradSync"`); `prepared`, whether
    /// the line's model was prepared.
    ///
    /// # Errors
    /// A join inside a join; a model that was not prepared.
    pub fn enter(&self, pg: &ProcessGroup, api: &str, prepared: bool) -> Result<()> {
        let mut slot = self.lock();
        let reason = if slot.is_some() {
            format!("{api}::join was called inside a join: call it once per loop")
        } else if !prepared {
            format!(
                "{api}::prepare was not called: prepare the model once, on every rank, before \
                 the join"
            )
        } else {
            *slot = Some(Active {
                join: Join::new(),
                scale: None,
            });
            return Ok(());
        };
        Err(DdpError::model_access(
            pg.rank(),
            "training with uneven inputs",
            reason,
        ))
    }

    /// Whether this rank is inside a join.
    pub fn joining(&self) -> bool {
        self.lock().is_some()
    }

    /// Inside a join, announces `call` (this rank still trains) and returns the round; `None`
    /// outside one (nothing is sent).
    ///
    /// # Errors
    /// As [`Join::step`].
    pub fn announce(&self, pg: &ProcessGroup, call: JoinCall) -> Result<Option<Round>> {
        match self.lock().as_mut() {
            Some(active) => active.join.step(pg, call).map(Some),
            None => Ok(None),
        }
    }

    /// [`announce`](Self::announce) of a synchronised backward, keeping the round's scale of a
    /// mean under `reduction` until [`take_scale`](Self::take_scale).
    ///
    /// # Errors
    /// As [`announce`](Self::announce); a backward announced while the previous one's scale
    /// was never taken: "the gradients of the previous synchronised backward" and `hint`
    /// (where they should have gone).
    pub fn announce_backward(
        &self,
        pg: &ProcessGroup,
        reduction: GradReduction,
        hint: &str,
    ) -> Result<Option<Round>> {
        let mut slot = self.lock();
        let Some(active) = slot.as_mut() else {
            return Ok(None);
        };
        let round = active.join.step(pg, JoinCall::Backward)?;
        if active.scale.replace(round.scale(reduction)).is_some() {
            return Err(DdpError::model_access(
                pg.rank(),
                "training with uneven inputs",
                format!("the gradients of the previous synchronised backward {hint}"),
            ));
        }
        Ok(Some(round))
    }

    /// The scale of a mean announced with the last synchronised backward (once; `None` if
    /// none is due or no rescaling is needed).
    pub fn take_scale(&self) -> Option<f32> {
        self.lock().as_mut().and_then(|a| a.scale.take()).flatten()
    }

    /// After this rank's loop: hands each call the ranks still training announce to `shadow`
    /// (which makes the same collectives with nothing of its own), until every rank has run
    /// out. Outside a join it returns at once.
    ///
    /// # Errors
    /// What `shadow` returns; as [`Join::next_shadow`].
    pub fn shadow(
        &self,
        pg: &ProcessGroup,
        mut shadow: impl FnMut(Round) -> Result<()>,
    ) -> Result<()> {
        loop {
            // Not locked while `shadow` runs: it makes the line's synchronising calls.
            let round = match self.lock().as_mut() {
                Some(active) => active.join.next_shadow(pg)?,
                None => return Ok(()),
            };
            match round {
                Some(round) => shadow(round)?,
                None => return Ok(()),
            }
        }
    }

    /// Leaves the join (the slot is empty afterwards, whatever `finished` is). With
    /// `finished` (this rank's loop and its [`shadow`](Self::shadow)) a success: its model,
    /// and the rank that trained longest, whose model every rank then loads
    /// (`Join::finish`).
    ///
    /// # Errors
    /// `finished`'s error (the other ranks' next collective then names this rank); the slot
    /// emptied during the join; collective failures.
    pub fn leave<M>(&self, pg: &ProcessGroup, finished: Result<M>) -> Result<(M, Rank)> {
        let active = self.lock().take();
        let model = finished?;
        let Some(active) = active else {
            return Err(DdpError::Internal {
                rank: pg.rank(),
                what: "the join's state disappeared during the join",
            });
        };
        Ok((model, active.join.finish(pg)?.authority))
    }

    /// Leaves any join without a word (a change of membership drops what belonged to the
    /// membership before).
    pub fn clear(&self) {
        self.lock().take();
    }
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

    /// The slot's whole life on 3 ranks with 3, 2 and 1 backward passes: every rank announces
    /// its own, shadows the rest, takes the scale once per backward, and leaves with rank 0 as
    /// the authority; a nested enter, an enter before prepare and a scale never taken are
    /// refused with the line's words.
    #[test]
    fn a_slot_enters_announces_shadows_and_leaves() {
        let got = on_local_ranks(3, |pg| {
            let slot = JoinSlot::default();
            let unprepared = slot.enter(&pg, "X", false).unwrap_err().to_string();
            assert!(!slot.joining() && slot.announce(&pg, JoinCall::Gradients).unwrap().is_none());
            slot.enter(&pg, "X", true).unwrap();
            let nested = slot.enter(&pg, "X", true).unwrap_err().to_string();
            let mut scales = Vec::new();
            for _ in 0..3 - pg.rank().index() {
                slot.announce_backward(&pg, GradReduction::Mean, "hint")
                    .unwrap();
                scales.push(slot.take_scale());
            }
            let mut shadowed = 0;
            let finished = slot.shadow(&pg, |round| {
                assert_eq!(round.call(), Some(JoinCall::Backward));
                shadowed += 1;
                Ok(())
            });
            let (_, authority) = slot.leave(&pg, finished).unwrap();
            assert!(!slot.joining());
            (unprepared, nested, scales, shadowed, authority)
        });
        for (r, (unprepared, nested, scales, shadowed, authority)) in got.into_iter().enumerate() {
            assert!(
                unprepared.contains("X::prepare was not called"),
                "{unprepared}"
            );
            assert!(
                nested.contains("X::join was called inside a join"),
                "{nested}"
            );
            assert_eq!(scales, [None, Some(1.5), Some(3.0)][..3 - r]);
            assert_eq!(shadowed, r);
            assert_eq!(authority, Rank(0));
        }
        let twice = on_local_ranks(1, |pg| {
            let slot = JoinSlot::default();
            slot.enter(&pg, "X", true).unwrap();
            slot.announce_backward(&pg, GradReduction::Sum, "x")
                .unwrap();
            slot.announce_backward(&pg, GradReduction::Mean, "did not go through X::complete")
                .unwrap_err()
                .to_string()
        });
        // The first scale (of a sum) is None: still pending, so the second is refused.
        assert!(
            twice[0].contains("previous synchronised backward did not go through X::complete"),
            "{}",
            twice[0]
        );
    }
}
