// The gated delta rule's chunked (WY/UT) form as three fused kernels,
// compiled at run time by NVRTC (src/delta_rule_cuda.rs) for one head shape:
//   -DDK=<key head dim> -DDV=<value head dim> -DBV=<value columns per scan block>
//   -DIN_BF16=<1: q, k, v are bf16; 0: f32>
// The math is the one of delta_rule.rs (read its docs first); every product
// is accumulated in f32 from inputs widened to f32, and the state is f32.
//
// Layout: q, k [T, HK, DK] (HK key heads, each serving H / HK value heads),
// v [T, H, DV], g (log decay) and beta [T, H] f32, all contiguous. A packed
// batch is a list of chunks of at most 64 tokens (chunk_tok: first token,
// chunk_len: tokens) in sequence order; sequence n owns the chunks
// seq_chunk0[n] .. + seq_nchunks[n]. No kernel reads across a chunk's
// tokens into another sequence, so no state leaks between sequences.
//
//  1. ut_prep  (grid chunks x heads): the chunk's decay prefix G, the UT
//     system L = I + strictly_lower(beta_i k_i.k_j exp(G_i - G_j)) and its
//     forward substitution for U = L^-1 (beta v), W = L^-1 (beta exp(G) k).
//  2. scan     (grid sequences x heads x DV/BV): the only sequential part;
//     per chunk v_new = U - W S, S' = exp(G_last) S + K_d^T v_new with
//     K_d = exp(G_last - G) k. Writes the state entering every chunk and
//     v_new (over U), and the final state.
//  3. output   (grid chunks x heads): o = exp(G) q S + (q k^T * decay, j <= i) v_new.
//
// Every product is a loop of fused multiply-adds over shared tiles whose
// rows are 16 bytes aligned (strides LP, KP): a warp's lanes take
// consecutive columns of one operand (no bank conflicts) while the other
// operand is the same for the whole warp and read four values at a time
// (broadcast vector loads), so shared memory is not what bounds them.

#define L 64
#define LP 68        // row stride of [DK][L] (transposed) and [L][L] tiles: 16-byte rows
#define KP (DK + 4)  // row stride of [L][DK] tiles

#if IN_BF16
typedef unsigned short in_t;
typedef uint2 in4_t; // four consecutive inputs
__device__ __forceinline__ float ld(const in_t* p) { return __uint_as_float(((unsigned)(*p)) << 16); }
__device__ __forceinline__ float4 widen4(in4_t v) {
    return make_float4(__uint_as_float(v.x << 16), __uint_as_float(v.x & 0xffff0000u), __uint_as_float(v.y << 16),
                       __uint_as_float(v.y & 0xffff0000u));
}
#else
typedef float in_t;
typedef float4 in4_t;
__device__ __forceinline__ float ld(const in_t* p) { return *p; }
__device__ __forceinline__ float4 widen4(in4_t v) { return v; }
#endif

typedef long long i64;

__device__ __forceinline__ float4 ld4(const float* p) { return *reinterpret_cast<const float4*>(p); }

// Loads the chunk's G (prefix sums of g; padding rows repeat the last) into
// Gs[L]: the loads in parallel, the sum by one thread from shared memory
// (in order, as a cumulative sum does it). Ends with a barrier.
__device__ __forceinline__ void load_decay(const float* __restrict__ g, i64 t0, int len, int H, int h, float* Gs) {
    for (int i = threadIdx.x; i < L; i += blockDim.x) Gs[i] = i < len ? g[(t0 + i) * H + h] : 0.f;
    __syncthreads();
    if (threadIdx.x == 0) {
        float acc = 0.f;
        for (int i = 0; i < L; i++) {
            acc += Gs[i];
            Gs[i] = acc;
        }
    }
    __syncthreads();
}

// Rows of a [T, heads, DK] input, transposed into a shared [DK][LP] tile
// (tile[d * LP + i] = x[t0 + i, head, d]), zero past len. 256 threads, four
// elements a load, every load of a thread issued before its stores.
__device__ __forceinline__ void load_cols(const in_t* __restrict__ x, i64 t0, int len, int heads, int head, float* tile) {
    constexpr int VECS = L * DK / 4;
#pragma unroll
    for (int p = 0; p < (VECS + 255) / 256; p++) {
        const int e = (threadIdx.x + p * 256) * 4;
        if (e < L * DK) {
            const int i = e / DK, d = e - i * DK;
            in4_t zero = {};
            const float4 v = widen4(i < len ? *reinterpret_cast<const in4_t*>(x + ((t0 + i) * heads + head) * DK + d) : zero);
            tile[d * LP + i] = v.x;
            tile[(d + 1) * LP + i] = v.y;
            tile[(d + 2) * LP + i] = v.z;
            tile[(d + 3) * LP + i] = v.w;
        }
    }
}

// With 256 threads: thread (b = t % 64, a = t / 64 * 16 + m for m < 16)
// gets acc[m] = sum_d aT[d][a] bT[d][b] (both [DK][LP] tiles): the b operand
// is one load per lane, the a operand four broadcast vector loads.
__device__ __forceinline__ void gram16(const float* aT, const float* bT, float acc[16]) {
    const int b = threadIdx.x % L, a0 = threadIdx.x / L * 16;
#pragma unroll
    for (int m = 0; m < 16; m++) acc[m] = 0.f;
#pragma unroll 4
    for (int d = 0; d < DK; d++) {
        const float vb = bT[d * LP + b];
#pragma unroll
        for (int q = 0; q < 4; q++) {
            const float4 va = ld4(aT + d * LP + a0 + 4 * q);
            acc[4 * q] += va.x * vb;
            acc[4 * q + 1] += va.y * vb;
            acc[4 * q + 2] += va.z * vb;
            acc[4 * q + 3] += va.w * vb;
        }
    }
}

// Block: 256 threads.
extern "C" __global__ void __launch_bounds__(256, 2) ut_prep(const in_t* __restrict__ k, const in_t* __restrict__ v,
                                   const float* __restrict__ g, const float* __restrict__ beta,
                                   const i64* __restrict__ chunk_tok, const i64* __restrict__ chunk_len, int H, int HK,
                                   float* __restrict__ U, float* __restrict__ W, float* __restrict__ Gc) {
    extern __shared__ float4 smem4[];
    float* kT = (float*)smem4; // [DK][LP]
    float* A = kT + DK * LP;   // [L][LP]: A[i][j]
    float* Gs = A + L * LP;    // [L]
    float* Bs = Gs + L;        // [L]
    const int c = blockIdx.x, h = blockIdx.y, kh = h / (H / HK);
    const i64 t0 = chunk_tok[c];
    const int len = (int)chunk_len[c];
    const i64 base = (i64)c * H + h;
    for (int i = threadIdx.x; i < L; i += blockDim.x) Bs[i] = i < len ? beta[(t0 + i) * H + h] : 0.f;
    load_cols(k, t0, len, HK, kh, kT);
    load_decay(g, t0, len, H, h, Gs); // ends with a barrier
    {
        float acc[16];
        gram16(kT, kT, acc); // acc[m] = k_i . k_j, i = t / 64 * 16 + m, j = t % 64
        const int j = threadIdx.x % L, i0 = threadIdx.x / L * 16;
#pragma unroll
        for (int m = 0; m < 16; m++) {
            const int i = i0 + m;
            A[i * LP + j] = j < i ? Bs[i] * expf(Gs[i] - Gs[j]) * acc[m] : 0.f;
        }
    }
    for (int i = threadIdx.x; i < L; i += blockDim.x) Gc[base * L + i] = Gs[i];
    __syncthreads();
    // Forward substitution, one right-hand column per thread, held in
    // registers (loaded first, then solved in place: x[j < i] are final
    // when row i is reached); the row of A read four entries at a time
    // (broadcast).
    for (int col = threadIdx.x; col < DV + DK; col += blockDim.x) {
        float x[L];
        const bool is_v = col < DV;
        const in_t* src = is_v ? v + (t0 * H + h) * DV + col : k + (t0 * HK + kh) * DK + col - DV;
        const i64 stride = is_v ? (i64)H * DV : (i64)HK * DK;
#pragma unroll
        for (int i = 0; i < L; i++) {
            const float b = is_v ? Bs[i] : Bs[i] * expf(Gs[i]);
            x[i] = i < len ? b * ld(src + i * stride) : 0.f;
        }
#pragma unroll
        for (int i = 1; i < L; i++) {
            // Keeps each row's loads of A in its row: hoisted all at once
            // they exceed the registers and spill (ptxas -v showed 8 KB).
            asm volatile("" ::: "memory");
            float r = x[i];
            const float* a = A + i * LP;
#pragma unroll
            for (int j = 0; j + 4 <= i; j += 4) {
                if (j % 16 == 0) asm volatile("" ::: "memory");
                const float4 a4 = ld4(a + j);
                r -= a4.x * x[j];
                r -= a4.y * x[j + 1];
                r -= a4.z * x[j + 2];
                r -= a4.w * x[j + 3];
            }
#pragma unroll
            for (int j = i / 4 * 4; j < i; j++) r -= a[j] * x[j];
            x[i] = r;
        }
        if (is_v) {
            float* out = U + base * L * DV + col;
#pragma unroll
            for (int i = 0; i < L; i++) out[i * DV] = x[i];
        } else {
            float* out = W + base * L * DK + (col - DV);
#pragma unroll
            for (int i = 0; i < L; i++) out[i * DK] = x[i];
        }
    }
}

// Block: BV * 8 threads; thread (c = t % BV, grp = t / BV) owns value column
// c0 + c and, of the state, rows grp * DK/8 .. (+DK/8); of a chunk's v_new,
// rows grp * 8 .. + 8. Row operands are read four at a time (broadcast).
extern "C" __global__ void __launch_bounds__(256, 2) scan(const in_t* __restrict__ k, float* __restrict__ U, const float* __restrict__ W,
                                const float* __restrict__ Gc, const i64* __restrict__ chunk_tok,
                                const i64* __restrict__ chunk_len, const i64* __restrict__ seq_chunk0,
                                const i64* __restrict__ seq_nchunks, const float* __restrict__ init, int H, int HK,
                                float* __restrict__ S_in, float* __restrict__ S_final) {
    constexpr int RV = L / 8;
    constexpr int RS = DK / 8;
    extern __shared__ float4 smem4[];
    float* Ws = (float*)smem4; // [L][KP]
    float* Kd = Ws + L * KP;   // [L][KP]
    float* Ss = Kd + L * KP;   // [DK][BV]
    float* Vn = Ss + DK * BV;  // [L][BV]
    float* Gs = Vn + L * BV;   // [L]
    const int n = blockIdx.x, h = blockIdx.y, c0 = blockIdx.z * BV, kh = h / (H / HK);
    const int c = threadIdx.x % BV, grp = threadIdx.x / BV;
    float s[RS];
#pragma unroll
    for (int m = 0; m < RS; m++) {
        int r = grp * RS + m;
        s[m] = init ? init[(((i64)n * H + h) * DK + r) * DV + c0 + c] : 0.f;
        Ss[r * BV + c] = s[m];
    }
    const i64 first = seq_chunk0[n];
    const int count = (int)seq_nchunks[n];
    // A chunk's inputs reach registers one chunk ahead, so that their
    // latency overlaps the products of the chunk before (loaded just in
    // time, each chunk waited for its loads: the scan ran 4 ms a layer).
    constexpr int NT = BV * 8;
    constexpr int PER = L * DK / 4 / NT; // four-element vectors of W and k per thread
    float4 wv[PER];
    in4_t kv[PER];
    float uv[RV], gv = 0.f;
    auto fetch = [&](int q) {
        const i64 ch = first + q;
        const i64 t0 = chunk_tok[ch];
        const int len = (int)chunk_len[ch];
        const i64 base = ch * H + h;
#pragma unroll
        for (int p = 0; p < PER; p++) {
            const int e = (threadIdx.x + p * NT) * 4, i = e / DK, d = e - i * DK;
            wv[p] = ld4(W + (base * L + i) * DK + d);
            in4_t zero = {};
            kv[p] = i < len ? *reinterpret_cast<const in4_t*>(k + ((t0 + i) * HK + kh) * DK + d) : zero;
        }
#pragma unroll
        for (int m = 0; m < RV; m++) uv[m] = U[(base * L + grp * RV + m) * DV + c0 + c];
        if (threadIdx.x < L) gv = Gc[base * L + threadIdx.x];
    };
    if (count > 0) fetch(0);
    for (int q = 0; q < count; q++) {
        const i64 base = (first + q) * H + h;
#pragma unroll
        for (int m = 0; m < RS; m++) S_in[(base * DK + grp * RS + m) * DV + c0 + c] = s[m];
        if (threadIdx.x < L) Gs[threadIdx.x] = gv;
        __syncthreads();
        const float glast = Gs[L - 1];
#pragma unroll
        for (int p = 0; p < PER; p++) {
            const int e = (threadIdx.x + p * NT) * 4, i = e / DK, d = e - i * DK;
            *reinterpret_cast<float4*>(Ws + i * KP + d) = wv[p];
            const float decay = expf(glast - Gs[i]);
            float4 k4 = widen4(kv[p]); // zero past the chunk's tokens
            k4.x *= decay;
            k4.y *= decay;
            k4.z *= decay;
            k4.w *= decay;
            *reinterpret_cast<float4*>(Kd + i * KP + d) = k4;
        }
        float acc[RV];
#pragma unroll
        for (int m = 0; m < RV; m++) acc[m] = uv[m];
        __syncthreads();
        if (q + 1 < count) fetch(q + 1);
        // v_new = U - W S
#pragma unroll 2
        for (int r = 0; r < DK; r += 4) {
            const float s0 = Ss[r * BV + c], s1 = Ss[(r + 1) * BV + c], s2 = Ss[(r + 2) * BV + c],
                        s3 = Ss[(r + 3) * BV + c];
#pragma unroll
            for (int m = 0; m < RV; m++) {
                const float4 w = ld4(Ws + (grp * RV + m) * KP + r);
                acc[m] -= w.x * s0;
                acc[m] -= w.y * s1;
                acc[m] -= w.z * s2;
                acc[m] -= w.w * s3;
            }
        }
#pragma unroll
        for (int m = 0; m < RV; m++) {
            Vn[(grp * RV + m) * BV + c] = acc[m];
            U[(base * L + grp * RV + m) * DV + c0 + c] = acc[m];
        }
        __syncthreads();
        // S = exp(G_last) S + K_d^T v_new
        const float decay = expf(glast);
#pragma unroll
        for (int m = 0; m < RS; m++) s[m] *= decay;
#pragma unroll 4
        for (int i = 0; i < L; i++) {
            const float vv = Vn[i * BV + c];
            const float* kd = Kd + i * KP + grp * RS;
            if constexpr (RS % 4 == 0) {
#pragma unroll
                for (int m = 0; m < RS; m += 4) {
                    const float4 k4 = ld4(kd + m);
                    s[m] += k4.x * vv;
                    s[m + 1] += k4.y * vv;
                    s[m + 2] += k4.z * vv;
                    s[m + 3] += k4.w * vv;
                }
            } else {
#pragma unroll
                for (int m = 0; m < RS; m++) s[m] += kd[m] * vv;
            }
        }
#pragma unroll
        for (int m = 0; m < RS; m++) Ss[(grp * RS + m) * BV + c] = s[m];
        __syncthreads();
    }
#pragma unroll
    for (int m = 0; m < RS; m++) S_final[(((i64)n * H + h) * DK + grp * RS + m) * DV + c0 + c] = s[m];
}

// Block: 256 threads; thread (col = t % DV, grp = t / DV) owns output column
// col for rows grp * OR .. + OR.
extern "C" __global__ void output(const in_t* __restrict__ q, const in_t* __restrict__ k,
                                  const float* __restrict__ Vnew, const float* __restrict__ Gc,
                                  const float* __restrict__ S_in, const i64* __restrict__ chunk_tok,
                                  const i64* __restrict__ chunk_len, int H, int HK, float* __restrict__ out) {
    constexpr int GROUPS = 256 / DV;
    constexpr int OR = L / GROUPS;
    extern __shared__ float4 smem4[];
    float* qT = (float*)smem4; // [DK][LP]
    float* kT = qT + DK * LP;  // [DK][LP]
    float* PT = kT + DK * LP;  // [L][LP]: PT[j][i] = (q_i . k_j) exp(G_i - G_j), j <= i
    float* Gs = PT + L * LP;   // [L]
    const int c = blockIdx.x, h = blockIdx.y, kh = h / (H / HK);
    const i64 t0 = chunk_tok[c];
    const int len = (int)chunk_len[c];
    const i64 base = (i64)c * H + h;
    for (int i = threadIdx.x; i < L; i += blockDim.x) Gs[i] = Gc[base * L + i];
    load_cols(q, t0, len, HK, kh, qT);
    load_cols(k, t0, len, HK, kh, kT);
    __syncthreads();
    {
        float acc[16];
        gram16(kT, qT, acc); // acc[m] = k_j . q_i, j = t / 64 * 16 + m, i = t % 64
        const int i = threadIdx.x % L, j0 = threadIdx.x / L * 16;
#pragma unroll
        for (int m = 0; m < 16; m++) {
            const int j = j0 + m;
            PT[j * LP + i] = j <= i ? acc[m] * expf(Gs[i] - Gs[j]) : 0.f;
        }
    }
    __syncthreads();
    const int col = threadIdx.x % DV, i0 = threadIdx.x / DV * OR;
    float acc[OR];
#pragma unroll
    for (int m = 0; m < OR; m++) acc[m] = 0.f;
    // exp(G) q S_in, then the chunk's own tokens: PT^T v_new.
    const float* S = S_in + base * DK * DV + col;
#pragma unroll 4
    for (int r = 0; r < DK; r++) {
        const float sv = S[r * DV];
        const float* qr = qT + r * LP + i0;
        if constexpr (OR % 4 == 0) {
#pragma unroll
            for (int m = 0; m < OR; m += 4) {
                const float4 q4 = ld4(qr + m);
                acc[m] += q4.x * sv;
                acc[m + 1] += q4.y * sv;
                acc[m + 2] += q4.z * sv;
                acc[m + 3] += q4.w * sv;
            }
        } else {
#pragma unroll
            for (int m = 0; m < OR; m++) acc[m] += qr[m] * sv;
        }
    }
#pragma unroll
    for (int m = 0; m < OR; m++) acc[m] *= expf(Gs[i0 + m]);
    const float* V = Vnew + base * L * DV + col;
#pragma unroll 4
    for (int j = 0; j < L; j++) {
        const float vv = V[j * DV];
        const float* pj = PT + j * LP + i0;
        if constexpr (OR % 4 == 0) {
#pragma unroll
            for (int m = 0; m < OR; m += 4) {
                const float4 p4 = ld4(pj + m);
                acc[m] += p4.x * vv;
                acc[m + 1] += p4.y * vv;
                acc[m + 2] += p4.z * vv;
                acc[m + 3] += p4.w * vv;
            }
        } else {
#pragma unroll
            for (int m = 0; m < OR; m++) acc[m] += pj[m] * vv;
        }
    }
#pragma unroll
    for (int m = 0; m < OR; m++) {
        int i = i0 + m;
        if (i < len) out[((t0 + i) * H + h) * DV + col] = acc[m];
    }
}

#if IN_BF16
// Round to nearest even (NaN and Inf stay NaN and Inf).
__device__ __forceinline__ in_t st(float f) {
    unsigned b = __float_as_uint(f);
    return (in_t)((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
}
#else
__device__ __forceinline__ in_t st(float f) { return f; }
#endif

// f rounded to the input kind and widened back (what a libtorch op in that
// kind leaves for the next one).
__device__ __forceinline__ float rd(float f) {
#if IN_BF16
    return __uint_as_float(((unsigned)st(f)) << 16);
#else
    return f;
#endif
}

// The layer's causal depthwise convolution and SiLU over packed sequences,
// before the rule: y[t, c] = silu(sum_{b <= pos[t], b < K} x[t - b, c] w[c, K-1-b]),
// x rows `stride` apart (a slice of the input projection), pos the token's
// position in its sequence (taps never reach into the sequence before).
// Summed in f32, rounded to the input kind before the SiLU (as the ops path).
extern "C" __global__ void causal_conv_silu(const in_t* __restrict__ x, i64 stride, const in_t* __restrict__ w,
                                            const i64* __restrict__ pos, i64 T, int C, int K,
                                            in_t* __restrict__ y) {
    // One block per token (no 64-bit division per element), its threads
    // across the channels.
    const i64 t = blockIdx.x;
    if (t >= T) return;
    const i64 p = pos[t];
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        float acc = 0.f;
        for (int b = 0; b < K && b <= p; b++) acc += ld(x + (t - b) * stride + c) * ld(w + (i64)c * K + K - 1 - b);
        in_t r = st(acc);
        float a = ld(&r);
        y[t * C + c] = st(a / (1.f + expf(-a)));
    }
}

// The rule's inputs from the convolved channels, one warp per (token, head,
// q or k): q and k L2-normalised in f32 (x rsqrt(sum x^2 + 1e-6), q also
// scaled), stored in the input kind as [T, HK, DK] each. `conv` rows are
// `stride` apart, q at channel 0, k at HK * DK.
extern "C" __global__ void qk_norm(const in_t* __restrict__ conv, i64 stride, i64 T, int HK, float q_scale,
                                   in_t* __restrict__ q_out, in_t* __restrict__ k_out) {
    constexpr int PER = (DK + 31) / 32;
    const i64 w = ((i64)blockIdx.x * blockDim.x + threadIdx.x) / 32;
    const int lane = threadIdx.x % 32;
    if (w >= T * 2 * HK) return; // whole warps
    const i64 t = w / (2 * HK);
    const int r = (int)(w - t * 2 * HK);
    const bool is_q = r < HK;
    const int head = is_q ? r : r - HK;
    const in_t* src = conv + t * stride + (is_q ? 0 : HK * DK) + head * DK;
    float v[PER];
    float ss = 0.f;
#pragma unroll
    for (int i = 0; i < PER; i++) {
        const int d = lane + 32 * i;
        v[i] = d < DK ? ld(src + d) : 0.f;
        ss += v[i] * v[i];
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    const float inv = rsqrtf(ss + 1e-6f);
    in_t* dst = (is_q ? q_out : k_out) + (t * HK + head) * DK;
#pragma unroll
    for (int i = 0; i < PER; i++) {
        const int d = lane + 32 * i;
        if (d < DK) dst[d] = st(is_q ? v[i] * inv * q_scale : v[i] * inv);
    }
}

// The rule's gates per (token, value head), f32: g = neg_a * softplus(a +
// dt_bias) (softplus linear above 20, as torch's), beta = sigmoid(b); a and
// b are columns of the projection rows (`stride` apart).
extern "C" __global__ void gates(const in_t* __restrict__ proj, i64 stride, i64 b_col, i64 a_col, i64 T, int NV,
                                 const float* __restrict__ neg_a, const float* __restrict__ dt_bias,
                                 float* __restrict__ g, float* __restrict__ beta) {
    const i64 t = blockIdx.x;
    if (t >= T) return;
    for (int h = threadIdx.x; h < NV; h += blockDim.x) {
        const float b = ld(proj + t * stride + b_col + h);
        const float a = ld(proj + t * stride + a_col + h) + dt_bias[h];
        const float sp = a > 20.f ? a : log1pf(expf(a));
        g[t * NV + h] = sp * neg_a[h];
        beta[t * NV + h] = 1.f / (1.f + expf(-b));
    }
}

// The rule's output normalised per (token, value head) and gated by
// silu(z), one warp per row, rounded as the libtorch ops it replaces round
// (rms_norm in f32, then the input kind for each product):
//   y = rd(rd(x * rsqrt(mean(x^2) + eps)) * w) * rd(silu(z))
// `out` [T, NV, DV] f32 contiguous; z at column z_col of the projection
// rows (`stride` apart, value head h at z_col + h * DV); w [DV] in the
// input kind; y [T, NV * DV] in the input kind.
extern "C" __global__ void gated_norm(const float* __restrict__ out, const in_t* __restrict__ proj, i64 stride,
                                      i64 z_col, i64 T, int NV, const in_t* __restrict__ w, float eps,
                                      in_t* __restrict__ y) {
    constexpr int PER = (DV + 31) / 32;
    const i64 r = ((i64)blockIdx.x * blockDim.x + threadIdx.x) / 32;
    const int lane = threadIdx.x % 32;
    if (r >= T * NV) return; // whole warps
    const i64 t = r / NV;
    const int h = (int)(r - t * NV);
    const float* src = out + r * DV;
    float v[PER];
    float ss = 0.f;
#pragma unroll
    for (int i = 0; i < PER; i++) {
        const int d = lane + 32 * i;
        v[i] = d < DV ? src[d] : 0.f;
        ss += v[i] * v[i];
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    const float inv = rsqrtf(ss / DV + eps);
    const in_t* z = proj + t * stride + z_col + (i64)h * DV;
    in_t* dst = y + r * DV;
#pragma unroll
    for (int i = 0; i < PER; i++) {
        const int d = lane + 32 * i;
        if (d < DV) {
            const float zz = ld(z + d);
            const float gate = rd(zz / (1.f + expf(-zz)));
            dst[d] = st(rd(rd(v[i] * inv) * ld(w + d)) * gate);
        }
    }
}
