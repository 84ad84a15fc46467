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
