//! [`DeviceCounts`]: what the device transports' passes cost, counted where the work is issued,
//! so that a test without a GPU can say what a bucket costs on the NCCL path (the same code
//! runs over a CPU backend with a stand-in link) and the GPU check can print it beside the
//! step times.
//!
//! Counted: operations the gradient path asks Burn for that run device work (a `cat`, a cast,
//! a fill, an upload; views, reshapes of contiguous tensors and allocations of an empty tensor
//! run none and are not counted), transfers to the host, waits of the step's thread for the
//! collective queue, hand-offs between the step's thread and the issuer thread, and on the
//! issuer thread the fusion drains and device synchronisations it needs. What Burn's backend
//! does inside one operation (burn-cubecl implements `cat` as one `slice_assign` per part:
//! burn-backend 0.22.1 `src/backend/ops/tensor.rs`, `float_cat`, line 1425) is not visible
//! here.

use std::sync::atomic::{AtomicU64, Ordering};

/// Totals over the passes of one device transport (see the module documentation).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct DeviceCounts {
    /// Synchronised passes (steps).
    pub passes: u64,
    /// Buckets sent.
    pub buckets: u64,
    /// Burn operations that pack buckets (and make gradients f32 before that).
    pub pack_ops: u64,
    /// Burn operations that unpack reduced buckets into gradients.
    pub unpack_ops: u64,
    /// Transfers to the host on the step's thread (presence flags of absent gradients).
    pub host_reads: u64,
    /// Waits of the step's thread for the collective queue (NCCL's stream).
    pub queue_waits: u64,
    /// Jobs handed to the issuer thread, and its answers taken back.
    pub hand_offs: u64,
    /// Drains of Burn's fusion stream on the issuer thread (resolving a bucket's tensors).
    pub fusion_drains: u64,
    /// Device synchronisations on the issuer thread (cubecl's stream, before NCCL reads).
    pub issuer_syncs: u64,
}

impl DeviceCounts {
    /// `self` minus an earlier reading `before` of the same counters: what happened between
    /// (zero for a counter that is lower now, as after reading another transport's).
    pub fn since(&self, before: &Self) -> Self {
        Self {
            passes: self.passes.saturating_sub(before.passes),
            buckets: self.buckets.saturating_sub(before.buckets),
            pack_ops: self.pack_ops.saturating_sub(before.pack_ops),
            unpack_ops: self.unpack_ops.saturating_sub(before.unpack_ops),
            host_reads: self.host_reads.saturating_sub(before.host_reads),
            queue_waits: self.queue_waits.saturating_sub(before.queue_waits),
            hand_offs: self.hand_offs.saturating_sub(before.hand_offs),
            fusion_drains: self.fusion_drains.saturating_sub(before.fusion_drains),
            issuer_syncs: self.issuer_syncs.saturating_sub(before.issuer_syncs),
        }
    }
}

impl std::fmt::Display for DeviceCounts {
    /// One line, `passes=.. buckets=.. pack_ops=.. ...`, as the step benchmarks print it.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "passes={} buckets={} pack_ops={} unpack_ops={} host_reads={} queue_waits={} \
             hand_offs={} fusion_drains={} issuer_syncs={}",
            self.passes,
            self.buckets,
            self.pack_ops,
            self.unpack_ops,
            self.host_reads,
            self.queue_waits,
            self.hand_offs,
            self.fusion_drains,
            self.issuer_syncs
        )
    }
}

/// The live counters behind [`DeviceCounts`], shared by a transport's step thread and its
/// issuer thread.
#[derive(Debug, Default)]
pub struct DeviceCounters {
    passes: AtomicU64,
    buckets: AtomicU64,
    pack_ops: AtomicU64,
    unpack_ops: AtomicU64,
    host_reads: AtomicU64,
    queue_waits: AtomicU64,
    hand_offs: AtomicU64,
    fusion_drains: AtomicU64,
    issuer_syncs: AtomicU64,
}

/// One kind of work [`DeviceCounters`] counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceWork {
    /// A pass begins.
    Pass,
    /// A bucket is sent.
    Bucket,
    /// A packing operation.
    Pack,
    /// An unpacking operation.
    Unpack,
    /// A transfer to the host.
    HostRead,
    /// A wait for the collective queue.
    QueueWait,
    /// A hand-off between threads.
    HandOff,
    /// A fusion drain.
    FusionDrain,
    /// A device synchronisation on the issuer.
    IssuerSync,
}

impl DeviceCounters {
    fn counter(&self, work: DeviceWork) -> &AtomicU64 {
        match work {
            DeviceWork::Pass => &self.passes,
            DeviceWork::Bucket => &self.buckets,
            DeviceWork::Pack => &self.pack_ops,
            DeviceWork::Unpack => &self.unpack_ops,
            DeviceWork::HostRead => &self.host_reads,
            DeviceWork::QueueWait => &self.queue_waits,
            DeviceWork::HandOff => &self.hand_offs,
            DeviceWork::FusionDrain => &self.fusion_drains,
            DeviceWork::IssuerSync => &self.issuer_syncs,
        }
    }

    /// Counts `n` of `work`.
    pub fn add(&self, work: DeviceWork, n: u64) {
        self.counter(work).fetch_add(n, Ordering::Relaxed);
    }

    /// Counts one `work`.
    pub fn one(&self, work: DeviceWork) {
        self.add(work, 1);
    }

    /// The totals so far.
    pub fn read(&self) -> DeviceCounts {
        let r = |w| self.counter(w).load(Ordering::Relaxed);
        DeviceCounts {
            passes: r(DeviceWork::Pass),
            buckets: r(DeviceWork::Bucket),
            pack_ops: r(DeviceWork::Pack),
            unpack_ops: r(DeviceWork::Unpack),
            host_reads: r(DeviceWork::HostRead),
            queue_waits: r(DeviceWork::QueueWait),
            hand_offs: r(DeviceWork::HandOff),
            fusion_drains: r(DeviceWork::FusionDrain),
            issuer_syncs: r(DeviceWork::IssuerSync),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_add_up_and_a_difference_is_what_came_between() {
        let c = DeviceCounters::default();
        c.one(DeviceWork::Pass);
        c.add(DeviceWork::Pack, 3);
        let before = c.read();
        c.one(DeviceWork::Pass);
        c.add(DeviceWork::HandOff, 4);
        c.one(DeviceWork::IssuerSync);
        let now = c.read();
        assert_eq!(now.passes, 2);
        assert_eq!(now.pack_ops, 3);
        let between = now.since(&before);
        assert_eq!(
            between,
            DeviceCounts {
                passes: 1,
                hand_offs: 4,
                issuer_syncs: 1,
                ..DeviceCounts::default()
            }
        );
        assert_eq!(
            between.to_string(),
            "passes=1 buckets=0 pack_ops=0 unpack_ops=0 host_reads=0 queue_waits=0 \
             hand_offs=4 fusion_drains=0 issuer_syncs=1"
        );
    }
}
