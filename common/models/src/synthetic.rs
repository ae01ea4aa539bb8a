//! A small randomly initialised Llama-style target written as a Hugging
//! Face directory, with the synthetic byte-level tokenizer: the model of
//! the tests and of the CPU demo until a real model is prepared.

use std::path::Path;

use tch::{Device, Kind};

use crate::target_config::{Family, TargetConfig};
use crate::target::{random_tensors, tensor_shapes};
use crate::weights::write_safetensors;
use crate::ModelError;

/// The shape of the synthetic target (vocabulary of the synthetic tokenizer).
pub fn synthetic_target_config(num_layers: i64) -> TargetConfig {
    TargetConfig {
        family: Family::Llama,
        hidden_size: 64,
        intermediate_size: 128,
        num_layers,
        num_heads: 4,
        num_kv_heads: 2,
        head_dim: 16,
        rms_norm_eps: 1e-5,
        rope_theta: 10_000.0,
        vocab_size: (dflash_data::SYNTHETIC_SPECIALS + 256) as i64,
        tie_word_embeddings: true,
        attention_bias: false,
        max_position_embeddings: 4096,
    }
}

/// Model shapes for benchmarks and synthetic targets, by name.
pub fn shape_preset(name: &str) -> Option<TargetConfig> {
    match name {
        "tiny" => Some(synthetic_target_config(6)),
        "qwen3-8b" => Some(TargetConfig {
            family: Family::Qwen3,
            hidden_size: 4096,
            intermediate_size: 12288,
            num_layers: 36,
            num_heads: 32,
            num_kv_heads: 8,
            head_dim: 128,
            rms_norm_eps: 1e-6,
            rope_theta: 1_000_000.0,
            vocab_size: 151_936,
            tie_word_embeddings: false,
            attention_bias: false,
            max_position_embeddings: 40_960,
        }),
        "smollm2-135m" => Some(TargetConfig {
            family: Family::Llama,
            hidden_size: 576,
            intermediate_size: 1536,
            num_layers: 30,
            num_heads: 9,
            num_kv_heads: 3,
            head_dim: 64,
            rms_norm_eps: 1e-5,
            rope_theta: 100_000.0,
            vocab_size: 49_152,
            tie_word_embeddings: true,
            attention_bias: false,
            max_position_embeddings: 8192,
        }),
        _ => None,
    }
}

/// Writes config.json, model.safetensors (random weights in `kind`,
/// generated on `device`) and the synthetic tokenizer files to `dir`.
pub fn write_synthetic_target(dir: &Path, config: &TargetConfig, seed: i64) -> Result<(), ModelError> {
    write_random_target(dir, config, seed, Device::Cpu, Kind::Float)
}

/// Like [`write_synthetic_target`] with a chosen device and dtype (large
/// shapes generate faster on a GPU and are stored in bf16).
pub fn write_random_target(dir: &Path, config: &TargetConfig, seed: i64, device: Device, kind: Kind) -> Result<(), ModelError> {
    std::fs::create_dir_all(dir).map_err(|e| ModelError::io(dir, e))?;
    tch::manual_seed(seed);
    let tensors = random_tensors(&tensor_shapes(config, config.num_layers, true), device, kind);
    write_safetensors(&dir.join("model.safetensors"), &tensors)?;
    drop(tensors);
    let mut json = config.to_hf_json();
    json["torch_dtype"] = serde_json::Value::from(if kind == Kind::BFloat16 { "bfloat16" } else { "float32" });
    let cfg_path = dir.join("config.json");
    std::fs::write(&cfg_path, serde_json::to_string_pretty(&json).expect("json"))
        .map_err(|e| ModelError::io(&cfg_path, e))?;
    dflash_data::write_synthetic_tokenizer(dir).map_err(|e| ModelError::Config {
        path: dir.join("tokenizer.json"),
        message: e.to_string(),
    })
}
