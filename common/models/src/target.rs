//! The frozen target model, whatever its family (`zoo/`): packed layer
//! capture for training, and cached forward steps for decoding. This is
//! the one interface the forward loop, decoding (regenerate, eval) and the
//! benchmarks use.

use std::path::Path;

use tch::{Device, Kind, Tensor};

use crate::decoder::DecoderLayer;
use crate::distill::TopK;
use crate::gated_deltanet::PackedLayout;
use crate::layers::RmsNorm;
use crate::rope::Rope;
use crate::target_config::TargetConfig;
use crate::weights::{RandomInit, SkippedTensors, Weights};
use crate::{KvCache, ModelError, zoo};

/// How much of the target to load.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LoadScope {
    /// Layers `0..=last_layer` only: enough to capture features. Skips the
    /// final norm, the later layers and (unless tied) the LM head.
    CaptureUpTo { last_layer: i64 },
    /// Everything, for decoding and verification.
    Full,
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
    /// Bytes of the tensors taken (what the model holds on its device).
    planned_bytes: u64,
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

/// Whether a non-layer tensor is needed for `scope`.
fn keep_outside_layers(name: &str, scope: LoadScope) -> bool {
    scope == LoadScope::Full || name.starts_with("model.embed_tokens.")
}

/// What [`TargetModel::inspect`] finds.
pub struct Inspection {
    pub config: TargetConfig,
    /// Bytes the model takes on its device in the requested kind.
    pub bytes: u64,
    /// Parts of the checkpoint that are not the target, found and not read.
    pub skipped: Vec<SkippedTensors>,
}

/// The target's input embedding and LM head (`[vocab, H]` each), without
/// its layers: what a drafter needs from its target.
pub fn load_embeddings(dir: &Path, device: Device, kind: Kind) -> Result<(TargetConfig, Tensor, Tensor), ModelError> {
    let c = TargetConfig::from_dir(dir)?;
    let keep = |n: &str| n.starts_with("model.embed_tokens.") || n.starts_with("lm_head.");
    let mut w = Weights::load_quantized(dir, &c.tensor_names, device, kind, keep, c.quant.as_ref())?;
    let embed = w.take("model.embed_tokens.weight", &[c.vocab_size, c.hidden_size])?;
    let head = lm_head(&mut w, &c, &embed)?;
    Ok((c, embed, head))
}

/// The LM head: the embedding when the config ties them (a stored head is
/// then ignored, as transformers ignores it), else `lm_head.weight`.
fn lm_head(w: &mut Weights, c: &TargetConfig, embed: &Tensor) -> Result<Tensor, ModelError> {
    if c.tie_word_embeddings {
        w.discard("lm_head.weight");
        Ok(embed.shallow_clone())
    } else {
        w.take("lm_head.weight", &[c.vocab_size, c.hidden_size])
    }
}

impl TargetModel {
    /// Loads a model directory onto `device` in `kind`. Every tensor the
    /// model needs is checked against the files' headers (present, right
    /// shape and dtype, FP8 scales matching) before any is read.
    pub fn load(dir: &Path, device: Device, kind: Kind, scope: LoadScope) -> Result<Self, ModelError> {
        let c = TargetConfig::from_dir(dir)?;
        let n_layers = layers_for(&c, scope, dir)?;
        let keep = |name: &str| match layer_index(name) {
            Some(i) => i < n_layers,
            None => keep_outside_layers(name, scope),
        };
        let mut headers = Weights::headers(dir, &c.tensor_names, kind, &keep, c.quant.as_ref())?;
        Self::from_weights(c.clone(), &mut headers, scope, Device::Cpu, kind, dir)?;
        let mut w = Weights::load_quantized(dir, &c.tensor_names, device, kind, keep, c.quant.as_ref())?;
        Self::from_weights(c, &mut w, scope, device, kind, dir)
    }

    /// What loading `dir` for `scope` would read, without reading it: the
    /// config, the bytes the model takes in `kind` (checked as
    /// [`TargetModel::load`] checks them) and what it would skip.
    pub fn inspect(dir: &Path, kind: Kind, scope: LoadScope) -> Result<Inspection, ModelError> {
        let c = TargetConfig::from_dir(dir)?;
        let n_layers = layers_for(&c, scope, dir)?;
        let keep = |name: &str| match layer_index(name) {
            Some(i) => i < n_layers,
            None => keep_outside_layers(name, scope),
        };
        let mut headers = Weights::headers(dir, &c.tensor_names, kind, &keep, c.quant.as_ref())?;
        let model = Self::from_weights(c.clone(), &mut headers, scope, Device::Cpu, kind, dir)?;
        Ok(Inspection { config: c, bytes: model.planned_bytes, skipped: headers.skipped().to_vec() })
    }

    /// A target of shape `c` with random weights, built on the device (no
    /// files): what the throughput benchmarks run.
    pub fn random(c: TargetConfig, device: Device, kind: Kind, scope: LoadScope) -> Result<Self, ModelError> {
        let mut w = Weights::random(device, kind, RandomInit::HuggingFace);
        Self::from_weights(c, &mut w, scope, device, kind, Path::new("<random weights>"))
    }

    /// Random tensors of a whole model of shape `c`, named and shaped as
    /// its checkpoints are (to write a random target to disk).
    pub fn random_checkpoint(
        c: &TargetConfig,
        device: Device,
        kind: Kind,
        init: RandomInit,
    ) -> Result<Vec<(String, Tensor)>, ModelError> {
        let mut w = Weights::random_recorded(device, kind, init);
        Self::from_weights(c.clone(), &mut w, LoadScope::Full, device, kind, Path::new("<random weights>"))?;
        Ok(w.into_tensors())
    }

    fn from_weights(
        c: TargetConfig,
        w: &mut Weights,
        scope: LoadScope,
        device: Device,
        kind: Kind,
        dir: &Path,
    ) -> Result<Self, ModelError> {
        let n_layers = layers_for(&c, scope, dir)?;
        let arch = zoo::architecture(c.family);
        let embed_tokens = w.take("model.embed_tokens.weight", &[c.vocab_size, c.hidden_size])?;
        let layers = (0..n_layers).map(|i| arch.load_layer(w, &c, i)).collect::<Result<Vec<_>, _>>()?;
        let (norm_f, lm_head) = if scope == LoadScope::Full {
            let n = zoo::norm(w, &c, "model.norm", c.hidden_size)?;
            (Some(n), Some(lm_head(w, &c, &embed_tokens)?))
        } else {
            (None, None)
        };
        let unused = w.remaining();
        if !unused.is_empty() && !w.is_headers() {
            tracing::warn!("{} tensors of {} were not used, e.g. {}", unused.len(), dir.display(), unused[0]);
        }
        let planned_bytes = w.taken_bytes();
        let rope = Rope::from_config(&c.rope, c.head_dim, device);
        if !w.is_headers() {
            for s in w.skipped().iter().filter(|s| s.tensors > 0) {
                tracing::info!(
                    "{}: skipped the {} ({} tensors under {}*, {} bytes): not part of the target",
                    dir.display(),
                    s.part.what,
                    s.tensors,
                    s.part.prefix,
                    s.bytes
                );
            }
        }
        Ok(Self { config: c, device, kind, embed_tokens, layers, norm: norm_f, lm_head, rope, planned_bytes })
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
        let last = *layer_ids.iter().max().expect("at least one captured layer");
        self.run_packed(input_ids, seq_lengths, layer_ids, last).1
    }

    /// [`TargetModel::capture_packed`], then the remaining layers, the final
    /// norm and the LM head: the distillation targets, the `k` most likely
    /// next tokens at every position (needs [`LoadScope::Full`]).
    pub fn capture_packed_with_top_k(
        &self,
        input_ids: &Tensor,
        seq_lengths: &[i64],
        layer_ids: &[i64],
        k: i64,
    ) -> (Vec<Tensor>, TopK) {
        let _guard = tch::no_grad_guard();
        let norm = self.norm.as_ref().expect("distillation targets need a fully loaded target");
        let head = self.lm_head.as_ref().expect("distillation targets need a fully loaded target");
        let (x, captured) = self.run_packed(input_ids, seq_lengths, layer_ids, self.config.num_layers - 1);
        (captured, TopK::of_hidden(&norm.forward(&x), head, k))
    }

    /// Layers `0..=last` over packed sequences: the final residual stream
    /// and the captures of `layer_ids`.
    fn run_packed(
        &self,
        input_ids: &Tensor,
        seq_lengths: &[i64],
        layer_ids: &[i64],
        last: i64,
    ) -> (Tensor, Vec<Tensor>) {
        let _guard = tch::no_grad_guard();
        assert!(last < self.loaded_layers(), "layer {last} not loaded");
        let positions = Tensor::cat(
            &seq_lengths.iter().map(|&l| Tensor::arange(l, (Kind::Int64, self.device))).collect::<Vec<_>>(),
            0,
        );
        let (cos, sin) = self.rope.cos_sin(&positions, self.kind);
        let (cos, sin) = (cos.unsqueeze(1), sin.unsqueeze(1));
        let linear = self.packed_layout(seq_lengths);
        let mut x = self.embed_tokens.embedding_for(input_ids);
        let mut captured = Vec::with_capacity(layer_ids.len());
        for (i, layer) in self.layers.iter().enumerate().take(last as usize + 1) {
            x = layer.forward_packed(&x, &cos, &sin, seq_lengths, linear.as_ref(), &mut |_| {});
            if layer_ids.contains(&(i as i64)) {
                captured.push(x.shallow_clone());
            }
        }
        (x, captured)
    }

    /// The layout of packed sequences for the linear-attention layers (None
    /// without them): made once per batch, shared by every layer.
    fn packed_layout(&self, seq_lengths: &[i64]) -> Option<PackedLayout> {
        let l = self.config.linear_attention.as_ref()?;
        Some(PackedLayout::new(seq_lengths, l.shape.conv_kernel, self.device))
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
        let linear = self.packed_layout(seq_lengths);
        let mut x = self.embed_tokens.embedding_for(input_ids);
        let mut totals: Vec<(&'static str, f64)> = Vec::new();
        sync();
        let mut t = std::time::Instant::now();
        for layer in self.layers.iter().take(last_layer as usize + 1) {
            x = layer.forward_packed(&x, &cos, &sin, seq_lengths, linear.as_ref(), &mut |stage| {
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
        let new_valid = key_valid.narrow(1, past, t);
        let mut x = self.embed_tokens.embedding_for(ids);
        let mut captured = Vec::with_capacity(capture.len());
        for (i, layer) in self.layers.iter().enumerate() {
            x = layer.forward_cached(&x, &cos, &sin, &mask, &new_valid, cache, i);
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
