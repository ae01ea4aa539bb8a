//! The target model zoo: one file per architecture, each saying how its
//! `config.json` reads (what it implements, what it refuses) and how one
//! decoder layer loads by its Hugging Face tensor names. The layers
//! themselves (attention, MLP, MoE block, norms, RoPE) are shared
//! (`layers.rs`, `moe.rs`, `rope.rs`, `decoder.rs`), and so is the stack
//! that runs them ([`crate::TargetModel`]). The zoo owns the family
//! registry ([`ARCHITECTURES`]) and reads a `config.json` into the plain
//! [`TargetConfig`] (`TargetConfig::from_dir`) and writes it back
//! (`to_hf_json`); the config imports nothing of the zoo. A new family is one
//! file here, one line in [`ARCHITECTURES`] and a fixture made by
//! `tests/fixtures/make_fixtures.py`.

mod deepseek_v3;
mod glm4_moe;
mod gpt_oss;
mod hybrid;
mod llama;
mod mistral;
mod qwen2;
mod qwen3;
mod qwen3_5;
mod qwen3_5_moe;
mod qwen3_moe;
mod qwen3_next;

use std::path::Path;

use serde_json::{Value, json};

use crate::ModelError;
use crate::attention::AttentionKernel;
use crate::decoder::{DecoderLayer, FeedForward, Mixer};
use crate::hf_config::HfConfig;
use crate::layers::{Attention, Linear, Mlp, RmsNorm};
use crate::moe::{Experts, Router, Routing, SharedExpert, SparseMoe};
use crate::quant::Quantization;
use crate::rope::{RopeConfig, RopeOptions};
use crate::target_config::{Family, LayerKind, MoeConfig, NormStyle, TargetConfig};
use crate::weights::Weights;

/// One target architecture.
pub trait Architecture: Sync {
    fn family(&self) -> Family;
    /// The `architectures` entry this family answers to (and writes).
    fn hf_architecture(&self) -> &'static str;
    /// Its `model_type` (accepted when `architectures` is absent).
    fn model_type(&self) -> &'static str;
    /// Other `architectures` names read as this family.
    fn aliases(&self) -> &'static [&'static str] {
        &[]
    }
    /// Reads every field the family uses (after which nothing but harmless
    /// fields may be left in `cfg`).
    fn read_config(&self, cfg: &mut HfConfig) -> Result<TargetConfig, ModelError>;
    /// Loads decoder layer `i` (`model.layers.{i}.*`).
    fn load_layer(&self, w: &mut Weights, c: &TargetConfig, i: i64) -> Result<DecoderLayer, ModelError> {
        dense_layer(w, c, i)
    }
    /// The family's own fields of a config.json the project writes.
    fn hf_fields(&self, c: &TargetConfig) -> Value;

    /// A config.json for `c` in the 4.x layout, which every transformers
    /// version and this crate read.
    fn to_hf_json(&self, c: &TargetConfig) -> Value {
        base_hf_json(self, c)
    }
}

/// The config.json fields every family writes, and the family's own.
pub(crate) fn base_hf_json<A: Architecture + ?Sized>(arch: &A, c: &TargetConfig) -> Value {
    let (theta, scaling) = c.rope.to_hf_fields();
    let mut v = json!({
        "architectures": [arch.hf_architecture()],
        "model_type": arch.model_type(),
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": theta,
        "rope_scaling": scaling,
        "vocab_size": c.vocab_size,
        "tie_word_embeddings": c.tie_word_embeddings,
        "max_position_embeddings": c.max_position_embeddings,
        "hidden_act": "silu",
        "torch_dtype": "float32",
    });
    if c.rope.partial_rotary_factor != 1.0 {
        v["partial_rotary_factor"] = json!(c.rope.partial_rotary_factor);
    }
    if let (Value::Object(all), Value::Object(own)) = (&mut v, arch.hf_fields(c)) {
        all.extend(own);
    }
    match &c.quant {
        Some(Quantization::Fp8(q)) => {
            v["quantization_config"] = json!({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": q.block});
        }
        Some(Quantization::Mxfp4) => v["quantization_config"] = json!({"quant_method": "mxfp4"}),
        None => {}
    }
    v
}

/// Every architecture this crate runs.
pub static ARCHITECTURES: &[&dyn Architecture] = &[
    &llama::Llama,
    &mistral::Mistral,
    &qwen2::Qwen2,
    &qwen3::Qwen3,
    &qwen3_moe::Qwen3Moe,
    &qwen3_next::Qwen3Next,
    &qwen3_5::Qwen35,
    &qwen3_5_moe::Qwen35Moe,
    &gpt_oss::GptOss,
    &deepseek_v3::DeepseekV3,
    &glm4_moe::Glm4Moe,
];

/// The architecture a config's `architectures[0]` (or `model_type`) names.
pub fn resolve(name: &str) -> Option<&'static dyn Architecture> {
    ARCHITECTURES
        .iter()
        .copied()
        .find(|a| a.hf_architecture() == name || a.model_type() == name || a.aliases().contains(&name))
}

/// The architecture of a family.
pub fn architecture(family: Family) -> &'static dyn Architecture {
    *ARCHITECTURES.iter().find(|a| a.family() == family).expect("every family has a file in zoo/")
}

/// The `architectures` names accepted, for messages.
pub fn supported_names() -> Vec<&'static str> {
    ARCHITECTURES.iter().flat_map(|a| std::iter::once(a.hf_architecture()).chain(a.aliases().iter().copied())).collect()
}

impl TargetConfig {
    /// Reads `dir/config.json`. Unsupported architectures and settings, and
    /// fields this code does not read, are errors that name the file and
    /// the field.
    pub fn from_dir(dir: &Path) -> Result<Self, ModelError> {
        Self::from_hf(HfConfig::from_dir(dir)?)
    }

    /// Reads a parsed config.json with the family's file it names.
    pub fn from_hf(mut cfg: HfConfig) -> Result<Self, ModelError> {
        let arch = resolve(&cfg.architecture).ok_or_else(|| ModelError::Config {
            path: cfg.path().to_path_buf(),
            message: format!(
                "architecture \"{}\" is not supported (supported: {})",
                cfg.architecture,
                supported_names().join(", ")
            ),
        })?;
        let c = arch.read_config(&mut cfg)?;
        cfg.finish()?;
        Ok(c)
    }

    /// config.json for a model of this shape (when the project writes a
    /// model directory itself), in the layout transformers 4.x writes.
    pub fn to_hf_json(&self) -> Value {
        architecture(self.family).to_hf_json(self)
    }
}

/// What differs between families in the fields every one of them has.
pub(crate) struct Defaults {
    pub family: Family,
    /// `head_dim` when the config has none (None: hidden / heads).
    pub head_dim: Option<i64>,
    pub max_position_embeddings: i64,
    /// What the family's RoPE may carry.
    pub rope: RopeOptions,
    /// `intermediate_size` when the config has none (None: required);
    /// families whose every MLP is sparse have no dense width.
    pub intermediate_size: Option<i64>,
}

/// Reads the fields all families share (transformers' defaults where a
/// field is absent) and checks the shape adds up.
pub(crate) fn read_common(cfg: &mut HfConfig, d: Defaults) -> Result<TargetConfig, ModelError> {
    let hidden_size = cfg.positive("hidden_size")?;
    let num_heads = cfg.positive("num_attention_heads")?;
    let num_kv_heads = cfg.or("num_key_value_heads", num_heads)?;
    if num_kv_heads <= 0 || num_heads % num_kv_heads != 0 {
        return Err(
            cfg.error("num_key_value_heads", format!("{num_kv_heads} must divide num_attention_heads {num_heads}"))
        );
    }
    let head_dim = match cfg.opt::<i64>("head_dim")?.or(d.head_dim) {
        Some(h) => h,
        None if hidden_size % num_heads == 0 => hidden_size / num_heads,
        None => return Err(cfg.error("num_attention_heads", "must divide hidden_size (or set head_dim)")),
    };
    if head_dim <= 0 || head_dim % 2 != 0 {
        return Err(cfg.error("head_dim", format!("{head_dim} must be positive and even for RoPE")));
    }
    let act: String = cfg.or("hidden_act", "silu".to_string())?;
    if act != "silu" {
        return Err(cfg.error("hidden_act", format!("\"{act}\" is not supported (only silu)")));
    }
    let max_position_embeddings = cfg.or("max_position_embeddings", d.max_position_embeddings)?;
    let rope = RopeConfig::read(cfg, max_position_embeddings, d.rope)?;
    let rotary = rope.rotary_dim(head_dim);
    if rotary == 0 {
        return Err(cfg.error("partial_rotary_factor", format!("leaves none of head_dim {head_dim} to rotate")));
    }
    let num_layers = cfg.positive("num_hidden_layers")?;
    Ok(TargetConfig {
        family: d.family,
        hidden_size,
        intermediate_size: match d.intermediate_size {
            Some(default) if !cfg.has("intermediate_size") => default,
            _ => cfg.positive("intermediate_size")?,
        },
        num_layers,
        num_heads,
        num_kv_heads,
        head_dim,
        rms_norm_eps: cfg.or("rms_norm_eps", 1e-6)?,
        rope,
        vocab_size: cfg.positive("vocab_size")?,
        tie_word_embeddings: cfg.or("tie_word_embeddings", false)?,
        qkv_bias: false,
        o_bias: false,
        mlp_bias: false,
        qk_norm: false,
        max_position_embeddings,
        moe: None,
        quant: Quantization::read(cfg)?,
        layer_types: TargetConfig::all_attention(num_layers),
        ..TargetConfig::default()
    })
}

/// Refuses sliding-window attention in the Qwen2/Qwen3 style: either
/// `layer_types` naming `sliding_attention`, or `use_sliding_window` with
/// a window applying from `max_window_layers` on.
pub(crate) fn refuse_qwen_sliding_window(cfg: &mut HfConfig, num_layers: i64) -> Result<(), ModelError> {
    let use_window: bool = cfg.or("use_sliding_window", false)?;
    let window: Option<i64> = cfg.opt("sliding_window")?;
    let from_layer: i64 = cfg.or("max_window_layers", 28)?;
    if let Some(types) = cfg.opt::<Vec<String>>("layer_types")? {
        if types.len() as i64 != num_layers {
            return Err(cfg.error("layer_types", format!("has {} entries for {num_layers} layers", types.len())));
        }
        if let Some((i, t)) = types.iter().enumerate().find(|(_, t)| t.as_str() != "full_attention") {
            return Err(cfg.error(
                "layer_types",
                format!("layer {i} is \"{t}\": only full attention is supported (sliding-window attention is not)"),
            ));
        }
        return Ok(());
    }
    if use_window && window.is_some() && from_layer < num_layers {
        return Err(cfg.error(
            "use_sliding_window",
            format!(
                "sliding-window attention (window {}, from layer {from_layer}) is not supported",
                window.unwrap_or_default()
            ),
        ));
    }
    Ok(())
}

pub(crate) fn linear(w: &mut Weights, name: &str, out: i64, inp: i64, bias: bool) -> Result<Linear, ModelError> {
    let weight = w.take(&format!("{name}.weight"), &[out, inp])?;
    let bias = if bias { Some(w.take(&format!("{name}.bias"), &[out])?) } else { None };
    Ok(Linear { weight, bias })
}

pub(crate) fn plain_norm(w: &mut Weights, name: &str, dim: i64, eps: f64) -> Result<RmsNorm, ModelError> {
    Ok(RmsNorm { weight: w.take(&format!("{name}.weight"), &[dim])?, eps })
}

/// `{name}.weight` as the family stores norm scales: plain, or zero-centred
/// (`1 + w`, kept in f32 so the norm scales in f32 as transformers does).
pub(crate) fn norm(w: &mut Weights, c: &TargetConfig, name: &str, dim: i64) -> Result<RmsNorm, ModelError> {
    let mut n = plain_norm(w, name, dim, c.rms_norm_eps)?;
    n.weight = match c.norm {
        NormStyle::Plain => n.weight,
        NormStyle::ScaleInF32 => w.transform(n.weight, |t| t.to_kind(tch::Kind::Float)),
        NormStyle::ZeroCentred => w.transform(n.weight, |t| t.to_kind(tch::Kind::Float) + 1.0),
    };
    Ok(n)
}

/// Layer `i`'s `{p}.self_attn.*` with the biases, QK norms, window and
/// sinks `c` names.
pub(crate) fn attention(w: &mut Weights, p: &str, c: &TargetConfig, i: i64) -> Result<Attention, ModelError> {
    let (h, hd) = (c.hidden_size, c.head_dim);
    let a = format!("{p}.self_attn");
    let sinks = if c.attention_sinks {
        let s = w.take(&format!("{a}.sinks"), &[c.num_heads])?;
        Some(w.transform(s, |s| s.to_kind(tch::Kind::Float)))
    } else {
        None
    };
    let window = if c.layer_kind(i) == LayerKind::SlidingAttention { c.sliding_window } else { None };
    let kernel = AttentionKernel { window, sinks, ..AttentionKernel::causal(hd) };
    let qk_norm = |w: &mut Weights, which: &str| -> Result<Option<RmsNorm>, ModelError> {
        if c.qk_norm { norm(w, c, &format!("{a}.{which}"), hd).map(Some) } else { Ok(None) }
    };
    Ok(Attention {
        q_proj: linear(w, &format!("{a}.q_proj"), c.q_proj_rows(), h, c.qkv_bias)?,
        k_proj: linear(w, &format!("{a}.k_proj"), c.num_kv_heads * hd, h, c.qkv_bias)?,
        v_proj: linear(w, &format!("{a}.v_proj"), c.num_kv_heads * hd, h, c.qkv_bias)?,
        o_proj: linear(w, &format!("{a}.o_proj"), h, c.num_heads * hd, c.o_bias)?,
        q_norm: qk_norm(w, "q_norm")?,
        k_norm: qk_norm(w, "k_norm")?,
        num_heads: c.num_heads,
        num_kv_heads: c.num_kv_heads,
        head_dim: hd,
        output_gate: c.attn_output_gate,
        kernel,
    })
}

/// A SwiGLU MLP `{name}.{gate,up,down}_proj` of width `inter`.
pub(crate) fn mlp(w: &mut Weights, name: &str, h: i64, inter: i64, bias: bool) -> Result<Mlp, ModelError> {
    Ok(Mlp {
        gate_proj: linear(w, &format!("{name}.gate_proj"), inter, h, bias)?,
        up_proj: linear(w, &format!("{name}.up_proj"), inter, h, bias)?,
        down_proj: linear(w, &format!("{name}.down_proj"), h, inter, bias)?,
    })
}

/// A decoder layer around a given feed-forward block; its mixer is
/// attention, or Gated DeltaNet where `c.layer_types` says so.
pub(crate) fn layer_with(
    w: &mut Weights,
    c: &TargetConfig,
    i: i64,
    mlp: impl FnOnce(&mut Weights, &str) -> Result<FeedForward, ModelError>,
) -> Result<DecoderLayer, ModelError> {
    let p = format!("model.layers.{i}");
    let mixer = match (c.layer_kind(i), &c.linear_attention) {
        _ if let Some(m) = &c.latent_attention => Mixer::Latent(deepseek_v3::latent_attention(w, &p, c, m)?),
        (LayerKind::LinearAttention, Some(l)) => Mixer::Linear(crate::gated_deltanet::GatedDeltaNet::load(
            w,
            &p,
            c.hidden_size,
            l.shape,
            l.layout,
            c.rms_norm_eps,
        )?),
        _ => Mixer::Attention(attention(w, &p, c, i)?),
    };
    Ok(DecoderLayer {
        input_layernorm: norm(w, c, &format!("{p}.input_layernorm"), c.hidden_size)?,
        mixer,
        post_attention_layernorm: norm(w, c, &format!("{p}.post_attention_layernorm"), c.hidden_size)?,
        mlp: mlp(w, &p)?,
    })
}

/// The MoE block of `{p}.mlp` as `m` describes it: the router
/// (`gate.weight`, and `gate.e_score_correction_bias` for sigmoid routing),
/// the routed experts as checkpoints publish them (one tensor per expert,
/// `experts.E.{gate,up,down}_proj.weight`) or in the fused layout
/// transformers 5 keeps in memory (`experts.gate_up_proj`,
/// `experts.down_proj`), and the shared expert (`shared`: its module name,
/// with the gate `shared_expert_gate` where the family has one).
pub(crate) fn sparse_moe(
    w: &mut Weights,
    p: &str,
    m: &MoeConfig,
    h: i64,
    shared: &str,
) -> Result<SparseMoe, ModelError> {
    let (e, inter) = (m.num_experts, m.expert_intermediate_size);
    let correction_bias = match m.routing {
        Routing::SigmoidGrouped { .. } => Some(w.take(&format!("{p}.mlp.gate.e_score_correction_bias"), &[e])?),
        _ => None,
    };
    let router = Router {
        weight: w.take(&format!("{p}.mlp.gate.weight"), &[e, h])?,
        bias: None,
        correction_bias,
        top_k: m.top_k,
        routing: m.routing.clone(),
    };
    let fused = format!("{p}.mlp.experts.gate_up_proj");
    let experts = match w.take_optional(&fused, &[e, 2 * inter, h])? {
        Some(gate_up) => Experts {
            gate_up,
            down: w.take(&format!("{p}.mlp.experts.down_proj"), &[e, h, inter])?,
            gate_up_bias: None,
            down_bias: None,
            activation: m.activation,
        },
        None => {
            let mut experts = Vec::with_capacity(e as usize);
            for j in 0..e {
                let x = format!("{p}.mlp.experts.{j}");
                experts.push((
                    w.take(&format!("{x}.gate_proj.weight"), &[inter, h])?,
                    w.take(&format!("{x}.up_proj.weight"), &[inter, h])?,
                    w.take(&format!("{x}.down_proj.weight"), &[h, inter])?,
                ));
            }
            Experts { activation: m.activation, ..Experts::stack(experts) }
        }
    };
    let shared = match m.shared_expert_intermediate_size {
        Some(width) => Some(SharedExpert {
            mlp: mlp(w, &format!("{p}.mlp.{shared}"), h, width, false)?,
            gate: if m.shared_expert_gate {
                Some(w.take(&format!("{p}.mlp.{shared}_gate.weight"), &[1, h])?)
            } else {
                None
            },
        }),
        None => None,
    };
    Ok(SparseMoe { router, experts, shared })
}

/// The Llama-style layer: attention and a dense MLP.
pub(crate) fn dense_layer(w: &mut Weights, c: &TargetConfig, i: i64) -> Result<DecoderLayer, ModelError> {
    layer_with(w, c, i, |w, p| {
        Ok(FeedForward::Dense(mlp(w, &format!("{p}.mlp"), c.hidden_size, c.intermediate_size, c.mlp_bias)?))
    })
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;

    fn read(text: &str) -> Result<TargetConfig, ModelError> {
        TargetConfig::from_hf(HfConfig::parse(Path::new("/m/config.json"), text)?)
    }

    const BASE: &str = r#""hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100"#;

    #[test]
    fn families_apply_their_own_defaults() {
        let q3 = read(&format!(r#"{{"architectures": ["Qwen3ForCausalLM"], {BASE}}}"#)).expect("qwen3");
        assert_eq!(q3.head_dim, 128, "Qwen3's head_dim default is 128, not hidden / heads");
        assert!(q3.qk_norm && !q3.qkv_bias);
        let q2 = read(&format!(r#"{{"architectures": ["Qwen2ForCausalLM"], {BASE}}}"#)).expect("qwen2");
        assert_eq!(q2.head_dim, 16);
        assert!(q2.qkv_bias && !q2.o_bias, "Qwen2 always has q/k/v biases");
        let l = read(&format!(r#"{{"architectures": ["LlamaForCausalLM"], "attention_bias": true, {BASE}}}"#))
            .expect("llama");
        assert!(l.qkv_bias && l.o_bias, "Llama's attention_bias covers o_proj too");
    }

    #[test]
    fn settings_that_change_the_math_are_refused_by_field() {
        for (text, field) in [
            (format!(r#"{{"architectures": ["MistralForCausalLM"], {BASE}}}"#), "sliding_window"),
            (
                format!(r#"{{"architectures": ["MistralForCausalLM"], "sliding_window": 4096, {BASE}}}"#),
                "sliding_window",
            ),
            (
                format!(
                    r#"{{"architectures": ["Qwen2ForCausalLM"], "use_sliding_window": true, "sliding_window": 4096, "max_window_layers": 2, {BASE}}}"#
                ),
                "use_sliding_window",
            ),
            (
                format!(
                    r#"{{"architectures": ["Qwen3ForCausalLM"], "layer_types": ["full_attention", "sliding_attention", "full_attention", "full_attention"], {BASE}}}"#
                ),
                "layer_types",
            ),
            (format!(r#"{{"architectures": ["LlamaForCausalLM"], "hidden_act": "gelu", {BASE}}}"#), "hidden_act"),
            (
                format!(r#"{{"architectures": ["LlamaForCausalLM"], "attn_logit_softcapping": 50.0, {BASE}}}"#),
                "attn_logit_softcapping",
            ),
            (format!(r#"{{"architectures": ["GemmaForCausalLM"], {BASE}}}"#), "GemmaForCausalLM"),
        ] {
            let err = read(&text).expect_err(&text).to_string();
            assert!(err.contains(field) && err.contains("/m/config.json"), "{text}: {err}");
        }
        // A window that never applies is plain attention, as Qwen2.5 ships it.
        read(&format!(
            r#"{{"architectures": ["Qwen2ForCausalLM"], "use_sliding_window": false, "sliding_window": 131072, "max_window_layers": 28, {BASE}}}"#
        ))
        .expect("window off");
        read(&format!(r#"{{"architectures": ["MistralForCausalLM"], "sliding_window": null, {BASE}}}"#))
            .expect("Mistral v0.2+: no window");
    }

    #[test]
    fn gpt_oss_rope_defaults_to_yarn_as_transformers_reads_it() {
        let gpt = |extra: &str| {
            read(&format!(
                r#"{{"architectures": ["GptOssForCausalLM"], "num_local_experts": 4, "num_experts_per_tok": 2, {extra} {BASE}}}"#
            ))
            .expect(extra)
        };
        let yarn = |c: &TargetConfig| matches!(c.rope.scaling, crate::rope::RopeScaling::Yarn { truncate: false, .. });
        let c = gpt("");
        assert!(yarn(&c) && c.rope.theta == 150_000.0, "{:?}", c.rope);
        assert_eq!(c.layer_types[0], LayerKind::SlidingAttention);
        assert_eq!((c.sliding_window, c.attention_sinks, c.rms_norm_eps), (Some(128), true, 1e-5));
        let c = gpt(r#""rope_theta": 5000.0, "rope_scaling": null,"#);
        assert!(yarn(&c) && c.rope.theta == 5000.0, "rope_theta alone keeps YaRN: {:?}", c.rope);
        let c = gpt(r#""rope_scaling": {"rope_type": "default"},"#);
        assert!(!yarn(&c) && c.rope.theta == 150_000.0, "{:?}", c.rope);
        let err = read(&format!(
            r#"{{"architectures": ["GptOssForCausalLM"], "num_local_experts": 4, "num_experts_per_tok": 2,
                "layer_types": ["sliding_attention", "chunked_attention", "full_attention", "full_attention"], {BASE}}}"#
        ))
        .expect_err("unknown layer type")
        .to_string();
        assert!(err.contains("layer_types") && err.contains("chunked_attention"), "{err}");
    }

    #[test]
    fn deepseek_and_glm_routing_settings_not_implemented_are_refused_by_field() {
        const DS: &str = r#""architectures": ["DeepseekV3ForCausalLM"], "n_routed_experts": 8, "num_experts_per_tok": 2,
            "moe_intermediate_size": 16, "n_group": 2, "topk_group": 1, "q_lora_rank": null, "kv_lora_rank": 16,
            "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8"#;
        let c = read(&format!(r#"{{{DS}, "first_k_dense_replace": 1, "num_nextn_predict_layers": 1, {BASE}}}"#))
            .expect("deepseek");
        assert_eq!(c.head_dim, 8, "the RoPE part is the head_dim RoPE tables cover");
        assert!(c.moe.as_ref().is_some_and(|m| m.dense_layers == vec![0]));
        assert_eq!(c.tensor_names.skipped[0].prefix, "model.layers.4.");
        for (extra, field) in [
            (r#""scoring_func": "softmax","#, "scoring_func"),
            (r#""topk_method": "group_limited_greedy","#, "topk_method"),
            (r#""moe_layer_freq": 2,"#, "moe_layer_freq"),
            (r#""n_group": 3,"#, "n_group"),
            (r#""pretraining_tp": 2,"#, "pretraining_tp"),
            (r#""qk_head_dim": 20,"#, "qk_head_dim"),
        ] {
            let text = format!("{{{extra} {DS}, {BASE}}}")
                .replace(r#", "n_group": 2"#, if field == "n_group" { "" } else { r#", "n_group": 2"# });
            let err = read(&text).expect_err(extra).to_string();
            assert!(err.contains(field), "{extra}: {err}");
        }
        let glm = read(&format!(
            r#"{{"architectures": ["Glm4MoeForCausalLM"], "n_routed_experts": 8, "num_experts_per_tok": 2,
                "moe_intermediate_size": 16, "use_qk_norm": true, "head_dim": 16, {BASE}}}"#
        ))
        .expect("glm");
        assert!(glm.qk_norm && glm.rope.partial_rotary_factor == 0.5 && !glm.o_bias);
    }

    const HYBRID: &str = r#""hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 100,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 8"#;

    #[test]
    fn hybrid_configs_read_as_transformers_reads_them() {
        let c = read(&format!(r#"{{"architectures": ["Qwen3_5ForCausalLM"], {HYBRID}}}"#)).expect("qwen3.5");
        use crate::target_config::LayerKind::{FullAttention as F, LinearAttention as L};
        assert_eq!(c.layer_types, vec![L, L, L, F], "every 4th layer full by default");
        assert_eq!(c.rope.partial_rotary_factor, 0.25, "the hybrids' default partial RoPE");
        assert!(c.attn_output_gate && c.norm == NormStyle::ZeroCentred && c.qk_norm);
        let c = read(&format!(
            r#"{{"architectures": ["Qwen3_5ForCausalLM"], "full_attention_interval": 2, "layer_types": null, {HYBRID}}}"#
        ))
        .expect("interval");
        assert_eq!(c.layer_types, vec![L, F, L, F]);
        let c = read(&format!(
            r#"{{"architectures": ["Qwen3NextForCausalLM"], "layer_types": ["mamba", "attention", "mamba", "mamba"], {HYBRID}}}"#
        ))
        .expect("legacy names");
        assert_eq!(c.layer_types, vec![L, F, L, L]);
        assert_eq!(c.moe.as_ref().map(|m| (m.num_experts, m.top_k)), Some((512, 10)), "transformers' defaults");
        // The published multimodal layout.
        let vl = read(&format!(
            r#"{{"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
                "tie_word_embeddings": false, "image_token_id": 5, "vision_config": {{"depth": 27}},
                "text_config": {{"model_type": "qwen3_5_moe_text", "num_experts": 8, "num_experts_per_tok": 2,
                "moe_intermediate_size": 16, "shared_expert_intermediate_size": 16, "mtp_num_hidden_layers": 1,
                "attn_output_gate": true, "output_gate_type": "swish", "mamba_ssm_dtype": "float32",
                "rope_parameters": {{"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                "mrope_section": [11, 11, 10], "mrope_interleaved": true}}, {HYBRID}}}}}"#
        ))
        .expect("multimodal");
        assert_eq!(vl.tensor_names.language_model.as_deref(), Some("model.language_model."));
        assert_eq!(vl.mtp_layers, 1);
        assert!(vl.moe.as_ref().is_some_and(|m| m.norm_topk_prob
            && m.shared_expert_intermediate_size == Some(16)
            && m.shared_expert_gate));
    }

    #[test]
    fn hybrid_settings_that_are_not_implemented_are_refused_by_field() {
        for (extra, arch, field) in [
            (
                r#""layer_types": ["linear_attention", "sliding_attention", "full_attention", "full_attention"]"#,
                "Qwen3_5ForCausalLM",
                "layer_types",
            ),
            (r#""layer_types": ["linear_attention", "full_attention"]"#, "Qwen3_5ForCausalLM", "layer_types"),
            (r#""attn_output_gate": false"#, "Qwen3_5ForCausalLM", "attn_output_gate"),
            (r#""mamba_ssm_dtype": "bfloat16""#, "Qwen3_5ForCausalLM", "mamba_ssm_dtype"),
            (r#""output_gate_type": "sigmoid""#, "Qwen3_5ForCausalLM", "output_gate_type"),
            (r#""linear_num_value_heads": 3"#, "Qwen3NextForCausalLM", "linear_num_value_heads"),
            (
                r#""rope_parameters": {"rope_type": "dynamic", "factor": 2.0}"#,
                "Qwen3NextForCausalLM",
                "rope_parameters",
            ),
            (r#""mrope_section": [1, 1]"#, "Qwen3NextForCausalLM", "mrope_section"),
            (r#""norm_topk_prob": false"#, "Qwen3_5MoeForCausalLM", "norm_topk_prob"),
            (r#""mlp_only_layers": [1]"#, "Qwen3_5MoeForCausalLM", "mlp_only_layers"),
        ] {
            let text = format!(
                r#"{{"architectures": ["{arch}"], {extra}, {}}}"#,
                HYBRID.replace(r#""linear_num_value_heads": 4,"#, "")
            );
            let text = if extra.contains("linear_num_value_heads") {
                text
            } else {
                text.replace(r#""linear_key_head_dim""#, r#""linear_num_value_heads": 4, "linear_key_head_dim""#)
            };
            let err = read(&text).expect_err(&text).to_string();
            assert!(err.contains(field) && err.contains("/m/config.json"), "{text}: {err}");
        }
        // A field nobody reads inside text_config is named with its path.
        let err = read(&format!(
            r#"{{"architectures": ["Qwen3_5ForConditionalGeneration"], "vision_config": {{}},
                "text_config": {{"attn_logit_softcapping": 30, {HYBRID}}}}}"#
        ))
        .expect_err("unread field")
        .to_string();
        assert!(err.contains("text_config.attn_logit_softcapping"), "{err}");
    }

    #[test]
    fn written_configs_read_back_to_the_same_config() {
        for text in [
            format!(
                r#"{{"architectures": ["LlamaForCausalLM"], "mlp_bias": true, "rope_scaling": {{"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}, {BASE}}}"#
            ),
            format!(
                r#"{{"architectures": ["Qwen3MoeForCausalLM"], "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 16, "mlp_only_layers": [1], "decoder_sparse_step": 1, "norm_topk_prob": true, {BASE}}}"#
            ),
            format!(
                r#"{{"architectures": ["Qwen2ForCausalLM"], "quantization_config": {{"quant_method": "fp8", "weight_block_size": [16, 16]}}, {BASE}}}"#
            ),
            format!(r#"{{"architectures": ["Qwen3NextForCausalLM"], "mlp_only_layers": [2], {HYBRID}}}"#),
            format!(r#"{{"architectures": ["Qwen3_5ForCausalLM"], "partial_rotary_factor": 0.5, {HYBRID}}}"#),
            format!(r#"{{"architectures": ["Qwen3_5MoeForCausalLM"], "num_experts": 8, {HYBRID}}}"#),
        ] {
            let c = read(&text).expect(&text);
            let again = read(&c.to_hf_json().to_string()).expect("written config");
            assert_eq!(c, again);
        }
    }
}
