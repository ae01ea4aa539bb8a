//! One decoder layer of a target, as every supported family has it:
//! RMSNorm -> token mixer (softmax attention, or Gated DeltaNet linear
//! attention in hybrid families) -> residual add -> RMSNorm -> feed-forward
//! (dense SwiGLU MLP or sparse MoE block) -> residual add; run over packed
//! sequences (capture) or against the decoding cache.

use tch::Tensor;

use crate::KvCache;
use crate::gated_deltanet::{GatedDeltaNet, PackedLayout};
use crate::layers::{Attention, Mlp, RmsNorm, repeat_kv};
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
                let n_rep = a.num_heads / a.num_kv_heads;
                let o = Tensor::scaled_dot_product_attention(
                    &p.q.transpose(1, 2),
                    &repeat_kv(&k, n_rep),
                    &repeat_kv(&v, n_rep),
                    Some(mask),
                    0.0,
                    false,
                    None,
                    false,
                );
                let (b, t) = (x.size()[0], x.size()[1]);
                a.output(&o.transpose(1, 2).reshape([b, t, a.num_heads * a.head_dim]), p.gate.as_ref())
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
    let (qs, ks, vs) = (p.q.split_with_sizes(lens, 0), p.k.split_with_sizes(lens, 0), p.v.split_with_sizes(lens, 0));
    let outs: Vec<Tensor> = qs
        .iter()
        .zip(&ks)
        .zip(&vs)
        .map(|((q, k), v)| {
            let q = q.transpose(0, 1).unsqueeze(0);
            let k = k.transpose(0, 1).unsqueeze(0);
            let v = v.transpose(0, 1).unsqueeze(0);
            // Grouped-query attention inside the (flash) kernel: no copy
            // of the kv heads per query head.
            let o = Tensor::scaled_dot_product_attention(&q, &k, &v, None::<Tensor>, 0.0, true, None, true);
            o.squeeze_dim(0).transpose(0, 1).reshape([-1, a.num_heads * a.head_dim])
        })
        .collect();
    let outs = Tensor::cat(&outs, 0);
    mark("attention");
    let y = a.output(&outs, p.gate.as_ref());
    mark("o_proj");
    y
}
