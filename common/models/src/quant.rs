//! Quantized checkpoints: `quantization_config` with `quant_method: "fp8"`
//! (block-scaled e4m3 weights, as Qwen3-*-FP8 and DeepSeek publish them).
//! A quantized projection stores `X.weight` in float8_e4m3fn and
//! `X.weight_scale_inv` in f32, one scale per `weight_block_size` block
//! (or one per tensor without a block size); the real weight is
//! `weight * scale` blockwise. Loading dequantizes to the compute dtype, as
//! transformers does with `FineGrainedFP8Config(dequantize=True)`;
//! everything else (embeddings, norms, LM head, routers) is stored
//! unquantized and loads as usual.

use serde_json::{Map, Value};
use tch::{Kind, Tensor};

use crate::ModelError;
use crate::hf_config::HfConfig;

/// How a checkpoint's FP8 weights are scaled.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Fp8Config {
    /// Rows and columns per scale; None: one scale per tensor.
    pub block: Option<[i64; 2]>,
}

impl Fp8Config {
    /// Reads `quantization_config`. Methods other than fp8, other formats,
    /// static activation scales and scale formats other than f32 are errors
    /// naming the field.
    pub fn read(cfg: &mut HfConfig) -> Result<Option<Self>, ModelError> {
        const FIELD: &str = "quantization_config";
        let Some(mut q): Option<Map<String, Value>> = cfg.opt(FIELD)? else { return Ok(None) };
        let text = |v: Option<Value>| v.and_then(|v| v.as_str().map(str::to_string));
        let method = text(q.remove("quant_method")).unwrap_or_default();
        if method != "fp8" {
            return Err(cfg.error(
                FIELD,
                format!("quant_method \"{method}\" is not supported (supported: fp8, block-scaled e4m3)"),
            ));
        }
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
        // Which modules stayed unquantized is also visible in the tensors'
        // dtypes, which is what loading goes by.
        for informational in ["modules_to_not_convert", "ignored_layers", "dequantize"] {
            q.remove(informational);
        }
        if let Some((k, v)) = q.iter().next() {
            return Err(cfg.error(FIELD, format!("{k} = {v} is not supported")));
        }
        Ok(Some(Self { block }))
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

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;

    fn read(text: &str) -> Result<Option<Fp8Config>, ModelError> {
        let mut c = HfConfig::parse(Path::new("/m/config.json"), text)?;
        Fp8Config::read(&mut c)
    }

    #[test]
    fn published_fp8_configs_read_and_others_are_refused() {
        let q = read(
            r#"{"quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                "weight_block_size": [128, 128]}}"#,
        )
        .expect("Qwen3-8B-FP8");
        assert_eq!(q, Some(Fp8Config { block: Some([128, 128]) }));
        assert_eq!(read("{}").expect("none"), None);
        for (text, want) in [
            (r#"{"quantization_config": {"quant_method": "gptq", "bits": 4}}"#, "\"gptq\" is not supported"),
            (r#"{"quantization_config": {"quant_method": "fp8", "fmt": "e5m2"}}"#, "e5m2"),
            (r#"{"quantization_config": {"quant_method": "fp8", "activation_scheme": "static"}}"#, "static"),
            (r#"{"quantization_config": {"quant_method": "fp8", "weight_block_size": [128]}}"#, "weight_block_size"),
            (r#"{"quantization_config": {"quant_method": "fp8", "scale_fmt": "ue8m0"}}"#, "ue8m0"),
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
}
