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
use crate::placement::{Footprint, Placement};
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

/// A frozen decoder-only target, whole on one device or split over
/// several ([`Placement`]): inputs go in and everything comes out on its
/// home device (`device`, the first part's).
pub struct TargetModel {
    pub config: TargetConfig,
    /// The home device: ids in, captured layers, logits and top-k out.
    pub device: Device,
    placement: Placement,
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
    /// Those bytes part by part (embedding, each layer, norm and head), to
    /// plan a split over several devices; no workspace yet.
    pub footprint: Footprint,
    /// Parts of the checkpoint that are not the target, found and not read.
    pub skipped: Vec<SkippedTensors>,
}

/// Where a layer or outside tensor of the checkpoint goes: the index of
/// the part that loads it, None for a tensor not loaded.
fn part_for(name: &str, placement: &Placement, n_layers: i64, scope: LoadScope) -> Option<usize> {
    let last = placement.parts().len() - 1;
    match layer_index(name) {
        Some(i) if i < n_layers => Some(placement.part_of(i)),
        Some(_) => None,
        None if name.starts_with("model.embed_tokens.") => Some(0),
        None if keep_outside_layers(name, scope) => Some(last),
        None => None,
    }
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
        Self::load_placed(dir, &Placement::whole(device, n_layers), kind, scope)
    }

    /// Loads a model directory split as `placement` says (plan it with
    /// [`Placement::plan`] from [`TargetModel::inspect`]'s footprint): each
    /// part reads only its own tensors, onto its own device. Checked
    /// against the headers first, as [`TargetModel::load`].
    pub fn load_placed(dir: &Path, placement: &Placement, kind: Kind, scope: LoadScope) -> Result<Self, ModelError> {
        let c = TargetConfig::from_dir(dir)?;
        let n_layers = layers_for(&c, scope, dir)?;
        let held = placement.parts().last().map_or(0, |p| p.layers.end);
        if held != n_layers {
            return Err(ModelError::Config {
                path: dir.join("config.json"),
                message: format!("the placement holds {held} layers; {n_layers} are to be loaded"),
            });
        }
        let all = |name: &str| part_for(name, placement, n_layers, scope).is_some();
        let mut headers = Weights::headers(dir, &c.tensor_names, kind, &all, c.quant.as_ref())?;
        let whole = Placement::whole(Device::Cpu, n_layers);
        Self::from_weights(c.clone(), std::slice::from_mut(&mut headers), &whole, scope, kind, dir)?;
        let mut parts = Vec::with_capacity(placement.parts().len());
        for (k, part) in placement.parts().iter().enumerate() {
            let mine = |name: &str| part_for(name, placement, n_layers, scope) == Some(k);
            parts.push(Weights::load_quantized(dir, &c.tensor_names, part.device, kind, mine, c.quant.as_ref())?);
        }
        Ok(Self::from_weights(c, &mut parts, placement, scope, kind, dir)?.0)
    }

    /// What loading `dir` for `scope` would read, without reading it: the
    /// config, the bytes the model takes in `kind` (checked as
    /// [`TargetModel::load`] checks them), part by part, and what it would skip.
    pub fn inspect(dir: &Path, kind: Kind, scope: LoadScope) -> Result<Inspection, ModelError> {
        let c = TargetConfig::from_dir(dir)?;
        let n_layers = layers_for(&c, scope, dir)?;
        let whole = Placement::whole(Device::Cpu, n_layers);
        let keep = |name: &str| part_for(name, &whole, n_layers, scope).is_some();
        let mut headers = Weights::headers(dir, &c.tensor_names, kind, &keep, c.quant.as_ref())?;
        let (model, footprint) =
            Self::from_weights(c.clone(), std::slice::from_mut(&mut headers), &whole, scope, kind, dir)?;
        Ok(Inspection { config: c, bytes: model.planned_bytes, footprint, skipped: headers.skipped().to_vec() })
    }

    /// A target of shape `c` with random weights, built on the device (no
    /// files): what the throughput benchmarks run.
    pub fn random(c: TargetConfig, device: Device, kind: Kind, scope: LoadScope) -> Result<Self, ModelError> {
        let n_layers = layers_for(&c, scope, Path::new("<random weights>"))?;
        Self::random_placed(c, &Placement::whole(device, n_layers), kind, scope)
    }

    /// [`TargetModel::random`] split as `placement` says.
    pub fn random_placed(
        c: TargetConfig,
        placement: &Placement,
        kind: Kind,
        scope: LoadScope,
    ) -> Result<Self, ModelError> {
        let mut parts: Vec<Weights> =
            placement.parts().iter().map(|p| Weights::random(p.device, kind, RandomInit::HuggingFace)).collect();
        Ok(Self::from_weights(c, &mut parts, placement, scope, kind, Path::new("<random weights>"))?.0)
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
        let whole = Placement::whole(device, c.num_layers);
        Self::from_weights(
            c.clone(),
            std::slice::from_mut(&mut w),
            &whole,
            LoadScope::Full,
            kind,
            Path::new("<random weights>"),
        )?;
        Ok(w.into_tensors())
    }

    /// Builds the model from one set of weights per part of `placement`
    /// (each on its part's device), and what each piece took.
    fn from_weights(
        c: TargetConfig,
        parts: &mut [Weights],
        placement: &Placement,
        scope: LoadScope,
        kind: Kind,
        dir: &Path,
    ) -> Result<(Self, Footprint), ModelError> {
        let n_layers = layers_for(&c, scope, dir)?;
        let arch = zoo::architecture(c.family);
        let last = parts.len() - 1;
        let mut footprint =
            Footprint { cost: (0..n_layers).map(|i| c.layer_linear_macs(i)).collect(), ..Default::default() };
        let embed_tokens = parts[0].take("model.embed_tokens.weight", &[c.vocab_size, c.hidden_size])?;
        footprint.embed = parts[0].taken_bytes();
        let mut layers = Vec::with_capacity(n_layers as usize);
        for i in 0..n_layers {
            let w = &mut parts[placement.part_of(i)];
            let before = w.taken_bytes();
            layers.push(arch.load_layer(w, &c, i)?);
            footprint.layers.push(w.taken_bytes() - before);
        }
        let (norm_f, lm_head) = if scope == LoadScope::Full {
            let w = &mut parts[last];
            let before = w.taken_bytes();
            let n = zoo::norm(w, &c, "model.norm", c.hidden_size)?;
            // A tied head on another device than the embedding is a copy of it.
            let copy = (c.tie_word_embeddings && placement.last() != placement.home())
                .then(|| embed_tokens.to_device(placement.last()));
            let head = lm_head(w, &c, copy.as_ref().unwrap_or(&embed_tokens))?;
            footprint.tail = w.taken_bytes() - before;
            footprint.tied_head = c.tie_word_embeddings;
            (Some(n), Some(head))
        } else {
            (None, None)
        };
        for w in parts.iter().filter(|w| !w.is_headers()) {
            let unused = w.remaining();
            if !unused.is_empty() {
                tracing::warn!("{} tensors of {} were not used, e.g. {}", unused.len(), dir.display(), unused[0]);
            }
        }
        let planned_bytes = parts.iter().map(Weights::taken_bytes).sum();
        let device = placement.home();
        let rope = Rope::from_config(&c.rope, c.head_dim, device);
        if !parts[0].is_headers() {
            for s in parts[0].skipped().iter().filter(|s| s.tensors > 0) {
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
        let model = Self {
            config: c,
            device,
            placement: placement.clone(),
            kind,
            embed_tokens,
            layers,
            norm: norm_f,
            lm_head,
            rope,
            planned_bytes,
        };
        Ok((model, footprint))
    }

    /// How the layers are split over devices.
    pub fn placement(&self) -> &Placement {
        &self.placement
    }

    /// Number of layers held (all of them for [`LoadScope::Full`]).
    pub fn loaded_layers(&self) -> i64 {
        self.layers.len() as i64
    }

    /// The input embedding table `[vocab, H]` (the drafter embeds with it).
    pub fn embed_tokens(&self) -> &Tensor {
        &self.embed_tokens
    }

    /// The output projection `[vocab, H]` (the drafter's logits use it), on
    /// the last part's device.
    pub fn lm_head(&self) -> Option<&Tensor> {
        self.lm_head.as_ref()
    }

    /// Runs packed sequences (`input_ids` `[T]`, lengths summing to T) up to
    /// the last requested layer and returns the residual stream after each
    /// layer in `layer_ids` (HF `hidden_states[id + 1]`), each `[T, H]`, on
    /// the home device. Attention is causal within each sequence; positions
    /// restart at 0.
    pub fn capture_packed(&self, input_ids: &Tensor, seq_lengths: &[i64], layer_ids: &[i64]) -> Vec<Tensor> {
        self.capture_packed_in_place(input_ids, seq_lengths, layer_ids, 0).0.into_iter().map(|t| self.home(t)).collect()
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
        assert!(k > 0, "the top-k of at least one token");
        let (captured, top) = self.capture_packed_in_place(input_ids, seq_lengths, layer_ids, k);
        let top = top.expect("asked for a top-k");
        let captured = captured.into_iter().map(|t| self.home(t)).collect();
        (captured, TopK { ids: self.home(top.ids), log_probs: self.home(top.log_probs) })
    }

    /// The captures of [`TargetModel::capture_packed`] (and with `top_k` > 0
    /// those of [`TargetModel::capture_packed_with_top_k`]) left on the
    /// device of the part that computed them. Nothing is gathered onto the
    /// home device, so its stream never waits for a later part: a split
    /// instance's first part can take the next batch while the later parts
    /// finish this one (the copies of the residual stream between parts are
    /// the only order between devices). Serving copies each capture to the
    /// host from its own device.
    pub fn capture_packed_in_place(
        &self,
        input_ids: &Tensor,
        seq_lengths: &[i64],
        layer_ids: &[i64],
        top_k: i64,
    ) -> (Vec<Tensor>, Option<TopK>) {
        let _guard = tch::no_grad_guard();
        if top_k == 0 {
            let last = *layer_ids.iter().max().expect("at least one captured layer");
            return (self.run_packed(input_ids, seq_lengths, layer_ids, last).1, None);
        }
        let norm = self.norm.as_ref().expect("distillation targets need a fully loaded target");
        let head = self.lm_head.as_ref().expect("distillation targets need a fully loaded target");
        let (x, captured) = self.run_packed(input_ids, seq_lengths, layer_ids, self.config.num_layers - 1);
        (captured, Some(TopK::of_hidden(&norm.forward(&x), head, top_k)))
    }

    /// A tensor moved to the home device (a no-op where it is).
    fn home(&self, t: Tensor) -> Tensor {
        t.to_device(self.device)
    }

    /// Layers `0..=last` over packed sequences: the final residual stream
    /// (on the device of layer `last`) and the captures of `layer_ids` (each
    /// on the device of its layer).
    fn run_packed(
        &self,
        input_ids: &Tensor,
        seq_lengths: &[i64],
        layer_ids: &[i64],
        last: i64,
    ) -> (Tensor, Vec<Tensor>) {
        self.run_layers(input_ids, seq_lengths, layer_ids, last, &mut |_| {})
    }

    /// Runs layers `0..=last` part by part: the residual stream and the
    /// positions' RoPE tables move from each part's device to the next
    /// (device-to-device copies queued without a host wait), the
    /// linear-attention layout is made once per part; captured layers stay
    /// on the part's device.
    /// `mark(stage)` after each stage of each layer.
    fn run_layers(
        &self,
        input_ids: &Tensor,
        seq_lengths: &[i64],
        layer_ids: &[i64],
        last: i64,
        mark: &mut dyn FnMut(&'static str),
    ) -> (Tensor, Vec<Tensor>) {
        let _guard = tch::no_grad_guard();
        assert!(last < self.loaded_layers(), "layer {last} not loaded");
        let positions = Tensor::cat(
            &seq_lengths.iter().map(|&l| Tensor::arange(l, (Kind::Int64, self.device))).collect::<Vec<_>>(),
            0,
        );
        let (cos, sin) = self.rope.cos_sin(&positions, self.kind);
        let (mut cos, mut sin) = (cos.unsqueeze(1), sin.unsqueeze(1));
        let mut x = self.embed_tokens.embedding_for(input_ids);
        let mut captured = Vec::with_capacity(layer_ids.len());
        for part in self.placement.parts().iter().filter(|p| p.layers.start <= last) {
            let dev = part.device;
            // Everything a part needs comes from the part before it, never
            // from the home device: a copy between devices orders both
            // streams, and one from home would hold part 1 of the next batch
            // behind this part.
            (cos, sin, x) = (cos.to_device(dev), sin.to_device(dev), x.to_device(dev));
            let linear = self.packed_layout(seq_lengths, dev);
            for i in part.layers.start..part.layers.end.min(last + 1) {
                x = self.layers[i as usize].forward_packed(&x, &cos, &sin, seq_lengths, linear.as_ref(), mark);
                if layer_ids.contains(&i) {
                    captured.push(x.shallow_clone());
                }
            }
        }
        (x, captured)
    }

    /// The layout of packed sequences for the linear-attention layers (None
    /// without them) on `device`: made once per batch and part, shared by
    /// its layers.
    fn packed_layout(&self, seq_lengths: &[i64], device: Device) -> Option<PackedLayout> {
        let l = self.config.linear_attention.as_ref()?;
        Some(PackedLayout::new(seq_lengths, l.shape.conv_kernel, device))
    }

    /// Where the time of a packed forward goes: runs the captured layers
    /// with a synchronization of every device after each stage and returns
    /// seconds per stage summed over layers (for the capture benchmark).
    pub fn profile_packed(&self, input_ids: &Tensor, seq_lengths: &[i64], last_layer: i64) -> Vec<(&'static str, f64)> {
        let devices: Vec<Device> = self.placement.parts().iter().map(|p| p.device).collect();
        let sync = || devices.iter().for_each(|&d| crate::perf::sync_device(d));
        let mut totals: Vec<(&'static str, f64)> = Vec::new();
        sync();
        let mut t = std::time::Instant::now();
        let _ = self.run_layers(input_ids, seq_lengths, &[], last_layer, &mut |stage| {
            sync();
            let dt = t.elapsed().as_secs_f64();
            match totals.iter_mut().find(|(s, _)| *s == stage) {
                Some(e) => e.1 += dt,
                None => totals.push((stage, dt)),
            }
            t = std::time::Instant::now();
        });
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
        for part in self.placement.parts() {
            let on = |a: &Tensor| a.to_device(part.device);
            let (cos, sin, mask, new_valid) = (on(&cos), on(&sin), on(&mask), on(&new_valid));
            x = on(&x);
            for i in part.layers.clone() {
                x = self.layers[i as usize].forward_cached(&x, &cos, &sin, &mask, &new_valid, cache, i as usize);
                if capture.contains(&i) {
                    captured.push(x.to_device(self.device));
                }
            }
        }
        cache.advance(t);
        (norm.forward(&x).to_device(self.device), captured)
    }

    /// Logits `[.., vocab]` (f32) of final hidden states (on the home device).
    pub fn logits(&self, hidden: &Tensor) -> Tensor {
        let head = self.lm_head.as_ref().expect("logits need a fully loaded target");
        hidden.to_device(head.device()).linear(head, None::<Tensor>).to_kind(Kind::Float).to_device(self.device)
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
