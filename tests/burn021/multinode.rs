//! Multi-node jobs for real: each node a Linux network namespace with its own address on a
//! virtual link (`burn-ddp-dev/src/netns.rs`), the launcher and the classifier example in each, so that
//! `MASTER_ADDR` is not loopback, the ranks pick the interface that reaches it, the job token
//! crosses the link, and a node can be killed or cut off whole.
//!
//! - a fixed 2-node job trains exactly as 2 ranks on one machine;
//! - an elastic job (`--nnodes 1:2`) loses a killed node, goes on alone from the newest
//!   checkpoint, takes the restarted node back at the next round, and finishes;
//! - an elastic job loses a node whose link goes down and finishes without it; the cut-off
//!   node ends with an error saying it lost the rendezvous, no hang;
//! - a fault-tolerant job survives a node cut off and takes a node back.
//!
//! The scenarios are burn-ddp-dev's (`netns.rs`), run by every line on its classifier.

use crate::common;

use common::netns;

/// Two nodes, one rank each, `MASTER_ADDR` on the first node's link: the job trains to the
/// same parameters as 2 ranks on one machine (`--nproc 2`, loopback), bit for bit (the
/// scenario every line's classifier passes, `burn_ddp_dev::netns`).
#[test]
fn two_nodes_on_a_virtual_link_train_exactly_like_one_machine() {
    netns::two_nodes_train_like_one_machine("classifier");
}

/// `--nnodes 1:2` on two nodes: node b killed whole, node a goes on alone from the newest
/// checkpoint, node b started again is taken back at the next round (the scenario every line's
/// classifier passes, `burn_ddp_dev::netns`).
#[test]
fn elastic_job_loses_a_killed_node_goes_on_and_takes_it_back() {
    netns::elastic_job_loses_a_killed_node_and_takes_it_back("classifier");
}

/// `--nnodes 1:2`; node b's link goes down: node a finishes alone (the scenario every line's
/// classifier passes, `burn_ddp_dev::netns`).
#[test]
fn elastic_job_drops_a_node_whose_link_goes_down() {
    netns::elastic_job_drops_a_node_whose_link_goes_down("classifier");
}

/// A fault-tolerant job on three nodes; node 2's link goes down mid-epoch and a new launcher
/// on node 2 joins back (the scenario every line's classifier passes, `burn_ddp_dev::netns`).
#[test]
fn a_fault_tolerant_job_survives_a_node_cut_off_and_takes_a_node_back() {
    netns::fault_tolerant_job_survives_a_node_cut_off_and_takes_a_node_back("classifier");
}
