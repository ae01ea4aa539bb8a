//! gpt-oss (`GptOssForCausalLM`: gpt-oss-20b, gpt-oss-120b):
//! - attention with biases on q/k/v/o and a learned sink logit per head
//!   (`self_attn.sinks`) that takes a share of every softmax;
//! - `layer_types` alternating `sliding_attention` (a window of
//!   `sliding_window` positions) and `full_attention`;
//! - YaRN RoPE (`truncate: false` in the published configs);
//! - RMSNorms that scale in f32 before rounding;
//! - every MLP a mixture of `num_local_experts` experts: a router with a
//!   bias (`mlp.router`) takes the top `num_experts_per_tok` logits and
//!   softmaxes over them; each expert is a clamped SwiGLU with biases whose
//!   gate and up projections interleave (`gate_up_proj[..., ::2]` is the
//!   gate), stored as transformers keeps them (`experts.gate_up_proj`
//!   `[E, H, 2I]`, `experts.down_proj` `[E, I, H]`), or as the published
//!   MXFP4 blocks, dequantized on load (`quant.rs`).

use serde_json::{Value, json};
use tch::Tensor;

use super::{Architecture, Defaults, layer_with, read_common};
use crate::ModelError;
use crate::decoder::{DecoderLayer, FeedForward};
use crate::hf_config::HfConfig;
use crate::moe::{ExpertActivation, Experts, Router, Routing, SparseMoe};
use crate::rope::{RopeConfig, RopeOptions, RopeScaling};
use crate::target_config::{Family, LayerKind, MoeConfig, NormStyle, TargetConfig};
use crate::weights::Weights;

pub struct GptOss;

/// transformers' defaults for what the config leaves out.
const DEFAULT_WINDOW: i64 = 128;
const DEFAULT_THETA: f64 = 150_000.0;

impl Architecture for GptOss {
    fn family(&self) -> Family {
        Family::GptOss
    }

    fn hf_architecture(&self) -> &'static str {
        "GptOssForCausalLM"
    }

    fn model_type(&self) -> &'static str {
        "gpt_oss"
    }

    fn read_config(&self, cfg: &mut HfConfig) -> Result<TargetConfig, ModelError> {
        // transformers gives gpt-oss its YaRN unless one of these is set
        // (null counts as unset; rope_theta alone keeps YaRN).
        let rope_given = cfg.has("rope_scaling") || cfg.has("rope_parameters");
        let eps_given = cfg.present("rms_norm_eps");
        let mut c = read_common(
            cfg,
            Defaults {
                family: Family::GptOss,
                head_dim: Some(64),
                max_position_embeddings: 131_072,
                rope: RopeOptions { theta: Some(DEFAULT_THETA), ..Default::default() },
                intermediate_size: None,
            },
        )?;
        if !rope_given {
            // transformers' default: YaRN x32 over 4096 positions, not truncated.
            c.rope = RopeConfig { scaling: RopeScaling::gpt_oss_default(), ..c.rope };
        }
        if !eps_given {
            c.rms_norm_eps = 1e-5;
        }
        let bias = cfg.or("attention_bias", true)?;
        (c.qkv_bias, c.o_bias, c.attention_sinks, c.norm) = (bias, bias, true, NormStyle::ScaleInF32);
        let window: i64 = cfg.or("sliding_window", DEFAULT_WINDOW)?;
        if window <= 0 {
            return Err(cfg.error("sliding_window", format!("must be positive, got {window}")));
        }
        c.sliding_window = Some(window);
        c.layer_types = match cfg.opt::<Vec<String>>("layer_types")? {
            None => (0..c.num_layers)
                .map(|i| if i % 2 == 0 { LayerKind::SlidingAttention } else { LayerKind::FullAttention })
                .collect(),
            Some(types) if types.len() as i64 != c.num_layers => {
                return Err(
                    cfg.error("layer_types", format!("has {} entries for {} layers", types.len(), c.num_layers))
                );
            }
            Some(types) => types
                .iter()
                .enumerate()
                .map(|(i, t)| match t.as_str() {
                    "sliding_attention" => Ok(LayerKind::SlidingAttention),
                    "full_attention" => Ok(LayerKind::FullAttention),
                    other => Err(cfg.error(
                        "layer_types",
                        format!("layer {i} is \"{other}\" (supported: sliding_attention, full_attention)"),
                    )),
                })
                .collect::<Result<_, _>>()?,
        };
        // `experts_per_token` and `initial_context_length` repeat fields
        // read above (the original release's names).
        cfg.ignore(&["output_router_logits", "router_aux_loss_coef", "experts_per_token", "initial_context_length"]);
        // transformers maps num_experts onto num_local_experts.
        let num_experts = match cfg.opt::<i64>("num_experts")? {
            Some(n) => n,
            None => cfg.positive("num_local_experts")?,
        };
        let top_k = cfg.positive("num_experts_per_tok")?;
        if top_k > num_experts {
            return Err(cfg.error("num_experts_per_tok", format!("{top_k} exceeds num_local_experts {num_experts}")));
        }
        let alpha: f64 = cfg.or("swiglu_alpha", 1.702)?;
        let limit: f64 = cfg.or("swiglu_limit", 7.0)?;
        if limit.is_nan() || limit <= 0.0 {
            return Err(cfg.error("swiglu_limit", format!("must be positive, got {limit}")));
        }
        // Every MLP is sparse; intermediate_size is the experts' width.
        let width = std::mem::take(&mut c.intermediate_size);
        c.moe = Some(MoeConfig {
            routing: Routing::TopKSoftmax,
            router_bias: true,
            expert_bias: true,
            activation: ExpertActivation::ClampedSwiGlu { alpha, limit },
            ..MoeConfig::qwen(num_experts, top_k, width, false)
        });
        Ok(c)
    }

    fn load_layer(&self, w: &mut Weights, c: &TargetConfig, i: i64) -> Result<DecoderLayer, ModelError> {
        let m = c.moe.as_ref().expect("a gpt-oss config has experts");
        layer_with(w, c, i, |w, p| Ok(FeedForward::Sparse(experts(w, p, m, c.hidden_size)?)))
    }

    fn hf_fields(&self, c: &TargetConfig) -> Value {
        let m = c.moe.as_ref().expect("a gpt-oss config has experts");
        let ExpertActivation::ClampedSwiGlu { alpha, limit } = m.activation else {
            unreachable!("gpt-oss experts are clamped SwiGLUs")
        };
        // A null rope_scaling would read as gpt-oss's default YaRN.
        let (_, scaling) = c.rope.to_hf_fields();
        let scaling = if scaling.is_null() { json!({"rope_type": "default"}) } else { scaling };
        json!({
            "rope_scaling": scaling,
            "attention_bias": c.qkv_bias,
            "sliding_window": c.sliding_window,
            "layer_types": c.layer_types.iter().map(|k| k.hf_name()).collect::<Vec<_>>(),
            "num_local_experts": m.num_experts,
            "num_experts_per_tok": m.top_k,
            "intermediate_size": m.expert_intermediate_size,
            "swiglu_alpha": alpha,
            "swiglu_limit": limit,
        })
    }
}

/// `{p}.mlp`: the router with its bias, and the experts with theirs, the
/// interleaved gate/up columns split into gate rows then up rows.
fn experts(w: &mut Weights, p: &str, m: &MoeConfig, h: i64) -> Result<SparseMoe, ModelError> {
    let (e, i) = (m.num_experts, m.expert_intermediate_size);
    let router = Router {
        weight: w.take(&format!("{p}.mlp.router.weight"), &[e, h])?,
        bias: Some(w.take(&format!("{p}.mlp.router.bias"), &[e])?),
        correction_bias: None,
        top_k: m.top_k,
        routing: m.routing.clone(),
    };
    let x = format!("{p}.mlp.experts");
    // [E, H, 2I] -> [E, 2I, H], then interleaved rows (gate, up, gate, ...)
    // to all gates then all ups.
    let split = |t: Tensor, rows_first: bool| {
        let t = if rows_first { t } else { t.transpose(1, 2) };
        let rest: Vec<i64> = t.size()[2..].to_vec();
        let pairs = t.reshape([vec![e, i, 2], rest.clone()].concat().as_slice());
        Tensor::cat(&[pairs.select(2, 0), pairs.select(2, 1)], 1).contiguous()
    };
    let gate_up = w.take(&format!("{x}.gate_up_proj"), &[e, h, 2 * i])?;
    let gate_up = w.transform(gate_up, |t| split(t, false));
    let gate_up_bias = w.take(&format!("{x}.gate_up_proj_bias"), &[e, 2 * i])?;
    let gate_up_bias = w.transform(gate_up_bias, |t| split(t, true));
    let down = w.take(&format!("{x}.down_proj"), &[e, i, h])?;
    let down = w.transform(down, |t| t.transpose(1, 2).contiguous());
    let experts = Experts {
        gate_up,
        down,
        gate_up_bias: Some(gate_up_bias),
        down_bias: Some(w.take(&format!("{x}.down_proj_bias"), &[e, h])?),
        activation: m.activation,
    };
    Ok(SparseMoe { router, experts, shared: None })
}
