//! A small randomly initialised Llama-style target written as a Hugging
//! Face directory, with the synthetic byte-level tokenizer: the model of
//! the tests and of the CPU demo until a real model is prepared.

use std::path::Path;

use tch::{Device, Kind, Tensor};

use crate::target_config::{Family, TargetConfig};
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

/// Writes config.json, model.safetensors and the tokenizer files to `dir`.
pub fn write_synthetic_target(dir: &Path, config: &TargetConfig, seed: i64) -> Result<(), ModelError> {
    std::fs::create_dir_all(dir).map_err(|e| ModelError::io(dir, e))?;
    tch::manual_seed(seed);
    let c = config;
    let (h, hd) = (c.hidden_size, c.head_dim);
    let randn = |shape: &[i64]| Tensor::randn(shape, (Kind::Float, Device::Cpu)) * 0.02;
    let ones = |n: i64| Tensor::ones([n], (Kind::Float, Device::Cpu));
    let mut t: Vec<(String, Tensor)> = vec![
        ("model.embed_tokens.weight".into(), randn(&[c.vocab_size, h])),
        ("model.norm.weight".into(), ones(h)),
    ];
    for i in 0..c.num_layers {
        let p = format!("model.layers.{i}");
        t.push((format!("{p}.input_layernorm.weight"), ones(h)));
        t.push((format!("{p}.post_attention_layernorm.weight"), ones(h)));
        t.push((format!("{p}.self_attn.q_proj.weight"), randn(&[c.num_heads * hd, h])));
        t.push((format!("{p}.self_attn.k_proj.weight"), randn(&[c.num_kv_heads * hd, h])));
        t.push((format!("{p}.self_attn.v_proj.weight"), randn(&[c.num_kv_heads * hd, h])));
        t.push((format!("{p}.self_attn.o_proj.weight"), randn(&[h, c.num_heads * hd])));
        t.push((format!("{p}.mlp.gate_proj.weight"), randn(&[c.intermediate_size, h])));
        t.push((format!("{p}.mlp.up_proj.weight"), randn(&[c.intermediate_size, h])));
        t.push((format!("{p}.mlp.down_proj.weight"), randn(&[h, c.intermediate_size])));
    }
    if !c.tie_word_embeddings {
        t.push(("lm_head.weight".into(), randn(&[c.vocab_size, h])));
    }
    write_safetensors(&dir.join("model.safetensors"), &t)?;
    let cfg_path = dir.join("config.json");
    std::fs::write(&cfg_path, serde_json::to_string_pretty(&c.to_hf_json()).expect("json"))
        .map_err(|e| ModelError::io(&cfg_path, e))?;
    dflash_data::write_synthetic_tokenizer(dir).map_err(|e| ModelError::Config {
        path: dir.join("tokenizer.json"),
        message: e.to_string(),
    })
}
