//! Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2, Moonlight), as
//! transformers' `DeepseekV3Attention` defines it:
//!
//! - queries: `q_proj`, or through a low-rank bottleneck `q_b_proj(
//!   q_a_layernorm(q_a_proj(x)))`; each head `[nope | rope]`;
//! - keys and values from one compressed latent shared by all heads:
//!   `kv_a_proj_with_mqa(x)` gives the latent `[kv_lora_rank]` and one
//!   RoPE key part `[rope]` for every head; the normed latent expands per
//!   head through `kv_b_proj` into `[k_nope | v]`;
//! - RoPE on the rope parts only, whose pairs are interleaved when
//!   `rope_interleave` is set. Rotating interleaved pairs `(x0, x1), (x2,
//!   x3), ...` equals rotating halves after the permutation `x0, x2, ...,
//!   x1, x3, ...`, and transformers' result is laid out in halves; so the
//!   rope rows of `q` and `kv_a_proj_with_mqa` are permuted once at load
//!   and the shared half-rotation runs;
//! - the softmax scale `(nope + rope)^-0.5`, times YaRN's mscale squared.
//!
//! The decoding cache holds each head's expanded keys and values.

use tch::Tensor;

use crate::attention::AttentionKernel;
use crate::layers::{Linear, RmsNorm, apply_rope};
use crate::target_config::LatentAttentionConfig;

/// The query projection: direct, or through the bottleneck.
#[derive(Debug)]
pub enum LatentQuery {
    Direct(Linear),
    LowRank { a: Linear, norm: RmsNorm, b: Linear },
}

impl LatentQuery {
    fn forward(&self, x: &Tensor) -> Tensor {
        match self {
            LatentQuery::Direct(q) => q.forward(x),
            LatentQuery::LowRank { a, norm, b } => b.forward(&norm.forward(&a.forward(x))),
        }
    }
}

/// One layer's latent attention.
#[derive(Debug)]
pub struct LatentAttention {
    pub q: LatentQuery,
    /// `[kv_lora_rank + rope, H]`.
    pub kv_a: Linear,
    pub kv_norm: RmsNorm,
    /// `[heads * (nope + v), kv_lora_rank]`.
    pub kv_b: Linear,
    pub o_proj: Linear,
    pub heads: i64,
    pub shape: LatentAttentionConfig,
    pub kernel: AttentionKernel,
}

/// Queries and keys `[.., S, heads, nope + rope]`, values `[.., S, heads, v]`.
pub struct LatentProjected {
    pub q: Tensor,
    pub k: Tensor,
    pub v: Tensor,
}

impl LatentAttention {
    /// Projections and RoPE of `x` `[.., S, H]`; `cos`/`sin` broadcast over heads.
    pub fn project(&self, x: &Tensor, cos: &Tensor, sin: &Tensor) -> LatentProjected {
        let m = &self.shape;
        let (nope, rope, vd) = (m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim);
        let mut lead = x.size();
        lead.pop();
        let shape = |heads: i64, per: i64| [lead.clone(), vec![heads, per]].concat();
        let q = self.q.forward(x).view(shape(self.heads, nope + rope).as_slice());
        let q_rot = apply_rope(&q.narrow(-1, nope, rope), cos, sin);
        let q = Tensor::cat(&[q.narrow(-1, 0, nope), q_rot], -1);
        let kv = self.kv_a.forward(x);
        let latent = self.kv_norm.forward(&kv.narrow(-1, 0, m.kv_lora_rank));
        let k_rot = apply_rope(&kv.narrow(-1, m.kv_lora_rank, rope).view(shape(1, rope).as_slice()), cos, sin);
        let kv = self.kv_b.forward(&latent).view(shape(self.heads, nope + vd).as_slice());
        let mut rot_shape = k_rot.size();
        *rot_shape.iter_mut().rev().nth(1).expect("[.., 1, rope]") = self.heads;
        let k = Tensor::cat(&[kv.narrow(-1, 0, nope), k_rot.expand(rot_shape.as_slice(), false)], -1);
        LatentProjected { q, k, v: kv.narrow(-1, nope, vd) }
    }

    /// The attention output `[.., heads * v]` through `o_proj`.
    pub fn output(&self, attended: &Tensor) -> Tensor {
        self.o_proj.forward(attended)
    }
}

/// The row order that turns interleaved RoPE pairs into halves, for a
/// projection of `rows` rows whose every `period` rows end in `rope` RoPE
/// rows: those are reordered even positions first, then odd ones.
pub fn deinterleave_rows(rows: i64, period: i64, rope: i64) -> Vec<i64> {
    let mut order: Vec<i64> = (0..rows).collect();
    for start in (0..rows).step_by(period as usize) {
        let base = start + period - rope;
        let evens = (0..rope / 2).map(|j| base + 2 * j);
        let odds = (0..rope / 2).map(|j| base + 2 * j + 1);
        for (slot, src) in (base..base + rope).zip(evens.chain(odds)) {
            order[slot as usize] = src;
        }
    }
    order
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interleaved_pairs_become_halves_within_each_period() {
        // Two heads of 2 nope + 4 rope rows.
        assert_eq!(deinterleave_rows(12, 6, 4), vec![0, 1, 2, 4, 3, 5, 6, 7, 8, 10, 9, 11]);
    }

    #[test]
    fn rotating_deinterleaved_halves_equals_rotating_interleaved_pairs() {
        tch::manual_seed(3);
        let f = (tch::Kind::Float, tch::Device::Cpu);
        let (d, s) = (8i64, 5i64);
        let x = Tensor::randn([s, d], f);
        let freqs = Tensor::rand([s, d / 2], f) * 3.0;
        let (c, si) = (freqs.cos(), freqs.sin());
        // transformers' apply_rotary_pos_emb_interleave.
        let (x1, x2) = (x.slice(-1, 0, d, 2), x.slice(-1, 1, d, 2));
        let want = Tensor::cat(&[&x1 * &c - &x2 * &si, &x2 * &c + &x1 * &si], -1);
        let order = Tensor::from_slice(&deinterleave_rows(d, d, d));
        let got = apply_rope(&x.index_select(1, &order), &Tensor::cat(&[&c, &c], -1), &Tensor::cat(&[&si, &si], -1));
        assert!((got - want).abs().max().double_value(&[]) < 1e-6);
    }
}
