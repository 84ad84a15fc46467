//! [`Replica`]: the part of the line contract that makes a model the same on every rank. A Burn
//! line implements it over its release's `Module` (its parameters in visit order, its record
//! as bytes); the core does the rest, the same for every line: [`check_and_load`] at
//! `prepare` (every rank has the same parameters, then rank 0's record on every rank) and
//! [`load_from`] (one rank's record on every rank: at the end of a join, the rank that trained
//! longest); and [`compare_replicas`], the periodic check that the ranks' synchronised
//! parameters are still equal.

use std::collections::HashSet;

use super::{check_same_params, digest, ParamInfo, ReplicaCheck};
use crate::group::ProcessGroup;
use crate::types::Rank;
use crate::Result;

/// A model as the core sees it: a line's adapter over its Burn release's module.
pub trait Replica: Sized {
    /// Every float parameter the ranks must agree on, in visit order (name, shape, dtype), and
    /// whether it is trainable. Parameters the line keeps rank-local (`#[ddp(skip)]` fields)
    /// are left out.
    fn params(&self) -> Vec<(ParamInfo, bool)>;

    /// The whole record (parameters and buffers) as bytes, with pending updates of running
    /// statistics folded in first, so that what is sent is current.
    ///
    /// # Errors
    /// The record cannot be serialised (a [`ModelError::Access`](crate::ModelError::Access) naming
    /// `rank`).
    fn record_bytes(&self, rank: Rank) -> Result<Vec<u8>>;

    /// `self` with the record `bytes` (from [`record_bytes`](Self::record_bytes) on another
    /// rank) loaded; pending updates of running statistics are folded in before, so that none
    /// overwrites what is loaded. Rank-local parameters keep their values.
    ///
    /// # Errors
    /// The record cannot be read or does not fit the model (a
    /// [`ModelError::Access`](crate::ModelError::Access) naming `rank`).
    fn load_record_bytes(self, rank: Rank, bytes: Vec<u8>) -> Result<Self>;

    /// The values of the float parameters whose names (as [`params`](Self::params) gives
    /// them) `keep` selects, read to the host and handed to `each` with the name, in visit
    /// order. The core digests them to compare the ranks' replicas ([`compare_replicas`]).
    fn param_values(&self, keep: &dyn Fn(&str) -> bool, each: &mut dyn FnMut(String, &[u8]));
}

/// Compares the parameters named in `synced` (those gradient synchronisation keeps equal: the
/// prepared bucket plan's, the same on every rank; not buffers such as BatchNorm's running
/// statistics, which each rank updates from its own batches, nor rank-local fields) across the
/// ranks of `pg`, by a [`digest`] of each ([`ReplicaCheck::compare`]). Every rank must call it
/// at the same point; `step` is the synchronised step it is said at (0: called by the user).
///
/// # Errors
/// [`ModelError::ReplicasDiverged`](crate::ModelError::ReplicasDiverged) naming the first
/// parameter that differs; collective failures.
pub fn compare_replicas<M: Replica>(
    pg: &ProcessGroup,
    step: u64,
    model: &M,
    synced: &HashSet<String>,
) -> Result<()> {
    let mut digests = Vec::new();
    model.param_values(&|name| synced.contains(name), &mut |name, bytes| {
        digests.push((name, digest(bytes)));
    });
    ReplicaCheck::compare(pg, step, &digests)
}

/// `root`'s record loaded into every other rank's `model` (one broadcast of its bytes). Every
/// rank must call it with the same `root`.
///
/// # Errors
/// What [`Replica::record_bytes`] or [`Replica::load_record_bytes`] fail with; collective
/// failures.
pub fn load_from<M: Replica>(pg: &ProcessGroup, model: M, root: Rank) -> Result<M> {
    let rank = pg.rank();
    if pg.world_size().as_usize() == 1 {
        return Ok(model);
    }
    let bytes = if rank == root {
        model.record_bytes(rank)?
    } else {
        Vec::new()
    };
    let bytes = pg.broadcast_bytes(bytes, root)?;
    if rank == root {
        return Ok(model);
    }
    model.load_record_bytes(rank, bytes)
}

/// The start of `prepare` on every line: checks that every rank has the same parameters
/// ([`check_same_params`]), then, when `from_root`, loads rank 0's record on every rank (after
/// a change of membership the ranks' models are equal already, and `from_root` is `false`).
///
/// # Errors
/// [`ModelError::ModelMismatch`](crate::ModelError::ModelMismatch) naming the first parameter that
/// differs; what [`load_from`] fails with.
pub fn check_and_load<M: Replica>(pg: &ProcessGroup, model: M, from_root: bool) -> Result<M> {
    let all: Vec<ParamInfo> = model.params().into_iter().map(|(i, _)| i).collect();
    check_same_params(pg, &all)?;
    if from_root {
        load_from(pg, model, Rank(0))
    } else {
        Ok(model)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ModelError;
    use crate::group::on_local_ranks;
    use crate::DdpError;

    /// A model of one parameter whose record is its values as text.
    struct Fake {
        name: &'static str,
        values: Vec<u8>,
    }

    impl Replica for Fake {
        fn params(&self) -> Vec<(ParamInfo, bool)> {
            vec![(
                ParamInfo::new(self.name, vec![self.values.len()], "F32"),
                true,
            )]
        }
        fn record_bytes(&self, _rank: Rank) -> Result<Vec<u8>> {
            Ok(self.values.clone())
        }
        fn load_record_bytes(mut self, rank: Rank, bytes: Vec<u8>) -> Result<Self> {
            if bytes.len() != self.values.len() {
                return Err(DdpError::model_access(
                    rank,
                    "loading the model received",
                    "wrong size",
                ));
            }
            self.values = bytes;
            Ok(self)
        }
        fn param_values(&self, keep: &dyn Fn(&str) -> bool, each: &mut dyn FnMut(String, &[u8])) {
            if keep(self.name) {
                each(self.name.to_owned(), &self.values);
            }
        }
    }

    fn run(names: [&'static str; 3], root: Option<Rank>) -> Vec<Result<Vec<u8>>> {
        on_local_ranks(3, |pg| {
            let r = pg.rank().index();
            let model = Fake {
                name: names[r],
                values: vec![r as u8; 4],
            };
            let model = match root {
                None => check_and_load(&pg, model, true),
                Some(root) => load_from(&pg, model, root),
            };
            model.map(|m| m.values)
        })
    }

    #[test]
    fn prepare_checks_then_loads_rank_0s_record_everywhere() {
        for got in run(["w", "w", "w"], None) {
            assert_eq!(got.unwrap(), vec![0; 4]);
        }
    }

    #[test]
    fn a_rank_with_other_parameters_is_named_and_nothing_is_loaded() {
        for got in run(["w", "w", "v"], None) {
            let err = got.unwrap_err();
            assert!(
                matches!(err, DdpError::Model(ModelError::ModelMismatch { .. })),
                "{err:?}"
            );
        }
    }

    #[test]
    fn load_from_takes_the_given_roots_record() {
        for got in run(["w", "w", "w"], Some(Rank(2))) {
            assert_eq!(got.unwrap(), vec![2; 4]);
        }
    }

    #[test]
    fn replicas_are_compared_on_the_synchronised_parameters_only() {
        // Rank 1's "w" differs; "b" (not synchronised, e.g. rank-local) differs everywhere.
        let got = on_local_ranks(3, |pg| {
            let r = pg.rank().index();
            let synced: HashSet<String> = ["w".to_owned()].into();
            let w = Fake {
                name: "w",
                values: vec![u8::from(r == 1); 4],
            };
            let b = Fake {
                name: "b",
                values: vec![r as u8; 4],
            };
            (
                compare_replicas(&pg, 7, &b, &synced),
                compare_replicas(&pg, 7, &w, &synced),
            )
        });
        for (b, w) in got {
            assert!(b.is_ok(), "{b:?}");
            match w.unwrap_err() {
                DdpError::Model(ModelError::ReplicasDiverged {
                    step,
                    param,
                    detail,
                    ..
                }) => {
                    assert_eq!((step, param.as_str()), (7, "w"));
                    assert!(
                        detail.contains("ranks 0, 2 have") && detail.contains("rank 1 has"),
                        "{detail}"
                    );
                }
                e => panic!("{e:?}"),
            }
        }
    }
}
