//! The DFlash drafter: Qwen3-style layers whose
//! keys/values see the target's fused context features ("KV injection"),
//! predicting a block of tokens in one non-causal pass.

use std::path::Path;

use serde::{Deserialize, Serialize};
use tch::nn::{self, Init};
use tch::{Device, Kind, Tensor};

use crate::ModelError;
use crate::blocks::BlockLayout;
use crate::dflash2::{BlockConv, CandidateSelector, Dflash2Config};
use crate::fused_layers;
use crate::layers::{Linear, Mlp, RmsNorm, Rope};
use crate::split_attention::{self, SplitIndex, SplitPlan};
use crate::target_config::TargetConfig;

/// Shape of a drafter; the width follows the target.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DrafterConfig {
    pub hidden_size: i64,
    pub intermediate_size: i64,
    pub num_layers: i64,
    pub num_heads: i64,
    pub num_kv_heads: i64,
    pub head_dim: i64,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub vocab_size: i64,
    pub max_position_embeddings: i64,
    pub block_size: i64,
    pub mask_token_id: i64,
    /// Target layers feeding `fc`, in payload order.
    pub target_layer_ids: Vec<i64>,
    /// Layers of the target (recorded in the exported config).
    pub num_target_layers: i64,
    /// Attention of each layer (empty: every layer full attention).
    #[serde(default)]
    pub layer_types: Vec<LayerType>,
    /// Window of the sliding-attention layers, in positions.
    #[serde(default)]
    pub sliding_window: Option<i64>,
    /// DFlash2's in-block convolutions and candidate selector (None: the
    /// DFlash drafter).
    #[serde(default)]
    pub dflash2: Option<Dflash2Config>,
}

/// How a drafter layer's block slots attend (the `layer_types` of the
/// exported config). A full-attention layer sees the whole context before
/// its anchor and its whole block (non-causal). A sliding-attention layer
/// is what the `dflash` package and transformers' Qwen3 apply: causal over
/// [context; block] and bounded by the window, so the slot at position p
/// sees positions p - window < k <= p.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LayerType {
    FullAttention,
    SlidingAttention,
}

impl LayerType {
    /// The name configs use.
    pub fn name(self) -> &'static str {
        match self {
            LayerType::FullAttention => "full_attention",
            LayerType::SlidingAttention => "sliding_attention",
        }
    }

    pub fn parse(name: &str) -> Option<Self> {
        match name {
            "full_attention" => Some(LayerType::FullAttention),
            "sliding_attention" => Some(LayerType::SlidingAttention),
            _ => None,
        }
    }
}

impl DrafterConfig {
    /// A drafter of `num_layers` layers matching the target's shape.
    pub fn for_target(
        t: &TargetConfig,
        num_layers: i64,
        block_size: i64,
        mask_token_id: i64,
        target_layer_ids: Vec<i64>,
    ) -> Self {
        Self {
            hidden_size: t.hidden_size,
            intermediate_size: t.intermediate_size,
            num_layers,
            num_heads: t.num_heads,
            num_kv_heads: t.num_kv_heads,
            head_dim: t.head_dim,
            rms_norm_eps: t.rms_norm_eps,
            rope_theta: t.rope.theta,
            vocab_size: t.vocab_size,
            max_position_embeddings: t.max_position_embeddings,
            block_size,
            mask_token_id,
            target_layer_ids,
            num_target_layers: t.num_layers,
            layer_types: Vec::new(),
            sliding_window: None,
            dflash2: None,
        }
    }

    /// The attention of layer `i`.
    pub fn layer_type(&self, i: usize) -> LayerType {
        self.layer_types.get(i).copied().unwrap_or(LayerType::FullAttention)
    }

    /// The sliding window, when some layer slides.
    pub fn window(&self) -> Option<i64> {
        let slides = (0..self.num_layers as usize).any(|i| self.layer_type(i) == LayerType::SlidingAttention);
        if slides { self.sliding_window } else { None }
    }

    /// Width of the concatenated target features: k * H.
    pub fn feature_width(&self) -> i64 {
        self.target_layer_ids.len() as i64 * self.hidden_size
    }

    /// Multiply-adds of one drafter forward per query token with `ctx`
    /// context keys, for MFU accounting (x2 for FLOPs, x3 with backward).
    pub fn matmul_macs_per_query(&self, keys_per_query: f64) -> f64 {
        let (h, i) = (self.hidden_size as f64, self.intermediate_size as f64);
        let (qd, kvd) = ((self.num_heads * self.head_dim) as f64, (self.num_kv_heads * self.head_dim) as f64);
        let per_layer = h * qd * 2.0 + h * kvd * 2.0 + 3.0 * h * i + 2.0 * qd * keys_per_query;
        per_layer * self.num_layers as f64
    }
}

pub(crate) struct DrafterAttention {
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    o_proj: Linear,
    q_norm: RmsNorm,
    k_norm: RmsNorm,
}

pub(crate) struct DrafterLayer {
    input_layernorm: RmsNorm,
    self_attn: DrafterAttention,
    post_attention_layernorm: RmsNorm,
    mlp: Mlp,
    /// DFlash2: the convolutions around the attention and the MLP.
    attention_conv: Option<BlockConv>,
    mlp_conv: Option<BlockConv>,
}

/// The trainable drafter. Parameters live in a [`nn::VarStore`] under the
/// exact names of the served checkpoint layout (what vLLM, SGLang and the
/// `dflash` package load).
pub struct Drafter {
    pub config: DrafterConfig,
    pub vs: nn::VarStore,
    fc: Linear,
    hidden_norm: RmsNorm,
    layers: Vec<DrafterLayer>,
    norm: RmsNorm,
    /// DFlash2's selector over each slot's top candidates.
    selector: Option<CandidateSelector>,
    rope: Rope,
    /// Whether training layouts may use the split (mask-free) attention
    /// where the device supports it.
    split_attention: bool,
    /// A half-precision drafter keeps its residual stream and RMSNorms in
    /// f32 (see [`Drafter::set_f32_residual`]).
    f32_residual: bool,
    /// The layer matmuls of the training forward in FP8 (see
    /// [`Drafter::set_fp8_matmuls`]).
    fp8: bool,
}

/// Inputs of one drafter forward over `n` sequences, padded to `S` context
/// tokens and `Q = N*B` block slots.
pub struct DrafterInput<'a> {
    /// Concatenated target features `[n, S, k*H]`.
    pub features: &'a Tensor,
    /// Embedded block tokens `[n, Q, H]` (anchor token, then masks).
    pub block_embeds: &'a Tensor,
    /// RoPE positions of the block slots `[n, Q]` (anchor + slot).
    pub block_positions: &'a Tensor,
    /// Which keys each block slot sees.
    pub attention: BlockAttention<'a>,
}

/// How the block slots' attention is computed.
pub enum BlockAttention<'a> {
    /// Boolean attention masks `[n * G, 1, Q/G, S + Q/G]` (true: may attend)
    /// for G chunks of block slots: `full` for full-attention layers,
    /// `sliding` for sliding-attention ones (needed when any layer slides);
    /// see [`crate::blocks::BlockLayout::attention_mask`].
    Masked { full: &'a Tensor, sliding: Option<&'a Tensor> },
    /// The DFlash mask's keys exactly, without a mask (CUDA, bf16/f16); see
    /// [`crate::split_attention`].
    Split(&'a SplitIndex),
}

fn lin(p: &nn::Path, name: &str, out: i64, inp: i64) -> Linear {
    // Hugging Face's initializer_range for Qwen3 configs.
    let weight = (p / name).var("weight", &[out, inp], Init::Randn { mean: 0.0, stdev: 0.02 });
    Linear { weight, bias: None }
}

fn rms(p: &nn::Path, name: &str, dim: i64, eps: f64) -> RmsNorm {
    RmsNorm { weight: (p / name).var("weight", &[dim], Init::Const(1.0)), eps }
}

impl Drafter {
    /// A freshly initialised drafter in `kind` on `device`.
    pub fn new(config: DrafterConfig, device: Device, kind: Kind) -> Self {
        let mut vs = nn::VarStore::new(device);
        let root = vs.root();
        let c = &config;
        let (h, hd) = (c.hidden_size, c.head_dim);
        let fc = lin(&root, "fc", h, c.feature_width());
        let hidden_norm = rms(&root, "hidden_norm", h, c.rms_norm_eps);
        let layers = (0..c.num_layers)
            .map(|i| {
                let p = root.sub("layers").sub(i.to_string());
                let a = p.sub("self_attn");
                let m = p.sub("mlp");
                DrafterLayer {
                    input_layernorm: rms(&p, "input_layernorm", h, c.rms_norm_eps),
                    self_attn: DrafterAttention {
                        q_proj: lin(&a, "q_proj", c.num_heads * hd, h),
                        k_proj: lin(&a, "k_proj", c.num_kv_heads * hd, h),
                        v_proj: lin(&a, "v_proj", c.num_kv_heads * hd, h),
                        o_proj: lin(&a, "o_proj", h, c.num_heads * hd),
                        q_norm: rms(&a, "q_norm", hd, c.rms_norm_eps),
                        k_norm: rms(&a, "k_norm", hd, c.rms_norm_eps),
                    },
                    post_attention_layernorm: rms(&p, "post_attention_layernorm", h, c.rms_norm_eps),
                    mlp: Mlp {
                        gate_proj: lin(&m, "gate_proj", c.intermediate_size, h),
                        up_proj: lin(&m, "up_proj", c.intermediate_size, h),
                        down_proj: lin(&m, "down_proj", h, c.intermediate_size),
                    },
                    attention_conv: c.dflash2.as_ref().map(|d| BlockConv::new(&p.sub("attention_conv"), h, d)),
                    mlp_conv: c.dflash2.as_ref().map(|d| BlockConv::new(&p.sub("mlp_conv"), h, d)),
                }
            })
            .collect();
        let norm = rms(&root, "norm", h, c.rms_norm_eps);
        let selector =
            c.dflash2.as_ref().map(|d| CandidateSelector::new(&root.sub("candidate_selector"), h, c.vocab_size, d));
        if kind != Kind::Float {
            vs.set_kind(kind);
        }
        let rope = Rope::new(hd, c.rope_theta, device);
        Self {
            config,
            vs,
            fc,
            hidden_norm,
            layers,
            norm,
            selector,
            rope,
            split_attention: true,
            f32_residual: false,
            fp8: false,
        }
    }

    /// Initialises the decoder layers from the target's top layers (drafter
    /// layer i from target layer n - L + i) and the final norm from the
    /// target's. The fusion (`fc`, `hidden_norm`) stays fresh; QK norms the
    /// target lacks (Llama, Qwen2) stay at one. Returns how many tensors came
    /// from the target.
    pub fn init_from_target(&mut self, dir: &Path) -> Result<usize, ModelError> {
        let t = TargetConfig::from_dir(dir)?;
        let (n, l) = (t.num_layers, self.config.num_layers);
        if l > n || t.hidden_size != self.config.hidden_size {
            return Err(ModelError::Config {
                path: dir.join("config.json"),
                message: format!(
                    "a {l}-layer drafter of width {} cannot start from this target",
                    self.config.hidden_size
                ),
            });
        }
        if t.is_hybrid() || t.attn_output_gate || t.norm != crate::target_config::NormStyle::Plain {
            // Its top layers are not the drafter's kind of layer (linear
            // attention, gated queries, zero-centred norm scales).
            return Err(ModelError::Config {
                path: dir.join("config.json"),
                message: format!(
                    "drafter.init_from_target_layers: a {:?} target's layers are not Qwen3 decoder layers; \
                     start the drafter from random weights",
                    t.family
                ),
            });
        }
        let mut map = std::collections::HashMap::new();
        map.insert("model.norm.weight".to_string(), "norm.weight".to_string());
        for i in 0..l {
            let j = n - l + i;
            for part in [
                "input_layernorm.weight",
                "post_attention_layernorm.weight",
                "self_attn.q_proj.weight",
                "self_attn.k_proj.weight",
                "self_attn.v_proj.weight",
                "self_attn.o_proj.weight",
                "self_attn.q_norm.weight",
                "self_attn.k_norm.weight",
                "mlp.gate_proj.weight",
                "mlp.up_proj.weight",
                "mlp.down_proj.weight",
            ] {
                map.insert(format!("model.layers.{j}.{part}"), format!("layers.{i}.{part}"));
            }
        }
        let kind = self.kind();
        let w = crate::weights::Weights::load_quantized(
            dir,
            &t.tensor_names,
            self.device(),
            kind,
            |name| map.contains_key(name) || name.strip_suffix("_scale_inv").is_some_and(|w| map.contains_key(w)),
            t.quant.as_ref(),
        )?;
        let vars = self.vs.variables();
        let _guard = tch::no_grad_guard();
        let mut copied = 0;
        for (src_name, src) in w.into_tensors() {
            let dst_name = &map[&src_name];
            let mut dst = vars[dst_name].shallow_clone();
            if dst.size() != src.size() {
                return Err(ModelError::Weights {
                    path: dir.to_path_buf(),
                    message: format!(
                        "{src_name} has shape {:?}, drafter {dst_name} needs {:?}",
                        src.size(),
                        dst.size()
                    ),
                });
            }
            dst.copy_(&src);
            copied += 1;
        }
        Ok(copied)
    }

    /// Loads weights saved in the served layout (`model.safetensors`, bf16).
    pub fn load_weights(&mut self, dir: &Path) -> Result<(), ModelError> {
        self.load_named(&dir.join("model.safetensors"), "")
    }

    /// Loads the exact fp32 master weights of a training checkpoint
    /// (`optimizer.safetensors`), not their bf16 export.
    pub fn load_master_weights(&mut self, dir: &Path) -> Result<(), ModelError> {
        self.load_named(&dir.join("optimizer.safetensors"), "master.")
    }

    fn load_named(&mut self, file: &Path, prefix: &str) -> Result<(), ModelError> {
        let dir = file.parent().unwrap_or(Path::new("."));
        let tensors = Tensor::read_safetensors(file)
            .map_err(|e| ModelError::Weights { path: file.to_path_buf(), message: e.to_string() })?;
        let mut by_name: std::collections::HashMap<String, Tensor> = tensors
            .into_iter()
            .filter_map(|(n, t)| n.strip_prefix(prefix).map(|n| (n.to_string(), t)))
            .filter(|(n, _)| prefix.is_empty() || !n.contains("exp_avg"))
            .collect();
        let _guard = tch::no_grad_guard();
        for (name, mut var) in self.vs.variables() {
            let src = by_name
                .remove(&name)
                .ok_or_else(|| ModelError::MissingTensor { dir: dir.to_path_buf(), name: name.clone() })?;
            if src.size() != var.size() {
                return Err(ModelError::Weights {
                    path: file.to_path_buf(),
                    message: format!("{name} has shape {:?}, the drafter needs {:?}", src.size(), var.size()),
                });
            }
            var.copy_(&src.to_kind(var.kind()).to_device(var.device()));
        }
        if let Some(extra) = by_name.keys().next() {
            return Err(ModelError::Weights {
                path: file.to_path_buf(),
                message: format!("unexpected tensor {extra} (is this a drafter of another shape?)"),
            });
        }
        Ok(())
    }

    pub fn device(&self) -> Device {
        self.vs.device()
    }

    pub fn kind(&self) -> Kind {
        self.fc.weight.kind()
    }

    /// Trainable parameters by name, sorted.
    pub fn named_parameters(&self) -> Vec<(String, Tensor)> {
        let mut v: Vec<(String, Tensor)> = self.vs.variables().into_iter().collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    }

    /// DFlash2's candidate selector (None for a DFlash drafter).
    pub fn selector(&self) -> Option<&CandidateSelector> {
        self.selector.as_ref()
    }

    /// The tokens the drafter proposes for blocks whose drafted slots have
    /// the final hidden states `hidden` `[N, B-1, H]` and the logits
    /// `logits` `[N, B-1, V]`, anchored at the tokens `anchors` `[N]`: the
    /// top logit of each slot (DFlash), or the selector's walk (DFlash2).
    pub fn propose(&self, hidden: &Tensor, logits: &Tensor, anchors: &Tensor) -> Tensor {
        match &self.selector {
            None => logits.argmax(-1, false),
            Some(s) => s.walk(hidden, logits, anchors),
        }
    }

    /// Fuses the target features: `hidden_norm(fc(features))`.
    pub fn context(&self, features: &Tensor) -> Tensor {
        self.hidden_norm.forward(&project(&self.fc, features, self.fp8))
    }

    /// Final-normed hidden states of the block slots, `[n, Q, H]`.
    pub fn forward(&self, input: &DrafterInput) -> Tensor {
        let ctx = self.context(input.features);
        self.forward_with_context(&ctx, input)
    }

    /// Forward over the blocks of `layout`, their tokens embedded with the
    /// target's `embed`; `features` is `[n, S, k*H]`, S the layout's
    /// context length. The training step and the acceptance check share it.
    /// On CUDA in bf16/f16 (flash head sizes) the blocks attend by [`crate::split_attention`]
    /// (unless turned off); elsewhere by the chunked mask.
    pub fn forward_layout(&self, features: &Tensor, embed: &Tensor, layout: &BlockLayout) -> Tensor {
        let dev = self.device();
        let (n, q_len) = (layout.n as i64, (layout.blocks * layout.block_size) as i64);
        let ids = crate::cuda::upload(&Tensor::from_slice(&layout.block_ids).view([n, q_len]), dev);
        let positions = crate::cuda::upload(&Tensor::from_slice(&layout.block_positions).view([n, q_len]), dev);
        let block_embeds = Tensor::embedding(embed, &ids, -1, false, false);
        let input =
            |attention| DrafterInput { features, block_embeds: &block_embeds, block_positions: &positions, attention };
        if self.uses_split_attention() {
            self.forward(&input(BlockAttention::Split(&SplitPlan::new(layout).to_device(dev))))
        } else {
            let sliding = self.config.window().map(|w| layout.sliding_attention_mask(dev, w));
            self.forward(&input(BlockAttention::Masked {
                full: &layout.attention_mask(dev),
                sliding: sliding.as_ref(),
            }))
        }
    }

    /// Turns the split (mask-free) block attention on or off (on by default;
    /// it only ever applies where [`split_attention::supported`] says so).
    /// Off, every device uses the chunked mask: for comparisons.
    pub fn set_split_attention(&mut self, on: bool) {
        self.split_attention = on;
    }

    /// Keeps the residual stream between the layers, and the RMSNorms that
    /// read it, in f32 while the weights, matmuls and attention stay in the
    /// drafter's half precision: what a PyTorch trainer under bf16 autocast
    /// computes. A bf16 residual stream rounds every layer's sum to 8 bits
    /// of mantissa; the outputs still come back in the drafter's kind. No
    /// effect on a drafter in f32 or f64.
    pub fn set_f32_residual(&mut self, on: bool) {
        self.f32_residual = on;
    }

    /// Runs the layer matmuls (the projections, the MLPs and the fusion
    /// `fc`) of the training forward and backward in FP8 ([`crate::fp8`]);
    /// attention, norms, the LM head and every forward without autograd
    /// stay in the drafter's kind. Refused, naming why, off a GPU of compute
    /// capability 8.9 or newer or for a drafter not in bf16/f16.
    pub fn set_fp8_matmuls(&mut self, on: bool) -> Result<(), ModelError> {
        if on {
            crate::fp8::check_supported(self.device(), self.kind())?;
        }
        self.fp8 = on;
        Ok(())
    }

    /// The kind of the residual stream between layers.
    fn residual_kind(&self) -> Kind {
        match self.kind() {
            Kind::BFloat16 | Kind::Half if self.f32_residual => Kind::Float,
            k => k,
        }
    }

    /// Whether [`Drafter::forward_layout`] attends by the split attention
    /// here. Not with sliding-attention layers: the split attention's
    /// mask-free calls cannot bound each slot's window, so those drafters
    /// train with the chunked mask on every device.
    pub fn uses_split_attention(&self) -> bool {
        self.split_attention
            && self.config.window().is_none()
            && split_attention::supported(self.device(), self.kind(), self.config.head_dim)
    }

    /// Like [`Drafter::forward`] with the fused context `[n, S, H]` given.
    pub fn forward_with_context(&self, ctx: &Tensor, input: &DrafterInput) -> Tensor {
        let kind = self.kind();
        let s = ctx.size()[1];
        let ctx_pos = Tensor::arange(s, (Kind::Int64, self.device()));
        let (cc, cs) = self.rope.cos_sin(&ctx_pos, kind); // [S, d]
        let (bc, bs) = self.rope.cos_sin(input.block_positions, kind); // [n, Q, d]
        let rope = RopeTables {
            ctx_cos: cc.unsqueeze(1),
            ctx_sin: cs.unsqueeze(1),
            blk_cos: bc.unsqueeze(2),
            blk_sin: bs.unsqueeze(2),
        };
        let pass = LayerPass { ctx, rope: &rope, attn: &input.attention, config: &self.config, fp8: self.fp8 };
        let mut x = input.block_embeds.to_kind(self.residual_kind());
        for (i, layer) in self.layers.iter().enumerate() {
            x = layer.forward(&x, &pass, self.config.layer_type(i));
        }
        self.norm.forward_to(&x, kind)
    }
}

struct RopeTables {
    ctx_cos: Tensor,
    ctx_sin: Tensor,
    blk_cos: Tensor,
    blk_sin: Tensor,
}

/// What every layer of one forward shares: the fused context, the RoPE
/// tables, the attention plan, the shape and the matmul precision.
struct LayerPass<'a> {
    ctx: &'a Tensor,
    rope: &'a RopeTables,
    attn: &'a BlockAttention<'a>,
    config: &'a DrafterConfig,
    fp8: bool,
}

impl DrafterLayer {
    fn forward(&self, x: &Tensor, pass: &LayerPass, layer_type: LayerType) -> Tensor {
        let (ctx, rope, attn, c, fp8) = (pass.ctx, pass.rope, pass.attn, pass.config, pass.fp8);
        let a = &self.self_attn;
        let (n, q_len, s) = (x.size()[0], x.size()[1], ctx.size()[1]);
        let (nh, kv, d) = (c.num_heads, c.num_kv_heads, c.head_dim);
        let block = c.block_size;
        // The residual stream `x` may be f32 (`f32_residual`); the norms
        // hand the sublayers their input in the weights' kind.
        let kind = a.q_proj.weight.kind();
        let xn = self.input_layernorm.forward_to(x, kind);
        let (xn, attention_dynamic) = match &self.attention_conv {
            Some(conv) => {
                let (y, dynamic) = conv.prepare(&xn, block);
                (y, Some(dynamic))
            }
            None => (xn, None),
        };
        // The split attention takes the query heads group-major (head
        // g*kv + j reads kv head j; see split_attention): q_proj's rows and
        // o_proj's columns are reordered here, a copy of two weights, so that
        // the queries, the outputs and their gradients need none (with one
        // query head per kv head the order is already that).
        let split = matches!(attn, BlockAttention::Split(_));
        let reordered = (split && nh != kv).then(|| group_major(a, kv, nh / kv));
        let (q_proj, o_proj) = reordered.as_ref().map_or((&a.q_proj, &a.o_proj), |(q, o)| (q, o));
        // Queries come from the block only; keys/values from the context and
        // the block through the SAME projections.
        let [q, kb, vb] = project_many([q_proj, &a.k_proj, &a.v_proj], &xn, fp8);
        let [kc, vc] = project_many([&a.k_proj, &a.v_proj], ctx, fp8);
        let q = fused_layers::norm_rope(&q.view([n, q_len, nh, d]), &a.q_norm, &rope.blk_cos, &rope.blk_sin);
        let kc = fused_layers::norm_rope(&kc.view([n, s, kv, d]), &a.k_norm, &rope.ctx_cos, &rope.ctx_sin);
        let kb = fused_layers::norm_rope(&kb.view([n, q_len, kv, d]), &a.k_norm, &rope.blk_cos, &rope.blk_sin);
        let vc = vc.view([n, s, kv, d]);
        let vb = vb.view([n, q_len, kv, d]);
        let o = match attn {
            BlockAttention::Masked { full, sliding } => {
                let mask = match (layer_type, sliding) {
                    (LayerType::FullAttention, _) => full,
                    (LayerType::SlidingAttention, Some(m)) => m,
                    (LayerType::SlidingAttention, None) => panic!("a sliding-attention layer without its mask"),
                };
                // G chunks of CB query slots each: keys of a chunk are the
                // whole context followed by the chunk's own slots.
                let g = mask.size()[0] / n;
                let cb = q_len / g;
                let q = q.view([n * g, cb, nh, d]).transpose(1, 2);
                let keys = |ctx_part: &Tensor, blk_part: &Tensor| {
                    let ctx_part = if g == 1 {
                        ctx_part.shallow_clone()
                    } else {
                        ctx_part.unsqueeze(1).expand([n, g, s, kv, d], false).reshape([n * g, s, kv, d])
                    };
                    Tensor::cat(&[ctx_part, blk_part.view([n * g, cb, kv, d])], 1).transpose(1, 2)
                };
                let (k, v) = (keys(&kc, &kb), keys(&vc, &vb));
                // Grouped-query attention in the kernel (enable_gqa): the kv
                // heads are not copied num_heads / num_kv_heads times first.
                let o = Tensor::scaled_dot_product_attention(&q, &k, &v, Some(*mask), 0.0, false, None, true);
                o.transpose(1, 2).reshape([n, q_len, nh * d])
            }
            BlockAttention::Split(index) => {
                assert!(layer_type == LayerType::FullAttention, "the split attention has no sliding window");
                let flat = |t: &Tensor, rows: i64, heads: i64| t.reshape([rows, heads, d]);
                let o = split_attention::split_attention(
                    &flat(&q, n * q_len, nh),
                    &flat(&kc, n * s, kv),
                    &flat(&vc, n * s, kv),
                    &flat(&kb, n * q_len, kv),
                    &flat(&vb, n * q_len, kv),
                    index,
                    1.0 / (d as f64).sqrt(),
                )
                .unwrap_or_else(|e| panic!("drafter attention: {e}"));
                o.view([n, q_len, nh * d])
            }
        };
        let attended = project(o_proj, &o, fp8);
        let attended = match (&self.attention_conv, &attention_dynamic) {
            (Some(conv), Some(dynamic)) => conv.finish(&attended, dynamic, block),
            _ => attended,
        };
        let x = x + attended.to_kind(x.kind());
        let xn = self.post_attention_layernorm.forward_to(&x, kind);
        let mlp = match &self.mlp_conv {
            Some(conv) => {
                let (y, dynamic) = conv.prepare(&xn, block);
                conv.finish(&self.mlp_forward(&y, fp8), &dynamic, block)
            }
            None => self.mlp_forward(&xn, fp8),
        };
        &x + mlp.to_kind(x.kind())
    }

    /// The SwiGLU MLP, its three matmuls in FP8 when `fp8`.
    fn mlp_forward(&self, x: &Tensor, fp8: bool) -> Tensor {
        let m = &self.mlp;
        let [gate, up] = project_many([&m.gate_proj, &m.up_proj], x, fp8);
        project(&m.down_proj, &fused_layers::swiglu(&gate, &up), fp8)
    }
}

/// `q_proj` and `o_proj` of `a` with the query heads in group-major order:
/// head g*kv + j of the result is head j*G + g of the model (G = `groups`
/// query heads per kv head), q_proj's output rows and o_proj's input
/// columns moved together, so the attention computes the same function.
fn group_major(a: &DrafterAttention, kv: i64, groups: i64) -> (Linear, Linear) {
    // [kv, G, rest] -> [G, kv, rest] over the head dimension of `t`.
    let swap = |t: &Tensor, dim: i64| {
        let sizes = t.size();
        let mut split = sizes[..dim as usize].to_vec();
        split.extend([kv, groups, -1]);
        t.reshape(&split[..]).transpose(dim, dim + 1).reshape(&sizes[..])
    };
    let q = Linear { weight: swap(&a.q_proj.weight, 0), bias: a.q_proj.bias.as_ref().map(|b| swap(b, 0)) };
    let o = Linear { weight: swap(&a.o_proj.weight, 1), bias: a.o_proj.bias.as_ref().map(Tensor::shallow_clone) };
    (q, o)
}

/// The projections `ls` of one input `x`: in FP8 one matmul over their
/// weights stacked (the input cast once for all of them, a wider matmul),
/// split after; otherwise one [`Linear::forward`] each, as ever.
fn project_many<const N: usize>(ls: [&Linear; N], x: &Tensor, fp8: bool) -> [Tensor; N] {
    if !fp8 || ls.iter().any(|l| l.bias.is_some()) {
        return ls.map(|l| l.forward(x));
    }
    let weights: Vec<&Tensor> = ls.iter().map(|l| &l.weight).collect();
    let sizes: Vec<i64> = ls.iter().map(|l| l.weight.size()[0]).collect();
    let y = crate::fp8::linear(x, &Tensor::cat(&weights, 0));
    y.split_with_sizes(&sizes, -1).try_into().unwrap_or_else(|v: Vec<Tensor>| panic!("{} parts, not {N}", v.len()))
}

/// `x w^T` of a bias-free drafter projection: FP8 ([`crate::fp8::linear`])
/// when `fp8`, else [`Linear::forward`].
fn project(l: &Linear, x: &Tensor, fp8: bool) -> Tensor {
    if fp8 && l.bias.is_none() { crate::fp8::linear(x, &l.weight) } else { l.forward(x) }
}
