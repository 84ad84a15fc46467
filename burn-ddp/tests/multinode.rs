//! Multi-node jobs for real: each node a Linux network namespace with its own address on a
//! virtual link (`burn-ddp-dev/src/netns.rs`), the launcher and the classifier example in each, so that
//! `MASTER_ADDR` is not loopback, the ranks pick the interface that reaches it, the job token
//! crosses the link, and a node can be killed or cut off whole.
//!
//! - a fixed 2-node job trains exactly as 2 ranks on one machine;
//! - an elastic job (`--nnodes 1:2`) loses a killed node, goes on alone from the newest
//!   checkpoint, takes the restarted node back at the next round, and finishes;
//! - an elastic job loses a node whose link goes down and finishes without it; the cut-off
//!   node ends with an error saying it lost the rendezvous, no hang.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use common::netns::{
    self, env_launcher, finish, scratch, strings, wait_for, wait_for_files, ElasticPair, Net,
};
use common::spawned::digest;

/// Two nodes, one rank each, `MASTER_ADDR` on the first node's link: the job trains to the
/// same parameters as 2 ranks on one machine (`--nproc 2`, loopback), bit for bit (the
/// scenario every line's classifier passes, `burn_ddp_dev::netns`).
#[test]
fn two_nodes_on_a_virtual_link_train_exactly_like_one_machine() {
    common::netns::two_nodes_train_like_one_machine("classifier");
}

/// `--nnodes 1:2` on two nodes: node b killed whole, node a goes on alone from the newest
/// checkpoint, node b started again is taken back at the next round (the scenario every line's
/// classifier passes, `burn_ddp_dev::netns`).
#[test]
fn elastic_job_loses_a_killed_node_goes_on_and_takes_it_back() {
    netns::elastic_job_loses_a_killed_node_and_takes_it_back("classifier");
}

/// `--nnodes 1:2`; node b's link goes down (its processes live on, cut off): node a's
/// rendezvous finds node b's launcher silent, and node a finishes alone from the newest
/// checkpoint. Node b ends non-zero within a bound, saying it lost the rendezvous.
#[test]
fn elastic_job_drops_a_node_whose_link_goes_down() {
    let mut job = ElasticPair::start("classifier", "cut", 3);
    wait_for_files(&job.checkpoint(1), Duration::from_secs(300));

    job.net.link(1, false);
    let cut = Instant::now();
    job.resumed_alone_after(cut, "cut off");
    let (ok_a, text_a) = finish(&mut job.a, &job.log_a, Duration::from_secs(300));
    assert!(ok_a, "node a:\n{text_a}");
    assert!(
        text_a.contains("round 1: 1 node(s) [a], world size 1 (was 2); left: [b]"),
        "{text_a}"
    );
    assert!(text_a.contains("final test accuracy"), "{text_a}");
    let (ok_b, text_b) = finish(&mut job.b, &job.log_b, Duration::from_secs(120));
    let took = cut.elapsed();
    assert!(!ok_b, "node b, cut off, succeeded:\n{text_b}");
    assert!(text_b.contains("lost the rendezvous"), "{text_b}");
    eprintln!("node b cut off: it ended {took:.1?} later, naming the lost rendezvous");
    let _ = std::fs::remove_dir_all(&job.dir);
}

/// Bad elastic options are refused before anything starts, naming the option; too few nodes
/// end the job at the rendezvous timeout saying how many came (no hang).
#[test]
fn bad_elastic_options_and_too_few_nodes_are_named() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
        .to_string();
    let cases: &[(&[&str], &str)] = &[
        (&["--nnodes", "3:2"], "MIN (3) is above MAX (2)"),
        (&["--nnodes", "0:2"], "neither a number of nodes"),
        (
            &["--nnodes", "1:2", "--node-rank", "1", "--rdzv-id", "x"],
            "assigned by the rendezvous",
        ),
        (&["--nnodes", "1:2"], "--rdzv-id"),
        (
            &["--nnodes", "1:2", "--fault-tolerant", "--rdzv-id", "x"],
            "does not go with an elastic --nnodes MIN:MAX",
        ),
        (&["--join"], "--fault-tolerant"),
        (&["--min-ranks", "2"], "--fault-tolerant"),
        (
            &[
                "--nnodes",
                "1:2",
                "--rdzv-id",
                "x",
                "--rdzv-join-window",
                "-1",
            ],
            "--rdzv-join-window",
        ),
        (
            &[
                "--nnodes",
                "2:3",
                "--rdzv-id",
                "x",
                "--rdzv-timeout",
                "1",
                "--node-id",
                "lonely",
                "--master-port",
                &port,
            ],
            "1 of the at least 2 node(s) arrived within 1s ([lonely])",
        ),
    ];
    for (args, expected) in cases {
        let started = Instant::now();
        let out = Command::new(common::spawned::launcher())
            .arg("run")
            .args(*args)
            .args(["--", "true"])
            .env_remove("BURN_DDP_JOB_TOKEN")
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} succeeded");
        assert!(stderr.contains(expected), "{args:?}: {stderr}");
        assert!(started.elapsed() < Duration::from_secs(30), "{args:?}");
    }
}

/// The launcher arguments of node `node` (of 3, one rank each) of a fault-tolerant job on `net`
/// (node 0 serves the job's store), then the classifier's; `join`: this node joins the
/// running job.
fn fault_tolerant_args(net: &Net, node: usize, out: &Path, join: bool) -> Vec<String> {
    let mut args = strings(&[
        "run",
        "--fault-tolerant",
        "--nnodes",
        "3",
        "--nproc-per-node",
        "1",
        "--rdzv-id",
        "ft-test",
        "--master-port",
        "29500",
        "--master-addr",
    ]);
    args.push(net.addr(0));
    args.extend(["--node-rank".into(), node.to_string()]);
    if join {
        args.push("--join".into());
    }
    args.push("--".into());
    args.push(common::spawned::example("classifier").display().to_string());
    args.extend(common::spawned::classifier_args(out, 3, 1536, 128));
    args
}

/// A fault-tolerant job on three nodes (network namespaces, one rank each). Node 2's link goes
/// down mid-epoch (its processes live on, cut off): within the heartbeat bound nodes 0 and 1
/// agree on a membership without it and go on from the step they were at, no restart. Node 2
/// ends non-zero, saying it is cut off. Its link back up, a new launcher on node 2 joins the
/// running job (`--join`) at a step boundary and takes a survivor's state; the three ranks of
/// the last membership end with the same parameters.
#[test]
fn a_fault_tolerant_job_survives_a_node_cut_off_and_takes_a_node_back() {
    let net = Net::new(3);
    let dir = scratch("ft-cut");
    let out = dir.join("out");
    let logs: Vec<PathBuf> = (0..3).map(|i| dir.join(format!("node{i}.log"))).collect();
    let mut nodes: Vec<std::process::Child> = (0..3)
        .map(|i| {
            let (prog, args) = env_launcher(fault_tolerant_args(&net, i, &out, false));
            net.start(i, &prog, &args, &logs[i])
        })
        .collect();
    wait_for(&logs[0], "[train] epoch 1/3", Duration::from_secs(300));
    std::thread::sleep(Duration::from_millis(1500));
    net.link(2, false);
    let cut = Instant::now();
    let first = wait_for(
        &logs[0],
        "the first step of membership epoch 1 is done",
        Duration::from_secs(60),
    );
    eprintln!(
        "node 2's link down -> the survivors' first step: {:?}",
        first - cut
    );
    let (ok2, text2) = finish(&mut nodes[2], &logs[2], Duration::from_secs(120));
    let ended = cut.elapsed();
    assert!(!ok2, "node 2, cut off, succeeded:\n{text2}");
    assert!(text2.contains("is cut off from the job"), "{text2}");
    assert!(text2.contains("cannot reach the job's store"), "{text2}");
    eprintln!("node 2, cut off, ended {ended:?} after its link went down");
    if std::env::var_os("BURN_DDP_TEST_SHOW").is_some() {
        eprintln!("{text2}");
    }

    net.link(2, true);
    let log_join = dir.join("node2-join.log");
    let (prog, args) = env_launcher(fault_tolerant_args(&net, 2, &out, true));
    let mut joiner = net.start(2, &prog, &args, &log_join);
    let (ok_j, text_j) = finish(&mut joiner, &log_join, Duration::from_secs(600));
    let (ok0, text0) = finish(&mut nodes[0], &logs[0], Duration::from_secs(600));
    let (ok1, text1) = finish(&mut nodes[1], &logs[1], Duration::from_secs(600));
    assert!(ok0, "node 0:\n{text0}");
    assert!(ok1, "node 1:\n{text1}");
    assert!(ok_j, "node 2 joining:\n{text_j}\n---- node 0 ----\n{text0}");
    assert!(
        text0.contains("membership epoch 1: world size 2 (was 3); left: [m2]"),
        "{text0}"
    );
    assert!(text0.contains("joined: [m3]"), "{text0}");
    assert!(
        text_j.contains("this process joined the running job"),
        "{text_j}"
    );
    let d0 = digest(&text0, 0);
    assert_eq!(d0, digest(&text1, 1), "nodes 0 and 1 differ");
    assert_eq!(d0, digest(&text_j, 2), "the node that joined differs");
    let _ = std::fs::remove_dir_all(&dir);
}
