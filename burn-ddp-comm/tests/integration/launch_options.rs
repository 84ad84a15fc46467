//! The launcher's elastic and fault-tolerant options as a user can misuse them: refused before
//! anything starts, naming the option; too few nodes end the job at the rendezvous timeout
//! saying how many came (no hang).

use std::process::Command;
use std::time::{Duration, Instant};

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
        // Nothing serves this port: a joining launcher tries for --rdzv-timeout (not a fixed
        // 60 s: the case is bounded below), and says so.
        (
            &[
                "--fault-tolerant",
                "--join",
                "--rdzv-timeout",
                "1",
                "--master-port",
                &port,
            ],
            "--rdzv-timeout sets how long to try",
        ),
        (&["--rdzv-backend", "etcd"], "--fault-tolerant"),
        (
            &["--fault-tolerant", "--rdzv-backend", "etcd"],
            "needs --rdzv-endpoint",
        ),
        (
            &["--fault-tolerant", "--rdzv-endpoint", "10.0.0.1:2379"],
            "add --rdzv-backend etcd",
        ),
        (
            &[
                "--fault-tolerant",
                "--rdzv-backend",
                "etcd",
                "--rdzv-endpoint",
                "10.0.0.1",
            ],
            "host:port each",
        ),
        (&["--etcd-ca", "ca.pem"], "--rdzv-endpoint"),
        (
            &[
                "--fault-tolerant",
                "--rdzv-backend",
                "etcd",
                "--rdzv-endpoint",
                "https://10.0.0.1:2379",
            ],
            "give the CA certificate",
        ),
        (
            &[
                "--fault-tolerant",
                "--rdzv-backend",
                "etcd",
                "--rdzv-endpoint",
                "10.0.0.1:2379",
                "--etcd-ca",
                "ca.pem",
            ],
            "give its endpoints as https://host:port",
        ),
        (
            &[
                "--fault-tolerant",
                "--rdzv-backend",
                "etcd",
                "--rdzv-endpoint",
                "https://10.0.0.1:2379",
                "--etcd-ca",
                "ca.pem",
                "--etcd-cert",
                "me.pem",
            ],
            "give both --etcd-cert and --etcd-key",
        ),
        // Nobody listens at the endpoint: a launcher built with `etcd` tries for
        // --rdzv-timeout and names the cluster; one built without says how to build it.
        (
            &[
                "--fault-tolerant",
                "--rdzv-backend",
                "etcd",
                "--rdzv-timeout",
                "2",
                "--rdzv-endpoint",
                &format!("127.0.0.1:{port}"),
            ],
            "etcd",
        ),
    ];
    for (args, expected) in cases {
        let started = Instant::now();
        let out = Command::new(burn_ddp_dev::spawned::launcher())
            .arg("run")
            .args(*args)
            .args(["--", "true"])
            .env_remove("BURN_DDP_JOB_TOKEN")
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} succeeded");
        assert!(stderr.contains(expected), "{args:?}: {stderr}");
        if args.contains(&"--rdzv-timeout") && args.contains(&"etcd") {
            assert!(
                stderr.contains("--rdzv-endpoint lists their client endpoints")
                    || stderr.contains("needs a launcher built with etcd support"),
                "{args:?}: {stderr}"
            );
        }
        assert!(started.elapsed() < Duration::from_secs(30), "{args:?}");
    }
}
