//! The NCCL communicator on a real GPU, at world size 1 (one GPU holds one NCCL rank): every
//! collective on every element type, compared with the host transport's result on the same
//! values. Built and run by `scripts/gpu-check.sh` (`--features cuda`); on a machine without a
//! GPU these tests fail, naming what is missing.
#![cfg(feature = "cuda")]

// This package is `burn-ddp-burn021`; users reach it as `burn_ddp` (the `burn-ddp` crate with
// feature `burn-0-21`), and so does this program.
extern crate burn_ddp_burn021 as burn_ddp;

use burn_ddp::cuda::cudarc::driver::{CudaSlice, DeviceRepr};
use burn_ddp::cuda::NcclComm;
use burn_ddp::{Element, ProcessGroup, Rank, ReduceOp};
use half::{bf16, f16};

fn comm() -> (ProcessGroup, NcclComm) {
    let pg = ProcessGroup::single();
    let comm = NcclComm::new(&pg).unwrap_or_else(|e| panic!("no NCCL communicator: {e}"));
    (pg, comm)
}

fn upload<T: DeviceRepr + Clone>(comm: &NcclComm, v: &[T]) -> CudaSlice<T> {
    comm.stream().clone_htod(v).expect("host to device copy")
}

fn download<T: DeviceRepr + Clone + Default>(comm: &NcclComm, d: &CudaSlice<T>) -> Vec<T> {
    comm.stream().clone_dtoh(d).expect("device to host copy")
}

/// Runs all four collectives on `values` with NCCL and with the host transport, and compares.
fn check<T>(pg: &ProcessGroup, comm: &NcclComm, values: Vec<T>, ops: &[ReduceOp])
where
    T: Element + DeviceRepr + Clone + Default + PartialEq + std::fmt::Debug,
{
    let dtype = T::DTYPE;
    for &op in ops {
        let mut d = upload(comm, &values);
        comm.all_reduce(&mut d, op).unwrap();
        let mut host = values.clone();
        pg.all_reduce(&mut host, op).unwrap();
        assert_eq!(download(comm, &d), host, "all_reduce {op} {dtype}");

        let d_send = upload(comm, &values);
        let mut d_recv = upload(comm, &vec![T::default(); values.len()]);
        comm.reduce_scatter(&d_send, &mut d_recv, op).unwrap();
        let mut host = vec![T::default(); values.len()];
        pg.reduce_scatter(&values, &mut host, op).unwrap();
        assert_eq!(download(comm, &d_recv), host, "reduce_scatter {op} {dtype}");
    }
    let mut d = upload(comm, &values);
    comm.broadcast(&mut d, Rank(0)).unwrap();
    assert_eq!(download(comm, &d), values, "broadcast {dtype}");

    let d_send = upload(comm, &values);
    let mut d_recv = upload(comm, &vec![T::default(); values.len()]);
    comm.all_gather(&d_send, &mut d_recv).unwrap();
    let mut host = vec![T::default(); values.len()];
    pg.all_gather(&values, &mut host).unwrap();
    assert_eq!(download(comm, &d_recv), host, "all_gather {dtype}");
}

const ALL: [ReduceOp; 4] = [ReduceOp::Sum, ReduceOp::Mean, ReduceOp::Max, ReduceOp::Min];
const INTEGER: [ReduceOp; 3] = [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min];
const N: usize = 1 << 20;

#[test]
fn nccl_world_size_1_every_collective_and_dtype_matches_the_host() {
    let (pg, comm) = comm();
    println!("{comm:?}");
    check(
        &pg,
        &comm,
        (0..N).map(|i| i as f32 * 0.5 - 7.0).collect(),
        &ALL,
    );
    check(&pg, &comm, (0..N).map(|i| i as f64 * 0.25).collect(), &ALL);
    check(
        &pg,
        &comm,
        (0..N).map(|i| f16::from_f32((i % 2048) as f32)).collect(),
        &ALL,
    );
    check(
        &pg,
        &comm,
        (0..N).map(|i| bf16::from_f32((i % 256) as f32)).collect(),
        &ALL,
    );
    check(
        &pg,
        &comm,
        (0..N).map(|i| i as i32 - 1000).collect(),
        &INTEGER,
    );
    check(
        &pg,
        &comm,
        (0..N).map(|i| (i as i64) << 20).collect(),
        &INTEGER,
    );
    check(
        &pg,
        &comm,
        (0..N).map(|i| (i % 251) as u8).collect(),
        &INTEGER,
    );
}

#[test]
fn mean_of_integers_is_refused_with_advice() {
    let (_pg, comm) = comm();
    let mut d = upload(&comm, &[1i32, 2, 3]);
    let e = comm.all_reduce(&mut d, ReduceOp::Mean).unwrap_err();
    assert!(e.to_string().contains("ReduceOp::Sum"), "{e}");
}

#[test]
fn wrong_buffer_lengths_are_errors() {
    let (_pg, comm) = comm();
    let send = upload(&comm, &[1.0f32; 8]);
    let mut recv = upload(&comm, &[0.0f32; 4]);
    let e = comm.all_gather(&send, &mut recv).unwrap_err();
    assert!(e.to_string().contains("recv"), "{e}");
}

#[test]
fn communicators_are_created_warmed_up_and_finalized_again_and_again() {
    // Non-blocking creation polled to completion, a warm-up all-reduce, and the finalize on drop
    // (each must end well inside its deadline, or the communicator would be aborted instead).
    let pg = ProcessGroup::single();
    for round in 0..3 {
        let started = std::time::Instant::now();
        let comm = NcclComm::new(&pg).unwrap_or_else(|e| panic!("round {round}: {e}"));
        comm.warm_up()
            .unwrap_or_else(|e| panic!("round {round}: warm-up: {e}"));
        drop(comm);
        println!(
            "round {round}: created, warmed up and finalized in {:?}",
            started.elapsed()
        );
    }
}

#[test]
fn a_gpu_other_than_the_ranks_own_is_refused_naming_both() {
    let pg = ProcessGroup::single();
    let count = burn_ddp::cuda::device_count(pg.rank()).expect("device count");
    // One visible GPU: ordinal 0 is this rank's whatever LOCAL_RANK says; ordinal `count` is
    // another (or none), and must be refused before NCCL ever sees it.
    let e = NcclComm::on_device(&pg, count).unwrap_err();
    println!("{e}");
    assert!(e.to_string().contains("GPU"), "{e}");
    let device = burn_ddp::cuda::rank_device(&pg).expect("rank device");
    assert_eq!(device.index, 0);
}

#[test]
fn a_subgroup_gets_its_own_communicator_and_point_to_point_refuses_itself() {
    let pg = ProcessGroup::single();
    let sub = pg
        .split(Some(0))
        .unwrap()
        .expect("the only rank is in its color's group");
    let comm = NcclComm::new(&sub).unwrap_or_else(|e| panic!("no NCCL communicator: {e}"));
    let mut d = upload(&comm, &[1.5f32, 2.5]);
    comm.all_reduce(&mut d, ReduceOp::Sum).unwrap();
    assert_eq!(download(&comm, &d), [1.5, 2.5]);
    let e = comm.send(&d, Rank(0)).unwrap_err();
    assert!(e.to_string().contains("is this rank"), "{e}");
}
