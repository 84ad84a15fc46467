//! What each rank shows and logs: rank 0 the dashboard (or [`ProgressLines`] when its output is
//! not a terminal), the other ranks nothing ([`Headless`], [`NoMetricLogger`]).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use burn::train::logger::MetricLogger;
use burn::train::metric::store::{EpochSummary, MetricsUpdate, Split};
use burn::train::metric::{MetricDefinition, MetricId, NumericEntry};
use burn::train::renderer::{
    EvaluationName, EvaluationProgress, MetricState, MetricsRenderer, MetricsRendererEvaluation,
    MetricsRendererTraining, ProgressType, TrainingProgress,
};
use burn::train::LearnerSummary;

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
/// `[train] epoch 1/3  items 6400/16000  Loss epoch 0.412 - batch 0.388 | Accuracy ...`.
#[derive(Debug)]
pub struct ProgressLines {
    every: Duration,
    last: Option<Instant>,
    names: HashMap<MetricId, String>,
    train: Vec<(MetricId, String)>,
    valid: Vec<(MetricId, String)>,
}

impl ProgressLines {
    /// A line at most every `every` (plus the epoch ends).
    pub fn new(every: Duration) -> Self {
        Self {
            every,
            last: None,
            names: HashMap::new(),
            train: Vec::new(),
            valid: Vec::new(),
        }
    }

    fn update(list: &mut Vec<(MetricId, String)>, state: MetricState) {
        let entry = match state {
            MetricState::Generic(e) | MetricState::Numeric(e, _) => e,
        };
        let text = entry.serialized_entry.formatted;
        match list.iter_mut().find(|(id, _)| *id == entry.metric_id) {
            Some(slot) => slot.1 = text,
            None => list.push((entry.metric_id, text)),
        }
    }

    fn line(&mut self, split: &str, item: &TrainingProgress) {
        let done = item
            .progress
            .as_ref()
            .is_some_and(|p| p.items_processed >= p.items_total);
        let now = Instant::now();
        if !done
            && self
                .last
                .is_some_and(|t| now.duration_since(t) < self.every)
        {
            return;
        }
        self.last = Some(now);
        let metrics = if split == "train" {
            &self.train
        } else {
            &self.valid
        };
        let metrics: Vec<String> = metrics
            .iter()
            .map(|(id, text)| match self.names.get(id) {
                Some(name) => format!("{name} {text}"),
                None => text.clone(),
            })
            .collect();
        let items = item
            .progress
            .as_ref()
            .map(|p| format!("items {}/{}  ", p.items_processed, p.items_total))
            .unwrap_or_default();
        println!(
            "[{split}] epoch {}/{}  {items}{}",
            item.global_progress.items_processed,
            item.global_progress.items_total,
            metrics.join(" | ")
        );
    }
}

impl Default for ProgressLines {
    fn default() -> Self {
        Self::new(Duration::from_secs(5))
    }
}

impl MetricsRendererTraining for ProgressLines {
    fn update_train(&mut self, state: MetricState) {
        Self::update(&mut self.train, state);
    }
    fn update_valid(&mut self, state: MetricState) {
        Self::update(&mut self.valid, state);
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
        Self::update(&mut self.valid, state);
    }
    fn render_test(&mut self, item: EvaluationProgress, _progress: Vec<ProgressType>) {
        self.line("test", &TrainingProgress::from(&item));
    }
}

impl MetricsRenderer for ProgressLines {
    fn manual_close(&mut self) {}
    fn register_metric(&mut self, definition: MetricDefinition) {
        self.names.insert(definition.metric_id, definition.name);
    }
}
