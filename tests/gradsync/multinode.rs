//! Multi-node jobs for real on Burn 0.22.1 or 0.23: each node a Linux network namespace with
//! its own address on a virtual link (`burn_ddp_dev::netns`), the launcher and the
//! release's classifier example in each (fixed; elastic with `--scale-lr`, losing a killed node and
//! a node whose link goes down; fault-tolerant, surviving a node cut off), so that
//! `MASTER_ADDR` is not loopback and the ranks meet across the link: the scenarios of
//! `burn_ddp_dev::netns`, which the 0.21 line's classifier passes too. Needs root and
//! iproute2's `ip` (the test fails, saying so, without them).

use crate::CLASSIFIER as EXAMPLE;

/// Two nodes, one rank each: the job trains to the same parameters as 2 ranks on one machine,
/// bit for bit (the scenario the 0.21 line's classifier passes in `tests/burn021/multinode.rs`).
#[test]
fn two_nodes_on_a_virtual_link_train_exactly_like_one_machine() {
    burn_ddp_dev::netns::two_nodes_train_like_one_machine(EXAMPLE);
}

/// `--nnodes 1:2` on two nodes: node b killed whole once the checkpoint of epoch 1 is complete,
/// node a goes on alone (world size 1, the learning rate scaled by `--scale-lr`) from that
/// checkpoint, node b started again is taken back at the next round, and both ranks end with
/// the same parameters (the scenario the 0.21 line's classifier passes).
#[test]
fn elastic_job_loses_a_killed_node_goes_on_and_takes_it_back() {
    burn_ddp_dev::netns::elastic_job_loses_a_killed_node_and_takes_it_back(EXAMPLE);
}

/// `--nnodes 1:2`; node b's link goes down: node a finishes alone, node b says it lost the
/// rendezvous.
#[test]
fn elastic_job_drops_a_node_whose_link_goes_down() {
    burn_ddp_dev::netns::elastic_job_drops_a_node_whose_link_goes_down(EXAMPLE);
}

/// A fault-tolerant job on three nodes; node 2's link goes down mid-epoch, the other two go on
/// without a restart, and a new launcher on node 2 joins back and takes their state.
#[test]
fn a_fault_tolerant_job_survives_a_node_cut_off_and_takes_a_node_back() {
    burn_ddp_dev::netns::fault_tolerant_job_survives_a_node_cut_off_and_takes_a_node_back(EXAMPLE);
}
