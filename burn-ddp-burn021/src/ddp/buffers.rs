//! `DdpSession::sync_buffers`: rank 0's buffers on every rank, as PyTorch DDP's
//! `broadcast_buffers=True` does before each forward.
//!
//! A buffer is a float tensor of the model that takes no gradient: BatchNorm's running mean and
//! variance (Burn's `RunningState`), and frozen parameters (which are equal already, and cost
//! their bytes). Each rank updates its running statistics from its own batches, so without this
//! the ranks validate with different statistics and a checkpoint holds rank 0's alone. All of a
//! model's buffers travel in one broadcast (one bucket), as f32 through the host.

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::tensor::backend::Backend;
use burn::tensor::Tensor;

use burn_ddp_comm::grad::{broadcast_buffers, FlatValues, JoinCall};

use super::model::Path;
use super::values::filled_like;
use super::DdpSession;
use crate::group::Rank;
use crate::Result;

/// The buffers' values, in visit order, outside skipped fields.
struct Gather<'a> {
    path: Path,
    skip: &'a [String],
    values: Vec<f32>,
    /// A buffer that could not be read as f32 (zeros were sent in its place).
    unreadable: Option<String>,
}

impl<B: Backend> ModuleVisitor<B> for Gather<'_> {
    fn enter_module(&mut self, name: &str, _container: &str) {
        self.path.0.push(name.to_owned());
    }
    fn exit_module(&mut self, _name: &str, _container: &str) {
        self.path.0.pop();
    }
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let t = param.val();
        if t.is_require_grad() || self.path.skipped(self.skip) {
            return;
        }
        let n = t.shape().num_elements();
        match t.into_data().convert::<f32>().into_vec::<f32>() {
            Ok(v) => self.values.extend(v),
            // Zeros keep the collective in step on every rank; the error comes after it.
            Err(e) => {
                self.values.extend(std::iter::repeat_n(0.0, n));
                let name = self.path.0.join(".");
                self.unreadable.get_or_insert(format!("{name}: {e:?}"));
            }
        }
    }
}

/// Counts the buffers, reading nothing.
struct Count<'a> {
    path: Path,
    skip: &'a [String],
    count: usize,
}

impl<B: Backend> ModuleVisitor<B> for Count<'_> {
    fn enter_module(&mut self, name: &str, _container: &str) {
        self.path.0.push(name.to_owned());
    }
    fn exit_module(&mut self, _name: &str, _container: &str) {
        self.path.0.pop();
    }
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if !param.val().is_require_grad() && !self.path.skipped(self.skip) {
            self.count += 1;
        }
    }
}

/// Puts the broadcast values back, in the same order.
struct Scatter<'a> {
    path: Path,
    skip: &'a [String],
    values: FlatValues<'a>,
}

impl<B: Backend> ModuleMapper<B> for Scatter<'_> {
    fn enter_module(&mut self, name: &str, _container: &str) {
        self.path.0.push(name.to_owned());
    }
    fn exit_module(&mut self, _name: &str, _container: &str) {
        self.path.0.pop();
    }
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        if param.is_require_grad() || self.path.skipped(self.skip) {
            return param;
        }
        let Some(values) = self.values.next(param.shape().num_elements()) else {
            return param;
        };
        let (id, tensor, mapper) = param.consume();
        Param::from_mapped_value(id, filled_like(&tensor, values), mapper)
    }
}

impl DdpSession {
    /// Rank 0's buffers on every rank (PyTorch DDP's `broadcast_buffers=True`): BatchNorm's
    /// running statistics, and any other float tensor of the model that takes no gradient,
    /// outside `#[ddp(skip)]` fields, in one broadcast. Call it where PyTorch would, before each
    /// training forward (`model = session.sync_buffers(model)?;`), or at least before
    /// validating and checkpointing; `DdpStrategy` does it before every training step and after
    /// the last one of each epoch. Inside [`DdpSession::join`] the lowest rank still training
    /// sends them. Every rank must call it at the same point. It returns
    /// `model` unchanged when `DdpConfig::broadcast_buffers` is off, at world size 1, or when
    /// the model has no buffers.
    ///
    /// # Errors
    /// A buffer that cannot be read as f32 ([`ModelError::Access`](crate::ModelError::Access), after the broadcast, so the
    /// other ranks are not left waiting); collective failures (ranks whose buffers differ in
    /// size fail in the broadcast, which compares lengths).
    pub fn sync_buffers<B: Backend, M: Module<B>>(&self, model: M) -> Result<M> {
        if !self.buffers_to_sync(&model) {
            return Ok(model);
        }
        // Inside a join: announced first, and sent by the lowest rank still training.
        let root = match self.shared.announce(JoinCall::Buffers)? {
            Some(round) => round.root(),
            None => Rank(0),
        };
        self.broadcast_buffers(model, root)
    }

    /// [`DdpSession::sync_buffers`] from `root`, for a caller that has asked
    /// [`DdpSession::buffers_to_sync`] already (and without the announcement of a join).
    pub(crate) fn broadcast_buffers<B: Backend, M: Module<B>>(
        &self,
        model: M,
        root: Rank,
    ) -> Result<M> {
        let pg = &self.shared.pg;
        let skip = self.skip();
        // Burn's `RunningState` keeps its last update pending (per thread) until it is synced,
        // and folds a pending update in at the next forward: `into_record` syncs it (on a
        // clone, which shares the state), so that what is read is current and nothing local
        // is left pending to overwrite rank 0's values.
        drop(model.clone().into_record());
        let mut gather = Gather {
            path: Path::default(),
            skip: &skip,
            values: Vec::new(),
            unreadable: None,
        };
        model.visit(&mut gather);
        let values = broadcast_buffers(pg, gather.values, gather.unreadable, root)?;
        Ok(model.map(&mut Scatter {
            path: Path::default(),
            skip: &skip,
            values: FlatValues::new(&values),
        }))
    }
}

impl DdpSession {
    /// Whether [`DdpSession::sync_buffers`] has anything to do with `model`: broadcasting is on,
    /// there are several ranks, and the model has buffers (the same answer on every rank:
    /// `prepare` checked that the models are the same).
    pub(crate) fn buffers_to_sync<B: Backend, M: Module<B>>(&self, model: &M) -> bool {
        if !self.shared.config.broadcast_buffers || self.shared.pg.world_size().get() == 1 {
            return false;
        }
        let skip = self.skip();
        let mut count = Count {
            path: Path::default(),
            skip: &skip,
            count: 0,
        };
        model.visit(&mut count);
        count.count > 0
    }

    pub(super) fn skip(&self) -> Vec<String> {
        self.shared
            .skip
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}
