//! What rank 0's dashboard says about the job's membership: its world size and the last change
//! (a fault-tolerant job's new membership, an elastic job's new round, a restart), shown by
//! every Burn line's renderer as two metrics of the job, `World size` (a number, plotted) and
//! `Membership` (a line of text).
//!
//! A job whose membership cannot change and that was never restarted shows neither: the
//! [`MembershipBoard`] stays empty.

use std::sync::{Arc, Mutex};

use crate::group::{ProcessGroup, Recovery};

/// The name under which the world size is shown.
pub const WORLD_SIZE: &str = "World size";
/// The name under which the last change of membership is shown.
pub const MEMBERSHIP: &str = "Membership";

/// What the dashboard shows now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MembershipNote {
    /// The job's world size.
    pub world: u32,
    /// The last change, in a few words, after the name `Membership`: a fault-tolerant job's
    /// membership epoch (`epoch 1: world size 2 (was 3); left m1; at epoch 1, training, 9 steps
    /// in`), an elastic job's round (`round 1: world size 1 (was 2), from the checkpoint of
    /// epoch 1`), a restart (`restart 2: world size 4`).
    pub text: String,
}

/// The membership shown on the dashboard, shared between the strategy (which writes it when
/// the membership changes) and the renderer (which shows it with every training step).
#[derive(Debug, Clone, Default)]
pub struct MembershipBoard(Arc<Mutex<Option<MembershipNote>>>);

impl MembershipBoard {
    /// The board of a process at its start: empty in a job whose membership cannot change and
    /// that was not restarted; else the world size and what this round or restart is
    /// (`round 1: world size 1 (was 2)`, `restart 2: world size 4`, a fault-tolerant job's
    /// `epoch 0: world size 3`).
    pub fn at_start(pg: &ProcessGroup) -> Self {
        Self::starting(
            pg.world_size().get(),
            pg.restart_count(),
            crate::config::env::first_world_size().is_some(),
            crate::config::env::previous_world_size(),
            pg.membership().map(|(_, epoch)| epoch),
        )
    }

    /// [`at_start`](Self::at_start) from its parts: `elastic` for a job launched with
    /// `--nnodes MIN:MAX` (restarts are its rounds), `previous` the round before's world size,
    /// `membership` a fault-tolerant job's membership epoch.
    pub fn starting(
        world: u32,
        restarts: u32,
        elastic: bool,
        previous: Option<u32>,
        membership: Option<u64>,
    ) -> Self {
        let board = Self::default();
        let was = previous.map(|p| format!(" (was {p})")).unwrap_or_default();
        let text = if let Some(epoch) = membership {
            Some(format!("epoch {epoch}: world size {world}"))
        } else if elastic {
            Some(format!("round {restarts}: world size {world}{was}"))
        } else if restarts > 0 {
            Some(format!("restart {restarts}: world size {world}{was}"))
        } else {
            None
        };
        if let Some(text) = text {
            board.set(world, text);
        }
        board
    }

    /// Shows `text` and `world`.
    pub fn set(&self, world: u32, text: String) {
        *self.0.lock().unwrap_or_else(|p| p.into_inner()) = Some(MembershipNote { world, text });
    }

    /// What to show, if anything.
    pub fn get(&self) -> Option<MembershipNote> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// A fault-tolerant job changed its membership (`rec`) at `at` (where training was:
    /// `epoch 1, training, 9 steps in`).
    pub fn changed(&self, rec: &Recovery, at: &str) {
        let ids = |v: &[u32]| {
            let list: Vec<String> = v.iter().map(|i| format!("m{i}")).collect();
            list.join(", ")
        };
        let mut text = format!("epoch {}: world size {}", rec.epoch, rec.world);
        if rec.previous.is_empty() {
            text.push_str(&format!("; joined as rank {}", rec.rank));
        } else {
            text.push_str(&format!(" (was {})", rec.previous.len()));
            if !rec.left.is_empty() {
                text.push_str(&format!("; left {}", ids(&rec.left)));
            }
            if !rec.joined.is_empty() {
                text.push_str(&format!("; joined {}", ids(&rec.joined)));
            }
        }
        text.push_str(&format!("; at {at}"));
        self.set(rec.world.get(), text);
    }

    /// A restarted job resumed from the checkpoint of `epoch`: said after the round's text.
    pub fn resumed(&self, epoch: usize) {
        let mut note = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(note) = note.as_mut() {
            note.text
                .push_str(&format!(", from the checkpoint of epoch {epoch}"));
        }
    }
}

#[cfg(test)]
mod tests {
    use std::num::NonZeroU32;
    use std::time::Duration;

    use super::*;
    use crate::types::{Rank, WorldSize};

    fn text(board: &MembershipBoard) -> Option<String> {
        board.get().map(|n| format!("{} | {}", n.world, n.text))
    }

    #[test]
    fn a_job_that_cannot_change_shows_nothing() {
        assert_eq!(
            text(&MembershipBoard::starting(4, 0, false, None, None)),
            None
        );
        let b = MembershipBoard::starting(4, 0, false, None, None);
        b.resumed(2);
        assert_eq!(text(&b), None);
    }

    #[test]
    fn rounds_restarts_and_memberships_say_what_they_are() {
        assert_eq!(
            text(&MembershipBoard::starting(2, 0, true, None, None)).unwrap(),
            "2 | round 0: world size 2"
        );
        let b = MembershipBoard::starting(1, 1, true, Some(2), None);
        b.resumed(1);
        assert_eq!(
            text(&b).unwrap(),
            "1 | round 1: world size 1 (was 2), from the checkpoint of epoch 1"
        );
        assert_eq!(
            text(&MembershipBoard::starting(4, 2, false, None, None)).unwrap(),
            "4 | restart 2: world size 4"
        );
        assert_eq!(
            text(&MembershipBoard::starting(3, 0, false, None, Some(0))).unwrap(),
            "3 | epoch 0: world size 3"
        );
    }

    fn recovery(previous: Vec<u32>, left: Vec<u32>, joined: Vec<u32>, world: u32) -> Recovery {
        Recovery {
            epoch: 2,
            members: Vec::new(),
            previous,
            left,
            joined,
            reason: String::new(),
            rank: Rank(1),
            world: WorldSize(NonZeroU32::new(world).unwrap()),
            source: Rank(0),
            behind: Vec::new(),
            progress: 9,
            took: Duration::ZERO,
        }
    }

    #[test]
    fn a_change_names_who_left_and_joined_and_where_training_was() {
        let b = MembershipBoard::starting(3, 0, false, None, Some(0));
        let clone = b.clone();
        b.changed(
            &recovery(vec![0, 1, 2], vec![1], vec![3], 3),
            "epoch 1, training, 9 steps in",
        );
        assert_eq!(
            text(&clone).unwrap(),
            "3 | epoch 2: world size 3 (was 3); left m1; joined m3; at epoch 1, \
             training, 9 steps in"
        );
        b.changed(
            &recovery(vec![0, 1], vec![1], vec![], 1),
            "epoch 2, validation, 0 steps in",
        );
        assert_eq!(
            text(&b).unwrap(),
            "1 | epoch 2: world size 1 (was 2); left m1; at epoch 2, validation, 0 \
             steps in"
        );
        b.changed(
            &recovery(vec![], vec![], vec![], 2),
            "epoch 1, training, 9 steps in",
        );
        assert_eq!(
            text(&b).unwrap(),
            "2 | epoch 2: world size 2; joined as rank 1; at epoch 1, training, 9 \
             steps in"
        );
    }
}
