//! The host's coordinator: closes each round once enough nodes arrived (or MAX did), writes its
//! plan, then watches the round for lost nodes (their beat silent for the node timeout) and for
//! nodes waiting to join.

use crate::error::MembershipError;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use super::rdzv::{arrival_key, arrivals_key, beat_key, plan_key, Plan, Rdzv, REQUEST};
use super::{ElasticConfig, BEAT};
use crate::{DdpError, Result};

/// The last time each node's beat counter was seen to move.
#[derive(Debug, Default)]
pub(super) struct Beats {
    seen: HashMap<String, (i64, Instant)>,
}

impl Beats {
    pub(super) fn observe<'a>(
        &mut self,
        rdzv: &Rdzv,
        ids: impl IntoIterator<Item = &'a String>,
    ) -> Result<()> {
        for id in ids {
            let v = rdzv.count(&beat_key(id))?;
            let entry = self.seen.entry(id.clone()).or_insert((v, Instant::now()));
            if entry.0 != v {
                *entry = (v, Instant::now());
            }
        }
        Ok(())
    }

    pub(super) fn silent_for(&self, id: &str) -> Duration {
        self.seen
            .get(id)
            .map(|(_, t)| t.elapsed())
            .unwrap_or_default()
    }
}

/// The host's coordinator: closes each round, then watches it for lost and waiting nodes.
pub(super) fn coordinate(rdzv: &Rdzv, cfg: &ElasticConfig, done: &AtomicBool) -> Result<()> {
    let mut beats = Beats::default();
    let mut previous: Vec<String> = Vec::new();
    let mut worlds: Option<(u32, u32)> = None; // (first, previous)
    let mut number = 0u32;
    loop {
        let Some(plan) = gather(rdzv, cfg, number, &previous, worlds, &mut beats, done)? else {
            return Ok(());
        };
        rdzv.client
            .set(&plan_key(number), &plan.encode())
            .map_err(|e| rdzv.lost("writing a round's plan", e))?;
        let Plan::Nodes {
            nodes,
            nproc,
            first_world,
            ..
        } = plan
        else {
            return Ok(());
        };
        worlds = Some((first_world, nodes.len() as u32 * nproc));
        loop {
            if done.load(Ordering::SeqCst) {
                return Ok(());
            }
            if rdzv.round()? > number {
                break;
            }
            beats.observe(rdzv, &nodes)?;
            if let Some(lost) = nodes
                .iter()
                .find(|n| beats.silent_for(n) >= cfg.node_timeout)
            {
                let why = format!(
                    "node {lost} was lost: its launcher has been silent for {:.1?}",
                    beats.silent_for(lost)
                );
                eprintln!("burn-ddp run: {why}; the job moves to round {}", number + 1);
                rdzv.bump(number, &why)?;
                break;
            }
            // A node asking to join moves the job on only while restarts are left: a newcomer
            // must not end a running job.
            if (nodes.len() as u32) < cfg.nodes.max
                && number < cfg.max_restarts
                && rdzv.count(&arrivals_key(number + 1))? > 0
            {
                let why = format!(
                    "a node asks to join and the job has {} of at most {} nodes",
                    nodes.len(),
                    cfg.nodes.max
                );
                eprintln!("burn-ddp run: {why}; the job moves to round {}", number + 1);
                rdzv.bump(number, &why)?;
                break;
            }
            thread::sleep(BEAT);
        }
        previous = nodes;
        number += 1;
    }
}

/// Collects the arrivals of round `number` until the round can close; `None` once `done`.
pub(super) fn gather(
    rdzv: &Rdzv,
    cfg: &ElasticConfig,
    number: u32,
    previous: &[String],
    worlds: Option<(u32, u32)>,
    beats: &mut Beats,
    done: &AtomicBool,
) -> Result<Option<Plan>> {
    let opened = Instant::now();
    let mut arrived: Vec<(u32, String)> = Vec::new();
    let mut enough_since: Option<Instant> = None;
    loop {
        if done.load(Ordering::SeqCst) {
            return Ok(None);
        }
        let n = rdzv.count(&arrivals_key(number))?;
        while (arrived.len() as i64) < n {
            // An arrival counts itself first, then writes who it is.
            let key = arrival_key(number, arrived.len() as i64);
            let v = rdzv
                .client
                .get_timeout(&key, REQUEST)
                .map_err(|e| rdzv.lost("reading an arrival", e))?;
            let text = String::from_utf8_lossy(&v).into_owned();
            let (nproc, id) = text
                .split_once('\t')
                .and_then(|(n, id)| Some((n.parse().ok()?, id.to_owned())))
                .ok_or_else(|| {
                    DdpError::Membership(MembershipError::Elastic {
                        addr: rdzv.addr.clone(),
                        reason: format!("a malformed arrival in round {number}: {text:?}"),
                    })
                })?;
            arrived.push((nproc, id));
        }
        beats.observe(
            rdzv,
            previous.iter().chain(arrived.iter().map(|(_, id)| id)),
        )?;
        // The host first (rank 0 and its store live there), then in order of arrival.
        let mut admitted: Vec<&(u32, String)> = arrived
            .iter()
            .filter(|(_, id)| *id == cfg.node_id)
            .take(1)
            .collect();
        if !admitted.is_empty() {
            for a in &arrived {
                if admitted.len() as u32 >= cfg.nodes.max {
                    break;
                }
                if !admitted.iter().any(|b| b.1 == a.1) {
                    admitted.push(a);
                }
            }
            let count = admitted.len() as u32;
            let waiting_for: Vec<&String> = previous
                .iter()
                .filter(|p| !arrived.iter().any(|(_, id)| id == *p))
                .filter(|p| beats.silent_for(p) < cfg.node_timeout)
                .collect();
            let ready = count >= cfg.nodes.max
                || (count >= cfg.nodes.min
                    && enough_since.get_or_insert_with(Instant::now).elapsed() >= cfg.join_window
                    && waiting_for.is_empty());
            if ready {
                return Ok(Some(plan_of(&admitted, worlds)));
            }
        }
        if opened.elapsed() >= cfg.rendezvous_timeout {
            let ids: Vec<&str> = arrived.iter().map(|(_, id)| id.as_str()).collect();
            return Ok(Some(Plan::Failed(format!(
                "round {number}: {} of the at least {} node(s) arrived within {:.0?} ([{}]); \
                 start more nodes' launchers, lower MIN in --nnodes, or raise --rdzv-timeout",
                ids.len(),
                cfg.nodes.min,
                cfg.rendezvous_timeout,
                ids.join(", ")
            ))));
        }
        thread::sleep(BEAT / 2);
    }
}

/// The plan for the admitted nodes, or why they cannot form a job.
/// `worlds`: the job's first and latest world sizes, once it has run.
pub(super) fn plan_of(admitted: &[&(u32, String)], worlds: Option<(u32, u32)>) -> Plan {
    let (nproc, first) = (admitted[0].0, &admitted[0].1);
    if let Some((other_n, other)) = admitted.iter().map(|a| (a.0, &a.1)).find(|a| a.0 != nproc) {
        return Plan::Failed(format!(
            "node {first} starts {nproc} rank(s) per node and node {other} {other_n}: give \
             every node's launcher the same --nproc-per-node"
        ));
    }
    let world = admitted.len() as u32 * nproc;
    Plan::Nodes {
        nproc,
        nodes: admitted.iter().map(|a| a.1.clone()).collect(),
        first_world: worlds.map_or(world, |w| w.0),
        previous_world: worlds.map(|w| w.1),
    }
}
