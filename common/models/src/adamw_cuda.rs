//! The AdamW step of a bf16 parameter with f32 master weights as one kernel
//! per parameter (`csrc/adamw.cu`): the gradient read in bf16 and the
//! parameter written from the new master in the same pass that updates the
//! master and moments. [`crate::optim::AdamW`] otherwise casts every
//! gradient to f32 for libtorch's fused kernel and copies every master back
//! into its parameter: two more passes over the drafter's weights a step.
//! [`step`] declines (returns false; the caller takes libtorch's path) where
//! the kernel does not apply: not CUDA, not bf16, not contiguous whole
//! 16-byte vectors, or `DFLASH_FUSED_OPS=off`.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use cudarc::driver::{CudaContext, CudaFunction, LaunchConfig, PushKernelArg};
use tch::{Device, Kind, Tensor};

const SOURCE: &str = concat!(include_str!("../csrc/vec_kind.cuh"), include_str!("../csrc/adamw.cu"));
const THREADS: u32 = 256;
/// bf16 elements of a 16-byte vector (`VEC` in the kernel).
const VEC: i64 = 8;

/// Kernels launched so far in this process: how a test tells the kernel
/// from libtorch's path.
pub static LAUNCHES: AtomicU64 = AtomicU64::new(0);

struct Kernel {
    ctx: Arc<CudaContext>,
    step: CudaFunction,
}

fn kernel(ordinal: usize) -> Option<Arc<Kernel>> {
    static COMPILED: crate::nvrtc::Compiled<Kernel> = crate::nvrtc::Compiled::new();
    COMPILED.get(ordinal, true, "AdamW kernel", || {
        let (ctx, m) = crate::nvrtc::compile(ordinal, SOURCE, "adamw.cu", &["-DIN_BF16=1".to_string()])?;
        let step = m.load_function("adamw_step").map_err(|e| format!("kernel adamw_step: {e:?}"))?;
        Ok(Kernel { ctx, step })
    })
}

/// One step's hyperparameters, as the kernel takes them (f32, like the
/// arithmetic of libtorch's fused kernel).
#[derive(Clone, Copy, Debug)]
pub struct StepSettings {
    /// What the gradient is divided by first (global-norm clipping; 1 when within bounds).
    pub divisor: f32,
    pub lr: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub weight_decay: f32,
    pub eps: f32,
    /// lr / (1 - beta1^step).
    pub step_size: f32,
    /// sqrt(1 - beta2^step).
    pub bias2_sqrt: f32,
}

/// One AdamW step of `param` (bf16) from its gradient `grad` (bf16), its f32
/// `master` weights and moments `exp_avg` / `exp_avg_sq` updated in place and
/// `param` rewritten from the new master; false (nothing done) where the
/// kernel does not apply.
pub fn step(
    param: &Tensor,
    grad: &Tensor,
    master: &Tensor,
    exp_avg: &Tensor,
    exp_avg_sq: &Tensor,
    s: &StepSettings,
) -> bool {
    let Device::Cuda(ordinal) = param.device() else { return false };
    let n = param.numel() as i64;
    let kinds = param.kind() == Kind::BFloat16
        && grad.kind() == Kind::BFloat16
        && [master, exp_avg, exp_avg_sq].iter().all(|t| t.kind() == Kind::Float);
    let all = [param, grad, master, exp_avg, exp_avg_sq];
    let laid_out = all.iter().all(|t| {
        t.device() == param.device()
            && t.numel() as i64 == n
            && t.is_contiguous()
            && (t.data_ptr() as usize).is_multiple_of(16)
    });
    if !crate::fused_cuda::enabled() || !kinds || !laid_out || n == 0 || n % VEC != 0 {
        return false;
    }
    let Some(k) = kernel(ordinal) else { return false };
    let vectors = n / VEC;
    let blocks = (vectors + i64::from(THREADS) - 1) / i64::from(THREADS);
    if blocks > i64::from(i32::MAX) {
        return false;
    }
    let cfg = LaunchConfig { grid_dim: (blocks as u32, 1, 1), block_dim: (THREADS, 1, 1), shared_mem_bytes: 0 };
    let [p, g, w, m, v] = all.map(|t| t.data_ptr() as u64);
    let stream = k.ctx.default_stream(); // libtorch's stream: ordered with its ops
    // SAFETY: five CUDA tensors of `n` elements on one device, contiguous,
    // 16-byte aligned, of the kinds the kernel reads (checked above);
    // libtorch's stream orders their lifetimes and the gradient's writers.
    let launched = unsafe {
        stream
            .launch_builder(&k.step)
            .arg(&w)
            .arg(&m)
            .arg(&v)
            .arg(&g)
            .arg(&p)
            .arg(&vectors)
            .arg(&s.divisor)
            .arg(&s.lr)
            .arg(&s.beta1)
            .arg(&s.beta2)
            .arg(&s.weight_decay)
            .arg(&s.eps)
            .arg(&s.step_size)
            .arg(&s.bias2_sqrt)
            .launch(cfg)
    };
    match launched {
        Ok(_) => {
            LAUNCHES.fetch_add(1, Ordering::Relaxed);
            true
        }
        Err(e) => panic!("launching the AdamW kernel on cuda:{ordinal} failed: {e:?}"),
    }
}
