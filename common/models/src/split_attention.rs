//! The drafter's block attention without a mask (CUDA): two variable-length
//! flash-attention calls merged by log-sum-exp, in `csrc/split_attention.cpp`.
//!
//! A query of block j sees the context before its anchor `a_j` and its own
//! block. Blocks are taken in groups of `chunk_blocks` (anchors are sorted);
//! `p` is the smallest anchor of a group. Part A: every query of the group
//! attends to context `[0, p)`. Part B: each block's queries attend to context
//! `[p, a_j)` followed by the block's own slots. Together they cover exactly
//! the keys the DFlash mask allows, so nothing masked is computed, where the
//! masked kernel computes every key of the context and of the chunk's blocks.
//! This file builds the index plan on the host; one test checks on the CPU
//! that the plan reproduces the masked attention, another (CUDA, ignored
//! elsewhere) checks the kernels' output and gradients against it.

use tch::{Device, Kind, Tensor};

use crate::ModelError;
use crate::blocks::BlockLayout;

unsafe extern "C" {
    /// csrc/split_attention.cpp: returns a new `at::Tensor*` or null with
    /// `err` filled.
    fn dflash_split_attention(
        q: *mut std::ffi::c_void,
        kc: *mut std::ffi::c_void,
        vc: *mut std::ffi::c_void,
        kb: *mut std::ffi::c_void,
        vb: *mut std::ffi::c_void,
        idx_a: *mut std::ffi::c_void,
        cuq_a: *mut std::ffi::c_void,
        cuk_a: *mut std::ffi::c_void,
        maxq_a: i64,
        maxk_a: i64,
        idx_b: *mut std::ffi::c_void,
        cuq_b: *mut std::ffi::c_void,
        cuk_b: *mut std::ffi::c_void,
        maxq_b: i64,
        maxk_b: i64,
        scale: f64,
        err: *mut std::ffi::c_char,
        err_len: i32,
    ) -> *mut std::ffi::c_void;
}

/// One part of the split: variable-length sequences of consecutive query
/// rows, each with its keys gathered from `cat(context keys, block keys)`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PartPlan {
    /// Rows of `cat([n*S context keys], [n*Q block keys])`, sequence after sequence.
    pub key_rows: Vec<i64>,
    /// `[seqs + 1]` cumulative query rows (every sequence `max_q` long).
    pub cu_q: Vec<i32>,
    /// `[seqs + 1]` cumulative key rows.
    pub cu_k: Vec<i32>,
    pub max_q: i64,
    pub max_k: i64,
}

/// The index plan of one micro-batch.
#[derive(Clone, Debug, PartialEq)]
pub struct SplitPlan {
    /// Part A: the context prefix every block of a group sees.
    pub prefix: PartPlan,
    /// Part B: each block's rest of the context and its own slots.
    pub band: PartPlan,
}

impl SplitPlan {
    /// The plan for `layout`. A group holding a block anchored at position 0
    /// has an empty prefix: flash writes zeros and a log-sum-exp of +inf for
    /// rows without keys, which the merge reads as "no keys" (weight 0).
    pub fn new(layout: &BlockLayout) -> Self {
        let (n, nb, b, s) = (layout.n, layout.blocks, layout.block_size, layout.context_len);
        let group = layout.chunk_blocks;
        debug_assert_eq!(nb % group, 0, "blocks are padded to whole chunks");
        let q_len = nb * b;
        let ctx_rows = n * s;
        let mut prefix = PartPlan { cu_q: vec![0], cu_k: vec![0], max_q: (group * b) as i64, ..PartPlan::default() };
        let mut band = PartPlan { cu_q: vec![0], cu_k: vec![0], max_q: b as i64, ..PartPlan::default() };
        for i in 0..n {
            for g in 0..nb / group {
                let blocks = i * nb + g * group..i * nb + (g + 1) * group;
                let real = blocks.clone().filter(|&j| layout.valid[j] == 1).map(|j| layout.anchors[j] as usize);
                // A group of padding blocks reads position 0: their rows feed
                // no loss, so any finite value will do.
                let p = real.min().unwrap_or(1);
                prefix.key_rows.extend((0..p).map(|t| (i * s + t) as i64));
                push_seq(&mut prefix, group * b, p);
                for j in blocks {
                    // A padding block (no anchor) attends to its own slots only.
                    let a = if layout.valid[j] == 1 { layout.anchors[j] as usize } else { p };
                    let own = ctx_rows + i * q_len + (j - i * nb) * b;
                    band.key_rows.extend((p..a).map(|t| (i * s + t) as i64));
                    band.key_rows.extend((own..own + b).map(|r| r as i64));
                    push_seq(&mut band, b, a - p + b);
                }
            }
        }
        SplitPlan { prefix, band }
    }

    /// The plan's index tensors on `device`.
    pub fn to_device(&self, device: Device) -> SplitIndex {
        SplitIndex { prefix: DevicePart::new(&self.prefix, device), band: DevicePart::new(&self.band, device) }
    }
}

fn push_seq(p: &mut PartPlan, queries: usize, keys: usize) {
    let (q, k) = (*p.cu_q.last().expect("starts at 0"), *p.cu_k.last().expect("starts at 0"));
    p.cu_q.push(q + queries as i32);
    p.cu_k.push(k + keys as i32);
    p.max_k = p.max_k.max(keys as i64);
}

/// A [`PartPlan`] on the device.
pub struct DevicePart {
    key_rows: Tensor,
    cu_q: Tensor,
    cu_k: Tensor,
    max_q: i64,
    max_k: i64,
}

impl DevicePart {
    fn new(p: &PartPlan, device: Device) -> Self {
        DevicePart {
            key_rows: crate::cuda::upload(&Tensor::from_slice(&p.key_rows), device),
            cu_q: crate::cuda::upload(&Tensor::from_slice(&p.cu_q), device),
            cu_k: crate::cuda::upload(&Tensor::from_slice(&p.cu_k), device),
            max_q: p.max_q,
            max_k: p.max_k,
        }
    }
}

/// A [`SplitPlan`] on the device, shared by every layer of one forward.
pub struct SplitIndex {
    prefix: DevicePart,
    band: DevicePart,
}

/// Block attention by the plan: `q` `[T, Hq, d]` (T = n*Q block slots) with
/// its heads group-major (head g*Hkv + j reads kv head j, where a model's
/// head j*G + g does: the shim then folds the G heads of a kv head into rows
/// without a copy), context keys/values `[n*S, Hkv, d]`, block keys/values
/// `[T, Hkv, d]`; returns `[T, Hq, d]`, heads group-major, differentiable in
/// all five. CUDA, bf16 or f16.
pub fn split_attention(
    q: &Tensor,
    kc: &Tensor,
    vc: &Tensor,
    kb: &Tensor,
    vb: &Tensor,
    index: &SplitIndex,
    scale: f64,
) -> Result<Tensor, ModelError> {
    if q.device().is_cuda() && crate::fused_cuda::enabled() {
        crate::gather_sum_cuda::register();
    }
    let (a, b) = (&index.prefix, &index.band);
    let ptr = crate::nvrtc::raw;
    // SAFETY: every pointer is a live at::Tensor borrowed for the call; the
    // C++ side copies the handles it keeps (autograd saves its own
    // references) and returns a new heap tensor or null; `err` has the
    // length passed.
    crate::nvrtc::try_call_shim(|err, len| unsafe {
        dflash_split_attention(
            ptr(q),
            ptr(kc),
            ptr(vc),
            ptr(kb),
            ptr(vb),
            ptr(&a.key_rows),
            ptr(&a.cu_q),
            ptr(&a.cu_k),
            a.max_q,
            a.max_k,
            ptr(&b.key_rows),
            ptr(&b.cu_q),
            ptr(&b.cu_k),
            b.max_q,
            b.max_k,
            scale,
            err,
            len,
        )
    })
    .map_err(|e| ModelError::Device(format!("split attention: {e}")))
}

/// Whether [`split_attention`] runs heads of `head_dim` on `device` in
/// `kind`: libtorch's flash kernels take CUDA tensors in bf16/f16 with a head
/// size that is a multiple of 8, up to 256 (Ampere or newer GPUs, as bf16
/// training needs anyway).
pub fn supported(device: Device, kind: Kind, head_dim: i64) -> bool {
    device.is_cuda() && matches!(kind, Kind::BFloat16 | Kind::Half) && head_dim % 8 == 0 && head_dim <= 256
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::blocks::{BlockSequence, BlockSettings};

    /// Plain attention of `q` over `k`/`v` (f64, one head): out and
    /// log-sum-exp per row.
    fn attend(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64) -> (Tensor, Tensor) {
        let s = q.matmul(&k.tr()) * scale;
        let lse = s.logsumexp([-1], false);
        ((s - lse.unsqueeze(-1)).exp().matmul(v), lse)
    }

    /// Runs one part of the plan with plain attention.
    fn run_part(p: &PartPlan, q: &Tensor, k_all: &Tensor, v_all: &Tensor) -> (Tensor, Tensor) {
        let (mut outs, mut lses) = (Vec::new(), Vec::new());
        let rows = Tensor::from_slice(&p.key_rows);
        for w in 0..p.cu_q.len() - 1 {
            let (q0, q1) = (p.cu_q[w] as i64, p.cu_q[w + 1] as i64);
            // No keys: log-sum-exp -inf and a zero output (the shim maps
            // flash's +inf to -inf).
            let (k0, k1) = (p.cu_k[w] as i64, p.cu_k[w + 1] as i64);
            let idx = rows.narrow(0, k0, k1 - k0);
            let (o, l) =
                attend(&q.narrow(0, q0, q1 - q0), &k_all.index_select(0, &idx), &v_all.index_select(0, &idx), 1.0);
            outs.push(o);
            lses.push(l);
        }
        (Tensor::cat(&outs, 0), Tensor::cat(&lses, 0))
    }

    #[test]
    fn only_cuda_half_precision_and_flash_head_sizes_use_the_split() {
        let gpu = Device::Cuda(0);
        assert!(supported(gpu, Kind::BFloat16, 128) && supported(gpu, Kind::Half, 64));
        assert!(!supported(Device::Cpu, Kind::BFloat16, 128));
        assert!(!supported(gpu, Kind::Float, 128));
        assert!(!supported(gpu, Kind::BFloat16, 100) && !supported(gpu, Kind::BFloat16, 512));
    }

    #[test]
    fn the_plan_covers_exactly_the_keys_the_mask_allows() {
        // Two sequences of different lengths and anchor counts (padding
        // blocks and a padded context), block 3, groups of 2 blocks.
        let ids_a: Vec<u32> = (0..14).collect();
        let ids_b: Vec<u32> = (0..9).collect();
        let (mask_a, mask_b) = (vec![1u8; 14], vec![1u8; 9]);
        let seqs = [
            BlockSequence { input_ids: &ids_a, loss_mask: &mask_a, anchors: vec![1, 3, 4, 8, 11] },
            // Anchored at 0: a block that sees no context at all.
            BlockSequence { input_ids: &ids_b, loss_mask: &mask_b, anchors: vec![0, 2, 6] },
        ];
        let settings = BlockSettings { block_size: 3, mask_token_id: 99, gamma: 4.0, anchors_per_sequence: 8 };
        let layout = BlockLayout::new(&seqs, &settings, 2).with_context_multiple(8);
        let plan = SplitPlan::new(&layout);
        let (n, s, q_len) = (2i64, layout.context_len as i64, (layout.blocks * 3) as i64);
        assert_eq!((s, q_len), (16, 18));

        tch::manual_seed(7);
        let opts = (Kind::Double, Device::Cpu);
        let q = Tensor::randn([n * q_len, 4], opts);
        let kc = Tensor::randn([n * s, 4], opts);
        let vc = Tensor::randn([n * s, 4], opts);
        let kb = Tensor::randn([n * q_len, 4], opts);
        let vb = Tensor::randn([n * q_len, 4], opts);
        let (k_all, v_all) = (Tensor::cat(&[&kc, &kb], 0), Tensor::cat(&[&vc, &vb], 0));
        let (oa, la) = run_part(&plan.prefix, &q, &k_all, &v_all);
        let (ob, lb) = run_part(&plan.band, &q, &k_all, &v_all);
        let merged = la.logaddexp(&lb);
        let split = oa * (la - &merged).exp().unsqueeze(-1) + ob * (lb - &merged).exp().unsqueeze(-1);

        // The masked attention of the layout (one chunk per call).
        let mask = layout.attention_mask(Device::Cpu); // [n*G, 1, CB, S+CB]
        let (g, cb) = (mask.size()[0] / n, mask.size()[2]);
        for i in 0..n {
            for c in 0..g {
                let rows = i * q_len + c * cb;
                let keys = Tensor::cat(&[kc.narrow(0, i * s, s), kb.narrow(0, rows, cb)], 0);
                let vals = Tensor::cat(&[vc.narrow(0, i * s, s), vb.narrow(0, rows, cb)], 0);
                let m = mask.get(i * g + c).get(0);
                let scores = q.narrow(0, rows, cb).matmul(&keys.tr()).masked_fill(&m.logical_not(), f64::NEG_INFINITY);
                let expect = scores.softmax(-1, Kind::Double).matmul(&vals);
                // Padding blocks (no anchor) feed no loss; compare real ones.
                for r in 0..cb {
                    let block = (layout.blocks as i64) * i + (c * cb + r) / 3;
                    if layout.valid[block as usize] == 0 {
                        continue;
                    }
                    let diff = (expect.get(r) - split.get(rows + r)).abs().max().double_value(&[]);
                    assert!(diff < 1e-12, "sequence {i} row {}: {diff}", c * cb + r);
                }
            }
        }
        // Groups of 2 blocks: 3 per sequence, every one max_q = 6 rows; the
        // first group of sequence 1 has an empty prefix (anchor 0).
        assert_eq!(plan.prefix.cu_q, (0..=6).map(|g| g * 6).collect::<Vec<i32>>());
        assert_eq!(plan.prefix.cu_k[4] - plan.prefix.cu_k[3], 0);
        assert_eq!(plan.band.max_q, 3);
    }

    /// The masked attention of `layout` in f32 (the drafter's masked path,
    /// key/value heads repeated for grouped queries); `[T, Hq, d]`.
    fn masked(layout: &BlockLayout, t: [&Tensor; 5], heads: (i64, i64, i64)) -> Tensor {
        let [q, kc, vc, kb, vb] = t.map(|x| x.to_kind(Kind::Float));
        let (hq, hkv, d) = heads;
        let (n, s) = (layout.n as i64, layout.context_len as i64);
        let q_len = (layout.blocks * layout.block_size) as i64;
        let mask = layout.attention_mask(q.device());
        let g = mask.size()[0] / n;
        let cb = q_len / g;
        let keys = |c: &Tensor, b: &Tensor| {
            let c = c.view([n, 1, s, hkv, d]).expand([n, g, s, hkv, d], false).reshape([n * g, s, hkv, d]);
            Tensor::cat(&[c, b.view([n * g, cb, hkv, d])], 1).transpose(1, 2).repeat_interleave_self_int(
                hq / hkv,
                1,
                None,
            )
        };
        let q = q.view([n * g, cb, hq, d]).transpose(1, 2);
        let o = Tensor::scaled_dot_product_attention(
            &q,
            &keys(&kc, &kb),
            &keys(&vc, &vb),
            Some(&mask),
            0.0,
            false,
            None,
            false,
        );
        o.transpose(1, 2).reshape([n * q_len, hq, d])
    }

    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn split_attention_on_cuda_matches_the_masked_attention() {
        use rand::{Rng, SeedableRng};
        let dev = crate::cuda::tch_device(Some(0)).expect("a CUDA device");
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(3);
        let settings = BlockSettings { block_size: 16, mask_token_id: 3, gamma: 7.0, anchors_per_sequence: 40 };
        let lens = [700usize, 260, 41];
        let ids: Vec<Vec<u32>> = lens.iter().map(|&l| (0..l as u32).collect()).collect();
        // The first sequence is trainable from position 0 and holds a block
        // anchored there (no context): its group's prefix is empty.
        let masks: Vec<Vec<u8>> =
            lens.iter().enumerate().map(|(s, &l)| (0..l).map(|i| u8::from(s == 0 || i >= l / 5)).collect()).collect();
        let seqs: Vec<BlockSequence> = (0..3)
            .map(|i| {
                let mut anchors = crate::blocks::sample_anchors(&masks[i], 40, &mut rng);
                if i == 0 && anchors[0] != 0 {
                    anchors[0] = 0;
                }
                BlockSequence { input_ids: &ids[i], loss_mask: &masks[i], anchors }
            })
            .collect();
        let layout = BlockLayout::new(&seqs, &settings, 8).with_context_multiple(128);
        let plan = SplitPlan::new(&layout);
        let (hq, hkv, d) = (8i64, 2i64, 128i64);
        let (n, s) = (layout.n as i64, layout.context_len as i64);
        let t = n * (layout.blocks * layout.block_size) as i64;
        tch::manual_seed(rng.random());
        let leaf = |rows: i64, h: i64| Tensor::randn([rows, h, d], (Kind::BFloat16, dev)).set_requires_grad(true);
        let (q, kc, vc, kb, vb) = (leaf(t, hq), leaf(n * s, hkv), leaf(n * s, hkv), leaf(t, hkv), leaf(t, hkv));
        // Upstream gradient on real blocks only (padding rows feed no loss).
        let valid = Tensor::from_slice(&layout.valid).to_device(dev).repeat_interleave_self_int(16, 0, None);
        let d_out = Tensor::randn([t, hq, d], (Kind::Float, dev)) * valid.view([t, 1, 1]).to_kind(Kind::Float);

        let launches = || crate::gather_sum_cuda::LAUNCHES.load(std::sync::atomic::Ordering::Relaxed);
        let before = launches();
        // The model's head order to group-major and back (see split_attention).
        let g = hq / hkv;
        let group_major = q.view([t, hkv, g, d]).transpose(1, 2).reshape([t, hq, d]);
        let out = split_attention(&group_major, &kc, &vc, &kb, &vb, &plan.to_device(dev), 1.0 / (d as f64).sqrt())
            .unwrap()
            .view([t, g, hkv, d])
            .transpose(1, 2)
            .reshape([t, hq, d]);
        let got: Vec<Tensor> = Tensor::run_backward(
            &[(out.to_kind(Kind::Float) * &d_out).sum(Kind::Float)],
            &[&q, &kc, &vc, &kb, &vb],
            false,
            false,
        );
        // The key and value gradients were summed by the GPU kernel (one
        // launch each), not by index_add_.
        // (At least: other tests of the process may launch it too.)
        assert!(launches() - before >= 2, "the gather-sum kernel ran");
        let reference = masked(&layout, [&q, &kc, &vc, &kb, &vb], (hq, hkv, d));
        let want: Vec<Tensor> =
            Tensor::run_backward(&[(&reference * &d_out).sum(Kind::Float)], &[&q, &kc, &vc, &kb, &vb], false, false);
        let rel = |a: &Tensor, b: &Tensor| {
            let (a, b) = (a.to_kind(Kind::Float), b.to_kind(Kind::Float));
            (a - &b).abs().max().double_value(&[]) / b.abs().max().double_value(&[])
        };
        let mask_rows = valid.view([t, 1, 1]).to_kind(Kind::Float);
        let out_err = rel(&(out.to_kind(Kind::Float) * &mask_rows), &(reference * &mask_rows));
        assert!(out_err < 1e-2, "output: relative error {out_err}");
        for (name, (g, w)) in ["q", "kc", "vc", "kb", "vb"].iter().zip(got.iter().zip(&want)) {
            let e = rel(g, w);
            assert!(e < 2e-2, "gradient of {name}: relative error {e}");
        }
    }
}
