//! Quantized checkpoints, as their `quantization_config` names them:
//!
//! - `quant_method: "fp8"` (block-scaled e4m3 weights, as Qwen3-*-FP8,
//!   DeepSeek-V3 and Kimi-K2 publish them). A quantized projection stores
//!   `X.weight` in float8_e4m3fn and `X.weight_scale_inv` in f32, one scale
//!   per `weight_block_size` block (or one per tensor without a block
//!   size); the real weight is `weight * scale` blockwise.
//! - `quant_method: "mxfp4"` (gpt-oss's experts). `X_blocks` `[.., rows,
//!   G, 16]` u8 holds two e2m1 values per byte (low nibble first) and
//!   `X_scales` `[.., rows, G]` u8 one e8m0 exponent (bias 127) per block
//!   of 32 values; the real tensor is transformers' parameter `X`, the
//!   dequantized `[E, rows, G * 32]` with its last two dimensions swapped.
//!
//! Loading dequantizes to the compute dtype, as transformers does
//! (`FineGrainedFP8Config(dequantize=True)`, `Mxfp4Config(dequantize=True)`);
//! everything else (embeddings, norms, LM head, routers) is stored
//! unquantized and loads as usual.

use serde_json::{Map, Value};
use tch::{Kind, Tensor};

use crate::ModelError;
use crate::hf_config::HfConfig;

/// How a checkpoint's weights are quantized.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Quantization {
    Fp8(Fp8Config),
    /// MXFP4 blocks (`X_blocks` + `X_scales`), dequantized on load.
    Mxfp4,
}

const FIELD: &str = "quantization_config";

fn text(v: Option<Value>) -> Option<String> {
    v.and_then(|v| v.as_str().map(str::to_string))
}

impl Quantization {
    /// Reads `quantization_config`. Methods other than fp8 and mxfp4, and
    /// settings of theirs this crate does not implement, are errors naming
    /// the field.
    pub fn read(cfg: &mut HfConfig) -> Result<Option<Self>, ModelError> {
        let Some(mut q): Option<Map<String, Value>> = cfg.opt(FIELD)? else { return Ok(None) };
        let method = text(q.remove("quant_method")).unwrap_or_default();
        let quant = match method.as_str() {
            "fp8" => Quantization::Fp8(Fp8Config::read(cfg, &mut q)?),
            "mxfp4" => Quantization::Mxfp4,
            _ => {
                return Err(cfg.error(
                    FIELD,
                    format!("quant_method \"{method}\" is not supported (supported: fp8, block-scaled e4m3; mxfp4)"),
                ));
            }
        };
        // Which modules stayed unquantized is also visible in the tensors'
        // dtypes, which is what loading goes by.
        for informational in ["modules_to_not_convert", "ignored_layers", "dequantize"] {
            q.remove(informational);
        }
        if let Some((k, v)) = q.iter().next() {
            return Err(cfg.error(FIELD, format!("{k} = {v} is not supported")));
        }
        Ok(Some(quant))
    }

    /// The FP8 settings, when the checkpoint is FP8.
    pub fn fp8(&self) -> Option<&Fp8Config> {
        match self {
            Quantization::Fp8(f) => Some(f),
            Quantization::Mxfp4 => None,
        }
    }

    pub fn describe(&self) -> String {
        match self {
            Quantization::Fp8(f) => f.describe(),
            Quantization::Mxfp4 => "mxfp4 (e2m1 in blocks of 32, e8m0 scales), dequantized on load".into(),
        }
    }
}

/// How a checkpoint's FP8 weights are scaled.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Fp8Config {
    /// Rows and columns per scale; None: one scale per tensor.
    pub block: Option<[i64; 2]>,
}

impl Fp8Config {
    /// The fp8 settings of `quantization_config` (its other fields are left
    /// in `q`): formats other than e4m3, static activation scales and scale
    /// formats other than f32 are errors naming the field.
    fn read(cfg: &HfConfig, q: &mut Map<String, Value>) -> Result<Self, ModelError> {
        if let Some(fmt) = text(q.remove("fmt"))
            && fmt != "e4m3"
        {
            return Err(cfg.error(FIELD, format!("fmt \"{fmt}\" is not supported (only e4m3)")));
        }
        if let Some(a) = text(q.remove("activation_scheme"))
            && a != "dynamic"
        {
            return Err(cfg.error(FIELD, format!("activation_scheme \"{a}\" is not supported (only dynamic)")));
        }
        if let Some(f) = text(q.remove("scale_fmt"))
            && f != "float"
        {
            return Err(cfg.error(FIELD, format!("scale_fmt \"{f}\" is not supported (only float)")));
        }
        let block = match q.remove("weight_block_size") {
            None | Some(Value::Null) => None,
            Some(v) => match serde_json::from_value::<Vec<i64>>(v.clone()) {
                Ok(b) if b.len() == 2 && b[0] > 0 && b[1] > 0 => Some([b[0], b[1]]),
                _ => return Err(cfg.error(FIELD, format!("weight_block_size {v} is not two positive integers"))),
            },
        };
        Ok(Self { block })
    }

    pub fn describe(&self) -> String {
        match self.block {
            Some([r, c]) => format!("fp8 e4m3, {r}x{c} blocks"),
            None => "fp8 e4m3, per tensor".into(),
        }
    }
}

/// The scale grid a weight of `shape` has under `block`.
pub fn scale_shape(shape: &[i64], block: Option<[i64; 2]>) -> Vec<i64> {
    match (block, shape) {
        (Some([br, bc]), [.., r, c]) => {
            let mut s = shape[..shape.len() - 2].to_vec();
            // Partial last blocks have a scale of their own.
            s.extend([(r + br - 1) / br, (c + bc - 1) / bc]);
            s
        }
        _ => vec![],
    }
}

/// `weight * scale` blockwise, in `kind`. `weight` is float8 `[.., r, c]`,
/// `scale` f32 of [`scale_shape`] (or one element per tensor).
pub fn dequantize(weight: &Tensor, scale: &Tensor, block: Option<[i64; 2]>, kind: Kind) -> Tensor {
    let w = weight.to_kind(Kind::Float);
    let s = scale.to_kind(Kind::Float);
    let out = match block {
        None => w * s.reshape([-1]).get(0),
        Some([br, bc]) => {
            let size = w.size();
            let (r, c) = (size[size.len() - 2], size[size.len() - 1]);
            // Expand the grid to the weight's shape; the last blocks may
            // be partial.
            let s = s.repeat_interleave_self_int(br, -2, None::<i64>).narrow(-2, 0, r);
            let s = s.repeat_interleave_self_int(bc, -1, None::<i64>).narrow(-1, 0, c);
            w * s
        }
    };
    out.to_kind(kind)
}

/// The e2m1 values of a nibble, as transformers' `FP4_VALUES`.
const FP4_VALUES: [f32; 16] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0];

/// Suffixes of an MXFP4 tensor's two parts.
pub const MXFP4_BLOCKS: &str = "_blocks";
pub const MXFP4_SCALES: &str = "_scales";

/// The shape of the dequantized tensor of `blocks` `[E, rows, G, 16]`:
/// `[E, G * 32, rows]` (transformers' parameter layout); None when the
/// blocks are not of that form.
pub fn mxfp4_shape(blocks: &[i64]) -> Option<Vec<i64>> {
    match blocks {
        [e, rows, g, 16] => Some(vec![*e, g * 32, *rows]),
        _ => None,
    }
}

/// Dequantizes MXFP4 `blocks` `[E, rows, G, 16]` (u8) with their e8m0
/// `scales` `[E, rows, G]` (u8) into `kind`, in transformers' layout
/// `[E, G * 32, rows]`: each byte's low nibble is the even value and its
/// high nibble the odd one, each block of 32 scaled by `2^(scale - 127)`
/// (exact: every e2m1 value times a power of two is representable).
pub fn dequantize_mxfp4(blocks: &Tensor, scales: &Tensor, kind: Kind) -> Tensor {
    let _guard = tch::no_grad_guard();
    let b = blocks.to_kind(Kind::Int64);
    let lut = Tensor::from_slice(&FP4_VALUES).to_device(blocks.device());
    let size = blocks.size();
    let (e, rows, g) = (size[0], size[1], size[2]);
    let lo = lut.index_select(0, &b.remainder(16).view([-1]));
    let hi = lut.index_select(0, &b.floor_divide_scalar(16).view([-1]));
    let values = Tensor::stack(&[lo, hi], -1).view([e, rows, g, 32]);
    let exponent = scales.to_kind(Kind::Float) - 127.0;
    let scale = Tensor::full([1], 2.0, (Kind::Float, blocks.device())).pow(&exponent).unsqueeze(-1);
    (values * scale).view([e, rows, g * 32]).transpose(1, 2).contiguous().to_kind(kind)
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;

    fn read(text: &str) -> Result<Option<Quantization>, ModelError> {
        let mut c = HfConfig::parse(Path::new("/m/config.json"), text)?;
        Quantization::read(&mut c)
    }

    #[test]
    fn published_fp8_configs_read_and_others_are_refused() {
        let q = read(
            r#"{"quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                "weight_block_size": [128, 128]}}"#,
        )
        .expect("Qwen3-8B-FP8");
        assert_eq!(q, Some(Quantization::Fp8(Fp8Config { block: Some([128, 128]) })));
        assert_eq!(read("{}").expect("none"), None);
        let q = read(r#"{"quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn"], "quant_method": "mxfp4"}}"#)
            .expect("gpt-oss");
        assert_eq!(q, Some(Quantization::Mxfp4));
        for (text, want) in [
            (r#"{"quantization_config": {"quant_method": "gptq", "bits": 4}}"#, "\"gptq\" is not supported"),
            (r#"{"quantization_config": {"quant_method": "fp8", "fmt": "e5m2"}}"#, "e5m2"),
            (r#"{"quantization_config": {"quant_method": "fp8", "activation_scheme": "static"}}"#, "static"),
            (r#"{"quantization_config": {"quant_method": "fp8", "weight_block_size": [128]}}"#, "weight_block_size"),
            (r#"{"quantization_config": {"quant_method": "fp8", "scale_fmt": "ue8m0"}}"#, "ue8m0"),
            (r#"{"quantization_config": {"quant_method": "mxfp4", "group_size": 64}}"#, "group_size"),
        ] {
            let err = read(text).expect_err(text).to_string();
            assert!(err.contains(want) && err.contains("quantization_config"), "{err}");
        }
    }

    #[test]
    fn blocks_scale_their_own_rows_and_columns_including_partial_blocks() {
        // A 3x5 weight in 2x2 blocks: a 2x3 grid, the last row and column partial.
        let w = Tensor::ones([3, 5], (Kind::Float, tch::Device::Cpu)).to_kind(Kind::Float8e4m3fn);
        let s = Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0]).view([2, 3]);
        assert_eq!(scale_shape(&[3, 5], Some([2, 2])), vec![2, 3]);
        let d = dequantize(&w, &s, Some([2, 2]), Kind::Float);
        let want = Tensor::from_slice(&[
            1.0f32, 1.0, 2.0, 2.0, 3.0, //
            1.0, 1.0, 2.0, 2.0, 3.0, //
            4.0, 4.0, 5.0, 5.0, 6.0,
        ])
        .view([3, 5]);
        assert!(d.equal(&want), "{d}");
        let per_tensor = dequantize(&w, &Tensor::from_slice(&[0.5f32]), None, Kind::Float);
        assert!(per_tensor.equal(&(Tensor::ones([3, 5], (Kind::Float, tch::Device::Cpu)) * 0.5)));
    }

    #[test]
    fn mxfp4_blocks_dequantize_nibble_by_nibble_with_their_exponents() {
        // One expert, two rows, one block of 32: byte j holds values 2j
        // (low nibble) and 2j+1 (high nibble).
        let mut bytes = vec![0u8; 2 * 16];
        bytes[0] = 0x21; // row 0: values 0.5 (code 1), 1.0 (code 2)
        bytes[15] = 0xF7; // row 0: values 6.0 (7), -6.0 (15)
        bytes[16] = 0x9A; // row 1: values -1.0 (10), -0.5 (9)
        let blocks = Tensor::from_slice(&bytes).view([1, 2, 1, 16]);
        let scales = Tensor::from_slice(&[128u8, 125]).view([1, 2, 1]);
        assert_eq!(mxfp4_shape(&blocks.size()), Some(vec![1, 32, 2]));
        let d = dequantize_mxfp4(&blocks, &scales, Kind::Float);
        assert_eq!(d.size(), vec![1, 32, 2], "transformers' [E, in, out] layout");
        let v = |i: i64, row: i64| d.double_value(&[0, i, row]);
        assert_eq!((v(0, 0), v(1, 0), v(30, 0), v(31, 0)), (1.0, 2.0, 12.0, -12.0), "scale 2^1");
        assert_eq!((v(0, 1), v(1, 1), v(2, 1)), (-0.25, -0.125, 0.0), "scale 2^-2");
    }
}
