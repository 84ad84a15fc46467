//! Counting the lines a migration changes (the guide's "at most 15 lines" for both Burn lines).

/// The code of an example (a path relative to the package under test): its lines after the
/// leading `//!` comment, without blank and comment-only lines (which a migration's count
/// leaves out). A `// ddp:` marker that rustfmt moved onto a line of its own (after an opening
/// parenthesis) is put back at the end of the line above.
pub fn code(path: &str) -> Vec<String> {
    let file = crate::package_dir().join(path);
    let text = std::fs::read_to_string(&file).unwrap_or_else(|e| panic!("{file:?}: {e}"));
    let mut out: Vec<String> = Vec::new();
    for line in text
        .lines()
        .skip_while(|l| l.starts_with("//!") || l.is_empty())
    {
        let trimmed = line.trim_start();
        match out.last_mut() {
            Some(last) if trimmed.starts_with("// ddp:") => {
                last.push(' ');
                last.push_str(trimmed);
            }
            _ if trimmed.is_empty() || trimmed.starts_with("//") => {}
            _ => out.push(line.to_owned()),
        }
    }
    out
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
        use crate::spawned::{example, Spawned};
        use std::process::Command;
        let limit = std::time::Duration::from_secs(600);
        let mut runs = Self {
            before: scratch(&format!("{after}-one")),
            after: scratch(&format!("{after}-two")),
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
        runs.stdout = on_two_ranks(after, &runs.after);
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
        [&self.before, &self.after].map(|d| {
            let file = d.join(path);
            std::fs::read_to_string(&file).unwrap_or_else(|e| panic!("{file:?}: {e}"))
        })
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

/// Runs example `name` of the package under test on 2 ranks through the launcher, in `dir`, to
/// success; returns its output (each line prefixed by its rank).
pub fn on_two_ranks(name: &str, dir: &std::path::Path) -> String {
    use crate::spawned::{example, launcher, Spawned};
    let mut cmd = std::process::Command::new(launcher());
    cmd.args(["run", "--standalone", "--nproc-per-node", "2", "--"])
        .arg(example(name))
        .current_dir(dir)
        .env_remove("RANK")
        .env_remove("SLURM_PROCID");
    let out = Spawned::start(&mut cmd, std::time::Duration::from_secs(600)).finish();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{name}:\n{stdout}\n{stderr}");
    stdout
}

/// The lines of rank `rank` in a launcher's `stdout` that start with `start`, without the
/// rank's prefix.
pub fn rank_lines<'a>(stdout: &'a str, rank: u32, start: &str) -> Vec<&'a str> {
    let prefix = format!("[rank {rank}] ");
    stdout
        .lines()
        .filter_map(|l| l.strip_prefix(prefix.as_str()))
        .filter(|l| l.starts_with(start))
        .collect()
}

/// A migrated training loop of the guide (`custom_loop_after`, `custom_loop022_after`) on 2
/// ranks: rank 0 alone prints each epoch's training and validation lines (4 epochs), with the
/// job's counts (2,048 training points a pass, each rank's 1,024 added; 512 validation points:
/// dealt once over the ranks and added, or all validated by rank 0), rank 1 prints none, and
/// the model is saved once, as `artifacts/<model_file>`.
pub fn assert_custom_loop_prints_and_saves_once(example: &str, model_file: &str) {
    let dir = scratch(example);
    let stdout = on_two_ranks(example, &dir);
    let saved: Vec<_> = std::fs::read_dir(dir.join("artifacts"))
        .map(|d| d.filter_map(|e| e.ok().map(|e| e.file_name())).collect())
        .unwrap_or_default();
    std::fs::remove_dir_all(&dir).ok();
    assert_eq!(saved, [model_file], "the saved model:\n{stdout}");
    for (part, items) in [("Train", 2048), ("Valid", 512)] {
        let lines = rank_lines(&stdout, 0, &format!("[{part} - Epoch "));
        assert_eq!(lines.len(), 4, "rank 0's {part} lines:\n{stdout}");
        for (epoch, line) in (1..).zip(&lines) {
            assert!(
                line.starts_with(&format!("[{part} - Epoch {epoch}] Loss ")),
                "{line}"
            );
            assert!(line.ends_with(&format!("% of {items} points")), "{line}");
        }
    }
    assert!(
        rank_lines(&stdout, 1, "[").is_empty(),
        "rank 1 printed:\n{stdout}"
    );
}

/// Checks `error`, rank `rank`'s, of the custom-loop tests' first step over a sampler of 256
/// items generated without a seed: it names the rank, the first sampler, what differs, and the
/// fix.
pub fn assert_unseeded_data_refused(rank: usize, error: &str) {
    let named = format!("[rank {rank}] the dataset of DistributedSampler 1 ");
    assert!(error.contains(&named), "{error}");
    assert!(
        error.contains("both have 256 items, but they differ"),
        "{error}"
    );
    assert!(error.contains("seed_from_u64"), "{error}");
}

/// Checks that every Burn summary in a launcher's `stdout` (rank 0's) names the model under
/// its header, as Burn's own strategy prints it, and that there is one at least.
pub fn assert_summaries_name_the_model(stdout: &str) {
    let lines = rank_lines(stdout, 0, "");
    let headers: Vec<usize> = (0..lines.len())
        .filter(|&i| lines[i].contains("Learner Summary"))
        .collect();
    assert!(!headers.is_empty(), "no summary:\n{stdout}");
    for i in headers {
        assert_eq!(
            lines.get(i + 1).copied(),
            Some("Model:"),
            "a summary without its model:\n{stdout}"
        );
    }
}

/// An empty directory of this test process's, `burn-ddp-<tag>-<pid>` under the temporary
/// directory (what an earlier run left there removed).
fn scratch(tag: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("burn-ddp-{tag}-{}", std::process::id()));
    std::fs::remove_dir_all(&dir).ok();
    std::fs::create_dir_all(&dir).expect("the temporary directory is writable");
    dir
}
