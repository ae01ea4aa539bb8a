//! The delta rule's chunked form on a GPU as three fused kernels
//! (`csrc/delta_rule.cu`: UT prep, state scan, outputs) in place of the
//! chain of libtorch ops of [`crate::delta_rule`] (about thirty passes over
//! `[chunks, heads, 64, d]` tensors per layer, and two small products per
//! chunk step). Same math, same chunks, every product accumulated in f32.
//! Beside them, the layer's packed causal convolution and SiLU as one
//! kernel ([`causal_conv_silu`]).
//!
//! The kernels are compiled once per process, device and head shape by
//! NVRTC (the `libnvrtc.so.13` that PyTorch's CUDA wheel ships, found next
//! to libtorch), so the release binary stays one build for every GPU. When
//! NVRTC cannot be loaded or compiling fails, the rule runs as libtorch ops
//! and the reason is logged once.
//!
//! For the head shape of every published hybrid (dk = dv = 128), the
//! products of all three run on tensor cores
//! (`ut_prep_tc`, `scan_tc`, `output_tc`: tf32 operands, f32 accumulators;
//! f32 inputs keep f32 accuracy by summing three tf32 products per
//! product). Other head dims run the same kernels' CUDA-core versions.
//!
//! `DFLASH_DELTA_RULE` picks the path, for comparing them on one machine:
//! `fused` (the default, as above), `cuda-cores` (the fused kernels
//! without tensor cores) or `torch` (the libtorch ops).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::sys::{CUdevice_attribute, CUfunction_attribute};
use cudarc::driver::{CudaContext, CudaFunction, LaunchConfig, PushKernelArg};
use tch::{Device, Kind, Tensor};

use crate::delta_rule::{CHUNK, ChunkPlan, RuleInputs, RuleOutput};

const SOURCE: &str = include_str!("../csrc/delta_rule.cu");
/// Threads of the UT-prep and output blocks.
const BLOCK: u32 = 256;

/// One head shape's kernels on one device.
struct Kernels {
    ctx: Arc<CudaContext>,
    ut_prep: CudaFunction,
    scan: CudaFunction,
    output: CudaFunction,
    conv: CudaFunction,
    /// The convolution on 16-byte vectors of channels.
    conv_vec: CudaFunction,
    qk_norm: CudaFunction,
    gates: CudaFunction,
    gated_norm: CudaFunction,
    /// Value columns per scan block.
    bv: i64,
    shared: [u32; 3],
}

/// (device ordinal, dk, dv, bf16 inputs)
type Key = (usize, i64, i64, bool);

fn cache() -> &'static Mutex<HashMap<Key, Option<Arc<Kernels>>>> {
    static CACHE: OnceLock<Mutex<HashMap<Key, Option<Arc<Kernels>>>>> = OnceLock::new();
    CACHE.get_or_init(Default::default)
}

/// The path `DFLASH_DELTA_RULE` selects.
#[derive(Clone, Copy, PartialEq)]
enum Path {
    /// Fused kernels, tensor cores where the head shape allows (the default).
    Fused,
    /// Fused kernels on CUDA cores only.
    CudaCores,
    /// libtorch ops.
    Torch,
}

/// The selected path. Any other value is refused: the process stops at its
/// first hybrid forward, naming the variable.
fn path() -> Path {
    static PATH: OnceLock<Path> = OnceLock::new();
    *PATH.get_or_init(|| match std::env::var("DFLASH_DELTA_RULE").as_deref() {
        Err(_) | Ok("fused") => Path::Fused,
        Ok("cuda-cores") => Path::CudaCores,
        Ok("torch") => Path::Torch,
        Ok(other) => panic!("DFLASH_DELTA_RULE={other} is none of `fused`, `cuda-cores`, `torch`"),
    })
}

/// Whether the fused kernels may be used.
fn selected() -> bool {
    path() != Path::Torch
}

/// Whether the rule runs on tensor cores for this head shape: the shape of
/// every published hybrid (dk = dv = 128), the one they are tested at on a
/// GPU. (The kernels are written for dk a multiple of 32 up to 128 and dv a
/// multiple of 32; other shapes run the CUDA-core kernels until tested.)
fn tensor_cores(dk: i64, dv: i64) -> bool {
    path() == Path::Fused && dk == 128 && dv == 128
}

fn compile(ordinal: usize, dk: i64, dv: i64, bf16: bool) -> Result<Kernels, String> {
    let bv = dv.min(32);
    let tc = tensor_cores(dk, dv);
    let defines = [
        format!("-DDK={dk}"),
        format!("-DDV={dv}"),
        format!("-DBV={bv}"),
        format!("-DIN_BF16={}", i32::from(bf16)),
        format!("-DTC={}", i32::from(tc)),
    ];
    let (ctx, module) = crate::nvrtc::compile(ordinal, SOURCE, "delta_rule.cu", &defines)?;
    let f = |name: &str| module.load_function(name).map_err(|e| format!("kernel {name}: {e:?}"));
    let names = if tc { ["ut_prep_tc", "scan_tc", "output_tc"] } else { ["ut_prep", "scan", "output"] };
    let (ut_prep, scan, output) = (f(names[0])?, f(names[1])?, f(names[2])?);
    let (conv, conv_vec) = (f("causal_conv_silu")?, f("causal_conv_silu_vec")?);
    let (qk_norm, gates, gated_norm) = (f("qk_norm")?, f("gates")?, f("gated_norm")?);
    // The shared tiles of each kernel (see the .cu file): row strides
    // LP = 68 and KP = dk + 4; the tensor-core kernels' dk + 4, dk + 8 and
    // bv + 8.
    let (l, lp, kp) = (CHUNK, 68, dk + 4);
    let floats = if tc {
        [
            l * kp + l * (dv + 8) + 2 * l * lp + 16 * (l - 12) + 2 * l,
            l * kp + l * (dk + 8) + (dk + l) * (bv + 8) + l,
            2 * l * kp + l * lp + l,
        ]
    } else {
        [dk * lp + l * lp + 2 * l, 2 * l * kp + dk * bv + l * bv + l, 2 * dk * lp + l * lp + l]
    };
    let shared = floats.map(|n| (n * 4) as u32);
    let limit = ctx
        .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
        .map_err(|e| format!("shared memory limit: {e:?}"))?;
    for (func, bytes) in [(&ut_prep, shared[0]), (&scan, shared[1]), (&output, shared[2])] {
        if bytes as i32 > limit {
            return Err(format!(
                "head dims {dk}x{dv} need {bytes} bytes of shared memory a block; the device has {limit}"
            ));
        }
        func.set_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, bytes as i32)
            .map_err(|e| format!("shared memory attribute: {e:?}"))?;
    }
    Ok(Kernels { ctx, ut_prep, scan, output, conv, conv_vec, qk_norm, gates, gated_norm, bv, shared })
}

/// The kernels for a shape, compiled on first use; None (logged once per
/// shape) when they cannot be.
fn kernels(ordinal: usize, dk: i64, dv: i64, bf16: bool) -> Option<Arc<Kernels>> {
    let mut cache = cache().lock().unwrap_or_else(|p| p.into_inner());
    cache
        .entry((ordinal, dk, dv, bf16))
        .or_insert_with(|| match compile(ordinal, dk, dv, bf16) {
            Ok(k) => {
                tracing::info!(
                    dk,
                    dv,
                    bf16,
                    tensor_cores = tensor_cores(dk, dv),
                    "delta rule: fused CUDA kernels compiled"
                );
                Some(Arc::new(k))
            }
            Err(e) => {
                tracing::warn!("delta rule: fused CUDA kernels unavailable ({e}); using libtorch ops");
                None
            }
        })
        .clone()
}

/// Whether the kernels take these head dims: every thread layout divides
/// evenly (dk a multiple of 8; dv a divisor of 256, at least 4, and a
/// multiple of its scan tile, whose thread count divides `16 dk`).
fn supported(dk: i64, dv: i64) -> bool {
    let bv = dv.min(32);
    dk % 8 == 0 && dk > 0 && (4..=256).contains(&dv) && 256 % dv == 0 && dv % bv == 0 && (2 * dk) % bv == 0
}

/// `t` contiguous and 16-byte aligned (the kernels read four elements a load).
fn aligned(t: Tensor) -> Tensor {
    let t = t.contiguous();
    if (t.data_ptr() as usize).is_multiple_of(16) { t } else { t.copy() }
}

/// Whether the fused kernels run for this device, head shape and input
/// kind (compiling them if they were not yet).
pub fn available(device: Device, dk: i64, dv: i64, kind: Kind) -> bool {
    let Device::Cuda(ordinal) = device else { return false };
    let Some(bf16) = bf16_input(kind) else { return false };
    selected() && supported(dk, dv) && kernels(ordinal, dk, dv, bf16).is_some()
}

/// Whether the kernels read `kind` as bf16 (true) or f32 (false); None for
/// a kind they do not take.
fn bf16_input(kind: Kind) -> Option<bool> {
    match kind {
        Kind::BFloat16 => Some(true),
        Kind::Float => Some(false),
        _ => None,
    }
}

fn ptr(t: &Tensor) -> u64 {
    t.data_ptr() as u64
}

/// The chunked rule through the fused kernels; None where they do not
/// apply (not a CUDA tensor, an input kind or head shape they do not take,
/// the kernels unavailable or deselected), and the caller runs the ops.
/// `q` and `k` may have fewer heads than `v` (each serving `H / HK` value
/// heads, as the layer's projections make them).
pub fn chunked(
    x: &RuleInputs,
    p: &ChunkPlan,
    initial: Option<&Tensor>,
    mark: &mut dyn FnMut(&'static str),
) -> Option<RuleOutput> {
    let Device::Cuda(ordinal) = x.v.device() else { return None };
    let kind = x.v.kind();
    let bf16 = bf16_input(kind)?;
    let (t, h, dv) = (x.v.size()[0], x.v.size()[1], x.v.size()[2]);
    let (hk, dk) = (x.k.size()[1], x.k.size()[2]);
    if !selected() || !supported(dk, dv) || h % hk != 0 || x.q.size()[1] != hk || t == 0 {
        return None;
    }
    let kern = kernels(ordinal, dk, dv, bf16)?;
    let _guard = tch::no_grad_guard();
    let c = |t: &Tensor| aligned(t.to_kind(kind));
    let f32c = |t: &Tensor| t.to_kind(Kind::Float).contiguous();
    let (q, k, v, g, beta) = (c(x.q), c(x.k), c(x.v), f32c(x.g), f32c(x.beta));
    let init = initial.map(f32c);
    let (chunks, n) = (p.chunks(), p.lens().len() as i64);
    let fo = (Kind::Float, x.v.device());
    let u = Tensor::empty([chunks, h, CHUNK, dv], fo);
    let w = Tensor::empty([chunks, h, CHUNK, dk], fo);
    let gc = Tensor::empty([chunks, h, CHUNK], fo);
    let s_in = Tensor::empty([chunks, h, dk, dv], fo);
    let final_state = Tensor::empty([n, h, dk, dv], fo);
    let out = Tensor::empty([t, h, dv], fo);
    let table = p.kernel_table();
    let (tok, len, first, count, order) =
        (ptr(&table[0]), ptr(&table[1]), ptr(&table[2]), ptr(&table[3]), ptr(&table[4]));
    let (hi, hki) = (h as i32, hk as i32);
    let init_ptr = init.as_ref().map_or(0u64, ptr);
    let stream = kern.ctx.default_stream(); // libtorch's stream: ordered with its ops
    let grid = |x: i64, z: i64| (x as u32, h as u32, z as u32);
    let cfg = |grid, block, shared| LaunchConfig { grid_dim: grid, block_dim: (block, 1, 1), shared_mem_bytes: shared };
    let launched = (|| {
        let (pq, pk, pv, pg, pb) = (ptr(&q), ptr(&k), ptr(&v), ptr(&g), ptr(&beta));
        let (pu, pw, pgc, ps, pf, po) = (ptr(&u), ptr(&w), ptr(&gc), ptr(&s_in), ptr(&final_state), ptr(&out));
        // SAFETY: every pointer is a live, contiguous tensor of the shape the
        // kernel indexes (made or checked above); the tensors outlive the
        // launches in stream order (libtorch frees into its stream-ordered
        // cache on this same stream).
        unsafe {
            stream
                .launch_builder(&kern.ut_prep)
                .arg(&pk)
                .arg(&pv)
                .arg(&pg)
                .arg(&pb)
                .arg(&tok)
                .arg(&len)
                .arg(&hi)
                .arg(&hki)
                .arg(&pu)
                .arg(&pw)
                .arg(&pgc)
                .launch(cfg(grid(chunks, 1), BLOCK, kern.shared[0]))?;
        }
        mark("rule: UT prep (fused)");
        unsafe {
            stream
                .launch_builder(&kern.scan)
                .arg(&pk)
                .arg(&pu)
                .arg(&pw)
                .arg(&pgc)
                .arg(&tok)
                .arg(&len)
                .arg(&first)
                .arg(&count)
                .arg(&order)
                .arg(&init_ptr)
                .arg(&hi)
                .arg(&hki)
                .arg(&ps)
                .arg(&pf)
                .launch(cfg(((h * (dv / kern.bv)) as u32, n as u32, 1), (kern.bv * 8) as u32, kern.shared[1]))?;
        }
        mark("rule: state scan (fused)");
        unsafe {
            stream
                .launch_builder(&kern.output)
                .arg(&pq)
                .arg(&pk)
                .arg(&pu)
                .arg(&pgc)
                .arg(&ps)
                .arg(&tok)
                .arg(&len)
                .arg(&hi)
                .arg(&hki)
                .arg(&po)
                .launch(cfg(grid(chunks, 1), BLOCK, kern.shared[2]))?;
        }
        mark("rule: outputs (fused)");
        Ok::<(), cudarc::driver::DriverError>(())
    })();
    if let Err(e) = launched {
        // A launch that fails leaves the device in error; libtorch's next op
        // would fail less clearly.
        panic!("delta rule: launching the fused CUDA kernels on GPU {ordinal} failed: {e:?}");
    }
    Some(RuleOutput { out, final_state, states: None })
}

/// The Gated DeltaNet layer's causal depthwise convolution and SiLU over
/// packed sequences through one kernel: `mixed` `[T, C]` (rows may be a
/// slice of a wider projection), `weight` `[C, K]`, `positions` `[T]` each
/// token's position in its sequence (int64). The kernels are those of the
/// layer's head shape `(dk, dv)`. None where the fused kernels do not apply.
pub fn causal_conv_silu(mixed: &Tensor, weight: &Tensor, positions: &Tensor, dk: i64, dv: i64) -> Option<Tensor> {
    let Device::Cuda(ordinal) = mixed.device() else { return None };
    let kind = mixed.kind();
    let bf16 = bf16_input(kind)?;
    let (t, c) = (mixed.size()[0], mixed.size()[1]);
    if !selected() || !supported(dk, dv) || t == 0 || t > i64::from(u32::MAX) || mixed.stride()[1] != 1 {
        return None;
    }
    let kern = kernels(ordinal, dk, dv, bf16)?;
    let _guard = tch::no_grad_guard();
    let w = weight.to_kind(kind).contiguous();
    let k = w.size()[1];
    let y = Tensor::empty([t, c], (kind, mixed.device()));
    let (px, pw, pp, py) = (ptr(mixed), ptr(&w), ptr(positions), ptr(&y));
    let (stride, ci, ki) = (mixed.stride()[0], c as i32, k as i32);
    // Whole 16-byte vectors of channels over runs of 64 tokens, with the
    // taps and the window in registers, where the rows and the kernel size
    // (at most 4 taps) allow it; else a block per token.
    let per_vec = if bf16 { 8 } else { 4 };
    let vectors = k <= 4 && stride % per_vec == 0 && c % per_vec == 0 && (mixed.data_ptr() as usize).is_multiple_of(16);
    let cfg = if vectors {
        let grid = (((c / per_vec + 127) / 128) as u32, ((t + 63) / 64) as u32, 1);
        LaunchConfig { grid_dim: grid, block_dim: (128, 1, 1), shared_mem_bytes: 0 }
    } else {
        LaunchConfig { grid_dim: (t as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 }
    };
    let stream = kern.ctx.default_stream();
    // SAFETY: `mixed` rows are `stride` elements apart with unit column
    // stride (checked), `w` is a contiguous [C, K], `positions` [T] int64
    // and `y` a fresh [T, C]; stream order keeps them alive (see `chunked`).
    let launched = unsafe {
        stream
            .launch_builder(if vectors { &kern.conv_vec } else { &kern.conv })
            .arg(&px)
            .arg(&stride)
            .arg(&pw)
            .arg(&pp)
            .arg(&t)
            .arg(&ci)
            .arg(&ki)
            .arg(&py)
            .launch(cfg)
    };
    if let Err(e) = launched {
        panic!("linear attention: launching the fused convolution on GPU {ordinal} failed: {e:?}");
    }
    Some(y)
}

/// Where a Gated DeltaNet layer's rule inputs come from: the convolved
/// channels `conv` `[N, C]` (q at channel 0, k after it) and the input
/// projection `proj` `[N, P]` (b and a at columns `b_col`, `a_col`), both
/// with unit column stride, and the layer's per-value-head `neg_a`
/// (`-exp(A_log)`) and `dt_bias`, f32.
pub struct GateSource<'a> {
    pub conv: &'a Tensor,
    pub proj: &'a Tensor,
    pub key_heads: i64,
    pub key_dim: i64,
    pub value_heads: i64,
    pub value_dim: i64,
    pub b_col: i64,
    pub a_col: i64,
    pub neg_a: &'a Tensor,
    pub dt_bias: &'a Tensor,
}

/// q and k L2-normalised (q scaled by `dk^-1/2`) in the input kind
/// `[N, HK, DK]`, and the gates g, beta `[N, NV]` f32, through two kernels
/// (one warp per head row; one block per token). None where the fused
/// kernels do not apply.
pub fn qk_norm_gates(x: &GateSource) -> Option<(Tensor, Tensor, Tensor, Tensor)> {
    let Device::Cuda(ordinal) = x.conv.device() else { return None };
    let kind = x.conv.kind();
    let bf16 = bf16_input(kind)?;
    let n = x.conv.size()[0];
    let (hk, dk, nv) = (x.key_heads, x.key_dim, x.value_heads);
    let unit_columns = x.conv.stride()[1] == 1 && x.proj.stride()[1] == 1 && x.proj.kind() == kind;
    if !selected() || !supported(dk, x.value_dim) || n == 0 || n > i64::from(u32::MAX) / 64 || !unit_columns {
        return None;
    }
    let kern = kernels(ordinal, dk, x.value_dim, bf16)?;
    let _guard = tch::no_grad_guard();
    let dev = x.conv.device();
    let (q, k) = (Tensor::empty([n, hk, dk], (kind, dev)), Tensor::empty([n, hk, dk], (kind, dev)));
    let (g, beta) = (Tensor::empty([n, nv], (Kind::Float, dev)), Tensor::empty([n, nv], (Kind::Float, dev)));
    let (neg_a, dt_bias) = (x.neg_a.to_kind(Kind::Float).contiguous(), x.dt_bias.to_kind(Kind::Float).contiguous());
    let (pc, pp, pq, pk, pg, pb, pn, pd) =
        (ptr(x.conv), ptr(x.proj), ptr(&q), ptr(&k), ptr(&g), ptr(&beta), ptr(&neg_a), ptr(&dt_bias));
    let (conv_stride, proj_stride) = (x.conv.stride()[0], x.proj.stride()[0]);
    let (hki, nvi, scale) = (hk as i32, nv as i32, (dk as f64).powf(-0.5) as f32);
    let warps = n * 2 * hk;
    let norm_cfg =
        LaunchConfig { grid_dim: (((warps + 7) / 8) as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
    let gate_cfg = LaunchConfig { grid_dim: (n as u32, 1, 1), block_dim: (64, 1, 1), shared_mem_bytes: 0 };
    let stream = kern.ctx.default_stream();
    // SAFETY: `conv` and `proj` rows are their row strides apart with unit
    // column stride (checked) and hold the channels and columns read; the
    // outputs are fresh tensors of the shapes written; stream order keeps
    // every tensor alive (see `chunked`).
    let launched = unsafe {
        stream
            .launch_builder(&kern.qk_norm)
            .arg(&pc)
            .arg(&conv_stride)
            .arg(&n)
            .arg(&hki)
            .arg(&scale)
            .arg(&pq)
            .arg(&pk)
            .launch(norm_cfg)
            .and_then(|_| {
                stream
                    .launch_builder(&kern.gates)
                    .arg(&pp)
                    .arg(&proj_stride)
                    .arg(&x.b_col)
                    .arg(&x.a_col)
                    .arg(&n)
                    .arg(&nvi)
                    .arg(&pn)
                    .arg(&pd)
                    .arg(&pg)
                    .arg(&pb)
                    .launch(gate_cfg)
            })
    };
    if let Err(e) = launched {
        panic!("linear attention: launching the fused q/k norm and gates on GPU {ordinal} failed: {e:?}");
    }
    Some((q, k, g, beta))
}

/// The rule's output `out` `[N, NV, DV]` (f32) RMS-normalised per head
/// (`eps`), scaled by `weight` `[DV]` and gated by `silu(z)`, z at column
/// `z_col` of `proj` `[N, P]` (unit column stride, the model's kind), as
/// `[N, NV * DV]` in that kind: one kernel in place of six libtorch passes,
/// rounding where they round. `dk` names the layer's kernels. None where
/// the fused kernels do not apply.
pub fn gated_norm(out: &Tensor, proj: &Tensor, z_col: i64, weight: &Tensor, eps: f64, dk: i64) -> Option<Tensor> {
    let Device::Cuda(ordinal) = out.device() else { return None };
    let kind = proj.kind();
    let bf16 = bf16_input(kind)?;
    let [n, nv, dv] = out.size()[..] else { return None };
    let fits = out.kind() == Kind::Float && proj.stride()[1] == 1 && z_col + nv * dv <= proj.size()[1];
    if !selected() || !supported(dk, dv) || n == 0 || n * nv > i64::from(u32::MAX) / 64 || !fits {
        return None;
    }
    let kern = kernels(ordinal, dk, dv, bf16)?;
    let _guard = tch::no_grad_guard();
    let (out, w) = (out.contiguous(), weight.to_kind(kind).contiguous());
    let y = Tensor::empty([n, nv * dv], (kind, out.device()));
    let (po, pp, pw, py) = (ptr(&out), ptr(proj), ptr(&w), ptr(&y));
    let (stride, nvi, eps) = (proj.stride()[0], nv as i32, eps as f32);
    let warps = n * nv;
    let cfg = LaunchConfig { grid_dim: (((warps + 7) / 8) as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
    let stream = kern.ctx.default_stream();
    // SAFETY: `out` is a contiguous f32 [N, NV, DV], `proj` rows are
    // `stride` apart with unit column stride and hold the z columns
    // (checked), `w` a contiguous [DV] and `y` a fresh [N, NV * DV]; stream
    // order keeps them alive (see `chunked`).
    let launched = unsafe {
        stream
            .launch_builder(&kern.gated_norm)
            .arg(&po)
            .arg(&pp)
            .arg(&stride)
            .arg(&z_col)
            .arg(&n)
            .arg(&nvi)
            .arg(&pw)
            .arg(&eps)
            .arg(&py)
            .launch(cfg)
    };
    if let Err(e) = launched {
        panic!("linear attention: launching the fused gated norm on GPU {ordinal} failed: {e:?}");
    }
    Some(y)
}
