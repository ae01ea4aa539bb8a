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

/// The device-to-host path of one instance: a side stream per device and a
/// bounded pool of pinned buffers (page-locked for every GPU) that the
/// sender hands back by dropping the payload.
#[derive(Clone)]
pub struct GpuCopy {
    /// The instance's devices, the home device first (the forward's events
    /// come in this order).
    pub(crate) devices: Vec<DeviceCopy>,
    pub(crate) pool: gpu::Pool<gpu::PinnedMem>,
}

/// One device's copy stream.
#[derive(Clone)]
pub struct DeviceCopy {
    pub(crate) ctx: std::sync::Arc<cudarc::driver::CudaContext>,
    pub(crate) stream: std::sync::Arc<cudarc::driver::CudaStream>,
}

impl GpuCopy {
    /// Side streams on each of `devices` (home first), the pinned pool shared.
    pub fn new(
        devices: &[std::sync::Arc<cudarc::driver::CudaContext>],
        pool: gpu::Pool<gpu::PinnedMem>,
    ) -> Result<Self, dflash_models::ModelError> {
        let devices = devices
            .iter()
            .map(|ctx| Ok(DeviceCopy { ctx: ctx.clone(), stream: gpu::side_stream(ctx)? }))
            .collect::<Result<_, dflash_models::ModelError>>()?;
        Ok(Self { devices, pool })
    }

    /// The index in `devices` of the device `t` lives on.
    fn index_of(&self, t: &Tensor) -> anyhow::Result<usize> {
        let tch::Device::Cuda(ordinal) = t.device() else {
            anyhow::bail!("a captured tensor on {:?} in a GPU instance", t.device());
        };
        self.devices
            .iter()
            .position(|d| d.ctx.ordinal() == ordinal)
            .ok_or_else(|| anyhow::anyhow!("a captured tensor on GPU {ordinal}, not one of the instance's"))
    }

    /// Device `i`'s copy stream, its context made current for the raw
    /// driver calls that follow.
    fn bound(&self, i: usize) -> anyhow::Result<&DeviceCopy> {
        let d = &self.devices[i];
        d.ctx.bind_to_thread().map_err(|e| anyhow::anyhow!("binding GPU {}'s context: {e:?}", d.ctx.ordinal()))?;
        Ok(d)
    }

    /// Waits (on the host) for every device's copies.
    fn sync_all(&self) -> anyhow::Result<()> {
        for d in &self.devices {
            gpu::sync(&d.stream)?;
        }
        Ok(())
    }

    /// Runs `queue` (which queues copies into a pinned buffer) and then
    /// waits for every device's copies, also when `queue` failed part-way:
    /// the buffer and the device tensors must outlive the copies already
    /// queued.
    fn copies(&self, queue: impl FnOnce() -> anyhow::Result<()>) -> anyhow::Result<()> {
        let queued = queue();
        self.sync_all()?;
        queued
    }
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
    /// PACKED features: the layers concatenated, noised as the spec says,
    /// on the first layer's device. A split instance's later layers are
    /// gathered there for it (the home device's stream then waits for its
    /// later parts: only SPLIT, the default, keeps the parts overlapping).
    fn packed(&self, c: &CapturedBatch) -> Tensor {
        let key = noise_key(self.seed, c.work.batch_id);
        let home = c.layers[0].device();
        let layers: Vec<Tensor> = c.layers.iter().map(|l| l.to_device(home)).collect();
        add_uniform_noise(Tensor::cat(&layers, 1), self.spec.target_noise_std(), key)
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
                let d = g.bound(g.index_of(&packed)?)?;
                let done = gpu::record_torch_event(&d.ctx)?;
                gpu::wait_event(&d.stream, &done)?;
                g.copies(|| Ok(buf.copy_from_device_async(0, &packed, &d.stream)?))?;
            }
            Layout::Split => {
                debug_assert_eq!(g.devices.len(), c.ready.len(), "one event per device of the instance");
                // Each device's copies wait for that device's share of the
                // forward only, never for another device's.
                for (d, ev) in g.devices.iter().zip(&c.ready) {
                    gpu::wait_event(&d.stream, ev)?;
                }
                let on: Vec<usize> = c.layers.iter().map(|l| g.index_of(l)).collect::<anyhow::Result<_>>()?;
                g.copies(|| {
                    for (i, (l, &d)) in c.layers.iter().zip(&on).enumerate() {
                        buf.copy_from_device_async(i * t * row, l, &g.bound(d)?.stream)?;
                    }
                    Ok(())
                })?;
            }
        }
        if let Some(k) = &c.top_k {
            // Computed by the forward on the last part's device (already int32
            // and f32, contiguous: the conversions are no-ops); the event
            // orders the copy after them anyway.
            let [ids, log_probs] = k.wire_parts();
            let d = g.bound(g.index_of(&ids)?)?;
            gpu::wait_event(&d.stream, &gpu::record_torch_event(&d.ctx)?)?;
            g.copies(|| {
                buf.copy_from_device_async(features, &ids, &d.stream)?;
                Ok(buf.copy_from_device_async(features + t * k.k() as usize * 4, &log_probs, &d.stream)?)
            })?;
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
