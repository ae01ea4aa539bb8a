//! The Gated DeltaNet token mixer of hybrid targets (the `linear_attention`
//! layers of Qwen3-Next and Qwen3.5), as transformers defines it:
//!
//! 1. projections of the normed input: q, k, v (the convolution's
//!    channels), the output gate z, and per value head `b` and `a`;
//! 2. a short causal depthwise convolution over q, k, v, then SiLU;
//! 3. q and k L2-normalised (q scaled by `dk^-0.5`), each key head serving
//!    `nv / nk` value heads;
//! 4. the gated delta rule (`delta_rule.rs`) with `beta = sigmoid(b)` and
//!    decay `g = -exp(A_log) * softplus(a + dt_bias)`;
//! 5. an RMSNorm per value head gated by `silu(z)`, then `out_proj`.
//!
//! Over packed sequences (capture) the convolution window and the
//! recurrent state start empty at every sequence: nothing of one sequence
//! reaches the next. In decoding both live in the cache.

use tch::{Kind, Tensor};

use crate::ModelError;
use crate::delta_rule::{self, ChunkPlan, RuleInputs};
use crate::delta_rule_cuda;
use crate::kv_cache::{Recorded, RecurrentState};
use crate::layers::Linear;
use crate::weights::Weights;

/// The shape of a layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeltaNetShape {
    pub num_key_heads: i64,
    pub num_value_heads: i64,
    pub key_head_dim: i64,
    pub value_head_dim: i64,
    /// Width of the causal convolution (`linear_conv_kernel_dim`).
    pub conv_kernel: i64,
}

impl DeltaNetShape {
    pub fn key_dim(&self) -> i64 {
        self.num_key_heads * self.key_head_dim
    }

    pub fn value_dim(&self) -> i64 {
        self.num_value_heads * self.value_head_dim
    }

    /// Channels of the convolution: q, k and v.
    pub fn conv_dim(&self) -> i64 {
        2 * self.key_dim() + self.value_dim()
    }

    /// Rows of the fused input projection: q, k, v, z, b, a.
    pub fn projection_dim(&self) -> i64 {
        self.conv_dim() + self.value_dim() + 2 * self.num_value_heads
    }

    /// Parameters of one layer's mixer.
    pub fn parameters(&self, hidden: i64) -> i64 {
        hidden * self.projection_dim()
            + self.conv_dim() * self.conv_kernel
            + 2 * self.num_value_heads
            + self.value_head_dim
            + self.value_dim() * hidden
    }
}

/// How a checkpoint stores the input projections.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProjectionLayout {
    /// Qwen3.5: `in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`.
    Split,
    /// Qwen3-Next: `in_proj_qkvz` and `in_proj_ba`, grouped by key head
    /// (each key head's q, k, then its value heads' v and z; its b, then a).
    GroupedByKeyHead,
}

/// One Gated DeltaNet layer.
#[derive(Debug)]
pub struct GatedDeltaNet {
    /// Every input projection as one matrix, rows q | k | v | z | b | a.
    pub in_proj: Linear,
    /// Depthwise convolution weights `[conv_dim, kernel]`.
    pub conv: Tensor,
    /// `-exp(A_log)` per value head, f32.
    pub neg_a: Tensor,
    /// `dt_bias` per value head, f32.
    pub dt_bias: Tensor,
    /// Scale of the gated RMSNorm `[value_head_dim]`.
    pub norm_weight: Tensor,
    pub norm_eps: f64,
    pub out_proj: Linear,
    pub shape: DeltaNetShape,
}

/// How a packed batch's sequences sit, as the linear-attention layers use
/// it: the delta rule's chunk plan, and the first `K-1` rows of every
/// sequence but the first, whose convolution is redone from their own
/// sequence. Made once per batch for all its layers.
pub struct PackedLayout {
    pub chunks: ChunkPlan,
    /// Rows to redo `[R]`, and per row its `K` taps' sources `[R * K]` and
    /// whether each tap is inside the row's sequence (0/1).
    fix_rows: Tensor,
    fix_sources: Tensor,
    fix_seen: Tensor,
    kernel: i64,
    /// Each token's position in its sequence `[T]` (the fused convolution's
    /// boundaries).
    positions: Tensor,
}

impl PackedLayout {
    pub fn new(lens: &[i64], kernel: i64, device: tch::Device) -> Self {
        let (mut rows, mut sources, mut seen) = (Vec::new(), Vec::new(), Vec::new());
        let mut start = 0;
        for (s, &len) in lens.iter().enumerate() {
            if s > 0 {
                for pos in 0..(kernel - 1).min(len) {
                    rows.push(start + pos);
                    for back in 0..kernel {
                        sources.push((start + pos - back).max(0));
                        seen.push(i64::from(back <= pos));
                    }
                }
            }
            start += len;
        }
        let positions: Vec<i64> = lens.iter().flat_map(|&l| 0..l).collect();
        let all = Tensor::from_slice(&[rows.as_slice(), &sources, &seen, &positions].concat()).to_device(device);
        let (r, rk) = (rows.len() as i64, sources.len() as i64);
        Self {
            chunks: ChunkPlan::new(lens, device),
            fix_rows: all.narrow(0, 0, r),
            fix_sources: all.narrow(0, r, rk),
            fix_seen: all.narrow(0, r + rk, rk).to_kind(Kind::Float).view([r, kernel, 1]),
            kernel,
            positions: all.narrow(0, r + 2 * rk, positions.len() as i64),
        }
    }
}

/// Per-token inputs of the rule, owned.
struct Rule {
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
}

impl Rule {
    fn inputs(&self) -> RuleInputs<'_> {
        RuleInputs { q: &self.q, k: &self.k, v: &self.v, g: &self.g, beta: &self.beta }
    }
}

impl GatedDeltaNet {
    /// Loads `{p}.linear_attn.*` (`p`: the layer's prefix).
    pub fn load(
        w: &mut Weights,
        p: &str,
        hidden: i64,
        s: DeltaNetShape,
        layout: ProjectionLayout,
        norm_eps: f64,
    ) -> Result<Self, ModelError> {
        let a = format!("{p}.linear_attn");
        let (kd, vd, nv, nk) = (s.key_dim(), s.value_dim(), s.num_value_heads, s.num_key_heads);
        let in_proj = match layout {
            ProjectionLayout::Split => {
                let parts = [
                    w.take(&format!("{a}.in_proj_qkv.weight"), &[s.conv_dim(), hidden])?,
                    w.take(&format!("{a}.in_proj_z.weight"), &[vd, hidden])?,
                    w.take(&format!("{a}.in_proj_b.weight"), &[nv, hidden])?,
                    w.take(&format!("{a}.in_proj_a.weight"), &[nv, hidden])?,
                ];
                Tensor::cat(&parts, 0)
            }
            ProjectionLayout::GroupedByKeyHead => {
                let per_v = nv / nk * s.value_head_dim;
                let qkvz = w.take(&format!("{a}.in_proj_qkvz.weight"), &[2 * kd + 2 * vd, hidden])?;
                let ba = w.take(&format!("{a}.in_proj_ba.weight"), &[2 * nv, hidden])?;
                if w.is_headers() {
                    // The dry run holds no values to reorder.
                    Tensor::cat(&[&qkvz, &ba], 0)
                } else {
                    let dk = s.key_head_dim;
                    let g = qkvz.view([nk, 2 * dk + 2 * per_v, hidden]);
                    let part = |start: i64, len: i64| g.narrow(1, start, len).reshape([nk * len, hidden]);
                    let ba = ba.view([nk, 2 * nv / nk, hidden]);
                    let half = |start: i64| ba.narrow(1, start, nv / nk).reshape([nv, hidden]);
                    let (q, k) = (part(0, dk), part(dk, dk));
                    let (v, z) = (part(2 * dk, per_v), part(2 * dk + per_v, per_v));
                    Tensor::cat(&[q, k, v, z, half(0), half(nv / nk)], 0)
                }
            }
        };
        let conv = w.take(&format!("{a}.conv1d.weight"), &[s.conv_dim(), 1, s.conv_kernel])?;
        let conv = w.transform(conv, |c| c.reshape([s.conv_dim(), s.conv_kernel]));
        let a_log = w.take(&format!("{a}.A_log"), &[nv])?;
        let neg_a = w.transform(a_log, |t| -t.to_kind(Kind::Float).exp());
        let dt_bias = w.take(&format!("{a}.dt_bias"), &[nv])?;
        let dt_bias = w.transform(dt_bias, |t| t.to_kind(Kind::Float));
        Ok(Self {
            in_proj: Linear { weight: in_proj, bias: None },
            conv,
            neg_a,
            dt_bias,
            norm_weight: w.take(&format!("{a}.norm.weight"), &[s.value_head_dim])?,
            norm_eps,
            out_proj: Linear { weight: w.take(&format!("{a}.out_proj.weight"), &[hidden, vd])?, bias: None },
            shape: s,
        })
    }

    /// Packed sequences `x` `[T, H]` (normed) laid out as `layout` says,
    /// each starting from an empty window and state. `mark(stage)` after
    /// each stage (profiling).
    pub fn forward_packed(&self, x: &Tensor, layout: &PackedLayout, mark: &mut dyn FnMut(&'static str)) -> Tensor {
        let proj = self.in_proj.forward(x);
        mark("linear attn: in_proj");
        let mixed = proj.narrow(-1, 0, self.shape.conv_dim());
        let conv = self.conv_packed(&mixed, layout);
        mark("linear attn: conv");
        let rule = self.rule_inputs(&conv, &proj);
        mark("linear attn: q/k norm, gates");
        let inputs = rule.inputs();
        let out = match delta_rule_cuda::chunked(&inputs, &layout.chunks, None, mark) {
            Some(fused) => fused.out,
            None => delta_rule::chunked_with(&inputs, &layout.chunks, None, false, mark).out,
        };
        let y = self.out_proj.forward(&self.gated_norm(&out, &proj, x.kind()));
        mark("linear attn: gated norm + out_proj");
        y
    }

    /// `x` `[B, t, H]` (normed) continuing from `prev` (empty when None);
    /// `valid` `[B, t]` marks real tokens (padding is zeroed, as
    /// transformers does, so it leaves window and state as they were).
    /// With `record` the state after every token is kept, so the cache can
    /// go back to any of them. Returns the output and the new state.
    pub fn forward_cached(
        &self,
        x: &Tensor,
        valid: &Tensor,
        prev: Option<&RecurrentState>,
        record: bool,
    ) -> (Tensor, RecurrentState) {
        let _guard = tch::no_grad_guard();
        let (b, t, _) = x.size3().expect("[B, t, H]");
        let s = self.shape;
        let x = x * valid.unsqueeze(-1).to_kind(x.kind());
        let proj = self.in_proj.forward(&x);
        let mixed = proj.narrow(-1, 0, s.conv_dim());
        let history = match prev {
            Some(p) => p.conv.shallow_clone(),
            None => Tensor::zeros([b, s.conv_kernel - 1, s.conv_dim()], (x.kind(), x.device())),
        };
        let window = Tensor::cat(&[&history, &mixed], 1); // [B, K-1+t, C]
        let conv = self.conv_window(&window, t);
        let rule = self.rule_inputs(&conv.reshape([b * t, s.conv_dim()]), &proj.reshape([b * t, -1]));
        let (out, state, states) = match prev {
            Some(p) if t == 1 && !record => {
                let (o, st) = delta_rule::step(&rule.inputs(), &p.state);
                (o, st, None)
            }
            _ => {
                let lens = vec![t; b as usize];
                let (x, initial) = (rule.inputs(), prev.map(|p| &p.state));
                let plan = ChunkPlan::new(&lens, x.v.device());
                let fused = (!record).then(|| delta_rule_cuda::chunked(&x, &plan, initial, &mut |_| {})).flatten();
                let r = fused.unwrap_or_else(|| delta_rule::chunked_with(&x, &plan, initial, record, &mut |_| {}));
                (r.out, r.final_state, r.states)
            }
        };
        let normed = self.gated_norm(&out, &proj.reshape([b * t, -1]), x.kind());
        let y = self.out_proj.forward(&normed).view([b, t, -1]);
        let k1 = s.conv_kernel - 1;
        let recorded = states.map(|st| {
            let d = st.size();
            Recorded { window: window.shallow_clone(), states: st.view([b, t, d[1], d[2], d[3]]) }
        });
        (y, RecurrentState { conv: window.narrow(1, t, k1), state, recorded })
    }

    /// The causal convolution and SiLU over packed sequences `mixed`
    /// `[T, C]`, in the model's kind: one depthwise convolution over the
    /// whole packed stream (taps multiplied in the model's kind, summed in
    /// f32), then the first `K-1` positions of each sequence
    /// after the first recomputed from their own sequence alone (the
    /// stream's convolution reached back into the sequence before).
    fn conv_packed(&self, mixed: &Tensor, layout: &PackedLayout) -> Tensor {
        let k = self.shape.conv_kernel;
        assert_eq!(k, layout.kernel, "the layout was made for this convolution");
        let s = self.shape;
        if let Some(y) =
            delta_rule_cuda::causal_conv_silu(mixed, &self.conv, &layout.positions, s.key_head_dim, s.value_head_dim)
        {
            return y;
        }
        let (t, c) = (mixed.size()[0], mixed.size()[1]);
        // Each position's window of K inputs is a strided view of the
        // zero-padded stream (no copy); the taps are summed in f32. (A
        // channels-first depthwise conv1d took 2.3 ms a layer at 8K tokens
        // of Qwen3.5-27B on an H100, most of it layout changes.)
        let padded = Tensor::cat(&[&mixed.new_zeros([k - 1, c], (mixed.kind(), mixed.device())), mixed], 0);
        let windows = padded.as_strided([t, k, c], [c, c, 1], 0); // window of t: inputs t-K+1..=t
        let taps = self.conv.to_kind(mixed.kind()).transpose(0, 1).unsqueeze(0); // [1, K, C]
        let mut conv = (windows * taps).sum_dim_intlist(1, false, Kind::Float).to_kind(mixed.kind()); // [T, C]
        let r = layout.fix_rows.size()[0];
        if r > 0 {
            let window =
                mixed.index_select(0, &layout.fix_sources).view([r, k, c]).to_kind(Kind::Float) * &layout.fix_seen;
            // Tap `back` weighs the input `back` tokens before: w[:, K-1-back].
            let taps = self.conv.to_kind(Kind::Float).flip([1]).transpose(0, 1); // [K, C]
            let redone = (window * taps.unsqueeze(0)).sum_dim_intlist(1, false, Kind::Float);
            let _ = conv.index_copy_(0, &layout.fix_rows, &redone.to_kind(conv.kind()));
        }
        conv.silu()
    }

    /// The causal convolution and SiLU of the last `t` positions of
    /// `window` `[B, K-1+t, C]` (history, then the new inputs), in the
    /// window's kind.
    fn conv_window(&self, window: &Tensor, t: i64) -> Tensor {
        let k = self.shape.conv_kernel;
        let x = window.to_kind(Kind::Float);
        let w = self.conv.to_kind(Kind::Float);
        let mut acc = x.narrow(1, k - 1, t) * w.select(1, k - 1);
        for back in 1..k {
            acc += x.narrow(1, k - 1 - back, t) * w.select(1, k - 1 - back);
        }
        acc.to_kind(window.kind()).silu()
    }

    /// q, k, v, decay and beta from the convolved channels `[N, C]` and
    /// the projections `[N, P]`.
    fn rule_inputs(&self, conv: &Tensor, proj: &Tensor) -> Rule {
        let s = self.shape;
        let n = conv.size()[0];
        let (kd, vd, nv) = (s.key_dim(), s.value_dim(), s.num_value_heads);
        let heads = |x: Tensor, h: i64, d: i64| x.reshape([n, h, d]);
        let gates = s.conv_dim() + vd;
        let fused = delta_rule_cuda::qk_norm_gates(&delta_rule_cuda::GateSource {
            conv,
            proj,
            key_heads: s.num_key_heads,
            key_dim: s.key_head_dim,
            value_heads: nv,
            value_dim: s.value_head_dim,
            b_col: gates,
            a_col: gates + nv,
            neg_a: &self.neg_a,
            dt_bias: &self.dt_bias,
        });
        if let Some((q, k, g, beta)) = fused {
            let v = heads(conv.narrow(1, 2 * kd, vd), nv, s.value_head_dim);
            return Rule { q, k, v, g, beta };
        }
        // q and k normalised in f32, then in the model's kind like v.
        let unit =
            |x: Tensor| delta_rule::l2_normalize(&heads(x.to_kind(Kind::Float), s.num_key_heads, s.key_head_dim));
        // Key heads stay unrepeated: the rule maps each to its value heads.
        let q = (unit(conv.narrow(1, 0, kd)) * (s.key_head_dim as f64).powf(-0.5)).to_kind(conv.kind());
        let k = unit(conv.narrow(1, kd, kd)).to_kind(conv.kind());
        let v = heads(conv.narrow(1, 2 * kd, vd), nv, s.value_head_dim);
        let b = proj.narrow(1, gates, nv).to_kind(Kind::Float);
        let a = proj.narrow(1, gates + nv, nv).to_kind(Kind::Float);
        let g = (a + &self.dt_bias).softplus() * &self.neg_a;
        Rule { q, k, v, g, beta: b.sigmoid() }
    }

    /// The per-head RMSNorm of the rule's output `[N, nv, dv]` (f32), gated
    /// by `silu(z)`, as `[N, nv * dv]` in `kind`: normalised in f32, scaled
    /// and gated in the model's kind (in f32 exactly transformers' order).
    fn gated_norm(&self, out: &Tensor, proj: &Tensor, kind: Kind) -> Tensor {
        let s = self.shape;
        let n = out.size()[0];
        let heads = out.reshape([n, s.num_value_heads, s.value_head_dim]);
        let (z_col, w, eps) = (s.conv_dim(), &self.norm_weight, self.norm_eps);
        if proj.kind() == kind
            && let Some(y) = delta_rule_cuda::gated_norm(&heads, proj, z_col, w, eps, s.key_head_dim)
        {
            return y;
        }
        let z = proj.narrow(1, s.conv_dim(), s.value_dim()).reshape([n, s.num_value_heads, s.value_head_dim]);
        let normed = out.rms_norm([s.value_head_dim], None::<Tensor>, self.norm_eps).to_kind(kind);
        (normed * &self.norm_weight * z.silu()).reshape([n, s.value_dim()])
    }
}
