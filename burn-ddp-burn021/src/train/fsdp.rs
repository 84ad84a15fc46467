//! [`DdpStrategy::fsdp`](super::DdpStrategy::fsdp) on Burn 0.21: burn-train's Learner over a
//! model sharded by [`FullyShard`]. The strategy is generic over any Learner, while FSDP's calls
//! name the backend, the model and the optimizer (Burn 0.21's optimizer state is typed by the
//! optimizer: [`FsdpOptimizer`]); the program names them once, in `DdpStrategy::fsdp::<AB, M,
//! O>`, which keeps [`Typed`] behind [`ShardedLearner`], whose calls take the Learner's model and
//! records as `Any` and say so when they are of other types.
//!
//! As on Burn 0.22/0.23, the program builds the Learner with this rank's shards; every rank's
//! part of an epoch's end writes one whole checkpoint (here the model gathered on the device,
//! `FullyShard::full_model`, and the optimizer state gathered through the host), which a run at
//! any world size loads whole (Burn 0.21's `load_record` takes a record of any shape: burn-core
//! 0.21.0 `module/param/tensor.rs`, `transform_for_load`) and shards again.

use std::any::Any;
use std::marker::PhantomData;

use burn::module::{AutodiffModule, ModuleVisitor, Param};
use burn::optim::adaptor::OptimizerAdaptor;
use burn::optim::{GradientsParams, Optimizer};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::Tensor;

use crate::fsdp::{FsdpBackend, FsdpOptimizer, FullyShard};
use crate::{DdpError, Rank, Result};

/// A sharded Learner's FSDP calls, its types erased (see the module's documentation). Every
/// `&dyn Any` model is the Learner's training model; every record its optimizer's.
pub(crate) trait ShardedLearner: Send + Sync + std::fmt::Debug {
    /// Refuses a model that holds a parameter of several rows whole (at a world size above 1).
    fn check_sharded(&self, model: &dyn Any) -> Result<()>;

    /// The whole model's number of values (the same at every world size).
    fn whole_values(&self, model: &dyn Any) -> Result<usize>;

    /// [`FullyShard::sync`], then the global-norm clipping at `clip`.
    fn sync(
        &self,
        model: &dyn Any,
        grads: GradientsParams,
        clip: Option<f64>,
    ) -> Result<GradientsParams>;

    /// [`FullyShard::full_model`] (collective).
    fn full_model(&self, model: &dyn Any) -> Result<Box<dyn Any>>;

    /// [`FullyShard::shard`] of a whole model (collective).
    fn shard(&self, model: Box<dyn Any>) -> Result<Box<dyn Any>>;

    /// [`FullyShard::full_optimizer_record`] (collective).
    fn full_optimizer_record(&self, model: &dyn Any, record: Box<dyn Any>) -> Result<Box<dyn Any>>;

    /// [`FullyShard::shard_optimizer_record`].
    fn shard_optimizer_record(&self, model: &dyn Any, record: Box<dyn Any>)
        -> Result<Box<dyn Any>>;
}

/// The types a [`Typed`] stands for, held by none of its values.
type Names<AB, M, O> = PhantomData<fn() -> (AB, M, O)>;

/// [`ShardedLearner`] for a model `M` on the autodiff backend `AB`, stepped by `O`.
pub(crate) struct Typed<AB, M, O> {
    pub(crate) fsdp: FullyShard,
    pub(crate) _types: Names<AB, M, O>,
}

impl<AB, M, O> std::fmt::Debug for Typed<AB, M, O> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Typed")
            .field("model", &std::any::type_name::<M>())
            .field("optimizer", &std::any::type_name::<O>())
            .finish_non_exhaustive()
    }
}

/// The Learner's optimizer record for `O` (Burn's adaptor keys it by parameter in its own map
/// type, which this names through the adaptor).
type Record<O, M, AB> = <OptimizerAdaptor<O, M, AB> as Optimizer<M, AB>>::Record;

impl<AB, M, O> Typed<AB, M, O>
where
    AB: FsdpBackend + AutodiffBackend,
    M: AutodiffModule<AB> + 'static,
    O: FsdpOptimizer<AB::InnerBackend> + 'static,
{
    fn rank(&self) -> Rank {
        self.fsdp.group().rank()
    }

    /// The error of a Learner whose model or optimizer is not the strategy's.
    fn other(&self, what: &str, found: &str) -> DdpError {
        DdpError::model_access(
            self.rank(),
            "training a sharded Learner",
            format!(
                "the Learner's {what} is a {found}, but DdpStrategy::fsdp was made for the model \
                 {} and the optimizer {}: name the Learner's in DdpStrategy::fsdp::<Backend, \
                 Model, Optimizer>",
                std::any::type_name::<M>(),
                std::any::type_name::<O>()
            ),
        )
    }

    fn model<'a>(&self, model: &'a dyn Any) -> Result<&'a M> {
        model
            .downcast_ref::<M>()
            .ok_or_else(|| self.other("model", "model of another type"))
    }

    fn record(&self, record: Box<dyn Any>) -> Result<Record<O, M, AB>> {
        record
            .downcast::<Record<O, M, AB>>()
            .map(|r| *r)
            .map_err(|_| self.other("optimizer", "optimizer of another type"))
    }
}

impl<AB, M, O> ShardedLearner for Typed<AB, M, O>
where
    AB: FsdpBackend + AutodiffBackend,
    M: AutodiffModule<AB> + 'static,
    O: FsdpOptimizer<AB::InnerBackend> + 'static,
    Record<O, M, AB>: Send,
{
    fn check_sharded(&self, model: &dyn Any) -> Result<()> {
        let model = self.model(model)?;
        if self.fsdp.group().world_size().as_usize() == 1 {
            return Ok(());
        }
        struct Whole<'a> {
            fsdp: &'a FullyShard,
            path: Vec<String>,
            first: Option<String>,
        }
        impl<B: Backend> ModuleVisitor<B> for Whole<'_> {
            fn enter_module(&mut self, name: &str, _container: &str) {
                self.path.push(name.to_owned());
            }
            fn exit_module(&mut self, _name: &str, _container: &str) {
                self.path.pop();
            }
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
                let rows = param.val().dims().first().copied().unwrap_or(1);
                if self.first.is_none() && rows > 1 && !self.fsdp.shards(&param.id) {
                    self.first = Some(self.path.join("."));
                }
            }
        }
        let mut whole = Whole {
            fsdp: &self.fsdp,
            path: Vec::new(),
            first: None,
        };
        model.visit(&mut whole);
        burn_ddp_comm::grad::refuse_whole_learner(self.rank(), whole.first)
    }

    fn whole_values(&self, model: &dyn Any) -> Result<usize> {
        Ok(self.fsdp.held_values::<AB, M>(self.model(model)?).1)
    }

    fn sync(
        &self,
        model: &dyn Any,
        grads: GradientsParams,
        clip: Option<f64>,
    ) -> Result<GradientsParams> {
        let model = self.model(model)?;
        let grads = self.fsdp.sync::<AB, M>(model, grads)?;
        match clip {
            Some(max_norm) => Ok(self.fsdp.clip_grad_norm::<AB, M>(model, grads, max_norm)?.0),
            None => Ok(grads),
        }
    }

    fn full_model(&self, model: &dyn Any) -> Result<Box<dyn Any>> {
        let whole = self.fsdp.full_model::<AB, M>(self.model(model)?)?;
        Ok(Box::new(whole))
    }

    fn shard(&self, model: Box<dyn Any>) -> Result<Box<dyn Any>> {
        let model = model
            .downcast::<M>()
            .map_err(|_| self.other("model", "model of another type"))?;
        Ok(Box::new(self.fsdp.shard::<AB, M>(*model)?))
    }

    fn full_optimizer_record(&self, model: &dyn Any, record: Box<dyn Any>) -> Result<Box<dyn Any>> {
        let (model, record) = (self.model(model)?, self.record(record)?);
        let whole: Record<O, M, AB> = self.fsdp.full_optimizer_record(model, record)?;
        Ok(Box::new(whole))
    }

    fn shard_optimizer_record(
        &self,
        model: &dyn Any,
        record: Box<dyn Any>,
    ) -> Result<Box<dyn Any>> {
        let (model, record) = (self.model(model)?, self.record(record)?);
        let mine: Record<O, M, AB> = self.fsdp.shard_optimizer_record(model, record)?;
        Ok(Box::new(mine))
    }
}

/// `record` back from `Any` as the Learner's type `R`, or the error naming `what`.
pub(crate) fn back<R: 'static>(record: Box<dyn Any>, rank: Rank, what: &'static str) -> Result<R> {
    record.downcast::<R>().map(|r| *r).map_err(|_| {
        DdpError::model_access(
            rank,
            what,
            format!(
                "FSDP gave back another type than the Learner's {}",
                std::any::type_name::<R>()
            ),
        )
    })
}
