//! A custom training loop in a fault-tolerant job (`burn-ddp run --fault-tolerant`) on Burn 0.22 or
//! 0.23: [`GradSync::loop_state`], [`GradSync::step_boundary`] and [`GradSync::recover`] carry a
//! [`LoopState`] (model, `ModuleOptimizer`, steps, the loop's own bytes) across changes of
//! membership. The protocol is the core's (`burn_ddp_comm::grad::LoopState`); this module gives it
//! the records of Burn's module and optimizer as bytes.

use burn::module::Module;
use burn::optim::{ModuleOptimizer, OptimizerRecord};
use burn::tensor::Bytes;
use burn_ddp_comm::grad::{LoopState, LoopSync, Replica};

use crate::sync::AsReplica;
use crate::{DdpError, GradSync, ProcessGroup, Result};

impl<M: Module> LoopSync<M, ModuleOptimizer> for GradSync {
    fn group(&self) -> &ProcessGroup {
        GradSync::group(self)
    }

    fn prepare(&mut self, model: M) -> Result<M> {
        GradSync::prepare(self, model)
    }

    fn reprepare(&mut self, model: M) -> Result<M> {
        GradSync::reprepare(self, model)
    }

    fn state_bytes(&self, model: &M, optim: &ModuleOptimizer) -> Result<[Vec<u8>; 2]> {
        let rank = self.group().rank();
        let model = AsReplica(model.clone()).record_bytes(rank)?;
        let optim = optim.to_record().into_bytes().map_err(|e| {
            DdpError::model_access(rank, "serialising the optimizer's state to send", e)
        })?;
        Ok([model, optim.to_vec()])
    }

    fn load_state(
        &self,
        model: M,
        optim: ModuleOptimizer,
        [m, o]: [Vec<u8>; 2],
    ) -> Result<(M, ModuleOptimizer)> {
        let rank = self.group().rank();
        let AsReplica(model) = AsReplica(model).load_record_bytes(rank, m)?;
        let record = OptimizerRecord::from_bytes(Bytes::from_bytes_vec(o)).map_err(|e| {
            DdpError::model_access(rank, "reading the optimizer's state received", e)
        })?;
        Ok((model, optim.load_record(record)))
    }
}

impl GradSync {
    /// A custom loop's state for a fault-tolerant job (the model prepared as
    /// [`prepare`](Self::prepare) does: every rank starts from rank 0's weights), or, in a
    /// process that joined a running job, taken from the rank the job's state comes from.
    /// Carry it with [`step_boundary`](Self::step_boundary) and [`recover`](Self::recover).
    ///
    /// ```no_run
    /// # #[cfg(feature = "burn-0-22")] extern crate burn022 as burn;
    /// # #[cfg(feature = "burn-0-23")] extern crate burn023 as burn;
    /// # use burn::module::Module;
    /// # use burn::optim::{AdamConfig, GradientsParams};
    /// use burn_ddp::{DdpConfig, GradSync, ProcessGroup};
    /// # fn model() -> burn::nn::Linear { burn::nn::LinearConfig::new(4, 1).init(&Default::default()) }
    /// # fn loss(m: &burn::nn::Linear) -> burn::Tensor<1> {
    /// #     m.forward(burn::Tensor::<2>::zeros([2, 4], &Default::default())).mean()
    /// # }
    ///
    /// # fn main() -> burn_ddp::Result<()> {
    /// // Under `burn-ddp run --fault-tolerant`:
    /// let mut sync = GradSync::new(ProcessGroup::from_env()?, DdpConfig::default())?;
    /// let mut state = sync.loop_state(model(), AdamConfig::new().init(), Vec::new())?;
    /// while state.step < 1000 {
    ///     let step = (|| {
    ///         sync.step_boundary(&mut state)?; // lets waiting processes in
    ///         let grads = GradientsParams::from_grads(loss(&state.model).backward(), &state.model);
    ///         let grads = sync.sync(&state.model, grads)?;
    ///         state.model = state.optim.step(1e-3, state.model.clone(), grads);
    ///         state.step += 1;
    ///         Ok(())
    ///     })();
    ///     if let Err(e) = step {
    ///         sync.recover(e, &mut state)?; // the step that failed is run again
    ///     }
    ///     // `state.changed` is `Some` after a change: re-deal the data over the new ranks.
    /// }
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// As [`prepare`](Self::prepare); a joining process: the transfer's errors.
    pub fn loop_state<M: Module>(
        &mut self,
        model: M,
        optim: ModuleOptimizer,
        extra: Vec<u8>,
    ) -> Result<LoopState<M, ModuleOptimizer>> {
        LoopState::start(self, model, optim, extra)
    }

    /// At a step boundary of a fault-tolerant job: lets in the processes that asked to join
    /// (one small all-reduce, so that every rank decides at the same step), and moves the
    /// state to them (`LoopState::step_boundary`). Call it first thing in every step, and
    /// nowhere else. Nothing outside fault-tolerant jobs.
    ///
    /// # Errors
    /// Collective failures (recover from them with [`recover`](Self::recover)).
    pub fn step_boundary<M: Module>(
        &mut self,
        state: &mut LoopState<M, ModuleOptimizer>,
    ) -> Result<()> {
        state.step_boundary(self)
    }

    /// After `cause` failed a step of a fault-tolerant job: agrees on the next membership,
    /// moves the state from the rank with the most steps to those behind it, and prepares this
    /// sync on the new ranks (`LoopState::recover`). The step that failed is dropped: run it
    /// again.
    ///
    /// # Errors
    /// `cause` itself when it is not a failure of the group ([`DdpError::is_peer_failure`]) or
    /// the group is not fault-tolerant; [`MembershipError::TooFewRanks`](burn_ddp_comm::MembershipError::TooFewRanks); the store's errors.
    pub fn recover<M: Module>(
        &mut self,
        cause: DdpError,
        state: &mut LoopState<M, ModuleOptimizer>,
    ) -> Result<()> {
        state.recover(self, cause)
    }
}
