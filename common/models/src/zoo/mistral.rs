//! Mistral (`MistralForCausalLM`): Llama's layers without biases. Its
//! sliding-window attention is not implemented, so only configs whose
//! `sliding_window` is null (Mistral 7B v0.2 and later, Mistral NeMo and
//! Small) are read; an absent field means transformers' default window of
//! 4096 and is refused too.

use serde_json::{Value, json};

use super::{Architecture, Defaults, read_common};
use crate::ModelError;
use crate::hf_config::HfConfig;
use crate::target_config::{Family, TargetConfig};

pub struct Mistral;

impl Architecture for Mistral {
    fn family(&self) -> Family {
        Family::Mistral
    }

    fn hf_architecture(&self) -> &'static str {
        "MistralForCausalLM"
    }

    fn model_type(&self) -> &'static str {
        "mistral"
    }

    fn read_config(&self, cfg: &mut HfConfig) -> Result<TargetConfig, ModelError> {
        let c = read_common(
            cfg,
            Defaults {
                family: Family::Mistral,
                head_dim: None,
                max_position_embeddings: 4096 * 32,
                rope: Default::default(),
                intermediate_size: None,
            },
        )?;
        let present = cfg.present("sliding_window");
        if let Some(window) = cfg.opt::<i64>("sliding_window")? {
            return Err(cfg.error("sliding_window", format!("sliding-window attention ({window}) is not supported")));
        }
        if !present {
            return Err(cfg.error(
                "sliding_window",
                "is absent, which transformers reads as a window of 4096; sliding-window attention is not supported \
                 (set it to null if the model attends fully)",
            ));
        }
        Ok(c)
    }

    fn hf_fields(&self, _: &TargetConfig) -> Value {
        json!({"sliding_window": null})
    }
}
