//! Qwen3-Next (`Qwen3NextForCausalLM`: Qwen3-Next-80B-A3B, Qwen3-Coder-Next):
//! the hybrid layers of `hybrid.rs` -- three Gated DeltaNet layers to one
//! gated attention layer by default -- with the input projections fused
//! per key head (`in_proj_qkvz`, `in_proj_ba`), and in every
//! `decoder_sparse_step`-th layer not in `mlp_only_layers` a MoE block of
//! `num_experts` experts (`num_experts_per_tok` per token, softmax router,
//! `norm_topk_prob`) plus a shared expert behind a sigmoid gate.

use serde_json::{Value, json};

use super::hybrid::{self, HybridFamily};
use super::{Architecture, dense_layer, layer_with};
use crate::ModelError;
use crate::decoder::{DecoderLayer, FeedForward};
use crate::gated_deltanet::ProjectionLayout;
use crate::hf_config::HfConfig;
use crate::target_config::{Family, MoeConfig, TargetConfig};
use crate::weights::Weights;

pub struct Qwen3Next;

impl Architecture for Qwen3Next {
    fn family(&self) -> Family {
        Family::Qwen3Next
    }

    fn hf_architecture(&self) -> &'static str {
        "Qwen3NextForCausalLM"
    }

    fn model_type(&self) -> &'static str {
        "qwen3_next"
    }

    fn read_config(&self, cfg: &mut HfConfig) -> Result<TargetConfig, ModelError> {
        let family = HybridFamily {
            family: Family::Qwen3Next,
            layout: ProjectionLayout::GroupedByKeyHead,
            mrope: false,
            vision: false,
            intermediate_size: None,
        };
        let mut c = hybrid::read_text(cfg, &family)?;
        cfg.ignore(&["output_router_logits", "router_aux_loss_coef"]);
        let num_experts: i64 = cfg.or("num_experts", 512)?;
        let top_k: i64 = cfg.or("num_experts_per_tok", 10)?;
        if num_experts < 0 || (num_experts > 0 && !(1..=num_experts).contains(&top_k)) {
            return Err(cfg.error("num_experts_per_tok", format!("{top_k} does not fit {num_experts} experts")));
        }
        let sparse_step: i64 = cfg.or("decoder_sparse_step", 1)?;
        if sparse_step <= 0 {
            return Err(cfg.error("decoder_sparse_step", format!("must be positive, got {sparse_step}")));
        }
        let dense_layers: Vec<i64> = cfg.or("mlp_only_layers", Vec::new())?;
        if let Some(l) = dense_layers.iter().find(|&&l| l < 0 || l >= c.num_layers) {
            return Err(cfg.error("mlp_only_layers", format!("layer {l} does not exist ({} layers)", c.num_layers)));
        }
        let shared: i64 = cfg.or("shared_expert_intermediate_size", 512)?;
        let (width, norm_topk_prob) = (cfg.or("moe_intermediate_size", 512)?, cfg.or("norm_topk_prob", true)?);
        c.moe = Some(MoeConfig {
            sparse_step,
            dense_layers,
            shared_expert_intermediate_size: (shared > 0).then_some(shared),
            shared_expert_gate: true,
            ..MoeConfig::qwen(num_experts, top_k, width, norm_topk_prob)
        });
        Ok(c)
    }

    fn load_layer(&self, w: &mut Weights, c: &TargetConfig, i: i64) -> Result<DecoderLayer, ModelError> {
        let Some(m) = c.moe.as_ref().filter(|m| m.is_sparse(i)) else { return dense_layer(w, c, i) };
        layer_with(w, c, i, |w, p| Ok(FeedForward::Sparse(super::sparse_moe(w, p, m, c.hidden_size, "shared_expert")?)))
    }

    fn hf_fields(&self, c: &TargetConfig) -> Value {
        let m = c.moe.as_ref().expect("a Qwen3-Next config has experts");
        let mut v = hybrid::hf_fields(c);
        if let (Value::Object(all), Value::Object(own)) = (
            &mut v,
            json!({
                "num_experts": m.num_experts,
                "num_experts_per_tok": m.top_k,
                "moe_intermediate_size": m.expert_intermediate_size,
                "shared_expert_intermediate_size": m.shared_expert_intermediate_size.unwrap_or(0),
                "norm_topk_prob": m.norm_topk_prob,
                "decoder_sparse_step": m.sparse_step,
                "mlp_only_layers": m.dense_layers,
            }),
        ) {
            all.extend(own);
        }
        v
    }
}
