//! CUDA support through cudarc (feature `cuda`).
//!
//! cudarc loads `libcuda` and `libnccl` when first used, so burn-ddp builds on machines without
//! a CUDA toolkit; this module turns a missing library into an error instead of cudarc's panic.
//! The NCCL communicator is to be built on it.

use std::fmt;

use cudarc::nccl::{result, sys};

use crate::error::{DdpError, Result};

/// An NCCL library version, as `ncclGetVersion` reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct NcclVersion {
    /// Major version.
    pub major: u32,
    /// Minor version.
    pub minor: u32,
    /// Patch level.
    pub patch: u32,
}

impl NcclVersion {
    /// Decodes NCCL's integer version code (`major*10000 + minor*100 + patch` since 2.9,
    /// `major*1000 + minor*100 + patch` before).
    pub fn from_code(code: u32) -> Self {
        if code >= 10_000 {
            Self {
                major: code / 10_000,
                minor: (code % 10_000) / 100,
                patch: code % 100,
            }
        } else {
            Self {
                major: code / 1000,
                minor: (code % 1000) / 100,
                patch: code % 100,
            }
        }
    }
}

impl fmt::Display for NcclVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}.{}", self.major, self.minor, self.patch)
    }
}

/// Whether `libnccl` can be loaded on this machine.
pub fn nccl_present() -> bool {
    // SAFETY: `is_culib_present` only tries `dlopen` on the candidate library names and closes
    // what it opened; it touches no NCCL state.
    unsafe { sys::is_culib_present() }
}

/// The version of the NCCL library this process would use.
///
/// # Errors
/// [`DdpError::NcclUnavailable`] if the library cannot be loaded or does not answer.
pub fn nccl_version() -> Result<NcclVersion> {
    if !nccl_present() {
        return Err(DdpError::NcclUnavailable {
            detail: "no libnccl shared library was found on the loader's search path".into(),
        });
    }
    let code = result::get_nccl_version().map_err(|e| DdpError::NcclUnavailable {
        detail: format!("ncclGetVersion failed: {e:?}"),
    })?;
    let code = u32::try_from(code).map_err(|_| DdpError::NcclUnavailable {
        detail: format!("ncclGetVersion returned a negative version {code}"),
    })?;
    Ok(NcclVersion::from_code(code))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decodes_version_codes() {
        let v = NcclVersion::from_code(22_304);
        assert_eq!((v.major, v.minor, v.patch), (2, 23, 4));
        assert_eq!(v.to_string(), "2.23.4");
        let old = NcclVersion::from_code(2_804);
        assert_eq!((old.major, old.minor, old.patch), (2, 8, 4));
    }

    #[test]
    fn missing_library_is_an_error_not_a_panic() {
        match nccl_version() {
            Ok(v) => assert_eq!(v.major, 2, "unexpected NCCL version {v}"),
            Err(DdpError::NcclUnavailable { detail }) => {
                assert!(!nccl_present(), "library present but unusable: {detail}")
            }
            Err(other) => panic!("wrong error: {other}"),
        }
    }
}
