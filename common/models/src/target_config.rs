//! The target's Hugging Face `config.json`, read into one internal config.

use std::path::Path;

use serde::Deserialize;

use crate::ModelError;

/// Architectures this crate can run as a target.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    /// Llama, Mistral-style: no attention bias, no QK norm.
    Llama,
    /// Qwen2: bias on q/k/v projections.
    Qwen2,
    /// Qwen3: per-head RMSNorm on q and k (QK norm), no bias.
    Qwen3,
}

#[derive(Deserialize)]
struct RawConfig {
    #[serde(default)]
    architectures: Vec<String>,
    #[serde(default)]
    model_type: Option<String>,
    hidden_size: i64,
    intermediate_size: i64,
    num_hidden_layers: i64,
    num_attention_heads: i64,
    #[serde(default)]
    num_key_value_heads: Option<i64>,
    #[serde(default)]
    head_dim: Option<i64>,
    #[serde(default = "default_eps")]
    rms_norm_eps: f64,
    #[serde(default = "default_theta")]
    rope_theta: f64,
    #[serde(default)]
    rope_scaling: Option<serde_json::Value>,
    vocab_size: i64,
    #[serde(default)]
    tie_word_embeddings: bool,
    #[serde(default)]
    attention_bias: Option<bool>,
    #[serde(default)]
    max_position_embeddings: Option<i64>,
    #[serde(default)]
    hidden_act: Option<String>,
}

fn default_eps() -> f64 {
    1e-6
}

fn default_theta() -> f64 {
    10_000.0
}

/// Shape and settings of a target model.
#[derive(Clone, Debug, PartialEq)]
pub struct TargetConfig {
    pub family: Family,
    pub hidden_size: i64,
    pub intermediate_size: i64,
    pub num_layers: i64,
    pub num_heads: i64,
    pub num_kv_heads: i64,
    pub head_dim: i64,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub vocab_size: i64,
    pub tie_word_embeddings: bool,
    pub attention_bias: bool,
    pub max_position_embeddings: i64,
}

impl TargetConfig {
    /// Reads `dir/config.json`. Unsupported architectures, activations and
    /// RoPE scalings are errors that name the file and the field.
    pub fn from_dir(dir: &Path) -> Result<Self, ModelError> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|e| ModelError::io(&path, e))?;
        let raw: RawConfig = serde_json::from_str(&text)
            .map_err(|e| ModelError::Config { path: path.clone(), message: e.to_string() })?;
        let bad = |message: String| ModelError::Config { path: path.clone(), message };
        let arch = raw.architectures.first().cloned().or(raw.model_type.clone()).unwrap_or_default();
        let family = match arch.as_str() {
            "LlamaForCausalLM" | "llama" | "MistralForCausalLM" | "mistral" => Family::Llama,
            "Qwen2ForCausalLM" | "qwen2" => Family::Qwen2,
            "Qwen3ForCausalLM" | "qwen3" => Family::Qwen3,
            other => {
                return Err(bad(format!(
                    "architecture \"{other}\" is not supported (supported: LlamaForCausalLM, \
                     MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM)"
                )));
            }
        };
        if let Some(act) = &raw.hidden_act
            && act != "silu"
        {
            return Err(bad(format!("hidden_act \"{act}\" is not supported (only silu)")));
        }
        if let Some(s) = &raw.rope_scaling
            && !s.is_null()
        {
            return Err(bad(format!("rope_scaling {s} is not supported")));
        }
        if raw.num_attention_heads <= 0 || raw.hidden_size % raw.num_attention_heads != 0 && raw.head_dim.is_none() {
            return Err(bad("num_attention_heads must divide hidden_size (or set head_dim)".into()));
        }
        let num_kv_heads = raw.num_key_value_heads.unwrap_or(raw.num_attention_heads);
        if num_kv_heads <= 0 || raw.num_attention_heads % num_kv_heads != 0 {
            return Err(bad(format!(
                "num_key_value_heads {num_kv_heads} must divide num_attention_heads {}",
                raw.num_attention_heads
            )));
        }
        Ok(Self {
            family,
            hidden_size: raw.hidden_size,
            intermediate_size: raw.intermediate_size,
            num_layers: raw.num_hidden_layers,
            num_heads: raw.num_attention_heads,
            num_kv_heads,
            head_dim: raw.head_dim.unwrap_or(raw.hidden_size / raw.num_attention_heads),
            rms_norm_eps: raw.rms_norm_eps,
            rope_theta: raw.rope_theta,
            vocab_size: raw.vocab_size,
            tie_word_embeddings: raw.tie_word_embeddings,
            attention_bias: raw.attention_bias.unwrap_or(family == Family::Qwen2),
            max_position_embeddings: raw.max_position_embeddings.unwrap_or(32_768),
        })
    }

    /// config.json for a Llama-family model of this shape (used when the
    /// project writes a model directory itself).
    pub fn to_hf_json(&self) -> serde_json::Value {
        let arch = match self.family {
            Family::Llama => ("LlamaForCausalLM", "llama"),
            Family::Qwen2 => ("Qwen2ForCausalLM", "qwen2"),
            Family::Qwen3 => ("Qwen3ForCausalLM", "qwen3"),
        };
        serde_json::json!({
            "architectures": [arch.0],
            "model_type": arch.1,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": null,
            "vocab_size": self.vocab_size,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": "silu",
            "torch_dtype": "float32",
        })
    }
}
