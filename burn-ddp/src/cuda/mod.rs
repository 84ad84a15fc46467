//! CUDA support through cudarc (feature `cuda`): NCCL communicators, and the zero-copy gradient
//! path of `Autodiff<Ddp<Cuda>>`.
//!
//! - `library.rs`: finding `libnccl` (and what to install or link when it is missing)
//! - `device.rs`: the GPU of a rank (its tensors' device, checked against `LOCAL_RANK`), the
//!   CUDA driver
//! - `status.rs`: NCCL and driver errors as text with advice
//! - `wait.rs`: waiting for GPU work with a deadline
//! - `nccl.rs`: [`NcclComm`], collectives on device memory
//! - `grad.rs`: the zero-copy gradient buckets of `Autodiff<Ddp<Cuda>>`
//!
//! cudarc loads `libcuda` and `libnccl` when first used, so burn-ddp builds on machines without a
//! CUDA toolkit; every entry point here checks for the libraries first and turns their absence
//! into an error instead of cudarc's panic.

mod device;
pub(crate) mod grad;
mod library;
mod nccl;
mod status;
mod wait;

pub(crate) use device::ordinal_for;
pub use device::{context_for, device_count, driver_present, rank_device};
pub(crate) use library::usable_nccl;
pub use library::{nccl_present, nccl_version, NcclVersion};
pub use nccl::NcclComm;

/// The cudarc version burn-ddp uses (for [`NcclComm`]'s `CudaSlice` buffers).
pub use cudarc;
pub(crate) use status::driver_error as driver_error_for;
