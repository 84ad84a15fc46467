//! What this line's Burn release, 0.22.1, does differently from the next: the one file of
//! Burn glue that burn-ddp-burn023 does not share with this crate (it compiles every other file
//! of `src/` against Burn 0.23, with a `release.rs` of its own). The rest of the crate names
//! these items instead of the release's differing APIs.

/// The features of this crate that give [`SyncBatchNorm`](crate::nn::SyncBatchNorm) a backend,
/// for its error when a tensor is on another.
pub(crate) const BACKEND_FEATURES: &str = "`flex`, `ndarray` or `cuda`";

#[cfg(feature = "train")]
pub(crate) use train::*;

/// burn-train 0.22: split events that carry a count of items, and progress loggers told
/// counts.
#[cfg(feature = "train")]
mod train {
    use burn::data::dataloader::Progress;
    use burn::train::logger::{EvaluationProgressLogger, TrainingProgressLogger};
    use burn::train::renderer::MetricsRenderer;
    use burn::train::LearnerEvent;

    use crate::train::{Headless, ProgressLines, WithMembership};

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

    impl TrainingProgressLogger for Headless {
        fn start(&mut self, _epochs: usize, _start: usize, _items: Option<usize>, _: Option<&str>) {
        }
        fn update_epoch(&mut self, _epoch: usize) {}
        fn start_split(&mut self, _split: &str, _total_items: usize) {}
        fn update_split(&mut self, _items_processed: usize) {}
        fn end_split(&mut self) {}
        fn end(&mut self) {}
        fn log_event_training(&mut self, _event: String) {}
    }

    impl EvaluationProgressLogger for Headless {
        fn start_global_progress(&mut self, _total_tests: usize) {}
        fn start_test(&mut self, _name: &str, _total_items: usize) {}
        fn update_test_progress(&mut self, _items_processed: usize) {}
        fn end_test(&mut self) {}
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
        fn start_split(&mut self, split: &str, total_items: usize) {
            self.begin_split(split, total_items);
        }
        fn update_split(&mut self, items_processed: usize) {
            self.progress(items_processed, None);
        }
        fn end_split(&mut self) {}
        fn end(&mut self) {}
        fn log_event_training(&mut self, _event: String) {}
    }

    impl EvaluationProgressLogger for ProgressLines {
        fn start_global_progress(&mut self, _total_tests: usize) {}
        fn start_test(&mut self, name: &str, total_items: usize) {
            self.begin_test(name, total_items);
        }
        fn update_test_progress(&mut self, items_processed: usize) {
            self.progress(items_processed, None);
        }
        fn end_test(&mut self) {}
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
        fn start_split(&mut self, split: &str, total_items: usize) {
            self.begin_split(split);
            self.inner.start_split(split, total_items);
        }
        fn update_split(&mut self, items_processed: usize) {
            self.step();
            self.inner.update_split(items_processed);
        }
        fn end_split(&mut self) {
            self.inner.end_split();
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
        fn start_test(&mut self, name: &str, total_items: usize) {
            self.begin_test();
            self.inner.start_test(name, total_items);
        }
        fn update_test_progress(&mut self, items_processed: usize) {
            self.inner.update_test_progress(items_processed);
        }
        fn end_test(&mut self) {
            self.inner.end_test();
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
    use burn::train::logger::{EvaluationProgressLogger, TrainingProgressLogger};

    pub(crate) use crate::train::render_tests::Recorder;

    /// Starts a split of `total` items on `r`.
    pub(crate) fn start_split(r: &mut impl TrainingProgressLogger, split: &str, total: usize) {
        r.start_split(split, total);
    }

    /// Tells `r` that `processed` items of the split are done.
    pub(crate) fn update_split(r: &mut impl TrainingProgressLogger, processed: usize) {
        r.update_split(processed);
    }

    impl TrainingProgressLogger for Recorder {
        fn start(&mut self, _: usize, _: usize, _: Option<usize>, _: Option<&str>) {}
        fn update_epoch(&mut self, _epoch: usize) {}
        fn start_split(&mut self, split: &str, _total_items: usize) {
            self.0.push(format!("split {split}"));
        }
        fn update_split(&mut self, items_processed: usize) {
            self.0.push(format!("step {items_processed}"));
        }
        fn end_split(&mut self) {}
        fn end(&mut self) {}
        fn log_event_training(&mut self, _event: String) {}
    }

    impl EvaluationProgressLogger for Recorder {
        fn start_global_progress(&mut self, _total_tests: usize) {}
        fn start_test(&mut self, _name: &str, _total_items: usize) {}
        fn update_test_progress(&mut self, _items_processed: usize) {}
        fn end_test(&mut self) {}
        fn end_global_progress(&mut self) {}
        fn log_event_evaluation(&mut self, _event: String) {}
    }
}
