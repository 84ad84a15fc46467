//! [`connect_for_grads`]: the collective decision to reduce gradients with NCCL, and the
//! communicator it makes. Both Burn lines call it when a model on a GPU is prepared: every rank
//! must take the same decision, or some would wait in NCCL for ranks that use the host-staged
//! transport.

use super::device::ordinal_for;
use super::library::usable_nccl;
use super::nccl::NcclComm;
use crate::config::GradTransport;
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
/// 3. the communicator is created (non-blocking, with the rendezvous deadline) and one small
///    all-reduce connects its peers (NCCL 2.19+ connects lazily, inside a first collective);
/// 4. a second vote: if any rank failed there, every rank drops NCCL together.
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
    const FAILED: i64 = 0;
    const NO_NCCL: i64 = 1;
    const READY: i64 = 2;
    let rank = pg.rank();
    let local = usable_nccl().and_then(|_| ordinal_for(rank, pg.local_rank(), ordinal));
    let mine = match &local {
        Ok(_) => READY,
        Err(DdpError::NcclUnavailable { .. } | DdpError::Cuda { .. }) => NO_NCCL,
        Err(_) => FAILED,
    };
    let mut vote = [mine];
    pg.all_reduce(&mut vote, ReduceOp::Min)?;
    let refuse = |why: DdpError| -> Result<Option<NcclComm>> {
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
            return Err(DdpError::Model {
                rank,
                what: "choosing the GPUs for NCCL",
                reason: "another rank failed (see its error)".into(),
            })
        }
        (Err(e), _) => return refuse(e),
        (Ok(_), NO_NCCL) => {
            return refuse(DdpError::NcclUnavailable {
                detail: "another rank cannot use NCCL (see its warning); every rank uses the \
                         host-staged transport so that they stay in step"
                    .into(),
            })
        }
        (Ok(o), _) => o,
    };
    // Every failure here goes to the second vote (none returns early): the other ranks wait in
    // it.
    let made = NcclComm::on_device(pg, ordinal).and_then(|c| c.warm_up().map(|()| c));
    let mut vote = [i64::from(made.is_ok())];
    pg.all_reduce(&mut vote, ReduceOp::Min)?;
    match made {
        Ok(comm) if vote[0] == 1 => Ok(Some(comm)),
        Ok(comm) => {
            comm.abort();
            refuse(DdpError::NcclUnavailable {
                detail: "another rank could not create its NCCL communicator (see its error); \
                         every rank uses the host-staged transport so that they stay in step"
                    .into(),
            })
        }
        Err(e) => refuse(e),
    }
}
