//! CUDA memory and streams next to libtorch, through cudarc (same primary
//! context): pinned host buffers from a bounded pool, device buffers outside
//! torch's caching allocator, side streams and events.
//!
//! Ownership is the safety argument: a [`PinnedBuf`] returns to its pool
//! only when dropped, and it is dropped only after the copy that fills or
//! drains it has completed (callers synchronize the stream first); a
//! [`DeviceBuf`] is freed only when the batch that owns it is dropped.

use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::{CudaContext, CudaEvent, CudaStream, result, sys};
use tch::{Kind, Tensor};

use crate::ModelError;

fn cuda_err(what: &str, e: impl std::fmt::Debug) -> ModelError {
    ModelError::Device(format!("{what}: {e:?}"))
}

/// The CUDA context of one GPU (the primary context libtorch uses too).
pub fn context(ordinal: usize) -> Result<Arc<CudaContext>, ModelError> {
    // SAFETY: only probes whether libcuda can be loaded.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(ModelError::Device("libcuda is not present on this host".into()));
    }
    CudaContext::new(ordinal).map_err(|e| cuda_err(&format!("CUDA context of GPU {ordinal}"), e))
}

/// The legacy default stream, where libtorch launches its kernels.
pub fn torch_stream(ctx: &Arc<CudaContext>) -> Arc<CudaStream> {
    ctx.default_stream()
}

/// Records an event after everything queued so far on libtorch's stream.
pub fn record_torch_event(ctx: &Arc<CudaContext>) -> Result<CudaEvent, ModelError> {
    torch_stream(ctx).record_event(None).map_err(|e| cuda_err("recording an event", e))
}

/// A bounded pool of reusable resources: taking waits when all are in use;
/// a taken item returns when its guard drops. The free items sit in a
/// bounded channel, so a wait for one can also wait on a stop signal.
pub struct Pool<T> {
    free: flume::Receiver<T>,
    give_back: flume::Sender<T>,
}

impl<T> Clone for Pool<T> {
    fn clone(&self) -> Self {
        Self { free: self.free.clone(), give_back: self.give_back.clone() }
    }
}

/// An item taken from a [`Pool`]; returns to it on drop.
pub struct Pooled<T> {
    item: Option<T>,
    give_back: flume::Sender<T>,
}

impl<T> Pool<T> {
    pub fn new(items: Vec<T>) -> Self {
        let (give_back, free) = flume::bounded(items.len().max(1));
        for item in items {
            assert!(give_back.try_send(item).is_ok(), "the channel holds every item");
        }
        Self { free, give_back }
    }

    fn guard(&self, item: T) -> Pooled<T> {
        Pooled { item: Some(item), give_back: self.give_back.clone() }
    }

    /// A free item, waiting up to `timeout`; None on timeout.
    pub fn take(&self, timeout: Duration) -> Option<Pooled<T>> {
        self.free.recv_timeout(timeout).ok().map(|item| self.guard(item))
    }

    /// A free item, waiting as long as it takes unless `stop` disconnects
    /// (a role's stop signal): None then. The one place the roles wait for a
    /// pooled buffer, so every such wait is cancellable.
    pub fn take_until(&self, stop: &flume::Receiver<()>) -> Option<Pooled<T>> {
        if stop.is_disconnected() {
            return None;
        }
        flume::Selector::new().recv(&self.free, |r| r.ok().map(|item| self.guard(item))).recv(stop, |_| None).wait()
    }

    /// How many items are free now.
    pub fn free_count(&self) -> usize {
        self.free.len()
    }
}

impl<T> std::ops::Deref for Pooled<T> {
    type Target = T;
    fn deref(&self) -> &T {
        self.item.as_ref().expect("present until drop")
    }
}

impl<T> std::ops::DerefMut for Pooled<T> {
    fn deref_mut(&mut self) -> &mut T {
        self.item.as_mut().expect("present until drop")
    }
}

impl<T> Drop for Pooled<T> {
    fn drop(&mut self) {
        if let Some(item) = self.item.take() {
            // The pool's channel holds every item, so this never blocks;
            // it fails only when every pool handle is gone (the item is
            // freed then).
            let _ = self.give_back.try_send(item);
        }
    }
}

/// Page-locked host memory readable by the CPU (allocated without the
/// write-combined flag, which makes CPU reads very slow).
pub struct PinnedMem {
    ptr: *mut u8,
    bytes: usize,
    _alloc: cudarc::driver::PinnedHostSlice<u8>,
}

// SAFETY: plain host memory; access is serialized by ownership (mutation
// needs `&mut`), so shared references are safe to send.
unsafe impl Send for PinnedMem {}
unsafe impl Sync for PinnedMem {}

impl PinnedMem {
    pub fn new(ctx: &Arc<CudaContext>, bytes: usize) -> Result<Self, ModelError> {
        // SAFETY: PORTABLE = page-locked for every context (GPU), not
        // write-combined (CPU reads stay fast); any bytes are valid u8.
        let mut alloc = unsafe { ctx.alloc_pinned_with_flags::<u8>(bytes, sys::CU_MEMHOSTALLOC_PORTABLE) }
            .map_err(|e| cuda_err(&format!("allocating {bytes} pinned bytes"), e))?;
        let ptr = alloc.as_mut_ptr().map_err(|e| cuda_err("pinned pointer", e))?;
        Ok(Self { ptr, bytes, _alloc: alloc })
    }

    pub fn capacity(&self) -> usize {
        self.bytes
    }
}

/// `count` pinned buffers of `bytes` each.
pub fn pinned_pool(ctx: &Arc<CudaContext>, count: usize, bytes: usize) -> Result<Pool<PinnedMem>, ModelError> {
    Ok(Pool::new((0..count).map(|_| PinnedMem::new(ctx, bytes)).collect::<Result<_, _>>()?))
}

/// A pooled pinned buffer of which the first `len` bytes are the payload.
/// `AsRef<[u8]>`, so `Bytes::from_owner` can hand it to the network and the
/// buffer returns to its pool when the last byte has left.
pub struct PinnedBuf {
    mem: Pooled<PinnedMem>,
    len: usize,
}

impl PinnedBuf {
    pub fn new(mem: Pooled<PinnedMem>, len: usize) -> Result<Self, ModelError> {
        if len > mem.bytes {
            return Err(ModelError::Device(format!(
                "a payload of {len} bytes exceeds the pinned buffers of {} bytes",
                mem.bytes
            )));
        }
        Ok(Self { mem, len })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: exclusively owned; the allocation holds bytes >= len.
        unsafe { std::slice::from_raw_parts_mut(self.mem.ptr, self.len) }
    }

    /// Copies `src` (a contiguous CUDA tensor) into `[offset..]` on `stream`,
    /// asynchronously. The caller synchronizes `stream` before reading or
    /// dropping the buffer and keeps `src` alive until then.
    pub fn copy_from_device_async(
        &mut self,
        offset: usize,
        src: &Tensor,
        stream: &CudaStream,
    ) -> Result<(), ModelError> {
        let n = src.numel() * src.kind().elt_size_in_bytes();
        if offset + n > self.len {
            return Err(ModelError::Device(format!(
                "copy of {n} bytes at {offset} overflows a {}-byte buffer",
                self.len
            )));
        }
        let dst = &mut self.as_mut_slice()[offset..offset + n];
        // SAFETY: dst is pinned host memory owned by this buffer; src is a
        // live, contiguous device allocation of n bytes.
        unsafe { result::memcpy_dtoh_async(dst, src.data_ptr() as sys::CUdeviceptr, stream.cu_stream()) }
            .map_err(|e| cuda_err("device-to-host copy", e))
    }
}

impl AsRef<[u8]> for PinnedBuf {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: as in as_mut_slice; shared access once filled.
        unsafe { std::slice::from_raw_parts(self.mem.ptr, self.len) }
    }
}

/// Device memory allocated outside libtorch's caching allocator, so that a
/// side stream may write it without racing torch's stream-ordered reuse.
pub struct DeviceBuf {
    ptr: sys::CUdeviceptr,
    bytes: usize,
    ctx: Arc<CudaContext>,
}

// SAFETY: a device pointer; ownership serializes access.
unsafe impl Send for DeviceBuf {}

impl DeviceBuf {
    pub fn new(ctx: &Arc<CudaContext>, bytes: usize) -> Result<Self, ModelError> {
        ctx.bind_to_thread().map_err(|e| cuda_err("binding the context", e))?;
        // SAFETY: plain device allocation, freed in Drop.
        let ptr = unsafe { result::malloc_sync(bytes) }
            .map_err(|e| cuda_err(&format!("allocating {bytes} device bytes"), e))?;
        Ok(Self { ptr, bytes, ctx: Arc::clone(ctx) })
    }

    /// Copies pinned host bytes in on `stream`, asynchronously; the caller
    /// synchronizes `stream` before `src` may be reused.
    pub fn copy_from_host_async(&mut self, src: &[u8], stream: &CudaStream) -> Result<(), ModelError> {
        if src.len() > self.bytes {
            return Err(ModelError::Device(format!(
                "{} bytes do not fit a {}-byte device buffer",
                src.len(),
                self.bytes
            )));
        }
        // SAFETY: the allocation holds `bytes >= src.len()` bytes.
        unsafe { result::memcpy_htod_async(self.ptr, src, stream.cu_stream()) }
            .map_err(|e| cuda_err("host-to-device copy", e))
    }

    /// A tensor view of the first `numel` elements. The view must not
    /// outlive this buffer; [`DeviceTensor`] ties the two together.
    fn view(&self, shape: &[i64], kind: Kind, ordinal: usize) -> Result<Tensor, ModelError> {
        let numel: i64 = shape.iter().product();
        if numel as usize * kind.elt_size_in_bytes() > self.bytes {
            return Err(ModelError::Device("tensor view larger than its buffer".into()));
        }
        let mut strides = vec![1i64; shape.len()];
        for i in (0..shape.len().saturating_sub(1)).rev() {
            strides[i] = strides[i + 1] * shape[i + 1];
        }
        // SAFETY: the pointer is a live device allocation of enough bytes.
        unsafe { Tensor::f_from_blob(self.ptr as *const u8, shape, &strides, kind, tch::Device::Cuda(ordinal)) }
            .map_err(ModelError::from)
    }
}

impl Drop for DeviceBuf {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: allocated by malloc_sync in new and freed once.
        let _ = unsafe { result::free_sync(self.ptr) };
    }
}

/// A tensor whose memory is a pooled [`DeviceBuf`] it owns: the view
/// cannot outlive the memory, and the memory returns to its pool only when
/// the tensor is gone.
pub struct DeviceTensor {
    tensor: Tensor,
    _buf: Pooled<DeviceBuf>,
}

impl DeviceTensor {
    pub fn new(buf: Pooled<DeviceBuf>, shape: &[i64], kind: Kind, ordinal: usize) -> Result<Self, ModelError> {
        let tensor = buf.view(shape, kind, ordinal)?;
        Ok(Self { tensor, _buf: buf })
    }

    pub fn tensor(&self) -> &Tensor {
        &self.tensor
    }
}

/// A non-blocking side stream of a context.
pub fn side_stream(ctx: &Arc<CudaContext>) -> Result<Arc<CudaStream>, ModelError> {
    ctx.new_stream().map_err(|e| cuda_err("creating a stream", e))
}

/// Blocks until `stream` has finished its work.
pub fn sync(stream: &CudaStream) -> Result<(), ModelError> {
    stream.synchronize().map_err(|e| cuda_err("stream synchronize", e))
}

/// Makes `stream` wait (on the GPU) for `event`.
pub fn wait_event(stream: &CudaStream, event: &CudaEvent) -> Result<(), ModelError> {
    stream.wait(event).map_err(|e| cuda_err("stream wait", e))
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::Pool;

    #[test]
    fn a_taken_item_comes_back_on_drop_and_a_wait_for_one_ends_at_stop() {
        let pool = Pool::new(vec![1u32, 2]);
        let (_keep, never) = flume::bounded::<()>(1);
        let a = pool.take_until(&never).expect("free");
        let b = pool.take(Duration::from_millis(10)).expect("free");
        assert_eq!(pool.free_count(), 0);
        assert!(pool.take(Duration::from_millis(10)).is_none(), "both are out");
        drop(a);
        assert_eq!(pool.free_count(), 1);
        let c = pool.take_until(&never).expect("back in the pool");
        // All out: a waiter wakes the moment the stop channel disconnects.
        let (stop_tx, stop) = flume::bounded::<()>(1);
        let p2 = pool.clone();
        let waiter = std::thread::spawn(move || {
            let t0 = Instant::now();
            (p2.take_until(&stop).is_none(), t0.elapsed())
        });
        std::thread::sleep(Duration::from_millis(50));
        drop(stop_tx);
        let (gave_up, waited) = waiter.join().unwrap();
        assert!(gave_up, "stopped, not served");
        assert!(waited < Duration::from_secs(2), "woke at the stop: {waited:?}");
        drop((b, c));
        assert_eq!(pool.free_count(), 2, "nothing lost");
    }
}
