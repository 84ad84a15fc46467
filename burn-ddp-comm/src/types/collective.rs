//! The vocabulary of collectives: element types, reduce operations, and the descriptor every rank
//! must agree on.

use std::fmt;

use crate::types::Rank;

/// Element type of a collective buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum DType {
    /// 32-bit float.
    F32 = 1,
    /// 64-bit float.
    F64 = 2,
    /// IEEE half precision.
    F16 = 3,
    /// bfloat16.
    BF16 = 4,
    /// 32-bit signed integer.
    I32 = 5,
    /// 64-bit signed integer.
    I64 = 6,
    /// Raw bytes (reductions wrap around).
    U8 = 7,
}

impl DType {
    /// Size of one element in bytes.
    pub const fn size(self) -> usize {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::F64 | DType::I64 => 8,
            DType::F16 | DType::BF16 => 2,
            DType::U8 => 1,
        }
    }

    /// The wire code of this type.
    pub(crate) const fn code(self) -> u8 {
        self as u8
    }

    /// Decodes a wire code.
    pub(crate) fn from_code(code: u8) -> Option<Self> {
        Some(match code {
            1 => DType::F32,
            2 => DType::F64,
            3 => DType::F16,
            4 => DType::BF16,
            5 => DType::I32,
            6 => DType::I64,
            7 => DType::U8,
            _ => return None,
        })
    }

    /// The name nccl-tests prints for this type.
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "float",
            DType::F64 => "double",
            DType::F16 => "half",
            DType::BF16 => "bfloat16",
            DType::I32 => "int32",
            DType::I64 => "int64",
            DType::U8 => "uint8",
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// How values from all ranks are combined.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[repr(u8)]
pub enum ReduceOp {
    /// Element-wise sum.
    #[default]
    Sum = 1,
    /// Element-wise sum divided by the world size (integer types divide towards zero).
    Mean = 2,
    /// Element-wise maximum.
    Max = 3,
    /// Element-wise minimum.
    Min = 4,
}

impl ReduceOp {
    pub(crate) const fn code(self) -> u8 {
        self as u8
    }

    pub(crate) fn from_code(code: u8) -> Option<Self> {
        Some(match code {
            1 => ReduceOp::Sum,
            2 => ReduceOp::Mean,
            3 => ReduceOp::Max,
            4 => ReduceOp::Min,
            _ => return None,
        })
    }

    /// Lower-case name (`sum`, `mean`, ...).
    pub fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Mean => "mean",
            ReduceOp::Max => "max",
            ReduceOp::Min => "min",
        }
    }
}

impl fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The kind of a collective.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum CollectiveOp {
    /// Every rank ends with the reduction of all buffers.
    AllReduce = 1,
    /// Every rank ends with the root's buffer.
    Broadcast = 2,
    /// Every rank ends with the concatenation of all buffers, in rank order.
    AllGather = 3,
    /// Rank r ends with block r of the reduction of all buffers.
    ReduceScatter = 4,
    /// Returns once every rank has entered it.
    Barrier = 5,
    /// A point-to-point message to one rank (`ProcessGroup::send`).
    Send = 6,
    /// A point-to-point message from one rank (`ProcessGroup::recv`).
    Recv = 7,
    /// The ranks of one host allocate buffers in the memory they share (shared-memory buckets).
    Allocate = 8,
    /// An all-reduce of buffers that lie in the memory the ranks share, reduced where they lie.
    AllReduceShared = 9,
}

impl CollectiveOp {
    pub(crate) const fn code(self) -> u8 {
        self as u8
    }

    pub(crate) fn from_code(code: u8) -> Option<Self> {
        Some(match code {
            1 => CollectiveOp::AllReduce,
            2 => CollectiveOp::Broadcast,
            3 => CollectiveOp::AllGather,
            4 => CollectiveOp::ReduceScatter,
            5 => CollectiveOp::Barrier,
            6 => CollectiveOp::Send,
            7 => CollectiveOp::Recv,
            8 => CollectiveOp::Allocate,
            9 => CollectiveOp::AllReduceShared,
            _ => return None,
        })
    }

    /// snake_case name, as in the API.
    pub fn name(self) -> &'static str {
        match self {
            CollectiveOp::AllReduce => "all_reduce",
            CollectiveOp::Broadcast => "broadcast",
            CollectiveOp::AllGather => "all_gather",
            CollectiveOp::ReduceScatter => "reduce_scatter",
            CollectiveOp::Barrier => "barrier",
            CollectiveOp::Send => "send",
            CollectiveOp::Recv => "recv",
            CollectiveOp::Allocate => "allocate",
            CollectiveOp::AllReduceShared => "all_reduce_shared",
        }
    }
}

impl fmt::Display for CollectiveOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// What a rank believes the current collective is. All ranks must pass equal descriptors;
/// the transports compare them and report a mismatch instead of corrupting data or hanging.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CollectiveDesc {
    /// Which collective.
    pub op: CollectiveOp,
    /// Element type.
    pub dtype: DType,
    /// Elements in this rank's contribution (per-rank block for gather/scatter).
    pub count: u64,
    /// Reduce operation (ignored by non-reducing collectives).
    pub reduce: ReduceOp,
    /// Root rank (broadcast only, 0 otherwise).
    pub root: Rank,
}

impl CollectiveDesc {
    /// A descriptor with the given op, dtype and count, `Sum` and root 0.
    pub fn new(op: CollectiveOp, dtype: DType, count: usize) -> Self {
        Self {
            op,
            dtype,
            count: count as u64,
            reduce: ReduceOp::Sum,
            root: Rank::ZERO,
        }
    }

    /// With a reduce operation.
    pub fn reduce(mut self, reduce: ReduceOp) -> Self {
        self.reduce = reduce;
        self
    }

    /// With a root.
    pub fn root(mut self, root: Rank) -> Self {
        self.root = root;
        self
    }
}

impl fmt::Display for CollectiveDesc {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}({} x {}", self.op, self.count, self.dtype)?;
        match self.op {
            CollectiveOp::AllReduce
            | CollectiveOp::AllReduceShared
            | CollectiveOp::ReduceScatter => write!(f, ", {}", self.reduce)?,
            CollectiveOp::Broadcast => write!(f, ", root {}", self.root)?,
            _ => {}
        }
        f.write_str(")")
    }
}

mod sealed {
    pub trait Sealed {}
}

/// A Rust type that collectives can move: `f32`, `f64`, `half::f16`, `half::bf16`, `i32`, `i64`, `u8`.
pub trait Element: bytemuck::Pod + Send + Sync + sealed::Sealed {
    /// The matching [`DType`].
    const DTYPE: DType;
}

macro_rules! elements {
    ($($ty:ty => $dtype:ident),* $(,)?) => {
        $(
            impl sealed::Sealed for $ty {}
            impl Element for $ty {
                const DTYPE: DType = DType::$dtype;
            }
        )*
    };
}

elements! {
    f32 => F32,
    f64 => F64,
    half::f16 => F16,
    half::bf16 => BF16,
    i32 => I32,
    i64 => I64,
    u8 => U8,
}

/// Which algorithm the TCP transport runs a collective with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Algorithm {
    /// By size: recursive doubling (log n steps) for all-reduces, broadcasts and all-gathers
    /// of at most [`TREE_MAX_BYTES`](crate::config::TREE_MAX_BYTES) (between two ranks
    /// [`TREE_MAX_BYTES_2`](crate::config::TREE_MAX_BYTES_2)) and for barriers, the pipelined
    /// ring (bandwidth-optimal, 2(n−1) steps) above. The only choice `BURN_DDP_ALGO` may
    /// replace.
    #[default]
    Auto,
    /// The ring for every collective (opens no other link).
    Ring,
    /// Recursive doubling for every all-reduce, broadcast, all-gather and barrier, whatever
    /// its size (reduce-scatters stay on the ring). For measuring; `Auto` is faster above the
    /// threshold.
    Tree,
}

impl Algorithm {
    /// Parses `auto`, `ring` and `tree`, in any case.
    pub fn parse(v: &str) -> Option<Self> {
        match v.trim().to_ascii_lowercase().as_str() {
            "auto" | "" => Some(Self::Auto),
            "ring" => Some(Self::Ring),
            "tree" => Some(Self::Tree),
            _ => None,
        }
    }

    /// The name `parse` reads back.
    pub fn name(self) -> &'static str {
        match self {
            Self::Auto => "auto",
            Self::Ring => "ring",
            Self::Tree => "tree",
        }
    }
}

impl std::fmt::Display for Algorithm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// How the ranks of a group that share a host move the bytes of their collectives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Transport {
    /// Shared memory when every rank of the group runs on one host (same kernel, host name
    /// and namespaces); when the ranks are spread over hosts with as many (at least 2) on each,
    /// large all-reduces in two levels (shared memory in each host, a TCP ring per local rank
    /// across hosts) and the rest over TCP; TCP otherwise. The only choice `BURN_DDP_TRANSPORT`
    /// may replace.
    #[default]
    Auto,
    /// TCP for every collective, even between ranks of one host (loopback).
    Tcp,
    /// Shared memory as under `Auto`, and an error at connection when the group's ranks are
    /// neither all on one host nor as many on each host, or the memory cannot be set up.
    Shm,
}

impl Transport {
    /// Parses `auto`, `tcp` and `shm`, in any case.
    pub fn parse(v: &str) -> Option<Self> {
        match v.trim().to_ascii_lowercase().as_str() {
            "auto" | "" => Some(Self::Auto),
            "tcp" => Some(Self::Tcp),
            "shm" => Some(Self::Shm),
            _ => None,
        }
    }

    /// The name `parse` reads back.
    pub fn name(self) -> &'static str {
        match self {
            Self::Auto => "auto",
            Self::Tcp => "tcp",
            Self::Shm => "shm",
        }
    }
}

impl std::fmt::Display for Transport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_round_trip() {
        for d in [
            DType::F32,
            DType::F64,
            DType::F16,
            DType::BF16,
            DType::I32,
            DType::I64,
            DType::U8,
        ] {
            assert_eq!(DType::from_code(d.code()), Some(d));
        }
        for r in [ReduceOp::Sum, ReduceOp::Mean, ReduceOp::Max, ReduceOp::Min] {
            assert_eq!(ReduceOp::from_code(r.code()), Some(r));
        }
        assert_eq!(DType::from_code(0), None);
        assert_eq!(CollectiveOp::from_code(99), None);
    }

    #[test]
    fn element_sizes_match_dtypes() {
        assert_eq!(
            std::mem::size_of::<half::bf16>(),
            <half::bf16 as Element>::DTYPE.size()
        );
        assert_eq!(std::mem::size_of::<i64>(), <i64 as Element>::DTYPE.size());
    }

    #[test]
    fn desc_display() {
        let d = CollectiveDesc::new(CollectiveOp::AllReduce, DType::F32, 10).reduce(ReduceOp::Mean);
        assert_eq!(d.to_string(), "all_reduce(10 x float, mean)");
    }
}
