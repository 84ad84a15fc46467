//! The guide's training-loop migration for Burn 0.22 and 0.23 users (`docs/guide.md`, section
//! 5): a loop of its own shaped like Burn's custom-loop examples
//! (`examples/custom_loop_before/gradsync.rs`: data generated with `rand`, the epoch's metrics printed,
//! the model saved) moves to `GradSync` in at most 15 changed lines
//! (`examples/custom_loop_after/gradsync.rs`, each marked `// ddp:`), and the result trains on 2
//! processes holding one model, printing the job's metrics and saving the model once. A dataset
//! that differs between the ranks (the "before" program's unseeded generator, kept) is refused
//! at the first step, naming the fix.

use std::sync::Arc;
use std::thread;
use std::time::Duration;

use burn::data::dataset::InMemDataset;
use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::optim::GradientsParams;
use burn::prelude::*;
use burn_ddp::{DdpConfig, DistributedSampler, GradSync, ProcessGroup, Timeouts, WorldSize};
use burn_ddp_dev::diff::{self, changed, code};
use rand::Rng;

#[test]
fn the_training_loop_migration_changes_at_most_15_lines_each_marked() {
    let before = code("examples/custom_loop_before/gradsync.rs");
    let after = code("examples/custom_loop_after/gradsync.rs");
    let (added, removed) = changed(&before, &after);
    println!("{added} lines added or modified, {removed} removed");
    assert!(added <= 15, "the migration takes {added} changed lines");
    let marked = after.iter().filter(|l| l.contains("// ddp:")).count();
    assert_eq!(
        marked, added,
        "every added or modified line is marked `// ddp:`"
    );
    assert!(before.iter().any(|l| l.contains("optim.step(")));
    assert!(before.iter().any(|l| l.contains("rand::rng()")));
    assert!(before.iter().any(|l| l.contains(".save_file(")));
    assert!(!before.iter().any(|l| l.contains("burn_ddp")));
}

#[test]
fn the_migrated_loop_trains_on_two_ranks_printing_and_saving_once() {
    diff::assert_custom_loop_prints_and_saves_once("custom_loop_after", "model.bpk");
}

#[derive(Module, Debug)]
struct Net {
    linear: Linear,
}

#[test]
fn datasets_generated_without_a_seed_are_refused_at_the_first_step() {
    let groups = ProcessGroup::local(
        WorldSize::new(2).unwrap(),
        Timeouts::uniform(Duration::from_secs(60)),
    );
    let handles: Vec<_> = groups
        .into_iter()
        .map(|pg| {
            thread::spawn(move || {
                // The "before" program's data: a generator without a seed, on every rank.
                let mut rng = rand::rng();
                let points: Vec<[u32; 2]> =
                    (0..256).map(|_| [rng.random(), rng.random()]).collect();
                let sampler = Arc::new(DistributedSampler::new(InMemDataset::new(points), &pg));
                let mut sync = GradSync::new(pg, DdpConfig::default()).unwrap();
                let device = Device::default().autodiff();
                device.seed(1);
                let model = sync
                    .prepare(Net {
                        linear: LinearConfig::new(2, 1).init(&device),
                    })
                    .unwrap();
                let x = Tensor::<2>::ones([4, 2], &device);
                let grads =
                    GradientsParams::from_grads(model.linear.forward(x).sum().backward(), &model);
                let e = sync.sync(&model, grads).unwrap_err().to_string();
                drop(sampler);
                e
            })
        })
        .collect();
    for (rank, h) in handles.into_iter().enumerate() {
        let e = h.join().unwrap();
        diff::assert_unseeded_data_refused(rank, &e);
    }
}
