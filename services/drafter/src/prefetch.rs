//! Prefetch: moves queued batches onto the drafter's device ahead of the
//! train step, turning SPLIT payloads into the concatenated features (and
//! adding the noise the feature spec leaves to the drafter) on the device.

use dflash_models::features::{add_uniform_noise, kind_of, noise_key};
use dflash_models::gpu;
use dflash_models::{DeviceBatch, TopK};
use dflash_role::Stop;
use dflash_wire::{FeatureSpec, HostBatch, Layout};
use tch::{Device, Kind, Tensor};

use crate::pipeline::{Arrival, Prepared, ReceivedBatch};

/// Converts host batches into device batches.
pub struct Prefetcher {
    pub device: Device,
    pub kind: Kind,
    pub spec: FeatureSpec,
    /// The run's seed: noise is drawn from it and the batch id.
    pub seed: u64,
    /// On CUDA: the copy stream and the landing buffers on the device.
    pub gpu: Option<GpuLanding>,
    pub stop: Stop,
}

/// Host-to-device path of one GPU: a side stream (copies overlap the train
/// step on torch's stream) into device buffers outside torch's allocator.
pub struct GpuLanding {
    pub ordinal: usize,
    pub stream: std::sync::Arc<cudarc::driver::CudaStream>,
    pub buffers: gpu::Pool<gpu::DeviceBuf>,
}

impl Prefetcher {
    /// `[T, k*H]` features on the device, in the drafter's kind.
    pub fn to_device(&self, b: &HostBatch, trace: &dflash_telemetry::TraceContext) -> anyhow::Result<DeviceBatch> {
        let span = dflash_telemetry::batch_span("h2d", trace, b.meta.batch_id);
        let _entered = span.enter();
        let m = &b.meta;
        let (t, k, h) = (m.token_count() as i64, m.layer_ids.len() as i64, m.hidden_size as i64);
        let kind = kind_of(m.dtype);
        // Distillation targets follow the features: a small upload of their own.
        let (features_part, top_k_part) = b.payload.split_at(m.feature_bytes());
        let target_top_k = match m.target_top_k {
            0 => None,
            top_k => Some(TopK::from_wire(top_k_part, t, top_k as i64, self.device)?),
        };
        let mut landing = None;
        let on_device = match &self.gpu {
            Some(g) => {
                let mut buf = g
                    .buffers
                    .take_until(self.stop.channel())
                    .ok_or_else(|| anyhow::anyhow!("stopped while waiting for a device buffer"))?;
                buf.copy_from_host_async(features_part, &g.stream)?;
                // The pinned payload may be reused only after the copy.
                gpu::sync(&g.stream)?;
                let dt = gpu::DeviceTensor::new(buf, &[t * k * h], kind, g.ordinal)?;
                let view = dt.tensor().to_kind(self.kind);
                landing = Some(Box::new(dt) as Box<dyn std::any::Any + Send>);
                view
            }
            None => {
                Tensor::f_from_data_size(features_part, &[t * k * h], kind)?.to_device(self.device).to_kind(self.kind)
            }
        };
        let features = match m.layout {
            // The target packed and noised already.
            Layout::Packed => on_device.view([t, k * h]),
            // k x [T, H] -> [T, k*H]: the concatenation fc expects.
            Layout::Split => add_uniform_noise(
                on_device.view([k, t, h]).permute([1, 0, 2]).contiguous().view([t, k * h]),
                self.spec.drafter_noise_std(),
                noise_key(self.seed, m.batch_id),
            ),
        };
        Ok(DeviceBatch {
            batch_id: m.batch_id,
            features,
            input_ids: m.input_ids.clone(),
            loss_mask: m.loss_mask.clone(),
            seq_lengths: m.seq_lengths.clone(),
            target_top_k,
            landing,
            trace_context: dflash_telemetry::context_of(&span),
        })
    }

    /// Runs until the queue closes or the role stops.
    pub fn run(
        self,
        input: flume::Receiver<Arrival>,
        output: flume::Sender<Prepared>,
        stop: Stop,
    ) -> anyhow::Result<()> {
        while let Some(r) = dflash_role::recv_until_stop(&input, &stop) {
            let ReceivedBatch { batch, queue_wait } = match r {
                Arrival::Batch(b) => b,
                Arrival::Rejected(r) => {
                    if !dflash_role::send_until_stop(&output, Prepared::Rejected(r), &stop) {
                        return Ok(());
                    }
                    continue;
                }
            };
            let waited = dflash_telemetry::context_of(&queue_wait);
            drop(queue_wait);
            let m = dflash_telemetry::metrics();
            m.queue_depth.with_label_values(&["hs_queue"]).set(input.len() as i64);
            let item = self.to_device(&batch, &waited)?;
            // The host payload is dropped here (after the copy), not earlier.
            drop(batch);
            if !dflash_role::send_until_stop(&output, Prepared::Batch(item), &stop) {
                return Ok(());
            }
            m.queue_depth.with_label_values(&["prefetch"]).set(output.len() as i64);
        }
        Ok(())
    }
}
