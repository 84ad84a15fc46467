//! What Burn 0.22.1 does differently from 0.23, below the modules that use it (the split events,
//! a loader's counts, `SyncBatchNorm`'s backends, a fusion tensor's resolve): the crate's
//! `release` module when it is built with `burn-0-22` (`release/burn023.rs` with `burn-0-23`);
//! `progress/` has the progress-logger impls. Every other file of `src/` is one source for both
//! releases, and names these items instead of the release's differing APIs.

/// The features of this crate that give [`SyncBatchNorm`](crate::nn::SyncBatchNorm) a backend,
/// for its error when a tensor is on another.
pub(crate) const BACKEND_FEATURES: &str = "`flex`, `ndarray` or `cuda`";

/// The cubecl tensor that resolving a fusion tensor gave (burn-fusion 0.22's resolve cannot
/// fail), as the `cuda` module takes it.
#[cfg(feature = "cuda")]
pub(crate) fn fusion_resolved<T>(resolved: T) -> Result<T, String> {
    Ok(resolved)
}

#[cfg(feature = "train")]
pub(crate) use train::*;

/// burn-train 0.22: split events that carry a count of items, and progress loggers told
/// counts.
#[cfg(feature = "train")]
mod train {
    use burn::data::dataloader::Progress;
    use burn::train::LearnerEvent;

    /// A loader's progress: items processed, and the total (always known in 0.22).
    pub(crate) fn counts(p: &Progress) -> (usize, Option<usize>) {
        (p.items_processed, Some(p.items_total))
    }

    /// A progress of `done` items of `total` (this rank's count when the job's is unknown).
    pub(crate) fn progress(done: usize, total: Option<usize>, unit: Option<String>) -> Progress {
        Progress::new(done, total.unwrap_or(done), unit)
    }

    /// The event that starts a split of `total` items (every rank's) at `epoch`.
    pub(crate) fn start_split<T>(epoch: usize, total: usize) -> LearnerEvent<T> {
        LearnerEvent::StartSplit {
            epoch_number: epoch,
            total_items: total,
        }
    }

    /// The event that ends a split at `epoch`; 0.22's carries no progress, so `last` (the
    /// job's at the split's last step) and `completed` (whether the split ran to its end) go
    /// unused.
    pub(crate) fn end_split<T>(epoch: usize, last: Progress, completed: bool) -> LearnerEvent<T> {
        let _ = (last, completed);
        LearnerEvent::EndSplit(epoch)
    }
}

/// The calls that tell a progress logger of this release of a split's progress, for the
/// renderers' tests.
#[cfg(all(test, feature = "train"))]
pub(crate) mod testing {
    use burn::train::logger::TrainingProgressLogger;

    /// Starts a split of `total` items on `r`.
    pub(crate) fn start_split(r: &mut impl TrainingProgressLogger, split: &str, total: usize) {
        r.start_split(split, total);
    }

    /// Tells `r` that `processed` items of the split are done.
    pub(crate) fn update_split(r: &mut impl TrainingProgressLogger, processed: usize) {
        r.update_split(processed);
    }
}
