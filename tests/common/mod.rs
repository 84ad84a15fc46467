//! Test helpers of the Burn 0.21 line: the process harness (`procs.rs`) and the model comparison
//! (`compare.rs`), both shared with the Burn 0.22 line's tests; spawned jobs; model parameters.
#![allow(dead_code)]

pub mod compare;
pub mod diff;
pub mod netns;
mod procs;
pub mod spawned;

#[allow(unused_imports)] // some test binaries use only `spawned`
pub use procs::*;

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
