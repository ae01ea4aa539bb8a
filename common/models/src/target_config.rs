//! The target's shape and settings: plain data. The zoo (`zoo/mod.rs`) reads
//! it from the Hugging Face `config.json` by the family's file and writes it
//! back (`TargetConfig::from_dir`, `from_hf`, `to_hf_json`); nothing here
//! knows the families' files.

use crate::gated_deltanet::{DeltaNetShape, ProjectionLayout};
use crate::moe::{ExpertActivation, Routing};
use crate::quant::Quantization;
use crate::rope::RopeConfig;
use crate::weights::TensorNames;

/// Architectures this crate can run as a target (one file each in `zoo/`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    /// Llama 2/3.x: optional attention and MLP biases, no QK norm.
    Llama,
    /// Mistral: Llama's layers; sliding-window attention must be off.
    Mistral,
    /// Qwen2 / Qwen2.5: biases on the q/k/v projections.
    Qwen2,
    /// Qwen3: per-head RMSNorm on q and k (QK norm).
    Qwen3,
    /// Qwen3 MoE: Qwen3 attention, sparse mixture-of-experts MLPs.
    Qwen3Moe,
    /// Qwen3-Next: Gated DeltaNet and gated attention layers, MoE with a
    /// shared expert.
    Qwen3Next,
    /// Qwen3.5 / 3.6 dense: Qwen3-Next's hybrid layers, dense MLPs.
    Qwen35,
    /// Qwen3.5 / 3.6 MoE: Qwen3-Next's hybrid layers, every MLP sparse.
    Qwen35Moe,
    /// gpt-oss: attention sinks, alternating sliding-window and full
    /// layers, biases everywhere, MoE of clamped-SwiGLU experts.
    GptOss,
    /// DeepSeek-V3 (and Kimi-K2): multi-head latent attention, MoE with
    /// grouped sigmoid routing and shared experts after dense first layers.
    DeepseekV3,
    /// GLM-4.5 / 4.6 / 4.7 MoE: partial RoPE, optional QK norm, DeepSeek's
    /// routing and shared experts.
    Glm4Moe,
}

/// What mixes a layer's tokens (transformers' `layer_types` entries).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayerKind {
    /// `full_attention`: causal softmax attention.
    FullAttention,
    /// `sliding_attention`: causal softmax attention over the last
    /// `sliding_window` positions.
    SlidingAttention,
    /// `linear_attention`: a Gated DeltaNet layer.
    LinearAttention,
}

impl LayerKind {
    pub fn hf_name(self) -> &'static str {
        match self {
            LayerKind::FullAttention => "full_attention",
            LayerKind::SlidingAttention => "sliding_attention",
            LayerKind::LinearAttention => "linear_attention",
        }
    }

    /// Softmax attention (full or windowed).
    pub fn is_attention(self) -> bool {
        matches!(self, LayerKind::FullAttention | LayerKind::SlidingAttention)
    }
}

/// DeepSeek's multi-head latent attention: queries through an optional
/// low-rank bottleneck, keys and values expanded per head from one
/// compressed latent shared by all heads, and a RoPE part of each query and
/// key head (one key RoPE part shared by all heads).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LatentAttentionConfig {
    /// Rank of the query bottleneck (None: one `q_proj`).
    pub q_lora_rank: Option<i64>,
    pub kv_lora_rank: i64,
    pub qk_nope_head_dim: i64,
    pub qk_rope_head_dim: i64,
    pub v_head_dim: i64,
    /// The RoPE part's pairs are interleaved (`rope_interleave`).
    pub rope_interleave: bool,
    /// Softmax scale: `(nope + rope)^-0.5`, times YaRN's mscale squared.
    pub softmax_scale: f64,
}

impl LatentAttentionConfig {
    pub fn qk_head_dim(&self) -> i64 {
        self.qk_nope_head_dim + self.qk_rope_head_dim
    }

    /// Multiply-adds per token of the projections, `heads` heads over a
    /// stream of width `hidden`.
    pub fn macs(&self, hidden: i64, heads: i64) -> i64 {
        let q = match self.q_lora_rank {
            Some(r) => hidden * r + r * heads * self.qk_head_dim(),
            None => hidden * heads * self.qk_head_dim(),
        };
        let kv = hidden * (self.kv_lora_rank + self.qk_rope_head_dim)
            + self.kv_lora_rank * heads * (self.qk_nope_head_dim + self.v_head_dim);
        q + kv + heads * self.v_head_dim * hidden
    }

    /// Parameters: the projections and the bottlenecks' norms.
    pub fn parameters(&self, hidden: i64, heads: i64) -> i64 {
        self.macs(hidden, heads) + self.q_lora_rank.unwrap_or(0) + self.kv_lora_rank
    }
}

/// How a family's RMSNorm applies its scale.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum NormStyle {
    /// Llama's `w * x_hat.to(dtype)`: the normalised value rounded, then scaled.
    #[default]
    Plain,
    /// `(w * x_hat).to(dtype)` with the scale kept in f32 (gpt-oss).
    ScaleInF32,
    /// Zero-centred scales, `x_hat * (1 + w)` in f32 (Qwen3-Next, Qwen3.5).
    ZeroCentred,
}

/// The Gated DeltaNet layers of a hybrid target.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LinearAttentionConfig {
    pub shape: DeltaNetShape,
    pub layout: ProjectionLayout,
}

/// The mixture-of-experts settings of a sparse target.
#[derive(Clone, Debug, PartialEq)]
pub struct MoeConfig {
    pub num_experts: i64,
    /// Experts per token.
    pub top_k: i64,
    /// Intermediate size of one expert.
    pub expert_intermediate_size: i64,
    /// Renormalise the chosen experts' weights to sum to 1.
    pub norm_topk_prob: bool,
    /// Every `sparse_step`-th layer is sparse (layer i when (i+1) % step == 0) ...
    pub sparse_step: i64,
    /// ... unless listed here (dense MLP of `intermediate_size`).
    pub dense_layers: Vec<i64>,
    /// Width of the shared expert every token also passes through; None:
    /// no shared expert.
    pub shared_expert_intermediate_size: Option<i64>,
    /// The shared expert is scaled by a sigmoid gate (Qwen3-Next, Qwen3.5).
    pub shared_expert_gate: bool,
    /// How the router picks and weighs experts.
    pub routing: Routing,
    /// The router has a bias (gpt-oss).
    pub router_bias: bool,
    /// The experts' projections have biases (gpt-oss).
    pub expert_bias: bool,
    pub activation: ExpertActivation,
}

impl MoeConfig {
    /// Qwen MoE's settings: softmax routing, SwiGLU experts, no biases.
    pub fn qwen(num_experts: i64, top_k: i64, expert_intermediate_size: i64, norm_topk_prob: bool) -> Self {
        Self {
            num_experts,
            top_k,
            expert_intermediate_size,
            norm_topk_prob,
            sparse_step: 1,
            dense_layers: Vec::new(),
            shared_expert_intermediate_size: None,
            shared_expert_gate: false,
            routing: Routing::Softmax { norm_topk_prob },
            router_bias: false,
            expert_bias: false,
            activation: ExpertActivation::SwiGlu,
        }
    }
}

impl MoeConfig {
    /// Whether layer `i` has the MoE block (else a dense MLP).
    pub fn is_sparse(&self, i: i64) -> bool {
        !self.dense_layers.contains(&i) && self.num_experts > 0 && (i + 1) % self.sparse_step == 0
    }
}

/// Shape and settings of a target model.
#[derive(Clone, Debug, PartialEq)]
pub struct TargetConfig {
    pub family: Family,
    pub hidden_size: i64,
    /// Intermediate size of the dense MLPs.
    pub intermediate_size: i64,
    pub num_layers: i64,
    pub num_heads: i64,
    pub num_kv_heads: i64,
    pub head_dim: i64,
    pub rms_norm_eps: f64,
    pub rope: RopeConfig,
    pub vocab_size: i64,
    pub tie_word_embeddings: bool,
    /// Biases on q/k/v.
    pub qkv_bias: bool,
    /// Bias on o_proj.
    pub o_bias: bool,
    /// Biases on the MLP's gate/up/down.
    pub mlp_bias: bool,
    /// Per-head RMSNorm on q and k before RoPE.
    pub qk_norm: bool,
    pub max_position_embeddings: i64,
    pub moe: Option<MoeConfig>,
    /// How the checkpoint's weights are quantized (None: stored as floats).
    pub quant: Option<Quantization>,
    /// Each layer's token mixer (all full attention outside hybrid families).
    pub layer_types: Vec<LayerKind>,
    /// The linear-attention layers' settings (hybrid families).
    pub linear_attention: Option<LinearAttentionConfig>,
    /// Gated attention: `q_proj` also gives a per-head output gate.
    pub attn_output_gate: bool,
    /// How the RMSNorms' scales apply.
    pub norm: NormStyle,
    /// How the checkpoint names the tensors and which parts are not read.
    pub tensor_names: TensorNames,
    /// Multi-token-prediction layers the checkpoint has (never loaded).
    pub mtp_layers: i64,
    /// Positions a `sliding_attention` layer sees (itself included).
    pub sliding_window: Option<i64>,
    /// A learned sink logit per head in every attention softmax (gpt-oss).
    pub attention_sinks: bool,
    /// Multi-head latent attention in place of `q/k/v_proj` (DeepSeek-V3).
    pub latent_attention: Option<LatentAttentionConfig>,
}

impl Default for TargetConfig {
    /// Zero sizes and every option off: the base that shapes are written
    /// over (`TargetConfig { hidden_size: .., ..Default::default() }`).
    fn default() -> Self {
        Self {
            family: Family::Llama,
            hidden_size: 0,
            intermediate_size: 0,
            num_layers: 0,
            num_heads: 0,
            num_kv_heads: 0,
            head_dim: 0,
            rms_norm_eps: 1e-6,
            rope: RopeConfig::plain(10_000.0),
            vocab_size: 0,
            tie_word_embeddings: false,
            qkv_bias: false,
            o_bias: false,
            mlp_bias: false,
            qk_norm: false,
            max_position_embeddings: 4096,
            moe: None,
            quant: None,
            layer_types: Vec::new(),
            linear_attention: None,
            attn_output_gate: false,
            norm: NormStyle::Plain,
            tensor_names: TensorNames::default(),
            mtp_layers: 0,
            sliding_window: None,
            attention_sinks: false,
            latent_attention: None,
        }
    }
}

impl TargetConfig {
    /// Shorthand: the RoPE base.
    pub fn rope_theta(&self) -> f64 {
        self.rope.theta
    }

    /// Whether decoder layer `i` is a mixture of experts.
    pub fn is_sparse_layer(&self, i: i64) -> bool {
        self.moe.as_ref().is_some_and(|m| m.is_sparse(i))
    }

    /// Layer `i`'s token mixer.
    pub fn layer_kind(&self, i: i64) -> LayerKind {
        self.layer_types.get(i as usize).copied().unwrap_or(LayerKind::FullAttention)
    }

    /// Whether the model has linear-attention layers.
    pub fn is_hybrid(&self) -> bool {
        self.linear_attention.is_some()
    }

    /// The full-attention layers all families share, `n` of them.
    pub fn all_attention(n: i64) -> Vec<LayerKind> {
        vec![LayerKind::FullAttention; n as usize]
    }

    /// Rows of `q_proj`: the queries, and the gates of gated attention.
    pub fn q_proj_rows(&self) -> i64 {
        self.num_heads * self.head_dim * if self.attn_output_gate { 2 } else { 1 }
    }

    /// Multiply-adds per token of decoder layer `i`'s projections
    /// (attention or linear-attention projections, router and the experts
    /// a token visits, or the dense MLP): active parameters, what MFU is
    /// counted on. The depthwise convolution and the delta rule of
    /// linear-attention layers are not counted.
    pub fn layer_linear_macs(&self, i: i64) -> f64 {
        let (h, hd) = (self.hidden_size as f64, self.head_dim as f64);
        let (qd, kvd) = (self.num_heads as f64 * hd, self.num_kv_heads as f64 * hd);
        let mixer = match (self.layer_kind(i), &self.linear_attention, &self.latent_attention) {
            (LayerKind::LinearAttention, Some(l), _) => {
                h * l.shape.projection_dim() as f64 + l.shape.value_dim() as f64 * h
            }
            (_, _, Some(m)) => m.macs(h as i64, self.num_heads) as f64,
            _ => h * self.q_proj_rows() as f64 + h * kvd * 2.0 + qd * h,
        };
        let mlp = match &self.moe {
            Some(m) if m.is_sparse(i) => {
                let gate = if m.shared_expert_gate { h } else { 0.0 };
                let shared = m.shared_expert_intermediate_size.map_or(0.0, |s| 3.0 * h * s as f64 + gate);
                h * m.num_experts as f64 + m.top_k as f64 * 3.0 * h * m.expert_intermediate_size as f64 + shared
            }
            _ => 3.0 * h * self.intermediate_size as f64,
        };
        mixer + mlp
    }

    /// FLOPs of layer `i`'s softmax attention over one sequence of `len`
    /// tokens: the visible (causal, windowed) query-key pairs, each a
    /// `q . k` and a weighted sum of values over every head. Zero for a
    /// linear-attention layer.
    pub fn attention_flops(&self, i: i64, len: usize) -> f64 {
        let kind = self.layer_kind(i);
        if !kind.is_attention() {
            return 0.0;
        }
        let (qk, v) = match &self.latent_attention {
            Some(m) => (m.qk_head_dim(), m.v_head_dim),
            None => (self.head_dim, self.head_dim),
        };
        let l = len as f64;
        let pairs = match (kind, self.sliding_window) {
            (LayerKind::SlidingAttention, Some(w)) if (w as f64) < l => {
                let w = w as f64;
                w * (w + 1.0) / 2.0 + (l - w) * w
            }
            _ => l * (l + 1.0) / 2.0,
        };
        2.0 * self.num_heads as f64 * (qk + v) as f64 * pairs
    }

    /// Parameters of layer `i` (all experts counted).
    pub fn layer_parameters(&self, i: i64) -> i64 {
        let (h, hd) = (self.hidden_size, self.head_dim);
        let (qd, kvd) = (self.num_heads * hd, self.num_kv_heads * hd);
        let mut n = 2 * h;
        n += match (self.layer_kind(i), &self.linear_attention, &self.latent_attention) {
            (LayerKind::LinearAttention, Some(l), _) => l.shape.parameters(h),
            (_, _, Some(m)) => m.parameters(h, self.num_heads),
            _ => {
                let mut a = h * self.q_proj_rows() + h * kvd * 2 + qd * h;
                a += if self.qkv_bias { self.q_proj_rows() + 2 * kvd } else { 0 } + if self.o_bias { h } else { 0 };
                a += if self.attention_sinks { self.num_heads } else { 0 };
                a + if self.qk_norm { 2 * hd } else { 0 }
            }
        };
        n += match &self.moe {
            Some(m) if m.is_sparse(i) => {
                let gate = if m.shared_expert_gate { h } else { 0 };
                let shared = m.shared_expert_intermediate_size.map_or(0, |s| 3 * h * s + gate);
                let router = m.num_experts * (h + i64::from(m.router_bias));
                let routing_bias = if matches!(m.routing, Routing::SigmoidGrouped { .. }) { m.num_experts } else { 0 };
                let bias = if m.expert_bias { 2 * m.expert_intermediate_size + h } else { 0 };
                router + routing_bias + m.num_experts * (3 * h * m.expert_intermediate_size + bias) + shared
            }
            _ => 3 * h * self.intermediate_size + if self.mlp_bias { 2 * self.intermediate_size + h } else { 0 },
        };
        n
    }

    /// Every parameter of the model.
    pub fn parameter_count(&self) -> i64 {
        let embeddings = self.vocab_size * self.hidden_size * if self.tie_word_embeddings { 1 } else { 2 };
        embeddings + self.hidden_size + (0..self.num_layers).map(|i| self.layer_parameters(i)).sum::<i64>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sparse_layers_follow_the_step_and_the_dense_list() {
        let m = MoeConfig { sparse_step: 2, dense_layers: vec![3], ..MoeConfig::qwen(8, 2, 4, true) };
        let sparse: Vec<i64> = (0..6).filter(|&i| m.is_sparse(i)).collect();
        assert_eq!(sparse, vec![1, 5]);
    }
}
