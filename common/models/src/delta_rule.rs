//! The gated delta rule of Gated DeltaNet layers (Qwen3-Next, Qwen3.5), as
//! transformers defines it: per head a state `S` `[dk, dv]` that, token by
//! token, decays by `exp(g)`, is corrected towards `v` along `k` with
//! learning rate `beta`, and is read by `q`:
//!
//! ```text
//! S = exp(g_t) S;  S += k_t ((v_t - S^T k_t) beta_t)^T;  o_t = S^T q_t
//! ```
//!
//! Two ways to compute it, equal up to rounding:
//! - [`chunked`]: the WY/UT form over chunks of 64 tokens. Within a chunk
//!   every product is a batched matmul over all chunks of all sequences
//!   at once (the triangular system of the chunk solved in one call); only
//!   the hand-over of the state from one chunk to the next is sequential,
//!   and it runs over every sequence of a packed batch together. Each
//!   sequence of a packed batch has chunks of its own, so no state crosses
//!   a sequence boundary. This is the capture path and the decoding prefill.
//! - [`step`]: one token of the recurrence, for decoding.
//!
//! Inputs are f32 (the precision transformers and flash-linear-attention
//! keep the rule in), `q` and `k` L2-normalised and `q` already scaled.

use tch::{Device, Kind, Tensor};

/// Tokens per chunk (what transformers and flash-linear-attention use).
pub const CHUNK: i64 = 64;

/// The per-token inputs of one layer: `q`, `k` `[T, HK, dk]`, `v` `[T, H,
/// dv]`, `g` (log decay, <= 0) and `beta` `[T, H]`. Each of the `HK` key
/// heads serves `H / HK` consecutive value heads (as the layer's
/// projections make them).
pub struct RuleInputs<'a> {
    pub q: &'a Tensor,
    pub k: &'a Tensor,
    pub v: &'a Tensor,
    pub g: &'a Tensor,
    pub beta: &'a Tensor,
}

/// What [`chunked`] returns.
pub struct RuleOutput {
    /// `[T, H, dv]` f32, in the input's token order.
    pub out: Tensor,
    /// Each sequence's state after its last token `[N, H, dk, dv]`.
    pub final_state: Tensor,
    /// With `record`: each sequence's state after each of its tokens,
    /// `[T, H, dk, dv]` in token order (for decoding, which must be able to
    /// go back to any position of a verified block).
    pub states: Option<Tensor>,
}

/// Where each sequence's chunks sit in the chunked layout. Chunks are
/// stored step-major (every sequence's first chunk, then every second
/// chunk, ...) with the sequences ordered by chunk count, longest first,
/// so that the chunks of scan step `j` are one contiguous run whose
/// sequences are the first `active[j]`. Built once per packed batch and
/// shared by its layers: its index tensors reach the device in one copy
/// (a copy from host memory waits for the device), not one per layer.
pub struct ChunkPlan {
    lens: Vec<i64>,
    /// Per scan step: how many sequences (a prefix of the order) have a
    /// chunk, and where the step's chunks start.
    active: Vec<i64>,
    offsets: Vec<i64>,
    /// For every slot of the chunked layout, its token (T = padding).
    gather: Tensor,
    /// For every token, its slot.
    scatter: Tensor,
    /// Sequence indices, longest first; and each sequence's rank in it.
    order: Tensor,
    unsort: Tensor,
    /// Per sequence in the order, the row of its last chunk.
    last_rows: Tensor,
    chunks: i64,
    /// The same chunks in sequence order, for the fused kernels
    /// (`delta_rule_cuda`): each chunk's first token and token count, each
    /// sequence's first chunk and chunk count, and the sequences from the
    /// most chunks to the fewest (the scan starts the longest first).
    kernel_table: [Tensor; 5],
}

impl ChunkPlan {
    /// The plan of packed sequences of lengths `lens` (each at least one token).
    pub fn new(lens: &[i64], device: Device) -> Self {
        assert!(lens.iter().all(|&l| l > 0), "every sequence has a token");
        let n_chunks: Vec<i64> = lens.iter().map(|&l| (l + CHUNK - 1) / CHUNK).collect();
        let mut order: Vec<usize> = (0..lens.len()).collect();
        order.sort_by_key(|&s| std::cmp::Reverse(n_chunks[s]));
        let starts: Vec<i64> = lens.iter().scan(0, |acc, &l| Some(std::mem::replace(acc, *acc + l))).collect();
        let total: i64 = lens.iter().sum();
        let steps = n_chunks.iter().copied().max().unwrap_or(0);
        let mut active = Vec::with_capacity(steps as usize);
        let mut gather = Vec::new();
        let mut scatter = vec![0i64; total as usize];
        for j in 0..steps {
            let mut n = 0;
            for &s in order.iter().take_while(|&&s| n_chunks[s] > j) {
                for i in 0..CHUNK {
                    let pos = j * CHUNK + i;
                    if pos < lens[s] {
                        let t = starts[s] + pos;
                        scatter[t as usize] = gather.len() as i64;
                        gather.push(t);
                    } else {
                        gather.push(total);
                    }
                }
                n += 1;
            }
            active.push(n);
        }
        let offsets: Vec<i64> = active.iter().scan(0, |acc, &a| Some(std::mem::replace(acc, *acc + a))).collect();
        let last_rows: Vec<i64> =
            order.iter().enumerate().map(|(rank, &s)| offsets[n_chunks[s] as usize - 1] + rank as i64).collect();
        let mut unsort = vec![0i64; lens.len()];
        for (rank, &s) in order.iter().enumerate() {
            unsort[s] = rank as i64;
        }
        let order: Vec<i64> = order.iter().map(|&s| s as i64).collect();
        let (mut chunk_tok, mut chunk_len, mut seq_chunk0) = (Vec::new(), Vec::new(), Vec::new());
        for (&start, &len) in starts.iter().zip(lens) {
            seq_chunk0.push(chunk_tok.len() as i64);
            for at in (0..len).step_by(CHUNK as usize) {
                chunk_tok.push(start + at);
                chunk_len.push(CHUNK.min(len - at));
            }
        }
        // One copy to the device, cut into its parts there.
        let parts = [&gather, &scatter, &order, &unsort, &last_rows, &chunk_tok, &chunk_len, &seq_chunk0, &n_chunks];
        let all =
            Tensor::from_slice(&parts.iter().flat_map(|p| p.iter().copied()).collect::<Vec<_>>()).to_device(device);
        let mut at = 0;
        let mut cut = |len: usize| {
            let t = all.narrow(0, at, len as i64);
            at += len as i64;
            t
        };
        let (g, sc, o, u, l) =
            (cut(gather.len()), cut(scatter.len()), cut(order.len()), cut(unsort.len()), cut(last_rows.len()));
        let kernel_table =
            [cut(chunk_tok.len()), cut(chunk_len.len()), cut(seq_chunk0.len()), cut(n_chunks.len()), o.shallow_clone()];
        ChunkPlan {
            lens: lens.to_vec(),
            active,
            offsets,
            gather: g,
            scatter: sc,
            order: o,
            unsort: u,
            last_rows: l,
            chunks: gather.len() as i64 / CHUNK,
            kernel_table,
        }
    }

    /// The sequences' lengths.
    pub fn lens(&self) -> &[i64] {
        &self.lens
    }

    /// Chunks of all sequences.
    pub fn chunks(&self) -> i64 {
        self.chunks
    }

    /// The chunk table of the fused kernels, on the plan's device.
    pub(crate) fn kernel_table(&self) -> &[Tensor; 5] {
        &self.kernel_table
    }
}

/// `[T, H, d]` into the chunked layout `[chunks, H, CHUNK, d]`, padding with zeros.
fn to_chunks(x: &Tensor, p: &ChunkPlan) -> Tensor {
    let mut shape = x.size();
    shape[0] = 1;
    let padded = Tensor::cat(&[x, &Tensor::zeros(shape.as_slice(), (x.kind(), x.device()))], 0);
    let h = x.size()[1];
    let rest: Vec<i64> = x.size()[2..].to_vec();
    let gathered = padded.index_select(0, &p.gather);
    let mut s = vec![p.chunks, CHUNK, h];
    s.extend(&rest);
    let g = gathered.view(s.as_slice());
    // [chunks, CHUNK, H, ..] -> [chunks, H, CHUNK, ..]
    g.transpose(1, 2)
}

/// The inverse of [`to_chunks`] for `[chunks, H, CHUNK, ..]`: `[T, H, ..]`.
fn from_chunks(x: &Tensor, p: &ChunkPlan) -> Tensor {
    let x = x.transpose(1, 2); // [chunks, CHUNK, H, ..]
    let mut s = vec![p.chunks * CHUNK];
    s.extend(&x.size()[2..]);
    x.reshape(s.as_slice()).index_select(0, &p.scatter)
}

/// `a @ b` over the last two dimensions with an f32 result: half-precision
/// operands stay half on GPUs (tensor cores, f32 accumulation), f32 stays f32.
fn mm(a: &Tensor, b: &Tensor) -> Tensor {
    if a.kind() == Kind::Float || !a.device().is_cuda() {
        return a.to_kind(Kind::Float).matmul(&b.to_kind(Kind::Float));
    }
    let (sa, sb) = (a.size(), b.size());
    let lead = &sa[..sa.len() - 2];
    let (m, k, n) = (sa[sa.len() - 2], sa[sa.len() - 1], sb[sb.len() - 1]);
    let batch: i64 = lead.iter().product();
    let out = a.reshape([batch, m, k]).bmm_dtype(&b.to_kind(a.kind()).reshape([batch, k, n]), Kind::Float);
    out.view([lead.to_vec(), vec![m, n]].concat().as_slice())
}

/// The gated delta rule over packed sequences of lengths `lens` (each at
/// least one token), each from its row of `initial` `[N, H, dk, dv]`
/// (zeros when None). `q`, `k`, `v` may be half precision (the model's
/// kind): their products then run in it with f32 accumulation, as
/// flash-linear-attention computes them; decays, the triangular systems
/// and the states stay f32.
///
/// Per chunk c (positions i, j; G the decay summed within the chunk):
/// `U = L^-1 (beta v)`, `W = L^-1 (beta exp(G) k)` with `L = I +
/// strictly_lower(beta_i k_i.k_j exp(G_i - G_j))` (the UT transform of the
/// chunk's sequential corrections). The state entering chunk c+1 is
/// `S' = M S + B` with `M = exp(G_last) I - K_d^T W`, `B = K_d^T U`,
/// `K_d = exp(G_last - G) k`, run as `v_new = U - W S`, `S' = exp(G_last)
/// S + K_d^T v_new`: two batched products per chunk step for all
/// sequences. Then, all chunks at once: `o = exp(G) q S + (q k^T * decay)
/// v_new`.
pub fn chunked(x: &RuleInputs, lens: &[i64], initial: Option<&Tensor>, record: bool) -> RuleOutput {
    chunked_with(x, &ChunkPlan::new(lens, x.q.device()), initial, record, &mut |_| {})
}

/// [`chunked`] over a plan made beforehand, calling `mark(stage)` after
/// each stage (profiling).
pub fn chunked_with(
    x: &RuleInputs,
    p: &ChunkPlan,
    initial: Option<&Tensor>,
    record: bool,
    mark: &mut dyn FnMut(&'static str),
) -> RuleOutput {
    let _guard = tch::no_grad_guard();
    let dev = x.q.device();
    let kind = x.v.kind();
    let (h, dk, dv) = (x.v.size()[1], x.k.size()[2], x.v.size()[2]);
    let f = (Kind::Float, dev);
    let q = to_chunks(&matched_heads(x.q, h).to_kind(kind), p);
    let k = to_chunks(&matched_heads(x.k, h).to_kind(kind), p);
    let v = to_chunks(x.v, p);
    let beta = to_chunks(&x.beta.to_kind(Kind::Float).unsqueeze(-1), p); // [C, H, L, 1]
    let g = to_chunks(&x.g.to_kind(Kind::Float).unsqueeze(-1), p).squeeze_dim(-1); // [C, H, L]
    mark("rule: into chunks");

    // Within a chunk, the decay from position j to position i (j <= i).
    let g_cum = g.cumsum(-1, Kind::Float);
    let later = Tensor::ones([CHUNK, CHUNK], (Kind::Bool, dev)).triu(1);
    let pairwise = (g_cum.unsqueeze(-1) - g_cum.unsqueeze(-2)).masked_fill(&later, f64::NEG_INFINITY).exp();
    let kt = k.transpose(-1, -2);
    let system = mm(&k, &kt) * &beta * &pairwise;
    let decay_in = g_cum.exp().unsqueeze(-1); // [C, H, L, 1]
    let k32 = k.to_kind(Kind::Float);
    let rhs = Tensor::cat(&[v.to_kind(Kind::Float) * &beta, &k32 * &beta * &decay_in], -1);
    mark("rule: UT systems");
    let solved = system.linalg_solve_triangular(&rhs, false, true, true);
    drop((system, rhs));
    mark("rule: triangular solve");
    let u = solved.narrow(-1, 0, dv);
    let w = solved.narrow(-1, dv, dk).to_kind(kind);
    let last = g_cum.narrow(-1, CHUNK - 1, 1); // [C, H, 1]
    let k_out = (k32 * (&last - &g_cum).exp().unsqueeze(-1)).to_kind(kind).transpose(-1, -2); // K_d^T
    let chunk_decay = last.exp().unsqueeze(-1); // [C, H, 1, 1]
    mark("rule: chunk decays");

    // The hand-over, chunk step by chunk step: the state S entering a chunk
    // gives the chunk's corrected values `v_new = U - W S` and the state
    // entering the next, `exp(G_last) S + K_d^T v_new`. Step j's chunks
    // are rows offset_j.. of the chunked layout, its sequences a prefix of
    // the longest-first order, so each step is two batched products over
    // every sequence still running (nothing `dk x dk` per chunk is made).
    let n = p.lens.len() as i64;
    let entering = Tensor::zeros([p.chunks, h, dk, dv], f);
    if let Some(s0) = initial {
        entering.narrow(0, 0, n).copy_(&s0.to_kind(Kind::Float).index_select(0, &p.order));
    }
    let v_new = Tensor::empty([p.chunks, h, CHUNK, dv], f);
    let offsets = &p.offsets;
    for j in 0..p.active.len() {
        let (at, a) = (offsets[j], p.active[j]);
        let state = entering.narrow(0, at, a);
        let corrected = u.narrow(0, at, a) - mm(&w.narrow(0, at, a), &state);
        if j + 1 < p.active.len() {
            let next = p.active[j + 1];
            let carried = state.narrow(0, 0, next) * chunk_decay.narrow(0, at, next)
                + mm(&k_out.narrow(0, at, next), &corrected.narrow(0, 0, next));
            entering.narrow(0, offsets[j + 1], next).copy_(&carried);
        }
        v_new.narrow(0, at, a).copy_(&corrected);
    }
    // Each sequence's state after its last chunk.
    let pick = |t: &Tensor| t.index_select(0, &p.last_rows);
    let sorted_final = pick(&entering) * pick(&chunk_decay) + mm(&pick(&k_out), &pick(&v_new));
    drop((k_out, u, w));
    mark("rule: state scan");

    let states_in = entering.to_kind(kind);
    let intra = mm(&q, &kt) * &pairwise;
    let q_in = (q.to_kind(Kind::Float) * &decay_in).to_kind(kind);
    let out_chunks = mm(&q_in, &states_in) + mm(&intra.to_kind(kind), &v_new.to_kind(kind));
    let out = from_chunks(&out_chunks, p);
    mark("rule: outputs");
    let states = record.then(|| {
        // The state after position i of a chunk:
        // exp(G_i) S + sum_{j<=i} decay(j->i) k_j v_new_j^T.
        let weighted = pairwise.unsqueeze(-1) * k.to_kind(Kind::Float).unsqueeze(-3); // [C, H, L(i), L(j), dk]
        let within = weighted.transpose(-1, -2).matmul(&v_new.unsqueeze(2)); // [C, H, L, dk, dv]
        let all = decay_in.unsqueeze(-1) * entering.unsqueeze(2) + within;
        all.transpose(1, 2).reshape([p.chunks * CHUNK, h, dk, dv]).index_select(0, &p.scatter)
    });
    let final_state = sorted_final.index_select(0, &p.unsort);
    RuleOutput { out, final_state, states }
}

/// `[T, HK, d]` with each key head repeated for the `h / HK` value heads it serves.
fn matched_heads(x: &Tensor, h: i64) -> Tensor {
    let per = h / x.size()[1];
    if per == 1 { x.shallow_clone() } else { x.repeat_interleave_self_int(per, 1, None::<i64>) }
}

/// One token of the recurrence for a batch: `q`, `k` `[B, HK, dk]`, `v`
/// `[B, H, dv]`, `g`, `beta` `[B, H]`, `state` `[B, H, dk, dv]`. Returns
/// the output `[B, H, dv]` and the new state.
pub fn step(x: &RuleInputs, state: &Tensor) -> (Tensor, Tensor) {
    let _guard = tch::no_grad_guard();
    let wide = state.kind();
    let h = x.v.size()[1];
    let (q, k, v) = (matched_heads(x.q, h).to_kind(wide), matched_heads(x.k, h).to_kind(wide), x.v.to_kind(wide));
    let s = state * x.g.to_kind(wide).exp().unsqueeze(-1).unsqueeze(-1);
    let remembered = k.unsqueeze(-2).matmul(&s).squeeze_dim(-2); // S^T k: [B, H, dv]
    let delta = (v - remembered) * x.beta.to_kind(wide).unsqueeze(-1);
    let s = s + k.unsqueeze(-1) * delta.unsqueeze(-2);
    let out = q.unsqueeze(-2).matmul(&s).squeeze_dim(-2);
    (out, s)
}

/// `x * rsqrt(sum(x^2) + 1e-6)` over the last dimension, as transformers
/// and flash-linear-attention normalise q and k.
pub fn l2_normalize(x: &Tensor) -> Tensor {
    x * (x.square().sum_dim_intlist(-1, true, x.kind()) + 1e-6).rsqrt()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The definition, token by token and sequence by sequence, in f64.
    fn reference(x: &RuleInputs, lens: &[i64], initial: Option<&Tensor>) -> (Tensor, Tensor) {
        let d = |t: &Tensor| t.to_kind(Kind::Double);
        let (q, k, v, g, b) = (d(x.q), d(x.k), d(x.v), d(x.g), d(x.beta));
        let (h, dk, dv) = (k.size()[1], k.size()[2], v.size()[2]);
        let mut outs = Vec::new();
        let mut finals = Vec::new();
        let mut start = 0;
        for (si, &l) in lens.iter().enumerate() {
            let mut s = match initial {
                Some(i) => d(&i.get(si as i64)),
                None => Tensor::zeros([h, dk, dv], (Kind::Double, Device::Cpu)),
            };
            for t in start..start + l {
                let one = |x: &Tensor| x.get(t).unsqueeze(0);
                let (o, s1) = step(
                    &RuleInputs { q: &one(&q), k: &one(&k), v: &one(&v), g: &one(&g), beta: &one(&b) },
                    &s.unsqueeze(0),
                );
                s = s1.squeeze_dim(0);
                outs.push(o.squeeze_dim(0));
            }
            finals.push(s);
            start += l;
        }
        (Tensor::stack(&outs, 0), Tensor::stack(&finals, 0))
    }

    fn inputs(t: i64, h: i64, dk: i64, dv: i64) -> [Tensor; 5] {
        let f = (Kind::Float, Device::Cpu);
        let q = l2_normalize(&Tensor::randn([t, h, dk], f)) * (dk as f64).powf(-0.5);
        let k = l2_normalize(&Tensor::randn([t, h, dk], f));
        let v = Tensor::randn([t, h, dv], f);
        // Decays as the layer makes them: -A * softplus(a + dt_bias).
        let g = -(Tensor::rand([t, h], f) * 4.0 + 0.01) * (Tensor::randn([t, h], f) + 1.0).softplus();
        let beta = Tensor::randn([t, h], f).sigmoid();
        [q, k, v, g, beta]
    }

    fn rel(a: &Tensor, b: &Tensor) -> f64 {
        let a = a.to_kind(Kind::Double);
        ((a - b).abs().max() / b.abs().max()).double_value(&[])
    }

    #[test]
    fn chunked_equals_the_recurrence_on_packed_sequences_of_any_length() {
        tch::manual_seed(11);
        // Lengths inside one chunk, at a chunk's edge, across several, and
        // sequences that share no chunk: each must see only itself.
        let lens = [5i64, 64, 130, 1, 200, 63];
        let total: i64 = lens.iter().sum();
        let [q, k, v, g, beta] = inputs(total, 3, 8, 6);
        let x = RuleInputs { q: &q, k: &k, v: &v, g: &g, beta: &beta };
        let got = chunked(&x, &lens, None, true);
        let (want, want_final) = reference(&x, &lens, None);
        assert!(rel(&got.out, &want) < 1e-5, "outputs: {}", rel(&got.out, &want));
        assert!(rel(&got.final_state, &want_final) < 1e-5, "final states");
        // The recorded state after each sequence's last token is its final state.
        let states = got.states.expect("recorded");
        let mut end = 0;
        for (i, &l) in lens.iter().enumerate() {
            end += l;
            assert!(rel(&states.get(end - 1), &want_final.get(i as i64)) < 1e-5, "recorded state of sequence {i}");
        }
    }

    #[test]
    fn a_sequence_packed_with_others_gives_what_it_gives_alone() {
        tch::manual_seed(12);
        let lens = [70i64, 9, 150];
        let total: i64 = lens.iter().sum();
        let [q, k, v, g, beta] = inputs(total, 2, 4, 4);
        let x = RuleInputs { q: &q, k: &k, v: &v, g: &g, beta: &beta };
        let packed = chunked(&x, &lens, None, false).out;
        let sl = |t: &Tensor| t.narrow(0, 70, 9);
        let alone = chunked(
            &RuleInputs { q: &sl(&q), k: &sl(&k), v: &sl(&v), g: &sl(&g), beta: &sl(&beta) },
            &[9],
            None,
            false,
        )
        .out;
        assert!(rel(&packed.narrow(0, 70, 9), &alone.to_kind(Kind::Double)) < 1e-6);
    }

    #[test]
    fn an_initial_state_carries_on_where_the_prefix_left_off() {
        tch::manual_seed(13);
        let [q, k, v, g, beta] = inputs(100, 2, 4, 5);
        let x = RuleInputs { q: &q, k: &k, v: &v, g: &g, beta: &beta };
        let whole = chunked(&x, &[100], None, false);
        let head = |t: &Tensor| t.narrow(0, 0, 37);
        let tail = |t: &Tensor| t.narrow(0, 37, 63);
        let first = chunked(
            &RuleInputs { q: &head(&q), k: &head(&k), v: &head(&v), g: &head(&g), beta: &head(&beta) },
            &[37],
            None,
            false,
        );
        let rest = chunked(
            &RuleInputs { q: &tail(&q), k: &tail(&k), v: &tail(&v), g: &tail(&g), beta: &tail(&beta) },
            &[63],
            Some(&first.final_state),
            false,
        );
        assert!(rel(&rest.out, &whole.out.narrow(0, 37, 63).to_kind(Kind::Double)) < 1e-5);
        assert!(rel(&rest.final_state, &whole.final_state.to_kind(Kind::Double)) < 1e-5);
    }
}
