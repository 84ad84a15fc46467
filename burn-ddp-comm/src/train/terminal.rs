//! Whether rank 0 can draw Burn's terminal dashboard here.
//!
//! Burn's dashboard (ratatui over crossterm) needs more than a terminal on stdout: it switches
//! the controlling terminal to raw mode, through stdin when stdin is a terminal, else through
//! `/dev/tty`. Under `mpirun` each rank's stdout is a pseudo-terminal but stdin is not, and the
//! process has no controlling terminal: opening `/dev/tty` fails with "No such device or
//! address" and Burn's renderer panics. Both Burn lines ask [`dashboard`] first and show
//! progress lines instead, with one warning, where it cannot work.
//!
//! [`RankOutput::choose`] is what each rank shows and writes during a Learner's training, the
//! same on every Burn line: each line applies it to its release's `SupervisedTraining`.

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

/// What a rank shows during training.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Renderer {
    /// Progress lines with the job's membership (the line's `WithMembership<ProgressLines>`).
    Lines,
    /// Burn's terminal dashboard with the job's membership (a restarted or elastic job).
    DashboardWithMembership,
    /// Burn's own choice: its terminal dashboard, or the program's renderer.
    Burn,
    /// Nothing (the line's `Headless`).
    Headless,
}

/// What a rank shows and writes during a Learner's training.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RankOutput {
    /// What it shows.
    pub renderer: Renderer,
    /// Whether Burn's application logger (`experiment.log`) is installed.
    pub application_log: bool,
    /// Whether the metrics are written into the training directory.
    pub metric_files: bool,
}

impl RankOutput {
    /// The choice for this process: rank 0 (`main`) shows the dashboard when its output can
    /// draw it ([`can_draw_dashboard`], asked only then) and progress lines otherwise, with the
    /// job's membership when `membership` (the board has a note) or the job is
    /// `fault_tolerant`; in a fault-tolerant job every rank shows progress lines (any rank may
    /// become rank 0; the terminal dashboard would be lost with the process that draws it), and
    /// only rank 0 writes files. Burn's application log is left out where the program installed
    /// a `tracing` subscriber of its own (Burn's could not install itself and would only warn).
    pub fn choose(main: bool, fault_tolerant: bool, membership: bool) -> Self {
        Self::decide(main, fault_tolerant, membership, can_draw_dashboard, || {
            tracing::dispatcher::has_been_set()
        })
    }

    fn decide(
        main: bool,
        fault_tolerant: bool,
        membership: bool,
        can_draw: impl FnOnce() -> bool,
        logs_already: impl FnOnce() -> bool,
    ) -> Self {
        let renderer = if !main {
            if fault_tolerant {
                Renderer::Lines
            } else {
                Renderer::Headless
            }
        } else if fault_tolerant || !can_draw() {
            Renderer::Lines
        } else if membership {
            Renderer::DashboardWithMembership
        } else {
            Renderer::Burn
        };
        Self {
            renderer,
            application_log: main && !logs_already(),
            metric_files: main,
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

    #[test]
    fn each_rank_shows_and_writes_what_its_place_in_the_job_asks() {
        let out = |main, ft, membership, draw, logs| {
            let o = RankOutput::decide(main, ft, membership, || draw, || logs);
            (o.renderer, o.application_log, o.metric_files)
        };
        use Renderer::*;
        // Rank 0 of a fixed job: Burn's dashboard, or progress lines where it cannot draw.
        assert_eq!(out(true, false, false, true, false), (Burn, true, true));
        assert_eq!(out(true, false, false, false, false), (Lines, true, true));
        // A restarted or elastic job: the dashboard with the membership.
        let dashboard = (DashboardWithMembership, true, true);
        assert_eq!(out(true, false, true, true, false), dashboard);
        // A program with its own tracing subscriber: no Burn application log.
        assert_eq!(out(true, false, false, true, true), (Burn, false, true));
        // Fault-tolerant: progress lines everywhere, files on rank 0 only.
        assert_eq!(out(true, true, false, true, false), (Lines, true, true));
        assert_eq!(out(false, true, false, true, false), (Lines, false, false));
        // The other ranks of a fixed job: nothing.
        assert_eq!(
            out(false, false, true, true, false),
            (Headless, false, false)
        );
    }
}
