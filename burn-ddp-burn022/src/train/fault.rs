//! [`DdpStrategy`] in a fault-tolerant job, its Burn 0.22 half: the Learner's state (model,
//! optimizer and scheduler records) as bytes for the ranks behind after a change of membership.
//! Where training is (the `Cursor`), the change itself (agreeing on the next membership, moving
//! the state from the rank with the most progress to the ranks behind) and the epoch loop
//! around it are the core's (burn-ddp-comm's `train::epoch`).

use burn::store::ModuleRecord;
use burn::tensor::Bytes;
use burn::train::checkpoint::{
    AsyncCheckpointer, Checkpoint, Checkpointer, CheckpointerError, KeepLastNCheckpoints,
};
use burn::train::metric::store::EventStoreClient;
use burn::train::{Learner, LearnerModel, LearningCheckpointer};
use burn_ddp_comm::group::handover::{learner_records, learner_state, RecordSlot};
use burn_ddp_comm::ModelError;

use super::DdpStrategy;
use crate::{DdpError, Rank, Result};

/// One of the Learner's records as bytes, for burn-train's checkpointer.
#[derive(Clone, Default)]
struct Memory(RecordSlot);

impl Memory {
    /// The checkpointer's strategy: saves at every call, deletes nothing.
    fn keep_all() -> Box<KeepLastNCheckpoints> {
        Box::new(KeepLastNCheckpoints::new(usize::MAX))
    }
}

/// The checkpointer of one record, writing into `memory`'s slot.
impl<R: Checkpoint> From<&Memory> for AsyncCheckpointer<R> {
    fn from(memory: &Memory) -> Self {
        AsyncCheckpointer::new(memory.clone())
    }
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
    R::checkpoint_from_bytes(Bytes::from_bytes_vec(bytes)).map_err(|e| {
        DdpError::Model(ModelError::Access {
            rank,
            what: "loading the Learner's state received from the source rank",
            reason: e.to_string(),
        })
    })
}

impl DdpStrategy {
    /// The Learner's model, optimizer and scheduler records at `epoch`, as bytes.
    pub(super) fn snapshot<M: LearnerModel>(
        &self,
        learner: &Learner<M>,
        epoch: usize,
        store: &EventStoreClient,
    ) -> Result<Vec<u8>> {
        let slots: [Memory; 3] = Default::default();
        let [m, o, s] = &slots;
        // Saves at every call, deletes nothing (epoch - usize::MAX never is one); dropped at the
        // end of the statement, which waits for its threads' writes.
        LearningCheckpointer::<M>::new(m.into(), o.into(), s.into(), Memory::keep_all())
            .checkpoint(learner, epoch, store);
        learner_state(&slots.map(|m| m.0), self.rank())
    }

    /// Loads a [`snapshot`](Self::snapshot) into `learner`.
    pub(super) fn restore_snapshot<M: LearnerModel>(
        &self,
        learner: &mut Learner<M>,
        bytes: &[u8],
    ) -> Result<()> {
        let rank = self.rank();
        let [model, optim, sched] = learner_records(bytes, rank)?;
        let model: ModuleRecord = load(model, rank)?;
        let model = learner.model().try_load_record(model).map_err(|e| {
            DdpError::Model(ModelError::Access {
                rank,
                what: "loading the Learner's state received from the source rank",
                reason: e.to_string(),
            })
        })?;
        learner.load_model(model.into_record());
        learner.load_optim(load(optim, rank)?);
        learner.load_scheduler(load(sched, rank)?);
        Ok(())
    }
}
