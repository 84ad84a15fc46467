//! Fault-tolerant training with Burn (`burn-ddp run --fault-tolerant`): the classifier example
//! through `DdpStrategy` and Burn's Learner, and a custom loop on `DdpSession`, in real
//! processes under the real launcher; ranks SIGKILLed mid-epoch; replacements joining live.
//!
//! What is checked every time: the survivors go on without a restart (the same processes, no
//! checkpoint reloaded), finish, and hold bit-identical parameters; a process that joins
//! takes the state of a survivor and ends identical to them.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use burn::backend::{Autodiff, NdArray};
use burn::module::Module;
use burn::nn::{Linear, LinearConfig, Relu};
use burn::optim::{AdamConfig, GradientsParams, Optimizer};

use burn::tensor::backend::Backend;
use burn::tensor::{Distribution, Tensor};
use burn_ddp::{Ddp, DdpConfig, DdpSession, ProcessGroup};
use common::netns::{finish, wait_for};
use common::spawned::{children, classifier_args, digests, rank_of};

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("burn-ddp-ftt-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The launcher, fault-tolerant, on a free port, running `program args`; its output in `log`.
fn launch(nproc: u32, restarts: u32, program: &Path, args: &[String], log: &Path) -> Child {
    let port = burn_ddp_comm::launch::spawn::free_port().unwrap();
    let (nproc, restarts) = (nproc.to_string(), restarts.to_string());
    launch_on(
        port,
        &["--nproc-per-node", &nproc, "--max-restarts", &restarts],
        program,
        args,
        &[],
        log,
    )
}

/// The fault-tolerant launcher of the job on `port` (`--rdzv-id` from it), with `options`, and
/// `env` for its ranks.
fn launch_on(
    port: u16,
    options: &[&str],
    program: &Path,
    args: &[String],
    env: &[(&str, &str)],
    log: &Path,
) -> Child {
    let out = std::fs::File::create(log).unwrap();
    Command::new(common::spawned::launcher())
        .args([
            "run",
            "--fault-tolerant",
            "--master-port",
            &port.to_string(),
        ])
        .args(["--rdzv-id", &format!("ftt-{port}")])
        .args(options)
        .arg("--")
        .arg(program)
        .args(args)
        .envs(env.iter().copied())
        // Failure detection, not the collective deadline, must bound every wait.
        .env("BURN_DDP_TIMEOUT", "10m")
        .env("BURN_DDP_HEARTBEAT_TIMEOUT", "3s")
        .env_remove("RANK")
        .env_remove("BURN_DDP_JOB_TOKEN")
        .stdin(Stdio::null())
        .stdout(out.try_clone().unwrap())
        .stderr(out)
        .spawn()
        .unwrap()
}

/// Kills (SIGKILL) the rank of `launcher` started as `rank`.
fn kill_rank(launcher: &Child, rank: u32) -> Instant {
    let pid = children(launcher.id())
        .into_iter()
        .find(|p| rank_of(*p) == Some(rank))
        .unwrap_or_else(|| panic!("no process of rank {rank}"));
    let status = Command::new("kill")
        .args(["-KILL", &pid.to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    Instant::now()
}

/// The steps into the epoch a membership line says the job went on from.
fn steps_in(line: &str) -> usize {
    line.split(" steps in")
        .next()
        .and_then(|h| h.rsplit(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

/// The classifier on 3 fault-tolerant ranks (`restarts` replacements allowed) in a fresh
/// directory, with rank `victim` SIGKILLed 1.5 s into the first epoch: the directory, the
/// launcher's log, the launcher, and when the kill happened.
fn classifier_losing(name: &str, restarts: u32, victim: u32) -> (PathBuf, PathBuf, Child, Instant) {
    let dir = scratch(name);
    let log = dir.join("launcher.log");
    let job = launch(
        3,
        restarts,
        &common::spawned::example("classifier"),
        &classifier_args(&dir.join("out"), 2, 1536, 128),
        &log,
    );
    wait_for(&log, "[train] epoch 1/2", Duration::from_secs(300));
    std::thread::sleep(Duration::from_millis(1500));
    let killed = kill_rank(&job, victim);
    (dir, log, job, killed)
}

/// 3 ranks train the classifier (Burn's Learner, `DdpStrategy`); rank 1 is SIGKILLed in the
/// middle of the first epoch. The other two agree on a membership of two within the
/// heartbeat bound, go on from the step they were at, re-deal the rest of the epoch, finish
/// both epochs, and hold bit-identical parameters. The time from the kill to the survivors'
/// first completed step is measured.
#[test]
fn the_classifier_loses_a_rank_mid_epoch_and_finishes_without_a_restart() {
    let (dir, log, mut job, killed) = classifier_losing("lose", 0, 1);
    let first = wait_for(
        &log,
        "the first step of membership epoch 1 is done",
        Duration::from_secs(60),
    );
    let (ok, text) = finish(&mut job, &log, Duration::from_secs(600));
    assert!(ok, "{text}");
    eprintln!(
        "SIGKILL of rank 1 -> the survivors' first step (seen in the log): {:?}",
        first - killed
    );
    let line = text
        .lines()
        .find(|l| l.contains("[membership] membership epoch 1: world size 2 (was 3); left: [m1]"))
        .unwrap_or_else(|| panic!("no membership line on rank 0:\n{text}"));
    assert!(line.contains("at epoch 1, training"), "{line}");
    assert!(steps_in(line) > 0, "not mid-epoch: {line}");
    // Rank 0's dashboard (its progress lines) shows the new world size and the change.
    assert!(
        text.lines().any(|l| l.contains("[train]")
            && l.contains("World size 2 | Membership epoch 1: world size 2 (was 3); left m1; at epoch 1, training")),
        "{text}"
    );
    assert!(text.contains("final test accuracy"), "{text}");
    let d = digests(&text);
    assert_eq!(d.len(), 2, "{text}");
    assert_eq!(d[0].1, d[1].1, "the survivors differ:\n{text}");
    assert!(
        text.contains("lost on the way: member 1 was killed by signal 9"),
        "{text}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Rank 0 (the dashboard's) is SIGKILLed mid-epoch with one replacement allowed: rank 1 becomes
/// rank 0 and carries on the progress lines, the replacement joins the running job, takes a
/// survivor's Learner state and position, and the three end with the same parameters.
#[test]
fn rank_zero_is_lost_and_a_replacement_joins_the_running_classifier() {
    let (dir, log, mut job, _) = classifier_losing("zero", 1, 0);
    let (ok, text) = finish(&mut job, &log, Duration::from_secs(600));
    assert!(ok, "{text}");
    assert!(text.contains("starting member 3 in its place"), "{text}");
    assert!(text.contains("left: [m0]"), "{text}");
    assert!(
        text.contains("this process joined the running job"),
        "{text}"
    );
    // The new rank 0 (started as rank 1) shows the dashboard's lines and the result.
    assert!(text.contains("[rank 1] [membership]"), "{text}");
    assert!(text.contains("[rank 1] final test accuracy"), "{text}");
    let d = digests(&text);
    assert_eq!(d.len(), 3, "{text}");
    assert!(
        d.iter().all(|(_, x)| *x == d[0].1),
        "the replicas differ:\n{text}"
    );
    let _ = std::fs::remove_dir_all(&dir);
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
