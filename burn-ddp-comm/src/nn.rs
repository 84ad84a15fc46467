//! What the lines' layers share without Burn: the configuration of `SyncBatchNorm`, written
//! once by [`sync_batch_norm_config!`](crate::sync_batch_norm_config) and derived with each
//! line's own Burn.

/// A Burn line's `SyncBatchNormConfig`: Burn's `BatchNormConfig` fields (`num_features`,
/// `epsilon` 1e-5, `momentum` 0.1) under the calling crate's `#[derive(Config)]` (Burn's
/// `Config` must be in scope where it is called), so that every line's layer is configured
/// alike. The line writes its `init`, which builds its release's layer.
///
/// ```ignore
/// use burn::config::Config;
///
/// burn_ddp_comm::sync_batch_norm_config! {
///     /// (the line's documentation)
///     pub struct SyncBatchNormConfig
/// }
/// ```
#[macro_export]
macro_rules! sync_batch_norm_config {
    ($(#[$meta:meta])* $vis:vis struct $name:ident) => {
        $(#[$meta])*
        #[derive(Config, Debug)]
        $vis struct $name {
            /// The number of features (channels).
            pub num_features: usize,
            /// A value required for numerical stability. Default: 1e-5
            #[config(default = 1e-5)]
            pub epsilon: f64,
            /// Momentum used to update the running statistics. Default: 0.1
            #[config(default = 0.1)]
            pub momentum: f64,
        }
    };
}

/// Whether this process made a layer whose forward pass runs collectives.
static COLLECTIVE_LAYERS: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Records that this process made a layer whose forward pass runs collectives (each line's
/// `SyncBatchNorm`). A rank with no batch cannot take part in such a forward pass, so a
/// fault-tolerant job then keeps even (padded) training shards after a change of membership
/// instead of a partial last step ([`collective_layers`]).
pub fn made_collective_layer() {
    COLLECTIVE_LAYERS.store(true, std::sync::atomic::Ordering::Relaxed);
}

/// Whether this process made a layer whose forward pass runs collectives
/// ([`made_collective_layer`]).
pub fn collective_layers() -> bool {
    COLLECTIVE_LAYERS.load(std::sync::atomic::Ordering::Relaxed)
}
