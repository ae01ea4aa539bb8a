//! Token ids onto the GPU ahead of the forward that reads them.
//!
//! `Tensor::to_device` from pageable memory first waits for everything queued
//! on torch's stream, then copies: the forward loop stalled each batch until
//! the previous forward had ended, and the tiny copy started at the very
//! moment that batch's device-to-host copy did. Here the ids go through
//! pinned memory on a side stream as soon as the batch arrives, and torch's
//! stream waits for that copy on the GPU: the loop queues the next forward
//! behind the current one and never waits on the host.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::{CudaContext, CudaEvent, CudaStream, sys};
use dflash_models::gpu::{self, DeviceBuf, DeviceTensor, PinnedBuf, PinnedMem, Pool};
use dflash_role::Stop;
use tch::{Kind, Tensor};

/// Uploads the ids of one device's batches (pooled pinned staging and
/// device buffers, so at most `count` batches are in flight).
pub struct IdsUploader {
    ctx: Arc<CudaContext>,
    ordinal: usize,
    stream: Arc<CudaStream>,
    staging: Pool<PinnedMem>,
    device: Pool<DeviceBuf>,
    max_tokens: usize,
}

/// Ids on the device. Its buffers return to their pools only once the
/// forward that reads them is done: dropping waits for that (or, before a
/// forward was attached, for the copy itself).
pub struct UploadedIds {
    ids: DeviceTensor,
    _staging: PinnedBuf,
    copied: CudaEvent,
    read: Option<CudaEvent>,
    ctx: Arc<CudaContext>,
}

impl UploadedIds {
    pub fn tensor(&self) -> &Tensor {
        self.ids.tensor()
    }

    /// Ties the buffers to the work queued on torch's stream so far (the
    /// forward that reads the ids).
    pub fn release_after_torch_work(&mut self) -> anyhow::Result<()> {
        self.read = Some(gpu::record_torch_event(&self.ctx)?);
        Ok(())
    }
}

impl Drop for UploadedIds {
    fn drop(&mut self) {
        // Errors here mean the context is gone; nothing can still read.
        let _ = self.read.as_ref().unwrap_or(&self.copied).synchronize();
    }
}

fn take<T>(pool: &Pool<T>, stop: &Stop, what: &str) -> anyhow::Result<gpu::Pooled<T>> {
    pool.take_until(stop.channel()).ok_or_else(|| anyhow::anyhow!("stopped while waiting for {what}"))
}

impl IdsUploader {
    /// `count` buffer pairs for batches of up to `max_tokens` tokens.
    pub fn new(ctx: &Arc<CudaContext>, ordinal: usize, max_tokens: usize, count: usize) -> anyhow::Result<Self> {
        let bytes = max_tokens.max(1) * 8;
        Ok(Self {
            ctx: Arc::clone(ctx),
            ordinal,
            stream: gpu::side_stream(ctx)?,
            staging: gpu::pinned_pool(ctx, count, bytes)?,
            device: Pool::new((0..count).map(|_| DeviceBuf::new(ctx, bytes)).collect::<Result<_, _>>()?),
            max_tokens,
        })
    }

    /// Starts copying `ids` (as int64) to the device; torch's stream will
    /// wait for the copy before anything queued after this call.
    pub fn upload(&self, ids: &[u32], stop: &Stop) -> anyhow::Result<UploadedIds> {
        anyhow::ensure!(
            ids.len() <= self.max_tokens,
            "a batch of {} tokens exceeds pipeline.token_budget ({})",
            ids.len(),
            self.max_tokens
        );
        let mut staging = PinnedBuf::new(take(&self.staging, stop, "an ids staging buffer")?, ids.len() * 8)?;
        for (dst, &id) in staging.as_mut_slice().chunks_exact_mut(8).zip(ids) {
            dst.copy_from_slice(&i64::from(id).to_le_bytes());
        }
        let mut dev = take(&self.device, stop, "an ids device buffer")?;
        dev.copy_from_host_async(staging.as_ref(), &self.stream)?;
        let copied = self.stream.record_event(None).map_err(|e| anyhow::anyhow!("recording an event: {e:?}"))?;
        gpu::wait_event(&gpu::torch_stream(&self.ctx), &copied)?;
        let ids = DeviceTensor::new(dev, &[ids.len() as i64], Kind::Int64, self.ordinal)?;
        Ok(UploadedIds { ids, _staging: staging, copied, read: None, ctx: Arc::clone(&self.ctx) })
    }
}

/// GPU time spent in forwards, and GPU time idle between them, from timing
/// events around each: the loop no longer waits for the GPU, so its own
/// clock cannot tell.
#[derive(Default)]
pub struct GpuBusy {
    pending: VecDeque<ForwardEvents>,
    last_end: Option<CudaEvent>,
}

/// Timing events of one forward on torch's stream.
pub struct ForwardEvents {
    /// Recorded before the forward's inputs were queued: completes when the
    /// previous forward does, or when recorded if the loop came late.
    queued: CudaEvent,
    /// After torch's stream has waited for the ids upload.
    start: CudaEvent,
    end: CudaEvent,
}

/// What `GpuBusy::collect` found for the forwards finished since the last
/// call.
#[derive(Debug, Default, Clone)]
pub struct GpuTimes {
    /// GPU time inside the forwards.
    pub busy: Duration,
    pub forwards: u64,
    /// GPU idle because the next forward was not queued yet (the loop was
    /// late: waiting for work, buffers or the postprocess queue).
    pub idle_unqueued: Duration,
    /// GPU idle with the next forward queued, waiting for its ids upload.
    pub idle_ids: Duration,
    /// The longest single gap between two forwards.
    pub max_gap: Duration,
    /// Each forward's (idle before it, GPU time) in ms, in order.
    pub timeline: Vec<(f64, f64)>,
}

fn timing_event(ctx: &Arc<CudaContext>) -> anyhow::Result<CudaEvent> {
    gpu::torch_stream(ctx)
        .record_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
        .map_err(|e| anyhow::anyhow!("recording a timing event: {e:?}"))
}

fn between(a: &CudaEvent, b: &CudaEvent) -> Duration {
    a.elapsed_ms(b).map_or(Duration::ZERO, |ms| Duration::from_secs_f64(f64::from(ms.max(0.0)) / 1e3))
}

impl GpuBusy {
    /// Marks a point on torch's stream (before and after a forward's
    /// inputs are queued).
    pub fn mark(ctx: &Arc<CudaContext>) -> anyhow::Result<CudaEvent> {
        timing_event(ctx)
    }

    /// Marks the end of a forward queued between `queued` and `start`.
    pub fn finish(&mut self, ctx: &Arc<CudaContext>, queued: CudaEvent, start: CudaEvent) -> anyhow::Result<()> {
        self.pending.push_back(ForwardEvents { queued, start, end: timing_event(ctx)? });
        Ok(())
    }

    /// Times of the forwards still pending, waiting up to `limit` for the
    /// last of them (the loop has ended; they would go uncounted).
    pub fn drain(&mut self, limit: Duration) -> GpuTimes {
        let deadline = std::time::Instant::now() + limit;
        while self.pending.back().is_some_and(|f| !f.end.is_complete()) && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
        self.collect()
    }

    /// Times of the forwards finished since the last call. Pending entries
    /// are bounded by the batches in flight (the upload pools).
    pub fn collect(&mut self) -> GpuTimes {
        let mut t = GpuTimes::default();
        while self.pending.front().is_some_and(|f| f.end.is_complete()) {
            let f = self.pending.pop_front().expect("checked");
            let busy = between(&f.start, &f.end);
            t.busy += busy;
            t.forwards += 1;
            let mut gap = Duration::ZERO;
            if let Some(prev) = &self.last_end {
                let unqueued = between(prev, &f.queued);
                let ids = between(&f.queued, &f.start);
                t.idle_unqueued += unqueued;
                t.idle_ids += ids;
                gap = unqueued + ids;
                t.max_gap = t.max_gap.max(gap);
            }
            t.timeline.push((gap.as_secs_f64() * 1e3, busy.as_secs_f64() * 1e3));
            self.last_end = Some(f.end);
        }
        t
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two forwards on torch's stream with the host 50 ms late for the
    /// second: the gap shows as `unqueued`; a fourth queued while the
    /// third runs shows none.
    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn gpu_busy_tells_a_late_launch_from_back_to_back_forwards() {
        let device = dflash_models::cuda::tch_device(Some(0)).expect("a CUDA device");
        let ctx = gpu::context(0).expect("CUDA context");
        let a = Tensor::randn([4096, 4096], (Kind::Float, device));
        let forward = |busy: &mut GpuBusy| {
            let queued = GpuBusy::mark(&ctx).expect("event");
            let start = GpuBusy::mark(&ctx).expect("event");
            for _ in 0..20 {
                let _ = a.matmul(&a);
            }
            busy.finish(&ctx, queued, start).expect("event");
        };
        let mut busy = GpuBusy::default();
        forward(&mut busy);
        tch::Cuda::synchronize(0);
        std::thread::sleep(Duration::from_millis(50));
        forward(&mut busy); // launched 50 ms after the GPU ran dry
        let t = busy.drain(Duration::from_secs(10));
        assert_eq!(t.forwards, 2);
        assert!(t.idle_unqueued >= Duration::from_millis(45), "{t:?}");
        assert!(t.busy > Duration::ZERO);
        forward(&mut busy);
        forward(&mut busy); // queued behind the one before
        let t = busy.drain(Duration::from_secs(10));
        assert_eq!(t.forwards, 2);
        assert!(t.timeline[1].0 < 0.5, "the back-to-back forward's gap: {t:?}");
    }
}
