//! The epoch loop of every Burn line's Learner strategy, once: where training is (a [`Cursor`]),
//! the loop over an epoch's phases ([`fit`]), the loop over one split's steps ([`run_split`]),
//! the vote at the end of an epoch ([`end_epoch`]), and, in a fault-tolerant job, the change of
//! membership between two steps ([`change`]).
//!
//! A Burn line implements two traits over its burn-train types and calls these functions:
//!
//! - [`SplitSteps`] for one split of one epoch: load a batch (and vote on it), run one step, end
//!   the split. Its training split holds burn-train's learner, loader, gradient accumulation and
//!   event processor; its validation split the model in inference mode.
//! - [`EpochDriver`] for the run ([`fit`]): start each split (a [`SplitSteps`] passed to
//!   [`run_split`]), rank 0's checkpoint and early stop at the end of an epoch, the Learner's
//!   interrupter (the vote at the end of an epoch, [`end_epoch`], is the trait's own);
//! - [`Handover`], for a fault-tolerant job ([`fit_fault_tolerant`]): the Learner's state as
//!   bytes and the model prepared anew after a change of membership.
//!
//! Every step is preceded by the ranks' vote (`vote`), so every rank steps, ends the split or
//! stops together. Progress counts every event that moves training on, on every rank alike: an
//! optimizer step, a validation step, the end of a split, the end of an epoch. Ranks with equal
//! progress are at the same place with equal state (a step whose synchronisation failed was not
//! applied anywhere it failed, and a step applied anywhere was applied with the same averaged
//! gradients), so after a change only the ranks behind need the state.

use crate::error::{JobError, MembershipError};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use super::board::MembershipBoard;
use super::files::SavedLog;
use super::vote::{self, Aside, FailureSlot, Flow, Split, Turn, Vote};
use crate::data::DataEpoch;
use crate::group::handover::{frame, move_state, saved_records, unframe, RecordSlot};
use crate::{DdpError, ProcessGroup, Rank, Recovery, Result};

/// The part of an epoch training is in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// The training split.
    Train = 0,
    /// The validation split.
    Valid = 1,
    /// Validation is over: the checkpoint, the early-stopping check and the epoch's last vote.
    End = 2,
}

/// Where training is, the same on every rank of a membership with the same progress.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cursor {
    /// The epoch, from 1.
    pub epoch: usize,
    /// Its phase.
    pub phase: Phase,
    /// Positions of the split's order (for this epoch) used so far.
    pub done: u64,
    /// burn-train's iteration count in the split.
    pub iteration: usize,
    /// Events that moved training on since the start.
    pub progress: u64,
}

impl Cursor {
    /// The start of `epoch`'s training.
    pub fn start(epoch: usize) -> Self {
        Self {
            epoch,
            phase: Phase::Train,
            done: 0,
            iteration: 0,
            progress: 0,
        }
    }

    /// The next phase (and the next epoch after the end), one event on.
    pub fn next_phase(&mut self) {
        match self.phase {
            Phase::Train => self.phase = Phase::Valid,
            Phase::Valid => self.phase = Phase::End,
            Phase::End => {
                self.phase = Phase::Train;
                self.epoch += 1;
            }
        }
        self.done = 0;
        self.iteration = 0;
        self.progress += 1;
    }

    /// The cursor as 40 bytes.
    pub fn encode(&self) -> Vec<u8> {
        [
            self.epoch as u64,
            self.phase as u64,
            self.done,
            self.iteration as u64,
            self.progress,
        ]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect()
    }

    /// `None` for anything malformed (it came over the network).
    pub fn decode(bytes: &[u8]) -> Option<Self> {
        if bytes.len() != 40 {
            return None;
        }
        let v: Vec<u64> = bytes
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().unwrap_or_default()))
            .collect();
        Some(Self {
            epoch: usize::try_from(v[0]).ok()?,
            phase: match v[1] {
                0 => Phase::Train,
                1 => Phase::Valid,
                2 => Phase::End,
                _ => return None,
            },
            done: v[2],
            iteration: usize::try_from(v[3]).ok()?,
            progress: v[4],
        })
    }

    /// The last epoch whose training and validation both ended when training is here (0 for
    /// none): what the summary of a run that stopped at this cursor counts.
    pub fn completed(&self) -> usize {
        match self.phase {
            Phase::End => self.epoch,
            Phase::Train | Phase::Valid => self.epoch.saturating_sub(1),
        }
    }

    /// For the membership line: `epoch 2, training, 3 steps in`.
    pub fn describe(&self) -> String {
        let phase = match self.phase {
            Phase::Train => "training",
            Phase::Valid => "validation",
            Phase::End => "end",
        };
        format!("epoch {}, {phase}, {} steps in", self.epoch, self.iteration)
    }
}

/// What makes the epoch loop leave a split before its end in a fault-tolerant job.
#[derive(Debug)]
pub enum Change {
    /// A collective failed because of another rank.
    Failed(DdpError),
    /// A process asks to join; every rank agreed on this step.
    Grow,
    /// This process was admitted into the running job.
    Admitted(Recovery),
}

/// How a split (or an epoch's end) ended.
#[derive(Debug)]
pub enum Ended {
    /// Its last step is done.
    Done,
    /// Training stops on every rank (the failure, if any, is recorded).
    Stop,
    /// The membership changes (fault-tolerant jobs only).
    Change(Change),
}

/// Why a step could not be taken.
#[derive(Debug)]
pub enum StepFault {
    /// An error this rank got (a collective, the session's checks): training stops, or in a
    /// fault-tolerant job the membership changes when the error is another rank's failure.
    Error(DdpError),
    /// This rank alone failed in the middle of a step (a panic, with what panicked): the group
    /// is aborted so that the others, maybe inside a collective, stop at once.
    Alone(String),
}

impl From<DdpError> for StepFault {
    fn from(e: DdpError) -> Self {
        Self::Error(e)
    }
}

/// Runs `step` on `input`: a panic in it becomes this rank's own failure
/// ([`StepFault::Alone`]: `{what} panicked: {message}`).
///
/// # Errors
/// `step` panicked.
pub fn guarded<I, O>(
    what: &str,
    input: I,
    step: impl FnOnce(I) -> O,
) -> std::result::Result<O, StepFault> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| step(input)))
        .map_err(|p| StepFault::Alone(format!("{what} panicked: {}", vote::panic_text(&*p))))
}

/// What one step did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stepped {
    /// It moved training on: an optimizer step, a validation step.
    Moved,
    /// A micro-step of gradient accumulation: no optimizer step yet.
    Accumulated,
    /// This rank had no batch for a training step (the split ends here).
    NoBatch,
}

/// What every rank knows of a step before it runs it ([`SplitSteps::step`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepAt {
    /// burn-train's iteration count in the split, from 1.
    pub iteration: usize,
    /// Every rank has a batch. In validation the last step may leave some out; in a
    /// fault-tolerant job's training split, so may the last step when every item is dealt
    /// once ([`vote::partial_steps`]): a rank without a batch then takes part in the step's
    /// collectives with no gradient (zeros, as PyTorch's `Join` with its default
    /// `divide_by_initial_world_size`), and every rank applies the same averaged step.
    pub full: bool,
    /// In a fault-tolerant job, the positions of the split's order used once this step is done
    /// (every rank's batches together, each item counted once; the same on every rank): the
    /// job's progress through the split. `None` elsewhere.
    pub done: Option<u64>,
}

impl StepAt {
    /// What a training step does with this rank's `batch`: `Some(Some(batch))` trains on it;
    /// `Some(None)`, a rank without a batch in a partial step, joins the step's
    /// synchronisation with no gradient and takes the same optimizer step; `None`, a rank
    /// without a batch in a step said to be full, takes no step ([`Stepped::NoBatch`]).
    pub fn batch<I>(&self, batch: Option<I>) -> Option<Option<I>> {
        match batch {
            Some(b) => Some(Some(b)),
            None if self.full => None,
            None => Some(None),
        }
    }
}

/// What [`SplitSteps::step`] returns: what the step did and what to report, or why it could
/// not be taken.
pub type StepResult<O> = std::result::Result<(Stepped, Option<O>), StepFault>;

/// One split of one epoch, as a Burn line runs it (the loop itself is [`run_split`]).
pub trait SplitSteps {
    /// Takes this rank's next batch (kept for [`step`](Self::step)) and returns this rank's vote
    /// about it (a batch, none left, a stop asked for, a failure while loading it) and how many
    /// positions of the split's order it used (a fault-tolerant job's cursor counts them).
    fn load(&mut self) -> (Vote, u64);

    /// What a step hands to [`report`](Self::report): its output item, progress and
    /// iteration.
    type Out;

    /// Runs the step on the batch loaded. This rank may have none while others do (`at.full`
    /// false: validation's last step, a fault-tolerant training split's partial last step);
    /// it still takes part in the step's collectives. Returns what it did and what to report
    /// (every rank reports: the report gathers the outputs).
    ///
    /// # Errors
    /// The step could not be taken: [`StepFault`].
    fn step(&mut self, at: StepAt) -> StepResult<Self::Out>;

    /// After the step: its outputs gathered for the metrics of the whole job. A training step's
    /// change of state counts (the cursor moves on) before this; a validation step's after.
    ///
    /// # Errors
    /// The gather failed.
    fn report(&mut self, out: Self::Out) -> Result<()>;

    /// After the split's last step (the rest of an accumulation, rank 0's buffers).
    ///
    /// # Errors
    /// What could not be done: [`StepFault`].
    fn finish(&mut self) -> std::result::Result<(), StepFault> {
        Ok(())
    }

    /// Whether this rank saw a process asking to join (a fault-tolerant training split).
    fn asks_join(&self) -> bool {
        false
    }

    /// Whether a micro-step's gradients are pending (a join waits for the optimizer step).
    fn mid_accumulation(&self) -> bool {
        false
    }

    /// Stops this rank's training with `message` (the Learner's interrupter).
    fn interrupt(&self, message: &str);
}

/// Where a split runs.
#[derive(Debug)]
pub struct SplitAt<'a> {
    /// The group that votes.
    pub pg: &'a ProcessGroup,
    /// Which split.
    pub split: Split,
    /// Its epoch.
    pub epoch: usize,
    /// Where this rank's failure is recorded.
    pub failure: &'a FailureSlot,
    /// In a fault-tolerant job, where training is: the split starts at its iteration, moves it
    /// on with every step, and ends with a change of membership when the group fails or a
    /// process asks to join. `None` elsewhere: a failure stops training.
    pub cursor: Option<&'a mut Cursor>,
    /// In a fault-tolerant job, the changes of membership: the first optimizer step after one
    /// is reported ([`ChangeLog::stepped`]).
    pub changes: Option<&'a ChangeLog>,
}

/// What a step's fault does: a change of membership in a fault-tolerant job when it is a
/// failure of the group, else training stops on this rank (aborting the group when this rank
/// failed alone).
fn fault(f: StepFault, at: &SplitAt<'_>, interrupt: impl FnOnce(&str)) -> Ended {
    match f {
        StepFault::Error(e) if at.cursor.is_some() && e.is_peer_failure() => {
            Ended::Change(Change::Failed(e))
        }
        StepFault::Error(e) => {
            vote::stop_with(e, at.failure, interrupt);
            Ended::Stop
        }
        StepFault::Alone(what) => {
            vote::fail_alone(at.pg, &what, at.failure, interrupt);
            Ended::Stop
        }
    }
}

/// One split: before every step the ranks' vote, then `steps`' step and report, until the
/// split's end, a stop, or (fault-tolerant) a change of membership.
pub fn run_split<S: SplitSteps + ?Sized>(steps: &mut S, mut at: SplitAt<'_>) -> Ended {
    let ft = at.cursor.is_some();
    let mut iteration = at.cursor.as_ref().map_or(0, |c| c.iteration);
    // Positions of the epoch's order used by the micro-steps since the last optimizer step.
    let mut pending = 0u64;
    loop {
        let (vote, items) = steps.load();
        let interrupt = |m: &str| steps.interrupt(m);
        let (turn, heard) = if ft {
            let aside = Aside {
                items,
                join: steps.asks_join(),
            };
            match vote::try_turn(
                at.pg, &vote, aside, at.split, at.epoch, at.failure, interrupt,
            ) {
                Ok((Turn::Step, heard)) if heard.join && !steps.mid_accumulation() => {
                    return Ended::Change(Change::Grow)
                }
                Ok(agreed) => agreed,
                Err(e) => return fault(e.into(), &at, |m| steps.interrupt(m)),
            }
        } else {
            vote::turn(at.pg, &vote, at.split, at.epoch, at.failure, interrupt)
        };
        match turn {
            Turn::Step => {}
            Turn::End => break,
            Turn::Stop => return Ended::Stop,
        }
        let step = StepAt {
            iteration: iteration + 1,
            full: heard.every,
            done: at.cursor.as_ref().map(|c| c.done + pending + heard.items),
        };
        let (stepped, out) = match steps.step(step) {
            Ok((Stepped::NoBatch, _)) => break,
            Ok(s) => s,
            Err(f) => return fault(f, &at, |m| steps.interrupt(m)),
        };
        iteration += 1;
        pending += heard.items;
        // The first step after a change, of whichever split: how long the change took.
        if let Some(changes) = at.changes {
            changes.stepped(at.pg.rank() == Rank::ZERO, at.split);
        }
        let mut moved = stepped == Stepped::Moved;
        if at.split == Split::Training && moved {
            step_cursor(at.cursor.as_deref_mut(), &mut pending, iteration);
            moved = false;
        }
        if let Some(Err(e)) = out.map(|out| steps.report(out)) {
            return fault(e.into(), &at, |m| steps.interrupt(m));
        }
        if moved {
            step_cursor(at.cursor.as_deref_mut(), &mut pending, iteration);
        }
    }
    match steps.finish() {
        Ok(()) => Ended::Done,
        Err(f) => fault(f, &at, |m| steps.interrupt(m)),
    }
}

/// A step that moved training on, at the cursor.
fn step_cursor(cursor: Option<&mut Cursor>, pending: &mut u64, iteration: usize) {
    if let Some(c) = cursor {
        c.done += std::mem::take(pending);
        c.iteration = iteration;
        c.progress += 1;
    }
}

/// The last vote of an epoch (rank 0's `vote` says whether early stopping or a checkpoint
/// stops training, every rank's whether its interrupter was set): the next epoch, a stop, or
/// in a fault-tolerant job a change when the vote failed because of another rank.
pub fn end_epoch(
    pg: &ProcessGroup,
    vote: &Vote,
    failure: &FailureSlot,
    fault_tolerant: bool,
    interrupt: impl FnOnce(&str),
) -> Ended {
    match vote::agree(pg, vote) {
        Err(e) if fault_tolerant && e.is_peer_failure() => Ended::Change(Change::Failed(e)),
        decision => match vote::apply_decision(decision, pg.rank(), failure, interrupt) {
            Flow::Continue => Ended::Done,
            Flow::Stop => Ended::Stop,
        },
    }
}

/// The vote after the epoch loop, once rank 0's last checkpoint is written (`vote`: whether it
/// was), so that a checkpoint rank 0 could not write fails every rank. None on a rank whose
/// training failed already (every rank left the loop on the same decision, or the group was
/// aborted). In a fault-tolerant job a vote that fails because of another rank is only logged:
/// training is over, the ranks lost meanwhile no longer matter. Returns whether every rank of
/// the membership agreed, none with a failure: then the steps this rank took were the job's.
pub fn last_vote(
    pg: &ProcessGroup,
    vote: &Vote,
    failure: &FailureSlot,
    fault_tolerant: bool,
    interrupt: impl FnOnce(&str),
) -> bool {
    if failure.message().is_some() {
        return false;
    }
    match vote::agree(pg, vote) {
        Err(e) if fault_tolerant && e.is_peer_failure() => {
            tracing::warn!(
                "[rank {}] training is over; the last vote failed ({e}): not waiting for the \
                 ranks lost meanwhile",
                pg.rank()
            );
            false
        }
        decision => {
            let agreed = decision.is_ok();
            vote::apply_decision(decision, pg.rank(), failure, interrupt);
            agreed && failure.message().is_none()
        }
    }
}

/// A Burn line's Learner strategy as [`fit`] drives it.
///
/// A line implements the splits ([`train`](Self::train), [`valid`](Self::valid): a
/// [`SplitSteps`] passed to [`run_split`]), rank 0's part of the end of an epoch and its
/// Learner's interrupter; the end of an epoch's vote and a stop on an error are the core's
/// (the provided methods).
pub trait EpochDriver {
    /// The group training runs on.
    fn group(&self) -> &ProcessGroup;

    /// Where this rank's first failure is kept (the strategy's, read when training returns).
    fn failure(&self) -> &FailureSlot;

    /// The training split of `cursor`'s epoch: `run_split` over the line's [`SplitSteps`],
    /// passing `cursor` on in a fault-tolerant job.
    fn train(&mut self, cursor: &mut Cursor, fault_tolerant: bool) -> Ended;

    /// The validation split, as [`train`](Self::train).
    fn valid(&mut self, cursor: &mut Cursor, fault_tolerant: bool) -> Ended;

    /// Rank 0's part of the end of `epoch` (called there only): the Learner's checkpoint,
    /// then whether its early-stopping strategy says to stop.
    fn main_epoch_end(&mut self, epoch: usize) -> bool;

    /// Every rank's part of the end of `epoch`, before rank 0's: what takes every rank (a
    /// sharded model's checkpoint, gathered from every rank's shards). Nothing by default.
    ///
    /// # Errors
    /// It failed on this rank: the epoch's vote carries the failure to every rank.
    fn every_rank_epoch_end(&mut self, _epoch: usize) -> Result<()> {
        Ok(())
    }

    /// The epochs whose checkpoint rank 0 has written (the strategy's
    /// [`StrategyState::saved`](super::strategy::StrategyState::saved)).
    fn saved(&self) -> &SavedLog;

    /// This rank's vote when its Learner was interrupted (a quit in the dashboard, an error it
    /// holds: [`vote::interrupted`]); None when it was not.
    fn interrupted(&self) -> Option<Vote>;

    /// Tells this rank's Learner to stop, with `message` (burn-train's interrupter).
    fn interrupt(&self, message: &str);

    /// Training is over: waits for rank 0's last checkpoint write (the line's checkpointer
    /// dropped) and returns this rank's last vote, a failure when that write failed
    /// (`StrategyState::fit` takes it to every rank).
    fn close(&mut self) -> Vote;

    /// The end of `epoch`: rank 0's part ([`main_epoch_end`](Self::main_epoch_end)), then
    /// every rank's vote ([`end_epoch`]).
    fn end_epoch(&mut self, epoch: usize, fault_tolerant: bool) -> Ended {
        let mut vote = match self.every_rank_epoch_end(epoch) {
            Ok(()) => Vote::Item,
            Err(e) => Vote::Failed(e.to_string()),
        };
        if self.group().rank() == Rank::ZERO && vote == Vote::Item {
            if self.main_epoch_end(epoch) {
                vote = Vote::Stop(format!("early stopping after epoch {epoch}"));
            }
            // In a fault-tolerant job the epoch ends once its checkpoint is on disk: if rank 0
            // dies while it writes, the others are still at this epoch's end, and their new
            // rank 0 writes it again.
            if fault_tolerant {
                let limit = self.group().timeouts().collective;
                if let Err(e) = self.saved().wait(epoch, limit) {
                    vote = Vote::Failed(e);
                }
            }
        }
        if let Some(v) = self.interrupted() {
            vote = v;
        }
        end_epoch(self.group(), &vote, self.failure(), fault_tolerant, |m| {
            self.interrupt(m);
        })
    }

    /// Training stops on this rank because of `e` (a change of membership that failed).
    fn stop_with(&mut self, e: DdpError) {
        vote::stop_with(e, self.failure(), |m| self.interrupt(m));
    }
}

/// What a Burn line's Learner strategy adds to [`EpochDriver`] for a fault-tolerant job
/// ([`fit_fault_tolerant`]): the Learner's state as bytes for the ranks behind after a change
/// of membership, and the model prepared anew on the new ranks.
pub trait Handover: EpochDriver {
    /// Saves the Learner's model, optimizer and scheduler records at `epoch` into `slots`, in
    /// that order (through burn-train's checkpointer, the one way to the optimizer's and the
    /// scheduler's records). A slot left empty fails the change on this rank with a
    /// [`ModelError::Access`](crate::ModelError::Access) naming the record.
    fn save_records(&mut self, epoch: usize, slots: &[RecordSlot; 3]);

    /// Loads another rank's [`save_records`](Self::save_records): its model, optimizer and
    /// scheduler records.
    ///
    /// # Errors
    /// They are not records of this Learner.
    fn load_records(&mut self, records: [Vec<u8>; 3]) -> Result<()>;

    /// Prepares the model again on the new membership (checks, transports).
    ///
    /// # Errors
    /// What the preparation returns.
    fn reprepare(&mut self) -> Result<()>;

    /// The membership changed (`rec`), training goes on at `cursor`; the change began at
    /// `began`.
    fn changed(&mut self, rec: Recovery, cursor: &Cursor, began: Instant);
}

/// The epoch loop of a job that is not fault-tolerant, from the training of `start` to the end
/// of `epochs` (or a stop): training, validation and the end of each epoch, where a failure
/// stops training on every rank. Returns where it ended.
pub fn fit<D: EpochDriver + ?Sized>(driver: &mut D, start: usize, epochs: usize) -> Cursor {
    epoch_loop(driver, start, epochs, None, None::<OnChange<D>>)
}

/// [`fit`] in a fault-tolerant job: a failure of the group, a process asking to join, or this
/// process's `admission` into the running job changes the membership ([`change`]), and training
/// goes on from where the ranks are (no restart, no checkpoint reload).
pub fn fit_fault_tolerant<D: Handover + ?Sized>(
    driver: &mut D,
    start: usize,
    epochs: usize,
    admission: Option<Recovery>,
) -> Cursor {
    let on_change = |driver: &mut D, c: Change, cursor: &mut Cursor| {
        let began = Instant::now();
        let rec = change(driver, c, cursor)?;
        driver.changed(rec, cursor, began);
        Ok(())
    };
    epoch_loop(
        driver,
        start,
        epochs,
        admission.map(Change::Admitted),
        Some(on_change),
    )
}

/// What a fault-tolerant loop does with a change of membership.
type OnChange<D> = fn(&mut D, Change, &mut Cursor) -> Result<()>;

/// The loop of [`fit`] and [`fit_fault_tolerant`]: the job is fault-tolerant when it has
/// `on_change`.
fn epoch_loop<D: EpochDriver + ?Sized>(
    driver: &mut D,
    start: usize,
    epochs: usize,
    mut pending: Option<Change>,
    mut on_change: Option<impl FnMut(&mut D, Change, &mut Cursor) -> Result<()>>,
) -> Cursor {
    let fault_tolerant = on_change.is_some();
    let mut cursor = Cursor::start(start);
    loop {
        if let (Some(c), Some(on_change)) = (pending.take(), on_change.as_mut()) {
            if let Err(e) = on_change(driver, c, &mut cursor) {
                driver.stop_with(e);
                break;
            }
        }
        if cursor.epoch > epochs {
            break;
        }
        let ended = match cursor.phase {
            Phase::Train => driver.train(&mut cursor, fault_tolerant),
            Phase::Valid => driver.valid(&mut cursor, fault_tolerant),
            Phase::End => driver.end_epoch(cursor.epoch, fault_tolerant),
        };
        match ended {
            Ended::Done => cursor.next_phase(),
            Ended::Stop => break,
            Ended::Change(c) if fault_tolerant => pending = Some(c),
            Ended::Change(c) => {
                // `run_split` and `end_epoch` change the membership only when told the job is
                // fault-tolerant; a driver that returns a change anyway stops training.
                let rank = driver.group().rank();
                driver.stop_with(DdpError::Job(JobError::TrainingFailed {
                    rank,
                    culprit: rank,
                    reason: format!(
                        "a change of membership ({c:?}) in a job that is not fault-tolerant"
                    ),
                }));
                break;
            }
        }
    }
    cursor
}

/// A change of membership: agree on the next one (again if it fails meanwhile), move the state
/// and the cursor from the rank with the most progress to the ranks behind, prepare the model
/// on the new ranks.
///
/// # Errors
/// The group could not agree, or this rank could not take the state or prepare the model.
pub fn change<D: Handover + ?Sized>(
    driver: &mut D,
    mut change: Change,
    cursor: &mut Cursor,
) -> Result<Recovery> {
    let pg = driver.group().clone();
    loop {
        let agreed = match change {
            Change::Failed(ref e) => pg.recover(e, Some(cursor.progress)),
            Change::Grow => pg.grow(Some(cursor.progress)),
            Change::Admitted(ref rec) => Ok(rec.clone()),
        };
        let rec = match agreed {
            Ok(rec) => rec,
            Err(DdpError::Membership(MembershipError::Excluded { .. })) => pg.rejoin()?,
            Err(e) => return Err(e),
        };
        let moved = move_state(&pg, &rec, || {
            let slots: [RecordSlot; 3] = Default::default();
            driver.save_records(cursor.epoch, &slots);
            let [m, o, s] = saved_records(&slots, pg.rank())?;
            Ok(frame(&[&cursor.encode(), &m, &o, &s]))
        })
        .and_then(|got| match got {
            Some(bytes) => take_state(driver, &bytes, cursor, pg.rank()).map(|()| {
                tracing::info!(
                    "[rank {}] took the Learner's state from rank {} ({})",
                    pg.rank(),
                    rec.source,
                    cursor.describe()
                );
            }),
            None => Ok(()),
        })
        .and_then(|()| driver.reprepare());
        match moved {
            Ok(()) => return Ok(rec),
            Err(e) if e.is_peer_failure() => {
                tracing::warn!(
                    "[rank {}] the change of membership failed ({e}); agreeing again",
                    pg.rank()
                );
                change = Change::Failed(e);
            }
            Err(e) => return Err(e),
        }
    }
}

/// Loads a state framed by [`change`]'s source: its cursor and the Learner's three records.
fn take_state<D: Handover + ?Sized>(
    driver: &mut D,
    bytes: &[u8],
    cursor: &mut Cursor,
    rank: crate::Rank,
) -> Result<()> {
    let bad =
        |why| DdpError::model_access(rank, "taking the Learner's state from the source rank", why);
    let [at, m, o, s] =
        unframe(bytes).ok_or_else(|| bad("the bytes received are not a framed state"))?;
    let at = Cursor::decode(&at).ok_or_else(|| bad("no training position"))?;
    driver.load_records([m, o, s])?;
    *cursor = at;
    Ok(())
}

/// Every sampler at `cursor`'s epoch, dealing the rest of it over `pg`'s current membership
/// (a fault-tolerant job, before each split and after a change): every item once, the
/// training split's last step partial ([`vote::partial_steps`]), unless the model has layers whose
/// forward pass runs collectives, whose shards are padded to even ones.
///
/// # Errors
/// A sampler that cannot be dealt again ([`DataEpoch::reshard`]).
pub fn deal(samplers: &[Arc<dyn DataEpoch>], pg: &ProcessGroup, cursor: &Cursor) -> Result<()> {
    let (rank, world) = (pg.rank(), pg.world_size());
    let start = usize::try_from(cursor.done).unwrap_or(usize::MAX);
    let once = vote::partial_steps();
    for s in samplers {
        s.set_every_item_once(once);
        s.set_epoch(cursor.epoch as u64);
        s.reshard(rank, world, start)?;
    }
    Ok(())
}

/// The changes of membership a strategy went through (shared by its clones), and when the last
/// began, until its first optimizer step: rank 0 says both.
#[derive(Debug, Clone, Default)]
pub struct ChangeLog(Arc<Mutex<Changes>>);

#[derive(Debug, Default)]
struct Changes {
    all: Vec<Recovery>,
    /// The membership epoch of the last change and when it began, until its first step.
    first_step: Option<(u64, Instant)>,
}

impl ChangeLog {
    fn lock(&self) -> std::sync::MutexGuard<'_, Changes> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The membership changed (`rec`, begun at `began`); training goes on at `cursor`. The
    /// board shows it on rank 0's dashboard; rank 0 (`main`) prints it too.
    pub fn changed(
        &self,
        rec: Recovery,
        cursor: &Cursor,
        began: Instant,
        board: &MembershipBoard,
        main: bool,
    ) {
        board.changed(&rec, &cursor.describe());
        if main {
            // The dashboard of this mode is the progress lines, on rank 0.
            println!("[membership] {} (at {})", rec.summary(), cursor.describe());
        }
        let mut changes = self.lock();
        changes.first_step = Some((rec.epoch, began));
        changes.all.push(rec);
    }

    /// A step of `split` was taken: the first after a change, rank 0 (`main`) says how long
    /// the change took (to the end of that step: a validation step when the change came
    /// during validation).
    pub fn stepped(&self, main: bool, split: Split) {
        let first = self.lock().first_step.take();
        if let (Some((membership, since)), true) = (first, main) {
            println!(
                "[membership] the first step of membership epoch {membership} is done (a \
                 {split} step), {} ms after the change began",
                since.elapsed().as_millis()
            );
        }
    }

    /// Every change so far, oldest first.
    pub fn changes(&self) -> Vec<Recovery> {
        self.lock().all.clone()
    }
}

#[cfg(test)]
mod tests;
