//! Times SGD steps of a model from `burn-ddp-step-model` on plain `Autodiff<NdArray>`.
//! Usage: `plain-autodiff <mlp|many> <batch> <warmup> <steps>`.

use burn::backend::{Autodiff, NdArray};
use burn::module::AutodiffModule;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::Tensor;

use burn_ddp_step_model::{print_result, time_steps, Trainer, Which};

type B = Autodiff<NdArray>;

struct Plain;

impl Trainer<B> for Plain {
    fn prepare<M: AutodiffModule<B>>(&mut self, model: M) -> M {
        model
    }
    fn backward(&mut self, loss: Tensor<B, 1>) -> <B as AutodiffBackend>::Gradients {
        loss.backward()
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let usage = "usage: plain-autodiff <mlp|many> <batch> <warmup> <steps>";
    let [which, batch, warmup, steps] = args.as_slice() else {
        eprintln!("{usage}");
        std::process::exit(2);
    };
    let (Some(which), Ok(batch), Ok(warmup), Ok(steps)) = (
        Which::parse(which),
        batch.parse(),
        warmup.parse(),
        steps.parse(),
    ) else {
        eprintln!("{usage}");
        std::process::exit(2);
    };
    let times = time_steps::<B>(which, batch, warmup, steps, &mut Plain);
    print_result("plain", &times);
}
