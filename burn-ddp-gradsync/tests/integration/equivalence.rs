//! Burn 0.22 or 0.23 (the release this binary is built for) on W processes, each with a batch of `b` and its gradients reduced by `GradSync`
//! after backward, must train exactly like one process on the whole batch of `W·b`: the
//! conformance suite every line runs (`burn_ddp_dev::conformance`: after 20 optimizer steps
//! every parameter matches within 1e-5 relative (f32), every rank's model is bit-identical to
//! the others', and a model trained without synchronisation is beyond the tolerance), then this
//! line's own cases. Real processes, real TCP, real Burn training (Burn's Flex CPU
//! backend).
//!
//! The reference runs in every rank's process, from the weights that `prepare` broadcast.

use burn_ddp as line;

use burn_ddp_comm::{CollectiveError, ModelError};
use burn_ddp_dev::procs;

use burn_ddp_dev::compare;

use burn::module::{Module, ModuleVisitor, Param};
use burn::nn::conv::{Conv2d, Conv2dConfig};
use burn::nn::{Linear, LinearConfig, Relu};
use burn::optim::{AdamConfig, GradientsAccumulator, GradientsParams, ModuleOptimizer, SgdConfig};
use burn::tensor::{Device, Distribution, Tensor};
use compare::{assert_close, F32};
use line::fsdp::gather;
use line::{Compression, DdpConfig, DdpError, FsdpConfig, FullyShard, GradSync, ProcessGroup};

use burn_ddp_dev::conformance::{self, Line, Scenario, Trained, IN, OUT, PER_RANK, STEPS};

fn device() -> Device {
    Device::default().autodiff()
}

#[derive(Module, Debug)]
struct Mlp {
    fc1: Linear,
    fc2: Linear,
    /// Never used in `forward`: gets no gradient on any rank.
    unused: Linear,
    act: Relu,
}

impl Mlp {
    fn new(device: &Device, hidden: usize) -> Self {
        Self {
            fc1: LinearConfig::new(IN, hidden).init(device),
            fc2: LinearConfig::new(hidden, OUT).init(device),
            unused: LinearConfig::new(IN, 5).init(device),
            act: Relu::new(),
        }
    }
}

#[derive(Module, Debug)]
struct ConvNet {
    conv: Conv2d,
    fc: Linear,
    act: Relu,
}

/// `x · fc.weight + (tanh(fc.bias) + shift)`: one gradient buffer for both branches of the
/// sum (`conformance::Net::SharedGrad`).
#[derive(Module, Debug)]
struct SharedGrad {
    fc: Linear,
    shift: Param<Tensor<2>>,
}

/// `out(tanh(x · weightᵀ))`: the weight's gradient is a strided view
/// (`conformance::Net::Strided`).
#[derive(Module, Debug)]
struct Strided {
    weight: Param<Tensor<2>>,
    out: Linear,
}

/// One layer applied twice (`out(tanh(fc(tanh(fc(x)))))`): `fc`'s gradients are the sum of two
/// contributions, and only the sum may be reduced (`conformance::Net::Tied`).
#[derive(Module, Debug)]
struct Tied {
    fc: Linear,
    out: Linear,
}

trait Net: Module + Sized {
    fn build(device: &Device) -> Self;
    fn loss(&self, x: Tensor<2>, y: Tensor<2>) -> Tensor<1>;
}

impl Net for Mlp {
    fn build(device: &Device) -> Self {
        Self::new(device, 16)
    }
    fn loss(&self, x: Tensor<2>, y: Tensor<2>) -> Tensor<1> {
        // `gather`: the FSDP scenarios' one changed line per block; without a `FullyShard`,
        // or on a whole model, the block itself.
        // Under FSDP's bf16 policy the gathered weights are bf16: the input is cast to them
        // (FSDP2's `cast_forward_inputs`), the output back to the loss's f32.
        let (fc1, fc2) = (gather(&self.fc1), gather(&self.fc2));
        let x = x.cast(fc1.weight.val().dtype());
        let h = self.act.forward(fc1.forward(x));
        (fc2.forward(h).cast(y.dtype()) - y).powi_scalar(2).mean()
    }
}

impl Net for ConvNet {
    fn build(device: &Device) -> Self {
        Self {
            conv: Conv2dConfig::new([1, 4], [3, 3]).init(device),
            fc: LinearConfig::new(4 * 2 * 2, OUT).init(device),
            act: Relu::new(),
        }
    }
    fn loss(&self, x: Tensor<2>, y: Tensor<2>) -> Tensor<1> {
        let n = x.dims()[0];
        let img = x.reshape([n, 1, 4, 2]).repeat_dim(3, 2); // [n, 1, 4, 4]
        let h = self.act.forward(gather(&self.conv).forward(img)); // [n, 4, 2, 2]
        (gather(&self.fc).forward(h.reshape([n, 16])) - y)
            .powi_scalar(2)
            .mean()
    }
}

impl Net for SharedGrad {
    fn build(device: &Device) -> Self {
        Self {
            fc: LinearConfig::new(IN, OUT).init(device),
            shift: Param::from_tensor(Tensor::random(
                [1, OUT],
                Distribution::Normal(0.0, 0.3),
                device,
            )),
        }
    }
    fn loss(&self, x: Tensor<2>, y: Tensor<2>) -> Tensor<1> {
        let h = x.matmul(self.fc.weight.val()); // [n, OUT]
        let bias = self.fc.bias.as_ref().expect("Linear has a bias").val();
        let shifted = bias.tanh().reshape([1, OUT]) + self.shift.val();
        ((h + shifted) - y).powi_scalar(2).mean()
    }
}

impl Net for Strided {
    fn build(device: &Device) -> Self {
        Self {
            weight: Param::from_tensor(Tensor::random(
                [16, IN],
                Distribution::Normal(0.0, 0.3),
                device,
            )),
            out: LinearConfig::new(16, OUT).init(device),
        }
    }
    fn loss(&self, x: Tensor<2>, y: Tensor<2>) -> Tensor<1> {
        let h = x.matmul(self.weight.val().transpose()).tanh(); // [n, 16]
        (self.out.forward(h) - y).powi_scalar(2).mean()
    }
}

impl Net for Tied {
    fn build(device: &Device) -> Self {
        Self {
            fc: LinearConfig::new(IN, IN).init(device),
            out: LinearConfig::new(IN, OUT).init(device),
        }
    }
    fn loss(&self, x: Tensor<2>, y: Tensor<2>) -> Tensor<1> {
        // Gathered once, used twice: its gradient is the sum of both uses before it is
        // reduce-scattered.
        let fc = gather(&self.fc);
        let h = fc.forward(fc.forward(x).tanh()).tanh();
        (gather(&self.out).forward(h) - y).powi_scalar(2).mean()
    }
}

/// The whole batch of step `step`: the same on every rank.
fn batch(step: usize, world: usize) -> (Tensor<2>, Tensor<2>) {
    let device = device();
    let n = world * PER_RANK;
    device.seed(conformance::batch_seed(step));
    let x = Tensor::<2>::random([n, IN], Distribution::Normal(0.0, 1.0), &device);
    let y = Tensor::<2>::random([n, OUT], Distribution::Normal(0.0, 1.0), &device);
    (x, y)
}

fn shard(t: Tensor<2>, rank: usize, per: usize) -> Tensor<2> {
    t.narrow(0, rank * per, per)
}

/// Every float parameter of `m`, flattened, in visit order.
fn params<M: Module>(m: &M) -> Vec<f32> {
    struct Collect<'a>(&'a mut Vec<f32>);
    impl ModuleVisitor for Collect<'_> {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
            self.0.extend(
                p.val()
                    .into_data()
                    .convert::<f32>()
                    .try_to_vec::<f32>()
                    .unwrap(),
            );
        }
    }
    let mut out = Vec::new();
    m.visit(&mut Collect(&mut out));
    out
}

/// This line's side of the conformance suite.
struct ThisLine;

impl Line for ThisLine {
    fn train(pg: ProcessGroup, s: &Scenario) -> Trained {
        fn with<M: Net>(pg: ProcessGroup, s: &Scenario) -> Trained {
            match (s.mode, s.opt) {
                (conformance::Mode::Resume(_), conformance::Opt::AdamFsdp(config)) => {
                    run_fsdp_resume::<M>(pg, config)
                }
                (_, conformance::Opt::AdamFsdp(config) | conformance::Opt::SgdFsdp(config)) => {
                    run_fsdp::<M>(pg, s, config)
                }
                (conformance::Mode::Resume(_), _) => run_resume::<M>(pg, s),
                _ => run::<M>(pg, s),
            }
        }
        match s.net {
            conformance::Net::Mlp => with::<Mlp>(pg, s),
            conformance::Net::Conv => with::<ConvNet>(pg, s),
            conformance::Net::SharedGrad => with::<SharedGrad>(pg, s),
            conformance::Net::Strided => with::<Strided>(pg, s),
            conformance::Net::Tied => with::<Tied>(pg, s),
        }
    }
}

burn_ddp_dev::conformance_suite!(ThisLine);

mod fsdp {
    burn_ddp_dev::fsdp_suite!(super::ThisLine);
}

fn optimizer(opt: conformance::Opt) -> ModuleOptimizer {
    match opt {
        conformance::Opt::Sgd | conformance::Opt::SgdFsdp(_) => SgdConfig::new().init(),
        conformance::Opt::Adam
        | conformance::Opt::AdamZero
        | conformance::Opt::AdamZero2
        | conformance::Opt::AdamFsdp(_) => AdamConfig::new().init(),
    }
}

/// One half of a [`conformance::Mode::Resume`] scenario on this rank (`conformance::Half`):
/// the first from the prepared model, writing the checkpoint (rank 0: the start, the model and
/// the optimizer's whole state, keyed by parameter position); the second from it, at another
/// world size.
fn run_resume<M: Net>(pg: ProcessGroup, s: &Scenario) -> Trained {
    let half = conformance::Half::from_env();
    let (world, rank) = (pg.world_size().as_usize(), pg.rank().index());
    let device = device();
    device.seed(conformance::init_seed(rank));
    let mut sync = GradSync::new(pg, (s.config)()).unwrap();
    let record = |name: &str| {
        let bytes = burn::tensor::Bytes::from_bytes_vec(half.read(name));
        burn::store::ModuleRecord::from_bytes(bytes).unwrap()
    };
    let built = match half.first {
        true => M::build(&device),
        false => M::build(&device).load_record(record("model.bpk")),
    };
    let mut model = sync.prepare(built).unwrap();
    let mut zero = match s.opt {
        conformance::Opt::AdamZero => sync.zero(AdamConfig::new().init(), &model).unwrap(),
        _ => sync.zero2(AdamConfig::new().init(), &model).unwrap(),
    };
    if !half.first {
        let whole = burn::optim::OptimizerRecord::load(half.path("optim.bpk")).unwrap();
        zero = zero.load_full_record(whole).unwrap();
    } else if rank == 0 {
        half.write(
            "start.bpk",
            &model.clone().into_record().into_bytes().unwrap(),
        );
    }
    let mut alone = M::build(&device).load_record(model.clone().into_record());
    let mut opt_alone = optimizer(s.opt);
    let lr = conformance::LR;
    for step in half.steps() {
        let (x, y) = batch(step, world);
        let mine = |t: &Tensor<2>| shard(t.clone(), rank, PER_RANK);
        let loss = sync.overlapped(&model).unwrap().loss(mine(&x), mine(&y));
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        let grads = sync.sync(&model, grads).unwrap();
        model = zero.step(lr, model, grads).unwrap();
        let grads = GradientsParams::from_grads(alone.loss(mine(&x), mine(&y)).backward(), &alone);
        alone = opt_alone.step(lr, alone, grads);
    }
    let whole = zero.gather_record().unwrap();
    if let (true, Some(whole)) = (half.first, whole) {
        whole.save(half.path("optim.bpk")).unwrap();
        half.write(
            "model.bpk",
            &model.clone().into_record().into_bytes().unwrap(),
        );
    }
    // One process from the start (rank 0 wrote it before the first step's collective) through
    // every step so far, each on its step's whole batch.
    let mut reference = M::build(&device).load_record(record("start.bpk"));
    let mut opt_ref = optimizer(s.opt);
    for step in 0..half.steps().end {
        let (x, y) = batch(step, half.world_of(step, world));
        let grads = GradientsParams::from_grads(reference.loss(x, y).backward(), &reference);
        reference = opt_ref.step(lr, reference, grads);
    }
    Trained {
        ddp: params(&model),
        reference: params(&reference),
        alone: params(&alone),
    }
}

/// One half of an FSDP [`conformance::Mode::Resume`] scenario on this rank: the first from
/// the sharded model, writing the checkpoint (rank 0: the gathered start, the gathered model
/// and the gathered optimizer state); the second from it, at another world size, each rank
/// cutting its shards of both.
fn run_fsdp_resume<M: Net>(pg: ProcessGroup, config: FsdpConfig) -> Trained {
    let half = conformance::Half::from_env();
    let (world, rank) = (pg.world_size().as_usize(), pg.rank().index());
    let plain = device();
    let here = match config.reshard_after_forward {
        true => plain.clone().gradient_checkpointing(),
        false => plain.clone(),
    };
    here.seed(conformance::init_seed(rank));
    let record = |name: &str| {
        let bytes = burn::tensor::Bytes::from_bytes_vec(half.read(name));
        burn::store::ModuleRecord::from_bytes(bytes).unwrap()
    };
    let fsdp = FullyShard::new(pg, config).unwrap();
    let built = match half.first {
        true => M::build(&here),
        false => M::build(&here).load_record(record("model.bpk")),
    };
    let mut model = fsdp.shard(built).unwrap();
    let mut opt = AdamConfig::new().init();
    let start = fsdp.full_model(&model).unwrap().into_record();
    if !half.first {
        let whole = burn::optim::OptimizerRecord::load(half.path("optim.bpk")).unwrap();
        opt = opt.load_record(fsdp.shard_optimizer_record(whole).unwrap());
    } else if rank == 0 {
        half.write("start.bpk", &start.clone().into_bytes().unwrap());
    }
    let mut alone = M::build(&plain).load_record(start);
    let mut opt_alone = AdamConfig::new().init();
    let lr = conformance::LR;
    for step in half.steps() {
        let (x, y) = batch(step, world);
        let mine = |t: &Tensor<2>| shard(t.clone(), rank, PER_RANK);
        let on_here = |t: Tensor<2>| Tensor::from_data(t.into_data(), &here);
        let loss = model.loss(on_here(mine(&x)), on_here(mine(&y)));
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = opt.step(lr, model.clone(), fsdp.sync(&model, grads).unwrap());
        let grads = GradientsParams::from_grads(alone.loss(mine(&x), mine(&y)).backward(), &alone);
        alone = opt_alone.step(lr, alone, grads);
    }
    let whole = fsdp.full_model(&model).unwrap();
    let state = fsdp.full_optimizer_record(opt.to_record()).unwrap();
    if half.first && rank == 0 {
        state.save(half.path("optim.bpk")).unwrap();
        half.write(
            "model.bpk",
            &whole.clone().into_record().into_bytes().unwrap(),
        );
    }
    // One process from the start (rank 0 wrote it before the first step's collective) through
    // every step so far, each on its step's whole batch.
    let mut reference = M::build(&plain).load_record(record("start.bpk"));
    let mut opt_ref = AdamConfig::new().init();
    for step in 0..half.steps().end {
        let (x, y) = batch(step, half.world_of(step, world));
        let grads = GradientsParams::from_grads(reference.loss(x, y).backward(), &reference);
        reference = opt_ref.step(lr, reference, grads);
    }
    Trained {
        ddp: params(&whole),
        reference: params(&reference),
        alone: params(&alone),
    }
}

/// `m` with every float parameter cast to `dtype` (through autodiff: the gradients reach the
/// f32 parameters).
fn cast_params<M: Module>(m: &M, dtype: burn::tensor::DType) -> M {
    struct Cast(burn::tensor::DType);
    impl burn::module::ModuleMapper for Cast {
        fn map_float<const D: usize>(&mut self, p: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let dtype = self.0;
            p.map(|t| t.cast(dtype))
        }
    }
    m.clone().map(&mut Cast(dtype))
}

/// An FSDP scenario (`conformance::Opt::AdamFsdp`) on this rank: the model sharded by
/// `FullyShard` (on a gradient-checkpointing device when the parameters are gathered again for
/// backward), each block gathered in the nets' forward, Burn's Adam stepping the shards; the
/// reference and the negative control from the gathered start, compared with the gathered end.
fn run_fsdp<M: Net>(pg: ProcessGroup, s: &Scenario, config: FsdpConfig) -> Trained {
    let world = pg.world_size().as_usize();
    let rank = pg.rank().index();
    let plain = device();
    let here = match config.reshard_after_forward {
        true => plain.clone().gradient_checkpointing(),
        false => plain.clone(),
    };
    // A different init per rank: `shard` must cut rank 0's.
    here.seed(conformance::init_seed(rank));
    let fsdp = FullyShard::new(pg, config).unwrap();
    let mut model = fsdp.shard(M::build(&here)).unwrap();
    let start = fsdp.full_model(&model).unwrap().into_record();
    let mut reference = M::build(&plain).load_record(start.clone());
    let mut alone = M::build(&plain).load_record(start);
    let (held, whole) = fsdp.held_values(&model);
    if world > 1 {
        assert!(held < whole, "{held} of {whole} values held");
    }
    let (mut opt, mut opt_ref, mut opt_alone) =
        (optimizer(s.opt), optimizer(s.opt), optimizer(s.opt));
    let lr = conformance::LR;
    // The reference and the negative control compute in the gathered precision too (their
    // f32 parameters cast, differentiably): one process under the same policy.
    let policy = |m: &M| match config.param_dtype {
        line::fsdp::Precision::F32 => m.clone(),
        line::fsdp::Precision::Bf16 => cast_params(m, burn::tensor::DType::BF16),
        line::fsdp::Precision::F16 => cast_params(m, burn::tensor::DType::F16),
    };
    let micros = match s.mode {
        conformance::Mode::Plain => 1,
        conformance::Mode::Accumulate(k) => k,
        other => panic!("no FSDP scenario runs {other:?}"),
    };
    for step in 0..STEPS {
        let mut acc = GradientsAccumulator::<M>::new();
        let mut acc_ref = GradientsAccumulator::<M>::new();
        let mut acc_alone = GradientsAccumulator::<M>::new();
        for micro in 0..micros {
            let (x, y) = batch(step * micros + micro, world);
            // On the model's device: tensors of one operation share a checkpointing strategy.
            let mine = |t: &Tensor<2>| {
                Tensor::from_data(shard(t.clone(), rank, PER_RANK).into_data(), &here)
            };
            // Each micro-step's backward reduce-scatters its shards' gradients (FSDP2's
            // default); the accumulated shards are the mean's.
            let before = fsdp.gathers();
            let loss = model.loss(mine(&x), mine(&y));
            let forward = fsdp.gathers() - before;
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            let backward = fsdp.gathers() - before - forward;
            // Resharded, the backward gathers again the weights it reads (the matrix products'
            // and the convolution's); kept, it gathers nothing.
            match (world > 1, config.reshard_after_forward) {
                (true, true) => assert!(backward > 0, "{forward} gathers, none again"),
                _ => assert_eq!(backward, 0, "gathers in backward without resharding"),
            }
            acc.accumulate(&model, fsdp.sync(&model, grads).unwrap());
            let plain_rows = |t: &Tensor<2>| shard(t.clone(), rank, PER_RANK);
            let loss = policy(&alone).loss(plain_rows(&x), plain_rows(&y));
            acc_alone.accumulate(&alone, GradientsParams::from_grads(loss.backward(), &alone));
            let loss = policy(&reference).loss(x, y);
            acc_ref.accumulate(
                &reference,
                GradientsParams::from_grads(loss.backward(), &reference),
            );
        }
        model = opt.step(lr, model, acc.grads());
        reference = opt_ref.step(lr, reference, acc_ref.grads());
        alone = opt_alone.step(lr, alone, acc_alone.grads());
    }
    Trained {
        ddp: params(&fsdp.full_model(&model).unwrap()),
        reference: params(&reference),
        alone: params(&alone),
    }
}

fn run<M: Net>(pg: ProcessGroup, s: &Scenario) -> Trained {
    let world = pg.world_size().as_usize();
    let rank = pg.rank().index();
    let device = device();
    // A different init per rank: prepare must fix it.
    device.seed(conformance::init_seed(rank));
    let mut sync = GradSync::new(pg, (s.config)()).unwrap();
    let mut model = sync.prepare(M::build(&device)).unwrap();
    let mut reference = M::build(&device).load_record(model.clone().into_record());
    assert_eq!(params(&model), params(&reference));
    // The negative control: this rank's shard alone, never synchronised.
    let mut alone = M::build(&device).load_record(model.clone().into_record());
    let (mut opt_ddp, mut opt_ref, mut opt_alone) =
        (optimizer(s.opt), optimizer(s.opt), optimizer(s.opt));
    let lr = conformance::LR;
    if s.mode == conformance::Mode::Join {
        return run_join(sync, model, reference, alone, s);
    }
    // ZeRO-1 and 2: the DDP model steps through the sharded optimizer.
    let mut zero = match s.opt {
        conformance::Opt::AdamZero => Some(sync.zero(AdamConfig::new().init(), &model).unwrap()),
        conformance::Opt::AdamZero2 => Some(sync.zero2(AdamConfig::new().init(), &model).unwrap()),
        _ => None,
    };
    let mut step_ddp = |model: M, grads: GradientsParams| match zero.as_mut() {
        Some(zero) => {
            if zero.stage() == 2 {
                // Only the gradients of the parameters this rank owns came back.
                let (owned, _) = zero.owned_elements();
                let got = grad_values(&model, &grads).len();
                assert!(
                    got <= owned,
                    "{got} gradient elements reached a rank owning {owned}"
                );
            }
            zero.step(lr, model, grads).unwrap()
        }
        None => opt_ddp.step(lr, model, grads),
    };
    for step in 0..STEPS {
        match s.mode {
            conformance::Mode::Plain => {
                let (x, y) = batch(step, world);
                // Overlapped (`DdpConfig::overlap`, on by default): the buckets are reduced
                // during backward; off, `overlapped` gives the model back and `sync` reduces
                // after it.
                let loss = sync.overlapped(&model).unwrap().loss(
                    shard(x.clone(), rank, PER_RANK),
                    shard(y.clone(), rank, PER_RANK),
                );
                let grads = GradientsParams::from_grads(loss.backward(), &model);
                let grads = sync.sync(&model, grads).unwrap();
                if sync.config().overlap && world > 1 {
                    // Every bucket but the last left while backward was running: the nets'
                    // parameters are visited in the order forward uses them. Not the MLP's:
                    // its `unused` layer, visited last, is in the first bucket, which waits for
                    // the end of the step, and so do the later ones. (One rank has nothing to
                    // overlap.)
                    let (early, buckets) = sync.sent_during_backward().expect("overlapped");
                    if s.net != conformance::Net::Mlp {
                        assert_eq!(early + 1, buckets, "buckets sent during backward");
                    }
                }
                model = step_ddp(model, grads);

                let loss = alone.loss(
                    shard(x.clone(), rank, PER_RANK),
                    shard(y.clone(), rank, PER_RANK),
                );
                let grads = GradientsParams::from_grads(loss.backward(), &alone);
                alone = opt_alone.step(lr, alone, grads);

                let loss = reference.loss(x, y);
                let grads = GradientsParams::from_grads(loss.backward(), &reference);
                reference = opt_ref.step(lr, reference, grads);
            }
            conformance::Mode::Accumulate(micros) => {
                // Micro-step k: this rank's rows of batch `step · micros + k`, accumulated
                // locally, then one `sync`; the reference's micro-step k is the whole batch.
                let mut acc = GradientsAccumulator::<M>::new();
                let mut acc_ref = GradientsAccumulator::<M>::new();
                let mut acc_alone = GradientsAccumulator::<M>::new();
                let mut last = None;
                for micro in 0..micros {
                    let (x, y) = batch(step * micros + micro, world);
                    let mine = |t: &Tensor<2>| shard(t.clone(), rank, PER_RANK);
                    if micro + 1 < micros {
                        let loss = model.loss(mine(&x), mine(&y));
                        acc.accumulate(
                            &model,
                            GradientsParams::from_grads(loss.backward(), &model),
                        );
                    } else {
                        // The last micro-batch overlapped, the earlier ones' sum added by the
                        // hooks.
                        let overlapped = sync.overlapped_after(&model, acc.grads()).unwrap();
                        let loss = overlapped.loss(mine(&x), mine(&y));
                        last = Some(GradientsParams::from_grads(loss.backward(), &model));
                    }
                    let loss = alone.loss(mine(&x), mine(&y));
                    acc_alone
                        .accumulate(&alone, GradientsParams::from_grads(loss.backward(), &alone));
                    let loss = reference.loss(x, y);
                    acc_ref.accumulate(
                        &reference,
                        GradientsParams::from_grads(loss.backward(), &reference),
                    );
                }
                let grads = sync.sync(&model, last.expect("micro-batches")).unwrap();
                if sync.config().overlap && world > 1 {
                    assert!(sync.sent_during_backward().is_some(), "overlapped");
                }
                model = step_ddp(model, grads);
                reference = opt_ref.step(lr, reference, acc_ref.grads());
                alone = opt_alone.step(lr, alone, acc_alone.grads());
            }
            conformance::Mode::Join => unreachable!("run_join trains it"),
            conformance::Mode::Resume(_) => unreachable!("run_resume trains it"),
        }
    }
    Trained {
        ddp: params(&model),
        reference: params(&reference),
        alone: params(&alone),
    }
}

/// [`conformance::Mode::Join`]: each rank steps on its own batches under `GradSync::join`.
fn run_join<M: Net>(
    mut sync: GradSync,
    model: M,
    mut reference: M,
    mut alone: M,
    s: &Scenario,
) -> Trained {
    let world = sync.group().world_size().as_usize();
    let rank = sync.group().rank().index();
    let (lr, mine) = (conformance::LR, conformance::batches(world, rank));
    let mut opt = optimizer(s.opt);
    let model = sync
        .join(model, |sync, mut model| {
            for step in 0..mine {
                let (x, y) = batch(step, world);
                let loss = model.loss(shard(x, rank, PER_RANK), shard(y, rank, PER_RANK));
                let grads = GradientsParams::from_grads(loss.backward(), &model);
                let grads = sync.sync(&model, grads)?;
                model = opt.step(lr, model, grads);
            }
            Ok(model)
        })
        .unwrap();
    let (mut opt_ref, mut opt_alone) = (optimizer(s.opt), optimizer(s.opt));
    for step in 0..STEPS {
        let (x, y) = batch(step, world);
        // The rows of the ranks that still have a batch.
        let still: Vec<usize> = (0..world)
            .filter(|&r| step < conformance::batches(world, r))
            .collect();
        let rows = |t: &Tensor<2>| {
            let parts = still.iter().map(|&r| shard(t.clone(), r, PER_RANK));
            Tensor::cat(parts.collect(), 0)
        };
        let loss = reference.loss(rows(&x), rows(&y));
        let grads = GradientsParams::from_grads(loss.backward(), &reference);
        reference = opt_ref.step(lr, reference, grads);
        if step < mine {
            let loss = alone.loss(shard(x, rank, PER_RANK), shard(y, rank, PER_RANK));
            let grads = GradientsParams::from_grads(loss.backward(), &alone);
            alone = opt_alone.step(lr, alone, grads);
        }
    }
    Trained {
        ddp: params(&model),
        reference: params(&reference),
        alone: params(&alone),
    }
}

#[test]
fn mismatched_models_fail_at_prepare_naming_the_parameter() {
    const NAME: &str = "mismatched_models_fail_at_prepare_naming_the_parameter";
    if let Some(pg) = procs::child_group(NAME) {
        let rank = pg.rank().index();
        let mut sync = GradSync::new(pg, DdpConfig::default()).unwrap();
        let hidden = if rank == 1 { 17 } else { 16 };
        let err = sync.prepare(Mlp::new(&device(), hidden)).unwrap_err();
        let text = err.to_string();
        println!("rank {rank} error: {text}");
        assert!(
            matches!(err, DdpError::Model(ModelError::ModelMismatch { .. })),
            "{text}"
        );
        assert!(text.contains("fc1.weight"), "{text}");
        assert!(text.contains("rank 1 has"), "{text}");
        assert!(text.contains("ranks 0, 2 have"), "{text}");
        return;
    }
    if !procs::is_any_child() {
        procs::TestJob::new(3, NAME).run().assert_all_ok();
    }
}

/// `fc2` is used on rank 1 only: every rank gets its gradient divided by the world size (the
/// mean over ranks, zeros for the ranks that did not use it); `unused` gets none anywhere.
#[test]
fn a_parameter_used_on_one_rank_gets_the_mean_everywhere() {
    const NAME: &str = "a_parameter_used_on_one_rank_gets_the_mean_everywhere";
    if let Some(pg) = procs::child_group(NAME) {
        let rank = pg.rank().index();
        let world = pg.world_size().as_usize();
        let mut sync = GradSync::new(pg, DdpConfig::default()).unwrap();
        let model = sync.prepare(Mlp::build(&device())).unwrap();
        let (x, y) = batch(0, world);
        let loss_of = |r: usize| {
            let (x, y) = (shard(x.clone(), r, PER_RANK), shard(y.clone(), r, PER_RANK));
            if r == 1 {
                model.loss(x, y)
            } else {
                // fc1 only: fc2 gets no gradient on this rank.
                model
                    .fc1
                    .forward(x)
                    .narrow(1, 0, OUT)
                    .sub(y)
                    .powi_scalar(2)
                    .mean()
            }
        };
        let grads = GradientsParams::from_grads(loss_of(rank).backward(), &model);
        let grads = sync.sync(&model, grads).unwrap();
        let got: Vec<f32> = grads
            .get::<2>(model.fc2.weight.id)
            .expect("fc2 has a gradient on every rank after sync")
            .into_data()
            .try_to_vec()
            .unwrap();
        let on_rank_1 = GradientsParams::from_grads(loss_of(1).backward(), &model)
            .get::<2>(model.fc2.weight.id);
        let want: Vec<f32> = on_rank_1.unwrap().into_data().try_to_vec().unwrap();
        for (g, w) in got.iter().zip(&want) {
            assert!(
                (g - w / world as f32).abs() <= 1e-6 * w.abs().max(1.0),
                "{g} vs {w}/{world}"
            );
        }
        assert!(grads.get::<2>(model.unused.weight.id).is_none());
        return;
    }
    if !procs::is_any_child() {
        procs::TestJob::new(3, NAME).run().assert_all_ok();
    }
}

/// The Learner's partial last step: rank 0 has a batch and overlaps its backward, rank 1 has
/// none and syncs no gradients, with a comparison of the replicas due at that step (every step
/// here). Both get rank 0's gradient over the world size, and the comparison comes after the
/// reduction on both paths (it came before it on the rank without a batch: a chaos run of the
/// 0.23 classifier failed with a collective mismatch at the 100th step after a change of
/// membership, a partial one).
#[test]
fn a_step_overlapped_on_one_rank_only_compares_the_replicas_in_step() {
    const NAME: &str = "a_step_overlapped_on_one_rank_only_compares_the_replicas_in_step";
    if let Some(pg) = procs::child_group(NAME) {
        let rank = pg.rank().index();
        let world = pg.world_size().as_usize() as f32;
        let config = DdpConfig {
            check_replicas_every: 1,
            ..DdpConfig::default()
        };
        let mut sync = GradSync::new(pg, config).unwrap();
        let model = sync.prepare(Mlp::build(&device())).unwrap();
        let (x, y) = batch(0, 1);
        for step in 0..3 {
            let grads = match rank {
                0 => {
                    let loss = sync.overlapped(&model).unwrap().loss(x.clone(), y.clone());
                    GradientsParams::from_grads(loss.backward(), &model)
                }
                _ => GradientsParams::new(),
            };
            let grads = sync
                .sync(&model, grads)
                .unwrap_or_else(|e| panic!("rank {rank}, step {step}: {e}"));
            let alone =
                GradientsParams::from_grads(model.loss(x.clone(), y.clone()).backward(), &model);
            let want: Vec<f32> = grad_values(&model, &alone)
                .iter()
                .map(|g| g / world)
                .collect();
            assert_close(rank, &grad_values(&model, &grads), &want, F32);
        }
        return;
    }
    if !procs::is_any_child() {
        procs::TestJob::new(2, NAME).run().assert_all_ok();
    }
}

/// At world size 1 the mean is the gradient itself: `sync` hands the gradients back untouched,
/// not rounded through bf16 (which the host path at one rank would do).
#[test]
fn at_world_size_1_sync_hands_the_gradients_back_untouched() {
    let config = DdpConfig::default().with_compression(Compression::Bf16);
    let mut sync = GradSync::new(ProcessGroup::single(), config).unwrap();
    let model = sync.prepare(Mlp::build(&device())).unwrap();
    let (x, y) = batch(0, 1);
    let grads = GradientsParams::from_grads(model.loss(x, y).backward(), &model);
    let want = grad_values(&model, &grads);
    let synced = sync.sync(&model, grads).unwrap();
    assert_eq!(grad_values(&model, &synced), want);
    // bf16 keeps the upper 16 bits of an f32.
    let rounded = want.iter().filter(|v| v.to_bits() & 0xffff != 0).count();
    assert!(
        rounded > 0,
        "every gradient is exact in bf16: the test cannot fail"
    );
}

/// The gradients in `grads` of `model`'s float parameters, flattened, in visit order.
fn grad_values<M: Module>(model: &M, grads: &GradientsParams) -> Vec<f32> {
    struct Collect<'a>(&'a GradientsParams, &'a mut Vec<f32>);
    impl ModuleVisitor for Collect<'_> {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
            if let Some(g) = self.0.get::<D>(p.id) {
                self.1
                    .extend(g.into_data().convert::<f32>().try_to_vec::<f32>().unwrap());
            }
        }
    }
    let mut out = Vec::new();
    model.visit(&mut Collect(grads, &mut out));
    out
}

#[test]
fn sync_before_prepare_says_what_to_do() {
    let mut sync = GradSync::new(ProcessGroup::single(), DdpConfig::default()).unwrap();
    let model = Mlp::build(&device());
    let err = sync.sync(&model, GradientsParams::new()).unwrap_err();
    assert!(
        err.to_string().contains("GradSync::prepare was not called"),
        "{err}"
    );
}

#[test]
fn diverged_replicas_fail_naming_the_parameter() {
    const NAME: &str = "diverged_replicas_fail_naming_the_parameter";
    if let Some(pg) = procs::child_group(NAME) {
        let rank = pg.rank().index();
        let config = DdpConfig::default().with_replica_check(2);
        let mut sync = GradSync::new(pg, config).unwrap();
        let mut model = sync.prepare(Mlp::build(&device())).unwrap();
        let mut opt = SgdConfig::new().init();
        for step in 0..4 {
            let (x, y) = batch(step, 2);
            let loss = model.loss(shard(x, rank, PER_RANK), shard(y, rank, PER_RANK));
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            let grads = sync.sync(&model, grads);
            match step {
                // The replicas agree: the check of step 2 passes.
                0 | 1 => model = opt.step(0.1, model, grads.unwrap()),
                // Rank 1 changes one weight by itself (as a rank-local update would).
                2 => {
                    model = opt.step(0.1, model, grads.unwrap());
                    if rank == 1 {
                        // Still trainable: the ranks' models differ by a value, not by their
                        // parameters (that would be refused by the reduction first).
                        model.fc2.bias = model
                            .fc2
                            .bias
                            .map(|p| p.map(|b| b.add_scalar(1e-3).detach().require_grad()));
                    }
                }
                // The check of step 4 names it on every rank.
                _ => {
                    let Err(e) = grads else {
                        panic!("rank {rank}: diverged replicas went unnoticed")
                    };
                    let text = e.to_string();
                    assert!(
                        matches!(
                            e,
                            DdpError::Model(ModelError::ReplicasDiverged { step: 4, .. })
                        ),
                        "{text}"
                    );
                    assert!(text.contains("`fc2.bias`"), "{text}");
                    assert!(text.contains("rank 1 has digest"), "{text}");
                }
            }
        }
        return;
    }
    if !procs::is_any_child() {
        procs::TestJob::new(2, NAME).run().assert_all_ok();
    }
}

#[derive(Module, Debug)]
struct Normed {
    fc: Linear,
    norm: burn::nn::BatchNorm,
}

/// 20 steps of a BatchNorm model with `sync_buffers` before each forward (PyTorch's
/// `broadcast_buffers=True`): every rank ends with rank 0's running statistics, bit for bit, and
/// the same parameters; rank 0's statistics moved (the test is not vacuous). With the switch
/// off, `sync_buffers` leaves each rank its own.
fn train_normed(pg: ProcessGroup, broadcast: bool) {
    let rank = pg.rank().index();
    let device = device();
    device.seed(23 + rank as u64);
    let config = DdpConfig::default().with_broadcast_buffers(broadcast);
    let mut sync = GradSync::new(pg, config).unwrap();
    let initial = burn::nn::BatchNormConfig::new(OUT).init(&device);
    let initial_mean = initial.running_mean.value().into_data();
    let mut model = sync
        .prepare(Normed {
            fc: LinearConfig::new(IN, OUT).init(&device),
            norm: initial,
        })
        .unwrap();
    let mut opt = SgdConfig::new().init();
    for step in 0..STEPS {
        model = sync.sync_buffers(model).unwrap();
        let (x, y) = batch(step, 2);
        let out = model
            .norm
            .forward(model.fc.forward(shard(x, rank, PER_RANK)));
        let loss = (out - shard(y, rank, PER_RANK)).powi_scalar(2).mean();
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        let grads = sync.sync(&model, grads).unwrap();
        model = opt.step(0.1, model, grads);
    }
    model = sync.sync_buffers(model).unwrap();
    sync.check_replicas(&model).unwrap();
    let mean = model.norm.running_mean.value_sync().into_data();
    let var = model.norm.running_var.value_sync().into_data();
    assert_ne!(mean, initial_mean, "the running mean never moved");
    let mine: Vec<u8> = [mean.as_bytes(), var.as_bytes()].concat();
    let first = sync
        .group()
        .broadcast_bytes(mine.clone(), line::Rank(0))
        .unwrap();
    if broadcast {
        assert_eq!(first, mine, "rank {rank}'s buffers differ from rank 0's");
        // The whole model, buffers included, is rank 0's.
        let all = params(&model);
        let bytes: Vec<u8> = all.iter().flat_map(|v| v.to_le_bytes()).collect();
        let first = sync
            .group()
            .broadcast_bytes(bytes.clone(), line::Rank(0))
            .unwrap();
        assert_eq!(first, bytes, "rank {rank}'s model differs from rank 0's");
    } else {
        assert!(
            rank == 0 || first != mine,
            "rank {rank}'s buffers were replaced"
        );
    }
}

#[test]
fn broadcast_buffers_give_every_rank_rank_0s_running_statistics() {
    const NAME: &str = "broadcast_buffers_give_every_rank_rank_0s_running_statistics";
    if let Some(pg) = procs::child_group(NAME) {
        train_normed(pg, true);
        return;
    }
    if !procs::is_any_child() {
        procs::TestJob::new(2, NAME).run().assert_all_ok();
    }
}

#[test]
fn without_broadcast_buffers_each_rank_keeps_its_own() {
    const NAME: &str = "without_broadcast_buffers_each_rank_keeps_its_own";
    if let Some(pg) = procs::child_group(NAME) {
        train_normed(pg, false);
        return;
    }
    if !procs::is_any_child() {
        procs::TestJob::new(2, NAME).run().assert_all_ok();
    }
}

/// A BatchNorm model with `sync_buffers` before every forward, rank 0 running out first: the
/// buffers come from the lowest rank still training, and every rank ends with the same
/// parameters and buffers.
#[test]
fn uneven_inputs_with_buffers_end_with_one_model_when_rank_0_runs_out_first() {
    const NAME: &str = "uneven_inputs_with_buffers_end_with_one_model_when_rank_0_runs_out_first";
    if let Some(pg) = procs::child_group(NAME) {
        let rank = pg.rank().index();
        let counts = [3, 8, 5];
        let device = device();
        let mut sync = GradSync::new(pg, DdpConfig::default()).unwrap();
        let model = sync
            .prepare(Normed {
                fc: LinearConfig::new(IN, OUT).init(&device),
                norm: burn::nn::BatchNormConfig::new(OUT).init(&device),
            })
            .unwrap();
        let mut opt = SgdConfig::new().init();
        let model = sync
            .join(model, |sync, mut model| {
                for step in 0..counts[rank] {
                    model = sync.sync_buffers(model)?;
                    let (x, y) = batch(step, 3);
                    let out = model
                        .norm
                        .forward(model.fc.forward(shard(x, rank, PER_RANK)));
                    let loss = (out - shard(y, rank, PER_RANK)).powi_scalar(2).mean();
                    let grads = GradientsParams::from_grads(loss.backward(), &model);
                    let grads = sync.sync(&model, grads)?;
                    model = opt.step(0.1, model, grads);
                }
                Ok(model)
            })
            .unwrap();
        let mean = model.norm.running_mean.value_sync().into_data();
        let mine: Vec<u8> = params(&model)
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .chain(mean.as_bytes().iter().copied())
            .collect();
        let all = sync.group().all_gather_bytes(&mine).unwrap();
        assert!(
            all.iter().all(|b| *b == mine),
            "rank {rank}: the ranks' models or buffers differ"
        );
        return;
    }
    if !procs::is_any_child() {
        procs::TestJob::new(3, NAME).run().assert_all_ok();
    }
}

/// Without `join`, 10 batches on rank 0 and 7 on rank 1: rank 1 finishes and leaves, and rank
/// 0's next synchronisation fails naming rank 1 (no hang).
#[test]
fn uneven_inputs_without_join_fail_naming_the_rank_that_ran_out() {
    const NAME: &str = "uneven_inputs_without_join_fail_naming_the_rank_that_ran_out";
    if let Some(pg) = procs::child_group(NAME) {
        let rank = pg.rank().index();
        let mut sync = GradSync::new(pg, DdpConfig::default()).unwrap();
        let mut model = sync.prepare(Mlp::build(&device())).unwrap();
        let mut opt = SgdConfig::new().init();
        for step in 0..[10, 7][rank] {
            let (x, y) = batch(step, 2);
            let loss = model.loss(shard(x, rank, PER_RANK), shard(y, rank, PER_RANK));
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            match sync.sync(&model, grads) {
                Ok(grads) => model = opt.step(0.1, model, grads),
                Err(e) => {
                    let text = e.to_string();
                    println!("rank {rank} at step {step}: {text}");
                    assert_eq!((rank, step), (0, 7), "{text}");
                    assert!(
                        matches!(e, DdpError::Collective(CollectiveError::PeerFinished { peer, .. }) if peer.index() == 1),
                        "{text}"
                    );
                    assert!(text.contains("rank 1 ended normally"), "{text}");
                    assert!(text.contains("GradSync::join"), "{text}");
                    return;
                }
            }
        }
        assert_eq!(
            rank, 1,
            "rank 0 finished 10 steps with a partner that took 7"
        );
        return;
    }
    if !procs::is_any_child() {
        let out = procs::TestJob::new(2, NAME).run();
        println!("{}", out.report());
        out.assert_all_ok();
    }
}

/// Steps `from..to` of one process with `opt` on the whole batch of `world` ranks.
fn reference_steps(
    mut model: Mlp,
    opt: &mut ModuleOptimizer,
    steps: std::ops::Range<usize>,
    world: usize,
) -> Mlp {
    for step in steps {
        let (x, y) = batch(step, world);
        let grads = GradientsParams::from_grads(model.loss(x, y).backward(), &model);
        model = opt.step(0.05, model, grads);
    }
    model
}

/// The bytes of an optimizer record's state tensors (not its keys, whose length varies with the
/// random `ParamId`s).
fn state_bytes(record: burn::optim::OptimizerRecord) -> usize {
    let reader = burn_pack::Reader::from_bytes(record.into_bytes().unwrap()).unwrap();
    let tensors = reader.into_tensors().unwrap();
    tensors.iter().map(|t| t.byte_len()).sum()
}

/// ZeRO-1 with Adam: 20 steps equal one process with Adam on the whole batch, every rank's
/// model is bit-identical, a rank that steps its shard alone (the negative control) is beyond
/// the tolerance, and each rank keeps about 1/N of the optimizer state (measured against a
/// plain Adam's state of the same model, printed).
fn zero_trains(pg: ProcessGroup) {
    let world = pg.world_size().as_usize();
    let rank = pg.rank().index();
    let device = device();
    device.seed(7 + rank as u64);
    let mut sync = GradSync::new(pg, DdpConfig::default()).unwrap();
    let mut model = sync.prepare(Mlp::new(&device, 16)).unwrap();
    let reference = Mlp::new(&device, 16).load_record(model.clone().into_record());
    let mut zero = sync.zero(AdamConfig::new().init(), &model).unwrap();
    for step in 0..STEPS {
        let (x, y) = batch(step, world);
        let loss = model.loss(shard(x, rank, PER_RANK), shard(y, rank, PER_RANK));
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        let grads = sync.sync(&model, grads).unwrap();
        model = zero.step(0.05, model, grads).unwrap();
    }
    let mut plain = AdamConfig::new().init();
    let reference = reference_steps(reference, &mut plain, 0..STEPS, world);
    let (got, want) = (params(&model), params(&reference));
    assert_close(rank, &got, &want, F32);
    let mine = compare::f32_bytes(&got);
    let all = sync.group().all_gather_bytes(&mine).unwrap();
    compare::assert_replicas_equal(rank, &mine, &all);

    let mine = state_bytes(zero.to_record());
    let full = state_bytes(plain.to_record());
    let (owned, total) = zero.owned_elements();
    println!(
        "zero w{world} rank {rank}: optimizer state {mine} bytes, plain Adam {full} bytes \
         ({:.3} of it; owns {owned} of {total} parameter elements)",
        mine as f64 / full as f64
    );
    // Adam keeps two f32 moments per element it steps: no more than this rank's parameters'.
    assert!(
        mine <= owned * 8 && mine < full,
        "rank {rank} keeps {mine} of {full} bytes of optimizer state at world size {world}, \
         owning {owned} of {total} elements"
    );
    // The shards are disjoint and together the whole state.
    let shards = sync
        .group()
        .all_gather_bytes(&(mine as u64).to_le_bytes())
        .unwrap();
    let sum: u64 = shards
        .iter()
        .map(|b| u64::from_le_bytes(b[..8].try_into().unwrap()))
        .sum();
    assert_eq!(
        sum, full as u64,
        "the ranks' shards do not add up to the whole state"
    );
    // The shards together are the whole state: rank 0's merged record holds as many state
    // bytes as a plain Adam's (the same entries, keyed by position instead of id).
    if let Some(whole) = zero.gather_record().unwrap() {
        assert_eq!(state_bytes(whole), full);
    }
}

#[test]
fn zero_adam_trains_like_one_process_and_keeps_a_shard_of_the_state() {
    for world in [2, 3] {
        let name = format!("zero_w{world}");
        if let Some(pg) = procs::child_group(&name) {
            zero_trains(pg);
            return;
        }
        if !procs::is_any_child() && procs::world_selected(world) {
            let out = procs::TestJob::new(world as u32, &name)
                .function("zero_adam_trains_like_one_process_and_keeps_a_shard_of_the_state")
                .run();
            println!("{}", out.report());
            out.assert_all_ok();
        }
    }
}

/// ZeRO checkpoints across world sizes and stages: 10 steps on 2 ranks (ZeRO stage
/// `ZERO_FIRST_STAGE`), rank 0 saves the model and the gathered optimizer state; 10 more on 3
/// ranks (stage `ZERO_SECOND_STAGE`) from them. The result equals one process with
/// Adam through both halves (the first on 2 ranks' batches, the second on 3 ranks'), and a
/// resume that drops the optimizer state (the negative control) does not.
fn zero_half(pg: ProcessGroup, dir: &std::path::Path) {
    let world = pg.world_size().as_usize();
    let rank = pg.rank().index();
    let device = device();
    device.seed(7 + rank as u64);
    let first = world == 2;
    let mut sync = GradSync::new(pg, DdpConfig::default()).unwrap();
    let built = Mlp::new(&device, 16);
    let built = if first {
        built
    } else {
        let bytes = std::fs::read(dir.join("model.bpk")).unwrap();
        built.load_record(
            burn::store::ModuleRecord::from_bytes(burn::tensor::Bytes::from_bytes_vec(bytes))
                .unwrap(),
        )
    };
    let mut model = sync.prepare(built).unwrap();
    let var = if first {
        "ZERO_FIRST_STAGE"
    } else {
        "ZERO_SECOND_STAGE"
    };
    let mut zero = match std::env::var(var).unwrap().as_str() {
        "1" => sync.zero(AdamConfig::new().init(), &model).unwrap(),
        _ => sync.zero2(AdamConfig::new().init(), &model).unwrap(),
    };
    if first {
        if rank == 0 {
            let bytes = model.clone().into_record().into_bytes().unwrap();
            std::fs::write(dir.join("start.bpk"), &*bytes).unwrap();
        }
    } else {
        let whole = burn::optim::OptimizerRecord::load(dir.join("optim.bpk")).unwrap();
        zero = zero.load_full_record(whole).unwrap();
    }
    let steps = if first { 0..10 } else { 10..20 };
    for step in steps {
        let (x, y) = batch(step, world);
        let loss = model.loss(shard(x, rank, PER_RANK), shard(y, rank, PER_RANK));
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        let grads = sync.sync(&model, grads).unwrap();
        model = zero.step(0.05, model, grads).unwrap();
    }
    let whole = zero.gather_record().unwrap();
    if first {
        if let Some(whole) = whole {
            whole.save(dir.join("optim.bpk")).unwrap();
            let bytes = model.into_record().into_bytes().unwrap();
            std::fs::write(dir.join("model.bpk"), &*bytes).unwrap();
        }
        return;
    }
    let start = || {
        let bytes = std::fs::read(dir.join("start.bpk")).unwrap();
        Mlp::new(&device, 16).load_record(
            burn::store::ModuleRecord::from_bytes(burn::tensor::Bytes::from_bytes_vec(bytes))
                .unwrap(),
        )
    };
    let mut opt = AdamConfig::new().init();
    let reference = reference_steps(start(), &mut opt, 0..10, 2);
    let reference = reference_steps(reference, &mut opt, 10..20, 3);
    let want = params(&reference);
    assert_close(rank, &params(&model), &want, F32);
    // Without the state (Adam starting afresh at step 10) the result is elsewhere.
    let mut opt = AdamConfig::new().init();
    let restarted = reference_steps(start(), &mut opt, 0..10, 2);
    let restarted = reference_steps(restarted, &mut AdamConfig::new().init(), 10..20, 3);
    compare::assert_discriminates(rank, &params(&restarted), &want, F32);
}

#[test]
fn zero_resumes_from_a_checkpoint_written_at_another_world_size() {
    const NAME: &str = "zero_resumes_from_a_checkpoint_written_at_another_world_size";
    if let Some(pg) = procs::child_group(NAME) {
        let dir = std::path::PathBuf::from(std::env::var("ZERO_CHECKPOINT_DIR").unwrap());
        zero_half(pg, &dir);
        return;
    }
    if procs::is_any_child() || !procs::world_selected(3) {
        return;
    }
    let dir = std::env::temp_dir().join(format!(
        "{}-zero-{}",
        env!("CARGO_PKG_NAME"),
        std::process::id()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    // Stage 1 throughout, stage 2 throughout, and a stage-1 checkpoint resumed in stage 2.
    for (first, second) in [(1, 1), (2, 2), (1, 2)] {
        for world in [2, 3] {
            procs::TestJob::new(world, NAME)
                .env("ZERO_CHECKPOINT_DIR", dir.display())
                .env("ZERO_FIRST_STAGE", first)
                .env("ZERO_SECOND_STAGE", second)
                .run()
                .assert_all_ok();
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn zero_before_prepare_and_a_foreign_state_are_refused() {
    const NAME: &str = "zero_before_prepare_and_a_foreign_state_are_refused";
    if let Some(pg) = procs::child_group(NAME) {
        let device = device();
        let mut sync = GradSync::new(pg, DdpConfig::default()).unwrap();
        let err = sync
            .zero(AdamConfig::new().init(), &Mlp::new(&device, 16))
            .unwrap_err()
            .to_string();
        assert!(err.contains("GradSync::prepare was not called"), "{err}");
        let model = sync.prepare(Mlp::new(&device, 16)).unwrap();
        // A plain Adam's state after two steps of another instance of the model.
        let mut big = Mlp::new(&device, 16);
        let mut opt = AdamConfig::new().init();
        for step in 0..2 {
            let (x, y) = batch(step, 1);
            let grads = GradientsParams::from_grads(big.loss(x, y).backward(), &big);
            big = opt.step(0.05, big, grads);
        }
        // A plain optimizer's record is keyed by ParamId (huge numbers), not by position.
        let zero = sync.zero(AdamConfig::new().init(), &model).unwrap();
        let err = zero
            .load_full_record(opt.to_record())
            .unwrap_err()
            .to_string();
        assert!(err.contains("the state of another model"), "{err}");
        // ZeRO stage 2 reduce-scatters its buckets: a hook that reduces whole ones is refused,
        // saying what to change.
        let config = DdpConfig::default().with_power_sgd(burn_ddp_comm::grad::PowerSgd::new(1));
        let pg = sync.group().clone();
        drop(sync);
        let mut sync = GradSync::new(pg, config).unwrap();
        let model = sync.prepare(Mlp::new(&device, 16)).unwrap();
        let err = sync
            .zero2(AdamConfig::new().init(), &model)
            .unwrap_err()
            .to_string();
        assert!(err.contains("drop PowerSGD, or use ZeRO stage 1"), "{err}");
        return;
    }
    if !procs::is_any_child() {
        procs::TestJob::new(2, NAME).run().assert_all_ok();
    }
}

/// A linear layer, a SyncBatchNorm, a linear head.
#[derive(Module, Debug)]
struct SyncNormed {
    fc: Linear,
    norm: line::nn::SyncBatchNorm,
    head: Linear,
}

/// [`SyncNormed`] with Burn's BatchNorm: the single-process reference.
#[derive(Module, Debug)]
struct BatchNormed {
    fc: Linear,
    norm: burn::nn::BatchNorm,
    head: Linear,
}

/// `n` rows of inputs and targets for step `step`: the same on every rank.
fn rows(step: usize, n: usize) -> (Tensor<2>, Tensor<2>) {
    let device = device();
    device.seed(5000 + step as u64);
    let x = Tensor::<2>::random([n, IN], Distribution::Normal(0.0, 1.0), &device);
    let y = Tensor::<2>::random([n, 4 * OUT], Distribution::Normal(0.5, 1.0), &device);
    (x, y)
}

/// The head's output over the normalized hidden layer: `[n, 4·OUT]` normalized as `[n, OUT, 2,
/// 2]` (2-D BatchNorm) or as `[n, 4·OUT, 1, 1]` (one channel per feature).
fn normed_out(
    fc: &Linear,
    head: &Linear,
    x: Tensor<2>,
    spatial: bool,
    norm: impl Fn(Tensor<4>) -> Tensor<4>,
) -> Tensor<2> {
    let n = x.dims()[0];
    let h = fc.forward(x);
    let h = match spatial {
        true => norm(h.reshape([n, OUT, 2, 2])),
        false => norm(h.reshape([n, 4 * OUT, 1, 1])),
    };
    head.forward(h.reshape([n, 4 * OUT]).tanh())
}

/// SyncBatchNorm on ranks with `sizes[r]` rows each must equal one process with Burn's
/// BatchNorm on all the rows: the forward output and the synchronised gradients of the first
/// step, then the parameters and running statistics after 20 SGD steps (1e-5 relative); and the
/// first step's output with this rank's own statistics (Burn's BatchNorm on the shard) is beyond
/// the tolerance. Rank r's loss is its squared error summed over its rows, scaled so that the
/// mean over the ranks is the global batch's mean.
fn sync_norm(pg: ProcessGroup, sizes: &[usize], spatial: bool) {
    let world = pg.world_size().as_usize();
    let rank = pg.rank().index();
    let device = device();
    let channels = if spatial { OUT } else { 4 * OUT };
    let layers = |device: &Device| {
        // The same weights on every rank and in the reference: drawn here, right after the
        // seed (Burn 0.22 draws a parameter's initial values when it is first read).
        device.seed(17);
        let fc = LinearConfig::new(IN, 4 * OUT).init(device);
        let head = LinearConfig::new(4 * OUT, 4 * OUT).init(device);
        let _ = (params(&fc), params(&head));
        (fc, head)
    };
    // Small buckets, overlapped: the head's bucket is in flight when the norm's backward
    // all-reduces its statistics' gradients, which must go behind it on every rank.
    let config = DdpConfig {
        bucket_cap_bytes: 256,
        first_bucket_cap_bytes: 256,
        ..DdpConfig::default()
    };
    let mut sync = GradSync::new(pg, config).unwrap();
    let (fc, head) = layers(&device);
    let norm = line::nn::SyncBatchNormConfig::new(channels).init(&device);
    let mut model = sync.prepare(SyncNormed { fc, norm, head }).unwrap();
    let (fc, head) = layers(&device);
    let norm = burn::nn::BatchNormConfig::new(channels).init(&device);
    let mut reference = BatchNormed { fc, norm, head };
    assert_eq!(
        params(&model),
        params(&reference),
        "the reference starts elsewhere"
    );
    let total: usize = sizes.iter().sum();
    let start: usize = sizes[..rank].iter().sum();
    let mine = sizes[rank];
    let elements = (total * 4 * OUT) as f64;
    let values =
        |t: Tensor<2>| -> Vec<f32> { t.into_data().convert::<f32>().try_to_vec().unwrap() };
    let mut opt = SgdConfig::new().init();
    let mut opt_ref = SgdConfig::new().init();
    for step in 0..STEPS {
        let (x, y) = rows(step, total);
        let x_mine = x.clone().narrow(0, start, mine);
        let overlapped = sync.overlapped(&model).unwrap();
        let out = normed_out(
            &overlapped.fc,
            &overlapped.head,
            x_mine.clone(),
            spatial,
            |h| overlapped.norm.forward(h),
        );
        let loss = (out.clone() - y.clone().narrow(0, start, mine))
            .powi_scalar(2)
            .sum()
            .mul_scalar(world as f64 / elements);
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        let grads = sync.sync(&model, grads).unwrap();
        if world > 1 {
            let (early, buckets) = sync.sent_during_backward().expect("overlapped");
            assert!(
                buckets > 2 && early + 1 == buckets,
                "{early} of {buckets} buckets early"
            );
        }

        let out_ref = normed_out(&reference.fc, &reference.head, x, spatial, |h| {
            reference.norm.forward(h)
        });
        let loss_ref = (out_ref.clone() - y).powi_scalar(2).mean();
        let grads_ref = GradientsParams::from_grads(loss_ref.backward(), &reference);
        if step == 0 {
            let want = values(out_ref.narrow(0, start, mine));
            assert_close(rank, &values(out), &want, F32);
            let local = burn::nn::BatchNormConfig::new(channels).init(&device);
            let alone = normed_out(&reference.fc, &reference.head, x_mine, spatial, |h| {
                local.forward(h)
            });
            compare::assert_discriminates(rank, &values(alone), &want, F32);
            assert_close(
                rank,
                &grad_values(&model.fc, &grads),
                &grad_values(&reference.fc, &grads_ref),
                F32,
            );
        }
        model = opt.step(0.1, model, grads);
        reference = opt_ref.step(0.1, reference, grads_ref);
    }
    assert_close(rank, &params(&model), &params(&reference), F32);
    let stats = |n: &burn::nn::BatchNorm| -> Vec<f32> {
        let (mean, var) = (n.running_mean.value_sync(), n.running_var.value_sync());
        let mut v: Vec<f32> = mean.into_data().convert::<f32>().try_to_vec().unwrap();
        v.extend(
            var.into_data()
                .convert::<f32>()
                .try_to_vec::<f32>()
                .unwrap(),
        );
        v
    };
    let synced = stats(&model.norm.into_batch_norm());
    assert_close(rank, &synced, &stats(&reference.norm), F32);
}

#[test]
fn sync_batch_norm_trains_like_one_process_with_batch_norm_on_the_global_batch() {
    for (name, sizes, spatial) in [
        ("sync_bn_1d_w2", &[4, 4][..], false),
        ("sync_bn_2d_w2", &[4, 4][..], true),
        // Different batch sizes.
        ("sync_bn_2d_uneven_w3", &[3, 6, 4][..], true),
    ] {
        let world = sizes.len();
        if let Some(pg) = procs::child_group(name) {
            sync_norm(pg, sizes, spatial);
            return;
        }
        if !procs::is_any_child() && procs::world_selected(world) {
            procs::TestJob::new(world as u32, name)
                .function(
                    "sync_batch_norm_trains_like_one_process_with_batch_norm_on_the_global_batch",
                )
                .run()
                .assert_all_ok();
        }
    }
}
