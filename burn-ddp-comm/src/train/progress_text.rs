//! What rank 0 prints when its output is not a terminal (a log file, the launcher's pipe): one
//! line every few seconds and one at the end of each split, with the metrics of the whole job:
//! `[train] epoch 1/3  items 6400/16000  Loss 0.412 | Accuracy 87.1 %`. Each Burn line's
//! `ProgressLines` renderer feeds it burn-train's metric states and progress.

use std::collections::HashMap;
use std::hash::Hash;
use std::time::{Duration, Instant};

/// The text of the progress lines, for metrics identified by `K`.
#[derive(Debug)]
pub struct ProgressText<K> {
    every: Duration,
    last: Option<Instant>,
    names: HashMap<K, String>,
    train: Vec<(K, String)>,
    valid: Vec<(K, String)>,
    /// Prints only while this process is the group's rank 0 (a fault-tolerant job, where every
    /// rank follows the metrics and any may become rank 0).
    main_of: Option<crate::ProcessGroup>,
}

impl<K: Eq + Hash + Clone> ProgressText<K> {
    /// A line at most every `every` (plus the ends of splits).
    pub fn new(every: Duration) -> Self {
        Self {
            every,
            last: None,
            names: HashMap::new(),
            train: Vec::new(),
            valid: Vec::new(),
            main_of: None,
        }
    }

    /// Lines only while this process is `pg`'s rank 0 (none on the others).
    pub fn while_main_of(mut self, pg: crate::ProcessGroup) -> Self {
        self.main_of = Some(pg);
        self
    }

    /// The display name of metric `id`.
    pub fn name(&mut self, id: K, name: String) {
        self.names.insert(id, name);
    }

    /// The latest formatted value of metric `id` in the training split (`train`) or the
    /// validation and test splits.
    pub fn update(&mut self, train: bool, id: K, text: String) {
        let list = if train {
            &mut self.train
        } else {
            &mut self.valid
        };
        match list.iter_mut().find(|(k, _)| *k == id) {
            Some(slot) => slot.1 = text,
            None => list.push((id, text)),
        }
    }

    /// The line for `split` at `epoch` of `epochs` after `items` (processed, total), or `None`
    /// when the last line is too recent (a split's last item always gets one).
    pub fn line(
        &mut self,
        split: &str,
        epoch: usize,
        epochs: usize,
        items: Option<(usize, usize)>,
    ) -> Option<String> {
        let head = format!("[{split}] epoch {epoch}/{epochs}  ");
        self.emit(head, split == "train", items)
    }

    /// The line of Burn's evaluator on the test split `name` after `items` (processed,
    /// total), or `None` when the last line is too recent (the split's last item always gets
    /// one): `[test Plain]  items 100/100  Accuracy 98.2 %` (`[test]` for a split named
    /// `test` or nothing). No epoch: the evaluation comes after training, once.
    pub fn test_line(&mut self, name: &str, items: (usize, usize)) -> Option<String> {
        let head = match name {
            "" | "test" => String::from("[test]  "),
            name => format!("[test {name}]  "),
        };
        self.emit(head, false, Some(items))
    }

    fn emit(&mut self, head: String, train: bool, items: Option<(usize, usize)>) -> Option<String> {
        if self.main_of.as_ref().is_some_and(|pg| !pg.is_main()) {
            return None;
        }
        let done = items.is_some_and(|(n, total)| n >= total);
        let now = Instant::now();
        if !done
            && self
                .last
                .is_some_and(|t| now.duration_since(t) < self.every)
        {
            return None;
        }
        self.last = Some(now);
        let metrics = if train { &self.train } else { &self.valid };
        let metrics: Vec<String> = metrics
            .iter()
            .map(|(id, text)| match self.names.get(id) {
                Some(name) => format!("{name} {text}"),
                None => text.clone(),
            })
            .collect();
        let items = items
            .map(|(n, total)| format!("items {n}/{total}  "))
            .unwrap_or_default();
        Some(format!("{head}{items}{}", metrics.join(" | ")))
    }
}

impl<K: Eq + Hash + Clone> Default for ProgressText<K> {
    fn default() -> Self {
        Self::new(Duration::from_secs(5))
    }
}

/// The trained model's text (its `Display`, as Burn's summary shows it), shared between a
/// line's strategy, which sets it at the end of training, and rank 0's [`ProgressText`]
/// renderer, which prints Burn's summary with it: Burn sets a summary's model only in its own
/// strategy (`LearnerSummary::with_model` is crate-private in burn-train 0.21 and 0.22).
#[derive(Debug, Clone, Default)]
pub struct ModelText(std::sync::Arc<std::sync::Mutex<Option<String>>>);

impl ModelText {
    /// The model's text, from the strategy.
    pub fn set(&self, text: String) {
        *self.0.lock().unwrap_or_else(|p| p.into_inner()) = Some(text);
    }

    /// `summary` (the text of Burn's `LearnerSummary`) with a `Model:` block after its
    /// header line, as Burn's own strategy prints it, when the model's text was set and the
    /// summary has none.
    pub fn summary(&self, summary: &str) -> String {
        let model = self.0.lock().unwrap_or_else(|p| p.into_inner()).clone();
        match (model, summary.split_once('\n')) {
            (Some(model), Some((header, rest)))
                if header.contains("Learner Summary") && !rest.starts_with("Model:") =>
            {
                format!("{header}\nModel:\n{model}\n{rest}")
            }
            _ => summary.to_owned(),
        }
    }

    /// Prints Burn's summary of a run, if there is one, with the model ([`ModelText::summary`]):
    /// what rank 0's progress lines print when training ends.
    pub fn print(&self, summary: Option<impl std::fmt::Display>) {
        if let Some(summary) = summary {
            println!("{}", self.summary(&summary.to_string()));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_model_goes_under_the_summarys_header_once() {
        let burn = "==== Learner Summary ====\nTotal Epochs: 3\n\n| Split |\n";
        let model = ModelText::default();
        assert_eq!(model.summary(burn), burn, "no model text yet");
        model.set("Model {\n  params: 162\n}".into());
        let with = model.summary(burn);
        assert_eq!(
            with,
            "==== Learner Summary ====\nModel:\nModel {\n  params: 162\n}\nTotal Epochs: 3\n\n| Split |\n"
        );
        assert_eq!(
            model.summary(&with),
            with,
            "a summary that has one keeps it"
        );
        assert_eq!(model.summary("something else\n"), "something else\n");
    }

    #[test]
    fn lines_are_throttled_but_every_split_end_is_printed() {
        let mut p = ProgressText::new(Duration::from_secs(3600));
        p.name(1, "Loss".into());
        p.update(true, 1, "0.412".into());
        p.update(true, 2, "87.1 %".into());
        p.update(true, 1, "0.388".into());
        assert_eq!(
            p.line("train", 1, 3, Some((64, 640))).unwrap(),
            "[train] epoch 1/3  items 64/640  Loss 0.388 | 87.1 %"
        );
        assert_eq!(p.line("train", 1, 3, Some((128, 640))), None);
        assert!(p.line("train", 1, 3, Some((640, 640))).is_some());
        p.update(false, 1, "0.5".into());
        assert_eq!(
            p.line("valid", 1, 3, Some((10, 10))).unwrap(),
            "[valid] epoch 1/3  items 10/10  Loss 0.5"
        );
    }

    #[test]
    fn an_evaluation_line_names_its_split_and_no_epoch() {
        let mut p = ProgressText::new(Duration::from_secs(3600));
        p.name(1, "Accuracy".into());
        p.update(false, 1, "98.2 %".into());
        assert_eq!(
            p.test_line("Plain", (10, 100)).unwrap(),
            "[test Plain]  items 10/100  Accuracy 98.2 %"
        );
        assert_eq!(p.test_line("Plain", (20, 100)), None, "throttled");
        assert_eq!(
            p.test_line("test", (100, 100)).unwrap(),
            "[test]  items 100/100  Accuracy 98.2 %"
        );
    }
}
