//! `burn-ddp bench p2p`: point-to-point throughput (what a pipeline's activations see), next to
//! the all-reduce bus bandwidth of the same group over the same transport, measured in
//! interleaved rounds of one run so that both see the same machine.
//!
//! For each message size: rank 0 sends a burst of messages to rank 1 (one way), ranks 0 and 1
//! exchange a burst in both directions at once (`batch_send_recv`, as a 1F1B stage passes an
//! activation on while it takes a gradient back), and the whole group all-reduces a buffer of
//! the same size. Each is the median of several rounds.

use crate::error::ConfigError;
use std::time::{Duration, Instant};

use super::bench::{median, BenchError, BenchResult};
use crate::comm::memory::huge_filled;
use crate::comm::ReduceOp;
use crate::config::Transport;
use crate::group::P2pOp;
use crate::types::Rank;
use crate::{DdpError, ProcessGroup, Result};

/// Options of the point-to-point sweep.
#[derive(Debug, Clone)]
pub struct P2pBench {
    /// Smallest message, bytes.
    pub min_bytes: usize,
    /// Largest message, bytes.
    pub max_bytes: usize,
    /// Rounds per size (the median is reported).
    pub rounds: usize,
    /// Target measuring time of one burst; the burst length adapts to it.
    pub target: Duration,
    /// Transports to compare in interleaved rounds (empty: the group's own choice).
    pub transports: Vec<Transport>,
}

impl Default for P2pBench {
    fn default() -> Self {
        Self {
            min_bytes: 64 << 10,
            max_bytes: 64 << 20,
            rounds: 5,
            target: Duration::from_millis(100),
            transports: Vec::new(),
        }
    }
}

impl P2pBench {
    /// Checks the options.
    ///
    /// # Errors
    /// [`ConfigError::InvalidOption`] naming the option out of range.
    pub fn check(&self) -> Result<()> {
        let bad = |option, reason: &str| {
            Err(DdpError::Config(ConfigError::InvalidOption {
                option,
                reason: reason.into(),
            }))
        };
        if self.min_bytes < 4 || self.min_bytes > self.max_bytes {
            return bad("--min-bytes", "must be at least 4 and at most --max-bytes");
        }
        if self.max_bytes > 1 << 30 {
            return bad("--max-bytes", "at most 1G");
        }
        if self.rounds == 0 || self.rounds > 100 {
            return bad("--rounds", "between 1 and 100");
        }
        if self.target.is_zero() || self.target > Duration::from_secs(10) {
            return bad("--target-ms", "between 1 and 10000");
        }
        Ok(())
    }
}

/// One size's medians over one transport, GB/s.
#[derive(Debug, Clone, Copy)]
struct Row {
    bytes: usize,
    transport: Option<Transport>,
    one_way: f64,
    both_ways: f64,
    busbw: f64,
}

/// Seconds of `f` on the slowest rank (every rank calls it).
fn timed(pg: &ProcessGroup, f: impl FnOnce() -> BenchResult<()>) -> BenchResult<f64> {
    pg.barrier()?;
    let t = Instant::now();
    f()?;
    let mut secs = [t.elapsed().as_secs_f64()];
    pg.all_reduce(&mut secs, ReduceOp::Max)?;
    Ok(secs[0])
}

/// One size's rows, a row per transport of `ways` (`None`: the group's own), in interleaved
/// rounds.
fn measure(
    pg: &ProcessGroup,
    opts: &P2pBench,
    bytes: usize,
    ways: &[Option<Transport>],
) -> BenchResult<Vec<Row>> {
    let me = pg.rank();
    let count = bytes / 4;
    let send: Vec<f32> = huge_filled(count, me.0 as f32 + 1.0);
    let mut recv: Vec<f32> = huge_filled(count, 0.0);
    let mut ring: Vec<f32> = huge_filled(count, 1.0);
    let peer = Rank(1 - me.0.min(1));
    let pair = me.0 < 2;
    let take = |way: Option<Transport>| match way {
        Some(t) => pg.set_transport(t),
        None => Ok(()),
    };
    // One message over each to estimate the burst length (every rank must agree on it).
    let mut est = 0f64;
    for &way in ways {
        take(way)?;
        est = est.max(timed(pg, || {
            match me.0 {
                0 => pg.send(&send, Rank(1), 0)?,
                1 => pg.recv(&mut recv, Rank(0), 0)?,
                _ => {}
            }
            Ok(())
        })?);
    }
    let burst = (opts.target.as_secs_f64() / est.max(1e-7)).clamp(2.0, 200.0) as usize;
    let mut medians = vec![(Vec::new(), Vec::new(), Vec::new()); ways.len()];
    let world = pg.world_size().get() as f64;
    for round in 0..opts.rounds * ways.len() {
        let k = round % ways.len();
        take(ways[k])?;
        let (one, both, bus) = &mut medians[k];
        let t = timed(pg, || {
            for _ in 0..burst {
                match me.0 {
                    0 => pg.send(&send, Rank(1), 1)?,
                    1 => pg.recv(&mut recv, Rank(0), 1)?,
                    _ => {}
                }
            }
            Ok(())
        })?;
        one.push((burst * bytes) as f64 / t / 1e9);
        let t = timed(pg, || {
            if pair {
                for _ in 0..burst {
                    pg.batch_send_recv(&mut [
                        P2pOp::send(&send, peer, 2),
                        P2pOp::recv(&mut recv, peer, 2),
                    ])?;
                }
            }
            Ok(())
        })?;
        both.push((burst * bytes) as f64 / t / 1e9);
        let t = timed(pg, || {
            for _ in 0..burst {
                pg.all_reduce(&mut ring, ReduceOp::Sum)?;
            }
            Ok(())
        })?;
        bus.push((burst * bytes) as f64 / t / 1e9 * 2.0 * (world - 1.0) / world);
    }
    // What arrived is what was sent.
    if me.0 == 1 && recv.iter().any(|&v| v != 1.0) {
        return Err(BenchError::WrongResults {
            wrong: recv.iter().filter(|&&v| v != 1.0).count() as u64,
        });
    }
    Ok(ways
        .iter()
        .zip(medians)
        .map(|(&transport, (one, both, bus))| Row {
            bytes,
            transport,
            one_way: median(&one),
            both_ways: median(&both),
            busbw: median(&bus),
        })
        .collect())
}

/// Runs the benchmark as one rank of the job in the environment and prints the table on rank 0.
///
/// # Errors
/// Options out of range, fewer than 2 ranks, any transfer or collective error, corrupted data.
pub fn run_worker(opts: &P2pBench) -> BenchResult<()> {
    opts.check()?;
    let pg = ProcessGroup::from_env()?;
    if pg.world_size().get() < 2 {
        return Err(DdpError::Config(ConfigError::InvalidOption {
            option: "--nproc",
            reason: "point-to-point needs at least 2 ranks".into(),
        })
        .into());
    }
    let ways: Vec<Option<Transport>> = match opts.transports.as_slice() {
        [] => vec![None],
        ts => ts.iter().copied().map(Some).collect(),
    };
    if pg.is_main() {
        println!(
            "# burn-ddp bench p2p: {} ranks, {} transport; rank 0 -> rank 1 one way, ranks 0 <-> 1 \
             both ways at once (per direction), all-reduce of the whole group; medians of {} rounds",
            pg.world_size(),
            pg.transport(),
            opts.rounds
        );
        println!(
            "# {:>10} {:>12} {:>12} {:>12} {:>12}",
            "size", "one way", "both ways", "all-reduce", "one way /"
        );
        println!(
            "# {:>10} {:>12} {:>12} {:>12} {:>12}",
            "(B)", "(GB/s)", "(GB/s)", "busbw GB/s", "busbw"
        );
    }
    let mut bytes = opts.min_bytes / 4 * 4;
    while bytes <= opts.max_bytes {
        for r in measure(&pg, opts, bytes, &ways)? {
            if pg.is_main() {
                println!(
                    "  {:>10} {:>12.3} {:>12.3} {:>12.3} {:>12.2}{}",
                    r.bytes,
                    r.one_way,
                    r.both_ways,
                    r.busbw,
                    r.one_way / r.busbw,
                    r.transport.map(|t| format!(" {t:>5}")).unwrap_or_default()
                );
            }
        }
        bytes = bytes.saturating_mul(4);
    }
    Ok(())
}
