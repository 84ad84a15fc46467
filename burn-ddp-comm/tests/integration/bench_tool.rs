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

/// `burn-ddp bench scale` end to end on two small jobs (host processes, the killed rank's
/// process): every row in the format, every killed rank named by all the others, and
/// the heartbeat traffic linear: the same few requests a rank an interval at 6 and 12 ranks (a
/// write, two neighbours' reads, the abort record's read each check), where reading every
/// peer's heartbeat made it 13 a rank at 12 ranks. Out-of-range options are refused naming
/// them.
#[test]
fn the_scale_harness_measures_small_jobs_and_refuses_bad_options() {
    let scale = |args: &[&str]| {
        let mut cmd = Command::new(burn_ddp_dev::spawned::launcher());
        cmd.args(["bench", "scale"]).args(args);
        let out = Spawned::start(&mut cmd, Duration::from_secs(120)).finish();
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        (
            out.status.success(),
            text,
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    for (args, says) in [
        (&["--ranks", "2"][..], "--ranks"),
        (&["--window", "0"][..], "--window"),
    ] {
        let (ok, _, err) = scale(args);
        assert!(!ok && err.contains(says), "{args:?}: {err}");
    }
    let (ok, out, err) = scale(&["--ranks", "6,12", "--heartbeat-s", "2", "--window", "4"]);
    assert!(ok, "{out}{err}");
    let rows: Vec<&str> = out
        .lines()
        .filter(|l| l.starts_with("scale ranks="))
        .collect();
    assert_eq!(rows.len(), 2, "{out}");
    let mut per_rank = Vec::new();
    for (row, n) in rows.iter().zip([6.0, 12.0]) {
        let field = |name: &str| -> f64 {
            let at = row.find(&format!("{name}=")).unwrap() + name.len() + 1;
            row[at..]
                .split_whitespace()
                .next()
                .unwrap()
                .parse()
                .unwrap()
        };
        per_rank.push(field("hb_requests_per_interval") / n);
        assert!(field("init_s") > 0.0 && field("detect_s") < 20.0, "{row}");
    }
    assert!(
        per_rank.iter().all(|r| (1.0..=6.0).contains(r)),
        "{per_rank:?}: {out}"
    );
    let growth = per_rank[1] / per_rank[0];
    assert!((0.7..=1.4).contains(&growth), "{per_rank:?}: {out}");
    assert!(
        out.contains("scale growth ranks=6->12 ranks_x=2.00"),
        "{out}"
    );
    // A fault-tolerant job of 20 ranks (more than the membership change's 8 deciders, so most
    // ranks wait on the decision): the others go on without the killed rank, and an all-reduce
    // of the new membership counts the 19.
    let (ok, out, err) = scale(&[
        "--ranks",
        "20",
        "--heartbeat-s",
        "2",
        "--window",
        "2",
        "--fault-tolerant",
    ]);
    assert!(ok, "{out}{err}");
    let row = out
        .lines()
        .find(|l| l.starts_with("scale ranks=20 "))
        .unwrap_or_default();
    let change = row
        .split("change_s=")
        .nth(1)
        .and_then(|v| v.trim().parse::<f64>().ok());
    assert!(change.is_some_and(|c| c > 0.0 && c < 20.0), "{out}");
}
