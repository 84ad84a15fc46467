//! Multi-node jobs for real on the Burn 0.22.1 line: each node a Linux network namespace with
//! its own address on a virtual link (`burn_ddp_dev::netns`), the launcher and the
//! `classifier022` example in each, so that `MASTER_ADDR` is not loopback and the ranks meet
//! across the link. Needs root and iproute2's `ip` (the test fails, saying so, without them).

/// Two nodes, one rank each: the job trains to the same parameters as 2 ranks on one machine,
/// bit for bit (the scenario the 0.21 line's classifier passes in `tests/multinode.rs`).
#[test]
fn two_nodes_on_a_virtual_link_train_exactly_like_one_machine() {
    burn_ddp_dev::netns::two_nodes_train_like_one_machine("classifier022");
}
