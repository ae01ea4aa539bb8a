//! The frozen target model (Llama, Qwen2, Qwen3 families): packed
//! layer capture for training, and cached forward steps for decoding.

use std::path::Path;

use tch::{Device, Kind, Tensor};

use crate::layers::{Linear, Mlp, RmsNorm, Rope, apply_rope, repeat_kv};
use crate::target_config::{Family, TargetConfig};
use crate::weights::Weights;
use crate::{KvCache, ModelError};

/// How much of the target to load.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LoadScope {
    /// Layers `0..=last_layer` only: enough to capture features. Skips the
    /// final norm, the later layers and (unless tied) the LM head.
    CaptureUpTo { last_layer: i64 },
    /// Everything, for decoding and verification.
    Full,
}

struct Attention {
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    o_proj: Linear,
    q_norm: Option<RmsNorm>,
    k_norm: Option<RmsNorm>,
}

struct DecoderLayer {
    input_layernorm: RmsNorm,
    self_attn: Attention,
    post_attention_layernorm: RmsNorm,
    mlp: Mlp,
}

/// A frozen decoder-only target.
pub struct TargetModel {
    pub config: TargetConfig,
    pub device: Device,
    pub kind: Kind,
    embed_tokens: Tensor,
    layers: Vec<DecoderLayer>,
    norm: Option<RmsNorm>,
    lm_head: Option<Tensor>,
    rope: Rope,
}

fn linear(w: &mut Weights, name: &str, out: i64, inp: i64, bias: bool) -> Result<Linear, ModelError> {
    let weight = w.take(&format!("{name}.weight"), &[out, inp])?;
    let bias = if bias { Some(w.take(&format!("{name}.bias"), &[out])?) } else { None };
    Ok(Linear { weight, bias })
}

fn norm(w: &mut Weights, name: &str, dim: i64, eps: f64) -> Result<RmsNorm, ModelError> {
    Ok(RmsNorm { weight: w.take(&format!("{name}.weight"), &[dim])?, eps })
}

/// Layers to hold for a scope.
fn layers_for(c: &TargetConfig, scope: LoadScope, dir: &Path) -> Result<i64, ModelError> {
    match scope {
        LoadScope::CaptureUpTo { last_layer } if last_layer < 0 || last_layer >= c.num_layers => {
            Err(ModelError::Config {
                path: dir.join("config.json"),
                message: format!("layer {last_layer} requested but the target has {} layers", c.num_layers),
            })
        }
        LoadScope::CaptureUpTo { last_layer } => Ok(last_layer + 1),
        LoadScope::Full => Ok(c.num_layers),
    }
}

/// Layer index of a `model.layers.N.` tensor name.
fn layer_index(name: &str) -> Option<i64> {
    name.strip_prefix("model.layers.")?.split('.').next()?.parse().ok()
}

/// The target's input embedding and LM head (`[vocab, H]` each), without
/// its layers: what a drafter needs from its target.
pub fn load_embeddings(dir: &Path, device: Device, kind: Kind) -> Result<(TargetConfig, Tensor, Tensor), ModelError> {
    let c = TargetConfig::from_dir(dir)?;
    let mut w = Weights::load(dir, device, kind, |n| n == "model.embed_tokens.weight" || n == "lm_head.weight")?;
    let embed = w.take("model.embed_tokens.weight", &[c.vocab_size, c.hidden_size])?;
    let head = match w.take_optional("lm_head.weight", &[c.vocab_size, c.hidden_size])? {
        Some(h) => h,
        None if c.tie_word_embeddings => embed.shallow_clone(),
        None => return Err(ModelError::MissingTensor { dir: dir.to_path_buf(), name: "lm_head.weight".into() }),
    };
    Ok((c, embed, head))
}

/// Hugging Face tensor names and shapes of a target's first `n_layers`
/// layers, plus the embedding and (if `full`) the final norm and head.
pub fn tensor_shapes(c: &TargetConfig, n_layers: i64, full: bool) -> Vec<(String, Vec<i64>)> {
    let (h, hd, i) = (c.hidden_size, c.head_dim, c.intermediate_size);
    let mut v = vec![("model.embed_tokens.weight".to_string(), vec![c.vocab_size, h])];
    for l in 0..n_layers {
        let p = format!("model.layers.{l}");
        let mut add = |n: &str, shape: Vec<i64>| v.push((format!("{p}.{n}"), shape));
        add("input_layernorm.weight", vec![h]);
        add("post_attention_layernorm.weight", vec![h]);
        add("self_attn.q_proj.weight", vec![c.num_heads * hd, h]);
        add("self_attn.k_proj.weight", vec![c.num_kv_heads * hd, h]);
        add("self_attn.v_proj.weight", vec![c.num_kv_heads * hd, h]);
        add("self_attn.o_proj.weight", vec![h, c.num_heads * hd]);
        if c.attention_bias {
            add("self_attn.q_proj.bias", vec![c.num_heads * hd]);
            add("self_attn.k_proj.bias", vec![c.num_kv_heads * hd]);
            add("self_attn.v_proj.bias", vec![c.num_kv_heads * hd]);
        }
        if c.family == Family::Qwen3 {
            add("self_attn.q_norm.weight", vec![hd]);
            add("self_attn.k_norm.weight", vec![hd]);
        }
        add("mlp.gate_proj.weight", vec![i, h]);
        add("mlp.up_proj.weight", vec![i, h]);
        add("mlp.down_proj.weight", vec![h, i]);
    }
    if full {
        v.push(("model.norm.weight".to_string(), vec![h]));
        if !c.tie_word_embeddings {
            v.push(("lm_head.weight".to_string(), vec![c.vocab_size, h]));
        }
    }
    v
}

/// Random weights of the right shapes: norms 1, biases 0, matrices
/// N(0, 0.02), as Hugging Face initialises (for benchmarks and tests).
pub fn random_tensors(shapes: &[(String, Vec<i64>)], device: Device, kind: Kind) -> Vec<(String, Tensor)> {
    let _guard = tch::no_grad_guard();
    shapes
        .iter()
        .map(|(n, shape)| {
            let t = if n.ends_with("norm.weight") {
                Tensor::ones(shape.as_slice(), (kind, device))
            } else if n.ends_with(".bias") {
                Tensor::zeros(shape.as_slice(), (kind, device))
            } else {
                Tensor::randn(shape.as_slice(), (kind, device)) * 0.02
            };
            (n.clone(), t)
        })
        .collect()
}

impl TargetModel {
    /// Loads a model directory onto `device` in `kind`.
    pub fn load(dir: &Path, device: Device, kind: Kind, scope: LoadScope) -> Result<Self, ModelError> {
        let c = TargetConfig::from_dir(dir)?;
        let n_layers = layers_for(&c, scope, dir)?;
        let full = scope == LoadScope::Full;
        let w = Weights::load(dir, device, kind, |name| match layer_index(name) {
            Some(i) => i < n_layers,
            None => full || name == "model.embed_tokens.weight",
        })?;
        Self::from_weights(c, w, scope, device, kind, dir)
    }

    /// A target of shape `c` with random weights, built on the device (no
    /// files): what the throughput benchmarks run.
    pub fn random(c: TargetConfig, device: Device, kind: Kind, scope: LoadScope) -> Result<Self, ModelError> {
        let label = Path::new("<random weights>");
        let n_layers = layers_for(&c, scope, label)?;
        let tensors = random_tensors(&tensor_shapes(&c, n_layers, scope == LoadScope::Full), device, kind);
        Self::from_weights(c, Weights::from_tensors(tensors, label), scope, device, kind, label)
    }

    fn from_weights(
        c: TargetConfig,
        mut w: Weights,
        scope: LoadScope,
        device: Device,
        kind: Kind,
        dir: &Path,
    ) -> Result<Self, ModelError> {
        let n_layers = layers_for(&c, scope, dir)?;
        let full = scope == LoadScope::Full;
        let (h, hd) = (c.hidden_size, c.head_dim);
        let embed_tokens = w.take("model.embed_tokens.weight", &[c.vocab_size, h])?;
        let mut layers = Vec::with_capacity(n_layers as usize);
        for i in 0..n_layers {
            let p = format!("model.layers.{i}");
            let qk_norm = c.family == Family::Qwen3;
            layers.push(DecoderLayer {
                input_layernorm: norm(&mut w, &format!("{p}.input_layernorm"), h, c.rms_norm_eps)?,
                self_attn: Attention {
                    q_proj: linear(&mut w, &format!("{p}.self_attn.q_proj"), c.num_heads * hd, h, c.attention_bias)?,
                    k_proj: linear(&mut w, &format!("{p}.self_attn.k_proj"), c.num_kv_heads * hd, h, c.attention_bias)?,
                    v_proj: linear(&mut w, &format!("{p}.self_attn.v_proj"), c.num_kv_heads * hd, h, c.attention_bias)?,
                    o_proj: linear(&mut w, &format!("{p}.self_attn.o_proj"), h, c.num_heads * hd, false)?,
                    q_norm: if qk_norm {
                        Some(norm(&mut w, &format!("{p}.self_attn.q_norm"), hd, c.rms_norm_eps)?)
                    } else {
                        None
                    },
                    k_norm: if qk_norm {
                        Some(norm(&mut w, &format!("{p}.self_attn.k_norm"), hd, c.rms_norm_eps)?)
                    } else {
                        None
                    },
                },
                post_attention_layernorm: norm(&mut w, &format!("{p}.post_attention_layernorm"), h, c.rms_norm_eps)?,
                mlp: Mlp {
                    gate_proj: linear(&mut w, &format!("{p}.mlp.gate_proj"), c.intermediate_size, h, false)?,
                    up_proj: linear(&mut w, &format!("{p}.mlp.up_proj"), c.intermediate_size, h, false)?,
                    down_proj: linear(&mut w, &format!("{p}.mlp.down_proj"), h, c.intermediate_size, false)?,
                },
            });
        }
        let (norm_f, lm_head) = if full {
            let n = norm(&mut w, "model.norm", h, c.rms_norm_eps)?;
            let head = match w.take_optional("lm_head.weight", &[c.vocab_size, h])? {
                Some(t) => t,
                None if c.tie_word_embeddings => embed_tokens.shallow_clone(),
                None => {
                    return Err(ModelError::MissingTensor { dir: dir.to_path_buf(), name: "lm_head.weight".into() });
                }
            };
            (Some(n), Some(head))
        } else {
            (None, None)
        };
        let unused = w.remaining();
        if !unused.is_empty() {
            tracing::warn!("{} tensors of {} were not used, e.g. {}", unused.len(), dir.display(), unused[0]);
        }
        let rope = Rope::new(hd, c.rope_theta, device);
        Ok(Self { config: c, device, kind, embed_tokens, layers, norm: norm_f, lm_head, rope })
    }

    /// Number of layers held (all of them for [`LoadScope::Full`]).
    pub fn loaded_layers(&self) -> i64 {
        self.layers.len() as i64
    }

    /// The input embedding table `[vocab, H]` (the drafter embeds with it).
    pub fn embed_tokens(&self) -> &Tensor {
        &self.embed_tokens
    }

    /// The output projection `[vocab, H]` (the drafter's logits use it).
    pub fn lm_head(&self) -> Option<&Tensor> {
        self.lm_head.as_ref()
    }

    /// Runs packed sequences (`input_ids` `[T]`, lengths summing to T) up to
    /// the last requested layer and returns the residual stream after each
    /// layer in `layer_ids` (HF `hidden_states[id + 1]`), each `[T, H]`.
    /// Attention is causal within each sequence; positions restart at 0.
    pub fn capture_packed(&self, input_ids: &Tensor, seq_lengths: &[i64], layer_ids: &[i64]) -> Vec<Tensor> {
        let _guard = tch::no_grad_guard();
        let last = *layer_ids.iter().max().expect("at least one captured layer");
        assert!(last < self.loaded_layers(), "layer {last} not loaded");
        let positions = Tensor::cat(
            &seq_lengths.iter().map(|&l| Tensor::arange(l, (Kind::Int64, self.device))).collect::<Vec<_>>(),
            0,
        );
        let (cos, sin) = self.rope.cos_sin(&positions, self.kind);
        let (cos, sin) = (cos.unsqueeze(1), sin.unsqueeze(1));
        let mut x = self.embed_tokens.embedding_for(input_ids);
        let mut captured = Vec::with_capacity(layer_ids.len());
        for (i, layer) in self.layers.iter().enumerate().take(last as usize + 1) {
            x = layer.forward_packed(&x, &cos, &sin, seq_lengths, &self.config, &mut |_| {});
            if layer_ids.contains(&(i as i64)) {
                captured.push(x.shallow_clone());
            }
        }
        captured
    }

    /// Where the time of a packed forward goes: runs the captured layers
    /// with a device synchronization after each stage and returns seconds
    /// per stage summed over layers (for the capture benchmark).
    pub fn profile_packed(&self, input_ids: &Tensor, seq_lengths: &[i64], last_layer: i64) -> Vec<(&'static str, f64)> {
        let _guard = tch::no_grad_guard();
        let sync = || {
            if let Device::Cuda(i) = self.device {
                tch::Cuda::synchronize(i as i64);
            }
        };
        let positions = Tensor::cat(
            &seq_lengths.iter().map(|&l| Tensor::arange(l, (Kind::Int64, self.device))).collect::<Vec<_>>(),
            0,
        );
        let (cos, sin) = self.rope.cos_sin(&positions, self.kind);
        let (cos, sin) = (cos.unsqueeze(1), sin.unsqueeze(1));
        let mut x = self.embed_tokens.embedding_for(input_ids);
        let mut totals: Vec<(&'static str, f64)> = Vec::new();
        sync();
        let mut t = std::time::Instant::now();
        for layer in self.layers.iter().take(last_layer as usize + 1) {
            x = layer.forward_packed(&x, &cos, &sin, seq_lengths, &self.config, &mut |stage| {
                sync();
                let dt = t.elapsed().as_secs_f64();
                match totals.iter_mut().find(|(s, _)| *s == stage) {
                    Some(e) => e.1 += dt,
                    None => totals.push((stage, dt)),
                }
                t = std::time::Instant::now();
            });
        }
        totals
    }

    /// One cached forward step for decoding: `ids` `[B, t]` at `positions`
    /// `[B, t]`; `key_valid` `[B, L + t]` marks real (non-padding) keys over
    /// the cache plus the new tokens. Appends to `cache`. Returns the final
    /// normed hidden states `[B, t, H]` and the residual stream after each
    /// layer in `capture` (each `[B, t, H]`).
    pub fn forward_cached(
        &self,
        ids: &Tensor,
        positions: &Tensor,
        key_valid: &Tensor,
        cache: &mut KvCache,
        capture: &[i64],
    ) -> (Tensor, Vec<Tensor>) {
        let _guard = tch::no_grad_guard();
        let norm = self.norm.as_ref().expect("forward_cached needs a fully loaded target");
        let (cos, sin) = self.rope.cos_sin(positions, self.kind);
        let (cos, sin) = (cos.unsqueeze(2), sin.unsqueeze(2));
        let t = ids.size()[1];
        let past = cache.len();
        // query i (absolute past + i) sees keys j <= past + i that are valid
        let q_idx = Tensor::arange(t, (Kind::Int64, self.device)).unsqueeze(1) + past;
        let k_idx = Tensor::arange(past + t, (Kind::Int64, self.device)).unsqueeze(0);
        let causal = k_idx.le_tensor(&q_idx); // [t, L+t]
        let mask = causal.unsqueeze(0).logical_and(&key_valid.unsqueeze(1)).unsqueeze(1); // [B,1,t,L+t]
        let mut x = self.embed_tokens.embedding_for(ids);
        let mut captured = Vec::with_capacity(capture.len());
        for (i, layer) in self.layers.iter().enumerate() {
            x = layer.forward_cached(&x, &cos, &sin, &mask, cache, i, &self.config);
            if capture.contains(&(i as i64)) {
                captured.push(x.shallow_clone());
            }
        }
        cache.advance(t);
        (norm.forward(&x), captured)
    }

    /// Logits `[.., vocab]` (f32) of final hidden states.
    pub fn logits(&self, hidden: &Tensor) -> Tensor {
        let head = self.lm_head.as_ref().expect("logits need a fully loaded target");
        hidden.linear(head, None::<Tensor>).to_kind(Kind::Float)
    }

    /// A cache sized for `batch` sequences on this model.
    pub fn new_cache(&self, batch: i64) -> KvCache {
        KvCache::new(self.layers.len(), batch)
    }
}

trait EmbeddingFor {
    fn embedding_for(&self, ids: &Tensor) -> Tensor;
}

impl EmbeddingFor for Tensor {
    fn embedding_for(&self, ids: &Tensor) -> Tensor {
        Tensor::embedding(self, ids, -1, false, false)
    }
}

impl Attention {
    /// Projections, QK norm and RoPE. `x` `[.., S, H]` gives q `[.., S, nh, d]`
    /// and k, v `[.., S, kv, d]`; `cos`/`sin` broadcast over heads.
    fn qkv(&self, x: &Tensor, cos: &Tensor, sin: &Tensor, c: &TargetConfig) -> (Tensor, Tensor, Tensor) {
        let mut lead = x.size();
        lead.pop();
        let shape = |heads: i64| [lead.clone(), vec![heads, c.head_dim]].concat();
        let mut q = self.q_proj.forward(x).view(shape(c.num_heads).as_slice());
        let mut k = self.k_proj.forward(x).view(shape(c.num_kv_heads).as_slice());
        let v = self.v_proj.forward(x).view(shape(c.num_kv_heads).as_slice());
        if let (Some(qn), Some(kn)) = (&self.q_norm, &self.k_norm) {
            q = qn.forward(&q);
            k = kn.forward(&k);
        }
        (apply_rope(&q, cos, sin), apply_rope(&k, cos, sin), v)
    }
}

impl DecoderLayer {
    /// `mark(stage)` is called after each stage (profiling; a no-op otherwise).
    fn forward_packed(
        &self,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        lens: &[i64],
        c: &TargetConfig,
        mark: &mut dyn FnMut(&'static str),
    ) -> Tensor {
        let h = self.input_layernorm.forward(x);
        mark("input norm");
        let (q, k, v) = self.self_attn.qkv(&h, cos, sin, c); // [T, heads, d]
        mark("qkv + qk-norm + rope");
        let (qs, ks, vs) = (q.split_with_sizes(lens, 0), k.split_with_sizes(lens, 0), v.split_with_sizes(lens, 0));
        let outs: Vec<Tensor> = qs
            .iter()
            .zip(&ks)
            .zip(&vs)
            .map(|((q, k), v)| {
                let q = q.transpose(0, 1).unsqueeze(0);
                let k = k.transpose(0, 1).unsqueeze(0);
                let v = v.transpose(0, 1).unsqueeze(0);
                // Grouped-query attention inside the (flash) kernel: no copy
                // of the kv heads per query head.
                let o = Tensor::scaled_dot_product_attention(&q, &k, &v, None::<Tensor>, 0.0, true, None, true);
                o.squeeze_dim(0).transpose(0, 1).reshape([-1, c.num_heads * c.head_dim])
            })
            .collect();
        let outs = Tensor::cat(&outs, 0);
        mark("attention");
        let x = x + self.self_attn.o_proj.forward(&outs);
        mark("o_proj + residual");
        let h = self.post_attention_layernorm.forward(&x);
        mark("post norm");
        let y = &x + self.mlp.forward(&h);
        mark("mlp + residual");
        y
    }

    #[allow(clippy::too_many_arguments)]
    fn forward_cached(
        &self,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        mask: &Tensor,
        cache: &mut KvCache,
        layer: usize,
        c: &TargetConfig,
    ) -> Tensor {
        let h = self.input_layernorm.forward(x);
        let (q, k, v) = self.self_attn.qkv(&h, cos, sin, c); // [B, t, heads, d]
        let (k, v) = cache.append(layer, k.transpose(1, 2), v.transpose(1, 2)); // [B, kv, L+t, d]
        let n_rep = c.num_heads / c.num_kv_heads;
        let o = Tensor::scaled_dot_product_attention(
            &q.transpose(1, 2),
            &repeat_kv(&k, n_rep),
            &repeat_kv(&v, n_rep),
            Some(mask),
            0.0,
            false,
            None,
            false,
        );
        let (b, t) = (x.size()[0], x.size()[1]);
        let attn = self.self_attn.o_proj.forward(&o.transpose(1, 2).reshape([b, t, c.num_heads * c.head_dim]));
        let x = x + attn;
        &x + self.mlp.forward(&self.post_attention_layernorm.forward(&x))
    }
}
