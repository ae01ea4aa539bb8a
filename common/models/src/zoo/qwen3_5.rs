//! Qwen3.5 / Qwen3.6 dense (`Qwen3_5ForCausalLM`, and as published
//! `Qwen3_5ForConditionalGeneration`: Qwen3.5-27B, Qwen3.6-27B, the small
//! Qwen3.5 models): the hybrid layers of `hybrid.rs` with separate input
//! projections (`in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`) and
//! a dense SwiGLU MLP in every layer. The text RoPE carries multimodal
//! sections, which for text are plain RoPE.

use serde_json::Value;

use super::Architecture;
use super::hybrid::{self, HybridFamily};
use crate::ModelError;
use crate::gated_deltanet::ProjectionLayout;
use crate::hf_config::HfConfig;
use crate::target_config::{Family, TargetConfig};

pub struct Qwen35;

impl Architecture for Qwen35 {
    fn family(&self) -> Family {
        Family::Qwen35
    }

    fn hf_architecture(&self) -> &'static str {
        "Qwen3_5ForCausalLM"
    }

    fn model_type(&self) -> &'static str {
        "qwen3_5_text"
    }

    fn aliases(&self) -> &'static [&'static str] {
        &["Qwen3_5ForConditionalGeneration", "qwen3_5"]
    }

    fn read_config(&self, cfg: &mut HfConfig) -> Result<TargetConfig, ModelError> {
        let family = HybridFamily {
            family: Family::Qwen35,
            layout: ProjectionLayout::Split,
            mrope: true,
            vision: true,
            intermediate_size: None,
        };
        hybrid::read_either_layout(cfg, |text| hybrid::read_text(text, &family))
    }

    fn hf_fields(&self, c: &TargetConfig) -> Value {
        hybrid::hf_fields(c)
    }
}
