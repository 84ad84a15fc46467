//! `DdpSession::join`: uneven inputs (PyTorch's `Join`), on the protocol of
//! `burn_ddp_comm::grad::Join`.
//!
//! Inside a join, each synchronising call of a rank that still trains is announced first: a
//! synchronised backward (from the `begin_backward` hook, so the overlapped reducer works as
//! usual), `sync_gradients`, `sync_buffers`. A rank that ran out shadows the announced calls
//! (zeros for gradients, the broadcast of buffers from the lowest rank still training), and
//! the mean of gradients is rescaled to the ranks still training by `complete` (or
//! `sync_gradients`). At the end every rank loads the model of the rank that trained longest.

use burn::module::AutodiffModule;
use burn::optim::GradientsParams;
use burn::tensor::backend::AutodiffBackend;
use burn_ddp_comm::grad::{JoinCall, Round};

use super::model::{Mark, Path};
use super::{DdpSession, SessionState};
use crate::Result;

/// A rank's uneven-input mode: the protocol's state, and the factor of the last synchronised
/// backward that `complete` has not applied yet.
/// What a synchronised backward's announcement says when the one before it never went
/// through `complete`.
const COMPLETE_HINT: &str = "did not go through DdpSession::complete: inside a join, take each \
     step's gradients with DdpSession::gradients(&model, loss), or pass them through \
     DdpSession::complete(&model, grads), so that the mean is over the ranks still training";

impl SessionState {
    /// Inside a join, announces `call` (a rank that still trains) and returns the round;
    /// `None` outside a join.
    ///
    /// # Errors
    /// The protocol's (different calls on different ranks, collective failures); a synchronised
    /// backward whose gradients never went through `complete` (after the announcement, so that
    /// the ranks stay in step).
    pub(crate) fn announce(&self, call: JoinCall) -> Result<Option<Round>> {
        match call {
            JoinCall::Backward => {
                self.join
                    .announce_backward(&self.pg, self.config.reduction, COMPLETE_HINT)
            }
            _ => self.join.announce(&self.pg, call),
        }
    }
}

impl DdpSession {
    /// Trains with **uneven inputs** (PyTorch's `Join`): `train` runs this rank's loop, which
    /// may have more or fewer batches than the other ranks'. Inside it, every synchronised
    /// backward, [`sync_gradients`](Self::sync_gradients) and
    /// [`sync_buffers`](Self::sync_buffers) first tell every rank which ranks still train (one
    /// small all-reduce). When `train` returns, this rank shadows the others' calls until every
    /// rank has returned: it joins their gradient all-reduces with zeros and no presence, and
    /// their broadcast of buffers. So:
    ///
    /// - a mean of gradients is over the ranks still training (the ranks that ran out are
    ///   counted out of the average; PyTorch's `divide_by_initial_world_size=False`): with
    ///   equal shards, a step in which only some ranks train is the step one process would
    ///   take on those ranks' batches. Take each step's gradients with
    ///   [`gradients`](Self::gradients) (or pass them through [`complete`](Self::complete)),
    ///   which applies that mean; a step that skips it is an error at the next backward;
    /// - buffers are broadcast by the lowest rank still training;
    /// - at the end, every rank takes the whole model (parameters and buffers, not
    ///   `#[ddp(skip)]` fields) of the rank that trained longest (the lowest such), so the
    ///   replicas are equal again; `join` returns it.
    ///
    /// Optimizer state is each rank's own: a rank that ran out did not step, so a stateful
    /// optimizer's moments (Adam's) lag by the steps it sat out, as with PyTorch's `Join`.
    /// The periodic comparison of replicas pauses inside a join. Without `join`, ranks with
    /// different numbers of batches fail: the first rank to finish leaves the job, and the
    /// others' next collective names it ([`CollectiveError::PeerFinished`](crate::CollectiveError::PeerFinished)).
    ///
    /// ```no_run
    /// # extern crate burn_ddp_burn021 as burn_ddp;
    /// # use burn::backend::{Autodiff, NdArray};
    /// # use burn::optim::{Optimizer, SgdConfig};
    /// # use burn_ddp::{Ddp, DdpConfig, DdpSession, ProcessGroup};
    /// # type B = Autodiff<Ddp<NdArray>>;
    /// # fn main() -> burn_ddp::Result<()> {
    /// # let device = Default::default();
    /// # let session = DdpSession::new(ProcessGroup::from_env()?, DdpConfig::default())?;
    /// # let model = session.prepare(burn::nn::LinearConfig::new(4, 1).init::<B>(&device))?;
    /// # let my_batches: Vec<burn::tensor::Tensor<B, 2>> = Vec::new();
    /// let mut optim = SgdConfig::new().init();
    /// let model = session.join(model, |session, mut model| {
    ///     for x in my_batches {                    // as many as this rank has
    ///         let loss = model.forward(x).mean();
    ///         let grads = session.gradients(&model, loss)?;
    ///         model = optim.step(0.1, model, grads);
    ///     }
    ///     Ok(model)
    /// })?;
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// What `train` returns (this rank then leaves the join at once, and the other ranks'
    /// next collective fails naming it); ranks that make different calls inside the join
    /// (naming who calls what); a nested `join`; `prepare` was not called; collective
    /// failures.
    pub fn join<B, M, F>(&self, model: M, train: F) -> Result<M>
    where
        B: AutodiffBackend,
        M: AutodiffModule<B>,
        F: FnOnce(&Self, M) -> Result<M>,
    {
        let pg = &self.shared.pg;
        burn_ddp_comm::grad::NotCarried::Join.refuse_on(pg)?;
        let prepared = !self.shared.reducer().params().is_empty();
        self.shared.join.enter(pg, "DdpSession", prepared)?;
        let finished = train(self, model).and_then(|model| {
            self.shadow(&model)?;
            Ok(model)
        });
        let (model, authority) = self.shared.join.leave(pg, finished)?;
        let skip = self.skip();
        let model = self.load_from::<B, M>(model, authority, &skip)?;
        Ok(model.map(&mut Mark {
            path: Path::default(),
            skip: &skip,
        }))
    }

    fn shadow<B: AutodiffBackend, M: AutodiffModule<B>>(&self, model: &M) -> Result<()> {
        self.shared
            .join
            .shadow(&self.shared.pg, |round| match round.call() {
                Some(JoinCall::Backward) => self.shared.reducer().shadow(),
                Some(JoinCall::Gradients) => self
                    .reduce_after_backward(model, GradientsParams::new())
                    .map(drop),
                Some(JoinCall::Buffers) => self
                    .broadcast_buffers(model.clone(), round.root())
                    .map(drop),
                // Never: a round to shadow always has a call.
                None => Ok(()),
            })
    }
}
