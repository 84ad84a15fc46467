//! `#[ddp]` on a real Burn module, trained on 2 real processes: the synchronised field ends
//! identical on both ranks, the `#[ddp(skip)]` field stays each rank's own (not broadcast from
//! rank 0, not averaged) — on the overlapped path and on the `no_sync` + `sync_gradients` path.

use crate::common;

use burn::backend::{Autodiff, NdArray};
use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::optim::{GradientsParams, Optimizer, SgdConfig};
use burn::tensor::backend::Backend;
use burn::tensor::{Distribution, Tensor};
use burn_ddp::{ddp, Ddp, DdpConfig, DdpModule, DdpSession, ReduceOp};

type B = Autodiff<Ddp<NdArray>>;

#[ddp]
#[derive(Module, Debug)]
struct Net<B: Backend> {
    body: Linear<B>,
    /// Rank-local.
    #[ddp(skip)]
    head: Linear<B>,
}

fn values(l: &Linear<B>) -> Vec<f32> {
    l.weight
        .val()
        .into_data()
        .convert::<f32>()
        .to_vec()
        .unwrap()
}

/// (min, max) over ranks of each value; equal everywhere iff min == max.
fn spread(pg: &burn_ddp::ProcessGroup, v: &[f32]) -> f32 {
    let mut hi = v.to_vec();
    let mut lo: Vec<f32> = v.iter().map(|x| -x).collect();
    pg.all_reduce(&mut hi, ReduceOp::Max).unwrap();
    pg.all_reduce(&mut lo, ReduceOp::Max).unwrap();
    hi.iter().zip(&lo).map(|(h, l)| h + l).fold(0.0, f32::max)
}

#[test]
fn generated_items_describe_the_struct() {
    assert_eq!(<Net<B> as DdpModule>::DDP_NAME, "Net");
    assert_eq!(<Net<B> as DdpModule>::DDP_FIELDS, ["body", "head"]);
    assert_eq!(<Net<B> as DdpModule>::DDP_SKIP, ["head"]);
}

#[test]
fn skipped_fields_stay_rank_local() {
    const NAME: &str = "skipped_fields_stay_rank_local";
    if let Some(pg) = common::child_group(NAME) {
        let rank = pg.rank().index();
        let device = Default::default();
        // Different initial weights on each rank.
        <B as Backend>::seed(&device, 100 + rank as u64);
        let net = Net::<B> {
            body: LinearConfig::new(4, 4).init(&device),
            head: LinearConfig::new(4, 2).init(&device),
        };
        let head_before = values(&net.head);
        let session = DdpSession::new(pg.clone(), DdpConfig::default()).unwrap();
        let mut net = session.prepare_module(net).unwrap();
        let names: Vec<String> = session.params().into_iter().map(|p| p.name).collect();
        assert_eq!(names, ["body.weight", "body.bias"]);
        assert_eq!(
            values(&net.head),
            head_before,
            "the skipped head was overwritten"
        );
        assert_eq!(spread(&pg, &values(&net.body)), 0.0, "body not broadcast");
        assert!(spread(&pg, &values(&net.head)) > 0.0);

        let mut optim = SgdConfig::new().init();
        for step in 0..6 {
            <B as Backend>::seed(&device, 1000 * rank as u64 + step);
            let x = Tensor::<B, 2>::random([3, 4], Distribution::Normal(0.0, 1.0), &device);
            let loss = net.head.forward(net.body.forward(x)).powi_scalar(2).mean();
            let grads = if step % 2 == 0 {
                GradientsParams::from_grads(session.backward(loss).unwrap(), &net)
            } else {
                let local = {
                    let _g = session.no_sync();
                    GradientsParams::from_grads(loss.backward(), &net)
                };
                session.sync_gradients(&net, local).unwrap()
            };
            net = optim.step(0.1, net, grads);
        }
        assert_eq!(spread(&pg, &values(&net.body)), 0.0, "body diverged");
        assert!(
            spread(&pg, &values(&net.head)) > 1e-3,
            "head was synchronised"
        );
        return;
    }
    if !common::is_any_child() {
        common::TestJob::new(2, NAME).run().assert_all_ok();
    }
}
