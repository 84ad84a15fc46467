//! A memory limit on one process of a test: a Linux cgroup of the memory controller (v1's
//! `memory.limit_in_bytes`, or v2's `memory.max`), made by the test's parent for each rank and
//! joined by the rank itself; what FSDP's over-limit test runs under. Without swap, a process
//! that goes past its limit is killed by the kernel's OOM killer, which the cgroup counts.

use std::path::{Path, PathBuf};
use std::time::Duration;

/// A cgroup with a memory limit, removed when dropped (once no process is left in it).
#[derive(Debug)]
pub struct MemoryLimit {
    dir: PathBuf,
    v2: bool,
}

/// Where a cgroup hierarchy with the memory controller is mounted: v1's `memory` hierarchy,
/// else a v2 hierarchy that offers `memory` to its children.
fn hierarchy() -> Result<(PathBuf, bool), String> {
    let v1 = Path::new("/sys/fs/cgroup/memory");
    if v1.join("memory.limit_in_bytes").exists() {
        return Ok((v1.to_path_buf(), false));
    }
    for root in ["/sys/fs/cgroup", "/sys/fs/cgroup/unified"] {
        let root = Path::new(root);
        let offered =
            std::fs::read_to_string(root.join("cgroup.subtree_control")).unwrap_or_default();
        if offered.split_whitespace().any(|c| c == "memory") {
            return Ok((root.to_path_buf(), true));
        }
    }
    Err(
        "no cgroup hierarchy with the memory controller: neither /sys/fs/cgroup/memory (v1) \
         nor a v2 hierarchy whose cgroup.subtree_control offers memory; the test needs one it \
         may write (run it as root, or give the user a delegated cgroup)"
            .to_string(),
    )
}

impl MemoryLimit {
    /// A new cgroup `name` (under `burn-ddp-test/`) whose processes may use at most `bytes` of
    /// memory.
    ///
    /// # Errors
    /// No writable memory controller (the message says what the test needs).
    pub fn new(name: &str, bytes: u64) -> Result<Self, String> {
        let (root, v2) = hierarchy()?;
        let parent = root.join("burn-ddp-test");
        let dir = parent.join(name);
        let made = |d: &Path| {
            std::fs::create_dir_all(d)
                .map_err(|e| format!("making the cgroup {}: {e}", d.display()))
        };
        made(&parent)?;
        if v2 {
            // A v2 child may only limit memory once its parent hands the controller down.
            let _ = std::fs::write(parent.join("cgroup.subtree_control"), "+memory");
        }
        made(&dir)?;
        let limit = Self { dir, v2 };
        let (file, value) = match v2 {
            false => ("memory.limit_in_bytes", bytes.to_string()),
            true => ("memory.max", bytes.to_string()),
        };
        limit.write(file, &value)?;
        if !v2 {
            // Without swap accounting the file is absent; with it, swap counts too.
            let _ = limit.write("memory.memsw.limit_in_bytes", &value);
        }
        Ok(limit)
    }

    /// The cgroup's directory (what a rank is told, to join it with [`MemoryLimit::join`]).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Moves the calling process into the cgroup at `dir`: what it allocates from now on counts
    /// against the limit.
    ///
    /// # Errors
    /// The cgroup cannot be written.
    pub fn join(dir: &Path) -> Result<(), String> {
        std::fs::write(dir.join("cgroup.procs"), std::process::id().to_string())
            .map_err(|e| format!("joining the cgroup {}: {e}", dir.display()))
    }

    fn write(&self, file: &str, value: &str) -> Result<(), String> {
        std::fs::write(self.dir.join(file), value)
            .map_err(|e| format!("writing {value} to {}: {e}", self.dir.join(file).display()))
    }

    fn read(&self, file: &str) -> Option<String> {
        std::fs::read_to_string(self.dir.join(file)).ok()
    }

    /// The most memory the cgroup's processes used at once, in bytes (v1's
    /// `memory.max_usage_in_bytes`, v2's `memory.peak`).
    pub fn peak(&self) -> Option<u64> {
        let file = if self.v2 {
            "memory.peak"
        } else {
            "memory.max_usage_in_bytes"
        };
        self.read(file)?.trim().parse().ok()
    }

    /// How many processes of the cgroup the OOM killer killed (v1's `oom_kill` line of
    /// `memory.oom_control`, v2's of `memory.events`).
    pub fn oom_kills(&self) -> u64 {
        let file = if self.v2 {
            "memory.events"
        } else {
            "memory.oom_control"
        };
        self.read(file)
            .unwrap_or_default()
            .lines()
            .find_map(|l| l.strip_prefix("oom_kill "))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0)
    }
}

impl Drop for MemoryLimit {
    fn drop(&mut self) {
        // The kernel frees a dead process's cgroup membership a moment after it is reaped.
        for _ in 0..50 {
            if std::fs::remove_dir(&self.dir).is_ok() {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}
