//! What each rank shows and logs: rank 0 the dashboard (or [`ProgressLines`] when its output is
//! not a terminal), with the job's membership when it can change ([`WithMembership`]), the
//! other ranks nothing ([`Headless`], [`NoMetricLogger`]).

use std::sync::Arc;
use std::time::Duration;

use burn::train::logger::MetricLogger;
use burn::train::metric::store::{EpochSummary, MetricsUpdate, Split};
use burn::train::metric::{
    MetricAttributes, MetricDefinition, MetricEntry, MetricId, NumericAttributes, NumericEntry,
    SerializedEntry,
};
use burn::train::renderer::{
    EvaluationName, EvaluationProgress, MetricState, MetricsRenderer, MetricsRendererEvaluation,
    MetricsRendererTraining, ProgressType, TrainingProgress,
};
use burn::train::LearnerSummary;
use burn_ddp_comm::train::board::{MembershipBoard, MEMBERSHIP, WORLD_SIZE};
use burn_ddp_comm::train::progress_text::{ModelText, ProgressText};

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

burn_ddp_comm::job_metric_logger!(burn);

/// Rank 0's progress when its output is not a terminal (a log file, the launcher's pipe): one
/// line every few seconds and one at the end of each epoch's training and validation, with the
/// metrics of the whole job —
/// `[train] epoch 1/3  items 6400/16000  Loss epoch 0.412 - batch 0.388 | Accuracy ...` —
/// and for Burn's evaluator the test split's name without an epoch, `[test Plain]  items ...`
/// (burn-ddp-comm's [`ProgressText`]).
#[derive(Debug, Default)]
pub struct ProgressLines {
    text: ProgressText<MetricId>,
    /// The name of the evaluator's current test split.
    test: String,
    /// The trained model, for the summary (set by the strategy).
    model: ModelText,
}

impl ProgressLines {
    /// A line at most every `every` (plus the epoch ends).
    pub fn new(every: Duration) -> Self {
        Self {
            text: ProgressText::new(every),
            test: String::new(),
            model: ModelText::default(),
        }
    }

    /// Prints only while this process is `pg`'s rank 0 (a fault-tolerant job, where every rank
    /// follows the metrics and any may become rank 0).
    pub(crate) fn while_main_of(mut self, pg: crate::ProcessGroup) -> Self {
        self.text = self.text.while_main_of(pg);
        self
    }

    /// Prints Burn's summary after training with the model the strategy trained, as Burn's
    /// own strategy has it.
    pub(crate) fn showing_model(mut self, model: ModelText) -> Self {
        self.model = model;
        self
    }

    fn update(&mut self, train: bool, state: MetricState) {
        let entry = match state {
            MetricState::Generic(e) | MetricState::Numeric(e, _) => e,
        };
        self.text
            .update(train, entry.metric_id, entry.serialized_entry.formatted);
    }

    fn line(&mut self, split: &str, item: &TrainingProgress) {
        let items = item
            .progress
            .as_ref()
            .map(|p| (p.items_processed, p.items_total));
        if let Some(line) = self.text.line(
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
    fn on_train_end(
        &mut self,
        summary: Option<LearnerSummary>,
    ) -> Result<(), Box<dyn core::error::Error>> {
        self.model.print(summary);
        Ok(())
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
    fn update_test(&mut self, name: EvaluationName, state: MetricState) {
        name.as_str().clone_into(&mut self.test);
        self.update(false, state);
    }
    fn render_test(&mut self, item: EvaluationProgress, _progress: Vec<ProgressType>) {
        let items = (item.progress.items_processed, item.progress.items_total);
        if let Some(line) = self.text.test_line(&self.test, items) {
            println!("{line}");
        }
    }
}

impl MetricsRenderer for ProgressLines {
    fn manual_close(&mut self) {}
    fn register_metric(&mut self, definition: MetricDefinition) {
        self.text.name(definition.metric_id, definition.name);
    }
}

/// Rank 0's renderer `R` (Burn's terminal dashboard, [`ProgressLines`]) with two more metrics of
/// the job when its membership can change (an elastic or fault-tolerant job, a restarted one):
/// `World size` (plotted, so that a change shows as a step) and `Membership` (the last change:
/// who left and joined, at which step, from which checkpoint), read from the strategy's
/// [`MembershipBoard`] at every training step. With an empty board it adds nothing.
pub struct WithMembership<R> {
    inner: R,
    board: MembershipBoard,
    /// The ids of the two metrics, once registered with `inner`.
    ids: Option<(MetricId, MetricId)>,
}

impl<R> std::fmt::Debug for WithMembership<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WithMembership")
            .field("board", &self.board)
            .finish_non_exhaustive()
    }
}

impl<R: MetricsRenderer> WithMembership<R> {
    /// `inner`, showing what `board` says.
    pub fn new(inner: R, board: MembershipBoard) -> Self {
        Self {
            inner,
            board,
            ids: None,
        }
    }

    /// Registers the two metrics (once: before their first update, which the terminal
    /// dashboard needs) and updates them with the board's note.
    fn show(&mut self) {
        let Some(note) = self.board.get() else {
            return;
        };
        let (world, membership) = match &self.ids {
            Some(ids) => ids.clone(),
            None => {
                let id = |name: &str| MetricId::new(Arc::new(format!("burn-ddp/{name}")));
                let world = id(WORLD_SIZE);
                let membership = id(MEMBERSHIP);
                self.inner.register_metric(MetricDefinition {
                    metric_id: world.clone(),
                    name: WORLD_SIZE.into(),
                    description: Some("The number of ranks training".into()),
                    attributes: MetricAttributes::Numeric(NumericAttributes {
                        unit: None,
                        higher_is_better: true,
                    }),
                });
                self.inner.register_metric(MetricDefinition {
                    metric_id: membership.clone(),
                    name: MEMBERSHIP.into(),
                    description: Some("The last change of the job's membership".into()),
                    attributes: MetricAttributes::None,
                });
                self.ids = Some((world.clone(), membership.clone()));
                (world, membership)
            }
        };
        let size = note.world.to_string();
        let entry = |id: MetricId, text: String| {
            MetricEntry::new(
                id,
                SerializedEntry {
                    formatted: text.clone(),
                    serialized: text,
                },
            )
        };
        self.inner.update_train(MetricState::Numeric(
            entry(world, size),
            NumericEntry::Value(f64::from(note.world)),
        ));
        self.inner
            .update_train(MetricState::Generic(entry(membership, note.text)));
    }
}

impl<R: MetricsRenderer> MetricsRendererTraining for WithMembership<R> {
    fn update_train(&mut self, state: MetricState) {
        self.inner.update_train(state);
    }
    fn update_valid(&mut self, state: MetricState) {
        self.inner.update_valid(state);
    }
    fn render_train(&mut self, item: TrainingProgress, progress: Vec<ProgressType>) {
        self.show();
        self.inner.render_train(item, progress);
    }
    fn render_valid(&mut self, item: TrainingProgress, progress: Vec<ProgressType>) {
        self.inner.render_valid(item, progress);
    }
    fn on_train_end(
        &mut self,
        summary: Option<LearnerSummary>,
    ) -> Result<(), Box<dyn core::error::Error>> {
        self.inner.on_train_end(summary)
    }
}

impl<R: MetricsRenderer> MetricsRendererEvaluation for WithMembership<R> {
    fn update_test(&mut self, name: EvaluationName, state: MetricState) {
        self.inner.update_test(name, state);
    }
    fn render_test(&mut self, item: EvaluationProgress, progress: Vec<ProgressType>) {
        self.inner.render_test(item, progress);
    }
    fn on_test_end(
        &mut self,
        summary: Option<LearnerSummary>,
    ) -> Result<(), Box<dyn core::error::Error>> {
        self.inner.on_test_end(summary)
    }
}

impl<R: MetricsRenderer> MetricsRenderer for WithMembership<R> {
    fn manual_close(&mut self) {
        self.inner.manual_close();
    }
    fn register_metric(&mut self, definition: MetricDefinition) {
        self.inner.register_metric(definition);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A renderer that writes down what it is told.
    #[derive(Default)]
    struct Recorder(Vec<String>);

    impl MetricsRendererTraining for Recorder {
        fn update_train(&mut self, state: MetricState) {
            let text = match state {
                MetricState::Generic(e) => format!("text {}", e.serialized_entry.formatted),
                MetricState::Numeric(e, v) => {
                    format!("number {} = {}", e.serialized_entry.formatted, v.current())
                }
            };
            self.0.push(text);
        }
        fn update_valid(&mut self, _state: MetricState) {
            self.0.push("valid".into());
        }
        fn render_train(&mut self, _item: TrainingProgress, _progress: Vec<ProgressType>) {
            self.0.push("render".into());
        }
        fn render_valid(&mut self, _item: TrainingProgress, _progress: Vec<ProgressType>) {
            self.0.push("render valid".into());
        }
    }

    impl MetricsRendererEvaluation for Recorder {
        fn update_test(&mut self, _name: EvaluationName, _state: MetricState) {}
        fn render_test(&mut self, _item: EvaluationProgress, _progress: Vec<ProgressType>) {}
    }

    impl MetricsRenderer for Recorder {
        fn manual_close(&mut self) {}
        fn register_metric(&mut self, definition: MetricDefinition) {
            self.0.push(format!("register {}", definition.name));
        }
    }

    fn step(r: &mut WithMembership<Recorder>) {
        r.render_train(TrainingProgress::none(), Vec::new());
    }

    #[test]
    fn an_empty_board_adds_nothing() {
        let mut r = WithMembership::new(Recorder::default(), MembershipBoard::default());
        step(&mut r);
        r.render_valid(TrainingProgress::none(), Vec::new());
        assert_eq!(r.inner.0, ["render", "render valid"]);
    }

    #[test]
    fn the_membership_is_registered_once_then_shown_with_every_training_step() {
        let board = MembershipBoard::starting(2, 1, true, Some(3), None);
        let mut r = WithMembership::new(Recorder::default(), board.clone());
        step(&mut r);
        r.render_valid(TrainingProgress::none(), Vec::new());
        board.set(3, "epoch 1: world size 3 (was 2); joined m4".into());
        step(&mut r);
        assert_eq!(
            r.inner.0,
            [
                // Registered before their first update (the terminal dashboard needs it).
                "register World size",
                "register Membership",
                "number 2 = 2",
                "text round 1: world size 2 (was 3)",
                "render",
                "render valid",
                "number 3 = 3",
                "text epoch 1: world size 3 (was 2); joined m4",
                "render",
            ]
        );
    }
}
