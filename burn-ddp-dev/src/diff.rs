//! Counting the lines a migration changes (the guide's "at most 15 lines" for both Burn lines).

/// The code of an example (a path relative to the package under test): its lines after the
/// leading `//!` comment.
pub fn code(path: &str) -> Vec<String> {
    let text = std::fs::read_to_string(crate::package_dir().join(path)).unwrap();
    text.lines()
        .skip_while(|l| l.starts_with("//!") || l.is_empty())
        .map(str::to_owned)
        .collect()
}

/// Lines of `after` that are not in a longest common subsequence with `before` (added or
/// modified), and lines of `before` that are not (removed or modified).
pub fn changed(before: &[String], after: &[String]) -> (usize, usize) {
    let (n, m) = (before.len(), after.len());
    let mut lcs = vec![vec![0usize; m + 1]; n + 1];
    for i in (0..n).rev() {
        for j in (0..m).rev() {
            lcs[i][j] = if before[i] == after[j] {
                lcs[i + 1][j + 1] + 1
            } else {
                lcs[i + 1][j].max(lcs[i][j + 1])
            };
        }
    }
    (m - lcs[0][0], n - lcs[0][0])
}

/// A migrated example's two runs, each in a directory of its own (removed on drop): the
/// "before" program as one process, the "after" program on 2 ranks through the launcher.
pub struct MigrationRuns {
    /// Where the one process ran.
    pub before: std::path::PathBuf,
    /// Where the 2 ranks ran.
    pub after: std::path::PathBuf,
    /// The 2-rank run's output (the launcher's, each line prefixed by its rank).
    pub stdout: String,
}

impl MigrationRuns {
    /// Runs `before` and `after` (examples of the package under test), each to success.
    pub fn start(before: &str, after: &str) -> Self {
        use crate::spawned::{example, launcher, Spawned};
        use std::process::Command;
        let limit = std::time::Duration::from_secs(600);
        let tmp = std::env::temp_dir();
        let dir = |tag: &str| {
            let d = tmp.join(format!("burn-ddp-{after}-{tag}-{}", std::process::id()));
            std::fs::remove_dir_all(&d).ok();
            std::fs::create_dir_all(&d).unwrap();
            d
        };
        let mut runs = Self {
            before: dir("one"),
            after: dir("two"),
            stdout: String::new(),
        };
        let mut one = Command::new(example(before));
        one.current_dir(&runs.before)
            .env_remove("RANK")
            .env_remove("WORLD_SIZE")
            .env_remove("SLURM_PROCID");
        let out = Spawned::start(&mut one, limit).finish();
        let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
        assert!(
            out.status.success(),
            "{before}:\n{}\n{}",
            text(&out.stdout),
            text(&out.stderr)
        );
        let mut two = Command::new(launcher());
        two.args(["run", "--standalone", "--nproc-per-node", "2", "--"])
            .arg(example(after))
            .current_dir(&runs.after)
            .env_remove("RANK")
            .env_remove("SLURM_PROCID");
        let out = Spawned::start(&mut two, limit).finish();
        let stdout = text(&out.stdout);
        assert!(
            out.status.success(),
            "{after}:\n{stdout}\n{}",
            text(&out.stderr)
        );
        runs.stdout = stdout;
        runs
    }

    /// Checks that the 2 ranks wrote exactly the files the one process wrote (Burn's metric
    /// logs, checkpoints, its application log, the evaluator's logs, a progress logger's file:
    /// nothing twice, nothing of another rank), and returns that list.
    pub fn assert_same_files(&self) -> Vec<String> {
        let one = crate::spawned::files_under(&self.before);
        let two = crate::spawned::files_under(&self.after);
        assert_eq!(two, one, "the 2-rank run's files against one process's");
        assert!(!one.is_empty());
        one
    }

    /// The text of file `path` (relative to the run's directory) of each run: one process's,
    /// the 2 ranks'.
    pub fn read(&self, path: &str) -> [String; 2] {
        [&self.before, &self.after].map(|d| std::fs::read_to_string(d.join(path)).unwrap())
    }
}

impl Drop for MigrationRuns {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            std::fs::remove_dir_all(&self.before).ok();
            std::fs::remove_dir_all(&self.after).ok();
        }
    }
}
