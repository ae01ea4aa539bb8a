//! FP8 matmuls for the drafter's training step (`training.precision =
//! "fp8"`): `y = x w^T` with e4m3 operands in the forward and e5m2 output
//! gradients in the backward, each tensor scaled by its current absolute
//! maximum, through cuBLASLt's FP8 GEMM (`csrc/fp8_linear.cpp`, a custom
//! autograd function over libtorch's `_scaled_mm`).
//!
//! Only the training forward takes this path: under `no_grad` (evaluation,
//! acceptance checks, generation) the same call is the bf16 matmul, so the
//! exported drafter is measured as it is served.

use tch::{Device, Kind, Tensor};

use crate::ModelError;

unsafe extern "C" {
    /// csrc/fp8_linear.cpp: a new `at::Tensor*` or null with `err` filled.
    fn dflash_fp8_linear(
        x: *mut std::ffi::c_void,
        w: *mut std::ffi::c_void,
        err: *mut std::ffi::c_char,
        err_len: i32,
    ) -> *mut std::ffi::c_void;
}

/// Whether a drafter on `device` computing in `kind` can run its matmuls in
/// FP8: a GPU of compute capability 8.9 or newer (Ada, Hopper, Blackwell:
/// the first with FP8 tensor cores) and a half-precision drafter. The error
/// says which condition failed.
pub fn check_supported(device: Device, kind: Kind) -> Result<(), ModelError> {
    let Device::Cuda(ordinal) = device else {
        return Err(ModelError::Device(format!(
            "training.precision = \"fp8\" needs a GPU of compute capability 8.9 or newer; this drafter runs on {device:?}"
        )));
    };
    if !matches!(kind, Kind::BFloat16 | Kind::Half) {
        return Err(ModelError::Device(format!(
            "training.precision = \"fp8\" needs a bf16 or f16 drafter; this one computes in {kind:?}"
        )));
    }
    let ctx = cudarc::driver::CudaContext::new(ordinal)
        .map_err(|e| ModelError::Device(format!("GPU {ordinal}: CUDA context: {e:?}")))?;
    let (major, minor) = ctx
        .compute_capability()
        .map_err(|e| ModelError::Device(format!("GPU {ordinal}: compute capability: {e:?}")))?;
    if (major, minor) < (8, 9) {
        return Err(ModelError::Device(format!(
            "training.precision = \"fp8\" needs a GPU of compute capability 8.9 or newer; GPU {ordinal} is {major}.{minor}"
        )));
    }
    Ok(())
}

/// `x w^T` (`x` `[.., K]`, `w` `[N, K]`, no bias) through FP8 matmuls while
/// autograd records, else in `x`'s kind. Weights whose K or N is not a
/// multiple of 16 (cuBLASLt's FP8 alignment) take the bf16 matmul; rows
/// need not be (the shim pads them).
pub fn linear(x: &Tensor, w: &Tensor) -> Tensor {
    let (n, k) = (w.size()[0], w.size()[1]);
    let mut shape = x.size();
    let rows: i64 = shape[..shape.len() - 1].iter().product();
    if n % 16 != 0 || k % 16 != 0 || rows == 0 {
        return x.linear(w, None::<&Tensor>);
    }
    let flat = x.reshape([rows, k]);
    let raw = crate::nvrtc::raw;
    // SAFETY: both pointers are live at::Tensors borrowed for the call (the
    // autograd function saves its own references); the shim returns a new
    // heap tensor or null and writes at most `len` bytes.
    let y = crate::nvrtc::try_call_shim(|err, len| unsafe { dflash_fp8_linear(raw(&flat), raw(w), err, len) })
        .unwrap_or_else(|e| panic!("FP8 matmul of [{rows}, {k}] x [{n}, {k}]^T: {e}"));
    *shape.last_mut().expect("x has a last dimension") = n;
    y.view(shape.as_slice())
}
