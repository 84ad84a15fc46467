//! [`connect_for_grads`]: the collective decision to reduce gradients with NCCL, and the
//! communicator it makes. Both Burn lines call it when a model on a GPU is prepared: every rank
//! must take the same decision, or some would wait in NCCL for ranks that use the host-staged
//! transport.

use super::device::ordinal_for;
use super::library::usable_nccl;
use super::nccl::NcclComm;
use crate::config::GradTransport;
use crate::error::CudaError;
use crate::error::{DdpError, Result};
use crate::group::ProcessGroup;
use crate::types::ReduceOp;

/// Whether gradient synchronisation over `pg` with `transport` would use NCCL for gradients on
/// a GPU: not with [`GradTransport::Host`], and at world size 1 only when
/// [`GradTransport::Nccl`] asks for it (the average of one rank is its gradient; the explicit
/// choice is how a one-GPU machine exercises the device path, since NCCL refuses two ranks on
/// one GPU).
pub fn wants_nccl(pg: &ProcessGroup, transport: GradTransport) -> bool {
    transport != GradTransport::Host
        && (pg.world_size().get() > 1 || transport == GradTransport::Nccl)
}

/// Sets up NCCL for the gradients of a model on GPU `ordinal` (its parameters' device; `None`:
/// the rank's default GPU), collectively: every rank of `pg` calls it at the same point.
///
/// 1. each rank checks it can: NCCL loads (2.14+), and its GPU is the one its `LOCAL_RANK`
///    names (a model on another GPU is an error on every transport);
/// 2. one vote (a host all-reduce): all can, some cannot load NCCL, or a rank has an error
///    (every rank fails);
/// 3. the communicator is created *on trial* ([`NcclComm::probe`]: non-blocking, with the
///    rendezvous deadline) and one small all-reduce connects its peers (NCCL 2.19+ connects
///    lazily, inside a first collective). A failure here (two ranks on one GPU, say, which NCCL
///    reports asynchronously) aborts this rank's communicator only: it is not published as the
///    job's failure, which would stop every rank's host collectives, the vote below included;
/// 4. a second vote: if any rank failed there, every rank drops NCCL together; else each
///    accepts its communicator ([`NcclComm::accept`]), whose failures are the job's from then
///    on.
///
/// `Ok(None)`: every rank goes on with the host-staged transport (with [`GradTransport::Auto`],
/// when some rank cannot use NCCL; a warning says why). Call it only where [`wants_nccl`].
///
/// # Errors
/// A rank's GPU is not its local rank's; with [`GradTransport::Nccl`], any rank that cannot
/// use NCCL; host collective failures.
pub fn connect_for_grads(
    pg: &ProcessGroup,
    transport: GradTransport,
    ordinal: Option<usize>,
) -> Result<Option<NcclComm>> {
    let rank = pg.rank();
    let local = usable_nccl().and_then(|_| ordinal_for(rank, pg.local_rank(), ordinal));
    decide(pg, transport, local, |ordinal| {
        NcclComm::probe(pg, ordinal).and_then(|c| c.warm_up().map(|()| c))
    })
}

/// [`connect_for_grads`] for a model placed on GPU `ordinal` (`None`: on another device, or
/// without parameters; `placed` names where, for the error), after one vote that every rank's
/// model is on a GPU or none is. Collective: every rank of `pg` calls it at the same point
/// (both lines' DDP `prepare` and FSDP's `shard`). `Ok(None)`: the host-staged transport
/// (`transport` does not want NCCL here, no model is on a GPU, or some rank cannot use NCCL).
///
/// # Errors
/// Some ranks' models are on a GPU and others' not; `transport` is `Nccl` for a model that is
/// not on a CUDA device; what [`connect_for_grads`] fails with.
pub fn connect_where_placed(
    pg: &ProcessGroup,
    transport: GradTransport,
    ordinal: Option<usize>,
    placed: &str,
) -> Result<Option<NcclComm>> {
    if !wants_nccl(pg, transport) {
        return Ok(None);
    }
    let mut votes = [i64::from(ordinal.is_some()), i64::from(ordinal.is_none())];
    pg.all_reduce(&mut votes, ReduceOp::Sum)?;
    if votes[0] > 0 && votes[1] > 0 {
        return Err(DdpError::model_access(
            pg.rank(),
            "choosing how gradients travel",
            format!(
                "{} rank(s) placed a model on a CUDA device and {} on another device \
                 (this rank: {placed}); put every rank's model on its GPU \
                 (burn_ddp::cuda::rank_device), or every rank's on the CPU",
                votes[0], votes[1],
            ),
        ));
    }
    let Some(ordinal) = ordinal else {
        if transport == GradTransport::Nccl {
            return Err(DdpError::Config(crate::error::ConfigError::InvalidConfig {
                field: "DdpConfig::transport",
                reason: "GradTransport::Nccl needs a model on a CUDA device (see \
                         burn_ddp::cuda::rank_device); other devices use GradTransport::Host \
                         or Auto",
            }));
        }
        return Ok(None);
    };
    connect_for_grads(pg, transport, Some(ordinal))
}

/// A communicator on trial, as the vote needs it.
trait Trial {
    /// Kept by every rank: its failures are the job's from now on.
    fn accept(&self);
    /// Dropped because another rank failed its trial.
    fn abort(&self);
}

impl Trial for NcclComm {
    fn accept(&self) {
        NcclComm::accept(self);
    }

    fn abort(&self) {
        NcclComm::abort(self);
    }
}

/// The two votes of [`connect_for_grads`]: `local` is this rank's own check (its GPU, or why it
/// cannot use NCCL), `make` creates and warms up its communicator on trial.
fn decide<C: Trial>(
    pg: &ProcessGroup,
    transport: GradTransport,
    local: Result<usize>,
    make: impl FnOnce(usize) -> Result<C>,
) -> Result<Option<C>> {
    const FAILED: i64 = 0;
    const NO_NCCL: i64 = 1;
    const READY: i64 = 2;
    let rank = pg.rank();
    let mine = match &local {
        Ok(_) => READY,
        Err(
            DdpError::Cuda(CudaError::NcclUnavailable { .. })
            | DdpError::Cuda(CudaError::Driver { .. }),
        ) => NO_NCCL,
        Err(_) => FAILED,
    };
    let mut vote = [mine];
    pg.all_reduce(&mut vote, ReduceOp::Min)?;
    let refuse = |why: DdpError| -> Result<Option<C>> {
        if transport == GradTransport::Nccl {
            return Err(why);
        }
        tracing::warn!(
            "[rank {rank}] gradients of CUDA tensors go through the host-staged transport: {why}"
        );
        Ok(None)
    };
    let ordinal = match (local, vote[0]) {
        (Err(e), _) if mine == FAILED => return Err(e),
        (_, FAILED) => {
            return Err(DdpError::model_access(
                rank,
                "choosing the GPUs for NCCL",
                "another rank failed (see its error)",
            ))
        }
        (Err(e), _) => return refuse(e),
        (Ok(_), NO_NCCL) => {
            return refuse(DdpError::Cuda(CudaError::NcclUnavailable {
                detail: "another rank cannot use NCCL (see its warning); every rank uses the \
                         host-staged transport so that they stay in step"
                    .into(),
            }))
        }
        (Ok(o), _) => o,
    };
    // Every failure here goes to the second vote (none returns early, none is published to the
    // job): the other ranks wait in it.
    let made = make(ordinal);
    let mut vote = [i64::from(made.is_ok())];
    pg.all_reduce(&mut vote, ReduceOp::Min)?;
    match made {
        Ok(comm) if vote[0] == 1 => {
            comm.accept();
            Ok(Some(comm))
        }
        Ok(comm) => {
            comm.abort();
            refuse(DdpError::Cuda(CudaError::NcclUnavailable {
                detail: "another rank could not create its NCCL communicator (see its error); \
                         every rank uses the host-staged transport so that they stay in step"
                    .into(),
            }))
        }
        Err(e) => refuse(e),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};

    use super::*;
    use crate::types::WorldSize;
    use crate::Timeouts;

    /// A communicator on trial that records what the vote did with it.
    #[derive(Default)]
    struct Fake {
        accepted: AtomicBool,
        aborted: AtomicBool,
    }

    impl Trial for Fake {
        fn accept(&self) {
            self.accepted.store(true, Ordering::SeqCst);
        }

        fn abort(&self) {
            self.aborted.store(true, Ordering::SeqCst);
        }
    }

    /// What one rank of a 3-rank group gets when its local check and its trial give these.
    #[derive(Clone, Copy)]
    enum Rank1 {
        Ready,
        NoNccl,
        WrongGpu,
        TrialFails,
    }

    fn unavailable(why: &str) -> DdpError {
        DdpError::Cuda(CudaError::NcclUnavailable { detail: why.into() })
    }

    /// One rank's result of the votes, and `Some((accepted, aborted))` if it made a communicator.
    type Outcome = (Result<Option<()>>, Option<(bool, bool)>);

    /// Runs the votes on 3 ranks (threads); rank 1 behaves as `rank1`. Returns each rank's
    /// outcome, and `Some((accepted, aborted))` where it made a communicator. Every rank checks
    /// that the host collectives still work afterwards.
    fn run(transport: GradTransport, rank1: Rank1) -> Vec<Outcome> {
        let groups = ProcessGroup::local(WorldSize::new(3).unwrap(), Timeouts::default());
        let threads: Vec<_> = groups
            .into_iter()
            .map(|pg| {
                std::thread::spawn(move || {
                    let me = pg.rank().0;
                    let behaviour = if me == 1 { rank1 } else { Rank1::Ready };
                    let local = match behaviour {
                        Rank1::NoNccl => Err(unavailable("libnccl.so.2 not found")),
                        Rank1::WrongGpu => Err(DdpError::Cuda(CudaError::DeviceMismatch {
                            rank: pg.rank(),
                            what: "the model",
                            found: 0,
                            expected_why: "LOCAL_RANK 1 names GPU 1".into(),
                        })),
                        _ => Ok(me as usize),
                    };
                    let made = std::sync::Arc::new(Fake::default());
                    let tried = AtomicBool::new(false);
                    let outcome = decide(&pg, transport, local, |_| {
                        tried.store(true, Ordering::SeqCst);
                        match behaviour {
                            // As NCCL reports two ranks on one GPU: asynchronously, at creation.
                            Rank1::TrialFails => Err(unavailable("Duplicate GPU detected")),
                            _ => Ok(std::sync::Arc::clone(&made)),
                        }
                    });
                    let marks = (tried.load(Ordering::SeqCst)
                        && !matches!(behaviour, Rank1::TrialFails))
                    .then(|| {
                        (
                            made.accepted.load(Ordering::SeqCst),
                            made.aborted.load(Ordering::SeqCst),
                        )
                    });
                    // The host transport the ranks fall back to still works on every rank.
                    let mut x = [1.0f32];
                    pg.all_reduce(&mut x, ReduceOp::Sum).unwrap();
                    assert_eq!(x, [3.0]);
                    (outcome.map(|o| o.map(drop)), marks)
                })
            })
            .collect();
        threads.into_iter().map(|t| t.join().unwrap()).collect()
    }

    impl Trial for std::sync::Arc<Fake> {
        fn accept(&self) {
            Fake::accept(self);
        }

        fn abort(&self) {
            Fake::abort(self);
        }
    }

    #[test]
    fn every_rank_accepts_when_every_trial_succeeds() {
        for (rank, (outcome, marks)) in run(GradTransport::Auto, Rank1::Ready)
            .into_iter()
            .enumerate()
        {
            assert!(matches!(outcome, Ok(Some(()))), "rank {rank}: {outcome:?}");
            assert_eq!(marks, Some((true, false)), "rank {rank}");
        }
    }

    #[test]
    fn a_failed_trial_on_one_rank_makes_every_rank_fall_back_under_auto() {
        for (rank, (outcome, marks)) in run(GradTransport::Auto, Rank1::TrialFails)
            .into_iter()
            .enumerate()
        {
            assert!(matches!(outcome, Ok(None)), "rank {rank}: {outcome:?}");
            if rank == 1 {
                assert_eq!(marks, None, "rank 1 made no communicator");
            } else {
                // Made, then dropped together, never accepted.
                assert_eq!(marks, Some((false, true)), "rank {rank}");
            }
        }
    }

    #[test]
    fn a_failed_trial_fails_every_rank_when_nccl_is_required() {
        for (rank, (outcome, marks)) in run(GradTransport::Nccl, Rank1::TrialFails)
            .into_iter()
            .enumerate()
        {
            let e = outcome.unwrap_err().to_string();
            if rank == 1 {
                assert!(e.contains("Duplicate GPU"), "{e}");
            } else {
                assert!(e.contains("another rank could not create"), "{e}");
                assert_eq!(marks, Some((false, true)), "rank {rank}");
            }
        }
    }

    #[test]
    fn a_rank_without_nccl_makes_every_rank_fall_back_before_any_trial() {
        for (rank, (outcome, marks)) in run(GradTransport::Auto, Rank1::NoNccl)
            .into_iter()
            .enumerate()
        {
            assert!(matches!(outcome, Ok(None)), "rank {rank}: {outcome:?}");
            assert_eq!(marks, None, "rank {rank} tried NCCL");
        }
    }

    #[test]
    fn a_rank_on_the_wrong_gpu_fails_every_rank_whatever_the_transport() {
        for (rank, (outcome, marks)) in run(GradTransport::Auto, Rank1::WrongGpu)
            .into_iter()
            .enumerate()
        {
            let e = outcome.unwrap_err().to_string();
            let expected = if rank == 1 {
                "LOCAL_RANK 1"
            } else {
                "another rank failed"
            };
            assert!(e.contains(expected), "rank {rank}: {e}");
            assert_eq!(marks, None, "rank {rank} tried NCCL");
        }
    }

    /// What each of 2 ranks gets from [`connect_where_placed`] with the model of rank `r` on
    /// `placed[r]`, under `transport`; each checks the host collectives afterwards.
    fn placed(transport: GradTransport, placed: [Option<usize>; 2]) -> Vec<Result<bool>> {
        let groups = ProcessGroup::local(WorldSize::new(2).unwrap(), Timeouts::default());
        let threads: Vec<_> = groups
            .into_iter()
            .map(|pg| {
                std::thread::spawn(move || {
                    let ordinal = placed[pg.rank().0 as usize];
                    let out =
                        connect_where_placed(&pg, transport, ordinal, "Cpu").map(|c| c.is_some());
                    let mut x = [1.0f32];
                    pg.all_reduce(&mut x, ReduceOp::Sum).unwrap();
                    assert_eq!(x, [2.0]);
                    out
                })
            })
            .collect();
        threads.into_iter().map(|t| t.join().unwrap()).collect()
    }

    #[test]
    fn models_on_a_gpu_on_some_ranks_only_fail_every_rank_before_nccl() {
        for transport in [GradTransport::Auto, GradTransport::Nccl] {
            for (rank, outcome) in placed(transport, [Some(0), None]).into_iter().enumerate() {
                let e = outcome.unwrap_err().to_string();
                assert!(
                    e.contains("1 rank(s) placed a model on a CUDA device and 1"),
                    "{e}"
                );
                assert!(e.contains("rank_device"), "rank {rank}: {e}");
            }
        }
    }

    #[test]
    fn models_on_no_gpu_stay_on_the_host_unless_nccl_is_required() {
        for outcome in placed(GradTransport::Auto, [None, None]) {
            assert!(!outcome.unwrap());
        }
        for outcome in placed(GradTransport::Host, [Some(0), None]) {
            assert!(
                !outcome.unwrap(),
                "the host transport asks nothing of the placement"
            );
        }
        for outcome in placed(GradTransport::Nccl, [None, None]) {
            let e = outcome.unwrap_err().to_string();
            assert!(e.contains("needs a model on a CUDA device"), "{e}");
        }
    }
}
