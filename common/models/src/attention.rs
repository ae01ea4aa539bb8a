//! How the queries of a softmax-attention layer attend, over packed
//! sequences (capture) and over the decoding cache: causally, optionally
//! within a sliding window (gpt-oss's `sliding_attention` layers), optionally
//! with a learned sink logit per head that takes a share of every softmax
//! and gives nothing back (gpt-oss), at the family's softmax scale, with
//! value heads that may be narrower than the query and key heads (DeepSeek's
//! latent attention).
//!
//! Three ways to compute it, chosen per call:
//! - plain causal attention (no window, no sinks, the default scale, equal
//!   head sizes): one flash SDPA call per sequence, as every dense family
//!   has always run;
//! - otherwise on a GPU in half precision: one variable-length flash call
//!   over the whole packed batch with the window (`csrc/varlen_attention.cpp`);
//!   sinks rescale its output by `sigmoid(lse - sink)`, since
//!   `sum_j e^{s_j} v_j / (e^{lse} + e^{sink}) = out * e^{lse} / (e^{lse} + e^{sink})`;
//! - otherwise (CPU, f32): the definition, sequence by sequence, with the
//!   softmax in f32.

use tch::{Device, Kind, Tensor};

use crate::ModelError;

unsafe extern "C" {
    /// csrc/varlen_attention.cpp: fills `out` and `lse` with new
    /// `at::Tensor*` and returns 0, or returns 1 with `err` filled.
    fn dflash_varlen_attention(
        q: *mut std::ffi::c_void,
        k: *mut std::ffi::c_void,
        v: *mut std::ffi::c_void,
        cu: *mut std::ffi::c_void,
        max_len: i64,
        scale: f64,
        window_left: i64,
        out: *mut *mut std::ffi::c_void,
        lse: *mut *mut std::ffi::c_void,
        err: *mut std::ffi::c_char,
        err_len: i32,
    ) -> i32;
}

/// What a layer's attention computes beyond plain causal attention.
#[derive(Debug)]
pub struct AttentionKernel {
    /// Multiplies `q . k` (`1/sqrt(d)` unless the family says otherwise).
    pub scale: f64,
    /// A query sees only the last `window` positions, itself included
    /// (transformers' `sliding_window`).
    pub window: Option<i64>,
    /// Per query head, a logit in every softmax's denominator `[heads]`, f32.
    pub sinks: Option<Tensor>,
}

impl AttentionKernel {
    /// Causal attention at the default scale of `head_dim`.
    pub fn causal(head_dim: i64) -> Self {
        Self { scale: (head_dim as f64).powf(-0.5), window: None, sinks: None }
    }

    fn is_plain(&self, qk_dim: i64, v_dim: i64) -> bool {
        self.window.is_none()
            && self.sinks.is_none()
            && qk_dim == v_dim
            && (self.scale - (qk_dim as f64).powf(-0.5)).abs() <= 1e-12 * self.scale
    }

    /// Causal attention of each packed sequence with itself: `q` `[T, nh,
    /// d]`, `k` `[T, nkv, d]`, `v` `[T, nkv, dv]`, sequences of `lens`;
    /// returns `[T, nh * dv]`.
    pub fn packed(&self, q: &Tensor, k: &Tensor, v: &Tensor, lens: &[i64]) -> Tensor {
        let (nh, d, dv) = (q.size()[1], q.size()[2], v.size()[2]);
        if self.is_plain(d, dv) {
            return plain_packed(q, k, v, lens);
        }
        if varlen_supported(q.device(), q.kind(), d) {
            match self.varlen(q, k, v, lens) {
                Ok(out) => return out.reshape([-1, nh * dv]),
                Err(e) => tracing::warn!("variable-length flash attention failed, computing it directly: {e}"),
            }
        }
        per_sequence(q, k, v, lens, |q, k, v| {
            let l = q.size()[2];
            let mask = self.windowed(causal_mask(l, l, q.device()), l, l);
            self.direct(q, k, v, &mask.unsqueeze(0).unsqueeze(0))
        })
    }

    /// Queries `q` `[B, nh, t, d]` (the newest `t` positions) against the
    /// cache's keys `[B, nkv, L, d]` and values `[B, nkv, L, dv]` under
    /// `mask` `[B, 1, t, L]` (causal and valid keys; the window is applied
    /// here, counting cache positions); returns `[B, t, nh * dv]`.
    pub fn cached(&self, q: &Tensor, k: &Tensor, v: &Tensor, mask: &Tensor) -> Tensor {
        let (b, nh, t, d) = q.size4().expect("[B, nh, t, d]");
        let (l, dv) = (k.size()[2], v.size()[3]);
        let o = if self.is_plain(d, dv) {
            let n_rep = nh / k.size()[1];
            let (k, v) = (repeat_kv(k, n_rep), repeat_kv(v, n_rep));
            Tensor::scaled_dot_product_attention(q, &k, &v, Some(mask), 0.0, false, None, false)
        } else {
            let all = Tensor::ones([t, l], (Kind::Bool, q.device()));
            self.direct(q, k, v, &mask.logical_and(&self.windowed(all, t, l)))
        };
        o.transpose(1, 2).reshape([b, t, nh * dv])
    }

    /// `mask` `[tq, tk]` (query i is position `tk - tq + i`) narrowed to the window.
    fn windowed(&self, mask: Tensor, tq: i64, tk: i64) -> Tensor {
        let Some(w) = self.window else { return mask };
        let q_pos = Tensor::arange(tq, (Kind::Int64, mask.device())).unsqueeze(1) + (tk - tq);
        let k_pos = Tensor::arange(tk, (Kind::Int64, mask.device())).unsqueeze(0);
        mask.logical_and(&k_pos.gt_tensor(&(q_pos - w)))
    }

    /// The definition, softmax in f32: `q` `[B, nh, tq, d]`, `k` `[B, nkv,
    /// tk, d]`, `v` `[B, nkv, tk, dv]`, `mask` broadcasting to `[B, nh, tq,
    /// tk]`; returns `[B, nh, tq, dv]` in `q`'s kind. A row with no visible
    /// key gives zeros (padding rows of a batch).
    fn direct(&self, q: &Tensor, k: &Tensor, v: &Tensor, mask: &Tensor) -> Tensor {
        let n_rep = q.size()[1] / k.size()[1];
        let (k, v) = (repeat_kv(k, n_rep), repeat_kv(v, n_rep));
        let f = |t: &Tensor| t.to_kind(Kind::Float);
        let scores = f(q).matmul(&f(&k).transpose(-1, -2)) * self.scale;
        let scores = scores.masked_fill(&mask.logical_not(), f64::NEG_INFINITY);
        let probs = match &self.sinks {
            Some(s) => {
                let sink = s
                    .to_kind(Kind::Float)
                    .view([1, -1, 1, 1])
                    .expand([scores.size()[0], -1, scores.size()[2], 1], false);
                let tk = scores.size()[3];
                Tensor::cat(&[&scores, &sink], -1).softmax(-1, Kind::Float).narrow(-1, 0, tk)
            }
            None => scores.softmax(-1, Kind::Float),
        };
        // Rows without a key are NaN after the softmax.
        let probs = probs.nan_to_num(0.0, None, None);
        probs.matmul(&f(&v)).to_kind(q.kind())
    }

    /// One variable-length flash call over the packed batch.
    fn varlen(&self, q: &Tensor, k: &Tensor, v: &Tensor, lens: &[i64]) -> Result<Tensor, ModelError> {
        let (d, dv) = (q.size()[2], v.size()[2]);
        // Flash needs equal head sizes: narrower values are padded with zeros.
        let v_in = if dv < d { v.constant_pad_nd([0, d - dv]) } else { v.shallow_clone() };
        let mut cu = vec![0i32];
        for &l in lens {
            cu.push(cu[cu.len() - 1] + l as i32);
        }
        let cu = Tensor::from_slice(&cu).to_device(q.device());
        let max_len = lens.iter().copied().max().unwrap_or(0);
        let window_left = self.window.map_or(-1, |w| w - 1);
        let (q, k) = (q.contiguous(), k.contiguous());
        let v_in = v_in.contiguous();
        let ptr = |t: &Tensor| t.as_ptr().cast_mut().cast::<std::ffi::c_void>();
        let (mut out, mut lse) = (std::ptr::null_mut(), std::ptr::null_mut());
        let mut err = [0u8; 1024];
        // SAFETY: every pointer is a live at::Tensor borrowed for the call;
        // on success the shim hands over two new heap tensors, and `err`
        // has the length passed.
        let failed = unsafe {
            dflash_varlen_attention(
                ptr(&q),
                ptr(&k),
                ptr(&v_in),
                ptr(&cu),
                max_len,
                self.scale,
                window_left,
                &mut out,
                &mut lse,
                err.as_mut_ptr().cast(),
                err.len() as i32,
            )
        };
        if failed != 0 {
            let end = err.iter().position(|&c| c == 0).unwrap_or(err.len());
            return Err(ModelError::Device(format!("varlen attention: {}", String::from_utf8_lossy(&err[..end]))));
        }
        // SAFETY: fresh at::Tensor pointers from the shim, owned from here on.
        let (out, lse) = unsafe { (Tensor::from_ptr(out.cast()), Tensor::from_ptr(lse.cast())) };
        let out = out.narrow(-1, 0, dv);
        Ok(match &self.sinks {
            // lse [nh, T]: each row's share after the sink took its own.
            Some(s) => {
                let keep = (lse - s.to_kind(Kind::Float).unsqueeze(1)).sigmoid().transpose(0, 1).unsqueeze(-1);
                (out.to_kind(Kind::Float) * keep).to_kind(q.kind())
            }
            None => out,
        })
    }
}

/// Plain causal attention, one flash SDPA call per sequence.
fn plain_packed(q: &Tensor, k: &Tensor, v: &Tensor, lens: &[i64]) -> Tensor {
    per_sequence(q, k, v, lens, |q, k, v| {
        // Grouped-query attention inside the (flash) kernel: no copy of the
        // kv heads per query head.
        Tensor::scaled_dot_product_attention(q, k, v, None::<Tensor>, 0.0, true, None, true)
    })
}

/// `attend` over each packed sequence alone, heads first (`[1, heads, l,
/// d]`), the outputs back in token order as `[T, nh * dv]`.
fn per_sequence(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    lens: &[i64],
    attend: impl Fn(&Tensor, &Tensor, &Tensor) -> Tensor,
) -> Tensor {
    let (nh, dv) = (q.size()[1], v.size()[2]);
    let (qs, ks, vs) = (q.split_with_sizes(lens, 0), k.split_with_sizes(lens, 0), v.split_with_sizes(lens, 0));
    let heads_first = |t: &Tensor| t.transpose(0, 1).unsqueeze(0);
    let outs: Vec<Tensor> = qs
        .iter()
        .zip(&ks)
        .zip(&vs)
        .map(|((q, k), v)| {
            let o = attend(&heads_first(q), &heads_first(k), &heads_first(v));
            o.squeeze_dim(0).transpose(0, 1).reshape([-1, nh * dv])
        })
        .collect();
    Tensor::cat(&outs, 0)
}

/// Repeats key/value heads for grouped-query attention: `[B, kv, S, d]` to
/// `[B, kv * n_rep, S, d]`.
fn repeat_kv(x: &Tensor, n_rep: i64) -> Tensor {
    if n_rep == 1 { x.shallow_clone() } else { x.repeat_interleave_self_int(n_rep, 1, None::<i64>) }
}

/// `[tq, tk]`: query i (position `tk - tq + i`) sees keys up to itself.
fn causal_mask(tq: i64, tk: i64, device: Device) -> Tensor {
    Tensor::ones([tq, tk], (Kind::Bool, device)).tril(tk - tq)
}

/// Whether the variable-length flash kernel takes these heads: CUDA,
/// bf16/f16, head size a multiple of 8 up to 256.
fn varlen_supported(device: Device, kind: Kind, head_dim: i64) -> bool {
    device.is_cuda() && matches!(kind, Kind::BFloat16 | Kind::Half) && head_dim % 8 == 0 && head_dim <= 256
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The definition in f64, one query at a time.
    fn reference(q: &Tensor, k: &Tensor, v: &Tensor, lens: &[i64], kern: &AttentionKernel) -> Tensor {
        let (nh, nkv) = (q.size()[1], k.size()[1]);
        let mut rows = Vec::new();
        let mut start = 0;
        for &l in lens {
            for i in 0..l {
                let mut heads = Vec::new();
                for h in 0..nh {
                    let g = h / (nh / nkv);
                    let lo = kern.window.map_or(0, |w| (i - w + 1).max(0));
                    let qi = q.get(start + i).get(h).to_kind(Kind::Double);
                    let ks = k.narrow(0, start + lo, i - lo + 1).select(1, g).to_kind(Kind::Double);
                    let vs = v.narrow(0, start + lo, i - lo + 1).select(1, g).to_kind(Kind::Double);
                    let s = ks.matmul(&qi) * kern.scale;
                    let mut denom = s.exp().sum(Kind::Double);
                    if let Some(sk) = &kern.sinks {
                        denom += sk.get(h).to_kind(Kind::Double).exp();
                    }
                    heads.push((s.exp() / denom).matmul(&vs));
                }
                rows.push(Tensor::cat(&heads, 0));
            }
            start += l;
        }
        Tensor::stack(&rows, 0)
    }

    #[test]
    fn windows_sinks_scales_and_narrow_values_follow_the_definition() {
        tch::manual_seed(7);
        let lens = [5i64, 9, 1, 12];
        let t: i64 = lens.iter().sum();
        let f = (Kind::Float, Device::Cpu);
        let (q, k) = (Tensor::randn([t, 4, 8], f), Tensor::randn([t, 2, 8], f));
        for (window, sinks, dv, scale) in [
            (None, false, 8, 8f64.powf(-0.5)),
            (Some(3), false, 8, 8f64.powf(-0.5)),
            (None, true, 8, 8f64.powf(-0.5)),
            (Some(4), true, 8, 0.3),
            (None, false, 6, 0.41),
        ] {
            let v = Tensor::randn([t, 2, dv], f);
            let kern = AttentionKernel { scale, window, sinks: sinks.then(|| Tensor::randn([4], f)) };
            let got = kern.packed(&q, &k, &v, &lens);
            let want = reference(&q, &k, &v, &lens, &kern);
            let err = (got.to_kind(Kind::Double) - &want).abs().max().double_value(&[]);
            assert!(err < 1e-5, "window {window:?} sinks {sinks} dv {dv}: {err}");
        }
    }

    #[test]
    fn cached_attention_over_a_prefix_equals_the_packed_forward() {
        tch::manual_seed(8);
        let f = (Kind::Float, Device::Cpu);
        let (l, t) = (10i64, 3i64);
        let (q, k, v) = (Tensor::randn([l, 4, 8], f), Tensor::randn([l, 2, 8], f), Tensor::randn([l, 2, 8], f));
        for kern in [
            AttentionKernel { scale: 0.35, window: Some(4), sinks: Some(Tensor::randn([4], f)) },
            AttentionKernel::causal(8),
        ] {
            let packed = kern.packed(&q, &k, &v, &[l]);
            // The last t queries against every key, the mask causal.
            let qb = q.narrow(0, l - t, t).transpose(0, 1).unsqueeze(0);
            let (kb, vb) = (k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0));
            let mask = causal_mask(t, l, Device::Cpu).view([1, 1, t, l]);
            let got = kern.cached(&qb, &kb, &vb, &mask).squeeze_dim(0);
            let err = (got - packed.narrow(0, l - t, t)).abs().max().double_value(&[]);
            assert!(err < 1e-5, "{kern:?}: {err}");
        }
    }
}
