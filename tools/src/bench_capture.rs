//! `dflash bench-capture`: target capture throughput and MFU on a
//! random-weight target of a named shape, and the step time with
//! postprocessing off, asynchronous (the service's pipeline) and
//! synchronous. Prints a table and writes JSON.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Context;
use dflash_models::perf::{matmul_peak, sync_device};
use dflash_models::placement::{Footprint, Placement};
use dflash_models::{LoadScope, TargetConfig, TargetModel};
use dflash_role::Stop;
use dflash_wire::{DType, FeatureSpec, Layout};
use rand::{Rng, SeedableRng};
use serde::Serialize;
use tch::{Device, Kind, Tensor};

use dflash_target::forward::CudaFeed;
use dflash_target::pipeline::{CapturePipeline, PipelineSettings};
use dflash_target::work::WorkItem;

#[derive(clap::Args, Debug)]
pub struct BenchArgs {
    /// Target shape: qwen3-8b, llama3.1-8b, qwen3-30b-a3b, gpt-oss-20b,
    /// moonlight-16b-a3b, qwen3.5-27b, qwen3.5-35b-a3b, qwen3-next-80b-a3b,
    /// smollm2-135m, tiny, tiny-qwen3, tiny-qwen2, tiny-moe, tiny-hybrid, tiny-gpt-oss.
    #[arg(long, default_value = "tiny")]
    pub shape: String,
    /// "cpu" or a GPU index.
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// Captured layers (spread as the drafter's default).
    #[arg(long, default_value_t = 5)]
    pub layers: u32,
    /// Tokens per batch (packed sequences).
    #[arg(long, default_value_t = 11_000)]
    pub batch_tokens: usize,
    #[arg(long, default_value_t = 550)]
    pub min_len: usize,
    #[arg(long, default_value_t = 3072)]
    pub max_len: usize,
    /// Timed batches per mode (after warm-up batches).
    #[arg(long, default_value_t = 8)]
    pub batches: usize,
    #[arg(long, default_value_t = 2)]
    pub warmup: usize,
    /// Comma-separated: off, async, sync.
    #[arg(long, default_value = "off,async,sync")]
    pub modes: String,
    /// SPLIT (per-layer) or PACKED payloads.
    #[arg(long, default_value = "split", value_parser = ["split", "packed"])]
    pub layout: String,
    /// Also print where one batch's forward time goes, stage by stage.
    #[arg(long)]
    pub profile: bool,
    /// Let libtorch use its cuDNN attention backend (off by default: it
    /// plans per input shape, and packed sequences vary in shape).
    #[arg(long)]
    pub cudnn_attention: bool,
    /// Split the target into this many pipeline parts of consecutive
    /// layers, all on `--device` (the cost of a split, measured on one
    /// device: what a multi-device instance runs, less the copies between
    /// devices).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..))]
    pub parts: u16,
    #[arg(long)]
    pub json: Option<PathBuf>,
    #[arg(long, default_value_t = 0)]
    pub threads: i32,
}

/// The random target to `last`, whole or in `parts` parts on `device`,
/// balanced by the layers' compute as the target service plans them.
fn random_target(c: &TargetConfig, device: Device, kind: Kind, last: i64, parts: u16) -> anyhow::Result<TargetModel> {
    let cost = (0..=last).map(|i| c.layer_linear_macs(i)).collect();
    let f = Footprint { layers: vec![0; last as usize + 1], cost, ..Default::default() };
    let plan = Placement::plan(&vec![device; parts as usize], &f, None)?;
    Ok(TargetModel::random_placed(c.clone(), &plan, kind, LoadScope::CaptureUpTo { last_layer: last })?)
}

#[derive(Serialize)]
struct ModeResult {
    mode: String,
    step_ms: f64,
    /// GPU time of one forward from timing events around it (the
    /// pipelined modes on CUDA): against `step_ms`, whether postprocessing
    /// slows the forward's kernels or leaves gaps between forwards.
    forward_gpu_ms: Option<f64>,
    /// GPU idle between forwards, per forward: the next forward not queued
    /// yet, or queued and waiting for its ids; and the longest gap (ms).
    idle_unqueued_ms: Option<f64>,
    idle_ids_ms: Option<f64>,
    max_gap_ms: Option<f64>,
    /// GPU time of the timed window from events on torch's stream (ms per
    /// batch; `off` on CUDA): against `step_ms`, whether the host clock and
    /// the GPU's agree.
    gpu_window_ms: Option<f64>,
    /// Pipelined modes on CUDA: each forward's (idle before it, GPU time),
    /// and when the consumer received each timed batch (ms after the first).
    timeline_ms: Vec<(f64, f64)>,
    received_ms: Vec<f64>,
    /// The timed batches' GPU time per batch from the timeline (forward
    /// plus idle before it; pipelined modes on CUDA).
    gpu_step_ms: Option<f64>,
    tokens_per_s: f64,
    mfu: f64,
    vs_off: f64,
}

/// FLOPs of capturing `lens` sequences through the first `layers` layers:
/// the linear layers a token passes through (for MoE layers the router and
/// the experts it is routed to: active parameters) plus softmax attention
/// over the visible pairs (the causal half, within the window of sliding
/// layers). The convolution and delta rule of linear-attention layers are
/// not counted.
pub fn capture_flops(c: &TargetConfig, layers: i64, lens: &[usize]) -> f64 {
    let tokens: f64 = lens.iter().map(|&l| l as f64).sum();
    (0..layers)
        .map(|i| 2.0 * c.layer_linear_macs(i) * tokens + lens.iter().map(|&l| c.attention_flops(i, l)).sum::<f64>())
        .sum()
}

fn make_batches(n: usize, a: &BenchArgs, vocab: i64, seed: u64) -> Vec<WorkItem> {
    // Nobody renews these: the bench has no coordinator.
    let leases = dflash_target::leases::Leases::new();
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    (0..n)
        .map(|b| {
            let mut lens = Vec::new();
            let mut total = 0;
            loop {
                let l = rng.random_range(a.min_len..=a.max_len);
                if total + l > a.batch_tokens && !lens.is_empty() {
                    break;
                }
                lens.push(l as u32);
                total += l;
            }
            let ids: Vec<u32> = (0..total).map(|_| rng.random_range(0..vocab as u32)).collect();
            WorkItem {
                batch_id: b as u64,
                epoch: 0,
                sample_ids: (0..lens.len() as u64).collect(),
                seq_lengths: lens,
                loss_mask: vec![1; total],
                input_ids: ids,
                trace: Default::default(),
                lease: leases.hold(b as u64, Default::default()),
                lease_token: Vec::new(),
            }
        })
        .collect()
}

/// The forward loop's CUDA input path, as the service builds it.
fn cuda_feed(
    cuda: &Option<std::sync::Arc<cudarc::driver::CudaContext>>,
    device: Device,
    max_tokens: usize,
    count: usize,
) -> anyhow::Result<Option<CudaFeed>> {
    match (cuda, device) {
        (Some(ctx), Device::Cuda(i)) => Ok(Some(CudaFeed::new(ctx, i, max_tokens, count)?)),
        _ => Ok(None),
    }
}

/// What one mode's timed batches measured.
#[derive(Default)]
struct Timing {
    elapsed: Duration,
    /// Mean GPU time of a forward (CUDA, the pipeline modes).
    forward_gpu_ms: Option<f64>,
    /// Mean idle time before a forward with nothing queued, waiting on ids,
    /// and the longest gap (CUDA, the pipeline modes).
    idle: Option<(f64, f64, f64)>,
    /// GPU time of the whole timed window per batch (CUDA, "off").
    gpu_window_ms: Option<f64>,
    /// Per forward: (GPU time, host-blocked time) in ms.
    timeline_ms: Vec<(f64, f64)>,
    /// When each timed batch's payload reached the consumer.
    received_ms: Vec<f64>,
}

/// Mode "off": the forward loop's input path (ids uploaded ahead on CUDA,
/// one batch queued behind the running one), nothing after it.
fn time_off(
    a: &BenchArgs,
    cuda: &Option<std::sync::Arc<cudarc::driver::CudaContext>>,
    device: Device,
    model: &TargetModel,
    batches: &[WorkItem],
    layer_ids: &[i64],
    stop: &Stop,
) -> anyhow::Result<Timing> {
    let (mut gpu_window_ms, mut timeline_ms) = (None, Vec::new());
    // The forward loop's input path (ids uploaded ahead on CUDA,
    // one batch queued behind the running one), nothing after it.
    let upload = cuda_feed(cuda, device, a.batch_tokens, 2)?;
    let mut previous = None;
    let mut t0 = Instant::now();
    let mut gpu_t0 = None;
    let mut off_events = Vec::new();
    for (i, w) in batches.iter().enumerate() {
        if i == a.warmup {
            drop(previous.take());
            sync_device(device);
            t0 = Instant::now();
            if let Some(ctx) = cuda {
                gpu_t0 = Some(dflash_target::upload::GpuBusy::mark(ctx)?);
            }
        }
        let lens: Vec<i64> = w.seq_lengths.iter().map(|&x| x as i64).collect();
        match &upload {
            Some(feed) => {
                let mut ids = feed.upload.upload(&w.input_ids, stop)?;
                let start = dflash_target::upload::GpuBusy::mark(&feed.ctx)?;
                let _ = model.capture_packed(ids.tensor(), &lens, layer_ids);
                off_events.push((start, dflash_target::upload::GpuBusy::mark(&feed.ctx)?));
                ids.release_after_torch_work()?;
                // Waits for the forward before this one.
                previous = Some(ids);
            }
            None => {
                let ids: Vec<i64> = w.input_ids.iter().map(|&x| x as i64).collect();
                let _ = model.capture_packed(&Tensor::from_slice(&ids).to_device(device), &lens, layer_ids);
            }
        }
    }
    drop(previous);
    if let (Some(ctx), Some(start)) = (cuda, &gpu_t0) {
        let end = dflash_target::upload::GpuBusy::mark(ctx)?;
        sync_device(device);
        gpu_window_ms = start.elapsed_ms(&end).ok().map(|ms| f64::from(ms) / a.batches as f64);
        timeline_ms = off_events.iter().map(|(s, e)| (0.0, s.elapsed_ms(e).map_or(f64::NAN, f64::from))).collect();
    }
    sync_device(device);
    Ok(Timing { elapsed: t0.elapsed(), gpu_window_ms, timeline_ms, ..Timing::default() })
}

/// What the capture modes' pipelines capture.
struct Pipeline<'a> {
    dtype: DType,
    layout: Layout,
    layer_ids: &'a [i64],
}

/// Modes "async" and "sync": the forward loop and the postprocess stage
/// (a worker thread, or inline), a consumer that plays the sender.
#[allow(clippy::too_many_arguments)]
fn time_pipeline(
    a: &BenchArgs,
    inline: bool,
    cuda: &Option<std::sync::Arc<cudarc::driver::CudaContext>>,
    device: Device,
    model: TargetModel,
    batches: Vec<WorkItem>,
    setup: Pipeline,
    stop: &Stop,
) -> anyhow::Result<Timing> {
    let Pipeline { dtype, layout, layer_ids } = setup;
    let (mut forward_gpu_ms, mut idle, mut timeline_ms, mut received_ms) = (None, None, Vec::new(), Vec::new());
    let spec = FeatureSpec {
        dtype,
        layout,
        layer_ids: layer_ids.iter().map(|&i| i as u32).collect(),
        noise_std: 0.0,
        target_top_k: 0,
    };
    // The service's pipeline (`dflash_target::pipeline`): postprocessing
    // inline or behind a queue of one, four pinned buffers, no cache.
    let settings = PipelineSettings {
        spec,
        seed: 0,
        target_instance: "bench".into(),
        label: "bench".into(),
        postprocess_depth: if inline { 0 } else { 1 },
        token_budget: a.batch_tokens,
        pinned_buffers: 4,
        feature_cache_bytes: 0,
    };
    let home = match (cuda, device) {
        (Some(ctx), Device::Cuda(i)) => Some((ctx.clone(), i)),
        _ => None,
    };
    let (work_tx, work_rx) = flume::bounded(2);
    let (host_tx, host_rx) = flume::bounded(1);
    let stats = std::sync::Arc::new(dflash_target::forward::ForwardStats::new(1));
    let pipeline = CapturePipeline::build(model, home, settings, stats.clone(), host_tx, stop.clone())?;
    let mut workers = Vec::new();
    if let Some(worker) = pipeline.postprocess {
        let s = stop.clone();
        workers.push(std::thread::spawn(move || worker.run(s)));
    }
    let fl = pipeline.forward;
    let s = stop.clone();
    let fwd = std::thread::spawn(move || fl.run(work_rx, s));
    let feeder = std::thread::spawn(move || {
        for w in batches {
            if work_tx.send(w).is_err() {
                break;
            }
        }
    });
    // The consumer plays the sender: it drops payloads (returning
    // pinned buffers) as fast as they come.
    let mut t0 = Instant::now();
    let mut received = 0;
    for i in 0..a.warmup + a.batches {
        let Ok(batch) = host_rx.recv() else {
            break;
        };
        // Read the clock before dropping the payload: the last
        // one's drop frees the pinned pool (the pipeline has
        // ended), which takes 0.2-0.3 s on an H200 host.
        let now = Instant::now();
        received += 1;
        if i + 1 == a.warmup {
            t0 = now;
        }
        if i + 1 >= a.warmup {
            received_ms.push((now - t0).as_secs_f64() * 1e3);
        }
        drop(batch);
    }
    let el = Duration::from_secs_f64(received_ms.last().copied().unwrap_or_default() / 1e3);
    stop.stop(dflash_role::StopCause::RunCompleted);
    drop(host_rx);
    let _ = feeder.join();
    fwd.join().map_err(|_| anyhow::anyhow!("forward loop panicked"))??;
    for w in workers {
        w.join().map_err(|_| anyhow::anyhow!("postprocess panicked"))??;
    }
    anyhow::ensure!(received == a.warmup + a.batches, "the pipeline delivered {received} batches");
    let timed = stats.timed_forwards.load(std::sync::atomic::Ordering::Relaxed);
    if cuda.is_some() && timed > 0 {
        let busy = stats.busy_ns.load(std::sync::atomic::Ordering::Relaxed) as f64;
        forward_gpu_ms = Some(busy / 1e6 / timed as f64);
        let ms = |a: &std::sync::atomic::AtomicU64| a.load(std::sync::atomic::Ordering::Relaxed) as f64 / 1e6;
        timeline_ms = stats.timeline.lock().map(|t| t.clone()).unwrap_or_default();
        idle = Some((
            ms(&stats.idle_unqueued_ns) / timed as f64,
            ms(&stats.idle_ids_ns) / timed as f64,
            ms(&stats.max_gap_ns),
        ));
    }
    Ok(Timing { elapsed: el, forward_gpu_ms, idle, timeline_ms, received_ms, ..Timing::default() })
}

/// Where one forward's time goes, synchronized per stage (`--profile`).
fn profile_stages(a: &BenchArgs, config: &TargetConfig, device: Device, kind: Kind, last: i64) -> anyhow::Result<()> {
    let model = random_target(config, device, kind, last, a.parts)?;
    let w = &make_batches(1, a, config.vocab_size, 9)[0];
    let ids: Vec<i64> = w.input_ids.iter().map(|&x| x as i64).collect();
    let lens: Vec<i64> = w.seq_lengths.iter().map(|&x| x as i64).collect();
    let ids = Tensor::from_slice(&ids).to_device(device);
    let _ = model.profile_packed(&ids, &lens, last); // warm-up
    let stages = model.profile_packed(&ids, &lens, last);
    let total: f64 = stages.iter().map(|s| s.1).sum();
    println!("where a forward's time goes ({} tokens, synchronized per stage):", w.input_ids.len());
    for (stage, secs) in &stages {
        println!("  {stage:<24} {:>8.1} ms {:>5.1}%", secs * 1e3, 100.0 * secs / total);
    }
    Ok(())
}

/// The copy the postprocess stage makes, alone (`--profile` on CUDA).
fn profile_copy(
    a: &BenchArgs,
    ctx: &std::sync::Arc<cudarc::driver::CudaContext>,
    config: &TargetConfig,
    device: Device,
    kind: Kind,
    last: i64,
    layer_ids: &[i64],
) -> anyhow::Result<()> {
    // The copy the postprocess stage makes, alone: one batch's captured
    // layers into a pinned buffer on a side stream, and into pageable
    // memory (what a plain `.cpu()` does), in GB/s.
    let model = random_target(config, device, kind, last, a.parts)?;
    let w = &make_batches(1, a, config.vocab_size, 9)[0];
    let ids: Vec<i64> = w.input_ids.iter().map(|&x| x as i64).collect();
    let lens: Vec<i64> = w.seq_lengths.iter().map(|&x| x as i64).collect();
    let layers = model.capture_packed(&Tensor::from_slice(&ids).to_device(device), &lens, layer_ids);
    sync_device(device);
    let bytes: usize = layers.iter().map(|l| l.numel() * l.kind().elt_size_in_bytes()).sum();
    let stream = dflash_models::gpu::side_stream(ctx)?;
    let pool = dflash_models::gpu::pinned_pool(ctx, 1, bytes)?;
    let mut best_pinned = f64::INFINITY;
    for _ in 0..3 {
        let mut buf =
            dflash_models::gpu::PinnedBuf::new(pool.take(std::time::Duration::from_secs(1)).context("pinned")?, bytes)?;
        let t0 = Instant::now();
        let mut off = 0;
        for l in &layers {
            buf.copy_from_device_async(off, l, &stream)?;
            off += l.numel() * l.kind().elt_size_in_bytes();
        }
        dflash_models::gpu::sync(&stream)?;
        best_pinned = best_pinned.min(t0.elapsed().as_secs_f64());
    }
    let t0 = Instant::now();
    for l in &layers {
        let _ = l.to_device(Device::Cpu);
    }
    let pageable = t0.elapsed().as_secs_f64();
    println!(
        "device-to-host of one batch ({:.0} MB): pinned {:.1} ms ({:.1} GB/s), pageable {:.1} ms ({:.1} GB/s)",
        bytes as f64 / 1e6,
        best_pinned * 1e3,
        bytes as f64 / best_pinned / 1e9,
        pageable * 1e3,
        bytes as f64 / pageable / 1e9
    );
    Ok(())
}

/// The table of the modes' results.
fn print_table(results: &[ModeResult]) {
    println!(
        "{:<8} {:>10} {:>12} {:>12} {:>22} {:>12} {:>7} {:>8}",
        "mode", "step ms", "GPU step ms", "fwd GPU ms", "idle unqueued/ids/max", "tokens/s", "MFU", "vs off"
    );
    let opt = |v: Option<f64>| v.map_or("-".to_string(), |ms| format!("{ms:.1}"));
    for r in results {
        let idle = format!("{}/{}/{}", opt(r.idle_unqueued_ms), opt(r.idle_ids_ms), opt(r.max_gap_ms));
        let fwd_ms = opt(r.forward_gpu_ms.or(r.gpu_window_ms));
        println!(
            "{:<8} {:>10.1} {:>12} {:>12} {:>22} {:>12.0} {:>6.1}% {:>8.3}",
            r.mode,
            r.step_ms,
            opt(r.gpu_step_ms.or(r.gpu_window_ms)),
            fwd_ms,
            idle,
            r.tokens_per_s,
            100.0 * r.mfu,
            r.vs_off
        );
    }
}

/// The `--json` report: the results, and what a reference implementation
/// needs to run the same model shape on the same batches.
fn report_json(
    a: &BenchArgs,
    config: &TargetConfig,
    kind: Kind,
    layer_ids: &[i64],
    peak: f64,
    results: &[ModeResult],
) -> serde_json::Value {
    let v = serde_json::json!({
        "bench": "capture",
        "shape": a.shape,
        "device": a.device,
        "kind": format!("{kind:?}"),
        "captured_layers": layer_ids,
        "batch_tokens": a.batch_tokens,
        "seq_len_range": [a.min_len, a.max_len],
        "layout": a.layout,
        "parts": a.parts,
        "cudnn_attention": a.cudnn_attention,
        "matmul_peak_flops": peak,
        "results": results,
        // What a reference implementation needs to run the same model
        // shape on the same batches (scripts/reference/hf_capture.py).
        "target_config": config.to_hf_json(),
        // How the FLOPs are counted, per layer, for the reference to count alike.
        "layer_linear_macs": (0..config.num_layers).map(|i| config.layer_linear_macs(i)).collect::<Vec<_>>(),
        // Per layer, the attention FLOPs of one query-key pair (0: no
        // softmax attention) and the window of sliding layers: the
        // reference counts its pairs alike.
        "attention_pair_flops": (0..config.num_layers)
            .map(|i| config.attention_flops(i, 1))
            .collect::<Vec<_>>(),
        "attention_window": (0..config.num_layers)
            .map(|i| match config.layer_kind(i) {
                dflash_models::LayerKind::SlidingAttention => config.sliding_window,
                _ => None,
            })
            .collect::<Vec<_>>(),
        "timed_seq_lengths": make_batches(a.warmup + a.batches, a, config.vocab_size, 7)[a.warmup..]
            .iter()
            .map(|w| w.seq_lengths.clone())
            .collect::<Vec<_>>(),
    });
    v
}

pub fn run(a: &BenchArgs) -> anyhow::Result<()> {
    if a.threads > 0 {
        tch::set_num_threads(a.threads);
    }
    let config = crate::cli_args::shape(&a.shape)?;
    let device = crate::cli_args::device(&a.device)?;
    let dtype = DType::compute(dflash_config::ComputeDtype::Auto, device.is_cuda());
    let kind = dflash_models::features::kind_of(dtype);
    if device.is_cuda() {
        // As the target service runs on GPUs.
        dflash_models::cuda::set_cudnn_attention(a.cudnn_attention);
    }
    let _guard = tch::no_grad_guard();
    let peak = matmul_peak(device, kind);
    let mut layer_ids: Vec<i64> = dflash_config::default_target_layer_ids(config.num_layers as u32, a.layers)
        .into_iter()
        .map(i64::from)
        .collect();
    layer_ids.dedup();
    let last = *layer_ids.iter().max().expect("layers");
    let layout = if a.layout == "packed" { Layout::Packed } else { Layout::Split };
    println!(
        "bench-capture: {} target ({} of {} layers, capturing {layer_ids:?}), {kind:?} on {device:?} in {} part(s), {} tokens/batch of {}-{}-token sequences, {layout:?}, cuDNN attention {}",
        a.shape,
        last + 1,
        config.num_layers,
        a.parts,
        a.batch_tokens,
        a.min_len,
        a.max_len,
        if device.is_cuda() && dflash_models::cuda::cudnn_attention_enabled() { "on" } else { "off" }
    );
    println!("measured {kind:?} matmul peak: {:.1} GFLOP/s", peak / 1e9);
    let cuda = match device {
        Device::Cuda(i) => Some(dflash_models::gpu::context(i)?),
        _ => None,
    };
    let mut results: Vec<ModeResult> = Vec::new();
    let mut off_ms = f64::NAN;
    for mode in a.modes.split(',').map(str::trim) {
        let model = random_target(&config, device, kind, last, a.parts)?;
        let batches = make_batches(a.warmup + a.batches, a, config.vocab_size, 7);
        let timed: Vec<usize> = batches[a.warmup..].iter().map(|w| w.input_ids.len()).collect();
        let lens: Vec<usize> =
            batches[a.warmup..].iter().flat_map(|w| w.seq_lengths.iter().map(|&l| l as usize)).collect();
        let flops = capture_flops(&config, last + 1, &lens);
        let tokens: usize = timed.iter().sum();
        let stop = Stop::new();
        let t = match mode {
            "off" => time_off(a, &cuda, device, &model, &batches, &layer_ids, &stop)?,
            "async" | "sync" => {
                let setup = Pipeline { dtype, layout, layer_ids: &layer_ids };
                time_pipeline(a, mode == "sync", &cuda, device, model, batches, setup, &stop)?
            }
            other => anyhow::bail!("unknown mode {other} (off, async, sync)"),
        };
        let Timing { elapsed, forward_gpu_ms, idle, gpu_window_ms, timeline_ms, received_ms } = t;
        let secs = elapsed.as_secs_f64();
        let step_ms = 1e3 * secs / a.batches as f64;
        if mode == "off" {
            off_ms = step_ms;
        }
        let timed_forwards = timeline_ms.get(a.warmup..a.warmup + a.batches).filter(|_| mode != "off");
        let gpu_step_ms = timed_forwards.map(|t| t.iter().map(|(g, b)| g + b).sum::<f64>() / a.batches as f64);
        results.push(ModeResult {
            mode: mode.to_string(),
            step_ms,
            forward_gpu_ms,
            idle_unqueued_ms: idle.map(|i| i.0),
            idle_ids_ms: idle.map(|i| i.1),
            max_gap_ms: idle.map(|i| i.2),
            gpu_window_ms,
            timeline_ms,
            received_ms,
            gpu_step_ms,
            tokens_per_s: tokens as f64 / secs,
            mfu: flops / secs / peak,
            vs_off: step_ms / off_ms,
        });
    }
    if a.profile {
        profile_stages(a, &config, device, kind, last)?;
        if let Some(ctx) = &cuda {
            profile_copy(a, ctx, &config, device, kind, last, &layer_ids)?;
        }
    }
    print_table(&results);
    if let Some(p) = &a.json {
        let v = report_json(a, &config, kind, &layer_ids, peak, &results);
        std::fs::write(p, serde_json::to_string_pretty(&v)?)?;
    }
    Ok(())
}
