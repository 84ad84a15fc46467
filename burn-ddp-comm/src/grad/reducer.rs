//! [`Pass`]: the gradient engine of one synchronised backward pass, the same for every Burn line
//! and every transport, over a [`BucketTransport`] (how a complete bucket travels).
//!
//! A pass over a [`BucketPlan`] takes each parameter's final gradient once ([`Pass::push`]),
//! or learns that this rank has none for it, and sends the buckets strictly in index order,
//! each as soon as all its slots are final ([`LaunchOrder`]), so that every rank issues the
//! same collectives in the same order whatever order its gradients arrive in (PyTorch's
//! `Reducer` keeps the same rule). Each bucket carries one presence flag per parameter after its
//! values, reduced with them: every rank learns which parameters some rank had a gradient for
//! (its transport reads them at the end).
//!
//! A failure does not stop the pass: it is kept (the first one), the later buckets still go —
//! a parameter whose gradient could not be taken counts as absent here — so that no other rank
//! waits for a bucket that never comes; [`Pass::finish`] then gives the pass up through the
//! transport ([`BucketTransport::abandon`]: a device transport stops NCCL and tells the other
//! ranks) and reports it. A pass dropped before its end (its backward panicked) is
//! [discarded](Pass::discard): nothing more is sent, and what was is settled.
//!
//! States of a slot: open (no gradient yet) → final, with this rank's gradient kept by the
//! transport, or absent (none on this rank: counted from the start, announced, or at the close
//! of the pass). States of a bucket: packing → sent (the transport's) → answered (collected by
//! [`BucketTransport::finish`]).
//!
//! The transports: the host-staged one ([`HostBuckets`](super::HostBuckets), over the
//! communication thread [`HostComm`](super::HostComm)), the Burn 0.21 line's device buckets
//! (`burn-ddp-burn021/src/ddp/gpu.rs`) and the Burn 0.22/0.23 line's
//! (`burn-ddp-gradsync/src/cuda.rs`).

use super::{BucketPlan, LaunchOrder};
use crate::{DdpError, Rank, Result};

/// How the buckets of a [`Pass`] travel: what a transport does with a final gradient, a complete
/// bucket, the end of the pass and a pass given up.
///
/// `K` is the plan's parameter key. A transport holds one pass's buckets; what outlives the pass
/// (a communication thread, a communicator) is its [`Link`](Self::Link), lent to each call.
pub trait BucketTransport<K> {
    /// A final gradient as this transport takes it (host values, a device tensor).
    type Grad<'g>;
    /// What the transport needs from its owner for the calls that communicate.
    type Link<'l>;
    /// What a finished pass gives back: the reduced gradients, by slot.
    type Output;

    /// Keeps parameter `slot`'s final gradient for its bucket (checking it fits the slot).
    ///
    /// # Errors
    /// A gradient that does not fit the slot (its size, its element type, its device).
    fn keep(
        &mut self,
        link: &mut Self::Link<'_>,
        plan: &BucketPlan<K>,
        slot: usize,
        grad: Self::Grad<'_>,
    ) -> Result<()>;

    /// Sends bucket `bucket`, every slot of which is final: those kept carry this rank's
    /// gradient and a presence flag of 1, the others zeros. Buckets come strictly in index order.
    ///
    /// # Errors
    /// The bucket cannot be packed or handed over.
    fn send(
        &mut self,
        link: &mut Self::Link<'_>,
        plan: &BucketPlan<K>,
        bucket: usize,
    ) -> Result<()>;

    /// After every bucket was sent, without failure: waits for their answers and gives the
    /// reduced gradients (`local`: the slots this rank had a gradient for).
    ///
    /// # Errors
    /// A collective failure, naming the rank at fault; no answer in time.
    fn finish(
        &mut self,
        link: &mut Self::Link<'_>,
        plan: &BucketPlan<K>,
        local: &[bool],
    ) -> Result<Self::Output>;

    /// Gives the pass up after failure `e`: what was sent is settled (answers taken, a device
    /// stream drained, the other ranks told where the transport can) before any of the pass's
    /// memory goes. Returns the error to report (`e`, or the first failure among the answers
    /// where that names the rank at fault).
    fn abandon(&mut self, link: &mut Self::Link<'_>, e: DdpError) -> DdpError;
}

/// One synchronised backward pass (see the module documentation).
#[derive(Debug)]
pub struct Pass<T> {
    rank: Rank,
    /// Which slots are final, and which bucket is sent next.
    order: LaunchOrder,
    /// The slots whose gradient this rank gave.
    local: Vec<bool>,
    transport: T,
    /// The pass's first failure.
    failed: Option<DdpError>,
    /// Buckets are sent as soon as they are complete (overlap), not at the end.
    eager: bool,
}

impl<T> Pass<T> {
    /// A pass of rank `rank` over `plan` whose buckets travel by `transport`; `eager`: each
    /// bucket is sent as soon as it is complete, else all at [`Pass::finish`].
    pub fn new<K>(rank: Rank, plan: &BucketPlan<K>, transport: T, eager: bool) -> Self {
        Self {
            rank,
            order: LaunchOrder::new(plan),
            local: vec![false; plan.slots.len()],
            transport,
            failed: None,
            eager,
        }
    }

    /// Whether parameter `slot` still waits for its gradient (`false` beyond the plan).
    pub fn is_open(&self, slot: usize) -> bool {
        slot < self.local.len() && !self.order.is_final(slot)
    }

    /// How many buckets have been sent.
    pub fn sent(&self) -> usize {
        self.order.launched()
    }

    /// The transport, for what is particular to it (an all-reduce issued behind the buckets
    /// in flight, on the host).
    pub fn transport_mut(&mut self) -> &mut T {
        &mut self.transport
    }

    /// Records failure `e` (the first one is reported by [`Pass::finish`]); the pass goes on.
    pub fn fail(&mut self, e: DdpError) {
        tracing::debug!("gradient synchronisation failed: {e}");
        self.failed.get_or_insert(e);
    }

    /// Whether the pass has failed.
    pub fn has_failed(&self) -> bool {
        self.failed.is_some()
    }

    /// Marks `slot` final; an internal failure if it is beyond the plan or final already.
    fn close_slot(&mut self, slot: usize, what: &'static str) -> bool {
        if self.order.mark_final(slot) {
            return true;
        }
        self.fail(DdpError::Internal {
            rank: self.rank,
            what,
        });
        false
    }
}

impl<T> Pass<T> {
    /// Parameter `slot`'s final gradient on this rank (`None`: this rank has none): kept by the
    /// transport, then every complete bucket is sent (when eager). A gradient the transport
    /// refuses fails the pass and counts as absent.
    pub fn push<K>(
        &mut self,
        link: &mut T::Link<'_>,
        plan: &BucketPlan<K>,
        slot: usize,
        grad: Option<T::Grad<'_>>,
    ) where
        T: BucketTransport<K>,
    {
        if !self.close_slot(
            slot,
            "a gradient was given twice, or for a slot beyond the plan",
        ) {
            return;
        }
        if let Some(grad) = grad {
            match self.transport.keep(link, plan, slot, grad) {
                Ok(()) => self.local[slot] = true,
                Err(e) => self.fail(e),
            }
        }
        if self.eager {
            self.send_ready(link, plan);
        }
    }

    /// Parameters this rank has no gradient for in this pass, known before any arrives (those
    /// its graph does not reach): final, absent.
    pub fn absent<K>(
        &mut self,
        link: &mut T::Link<'_>,
        plan: &BucketPlan<K>,
        slots: impl IntoIterator<Item = usize>,
    ) where
        T: BucketTransport<K>,
    {
        for slot in slots {
            self.close_slot(slot, "a slot beyond the plan was announced absent");
        }
        if self.eager {
            self.send_ready(link, plan);
        }
    }

    /// Sends every complete bucket whose predecessors have all gone; a bucket that fails is
    /// recorded and the later ones still go.
    fn send_ready<K>(&mut self, link: &mut T::Link<'_>, plan: &BucketPlan<K>)
    where
        T: BucketTransport<K>,
    {
        while let Some(bucket) = self.order.next_ready() {
            if let Err(e) = self.transport.send(link, plan, bucket) {
                self.fail(e);
            }
        }
    }

    /// Ends the pass: parameters never given count as absent here, every bucket left is sent
    /// (in order), and then the transport waits for the answers and gives the reduced
    /// gradients — or, after a failure, gives the pass up and reports it.
    ///
    /// # Errors
    /// The pass's first failure (see [`BucketTransport::abandon`]), or the answers'.
    pub fn finish<K>(mut self, link: &mut T::Link<'_>, plan: &BucketPlan<K>) -> Result<T::Output>
    where
        T: BucketTransport<K>,
    {
        self.order.mark_rest_final();
        self.send_ready(link, plan);
        match self.failed.take() {
            Some(e) => Err(self.transport.abandon(link, e)),
            None => self.transport.finish(link, plan, &self.local),
        }
    }

    /// Ends a pass that never reached its end (its backward panicked, or it was replaced): sends
    /// nothing more, settles what was sent, and returns the error to report (the pass's own
    /// failure, else `e`).
    pub fn discard<K>(mut self, link: &mut T::Link<'_>, e: DdpError) -> DdpError
    where
        T: BucketTransport<K>,
    {
        let e = self.failed.take().unwrap_or(e);
        self.transport.abandon(link, e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A transport that records what the engine asks of it.
    #[derive(Debug, Default)]
    struct Log {
        kept: Vec<(usize, f32)>,
        sent: Vec<usize>,
        refuse: Option<usize>,
        abandoned: std::rc::Rc<std::cell::Cell<bool>>,
    }

    impl BucketTransport<u64> for Log {
        type Grad<'g> = f32;
        type Link<'l> = ();
        type Output = (Vec<usize>, Vec<bool>);

        fn keep(
            &mut self,
            _: &mut (),
            plan: &BucketPlan<u64>,
            slot: usize,
            grad: f32,
        ) -> Result<()> {
            if self.refuse == Some(slot) {
                return Err(DdpError::Model(crate::ModelError::GradientSize {
                    rank: Rank(0),
                    param: plan.slots[slot].info.name.clone(),
                    expected: plan.slots[slot].info.numel,
                    got: 0,
                }));
            }
            self.kept.push((slot, grad));
            Ok(())
        }

        fn send(&mut self, _: &mut (), _: &BucketPlan<u64>, bucket: usize) -> Result<()> {
            self.sent.push(bucket);
            Ok(())
        }

        fn finish(
            &mut self,
            _: &mut (),
            _: &BucketPlan<u64>,
            local: &[bool],
        ) -> Result<Self::Output> {
            Ok((self.sent.clone(), local.to_vec()))
        }

        fn abandon(&mut self, _: &mut (), e: DdpError) -> DdpError {
            self.abandoned.set(true);
            e
        }
    }

    /// Three buckets of two parameters each.
    fn plan() -> BucketPlan<u64> {
        super::super::plan::test_plan(6, 2, 16, 16)
    }

    #[test]
    fn eager_buckets_go_in_order_as_they_complete_and_the_close_sends_the_rest() {
        let plan = plan();
        let mut pass = Pass::new(Rank(0), &plan, Log::default(), true);
        let b = |i: usize| plan.buckets[i].0.clone();
        // Bucket 1 completes before bucket 0: nothing goes until bucket 0 has.
        for s in b(1) {
            pass.push(&mut (), &plan, s, Some(1.0));
        }
        assert_eq!(pass.transport_mut().sent, Vec::<usize>::new());
        pass.absent(&mut (), &plan, [b(0)[0]]);
        pass.push(&mut (), &plan, b(0)[1], Some(2.0));
        assert_eq!(pass.transport_mut().sent, vec![0, 1]);
        assert!(pass.is_open(b(2)[0]));
        // Bucket 2's slots were never given: absent at the close, and the bucket goes.
        let (sent, local) = pass.finish(&mut (), &plan).unwrap();
        assert_eq!(sent, vec![0, 1, 2]);
        let want: Vec<bool> = (0..6).map(|s| b(1).contains(&s) || s == b(0)[1]).collect();
        assert_eq!(local, want);
    }

    #[test]
    fn a_lazy_pass_sends_every_bucket_at_its_end() {
        let plan = plan();
        let mut pass = Pass::new(Rank(0), &plan, Log::default(), false);
        for s in 0..6 {
            pass.push(&mut (), &plan, s, Some(s as f32));
        }
        assert_eq!(pass.sent(), 0);
        assert!(pass.transport_mut().sent.is_empty());
        let (sent, local) = pass.finish(&mut (), &plan).unwrap();
        assert_eq!(sent, vec![0, 1, 2]);
        assert!(local.iter().all(|&l| l));
    }

    #[test]
    fn a_refused_gradient_fails_the_pass_but_every_bucket_still_goes() {
        let plan = plan();
        let refused = plan.buckets[0].0[0];
        let log = Log {
            refuse: Some(refused),
            ..Log::default()
        };
        let mut pass = Pass::new(Rank(0), &plan, log, true);
        for s in 0..6 {
            pass.push(&mut (), &plan, s, Some(1.0));
        }
        assert!(pass.has_failed());
        // Every bucket went (the other ranks wait for them), then the pass was given up.
        assert_eq!(pass.transport_mut().sent, vec![0, 1, 2]);
        let abandoned = std::rc::Rc::clone(&pass.transport_mut().abandoned);
        let err = pass.finish(&mut (), &plan).unwrap_err();
        assert!(abandoned.get(), "the transport gave the pass up");
        assert!(
            matches!(err, DdpError::Model(crate::ModelError::GradientSize { .. })),
            "{err:?}"
        );
    }

    #[test]
    fn a_gradient_given_twice_is_an_internal_failure_reported_at_the_end() {
        let plan = plan();
        let mut pass = Pass::new(Rank(0), &plan, Log::default(), true);
        pass.push(&mut (), &plan, 0, Some(1.0));
        pass.push(&mut (), &plan, 0, Some(2.0));
        pass.push(&mut (), &plan, 99, Some(2.0));
        assert_eq!(pass.transport_mut().kept, vec![(0, 1.0)]);
        let err = pass.finish(&mut (), &plan).unwrap_err();
        assert!(matches!(err, DdpError::Internal { .. }), "{err:?}");
    }

    #[test]
    fn a_discarded_pass_sends_nothing_more_and_is_settled() {
        let plan = plan();
        let mut pass = Pass::new(Rank(0), &plan, Log::default(), true);
        for &s in &plan.buckets[0].0 {
            pass.push(&mut (), &plan, s, Some(1.0));
        }
        pass.absent(&mut (), &plan, plan.buckets[1].0.clone());
        let abandoned = std::rc::Rc::clone(&pass.transport_mut().abandoned);
        assert_eq!(pass.transport_mut().sent, vec![0, 1]);
        let e = pass.discard(
            &mut (),
            DdpError::Internal {
                rank: Rank(0),
                what: "backward panicked",
            },
        );
        assert!(e.to_string().contains("backward panicked"), "{e}");
        assert!(abandoned.get(), "what was sent is settled");
    }
}
