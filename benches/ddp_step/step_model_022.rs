//! The `Mlp` of `burn-ddp-step-model`, on Burn 0.22.1 (`burn022`), trained with burn-ddp-gradsync's
//! `GradSync`: the other side of the `lines` comparison. Same shapes, same batch, same
//! optimizer, same timing as `time_steps`.

use std::time::Instant;

// `#[derive(Module)]` names `burn::...`: in this module, that is Burn 0.22.1 (feature `lines`)
// or Burn 0.23.0-pre.1 (`lines-023`), whichever burn-ddp-gradsync is built for.
#[cfg(not(feature = "lines-023"))]
use burn022 as burn;
#[cfg(feature = "lines-023")]
use burn023 as burn;

/// The release this side runs, as the tables name it.
#[cfg(not(feature = "lines-023"))]
pub const RELEASE: &str = "Burn 0.22.1, Flex + `GradSync`";
#[cfg(feature = "lines-023")]
pub const RELEASE: &str = "Burn 0.23.0-pre.1, Flex + `GradSync`";

use burn::module::Module;
use burn::nn::{Linear, LinearConfig, Relu};
use burn::optim::{GradientsParams, SgdConfig};
use burn::tensor::{Device, Distribution, Tensor};
use burn_ddp::ProcessGroup;
use burn_ddp_gradsync::{DdpConfig, GradSync};

#[derive(Module, Debug)]
struct Mlp {
    fc1: Linear,
    fc2: Linear,
    fc3: Linear,
    act: Relu,
}

impl Mlp {
    fn new(device: &Device) -> Self {
        Self {
            fc1: LinearConfig::new(784, 512).init(device),
            fc2: LinearConfig::new(512, 256).init(device),
            fc3: LinearConfig::new(256, 10).init(device),
            act: Relu::new(),
        }
    }

    fn loss(&self, x: Tensor<2>, y: Tensor<2>) -> Tensor<1> {
        let h = self.act.forward(self.fc1.forward(x));
        let h = self.act.forward(self.fc2.forward(h));
        (self.fc3.forward(h) - y).powi_scalar(2).mean()
    }
}

/// How a step of the 0.22 side synchronises.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sync022 {
    /// Not at all (the model is prepared all the same).
    Local,
    /// `GradSync::sync` after backward (`DdpConfig::overlap` off).
    After,
    /// `GradSync::overlapped` for the forward, the buckets reduced during backward.
    Overlapped,
}

/// `warmup + steps` SGD steps of the MLP on Burn 0.22's Flex backend, synchronised as `how`
/// says; the wall time of each timed step, in seconds.
pub fn time_steps_022(
    pg: &ProcessGroup,
    how: Sync022,
    batch: usize,
    warmup: usize,
    steps: usize,
) -> Vec<f64> {
    let device = Device::default().autodiff();
    device.seed(7);
    let config = DdpConfig::default().with_overlap(how == Sync022::Overlapped);
    let mut grad_sync = GradSync::new(pg.clone(), config).expect("GradSync");
    let mut model = grad_sync.prepare(Mlp::new(&device)).expect("prepare");
    let x = Tensor::<2>::random([batch, 784], Distribution::Normal(0.0, 1.0), &device);
    let y = Tensor::<2>::random([batch, 10], Distribution::Normal(0.0, 1.0), &device);
    let mut optim = SgdConfig::new().init();
    let mut times = Vec::with_capacity(steps);
    for i in 0..warmup + steps {
        let start = Instant::now();
        let loss = match how {
            Sync022::Overlapped => {
                let overlapped = grad_sync.overlapped(&model).expect("overlapped");
                overlapped.loss(x.clone(), y.clone())
            }
            _ => model.loss(x.clone(), y.clone()),
        };
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        let grads = match how {
            Sync022::Local => grads,
            _ => grad_sync.sync(&model, grads).expect("sync"),
        };
        model = optim.step(1e-3, model, grads);
        device.sync().expect("device sync");
        if i >= warmup {
            times.push(start.elapsed().as_secs_f64());
        }
    }
    times
}

/// The `memory` model on Burn 0.22.1: 16 linear layers of 1024 × 1024 (67 MB of f32
/// parameters).
#[derive(Module, Debug)]
struct Wide {
    layers: Vec<Linear>,
}

impl Wide {
    fn new(device: &Device) -> Self {
        Self {
            layers: (0..16)
                .map(|_| LinearConfig::new(1024, 1024).init(device))
                .collect(),
        }
    }

    /// The loss of a step on a fresh batch of 8 rows.
    fn loss(&self, device: &Device) -> Tensor<1> {
        let x = Tensor::<2>::random([8, 1024], Distribution::Default, device);
        self.layers
            .iter()
            .fold(x, |h, l| {
                burn_ddp_gradsync::fsdp::gather(l).forward(h).tanh()
            })
            .mean()
    }
}

/// Trains `Wide` for 3 SGD steps on Flex, with `GradSync` after backward when `sync`, and
/// returns this process's peak resident memory in MiB (`VmHWM`), as the 0.21 line's
/// `memory_run`.
pub fn memory_run_022(pg: &ProcessGroup, sync: bool) -> anyhow::Result<f64> {
    let device = Device::default().autodiff();
    let mut grad_sync = GradSync::new(pg.clone(), DdpConfig::default())?;
    let mut model = grad_sync.prepare(Wide::new(&device))?;
    let mut optim = SgdConfig::new().init();
    for _ in 0..3 {
        let loss = model.loss(&device);
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        let grads = if sync {
            grad_sync.sync(&model, grads)?
        } else {
            grads
        };
        model = optim.step(1e-3, model, grads);
    }
    crate::peak_mib()
}

/// The `zero` table's run on Burn 0.22.1 (Flex), as the 0.21 line's `zero_run`: `Wide` trained
/// with Adam for `ZERO_STEPS` overlapped steps, as DDP (`stage` 0), ZeRO-1 or ZeRO-2.
pub(crate) fn zero_run_022(pg: &ProcessGroup, stage: u8) -> anyhow::Result<crate::ZeroRun> {
    use burn::module::{ModuleVisitor, Param};
    use burn::optim::AdamConfig;
    if stage == 3 {
        return fsdp_run_022(pg);
    }
    struct Count<'a>(&'a GradientsParams, usize);
    impl ModuleVisitor for Count<'_> {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
            if let Some(g) = self.0.get::<D>(p.id) {
                self.1 += 4 * g.shape().num_elements();
            }
        }
    }
    let device = Device::default().autodiff();
    let mut grad_sync = GradSync::new(pg.clone(), DdpConfig::default())?;
    let mut model = grad_sync.prepare(Wide::new(&device))?;
    let mut plain = AdamConfig::new().init();
    let mut zero = match stage {
        0 => None,
        1 => Some(grad_sync.zero(AdamConfig::new().init(), &model)?),
        _ => Some(grad_sync.zero2(AdamConfig::new().init(), &model)?),
    };
    let (mut grad_bytes, mut step_s) = (0, Vec::new());
    for step in 0..crate::ZERO_STEPS {
        let start = Instant::now();
        let loss = grad_sync.overlapped(&model)?.loss(&device);
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        let grads = grad_sync.sync(&model, grads)?;
        let mut count = Count(&grads, 0);
        model.visit(&mut count);
        grad_bytes = count.1;
        model = match zero.as_mut() {
            Some(zero) => zero.step(1e-3, model, grads)?,
            None => plain.step(1e-3, model, grads),
        };
        device.sync()?;
        if step > 0 {
            step_s.push(start.elapsed().as_secs_f64());
        }
    }
    let record = match zero.as_ref() {
        Some(zero) => zero.to_record(),
        None => plain.to_record(),
    };
    let state_bytes = record
        .into_bytes()
        .map_err(|e| anyhow::anyhow!("{e:?}"))?
        .len();
    Ok(crate::ZeroRun {
        param_bytes: 4 * model.num_params(),
        grad_bytes,
        state_bytes,
        step_s,
    })
}

/// The `zero` table's FSDP run on Burn 0.22.1/0.23 (Flex): `Wide` sharded by `FullyShard` on a
/// gradient-checkpointing device (parameters gathered again for backward), trained with Burn's
/// Adam on the shards for `ZERO_STEPS` steps.
fn fsdp_run_022(pg: &ProcessGroup) -> anyhow::Result<crate::ZeroRun> {
    use burn::module::{ModuleVisitor, Param};
    use burn::optim::AdamConfig;
    use burn_ddp_gradsync::{FsdpConfig, FullyShard};
    struct Count<'a>(&'a GradientsParams, usize);
    impl ModuleVisitor for Count<'_> {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
            if let Some(g) = self.0.get::<D>(p.id) {
                self.1 += 4 * g.shape().num_elements();
            }
        }
    }
    let device = Device::default().autodiff().gradient_checkpointing();
    let fsdp = FullyShard::new(pg.clone(), FsdpConfig::default())?;
    let mut model = fsdp.shard(Wide::new(&device))?;
    let mut optim = AdamConfig::new().init();
    let (mut grad_bytes, mut step_s) = (0, Vec::new());
    for step in 0..crate::ZERO_STEPS {
        let start = Instant::now();
        let grads = GradientsParams::from_grads(model.loss(&device).backward(), &model);
        let grads = fsdp.sync(&model, grads)?;
        let mut count = Count(&grads, 0);
        model.visit(&mut count);
        grad_bytes = count.1;
        model = optim.step(1e-3, model, grads);
        device.sync()?;
        if step > 0 {
            step_s.push(start.elapsed().as_secs_f64());
        }
    }
    let state_bytes = optim
        .to_record()
        .into_bytes()
        .map_err(|e| anyhow::anyhow!("{e:?}"))?
        .len();
    Ok(crate::ZeroRun {
        param_bytes: 4 * fsdp.held_values(&model).0,
        grad_bytes,
        state_bytes,
        step_s,
    })
}
