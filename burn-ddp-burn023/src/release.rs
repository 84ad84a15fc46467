//! What Burn 0.23 does differently from 0.22: the one file of this crate's Burn glue that is its
//! own (every other file is burn-ddp-burn022's, compiled against Burn 0.23; see the crate's
//! documentation). burn-ddp-burn022's `release.rs` has the same items for 0.22.

/// The features of this crate that give [`SyncBatchNorm`](crate::nn::SyncBatchNorm) a backend,
/// for its error when a tensor is on another.
pub(crate) const BACKEND_FEATURES: &str = "`flex`";

#[cfg(feature = "train")]
pub(crate) use train::*;

/// burn-train 0.23: split events and progress loggers carry a [`Progress`] (items processed,
/// a total that may be unknown, a unit) instead of counts, and a split's end carries its last.
#[cfg(feature = "train")]
mod train {
    use burn::data::dataloader::Progress;
    use burn::train::logger::{EvaluationProgressLogger, TrainingProgressLogger};
    use burn::train::renderer::MetricsRenderer;
    use burn::train::LearnerEvent;

    use crate::train::{Headless, ProgressLines, WithMembership};

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

    impl TrainingProgressLogger for Headless {
        fn start(&mut self, _epochs: usize, _start: usize, _items: Option<usize>, _: Option<&str>) {
        }
        fn update_epoch(&mut self, _epoch: usize) {}
        fn start_split(&mut self, _split: &str, _progress: &Progress) {}
        fn update_split(&mut self, _progress: &Progress) {}
        fn end_split(&mut self, _progress: &Progress) {}
        fn end(&mut self) {}
        fn log_event_training(&mut self, _event: String) {}
    }

    impl EvaluationProgressLogger for Headless {
        fn start_global_progress(&mut self, _total_tests: usize) {}
        fn start_test(&mut self, _name: &str, _progress: &Progress) {}
        fn update_test_progress(&mut self, _progress: &Progress) {}
        fn end_test(&mut self, _progress: &Progress) {}
        fn end_global_progress(&mut self) {}
        fn log_event_evaluation(&mut self, _event: String) {}
    }

    impl TrainingProgressLogger for ProgressLines {
        fn start(&mut self, epochs: usize, start: usize, _items: Option<usize>, _: Option<&str>) {
            self.start_training(epochs, start);
        }
        fn update_epoch(&mut self, epoch: usize) {
            self.at_epoch(epoch);
        }
        fn start_split(&mut self, split: &str, progress: &Progress) {
            self.begin_split(split, progress.total.unwrap_or(0));
        }
        fn update_split(&mut self, progress: &Progress) {
            self.progress(progress.items_processed, progress.total);
        }
        fn end_split(&mut self, _progress: &Progress) {}
        fn end(&mut self) {}
        fn log_event_training(&mut self, _event: String) {}
    }

    impl EvaluationProgressLogger for ProgressLines {
        fn start_global_progress(&mut self, _total_tests: usize) {}
        fn start_test(&mut self, name: &str, progress: &Progress) {
            self.begin_test(name, progress.total.unwrap_or(0));
        }
        fn update_test_progress(&mut self, progress: &Progress) {
            self.progress(progress.items_processed, progress.total);
        }
        fn end_test(&mut self, _progress: &Progress) {}
        fn end_global_progress(&mut self) {}
        fn log_event_evaluation(&mut self, _event: String) {}
    }

    impl<R: MetricsRenderer> TrainingProgressLogger for WithMembership<R> {
        fn start(
            &mut self,
            epochs: usize,
            start: usize,
            items: Option<usize>,
            label: Option<&str>,
        ) {
            self.inner.start(epochs, start, items, label);
        }
        fn update_epoch(&mut self, epoch: usize) {
            self.inner.update_epoch(epoch);
        }
        fn start_split(&mut self, split: &str, progress: &Progress) {
            self.begin_split(split);
            self.inner.start_split(split, progress);
        }
        fn update_split(&mut self, progress: &Progress) {
            self.step();
            self.inner.update_split(progress);
        }
        fn end_split(&mut self, progress: &Progress) {
            self.inner.end_split(progress);
        }
        fn end(&mut self) {
            self.inner.end();
        }
        fn log_event_training(&mut self, event: String) {
            self.inner.log_event_training(event);
        }
    }

    impl<R: MetricsRenderer> EvaluationProgressLogger for WithMembership<R> {
        fn start_global_progress(&mut self, total_tests: usize) {
            self.inner.start_global_progress(total_tests);
        }
        fn start_test(&mut self, name: &str, progress: &Progress) {
            self.begin_test();
            self.inner.start_test(name, progress);
        }
        fn update_test_progress(&mut self, progress: &Progress) {
            self.inner.update_test_progress(progress);
        }
        fn end_test(&mut self, progress: &Progress) {
            self.inner.end_test(progress);
        }
        fn end_global_progress(&mut self) {
            self.inner.end_global_progress();
        }
        fn log_event_evaluation(&mut self, event: String) {
            self.inner.log_event_evaluation(event);
        }
    }
}

/// The renderers' tests' recorder as a progress logger of this release, and the calls that tell
/// a logger of a split's progress.
#[cfg(all(test, feature = "train"))]
pub(crate) mod testing {
    use burn::data::dataloader::Progress;
    use burn::train::logger::{EvaluationProgressLogger, TrainingProgressLogger};

    pub(crate) use crate::train::render_tests::Recorder;

    /// Starts a split of `total` items on `r`.
    pub(crate) fn start_split(r: &mut impl TrainingProgressLogger, split: &str, total: usize) {
        r.start_split(split, &Progress::new(0, total, None));
    }

    /// Tells `r` that `processed` items of the split are done.
    pub(crate) fn update_split(r: &mut impl TrainingProgressLogger, processed: usize) {
        r.update_split(&Progress::new(processed, None, None));
    }

    impl TrainingProgressLogger for Recorder {
        fn start(&mut self, _: usize, _: usize, _: Option<usize>, _: Option<&str>) {}
        fn update_epoch(&mut self, _epoch: usize) {}
        fn start_split(&mut self, split: &str, _progress: &Progress) {
            self.0.push(format!("split {split}"));
        }
        fn update_split(&mut self, progress: &Progress) {
            self.0.push(format!("step {}", progress.items_processed));
        }
        fn end_split(&mut self, _progress: &Progress) {}
        fn end(&mut self) {}
        fn log_event_training(&mut self, _event: String) {}
    }

    impl EvaluationProgressLogger for Recorder {
        fn start_global_progress(&mut self, _total_tests: usize) {}
        fn start_test(&mut self, _name: &str, _progress: &Progress) {}
        fn update_test_progress(&mut self, _progress: &Progress) {}
        fn end_test(&mut self, _progress: &Progress) {}
        fn end_global_progress(&mut self) {}
        fn log_event_evaluation(&mut self, _event: String) {}
    }
}
