//! The sparse mixture-of-experts block of every MoE family: a router picks
//! `top_k` experts per token and weighs them (the routing is the family's:
//! [`Routing`]), each expert is a gated MLP (SwiGLU, or gpt-oss's clamped
//! SwiGLU, with optional biases), the token's output is the weighted sum of
//! its experts' outputs -- plus, where the family has one, a shared expert
//! every token passes through (in Qwen3-Next and Qwen3.5 scaled by a sigmoid
//! gate of its own).
//!
//! The experts are one piece of code for all families: two grouped GEMMs
//! over the tokens sorted by expert (libtorch's `_grouped_mm`: one kernel
//! for all experts on Hopper, a loop over the groups elsewhere), not a loop
//! of tiny matmuls per expert. Nothing here reads a tensor back to the
//! host, so a CUDA forward stays asynchronous.

use tch::{Kind, Tensor};

use crate::layers::Mlp;

/// How a family's router turns its logits into experts and weights.
#[derive(Clone, Debug, PartialEq)]
pub enum Routing {
    /// Softmax over every expert (in f32), the `top_k` largest,
    /// renormalised to sum to 1 when `norm_topk_prob` (Qwen MoE).
    Softmax { norm_topk_prob: bool },
    /// The `top_k` largest logits (router with bias), softmax over those
    /// (gpt-oss).
    TopKSoftmax,
    /// Sigmoid scores (in f32); the experts chosen by score plus a learned
    /// correction bias, among the `topk_group` best of `n_group` groups
    /// (a group scored by its two best); weighted by their scores,
    /// renormalised when `norm_topk_prob`, times `routed_scaling_factor`
    /// (DeepSeek-V3, Kimi-K2, GLM-4 MoE).
    SigmoidGrouped { n_group: i64, topk_group: i64, norm_topk_prob: bool, routed_scaling_factor: f64 },
}

impl Routing {
    /// One line for printouts.
    pub fn describe(&self) -> String {
        match self {
            Routing::Softmax { norm_topk_prob: true } => "softmax, top-k renormalised".into(),
            Routing::Softmax { norm_topk_prob: false } => "softmax".into(),
            Routing::TopKSoftmax => "softmax over the top-k logits".into(),
            Routing::SigmoidGrouped { n_group, topk_group, norm_topk_prob, routed_scaling_factor } => format!(
                "sigmoid with correction bias, best {topk_group} of {n_group} groups{}, scaled x{routed_scaling_factor}",
                if *norm_topk_prob { ", renormalised" } else { "" }
            ),
        }
    }
}

/// The gated activation of an expert, given its gate and up projections.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum ExpertActivation {
    /// `silu(gate) * up`.
    SwiGlu,
    /// gpt-oss: gate clamped above and up on both sides at `limit`, then
    /// `(up + 1) * gate * sigmoid(alpha * gate)`.
    ClampedSwiGlu { alpha: f64, limit: f64 },
}

impl ExpertActivation {
    fn apply(self, gate: &Tensor, up: &Tensor) -> Tensor {
        match self {
            ExpertActivation::SwiGlu => gate.silu() * up,
            ExpertActivation::ClampedSwiGlu { alpha, limit } => {
                let gate = gate.clamp_max(limit);
                let up = up.clamp(-limit, limit);
                (up + 1.0) * (&gate * (&gate * alpha).sigmoid())
            }
        }
    }
}

/// The router: `[E, H]` weights, an optional bias `[E]`, and for sigmoid
/// routing the correction bias `[E]` (f32) that only the choice sees.
#[derive(Debug)]
pub struct Router {
    pub weight: Tensor,
    pub bias: Option<Tensor>,
    pub correction_bias: Option<Tensor>,
    pub top_k: i64,
    pub routing: Routing,
}

impl Router {
    /// The chosen experts `[T, k]` and their weights `[T, k]` (in `x`'s kind).
    pub fn route(&self, x: &Tensor) -> (Tensor, Tensor) {
        let k = self.top_k;
        let (weights, chosen) = match &self.routing {
            Routing::Softmax { norm_topk_prob } => {
                let logits = x.linear(&self.weight, self.bias.as_ref());
                // On a GPU one kernel: softmax, top-k and weights.
                if let Some(routed) = crate::fused_cuda::route_softmax_topk(&logits, k, *norm_topk_prob) {
                    return routed;
                }
                // In f32, as transformers routes; the weights then take the
                // activations' dtype.
                let probs = logits.softmax(-1, Kind::Float);
                let (mut w, chosen) = probs.topk(k, -1, true, true);
                if *norm_topk_prob {
                    w = &w / w.sum_dim_intlist(-1, true, Kind::Float);
                }
                (w, chosen)
            }
            Routing::TopKSoftmax => {
                let logits = x.linear(&self.weight, self.bias.as_ref());
                let (top, chosen) = logits.topk(k, -1, true, true);
                (top.softmax(-1, top.kind()), chosen)
            }
            Routing::SigmoidGrouped { n_group, topk_group, norm_topk_prob, routed_scaling_factor } => {
                let e = self.weight.size()[0];
                let scores = x.to_kind(Kind::Float).linear(&self.weight.to_kind(Kind::Float), None::<Tensor>).sigmoid();
                let for_choice = match &self.correction_bias {
                    Some(b) => &scores + b.to_kind(Kind::Float),
                    None => scores.shallow_clone(),
                };
                let t = for_choice.size()[0];
                let for_choice = if *n_group > 1 {
                    let groups = for_choice.view([t, *n_group, e / n_group]);
                    let group_scores = groups.topk(2, -1, true, true).0.sum_dim_intlist(-1, false, Kind::Float);
                    let (_, best) = group_scores.topk(*topk_group, -1, true, false);
                    let keep =
                        Tensor::zeros([t, *n_group], (Kind::Float, x.device())).scatter_value(1, &best, 1.0).gt(0.5);
                    let keep = keep.unsqueeze(-1).expand([t, *n_group, e / n_group], false);
                    groups.masked_fill(&keep.logical_not(), f64::NEG_INFINITY).reshape([t, e])
                } else {
                    for_choice
                };
                let (_, chosen) = for_choice.topk(k, -1, true, false);
                let mut w = scores.gather(1, &chosen, false);
                if *norm_topk_prob {
                    w = &w / (w.sum_dim_intlist(-1, true, Kind::Float) + 1e-20);
                }
                (w * *routed_scaling_factor, chosen)
            }
        };
        (chosen, weights.to_kind(x.kind()))
    }
}

/// The routed experts, stacked: gate and up projections, gate first,
/// `[E, 2I, H]` (and biases `[E, 2I]`); down projections `[E, H, I]` (and
/// biases `[E, H]`).
#[derive(Debug)]
pub struct Experts {
    pub gate_up: Tensor,
    pub down: Tensor,
    pub gate_up_bias: Option<Tensor>,
    pub down_bias: Option<Tensor>,
    pub activation: ExpertActivation,
}

impl Experts {
    /// Stacks per-expert `(gate [I, H], up [I, H], down [H, I])` weights.
    pub fn stack(experts: Vec<(Tensor, Tensor, Tensor)>) -> Self {
        let _guard = tch::no_grad_guard();
        let gate_up: Vec<Tensor> = experts.iter().map(|(g, u, _)| Tensor::cat(&[g, u], 0)).collect();
        let down: Vec<&Tensor> = experts.iter().map(|(_, _, d)| d).collect();
        Self {
            gate_up: Tensor::stack(&gate_up, 0),
            down: Tensor::stack(&down, 0),
            gate_up_bias: None,
            down_bias: None,
            activation: ExpertActivation::SwiGlu,
        }
    }

    pub fn num_experts(&self) -> i64 {
        self.down.size()[0]
    }

    fn intermediate(&self) -> i64 {
        self.down.size()[2]
    }

    /// Each token's weighted sum over its chosen experts: `x` `[T, H]`,
    /// `chosen` and `weights` `[T, k]`.
    pub fn forward(&self, x: &Tensor, chosen: &Tensor, weights: &Tensor) -> Tensor {
        let (experts, k, h) = (self.num_experts(), chosen.size()[1], x.size()[1]);
        // Every (token, slot) pair, grouped by its expert (on a GPU by a
        // counting sort, which also gives where each pair went).
        let flat = chosen.reshape([-1]);
        let count = || Tensor::zeros([experts], (Kind::Int64, x.device())).scatter_add(0, &flat, &flat.ones_like());
        let (order, token, offsets, inverse) = match crate::fused_cuda::expert_order(chosen, experts) {
            Some(o) => (o.order, o.token, o.offsets, Some(o.inverse)),
            None => {
                let order = flat.argsort_stable(true, 0, false);
                let token = order.floor_divide_scalar(k);
                (order, token, count().cumsum(0, Kind::Int), None)
            }
        };
        // Each position's expert, for the biases of the families that have them.
        let biased = self.gate_up_bias.is_some() || self.down_bias.is_some();
        let sorted_experts = biased.then(|| flat.index_select(0, &order));
        let rows = x.index_select(0, &token); // [T*k, H]
        let out = match self.grouped(&rows, &offsets, sorted_experts.as_ref()) {
            Ok(out) => out,
            // libtorch's grouped GEMM takes f32/bf16/f16 only; other kinds
            // (f64 references) go expert by expert.
            Err(_) => self.expert_by_expert(&rows, &count(), sorted_experts.as_ref()),
        };
        // Back to token order, then each token's weighted sum over its k
        // slots as one batched matmul: no atomics (index_add on bf16 took
        // 3x as long on an H200) and the sum accumulates in f32.
        let n = flat.size()[0];
        let inverse = inverse
            .unwrap_or_else(|| order.empty_like().scatter(0, &order, &Tensor::arange(n, (Kind::Int64, x.device()))));
        // On a GPU one kernel reads each row once, without the gathered copy.
        if let Some(y) = crate::fused_cuda::moe_unpermute(&out, &inverse, weights) {
            return y;
        }
        let per_slot = out.index_select(0, &inverse).view([-1, k, h]); // [T, k, H]
        weights.unsqueeze(1).bmm(&per_slot).squeeze_dim(1)
    }

    /// The gated activation of gate/up outputs `[N, 2I]` (biases added).
    fn activate(&self, gate_up: Tensor, sorted_experts: Option<&Tensor>) -> Tensor {
        let gate_up = match &self.gate_up_bias {
            Some(b) => gate_up + b.index_select(0, sorted_experts.expect("a biased block has each row's expert")),
            None => gate_up,
        };
        if self.activation == ExpertActivation::SwiGlu
            && let Some(act) = crate::fused_cuda::swiglu(&gate_up)
        {
            return act;
        }
        let i = self.intermediate();
        self.activation.apply(&gate_up.narrow(-1, 0, i), &gate_up.narrow(-1, i, i))
    }

    fn with_down_bias(&self, out: Tensor, sorted_experts: Option<&Tensor>) -> Tensor {
        match &self.down_bias {
            Some(b) => out + b.index_select(0, sorted_experts.expect("a biased block has each row's expert")),
            None => out,
        }
    }

    /// The experts as two grouped GEMMs over `rows` sorted by expert
    /// (`offsets`: cumulative row counts, int32).
    fn grouped(
        &self,
        rows: &Tensor,
        offsets: &Tensor,
        sorted_experts: Option<&Tensor>,
    ) -> Result<Tensor, tch::TchError> {
        let gate_up =
            rows.f_internal_grouped_mm(&self.gate_up.transpose(1, 2), Some(offsets), None::<&Tensor>, None::<Kind>)?;
        let act = self.activate(gate_up, sorted_experts);
        let out =
            act.f_internal_grouped_mm(&self.down.transpose(1, 2), Some(offsets), None::<&Tensor>, None::<Kind>)?;
        Ok(self.with_down_bias(out, sorted_experts))
    }

    /// The same, one matmul pair per expert (reads the counts back).
    fn expert_by_expert(&self, rows: &Tensor, counts: &Tensor, sorted_experts: Option<&Tensor>) -> Tensor {
        let counts = Vec::<i64>::try_from(counts.to_device(tch::Device::Cpu)).expect("1-D counts");
        let mut start = 0;
        let mut parts = Vec::with_capacity(counts.len());
        for (e, &n) in counts.iter().enumerate() {
            let r = rows.narrow(0, start, n);
            parts.push(r.linear(&self.gate_up.get(e as i64), None::<Tensor>));
            start += n;
        }
        let act = self.activate(Tensor::cat(&parts, 0), sorted_experts);
        let mut start = 0;
        let mut outs = Vec::with_capacity(counts.len());
        for (e, &n) in counts.iter().enumerate() {
            outs.push(act.narrow(0, start, n).linear(&self.down.get(e as i64), None::<Tensor>));
            start += n;
        }
        self.with_down_bias(Tensor::cat(&outs, 0), sorted_experts)
    }
}

/// The expert every token passes through (`mlp.shared_expert` in Qwen,
/// `mlp.shared_experts` in DeepSeek and GLM), and in Qwen its gate `[1, H]`
/// (`mlp.shared_expert_gate`): the token adds `sigmoid(gate . x) * shared(x)`.
#[derive(Debug)]
pub struct SharedExpert {
    pub mlp: Mlp,
    pub gate: Option<Tensor>,
}

/// One MoE feed-forward block.
#[derive(Debug)]
pub struct SparseMoe {
    pub router: Router,
    pub experts: Experts,
    pub shared: Option<SharedExpert>,
}

impl SparseMoe {
    /// `x` `[.., H]` to `[.., H]`.
    pub fn forward(&self, x: &Tensor) -> Tensor {
        let shape = x.size();
        let h = *shape.last().expect("MoE input has a hidden dimension");
        let x = x.reshape([-1, h]);
        let (chosen, weights) = self.router.route(&x);
        let routed = self.experts.forward(&x, &chosen, &weights);
        let y = match &self.shared {
            Some(SharedExpert { mlp, gate: Some(g) }) => {
                routed + x.linear(g, None::<Tensor>).sigmoid() * mlp.forward(&x)
            }
            Some(SharedExpert { mlp, gate: None }) => routed + mlp.forward(&x),
            None => routed,
        };
        y.reshape(shape.as_slice())
    }
}

#[cfg(test)]
mod tests {
    use tch::Device;

    use super::*;

    /// The definition, one token and one expert at a time.
    fn reference(m: &SparseMoe, x: &Tensor) -> Tensor {
        let t = x.size()[0];
        let (chosen, weights) = m.router.route(x);
        let e = &m.experts;
        let inter = e.down.size()[2];
        let rows: Vec<Tensor> = (0..t)
            .map(|i| {
                let mut acc = x.get(i).zeros_like();
                for s in 0..m.router.top_k {
                    let j = chosen.int64_value(&[i, s]);
                    let mut gu = x.get(i).linear(&e.gate_up.get(j), None::<Tensor>);
                    if let Some(b) = &e.gate_up_bias {
                        gu += b.get(j);
                    }
                    let act = e.activation.apply(&gu.narrow(0, 0, inter), &gu.narrow(0, inter, inter));
                    let mut out = act.linear(&e.down.get(j), None::<Tensor>);
                    if let Some(b) = &e.down_bias {
                        out += b.get(j);
                    }
                    acc += out * weights.double_value(&[i, s]);
                }
                acc
            })
            .collect();
        Tensor::stack(&rows, 0)
    }

    fn experts(e: i64, h: i64, i: i64, kind: Kind) -> Vec<(Tensor, Tensor, Tensor)> {
        let opts = (kind, Device::Cpu);
        (0..e)
            .map(|_| (Tensor::randn([i, h], opts), Tensor::randn([i, h], opts), Tensor::randn([h, i], opts)))
            .collect()
    }

    fn block(routing: Routing, activation: ExpertActivation, biases: bool, kind: Kind) -> SparseMoe {
        let (e, h, i) = (8, 16, 8);
        let opts = (kind, Device::Cpu);
        let mut experts = Experts::stack(experts(e, h, i, kind));
        experts.activation = activation;
        if biases {
            experts.gate_up_bias = Some(Tensor::randn([e, 2 * i], opts));
            experts.down_bias = Some(Tensor::randn([e, h], opts));
        }
        let grouped = matches!(routing, Routing::SigmoidGrouped { .. });
        let router = Router {
            weight: Tensor::randn([e, h], opts),
            bias: biases.then(|| Tensor::randn([e], opts)),
            correction_bias: grouped.then(|| Tensor::randn([e], (Kind::Float, Device::Cpu)) * 0.1),
            top_k: 2,
            routing,
        };
        SparseMoe { router, experts, shared: None }
    }

    #[test]
    fn grouped_experts_equal_the_per_token_definition_for_every_routing_in_any_kind() {
        tch::manual_seed(3);
        let routings = [
            (Routing::Softmax { norm_topk_prob: false }, ExpertActivation::SwiGlu, false),
            (Routing::Softmax { norm_topk_prob: true }, ExpertActivation::SwiGlu, false),
            (Routing::TopKSoftmax, ExpertActivation::ClampedSwiGlu { alpha: 1.702, limit: 7.0 }, true),
            (
                Routing::SigmoidGrouped { n_group: 4, topk_group: 2, norm_topk_prob: true, routed_scaling_factor: 2.5 },
                ExpertActivation::SwiGlu,
                false,
            ),
        ];
        for (routing, activation, biases) in routings {
            for kind in [Kind::Float, Kind::Double] {
                let m = block(routing.clone(), activation, biases, kind);
                // Some experts get no token at all in a batch this small.
                let x = Tensor::randn([5, 16], (kind, Device::Cpu));
                let want = reference(&m, &x);
                let err = (m.forward(&x) - &want).abs().max().double_value(&[]) / want.abs().max().double_value(&[]);
                // f64 takes the expert-by-expert path.
                assert!(err < 1e-5, "{routing:?} {kind:?}: {err}");
                assert_eq!(m.forward(&x.view([1, 5, 16])).size(), vec![1, 5, 16], "leading dimensions pass through");
            }
        }
    }

    #[test]
    fn sigmoid_routing_picks_only_from_the_best_groups_and_scales_the_scores() {
        tch::manual_seed(5);
        let routing =
            Routing::SigmoidGrouped { n_group: 4, topk_group: 1, norm_topk_prob: false, routed_scaling_factor: 3.0 };
        let m = block(routing, ExpertActivation::SwiGlu, false, Kind::Float);
        let x = Tensor::randn([6, 16], (Kind::Float, Device::Cpu));
        let (chosen, weights) = m.router.route(&x);
        let scores = x.linear(&m.router.weight, None::<Tensor>).sigmoid();
        for t in 0..6 {
            // Both experts from one group of two (8 experts in 4 groups).
            assert_eq!(chosen.int64_value(&[t, 0]) / 2, chosen.int64_value(&[t, 1]) / 2);
            for s in 0..2 {
                let e = chosen.int64_value(&[t, s]);
                let want = 3.0 * scores.double_value(&[t, e]);
                assert!(
                    (weights.double_value(&[t, s]) - want).abs() < 1e-6,
                    "the weight is the score, not score + bias"
                );
            }
        }
    }

    #[test]
    fn a_shared_expert_adds_its_output_gated_or_not() {
        tch::manual_seed(4);
        let h = 16;
        let opts = (Kind::Float, Device::Cpu);
        let lin = |o, i| crate::layers::Linear { weight: Tensor::randn([o, i], opts), bias: None };
        let x = Tensor::randn([5, h], opts);
        for gated in [false, true] {
            let mut m = block(Routing::Softmax { norm_topk_prob: true }, ExpertActivation::SwiGlu, false, Kind::Float);
            let plain = m.forward(&x);
            let mlp = crate::layers::Mlp { gate_proj: lin(6, h), up_proj: lin(6, h), down_proj: lin(h, 6) };
            let gate = gated.then(|| Tensor::randn([1, h], opts));
            let shared = mlp.forward(&x);
            let want = match &gate {
                Some(g) => &plain + x.matmul(&g.tr()).sigmoid() * shared,
                None => &plain + shared,
            };
            m.shared = Some(SharedExpert { mlp, gate });
            let err = (m.forward(&x) - &want).abs().max().double_value(&[]);
            assert!(err < 1e-5, "gated {gated}: {err}");
        }
    }
}
