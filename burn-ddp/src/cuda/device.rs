//! Which GPU a rank uses: the one at its `LOCAL_RANK` among the devices this process sees.

use std::sync::Arc;

use cudarc::driver::CudaContext;

use super::status::driver_error;
use crate::error::{DdpError, Result};
use crate::group::{LocalRank, Rank};

/// Whether the CUDA driver library (`libcuda`) can be loaded.
pub fn driver_present() -> bool {
    // SAFETY: only tries `dlopen` on the candidate names.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// The device ordinal for `local_rank` when `count` devices are visible (PyTorch's
/// `torch.cuda.set_device(LOCAL_RANK)` convention).
pub(crate) fn ordinal_for(
    rank: Rank,
    local_rank: LocalRank,
    count: usize,
    visible: Option<&str>,
) -> Result<usize> {
    let ordinal = local_rank.0 as usize;
    if ordinal < count {
        return Ok(ordinal);
    }
    Err(DdpError::NoGpuForRank {
        rank,
        local_rank,
        count,
        visible: visible
            .map(|v| format!(" (CUDA_VISIBLE_DEVICES={v})"))
            .unwrap_or_default(),
    })
}

/// Number of CUDA devices this process sees.
///
/// # Errors
/// No CUDA driver, or the driver fails.
pub fn device_count(rank: Rank) -> Result<usize> {
    if !driver_present() {
        return Err(DdpError::Cuda {
            rank,
            what: "loading the CUDA driver (libcuda.so)".into(),
            detail: "the library was not found: this machine has no NVIDIA driver, or the \
                     container was started without GPU access (`--gpus all`)"
                .into(),
        });
    }
    let n = CudaContext::device_count().map_err(|e| driver_error(rank, "cuDeviceGetCount", e))?;
    Ok(usize::try_from(n).unwrap_or(0))
}

/// The primary context of the GPU for `local_rank` (the context Burn's CUDA backend uses too).
///
/// # Errors
/// No driver, no GPU for this local rank, or a driver failure.
pub fn context_for(rank: Rank, local_rank: LocalRank) -> Result<Arc<CudaContext>> {
    let count = device_count(rank)?;
    let visible = std::env::var("CUDA_VISIBLE_DEVICES").ok();
    let ordinal = ordinal_for(rank, local_rank, count, visible.as_deref())?;
    CudaContext::new(ordinal).map_err(|e| driver_error(rank, format!("opening GPU {ordinal}"), e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn local_rank_picks_its_gpu_or_says_how_many_there_are() {
        assert_eq!(ordinal_for(Rank(5), LocalRank(1), 2, None).unwrap(), 1);
        let e = ordinal_for(Rank(6), LocalRank(2), 2, Some("0,1")).unwrap_err();
        let text = e.to_string();
        assert!(
            text.starts_with("[rank 6] no GPU for local rank 2"),
            "{text}"
        );
        assert!(
            text.contains("shows 2 CUDA device(s) (CUDA_VISIBLE_DEVICES=0,1)"),
            "{text}"
        );
        assert!(text.contains("--nproc-per-node 2"), "{text}");
        let none = ordinal_for(Rank(0), LocalRank(0), 0, None).unwrap_err();
        assert!(
            none.to_string().contains("shows 0 CUDA device(s)."),
            "{none}"
        );
    }

    #[test]
    fn no_driver_is_an_error_not_a_panic() {
        match device_count(Rank(0)) {
            Ok(_) => assert!(driver_present()),
            Err(e) => {
                assert!(!driver_present(), "{e}");
                assert!(e.to_string().contains("libcuda.so"), "{e}");
            }
        }
    }
}
