//! What Burn 0.23 does differently from 0.22, below the modules that use it (the split events,
//! a loader's counts, `SyncBatchNorm`'s backends, a fusion tensor's resolve): the crate's
//! `release` module when it is built with `burn-0-23` (`release/burn022.rs` with `burn-0-22`);
//! `progress/` has the progress-logger impls. Every other file of `src/` is one source for both
//! releases (see the crate's documentation).

/// The features of this crate that give [`SyncBatchNorm`](crate::nn::SyncBatchNorm) a backend,
/// for its error when a tensor is on another.
pub(crate) const BACKEND_FEATURES: &str = "`flex` or `cuda`";

/// The cubecl tensor that resolving a fusion tensor gave, or what failed in the fused work
/// that makes it (burn-fusion 0.23's resolve returns Burn's `ExecutionError`).
#[cfg(feature = "cuda")]
pub(crate) fn fusion_resolved<T, E: std::fmt::Debug>(resolved: Result<T, E>) -> Result<T, String> {
    resolved.map_err(|e| format!("{e:?}"))
}

#[cfg(feature = "train")]
pub(crate) use train::*;

/// burn-train 0.23: split events and progress loggers carry a [`Progress`] (items processed,
/// a total that may be unknown, a unit) instead of counts, and a split's end carries its last.
#[cfg(feature = "train")]
mod train {
    use burn::data::dataloader::Progress;
    use burn::train::LearnerEvent;

    /// A loader's progress: items processed, and the total when the loader knows it.
    pub(crate) fn counts(p: &Progress) -> (usize, Option<usize>) {
        (p.items_processed, p.total)
    }

    /// A progress of `done` items of `total`.
    pub(crate) fn progress(done: usize, total: Option<usize>, unit: Option<String>) -> Progress {
        Progress::new(done, total, unit)
    }

    /// The event that starts a split of `total` items (every rank's) at `epoch`.
    pub(crate) fn start_split<T>(epoch: usize, total: usize) -> LearnerEvent<T> {
        LearnerEvent::StartSplit {
            epoch_number: epoch,
            progress: Progress::new(0, total, None),
        }
    }

    /// The event that ends a split at `epoch` with `last`, the job's progress at its last step;
    /// a split that ran to its end (`completed`) resolves an unknown total to the count, as
    /// burn-train 0.23's own loops do.
    pub(crate) fn end_split<T>(
        epoch: usize,
        mut last: Progress,
        completed: bool,
    ) -> LearnerEvent<T> {
        if completed {
            last.resolve_total();
        }
        LearnerEvent::EndSplit {
            epoch,
            progress: last,
        }
    }
}

/// The calls that tell a progress logger of this release of a split's progress, for the
/// renderers' tests.
#[cfg(all(test, feature = "train"))]
pub(crate) mod testing {
    use burn::data::dataloader::Progress;
    use burn::train::logger::TrainingProgressLogger;

    /// Starts a split of `total` items on `r`.
    pub(crate) fn start_split(r: &mut impl TrainingProgressLogger, split: &str, total: usize) {
        r.start_split(split, &Progress::new(0, total, None));
    }

    /// Tells `r` that `processed` items of the split are done.
    pub(crate) fn update_split(r: &mut impl TrainingProgressLogger, processed: usize) {
        r.update_split(&Progress::new(processed, None, None));
    }
}
