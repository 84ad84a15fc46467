//! The line with which a fault-tolerant process tells its launcher its new rank after a change
//! of membership (the launcher's `[rank N]` prefix follows it): written here, read by the
//! launcher's output forwarder (`launch/spawn.rs`).

use std::io::Write;

use crate::config::env;
use crate::types::Rank;

/// The start and end of the line with which a rank tells its launcher its new rank (an APC
/// escape sequence, which a terminal ignores should one show it).
const MARKER: (&str, &str) = ("\x1b_burn-ddp rank ", "\x1b\\");

/// The marker line of `rank`.
pub(crate) fn marker(rank: Rank) -> String {
    format!("{}{}{}", MARKER.0, rank.0, MARKER.1)
}

/// The rank a marker line announces, if `line` is one.
pub(crate) fn marked(line: &str) -> Option<Rank> {
    line.strip_prefix(MARKER.0)?
        .strip_suffix(MARKER.1)?
        .parse()
        .ok()
        .map(Rank)
}

/// Tells this process's launcher (when it follows ranks: [`env::rank_markers`]) that this
/// process is now rank `rank`: its next lines on stdout and stderr are prefixed `[rank
/// {rank}]`. Called by a fault-tolerant process when a change of membership gives it a rank.
pub(crate) fn announce_rank(rank: Rank) {
    if !env::rank_markers() {
        return;
    }
    let line = format!("{}\n", marker(rank));
    let _ = std::io::stdout().lock().write_all(line.as_bytes());
    let _ = std::io::stdout().flush();
    let _ = std::io::stderr().lock().write_all(line.as_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rank_marker_is_read_back_and_other_lines_are_not_markers() {
        for r in [0, 1, 7, 4095] {
            assert_eq!(marked(&marker(Rank(r))), Some(Rank(r)));
        }
        for line in [
            "",
            "[membership] rank 1",
            "\x1b_burn-ddp rank \x1b\\",
            "\x1b_burn-ddp rank x\x1b\\",
            "\x1b_burn-ddp rank 3",
        ] {
            assert_eq!(marked(line), None, "{line:?}");
        }
    }
}
