//! Sub-groups: a process group over some of a group's ranks (PyTorch's `new_group` and
//! `split_group`).
//!
//! A sub-group is a [`ProcessGroup`] like any other (the same collectives, deadlines and error
//! naming; DDP runs on it) with ranks numbered 0..n within it. Between processes it has a TCP
//! ring of its own, opened through the job's store under a key prefix of its own, and the
//! process's heartbeat watches its collectives as waits on the peers: a rank that dies or freezes
//! is named within the heartbeat bound, and a verdict stops every ring of the process. Its
//! errors name the job's global ranks, wrapped in [`CollectiveError::InGroup`](crate::CollectiveError::InGroup) with the group and this
//! rank's place in it.

use crate::error::{CollectiveError, MembershipError};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use super::heartbeat::SubgroupWatch;
use super::p2p::P2p;
use super::{Inner, ProcessGroup};
use crate::comm::{Communicator, LocalCommunicator, TcpCommunicator, Tuning};
use crate::types::{Rank, RankList, WorldSize};
use crate::{DdpError, Result};

/// What a sub-group knows of its place in the job.
#[derive(Debug)]
pub(super) struct SubInfo {
    /// `g<n>: ranks [..]`, as errors show it.
    pub(super) name: String,
    /// The members' global ranks, by group rank.
    pub(super) members: Arc<[Rank]>,
    /// The group it was made from (kept alive while the sub-group lives).
    pub(super) parent: ProcessGroup,
}

impl ProcessGroup {
    /// A group of the ranks `ranks` of this group (PyTorch's `new_group`), in that order: the
    /// rank at `ranks[i]` is rank `i` of the new group. Every rank of this group must call it,
    /// in the same order relative to its other `new_group`/`split` calls, with the same list;
    /// members get `Some(group)`, the others `None`.
    ///
    /// Groups may overlap and nest. Their collectives are independent of this group's and of
    /// each other's (each group has its own connections), so disjoint groups run concurrently.
    ///
    /// # Errors
    /// [`CollectiveError::InvalidGroupCall`] for an empty list, a repeated rank or one outside this
    /// group; the rendezvous errors of [`ProcessGroup::init`] (naming global ranks) when a
    /// member does not arrive within the rendezvous timeout.
    pub fn new_group(&self, ranks: &[Rank]) -> Result<Option<ProcessGroup>> {
        self.refuse_fault_tolerant()?;
        let n = self.inner().subgroups.fetch_add(1, Ordering::SeqCst);
        self.check_members(ranks)?;
        let tag = format!("{}/g{n}", self.inner().tag);
        self.make_subgroup(ranks, tag, format!("g{n}"))
    }

    /// Splits this group by `color` (PyTorch's `split_group`, NCCL's `ncclCommSplit`): the ranks
    /// that pass the same `Some(color)` form one group, ordered by their rank in this group;
    /// ranks that pass `None` join none. A collective of this group: every rank must call it.
    ///
    /// ```no_run
    /// # use burn_ddp_comm::ProcessGroup;
    /// let world = ProcessGroup::from_env()?;
    /// // 2 pipeline stages x R replicas, ranks stage-major: the replicas of each stage.
    /// let replicas = world.split(Some(world.rank().0 / (world.world_size().get() / 2)))?;
    /// # Ok::<(), burn_ddp_comm::DdpError>(())
    /// ```
    ///
    /// # Errors
    /// The errors of [`ProcessGroup::all_gather`] (the colors are exchanged first) and of
    /// [`ProcessGroup::new_group`].
    pub fn split(&self, color: Option<u32>) -> Result<Option<ProcessGroup>> {
        self.refuse_fault_tolerant()?;
        let mut colors = vec![0i64; self.inner().world.as_usize()];
        self.all_gather(&[color.map_or(-1, i64::from)], &mut colors)?;
        let n = self.inner().subgroups.fetch_add(1, Ordering::SeqCst);
        let Some(color) = color else {
            return Ok(None);
        };
        let ranks: Vec<Rank> = self
            .inner()
            .world
            .ranks()
            .filter(|r| colors[r.index()] == i64::from(color))
            .collect();
        let tag = format!("{}/g{n}c{color}", self.inner().tag);
        self.make_subgroup(&ranks, tag, format!("g{n} color {color}"))
    }

    /// This process's rank in the job (its rank in the world group), whatever group this is.
    pub fn global_rank(&self) -> Rank {
        self.to_global(self.inner().rank)
    }

    /// The global rank of this group's rank `rank`.
    pub fn to_global(&self, rank: Rank) -> Rank {
        match &self.inner().sub {
            Some(sub) => sub.members.get(rank.index()).copied().unwrap_or(rank),
            None => rank,
        }
    }

    /// This group's ranks as global ranks, by group rank (`0..world_size` for the world group).
    pub fn members(&self) -> Vec<Rank> {
        match &self.inner().sub {
            Some(sub) => sub.members.to_vec(),
            None => self.inner().world.ranks().collect(),
        }
    }

    /// Whether this is a sub-group (made by [`ProcessGroup::new_group`] or [`ProcessGroup::split`]).
    pub fn is_subgroup(&self) -> bool {
        self.inner().sub.is_some()
    }

    /// `result`, its error wrapped in the group's name and this rank's place for a sub-group.
    pub(super) fn scoped<T>(&self, result: Result<T>) -> Result<T> {
        match (&self.inner().sub, result) {
            (Some(sub), Err(e))
                if !matches!(e, DdpError::Collective(CollectiveError::InGroup { .. })) =>
            {
                Err(DdpError::Collective(CollectiveError::InGroup {
                    group: sub.name.clone(),
                    group_rank: self.inner().rank,
                    inner: Box::new(e),
                }))
            }
            (_, r) => r,
        }
    }

    /// Sub-groups are made of the ranks of one membership; a fault-tolerant group changes its
    /// membership.
    fn refuse_fault_tolerant(&self) -> Result<()> {
        if self.is_fault_tolerant() {
            return Err(DdpError::Membership(MembershipError::NotFaultTolerant {
                what: "sub-groups (new_group, split)",
                reason: "their ranks are fixed, while a fault-tolerant job's membership \
                         changes; train data-parallel on the whole group",
            }));
        }
        Ok(())
    }

    fn check_members(&self, ranks: &[Rank]) -> Result<()> {
        let bad = |reason: String| {
            DdpError::Collective(CollectiveError::InvalidGroupCall {
                rank: self.global_rank(),
                what: "new_group",
                reason,
            })
        };
        if ranks.is_empty() {
            return Err(bad("the list of ranks is empty; give at least one".into()));
        }
        if let Some(r) = ranks.iter().find(|r| !self.inner().world.contains(**r)) {
            return Err(bad(format!(
                "rank {r} is not in this group of {} ranks",
                self.inner().world
            )));
        }
        let mut sorted = ranks.to_vec();
        sorted.sort_unstable();
        if let Some(w) = sorted.windows(2).find(|w| w[0] == w[1]) {
            return Err(bad(format!("rank {} is listed twice", w[0])));
        }
        Ok(())
    }

    /// The sub-group of `ranks` (ranks of this group) with store-key prefix `tag`, if this rank
    /// is one of them.
    fn make_subgroup(&self, ranks: &[Rank], tag: String, name: String) -> Result<Option<Self>> {
        let Some(place) = ranks.iter().position(|r| *r == self.inner().rank) else {
            return Ok(None);
        };
        let place = Rank(place as u32);
        let members: Arc<[Rank]> = ranks.iter().map(|r| self.to_global(*r)).collect();
        let size = WorldSize::try_from(members.len()).map_err(|_| {
            DdpError::Collective(CollectiveError::InvalidGroupCall {
                rank: self.global_rank(),
                what: "new_group",
                reason: format!("{} ranks is not a group size", members.len()),
            })
        })?;
        let name = format!("{name}: ranks {}", RankList(members.to_vec()));
        let info = SubInfo {
            name: name.clone(),
            members: Arc::clone(&members),
            parent: self.clone(),
        };
        let inner = self.inner();
        let timeouts = inner.timeouts;
        let (comm, p2p): (Box<dyn Communicator>, P2p) = if size == WorldSize::ONE {
            let comm = LocalCommunicator::group(size, timeouts.collective).pop();
            let Some(comm) = comm else {
                unreachable!("a local group of one has one communicator")
            };
            (Box::new(comm), P2p::none())
        } else {
            let Some(store) = &inner.store else {
                return Err(DdpError::Collective(CollectiveError::InvalidGroupCall {
                    rank: self.global_rank(),
                    what: "new_group",
                    reason: "a sub-group of more than one rank needs a group of processes \
                             (ProcessGroup::init or from_env); the threads of an in-process \
                             group (ProcessGroup::local) have no store to meet through"
                        .into(),
                }));
            };
            let deadline = Instant::now() + timeouts.rendezvous;
            let connected = TcpCommunicator::connect(
                Arc::clone(store),
                place,
                size,
                &inner.token,
                &tag,
                deadline,
                timeouts,
                Tuning {
                    algorithm: inner.algorithm,
                    local_world: inner.local_world,
                    transport: inner.transport,
                },
            )
            .map_err(|e| {
                DdpError::Collective(CollectiveError::InGroup {
                    group: name.clone(),
                    group_rank: place,
                    inner: Box::new(e),
                })
            })?;
            let mut comm = connected.with_members(Arc::clone(&members));
            if let Some(h) = &inner.heartbeat {
                comm.watch_with(Arc::new(SubgroupWatch(Arc::clone(h))));
                h.also_stop(comm.weak_stopper());
            }
            let same_host = comm.same_host();
            let p2p =
                P2p::tcp(store, &inner.token, (place, size), &tag, &same_host).map_err(|e| {
                    DdpError::Collective(CollectiveError::InGroup {
                        group: name.clone(),
                        group_rank: place,
                        inner: Box::new(e),
                    })
                })?;
            (Box::new(comm), p2p)
        };
        tracing::debug!(
            "[rank {}] joined sub-group {name} as its rank {place}",
            self.global_rank()
        );
        Ok(Some(ProcessGroup::from_inner(Inner {
            rank: place,
            world: size,
            local_rank: inner.local_rank,
            local_world: inner.local_world,
            timeouts,
            token: inner.token.clone(),
            algorithm: inner.algorithm,
            transport: inner.transport,
            restart_count: inner.restart_count,
            desync: super::DesyncCheck::new(inner.desync.is_some()),
            tag,
            subgroups: Default::default(),
            sub: Some(info),
            p2p,
            comm,
            heartbeat: inner.heartbeat.clone(),
            store: inner.store.clone(),
            server: None,
        })))
    }
}
