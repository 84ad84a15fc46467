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
