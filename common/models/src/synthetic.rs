//! A small randomly initialised Llama-style target written as a Hugging
//! Face directory, with the synthetic byte-level tokenizer: the model of
//! the tests and of the CPU demo until a real model is prepared.

use std::path::Path;

use tch::{Device, Kind, Tensor};

use crate::ModelError;
use crate::target::{random_tensors, tensor_shapes};
use crate::target_config::{Family, TargetConfig};
use crate::weights::write_safetensors;

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
        // Small fixtures of the other families (reference logits from
        // Hugging Face transformers are pinned in the tests).
        "tiny-qwen3" => Some(TargetConfig {
            family: Family::Qwen3,
            hidden_size: 32,
            intermediate_size: 64,
            num_layers: 2,
            num_heads: 4,
            num_kv_heads: 2,
            head_dim: 16,
            rope_theta: 1_000_000.0,
            rms_norm_eps: 1e-6,
            tie_word_embeddings: false,
            ..synthetic_target_config(2)
        }),
        "tiny-qwen2" => Some(TargetConfig {
            family: Family::Qwen2,
            hidden_size: 32,
            intermediate_size: 64,
            num_layers: 2,
            num_heads: 4,
            num_kv_heads: 2,
            head_dim: 8,
            attention_bias: true,
            ..synthetic_target_config(2)
        }),
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
pub fn write_random_target(
    dir: &Path,
    config: &TargetConfig,
    seed: i64,
    device: Device,
    kind: Kind,
) -> Result<(), ModelError> {
    write_random_target_sharded(dir, config, seed, device, kind, 1)
}

/// Like [`write_random_target`], split into `shards` safetensors files with
/// a `model.safetensors.index.json` when `shards > 1` (as large checkpoints are).
pub fn write_random_target_sharded(
    dir: &Path,
    config: &TargetConfig,
    seed: i64,
    device: Device,
    kind: Kind,
    shards: usize,
) -> Result<(), ModelError> {
    std::fs::create_dir_all(dir).map_err(|e| ModelError::io(dir, e))?;
    tch::manual_seed(seed);
    let shapes = tensor_shapes(config, config.num_layers, true);
    let tensors = random_tensors(&shapes, device, kind);
    // Random norms and biases (ones/zeros would hide a missing scale).
    let tensors: Vec<(String, Tensor)> = tensors
        .into_iter()
        .map(|(n, t)| {
            let t = if n.ends_with("norm.weight") || n.ends_with(".bias") { &t + t.rand_like() * 0.2 - 0.1 } else { t };
            (n, t)
        })
        .collect();
    if shards <= 1 {
        write_safetensors(&dir.join("model.safetensors"), &tensors)?;
    } else {
        let per = tensors.len().div_ceil(shards);
        let mut map = serde_json::Map::new();
        for (i, part) in tensors.chunks(per).enumerate() {
            let file = format!("model-{:05}-of-{:05}.safetensors", i + 1, shards);
            write_safetensors(&dir.join(&file), part)?;
            for (n, _) in part {
                map.insert(n.clone(), serde_json::Value::from(file.clone()));
            }
        }
        let index = serde_json::json!({ "metadata": {}, "weight_map": map });
        let p = dir.join("model.safetensors.index.json");
        std::fs::write(&p, serde_json::to_string_pretty(&index).expect("json")).map_err(|e| ModelError::io(&p, e))?;
    }
    drop(tensors);
    let mut json = config.to_hf_json();
    json["torch_dtype"] = serde_json::Value::from(if kind == Kind::BFloat16 { "bfloat16" } else { "float32" });
    let cfg_path = dir.join("config.json");
    std::fs::write(&cfg_path, serde_json::to_string_pretty(&json).expect("json"))
        .map_err(|e| ModelError::io(&cfg_path, e))?;
    dflash_data::write_synthetic_tokenizer(dir)
        .map_err(|e| ModelError::Config { path: dir.join("tokenizer.json"), message: e.to_string() })
}
