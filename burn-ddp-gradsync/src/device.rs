//! The device transport of [`GradSync::sync`](crate::GradSync::sync): buckets packed by Burn on
//! the gradients' device, handed to a issuer thread that reduces them, and unpacked as views.
//! Generic over its [`DeviceLink`]: NCCL on a CUDA device (`cuda.rs`, which says how a bucket
//! reaches NCCL), or, in this crate's tests, a stand-in that reduces over the host, so that the
//! same packing, flags and unpacking run, and are counted ([`DeviceCounts`]), on a CPU backend.
//!
//! Per step, after backward:
//! 1. each trainable parameter's gradient is flattened where it is (f32: a cast where it was
//!    not); every bucket is packed into one contiguous device tensor by Burn (`cat` of the
//!    flattened gradients, zeros for parameters without a gradient on this rank, then one
//!    presence flag per parameter; a cast for compression): one device-to-device copy, as
//!    PyTorch DDP's bucket copy. The flags of a bucket whose every gradient is here are a
//!    tensor of ones the link keeps from step to step, so the usual step fills none;
//! 2. as soon as a bucket is packed (still queued work), it goes with a fresh output buffer to
//!    the issuer thread, with the cubecl `StreamId` of the thread that packed it, and packing
//!    goes on with the next bucket;
//! 3. after the last bucket, the step waits for every answer and for the collective queue; a
//!    compressed bucket's output is cast back to f32 once (not per gradient); each parameter that
//!    some rank had a gradient for (its reduced flag is not zero) gets its slice of the output (a
//!    view). Only the flags of parameters without a gradient on this rank are read to the host
//!    (a parameter with one here is present on every rank): none in a step where every
//!    parameter had a gradient.
//!
//! What one bucket costs in the usual step (every gradient here, f32, no compression), as the
//! tests below count it: one packing operation (the `cat`), no unpacking operation, two
//! hand-offs (the job and its answer), and per step one wait for the queue and no transfer to
//! the host. With compression: two packing operations (the `cat`, the cast) and one unpacking
//! operation (the cast back).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use burn::backend::StreamId;
use burn::module::Module;
use burn::optim::GradientsParams;
use burn::tensor::{DType as BurnDType, Device, Tensor};
use burn_ddp_comm::comm::DType;
use burn_ddp_comm::grad::{
    BucketIssuer, BucketPlan, BucketTransport, DeviceCounters, DeviceWork, InFlight, Pass, Piece,
    ANSWER_SLACK,
};
use burn_ddp_comm::{Compression, GradReduction, ProcessGroup, Rank, ReduceOp};

use crate::{DdpError, Result};

/// One bucket for the issuer thread: its packed input and fresh output (both still queued
/// work on the stream `stream`), and how to reduce it.
pub(crate) struct BucketJob {
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
    pub(crate) input: Tensor<1>,
    /// A fresh tensor (`count` elements, or `block`) for the collective to write (NCCL's; the tests'
    /// stand-in makes its own).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) output: Tensor<1>,
    /// The stream that queued both (NCCL's issuer runs as it).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) stream: StreamId,
}

/// What every [`DeviceLink`] holds: its issuer thread, its device, its counters, and the
/// constant runs of packed buckets (by value and length: the presence flags of buckets whose
/// every gradient is here, ones; a sharded bucket's padding, zeros), kept from step to step.
pub(crate) struct LinkCore<P> {
    pub(crate) issuer: BucketIssuer<BucketJob, P>,
    pub(crate) device: Device,
    pub(crate) counters: Arc<DeviceCounters>,
    constants: Mutex<HashMap<(bool, usize), Tensor<1>>>,
}

impl<P> std::fmt::Debug for LinkCore<P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LinkCore")
            .field("device", &self.device)
            .field("counts", &self.counters.read())
            .finish_non_exhaustive()
    }
}

impl<P> LinkCore<P> {
    pub(crate) fn new(
        issuer: BucketIssuer<BucketJob, P>,
        device: Device,
        counters: Arc<DeviceCounters>,
    ) -> Self {
        Self {
            issuer,
            device,
            counters,
            constants: Mutex::new(HashMap::new()),
        }
    }

    /// `n` ones (`one`) or zeros on the link's device, made (one fill) the first time a bucket
    /// needs them.
    fn constant(&self, one: bool, n: usize) -> Tensor<1> {
        let mut constants = self.constants.lock().unwrap_or_else(|p| p.into_inner());
        constants
            .entry((one, n))
            .or_insert_with(|| {
                self.counters.one(DeviceWork::Pack);
                let fill = if one { Tensor::ones } else { Tensor::zeros };
                fill([n], (&self.device, BurnDType::F32))
            })
            .clone()
    }
}

/// How a device transport's buckets are reduced: NCCL (`cuda.rs`), or the tests' stand-in.
pub(crate) trait DeviceLink: 'static {
    /// What the issuer keeps alive while a bucket's collective runs.
    type Pins: Send + 'static;

    /// The issuer, device and counters.
    fn core(&self) -> &LinkCore<Self::Pins>;

    /// Checks that the gradient of `name`, found on `found`, is on the link's device.
    ///
    /// # Errors
    /// It is not, with what to do.
    fn check_device(&self, rank: Rank, name: &str, found: &Device) -> Result<()>;

    /// Bucket `bucket`'s reduced values, once its collective is known done: `output`, which the
    /// collective wrote, unless the link hands back a tensor of its own.
    ///
    /// # Errors
    /// The link has no result for the bucket.
    fn reduced(&self, rank: Rank, bucket: usize, output: Tensor<1>) -> Result<Tensor<1>>;
}

/// The bucket element type for a compression setting: the wire's, and Burn's.
pub(crate) fn bucket_dtype(c: Compression) -> (DType, BurnDType) {
    match c {
        Compression::None => (DType::F32, BurnDType::F32),
        Compression::F16 => (DType::F16, BurnDType::F16),
        Compression::Bf16 => (DType::BF16, BurnDType::BF16),
    }
}

/// The pass of one step over `link` (eager: each bucket goes as soon as its gradients are in).
pub(crate) fn begin<L: DeviceLink>(
    link: &L,
    pg: &ProcessGroup,
    plan: &BucketPlan<usize>,
    (reduction, compression): (GradReduction, Compression),
) -> Pass<DeviceBuckets<L>> {
    let rank = pg.rank();
    link.core().counters.one(DeviceWork::Pass);
    let buckets = DeviceBuckets::<L> {
        op: reduction.op(),
        dtype: bucket_dtype(compression),
        parts: (0..plan.slots.len()).map(|_| None).collect(),
        outputs: (0..plan.buckets.len()).map(|_| None).collect(),
        in_flight: InFlight::new(),
        rank,
        wait: pg.timeouts().collective + ANSWER_SLACK,
    };
    Pass::new(rank, plan, buckets, true)
}

/// Reduces `grads` of `model` over `link` (see the module documentation).
///
/// # Errors
/// A gradient on another device than the link's; a gradient of the wrong size; a model that
/// changed since `prepare`; the link's failures, naming the rank at fault.
pub(crate) fn sync<L: DeviceLink, M: Module>(
    link: &L,
    pg: &ProcessGroup,
    plan: &BucketPlan<usize>,
    how: (GradReduction, Compression),
    model: &M,
    mut grads: GradientsParams,
) -> Result<GradientsParams> {
    let rank = pg.rank();
    let mut pass = begin(link, pg, plan, how);
    let mut link = link;
    let taken = crate::grads::take_grads(rank, plan, model, &mut grads, &mut |slot, grad| {
        pass.push(&mut link, plan, slot, grad);
        Ok(())
    });
    finish(rank, pass, link, plan, (model, grads), taken)
}

/// Ends `pass` (the buckets left, the answers) and writes its reduced gradients into `grads`
/// for `model`'s parameters (`taken`: where they go, or why they could not be taken, which
/// fails the pass after every bucket went).
///
/// # Errors
/// The pass's first failure, or `taken`'s.
pub(crate) fn finish<L: DeviceLink, M: Module>(
    rank: Rank,
    mut pass: Pass<DeviceBuckets<L>>,
    mut link: &L,
    plan: &BucketPlan<usize>,
    (model, mut grads): (&M, GradientsParams),
    taken: Result<Vec<crate::grads::Target>>,
) -> Result<GradientsParams> {
    // A failure still sends every bucket, then stops the link (the other ranks are told) and
    // is reported; the pins go only once the link is known done with them.
    let targets = match taken {
        Ok(t) => Some(t),
        Err(e) => {
            pass.fail(e);
            None
        }
    };
    let mut reduced = pass.finish(&mut link, plan)?;
    let targets = targets.ok_or(DdpError::Internal {
        rank,
        what: "a failed gradient step was not reported",
    })?;
    crate::grads::put_grads(model, &mut grads, &targets, &mut |slot, _| {
        reduced[slot].take()
    });
    Ok(grads)
}

/// The device transport of one step: the flattened gradients until their bucket is packed, and
/// the buckets' outputs.
pub(crate) struct DeviceBuckets<L: DeviceLink> {
    op: ReduceOp,
    dtype: (DType, BurnDType),
    /// Each slot's flattened f32 gradient (`None`: none on this rank, or packed already).
    parts: Vec<Option<Tensor<1>>>,
    /// Each sent bucket's output: its values, then one presence flag per slot.
    outputs: Vec<Option<Tensor<1>>>,
    in_flight: InFlight<L::Pins>,
    rank: Rank,
    /// How long to wait for the issuer's answers and the collective queue.
    wait: Duration,
}

impl<L: DeviceLink> BucketTransport<usize> for DeviceBuckets<L> {
    type Grad<'g> = Tensor<1>;
    type Link<'l> = &'l L;
    type Output = Vec<Option<Tensor<1>>>;

    /// Keeps slot `slot`'s flattened gradient, checked to be on the link's device.
    fn keep(
        &mut self,
        link: &mut &L,
        plan: &BucketPlan<usize>,
        slot: usize,
        g: Tensor<1>,
    ) -> Result<()> {
        link.check_device(self.rank, &plan.slots[slot].info.name, &g.device())?;
        let g = if g.dtype() == BurnDType::F32 {
            g
        } else {
            link.core().counters.one(DeviceWork::Pack);
            g.cast(BurnDType::F32)
        };
        self.parts[slot] = Some(g);
        Ok(())
    }

    /// Packs bucket `bucket` and hands it to the issuer (nothing waits here).
    fn send(&mut self, link: &mut &L, plan: &BucketPlan<usize>, bucket: usize) -> Result<()> {
        let core = link.core();
        let counters = &core.counters;
        let device = &core.device;
        // In the plan's layout: values, then flags (1 where this rank has the gradient),
        // block after block when the plan is sharded, each padded to the block's length.
        let layout = plan.layout(bucket, |slot| self.parts[slot].is_some());
        let mut parts = Vec::with_capacity(layout.len());
        for piece in layout {
            parts.push(match piece {
                Piece::Values(slot) => match self.parts[slot].take() {
                    Some(g) => g,
                    None => {
                        counters.one(DeviceWork::Pack);
                        let numel = plan.slots[slot].info.numel;
                        Tensor::<1>::zeros([numel], (device, BurnDType::F32))
                    }
                },
                Piece::Ones(n) => core.constant(true, n),
                Piece::Flags(flags) => {
                    counters.one(DeviceWork::Pack);
                    Tensor::<1>::from_floats(flags.as_slice(), device)
                }
                Piece::Zeros(n) => core.constant(false, n),
            });
        }
        let (count, block) = (plan.buffer_len(bucket), plan.block(bucket));
        let received = plan.received_len(bucket);
        counters.one(DeviceWork::Pack);
        let packed = Tensor::cat(parts, 0);
        let (_, burn_dtype) = self.dtype;
        let input = if burn_dtype == BurnDType::F32 {
            packed
        } else {
            counters.one(DeviceWork::Pack);
            packed.cast(burn_dtype)
        };
        let output = Tensor::<1>::empty([received], (device, burn_dtype));
        self.outputs[bucket] = Some(output.clone());
        counters.one(DeviceWork::Bucket);
        counters.one(DeviceWork::HandOff);
        self.in_flight.send(
            &core.issuer,
            BucketJob {
                bucket,
                count,
                block,
                dtype: self.dtype,
                op: self.op,
                input,
                output,
                stream: StreamId::current(),
            },
        )
    }

    /// Waits for every answer, then the collective queue; returns each slot's reduced gradient
    /// (flattened f32), `None` where no rank had one.
    fn finish(
        &mut self,
        link: &mut &L,
        plan: &BucketPlan<usize>,
        local: &[bool],
    ) -> Result<Vec<Option<Tensor<1>>>> {
        let core = link.core();
        let counters = &core.counters;
        counters.add(DeviceWork::HandOff, self.in_flight.waiting() as u64);
        counters.one(DeviceWork::QueueWait);
        self.in_flight.finish(&core.issuer, self.wait)?;
        let mut outputs = Vec::with_capacity(self.outputs.len());
        for (bucket, o) in self.outputs.iter_mut().enumerate() {
            let output = o.take().ok_or(DdpError::Internal {
                rank: self.rank,
                what: "a gradient bucket was not launched",
            })?;
            let output = link.reduced(self.rank, bucket, output)?;
            // Compressed: back to f32 once per bucket, not once per gradient.
            outputs.push(if output.dtype() == BurnDType::F32 {
                output
            } else {
                counters.one(DeviceWork::Unpack);
                output.cast(BurnDType::F32)
            });
        }
        let present = present(self.rank, plan, local, &outputs, counters)?;
        Ok((plan.slots.iter().enumerate())
            .zip(present)
            .map(|((i, s), had)| {
                let (offset, _) = plan.received(i, self.rank)?;
                had.then(|| {
                    outputs[s.bucket]
                        .clone()
                        .slice(offset..offset + s.info.numel)
                })
            })
            .collect())
    }

    /// The link is stopped (the other ranks' waits end with this rank named), the issuer's
    /// answers are taken and the queue drained (bounded) before any buffer of the step goes,
    /// so that their memory is not reused under the collective (see [`InFlight::abandon`]).
    fn abandon(&mut self, link: &mut &L, e: DdpError) -> DdpError {
        self.in_flight.abandon(&link.core().issuer, e, self.wait)
    }
}

/// Which slots some rank had a gradient for, of those this rank receives (all, or under ZeRO
/// stage 2 the ones it owns). A slot with this rank's gradient is present on every rank (its
/// reduced flag is at least 1/world): only the flags of the received slots absent here are read
/// to the host, in one transfer, and none when every slot has a local gradient (the usual step:
/// no host synchronisation at its end beyond the queue's).
fn present(
    rank: Rank,
    plan: &BucketPlan<usize>,
    local: &[bool],
    outputs: &[Tensor<1>],
    counters: &DeviceCounters,
) -> Result<Vec<bool>> {
    let absent: Vec<(usize, usize)> = (0..plan.slots.len())
        .filter(|&i| !local[i])
        .filter_map(|i| Some((i, plan.received(i, rank)?.1)))
        .collect();
    let mut present = local.to_vec();
    if absent.is_empty() {
        return Ok(present);
    }
    let flags: Vec<Tensor<1>> = absent
        .iter()
        .map(|&(i, flag)| outputs[plan.slots[i].bucket].clone().slice(flag..flag + 1))
        .collect();
    counters.one(DeviceWork::Unpack);
    counters.one(DeviceWork::HostRead);
    let what = "reading the reduced buckets' presence flags";
    let flags = Tensor::cat(flags, 0)
        .try_into_data()
        .map_err(|e| DdpError::model_access(rank, what, format!("{e:?}")))?
        .try_to_vec::<f32>()
        .map_err(|e| DdpError::model_access(rank, what, format!("{e:?}")))?;
    for (&(i, _), flag) in absent.iter().zip(flags) {
        present[i] = flag != 0.0;
    }
    Ok(present)
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::module::Param;
    use burn::nn::{Linear, LinearConfig};
    use burn::tensor::TensorData;
    use burn_ddp_comm::grad::{BucketOrder, DeviceCounts};
    use burn_ddp_comm::DdpConfig;
    use burn_ddp_dev::device::{assert_gradients, on_thread_ranks, usual_step, ReducedQueue};

    /// A link that reduces each packed bucket over the host (read once, all-reduced by the
    /// process group on the issuer thread, this rank's block kept when the bucket is
    /// reduce-scattered, uploaded as a fresh tensor): the device transport's own packing, flags
    /// and unpacking, on a CPU backend.
    struct HostLink {
        core: LinkCore<()>,
        reduced: Arc<Mutex<HashMap<usize, Tensor<1>>>>,
    }

    impl HostLink {
        fn start(pg: ProcessGroup, device: Device) -> Self {
            let reduced = Arc::new(Mutex::new(HashMap::new()));
            let into = Arc::clone(&reduced);
            let on = device.clone();
            let issuer =
                BucketIssuer::start(pg.rank(), Arc::new(ReducedQueue), move |job: BucketJob| {
                    let rank = pg.rank();
                    let mut values = job
                        .input
                        .into_data()
                        .convert::<f32>()
                        .try_to_vec::<f32>()
                        .map_err(|e| {
                            DdpError::model_access(rank, "reading a bucket", format!("{e:?}"))
                        })?;
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
                    let data = TensorData::new(values, [n]);
                    let t = Tensor::<1>::from_data(data, (&on, job.dtype.1));
                    into.lock().unwrap().insert(job.bucket, t);
                    Ok(())
                })
                .unwrap();
            Self {
                core: LinkCore::new(issuer, device, Arc::default()),
                reduced,
            }
        }
    }

    impl DeviceLink for HostLink {
        type Pins = ();
        fn core(&self) -> &LinkCore<()> {
            &self.core
        }
        fn check_device(&self, _rank: Rank, _name: &str, _found: &Device) -> Result<()> {
            Ok(())
        }
        fn reduced(&self, rank: Rank, bucket: usize, _output: Tensor<1>) -> Result<Tensor<1>> {
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

    #[derive(burn::module::Module, Debug)]
    struct Net {
        a: Linear,
        b: Linear,
        c: Linear,
    }

    /// Each parameter's gradient values, in visit order (`None`: no gradient).
    fn values(model: &Net, grads: &GradientsParams) -> Vec<Option<Vec<f32>>> {
        let get2 = |p: &Param<Tensor<2>>| grads.get::<2>(p.id);
        let get1 = |p: &Param<Tensor<1>>| grads.get::<1>(p.id);
        let read2 = |t: Option<Tensor<2>>| t.map(|t| t.into_data().try_to_vec::<f32>().unwrap());
        let read1 = |t: Option<Tensor<1>>| t.map(|t| t.into_data().try_to_vec::<f32>().unwrap());
        let mut out = Vec::new();
        for l in [&model.a, &model.b, &model.c] {
            out.push(read2(get2(&l.weight)));
            out.push(read1(l.bias.as_ref().and_then(get1)));
        }
        out
    }

    /// Two thread ranks synchronise `steps` steps of `Net` (3 buckets of one layer each) over
    /// the stand-in link; rank 1 has no gradient for layer `b` when `b_absent`. Each rank
    /// checks every gradient against the mean of both ranks' (zeros where absent), and returns
    /// what its link counted in the last step.
    fn run(compression: Compression, b_absent: bool, steps: usize) -> Vec<DeviceCounts> {
        run_plan(compression, b_absent, steps, None)
    }

    /// [`run`] over the plan sharded to `owners` (by slot) when given (ZeRO stage 2): each
    /// rank checks that it got exactly the gradients it owns, each the mean of both ranks'.
    fn run_plan(
        compression: Compression,
        b_absent: bool,
        steps: usize,
        owners: Option<&[Rank]>,
    ) -> Vec<DeviceCounts> {
        let tolerance = if compression == Compression::None {
            1e-6
        } else {
            2e-2
        };
        on_thread_ranks(2, |pg| {
            let device = Device::flex().autodiff();
            let rank = pg.rank().index();
            let layer = |i, o| LinearConfig::new(i, o).init(&device);
            let model = Net {
                a: layer(4, 8),
                b: layer(8, 8),
                c: layer(8, 2),
            };
            // Buckets of one layer each (weight and bias: 8x8 + 8 floats < 300 B).
            let mut config = DdpConfig::default().with_compression(compression);
            config.bucket_cap_bytes = 300;
            config.first_bucket_cap_bytes = 300;
            let trainable = crate::grads::describe(&model)
                .into_iter()
                .enumerate()
                .map(|(slot, (info, _))| (info, slot))
                .collect();
            let plan = BucketPlan::build(trainable, &config, BucketOrder::Forward);
            assert_eq!(plan.buckets.len(), 3, "{:?}", plan.bucket_names());
            let plan = match owners {
                Some(owners) => plan.sharded(owners, 2),
                None => plan,
            };
            let link = HostLink::start(pg.clone(), device.clone());
            let mut last = DeviceCounts::default();
            for step in 0..steps {
                let x = Tensor::<2>::from_floats(
                    [[rank as f32 + step as f32, 1.0, -2.0, 0.5]],
                    &device,
                );
                let y = model.c.forward(model.b.forward(model.a.forward(x)));
                let mut grads = GradientsParams::from_grads(y.sum().backward(), &model);
                if b_absent && rank == 1 {
                    grads.remove::<2>(model.b.weight.id);
                    grads.remove::<1>(model.b.bias.as_ref().unwrap().id);
                }
                // The mean of both ranks' gradients, over the host.
                let mine = values(&model, &grads);
                let mut expected: Vec<Vec<f32>> = Vec::new();
                for (i, g) in mine.iter().enumerate() {
                    let numel = plan.slots[i].info.numel;
                    let mut v = g.clone().unwrap_or_else(|| vec![0.0; numel]);
                    pg.all_reduce(&mut v, ReduceOp::Mean).unwrap();
                    expected.push(v);
                }
                let before = link.core.counters.read();
                let how = (GradReduction::Mean, compression);
                let grads = sync(&link, &pg, &plan, how, &model, grads).unwrap();
                last = link.core.counters.read().since(&before);
                let mut got = values(&model, &grads);
                if owners.is_some() {
                    // Sharded: this rank's own gradients, and none of the others'.
                    let mine = |i: usize| plan.owner(i) == Some(pg.rank());
                    for (i, g) in got.iter().enumerate() {
                        assert_eq!(g.is_some(), mine(i), "rank {rank} slot {i}");
                    }
                    let owned = |i: &usize| mine(*i);
                    got = (0..got.len())
                        .filter(owned)
                        .map(|i| got[i].take())
                        .collect();
                    expected = (0..expected.len())
                        .filter(owned)
                        .map(|i| expected[i].clone())
                        .collect();
                }
                assert_gradients(rank, &got, &expected, tolerance);
            }
            last
        })
    }

    #[test]
    fn the_usual_step_packs_each_bucket_with_one_operation_and_unpacks_with_none() {
        let counts = run(Compression::None, false, 2);
        for c in counts {
            // The second step: the flags of ones were made in the first.
            assert_eq!(c, usual_step(3));
        }
    }

    #[test]
    fn the_first_step_makes_each_length_of_flags_once() {
        let counts = run(Compression::None, false, 1);
        // Every bucket holds two parameters (a layer's weight and bias): one fill of two ones,
        // kept for every later step.
        for c in counts {
            assert_eq!(c.pack_ops, 3 + 1);
        }
    }

    #[test]
    fn compression_casts_each_bucket_once_each_way() {
        for c in run(Compression::Bf16, false, 2) {
            assert_eq!((c.pack_ops, c.unpack_ops, c.host_reads), (6, 3, 0));
        }
    }

    #[test]
    fn a_gradient_absent_on_one_rank_costs_that_rank_one_fill_one_upload_and_one_read() {
        let counts = run(Compression::None, true, 2);
        // Rank 0 had every gradient: its step is the usual one.
        assert_eq!(
            (
                counts[0].pack_ops,
                counts[0].unpack_ops,
                counts[0].host_reads
            ),
            (3, 0, 0)
        );
        // Rank 1: zeros for b's weight and bias, b's flags uploaded, the absent flags read.
        assert_eq!(
            (
                counts[1].pack_ops,
                counts[1].unpack_ops,
                counts[1].host_reads
            ),
            (3 + 2 + 1, 1, 1)
        );
        assert_eq!(counts[1].queue_waits, 1);
    }

    /// Weight and bias of each layer owned by different ranks: every bucket has a block for
    /// each rank.
    const OWNERS: [Rank; 6] = [Rank(0), Rank(1), Rank(1), Rank(0), Rank(0), Rank(1)];

    #[test]
    fn a_sharded_plan_leaves_each_rank_the_reduced_gradients_it_owns_and_no_others() {
        for compression in [Compression::None, Compression::Bf16] {
            for c in run_plan(compression, false, 2, Some(&OWNERS)) {
                // Reduce-scattered buckets cost what all-reduced ones do: one packing operation
                // each (a cast more each way when compressed), nothing read to the host.
                let casts = u64::from(compression != Compression::None);
                assert_eq!(
                    (c.buckets, c.pack_ops, c.unpack_ops, c.host_reads),
                    (3, 3 + 3 * casts, 3 * casts, 0)
                );
            }
        }
    }

    #[test]
    fn a_sharded_plan_reads_only_the_owned_flags_of_gradients_absent_here() {
        let counts = run_plan(Compression::None, true, 2, Some(&OWNERS));
        // Rank 1 has no gradient for b and owns b's weight: it reads that flag alone (rank 0
        // had it, so the weight is present); b's bias is rank 0's, which had its gradient.
        assert_eq!((counts[0].host_reads, counts[1].host_reads), (0, 1));
    }
}
