//! Reading GGUF files (llama.cpp's format) and converting a Llama GGUF into a
//! Hugging Face model directory: dequantized weights under HF names, with
//! the q/k rows un-permuted back to `rotate_half` RoPE, plus the tokenizer
//! and chat template from the metadata.

use std::collections::BTreeMap;
use std::io::{Cursor, Read};
use std::path::Path;

use half::f16;
use tch::{Kind, Tensor};

use dflash_models::ModelError;
use dflash_models::target_config::{Family, TargetConfig};
use dflash_models::weights::write_safetensors;

/// A metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    U64(u64),
    I64(i64),
    F64(f64),
    Bool(bool),
    Str(String),
    Array(Vec<Value>),
}

impl Value {
    pub fn as_u64(&self) -> Option<u64> {
        match self {
            Value::U64(v) => Some(*v),
            Value::I64(v) if *v >= 0 => Some(*v as u64),
            _ => None,
        }
    }
    pub fn as_f64(&self) -> Option<f64> {
        match self {
            Value::F64(v) => Some(*v),
            Value::U64(v) => Some(*v as f64),
            Value::I64(v) => Some(*v as f64),
            _ => None,
        }
    }
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }
}

/// One tensor's place in the file.
#[derive(Clone, Debug)]
pub struct TensorInfo {
    pub name: String,
    /// Dimensions fastest-first, as GGUF lists them.
    pub dims: Vec<u64>,
    pub ggml_type: u32,
    pub offset: u64,
}

/// A parsed GGUF file held in memory.
pub struct Gguf {
    pub metadata: BTreeMap<String, Value>,
    pub tensors: Vec<TensorInfo>,
    data: Vec<u8>,
    data_start: usize,
    path: String,
}

const GGML_F32: u32 = 0;
const GGML_F16: u32 = 1;
const GGML_Q4_0: u32 = 2;
const GGML_Q4_1: u32 = 3;
const GGML_Q8_0: u32 = 8;

fn bad(path: &str, msg: impl Into<String>) -> ModelError {
    ModelError::Weights { path: path.into(), message: msg.into() }
}

struct Reader<'a> {
    c: Cursor<&'a [u8]>,
    path: &'a str,
}

impl Reader<'_> {
    fn bytes<const N: usize>(&mut self) -> Result<[u8; N], ModelError> {
        let mut b = [0u8; N];
        self.c.read_exact(&mut b).map_err(|_| bad(self.path, "truncated GGUF header"))?;
        Ok(b)
    }
    fn u32(&mut self) -> Result<u32, ModelError> {
        Ok(u32::from_le_bytes(self.bytes()?))
    }
    fn u64(&mut self) -> Result<u64, ModelError> {
        Ok(u64::from_le_bytes(self.bytes()?))
    }
    fn string(&mut self) -> Result<String, ModelError> {
        let n = self.u64()? as usize;
        let pos = self.c.position() as usize;
        let buf = self.c.get_ref();
        if pos + n > buf.len() {
            return Err(bad(self.path, "truncated GGUF string"));
        }
        let s = String::from_utf8_lossy(&buf[pos..pos + n]).into_owned();
        self.c.set_position((pos + n) as u64);
        Ok(s)
    }
    fn value(&mut self, t: u32) -> Result<Value, ModelError> {
        Ok(match t {
            0 => Value::U64(self.bytes::<1>()?[0] as u64),
            1 => Value::I64(self.bytes::<1>()?[0] as i8 as i64),
            2 => Value::U64(u16::from_le_bytes(self.bytes()?) as u64),
            3 => Value::I64(i16::from_le_bytes(self.bytes()?) as i64),
            4 => Value::U64(self.u32()? as u64),
            5 => Value::I64(i32::from_le_bytes(self.bytes()?) as i64),
            6 => Value::F64(f32::from_le_bytes(self.bytes()?) as f64),
            7 => Value::Bool(self.bytes::<1>()?[0] != 0),
            8 => Value::Str(self.string()?),
            9 => {
                let at = self.u32()?;
                let n = self.u64()?;
                (0..n).map(|_| self.value(at)).collect::<Result<Vec<_>, _>>().map(Value::Array)?
            }
            10 => Value::U64(self.u64()?),
            11 => Value::I64(i64::from_le_bytes(self.bytes()?)),
            12 => Value::F64(f64::from_le_bytes(self.bytes()?)),
            other => return Err(bad(self.path, format!("unknown GGUF value type {other}"))),
        })
    }
}

impl Gguf {
    /// Reads a whole GGUF file.
    pub fn read(path: &Path) -> Result<Self, ModelError> {
        let data = std::fs::read(path).map_err(|e| ModelError::io(path, e))?;
        let p = path.display().to_string();
        let (metadata, tensors, data_start) = {
            let mut r = Reader { c: Cursor::new(&data), path: &p };
            if &r.bytes::<4>()? != b"GGUF" {
                return Err(bad(&p, "not a GGUF file (bad magic)"));
            }
            let version = r.u32()?;
            if !(2..=3).contains(&version) {
                return Err(bad(&p, format!("GGUF version {version} is not supported (2 or 3)")));
            }
            let n_tensors = r.u64()?;
            let n_kv = r.u64()?;
            let mut metadata = BTreeMap::new();
            for _ in 0..n_kv {
                let k = r.string()?;
                let t = r.u32()?;
                metadata.insert(k, r.value(t)?);
            }
            let mut tensors = Vec::with_capacity(n_tensors as usize);
            for _ in 0..n_tensors {
                let name = r.string()?;
                let nd = r.u32()?;
                let dims = (0..nd).map(|_| r.u64()).collect::<Result<Vec<_>, _>>()?;
                let ggml_type = r.u32()?;
                let offset = r.u64()?;
                tensors.push(TensorInfo { name, dims, ggml_type, offset });
            }
            let align = metadata.get("general.alignment").and_then(Value::as_u64).unwrap_or(32) as usize;
            let pos = r.c.position() as usize;
            (metadata, tensors, pos.div_ceil(align) * align)
        };
        Ok(Self { metadata, tensors, data, data_start, path: p })
    }

    pub fn get(&self, key: &str) -> Result<&Value, ModelError> {
        self.metadata.get(key).ok_or_else(|| bad(&self.path, format!("metadata {key} is missing")))
    }

    fn u64(&self, key: &str) -> Result<u64, ModelError> {
        self.get(key)?.as_u64().ok_or_else(|| bad(&self.path, format!("metadata {key} is not an integer")))
    }

    fn f64(&self, key: &str) -> Result<f64, ModelError> {
        self.get(key)?.as_f64().ok_or_else(|| bad(&self.path, format!("metadata {key} is not a number")))
    }

    fn strings(&self, key: &str) -> Result<Vec<String>, ModelError> {
        match self.get(key)? {
            Value::Array(v) => v
                .iter()
                .map(|x| x.as_str().map(str::to_string).ok_or_else(|| bad(&self.path, format!("{key}: not strings"))))
                .collect(),
            _ => Err(bad(&self.path, format!("metadata {key} is not an array"))),
        }
    }

    /// Dequantizes a tensor to f32 in torch's shape (dims reversed).
    pub fn dequantize(&self, info: &TensorInfo) -> Result<Tensor, ModelError> {
        let n: u64 = info.dims.iter().product();
        let n = n as usize;
        let start = self.data_start + info.offset as usize;
        let (block_bytes, block_elems) = match info.ggml_type {
            GGML_F32 => (4, 1),
            GGML_F16 => (2, 1),
            GGML_Q4_0 => (18, 32),
            GGML_Q4_1 => (20, 32),
            GGML_Q8_0 => (34, 32),
            t => return Err(bad(&self.path, format!("tensor {}: ggml type {t} is not supported", info.name))),
        };
        if !n.is_multiple_of(block_elems) {
            return Err(bad(&self.path, format!("tensor {}: {n} elements is not whole blocks", info.name)));
        }
        let len = n / block_elems * block_bytes;
        let raw = self
            .data
            .get(start..start + len)
            .ok_or_else(|| bad(&self.path, format!("tensor {} runs past the end of the file", info.name)))?;
        let out = dequantize_blocks(info.ggml_type, raw, n);
        let shape: Vec<i64> = info.dims.iter().rev().map(|&d| d as i64).collect();
        Ok(Tensor::from_slice(&out).view(shape.as_slice()))
    }
}

fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

/// Dequantizes `n` values of a supported ggml type.
pub fn dequantize_blocks(ggml_type: u32, raw: &[u8], n: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(n);
    match ggml_type {
        GGML_F32 => out.extend(raw.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))),
        GGML_F16 => out.extend(raw.chunks_exact(2).map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32())),
        GGML_Q4_0 => {
            for b in raw.chunks_exact(18) {
                let d = f16_at(b, 0);
                let q = &b[2..18];
                out.extend(q.iter().map(|&x| d * ((x & 0xF) as f32 - 8.0)));
                out.extend(q.iter().map(|&x| d * ((x >> 4) as f32 - 8.0)));
            }
        }
        GGML_Q4_1 => {
            // Low nibbles are the first 16 weights, high nibbles the next 16.
            for b in raw.chunks_exact(20) {
                let (d, m) = (f16_at(b, 0), f16_at(b, 2));
                let q = &b[4..20];
                out.extend(q.iter().map(|&x| d * (x & 0xF) as f32 + m));
                out.extend(q.iter().map(|&x| d * (x >> 4) as f32 + m));
            }
        }
        GGML_Q8_0 => {
            for b in raw.chunks_exact(34) {
                let d = f16_at(b, 0);
                out.extend(b[2..34].iter().map(|&x| d * (x as i8) as f32));
            }
        }
        _ => unreachable!("checked by the caller"),
    }
    out
}

/// Undoes llama.cpp's row permutation of q/k projections (made for
/// interleaved-pair RoPE) so that `rotate_half` RoPE applies.
pub fn unpermute_qk(w: &Tensor, n_head: i64) -> Tensor {
    let (out, inp) = (w.size()[0], w.size()[1]);
    let head_dim = out / n_head;
    w.reshape([n_head, head_dim / 2, 2, inp]).transpose(1, 2).reshape([out, inp])
}

fn hf_name(gguf: &str) -> Option<String> {
    let direct = match gguf {
        "token_embd.weight" => Some("model.embed_tokens.weight"),
        "output_norm.weight" => Some("model.norm.weight"),
        "output.weight" => Some("lm_head.weight"),
        _ => None,
    };
    if let Some(d) = direct {
        return Some(d.to_string());
    }
    let rest = gguf.strip_prefix("blk.")?;
    let (layer, part) = rest.split_once('.')?;
    let mapped = match part {
        "attn_norm.weight" => "input_layernorm.weight",
        "ffn_norm.weight" => "post_attention_layernorm.weight",
        "attn_q.weight" => "self_attn.q_proj.weight",
        "attn_k.weight" => "self_attn.k_proj.weight",
        "attn_v.weight" => "self_attn.v_proj.weight",
        "attn_output.weight" => "self_attn.o_proj.weight",
        "ffn_gate.weight" => "mlp.gate_proj.weight",
        "ffn_up.weight" => "mlp.up_proj.weight",
        "ffn_down.weight" => "mlp.down_proj.weight",
        _ => return None,
    };
    Some(format!("model.layers.{layer}.{mapped}"))
}

/// Converts a Llama-architecture GGUF into a Hugging Face directory with
/// f32 weights, tokenizer.json and tokenizer_config.json.
pub fn convert_llama_gguf(gguf_path: &Path, out: &Path) -> Result<TargetConfig, ModelError> {
    let g = Gguf::read(gguf_path)?;
    let p = gguf_path.display().to_string();
    let arch = g.get("general.architecture")?.as_str().unwrap_or_default().to_string();
    if arch != "llama" {
        return Err(bad(&p, format!("architecture {arch} is not supported (only llama)")));
    }
    let n_head = g.u64("llama.attention.head_count")? as i64;
    let n_kv = g.u64("llama.attention.head_count_kv").unwrap_or(n_head as u64) as i64;
    let hidden = g.u64("llama.embedding_length")? as i64;
    let has_output = g.tensors.iter().any(|t| t.name == "output.weight");
    let tokens = g.strings("tokenizer.ggml.tokens")?;
    let num_layers = g.u64("llama.block_count")? as i64;
    let config = TargetConfig {
        family: Family::Llama,
        hidden_size: hidden,
        intermediate_size: g.u64("llama.feed_forward_length")? as i64,
        num_layers,
        num_heads: n_head,
        num_kv_heads: n_kv,
        head_dim: hidden / n_head,
        rms_norm_eps: g.f64("llama.attention.layer_norm_rms_epsilon")?,
        rope: dflash_models::rope::RopeConfig::plain(g.f64("llama.rope.freq_base").unwrap_or(10_000.0)),
        vocab_size: tokens.len() as i64,
        tie_word_embeddings: !has_output,
        qkv_bias: false,
        o_bias: false,
        mlp_bias: false,
        qk_norm: false,
        max_position_embeddings: g.u64("llama.context_length").unwrap_or(4096) as i64,
        moe: None,
        quant: None,
        layer_types: TargetConfig::all_attention(num_layers),
        ..TargetConfig::default()
    };
    std::fs::create_dir_all(out).map_err(|e| ModelError::io(out, e))?;
    let mut named = Vec::with_capacity(g.tensors.len());
    let mut meter = crate::meter::Meter::new("dequantize", g.tensors.len() as u64, "tensors");
    for info in &g.tensors {
        meter.add(1, "");
        let Some(name) = hf_name(&info.name) else {
            if info.name == "rope_freqs.weight" {
                return Err(bad(&p, "rope_freqs (RoPE scaling) is not supported"));
            }
            continue;
        };
        let mut t = g.dequantize(info)?;
        if info.name.ends_with("attn_q.weight") {
            t = unpermute_qk(&t, n_head);
        } else if info.name.ends_with("attn_k.weight") {
            t = unpermute_qk(&t, n_kv);
        }
        named.push((name, t.to_kind(Kind::Float)));
    }
    meter.finish();
    write_safetensors(&out.join("model.safetensors"), &named)?;
    let mut json = config.to_hf_json();
    json["bos_token_id"] = g.u64("tokenizer.ggml.bos_token_id").map(serde_json::Value::from).unwrap_or_default();
    json["eos_token_id"] = g.u64("tokenizer.ggml.eos_token_id").map(serde_json::Value::from).unwrap_or_default();
    let cfg_path = out.join("config.json");
    std::fs::write(&cfg_path, serde_json::to_string_pretty(&json).expect("json"))
        .map_err(|e| ModelError::io(&cfg_path, e))?;

    let tok_model = g.get("tokenizer.ggml.model")?.as_str().unwrap_or_default().to_string();
    if tok_model != "gpt2" {
        return Err(bad(&p, format!("tokenizer model {tok_model} is not supported (only byte-level BPE, gpt2)")));
    }
    let merges = g
        .strings("tokenizer.ggml.merges")?
        .into_iter()
        .map(|m| {
            m.split_once(' ')
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .ok_or_else(|| bad(&p, format!("bad merge {m}")))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let types: Vec<u64> = match g.get("tokenizer.ggml.token_type")? {
        Value::Array(v) => v.iter().filter_map(Value::as_u64).collect(),
        _ => Vec::new(),
    };
    // Control (3) and user-defined (4) tokens are matched whole.
    let special_ids: Vec<u32> =
        types.iter().enumerate().filter(|(_, t)| **t == 3 || **t == 4).map(|(i, _)| i as u32).collect();
    let token = |key: &str| -> Result<String, ModelError> {
        let id = g.u64(key)? as usize;
        tokens.get(id).cloned().ok_or_else(|| bad(&p, format!("{key} {id} is outside the vocabulary")))
    };
    let pre = g.get("tokenizer.ggml.pre").ok().and_then(Value::as_str).unwrap_or("default").to_string();
    let spec = dflash_data::BpeSpec {
        tokens: tokens.clone(),
        merges,
        special_ids,
        split_digits: matches!(pre.as_str(), "smollm" | "llama3" | "llama-bpe"),
        bos: token("tokenizer.ggml.bos_token_id")?,
        eos: token("tokenizer.ggml.eos_token_id")?,
        pad: token("tokenizer.ggml.padding_token_id").ok(),
        chat_template: g
            .get("tokenizer.chat_template")?
            .as_str()
            .ok_or_else(|| bad(&p, "tokenizer.chat_template is not a string"))?
            .to_string(),
    };
    dflash_data::write_bpe_tokenizer(out, &spec)
        .map_err(|e| ModelError::Config { path: out.join("tokenizer.json"), message: e.to_string() })?;
    Ok(config)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn q4_1_uses_low_nibbles_first() {
        // d = 0.5, m = -1; byte j holds weights j (low) and j+16 (high).
        let mut b = Vec::new();
        b.extend_from_slice(&f16::from_f32(0.5).to_le_bytes());
        b.extend_from_slice(&f16::from_f32(-1.0).to_le_bytes());
        b.extend((0..16u8).map(|j| (15 - j) << 4 | j));
        let w = dequantize_blocks(GGML_Q4_1, &b, 32);
        assert_eq!(w[0], -1.0);
        assert_eq!(w[3], 0.5 * 3.0 - 1.0);
        assert_eq!(w[16], 0.5 * 15.0 - 1.0);
        assert_eq!(w[31], -1.0);
    }

    #[test]
    fn q8_0_is_scaled_signed_bytes() {
        let mut b = f16::from_f32(0.25).to_le_bytes().to_vec();
        b.extend((0..32).map(|i| (i as i8 - 16) as u8));
        let w = dequantize_blocks(GGML_Q8_0, &b, 32);
        assert_eq!(w[0], -4.0);
        assert_eq!(w[31], 3.75);
    }

    #[test]
    fn unpermute_inverts_the_llama_cpp_permutation() {
        // llama.cpp: w.reshape(n_head, 2, head_dim/2, in).swapaxes(1, 2)
        let (n_head, head_dim, inp) = (3i64, 4i64, 2i64);
        let w = Tensor::arange(n_head * head_dim * inp, (Kind::Float, tch::Device::Cpu)).view([n_head * head_dim, inp]);
        let permuted = w.reshape([n_head, 2, head_dim / 2, inp]).transpose(1, 2).reshape([n_head * head_dim, inp]);
        assert!(unpermute_qk(&permuted, n_head).equal(&w));
    }

    #[test]
    fn names_map_to_hugging_face() {
        assert_eq!(hf_name("blk.7.attn_output.weight").unwrap(), "model.layers.7.self_attn.o_proj.weight");
        assert_eq!(hf_name("token_embd.weight").unwrap(), "model.embed_tokens.weight");
        assert!(hf_name("blk.0.unknown.weight").is_none());
    }
}
