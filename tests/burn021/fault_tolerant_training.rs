//! Fault-tolerant training with Burn (`burn-ddp run --fault-tolerant`): the classifier example
//! through `DdpStrategy` and Burn's Learner, and a custom loop on `DdpSession`, in real
//! processes under the real launcher; ranks SIGKILLed mid-epoch; replacements joining live.
//!
//! What is checked every time: the survivors go on without a restart (the same processes, no
//! checkpoint reloaded), finish, and hold bit-identical parameters; a process that joins
//! takes the state of a survivor and ends identical to them.

use crate::common;

use burn::backend::{Autodiff, NdArray};
use burn::module::Module;
use burn::nn::{Linear, LinearConfig, Relu};
use burn::optim::adaptor::OptimizerAdaptor;
use burn::optim::{AdamConfig, GradientsParams, Optimizer};
use burn_ddp_comm::MembershipError;

use burn::tensor::backend::Backend;
use burn::tensor::{Distribution, Tensor};
use burn_ddp::{Ddp, DdpConfig, DdpSession, LoopState, ProcessGroup};
use burn_ddp_dev::fault_tolerance as fault;

/// 3 ranks train the classifier (Burn's Learner, `DdpStrategy`); rank 1 is SIGKILLed in the
/// middle of the first epoch; the survivors go on without a restart, bit-identical
/// (`burn_ddp_dev::fault`, the scenario every line passes).
#[test]
fn the_classifier_loses_a_rank_mid_epoch_and_finishes_without_a_restart() {
    fault::classifier_loses_a_rank_mid_epoch("classifier");
}

/// The chaos run's short schedule (`burn_ddp_dev::chaos`): 20 faults of every kind on
/// 3-rank jobs of the classifier, each survived within the bound, every job ending with equal
/// replicas, every item counted once and its checkpoints intact.
#[test]
fn a_chaos_schedule_of_20_faults_is_survived() {
    fault::chaos_schedule("classifier", 20);
}

/// Rank 0 is SIGKILLed mid-epoch with one replacement allowed: rank 1 becomes rank 0, the
/// replacement joins the running job and takes a survivor's state; the three end identical.
#[test]
fn rank_zero_is_lost_and_a_replacement_joins_the_running_classifier() {
    fault::rank_zero_is_lost_and_a_replacement_joins("classifier");
}

/// Rank 0 is SIGKILLed as it writes the checkpoint of epoch 1: the new rank 0 writes it again,
/// both epochs' checkpoints are complete at the end, no temporary file is left.
#[test]
fn rank_zero_lost_while_it_writes_a_checkpoint_loses_no_checkpoint() {
    fault::rank_zero_dies_while_it_writes_a_checkpoint("classifier");
}

/// Rank 0 is frozen with a checkpoint half written, left out, then continued: its write
/// completes though the new rank 0 wrote that checkpoint again meanwhile, it rejoins, and the
/// job ends well with its checkpoints complete.
#[test]
fn rank_zero_frozen_while_it_writes_a_checkpoint_rejoins_and_the_job_ends_well() {
    fault::rank_zero_frozen_while_it_writes_a_checkpoint("classifier");
}

/// Rank 0 is frozen, left out, then continued: it rejoins, and the summary is printed once, by
/// the rank 0 of the last membership.
#[test]
fn a_frozen_rank_zero_rejoins_and_the_new_rank_zero_prints_the_summary() {
    fault::frozen_rank_zero_rejoins_and_the_new_rank_zero_prints_the_summary("classifier");
}

/// The optimizer of the custom loop.
type Adam = OptimizerAdaptor<burn::optim::Adam, Mlp<Train>, Train>;

const LOOP_CHILD: &str = "custom_loop_child";

#[derive(Module, Debug)]
struct Mlp<B: Backend> {
    a: Linear<B>,
    b: Linear<B>,
    act: Relu,
}

type Train = Autodiff<Ddp<NdArray>>;

/// One rank of a custom training loop on `DdpSession` (run by the launcher): a small MLP,
/// Adam, a fixed regression task; `loop_state`, `step_boundary` and `recover` carry it across
/// changes of membership.
#[test]
fn custom_loop_child() {
    let Some(pg) = fault::loop_child(LOOP_CHILD) else {
        return;
    };
    let session = DdpSession::new(pg.clone(), DdpConfig::default()).unwrap();
    let device = Default::default();
    <Train as Backend>::seed(&device, 7);
    let model = Mlp::<Train> {
        a: LinearConfig::new(16, 32).init(&device),
        b: LinearConfig::new(32, 1).init(&device),
        act: Relu::new(),
    };
    let mut state = session
        .loop_state(model, AdamConfig::new().init(), Vec::new())
        .unwrap_or_else(|e| panic!("preparing: {e}"));
    let train = |session: &mut &DdpSession, state: &mut LoopState<Mlp<Train>, Adam>| {
        session.step_boundary(state)?;
        // This step's batch on this rank: a function of the step and the rank's place.
        <Train as Backend>::seed(&device, state.step * 1000 + u64::from(pg.rank().0));
        let x = Tensor::<Train, 2>::random([8, 16], Distribution::Normal(0.0, 1.0), &device);
        let y = x.clone().sum_dim(1).div_scalar(4.0);
        let m: &Mlp<Train> = &state.model;
        let loss = (m.b.forward(m.act.forward(m.a.forward(x))) - y)
            .powi_scalar(2)
            .mean();
        let grads: GradientsParams = session.gradients(&state.model, loss)?;
        state.model = state.optim.step(1e-2, state.model.clone(), grads);
        state.step += 1;
        Ok(())
    };
    fault::drive_loop(
        &mut &session,
        &mut state,
        train,
        |session, e, state| session.recover(e, state),
        |m| common::params(m).iter().map(|x| x.to_bits()).collect(),
    );
}

/// A custom loop (`DdpSession`): 3 ranks, one SIGKILLed; the two survivors go on; later a
/// process started by a second launcher (`--join`) is let in at a step boundary and takes a
/// survivor's model and optimizer: the three end with equal parameters, after all the steps
/// (`burn_ddp_dev::fault`, the scenario every line passes).
#[test]
fn a_custom_loop_recovers_and_takes_in_a_process_started_later() {
    fault::custom_loop_recovers_and_takes_in_a_joiner(LOOP_CHILD);
}

/// What a fault-tolerant session cannot offer is refused at once, saying why: PowerSGD, ZeRO,
/// uneven inputs (`join`), sub-groups. (A job of one process on a store served in this test, as
/// the launcher serves it.)
#[test]
fn what_a_fault_tolerant_session_cannot_carry_is_refused() {
    use burn_ddp::{FaultTolerance, GroupConfig, JobToken, MasterAddr, PowerSgd, Rank, WorldSize};
    let token = JobToken::new("ft-refusals");
    let port = burn_ddp_comm::launch::spawn::free_port().unwrap();
    let master = MasterAddr::new("127.0.0.1", port);
    let _store =
        burn_ddp_comm::launch::lighthouse::Lighthouse::bind(&master, token.clone()).unwrap();
    let pg = ProcessGroup::init(
        GroupConfig::new(Rank(0), WorldSize::ONE, token)
            .with_master(master)
            .with_fault_tolerance(FaultTolerance::default()),
    )
    .unwrap();
    let refused = |r: burn_ddp::Result<()>, what: &str| match r {
        Err(burn_ddp::DdpError::Membership(MembershipError::NotFaultTolerant {
            what: w, ..
        })) => {
            assert!(w.contains(what), "{w}")
        }
        other => panic!("{what}: expected a refusal, got {other:?}"),
    };
    refused(
        DdpSession::new(
            pg.clone(),
            DdpConfig::default().with_power_sgd(PowerSgd::new(2)),
        )
        .map(drop),
        "PowerSGD",
    );
    refused(pg.new_group(&[Rank(0)]).map(drop), "sub-groups");
    let session = DdpSession::new(pg, DdpConfig::default()).unwrap();
    let device = Default::default();
    let model = session
        .prepare(Mlp::<Train> {
            a: LinearConfig::new(4, 4).init(&device),
            b: LinearConfig::new(4, 1).init(&device),
            act: Relu::new(),
        })
        .unwrap();
    refused(
        session.zero(AdamConfig::new().init(), &model).map(drop),
        "ZeRO",
    );
    refused(session.join(model, |_, m| Ok(m)).map(drop), "uneven inputs");
}
