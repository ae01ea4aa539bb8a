//! The forward loop of one target device: token batch in, captured layers
//! out. It never waits on postprocessing beyond the postprocess queue's
//! bound (`pipeline.target_postprocess_depth`).

use std::time::{Duration, Instant};

use dflash_models::{TargetModel, TopK};
use dflash_role::Stop;
use tch::Tensor;

use crate::captured::CapturedBatch;
use crate::feature_cache::FeatureCache;
use crate::postprocess::PostprocessSink;
use crate::upload::{GpuBusy, GpuTimes, IdsUploader, UploadedIds};
use crate::work::WorkItem;

/// Forwards whose timing `ForwardStats::timeline` keeps.
pub const TIMELINE_CAP: usize = 1024;

/// What the forward loops of a target did, for the coordinator's supply
/// and demand view.
pub struct ForwardStats {
    pub tokens: std::sync::atomic::AtomicU64,
    pub busy_ns: std::sync::atomic::AtomicU64,
    /// Forwards whose GPU time `busy_ns` holds (on CUDA the last few are
    /// still pending when a run ends).
    pub timed_forwards: std::sync::atomic::AtomicU64,
    /// On CUDA: GPU time idle between forwards because the next one was
    /// not queued yet, and with it queued but waiting for its ids upload;
    /// the longest single gap.
    pub idle_unqueued_ns: std::sync::atomic::AtomicU64,
    pub idle_ids_ns: std::sync::atomic::AtomicU64,
    pub max_gap_ns: std::sync::atomic::AtomicU64,
    /// On CUDA: the first forwards' (idle before, GPU time) in ms, for
    /// benchmarks (bounded: `TIMELINE_CAP` entries).
    pub timeline: std::sync::Mutex<Vec<(f64, f64)>>,
    pub started: Instant,
    pub loops: usize,
}

impl ForwardStats {
    pub fn new(loops: usize) -> Self {
        Self {
            tokens: Default::default(),
            busy_ns: Default::default(),
            timed_forwards: Default::default(),
            idle_unqueued_ns: Default::default(),
            idle_ids_ns: Default::default(),
            max_gap_ns: Default::default(),
            timeline: Default::default(),
            started: Instant::now(),
            loops: loops.max(1),
        }
    }

    /// Adds what `GpuBusy::collect` found (CUDA).
    fn record_gpu(&self, g: &GpuTimes) {
        use std::sync::atomic::Ordering::Relaxed;
        self.busy_ns.fetch_add(g.busy.as_nanos() as u64, Relaxed);
        self.timed_forwards.fetch_add(g.forwards, Relaxed);
        self.idle_unqueued_ns.fetch_add(g.idle_unqueued.as_nanos() as u64, Relaxed);
        self.idle_ids_ns.fetch_add(g.idle_ids.as_nanos() as u64, Relaxed);
        self.max_gap_ns.fetch_max(g.max_gap.as_nanos() as u64, Relaxed);
        let idle = &dflash_telemetry::metrics().gpu_idle_seconds;
        idle.with_label_values(&["unqueued"]).inc_by(g.idle_unqueued.as_secs_f64());
        idle.with_label_values(&["ids"]).inc_by(g.idle_ids.as_secs_f64());
        let mut log = self.timeline.lock().expect("timeline lock");
        let room = TIMELINE_CAP.saturating_sub(log.len());
        log.extend(g.timeline.iter().take(room));
    }

    /// (tokens produced, fraction of the loops' wall time spent computing).
    pub fn load(&self) -> (u64, f32) {
        use std::sync::atomic::Ordering::Relaxed;
        let wall = self.started.elapsed().as_nanos() as f64 * self.loops as f64;
        (self.tokens.load(Relaxed), (self.busy_ns.load(Relaxed) as f64 / wall.max(1.0)) as f32)
    }
}

/// One device's forward loop: takes a work item, computes (or takes from
/// the cache) its captured layers, hands them to postprocessing.
pub struct ForwardLoop {
    pub(crate) stats: std::sync::Arc<ForwardStats>,
    pub(crate) model: TargetModel,
    pub(crate) layer_ids: Vec<i64>,
    /// Distillation: how many next tokens per position to ship (0: none).
    pub(crate) top_k: i64,
    pub(crate) label: String,
    /// The device's CUDA context and the ids uploader (None on CPU).
    pub(crate) cuda: Option<CudaFeed>,
    /// Features of sequences already computed, reused in later epochs.
    pub(crate) cache: FeatureCache,
    /// Where captured batches go.
    pub(crate) sink: PostprocessSink,
}

/// How a CUDA forward loop gets its inputs onto the device, and the devices
/// whose work a batch's events mark.
pub struct CudaFeed {
    /// The home device: ids go in there.
    pub ctx: std::sync::Arc<cudarc::driver::CudaContext>,
    pub upload: IdsUploader,
    /// Every device of the instance, the home device first: one for a
    /// one-GPU instance, one per distinct GPU of a split one.
    pub devices: Vec<std::sync::Arc<cudarc::driver::CudaContext>>,
}

impl CudaFeed {
    /// Uploads for batches of up to `max_tokens`, `in_flight` at a time, on
    /// an instance of one GPU.
    pub fn new(
        ctx: &std::sync::Arc<cudarc::driver::CudaContext>,
        ordinal: usize,
        max_tokens: usize,
        in_flight: usize,
    ) -> anyhow::Result<Self> {
        Ok(Self {
            ctx: ctx.clone(),
            upload: IdsUploader::new(ctx, ordinal, max_tokens, in_flight)?,
            devices: vec![ctx.clone()],
        })
    }

    /// The same feed for an instance over `devices` (the home device first).
    pub fn over(mut self, devices: Vec<std::sync::Arc<cudarc::driver::CudaContext>>) -> Self {
        debug_assert!(devices.first().is_some_and(|d| d.ordinal() == self.ctx.ordinal()), "home device first");
        self.devices = devices;
        self
    }

    /// An event after everything queued so far on each device's libtorch
    /// stream: postprocessing waits on them, the forward loop does not.
    fn record_ready(&self) -> anyhow::Result<Vec<cudarc::driver::CudaEvent>> {
        Ok(self.devices.iter().map(dflash_models::gpu::record_torch_event).collect::<Result<_, _>>()?)
    }
}

/// The captured layers of one batch, before they become a [`CapturedBatch`].
struct Forwarded {
    layers: Vec<Tensor>,
    top_k: Option<TopK>,
    ready: Vec<cudarc::driver::CudaEvent>,
    ids: Option<UploadedIds>,
    from_cache: bool,
}

impl ForwardLoop {
    /// Runs until the input closes or the role stops.
    pub fn run(mut self, input: flume::Receiver<WorkItem>, stop: Stop) -> anyhow::Result<()> {
        let mut progress = LoopProgress::new();
        let mut gpu_busy = GpuBusy::default();
        while let Some(mut work) = dflash_role::recv_until_stop(&input, &stop) {
            let span = dflash_telemetry::batch_span("forward", &work.trace, work.batch_id);
            let entered = span.enter();
            let t0 = Instant::now();
            let f = self.forward(&work, &mut gpu_busy, &stop)?;
            // On CUDA the loop runs ahead of the GPU: busy time is the GPU's.
            let (spent, timed) = if self.cuda.is_some() {
                let g = gpu_busy.collect();
                self.stats.record_gpu(&g);
                (g.busy, g.forwards)
            } else {
                (t0.elapsed(), 1)
            };
            drop(entered);
            work.trace = dflash_telemetry::context_of(&span);
            self.record(&mut progress, work.input_ids.len() as u64, spent, timed, f.from_cache, input.len());
            tracing::debug!(batch = work.batch_id, "forward queued");
            let forward_span = self.cuda.is_some().then_some(span);
            let captured =
                CapturedBatch { work, layers: f.layers, top_k: f.top_k, ready: f.ready, ids: f.ids, forward_span };
            if !self.sink.push(captured, &stop)? {
                break;
            }
        }
        // The last forwards end after the loop has: count them too.
        if self.cuda.is_some() {
            self.stats.record_gpu(&gpu_busy.drain(Duration::from_secs(5)));
        }
        Ok(())
    }

    /// The batch's captured layers: from the feature cache when every
    /// sequence is in it, else from a forward (which fills the cache).
    fn forward(&mut self, work: &WorkItem, gpu_busy: &mut GpuBusy, stop: &Stop) -> anyhow::Result<Forwarded> {
        let lens: Vec<i64> = work.seq_lengths.iter().map(|&l| l as i64).collect();
        if let Some(mut layers) = self.cache.assemble(&work.sample_ids) {
            let ready = match &self.cuda {
                Some(feed) => feed.record_ready()?,
                None => Vec::new(),
            };
            // The cache holds the top-k after the layers, as two more tensors.
            let top_k = (self.top_k > 0).then(|| {
                let log_probs = layers.pop().expect("cached with the top-k");
                TopK { ids: layers.pop().expect("cached with the top-k"), log_probs }
            });
            return Ok(Forwarded { layers, top_k, ready, ids: None, from_cache: true });
        }
        let f = match &self.cuda {
            Some(feed) => {
                let queued = GpuBusy::mark(&feed.ctx)?;
                let mut ids = feed.upload.upload(&work.input_ids, stop)?;
                let start = GpuBusy::mark(&feed.ctx)?;
                let (layers, top_k) = self.capture(ids.tensor(), &lens);
                // Kernel launches are asynchronous: record where the forward
                // ends and move on; postprocessing waits on the event.
                gpu_busy.finish(&feed.ctx, queued, start)?;
                ids.release_after_torch_work()?;
                let ready = feed.record_ready()?;
                Forwarded { layers, top_k, ready, ids: Some(ids), from_cache: false }
            }
            None => {
                let ids: Vec<i64> = work.input_ids.iter().map(|&i| i as i64).collect();
                let ids = Tensor::from_slice(&ids).to_device(self.model.device);
                let (layers, top_k) = self.capture(&ids, &lens);
                Forwarded { layers, top_k, ready: Vec::new(), ids: None, from_cache: false }
            }
        };
        if self.cache.enabled() {
            let mut per_token: Vec<Tensor> = f.layers.iter().map(Tensor::shallow_clone).collect();
            if let Some(t) = &f.top_k {
                per_token.extend([t.ids.shallow_clone(), t.log_probs.shallow_clone()]);
            }
            self.cache.insert(&work.sample_ids, &work.seq_lengths, &per_token);
        }
        Ok(f)
    }

    /// The captured layers, and (distillation) the top-k next tokens, each
    /// on the device that computed it: a split instance's home device never
    /// waits for its later parts, so it takes the next batch while they
    /// finish this one (ARCHITECTURE.md, "Targets larger than one device").
    fn capture(&self, ids: &Tensor, lens: &[i64]) -> (Vec<Tensor>, Option<TopK>) {
        self.model.capture_packed_in_place(ids, lens, &self.layer_ids, self.top_k)
    }

    /// Counts one batch in the metrics, the shared stats and the periodic log line.
    fn record(&self, p: &mut LoopProgress, tokens: u64, spent: Duration, timed: u64, hit: bool, queued: usize) {
        use std::sync::atomic::Ordering::Relaxed;
        p.batches += 1;
        p.tokens += tokens;
        p.busy += spent;
        p.hits += hit as u64;
        let m = dflash_telemetry::metrics();
        m.tokens.with_label_values(&["captured"]).inc_by(tokens);
        m.batches.with_label_values(&["captured"]).inc();
        if hit {
            m.batches.with_label_values(&["cache_hit"]).inc();
        }
        m.idle_fraction.with_label_values(&["forward"]).set(1.0 - p.busy_fraction());
        m.queue_depth.with_label_values(&["work"]).set(queued as i64);
        self.stats.tokens.fetch_add(tokens, Relaxed);
        if self.cuda.is_none() {
            self.stats.busy_ns.fetch_add(spent.as_nanos() as u64, Relaxed);
            self.stats.timed_forwards.fetch_add(timed, Relaxed);
        }
        if p.batches.is_multiple_of(50) {
            let cache = if self.cache.enabled() {
                format!(
                    ", {} from the feature cache ({} sequences, {} MiB)",
                    p.hits,
                    self.cache.len(),
                    self.cache.used_bytes() >> 20
                )
            } else {
                String::new()
            };
            tracing::info!(
                "{}: {} batches, {:.0} tokens/s, forward busy {:.0}%{cache}",
                self.label,
                p.batches,
                p.tokens as f64 / p.started.elapsed().as_secs_f64(),
                100.0 * p.busy_fraction()
            );
        }
    }
}

/// What one forward loop has done since it started (for its log line).
struct LoopProgress {
    batches: u64,
    hits: u64,
    tokens: u64,
    busy: Duration,
    started: Instant,
}

impl LoopProgress {
    fn new() -> Self {
        Self { batches: 0, hits: 0, tokens: 0, busy: Duration::ZERO, started: Instant::now() }
    }

    fn busy_fraction(&self) -> f64 {
        self.busy.as_secs_f64() / self.started.elapsed().as_secs_f64().max(1e-9)
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use dflash_models::{LoadScope, TargetModel};
    use dflash_role::Stop;
    use dflash_wire::{DType, FeatureSpec, HostBatch, Layout};
    use tch::Kind;

    use super::*;
    use crate::leases::Leases;
    use crate::postprocess::Postprocessor;

    fn item(batch_id: u64, samples: &[(u64, Vec<u32>)]) -> WorkItem {
        WorkItem {
            batch_id,
            epoch: 0,
            sample_ids: samples.iter().map(|s| s.0).collect(),
            seq_lengths: samples.iter().map(|s| s.1.len() as u32).collect(),
            input_ids: samples.iter().flat_map(|s| s.1.iter().copied()).collect(),
            loss_mask: samples.iter().flat_map(|s| vec![1u8; s.1.len()]).collect(),
            trace: Default::default(),
            lease: Leases::new().hold(batch_id, Default::default()),
            lease_token: Vec::new(),
        }
    }

    /// Runs a real forward loop over the tiny Llama fixture (CPU) and returns
    /// the host batches it produced, and how many it took from the cache.
    /// With `top_k` > 0 it also ships the target's top-k next tokens.
    fn run_loop(cache_bytes: usize, work: Vec<WorkItem>, top_k: u32) -> (Vec<HostBatch>, u64) {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny-llama");
        let scope = if top_k > 0 { LoadScope::Full } else { LoadScope::CaptureUpTo { last_layer: 1 } };
        let model = TargetModel::load(&dir, tch::Device::Cpu, Kind::Float, scope).expect("tiny llama loads");
        let stop = Stop::new();
        let post = Postprocessor {
            spec: FeatureSpec {
                dtype: DType::F32,
                layout: Layout::Split,
                layer_ids: vec![0, 1],
                noise_std: 0.0,
                target_top_k: top_k,
            },
            seed: 0,
            target_instance: "test".into(),
            gpu: None,
            stop: stop.clone(),
        };
        let (work_tx, work_rx) = flume::bounded(work.len());
        let (host_tx, host_rx) = flume::bounded(work.len());
        let fl = ForwardLoop {
            stats: std::sync::Arc::new(ForwardStats::new(1)),
            model,
            layer_ids: vec![0, 1],
            top_k: top_k as i64,
            label: "test".into(),
            cuda: None,
            cache: FeatureCache::new(cache_bytes),
            sink: PostprocessSink::Inline(post, host_tx),
        };
        let before = dflash_telemetry::metrics().batches.with_label_values(&["cache_hit"]).get();
        for w in work {
            work_tx.send(w).expect("queue has room");
        }
        drop(work_tx);
        fl.run(work_rx, stop).expect("loop runs");
        let hits = dflash_telemetry::metrics().batches.with_label_values(&["cache_hit"]).get() - before;
        (host_rx.drain().map(|o| o.batch).collect(), hits)
    }

    fn floats(b: &[u8]) -> Vec<f32> {
        b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
    }

    /// Equal up to float rounding: the CPU matmuls block by the batch's
    /// total length, so a sequence packed with others differs in the last
    /// bits from the same sequence in another batch.
    fn assert_close(got: &[u8], want: &[u8], what: &str) {
        let (g, w) = (floats(got), floats(want));
        assert_eq!(g.len(), w.len());
        let scale = w.iter().fold(0f32, |m, x| m.max(x.abs()));
        let diff = g.iter().zip(&w).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(scale > 0.0 && diff <= 1e-5 * scale, "{what}: max |diff| {diff} (scale {scale})");
    }

    #[test]
    fn a_later_epoch_served_from_the_feature_cache_ships_what_a_fresh_forward_would() {
        let a = (10, vec![5u32, 17, 3, 99, 42, 7]);
        let b = (11, vec![8u32, 250, 1, 64]);
        let c = (12, vec![33u32, 2, 19, 5, 6, 200, 77, 12, 9]);
        // Epoch 1 computes every sequence; epoch 2 packs them differently.
        let epoch1 = [item(1, &[a.clone(), b.clone()]), item(2, std::slice::from_ref(&c))];
        let epoch2 = vec![item(3, &[c.clone(), a.clone()]), item(4, std::slice::from_ref(&b))];
        let all: Vec<WorkItem> = epoch1.iter().chain(&epoch2).cloned().collect();
        // Features only, and with distillation's top-4 next tokens after them.
        for top_k in [0, 4] {
            let (cached, hits) = run_loop(1 << 20, all.clone(), top_k);
            let (fresh, _) = run_loop(0, epoch2.clone(), top_k);
            assert!(hits >= 2, "both epoch-2 batches come from the cache (counted {hits} hits)");
            assert_eq!(cached.len(), 4);
            for (got, want) in cached[2..].iter().zip(&fresh) {
                let m = &want.meta;
                assert_eq!((got.meta.batch_id, &got.meta.seq_lengths), (m.batch_id, &m.seq_lengths));
                assert_eq!((got.meta.target_top_k, m.target_top_k), (top_k, top_k));
                let (gf, gk) = got.payload.split_at(m.feature_bytes());
                let (wf, wk) = want.payload.split_at(m.feature_bytes());
                assert_close(gf, wf, &format!("batch {} features", m.batch_id));
                assert_eq!(gk.len(), m.distill_bytes());
                // Top-k: the same ids, log-probabilities up to rounding.
                let ids = m.token_count() * top_k as usize * 4;
                assert_eq!(gk[..ids], wk[..ids], "batch {} top-k ids", m.batch_id);
                if top_k > 0 {
                    assert_close(&gk[ids..], &wk[ids..], &format!("batch {} top-k log-probabilities", m.batch_id));
                }
            }
        }
    }
}
