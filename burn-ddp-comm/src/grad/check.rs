//! The cross-rank check of a model before training: every rank must have the same parameters,
//! in the same order, with the same shapes and dtypes.

use super::ParamInfo;
use crate::group::ProcessGroup;
use crate::types::Rank;
use crate::{DdpError, Result};

/// Checks that every rank of `pg` has the same `params` (names, shapes, dtypes, in order).
/// Every rank must call it.
///
/// # Errors
/// [`DdpError::ModelMismatch`] naming the first parameter that differs and what each rank has
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
        return Err(DdpError::ModelMismatch {
            rank,
            index: i,
            param,
            detail,
        });
    }
    Ok(())
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
        let DdpError::ModelMismatch {
            index,
            param,
            detail,
            ..
        } = &err
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
}
