//! Fully sharded data parallelism (FSDP, ZeRO stage 3) without Burn: how one parameter is cut
//! into the ranks' shards on its first dimension, the all-gather that makes it whole for a
//! block's forward, the reduce-scatter that hands each rank its shard of the gradient, and the
//! global gradient norm over the shards. The Burn lines wrap these in autodiff operations of
//! their own (`fsdp.rs` of each line).
//!
//! A parameter of shape `[rows, d1, d2, ...]` is a matrix of `rows` rows of
//! `row_len = d1·d2·…` values. Each of the `world` ranks holds `per_rank = ⌈rows / world⌉`
//! consecutive rows (rank `r` the rows from `r·per_rank`), the last ranks' shards padded with
//! rows of zeros (FSDP2's padding of uneven shards): `world · per_rank` rows in all. The
//! padding never reaches the model (the gathered parameter is cut back to `rows`), its
//! gradient is zero, so every optimizer whose update of a zero parameter with a zero gradient
//! is zero (Burn's SGD, momentum, Adam, AdamW) keeps it zero.

use crate::types::{Element, ReduceOp};
use crate::{ProcessGroup, Result};

/// How the parameter of `rows` rows of `row_len` values is cut among `world` ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ShardLayout {
    /// The parameter's first dimension.
    pub rows: usize,
    /// Values per row (the product of the other dimensions; 1 for a vector).
    pub row_len: usize,
    /// The ranks it is cut among.
    pub world: usize,
}

impl ShardLayout {
    /// The layout of a parameter of `shape` (at least one dimension) among `world` ranks.
    pub fn new(shape: &[usize], world: usize) -> Self {
        let rows = shape.first().copied().unwrap_or(1);
        Self {
            rows,
            row_len: shape.iter().skip(1).product(),
            world: world.max(1),
        }
    }

    /// Rows per rank, padding included: `⌈rows / world⌉` (at least 1).
    pub fn per_rank(&self) -> usize {
        self.rows.div_ceil(self.world).max(1)
    }

    /// Values in one rank's shard.
    pub fn shard_len(&self) -> usize {
        self.per_rank() * self.row_len
    }

    /// Values in the whole parameter (no padding).
    pub fn full_len(&self) -> usize {
        self.rows * self.row_len
    }

    /// Rows of padding in the shards together (`world · per_rank − rows`).
    pub fn padding_rows(&self) -> usize {
        self.world * self.per_rank() - self.rows
    }

    /// The shape of a shard of a parameter of `shape`: `per_rank` rows.
    pub fn shard_shape(&self, shape: &[usize]) -> Vec<usize> {
        let mut out = shape.to_vec();
        if let Some(first) = out.first_mut() {
            *first = self.per_rank();
        }
        out
    }

    /// Of the parameter's real rows, those rank `rank` holds (empty for a rank that holds
    /// padding only).
    pub fn real_rows(&self, rank: usize) -> std::ops::Range<usize> {
        let start = (rank * self.per_rank()).min(self.rows);
        start..((rank + 1) * self.per_rank()).min(self.rows)
    }

    /// Rank `rank`'s shard of the whole parameter `full` (`full_len` values), padded with
    /// zeros to `shard_len`.
    pub fn shard_of<T: Copy + Default>(&self, rank: usize, full: &[T]) -> Vec<T> {
        let rows = self.real_rows(rank);
        let mut out = full[rows.start * self.row_len..rows.end * self.row_len].to_vec();
        out.resize(self.shard_len(), T::default());
        out
    }

    /// Every rank's shard of `full`, gathered into the whole parameter: `world · shard_len`
    /// values in rank order, cut back to `full_len` (the padding dropped).
    ///
    /// # Errors
    /// A `shard` of another length than [`shard_len`](Self::shard_len) (`BufferSize`); the
    /// errors of [`ProcessGroup::all_gather`].
    pub fn all_gather<T: Element + Default>(
        &self,
        pg: &ProcessGroup,
        shard: &[T],
    ) -> Result<Vec<T>> {
        let mut all = vec![T::default(); self.world * shard.len()];
        pg.all_gather(shard, &mut all)?;
        if shard.len() != self.shard_len() {
            return Err(crate::DdpError::model_access(
                pg.rank(),
                "gathering a sharded parameter",
                format!(
                    "this rank's shard has {} values where its layout ({} rows of {} among {} \
                     ranks) says {}: was the model sharded for another world size?",
                    shard.len(),
                    self.rows,
                    self.row_len,
                    self.world,
                    self.shard_len()
                ),
            ));
        }
        all.truncate(self.full_len());
        Ok(all)
    }
}

/// The precision of a sharded parameter while it is gathered, or of its gradient while it is
/// reduced (FSDP2's `MixedPrecisionPolicy`). The shards themselves, and the optimizer's step on
/// them, stay in f32.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Precision {
    /// IEEE single precision.
    #[default]
    F32,
    /// IEEE half precision.
    F16,
    /// bfloat16.
    Bf16,
}

impl Precision {
    /// The same format as a gradient bucket's wire format, which the reductions share.
    pub fn wire(self) -> super::Compression {
        match self {
            Self::F32 => super::Compression::None,
            Self::F16 => super::Compression::F16,
            Self::Bf16 => super::Compression::Bf16,
        }
    }
}

/// FSDP's options (PyTorch FSDP2's `fully_shard` arguments).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FsdpConfig {
    /// Free a block's gathered parameters after its forward and gather them again when its
    /// backward needs them (FSDP2's `reshard_after_forward`, on by default): the whole
    /// parameters of only one block live at a time, for a second all-gather per block and
    /// step. Needs Burn's `BalancedCheckpointing` (`Autodiff<B, BalancedCheckpointing>`),
    /// whose checkpointer can run an operation again in backward; off, a block's gathered
    /// parameters live until its backward is done.
    pub reshard_after_forward: bool,
    /// The precision the parameters are gathered and computed in (FSDP2's `param_dtype`).
    pub param_dtype: Precision,
    /// The precision gradients are reduce-scattered in (FSDP2's `reduce_dtype`).
    pub reduce_dtype: Precision,
    /// Mean (PyTorch's) or sum of the ranks' gradients.
    pub reduction: super::GradReduction,
}

impl Default for FsdpConfig {
    fn default() -> Self {
        Self {
            reshard_after_forward: true,
            param_dtype: Precision::F32,
            reduce_dtype: Precision::F32,
            reduction: super::GradReduction::Mean,
        }
    }
}

impl FsdpConfig {
    /// With `reshard_after_forward` set.
    pub fn with_reshard_after_forward(mut self, on: bool) -> Self {
        self.reshard_after_forward = on;
        self
    }

    /// With the gathered parameters in `precision`.
    pub fn with_param_dtype(mut self, precision: Precision) -> Self {
        self.param_dtype = precision;
        self
    }

    /// With the gradients reduced in `precision`.
    pub fn with_reduce_dtype(mut self, precision: Precision) -> Self {
        self.reduce_dtype = precision;
        self
    }

    /// With the ranks' gradients summed or averaged.
    pub fn with_reduction(mut self, reduction: super::GradReduction) -> Self {
        self.reduction = reduction;
        self
    }
}

/// The whole parameter from this rank's `shard` (f32), gathered over `pg` in `precision`:
/// `full_len` f32 values (rounded through `precision`).
///
/// # Errors
/// As [`ShardLayout::all_gather`].
pub fn gather_in(
    layout: &ShardLayout,
    pg: &ProcessGroup,
    shard: &[f32],
    precision: Precision,
) -> Result<Vec<f32>> {
    fn on_wire<T: Element + Default>(
        layout: &ShardLayout,
        pg: &ProcessGroup,
        shard: &[f32],
        to: fn(f32) -> T,
        from: fn(T) -> f32,
    ) -> Result<Vec<f32>> {
        let send: Vec<T> = shard.iter().map(|&v| to(v)).collect();
        Ok(layout
            .all_gather(pg, &send)?
            .into_iter()
            .map(from)
            .collect())
    }
    match precision {
        Precision::F32 => layout.all_gather(pg, shard),
        Precision::F16 => on_wire(layout, pg, shard, half::f16::from_f32, half::f16::to_f32),
        Precision::Bf16 => on_wire(layout, pg, shard, half::bf16::from_f32, half::bf16::to_f32),
    }
}

/// This rank's shard of the whole gradient `full` (`full_len` values) reduced over `pg`, in
/// `precision`: the gradient padded to the ranks' shards and reduce-scattered as a ZeRO-2
/// bucket is ([`scatter_bucket`](super::scatter_bucket)); `shard_len` f32 values, zero in this
/// rank's padding.
///
/// # Errors
/// A `full` of another length than [`full_len`](ShardLayout::full_len) (after the collective,
/// so that no rank waits); the errors of [`scatter_bucket`](super::scatter_bucket).
pub fn reduce_scatter_in(
    layout: &ShardLayout,
    pg: &ProcessGroup,
    full: &[f32],
    reduction: super::GradReduction,
    precision: Precision,
) -> Result<Vec<f32>> {
    let mut send = full.to_vec();
    send.resize(layout.world * layout.shard_len(), 0.0);
    let mine = super::scatter_bucket(pg, &send, reduction, precision.wire())?;
    if full.len() != layout.full_len() {
        return Err(crate::DdpError::model_access(
            pg.rank(),
            "reduce-scattering a sharded parameter's gradient",
            format!(
                "the gradient has {} values where the parameter ({} rows of {}) has {}",
                full.len(),
                layout.rows,
                layout.row_len,
                layout.full_len()
            ),
        ));
    }
    Ok(mine)
}

/// The gradients' global L2 norm and the factor that clips it to `max_norm` (PyTorch's
/// `clip_grad_norm_`: `max_norm / (norm + 1e-6)` when that is below 1, else 1): `sharded` is
/// the sum of the squares of this rank's shards' gradients (each value held by one rank),
/// `replicated` that of the gradients every rank holds whole (counted once). One all-reduce
/// of one value.
///
/// # Errors
/// A `max_norm` that is not finite and positive; the errors of [`ProcessGroup::all_reduce`].
pub fn global_norm(
    pg: &ProcessGroup,
    sharded: f64,
    replicated: f64,
    max_norm: f64,
) -> Result<(f64, f64)> {
    if !(max_norm.is_finite() && max_norm > 0.0) {
        return Err(crate::DdpError::Config(crate::ConfigError::InvalidOption {
            option: "max_norm",
            reason: format!(
                "{max_norm} is not a finite, positive norm; pass the largest global gradient \
                 norm to allow (PyTorch's clip_grad_norm_ max_norm), e.g. 1.0"
            ),
        }));
    }
    let mut total = [sharded];
    pg.all_reduce(&mut total, ReduceOp::Sum)?;
    let norm = (total[0] + replicated).sqrt();
    let coef = max_norm / (norm + 1e-6);
    Ok((norm, coef.min(1.0)))
}

/// Values read from a tensor, or zeros of `len` in their place with the reason they could not
/// be read: a rank whose tensor cannot be read still takes part in the collective, so that no
/// rank waits on it, and keeps the reason.
fn or_zeros(read: std::result::Result<Vec<f32>, String>, len: usize) -> (Vec<f32>, Option<String>) {
    match read {
        Ok(v) => (v, None),
        Err(e) => (vec![0.0; len], Some(e)),
    }
}

/// How a parameter a Burn line finds in a model stands against the sharding: see
/// [`FsdpState::held_as`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Held {
    /// Not sharded: a parameter of one row, of another model, or any without a sharding.
    NotSharded,
    /// This rank's shard of the sharded parameter: gather it.
    Shard(ShardedParam),
    /// Already whole (a model loaded from a gathered record, which keeps the ids).
    Whole,
}

/// One sharded parameter: its whole shape and how it is cut.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardedParam {
    /// The whole parameter's shape.
    pub shape: Vec<usize>,
    /// How it is cut among the ranks.
    pub layout: ShardLayout,
}

impl ShardedParam {
    /// The shape of this rank's shard.
    pub fn shard_shape(&self) -> Vec<usize> {
        self.layout.shard_shape(&self.shape)
    }
}

/// One state tensor of an optimizer's record (Adam's moments, momentum): its name, the id of
/// the parameter it belongs to, its shape, and its values as f32.
#[derive(Debug, Clone, PartialEq)]
pub struct StateTensor {
    /// The tensor's name in the record (`"{id}.{field}"` in Burn's burnpack records).
    pub name: String,
    /// The id of the parameter it belongs to (Burn's `ParamId::val`).
    pub param: Option<u64>,
    /// Its shape.
    pub shape: Vec<usize>,
    /// Its values.
    pub values: Vec<f32>,
}

/// A job's fully sharded parameters, what both Burn lines' `FullyShard` wrap: the group they
/// are gathered over, the options, each sharded parameter by id (Burn's `ParamId::val`), the
/// first failure of the gathers and reduce-scatters that run inside Burn's forward and
/// backward (which cannot return one), and a count of the gathers. Made on a thread, it is
/// that thread's (and, for threads that made none, the process's) [`current`](Self::current)
/// one, which the lines' free `gather` functions use, so a model's `forward` needs no handle.
#[derive(Debug)]
pub struct FsdpState {
    pg: ProcessGroup,
    config: FsdpConfig,
    params: std::sync::Mutex<std::collections::HashMap<u64, ShardedParam>>,
    failure: std::sync::Mutex<Option<crate::DdpError>>,
    gathers: std::sync::atomic::AtomicU64,
    /// The line's device path for the collectives (NCCL's, set once by its `shard` when the
    /// model is on a GPU), as the line's own type.
    link: std::sync::OnceLock<std::sync::Arc<dyn std::any::Any + Send + Sync>>,
}

static CURRENT: std::sync::Mutex<Option<std::sync::Weak<FsdpState>>> = std::sync::Mutex::new(None);

thread_local! {
    static THREAD_CURRENT: std::cell::RefCell<Option<std::sync::Weak<FsdpState>>> =
        const { std::cell::RefCell::new(None) };
}

impl FsdpState {
    /// FSDP over `pg` with `config`, this thread's (and the process's) current one from now on.
    ///
    /// # Errors
    /// A fault-tolerant group (a lost rank would take its shards with it).
    pub fn new(pg: ProcessGroup, config: FsdpConfig) -> Result<std::sync::Arc<Self>> {
        super::NotCarried::Fsdp.refuse_on(&pg)?;
        made_sharded_model();
        let state = std::sync::Arc::new(Self {
            pg,
            config,
            params: Default::default(),
            failure: Default::default(),
            gathers: Default::default(),
            link: Default::default(),
        });
        let weak = std::sync::Arc::downgrade(&state);
        THREAD_CURRENT.with(|t| *t.borrow_mut() = Some(weak.clone()));
        *CURRENT.lock().unwrap_or_else(|p| p.into_inner()) = Some(weak);
        Ok(state)
    }

    /// Sets the line's device path for the collectives, once (a later one is dropped: the
    /// first stays, which every rank set in the same call). Returns whether this one was set.
    pub fn set_link(&self, link: std::sync::Arc<dyn std::any::Any + Send + Sync>) -> bool {
        self.link.set(link).is_ok()
    }

    /// Counts one gather (the host path's [`gather`](Self::gather) and a line's device path).
    pub fn count_gather(&self) {
        self.gathers
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }

    /// The line's device path, if its `shard` set one.
    pub fn link(&self) -> Option<&std::sync::Arc<dyn std::any::Any + Send + Sync>> {
        self.link.get()
    }

    /// The current one (this thread's, else the process's last), while it lives.
    pub fn current() -> Option<std::sync::Arc<Self>> {
        THREAD_CURRENT
            .with(|t| t.borrow().as_ref().and_then(std::sync::Weak::upgrade))
            .or_else(|| {
                CURRENT
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .as_ref()
                    .and_then(std::sync::Weak::upgrade)
            })
    }

    /// The group.
    pub fn group(&self) -> &ProcessGroup {
        &self.pg
    }

    /// The options.
    pub fn config(&self) -> &FsdpConfig {
        &self.config
    }

    /// The sharded parameter `id`, if it is one.
    pub fn param(&self, id: u64) -> Option<ShardedParam> {
        self.params
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&id)
            .cloned()
    }

    /// The error for what `what` found wrong (`reason`), naming this rank.
    pub fn error(&self, what: &'static str, reason: impl std::fmt::Display) -> crate::DdpError {
        crate::DdpError::model_access(self.pg.rank(), what, reason)
    }

    /// Keeps `e` (unless an earlier failure is kept) for the line's `sync`.
    pub fn fail(&self, e: crate::DdpError) {
        tracing::debug!("{e}");
        let mut slot = self.failure.lock().unwrap_or_else(|p| p.into_inner());
        if slot.is_none() {
            *slot = Some(e);
        }
    }

    /// The first failure kept since the last call.
    pub fn take_failure(&self) -> Option<crate::DdpError> {
        self.failure
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
    }

    /// The first of `params` (a model's parameters: name and id) that is sharded by the
    /// current sharding, where a line's whole-replica synchronisation (`what`) must refuse the
    /// model: its all-reduce would average different ranks' shards.
    ///
    /// # Errors
    /// A sharded parameter among `params`, named with the fix.
    pub fn refuse_shards(
        rank: crate::Rank,
        what: &'static str,
        params: impl IntoIterator<Item = (String, u64)>,
    ) -> Result<()> {
        let Some(state) = Self::current() else {
            return Ok(());
        };
        match params
            .into_iter()
            .find(|(_, id)| state.param(*id).is_some())
        {
            None => Ok(()),
            Some((name, _)) => Err(crate::DdpError::model_access(
                rank,
                what,
                format!(
                    "parameter {name} is a shard of FullyShard::shard: an FSDP model's gradients \
                     are reduce-scattered in its backward and finished by FullyShard::sync, not \
                     by {what} (whose all-reduce would average different ranks' shards), nor by \
                     its ZeRO, join, PowerSGD or overlap; give it the whole model, or train the \
                     sharded one with FullyShard alone"
                ),
            )),
        }
    }

    /// How parameter `id`, of `dims` in the model a line is gathering, stands: not sharded, a
    /// shard to gather, or already whole. A parameter with a sharded id and neither shape keeps
    /// an error for the line's `sync` and is treated as not sharded.
    pub fn held_as(&self, id: u64, dims: &[usize]) -> Held {
        let Some(p) = self.param(id) else {
            return Held::NotSharded;
        };
        if dims == p.shard_shape() {
            return Held::Shard(p);
        }
        if dims == p.shape {
            return Held::Whole;
        }
        self.fail(self.error(
            "gathering a sharded parameter",
            format!(
                "a parameter of shape {dims:?} has the id of one sharded as {:?} of {:?}: was \
                 the model changed after FullyShard::shard?",
                p.shard_shape(),
                p.shape
            ),
        ));
        Held::NotSharded
    }

    /// Checks that every rank describes its optimizer state alike (`described`: its tensors'
    /// names and shapes, or which parameters it holds state for), before any rank gathers it.
    ///
    /// # Errors
    /// A rank whose description differs, named; collective failures.
    pub fn same_state_everywhere(&self, described: &[u8]) -> Result<()> {
        let all = self.pg.all_gather_bytes(described)?;
        match all.iter().position(|d| d != described) {
            None => Ok(()),
            Some(r) => Err(self.error(
                "gathering the optimizer state",
                format!(
                    "rank {r}'s optimizer state is of other tensors than this rank's: were the \
                     ranks' optimizers made alike and stepped the same steps?"
                ),
            )),
        }
    }

    /// How many parameters this process has all-gathered so far (in forward, and again in
    /// backward where resharded).
    pub fn gathers(&self) -> u64 {
        self.gathers.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// This rank's shard of parameter `id` of `shape` whose values are `full` (`None`: it is
    /// not cut, being of one row, or the world being one rank), recorded as sharded. The
    /// shard's values and shape.
    pub fn cut(&self, id: u64, shape: &[usize], full: &[f32]) -> Option<(Vec<f32>, Vec<usize>)> {
        let world = self.pg.world_size().as_usize();
        // A first dimension of one cannot be cut (the whole would be on rank 0, and a shard
        // would look like the whole): such a parameter stays whole on every rank.
        if world == 1 || shape.first().copied().unwrap_or(1) <= 1 {
            return None;
        }
        let layout = ShardLayout::new(shape, world);
        let mine = layout.shard_of(self.pg.rank().index(), full);
        let param = ShardedParam {
            shape: shape.to_vec(),
            layout,
        };
        let shard_shape = param.shard_shape();
        self.params
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(id, param);
        Some((mine, shard_shape))
    }

    /// What this rank keeps of parameter `id` of `shape` when a model is sharded: rank 0's
    /// id and values (`mine`, read from this rank's tensor, are sent by rank 0 and replaced by
    /// them elsewhere: one broadcast per parameter, so the whole model is never held twice),
    /// cut into this rank's shard where the parameter is cut ([`cut`](Self::cut), under rank
    /// 0's id); the id, the values and their shape. Rank 0's ids make the ranks' optimizer
    /// states, keyed by id, name the same tensors. Every rank calls it for every parameter, in
    /// one order. A tensor that could not be read takes part as zeros, so no rank waits on this
    /// one.
    ///
    /// # Errors
    /// A tensor that could not be read (after the broadcast); the broadcasts' failures.
    pub fn take_root_and_cut(
        &self,
        id: u64,
        shape: &[usize],
        mine: std::result::Result<Vec<f32>, String>,
    ) -> Result<(u64, Vec<f32>, Vec<usize>)> {
        let (mut values, unread) = or_zeros(mine, shape.iter().product());
        // The id's bits, as the collectives carry 64-bit integers signed.
        let mut root_id = [id as i64];
        self.pg.broadcast(&mut root_id, crate::Rank(0))?;
        let root_id = root_id[0] as u64;
        self.pg.broadcast(&mut values, crate::Rank(0))?;
        if let Some(e) = unread {
            return Err(self.error("sharding a parameter", e));
        }
        let (values, shape) = match self.cut(root_id, shape, &values) {
            Some(shard) => shard,
            None => (values, shape.to_vec()),
        };
        Ok((root_id, values, shape))
    }

    /// The whole parameter `p` from this rank's shard `mine` (read from the tensor; an error if
    /// it could not be), gathered in `precision`. A shard that could not be read takes part as
    /// zeros, so that no rank waits on this one; a failure gives zeros; either is kept.
    pub fn gather(
        &self,
        p: &ShardedParam,
        mine: std::result::Result<Vec<f32>, String>,
        precision: Precision,
    ) -> Vec<f32> {
        self.count_gather();
        let (mine, unread) = or_zeros(mine, p.layout.shard_len());
        let whole = gather_in(&p.layout, &self.pg, &mine, precision);
        if let Some(e) = unread {
            self.fail(self.error("gathering a sharded parameter", e));
        }
        whole.unwrap_or_else(|e| {
            self.fail(e);
            vec![0.0; p.layout.full_len()]
        })
    }

    /// This rank's shard of the ranks' mean (or sum) of `p`'s whole gradient `full` (read from
    /// the tensor; an error if it could not be), reduced in the configured precision; as
    /// [`gather`](Self::gather) with failures.
    pub fn reduce_scatter(
        &self,
        p: &ShardedParam,
        full: std::result::Result<Vec<f32>, String>,
    ) -> Vec<f32> {
        let (full, unread) = or_zeros(full, p.layout.full_len());
        let (reduction, precision) = (self.config.reduction, self.config.reduce_dtype);
        let mine = reduce_scatter_in(&p.layout, &self.pg, &full, reduction, precision);
        if let Some(e) = unread {
            self.fail(self.error("reduce-scattering a gradient", e));
        }
        mine.unwrap_or_else(|e| {
            self.fail(e);
            vec![0.0; p.layout.shard_len()]
        })
    }

    /// The whole optimizer state from this rank's `tensors`: each state tensor of a sharded
    /// parameter whose shape is its shard's all-gathered into the parameter's whole shape, in
    /// name order, after checking that every rank holds the same tensors.
    ///
    /// # Errors
    /// Ranks whose states name other tensors; collective failures.
    pub fn gather_state(&self, tensors: &mut [StateTensor]) -> Result<()> {
        tensors.sort_by(|a, b| a.name.cmp(&b.name));
        let names: Vec<u8> = tensors
            .iter()
            .flat_map(|t| format!("{}:{:?};", t.name, t.shape).into_bytes())
            .collect();
        self.same_state_everywhere(&names)?;
        for t in tensors.iter_mut() {
            let Some(p) = t.param.and_then(|id| self.param(id)) else {
                continue;
            };
            if t.shape == p.shard_shape() {
                t.values = p.layout.all_gather(&self.pg, &t.values)?;
                t.shape = p.shape.clone();
            }
        }
        Ok(())
    }

    /// This rank's shard of a whole optimizer state (as [`gather_state`](Self::gather_state)
    /// gives it, at any world size): each state tensor of a sharded parameter whose shape is
    /// the parameter's whole shape cut as the parameter is.
    pub fn cut_state(&self, tensors: &mut [StateTensor]) {
        let rank = self.pg.rank().index();
        for t in tensors.iter_mut() {
            let Some(p) = t.param.and_then(|id| self.param(id)) else {
                continue;
            };
            if t.shape == p.shape {
                t.values = p.layout.shard_of(rank, &t.values);
                t.shape = p.shard_shape();
            }
        }
    }
}

/// The `max_norm` of a Learner strategy's `with_clip_grad_norm` (`sharded`: the strategy's
/// model is, `DdpStrategy::fsdp`), checked.
///
/// # Errors
/// A strategy whose model is not sharded (Burn's optimizer clipping serves whole gradients); a
/// `max_norm` that is not finite and positive.
pub fn checked_clip_norm(sharded: bool, max_norm: f64) -> Result<f64> {
    use crate::error::ConfigError;
    if !sharded {
        return Err(crate::DdpError::Config(ConfigError::InvalidConfig {
            field: "DdpStrategy::with_clip_grad_norm",
            reason: "is for a sharded model (DdpStrategy::fsdp); with whole gradients use the \
                     optimizer's own clipping (`with_grad_clipping` in its config)",
        }));
    }
    if !(max_norm.is_finite() && max_norm > 0.0) {
        return Err(crate::DdpError::Config(ConfigError::InvalidConfig {
            field: "DdpStrategy::with_clip_grad_norm",
            reason: "max_norm must be finite and positive",
        }));
    }
    Ok(max_norm)
}

/// Refuses a Learner given to `DdpStrategy::fsdp` whose model holds `whole` (the path of its
/// first parameter of several rows that is not a shard), when there is one.
///
/// # Errors
/// [`ModelError::Access`](crate::ModelError::Access) naming the parameter and the fix.
pub fn refuse_whole_learner(rank: crate::Rank, whole: Option<String>) -> Result<()> {
    match whole {
        None => Ok(()),
        Some(param) => Err(crate::DdpError::model_access(
            rank,
            "starting DdpStrategy::fsdp",
            format!(
                "the Learner's model holds `{param}` whole, not this rank's shard: build the \
                 Learner with `Learner::new(fsdp.shard(model)?, optimizer, scheduler)`, with \
                 the FullyShard given to DdpStrategy::fsdp"
            ),
        )),
    }
}

/// Whether this process sharded a model with FSDP, whose forward gathers the parameters, in
/// training and in inference ([`made_sharded_model`]).
static SHARDED_MODELS: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Records that this process made an FSDP sharding ([`FsdpState::new`]): its model's forward
/// runs collectives in validation too, so a validation step goes on only while every rank has
/// a batch ([`sharded_models`]). Training steps need no more: FSDP is refused in
/// fault-tolerant jobs, the only ones with partial steps.
pub fn made_sharded_model() {
    SHARDED_MODELS.store(true, std::sync::atomic::Ordering::Relaxed);
}

/// Whether this process made an FSDP sharding ([`made_sharded_model`]).
pub fn sharded_models() -> bool {
    SHARDED_MODELS.load(std::sync::atomic::Ordering::Relaxed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uneven_rows_are_padded_on_the_last_ranks() {
        let l = ShardLayout::new(&[5, 2], 3);
        assert_eq!((l.per_rank(), l.shard_len(), l.padding_rows()), (2, 4, 1));
        assert_eq!(l.shard_shape(&[5, 2]), vec![2, 2]);
        let full: Vec<f32> = (0..10).map(|v| v as f32).collect();
        assert_eq!(l.shard_of(0, &full), vec![0.0, 1.0, 2.0, 3.0]);
        assert_eq!(l.shard_of(2, &full), vec![8.0, 9.0, 0.0, 0.0]);
        // Fewer rows than ranks: the last ranks hold padding only.
        let l = ShardLayout::new(&[2], 4);
        assert_eq!((l.per_rank(), l.real_rows(3)), (1, 2..2));
        assert_eq!(l.shard_of(3, &[7.0, 8.0]), vec![0.0]);
    }

    #[test]
    fn gather_and_reduce_scatter_invert_the_cut_across_threads() {
        use crate::grad::GradReduction;
        use crate::{ProcessGroup, Timeouts, WorldSize};
        let shape = [7usize, 3];
        let full: Vec<f32> = (0..21).map(|v| v as f32 * 0.5).collect();
        let groups = ProcessGroup::local(WorldSize::new(3).unwrap(), Timeouts::default());
        let handles: Vec<_> = groups
            .into_iter()
            .map(|pg| {
                let full = full.clone();
                std::thread::spawn(move || {
                    let l = ShardLayout::new(&shape, 3);
                    let rank = pg.rank().index();
                    let shard = l.shard_of(rank, &full);
                    let whole = gather_in(&l, &pg, &shard, Precision::F32).unwrap();
                    assert_eq!(whole, full);
                    // Every rank's gradient is the whole parameter times (rank + 1): the mean's
                    // shard is twice this rank's rows.
                    let grad: Vec<f32> = full.iter().map(|v| v * (rank + 1) as f32).collect();
                    let mine =
                        reduce_scatter_in(&l, &pg, &grad, GradReduction::Mean, Precision::F32)
                            .unwrap();
                    let want: Vec<f32> = l.shard_of(rank, &full).iter().map(|v| v * 2.0).collect();
                    assert_eq!(mine, want);
                    let bf = gather_in(&l, &pg, &shard, Precision::Bf16).unwrap();
                    assert!(bf
                        .iter()
                        .zip(&full)
                        .all(|(a, b)| (a - b).abs() <= 0.01 * b.abs()));
                    // Norm: every rank holds a shard of a gradient of ones (21 values, 2 rows of
                    // padding), and a replicated gradient of 4 ones.
                    let sq = l.shard_of(rank, &[1.0f32; 21]).iter().sum::<f32>() as f64;
                    let (norm, coef) = global_norm(&pg, sq, 4.0, 1.0).unwrap();
                    assert!((norm - 5.0).abs() < 1e-9, "{norm}");
                    assert!((coef - 1.0 / (5.0 + 1e-6)).abs() < 1e-12);
                    assert!(global_norm(&pg, sq, 4.0, 0.0).is_err());
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
    }
}
