//! Store tests on real sockets: the server, clients, and a raw socket that misbehaves.

use crate::error::{CollectiveError, RendezvousError};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::thread;
use std::time::{Duration, Instant};

use super::protocol::{self, Request};
use super::server::MAX_PENDING;
use super::{Store, StoreClient, StoreServer, WaitOutcome};
use crate::config::{JobToken, MasterAddr};
use crate::store::auth::Purpose;
use crate::types::{Rank, WorldSize};
use crate::wire;
use crate::DdpError;

fn world(n: u32) -> WorldSize {
    WorldSize::new(n).unwrap()
}

fn serve(n: u32) -> StoreServer {
    StoreServer::bind(
        "127.0.0.1:0".parse().unwrap(),
        Rank(0),
        world(n),
        JobToken::new("secret"),
    )
    .unwrap()
}

fn join_as(
    addr: SocketAddr,
    purpose: Purpose,
    rank: u32,
    n: u32,
    token: &str,
) -> crate::Result<StoreClient> {
    StoreClient::connect(
        &MasterAddr::new(addr.ip().to_string(), addr.port()),
        purpose,
        Rank(rank),
        world(n),
        &JobToken::new(token),
        Duration::from_secs(5),
        Instant::now() + Duration::from_secs(5),
    )
}

fn join(addr: SocketAddr, rank: u32, n: u32) -> StoreClient {
    join_as(addr, Purpose::Store, rank, n, "secret").unwrap()
}

#[test]
fn set_get_add_wait_compare_delete() {
    let server = serve(2);
    let a = join(server.addr(), 0, 2);
    let b = join(server.addr(), 1, 2);
    a.set("k", b"v").unwrap();
    assert_eq!(b.get("k").unwrap(), b"v");
    assert_eq!(a.add("n", 2).unwrap(), 2);
    assert_eq!(b.add("n", -5).unwrap(), -3);
    assert_eq!(
        b.wait(&["k".into()], Duration::from_millis(10)).unwrap(),
        WaitOutcome::Ready
    );
    assert_eq!(
        b.wait(&["k".into(), "z".into()], Duration::from_millis(50))
            .unwrap(),
        WaitOutcome::Missing(vec!["z".into()])
    );
    assert_eq!(a.compare_set("c", None, b"1").unwrap(), b"1");
    assert_eq!(a.compare_set("c", None, b"2").unwrap(), b"1");
    assert_eq!(a.compare_set("c", Some(b"1"), b"3").unwrap(), b"3");
    assert!(a.delete("c").unwrap());
    assert!(!a.delete("c").unwrap());
    // Both members are listed as joined.
    assert_eq!(
        a.wait(
            &[protocol::joined_key(Rank(0)), protocol::joined_key(Rank(1))],
            Duration::from_secs(1)
        )
        .unwrap(),
        WaitOutcome::Ready
    );
}

#[test]
fn add_on_a_value_that_is_not_a_counter_is_refused_and_the_connection_lives_on() {
    let server = serve(1);
    let a = join(server.addr(), 0, 1);
    a.set("v", b"abc").unwrap();
    match a.add("v", 1) {
        Err(DdpError::Rendezvous(RendezvousError::StoreRequest {
            op, key, reason, ..
        })) => {
            assert_eq!((op, key.as_str()), ("add", "v"));
            assert!(reason.contains("3-byte"), "{reason}");
        }
        other => panic!("expected StoreRequest, got {other:?}"),
    }
    assert_eq!(a.get("v").unwrap(), b"abc", "the value must not be lost");
    assert_eq!(a.add("n", 1).unwrap(), 1);
}

#[test]
fn user_keys_are_kept_apart_from_internal_keys() {
    let server = serve(2);
    let a = std::sync::Arc::new(join(server.addr(), 0, 2));
    let b = std::sync::Arc::new(join(server.addr(), 1, 2));
    let (sa, sb) = (Store::new(a.clone()), Store::new(b.clone()));
    sa.set(&protocol::joined_key(Rank(5)), b"x").unwrap();
    // The user's key did not land on the internal one.
    assert_eq!(
        b.wait(&[protocol::joined_key(Rank(5))], Duration::from_millis(20))
            .unwrap(),
        WaitOutcome::Missing(vec![protocol::joined_key(Rank(5))])
    );
    assert_eq!(sb.get(&protocol::joined_key(Rank(5))).unwrap(), b"x");
    assert_eq!(sa.add("arrived", 1).unwrap(), 1);
    assert_eq!(sb.add("arrived", 1).unwrap(), 2);
    sb.wait(&["arrived"], Duration::from_millis(50)).unwrap();
    match sb.wait(&["arrived", "never"], Duration::from_millis(20)) {
        Err(DdpError::Rendezvous(RendezvousError::StoreTimeout { op, key, .. })) => {
            assert_eq!((op, key.as_str()), ("wait", "never"))
        }
        other => panic!("expected StoreTimeout, got {other:?}"),
    }
    assert_eq!(sa.compare_set("c", None, b"1").unwrap(), b"1");
    assert!(sb.delete("c").unwrap());
    assert!(matches!(
        sa.get_timeout("c", Duration::from_millis(20)),
        Err(DdpError::Rendezvous(RendezvousError::StoreTimeout { .. }))
    ));
}

#[test]
fn blocking_get_wakes_on_set() {
    let server = serve(2);
    let addr = server.addr();
    let waiter = thread::spawn(move || {
        let b = join(addr, 1, 2);
        b.get("late").unwrap()
    });
    let a = join(addr, 0, 2);
    thread::sleep(Duration::from_millis(100));
    a.set("late", b"here").unwrap();
    assert_eq!(waiter.join().unwrap(), b"here");
}

#[test]
fn get_times_out_with_the_key_name() {
    let server = serve(1);
    let a = join(server.addr(), 0, 1);
    let err = a
        .get_timeout("never", Duration::from_millis(50))
        .unwrap_err();
    assert!(
        matches!(err, DdpError::Rendezvous(RendezvousError::StoreTimeout { ref key, .. }) if key == "never"),
        "{err}"
    );
}

#[test]
fn wrong_token_is_refused_and_recorded() {
    let server = serve(2);
    let err = join_as(server.addr(), Purpose::Store, 1, 2, "other-job").unwrap_err();
    assert!(
        matches!(
            err,
            DdpError::Rendezvous(RendezvousError::TokenMismatch { .. })
        ),
        "{err}"
    );
    let a = join(server.addr(), 0, 2);
    // A stranger does not abort the job, but it is recorded for diagnostics.
    assert_eq!(a.abort_record().unwrap(), None);
    // The server records the refusal just after sending it, so the stranger can hear of it
    // first: wait (bounded) for the record.
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    let refusals = loop {
        let r = a.refusals().unwrap();
        if !r.is_empty() || std::time::Instant::now() > deadline {
            break r;
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    assert_eq!(refusals.len(), 1, "{refusals:?}");
}

/// A store for 3 ranks, rank 1 joined, and a second claim of rank 1 refused (which aborts the
/// rendezvous): the store and rank 1's client.
fn rank_claimed_twice() -> (StoreServer, StoreClient) {
    let server = serve(3);
    let first = join(server.addr(), 1, 3);
    let err = join_as(server.addr(), Purpose::Store, 1, 3, "secret").unwrap_err();
    assert!(
        matches!(
            err,
            DdpError::Rendezvous(RendezvousError::DuplicateRank { .. })
        ),
        "{err}"
    );
    (server, first)
}

/// `first`, waiting, is released with the explanation instead of timing out.
fn is_told_a_rank_was_claimed_twice(first: &StoreClient) {
    let err = first
        .wait(&[protocol::joined_key(Rank(2))], Duration::from_secs(30))
        .unwrap_err();
    assert!(
        err.to_string().contains("claimed by two processes"),
        "{err}"
    );
}

#[test]
fn duplicate_rank_is_refused_and_aborts_the_rendezvous() {
    let (_server, first) = rank_claimed_twice();
    is_told_a_rank_was_claimed_twice(&first);
}

/// Rank 0's rendezvous fails (here, a rank claimed twice aborted it): its store stays up until
/// the rank still waiting has read the abort record, even when that rank was between two
/// requests when rank 0 gave up (it used to find the store gone: "lost the connection").
#[test]
fn after_a_failed_rendezvous_the_store_stays_up_until_the_others_read_the_abort() {
    let (server, first) = rank_claimed_twice();
    let rank0 = thread::spawn(move || {
        server.linger_after_abort(Rank(0));
        drop(server);
    });
    // Rank 1 is between two requests while rank 0 gives up.
    thread::sleep(Duration::from_millis(300));
    is_told_a_rank_was_claimed_twice(&first);
    drop(first);
    rank0.join().unwrap();
}

#[test]
fn world_size_mismatch_is_refused() {
    let server = serve(2);
    let err = join_as(server.addr(), Purpose::Store, 1, 3, "secret").unwrap_err();
    assert!(
        matches!(
            err,
            DdpError::Rendezvous(RendezvousError::WorldSizeMismatch { .. })
        ),
        "{err}"
    );
}

#[test]
fn auxiliary_connections_do_not_claim_the_rank() {
    let server = serve(2);
    let _member = join(server.addr(), 1, 2);
    let aux = join_as(server.addr(), Purpose::StoreAux, 1, 2, "secret").unwrap();
    aux.set("x", b"1").unwrap();
}

#[test]
fn unclean_disconnect_aborts_and_names_the_rank() {
    let server = serve(2);
    let a = join(server.addr(), 0, 2);
    let b = join(server.addr(), 1, 2);
    drop(b); // no goodbye: as if the process died
    let err = a.get_timeout("never", Duration::from_secs(10)).unwrap_err();
    match err {
        DdpError::Collective(CollectiveError::JobAborted { record, .. }) => {
            assert_eq!(record.culprit, Some(Rank(1)))
        }
        other => panic!("{other}"),
    }
}

/// A member that dies while its request waits in the store (a rank killed in its rendezvous)
/// is found when its connection closes, not when its wait would have ended.
#[test]
fn a_member_that_dies_while_it_waits_is_found_at_once() {
    let server = serve(2);
    let a = join(server.addr(), 0, 2);
    let mut b = raw_authenticated_as(server.addr(), Purpose::Store, 1);
    let (k, p) = Request::Get {
        key: "never".into(),
        timeout: Duration::from_secs(60),
    }
    .encode();
    wire::write_frame(&mut b, k, &p).unwrap();
    thread::sleep(Duration::from_millis(100));
    let started = Instant::now();
    drop(b);
    let err = a
        .get_timeout("also-never", Duration::from_secs(10))
        .unwrap_err();
    match err {
        DdpError::Collective(CollectiveError::JobAborted { record, .. }) => {
            assert_eq!(record.culprit, Some(Rank(1)))
        }
        other => panic!("{other}"),
    }
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "found after {:?}",
        started.elapsed()
    );
}

#[test]
fn goodbye_is_not_a_failure() {
    let server = serve(2);
    let a = join(server.addr(), 0, 2);
    let b = join(server.addr(), 1, 2);
    b.bye(Duration::from_secs(1));
    drop(b);
    thread::sleep(Duration::from_millis(100));
    assert_eq!(a.abort_record().unwrap(), None);
    server.wait_for_departures(Rank(0), Duration::from_secs(1));
}

/// Opens a raw TCP connection and authenticates it like a real client would, so that the
/// garbage that follows reaches the request decoder.
fn raw_authenticated(addr: SocketAddr) -> TcpStream {
    raw_authenticated_as(addr, Purpose::StoreAux, 0)
}

/// [`raw_authenticated`] as rank `rank` of 2, for `purpose`.
fn raw_authenticated_as(addr: SocketAddr, purpose: Purpose, rank: u32) -> TcpStream {
    let mut s = TcpStream::connect(addr).unwrap();
    crate::store::auth::client_handshake(
        &mut s,
        purpose,
        &JobToken::new("secret"),
        Rank(rank),
        world(2),
        Instant::now() + Duration::from_secs(5),
    )
    .unwrap();
    s
}

fn assert_still_serving(addr: SocketAddr) {
    let c = join_as(addr, Purpose::StoreAux, 0, 2, "secret").unwrap();
    c.set("alive", b"yes").unwrap();
    assert_eq!(c.get("alive").unwrap(), b"yes");
}

#[test]
fn survives_garbage_before_the_handshake() {
    let server = serve(2);
    let mut s = TcpStream::connect(server.addr()).unwrap();
    s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    let mut sink = Vec::new();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let _ = s.read_to_end(&mut sink); // the server closes the connection
    assert_still_serving(server.addr());
}

#[test]
fn survives_oversized_frames() {
    let server = serve(2);
    // Before authentication.
    let mut s = TcpStream::connect(server.addr()).unwrap();
    s.write_all(&wire::encode_header(0x01, u32::MAX)).unwrap();
    // After authentication: a request announcing 4 GiB.
    let mut s2 = raw_authenticated(server.addr());
    s2.write_all(&wire::encode_header(0x10, u32::MAX)).unwrap();
    let mut sink = Vec::new();
    s2.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let _ = s2.read_to_end(&mut sink);
    assert_still_serving(server.addr());
    drop(s);
}

#[test]
fn survives_truncated_and_malformed_requests() {
    let server = serve(2);
    // A header that promises 100 bytes, then only 3, then the client goes away.
    let mut s = raw_authenticated(server.addr());
    s.write_all(&wire::encode_header(0x10, 100)).unwrap();
    s.write_all(b"abc").unwrap();
    drop(s);
    // A well-framed request whose payload is nonsense: answered with an error, then closed.
    let mut s = raw_authenticated(server.addr());
    wire::write_frame(&mut s, 0x10, &[0xff, 0xff, 0xff, 0xff, 1]).unwrap();
    let (kind, payload) = wire::read_frame(&mut s, 1 << 20).unwrap();
    let reply = protocol::Reply::decode(kind, &payload).unwrap();
    assert!(matches!(reply, protocol::Reply::Error(_)), "{reply:?}");
    // An unknown request kind.
    let mut s = raw_authenticated(server.addr());
    wire::write_frame(&mut s, 0x7f, &[]).unwrap();
    let (kind, payload) = wire::read_frame(&mut s, 1 << 20).unwrap();
    assert!(matches!(
        protocol::Reply::decode(kind, &payload).unwrap(),
        protocol::Reply::Error(_)
    ));
    // Random bytes of every length.
    for len in [1usize, 11, 12, 13, 64, 4096] {
        let mut s = raw_authenticated(server.addr());
        let junk: Vec<u8> = (0..len).map(|i| (i * 7 + 3) as u8).collect();
        let _ = s.write_all(&junk);
    }
    assert_still_serving(server.addr());
    // A valid request still works on a fresh connection.
    let mut s = raw_authenticated(server.addr());
    let (k, p) = Request::Set {
        key: "raw".into(),
        value: b"ok".to_vec(),
    }
    .encode();
    wire::write_frame(&mut s, k, &p).unwrap();
    let (kind, payload) = wire::read_frame(&mut s, 1 << 20).unwrap();
    assert_eq!(
        protocol::Reply::decode(kind, &payload).unwrap(),
        protocol::Reply::Ok
    );
}

#[test]
fn port_in_use_is_reported() {
    let server = serve(2);
    let err = StoreServer::bind(server.addr(), Rank(0), world(2), JobToken::new("x")).unwrap_err();
    assert!(
        matches!(err, DdpError::Rendezvous(RendezvousError::PortInUse { .. })),
        "{err}"
    );
}

#[test]
fn unreachable_master_times_out_with_the_address() {
    // Bind then drop a listener to get a port nobody listens on.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let started = Instant::now();
    let err = StoreClient::connect(
        &MasterAddr::new("127.0.0.1", port),
        Purpose::Store,
        Rank(1),
        world(2),
        &JobToken::new("t"),
        Duration::from_secs(1),
        Instant::now() + Duration::from_millis(600),
    )
    .unwrap_err();
    assert!(
        matches!(
            err,
            DdpError::Rendezvous(RendezvousError::MasterUnreachable { .. })
        ),
        "{err}"
    );
    assert!(started.elapsed() < Duration::from_secs(5));
}

/// Idle and trickling connections that never authenticate cannot keep a rank out: at most
/// `MAX_PENDING` handshakes are held at once (a new connection closes the oldest), and each
/// lasts at most the handshake bound in all, however slowly its bytes come. The connections
/// the server holds stay bounded under a flood.
#[test]
fn unauthenticated_floods_cannot_keep_a_rank_out() {
    let server = StoreServer::bind_with(
        "127.0.0.1:0".parse().unwrap(),
        Rank(0),
        world(2),
        JobToken::new("secret"),
        Duration::from_secs(1),
    )
    .unwrap();
    let addr = server.addr();
    let idle: Vec<TcpStream> = (0..300)
        .map(|_| TcpStream::connect(addr).unwrap())
        .collect();
    // A peer that sends one byte of a plausible hello every 100 ms.
    let trickler = thread::spawn(move || {
        let mut s = TcpStream::connect(addr).unwrap();
        let started = Instant::now();
        for b in wire::encode_header(0x01, 60).iter().cycle() {
            if s.write_all(&[*b]).is_err() || started.elapsed() > Duration::from_secs(20) {
                break;
            }
            thread::sleep(Duration::from_millis(100));
        }
        started.elapsed()
    });
    // Every evicted connection is closed: what the server holds is bounded.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (all, pending) = server.connections();
        assert!(pending <= MAX_PENDING, "{pending} handshakes held");
        if all <= MAX_PENDING {
            break;
        }
        assert!(Instant::now() < deadline, "{all} connections still held");
        thread::sleep(Duration::from_millis(20));
    }
    let started = Instant::now();
    let a = join(addr, 0, 2);
    let b = join(addr, 1, 2);
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );
    a.set("k", b"v").unwrap();
    assert_eq!(b.get("k").unwrap(), b"v");
    let took = trickler.join().unwrap();
    assert!(
        took < Duration::from_secs(5),
        "a trickling peer kept its handshake open for {took:?}"
    );
    drop(idle);
}

/// A scope's abort record ends the waits on its keys, and only those: the job, and other
/// scopes, go on; the first record of a scope stays.
#[test]
fn a_scoped_abort_ends_the_waits_of_its_scope_only() {
    let server = serve(2);
    let a = join(server.addr(), 0, 2).with_scope(Some("ft/3".into()));
    let b = join(server.addr(), 1, 2);
    let record = |why: &str| crate::types::AbortRecord {
        reporter: Rank(0),
        culprit: Some(Rank(1)),
        collective: None,
        reason: why.into(),
    };
    let waiter = thread::spawn(move || {
        let started = Instant::now();
        let got = a.get_timeout("late", Duration::from_secs(20));
        (got, started.elapsed(), a)
    });
    thread::sleep(Duration::from_millis(100));
    b.end_scope("ft/3", record("first")).unwrap();
    b.end_scope("ft/3", record("second")).unwrap();
    let (got, waited, a) = waiter.join().unwrap();
    assert!(
        matches!(&got, Err(DdpError::Collective(CollectiveError::JobAborted { record, .. })) if record.reason == "first"),
        "{got:?}"
    );
    assert!(waited < Duration::from_secs(5), "{waited:?}");
    // The scoped client's keys are under the scope; the job's keys and record are untouched.
    assert!(matches!(a.abort_record(), Ok(Some(r)) if r.reason == "first"));
    assert_eq!(b.abort_record().unwrap(), None);
    b.set("ft/3/x", b"1").unwrap();
    b.set("ft/4/y", b"2").unwrap();
    let c = join_as(server.addr(), Purpose::StoreAux, 1, 2, "secret")
        .unwrap()
        .with_scope(Some("ft/4".into()));
    assert_eq!(c.get_timeout("y", Duration::from_secs(1)).unwrap(), b"2");
    assert_eq!(c.scope_record("ft/4").unwrap(), None);
}

/// The store of a fault-tolerant job: a member that disconnects is recorded as gone (with
/// why), nothing is aborted, and its id cannot be claimed again.
#[test]
fn the_lighthouse_marks_lost_members_gone_and_aborts_nothing() {
    let token = JobToken::new("ft");
    let server =
        StoreServer::bind_lighthouse("127.0.0.1:0".parse().unwrap(), token.clone(), world(1))
            .unwrap();
    let master = MasterAddr::new("127.0.0.1", server.addr().port());
    let connect = |purpose, id: u32| {
        StoreClient::connect(
            &master,
            purpose,
            Rank(id),
            world(3),
            &token,
            Duration::from_secs(5),
            Instant::now() + Duration::from_secs(5),
        )
    };
    let watcher = connect(Purpose::StoreAux, 0).unwrap();
    let member = connect(Purpose::Store, 7).unwrap();
    drop(member); // closes without a goodbye: its process died
    let why = watcher
        .get_timeout(&super::gone_key(Rank(7)), Duration::from_secs(5))
        .unwrap();
    assert!(!why.is_empty());
    assert_eq!(watcher.abort_record().unwrap(), None);
    let again = connect(Purpose::Store, 7);
    assert!(
        matches!(
            again,
            Err(DdpError::Rendezvous(RendezvousError::DuplicateRank { .. }))
        ),
        "{again:?}"
    );
    // A member that says goodbye is gone too: it takes part in no later membership.
    let leaving = connect(Purpose::Store, 8).unwrap();
    leaving.bye(Duration::from_secs(2));
    assert_eq!(
        watcher
            .get_timeout(&super::gone_key(Rank(8)), Duration::from_secs(5))
            .unwrap(),
        b"it left the job"
    );
}

/// Many keys in one request: the values in order, one request a chunk of `GET_MANY_KEYS`, not
/// one a key (the store counts them); the wait until a late key appears; the keys still
/// missing named at the timeout.
#[test]
fn get_many_reads_every_key_in_one_request_a_chunk() {
    let server = serve(2);
    let a = join(server.addr(), 0, 2);
    let b = join(server.addr(), 1, 2).with_request_timeout(Duration::from_secs(10));
    let n = super::client::GET_MANY_KEYS + 3;
    let keys: Vec<String> = (0..n).map(|i| format!("host/{i}")).collect();
    for (i, k) in keys.iter().enumerate() {
        a.set(k, format!("h{}", i % 7).as_bytes()).unwrap();
    }
    let before = server.traffic().member_requests;
    let values = b.get_many(&keys).unwrap();
    assert_eq!(
        server.traffic().member_requests - before,
        2,
        "two chunks, one request each"
    );
    assert_eq!(values.len(), n);
    assert!((0..n).all(|i| values[i] == format!("h{}", i % 7).as_bytes()));
    let late = ["host/5".to_string(), "late".to_string()];
    let reader = thread::spawn(move || (b.get_many(&late), b));
    thread::sleep(Duration::from_millis(200));
    a.set("late", b"here").unwrap();
    let (values, b) = reader.join().unwrap();
    assert_eq!(values.unwrap(), [b"h5".to_vec(), b"here".to_vec()]);
    let b = b.with_request_timeout(Duration::from_millis(100));
    let err = b
        .get_many(&["host/1".into(), "absent/x".into(), "absent/y".into()])
        .unwrap_err()
        .to_string();
    assert!(err.contains("absent/x, absent/y"), "{err}");
    assert!(!err.contains("host/1"), "{err}");
}

/// A store that answers the requests of one client by hand, each after the delay `delays`
/// gives it (in order; at once past its end), `None` never: a slow store, without making a
/// real one slow. Its reply to the `i`-th request is the integer `i`, so a reply taken for
/// another request's shows.
fn slow_store(delays: Vec<Option<Duration>>) -> SocketAddr {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        let token = JobToken::new("secret");
        let deadline = Instant::now() + Duration::from_secs(5);
        crate::store::auth::server_handshake(&s, &[Purpose::StoreAux], &token, deadline).unwrap();
        crate::store::auth::welcome(&s).unwrap();
        for i in 0u32.. {
            if wire::read_frame(&mut s, protocol::MAX_FRAME).is_err() {
                return;
            }
            match delays
                .get(i as usize)
                .copied()
                .unwrap_or(Some(Duration::ZERO))
            {
                Some(d) => thread::sleep(d),
                None => thread::sleep(Duration::from_secs(3600)),
            }
            let (k, p) = protocol::Reply::Int(i64::from(i)).encode();
            if wire::write_frame(&mut s, k, &p).is_err() {
                return;
            }
        }
    });
    addr
}

fn keeping_late_replies(addr: SocketAddr, limit: Duration) -> StoreClient {
    join_as(addr, Purpose::StoreAux, 0, 2, "secret")
        .unwrap()
        .with_request_timeout(Duration::from_millis(100))
        .with_reply_slack(Duration::ZERO)
        .keeping_late_replies(limit)
}

fn timed_out<T>(r: crate::Result<T>) -> bool {
    matches!(r, Err(DdpError::Rendezvous(RendezvousError::StoreLost { ref source, .. }))
        if source.kind() == std::io::ErrorKind::TimedOut)
}

#[test]
fn a_late_reply_is_taken_later_on_the_same_connection() {
    let addr = slow_store(vec![Some(Duration::from_millis(400))]);
    let c = keeping_late_replies(addr, Duration::from_secs(30));
    // No reply within the request's bound: a failure that is not the store's "absent".
    assert!(timed_out(c.add("k", 1)));
    assert!(!c.is_broken());
    // While the reply is still on its way, a request fails at once without being sent.
    let started = Instant::now();
    assert!(timed_out(c.add("k", 1)));
    assert!(started.elapsed() < Duration::from_millis(100));
    assert!(c.last_answer().is_none());
    thread::sleep(Duration::from_millis(500));
    // The late reply (to request 0) is taken and dropped; each request gets its own.
    assert_eq!(c.add("k", 1).unwrap(), 1);
    assert_eq!(c.add("k", 1).unwrap(), 2);
    assert!(!c.is_broken());
    assert!(c.last_answer().is_some());
}

#[test]
fn a_reply_that_never_comes_breaks_the_connection_after_the_limit() {
    let addr = slow_store(vec![None]);
    let c = keeping_late_replies(addr, Duration::from_millis(300));
    assert!(timed_out(c.set("k", b"1")));
    assert!(!c.is_broken());
    thread::sleep(Duration::from_millis(400));
    assert!(timed_out(c.set("k", b"2")));
    assert!(
        c.is_broken(),
        "a reply awaited past the limit breaks the connection"
    );
}

#[test]
fn without_keeping_late_replies_a_late_reply_breaks_the_connection() {
    let addr = slow_store(vec![Some(Duration::from_millis(400))]);
    let c = join_as(addr, Purpose::StoreAux, 0, 2, "secret")
        .unwrap()
        .with_request_timeout(Duration::from_millis(100))
        .with_reply_slack(Duration::ZERO);
    assert!(matches!(
        c.set("k", b"1"),
        Err(DdpError::Rendezvous(RendezvousError::StoreTimeout { .. }))
    ));
    assert!(c.is_broken());
}

#[test]
fn a_chosen_local_address_is_where_the_connection_comes_from() {
    let server = serve(2);
    let addr = server.addr();
    let local: std::net::IpAddr = "127.0.0.7".parse().unwrap();
    let master = MasterAddr::new(addr.ip().to_string(), addr.port()).with_local(local);
    let connect = |master: &MasterAddr| {
        StoreClient::connect(
            master,
            Purpose::StoreAux,
            Rank(1),
            world(2),
            &JobToken::new("secret"),
            Duration::from_secs(5),
            Instant::now() + Duration::from_secs(5),
        )
    };
    let c = connect(&master).unwrap();
    assert_eq!(c.local_ip().unwrap(), local);
    // Connecting again (the heartbeat's reconnection) keeps it.
    assert_eq!(c.master().local, Some(local));
    c.set("k", b"v").unwrap();
    // An address this host does not have is refused at once, naming the setting.
    let started = Instant::now();
    let foreign = master.with_local("192.0.2.1".parse().unwrap());
    let err = connect(&foreign).unwrap_err().to_string();
    assert!(
        err.contains("BURN_DDP_LOCAL_ADDR") && err.contains("192.0.2.1"),
        "{err}"
    );
    assert!(started.elapsed() < Duration::from_secs(2));
}
