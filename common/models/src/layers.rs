//! Building blocks shared by the targets and the drafter: RMSNorm, linear
//! layers, the SwiGLU MLP and the targets' attention projections. RoPE lives
//! in `rope.rs`, the MoE block in `moe.rs`, the softmax itself (with the
//! grouped-query key/value repetition) in `attention.rs`.

use tch::Tensor;

pub use crate::rope::{Rope, apply_rope};

/// RMSNorm over the last dimension with a learned scale.
///
/// A scale kept in f32 under half-precision activations means the
/// normalised value is scaled in f32 and rounded once, as transformers'
/// zero-centred norms do (Qwen3-Next, Qwen3.5: `x_hat * (1 + w)` in f32);
/// a scale in the activations' kind multiplies the rounded normalised
/// value (Llama's `w * x_hat.to(dtype)`).
#[derive(Debug)]
pub struct RmsNorm {
    pub weight: Tensor,
    pub eps: f64,
}

impl RmsNorm {
    pub fn forward(&self, x: &Tensor) -> Tensor {
        let dim = *x.size().last().expect("rms_norm input has a last dimension");
        if self.weight.kind() == tch::Kind::Float {
            // On a GPU one kernel in place of cast, norm and cast back.
            if let Some(y) = crate::fused_cuda::rms_norm_f32_scale(x, &self.weight, self.eps) {
                return y;
            }
        }
        if self.weight.kind() == tch::Kind::Float && x.kind() != tch::Kind::Float {
            return x.to_kind(tch::Kind::Float).rms_norm([dim], Some(&self.weight), self.eps).to_kind(x.kind());
        }
        x.rms_norm([dim], Some(&self.weight), self.eps)
    }

    /// Normalizes `x` in its own kind (an f32 residual stream under half
    /// weights: the scale is widened to it) and returns the result in `kind`.
    pub fn forward_to(&self, x: &Tensor, kind: tch::Kind) -> Tensor {
        if x.kind() == self.weight.kind() {
            return self.forward(x).to_kind(kind);
        }
        let dim = *x.size().last().expect("rms_norm input has a last dimension");
        x.rms_norm([dim], Some(&self.weight.to_kind(x.kind())), self.eps).to_kind(kind)
    }
}

/// A linear layer with weight `[out, in]` and optional bias.
#[derive(Debug)]
pub struct Linear {
    pub weight: Tensor,
    pub bias: Option<Tensor>,
}

impl Linear {
    pub fn forward(&self, x: &Tensor) -> Tensor {
        x.linear(&self.weight, self.bias.as_ref())
    }
}

/// SwiGLU feed-forward: `down(silu(gate(x)) * up(x))`.
#[derive(Debug)]
pub struct Mlp {
    pub gate_proj: Linear,
    pub up_proj: Linear,
    pub down_proj: Linear,
}

impl Mlp {
    pub fn forward(&self, x: &Tensor) -> Tensor {
        self.down_proj.forward(&(self.gate_proj.forward(x).silu() * self.up_proj.forward(x)))
    }
}

/// A target layer's attention projections: `q_proj`, `k_proj`, `v_proj`,
/// `o_proj` (biases as the family has them), in Qwen3-style families the
/// per-head RMSNorms `q_norm` / `k_norm` applied before RoPE, and in gated
/// attention (Qwen3-Next, Qwen3.5) an output gate: `q_proj` gives each
/// head its query followed by a gate, and the attention output is
/// multiplied by `sigmoid(gate)` before `o_proj`.
#[derive(Debug)]
pub struct Attention {
    pub q_proj: Linear,
    pub k_proj: Linear,
    pub v_proj: Linear,
    pub o_proj: Linear,
    pub q_norm: Option<RmsNorm>,
    pub k_norm: Option<RmsNorm>,
    pub num_heads: i64,
    pub num_kv_heads: i64,
    pub head_dim: i64,
    pub output_gate: bool,
    /// Scale, window and sinks of the softmax.
    pub kernel: crate::attention::AttentionKernel,
}

/// What [`Attention::project`] gives: q `[.., S, nh, d]`, k and v
/// `[.., S, kv, d]`, and the output gate `[.., S, nh * d]` of gated attention.
pub struct Projected {
    pub q: Tensor,
    pub k: Tensor,
    pub v: Tensor,
    pub gate: Option<Tensor>,
}

impl Attention {
    /// Projections, QK norm and RoPE of `x` `[.., S, H]`; `cos`/`sin`
    /// broadcast over heads.
    pub fn project(&self, x: &Tensor, cos: &Tensor, sin: &Tensor) -> Projected {
        let mut lead = x.size();
        lead.pop();
        let shape = |heads: i64, per: i64| [lead.clone(), vec![heads, per]].concat();
        let d = self.head_dim;
        let (mut q, gate) = if self.output_gate {
            let both = self.q_proj.forward(x).view(shape(self.num_heads, 2 * d).as_slice());
            let gate = both.narrow(-1, d, d).reshape([lead.clone(), vec![self.num_heads * d]].concat().as_slice());
            (both.narrow(-1, 0, d), Some(gate))
        } else {
            (self.q_proj.forward(x).view(shape(self.num_heads, d).as_slice()), None)
        };
        let mut k = self.k_proj.forward(x).view(shape(self.num_kv_heads, d).as_slice());
        let v = self.v_proj.forward(x).view(shape(self.num_kv_heads, d).as_slice());
        if let (Some(qn), Some(kn)) = (&self.q_norm, &self.k_norm) {
            q = qn.forward(&q);
            k = kn.forward(&k);
        }
        Projected { q: apply_rope(&q, cos, sin), k: apply_rope(&k, cos, sin), v, gate }
    }

    /// The attention output `[.., nh * d]` through the gate (if any) and `o_proj`.
    pub fn output(&self, attended: &Tensor, gate: Option<&Tensor>) -> Tensor {
        match gate {
            Some(g) => self.o_proj.forward(&(attended * g.sigmoid())),
            None => self.o_proj.forward(attended),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rms_norm_matches_definition() {
        let x = Tensor::from_slice(&[1.0f64, -2.0, 2.0, 0.0]).view([1, 4]);
        let n = RmsNorm { weight: Tensor::from_slice(&[1.0f64, 1.0, 2.0, 1.0]), eps: 0.0 };
        let rms = (9.0f64 / 4.0).sqrt();
        let y = n.forward(&x);
        assert!((y.double_value(&[0, 2]) - 2.0 * 2.0 / rms).abs() < 1e-9);
    }
}
