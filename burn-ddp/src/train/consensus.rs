//! Votes and decisions: before every step, each rank says whether it has a batch, wants to stop
//! or failed, and one small all-reduce turns those votes into the same decision on every rank,
//! so that no rank is left waiting in a collective that the others skipped.

use super::DdpStrategy;
use crate::{DdpError, ProcessGroup, Rank, ReduceOp, Result};
use burn::tensor::backend::Backend;

/// What one rank says before a step.
#[derive(Debug)]
pub(super) enum Vote {
    Item,
    NoItem,
    Stop(String),
    Failed(String),
}

#[derive(Debug, PartialEq, Eq)]
pub(super) enum Decision {
    Go { any_item: bool, all_items: bool },
    Stop { culprit: Rank, reason: String },
    Failed { culprit: Rank, reason: String },
}

#[derive(Debug, PartialEq, Eq)]
pub(super) enum Flow {
    Continue,
    Stop,
}

pub(super) fn panic_text(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| String::from("(no message)"))
}

/// One small all-reduce: every rank's vote, and what they decide together.
pub(super) fn agree(pg: &ProcessGroup, vote: &Vote) -> Result<Decision> {
    let (has, stop, failed) = match vote {
        Vote::Item => (1, 0, 0),
        Vote::NoItem => (0, 0, 0),
        Vote::Stop(_) => (0, 1, 0),
        Vote::Failed(_) => (0, 0, 1),
    };
    // Max of (has, 1 - has, stop, failed): any rank has an item, any has none, any stops,
    // any failed.
    let mut flags = [has, 1 - has, stop, failed];
    pg.all_reduce(&mut flags, ReduceOp::Max)?;
    if flags[2] == 0 && flags[3] == 0 {
        return Ok(Decision::Go {
            any_item: flags[0] == 1,
            all_items: flags[1] == 0,
        });
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
    Ok(if failed {
        Decision::Failed { culprit, reason }
    } else {
        Decision::Stop { culprit, reason }
    })
}

/// The tags of a reason in the gathered votes.
const STOP: u8 = b'S';
const FAILED: u8 = b'F';

impl<B: Backend> DdpStrategy<B> {
    /// One small all-reduce: every rank's vote, and what they decide together.
    pub(super) fn agree(&self, vote: Vote) -> Result<Decision> {
        agree(self.session.group(), &vote)
    }

    /// Applies a stop or failure decision on this rank; `true` when training must stop.
    pub(super) fn settle(
        &self,
        decision: Result<Decision>,
        interrupter: &burn::train::Interrupter,
    ) -> Flow {
        match decision {
            Ok(Decision::Go { .. }) => Flow::Continue,
            Ok(Decision::Stop { culprit, reason }) => {
                tracing::info!(
                    "[rank {}] stopping: rank {culprit} asked: {reason}",
                    self.rank()
                );
                interrupter.stop(Some(&format!("rank {culprit}: {reason}")));
                Flow::Stop
            }
            Ok(Decision::Failed { culprit, reason }) => {
                interrupter.stop(Some(&format!("rank {culprit} failed: {reason}")));
                self.fail(DdpError::TrainingFailed {
                    rank: self.rank(),
                    culprit,
                    reason,
                });
                Flow::Stop
            }
            Err(e) => self.stop_with(e, interrupter),
        }
    }

    /// Stops this rank on an error it got itself (a failed collective names the rank at fault).
    pub(super) fn stop_with(&self, e: DdpError, interrupter: &burn::train::Interrupter) -> Flow {
        interrupter.stop(Some(&e.to_string()));
        self.fail(e);
        Flow::Stop
    }

    /// A failure of this rank alone, in the middle of a step (the others may be inside a
    /// collective): abort the group so that they stop at once, naming this rank.
    pub(super) fn fail_alone(&self, what: &str, interrupter: &burn::train::Interrupter) {
        let reason = what.to_owned();
        interrupter.stop(Some(&reason));
        self.fail(DdpError::TrainingFailed {
            rank: self.rank(),
            culprit: self.rank(),
            reason,
        });
        self.session.group().abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Timeouts, WorldSize};
    use std::time::Duration;

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
        let ds = decide(4, |r| match r {
            2 => Vote::Failed("loading a batch panicked".into()),
            3 => Vote::Failed("a second failure".into()),
            _ => Vote::Item,
        });
        assert_eq!(
            all_same(&ds),
            &Decision::Failed {
                culprit: Rank(2),
                reason: "loading a batch panicked".into()
            }
        );
    }
}
