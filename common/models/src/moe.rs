//! The sparse mixture-of-experts block of Qwen3 MoE-style targets: a
//! softmax router picks `top_k` experts per token (weights optionally
//! renormalised to sum to 1), each expert is a SwiGLU MLP, and the token's
//! output is the weighted sum of its experts' outputs -- plus, in
//! Qwen3-Next and Qwen3.5 MoE, a shared expert every token passes through,
//! scaled by a sigmoid gate of its own.
//!
//! The experts run as two grouped GEMMs over tokens sorted by expert
//! (libtorch's `_grouped_mm`: one kernel for all experts on Hopper, a loop
//! over the groups elsewhere), not as a loop of tiny matmuls per expert.
//! Nothing here reads a tensor back to the host, so a CUDA forward stays
//! asynchronous.

use tch::{Kind, Tensor};

use crate::layers::Mlp;

/// The expert every token passes through, and its gate `[1, H]`
/// (`mlp.shared_expert`, `mlp.shared_expert_gate`): the token adds
/// `sigmoid(gate . x) * shared(x)`.
#[derive(Debug)]
pub struct SharedExpert {
    pub mlp: Mlp,
    pub gate: Tensor,
}

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
    pub shared: Option<SharedExpert>,
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
        Self {
            router,
            gate_up: Tensor::stack(&gate_up, 0),
            down: Tensor::stack(&down, 0),
            top_k,
            norm_topk_prob,
            shared: None,
        }
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
        let out = match self.grouped(&rows, &offsets) {
            Ok(out) => out,
            // libtorch's grouped GEMM takes f32/bf16/f16 only; other kinds
            // (f64 references) go expert by expert.
            Err(_) => self.expert_by_expert(&rows, &counts),
        };
        // Back to token order, then each token's weighted sum over its k
        // slots as one batched matmul: no atomics (index_add on bf16 took
        // 3x as long on an H200) and the sum accumulates in f32.
        let n = flat.size()[0];
        let inverse = order.empty_like().scatter(0, &order, &Tensor::arange(n, (Kind::Int64, x.device())));
        let per_slot = out.index_select(0, &inverse).view([-1, k, h]); // [T, k, H]
        let routed = weights.unsqueeze(1).bmm(&per_slot).squeeze_dim(1);
        let y = match &self.shared {
            Some(s) => routed + x.linear(&s.gate, None::<Tensor>).sigmoid() * s.mlp.forward(&x),
            None => routed,
        };
        y.reshape(shape.as_slice())
    }
}

impl SparseMoe {
    /// The experts as two grouped GEMMs over `rows` sorted by expert
    /// (`offsets`: cumulative row counts, int32).
    fn grouped(&self, rows: &Tensor, offsets: &Tensor) -> Result<Tensor, tch::TchError> {
        let gate_up =
            rows.f_internal_grouped_mm(&self.gate_up.transpose(1, 2), Some(offsets), None::<&Tensor>, None::<Kind>)?;
        let halves = gate_up.chunk(2, -1);
        let act = halves[0].silu() * &halves[1];
        act.f_internal_grouped_mm(&self.down.transpose(1, 2), Some(offsets), None::<&Tensor>, None::<Kind>)
    }

    /// The same, one matmul pair per expert (reads the counts back).
    fn expert_by_expert(&self, rows: &Tensor, counts: &Tensor) -> Tensor {
        let counts = Vec::<i64>::try_from(counts.to_device(tch::Device::Cpu)).expect("1-D counts");
        let inter = self.down.size()[2];
        let mut start = 0;
        let mut parts = Vec::with_capacity(counts.len());
        for (e, &n) in counts.iter().enumerate() {
            let r = rows.narrow(0, start, n);
            let gu = self.gate_up.get(e as i64);
            let act = r.linear(&gu.narrow(0, 0, inter), None::<Tensor>).silu()
                * r.linear(&gu.narrow(0, inter, inter), None::<Tensor>);
            parts.push(act.linear(&self.down.get(e as i64), None::<Tensor>));
            start += n;
        }
        Tensor::cat(&parts, 0)
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
    fn grouped_experts_equal_the_per_token_definition_in_any_kind() {
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
            // f64 takes the expert-by-expert path.
            let m64 = SparseMoe {
                router: m.router.to_kind(Kind::Double),
                gate_up: m.gate_up.to_kind(Kind::Double),
                down: m.down.to_kind(Kind::Double),
                shared: None,
                ..m
            };
            let x64 = x.to_kind(Kind::Double);
            let want = reference(&m64, &x64);
            let err = (m64.forward(&x64) - &want).abs().max().double_value(&[]) / want.abs().max().double_value(&[]);
            // Routing is f32 in any kind, as in transformers.
            assert!(err < 1e-6, "f64: {err}");
            // Leading dimensions pass through.
            assert_eq!(m.forward(&x.view([1, 5, h])).size(), vec![1, 5, h]);
        }
    }

    #[test]
    fn a_shared_expert_adds_its_gated_output_to_every_token() {
        tch::manual_seed(4);
        let (e, h, i) = (4, 8, 6);
        let opts = (Kind::Float, Device::Cpu);
        let experts: Vec<_> = (0..e)
            .map(|_| (Tensor::randn([i, h], opts), Tensor::randn([i, h], opts), Tensor::randn([h, i], opts)))
            .collect();
        let router = Tensor::randn([e, h], opts);
        let plain = SparseMoe::from_experts(router.copy(), experts_clone(&experts), 2, true);
        let mut with_shared = SparseMoe::from_experts(router, experts, 2, true);
        let lin = |o, i| crate::layers::Linear { weight: Tensor::randn([o, i], opts), bias: None };
        let mlp = crate::layers::Mlp { gate_proj: lin(i, h), up_proj: lin(i, h), down_proj: lin(h, i) };
        let gate = Tensor::randn([1, h], opts);
        let x = Tensor::randn([5, h], opts);
        let want = plain.forward(&x) + x.matmul(&gate.tr()).sigmoid() * mlp.forward(&x);
        with_shared.shared = Some(SharedExpert { mlp, gate });
        let err = (with_shared.forward(&x) - &want).abs().max().double_value(&[]);
        assert!(err < 1e-5, "{err}");
    }

    fn experts_clone(v: &[(Tensor, Tensor, Tensor)]) -> Vec<(Tensor, Tensor, Tensor)> {
        v.iter().map(|(a, b, c)| (a.copy(), b.copy(), c.copy())).collect()
    }
}
