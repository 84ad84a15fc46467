//! CUDA through cudarc (feature `cuda`): NCCL communicators on device memory.
//!
//! - `library.rs`: finding `libnccl` (and what to install or link when it is missing)
//! - `device.rs`: the GPU of a rank (its tensors' device, checked against `LOCAL_RANK`), the
//!   CUDA driver
//! - `status.rs`: NCCL and driver errors as text with advice
//! - `wait.rs`: waiting for GPU work with a deadline
//! - `nccl/`: [`NcclComm`]: its life (creation, waits, aborts, finalize) in `mod.rs`, its
//!   collectives and point-to-point calls on device memory in `ops.rs`
//! - `bucket.rs`: a gradient bucket's buffers as [`DeviceSpan`]s, checked and reduced by
//!   [`reduce_bucket`] (both Burn lines' device paths; all-reduced, or reduce-scattered under
//!   ZeRO stage 2); the stepped parameters of a ZeRO run all-gathered by [`all_gather_blocks`]
//! - `connect.rs`: [`connect_for_grads`], the collective choice of NCCL for a model's gradients
//!
//! cudarc loads `libcuda` and `libnccl` when first used, so this crate builds on machines without
//! a CUDA toolkit; every entry point here checks for the libraries first and turns their absence
//! into an error instead of cudarc's panic.

mod bucket;
mod connect;
mod device;
mod library;
mod nccl;
mod status;
mod wait;

pub use bucket::{
    all_gather_blocks, no_device_resource, queued_work_failed, reduce_bucket,
    reduce_scatter_blocks, BucketBuffer, BucketCall, DeviceSpan,
};
pub use connect::{connect_for_grads, connect_where_placed, wants_nccl};
pub use device::{
    context_for, describe_gpus, device_count, driver_present, ordinal_for, rank_ordinal,
};
pub use library::{nccl_present, nccl_version, usable_nccl, NcclVersion};
pub use nccl::{check_bucket_tensor, NcclComm, NcclP2p};

/// The cudarc version this crate uses (for [`NcclComm`]'s `CudaSlice` buffers).
pub use cudarc;
pub(crate) use status::driver_error as driver_error_for;
