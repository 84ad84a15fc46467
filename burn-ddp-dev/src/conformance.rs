//! The conformance suite every Burn line runs: data-parallel training on W processes, each with
//! a batch of [`PER_RANK`] rows, must train exactly like one process on the whole batch of
//! `W·PER_RANK` rows. After [`STEPS`] optimizer steps every parameter matches the single
//! process's within the scenario's tolerance, every rank's model is bit-identical to the
//! others', and a model trained on this rank's rows alone, never synchronised, is beyond the
//! tolerance (the negative control). Real processes, real TCP, real Burn training.
//!
//! The scenarios ([`scenarios`]: nets, optimizers, accumulation, bucket sizes, compression, a
//! communication hook, gradients as bucket views) and the checks are here, once. A line
//! implements [`Line`] in its test binary (the nets of [`Net`] in its release's API, one
//! training run of a scenario) and writes `burn_ddp_dev::conformance_suite!(MyLine);`, which
//! makes one `#[test]` per scenario, by the scenario's name.

use burn_ddp_comm::grad::{FsdpConfig, Precision};
use burn_ddp_comm::{Compression, DdpConfig, GradReduction, ProcessGroup};

use crate::compare::{assert_close, assert_discriminates, assert_replicas_equal, f32_bytes};
use crate::compare::{Tolerance, F32};
use crate::hooks::MeanBySum;
use crate::procs;

/// Optimizer steps per run.
pub const STEPS: usize = 20;
/// Rows of each rank's batch.
pub const PER_RANK: usize = 4;
/// Input features.
pub const IN: usize = 8;
/// Output features.
pub const OUT: usize = 3;
/// The learning rate.
pub const LR: f64 = 0.05;

/// The seed of this rank's initial weights (different per rank: `prepare` must make them equal).
pub fn init_seed(rank: usize) -> u64 {
    7 + rank as u64
}

/// The seed of the whole batch of (micro-)step `step`, the same on every rank: `PER_RANK ·
/// world` rows of [`IN`] normal inputs, then as many rows of [`OUT`] normal targets.
pub fn batch_seed(step: usize) -> u64 {
    1000 + step as u64
}

/// The models a scenario trains, each written by the line in its release's API (the loss is
/// the mean squared error of the output against the targets).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Net {
    /// `fc2(relu(fc1(x)))`, `IN → 16 → OUT`, with a third linear layer `unused` (`IN → 5`)
    /// that the forward never touches: it gets no gradient on any rank.
    Mlp,
    /// The input reshaped to `[n, 1, 4, 2]`, repeated to `[n, 1, 4, 4]`, a 3×3 convolution to 4
    /// channels, relu, then a linear layer `16 → OUT`.
    Conv,
    /// `x · fc.weight + (tanh(fc.bias) + shift)` (`fc: IN → OUT`, `shift` a `[1, OUT]`
    /// parameter): Burn's autodiff hands one gradient buffer to both branches of the sum, so
    /// `shift`'s gradient (alone in the first bucket, see the scenarios) is memory that
    /// `tanh`'s backward still reads.
    SharedGrad,
    /// `out(tanh(x · weightᵀ))` (`weight` a `[16, IN]` parameter, `out: 16 → OUT`): the weight's
    /// gradient is a strided view, not one contiguous span.
    Strided,
    /// `out(tanh(fc(tanh(fc(x)))))` (`fc: IN → IN`, `out: IN → OUT`): `fc`'s weight and bias are
    /// used twice in the forward, so each one's gradient is the sum of two contributions, and
    /// only the sum may be reduced (an overlapped line must not send the first one).
    Tied,
}

/// The optimizer of every model of a run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Opt {
    /// SGD, Burn's defaults.
    Sgd,
    /// Adam, Burn's defaults.
    Adam,
    /// ZeRO-1: the DDP model steps with Adam through the line's sharded optimizer (each rank
    /// keeps the state of the parameters it owns); the reference and the negative control
    /// with plain Adam.
    AdamZero,
    /// ZeRO-2: as [`AdamZero`](Self::AdamZero), with the gradient buckets reduce-scattered so
    /// that each rank receives only the reduced gradients of the parameters it owns (the
    /// line's stage-2 call); the line also checks that no other gradient reaches its
    /// optimizer.
    AdamZero2,
    /// FSDP: every parameter sharded on its first dimension (the line's `FullyShard`), each
    /// block gathered in the forward, the DDP model stepped by Burn's Adam on its shards, and
    /// compared through its gathered whole; the reference and the negative control with plain
    /// Adam. These scenarios are [`fsdp_scenarios`], a suite of their own
    /// ([`fsdp_suite!`](crate::fsdp_suite)).
    AdamFsdp(FsdpConfig),
    /// FSDP as [`AdamFsdp`](Self::AdamFsdp), stepped by SGD (Burn's defaults): an update
    /// linear in the gradient, so that a reduced precision's rounding stays as small as it is
    /// (Adam's normalised update carries the rounding of a gradient near zero to a full step).
    SgdFsdp(FsdpConfig),
}

/// How each optimizer step's gradients are made.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// One batch per step ([`batch_seed`] of the step), synchronised once.
    Plain,
    /// `k` batches per step ([`batch_seed`] of `step · k + micro`), accumulated on each rank
    /// without synchronisation, then synchronised once.
    Accumulate(usize),
    /// Uneven inputs under the line's `join`: rank `r` has [`batches`]`(world, r)` batches,
    /// one step each; the reference is one process that, at each step, trains on the shards
    /// of the ranks that still have a batch (the mean over those ranks), for as many steps as
    /// the longest rank, and every rank ends with its model. The negative control trains on
    /// this rank's batches alone.
    Join,
    /// ZeRO (stage 1 or 2, as the optimizer says) or FSDP only, one batch per step: the first
    /// half of the steps at each world size of the scenario's, then a checkpoint (the model's
    /// record, and the optimizer's whole state gathered: ZeRO's `gather_record`, FSDP's
    /// `full_optimizer_record`), and the rest at this many ranks, resumed from it (ZeRO's
    /// `load_full_record`, FSDP's `shard_optimizer_record`). Each half is a job of its
    /// own ([`Half`]), checked as any scenario: the reference is one process from the first
    /// half's start through every step so far (each step's whole batch: the first half's world
    /// size, then the second's), the negative control this rank's rows alone from the half's
    /// start with a fresh optimizer.
    Resume(u32),
}

/// Which half of a [`Mode::Resume`] scenario this process's job runs, and where the checkpoint
/// between them is: what the suite's runner tells the line's ranks (in their environment).
#[derive(Clone, Debug)]
pub struct Half {
    /// The first half (from the start, writing the checkpoint); else the second (from it).
    pub first: bool,
    /// The first half's world size.
    pub from_world: usize,
    /// The folder the halves share.
    pub dir: std::path::PathBuf,
}

/// The environment variable holding a [`Half`] (`first:W` or `second:W`, `W` the first half's
/// world size), and the one holding its folder.
const HALF_VAR: &str = "BURN_DDP_CONFORMANCE_HALF";
const DIR_VAR: &str = "BURN_DDP_CONFORMANCE_DIR";

impl Half {
    /// The half the runner gave this rank.
    ///
    /// # Panics
    /// Outside a [`Mode::Resume`] scenario's job.
    pub fn from_env() -> Self {
        let half = std::env::var(HALF_VAR).expect("a Resume scenario's job names its half");
        let (which, world) = half.split_once(':').expect("first:W or second:W");
        Self {
            first: which == "first",
            from_world: world.parse().expect("the first half's world size"),
            dir: std::env::var(DIR_VAR)
                .expect("a Resume scenario's job names its folder")
                .into(),
        }
    }

    /// The steps this half trains.
    pub fn steps(&self) -> std::ops::Range<usize> {
        if self.first {
            0..STEPS / 2
        } else {
            STEPS / 2..STEPS
        }
    }

    /// The world size whose whole batch step `step` trains on (`now`: this job's).
    pub fn world_of(&self, step: usize, now: usize) -> usize {
        if step < STEPS / 2 {
            self.from_world
        } else {
            now
        }
    }

    /// The file `name` in the shared folder.
    pub fn path(&self, name: &str) -> std::path::PathBuf {
        self.dir.join(name)
    }

    /// Writes `bytes` as `name` (rank 0 does).
    ///
    /// # Panics
    /// The folder cannot be written.
    pub fn write(&self, name: &str, bytes: &[u8]) {
        std::fs::write(self.path(name), bytes).expect("writing the checkpoint");
    }

    /// Reads `name`.
    ///
    /// # Panics
    /// The file is not there.
    pub fn read(&self, name: &str) -> Vec<u8> {
        std::fs::read(self.path(name)).expect("reading the checkpoint")
    }
}

/// How many batches rank `rank` of `world` has in a [`Mode::Join`] scenario: [`STEPS`] for the
/// last rank, fewer for the others (with 3 ranks, rank 1 runs out first, then rank 0).
pub fn batches(world: usize, rank: usize) -> usize {
    STEPS - 3 * ((rank + 1) % world)
}

/// One scenario of the suite.
#[derive(Clone, Copy, Debug)]
pub struct Scenario {
    /// The test's name.
    pub name: &'static str,
    /// The model.
    pub net: Net,
    /// The optimizer.
    pub opt: Opt,
    /// Plain or accumulated.
    pub mode: Mode,
    /// The synchronisation's configuration.
    pub config: fn() -> DdpConfig,
    /// The tolerance, where the scenario needs a looser one than f32's on the test binary's
    /// backend ([`Line::F32`]; the looser of the two applies).
    pub tolerance: Option<Tolerance>,
    /// The world sizes it runs at. At world size 1 a job has nothing to synchronise (a cheap
    /// smoke test), except on the GPU's zero-copy path, which synchronises through NCCL.
    pub worlds: &'static [u32],
}

fn default() -> DdpConfig {
    DdpConfig::default()
}

fn small_buckets() -> DdpConfig {
    DdpConfig {
        bucket_cap_bytes: 64,
        first_bucket_cap_bytes: 16,
        ..DdpConfig::default()
    }
}

/// `shift` (the last parameter) alone in the first bucket.
fn shift_alone() -> DdpConfig {
    DdpConfig {
        first_bucket_cap_bytes: 4 * OUT,
        ..DdpConfig::default()
    }
}

/// The weight in a bucket of its own, `out`'s bias alone in the first.
fn weight_alone() -> DdpConfig {
    DdpConfig {
        bucket_cap_bytes: 4 * 16 * IN,
        first_bucket_cap_bytes: 4 * OUT,
        ..DdpConfig::default()
    }
}

/// The scenarios, in the order of their tests.
pub fn scenarios() -> Vec<Scenario> {
    use Mode::{Accumulate, Join, Plain, Resume};
    use Net::{Conv, Mlp, SharedGrad, Strided, Tied};
    use Opt::{Adam, AdamZero, AdamZero2, Sgd};
    let s = |name, net, opt, mode, config: fn() -> DdpConfig, worlds| Scenario {
        name,
        net,
        opt,
        mode,
        config,
        tolerance: None,
        worlds,
    };
    vec![
        s("mlp_sgd", Mlp, Sgd, Plain, default, &[1, 2, 3]),
        s("mlp_adam", Mlp, Adam, Plain, default, &[1, 2, 3]),
        s("conv_sgd", Conv, Sgd, Plain, default, &[1, 2, 3]),
        // After backward (the 0.21 line's `overlap` off; the only way on the 0.22 line).
        s(
            "conv_adam_after_backward",
            Conv,
            Adam,
            Plain,
            || default().with_overlap(false),
            &[1, 2],
        ),
        s("mlp_small_buckets", Mlp, Sgd, Plain, small_buckets, &[1, 3]),
        s(
            "mlp_accumulate_4",
            Mlp,
            Sgd,
            Accumulate(4),
            default,
            &[1, 2, 3],
        ),
        s(
            "mlp_adam_accumulate_2",
            Mlp,
            Adam,
            Accumulate(2),
            default,
            &[2, 3],
        ),
        s(
            "shared_gradient_buffer",
            SharedGrad,
            Sgd,
            Plain,
            shift_alone,
            &[1, 2],
        ),
        s(
            "strided_gradient_view",
            Strided,
            Adam,
            Plain,
            weight_alone,
            &[1, 2],
        ),
        // bf16 buckets keep 8 bits of mantissa: each averaged gradient is off by up to 2^-8
        // relative, and the errors of 20 steps add up; stated tolerance 2e-2 relative to
        // max(|w|, 0.1) (parameters here are of order 0.1-0.5).
        Scenario {
            tolerance: Some(Tolerance {
                rel: 2e-2,
                floor: 0.1,
            }),
            ..s(
                "mlp_bf16_compression",
                Mlp,
                Sgd,
                Plain,
                || default().with_compression(Compression::Bf16),
                &[1, 2],
            )
        },
        // A user's communication hook (PyTorch's `register_comm_hook`) that averages by a sum
        // and a scale of its own while the configuration says `Sum`: trained like one process
        // on the mean only if the hook reduced every bucket.
        s(
            "mlp_sgd_comm_hook",
            Mlp,
            Sgd,
            Plain,
            || {
                default()
                    .with_reduction(GradReduction::Sum)
                    .with_comm_hook(MeanBySum::boxed)
            },
            &[2, 3],
        ),
        // Gradients released into their buckets (`gradient_as_bucket_view`; what the 0.22 line
        // always does): one bucket, then buckets of one gradient and of several, and a gradient
        // whose buffer Burn shares with another branch of the graph.
        s(
            "mlp_adam_bucket_view",
            Mlp,
            Adam,
            Plain,
            || default().with_gradient_as_bucket_view(true),
            &[2, 3],
        ),
        s(
            "mlp_small_buckets_bucket_view",
            Mlp,
            Sgd,
            Plain,
            || small_buckets().with_gradient_as_bucket_view(true),
            &[3],
        ),
        s(
            "shared_gradient_buffer_bucket_view",
            SharedGrad,
            Sgd,
            Plain,
            || shift_alone().with_gradient_as_bucket_view(true),
            &[2],
        ),
        s("mlp_adam_join", Mlp, Adam, Join, default, &[2, 3]),
        s(
            "conv_sgd_join_small_buckets",
            Conv,
            Sgd,
            Join,
            small_buckets,
            &[3],
        ),
        s("mlp_adam_zero", Mlp, AdamZero, Plain, default, &[2, 3]),
        // Buckets in memory the host's ranks share, reduced where they lie (in shared memory,
        // the default transport of these jobs; heap buckets over TCP): one bucket, many with a
        // join's shadow passes, and buckets of one gradient released into them.
        s(
            "mlp_adam_shared_buckets",
            Mlp,
            Adam,
            Plain,
            || default().with_shared_buckets(true),
            &[2, 3],
        ),
        s(
            "conv_sgd_join_shared_small_buckets",
            Conv,
            Sgd,
            Join,
            || small_buckets().with_shared_buckets(true),
            &[3],
        ),
        s(
            "mlp_small_shared_buckets_bucket_view",
            Mlp,
            Sgd,
            Plain,
            || {
                small_buckets()
                    .with_gradient_as_bucket_view(true)
                    .with_shared_buckets(true)
            },
            &[2],
        ),
        s(
            "conv_adam_zero_accumulate_2",
            Conv,
            AdamZero,
            Accumulate(2),
            default,
            &[3],
        ),
        // A layer applied twice, overlapped (the default): the first contribution to its
        // gradients comes early in backward, the second late; in small buckets, so the
        // buckets after it are sent while it is still incomplete.
        s(
            "tied_adam_small_buckets",
            Tied,
            Adam,
            Plain,
            small_buckets,
            &[2, 3],
        ),
        s(
            "tied_sgd_accumulate_2",
            Tied,
            Sgd,
            Accumulate(2),
            default,
            &[2],
        ),
        // ZeRO-2: buckets reduce-scattered to the parameters' owners. Whole parameters are
        // owned (balanced by size), so the shards are uneven (the MLP: 128 + 16 + 48 + 3 + 40
        // + 5 elements) and every bucket is padded to its largest block; the MLP's unused
        // layer has no gradient anywhere; in small buckets some ranks own nothing of a bucket.
        s("mlp_adam_zero2", Mlp, AdamZero2, Plain, default, &[1, 2, 3]),
        s(
            "mlp_adam_zero2_after_backward",
            Mlp,
            AdamZero2,
            Plain,
            || default().with_overlap(false),
            &[2],
        ),
        s(
            "conv_adam_zero2_accumulate_2",
            Conv,
            AdamZero2,
            Accumulate(2),
            default,
            &[2, 3],
        ),
        s(
            "tied_adam_zero2_small_buckets",
            Tied,
            AdamZero2,
            Plain,
            small_buckets,
            &[2, 3],
        ),
        // ZeRO resumed at another world size from a checkpoint (the optimizer's whole state,
        // keyed so that any world size loads it): stage 2 grown from 2 ranks to 3, and a
        // stage-1 run in small buckets shrunk from 3 ranks to 2 (the owners, the shards and
        // the buckets' blocks all change between the halves).
        s(
            "mlp_adam_zero2_resume_3",
            Mlp,
            AdamZero2,
            Resume(3),
            default,
            &[2],
        ),
        s(
            "tied_adam_zero_resume_2_small_buckets",
            Tied,
            AdamZero,
            Resume(2),
            small_buckets,
            &[3],
        ),
    ]
}

/// The FSDP scenarios ([`Opt::AdamFsdp`], [`Opt::SgdFsdp`]): Adam on shards, uneven shards
/// (the MLP's first weight has 8 rows and its output bias 3, so neither 2 nor 3 ranks cut them
/// evenly), the parameters gathered again for backward (`reshard_after_forward`, the default)
/// and kept, accumulation, a layer used twice, resumed at another world size, and mixed
/// precision (bf16 parameters and reductions) under SGD. Mixed precision under Adam is no
/// scenario: on these small nets, bf16 reductions whose ranks' parts nearly cancel round
/// differently from run to run (the transport's order of summation varies), and Adam's
/// normalised update carries such a rounding to a full step (two runs differed by more than
/// 0.1).
pub fn fsdp_scenarios() -> Vec<Scenario> {
    use Mode::{Accumulate, Plain, Resume};
    use Net::{Conv, Mlp, Tied};
    let s = |name, net, config: FsdpConfig, mode, worlds| Scenario {
        name,
        net,
        opt: Opt::AdamFsdp(config),
        mode,
        config: default,
        tolerance: None,
        worlds,
    };
    let keep = FsdpConfig::default().with_reshard_after_forward(false);
    vec![
        s(
            "fsdp_mlp_adam",
            Mlp,
            FsdpConfig::default(),
            Plain,
            &[1, 2, 3],
        ),
        s("fsdp_mlp_adam_no_reshard", Mlp, keep, Plain, &[2, 3]),
        s(
            "fsdp_conv_adam_accumulate_2",
            Conv,
            FsdpConfig::default(),
            Accumulate(2),
            &[2, 3],
        ),
        s(
            "fsdp_tied_adam",
            Tied,
            FsdpConfig::default(),
            Plain,
            &[2, 3],
        ),
        s("fsdp_tied_adam_no_reshard", Tied, keep, Plain, &[3]),
        // Resumed at another world size from a checkpoint of the gathered model and the
        // gathered optimizer state: grown from 2 ranks to 3, and shrunk from 3 to 2 (every
        // shard and its padding change between the halves).
        s(
            "fsdp_mlp_adam_resume_3",
            Mlp,
            FsdpConfig::default(),
            Resume(3),
            &[2],
        ),
        s(
            "fsdp_tied_adam_resume_2_no_reshard",
            Tied,
            keep,
            Resume(2),
            &[3],
        ),
        Scenario {
            // bf16 parameters (the forward and backward computed in bf16, by the reference
            // too) and bf16 reductions: SGD's update keeps bf16's rounding (2^-8 relative) as
            // it is; as `mlp_bf16_compression`, 2e-2 relative to max(|w|, 0.1).
            opt: Opt::SgdFsdp(
                FsdpConfig::default()
                    .with_param_dtype(Precision::Bf16)
                    .with_reduce_dtype(Precision::Bf16),
            ),
            tolerance: Some(Tolerance {
                rel: 2e-2,
                floor: 0.1,
            }),
            ..s(
                "fsdp_mlp_sgd_bf16",
                Mlp,
                FsdpConfig::default(),
                Plain,
                &[2, 3],
            )
        },
    ]
}

/// The parameters of the three models of one run on one rank, each flattened in visit order.
#[derive(Debug, Clone)]
pub struct Trained {
    /// The data-parallel model, trained on this rank's rows with synchronisation.
    pub ddp: Vec<f32>,
    /// The single-process reference, trained in this process on every rank's rows, from the
    /// weights that `prepare` gave the data-parallel model.
    pub reference: Vec<f32>,
    /// The negative control: this rank's rows alone, never synchronised, from the same weights.
    pub alone: Vec<f32>,
}

/// What a Burn line gives the suite.
pub trait Line {
    /// f32's tolerance on the test binary's backend ([`F32`], or
    /// [`F32_GPU`](crate::compare::F32_GPU) on a GPU).
    const F32: Tolerance = F32;

    /// Trains `scenario` on this rank of `pg`: the three models of [`Trained`], from this
    /// rank's [`init_seed`], for [`STEPS`] steps at [`LR`], on the batches of [`batch_seed`].
    fn train(pg: ProcessGroup, scenario: &Scenario) -> Trained;
}

/// The test `name` of the suite for line `L`: as the parent, runs it as a job of each of its
/// world sizes (the ones selected); as one of those jobs' ranks, trains and checks.
///
/// # Panics
/// A scenario that fails its checks; a name that is no scenario's.
pub fn run<L: Line>(name: &str) {
    let scenario = scenarios()
        .into_iter()
        .chain(fsdp_scenarios())
        .find(|s| s.name == name)
        .unwrap_or_else(|| panic!("no conformance scenario is called {name}"));
    for &world in scenario.worlds {
        let job = format!("{name}_w{world}");
        // A Resume scenario's second half: a job of its own, at another world size.
        let second = match scenario.mode {
            Mode::Resume(to) => Some((format!("{job}_to{to}"), to)),
            _ => None,
        };
        let child = procs::child_group(&job).or_else(|| {
            let (job, _) = second.as_ref()?;
            procs::child_group(job)
        });
        if let Some(pg) = child {
            // CI runs the suite once more with TCP forced (the default on one host is shared
            // memory): the job must use what was asked for.
            if let Ok(asked) = std::env::var("BURN_DDP_TRANSPORT") {
                if pg.world_size().as_usize() > 1 && asked != "auto" {
                    assert_eq!(pg.transport(), asked, "the job ignored BURN_DDP_TRANSPORT");
                }
            }
            let tolerance = scenario.tolerance.map_or(L::F32, |t| Tolerance {
                rel: t.rel.max(L::F32.rel),
                floor: t.floor.max(L::F32.floor),
            });
            let trained = L::train(pg.clone(), &scenario);
            check(&pg, &trained, tolerance);
            return;
        }
        let selected = |w: u32| procs::world_selected(w as usize);
        if procs::is_any_child() || !selected(world) {
            continue;
        }
        let Some((resumed, to)) = second else {
            procs::TestJob::new(world, &job)
                .function(name)
                .run()
                .assert_all_ok();
            continue;
        };
        if !selected(to) {
            continue;
        }
        let dir = std::env::temp_dir().join(format!("{job}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("a folder for the checkpoint");
        for (job, ranks, half) in [(&job, world, "first"), (&resumed, to, "second")] {
            procs::TestJob::new(ranks, job)
                .function(name)
                .env(HALF_VAR, format!("{half}:{world}"))
                .env(DIR_VAR, dir.display())
                .run()
                .assert_all_ok();
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// The checks of one rank: close to the reference, bit-identical to the other ranks, and the
/// unsynchronised model beyond the tolerance (with more than one rank).
fn check(pg: &ProcessGroup, t: &Trained, tolerance: Tolerance) {
    let rank = pg.rank().index();
    assert_close(rank, &t.ddp, &t.reference, tolerance);
    let mine = f32_bytes(&t.ddp);
    let all = pg.all_gather_bytes(&mine).unwrap();
    assert_replicas_equal(rank, &mine, &all);
    if pg.world_size().as_usize() > 1 {
        assert_discriminates(rank, &t.alone, &t.reference, tolerance);
    }
    let _ = pg.barrier();
}

/// One `#[test]` per FSDP scenario ([`fsdp_scenarios`]) for the line `$line` (a [`Line`]),
/// named as the scenario, and one test that the list is the suite's.
#[macro_export]
macro_rules! fsdp_suite {
    ($line:ty) => {
        $crate::fsdp_suite!(@tests $line;
            fsdp_mlp_adam, fsdp_mlp_adam_no_reshard, fsdp_conv_adam_accumulate_2, fsdp_tied_adam,
            fsdp_tied_adam_no_reshard, fsdp_mlp_adam_resume_3, fsdp_tied_adam_resume_2_no_reshard,
            fsdp_mlp_sgd_bf16);
    };
    (@tests $line:ty; $($name:ident),* $(,)?) => {
        $(
            #[test]
            fn $name() {
                $crate::conformance::run::<$line>(stringify!($name));
            }
        )*

        #[test]
        fn the_fsdp_suite_runs_every_scenario() {
            let names: Vec<&str> =
                $crate::conformance::fsdp_scenarios().iter().map(|s| s.name).collect();
            assert_eq!(names, [$(stringify!($name)),*]);
        }
    };
}

/// One `#[test]` per conformance scenario for the line `$line` (a [`Line`]), named as the
/// scenario, and one test that the list is the suite's.
#[macro_export]
macro_rules! conformance_suite {
    ($line:ty) => {
        $crate::conformance_suite!(@tests $line;
            mlp_sgd, mlp_adam, conv_sgd, conv_adam_after_backward, mlp_small_buckets,
            mlp_accumulate_4, mlp_adam_accumulate_2, shared_gradient_buffer,
            strided_gradient_view, mlp_bf16_compression, mlp_sgd_comm_hook, mlp_adam_bucket_view,
            mlp_small_buckets_bucket_view, shared_gradient_buffer_bucket_view, mlp_adam_join,
            conv_sgd_join_small_buckets, mlp_adam_zero, mlp_adam_shared_buckets,
            conv_sgd_join_shared_small_buckets, mlp_small_shared_buckets_bucket_view,
            conv_adam_zero_accumulate_2, tied_adam_small_buckets, tied_sgd_accumulate_2,
            mlp_adam_zero2, mlp_adam_zero2_after_backward, conv_adam_zero2_accumulate_2,
            tied_adam_zero2_small_buckets, mlp_adam_zero2_resume_3,
            tied_adam_zero_resume_2_small_buckets);
    };
    (@tests $line:ty; $($name:ident),* $(,)?) => {
        $(
            #[test]
            fn $name() {
                $crate::conformance::run::<$line>(stringify!($name));
            }
        )*

        #[test]
        fn the_conformance_suite_runs_every_scenario() {
            let names: Vec<&str> = $crate::conformance::scenarios().iter().map(|s| s.name).collect();
            assert_eq!(names, [$(stringify!($name)),*]);
        }
    };
}
