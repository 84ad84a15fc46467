//! Fault-tolerant training with Burn (`burn-ddp run --fault-tolerant`): the classifier example
//! through `DdpStrategy` and Burn's Learner, and a custom loop on `DdpSession`, in real
//! processes under the real launcher; ranks SIGKILLed mid-epoch; replacements joining live.
//!
//! What is checked every time: the survivors go on without a restart (the same processes, no
//! checkpoint reloaded), finish, and hold bit-identical parameters; a process that joins
//! takes the state of a survivor and ends identical to them.

mod common;

use std::time::Duration;

use burn::backend::{Autodiff, NdArray};
use burn::module::Module;
use burn::nn::{Linear, LinearConfig, Relu};
use burn::optim::{AdamConfig, GradientsParams, Optimizer};

use burn::tensor::backend::Backend;
use burn::tensor::{Distribution, Tensor};
use burn_ddp::{Ddp, DdpConfig, DdpSession, ProcessGroup};
use burn_ddp_dev::fault::{self, kill_rank, launch_on, scratch};
use common::netns::{finish, wait_for};

/// 3 ranks train the classifier (Burn's Learner, `DdpStrategy`); rank 1 is SIGKILLed in the
/// middle of the first epoch; the survivors go on without a restart, bit-identical
/// (`burn_ddp_dev::fault`, the scenario every line passes).
#[test]
fn the_classifier_loses_a_rank_mid_epoch_and_finishes_without_a_restart() {
    fault::classifier_loses_a_rank_mid_epoch("classifier");
}

/// Rank 0 is SIGKILLed mid-epoch with one replacement allowed: rank 1 becomes rank 0, the
/// replacement joins the running job and takes a survivor's state; the three end identical.
#[test]
fn rank_zero_is_lost_and_a_replacement_joins_the_running_classifier() {
    fault::rank_zero_is_lost_and_a_replacement_joins("classifier");
}

const LOOP_CHILD: &str = "custom_loop_child";

#[derive(Module, Debug)]
struct Mlp<B: Backend> {
    a: Linear<B>,
    b: Linear<B>,
    act: Relu,
}

type Train = Autodiff<Ddp<NdArray>>;

/// One rank of a custom training loop on `DdpSession` (run by the launcher): a small MLP,
/// Adam, a fixed regression task; `Replica`, `step_boundary` and `recover` carry it across
/// changes of membership.
#[test]
fn custom_loop_child() {
    if std::env::var("BURN_DDP_TEST_CHILD").as_deref() != Ok(LOOP_CHILD) {
        return;
    }
    burn_ddp_comm::launch::cli::init_logging();
    println!();
    let steps: u64 = std::env::var("FT_STEPS").unwrap().parse().unwrap();
    let pg = ProcessGroup::from_env().unwrap_or_else(|e| panic!("joining: {e}"));
    println!(
        "member {} pid {}",
        pg.membership().unwrap().0,
        std::process::id()
    );
    let session = DdpSession::new(pg.clone(), DdpConfig::default()).unwrap();
    let device = Default::default();
    <Train as Backend>::seed(&device, 7);
    let model = Mlp::<Train> {
        a: LinearConfig::new(16, 32).init(&device),
        b: LinearConfig::new(32, 1).init(&device),
        act: Relu::new(),
    };
    let mut replica = session
        .replica(model, AdamConfig::new().init(), Vec::new())
        .unwrap_or_else(|e| panic!("preparing: {e}"));
    while replica.step < steps {
        let step = replica.step;
        let result = (|| {
            session.step_boundary(&mut replica)?;
            // This step's batch on this rank: a function of the step and the rank's place.
            <Train as Backend>::seed(&device, step * 1000 + u64::from(pg.rank().0));
            let x = Tensor::<Train, 2>::random([8, 16], Distribution::Normal(0.0, 1.0), &device);
            let y = x.clone().sum_dim(1).div_scalar(4.0);
            let m = &replica.model;
            let pred = m.b.forward(m.act.forward(m.a.forward(x)));
            let loss = (pred - y).powi_scalar(2).mean();
            let grads: GradientsParams = session.gradients(&replica.model, loss)?;
            replica.model = replica.optim.step(1e-2, replica.model.clone(), grads);
            replica.step += 1;
            Ok::<(), burn_ddp::DdpError>(())
        })();
        if let Err(e) = result {
            session
                .recover(e, &mut replica)
                .unwrap_or_else(|e| panic!("recovering: {e}"));
        }
        if let Some(rec) = &replica.changed {
            println!("changed: {}", rec.summary());
        }
        std::thread::sleep(Duration::from_millis(15));
    }
    let bits: Vec<u32> = common::params(&replica.model)
        .iter()
        .map(|x| x.to_bits())
        .collect();
    let digest = bits.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3)
    });
    println!("final step {} digest {digest:016x}", replica.step);
}

/// A custom loop (`DdpSession`): 3 ranks, one SIGKILLed; the two survivors go on; later a
/// process started by a second launcher (`--join`) is let in at a step boundary and takes a
/// survivor's model and optimizer: the three end with equal parameters, after all the steps.
#[test]
fn a_custom_loop_recovers_and_takes_in_a_process_started_later() {
    let dir = scratch("loop");
    let (log, log_join) = (dir.join("launcher.log"), dir.join("joiner.log"));
    let args: Vec<String> = [LOOP_CHILD, "--exact", "--nocapture", "--test-threads=1"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    let env = [("BURN_DDP_TEST_CHILD", LOOP_CHILD), ("FT_STEPS", "300")];
    let port = burn_ddp_comm::launch::spawn::free_port().unwrap();
    let exe = std::env::current_exe().unwrap();
    let mut job = launch_on(port, &["--nproc-per-node", "3"], &exe, &args, &env, &log);
    wait_for(&log, "member 2 pid", Duration::from_secs(120));
    std::thread::sleep(Duration::from_millis(1000));
    kill_rank(&job, 2);
    wait_for(&log, "changed: membership epoch 1", Duration::from_secs(60));
    let mut joiner = launch_on(
        port,
        &["--join", "--nproc-per-node", "1"],
        &exe,
        &args,
        &env,
        &log_join,
    );
    let (ok_j, joined) = finish(&mut joiner, &log_join, Duration::from_secs(600));
    let (ok, text) = finish(&mut job, &log, Duration::from_secs(600));
    assert!(ok, "{text}");
    assert!(ok_j, "{joined}\n---- job ----\n{text}");
    assert!(text.contains("joined: [m3]"), "{text}");
    assert!(text.contains("a process asked to join"), "{text}");
    let finals: Vec<String> = [&text, &joined]
        .iter()
        .flat_map(|t| t.lines())
        .filter_map(|l| {
            l.split_once("final step 300 digest ")
                .map(|p| p.1.to_string())
        })
        .collect();
    assert_eq!(finals.len(), 3, "{text}\n{joined}");
    assert!(
        finals.iter().all(|d| *d == finals[0]),
        "the replicas differ:\n{text}\n{joined}"
    );
    let _ = std::fs::remove_dir_all(&dir);
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
    let _store = burn_ddp_comm::launch::fault::Lighthouse::bind(&master, token.clone()).unwrap();
    let pg = ProcessGroup::init(
        GroupConfig::new(Rank(0), WorldSize::ONE, token)
            .with_master(master)
            .with_fault_tolerance(FaultTolerance::default()),
    )
    .unwrap();
    let refused = |r: burn_ddp::Result<()>, what: &str| match r {
        Err(burn_ddp::DdpError::NotFaultTolerant { what: w, .. }) => {
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
