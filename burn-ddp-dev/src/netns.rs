//! Several "nodes" on one machine: Linux network namespaces, each with its own address on a
//! virtual link to a bridge (a switch namespace of its own), created by the test and removed
//! when it ends. A node's processes see only their namespace's network: `MASTER_ADDR` is not
//! loopback, and cutting a node's link (or killing every process in it) acts on that node only.
//!
//! Needs root and iproute2's `ip`. Where namespaces cannot be made, [`Net::new`] panics saying
//! why: such a test fails, it never passes without having run.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

static NEXT: AtomicU32 = AtomicU32::new(0);

/// The nodes of one test, on the subnet 10.77.0.0/24: node `i` has 10.77.0.{i+1}.
pub struct Net {
    prefix: String,
    nodes: usize,
}

fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("`ip {}` could not run: {e}", args.join(" ")))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "`ip {}` failed ({}): {}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

impl Net {
    /// Makes `nodes` namespaces linked by a bridge.
    pub fn new(nodes: usize) -> Self {
        let prefix = format!(
            "bddp{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::SeqCst)
        );
        let net = Self { prefix, nodes };
        if let Err(e) = net.build() {
            panic!(
                "this test needs network namespaces (root and iproute2's `ip`), and this machine \
                 could not make them: {e}"
            );
        }
        net
    }

    fn switch(&self) -> String {
        format!("{}-sw", self.prefix)
    }

    /// The namespace of node `i`.
    pub fn ns(&self, i: usize) -> String {
        format!("{}-n{i}", self.prefix)
    }

    /// The address of node `i`.
    pub fn addr(&self, i: usize) -> String {
        format!("10.77.0.{}", i + 1)
    }

    fn build(&self) -> Result<(), String> {
        let sw = self.switch();
        ip(&["netns", "add", &sw])?;
        ip(&["-n", &sw, "link", "add", "br0", "type", "bridge"])?;
        ip(&["-n", &sw, "link", "set", "br0", "up"])?;
        for i in 0..self.nodes {
            let ns = self.ns(i);
            let port = format!("p{i}");
            ip(&["netns", "add", &ns])?;
            ip(&[
                "-n", &ns, "link", "add", "eth0", "type", "veth", "peer", "name", &port, "netns",
                &sw,
            ])?;
            ip(&["-n", &sw, "link", "set", &port, "master", "br0", "up"])?;
            ip(&["-n", &ns, "link", "set", "lo", "up"])?;
            let cidr = format!("{}/24", self.addr(i));
            ip(&["-n", &ns, "addr", "add", &cidr, "dev", "eth0"])?;
            ip(&["-n", &ns, "link", "set", "eth0", "up"])?;
        }
        Ok(())
    }

    /// Starts `program args` on node `i`, its stdout and stderr into `log`.
    pub fn start(&self, i: usize, program: &Path, args: &[String], log: &Path) -> Child {
        self.command(i, program, args, log).spawn().unwrap()
    }

    /// The command that runs `program args` on node `i` (`ip netns exec`, which becomes the
    /// program), its stdout and stderr into `log`.
    pub fn command(&self, i: usize, program: &Path, args: &[String], log: &Path) -> Command {
        let out = File::create(log).unwrap();
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.ns(i)])
            .arg(program)
            .args(args)
            .env_remove("RANK")
            .env_remove("SLURM_PROCID")
            .stdin(Stdio::null())
            .stdout(out.try_clone().unwrap())
            .stderr(out);
        c
    }

    /// Kills every process of node `i` at once (SIGKILL), as if the machine died.
    pub fn kill(&self, i: usize) {
        let out = Command::new("ip")
            .args(["netns", "pids", &self.ns(i)])
            .output()
            .unwrap();
        for pid in String::from_utf8_lossy(&out.stdout).split_whitespace() {
            let _ = Command::new("kill").args(["-9", pid]).status();
        }
    }

    /// Sets node `i`'s link down (or up): its processes live on, cut off from the others.
    pub fn link(&self, i: usize, up: bool) {
        ip(&[
            "-n",
            &self.ns(i),
            "link",
            "set",
            "eth0",
            if up { "up" } else { "down" },
        ])
        .unwrap();
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        for i in 0..self.nodes {
            self.kill(i);
        }
        for i in 0..self.nodes {
            let _ = ip(&["netns", "del", &self.ns(i)]);
        }
        let _ = ip(&["netns", "del", &self.switch()]);
    }
}

pub use crate::spawned::{finish, wait_for, wait_for_files};

/// A fresh scratch directory for the test `name`.
pub fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("burn-ddp-mn-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The classifier's arguments: small, `--resume` (a restarted round resumes), a digest at the end.
fn classifier_args(out: &Path, epochs: u32) -> Vec<String> {
    let mut args = crate::spawned::classifier_args(out, epochs, 768, 64);
    args.push("--resume".into());
    args
}

/// The strings of `args`.
pub fn strings(args: &[&str]) -> Vec<String> {
    args.iter().map(|s| s.to_string()).collect()
}

/// The launcher arguments of node `node` of an elastic job on `net`, then the classifier's.
fn elastic_args(net: &Net, example: &str, node: &str, out: &Path, epochs: u32) -> Vec<String> {
    let mut args = strings(&[
        "run",
        "--nnodes",
        "1:2",
        "--nproc-per-node",
        "1",
        "--max-restarts",
        "3",
        "--rdzv-join-window",
        "2",
        "--node-timeout",
        "3",
        "--master-port",
        "29500",
        "--rdzv-id",
        "elastic-test",
        "--node-id",
        node,
        "--master-addr",
    ]);
    args.push(net.addr(0));
    args.push("--".into());
    args.push(crate::spawned::example(example).display().to_string());
    args.extend(classifier_args(out, epochs));
    // The elastic hook: the learning rate follows the world size.
    args.push("--scale-lr".into());
    args
}

/// `env` then the launcher: the environment every node's launcher gets.
pub fn env_launcher(args: Vec<String>) -> (PathBuf, Vec<String>) {
    env_with(&crate::spawned::launcher(), args)
}

/// `env` then `launcher`: the environment every node's launcher gets.
pub fn env_with(launcher: &Path, args: Vec<String>) -> (PathBuf, Vec<String>) {
    let mut all = strings(&[
        "RUST_LOG=burn_ddp=info",
        // Failure detection, not the collective deadline, must bound every wait.
        "BURN_DDP_TIMEOUT=10m",
        "BURN_DDP_HEARTBEAT_TIMEOUT=3s",
    ]);
    all.push(launcher.display().to_string());
    all.extend(args);
    (PathBuf::from("/usr/bin/env"), all)
}

/// An elastic job of nodes a and b (`--nnodes 1:2`), started, with round 0 formed by both.
pub struct ElasticPair {
    pub net: Net,
    pub dir: PathBuf,
    pub out: PathBuf,
    pub a: std::process::Child,
    pub b: std::process::Child,
    pub log_a: PathBuf,
    pub log_b: PathBuf,
    /// Node b's launcher command, to start it again.
    pub b_cmd: (PathBuf, Vec<String>),
}

impl ElasticPair {
    /// The classifier example `example` on both nodes, round 0 formed.
    pub fn start(example: &str, name: &str, epochs: u32) -> Self {
        let net = Net::new(2);
        let dir = scratch(name);
        let out = dir.join("out");
        let (log_a, log_b) = (dir.join("a.log"), dir.join("b.log"));
        let (prog, args) = env_launcher(elastic_args(&net, example, "a", &out, epochs));
        let a = net.start(0, &prog, &args, &log_a);
        let b_cmd = env_launcher(elastic_args(&net, example, "b", &out, epochs));
        let b = net.start(1, &b_cmd.0, &b_cmd.1, &log_b);
        wait_for(
            &log_a,
            "round 0: 2 node(s) [a, b]",
            Duration::from_secs(120),
        );
        Self {
            net,
            dir,
            out,
            a,
            b,
            log_a,
            log_b,
            b_cmd,
        }
    }

    /// Waits until node a's rank resumed from epoch 1's checkpoint, and says how long after
    /// node b was lost (`how`) at `since`.
    pub fn resumed_alone_after(&self, since: Instant, how: &str) {
        let resumed = wait_for(
            &self.log_a,
            "[rank 0] resumed from the checkpoint of epoch 1",
            Duration::from_secs(60),
        );
        eprintln!(
            "node b {how}: node a's rank resumed alone {:.1?} later",
            resumed - since
        );
    }

    /// The three records of the checkpoint of `epoch`.
    pub fn checkpoint(&self, epoch: u32) -> Vec<PathBuf> {
        ["model", "optim", "scheduler"]
            .iter()
            .map(|p| self.out.join(format!("checkpoint/{p}-{epoch}.bin")))
            .collect()
    }
}

/// `--nnodes 1:2`; node b's link goes down (its processes live on, cut off): node a's
/// rendezvous finds node b's launcher silent, and node a finishes alone from the newest
/// checkpoint. Node b ends non-zero within a bound, saying it lost the rendezvous.
pub fn elastic_job_drops_a_node_whose_link_goes_down(example: &str) {
    let mut job = ElasticPair::start(example, &format!("cut-{example}"), 3);
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

/// The launcher arguments of node `node` (of 3, one rank each) of a fault-tolerant job on `net`
/// (node 0 serves the job's store), then the classifier `example`'s; `join`: this node joins the
/// running job.
fn fault_tolerant_args(
    example: &str,
    net: &Net,
    node: usize,
    out: &Path,
    join: bool,
) -> Vec<String> {
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
    args.push(crate::spawned::example(example).display().to_string());
    // Node 2 is cut off a moment into the first epoch, ends once it has lost the store, and
    // is started again to join: the job must still be training then.
    let classifier = crate::spawned::classifier_args(out, 3, 1536, 128);
    args.extend(crate::spawned::paced(
        classifier,
        2 * crate::spawned::FAULT_PACE,
    ));
    args
}

/// A fault-tolerant job on three nodes (network namespaces, one rank each). Node 2's link goes
/// down mid-epoch (its processes live on, cut off): within the heartbeat bound nodes 0 and 1
/// agree on a membership without it and go on from the step they were at, no restart. Node 2
/// ends non-zero, saying it is cut off. Its link back up, a new launcher on node 2 joins the
/// running job (`--join`) at a step boundary and takes a survivor's state; the three ranks of
/// the last membership end with the same parameters.
pub fn fault_tolerant_job_survives_a_node_cut_off_and_takes_a_node_back(example: &str) {
    let net = Net::new(3);
    let dir = scratch(&format!("ft-cut-{example}"));
    let out = dir.join("out");
    let logs: Vec<PathBuf> = (0..3).map(|i| dir.join(format!("node{i}.log"))).collect();
    let mut nodes: Vec<std::process::Child> = (0..3)
        .map(|i| {
            let (prog, args) = env_launcher(fault_tolerant_args(example, &net, i, &out, false));
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
    assert!(text2.contains("has lost the job's store"), "{text2}");
    assert!(text2.contains("cannot reach the job's store"), "{text2}");
    eprintln!("node 2, cut off, ended {ended:?} after its link went down");
    if std::env::var_os("BURN_DDP_TEST_SHOW").is_some() {
        eprintln!("{text2}");
    }

    net.link(2, true);
    let log_join = dir.join("node2-join.log");
    let (prog, args) = env_launcher(fault_tolerant_args(example, &net, 2, &out, true));
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
    let d0 = crate::spawned::digest(&text0, 0);
    assert_eq!(
        d0,
        crate::spawned::digest(&text1, 1),
        "nodes 0 and 1 differ"
    );
    assert_eq!(
        d0,
        crate::spawned::digest(&text_j, 2),
        "the node that joined differs"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// `--nnodes 1:2` on two nodes. Node b is killed whole (launcher and rank) once the checkpoint
/// of epoch 1 is complete: node a goes on alone (world size 1) from that checkpoint and writes
/// the next one. Then node b is started again: it asks to join, the job restarts with both at
/// the next round, resumes from the newest checkpoint, and finishes; both ranks end with the
/// same parameters. Every launcher logs each round: who left, who joined, the world size.
pub fn elastic_job_loses_a_killed_node_and_takes_it_back(example: &str) {
    let mut job = ElasticPair::start(example, &format!("killed-{example}"), 5);
    wait_for_files(&job.checkpoint(1), Duration::from_secs(300));

    job.net.kill(1);
    let killed = Instant::now();
    let _ = job.b.wait();
    job.resumed_alone_after(killed, "killed");
    let text = std::fs::read_to_string(&job.log_a).unwrap();
    assert!(
        text.contains("node b was lost") || text.contains("round 0 failed on node a"),
        "{text}"
    );
    assert!(
        text.contains("round 1: 1 node(s) [a], world size 1 (was 2); left: [b]; joined: []"),
        "{text}"
    );
    assert!(
        text.contains("learning rate 1.00e-3: 2.00e-3 scaled by world size 1 / 2"),
        "{text}"
    );
    // Rank 0's dashboard (its progress lines here) shows the new round.
    wait_for(
        &job.log_a,
        "World size 1 | Membership round 1: world size 1 (was 2), from the checkpoint of epoch 1",
        Duration::from_secs(120),
    );
    // Node a alone makes progress: the next checkpoint.
    wait_for_files(&job.checkpoint(2), Duration::from_secs(300));

    let log_b2 = job.dir.join("b2.log");
    let mut b2 = job.net.start(1, &job.b_cmd.0, &job.b_cmd.1, &log_b2);
    let (ok_b2, text_b2) = finish(&mut b2, &log_b2, Duration::from_secs(300));
    let (ok_a, text_a) = finish(&mut job.a, &job.log_a, Duration::from_secs(300));
    assert!(ok_a, "node a:\n{text_a}");
    assert!(ok_b2, "restarted node b:\n{text_b2}");
    assert!(
        text_b2.contains("node b asks to join the running job"),
        "{text_b2}"
    );
    assert!(
        text_a.contains("a node asks to join and the job has 1 of at most 2 nodes"),
        "{text_a}"
    );
    assert!(
        text_a.contains("2 node(s) [a, b], world size 2 (was 1); left: []; joined: [b]"),
        "{text_a}"
    );
    assert!(
        text_a.contains(
            "World size 2 | Membership round 2: world size 2 (was 1), from the checkpoint"
        ),
        "{text_a}"
    );
    // The last round resumed from a checkpoint written while node a was alone.
    let last_resume = text_a
        .lines()
        .rev()
        .find_map(|l| l.split("resumed from the checkpoint of epoch ").nth(1))
        .unwrap()
        .trim()
        .parse::<u32>()
        .unwrap();
    assert!(last_resume >= 2, "{text_a}");
    assert!(text_a.contains("final test accuracy"), "{text_a}");
    assert_eq!(
        crate::spawned::digest(&text_a, 0),
        crate::spawned::digest(&text_b2, 1)
    );
    let _ = std::fs::remove_dir_all(&job.dir);
}

/// Two nodes, one rank each, `MASTER_ADDR` on the first node's link, running the classifier
/// example `example` (every line has one) under the launcher: the job trains to the same
/// parameters as 2 ranks on one machine (`--nproc 2`, loopback), bit for bit. The scenario
/// every line passes.
pub fn two_nodes_train_like_one_machine(example: &str) {
    use crate::spawned::{classifier_args, digest};
    let net = Net::new(2);
    let dir = std::env::temp_dir().join(format!("burn-ddp-mn-{example}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let program = crate::spawned::example(example);
    let job_args = |out: &Path| {
        let mut args = classifier_args(out, 2, 768, 64);
        args.push("--resume".into());
        args
    };
    let mut nodes = Vec::new();
    for i in 0..2 {
        let mut args: Vec<String> = Vec::new();
        args.extend(
            [
                "run",
                "--nnodes",
                "2",
                "--nproc-per-node",
                "1",
                "--rdzv-id",
                "fixed-test",
                "--master-port",
                "29500",
            ]
            .iter()
            .map(|s| s.to_string()),
        );
        args.extend(["--node-rank".into(), i.to_string()]);
        args.extend(["--master-addr".into(), net.addr(0)]);
        args.push("--".into());
        args.push(program.display().to_string());
        args.extend(job_args(&dir.join("out")));
        let log = dir.join(format!("node{i}.log"));
        let (env, args) = env_launcher(args);
        nodes.push((net.start(i, &env, &args, &log), log));
    }
    let logs: Vec<String> = nodes
        .iter_mut()
        .map(|(child, log)| {
            let (ok, text) = finish(child, log, std::time::Duration::from_secs(300));
            assert!(ok, "{}:\n{text}", log.display());
            text
        })
        .collect();
    let store = format!("store {}:29500", net.addr(0));
    assert!(
        logs[0].contains(&store) && logs[1].contains(&store),
        "the ranks did not meet at {store}:\n{}\n{}",
        logs[0],
        logs[1]
    );
    let (d0, d1) = (digest(&logs[0], 0), digest(&logs[1], 1));
    assert_eq!(d0, d1);

    // The same job on one machine.
    let local = Command::new(&program)
        .args(["--nproc", "2"])
        .args(job_args(&dir.join("local")))
        .env_remove("RANK")
        .env_remove("SLURM_PROCID")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&local.stdout);
    assert!(local.status.success(), "{text}");
    assert_eq!(digest(&text, 0), d0, "two nodes and one machine differ");
    let _ = std::fs::remove_dir_all(&dir);
}
