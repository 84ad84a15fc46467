// What the Burn lines that share this crate's sources export at their root, included by each
// line's `lib.rs` (an included file has no inner docs of its own).

pub use burn_ddp_comm::data::{surviving, DataEpoch};
pub use burn_ddp_comm::{comm, config, grad, group, launch, types};
pub use burn_ddp_comm::{
    grad::{LoopState, PowerSgd},
    spawn, CollectiveError, Compression, ConfigError, CudaError, DdpConfig, DdpError,
    GradReduction, GroupConfig, JobError, JobToken, MasterAddr, MembershipError, ModelError,
    ParamInfo, ProcessGroup, Rank, ReduceOp, RendezvousError, Result, Timeouts, WorldSize,
};
pub use data::DistributedSampler;
pub use sync::GradSync;
pub use zero::ZeroOptimizer;
