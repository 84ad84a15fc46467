//! Every collective, every element type, every reduce operation, sizes 0, 1, odd and 64 MiB,
//! in real processes (world sizes 1 to 5) over shared memory (the default on one host) and over
//! TCP (the ring, recursive doubling, and both chosen by size), checked against references
//! computed in the test.

use burn_ddp_comm::{Element, ProcessGroup, Rank, ReduceOp};
use burn_ddp_dev::procs::{self, TestJob};
use half::{bf16, f16};

/// Test element: built from small integers so that every reduction order gives exact results.
trait TestElem: Element + PartialEq + std::fmt::Debug + Copy {
    fn from_i64(v: i64) -> Self;
    /// The mean of a sum of `w` values, rounded the way the transport does.
    fn mean(sum: i64, w: u32) -> Self;
}

macro_rules! float_elem {
    ($($t:ty => $from:expr),*) => {$(
        impl TestElem for $t {
            fn from_i64(v: i64) -> Self { ($from)(v as f64) }
            fn mean(sum: i64, w: u32) -> Self { ($from)((sum as f32 / w as f32) as f64) }
        }
    )*};
}
float_elem!(
    f32 => |v: f64| v as f32,
    f16 => |v: f64| f16::from_f64(v),
    bf16 => |v: f64| bf16::from_f64(v)
);

impl TestElem for f64 {
    fn from_i64(v: i64) -> Self {
        v as f64
    }
    fn mean(sum: i64, w: u32) -> Self {
        sum as f64 / w as f64
    }
}

macro_rules! int_elem {
    ($($t:ty),*) => {$(
        impl TestElem for $t {
            fn from_i64(v: i64) -> Self { v as $t }
            fn mean(sum: i64, w: u32) -> Self { (sum / w as i64) as $t }
        }
    )*};
}
int_elem!(i32, i64);

/// The pattern repeats every `PERIOD` elements, so fills and references are table lookups.
const PERIOD: usize = 11;

/// What rank `r` contributes at index `i`: small integers in [-5, 5].
fn pattern(r: u32, i: usize) -> i64 {
    ((r as i64 * 7 + (i % PERIOD) as i64 * 3) % 11) - 5
}

fn fill<T: TestElem>(r: u32, n: usize) -> Vec<T> {
    let table: Vec<T> = (0..PERIOD).map(|i| T::from_i64(pattern(r, i))).collect();
    repeat(&table, n)
}

/// `table` repeated to `n` elements (built by doubling: no per-element arithmetic).
fn repeat<T: Copy>(table: &[T], n: usize) -> Vec<T> {
    let mut v = Vec::with_capacity(n);
    v.extend_from_slice(&table[..table.len().min(n)]);
    while v.len() < n {
        let take = v.len().min(n - v.len());
        v.extend_from_within(..take);
    }
    v
}

/// The reduction of every rank's pattern at each index of one period.
fn expected_table<T: TestElem>(op: ReduceOp, world: u32) -> Vec<T> {
    (0..PERIOD)
        .map(|i| {
            let values = (0..world).map(|r| pattern(r, i));
            match op {
                ReduceOp::Sum => T::from_i64(values.sum()),
                ReduceOp::Mean => T::mean(values.sum(), world),
                ReduceOp::Max => T::from_i64(values.max().unwrap()),
                ReduceOp::Min => T::from_i64(values.min().unwrap()),
            }
        })
        .collect()
}

/// Checks `got[i] == table[(i + offset) % PERIOD]`.
fn check<T: TestElem>(what: &str, got: &[T], table: &[T], offset: usize) {
    let rotated: Vec<T> = (0..PERIOD).map(|i| table[(i + offset) % PERIOD]).collect();
    let want = repeat(&rotated, got.len().min(PERIOD << 12));
    let mismatch = got
        .chunks(want.len().max(1))
        .enumerate()
        .find(|(_, c)| *c != &want[..c.len()])
        .map(|(k, c)| k * want.len() + c.iter().zip(&want).position(|(a, b)| a != b).unwrap_or(0));
    if let Some(i) = mismatch {
        panic!(
            "{what} ({} x {:?}): element {i} is {:?}, expected {:?}",
            got.len(),
            T::DTYPE,
            got[i],
            table[(i + offset) % PERIOD]
        );
    }
}

const BIG: usize = 64 << 20;

fn sizes<T>() -> Vec<usize> {
    vec![0, 1, 7, 1001, BIG / std::mem::size_of::<T>()]
}

fn collectives<T: TestElem>(pg: &ProcessGroup) {
    let r = pg.rank().0;
    let w = pg.world_size().get();
    let name = format!("{:?}", T::DTYPE);
    for n in sizes::<T>() {
        let big = n * std::mem::size_of::<T>() >= BIG;
        let ops: &[ReduceOp] = if big {
            &[ReduceOp::Sum]
        } else {
            &[ReduceOp::Sum, ReduceOp::Mean, ReduceOp::Max, ReduceOp::Min]
        };
        for &op in ops {
            let mut buf = fill::<T>(r, n);
            pg.all_reduce(&mut buf, op).unwrap();
            check(
                &format!("{name} all_reduce {op}"),
                &buf,
                &expected_table(op, w),
                0,
            );
        }

        let root = Rank(w - 1);
        let mut buf = fill::<T>(r, n);
        pg.broadcast(&mut buf, root).unwrap();
        check(
            &format!("{name} broadcast"),
            &buf,
            &fill::<T>(root.0, PERIOD),
            0,
        );

        let send = fill::<T>(r, n);
        let mut recv = vec![T::from_i64(0); n * w as usize];
        pg.all_gather(&send, &mut recv).unwrap();
        for (from, block) in recv.chunks(n.max(1)).enumerate() {
            check(
                &format!("{name} all_gather block {from}"),
                block,
                &fill::<T>(from as u32, PERIOD),
                0,
            );
        }

        // Reduce-scatter: each rank receives a block of n / w (rounded down) elements.
        let block = n / w as usize;
        for &op in ops {
            let send = fill::<T>(r, block * w as usize);
            let mut recv = vec![T::from_i64(0); block];
            pg.reduce_scatter(&send, &mut recv, op).unwrap();
            check(
                &format!("{name} reduce_scatter {op}"),
                &recv,
                &expected_table(op, w),
                r as usize * block,
            );
        }
    }
    pg.barrier().unwrap();
}

/// Sums whose order shows in the last bits (values of every magnitude, signs mixed), maxima
/// over NaN and ±0: every rank must end with the same bytes, whichever algorithm ran, at sizes
/// on both sides of the threshold between recursive doubling and the ring.
fn identical_on_every_rank(pg: &ProcessGroup) {
    let r = pg.rank().0;
    let w = pg.world_size().as_usize();
    for n in [1usize, 999, 5_000, 40_000] {
        let mut state = 0x9e37_79b9_7f4a_7c15u64 ^ (u64::from(r) << 32) ^ n as u64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let values: Vec<f32> = (0..n)
            .map(|i| match next() % 16 {
                0 if i % 3 == 0 => f32::NAN,
                1 => -0.0,
                2 => 0.0,
                k => (k as f32 - 8.0) * 10f32.powi((next() % 12) as i32 - 6),
            })
            .collect();
        for op in [ReduceOp::Sum, ReduceOp::Mean, ReduceOp::Max, ReduceOp::Min] {
            let mut mine = values.clone();
            if op == ReduceOp::Sum || op == ReduceOp::Mean {
                mine.iter_mut()
                    .filter(|x| x.is_nan())
                    .for_each(|x| *x = 1.5);
            }
            pg.all_reduce(&mut mine, op).unwrap();
            let mut all = vec![0f32; n * w];
            pg.all_gather(&mine, &mut all).unwrap();
            for (k, theirs) in all.chunks(n).enumerate() {
                let same = theirs
                    .iter()
                    .zip(&mine)
                    .position(|(a, b)| a.to_bits() != b.to_bits());
                if let Some(i) = same {
                    panic!(
                        "{op} of {n} f32: rank {k} has {:?} at {i}, rank {r} {:?}",
                        theirs[i], mine[i]
                    );
                }
            }
        }
    }
}

fn all_types(pg: ProcessGroup) {
    identical_on_every_rank(&pg);
    collectives::<f32>(&pg);
    collectives::<f64>(&pg);
    collectives::<f16>(&pg);
    collectives::<bf16>(&pg);
    collectives::<i32>(&pg);
    collectives::<i64>(&pg);
    // Mismatched lengths are reported locally, before anything is sent.
    let mut small = vec![0f32; 3];
    let err = pg.all_gather(&[1f32; 2], &mut small).unwrap_err();
    assert!(err.to_string().contains("expected"), "{err}");
    let err = pg.broadcast(&mut small, Rank(99)).unwrap_err();
    assert!(err.to_string().contains("root"), "{err}");
    // The group is still usable after those local errors.
    pg.barrier().unwrap();
}

#[test]
fn collectives_world_1() {
    // No network at all: a world of one.
    all_types(ProcessGroup::single());
}

/// Runs `all_types` in `world` processes with `env` (each rank checks that its group moves
/// collectives over `transport`).
fn job(world: u32, name: &str, transport: &str, env: &[(&str, &str)]) {
    if let Some(pg) = procs::child_group(name) {
        assert_eq!(pg.transport(), transport);
        return all_types(pg);
    }
    env.iter()
        .fold(TestJob::new(world, name), |job, (k, v)| job.env(k, v))
        .run()
        .assert_all_ok();
}

/// Ranks of one host share memory unless told otherwise.
#[test]
fn collectives_world_2() {
    job(2, "collectives_world_2", "shm", &[]);
}

#[test]
fn collectives_world_3() {
    job(3, "collectives_world_3", "shm", &[]);
}

#[test]
fn collectives_world_4() {
    job(4, "collectives_world_4", "shm", &[]);
}

#[test]
fn collectives_world_2_over_tcp() {
    job(
        2,
        "collectives_world_2_over_tcp",
        "tcp",
        &[("BURN_DDP_TRANSPORT", "tcp")],
    );
}

#[test]
fn collectives_world_4_over_tcp() {
    job(
        4,
        "collectives_world_4_over_tcp",
        "tcp",
        &[("BURN_DDP_TRANSPORT", "tcp")],
    );
}

/// Every collective on the ring alone (`BURN_DDP_ALGO=ring`: no links for recursive doubling).
#[test]
fn collectives_world_3_on_the_ring() {
    let env = [("BURN_DDP_TRANSPORT", "tcp"), ("BURN_DDP_ALGO", "ring")];
    job(3, "collectives_world_3_on_the_ring", "tcp", &env);
}

/// Every all-reduce, broadcast, all-gather and barrier by recursive doubling, 64 MiB included
/// (`BURN_DDP_ALGO=tree`), in a world that is not a power of two (ranks 0 and 1 fold, then 4
/// exchange).
#[test]
fn collectives_world_5_by_recursive_doubling() {
    let env = [("BURN_DDP_TRANSPORT", "tcp"), ("BURN_DDP_ALGO", "tree")];
    job(5, "collectives_world_5_by_recursive_doubling", "tcp", &env);
}

/// Shared memory asked for by every rank, in a world that is not a power of two.
#[test]
fn collectives_world_5_in_shared_memory() {
    let env = [("BURN_DDP_TRANSPORT", "shm")];
    job(5, "collectives_world_5_in_shared_memory", "shm", &env);
}

/// Ranks that chose different transports are all refused at start, with the variable to set.
#[test]
fn ranks_with_different_transports_are_refused_with_the_fix() {
    const NAME: &str = "ranks_with_different_transports_are_refused_with_the_fix";
    if procs::is_child(NAME) {
        let err = ProcessGroup::from_env().unwrap_err().to_string();
        assert!(err.contains("BURN_DDP_TRANSPORT"), "{err}");
        assert!(err.contains("tcp") && err.contains("shm"), "{err}");
        return;
    }
    TestJob::new(3, NAME)
        .env("BURN_DDP_TRANSPORT", "shm")
        .rank_env(2, "BURN_DDP_TRANSPORT", "tcp")
        .env("BURN_DDP_RENDEZVOUS_TIMEOUT", "60")
        .run()
        .assert_all_ok();
}

/// Ranks that chose different algorithms would wait on different links: every rank is refused
/// at start, with the variable to set.
#[test]
fn ranks_with_different_algorithms_are_refused_with_the_fix() {
    const NAME: &str = "ranks_with_different_algorithms_are_refused_with_the_fix";
    if procs::is_child(NAME) {
        let err = ProcessGroup::from_env().unwrap_err().to_string();
        assert!(
            err.contains("algorithm") && err.contains("BURN_DDP_ALGO"),
            "{err}"
        );
        assert!(err.contains("ring") && err.contains("tree"), "{err}");
        return;
    }
    TestJob::new(3, NAME)
        .env("BURN_DDP_ALGO", "tree")
        .rank_env(1, "BURN_DDP_ALGO", "ring")
        .env("BURN_DDP_RENDEZVOUS_TIMEOUT", "60")
        .run()
        .assert_all_ok();
}

#[test]
fn collectives_between_threads() {
    use std::time::Duration;
    let groups = ProcessGroup::local(
        burn_ddp_comm::WorldSize::new(3).unwrap(),
        burn_ddp_comm::Timeouts::uniform(Duration::from_secs(60)),
    );
    let handles: Vec<_> = groups
        .into_iter()
        .map(|pg| std::thread::spawn(move || all_types(pg)))
        .collect();
    for h in handles {
        h.join().unwrap();
    }
}

/// `on_main`: rank 0 alone prepares (slowly), and no rank goes on before it has.
fn prepared_by_rank_0(pg: ProcessGroup) {
    let port = std::env::var("MASTER_PORT").unwrap();
    let dir = std::env::temp_dir().join(format!("burn-ddp-on-main-{port}"));
    let made = pg
        .on_main(|| {
            std::thread::sleep(std::time::Duration::from_millis(500));
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(dir.join("by"), pg.rank().0.to_string()).unwrap();
            7
        })
        .unwrap();
    assert_eq!(made, pg.is_main().then_some(7));
    assert_eq!(std::fs::read_to_string(dir.join("by")).unwrap(), "0");
    pg.barrier().unwrap();
    if pg.is_main() {
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

#[test]
fn on_main_runs_on_rank_0_alone_and_every_rank_waits_for_it() {
    procs::multi_process(
        3,
        "on_main_runs_on_rank_0_alone_and_every_rank_waits_for_it",
        prepared_by_rank_0,
    );
}

#[test]
fn a_global_batch_is_split_evenly_or_refused_with_the_sizes_that_split() {
    use burn_ddp_comm::data::per_rank_batch;
    use burn_ddp_comm::{ConfigError, DdpError, WorldSize};
    let w = |n| WorldSize::new(n).unwrap();
    assert_eq!(per_rank_batch(256, w(1)).unwrap(), 256);
    assert_eq!(per_rank_batch(256, w(8)).unwrap(), 32);
    assert_eq!(ProcessGroup::single().per_rank_batch(64).unwrap(), 64);
    for (global, world, nearest) in [
        (100, 3, "99 or 102"),
        (2, 4, "at least 4"),
        (0, 2, "at least 2"),
    ] {
        let e = per_rank_batch(global, w(world)).unwrap_err();
        assert!(
            matches!(e, DdpError::Config(ConfigError::UnevenGlobalBatch { .. })),
            "{e:?}"
        );
        let text = e.to_string();
        assert!(text.contains(&format!("{global} items")), "{text}");
        assert!(text.contains(nearest), "{text}");
    }
}
