//! The sparse mixture-of-experts block of Qwen3 MoE-style targets: a
//! softmax router picks `top_k` experts per token (weights optionally
//! renormalised to sum to 1), each expert is a SwiGLU MLP, and the token's
//! output is the weighted sum of its experts' outputs.
//!
//! The experts run as two grouped GEMMs over tokens sorted by expert
//! (libtorch's `_grouped_mm`: one kernel for all experts on Hopper, a loop
//! over the groups elsewhere), not as a loop of tiny matmuls per expert.
//! Nothing here reads a tensor back to the host, so a CUDA forward stays
//! asynchronous.

use tch::{Kind, Tensor};

/// One MoE feed-forward block with its experts' weights stacked.
#[derive(Debug)]
pub struct SparseMoe {
    /// Router `[E, H]` (`mlp.gate.weight`).
    pub router: Tensor,
    /// Every expert's gate and up projections, gate first: `[E, 2I, H]`.
    pub gate_up: Tensor,
    /// Every expert's down projection: `[E, H, I]`.
    pub down: Tensor,
    pub top_k: i64,
    pub norm_topk_prob: bool,
}

impl SparseMoe {
    /// Stacks per-expert `(gate [I, H], up [I, H], down [H, I])` weights.
    pub fn from_experts(
        router: Tensor,
        experts: Vec<(Tensor, Tensor, Tensor)>,
        top_k: i64,
        norm_topk_prob: bool,
    ) -> Self {
        let _guard = tch::no_grad_guard();
        let gate_up: Vec<Tensor> = experts.iter().map(|(g, u, _)| Tensor::cat(&[g, u], 0)).collect();
        let down: Vec<&Tensor> = experts.iter().map(|(_, _, d)| d).collect();
        Self { router, gate_up: Tensor::stack(&gate_up, 0), down: Tensor::stack(&down, 0), top_k, norm_topk_prob }
    }

    pub fn num_experts(&self) -> i64 {
        self.router.size()[0]
    }

    /// `x` `[.., H]` to `[.., H]`.
    pub fn forward(&self, x: &Tensor) -> Tensor {
        let shape = x.size();
        let h = *shape.last().expect("MoE input has a hidden dimension");
        let x = x.reshape([-1, h]);
        let (experts, k) = (self.num_experts(), self.top_k);
        // Routing in f32, as transformers does; the weights then take the
        // activations' dtype.
        let probs = x.linear(&self.router, None::<Tensor>).softmax(-1, Kind::Float);
        let (mut weights, chosen) = probs.topk(k, -1, true, true); // [T, k]
        if self.norm_topk_prob {
            weights = &weights / weights.sum_dim_intlist(-1, true, Kind::Float);
        }
        let weights = weights.to_kind(x.kind());
        // Every (token, slot) pair, grouped by its expert.
        let flat = chosen.reshape([-1]);
        let (_, order) = flat.sort_stable(true, 0, false);
        let token = order.floor_divide_scalar(k);
        let counts = Tensor::zeros([experts], (Kind::Int64, x.device())).scatter_add(0, &flat, &flat.ones_like());
        let offsets = counts.cumsum(0, Kind::Int);
        let rows = x.index_select(0, &token); // [T*k, H]
        let gate_up =
            rows.internal_grouped_mm(&self.gate_up.transpose(1, 2), Some(&offsets), None::<&Tensor>, None::<Kind>);
        let halves = gate_up.chunk(2, -1);
        let act = halves[0].silu() * &halves[1];
        let out = act.internal_grouped_mm(&self.down.transpose(1, 2), Some(&offsets), None::<&Tensor>, None::<Kind>);
        let out = out * weights.reshape([-1]).index_select(0, &order).unsqueeze(-1);
        x.zeros_like().index_add(0, &token, &out).reshape(shape.as_slice())
    }
}

#[cfg(test)]
mod tests {
    use tch::Device;

    use super::*;

    /// The definition, one token and one expert at a time.
    fn reference(m: &SparseMoe, x: &Tensor) -> Tensor {
        let (t, inter) = (x.size()[0], m.down.size()[2]);
        let probs = x.linear(&m.router, None::<Tensor>).softmax(-1, Kind::Float);
        let (w, idx) = probs.topk(m.top_k, -1, true, true);
        let rows: Vec<Tensor> = (0..t)
            .map(|i| {
                let norm = if m.norm_topk_prob { w.get(i).sum(Kind::Float).double_value(&[]) } else { 1.0 };
                let mut acc = x.get(i).zeros_like();
                for s in 0..m.top_k {
                    let e = idx.int64_value(&[i, s]);
                    let gu = m.gate_up.get(e);
                    let h = x.get(i).linear(&gu.narrow(0, 0, inter), None::<Tensor>).silu()
                        * x.get(i).linear(&gu.narrow(0, inter, inter), None::<Tensor>);
                    acc += h.linear(&m.down.get(e), None::<Tensor>) * (w.double_value(&[i, s]) / norm);
                }
                acc
            })
            .collect();
        Tensor::stack(&rows, 0)
    }

    #[test]
    fn grouped_experts_equal_the_per_token_definition() {
        tch::manual_seed(3);
        let (e, h, i) = (6, 16, 8);
        let opts = (Kind::Float, Device::Cpu);
        let experts: Vec<_> = (0..e)
            .map(|_| (Tensor::randn([i, h], opts), Tensor::randn([i, h], opts), Tensor::randn([h, i], opts)))
            .collect();
        for norm in [false, true] {
            let m = SparseMoe::from_experts(Tensor::randn([e, h], opts), experts_clone(&experts), 2, norm);
            // Some experts get no token at all in a batch this small.
            let x = Tensor::randn([5, h], opts);
            let got = m.forward(&x);
            let want = reference(&m, &x);
            let err = (&got - &want).abs().max().double_value(&[]) / want.abs().max().double_value(&[]);
            assert!(err < 1e-5, "norm_topk_prob {norm}: {err}");
            // Leading dimensions pass through.
            assert_eq!(m.forward(&x.view([1, 5, h])).size(), vec![1, 5, h]);
        }
    }

    fn experts_clone(v: &[(Tensor, Tensor, Tensor)]) -> Vec<(Tensor, Tensor, Tensor)> {
        v.iter().map(|(a, b, c)| (a.copy(), b.copy(), c.copy())).collect()
    }
}
