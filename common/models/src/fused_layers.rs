//! The drafter layer's RoPE and SwiGLU on a GPU as autograd functions
//! (`csrc/fused_layers.cpp`) whose forward and backward are one kernel
//! each (`csrc/fused_layers.cu`): libtorch's chains made five passes over
//! the queries and keys for RoPE and kept `silu(gate)` beside gate and up
//! for SwiGLU's backward. [`rope`] and [`swiglu`] take that path for CUDA
//! tensors of the shapes below and run the libtorch ops otherwise (the CPU,
//! partial rotary tables, views that are not contiguous, and
//! `DFLASH_FUSED_OPS=off`), so the CPU's arithmetic is unchanged.
//! [`norm_rope`] is the per-head QK norm and the RoPE after it as one
//! function (`csrc/norm_rope.cu`: one warp per head vector, the weight's
//! gradient summed per thread block): the normalized queries and keys are
//! never written, nor their gradient read.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use cudarc::driver::{CudaContext, CudaFunction, LaunchConfig, PushKernelArg};
use tch::{Kind, Tensor};

use crate::layers::RmsNorm;
use crate::nvrtc::{call_shim, raw};
use crate::rope::apply_rope;

const SOURCE: &str = concat!(
    include_str!("../csrc/vec_kind.cuh"),
    include_str!("../csrc/fused_layers.cu"),
    include_str!("../csrc/norm_rope.cu")
);
const THREADS: u32 = 256;

/// One call, as `csrc/fused_layers.cpp` lays out `DflashFusedLayerCall`.
#[repr(C)]
pub struct Call {
    op: i32,
    device: i32,
    bf16: i32,
    heads: i32,
    dim: i32,
    rows: i64,
    table_rows: i64,
    numel: i64,
    a: u64,
    b: u64,
    c: u64,
    out0: u64,
    out1: u64,
    d: u64,
    e: u64,
    f: u64,
    eps: f64,
    blocks: i64,
}

const ROPE_FORWARD: i32 = 0;
const ROPE_BACKWARD: i32 = 1;
const SWIGLU_FORWARD: i32 = 2;
const SWIGLU_BACKWARD: i32 = 3;
const NORM_ROPE_FORWARD: i32 = 4;
const NORM_ROPE_BACKWARD: i32 = 5;

/// Head sizes the norm + RoPE kernels take: 32 lanes of 2, 4 or 8 elements.
const NORM_ROPE_DIMS: [i32; 3] = [64, 128, 256];

/// Kernels launched so far in this process: how a test tells the kernels
/// from the libtorch ops they replace.
pub static LAUNCHES: AtomicU64 = AtomicU64::new(0);

struct Kernels {
    ctx: Arc<CudaContext>,
    rope: CudaFunction,
    swiglu_forward: CudaFunction,
    swiglu_backward: CudaFunction,
    /// Norm + RoPE forward and backward for head sizes 64, 128, 256.
    norm_rope_forward: [CudaFunction; 3],
    norm_rope_backward: [CudaFunction; 3],
}

fn kernels(ordinal: usize, bf16: bool) -> Option<Arc<Kernels>> {
    static COMPILED: crate::nvrtc::Compiled<Kernels> = crate::nvrtc::Compiled::new();
    COMPILED.get(ordinal, bf16, "fused layer kernels", || {
        let defines = [format!("-DIN_BF16={}", i32::from(bf16))];
        let (ctx, m) = crate::nvrtc::compile(ordinal, SOURCE, "fused_layers.cu", &defines)?;
        let f = |name: &str| m.load_function(name).map_err(|e| format!("kernel {name}: {e:?}"));
        Ok(Kernels {
            rope: f("rope")?,
            swiglu_forward: f("swiglu_forward")?,
            swiglu_backward: f("swiglu_backward")?,
            norm_rope_forward: [f("norm_rope_forward_2")?, f("norm_rope_forward_4")?, f("norm_rope_forward_8")?],
            norm_rope_backward: [f("norm_rope_backward_2")?, f("norm_rope_backward_4")?, f("norm_rope_backward_8")?],
            ctx,
        })
    })
}

/// Hands [`launch`] to the shim, once per process.
fn register() {
    static ONCE: OnceLock<()> = OnceLock::new();
    ONCE.get_or_init(|| {
        // SAFETY: `launch` has the shim's launcher signature and lives for
        // the whole process.
        unsafe { dflash_fused_layers_set_launcher(launch) }
    });
}

unsafe extern "C" {
    /// csrc/fused_layers.cpp.
    fn dflash_fused_layers_set_launcher(f: unsafe extern "C" fn(*const Call, *mut std::ffi::c_char, i32) -> i32);
    /// csrc/fused_layers.cpp: a new `at::Tensor*` or null with `err` filled.
    fn dflash_fused_rope(
        x: *mut std::ffi::c_void,
        cos: *mut std::ffi::c_void,
        sin: *mut std::ffi::c_void,
        err: *mut std::ffi::c_char,
        err_len: i32,
    ) -> *mut std::ffi::c_void;
    /// csrc/fused_layers.cpp: a new `at::Tensor*` or null with `err` filled.
    fn dflash_fused_norm_rope(
        x: *mut std::ffi::c_void,
        w: *mut std::ffi::c_void,
        cos: *mut std::ffi::c_void,
        sin: *mut std::ffi::c_void,
        eps: f64,
        err: *mut std::ffi::c_char,
        err_len: i32,
    ) -> *mut std::ffi::c_void;
    /// csrc/fused_layers.cpp: a new `at::Tensor*` or null with `err` filled.
    fn dflash_fused_swiglu(
        gate: *mut std::ffi::c_void,
        up: *mut std::ffi::c_void,
        err: *mut std::ffi::c_char,
        err_len: i32,
    ) -> *mut std::ffi::c_void;
}

/// Elements of a 16-byte vector of the call's kind.
fn vec_len(c: &Call) -> i64 {
    if c.bf16 != 0 { 8 } else { 4 }
}

/// Threads of the call's kernel: one per vector (of a head's half for
/// RoPE); a warp per head vector for the norm + RoPE forward, and the
/// backward's fixed grid.
fn threads(c: &Call) -> i64 {
    match c.op {
        ROPE_FORWARD | ROPE_BACKWARD => c.rows * i64::from(c.heads) * i64::from(c.dim / 2) / vec_len(c),
        NORM_ROPE_FORWARD => c.rows * i64::from(c.heads) * 32,
        NORM_ROPE_BACKWARD => c.blocks * i64::from(THREADS),
        _ => c.numel / vec_len(c),
    }
}

/// Thread blocks for `threads` threads.
fn blocks(threads: i64) -> i64 {
    (threads + i64::from(THREADS) - 1) / i64::from(THREADS)
}

/// Whether the kernels take this call's shapes and pointers.
fn applies(c: &Call) -> bool {
    let vec = vec_len(c);
    let shapes = match c.op {
        ROPE_FORWARD | ROPE_BACKWARD => {
            c.heads > 0 && c.dim > 0 && i64::from(c.dim / 2) % vec == 0 && c.rows > 0 && c.table_rows > 0
        }
        SWIGLU_FORWARD | SWIGLU_BACKWARD => c.numel > 0 && c.numel % vec == 0,
        NORM_ROPE_FORWARD | NORM_ROPE_BACKWARD => {
            NORM_ROPE_DIMS.contains(&c.dim)
                && c.heads > 0
                && c.rows > 0
                && c.table_rows > 0
                && (c.op == NORM_ROPE_FORWARD || (1..=1024).contains(&c.blocks))
        }
        _ => false,
    };
    let pointers: &[u64] = match c.op {
        SWIGLU_FORWARD => &[c.a, c.b, c.out0],
        SWIGLU_BACKWARD => &[c.a, c.b, c.c, c.out0, c.out1],
        NORM_ROPE_FORWARD => &[c.a, c.b, c.c, c.d, c.out0, c.out1],
        NORM_ROPE_BACKWARD => &[c.a, c.b, c.c, c.d, c.e, c.f, c.out0, c.out1],
        _ => &[c.a, c.b, c.c, c.out0],
    };
    crate::fused_cuda::enabled()
        && shapes
        && blocks(threads(c)) <= i64::from(i32::MAX)
        && pointers.iter().all(|&p| p != 0 && p % 16 == 0)
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
    let n = threads(c);
    let cfg = LaunchConfig { grid_dim: (blocks(n) as u32, 1, 1), block_dim: (THREADS, 1, 1), shared_mem_bytes: 0 };
    let stream = k.ctx.default_stream(); // libtorch's stream: ordered with its ops
    let vectors = n;
    let backward = i32::from(c.op == ROPE_BACKWARD);
    // SAFETY: the shim sized every tensor it passes by the call's shape;
    // `applies` checked alignment; libtorch's stream orders the tensors'
    // lifetimes.
    let launched = unsafe {
        match c.op {
            ROPE_FORWARD | ROPE_BACKWARD => stream
                .launch_builder(&k.rope)
                .arg(&c.a)
                .arg(&c.b)
                .arg(&c.c)
                .arg(&c.rows)
                .arg(&c.heads)
                .arg(&c.dim)
                .arg(&c.table_rows)
                .arg(&backward)
                .arg(&c.out0)
                .launch(cfg),
            SWIGLU_FORWARD => {
                stream.launch_builder(&k.swiglu_forward).arg(&c.a).arg(&c.b).arg(&vectors).arg(&c.out0).launch(cfg)
            }
            NORM_ROPE_FORWARD | NORM_ROPE_BACKWARD => {
                let which = NORM_ROPE_DIMS.iter().position(|&d| d == c.dim).expect("`applies` checked the head size");
                let head_vectors = c.rows * i64::from(c.heads);
                if c.op == NORM_ROPE_FORWARD {
                    let eps = c.eps as f32;
                    stream
                        .launch_builder(&k.norm_rope_forward[which])
                        .arg(&c.a)
                        .arg(&c.d)
                        .arg(&c.b)
                        .arg(&c.c)
                        .arg(&head_vectors)
                        .arg(&c.heads)
                        .arg(&c.table_rows)
                        .arg(&eps)
                        .arg(&c.out0)
                        .arg(&c.out1)
                        .launch(cfg)
                } else {
                    stream
                        .launch_builder(&k.norm_rope_backward[which])
                        .arg(&c.a)
                        .arg(&c.e)
                        .arg(&c.f)
                        .arg(&c.d)
                        .arg(&c.b)
                        .arg(&c.c)
                        .arg(&head_vectors)
                        .arg(&c.heads)
                        .arg(&c.table_rows)
                        .arg(&c.out0)
                        .arg(&c.out1)
                        .launch(cfg)
                }
            }
            _ => stream
                .launch_builder(&k.swiglu_backward)
                .arg(&c.a)
                .arg(&c.b)
                .arg(&c.c)
                .arg(&vectors)
                .arg(&c.out0)
                .arg(&c.out1)
                .launch(cfg),
        }
    };
    launched.map_err(|e| format!("launching the fused layer kernel failed: {e:?}"))?;
    LAUNCHES.fetch_add(1, Ordering::Relaxed);
    Ok(())
}

fn fused_kind(k: Kind) -> bool {
    matches!(k, Kind::BFloat16 | Kind::Float)
}

/// Whether tables `cos`/`sin` `[.., 1, d]` fit `x`'s sizes `xs` `[.., heads,
/// d]` as the fused functions take them: their leading dimensions the
/// trailing ones of `x`'s (`[S, 1, d]` against `[n, S, heads, d]`).
fn tables_fit(xs: &[i64], cos: &Tensor, sin: &Tensor) -> bool {
    let cs = cos.size();
    let d = xs.last().copied();
    xs.len() >= 2
        && cs.len() >= 2
        && cs.len() <= xs.len()
        && cs.last().copied() == d
        && cs[cs.len() - 2] == 1
        && cs[..cs.len() - 2] == xs[xs.len() - cs.len()..xs.len() - 2]
        && sin.size() == cs
}

/// [`apply_rope`] of `x` `[.., heads, d]` with tables `cos`/`sin` `[.., 1,
/// d]` whose leading dimensions are the trailing ones of `x`'s (`[S, 1, d]`
/// against `[n, S, heads, d]`: one table for every sequence), as the fused
/// autograd function on a GPU.
pub fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Tensor {
    let xs = x.size();
    let d = *xs.last().expect("rope input has a head dimension");
    let fits = tables_fit(&xs, cos, sin);
    let on_gpu = x.device().is_cuda() && crate::fused_cuda::enabled();
    // The function gives the tables no gradient: a learned table takes the ops.
    let tables_frozen = !cos.requires_grad() && !sin.requires_grad();
    let kinds = fused_kind(x.kind()) && cos.kind() == x.kind() && sin.kind() == x.kind();
    if !on_gpu || !fits || !kinds || !tables_frozen || cos.device() != x.device() || sin.device() != x.device() {
        return apply_rope(x, cos, sin);
    }
    if !x.is_contiguous() || !cos.is_contiguous() || !sin.is_contiguous() || d % 2 != 0 {
        return apply_rope(x, cos, sin);
    }
    register();
    let heads = xs[xs.len() - 2];
    let (flat, table) = (x.view([-1, heads, d]), [-1, d]);
    let (c, s) = (cos.view(table), sin.view(table));
    // SAFETY: the three are live tensors borrowed for the call; the shim
    // keeps its own references.
    let out = call_shim(|err, len| unsafe { dflash_fused_rope(raw(&flat), raw(&c), raw(&s), err, len) });
    out.view(xs.as_slice())
}

/// `rope(norm(x), cos, sin)` for `x` `[.., heads, d]` and the tables as
/// [`rope`] takes them, with `norm` the per-head RMS norm (weight `[d]`):
/// on a GPU one fused autograd function (64, 128 or 256 per head; the
/// weight of x's kind), else the two as they are.
pub fn norm_rope(x: &Tensor, norm: &RmsNorm, cos: &Tensor, sin: &Tensor) -> Tensor {
    let (xs, w) = (x.size(), &norm.weight);
    let d = *xs.last().expect("norm + rope input has a head dimension");
    let fused = x.device().is_cuda()
        && crate::fused_cuda::enabled()
        && xs.len() >= 2
        && [64, 128, 256].contains(&d)
        && tables_fit(&xs, cos, sin)
        && fused_kind(x.kind())
        && [w.kind(), cos.kind(), sin.kind()].iter().all(|&k| k == x.kind())
        && w.size() == [d]
        && [w.device(), cos.device(), sin.device()].iter().all(|&dv| dv == x.device())
        && !cos.requires_grad()
        && !sin.requires_grad()
        && x.is_contiguous()
        && w.is_contiguous()
        && cos.is_contiguous()
        && sin.is_contiguous();
    if !fused {
        return rope(&norm.forward(x), cos, sin);
    }
    register();
    let heads = xs[xs.len() - 2];
    let (flat, table) = (x.view([-1, heads, d]), [-1, d]);
    let (c, s) = (cos.view(table), sin.view(table));
    // SAFETY: the four are live tensors borrowed for the call; the shim
    // keeps its own references.
    let out = call_shim(|err, len| unsafe {
        dflash_fused_norm_rope(raw(&flat), raw(w), raw(&c), raw(&s), norm.eps, err, len)
    });
    out.view(xs.as_slice())
}

/// `silu(gate) * up`, as the fused autograd function on a GPU.
pub fn swiglu(gate: &Tensor, up: &Tensor) -> Tensor {
    let fused = gate.device().is_cuda()
        && crate::fused_cuda::enabled()
        && fused_kind(gate.kind())
        && up.kind() == gate.kind()
        && up.size() == gate.size()
        && gate.is_contiguous()
        && up.is_contiguous();
    if !fused {
        return gate.silu() * up;
    }
    register();
    // SAFETY: both are live tensors borrowed for the call; the shim keeps
    // its own references.
    call_shim(|err, len| unsafe { dflash_fused_swiglu(raw(gate), raw(up), err, len) })
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Device;

    /// The largest difference of `a` from `b`, relative to `b`'s largest magnitude.
    fn rel(a: &Tensor, b: &Tensor) -> f64 {
        let (a, b) = (a.to_kind(Kind::Double), b.to_kind(Kind::Double));
        (a - &b).abs().max().double_value(&[]) / b.abs().max().double_value(&[]).max(1e-30)
    }

    /// The shim's autograd functions on the CPU (their libtorch form: the
    /// launcher declines what is not CUDA) against the ops they replace, in
    /// f64: outputs and the gradients of every input, with a table shared
    /// by the sequences of a batch (`[S, 1, d]`) and one per row.
    #[test]
    fn the_fused_layers_autograd_functions_match_the_ops_they_replace() {
        tch::manual_seed(11);
        let opts = (Kind::Double, Device::Cpu);
        let (n, s, heads, d) = (3, 5, 4, 16);
        for table in [vec![s, 1, d], vec![n, s, 1, d]] {
            let x = Tensor::randn([n, s, heads, d], opts).set_requires_grad(true);
            let (cos, sin) = (Tensor::randn(table.as_slice(), opts), Tensor::randn(table.as_slice(), opts));
            let dy = Tensor::randn([n, s, heads, d], opts);
            let want = apply_rope(&x, &cos, &sin);
            let want_dx = Tensor::run_backward(&[(&want * &dy).sum(Kind::Double)], &[&x], false, false);
            let t = [-1, d];
            let flat = x.view([-1, heads, d]);
            // SAFETY: live tensors borrowed for the call.
            let got = call_shim(|err, len| unsafe {
                dflash_fused_rope(raw(&flat), raw(&cos.view(t)), raw(&sin.view(t)), err, len)
            })
            .view([n, s, heads, d]);
            let got_dx = Tensor::run_backward(&[(&got * &dy).sum(Kind::Double)], &[&x], false, false);
            assert!(got.allclose(&want, 1e-12, 1e-12, false), "RoPE output, table {table:?}");
            assert!(got_dx[0].allclose(&want_dx[0], 1e-12, 1e-12, false), "RoPE gradient, table {table:?}");
        }
        let gate = Tensor::randn([7, 24], opts).set_requires_grad(true);
        let up = Tensor::randn([7, 24], opts).set_requires_grad(true);
        let dy = Tensor::randn([7, 24], opts);
        let want = gate.silu() * &up;
        let want_g = Tensor::run_backward(&[(&want * &dy).sum(Kind::Double)], &[&gate, &up], false, false);
        // SAFETY: live tensors borrowed for the call.
        let got = call_shim(|err, len| unsafe { dflash_fused_swiglu(raw(&gate), raw(&up), err, len) });
        let got_g = Tensor::run_backward(&[(&got * &dy).sum(Kind::Double)], &[&gate, &up], false, false);
        assert!(got.allclose(&want, 1e-12, 1e-12, false), "SwiGLU output");
        for (name, (g, w)) in ["gate", "up"].iter().zip(got_g.iter().zip(&want_g)) {
            assert!(g.allclose(w, 1e-12, 1e-12, false), "SwiGLU gradient of {name}");
        }
        // The shim refuses shapes that do not fit, by name.
        let bad = Tensor::randn([6, 16], opts);
        // SAFETY: live tensors borrowed for the call.
        let refused = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            call_shim(|err, len| unsafe { dflash_fused_rope(raw(&bad), raw(&bad), raw(&bad), err, len) })
        }));
        assert!(refused.is_err(), "a 2-D input is refused");
    }

    /// The norm + RoPE function on the CPU (the launcher declines: the ops,
    /// and a backward through them recomputed) against the two functions
    /// it fuses, in f64: output and the gradients of x and the weight.
    #[test]
    fn the_norm_rope_function_matches_the_norm_then_rope() {
        tch::manual_seed(13);
        let opts = (Kind::Double, Device::Cpu);
        let (n, s, heads, d) = (2, 5, 3, 16);
        let x = Tensor::randn([n, s, heads, d], opts).set_requires_grad(true);
        let norm = RmsNorm { weight: (Tensor::randn([d], opts) * 0.3 + 1.0).set_requires_grad(true), eps: 1e-6 };
        let (cos, sin) = (Tensor::randn([s, 1, d], opts), Tensor::randn([s, 1, d], opts));
        let dy = Tensor::randn([n, s, heads, d], opts);
        let want = apply_rope(&norm.forward(&x), &cos, &sin);
        let want_g = Tensor::run_backward(&[(&want * &dy).sum(Kind::Double)], &[&x, &norm.weight], false, false);
        let (flat, t) = (x.view([-1, heads, d]), [-1, d]);
        // SAFETY: live tensors borrowed for the call.
        let got = call_shim(|err, len| unsafe {
            dflash_fused_norm_rope(raw(&flat), raw(&norm.weight), raw(&cos.view(t)), raw(&sin.view(t)), 1e-6, err, len)
        })
        .view([n, s, heads, d]);
        let got_g = Tensor::run_backward(&[(&got * &dy).sum(Kind::Double)], &[&x, &norm.weight], false, false);
        assert!(got.allclose(&want, 1e-12, 1e-12, false), "output");
        for (name, (g, w)) in ["x", "weight"].iter().zip(got_g.iter().zip(&want_g)) {
            assert!(g.allclose(w, 1e-10, 1e-10, false), "gradient of {name}");
        }
        // A weight of another size is refused by name.
        let short = Tensor::ones([d - 2], opts);
        let refused = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            // SAFETY: live tensors borrowed for the call.
            call_shim(|err, len| unsafe {
                dflash_fused_norm_rope(raw(&flat), raw(&short), raw(&cos.view(t)), raw(&sin.view(t)), 1e-6, err, len)
            })
        }));
        assert!(refused.is_err(), "a weight of {} for heads of {d} is refused", d - 2);
    }

    /// On a GPU the norm + RoPE kernels (launched) give the two ops'
    /// output and gradients (x's and the weight's, summed over more head
    /// vectors than the backward has warps, so its grid stride runs) for
    /// each head size they take: f32 within 1e-5 of the f64 ops, bf16
    /// within its rounding; NaN in a head stays in that head.
    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn the_norm_rope_kernels_match_the_ops_on_a_gpu() {
        let dev = crate::cuda::tch_device(Some(0)).expect("a CUDA device");
        tch::manual_seed(14);
        for (kind, tol) in [(Kind::Float, 1e-5), (Kind::BFloat16, 2e-2)] {
            for (n, s, heads, d) in [(2, 2100, 8, 128), (1, 700, 4, 64), (3, 300, 2, 256)] {
                let x64 = Tensor::randn([n, s, heads, d], (Kind::Double, dev)) * 3.0;
                let w64 = Tensor::randn([d], (Kind::Double, dev)) * 0.3 + 1.0;
                let angle = Tensor::randn([s, 1, d], (Kind::Double, dev));
                let dy = Tensor::randn([n, s, heads, d], (Kind::Double, dev));
                let x = x64.to_kind(kind).set_requires_grad(true);
                let norm = RmsNorm { weight: w64.to_kind(kind).set_requires_grad(true), eps: 1e-6 };
                let (cos, sin) = (angle.cos().to_kind(kind), angle.sin().to_kind(kind));
                // The reference: the ops in f64 on the same (rounded) inputs.
                let xr = x.to_kind(Kind::Double).detach().set_requires_grad(true);
                let wr = norm.weight.to_kind(Kind::Double).detach().set_requires_grad(true);
                let r = RmsNorm { weight: wr.shallow_clone(), eps: 1e-6 };
                let want = apply_rope(&r.forward(&xr), &cos.to_kind(Kind::Double), &sin.to_kind(Kind::Double));
                let want_g = Tensor::run_backward(&[(&want * &dy).sum(Kind::Double)], &[&xr, &wr], false, false);
                let before = LAUNCHES.load(Ordering::Relaxed);
                let got = norm_rope(&x, &norm, &cos, &sin);
                let got_g = Tensor::run_backward(
                    &[(got.to_kind(Kind::Double) * &dy).sum(Kind::Double)],
                    &[&x, &norm.weight],
                    false,
                    false,
                );
                let shape = [n, s, heads, d];
                assert!(LAUNCHES.load(Ordering::Relaxed) - before >= 2, "{kind:?} {shape:?}: both kernels");
                assert!(rel(&got, &want) < tol, "{kind:?} {shape:?} output: {}", rel(&got, &want));
                for (name, (g, w)) in ["x", "weight"].iter().zip(got_g.iter().zip(&want_g)) {
                    assert!(rel(g, w) < tol, "{kind:?} {shape:?} gradient of {name}: {}", rel(g, w));
                }
            }
            let x = Tensor::randn([4, 3, 128], (kind, dev));
            let _ = x.get(2).get(1).get(7).fill_(f64::NAN);
            let norm = RmsNorm { weight: Tensor::ones([128], (kind, dev)), eps: 1e-6 };
            let (cos, sin) = (Tensor::ones([4, 1, 128], (kind, dev)), Tensor::zeros([4, 1, 128], (kind, dev)));
            let y = norm_rope(&x, &norm, &cos, &sin);
            let nan = y.isnan().to_kind(Kind::Int64).sum_dim_intlist(-1, false, Kind::Int64);
            assert_eq!(nan.int64_value(&[2, 1]), 128, "{kind:?}: the NaN head is NaN");
            assert_eq!(nan.sum(Kind::Int64).int64_value(&[]), 128, "{kind:?}: the other heads are not");
        }
    }

    /// On a GPU the kernels (launched: the counter moves) give the ops'
    /// outputs and gradients: f32 within 1e-5 of the f64 ops, bf16 within
    /// bf16's rounding of them; partial rotary tables and `[S, 1, d]` tables
    /// of the context as the drafter passes them; NaN stays NaN.
    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn the_fused_layer_kernels_match_the_ops_on_a_gpu() {
        let dev = crate::cuda::tch_device(Some(0)).expect("a CUDA device");
        tch::manual_seed(12);
        for (kind, tol) in [(Kind::Float, 1e-5), (Kind::BFloat16, 1e-2)] {
            let (n, s, heads, d) = (2, 300, 8, 128);
            for table in [vec![s, 1, d], vec![n, s, 1, d]] {
                let x64 = Tensor::randn([n, s, heads, d], (Kind::Double, dev));
                let cos64 = Tensor::randn(table.as_slice(), (Kind::Double, dev));
                let sin64 = Tensor::randn(table.as_slice(), (Kind::Double, dev));
                let dy = Tensor::randn([n, s, heads, d], (Kind::Double, dev));
                let x = x64.to_kind(kind).set_requires_grad(true);
                let (cos, sin) = (cos64.to_kind(kind), sin64.to_kind(kind));
                // The reference: the ops in f64 on the same (rounded) inputs.
                let xr = x.to_kind(Kind::Double).detach().set_requires_grad(true);
                let want = apply_rope(&xr, &cos.to_kind(Kind::Double), &sin.to_kind(Kind::Double));
                let want_dx = Tensor::run_backward(&[(&want * &dy).sum(Kind::Double)], &[&xr], false, false);
                let before = LAUNCHES.load(Ordering::Relaxed);
                let got = rope(&x, &cos, &sin);
                let got_dx =
                    Tensor::run_backward(&[(got.to_kind(Kind::Double) * &dy).sum(Kind::Double)], &[&x], false, false);
                // At least (other tests of the process may launch too).
                assert!(LAUNCHES.load(Ordering::Relaxed) - before >= 2, "{kind:?}: forward and backward kernels");
                assert!(rel(&got, &want) < tol, "{kind:?} RoPE output {table:?}: {}", rel(&got, &want));
                assert!(rel(&got_dx[0], &want_dx[0]) < tol, "{kind:?} RoPE gradient {table:?}");
            }
            // Partial rotary tables go to the ops.
            let x = Tensor::randn([4, 2, 64], (kind, dev));
            let (c, s) = (Tensor::randn([4, 1, 32], (kind, dev)), Tensor::randn([4, 1, 32], (kind, dev)));
            let before = LAUNCHES.load(Ordering::Relaxed);
            assert!(rope(&x, &c, &s).equal(&apply_rope(&x, &c, &s)));
            assert_eq!(LAUNCHES.load(Ordering::Relaxed), before, "partial rotary: the ops");

            let g64 = Tensor::randn([333, 512], (Kind::Double, dev)) * 4.0;
            let u64 = Tensor::randn([333, 512], (Kind::Double, dev));
            let dy = Tensor::randn([333, 512], (Kind::Double, dev));
            let (gate, up) = (g64.to_kind(kind).set_requires_grad(true), u64.to_kind(kind).set_requires_grad(true));
            let (gr, ur) = (
                gate.to_kind(Kind::Double).detach().set_requires_grad(true),
                up.to_kind(Kind::Double).detach().set_requires_grad(true),
            );
            let want = gr.silu() * &ur;
            let want_g = Tensor::run_backward(&[(&want * &dy).sum(Kind::Double)], &[&gr, &ur], false, false);
            let before = LAUNCHES.load(Ordering::Relaxed);
            let got = swiglu(&gate, &up);
            let got_g = Tensor::run_backward(
                &[(got.to_kind(Kind::Double) * &dy).sum(Kind::Double)],
                &[&gate, &up],
                false,
                false,
            );
            assert!(LAUNCHES.load(Ordering::Relaxed) - before >= 2, "{kind:?}: SwiGLU kernels");
            assert!(rel(&got, &want) < tol, "{kind:?} SwiGLU output: {}", rel(&got, &want));
            for (name, (g, w)) in ["gate", "up"].iter().zip(got_g.iter().zip(&want_g)) {
                assert!(rel(g, w) < tol, "{kind:?} SwiGLU gradient of {name}: {}", rel(g, w));
            }
            // NaN in, NaN out.
            let nan = Tensor::full([8, 64], f64::NAN, (kind, dev));
            assert!(bool::try_from(swiglu(&nan, &nan).isnan().all()).unwrap(), "{kind:?}: NaN kept");
        }
    }
}
