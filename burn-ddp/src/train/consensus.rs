//! The ranks' votes before every step (burn-ddp-comm's [`vote`](burn_ddp_comm::train::vote)),
//! applied to Burn 0.21's interrupter: a decision to stop or a failure stops every rank at the
//! same step, so that no rank is left waiting in a collective that the others skipped.

use burn::tensor::backend::Backend;
use burn_ddp_comm::train::vote::{self, agree, Decision, Flow, Vote};

use super::DdpStrategy;
use crate::{DdpError, Result};

impl<B: Backend> DdpStrategy<B> {
    /// One small all-reduce: every rank's vote, and what they decide together.
    pub(super) fn agree(&self, vote: Vote) -> Result<Decision> {
        agree(self.session.group(), &vote)
    }

    /// Applies a stop or failure decision on this rank.
    pub(super) fn apply_decision(
        &self,
        decision: Result<Decision>,
        interrupter: &burn::train::Interrupter,
    ) -> Flow {
        vote::apply_decision(decision, self.rank(), &self.failure, |m| {
            interrupter.stop(Some(m))
        })
    }

    /// Stops this rank on an error it got itself (a failed collective names the rank at fault).
    pub(super) fn stop_with(&self, e: DdpError, interrupter: &burn::train::Interrupter) -> Flow {
        vote::stop_with(e, &self.failure, |m| interrupter.stop(Some(m)))
    }
}
