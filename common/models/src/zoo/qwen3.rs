//! Qwen3 (`Qwen3ForCausalLM`): per-head RMSNorm on q and k before RoPE (QK
//! norm), optional attention biases (q/k/v and o), `head_dim` 128 unless
//! the config says otherwise. Sliding-window attention is refused where a
//! config turns it on.

use serde_json::{Value, json};

use super::{Architecture, Defaults, read_common, refuse_qwen_sliding_window};
use crate::ModelError;
use crate::hf_config::HfConfig;
use crate::target_config::{Family, TargetConfig};

pub struct Qwen3;

impl Architecture for Qwen3 {
    fn family(&self) -> Family {
        Family::Qwen3
    }

    fn hf_architecture(&self) -> &'static str {
        "Qwen3ForCausalLM"
    }

    fn model_type(&self) -> &'static str {
        "qwen3"
    }

    fn read_config(&self, cfg: &mut HfConfig) -> Result<TargetConfig, ModelError> {
        let mut c = read_common(
            cfg,
            Defaults {
                family: Family::Qwen3,
                head_dim: Some(128),
                max_position_embeddings: 32_768,
                rope: Default::default(),
                intermediate_size: None,
            },
        )?;
        let bias = cfg.or("attention_bias", false)?;
        (c.qkv_bias, c.o_bias, c.qk_norm) = (bias, bias, true);
        refuse_qwen_sliding_window(cfg, c.num_layers)?;
        Ok(c)
    }

    fn hf_fields(&self, c: &TargetConfig) -> Value {
        json!({"attention_bias": c.qkv_bias, "use_sliding_window": false})
    }
}
