//! Making CUDA visible to a binary linked only against libtorch_cpu.
//!
//! The release binary links the CPU half of libtorch so that one build runs
//! everywhere. On a GPU host the CUDA half must be loaded before the first
//! CUDA call: `dlopen("libtorch_cuda.so")` registers the CUDA backend
//! (its static initializers do). The library stays loaded for the life of the process.

use std::sync::OnceLock;

use crate::ModelError;

static CUDA_LIB: OnceLock<Result<libloading::Library, String>> = OnceLock::new();

/// Loads libtorch's CUDA half once and checks that every requested GPU
/// exists. The error says what to fix.
pub fn ensure_cuda(gpu_indices: &[u32]) -> Result<(), ModelError> {
    let loaded = CUDA_LIB.get_or_init(|| {
        // SAFETY: loading libtorch_cuda runs its static initialisers, which
        // register the CUDA backend with libtorch; that is the intent.
        unsafe { libloading::Library::new("libtorch_cuda.so") }.map_err(|e| e.to_string())
    });
    if let Err(e) = loaded {
        return Err(ModelError::Device(format!(
            "CUDA devices are configured but libtorch_cuda.so cannot be loaded ({e}); \
             set LD_LIBRARY_PATH to the torch/lib folder of a PyTorch 2.11 CUDA install"
        )));
    }
    if !tch::Cuda::is_available() {
        return Err(ModelError::Device(
            "libtorch_cuda.so is loaded but no CUDA device is available (driver missing?)".into(),
        ));
    }
    let count = tch::Cuda::device_count() as u32;
    if let Some(&bad) = gpu_indices.iter().find(|&&i| i >= count) {
        return Err(ModelError::Device(format!("GPU {bad} is configured but this host has {count} GPU(s)")));
    }
    Ok(())
}

/// The tch device for a config device, loading CUDA when needed.
pub fn tch_device(cuda_index: Option<u32>) -> Result<tch::Device, ModelError> {
    match cuda_index {
        None => Ok(tch::Device::Cpu),
        Some(i) => {
            ensure_cuda(&[i])?;
            Ok(tch::Device::Cuda(i as usize))
        }
    }
}

/// The libtorch device of a configured device (no CUDA loaded: see
/// [`ensure_cuda`]).
pub fn torch_device(d: &dflash_config::Device) -> tch::Device {
    match d {
        dflash_config::Device::Cpu => tch::Device::Cpu,
        dflash_config::Device::Cuda(i) => tch::Device::Cuda(*i as usize),
    }
}

unsafe extern "C" {
    fn dflash_set_cudnn_sdp(enabled: i32);
    fn dflash_cudnn_sdp_enabled() -> i32;
    fn dflash_set_deterministic(on: i32, warn_only: i32);
}

/// Makes libtorch use deterministic kernels only (process-wide), strictly:
/// an op that has none fails, naming itself. (With PyTorch's warn-only mode
/// flash attention keeps its nondeterministic backward: two such runs on an
/// H200 differed.) cuBLAS is deterministic only with
/// `CUBLAS_WORKSPACE_CONFIG` set before its first use (see
/// [`fix_cublas_workspace`]).
pub fn set_deterministic_algorithms(on: bool) {
    // SAFETY: a plain setter on libtorch's global context.
    unsafe { dflash_set_deterministic(i32::from(on), 0) }
}

/// Gives cuBLAS a fixed workspace (`CUBLAS_WORKSPACE_CONFIG=:4096:8`, 32 MiB)
/// unless the environment sets one: what NVIDIA and PyTorch document as the
/// condition for cuBLAS GEMMs that repeat bit for bit. Must run before any
/// other thread starts (it edits the environment).
///
/// # Safety
/// No other thread may read or write the environment meanwhile: call it
/// first thing in `main`.
pub unsafe fn fix_cublas_workspace() {
    if std::env::var_os("CUBLAS_WORKSPACE_CONFIG").is_none() {
        // SAFETY: the caller guarantees a single-threaded process.
        unsafe { std::env::set_var("CUBLAS_WORKSPACE_CONFIG", ":4096:8") };
    }
}

/// Turns libtorch's cuDNN attention backend on or off (process-wide). The
/// target turns it off: it builds a plan per input shape, and every packed
/// batch brings new sequence lengths (capture ran at half speed with it).
/// The drafter keeps it: its masked block attention at 512 anchors is 20%
/// faster with it (BENCHMARKS.md).
pub fn set_cudnn_attention(enabled: bool) {
    // SAFETY: plain setters on libtorch's global context.
    unsafe { dflash_set_cudnn_sdp(i32::from(enabled)) }
}

/// Whether libtorch may use its cuDNN attention backend.
pub fn cudnn_attention_enabled() -> bool {
    // SAFETY: plain getter on libtorch's global context.
    unsafe { dflash_cudnn_sdp_enabled() != 0 }
}

/// The environment variable of the device-fault hook: a comma-separated
/// list of device names (`cpu`, `cuda:1`) whose [`probe_device`] fails, as
/// a broken GPU's would, or `@<file>`: the list is read from that file at
/// each probe (no file, no fault), so a fault can begin mid-run. For
/// fault-injection tests and chaos runs; unset in production.
pub const FAULT_DEVICE_ENV: &str = "DFLASH_FAULT_DEVICE";

/// Whether the device-fault hook names `device`.
fn fault_injected(device: &str) -> bool {
    let Ok(v) = std::env::var(FAULT_DEVICE_ENV) else { return false };
    let list = match v.strip_prefix('@') {
        Some(file) => std::fs::read_to_string(file).unwrap_or_default(),
        None => v,
    };
    list.split(',').any(|d| d.trim() == device)
}

/// Whether the device still computes: a small product on it, read back and
/// checked. A member whose training failed with a device error probes its
/// devices to tell its own broken device (the probe fails) from a peer's
/// failure seen through a collective (the probe passes).
pub fn probe_device(device: tch::Device) -> Result<(), String> {
    let name = match device {
        tch::Device::Cpu => "cpu".to_string(),
        tch::Device::Cuda(i) => format!("cuda:{i}"),
        other => format!("{other:?}"),
    };
    if fault_injected(&name) {
        return Err(format!("{name}: injected device fault ({FAULT_DEVICE_ENV})"));
    }
    let run = || -> Result<f64, tch::TchError> {
        let t = tch::Tensor::f_ones([64, 64], (tch::Kind::Float, device))?;
        let sum = t.f_matmul(&t)?.f_sum(tch::Kind::Float)?.f_to_device(tch::Device::Cpu)?;
        sum.f_double_value(&[])
    };
    // A CUDA error may surface as a panic inside libtorch's bindings.
    match std::panic::catch_unwind(run) {
        Ok(Ok(v)) if v == 64.0 * 64.0 * 64.0 => Ok(()),
        Ok(Ok(v)) => Err(format!("{name}: a probe product gave {v}, not {}", 64 * 64 * 64)),
        Ok(Err(e)) => Err(format!("{name}: {e}")),
        Err(_) => Err(format!("{name}: the probe panicked")),
    }
}

/// `host` (a CPU tensor) on `device`, without the host waiting for the
/// device. On a GPU the bytes go through pinned memory by a non-blocking
/// copy, ordered on the current stream before the kernels that read them
/// (libtorch keeps the pinned block until the copy is done). A plain
/// `to_device` from pageable memory synchronizes the stream: the GPU then
/// idles from the end of the work queued before it until the host has
/// launched the next kernels. The training step uploads its index plans
/// this way at every micro-batch.
pub fn upload(host: &tch::Tensor, device: tch::Device) -> tch::Tensor {
    match device {
        tch::Device::Cuda(_) => match pinned(host) {
            Ok(p) => p.to_device_(device, host.kind(), true, false),
            // No pinned memory to be had: the blocking copy still works.
            Err(_) => host.to_device(device),
        },
        _ => host.to_device(device),
    }
}

unsafe extern "C" {
    /// csrc/host_memory.cpp: a new `at::Tensor*` or null with `err` filled.
    fn dflash_pin_memory(t: *mut std::ffi::c_void, err: *mut std::ffi::c_char, err_len: i32) -> *mut std::ffi::c_void;
}

/// A pinned (page-locked) copy of the CPU tensor `host`, for the CUDA
/// backend loaded ([`ensure_cuda`]). Unlike tch's `pin_memory(device)` it
/// passes no device, which libtorch has deprecated and warns about at every
/// call.
pub fn pinned(host: &tch::Tensor) -> Result<tch::Tensor, ModelError> {
    let mut err = [0u8; 512];
    // SAFETY: `host` is a live at::Tensor borrowed for the call; the shim
    // returns a new heap tensor or null, and writes at most err.len() bytes.
    let out = unsafe { dflash_pin_memory(host.as_ptr().cast_mut().cast(), err.as_mut_ptr().cast(), err.len() as i32) };
    if out.is_null() {
        let end = err.iter().position(|&c| c == 0).unwrap_or(err.len());
        return Err(ModelError::Device(format!("pinning host memory: {}", String::from_utf8_lossy(&err[..end]))));
    }
    // SAFETY: a fresh at::Tensor* from the shim, owned from here on.
    Ok(unsafe { tch::Tensor::from_ptr(out.cast()) })
}
