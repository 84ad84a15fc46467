//! Test helpers of the Burn 0.21 line: the process harness, the model comparison, spawned jobs
//! and migration diffs (from `burn-ddp-dev`, shared with the Burn 0.22 line's tests), network
//! namespaces, model parameters.
#![allow(dead_code)]

#[allow(unused_imports)] // each test binary uses some of them
pub use burn_ddp_dev::{compare, diff, netns, spawned};

#[allow(unused_imports)] // some test binaries use only `spawned`
pub use burn_ddp_dev::procs::*;

use burn::module::{Module, ModuleVisitor, Param};
use burn::tensor::backend::Backend;
use burn::tensor::Tensor;

/// Every float parameter of `m`, flattened, in the order Burn visits them (to compare models
/// across ranks or runs).
pub fn params<B: Backend, M: Module<B>>(m: &M) -> Vec<f32> {
    struct Collect<'a>(&'a mut Vec<f32>);
    impl<B: Backend> ModuleVisitor<B> for Collect<'_> {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<B, D>>) {
            self.0.extend(
                p.val()
                    .into_data()
                    .convert::<f32>()
                    .to_vec::<f32>()
                    .unwrap(),
            );
        }
    }
    let mut out = Vec::new();
    m.visit(&mut Collect(&mut out));
    out
}
