//! Llama 2 and 3.x (`LlamaForCausalLM`): RMSNorm, attention with optional
//! biases (`attention_bias` covers q/k/v and o), a SwiGLU MLP with optional
//! biases (`mlp_bias`), RoPE with any supported scaling (Llama 3.1-3.3 use
//! `llama3`).

use serde_json::{Value, json};

use super::{Architecture, Defaults, read_common};
use crate::ModelError;
use crate::hf_config::HfConfig;
use crate::target_config::{Family, TargetConfig};

pub struct Llama;

impl Architecture for Llama {
    fn family(&self) -> Family {
        Family::Llama
    }

    fn hf_architecture(&self) -> &'static str {
        "LlamaForCausalLM"
    }

    fn model_type(&self) -> &'static str {
        "llama"
    }

    fn read_config(&self, cfg: &mut HfConfig) -> Result<TargetConfig, ModelError> {
        let mut c = read_common(
            cfg,
            Defaults {
                family: Family::Llama,
                head_dim: None,
                max_position_embeddings: 2048,
                rope: Default::default(),
                intermediate_size: None,
            },
        )?;
        let bias = cfg.or("attention_bias", false)?;
        (c.qkv_bias, c.o_bias) = (bias, bias);
        c.mlp_bias = cfg.or("mlp_bias", false)?;
        // Splits each projection into slices whose results are summed: the
        // same math.
        cfg.ignore(&["pretraining_tp"]);
        Ok(c)
    }

    fn hf_fields(&self, c: &TargetConfig) -> Value {
        json!({"attention_bias": c.qkv_bias, "mlp_bias": c.mlp_bias})
    }
}
