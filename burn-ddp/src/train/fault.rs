//! [`DdpStrategy`] in a fault-tolerant job, its Burn half: the Learner's state (model,
//! optimizer and scheduler records) as bytes for the ranks behind after a change of membership.
//! Where training is (the `Cursor`), the change itself
//! (agreeing on the next membership, moving the state from the rank with the most progress to
//! the ranks behind) and the epoch loop around it are the core's (burn-ddp-comm's
//! `train::epoch`).

use burn::record::{BinBytesRecorder, FullPrecisionSettings, Record, Recorder};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::train::checkpoint::{
    AsyncCheckpointer, Checkpointer, CheckpointerError, KeepLastNCheckpoints,
};
use burn::train::metric::store::EventStoreClient;
use burn::train::{
    Learner, LearnerModelRecord, LearnerOptimizerRecord, LearnerSchedulerRecord,
    LearningCheckpointer, LearningComponentsTypes,
};
use burn_backend::BackendTypes;
use burn_ddp_comm::ModelError;

use super::DdpStrategy;
use burn_ddp_comm::group::handover::{learner_records, learner_state, RecordSlot};

use crate::{Ddp, DdpError, Result};

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
impl<R: Record<B> + 'static, B: Backend> From<&Memory> for AsyncCheckpointer<R, B> {
    fn from(memory: &Memory) -> Self {
        AsyncCheckpointer::new(memory.clone())
    }
}

impl<R: Record<B>, B: Backend> Checkpointer<R, B> for Memory {
    fn save(&self, _epoch: usize, record: R) -> std::result::Result<(), CheckpointerError> {
        let bytes = BinBytesRecorder::<FullPrecisionSettings>::default()
            .record(record, ())
            .map_err(|e| CheckpointerError::Unknown(e.to_string()))?;
        self.0.put(bytes);
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

fn load<R: Record<B>, B: Backend>(
    bytes: Vec<u8>,
    device: &B::Device,
    rank: crate::Rank,
) -> Result<R> {
    BinBytesRecorder::<FullPrecisionSettings>::default()
        .load(bytes, device)
        .map_err(|e| {
            DdpError::Model(ModelError::Access {
                rank,
                what: "loading the Learner's state received from the source rank",
                reason: e.to_string(),
            })
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
        let slots: [Memory; 3] = Default::default();
        let [m, o, s] = &slots;
        // Saves at every call, deletes nothing (epoch - usize::MAX never is one); dropped at the
        // end of the statement, which waits for its threads' writes.
        LearningCheckpointer::<LC>::new(m.into(), o.into(), s.into(), Memory::keep_all())
            .checkpoint(learner, epoch, store);
        learner_state(&slots.map(|m| m.0), self.rank())
    }

    /// Loads a [`snapshot`](Self::snapshot) into `learner`.
    pub(super) fn restore_snapshot<LC>(&self, learner: &mut Learner<LC>, bytes: &[u8]) -> Result<()>
    where
        LC: LearningComponentsTypes,
        LC::Backend: AutodiffBackend<InnerBackend = Ddp<B>> + BackendTypes<Device = B::Device>,
    {
        let rank = self.rank();
        let [model, optim, sched] = learner_records(bytes, rank)?;
        let model: LearnerModelRecord<LC> = load(model, &self.device, rank)?;
        let optim: LearnerOptimizerRecord<LC> = load(optim, &self.device, rank)?;
        let sched: LearnerSchedulerRecord<LC> = load(sched, &self.device, rank)?;
        learner.load_model(model);
        learner.load_optim(optim);
        learner.load_scheduler(sched);
        Ok(())
    }
}
