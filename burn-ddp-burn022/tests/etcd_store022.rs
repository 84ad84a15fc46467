//! The store of a fault-tolerant job on a real etcd cluster, on the Burn 0.22 line: as
//! `burn-ddp/tests/etcd_store.rs`, with `classifier022`. Needs the `etcd` feature, root and
//! Debian's `etcd-server`: `cargo test --workspace --features
//! burn-ddp/etcd,burn-ddp-burn022/etcd --test etcd_store022` (.ci/run runs it).

#[test]
fn losing_the_node_of_rank_0_and_an_etcd_member_mid_epoch_is_survived() {
    burn_ddp_dev::etcd::node_loss_scenario("classifier022", "etcd-node-loss-022");
}

/// The chaos run on etcd, as `burn-ddp/tests/etcd_store.rs`, with `classifier022`.
#[test]
fn a_chaos_schedule_with_link_cuts_and_node_losses_on_etcd_is_survived() {
    burn_ddp_dev::fault::chaos_schedule_on_etcd("classifier022", 10);
}
