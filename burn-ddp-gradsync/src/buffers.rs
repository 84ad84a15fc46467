//! [`GradSync::sync_buffers`]: rank 0's buffers on every rank, as PyTorch DDP's
//! `broadcast_buffers=True` does before each forward.
//!
//! A buffer is a float tensor of the model that takes no gradient: BatchNorm's running mean and
//! variance (Burn's `RunningState`), and frozen parameters (which are equal already, and cost
//! their bytes). Each rank updates its running statistics from its own batches, so without this
//! the ranks validate with different statistics and a checkpoint holds rank 0's alone. All of a
//! model's buffers travel in one broadcast (one bucket), as f32 through the host.

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::tensor::Tensor;
use burn_ddp_comm::grad::{broadcast_buffers, FlatValues, JoinCall};
use burn_ddp_comm::{Rank, Result};

use crate::grads::filled_like;
use crate::GradSync;

/// Whether a float tensor of the model is a buffer (what the plan of trainable parameters
/// leaves out).
fn is_buffer<const D: usize>(param: &Param<Tensor<D>>) -> bool {
    !param.is_require_grad()
}

/// The buffers' values, in visit order.
#[derive(Default)]
struct Gather {
    path: Vec<String>,
    values: Vec<f32>,
    /// A buffer that could not be read as f32 (zeros were sent in its place).
    unreadable: Option<String>,
}

impl ModuleVisitor for Gather {
    fn enter_module(&mut self, name: &str, _container: &str) {
        self.path.push(name.to_owned());
    }
    fn exit_module(&mut self, _name: &str, _container: &str) {
        self.path.pop();
    }
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if !is_buffer(param) {
            return;
        }
        let t = param.val();
        let n = t.shape().num_elements();
        let values = t.try_into_data().map_err(|e| e.to_string()).and_then(|d| {
            d.convert::<f32>()
                .try_into_vec::<f32>()
                .map_err(|e| format!("{e:?}"))
        });
        match values {
            Ok(v) => self.values.extend(v),
            // Zeros keep the collective in step on every rank; the error comes after it.
            Err(e) => {
                self.values.extend(std::iter::repeat_n(0.0, n));
                let name = self.path.join(".");
                self.unreadable.get_or_insert(format!("{name}: {e}"));
            }
        }
    }
}

/// Counts the buffers, reading nothing.
#[derive(Default)]
struct Count(usize);

impl ModuleVisitor for Count {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if is_buffer(param) {
            self.0 += 1;
        }
    }
}

/// Puts the broadcast values back, in the same order, on each buffer's device and in its dtype.
struct Scatter<'a> {
    values: FlatValues<'a>,
}

impl ModuleMapper for Scatter<'_> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        if !is_buffer(&param) {
            return param;
        }
        let Some(values) = self.values.next(param.shape().num_elements()) else {
            return param;
        };
        let (id, tensor, mapper) = param.consume();
        Param::from_mapped_value(id, filled_like(&tensor, values), mapper)
    }
}

impl GradSync {
    /// Rank 0's buffers on every rank (PyTorch DDP's `broadcast_buffers=True`): BatchNorm's
    /// running statistics, and any other float tensor of the model that takes no gradient, in
    /// one broadcast. Call it where PyTorch would, before each training forward
    /// (`model = sync.sync_buffers(model)?;`), or at least before validating and
    /// checkpointing; `DdpStrategy` does it before every training step and after the last one
    /// of each epoch. Inside [`GradSync::join`] the lowest rank still training sends them.
    /// Every rank must call it at the same point. It returns `model` unchanged when
    /// `DdpConfig::broadcast_buffers` is off, at world size 1, or when the model has no
    /// buffers.
    ///
    /// # Errors
    /// A buffer that cannot be read as f32 ([`ModelError::Access`](burn_ddp_comm::ModelError::Access),
    /// after the broadcast, so the other ranks are not left waiting); collective failures (ranks whose buffers differ in
    /// size fail in the broadcast, which compares lengths).
    pub fn sync_buffers<M: Module>(&mut self, model: M) -> Result<M> {
        if !self.buffers_to_sync(&model) {
            return Ok(model);
        }
        // Inside a join: announced first, and sent by the lowest rank still training.
        let root = self
            .join
            .announce(self.group(), JoinCall::Buffers)?
            .map_or(Rank(0), |round| round.root());
        self.broadcast_buffers(model, root)
    }

    /// The broadcast of [`GradSync::sync_buffers`], from `root`, without the announcement of
    /// a join.
    pub(crate) fn broadcast_buffers<M: Module>(&self, model: M, root: Rank) -> Result<M> {
        let pg = self.group();
        // Burn's `RunningState` keeps each thread's last update pending until it is synced
        // (what it hands a visitor is the value before it), and folds a pending update in at
        // the next one: `valid` syncs it (on a copy that shares the state), so that what is
        // read is current and nothing local is left pending to overwrite rank 0's values.
        drop(model.valid());
        let mut gather = Gather::default();
        model.visit(&mut gather);
        let values = broadcast_buffers(pg, gather.values, gather.unreadable, root)?;
        Ok(model.map(&mut Scatter {
            values: FlatValues::new(&values),
        }))
    }

    /// Whether [`GradSync::sync_buffers`] has anything to do with `model`: broadcasting is on,
    /// there are several ranks, and the model has buffers (the same answer on every rank:
    /// `prepare` checked that the models are the same).
    pub(crate) fn buffers_to_sync<M: Module>(&self, model: &M) -> bool {
        if !self.config().broadcast_buffers || self.group().world_size().get() == 1 {
            return false;
        }
        let mut count = Count::default();
        model.visit(&mut count);
        count.0 > 0
    }
}
