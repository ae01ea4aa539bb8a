//! Compiling our CUDA sources at run time with NVRTC (the `libnvrtc.so.13`
//! that PyTorch's CUDA wheel ships, found next to libtorch), so the release
//! binary stays one build for every GPU: each caller compiles its source
//! once per process, device and setting, for the device's own architecture.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::{CudaContext, CudaModule};
use cudarc::nvrtc::CompileOptions;

/// The kernels of one source by (device ordinal, bf16 inputs), compiled on
/// first use; None (logged once) where they could not be, and the callers
/// run libtorch ops instead.
pub(crate) struct Compiled<K>(Mutex<BTreeMap<DeviceKind, Option<Arc<K>>>>);

/// (device ordinal, bf16 inputs)
type DeviceKind = (usize, bool);

impl<K> Compiled<K> {
    pub(crate) const fn new() -> Self {
        Self(Mutex::new(BTreeMap::new()))
    }

    /// The kernels for (device, bf16), made by `build` the first time;
    /// `what` names them in the warning when that fails.
    pub(crate) fn get(
        &self,
        ordinal: usize,
        bf16: bool,
        what: &str,
        build: impl FnOnce() -> Result<K, String>,
    ) -> Option<Arc<K>> {
        let mut cache = self.0.lock().unwrap_or_else(|p| p.into_inner());
        cache
            .entry((ordinal, bf16))
            .or_insert_with(|| match build() {
                Ok(k) => Some(Arc::new(k)),
                Err(e) => {
                    tracing::warn!("{what} unavailable ({e}); using libtorch ops");
                    None
                }
            })
            .clone()
    }
}

/// `source` (named `name` in errors) compiled with `defines` (`-DNAME=value`)
/// for GPU `ordinal`, and loaded there.
pub(crate) fn compile(
    ordinal: usize,
    source: &str,
    name: &str,
    defines: &[String],
) -> Result<(Arc<CudaContext>, Arc<CudaModule>), String> {
    preload_nvrtc()?;
    let ctx = CudaContext::new(ordinal).map_err(|e| format!("CUDA context: {e:?}"))?;
    let (major, minor) = ctx.compute_capability().map_err(|e| format!("compute capability: {e:?}"))?;
    let mut options = vec![format!("--gpu-architecture=compute_{major}{minor}"), "--std=c++17".into()];
    options.extend(defines.iter().cloned());
    let ptx = cudarc::nvrtc::compile_ptx_with_opts(
        source,
        CompileOptions { options, name: Some(name.into()), ..Default::default() },
    )
    .map_err(|e| format!("NVRTC ({name}): {e:?}"))?;
    let module = ctx.load_module(ptx).map_err(|e| format!("loading {name}: {e:?}"))?;
    Ok((ctx, module))
}

/// The body of a C++ shim's launcher for `call`: `applies` says whether
/// the kernels take it, `kernels` compiles or finds them, `run` launches.
/// Returns 0 launched, 1 declined (the shim runs libtorch ops instead), 2
/// failed, with the failure's message (or a panic's: it must not unwind into
/// C++) written into `err`.
///
/// # Safety
/// `call` points at a live call whose pointers are device memory of the
/// shapes it names, and `err` at `err_len` writable bytes.
pub(crate) unsafe fn shim_launch<C: std::panic::RefUnwindSafe, K>(
    call: *const C,
    err: *mut std::ffi::c_char,
    err_len: i32,
    applies: fn(&C) -> bool,
    kernels: fn(&C) -> Option<Arc<K>>,
    run: fn(&K, &C) -> Result<(), String>,
) -> i32 {
    // SAFETY: the shim passes a call that lives for this one.
    let c = unsafe { &*call };
    let attempt = || {
        if !applies(c) {
            return Ok(false);
        }
        let Some(k) = kernels(c) else { return Ok(false) };
        run(&k, c).map(|()| true)
    };
    let message = match std::panic::catch_unwind(attempt) {
        Ok(Ok(true)) => return 0,
        Ok(Ok(false)) => return 1,
        Ok(Err(e)) => e,
        Err(_) => "the launcher panicked".to_string(),
    };
    let bytes = message.as_bytes();
    let n = bytes.len().min(err_len.max(1) as usize - 1);
    // SAFETY: `err` holds err_len bytes; n + 1 <= err_len.
    unsafe {
        std::ptr::copy_nonoverlapping(bytes.as_ptr(), err.cast::<u8>(), n);
        *err.add(n) = 0;
    }
    2
}

/// Runs a C++ shim entry `f(err, err_len)` that returns a new `at::Tensor*`
/// or null with `err` filled: the tensor, or the shim's message.
pub(crate) fn try_call_shim(
    f: impl FnOnce(*mut std::ffi::c_char, i32) -> *mut std::ffi::c_void,
) -> Result<tch::Tensor, String> {
    let mut err = [0u8; 1024];
    let out = f(err.as_mut_ptr().cast(), err.len() as i32);
    if out.is_null() {
        let end = err.iter().position(|&c| c == 0).unwrap_or(err.len());
        return Err(String::from_utf8_lossy(&err[..end]).into_owned());
    }
    // SAFETY: a fresh at::Tensor* from the shim, owned from here on.
    Ok(unsafe { tch::Tensor::from_ptr(out.cast()) })
}

/// [`try_call_shim`] where a failure panics with the shim's message (the
/// callers checked the shapes before, so what is left is a device error).
pub(crate) fn call_shim(f: impl FnOnce(*mut std::ffi::c_char, i32) -> *mut std::ffi::c_void) -> tch::Tensor {
    try_call_shim(f).unwrap_or_else(|e| panic!("{e}"))
}

/// The `at::Tensor*` behind `t`, for a shim that borrows it for one call.
pub(crate) fn raw(t: &tch::Tensor) -> *mut std::ffi::c_void {
    t.as_ptr().cast_mut().cast()
}

/// Makes `libnvrtc.so.13` loadable by name: PyTorch's CUDA wheel keeps it
/// in `site-packages/nvidia/cu13/lib`, beside the `torch/lib` folder that
/// LD_LIBRARY_PATH names. Once loaded by path, a load by name finds it.
fn preload_nvrtc() -> Result<(), String> {
    static LOADED: OnceLock<Result<(), String>> = OnceLock::new();
    LOADED
        .get_or_init(|| {
            // SAFETY: only probes whether the library can be loaded.
            if unsafe { cudarc::nvrtc::sys::is_culib_present() } {
                return Ok(());
            }
            let dirs = std::env::var("LD_LIBRARY_PATH").unwrap_or_default();
            for dir in dirs.split(':').filter(|d| !d.is_empty()) {
                let dir = std::path::Path::new(dir);
                for lib in
                    [dir.to_path_buf(), dir.join("../../nvidia/cu13/lib"), dir.join("../../nvidia/cuda_nvrtc/lib")]
                {
                    let path = lib.join("libnvrtc.so.13");
                    if !path.exists() {
                        continue;
                    }
                    // SAFETY: loading NVRTC runs no initialisers that need
                    // anything of us; the library stays loaded for good.
                    match unsafe { libloading::Library::new(&path) } {
                        Ok(l) => {
                            std::mem::forget(l);
                            return Ok(());
                        }
                        Err(e) => return Err(format!("{}: {e}", path.display())),
                    }
                }
            }
            Err("libnvrtc.so.13 is not on LD_LIBRARY_PATH nor beside torch/lib in nvidia/cu13/lib".into())
        })
        .clone()
}
