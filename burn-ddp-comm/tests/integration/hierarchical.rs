//! Groups spread over two "hosts" (network namespaces, `burn_ddp_dev::netns`) with two ranks on
//! each: large all-reduces run in two levels, shared memory inside each host and a ring per local
//! index across hosts (Note [Hierarchical all-reduce] in `src/comm/tcp/shm/mod.rs`). Checked in
//! real processes against exact references and against the same job on the flat TCP ring, bit for
//! bit where the order of summation cannot show; a rank killed mid-all-reduce is named by every
//! survivor; layouts the hierarchy does not take fall back to TCP, or are refused under `shm`.
//!
//! Needs root (network namespaces), as the multi-node tests of the Burn lines do.

use std::collections::BTreeMap;

use burn_ddp_comm::{Element, ProcessGroup, Rank, ReduceOp};
use burn_ddp_dev::netns::Net;
use burn_ddp_dev::procs::{self, TestJob};
use half::{bf16, f16};

/// Rank `r`'s host in the jobs of two hosts: ranks 0 and 2 on node 0, 1 and 3 on node 1, so
/// that a rank's local index is not its rank modulo anything simple.
fn node_of(r: u32) -> usize {
    (r % 2) as usize
}

/// A 64-bit FNV-1a digest of `bytes`.
fn digest(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// What rank `r` contributes at index `i`: small integers, so that every order of summation
/// gives the same, exact result.
fn small(r: u32, i: usize) -> i64 {
    ((i64::from(r) * 7 + (i % 13) as i64 * 3) % 11) - 5
}

/// Values of every magnitude and both signs: their sums show the order of summation.
fn wild(r: u32, n: usize) -> Vec<f32> {
    let mut state = 0x9e37_79b9_7f4a_7c15u64 ^ (u64::from(r) << 32) ^ n as u64;
    (0..n)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            ((state % 17) as f32 - 8.0) * 10f32.powi((state >> 40) as i32 % 9 - 4)
        })
        .collect()
}

/// The element types the exact check runs on.
trait Exact: Element + Copy + PartialEq + std::fmt::Debug {
    fn of(v: f64) -> Self;
}

macro_rules! exact {
    ($($t:ty => $f:expr),*) => {$(impl Exact for $t { fn of(v: f64) -> Self { ($f)(v) } })*};
}
exact!(
    f32 => |v: f64| v as f32,
    f64 => |v: f64| v,
    f16 => f16::from_f64,
    bf16 => bf16::from_f64,
    i32 => |v: f64| v as i32,
    i64 => |v: f64| v as i64
);

/// Sizes on both sides of the threshold of recursive doubling (64 KiB), odd ones (parts of
/// unequal sizes), and one of 16 MiB of f32 (many chunks per part in the segment).
const SIZES: [usize; 6] = [0, 1, 1001, 16_411, 100_003, 4 << 20];

/// Every reduce operation on every size for `T`, checked against the exact result; prints a
/// digest of each result (the parent compares them between the jobs).
fn exact_sums<T: Exact>(pg: &ProcessGroup) {
    let (r, w) = (pg.rank().0, pg.world_size().get());
    for n in SIZES {
        for op in [ReduceOp::Sum, ReduceOp::Mean, ReduceOp::Max, ReduceOp::Min] {
            if n > 100_003 && op != ReduceOp::Sum {
                continue;
            }
            let mut buf: Vec<T> = (0..n).map(|i| T::of(small(r, i) as f64)).collect();
            pg.all_reduce(&mut buf, op).unwrap();
            for (i, got) in buf.iter().enumerate().step_by(97) {
                let all = (0..w).map(|q| small(q, i));
                let want = match op {
                    ReduceOp::Sum => all.sum::<i64>() as f64,
                    ReduceOp::Mean => all.sum::<i64>() as f64 / f64::from(w),
                    ReduceOp::Max => all.max().unwrap_or(0) as f64,
                    ReduceOp::Min => all.min().unwrap_or(0) as f64,
                };
                // The mean divides once, by the world, as the flat ring does.
                let sum = (0..w).map(|q| small(q, i)).sum::<i64>();
                let want = match (op, T::DTYPE.size()) {
                    (ReduceOp::Mean, _) if T::of(0.5) == T::of(0.0) => T::of(want.trunc()),
                    (ReduceOp::Mean, 8) => T::of(want),
                    // Narrower floats divide in f32.
                    (ReduceOp::Mean, _) => T::of(f64::from(sum as f32 / w as f32)),
                    _ => T::of(want),
                };
                assert_eq!(*got, want, "{:?} {op} of {n}: element {i}", T::DTYPE);
            }
            println!(
                "digest exact {:?} {op} {n}: {:016x}",
                T::DTYPE,
                digest(bytemuck::cast_slice(&buf))
            );
            // A flat collective between two-level ones: a peer may already send its bytes on
            // the flat links while this rank still waits in its host's segment.
            let mut token = [r as i32];
            pg.broadcast(&mut token, Rank(w - 1)).unwrap();
            assert_eq!(token[0], (w - 1) as i32);
        }
    }
}

/// Sums that show their order: identical bits on every rank and from one call to the next,
/// within rounding of the sum in f64.
fn wild_sums(pg: &ProcessGroup) {
    let (r, w) = (pg.rank().0, pg.world_size().as_usize());
    let n = 300_001;
    for op in [ReduceOp::Sum, ReduceOp::Mean] {
        let mut first = wild(r, n);
        pg.all_reduce(&mut first, op).unwrap();
        let mut again = wild(r, n);
        pg.all_reduce(&mut again, op).unwrap();
        assert!(
            first
                .iter()
                .zip(&again)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "{op}: two calls on the same values differ"
        );
        let mut all = vec![0f32; n * w];
        pg.all_gather(&first, &mut all).unwrap();
        for (q, theirs) in all.chunks(n).enumerate() {
            let at = theirs
                .iter()
                .zip(&first)
                .position(|(a, b)| a.to_bits() != b.to_bits());
            assert!(
                at.is_none(),
                "{op}: rank {q} differs from rank {r} at {at:?}"
            );
        }
        let inputs: Vec<Vec<f32>> = (0..w as u32).map(|q| wild(q, n)).collect();
        for i in (0..n).step_by(101) {
            let exact: f64 = inputs.iter().map(|v| f64::from(v[i])).sum();
            let scale: f64 = inputs.iter().map(|v| f64::from(v[i]).abs()).sum();
            let want = if op == ReduceOp::Mean {
                exact / w as f64
            } else {
                exact
            };
            let tol = 1e-6 * scale.max(1e-30);
            assert!(
                (f64::from(first[i]) - want).abs() <= tol,
                "{op} element {i}: {} against {want}",
                first[i]
            );
        }
        println!(
            "digest wild {op}: {:016x}",
            digest(bytemuck::cast_slice(&first))
        );
    }
}

/// The body of the comparison's two jobs.
fn two_levels_or_flat(transport: &str) {
    let pg = ProcessGroup::from_env().unwrap();
    assert_eq!(pg.transport(), transport);
    wild_sums(&pg);
    exact_sums::<f32>(&pg);
    exact_sums::<f64>(&pg);
    exact_sums::<f16>(&pg);
    exact_sums::<bf16>(&pg);
    exact_sums::<i32>(&pg);
    exact_sums::<i64>(&pg);
    pg.barrier().unwrap();
}

/// The digests rank 0 printed, by what they are of.
fn digests(out: &procs::Outcomes, kind: &str) -> BTreeMap<String, String> {
    out.rank(0)
        .output
        .lines()
        // The first line printed follows the test harness's "test ... " on its line.
        .filter_map(|l| Some(l.split_once(&format!("digest {kind} "))?.1))
        .filter_map(|l| l.rsplit_once(": "))
        .map(|(what, d)| (what.to_string(), d.to_string()))
        .collect()
}

/// Two hosts of two ranks: the same all-reduces over two levels and on the flat ring (TCP
/// forced) give the same bits wherever the order of summation cannot show (small integers, in
/// every type, every operation), and sums that show it are the same on every rank, from one
/// call to the next, and within rounding of the exact sum.
#[test]
fn all_reduce_in_two_levels_matches_the_flat_ring() {
    const NAME: &str = "all_reduce_in_two_levels_matches_the_flat_ring";
    if procs::is_child(NAME) {
        let forced = std::env::var("BURN_DDP_TRANSPORT").is_ok_and(|t| t == "tcp");
        return two_levels_or_flat(if forced { "tcp" } else { "shm+tcp" });
    }
    let net = Net::new(2);
    let run = |tcp: bool| {
        let started = std::time::Instant::now();
        let job = TestJob::new(4, NAME)
            .on_nodes(&net, node_of)
            .timeout(std::time::Duration::from_secs(600));
        let job = if tcp {
            job.env("BURN_DDP_TRANSPORT", "tcp")
        } else {
            job
        };
        let out = job.run();
        out.assert_all_ok();
        eprintln!(
            "{} took {:.1?}",
            if tcp { "the flat ring" } else { "two levels" },
            started.elapsed()
        );
        out
    };
    let two_levels = run(false);
    let flat = run(true);
    let (a, b) = (digests(&two_levels, "exact"), digests(&flat, "exact"));
    assert_eq!(a.len(), 6 * (5 * 4 + 1), "{a:?}");
    assert_eq!(a, b, "two levels and the flat ring differ");
    let (a, b) = (digests(&two_levels, "wild"), digests(&flat, "wild"));
    assert_eq!(a.len(), 2);
    eprintln!(
        "sums that show their order: the same bits on both ways? {}",
        if a == b {
            "yes"
        } else {
            "no (another order of summation)"
        }
    );
}

/// A rank killed in the middle of large two-level all-reduces (in its host's segment or on its
/// ring across hosts): every survivor, on its host and on the other, names it within the
/// heartbeat's bound, not the 10-minute deadline.
#[test]
fn rank_killed_mid_two_level_all_reduce_is_named_by_every_survivor() {
    const NAME: &str = "rank_killed_mid_two_level_all_reduce_is_named_by_every_survivor";
    if procs::is_child(NAME) {
        let pg = ProcessGroup::from_env().unwrap();
        assert_eq!(pg.transport(), "shm+tcp");
        if pg.rank() == Rank(3) {
            procs::kill_self_after(std::time::Duration::from_millis(500));
        }
        procs::all_reduces_fail_naming(&pg, 8 << 20, Rank(3));
        return;
    }
    let net = Net::new(2);
    procs::assert_killed_rank_named_fast_in(TestJob::new(4, NAME).on_nodes(&net, node_of), 3);
}

/// Point-to-point in the same job: between ranks of one host through a shared-memory pipe,
/// between hosts over TCP; every message arrives whole, in order.
#[test]
fn point_to_point_goes_through_shared_memory_inside_a_host_only() {
    const NAME: &str = "point_to_point_goes_through_shared_memory_inside_a_host_only";
    if procs::is_child(NAME) {
        let pg = ProcessGroup::from_env().unwrap();
        let (r, w) = (pg.rank().0, pg.world_size().get());
        let message = |from: u32, to: u32, k: usize| -> Vec<f32> {
            (0..100_000 + k)
                .map(|i| (from * 100 + to * 10) as f32 + i as f32)
                .collect()
        };
        for k in 0..3 {
            for to in (0..w).filter(|&q| q != r) {
                pg.send(&message(r, to, k), Rank(to), k as u32).unwrap();
            }
            for from in (0..w).filter(|&q| q != r) {
                let mut got = vec![0f32; 100_000 + k];
                pg.recv(&mut got, Rank(from), k as u32).unwrap();
                assert!(got == message(from, r, k), "message {k} from rank {from}");
            }
        }
        // One pipe to the other rank of this host and one from it, mapped by this process;
        // none with the other host.
        let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
        let pipes = maps
            .lines()
            .filter(|l| l.contains("memfd:burn-ddp-p2p"))
            .count();
        assert_eq!(pipes, 2, "{maps}");
        pg.barrier().unwrap();
        return;
    }
    let net = Net::new(2);
    TestJob::new(4, NAME)
        .on_nodes(&net, node_of)
        .run()
        .assert_all_ok();
}

/// Hosts with different numbers of ranks (two on one, one on the other): under `auto` the group
/// goes over TCP; under `shm` every rank is refused, told why.
#[test]
fn hosts_of_unequal_ranks_go_over_tcp_or_are_refused_under_shm() {
    const NAME: &str = "hosts_of_unequal_ranks_go_over_tcp_or_are_refused_under_shm";
    if procs::is_child(NAME) {
        if std::env::var("BURN_DDP_TRANSPORT").is_ok_and(|t| t == "shm") {
            let err = ProcessGroup::from_env().unwrap_err().to_string();
            assert!(err.contains("the same number"), "{err}");
            return;
        }
        let pg = ProcessGroup::from_env().unwrap();
        assert_eq!(pg.transport(), "tcp");
        let mut buf = vec![1i64; 100_000];
        pg.all_reduce(&mut buf, ReduceOp::Sum).unwrap();
        assert!(buf.iter().all(|&v| v == 3));
        return;
    }
    let net = Net::new(2);
    let nodes = |r: u32| usize::from(r == 2);
    TestJob::new(3, NAME)
        .on_nodes(&net, nodes)
        .run()
        .assert_all_ok();
    TestJob::new(3, NAME)
        .on_nodes(&net, nodes)
        .env("BURN_DDP_TRANSPORT", "shm")
        .env("BURN_DDP_RENDEZVOUS_TIMEOUT", "60")
        .run()
        .assert_all_ok();
}
