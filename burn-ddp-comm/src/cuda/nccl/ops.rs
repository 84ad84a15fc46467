//! What an [`NcclComm`] does: its collectives and point-to-point calls (raw, on device pointers,
//! and typed, on cudarc's slices), the checks of counts, types and spans before a pointer reaches
//! NCCL, and the tables from our element types and reductions to NCCL's.

use crate::error::{CollectiveError, CudaError};
use std::ffi::{c_int, c_void};
use std::fmt;

use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, DeviceRepr};
use cudarc::nccl::result::{self, NcclStatus};
use cudarc::nccl::sys::{ncclDataType_t, ncclRedOp_t};

use super::NcclComm;
use crate::comm::{CollectiveOp, DType, Element, ReduceOp};
use crate::cuda::library::NcclVersion;
use crate::error::{DdpError, Result};
use crate::types::{CollectiveSeq, Rank};

/// One transfer of [`NcclComm::send_recv_raw`]: a device pointer, its element count and type,
/// and the peer (a rank of the communicator's group).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NcclP2p {
    /// Send `count` elements at `ptr` to `peer`.
    Send {
        /// Device pointer.
        ptr: u64,
        /// Elements.
        count: usize,
        /// Their type.
        dtype: DType,
        /// The receiving rank.
        peer: Rank,
    },
    /// Receive `count` elements from `peer` into `ptr`.
    Recv {
        /// Device pointer.
        ptr: u64,
        /// Elements.
        count: usize,
        /// Their type.
        dtype: DType,
        /// The sending rank.
        peer: Rank,
    },
}

/// NCCL's element type for `dtype`.
pub(crate) fn nccl_dtype(dtype: DType) -> ncclDataType_t {
    match dtype {
        DType::F32 => ncclDataType_t::ncclFloat32,
        DType::F64 => ncclDataType_t::ncclFloat64,
        DType::F16 => ncclDataType_t::ncclFloat16,
        DType::BF16 => ncclDataType_t::ncclBfloat16,
        DType::I32 => ncclDataType_t::ncclInt32,
        DType::I64 => ncclDataType_t::ncclInt64,
        DType::U8 => ncclDataType_t::ncclUint8,
    }
}

/// NCCL's reduction for `op` on `dtype`, or why this NCCL cannot do it.
pub(crate) fn nccl_op(
    op: ReduceOp,
    dtype: DType,
    version: NcclVersion,
) -> std::result::Result<ncclRedOp_t, String> {
    Ok(match op {
        ReduceOp::Sum => ncclRedOp_t::ncclSum,
        ReduceOp::Max => ncclRedOp_t::ncclMax,
        ReduceOp::Min => ncclRedOp_t::ncclMin,
        ReduceOp::Mean => {
            if !matches!(dtype, DType::F32 | DType::F64 | DType::F16 | DType::BF16) {
                return Err(format!(
                    "mean of {dtype} values: NCCL averages floating-point types only; reduce with \
                     ReduceOp::Sum and divide by the world size"
                ));
            }
            if !version.has_avg() {
                return Err(format!(
                    "mean needs ncclAvg (NCCL 2.10 or newer); this process loaded NCCL {version}"
                ));
            }
            ncclRedOp_t::ncclAvg
        }
    })
}

/// Checks that a tensor of `numel` elements of type `got` (the Burn line's dtype) is a bucket
/// of `count` elements of type `want`; the message says what differs.
pub(crate) fn check_elements<T: PartialEq + fmt::Debug>(
    numel: usize,
    got: T,
    count: usize,
    want: T,
) -> std::result::Result<(), String> {
    if numel != count {
        return Err(format!("it has {numel} elements, the bucket plan {count}"));
    }
    if got != want {
        return Err(format!("its elements are {got:?}, the bucket's {want:?}"));
    }
    Ok(())
}

/// Checks that a device buffer of `bytes` bytes holds a bucket of `count` elements of `dtype`
/// (what the device paths check before handing a pointer to NCCL); the message says what does
/// not fit.
pub(crate) fn check_span(
    bytes: u64,
    count: usize,
    dtype: DType,
) -> std::result::Result<(), String> {
    let need = count as u64 * dtype.size() as u64;
    if bytes >= need {
        Ok(())
    } else {
        Err(format!(
            "the bucket's device buffer has {bytes} bytes but {count} x {dtype} need {need}"
        ))
    }
}

/// What a device path checks of a bucket's tensor before it takes its device pointer: that
/// it is contiguous and holds `count` elements of the line's dtype `want` (`numel` elements of
/// `got`). The error names `what` (the bucket's input or output) and what differs.
///
/// # Errors
/// [`ModelError::Access`](crate::ModelError::Access) ([`DdpError::bucket_layout`]) for this `rank`.
pub fn check_bucket_tensor<T: PartialEq + fmt::Debug>(
    rank: Rank,
    what: &str,
    contiguous: bool,
    (numel, got): (usize, T),
    (count, want): (usize, T),
) -> Result<()> {
    if !contiguous {
        return Err(DdpError::bucket_layout(
            rank,
            format!("the {what} is not contiguous"),
        ));
    }
    check_elements(numel, got, count, want)
        .map_err(|m| DdpError::bucket_layout(rank, format!("the {what}: {m}")))
}

/// What a device path checks of the allocation behind a bucket's tensor: `bytes` hold `count`
/// elements of `dtype` ([`check_bucket_tensor`] for the tensor itself).
///
/// # Errors
/// [`ModelError::Access`](crate::ModelError::Access) ([`DdpError::bucket_layout`]) for this `rank`, naming `what`.
pub(crate) fn check_bucket_span(
    rank: Rank,
    what: &str,
    bytes: u64,
    count: usize,
    dtype: DType,
) -> Result<()> {
    check_span(bytes, count, dtype)
        .map_err(|m| DdpError::bucket_layout(rank, format!("the {what}: {m}")))
}

impl NcclComm {
    fn check_len(
        &self,
        op: CollectiveOp,
        what: &'static str,
        expected: usize,
        got: usize,
    ) -> Result<()> {
        if expected == got {
            return Ok(());
        }
        Err(DdpError::Collective(CollectiveError::BufferSize {
            rank: self.rank,
            op,
            what,
            expected,
            got,
        }))
    }

    /// NCCL's reduction for `op` on `dtype`, or an error saying why it is not available.
    fn reduction(&self, op: ReduceOp, dtype: DType, call: &str) -> Result<ncclRedOp_t> {
        nccl_op(op, dtype, self.version).map_err(|reason| {
            DdpError::Cuda(CudaError::NcclUnsupported {
                rank: self.rank,
                what: call.into(),
                reason,
            })
        })
    }

    /// Queues an all-reduce of `count` elements from `send` into `recv` (equal for in place).
    ///
    /// # Safety
    /// `send` and `recv` must be device pointers on this communicator's GPU to at least
    /// `count` elements of `dtype`, and stay valid until [`NcclComm::wait`] returns. Work that
    /// writes `send` must be complete (or ordered before this stream); nothing may read `recv`
    /// before the wait.
    ///
    /// # Errors
    /// The reduction is not available for `dtype`, or NCCL refuses the call.
    pub unsafe fn all_reduce_raw(
        &self,
        send: u64,
        recv: u64,
        count: usize,
        dtype: DType,
        op: ReduceOp,
    ) -> Result<CollectiveSeq> {
        let red = self.reduction(op, dtype, "ncclAllReduce")?;
        self.issue(
            CollectiveOp::AllReduce,
            format!("{count} x {dtype}, {op}"),
            "ncclAllReduce",
            |comm, stream| {
                // SAFETY: the caller's contract covers the pointers; comm and stream are live.
                unsafe {
                    result::all_reduce(
                        send as *const c_void,
                        recv as *mut c_void,
                        count,
                        nccl_dtype(dtype),
                        red,
                        comm,
                        stream,
                    )
                }
            },
        )
    }

    /// Queues point-to-point transfers on device pointers as one NCCL group
    /// (`ncclGroupStart`, `ncclSend`/`ncclRecv` per transfer, `ncclGroupEnd`): NCCL runs them
    /// concurrently, so a rank may send to and receive from the same peer in one batch without
    /// deadlock (PyTorch's `batch_isend_irecv`). [`NcclComm::wait`] completes them. Peers are
    /// ranks of this communicator's group; every send needs the peer's matching receive (same
    /// count and type) in its own batch.
    ///
    /// # Safety
    /// Every pointer must be a device pointer on this communicator's GPU to at least its count of
    /// elements of its type, and stay valid until [`NcclComm::wait`] returns; nothing may read a
    /// receive buffer or write a send buffer before then.
    ///
    /// # Errors
    /// A peer outside the group or this rank itself ([`CollectiveError::InvalidGroupCall`](crate::CollectiveError::InvalidGroupCall)); bfloat16
    /// before NCCL 2.10; NCCL refuses a call.
    pub unsafe fn send_recv_raw(&self, ops: &[NcclP2p]) -> Result<CollectiveSeq> {
        for op in ops {
            let (peer, dtype) = match *op {
                NcclP2p::Send { peer, dtype, .. } | NcclP2p::Recv { peer, dtype, .. } => {
                    (peer, dtype)
                }
            };
            if peer.0 >= self.world.get() || peer == self.rank {
                return Err(DdpError::Collective(CollectiveError::InvalidGroupCall {
                    rank: self.rank,
                    what: "NCCL send/recv",
                    reason: format!(
                        "peer {peer} is this rank or outside the group of {} ranks",
                        self.world
                    ),
                }));
            }
            if dtype == DType::BF16 && !self.version.has_bf16() {
                return Err(DdpError::Cuda(CudaError::NcclUnsupported {
                    rank: self.rank,
                    what: "ncclSend/ncclRecv".into(),
                    reason: format!(
                        "bfloat16 needs NCCL 2.10 or later, this is {}",
                        self.version
                    ),
                }));
            }
        }
        let op = if ops.iter().all(|o| matches!(o, NcclP2p::Recv { .. })) {
            CollectiveOp::Recv
        } else {
            CollectiveOp::Send
        };
        let what = ops
            .iter()
            .map(|o| match *o {
                NcclP2p::Send {
                    count, dtype, peer, ..
                } => format!("send {count} x {dtype} to {peer}"),
                NcclP2p::Recv {
                    count, dtype, peer, ..
                } => format!("recv {count} x {dtype} from {peer}"),
            })
            .collect::<Vec<_>>()
            .join(", ");
        self.issue(op, what, "ncclSend/ncclRecv", |comm, stream| {
            result::group_start()?;
            let mut first = Ok(NcclStatus::Success);
            for o in ops {
                // SAFETY: the caller's contract covers the pointers; comm and stream are live.
                let r = unsafe {
                    match *o {
                        NcclP2p::Send {
                            ptr,
                            count,
                            dtype,
                            peer,
                        } => result::send(
                            ptr as *const c_void,
                            count,
                            nccl_dtype(dtype),
                            peer.0 as c_int,
                            comm,
                            stream,
                        ),
                        NcclP2p::Recv {
                            ptr,
                            count,
                            dtype,
                            peer,
                        } => result::recv(
                            ptr as *mut c_void,
                            count,
                            nccl_dtype(dtype),
                            peer.0 as c_int,
                            comm,
                            stream,
                        ),
                    }
                };
                if first.is_ok() {
                    if let Err(e) = r {
                        first = Err(e);
                    }
                }
            }
            // The group is closed whatever happened inside it.
            let end = result::group_end();
            first.and(end)
        })
    }

    /// Sends `buf` to rank `peer` of the group and waits for the transfer (the peer must call
    /// [`NcclComm::recv`] with a buffer of the same length).
    ///
    /// # Errors
    /// As [`NcclComm::send_recv_raw`] and [`NcclComm::wait`].
    pub fn send<T: Element + DeviceRepr>(&self, buf: &CudaSlice<T>, peer: Rank) -> Result<()> {
        let count = buf.len();
        {
            let (ptr, _sync) = buf.device_ptr(&self.stream);
            let op = NcclP2p::Send {
                ptr,
                count,
                dtype: T::DTYPE,
                peer,
            };
            // SAFETY: `buf` is a live allocation of `count` T on this GPU; `_sync` orders its
            // earlier writes before this stream and this stream's read before later writes.
            unsafe { self.send_recv_raw(&[op]) }?;
        }
        self.wait()
    }

    /// Receives rank `peer`'s [`NcclComm::send`] into `buf` and waits for it.
    ///
    /// # Errors
    /// As [`NcclComm::send_recv_raw`] and [`NcclComm::wait`].
    pub fn recv<T: Element + DeviceRepr>(&self, buf: &mut CudaSlice<T>, peer: Rank) -> Result<()> {
        let count = buf.len();
        {
            let (ptr, _sync) = buf.device_ptr_mut(&self.stream);
            let op = NcclP2p::Recv {
                ptr,
                count,
                dtype: T::DTYPE,
                peer,
            };
            // SAFETY: as in `send`, for a write.
            unsafe { self.send_recv_raw(&[op]) }?;
        }
        self.wait()
    }

    /// Queues a broadcast of `count` elements from `root`'s `send` into every rank's `recv`.
    ///
    /// # Safety
    /// As [`NcclComm::all_reduce_raw`].
    ///
    /// # Errors
    /// `root` outside the group, or NCCL refuses the call.
    pub unsafe fn broadcast_raw(
        &self,
        send: u64,
        recv: u64,
        count: usize,
        dtype: DType,
        root: Rank,
    ) -> Result<CollectiveSeq> {
        if root.0 >= self.world.get() {
            return Err(DdpError::Collective(CollectiveError::InvalidRoot {
                rank: self.rank,
                root,
                world: self.world,
            }));
        }
        self.issue(
            CollectiveOp::Broadcast,
            format!("{count} x {dtype}, root {root}"),
            "ncclBroadcast",
            |comm, stream| {
                // SAFETY: as in `all_reduce_raw`.
                unsafe {
                    result::broadcast(
                        send as *const c_void,
                        recv as *mut c_void,
                        count,
                        nccl_dtype(dtype),
                        root.0 as i32,
                        comm,
                        stream,
                    )
                }
            },
        )
    }

    /// Queues an all-gather: `send` holds `count` elements, `recv` `world * count`.
    ///
    /// # Safety
    /// As [`NcclComm::all_reduce_raw`], with `recv` holding `world * count` elements.
    ///
    /// # Errors
    /// NCCL refuses the call.
    pub unsafe fn all_gather_raw(
        &self,
        send: u64,
        recv: u64,
        count: usize,
        dtype: DType,
    ) -> Result<CollectiveSeq> {
        self.issue(
            CollectiveOp::AllGather,
            format!("{count} x {dtype} per rank"),
            "ncclAllGather",
            |comm, stream| {
                // SAFETY: as in `all_reduce_raw`.
                unsafe {
                    result::all_gather(
                        send as *const c_void,
                        recv as *mut c_void,
                        count,
                        nccl_dtype(dtype),
                        comm,
                        stream,
                    )
                }
            },
        )
    }

    /// Queues a reduce-scatter: `send` holds `world * count` elements, `recv` `count`.
    ///
    /// # Safety
    /// As [`NcclComm::all_reduce_raw`], with `send` holding `world * count` elements.
    ///
    /// # Errors
    /// The reduction is not available for `dtype`, or NCCL refuses the call.
    pub unsafe fn reduce_scatter_raw(
        &self,
        send: u64,
        recv: u64,
        count: usize,
        dtype: DType,
        op: ReduceOp,
    ) -> Result<CollectiveSeq> {
        let red = self.reduction(op, dtype, "ncclReduceScatter")?;
        self.issue(
            CollectiveOp::ReduceScatter,
            format!("{count} x {dtype} per rank, {op}"),
            "ncclReduceScatter",
            |comm, stream| {
                // SAFETY: as in `all_reduce_raw`.
                unsafe {
                    result::reduce_scatter(
                        send as *const c_void,
                        recv as *mut c_void,
                        count,
                        nccl_dtype(dtype),
                        red,
                        comm,
                        stream,
                    )
                }
            },
        )
    }

    /// All-reduces `buf` in place and waits for the result.
    ///
    /// # Errors
    /// As [`NcclComm::all_reduce_raw`] and [`NcclComm::wait`].
    pub fn all_reduce<T: Element + DeviceRepr>(
        &self,
        buf: &mut CudaSlice<T>,
        op: ReduceOp,
    ) -> Result<()> {
        self.queue_all_reduce(buf, op)?;
        self.wait()
    }

    /// Queues an in-place all-reduce of `buf` (a `CudaSlice` or a view of one) on this
    /// communicator's stream and returns at once; [`NcclComm::wait`] completes it. Safe for the
    /// reason cudarc's own NCCL calls are: the write is recorded on `buf`, and cudarc orders
    /// every later use of its memory, and its release, after this stream's work.
    ///
    /// # Errors
    /// As [`NcclComm::all_reduce_raw`].
    pub fn queue_all_reduce<T: Element + DeviceRepr, B: DevicePtrMut<T>>(
        &self,
        buf: &mut B,
        op: ReduceOp,
    ) -> Result<CollectiveSeq> {
        let count = buf.len();
        let (ptr, _record) = buf.device_ptr_mut(&self.stream);
        // SAFETY: `buf` is a live allocation of `count` T on this GPU: cudarc orders its earlier
        // writes before this stream, and `_record` records this stream's write on it, so nothing
        // reads it or frees it before the all-reduce is done.
        unsafe { self.all_reduce_raw(ptr, ptr, count, T::DTYPE, op) }
    }

    /// Copies `root`'s `buf` to every rank and waits for it.
    ///
    /// # Errors
    /// As [`NcclComm::broadcast_raw`] and [`NcclComm::wait`].
    pub fn broadcast<T: Element + DeviceRepr>(
        &self,
        buf: &mut CudaSlice<T>,
        root: Rank,
    ) -> Result<()> {
        let count = buf.len();
        {
            let (ptr, _sync) = buf.device_ptr_mut(&self.stream);
            // SAFETY: as in `all_reduce`.
            unsafe { self.broadcast_raw(ptr, ptr, count, T::DTYPE, root) }?;
        }
        self.wait()
    }

    /// Concatenates every rank's `send` into `recv` (`world * send.len()`), in rank order.
    ///
    /// # Errors
    /// `recv` of the wrong length, and as [`NcclComm::all_gather_raw`] and [`NcclComm::wait`].
    pub fn all_gather<T: Element + DeviceRepr>(
        &self,
        send: &CudaSlice<T>,
        recv: &mut CudaSlice<T>,
    ) -> Result<()> {
        let count = send.len();
        self.check_len(
            CollectiveOp::AllGather,
            "recv",
            count * self.world.get() as usize,
            recv.len(),
        )?;
        {
            let (s, _s) = send.device_ptr(&self.stream);
            let (r, _r) = recv.device_ptr_mut(&self.stream);
            // SAFETY: as in `all_reduce`; lengths checked above.
            unsafe { self.all_gather_raw(s, r, count, T::DTYPE) }?;
        }
        self.wait()
    }

    /// Reduces `send` (`world` blocks of `recv.len()`) across ranks; rank r receives block r.
    ///
    /// # Errors
    /// `send` of the wrong length, and as [`NcclComm::reduce_scatter_raw`] and
    /// [`NcclComm::wait`].
    pub fn reduce_scatter<T: Element + DeviceRepr>(
        &self,
        send: &CudaSlice<T>,
        recv: &mut CudaSlice<T>,
        op: ReduceOp,
    ) -> Result<()> {
        let count = recv.len();
        self.check_len(
            CollectiveOp::ReduceScatter,
            "send",
            count * self.world.get() as usize,
            send.len(),
        )?;
        {
            let (s, _s) = send.device_ptr(&self.stream);
            let (r, _r) = recv.device_ptr_mut(&self.stream);
            // SAFETY: as in `all_reduce`; lengths checked above.
            unsafe { self.reduce_scatter_raw(s, r, count, T::DTYPE, op) }?;
        }
        self.wait()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bucket_tensor_must_match_the_plan_in_count_and_type() {
        assert!(check_elements(1024, DType::F32, 1024, DType::F32).is_ok());
        assert!(check_elements(8, DType::BF16, 8, DType::BF16).is_ok());
        let e = check_elements(1023, DType::F32, 1024, DType::F32).unwrap_err();
        assert!(e.contains("1023 elements, the bucket plan 1024"), "{e}");
        let e = check_elements(8, DType::F32, 8, DType::F16).unwrap_err();
        assert!(e.contains("F32"), "{e}");
    }

    #[test]
    fn a_bucket_must_fit_its_device_buffer() {
        assert!(check_span(4096, 1024, DType::F32).is_ok());
        assert!(check_span(4096, 2048, DType::F16).is_ok());
        let e = check_span(4092, 1024, DType::F32).unwrap_err();
        assert!(e.contains("4092 bytes but 1024 x float need 4096"), "{e}");
    }

    #[test]
    fn every_dtype_and_op_maps_to_nccl() {
        let v = NcclVersion::from_code(22_304);
        for dtype in [
            DType::F32,
            DType::F64,
            DType::F16,
            DType::BF16,
            DType::I32,
            DType::I64,
            DType::U8,
        ] {
            let t = nccl_dtype(dtype);
            assert_ne!(t, ncclDataType_t::ncclNumTypes);
            for op in [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min] {
                assert!(nccl_op(op, dtype, v).is_ok(), "{op} {dtype}");
            }
        }
        assert_eq!(nccl_dtype(DType::BF16), ncclDataType_t::ncclBfloat16);
        assert_eq!(
            nccl_op(ReduceOp::Mean, DType::BF16, v),
            Ok(ncclRedOp_t::ncclAvg)
        );
        let int_mean = nccl_op(ReduceOp::Mean, DType::I64, v).unwrap_err();
        assert!(int_mean.contains("ReduceOp::Sum"), "{int_mean}");
        let old = nccl_op(ReduceOp::Mean, DType::F32, NcclVersion::from_code(2_804)).unwrap_err();
        assert!(old.contains("NCCL 2.8.4"), "{old}");
    }

    #[test]
    fn the_op_and_type_tables_are_ncclh() {
        let v = NcclVersion::from_code(22_304);
        let ops = [
            (ReduceOp::Sum, ncclRedOp_t::ncclSum, 0),
            (ReduceOp::Max, ncclRedOp_t::ncclMax, 2),
            (ReduceOp::Min, ncclRedOp_t::ncclMin, 3),
            (ReduceOp::Mean, ncclRedOp_t::ncclAvg, 4),
        ];
        for (op, want, value) in ops {
            let got = nccl_op(op, DType::F32, v).unwrap();
            assert_eq!(got, want, "{op}");
            assert_eq!(got as u32, value, "{op}: nccl.h's value");
        }
        let types = [
            (DType::U8, 1),
            (DType::I32, 2),
            (DType::I64, 4),
            (DType::F16, 6),
            (DType::F32, 7),
            (DType::F64, 8),
            (DType::BF16, 9),
        ];
        for (dtype, value) in types {
            assert_eq!(nccl_dtype(dtype) as u32, value, "{dtype}: nccl.h's value");
        }
    }
}
