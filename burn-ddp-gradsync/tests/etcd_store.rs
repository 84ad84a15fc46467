//! The store of a fault-tolerant job on a real etcd cluster, on Burn 0.22 or 0.23: as
//! `burn-ddp-burn021/tests/etcd_store.rs`, with `classifier022` or `classifier023`. Needs the
//! `etcd` feature, root and Debian's `etcd-server`: `cargo test --workspace --features
//! burn-ddp-burn021/etcd,burn-ddp-gradsync/etcd --test etcd_store`, and for Burn 0.23 `cargo test
//! -p burn-ddp-gradsync --no-default-features --features burn-0-23,train,hold-systemstat,etcd
//! --test etcd_store` (.ci/run runs both).

#[cfg(feature = "burn-0-22")]
const EXAMPLE: &str = "classifier022";
#[cfg(feature = "burn-0-23")]
const EXAMPLE: &str = "classifier023";

#[test]
fn losing_the_node_of_rank_0_and_an_etcd_member_mid_epoch_is_survived() {
    burn_ddp_dev::etcd::node_loss_scenario(
        EXAMPLE,
        concat!("etcd-node-loss-", env!("CARGO_PKG_NAME")),
    );
}

/// The chaos run on etcd, as `burn-ddp-burn021/tests/etcd_store.rs`, with the classifier example.
#[test]
fn a_chaos_schedule_with_link_cuts_and_node_losses_on_etcd_is_survived() {
    burn_ddp_dev::fault::chaos_schedule_on_etcd(EXAMPLE, 10);
}
