//! The device transport of the 0.21 line's passes ([`DeviceStep`]): buckets packed by Burn on
//! the gradients' device, handed to a issuer thread that reduces them, and unpacked as views.
//! Generic over the backend and over its [`DeviceLink`]: NCCL on Burn's `Cuda` (`gpu.rs`,
//! which says how a bucket reaches NCCL), or, in this crate's tests, a stand-in over NdArray
//! that reduces over the host, so that the same packing, flags and unpacking run, and are
//! counted ([`DeviceCounts`](burn_ddp_comm::grad::DeviceCounts)), without a GPU.
//!
//! Per bucket, when its last gradient is final (in bucket order, as on the host path):
//! 1. its gradients (flattened; f32: a cast where they were not) are packed into one contiguous
//!    device tensor by Burn (`cat`, zeros for parameters without a gradient on this rank, then
//!    one presence flag per parameter; a cast for compression): one device-to-device copy, as
//!    PyTorch DDP's bucket copy. The flags of a bucket whose every gradient is here are a tensor
//!    of ones the link keeps from pass to pass, so the usual pass fills none;
//! 2. backward hands it with a fresh output tensor (both still queued work) and its stream to
//!    the issuer thread, and goes on at once.
//!
//! At the end of backward every answer and the collective queue are waited for; a compressed
//! bucket's output is cast back to f32 once; each gradient is replaced by its slice of the
//! output (a view, reshaped, cast only where the gradient was not f32). Parameters without a
//! gradient here whose reduced flag is not zero (other ranks used them) keep their slice for
//! `DdpSession::complete`; their flags are the only bytes read to the host, in one transfer.

use burn_ddp_comm::ModelError;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use burn_backend::distributed::DistributedParamId;
use burn_backend::tensor::FloatTensor;
use burn_backend::{Backend, DType as BurnDType, FloatDType, Shape, StreamId, TensorMetadata};
use burn_ddp_comm::grad::{
    BucketIssuer, BucketPlan, BucketTransport, DeviceCounters, DeviceWork, InFlight, Piece,
};

use crate::comm::{DType, ReduceOp};
use crate::ddp::values::{float_dtype, read_f32, write_f32};
use crate::group::Rank;
use crate::{DdpError, Result};

/// The reducer's plan (by Burn's parameter ids).
type Plan = BucketPlan<DistributedParamId>;

/// The bucket element type for a compression setting: the wire's, and Burn's.
pub(crate) fn bucket_dtype(c: crate::Compression) -> (DType, BurnDType) {
    match c {
        crate::Compression::None => (DType::F32, BurnDType::F32),
        crate::Compression::F16 => (DType::F16, BurnDType::F16),
        crate::Compression::Bf16 => (DType::BF16, BurnDType::BF16),
    }
}

/// What a finished device pass gives back: each local gradient's reduced value by slot, and the
/// slots without a local gradient that some other rank had one for, with their average
/// (flattened, f32).
pub(crate) type DeviceResults<B> = (Vec<(usize, FloatTensor<B>)>, Vec<(usize, FloatTensor<B>)>);

/// One bucket for the issuer thread: its packed input and fresh output (both still queued
/// work on Burn's stream `stream`), and how to reduce it.
pub(crate) struct BucketJob<B: Backend> {
    /// The bucket's index in the plan.
    pub(crate) bucket: usize,
    /// Its elements (gradients, then one flag per parameter).
    pub(crate) count: usize,
    /// Set for a bucket of a sharded plan (ZeRO stage 2), reduce-scattered: the length of each
    /// rank's block, all this rank receives. `None`: all-reduced.
    pub(crate) block: Option<usize>,
    /// Their type on the wire, and as Burn names it.
    pub(crate) dtype: (DType, BurnDType),
    pub(crate) op: ReduceOp,
    /// The packed gradients and flags.
    pub(crate) input: FloatTensor<B>,
    /// A fresh tensor (`count` elements, or `block`) for the collective to write (NCCL's; the tests'
    /// stand-in makes its own).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) output: FloatTensor<B>,
    /// The stream that queued both (NCCL's issuer runs as it).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) stream: StreamId,
    /// Where both are.
    pub(crate) device: B::Device,
}

/// What every [`DeviceLink`] holds: its issuer thread, its counters, and the constant runs of
/// packed buckets (by value and length: the presence flags of buckets whose every gradient is
/// here, ones; a sharded bucket's padding, zeros), kept from pass to pass.
pub(crate) struct LinkCore<B: Backend, P> {
    pub(crate) issuer: BucketIssuer<BucketJob<B>, P>,
    pub(crate) counters: Arc<DeviceCounters>,
    constants: Mutex<HashMap<(bool, usize), FloatTensor<B>>>,
}

impl<B: Backend, P> std::fmt::Debug for LinkCore<B, P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LinkCore")
            .field("counts", &self.counters.read())
            .finish_non_exhaustive()
    }
}

impl<B: Backend, P> LinkCore<B, P> {
    pub(crate) fn new(
        issuer: BucketIssuer<BucketJob<B>, P>,
        counters: Arc<DeviceCounters>,
    ) -> Self {
        Self {
            issuer,
            counters,
            constants: Mutex::new(HashMap::new()),
        }
    }

    /// `n` ones (`one`) or zeros on `device`, made (one fill) the first time a bucket needs
    /// them. A link serves one device (its communicator's).
    fn constant(&self, one: bool, n: usize, device: &B::Device) -> FloatTensor<B> {
        let mut constants = self.constants.lock().unwrap_or_else(|p| p.into_inner());
        constants
            .entry((one, n))
            .or_insert_with(|| {
                self.counters.one(DeviceWork::Pack);
                let fill = if one { B::float_ones } else { B::float_zeros };
                fill(Shape::new([n]), device, FloatDType::F32)
            })
            .clone()
    }
}

/// How a device pass's buckets are reduced: NCCL (`gpu.rs`), or the tests' stand-in.
pub(crate) trait DeviceLink<B: Backend>: 'static {
    /// What the issuer keeps alive while a bucket's collective runs.
    type Pins: Send + 'static;

    /// The issuer and counters.
    fn core(&self) -> &LinkCore<B, Self::Pins>;

    /// Bucket `bucket`'s reduced values, once its collective is known done: `output`, which
    /// the collective wrote, unless the link hands back a tensor of its own.
    ///
    /// # Errors
    /// The link has no result for the bucket.
    fn reduced(&self, rank: Rank, bucket: usize, output: FloatTensor<B>) -> Result<FloatTensor<B>>;
}

/// What a device pass needs from its session: the link, and how buckets are reduced.
pub(crate) struct PassLink<'a, L> {
    pub(crate) rank: Rank,
    pub(crate) link: &'a L,
    pub(crate) op: ReduceOp,
    pub(crate) compression: crate::Compression,
    /// How long to wait for the issuer's answers and the collective queue.
    pub(crate) wait: Duration,
}

/// The device state of one backward pass.
pub(crate) struct DeviceStep<B: Backend, L: DeviceLink<B>> {
    /// Each slot's flattened f32 gradient, until its bucket is packed.
    grads: Vec<Option<FloatTensor<B>>>,
    /// Each slot's original shape and dtype (to write the result back).
    shapes: Vec<Option<(Shape, BurnDType)>>,
    /// Each launched bucket's output (what its gradients become).
    outputs: Vec<Option<FloatTensor<B>>>,
    /// Buckets handed to the issuer (which holds the buffers the collective works on until
    /// its queue is known done with them).
    in_flight: InFlight<L::Pins>,
    /// Where the gradients are (the first one's device), and so the buckets.
    device: Option<B::Device>,
    /// Where buckets go before any gradient came (the communicator's device).
    home: B::Device,
}

impl<B: Backend, L: DeviceLink<B>> std::fmt::Debug for DeviceStep<B, L> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceStep")
            .field("grads", &self.grads.iter().filter(|g| g.is_some()).count())
            .field("in_flight", &self.in_flight)
            .finish()
    }
}

impl<B: Backend, L: DeviceLink<B>> DeviceStep<B, L> {
    /// A pass over `slots` parameters in `buckets` buckets, whose buckets are made on `home`
    /// until a gradient says where the gradients are.
    pub(crate) fn new(slots: usize, buckets: usize, home: B::Device) -> Self {
        Self {
            grads: (0..slots).map(|_| None).collect(),
            shapes: vec![None; slots],
            outputs: (0..buckets).map(|_| None).collect(),
            in_flight: InFlight::new(),
            device: None,
            home,
        }
    }

    /// After the link's queue was stopped by its owner (a membership change: nobody to tell),
    /// takes every answer and drains the queue (bounded) before any buffer the pass pinned goes
    /// (`InFlight::settle_stopped`).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn settle_aborted(&mut self, link: &L, wait: Duration) {
        self.in_flight.settle_stopped(&link.core().issuer, wait);
    }
}

impl<B: Backend, L: DeviceLink<B>> BucketTransport<DistributedParamId> for DeviceStep<B, L> {
    type Grad<'g> = FloatTensor<B>;
    type Link<'l> = PassLink<'l, L>;
    type Output = DeviceResults<B>;

    /// Keeps slot `slot`'s final gradient (flattened, f32) for its bucket, after checking it
    /// has the parameter's element count and a float type (as the host path does).
    fn keep(
        &mut self,
        link: &mut PassLink<'_, L>,
        plan: &Plan,
        slot: usize,
        grad: FloatTensor<B>,
    ) -> Result<()> {
        let (rank, param) = (link.rank, &plan.slots[slot].info);
        let numel = param.numel;
        let shape = grad.shape();
        let dtype = grad.dtype();
        if shape.num_elements() != numel {
            return Err(DdpError::Model(ModelError::GradientSize {
                rank,
                param: param.name.clone(),
                expected: numel,
                got: shape.num_elements(),
            }));
        }
        if !matches!(
            dtype,
            BurnDType::F32 | BurnDType::F16 | BurnDType::BF16 | BurnDType::F64
        ) {
            return Err(DdpError::model_access(
                rank,
                "reading a gradient",
                format!(
                    "the gradient of `{}` holds {dtype:?}, not floats",
                    param.name
                ),
            ));
        }
        self.device.get_or_insert_with(|| B::float_device(&grad));
        let flat = B::float_reshape(grad, Shape::new([numel]));
        let flat = if dtype == BurnDType::F32 {
            flat
        } else {
            link.link.core().counters.one(DeviceWork::Pack);
            B::float_cast(flat, FloatDType::F32)
        };
        self.grads[slot] = Some(flat);
        self.shapes[slot] = Some((shape, dtype));
        Ok(())
    }

    /// Packs bucket `bucket` into a fresh tensor, with a fresh output beside it (both queued
    /// work on Burn's stream: nothing waits here), and hands both to the issuer.
    fn send(&mut self, link: &mut PassLink<'_, L>, plan: &Plan, bucket: usize) -> Result<()> {
        let core = link.link.core();
        let counters = &core.counters;
        let device = self.device.clone().unwrap_or_else(|| self.home.clone());
        let f32 = FloatDType::F32;
        // In the plan's layout: values, then one presence flag per parameter (1 where this rank
        // has its gradient), reduced with them: every rank learns which parameters some rank
        // had a gradient for. Block after block when the plan is sharded, each padded to the
        // block's length.
        let layout = plan.layout(bucket, |slot| self.grads[slot].is_some());
        let mut parts = Vec::with_capacity(layout.len());
        for piece in layout {
            parts.push(match piece {
                Piece::Values(slot) => match self.grads[slot].take() {
                    Some(g) => g,
                    None => {
                        counters.one(DeviceWork::Pack);
                        let numel = plan.slots[slot].info.numel;
                        B::float_zeros(Shape::new([numel]), &device, f32)
                    }
                },
                Piece::Ones(n) => core.constant(true, n, &device),
                Piece::Flags(flags) => {
                    counters.one(DeviceWork::Pack);
                    let n = flags.len();
                    B::float_from_data(burn_backend::TensorData::new(flags, [n]), &device)
                }
                Piece::Zeros(n) => core.constant(false, n, &device),
            });
        }
        let (count, block) = (plan.buffer_len(bucket), plan.block(bucket));
        let received = plan.received_len(bucket);
        counters.one(DeviceWork::Pack);
        let packed = B::float_cat(parts, 0);
        let (dtype, burn_dtype) = bucket_dtype(link.compression);
        let input = if burn_dtype == BurnDType::F32 {
            packed
        } else {
            counters.one(DeviceWork::Pack);
            B::float_cast(packed, float_dtype(burn_dtype))
        };
        let output = B::float_empty(Shape::new([received]), &device, float_dtype(burn_dtype));
        counters.one(DeviceWork::Bucket);
        counters.one(DeviceWork::HandOff);
        self.in_flight.send(
            &core.issuer,
            BucketJob {
                bucket,
                count,
                block,
                dtype: (dtype, burn_dtype),
                op: link.op,
                input,
                output: output.clone(),
                stream: StreamId::current(),
                device,
            },
        )?;
        self.outputs[bucket] = Some(output);
        Ok(())
    }

    /// Waits for every queued reduction and returns, per slot with a local gradient, the
    /// reduced values (a view of the bucket's output, shaped and typed as the gradient was),
    /// and the slots without a local gradient whose average is not zero (other ranks used those
    /// parameters; the caller reports them, as the host path does).
    fn finish(
        &mut self,
        link: &mut PassLink<'_, L>,
        plan: &Plan,
        _local: &[bool],
    ) -> Result<DeviceResults<B>> {
        let (rank, core) = (link.rank, link.link.core());
        let counters = &core.counters;
        counters.one(DeviceWork::Pass);
        counters.add(DeviceWork::HandOff, self.in_flight.waiting() as u64);
        counters.one(DeviceWork::QueueWait);
        self.in_flight.finish(&core.issuer, link.wait)?;
        let mut outputs = Vec::with_capacity(self.outputs.len());
        for (bucket, o) in self.outputs.iter_mut().enumerate() {
            outputs.push(match o.take() {
                Some(output) => {
                    let output = link.link.reduced(rank, bucket, output)?;
                    // Compressed: back to f32 once per bucket, not once per gradient.
                    Some(if output.dtype() == BurnDType::F32 {
                        output
                    } else {
                        counters.one(DeviceWork::Unpack);
                        B::float_cast(output, FloatDType::F32)
                    })
                }
                None => None,
            });
        }
        let mut out = Vec::new();
        let mut absent = Vec::new();
        for (slot, s) in plan.slots.iter().enumerate() {
            let Some(output) = &outputs[s.bucket] else {
                continue;
            };
            let Some((offset, flag)) = plan.received(slot, rank) else {
                // ZeRO stage 2: another rank owns it. This rank's own gradient goes: an empty
                // tensor of the parameter's rank takes its place in Burn's container (as on the
                // host path), which the ZeRO optimizer drops before its step.
                if let Some((shape, dtype)) = &self.shapes[slot] {
                    let empty = Shape::from(vec![0; shape.num_dims()]);
                    let device = B::float_device(output);
                    out.push((slot, write_f32::<B>(Vec::new(), empty, *dtype, &device)));
                }
                continue;
            };
            let view = |from: usize, len: usize| {
                B::float_slice(
                    output.clone(),
                    &[burn_backend::Slice::from(from..from + len)],
                )
            };
            let part = view(offset, s.info.numel);
            match self.shapes[slot].clone() {
                Some((shape, dtype)) => {
                    let part = if dtype == BurnDType::F32 {
                        part
                    } else {
                        counters.one(DeviceWork::Unpack);
                        B::float_cast(part, float_dtype(dtype))
                    };
                    out.push((slot, B::float_reshape(part, shape)));
                }
                None => absent.push((slot, part, view(flag, 1))),
            }
        }
        if absent.is_empty() {
            return Ok((out, Vec::new()));
        }
        // No gradient here: the reduced presence flags (one read for all of them) tell which
        // parameters some other rank had a gradient for.
        let flags: Vec<FloatTensor<B>> = absent.iter().map(|(_, _, f)| f.clone()).collect();
        counters.one(DeviceWork::Unpack);
        counters.one(DeviceWork::HostRead);
        let flags = read_f32::<B>(B::float_cat(flags, 0)).map_err(|reason| {
            DdpError::model_access(rank, "reading the reduced buckets' presence flags", reason)
        })?;
        let foreign = absent
            .into_iter()
            .zip(flags)
            .filter(|(_, f)| *f != 0.0)
            .map(|((slot, part, _), _)| (slot, part))
            .collect();
        Ok((out, foreign))
    }

    fn abandon(&mut self, link: &mut PassLink<'_, L>, e: DdpError) -> DdpError {
        self.in_flight
            .abandon(&link.link.core().issuer, e, link.wait)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::ndarray::{NdArray, NdArrayDevice};
    use burn_backend::ops::FloatTensorOps;
    use burn_backend::TensorData;
    use burn_ddp_comm::grad::{BucketOrder, DeviceCounts, Pass};
    use burn_ddp_comm::{DdpConfig, ParamInfo, ProcessGroup};
    use burn_ddp_dev::device::{assert_gradients, on_thread_ranks, usual_step, ReducedQueue};

    type B = NdArray;

    /// A link that reduces each packed bucket over the host (read once, all-reduced by the
    /// process group on the issuer thread, this rank's block kept when the bucket is
    /// reduce-scattered, uploaded as a fresh tensor): the device transport's own packing, flags
    /// and unpacking, on NdArray.
    struct HostLink {
        core: LinkCore<B, ()>,
        reduced: Arc<Mutex<HashMap<usize, FloatTensor<B>>>>,
    }

    impl HostLink {
        fn start(pg: ProcessGroup) -> Self {
            let reduced = Arc::new(Mutex::new(HashMap::new()));
            let into = Arc::clone(&reduced);
            let rank = pg.rank();
            let issuer =
                BucketIssuer::start(rank, Arc::new(ReducedQueue), move |job: BucketJob<B>| {
                    let mut values = read_f32::<B>(job.input)
                        .map_err(|e| DdpError::model_access(rank, "reading a bucket", e))?;
                    if values.len() != job.count {
                        return Err(DdpError::Internal {
                            rank,
                            what: "a packed bucket is not as long as its plan says",
                        });
                    }
                    pg.all_reduce(&mut values, job.op)?;
                    if let Some(block) = job.block {
                        let at = rank.index() * block;
                        values = values[at..at + block].to_vec();
                    }
                    let n = values.len();
                    let data = TensorData::new(values, [n]).convert_dtype(job.dtype.1);
                    let t = B::float_from_data(data, &job.device);
                    into.lock().unwrap().insert(job.bucket, t);
                    Ok(())
                })
                .unwrap();
            Self {
                core: LinkCore::new(issuer, Arc::default()),
                reduced,
            }
        }
    }

    impl DeviceLink<B> for HostLink {
        type Pins = ();
        fn core(&self) -> &LinkCore<B, ()> {
            &self.core
        }
        fn reduced(
            &self,
            rank: Rank,
            bucket: usize,
            _output: FloatTensor<B>,
        ) -> Result<FloatTensor<B>> {
            self.reduced
                .lock()
                .unwrap()
                .remove(&bucket)
                .ok_or(DdpError::Internal {
                    rank,
                    what: "the stand-in link has no result for a bucket",
                })
        }
    }

    /// Three layers' weights and biases: three buckets of two parameters.
    const SHAPES: [&[usize]; 6] = [&[4, 8], &[8], &[8, 8], &[8], &[8, 2], &[2]];

    /// A gradient of `shape` whose values depend on the rank, slot and step.
    fn grad(shape: &[usize], rank: usize, slot: usize, step: usize) -> Vec<f32> {
        let n: usize = shape.iter().product();
        (0..n)
            .map(|i| (i as f32 * 0.25 - 1.0) * (rank + 1) as f32 + (slot + step) as f32)
            .collect()
    }

    /// Two thread ranks run `steps` passes over the stand-in link, overlapped (buckets sent as
    /// gradients come, in backward's order: last slot first); rank 1 has no gradient for the
    /// middle layer when `absent`; the gradients are of `grads_in`. Each rank checks every
    /// gradient against the mean of both ranks' (zeros where absent), and returns what its link
    /// counted in the last pass.
    fn run(grads_in: BurnDType, absent: bool, steps: usize) -> Vec<DeviceCounts> {
        run_plan(grads_in, absent, steps, None)
    }

    /// [`run`] over the plan sharded to `owners` (by slot) when given (ZeRO stage 2): each
    /// rank checks that the pass gives back the mean of the gradients it owns, and an empty
    /// tensor of the parameter's rank for each local gradient another rank owns.
    fn run_plan(
        grads_in: BurnDType,
        absent: bool,
        steps: usize,
        owners: Option<&[Rank]>,
    ) -> Vec<DeviceCounts> {
        on_thread_ranks(2, |pg| {
            let r = pg.rank().index();
            let config = DdpConfig {
                bucket_cap_bytes: 300,
                first_bucket_cap_bytes: 300,
                ..DdpConfig::default()
            };
            let params = SHAPES
                .iter()
                .enumerate()
                .map(|(i, s)| {
                    let info = ParamInfo::new(format!("p{i}"), s.to_vec(), "F32");
                    (info, DistributedParamId::from(i as u64))
                })
                .collect();
            let plan: Plan = BucketPlan::build(params, &config, BucketOrder::Forward);
            assert_eq!(plan.buckets.len(), 3, "{:?}", plan.bucket_names());
            let plan = match owners {
                Some(owners) => plan.sharded(owners, 2),
                None => plan,
            };
            let link = HostLink::start(pg.clone());
            let device = NdArrayDevice::Cpu;
            let mut last = DeviceCounts::default();
            for step in 0..steps {
                let have = |slot: usize| !(absent && r == 1 && (slot == 2 || slot == 3));
                let mut expected = Vec::new();
                for (slot, shape) in SHAPES.iter().enumerate() {
                    let mut v = grad(shape, r, slot, step);
                    if !have(slot) {
                        v.iter_mut().for_each(|x| *x = 0.0);
                    }
                    pg.all_reduce(&mut v, ReduceOp::Mean).unwrap();
                    expected.push(v);
                }
                let before = link.core.counters.read();
                let step_state =
                    DeviceStep::<B, HostLink>::new(plan.slots.len(), plan.buckets.len(), device);
                let mut pass = Pass::new(pg.rank(), &plan, step_state, true);
                let mut pass_link = PassLink {
                    rank: pg.rank(),
                    link: &link,
                    op: ReduceOp::Mean,
                    compression: crate::Compression::None,
                    wait: Duration::from_secs(60),
                };
                for (slot, shape) in SHAPES.iter().enumerate().rev() {
                    let g = have(slot).then(|| {
                        let data = TensorData::new(grad(shape, r, slot, step), *shape)
                            .convert_dtype(grads_in);
                        B::float_from_data(data, &device)
                    });
                    pass.push(&mut pass_link, &plan, slot, g);
                }
                let (out, foreign) = pass.finish(&mut pass_link, &plan).unwrap();
                last = link.core.counters.read().since(&before);
                let mut got: Vec<Option<Vec<f32>>> = vec![None; SHAPES.len()];
                for (slot, t) in out.into_iter().chain(foreign) {
                    if plan.owner(slot).is_some_and(|o| o != pg.rank()) {
                        // Another rank's: released, as an empty tensor of the parameter's rank.
                        let shape = t.shape();
                        let dims = (shape.num_dims(), shape.num_elements());
                        assert_eq!(dims, (SHAPES[slot].len(), 0), "slot {slot}");
                        assert!(have(slot), "rank {r} slot {slot}: not local, not released");
                        continue;
                    }
                    got[slot] = Some(read_f32::<B>(t).unwrap());
                }
                if owners.is_some() {
                    let mine = |i: &usize| plan.owner(*i) == Some(pg.rank());
                    got = (0..got.len()).filter(mine).map(|i| got[i].take()).collect();
                    expected = (0..expected.len())
                        .filter(mine)
                        .map(|i| expected[i].clone())
                        .collect();
                }
                assert_gradients(r, &got, &expected, 1e-6);
            }
            last
        })
    }

    #[test]
    fn the_usual_pass_packs_each_bucket_with_one_operation_and_unpacks_with_none() {
        for c in run(BurnDType::F32, false, 2) {
            // The second pass: the flags of ones were made in the first.
            assert_eq!(c, usual_step(3));
        }
    }

    #[test]
    fn the_first_pass_makes_each_length_of_flags_once() {
        for c in run(BurnDType::F32, false, 1) {
            assert_eq!(c.pack_ops, 3 + 1);
        }
    }

    /// Compression's casts are counted on the 0.22/0.23 line's tests (Flex): Burn 0.21's
    /// NdArray has no f16 or bf16 (burn-ndarray 0.21.0 `src/tensor.rs`, lines 71-84). A gradient
    /// that is not f32 takes the same two casts a compressed bucket does, one each way, per
    /// gradient.
    #[test]
    fn a_gradient_that_is_not_f32_is_cast_once_each_way() {
        for c in run(BurnDType::F64, false, 2) {
            assert_eq!((c.pack_ops, c.unpack_ops, c.host_reads), (3 + 6, 6, 0));
        }
    }

    #[test]
    fn a_gradient_absent_on_one_rank_costs_that_rank_one_fill_one_upload_and_one_read() {
        let counts = run(BurnDType::F32, true, 2);
        assert_eq!(
            (
                counts[0].pack_ops,
                counts[0].unpack_ops,
                counts[0].host_reads
            ),
            (3, 0, 0)
        );
        // Rank 1: zeros for the middle layer's two parameters, their bucket's flags uploaded,
        // the absent flags read.
        assert_eq!(
            (
                counts[1].pack_ops,
                counts[1].unpack_ops,
                counts[1].host_reads
            ),
            (3 + 2 + 1, 1, 1)
        );
    }

    /// Weight and bias of each layer owned by different ranks: every bucket has a block for
    /// each rank.
    const OWNERS: [Rank; 6] = [Rank(0), Rank(1), Rank(1), Rank(0), Rank(0), Rank(1)];

    #[test]
    fn a_sharded_plan_leaves_each_rank_the_reduced_gradients_it_owns_and_no_others() {
        for c in run_plan(BurnDType::F32, false, 2, Some(&OWNERS)) {
            // Reduce-scattered buckets cost what all-reduced ones do.
            assert_eq!(c, usual_step(3));
        }
    }

    #[test]
    fn a_sharded_plan_reads_only_the_owned_flags_of_gradients_absent_here() {
        let counts = run_plan(BurnDType::F32, true, 2, Some(&OWNERS));
        // Rank 1 has no gradient for the middle layer and owns its weight: it reads that flag
        // alone (rank 0 had it); the bias is rank 0's, which had its gradient.
        assert_eq!((counts[0].host_reads, counts[1].host_reads), (0, 1));
    }
}
