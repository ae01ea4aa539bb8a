//! One decoder layer of a target, as every supported family has it:
//! RMSNorm -> token mixer (softmax attention, DeepSeek's latent attention,
//! or Gated DeltaNet linear attention in hybrid families) -> residual add -> RMSNorm -> feed-forward
//! (dense SwiGLU MLP or sparse MoE block) -> residual add; run over packed
//! sequences (capture) or against the decoding cache.

use tch::Tensor;

use crate::KvCache;
use crate::gated_deltanet::{GatedDeltaNet, PackedLayout};
use crate::latent_attention::LatentAttention;
use crate::layers::{Attention, Mlp, RmsNorm};
use crate::moe::SparseMoe;

/// The MLP half of a layer.
#[derive(Debug)]
pub enum FeedForward {
    Dense(Mlp),
    Sparse(SparseMoe),
}

impl FeedForward {
    pub fn forward(&self, x: &Tensor) -> Tensor {
        match self {
            FeedForward::Dense(m) => m.forward(x),
            FeedForward::Sparse(m) => m.forward(x),
        }
    }
}

/// What mixes information across a sequence's tokens.
#[derive(Debug)]
pub enum Mixer {
    /// Causal softmax attention (`self_attn`).
    Attention(Attention),
    /// A Gated DeltaNet layer (`linear_attn`).
    Linear(GatedDeltaNet),
    /// Multi-head latent attention (`self_attn` of DeepSeek-V3).
    Latent(LatentAttention),
}

/// A decoder layer, with its Hugging Face module names.
#[derive(Debug)]
pub struct DecoderLayer {
    pub input_layernorm: RmsNorm,
    pub mixer: Mixer,
    pub post_attention_layernorm: RmsNorm,
    pub mlp: FeedForward,
}

impl DecoderLayer {
    /// Packed sequences `x` `[T, H]` of lengths `lens`, each attending
    /// causally to itself (`linear`: their layout for linear-attention
    /// layers, made once per batch). `mark(stage)` is called after each
    /// stage (profiling; a no-op otherwise).
    #[allow(clippy::too_many_arguments)]
    pub fn forward_packed(
        &self,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        lens: &[i64],
        linear: Option<&PackedLayout>,
        mark: &mut dyn FnMut(&'static str),
    ) -> Tensor {
        let h = self.input_layernorm.forward(x);
        mark("input norm");
        let mixed = match &self.mixer {
            Mixer::Attention(a) => attention_packed(a, &h, cos, sin, lens, mark),
            Mixer::Linear(l) => l.forward_packed(&h, linear.expect("a hybrid batch has its packed layout"), mark),
            Mixer::Latent(a) => {
                let p = a.project(&h, cos, sin);
                mark("latent q/kv + rope");
                let o = a.kernel.packed(&p.q, &p.k, &p.v, lens);
                mark("attention");
                let y = a.output(&o);
                mark("o_proj");
                y
            }
        };
        let x = x + mixed;
        mark("mixer residual");
        let h = self.post_attention_layernorm.forward(&x);
        mark("post norm");
        let y = &x + self.mlp.forward(&h);
        mark(match self.mlp {
            FeedForward::Dense(_) => "mlp + residual",
            FeedForward::Sparse(_) => "moe + residual",
        });
        y
    }

    /// `x` `[B, t, H]` at the positions of `cos`/`sin`, attending to the
    /// cache of layer `layer` plus itself under `mask` `[B, 1, t, L + t]`
    /// (`valid` `[B, t]`: which new tokens are real); extends the cache.
    #[allow(clippy::too_many_arguments)]
    pub fn forward_cached(
        &self,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        mask: &Tensor,
        valid: &Tensor,
        cache: &mut KvCache,
        layer: usize,
    ) -> Tensor {
        let h = self.input_layernorm.forward(x);
        let mixed = match &self.mixer {
            Mixer::Attention(a) => {
                let p = a.project(&h, cos, sin); // [B, t, heads, d]
                let (k, v) = cache.append(layer, p.k.transpose(1, 2), p.v.transpose(1, 2)); // [B, kv, L+t, d]
                a.output(&a.kernel.cached(&p.q.transpose(1, 2), &k, &v, mask), p.gate.as_ref())
            }
            Mixer::Latent(a) => {
                let p = a.project(&h, cos, sin); // [B, t, heads, d]
                let (k, v) = cache.append(layer, p.k.transpose(1, 2), p.v.transpose(1, 2));
                a.output(&a.kernel.cached(&p.q.transpose(1, 2), &k, &v, mask))
            }
            Mixer::Linear(l) => {
                let record = KvCache::records(x.size()[1]);
                let (y, state) = l.forward_cached(&h, valid, cache.recurrent(layer), record);
                cache.set_recurrent(layer, state);
                y
            }
        };
        let x = x + mixed;
        &x + self.mlp.forward(&self.post_attention_layernorm.forward(&x))
    }
}

/// Causal attention of each packed sequence with itself.
fn attention_packed(
    a: &Attention,
    h: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    lens: &[i64],
    mark: &mut dyn FnMut(&'static str),
) -> Tensor {
    let p = a.project(h, cos, sin); // [T, heads, d]
    mark("qkv + qk-norm + rope");
    let outs = a.kernel.packed(&p.q, &p.k, &p.v, lens);
    mark("attention");
    let y = a.output(&outs, p.gate.as_ref());
    mark("o_proj");
    y
}
