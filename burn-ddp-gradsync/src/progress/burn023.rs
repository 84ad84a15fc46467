//! burn-train 0.23's progress loggers (`TrainingProgressLogger`, `EvaluationProgressLogger`)
//! for this crate's renderers, in this release's signatures (a `Progress`): the other half of what
//! differs between the Burn releases whose lines share this crate's sources (`release.rs` holds
//! the rest; `progress/burn022.rs` is Burn 0.22's). The logic is the shared `train/render.rs`'s;
//! nothing names this module (the impls are found by their types), so it sits above `train`.

use burn::train::logger::{EvaluationProgressLogger, TrainingProgressLogger};
use burn::train::renderer::MetricsRenderer;

use crate::train::{Headless, ProgressLines, WithMembership};
use burn::data::dataloader::Progress;

impl TrainingProgressLogger for Headless {
    fn start(&mut self, _epochs: usize, _start: usize, _items: Option<usize>, _: Option<&str>) {}
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
    fn start(&mut self, epochs: usize, start: usize, items: Option<usize>, label: Option<&str>) {
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

/// The renderers' tests' recorder (`train/render.rs`) as a progress logger of this release.
#[cfg(test)]
mod recorder {
    use burn::data::dataloader::Progress;
    use burn::train::logger::{EvaluationProgressLogger, TrainingProgressLogger};

    use crate::train::render_tests::Recorder;

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
