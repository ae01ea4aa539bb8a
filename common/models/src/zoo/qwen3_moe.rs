//! Qwen3 MoE (`Qwen3MoeForCausalLM`: Qwen3-30B-A3B, Qwen3-235B-A22B,
//! Qwen3-Coder-30B-A3B): Qwen3 attention, and in every
//! `decoder_sparse_step`-th layer not listed in `mlp_only_layers` a sparse
//! block of `num_experts` SwiGLU experts of width `moe_intermediate_size`,
//! `num_experts_per_tok` per token chosen by a softmax router
//! (`norm_topk_prob` renormalises their weights). Checkpoints store one
//! tensor per expert (`mlp.experts.E.{gate,up,down}_proj.weight`) and the
//! router as `mlp.gate.weight`; the fused layout transformers 5 keeps in
//! memory (`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`) reads too.

use serde_json::{Value, json};

use super::{Architecture, Defaults, dense_layer, layer_with, read_common, sparse_moe};
use crate::ModelError;
use crate::decoder::{DecoderLayer, FeedForward};
use crate::hf_config::HfConfig;
use crate::target_config::{Family, MoeConfig, TargetConfig};
use crate::weights::Weights;

pub struct Qwen3Moe;

impl Architecture for Qwen3Moe {
    fn family(&self) -> Family {
        Family::Qwen3Moe
    }

    fn hf_architecture(&self) -> &'static str {
        "Qwen3MoeForCausalLM"
    }

    fn model_type(&self) -> &'static str {
        "qwen3_moe"
    }

    fn read_config(&self, cfg: &mut HfConfig) -> Result<TargetConfig, ModelError> {
        let mut c = read_common(
            cfg,
            Defaults {
                family: Family::Qwen3Moe,
                head_dim: None,
                max_position_embeddings: 32_768,
                rope: Default::default(),
                intermediate_size: None,
            },
        )?;
        let bias = cfg.or("attention_bias", false)?;
        (c.qkv_bias, c.o_bias, c.qk_norm) = (bias, bias, true);
        // Qwen3 MoE slides every layer when the window is on; the published
        // configs carry max_window_layers, which the model does not use.
        let use_window: bool = cfg.or("use_sliding_window", false)?;
        let window: Option<i64> = cfg.opt("sliding_window")?;
        if let (true, Some(w)) = (use_window, window) {
            return Err(cfg.error("use_sliding_window", format!("sliding-window attention ({w}) is not supported")));
        }
        cfg.ignore(&["max_window_layers", "output_router_logits", "router_aux_loss_coef"]);
        // transformers 5 writes num_local_experts, 4.x num_experts.
        let num_experts = match cfg.opt::<i64>("num_experts")? {
            Some(n) => n,
            None => cfg.positive("num_local_experts")?,
        };
        let top_k = cfg.positive("num_experts_per_tok")?;
        if top_k > num_experts {
            return Err(cfg.error("num_experts_per_tok", format!("{top_k} exceeds num_experts {num_experts}")));
        }
        let sparse_step: i64 = cfg.or("decoder_sparse_step", 1)?;
        if sparse_step <= 0 {
            return Err(cfg.error("decoder_sparse_step", format!("must be positive, got {sparse_step}")));
        }
        let dense_layers: Vec<i64> = cfg.or("mlp_only_layers", Vec::new())?;
        if let Some(l) = dense_layers.iter().find(|&&l| l < 0 || l >= c.num_layers) {
            return Err(cfg.error("mlp_only_layers", format!("layer {l} does not exist ({} layers)", c.num_layers)));
        }
        let norm_topk_prob = cfg.or("norm_topk_prob", false)?;
        let width = cfg.positive("moe_intermediate_size")?;
        c.moe =
            Some(MoeConfig { sparse_step, dense_layers, ..MoeConfig::qwen(num_experts, top_k, width, norm_topk_prob) });
        Ok(c)
    }

    fn load_layer(&self, w: &mut Weights, c: &TargetConfig, i: i64) -> Result<DecoderLayer, ModelError> {
        let Some(m) = c.moe.as_ref().filter(|m| m.is_sparse(i)) else { return dense_layer(w, c, i) };
        layer_with(w, c, i, |w, p| Ok(FeedForward::Sparse(sparse_moe(w, p, m, c.hidden_size, "shared_expert")?)))
    }

    fn hf_fields(&self, c: &TargetConfig) -> Value {
        let m = c.moe.as_ref().expect("a Qwen3 MoE config has experts");
        json!({
            "attention_bias": c.qkv_bias,
            "use_sliding_window": false,
            "num_experts": m.num_experts,
            "num_experts_per_tok": m.top_k,
            "moe_intermediate_size": m.expert_intermediate_size,
            "norm_topk_prob": m.norm_topk_prob,
            "decoder_sparse_step": m.sparse_step,
            "mlp_only_layers": m.dense_layers,
        })
    }
}
