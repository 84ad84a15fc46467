//! [`DdpStrategy`](super::DdpStrategy) in a fault-tolerant job, its Burn half: the Learner's model,
//! optimizer and scheduler records as bytes for the ranks behind after a change of membership (the
//! core's `Handover::save_records` and `load_records`). Where training is (the `Cursor`), the
//! change itself (agreeing on the next membership, moving the state from the rank with the most
//! progress to the ranks behind) and the epoch loop around it are the core's (burn-ddp-comm's
//! `train::epoch`).

use burn::store::ModuleRecord;
use burn::tensor::Bytes;
use burn::train::checkpoint::{
    AsyncCheckpointer, Checkpoint, Checkpointer, CheckpointerError, KeepLastNCheckpoints,
};
use burn::train::metric::store::EventStoreClient;
use burn::train::{Learner, LearnerModel, LearningCheckpointer};
use burn_ddp_comm::group::handover::RecordSlot;

use crate::{DdpError, Rank, Result};

/// One of the Learner's records as bytes, for burn-train's checkpointer.
#[derive(Clone, Default)]
struct Memory(RecordSlot);

/// The checkpointer of one record, writing into `slot`.
fn in_memory<R: Checkpoint>(slot: &RecordSlot) -> AsyncCheckpointer<R> {
    AsyncCheckpointer::new(Memory(slot.clone()))
}

impl<R: Checkpoint> Checkpointer<R> for Memory {
    fn save(&self, _epoch: usize, record: R) -> std::result::Result<(), CheckpointerError> {
        let bytes = record
            .checkpoint_into_bytes()
            .map_err(|e| CheckpointerError::Unknown(e.to_string()))?;
        self.0.put(bytes.to_vec());
        Ok(())
    }

    fn delete(&self, _epoch: usize) -> std::result::Result<(), CheckpointerError> {
        Ok(())
    }

    fn restore(&self, _epoch: usize) -> std::result::Result<R, CheckpointerError> {
        Err(CheckpointerError::Unknown(
            "a state in memory is restored from its bytes".into(),
        ))
    }
}

fn load<R: Checkpoint>(bytes: Vec<u8>, rank: Rank) -> Result<R> {
    R::checkpoint_from_bytes(Bytes::from_bytes_vec(bytes)).map_err(|e| received(rank, e))
}

/// A record received from the source rank that this Learner cannot load.
fn received(rank: Rank, e: impl std::fmt::Display) -> DdpError {
    DdpError::model_access(
        rank,
        "loading the Learner's state received from the source rank",
        e,
    )
}

/// Saves `learner`'s model, optimizer and scheduler records at `epoch` into `slots`, through
/// burn-train's checkpointer (saving at every call, deleting nothing); it returns once its
/// threads have written them.
pub(super) fn save_records<M: LearnerModel>(
    learner: &Learner<M>,
    epoch: usize,
    store: &EventStoreClient,
    slots: &[RecordSlot; 3],
) {
    let keep_all = Box::new(KeepLastNCheckpoints::new(usize::MAX));
    let [m, o, s] = slots;
    // Dropped at the end of the statement, which waits for its threads' writes.
    LearningCheckpointer::<M>::new(in_memory(m), in_memory(o), in_memory(s), keep_all)
        .checkpoint(learner, epoch, store);
}

/// Loads another rank's [`save_records`] into `learner`.
pub(super) fn load_records<M: LearnerModel>(
    learner: &mut Learner<M>,
    [model, optim, sched]: [Vec<u8>; 3],
    rank: Rank,
) -> Result<()> {
    let model: ModuleRecord = load(model, rank)?;
    let model = learner
        .model()
        .try_load_record(model)
        .map_err(|e| received(rank, e))?;
    learner.load_model(model.into_record());
    learner.load_optim(load(optim, rank)?);
    learner.load_scheduler(load(sched, rank)?);
    Ok(())
}
