//! Building blocks shared by the target and the drafter: RMSNorm, linear
//! layers, the SwiGLU MLP and rotary position embeddings (Hugging Face
//! `rotate_half` convention).

use tch::{Kind, Tensor};

/// RMSNorm over the last dimension with a learned scale.
#[derive(Debug)]
pub struct RmsNorm {
    pub weight: Tensor,
    pub eps: f64,
}

impl RmsNorm {
    pub fn forward(&self, x: &Tensor) -> Tensor {
        let dim = *x.size().last().expect("rms_norm input has a last dimension");
        x.rms_norm([dim], Some(&self.weight), self.eps)
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

/// Rotary embedding tables for one head size.
#[derive(Debug)]
pub struct Rope {
    inv_freq: Tensor,
}

impl Rope {
    pub fn new(head_dim: i64, theta: f64, device: tch::Device) -> Self {
        let exponents = Tensor::arange_start_step(0, head_dim, 2, (Kind::Float, device)) / head_dim as f64;
        let inv_freq = Tensor::from(theta).to_device(device).pow(&exponents).reciprocal();
        Self { inv_freq }
    }

    /// `(cos, sin)` of shape `positions.shape + [head_dim]`, in `kind`.
    pub fn cos_sin(&self, positions: &Tensor, kind: Kind) -> (Tensor, Tensor) {
        let freqs = positions.to_kind(Kind::Float).unsqueeze(-1) * &self.inv_freq;
        let emb = Tensor::cat(&[&freqs, &freqs], -1);
        (emb.cos().to_kind(kind), emb.sin().to_kind(kind))
    }
}

/// Applies rotary embeddings: `x * cos + rotate_half(x) * sin`. `cos`/`sin`
/// must broadcast against `x` (e.g. x `[.., S, heads, d]`, cos `[.., S, 1, d]`).
pub fn apply_rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Tensor {
    let d = *x.size().last().expect("rope input has a head dimension");
    let x1 = x.narrow(-1, 0, d / 2);
    let x2 = x.narrow(-1, d / 2, d / 2);
    let rotated = Tensor::cat(&[&x2.neg(), &x1], -1);
    x * cos + rotated * sin
}

/// Repeats key/value heads for grouped-query attention: `[B, kv, S, d]` to
/// `[B, kv * n_rep, S, d]`.
pub fn repeat_kv(x: &Tensor, n_rep: i64) -> Tensor {
    if n_rep == 1 { x.shallow_clone() } else { x.repeat_interleave_self_int(n_rep, 1, None::<i64>) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rope_rotates_pairs_half_a_head_apart() {
        let rope = Rope::new(4, 10_000.0, tch::Device::Cpu);
        let pos = Tensor::from_slice(&[0i64, 1]);
        let (cos, sin) = rope.cos_sin(&pos, Kind::Double);
        let x = Tensor::from_slice(&[1.0f64, 2.0, 3.0, 4.0]).view([1, 4]).repeat([2, 1]);
        let y = apply_rope(&x, &cos, &sin);
        // position 0: identity
        assert!(y.get(0).allclose(&x.get(0), 1e-6, 1e-6, false));
        // position 1, first pair (dims 0 and 2) rotated by angle 1 (inv_freq[0] = 1)
        let (c, s) = (1f64.cos(), 1f64.sin());
        let want0 = 1.0 * c - 3.0 * s;
        let want2 = 3.0 * c + 1.0 * s;
        assert!((y.double_value(&[1, 0]) - want0).abs() < 1e-6, "rope tables are f32");
        assert!((y.double_value(&[1, 2]) - want2).abs() < 1e-6);
    }

    #[test]
    fn rms_norm_matches_definition() {
        let x = Tensor::from_slice(&[1.0f64, -2.0, 2.0, 0.0]).view([1, 4]);
        let n = RmsNorm { weight: Tensor::from_slice(&[1.0f64, 1.0, 2.0, 1.0]), eps: 0.0 };
        let rms = (9.0f64 / 4.0).sqrt();
        let y = n.forward(&x);
        assert!((y.double_value(&[0, 2]) - 2.0 * 2.0 / rms).abs() < 1e-9);
    }
}
