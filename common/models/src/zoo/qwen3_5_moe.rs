//! Qwen3.5 / Qwen3.6 MoE (`Qwen3_5MoeForCausalLM`, and as published
//! `Qwen3_5MoeForConditionalGeneration`: Qwen3.5-35B-A3B, -122B-A10B,
//! -397B-A17B, Qwen3.6-35B-A3B): Qwen3.5's hybrid layers, and in every
//! layer a MoE block of `num_experts` experts, `num_experts_per_tok` per
//! token with their weights always renormalised, plus a shared expert
//! behind a sigmoid gate.

use serde_json::{Value, json};

use super::hybrid::{self, HybridFamily};
use super::{Architecture, layer_with};
use crate::ModelError;
use crate::decoder::{DecoderLayer, FeedForward};
use crate::gated_deltanet::ProjectionLayout;
use crate::hf_config::HfConfig;
use crate::target_config::{Family, MoeConfig, TargetConfig};
use crate::weights::Weights;

pub struct Qwen35Moe;

fn read_text(cfg: &mut HfConfig) -> Result<TargetConfig, ModelError> {
    // transformers' Qwen3.5 MoE has no dense MLP and does not read the width.
    cfg.ignore(&["intermediate_size"]);
    let family = HybridFamily {
        family: Family::Qwen35Moe,
        layout: ProjectionLayout::Split,
        mrope: true,
        vision: true,
        // Every MLP is sparse: no dense width.
        intermediate_size: Some(0),
    };
    let mut c = hybrid::read_text(cfg, &family)?;
    cfg.ignore(&["output_router_logits", "router_aux_loss_coef"]);
    // The router always renormalises and every layer is sparse; a config
    // saying otherwise describes another model.
    if cfg.opt::<bool>("norm_topk_prob")? == Some(false) {
        return Err(cfg.error("norm_topk_prob", "false: Qwen3.5 MoE always renormalises the chosen experts"));
    }
    if let Some(step) = cfg.opt::<i64>("decoder_sparse_step")?
        && step != 1
    {
        return Err(cfg.error("decoder_sparse_step", format!("{step}: every Qwen3.5 MoE layer is sparse")));
    }
    if let Some(l) = cfg.opt::<Vec<i64>>("mlp_only_layers")?
        && !l.is_empty()
    {
        return Err(cfg.error("mlp_only_layers", format!("{l:?}: every Qwen3.5 MoE layer is sparse")));
    }
    let num_experts: i64 = cfg.or("num_experts", 256)?;
    let top_k: i64 = cfg.or("num_experts_per_tok", 8)?;
    if !(1..=num_experts).contains(&top_k) {
        return Err(cfg.error("num_experts_per_tok", format!("{top_k} does not fit {num_experts} experts")));
    }
    let shared: i64 = cfg.or("shared_expert_intermediate_size", 512)?;
    c.moe = Some(MoeConfig {
        shared_expert_intermediate_size: (shared > 0).then_some(shared),
        shared_expert_gate: true,
        ..MoeConfig::qwen(num_experts, top_k, cfg.or("moe_intermediate_size", 512)?, true)
    });
    Ok(c)
}

impl Architecture for Qwen35Moe {
    fn family(&self) -> Family {
        Family::Qwen35Moe
    }

    fn hf_architecture(&self) -> &'static str {
        "Qwen3_5MoeForCausalLM"
    }

    fn model_type(&self) -> &'static str {
        "qwen3_5_moe_text"
    }

    fn aliases(&self) -> &'static [&'static str] {
        &["Qwen3_5MoeForConditionalGeneration", "qwen3_5_moe"]
    }

    fn read_config(&self, cfg: &mut HfConfig) -> Result<TargetConfig, ModelError> {
        hybrid::read_either_layout(cfg, read_text)
    }

    fn load_layer(&self, w: &mut Weights, c: &TargetConfig, i: i64) -> Result<DecoderLayer, ModelError> {
        let m = c.moe.as_ref().expect("a Qwen3.5 MoE config has experts");
        layer_with(w, c, i, |w, p| Ok(FeedForward::Sparse(super::sparse_moe(w, p, m, c.hidden_size, "shared_expert")?)))
    }

    fn to_hf_json(&self, c: &TargetConfig) -> Value {
        let mut v = super::base_hf_json(self, c);
        // The family has no dense MLP width (transformers refuses the field).
        if let Value::Object(m) = &mut v {
            m.remove("intermediate_size");
        }
        v
    }

    fn hf_fields(&self, c: &TargetConfig) -> Value {
        let m = c.moe.as_ref().expect("a Qwen3.5 MoE config has experts");
        let mut v = hybrid::hf_fields(c);
        if let (Value::Object(all), Value::Object(own)) = (
            &mut v,
            json!({
                "num_experts": m.num_experts,
                "num_experts_per_tok": m.top_k,
                "moe_intermediate_size": m.expert_intermediate_size,
                "shared_expert_intermediate_size": m.shared_expert_intermediate_size.unwrap_or(0),
            }),
        ) {
            all.extend(own);
        }
        v
    }
}
