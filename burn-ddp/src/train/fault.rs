//! [`DdpStrategy`] in a fault-tolerant job, its Burn half: the Learner's state (model,
//! optimizer and scheduler records) as bytes for the ranks behind after a change of membership,
//! and the samplers re-dealt at a cursor. Where training is (the `Cursor`), the change itself
//! (agreeing on the next membership, moving the state from the rank with the most progress to
//! the ranks behind) and the epoch loop around it are the core's (burn-ddp-comm's
//! `train::epoch`).

use std::sync::{Arc, Mutex};

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
use burn_ddp_comm::group::handover::{frame, unframe};
use burn_ddp_comm::train::epoch::Cursor;

use crate::{Ddp, DdpError, Result};

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
    /// The Learner's model, optimizer and scheduler records at `epoch`, as bytes.
    pub(super) fn snapshot<LC>(
        &self,
        learner: &Learner<LC>,
        epoch: usize,
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
            checkpointer.checkpoint(learner, epoch, store);
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
        Ok(frame(&[&bytes[0], &bytes[1], &bytes[2]]))
    }

    /// Loads a [`snapshot`](Self::snapshot) into `learner`.
    pub(super) fn restore_snapshot<LC>(&self, learner: &mut Learner<LC>, bytes: &[u8]) -> Result<()>
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
        let [model, optim, sched] =
            unframe(bytes).ok_or_else(|| bad("the bytes received are not a framed state"))?;
        let model: LearnerModelRecord<LC> = load(model, &self.device, rank)?;
        let optim: LearnerOptimizerRecord<LC> = load(optim, &self.device, rank)?;
        let sched: LearnerSchedulerRecord<LC> = load(sched, &self.device, rank)?;
        learner.load_model(model);
        learner.load_optim(optim);
        learner.load_scheduler(sched);
        Ok(())
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
