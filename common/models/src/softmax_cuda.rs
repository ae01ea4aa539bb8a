//! The loss's softmax over a chunk of logits on a GPU
//! (`csrc/softmax_rows.cu`): one kernel per chunk that writes each row's
//! softmax over the logits and returns the row's argmax and the f32 sum of
//! the probabilities as written, in place of the argmax, softmax and sum
//! that [`crate::objective`] otherwise runs (four passes over rows x vocab
//! where the kernel makes two reads, the second mostly from shared memory,
//! and one write).
//!
//! [`softmax_in_place`] takes the logits (it overwrites them) and hands
//! them back untouched where the kernel does not apply (not
//! a CUDA tensor, a kind other than bf16/f32, not a contiguous 2-D tensor, a
//! row not 16-byte aligned or not whole vectors, a tensor that needs
//! gradients, the kernel unavailable or turned off by
//! `DFLASH_FUSED_OPS=off`); the caller then runs the ops.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use cudarc::driver::sys::{CUdevice_attribute, CUfunction_attribute};
use cudarc::driver::{CudaContext, CudaFunction, LaunchConfig, PushKernelArg};
use tch::{Device, Kind, Tensor};

const SOURCE: &str = concat!(
    include_str!("../csrc/vec_kind.cuh"),
    include_str!("../csrc/order_key.cuh"),
    include_str!("../csrc/softmax_rows.cu")
);
/// A block shape the kernel is compiled in (`SHAPE` in the kernel): threads
/// per block, and blocks resident per SM, for which the row cache is sized.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Shape {
    threads: u32,
    blocks_per_sm: i64,
}

const SHAPES: [Shape; 3] = [
    Shape { threads: 1024, blocks_per_sm: 1 },
    Shape { threads: 512, blocks_per_sm: 2 },
    Shape { threads: 256, blocks_per_sm: 4 },
];
/// The shape the objective's chunks take (timing test: `the_gpu_softmax_timings`).
const DEFAULT_SHAPE: Shape = SHAPES[0];
/// Shared memory a block keeps for its own reduction slots (the kernel's
/// static arrays, at most 640 bytes) and the 1 KiB the hardware reserves per
/// block, out of its share of the SM's.
const BLOCK_SHARED: i64 = 2048;

/// Kernels launched so far in this process: how a test tells the kernel
/// from the ops it replaces.
pub static LAUNCHES: AtomicU64 = AtomicU64::new(0);

struct Kernel {
    ctx: Arc<CudaContext>,
    /// Per shape of [`SHAPES`]: the function and the bytes of row cache a
    /// block may take (its share of the SM's shared memory, within the
    /// device's per-block limit).
    shapes: Vec<(CudaFunction, i64)>,
}

fn kernel(ordinal: usize, bf16: bool) -> Option<Arc<Kernel>> {
    static COMPILED: crate::nvrtc::Compiled<Kernel> = crate::nvrtc::Compiled::new();
    COMPILED.get(ordinal, bf16, "loss softmax kernel", || {
        let defines = [format!("-DIN_BF16={}", i32::from(bf16))];
        let (ctx, m) = crate::nvrtc::compile(ordinal, SOURCE, "softmax_rows.cu", &defines)?;
        let attribute = |a, what: &str| ctx.attribute(a).map(i64::from).map_err(|e| format!("{what}: {e:?}"));
        let per_block = attribute(
            CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
            "shared memory limit",
        )?;
        let per_sm = attribute(
            CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR,
            "shared memory per SM",
        )?;
        let mut shapes = Vec::new();
        for shape in SHAPES {
            let name = format!("softmax_rows_{}", shape.threads);
            let f = m.load_function(&name).map_err(|e| format!("kernel {name}: {e:?}"))?;
            let limit = (per_sm / shape.blocks_per_sm - BLOCK_SHARED).min(per_block - BLOCK_SHARED).max(0) / 16 * 16;
            f.set_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, limit as i32)
                .map_err(|e| format!("shared memory attribute of {name}: {e:?}"))?;
            shapes.push((f, limit));
        }
        Ok(Kernel { ctx, shapes })
    })
}

/// What the kernel leaves: the probabilities (the logits' own storage,
/// overwritten), each row's argmax (int64, as `argmax` gives it: a NaN
/// first, then the lowest position of the maximum) and the f32 sum of its
/// probabilities as written.
pub struct SoftmaxRows {
    pub probs: Tensor,
    pub argmax: Tensor,
    pub sums: Tensor,
}

/// Each row's softmax of `logits` `[rows, V]` written over it (in its
/// kind; f32 math, one rounding), with the rows' argmax and sums; or the
/// logits back, untouched, where the kernel does not apply. Taken by value:
/// the storage is overwritten, so no other tensor may still read it (the
/// caller's are fresh outputs of the LM head).
pub fn softmax_in_place(logits: Tensor) -> Result<SoftmaxRows, Tensor> {
    softmax_with(logits, DEFAULT_SHAPE, None)
}

/// [`softmax_in_place`] in blocks of `shape` with at most `cache_bytes` of
/// each row kept in shared memory between the two reads (None: as much as
/// the shape's share of an SM allows); the timing test compares the choices.
fn softmax_with(logits: Tensor, shape: Shape, cache_bytes: Option<i64>) -> Result<SoftmaxRows, Tensor> {
    let Device::Cuda(ordinal) = logits.device() else { return Err(logits) };
    let (bf16, elem) = match logits.kind() {
        Kind::BFloat16 => (true, 2),
        Kind::Float => (false, 4),
        _ => return Err(logits),
    };
    let &[rows, v] = logits.size().as_slice() else { return Err(logits) };
    let vec = 16 / elem;
    let sized = v > 0 && v % vec == 0 && v <= i64::from(i32::MAX) && (1..=i64::from(i32::MAX)).contains(&rows);
    let aligned = (logits.data_ptr() as usize).is_multiple_of(16);
    if !crate::fused_cuda::enabled() || !sized || logits.requires_grad() || !logits.is_contiguous() || !aligned {
        return Err(logits);
    }
    let Some(kern) = kernel(ordinal, bf16) else { return Err(logits) };
    let at = SHAPES.iter().position(|s| *s == shape).expect("one of SHAPES");
    let (function, limit) = &kern.shapes[at];
    let cache = cache_bytes.unwrap_or(*limit).clamp(0, *limit).min(v * elem) / 16 * 16;
    let argmax = Tensor::empty([rows], (Kind::Int64, logits.device()));
    let sums = Tensor::empty([rows], (Kind::Float, logits.device()));
    let (pl, pa, ps) = (logits.data_ptr() as u64, argmax.data_ptr() as u64, sums.data_ptr() as u64);
    let (vi, cache_vecs) = (v as i32, (cache / 16) as i32);
    let cfg = LaunchConfig {
        grid_dim: (rows as u32, 1, 1),
        block_dim: (shape.threads, 1, 1),
        shared_mem_bytes: cache as u32,
    };
    // SAFETY: `logits` is a contiguous [rows, V] CUDA tensor of the compiled
    // kind, 16-byte aligned, V whole vectors (checked), owned here and
    // written in place by this one kernel; `argmax` and `sums` are fresh [rows] int64 and f32;
    // the cache is within the opted-in shared memory; libtorch's stream (the
    // default one) orders their lifetimes.
    let launched = unsafe {
        kern.ctx
            .default_stream()
            .launch_builder(function)
            .arg(&pl)
            .arg(&vi)
            .arg(&cache_vecs)
            .arg(&pa)
            .arg(&ps)
            .launch(cfg)
    };
    // A launch that fails leaves the device in error; libtorch's next op
    // would fail less clearly.
    launched.unwrap_or_else(|e| panic!("loss softmax: launching the CUDA kernel failed: {e:?}"));
    LAUNCHES.fetch_add(1, Ordering::Relaxed);
    Ok(SoftmaxRows { probs: logits, argmax, sums })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn applied(r: Result<SoftmaxRows, Tensor>) -> SoftmaxRows {
        r.unwrap_or_else(|_| panic!("the kernel declined"))
    }

    /// Largest |a - b| / (|b| + floor) over the entries, NaN where exactly one
    /// of them is NaN.
    fn worst(a: &Tensor, b: &Tensor, floor: f64) -> f64 {
        let (a, b) = (a.to_kind(Kind::Double), b.to_kind(Kind::Double));
        let nan_mismatch = a.isnan().logical_xor(&b.isnan());
        if bool::try_from(nan_mismatch.any()).unwrap() {
            return f64::NAN;
        }
        let d = ((&a - &b).abs() / (b.abs() + floor)).nan_to_num(0.0, None, None);
        d.max().double_value(&[])
    }

    /// The kernel gives softmax's probabilities (f32 within 1e-5 relative,
    /// bf16 within one rounding), argmax's positions exactly (ties to the
    /// lowest, NaN first) and the sum of its own probabilities (1e-5
    /// relative), with and without the shared-memory cache; on Qwen's and
    /// SmolLM2's vocabularies and a small one; on random logits, logits of
    /// few values (ties), and rows with NaN (early, and only past the
    /// cache), +inf, some -inf, all -inf and a maximum of zero signed both
    /// ways; in every block shape. It hands back, untouched, what it does
    /// not take.
    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn the_gpu_softmax_matches_the_ops() {
        let dev = crate::cuda::tch_device(Some(0)).expect("a CUDA device");
        tch::manual_seed(11);
        for kind in [Kind::BFloat16, Kind::Float] {
            for v in [151_936, 49_152, 8 * 37] {
                let random = (Tensor::randn([203, v], (Kind::Float, dev)) * 4.0).to_kind(kind);
                let tied = (random.to_kind(Kind::Float) * 0.5).round().to_kind(kind);
                let special = random.copy();
                let _ = special.get(0).narrow(0, 7, 1).fill_(f64::NAN);
                let _ = special.get(0).narrow(0, v - 3, 1).fill_(f64::NAN);
                let _ = special.get(1).fill_(f64::NEG_INFINITY);
                let _ = special.get(2).narrow(0, 40, 5).fill_(f64::INFINITY);
                let _ = special.get(3).narrow(0, 0, v / 2).fill_(f64::NEG_INFINITY);
                let _ = special.get(4).narrow(0, v - 9, 9).fill_(f64::NEG_INFINITY);
                // A maximum of zero held as -0 first, +0 later: argmax takes -0's.
                let _ = special.get(5).fill_(-1.0);
                let _ = special.get(5).narrow(0, 5, 1).fill_(-0.0);
                let _ = special.get(5).narrow(0, 9, 1).fill_(0.0);
                // One NaN, past the part of the row the cache holds.
                let _ = special.get(6).narrow(0, v - 3, 1).fill_(f64::NAN);
                for (name, logits) in [("random", &random), ("tied", &tied), ("special", &special)] {
                    let want_probs = logits.softmax(-1, kind);
                    let want_argmax = logits.argmax(-1, false);
                    for (shape, cache) in SHAPES.iter().flat_map(|s| [(s, Some(0)), (s, Some(4096)), (s, None)]) {
                        let at = format!("{kind:?} V {v} {name} {shape:?} cache {cache:?}");
                        let before = LAUNCHES.load(Ordering::Relaxed);
                        let got = applied(softmax_with(logits.copy(), *shape, cache));
                        assert!(LAUNCHES.load(Ordering::Relaxed) > before);
                        assert!(got.argmax.equal(&want_argmax), "{at}: argmax");
                        let tol = if kind == Kind::Float { 1e-5 } else { 1.0 / 128.0 };
                        let e = worst(&got.probs, &want_probs, 1e-30);
                        assert!(e <= tol, "{at}: probabilities off by {e}");
                        let own = got.probs.sum_dim_intlist(-1, false, Kind::Float);
                        let e = worst(&got.sums, &own, 1e-30);
                        assert!(e <= 1e-5, "{at}: sums off by {e}");
                    }
                }
                // Special rows: NaN wherever softmax gives NaN, zero at -inf.
                let got = applied(softmax_in_place(special.copy()));
                for r in [0, 1, 2, 6] {
                    assert!(bool::try_from(got.probs.get(r).isnan().all()).unwrap(), "{kind:?} V {v}: row {r} NaN");
                }
                assert!(bool::try_from(got.probs.get(4).narrow(0, v - 9, 9).eq(0.0).all()).unwrap());
            }
        }
        // Declined, and handed back untouched: gradients, rows not whole
        // vectors (bf16 takes 8 a vector, f32 4), a row not 16-byte aligned,
        // not contiguous, not 2-D, f16, the CPU.
        let declined = |t: Tensor| {
            let before = t.copy();
            softmax_in_place(t).err().is_some_and(|back| back.equal(&before))
        };
        let base = Tensor::randn([4, 151_936], (Kind::Float, dev));
        assert!(declined(base.copy().set_requires_grad(true)));
        assert!(declined(Tensor::randn([4, 151_935], (Kind::Float, dev))));
        assert!(declined(Tensor::randn([4, 151_932], (Kind::BFloat16, dev))));
        assert!(softmax_in_place(Tensor::randn([4, 151_932], (Kind::Float, dev))).is_ok());
        let flat = Tensor::randn([4 * 151_936 + 8], (Kind::BFloat16, dev));
        assert!(declined(flat.narrow(0, 1, 4 * 151_936).view([4, 151_936])));
        assert!(declined(base.narrow(1, 4, 1000)));
        assert!(declined(base.view([2, 2, 151_936])));
        assert!(declined(base.to_kind(Kind::Half)));
        assert!(declined(base.to_device(Device::Cpu)));
    }

    /// Information, not a goal: the kernel in each block shape, with and
    /// without the row cache, against the ops it replaces (argmax, softmax, sum) on one loss chunk of the
    /// Qwen3-8B-shape step (3,840 rows of 151,936), printed.
    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn the_gpu_softmax_timings() {
        let dev = crate::cuda::tch_device(Some(0)).expect("a CUDA device");
        let logits = Tensor::randn([3840, 151_936], (Kind::BFloat16, dev));
        let time = |f: &dyn Fn()| {
            f();
            tch::Cuda::synchronize(0);
            let start = std::time::Instant::now();
            for _ in 0..20 {
                f();
            }
            tch::Cuda::synchronize(0);
            start.elapsed().as_secs_f64() * 1e3 / 20.0
        };
        let ops = time(&|| {
            let a = logits.argmax(-1, false);
            let p = logits.softmax(-1, Kind::BFloat16);
            let s = p.sum_dim_intlist(-1, false, Kind::Float);
            drop((a, p, s));
        });
        println!("loss softmax, 3840 x 151936 bf16: ops (argmax, softmax, sum) {ops:.3} ms");
        for shape in SHAPES {
            for cache in [Some(0), None] {
                let scratch = logits.copy();
                let ms = time(&|| drop(applied(softmax_with(scratch.shallow_clone(), shape, cache))));
                println!(
                    "loss softmax, 3840 x 151936 bf16: kernel, {} threads x {} blocks per SM, cache {}: {ms:.3} ms",
                    shape.threads,
                    shape.blocks_per_sm,
                    cache.map_or("as large as fits".into(), |c| format!("{c} bytes"))
                );
            }
        }
    }
}
