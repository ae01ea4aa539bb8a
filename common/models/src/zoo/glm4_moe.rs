//! GLM-4 MoE (`Glm4MoeForCausalLM`: GLM-4.5, GLM-4.5-Air, GLM-4.6, GLM-4.7):
//! - attention with q/k/v biases (`attention_bias`, o_proj never has one),
//!   an optional per-head QK norm (`use_qk_norm`) and partial RoPE over
//!   the first `partial_rotary_factor` (0.5 by default) of each head;
//! - the first `first_k_dense_replace` layers dense, the rest DeepSeek-V3's
//!   MoE: grouped sigmoid routing with `e_score_correction_bias`,
//!   `routed_scaling_factor` and `n_shared_experts` shared experts
//!   (`deepseek_v3.rs` reads those settings);
//! - multi-token-prediction layers stored after the decoder's
//!   (`num_nextn_predict_layers`) skipped and named.

use serde_json::{Value, json};

use super::deepseek_v3::{grouped_moe_fields, read_grouped_moe, read_next_n};
use super::{Architecture, Defaults, dense_layer, layer_with, read_common, sparse_moe};
use crate::ModelError;
use crate::decoder::{DecoderLayer, FeedForward};
use crate::hf_config::HfConfig;
use crate::rope::RopeOptions;
use crate::target_config::{Family, TargetConfig};
use crate::weights::Weights;

pub struct Glm4Moe;

impl Architecture for Glm4Moe {
    fn family(&self) -> Family {
        Family::Glm4Moe
    }

    fn hf_architecture(&self) -> &'static str {
        "Glm4MoeForCausalLM"
    }

    fn model_type(&self) -> &'static str {
        "glm4_moe"
    }

    fn read_config(&self, cfg: &mut HfConfig) -> Result<TargetConfig, ModelError> {
        let eps_given = cfg.present("rms_norm_eps");
        let mut c = read_common(
            cfg,
            Defaults {
                family: Family::Glm4Moe,
                head_dim: None,
                max_position_embeddings: 131_072,
                rope: RopeOptions { partial: Some(0.5), mrope: false, theta: None },
                intermediate_size: None,
            },
        )?;
        if !eps_given {
            c.rms_norm_eps = 1e-5;
        }
        c.qkv_bias = cfg.or("attention_bias", false)?;
        c.qk_norm = cfg.or("use_qk_norm", false)?;
        c.moe = Some(read_grouped_moe(cfg, c.num_layers)?);
        (c.mtp_layers, c.tensor_names) = read_next_n(cfg, c.num_layers)?;
        Ok(c)
    }

    fn load_layer(&self, w: &mut Weights, c: &TargetConfig, i: i64) -> Result<DecoderLayer, ModelError> {
        let Some(m) = c.moe.as_ref().filter(|m| m.is_sparse(i)) else { return dense_layer(w, c, i) };
        layer_with(w, c, i, |w, p| Ok(FeedForward::Sparse(sparse_moe(w, p, m, c.hidden_size, "shared_experts")?)))
    }

    fn hf_fields(&self, c: &TargetConfig) -> Value {
        let mut v = json!({
            "attention_bias": c.qkv_bias,
            "use_qk_norm": c.qk_norm,
            "partial_rotary_factor": c.rope.partial_rotary_factor,
            "num_nextn_predict_layers": c.mtp_layers,
        });
        if let (Value::Object(all), Value::Object(moe)) = (&mut v, grouped_moe_fields(c)) {
            all.extend(moe);
        }
        v
    }
}
