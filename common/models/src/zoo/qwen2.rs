//! Qwen2 and Qwen2.5 (`Qwen2ForCausalLM`): Llama-style layers whose q, k
//! and v projections always carry biases (transformers ignores
//! `attention_bias` here). Sliding-window attention is refused where a
//! config turns it on.

use serde_json::{Value, json};

use super::{Architecture, Defaults, read_common, refuse_qwen_sliding_window};
use crate::ModelError;
use crate::hf_config::HfConfig;
use crate::target_config::{Family, TargetConfig};

pub struct Qwen2;

impl Architecture for Qwen2 {
    fn family(&self) -> Family {
        Family::Qwen2
    }

    fn hf_architecture(&self) -> &'static str {
        "Qwen2ForCausalLM"
    }

    fn model_type(&self) -> &'static str {
        "qwen2"
    }

    fn read_config(&self, cfg: &mut HfConfig) -> Result<TargetConfig, ModelError> {
        let mut c = read_common(
            cfg,
            Defaults {
                family: Family::Qwen2,
                head_dim: None,
                max_position_embeddings: 32_768,
                rope: Default::default(),
                intermediate_size: None,
            },
        )?;
        c.qkv_bias = true;
        cfg.ignore(&["attention_bias"]);
        refuse_qwen_sliding_window(cfg, c.num_layers)?;
        Ok(c)
    }

    fn hf_fields(&self, _: &TargetConfig) -> Value {
        json!({"use_sliding_window": false})
    }
}
