//! Failure modes of a job, each in real processes: every surviving rank must end with a distinct,
//! clear error within the test's bound, never a hang or a panic in the library.

use burn_ddp_comm::{CollectiveError, ConfigError, RendezvousError};
use std::time::{Duration, Instant};

use burn_ddp_comm::{DdpError, ProcessGroup, Rank, ReduceOp};
use burn_ddp_dev::procs::{self, TestJob};

fn rank() -> u32 {
    std::env::var("RANK").unwrap().parse().unwrap()
}

/// Prints the error (so it shows in the parent's report) and returns its text.
fn show(e: &DdpError) -> String {
    let s = e.to_string();
    println!("rank {} error: {s}", rank());
    s
}

/// `err` reports a mismatch of collectives (this rank's, or the one another rank published).
fn assert_mismatch(err: &DdpError) {
    let text = show(err);
    assert!(
        matches!(
            err,
            DdpError::Collective(CollectiveError::CollectiveMismatch { .. })
                | DdpError::Collective(CollectiveError::JobAborted { .. })
        ),
        "{text}"
    );
    assert!(text.contains("mismatch"), "{text}");
}

fn assert_fast(out: &procs::Outcomes, bound: Duration) {
    for o in &out.0 {
        assert!(
            o.elapsed < bound,
            "rank {} took {:?} (bound {bound:?}):\n{}",
            o.rank,
            o.elapsed,
            out.report()
        );
    }
}

#[test]
fn rank_killed_mid_collective() {
    const NAME: &str = "rank_killed_mid_collective";
    if procs::is_child(NAME) {
        let pg = ProcessGroup::from_env().unwrap();
        assert_eq!(pg.transport(), "shm");
        if pg.rank() == Rank(1) {
            procs::kill_self_after(Duration::from_millis(300));
        }
        let mut buf = vec![1.0f32; 16 << 20];
        let err = (0..10_000)
            .map(|_| pg.all_reduce(&mut buf, ReduceOp::Sum))
            .find_map(Result::err)
            .expect("the collectives cannot all succeed once rank 1 is dead");
        let text = show(&err);
        match &err {
            DdpError::Collective(CollectiveError::PeerLost { peer, .. }) => {
                assert_eq!(*peer, Rank(1), "{text}")
            }
            DdpError::Collective(CollectiveError::JobAborted { record, during, .. }) => {
                assert_eq!(record.culprit, Some(Rank(1)), "{text}");
                assert!(during.is_some(), "{text}");
            }
            other => panic!("unexpected error: {other}"),
        }
        // Every survivor names the operation it was in and its sequence number.
        assert!(text.contains("all_reduce #"), "{text}");
        // Further calls fail at once, naming the first failure.
        let again = pg.all_reduce(&mut buf, ReduceOp::Sum).unwrap_err();
        assert!(
            matches!(
                again,
                DdpError::Collective(CollectiveError::GroupAborted { .. })
            ),
            "{again}"
        );
        return;
    }
    // A 10-minute collective timeout: only prompt failure detection can meet the bound. The
    // ranks share memory: only their TCP links, which carry nothing, tell them of the death.
    let out = TestJob::new(3, NAME)
        .env("BURN_DDP_COLLECTIVE_TIMEOUT", "600")
        .env("BURN_DDP_TRANSPORT", "shm")
        .run();
    assert!(!out.rank(1).ok(), "{}", out.report());
    assert!(out.rank(0).ok() && out.rank(2).ok(), "{}", out.report());
    assert_fast(&out, Duration::from_secs(20));
}

#[test]
fn rank_panics_between_collectives() {
    const NAME: &str = "rank_panics_between_collectives";
    if procs::is_child(NAME) {
        let pg = ProcessGroup::from_env().unwrap();
        let mut x = [1.0f32; 4];
        pg.all_reduce(&mut x, ReduceOp::Sum).unwrap();
        if pg.rank() == Rank(1) {
            panic!("simulated bug in user code");
        }
        let err = pg.all_reduce(&mut x, ReduceOp::Sum).unwrap_err();
        let text = show(&err);
        assert!(text.contains("rank 1"), "{text}");
        return;
    }
    let out = TestJob::new(2, NAME)
        .env("BURN_DDP_COLLECTIVE_TIMEOUT", "600")
        .run();
    assert!(!out.rank(1).ok() && out.rank(0).ok(), "{}", out.report());
    assert_fast(&out, Duration::from_secs(20));
}

#[test]
fn rank_never_arrives_at_rendezvous() {
    const NAME: &str = "rank_never_arrives_at_rendezvous";
    if procs::is_child(NAME) {
        // The warnings of the wait, on stderr for the parent to read.
        let _ = tracing_subscriber::fmt()
            .with_writer(std::io::stderr)
            .with_ansi(false)
            .try_init();
        let err = ProcessGroup::from_env().unwrap_err();
        let text = show(&err);
        match err {
            DdpError::Rendezvous(RendezvousError::RendezvousTimeout { missing, .. }) => {
                assert_eq!(missing.0, vec![Rank(2)], "{text}")
            }
            // The other waiting rank gave up first and published why.
            DdpError::Collective(CollectiveError::JobAborted { .. }) => {
                assert!(text.contains("missing [2]"), "{text}")
            }
            other => panic!("unexpected: {other}"),
        }
        return;
    }
    let out = TestJob::new(3, NAME)
        .skip(2)
        .env("BURN_DDP_RENDEZVOUS_TIMEOUT", "3")
        .run();
    out.assert_all_ok();
    assert_fast(&out, Duration::from_secs(20));
    // While they wait, the ranks say who is missing (every second for a 3 s wait).
    for o in &out.0 {
        assert!(
            o.output
                .contains("waiting for rank(s) [2] to join the job at 127.0.0.1:"),
            "rank {} never said whom it waits for:\n{}",
            o.rank,
            out.report()
        );
    }
}

#[test]
fn rank_never_arrives_at_collective() {
    const NAME: &str = "rank_never_arrives_at_collective";
    if procs::is_child(NAME) {
        let pg = ProcessGroup::from_env().unwrap();
        let mut x = vec![1.0f32; 1 << 20];
        if pg.rank() == Rank(2) {
            // Stuck elsewhere (data loading, a deadlock in user code) long past the timeout.
            std::thread::sleep(Duration::from_secs(6));
            let err = pg.all_reduce(&mut x, ReduceOp::Sum).unwrap_err();
            show(&err);
            return;
        }
        let err = pg.all_reduce(&mut x, ReduceOp::Sum).unwrap_err();
        let text = show(&err);
        match &err {
            DdpError::Collective(CollectiveError::CollectiveTimeout { diagnosis, .. }) => {
                assert_eq!(diagnosis.culprit(), Rank(2), "{text}");
                assert!(text.contains("rank 2 never reached it"), "{text}");
            }
            // The other waiting rank may learn it from the first one's report.
            DdpError::Collective(CollectiveError::JobAborted { record, .. }) => {
                assert_eq!(record.culprit, Some(Rank(2)), "{text}")
            }
            other => panic!("unexpected: {other}"),
        }
        return;
    }
    let out = TestJob::new(3, NAME)
        .env("BURN_DDP_COLLECTIVE_TIMEOUT", "2")
        .run();
    out.assert_all_ok();
    assert_fast(&out, Duration::from_secs(30));
}

#[test]
fn wrong_token_is_refused_on_both_sides() {
    const NAME: &str = "wrong_token_is_refused_on_both_sides";
    if procs::is_child(NAME) {
        let err = ProcessGroup::from_env().unwrap_err();
        let text = show(&err);
        if rank() == 1 {
            assert!(
                matches!(
                    err,
                    DdpError::Rendezvous(RendezvousError::TokenMismatch { .. })
                ),
                "{text}"
            );
        } else {
            assert!(
                matches!(
                    err,
                    DdpError::Rendezvous(RendezvousError::RendezvousTimeout { .. })
                ),
                "{text}"
            );
            assert!(text.contains("wrong job token"), "{text}");
        }
        return;
    }
    let out = TestJob::new(2, NAME)
        .env("BURN_DDP_RENDEZVOUS_TIMEOUT", "3")
        .rank_env(1, "BURN_DDP_JOB_TOKEN", "intruder")
        .run();
    out.assert_all_ok();
    assert_fast(&out, Duration::from_secs(20));
}

#[test]
fn rank_at_or_above_world_size() {
    const NAME: &str = "rank_at_or_above_world_size";
    if procs::is_child(NAME) {
        let err = ProcessGroup::from_env().unwrap_err();
        let text = show(&err);
        if std::env::var("LOCAL_RANK").unwrap() == "1" {
            assert!(
                matches!(err, DdpError::Config(ConfigError::RankOutOfRange { .. })),
                "{text}"
            );
            assert!(text.contains("rank 2 is outside the world of 2"), "{text}");
        } else {
            assert!(
                matches!(
                    err,
                    DdpError::Rendezvous(RendezvousError::RendezvousTimeout { .. })
                ),
                "{text}"
            );
        }
        return;
    }
    let out = TestJob::new(2, NAME)
        .env("BURN_DDP_RENDEZVOUS_TIMEOUT", "3")
        .rank_env(1, "RANK", 2)
        .run();
    out.assert_all_ok();
    assert_fast(&out, Duration::from_secs(20));
}

#[test]
fn two_ranks_claim_the_same_rank() {
    const NAME: &str = "two_ranks_claim_the_same_rank";
    if procs::is_child(NAME) {
        let err = ProcessGroup::from_env().unwrap_err();
        let text = show(&err);
        match &err {
            DdpError::Rendezvous(RendezvousError::DuplicateRank { claimed, .. }) => {
                assert_eq!(*claimed, Rank(1))
            }
            DdpError::Collective(CollectiveError::JobAborted { .. }) => {
                assert!(text.contains("claimed by two processes"), "{text}")
            }
            other => panic!("unexpected: {other}"),
        }
        return;
    }
    // A long rendezvous timeout: the conflict must end the rendezvous at once, not by timing out.
    let out = TestJob::new(3, NAME)
        .env("BURN_DDP_RENDEZVOUS_TIMEOUT", "120")
        .rank_env(2, "RANK", 1)
        .run();
    out.assert_all_ok();
    let duplicates = out
        .0
        .iter()
        .filter(|o| o.output.contains("claimed by two processes"))
        .count();
    assert_eq!(duplicates, 3, "{}", out.report());
    assert_fast(&out, Duration::from_secs(20));
}

#[test]
fn world_size_mismatch() {
    const NAME: &str = "world_size_mismatch";
    if procs::is_child(NAME) {
        let err = ProcessGroup::from_env().unwrap_err();
        let text = show(&err);
        if rank() == 1 {
            assert!(
                matches!(
                    err,
                    DdpError::Rendezvous(RendezvousError::WorldSizeMismatch { .. })
                ),
                "{text}"
            );
        } else {
            assert!(text.contains("WORLD_SIZE=3"), "{text}");
        }
        return;
    }
    // With the launcher's job token, and without one (the token derived from the master
    // address must not turn the mismatch into a token mismatch).
    for token in [true, false] {
        let mut job = TestJob::new(2, NAME)
            .env("BURN_DDP_RENDEZVOUS_TIMEOUT", "120")
            .rank_env(1, "WORLD_SIZE", 3);
        if !token {
            job = job.unset("BURN_DDP_JOB_TOKEN");
        }
        let out = job.run();
        out.assert_all_ok();
        assert_fast(&out, Duration::from_secs(20));
    }
}

#[test]
fn master_unreachable() {
    const NAME: &str = "master_unreachable";
    if procs::is_child(NAME) {
        let err = ProcessGroup::from_env().unwrap_err();
        let text = show(&err);
        assert!(
            matches!(
                err,
                DdpError::Rendezvous(RendezvousError::MasterUnreachable { .. })
            ),
            "{text}"
        );
        return;
    }
    let out = TestJob::new(2, NAME)
        .skip(0)
        .env("BURN_DDP_RENDEZVOUS_TIMEOUT", "2")
        .run();
    out.assert_all_ok();
    assert_fast(&out, Duration::from_secs(20));
}

#[test]
fn port_already_in_use_by_another_job() {
    const NAME: &str = "port_already_in_use_by_another_job";
    if procs::is_child(NAME) {
        let err = ProcessGroup::from_env().unwrap_err();
        let text = show(&err);
        if rank() == 0 {
            assert!(
                matches!(err, DdpError::Rendezvous(RendezvousError::PortInUse { .. })),
                "{text}"
            );
            // The port came from BURN_DDP_STORE_PORT, not MASTER_PORT: the error says so.
            assert!(text.contains("(BURN_DDP_STORE_PORT="), "{text}");
        } else {
            // Rank 1 reaches the other job's store, which does not hold this job's token.
            assert!(
                matches!(
                    err,
                    DdpError::Rendezvous(RendezvousError::TokenMismatch { .. })
                ),
                "{text}"
            );
        }
        return;
    }
    // Job A: a rank 0 in this process, waiting for a rank 1 that never comes.
    let port = burn_ddp_comm::launch::spawn::free_port().unwrap();
    let cfg = burn_ddp_comm::GroupConfig::new(
        Rank(0),
        burn_ddp_comm::WorldSize::new(2).unwrap(),
        burn_ddp_comm::JobToken::new("job-a"),
    )
    .with_master(burn_ddp_comm::MasterAddr::new("127.0.0.1", port))
    .with_timeouts(burn_ddp_comm::Timeouts::uniform(Duration::from_secs(8)));
    let job_a = std::thread::spawn(move || ProcessGroup::init(cfg));
    // Until job A's store listens on the port (binding it then fails).
    let listening = Instant::now() + Duration::from_secs(10);
    while std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
        assert!(
            Instant::now() < listening,
            "job A's store never listened on {port}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let started = Instant::now();
    let out = TestJob::new(2, NAME)
        .env("BURN_DDP_STORE_PORT", port)
        .env("BURN_DDP_RENDEZVOUS_TIMEOUT", "5")
        .run();
    out.assert_all_ok();
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "{}",
        out.report()
    );
    // Job A saw the stranger and says so when it gives up.
    let a = job_a.join().unwrap().unwrap_err();
    assert!(a.to_string().contains("wrong job token"), "{a}");
}

#[test]
fn mismatched_collectives_are_reported_not_hung() {
    const NAME: &str = "mismatched_collectives_are_reported_not_hung";
    if procs::is_child(NAME) {
        let pg = ProcessGroup::from_env().unwrap();
        let mut x = vec![1.0f32; 10];
        let err = if pg.rank() == Rank(0) {
            pg.all_reduce(&mut x, ReduceOp::Sum).unwrap_err()
        } else {
            pg.broadcast(&mut x, Rank(0)).unwrap_err()
        };
        assert_mismatch(&err);
        return;
    }
    let out = TestJob::new(2, NAME)
        .env("BURN_DDP_COLLECTIVE_TIMEOUT", "600")
        .run();
    out.assert_all_ok();
    assert_fast(&out, Duration::from_secs(20));
}

/// Rank 3 of 5 is killed while the ranks run small all-reduces (over TCP by recursive
/// doubling: rank 3 exchanges with ranks 2 and 1 directly, the others only hear of it through
/// them; in shared memory every rank waits for rank 3, and only its ring neighbours have a link
/// to it): every survivor names rank 3, fast, though most never had a link to it.
fn rank_3_killed_in_small_collectives(name: &str, transport: &str) {
    if procs::is_child(name) {
        let pg = ProcessGroup::from_env().unwrap();
        assert_eq!(pg.transport(), transport);
        if pg.rank() == Rank(3) {
            procs::kill_self_after(Duration::from_millis(300));
        }
        procs::all_reduces_fail_naming(&pg, 100, Rank(3));
        return;
    }
    let out = TestJob::new(5, name)
        .env("BURN_DDP_COLLECTIVE_TIMEOUT", "600")
        .env("BURN_DDP_ALGO", "auto")
        .env("BURN_DDP_TRANSPORT", transport)
        .run();
    assert!(!out.rank(3).ok(), "{}", out.report());
    for r in [0, 1, 2, 4] {
        assert!(out.rank(r).ok(), "{}", out.report());
    }
    assert_fast(&out, Duration::from_secs(20));
}

#[test]
fn rank_killed_in_small_collectives_is_named_by_every_survivor() {
    let name = "rank_killed_in_small_collectives_is_named_by_every_survivor";
    rank_3_killed_in_small_collectives(name, "tcp");
}

#[test]
fn rank_killed_in_small_shared_memory_collectives_is_named_by_every_survivor() {
    let name = "rank_killed_in_small_shared_memory_collectives_is_named_by_every_survivor";
    rank_3_killed_in_small_collectives(name, "shm");
}

/// The inode of the shared segment this process maps (`/proc/self/maps`).
fn segment_inode() -> Option<u64> {
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    let line = maps.lines().find(|l| l.contains("/memfd:burn-ddp"))?;
    line.split_whitespace().nth(4)?.parse().ok()
}

/// Whether any process maps the shared segment of inode `ino`, or holds a descriptor of it.
fn segment_held(ino: u64) -> Option<String> {
    use std::os::unix::fs::MetadataExt;
    for proc in std::fs::read_dir("/proc").ok()?.flatten() {
        let path = proc.path();
        if !path
            .file_name()?
            .to_string_lossy()
            .bytes()
            .all(|b| b.is_ascii_digit())
        {
            continue;
        }
        let maps = std::fs::read_to_string(path.join("maps")).unwrap_or_default();
        if maps.lines().any(|l| {
            l.contains("/memfd:burn-ddp") && l.split_whitespace().nth(4) == Some(&ino.to_string())
        }) {
            return Some(format!("{} maps it", path.display()));
        }
        for fd in std::fs::read_dir(path.join("fd"))
            .into_iter()
            .flatten()
            .flatten()
        {
            let target = std::fs::read_link(fd.path()).unwrap_or_default();
            if target.to_string_lossy().contains("memfd:burn-ddp")
                && std::fs::metadata(fd.path()).is_ok_and(|m| m.ino() == ino)
            {
                return Some(format!("{} holds it", fd.path().display()));
            }
        }
    }
    None
}

fn shm_names() -> Vec<String> {
    std::fs::read_dir("/dev/shm")
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains("burn"))
        .collect()
}

/// Every rank is SIGKILLed in the middle of shared-memory collectives: nothing of the segment
/// survives them (no name in `/dev/shm`, no process that maps it or holds it).
#[test]
fn nothing_of_the_shared_segment_survives_a_kill_of_every_rank() {
    const NAME: &str = "nothing_of_the_shared_segment_survives_a_kill_of_every_rank";
    let report = std::env::temp_dir().join(format!("{NAME}-{}", std::process::id()));
    if procs::is_child(NAME) {
        let pg = ProcessGroup::from_env().unwrap();
        assert_eq!(pg.transport(), "shm");
        let mut pids = vec![0i64; 3];
        pg.all_gather(&[i64::from(std::process::id())], &mut pids)
            .unwrap();
        if pg.rank() == Rank(0) {
            let ino = segment_inode().expect("rank 0 maps the segment");
            let path = std::env::var("SEGMENT_REPORT").unwrap();
            std::fs::write(path, format!("{ino}")).unwrap();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(300));
                for &pid in pids.iter().rev() {
                    let pid = rustix::process::Pid::from_raw(pid as i32).unwrap();
                    let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
                }
            });
        }
        let mut buf = vec![1.0f32; 4 << 20];
        // Until killed: a rank that learns of another's death first waits for its own.
        while pg.all_reduce(&mut buf, ReduceOp::Sum).is_ok() {}
        loop {
            std::thread::sleep(Duration::from_secs(1));
        }
    }
    let before = shm_names();
    let out = TestJob::new(3, NAME)
        .env("BURN_DDP_TRANSPORT", "shm")
        .env("SEGMENT_REPORT", report.display())
        .timeout(Duration::from_secs(120))
        .run();
    for r in 0..3 {
        assert!(!out.rank(r).ok(), "every rank is killed: {}", out.report());
    }
    let ino: u64 = std::fs::read_to_string(&report)
        .unwrap_or_else(|e| panic!("rank 0 wrote no report ({e}): {}", out.report()))
        .trim()
        .parse()
        .unwrap();
    let _ = std::fs::remove_file(&report);
    assert_eq!(segment_held(ino), None, "segment inode {ino} survived");
    assert_eq!(shm_names(), before, "names left in /dev/shm");
}

/// Rank 2 calls a large all-reduce (the ring) where the others call a small one (recursive
/// doubling): no link carries both, yet the mismatch is reported at once, not after the
/// 10-minute deadline.
#[test]
fn collectives_that_chose_different_algorithms_are_reported_as_a_mismatch() {
    const NAME: &str = "collectives_that_chose_different_algorithms_are_reported_as_a_mismatch";
    if procs::is_child(NAME) {
        let pg = ProcessGroup::from_env().unwrap();
        pg.barrier().unwrap();
        let mut x = vec![1.0f32; if pg.rank() == Rank(2) { 1 << 20 } else { 10 }];
        let err = pg.all_reduce(&mut x, ReduceOp::Sum).unwrap_err();
        assert_mismatch(&err);
        return;
    }
    let out = TestJob::new(4, NAME)
        .env("BURN_DDP_COLLECTIVE_TIMEOUT", "600")
        .env("BURN_DDP_ALGO", "auto")
        .env("BURN_DDP_TRANSPORT", "tcp")
        .run();
    out.assert_all_ok();
    assert_fast(&out, Duration::from_secs(20));
}

/// Rank 2 is alive (its heartbeat beats) but stops calling collectives — a deadlock or an
/// endless loop in user code. The others are told within the stall bound, not the 10-minute
/// collective timeout, with the rank, its host and its last completed collective.
#[test]
fn rank_stuck_outside_the_collectives_is_reported_within_the_stall_bound() {
    const NAME: &str = "rank_stuck_outside_the_collectives_is_reported_within_the_stall_bound";
    if procs::is_child(NAME) {
        let pg = ProcessGroup::from_env().unwrap();
        let mut x = vec![1.0f32; 1024];
        pg.all_reduce(&mut x, ReduceOp::Sum).unwrap();
        if pg.rank() == Rank(2) {
            std::thread::sleep(Duration::from_secs(15));
            let err = pg.all_reduce(&mut x, ReduceOp::Sum).unwrap_err();
            show(&err);
            return;
        }
        let started = Instant::now();
        let err = pg.all_reduce(&mut x, ReduceOp::Sum).unwrap_err();
        let took = started.elapsed();
        let text = show(&err);
        match &err {
            DdpError::Collective(CollectiveError::RankUnresponsive {
                culprit,
                last_completed,
                host,
                ..
            }) => {
                assert_eq!(*culprit, Rank(2), "{text}");
                assert_eq!(
                    *last_completed,
                    burn_ddp_comm::types::CollectiveSeq(1),
                    "{text}"
                );
                assert!(!host.is_empty() && host != "?", "{text}");
                assert!(text.contains("has not reached collective #2"), "{text}");
            }
            DdpError::Collective(CollectiveError::JobAborted { record, .. }) => {
                assert_eq!(record.culprit, Some(Rank(2)), "{text}")
            }
            other => panic!("unexpected: {other}"),
        }
        assert!(took < Duration::from_secs(10), "took {took:?}: {text}");
        return;
    }
    let out = TestJob::new(3, NAME)
        .env("BURN_DDP_COLLECTIVE_TIMEOUT", "600")
        .env("BURN_DDP_STALL_TIMEOUT", "3")
        .run();
    out.assert_all_ok();
}

/// Rank 1 freezes (SIGSTOP: a hung node, a swapped-out process): its heartbeat stops, and the
/// others are told within the heartbeat bound.
#[test]
fn frozen_rank_is_reported_within_the_heartbeat_bound() {
    const NAME: &str = "frozen_rank_is_reported_within_the_heartbeat_bound";
    if procs::is_child(NAME) {
        let (pg, mut x) = join_then_freeze_rank_1();
        let started = Instant::now();
        let err = pg.all_reduce(&mut x, ReduceOp::Sum).unwrap_err();
        let took = started.elapsed();
        let text = show(&err);
        match &err {
            DdpError::Collective(CollectiveError::RankUnresponsive { culprit, .. }) => {
                assert_eq!(*culprit, Rank(1), "{text}");
                assert!(text.contains("sent no heartbeat"), "{text}");
            }
            DdpError::Collective(CollectiveError::JobAborted { record, .. }) => {
                assert_eq!(record.culprit, Some(Rank(1)), "{text}");
                assert!(record.reason.contains("sent no heartbeat"), "{text}");
            }
            other => panic!("unexpected: {other}"),
        }
        assert!(took < Duration::from_secs(12), "took {took:?}: {text}");
        kill_frozen_rank(&pg);
        return;
    }
    run_with_rank_1_frozen(NAME);
}

/// Rank 0 freezes (SIGSTOP), and with it the store it serves: the other ranks judge its silence
/// by the same heartbeat bound as any rank's, and name it, although the store cannot carry the
/// news (a store request that would hang is bounded by the heartbeat's check interval).
#[test]
fn frozen_rank_0_is_reported_within_the_heartbeat_bound() {
    const NAME: &str = "frozen_rank_0_is_reported_within_the_heartbeat_bound";
    if procs::is_child(NAME) {
        let pg = ProcessGroup::from_env().unwrap();
        let mut x = vec![1.0f32; 1024];
        pg.all_reduce(&mut x, ReduceOp::Sum).unwrap();
        let me = rustix::process::getpid();
        let mut pid = [i64::from(me.as_raw_nonzero().get())];
        pg.broadcast(&mut pid, Rank(0)).unwrap();
        if pg.rank() == Rank(0) {
            let _ = rustix::process::kill_process(me, rustix::process::Signal::STOP);
            loop {
                std::thread::sleep(Duration::from_secs(1));
            }
        }
        let started = Instant::now();
        let err = pg.all_reduce(&mut x, ReduceOp::Sum).unwrap_err();
        let took = started.elapsed();
        let text = show(&err);
        match &err {
            DdpError::Collective(CollectiveError::RankUnresponsive { culprit, .. }) => {
                assert_eq!(*culprit, Rank(0), "{text}");
                assert!(text.contains("stopped answering"), "{text}");
            }
            other => panic!("unexpected: {other}"),
        }
        // The bound (3 s) plus two checks of the heartbeat (each a 0.6 s wait and store
        // requests of at most 0.3 s): 4.8 s, and a margin for a loaded machine.
        assert!(took < Duration::from_secs(6), "took {took:?}: {text}");
        // The other survivor may not have its verdict yet: this process's exit (or rank 0's
        // death) would close connections it still waits on, and it would rightly name that
        // instead. Both verdicts come within the bound above, so wait out its rest.
        std::thread::sleep(Duration::from_secs(4));
        let pid = rustix::process::Pid::from_raw(pid[0] as i32).unwrap();
        let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
        return;
    }
    let out = heartbeat_job(3, NAME);
    assert!(!out.rank(0).ok(), "{}", out.report());
    assert!(out.rank(1).ok() && out.rank(2).ok(), "{}", out.report());
}

/// Joins the 3-rank job; then rank 1 freezes itself (SIGSTOP: a hung node, a swapped-out
/// process) and never returns, after leaving its pid in the store for [`kill_frozen_rank`].
/// The others get the group and a buffer. Rank 1 freezes as soon as it has the group, before any
/// collective: the moment its heartbeat thread may not have run yet, so its first heartbeat must
/// already be in the store when the group is handed over (else nobody ever judges its silence).
fn join_then_freeze_rank_1() -> (ProcessGroup, Vec<f32>) {
    let pg = ProcessGroup::from_env().unwrap();
    let x = vec![1.0f32; 1024];
    if pg.rank() == Rank(1) {
        freeze_here(&pg);
    }
    (pg, x)
}

/// Leaves this process's pid in the store for [`kill_frozen_rank`], then freezes it (SIGSTOP)
/// and never returns.
fn freeze_here(pg: &ProcessGroup) -> ! {
    let me = rustix::process::getpid();
    pg.store()
        .unwrap()
        .set("frozen-pid", me.as_raw_nonzero().to_string().as_bytes())
        .unwrap();
    let _ = rustix::process::kill_process(me, rustix::process::Signal::STOP);
    // The stop takes effect asynchronously (SIGSTOP can still be pending when `kill` returns),
    // so do nothing the others could notice until it does; the test kills it.
    loop {
        std::thread::sleep(Duration::from_secs(1));
    }
}

/// Rank 0 kills the process [`freeze_here`] froze.
fn kill_frozen_rank(pg: &ProcessGroup) {
    if pg.rank() == Rank(0) {
        let pid = pg.store().unwrap().get("frozen-pid").unwrap();
        let pid: i32 = String::from_utf8(pid).unwrap().parse().unwrap();
        let pid = rustix::process::Pid::from_raw(pid).unwrap();
        let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
    }
}

/// Runs test `name` on `n` ranks with a 3 s heartbeat bound, the collective and stall bounds at
/// 10 min (only the heartbeat can end a wait in time), within a minute.
fn heartbeat_job(n: u32, name: &str) -> procs::Outcomes {
    TestJob::new(n, name)
        .env("BURN_DDP_COLLECTIVE_TIMEOUT", "600")
        .env("BURN_DDP_STALL_TIMEOUT", "600")
        .env("BURN_DDP_HEARTBEAT_TIMEOUT", "3")
        .timeout(Duration::from_secs(60))
        .run()
}

/// Runs test `name` on 3 ranks with a 3 s heartbeat bound (the collective and stall bounds at
/// 10 min, so only the heartbeat can end it in time): rank 1 must fail (killed), the others pass.
fn run_with_rank_1_frozen(name: &str) {
    let out = heartbeat_job(3, name);
    assert!(!out.rank(1).ok(), "{}", out.report());
    assert!(out.rank(0).ok() && out.rank(2).ok(), "{}", out.report());
}

/// A rank that freezes while the others wait on it outside the host collectives (as NCCL
/// waits do, through `ProcessGroup::waiting_on_peers`) is named in the abort record within the
/// heartbeat bound.
#[test]
fn frozen_rank_is_reported_while_the_others_wait_outside_the_collectives() {
    const NAME: &str = "frozen_rank_is_reported_while_the_others_wait_outside_the_collectives";
    if procs::is_child(NAME) {
        let (pg, mut x) = join_then_freeze_rank_1();
        let started = Instant::now();
        let record = {
            let _waiting = pg.waiting_on_peers();
            loop {
                if let Some(r) = pg.abort_record().unwrap() {
                    break r;
                }
                assert!(
                    started.elapsed() < Duration::from_secs(40),
                    "nobody named the frozen rank"
                );
                std::thread::sleep(Duration::from_millis(50));
            }
        };
        let took = started.elapsed();
        assert_eq!(record.culprit, Some(Rank(1)), "{record:?}");
        assert!(
            record.reason.contains("sent no heartbeat")
                && record.reason.contains("outside the host collectives"),
            "{record:?}"
        );
        assert!(took < Duration::from_secs(12), "took {took:?}: {record:?}");
        // The group is aborted: the next collective fails at once, naming rank 1.
        let err = pg.all_reduce(&mut x, ReduceOp::Sum).unwrap_err();
        assert!(show(&err).contains("rank 1"), "{}", show(&err));
        kill_frozen_rank(&pg);
        return;
    }
    run_with_rank_1_frozen(NAME);
}

/// Each rank reads only its ring neighbours' heartbeats (a linear number of store requests): a
/// rank that waits on a far one — here rank 0 in a sub-group with rank 3, of 6 ranks, while the
/// others wait on nothing — still names it within the heartbeat bound, through the silence that
/// rank 3's neighbours (2 and 4) record although they wait on nothing themselves.
#[test]
fn frozen_far_rank_is_named_through_its_neighbours_record() {
    const NAME: &str = "frozen_far_rank_is_named_through_its_neighbours_record";
    if procs::is_child(NAME) {
        let pg = ProcessGroup::from_env().unwrap();
        let sub = pg.new_group(&[Rank(0), Rank(3)]).unwrap();
        match pg.rank() {
            Rank(3) => freeze_here(&pg),
            Rank(0) => {
                let mut x = vec![1.0f32; 1024];
                let started = Instant::now();
                let err = sub.unwrap().all_reduce(&mut x, ReduceOp::Sum).unwrap_err();
                let took = started.elapsed();
                let text = show(&err);
                // The sub-group's failure, naming the job's rank 3 and what its neighbour saw.
                assert!(
                    matches!(&err, DdpError::Collective(CollectiveError::InGroup { .. })),
                    "{text}"
                );
                assert_eq!(err.culprit(), Some(Rank(3)), "{text}");
                assert!(text.contains("sent no heartbeat"), "{text}");
                kill_frozen_rank(&pg);
                assert!(took < Duration::from_secs(12), "took {took:?}: {text}");
            }
            // Waiting on nothing, past rank 0's verdict.
            _ => std::thread::sleep(Duration::from_secs(14)),
        }
        return;
    }
    let out = heartbeat_job(6, NAME);
    assert!(!out.rank(3).ok(), "{}", out.report());
    for r in [0, 1, 2, 4, 5] {
        assert!(out.rank(r).ok(), "rank {r}: {}", out.report());
    }
}

/// With `BURN_DDP_DEBUG_DESYNC=1` every rank stops before the first collective that differs,
/// and says what each side called and from which line.
#[test]
fn desync_debug_mode_shows_both_calls_and_their_lines() {
    const NAME: &str = "desync_debug_mode_shows_both_calls_and_their_lines";
    if procs::is_child(NAME) {
        let pg = ProcessGroup::from_env().unwrap();
        let mut x = vec![1.0f32; 1024];
        pg.all_reduce(&mut x, ReduceOp::Sum).unwrap();
        let err = if pg.rank() == Rank(2) {
            pg.broadcast(&mut x, Rank(0)).unwrap_err()
        } else {
            pg.all_reduce(&mut x, ReduceOp::Sum).unwrap_err()
        };
        let text = show(&err);
        let DdpError::Collective(CollectiveError::Desync {
            call,
            ours,
            peer,
            theirs,
            ..
        }) = &err
        else {
            panic!("unexpected: {text}");
        };
        assert_eq!(*call, burn_ddp_comm::types::CollectiveSeq(2), "{text}");
        let (mine, other) = if pg.rank() == Rank(2) {
            assert_eq!(*peer, Rank(0), "{text}");
            (
                "broadcast(1024 x float, root 0)",
                "all_reduce(1024 x float, sum)",
            )
        } else {
            assert_eq!(*peer, Rank(2), "{text}");
            (
                "all_reduce(1024 x float, sum)",
                "broadcast(1024 x float, root 0)",
            )
        };
        assert!(ours.starts_with(mine), "{text}");
        assert!(theirs.starts_with(other), "{text}");
        assert!(
            ours.contains("tests/integration/group_failures.rs:")
                && theirs.contains("tests/integration/group_failures.rs:"),
            "{text}"
        );
        return;
    }
    let out = TestJob::new(3, NAME)
        .env("BURN_DDP_DEBUG_DESYNC", "1")
        .env("BURN_DDP_COLLECTIVE_TIMEOUT", "20")
        .run();
    out.assert_all_ok();
    assert_fast(&out, Duration::from_secs(20));
}
