//! The guide's training-loop migration (`docs/guide.md`, section 2): a loop of its own shaped
//! like Burn 0.21's custom-loop examples (the repository's top-level
//! `examples/custom_loop_before/burn021.rs`, the root package's: data generated in the program, the
//! epoch's metrics printed, the model saved) moves to burn-ddp in at most 15 changed lines
//! (`examples/custom_loop_after/burn021.rs`, each marked `// ddp:`), and the result trains on 2
//! processes holding one model, printing and saving once. A dataset that differs between the
//! ranks (generated without a seed) is refused at the first step, naming the fix.

use crate::common;

use burn::backend::{Autodiff, NdArray};
use burn::data::dataset::InMemDataset;
use burn::nn::{Linear, LinearConfig};
use burn::prelude::*;
use burn_ddp::{Ddp, DdpConfig, DdpSession, DistributedSampler};
use common::diff::{self, changed, code};
use rand::Rng;

#[test]
fn the_training_loop_migration_changes_at_most_15_lines_each_marked() {
    let before = code("examples/custom_loop_before/burn021.rs");
    let after = code("examples/custom_loop_after/burn021.rs");
    let (added, removed) = changed(&before, &after);
    // Plus one line that both files already hold: the backend in `main`, `Autodiff<NdArray>`
    // in Burn's examples, `Autodiff<Ddp<NdArray>>` here (step 1 of the guide).
    let lines = added + 1;
    println!("{added} lines added or modified, {removed} removed, plus the backend line");
    assert!(lines <= 15, "the migration takes {lines} changed lines");
    let marked = after.iter().filter(|l| l.contains("// ddp:")).count();
    assert_eq!(
        marked, added,
        "every added or modified line is marked `// ddp:`"
    );
    assert!(before
        .iter()
        .any(|l| l.contains("pub fn run<B: AutodiffBackend>")));
    assert!(before.iter().any(|l| l.contains("optim.step(")));
    assert!(before.iter().any(|l| l.contains(".save_file(")));
}

#[test]
fn the_migrated_loop_trains_on_two_ranks_printing_and_saving_once() {
    diff::assert_custom_loop_prints_and_saves_once("custom_loop_after", "model.mpk");
}

type B = Autodiff<Ddp<NdArray>>;

#[derive(Module, Debug)]
struct Net<B: Backend> {
    linear: Linear<B>,
}

#[test]
fn datasets_generated_without_a_seed_are_refused_at_the_first_step() {
    const NAME: &str = "datasets_generated_without_a_seed_are_refused_at_the_first_step";
    if let Some(pg) = common::child_group(NAME) {
        let rank = pg.rank().index();
        // Data from a generator without a seed, on every rank.
        let mut rng = rand::rng();
        let points: Vec<[u32; 2]> = (0..256).map(|_| [rng.random(), rng.random()]).collect();
        let _sampler = DistributedSampler::new(InMemDataset::new(points), &pg);
        let session = DdpSession::new(pg, DdpConfig::default()).unwrap();
        let device = Default::default();
        B::seed(&device, 1);
        let model = session
            .prepare(Net::<B> {
                linear: LinearConfig::new(2, 1).init(&device),
            })
            .unwrap();
        let x = Tensor::<B, 2>::ones([4, 2], &device);
        let e = session
            .gradients(&model, model.linear.forward(x).sum())
            .unwrap_err()
            .to_string();
        println!("rank {rank} error: {e}");
        diff::assert_unseeded_data_refused(rank, &e);
        return;
    }
    if !common::is_any_child() {
        common::TestJob::new(2, NAME).run().assert_all_ok();
    }
}
