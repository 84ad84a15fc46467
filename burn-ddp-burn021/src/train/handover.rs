//! [`DdpStrategy`] in a fault-tolerant job, its Burn half: the Learner's model, optimizer and
//! scheduler records as bytes for the ranks behind after a change of membership (the core's
//! `Handover::save_records` and `load_records`).
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

use super::DdpStrategy;
use burn_ddp_comm::group::handover::RecordSlot;

use crate::{Ddp, DdpError, Result};

/// One of the Learner's records as bytes, for burn-train's checkpointer.
#[derive(Clone, Default)]
struct Memory(RecordSlot);

impl Memory {
    /// The checkpointer of one record, writing into `slot`.
    fn checkpointer<R: Record<B> + 'static, B: Backend>(
        slot: &RecordSlot,
    ) -> AsyncCheckpointer<R, B> {
        AsyncCheckpointer::new(Self(slot.clone()))
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

pub(super) fn load<R: Record<B>, B: Backend>(
    bytes: Vec<u8>,
    device: &B::Device,
    rank: crate::Rank,
) -> Result<R> {
    BinBytesRecorder::<FullPrecisionSettings>::default()
        .load(bytes, device)
        .map_err(|e| {
            let what = "loading the Learner's state received from the source rank";
            DdpError::model_access(rank, what, e)
        })
}

/// Saves `learner`'s model, optimizer and scheduler records at `epoch` into `slots`, through
/// burn-train's checkpointer (saving at this call, deleting nothing); it returns once its
/// threads have written them.
pub(super) fn save_records<LC: LearningComponentsTypes>(
    learner: &Learner<LC>,
    epoch: usize,
    store: &EventStoreClient,
    [m, o, s]: &[RecordSlot; 3],
) {
    let (m, o, s) = (
        Memory::checkpointer(m),
        Memory::checkpointer(o),
        Memory::checkpointer(s),
    );
    let keep_all = Box::new(KeepLastNCheckpoints::new(usize::MAX));
    // Dropped at the end of the statement, which waits for its threads' writes.
    LearningCheckpointer::<LC>::new(m, o, s, keep_all).checkpoint(learner, epoch, store);
}

impl<B: Backend> DdpStrategy<B> {
    /// Loads another rank's [`save_records`] into `learner`.
    pub(super) fn load_records<LC>(
        &self,
        learner: &mut Learner<LC>,
        [model, optim, sched]: [Vec<u8>; 3],
    ) -> Result<()>
    where
        LC: LearningComponentsTypes,
        LC::Backend: AutodiffBackend<InnerBackend = Ddp<B>> + BackendTypes<Device = B::Device>,
    {
        let rank = self.rank();
        let model: LearnerModelRecord<LC> = load(model, &self.device, rank)?;
        let optim: LearnerOptimizerRecord<LC> = load(optim, &self.device, rank)?;
        let sched: LearnerSchedulerRecord<LC> = load(sched, &self.device, rank)?;
        learner.load_model(model);
        learner.load_optim(optim);
        learner.load_scheduler(sched);
        Ok(())
    }
}
