//! The bandwidth tool (`burn-ddp bench all-reduce`) as a user can misuse it: every option out of
//! range is refused at once, non-zero, naming the option and what is accepted; a small valid
//! sweep over 2 real processes finishes and checks its results.

use std::process::Command;
use std::time::{Duration, Instant};

use burn_ddp_dev::spawned::Spawned;

fn bench(args: &[&str]) -> (bool, String, Duration) {
    let mut cmd = Command::new(burn_ddp_dev::spawned::launcher());
    cmd.args(["bench", "all-reduce"])
        .args(args)
        .env_remove("RANK")
        .env_remove("SLURM_PROCID");
    let started = Instant::now();
    let out = Spawned::start(&mut cmd, Duration::from_secs(120)).finish();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text, started.elapsed())
}

#[test]
fn options_out_of_range_are_refused_naming_the_option() {
    for (args, says) in [
        (
            &["--min-bytes", "8K", "--max-bytes", "4K"][..],
            "--min-bytes",
        ),
        (&["--step-factor", "1"][..], "--step-factor"),
        (&["--step-factor", "0"][..], "--step-factor"),
        (&["--max-bytes", "2"][..], "less than one"),
        (&["--max-bytes", "3", "--dtype", "f64"][..], "less than one"),
        (&["--max-bytes", "2G"][..], "above the"),
        (&["--target-ms", "0"][..], "--target-ms"),
        (&["--target-ms", "99999999"][..], "--target-ms"),
        (&["--nproc", "100000"][..], "--nproc"),
        (&["--max-bytes", "12Q"][..], "not a size"),
    ] {
        let (ok, text, took) = bench(args);
        assert!(!ok, "{args:?} was accepted:\n{text}");
        assert!(
            text.contains(says),
            "{args:?}: the refusal does not say {says:?}:\n{text}"
        );
        assert!(
            !text.contains("Avg bus bandwidth"),
            "{args:?} printed results:\n{text}"
        );
        // Refused before any rank starts (a generous bound for a loaded machine).
        assert!(took < Duration::from_secs(20), "{args:?} took {took:?}");
    }
}

#[test]
fn a_small_sweep_finishes_with_correct_results() {
    let (ok, text, _) = bench(&[
        "--min-bytes",
        "4",
        "--max-bytes",
        "64K",
        "--step-factor",
        "4",
        "--target-ms",
        "5",
        "--no-loopback",
    ]);
    assert!(ok, "{text}");
    assert!(text.contains("Out of bounds values : 0 OK"), "{text}");
    // 4 B to 64 KiB by factors of 4: 8 sizes.
    let rows = text
        .lines()
        .filter(|l| {
            l.split_whitespace()
                .next()
                .is_some_and(|w| w.trim_start_matches("[rank 0]").parse::<u64>().is_ok())
        })
        .count();
    assert!(rows >= 8, "expected 8 sizes:\n{text}");
}
