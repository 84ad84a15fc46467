//! Sub-groups and point-to-point, in real processes over TCP: collectives on overlapping and
//! disjoint sub-groups, messages in order and by tag, both directions at once, batches, and the
//! failures: a bad argument, a size mismatch, a killed rank named by every other rank.

use burn_ddp_comm::CollectiveError;
use std::time::Duration;

use burn_ddp_comm::{DdpError, P2pOp, ProcessGroup, Rank, ReduceOp};
use burn_ddp_dev::procs::{self, TestJob};

fn show(pg: &ProcessGroup, e: &DdpError) -> String {
    let s = e.to_string();
    println!("rank {} error: {s}", pg.global_rank());
    s
}

#[test]
fn subgroup_collectives_on_overlapping_and_disjoint_groups() {
    procs::multi_process(
        4,
        "subgroup_collectives_on_overlapping_and_disjoint_groups",
        |pg| {
            let me = pg.rank().0;
            // Disjoint: {0, 1} and {2, 3}. Every rank calls new_group for both, members or not.
            let low = pg.new_group(&[Rank(0), Rank(1)]).unwrap();
            let high = pg.new_group(&[Rank(3), Rank(2)]).unwrap();
            // Overlapping with both: {1, 2, 3}.
            let mid = pg.new_group(&[Rank(1), Rank(2), Rank(3)]).unwrap();
            // By color: even and odd ranks.
            let parity = pg.split(Some(me % 2)).unwrap().unwrap();
            assert_eq!(low.is_some(), me < 2);
            assert_eq!(high.is_some(), me >= 2);
            assert_eq!(mid.is_some(), me >= 1);
            assert_eq!(parity.members(), [Rank(me % 2), Rank(me % 2 + 2)]);
            assert_eq!(parity.global_rank(), Rank(me));
            assert_eq!(parity.rank(), Rank(me / 2));
            if let Some(high) = &high {
                // The listed order: rank 3 is group rank 0.
                assert_eq!(high.rank(), Rank(3 - me));
                assert_eq!(high.to_global(Rank(0)), Rank(3));
            }

            // The disjoint groups do not wait for each other: {2, 3} first wait for a message that
            // rank 0 sends only after {0, 1} finished 50 all-reduces. If {0, 1} needed {2, 3}, this
            // would never finish (the harness's deadline would fail the test).
            let mut x = [0f32; 1000];
            if let Some(low) = &low {
                for i in 0..50 {
                    x.fill((me + 1) as f32 * i as f32);
                    low.all_reduce(&mut x, ReduceOp::Sum).unwrap();
                    assert!(x.iter().all(|&v| v == 3.0 * i as f32), "{}", x[0]);
                }
                if me == 0 {
                    pg.send(&[50i64], Rank(2), 0).unwrap();
                    pg.send(&[50i64], Rank(3), 0).unwrap();
                }
            }
            if let Some(high) = &high {
                let mut done = [0i64];
                pg.recv(&mut done, Rank(0), 0).unwrap();
                assert_eq!(done, [50]);
                for i in 0..50 {
                    x.fill((me + 1) as f32 * i as f32);
                    high.all_reduce(&mut x, ReduceOp::Sum).unwrap();
                    assert!(x.iter().all(|&v| v == 7.0 * i as f32), "{}", x[0]);
                }
            }
            // Overlapping groups interleaved with the world's collectives.
            for i in 0..10 {
                let mut w = [(me + i) as i64];
                pg.all_reduce(&mut w, ReduceOp::Sum).unwrap();
                assert_eq!(w[0], (6 + 4 * i) as i64);
                if let Some(mid) = &mid {
                    let mut m = [me as i64; 3];
                    mid.all_reduce(&mut m, ReduceOp::Max).unwrap();
                    assert_eq!(m, [3; 3]);
                    let mut b = vec![me as f64; 5];
                    mid.broadcast(&mut b, Rank(1)).unwrap();
                    // Group rank 1 is rank 2.
                    assert_eq!(b, [2.0; 5]);
                }
                let mut g = [0i32; 2];
                parity.all_gather(&[me as i32], &mut g).unwrap();
                assert_eq!(g, [(me % 2) as i32, (me % 2 + 2) as i32]);
            }
            // Collectives of a sub-group can run on its own thread while the world group runs
            // its own on this one (each group has its own connections).
            std::thread::scope(|s| {
                let side = s.spawn(|| {
                    let mut v = [1u8; 64];
                    for _ in 0..20 {
                        parity.all_reduce(&mut v, ReduceOp::Min).unwrap();
                    }
                    v
                });
                for _ in 0..20 {
                    pg.barrier().unwrap();
                }
                assert_eq!(side.join().unwrap(), [1u8; 64]);
            });
            // Point-to-point inside a sub-group uses group ranks.
            if let Some(mid) = &mid {
                let next = Rank((mid.rank().0 + 1) % 3);
                let prev = Rank((mid.rank().0 + 2) % 3);
                mid.send(&[mid.global_rank().0 as i32], next, 9).unwrap();
                let mut got = [0i32];
                mid.recv(&mut got, prev, 9).unwrap();
                assert_eq!(Rank(got[0] as u32), mid.to_global(prev));
            }
            pg.barrier().unwrap();
        },
    );
}

#[test]
fn point_to_point_keeps_order_per_tag_and_never_deadlocks() {
    p2p_order(
        "point_to_point_keeps_order_per_tag_and_never_deadlocks",
        "shm",
    );
}

#[test]
fn point_to_point_over_tcp_keeps_order_per_tag_and_never_deadlocks() {
    p2p_order(
        "point_to_point_over_tcp_keeps_order_per_tag_and_never_deadlocks",
        "tcp",
    );
}

/// Order per tag, sends that never wait for the receiver, large messages both ways at once, in
/// three processes whose group moves its messages over `transport` (through shared memory when
/// they share it, the default on one host).
fn p2p_order(name: &str, transport: &str) {
    if !procs::is_child(name) {
        TestJob::new(3, name)
            .env("BURN_DDP_TRANSPORT", transport)
            .run()
            .assert_all_ok();
        return;
    }
    {
        let pg = ProcessGroup::from_env().unwrap();
        assert_eq!(pg.transport(), transport);
        {
            let me = pg.rank().0;
            let next = Rank((me + 1) % 3);
            let prev = Rank((me + 2) % 3);
            // A send completes before its receiver reaches any point-to-point call (this is the
            // job's first): rank 0 sends, then meets the others in a barrier; rank 1 receives
            // only after it.
            if me == 0 {
                pg.send(&[42i64], Rank(1), 6).unwrap();
            }
            pg.barrier().unwrap();
            if me == 1 {
                let mut v = [0i64];
                pg.recv(&mut v, Rank(0), 6).unwrap();
                assert_eq!(v, [42]);
            }
            // Every rank sends before it receives: sends do not wait for the receiver.
            for i in 0..20 {
                pg.send(&[me as i32 * 100 + i], next, 1).unwrap();
            }
            pg.send(&[7.5f64; 3], next, 2).unwrap();
            // Tag 2 first, although it was sent last; tag 1 in sending order.
            let mut f = [0f64; 3];
            pg.recv(&mut f, prev, 2).unwrap();
            assert_eq!(f, [7.5; 3]);
            for i in 0..20 {
                let mut v = [0i32];
                pg.recv(&mut v, prev, 1).unwrap();
                assert_eq!(v[0], prev.0 as i32 * 100 + i);
            }
            // A large message both ways at once between ranks 0 and 1 (64 MiB each way).
            if me < 2 {
                let other = Rank(1 - me);
                let out = vec![me as f32 + 0.5; 16 << 20];
                let mut back = vec![0f32; 16 << 20];
                pg.batch_send_recv(&mut [
                    P2pOp::send(&out, other, 3),
                    P2pOp::recv(&mut back, other, 3),
                ])
                .unwrap();
                assert!(back.iter().all(|&v| v == other.0 as f32 + 0.5));
            }
            // A batch that sends to two ranks and receives from two.
            let mut a = [0i64; 4];
            let mut b = [0i64; 4];
            pg.batch_send_recv(&mut [
                P2pOp::send(&[me as i64; 4], next, 4),
                P2pOp::send(&[10 + me as i64; 4], prev, 4),
                P2pOp::recv(&mut a, prev, 4),
                P2pOp::recv(&mut b, next, 4),
            ])
            .unwrap();
            assert_eq!(a, [prev.0 as i64; 4]);
            assert_eq!(b, [10 + next.0 as i64; 4]);
            // Bytes of any length.
            let text = format!("hello from {me}").repeat(me as usize + 1);
            pg.send_bytes(text.as_bytes(), next, 5).unwrap();
            let got = pg.recv_bytes(prev, 5).unwrap();
            assert_eq!(
                String::from_utf8(got).unwrap(),
                format!("hello from {}", prev.0).repeat(prev.0 as usize + 1)
            );
            // Bad arguments fail at once without harming the group.
            let e = pg.send(&[1u8], Rank(3), 0).unwrap_err();
            assert!(e.to_string().contains("rank 3 is not in this group"), "{e}");
            let e = pg.recv(&mut [0u8], Rank(me), 0).unwrap_err();
            assert!(e.to_string().contains("itself"), "{e}");
            pg.barrier().unwrap();
        }
    }
}

#[test]
fn point_to_point_on_threads_of_one_process() {
    let groups = ProcessGroup::local(
        burn_ddp_comm::WorldSize::new(2).unwrap(),
        burn_ddp_comm::Timeouts::default(),
    );
    std::thread::scope(|s| {
        for pg in &groups {
            s.spawn(move || {
                let other = Rank(1 - pg.rank().0);
                pg.send(&[pg.rank().0 as f32; 8], other, 0).unwrap();
                let mut v = [9f32; 8];
                pg.recv(&mut v, other, 0).unwrap();
                assert_eq!(v, [other.0 as f32; 8]);
            });
        }
    });
}

#[test]
fn a_message_of_the_wrong_size_is_named_on_the_receiver() {
    const NAME: &str = "a_message_of_the_wrong_size_is_named_on_the_receiver";
    if let Some(pg) = procs::child_group(NAME) {
        if pg.rank() == Rank(0) {
            pg.send(&[1f32; 10], Rank(1), 6).unwrap();
            // The receiver's failure ends the job: this rank hears of it.
            let e = pg.recv(&mut [0u8], Rank(1), 7).unwrap_err();
            let text = show(&pg, &e);
            assert!(text.contains("12 bytes of float"), "{text}");
        } else {
            let e = pg.recv(&mut [0f32; 3], Rank(0), 6).unwrap_err();
            let text = show(&pg, &e);
            assert!(
                text.contains(
                    "the message is 40 bytes of float, the receive buffer 12 bytes of float"
                ),
                "{text}"
            );
        }
        return;
    }
    let out = TestJob::new(2, NAME)
        .env("BURN_DDP_COLLECTIVE_TIMEOUT", "600")
        .run();
    out.assert_all_ok();
}

/// A three-stage pipeline in which the middle stage is killed: both neighbours name it, long
/// before the 10-minute deadline. Stage 0 waits for a gradient the dead stage never sent.
#[test]
fn a_killed_stage_is_named_by_every_other_rank() {
    killed_stage("a_killed_stage_is_named_by_every_other_rank", "shm");
}

#[test]
fn a_killed_stage_over_tcp_is_named_by_every_other_rank() {
    killed_stage(
        "a_killed_stage_over_tcp_is_named_by_every_other_rank",
        "tcp",
    );
}

fn killed_stage(name: &str, transport: &str) {
    if let Some(pg) = procs::child_group(name) {
        assert_eq!(pg.transport(), transport);
        let me = pg.rank().0;
        let act = vec![1f32; 1 << 16];
        let mut buf = vec![0f32; 1 << 16];
        let err = (0..1000)
            .find_map(|step| {
                let r = match me {
                    0 => pg
                        .send(&act, Rank(1), 0)
                        .and_then(|()| pg.recv(&mut buf, Rank(1), 1)),
                    1 => {
                        pg.recv(&mut buf, Rank(0), 0).unwrap();
                        if step == 3 {
                            let me = rustix::process::getpid();
                            let _ =
                                rustix::process::kill_process(me, rustix::process::Signal::KILL);
                            std::thread::sleep(Duration::from_secs(60));
                        }
                        pg.send(&act, Rank(2), 0).unwrap();
                        pg.recv(&mut buf, Rank(2), 1).unwrap();
                        pg.send(&act, Rank(0), 1)
                    }
                    _ => pg
                        .recv(&mut buf, Rank(1), 0)
                        .and_then(|()| pg.send(&act, Rank(1), 1)),
                };
                r.err()
            })
            .expect("the pipeline cannot go on once rank 1 is dead");
        let text = show(&pg, &err);
        match &err {
            DdpError::Collective(CollectiveError::PeerLost { peer, .. })
            | DdpError::Collective(CollectiveError::RankUnresponsive { culprit: peer, .. }) => {
                assert_eq!(*peer, Rank(1), "{text}")
            }
            DdpError::Collective(CollectiveError::JobAborted { record, .. }) => {
                assert_eq!(record.culprit, Some(Rank(1)), "{text}")
            }
            other => panic!("unexpected error: {other}"),
        }
        // The group is unusable afterwards, and says so at once, naming the culprit.
        let again = pg.barrier().unwrap_err();
        assert!(again.to_string().contains("rank 1"), "{again}");
        return;
    }
    procs::assert_killed_rank_named_fast_with(3, name, 1, &[("BURN_DDP_TRANSPORT", transport)]);
}

/// A rank killed while a sub-group it is not in runs collectives, and while its own sub-group
/// waits: the heartbeat names it in every group.
#[test]
fn a_killed_rank_is_named_in_its_subgroup() {
    const NAME: &str = "a_killed_rank_is_named_in_its_subgroup";
    if let Some(pg) = procs::child_group(NAME) {
        let me = pg.rank().0;
        let pair = pg.split(Some(me / 2)).unwrap().unwrap();
        if me == 3 {
            std::thread::sleep(Duration::from_millis(500));
            let pid = rustix::process::getpid();
            let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
            std::thread::sleep(Duration::from_secs(60));
        }
        let mut x = vec![1f32; 1 << 16];
        let err = (0..100_000)
            .find_map(|_| pair.all_reduce(&mut x, ReduceOp::Sum).err())
            .expect("rank 3's death must end the job");
        let text = show(&pg, &err);
        assert!(text.contains("rank 3"), "{text}");
        if me == 2 {
            assert!(
                text.starts_with("[group g0 color 1: ranks [2, 3], group rank 0]"),
                "{text}"
            );
        }
        return;
    }
    procs::assert_killed_rank_named_fast(4, NAME, 3);
}
