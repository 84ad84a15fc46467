//! Finding `libnccl` and saying exactly what to do when cudarc cannot load it.
//!
//! cudarc `dlopen`s `libnccl.so` (then `libnccl.so.<cuda major>`, `.12`, `.11`, ...), never
//! `libnccl.so.2`, which is the only name the runtime packages ship (Debian/Ubuntu `libnccl2`,
//! pip's `nvidia-nccl-cu12`). A machine with NCCL installed can therefore still fail to load it;
//! the message then names the file that is there and the one link that fixes it.

use crate::error::CudaError;
use std::fmt;
use std::path::{Path, PathBuf};

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

    /// `ncclAvg` (used for `ReduceOp::Mean`) exists since NCCL 2.10.
    pub fn has_avg(self) -> bool {
        (self.major, self.minor) >= (2, 10)
    }

    /// bfloat16 collectives exist since NCCL 2.10.
    pub fn has_bf16(self) -> bool {
        (self.major, self.minor) >= (2, 10)
    }

    /// Non-blocking communicators (`ncclCommInitRankConfig`, `ncclCommFinalize`), which burn-ddp
    /// needs so that no NCCL call can hang without a deadline, exist since NCCL 2.14.
    pub fn has_nonblocking(self) -> bool {
        (self.major, self.minor) >= (2, 14)
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
/// [`CudaError::NcclUnavailable`](crate::CudaError::NcclUnavailable) if the library cannot be loaded (the message says what to
/// install or link) or does not answer.
pub fn nccl_version() -> Result<NcclVersion> {
    if !nccl_present() {
        return Err(DdpError::Cuda(CudaError::NcclUnavailable {
            detail: missing_library_help(&installed_runtime_libraries()),
        }));
    }
    let code = result::get_nccl_version().map_err(|e| {
        DdpError::Cuda(CudaError::NcclUnavailable {
            detail: format!(
                "ncclGetVersion failed ({}); the library that was loaded is not a working NCCL 2.x",
                super::status::code_text(e.0)
            ),
        })
    })?;
    let code = u32::try_from(code).map_err(|_| {
        DdpError::Cuda(CudaError::NcclUnavailable {
            detail: format!("ncclGetVersion returned a negative version {code}"),
        })
    })?;
    Ok(NcclVersion::from_code(code))
}

/// The loaded NCCL's version, if burn-ddp can use it: 2.14 or newer (non-blocking
/// communicators, so that no NCCL call can hang without a deadline).
///
/// # Errors
/// As [`nccl_version`], and [`CudaError::NcclUnavailable`](crate::CudaError::NcclUnavailable) for an older NCCL, saying what to
/// install.
pub fn usable_nccl() -> Result<NcclVersion> {
    let version = nccl_version()?;
    if !version.has_nonblocking() {
        return Err(DdpError::Cuda(CudaError::NcclUnavailable {
            detail: format!(
                "this process loaded NCCL {version}; burn-ddp needs 2.14 or newer (non-blocking \
                 communicators, so that no NCCL call can hang without a deadline). Install a \
                 newer NCCL (pip install nvidia-nccl-cu12 or -cu13)"
            ),
        }));
    }
    Ok(version)
}

/// Directories where NCCL's runtime library is commonly installed: `LD_LIBRARY_PATH`, the
/// system library directories, the CUDA toolkit, and pip's `nvidia/nccl/lib` in the active
/// virtual environment and the system's Python installations.
fn search_dirs() -> Vec<PathBuf> {
    let env = crate::config::env::library_search();
    let mut dirs: Vec<PathBuf> = env.ld_library_path;
    for d in [
        "/usr/lib/x86_64-linux-gnu",
        "/usr/lib/aarch64-linux-gnu",
        "/usr/lib64",
        "/usr/lib",
        "/usr/local/lib",
        "/usr/local/cuda/lib64",
        "/usr/local/nccl/lib",
    ] {
        dirs.push(d.into());
    }
    let mut python_roots: Vec<PathBuf> = vec!["/usr/lib".into(), "/usr/local/lib".into()];
    if let Some(venv) = env.python_env {
        python_roots.insert(0, PathBuf::from(venv).join("lib"));
    }
    if let Some(home) = env.home {
        python_roots.push(PathBuf::from(home).join(".local/lib"));
    }
    for root in python_roots {
        let Ok(entries) = std::fs::read_dir(&root) else {
            continue;
        };
        for e in entries.flatten() {
            let name = e.file_name();
            if name.to_string_lossy().starts_with("python3") {
                for site in ["site-packages", "dist-packages"] {
                    dirs.push(e.path().join(site).join("nvidia/nccl/lib"));
                }
            }
        }
    }
    dirs
}

/// Files named `libnccl.so.2` (or `libnccl.so.2.x.y`) in `dirs`.
pub(crate) fn runtime_libraries_in(dirs: &[PathBuf]) -> Vec<PathBuf> {
    let mut found = Vec::new();
    for d in dirs {
        let Ok(entries) = std::fs::read_dir(d) else {
            continue;
        };
        let mut here: Vec<PathBuf> = entries
            .flatten()
            .map(|e| e.path())
            .filter(|p| {
                p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n == "libnccl.so.2" || n.starts_with("libnccl.so.2."))
            })
            .collect();
        // Prefer the `.so.2` link over the versioned file it points to.
        here.sort_by_key(|p| p.file_name().map(|n| n.len()));
        if let Some(first) = here.into_iter().next() {
            if !found.contains(&first) {
                found.push(first);
            }
        }
    }
    found
}

fn installed_runtime_libraries() -> Vec<PathBuf> {
    runtime_libraries_in(&search_dirs())
}

/// What to tell a user whose process cannot load `libnccl.so`, given the runtime libraries
/// (`libnccl.so.2`) found on the machine.
pub(crate) fn missing_library_help(found: &[PathBuf]) -> String {
    match found.first() {
        Some(lib) => {
            let dir = lib.parent().unwrap_or_else(|| Path::new("."));
            format!(
                "NCCL is installed ({}) but cudarc loads `libnccl.so`, which is missing beside it \
                 (the runtime packages, `libnccl2` and pip's `nvidia-nccl-cu12`, ship only \
                 `libnccl.so.2`). Fix: install the development package (`apt install \
                 libnccl-dev`), or link it: `ln -s {} {}/libnccl.so` (or into any directory you \
                 then add to LD_LIBRARY_PATH). The host-staged transport (DdpConfig::transport = \
                 GradTransport::Host) works without NCCL",
                lib.display(),
                lib.display(),
                dir.display()
            )
        }
        None => "no NCCL library was found (cudarc looks for `libnccl.so` on the loader's search \
                 path). Install NCCL 2.x with its development link (`apt install libnccl2 \
                 libnccl-dev`, or `pip install nvidia-nccl-cu12` and then `ln -s \
                 <site-packages>/nvidia/nccl/lib/libnccl.so.2 <dir on LD_LIBRARY_PATH>/libnccl.so`). \
                 The host-staged transport (DdpConfig::transport = GradTransport::Host) works \
                 without NCCL"
            .into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decodes_version_codes() {
        let v = NcclVersion::from_code(22_304);
        assert_eq!((v.major, v.minor, v.patch), (2, 23, 4));
        assert_eq!(v.to_string(), "2.23.4");
        assert!(v.has_avg() && v.has_bf16());
        let old = NcclVersion::from_code(2_804);
        assert_eq!((old.major, old.minor, old.patch), (2, 8, 4));
        assert!(!old.has_avg());
    }

    #[test]
    fn missing_library_is_an_error_not_a_panic() {
        match nccl_version() {
            Ok(v) => assert_eq!(v.major, 2, "unexpected NCCL version {v}"),
            Err(DdpError::Cuda(CudaError::NcclUnavailable { detail })) => {
                assert!(!nccl_present(), "library present but unusable: {detail}");
                assert!(detail.contains("libnccl.so"), "{detail}");
            }
            Err(other) => panic!("wrong error: {other}"),
        }
    }

    #[test]
    fn a_runtime_only_install_gets_the_exact_link_to_make() {
        let root = std::env::temp_dir().join(format!("burn-ddp-nccl-{}", std::process::id()));
        let pip = root.join("venv/lib/python3.12/site-packages/nvidia/nccl/lib");
        let empty = root.join("empty");
        std::fs::create_dir_all(&pip).unwrap();
        std::fs::create_dir_all(&empty).unwrap();
        std::fs::write(pip.join("libnccl.so.2"), b"").unwrap();
        std::fs::write(pip.join("libnccl.so.2.21.5"), b"").unwrap();

        let found = runtime_libraries_in(&[empty.clone(), pip.clone(), pip.clone()]);
        assert_eq!(found, vec![pip.join("libnccl.so.2")]);
        let help = missing_library_help(&found);
        let link = format!(
            "ln -s {} {}/libnccl.so",
            pip.join("libnccl.so.2").display(),
            pip.display()
        );
        assert!(help.contains(&link), "{help}");
        assert!(help.contains("libnccl-dev"), "{help}");

        let none = missing_library_help(&runtime_libraries_in(&[empty]));
        assert!(none.contains("Install NCCL"), "{none}");
        std::fs::remove_dir_all(&root).unwrap();
    }
}
