//! The pipeline example (`examples/pipeline.rs`) through the launcher.

use std::time::Duration;

use crate::common;

/// The example: 2 stages x 2 replicas in 4 processes through `burn-ddp run`; the loss falls.
#[test]
fn the_example_trains_two_stages_by_two_replicas_through_the_launcher() {
    let mut cmd = std::process::Command::new(common::spawned::launcher());
    cmd.args(["run", "--standalone", "--nproc-per-node", "4", "--"])
        .arg(common::spawned::example("pipeline"))
        .args(["--epochs", "3", "--train-size", "512", "--batch-size", "32"])
        .env_remove("RANK")
        .env_remove("SLURM_PROCID");
    let run = common::spawned::Spawned::start(&mut cmd, Duration::from_secs(600)).finish();
    let stdout = String::from_utf8_lossy(&run.stdout);
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(run.status.success(), "stdout:\n{stdout}\nstderr:\n{stderr}");
    assert!(
        stdout.contains("4 ranks = 2 stages x 2 replicas, 1f1b with 4 micro-batches"),
        "{stdout}"
    );
    let losses: Vec<f64> = stdout
        .lines()
        .filter_map(|l| l.split("loss ").nth(1)?.split(',').next()?.parse().ok())
        .collect();
    assert_eq!(
        losses.len(),
        3,
        "one line per epoch from one rank:\n{stdout}"
    );
    assert!(
        losses[2] < losses[0],
        "the loss must fall: {losses:?}\n{stdout}"
    );
}
