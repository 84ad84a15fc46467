//! Buffers kept in sync (PyTorch's `broadcast_buffers`): the part of a Burn line's
//! `sync_buffers` that does not touch Burn. The line reads its model's buffers (float tensors
//! without a gradient: BatchNorm's running statistics) into one `Vec<f32>` in visit order,
//! calls [`broadcast_buffers`], and writes the result back in the same order.

use crate::group::ProcessGroup;
use crate::types::Rank;
use crate::{DdpError, Result};

/// Puts `root`'s buffer values on every rank of `pg`, in place of this rank's `values`.
/// `unreadable` is what this rank could not read as `f32` (a buffer of another type), if
/// anything: the broadcast runs first all the same, so that no rank waits in it for one that
/// failed, and then this rank fails.
///
/// # Errors
/// The broadcast's errors (a dead peer, a deadline), or [`ModelError::Access`](crate::ModelError::Access) naming the buffer
/// this rank could not read.
pub fn broadcast_buffers(
    pg: &ProcessGroup,
    mut values: Vec<f32>,
    unreadable: Option<String>,
    root: Rank,
) -> Result<Vec<f32>> {
    pg.broadcast(&mut values, root)?;
    if let Some(what) = unreadable {
        return Err(DdpError::model_access(
            pg.rank(),
            "synchronising buffers",
            format!("a buffer cannot be read as f32 ({what})"),
        ));
    }
    Ok(values)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Timeouts;
    use std::time::Duration;

    #[test]
    fn every_rank_gets_roots_values_and_an_unreadable_buffer_fails_after_the_broadcast() {
        let groups = ProcessGroup::local(
            crate::types::WorldSize::new(3).unwrap(),
            Timeouts::uniform(Duration::from_secs(20)),
        );
        let results: Vec<Result<Vec<f32>>> = std::thread::scope(|s| {
            let handles: Vec<_> = groups
                .into_iter()
                .map(|pg| {
                    s.spawn(move || {
                        let r = pg.rank().0;
                        let unreadable = (r == 2).then(|| "layer.running_var: i64".to_string());
                        broadcast_buffers(&pg, vec![r as f32; 4], unreadable, Rank(1))
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert_eq!(results[0].as_ref().unwrap(), &vec![1.0; 4]);
        assert_eq!(results[1].as_ref().unwrap(), &vec![1.0; 4]);
        let err = results[2].as_ref().unwrap_err().to_string();
        assert!(err.contains("layer.running_var: i64"), "{err}");
    }
}
