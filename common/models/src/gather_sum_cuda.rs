//! The split attention's key and value gradients summed back into their
//! rows on a GPU (`csrc/gather_sum.cu`): one kernel per tensor in place of
//! f32 casts, two `index_add_`s and a cast back (see the source for why).
//! `csrc/split_attention.cpp` stays the autograd function and calls back
//! here; it is built against libtorch's CPU half and cannot launch CUDA
//! itself, so [`register`] hands it [`launch`].
//!
//! The launcher declines (and the `index_add_` path runs) a kind other than
//! bf16/f32, rows not 16-byte aligned or not whole vectors, and the kernel
//! unavailable or turned off by `DFLASH_FUSED_OPS=off`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use cudarc::driver::{CudaContext, CudaFunction, LaunchConfig, PushKernelArg};

const SOURCE: &str = concat!(include_str!("../csrc/vec_kind.cuh"), include_str!("../csrc/gather_sum.cu"));

/// One call, as `csrc/split_attention.cpp` lays out `DflashGatherSumCall`.
#[repr(C)]
pub struct Call {
    device: i32,
    bf16: i32,
    /// Output rows.
    rows: i64,
    /// Elements per row.
    width: i64,
    /// Rows of `a`; sources at or past it are `b`'s.
    rows_a: i64,
    a: u64,
    b: u64,
    /// int64 `[sources]`: gathered rows, sorted by the row they sum into.
    order: u64,
    /// int64 `[rows + 1]`: each output row's range of `order`.
    offsets: u64,
    out: u64,
}

/// Kernels launched so far in this process: how a test tells the kernel
/// from the ops it replaces.
pub static LAUNCHES: AtomicU64 = AtomicU64::new(0);

struct Kernel {
    ctx: Arc<CudaContext>,
    gather_sum: CudaFunction,
}

fn kernel(ordinal: usize, bf16: bool) -> Option<Arc<Kernel>> {
    static COMPILED: crate::nvrtc::Compiled<Kernel> = crate::nvrtc::Compiled::new();
    COMPILED.get(ordinal, bf16, "gather-sum kernel", || {
        let defines = [format!("-DIN_BF16={}", i32::from(bf16))];
        let (ctx, m) = crate::nvrtc::compile(ordinal, SOURCE, "gather_sum.cu", &defines)?;
        let gather_sum = m.load_function("gather_sum").map_err(|e| format!("kernel gather_sum: {e:?}"))?;
        Ok(Kernel { ctx, gather_sum })
    })
}

/// Hands [`launch`] to the shim, once per process.
pub fn register() {
    static ONCE: OnceLock<()> = OnceLock::new();
    ONCE.get_or_init(|| {
        // SAFETY: `launch` has the shim's launcher signature and lives for
        // the whole process.
        unsafe { dflash_split_attention_set_gather_sum(launch) }
    });
}

unsafe extern "C" {
    /// csrc/split_attention.cpp.
    fn dflash_split_attention_set_gather_sum(f: unsafe extern "C" fn(*const Call, *mut std::ffi::c_char, i32) -> i32);
}

/// Whether the kernel takes this call's shapes and pointers.
fn applies(c: &Call) -> bool {
    let vec = if c.bf16 != 0 { 8 } else { 4 };
    crate::fused_cuda::enabled()
        && c.rows > 0
        && c.rows <= i64::from(i32::MAX)
        && c.width > 0
        && c.width % vec == 0
        && [c.a, c.b, c.out].iter().all(|&p| p % 16 == 0)
}

/// The shim's launcher: 0 launched, 1 declined, 2 failed (with `err` filled).
///
/// # Safety
/// `call` points at a live call whose pointers are device memory of the
/// shapes it names, and `err` at `err_len` writable bytes.
unsafe extern "C" fn launch(call: *const Call, err: *mut std::ffi::c_char, err_len: i32) -> i32 {
    // SAFETY: as this function's contract states.
    unsafe { crate::nvrtc::shim_launch(call, err, err_len, applies, |c| kernel(c.device as usize, c.bf16 != 0), run) }
}

fn run(k: &Kernel, c: &Call) -> Result<(), String> {
    let vec = if c.bf16 != 0 { 8 } else { 4 };
    // A thread per vector of the row, in whole warps, up to 256.
    let threads = ((c.width / vec).min(256) as u32).div_ceil(32) * 32;
    let cfg = LaunchConfig { grid_dim: (c.rows as u32, 1, 1), block_dim: (threads, 1, 1), shared_mem_bytes: 0 };
    let stream = k.ctx.default_stream(); // libtorch's stream: ordered with its ops
    // SAFETY: the shim sized the tensors and index ranges it passes;
    // `applies` checked alignment; libtorch's stream orders the tensors'
    // lifetimes.
    let launched = unsafe {
        stream
            .launch_builder(&k.gather_sum)
            .arg(&c.a)
            .arg(&c.b)
            .arg(&c.rows_a)
            .arg(&c.order)
            .arg(&c.offsets)
            .arg(&c.width)
            .arg(&c.out)
            .launch(cfg)
    };
    launched.map_err(|e| format!("launching the gather-sum kernel failed: {e:?}"))?;
    LAUNCHES.fetch_add(1, Ordering::Relaxed);
    Ok(())
}
