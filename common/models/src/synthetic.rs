//! A small randomly initialised Llama-style target written as a Hugging
//! Face directory, with the synthetic byte-level tokenizer: the model of
//! the tests and of the CPU demo until a real model is prepared.

use std::path::Path;

use tch::{Device, Kind};

use crate::gated_deltanet::{DeltaNetShape, ProjectionLayout};
use crate::moe::{ExpertActivation, Routing};
use crate::rope::{RopeConfig, RopeScaling};
use crate::target_config::{
    Family, LatentAttentionConfig, LayerKind, LinearAttentionConfig, MoeConfig, NormStyle, TargetConfig,
};
use crate::weights::{RandomInit, write_safetensors};
use crate::weights::{SkippedPart, TensorNames};
use crate::{ModelError, TargetModel};

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
        rope: RopeConfig::plain(10_000.0),
        vocab_size: (dflash_data::SYNTHETIC_SPECIALS + 256) as i64,
        tie_word_embeddings: true,
        max_position_embeddings: 4096,
        layer_types: TargetConfig::all_attention(num_layers),
        ..TargetConfig::default()
    }
}

/// A Qwen3-style dense config (QK norm, no biases).
fn qwen3(base: TargetConfig) -> TargetConfig {
    TargetConfig { family: Family::Qwen3, qk_norm: true, ..base }
}

/// A hybrid config (Qwen3-Next / Qwen3.5 layers) of `base`'s shape: every
/// fourth layer gated full attention, the others Gated DeltaNet of `linear`.
fn hybrid(base: TargetConfig, family: Family, linear: DeltaNetShape, moe: Option<MoeConfig>) -> TargetConfig {
    let layout = if family == Family::Qwen3Next { ProjectionLayout::GroupedByKeyHead } else { ProjectionLayout::Split };
    let layer_types = (0..base.num_layers)
        .map(|i| if (i + 1) % 4 == 0 { LayerKind::FullAttention } else { LayerKind::LinearAttention })
        .collect();
    TargetConfig {
        family,
        qk_norm: true,
        attn_output_gate: true,
        norm: NormStyle::ZeroCentred,
        layer_types,
        linear_attention: Some(LinearAttentionConfig { shape: linear, layout }),
        intermediate_size: if family == Family::Qwen35Moe { 0 } else { base.intermediate_size },
        moe,
        tensor_names: TensorNames {
            language_model: None,
            skipped: vec![SkippedPart { prefix: "mtp.".into(), what: "multi-token prediction".into() }],
        },
        ..base
    }
}

/// The published Qwen3.5 / Qwen3-Next Gated DeltaNet shape with `value_heads`.
fn qwen_deltanet(value_heads: i64) -> DeltaNetShape {
    DeltaNetShape {
        num_key_heads: 16,
        num_value_heads: value_heads,
        key_head_dim: 128,
        value_head_dim: 128,
        conv_kernel: 4,
    }
}

/// A gpt-oss config of `base`'s shape: sliding-window layers first and
/// every other layer after, sinks, biases, f32-scaled norms, `experts`
/// clamped-SwiGLU experts of `width`, `top_k` per token.
fn gpt_oss(base: TargetConfig, experts: i64, top_k: i64, width: i64) -> TargetConfig {
    let layer_types = (0..base.num_layers)
        .map(|i| if i % 2 == 0 { LayerKind::SlidingAttention } else { LayerKind::FullAttention })
        .collect();
    TargetConfig {
        family: Family::GptOss,
        qkv_bias: true,
        o_bias: true,
        attention_sinks: true,
        norm: NormStyle::ScaleInF32,
        intermediate_size: 0,
        layer_types,
        moe: Some(MoeConfig {
            routing: Routing::TopKSoftmax,
            router_bias: true,
            expert_bias: true,
            activation: ExpertActivation::ClampedSwiGlu { alpha: 1.702, limit: 7.0 },
            ..MoeConfig::qwen(experts, top_k, width, false)
        }),
        ..base
    }
}

/// Model shapes for benchmarks and synthetic targets, by name.
pub fn shape_preset(name: &str) -> Option<TargetConfig> {
    let tiny = synthetic_target_config(2);
    fixture_preset(name, &tiny)
        .or_else(|| dense_preset(name, &tiny))
        .or_else(|| moe_preset(name, &tiny))
        .or_else(|| hybrid_preset(name, &tiny))
}

/// Tiny fixtures of each family on the synthetic tokenizer (the CPU runs and
/// tests; reference logits from Hugging Face transformers are pinned in the tests).
fn fixture_preset(name: &str, tiny: &TargetConfig) -> Option<TargetConfig> {
    let tiny = tiny.clone();
    match name {
        "tiny" => Some(synthetic_target_config(6)),
        // Small fixtures of the other families (reference logits from
        // Hugging Face transformers are pinned in the tests).
        "tiny-qwen3" => Some(qwen3(TargetConfig {
            hidden_size: 32,
            intermediate_size: 64,
            head_dim: 16,
            rope: RopeConfig::plain(1_000_000.0),
            rms_norm_eps: 1e-6,
            tie_word_embeddings: false,
            ..tiny
        })),
        "tiny-qwen2" => Some(TargetConfig {
            family: Family::Qwen2,
            hidden_size: 32,
            intermediate_size: 64,
            head_dim: 8,
            qkv_bias: true,
            ..tiny
        }),
        // The synthetic target as a Qwen3 MoE: 6 layers, the second dense,
        // 8 experts of which 2 per token.
        "tiny-moe" => Some(TargetConfig {
            family: Family::Qwen3Moe,
            qk_norm: true,
            num_layers: 6,
            moe: Some(MoeConfig { dense_layers: vec![1], ..MoeConfig::qwen(8, 2, 32, true) }),
            ..tiny
        }),
        // A tiny Qwen3.5 MoE (hybrid layers, shared expert) on the synthetic
        // tokenizer: the CPU runs and tests of hybrid targets.
        "tiny-hybrid" => Some(hybrid(
            TargetConfig {
                num_layers: 6,
                hidden_size: 64,
                head_dim: 16,
                rms_norm_eps: 1e-6,
                rope: RopeConfig { partial_rotary_factor: 0.5, ..RopeConfig::plain(10_000_000.0) },
                // Tied, as the small Qwen3.5 models are (and so that greedy
                // outputs repeat: a few training steps then teach a drafter).
                tie_word_embeddings: true,
                ..tiny.clone()
            },
            Family::Qwen35Moe,
            DeltaNetShape {
                num_key_heads: 2,
                num_value_heads: 4,
                key_head_dim: 16,
                value_head_dim: 16,
                conv_kernel: 4,
            },
            Some(MoeConfig {
                shared_expert_intermediate_size: Some(32),
                shared_expert_gate: true,
                ..MoeConfig::qwen(8, 2, 32, true)
            }),
        )),
        // The synthetic target as gpt-oss: sliding (window 8) and full
        // layers, sinks, 8 clamped-SwiGLU experts of which 2 per token, tied
        // (so that greedy outputs repeat and a few steps teach a drafter).
        "tiny-gpt-oss" => {
            Some(gpt_oss(TargetConfig { num_layers: 6, sliding_window: Some(8), ..tiny.clone() }, 8, 2, 32))
        }
        _ => None,
    }
}

/// Published dense shapes.
fn dense_preset(name: &str, tiny: &TargetConfig) -> Option<TargetConfig> {
    let tiny = tiny.clone();
    match name {
        "qwen3-8b" => Some(qwen3(TargetConfig {
            hidden_size: 4096,
            intermediate_size: 12288,
            num_layers: 36,
            num_heads: 32,
            num_kv_heads: 8,
            head_dim: 128,
            rms_norm_eps: 1e-6,
            rope: RopeConfig::plain(1_000_000.0),
            vocab_size: 151_936,
            tie_word_embeddings: false,
            max_position_embeddings: 40_960,
            ..tiny
        })),
        // Meta-Llama-3.1-8B(-Instruct)'s config.json.
        "llama3.1-8b" => Some(TargetConfig {
            hidden_size: 4096,
            intermediate_size: 14336,
            num_layers: 32,
            num_heads: 32,
            num_kv_heads: 8,
            head_dim: 128,
            rms_norm_eps: 1e-5,
            rope: RopeConfig {
                theta: 500_000.0,
                scaling: RopeScaling::Llama3 {
                    factor: 8.0,
                    low_freq_factor: 1.0,
                    high_freq_factor: 4.0,
                    original_max_position_embeddings: 8192.0,
                },
                partial_rotary_factor: 1.0,
            },
            vocab_size: 128_256,
            tie_word_embeddings: false,
            max_position_embeddings: 131_072,
            ..tiny
        }),
        "smollm2-135m" => Some(TargetConfig {
            hidden_size: 576,
            intermediate_size: 1536,
            num_layers: 30,
            num_heads: 9,
            num_kv_heads: 3,
            head_dim: 64,
            rms_norm_eps: 1e-5,
            rope: RopeConfig::plain(100_000.0),
            vocab_size: 49_152,
            tie_word_embeddings: true,
            max_position_embeddings: 8192,
            ..tiny
        }),
        _ => None,
    }
}

/// Published mixture-of-experts shapes.
fn moe_preset(name: &str, tiny: &TargetConfig) -> Option<TargetConfig> {
    let tiny = tiny.clone();
    match name {
        // Qwen3-30B-A3B's (and Qwen3-Coder-30B-A3B's) config.json.
        "qwen3-30b-a3b" => Some(TargetConfig {
            family: Family::Qwen3Moe,
            qk_norm: true,
            hidden_size: 2048,
            intermediate_size: 6144,
            num_layers: 48,
            num_heads: 32,
            num_kv_heads: 4,
            head_dim: 128,
            rms_norm_eps: 1e-6,
            rope: RopeConfig::plain(1_000_000.0),
            vocab_size: 151_936,
            tie_word_embeddings: false,
            max_position_embeddings: 40_960,
            moe: Some(MoeConfig::qwen(128, 8, 768, true)),
            ..tiny
        }),
        // gpt-oss-20b's config.json.
        "gpt-oss-20b" => Some(gpt_oss(
            TargetConfig {
                hidden_size: 2880,
                num_layers: 24,
                num_heads: 64,
                num_kv_heads: 8,
                head_dim: 64,
                rope: RopeConfig { scaling: RopeScaling::gpt_oss_default(), ..RopeConfig::plain(150_000.0) },
                vocab_size: 201_088,
                tie_word_embeddings: false,
                max_position_embeddings: 131_072,
                sliding_window: Some(128),
                ..tiny.clone()
            },
            32,
            4,
            2880,
        )),
        // Moonlight-16B-A3B's config.json: the DeepSeek-V3 architecture
        // (latent attention without the query bottleneck, 64 experts of
        // which 6, 2 shared, one dense layer) at a size one GPU holds in bf16.
        "moonlight-16b-a3b" => Some(TargetConfig {
            family: Family::DeepseekV3,
            hidden_size: 2048,
            intermediate_size: 11_264,
            num_layers: 27,
            layer_types: TargetConfig::all_attention(27),
            num_heads: 16,
            num_kv_heads: 16,
            head_dim: 64,
            rms_norm_eps: 1e-5,
            rope: RopeConfig::plain(50_000.0),
            vocab_size: 163_840,
            tie_word_embeddings: false,
            max_position_embeddings: 8192,
            latent_attention: Some(LatentAttentionConfig {
                q_lora_rank: None,
                kv_lora_rank: 512,
                qk_nope_head_dim: 128,
                qk_rope_head_dim: 64,
                v_head_dim: 128,
                rope_interleave: true,
                softmax_scale: 192f64.powf(-0.5),
            }),
            moe: Some(MoeConfig {
                dense_layers: vec![0],
                shared_expert_intermediate_size: Some(2 * 1408),
                routing: Routing::SigmoidGrouped {
                    n_group: 1,
                    topk_group: 1,
                    norm_topk_prob: true,
                    routed_scaling_factor: 2.446,
                },
                ..MoeConfig::qwen(64, 6, 1408, true)
            }),
            ..tiny.clone()
        }),
        _ => None,
    }
}

/// Published hybrid shapes (Gated DeltaNet and gated attention layers).
fn hybrid_preset(name: &str, tiny: &TargetConfig) -> Option<TargetConfig> {
    let tiny = tiny.clone();
    match name {
        // Qwen3.5-27B's and Qwen3.6-27B's text_config.
        "qwen3.5-27b" => Some(hybrid(
            TargetConfig {
                hidden_size: 5120,
                intermediate_size: 17408,
                num_layers: 64,
                num_heads: 24,
                num_kv_heads: 4,
                head_dim: 256,
                rms_norm_eps: 1e-6,
                rope: RopeConfig { partial_rotary_factor: 0.25, ..RopeConfig::plain(10_000_000.0) },
                vocab_size: 248_320,
                tie_word_embeddings: false,
                max_position_embeddings: 262_144,
                ..tiny.clone()
            },
            Family::Qwen35,
            qwen_deltanet(48),
            None,
        )),
        // Qwen3.5-35B-A3B's and Qwen3.6-35B-A3B's text_config.
        "qwen3.5-35b-a3b" => Some(hybrid(
            TargetConfig {
                hidden_size: 2048,
                num_layers: 40,
                num_heads: 16,
                num_kv_heads: 2,
                head_dim: 256,
                rms_norm_eps: 1e-6,
                rope: RopeConfig { partial_rotary_factor: 0.25, ..RopeConfig::plain(10_000_000.0) },
                vocab_size: 248_320,
                tie_word_embeddings: false,
                max_position_embeddings: 262_144,
                ..tiny.clone()
            },
            Family::Qwen35Moe,
            qwen_deltanet(32),
            Some(MoeConfig {
                shared_expert_intermediate_size: Some(512),
                shared_expert_gate: true,
                ..MoeConfig::qwen(256, 8, 512, true)
            }),
        )),
        // Qwen3-Next-80B-A3B's config.json.
        "qwen3-next-80b-a3b" => Some(hybrid(
            TargetConfig {
                hidden_size: 2048,
                intermediate_size: 5120,
                num_layers: 48,
                num_heads: 16,
                num_kv_heads: 2,
                head_dim: 256,
                rms_norm_eps: 1e-6,
                rope: RopeConfig { partial_rotary_factor: 0.25, ..RopeConfig::plain(10_000_000.0) },
                vocab_size: 151_936,
                tie_word_embeddings: false,
                max_position_embeddings: 262_144,
                ..tiny.clone()
            },
            Family::Qwen3Next,
            qwen_deltanet(32),
            Some(MoeConfig {
                shared_expert_intermediate_size: Some(512),
                shared_expert_gate: true,
                ..MoeConfig::qwen(512, 10, 512, true)
            }),
        )),
        _ => None,
    }
}

/// Names of [`shape_preset`]'s shapes, for messages.
pub const SHAPE_PRESETS: &[&str] = &[
    "tiny",
    "tiny-qwen3",
    "tiny-qwen2",
    "tiny-moe",
    "tiny-hybrid",
    "qwen3-8b",
    "llama3.1-8b",
    "qwen3-30b-a3b",
    "qwen3.5-27b",
    "qwen3.5-35b-a3b",
    "qwen3-next-80b-a3b",
    "tiny-gpt-oss",
    "gpt-oss-20b",
    "moonlight-16b-a3b",
    "smollm2-135m",
];

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
    // Random norms and biases (ones/zeros would hide a missing scale).
    let mut tensors = TargetModel::random_checkpoint(config, device, kind, RandomInit::Perturbed)?;
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_count_the_published_parameters() {
        // From the published checkpoints' safetensors headers.
        for (name, published) in
            [("qwen3-8b", 8_190_735_360i64), ("llama3.1-8b", 8_030_261_248), ("qwen3-30b-a3b", 30_532_122_624)]
        {
            let c = shape_preset(name).expect("preset");
            assert_eq!(c.parameter_count(), published, "{name}");
        }
    }

    #[test]
    fn presets_read_back_through_their_written_configs() {
        for name in ["tiny-hybrid", "qwen3.5-27b", "qwen3.5-35b-a3b", "qwen3-next-80b-a3b"] {
            let c = shape_preset(name).expect("preset");
            let hf =
                crate::hf_config::HfConfig::parse(std::path::Path::new("/p/config.json"), &c.to_hf_json().to_string())
                    .expect("json");
            let again = TargetConfig::from_hf(hf).expect(name);
            assert_eq!(again.layer_types, c.layer_types, "{name}");
            assert_eq!((again.linear_attention, again.moe.clone()), (c.linear_attention, c.moe.clone()), "{name}");
            assert_eq!(again.parameter_count(), c.parameter_count(), "{name}");
        }
        for name in ["tiny-gpt-oss", "gpt-oss-20b", "moonlight-16b-a3b"] {
            let c = shape_preset(name).expect("preset");
            let hf =
                crate::hf_config::HfConfig::parse(std::path::Path::new("/p/config.json"), &c.to_hf_json().to_string())
                    .expect("json");
            let again = TargetConfig::from_hf(hf).expect(name);
            assert_eq!(again, c, "{name}");
        }
        // gpt-oss-20b: 20.9B parameters, 3.6B active (its model card).
        let c = shape_preset("gpt-oss-20b").expect("preset");
        let active: f64 =
            (0..c.num_layers).map(|i| c.layer_linear_macs(i)).sum::<f64>() + (c.vocab_size * c.hidden_size) as f64;
        assert_eq!((c.parameter_count() as f64 / 1e8).round(), 209.0);
        assert_eq!((active / 1e8).round(), 36.0);
        // Qwen3.5-27B: 64 layers, 16 of them full attention.
        let c = shape_preset("qwen3.5-27b").expect("preset");
        assert_eq!(c.layer_types.iter().filter(|&&k| k == LayerKind::FullAttention).count(), 16);
    }
}
