//! `dflash-target inspect`: what a model directory resolves to, checked
//! before a long run -- architecture, shape, each layer's kind, RoPE,
//! experts, quantization, parameters, the memory it needs, the parts of the
//! checkpoint that are not read, the default captured layers -- and,
//! with `--ids`, the logits of every position and the residual stream after
//! chosen layers (Hugging Face `hidden_states[id + 1]`) for those tokens,
//! in f32, as JSON a test or a user compares with transformers.

use std::path::PathBuf;

use anyhow::Context;
use dflash_models::placement::{self, Footprint, Placement};
use dflash_models::target_config::NormStyle;
use dflash_models::{Inspection, LayerKind, LoadScope, TargetConfig, TargetModel};
use tch::{Device, Kind, Tensor};

use dflash_config::ComputeDtype;
use dflash_models::features::kind_of;
use dflash_wire::DType;

#[derive(clap::Args, Debug)]
pub struct InspectArgs {
    /// Hugging Face model directory (config.json, *.safetensors), or a repo
    /// id ORG/NAME[@REVISION] in the Hugging Face cache.
    #[arg(long, value_parser = dflash_config::hub::resolve_model_dir)]
    pub model: PathBuf,
    /// Token ids to run (comma-separated); without them nothing is loaded.
    #[arg(long, value_delimiter = ',')]
    pub ids: Vec<i64>,
    /// Decoder layers whose output to write (default: every layer).
    #[arg(long, value_delimiter = ',')]
    pub layers: Vec<i64>,
    /// Write `{"architecture", "ids", "logits", "layers"}` here.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// "cpu" or a GPU index to run `--ids` on.
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// Target device groups as `devices.target` names them ("0-1",
    /// "0-3,4", "cpu,cpu"): print how each instance's layers and memory
    /// split over its devices (and run `--ids` on the first).
    #[arg(long, conflicts_with = "device")]
    pub devices: Option<dflash_config::TargetDevices>,
    /// Tokens per batch (`pipeline.token_budget`), for the activations
    /// each device of a `--devices` layout must hold.
    #[arg(long, default_value_t = 12288)]
    pub tokens: u64,
    /// Compute dtype (auto: bf16 on GPUs, f32 on CPUs).
    #[arg(long, value_enum, default_value_t = ComputeDtype::F32)]
    pub dtype: ComputeDtype,
    /// Drafter layers, for the default captured layer ids shown.
    #[arg(long, default_value_t = 5)]
    pub drafter_layers: u32,
}

#[derive(serde::Serialize)]
struct Outputs {
    architecture: String,
    ids: Vec<i64>,
    logits: Vec<Vec<f32>>,
    layers: std::collections::BTreeMap<String, Vec<Vec<f32>>>,
}

/// Bytes in the largest binary unit that keeps a whole number in front.
fn bytes(n: u64) -> String {
    let units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < units.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 { format!("{n} B") } else { format!("{v:.2} {}", units[u]) }
}

/// A count with an SI suffix (parameters).
fn count(n: f64) -> String {
    match n {
        n if n >= 1e9 => format!("{:.2} B", n / 1e9),
        n if n >= 1e6 => format!("{:.2} M", n / 1e6),
        n if n >= 1e3 => format!("{:.1} K", n / 1e3),
        n => format!("{n:.0}"),
    }
}

pub fn run(a: &InspectArgs) -> anyhow::Result<()> {
    let device = match (&a.devices, a.device.as_str()) {
        (Some(groups), _) => {
            let first = &groups.instances()[0].devices()[0];
            if !groups.is_cpu() {
                dflash_models::cuda::ensure_cuda(&groups.cuda_indices())?;
            }
            dflash_models::cuda::torch_device(first)
        }
        (None, "cpu") => Device::Cpu,
        (None, i) => dflash_models::cuda::tch_device(Some(i.parse().context("--device: cpu or a GPU index")?))?,
    };
    let kind = kind_of(DType::compute(a.dtype, device.is_cuda()));
    let Inspection { config: c, bytes: full_bytes, footprint: full, skipped } =
        TargetModel::inspect(&a.model, kind, LoadScope::Full)?;
    let mut capture_ids = dflash_config::default_target_layer_ids(c.num_layers as u32, a.drafter_layers);
    capture_ids.sort_unstable();
    capture_ids.dedup();
    let last = *capture_ids.iter().max().context("no captured layers")? as i64;
    let capture = TargetModel::inspect(&a.model, kind, LoadScope::CaptureUpTo { last_layer: last })?;
    let capture_bytes = capture.bytes;
    print!("{}", describe(&a.model, &c));
    for s in &skipped {
        let found = if s.tensors == 0 {
            "none in this checkpoint".to_string()
        } else {
            format!("{} tensors, {} (not read)", s.tensors, bytes(s.bytes))
        };
        println!("  {:<18} {} ({}*): {found}", "skipped:", s.part.what, s.part.prefix);
    }
    println!(
        "  {:<18} {} for the whole model, {} to capture up to layer {last} ({kind:?})",
        "memory:",
        bytes(full_bytes),
        bytes(capture_bytes)
    );
    let kinds: Vec<&str> = capture_ids.iter().map(|&i| kind_name(c.layer_kind(i as i64))).collect();
    if c.is_hybrid() {
        println!(
            "  {:<18} {capture_ids:?} ({}; for {} drafter layers)",
            "captured layers:",
            kinds.join(", "),
            a.drafter_layers
        );
    } else {
        println!("  {:<18} {capture_ids:?} (for {} drafter layers)", "captured layers:", a.drafter_layers);
    }
    let placed = match &a.devices {
        Some(groups) => Some(print_layouts(a, groups, &c, capture.footprint, &capture_ids, last, kind, &full)?),
        None => None,
    };
    if a.ids.is_empty() {
        if a.json.is_some() {
            anyhow::bail!("--json needs --ids: the token ids to run");
        }
        return Ok(());
    }
    if let Some(&bad) = a.ids.iter().find(|&&i| i < 0 || i >= c.vocab_size) {
        anyhow::bail!("--ids: token {bad} is outside the vocabulary (0..{})", c.vocab_size);
    }
    let layers: Vec<i64> = if a.layers.is_empty() { (0..c.num_layers).collect() } else { a.layers.clone() };
    if let Some(&bad) = layers.iter().find(|&&l| l < 0 || l >= c.num_layers) {
        anyhow::bail!("--layers: layer {bad} does not exist ({} layers)", c.num_layers);
    }
    let model = match &placed {
        Some(plan) => TargetModel::load_placed(&a.model, plan, kind, LoadScope::Full)?,
        None => TargetModel::load(&a.model, device, kind, LoadScope::Full)?,
    };
    let n = a.ids.len() as i64;
    let ids = Tensor::from_slice(&a.ids).view([1, n]).to_device(device);
    let positions = Tensor::arange(n, (Kind::Int64, device)).unsqueeze(0);
    let valid = Tensor::ones([1, n], (Kind::Bool, device));
    let mut cache = model.new_cache(1);
    let (hidden, captured) = model.forward_cached(&ids, &positions, &valid, &mut cache, &layers);
    let rows = |t: &Tensor| -> anyhow::Result<Vec<Vec<f32>>> {
        let t = t.squeeze_dim(0).to_kind(Kind::Float).to_device(Device::Cpu);
        Ok(Vec::<Vec<f32>>::try_from(t)?)
    };
    let logits = rows(&model.logits(&hidden))?;
    let finite = logits.iter().flatten().all(|v| v.is_finite());
    let last_row = logits.last().context("no positions")?;
    let argmax = last_row.iter().enumerate().max_by(|x, y| x.1.total_cmp(y.1)).map_or(0, |(i, _)| i);
    let on: Vec<String> = model.placement().parts().iter().map(|p| format!("{:?}", p.device)).collect();
    println!("  ran {n} tokens on {}: logits finite {finite}, next token after the last id: {argmax}", on.join(" + "));
    if let Some(path) = &a.json {
        // capture order follows the model's layers: map them back by id.
        let mut sorted = layers.clone();
        sorted.sort_unstable();
        sorted.dedup();
        let mut out =
            Outputs { architecture: zoo_name(&c).to_string(), ids: a.ids.clone(), logits, layers: Default::default() };
        for (id, t) in sorted.iter().zip(&captured) {
            out.layers.insert(id.to_string(), rows(t)?);
        }
        let text = serde_json::to_string(&out)?;
        std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))?;
        println!("  wrote {}", path.display());
    }
    Ok(())
}

/// Prints how each instance of `groups` splits the model to capture up to
/// layer `last` (`captured` layers, `a.tokens` a batch) over its devices,
/// each part holding the captures of its own layers,
/// against their free memory; a layout that does not fit is an error.
/// Returns the whole model's placement on the first group (for `--ids`).
#[allow(clippy::too_many_arguments)]
fn print_layouts(
    a: &InspectArgs,
    groups: &dflash_config::TargetDevices,
    c: &TargetConfig,
    mut f: Footprint,
    captured: &[u32],
    last: i64,
    kind: Kind,
    full: &Footprint,
) -> anyhow::Result<Placement> {
    let elem = kind.elt_size_in_bytes() as u64;
    f.workspace = placement::workspace_bytes(c, a.tokens, elem, false);
    // As serve counts them at the default postprocess depth: three batches.
    let ids: Vec<i64> = captured.iter().map(|&i| i as i64).collect();
    f.capture(&ids, 3 * a.tokens * c.hidden_size as u64 * elem);
    let mut first = None;
    for group in groups.instances() {
        let devices: Vec<Device> = group.devices().iter().map(dflash_models::cuda::torch_device).collect();
        let capacity = placement::capacities(&devices);
        let name = dflash_config::group_name(group);
        let plan =
            Placement::plan(&devices, &f, Some(&capacity)).map_err(|e| anyhow::anyhow!("devices {name}: {e}"))?;
        println!("  {:<18} capturing up to layer {last}, {} tokens a batch:", format!("layout {name}:"), a.tokens);
        for (k, (part, need)) in plan.parts().iter().zip(plan.bytes(&f)).enumerate() {
            let free = match capacity[k] {
                u64::MAX => " (free memory unknown)".to_string(),
                c => format!(" of {} free", bytes(c)),
            };
            let (from, to) = (part.layers.start, part.layers.end - 1);
            println!("  {:<18} layers {from}-{to} on {}: {}{free}", "", group.devices()[k], bytes(need));
        }
        if first.is_none() {
            // `--ids` runs the whole model (to its logits) on the first group.
            let whole = Footprint { workspace: 0, captures: Vec::new(), ..full.clone() };
            first = Some(Placement::plan(&devices, &whole, None)?);
        }
    }
    first.context("no device groups")
}

fn zoo_name(c: &TargetConfig) -> &'static str {
    dflash_models::zoo::architecture(c.family).hf_architecture()
}

fn kind_name(k: LayerKind) -> &'static str {
    match k {
        LayerKind::FullAttention => "full attention",
        LayerKind::SlidingAttention => "sliding-window attention",
        LayerKind::LinearAttention => "linear attention",
    }
}

/// Layer kinds as runs: `0-2 linear attention, 3 full attention, ...`.
fn layer_runs(c: &TargetConfig) -> String {
    let mut runs: Vec<(i64, i64, LayerKind)> = Vec::new();
    for i in 0..c.num_layers {
        let k = c.layer_kind(i);
        match runs.last_mut() {
            Some((_, end, last)) if *last == k => *end = i,
            _ => runs.push((i, i, k)),
        }
    }
    let run = |(a, b, k): &(i64, i64, LayerKind)| {
        if a == b { format!("{a} {}", kind_name(*k)) } else { format!("{a}-{b} {}", kind_name(*k)) }
    };
    if runs.len() <= 6 {
        return runs.iter().map(run).collect::<Vec<_>>().join(", ");
    }
    // A repeating pattern: how many of each kind, and where the rarest are.
    let of = |k: LayerKind| (0..c.num_layers).filter(|&i| c.layer_kind(i) == k).collect::<Vec<i64>>();
    let mut kinds: Vec<(LayerKind, Vec<i64>)> =
        [LayerKind::LinearAttention, LayerKind::SlidingAttention, LayerKind::FullAttention]
            .into_iter()
            .map(|k| (k, of(k)))
            .filter(|(_, l)| !l.is_empty())
            .collect();
    kinds.sort_by_key(|(_, l)| std::cmp::Reverse(l.len()));
    let (rarest, layers) = kinds.last().expect("a model has layers");
    let counts: Vec<String> = kinds.iter().map(|(k, l)| format!("{} {}", l.len(), kind_name(*k))).collect();
    format!("{} ({} at layers {layers:?})", counts.join(", "), kind_name(*rarest))
}

/// The resolved config, one setting per line.
pub fn describe(dir: &std::path::Path, c: &TargetConfig) -> String {
    let mut s = format!("{}\n", dir.display());
    let mut line = |k: &str, v: String| s.push_str(&format!("  {k:<18} {v}\n"));
    line(
        "architecture:",
        format!(
            "{} ({:?}){}",
            zoo_name(c),
            c.family,
            if c.tensor_names.language_model.is_some() { ", multimodal checkpoint: language model only" } else { "" }
        ),
    );
    line("layers:", c.num_layers.to_string());
    if c.layer_types.iter().any(|&k| k != LayerKind::FullAttention) {
        line("layer kinds:", layer_runs(c));
    }
    line("hidden size:", c.hidden_size.to_string());
    if let Some(l) = &c.linear_attention {
        let sh = l.shape;
        line(
            "linear attention:",
            format!(
                "Gated DeltaNet, {} key heads of {}, {} value heads of {}, convolution {}, chunked delta rule",
                sh.num_key_heads, sh.key_head_dim, sh.num_value_heads, sh.value_head_dim, sh.conv_kernel
            ),
        );
    }
    let mut extras = String::new();
    for (on, what) in [
        (c.qk_norm, ", QK norm"),
        (c.attn_output_gate, ", output gate"),
        (c.attention_sinks, ", a sink logit per head"),
        (c.qkv_bias && c.o_bias, ", biases on q/k/v/o"),
        (c.qkv_bias && !c.o_bias, ", biases on q/k/v"),
    ] {
        if on {
            extras.push_str(what);
        }
    }
    if let Some(w) = c.sliding_window.filter(|_| c.layer_types.contains(&LayerKind::SlidingAttention)) {
        extras.push_str(&format!(", window {w} in sliding layers"));
    }
    match &c.latent_attention {
        Some(m) => line(
            "attention:",
            format!(
                "multi-head latent, {} heads, queries {}, kv latent {}, per head {} + {} RoPE (q/k) and {} (v){}{extras}",
                c.num_heads,
                m.q_lora_rank.map_or("direct".to_string(), |r| format!("through rank {r}")),
                m.kv_lora_rank,
                m.qk_nope_head_dim,
                m.qk_rope_head_dim,
                m.v_head_dim,
                if m.rope_interleave { ", RoPE pairs interleaved" } else { "" },
            ),
        ),
        None => line(
            "attention:",
            format!("{} heads, {} kv heads, head_dim {}{extras}", c.num_heads, c.num_kv_heads, c.head_dim),
        ),
    }
    line("RoPE:", format!("{}, max positions {}", c.rope.describe(), c.max_position_embeddings));
    match &c.moe {
        Some(m) => {
            let sparse = (0..c.num_layers).filter(|&i| m.is_sparse(i)).count();
            let shared = match (m.shared_expert_intermediate_size, m.shared_expert_gate) {
                (Some(w), true) => format!(", a gated shared expert of width {w}"),
                (Some(w), false) => format!(", a shared expert of width {w}"),
                (None, _) => String::new(),
            };
            let activation = match m.activation {
                dflash_models::moe::ExpertActivation::SwiGlu => "SwiGLU".to_string(),
                dflash_models::moe::ExpertActivation::ClampedSwiGlu { alpha, limit } => {
                    format!("clamped SwiGLU (alpha {alpha}, limit {limit})")
                }
            };
            line(
                "experts:",
                format!(
                    "{} per sparse layer, top {}, {activation}{}, width {}{shared}; {sparse} sparse layers, {} dense{}",
                    m.num_experts,
                    m.top_k,
                    if m.expert_bias { " with biases" } else { "" },
                    m.expert_intermediate_size,
                    c.num_layers - sparse as i64,
                    if sparse as i64 == c.num_layers {
                        String::new()
                    } else {
                        format!(" (width {})", c.intermediate_size)
                    }
                ),
            );
            line(
                "routing:",
                format!("{}{}", m.routing.describe(), if m.router_bias { ", router with bias" } else { "" }),
            );
        }
        None => {
            line("mlp:", format!("SwiGLU, width {}{}", c.intermediate_size, if c.mlp_bias { ", biases" } else { "" }))
        }
    }
    match c.norm {
        NormStyle::Plain => {}
        NormStyle::ScaleInF32 => line("norms:", "RMSNorm, scales in f32".into()),
        NormStyle::ZeroCentred => line("norms:", "RMSNorm, zero-centred scales (1 + w, in f32)".into()),
    }
    line("vocabulary:", format!("{}{}", c.vocab_size, if c.tie_word_embeddings { ", LM head tied" } else { "" }));
    line("weights:", c.quant.as_ref().map_or("floating point".to_string(), |q| q.describe()));
    let total = c.parameter_count();
    let active: f64 =
        (0..c.num_layers).map(|i| c.layer_linear_macs(i)).sum::<f64>() + (c.vocab_size * c.hidden_size) as f64;
    line(
        "parameters:",
        if c.moe.is_some() {
            format!("{} ({} active per token)", count(total as f64), count(active))
        } else {
            count(total as f64)
        },
    );
    s
}
