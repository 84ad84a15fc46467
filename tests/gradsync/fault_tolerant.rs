//! Fault-tolerant training on Burn 0.22.1 or 0.23 (`burn-ddp run --fault-tolerant`): the
//! release's classifier example through its burn-train's Learner and this line's `DdpStrategy`, in
//! real processes under the real launcher, ranks SIGKILLed mid-epoch, a replacement joining
//! live: the scenarios the 0.21 line passes (`burn_ddp_dev::fault`), a custom loop on
//! `GradSync::loop_state` losing a rank and taking in a joiner, and the refusals of what a
//! change of membership cannot carry.

use burn_ddp as line;

use crate::CLASSIFIER as EXAMPLE;

use burn::module::{Module, ModuleVisitor, Param};
use burn::nn::{Linear, LinearConfig, Relu};
use burn::optim::{AdamConfig, GradientsParams, ModuleOptimizer};
use burn::tensor::{Device, Distribution, Tensor};
use burn_ddp_comm::launch::lighthouse::Lighthouse;
use burn_ddp_comm::FaultTolerance;
use burn_ddp_comm::MembershipError;
use burn_ddp_dev::fault_tolerance as fault;
use line::{
    DdpConfig, DdpError, GradSync, GroupConfig, JobToken, LoopState, MasterAddr, PowerSgd,
    ProcessGroup, Rank, WorldSize,
};

/// 3 ranks train the classifier example; rank 1 is SIGKILLed in the middle of the first epoch; the
/// survivors agree on a membership of two, go on from the step they were at without a restart,
/// and end bit-identical.
#[test]
fn the_classifier_loses_a_rank_mid_epoch_and_finishes_without_a_restart() {
    fault::classifier_loses_a_rank_mid_epoch(EXAMPLE);
}

/// Rank 0 is SIGKILLed mid-epoch with one replacement allowed: rank 1 becomes rank 0, the
/// replacement joins the running job and takes a survivor's Learner state; the three end
/// identical.
#[test]
fn rank_zero_is_lost_and_a_replacement_joins_the_running_classifier() {
    fault::rank_zero_is_lost_and_a_replacement_joins(EXAMPLE);
}

/// The chaos run's short schedule (`burn_ddp_dev::chaos`): 20 faults of every kind on
/// 3-rank jobs of the classifier, each survived within the bound, every job ending with equal
/// replicas, every item counted once and its checkpoints intact.
#[test]
fn a_chaos_schedule_of_20_faults_is_survived() {
    fault::chaos_schedule(EXAMPLE, 20);
}

/// Rank 0 is SIGKILLed as it writes the checkpoint of epoch 1: the new rank 0 writes it again,
/// both epochs' checkpoints are complete at the end, no temporary file is left.
#[test]
fn rank_zero_lost_while_it_writes_a_checkpoint_loses_no_checkpoint() {
    fault::rank_zero_dies_while_it_writes_a_checkpoint(EXAMPLE);
}

/// Rank 0 is frozen with a checkpoint half written, left out, then continued: its write
/// completes though the new rank 0 wrote that checkpoint again meanwhile, it rejoins, and the
/// job ends well with its checkpoints complete.
#[test]
fn rank_zero_frozen_while_it_writes_a_checkpoint_rejoins_and_the_job_ends_well() {
    fault::rank_zero_frozen_while_it_writes_a_checkpoint(EXAMPLE);
}

/// Rank 0 is frozen, left out, then continued: it rejoins, and the summary is printed once, by
/// the rank 0 of the last membership.
#[test]
fn a_frozen_rank_zero_rejoins_and_the_new_rank_zero_prints_the_summary() {
    fault::frozen_rank_zero_rejoins_and_the_new_rank_zero_prints_the_summary(EXAMPLE);
}

const LOOP_CHILD: &str = "custom_loop_child";

#[derive(Module, Debug)]
struct Mlp {
    a: Linear,
    b: Linear,
    act: Relu,
}

/// Every float parameter's bits, in visit order.
fn bits<M: Module>(m: &M) -> Vec<u32> {
    struct Collect(Vec<u32>);
    impl ModuleVisitor for Collect {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
            let values = p.val().into_data().convert::<f32>().try_to_vec::<f32>();
            self.0.extend(values.unwrap().iter().map(|x| x.to_bits()));
        }
    }
    let mut out = Collect(Vec::new());
    m.visit(&mut out);
    out.0
}

/// One rank of a custom training loop on `GradSync` (run by the launcher): a small MLP, Adam,
/// a fixed regression task; `loop_state`, `step_boundary` and `recover` carry it across
/// changes of membership.
#[test]
fn custom_loop_child() {
    let Some(pg) = fault::loop_child(LOOP_CHILD) else {
        return;
    };
    let mut sync = GradSync::new(pg.clone(), DdpConfig::default()).unwrap();
    let device = Device::default().autodiff();
    device.seed(7);
    let model = Mlp {
        a: LinearConfig::new(16, 32).init(&device),
        b: LinearConfig::new(32, 1).init(&device),
        act: Relu::new(),
    };
    let mut state = sync
        .loop_state(model, AdamConfig::new().init(), Vec::new())
        .unwrap_or_else(|e| panic!("preparing: {e}"));
    let train = |sync: &mut GradSync, state: &mut LoopState<Mlp, ModuleOptimizer>| {
        sync.step_boundary(state)?;
        // This step's batch on this rank: a function of the step and the rank's place.
        device.seed(state.step * 1000 + u64::from(pg.rank().0));
        let x = Tensor::<2>::random([8, 16], Distribution::Normal(0.0, 1.0), &device);
        let y = x.clone().sum_dim(1).div_scalar(4.0);
        let m = &state.model;
        let loss = (m.b.forward(m.act.forward(m.a.forward(x))) - y)
            .powi_scalar(2)
            .mean();
        let grads = GradientsParams::from_grads(loss.backward(), &state.model);
        let grads = sync.sync(&state.model, grads)?;
        state.model = state.optim.step(1e-2, state.model.clone(), grads);
        state.step += 1;
        Ok(())
    };
    fault::drive_loop(
        &mut sync,
        &mut state,
        train,
        |sync, e, state| sync.recover(e, state),
        bits,
    );
}

/// A custom loop (`GradSync`): 3 ranks, one SIGKILLed; the two survivors go on; later a
/// process started by a second launcher (`--join`) is let in at a step boundary and takes a
/// survivor's model and optimizer: the three end with equal parameters, after all the steps
/// (`burn_ddp_dev::fault`, the scenario the 0.21 line passes).
#[test]
fn a_custom_loop_recovers_and_takes_in_a_process_started_later() {
    fault::custom_loop_recovers_and_takes_in_a_joiner(LOOP_CHILD);
}

/// What a fault-tolerant job cannot carry across a change of membership is refused at once,
/// saying why: PowerSGD, ZeRO-1, uneven inputs (`join`). (A job of one process on a store
/// served in this test, as the launcher serves it.)
#[test]
fn what_a_fault_tolerant_job_cannot_carry_is_refused() {
    let token = JobToken::new(concat!("ft-refusals-", env!("CARGO_CRATE_NAME")));
    let port = burn_ddp_comm::launch::spawn::free_port().unwrap();
    let master = MasterAddr::new("127.0.0.1", port);
    let _store = Lighthouse::bind(&master, token.clone()).unwrap();
    let pg = ProcessGroup::init(
        GroupConfig::new(Rank(0), WorldSize::ONE, token)
            .with_master(master)
            .with_fault_tolerance(FaultTolerance::default()),
    )
    .unwrap();
    let refused = |r: Result<(), DdpError>, what: &str| match r {
        Err(DdpError::Membership(MembershipError::NotFaultTolerant { what: w, .. })) => {
            assert!(w.contains(what), "{w}")
        }
        other => panic!("{what}: expected a refusal, got {other:?}"),
    };
    refused(
        GradSync::new(
            pg.clone(),
            DdpConfig::default().with_power_sgd(PowerSgd::new(2)),
        )
        .map(drop),
        "PowerSGD",
    );
    let mut sync = GradSync::new(pg, DdpConfig::default()).unwrap();
    let model = sync
        .prepare(LinearConfig::new(4, 1).init(&Default::default()))
        .unwrap();
    let optim: ModuleOptimizer = AdamConfig::new().init();
    refused(sync.zero(optim, &model).map(drop), "ZeRO");
    refused(sync.join(model, |_, m| Ok(m)).map(drop), "uneven inputs");
}
