//! Multi-node jobs for real on the Burn 0.23 line: each node a Linux network namespace with
//! its own address on a virtual link (`burn_ddp_dev::netns`), the launcher and the
//! `classifier023` example in each (fixed; elastic with `--scale-lr`, losing a killed node and
//! a node whose link goes down; fault-tolerant, surviving a node cut off), so that
//! `MASTER_ADDR` is not loopback and the ranks meet across the link: the scenarios of
//! `burn_ddp_dev::netns`, which the 0.21 line's classifier passes too. Needs root and
//! iproute2's `ip` (the test fails, saying so, without them).
//!
//! The tests are burn-ddp-burn022's (`tests/shared/multinode.rs` there), compiled against this line.

const EXAMPLE: &str = "classifier023";

include!("../../../burn-ddp-burn022/tests/shared/multinode.rs");
