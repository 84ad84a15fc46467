//! CUDA support (feature `cuda`): [`rank_device`], the Burn device of a rank, and everything of
//! `burn_ddp_comm::cuda` (finding `libnccl`, choosing a rank's GPU, [`NcclComm`]) re-exported.
//!
//! - `mod.rs`: this module (the zero-copy gradient path of `Autodiff<Ddp<Cuda>>` itself is
//!   part of the reducer: `ddp/gpu.rs`)

pub use burn_ddp_comm::cuda::*;

use cubecl::cuda::CudaDevice;

use crate::{ProcessGroup, Result};

/// The Burn CUDA device of this rank: where to build its model and put its batches
/// (`Autodiff<Ddp<Cuda>>`'s device). One visible GPU per process: that GPU; several: the one
/// `LOCAL_RANK` names.
///
/// ```no_run
/// # extern crate burn_ddp_burn021 as burn_ddp;
/// # fn main() -> burn_ddp::Result<()> {
/// let group = burn_ddp::ProcessGroup::from_env()?;
/// let device = burn_ddp::cuda::rank_device(&group)?; // burn::backend::cuda::CudaDevice
/// # Ok(()) }
/// ```
///
/// # Errors
/// No driver, or no GPU for this rank.
pub fn rank_device(pg: &ProcessGroup) -> Result<CudaDevice> {
    Ok(CudaDevice {
        index: rank_ordinal(pg)?,
    })
}
