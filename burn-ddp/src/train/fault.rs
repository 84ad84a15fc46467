//! [`DdpStrategy`] in a fault-tolerant job: where training is (a [`Cursor`] that every rank of
//! a membership agrees on), the Learner's state as bytes, and what a change of membership does
//! (`DdpStrategy::change`): agree on the next membership, move the state and the cursor from
//! the rank with the most progress to the ranks behind it, prepare the session again, re-deal
//! the rest of the epoch over the new ranks.
//!
//! Progress counts every event that moves training on, on every rank alike: an optimizer step,
//! a validation step, the end of a split, the end of an epoch. Ranks with equal progress are at
//! the same place with equal state (a step whose synchronisation failed was not applied
//! anywhere it failed, and a step applied anywhere was applied with the same averaged
//! gradients), so only the ranks behind need the state.

use std::sync::{Arc, Mutex};

use burn::module::Module;
use burn::record::{BinBytesRecorder, FullPrecisionSettings, Record, Recorder};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::train::checkpoint::{
    AsyncCheckpointer, Checkpointer, CheckpointerError, CheckpointingAction, CheckpointingStrategy,
};
use burn::train::metric::store::EventStoreClient;
use burn::train::{
    Learner, LearnerModelRecord, LearnerOptimizerRecord, LearnerSchedulerRecord,
    LearningCheckpointer, LearningComponentsTypes,
};
use burn_backend::BackendTypes;

use super::DdpStrategy;
use crate::ddp::{frame, move_state, unframe};
use crate::{Ddp, DdpError, Recovery, Result};

/// The part of an epoch training is in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Phase {
    Train = 0,
    Valid = 1,
    /// Validation is over: the checkpoint, the early-stopping check and the epoch's last vote.
    End = 2,
}

/// Where training is, the same on every rank of a membership with the same progress.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Cursor {
    pub(super) epoch: usize,
    pub(super) phase: Phase,
    /// Positions of the split's order (for this epoch) used so far.
    pub(super) done: u64,
    /// burn-train's iteration count in the split.
    pub(super) iteration: usize,
    /// Events that moved training on since the start.
    pub(super) progress: u64,
}

impl Cursor {
    pub(super) fn start(epoch: usize) -> Self {
        Self {
            epoch,
            phase: Phase::Train,
            done: 0,
            iteration: 0,
            progress: 0,
        }
    }

    /// The next phase (and the next epoch after the end), one event on.
    pub(super) fn next_phase(&mut self) {
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

    fn encode(&self) -> Vec<u8> {
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
    fn decode(bytes: &[u8]) -> Option<Self> {
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

    /// For the membership line: `epoch 2, training, 3 steps in`.
    pub(super) fn describe(&self) -> String {
        let phase = match self.phase {
            Phase::Train => "training",
            Phase::Valid => "validation",
            Phase::End => "end",
        };
        format!("epoch {}, {phase}, {} steps in", self.epoch, self.iteration)
    }
}

/// What makes the epoch loops stop before the end of their split.
#[derive(Debug)]
pub(super) enum Change {
    /// A collective failed because of another rank.
    Failed(DdpError),
    /// A process asks to join; every rank agreed on this step.
    Grow,
    /// This process was admitted into the running job.
    Admitted(Recovery),
}

/// One of the Learner's records as bytes, for burn-train's checkpointer (the only way to the
/// optimizer's and the scheduler's records: the Learner keeps them private).
#[derive(Clone, Default)]
struct Memory(Arc<Mutex<Option<Vec<u8>>>>);

impl Memory {
    fn take(&self) -> Option<Vec<u8>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).take()
    }
}

impl<R: Record<B>, B: Backend> Checkpointer<R, B> for Memory {
    fn save(&self, _epoch: usize, record: R) -> std::result::Result<(), CheckpointerError> {
        let bytes = BinBytesRecorder::<FullPrecisionSettings>::default()
            .record(record, ())
            .map_err(|e| CheckpointerError::Unknown(e.to_string()))?;
        *self.0.lock().unwrap_or_else(|p| p.into_inner()) = Some(bytes);
        Ok(())
    }

    fn delete(&self, _epoch: usize) -> std::result::Result<(), CheckpointerError> {
        Ok(())
    }

    fn restore(
        &self,
        _epoch: usize,
        _device: &B::Device,
    ) -> std::result::Result<R, CheckpointerError> {
        Err(CheckpointerError::Unknown(
            "a state in memory is restored from its bytes".into(),
        ))
    }
}

/// Saves every time it is asked.
struct Always;

impl CheckpointingStrategy for Always {
    fn checkpointing(
        &mut self,
        _epoch: usize,
        _store: &EventStoreClient,
    ) -> Vec<CheckpointingAction> {
        vec![CheckpointingAction::Save]
    }
}

fn load<R: Record<B>, B: Backend>(
    bytes: Vec<u8>,
    device: &B::Device,
    rank: crate::Rank,
) -> Result<R> {
    BinBytesRecorder::<FullPrecisionSettings>::default()
        .load(bytes, device)
        .map_err(|e| DdpError::Model {
            rank,
            what: "loading the Learner's state received from the source rank",
            reason: e.to_string(),
        })
}

impl<B: Backend> DdpStrategy<B> {
    /// The Learner's model, optimizer and scheduler records, and `cursor`, as bytes.
    fn snapshot<LC>(
        &self,
        learner: &Learner<LC>,
        cursor: &Cursor,
        store: &EventStoreClient,
    ) -> Result<Vec<u8>>
    where
        LC: LearningComponentsTypes,
    {
        let parts = [Memory::default(), Memory::default(), Memory::default()];
        {
            let mut checkpointer = LearningCheckpointer::<LC>::new(
                AsyncCheckpointer::new(parts[0].clone()),
                AsyncCheckpointer::new(parts[1].clone()),
                AsyncCheckpointer::new(parts[2].clone()),
                Box::new(Always),
            );
            checkpointer.checkpoint(learner, cursor.epoch, store);
            // Dropped here: it waits for its threads' writes.
        }
        let mut bytes = Vec::new();
        for (p, name) in parts.iter().zip(["model", "optimizer", "scheduler"]) {
            bytes.push(p.take().ok_or_else(|| DdpError::Model {
                rank: self.rank(),
                what: "serialising the Learner's state for the ranks behind",
                reason: format!("burn-train's checkpointer did not save the {name} record"),
            })?);
        }
        Ok(frame(&[&cursor.encode(), &bytes[0], &bytes[1], &bytes[2]]))
    }

    /// Loads a [`snapshot`](Self::snapshot) into `learner`, returning its cursor.
    fn restore_snapshot<LC>(&self, learner: &mut Learner<LC>, bytes: &[u8]) -> Result<Cursor>
    where
        LC: LearningComponentsTypes,
        LC::Backend: AutodiffBackend<InnerBackend = Ddp<B>> + BackendTypes<Device = B::Device>,
    {
        let rank = self.rank();
        let bad = |why: &str| DdpError::Model {
            rank,
            what: "taking the Learner's state from the source rank",
            reason: why.to_owned(),
        };
        let [cursor, model, optim, sched] =
            unframe(bytes).ok_or_else(|| bad("the bytes received are not a framed state"))?;
        let cursor = Cursor::decode(&cursor).ok_or_else(|| bad("no training position"))?;
        let model: LearnerModelRecord<LC> = load(model, &self.device, rank)?;
        let optim: LearnerOptimizerRecord<LC> = load(optim, &self.device, rank)?;
        let sched: LearnerSchedulerRecord<LC> = load(sched, &self.device, rank)?;
        learner.load_model(model);
        learner.load_optim(optim);
        learner.load_scheduler(sched);
        Ok(cursor)
    }

    /// A change of membership: agree on the next one (again if it fails meanwhile), move the
    /// state and the cursor to the ranks behind, prepare the session on the new ranks.
    pub(super) fn change<LC>(
        &self,
        mut change: Change,
        learner: &mut Learner<LC>,
        cursor: &mut Cursor,
        store: &EventStoreClient,
    ) -> Result<Recovery>
    where
        LC: LearningComponentsTypes,
        LC::Backend: AutodiffBackend<InnerBackend = Ddp<B>> + BackendTypes<Device = B::Device>,
    {
        let pg = self.session.group().clone();
        loop {
            let agreed = match change {
                Change::Failed(ref e) => pg.recover(e, Some(cursor.progress)),
                Change::Grow => pg.grow(Some(cursor.progress)),
                Change::Admitted(ref rec) => Ok(rec.clone()),
            };
            let rec = match agreed {
                Ok(rec) => rec,
                Err(DdpError::Excluded { .. }) => pg.rejoin()?,
                Err(e) => return Err(e),
            };
            let moved = move_state(&pg, &rec, || self.snapshot(learner, cursor, store))
                .and_then(|got| match got {
                    Some(bytes) => {
                        *cursor = self.restore_snapshot(learner, &bytes)?;
                        tracing::info!(
                            "[rank {}] took the Learner's state from rank {} ({})",
                            pg.rank(),
                            rec.source,
                            cursor.describe()
                        );
                        Ok(())
                    }
                    None => Ok(()),
                })
                .and_then(|()| self.session.reprepare(learner.model()))
                .map(|model| learner.load_model(model.into_record()));
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

    /// Every sampler at `cursor`'s epoch, dealing the rest of it over the current membership.
    pub(super) fn deal(&self, cursor: &Cursor) -> Result<()> {
        let pg = self.session.group();
        let (rank, world) = (pg.rank(), pg.world_size());
        let start = usize::try_from(cursor.done).unwrap_or(usize::MAX);
        for s in &self.samplers {
            s.set_epoch(cursor.epoch as u64);
            s.reshard(rank, world, start)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
