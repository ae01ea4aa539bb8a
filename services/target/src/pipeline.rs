//! One target instance's capture pipeline, built in one place for the
//! service and for `dflash bench-capture`: the forward loop over a loaded
//! model, its CUDA ids uploads, the feature cache, and postprocessing --
//! inline on the forward thread (depth 0) or a worker behind a bounded
//! queue -- with the pinned device-to-host buffers on a GPU. The caller owns
//! the threads: it runs [`CapturePipeline::forward`] and, if there is one,
//! [`CapturePipeline::postprocess`] each on a thread of its own.

use std::sync::Arc;

use cudarc::driver::CudaContext;
use dflash_models::{ModelError, TargetModel};
use dflash_role::{KindExt, Stop};
use dflash_telemetry::ErrorKind;
use dflash_wire::FeatureSpec;

use crate::captured::CapturedBatch;
use crate::feature_cache::FeatureCache;
use crate::forward::{CudaFeed, ForwardLoop, ForwardStats};
use crate::postprocess::{self, GpuCopy, OutboundBatch, PostprocessSink, Postprocessor};

/// What one instance's pipeline is built from.
pub struct PipelineSettings {
    /// What the drafter expects of each batch (layers, layout, dtype, noise, top-k).
    pub spec: FeatureSpec,
    /// The run's seed: noise is drawn from it and the batch id.
    pub seed: u64,
    /// This target's instance id, stamped on every batch.
    pub target_instance: String,
    /// The forward loop's name in logs.
    pub label: String,
    /// Captured batches queued for postprocessing (0: inline on the forward thread).
    pub postprocess_depth: usize,
    /// The largest batch in tokens: sizes the ids uploads and the pinned buffers.
    pub token_budget: usize,
    /// Pinned device-to-host buffers (GPU): every place a payload waits
    /// (postprocess, the sender's queue, the unacknowledged window) and one more.
    pub pinned_buffers: usize,
    /// Memory for the features of sequences already computed (0: no cache).
    pub feature_cache_bytes: usize,
}

/// The instance's CUDA device: its context and ordinal (None on a CPU).
pub type CudaHome = Option<(Arc<CudaContext>, usize)>;

/// A built pipeline, its stages not yet running.
pub struct CapturePipeline {
    /// Takes work items, hands captured batches on.
    pub forward: ForwardLoop,
    /// The postprocess worker (None when postprocessing is inline).
    pub postprocess: Option<PostprocessWorker>,
}

/// Postprocessing behind the forward loop's queue: captured batches in,
/// host batches ready for the wire out.
pub struct PostprocessWorker {
    post: Postprocessor,
    input: flume::Receiver<CapturedBatch>,
    output: flume::Sender<OutboundBatch>,
}

impl PostprocessWorker {
    /// Until the queue closes or the role stops.
    pub fn run(self, stop: Stop) -> anyhow::Result<()> {
        postprocess::worker(self.post, self.input, self.output, stop)
    }
}

impl CapturePipeline {
    /// The pipeline of `model` (whose first device is `cuda`'s, or the CPU),
    /// handing host batches to `host_tx`. On a GPU this allocates the
    /// pinned buffers, a side stream for the copies and the ids uploads.
    pub fn build(
        model: TargetModel,
        cuda: CudaHome,
        s: PipelineSettings,
        stats: Arc<ForwardStats>,
        host_tx: flume::Sender<OutboundBatch>,
        stop: Stop,
    ) -> anyhow::Result<Self> {
        let hidden = model.config.hidden_size as usize;
        let layer_ids: Vec<i64> = s.spec.layer_ids.iter().map(|&i| i as i64).collect();
        let top_k = s.spec.target_top_k as i64;
        let devices = match &cuda {
            Some((ctx, _)) => instance_devices(&model, ctx).kind(ErrorKind::Device)?,
            None => Vec::new(),
        };
        let gpu = match &cuda {
            Some((ctx, _)) => {
                let bytes = s.spec.payload_bytes(s.token_budget, hidden);
                let pool = dflash_models::gpu::pinned_pool(ctx, s.pinned_buffers, bytes).kind(ErrorKind::Device)?;
                tracing::info!(
                    "{}: {} pinned buffers of {} MiB for device-to-host copies",
                    s.label,
                    s.pinned_buffers,
                    bytes >> 20
                );
                Some(GpuCopy::new(&devices, pool).kind(ErrorKind::Device)?)
            }
            None => None,
        };
        let post = Postprocessor { spec: s.spec, seed: s.seed, target_instance: s.target_instance, gpu, stop };
        let (sink, postprocess) = if s.postprocess_depth == 0 {
            (PostprocessSink::Inline(post, host_tx), None)
        } else {
            let (cap_tx, cap_rx) = flume::bounded(s.postprocess_depth);
            (PostprocessSink::Queue(cap_tx), Some(PostprocessWorker { post, input: cap_rx, output: host_tx }))
        };
        // Ids are held by: the loop, the postprocess queue, the worker.
        let in_flight = s.postprocess_depth + 3;
        let feed = match &cuda {
            Some((ctx, ordinal)) => {
                Some(CudaFeed::new(ctx, *ordinal, s.token_budget, in_flight).kind(ErrorKind::Device)?.over(devices))
            }
            None => None,
        };
        let forward = ForwardLoop {
            stats,
            model,
            layer_ids,
            top_k,
            label: s.label,
            cuda: feed,
            cache: FeatureCache::new(s.feature_cache_bytes),
            sink,
        };
        Ok(Self { forward, postprocess })
    }
}

/// The CUDA contexts of the GPUs `model` is placed on, `home` (its first
/// part's) first, each GPU once: one for a one-GPU instance.
fn instance_devices(model: &TargetModel, home: &Arc<CudaContext>) -> Result<Vec<Arc<CudaContext>>, ModelError> {
    let mut devices = vec![home.clone()];
    for part in model.placement().parts() {
        if let tch::Device::Cuda(ordinal) = part.device
            && !devices.iter().any(|d| d.ordinal() == ordinal)
        {
            devices.push(dflash_models::gpu::context(ordinal)?);
        }
    }
    Ok(devices)
}
