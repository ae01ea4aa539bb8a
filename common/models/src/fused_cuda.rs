//! Row and elementwise kernels of the capture path (`csrc/fused.cu`) in
//! place of chains of libtorch ops that each make a full pass over memory:
//! the f32-scale RMSNorm of the zero-centred norms (Qwen3-Next, Qwen3.5: a
//! cast to f32, the norm, a cast back); and of the MoE block, the Qwen
//! router's softmax and top-k (five ops), the grouping of the (token, slot)
//! pairs by expert (a counting sort in place of a stable sort, a histogram
//! and three index ops), the experts' SwiGLU (two strided reads, two
//! writes) and the un-permute (a gather of `[T, K, H]` rows and a batched
//! matmul). Same math in f32, the same roundings to the input kind, the
//! same order of the pairs.
//!
//! Each entry returns None where its kernel does not apply (not a CUDA
//! tensor, a kind other than bf16/f32, rows not 16-byte aligned, a tensor
//! that needs gradients, or the kernels unavailable or turned off) and the
//! caller runs the ops. `DFLASH_FUSED_OPS=off` turns them off (for comparing
//! the two on one machine); unset or `on` keeps them.

use std::sync::{Arc, OnceLock};

use cudarc::driver::{CudaContext, CudaFunction, LaunchConfig, PushKernelArg};
use tch::{Device, Kind, Tensor};

const SOURCE: &str = concat!(include_str!("../csrc/vec_kind.cuh"), include_str!("../csrc/fused.cu"));

struct Kernels {
    ctx: Arc<CudaContext>,
    rms_norm: CudaFunction,
    unpermute: CudaFunction,
    swiglu: CudaFunction,
    route: CudaFunction,
    counts: CudaFunction,
    order: CudaFunction,
}

/// Whether the kernels may run (these and DFlash2's block convolution,
/// [`crate::block_conv_cuda`]). Any value but `on` and `off` is refused:
/// the process stops at its first use, naming the variable.
pub(crate) fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| match std::env::var("DFLASH_FUSED_OPS").as_deref() {
        Err(_) | Ok("on") => true,
        Ok("off") => false,
        Ok(other) => panic!("DFLASH_FUSED_OPS={other} is neither `on` nor `off`"),
    })
}

/// The kernels for (device, bf16 inputs), compiled on first use; None
/// (logged once) when they cannot be.
fn kernels(ordinal: usize, bf16: bool) -> Option<Arc<Kernels>> {
    static COMPILED: crate::nvrtc::Compiled<Kernels> = crate::nvrtc::Compiled::new();
    COMPILED.get(ordinal, bf16, "fused row kernels", || {
        let (ctx, module) =
            crate::nvrtc::compile(ordinal, SOURCE, "fused.cu", &[format!("-DIN_BF16={}", i32::from(bf16))])?;
        let f = |name: &str| module.load_function(name).map_err(|e| format!("kernel {name}: {e:?}"));
        Ok(Kernels {
            rms_norm: f("rms_norm_f32_scale")?,
            unpermute: f("moe_unpermute")?,
            swiglu: f("swiglu")?,
            route: f("route_softmax_topk")?,
            counts: f("expert_counts")?,
            order: f("expert_order")?,
            ctx,
        })
    })
}

/// The elements a 16-byte vector holds, for the kinds the kernels take.
fn vec_len(kind: Kind) -> Option<i64> {
    match kind {
        Kind::BFloat16 => Some(8),
        Kind::Float => Some(4),
        _ => None,
    }
}

/// The kernels for `t`'s device and kind, where `t` is a contiguous CUDA
/// tensor of that kind, 16-byte aligned, with rows of `row` elements that
/// fill whole vectors and needs no gradient.
fn applicable(t: &Tensor, row: i64) -> Option<Arc<Kernels>> {
    let Device::Cuda(ordinal) = t.device() else { return None };
    let vec = vec_len(t.kind())?;
    if !enabled() || t.requires_grad() || !t.is_contiguous() || row <= 0 || row % vec != 0 || row > i64::from(i32::MAX)
    {
        return None;
    }
    if !(t.data_ptr() as usize).is_multiple_of(16) {
        return None;
    }
    kernels(ordinal, t.kind() == Kind::BFloat16)
}

fn ptr(t: &Tensor) -> u64 {
    t.data_ptr() as u64
}

fn launch_failed(what: &str, e: cudarc::driver::DriverError) -> ! {
    // A launch that fails leaves the device in error; libtorch's next op
    // would fail less clearly.
    panic!("{what}: launching the fused CUDA kernel failed: {e:?}")
}

/// RMSNorm over the last dimension of `x` with the f32 scale `weight`,
/// computed in f32 and rounded once to `x`'s kind.
pub fn rms_norm_f32_scale(x: &Tensor, weight: &Tensor, eps: f64) -> Option<Tensor> {
    let dim = *x.size().last()?;
    if weight.kind() != Kind::Float || weight.size() != [dim] || weight.device() != x.device() || weight.requires_grad()
    {
        return None;
    }
    let kern = applicable(x, dim)?;
    let rows = x.numel() as i64 / dim;
    if rows == 0 || rows > i64::from(u32::MAX) / 32 {
        return None;
    }
    let w = weight.contiguous();
    let y = x.empty_like();
    let (px, pw, py, d, e) = (ptr(x), ptr(&w), ptr(&y), dim as i32, eps as f32);
    const WARPS: i64 = 8; // rows per block
    let cfg = LaunchConfig {
        grid_dim: (((rows + WARPS - 1) / WARPS) as u32, 1, 1),
        block_dim: (32 * WARPS as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: `x` and `y` are contiguous [rows, dim] of the compiled kind,
    // 16-byte aligned with dim a multiple of the vector (checked), `w` a
    // contiguous f32 [dim]; libtorch's stream orders their lifetimes.
    let launched = unsafe {
        kern.ctx
            .default_stream()
            .launch_builder(&kern.rms_norm)
            .arg(&px)
            .arg(&rows)
            .arg(&d)
            .arg(&pw)
            .arg(&e)
            .arg(&py)
            .launch(cfg)
    };
    launched.unwrap_or_else(|e| launch_failed("RMSNorm", e));
    Some(y)
}

/// Each token's weighted sum over its `k` expert rows: `out` `[T k, H]` in
/// expert order, `inverse` `[T k]` (int64) the row of each (token, slot),
/// `weights` `[T, k]` in `out`'s kind. `[T, H]`.
pub fn moe_unpermute(out: &Tensor, inverse: &Tensor, weights: &Tensor) -> Option<Tensor> {
    let (n, h) = (out.size()[0], *out.size().last()?);
    let (t, k) = (weights.size()[0], weights.size()[1]);
    if n != t * k || inverse.kind() != Kind::Int64 || inverse.numel() as i64 != n || weights.kind() != out.kind() {
        return None;
    }
    if t == 0 || t > i64::from(u32::MAX) || k > i64::from(i32::MAX) || weights.requires_grad() {
        return None;
    }
    let kern = applicable(out, h)?;
    let (inverse, weights) = (inverse.contiguous(), weights.contiguous());
    let y = Tensor::empty([t, h], (out.kind(), out.device()));
    let (po, pi, pw, py, ki, hi) = (ptr(out), ptr(&inverse), ptr(&weights), ptr(&y), k as i32, h as i32);
    let cfg = LaunchConfig { grid_dim: (t as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
    // SAFETY: `out` is a contiguous [T k, H] (checked, aligned rows),
    // `inverse` a contiguous [T k] of row indices into it (a permutation the
    // caller made), `weights` a contiguous [T, k] and `y` a fresh [T, H], all
    // of one kind; libtorch's stream orders their lifetimes.
    let launched = unsafe {
        kern.ctx
            .default_stream()
            .launch_builder(&kern.unpermute)
            .arg(&po)
            .arg(&pi)
            .arg(&pw)
            .arg(&ki)
            .arg(&hi)
            .arg(&py)
            .launch(cfg)
    };
    launched.unwrap_or_else(|e| launch_failed("MoE un-permute", e));
    Some(y)
}

/// `silu(gate) * up` of fused `[N, 2I]` gate/up rows (gate first), `[N, I]`.
pub fn swiglu(gate_up: &Tensor) -> Option<Tensor> {
    let two_i = *gate_up.size().last()?;
    let (rows, i) = (gate_up.numel() as i64 / two_i.max(1), two_i / 2);
    if two_i % 2 != 0 || rows == 0 {
        return None;
    }
    let kern = applicable(gate_up, i)?;
    let vectors = rows * (i / vec_len(gate_up.kind())?);
    if ((vectors + 255) / 256) > i64::from(u32::MAX) {
        return None;
    }
    let mut shape = gate_up.size();
    *shape.last_mut()? = i;
    let act = Tensor::empty(shape.as_slice(), (gate_up.kind(), gate_up.device()));
    let (pg, pa, ii) = (ptr(gate_up), ptr(&act), i as i32);
    let cfg =
        LaunchConfig { grid_dim: (((vectors + 255) / 256) as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
    // SAFETY: `gate_up` is a contiguous [rows, 2I] with I a whole number of
    // aligned vectors (checked), `act` a fresh [rows, I] of its kind.
    let launched = unsafe {
        kern.ctx.default_stream().launch_builder(&kern.swiglu).arg(&pg).arg(&rows).arg(&ii).arg(&pa).launch(cfg)
    };
    launched.unwrap_or_else(|e| launch_failed("SwiGLU", e));
    Some(act)
}

/// The Qwen router's choice from its logits `[T, E]`: softmax in f32, the
/// `k` largest in descending order, renormalised to sum to 1 when `renorm`.
/// The chosen experts `[T, k]` (int64) and their weights `[T, k]` in the
/// logits' kind.
pub fn route_softmax_topk(logits: &Tensor, k: i64, renorm: bool) -> Option<(Tensor, Tensor)> {
    let Device::Cuda(ordinal) = logits.device() else { return None };
    vec_len(logits.kind())?;
    if !enabled() || logits.dim() != 2 || !logits.is_contiguous() || logits.requires_grad() {
        return None;
    }
    let (t, e) = (logits.size()[0], logits.size()[1]);
    // The kernel holds 16 logits a lane and writes one choice a lane.
    if !(1..=32).contains(&k) || k > e || e > 512 || t == 0 || t > i64::from(u32::MAX) / 32 {
        return None;
    }
    let kern = kernels(ordinal, logits.kind() == Kind::BFloat16)?;
    let chosen = Tensor::empty([t, k], (Kind::Int64, logits.device()));
    let weights = Tensor::empty([t, k], (logits.kind(), logits.device()));
    let (pl, pc, pw, ei, ki, norm) = (ptr(logits), ptr(&chosen), ptr(&weights), e as i32, k as i32, i32::from(renorm));
    const WARPS: i64 = 8; // tokens per block
    let cfg = LaunchConfig {
        grid_dim: (((t + WARPS - 1) / WARPS) as u32, 1, 1),
        block_dim: (32 * WARPS as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: `logits` is a contiguous [T, E] of the compiled kind, `chosen`
    // and `weights` fresh [T, k]; libtorch's stream orders their lifetimes.
    let launched = unsafe {
        kern.ctx
            .default_stream()
            .launch_builder(&kern.route)
            .arg(&pl)
            .arg(&t)
            .arg(&ei)
            .arg(&ki)
            .arg(&norm)
            .arg(&pc)
            .arg(&pw)
            .launch(cfg)
    };
    launched.unwrap_or_else(|e| launch_failed("MoE routing", e));
    Some((chosen, weights))
}

/// The (token, slot) pairs of a MoE block grouped by expert, in the order a
/// stable sort of the chosen experts gives them.
pub struct ExpertOrder {
    /// Each position's pair (`token * k + slot`).
    pub order: Tensor,
    /// Each pair's position.
    pub inverse: Tensor,
    /// Each position's token.
    pub token: Tensor,
    /// Cumulative pair counts per expert (int32, as the grouped GEMM takes them).
    pub offsets: Tensor,
}

/// [`ExpertOrder`] of `chosen` `[T, k]` (int64 ids below `experts`) by a
/// histogram and a stable counting sort.
pub fn expert_order(chosen: &Tensor, experts: i64) -> Option<ExpertOrder> {
    let Device::Cuda(ordinal) = chosen.device() else { return None };
    if !enabled() || chosen.kind() != Kind::Int64 || chosen.dim() != 2 {
        return None;
    }
    let (t, k, n) = (chosen.size()[0], chosen.size()[1], chosen.numel() as i64);
    if n == 0 || n > i64::from(i32::MAX) || experts <= 0 || experts > i64::from(u32::MAX) || t == 0 {
        return None;
    }
    // The index kernels do not depend on the kind; a GPU run has the bf16 build.
    let kern = kernels(ordinal, true)?;
    let device = chosen.device();
    let chosen = chosen.contiguous();
    let counts = Tensor::zeros([experts], (Kind::Int, device));
    let (pc, pn) = (ptr(&chosen), ptr(&counts));
    let blocks = ((n + 255) / 256).min(4096) as u32;
    let cfg = LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
    // SAFETY: `chosen` is a contiguous [n] of int64 expert ids below
    // `experts` (the router's top-k), `counts` a zeroed int32 [experts].
    let launched =
        unsafe { kern.ctx.default_stream().launch_builder(&kern.counts).arg(&pc).arg(&n).arg(&pn).launch(cfg) };
    launched.unwrap_or_else(|e| launch_failed("MoE expert counts", e));
    let offsets = counts.cumsum(0, Kind::Int);
    let start = &offsets - &counts;
    let order = Tensor::empty([n], (Kind::Int64, device));
    let inverse = Tensor::empty([n], (Kind::Int64, device));
    let token = Tensor::empty([n], (Kind::Int64, device));
    let (ps, po, pi, pt, ki) = (ptr(&start), ptr(&order), ptr(&inverse), ptr(&token), k as i32);
    let cfg = LaunchConfig { grid_dim: (experts as u32, 1, 1), block_dim: (1024, 1, 1), shared_mem_bytes: 0 };
    // SAFETY: as above; `start` [experts] int32 holds each expert's first
    // position, so the positions written are a permutation of 0..n; the
    // outputs are fresh [n] int64.
    let launched = unsafe {
        kern.ctx
            .default_stream()
            .launch_builder(&kern.order)
            .arg(&pc)
            .arg(&n)
            .arg(&ki)
            .arg(&ps)
            .arg(&po)
            .arg(&pi)
            .arg(&pt)
            .launch(cfg)
    };
    launched.unwrap_or_else(|e| launch_failed("MoE expert order", e));
    Some(ExpertOrder { order, inverse, token, offsets })
}
