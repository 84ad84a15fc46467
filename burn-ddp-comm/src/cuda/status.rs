//! NCCL and CUDA driver results as text a user can act on.

use crate::error::CudaError;
use std::ffi::CStr;

use cudarc::driver::DriverError;
use cudarc::nccl::sys::{self, ncclResult_t};

use crate::error::DdpError;
use crate::types::Rank;

/// NCCL's name for a result code.
pub(crate) fn code_name(code: ncclResult_t) -> &'static str {
    match code {
        ncclResult_t::ncclSuccess => "ncclSuccess",
        ncclResult_t::ncclUnhandledCudaError => "ncclUnhandledCudaError",
        ncclResult_t::ncclSystemError => "ncclSystemError",
        ncclResult_t::ncclInternalError => "ncclInternalError",
        ncclResult_t::ncclInvalidArgument => "ncclInvalidArgument",
        ncclResult_t::ncclInvalidUsage => "ncclInvalidUsage",
        ncclResult_t::ncclRemoteError => "ncclRemoteError",
        ncclResult_t::ncclInProgress => "ncclInProgress",
        ncclResult_t::ncclTimeout => "ncclTimeout",
        ncclResult_t::ncclNumResults => "ncclNumResults",
    }
}

/// What usually causes a failure with `code`, and what to do about it.
pub(crate) fn hint(code: ncclResult_t) -> &'static str {
    match code {
        ncclResult_t::ncclUnhandledCudaError => {
            "A CUDA call inside NCCL failed: out of GPU memory, a buffer that is not device \
             memory, or a GPU error earlier in this process (run with CUDA_LAUNCH_BLOCKING=1 \
             and NCCL_DEBUG=WARN to see which)"
        }
        ncclResult_t::ncclSystemError => {
            "A system call failed: usually the network between nodes (set NCCL_SOCKET_IFNAME \
             to the interface the nodes share) or shared memory in a container (start it with \
             a larger /dev/shm, e.g. `docker run --shm-size=1g`). NCCL_DEBUG=WARN shows which"
        }
        ncclResult_t::ncclInternalError => {
            "NCCL hit an internal error; NCCL_DEBUG=WARN shows its cause. Check that every node \
             has the same NCCL version"
        }
        ncclResult_t::ncclInvalidArgument => {
            "NCCL refused an argument: a null or foreign device pointer, a data type this NCCL \
             lacks (bfloat16 needs 2.10+), or a root outside the group"
        }
        ncclResult_t::ncclInvalidUsage => {
            "NCCL refused how it was used: most often two ranks bound to the same GPU (check \
             LOCAL_RANK and CUDA_VISIBLE_DEVICES; ranks that share a GPU must use the \
             host-staged transport, GradTransport::Host), or ranks that disagree on the world \
             size"
        }
        ncclResult_t::ncclRemoteError => {
            "A remote rank failed or closed its connection: look at the other ranks' output \
             for the first error"
        }
        ncclResult_t::ncclInProgress => {
            "The operation had not finished; burn-ddp waits for it with a deadline"
        }
        ncclResult_t::ncclTimeout => {
            "NCCL timed out waiting for a peer: a rank died or stalls, or the network is \
             partitioned"
        }
        ncclResult_t::ncclSuccess | ncclResult_t::ncclNumResults => "",
    }
}

/// NCCL's own text for a result code (`ncclGetErrorString`), with its name.
pub(crate) fn code_text(code: ncclResult_t) -> String {
    if !super::nccl_present() {
        return code_name(code).to_string();
    }
    // SAFETY: `ncclGetErrorString` returns a pointer to a static, NUL-terminated string for
    // every code, or null.
    let text = unsafe {
        let p = sys::ncclGetErrorString(code);
        (!p.is_null()).then(|| CStr::from_ptr(p).to_string_lossy().into_owned())
    };
    match text {
        Some(t) if !t.is_empty() => format!("{} ({t})", code_name(code)),
        _ => code_name(code).to_string(),
    }
}

/// The error for a failed NCCL call, with `last_error` (`ncclGetLastError`'s text) if any.
pub(crate) fn nccl_error(
    rank: Rank,
    call: impl Into<String>,
    code: ncclResult_t,
    last_error: Option<String>,
) -> DdpError {
    DdpError::Cuda(CudaError::Nccl {
        rank,
        call: call.into(),
        code: code_text(code),
        detail: last_error
            .filter(|s| !s.trim().is_empty())
            .map(|s| format!(": {}", s.trim()))
            .unwrap_or_default(),
        hint: hint(code),
    })
}

/// The error for a failed CUDA driver call.
pub(crate) fn driver_error(rank: Rank, what: impl Into<String>, e: DriverError) -> DdpError {
    use cudarc::driver::sys::CUresult;
    let advice = match e.0 {
        CUresult::CUDA_ERROR_NO_DEVICE => {
            ": no CUDA device is visible to this process (check CUDA_VISIBLE_DEVICES and \
             `nvidia-smi`)"
        }
        CUresult::CUDA_ERROR_INVALID_DEVICE => ": this device ordinal does not exist here",
        CUresult::CUDA_ERROR_OUT_OF_MEMORY => ": the GPU is out of memory",
        CUresult::CUDA_ERROR_NOT_INITIALIZED | CUresult::CUDA_ERROR_INVALID_CONTEXT => {
            ": the CUDA context is not usable in this thread"
        }
        _ => "",
    };
    let name = e
        .error_name()
        .ok()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| format!("{:?}", e.0));
    DdpError::Cuda(CudaError::Driver {
        rank,
        what: what.into(),
        detail: format!("{name}{advice}"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const ALL: [ncclResult_t; 8] = [
        ncclResult_t::ncclUnhandledCudaError,
        ncclResult_t::ncclSystemError,
        ncclResult_t::ncclInternalError,
        ncclResult_t::ncclInvalidArgument,
        ncclResult_t::ncclInvalidUsage,
        ncclResult_t::ncclRemoteError,
        ncclResult_t::ncclInProgress,
        ncclResult_t::ncclTimeout,
    ];

    #[test]
    fn every_failure_code_has_a_name_and_advice() {
        for code in ALL {
            assert!(code_name(code).starts_with("nccl"), "{code:?}");
            assert!(hint(code).len() > 40, "{code:?} has no useful hint");
            assert!(code_text(code).starts_with(code_name(code)), "{code:?}");
        }
    }

    #[test]
    fn nccl_errors_name_the_rank_the_call_and_the_cause() {
        let e = nccl_error(
            Rank(3),
            "ncclAllReduce (all_reduce #7, 1024 x float)",
            ncclResult_t::ncclInvalidUsage,
            Some("Duplicate GPU detected : rank 3 and rank 2 both on CUDA device 0\n".into()),
        );
        let text = e.to_string();
        assert!(
            text.starts_with("[rank 3] NCCL ncclAllReduce (all_reduce #7"),
            "{text}"
        );
        assert!(text.contains("ncclInvalidUsage"), "{text}");
        assert!(text.contains(": Duplicate GPU detected"), "{text}");
        assert!(text.contains("GradTransport::Host"), "{text}");
        assert_eq!(e.rank(), Some(Rank(3)));
        let quiet = nccl_error(
            Rank(0),
            "x",
            ncclResult_t::ncclSystemError,
            Some("  ".into()),
        );
        assert!(
            quiet.to_string().contains("ncclSystemError. A system call"),
            "{quiet}"
        );
    }
}
