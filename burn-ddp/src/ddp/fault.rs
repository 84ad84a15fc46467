//! Fault-tolerant sessions (a group made by `burn-ddp run --fault-tolerant`): what a change of
//! membership does to a session and to a training loop's state.
//!
//! The group agrees on the next membership (burn-ddp-comm's `ProcessGroup::recover`, `grow`,
//! `rejoin`, a joining process's admission); then the rank with the most progress sends its
//! state to the ranks behind it (point to point, only to them), and every rank prepares the
//! session again on the new membership: the reducer's partial step and its transports (host
//! thread, NCCL communicator) are dropped, the model is checked across ranks, marked, and the
//! NCCL communicator is created anew on the new ranks. A step that failed is dropped whole: no
//! optimizer step was taken on a rank whose synchronisation failed, so the ranks that recover
//! at equal progress hold equal replicas.

use burn::module::AutodiffModule;
use burn::optim::Optimizer;
use burn::record::{BinBytesRecorder, FullPrecisionSettings, Record, Recorder};
use burn::tensor::backend::AutodiffBackend;

use burn_ddp_comm::group::handover::{frame, move_state, unframe};
use burn_ddp_comm::group::Recovery;

use super::DdpSession;
use crate::group::Rank;
use crate::{DdpError, ReduceOp, Result};

/// The state of a custom training loop that a fault-tolerant session carries across changes of
/// membership ([`DdpSession::replica`], [`DdpSession::step_boundary`], [`DdpSession::recover`]):
/// the model, the optimizer, the number of optimizer steps taken, and any bytes of the loop's
/// own (its data position, a scheduler's state).
///
/// ```no_run
/// # use burn::backend::{Autodiff, NdArray};
/// # use burn::optim::{AdamConfig, GradientsParams, Optimizer};
/// # use burn::tensor::Tensor;
/// # fn model() -> burn::nn::Linear<Autodiff<burn_ddp::Ddp<NdArray>>> {
/// #     burn::nn::LinearConfig::new(4, 1).init(&Default::default())
/// # }
/// # fn loss(m: &burn::nn::Linear<Autodiff<burn_ddp::Ddp<NdArray>>>) -> Tensor<Autodiff<burn_ddp::Ddp<NdArray>>, 1> {
/// #     m.forward(Tensor::<_, 2>::zeros([2, 4], &Default::default())).sum()
/// # }
/// use burn_ddp::{DdpConfig, DdpSession, ProcessGroup};
///
/// # fn main() -> burn_ddp::Result<()> {
/// // Under `burn-ddp run --fault-tolerant`:
/// let session = DdpSession::new(ProcessGroup::from_env()?, DdpConfig::default())?;
/// let mut replica = session.replica(model(), AdamConfig::new().init(), Vec::new())?;
/// while replica.step < 1000 {
///     let step = (|| {
///         session.step_boundary(&mut replica)?; // lets waiting processes in
///         let grads = session.gradients(&replica.model, loss(&replica.model))?;
///         replica.model = replica.optim.step(1e-3, replica.model.clone(), grads);
///         replica.step += 1;
///         Ok(())
///     })();
///     if let Err(e) = step {
///         session.recover(e, &mut replica)?; // the step that failed is run again
///     }
///     // `replica.changed` is `Some` after a change: re-deal the data over the new ranks.
/// }
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct Replica<M, O> {
    /// The prepared model.
    pub model: M,
    /// The optimizer.
    pub optim: O,
    /// Optimizer steps taken: the rank with the most is the source of the others' state.
    /// Count a step once its optimizer step is done (never for a step whose synchronisation
    /// failed).
    pub step: u64,
    /// Whatever else the loop must resume with (moved with the state).
    pub extra: Vec<u8>,
    /// The last change of membership (set by the call that made it; the loop re-deals its data
    /// over the new ranks when it is `Some`).
    pub changed: Option<Recovery>,
}

fn record_bytes<B: burn::tensor::backend::Backend, R: Record<B>>(
    rank: Rank,
    record: R,
) -> Result<Vec<u8>> {
    Recorder::<B>::record(
        &BinBytesRecorder::<FullPrecisionSettings>::default(),
        record,
        (),
    )
    .map_err(|e| DdpError::Model {
        rank,
        what: "serialising the state to send to the ranks behind",
        reason: e.to_string(),
    })
}

fn load_bytes<B: burn::tensor::backend::Backend, R: Record<B>>(
    rank: Rank,
    bytes: Vec<u8>,
    device: &B::Device,
) -> Result<R> {
    Recorder::<B>::load(
        &BinBytesRecorder::<FullPrecisionSettings>::default(),
        bytes,
        device,
    )
    .map_err(|e| DdpError::Model {
        rank,
        what: "loading the state received from the source rank",
        reason: e.to_string(),
    })
}

impl DdpSession {
    /// Whether this session's group is fault-tolerant.
    pub fn is_fault_tolerant(&self) -> bool {
        self.shared.pg.is_fault_tolerant()
    }

    /// After a change of membership, on every rank of the new one, with the ranks' models
    /// equal (the ranks behind took the source's): drops the reducer's partial step and its
    /// transports, then checks the model across the new ranks, marks it and builds its bucket
    /// plan (and the NCCL communicator of `Autodiff<Ddp<Cuda>>`), as
    /// [`prepare`](Self::prepare) does without loading rank 0's weights.
    ///
    /// # Errors
    /// As [`prepare`](Self::prepare).
    pub fn reprepare<B: AutodiffBackend, M: AutodiffModule<B>>(&self, model: M) -> Result<M> {
        self.reset_transports();
        let skip = self.skip();
        let skip: Vec<&str> = skip.iter().map(String::as_str).collect();
        self.prepare_with(model, &skip, false)
    }

    /// Drops what belongs to the membership before: the reducer (its partial step, its host
    /// thread, its NCCL communicator), the after-backward path's thread, the count of steps
    /// between replica checks.
    fn reset_transports(&self) {
        {
            let mut reducer = self.shared.reducer();
            reducer.abort_transports();
            *reducer = super::Reducer::new(&self.shared.pg, &self.shared.config);
        }
        *self.shared.host.lock().unwrap_or_else(|p| p.into_inner()) = None;
        *self
            .shared
            .replicas
            .lock()
            .unwrap_or_else(|p| p.into_inner()) =
            burn_ddp_comm::grad::ReplicaCheck::new(self.shared.config.check_replicas_every);
    }

    /// A custom loop's state, prepared (as [`prepare`](Self::prepare) does: every rank starts
    /// from rank 0's weights), or, in a process that joined a running fault-tolerant job, taken
    /// from the rank the job's state comes from.
    ///
    /// # Errors
    /// As [`prepare`](Self::prepare); a joining process: the transfer's errors.
    pub fn replica<B, M, O>(&self, model: M, optim: O, extra: Vec<u8>) -> Result<Replica<M, O>>
    where
        B: AutodiffBackend,
        M: AutodiffModule<B>,
        O: Optimizer<M, B>,
    {
        let mut replica = Replica {
            model,
            optim,
            step: 0,
            extra,
            changed: None,
        };
        match self.shared.pg.take_admission() {
            Some(rec) => self.move_state_and_prepare(replica, rec),
            None => {
                replica.model = self.prepare(replica.model)?;
                Ok(replica)
            }
        }
    }

    /// At a step boundary of a fault-tolerant job: lets in the processes that asked to join (one
    /// small all-reduce, so that every rank decides at the same step), and moves the state to
    /// them. Call it first thing in every step, and nowhere else: a joining process comes to
    /// it from [`replica`](Self::replica), a rank that recovered from a failure from
    /// [`recover`](Self::recover). Nothing outside fault-tolerant jobs.
    ///
    /// # Errors
    /// Collective failures (recover from them with [`recover`](Self::recover)).
    pub fn step_boundary<B, M, O>(&self, replica: &mut Replica<M, O>) -> Result<()>
    where
        B: AutodiffBackend,
        M: AutodiffModule<B>,
        O: Optimizer<M, B>,
    {
        replica.changed = None;
        let pg = &self.shared.pg;
        if !pg.is_fault_tolerant() {
            return Ok(());
        }
        // After letting processes in, the boundary is asked again: the newcomers come to it
        // from their admission (`replica`), as the ranks that recover from a failure come to
        // it from the failed step, so every rank's next collective is this one.
        loop {
            let mut join = [i64::from(pg.join_pending())];
            pg.all_reduce(&mut join, ReduceOp::Max)?;
            if join[0] == 0 {
                return Ok(());
            }
            let rec = match pg.grow(Some(replica.step)) {
                Ok(rec) => rec,
                Err(DdpError::Excluded { .. }) => pg.rejoin()?,
                Err(e) => return Err(e),
            };
            *replica = self.move_state_and_prepare(replica.clone(), rec)?;
        }
    }

    /// After `cause` failed a step of a fault-tolerant job: agrees on the next membership with
    /// the ranks that can still reach the job's store, moves the state from the rank with the
    /// most steps to those behind it, and prepares the session on the new ranks. The step that
    /// failed is dropped: run it again. A rank the others went on without joins again (and is
    /// then behind). Failures during the recovery start it again.
    ///
    /// # Errors
    /// `cause` itself when it is not a failure of the group ([`DdpError::is_peer_failure`]) or
    /// the group is not fault-tolerant; [`DdpError::TooFewRanks`]; the store's errors.
    pub fn recover<B, M, O>(&self, cause: DdpError, replica: &mut Replica<M, O>) -> Result<()>
    where
        B: AutodiffBackend,
        M: AutodiffModule<B>,
        O: Optimizer<M, B>,
    {
        let pg = &self.shared.pg;
        if !pg.is_fault_tolerant() || !cause.is_peer_failure() {
            return Err(cause);
        }
        let rec = match pg.recover(&cause, Some(replica.step)) {
            Ok(rec) => rec,
            Err(DdpError::Excluded { .. }) => pg.rejoin()?,
            Err(e) => return Err(e),
        };
        *replica = self.move_state_and_prepare(replica.clone(), rec)?;
        Ok(())
    }

    /// The state moved from the source to the ranks behind, then the session prepared again;
    /// a failure of the group meanwhile starts the recovery again.
    fn move_state_and_prepare<B, M, O>(
        &self,
        replica: Replica<M, O>,
        mut rec: Recovery,
    ) -> Result<Replica<M, O>>
    where
        B: AutodiffBackend,
        M: AutodiffModule<B>,
        O: Optimizer<M, B>,
    {
        let pg = self.shared.pg.clone();
        loop {
            match self.take_state(replica.clone(), &rec) {
                Ok(mut r) => {
                    r.changed = Some(rec);
                    return Ok(r);
                }
                Err(e) if e.is_peer_failure() => {
                    tracing::warn!(
                        "[rank {}] the recovery failed: {e}; agreeing again",
                        pg.rank()
                    );
                    rec = match pg.recover(&e, Some(replica.step)) {
                        Ok(rec) => rec,
                        Err(DdpError::Excluded { .. }) => pg.rejoin()?,
                        Err(e) => return Err(e),
                    };
                }
                Err(e) => return Err(e),
            }
        }
    }

    fn take_state<B, M, O>(&self, replica: Replica<M, O>, rec: &Recovery) -> Result<Replica<M, O>>
    where
        B: AutodiffBackend,
        M: AutodiffModule<B>,
        O: Optimizer<M, B>,
    {
        let pg = &self.shared.pg;
        let rank = pg.rank();
        let received = move_state(pg, rec, || {
            let model = record_bytes::<B, _>(rank, replica.model.clone().into_record())?;
            let optim = record_bytes::<B, _>(rank, replica.optim.to_record())?;
            Ok(frame(&[
                &replica.step.to_le_bytes(),
                &model,
                &optim,
                &replica.extra,
            ]))
        })?;
        let mut replica = match received {
            None => replica,
            Some(bytes) => self.load_state(replica, bytes)?,
        };
        replica.model = self.reprepare(replica.model)?;
        Ok(replica)
    }

    fn load_state<B, M, O>(&self, replica: Replica<M, O>, bytes: Vec<u8>) -> Result<Replica<M, O>>
    where
        B: AutodiffBackend,
        M: AutodiffModule<B>,
        O: Optimizer<M, B>,
    {
        let rank = self.shared.pg.rank();
        let bad = |why: &str| DdpError::Model {
            rank,
            what: "taking the state of the source rank",
            reason: why.to_owned(),
        };
        let [step, model_bytes, optim_bytes, extra] =
            unframe(&bytes).ok_or_else(|| bad("the bytes received are not a framed state"))?;
        let step = <[u8; 8]>::try_from(step.as_slice())
            .map(u64::from_le_bytes)
            .map_err(|_| bad("no step count"))?;
        let device = replica
            .model
            .devices()
            .into_iter()
            .next()
            .unwrap_or_default();
        let model_record = load_bytes::<B, M::Record>(rank, model_bytes, &device)?;
        let optim_record = load_bytes::<B, O::Record>(rank, optim_bytes, &device)?;
        tracing::info!("[rank {rank}] took the state of step {step} from another rank");
        Ok(Replica {
            model: replica.model.load_record(model_record),
            optim: replica.optim.load_record(optim_record),
            step,
            extra,
            changed: None,
        })
    }
}
