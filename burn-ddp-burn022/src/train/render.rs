//! What each rank shows and logs: rank 0 the dashboard (or [`ProgressLines`] when its output is
//! not a terminal), the other ranks nothing ([`Headless`], [`NoMetricLogger`]).

use std::time::Duration;

use burn::train::logger::{EvaluationProgressLogger, MetricLogger, TrainingProgressLogger};
use burn::train::metric::store::{EpochSummary, MetricsUpdate, Split};
use burn::train::metric::{MetricDefinition, MetricId, NumericEntry};
use burn::train::renderer::{
    EvaluationName, MetricState, MetricsRenderer, MetricsRendererEvaluation,
    MetricsRendererTraining,
};
use burn::train::LearnerSummary;
use burn_ddp_comm::train::lines::ProgressText;

/// A renderer that shows nothing: the dashboard of ranks other than 0.
#[derive(Debug, Default, Clone, Copy)]
pub struct Headless;

impl MetricsRendererTraining for Headless {
    fn update_train(&mut self, _state: MetricState) {}
    fn update_valid(&mut self, _state: MetricState) {}
    fn on_train_end(
        &mut self,
        _summary: Option<LearnerSummary>,
    ) -> Result<(), Box<dyn core::error::Error>> {
        Ok(())
    }
}

impl MetricsRendererEvaluation for Headless {
    fn update_test(&mut self, _name: EvaluationName, _state: MetricState) {}
    fn on_test_end(
        &mut self,
        _summary: Option<LearnerSummary>,
    ) -> Result<(), Box<dyn core::error::Error>> {
        Ok(())
    }
}

impl TrainingProgressLogger for Headless {
    fn start(&mut self, _epochs: usize, _start: usize, _items: Option<usize>, _: Option<&str>) {}
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

impl MetricsRenderer for Headless {
    fn manual_close(&mut self) {}
    fn register_metric(&mut self, _definition: MetricDefinition) {}
}

/// A metric logger that writes nothing: ranks other than 0 log no duplicate metrics.
#[derive(Debug, Default, Clone, Copy)]
pub struct NoMetricLogger;

impl MetricLogger for NoMetricLogger {
    fn log(&mut self, _update: MetricsUpdate, _epoch: usize, _split: &Split) {}
    fn read_numeric(
        &mut self,
        _name: &str,
        _epoch: usize,
        _split: &Split,
    ) -> Result<Vec<NumericEntry>, String> {
        Ok(Vec::new())
    }
    fn log_metric_definition(&mut self, _definition: MetricDefinition) {}
    fn log_epoch_summary(&mut self, _summary: EpochSummary) {}
}

/// Rank 0's progress when its output is not a terminal (a log file, the launcher's pipe): one
/// line every few seconds and one at the end of each split, with the metrics of the whole job —
/// `[train] epoch 1/3  items 6400/16000  Loss epoch 0.412 - batch 0.388 | Accuracy ...`
/// (burn-ddp-comm's [`ProgressText`]).
#[derive(Debug)]
pub struct ProgressLines {
    text: ProgressText<MetricId>,
    split: String,
    epoch: usize,
    epochs: usize,
    items: usize,
}

impl ProgressLines {
    /// A line at most every `every` (plus the ends of splits).
    pub fn new(every: Duration) -> Self {
        Self {
            text: ProgressText::new(every),
            split: String::from("train"),
            epoch: 1,
            epochs: 1,
            items: 0,
        }
    }

    fn update(&mut self, train: bool, state: MetricState) {
        let entry = match state {
            MetricState::Generic(e) | MetricState::Numeric(e, _) => e,
        };
        self.text
            .update(train, entry.metric_id, entry.serialized_entry.formatted);
    }

    fn line(&mut self, processed: usize) {
        let items = Some((processed.min(self.items), self.items));
        if let Some(line) = self.text.line(&self.split, self.epoch, self.epochs, items) {
            println!("{line}");
        }
    }
}

impl Default for ProgressLines {
    fn default() -> Self {
        Self::new(Duration::from_secs(5))
    }
}

impl MetricsRendererTraining for ProgressLines {
    fn update_train(&mut self, state: MetricState) {
        self.update(true, state);
    }
    fn update_valid(&mut self, state: MetricState) {
        self.update(false, state);
    }
}

impl MetricsRendererEvaluation for ProgressLines {
    fn update_test(&mut self, _name: EvaluationName, state: MetricState) {
        self.update(false, state);
    }
}

impl TrainingProgressLogger for ProgressLines {
    fn start(&mut self, epochs: usize, start: usize, _items: Option<usize>, _: Option<&str>) {
        self.epochs = epochs;
        self.epoch = start;
    }
    fn update_epoch(&mut self, epoch: usize) {
        self.epoch = epoch + 1;
    }
    fn start_split(&mut self, split: &str, total_items: usize) {
        split.clone_into(&mut self.split);
        self.items = total_items;
    }
    fn update_split(&mut self, items_processed: usize) {
        self.line(items_processed);
    }
    fn end_split(&mut self) {}
    fn end(&mut self) {}
    fn log_event_training(&mut self, _event: String) {}
}

impl EvaluationProgressLogger for ProgressLines {
    fn start_global_progress(&mut self, _total_tests: usize) {}
    fn start_test(&mut self, _name: &str, total_items: usize) {
        "test".clone_into(&mut self.split);
        self.items = total_items;
    }
    fn update_test_progress(&mut self, items_processed: usize) {
        self.line(items_processed);
    }
    fn end_test(&mut self) {}
    fn end_global_progress(&mut self) {}
    fn log_event_evaluation(&mut self, _event: String) {}
}

impl MetricsRenderer for ProgressLines {
    fn manual_close(&mut self) {}
    fn register_metric(&mut self, definition: MetricDefinition) {
        self.text
            .name(definition.metric_id, definition.name.to_string());
    }
}
