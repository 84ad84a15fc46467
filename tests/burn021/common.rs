//! Helpers of the Burn 0.21 line's end-to-end tests: the process harness, spawned jobs,
//! migration diffs and network namespaces (`burn-ddp-dev`, shared with the 0.22/0.23 line), and
//! a model's parameters.

pub use burn_ddp_dev::procs::{child_group, is_any_child, TestJob};
pub use burn_ddp_dev::{diff, netns, spawned};

use burn::module::{Module, ModuleVisitor, Param};
use burn::tensor::backend::Backend;
use burn::tensor::Tensor;

/// Every float parameter of `m`, flattened, in the order Burn visits them (to compare models
/// across ranks or runs).
pub fn params<B: Backend, M: Module<B>>(m: &M) -> Vec<f32> {
    struct Collect<'a>(&'a mut Vec<f32>);
    impl<B: Backend> ModuleVisitor<B> for Collect<'_> {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<B, D>>) {
            let data = p.val().into_data().convert::<f32>();
            self.0
                .extend(data.to_vec::<f32>().expect("f32 after convert"));
        }
    }
    let mut out = Vec::new();
    m.visit(&mut Collect(&mut out));
    out
}
