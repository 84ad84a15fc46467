//! The store of a fault-tolerant job on a real etcd cluster, on the Burn 0.23 line: as
//! `burn-ddp/tests/etcd_store.rs`, with `classifier023`. Needs the `etcd` feature, root and
//! Debian's `etcd-server`: `cargo test --workspace --features
//! burn-ddp/etcd,burn-ddp-burn022/etcd,burn-ddp-burn023/etcd --test etcd_store023` (.ci/run
//! runs it).
//!
//! The tests are burn-ddp-burn022's (`tests/shared/etcd_store.rs` there), compiled against this line.

const EXAMPLE: &str = "classifier023";

include!("../../burn-ddp-burn022/tests/shared/etcd_store.rs");
