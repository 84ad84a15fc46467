//! Recursive doubling: an all-reduce in ⌈log₂ n⌉ exchanges instead of the ring's 2(n−1) hops,
//! for small messages, whose cost is latency, not bandwidth.
//!
//! With p the largest power of two ≤ n and `rem = n − p`, the first `2·rem` ranks pair up: each
//! even one hands its buffer to the odd one after it (the fold) and waits. The p ranks left
//! (virtual ranks `v`: the odd ranks below `2·rem` as `r / 2`, the others as `r − rem`) exchange
//! their whole buffer with `v ^ 2^k` for k = 0, 1, …, log₂ p − 1, each combining what it
//! received into what it has. After the last exchange every one of them holds the result; the
//! odd ranks hand it back to their even partner (the unfold).
//!
//! Both partners of an exchange compute `a ⊕ b` from the same two operands, one as `a ⊕ b`, the
//! other as `b ⊕ a`; every reduction of `comm/reduce.rs` is symmetric bit for bit (float
//! addition is commutative; max and min order NaN and ±0), so every rank ends with the same bytes.
//! The order of summation is fixed by the world size alone (not by timing): the same inputs give
//! the same result run to run. It differs from the ring's order, so the two algorithms may differ
//! in the last bits of a float sum; a group never mixes them for one collective.
//!
//! Small broadcasts and all-gathers use the same links and pairs ([`broadcast`], [`all_gather`]):
//! they only copy, so every rank ends with the same bytes as on the ring.

use std::ops::Range;

/// One step of a rank's schedule, with the partner's place in the group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Step {
    /// Send the buffer to the partner (the fold, on an even rank below `2·rem`).
    Give(usize),
    /// Combine the partner's buffer into ours (the fold, on the odd rank after it).
    Take(usize),
    /// Send ours and combine theirs at once.
    Exchange(usize),
    /// Send the result back (the unfold, on the odd rank).
    Return(usize),
    /// Receive the result (the unfold, on the even rank).
    Receive(usize),
}

impl Step {
    /// The partner's place.
    pub(crate) fn peer(self) -> usize {
        match self {
            Step::Give(p)
            | Step::Take(p)
            | Step::Exchange(p)
            | Step::Return(p)
            | Step::Receive(p) => p,
        }
    }
}

/// The largest power of two ≤ `world` (world ≥ 1).
fn pow2_below(world: usize) -> usize {
    1 << (usize::BITS - 1 - world.leading_zeros())
}

/// The rank of virtual rank `v`.
fn real(v: usize, rem: usize) -> usize {
    if v < rem {
        2 * v + 1
    } else {
        v + rem
    }
}

/// The steps of rank `rank` of `world` (≥ 2), in order.
pub(crate) fn schedule(rank: usize, world: usize) -> Vec<Step> {
    let p = pow2_below(world);
    let rem = world - p;
    if rank < 2 * rem && rank.is_multiple_of(2) {
        return vec![Step::Give(rank + 1), Step::Receive(rank + 1)];
    }
    let folded = rank < 2 * rem;
    let v = if folded { rank / 2 } else { rank - rem };
    let mut steps = Vec::with_capacity(p.trailing_zeros() as usize + 2);
    if folded {
        steps.push(Step::Take(rank - 1));
    }
    let mut bit = 1;
    while bit < p {
        steps.push(Step::Exchange(real(v ^ bit, rem)));
        bit <<= 1;
    }
    if folded {
        steps.push(Step::Return(rank - 1));
    }
    steps
}

/// The ranks `rank` exchanges with, each once, in ascending order.
pub(crate) fn partners(rank: usize, world: usize) -> Vec<usize> {
    let mut peers: Vec<usize> = schedule(rank, world).iter().map(|s| s.peer()).collect();
    peers.sort_unstable();
    peers.dedup();
    peers
}

/// One step of a broadcast or an all-gather over the same links: bytes of the buffer to send to
/// the partner, and bytes to receive from it (copied in place), never overlapping.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Move {
    pub(crate) peer: usize,
    pub(crate) send: Option<Range<usize>>,
    pub(crate) recv: Option<Range<usize>>,
}

/// The virtual rank of `rank`, `None` for an even rank below `2·rem` (which folds).
fn virtual_of(rank: usize, rem: usize) -> Option<usize> {
    match rank < 2 * rem {
        true if rank.is_multiple_of(2) => None,
        true => Some(rank / 2),
        false => Some(rank - rem),
    }
}

/// The ranks virtual ranks `vs` stand for, as a range of ranks (consecutive virtual ranks stand
/// for consecutive ranks).
fn ranks_of(vs: Range<usize>, rem: usize) -> Range<usize> {
    let first = |v: usize| if v < rem { 2 * v } else { v + rem };
    first(vs.start)..first(vs.end)
}

/// A broadcast of `bytes` from `root`: the root's half of each exchange sends, the other
/// receives, so that the ranks holding the data double at every step (⌈log₂ n⌉ steps).
pub(crate) fn broadcast(rank: usize, world: usize, root: usize, bytes: usize) -> Vec<Move> {
    let p = pow2_below(world);
    let rem = world - p;
    let all = Some(0..bytes);
    let give = |peer| Move {
        peer,
        send: all.clone(),
        recv: None,
    };
    let take = |peer| Move {
        peer,
        send: None,
        recv: all.clone(),
    };
    let Some(v) = virtual_of(rank, rem) else {
        return vec![if rank == root {
            give(rank + 1)
        } else {
            take(rank + 1)
        }];
    };
    let folded = rank < 2 * rem;
    let vroot = virtual_of(root, rem).unwrap_or(root / 2);
    let mut moves = Vec::new();
    if folded && root == rank - 1 {
        moves.push(take(rank - 1));
    }
    let mut bit = 1;
    while bit < p {
        let holds = |x: usize| x / bit == vroot / bit;
        let peer = v ^ bit;
        if holds(v) {
            moves.push(give(real(peer, rem)));
        } else if holds(peer) {
            moves.push(take(real(peer, rem)));
        }
        bit <<= 1;
    }
    if folded && root != rank - 1 {
        moves.push(give(rank - 1));
    }
    moves
}

/// An all-gather of blocks of `block` bytes, rank r's at `r·block`: partners swap every block
/// they hold (the blocks of their half of the group), so that holdings double at every step.
pub(crate) fn all_gather(rank: usize, world: usize, block: usize) -> Vec<Move> {
    let p = pow2_below(world);
    let rem = world - p;
    let bytes = |ranks: Range<usize>| ranks.start * block..ranks.end * block;
    let Some(v) = virtual_of(rank, rem) else {
        return vec![
            Move {
                peer: rank + 1,
                send: Some(bytes(rank..rank + 1)),
                recv: None,
            },
            Move {
                peer: rank + 1,
                send: None,
                recv: Some(0..world * block),
            },
        ];
    };
    let folded = rank < 2 * rem;
    let mut moves = Vec::new();
    if folded {
        moves.push(Move {
            peer: rank - 1,
            send: None,
            recv: Some(bytes(rank - 1..rank)),
        });
    }
    let mut bit = 1;
    while bit < p {
        let group = |x: usize| x / bit * bit..x / bit * bit + bit;
        let peer = v ^ bit;
        moves.push(Move {
            peer: real(peer, rem),
            send: Some(bytes(ranks_of(group(v), rem))),
            recv: Some(bytes(ranks_of(group(peer), rem))),
        });
        bit <<= 1;
    }
    if folded {
        moves.push(Move {
            peer: rank - 1,
            send: Some(0..world * block),
            recv: None,
        });
    }
    moves
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::VecDeque;

    /// One rank's step as the simulator sees it: the partner, what to send it, and whether a
    /// message from it is awaited.
    type SimStep<M> = (usize, Option<M>, bool);

    /// Drives every rank's steps over in-memory queues, one link per ordered pair: `step(state,
    /// r, i)` gives rank r's i-th step (called once per step, before its message is awaited),
    /// `take(state, r, i, m)` applies the message it awaited. Panics on a deadlock or on bytes
    /// left on a link.
    fn drive<S, M>(
        state: &mut S,
        lens: &[usize],
        step: impl Fn(&S, usize, usize) -> SimStep<M>,
        take: impl Fn(&mut S, usize, usize, M),
    ) {
        let world = lens.len();
        let mut at = vec![0usize; world];
        let mut current: Vec<Option<(usize, bool)>> = vec![None; world];
        let mut wire: std::collections::HashMap<(usize, usize), VecDeque<M>> = Default::default();
        let mut rounds = 0;
        while (0..world).any(|r| at[r] < lens[r]) {
            rounds += 1;
            assert!(rounds < 10_000, "world {world}: the steps deadlock");
            for r in 0..world {
                if at[r] == lens[r] {
                    continue;
                }
                let (peer, awaits) = match current[r] {
                    Some(c) => c,
                    None => {
                        let (peer, send, awaits) = step(state, r, at[r]);
                        if let Some(m) = send {
                            wire.entry((r, peer)).or_default().push_back(m);
                        }
                        current[r] = Some((peer, awaits));
                        (peer, awaits)
                    }
                };
                let done = !awaits
                    || match wire.entry((peer, r)).or_default().pop_front() {
                        Some(m) => {
                            take(state, r, at[r], m);
                            true
                        }
                        None => false,
                    };
                if done {
                    at[r] += 1;
                    current[r] = None;
                }
            }
        }
        assert!(
            wire.values().all(|q| q.is_empty()),
            "world {world}: bytes left on a link"
        );
    }

    /// Runs every rank's all-reduce schedule with `op`, each rank's value its input; returns
    /// every rank's result.
    fn simulate(world: usize, inputs: &[u64], op: impl Fn(u64, u64) -> u64) -> Vec<u64> {
        let scheds: Vec<Vec<Step>> = (0..world).map(|r| schedule(r, world)).collect();
        let lens: Vec<usize> = scheds.iter().map(Vec::len).collect();
        let mut acc = inputs.to_vec();
        drive(
            &mut acc,
            &lens,
            |acc, r, i| {
                let s = scheds[r][i];
                let sends = matches!(s, Step::Give(_) | Step::Exchange(_) | Step::Return(_));
                let awaits = !matches!(s, Step::Give(_) | Step::Return(_));
                (s.peer(), sends.then_some(acc[r]), awaits)
            },
            |acc, r, i, x| {
                acc[r] = match scheds[r][i] {
                    Step::Receive(_) => x,
                    _ => op(acc[r], x),
                }
            },
        );
        acc
    }

    #[test]
    fn every_world_to_37_reduces_every_input_once_on_every_rank() {
        for world in 2..=37 {
            // Powers of two as inputs: the sum shows which ranks were counted, and how often.
            let inputs: Vec<u64> = (0..world).map(|r| 1u64 << r).collect();
            let all = (1u64 << world) - 1;
            let got = simulate(world, &inputs, |a, b| {
                assert_eq!(a & b, 0, "world {world}: an input counted twice");
                a | b
            });
            assert!(got.iter().all(|&g| g == all), "world {world}: {got:?}");
        }
    }

    #[test]
    fn steps_grow_as_log_n_and_partners_are_symmetric() {
        for world in 2..=300usize {
            let log = usize::BITS - 1 - world.leading_zeros();
            for rank in 0..world {
                let s = schedule(rank, world);
                assert!(
                    s.len() <= log as usize + 2,
                    "world {world} rank {rank}: {s:?}"
                );
                for q in partners(rank, world) {
                    assert_ne!(q, rank);
                    assert!(
                        partners(q, world).contains(&rank),
                        "world {world}: {rank} talks to {q} but not back"
                    );
                }
            }
        }
    }

    /// Runs every rank's moves; returns every rank's buffer.
    fn simulate_moves(mut bufs: Vec<Vec<u8>>, moves: &[Vec<Move>]) -> Vec<Vec<u8>> {
        let lens: Vec<usize> = moves.iter().map(Vec::len).collect();
        drive(
            &mut bufs,
            &lens,
            |bufs, r, i| {
                let m = &moves[r][i];
                let send = m.send.as_ref().map(|range| bufs[r][range.clone()].to_vec());
                (m.peer, send, m.recv.is_some())
            },
            |bufs, r, i, bytes| {
                let range = moves[r][i].recv.clone().unwrap_or(0..0);
                assert_eq!(bytes.len(), range.len(), "rank {r} step {i}");
                bufs[r][range].copy_from_slice(&bytes);
            },
        );
        bufs
    }

    #[test]
    fn broadcasts_reach_every_rank_from_every_root() {
        for world in 2..=37 {
            for root in 0..world {
                let bufs = (0..world).map(|r| vec![r as u8; 3]).collect();
                let moves: Vec<Vec<Move>> =
                    (0..world).map(|r| broadcast(r, world, root, 3)).collect();
                for (r, m) in moves.iter().enumerate() {
                    let partners = partners(r, world);
                    assert!(
                        m.iter().all(|m| partners.contains(&m.peer)),
                        "{world} {root} {r}"
                    );
                }
                let got = simulate_moves(bufs, &moves);
                assert!(
                    got.iter().all(|b| b == &vec![root as u8; 3]),
                    "world {world} root {root}: {got:?}"
                );
            }
        }
    }

    #[test]
    fn all_gathers_give_every_rank_every_block() {
        for world in 2..=37 {
            let block = 2;
            let bufs = (0..world)
                .map(|r| {
                    let mut b = vec![0xffu8; world * block];
                    b[r * block..(r + 1) * block].fill(r as u8);
                    b
                })
                .collect();
            let moves: Vec<Vec<Move>> = (0..world).map(|r| all_gather(r, world, block)).collect();
            let want: Vec<u8> = (0..world).flat_map(|r| [r as u8; 2]).collect();
            let got = simulate_moves(bufs, &moves);
            assert!(got.iter().all(|b| b == &want), "world {world}: {got:?}");
        }
    }

    #[test]
    fn small_worlds() {
        assert_eq!(schedule(0, 2), vec![Step::Exchange(1)]);
        assert_eq!(schedule(0, 3), vec![Step::Give(1), Step::Receive(1)]);
        assert_eq!(
            schedule(1, 3),
            vec![Step::Take(0), Step::Exchange(2), Step::Return(0)]
        );
        assert_eq!(schedule(2, 3), vec![Step::Exchange(1)]);
        assert_eq!(
            schedule(5, 8),
            vec![Step::Exchange(4), Step::Exchange(7), Step::Exchange(1)]
        );
    }
}
