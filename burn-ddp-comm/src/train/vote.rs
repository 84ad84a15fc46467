//! Votes and decisions: before every step, each rank says whether it has a batch, wants to stop
//! or failed, and one small all-reduce turns those votes into the same decision on every rank,
//! so that no rank is left waiting in a collective that the others skipped.

use crate::error::JobError;
use std::sync::{Arc, Mutex};

use crate::{DdpError, ProcessGroup, Rank, ReduceOp, Result};

/// What one rank says before a step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Vote {
    /// It has a batch for this step.
    Item,
    /// Its loader is exhausted.
    NoItem,
    /// It asks every rank to stop (a quit in the dashboard, an early stop), and why.
    Stop(String),
    /// It failed (a data error, a checkpoint that could not be written), and how.
    Failed(String),
}

/// What every rank decides together from the votes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Nobody stops: whether some rank, and whether every rank, has a batch.
    Go {
        /// Some rank has a batch.
        any_item: bool,
        /// Every rank has a batch.
        all_items: bool,
    },
    /// A rank asked to stop (the first in rank order that did).
    Stop {
        /// The rank that asked.
        culprit: Rank,
        /// Its reason.
        reason: String,
    },
    /// A rank failed (the first in rank order that did; a failure wins over a stop).
    Failed {
        /// The rank that failed.
        culprit: Rank,
        /// What failed.
        reason: String,
    },
}

/// Whether a loop goes on after a decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flow {
    /// Go on.
    Continue,
    /// Stop training on this rank (every rank decided the same).
    Stop,
}

/// The message of a caught panic.
pub fn panic_text(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| String::from("(no message)"))
}

/// The tags of a reason in the gathered votes.
const STOP: u8 = b'S';
const FAILED: u8 = b'F';

/// What a rank says besides its vote, in the same all-reduce (fault-tolerant jobs): how many
/// items its batch has, and whether it saw a process asking to join.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Aside {
    /// Items of this rank's batch (0 without one).
    pub items: u64,
    /// A process asks to join ([`ProcessGroup::join_pending`]).
    pub join: bool,
}

/// What the ranks learn of each other's votes and asides.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Heard {
    /// The items of every rank's batch together: the positions of the split's order the step
    /// uses (each rank deals its share of them), the same on every rank.
    pub items: u64,
    /// Every rank has a batch.
    pub every: bool,
    /// Some rank saw a process asking to join.
    pub join: bool,
}

/// Whether a fault-tolerant training split takes a partial step — some ranks without a batch,
/// which take part with no gradient — when its ranks' shares differ by one item (every item
/// dealt once): unless this process made layers whose forward pass runs collectives
/// ([`crate::nn::collective_layers`]), which a rank without a batch cannot join; the split
/// then ends at the first rank out of batches, and its data is padded to even shards instead.
pub fn partial_steps() -> bool {
    !crate::nn::collective_layers()
}

/// One small all-reduce: every rank's vote, and what they decide together.
///
/// # Errors
/// The collective failed (it names the rank at fault).
pub fn agree(pg: &ProcessGroup, vote: &Vote) -> Result<Decision> {
    agree_with(pg, vote, None).map(|(d, _)| d)
}

/// [`agree`], with every rank's [`Aside`] in the same all-reduce (one more value per rank:
/// every rank of the job must call it alike).
///
/// # Errors
/// The collective failed (it names the rank at fault).
pub fn agree_aside(pg: &ProcessGroup, vote: &Vote, aside: Aside) -> Result<(Decision, Heard)> {
    agree_with(pg, vote, Some(aside))
}

/// [`agree`], with every rank's [`Aside`] when there is one (every rank alike): without it, the
/// five values of the votes alone, and nothing heard of batches' items.
fn agree_with(pg: &ProcessGroup, vote: &Vote, aside: Option<Aside>) -> Result<(Decision, Heard)> {
    let (has, stop, failed) = match vote {
        Vote::Item => (1, 0, 0),
        Vote::NoItem => (0, 0, 0),
        Vote::Stop(_) => (0, 1, 0),
        Vote::Failed(_) => (0, 0, 1),
    };
    // Max of (has, 1 - has, stop, failed, join, then with an aside one slot per rank for its
    // items): any rank has an item, any has none, any stops, any failed, any saw a joining
    // process, and every rank's batch.
    const SLOTS: usize = 5;
    let join = aside.is_some_and(|a| a.join);
    let mut flags = vec![has, 1 - has, stop, failed, i64::from(join)];
    if let Some(aside) = aside {
        flags.resize(SLOTS + pg.world_size().as_usize(), 0);
        flags[SLOTS + pg.rank().0 as usize] = i64::try_from(aside.items).unwrap_or(i64::MAX);
    }
    pg.all_reduce(&mut flags, ReduceOp::Max)?;
    let heard = Heard {
        items: flags[SLOTS..]
            .iter()
            .map(|&n| u64::try_from(n).unwrap_or(0))
            .fold(0u64, u64::saturating_add),
        every: flags[1] == 0,
        join: flags[4] == 1,
    };
    if flags[2] == 0 && flags[3] == 0 {
        return Ok((
            Decision::Go {
                any_item: flags[0] == 1,
                all_items: flags[1] == 0,
            },
            heard,
        ));
    }
    // Each rank's reason, tagged with its kind, so that a failure names a rank that failed
    // (not an earlier rank that only asked to stop).
    let mine = match vote {
        Vote::Stop(m) => [&[STOP][..], m.as_bytes()].concat(),
        Vote::Failed(m) => [&[FAILED][..], m.as_bytes()].concat(),
        _ => Vec::new(),
    };
    let reasons = pg.all_gather_bytes(&mine)?;
    let failed = flags[3] == 1;
    let wanted = if failed { FAILED } else { STOP };
    let (culprit, reason) = reasons
        .iter()
        .enumerate()
        .find_map(|(r, m)| match m.split_first() {
            Some((&kind, text)) if kind == wanted => Some((
                Rank::try_from(r).unwrap_or(Rank::ZERO),
                String::from_utf8_lossy(text).into_owned(),
            )),
            _ => None,
        })
        .unwrap_or((Rank::ZERO, String::from("no reason given")));
    Ok((
        if failed {
            Decision::Failed { culprit, reason }
        } else {
            Decision::Stop { culprit, reason }
        },
        heard,
    ))
}

/// What a rank does with a decision (or with the error of the collective that should have
/// made it): the message for its Learner's interrupter and the error training ends with.
#[derive(Debug)]
pub enum Outcome {
    /// Go on.
    Go,
    /// Stop without an error: the interrupter's message.
    Stop(String),
    /// Stop with an error: the interrupter's message, and the error to report.
    Fail(String, DdpError),
}

impl Outcome {
    /// The outcome on rank `me` of `decision`.
    pub fn of(decision: Result<Decision>, me: Rank) -> Self {
        match decision {
            Ok(Decision::Go { .. }) => Outcome::Go,
            Ok(Decision::Stop { culprit, reason }) => {
                tracing::info!("[rank {me}] stopping: rank {culprit} asked: {reason}");
                Outcome::Stop(format!("rank {culprit}: {reason}"))
            }
            Ok(Decision::Failed { culprit, reason }) => Outcome::Fail(
                format!("rank {culprit} failed: {reason}"),
                DdpError::Job(JobError::TrainingFailed {
                    rank: me,
                    culprit,
                    reason,
                }),
            ),
            Err(e) => Outcome::Fail(e.to_string(), e),
        }
    }
}

/// The split an epoch loop runs over, which decides when its epoch ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Split {
    /// Training: every rank steps together, so the epoch ends as soon as any rank runs out.
    Training,
    /// Validation: shards may differ by one item, so it goes on while any rank has a batch.
    Validation,
}

impl std::fmt::Display for Split {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Split::Training => "training",
            Split::Validation => "validation",
        })
    }
}

/// What every rank does at one step of an epoch loop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Turn {
    /// Run the step (in validation, this rank may have no batch while others do).
    Step,
    /// The epoch is over.
    End,
    /// Training stops on every rank (the interrupter is set; a failure is recorded).
    Stop,
}

/// One step's agreement in an epoch loop over `split`: every rank's `vote` (collective), the
/// end of the epoch when the split says so, else [`apply_decision`]; and what the ranks heard
/// of each other (no asides: whether every rank had a batch). A training rank that still had a batch when another ran out is told so with
/// a warning (its remaining batches are skipped).
pub fn turn(
    pg: &ProcessGroup,
    vote: &Vote,
    split: Split,
    epoch: usize,
    failure: &FailureSlot,
    interrupt: impl FnOnce(&str),
) -> (Turn, Heard) {
    match agree_with(pg, vote, None) {
        Ok((decision, heard)) => (
            decide_turn(pg, vote, decision, split, epoch, failure, false, interrupt),
            heard,
        ),
        Err(e) => {
            apply_decision(Err(e), pg.rank(), failure, interrupt);
            (Turn::Stop, Heard::default())
        }
    }
}

/// [`turn`] with every rank's [`Aside`], for a fault-tolerant job: a failed collective is
/// returned (the caller recovers from it) instead of stopping training, and a training split
/// whose ranks' shares differ by one item (every item dealt once) takes its partial last step
/// when [`partial_steps`] allows it, instead of ending.
///
/// # Errors
/// The vote's collective failed.
pub fn try_turn(
    pg: &ProcessGroup,
    vote: &Vote,
    aside: Aside,
    split: Split,
    epoch: usize,
    failure: &FailureSlot,
    interrupt: impl FnOnce(&str),
) -> Result<(Turn, Heard)> {
    let (decision, heard) = agree_aside(pg, vote, aside)?;
    let partial = partial_steps();
    let turn = decide_turn(
        pg, vote, decision, split, epoch, failure, partial, interrupt,
    );
    Ok((turn, heard))
}

/// `partial`: a training step may go on while some rank has a batch.
#[allow(clippy::too_many_arguments)]
fn decide_turn(
    pg: &ProcessGroup,
    vote: &Vote,
    decision: Decision,
    split: Split,
    epoch: usize,
    failure: &FailureSlot,
    partial: bool,
    interrupt: impl FnOnce(&str),
) -> Turn {
    if let Decision::Go {
        any_item,
        all_items,
    } = &decision
    {
        match split {
            Split::Training if partial && *any_item => {}
            Split::Training if !all_items => {
                if *vote == Vote::Item {
                    tracing::warn!(
                        "[rank {}] epoch {epoch}: another rank ran out of training batches \
                         first; the rest of this rank's are skipped (use a \
                         DistributedSampler so that every rank has as many)",
                        pg.rank()
                    );
                }
                return Turn::End;
            }
            Split::Validation if !any_item => return Turn::End,
            // A sharded model's forward gathers its parameters on every rank: a rank without
            // a batch cannot take part.
            Split::Validation if !all_items && crate::grad::sharded_models() => {
                if *vote == Vote::Item {
                    tracing::warn!(
                        "[rank {}] epoch {epoch}: another rank ran out of validation batches \
                         first, and a sharded (FSDP) model's forward runs on every rank \
                         together: the rest of this rank's are skipped (use a \
                         DistributedSampler, whose shards are padded to even ones)",
                        pg.rank()
                    );
                }
                return Turn::End;
            }
            _ => {}
        }
    }
    match apply_decision(Ok(decision), pg.rank(), failure, interrupt) {
        Flow::Continue => Turn::Step,
        Flow::Stop => Turn::Stop,
    }
}

/// Applies `decision` on rank `me`: a stop or a failure is passed to `interrupt` (the Learner's
/// interrupter, with its message) and a failure is recorded in `failure`.
pub fn apply_decision(
    decision: Result<Decision>,
    me: Rank,
    failure: &FailureSlot,
    interrupt: impl FnOnce(&str),
) -> Flow {
    match Outcome::of(decision, me) {
        Outcome::Go => Flow::Continue,
        Outcome::Stop(message) => {
            interrupt(&message);
            Flow::Stop
        }
        Outcome::Fail(message, e) => {
            interrupt(&message);
            failure.fail(e);
            Flow::Stop
        }
    }
}

/// The vote of a rank whose Learner was interrupted: a failure when it holds one (`failed`: an
/// error its interrupter holds, a checkpoint that could not be written), else a stop with the
/// interrupter's `message`.
pub fn interrupted(failed: Option<String>, message: Option<String>) -> Vote {
    match failed {
        Some(e) => Vote::Failed(e),
        None => Vote::Stop(message.unwrap_or_else(|| "interrupted".into())),
    }
}

/// The batch `next` loads (a data loader's next item, or its error) and this rank's vote
/// about it: a batch, none left, or a failure naming the `split` (an error or a panic while
/// loading it).
pub fn load_batch<I, E: std::fmt::Display>(
    split: &str,
    next: impl FnOnce() -> Option<std::result::Result<I, E>>,
) -> (Option<I>, Vote) {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(next)) {
        Ok(Some(Ok(item))) => (Some(item), Vote::Item),
        Ok(Some(Err(e))) => (
            None,
            Vote::Failed(format!("loading a {split} batch failed: {e}")),
        ),
        Ok(None) => (None, Vote::NoItem),
        Err(p) => {
            let why = panic_text(&*p);
            let failed = format!("loading a {split} batch panicked: {why}");
            (None, Vote::Failed(failed))
        }
    }
}

/// Stops this rank on an error it got itself (a failed collective names the rank at fault).
pub fn stop_with(e: DdpError, failure: &FailureSlot, interrupt: impl FnOnce(&str)) -> Flow {
    interrupt(&e.to_string());
    failure.fail(e);
    Flow::Stop
}

/// A failure of this rank alone, in the middle of a step (the others may be inside a
/// collective): the group is aborted so that they stop at once, naming this rank.
pub fn fail_alone(
    pg: &ProcessGroup,
    what: &str,
    failure: &FailureSlot,
    interrupt: impl FnOnce(&str),
) -> Flow {
    interrupt(what);
    failure.fail(DdpError::Job(JobError::TrainingFailed {
        rank: pg.rank(),
        culprit: pg.rank(),
        reason: what.to_owned(),
    }));
    pg.abort();
    Flow::Stop
}

/// The first error that stopped training on this rank, shared by the clones of a strategy:
/// set where training fails, taken where the program gets its result.
#[derive(Debug, Clone, Default)]
pub struct FailureSlot(Arc<Mutex<Option<DdpError>>>);

impl FailureSlot {
    /// Records `e` unless an earlier error is already recorded (logged at debug level: the
    /// error reaches the program, which reports it).
    pub fn fail(&self, e: DdpError) {
        tracing::debug!("{e}");
        let mut slot = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if slot.is_none() {
            *slot = Some(e);
        }
    }

    /// The recorded error's message, if any.
    pub fn message(&self) -> Option<String> {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .map(ToString::to_string)
    }

    /// Whether the recorded error left this process out of a fault-tolerant job (left out of
    /// a membership, not let back in, cut off from the store): what it holds of the run is
    /// not the job's, so it prints no summary of it.
    pub fn out_of_the_job(&self) -> bool {
        use crate::error::MembershipError as M;
        matches!(
            self.0.lock().unwrap_or_else(|p| p.into_inner()).as_ref(),
            Some(DdpError::Membership(
                M::Excluded { .. } | M::JoinFailed { .. } | M::StoreUnreachable { .. }
            ))
        )
    }

    /// Takes the recorded error, leaving none.
    pub fn take(&self) -> Option<DdpError> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).take()
    }

    /// What the program gets after training: the recorded error (taken), or `result`.
    ///
    /// # Errors
    /// The error that stopped training on this rank.
    pub fn or_result<T>(&self, result: T) -> crate::Result<T> {
        self.take().map_or(Ok(result), Err)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Timeouts, WorldSize};
    use std::time::Duration;

    #[test]
    fn a_loaded_batch_votes_what_the_loader_gave() {
        let ok = load_batch("train", || Some(Ok::<_, String>(7)));
        assert_eq!((ok.0, &ok.1), (Some(7), &Vote::Item));
        let none = load_batch("train", || None::<Result<u8, String>>);
        assert_eq!((none.0, &none.1), (None, &Vote::NoItem));
        let err = load_batch("valid", || Some(Err::<u8, _>("bad file")));
        assert_eq!(
            err.1,
            Vote::Failed("loading a valid batch failed: bad file".into())
        );
        let panicked = load_batch("train", || -> Option<Result<u8, String>> {
            panic!("index out of range")
        });
        assert_eq!(
            panicked.1,
            Vote::Failed("loading a train batch panicked: index out of range".into())
        );
    }

    /// Every rank's decision when rank r votes `votes(r)`, on an in-process group of `world`.
    fn decide(world: u32, votes: impl Fn(u32) -> Vote + Sync) -> Vec<Decision> {
        let groups = ProcessGroup::local(
            WorldSize::new(world).unwrap(),
            Timeouts::uniform(Duration::from_secs(20)),
        );
        std::thread::scope(|s| {
            let handles: Vec<_> = groups
                .into_iter()
                .map(|pg| {
                    let votes = &votes;
                    s.spawn(move || agree(&pg, &votes(pg.rank().0)).unwrap())
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    fn all_same(ds: &[Decision]) -> &Decision {
        assert!(
            ds.windows(2).all(|w| w[0] == w[1]),
            "ranks disagree: {ds:?}"
        );
        &ds[0]
    }

    #[test]
    fn every_rank_with_a_batch_goes_on() {
        let ds = decide(3, |_| Vote::Item);
        assert_eq!(
            all_same(&ds),
            &Decision::Go {
                any_item: true,
                all_items: true
            }
        );
    }

    #[test]
    fn a_rank_without_a_batch_is_seen_by_all() {
        let ds = decide(3, |r| if r == 2 { Vote::NoItem } else { Vote::Item });
        assert_eq!(
            all_same(&ds),
            &Decision::Go {
                any_item: true,
                all_items: false
            }
        );
        let ds = decide(2, |_| Vote::NoItem);
        assert_eq!(
            all_same(&ds),
            &Decision::Go {
                any_item: false,
                all_items: false
            }
        );
    }

    #[test]
    fn one_rank_asking_to_stop_stops_every_rank_naming_it() {
        let ds = decide(3, |r| match r {
            1 => Vote::Stop("quit from the dashboard".into()),
            _ => Vote::Item,
        });
        assert_eq!(
            all_same(&ds),
            &Decision::Stop {
                culprit: Rank(1),
                reason: "quit from the dashboard".into()
            }
        );
    }

    #[test]
    fn a_failure_wins_over_a_stop_and_names_the_failed_rank() {
        let ds = decide(4, |r| match r {
            0 => Vote::Stop("early stop".into()),
            2 => Vote::Failed("loading a batch panicked".into()),
            3 => Vote::Failed("a second failure".into()),
            _ => Vote::Item,
        });
        // The first rank that failed is named, not rank 0, which only asked to stop.
        assert_eq!(
            all_same(&ds),
            &Decision::Failed {
                culprit: Rank(2),
                reason: "loading a batch panicked".into()
            }
        );
    }

    /// Rank 2 has no batch left: training ends on every rank, validation goes on; a stop
    /// vote stops both and reaches each rank's interrupter.
    #[test]
    fn turns_end_training_when_any_rank_runs_out_and_validation_when_all_do() {
        let turns = |split: Split, votes: fn(u32) -> Vote| -> Vec<(Turn, Option<String>)> {
            crate::group::on_local_ranks(3, |pg| {
                let mut told = None;
                let slot = FailureSlot::default();
                let (t, _) = turn(&pg, &votes(pg.rank().0), split, 1, &slot, |m| {
                    told = Some(m.to_owned())
                });
                (t, told)
            })
        };
        let short = |r: u32| if r == 2 { Vote::NoItem } else { Vote::Item };
        assert!(turns(Split::Training, short)
            .iter()
            .all(|t| *t == (Turn::End, None)));
        assert!(turns(Split::Validation, short)
            .iter()
            .all(|t| *t == (Turn::Step, None)));
        assert!(turns(Split::Validation, |_| Vote::NoItem)
            .iter()
            .all(|t| *t == (Turn::End, None)));
        let stop = |r: u32| match r {
            1 => Vote::Stop("quit".into()),
            _ => Vote::Item,
        };
        for split in [Split::Training, Split::Validation] {
            assert!(turns(split, stop)
                .iter()
                .all(|t| *t == (Turn::Stop, Some("rank 1: quit".into()))));
        }
    }

    /// In a fault-tolerant training split whose shares differ by one item (every item dealt
    /// once), a rank out of batches does not end the split while another has one: every rank
    /// takes the partial step and hears how many items it uses and that it is partial; the
    /// split ends once no rank has a batch.
    #[test]
    fn a_fault_tolerant_training_split_takes_its_partial_last_step() {
        let turns = |batches: fn(u32) -> u64| -> Vec<(Turn, Heard)> {
            crate::group::on_local_ranks(3, |pg| {
                let items = batches(pg.rank().0);
                let vote = if items > 0 { Vote::Item } else { Vote::NoItem };
                let aside = Aside { items, join: false };
                let slot = FailureSlot::default();
                try_turn(&pg, &vote, aside, Split::Training, 1, &slot, |m| {
                    panic!("interrupted: {m}")
                })
                .unwrap()
            })
        };
        let partial = Heard {
            items: 5,
            every: false,
            join: false,
        };
        assert_eq!(
            turns(|r| [3, 2, 0][r as usize]),
            vec![(Turn::Step, partial); 3]
        );
        let full = Heard {
            items: 12,
            every: true,
            join: false,
        };
        assert_eq!(turns(|_| 4), vec![(Turn::Step, full); 3]);
        assert!(turns(|_| 0).iter().all(|(t, _)| *t == Turn::End));
    }

    #[test]
    fn outcomes_carry_the_culprit_and_keep_the_first_failure() {
        let stop = Outcome::of(
            Ok(Decision::Stop {
                culprit: Rank(1),
                reason: "quit".into(),
            }),
            Rank(0),
        );
        assert!(matches!(stop, Outcome::Stop(m) if m == "rank 1: quit"));
        let Outcome::Fail(message, e) = Outcome::of(
            Ok(Decision::Failed {
                culprit: Rank(2),
                reason: "bad batch".into(),
            }),
            Rank(0),
        ) else {
            panic!("a failure is a failure")
        };
        assert_eq!(message, "rank 2 failed: bad batch");
        let slot = FailureSlot::default();
        slot.fail(e);
        slot.fail(DdpError::Job(JobError::TrainingFailed {
            rank: Rank(0),
            culprit: Rank(3),
            reason: "later".into(),
        }));
        let kept = slot.message().unwrap();
        assert!(
            kept.contains("rank 2") && kept.contains("bad batch"),
            "{kept}"
        );
        assert!(slot.take().is_some());
        assert!(slot.take().is_none());
    }

    #[test]
    fn a_process_left_out_of_the_job_is_told_apart_from_one_that_failed_in_it() {
        use crate::error::{JobError, MembershipError};
        let slot = FailureSlot::default();
        assert!(!slot.out_of_the_job());
        slot.fail(DdpError::Job(JobError::TrainingFailed {
            rank: Rank(0),
            culprit: Rank(1),
            reason: "a rank failed".into(),
        }));
        assert!(
            !slot.out_of_the_job(),
            "a member's failure: its summary is the job's"
        );
        let slot = FailureSlot::default();
        slot.fail(DdpError::Membership(MembershipError::JoinFailed {
            member: 0,
            waited: Duration::from_secs(1),
            why: "the job finished".into(),
        }));
        assert!(slot.out_of_the_job());
        let slot = FailureSlot::default();
        slot.fail(DdpError::Membership(MembershipError::Excluded {
            member: 0,
            epoch: 2,
            members: vec![1, 2],
            why: "frozen".into(),
        }));
        assert!(slot.out_of_the_job());
    }
}
