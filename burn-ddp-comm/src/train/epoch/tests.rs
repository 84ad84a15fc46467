//! The epoch loop with fake splits and a fake driver, on in-process groups.

use std::cell::RefCell;
use std::time::Duration;

use super::*;
use crate::{Timeouts, WorldSize};

#[test]
fn cursors_round_trip_and_garbage_is_refused() {
    let mut c = Cursor::start(3);
    c.done = 640;
    c.iteration = 20;
    c.progress = 77;
    assert_eq!(Cursor::decode(&c.encode()), Some(c));
    c.next_phase();
    assert_eq!(
        (c.phase, c.done, c.iteration, c.progress),
        (Phase::Valid, 0, 0, 78)
    );
    c.next_phase();
    c.next_phase();
    assert_eq!((c.epoch, c.phase, c.progress), (4, Phase::Train, 80));
    let mut bad = c.encode();
    bad[8] = 7;
    assert_eq!(Cursor::decode(&bad), None);
    assert_eq!(Cursor::decode(&bad[..39]), None);
}

/// A split of `batches` batches of `items` items each, writing down what the loop asks.
struct Fake {
    batches: usize,
    items: u64,
    /// The iteration at which the step panics (as a Burn step would), if any.
    panics_at: Option<usize>,
    /// Micro-steps per optimizer step.
    accumulation: usize,
    loaded: bool,
    log: RefCell<Vec<String>>,
    /// What each step was told.
    seen: RefCell<Vec<StepAt>>,
}

impl Fake {
    fn new(batches: usize) -> Self {
        Self {
            batches,
            items: 4,
            panics_at: None,
            accumulation: 1,
            loaded: false,
            log: RefCell::default(),
            seen: RefCell::default(),
        }
    }

    fn log(&self) -> Vec<String> {
        self.log.borrow().clone()
    }
}

impl SplitSteps for Fake {
    type Out = ();

    fn load(&mut self) -> (Vote, u64) {
        self.loaded = self.batches > 0;
        if self.loaded {
            self.batches -= 1;
            (Vote::Item, self.items)
        } else {
            (Vote::NoItem, 0)
        }
    }

    fn step(&mut self, at: StepAt) -> StepResult<()> {
        self.seen.borrow_mut().push(at);
        let iteration = at.iteration;
        if self.panics_at == Some(iteration) {
            return Err(StepFault::Alone("the training step panicked: boom".into()));
        }
        self.log.borrow_mut().push(format!(
            "step {iteration}{}",
            if self.loaded { "" } else { " (no batch)" }
        ));
        let stepped = if iteration.is_multiple_of(self.accumulation) {
            Stepped::Moved
        } else {
            Stepped::Accumulated
        };
        Ok((stepped, Some(())))
    }

    fn report(&mut self, (): ()) -> Result<()> {
        Ok(())
    }

    fn finish(&mut self) -> std::result::Result<(), StepFault> {
        self.log.borrow_mut().push("finish".into());
        Ok(())
    }

    fn interrupt(&self, message: &str) {
        self.log.borrow_mut().push(format!("interrupt: {message}"));
    }
}

/// Runs `split` on an in-process group of `world`, rank r with `fake(r)`; every rank's
/// outcome, log and recorded failure.
fn on_ranks(
    world: u32,
    split: Split,
    fake: impl Fn(u32) -> Fake + Sync,
) -> Vec<(String, Vec<String>, Option<DdpError>)> {
    on_ranks_at(world, split, None, fake)
        .into_iter()
        .map(|(ended, log, failure, _)| (ended, log, failure))
        .collect()
}

/// [`on_ranks`] from `cursor` when given (a fault-tolerant job); also what each rank's steps
/// were told and its cursor after the split.
#[allow(clippy::type_complexity)]
fn on_ranks_at(
    world: u32,
    split: Split,
    cursor: Option<Cursor>,
    fake: impl Fn(u32) -> Fake + Sync,
) -> Vec<(
    String,
    Vec<String>,
    Option<DdpError>,
    (Vec<StepAt>, Option<Cursor>),
)> {
    let groups = ProcessGroup::local(
        WorldSize::new(world).unwrap(),
        Timeouts::uniform(Duration::from_secs(20)),
    );
    std::thread::scope(|s| {
        let handles: Vec<_> = groups
            .into_iter()
            .map(|pg| {
                let fake = &fake;
                s.spawn(move || {
                    let mut steps = fake(pg.rank().0);
                    let failure = FailureSlot::default();
                    let mut cursor = cursor;
                    let at = SplitAt {
                        pg: &pg,
                        split,
                        epoch: 1,
                        failure: &failure,
                        cursor: cursor.as_mut(),
                        changes: None,
                    };
                    let ended = format!("{:?}", run_split(&mut steps, at));
                    let seen = steps.seen.borrow().clone();
                    (ended, steps.log(), failure.take(), (seen, cursor))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn training_ends_on_every_rank_when_one_runs_out() {
    let out = on_ranks(2, Split::Training, |r| Fake::new(3 - r as usize));
    for (ended, log, failure) in out {
        assert_eq!(ended, "Done");
        assert_eq!(log, ["step 1", "step 2", "finish"]);
        assert!(failure.is_none());
    }
}

/// A fault-tolerant job deals every item once after a change, so shares may differ by one
/// batch: the ranks out of batches take part in the last step (told it is partial) instead of
/// ending the split, and the cursor and the steps' progress count every rank's items once.
#[test]
fn a_fault_tolerant_training_split_takes_its_partial_last_step() {
    let mut start = Cursor::start(1);
    start.done = 100;
    let out = on_ranks_at(3, Split::Training, Some(start), |r| {
        Fake::new(if r == 0 { 3 } else { 2 })
    });
    for (rank, (ended, log, failure, (seen, cursor))) in out.iter().enumerate() {
        assert_eq!(ended, "Done", "rank {rank}");
        assert!(failure.is_none(), "rank {rank}");
        let last = if rank == 0 {
            "step 3"
        } else {
            "step 3 (no batch)"
        };
        assert_eq!(log, &["step 1", "step 2", last, "finish"], "rank {rank}");
        let told: Vec<_> = seen.iter().map(|s| (s.full, s.done)).collect();
        assert_eq!(
            told,
            [(true, Some(112)), (true, Some(124)), (false, Some(128))],
            "rank {rank}"
        );
        let c = cursor.expect("a cursor");
        assert_eq!(
            (c.iteration, c.done, c.progress),
            (3, 128, 3),
            "rank {rank}"
        );
    }
}

#[test]
fn validation_goes_on_while_any_rank_has_a_batch() {
    let out = on_ranks(2, Split::Validation, |r| Fake::new(3 - r as usize));
    assert_eq!(out[0].1, ["step 1", "step 2", "step 3", "finish"]);
    assert_eq!(
        out[1].1,
        ["step 1", "step 2", "step 3 (no batch)", "finish"]
    );
}

#[test]
fn a_rank_failing_alone_stops_every_rank_naming_it() {
    let out = on_ranks(3, Split::Training, |r| Fake {
        panics_at: (r == 1).then_some(2),
        ..Fake::new(5)
    });
    for (rank, (ended, log, failure)) in out.iter().enumerate() {
        assert_eq!(ended, "Stop", "rank {rank}");
        assert!(!log.contains(&"finish".to_owned()), "rank {rank}: {log:?}");
        let failure = failure.as_ref().expect("every rank records a failure");
        assert!(
            failure.to_string().contains("rank 1"),
            "rank {rank}: {failure}"
        );
    }
    assert_eq!(
        out[1].1.last().map(String::as_str),
        Some("interrupt: the training step panicked: boom")
    );
}

#[test]
fn a_stop_vote_stops_every_rank_before_the_step() {
    struct Stopping(Fake);
    impl SplitSteps for Stopping {
        type Out = ();
        fn load(&mut self) -> (Vote, u64) {
            (Vote::Stop("early stopping".into()), 0)
        }
        fn step(&mut self, at: StepAt) -> StepResult<()> {
            self.0.step(at)
        }
        fn report(&mut self, (): ()) -> Result<()> {
            Ok(())
        }
        fn interrupt(&self, message: &str) {
            self.0.interrupt(message);
        }
    }
    let pg = ProcessGroup::local(
        WorldSize::new(1).unwrap(),
        Timeouts::uniform(Duration::from_secs(20)),
    )
    .remove(0);
    let failure = FailureSlot::default();
    let mut steps = Stopping(Fake::new(2));
    let at = SplitAt {
        pg: &pg,
        split: Split::Training,
        epoch: 1,
        failure: &failure,
        cursor: None,
        changes: None,
    };
    assert!(matches!(run_split(&mut steps, at), Ended::Stop));
    assert_eq!(steps.0.log(), ["interrupt: rank 0: early stopping"]);
    assert!(failure.take().is_none());
}

#[test]
fn the_cursor_counts_optimizer_steps_and_the_positions_they_used() {
    let pg = ProcessGroup::local(
        WorldSize::new(1).unwrap(),
        Timeouts::uniform(Duration::from_secs(20)),
    )
    .remove(0);
    let failure = FailureSlot::default();
    let mut cursor = Cursor::start(1);
    cursor.iteration = 2;
    cursor.done = 8;
    let mut steps = Fake {
        accumulation: 2,
        ..Fake::new(5)
    };
    let at = SplitAt {
        pg: &pg,
        split: Split::Training,
        epoch: 1,
        failure: &failure,
        cursor: Some(&mut cursor),
        changes: None,
    };
    assert!(matches!(run_split(&mut steps, at), Ended::Done));
    // Five micro-steps from iteration 3 (the cursor's): optimizer steps at 4 and 6; the last
    // micro-step (7) is not counted until an optimizer step uses it.
    assert_eq!(
        steps.log(),
        ["step 3", "step 4", "step 5", "step 6", "step 7", "finish"]
    );
    assert_eq!((cursor.iteration, cursor.done, cursor.progress), (6, 24, 2));
}

/// A driver whose splits are [`Fake`]s of `batches`, stopping at the end of `stop_after`.
struct Driver {
    pg: ProcessGroup,
    failure: FailureSlot,
    batches: usize,
    stop_after: Option<usize>,
    log: RefCell<Vec<String>>,
    saved: crate::train::files::SavedLog,
}

impl Driver {
    fn split(&mut self, split: Split, cursor: &mut Cursor, ft: bool) -> Ended {
        let mut steps = Fake::new(self.batches);
        let at = SplitAt {
            pg: &self.pg,
            split,
            epoch: cursor.epoch,
            failure: &self.failure,
            cursor: ft.then_some(cursor),
            changes: None,
        };
        let ended = run_split(&mut steps, at);
        self.log
            .borrow_mut()
            .push(format!("{split:?} {}", steps.log().join(", ")));
        ended
    }
}

impl EpochDriver for Driver {
    fn group(&self) -> &ProcessGroup {
        &self.pg
    }
    fn failure(&self) -> &FailureSlot {
        &self.failure
    }
    fn train(&mut self, cursor: &mut Cursor, ft: bool) -> Ended {
        self.split(Split::Training, cursor, ft)
    }
    fn valid(&mut self, cursor: &mut Cursor, ft: bool) -> Ended {
        self.split(Split::Validation, cursor, ft)
    }
    fn main_epoch_end(&mut self, epoch: usize) -> bool {
        self.log.borrow_mut().push(format!("end {epoch}"));
        self.stop_after == Some(epoch)
    }
    fn saved(&self) -> &crate::train::files::SavedLog {
        &self.saved
    }
    fn interrupted(&self) -> Option<Vote> {
        None
    }
    fn interrupt(&self, message: &str) {
        self.log.borrow_mut().push(message.to_owned());
    }
    fn close(&mut self) -> Vote {
        self.log.borrow_mut().push("closed".into());
        Vote::Item
    }
}

fn driver(batches: usize, stop_after: Option<usize>) -> Driver {
    Driver {
        pg: ProcessGroup::local(
            WorldSize::new(1).unwrap(),
            Timeouts::uniform(Duration::from_secs(20)),
        )
        .remove(0),
        failure: FailureSlot::default(),
        batches,
        stop_after,
        log: RefCell::default(),
        saved: Default::default(),
    }
}

#[test]
fn fit_runs_every_phase_of_every_epoch_from_the_start_epoch() {
    let mut d = driver(1, None);
    let end = fit(&mut d, 2, 3);
    assert_eq!(
        *d.log.borrow(),
        [
            "Training step 1, finish",
            "Validation step 1, finish",
            "end 2",
            "Training step 1, finish",
            "Validation step 1, finish",
            "end 3",
        ]
    );
    assert_eq!((end.epoch, end.phase, end.progress), (4, Phase::Train, 6));
    assert_eq!(end.completed(), 3);
}

#[test]
fn an_epoch_is_completed_once_its_validation_ended() {
    let mut c = Cursor::start(1);
    let mut seen = vec![c.completed()];
    for _ in 0..4 {
        c.next_phase();
        seen.push(c.completed());
    }
    // training 1, validation 1, end 1, training 2, validation 2
    assert_eq!(seen, [0, 0, 1, 1, 1]);
}

#[test]
fn fit_ends_where_the_epoch_vote_says_stop() {
    let mut d = driver(0, Some(1));
    let end = fit(&mut d, 1, 5);
    assert_eq!(
        *d.log.borrow(),
        [
            "Training finish",
            "Validation finish",
            "end 1",
            "rank 0: early stopping after epoch 1",
        ]
    );
    assert_eq!((end.epoch, end.phase), (1, Phase::End));
    assert_eq!(end.completed(), 1);
    assert!(d.failure.take().is_none());
}

#[test]
fn a_rank_without_a_batch_steps_only_in_a_partial_step() {
    let at = |full| StepAt {
        iteration: 3,
        full,
        done: Some(96),
    };
    assert_eq!(at(true).batch(Some(7)), Some(Some(7)));
    assert_eq!(at(false).batch(Some(7)), Some(Some(7)));
    assert_eq!(at(false).batch(None::<u8>), Some(None));
    assert_eq!(at(true).batch(None::<u8>), None);
}
