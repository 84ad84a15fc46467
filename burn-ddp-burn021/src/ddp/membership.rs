//! Fault-tolerant sessions (a group made by `burn-ddp run --fault-tolerant`): what a change of
//! membership does to a session, and a custom training loop's state carried across it (the
//! core's `LoopState`, over this line's `LoopSync`).
//!
//! After the group agrees on the next membership and the state moved to the ranks behind
//! (burn-ddp-comm's `grad::LoopState`), every rank prepares the session again on the new
//! membership: the reducer's partial step and its transports (host thread, NCCL communicator)
//! are dropped, the model is checked across ranks, marked, and the NCCL communicator is created
//! anew on the new ranks.

use std::marker::PhantomData;

use burn::module::AutodiffModule;
use burn::optim::Optimizer;
use burn::record::{BinBytesRecorder, FullPrecisionSettings, Record, Recorder};
use burn::tensor::backend::AutodiffBackend;
use burn_ddp_comm::grad::{LoopState, LoopSync};

use super::DdpSession;
use crate::group::{ProcessGroup, Rank};
use crate::{DdpError, Result};

fn record_bytes<B: burn::tensor::backend::Backend, R: Record<B>>(
    rank: Rank,
    record: R,
) -> Result<Vec<u8>> {
    Recorder::<B>::record(
        &BinBytesRecorder::<FullPrecisionSettings>::default(),
        record,
        (),
    )
    .map_err(|e| {
        DdpError::model_access(rank, "serialising the state to send to the ranks behind", e)
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
    .map_err(|e| DdpError::model_access(rank, "loading the state received from the source rank", e))
}

/// This line's [`LoopSync`]: a session, for models of backend `B`.
struct SessionLoop<'a, B>(&'a DdpSession, PhantomData<B>);

impl<B, M, O> LoopSync<M, O> for SessionLoop<'_, B>
where
    B: AutodiffBackend,
    M: AutodiffModule<B>,
    O: Optimizer<M, B>,
{
    fn group(&self) -> &ProcessGroup {
        &self.0.shared.pg
    }

    fn prepare(&mut self, model: M) -> Result<M> {
        self.0.prepare(model)
    }

    fn reprepare(&mut self, model: M) -> Result<M> {
        self.0.reprepare(model)
    }

    fn state_bytes(&self, model: &M, optim: &O) -> Result<[Vec<u8>; 2]> {
        let rank = self.0.shared.pg.rank();
        Ok([
            record_bytes::<B, _>(rank, model.clone().into_record())?,
            record_bytes::<B, _>(rank, optim.to_record())?,
        ])
    }

    fn load_state(&self, model: M, optim: O, [m, o]: [Vec<u8>; 2]) -> Result<(M, O)> {
        let rank = self.0.shared.pg.rank();
        let device = model.devices().into_iter().next().unwrap_or_default();
        let model_record = load_bytes::<B, M::Record>(rank, m, &device)?;
        let optim_record = load_bytes::<B, O::Record>(rank, o, &device)?;
        Ok((
            model.load_record(model_record),
            optim.load_record(optim_record),
        ))
    }
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
    /// thread, which the after-backward path shares, its NCCL communicator), the count of steps
    /// between replica checks.
    fn reset_transports(&self) {
        {
            let mut reducer = self.shared.reducer();
            reducer.abort_transports();
            *reducer = super::Reducer::new(&self.shared.pg, &self.shared.config);
        }
        *self
            .shared
            .replicas
            .lock()
            .unwrap_or_else(|p| p.into_inner()) =
            burn_ddp_comm::grad::ReplicaCheck::new(self.shared.config.check_replicas_every);
    }

    /// A custom loop's state for a fault-tolerant job (the model prepared as
    /// [`prepare`](Self::prepare) does: every rank starts from rank 0's weights), or, in a
    /// process that joined a running job, taken from the rank the job's state comes from.
    /// Carry it with [`step_boundary`](Self::step_boundary) and [`recover`](Self::recover).
    ///
    /// ```no_run
    /// # extern crate burn_ddp_burn021 as burn_ddp;
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
    /// let mut state = session.loop_state(model(), AdamConfig::new().init(), Vec::new())?;
    /// while state.step < 1000 {
    ///     let step = (|| {
    ///         session.step_boundary(&mut state)?; // lets waiting processes in
    ///         let grads = session.gradients(&state.model, loss(&state.model))?;
    ///         state.model = state.optim.step(1e-3, state.model.clone(), grads);
    ///         state.step += 1;
    ///         Ok(())
    ///     })();
    ///     if let Err(e) = step {
    ///         session.recover(e, &mut state)?; // the step that failed is run again
    ///     }
    ///     // `state.changed` is `Some` after a change: re-deal the data over the new ranks.
    /// }
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// As [`prepare`](Self::prepare); a joining process: the transfer's errors.
    pub fn loop_state<B, M, O>(&self, model: M, optim: O, extra: Vec<u8>) -> Result<LoopState<M, O>>
    where
        B: AutodiffBackend,
        M: AutodiffModule<B>,
        O: Optimizer<M, B>,
    {
        LoopState::start(
            &mut SessionLoop::<B>(self, PhantomData),
            model,
            optim,
            extra,
        )
    }

    /// At a step boundary of a fault-tolerant job: lets in the processes that asked to join (one
    /// small all-reduce, so that every rank decides at the same step), and moves the state to
    /// them (`LoopState::step_boundary`). Call it first thing in every step, and nowhere else.
    /// Nothing outside fault-tolerant jobs.
    ///
    /// # Errors
    /// Collective failures (recover from them with [`recover`](Self::recover)).
    pub fn step_boundary<B, M, O>(&self, state: &mut LoopState<M, O>) -> Result<()>
    where
        B: AutodiffBackend,
        M: AutodiffModule<B>,
        O: Optimizer<M, B>,
    {
        state.step_boundary(&mut SessionLoop::<B>(self, PhantomData))
    }

    /// After `cause` failed a step of a fault-tolerant job: agrees on the next membership, moves
    /// the state from the rank with the most steps to those behind it, and prepares the session
    /// on the new ranks (`LoopState::recover`). The step that failed is dropped: run it again.
    ///
    /// # Errors
    /// `cause` itself when it is not a failure of the group ([`DdpError::is_peer_failure`]) or
    /// the group is not fault-tolerant; [`MembershipError::TooFewRanks`](burn_ddp_comm::MembershipError::TooFewRanks); the store's errors.
    pub fn recover<B, M, O>(&self, cause: DdpError, state: &mut LoopState<M, O>) -> Result<()>
    where
        B: AutodiffBackend,
        M: AutodiffModule<B>,
        O: Optimizer<M, B>,
    {
        state.recover(&mut SessionLoop::<B>(self, PhantomData), cause)
    }
}
