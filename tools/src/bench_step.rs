//! `dflash bench-step`: drafter training-step time, samples/s and
//! MFU on random weights of a named target shape, for several anchor counts
//! and attention chunkings. Prints a table and writes JSON.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use dflash_models::blocks::BlockSettings;
use dflash_models::collective::Collective;
use dflash_models::gloo::GroupStore;
use dflash_models::optim::{AdamWSettings, LrSchedule};
use dflash_models::perf::{matmul_peak, sync_device};
use dflash_models::{DeviceBatch, Drafter, DrafterConfig, LayerType, StepOutcome, TrainSettings, Trainer};

use crate::step_profile::{self, StepFlops};
use rand::{Rng, SeedableRng};
use serde::Serialize;
use tch::{Device, Kind, Tensor};

#[derive(clap::Args, Debug)]
pub struct BenchStepArgs {
    /// Target shape the drafter matches: qwen3-8b, smollm2-135m or tiny.
    #[arg(long, default_value = "tiny")]
    pub shape: String,
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// Drafter layers (= captured target layers).
    #[arg(long, default_value_t = 5)]
    pub layers: i64,
    #[arg(long, default_value_t = 16)]
    pub block: i64,
    /// Comma-separated anchor counts per sequence.
    #[arg(long, default_value = "256,512")]
    pub anchors: String,
    /// Comma-separated blocks per attention call (a large value = one dense mask).
    #[arg(long, default_value = "100000,64,32")]
    pub chunks: String,
    /// Comma-separated block attentions: split (two mask-free flash calls
    /// merged by log-sum-exp; CUDA only, the default there) and masked (the
    /// chunked mask).
    #[arg(long, default_value = "split,masked")]
    pub attention: String,
    /// Comma-separated step paths: none (one process alone, as a drafter
    /// outside a group) and group-of-one (the drafter group's step over a
    /// real one-member collective formed through the group's store: NCCL
    /// on a GPU, Gloo on the CPU -- agreement, gradient all-reduce, then
    /// the optimizer step).
    #[arg(long, default_value = "none")]
    pub collective: String,
    /// The training objective: ce, dpace (alpha 0.5) or kd (from a random
    /// top-32 per position, as a target would ship it).
    #[arg(long, default_value = "ce")]
    pub objective: String,
    /// The drafter: dflash, or dflash2 (the published shape: 2-tap
    /// convolutions in groups of 16 channels, a rank-256 selector over the
    /// top 16 candidates, selector loss weight 1).
    #[arg(long, default_value = "dflash")]
    pub variant: String,
    /// Sliding-window drafter layers: the first `--sliding-layers` layers
    /// attend within this window (0: every layer attends fully). Needs
    /// `--attention masked` (the split attention cannot bound a window).
    #[arg(long, default_value_t = 0)]
    pub sliding_window: i64,
    /// How many of the layers slide when `--sliding-window` is set.
    #[arg(long, default_value_t = 0)]
    pub sliding_layers: i64,
    /// Tokens per batch (packed sequences).
    #[arg(long, default_value_t = 11_000)]
    pub batch_tokens: usize,
    #[arg(long, default_value_t = 550)]
    pub min_len: usize,
    #[arg(long, default_value_t = 3072)]
    pub max_len: usize,
    /// Cap on sequences x anchors per micro-batch.
    #[arg(long, default_value_t = 4096)]
    pub max_blocks: usize,
    #[arg(long, default_value_t = 4)]
    pub steps: usize,
    /// Distinct random batches cycled through (shapes vary as in training).
    #[arg(long, default_value_t = 1)]
    pub batches: usize,
    /// Turn libtorch's cuDNN attention backend off (the drafter service
    /// keeps it on: faster for masked block attention at 512 anchors).
    #[arg(long)]
    pub no_cudnn_attention: bool,
    /// Keep the residual stream and norms in f32 (training.f32_residual).
    #[arg(long)]
    pub f32_residual: bool,
    /// The layer matmuls' kind, comma-separated to compare in one run:
    /// `bf16`, `fp8` (training.precision; fp8 needs a GPU of compute
    /// capability 8.9 or newer). MFU is counted against the bf16 matmul peak
    /// either way.
    #[arg(long, default_value = "bf16")]
    pub precision: String,
    /// Round each micro-batch's context up to a multiple of this
    /// (training.context_pad_multiple; 1: no padding).
    #[arg(long, default_value_t = 128)]
    pub context_multiple: usize,
    #[arg(long, default_value_t = 2)]
    pub warmup: usize,
    /// Also run one step of each configuration under libtorch's profiler
    /// and print where its time goes, by kernel class (the first batch;
    /// without a group).
    #[arg(long)]
    pub profile: bool,
    #[arg(long)]
    pub json: Option<PathBuf>,
    #[arg(long, default_value_t = 0)]
    pub threads: i32,
}

#[derive(Serialize)]
struct Row {
    collective: String,
    precision: String,
    attention: String,
    anchors: usize,
    chunk_blocks: usize,
    step_ms: f64,
    samples_per_s: f64,
    tokens_per_s: f64,
    mfu: f64,
    peak_mem_gib: f64,
}

/// Useful FLOPs of one training step (forward + backward) on sequences of
/// `lens` with `anchors` blocks each: fc, the layers (queries are the block
/// slots; keys/values also the context), attention over the visible keys
/// only (context before the anchor, about S/2 on average, plus the block),
/// and the frozen LM head (forward and input gradient).
pub fn step_flops(c: &DrafterConfig, lens: &[usize], anchors: usize) -> StepFlops {
    let (h, i, v) = (c.hidden_size as f64, c.intermediate_size as f64, c.vocab_size as f64);
    let (qd, kvd) = ((c.num_heads * c.head_dim) as f64, (c.num_kv_heads * c.head_dim) as f64);
    let b = c.block_size as f64;
    let width = c.feature_width() as f64;
    let mut f = StepFlops::default();
    for &s in lens {
        let s = s as f64;
        let n = (anchors as f64).min(s - 1.0);
        let q = n * b;
        f.layers += 2.0 * 2.0 * s * width * h; // fc: forward + weight gradient
        let linear = 2.0 * (q * (h * qd + qd * h + 3.0 * h * i) + (s + q) * 2.0 * h * kvd);
        let attn = 4.0 * qd * q * (s / 2.0 + b);
        f.layers += c.num_layers as f64 * 3.0 * linear;
        f.attention += c.num_layers as f64 * 3.0 * attn;
        f.lm_head += 2.0 * 2.0 * n * (b - 1.0) * h * v; // LM head: forward + input gradient
    }
    f
}

pub fn run(a: &BenchStepArgs) -> anyhow::Result<()> {
    if a.threads > 0 {
        tch::set_num_threads(a.threads);
    }
    let shape = crate::cli_args::shape(&a.shape)?;
    let device = crate::cli_args::device(&a.device)?;
    let kind = if device.is_cuda() { Kind::BFloat16 } else { Kind::Float };
    anyhow::ensure!(
        !a.profile || device.is_cuda(),
        "--profile sorts a GPU's kernels by class; on {device:?} there are none (use a CUDA device)"
    );
    if device.is_cuda() {
        dflash_models::cuda::set_cudnn_attention(!a.no_cudnn_attention);
    }
    let peak = matmul_peak(device, kind);
    let config = drafter_config(a, &shape)?;
    let (batches, all_lens) = random_batches(a, &config, &shape, kind, device);
    let seqs: usize = all_lens.iter().map(Vec::len).sum();
    let tokens: usize = all_lens.iter().flatten().sum();
    println!(
        "bench-step: {}-layer drafter for {} (hidden {}, vocab {}), block {}{}, {kind:?} on {device:?}; {} batch(es), {:.1} sequences and {:.0} tokens per batch; cuDNN attention {}; measured matmul peak {:.1} GFLOP/s",
        a.layers,
        a.shape,
        shape.hidden_size,
        shape.vocab_size,
        a.block,
        if a.sliding_window > 0 {
            format!(", {} sliding layer(s) of window {}", a.sliding_layers, a.sliding_window)
        } else {
            String::new()
        },
        batches.len(),
        seqs as f64 / batches.len() as f64,
        tokens as f64 / batches.len() as f64,
        if a.no_cudnn_attention { "off" } else { "on" },
        peak / 1e9
    );
    let embed = Tensor::randn([shape.vocab_size, shape.hidden_size], (kind, device)) * 0.02;
    let head = Tensor::randn([shape.vocab_size, shape.hidden_size], (kind, device)) * 0.02;
    let modes = attention_modes(a, device)?;
    let objective = objective(a)?;
    let fp8_settings = precisions(a)?;
    let mut rows = Vec::new();
    let mut profiles = Vec::new();
    for collective in collectives(a)? {
        let group = match collective {
            "group-of-one" => Some(group_of_one(device)?),
            _ => None,
        };
        for ((split, anchors, chunk), fp8) in attention_grid(&modes, &a.anchors, &a.chunks)?
            .into_iter()
            .flat_map(|cell| fp8_settings.iter().map(move |&fp8| (cell, fp8)))
        {
            tch::manual_seed(0);
            let mut drafter = Drafter::new(config.clone(), device, kind);
            drafter.set_split_attention(split);
            drafter.set_f32_residual(a.f32_residual);
            drafter.set_fp8_matmuls(fp8)?;
            let settings = train_settings(a, anchors, chunk, objective);
            let mut trainer = Trainer::new(drafter, embed.shallow_clone(), head.shallow_clone(), settings);
            let run = Timed { trainer: &mut trainer, group: group.as_deref(), batches: &batches, lens: &all_lens };
            let (secs, flops, step_seqs, step_tokens) = run.time(a, &config, anchors, device)?;
            let mem = if device.is_cuda() { device_memory_used_gib() } else { 0.0 };
            if a.profile {
                let label = format!(
                    "{} attention, {anchors} anchors, {}",
                    if split { "split" } else { "masked" },
                    if fp8 { "fp8" } else { "bf16" }
                );
                let p = step_profile::profile_step(
                    device.is_cuda(),
                    &config,
                    step_flops(&config, &all_lens[0], anchors),
                    peak,
                    || trainer.train_batch(&batches[0]),
                    || sync_device(device),
                )?;
                step_profile::print(&p, &label);
                profiles.push(serde_json::json!({ "config": label, "profile": p }));
            }
            rows.push(Row {
                collective: collective.into(),
                precision: if fp8 { "fp8" } else { "bf16" }.into(),
                attention: if split { "split" } else { "masked" }.into(),
                anchors,
                chunk_blocks: chunk,
                step_ms: secs * 1e3 / a.steps as f64,
                samples_per_s: step_seqs as f64 / secs,
                tokens_per_s: step_tokens as f64 / secs,
                mfu: flops / secs / peak,
                peak_mem_gib: mem,
            });
        }
    }
    print_rows(&rows);
    if let Some(p) = &a.json {
        let v = serde_json::json!({
            "bench": "drafter_step",
            "objective": a.objective,
            "variant": a.variant,
            "sliding_window": a.sliding_window,
            "sliding_layers": if a.sliding_window > 0 { a.sliding_layers } else { 0 },
            "shape": a.shape,
            "layers": a.layers,
            "block": a.block,
            "device": a.device,
            "batches": all_lens,
            "cudnn_attention": !a.no_cudnn_attention,
            "f32_residual": a.f32_residual,
            "precision": a.precision,
            "matmul_peak_flops": peak,
            "rows": rows,
            "profiles": profiles,
        });
        std::fs::write(p, serde_json::to_string_pretty(&v)?)?;
    }
    Ok(())
}

/// The drafter of `--shape` with `--layers`, `--block`, `--variant` and
/// the sliding-window flags.
fn drafter_config(a: &BenchStepArgs, shape: &dflash_models::TargetConfig) -> anyhow::Result<DrafterConfig> {
    let layer_ids: Vec<i64> = dflash_config::default_target_layer_ids(shape.num_layers as u32, a.layers as u32)
        .into_iter()
        .map(i64::from)
        .collect();
    let mut config = DrafterConfig::for_target(shape, a.layers, a.block, 3, layer_ids);
    config.dflash2 = match a.variant.as_str() {
        "dflash" => None,
        "dflash2" => Some(dflash_models::dflash2::Dflash2Config {
            conv_kernel_size: 2,
            conv_group_size: 16,
            selector_rank: 256,
            selector_top_k: 16,
        }),
        other => anyhow::bail!("--variant: {other:?} is neither dflash nor dflash2"),
    };
    if a.sliding_window > 0 {
        anyhow::ensure!(
            (1..=a.layers).contains(&a.sliding_layers),
            "--sliding-layers: {} with --sliding-window; must be between 1 and --layers ({})",
            a.sliding_layers,
            a.layers
        );
        config.layer_types = (0..a.layers)
            .map(|i| if i < a.sliding_layers { LayerType::SlidingAttention } else { LayerType::FullAttention })
            .collect();
        config.sliding_window = Some(a.sliding_window);
    }
    Ok(config)
}

/// Random batches (features and tokens) with the length distribution of
/// training; the step depends on their shapes, not their values. Returns
/// them and each one's sequence lengths.
fn random_batches(
    a: &BenchStepArgs,
    config: &DrafterConfig,
    shape: &dflash_models::TargetConfig,
    kind: Kind,
    device: Device,
) -> (Vec<DeviceBatch>, Vec<Vec<usize>>) {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(1);
    let mut batches = Vec::new();
    let mut all_lens: Vec<Vec<usize>> = Vec::new();
    for b in 0..a.batches.max(1) {
        let mut lens = Vec::new();
        let mut total = 0;
        loop {
            let l = rng.random_range(a.min_len..=a.max_len);
            if total + l > a.batch_tokens && !lens.is_empty() {
                break;
            }
            lens.push(l);
            total += l;
        }
        batches.push(DeviceBatch {
            batch_id: b as u64,
            features: Tensor::randn([total as i64, config.feature_width()], (kind, device)),
            input_ids: (0..total).map(|_| rng.random_range(0..shape.vocab_size as u32)).collect(),
            loss_mask: vec![1; total],
            seq_lengths: lens.iter().map(|&l| l as u32).collect(),
            target_top_k: (a.objective == "kd").then(|| {
                let logits = Tensor::randn([total as i64, shape.vocab_size], (tch::Kind::Float, device));
                let (log_probs, ids) = logits.log_softmax(-1, tch::Kind::Float).topk(32, -1, true, true);
                dflash_models::TopK { ids, log_probs }
            }),
            landing: None,
            trace_context: Default::default(),
        });
        all_lens.push(lens);
    }
    (batches, all_lens)
}

/// The attention paths of `--attention` this device runs (split: CUDA, no
/// sliding window).
fn attention_modes(a: &BenchStepArgs, device: Device) -> anyhow::Result<Vec<bool>> {
    let mut modes = Vec::new();
    for m in a.attention.split(',').map(str::trim) {
        match m {
            "split" if !device.is_cuda() => println!("bench-step: split attention needs CUDA; skipped on {device:?}"),
            "split" if a.sliding_window > 0 => println!("bench-step: split attention has no sliding window; skipped"),
            "split" => modes.push(true),
            "masked" => modes.push(false),
            other => anyhow::bail!("--attention: {other:?} is neither split nor masked"),
        }
    }
    Ok(modes)
}

fn objective(a: &BenchStepArgs) -> anyhow::Result<dflash_models::Objective> {
    Ok(match a.objective.as_str() {
        "ce" => dflash_models::Objective::CrossEntropy,
        "dpace" => dflash_models::Objective::Dpace { alpha: dflash_config::DEFAULT_DPACE_ALPHA },
        "kd" => dflash_models::Objective::Distill,
        other => anyhow::bail!("--objective: {other:?} is none of ce, dpace and kd"),
    })
}

fn collectives(a: &BenchStepArgs) -> anyhow::Result<Vec<&str>> {
    let mut collectives = Vec::new();
    for c in a.collective.split(',').map(str::trim) {
        match c {
            "none" | "group-of-one" => collectives.push(c),
            other => anyhow::bail!("--collective: {other:?} is neither none nor group-of-one"),
        }
    }
    Ok(collectives)
}

/// `--precision` as FP8 on/off settings, in the order given.
fn precisions(a: &BenchStepArgs) -> anyhow::Result<Vec<bool>> {
    a.precision
        .split(',')
        .map(str::trim)
        .map(|p| match p {
            "bf16" => Ok(false),
            "fp8" => Ok(true),
            other => anyhow::bail!("--precision: {other:?} is neither bf16 nor fp8"),
        })
        .collect()
}

fn train_settings(
    a: &BenchStepArgs,
    anchors: usize,
    chunk: usize,
    objective: dflash_models::Objective,
) -> TrainSettings {
    TrainSettings {
        blocks: BlockSettings {
            block_size: a.block as usize,
            mask_token_id: 3,
            gamma: 7.0,
            anchors_per_sequence: anchors,
        },
        schedule: LrSchedule::new(6e-4, 1000, 0.04, 0.0),
        adamw: AdamWSettings { beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.0 },
        grad_clip: 1.0,
        max_blocks_per_micro_batch: a.max_blocks.max(anchors),
        loss_chunk_blocks: 256,
        attention_chunk_blocks: chunk,
        context_pad_multiple: a.context_multiple,
        seed: 0,
        objective,
        selector_loss_weight: 1.0,
    }
}

/// One configuration's trainer and the batches it steps through.
struct Timed<'a> {
    trainer: &'a mut Trainer,
    group: Option<&'a dyn Collective>,
    batches: &'a [DeviceBatch],
    lens: &'a [Vec<usize>],
}

impl Timed<'_> {
    /// `--warmup` steps, then `--steps` timed ones: seconds, useful FLOPs,
    /// sequences and tokens of the timed steps.
    fn time(
        self,
        a: &BenchStepArgs,
        config: &DrafterConfig,
        anchors: usize,
        device: Device,
    ) -> anyhow::Result<(f64, f64, usize, usize)> {
        let (trainer, batches, all_lens) = (self.trainer, self.batches, self.lens);
        let mut t0 = Instant::now();
        let (mut flops, mut step_seqs, mut step_tokens) = (0.0, 0usize, 0usize);
        for i in 0..a.warmup + a.steps {
            if i == a.warmup {
                sync_device(device);
                t0 = Instant::now();
            }
            let b = i % batches.len();
            let outcome = match self.group {
                None => trainer.train_batch(&batches[b]),
                Some(g) => group_step(trainer, g, &batches[b], device)?,
            };
            if let StepOutcome::Skipped(r) = outcome {
                anyhow::bail!("benchmark step skipped: {r}");
            }
            if i >= a.warmup {
                flops += step_flops(config, &all_lens[b], anchors).total();
                step_seqs += all_lens[b].len();
                step_tokens += all_lens[b].iter().sum::<usize>();
            }
        }
        sync_device(device);
        let secs = t0.elapsed().as_secs_f64();
        Ok((secs, flops, step_seqs, step_tokens))
    }
}

fn print_rows(rows: &[Row]) {
    println!(
        "{:>12} {:>9} {:>9} {:>8} {:>7} {:>10} {:>10} {:>10} {:>7} {:>9}",
        "collective",
        "precision",
        "attention",
        "anchors",
        "chunk",
        "step ms",
        "samples/s",
        "tokens/s",
        "MFU",
        "mem GiB"
    );
    for r in rows {
        let chunk = if r.chunk_blocks >= r.anchors { "dense".to_string() } else { r.chunk_blocks.to_string() };
        println!(
            "{:>12} {:>9} {:>9} {:>8} {:>7} {:>10.1} {:>10.2} {:>10.0} {:>6.1}% {:>9.1}",
            r.collective,
            r.precision,
            r.attention,
            r.anchors,
            chunk,
            r.step_ms,
            r.samples_per_s,
            r.tokens_per_s,
            100.0 * r.mfu,
            r.peak_mem_gib
        );
    }
}

/// A one-member drafter group formed as the service forms one: a store
/// served on this host, then the device's collective over it.
fn group_of_one(device: Device) -> anyhow::Result<Box<dyn Collective>> {
    let timeout = std::time::Duration::from_secs(60);
    let store = GroupStore::serve("127.0.0.1", 1, 1, timeout)?;
    Ok(dflash_models::group::join(store, "127.0.0.1", 0, 1, device, dflash_models::dp::never_cancelled())?)
}

/// One step as a group member takes it (`services/drafter/src/train_loop.rs`):
/// gradients, the members' agreement on who contributes, the gradient
/// average, then the optimizer step.
fn group_step(
    trainer: &mut Trainer,
    group: &dyn Collective,
    batch: &DeviceBatch,
    device: Device,
) -> anyhow::Result<StepOutcome> {
    let metrics = match trainer.compute_gradients(batch) {
        StepOutcome::Trained(m) => m,
        skipped => return Ok(skipped),
    };
    let agreed = group.agree(&[1.0, 1.0, 0.0], device)?;
    group.average_gradients(&trainer.drafter().named_parameters(), agreed[0])?;
    Ok(trainer.apply_gradients(metrics))
}

/// Every (split, anchors, chunk) combination of the arguments, in order.
fn attention_grid(modes: &[bool], anchors: &str, chunks: &str) -> anyhow::Result<Vec<(bool, usize, usize)>> {
    let list = |s: &str, what: &str| -> anyhow::Result<Vec<usize>> {
        s.split(',')
            .map(|x| x.trim().parse::<usize>().with_context(|| format!("{what}: comma-separated integers")))
            .collect()
    };
    let (anchors, chunks) = (list(anchors, "--anchors")?, list(chunks, "--chunks")?);
    let mut grid = Vec::new();
    for &m in modes {
        for &a in &anchors {
            grid.extend(chunks.iter().map(|&c| (m, a, c)));
        }
    }
    Ok(grid)
}

/// Device memory in use according to the driver. libtorch's caching
/// allocator keeps what it once reserved, so after the steps this is close
/// to the peak the steps needed (tch does not expose the allocator's own
/// statistics).
fn device_memory_used_gib() -> f64 {
    let mut free = 0usize;
    let mut total = 0usize;
    // SAFETY: plain query of the current context's memory.
    let ok = unsafe { cudarc::driver::sys::cuMemGetInfo_v2(&mut free, &mut total) };
    if ok == cudarc::driver::sys::CUresult::CUDA_SUCCESS {
        (total - free) as f64 / (1u64 << 30) as f64
    } else {
        f64::NAN
    }
}
