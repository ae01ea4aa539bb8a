//! DFlash2's block convolution on a GPU (`csrc/block_conv.cu`): one kernel
//! for the forward and one for the backward, in place of the per-tap
//! libtorch passes of `csrc/block_conv.cpp`, which stays the autograd
//! function and calls back here. That shim is built against libtorch's CPU
//! half and cannot launch CUDA itself; [`register`] hands it [`launch`].
//!
//! The launcher declines (and the libtorch passes run) where the kernels do
//! not apply: a kind other than bf16/f32, rows not 16-byte aligned, a
//! channel group that neither fills whole threads' vectors in a power of
//! two up to a warp nor divides one, more than [`MAX_TAPS`] taps, the
//! kernels unavailable or turned off by `DFLASH_FUSED_OPS=off`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use cudarc::driver::{CudaContext, CudaFunction, LaunchConfig, PushKernelArg};

const SOURCE: &str = concat!(include_str!("../csrc/vec_kind.cuh"), include_str!("../csrc/block_conv.cu"));
/// Taps the backward kernel keeps base-kernel gradients of in registers.
pub const MAX_TAPS: i32 = 8;
/// The backward's tap bounds, one kernel each (`block_conv_backward_<T>`):
/// a call takes the smallest that holds its taps, which keeps its registers,
/// hence the warps an SM can hold, to what the taps need.
const TAP_BOUNDS: [i32; 3] = [2, 4, MAX_TAPS];
/// Threads per block: 128 vectors of channels.
const THREADS: u32 = 128;

/// One call, as `csrc/block_conv.cpp` lays out `DflashBlockConvCall`.
#[repr(C)]
pub struct Call {
    backward: i32,
    device: i32,
    bf16: i32,
    bl: i32,
    k: i32,
    groups: i32,
    gs: i32,
    chunk_rows: i32,
    rows: i64,
    h: i64,
    dyn_stride: i64,
    x: u64,
    dynamic: u64,
    base: u64,
    g: u64,
    out: u64,
    gdyn: u64,
    gbase: u64,
}

/// Kernels launched so far in this process (both directions): how a test
/// tells the kernels from the libtorch passes they replace.
pub static LAUNCHES: AtomicU64 = AtomicU64::new(0);

struct Kernels {
    ctx: Arc<CudaContext>,
    forward: CudaFunction,
    /// One per bound of [`TAP_BOUNDS`].
    backward: Vec<CudaFunction>,
}

fn kernels(ordinal: usize, bf16: bool) -> Option<Arc<Kernels>> {
    static COMPILED: crate::nvrtc::Compiled<Kernels> = crate::nvrtc::Compiled::new();
    COMPILED.get(ordinal, bf16, "block convolution kernels", || {
        let defines = [format!("-DIN_BF16={}", i32::from(bf16))];
        let (ctx, m) = crate::nvrtc::compile(ordinal, SOURCE, "block_conv.cu", &defines)?;
        let f = |name: &str| m.load_function(name).map_err(|e| format!("kernel {name}: {e:?}"));
        let backward = TAP_BOUNDS.iter().map(|t| f(&format!("block_conv_backward_{t}"))).collect::<Result<_, _>>()?;
        Ok(Kernels { forward: f("block_conv_forward")?, backward, ctx })
    })
}

/// Hands [`launch`] to the shim, once per process.
pub fn register() {
    static ONCE: OnceLock<()> = OnceLock::new();
    ONCE.get_or_init(|| {
        // SAFETY: `launch` has the shim's launcher signature and lives for
        // the whole process.
        unsafe { dflash_block_conv_set_launcher(launch) }
    });
}

unsafe extern "C" {
    /// csrc/block_conv.cpp.
    fn dflash_block_conv_set_launcher(f: unsafe extern "C" fn(*const Call, *mut std::ffi::c_char, i32) -> i32);
}

/// Chunks of rows, the grid's second dimension (the shim sized the base
/// kernel's partial gradients by it).
fn chunks(c: &Call) -> i64 {
    (c.rows + i64::from(c.chunk_rows) - 1) / i64::from(c.chunk_rows)
}

/// Whether the kernels take this call's shapes and pointers.
fn applies(c: &Call) -> bool {
    if c.gs <= 0 || c.bl <= 0 || c.chunk_rows <= 0 {
        return false;
    }
    let vec = if c.bf16 != 0 { 8 } else { 4 };
    let lanes = c.gs / vec;
    let groups_fit =
        if c.gs >= vec { c.gs % vec == 0 && lanes <= 32 && (lanes as u32).is_power_of_two() } else { vec % c.gs == 0 };
    let pointers = [c.x, c.base, c.g, c.out];
    crate::fused_cuda::enabled()
        && groups_fit
        && (1..=MAX_TAPS).contains(&c.k)
        && c.h % i64::from(vec) == 0
        && c.rows > 0
        && c.rows % i64::from(c.bl) == 0
        && chunks(c) <= 65_535
        && c.h / i64::from(vec) <= i64::from(u32::MAX)
        && pointers.iter().all(|&p| p % 16 == 0)
}

/// The shim's launcher: 0 launched, 1 declined, 2 failed (with `err` filled).
///
/// # Safety
/// `call` points at a live call whose pointers are device memory of the
/// shapes it names, and `err` at `err_len` writable bytes.
unsafe extern "C" fn launch(call: *const Call, err: *mut std::ffi::c_char, err_len: i32) -> i32 {
    // SAFETY: as this function's contract states.
    unsafe { crate::nvrtc::shim_launch(call, err, err_len, applies, |c| kernels(c.device as usize, c.bf16 != 0), run) }
}

fn run(k: &Kernels, c: &Call) -> Result<(), String> {
    let vec = if c.bf16 != 0 { 8 } else { 4 };
    let grid_x = (c.h / vec + i64::from(THREADS) - 1) / i64::from(THREADS);
    let cfg = LaunchConfig {
        grid_dim: (grid_x as u32, chunks(c) as u32, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let stream = k.ctx.default_stream(); // libtorch's stream: ordered with its ops
    let (bl, kk, groups, gs, chunk_rows) = (c.bl, c.k, c.groups, c.gs, c.chunk_rows);
    // SAFETY: the shim checked the shapes against the tensors it allocated
    // and passes; `applies` checked alignment; libtorch's stream orders the
    // tensors' lifetimes.
    let launched = unsafe {
        let bound = TAP_BOUNDS.iter().position(|&t| t >= c.k).expect("applies: k <= MAX_TAPS");
        let mut b = stream.launch_builder(if c.backward == 0 { &k.forward } else { &k.backward[bound] });
        b.arg(&c.x).arg(&c.dynamic).arg(&c.base).arg(&c.rows).arg(&c.h).arg(&bl).arg(&kk).arg(&groups).arg(&gs);
        b.arg(&c.dyn_stride).arg(&chunk_rows).arg(&c.out);
        if c.backward != 0 {
            b.arg(&c.g).arg(&c.gdyn).arg(&c.gbase);
        }
        b.launch(cfg)
    };
    launched.map_err(|e| format!("launching the block convolution kernel failed: {e:?}"))?;
    LAUNCHES.fetch_add(1, Ordering::Relaxed);
    Ok(())
}
