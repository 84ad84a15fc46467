//! `Autodiff<Ddp<NdArray>>` on W processes, each with a batch of `b`, must train exactly like one
//! process on the whole batch of `W·b`: the conformance suite every line runs
//! (`burn_ddp_dev::conformance`: after 20 optimizer steps every parameter matches within 1e-5
//! relative (f32; 1e-2 on a GPU, whose f32 matrix products run in TF32: see
//! `compare::F32_GPU`), every rank's model is bit-identical to the others', and a model trained
//! without synchronisation is beyond the tolerance), then this line's own cases. Real
//! processes, real TCP, real Burn training.
//!
//! With `--features cuda` the backend is `Autodiff<Ddp<Cuda>>` (scripts/gpu-check.sh runs it with
//! `BURN_DDP_GRAD_TRANSPORT=host` for several processes sharing one GPU, and `=nccl` at world
//! size 1, which takes the zero-copy device path).
//!
//! The reference runs in every rank's process on the same backend without a session (nothing is
//! marked, so nothing is synchronised), from the weights that `prepare` broadcast.

use crate::common;

use burn::backend::autodiff::checkpoint::strategy::BalancedCheckpointing;
use burn::backend::Autodiff;
use burn::module::{AutodiffModule, Module, Param};
use burn::nn::conv::{Conv2d, Conv2dConfig};
use burn::nn::{Linear, LinearConfig, Relu};
use burn::optim::{AdamConfig, GradientsAccumulator, GradientsParams, Optimizer, SgdConfig};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Distribution, Tensor};
use burn_ddp::fsdp::{gather, FsdpBackend, FsdpConfig, FullyShard};
use burn_ddp::{Ddp, DdpConfig, DdpSession, ProcessGroup};
use burn_ddp_comm::{CollectiveError, ModelError};
use common::compare::{assert_close, Tolerance};

/// A session with `config` and the environment's choices (`BURN_DDP_GRAD_TRANSPORT`: the GPU
/// check runs this suite over NCCL at world size 1 and host-staged with several processes).
fn new_session(pg: ProcessGroup, config: DdpConfig) -> burn_ddp::Result<DdpSession> {
    DdpSession::new(pg, config.with_env()?)
}

// `--features cuda` (scripts/gpu-check.sh) runs the same tests on the GPU.
#[cfg(not(feature = "cuda"))]
type B = Autodiff<Ddp<burn::backend::NdArray>>;
#[cfg(feature = "cuda")]
type B = Autodiff<Ddp<burn::backend::Cuda>>;
/// `B` under Burn's gradient checkpointing: what FSDP's resharding needs.
type Bc = Autodiff<<B as AutodiffBackend>::InnerBackend, BalancedCheckpointing>;
/// The FSDP scenarios in reduced precision: Burn's Flex backend (NdArray computes in f32 and
/// f64 only), with checkpointing; on the GPU, `Bc`.
#[cfg(not(feature = "cuda"))]
type Bh = Autodiff<Ddp<burn::backend::Flex>, BalancedCheckpointing>;
#[cfg(feature = "cuda")]
type Bh = Bc;

/// f32 training on this binary's backend.
#[cfg(not(feature = "cuda"))]
const F32: Tolerance = common::compare::F32;
#[cfg(feature = "cuda")]
const F32: Tolerance = common::compare::F32_GPU;

use burn_ddp_dev::conformance::{self, Line, Scenario, Trained, IN, OUT, PER_RANK, STEPS};

#[derive(Module, Debug)]
struct Mlp<B: Backend> {
    fc1: Linear<B>,
    fc2: Linear<B>,
    /// Never used in `forward`: gets no gradient on any rank.
    unused: Linear<B>,
    act: Relu,
}

impl<B: Backend> Mlp<B> {
    fn new(device: &B::Device) -> Self {
        Self {
            fc1: LinearConfig::new(IN, 16).init(device),
            fc2: LinearConfig::new(16, OUT).init(device),
            unused: LinearConfig::new(IN, 5).init(device),
            act: Relu::new(),
        }
    }
}

#[derive(Module, Debug)]
struct ConvNet<B: Backend> {
    conv: Conv2d<B>,
    fc: Linear<B>,
    act: Relu,
}

impl<B: Backend> ConvNet<B> {
    fn new(device: &B::Device) -> Self {
        Self {
            conv: Conv2dConfig::new([1, 4], [3, 3]).init(device),
            fc: LinearConfig::new(4 * 2 * 2, OUT).init(device),
            act: Relu::new(),
        }
    }
}

/// `a + shift` with equal shapes (`a = tanh(fc.bias)`): Burn's autodiff hands one gradient buffer
/// to both branches, so `shift`'s gradient (alone in the first bucket, see its config) is memory
/// that `a`'s backward still reads. A reducer that wrote the average into it in place, while
/// backward goes on, would race with that read.
#[derive(Module, Debug)]
struct SharedGrad<B: Backend> {
    fc: Linear<B>,
    shift: Param<Tensor<B, 2>>,
}

impl<B: Backend> SharedGrad<B> {
    fn new(device: &B::Device) -> Self {
        Self {
            fc: LinearConfig::new(IN, OUT).init(device),
            shift: Param::from_tensor(Tensor::random(
                [1, OUT],
                Distribution::Normal(0.0, 0.3),
                device,
            )),
        }
    }
}

/// The weight is used transposed (`x · wᵀ`), so its gradient is a strided view (the transpose
/// of the matmul's output), not one contiguous span: the device path must copy it before NCCL
/// reads it, the host path reads it element by element.
#[derive(Module, Debug)]
struct Strided<B: Backend> {
    weight: Param<Tensor<B, 2>>,
    out: Linear<B>,
}

impl<B: Backend> Strided<B> {
    fn new(device: &B::Device) -> Self {
        Self {
            weight: Param::from_tensor(Tensor::random(
                [16, IN],
                Distribution::Normal(0.0, 0.3),
                device,
            )),
            out: LinearConfig::new(16, OUT).init(device),
        }
    }
}

/// One layer applied twice (`out(tanh(fc(tanh(fc(x)))))`): `fc`'s gradients are the sum of two
/// contributions, and only the sum may be reduced.
#[derive(Module, Debug)]
struct Tied<B: Backend> {
    fc: Linear<B>,
    out: Linear<B>,
}

trait Net<B: Backend>: Module<B> {
    fn build(device: &B::Device) -> Self;
    fn loss(&self, x: Tensor<B, 2>, y: Tensor<B, 2>) -> Tensor<B, 1>;
}

impl<B: FsdpBackend> Net<B> for Mlp<B> {
    fn build(device: &B::Device) -> Self {
        Self::new(device)
    }
    fn loss(&self, x: Tensor<B, 2>, y: Tensor<B, 2>) -> Tensor<B, 1> {
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

impl<B: FsdpBackend> Net<B> for ConvNet<B> {
    fn build(device: &B::Device) -> Self {
        Self::new(device)
    }
    fn loss(&self, x: Tensor<B, 2>, y: Tensor<B, 2>) -> Tensor<B, 1> {
        let n = x.dims()[0];
        let img = x.reshape([n, 1, 4, 2]).repeat_dim(3, 2); // [n, 1, 4, 4]
        let h = self.act.forward(gather(&self.conv).forward(img)); // [n, 4, 2, 2]
        let out = gather(&self.fc).forward(h.reshape([n, 16]));
        (out - y).powi_scalar(2).mean()
    }
}

impl<B: Backend> Net<B> for SharedGrad<B> {
    fn build(device: &B::Device) -> Self {
        Self::new(device)
    }
    fn loss(&self, x: Tensor<B, 2>, y: Tensor<B, 2>) -> Tensor<B, 1> {
        let h = x.matmul(self.fc.weight.val()); // [n, OUT]
        let bias = self.fc.bias.as_ref().expect("Linear has a bias").val();
        let a = bias.tanh().reshape([1, OUT]);
        // Equal shapes: one gradient buffer for `shift` and for `a`, whose backward (tanh) reads
        // it after `shift`'s gradient was handed to the reducer.
        let shifted = a + self.shift.val();
        ((h + shifted) - y).powi_scalar(2).mean()
    }
}

impl<B: Backend> Net<B> for Strided<B> {
    fn build(device: &B::Device) -> Self {
        Self::new(device)
    }
    fn loss(&self, x: Tensor<B, 2>, y: Tensor<B, 2>) -> Tensor<B, 1> {
        let h = x.matmul(self.weight.val().transpose()).tanh(); // [n, 16]
        (self.out.forward(h) - y).powi_scalar(2).mean()
    }
}

impl<B: FsdpBackend> Net<B> for Tied<B> {
    fn build(device: &B::Device) -> Self {
        Self {
            fc: LinearConfig::new(IN, IN).init(device),
            out: LinearConfig::new(IN, OUT).init(device),
        }
    }
    fn loss(&self, x: Tensor<B, 2>, y: Tensor<B, 2>) -> Tensor<B, 1> {
        // Gathered once, used twice: its gradient is the sum of both uses before it is
        // reduce-scattered.
        let fc = gather(&self.fc);
        let h = fc.forward(fc.forward(x).tanh()).tanh();
        (gather(&self.out).forward(h) - y).powi_scalar(2).mean()
    }
}

/// The whole batch of step `step`: the same on every rank.
fn batch(step: usize, world: usize) -> (Tensor<B, 2>, Tensor<B, 2>) {
    let device = Default::default();
    let n = world * PER_RANK;
    <B as Backend>::seed(&device, conformance::batch_seed(step));
    let x = Tensor::<B, 2>::random([n, IN], Distribution::Normal(0.0, 1.0), &device);
    let y = Tensor::<B, 2>::random([n, OUT], Distribution::Normal(0.0, 1.0), &device);
    (x, y)
}

fn shard(t: Tensor<B, 2>, rank: usize) -> Tensor<B, 2> {
    t.narrow(0, rank * PER_RANK, PER_RANK)
}

/// This line's side of the conformance suite.
struct Line021;

impl Line for Line021 {
    const F32: Tolerance = F32;

    fn train(pg: ProcessGroup, s: &Scenario) -> Trained {
        use conformance::Opt;
        fn with<M: Net<B> + AutodiffModule<B>>(pg: ProcessGroup, s: &Scenario) -> Trained {
            if let conformance::Mode::Resume(_) = s.mode {
                return run_resume::<M>(pg, s);
            }
            match s.opt {
                Opt::Sgd => run::<M, _>(pg, s, || SgdConfig::new().init()),
                Opt::Adam | Opt::AdamZero | Opt::AdamZero2 => {
                    run::<M, _>(pg, s, || AdamConfig::new().init())
                }
                Opt::AdamFsdp(_) | Opt::SgdFsdp(_) => unreachable!("fsdp_train trains it"),
            }
        }
        if let Opt::AdamFsdp(config) | Opt::SgdFsdp(config) = s.opt {
            let f32 = config.param_dtype == burn_ddp::fsdp::Precision::F32;
            return match (config.reshard_after_forward, f32) {
                (true, true) => fsdp_train::<Bc>(pg, s, config),
                (false, true) => fsdp_train::<B>(pg, s, config),
                (true, false) => fsdp_train::<Bh>(pg, s, config),
                (false, false) => panic!("no FSDP scenario keeps reduced-precision parameters"),
            };
        }
        match s.net {
            conformance::Net::Mlp => with::<Mlp<B>>(pg, s),
            conformance::Net::Conv => with::<ConvNet<B>>(pg, s),
            conformance::Net::SharedGrad => with::<SharedGrad<B>>(pg, s),
            conformance::Net::Strided => with::<Strided<B>>(pg, s),
            conformance::Net::Tied => with::<Tied<B>>(pg, s),
        }
    }
}

burn_ddp_dev::conformance_suite!(Line021);

mod fsdp {
    burn_ddp_dev::fsdp_suite!(super::Line021);
}

/// An FSDP scenario on backend `Bk` (`B`, or `Bc` where the parameters are gathered again for
/// backward).
fn fsdp_train<Bk: FsdpBackend + AutodiffBackend>(
    pg: ProcessGroup,
    s: &Scenario,
    config: FsdpConfig,
) -> Trained {
    fn with<Bk: FsdpBackend + AutodiffBackend, M: Net<Bk> + AutodiffModule<Bk>>(
        pg: ProcessGroup,
        s: &Scenario,
        config: FsdpConfig,
    ) -> Trained {
        match (s.mode, s.opt) {
            (conformance::Mode::Resume(_), _) => run_fsdp_resume::<Bk, M>(pg, config),
            (_, conformance::Opt::SgdFsdp(_)) => {
                run_fsdp::<Bk, M, _>(pg, s, config, || SgdConfig::new().init())
            }
            _ => run_fsdp::<Bk, M, _>(pg, s, config, || AdamConfig::new().init()),
        }
    }
    match s.net {
        conformance::Net::Mlp => with::<Bk, Mlp<Bk>>(pg, s, config),
        conformance::Net::Conv => with::<Bk, ConvNet<Bk>>(pg, s, config),
        conformance::Net::Tied => with::<Bk, Tied<Bk>>(pg, s, config),
        other => panic!("no FSDP scenario runs {other:?}"),
    }
}

/// `record` as bytes (Burn's binary recorder), on backend `Bk`.
fn record_bytes_on<Bk: Backend, R: burn::record::Record<Bk>>(record: R) -> Vec<u8> {
    use burn::record::{BinBytesRecorder, FullPrecisionSettings, Recorder};
    Recorder::<Bk>::record(
        &BinBytesRecorder::<FullPrecisionSettings>::default(),
        record,
        (),
    )
    .unwrap()
}

/// A record from [`record_bytes_on`]'s bytes.
fn load_bytes_on<Bk: Backend, R: burn::record::Record<Bk>>(bytes: Vec<u8>) -> R {
    use burn::record::{BinBytesRecorder, FullPrecisionSettings, Recorder};
    let recorder = BinBytesRecorder::<FullPrecisionSettings>::default();
    Recorder::<Bk>::load(&recorder, bytes, &Default::default()).unwrap()
}

/// One half of an FSDP [`conformance::Mode::Resume`] scenario on this rank: the first from the
/// sharded model, writing the checkpoint (rank 0: the gathered start, the gathered model and the
/// gathered optimizer state); the second from it, at another world size, each rank cutting its
/// shards of both.
fn run_fsdp_resume<Bk, M>(pg: ProcessGroup, config: FsdpConfig) -> Trained
where
    Bk: FsdpBackend + AutodiffBackend,
    M: Net<Bk> + AutodiffModule<Bk>,
{
    let half = conformance::Half::from_env();
    let (world, rank) = (pg.world_size().as_usize(), pg.rank().index());
    let device = Default::default();
    <Bk as Backend>::seed(&device, conformance::init_seed(rank));
    let fsdp = FullyShard::new(pg, config).unwrap();
    let built = match half.first {
        true => M::build(&device),
        false => M::build(&device).load_record(load_bytes_on::<Bk, _>(half.read("model.bin"))),
    };
    let mut model = fsdp.shard::<Bk, M>(built).unwrap();
    let mut opt = AdamConfig::new().init::<Bk, M>();
    if !half.first {
        let whole = load_bytes_on::<Bk, _>(half.read("optim.bin"));
        opt = opt.load_record(fsdp.shard_optimizer_record(&model, whole).unwrap());
    } else if rank == 0 {
        let start = fsdp.full_model::<Bk, M>(&model).unwrap().into_record();
        half.write("start.bin", &record_bytes_on::<Bk, _>(start));
    } else {
        // Every rank takes part in the gather.
        let _ = fsdp.full_model::<Bk, M>(&model).unwrap();
    }
    let start = || fsdp.full_model::<Bk, M>(&model).unwrap().into_record();
    let mut alone = M::build(&device).load_record(start());
    let mut opt_alone = AdamConfig::new().init::<Bk, M>();
    let lr = conformance::LR;
    let mine = |t: &Tensor<Bk, 2>| t.clone().narrow(0, rank * PER_RANK, PER_RANK);
    for step in half.steps() {
        let (x, y) = batch_on::<Bk>(step, world);
        let loss = model.loss(mine(&x), mine(&y));
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        let grads = fsdp.sync::<Bk, M>(&model, grads).unwrap();
        model = opt.step(lr, model, grads);
        let loss = alone.loss(mine(&x), mine(&y));
        let grads = GradientsParams::from_grads(loss.backward(), &alone);
        alone = opt_alone.step(lr, alone, grads);
    }
    let whole = fsdp.full_model::<Bk, M>(&model).unwrap();
    let state = fsdp.full_optimizer_record(&model, opt.to_record()).unwrap();
    if half.first && rank == 0 {
        half.write("optim.bin", &record_bytes_on::<Bk, _>(state));
        half.write(
            "model.bin",
            &record_bytes_on::<Bk, _>(whole.clone().into_record()),
        );
    }
    // One process from the start (rank 0 wrote it before the first step's collective) through
    // every step so far, each on its step's whole batch.
    let start = load_bytes_on::<Bk, _>(half.read("start.bin"));
    let mut reference = M::build(&device).load_record(start);
    let mut opt_ref = AdamConfig::new().init::<Bk, M>();
    for step in 0..half.steps().end {
        let (x, y) = batch_on::<Bk>(step, half.world_of(step, world));
        let grads = GradientsParams::from_grads(reference.loss(x, y).backward(), &reference);
        reference = opt_ref.step(lr, reference, grads);
    }
    Trained {
        ddp: common::params(&whole),
        reference: common::params(&reference),
        alone: common::params(&alone),
    }
}

/// The whole batch of step `step` on backend `Bk`: the same on every rank, and the same as
/// [`batch`]'s (one inner backend, one seed).
fn batch_on<Bk: Backend>(step: usize, world: usize) -> (Tensor<Bk, 2>, Tensor<Bk, 2>) {
    let device = Default::default();
    let n = world * PER_RANK;
    <Bk as Backend>::seed(&device, conformance::batch_seed(step));
    let x = Tensor::<Bk, 2>::random([n, IN], Distribution::Normal(0.0, 1.0), &device);
    let y = Tensor::<Bk, 2>::random([n, OUT], Distribution::Normal(0.0, 1.0), &device);
    (x, y)
}

/// `m` with every float parameter cast to `dtype` (differentiably: the gradients reach the f32
/// parameters).
fn cast_params<Bk: Backend, M: Module<Bk>>(m: &M, dtype: burn::tensor::DType) -> M {
    struct Cast(burn::tensor::DType);
    impl<Bk: Backend> burn::module::ModuleMapper<Bk> for Cast {
        fn map_float<const D: usize>(&mut self, p: Param<Tensor<Bk, D>>) -> Param<Tensor<Bk, D>> {
            let dtype = self.0;
            p.map(|t| t.cast(dtype))
        }
    }
    m.clone().map(&mut Cast(dtype))
}

/// An FSDP scenario (`conformance::Opt::AdamFsdp`, `SgdFsdp`) on this rank: the model sharded
/// by `FullyShard`, each block gathered in the nets' forward, Burn's optimizer (`make_opt`'s)
/// stepping the shards; the reference and the negative control from the gathered start,
/// computing in the gathered precision too (their f32 parameters cast, differentiably: one
/// process under the same policy), compared with the gathered end.
fn run_fsdp<Bk, M, O>(
    pg: ProcessGroup,
    s: &Scenario,
    config: FsdpConfig,
    make_opt: impl Fn() -> O,
) -> Trained
where
    Bk: FsdpBackend + AutodiffBackend,
    M: Net<Bk> + AutodiffModule<Bk>,
    O: Optimizer<M, Bk>,
{
    let world = pg.world_size().as_usize();
    let rank = pg.rank().index();
    let device = Default::default();
    // A different init per rank: `shard` must cut rank 0's.
    <Bk as Backend>::seed(&device, conformance::init_seed(rank));
    let fsdp = FullyShard::new(pg, config).unwrap();
    let mut model = fsdp.shard::<Bk, M>(M::build(&device)).unwrap();
    let start = || fsdp.full_model::<Bk, M>(&model).unwrap().into_record();
    let mut reference = M::build(&device).load_record(start());
    let mut alone = M::build(&device).load_record(start());
    let (held, whole) = fsdp.held_values(&model);
    if world > 1 {
        assert!(held < whole, "{held} of {whole} values held");
    }
    let (mut opt, mut opt_ref, mut opt_alone) = (make_opt(), make_opt(), make_opt());
    let lr = conformance::LR;
    let policy = |m: &M| match config.param_dtype {
        burn_ddp::fsdp::Precision::F32 => m.clone(),
        burn_ddp::fsdp::Precision::Bf16 => cast_params(m, burn::tensor::DType::BF16),
        burn_ddp::fsdp::Precision::F16 => cast_params(m, burn::tensor::DType::F16),
    };
    let micros = match s.mode {
        conformance::Mode::Plain => 1,
        conformance::Mode::Accumulate(k) => k,
        other => panic!("no FSDP scenario runs {other:?}"),
    };
    let mine = |t: &Tensor<Bk, 2>| t.clone().narrow(0, rank * PER_RANK, PER_RANK);
    for step in 0..STEPS {
        let mut acc = GradientsAccumulator::<M>::new();
        let mut acc_ref = GradientsAccumulator::<M>::new();
        let mut acc_alone = GradientsAccumulator::<M>::new();
        for micro in 0..micros {
            let (x, y) = batch_on::<Bk>(step * micros + micro, world);
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
            acc.accumulate(&model, fsdp.sync::<Bk, M>(&model, grads).unwrap());
            let loss = policy(&alone).loss(mine(&x), mine(&y));
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
        ddp: common::params(&fsdp.full_model::<Bk, M>(&model).unwrap()),
        reference: common::params(&reference),
        alone: common::params(&alone),
    }
}

fn run<M: Net<B> + AutodiffModule<B>, O: Optimizer<M, B>>(
    pg: ProcessGroup,
    s: &Scenario,
    make_opt: impl Fn() -> O,
) -> Trained {
    let world = pg.world_size().as_usize();
    let rank = pg.rank().index();
    let device = Default::default();
    // Different init per rank: prepare must fix it.
    <B as Backend>::seed(&device, conformance::init_seed(rank));
    let session = new_session(pg, (s.config)()).unwrap();
    let mut model = session.prepare(M::build(&device)).unwrap();
    let mut reference = independent(M::build(&device), &model);
    assert_eq!(common::params(&model), common::params(&reference));
    // The negative control: this rank's shard alone, never synchronised.
    let mut alone = independent(M::build(&device), &model);
    let mut opt_ddp = make_opt();
    let mut opt_ref = make_opt();
    let mut opt_alone = make_opt();
    let lr = conformance::LR;
    if s.mode == conformance::Mode::Join {
        return run_join(&session, model, reference, alone, make_opt);
    }
    // ZeRO-1 and 2: the DDP model steps through the sharded optimizer.
    let mut zero = match s.opt {
        conformance::Opt::AdamZero => Some(session.zero(AdamConfig::new().init(), &model).unwrap()),
        conformance::Opt::AdamZero2 => {
            Some(session.zero2(AdamConfig::new().init(), &model).unwrap())
        }
        _ => None,
    };
    let mut step_ddp = |model: M, grads: GradientsParams| match zero.as_mut() {
        Some(zero) => {
            if zero.stage() == 2 {
                // Only the gradients of the parameters this rank owns came back with values.
                let (owned, _) = zero.owned_elements();
                let got = grad_elements(&model, &grads);
                assert!(
                    got <= owned,
                    "{got} gradient elements reached a rank owning {owned}"
                );
            }
            zero.try_step(lr, model, grads).unwrap()
        }
        None => opt_ddp.step(lr, model, grads),
    };
    for step in 0..STEPS {
        match s.mode {
            conformance::Mode::Plain => {
                let (x, y) = batch(step, world);
                let loss = model.loss(shard(x.clone(), rank), shard(y.clone(), rank));
                let grads = session.backward(loss).unwrap();
                let grads = GradientsParams::from_grads(grads, &model);
                model = step_ddp(model, grads);

                let loss = alone.loss(shard(x.clone(), rank), shard(y.clone(), rank));
                let grads = GradientsParams::from_grads(loss.backward(), &alone);
                alone = opt_alone.step(lr, alone, grads);

                let loss = reference.loss(x, y);
                let grads = GradientsParams::from_grads(loss.backward(), &reference);
                reference = opt_ref.step(lr, reference, grads);
            }
            conformance::Mode::Accumulate(micros) => {
                let mut acc = GradientsAccumulator::<M>::new();
                let mut acc_ref = GradientsAccumulator::<M>::new();
                let mut acc_alone = GradientsAccumulator::<M>::new();
                for micro in 0..micros {
                    let (x, y) = batch(step * micros + micro, world);
                    let grads = {
                        let _guard = session.no_sync();
                        let loss = model.loss(shard(x.clone(), rank), shard(y.clone(), rank));
                        session.backward(loss).unwrap()
                    };
                    acc.accumulate(&model, GradientsParams::from_grads(grads, &model));
                    let loss = alone.loss(shard(x.clone(), rank), shard(y.clone(), rank));
                    acc_alone
                        .accumulate(&alone, GradientsParams::from_grads(loss.backward(), &alone));
                    let loss = reference.loss(x, y);
                    acc_ref.accumulate(
                        &reference,
                        GradientsParams::from_grads(loss.backward(), &reference),
                    );
                }
                let grads = session.sync_gradients(&model, acc.grads()).unwrap();
                model = step_ddp(model, grads);
                reference = opt_ref.step(lr, reference, acc_ref.grads());
                alone = opt_alone.step(lr, alone, acc_alone.grads());
            }
            conformance::Mode::Join => unreachable!("run_join trains it"),
            conformance::Mode::Resume(_) => unreachable!("run_resume trains it"),
        }
    }
    Trained {
        ddp: common::params(&model),
        reference: common::params(&reference),
        alone: common::params(&alone),
    }
}

/// One half of a [`conformance::Mode::Resume`] scenario on this rank (`conformance::Half`):
/// the first from the prepared model, writing the checkpoint (rank 0: the start, the model and
/// the optimizer's whole state); the second from it, at another world size.
fn run_resume<M: Net<B> + AutodiffModule<B>>(pg: ProcessGroup, s: &Scenario) -> Trained {
    let half = conformance::Half::from_env();
    let (world, rank) = (pg.world_size().as_usize(), pg.rank().index());
    let device = Default::default();
    <B as Backend>::seed(&device, conformance::init_seed(rank));
    let session = new_session(pg, (s.config)()).unwrap();
    let built = match half.first {
        true => M::build(&device),
        false => M::build(&device).load_record(load_bytes(half.read("model.bin"))),
    };
    let mut model = session.prepare(built).unwrap();
    let mut zero = match s.opt {
        conformance::Opt::AdamZero => session.zero(AdamConfig::new().init(), &model).unwrap(),
        _ => session.zero2(AdamConfig::new().init(), &model).unwrap(),
    };
    if !half.first {
        zero = zero.load_full_record(load_bytes(half.read("optim.bin")));
    } else if rank == 0 {
        half.write("start.bin", &record_bytes(model.clone().into_record()));
    }
    let mut alone = independent(M::build(&device), &model);
    let mut opt_alone = AdamConfig::new().init();
    let lr = conformance::LR;
    for step in half.steps() {
        let (x, y) = batch(step, world);
        let loss = model.loss(shard(x.clone(), rank), shard(y.clone(), rank));
        let grads = GradientsParams::from_grads(session.backward(loss).unwrap(), &model);
        model = zero.try_step(lr, model, grads).unwrap();
        let loss = alone.loss(shard(x, rank), shard(y, rank));
        let grads = GradientsParams::from_grads(loss.backward(), &alone);
        alone = opt_alone.step(lr, alone, grads);
    }
    let whole = zero.gather_record().unwrap();
    if let (true, Some(whole)) = (half.first, whole) {
        half.write("optim.bin", &record_bytes(whole));
        half.write("model.bin", &record_bytes(model.clone().into_record()));
    }
    // One process from the start (rank 0 wrote it before the first step's collective) through
    // every step so far, each on its step's whole batch.
    let start = load_bytes(half.read("start.bin"));
    let mut reference = independent(M::build(&device), &M::build(&device).load_record(start));
    let mut opt_ref = AdamConfig::new().init();
    for step in 0..half.steps().end {
        let (x, y) = batch(step, half.world_of(step, world));
        let grads = GradientsParams::from_grads(reference.loss(x, y).backward(), &reference);
        reference = opt_ref.step(lr, reference, grads);
    }
    Trained {
        ddp: common::params(&model),
        reference: common::params(&reference),
        alone: common::params(&alone),
    }
}

/// The elements of `model`'s gradients in `grads`.
fn grad_elements<M: AutodiffModule<B>>(model: &M, grads: &GradientsParams) -> usize {
    struct Count<'a>(&'a GradientsParams, usize);
    impl burn::module::ModuleVisitor<B> for Count<'_> {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<B, D>>) {
            type Inner = <B as AutodiffBackend>::InnerBackend;
            if let Some(g) = self.0.get::<Inner, D>(p.id) {
                self.1 += g.shape().num_elements();
            }
        }
    }
    let mut count = Count(grads, 0);
    model.visit(&mut count);
    count.1
}

/// [`conformance::Mode::Join`]: each rank steps on its own batches under `DdpSession::join`.
fn run_join<M: Net<B> + AutodiffModule<B>, O: Optimizer<M, B>>(
    session: &DdpSession,
    model: M,
    mut reference: M,
    mut alone: M,
    make_opt: impl Fn() -> O,
) -> Trained {
    let world = session.group().world_size().as_usize();
    let rank = session.group().rank().index();
    let (lr, mine) = (conformance::LR, conformance::batches(world, rank));
    let mut opt = make_opt();
    let model = session
        .join(model, |session, mut model| {
            for step in 0..mine {
                let (x, y) = batch(step, world);
                let grads =
                    session.gradients(&model, model.loss(shard(x, rank), shard(y, rank)))?;
                model = opt.step(lr, model, grads);
            }
            Ok(model)
        })
        .unwrap();
    let (mut opt_ref, mut opt_alone) = (make_opt(), make_opt());
    for step in 0..STEPS {
        let (x, y) = batch(step, world);
        // The rows of the ranks that still have a batch.
        let still: Vec<usize> = (0..world)
            .filter(|&r| step < conformance::batches(world, r))
            .collect();
        let rows = |t: &Tensor<B, 2>| {
            let parts = still.iter().map(|&r| shard(t.clone(), r));
            Tensor::cat(parts.collect(), 0)
        };
        let loss = reference.loss(rows(&x), rows(&y));
        let grads = GradientsParams::from_grads(loss.backward(), &reference);
        reference = opt_ref.step(lr, reference, grads);
        if step < mine {
            let loss = alone.loss(shard(x, rank), shard(y, rank));
            let grads = GradientsParams::from_grads(loss.backward(), &alone);
            alone = opt_alone.step(lr, alone, grads);
        }
    }
    Trained {
        ddp: common::params(&model),
        reference: common::params(&reference),
        alone: common::params(&alone),
    }
}

/// `fresh` with `model`'s values, through serialised bytes: a reference that shares nothing with
/// `model` (an in-memory record carries the tensors themselves, marked for synchronisation, so
/// a reference loaded from it would be synchronised too: averaged with the other ranks' identical
/// copies, and compressed like the model).
fn independent<M: Module<B>>(fresh: M, model: &M) -> M {
    use burn::record::{BinBytesRecorder, FullPrecisionSettings, Recorder};
    let recorder = BinBytesRecorder::<FullPrecisionSettings>::default();
    let bytes = Recorder::<B>::record(&recorder, model.clone().into_record(), ()).unwrap();
    let record = Recorder::<B>::load(&recorder, bytes, &Default::default()).unwrap();
    let reference = fresh.load_record(record);
    struct Marked(bool);
    impl burn::module::ModuleVisitor<B> for Marked {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<B, D>>) {
            self.0 |= p.val().is_distributed();
        }
    }
    let mut marked = Marked(false);
    reference.visit(&mut marked);
    assert!(!marked.0, "the reference is synchronised");
    reference
}

#[test]
fn mismatched_models_fail_at_prepare_naming_the_parameter() {
    const NAME: &str = "mismatched_models_fail_at_prepare_naming_the_parameter";
    if let Some(pg) = common::child_group(NAME) {
        let device = Default::default();
        let rank = pg.rank().index();
        let session = new_session(pg, DdpConfig::default()).unwrap();
        let hidden = if rank == 1 { 17 } else { 16 };
        let model = Mlp::<B> {
            fc1: LinearConfig::new(IN, hidden).init(&device),
            fc2: LinearConfig::new(hidden, OUT).init(&device),
            unused: LinearConfig::new(IN, 5).init(&device),
            act: Relu::new(),
        };
        let err = session.prepare(model).unwrap_err();
        let text = err.to_string();
        println!("rank {rank} error: {text}");
        assert!(
            matches!(
                err,
                burn_ddp::DdpError::Model(ModelError::ModelMismatch { .. })
            ),
            "{text}"
        );
        assert!(text.contains("fc1.weight"), "{text}");
        assert!(text.contains("rank 1 has"), "{text}");
        assert!(text.contains("ranks 0, 2 have"), "{text}");
        return;
    }
    if !common::is_any_child() {
        common::TestJob::new(3, NAME).run().assert_all_ok();
    }
}

#[test]
fn an_unused_parameter_stays_untouched_and_nothing_hangs() {
    const NAME: &str = "an_unused_parameter_stays_untouched_and_nothing_hangs";
    if let Some(pg) = common::child_group(NAME) {
        let device = Default::default();
        let session = new_session(pg, DdpConfig::default()).unwrap();
        let model = session.prepare(Mlp::<B>::new(&device)).unwrap();
        let before = model.unused.weight.val().into_data();
        let (x, y) = batch(0, 2);
        let grads = session.backward(model.loss(x, y)).unwrap();
        let grads = GradientsParams::from_grads(grads, &model);
        assert!(grads
            .get::<<B as AutodiffBackend>::InnerBackend, 2>(model.unused.weight.id)
            .is_none());
        let mut opt = SgdConfig::new().init();
        let model = opt.step(0.1, model, grads);
        assert_eq!(model.unused.weight.val().into_data(), before);
        return;
    }
    if !common::is_any_child() {
        common::TestJob::new(2, NAME).run().assert_all_ok();
    }
}

/// A side branch that only some ranks' batches take (issue: replicas must not drift apart).
#[derive(Module, Debug)]
struct Branchy<B: Backend> {
    main: Linear<B>,
    side: Linear<B>,
}

impl<B: Backend> Branchy<B> {
    fn new(device: &B::Device) -> Self {
        Self {
            main: LinearConfig::new(IN, OUT).init(device),
            side: LinearConfig::new(IN, OUT).init(device),
        }
    }

    /// The loss of one rank's shard; `side`: whether that rank's batch takes the branch.
    fn loss(&self, x: Tensor<B, 2>, y: Tensor<B, 2>, side: bool) -> Tensor<B, 1> {
        let mut out = self.main.forward(x.clone());
        if side {
            out = out + self.side.forward(x).tanh();
        }
        (out - y).powi_scalar(2).mean()
    }
}

/// `side_ranks` take the branch. DDP: each rank's loss on its shard, gradients through
/// `DdpSession::gradients`. Reference, in one process: the mean over ranks of the same per-shard
/// losses (the global batch's loss when each shard's loss is a mean), Adam for both.
fn train_branchy(pg: ProcessGroup, config: DdpConfig, side_ranks: &[usize]) {
    let world = pg.world_size().as_usize();
    let rank = pg.rank().index();
    let device = Default::default();
    <B as Backend>::seed(&device, 7 + rank as u64);
    let session = new_session(pg, config).unwrap();
    let mut model = session.prepare(Branchy::<B>::new(&device)).unwrap();
    let mut reference = independent(Branchy::<B>::new(&device), &model);
    let mut opt_ddp = AdamConfig::new().init();
    let mut opt_ref = AdamConfig::new().init();
    let lr = 0.05;
    for step in 0..STEPS {
        let (x, y) = batch(step, world);
        let mine = side_ranks.contains(&rank);
        let loss = model.loss(shard(x.clone(), rank), shard(y.clone(), rank), mine);
        let grads = session.gradients(&model, loss).unwrap();
        assert!(
            session.unsynced_params().is_empty(),
            "{:?}",
            session.unsynced_params()
        );
        model = opt_ddp.step(lr, model, grads);

        let losses: Vec<Tensor<B, 1>> = (0..world)
            .map(|r| {
                let side = side_ranks.contains(&r);
                reference.loss(shard(x.clone(), r), shard(y.clone(), r), side)
            })
            .collect();
        let loss = Tensor::cat(losses, 0).mean();
        // The reference's parameters came from the prepared model's record, marks included:
        // keep the session out of its backward.
        let grads = {
            let _local = session.no_sync();
            GradientsParams::from_grads(loss.backward(), &reference)
        };
        reference = opt_ref.step(lr, reference, grads);
    }
    let got = common::params(&model);
    assert_close(rank, &got, &common::params(&reference), F32);
    // Every rank bit-identical to rank 0.
    let mine: Vec<u8> = got.iter().flat_map(|v| v.to_le_bytes()).collect();
    let first = session
        .group()
        .broadcast_bytes(mine.clone(), burn_ddp::Rank(0))
        .unwrap();
    assert!(
        first == mine,
        "rank {rank}'s parameters differ from rank 0's"
    );
    let _ = session.group().barrier();
}

macro_rules! branch_equivalence {
    ($($name:ident: $world:literal, $side:expr, $config:expr;)*) => {$(
        #[test]
        fn $name() {
            let name = stringify!($name);
            if let Some(pg) = common::child_group(name) {
                train_branchy(pg, $config, &$side);
                return;
            }
            if !common::is_any_child() && common::world_selected($world) {
                common::TestJob::new($world, name)
                    .function(name)
                    .run()
                    .assert_all_ok();
            }
        }
    )*};
}

branch_equivalence! {
    branch_on_rank_0_only_overlapped: 2, [0], DdpConfig::default();
    branch_on_rank_0_only_after_backward: 2, [0], DdpConfig::default().with_overlap(false);
    branch_on_ranks_1_and_2_of_3_overlapped: 3, [1, 2], DdpConfig::default();
    branch_on_ranks_1_and_2_of_3_after_backward: 3, [1, 2], DdpConfig::default().with_overlap(false);
}

#[test]
fn foreign_gradients_left_out_of_the_optimizer_fail_the_next_step() {
    const NAME: &str = "foreign_gradients_left_out_of_the_optimizer_fail_the_next_step";
    if let Some(pg) = common::child_group(NAME) {
        let device = Default::default();
        let rank = pg.rank().index();
        let session = new_session(pg, DdpConfig::default()).unwrap();
        let model = session.prepare(Branchy::<B>::new(&device)).unwrap();
        let (x, y) = batch(0, 2);
        // Rank 0 takes the branch, rank 1 does not; the plain `backward` + `from_grads` leaves
        // rank 1 without the branch's average, and its optimizer steps without it.
        let loss = model.loss(shard(x.clone(), rank), shard(y.clone(), rank), rank == 0);
        let grads = GradientsParams::from_grads(session.backward(loss).unwrap(), &model);
        let model = SgdConfig::new().init().step(0.1, model, grads);
        if rank == 1 {
            assert_eq!(
                session.unsynced_params(),
                vec!["side.weight".to_owned(), "side.bias".to_owned()]
            );
        }
        let loss = model.loss(shard(x, rank), shard(y, rank), rank == 0);
        let next = session.backward(loss);
        if rank == 1 {
            let Err(e) = next else {
                panic!("rank 1's next backward succeeded after it dropped foreign gradients")
            };
            let e = e.to_string();
            println!("rank 1 error: {e}");
            assert!(e.contains("side.weight"), "{e}");
            assert!(e.contains("DdpSession::complete"), "{e}");
        }
        return;
    }
    if !common::is_any_child() && common::world_selected(2) {
        common::TestJob::new(2, NAME).run().assert_all_ok();
    }
}

#[test]
fn diverged_replicas_fail_naming_the_parameter() {
    const NAME: &str = "diverged_replicas_fail_naming_the_parameter";
    if let Some(pg) = common::child_group(NAME) {
        let device = Default::default();
        let rank = pg.rank().index();
        let config = DdpConfig::default().with_replica_check(2);
        let session = new_session(pg, config).unwrap();
        let mut model = session.prepare(Branchy::<B>::new(&device)).unwrap();
        let mut opt = SgdConfig::new().init();
        for step in 0..4 {
            let (x, y) = batch(step, 2);
            let loss = model.loss(shard(x, rank), shard(y, rank), true);
            let grads = session.gradients(&model, loss);
            match step {
                // The replicas agree: the check of step 2 passes.
                0 | 1 => model = opt.step(0.1, model, grads.unwrap()),
                // Rank 1 changes one weight by itself (as a rank-local update would).
                2 => {
                    model = opt.step(0.1, model, grads.unwrap());
                    if rank == 1 {
                        model.side.bias = model.side.bias.map(|p| p.map(|b| b.add_scalar(1e-3)));
                    }
                }
                // The check of step 4 names it on every rank.
                _ => {
                    let Err(e) = grads else {
                        panic!("rank {rank}: diverged replicas went unnoticed")
                    };
                    let text = e.to_string();
                    println!("rank {rank} error: {text}");
                    assert!(
                        matches!(
                            e,
                            burn_ddp::DdpError::Model(ModelError::ReplicasDiverged { step: 4, .. })
                        ),
                        "{text}"
                    );
                    assert!(text.contains("`side.bias`"), "{text}");
                    assert!(text.contains("rank 0 has digest"), "{text}");
                    assert!(text.contains("rank 1 has digest"), "{text}");
                }
            }
        }
        return;
    }
    if !common::is_any_child() && common::world_selected(2) {
        common::TestJob::new(2, NAME).run().assert_all_ok();
    }
}

/// A model with BatchNorm: its running statistics are updated by each rank from its own batch.
#[derive(Module, Debug)]
struct Normed<B: Backend> {
    fc: Linear<B>,
    norm: burn::nn::BatchNorm<B>,
}

#[test]
fn per_rank_buffers_do_not_trip_the_replica_check() {
    const NAME: &str = "per_rank_buffers_do_not_trip_the_replica_check";
    if let Some(pg) = common::child_group(NAME) {
        let device = Default::default();
        let rank = pg.rank().index();
        let session = new_session(pg, DdpConfig::default().with_replica_check(1)).unwrap();
        let mut model = session
            .prepare(Normed::<B> {
                fc: LinearConfig::new(IN, OUT).init(&device),
                norm: burn::nn::BatchNormConfig::new(OUT).init(&device),
            })
            .unwrap();
        let mut opt = SgdConfig::new().init();
        for step in 0..4 {
            let (x, y) = batch(step, 2);
            let out = model.norm.forward(model.fc.forward(shard(x, rank)));
            let loss = (out - shard(y, rank)).powi_scalar(2).mean();
            let grads = session.gradients(&model, loss).unwrap();
            model = opt.step(0.1, model, grads);
        }
        // The running mean differs between ranks (each saw its own shard); the check only
        // compares what gradient synchronisation keeps equal.
        let mean: Vec<u8> = model
            .norm
            .running_mean
            .value()
            .into_data()
            .as_bytes()
            .to_vec();
        let first = session
            .group()
            .broadcast_bytes(mean.clone(), burn_ddp::Rank(0))
            .unwrap();
        assert!(
            rank == 0 || first != mean,
            "the test needs buffers that differ"
        );
        session.check_replicas(&model).unwrap();
        return;
    }
    if !common::is_any_child() && common::world_selected(2) {
        common::TestJob::new(2, NAME).run().assert_all_ok();
    }
}

/// 20 steps of the BatchNorm model with `sync_buffers` before each forward (PyTorch's
/// `broadcast_buffers=True`): every rank ends with rank 0's running statistics, bit for bit, and
/// the same parameters; rank 0's statistics moved (the test is not vacuous). With the switch
/// off, `sync_buffers` leaves each rank its own.
fn train_normed(pg: ProcessGroup, broadcast: bool) {
    let device = Default::default();
    let rank = pg.rank().index();
    <B as Backend>::seed(&device, 23 + rank as u64);
    let config = DdpConfig::default().with_broadcast_buffers(broadcast);
    let session = new_session(pg, config).unwrap();
    let initial = burn::nn::BatchNormConfig::new(OUT).init::<B>(&device);
    let initial_mean = initial.running_mean.value().into_data();
    let mut model = session
        .prepare(Normed::<B> {
            fc: LinearConfig::new(IN, OUT).init(&device),
            norm: initial,
        })
        .unwrap();
    let mut opt = SgdConfig::new().init();
    for step in 0..20 {
        model = session.sync_buffers(model).unwrap();
        let (x, y) = batch(step, 2);
        let out = model.norm.forward(model.fc.forward(shard(x, rank)));
        let loss = (out - shard(y, rank)).powi_scalar(2).mean();
        let grads = session.gradients(&model, loss).unwrap();
        model = opt.step(0.1, model, grads);
    }
    model = session.sync_buffers(model).unwrap();
    session.check_replicas(&model).unwrap();
    let mean = model.norm.running_mean.value_sync().into_data();
    let var = model.norm.running_var.value_sync().into_data();
    assert_ne!(mean, initial_mean, "the running mean never moved");
    let mine: Vec<u8> = [mean.as_bytes(), var.as_bytes()].concat();
    let first = session
        .group()
        .broadcast_bytes(mine.clone(), burn_ddp::Rank(0))
        .unwrap();
    if broadcast {
        assert_eq!(first, mine, "rank {rank}'s buffers differ from rank 0's");
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
    if let Some(pg) = common::child_group(NAME) {
        train_normed(pg, true);
        return;
    }
    if !common::is_any_child() && common::world_selected(2) {
        common::TestJob::new(2, NAME).run().assert_all_ok();
    }
}

#[test]
fn without_broadcast_buffers_each_rank_keeps_its_own() {
    const NAME: &str = "without_broadcast_buffers_each_rank_keeps_its_own";
    if let Some(pg) = common::child_group(NAME) {
        train_normed(pg, false);
        return;
    }
    if !common::is_any_child() && common::world_selected(2) {
        common::TestJob::new(2, NAME).run().assert_all_ok();
    }
}

/// Uneven inputs under `DdpSession::join`, each step's backward under `no_sync` and its
/// gradients synchronised after it (`sync_gradients`; the conformance suite's `Join` scenarios
/// take the overlapped path): rank r has `counts[r]` batches. What it is documented to match:
/// one process with Adam that, at each step, trains on the shards of the ranks that still have
/// a batch (the mean over those ranks), for as many steps as the longest rank. Every rank ends
/// with that model (the longest rank's, loaded at the end of the join), and the model returned
/// is synchronised again.
fn uneven(pg: ProcessGroup, counts: &[usize]) {
    let world = pg.world_size().as_usize();
    let rank = pg.rank().index();
    let device = Default::default();
    <B as Backend>::seed(&device, 13 + rank as u64);
    let session = new_session(pg, DdpConfig::default()).unwrap();
    let model = session.prepare(Mlp::<B>::new(&device)).unwrap();
    let mut reference = independent(Mlp::<B>::new(&device), &model);
    let mut opt = AdamConfig::new().init();
    let trained = session
        .join(model, |session, mut model| {
            for step in 0..counts[rank] {
                let (x, y) = batch(step, world);
                let loss = model.loss(shard(x, rank), shard(y, rank));
                let grads = {
                    let _local = session.no_sync();
                    session.backward(loss)?
                };
                let grads = GradientsParams::from_grads(grads, &model);
                let grads = session.sync_gradients(&model, grads)?;
                model = opt.step(1e-2, model, grads);
            }
            Ok(model)
        })
        .unwrap();

    let mut opt = AdamConfig::new().init();
    let longest = counts.iter().copied().max().unwrap();
    for step in 0..longest {
        let (x, y) = batch(step, world);
        let still: Vec<usize> = (0..world).filter(|&r| step < counts[r]).collect();
        let xs = still.iter().map(|&r| shard(x.clone(), r)).collect();
        let ys = still.iter().map(|&r| shard(y.clone(), r)).collect();
        let loss = reference.loss(Tensor::cat(xs, 0), Tensor::cat(ys, 0));
        let grads = GradientsParams::from_grads(loss.backward(), &reference);
        reference = opt.step(1e-2, reference, grads);
    }
    let got = common::params(&trained);
    assert_close(rank, &got, &common::params(&reference), F32);
    let mine: Vec<u8> = got.iter().flat_map(|v| v.to_le_bytes()).collect();
    let all = session.group().all_gather_bytes(&mine).unwrap();
    assert!(
        all.iter().all(|b| *b == mine),
        "rank {rank}: the ranks' models differ"
    );
    // The returned model is synchronised again: a plain step after the join still averages.
    let (x, y) = batch(99, world);
    let grads = session
        .gradients(&trained, trained.loss(shard(x, rank), shard(y, rank)))
        .unwrap();
    let trained = AdamConfig::new().init().step(1e-2, trained, grads);
    session.check_replicas(&trained).unwrap();
}

#[test]
fn uneven_inputs_synced_after_backward_under_join_train_like_one_process() {
    const NAME: &str = "uneven_inputs_synced_after_backward_under_join_train_like_one_process";
    if let Some(pg) = common::child_group(NAME) {
        uneven(pg, &[4, 6]);
        return;
    }
    if !common::is_any_child() && common::world_selected(2) {
        common::TestJob::new(2, NAME).run().assert_all_ok();
    }
}

/// A BatchNorm model with `sync_buffers` before every forward, rank 0 running out first: the
/// buffers come from the lowest rank still training, and every rank ends with the same
/// parameters and buffers.
#[test]
fn uneven_inputs_with_buffers_end_with_one_model_when_rank_0_runs_out_first() {
    const NAME: &str = "uneven_inputs_with_buffers_end_with_one_model_when_rank_0_runs_out_first";
    if let Some(pg) = common::child_group(NAME) {
        let rank = pg.rank().index();
        let counts = [3, 8, 5];
        let device = Default::default();
        let session = new_session(pg, DdpConfig::default()).unwrap();
        let model = session
            .prepare(Normed::<B> {
                fc: LinearConfig::new(IN, OUT).init(&device),
                norm: burn::nn::BatchNormConfig::new(OUT).init(&device),
            })
            .unwrap();
        let mut opt = SgdConfig::new().init();
        let model = session
            .join(model, |session, mut model| {
                for step in 0..counts[rank] {
                    model = session.sync_buffers(model)?;
                    let (x, y) = batch(step, 3);
                    let out = model.norm.forward(model.fc.forward(shard(x, rank)));
                    let loss = (out - shard(y, rank)).powi_scalar(2).mean();
                    let grads = session.gradients(&model, loss)?;
                    model = opt.step(0.1, model, grads);
                }
                Ok(model)
            })
            .unwrap();
        let mean = model.norm.running_mean.value_sync().into_data();
        let mine: Vec<u8> = common::params(&model)
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .chain(mean.as_bytes().iter().copied())
            .collect();
        let all = session.group().all_gather_bytes(&mine).unwrap();
        assert!(
            all.iter().all(|b| *b == mine),
            "rank {rank}: the ranks' models or buffers differ"
        );
        return;
    }
    if !common::is_any_child() && common::world_selected(3) {
        common::TestJob::new(3, NAME).run().assert_all_ok();
    }
}

/// Without `join`, 10 batches on rank 0 and 7 on rank 1: rank 1 finishes and leaves, and rank
/// 0's next backward fails naming rank 1 and pointing to `join` (no hang).
#[test]
fn uneven_inputs_without_join_fail_naming_the_rank_that_ran_out() {
    const NAME: &str = "uneven_inputs_without_join_fail_naming_the_rank_that_ran_out";
    if let Some(pg) = common::child_group(NAME) {
        let rank = pg.rank().index();
        let device = Default::default();
        let session = new_session(pg, DdpConfig::default()).unwrap();
        let mut model = session.prepare(Mlp::<B>::new(&device)).unwrap();
        let mut opt = SgdConfig::new().init();
        for step in 0..[10, 7][rank] {
            let (x, y) = batch(step, 2);
            let loss = model.loss(shard(x, rank), shard(y, rank));
            match session.gradients(&model, loss) {
                Ok(grads) => model = opt.step(0.1, model, grads),
                Err(e) => {
                    let text = e.to_string();
                    println!("rank {rank} at step {step}: {text}");
                    assert_eq!((rank, step), (0, 7), "{text}");
                    assert!(
                        matches!(e, burn_ddp::DdpError::Collective(CollectiveError::PeerFinished { peer, .. }) if peer.index() == 1),
                        "{text}"
                    );
                    assert!(text.contains("DdpSession::join"), "{text}");
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
    if !common::is_any_child() && common::world_selected(2) {
        common::TestJob::new(2, NAME).run().assert_all_ok();
    }
}

/// Inside a join, a step whose gradients skip `complete` (so the mean over the ranks still
/// training is never applied) is an error at the next backward, on every rank.
#[test]
fn a_join_step_without_complete_is_an_error_at_the_next_backward() {
    const NAME: &str = "a_join_step_without_complete_is_an_error_at_the_next_backward";
    if let Some(pg) = common::child_group(NAME) {
        let rank = pg.rank().index();
        let device = Default::default();
        let session = new_session(pg, DdpConfig::default()).unwrap();
        let model = session.prepare(Mlp::<B>::new(&device)).unwrap();
        let mut opt = SgdConfig::new().init();
        let err = session
            .join(model, |session, mut model| {
                for step in 0..3 {
                    let (x, y) = batch(step, 2);
                    let grads = session.backward(model.loss(shard(x, rank), shard(y, rank)))?;
                    let grads = GradientsParams::from_grads(grads, &model);
                    model = opt.step(0.1, model, grads);
                }
                Ok(model)
            })
            .unwrap_err();
        let text = err.to_string();
        assert!(
            text.contains("did not go through DdpSession::complete"),
            "{text}"
        );
        return;
    }
    if !common::is_any_child() && common::world_selected(2) {
        common::TestJob::new(2, NAME).run().assert_all_ok();
    }
}

/// Seven linear layers of equal size but one: enough parameters for the optimizer state to
/// split evenly over the ranks.
#[derive(Module, Debug)]
struct Tower<B: Backend> {
    layers: Vec<Linear<B>>,
    head: Linear<B>,
}

impl<B: Backend> Tower<B> {
    fn new(device: &B::Device) -> Self {
        Self {
            layers: (0..6)
                .map(|_| LinearConfig::new(IN, IN).init(device))
                .collect(),
            head: LinearConfig::new(IN, OUT).init(device),
        }
    }

    fn loss(&self, x: Tensor<B, 2>, y: Tensor<B, 2>) -> Tensor<B, 1> {
        let h = self.layers.iter().fold(x, |h, l| l.forward(h).tanh());
        (self.head.forward(h) - y).powi_scalar(2).mean()
    }
}

fn record_bytes<R: burn::record::Record<B>>(record: R) -> Vec<u8> {
    use burn::record::{BinBytesRecorder, FullPrecisionSettings, Recorder};
    Recorder::<B>::record(
        &BinBytesRecorder::<FullPrecisionSettings>::default(),
        record,
        (),
    )
    .unwrap()
}

fn load_bytes<R: burn::record::Record<B>>(bytes: Vec<u8>) -> R {
    use burn::record::{BinBytesRecorder, FullPrecisionSettings, Recorder};
    Recorder::<B>::load(
        &BinBytesRecorder::<FullPrecisionSettings>::default(),
        bytes,
        &Default::default(),
    )
    .unwrap()
}

/// Steps `from..to` of one process with Adam on the whole batch of `world` ranks.
fn reference_adam(
    mut model: Tower<B>,
    opt: &mut impl Optimizer<Tower<B>, B>,
    steps: std::ops::Range<usize>,
    world: usize,
) -> Tower<B> {
    for step in steps {
        let (x, y) = batch(step, world);
        let grads = GradientsParams::from_grads(model.loss(x, y).backward(), &model);
        model = opt.step(1e-2, model, grads);
    }
    model
}

/// ZeRO-1 with Adam: 20 steps equal one process with Adam on the whole batch (which plain DDP
/// with Adam equals, `mlp_adam`), and each rank keeps about 1/N of the optimizer state
/// (measured against a plain Adam's state of the same model, printed).
fn zero_trains(pg: ProcessGroup) {
    let world = pg.world_size().as_usize();
    let rank = pg.rank().index();
    let device = Default::default();
    // Seeded, as every equivalence test here: the same numbers on every run, so a failure
    // reproduces (unseeded, one draw in CI was 4.2e-5 off on a parameter of 0.049).
    <B as Backend>::seed(&device, 7 + rank as u64);
    let session = new_session(pg, DdpConfig::default()).unwrap();
    let mut model = session.prepare(Tower::<B>::new(&device)).unwrap();
    let reference = independent(Tower::<B>::new(&device), &model);
    // The negative control: this rank's shard alone, never synchronised.
    let mut alone = independent(Tower::<B>::new(&device), &model);
    let mut opt_alone = AdamConfig::new().init();
    let mut zero = session.zero(AdamConfig::new().init(), &model).unwrap();
    for step in 0..STEPS {
        let (x, y) = batch(step, world);
        let (x, y) = (shard(x, rank), shard(y, rank));
        let grads =
            GradientsParams::from_grads(alone.loss(x.clone(), y.clone()).backward(), &alone);
        alone = opt_alone.step(1e-2, alone, grads);
        let grads = session.gradients(&model, model.loss(x, y)).unwrap();
        model = zero.try_step(1e-2, model, grads).unwrap();
    }
    let mut plain = AdamConfig::new().init();
    let reference = reference_adam(reference, &mut plain, 0..STEPS, world);
    if world > 1 {
        common::compare::assert_discriminates(
            rank,
            &common::params(&alone),
            &common::params(&reference),
            F32,
        );
    }
    assert_close(
        rank,
        &common::params(&model),
        &common::params(&reference),
        F32,
    );
    session.check_replicas(&model).unwrap();

    let mine = record_bytes(zero.to_record()).len();
    let full = record_bytes(plain.to_record()).len();
    let (owned, total) = zero.owned_elements();
    println!(
        "zero w{world} rank {rank}: optimizer state {mine} bytes, plain Adam {full} bytes \
         ({:.3} of it; owns {owned} of {total} parameter elements)",
        mine as f64 / full as f64
    );
    assert!(
        (mine as f64) < full as f64 / world as f64 * 1.25,
        "rank {rank} keeps {mine} of {full} bytes of optimizer state at world size {world}"
    );
    // The shards together are the whole state: rank 0 gathers one entry per parameter.
    if let Some(whole) = zero.gather_record().unwrap() {
        assert_eq!(whole.len(), plain.to_record().len());
    }
}

#[test]
fn zero_adam_trains_like_one_process_and_keeps_a_shard_of_the_state() {
    for world in [2, 3] {
        let name = format!("zero_w{world}");
        if let Some(pg) = common::child_group(&name) {
            zero_trains(pg);
            return;
        }
        if !common::is_any_child() && common::world_selected(world) {
            let out = common::TestJob::new(world as u32, &name)
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
/// Adam through both halves (the first on 2 ranks' batches, the second on 3 ranks').
fn zero_half(pg: ProcessGroup, dir: &std::path::Path) {
    let world = pg.world_size().as_usize();
    let rank = pg.rank().index();
    let device = Default::default();
    let session = new_session(pg, DdpConfig::default()).unwrap();
    let first = world == 2;
    <B as Backend>::seed(&device, 11 + rank as u64);
    let built = Tower::<B>::new(&device);
    let built = if first {
        built
    } else {
        built.load_record(load_bytes(std::fs::read(dir.join("model.bin")).unwrap()))
    };
    let mut model = session.prepare(built).unwrap();
    let var = if first {
        "ZERO_FIRST_STAGE"
    } else {
        "ZERO_SECOND_STAGE"
    };
    let mut zero = match std::env::var(var).unwrap().as_str() {
        "1" => session.zero(AdamConfig::new().init(), &model).unwrap(),
        _ => session.zero2(AdamConfig::new().init(), &model).unwrap(),
    };
    if first {
        if rank == 0 {
            std::fs::write(
                dir.join("start.bin"),
                record_bytes(model.clone().into_record()),
            )
            .unwrap();
        }
    } else {
        let whole = load_bytes(std::fs::read(dir.join("optim.bin")).unwrap());
        zero = zero.load_full_record(whole);
    }
    let steps = if first { 0..10 } else { 10..20 };
    for step in steps {
        let (x, y) = batch(step, world);
        let grads = session
            .gradients(&model, model.loss(shard(x, rank), shard(y, rank)))
            .unwrap();
        model = zero.try_step(1e-2, model, grads).unwrap();
    }
    let whole = zero.gather_record().unwrap();
    if first {
        if let Some(whole) = whole {
            std::fs::write(dir.join("optim.bin"), record_bytes(whole)).unwrap();
            std::fs::write(dir.join("model.bin"), record_bytes(model.into_record())).unwrap();
        }
        return;
    }
    let start = Tower::<B>::new(&device)
        .load_record(load_bytes(std::fs::read(dir.join("start.bin")).unwrap()));
    let mut opt = AdamConfig::new().init();
    let reference = reference_adam(start, &mut opt, 0..10, 2);
    let reference = reference_adam(reference, &mut opt, 10..20, 3);
    assert_close(
        rank,
        &common::params(&model),
        &common::params(&reference),
        F32,
    );
}

#[test]
fn zero_resumes_from_a_checkpoint_written_at_another_world_size() {
    const NAME: &str = "zero_resumes_from_a_checkpoint_written_at_another_world_size";
    if let Some(pg) = common::child_group(NAME) {
        let dir = std::path::PathBuf::from(std::env::var("ZERO_CHECKPOINT_DIR").unwrap());
        zero_half(pg, &dir);
        return;
    }
    if common::is_any_child() || !common::world_selected(3) {
        return;
    }
    let dir = std::env::temp_dir().join(format!("burn-ddp-zero-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    // Stage 1 throughout, stage 2 throughout, and a stage-1 checkpoint resumed in stage 2.
    for (first, second) in [(1, 1), (2, 2), (1, 2)] {
        for world in [2, 3] {
            common::TestJob::new(world, NAME)
                .env("ZERO_CHECKPOINT_DIR", dir.display())
                .env("ZERO_FIRST_STAGE", first)
                .env("ZERO_SECOND_STAGE", second)
                .run()
                .assert_all_ok();
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// ZeRO stage 2 reduce-scatters its buckets: what reduces whole buckets on every rank (a
/// communication hook, PowerSGD) is refused, saying what to change.
#[test]
fn zero2_refuses_what_reduces_whole_buckets() {
    let device = Default::default();
    let hook = DdpConfig::default().with_comm_hook(|| {
        Box::new(burn_ddp::grad::AllReduce {
            reduction: burn_ddp::GradReduction::Mean,
            compression: burn_ddp::Compression::None,
        })
    });
    let cases: [(DdpConfig, &str); 2] = [
        (
            DdpConfig::default().with_power_sgd(burn_ddp::PowerSgd::new(2)),
            "drop PowerSGD, or use ZeRO stage 1",
        ),
        (hook, "drop the hook, or use ZeRO stage 1"),
    ];
    for (config, fix) in cases {
        let session = new_session(ProcessGroup::single(), config).unwrap();
        let model = session.prepare(Tower::<B>::new(&device)).unwrap();
        let err = session
            .zero2(AdamConfig::new().init(), &model)
            .unwrap_err()
            .to_string();
        assert!(err.contains(fix), "{err}");
    }
}

/// A linear layer, a SyncBatchNorm, a linear head: the head's gradients are final (and their
/// buckets in flight) before backward reaches the normalization's all-reduces.
#[derive(Module, Debug)]
struct SyncNormed<B: Backend> {
    fc: Linear<B>,
    norm: burn_ddp::nn::SyncBatchNorm<B>,
    head: Linear<B>,
}

/// [`SyncNormed`] with Burn's BatchNorm: the single-process reference (the same record).
#[derive(Module, Debug)]
struct Normed3<B: Backend> {
    fc: Linear<B>,
    norm: burn::nn::BatchNorm<B>,
    head: Linear<B>,
}

/// `n` rows of inputs and targets for step `step`: the same on every rank.
fn rows(step: usize, n: usize) -> (Tensor<B, 2>, Tensor<B, 2>) {
    let device = Default::default();
    <B as Backend>::seed(&device, 5000 + step as u64);
    let x = Tensor::<B, 2>::random([n, IN], Distribution::Normal(0.0, 1.0), &device);
    let y = Tensor::<B, 2>::random([n, 4 * OUT], Distribution::Normal(0.5, 1.0), &device);
    (x, y)
}

/// The normalized output: `[n, 4·OUT]` as `[n, OUT]` (1-D BatchNorm) or `[n, OUT, 2, 2]`
/// (2-D), flattened back.
fn normed_out<N>(
    fc: &Linear<B>,
    head: &Linear<B>,
    x: Tensor<B, 2>,
    spatial: bool,
    norm: N,
) -> Tensor<B, 2>
where
    N: Fn(Tensor<B, 4>) -> Tensor<B, 4>,
{
    let n = x.dims()[0];
    let h = fc.forward(x); // [n, 4·OUT]
    let h = if spatial {
        norm(h.reshape([n, OUT, 2, 2])).reshape([n, 4 * OUT])
    } else {
        // [n, 4·OUT] with 4·OUT channels, through the 4-D closure as [n, 4·OUT, 1, 1].
        norm(h.reshape([n, 4 * OUT, 1, 1])).reshape([n, 4 * OUT])
    };
    head.forward(h.tanh())
}

/// SyncBatchNorm on ranks with `sizes[r]` rows each must equal one process with Burn's
/// BatchNorm on all the rows: the forward output and the synchronised gradients of the first
/// step, then the parameters and running statistics after 20 SGD steps (1e-5 relative). The
/// loss of rank r is its squared error summed over its rows, scaled so that the mean over the
/// ranks is the global batch's mean.
fn sync_norm(pg: ProcessGroup, sizes: &[usize], spatial: bool, config: DdpConfig) {
    let world = pg.world_size().as_usize();
    let rank = pg.rank().index();
    let device = Default::default();
    <B as Backend>::seed(&device, 17 + rank as u64);
    let channels = if spatial { OUT } else { 4 * OUT };
    let session = new_session(pg, config).unwrap();
    let mut model = session
        .prepare(SyncNormed::<B> {
            fc: LinearConfig::new(IN, 4 * OUT).init(&device),
            norm: burn_ddp::nn::SyncBatchNormConfig::new(channels).init(&device),
            head: LinearConfig::new(4 * OUT, 4 * OUT).init(&device),
        })
        .unwrap();
    // The reference: Burn's BatchNorm, from SyncBatchNorm's record (the records are the same).
    let mut reference = Normed3::<B> {
        fc: LinearConfig::new(IN, 4 * OUT).init(&device),
        norm: burn::nn::BatchNormConfig::new(channels).init(&device),
        head: LinearConfig::new(4 * OUT, 4 * OUT).init(&device),
    }
    .load_record(load_bytes(record_bytes(model.clone().into_record())));
    let total: usize = sizes.iter().sum();
    let start: usize = sizes[..rank].iter().sum();
    let mine = sizes[rank];
    let elements = (total * 4 * OUT) as f64;
    let mut opt = SgdConfig::new().init();
    let mut opt_ref = SgdConfig::new().init();
    for step in 0..STEPS {
        let (x, y) = rows(step, total);
        let out = normed_out(
            &model.fc,
            &model.head,
            x.clone().narrow(0, start, mine),
            spatial,
            |h| model.norm.forward(h),
        );
        let loss = (out.clone() - y.clone().narrow(0, start, mine))
            .powi_scalar(2)
            .sum()
            .mul_scalar(world as f64 / elements);
        let grads = session.gradients(&model, loss).unwrap();

        let out_ref = normed_out(&reference.fc, &reference.head, x, spatial, |h| {
            reference.norm.forward(h)
        });
        let loss_ref = (out_ref.clone() - y).powi_scalar(2).mean();
        let grads_ref = GradientsParams::from_grads(loss_ref.backward(), &reference);
        if step == 0 {
            let got: Vec<f32> = out.into_data().to_vec().unwrap();
            let want: Vec<f32> = out_ref.narrow(0, start, mine).into_data().to_vec().unwrap();
            assert_close(rank, &got, &want, F32);
            let grad = |g: &GradientsParams, id| -> Vec<f32> {
                g.get::<<B as AutodiffBackend>::InnerBackend, 2>(id)
                    .unwrap()
                    .into_data()
                    .to_vec()
                    .unwrap()
            };
            assert_close(
                rank,
                &grad(&grads, model.fc.weight.id),
                &grad(&grads_ref, reference.fc.weight.id),
                F32,
            );
        }
        model = opt.step(0.1, model, grads);
        reference = opt_ref.step(0.1, reference, grads_ref);
    }
    assert_close(
        rank,
        &common::params(&model),
        &common::params(&reference),
        F32,
    );
    let stats = |m: Vec<Tensor<B, 1>>| -> Vec<f32> {
        m.into_iter()
            .flat_map(|t| t.into_data().to_vec::<f32>().unwrap())
            .collect()
    };
    assert_close(
        rank,
        &stats(vec![
            model.norm.running_mean.value_sync(),
            model.norm.running_var.value_sync(),
        ]),
        &stats(vec![
            reference.norm.running_mean.value_sync(),
            reference.norm.running_var.value_sync(),
        ]),
        F32,
    );
}

#[test]
fn sync_batch_norm_trains_like_one_process_with_batch_norm_on_the_global_batch() {
    let small = DdpConfig {
        bucket_cap_bytes: 64,
        first_bucket_cap_bytes: 16,
        ..DdpConfig::default()
    };
    for (name, sizes, spatial, config) in [
        ("sync_bn_1d_w2", &[4, 4][..], false, DdpConfig::default()),
        ("sync_bn_2d_w2", &[4, 4][..], true, DdpConfig::default()),
        // Different batch sizes, and small buckets in flight during backward.
        ("sync_bn_2d_uneven_w3", &[3, 6, 4][..], true, small),
    ] {
        let world = sizes.len();
        if let Some(pg) = common::child_group(name) {
            sync_norm(pg, sizes, spatial, config);
            return;
        }
        if !common::is_any_child() && common::world_selected(world) {
            common::TestJob::new(world as u32, name)
                .function(
                    "sync_batch_norm_trains_like_one_process_with_batch_norm_on_the_global_batch",
                )
                .run()
                .assert_all_ok();
        }
    }
}

/// PowerSGD (rank 2, from the third step), overlapped or after backward: every rank ends with
/// the same parameters (the approximation is the same everywhere), the loss ends within 1 % of
/// uncompressed training's, and fewer elements travel than uncompressed.
fn power_sgd(pg: ProcessGroup, after_backward: bool) {
    let world = pg.world_size().as_usize();
    let rank = pg.rank().index();
    let device = Default::default();
    <B as Backend>::seed(&device, 19 + rank as u64);
    let config = DdpConfig {
        bucket_cap_bytes: 256,
        first_bucket_cap_bytes: 256,
        ..DdpConfig::default()
    }
    .with_power_sgd(burn_ddp::PowerSgd::new(2).with_start_step(2));
    let session = new_session(pg, config).unwrap();
    let mut model = session.prepare(Tower::<B>::new(&device)).unwrap();
    let mut reference = independent(Tower::<B>::new(&device), &model);
    let mut opt = SgdConfig::new().init();
    let mut opt_ref = SgdConfig::new().init();
    let (x0, y0) = batch(0, world);
    let first = reference.loss(x0.clone(), y0.clone()).into_scalar();
    for step in 0..STEPS {
        let (x, y) = batch(step, world);
        let loss = model.loss(shard(x.clone(), rank), shard(y.clone(), rank));
        let grads = if after_backward {
            let grads = {
                let _local = session.no_sync();
                session.backward(loss).unwrap()
            };
            let grads = GradientsParams::from_grads(grads, &model);
            session.sync_gradients(&model, grads).unwrap()
        } else {
            session.gradients(&model, loss).unwrap()
        };
        model = opt.step(0.2, model, grads);
        let grads = GradientsParams::from_grads(reference.loss(x, y).backward(), &reference);
        reference = opt_ref.step(0.2, reference, grads);
    }
    session.check_replicas(&model).unwrap();
    let compressed = model.loss(x0.clone(), y0.clone()).into_scalar();
    let uncompressed = reference.loss(x0, y0).into_scalar();
    let (sent, dense, steps) = session.power_sgd_totals().unwrap();
    println!(
        "powersgd rank {rank}: loss {first} -> {compressed} (uncompressed {uncompressed}); \
         {sent} of {dense} elements sent over {steps} steps"
    );
    assert!(
        (compressed - uncompressed).abs() <= 0.01 * uncompressed,
        "PowerSGD training: loss {first} -> {compressed}, uncompressed -> {uncompressed}"
    );
    assert_eq!(steps, STEPS as u64);
    assert!(sent < dense, "{sent} elements sent of {dense}");
}

#[test]
fn power_sgd_keeps_the_replicas_equal_and_sends_less() {
    for (name, after) in [
        ("power_sgd_w2", false),
        ("power_sgd_after_backward_w2", true),
    ] {
        if let Some(pg) = common::child_group(name) {
            power_sgd(pg, after);
            return;
        }
        if !common::is_any_child() && common::world_selected(2) {
            let out = common::TestJob::new(2, name)
                .function("power_sgd_keeps_the_replicas_equal_and_sends_less")
                .run();
            println!("{}", out.report());
            out.assert_all_ok();
        }
    }
}

/// Under `gradient_as_bucket_view`, a backward whose all-reduce fails (rank 1 has left) still
/// leaves every gradient in its shape (zeros), so a loop that steps before checking does not
/// crash in the optimizer; the failure is what `check` returns, naming rank 1.
#[test]
fn a_failed_sync_with_bucket_view_leaves_gradients_of_the_right_shape() {
    const NAME: &str = "a_failed_sync_with_bucket_view_leaves_gradients_of_the_right_shape";
    if let Some(pg) = common::child_group(NAME) {
        let rank = pg.rank().index();
        let device = Default::default();
        let config = DdpConfig::default().with_gradient_as_bucket_view(true);
        let session = new_session(pg, config).unwrap();
        let model = session.prepare(Mlp::<B>::new(&device)).unwrap();
        if rank == 1 {
            return; // leaves the job
        }
        let (x, y) = batch(0, 2);
        let grads = model.loss(shard(x, rank), shard(y, rank)).backward();
        let grads = GradientsParams::from_grads(grads, &model);
        let shape = grads
            .get::<<B as AutodiffBackend>::InnerBackend, 2>(model.fc1.weight.id)
            .unwrap()
            .dims();
        assert_eq!(shape, [IN, 16]);
        let _ = SgdConfig::new().init().step(0.1, model, grads);
        let err = session.check().unwrap_err().to_string();
        assert!(err.contains("rank 1"), "{err}");
        return;
    }
    if !common::is_any_child() && common::world_selected(2) {
        common::TestJob::new(2, NAME).run().assert_all_ok();
    }
}
