//! Whether rank 0 can draw Burn's terminal dashboard here.
//!
//! Burn's dashboard (ratatui over crossterm) needs more than a terminal on stdout: it switches
//! the controlling terminal to raw mode, through stdin when stdin is a terminal, else through
//! `/dev/tty`. Under `mpirun` each rank's stdout is a pseudo-terminal but stdin is not, and the
//! process has no controlling terminal: opening `/dev/tty` fails with "No such device or
//! address" and Burn's renderer panics. Both Burn lines ask [`dashboard`] first and show
//! progress lines instead, with one warning, where it cannot work.

use std::io::IsTerminal;

/// What rank 0's stdout can show.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Terminal {
    /// A terminal the dashboard can drive.
    Drivable,
    /// Not a terminal (a file, a pipe): progress lines, as Burn itself chooses.
    NotATerminal,
    /// A terminal on stdout that the dashboard could not drive; the reason, for the warning.
    Undrivable(String),
}

/// Checks what rank 0's stdout can show, as Burn's terminal backend would use it.
pub fn dashboard() -> Terminal {
    if !std::io::stdout().is_terminal() {
        return Terminal::NotATerminal;
    }
    if std::io::stdin().is_terminal() {
        return Terminal::Drivable;
    }
    match std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/tty")
    {
        Ok(_) => Terminal::Drivable,
        Err(e) => Terminal::Undrivable(format!(
            "stdout is a terminal, but this process has no controlling terminal to put in raw \
             mode (stdin is not a terminal; /dev/tty: {e}), as under mpirun, which gives each \
             rank a pseudo-terminal"
        )),
    }
}

/// [`dashboard`] as a yes or no, warning once (on the tracing log) when stdout is a terminal
/// that cannot be driven: the caller then shows progress lines.
pub fn can_draw_dashboard() -> bool {
    match dashboard() {
        Terminal::Drivable => true,
        Terminal::NotATerminal => false,
        Terminal::Undrivable(why) => {
            tracing::warn!("progress lines instead of Burn's dashboard: {why}");
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_test_harness_has_no_terminal_to_draw_on() {
        // cargo test captures stdout (or it is CI's pipe): never a dashboard.
        if !std::io::stdout().is_terminal() {
            assert_eq!(dashboard(), Terminal::NotATerminal);
            assert!(!can_draw_dashboard());
        }
    }
}
