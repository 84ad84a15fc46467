//! What a [`ProcessGroup`] of a fault-tolerant job offers its caller: whether it is one, the
//! current membership, processes asking to join, and the calls that change the membership
//! (`recover`, `grow`, `rejoin`).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use super::super::{Inner, ProcessGroup};
use super::Recovery;
use crate::types::Rank;
use crate::{DdpError, Result};

impl ProcessGroup {
    /// Whether this group survives the loss of ranks (a fault-tolerant job: `burn-ddp run
    /// --fault-tolerant`, `BURN_DDP_FAULT_TOLERANT=1`).
    pub fn is_fault_tolerant(&self) -> bool {
        self.shared.membership.is_some()
    }

    /// In a fault-tolerant job: this process's member id (unique for the job's life) and the
    /// current membership epoch.
    pub fn membership(&self) -> Option<(u32, u64)> {
        let e = self.shared.membership.as_ref()?;
        Some((e.id, e.epoch().0))
    }

    /// In a fault-tolerant job: whether the current membership has ended, asked of the store
    /// (one request, bounded by the heartbeat bound): a rank recorded its end, or the store
    /// does not answer. A rank frozen past the heartbeat bound and then continued can still
    /// finish a collective from what its peers had posted before they ended the membership
    /// without it, and go on as if its step were the job's; what it would write for the job
    /// (rank 0's metric files) must wait for this answer. `false` outside fault-tolerant jobs.
    pub fn membership_ended(&self) -> bool {
        self.shared
            .membership
            .as_ref()
            .is_some_and(|e| e.current_ended())
    }

    /// In a fault-tolerant job: `Ok` while the current membership stands, asked of the store
    /// (one request, bounded by the heartbeat bound), for a write of the job's (`what`: rank
    /// 0's checkpoint file) that must not happen once a newer membership took over. Always `Ok`
    /// outside fault-tolerant jobs.
    ///
    /// # Errors
    /// [`MembershipError::Superseded`](crate::MembershipError::Superseded) (naming `what` and
    /// why the membership ended) once a rank recorded its end; the store's error when it does
    /// not answer (the write cannot be known to be the job's).
    pub fn membership_stands(&self, what: &str) -> Result<()> {
        match &self.shared.membership {
            Some(e) => e.current_stands(what),
            None => Ok(()),
        }
    }

    /// Records the end of this process's current membership, as a rank that saw a failure
    /// does (tests of what a superseded process may still do).
    #[cfg(test)]
    pub(crate) fn end_membership(&self, reason: &str) {
        if let Some(e) = &self.shared.membership {
            let (epoch, _) = e.epoch();
            e.end(epoch, self.rank(), None, reason.to_owned());
        }
    }

    /// In a fault-tolerant job: whether a process has asked to join since the current
    /// membership began (this rank's view, read from the store each heartbeat interval). The
    /// ranks must agree on a step boundary (a collective of theirs), then all call
    /// [`ProcessGroup::grow`]. `false` outside fault-tolerant jobs.
    pub fn join_pending(&self) -> bool {
        self.shared
            .membership
            .as_ref()
            .is_some_and(|e| e.joins.pending.load(Ordering::SeqCst))
    }

    /// A joining process's admission into the running job (once, after
    /// [`ProcessGroup::from_env`] returned): it is behind, and takes the state of
    /// [`Recovery::source`].
    pub fn take_admission(&self) -> Option<Recovery> {
        self.admission()?.take()
    }

    /// A fault-tolerant job's slot for this process's admission (`None` in other jobs).
    fn admission(&self) -> Option<std::sync::MutexGuard<'_, Option<Recovery>>> {
        let service = self.shared.membership.as_ref()?;
        Some(service.admission.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// Runs `prepare` on rank 0 alone, and returns on every rank once rank 0 has run it: what
    /// rank 0 prepares for the job (the training directory it creates or clears) is there
    /// before any rank goes on, and no other rank touches it. Rank 0 gets `Some` of what
    /// `prepare` returned, the other ranks `None`.
    ///
    /// ```no_run
    /// # fn doc(pg: &burn_ddp_comm::ProcessGroup) -> burn_ddp_comm::Result<()> {
    /// pg.on_main(|| std::fs::create_dir_all("artifacts"))?.transpose()?;
    /// # Ok(()) }
    /// ```
    ///
    /// A process joining a running fault-tolerant job does not wait (rank 0 prepared the job
    /// when it started).
    ///
    /// # Errors
    /// As [`ProcessGroup::barrier`]: a rank that failed meanwhile (rank 0 in `prepare`) is
    /// named, within the group's deadline.
    pub fn on_main<T>(&self, prepare: impl FnOnce() -> T) -> Result<Option<T>> {
        let out = self.is_main().then(prepare);
        let joining = self.admission().is_some_and(|a| a.is_some());
        if !joining {
            self.barrier()?;
        }
        Ok(out)
    }

    /// After `cause` (a failure of the group: [`DdpError::is_peer_failure`]), agrees with the
    /// other ranks that can still reach the job's store on the next membership, opens its
    /// group (this group, and every clone of it, now has the new ranks: this rank's rank may
    /// change), and compares the ranks' `progress` (e.g. optimizer steps taken; `None` when
    /// this rank has no state at all, as a process that joined and has not taken one yet) so
    /// that the ranks behind take the source's state ([`Recovery`]). Ranks that keep no count
    /// but hold the job's state pass the same `Some` value. The partial
    /// results of the step that failed must be dropped by the caller.
    ///
    /// # Errors
    /// [`MembershipError::NotFaultTolerant`](crate::MembershipError::NotFaultTolerant) for other groups; [`MembershipError::Excluded`](crate::MembershipError::Excluded) when the others
    /// went on without this rank (it may [`rejoin`](Self::rejoin)); [`MembershipError::TooFewRanks`](crate::MembershipError::TooFewRanks);
    /// the store's errors (this rank cannot reach the job).
    pub fn recover(&self, cause: &DdpError, progress: Option<u64>) -> Result<Recovery> {
        let culprit = cause.culprit().filter(|c| *c != self.rank());
        self.change(cause.to_string(), culprit, progress, true)
    }

    /// Closes a fault-tolerant job to processes asking to join, for the rest of this
    /// process's membership: after training, a replacement would start training while the
    /// members do the work that follows it (an evaluation), so the changes of membership this
    /// process decides from now on leave joiners out; they wait until the job ends, and their
    /// launcher then stops them. [`surviving`](crate::data::surviving) calls it. Nothing for
    /// other groups.
    pub fn close_joins(&self) {
        if let Ok(e) = self.service() {
            e.closed.store(true, std::sync::atomic::Ordering::SeqCst);
        }
    }

    /// In a fault-tolerant job: this process ends with a failure (its program's error), so that
    /// when it leaves, the job's record counts it as gone, not as finished. Without it, a
    /// process that returns an error is recorded as finished, and a launcher would read a job
    /// whose last members all failed as one that finished. [`spawn`](crate::launch::spawn())
    /// calls it when its function fails; a program that makes its group itself calls it before
    /// it exits with an error. Nothing outside fault-tolerant jobs.
    pub fn mark_failed(&self) {
        if let Ok(e) = self.service() {
            e.failed.store(true, std::sync::atomic::Ordering::SeqCst);
        }
    }

    /// Lets in the processes that asked to join ([`ProcessGroup::join_pending`]): every rank
    /// of the group calls it at the same step boundary; the joiners are behind.
    ///
    /// # Errors
    /// As [`ProcessGroup::recover`].
    pub fn grow(&self, progress: Option<u64>) -> Result<Recovery> {
        self.change("a process asked to join".into(), None, progress, false)
    }

    /// Joins the job again after [`MembershipError::Excluded`](crate::MembershipError::Excluded): waits to be admitted at a step
    /// boundary, as a new process does; this rank is then behind.
    ///
    /// # Errors
    /// [`MembershipError::JoinFailed`](crate::MembershipError::JoinFailed) at the rendezvous timeout, or when the job ended; the
    /// store's errors.
    pub fn rejoin(&self) -> Result<Recovery> {
        let e = self.service()?;
        let _one = e.changing.lock().unwrap_or_else(|p| p.into_inner());
        let started = Instant::now();
        let deadline = started + e.config.timeouts.rendezvous;
        let (before, _) = e.epoch();
        let old = self.inner();
        old.comm.abort();
        old.p2p.close();
        loop {
            let (epoch, members) = e.admit(deadline).map_err(|err| e.cut_off(err))?;
            let inner = match e.connect_epoch(epoch, &members, e.connect_deadline(deadline)) {
                Ok(inner) => inner,
                Err(err) => {
                    e.end(epoch, Rank::ZERO, err.culprit(), err.to_string());
                    continue;
                }
            };
            self.install(inner);
            match e.exchange_progress(
                self,
                epoch,
                Vec::new(),
                members,
                None,
                format!(
                    "it asked again after being left out of epoch {}",
                    before + 1
                ),
                started,
            ) {
                Ok(r) => return Ok(r),
                Err(err) => e.end(epoch, self.rank(), err.culprit(), err.to_string()),
            }
        }
    }

    fn install(&self, inner: Inner) {
        let old = std::mem::replace(
            &mut *self
                .shared
                .current
                .write()
                .unwrap_or_else(|p| p.into_inner()),
            Arc::new(inner),
        );
        old.comm.abort();
        old.p2p.close();
    }

    /// Ends the current epoch (blaming `culprit`, a rank of it) and moves to the next one.
    fn change(
        &self,
        reason: String,
        culprit: Option<Rank>,
        progress: Option<u64>,
        failed: bool,
    ) -> Result<Recovery> {
        let e = self.service()?;
        let _one = e.changing.lock().unwrap_or_else(|p| p.into_inner());
        let started = Instant::now();
        let overall = started + e.config.timeouts.rendezvous;
        let (mut epoch, mut members) = e.epoch();
        let me = self.rank();
        e.end(epoch, me, culprit, reason.clone());
        if failed {
            // The neighbours stop at once instead of at their next check.
            let old = self.inner();
            old.comm.abort();
            old.p2p.close();
        }
        let (first, previous) = (epoch, members.clone());
        loop {
            let next_members = e
                .decide(epoch, &members, overall)
                .map_err(|err| e.cut_off(err))
                .inspect_err(|err| tracing::warn!("{err}"))?;
            let next = epoch + 1;
            e.begin(next, next_members.clone())?;
            let inner = match e.connect_epoch(next, &next_members, e.connect_deadline(overall)) {
                Ok(inner) => inner,
                Err(err) => {
                    tracing::warn!(
                        "[member {}] opening membership epoch {next} failed: {err}",
                        e.id
                    );
                    let me = next_members.iter().position(|m| *m == e.id).unwrap_or(0);
                    e.end(next, Rank(me as u32), err.culprit(), err.to_string());
                    (epoch, members) = (next, next_members);
                    continue;
                }
            };
            self.install(inner);
            // The record of the first epoch's end says best why (it may be another rank's).
            let why = e
                .blamed(first, &previous)
                .map_or_else(|_| reason.clone(), |(_, why)| why);
            match e.exchange_progress(
                self,
                next,
                previous.clone(),
                next_members.clone(),
                progress,
                why,
                started,
            ) {
                Ok(r) => return Ok(r),
                // Not a failure of the new group (no rank has any state): agreeing again
                // would end the same way.
                Err(err) if !err.is_peer_failure() => return Err(err),
                Err(err) => {
                    tracing::warn!(
                        "[member {}] membership epoch {next} failed at once: {err}",
                        e.id
                    );
                    e.end(next, self.rank(), err.culprit(), err.to_string());
                    (epoch, members) = (next, next_members);
                }
            }
        }
    }
}
