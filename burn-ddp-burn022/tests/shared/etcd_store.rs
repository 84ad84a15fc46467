// The `etcd_store` tests of the Burn lines that share burn-ddp-burn022's sources, included by each
// line's `tests/etcd_storeNNN.rs` with the name of its classifier example as `EXAMPLE` (an included
// file has no inner docs; its tests keep their names, which the multi-process harness runs by).

#[test]
fn losing_the_node_of_rank_0_and_an_etcd_member_mid_epoch_is_survived() {
    burn_ddp_dev::etcd::node_loss_scenario(
        EXAMPLE,
        concat!("etcd-node-loss-", env!("CARGO_PKG_NAME")),
    );
}

/// The chaos run on etcd, as `burn-ddp/tests/etcd_store.rs`, with the classifier example.
#[test]
fn a_chaos_schedule_with_link_cuts_and_node_losses_on_etcd_is_survived() {
    burn_ddp_dev::fault::chaos_schedule_on_etcd(EXAMPLE, 10);
}
