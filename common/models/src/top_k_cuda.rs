//! The top-k over a vocabulary on a GPU (`csrc/top_k.cu`): one kernel per
//! call that reads each row once, in place of the libtorch ops of
//! [`crate::dflash2::top_k`] (an `amax` over the chunks that runs at about a
//! fifth of the memory's rate, two `topk`s, a gather). Same result: `topk`'s
//! values, best first, each with the id of an entry holding it.
//!
//! [`top_k`] returns None where the kernel does not apply (not a CUDA
//! tensor, a kind other than bf16/f32, a row not 16-byte aligned or not
//! whole chunks, fewer than `k` chunks, a `k` whose buffers outgrow shared
//! memory, a tensor that needs gradients, the kernel unavailable or turned
//! off by `DFLASH_FUSED_OPS=off`) and the caller runs the ops.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use cudarc::driver::{CudaContext, CudaFunction, LaunchConfig, PushKernelArg};
use tch::{Device, Kind, Tensor};

const SOURCE: &str = concat!(
    include_str!("../csrc/vec_kind.cuh"),
    include_str!("../csrc/order_key.cuh"),
    include_str!("../csrc/top_k.cu")
);
/// Vocabulary entries per chunk (`CHUNK` in the kernel).
pub const CHUNK: i64 = 128;
/// Threads per block (`THREADS` in the kernel).
const THREADS: u32 = 256;
/// Shared memory a block may take without opting in to more.
const SHARED_LIMIT: i64 = 48 * 1024;

/// Kernels launched so far in this process: how a test tells the kernel
/// from the ops it replaces.
pub static LAUNCHES: AtomicU64 = AtomicU64::new(0);

struct Kernel {
    ctx: Arc<CudaContext>,
    top_k: CudaFunction,
}

fn kernel(ordinal: usize, bf16: bool) -> Option<Arc<Kernel>> {
    static COMPILED: crate::nvrtc::Compiled<Kernel> = crate::nvrtc::Compiled::new();
    COMPILED.get(ordinal, bf16, "top-k kernel", || {
        let (ctx, m) = crate::nvrtc::compile(ordinal, SOURCE, "top_k.cu", &[format!("-DIN_BF16={}", i32::from(bf16))])?;
        let top_k = m.load_function("chunked_top_k").map_err(|e| format!("kernel chunked_top_k: {e:?}"))?;
        Ok(Kernel { ctx, top_k })
    })
}

/// Shared memory of one block: the chunks' maxima, the candidates' keys,
/// the chosen chunks and candidates (4 bytes each).
fn shared_bytes(v: i64, k: i64) -> i64 {
    4 * (v / CHUNK + k * CHUNK + 2 * k)
}

/// The `k` largest entries of each row of `logits` `[.., V]` and their ids
/// (int64), best first, or None where the kernel does not apply.
pub fn top_k(logits: &Tensor, k: i64) -> Option<(Tensor, Tensor)> {
    let Device::Cuda(ordinal) = logits.device() else { return None };
    let bf16 = match logits.kind() {
        Kind::BFloat16 => true,
        Kind::Float => false,
        _ => return None,
    };
    let size = logits.size();
    let v = *size.last()?;
    let rows = logits.numel() as i64 / v.max(1);
    let fits = v % CHUNK == 0 && v / CHUNK > k && k >= 1 && shared_bytes(v, k) <= SHARED_LIMIT;
    let sized = v <= i64::from(i32::MAX) && (1..=i64::from(i32::MAX)).contains(&rows);
    if !crate::fused_cuda::enabled() || !fits || !sized || logits.requires_grad() || !logits.is_contiguous() {
        return None;
    }
    if !(logits.data_ptr() as usize).is_multiple_of(16) {
        return None;
    }
    let kern = kernel(ordinal, bf16)?;
    let out: Vec<i64> = size[..size.len() - 1].iter().copied().chain([k]).collect();
    let values = Tensor::empty(out.as_slice(), (logits.kind(), logits.device()));
    let ids = Tensor::empty(out.as_slice(), (Kind::Int64, logits.device()));
    let (pl, pv, pi, vi, ki) =
        (logits.data_ptr() as u64, values.data_ptr() as u64, ids.data_ptr() as u64, v as i32, k as i32);
    let cfg = LaunchConfig {
        grid_dim: (rows as u32, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: shared_bytes(v, k) as u32,
    };
    // SAFETY: `logits` is a contiguous [rows, V] CUDA tensor of the compiled
    // kind, 16-byte aligned, V whole chunks and more than k of them
    // (checked); `values` and `ids` are fresh [rows, k] of its kind and
    // int64; libtorch's stream (the default one) orders their lifetimes.
    let launched = unsafe {
        kern.ctx.default_stream().launch_builder(&kern.top_k).arg(&pl).arg(&vi).arg(&ki).arg(&pv).arg(&pi).launch(cfg)
    };
    // A launch that fails leaves the device in error; libtorch's next op
    // would fail less clearly.
    launched.unwrap_or_else(|e| panic!("top-k: launching the CUDA kernel failed: {e:?}"));
    LAUNCHES.fetch_add(1, Ordering::Relaxed);
    Some((values, ids))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Equal entry by entry, a NaN matching a NaN.
    fn same_values(a: &Tensor, b: &Tensor) -> bool {
        let both_nan = a.isnan().logical_and(&b.isnan());
        bool::try_from(a.eq_tensor(b).logical_or(&both_nan).all()).unwrap()
    }

    fn distinct_per_row(ids: &Tensor) -> bool {
        let k = *ids.size().last().unwrap();
        let sorted = ids.sort(-1, false).0;
        k == 1 || bool::try_from(sorted.narrow(-1, 1, k - 1).ne_tensor(&sorted.narrow(-1, 0, k - 1)).all()).unwrap()
    }

    /// The kernel returns `topk`'s values, best first, each with the id of
    /// an entry holding it, the ids of a row distinct and the same on a
    /// second call: for bf16 and f32; on Qwen's vocabulary, on exactly 8 k
    /// chunks and on barely more chunks than k; on random logits, on logits
    /// of a few values (ties everywhere), with the best entries packed in
    /// the last chunk, and with NaN, infinite and all-`-inf` rows. It leaves
    /// to the ops what it does not take.
    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn the_gpu_top_k_returns_topks_values_with_their_ids() {
        let dev = crate::cuda::tch_device(Some(0)).expect("a CUDA device");
        tch::manual_seed(5);
        for kind in [Kind::BFloat16, Kind::Float] {
            for v in [151_936, CHUNK * 8 * 16, CHUNK * 17] {
                let random = Tensor::randn([301, v], (Kind::Float, dev)).to_kind(kind);
                let tied = (random.to_kind(Kind::Float) * 2.0).round().to_kind(kind);
                let packed = random.copy();
                let _ = packed.narrow(1, v - CHUNK, CHUNK).g_add_scalar_(50.0);
                let special = random.copy();
                let _ = special.get(0).narrow(0, 7, 1).fill_(f64::NAN);
                let _ = special.get(0).narrow(0, v - 3, 1).fill_(f64::NAN);
                let _ = special.get(1).fill_(f64::NEG_INFINITY);
                let _ = special.get(2).narrow(0, 300, 5).fill_(f64::INFINITY);
                let _ = special.get(3).narrow(0, 0, v / 2).fill_(f64::NEG_INFINITY);
                for (name, logits) in [("random", &random), ("tied", &tied), ("packed", &packed), ("special", &special)]
                {
                    for k in [1, 4, 16, 64] {
                        let applies = v / CHUNK > k && shared_bytes(v, k) <= SHARED_LIMIT;
                        let before = LAUNCHES.load(Ordering::Relaxed);
                        let Some((got, ids)) = top_k(logits, k) else {
                            assert!(!applies, "{kind:?} V {v} {name} k {k}: the kernel declined");
                            continue;
                        };
                        assert!(LAUNCHES.load(Ordering::Relaxed) > before);
                        let (want, _) = logits.topk(k, -1, true, true);
                        let at = format!("{kind:?} V {v} {name} k {k}");
                        assert!(same_values(&got, &want), "{at}: topk's values");
                        assert!(same_values(&logits.gather(1, &ids, false), &got), "{at}: the ids hold the values");
                        assert!(distinct_per_row(&ids), "{at}: distinct ids");
                        assert!(top_k(logits, k).unwrap().1.equal(&ids), "{at}: the same ids again");
                    }
                }
            }
        }
        // Leading dimensions are kept.
        let logits = Tensor::randn([3, 5, 151_936], (Kind::BFloat16, dev));
        let (got, ids) = top_k(&logits, 16).unwrap();
        assert_eq!(got.size(), [3, 5, 16]);
        assert!(got.equal(&logits.topk(16, -1, true, true).0));
        assert!(logits.gather(2, &ids, false).equal(&got));
        // Declined: gradients, a row that is not whole chunks, a view that
        // is not contiguous, f16, the CPU.
        let base = Tensor::randn([4, 151_936], (Kind::Float, dev));
        assert!(top_k(&base.shallow_clone().set_requires_grad(true), 16).is_none());
        assert!(top_k(&base.narrow(1, 0, 151_935), 16).is_none());
        assert!(top_k(&base.narrow(1, 128, CHUNK * 1000), 16).is_none());
        assert!(top_k(&base.to_kind(Kind::Half), 16).is_none());
        assert!(top_k(&base.to_device(Device::Cpu), 16).is_none());
    }
}
