//! What the hybrid Qwen families share (Qwen3-Next, Qwen3.5 / 3.6 dense
//! and MoE), as transformers' `Qwen3NextConfig` reads it:
//! - `layer_types` (or, without it, every `full_attention_interval`-th
//!   layer full attention, the others linear), legacy names included;
//! - Gated DeltaNet layers of `linear_num_{key,value}_heads` heads of
//!   `linear_{key,value}_head_dim`, convolution `linear_conv_kernel_dim`;
//! - gated attention (`attn_output_gate`) with QK norm, `head_dim` 256 and
//!   partial RoPE (`partial_rotary_factor`, 0.25 unless the config says
//!   otherwise);
//! - zero-centred RMSNorms (`x_hat * (1 + w)`);
//! - multi-token-prediction layers (`mtp.*`), never loaded.
//!
//! Also the multimodal layout Qwen3.5 / 3.6 are published in
//! (`*ForConditionalGeneration`): the language model's config nested as
//! `text_config` and its tensors under `model.language_model.`, beside a
//! vision tower (`model.visual.*`) that is never read.

use super::{Defaults, read_common};
use crate::ModelError;
use crate::gated_deltanet::{DeltaNetShape, ProjectionLayout};
use crate::hf_config::HfConfig;
use crate::rope::RopeOptions;
use crate::target_config::{Family, LayerKind, LinearAttentionConfig, NormStyle, TargetConfig};
use crate::weights::{SkippedPart, TensorNames};

/// The multimodal checkpoint's prefix of the language model's tensors.
const LANGUAGE_MODEL: &str = "model.language_model.";

/// What differs between the hybrid families in the shared fields.
pub(crate) struct HybridFamily {
    pub family: Family,
    pub layout: ProjectionLayout,
    /// Multimodal RoPE sections in the config (Qwen3.5's text RoPE).
    pub mrope: bool,
    /// Whether the checkpoint can hold a vision tower (`model.visual.*`).
    pub vision: bool,
    /// `intermediate_size` when absent (families without dense MLPs).
    pub intermediate_size: Option<i64>,
}

/// Reads a hybrid text config (the whole file, or a multimodal file's
/// `text_config`).
pub(crate) fn read_text(cfg: &mut HfConfig, f: &HybridFamily) -> Result<TargetConfig, ModelError> {
    let mut c = read_common(
        cfg,
        Defaults {
            family: f.family,
            head_dim: Some(256),
            max_position_embeddings: 32_768,
            rope: RopeOptions { partial: Some(0.25), mrope: f.mrope, theta: None },
            intermediate_size: f.intermediate_size,
        },
    )?;
    let bias = cfg.or("attention_bias", false)?;
    (c.qkv_bias, c.o_bias, c.qk_norm, c.attn_output_gate) = (bias, bias, true, true);
    c.norm = NormStyle::ZeroCentred;
    // transformers' hybrid attention always gates its output and its
    // gated norm always uses SiLU; other values describe another model.
    if cfg.opt::<bool>("attn_output_gate")? == Some(false) {
        return Err(cfg.error("attn_output_gate", "false: attention without the output gate is not implemented"));
    }
    if let Some(t) = cfg.opt::<String>("output_gate_type")?
        && t != "swish"
        && t != "silu"
    {
        return Err(cfg.error("output_gate_type", format!("\"{t}\" is not supported (only swish)")));
    }
    if let Some(t) = cfg.opt::<String>("mamba_ssm_dtype")?
        && t != "float32"
    {
        return Err(cfg.error("mamba_ssm_dtype", format!("\"{t}\": the recurrent state is kept in float32 only")));
    }
    let shape = DeltaNetShape {
        num_key_heads: cfg.or("linear_num_key_heads", 16)?,
        num_value_heads: cfg.or("linear_num_value_heads", 32)?,
        key_head_dim: cfg.or("linear_key_head_dim", 128)?,
        value_head_dim: cfg.or("linear_value_head_dim", 128)?,
        conv_kernel: cfg.or("linear_conv_kernel_dim", 4)?,
    };
    for (field, v) in [
        ("linear_num_key_heads", shape.num_key_heads),
        ("linear_num_value_heads", shape.num_value_heads),
        ("linear_key_head_dim", shape.key_head_dim),
        ("linear_value_head_dim", shape.value_head_dim),
        ("linear_conv_kernel_dim", shape.conv_kernel),
    ] {
        if v <= 0 {
            return Err(cfg.error(field, format!("must be positive, got {v}")));
        }
    }
    if shape.num_value_heads % shape.num_key_heads != 0 {
        return Err(cfg.error(
            "linear_num_value_heads",
            format!("{} must be a multiple of linear_num_key_heads {}", shape.num_value_heads, shape.num_key_heads),
        ));
    }
    c.layer_types = layer_types(cfg, c.num_layers)?;
    c.linear_attention = Some(LinearAttentionConfig { shape, layout: f.layout });
    c.mtp_layers = cfg.or("mtp_num_hidden_layers", 0)?;
    // Settings of the multi-token-prediction layers, which are not loaded.
    cfg.ignore(&["mtp_use_dedicated_embeddings"]);
    let mut skipped = vec![SkippedPart {
        prefix: "mtp.".into(),
        what: match c.mtp_layers {
            0 => "multi-token prediction".to_string(),
            1 => "multi-token prediction (1 layer)".to_string(),
            n => format!("multi-token prediction ({n} layers)"),
        },
    }];
    if f.vision {
        skipped.push(SkippedPart { prefix: "model.visual.".into(), what: "vision tower".into() });
    }
    c.tensor_names = TensorNames { language_model: None, skipped };
    Ok(c)
}

/// `layer_types`, or the pattern `full_attention_interval` implies.
fn layer_types(cfg: &mut HfConfig, n: i64) -> Result<Vec<LayerKind>, ModelError> {
    let interval: i64 = cfg.or("full_attention_interval", 4)?;
    if interval <= 0 {
        return Err(cfg.error("full_attention_interval", format!("must be positive, got {interval}")));
    }
    let Some(types) = cfg.opt::<Vec<String>>("layer_types")? else {
        return Ok((0..n)
            .map(|i| if (i + 1) % interval == 0 { LayerKind::FullAttention } else { LayerKind::LinearAttention })
            .collect());
    };
    if types.len() as i64 != n {
        return Err(cfg.error("layer_types", format!("has {} entries for {n} layers", types.len())));
    }
    types
        .iter()
        .enumerate()
        .map(|(i, t)| match t.as_str() {
            // "attention" and "mamba" are the legacy names transformers remaps.
            "full_attention" | "attention" => Ok(LayerKind::FullAttention),
            "linear_attention" | "mamba" => Ok(LayerKind::LinearAttention),
            other => Err(cfg.error(
                "layer_types",
                format!(
                    "layer {i} is \"{other}\": only full_attention and linear_attention (Gated DeltaNet) are supported"
                ),
            )),
        })
        .collect()
}

/// Reads a config that is either text-only or multimodal (`text_config`
/// nested): `read` reads the text fields. The multimodal file's own
/// fields are read here.
pub(crate) fn read_either_layout(
    cfg: &mut HfConfig,
    read: impl FnOnce(&mut HfConfig) -> Result<TargetConfig, ModelError>,
) -> Result<TargetConfig, ModelError> {
    let Some(mut text) = cfg.nested("text_config")? else { return read(cfg) };
    let mut c = read(&mut text)?;
    // transformers ties the multimodal model's embeddings by the outer
    // field; the nested one is not consulted.
    text.ignore(&["tie_word_embeddings"]);
    text.finish()?;
    c.tie_word_embeddings = cfg.or("tie_word_embeddings", false)?;
    if cfg.opt::<serde_json::Value>("vision_config")?.is_none() {
        return Err(cfg.error("vision_config", "is missing: a multimodal checkpoint describes its vision tower"));
    }
    if c.quant.is_none() {
        c.quant = crate::quant::Quantization::read(cfg)?;
    }
    // Token ids of images and video: the text-only input never holds them.
    cfg.ignore(&[
        "image_token_id",
        "video_token_id",
        "vision_start_token_id",
        "vision_end_token_id",
        "language_model_only",
    ]);
    c.tensor_names.language_model = Some(LANGUAGE_MODEL.into());
    Ok(c)
}

/// The config fields hybrid families write (4.x style, text-only layout).
pub(crate) fn hf_fields(c: &TargetConfig) -> serde_json::Value {
    let l = c.linear_attention.expect("a hybrid config has linear attention");
    serde_json::json!({
        "attention_bias": c.qkv_bias,
        "layer_types": c.layer_types.iter().map(|k| k.hf_name()).collect::<Vec<_>>(),
        "linear_num_key_heads": l.shape.num_key_heads,
        "linear_num_value_heads": l.shape.num_value_heads,
        "linear_key_head_dim": l.shape.key_head_dim,
        "linear_value_head_dim": l.shape.value_head_dim,
        "linear_conv_kernel_dim": l.shape.conv_kernel,
        "partial_rotary_factor": c.rope.partial_rotary_factor,
    })
}
