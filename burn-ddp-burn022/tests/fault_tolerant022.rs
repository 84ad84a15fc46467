//! Fault-tolerant training on the Burn 0.22.1 line (`burn-ddp run --fault-tolerant`): the
//! `classifier022` example through burn-train 0.22's Learner and this line's `DdpStrategy`, in
//! real processes under the real launcher, ranks SIGKILLed mid-epoch, a replacement joining
//! live: the scenarios the 0.21 line passes (`burn_ddp_dev::fault`), and the refusals of what a
//! change of membership cannot carry.

use burn::nn::LinearConfig;
use burn::optim::{AdamConfig, ModuleOptimizer};
use burn_ddp_burn022::{
    DdpConfig, DdpError, GradSync, GroupConfig, JobToken, MasterAddr, PowerSgd, ProcessGroup, Rank,
    WorldSize,
};
use burn_ddp_comm::launch::fault::Lighthouse;
use burn_ddp_comm::FaultTolerance;
use burn_ddp_dev::fault;

/// 3 ranks train `classifier022`; rank 1 is SIGKILLed in the middle of the first epoch; the
/// survivors agree on a membership of two, go on from the step they were at without a restart,
/// and end bit-identical.
#[test]
fn the_classifier_loses_a_rank_mid_epoch_and_finishes_without_a_restart() {
    fault::classifier_loses_a_rank_mid_epoch("classifier022");
}

/// Rank 0 is SIGKILLed mid-epoch with one replacement allowed: rank 1 becomes rank 0, the
/// replacement joins the running job and takes a survivor's Learner state; the three end
/// identical.
#[test]
fn rank_zero_is_lost_and_a_replacement_joins_the_running_classifier() {
    fault::rank_zero_is_lost_and_a_replacement_joins("classifier022");
}

/// What a fault-tolerant job cannot carry across a change of membership is refused at once,
/// saying why: PowerSGD, ZeRO-1, uneven inputs (`join`). (A job of one process on a store
/// served in this test, as the launcher serves it.)
#[test]
fn what_a_fault_tolerant_job_cannot_carry_is_refused() {
    let token = JobToken::new("ft-refusals-022");
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
        Err(DdpError::NotFaultTolerant { what: w, .. }) => assert!(w.contains(what), "{w}"),
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
