//! Multi-node jobs for real on the Burn 0.22.1 line: each node a Linux network namespace with
//! its own address on a virtual link (`burn_ddp_dev::netns`), the launcher and the
//! `classifier022` example in each (fixed; elastic with `--scale-lr`, losing a killed node and
//! a node whose link goes down; fault-tolerant, surviving a node cut off), so that
//! `MASTER_ADDR` is not loopback and the ranks meet across the link: the scenarios of
//! `burn_ddp_dev::netns`, which the 0.21 line's classifier passes too. Needs root and
//! iproute2's `ip` (the test fails, saying so, without them).

const EXAMPLE: &str = "classifier022";

include!("../shared/multinode.rs");
