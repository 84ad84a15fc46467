//! Host-staged gradient buckets: packed as f32 on the calling thread, all-reduced one after
//! another on a communication thread while the next bucket is being packed, and read back.
//!
//! Invariant that keeps ranks in step: every bucket of the plan is launched in every step, in
//! index order, on every rank; a parameter without a gradient on this rank is sent as zeros.
//! Each bucket carries one presence flag per parameter after its values (1 where this rank had
//! a gradient), reduced with them, so every rank learns which parameters some rank had a
//! gradient for: those get the reduced value on every rank; those no rank had stay absent.

use std::sync::mpsc::RecvTimeoutError;
use std::sync::Arc;
use std::time::Duration;

use half::{bf16, f16};

use super::{
    BucketPlan, BucketShape, Compression, DdpConfig, GradReduction, LaunchOrder, PowerSgdState,
    PowerSgdStats, Worker,
};
use crate::group::ProcessGroup;
use crate::{DdpError, Result};

/// Extra wait, beyond the collective timeout, for the communication thread's answer.
const ANSWER_SLACK: Duration = Duration::from_secs(30);

/// All-reduces one bucket in place, compressed on the wire if asked.
///
/// # Errors
/// Collective failures, naming the rank at fault.
pub fn reduce_bucket(
    pg: &ProcessGroup,
    data: &mut [f32],
    reduction: GradReduction,
    compression: Compression,
) -> Result<()> {
    let op = reduction.op();
    match compression {
        Compression::None => pg.all_reduce(data, op),
        Compression::F16 => {
            let mut c: Vec<f16> = data.iter().map(|&v| f16::from_f32(v)).collect();
            pg.all_reduce(&mut c, op)?;
            data.iter_mut().zip(&c).for_each(|(d, v)| *d = v.to_f32());
            Ok(())
        }
        Compression::Bf16 => {
            let mut c: Vec<bf16> = data.iter().map(|&v| bf16::from_f32(v)).collect();
            pg.all_reduce(&mut c, op)?;
            data.iter_mut().zip(&c).for_each(|(d, v)| *d = v.to_f32());
            Ok(())
        }
    }
}

struct HostBucketJob {
    bucket: usize,
    data: Vec<f32>,
    /// The bucket's layout, for PowerSGD (`None` without it).
    shape: Option<BucketShape>,
}

struct Done {
    bucket: usize,
    result: Result<Vec<f32>>,
}

/// The host transport of gradient synchronisation: a communication thread that all-reduces
/// buckets in the order they are handed over. Start it once per process (rank) and use
/// [`begin`](Self::begin) for every synchronised step.
pub struct HostSync {
    pg: ProcessGroup,
    worker: Worker<HostBucketJob, Done>,
    /// Buckets handed to the thread whose answers were not taken (a step abandoned midway).
    outstanding: usize,
    /// What PowerSGD has sent, when it is on.
    power_sgd: Option<Arc<PowerSgdStats>>,
}

impl std::fmt::Debug for HostSync {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostSync")
            .field("rank", &self.pg.rank())
            .field("outstanding", &self.outstanding)
            .finish()
    }
}

impl HostSync {
    /// Starts the communication thread of `pg`'s rank, reducing as `config` says.
    ///
    /// # Errors
    /// [`DdpError::Io`] if the thread cannot be started.
    pub fn start(pg: &ProcessGroup, config: &DdpConfig) -> Result<Self> {
        let reduction = config.reduction;
        let compression = config.compression;
        let comm = pg.clone();
        let stats = config.power_sgd.map(|_| Arc::new(PowerSgdStats::default()));
        let mut power = config
            .power_sgd
            .zip(stats.clone())
            .map(|(p, s)| PowerSgdState::new(p, s));
        let worker = Worker::start(
            format!("burn-ddp-grad-{}", pg.rank()),
            move |HostBucketJob {
                      bucket,
                      mut data,
                      shape,
                  }| {
                let result = match (power.as_mut(), shape) {
                    (Some(p), Some(shape)) => p.reduce(&comm, bucket, &mut data, &shape, reduction),
                    _ => reduce_bucket(&comm, &mut data, reduction, compression),
                }
                .map(|()| data);
                Done { bucket, result }
            },
        )?;
        Ok(Self {
            pg: pg.clone(),
            worker,
            outstanding: 0,
            power_sgd: stats,
        })
    }

    /// PowerSGD's counts (elements all-reduced, elements uncompressed, steps), when it is on.
    pub fn power_sgd_totals(&self) -> Option<(u64, u64, u64)> {
        self.power_sgd.as_ref().map(|s| s.totals())
    }

    /// Starts one synchronised step over `plan`: [`HostStep::push`] every parameter's
    /// gradient, then [`HostStep::finish`].
    ///
    /// # Errors
    /// What an earlier, abandoned step's buckets still failed with (the step before this one
    /// never finished).
    pub fn begin<'a, K>(&'a mut self, plan: &'a BucketPlan<K>) -> Result<HostStep<'a, K>> {
        if self.outstanding > 0 {
            let mut stale = Vec::new();
            self.collect(&mut stale)?;
        }
        let buckets = (0..plan.buckets.len())
            .map(|b| Some(vec![0.0f32; plan.buffer_len(b)]))
            .collect();
        Ok(HostStep {
            order: LaunchOrder::new(plan),
            buckets,
            results: vec![None; plan.buckets.len()],
            stopped: false,
            sync: self,
            plan,
        })
    }

    fn stopped(&self) -> DdpError {
        DdpError::WorkerStopped {
            rank: self.pg.rank(),
            what: "the gradient communication thread",
        }
    }

    /// Takes every outstanding answer into `results`, in order.
    fn collect(&mut self, results: &mut [Option<Vec<f32>>]) -> Result<()> {
        let wait = self.pg.timeouts().collective + ANSWER_SLACK;
        let mut first_error = None;
        while self.outstanding > 0 {
            match self.worker.receive(wait) {
                Ok(Done { bucket, result }) => {
                    self.outstanding -= 1;
                    match result {
                        Ok(v) => {
                            if let Some(r) = results.get_mut(bucket) {
                                *r = Some(v);
                            }
                        }
                        Err(e) => {
                            first_error.get_or_insert(e);
                        }
                    }
                }
                Err(RecvTimeoutError::Timeout) => {
                    first_error.get_or_insert(DdpError::GradSyncTimeout {
                        rank: self.pg.rank(),
                        waited: wait,
                    });
                    break;
                }
                Err(RecvTimeoutError::Disconnected) => {
                    first_error.get_or_insert(DdpError::WorkerStopped {
                        rank: self.pg.rank(),
                        what: "the gradient communication thread",
                    });
                    break;
                }
            }
        }
        match first_error {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

/// One synchronised step (see [`HostSync::begin`]): each bucket is handed to the communication
/// thread as soon as all its parameters are pushed and every bucket before it has left.
pub struct HostStep<'a, K> {
    sync: &'a mut HostSync,
    plan: &'a BucketPlan<K>,
    /// Buckets being packed (taken when launched): values, then one presence flag per slot.
    buckets: Vec<Option<Vec<f32>>>,
    results: Vec<Option<Vec<f32>>>,
    /// Which slots are pushed, and which bucket launches next.
    order: LaunchOrder,
    /// The communication thread stopped taking buckets.
    stopped: bool,
}

impl<K> std::fmt::Debug for HostStep<'_, K> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostStep")
            .field("launched", &self.order.launched())
            .field("buckets", &self.buckets.len())
            .finish()
    }
}

impl<K> HostStep<'_, K> {
    /// Packs the gradient of parameter `slot` (`None`: this rank has none); buckets that are
    /// complete leave for the communication thread.
    ///
    /// # Errors
    /// [`DdpError::GradientSize`] if `values` is not the parameter's size;
    /// [`DdpError::WorkerStopped`] if the communication thread has stopped.
    pub fn push(&mut self, slot: usize, values: Option<&[f32]>) -> Result<()> {
        let rank = self.sync.pg.rank();
        if self.stopped {
            return Err(self.sync.stopped());
        }
        let Some(s) = self.plan.slots.get(slot) else {
            return Err(DdpError::Internal {
                rank,
                what: "a gradient was pushed for a slot beyond the bucket plan",
            });
        };
        if self.order.is_final(slot) {
            return Err(DdpError::Internal {
                rank,
                what: "a parameter's gradient was pushed twice in one step",
            });
        }
        if let Some(v) = values {
            if v.len() != s.info.numel {
                return Err(DdpError::GradientSize {
                    rank,
                    param: s.info.name.clone(),
                    expected: s.info.numel,
                    got: v.len(),
                });
            }
            let flag = self.plan.flag_index(slot);
            if let Some(bucket) = self.buckets[s.bucket].as_mut() {
                bucket[s.offset..s.offset + v.len()].copy_from_slice(v);
                bucket[flag] = 1.0;
            }
        }
        self.order.mark_final(slot);
        self.launch_ready()
    }

    /// Launches every complete bucket whose predecessors have all left.
    fn launch_ready(&mut self) -> Result<()> {
        while let Some(bucket) = self.order.next_ready() {
            let Some(data) = self.buckets[bucket].take() else {
                continue;
            };
            let shape = self
                .sync
                .power_sgd
                .is_some()
                .then(|| self.plan.bucket_shape(bucket));
            if !self.sync.worker.send(HostBucketJob {
                bucket,
                data,
                shape,
            }) {
                self.stopped = true;
                return Err(self.sync.stopped());
            }
            self.sync.outstanding += 1;
        }
        Ok(())
    }

    /// Launches what is left (parameters never pushed count as absent on this rank), waits for
    /// every bucket, and returns the reduced gradients.
    ///
    /// # Errors
    /// The first failure of the step: a collective error naming the rank at fault, or
    /// [`DdpError::GradSyncTimeout`] when the communication thread does not answer in time.
    pub fn finish(mut self) -> Result<Reduced> {
        self.order.mark_rest_final();
        let launched = if self.stopped {
            Err(self.sync.stopped())
        } else {
            self.launch_ready()
        };
        // Answers for what did leave are taken even after a failure, so the next step starts
        // clean.
        let collected = self.sync.collect(&mut self.results);
        launched?;
        collected?;
        let mut values = Vec::with_capacity(self.results.len());
        for (i, r) in self.results.iter_mut().enumerate() {
            match r.take() {
                Some(v) => values.push(v),
                None => {
                    tracing::error!("gradient bucket {i} came back without a result");
                    return Err(DdpError::Internal {
                        rank: self.sync.pg.rank(),
                        what: "a gradient bucket came back without a result",
                    });
                }
            }
        }
        let layout = self
            .plan
            .slots
            .iter()
            .enumerate()
            .map(|(i, s)| (s.bucket, s.offset, s.info.numel, self.plan.flag_index(i)))
            .collect();
        Ok(Reduced {
            buckets: values,
            layout,
        })
    }
}

/// The reduced gradients of one step, by slot.
#[derive(Debug)]
pub struct Reduced {
    buckets: Vec<Vec<f32>>,
    /// Per slot: bucket, offset, element count, index of its presence flag.
    layout: Vec<(usize, usize, usize, usize)>,
}

impl Reduced {
    /// The reduced gradient of parameter `slot`; `None` when no rank had a gradient for it
    /// (leave it without one, as a single process would).
    pub fn get(&self, slot: usize) -> Option<&[f32]> {
        let &(bucket, offset, numel, flag) = self.layout.get(slot)?;
        let b = &self.buckets[bucket];
        (b[flag] > 0.0).then(|| &b[offset..offset + numel])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Timeouts;
    use crate::types::WorldSize;

    fn plan() -> BucketPlan<u64> {
        super::super::plan::test_plan(5, 3, 12, 24)
    }

    /// Three in-process ranks; parameter 1 has a gradient on rank 2 only, parameter 3 on none.
    fn run(reduction: GradReduction, compression: Compression) -> Vec<Vec<Option<Vec<f32>>>> {
        let groups = ProcessGroup::local(
            WorldSize::new(3).unwrap(),
            Timeouts::uniform(Duration::from_secs(20)),
        );
        let config = DdpConfig {
            reduction,
            compression,
            ..DdpConfig::default()
        };
        let handles: Vec<_> = groups
            .into_iter()
            .enumerate()
            .map(|(r, pg)| {
                let config = config.clone();
                std::thread::spawn(move || {
                    let plan = plan();
                    let mut sync = HostSync::start(&pg, &config).unwrap();
                    let mut out = Vec::new();
                    for step in 0..2 {
                        let mut s = sync.begin(&plan).unwrap();
                        for slot in [4usize, 0, 2, 1] {
                            let v = vec![(r * 10 + slot + step) as f32; 3];
                            let have = slot != 1 || r == 2;
                            s.push(slot, have.then_some(v.as_slice())).unwrap();
                        }
                        let red = s.finish().unwrap();
                        out = (0..5).map(|i| red.get(i).map(<[f32]>::to_vec)).collect();
                    }
                    out
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    }

    #[test]
    fn every_rank_gets_the_mean_and_absent_parameters_stay_absent() {
        let got = run(GradReduction::Mean, Compression::None);
        for r in &got {
            // step 1: rank r sends r*10 + slot + 1 → mean over ranks 0..3 = 10 + slot + 1.
            assert_eq!(r[0].as_deref(), Some(&[11.0; 3][..]));
            assert_eq!(r[4].as_deref(), Some(&[15.0; 3][..]));
            // only rank 2 had parameter 1: (21 + 1) / 3, on every rank.
            let p1 = r[1]
                .as_deref()
                .expect("parameter 1 had a gradient on rank 2");
            assert!(p1.iter().all(|v| (v - 22.0 / 3.0).abs() < 1e-5), "{p1:?}");
            assert_eq!(r[3], None);
        }
    }

    #[test]
    fn sum_and_bf16_reduce_on_every_rank_alike() {
        let got = run(GradReduction::Sum, Compression::Bf16);
        for r in &got {
            assert_eq!(r[2].as_deref(), Some(&[39.0; 3][..]));
            assert_eq!(r[1].as_deref(), Some(&[22.0; 3][..]));
        }
        assert!(got.iter().all(|r| *r == got[0]));
    }

    #[test]
    fn a_gradient_of_the_wrong_size_is_named() {
        let pg = ProcessGroup::single();
        let plan = plan();
        let mut sync = HostSync::start(&pg, &DdpConfig::default()).unwrap();
        let mut s = sync.begin(&plan).unwrap();
        let err = s.push(2, Some(&[1.0, 2.0])).unwrap_err();
        assert!(
            matches!(&err, DdpError::GradientSize { param, expected: 3, got: 2, .. } if param == "p2"),
            "{err:?}"
        );
        drop(s);
        // An abandoned step leaves the next one clean.
        let mut s = sync.begin(&plan).unwrap();
        s.push(0, Some(&[1.0; 3])).unwrap();
        let red = s.finish().unwrap();
        assert_eq!(red.get(0), Some(&[1.0; 3][..]));
        assert_eq!(red.get(1), None);
    }
}
