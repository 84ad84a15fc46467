//! What each rank shows and logs: rank 0 the dashboard (or [`ProgressLines`] when its output is
//! not a terminal), the other ranks nothing ([`Headless`], [`NoMetricLogger`]).

use std::time::Duration;

use burn::train::logger::MetricLogger;
use burn::train::metric::store::{EpochSummary, MetricsUpdate, Split};
use burn::train::metric::{MetricDefinition, MetricId, NumericEntry};
use burn::train::renderer::{
    EvaluationName, EvaluationProgress, MetricState, MetricsRenderer, MetricsRendererEvaluation,
    MetricsRendererTraining, ProgressType, TrainingProgress,
};
use burn::train::LearnerSummary;
use burn_ddp_comm::train::lines::ProgressText;

/// A renderer that shows nothing: the dashboard of ranks other than 0.
#[derive(Debug, Default, Clone, Copy)]
pub struct Headless;

impl MetricsRendererTraining for Headless {
    fn update_train(&mut self, _state: MetricState) {}
    fn update_valid(&mut self, _state: MetricState) {}
    fn render_train(&mut self, _item: TrainingProgress, _progress: Vec<ProgressType>) {}
    fn render_valid(&mut self, _item: TrainingProgress, _progress: Vec<ProgressType>) {}
    fn on_train_end(
        &mut self,
        _summary: Option<LearnerSummary>,
    ) -> Result<(), Box<dyn core::error::Error>> {
        Ok(())
    }
}

impl MetricsRendererEvaluation for Headless {
    fn update_test(&mut self, _name: EvaluationName, _state: MetricState) {}
    fn render_test(&mut self, _item: EvaluationProgress, _progress: Vec<ProgressType>) {}
    fn on_test_end(
        &mut self,
        _summary: Option<LearnerSummary>,
    ) -> Result<(), Box<dyn core::error::Error>> {
        Ok(())
    }
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
/// line every few seconds and one at the end of each epoch's training and validation, with the
/// metrics of the whole job —
/// `[train] epoch 1/3  items 6400/16000  Loss epoch 0.412 - batch 0.388 | Accuracy ...`
/// (burn-ddp-comm's [`ProgressText`]).
#[derive(Debug, Default)]
pub struct ProgressLines(ProgressText<MetricId>);

impl ProgressLines {
    /// A line at most every `every` (plus the epoch ends).
    pub fn new(every: Duration) -> Self {
        Self(ProgressText::new(every))
    }

    fn update(&mut self, train: bool, state: MetricState) {
        let entry = match state {
            MetricState::Generic(e) | MetricState::Numeric(e, _) => e,
        };
        self.0
            .update(train, entry.metric_id, entry.serialized_entry.formatted);
    }

    fn line(&mut self, split: &str, item: &TrainingProgress) {
        let items = item
            .progress
            .as_ref()
            .map(|p| (p.items_processed, p.items_total));
        if let Some(line) = self.0.line(
            split,
            item.global_progress.items_processed,
            item.global_progress.items_total,
            items,
        ) {
            println!("{line}");
        }
    }
}

impl MetricsRendererTraining for ProgressLines {
    fn update_train(&mut self, state: MetricState) {
        self.update(true, state);
    }
    fn update_valid(&mut self, state: MetricState) {
        self.update(false, state);
    }
    fn render_train(&mut self, item: TrainingProgress, _progress: Vec<ProgressType>) {
        self.line("train", &item);
    }
    fn render_valid(&mut self, item: TrainingProgress, _progress: Vec<ProgressType>) {
        self.line("valid", &item);
    }
}

impl MetricsRendererEvaluation for ProgressLines {
    fn update_test(&mut self, _name: EvaluationName, state: MetricState) {
        self.update(false, state);
    }
    fn render_test(&mut self, item: EvaluationProgress, _progress: Vec<ProgressType>) {
        self.line("test", &TrainingProgress::from(&item));
    }
}

impl MetricsRenderer for ProgressLines {
    fn manual_close(&mut self) {}
    fn register_metric(&mut self, definition: MetricDefinition) {
        self.0.name(definition.metric_id, definition.name);
    }
}
