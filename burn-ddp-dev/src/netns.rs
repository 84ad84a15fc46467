//! Several "nodes" on one machine: Linux network namespaces, each with its own address on a
//! virtual link to a bridge (a switch namespace of its own), created by the test and removed
//! when it ends. A node's processes see only their namespace's network: `MASTER_ADDR` is not
//! loopback, and cutting a node's link (or killing every process in it) acts on that node only.
//!
//! Needs root and iproute2's `ip`. Where namespaces cannot be made, [`Net::new`] panics saying
//! why: such a test fails, it never passes without having run.

use std::fs::File;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};

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
        let out = File::create(log).unwrap();
        Command::new("ip")
            .args(["netns", "exec", &self.ns(i)])
            .arg(program)
            .args(args)
            .env_remove("RANK")
            .env_remove("SLURM_PROCID")
            .stdin(Stdio::null())
            .stdout(out.try_clone().unwrap())
            .stderr(out)
            .spawn()
            .unwrap()
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

/// Two nodes, one rank each, `MASTER_ADDR` on the first node's link, running the classifier
/// example `example` (every line has one) under the launcher: the job trains to the same
/// parameters as 2 ranks on one machine (`--nproc 2`, loopback), bit for bit. The scenario
/// every line passes.
pub fn two_nodes_train_like_one_machine(example: &str) {
    use crate::spawned::{classifier_args, digest, launcher};
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
        let mut args: Vec<String> = [
            "RUST_LOG=burn_ddp=info",
            // Failure detection, not the collective deadline, must bound every wait.
            "BURN_DDP_TIMEOUT=10m",
            "BURN_DDP_HEARTBEAT_TIMEOUT=3s",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        args.push(launcher().display().to_string());
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
        nodes.push((net.start(i, Path::new("/usr/bin/env"), &args, &log), log));
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
