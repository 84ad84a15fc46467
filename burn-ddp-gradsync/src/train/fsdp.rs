//! [`DdpStrategy::fsdp`](super::DdpStrategy::fsdp): burn-train's Learner over a model sharded
//! by [`FullyShard`] (FSDP). The Learner holds this rank's shards from the start (the program
//! builds it with `fsdp.shard(model)?`, as PyTorch's `fully_shard` comes before the optimizer:
//! Burn's `Learner::load_model` takes only records of the model's own shapes, so the strategy
//! cannot cut the model itself). Every rank's part of an epoch's end writes one checkpoint of
//! the whole model and optimizer state, gathered from the shards on the host (`full_*_record`),
//! which a run at any world size cuts again on resume; the trained model is gathered at the
//! end.

use burn::module::Module;
use burn::optim::OptimizerRecord;
use burn::store::ModuleRecord;
use burn::tensor::Bytes;
use burn::train::checkpoint::Checkpoint;
use burn::train::metric::store::EventStoreClient;
use burn::train::{Learner, LearnerModel};
use burn_ddp_comm::group::handover::{saved_records, RecordSlot};
use burn_ddp_comm::train::files::{self, RecordFiles};
use burn_ddp_comm::{DdpError, JobError};

use super::checkpoint;
use super::handover;
use crate::fsdp::FullyShard;
use crate::grads::params_by_path;
use crate::Result;

/// A record's checkpoint bytes (burn-train's format) read back, or the error naming `what`.
fn decode<R: Checkpoint>(bytes: Vec<u8>, what: &'static str, rank: crate::Rank) -> Result<R> {
    R::checkpoint_from_bytes(Bytes::from_bytes_vec(bytes))
        .map_err(|e| DdpError::model_access(rank, what, e))
}

fn encode<R: Checkpoint>(record: R, what: &'static str, rank: crate::Rank) -> Result<Vec<u8>> {
    record
        .checkpoint_into_bytes()
        .map(|b| b.to_vec())
        .map_err(|e| DdpError::model_access(rank, what, e))
}

/// The checkpoint of `epoch`, on every rank: the Learner's records of this rank's shards (through
/// burn-train's checkpointer, the one way to the optimizer's and the scheduler's), the model's
/// and the optimizer's gathered into whole ones (collectives), written by rank 0 with the
/// scheduler's (`files`: model, optimizer, scheduler); the epoch `keep` before it removed, as
/// burn-train's `KeepLastNCheckpoints` does.
///
/// # Errors
/// A record that cannot be read or written; collective failures.
pub(super) fn checkpoint<M: LearnerModel>(
    fsdp: &FullyShard,
    learner: &Learner<M>,
    epoch: usize,
    store: &EventStoreClient,
    files: &[RecordFiles; 3],
    keep: usize,
) -> Result<()> {
    let rank = fsdp.group().rank();
    let slots: [RecordSlot; 3] = Default::default();
    handover::save_records(learner, epoch, store, &slots);
    let [model, optim, sched] = saved_records(&slots, rank)?;
    let model: ModuleRecord = decode(model, "reading this rank's model record", rank)?;
    let model = fsdp.full_model_record(model)?;
    let optim: OptimizerRecord = decode(optim, "reading this rank's optimizer record", rank)?;
    let optim = fsdp.full_optimizer_record(optim)?;
    let [model_files, optim_files, sched_files] = files;
    let what = "writing the whole model's checkpoint";
    model_files.save(epoch, || encode(model, what, rank))?;
    let what = "writing the whole optimizer state's checkpoint";
    optim_files.save(epoch, || encode(optim, what, rank))?;
    sched_files.save(epoch, || Ok::<_, DdpError>(sched))?;
    files::delete_behind(files, epoch, keep)
}

/// Resumes `learner` (this rank's shards) from the whole records of `epoch` (`files`: model,
/// optimizer, scheduler), written at any world size: every rank receives rank 0's files
/// (collectives) and cuts its shards of the model and of the optimizer state, matched with
/// this model's parameters by path.
///
/// # Errors
/// A record that cannot be read, or that is another model's; collective failures.
pub(super) fn restore<M: LearnerModel>(
    fsdp: &FullyShard,
    learner: &mut Learner<M>,
    files: &[RecordFiles; 3],
    epoch: usize,
) -> Result<()> {
    let [model_files, optim_files, sched_files] = files;
    let model: ModuleRecord = checkpoint::restore(model_files, epoch)?;
    let optim: OptimizerRecord = checkpoint::restore(optim_files, epoch)?;
    let sched = checkpoint::restore(sched_files, epoch)?;
    let (model, ids) = fsdp.shard_model_record(&learner.model(), model)?;
    let loaded = learner.model().try_load_record(model).map_err(|e| {
        DdpError::Job(JobError::Checkpoint {
            path: model_files.path(epoch).display().to_string(),
            what: "loading this rank's shards into the model",
            reason: e.to_string(),
        })
    })?;
    learner.load_model(loaded.into_record());
    learner.load_optim(fsdp.shard_optimizer_record_of(optim, &ids)?);
    learner.load_scheduler(sched);
    Ok(())
}

/// Refuses a Learner whose model `fsdp` did not shard: a parameter of several rows held whole
/// at a world size above 1 (the program built the Learner with the model itself).
///
/// # Errors
/// [`ModelError::Access`](burn_ddp_comm::ModelError::Access) naming the parameter and the fix.
pub(super) fn check_sharded<M: Module>(fsdp: &FullyShard, model: &M) -> Result<()> {
    if fsdp.group().world_size().as_usize() == 1 {
        return Ok(());
    }
    let whole = params_by_path(model).into_iter().find(|p| {
        let rows = p.dims.first().copied().unwrap_or(1);
        rows > 1 && !fsdp.shards(&p.id)
    });
    burn_ddp_comm::grad::refuse_whole_learner(fsdp.group().rank(), whole.map(|p| p.path))
}
