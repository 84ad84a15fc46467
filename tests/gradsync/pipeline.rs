//! The pipeline example (`examples/pipeline/`) through the launcher.

/// The example: 2 stages x 2 replicas in 4 processes through `burn-ddp run`; the loss falls.
#[test]
fn the_example_trains_two_stages_by_two_replicas_through_the_launcher() {
    burn_ddp_dev::spawned::pipeline_example_trains_two_stages_by_two_replicas();
}
