//! The cross-rank checks of a model: before training, every rank must have the same parameters,
//! in the same order, with the same shapes and dtypes ([`check_same_params`]); while training,
//! their values must stay the same ([`ReplicaCheck`]).

use super::ParamInfo;
use crate::error::ModelError;
use crate::group::ProcessGroup;
pub use crate::types::digest;
use crate::types::{Rank, ReduceOp};
use crate::{DdpError, Result};

/// Checks that every rank of `pg` has the same `params` (names, shapes, dtypes, in order).
/// Every rank must call it.
///
/// # Errors
/// [`ModelError::ModelMismatch`](crate::ModelError::ModelMismatch) naming the first parameter that differs and what each rank has
/// there; collective failures.
pub fn check_same_params(pg: &ProcessGroup, params: &[ParamInfo]) -> Result<()> {
    let text: String = params.iter().map(|p| p.line() + "\n").collect();
    let lists: Vec<Vec<String>> = pg
        .all_gather_bytes(text.as_bytes())?
        .into_iter()
        .map(|b| {
            String::from_utf8_lossy(&b)
                .lines()
                .map(str::to_owned)
                .collect()
        })
        .collect();
    first_mismatch(pg.rank(), &lists)
}

fn ranks_text(ranks: &[usize]) -> String {
    let list: Vec<String> = ranks.iter().map(usize::to_string).collect();
    if ranks.len() == 1 {
        format!("rank {}", list[0])
    } else {
        format!("ranks {}", list.join(", "))
    }
}

/// Finds the first parameter whose description differs between ranks.
fn first_mismatch(rank: Rank, lists: &[Vec<String>]) -> Result<()> {
    let longest = lists.iter().map(Vec::len).max().unwrap_or(0);
    for i in 0..longest {
        let at = |r: usize| lists[r].get(i).map(String::as_str);
        if (0..lists.len()).all(|r| at(r) == at(0)) {
            continue;
        }
        // Group the ranks by what they have at position i.
        let mut groups: Vec<(Option<&str>, Vec<usize>)> = Vec::new();
        for r in 0..lists.len() {
            match groups.iter_mut().find(|(v, _)| *v == at(r)) {
                Some((_, rs)) => rs.push(r),
                None => groups.push((at(r), vec![r])),
            }
        }
        let show = |v: Option<&str>| match v {
            Some(line) => {
                let mut parts = line.split('\t');
                let name = parts.next().unwrap_or("");
                let shape = parts.next().unwrap_or("");
                let dtype = parts.next().unwrap_or("");
                format!("`{name}` with shape {shape} and dtype {dtype}")
            }
            None => "no parameter (the model has fewer parameters)".to_owned(),
        };
        let detail = groups
            .iter()
            .map(|(v, rs)| {
                format!(
                    "{} {} {}",
                    ranks_text(rs),
                    if rs.len() == 1 { "has" } else { "have" },
                    show(*v)
                )
            })
            .collect::<Vec<_>>()
            .join("; ");
        let param = at(0)
            .and_then(|l| l.split('\t').next())
            .unwrap_or("(none on rank 0)")
            .to_owned();
        return Err(DdpError::Model(ModelError::ModelMismatch {
            rank,
            index: i,
            param,
            detail,
        }));
    }
    Ok(())
}

/// The periodic comparison of the ranks' parameters: [`ReplicaCheck::due`] counts synchronised
/// steps, [`ReplicaCheck::compare`] compares the digests of every parameter across ranks.
#[derive(Debug, Clone)]
pub struct ReplicaCheck {
    every: u64,
    steps: u64,
}

impl ReplicaCheck {
    /// A check every `every` steps (0: never).
    pub fn new(every: u64) -> Self {
        Self { every, steps: 0 }
    }

    /// Counts one synchronised step; `Some(step)` when the ranks should compare now (every rank
    /// counts the same steps, so they agree without talking).
    pub fn due(&mut self) -> Option<u64> {
        self.steps += 1;
        (self.every > 0 && self.steps.is_multiple_of(self.every)).then_some(self.steps)
    }

    /// Compares `params` (name and [`digest`] of each parameter, in visit order) across the
    /// ranks of `pg`: two all-reduces of one integer per parameter, and, if some differ, one
    /// gather to say which ranks hold which value. Every rank must call it.
    ///
    /// # Errors
    /// [`ModelError::ReplicasDiverged`](crate::ModelError::ReplicasDiverged) naming the first parameter that differs; collective
    /// failures.
    pub fn compare(pg: &ProcessGroup, step: u64, params: &[(String, u64)]) -> Result<()> {
        let mut lo: Vec<i64> = params.iter().map(|(_, d)| *d as i64).collect();
        let mut hi = lo.clone();
        pg.all_reduce(&mut lo, ReduceOp::Min)?;
        pg.all_reduce(&mut hi, ReduceOp::Max)?;
        let Some(index) = (0..params.len()).find(|&i| lo[i] != hi[i]) else {
            return Ok(());
        };
        let (name, mine) = &params[index];
        let all = pg.all_gather_bytes(&mine.to_le_bytes())?;
        let mut groups: Vec<(Vec<u8>, Vec<usize>)> = Vec::new();
        for (r, d) in all.into_iter().enumerate() {
            match groups.iter_mut().find(|(v, _)| *v == d) {
                Some((_, rs)) => rs.push(r),
                None => groups.push((d, vec![r])),
            }
        }
        let detail = groups
            .iter()
            .map(|(d, rs)| {
                let d = u64::from_le_bytes(d.as_slice().try_into().unwrap_or([0; 8]));
                format!(
                    "{} {} digest {d:016x}",
                    ranks_text(rs),
                    if rs.len() == 1 { "has" } else { "have" }
                )
            })
            .collect::<Vec<_>>()
            .join(", ");
        Err(DdpError::Model(ModelError::ReplicasDiverged {
            rank: pg.rank(),
            step,
            index,
            param: name.clone(),
            detail: format!("differs: {detail}"),
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lines(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| (*s).to_owned()).collect()
    }

    #[test]
    fn the_first_differing_parameter_is_named_with_each_side() {
        let a = ParamInfo::new("fc.weight", vec![4, 2], "F32").line();
        let b = ParamInfo::new("fc.weight", vec![4, 3], "F32").line();
        let bias = ParamInfo::new("fc.bias", vec![4], "F32").line();
        let lists = vec![
            lines(&[&a, &bias]),
            lines(&[&a, &bias]),
            lines(&[&b, &bias]),
        ];
        let err = first_mismatch(Rank(1), &lists).unwrap_err();
        let DdpError::Model(ModelError::ModelMismatch {
            index,
            param,
            detail,
            ..
        }) = &err
        else {
            panic!("{err:?}")
        };
        assert_eq!((*index, param.as_str()), (0, "fc.weight"));
        assert!(
            detail.contains("ranks 0, 1 have `fc.weight` with shape [4, 2]"),
            "{detail}"
        );
        assert!(
            detail.contains("rank 2 has `fc.weight` with shape [4, 3]"),
            "{detail}"
        );
    }

    #[test]
    fn a_missing_parameter_is_a_mismatch_and_equal_lists_are_not() {
        let a = ParamInfo::new("w", vec![1], "F32").line();
        assert!(first_mismatch(Rank(0), &[lines(&[&a]), lines(&[&a])]).is_ok());
        let err = first_mismatch(Rank(0), &[lines(&[&a]), lines(&[])]).unwrap_err();
        assert!(err.to_string().contains("fewer parameters"), "{err}");
    }

    #[test]
    fn a_check_is_due_every_n_steps_and_never_at_zero() {
        let mut c = ReplicaCheck::new(3);
        let due: Vec<Option<u64>> = (0..7).map(|_| c.due()).collect();
        assert_eq!(due, [None, None, Some(3), None, None, Some(6), None]);
        let mut never = ReplicaCheck::new(0);
        assert!((0..10).all(|_| never.due().is_none()));
    }

    #[test]
    fn diverged_replicas_are_named_by_parameter_and_ranks() {
        use crate::types::WorldSize;
        let groups = ProcessGroup::local(WorldSize::new(3).unwrap(), crate::Timeouts::default());
        let results: Vec<Result<()>> = std::thread::scope(|s| {
            let handles: Vec<_> = groups
                .into_iter()
                .map(|pg| {
                    s.spawn(move || {
                        let rank = pg.rank().index();
                        let mut w = digest(b"weights");
                        if rank == 2 {
                            w ^= 1;
                        }
                        let params = vec![
                            ("fc.bias".to_owned(), digest(b"bias")),
                            ("fc.weight".to_owned(), w),
                        ];
                        ReplicaCheck::compare(&pg, 100, &params[..1])?;
                        ReplicaCheck::compare(&pg, 100, &params)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for r in results {
            let e = r.unwrap_err();
            let DdpError::Model(ModelError::ReplicasDiverged {
                step,
                index,
                param,
                detail,
                ..
            }) = &e
            else {
                panic!("{e:?}")
            };
            assert_eq!((*step, *index, param.as_str()), (100, 1, "fc.weight"));
            assert!(detail.contains("ranks 0, 1 have digest"), "{detail}");
            assert!(detail.contains("rank 2 has digest"), "{detail}");
        }
    }
}
