//! A custom training loop in a fault-tolerant job (`burn-ddp run --fault-tolerant`):
//! [`LoopState`], what the loop carries across changes of membership, and the three calls that
//! carry it ([`LoopState::start`], [`LoopState::step_boundary`], [`LoopState::recover`]) over
//! a line's [`LoopSync`] (its gradient sync: prepare, and the model's and optimizer's records
//! as bytes).
//!
//! The group agrees on the next membership (`ProcessGroup::recover`, `grow`, `rejoin`, a
//! joining process's admission); then the rank with the most optimizer steps sends its state
//! to the ranks behind it (point to point, only to them: `group::handover::move_state`), and
//! every rank prepares its sync again on the new membership. A step that failed is dropped
//! whole: no optimizer step was taken on a rank whose synchronisation failed, so the ranks
//! that recover at equal progress hold equal replicas.

use crate::error::MembershipError;
use crate::group::handover::{frame, move_state, unframe};
use crate::group::{ProcessGroup, Recovery};
use crate::types::ReduceOp;
use crate::{DdpError, Result};

/// What a Burn line gives for a custom loop's state to cross a change of membership: its
/// gradient sync's group and preparation, and the model's and optimizer's records as bytes.
pub trait LoopSync<M, O> {
    /// The fault-tolerant group the sync runs on.
    fn group(&self) -> &ProcessGroup;

    /// Prepares `model` for a job that starts: checked across ranks, rank 0's weights loaded
    /// everywhere (the line's `prepare`).
    ///
    /// # Errors
    /// As the line's `prepare`.
    fn prepare(&mut self, model: M) -> Result<M>;

    /// Prepares `model` again after a change of membership, the ranks' models equal (the
    /// line's `reprepare`: what belonged to the membership before dropped, nothing loaded).
    ///
    /// # Errors
    /// As the line's `prepare`.
    fn reprepare(&mut self, model: M) -> Result<M>;

    /// The model's and the optimizer's records as bytes, to send to the ranks behind.
    ///
    /// # Errors
    /// A record that cannot be serialised (a [`ModelError::Access`](crate::ModelError::Access)).
    fn state_bytes(&self, model: &M, optim: &O) -> Result<[Vec<u8>; 2]>;

    /// `model` and `optim` with the records `bytes` (from [`state_bytes`](Self::state_bytes)
    /// on the source rank) loaded.
    ///
    /// # Errors
    /// Records that cannot be read or do not fit (a [`ModelError::Access`](crate::ModelError::Access)).
    fn load_state(&self, model: M, optim: O, bytes: [Vec<u8>; 2]) -> Result<(M, O)>;
}

/// The state of a custom training loop that a fault-tolerant job carries across changes of
/// membership: the model, the optimizer, the number of optimizer steps taken, and any bytes of
/// the loop's own (its data position, a scheduler's state). Each Burn line makes one with its
/// sync's `loop_state` and carries it with `step_boundary` and `recover`.
#[derive(Debug, Clone)]
pub struct LoopState<M, O> {
    /// The prepared model.
    pub model: M,
    /// The optimizer.
    pub optim: O,
    /// Optimizer steps taken: the rank with the most is the source of the others' state.
    /// Count a step once its optimizer step is done (never for a step whose synchronisation
    /// failed).
    pub step: u64,
    /// Whatever else the loop must resume with (moved with the state).
    pub extra: Vec<u8>,
    /// The last change of membership (set by the call that made it; the loop re-deals its data
    /// over the new ranks when it is `Some`).
    pub changed: Option<Recovery>,
}

impl<M: Clone, O: Clone> LoopState<M, O> {
    /// A loop's state, prepared (every rank starts from rank 0's weights), or, in a process
    /// that joined a running fault-tolerant job, taken from the rank the job's state comes
    /// from.
    ///
    /// # Errors
    /// As the line's `prepare`; a joining process: the transfer's errors.
    pub fn start<S: LoopSync<M, O>>(
        sync: &mut S,
        model: M,
        optim: O,
        extra: Vec<u8>,
    ) -> Result<Self> {
        let mut state = Self {
            model,
            optim,
            step: 0,
            extra,
            changed: None,
        };
        match sync.group().take_admission() {
            Some(rec) => state.take_over(sync, rec)?,
            None => state.model = sync.prepare(state.model)?,
        }
        Ok(state)
    }

    /// At a step boundary of a fault-tolerant job: lets in the processes that asked to join
    /// (one small all-reduce, so that every rank decides at the same step), and moves the
    /// state to them. Call it first thing in every step, and nowhere else: a joining process
    /// comes to it from [`start`](Self::start), a rank that recovered from a failure from
    /// [`recover`](Self::recover). Nothing outside fault-tolerant jobs.
    ///
    /// # Errors
    /// Collective failures (recover from them with [`recover`](Self::recover)).
    pub fn step_boundary<S: LoopSync<M, O>>(&mut self, sync: &mut S) -> Result<()> {
        self.changed = None;
        let pg = sync.group().clone();
        if !pg.is_fault_tolerant() {
            return Ok(());
        }
        // After letting processes in, the boundary is asked again: the newcomers come to it
        // from their admission (`start`), as the ranks that recover from a failure come to it
        // from the failed step, so every rank's next collective is this one.
        loop {
            let mut join = [i64::from(pg.join_pending())];
            pg.all_reduce(&mut join, ReduceOp::Max)?;
            if join[0] == 0 {
                return Ok(());
            }
            let rec = match pg.grow(Some(self.step)) {
                Ok(rec) => rec,
                Err(DdpError::Membership(MembershipError::Excluded { .. })) => pg.rejoin()?,
                Err(e) => return Err(e),
            };
            self.take_over(sync, rec)?;
        }
    }

    /// After `cause` failed a step of a fault-tolerant job: agrees on the next membership with
    /// the ranks that can still reach the job's store, moves the state from the rank with the
    /// most steps to those behind it, and prepares the sync on the new ranks. The step that
    /// failed is dropped: run it again. A rank the others went on without joins again (and is
    /// then behind). Failures during the recovery start it again.
    ///
    /// # Errors
    /// `cause` itself when it is not a failure of the group ([`DdpError::is_peer_failure`]) or
    /// the group is not fault-tolerant; [`MembershipError::TooFewRanks`](crate::MembershipError::TooFewRanks); the store's errors.
    pub fn recover<S: LoopSync<M, O>>(&mut self, sync: &mut S, cause: DdpError) -> Result<()> {
        let pg = sync.group().clone();
        if !pg.is_fault_tolerant() || !cause.is_peer_failure() {
            return Err(cause);
        }
        let rec = agree(&pg, &cause, self.step)?;
        self.take_over(sync, rec)
    }

    /// The state moved from the source to the ranks behind, then the sync prepared again; a
    /// failure of the group meanwhile starts the recovery again.
    fn take_over<S: LoopSync<M, O>>(&mut self, sync: &mut S, mut rec: Recovery) -> Result<()> {
        let pg = sync.group().clone();
        loop {
            match self.clone().moved(sync, &rec) {
                Ok(mut state) => {
                    state.changed = Some(rec);
                    *self = state;
                    return Ok(());
                }
                Err(e) if e.is_peer_failure() => {
                    tracing::warn!(
                        "[rank {}] the recovery failed: {e}; agreeing again",
                        pg.rank()
                    );
                    rec = agree(&pg, &e, self.step)?;
                }
                Err(e) => return Err(e),
            }
        }
    }

    fn moved<S: LoopSync<M, O>>(self, sync: &mut S, rec: &Recovery) -> Result<Self> {
        let pg = sync.group().clone();
        let received = move_state(&pg, rec, || {
            let [model, optim] = sync.state_bytes(&self.model, &self.optim)?;
            Ok(frame(&[
                &self.step.to_le_bytes(),
                &model,
                &optim,
                &self.extra,
            ]))
        })?;
        let mut state = match received {
            None => self,
            Some(bytes) => self.loaded(sync, &pg, &bytes)?,
        };
        state.model = sync.reprepare(state.model)?;
        Ok(state)
    }

    fn loaded<S: LoopSync<M, O>>(self, sync: &S, pg: &ProcessGroup, bytes: &[u8]) -> Result<Self> {
        let rank = pg.rank();
        let bad = |why: &str| {
            DdpError::model_access(rank, "taking the state of the source rank", why.to_owned())
        };
        let [step, model, optim, extra] =
            unframe(bytes).ok_or_else(|| bad("the bytes received are not a framed state"))?;
        let step = <[u8; 8]>::try_from(step.as_slice())
            .map(u64::from_le_bytes)
            .map_err(|_| bad("no step count"))?;
        let (model, optim) = sync.load_state(self.model, self.optim, [model, optim])?;
        tracing::info!("[rank {rank}] took the state of step {step} from another rank");
        Ok(Self {
            model,
            optim,
            step,
            extra,
            changed: None,
        })
    }
}

/// The next membership after `cause`, with this rank's progress; a rank the others went on
/// without joins again.
fn agree(pg: &ProcessGroup, cause: &DdpError, step: u64) -> Result<Recovery> {
    match pg.recover(cause, Some(step)) {
        Ok(rec) => Ok(rec),
        Err(DdpError::Membership(MembershipError::Excluded { .. })) => pg.rejoin(),
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::JobError;
    use crate::group::on_local_ranks;

    /// A "model" of one number, an "optimizer" of one number; its records are their bytes.
    struct Fake {
        pg: ProcessGroup,
        prepared: u32,
    }

    impl LoopSync<f32, u64> for Fake {
        fn group(&self) -> &ProcessGroup {
            &self.pg
        }
        fn prepare(&mut self, model: f32) -> Result<f32> {
            self.prepared += 1;
            Ok(model)
        }
        fn reprepare(&mut self, model: f32) -> Result<f32> {
            self.prepared += 1;
            Ok(model)
        }
        fn state_bytes(&self, model: &f32, optim: &u64) -> Result<[Vec<u8>; 2]> {
            Ok([model.to_le_bytes().to_vec(), optim.to_le_bytes().to_vec()])
        }
        fn load_state(&self, _: f32, _: u64, [m, o]: [Vec<u8>; 2]) -> Result<(f32, u64)> {
            let fail = || DdpError::model_access(self.pg.rank(), "loading", "size");
            Ok((
                f32::from_le_bytes(m.try_into().map_err(|_| fail())?),
                u64::from_le_bytes(o.try_into().map_err(|_| fail())?),
            ))
        }
    }

    #[test]
    fn outside_a_fault_tolerant_job_the_calls_prepare_once_and_change_nothing() {
        let got = on_local_ranks(2, |pg| {
            let mut sync = Fake { pg, prepared: 0 };
            let mut state = LoopState::start(&mut sync, 1.5, 7, vec![9]).unwrap();
            state.step_boundary(&mut sync).unwrap();
            let cause = DdpError::Job(JobError::Interrupted);
            let refused = state.recover(&mut sync, cause).unwrap_err();
            (state.model, state.optim, state.step, sync.prepared, refused)
        });
        for (model, optim, step, prepared, refused) in got {
            assert_eq!((model, optim, step, prepared), (1.5, 7, 0, 1));
            assert!(
                matches!(refused, DdpError::Job(JobError::Interrupted)),
                "{refused:?}"
            );
        }
    }
}
