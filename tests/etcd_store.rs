//! The store of a fault-tolerant job on a real etcd cluster (three members, one per node of
//! three network namespaces), with the classifier example of the release the features choose:
//! losing the node of rank 0, with its etcd member, mid-epoch does not stop training
//! (`burn-ddp-dev/src/etcd.rs`). Needs the `etcd` feature, root and Debian's `etcd-server`:
//! `cargo test --features etcd --test etcd_store` (Burn 0.21), with `--no-default-features
//! --features burn-0-22,etcd` (or `burn-0-23`) for the other releases; .ci/run runs each.

/// The scenario's scratch directory, one per release.
#[cfg(feature = "burn-0-21")]
const NODE_LOSS: &str = "etcd-node-loss-021";
#[cfg(feature = "burn-0-22")]
const NODE_LOSS: &str = "etcd-node-loss-022";
#[cfg(feature = "burn-0-23")]
const NODE_LOSS: &str = "etcd-node-loss-023";

#[test]
fn losing_the_node_of_rank_0_and_an_etcd_member_mid_epoch_is_survived() {
    burn_ddp_dev::etcd::node_loss_scenario("classifier", NODE_LOSS);
}

/// The chaos run on etcd (`burn_ddp_dev::chaos`), each of its eight kinds once (10 processes
/// or nodes hit): 3-node jobs of the classifier; a node's link cut past the heartbeat bound and
/// a node lost whole (its launcher, its rank and its etcd member) among the faults; every
/// invariant checked.
#[test]
fn a_chaos_schedule_with_link_cuts_and_node_losses_on_etcd_is_survived() {
    burn_ddp_dev::fault_tolerance::chaos_schedule_on_etcd("classifier", 10);
}
