//! The membership rule: from what the store shows of the epoch that ended (who checked in,
//! who is missing, who asks to join) and whom its end blamed, what a rank proposes as the next
//! epoch's members, or that it waits. Pure: no store, no clock; `super` runs it.

/// The membership rule's inputs for the epoch after `members`, as the store shows them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Ballot {
    /// Members of the epoch before that checked in (not gone), in their order.
    pub(super) checked: Vec<u32>,
    /// Members of the epoch before that neither checked in nor are gone.
    pub(super) missing: Vec<u32>,
    /// Joining processes that checked in (not gone), by id.
    pub(super) joiners: Vec<u32>,
}

impl Ballot {
    /// What `me` proposes, or `None` while it waits: every member accounted for, or the
    /// window passed. The blamed rank is left out (unless it is `me`: a rank never proposes
    /// a membership without itself; a blamed one waits for the window instead).
    pub(super) fn proposal(
        &self,
        me: u32,
        blamed: Option<u32>,
        window_passed: bool,
    ) -> Option<Vec<u32>> {
        let waiting: Vec<u32> = self
            .missing
            .iter()
            .copied()
            .filter(|m| Some(*m) != blamed)
            .collect();
        let i_am_blamed = blamed == Some(me);
        if !(window_passed || (waiting.is_empty() && !i_am_blamed)) {
            return None;
        }
        let mut out: Vec<u32> = self
            .checked
            .iter()
            .copied()
            .filter(|m| Some(*m) != blamed || *m == me)
            .collect();
        for j in &self.joiners {
            if !out.contains(j) && (Some(*j) != blamed || *j == me) {
                out.push(*j);
            }
        }
        Some(out)
    }
}

/// The ids of `v` not in `of`.
pub(super) fn minus(v: &[u32], of: &[u32]) -> Vec<u32> {
    v.iter().copied().filter(|i| !of.contains(i)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn ballot(checked: &[u32], missing: &[u32], joiners: &[u32]) -> Ballot {
        Ballot {
            checked: checked.to_vec(),
            missing: missing.to_vec(),
            joiners: joiners.to_vec(),
        }
    }

    #[test]
    fn the_rule_waits_for_every_member_then_keeps_their_order_and_adds_joiners() {
        // Member 2 is neither checked in nor gone: wait, unless the window passed.
        let b = ballot(&[1, 0], &[2], &[5]);
        assert_eq!(b.proposal(0, None, false), None);
        assert_eq!(b.proposal(0, None, true), Some(vec![1, 0, 5]));
        // Everyone accounted for: at once, previous order first, joiners by id after.
        let b = ballot(&[0, 1, 3], &[], &[4, 6]);
        assert_eq!(b.proposal(1, None, false), Some(vec![0, 1, 3, 4, 6]));
    }

    #[test]
    fn the_blamed_rank_is_left_out_and_not_waited_for() {
        // Member 2 was blamed and never checked in: nobody waits for it.
        let b = ballot(&[0, 1], &[2], &[]);
        assert_eq!(b.proposal(0, Some(2), false), Some(vec![0, 1]));
        // Blamed but checked in (two ranks blaming each other): the others leave it out...
        let b = ballot(&[0, 1, 2], &[], &[]);
        assert_eq!(b.proposal(0, Some(2), false), Some(vec![0, 1]));
        // ...and it waits for the window before proposing, with itself.
        assert_eq!(b.proposal(2, Some(2), false), None);
        assert_eq!(b.proposal(2, Some(2), true), Some(vec![0, 1, 2]));
    }

    proptest! {
        /// Whatever the store shows: a proposal never holds a member twice, always holds its
        /// proposer when the proposer checked in, never holds a missing member, and never holds
        /// the blamed member unless it is the proposer.
        #[test]
        fn proposals_are_sets_of_present_members(
            members in proptest::collection::vec(0u32..6, 0..6),
            missing_mask in proptest::collection::vec(any::<bool>(), 6),
            joiners in proptest::collection::btree_set(6u32..10, 0..3),
            blamed in proptest::option::of(0u32..8),
            passed in any::<bool>(),
        ) {
            let mut uniq = members.clone();
            uniq.sort_unstable();
            uniq.dedup();
            let checked: Vec<u32> = uniq.iter().copied().filter(|m| !missing_mask[*m as usize]).collect();
            let missing: Vec<u32> = uniq.iter().copied().filter(|m| missing_mask[*m as usize]).collect();
            let joiners: Vec<u32> = joiners.into_iter().collect();
            let b = ballot(&checked, &missing, &joiners);
            for &me in &checked {
                if let Some(p) = b.proposal(me, blamed, passed) {
                    let mut sorted = p.clone();
                    sorted.sort_unstable();
                    sorted.dedup();
                    prop_assert_eq!(sorted.len(), p.len());
                    prop_assert!(p.contains(&me));
                    prop_assert!(p.iter().all(|m| !missing.contains(m)));
                    prop_assert!(p.iter().all(|m| Some(*m) != blamed || *m == me));
                }
            }
        }
    }
}
