//! `burn-ddp bench all-reduce`: bus bandwidth of the host transport, in the format of nccl-tests,
//! next to the single-stream TCP throughput measured between the same processes in the same run.
//!
//! Run standalone, it starts `--nproc` local ranks; run under a launcher (`RANK` set), it is one
//! rank of that job, so the same command measures a multi-node job.

use crate::error::{ConfigError, RendezvousError};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use half::{bf16, f16};

use crate::comm::memory::huge_filled;
use crate::comm::{Element, ReduceOp};
use crate::config::{Algorithm, Transport};
use crate::store::auth::{self, Purpose};
use crate::types::Rank;
use crate::{DdpError, ProcessGroup, Result};

/// What the bandwidth tools (`burn-ddp bench all-reduce`, `burn-ddp bench p2p`) report beside
/// the library's own errors.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// An error of the library (a collective, the store, an option).
    #[error(transparent)]
    Ddp(#[from] DdpError),

    /// The bandwidth tool's own TCP link (rank 0 to rank 1, for the single-stream reference)
    /// failed or passed its deadline.
    #[error("[rank {rank}] the bandwidth tool's reference link between ranks 0 and 1: {what} failed: {source}. Check that the two hosts reach each other on an ephemeral port (as the ring links do)")]
    Link {
        /// This rank.
        rank: Rank,
        /// The step (`connecting to rank 1`, `moving a message`).
        what: &'static str,
        /// The operating system's error (a timeout when the deadline passed).
        source: std::io::Error,
    },

    /// A benchmark found corrupted results.
    #[error("the benchmark found {wrong} wrong elements: the transport corrupted data (please report this)")]
    WrongResults {
        /// How many elements differed, over all ranks.
        wrong: u64,
    },
}

impl From<std::io::Error> for BenchError {
    fn from(e: std::io::Error) -> Self {
        BenchError::Ddp(e.into())
    }
}

/// The result of the bandwidth tools.
pub type BenchResult<T> = std::result::Result<T, BenchError>;

/// Options of the all-reduce sweep.
#[derive(Debug, Clone)]
pub struct AllReduceBench {
    /// Smallest message, bytes.
    pub min_bytes: usize,
    /// Largest message, bytes.
    pub max_bytes: usize,
    /// Size multiplier between steps.
    pub step_factor: usize,
    /// Element type.
    pub dtype: BenchDType,
    /// Reduce operation.
    pub op: ReduceOp,
    /// Target measuring time per size; iterations adapt to it.
    pub target: Duration,
    /// Skip the single-stream TCP measurement.
    pub skip_loopback: bool,
    /// Measure NCCL on each rank's GPU instead of the process group's transport (`cuda`
    /// feature).
    pub nccl: bool,
    /// Collective algorithms to compare within each size, in interleaved rounds (empty: the
    /// group's own choice).
    pub algorithms: Vec<Algorithm>,
    /// Transports to compare within each size, in interleaved rounds (empty: the group's own
    /// choice); each TCP one with every algorithm of `algorithms`.
    pub transports: Vec<Transport>,
    /// Compare, after the ways of `transports`, shared memory with the buffer in memory every
    /// rank maps (each rank's in its own region of an arena): the shared gradient buckets'
    /// all-reduce, which copies nothing into or out of the segment.
    pub shm_in_place: bool,
}

/// One way of running the all-reduce that the bench compares: a transport and an algorithm,
/// each `None` where the group's own choice stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Way {
    /// The transport.
    pub transport: Option<Transport>,
    /// The algorithm (TCP's; shared memory has one).
    pub algorithm: Option<Algorithm>,
    /// The buffer lies in memory every rank maps and is reduced there (shared memory only).
    pub in_place: bool,
}

impl std::fmt::Display for Way {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.in_place {
            return f.write_str("shm-in-place");
        }
        match (self.transport, self.algorithm) {
            (Some(t), Some(a)) => write!(f, "{t}/{a}"),
            (Some(t), None) => write!(f, "{t}"),
            (None, Some(a)) => write!(f, "{a}"),
            (None, None) => f.write_str("auto"),
        }
    }
}

impl Way {
    /// Makes `pg` run the following collectives this way (every rank at the same point).
    fn take(self, pg: &ProcessGroup) -> Result<()> {
        if let Some(t) = self.transport {
            pg.set_transport(t)?;
        }
        if let Some(a) = self.algorithm {
            pg.set_algorithm(a)?;
        }
        Ok(())
    }
}

impl Default for AllReduceBench {
    fn default() -> Self {
        Self {
            min_bytes: 1 << 10,
            max_bytes: 256 << 20,
            step_factor: 2,
            dtype: BenchDType::F32,
            op: ReduceOp::Sum,
            target: Duration::from_millis(400),
            skip_loopback: false,
            nccl: false,
            algorithms: Vec::new(),
            transports: Vec::new(),
            shm_in_place: false,
        }
    }
}

/// Element types the bandwidth tool can measure.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BenchDType {
    /// f32
    F32,
    /// f64
    F64,
    /// f16
    F16,
    /// bf16
    BF16,
    /// i32
    I32,
    /// i64
    I64,
}

impl BenchDType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            Self::F16 | Self::BF16 => 2,
            Self::F32 | Self::I32 => 4,
            Self::F64 | Self::I64 => 8,
        }
    }
}

/// One line of the result table.
#[derive(Debug, Clone, Copy)]
pub struct BenchRow {
    /// Message size in bytes.
    pub bytes: usize,
    /// Elements.
    pub count: usize,
    /// Seconds per all-reduce (slowest rank).
    pub seconds: f64,
    /// Bytes / time, GB/s.
    pub algbw: f64,
    /// algbw * 2(n-1)/n, GB/s.
    pub busbw: f64,
    /// Elements that differed from the expected result, over all ranks.
    pub wrong: u64,
}

trait BenchElem: Element + Copy {
    fn from_i32(v: i32) -> Self;
    fn to_f64(self) -> f64;
}

macro_rules! bench_elem {
    ($($t:ty => $from:expr, $to:expr;)*) => {$(
        impl BenchElem for $t {
            fn from_i32(v: i32) -> Self { ($from)(v) }
            fn to_f64(self) -> f64 { ($to)(self) }
        }
    )*};
}

bench_elem! {
    f32 => |v: i32| v as f32, |x: f32| x as f64;
    f64 => |v: i32| v as f64, |x: f64| x;
    f16 => |v: i32| f16::from_f32(v as f32), |x: f16| x.to_f64();
    bf16 => |v: i32| bf16::from_f32(v as f32), |x: bf16| x.to_f64();
    i32 => |v: i32| v, |x: i32| x as f64;
    i64 => |v: i32| v as i64, |x: i64| x as f64;
}

/// The value rank `r` contributes at index `i`, and the expected result of the reduction.
fn pattern(r: u32, i: usize) -> i32 {
    (r as i32 + 1) * ((i % 7) as i32 + 1)
}

fn expected(op: ReduceOp, world: u32, i: usize, integer: bool) -> f64 {
    let base = ((i % 7) + 1) as f64;
    let w = world as f64;
    match op {
        ReduceOp::Sum => base * w * (w + 1.0) / 2.0,
        ReduceOp::Mean => {
            let sum = base * w * (w + 1.0) / 2.0;
            if integer {
                (sum / w).trunc()
            } else {
                sum / w
            }
        }
        ReduceOp::Max => base * w,
        ReduceOp::Min => base,
    }
}

/// The largest message the tool measures over the host transport: each rank holds one buffer
/// of it (and the reference link two), so every accepted size runs in seconds, not minutes.
pub const MAX_HOST_BYTES: usize = 1 << 30;
/// The largest message over NCCL (one buffer of it on each GPU).
pub const MAX_NCCL_BYTES: usize = 8 << 30;
/// The longest measuring time per size.
pub const MAX_TARGET: Duration = Duration::from_secs(10);

impl AllReduceBench {
    /// Checks the options: sizes from at least one element up to the transport's limit, the
    /// smallest not above the largest, a step factor of at least 2 (so the sweep ends), a
    /// measuring time from 1 ms to [`MAX_TARGET`].
    ///
    /// # Errors
    /// [`ConfigError::InvalidOption`] naming the option, its value and what is accepted.
    pub fn check(&self) -> Result<()> {
        let bad = |option, reason: String| {
            Err(DdpError::Config(ConfigError::InvalidOption {
                option,
                reason,
            }))
        };
        let elem = self.dtype.size();
        let (limit, transport) = if self.nccl {
            (MAX_NCCL_BYTES, "NCCL")
        } else {
            (MAX_HOST_BYTES, "the host transport")
        };
        if self.nccl && !self.algorithms.is_empty() {
            return bad(
                "--algo",
                "compares the host transport's algorithms; NCCL chooses its own".into(),
            );
        }
        if self.nccl && (!self.transports.is_empty() || self.shm_in_place) {
            return bad(
                "--transport",
                "nccl is measured alone: it cannot be compared with tcp or shm in one run".into(),
            );
        }
        if self.max_bytes < elem {
            return bad(
                "--max-bytes",
                format!(
                    "{} bytes is less than one {:?} element ({elem} bytes)",
                    self.max_bytes, self.dtype
                ),
            );
        }
        if self.max_bytes > limit {
            return bad(
                "--max-bytes",
                format!(
                    "{} bytes is above the {} bytes this tool measures over {transport}",
                    self.max_bytes, limit
                ),
            );
        }
        if self.min_bytes > self.max_bytes {
            return bad(
                "--min-bytes",
                format!(
                    "{} bytes is above --max-bytes ({} bytes)",
                    self.min_bytes, self.max_bytes
                ),
            );
        }
        if self.step_factor < 2 {
            return bad(
                "--step-factor",
                format!(
                    "{} would never reach --max-bytes: use 2 or more",
                    self.step_factor
                ),
            );
        }
        if self.target.is_zero() || self.target > MAX_TARGET {
            return bad(
                "--target-ms",
                format!(
                    "{} ms is outside 1 ms to {} ms",
                    self.target.as_millis(),
                    MAX_TARGET.as_millis()
                ),
            );
        }
        Ok(())
    }
}

fn sizes(opts: &AllReduceBench, elem: usize) -> Vec<usize> {
    let mut out = Vec::new();
    let mut s = opts.min_bytes.max(elem);
    while s <= opts.max_bytes {
        out.push(s / elem * elem);
        s = s.saturating_mul(opts.step_factor.max(2));
    }
    out
}

fn sweep<T: BenchElem>(pg: &ProcessGroup, opts: &AllReduceBench) -> BenchResult<Vec<BenchRow>> {
    let elem = std::mem::size_of::<T>();
    let max_count = opts.max_bytes / elem;
    // Touch every page before timing anything.
    let mut buf: Vec<T> = huge_filled(max_count, T::from_i32(1));
    let mut rows = Vec::new();
    for bytes in sizes(opts, elem) {
        let count = bytes / elem;
        let slice = &mut buf[..count];
        // Warm up and estimate; every rank must run the same number of iterations.
        for _ in 0..2 {
            pg.all_reduce(slice, opts.op)?;
        }
        let t = Instant::now();
        pg.all_reduce(slice, opts.op)?;
        let mut est = [t.elapsed().as_secs_f64()];
        pg.all_reduce(&mut est, ReduceOp::Max)?;
        let iters = (opts.target.as_secs_f64() / est[0].max(1e-7)).clamp(3.0, 500.0) as usize;

        for (i, x) in slice.iter_mut().enumerate() {
            *x = T::from_i32(pattern(pg.rank().0, i));
        }
        pg.barrier()?;
        let t = Instant::now();
        for _ in 0..iters {
            pg.all_reduce(slice, opts.op)?;
        }
        let mut secs = [t.elapsed().as_secs_f64() / iters as f64];
        pg.all_reduce(&mut secs, ReduceOp::Max)?;

        // Correctness on fresh data.
        for (i, x) in slice.iter_mut().enumerate() {
            *x = T::from_i32(pattern(pg.rank().0, i));
        }
        pg.all_reduce(slice, opts.op)?;
        rows.push(row(pg, opts, (bytes, secs[0]), slice, None)?);
    }
    Ok(rows)
}

/// The ways `opts` compares, in order: every transport with every algorithm (shared memory
/// once, having one); empty when it compares none.
pub fn ways(opts: &AllReduceBench) -> Vec<Way> {
    let in_place = opts.shm_in_place.then_some(Way {
        transport: Some(Transport::Shm),
        algorithm: None,
        in_place: true,
    });
    if opts.algorithms.is_empty() && opts.transports.is_empty() {
        return in_place.into_iter().collect();
    }
    let transports: Vec<Option<Transport>> = match opts.transports.as_slice() {
        [] => vec![None],
        ts => ts.iter().copied().map(Some).collect(),
    };
    let algorithms: Vec<Option<Algorithm>> = match opts.algorithms.as_slice() {
        [] => vec![None],
        al => al.iter().copied().map(Some).collect(),
    };
    let mut out = Vec::new();
    for t in transports {
        if t == Some(Transport::Shm) {
            out.push(Way {
                transport: t,
                algorithm: None,
                in_place: false,
            });
            continue;
        }
        for &a in &algorithms {
            out.push(Way {
                transport: t,
                algorithm: a,
                in_place: false,
            });
        }
    }
    out.extend(in_place);
    out
}

/// The values `w` reduces: `buf`, or (for an in-place way) as many in this rank's region of
/// `arena`. No collective may run while the slice lives.
fn values_of<'a, T: BenchElem>(
    w: &Way,
    buf: &'a mut [T],
    arena: Option<&'a crate::comm::SharedArena>,
) -> &'a mut [T] {
    match arena.filter(|_| w.in_place) {
        // SAFETY: this rank's region, which no other rank touches outside a shared all-reduce
        // (none runs while the slice lives); page-aligned, so aligned for `T`.
        Some(a) => bytemuck::cast_slice_mut(unsafe {
            a.bytes_mut(a.place(), 0..std::mem::size_of_val(buf))
        }),
        None => buf,
    }
}

/// One all-reduce of the values of `w` (see [`values_of`]).
fn reduce_way<T: BenchElem>(
    pg: &ProcessGroup,
    w: &Way,
    buf: &mut [T],
    arena: Option<&crate::comm::SharedArena>,
    op: ReduceOp,
) -> Result<()> {
    match arena.filter(|_| w.in_place) {
        Some(a) => pg.all_reduce_shared::<T>(a, 0..std::mem::size_of_val(buf), op),
        None => pg.all_reduce(buf, op),
    }
}

/// Per size, the median time of each way compared (in the order given) and single-core
/// `memcpy`'s bandwidth of the same bytes (GB/s, measured on rank 0).
type WayTimes = Vec<(usize, Vec<f64>, f64)>;

/// Rounds of each way per size in [`sweep_ways`], interleaved.
const ALGORITHM_ROUNDS: usize = 5;

/// `memcpy` of `src` into `dst` on this core: bytes per second, the median of 5 timed runs of
/// enough copies to fill `target`.
fn memcpy_bandwidth(src: &[u8], dst: &mut [u8], target: Duration) -> f64 {
    let t = Instant::now();
    dst.copy_from_slice(src);
    let once = t.elapsed().as_secs_f64().max(1e-8);
    let iters = (target.as_secs_f64() / 5.0 / once).clamp(1.0, 10_000.0) as usize;
    let mut runs = Vec::with_capacity(5);
    for _ in 0..5 {
        let t = Instant::now();
        for _ in 0..iters {
            dst.copy_from_slice(std::hint::black_box(src));
        }
        std::hint::black_box(&mut *dst);
        runs.push(src.len() as f64 * iters as f64 / t.elapsed().as_secs_f64());
    }
    median(&runs)
}

/// The sweep over several ways: within each size, `ALGORITHM_ROUNDS` rounds of every way in
/// turn (the same iterations each), so that all see the same machine conditions; a row per way
/// with its median time, checked on fresh data. Returns the rows and, per size, the median
/// times in the order of `ways`, and `memcpy`'s bandwidth on rank 0 (the others wait).
fn sweep_ways<T: BenchElem>(
    pg: &ProcessGroup,
    opts: &AllReduceBench,
    ways: &[Way],
) -> BenchResult<(Vec<BenchRow>, WayTimes)> {
    let elem = std::mem::size_of::<T>();
    let mut buf: Vec<T> = huge_filled(opts.max_bytes / elem, T::from_i32(1));
    let mut copy: Vec<u8> = if pg.is_main() {
        huge_filled(opts.max_bytes, 0u8)
    } else {
        Vec::new()
    };
    // The in-place way's buffers: an arena of the largest size (every rank alike).
    let arena = match ways.iter().find(|w| w.in_place) {
        Some(w) => {
            w.take(pg)?;
            Some(pg.allocate_shared(opts.max_bytes)?.ok_or_else(|| {
                BenchError::from(DdpError::Config(ConfigError::InvalidOption {
                    option: "--transport",
                    reason: "shm-in-place needs every rank on one host, in shared memory".into(),
                }))
            })?)
        }
        None => None,
    };
    let arena = arena.as_deref();
    let (mut rows, mut times) = (Vec::new(), Vec::new());
    for bytes in sizes(opts, elem) {
        let slice = &mut buf[..bytes / elem];
        for &w in ways {
            w.take(pg)?;
            for _ in 0..2 {
                reduce_way(pg, &w, slice, arena, opts.op)?;
            }
        }
        // Iterations from the slowest way's estimate, the same for all.
        let mut est = [0f64];
        for &w in ways {
            w.take(pg)?;
            let t = Instant::now();
            reduce_way(pg, &w, slice, arena, opts.op)?;
            est[0] = est[0].max(t.elapsed().as_secs_f64());
        }
        pg.all_reduce(&mut est, ReduceOp::Max)?;
        let per_round = opts.target.as_secs_f64() / ALGORITHM_ROUNDS as f64;
        let iters = (per_round / est[0].max(1e-7)).clamp(3.0, 500.0) as usize;
        let mut secs: Vec<Vec<f64>> = vec![Vec::new(); ways.len()];
        for _ in 0..ALGORITHM_ROUNDS {
            for (k, &w) in ways.iter().enumerate() {
                w.take(pg)?;
                for (i, x) in values_of(&w, slice, arena).iter_mut().enumerate() {
                    *x = T::from_i32(pattern(pg.rank().0, i));
                }
                pg.barrier()?;
                let t = Instant::now();
                for _ in 0..iters {
                    reduce_way(pg, &w, slice, arena, opts.op)?;
                }
                let mut s = [t.elapsed().as_secs_f64() / iters as f64];
                pg.all_reduce(&mut s, ReduceOp::Max)?;
                secs[k].push(s[0]);
            }
        }
        let mut medians = Vec::with_capacity(secs.len());
        for (&w, s) in ways.iter().zip(secs) {
            w.take(pg)?;
            for (i, x) in values_of(&w, slice, arena).iter_mut().enumerate() {
                *x = T::from_i32(pattern(pg.rank().0, i));
            }
            reduce_way(pg, &w, slice, arena, opts.op)?;
            let m = median(&s);
            let values = values_of(&w, slice, arena);
            rows.push(row(pg, opts, (bytes, m), values, Some(w))?);
            medians.push(m);
        }
        let memcpy = if pg.is_main() {
            let src: &[u8] = bytemuck::cast_slice(&*slice);
            memcpy_bandwidth(src, &mut copy[..bytes], opts.target) / 1e9
        } else {
            0.0
        };
        pg.barrier()?;
        times.push((bytes, medians, memcpy));
    }
    Ok((rows, times))
}

/// Prints each size's time under every way as a ratio to the first's, and each way's bus
/// bandwidth as a share of `memcpy`'s.
fn print_ratios(ways: &[Way], world: u32, times: &WayTimes) {
    let Some((first, rest)) = ways.split_first() else {
        return;
    };
    println!("#");
    println!(
        "# time of {first} / time of each other way, per size ({ALGORITHM_ROUNDS} interleaved rounds, medians); \
         busbw as a share of single-core memcpy of the same bytes on rank 0:"
    );
    let bus = 2.0 * (f64::from(world) - 1.0) / f64::from(world);
    for (bytes, t, memcpy) in times {
        let ratios: Vec<String> = rest
            .iter()
            .zip(&t[1..])
            .map(|(w, x)| format!("{w} {:.2}x", t[0] / x))
            .collect();
        let shares: Vec<String> = ways
            .iter()
            .zip(t)
            .map(|(w, x)| {
                format!(
                    "{w} {:.0}%",
                    100.0 * (*bytes as f64 / x * bus / 1e9) / memcpy
                )
            })
            .collect();
        println!(
            "# {bytes:>10} B: {first} {:.1} us; {}; memcpy {memcpy:.2} GB/s: {}",
            t[0] * 1e6,
            ratios.join(", "),
            shares.join(", ")
        );
    }
}

/// Prints the table's footer (nccl-tests' wrong-value count and average bus bandwidth) and
/// returns the number of wrong values.
fn print_summary(rows: &[BenchRow]) -> u64 {
    let wrong: u64 = rows.iter().map(|r| r.wrong).sum();
    let avg = rows.iter().map(|r| r.busbw).sum::<f64>() / rows.len().max(1) as f64;
    println!(
        "# Out of bounds values : {wrong} {}",
        if wrong == 0 { "OK" } else { "FAILED" }
    );
    println!("# Avg bus bandwidth    : {avg:.3} GB/s");
    wrong
}

/// The table row of one size: counts wrong results on every rank (`result` holds this rank's
/// reduced values), prints it on rank 0.
fn row<T: BenchElem>(
    pg: &ProcessGroup,
    opts: &AllReduceBench,
    (bytes, seconds): (usize, f64),
    result: &[T],
    way: Option<Way>,
) -> BenchResult<BenchRow> {
    let world = pg.world_size().get();
    let integer = matches!(T::DTYPE, crate::DType::I32 | crate::DType::I64);
    let mut wrong = [result
        .iter()
        .enumerate()
        .filter(|(i, x)| x.to_f64() != expected(opts.op, world, *i, integer))
        .count() as i64];
    pg.all_reduce(&mut wrong, ReduceOp::Sum)?;
    let algbw = bytes as f64 / seconds / 1e9;
    let r = BenchRow {
        bytes,
        count: result.len(),
        seconds,
        algbw,
        busbw: algbw * 2.0 * (world as f64 - 1.0) / world as f64,
        wrong: wrong[0].max(0) as u64,
    };
    if pg.is_main() {
        print_row(Some(r), opts, way);
    }
    Ok(r)
}

/// The sweep over NCCL: buffers on each rank's GPU, `iters` all-reduces queued back to back and
/// waited for once (as nccl-tests does), results checked on the host afterwards.
#[cfg(feature = "cuda")]
fn run_nccl(pg: &ProcessGroup, opts: &AllReduceBench) -> BenchResult<()> {
    let comm = crate::cuda::NcclComm::new(pg)?;
    if pg.is_main() {
        println!(
            "# burn-ddp bench all-reduce: {} ranks, NCCL {} on GPU {} (rank 0), {} {}, in place",
            pg.world_size(),
            comm.version(),
            comm.context().ordinal(),
            dtype_name(opts.dtype),
            opts.op
        );
        println!("#");
        println!(
            "# {:>10} {:>12} {:>8} {:>6} {:>10} {:>8} {:>8} {:>7}",
            "size", "count", "type", "redop", "time", "algbw", "busbw", "#wrong"
        );
    }
    let rows = match opts.dtype {
        BenchDType::F32 => sweep_nccl::<f32>(pg, &comm, opts),
        BenchDType::F64 => sweep_nccl::<f64>(pg, &comm, opts),
        BenchDType::F16 => sweep_nccl::<f16>(pg, &comm, opts),
        BenchDType::BF16 => sweep_nccl::<bf16>(pg, &comm, opts),
        BenchDType::I32 => sweep_nccl::<i32>(pg, &comm, opts),
        BenchDType::I64 => sweep_nccl::<i64>(pg, &comm, opts),
    }?;
    if pg.is_main() {
        let wrong = print_summary(&rows);
        if wrong > 0 {
            return Err(BenchError::WrongResults { wrong });
        }
    }
    Ok(())
}

#[cfg(not(feature = "cuda"))]
fn run_nccl(_pg: &ProcessGroup, _opts: &AllReduceBench) -> BenchResult<()> {
    Err(DdpError::Cuda(crate::error::CudaError::NcclUnavailable {
        detail: "this burn-ddp binary was built without the `cuda` feature; rebuild with \
                         `--features cuda` to measure NCCL"
            .into(),
    })
    .into())
}

#[cfg(feature = "cuda")]
fn sweep_nccl<T: BenchElem + cudarc::driver::DeviceRepr + Default>(
    pg: &ProcessGroup,
    comm: &crate::cuda::NcclComm,
    opts: &AllReduceBench,
) -> BenchResult<Vec<BenchRow>> {
    let elem = std::mem::size_of::<T>();
    let rank = pg.rank();
    let cuda = |what: &str, e| crate::cuda::driver_error_for(rank, what, e);
    let max_count = opts.max_bytes / elem;
    let host: Vec<T> = (0..max_count)
        .map(|i| T::from_i32(pattern(rank.0, i)))
        .collect();
    let mut dev = comm
        .stream()
        .clone_htod(&host)
        .map_err(|e| cuda("copying the benchmark buffer to the GPU", e))?;
    let mut rows = Vec::new();
    for bytes in sizes(opts, elem) {
        let count = bytes / elem;
        let mut run = |n: usize| -> BenchResult<f64> {
            let t = Instant::now();
            for _ in 0..n {
                comm.queue_all_reduce(&mut dev.slice_mut(..count), opts.op)?;
            }
            comm.wait()?;
            Ok(t.elapsed().as_secs_f64())
        };
        run(2)?;
        let mut est = [run(1)?];
        pg.all_reduce(&mut est, ReduceOp::Max)?;
        let iters = (opts.target.as_secs_f64() / est[0].max(1e-7)).clamp(3.0, 500.0) as usize;
        pg.barrier()?;
        let mut secs = [run(iters)? / iters as f64];
        pg.all_reduce(&mut secs, ReduceOp::Max)?;

        // Correctness on fresh data.
        comm.stream()
            .memcpy_htod(&host, &mut dev)
            .map_err(|e| cuda("resetting the benchmark buffer", e))?;
        comm.queue_all_reduce(&mut dev.slice_mut(..count), opts.op)?;
        comm.wait()?;
        let back: Vec<T> = comm
            .stream()
            .clone_dtoh(&dev)
            .map_err(|e| cuda("reading the result", e))?;
        rows.push(row(pg, opts, (bytes, secs[0]), &back[..count], None)?);
        comm.stream()
            .memcpy_htod(&host, &mut dev)
            .map_err(|e| cuda("resetting the benchmark buffer", e))?;
    }
    Ok(rows)
}

fn dtype_name(d: BenchDType) -> &'static str {
    match d {
        BenchDType::F32 => "float",
        BenchDType::F64 => "double",
        BenchDType::F16 => "half",
        BenchDType::BF16 => "bfloat16",
        BenchDType::I32 => "int32",
        BenchDType::I64 => "int64",
    }
}

fn print_row(row: Option<BenchRow>, opts: &AllReduceBench, way: Option<Way>) {
    if let Some(r) = row {
        println!(
            "{:>12} {:>12} {:>8} {:>6} {:>10.1} {:>8.3} {:>8.3} {:>7}{}",
            r.bytes,
            r.count,
            dtype_name(opts.dtype),
            opts.op.name(),
            r.seconds * 1e6,
            r.algbw,
            r.busbw,
            r.wrong,
            way.map(|w| format!(" {:>8}", w.to_string()))
                .unwrap_or_default()
        );
    }
}

/// One TCP connection from rank 0 to rank 1, set up and authenticated like a transport link,
/// used to measure what a single stream achieves between the same two processes. Every step
/// has a deadline: setting up, the rendezvous one; each transfer, the collective one.
struct StreamLink {
    stream: TcpStream,
    buf: Vec<u8>,
    rank: Rank,
    sender: bool,
}

const CACHED_CHUNK: usize = 1 << 20;

impl StreamLink {
    /// Opens the link on ranks 0 and 1 (`None` elsewhere).
    fn open(pg: &ProcessGroup, message_bytes: usize) -> BenchResult<Option<Self>> {
        let Some(store) = pg.store_client() else {
            return Ok(None);
        };
        let rank = pg.rank();
        let deadline = Instant::now() + pg.timeouts().rendezvous;
        let token = pg.token();
        let fail = |what: &'static str| {
            move |source: std::io::Error| BenchError::Link { rank, what, source }
        };
        let stream = match rank.0 {
            1 => {
                let ip = store.local_ip()?;
                let listener =
                    TcpListener::bind(SocketAddr::new(ip, 0)).map_err(fail("listening"))?;
                store.set(
                    "bench/stream",
                    listener.local_addr()?.to_string().as_bytes(),
                )?;
                let s = accept_until(&listener, deadline).map_err(fail("accepting rank 0"))?;
                auth::server_handshake(&s, &[Purpose::Bench], &token, deadline).map_err(|e| {
                    DdpError::Rendezvous(RendezvousError::StoreRefused {
                        rank,
                        reason: format!("bench link handshake failed: {e}"),
                    })
                })?;
                auth::welcome(&s)?;
                s
            }
            0 => {
                let raw = store.get("bench/stream")?;
                let addr: SocketAddr = String::from_utf8_lossy(&raw).parse().map_err(|_| {
                    fail("reading rank 1's address")(std::io::Error::new(
                        std::io::ErrorKind::InvalidData,
                        "rank 1 published an address that does not parse",
                    ))
                })?;
                let left = deadline.saturating_duration_since(Instant::now());
                let mut s = TcpStream::connect_timeout(&addr, left.max(Duration::from_millis(1)))
                    .map_err(fail("connecting to rank 1"))?;
                auth::client_handshake(
                    &mut s,
                    Purpose::Bench,
                    &token,
                    rank,
                    pg.world_size(),
                    deadline,
                )?;
                s
            }
            _ => return Ok(None),
        };
        let each = Some(pg.timeouts().collective);
        stream
            .set_nodelay(true)
            .and_then(|()| stream.set_read_timeout(each))
            .and_then(|()| stream.set_write_timeout(each))
            .map_err(fail("setting up the socket"))?;
        Ok(Some(Self {
            stream,
            buf: huge_filled(message_bytes, 1u8),
            rank,
            sender: rank.is_zero(),
        }))
    }

    fn error(&self, what: &'static str) -> impl Fn(std::io::Error) -> BenchError {
        let rank = self.rank;
        move |source| BenchError::Link { rank, what, source }
    }

    /// Moves one whole message from rank 0's buffer into rank 1's; rank 0 returns the seconds.
    fn transfer(&mut self) -> BenchResult<Option<f64>> {
        let mut ack = [0u8; 1];
        let fail = self.error("moving a message");
        if self.sender {
            let t = Instant::now();
            self.stream.write_all(&self.buf).map_err(&fail)?;
            self.stream.read_exact(&mut ack).map_err(&fail)?;
            Ok(Some(t.elapsed().as_secs_f64()))
        } else {
            self.stream.read_exact(&mut self.buf).map_err(&fail)?;
            self.stream.write_all(&ack).map_err(&fail)?;
            Ok(None)
        }
    }

    /// iperf-style: resends one cache-resident 1 MiB chunk `total` bytes' worth; GB/s on rank 0.
    fn cached(&mut self, total: usize) -> BenchResult<Option<f64>> {
        let mut ack = [0u8; 1];
        let fail = self.error("streaming a cached chunk");
        if self.sender {
            let t = Instant::now();
            let mut left = total;
            while left > 0 {
                let n = CACHED_CHUNK.min(left).min(self.buf.len());
                self.stream.write_all(&self.buf[..n]).map_err(&fail)?;
                left -= n;
            }
            self.stream.read_exact(&mut ack).map_err(&fail)?;
            Ok(Some(total as f64 / t.elapsed().as_secs_f64() / 1e9))
        } else {
            let mut left = total;
            let chunk = CACHED_CHUNK.min(self.buf.len());
            while left > 0 {
                let n = self
                    .stream
                    .read(&mut self.buf[..chunk.min(left)])
                    .map_err(&fail)?;
                if n == 0 {
                    return Err(fail(std::io::ErrorKind::UnexpectedEof.into()));
                }
                left -= n;
            }
            self.stream.write_all(&ack).map_err(&fail)?;
            Ok(None)
        }
    }
}

/// The first connection to `listener` before `deadline`.
fn accept_until(listener: &TcpListener, deadline: Instant) -> std::io::Result<TcpStream> {
    listener.set_nonblocking(true)?;
    loop {
        match listener.accept() {
            Ok((s, _)) => {
                s.set_nonblocking(false)?;
                return Ok(s);
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        "rank 0 did not connect before the rendezvous deadline",
                    ));
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(e) => return Err(e),
        }
    }
}

/// The reference message size for the comparison with a single stream.
const REFERENCE: usize = 64 << 20;
/// Interleaved rounds of the comparison.
const ROUNDS: usize = 9;

/// The median of `samples`: the middle one, or the mean of the two middle ones for an even
/// count; NaN for none. The one median of the bandwidth tool, the point-to-point benchmark and
/// the step benchmarks (`burn_ddp_dev::args::median`).
pub fn median(samples: &[f64]) -> f64 {
    let mut v = samples.to_vec();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    match n {
        0 => f64::NAN,
        _ if n % 2 == 1 => v[n / 2],
        _ => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// Alternates one single-stream transfer and one all-reduce of the same size, `ROUNDS` times,
/// so that both see the same machine conditions; returns (stream GB/s, all-reduce busbw GB/s)
/// medians on rank 0.
fn compare<T: BenchElem>(
    pg: &ProcessGroup,
    link: &mut Option<StreamLink>,
    bytes: usize,
) -> BenchResult<Option<(f64, f64)>> {
    let count = bytes / std::mem::size_of::<T>();
    let world = pg.world_size().get() as f64;
    let mut buf: Vec<T> = huge_filled(count, T::from_i32(1));
    let mut stream = Vec::new();
    let mut ring = Vec::new();
    pg.all_reduce(&mut buf, ReduceOp::Sum)?;
    for _ in 0..ROUNDS {
        if let Some(l) = link.as_mut() {
            if let Some(s) = l.transfer()? {
                stream.push(bytes as f64 / s / 1e9);
            }
        }
        pg.barrier()?;
        let t = Instant::now();
        pg.all_reduce(&mut buf, ReduceOp::Sum)?;
        let mut secs = [t.elapsed().as_secs_f64()];
        pg.all_reduce(&mut secs, ReduceOp::Max)?;
        ring.push(bytes as f64 / secs[0] / 1e9 * 2.0 * (world - 1.0) / world);
    }
    Ok((!stream.is_empty()).then(|| (median(&stream), median(&ring))))
}

/// Runs the benchmark as one rank of the job in the environment and prints the table on rank 0.
///
/// # Errors
/// Options out of range ([`AllReduceBench::check`]), any collective or setup error.
pub fn run_worker(opts: &AllReduceBench) -> BenchResult<()> {
    opts.check()?;
    let pg = ProcessGroup::from_env()?;
    if opts.nccl {
        return run_nccl(&pg, opts);
    }
    let world = pg.world_size();
    let reference = REFERENCE.min(opts.max_bytes);
    let mut link = if world.get() >= 2 && !opts.skip_loopback {
        StreamLink::open(&pg, reference)?
    } else {
        None
    };
    let cached = match link.as_mut() {
        Some(l) => l.cached(reference.max(256 << 20))?,
        None => None,
    };
    pg.barrier()?;
    if pg.is_main() {
        println!(
            "# burn-ddp bench all-reduce: {} ranks, {} transport, {} {}, in place",
            world,
            pg.transport(),
            dtype_name(opts.dtype),
            opts.op
        );
        if let Some(c) = cached {
            println!("# single TCP stream rank 0 -> rank 1, resending a cache-resident 1 MiB buffer (iperf-style): {c:.2} GB/s");
        }
        println!("#");
        println!(
            "# {:>10} {:>12} {:>8} {:>6} {:>10} {:>8} {:>8} {:>7}",
            "size", "count", "type", "redop", "time", "algbw", "busbw", "#wrong"
        );
        println!(
            "# {:>10} {:>12} {:>8} {:>6} {:>10} {:>8} {:>8} {:>7}",
            "(B)", "(elements)", "", "", "(us)", "(GB/s)", "(GB/s)", ""
        );
    }
    macro_rules! with_type {
        ($f:ident $(, $arg:expr)*) => {
            match opts.dtype {
                BenchDType::F32 => $f::<f32>($($arg),*),
                BenchDType::F64 => $f::<f64>($($arg),*),
                BenchDType::F16 => $f::<f16>($($arg),*),
                BenchDType::BF16 => $f::<bf16>($($arg),*),
                BenchDType::I32 => $f::<i32>($($arg),*),
                BenchDType::I64 => $f::<i64>($($arg),*),
            }
        };
    }
    let ways = ways(opts);
    let (rows, times) = if ways.is_empty() {
        (with_type!(sweep, &pg, opts)?, Vec::new())
    } else {
        with_type!(sweep_ways, &pg, opts, &ways)?
    };
    let comparison = if world.get() >= 2 && !opts.skip_loopback {
        with_type!(compare, &pg, &mut link, reference)?
    } else {
        None
    };
    if pg.is_main() {
        let wrong = print_summary(&rows);
        print_ratios(&ways, world.get(), &times);
        if let Some((stream, ring)) = comparison {
            println!("#");
            println!(
                "# {} MiB, {ROUNDS} interleaved rounds (medians): single TCP stream rank 0 -> rank 1 {stream:.3} GB/s, \
                 all-reduce busbw {ring:.3} GB/s = {:.0}% of the single stream",
                reference >> 20,
                100.0 * ring / stream
            );
        }
        if wrong > 0 {
            return Err(BenchError::WrongResults { wrong });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::median;

    #[test]
    fn the_median_is_the_middle_sample_or_the_mean_of_the_two_middle_ones() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), 2.5);
        assert_eq!(median(&[7.0]), 7.0);
        assert!(median(&[]).is_nan());
    }
}
