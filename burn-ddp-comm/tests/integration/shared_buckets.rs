//! Host-staged gradient buckets in memory shared by the ranks of one host (Note [Shared
//! buckets] in `src/grad/shared.rs`), in real processes: the same bits as heap buckets, the
//! arena really mapped, and a rank killed mid-reduction named by every survivor.

use std::time::Duration;

use burn_ddp_comm::grad::{BucketOrder, BucketPlan, DdpConfig, GradReduction, HostSync, ParamInfo};
use burn_ddp_comm::{ProcessGroup, Rank};
use burn_ddp_dev::procs::{self, TestJob};

/// Parameter sizes: a bucket above the segment's 1 MiB chunk (parts cut per chunk), unequal
/// parts, and small buckets.
const SIZES: [usize; 6] = [3, 1001, 300_000, 17, 70_000, 5];

fn plan(config: &DdpConfig) -> BucketPlan<usize> {
    let params = SIZES
        .iter()
        .enumerate()
        .map(|(i, &n)| (ParamInfo::new(format!("p{i}"), vec![n], "F32"), i))
        .collect();
    BucketPlan::build(params, config, BucketOrder::Forward)
}

/// Values of every magnitude and sign, so that the order of summation shows in the last bits.
fn values(rank: u32, slot: usize, step: usize) -> Vec<f32> {
    let mut state = 0x9e37_79b9_7f4a_7c15u64 ^ (u64::from(rank) << 40) ^ ((slot as u64) << 20);
    state ^= step as u64 + 1;
    (0..SIZES[slot])
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            ((state % 17) as f32 - 8.0) * 10f32.powi(((state >> 8) % 12) as i32 - 6)
        })
        .collect()
}

/// Bytes of the group's shared memory file mapped by this process.
fn shared_bytes() -> usize {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    maps.lines()
        .filter(|l| l.ends_with("memfd:burn-ddp (deleted)"))
        .map(|l| {
            let (range, _) = l.split_once(' ').unwrap();
            let (a, b) = range.split_once('-').unwrap();
            usize::from_str_radix(b, 16).unwrap() - usize::from_str_radix(a, 16).unwrap()
        })
        .sum()
}

/// Reduced gradients of one step, by slot.
type Step = Vec<Option<Vec<f32>>>;

/// Three synchronised steps under `config`: each step's reduced gradients, and the bytes of
/// shared memory mapped during the last. Parameter 3 has a gradient on rank 1 only, parameter 5
/// on none; gradients come in backward's order.
fn steps(pg: &ProcessGroup, config: &DdpConfig) -> (Vec<Step>, usize) {
    let r = pg.rank().0;
    let plan = plan(config);
    let mut sync = HostSync::start(pg, config).unwrap();
    let mut mapped = 0;
    let out = (0..3)
        .map(|step| {
            let mut s = sync.begin(&plan).unwrap();
            mapped = shared_bytes();
            for slot in (0..SIZES.len()).rev() {
                let have = slot != 5 && (slot != 3 || r == 1);
                let v = values(r, slot, step);
                s.push(slot, have.then_some(v.as_slice()));
            }
            let mut red = s.finish().unwrap();
            (0..SIZES.len()).map(|i| red.take(i)).collect()
        })
        .collect();
    (out, mapped)
}

fn bits(steps: &[Step]) -> Vec<u32> {
    steps
        .iter()
        .flatten()
        .flatten()
        .flatten()
        .map(|v| v.to_bits())
        .collect()
}

#[test]
fn shared_buckets_reduce_in_place_with_the_bits_of_heap_buckets() {
    const NAME: &str = "shared_buckets_reduce_in_place_with_the_bits_of_heap_buckets";
    if let Some(pg) = procs::child_group(NAME) {
        assert_eq!(pg.transport(), "shm");
        let world = pg.world_size().as_usize();
        let floats: usize = SIZES.iter().sum();
        for reduction in [GradReduction::Mean, GradReduction::Sum] {
            let config = DdpConfig::default()
                .with_bucket_cap_mb(2.0)
                .with_reduction(reduction)
                .with_shared_buckets(true);
            let before = shared_bytes();
            let (heap, mapped) = steps(&pg, &config.clone().with_shared_buckets(false));
            assert_eq!(mapped, before, "heap buckets map nothing shared");
            let (shared, mapped) = steps(&pg, &config);
            let grown = mapped - before;
            assert!(
                grown >= world * 4 * floats,
                "{reduction:?}: {grown} bytes of shared buckets mapped, for {world} ranks of \
                 {floats} f32"
            );
            let (heap_bits, shared_bits) = (bits(&heap), bits(&shared));
            assert_eq!(heap_bits.len(), shared_bits.len());
            if let Some(i) = heap_bits.iter().zip(&shared_bits).position(|(a, b)| a != b) {
                panic!("{reduction:?}: value {i} differs from the heap buckets'");
            }
            // What the reduction means: parameter 3 from rank 1 alone, 5 from nobody.
            let last = &shared[2];
            assert_eq!(last[5], None);
            let want: Vec<f32> = values(1, 3, 2)
                .iter()
                .map(|v| match reduction {
                    GradReduction::Mean => v / world as f32,
                    GradReduction::Sum => *v,
                })
                .collect();
            assert_eq!(last[3].as_deref(), Some(want.as_slice()));
            // The same bits on every rank.
            let digest = shared_bits.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
                (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
            });
            let mut all = vec![0i64; world];
            pg.all_gather(&[digest as i64], &mut all).unwrap();
            assert!(all.iter().all(|&d| d == all[0]), "{all:?}");
        }
        return;
    }
    TestJob::new(3, NAME).run().assert_all_ok();
}

/// Rank 2 dies (SIGKILL) while every rank reduces 16 MiB buckets in shared memory: every
/// survivor's step fails naming rank 2 and the shared all-reduce it stopped, within the bounds
/// of the TCP tests.
#[test]
fn rank_killed_mid_shared_bucket_reduction_is_named_by_every_survivor() {
    const NAME: &str = "rank_killed_mid_shared_bucket_reduction_is_named_by_every_survivor";
    if let Some(pg) = procs::child_group(NAME) {
        assert_eq!(pg.transport(), "shm");
        let config = DdpConfig::default().with_shared_buckets(true);
        let params = (0..4)
            .map(|i| (ParamInfo::new(format!("w{i}"), vec![4 << 20], "F32"), i))
            .collect();
        let plan = BucketPlan::build(params, &config, BucketOrder::Forward);
        let mut sync = HostSync::start(&pg, &config).unwrap();
        let grad = vec![1.0f32; 4 << 20];
        if pg.rank() == Rank(2) {
            procs::kill_self_after(Duration::from_millis(1500));
        }
        let err = loop {
            let step = sync.begin(&plan).and_then(|mut s| {
                for slot in 0..4 {
                    s.push(slot, Some(&grad));
                }
                s.finish().map(drop)
            });
            if let Err(e) = step {
                break e;
            }
        };
        procs::assert_names(&pg, &err, Rank(2), "all_reduce_shared #");
        return;
    }
    procs::assert_killed_rank_named_fast(3, NAME, 2);
}
