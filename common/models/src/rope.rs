//! Rotary position embeddings as the configs say them: the base, and the
//! scalings `linear`, `llama3` (Llama 3.1-3.3) and `yarn`, read from either
//! layout transformers writes (4.x: `rope_theta` + `rope_scaling`; 5.x:
//! `rope_parameters`), partial rotary embeddings (`partial_rotary_factor`:
//! only the first dimensions of each head rotate) where a family has them,
//! and the cos/sin tables in the Hugging Face `rotate_half` convention.
//! Frequencies follow transformers' `modeling_rope_utils` (computed here in
//! f64).

use std::f64::consts::PI;

use serde_json::{Map, Value};
use tch::{Device, Kind, Tensor};

use crate::ModelError;
use crate::hf_config::HfConfig;

/// The transformers default base when a config names none.
const DEFAULT_THETA: f64 = 10_000.0;

/// How the base frequencies are rescaled for long context.
#[derive(Clone, Debug, PartialEq)]
pub enum RopeScaling {
    None,
    /// Every frequency divided by `factor` (positions interpolated).
    Linear {
        factor: f64,
    },
    /// Llama 3.1: low frequencies divided by `factor`, high ones kept, a
    /// smooth ramp between the two wavelength bounds.
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position_embeddings: f64,
    },
    /// YaRN: interpolation blended with extrapolation per dimension, and
    /// cos/sin scaled by `attention_factor`.
    Yarn {
        factor: f64,
        original_max_position_embeddings: f64,
        attention_factor: f64,
        beta_fast: f64,
        beta_slow: f64,
        truncate: bool,
        /// DeepSeek's `mscale_all_dim` (0: none): latent attention scales
        /// its softmax by `mscale(factor, mscale_all_dim)^2`.
        mscale_all_dim: f64,
    },
}

impl RopeScaling {
    /// gpt-oss's YaRN (transformers' default for it): x32 over 4096
    /// positions, betas 32/1, not truncated, the attention factor derived.
    pub fn gpt_oss_default() -> Self {
        RopeScaling::Yarn {
            factor: 32.0,
            original_max_position_embeddings: 4096.0,
            attention_factor: yarn_mscale(32.0, 1.0),
            beta_fast: 32.0,
            beta_slow: 1.0,
            truncate: false,
            mscale_all_dim: 0.0,
        }
    }
}

/// A target's RoPE: base, scaling, and the share of each head that rotates.
#[derive(Clone, Debug, PartialEq)]
pub struct RopeConfig {
    pub theta: f64,
    pub scaling: RopeScaling,
    /// `partial_rotary_factor`: the first `head_dim * factor` dimensions of
    /// a head rotate, the rest pass through (1: all of them).
    pub partial_rotary_factor: f64,
}

/// What a family's RoPE may carry beyond base and scaling.
#[derive(Clone, Copy, Debug, Default)]
pub struct RopeOptions {
    /// `partial_rotary_factor` below 1 is allowed, with this default when
    /// the config names none (None: refused, as in the dense families).
    pub partial: Option<f64>,
    /// Multimodal RoPE sections (`mrope_section`, `mrope_interleaved`, rope
    /// type `mrope`). A text token has the same temporal, height and width
    /// position, so every section turns by the text position: for text the
    /// sections are plain RoPE, which is what is computed.
    pub mrope: bool,
    /// The base when the config names none (transformers' `default_theta`;
    /// None: 10000).
    pub theta: Option<f64>,
}

impl RopeConfig {
    /// Plain RoPE with base `theta`.
    pub fn plain(theta: f64) -> Self {
        Self { theta, scaling: RopeScaling::None, partial_rotary_factor: 1.0 }
    }

    /// Dimensions of a head of `head_dim` that rotate (even).
    pub fn rotary_dim(&self, head_dim: i64) -> i64 {
        ((head_dim as f64 * self.partial_rotary_factor) as i64) / 2 * 2
    }

    /// Reads the RoPE fields of `cfg` in either layout. Types other than
    /// default, linear, llama3 and yarn, partial rotary embeddings and
    /// multimodal sections unless `options` allows them, per-layer-type
    /// RoPE and keys a type does not use are errors that name the field.
    pub fn read(cfg: &mut HfConfig, max_position_embeddings: i64, options: RopeOptions) -> Result<Self, ModelError> {
        let scaling: Option<Map<String, Value>> = cfg.opt("rope_scaling")?;
        let parameters: Option<Map<String, Value>> = cfg.opt("rope_parameters")?;
        let top_theta: Option<f64> = cfg.opt("rope_theta")?;
        let top_partial: Option<f64> = cfg.opt("partial_rotary_factor")?;
        // A top-level pretraining length wins over the one in the dict, as
        // in transformers' standardisation.
        let top_original: Option<f64> = cfg.opt("original_max_position_embeddings")?;
        // transformers 5 takes `rope_scaling` over `rope_parameters`.
        let (field, mut p) = match (scaling, parameters) {
            (Some(s), _) if !s.is_empty() => ("rope_scaling", s),
            (_, Some(p)) => ("rope_parameters", p),
            _ => ("rope_parameters", Map::new()),
        };
        let bad = |cfg: &HfConfig, m: String| cfg.error(field, m);
        if let Some((k, _)) = p.iter().find(|(_, v)| v.is_object()) {
            return Err(bad(cfg, format!("per-layer-type RoPE (\"{k}\") is not supported")));
        }
        let num = |p: &mut Map<String, Value>, key: &str| -> Result<Option<f64>, ModelError> {
            match p.remove(key) {
                None | Some(Value::Null) => Ok(None),
                Some(v) => v.as_f64().map(Some).ok_or_else(|| cfg.error(field, format!("{key} = {v} is not a number"))),
            }
        };
        let rope_type = p.remove("rope_type").or_else(|| p.remove("type"));
        p.remove("type");
        let mut rope_type = match rope_type {
            None | Some(Value::Null) => "default".to_string(),
            Some(Value::String(s)) => s,
            Some(v) => return Err(cfg.error(field, format!("rope_type {v} is not a string"))),
        };
        if options.mrope {
            // Older multimodal configs name the sections' type "mrope".
            if rope_type == "mrope" {
                rope_type = "default".into();
            }
            match p.remove("mrope_section") {
                None | Some(Value::Null) => {}
                Some(v) if serde_json::from_value::<Vec<u32>>(v.clone()).is_ok() => {}
                Some(v) => return Err(cfg.error(field, format!("mrope_section {v} is not a list of sizes"))),
            }
            match p.remove("mrope_interleaved") {
                None | Some(Value::Null) | Some(Value::Bool(_)) => {}
                Some(v) => return Err(cfg.error(field, format!("mrope_interleaved {v} is not a boolean"))),
            }
        }
        let theta = num(&mut p, "rope_theta")?.or(top_theta).or(options.theta).unwrap_or(DEFAULT_THETA);
        let partial_rotary_factor =
            num(&mut p, "partial_rotary_factor")?.or(top_partial).or(options.partial).unwrap_or(1.0);
        if partial_rotary_factor != 1.0 && options.partial.is_none() {
            return Err(cfg.error(
                field,
                format!("partial_rotary_factor {partial_rotary_factor} (partial rotary embeddings) is not supported"),
            ));
        }
        if !(partial_rotary_factor > 0.0 && partial_rotary_factor <= 1.0) {
            return Err(
                cfg.error(field, format!("partial_rotary_factor must be in (0, 1], got {partial_rotary_factor}"))
            );
        }
        if theta.is_nan() || theta <= 0.0 {
            return Err(cfg.error(field, format!("rope_theta must be positive, got {theta}")));
        }
        let max_pos = max_position_embeddings as f64;
        let scaling = match rope_type.as_str() {
            "default" => RopeScaling::None,
            "linear" => {
                let factor = num(&mut p, "factor")?.ok_or_else(|| cfg.error(field, "linear RoPE needs a factor"))?;
                RopeScaling::Linear { factor }
            }
            "llama3" => {
                let need = |p: &mut Map<String, Value>, key: &str| {
                    num(p, key)?.ok_or_else(|| cfg.error(field, format!("llama3 RoPE needs {key}")))
                };
                let factor = need(&mut p, "factor")?;
                let low_freq_factor = need(&mut p, "low_freq_factor")?;
                let high_freq_factor = need(&mut p, "high_freq_factor")?;
                let original = num(&mut p, "original_max_position_embeddings")?;
                if high_freq_factor <= low_freq_factor {
                    return Err(cfg.error(field, "llama3 RoPE needs high_freq_factor > low_freq_factor"));
                }
                RopeScaling::Llama3 {
                    factor,
                    low_freq_factor,
                    high_freq_factor,
                    original_max_position_embeddings: top_original.or(original).unwrap_or(max_pos),
                }
            }
            "yarn" => {
                let original = top_original.or(num(&mut p, "original_max_position_embeddings")?).unwrap_or(max_pos);
                let factor = num(&mut p, "factor")?.unwrap_or(max_pos / original);
                let mscale = num(&mut p, "mscale")?.unwrap_or(0.0);
                let mscale_all_dim = num(&mut p, "mscale_all_dim")?.unwrap_or(0.0);
                let attention_factor = match num(&mut p, "attention_factor")? {
                    Some(a) => a,
                    None if mscale != 0.0 && mscale_all_dim != 0.0 => {
                        yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
                    }
                    None => yarn_mscale(factor, 1.0),
                };
                let truncate = match p.remove("truncate") {
                    None | Some(Value::Null) => true,
                    Some(Value::Bool(b)) => b,
                    Some(v) => return Err(cfg.error(field, format!("truncate {v} is not a boolean"))),
                };
                RopeScaling::Yarn {
                    factor,
                    original_max_position_embeddings: original,
                    attention_factor,
                    beta_fast: num(&mut p, "beta_fast")?.filter(|&b| b != 0.0).unwrap_or(32.0),
                    beta_slow: num(&mut p, "beta_slow")?.filter(|&b| b != 0.0).unwrap_or(1.0),
                    truncate,
                    mscale_all_dim,
                }
            }
            other => {
                return Err(cfg.error(
                    field,
                    format!("RoPE type \"{other}\" is not supported (supported: default, linear, llama3, yarn)"),
                ));
            }
        };
        if let Some((k, v)) = p.iter().next() {
            return Err(cfg.error(field, format!("{k} = {v} is not used by RoPE type \"{rope_type}\"")));
        }
        match &scaling {
            RopeScaling::Linear { factor } | RopeScaling::Llama3 { factor, .. } | RopeScaling::Yarn { factor, .. }
                if factor.is_nan() || *factor <= 0.0 =>
            {
                Err(cfg.error(field, format!("factor must be positive, got {factor}")))
            }
            _ => Ok(Self { theta, scaling, partial_rotary_factor }),
        }
    }

    /// Inverse frequencies of the rotated pairs of a head of `head_dim`
    /// (`rotary_dim / 2` of them).
    pub fn inv_freq(&self, head_dim: i64) -> Vec<f64> {
        let rotary = self.rotary_dim(head_dim);
        let d = rotary as f64;
        let base: Vec<f64> = (0..rotary / 2).map(|i| 1.0 / self.theta.powf(2.0 * i as f64 / d)).collect();
        match self.scaling {
            RopeScaling::None => base,
            RopeScaling::Linear { factor } => base.iter().map(|f| f / factor).collect(),
            RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position_embeddings } => {
                let low_wavelen = original_max_position_embeddings / low_freq_factor;
                let high_wavelen = original_max_position_embeddings / high_freq_factor;
                base.iter()
                    .map(|&f| {
                        let wavelen = 2.0 * PI / f;
                        if wavelen < high_wavelen {
                            f
                        } else if wavelen > low_wavelen {
                            f / factor
                        } else {
                            let smooth = (original_max_position_embeddings / wavelen - low_freq_factor)
                                / (high_freq_factor - low_freq_factor);
                            (1.0 - smooth) * f / factor + smooth * f
                        }
                    })
                    .collect()
            }
            RopeScaling::Yarn { factor, original_max_position_embeddings, beta_fast, beta_slow, truncate, .. } => {
                let correction = |rotations: f64| {
                    d * (original_max_position_embeddings / (rotations * 2.0 * PI)).ln() / (2.0 * self.theta.ln())
                };
                let (mut low, mut high) = (correction(beta_fast), correction(beta_slow));
                if truncate {
                    (low, high) = (low.floor(), high.ceil());
                }
                let (low, mut high) = (low.max(0.0), high.min(d - 1.0));
                if low == high {
                    high += 0.001;
                }
                base.iter()
                    .enumerate()
                    .map(|(i, &f)| {
                        let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
                        let extrapolation = 1.0 - ramp;
                        (f / factor) * (1.0 - extrapolation) + f * extrapolation
                    })
                    .collect()
            }
        }
    }

    /// What DeepSeek's latent attention multiplies its softmax scale by:
    /// YaRN's `mscale(factor, mscale_all_dim)` squared (1 otherwise), as
    /// transformers' `yarn_apply_mscale`.
    pub fn softmax_mscale(&self) -> f64 {
        match self.scaling {
            RopeScaling::Yarn { factor, mscale_all_dim, .. } if mscale_all_dim != 0.0 => {
                yarn_mscale(factor, mscale_all_dim).powi(2)
            }
            _ => 1.0,
        }
    }

    /// Scale applied to cos and sin (YaRN's attention factor; else 1).
    pub fn attention_scaling(&self) -> f64 {
        match self.scaling {
            RopeScaling::Yarn { attention_factor, .. } => attention_factor,
            _ => 1.0,
        }
    }

    /// One line for printouts.
    pub fn describe(&self) -> String {
        let base = self.describe_scaling();
        if self.partial_rotary_factor == 1.0 {
            base
        } else {
            format!("{base}, partial (factor {})", self.partial_rotary_factor)
        }
    }

    fn describe_scaling(&self) -> String {
        match &self.scaling {
            RopeScaling::None => format!("theta {}", self.theta),
            RopeScaling::Linear { factor } => format!("theta {}, linear x{factor}", self.theta),
            RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position_embeddings } => {
                format!(
                    "theta {}, llama3 x{factor} (low {low_freq_factor}, high {high_freq_factor}, original {original_max_position_embeddings})",
                    self.theta
                )
            }
            RopeScaling::Yarn {
                factor,
                original_max_position_embeddings,
                attention_factor,
                beta_fast,
                beta_slow,
                ..
            } => {
                format!(
                    "theta {}, yarn x{factor} (original {original_max_position_embeddings}, attention {attention_factor:.4}, beta {beta_fast}/{beta_slow})",
                    self.theta
                )
            }
        }
    }

    /// The 4.x layout of these settings (`rope_theta`, `rope_scaling`), for
    /// config.json files the project writes.
    pub fn to_hf_fields(&self) -> (f64, Value) {
        let scaling = match &self.scaling {
            RopeScaling::None => Value::Null,
            RopeScaling::Linear { factor } => serde_json::json!({"rope_type": "linear", "factor": factor}),
            RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position_embeddings } => {
                serde_json::json!({"rope_type": "llama3", "factor": factor, "low_freq_factor": low_freq_factor,
                    "high_freq_factor": high_freq_factor,
                    "original_max_position_embeddings": *original_max_position_embeddings as i64})
            }
            RopeScaling::Yarn {
                factor,
                original_max_position_embeddings,
                attention_factor,
                beta_fast,
                beta_slow,
                truncate,
                mscale_all_dim,
            } => {
                let mut v = serde_json::json!({"rope_type": "yarn", "factor": factor,
                    "original_max_position_embeddings": *original_max_position_embeddings as i64,
                    "attention_factor": attention_factor, "beta_fast": beta_fast, "beta_slow": beta_slow,
                    "truncate": truncate});
                if *mscale_all_dim != 0.0 {
                    v["mscale_all_dim"] = serde_json::json!(mscale_all_dim);
                }
                v
            }
        };
        (self.theta, scaling)
    }
}

fn yarn_mscale(scale: f64, mscale: f64) -> f64 {
    if scale <= 1.0 { 1.0 } else { 0.1 * mscale * scale.ln() + 1.0 }
}

/// Rotary tables for one head size: the inverse frequencies on the device.
#[derive(Debug)]
pub struct Rope {
    inv_freq: Tensor,
    scaling: f64,
}

impl Rope {
    /// Plain RoPE with base `theta` (the drafter's).
    pub fn new(head_dim: i64, theta: f64, device: Device) -> Self {
        Self::from_config(&RopeConfig::plain(theta), head_dim, device)
    }

    pub fn from_config(config: &RopeConfig, head_dim: i64, device: Device) -> Self {
        let inv: Vec<f32> = config.inv_freq(head_dim).iter().map(|&f| f as f32).collect();
        Self { inv_freq: Tensor::from_slice(&inv).to_device(device), scaling: config.attention_scaling() }
    }

    /// `(cos, sin)` of shape `positions.shape + [rotary_dim]`, in `kind`.
    pub fn cos_sin(&self, positions: &Tensor, kind: Kind) -> (Tensor, Tensor) {
        let freqs = positions.to_kind(Kind::Float).unsqueeze(-1) * &self.inv_freq;
        let emb = Tensor::cat(&[&freqs, &freqs], -1);
        if self.scaling == 1.0 {
            (emb.cos().to_kind(kind), emb.sin().to_kind(kind))
        } else {
            ((emb.cos() * self.scaling).to_kind(kind), (emb.sin() * self.scaling).to_kind(kind))
        }
    }
}

/// Applies rotary embeddings: `x * cos + rotate_half(x) * sin`. `cos`/`sin`
/// must broadcast against `x` (e.g. x `[.., S, heads, d]`, cos `[.., S, 1, r]`);
/// when they cover fewer dimensions than a head (`r < d`, partial rotary
/// embeddings), the first `r` rotate and the rest pass through.
pub fn apply_rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Tensor {
    let d = *x.size().last().expect("rope input has a head dimension");
    let r = *cos.size().last().expect("rope tables have a last dimension");
    if r < d {
        let rotated = apply_rope(&x.narrow(-1, 0, r), cos, sin);
        return Tensor::cat(&[&rotated, &x.narrow(-1, r, d - r)], -1);
    }
    let x1 = x.narrow(-1, 0, d / 2);
    let x2 = x.narrow(-1, d / 2, d / 2);
    let rotated = Tensor::cat(&[&x2.neg(), &x1], -1);
    x * cos + rotated * sin
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;

    fn read(text: &str) -> Result<RopeConfig, ModelError> {
        let mut c = HfConfig::parse(Path::new("/m/config.json"), text)?;
        RopeConfig::read(&mut c, 2048, RopeOptions::default())
    }

    #[test]
    fn rope_rotates_pairs_half_a_head_apart() {
        let rope = Rope::new(4, 10_000.0, Device::Cpu);
        let pos = Tensor::from_slice(&[0i64, 1]);
        let (cos, sin) = rope.cos_sin(&pos, Kind::Double);
        let x = Tensor::from_slice(&[1.0f64, 2.0, 3.0, 4.0]).view([1, 4]).repeat([2, 1]);
        let y = apply_rope(&x, &cos, &sin);
        // position 0: identity
        assert!(y.get(0).allclose(&x.get(0), 1e-6, 1e-6, false));
        // position 1, first pair (dims 0 and 2) rotated by angle 1 (inv_freq[0] = 1)
        let (c, s) = (1f64.cos(), 1f64.sin());
        assert!((y.double_value(&[1, 0]) - (1.0 * c - 3.0 * s)).abs() < 1e-6, "rope tables are f32");
        assert!((y.double_value(&[1, 2]) - (3.0 * c + 1.0 * s)).abs() < 1e-6);
    }

    #[test]
    fn both_layouts_give_the_same_rope() {
        let tf4 = read(
            r#"{"rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}"#,
        )
        .expect("4.x");
        let tf5 = read(
            r#"{"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}"#,
        )
        .expect("5.x");
        assert_eq!(tf4, tf5);
        // The 5.x bug this guards against: a base that lives only in
        // rope_parameters must not fall back to the default.
        assert_eq!(
            read(r#"{"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}"#).expect("5.x").theta,
            1e6
        );
        assert_eq!(read(r#"{"rope_theta": 1e6, "rope_scaling": null}"#).expect("4.x").theta, 1e6);
        assert_eq!(read("{}").expect("nothing").theta, 10_000.0);
        let old = read(r#"{"rope_scaling": {"type": "linear", "factor": 2.0}}"#).expect("old type key");
        assert_eq!(old.scaling, RopeScaling::Linear { factor: 2.0 });
    }

    #[test]
    fn llama3_keeps_high_frequencies_and_divides_low_ones() {
        let r = read(
            r#"{"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}"#,
        )
        .expect("llama3");
        let plain = RopeConfig::plain(500_000.0).inv_freq(128);
        let scaled = r.inv_freq(128);
        assert_eq!(scaled[0], plain[0], "wavelength 2pi < 2048: kept");
        assert!((scaled[63] - plain[63] / 8.0).abs() < 1e-18, "wavelength > 8192: divided by the factor");
        assert!(scaled.iter().zip(&plain).all(|(s, p)| s <= p && *s >= p / 8.0));
    }

    #[test]
    fn yarn_scales_the_tables_by_its_attention_factor() {
        let r = read(
            r#"{"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
            "original_max_position_embeddings": 32768}}"#,
        )
        .expect("yarn");
        assert!((r.attention_scaling() - (0.1 * 4f64.ln() + 1.0)).abs() < 1e-12);
        let plain = RopeConfig::plain(1e6).inv_freq(128);
        let scaled = r.inv_freq(128);
        assert_eq!(scaled[0], plain[0], "fast dimensions extrapolate");
        assert!((scaled[63] - plain[63] / 4.0).abs() < 1e-18, "slow dimensions interpolate");
    }

    #[test]
    fn partial_rotary_embeddings_rotate_the_first_dimensions_only() {
        let text = r#"{"rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
            "mrope_section": [11, 11, 10], "mrope_interleaved": true}}"#;
        let mut c = HfConfig::parse(Path::new("/m/config.json"), text).expect("json");
        let r = RopeConfig::read(&mut c, 2048, RopeOptions { partial: Some(0.25), mrope: true, theta: None })
            .expect("qwen3.5");
        assert_eq!(r.rotary_dim(256), 64);
        let inv = r.inv_freq(256);
        assert_eq!(inv.len(), 32);
        // transformers: 1 / base^(arange(0, dim, 2) / dim) with dim = 64.
        assert!((inv[1] - 1.0 / 1e7f64.powf(2.0 / 64.0)).abs() < 1e-15);
        let rope = Rope::from_config(&r, 256, Device::Cpu);
        let (cos, sin) = rope.cos_sin(&Tensor::from_slice(&[3i64]), Kind::Double);
        assert_eq!(cos.size(), vec![1, 64]);
        let x = Tensor::randn([1, 256], (Kind::Double, Device::Cpu));
        let y = apply_rope(&x, &cos, &sin);
        assert!(y.narrow(-1, 64, 192).equal(&x.narrow(-1, 64, 192)), "the rest passes through");
        assert!(y.narrow(-1, 0, 64).allclose(&apply_rope(&x.narrow(-1, 0, 64), &cos, &sin), 0.0, 0.0, false));
        // Families without partial RoPE or multimodal sections refuse them.
        let mut c = HfConfig::parse(Path::new("/m/config.json"), text).expect("json");
        let err = RopeConfig::read(&mut c, 2048, RopeOptions { partial: Some(0.25), mrope: false, theta: None })
            .expect_err("mrope");
        assert!(err.to_string().contains("mrope_"), "{err}");
    }

    #[test]
    fn what_is_not_implemented_is_refused_by_name() {
        for (text, want) in [
            (r#"{"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}"#, "\"dynamic\" is not supported"),
            (r#"{"rope_scaling": {"rope_type": "longrope", "short_factor": [1], "long_factor": [1]}}"#, "longrope"),
            (r#"{"partial_rotary_factor": 0.5}"#, "partial_rotary_factor"),
            (
                r#"{"rope_parameters": {"rope_type": "linear", "factor": 2.0, "mrope_section": [1, 2]}}"#,
                "mrope_section",
            ),
            (r#"{"rope_parameters": {"full_attention": {"rope_type": "default"}}}"#, "per-layer-type"),
            (r#"{"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}"#, "low_freq_factor"),
        ] {
            let err = read(text).expect_err(text).to_string();
            assert!(err.contains(want) && err.contains("/m/config.json"), "{text}: {err}");
        }
    }
}
