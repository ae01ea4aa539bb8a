//! The postprocess pool: captured layers on the device become a host
//! payload in the run's feature layout (PACKED: [T, k*H] with noise;
//! SPLIT: k x [T, H]), owned by the batch until its bytes have left.

use bytes::Bytes;
use dflash_models::features::{add_uniform_noise, dtype_of, noise_key};
use dflash_models::gpu;
use dflash_role::{Stop, recv_until_stop, send_until_stop};
use dflash_wire::{BatchMeta, FeatureSpec, HostBatch, Layout};
use tch::Tensor;

use crate::captured::CapturedBatch;
use crate::leases::Lease;

/// Turns captured batches into host batches.
#[derive(Clone)]
pub struct Postprocessor {
    pub(crate) spec: FeatureSpec,
    /// The run's seed: noise is drawn from it and the batch id.
    pub(crate) seed: u64,
    pub(crate) target_instance: String,
    /// On CUDA: where device-to-host copies go.
    pub(crate) gpu: Option<GpuCopy>,
    pub(crate) stop: Stop,
}

/// A batch ready for the wire, with the lease the sender holds until the
/// drafter has it.
pub struct OutboundBatch {
    pub batch: HostBatch,
    pub lease: Lease,
}

/// The device-to-host path of one GPU: a side stream and a bounded pool of
/// pinned buffers that the sender hands back by dropping the payload.
#[derive(Clone)]
pub struct GpuCopy {
    pub(crate) ctx: std::sync::Arc<cudarc::driver::CudaContext>,
    pub(crate) stream: std::sync::Arc<cudarc::driver::CudaStream>,
    pub(crate) pool: gpu::Pool<gpu::PinnedMem>,
}

/// Contiguous host bytes of a tensor.
fn host_bytes(t: &Tensor) -> Bytes {
    let t = t.to_device(tch::Device::Cpu).contiguous();
    let numel = t.numel();
    let mut buf = vec![0u8; numel * t.kind().elt_size_in_bytes()];
    t.copy_data_u8(&mut buf, numel);
    Bytes::from(buf)
}

impl Postprocessor {
    /// PACKED features: the layers concatenated, noised as the spec says.
    fn packed(&self, c: &CapturedBatch) -> Tensor {
        let key = noise_key(self.seed, c.work.batch_id);
        add_uniform_noise(Tensor::cat(&c.layers, 1), self.spec.target_noise_std(), key)
    }

    /// Pinned payload of a CUDA batch: wait for the forward on the copy
    /// stream (not on the host), pack if PACKED, copy every layer into one
    /// pooled pinned buffer, and wait for the copy before the device tensors
    /// are released.
    fn gpu_payload(&self, g: &GpuCopy, c: &CapturedBatch) -> anyhow::Result<Bytes> {
        let t = c.layers[0].size()[0] as usize;
        let row = c.layers[0].size()[1] as usize * c.layers[0].kind().elt_size_in_bytes();
        let features = t * row * c.layers.len();
        let bytes = features + c.top_k.as_ref().map_or(0, |k| dflash_wire::distill_bytes(t, k.k() as usize));
        let t0 = std::time::Instant::now();
        let mem = g
            .pool
            .take_until(self.stop.channel())
            .ok_or_else(|| anyhow::anyhow!("stopped while waiting for a pinned buffer"))?;
        let took = t0.elapsed();
        let mut buf = gpu::PinnedBuf::new(mem, bytes)?;
        match self.spec.layout {
            Layout::Packed => {
                let packed = self.packed(c);
                let done = gpu::record_torch_event(&g.ctx)?;
                gpu::wait_event(&g.stream, &done)?;
                buf.copy_from_device_async(0, &packed, &g.stream)?;
                gpu::sync(&g.stream)?;
            }
            Layout::Split => {
                if let Some(ev) = &c.ready {
                    gpu::wait_event(&g.stream, ev)?;
                }
                for (i, l) in c.layers.iter().enumerate() {
                    buf.copy_from_device_async(i * t * row, l, &g.stream)?;
                }
                gpu::sync(&g.stream)?;
            }
        }
        if let Some(k) = &c.top_k {
            // Computed by the forward (already int32 and f32, contiguous: the
            // conversions are no-ops); the event orders the copy after them anyway.
            let [ids, log_probs] = k.wire_parts();
            gpu::wait_event(&g.stream, &gpu::record_torch_event(&g.ctx)?)?;
            buf.copy_from_device_async(features, &ids, &g.stream)?;
            buf.copy_from_device_async(features + t * k.k() as usize * 4, &log_probs, &g.stream)?;
            gpu::sync(&g.stream)?;
        }
        tracing::debug!(
            batch = c.work.batch_id,
            "postprocess: pinned buffer after {:.1} ms, forward done and {} MB copied after {:.1} ms more",
            took.as_secs_f64() * 1e3,
            bytes >> 20,
            (t0.elapsed() - took).as_secs_f64() * 1e3
        );
        Ok(Bytes::from_owner(buf))
    }

    pub fn process(&self, c: CapturedBatch) -> anyhow::Result<OutboundBatch> {
        let span = dflash_telemetry::batch_span("postprocess", &c.work.trace, c.work.batch_id);
        let _entered = span.enter();
        let _guard = tch::no_grad_guard();
        let first = c.layers.first().ok_or_else(|| anyhow::anyhow!("batch {}: no captured layers", c.work.batch_id))?;
        let hidden = first.size()[1] as u32;
        let dtype = dtype_of(first.kind()).filter(|&d| d == self.spec.dtype).ok_or_else(|| {
            anyhow::anyhow!("captured {:?} features; the run ships {:?}", first.kind(), self.spec.dtype)
        })?;
        let top_k = c.top_k.as_ref().map_or(0, |k| k.k() as u32);
        if top_k != self.spec.target_top_k {
            anyhow::bail!(
                "captured the top-{top_k} next tokens; the run distills from the top {}",
                self.spec.target_top_k
            );
        }
        let payload = match (&self.gpu, self.spec.layout) {
            (Some(g), _) => self.gpu_payload(g, &c)?,
            (None, layout) => {
                let features = match layout {
                    Layout::Packed => host_bytes(&self.packed(&c)),
                    Layout::Split => host_bytes(&Tensor::stack(&c.layers, 0)),
                };
                match &c.top_k {
                    None => features,
                    Some(k) => {
                        let parts = k.wire_parts();
                        Bytes::from([&features[..], &host_bytes(&parts[0])[..], &host_bytes(&parts[1])[..]].concat())
                    }
                }
            }
        };
        let w = c.work;
        let meta = BatchMeta {
            batch_id: w.batch_id,
            epoch: w.epoch,
            target_instance: self.target_instance.clone(),
            layout: self.spec.layout,
            dtype,
            seq_lengths: w.seq_lengths,
            input_ids: w.input_ids,
            loss_mask: w.loss_mask,
            layer_ids: self.spec.layer_ids.clone(),
            hidden_size: hidden,
            sample_ids: w.sample_ids,
            target_top_k: top_k,
            trace_context: dflash_telemetry::context_of(&span),
            lease_token: w.lease_token,
        };
        Ok(OutboundBatch { batch: HostBatch::new(meta, payload)?, lease: w.lease })
    }
}

/// Where the forward loop hands captured batches: a bounded queue to the
/// pool, or (depth 0) postprocessing inline on the forward thread.
pub enum PostprocessSink {
    Queue(flume::Sender<CapturedBatch>),
    Inline(Postprocessor, flume::Sender<OutboundBatch>),
}

impl PostprocessSink {
    /// Hands one batch on; false when the pipeline is closing.
    pub fn push(&self, c: CapturedBatch, stop: &Stop) -> anyhow::Result<bool> {
        match self {
            PostprocessSink::Queue(tx) => {
                let ok = send_until_stop(tx, c, stop);
                dflash_telemetry::metrics().queue_depth.with_label_values(&["postprocess"]).set(tx.len() as i64);
                Ok(ok)
            }
            PostprocessSink::Inline(p, tx) => Ok(send_until_stop(tx, p.process(c)?, stop)),
        }
    }
}

/// One postprocess worker: runs until its input closes or the role stops.
pub fn worker(
    p: Postprocessor,
    input: flume::Receiver<CapturedBatch>,
    output: flume::Sender<OutboundBatch>,
    stop: Stop,
) -> anyhow::Result<()> {
    while let Some(c) = recv_until_stop(&input, &stop) {
        if !send_until_stop(&output, p.process(c)?, &stop) {
            return Ok(());
        }
    }
    Ok(())
}
