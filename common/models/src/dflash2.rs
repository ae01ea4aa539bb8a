//! DFlash2's two additions to the DFlash drafter, as the DFlash authors'
//! `DFlash2DraftModel` defines them (the `dflash` package):
//!
//! - [`BlockConv`]: a grouped dynamic causal convolution around every
//!   attention and MLP sublayer. Tap `t` of slot `j` reads slot `j - t` of
//!   the same block (zero padding before the block's first slot), weighted
//!   by a learned per-channel base kernel plus a per-group coefficient
//!   projected from the sublayer's normed input. It never crosses a block
//!   boundary, so training (many blocks side by side) and decoding (one
//!   block) see the same thing.
//! - [`CandidateSelector`]: each drafted slot keeps its top-k candidates by
//!   the LM head's logits `U`, and a walk from the anchor picks, slot by
//!   slot, the candidate `b` maximising `U(b) + <A(prev) * H(h), B(b)>`
//!   given the token `prev` picked before it.

use serde::{Deserialize, Serialize};
use tch::nn::{self, Init};
use tch::{Kind, Tensor};

use crate::layers::Linear;

/// DFlash2's shape (the `dflash_config` fields of its export).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Dflash2Config {
    pub conv_kernel_size: i64,
    pub conv_group_size: i64,
    pub selector_rank: i64,
    pub selector_top_k: i64,
}

/// One sublayer's in-block convolution (`layers.N.attention_conv` or
/// `layers.N.mlp_conv`). `base_kernel` is `[2, K, H]`: side 0 convolves the
/// sublayer's input, side 1 its output; `kernel_projection` gives both
/// sides' per-group corrections from the sublayer's input.
pub struct BlockConv {
    base_kernel: Tensor,
    kernel_projection: Linear,
    kernel_size: i64,
    group_size: i64,
}

impl BlockConv {
    /// Starts as the identity: tap 0 weighs 1, later taps 0, no dynamic
    /// correction (the peers' initialisation), so a fresh DFlash2 drafter
    /// computes what a DFlash one would.
    pub fn new(p: &nn::Path, hidden: i64, c: &Dflash2Config) -> Self {
        let (k, groups) = (c.conv_kernel_size, hidden / c.conv_group_size);
        let base_kernel = p.var("base_kernel", &[2, k, hidden], Init::Const(0.0));
        tch::no_grad(|| {
            let _ = base_kernel.narrow(1, 0, 1).fill_(1.0);
        });
        let weight = (p / "kernel_projection").var("weight", &[2 * k * groups, hidden], Init::Const(0.0));
        Self {
            base_kernel,
            kernel_projection: Linear { weight, bias: None },
            kernel_size: k,
            group_size: c.conv_group_size,
        }
    }

    /// Convolves the sublayer input `x` `[n, Q, H]` (blocks of `block_len`
    /// slots side by side) with side 0, and returns side 1's dynamic
    /// coefficients for [`BlockConv::finish`].
    pub fn prepare(&self, x: &Tensor, block_len: i64) -> (Tensor, Tensor) {
        let size = x.size();
        let groups = size[2] / self.group_size;
        let dynamic = self.kernel_projection.forward(x).view([size[0], size[1], 2, self.kernel_size, groups]);
        let out = self.convolve(x, &dynamic.select(2, 0), &self.base_kernel.get(0), block_len);
        (out, dynamic.select(2, 1))
    }

    /// Convolves the sublayer output with side 1.
    pub fn finish(&self, x: &Tensor, dynamic: &Tensor, block_len: i64) -> Tensor {
        self.convolve(x, dynamic, &self.base_kernel.get(1), block_len)
    }

    /// `sum_t (base[t] + dynamic[t]) * x[j - t]` within each block;
    /// `dynamic` is `[n, Q, K, groups]`, `base` `[K, H]`. One autograd
    /// function (`csrc/block_conv.cpp`) that keeps only `x`, `dynamic` and
    /// `base` for the backward: as libtorch ops, autograd kept a full-size
    /// kernel and a shifted copy of `x` per tap. On a GPU its two directions
    /// are one kernel each ([`crate::block_conv_cuda`]).
    fn convolve(&self, x: &Tensor, dynamic: &Tensor, base: &Tensor, block_len: i64) -> Tensor {
        if x.device().is_cuda() {
            crate::block_conv_cuda::register();
        }
        let base = base.to_kind(x.kind());
        let dynamic = dynamic.to_kind(x.kind());
        let raw = crate::nvrtc::raw;
        // SAFETY: the three pointers are live at::Tensors borrowed for the
        // call (the autograd function saves its own references); the shim
        // returns a new heap tensor or null and writes at most `len` bytes.
        crate::nvrtc::call_shim(|err, len| unsafe {
            dflash_block_conv(raw(x), raw(&dynamic), raw(&base), block_len, self.group_size, err, len)
        })
    }
}

unsafe extern "C" {
    /// csrc/block_conv.cpp: a new `at::Tensor*` or null with `err` filled.
    fn dflash_block_conv(
        x: *mut std::ffi::c_void,
        dynamic: *mut std::ffi::c_void,
        base: *mut std::ffi::c_void,
        block_len: i64,
        group_size: i64,
        err: *mut std::ffi::c_char,
        err_len: i32,
    ) -> *mut std::ffi::c_void;
}

/// The selector (`candidate_selector.*`): codebooks `A` (predecessor) and
/// `B` (successor) of `[vocab, rank]`, and `H` projecting a slot's hidden
/// state to the rank.
pub struct CandidateSelector {
    predecessor_codebook: Tensor,
    successor_codebook: Tensor,
    hidden_projection: Linear,
    pub top_k: i64,
}

impl CandidateSelector {
    /// `B` starts at zero, so a fresh selector walks the top-1 path of the
    /// logits (the peers' initialisation); `A` and `H` start as every other
    /// projection (normal, std 0.02).
    pub fn new(p: &nn::Path, hidden: i64, vocab: i64, c: &Dflash2Config) -> Self {
        let r = c.selector_rank;
        let predecessor_codebook = p.var("predecessor_codebook", &[vocab, r], Init::Randn { mean: 0.0, stdev: 0.02 });
        let successor_codebook = p.var("successor_codebook", &[vocab, r], Init::Const(0.0));
        let weight = (p / "hidden_projection").var("weight", &[r, hidden], Init::Randn { mean: 0.0, stdev: 0.02 });
        Self {
            predecessor_codebook,
            successor_codebook,
            hidden_projection: Linear { weight, bias: None },
            top_k: c.selector_top_k,
        }
    }

    /// Each slot's top-k candidates by logit: `(unary [.., k], ids [.., k])`,
    /// best first.
    pub fn candidates(&self, logits: &Tensor) -> (Tensor, Tensor) {
        top_k(logits, self.top_k)
    }

    /// Scores `[M, k]` of `candidates` `[M, k]` (with logits `unary`) for
    /// slots with hidden states `hidden` `[M, H]` whose predecessor tokens
    /// are `predecessors` `[M]`.
    pub fn scores(&self, hidden: &Tensor, unary: &Tensor, candidates: &Tensor, predecessors: &Tensor) -> Tensor {
        let (m, k) = (candidates.size()[0], candidates.size()[1]);
        let a = self.predecessor_codebook.index_select(0, predecessors) * self.hidden_projection.forward(hidden);
        let b = self.successor_codebook.index_select(0, &candidates.reshape([-1])).view([m, k, -1]);
        unary + b.matmul(&a.unsqueeze(-1)).squeeze_dim(-1).to_kind(unary.kind())
    }

    /// The greedy walk: for blocks with drafted-slot hidden states `hidden`
    /// `[N, B-1, H]`, their logits `[N, B-1, V]` and anchor tokens `[N]`,
    /// the proposed tokens `[N, B-1]`.
    pub fn walk(&self, hidden: &Tensor, logits: &Tensor, anchors: &Tensor) -> Tensor {
        let (unary, candidates) = self.candidates(logits);
        let mut previous = anchors.shallow_clone();
        let mut path = Vec::new();
        for j in 0..hidden.size()[1] {
            let cands = candidates.select(1, j);
            let s = self.scores(&hidden.select(1, j), &unary.select(1, j), &cands, &previous);
            previous = cands.gather(1, &s.argmax(-1, true), false).squeeze_dim(1);
            path.push(previous.shallow_clone());
        }
        Tensor::stack(&path, 1)
    }

    /// Kind of the codebooks (for callers building inputs).
    pub fn kind(&self) -> Kind {
        self.successor_codebook.kind()
    }
}

/// Vocabulary entries per chunk of [`top_k`]'s first stage (the GPU
/// kernel's too).
const TOP_K_CHUNK: i64 = crate::top_k_cuda::CHUNK;

/// The `k` largest entries of each row of `logits` `[.., V]` and their ids,
/// best first: `topk`'s values. Over a vocabulary, libtorch's `topk` is a
/// multi-pass radix select (16 kernels a call, 4.6 ms for 3,840 rows of
/// 151,936 on an H100); here one pass takes the maximum of each chunk of
/// 128 entries, `topk` picks the `k` best chunks, and a second `topk` runs
/// over their `128 k` entries only. Exact: a chunk that holds one of the k
/// largest has a maximum at least that large, and fewer than k other chunks
/// can beat it. Among equal logits the ids chosen may differ from `topk`'s.
/// Rows too short for chunks to pay go to `topk`. On a GPU the same
/// selection runs as one kernel that reads each row once
/// ([`crate::top_k_cuda`]). No gradient flows (the selector's candidates
/// are taken without one).
pub fn top_k(logits: &Tensor, k: i64) -> (Tensor, Tensor) {
    let size = logits.size();
    let v = *size.last().expect("logits have a vocabulary dimension");
    if v % TOP_K_CHUNK != 0 || v / TOP_K_CHUNK < 8 * k || logits.requires_grad() {
        return logits.topk(k, -1, true, true);
    }
    if let Some(found) = crate::top_k_cuda::top_k(logits, k) {
        return found;
    }
    let lead = &size[..size.len() - 1];
    let rows: i64 = lead.iter().product();
    let chunks = logits.reshape([rows, v / TOP_K_CHUNK, TOP_K_CHUNK]);
    let (_, best_chunks) = chunks.amax([-1i64].as_slice(), false).topk(k, -1, true, false); // [rows, k]
    let near = chunks.gather(1, &best_chunks.unsqueeze(-1).expand([rows, k, TOP_K_CHUNK], false), false);
    let (values, at) = near.reshape([rows, k * TOP_K_CHUNK]).topk(k, -1, true, true);
    let ids = best_chunks.gather(1, &at.divide_scalar_mode(TOP_K_CHUNK, "floor"), false) * TOP_K_CHUNK
        + at.remainder(TOP_K_CHUNK);
    let out: Vec<i64> = lead.iter().copied().chain([k]).collect();
    (values.view(out.as_slice()), ids.view(out.as_slice()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Device;

    fn config(k: i64) -> Dflash2Config {
        Dflash2Config { conv_kernel_size: k, conv_group_size: 2, selector_rank: 3, selector_top_k: 4 }
    }

    /// The convolution against a direct evaluation of its definition, with
    /// random kernels: within each block, slot j is sum_t (base[t][c] +
    /// dyn[j][t][c / gs]) * x[j - t][c], zero where j - t leaves the block.
    #[test]
    fn the_convolution_stays_inside_each_block_and_matches_its_definition() {
        tch::manual_seed(1);
        let vs = nn::VarStore::new(Device::Cpu);
        let mut conv = BlockConv::new(&vs.root(), 4, &config(2));
        conv.base_kernel = Tensor::randn([2, 2, 4], (Kind::Double, Device::Cpu));
        let (n, blocks, bl, h) = (2, 3, 4, 4);
        let x = Tensor::randn([n, blocks * bl, h], (Kind::Double, Device::Cpu));
        let dynamic = Tensor::randn([n, blocks * bl, 2, 2], (Kind::Double, Device::Cpu));
        let got = conv.finish(&x, &dynamic, bl);
        for s in 0..n {
            for q in 0..blocks * bl {
                for c in 0..h {
                    let mut want = 0.0;
                    for t in 0..2 {
                        if q % bl >= t {
                            let k = conv.base_kernel.double_value(&[1, t, c]) + dynamic.double_value(&[s, q, t, c / 2]);
                            want += k * x.double_value(&[s, q - t, c]);
                        }
                    }
                    let g = got.double_value(&[s, q, c]);
                    assert!((g - want).abs() < 1e-12, "slot {q} channel {c}: {g} vs {want}");
                }
            }
        }
    }

    /// The convolution as libtorch ops under autograd (the form before
    /// `csrc/block_conv.cpp`): the reference for the fused gradients.
    fn composite(x: &Tensor, dynamic: &Tensor, base: &Tensor, block_len: i64, gs: i64, k: i64) -> Tensor {
        let (n, q, h) = (x.size()[0], x.size()[1], x.size()[2]);
        let (groups, blocks) = (h / gs, q / block_len);
        let values = x.view([n, blocks, block_len, groups, gs]);
        let dynamic = dynamic.reshape([n, blocks, block_len, k, groups, 1]);
        let mut out = values.zeros_like();
        for t in 0..k.min(block_len) {
            let shifted = values.narrow(2, 0, block_len - t).constant_pad_nd([0, 0, 0, 0, t, 0]);
            out += (base.get(t).view([1, 1, 1, groups, gs]) + dynamic.select(3, t)) * shifted;
        }
        out.view([n, q, h])
    }

    /// The fused convolution's output and the gradients of its input,
    /// dynamic coefficients (a view of both sides', as `prepare` makes
    /// them) and base kernel equal autograd's through the composite form,
    /// for kernels shorter than, as long as and longer than a block.
    #[test]
    fn the_fused_convolution_has_the_gradients_of_its_composite_form() {
        let opts = (Kind::Double, Device::Cpu);
        for (k, bl) in [(1, 4), (2, 4), (3, 4), (4, 4), (6, 4), (4, 16)] {
            tch::manual_seed(k);
            let (n, blocks, gs, groups) = (2, 3, 2, 3);
            let h = gs * groups;
            let vs = nn::VarStore::new(Device::Cpu);
            let mut conv = BlockConv::new(&vs.root(), h, &Dflash2Config { conv_group_size: gs, ..config(k) });
            conv.base_kernel = Tensor::randn([2, k, h], opts).set_requires_grad(true);
            let x = Tensor::randn([n, blocks * bl, h], opts).set_requires_grad(true);
            let both = Tensor::randn([n, blocks * bl, 2, k, groups], opts).set_requires_grad(true);
            let weights = Tensor::randn([n, blocks * bl, h], opts);
            let fused = conv.finish(&x, &both.select(2, 1), bl);
            let want = composite(&x, &both.select(2, 1), &conv.base_kernel.get(1), bl, gs, k);
            assert!(fused.allclose(&want, 1e-12, 1e-12, false), "k {k}, block {bl}: outputs differ");
            let inputs = [&x, &both, &conv.base_kernel];
            let got = Tensor::run_backward(&[(&fused * &weights).sum(Kind::Double)], &inputs, false, false);
            let expect = Tensor::run_backward(&[(&want * &weights).sum(Kind::Double)], &inputs, false, false);
            for (name, (g, e)) in ["x", "dynamic", "base"].iter().zip(got.iter().zip(&expect)) {
                let diff = (g - e).abs().max().double_value(&[]);
                assert!(diff < 1e-12, "k {k}, block {bl}: the gradient of {name} is {diff} off");
            }
            // Without autograd: the same output.
            let plain = tch::no_grad(|| conv.finish(&x, &both.select(2, 1), bl));
            assert!(plain.allclose(&want, 1e-12, 1e-12, false), "k {k}, block {bl}: no_grad output differs");
        }
    }

    /// On a GPU both directions are the kernels of `block_conv_cuda` (they
    /// ran: the launch count grows), against the composite form in f64 on
    /// the CPU: f32 within 1e-5 and bf16 within 1e-2 (relative L2: it
    /// rounds inputs and outputs, not sums), the same bits when run again.
    /// Groups of 2 to 32 threads, of one and within one thread's vector;
    /// kernels of 1 to 8 taps, longer than a block too; channels past the
    /// last thread block's end; coefficients as `prepare`'s views and as
    /// rows the shim must copy dense. A group the kernels decline (12
    /// channels: neither whole vectors in a power of two nor within one)
    /// runs the libtorch passes, also within the tolerance, as do 256
    /// channels in f32 (64 vectors: more than a warp). A NaN in the input
    /// reaches the output and the coefficients' gradients.
    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn the_gpu_kernels_of_the_convolution_match_its_composite_form() {
        use std::sync::atomic::Ordering;
        crate::cuda::ensure_cuda(&[0]).unwrap();
        let gpu = Device::Cuda(0);
        let f64s = (Kind::Double, Device::Cpu);
        // 1,536 channels: whole groups of each size, two thread blocks of
        // vectors in bf16 (the second half-full), one and a half in f32.
        let (n, blocks, h) = (2, 9, 1536);
        let launches = || crate::block_conv_cuda::LAUNCHES.load(Ordering::Relaxed);
        let cases =
            [(16, 2, 16, false), (64, 4, 16, false), (256, 8, 16, false), (128, 3, 16, true), (2, 3, 16, false)];
        let cases = cases.into_iter().chain([(8, 1, 16, false), (4, 6, 4, false), (12, 2, 16, false)]);
        for (kind, tol) in [(Kind::Float, 1e-5), (Kind::BFloat16, 1e-2)] {
            for (gs, k, bl, transposed) in cases.clone() {
                // 256 channels are 64 f32 vectors: more than a warp.
                let kernels = gs != 12 && !(kind == Kind::Float && gs == 256);
                tch::manual_seed(gs * 10 + k);
                let groups = h / gs;
                let x = Tensor::randn([n, blocks * bl, h], f64s);
                let both = Tensor::randn([n, blocks * bl, 2, k, groups], f64s);
                let base = Tensor::randn([k, h], f64s);
                let weights = Tensor::randn([n, blocks * bl, h], f64s);
                // The reference: the composite form's output and gradients in f64.
                let leaves = [&x, &both, &base].map(|t| t.copy().set_requires_grad(true));
                let want = composite(&leaves[0], &leaves[1].select(2, 1), &leaves[2], bl, gs, k);
                let inputs = [&leaves[0], &leaves[1], &leaves[2]];
                let expect = Tensor::run_backward(&[(&want * &weights).sum(Kind::Double)], &inputs, false, false);
                let conv = |x: &Tensor, both: &Tensor| {
                    let leaves = [x, both, &base].map(|t| t.to_kind(kind).to_device(gpu).set_requires_grad(true));
                    let vs = nn::VarStore::new(gpu);
                    let conv = BlockConv::new(&vs.root(), h, &Dflash2Config { conv_group_size: gs, ..config(k) });
                    let side = leaves[1].select(2, 1);
                    // Rows whose [k, groups] are not dense: the shim copies them.
                    let side = if transposed { side.transpose(2, 3).contiguous().transpose(2, 3) } else { side };
                    let out = conv.convolve(&leaves[0], &side, &leaves[2], bl);
                    let w = weights.to_kind(kind).to_device(gpu);
                    let inputs = [&leaves[0], &leaves[1], &leaves[2]];
                    let grads = Tensor::run_backward(&[(&out * w).sum(Kind::Float)], &inputs, false, false);
                    let cpu = |t: &Tensor| t.to_kind(Kind::Double).to_device(Device::Cpu);
                    (cpu(&out), grads.iter().map(cpu).collect::<Vec<_>>())
                };
                let case = format!("{kind:?} gs {gs} k {k} block {bl}");
                let before = launches();
                let (out, grads) = conv(&x, &both);
                assert_eq!(launches() - before, if kernels { 2 } else { 0 }, "{case}: kernel launches");
                let rel = |a: &Tensor, b: &Tensor| (a - b).norm().double_value(&[]) / b.norm().double_value(&[]);
                assert!(rel(&out, &want) < tol, "{case}: output {}", rel(&out, &want));
                for (name, (g, e)) in ["x", "dynamic", "base"].iter().zip(grads.iter().zip(&expect)) {
                    assert!(rel(g, e) < tol, "{case}: the gradient of {name} is {} off", rel(g, e));
                }
                let (again, grads_again) = conv(&x, &both);
                assert!(again.equal(&out) && grads_again.iter().zip(&grads).all(|(a, b)| a.equal(b)), "{case}: repeat");
                // A NaN in the input reaches the output and the coefficients' gradients.
                let poisoned = x.copy();
                let _ = poisoned.get(0).get(0).get(0).fill_(f64::NAN);
                let (out, grads) = conv(&poisoned, &both);
                let has_nan = |t: &Tensor| bool::try_from(t.isnan().any()).unwrap();
                assert!(has_nan(&out) && has_nan(&grads[1]) && has_nan(&grads[2]), "{case}: a NaN was lost");
            }
        }
    }

    #[test]
    fn a_fresh_convolution_is_the_identity_and_a_fresh_selector_walks_the_top_logits() {
        tch::manual_seed(2);
        let vs = nn::VarStore::new(Device::Cpu);
        let c = config(2);
        let conv = BlockConv::new(&vs.root().sub("conv"), 4, &c);
        let x = Tensor::randn([1, 8, 4], (Kind::Float, Device::Cpu));
        let (y, dynamic) = conv.prepare(&x, 4);
        assert!(y.allclose(&x, 0.0, 0.0, false));
        assert!(conv.finish(&x, &dynamic, 4).allclose(&x, 0.0, 0.0, false));
        let selector = CandidateSelector::new(&vs.root().sub("sel"), 4, 10, &c);
        let logits = Tensor::randn([2, 3, 10], (Kind::Float, Device::Cpu));
        let path = selector.walk(
            &Tensor::randn([2, 3, 4], (Kind::Float, Device::Cpu)),
            &logits,
            &Tensor::from_slice(&[1i64, 2]),
        );
        assert_eq!(path, logits.argmax(-1, false));
    }

    /// The walk conditions each slot on the token picked before it: a
    /// transition score that favours the second candidate after token 7
    /// changes the pick only after 7.
    #[test]
    fn the_walk_follows_its_own_picks() {
        let vs = nn::VarStore::new(Device::Cpu);
        let mut s = CandidateSelector::new(
            &vs.root(),
            1,
            10,
            &Dflash2Config { selector_rank: 1, selector_top_k: 2, ..config(2) },
        );
        s.predecessor_codebook = Tensor::zeros([10, 1], (Kind::Float, Device::Cpu));
        let _ = s.predecessor_codebook.get(7).fill_(1.0);
        s.successor_codebook = Tensor::zeros([10, 1], (Kind::Float, Device::Cpu));
        let _ = s.successor_codebook.get(5).fill_(10.0);
        s.hidden_projection.weight = Tensor::ones([1, 1], (Kind::Float, Device::Cpu));
        // Slot 0 prefers 7 over 3; slot 1 prefers 4 over 5 by its logits.
        let logits = Tensor::zeros([1, 2, 10], (Kind::Float, Device::Cpu));
        let _ = logits.get(0).get(0).get(7).fill_(2.0);
        let _ = logits.get(0).get(0).get(3).fill_(1.0);
        let _ = logits.get(0).get(1).get(4).fill_(2.0);
        let _ = logits.get(0).get(1).get(5).fill_(1.0);
        let hidden = Tensor::ones([1, 2, 1], (Kind::Float, Device::Cpu));
        let path = s.walk(&hidden, &logits, &Tensor::from_slice(&[0i64]));
        assert_eq!(Vec::<i64>::try_from(path.view([-1])).unwrap(), [7, 5], "after 7, 5 scores 1 + 10 > 2");
        let _ = logits.get(0).get(0).get(3).fill_(3.0);
        let path = s.walk(&hidden, &logits, &Tensor::from_slice(&[0i64]));
        assert_eq!(Vec::<i64>::try_from(path.view([-1])).unwrap(), [3, 4], "after 3 the logits decide");
    }

    /// The two-stage top-k returns `topk`'s values exactly, each with the id
    /// of an entry holding it, all ids of a row distinct: on random logits,
    /// on logits rounded to bf16's few values (many ties), with the best
    /// entries packed in one chunk, and over extra leading dimensions.
    #[test]
    fn the_two_stage_top_k_returns_topks_values_with_their_ids() {
        tch::manual_seed(3);
        let v = TOP_K_CHUNK * 200;
        let random = Tensor::randn([37, v], (Kind::Float, tch::Device::Cpu));
        let tied = (&random * 4.0).round() / 4.0;
        let packed = random.copy();
        let _ = packed.narrow(1, 5 * TOP_K_CHUNK, TOP_K_CHUNK).g_add_scalar_(100.0);
        for (name, logits) in [("random", random.shallow_clone()), ("tied", tied), ("packed", packed)] {
            for k in [1, 5, 16] {
                let (want, _) = logits.topk(k, -1, true, true);
                let (got, ids) = top_k(&logits, k);
                assert_eq!(
                    Vec::<f32>::try_from(got.reshape([-1])).unwrap(),
                    Vec::<f32>::try_from(want.reshape([-1])).unwrap(),
                    "{name} k {k}"
                );
                let at = logits.gather(1, &ids, false);
                assert!(at.equal(&got), "{name} k {k}: the ids hold the values");
                let sorted = ids.sort(-1, false).0;
                let distinct = sorted.narrow(1, 1, k - 1).ne_tensor(&sorted.narrow(1, 0, k - 1)).all();
                assert!(k == 1 || bool::try_from(distinct).unwrap(), "{name} k {k}: distinct ids");
            }
        }
        let batched = random.view([37, 1, v]);
        let (got, ids) = top_k(&batched, 16);
        assert_eq!(got.size(), [37, 1, 16]);
        assert!(got.equal(&random.topk(16, -1, true, true).0.view([37, 1, 16])));
        assert!(batched.gather(2, &ids, false).equal(&got));
        // Short rows go to topk itself.
        let short = Tensor::randn([4, TOP_K_CHUNK * 8], (Kind::Float, tch::Device::Cpu));
        assert!(top_k(&short, 16).1.equal(&short.topk(16, -1, true, true).1));
    }
}
