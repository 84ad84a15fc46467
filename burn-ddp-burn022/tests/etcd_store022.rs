//! The store of a fault-tolerant job on a real etcd cluster, on the Burn 0.22 line: as
//! `burn-ddp/tests/etcd_store.rs`, with `classifier022`. Needs the `etcd` feature, root and
//! Debian's `etcd-server`: `cargo test --workspace --features
//! burn-ddp/etcd,burn-ddp-burn022/etcd,burn-ddp-burn023/etcd --test etcd_store022` (.ci/run
//! runs it).

const EXAMPLE: &str = "classifier022";

include!("shared/etcd_store.rs");
