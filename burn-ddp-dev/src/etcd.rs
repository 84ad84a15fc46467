//! A real etcd cluster for tests (Debian's `etcd-server`): one member per node of a [`Net`],
//! started by the test and stopped by PID when dropped. Where `etcd` is not installed,
//! [`EtcdCluster::start`] panics saying how to install it: such a test fails, it never passes
//! without having run.

use std::fs::File;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::netns::Net;

/// The features the etcd scenarios build with over the whole workspace when no test run names
/// its own (`BURN_DDP_TEST_RUN`, which scripts/test.sh sets): Burn 0.21's examples with `etcd`.
pub const ETCD_FEATURES: &str =
    "burn-ddp-burn021/etcd,burn-ddp-gradsync/etcd,burn-ddp-workspace/etcd";

/// etcd's client port on each node.
pub const CLIENT_PORT: u16 = 2379;
const PEER_PORT: u16 = 2380;

/// An etcd cluster of one member per listed node of a [`Net`].
pub struct EtcdCluster {
    members: Vec<(usize, Child)>,
    addrs: Vec<String>,
    /// `--initial-cluster`: every member's name and peer URL.
    initial: String,
    etcd: PathBuf,
    dir: PathBuf,
}

impl EtcdCluster {
    /// Starts a member on each of `nodes` of `net` (data and logs under `dir`) and waits until
    /// every one accepts connections and the cluster has a leader (`etcdctl endpoint health`).
    pub fn start(net: &Net, nodes: &[usize], dir: &Path) -> Self {
        let etcd = which("etcd").unwrap_or_else(|| {
            panic!(
                "this test needs etcd (Debian: `apt-get install etcd-server etcd-client`; .ci/run \
                 installs them)"
            )
        });
        let initial: Vec<String> = nodes
            .iter()
            .map(|i| format!("{}=http://{}:{PEER_PORT}", member_name(*i), net.addr(*i)))
            .collect();
        let addrs = nodes
            .iter()
            .map(|i| format!("{}:{CLIENT_PORT}", net.addr(*i)))
            .collect();
        let mut c = Self {
            members: Vec::new(),
            addrs,
            initial: initial.join(","),
            etcd,
            dir: dir.to_owned(),
        };
        for &i in nodes {
            let data = dir.join(format!("etcd-{i}"));
            let _ = std::fs::remove_dir_all(&data);
            let child = c.spawn_member(net, i, "new");
            c.members.push((i, child));
        }
        c.wait_healthy(net, nodes[0], Duration::from_secs(60));
        c
    }

    /// Starts the member of node `i` (`state`: `new` for a new cluster, `existing` for a member
    /// that comes back with its data), its output appended to its log.
    fn spawn_member(&self, net: &Net, i: usize, state: &str) -> Child {
        let log = File::options()
            .create(true)
            .append(true)
            .open(self.dir.join(format!("etcd-{i}.log")))
            .unwrap();
        let a = net.addr(i);
        Command::new("ip")
            .args(["netns", "exec", &net.ns(i)])
            .arg(&self.etcd)
            .args(["--name", &member_name(i), "--data-dir"])
            .arg(self.dir.join(format!("etcd-{i}")))
            .args([
                "--listen-client-urls",
                &format!("http://{a}:{CLIENT_PORT}"),
                "--advertise-client-urls",
                &format!("http://{a}:{CLIENT_PORT}"),
                "--listen-peer-urls",
                &format!("http://{a}:{PEER_PORT}"),
                "--initial-advertise-peer-urls",
                &format!("http://{a}:{PEER_PORT}"),
                "--initial-cluster",
                &self.initial,
                "--initial-cluster-state",
                state,
                "--initial-cluster-token",
                &format!("burn-ddp-test-{}", std::process::id()),
            ])
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap()
    }

    /// Starts the member of node `node` again, with the data it had (after its node was killed):
    /// it catches up with the cluster's log.
    pub fn restart(&mut self, net: &Net, node: usize) {
        let child = self.spawn_member(net, node, "existing");
        match self.members.iter_mut().find(|(i, _)| *i == node) {
            Some((_, c)) => {
                let _ = c.kill();
                let _ = c.wait();
                *c = child;
            }
            None => self.members.push((node, child)),
        }
    }

    /// The client endpoints, `host:port,...` (`--rdzv-endpoint`).
    pub fn endpoints(&self) -> String {
        self.addrs.join(",")
    }

    fn wait_healthy(&self, net: &Net, from: usize, limit: Duration) {
        let until = Instant::now() + limit;
        let etcdctl = which("etcdctl");
        loop {
            let up = self.addrs.iter().all(|a| {
                let a: SocketAddr = a.parse().unwrap();
                // Reachable from the node's namespace only: ask from there.
                Command::new("ip")
                    .args(["netns", "exec", &net.ns(from)])
                    .args([
                        "bash",
                        "-c",
                        &format!("exec 3<>/dev/tcp/{}/{}", a.ip(), a.port()),
                    ])
                    .stderr(Stdio::null())
                    .status()
                    .is_ok_and(|s| s.success())
            });
            let healthy = up
                && etcdctl.as_ref().is_none_or(|ctl| {
                    Command::new("ip")
                        .args(["netns", "exec", &net.ns(from)])
                        .arg(ctl)
                        .args(["--endpoints", &self.endpoints(), "endpoint", "health"])
                        .env("ETCDCTL_API", "3")
                        .stdout(Stdio::null())
                        .stderr(Stdio::null())
                        .status()
                        .is_ok_and(|s| s.success())
                });
            if healthy {
                return;
            }
            if Instant::now() >= until {
                panic!(
                    "the etcd cluster {} was not healthy within {limit:?}; its logs are in {}",
                    self.endpoints(),
                    self.dir.display()
                );
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// Makes the member of node `node` the cluster's leader (`etcdctl move-leader`, asked from
    /// node `from`), so that losing it forces an election.
    pub fn make_leader(&self, net: &Net, node: usize, from: usize) {
        let ctl = which("etcdctl").expect("etcdctl (Debian: etcd-client) is not installed");
        let run = |args: &[&str]| {
            let out = Command::new("ip")
                .args(["netns", "exec", &net.ns(from)])
                .arg(&ctl)
                .args(["--endpoints", &self.endpoints()])
                .args(args)
                .env("ETCDCTL_API", "3")
                .output()
                .unwrap();
            assert!(
                out.status.success(),
                "etcdctl {args:?} failed: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            String::from_utf8_lossy(&out.stdout).into_owned()
        };
        // `member list`: "id, started, name, peer urls, client urls, learner" per member.
        let list = run(&["member", "list"]);
        let id = list
            .lines()
            .find(|l| l.split(", ").nth(2) == Some(&member_name(node)))
            .and_then(|l| l.split(", ").next())
            .unwrap_or_else(|| panic!("member m{node} is not in the cluster: {list}"))
            .to_owned();
        run(&["move-leader", &id]);
    }

    /// Whether member of node `node` still runs.
    pub fn running(&mut self, node: usize) -> bool {
        self.members
            .iter_mut()
            .find(|(i, _)| *i == node)
            .is_some_and(|(_, c)| matches!(c.try_wait(), Ok(None)))
    }
}

impl Drop for EtcdCluster {
    fn drop(&mut self) {
        for (_, c) in &mut self.members {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// The etcd member name of node `i`.
fn member_name(i: usize) -> String {
    format!("m{i}")
}

/// The path of `program` on `PATH`.
pub fn which(program: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|p| p.join(program))
            .find(|p| p.is_file())
    })
}

/// The `burn-ddp` launcher and the example `name`, built now with the `etcd` feature (`cargo
/// test --test X` builds no example; cargo does nothing when they are current). The example with
/// the selection and features of the run that built the tests ([`crate::spawned::test_run`];
/// without one, the whole workspace with [`ETCD_FEATURES`]), so that Burn is not built a second
/// time with another feature set; the launcher in the same cargo run when that selection holds
/// the core (a workspace run), because an example's build, as a test build, turns on the
/// dev-dependencies' features: a build of the launcher alone would resolve the core's
/// dependencies without them and compile the core again. A run of one release's packages
/// (`-p burn-ddp-workspace ...`) takes the launcher the workspace run before it built, or builds
/// the core's alone.
pub fn etcd_builds(name: &str) -> (PathBuf, PathBuf) {
    let profile_dir = crate::spawned::profile_dir();
    let launcher = profile_dir.join("burn-ddp");
    let run = crate::spawned::test_run(&["--workspace", "--features", ETCD_FEATURES]);
    let mut args: Vec<&str> = run.iter().map(String::as_str).collect();
    args.extend(["--example", name]);
    if run.iter().any(|a| a == "--workspace") {
        args.extend(["--bin", "burn-ddp"]);
    }
    crate::spawned::cargo_build(&args, &format!("the example {name} with etcd"));
    if !launcher.exists() {
        let core = [
            "-p",
            "burn-ddp-comm",
            "--features",
            "cli,etcd",
            "--bin",
            "burn-ddp",
        ];
        crate::spawned::cargo_build(&core, "the launcher with etcd");
    }
    (launcher, profile_dir.join("examples").join(name))
}

/// The scenario every line's classifier passes on the etcd store: a fault-tolerant job of three
/// nodes (network namespaces), one rank each, its store kept by a three-member etcd cluster
/// with one member on each node. Mid-epoch, node 0 dies whole: its launcher, rank 0 and the
/// etcd member that leads the cluster, all SIGKILLed at once. The two other nodes go on without a restart, end the
/// training with bit-identical replicas, and their launchers exit with success.
pub fn node_loss_scenario(example: &str, name: &str) {
    let net = Net::new(3);
    let dir = crate::netns::scratch(name);
    let cluster = EtcdCluster::start(&net, &[0, 1, 2], &dir);
    let (launcher, program) = etcd_builds(example);
    let mut children = Vec::new();
    let mut logs = Vec::new();
    for node in 0..3 {
        let out = dir.join(format!("out-{node}"));
        let mut args: Vec<String> = Vec::new();
        args.extend(
            [
                "run",
                "--nnodes",
                "3",
                "--node-rank",
                &node.to_string(),
                "--nproc-per-node",
                "1",
                "--fault-tolerant",
                "--min-ranks",
                "2",
                "--rdzv-backend",
                "etcd",
                "--rdzv-endpoint",
                &cluster.endpoints(),
                "--rdzv-id",
                &format!("{name}-{}", std::process::id()),
                "--rdzv-timeout",
                "120",
                "--",
            ]
            .iter()
            .map(|s| s.to_string()),
        );
        args.push(program.display().to_string());
        args.extend(crate::spawned::classifier_args(&out, 2, 3072, 96));
        let log = dir.join(format!("node-{node}.log"));
        let (env, args) = crate::netns::env_with(&launcher, args);
        children.push(net.start(node, &env, &args, &log));
        logs.push(log);
    }
    // Mid-epoch: training has begun, and then some steps more; the etcd member that dies with
    // node 0 leads the cluster then, so that its loss forces an election.
    crate::spawned::wait_for(
        &logs[0],
        "[train] epoch 1/2  items",
        Duration::from_secs(180),
    );
    cluster.make_leader(&net, 0, 1);
    std::thread::sleep(Duration::from_secs(1));
    net.kill(0);
    let killed = Instant::now();
    let mut cluster = cluster;
    while cluster.running(0) {
        assert!(
            killed.elapsed() < Duration::from_secs(10),
            "node 0's etcd member still runs 10 s after its node was killed"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut texts = Vec::new();
    for node in 1..3 {
        let (ok, text) =
            crate::spawned::finish(&mut children[node], &logs[node], Duration::from_secs(300));
        assert!(
            ok,
            "node {node}'s launcher failed after node 0 (rank 0 and an etcd member) was lost:\n{}",
            tail(&text)
        );
        texts.push(text);
    }
    let _ = children[0].wait();
    let all = texts.join("\n");
    assert!(
        all.contains("left: [m0]"),
        "no membership change without member 0:\n{}",
        tail(&all)
    );
    assert!(
        all.contains("[valid] epoch 2/2  items 96/96"),
        "the job did not finish its second epoch:\n{}",
        tail(&all)
    );
    let digests = crate::spawned::digests(&all);
    assert_eq!(
        digests.len(),
        2,
        "one digest per surviving rank: {digests:?}"
    );
    assert_eq!(
        digests[0].1, digests[1].1,
        "the surviving replicas differ: {digests:?}"
    );
    let change = all
        .lines()
        .find(|l| l.contains("the first step of membership epoch 1 is done"))
        .unwrap_or("(no first-step line)");
    println!(
        "node 0 (rank 0, an etcd member, its launcher) killed; the survivors ended {:.1?} later \
         with equal replicas ({}); {change}",
        killed.elapsed(),
        digests[0].1
    );
    let _ = std::fs::remove_dir_all(&dir);
}

fn tail(text: &str) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(40)..].join("\n")
}
