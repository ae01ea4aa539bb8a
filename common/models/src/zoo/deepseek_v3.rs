//! DeepSeek-V3 (`DeepseekV3ForCausalLM`: DeepSeek-V3 / V3.1 / V3.2-Exp's
//! dense-attention layers, Kimi-K2 / K2.5, Moonlight):
//! - multi-head latent attention (`latent_attention.rs`): `q_lora_rank`
//!   (or a direct `q_proj`), the compressed `kv_lora_rank` latent, the
//!   rope / nope split of each head, YaRN with its softmax mscale;
//! - the first `first_k_dense_replace` layers dense (`intermediate_size`),
//!   the rest MoE: sigmoid scores, the choice among the `topk_group` best
//!   of `n_group` groups by score plus `e_score_correction_bias`, weights
//!   the scores (renormalised with `norm_topk_prob`) times
//!   `routed_scaling_factor`, plus `n_shared_experts` always-on experts
//!   (`mlp.shared_experts`, one MLP of their summed width);
//! - published FP8 block-scaled weights read as for the dense zoo;
//! - multi-token-prediction layers (`model.layers.{num_hidden_layers}..`,
//!   `num_nextn_predict_layers` of them) skipped and named.

use serde_json::{Value, json};

use super::{Architecture, Defaults, dense_layer, layer_with, linear, norm, read_common, sparse_moe};
use crate::ModelError;
use crate::attention::AttentionKernel;
use crate::decoder::{DecoderLayer, FeedForward};
use crate::hf_config::HfConfig;
use crate::latent_attention::{LatentAttention, LatentQuery, deinterleave_rows};
use crate::moe::Routing;
use crate::target_config::{Family, LatentAttentionConfig, MoeConfig, TargetConfig};
use crate::weights::{SkippedPart, TensorNames, Weights};

pub struct DeepseekV3;

impl Architecture for DeepseekV3 {
    fn family(&self) -> Family {
        Family::DeepseekV3
    }

    fn hf_architecture(&self) -> &'static str {
        "DeepseekV3ForCausalLM"
    }

    fn model_type(&self) -> &'static str {
        "deepseek_v3"
    }

    fn read_config(&self, cfg: &mut HfConfig) -> Result<TargetConfig, ModelError> {
        let head_dim_given = cfg.present("head_dim");
        let mut c = read_common(
            cfg,
            Defaults {
                family: Family::DeepseekV3,
                head_dim: None,
                max_position_embeddings: 4096,
                rope: Default::default(),
                intermediate_size: None,
            },
        )?;
        let rope: i64 = cfg.or("qk_rope_head_dim", 64)?;
        // transformers' head_dim is the RoPE part, which the RoPE tables cover.
        if head_dim_given && c.head_dim != rope {
            return Err(cfg.error("head_dim", format!("{} differs from qk_rope_head_dim {rope}", c.head_dim)));
        }
        c.head_dim = rope;
        // null: a direct q_proj (Moonlight, DeepSeek-V2-Lite); absent: transformers' default.
        let q_lora_rank: Option<i64> = if cfg.present("q_lora_rank") { cfg.opt("q_lora_rank")? } else { Some(1536) };
        let m = LatentAttentionConfig {
            q_lora_rank,
            kv_lora_rank: cfg.or("kv_lora_rank", 512)?,
            qk_nope_head_dim: cfg.or("qk_nope_head_dim", 128)?,
            qk_rope_head_dim: rope,
            v_head_dim: cfg.or("v_head_dim", 128)?,
            rope_interleave: cfg.or("rope_interleave", true)?,
            softmax_scale: 0.0,
        };
        for (field, v) in [
            ("q_lora_rank", m.q_lora_rank.unwrap_or(1)),
            ("kv_lora_rank", m.kv_lora_rank),
            ("qk_nope_head_dim", m.qk_nope_head_dim),
            ("qk_rope_head_dim", m.qk_rope_head_dim),
            ("v_head_dim", m.v_head_dim),
        ] {
            if v <= 0 {
                return Err(cfg.error(field, format!("must be positive, got {v}")));
            }
        }
        if rope % 2 != 0 {
            return Err(cfg.error("qk_rope_head_dim", format!("{rope} must be even for RoPE")));
        }
        // transformers 5 writes the derived sum too.
        if let Some(sum) = cfg.opt::<i64>("qk_head_dim")?
            && sum != m.qk_head_dim()
        {
            return Err(cfg.error("qk_head_dim", format!("{sum} is not qk_nope_head_dim + qk_rope_head_dim")));
        }
        let softmax_scale = (m.qk_head_dim() as f64).powf(-0.5) * c.rope.softmax_mscale();
        c.latent_attention = Some(LatentAttentionConfig { softmax_scale, ..m });
        let bias = cfg.or("attention_bias", false)?;
        (c.qkv_bias, c.o_bias) = (bias, bias);
        let tp: i64 = cfg.or("pretraining_tp", 1)?;
        if tp != 1 {
            return Err(cfg.error("pretraining_tp", format!("{tp} (sliced projections) is not supported")));
        }
        c.moe = Some(read_grouped_moe(cfg, c.num_layers)?);
        (c.mtp_layers, c.tensor_names) = read_next_n(cfg, c.num_layers)?;
        Ok(c)
    }

    fn load_layer(&self, w: &mut Weights, c: &TargetConfig, i: i64) -> Result<DecoderLayer, ModelError> {
        let Some(m) = c.moe.as_ref().filter(|m| m.is_sparse(i)) else { return dense_layer(w, c, i) };
        layer_with(w, c, i, |w, p| Ok(FeedForward::Sparse(sparse_moe(w, p, m, c.hidden_size, "shared_experts")?)))
    }

    fn hf_fields(&self, c: &TargetConfig) -> Value {
        let m = c.latent_attention.expect("a DeepSeek-V3 config has latent attention");
        let mut v = json!({
            "q_lora_rank": m.q_lora_rank,
            "kv_lora_rank": m.kv_lora_rank,
            "qk_nope_head_dim": m.qk_nope_head_dim,
            "qk_rope_head_dim": m.qk_rope_head_dim,
            "v_head_dim": m.v_head_dim,
            "rope_interleave": m.rope_interleave,
            "attention_bias": c.qkv_bias,
            "num_nextn_predict_layers": c.mtp_layers,
        });
        if let (Value::Object(all), Value::Object(moe)) = (&mut v, grouped_moe_fields(c)) {
            all.extend(moe);
        }
        v
    }
}

/// The MoE settings DeepSeek-V3 and GLM-4 MoE share: `n_routed_experts`
/// experts of width `moe_intermediate_size` in every layer from
/// `first_k_dense_replace` on, `num_experts_per_tok` chosen by grouped
/// sigmoid routing, `n_shared_experts` shared. The original release's
/// `topk_method`, `scoring_func` and `moe_layer_freq` are checked to be the
/// ones implemented.
pub(crate) fn read_grouped_moe(cfg: &mut HfConfig, num_layers: i64) -> Result<MoeConfig, ModelError> {
    if let Some(m) = cfg.opt::<String>("topk_method")?
        && m != "noaux_tc"
    {
        return Err(cfg.error("topk_method", format!("\"{m}\" is not supported (only noaux_tc)")));
    }
    if let Some(f) = cfg.opt::<String>("scoring_func")?
        && f != "sigmoid"
    {
        return Err(cfg.error("scoring_func", format!("\"{f}\" is not supported (only sigmoid)")));
    }
    let freq: i64 = cfg.or("moe_layer_freq", 1)?;
    if freq != 1 {
        return Err(cfg.error("moe_layer_freq", format!("{freq} is not supported (only 1: every layer)")));
    }
    // Training and deployment settings that do not change the forward.
    cfg.ignore(&["aux_loss_alpha", "seq_aux", "ep_size", "output_router_logits", "router_aux_loss_coef"]);
    let num_experts = cfg.positive("n_routed_experts")?;
    let top_k = cfg.positive("num_experts_per_tok")?;
    let width = cfg.positive("moe_intermediate_size")?;
    let shared: i64 = cfg.or("n_shared_experts", 1)?;
    let n_group: i64 = cfg.or::<Option<i64>>("n_group", None)?.unwrap_or(1);
    let topk_group: i64 = cfg.or::<Option<i64>>("topk_group", None)?.unwrap_or(1);
    let first_dense: i64 = cfg.or::<Option<i64>>("first_k_dense_replace", None)?.unwrap_or(0);
    let norm_topk_prob: bool = cfg.or::<Option<bool>>("norm_topk_prob", None)?.unwrap_or(true);
    let routed_scaling_factor: f64 = cfg.or("routed_scaling_factor", 1.0)?;
    if n_group <= 0 || num_experts % n_group != 0 {
        return Err(cfg.error("n_group", format!("{n_group} must divide n_routed_experts {num_experts}")));
    }
    if topk_group <= 0 || topk_group > n_group {
        return Err(cfg.error("topk_group", format!("{topk_group} must be in 1..={n_group} (n_group)")));
    }
    if num_experts / n_group < 2 {
        return Err(cfg.error("n_group", "groups are scored by their two best experts: each needs at least two"));
    }
    if top_k > topk_group * (num_experts / n_group) {
        return Err(cfg.error(
            "num_experts_per_tok",
            format!(
                "{top_k} exceeds the {} experts of the {topk_group} chosen groups",
                topk_group * (num_experts / n_group)
            ),
        ));
    }
    if !(0..=num_layers).contains(&first_dense) {
        return Err(cfg.error("first_k_dense_replace", format!("{first_dense} is outside 0..={num_layers}")));
    }
    if shared < 0 {
        return Err(cfg.error("n_shared_experts", format!("must not be negative, got {shared}")));
    }
    Ok(MoeConfig {
        dense_layers: (0..first_dense).collect(),
        shared_expert_intermediate_size: (shared > 0).then_some(shared * width),
        routing: Routing::SigmoidGrouped { n_group, topk_group, norm_topk_prob, routed_scaling_factor },
        ..MoeConfig::qwen(num_experts, top_k, width, norm_topk_prob)
    })
}

/// The config fields [`read_grouped_moe`] reads.
pub(crate) fn grouped_moe_fields(c: &TargetConfig) -> Value {
    let m = c.moe.as_ref().expect("a grouped-routing config has experts");
    let Routing::SigmoidGrouped { n_group, topk_group, norm_topk_prob, routed_scaling_factor } = m.routing else {
        unreachable!("grouped sigmoid routing")
    };
    json!({
        "n_routed_experts": m.num_experts,
        "num_experts_per_tok": m.top_k,
        "moe_intermediate_size": m.expert_intermediate_size,
        "n_shared_experts": m.shared_expert_intermediate_size.map_or(0, |s| s / m.expert_intermediate_size),
        "n_group": n_group,
        "topk_group": topk_group,
        "norm_topk_prob": norm_topk_prob,
        "routed_scaling_factor": routed_scaling_factor,
        "first_k_dense_replace": m.dense_layers.len(),
    })
}

/// `num_nextn_predict_layers`: the multi-token-prediction layers stored
/// after the decoder's, named so that loading skips them.
pub(crate) fn read_next_n(cfg: &mut HfConfig, num_layers: i64) -> Result<(i64, TensorNames), ModelError> {
    let n: i64 = cfg.or::<Option<i64>>("num_nextn_predict_layers", None)?.unwrap_or(0);
    if n < 0 {
        return Err(cfg.error("num_nextn_predict_layers", format!("must not be negative, got {n}")));
    }
    let skipped = (num_layers..num_layers + n)
        .map(|l| SkippedPart {
            prefix: format!("model.layers.{l}."),
            what: format!("multi-token prediction layer {}", l - num_layers),
        })
        .collect();
    Ok((n, TensorNames { language_model: None, skipped }))
}

/// `{p}.self_attn.*` of a latent-attention layer. Interleaved RoPE rows are
/// reordered into halves here (`latent_attention.rs`).
pub(crate) fn latent_attention(
    w: &mut Weights,
    p: &str,
    c: &TargetConfig,
    m: &LatentAttentionConfig,
) -> Result<LatentAttention, ModelError> {
    let (h, nh, rope) = (c.hidden_size, c.num_heads, m.qk_rope_head_dim);
    let (qk, bias) = (m.qk_head_dim(), c.qkv_bias);
    let a = format!("{p}.self_attn");
    let reorder = |w: &Weights, t: tch::Tensor, rows: i64, period: i64| {
        if !m.rope_interleave {
            return t;
        }
        w.transform(t, |t| {
            t.index_select(0, &tch::Tensor::from_slice(&deinterleave_rows(rows, period, rope)).to_device(t.device()))
        })
    };
    let q = match m.q_lora_rank {
        Some(r) => {
            let mut b = linear(w, &format!("{a}.q_b_proj"), nh * qk, r, false)?;
            b.weight = reorder(w, b.weight, nh * qk, qk);
            LatentQuery::LowRank {
                a: linear(w, &format!("{a}.q_a_proj"), r, h, bias)?,
                norm: norm(w, c, &format!("{a}.q_a_layernorm"), r)?,
                b,
            }
        }
        None => {
            let mut q = linear(w, &format!("{a}.q_proj"), nh * qk, h, false)?;
            q.weight = reorder(w, q.weight, nh * qk, qk);
            LatentQuery::Direct(q)
        }
    };
    let rows = m.kv_lora_rank + rope;
    let mut kv_a = linear(w, &format!("{a}.kv_a_proj_with_mqa"), rows, h, bias)?;
    kv_a.weight = reorder(w, kv_a.weight, rows, rows);
    if let Some(b) = kv_a.bias.take() {
        kv_a.bias = Some(reorder(w, b, rows, rows));
    }
    Ok(LatentAttention {
        q,
        kv_a,
        kv_norm: norm(w, c, &format!("{a}.kv_a_layernorm"), m.kv_lora_rank)?,
        kv_b: linear(w, &format!("{a}.kv_b_proj"), nh * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank, false)?,
        o_proj: linear(w, &format!("{a}.o_proj"), h, nh * m.v_head_dim, bias)?,
        heads: nh,
        shape: *m,
        kernel: AttentionKernel { scale: m.softmax_scale, window: None, sinks: None },
    })
}
