//! The store of a fault-tolerant job on a real etcd cluster (three members, one per node of
//! three network namespaces): losing the node of rank 0, with its etcd member, mid-epoch does
//! not stop training (`burn-ddp-dev/src/etcd.rs`). Needs the `etcd` feature, root and Debian's
//! `etcd-server`: `cargo test --workspace --features
//! burn-ddp-burn021/etcd,burn-ddp-gradsync/etcd --test etcd_store` (.ci/run runs
//! it).

#[test]
fn losing_the_node_of_rank_0_and_an_etcd_member_mid_epoch_is_survived() {
    burn_ddp_dev::etcd::node_loss_scenario("classifier", "etcd-node-loss");
}

/// The chaos run on etcd (`burn_ddp_dev::chaos`), each of its eight kinds once (10 processes
/// or nodes hit): 3-node jobs of the classifier; a node's link cut past the heartbeat bound and
/// a node lost whole (its launcher, its rank and its etcd member) among the faults; every
/// invariant checked.
#[test]
fn a_chaos_schedule_with_link_cuts_and_node_losses_on_etcd_is_survived() {
    burn_ddp_dev::fault::chaos_schedule_on_etcd("classifier", 10);
}
