//! Multi-node jobs for real on the Burn 0.22.1 line: each node a Linux network namespace with
//! its own address on a virtual link (`burn_ddp_dev::netns`), the launcher and the
//! `classifier022` example in each (fixed, and elastic with `--scale-lr`), so that
//! `MASTER_ADDR` is not loopback and the ranks meet across the link. Needs root and iproute2's
//! `ip` (the test fails, saying so, without them).

/// Two nodes, one rank each: the job trains to the same parameters as 2 ranks on one machine,
/// bit for bit (the scenario the 0.21 line's classifier passes in `tests/multinode.rs`).
#[test]
fn two_nodes_on_a_virtual_link_train_exactly_like_one_machine() {
    burn_ddp_dev::netns::two_nodes_train_like_one_machine("classifier022");
}

/// `--nnodes 1:2` on two nodes: node b killed whole once the checkpoint of epoch 1 is complete,
/// node a goes on alone (world size 1, the learning rate scaled by `--scale-lr`) from that
/// checkpoint, node b started again is taken back at the next round, and both ranks end with
/// the same parameters (the scenario the 0.21 line's classifier passes).
#[test]
fn elastic_job_loses_a_killed_node_goes_on_and_takes_it_back() {
    burn_ddp_dev::netns::elastic_job_loses_a_killed_node_and_takes_it_back("classifier022");
}
