//! Which GPU a rank uses.
//!
//! The GPU that matters is the one holding the rank's tensors: NCCL reads and writes them. It is
//! taken from the model's parameters (or the gradients' device) when known. `LOCAL_RANK` is only
//! the default (PyTorch's `torch.cuda.set_device(LOCAL_RANK)` convention) and what the tensors'
//! device is checked against:
//!
//! - one visible device (a scheduler that gives each process its own GPU through
//!   `CUDA_VISIBLE_DEVICES`): device 0, whatever the local rank;
//! - several visible devices: device `LOCAL_RANK`; tensors on another device are an error naming
//!   both (the classic mistake: every rank builds its model on `Default::default()`, GPU 0).

use crate::error::CudaError;
use std::sync::Arc;

use cudarc::driver::CudaContext;

use super::status::driver_error;
use crate::error::{DdpError, Result};
use crate::group::ProcessGroup;
use crate::types::{LocalRank, Rank};

/// Whether the CUDA driver library (`libcuda`) can be loaded.
pub fn driver_present() -> bool {
    // SAFETY: only tries `dlopen` on the candidate names.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// The CUDA version the driver supports (`13.0`) and one line per device this process sees
/// (`GPU 0: NVIDIA H100 80GB HBM3, 81559 MiB`), straight from `libcuda` (what `burn-ddp gpus`
/// prints: `nvidia-smi -L` for machines that have the driver's library but not its tools).
///
/// # Errors
/// No CUDA driver, or the driver fails (with its error's name).
pub fn describe_gpus() -> Result<(String, Vec<String>)> {
    let rank = Rank(0);
    let count = device_count(rank)?;
    let mut version = 0;
    // SAFETY: `version` is written by the driver.
    unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut version) }
        .result()
        .map_err(|e| driver_error(rank, "cuDriverGetVersion", e))?;
    let mut lines = Vec::with_capacity(count);
    for ordinal in 0..count {
        let dev = cudarc::driver::result::device::get(ordinal as i32)
            .map_err(|e| driver_error(rank, "cuDeviceGet", e))?;
        let name = cudarc::driver::result::device::get_name(dev)
            .map_err(|e| driver_error(rank, "cuDeviceGetName", e))?;
        // SAFETY: `dev` came from `cuDeviceGet`.
        let bytes = unsafe { cudarc::driver::result::device::total_mem(dev) }
            .map_err(|e| driver_error(rank, "cuDeviceTotalMem", e))?;
        lines.push(format!("GPU {ordinal}: {name}, {} MiB", bytes >> 20));
    }
    Ok((format!("{}.{}", version / 1000, version % 1000 / 10), lines))
}

/// What this process sees, for choosing a device and for messages.
#[derive(Debug, Clone)]
pub(crate) struct Visible {
    /// Number of CUDA devices this process sees.
    pub count: usize,
    /// `CUDA_VISIBLE_DEVICES`, when set.
    pub list: Option<String>,
}

impl Visible {
    fn suffix(&self) -> String {
        self.list
            .as_deref()
            .map(|v| format!(" (CUDA_VISIBLE_DEVICES={v})"))
            .unwrap_or_default()
    }
}

/// The device ordinal (among the visible devices) of a rank: its tensors' device `tensors` when
/// known, checked against the one its local rank names; else the local rank's.
///
/// # Errors
/// No device at all, a local rank without a device (more ranks than GPUs on a node), or tensors
/// on another GPU than the local rank's.
pub(crate) fn choose_ordinal(
    rank: Rank,
    local_rank: LocalRank,
    tensors: Option<usize>,
    visible: &Visible,
) -> Result<usize> {
    let no_gpu = || {
        DdpError::Cuda(CudaError::NoGpuForRank {
            rank,
            local_rank,
            count: visible.count,
            visible: visible.suffix(),
        })
    };
    let by_local_rank = match visible.count {
        0 => return Err(no_gpu()),
        // One device per process: it is this rank's, whatever LOCAL_RANK says.
        1 => 0,
        n if (local_rank.0 as usize) < n => local_rank.0 as usize,
        // More local ranks than devices: only the tensors can say which GPU (NCCL refuses two
        // ranks on one GPU, and says so).
        _ => return tensors.filter(|&t| t < visible.count).ok_or_else(no_gpu),
    };
    match tensors {
        None => Ok(by_local_rank),
        Some(t) if t == by_local_rank => Ok(t),
        Some(t) => Err(DdpError::Cuda(CudaError::DeviceMismatch {
            rank,
            what: "the model's parameters",
            found: t,
            expected_why: format!(
                "LOCAL_RANK {local_rank} means GPU {by_local_rank} of the {} this process sees{}",
                visible.count,
                visible.suffix()
            ),
        })),
    }
}

/// Number of CUDA devices this process sees.
///
/// # Errors
/// No CUDA driver, or the driver fails.
pub fn device_count(rank: Rank) -> Result<usize> {
    if !driver_present() {
        return Err(DdpError::Cuda(CudaError::Driver {
            rank,
            what: "loading the CUDA driver (libcuda.so)".into(),
            detail: "the library was not found: this machine has no NVIDIA driver, or the \
                     container was started without GPU access (`--gpus all`)"
                .into(),
        }));
    }
    let n = CudaContext::device_count().map_err(|e| driver_error(rank, "cuDeviceGetCount", e))?;
    Ok(usize::try_from(n).unwrap_or(0))
}

pub(crate) fn visible(rank: Rank) -> Result<Visible> {
    Ok(Visible {
        count: device_count(rank)?,
        list: crate::config::env::cuda_visible_devices(),
    })
}

/// The GPU ordinal of this rank: `tensors` (the device of its model) if given, checked against
/// its `LOCAL_RANK`; else the one its `LOCAL_RANK` names (see the module documentation).
///
/// # Errors
/// No driver, no GPU for this rank, or tensors on another GPU than the local rank's.
pub fn ordinal_for(rank: Rank, local_rank: LocalRank, tensors: Option<usize>) -> Result<usize> {
    choose_ordinal(rank, local_rank, tensors, &visible(rank)?)
}

/// The primary context of GPU `ordinal` (the context Burn's CUDA backend uses too).
///
/// # Errors
/// A driver failure.
pub(crate) fn context(rank: Rank, ordinal: usize) -> Result<Arc<CudaContext>> {
    CudaContext::new(ordinal).map_err(|e| driver_error(rank, format!("opening GPU {ordinal}"), e))
}

/// The primary context of the GPU for `local_rank` (see the module documentation).
///
/// # Errors
/// No driver, no GPU for this local rank, or a driver failure.
pub fn context_for(rank: Rank, local_rank: LocalRank) -> Result<Arc<CudaContext>> {
    context(rank, ordinal_for(rank, local_rank, None)?)
}

/// The ordinal (among the visible devices) of this rank's GPU: with one visible GPU per
/// process, that GPU; with several, the one `LOCAL_RANK` names.
///
/// ```no_run
/// # fn main() -> burn_ddp_comm::Result<()> {
/// let group = burn_ddp_comm::ProcessGroup::from_env()?;
/// let ordinal = burn_ddp_comm::cuda::rank_ordinal(&group)?;
/// # Ok(()) }
/// ```
///
/// # Errors
/// No driver, or no GPU for this rank.
pub fn rank_ordinal(pg: &ProcessGroup) -> Result<usize> {
    ordinal_for(pg.rank(), pg.local_rank(), None)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sees(count: usize, list: Option<&str>) -> Visible {
        Visible {
            count,
            list: list.map(str::to_owned),
        }
    }

    #[test]
    fn local_rank_picks_its_gpu_or_says_how_many_there_are() {
        let two = sees(2, None);
        assert_eq!(
            choose_ordinal(Rank(5), LocalRank(1), None, &two).unwrap(),
            1
        );
        let e = choose_ordinal(Rank(6), LocalRank(2), None, &sees(2, Some("0,1"))).unwrap_err();
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
        let none = choose_ordinal(Rank(0), LocalRank(0), None, &sees(0, None)).unwrap_err();
        assert!(
            none.to_string().contains("shows 0 CUDA device(s)."),
            "{none}"
        );
        // A model on a real device does not conjure one up where none is visible.
        assert!(choose_ordinal(Rank(0), LocalRank(0), Some(0), &sees(0, None)).is_err());
    }

    #[test]
    fn one_visible_gpu_per_process_is_every_local_ranks_gpu() {
        // A scheduler (Slurm --gpus-per-task=1, Kubernetes) sets CUDA_VISIBLE_DEVICES to one GPU
        // per process: local rank 3 sees one device, ordinal 0.
        let one = sees(1, Some("3"));
        for local in 0..8 {
            assert_eq!(
                choose_ordinal(Rank(local), LocalRank(local), None, &one).unwrap(),
                0
            );
            assert_eq!(
                choose_ordinal(Rank(local), LocalRank(local), Some(0), &one).unwrap(),
                0
            );
        }
    }

    #[test]
    fn tensors_on_another_gpu_than_the_local_ranks_are_named_with_both() {
        // Every rank built its model on Default::default() (GPU 0); rank 1 should use GPU 1.
        let four = sees(4, None);
        assert_eq!(
            choose_ordinal(Rank(0), LocalRank(0), Some(0), &four).unwrap(),
            0
        );
        let e = choose_ordinal(Rank(1), LocalRank(1), Some(0), &four).unwrap_err();
        let text = e.to_string();
        assert!(
            matches!(
                e,
                DdpError::Cuda(CudaError::DeviceMismatch { found: 0, .. })
            ),
            "{text}"
        );
        assert!(
            text.starts_with("[rank 1] the model's parameters are on GPU 0, but LOCAL_RANK 1 means GPU 1 of the 4 this process sees"),
            "{text}"
        );
        assert!(text.contains("rank_device"), "{text}");
        let listed = choose_ordinal(Rank(9), LocalRank(1), Some(2), &sees(4, Some("4,5,6,7")))
            .unwrap_err()
            .to_string();
        assert!(
            listed.contains("(CUDA_VISIBLE_DEVICES=4,5,6,7)"),
            "{listed}"
        );
    }

    #[test]
    fn more_local_ranks_than_gpus_follow_the_tensors() {
        let two = sees(2, None);
        assert_eq!(
            choose_ordinal(Rank(3), LocalRank(3), Some(1), &two).unwrap(),
            1
        );
        assert!(choose_ordinal(Rank(3), LocalRank(3), Some(2), &two).is_err());
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
