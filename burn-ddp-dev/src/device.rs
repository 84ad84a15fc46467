//! What both lines' device-transport tests share: the stand-in link's collective queue (a
//! bucket reduced over the host is done by the time its answer comes), thread ranks, the check
//! of reduced gradients against the host's mean, and what the usual step costs.

use std::time::Duration;

use burn_ddp_comm::grad::{DeviceCounts, Queue};
use burn_ddp_comm::{DdpError, ProcessGroup, Result, Timeouts, WorldSize};

/// The stand-in link's collective queue: a bucket is reduced (over the host, on the issuer
/// thread) by the time its answer comes, so there is nothing to wait for, stop or drain.
#[derive(Debug)]
pub struct ReducedQueue;

impl Queue for ReducedQueue {
    fn wait(&self) -> Result<()> {
        Ok(())
    }
    fn fail_with(&self, _e: &DdpError) {}
    fn drain(&self, _limit: Duration) -> bool {
        true
    }
}

/// Runs `rank` on `world` thread ranks of an in-process group; their results in rank order.
///
/// # Panics
/// A rank panicked (its panic is passed on).
pub fn on_thread_ranks<T: Send>(world: u32, rank: impl Fn(ProcessGroup) -> T + Sync) -> Vec<T> {
    let world = WorldSize::new(world).expect("a world of at least one rank");
    let groups = ProcessGroup::local(world, Timeouts::default());
    let rank = &rank;
    std::thread::scope(|s| {
        let ranks: Vec<_> = groups
            .into_iter()
            .map(|pg| s.spawn(move || rank(pg)))
            .collect();
        ranks
            .into_iter()
            .map(|r| r.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
            .collect()
    })
}

/// Asserts that every slot got a gradient and that each value is within `tolerance` (relative,
/// absolute below 1) of `want`'s.
///
/// # Panics
/// A slot without a gradient, or a value beyond the tolerance, named with its rank and slot.
pub fn assert_gradients(rank: usize, got: &[Option<Vec<f32>>], want: &[Vec<f32>], tolerance: f32) {
    assert_eq!(got.len(), want.len(), "rank {rank}: slots");
    for (slot, (got, want)) in got.iter().zip(want).enumerate() {
        let got = got
            .as_ref()
            .unwrap_or_else(|| panic!("rank {rank}: slot {slot} has no gradient"));
        assert_eq!(got.len(), want.len(), "rank {rank} slot {slot}: length");
        for (g, w) in got.iter().zip(want) {
            assert!(
                (g - w).abs() <= tolerance * w.abs().max(1.0),
                "rank {rank} slot {slot}: {g} vs {w}"
            );
        }
    }
}

/// What one step of `buckets` buckets costs when every gradient is here, f32, uncompressed,
/// once the flags of ones exist: one packing operation per bucket (the `cat`), none to unpack,
/// a hand-off each way per bucket, one wait for the queue, nothing read to the host.
pub fn usual_step(buckets: u64) -> DeviceCounts {
    DeviceCounts {
        passes: 1,
        buckets,
        pack_ops: buckets,
        unpack_ops: 0,
        host_reads: 0,
        queue_waits: 1,
        hand_offs: 2 * buckets,
        fusion_drains: 0,
        issuer_syncs: 0,
    }
}
