//! [`DdpError`]: every way burn-ddp can fail, each message saying what happened, the values seen
//! (and on which rank), and what to change.

use std::io;
use std::net::SocketAddr;
use std::time::Duration;

use crate::types::{
    AbortRecord, CollectiveSeq, LocalRank, Rank, RankList, StallDiagnosis, WorldSize,
};
use crate::types::{CollectiveDesc, CollectiveOp};
use crate::wire::WireError;

/// `Result` with [`DdpError`].
pub type Result<T, E = DdpError> = std::result::Result<T, E>;

/// Every error burn-ddp reports. Messages start with the rank that saw the problem.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DdpError {
    // === Configuration ===
    /// A required environment variable is not set.
    #[error("environment variable {var} is not set. {hint}")]
    MissingEnv {
        /// The variable.
        var: &'static str,
        /// How to provide it.
        hint: &'static str,
    },

    /// A launcher's variables are present but do not describe a job this process can join
    /// (some of them missing, a batch script instead of its tasks, ranks on several hosts
    /// without `MASTER_ADDR`).
    #[error("{launcher}: {problem}. {fix}")]
    Launch {
        /// The launcher whose variables were read.
        launcher: &'static str,
        /// What is wrong, with the values seen.
        problem: String,
        /// How to launch instead.
        fix: String,
    },

    /// An environment variable holds a value that cannot be used.
    #[error("environment variable {var}={value:?} is invalid: expected {expected}")]
    InvalidEnv {
        /// The variable.
        var: &'static str,
        /// What it held.
        value: String,
        /// What it should hold.
        expected: &'static str,
    },

    /// The rank does not belong to the world.
    #[error(
        "rank {rank} is outside the world of {world} processes (valid ranks are 0..{world}). \
         Check RANK and WORLD_SIZE: every process must use the same WORLD_SIZE and a distinct RANK below it"
    )]
    RankOutOfRange {
        /// The rank given.
        rank: Rank,
        /// The world size given.
        world: WorldSize,
    },

    /// The local rank does not belong to the node.
    #[error(
        "[rank {rank}] LOCAL_RANK={local_rank} is outside LOCAL_WORLD_SIZE={local_world}. \
         Check the launcher's --nproc-per-node"
    )]
    LocalRankOutOfRange {
        /// The global rank.
        rank: Rank,
        /// The local rank given.
        local_rank: LocalRank,
        /// The node size given.
        local_world: WorldSize,
    },

    /// A configuration value is out of its valid range.
    #[error("invalid configuration: {field} {reason}")]
    InvalidConfig {
        /// The field.
        field: &'static str,
        /// What is wrong with it.
        reason: &'static str,
    },

    /// An option of a tool (the bandwidth tool's) is out of its valid range.
    #[error("invalid option {option}: {reason}")]
    InvalidOption {
        /// The option.
        option: &'static str,
        /// What is wrong with its value, and what is accepted.
        reason: String,
    },

    // === Rendezvous ===
    /// Rank 0 cannot serve the store because the port is taken.
    #[error(
        "[rank {rank}] cannot serve the rendezvous store on {addr}{origin}: the port is already \
         in use (another job, or an earlier run still shutting down). Pick another MASTER_PORT \
         (or `burn-ddp run --standalone`) or stop the other job"
    )]
    PortInUse {
        /// The rank (0).
        rank: Rank,
        /// The address it tried to bind.
        addr: SocketAddr,
        /// Where the port came from, when not `MASTER_PORT` itself (` (…)`, or empty).
        origin: String,
    },

    /// Rank 0 cannot bind the store address for another reason.
    #[error(
        "[rank {rank}] cannot serve the rendezvous store on {addr}: {source}. MASTER_ADDR must be \
         an address of rank 0's own machine"
    )]
    StoreBind {
        /// The rank (0).
        rank: Rank,
        /// The address it tried to bind.
        addr: SocketAddr,
        /// The OS error.
        source: io::Error,
    },

    /// `MASTER_ADDR` does not resolve.
    #[error("[rank {rank}] cannot resolve MASTER_ADDR {host:?}: {source}. Use an IP address or a host name every node can resolve")]
    MasterUnresolvable {
        /// This rank.
        rank: Rank,
        /// The host name.
        host: String,
        /// The resolver error.
        source: io::Error,
    },

    /// Nobody answered at the master address within the rendezvous deadline.
    #[error(
        "[rank {rank}] the rendezvous store at {addr} was unreachable for {waited:?} (last error: {last_error}). \
         Check that rank 0 is running, that MASTER_ADDR/MASTER_PORT point to it, and that no firewall \
         blocks the port; or raise the rendezvous timeout (BURN_DDP_RENDEZVOUS_TIMEOUT)"
    )]
    MasterUnreachable {
        /// This rank.
        rank: Rank,
        /// The master address.
        addr: String,
        /// How long it tried.
        waited: Duration,
        /// The last connection error.
        last_error: io::Error,
    },

    /// Not every rank joined within the rendezvous deadline.
    #[error(
        "[rank {rank}] rendezvous at {addr} timed out after {waited:?}: {joined}/{world} ranks joined, \
         missing {missing}{refused_note}. Check that every rank uses the same MASTER_ADDR/MASTER_PORT, \
         WORLD_SIZE and job token (BURN_DDP_JOB_TOKEN), or raise the rendezvous timeout"
    )]
    RendezvousTimeout {
        /// This rank.
        rank: Rank,
        /// The master address.
        addr: String,
        /// How long it waited.
        waited: Duration,
        /// How many ranks had joined.
        joined: usize,
        /// The expected world size.
        world: WorldSize,
        /// The ranks that never joined.
        missing: RankList,
        /// A note on refused connections, if any ("; 1 connection was refused ...").
        refused_note: String,
    },

    /// The peer does not share our job token.
    #[error(
        "[rank {rank}] {peer} refused the handshake: it does not hold this job's token. It belongs to \
         another job, or this process was started with a different BURN_DDP_JOB_TOKEN; start every rank \
         from the same launcher (or give them the same token)"
    )]
    TokenMismatch {
        /// This rank.
        rank: Rank,
        /// The peer.
        peer: SocketAddr,
    },

    /// The peer speaks another version of the protocol.
    #[error(
        "[rank {rank}] {peer} speaks burn-ddp protocol version {theirs}, this process speaks {ours}. \
         Build every rank from the same burn-ddp version"
    )]
    ProtocolMismatch {
        /// This rank.
        rank: Rank,
        /// The peer.
        peer: SocketAddr,
        /// Our version.
        ours: u8,
        /// Theirs.
        theirs: u8,
    },

    /// Ranks disagree on the world size.
    #[error(
        "[rank {rank}] WORLD_SIZE mismatch: rank {other} uses WORLD_SIZE={theirs}, this process uses {ours}. \
         Every process of a job must be started with the same WORLD_SIZE"
    )]
    WorldSizeMismatch {
        /// This rank.
        rank: Rank,
        /// The other rank.
        other: Rank,
        /// Our world size.
        ours: WorldSize,
        /// Theirs.
        theirs: WorldSize,
    },

    /// Two processes claimed the same rank.
    #[error(
        "[rank {rank}] rank {claimed} was claimed by two processes ({first} and {second}). \
         Give every process a distinct RANK (and check that two jobs do not share MASTER_PORT)"
    )]
    DuplicateRank {
        /// This rank.
        rank: Rank,
        /// The rank claimed twice.
        claimed: Rank,
        /// Address of the first claimant.
        first: SocketAddr,
        /// Address of the second claimant.
        second: SocketAddr,
    },

    /// A store request did not complete in time.
    #[error("[rank {rank}] store {op} of key {key:?} timed out after {waited:?}. Some rank did not publish it; raise the store timeout if that rank is just slow")]
    StoreTimeout {
        /// This rank.
        rank: Rank,
        /// The store operation.
        op: &'static str,
        /// The key.
        key: String,
        /// How long it waited.
        waited: Duration,
    },

    /// A peer's published transport address does not answer.
    #[error(
        "[rank {rank}] cannot connect to rank {peer} at {addr} (last error: {last_error}) after {waited:?}. \
         Check that the ranks can reach each other on that interface (firewalls, BURN_DDP_SOCKET_IFADDR)"
    )]
    PeerUnreachable {
        /// This rank.
        rank: Rank,
        /// The peer.
        peer: Rank,
        /// The address it published.
        addr: SocketAddr,
        /// How long this rank tried.
        waited: Duration,
        /// The last connection error.
        last_error: io::Error,
    },

    /// The connection to the store broke.
    #[error(
        "[rank {rank}] lost the connection to the rendezvous store at {addr} ({source}): rank 0, which \
         hosts it, has exited or crashed. See rank 0's output for the cause"
    )]
    StoreLost {
        /// This rank.
        rank: Rank,
        /// The store address.
        addr: SocketAddr,
        /// The I/O error.
        source: io::Error,
    },

    /// A peer sent bytes that are not a valid frame.
    #[error("[rank {rank}] {peer} sent a malformed frame: {error}")]
    Protocol {
        /// This rank.
        rank: Rank,
        /// The peer.
        peer: SocketAddr,
        /// What was wrong.
        error: WireError,
    },

    /// The store refused a request for a reason it gave.
    #[error("[rank {rank}] the store refused the request: {reason}")]
    StoreRefused {
        /// This rank.
        rank: Rank,
        /// The store's explanation.
        reason: String,
    },

    /// The store could not carry out one request; the connection and the job go on.
    #[error("[rank {rank}] store `{op}` on key {key:?} failed: {reason}")]
    StoreRequest {
        /// This rank.
        rank: Rank,
        /// The request.
        op: &'static str,
        /// The key.
        key: String,
        /// Why.
        reason: String,
    },

    // === Collectives ===
    /// A neighbour closed its connection in the middle of a collective.
    #[error(
        "[rank {rank}] rank {peer} closed its connection during {op} {seq} ({cause}): it exited or crashed. \
         See rank {peer}'s output for the cause"
    )]
    PeerLost {
        /// This rank.
        rank: Rank,
        /// The rank that disappeared.
        peer: Rank,
        /// The collective in progress.
        op: CollectiveOp,
        /// Its sequence number.
        seq: CollectiveSeq,
        /// What the socket reported.
        cause: io::ErrorKind,
    },

    /// A neighbour finished normally (its process group was dropped without an error) while
    /// this rank still ran collectives: the ranks made different numbers of calls, typically
    /// because they had different numbers of batches.
    #[error(
        "[rank {rank}] rank {peer} ended normally (no panic, no failure reported) and left the \
         job while this rank was in {op} {seq}: the ranks ran different numbers of steps (see \
         rank {peer}'s output if it stopped on an error of its own). With uneven inputs (ranks with different \
         numbers of batches), train inside `GradSync::join` (Burn 0.22) or `DdpSession::join` \
         (Burn 0.21); otherwise give every rank the same number of steps (DistributedSampler \
         gives every rank the same number of batches)"
    )]
    PeerFinished {
        /// This rank.
        rank: Rank,
        /// The rank that finished.
        peer: Rank,
        /// The collective in progress.
        op: CollectiveOp,
        /// Its sequence number.
        seq: CollectiveSeq,
    },

    /// Another rank reported a failure and aborted the job.
    #[error("[rank {rank}] {}the job was aborted: {record}", during_prefix(.during))]
    JobAborted {
        /// This rank.
        rank: Rank,
        /// The collective this rank was in when it learnt of the abort, if any.
        during: Option<(CollectiveOp, CollectiveSeq)>,
        /// What the first failing rank reported.
        record: AbortRecord,
    },

    /// A collective did not complete within its deadline.
    #[error(
        "[rank {rank}] {op} {seq} timed out after {waited:?}: {diagnosis}. Every rank must call the \
         same collectives in the same order; if the stalled rank is just slow (data loading, a \
         long validation), raise the collective timeout (BURN_DDP_COLLECTIVE_TIMEOUT)"
    )]
    CollectiveTimeout {
        /// This rank.
        rank: Rank,
        /// The collective.
        op: CollectiveOp,
        /// Its sequence number.
        seq: CollectiveSeq,
        /// How long it waited.
        waited: Duration,
        /// Which ranks were found stalled (or which neighbour this rank waited on).
        diagnosis: StallDiagnosis,
    },

    /// Two ranks called different collectives at the same point of the sequence.
    #[error(
        "[rank {rank}] collective mismatch at {seq}: this rank called {ours}, rank {peer} called {theirs} \
         (at its {their_seq}). Every rank must call the same collectives, with the same sizes and types, \
         in the same order"
    )]
    CollectiveMismatch {
        /// This rank.
        rank: Rank,
        /// The other rank.
        peer: Rank,
        /// Our sequence number.
        seq: CollectiveSeq,
        /// Theirs.
        their_seq: CollectiveSeq,
        /// What we called.
        ours: CollectiveDesc,
        /// What they called.
        theirs: CollectiveDesc,
    },

    /// A buffer passed to a collective has the wrong length.
    #[error("[rank {rank}] {op}: {what} has {got} elements, expected {expected}")]
    BufferSize {
        /// This rank.
        rank: Rank,
        /// The collective.
        op: CollectiveOp,
        /// Which buffer.
        what: &'static str,
        /// Expected length.
        expected: usize,
        /// Actual length.
        got: usize,
    },

    /// The root of a broadcast is not a rank of the group.
    #[error("[rank {rank}] broadcast root {root} is outside the world of {world}")]
    InvalidRoot {
        /// This rank.
        rank: Rank,
        /// The root given.
        root: Rank,
        /// The world size.
        world: WorldSize,
    },

    /// A sub-group or point-to-point call got an argument that cannot work.
    #[error("[rank {rank}] {what}: {reason}")]
    InvalidGroupCall {
        /// This rank.
        rank: Rank,
        /// The call (`new_group`, `send`, ...).
        what: &'static str,
        /// What is wrong, and what is accepted.
        reason: String,
    },

    /// A point-to-point receive waited past its deadline for a message that never came.
    #[error(
        "[rank {rank}] recv from rank {peer} (tag {tag}) got nothing within {waited:?}: rank {peer} \
         is alive but never sent it. Every recv needs a matching send with the same tag (check \
         that both ranks run the same schedule); raise BURN_DDP_COLLECTIVE_TIMEOUT if the sender \
         is only slow"
    )]
    P2pTimeout {
        /// This rank.
        rank: Rank,
        /// The rank that should have sent.
        peer: Rank,
        /// The tag waited for.
        tag: u32,
        /// How long this rank waited.
        waited: std::time::Duration,
    },

    /// A point-to-point message did not fit the receiver's buffer.
    #[error(
        "[rank {rank}] recv from rank {peer} (tag {tag}): the message is {theirs}, the receive \
         buffer {ours}. The sender and the receiver disagree on the tensor's shape or element \
         type"
    )]
    P2pMismatch {
        /// This rank.
        rank: Rank,
        /// The sender.
        peer: Rank,
        /// The message's tag.
        tag: u32,
        /// The receive buffer (bytes and element type).
        ours: String,
        /// The message (bytes and element type).
        theirs: String,
    },

    /// A failure in a sub-group (`ProcessGroup::new_group`, `ProcessGroup::split`): the group,
    /// this rank's place in it, and the failure (whose ranks are the job's global ranks).
    #[error("[group {group}, group rank {group_rank}] {inner}")]
    InGroup {
        /// The group: its name and its members' global ranks.
        group: String,
        /// This rank's rank in the group.
        group_rank: Rank,
        /// The failure, naming global ranks.
        inner: Box<DdpError>,
    },

    /// An earlier failure left the group unusable.
    #[error("[rank {rank}] the process group is unusable after an earlier failure: {first}")]
    GroupAborted {
        /// This rank.
        rank: Rank,
        /// The first failure.
        first: Box<AbortRecord>,
    },

    /// Something was used before it was set up.
    #[error("{what} is not set up: {fix}")]
    NotInitialized {
        /// What was used.
        what: &'static str,
        /// What sets it up.
        fix: &'static str,
    },

    /// A thread that this rank's collectives depend on (the gradient communication thread, the
    /// NCCL launcher) is gone: an earlier error ended it, or it panicked.
    #[error("[rank {rank}] {what} has stopped, so this step cannot finish: an earlier error ended it (the first error this rank reported says which) or it panicked. The group cannot continue: let the job end, and restart it (burn-ddp run --max-restarts)")]
    WorkerStopped {
        /// This rank.
        rank: Rank,
        /// The thread (`the gradient communication thread`).
        what: &'static str,
    },

    /// An invariant of burn-ddp itself does not hold: a bug.
    #[error("[rank {rank}] internal error in burn-ddp: {what}. Please report it, with the output of every rank")]
    Internal {
        /// This rank.
        rank: Rank,
        /// What did not hold.
        what: &'static str,
    },

    /// The NCCL library could not be loaded (the `cuda` feature loads it at run time).
    #[error("NCCL is not available: {detail}")]
    NcclUnavailable {
        /// What was tried, and what to install or link.
        detail: String,
    },

    /// The CUDA driver failed or is missing.
    #[error("[rank {rank}] CUDA: {what} failed: {detail}")]
    Cuda {
        /// This rank.
        rank: Rank,
        /// The call that failed.
        what: String,
        /// The driver's error, and what to check.
        detail: String,
    },

    /// This process's local rank has no GPU.
    #[error("[rank {rank}] no GPU for local rank {local_rank}: this node shows {count} CUDA device(s){visible}. Start at most {count} rank(s) per node (`--nproc-per-node {count}`), or give each rank its own GPU through CUDA_VISIBLE_DEVICES")]
    NoGpuForRank {
        /// This rank.
        rank: Rank,
        /// Its local rank (the GPU it would use).
        local_rank: LocalRank,
        /// Devices visible to this process.
        count: usize,
        /// `" (CUDA_VISIBLE_DEVICES=...)"` when set.
        visible: String,
    },

    /// The GPU that holds this rank's tensors is not the GPU its `LOCAL_RANK` names, or gradients
    /// arrived on another GPU than the one NCCL was set up on.
    #[error("[rank {rank}] {what} are on GPU {found}, but {expected_why}: NCCL would read memory of another device. Build the model on this rank's GPU (`burn_ddp::cuda::rank_device(&group)` gives it), or give each process one GPU through CUDA_VISIBLE_DEVICES")]
    DeviceMismatch {
        /// This rank.
        rank: Rank,
        /// What was found where (`the model's parameters`, `the gradients of this backward`).
        what: &'static str,
        /// The GPU (ordinal among the visible devices) it is on.
        found: usize,
        /// Which GPU was expected, and why (`LOCAL_RANK 1 means GPU 1 of the 2 this process sees`).
        expected_why: String,
    },

    /// An NCCL call failed.
    #[error("[rank {rank}] NCCL {call} failed: {code}{detail}. {hint}")]
    Nccl {
        /// This rank.
        rank: Rank,
        /// The NCCL call and what it was doing (`ncclAllReduce (all_reduce #12, 4096 x float)`).
        call: String,
        /// The `ncclResult_t` NCCL returned: its name and NCCL's text for it.
        code: String,
        /// `ncclGetLastError`'s message, when NCCL gave one (starts with ": ").
        detail: String,
        /// What usually causes it and what to do.
        hint: &'static str,
    },

    /// The loaded NCCL cannot run a collective as asked (an operation or element type it does
    /// not support).
    #[error("[rank {rank}] NCCL cannot run {what}: {reason}")]
    NcclUnsupported {
        /// This rank.
        rank: Rank,
        /// The collective (`all_reduce #3 (mean of bfloat16)`).
        what: String,
        /// Why, and what would work.
        reason: String,
    },

    /// Rank 0's NCCL unique id arrived with the wrong size.
    #[error("[rank {rank}] rank 0's NCCL unique id has {len} bytes, not 128: every rank must run the same burn-ddp version")]
    NcclIdMalformed {
        /// This rank.
        rank: Rank,
        /// The size that arrived.
        len: usize,
    },

    /// An NCCL operation did not complete in time; the communicator was aborted.
    #[error("[rank {rank}] NCCL {what} did not complete within {waited:?}; the communicator was aborted (ncclCommAbort) so that nothing waits forever. A rank that died or stalls, or ranks that call different collectives, cause this: look at the other ranks' output, and run with BURN_DDP_DEBUG_DESYNC=1 to compare the calls. Raise BURN_DDP_COLLECTIVE_TIMEOUT if the work is only slow")]
    NcclTimeout {
        /// This rank.
        rank: Rank,
        /// The operation (`all_reduce #12`, `communicator creation`).
        what: String,
        /// The deadline.
        waited: Duration,
    },

    /// The ranks' models differ: a parameter's name, shape or dtype is not the same everywhere.
    #[error("[rank {rank}] the model differs between ranks at parameter {index} `{param}`: {detail}. Every rank must build the same model (same layer sizes, same order of fields)")]
    ModelMismatch {
        /// This rank.
        rank: Rank,
        /// Position of the first mismatching parameter in visit order.
        index: usize,
        /// Its name on rank 0.
        param: String,
        /// What differs, and on which ranks.
        detail: String,
    },

    /// The ranks' parameters are no longer the same: some rank updated its replica
    /// differently (see [`DdpConfig::check_replicas_every`](crate::DdpConfig)).
    #[error("[rank {rank}] the replicas differ at synchronised step {step}: parameter {index} `{param}` {detail}. Every rank must apply the same averaged gradients: look for a parameter changed on some ranks only (a rank-local update, a gradient left out of the optimizer step), or non-deterministic operations on weights")]
    ReplicasDiverged {
        /// This rank.
        rank: Rank,
        /// The synchronised step the check ran at (1 = the first).
        step: u64,
        /// Position of the first differing parameter in visit order.
        index: usize,
        /// Its name.
        param: String,
        /// Which ranks hold which digest.
        detail: String,
    },

    /// The gradient communication thread did not answer in time.
    #[error("[rank {rank}] gradient synchronisation got no answer within {waited:?} (the communication thread is stuck)")]
    GradSyncTimeout {
        /// This rank.
        rank: Rank,
        /// How long it waited.
        waited: Duration,
    },

    /// A gradient's size is not its parameter's (a custom op or backend produced a gradient of
    /// the wrong shape).
    #[error("[rank {rank}] the gradient of `{param}` has {got} elements, but the parameter has {expected}: the operation that produced it returned a gradient of the wrong shape")]
    GradientSize {
        /// This rank.
        rank: Rank,
        /// The parameter's name.
        param: String,
        /// The parameter's element count.
        expected: usize,
        /// The gradient's element count.
        got: usize,
    },

    /// A model's parameters could not be read, written or (de)serialised.
    #[error("[rank {rank}] {what}: {reason}")]
    Model {
        /// This rank.
        rank: Rank,
        /// What was being done.
        what: &'static str,
        /// Why it failed.
        reason: String,
    },

    /// `BURN_DDP_DEBUG_DESYNC`: the ranks were about to call different collectives.
    #[error("[rank {rank}] collectives out of step at call {call} (BURN_DDP_DEBUG_DESYNC): this rank calls {ours}; rank {peer} calls {theirs}. Every rank must call the same collectives in the same order")]
    Desync {
        /// This rank.
        rank: Rank,
        /// The checked call on this rank (`#1` = the first collective).
        call: CollectiveSeq,
        /// What this rank calls, and from where.
        ours: String,
        /// The rank compared with.
        peer: Rank,
        /// What it calls, and from where.
        theirs: String,
    },

    /// The heartbeat watcher found a rank dead, frozen or stuck while this rank waited in a
    /// collective (long before the collective timeout).
    #[error("[rank {rank}] {op} {seq}: rank {culprit} (host {host}) {what}; its last completed collective was {last_completed}")]
    RankUnresponsive {
        /// This rank.
        rank: Rank,
        /// The rank at fault.
        culprit: Rank,
        /// Its host, as it reported it.
        host: String,
        /// The last collective it completed.
        last_completed: CollectiveSeq,
        /// The collective this rank waited in.
        op: CollectiveOp,
        /// Its sequence number.
        seq: CollectiveSeq,
        /// What was seen.
        what: String,
    },

    /// Training under burn-ddp's `DdpStrategy` stopped because a rank failed
    /// (a data error, a panic in a training step, a lost peer): every rank reports the rank at
    /// fault.
    #[error("[rank {rank}] training stopped: rank {culprit} failed: {reason}")]
    TrainingFailed {
        /// This rank.
        rank: Rank,
        /// The rank that failed.
        culprit: Rank,
        /// What went wrong there.
        reason: String,
    },

    // === Launcher ===
    /// A rank process could not be started.
    #[error("cannot start rank {rank} ({program}): {source}")]
    Spawn {
        /// The rank.
        rank: Rank,
        /// The program.
        program: String,
        /// The OS error.
        source: io::Error,
    },

    /// A rank process failed.
    #[error("rank {rank} (pid {pid}) {status}; the other ranks were stopped")]
    RankFailed {
        /// The rank.
        rank: Rank,
        /// Its process id.
        pid: u32,
        /// How it ended ("exited with status 3", "was killed by signal 9 (SIGKILL)").
        status: String,
    },

    /// Reading or writing a checkpoint file failed.
    #[error("checkpoint {}: {what} failed: {source}", path.display())]
    CheckpointIo {
        /// The file.
        path: std::path::PathBuf,
        /// The step that failed (`writing`, `renaming into place`).
        what: &'static str,
        /// The operating system's error.
        source: io::Error,
    },

    /// A checkpoint could not be made or used (serialising, or a file that is not a record of
    /// this model).
    #[error("checkpoint {path}: {what} failed: {reason}")]
    Checkpoint {
        /// The file.
        path: String,
        /// The step that failed.
        what: &'static str,
        /// Why.
        reason: String,
    },

    /// The function a rank ran under [`spawn`](crate::launch::spawn()) returned an error.
    #[error("rank {rank} failed: {source}")]
    RankError {
        /// The rank.
        rank: Rank,
        /// The function's error.
        source: Box<dyn std::error::Error + Send + Sync>,
    },

    /// The launcher was asked to stop (SIGINT/SIGTERM/SIGHUP) and stopped every rank.
    #[error("interrupted: every rank was stopped")]
    Interrupted,

    /// The elastic rendezvous of `burn-ddp run --nnodes MIN:MAX` could not form or keep a
    /// job: too few nodes came, the nodes disagree on their settings, the rendezvous host was
    /// lost, or the job used up its restarts.
    #[error("elastic rendezvous at {addr}: {reason}")]
    Elastic {
        /// The rendezvous endpoint.
        addr: String,
        /// What went wrong, and what to do about it.
        reason: String,
    },

    // === Fault-tolerant jobs ===
    /// This process was left out of a fault-tolerant job's new membership: the other ranks
    /// agreed without it (it was named as the cause of the failure, or it was too slow to
    /// answer). It may join again ([`ProcessGroup::rejoin`](crate::ProcessGroup::rejoin):
    /// `DdpStrategy` does).
    #[error(
        "[member {member}] this process was left out of the job's membership epoch {epoch} \
         (ranks {members:?} go on without it): {why}"
    )]
    Excluded {
        /// This process's member id.
        member: u32,
        /// The membership it is not in.
        epoch: u64,
        /// The members that go on.
        members: Vec<u32>,
        /// Why, as far as this process can tell.
        why: String,
    },

    /// Too few ranks are left in a fault-tolerant job to go on, and not enough joined in
    /// time.
    #[error(
        "[member {member}] the job cannot go on: {have} rank(s) left after {why}, fewer than \
         the {min} it needs (BURN_DDP_MIN_RANKS), and not enough processes joined within \
         {waited:?}. Start replacements (burn-ddp run --fault-tolerant --max-restarts, or \
         `burn-ddp run --fault-tolerant --join`), or lower the minimum"
    )]
    TooFewRanks {
        /// This process's member id.
        member: u32,
        /// Ranks that were left.
        have: usize,
        /// The minimum.
        min: u32,
        /// What ended the last membership.
        why: String,
        /// How long the survivors waited.
        waited: Duration,
    },

    /// A process of a fault-tolerant job lost the job's store (its link is down, or the
    /// launcher that serves the store is gone): it cannot take part in any membership.
    #[error(
        "[member {member}] cannot reach the job's store at {addr} (node 0's launcher serves it): \
         this process is cut off from the job, which goes on without it ({reason}). When its \
         network is back, a replacement can join the running job (burn-ddp run --fault-tolerant \
         --join, or --max-restarts)"
    )]
    StoreUnreachable {
        /// This process's member id.
        member: u32,
        /// The store's address.
        addr: String,
        /// The store request that failed.
        reason: String,
    },

    /// A process that asked to join a running fault-tolerant job was not admitted.
    #[error("[member {member}] could not join the running job within {waited:?}: {why}")]
    JoinFailed {
        /// This process's member id.
        member: u32,
        /// How long it waited.
        waited: Duration,
        /// What it saw.
        why: String,
    },

    /// A node of a fault-tolerant job failed: a rank of the job's last membership failed, every
    /// rank of the node was lost, or the node lost the job's store.
    #[error("fault-tolerant job: {reason}")]
    FaultTolerantJob {
        /// What happened to the node's ranks.
        reason: String,
    },

    /// A feature that a fault-tolerant job cannot offer (its state would not survive a change
    /// of membership).
    #[error("{what} is not available in a fault-tolerant job: {reason}")]
    NotFaultTolerant {
        /// The feature.
        what: &'static str,
        /// Why, and what to use instead.
        reason: &'static str,
    },

    /// An I/O error outside the cases above.
    #[error(transparent)]
    Io(#[from] io::Error),
}

impl DdpError {
    /// A gradient bucket that the device paths (both Burn lines) cannot hand to NCCL: a buffer
    /// that is not contiguous, of the wrong size or type, or without a device pointer.
    pub fn bucket_layout(rank: Rank, reason: String) -> Self {
        DdpError::Model {
            rank,
            what: "handing a gradient bucket to NCCL",
            reason,
        }
    }

    /// The rank that reported this error, when it names one.
    pub fn rank(&self) -> Option<Rank> {
        use DdpError::*;
        match self {
            RankOutOfRange { rank, .. }
            | LocalRankOutOfRange { rank, .. }
            | PortInUse { rank, .. }
            | StoreBind { rank, .. }
            | MasterUnresolvable { rank, .. }
            | MasterUnreachable { rank, .. }
            | RendezvousTimeout { rank, .. }
            | TokenMismatch { rank, .. }
            | ProtocolMismatch { rank, .. }
            | WorldSizeMismatch { rank, .. }
            | DuplicateRank { rank, .. }
            | StoreTimeout { rank, .. }
            | StoreLost { rank, .. }
            | PeerUnreachable { rank, .. }
            | Protocol { rank, .. }
            | StoreRefused { rank, .. }
            | StoreRequest { rank, .. }
            | ModelMismatch { rank, .. }
            | GradSyncTimeout { rank, .. }
            | ReplicasDiverged { rank, .. }
            | Model { rank, .. }
            | GradientSize { rank, .. }
            | WorkerStopped { rank, .. }
            | Internal { rank, .. }
            | NcclUnsupported { rank, .. }
            | NcclIdMalformed { rank, .. }
            | TrainingFailed { rank, .. }
            | RankUnresponsive { rank, .. }
            | Desync { rank, .. }
            | PeerLost { rank, .. }
            | PeerFinished { rank, .. }
            | JobAborted { rank, .. }
            | CollectiveTimeout { rank, .. }
            | CollectiveMismatch { rank, .. }
            | BufferSize { rank, .. }
            | InvalidRoot { rank, .. }
            | GroupAborted { rank, .. }
            | Spawn { rank, .. }
            | RankFailed { rank, .. }
            | RankError { rank, .. }
            | Cuda { rank, .. }
            | NoGpuForRank { rank, .. }
            | DeviceMismatch { rank, .. }
            | Nccl { rank, .. }
            | NcclTimeout { rank, .. }
            | P2pTimeout { rank, .. }
            | InvalidGroupCall { rank, .. }
            | P2pMismatch { rank, .. } => Some(*rank),
            InGroup { inner, .. } => inner.rank(),
            _ => None,
        }
    }
}

impl DdpError {
    /// Whether this error says that the group failed around this rank (a rank died, froze,
    /// was cut off or stopped the group; a collective or the store did not answer in time)
    /// rather than that this rank's own call was wrong: what a fault-tolerant job recovers
    /// from by agreeing on a new membership ([`ProcessGroup::recover`](crate::ProcessGroup::recover)).
    /// Configuration errors, mismatched models or collectives, and bad arguments are not.
    pub fn is_peer_failure(&self) -> bool {
        use DdpError::*;
        match self {
            PeerLost { .. }
            | PeerUnreachable { .. }
            | JobAborted { .. }
            | CollectiveTimeout { .. }
            | GroupAborted { .. }
            | RankUnresponsive { .. }
            | P2pTimeout { .. }
            | StoreTimeout { .. }
            | StoreLost { .. }
            | GradSyncTimeout { .. }
            | WorkerStopped { .. }
            | Nccl { .. }
            | NcclTimeout { .. }
            | RendezvousTimeout { .. }
            | Io(_) => true,
            InGroup { inner, .. } => inner.is_peer_failure(),
            _ => false,
        }
    }

    /// The rank this error blames, when it names one other than the reporter (a rank that
    /// died, froze or did not answer).
    pub fn culprit(&self) -> Option<Rank> {
        use DdpError::*;
        match self {
            PeerLost { peer, .. } | PeerUnreachable { peer, .. } | P2pTimeout { peer, .. } => {
                Some(*peer)
            }
            RankUnresponsive { culprit, .. } => Some(*culprit),
            RendezvousTimeout { missing, .. } => missing.0.first().copied(),
            JobAborted { record, .. } => record.culprit,
            CollectiveTimeout { diagnosis, .. } => Some(diagnosis.culprit()),
            InGroup { inner, .. } => inner.culprit(),
            _ => None,
        }
    }
}

fn during_prefix(during: &Option<(CollectiveOp, CollectiveSeq)>) -> String {
    match during {
        Some((op, seq)) => format!("{op} {seq} stopped: "),
        None => String::new(),
    }
}
