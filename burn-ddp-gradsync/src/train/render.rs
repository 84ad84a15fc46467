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
    EvaluationName, MetricState, MetricsRenderer, MetricsRendererEvaluation,
    MetricsRendererTraining,
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
/// line every few seconds and one at the end of each split, with the metrics of the whole job —
/// `[train] epoch 1/3  items 6400/16000  Loss epoch 0.412 - batch 0.388 | Accuracy ...` —
/// and for Burn's evaluator the test split's name without an epoch, `[test Plain]  items ...`
/// (burn-ddp-comm's [`ProgressText`]).
#[derive(Debug)]
pub struct ProgressLines {
    text: ProgressText<MetricId>,
    split: String,
    epoch: usize,
    epochs: usize,
    items: usize,
    /// The evaluator's current test split, while it runs.
    test: Option<String>,
    /// The trained model, for the summary (set by the strategy).
    model: ModelText,
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
            test: None,
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

    /// Training starts: `epochs` in all, from epoch `start` (burn-train's progress logger's
    /// `start`).
    pub(crate) fn start_training(&mut self, epochs: usize, start: usize) {
        self.epochs = epochs;
        self.epoch = start;
    }

    /// Epoch `epoch` (from 0) begins.
    pub(crate) fn at_epoch(&mut self, epoch: usize) {
        self.epoch = epoch + 1;
    }

    /// A split of `items` items begins.
    pub(crate) fn begin_split(&mut self, split: &str, items: usize) {
        split.clone_into(&mut self.split);
        self.items = items;
        self.test = None;
    }

    /// The evaluator's test split `name`, of `items` items, begins.
    pub(crate) fn begin_test(&mut self, name: &str, items: usize) {
        self.test = Some(name.to_owned());
        self.items = items;
    }

    /// `processed` items of the split (of `total`, when the release says it with each step):
    /// a line when one is due.
    pub(crate) fn progress(&mut self, processed: usize, total: Option<usize>) {
        if let Some(total) = total {
            self.items = total;
        }
        let items = (processed.min(self.items), self.items);
        let line = match &self.test {
            Some(name) => self.text.test_line(name, items),
            None => self
                .text
                .line(&self.split, self.epoch, self.epochs, Some(items)),
        };
        if let Some(line) = line {
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
}

impl MetricsRendererEvaluation for ProgressLines {
    fn update_test(&mut self, _name: EvaluationName, state: MetricState) {
        self.update(false, state);
    }
}

impl MetricsRenderer for ProgressLines {
    fn manual_close(&mut self) {}
    fn register_metric(&mut self, definition: MetricDefinition) {
        self.text
            .name(definition.metric_id, definition.name.to_string());
    }
}

/// Rank 0's renderer `R` (Burn's terminal dashboard, [`ProgressLines`]) with two more metrics of
/// the job when it was restarted at a new size or after a failure (`burn-ddp run --nnodes
/// MIN:MAX`, `--max-restarts`): `World size` (plotted) and `Membership` (the round and the
/// checkpoint it resumed from), read from the strategy's [`MembershipBoard`] at every training
/// step. With an empty board it adds nothing.
pub struct WithMembership<R> {
    pub(crate) inner: R,
    board: MembershipBoard,
    /// Whether the current split is the training's (the metrics are shown with its steps).
    training: bool,
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
            training: false,
            ids: None,
        }
    }

    /// A split begins (the training split's steps show the membership).
    pub(crate) fn begin_split(&mut self, split: &str) {
        self.training = split == <&str>::from(Split::Train);
    }

    /// The evaluator's test split begins.
    pub(crate) fn begin_test(&mut self) {
        self.training = false;
    }

    /// A step of the current split: the membership with the training split's.
    pub(crate) fn step(&mut self) {
        if self.training {
            self.show();
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
                let ids = (
                    MetricId::new(Arc::new(format!("burn-ddp/{WORLD_SIZE}"))),
                    MetricId::new(Arc::new(format!("burn-ddp/{MEMBERSHIP}"))),
                );
                self.inner.register_metric(MetricDefinition {
                    metric_id: ids.0.clone(),
                    name: Arc::new(WORLD_SIZE.into()),
                    description: Some("The number of ranks training".into()),
                    attributes: MetricAttributes::Numeric(NumericAttributes {
                        unit: None,
                        higher_is_better: true,
                    }),
                });
                self.inner.register_metric(MetricDefinition {
                    metric_id: ids.1.clone(),
                    name: Arc::new(MEMBERSHIP.into()),
                    description: Some("The last change of the job's membership".into()),
                    attributes: MetricAttributes::None,
                });
                self.ids = Some(ids.clone());
                ids
            }
        };
        let entry = |id: MetricId, text: String| {
            MetricEntry::new(id, SerializedEntry::new(text.clone(), text))
        };
        self.inner.update_train(MetricState::Numeric(
            entry(world, note.world.to_string()),
            Some(NumericEntry::Value(f64::from(note.world))),
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
pub(crate) mod tests {
    use super::*;

    use crate::release::testing::{start_split, update_split};

    /// A renderer that writes down what it is told (and, as [`ProgressLines`], a line per
    /// step); each release's `release::testing` makes it a progress logger.
    #[derive(Default)]
    pub(crate) struct Recorder(pub(crate) Vec<String>);

    impl MetricsRendererTraining for Recorder {
        fn update_train(&mut self, state: MetricState) {
            let text = match state {
                MetricState::Generic(e) => format!("text {}", e.serialized_entry.formatted),
                MetricState::Numeric(e, v) => {
                    let v = v.map(|v| v.current());
                    format!("number {} = {v:?}", e.serialized_entry.formatted)
                }
            };
            self.0.push(text);
        }
        fn update_valid(&mut self, _state: MetricState) {}
    }

    impl MetricsRendererEvaluation for Recorder {
        fn update_test(&mut self, _name: EvaluationName, _state: MetricState) {}
    }

    impl MetricsRenderer for Recorder {
        fn manual_close(&mut self) {}
        fn register_metric(&mut self, definition: MetricDefinition) {
            self.0.push(format!("register {}", definition.name));
        }
    }

    fn epoch(r: &mut WithMembership<Recorder>) {
        start_split(r, "train", 2);
        update_split(r, 1);
        start_split(r, "valid", 1);
        update_split(r, 1);
    }

    #[test]
    fn an_empty_board_adds_nothing() {
        let mut r = WithMembership::new(Recorder::default(), MembershipBoard::default());
        epoch(&mut r);
        assert_eq!(
            r.inner.0,
            ["split train", "step 1", "split valid", "step 1"]
        );
    }

    #[test]
    fn a_new_round_is_registered_once_then_shown_with_every_training_step() {
        let board = MembershipBoard::starting(1, 1, true, Some(2), None);
        board.resumed(3);
        let mut r = WithMembership::new(Recorder::default(), board);
        epoch(&mut r);
        start_split(&mut r, "train", 2);
        update_split(&mut r, 2);
        let text = "text round 1: world size 1 (was 2), from the checkpoint of epoch 3";
        assert_eq!(
            r.inner.0,
            [
                "split train",
                // Registered before their first update (the terminal dashboard needs it).
                "register World size",
                "register Membership",
                "number 1 = Some(1.0)",
                text,
                "step 1",
                "split valid",
                "step 1",
                "split train",
                "number 1 = Some(1.0)",
                text,
                "step 2",
            ]
        );
    }
}
