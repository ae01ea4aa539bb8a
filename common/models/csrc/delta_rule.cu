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
//  2. scan     (grid heads x DV/BV by sequences, the sequences from the most
//     chunks to the fewest, so that the longest start first and the rest
//     fill in around them): the only sequential part;
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

// The chunk's G (prefix sums of g; padding rows repeat the last) into
// Gs[L], from gi = g of token threadIdx.x (fetch_decay: zero past len): the
// sum by one thread from shared memory, in order, as a cumulative sum does
// it. Starts and ends with a barrier.
__device__ __forceinline__ float fetch_decay(const float* __restrict__ g, i64 t0, int len, int H, int h) {
    return threadIdx.x < len ? g[(t0 + threadIdx.x) * H + h] : 0.f;
}

__device__ __forceinline__ void decay_prefix(float gi, float* Gs) {
    if (threadIdx.x < L) Gs[threadIdx.x] = gi;
    __syncthreads();
    if (threadIdx.x == 0) {
        // All loads first (each store would otherwise wait for its load),
        // then the sum in order.
        float v[L];
#pragma unroll
        for (int i = 0; i < L; i++) v[i] = Gs[i];
        float acc = 0.f;
#pragma unroll
        for (int i = 0; i < L; i++) {
            acc += v[i];
            Gs[i] = acc;
        }
    }
    __syncthreads();
}

__device__ __forceinline__ void load_decay(const float* __restrict__ g, i64 t0, int len, int H, int h, float* Gs) {
    decay_prefix(fetch_decay(g, t0, len, H, h), Gs);
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
                                const i64* __restrict__ seq_nchunks, const i64* __restrict__ seq_order,
                                const float* __restrict__ init, int H, int HK, float* __restrict__ S_in,
                                float* __restrict__ S_final) {
    constexpr int RV = L / 8;
    constexpr int RS = DK / 8;
    extern __shared__ float4 smem4[];
    float* Ws = (float*)smem4; // [L][KP]
    float* Kd = Ws + L * KP;   // [L][KP]
    float* Ss = Kd + L * KP;   // [DK][BV]
    float* Vn = Ss + DK * BV;  // [L][BV]
    float* Gs = Vn + L * BV;   // [L]
    const int n = (int)seq_order[blockIdx.y], h = blockIdx.x / (DV / BV), c0 = blockIdx.x % (DV / BV) * BV;
    const int kh = h / (H / HK);
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

#if TC
// The rule's products on tensor cores (mma.sync m16n8k8, tf32 operands, f32
// accumulators), written for dk a multiple of 32 up to 128 and dv a multiple
// of 32 (-DTC=1; the host enables them for dk = dv = 128, the shape of every
// published hybrid and the one tested on a GPU). With f32 inputs each operand is
// split into a tf32 high part and a tf32 remainder and three products are
// summed (the "3xTF32" scheme), which keeps f32 accuracy; with bf16 inputs
// one tf32 product (10 mantissa bits: finer than the bf16 outputs the layer
// rounds to, and than the bf16 products flash-linear-attention uses).
//
// Fragments (PTX ISA, "Matrix Fragments for mma.m16n8k8", .tf32), with
// g = lane / 4 and t = lane % 4: A (16 x 8) a0 (g, t), a1 (g + 8, t),
// a2 (g, t + 4), a3 (g + 8, t + 4); B (8 x 8) b0 (t, g), b1 (t + 4, g);
// C (16 x 8) c0 (g, 2t), c1 (g, 2t + 1), c2 (g + 8, 2t), c3 (g + 8, 2t + 1).
// Shared row strides are padded so that each fragment load of a warp hits
// 32 distinct banks.
#define SPLIT (!IN_BF16)

__device__ __forceinline__ unsigned tf32(float x) {
    unsigned r;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
    return r;
}

template <int N> struct Frag {
    unsigned hi[N];
    unsigned lo[N]; // unused (and dropped by the compiler) without SPLIT
    __device__ __forceinline__ void set(int i, float x) {
        hi[i] = tf32(x);
        if (SPLIT) lo[i] = tf32(x - __uint_as_float(hi[i]));
    }
};

__device__ __forceinline__ void mma1(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// d += a b (the remainders' products first, the large one last).
__device__ __forceinline__ void mma(float (&d)[4], const Frag<4>& a, const Frag<2>& b) {
    if (SPLIT) {
        mma1(d, a.lo, b.hi);
        mma1(d, a.hi, b.lo);
    }
    mma1(d, a.hi, b.hi);
}

// A fragment of a row-major tile (rows r0.., columns k0..; row stride ld).
__device__ __forceinline__ Frag<4> frag_a(const float* m, int ld, int r0, int k0) {
    const int g = (threadIdx.x % 32) / 4, t = threadIdx.x % 4;
    Frag<4> a;
    a.set(0, m[(r0 + g) * ld + k0 + t]);
    a.set(1, m[(r0 + g + 8) * ld + k0 + t]);
    a.set(2, m[(r0 + g) * ld + k0 + t + 4]);
    a.set(3, m[(r0 + g + 8) * ld + k0 + t + 4]);
    return a;
}

// A fragment of the transpose of a row-major tile: A[r][k] = m[k][r].
__device__ __forceinline__ Frag<4> frag_at(const float* m, int ld, int r0, int k0) {
    const int g = (threadIdx.x % 32) / 4, t = threadIdx.x % 4;
    Frag<4> a;
    a.set(0, m[(k0 + t) * ld + r0 + g]);
    a.set(1, m[(k0 + t) * ld + r0 + g + 8]);
    a.set(2, m[(k0 + t + 4) * ld + r0 + g]);
    a.set(3, m[(k0 + t + 4) * ld + r0 + g + 8]);
    return a;
}

// B fragment of a row-major [K][N] matrix (rows k0.., columns n0..).
__device__ __forceinline__ Frag<2> frag_b(const float* m, i64 ld, int k0, int n0) {
    const int g = (threadIdx.x % 32) / 4, t = threadIdx.x % 4;
    Frag<2> b;
    b.set(0, m[(k0 + t) * ld + n0 + g]);
    b.set(1, m[(k0 + t + 4) * ld + n0 + g]);
    return b;
}

// B fragment of the transpose of a row-major [N][K] matrix: B[k][n] = m[n][k].
__device__ __forceinline__ Frag<2> frag_bt(const float* m, int ld, int k0, int n0) {
    const int g = (threadIdx.x % 32) / 4, t = threadIdx.x % 4;
    Frag<2> b;
    b.set(0, m[(n0 + g) * ld + k0 + t]);
    b.set(1, m[(n0 + g) * ld + k0 + t + 4]);
    return b;
}

// The scan of `scan` above with its two products per chunk on tensor cores.
// Block: 256 threads (8 warps), BV = 32 value columns. The state [DK][BV]
// stays in f32 accumulator registers across the chunks: warp w holds tiles
// w * SPW .. + SPW of it (16 x 8 each, row-major order over the tiles).
extern "C" __global__ void __launch_bounds__(256, 2) scan_tc(
    const in_t* __restrict__ k, float* __restrict__ U, const float* __restrict__ W, const float* __restrict__ Gc,
    const i64* __restrict__ chunk_tok, const i64* __restrict__ chunk_len, const i64* __restrict__ seq_chunk0,
    const i64* __restrict__ seq_nchunks, const i64* __restrict__ seq_order, const float* __restrict__ init, int H,
    int HK, float* __restrict__ S_in, float* __restrict__ S_final) {
    constexpr int WP = DK + 4;              // Ws rows
    constexpr int KDP = DK + 8;             // Kd rows (read transposed)
    constexpr int SP = BV + 8;              // Ss and Vn rows (read as B)
    constexpr int NB = BV / 8;              // column tiles
    constexpr int SPW = DK / 16 * NB / 8;   // state tiles per warp
    extern __shared__ float4 smem4[];
    float* Ws = (float*)smem4; // [L][WP]
    float* Kd = Ws + L * WP;   // [L][KDP]
    float* Ss = Kd + L * KDP;  // [DK][SP]
    float* Vn = Ss + DK * SP;  // [L][SP]
    float* Gs = Vn + L * SP;   // [L]
    const int n = (int)seq_order[blockIdx.y], h = blockIdx.x / (DV / BV), c0 = blockIdx.x % (DV / BV) * BV;
    const int kh = h / (H / HK);
    const int warp = threadIdx.x / 32, g = (threadIdx.x % 32) / 4, t4 = threadIdx.x % 4;
    const i64 state0 = ((i64)n * H + h) * DK * DV + c0;
    float st[SPW][4];
#pragma unroll
    for (int j = 0; j < SPW; j++) {
        const int tile = warp * SPW + j, r = tile / NB * 16 + g, c = tile % NB * 8 + 2 * t4;
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int rr = r + (e / 2) * 8, cc = c + e % 2;
            st[j][e] = init ? init[state0 + (i64)rr * DV + cc] : 0.f;
        }
    }
    // v_new's tiles of this warp: rows m1 * 16.., columns (n1 + jn) * 8...
    const int m1 = warp / 2, n1 = (warp % 2) * 2;
    const i64 first = seq_chunk0[n];
    const int count = (int)seq_nchunks[n];
    constexpr int PER = L * DK / 4 / 256; // four-element vectors of W and k per thread
    float4 wv[PER];
    in4_t kv[PER];
    float uv[2][4], gv = 0.f;
    auto fetch = [&](int q) {
        const i64 ch = first + q;
        const i64 t0 = chunk_tok[ch];
        const int len = (int)chunk_len[ch];
        const i64 base = ch * H + h;
#pragma unroll
        for (int p = 0; p < PER; p++) {
            const int e = (threadIdx.x + p * 256) * 4, i = e / DK, d = e - i * DK;
            wv[p] = ld4(W + (base * L + i) * DK + d);
            in4_t zero = {};
            kv[p] = i < len ? *reinterpret_cast<const in4_t*>(k + ((t0 + i) * HK + kh) * DK + d) : zero;
        }
#pragma unroll
        for (int jn = 0; jn < 2; jn++) {
            const float* u = U + (base * L + m1 * 16 + g) * DV + c0 + (n1 + jn) * 8 + 2 * t4;
            const float2 a = *reinterpret_cast<const float2*>(u), b = *reinterpret_cast<const float2*>(u + 8 * DV);
            uv[jn][0] = a.x, uv[jn][1] = a.y, uv[jn][2] = b.x, uv[jn][3] = b.y;
        }
        if (threadIdx.x < L) gv = Gc[base * L + threadIdx.x];
    };
    if (count > 0) fetch(0);
    for (int q = 0; q < count; q++) {
        const i64 base = (first + q) * H + h;
        // The state entering the chunk: to S_in, and to Ss for v_new.
#pragma unroll
        for (int j = 0; j < SPW; j++) {
            const int tile = warp * SPW + j, r = tile / NB * 16 + g, c = tile % NB * 8 + 2 * t4;
            float* out = S_in + base * DK * DV + c0;
            *reinterpret_cast<float2*>(out + (i64)r * DV + c) = make_float2(st[j][0], st[j][1]);
            *reinterpret_cast<float2*>(out + (i64)(r + 8) * DV + c) = make_float2(st[j][2], st[j][3]);
            *reinterpret_cast<float2*>(Ss + r * SP + c) = make_float2(st[j][0], st[j][1]);
            *reinterpret_cast<float2*>(Ss + (r + 8) * SP + c) = make_float2(st[j][2], st[j][3]);
        }
        if (threadIdx.x < L) Gs[threadIdx.x] = gv;
        __syncthreads();
        const float glast = Gs[L - 1];
#pragma unroll
        for (int p = 0; p < PER; p++) {
            const int e = (threadIdx.x + p * 256) * 4, i = e / DK, d = e - i * DK;
            *reinterpret_cast<float4*>(Ws + i * WP + d) = wv[p];
            const float decay = expf(glast - Gs[i]);
            float4 k4 = widen4(kv[p]); // zero past the chunk's tokens
            k4.x *= decay;
            k4.y *= decay;
            k4.z *= decay;
            k4.w *= decay;
            *reinterpret_cast<float4*>(Kd + i * KDP + d) = k4;
        }
        float ws[2][4] = {};
        float u[2][4];
#pragma unroll
        for (int jn = 0; jn < 2; jn++)
#pragma unroll
            for (int e = 0; e < 4; e++) u[jn][e] = uv[jn][e];
        __syncthreads();
        if (q + 1 < count) fetch(q + 1);
        // v_new = U - W S
#pragma unroll 4
        for (int k0 = 0; k0 < DK; k0 += 8) {
            const Frag<4> a = frag_a(Ws, WP, m1 * 16, k0);
#pragma unroll
            for (int jn = 0; jn < 2; jn++) mma(ws[jn], a, frag_b(Ss, SP, k0, (n1 + jn) * 8));
        }
#pragma unroll
        for (int jn = 0; jn < 2; jn++) {
            const int r = m1 * 16 + g, c = (n1 + jn) * 8 + 2 * t4;
            const float2 top = make_float2(u[jn][0] - ws[jn][0], u[jn][1] - ws[jn][1]);
            const float2 bottom = make_float2(u[jn][2] - ws[jn][2], u[jn][3] - ws[jn][3]);
            *reinterpret_cast<float2*>(Vn + r * SP + c) = top;
            *reinterpret_cast<float2*>(Vn + (r + 8) * SP + c) = bottom;
            float* out = U + (base * L + r) * DV + c0 + c;
            *reinterpret_cast<float2*>(out) = top;
            *reinterpret_cast<float2*>(out + 8 * DV) = bottom;
        }
        __syncthreads();
        // S = exp(G_last) S + K_d^T v_new. (The next chunk's writes of Ss,
        // Gs, Ws and Kd come after its first barrier, which every warp
        // reaches only past these reads.)
        const float decay = expf(glast);
#pragma unroll
        for (int j = 0; j < SPW; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) st[j][e] *= decay;
#pragma unroll 2
        for (int k0 = 0; k0 < L; k0 += 8) {
#pragma unroll
            for (int j = 0; j < SPW; j++) {
                const int tile = warp * SPW + j;
                mma(st[j], frag_at(Kd, KDP, tile / NB * 16, k0), frag_b(Vn, SP, k0, tile % NB * 8));
            }
        }
    }
#pragma unroll
    for (int j = 0; j < SPW; j++) {
        const int tile = warp * SPW + j, r = tile / NB * 16 + g, c = tile % NB * 8 + 2 * t4;
        float* out = S_final + state0;
        *reinterpret_cast<float2*>(out + (i64)r * DV + c) = make_float2(st[j][0], st[j][1]);
        *reinterpret_cast<float2*>(out + (i64)(r + 8) * DV + c) = make_float2(st[j][2], st[j][3]);
    }
}

// Rows of a [T, heads, N] input for a shared row-major [L][ld] tile, zero
// past len, in two steps: fetch() issues every load of the tile into
// registers, store() widens them into the tile. A block fetches all its
// tiles before it stores any, so that all its loads are in flight at once
// (a store waits for its load: loading and storing row by row left a block
// one load deep, latency-bound at a fraction of the memory's bandwidth).
// 256 threads, four elements a load.
template <int N> struct RowTile {
    static constexpr int P = (L * N / 4 + 255) / 256;
    in4_t r[P];
    __device__ __forceinline__ void fetch(const in_t* __restrict__ x, i64 t0, int len, int heads, int head) {
#pragma unroll
        for (int p = 0; p < P; p++) {
            const int e = (threadIdx.x + p * 256) * 4, i = e / N, d = e - i * N;
            in4_t zero = {};
            r[p] = e < L * N && i < len ? *reinterpret_cast<const in4_t*>(x + ((t0 + i) * heads + head) * N + d) : zero;
        }
    }
    __device__ __forceinline__ void store(float* tile, int ld) const {
#pragma unroll
        for (int p = 0; p < P; p++) {
            const int e = (threadIdx.x + p * 256) * 4, i = e / N, d = e - i * N;
            if (e < L * N) *reinterpret_cast<float4*>(tile + i * ld + d) = widen4(r[p]);
        }
    }
};

// UT prep (as `ut_prep` above) with its products on tensor cores: the gram
// K K^T, then T = L^-1 (L = I + A, unit lower triangular) by blocks, then
// U = T (beta v) and W = T (beta exp(G) k). Block: 256 threads (8 warps).
extern "C" __global__ void __launch_bounds__(256, 2) ut_prep_tc(const in_t* __restrict__ k, const in_t* __restrict__ v,
                                                                const float* __restrict__ g, const float* __restrict__ beta,
                                                                const i64* __restrict__ chunk_tok,
                                                                const i64* __restrict__ chunk_len, int H, int HK,
                                                                float* __restrict__ U, float* __restrict__ W,
                                                                float* __restrict__ Gc) {
    constexpr int KR = DK + 4; // Ks rows
    constexpr int VR = DV + 8; // Vs rows (read as B)
    extern __shared__ float4 smem4[];
    float* Ks = (float*)smem4; // [L][KR]
    float* Vs = Ks + L * KR;   // [L][VR]
    float* A = Vs + L * VR;    // [L][LP]
    constexpr int MP = L - 16 + 4; // Ms rows
    float* Ti = A + L * LP;    // [L][LP]: T = L^-1
    float* Ms = Ti + L * LP;   // [16][MP]: one block row's sums
    float* Gs = Ms + 16 * MP;  // [L]
    float* Bs = Gs + L;        // [L]
    const int c = blockIdx.x, h = blockIdx.y, kh = h / (H / HK);
    const int warp = threadIdx.x / 32, gq = (threadIdx.x % 32) / 4, t4 = threadIdx.x % 4;
    const i64 t0 = chunk_tok[c];
    const int len = (int)chunk_len[c];
    const i64 base = (i64)c * H + h;
    {
        RowTile<DK> kr;
        RowTile<DV> vr;
        kr.fetch(k, t0, len, HK, kh);
        vr.fetch(v, t0, len, H, h);
        const float gi = fetch_decay(g, t0, len, H, h);
        const float bi = threadIdx.x < len ? beta[(t0 + threadIdx.x) * H + h] : 0.f;
        kr.store(Ks, KR);
        vr.store(Vs, VR);
        if (threadIdx.x < L) Bs[threadIdx.x] = bi;
        decay_prefix(gi, Gs); // starts and ends with a barrier
    }
    {
        // A = strictly_lower(beta_i exp(G_i - G_j) k_i . k_j)
        const int mp = warp / 2, np = (warp % 2) * 4;
        float p[4][4] = {};
#pragma unroll 4
        for (int k0 = 0; k0 < DK; k0 += 8) {
            const Frag<4> a = frag_a(Ks, KR, mp * 16, k0);
#pragma unroll
            for (int jn = 0; jn < 4; jn++) mma(p[jn], a, frag_bt(Ks, KR, k0, (np + jn) * 8));
        }
        // The rows' and columns' G and beta into registers before the
        // first store (which the loads after it would wait for).
        const int i0 = mp * 16 + gq;
        const float gr[2] = {Gs[i0], Gs[i0 + 8]}, br[2] = {Bs[i0], Bs[i0 + 8]};
        float gc[4][2];
#pragma unroll
        for (int jn = 0; jn < 4; jn++)
#pragma unroll
            for (int e = 0; e < 2; e++) gc[jn][e] = Gs[(np + jn) * 8 + 2 * t4 + e];
#pragma unroll
        for (int jn = 0; jn < 4; jn++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int i = i0 + (e / 2) * 8, j = (np + jn) * 8 + 2 * t4 + e % 2;
                A[i * LP + j] = j < i ? br[e / 2] * expf(gr[e / 2] - gc[jn][e % 2]) * p[jn][e] : 0.f;
            }
    }
    for (int i = threadIdx.x; i < L; i += blockDim.x) Gc[base * L + i] = Gs[i];
    __syncthreads();
    // T = L^-1 by 16 x 16 blocks: first the diagonal blocks' inverses, by
    // forward substitution on their identity's columns (a chain of 120
    // products where the whole matrix's takes 2016); then each block row
    // below from those above it, T_ij = -T_ii sum_{j <= m < i} A_im T_mj.
    if (threadIdx.x < L) {
        const int o = threadIdx.x / 16 * 16, col = threadIdx.x % 16;
        float x[16];
#pragma unroll
        for (int i = 0; i < 16; i++) x[i] = i == col ? 1.f : 0.f;
#pragma unroll
        for (int i = 1; i < 16; i++) {
            float r = x[i];
            const float* a = A + (o + i) * LP + o;
#pragma unroll
            for (int j = 0; j < i; j++) r -= a[j] * x[j];
            x[i] = r;
        }
#pragma unroll
        for (int i = 0; i < 16; i++) Ti[(o + i) * LP + o + col] = x[i];
    } else {
        // Meanwhile: the blocks of T above the diagonal are zero, and the
        // right-hand sides are beta v and beta exp(G) k.
        for (int e = threadIdx.x - L; e < L * L; e += blockDim.x - L) {
            const int i = e / L, j = e - i * L;
            if (j / 16 > i / 16) Ti[i * LP + j] = 0.f;
        }
        // Four values a thread and step, so that a row's factor is computed
        // once for four.
        for (int e = threadIdx.x - L; e < L * (DK + DV) / 4; e += blockDim.x - L) {
            const int i = e / ((DK + DV) / 4), d = (e - i * ((DK + DV) / 4)) * 4;
            float4* x = reinterpret_cast<float4*>(d < DK ? Ks + i * KR + d : Vs + i * VR + d - DK);
            const float f = d < DK ? Bs[i] * expf(Gs[i]) : Bs[i];
            float4 y = *x;
            y.x *= f;
            y.y *= f;
            y.z *= f;
            y.w *= f;
            *x = y;
        }
    }
    __syncthreads();
    // Thread (r, cc) = (t / 16, t % 16) computes row r, column cc of every
    // 16 x 16 block of the block row; each sum's loads are issued together
    // (compile-time bounds) and the sums are stored after all of them.
    {
        const int r = threadIdx.x / 16, cc = threadIdx.x % 16;
#pragma unroll
        for (int bi = 1; bi < L / 16; bi++) {
            // M_j = sum_{j <= m < bi} A_{bi,m} T_{m,j} for every block j < bi.
            const float* a = A + (bi * 16 + r) * LP;
            float acc[L / 16 - 1];
#pragma unroll
            for (int bj = 0; bj < bi; bj++) {
                acc[bj] = 0.f;
#pragma unroll
                for (int m = bj * 16; m < bi * 16; m++) acc[bj] += a[m] * Ti[m * LP + bj * 16 + cc];
            }
#pragma unroll
            for (int bj = 0; bj < bi; bj++) Ms[r * MP + bj * 16 + cc] = acc[bj];
            __syncthreads();
            // T_{bi,j} = -T_{bi,bi} M_j.
            const float* t = Ti + (bi * 16 + r) * LP + bi * 16;
#pragma unroll
            for (int bj = 0; bj < bi; bj++) {
                acc[bj] = 0.f;
#pragma unroll
                for (int m = 0; m < 16; m++)
                    if (m <= r) acc[bj] += t[m] * Ms[m * MP + bj * 16 + cc];
            }
#pragma unroll
            for (int bj = 0; bj < bi; bj++) Ti[(bi * 16 + r) * LP + bj * 16 + cc] = -acc[bj];
            __syncthreads();
        }
    }
    // U = T (beta v), W = T (beta exp(G) k): warp w, rows (w % 4) * 16..,
    // its half of the columns.
    const int mo = warp % 4;
    {
        constexpr int ON = DV / 16;
        const int no = (warp / 4) * ON;
        float o[ON][4] = {};
#pragma unroll 2
        for (int k0 = 0; k0 < L; k0 += 8) {
            const Frag<4> a = frag_a(Ti, LP, mo * 16, k0);
#pragma unroll
            for (int jn = 0; jn < ON; jn++) mma(o[jn], a, frag_b(Vs, VR, k0, (no + jn) * 8));
        }
#pragma unroll
        for (int jn = 0; jn < ON; jn++) {
            float* out = U + (base * L + mo * 16 + gq) * DV + (no + jn) * 8 + 2 * t4;
            *reinterpret_cast<float2*>(out) = make_float2(o[jn][0], o[jn][1]);
            *reinterpret_cast<float2*>(out + 8 * DV) = make_float2(o[jn][2], o[jn][3]);
        }
    }
    {
        constexpr int ON = DK / 16;
        const int no = (warp / 4) * ON;
        float o[ON][4] = {};
#pragma unroll 2
        for (int k0 = 0; k0 < L; k0 += 8) {
            const Frag<4> a = frag_a(Ti, LP, mo * 16, k0);
#pragma unroll
            for (int jn = 0; jn < ON; jn++) mma(o[jn], a, frag_b(Ks, KR, k0, (no + jn) * 8));
        }
#pragma unroll
        for (int jn = 0; jn < ON; jn++) {
            float* out = W + (base * L + mo * 16 + gq) * DK + (no + jn) * 8 + 2 * t4;
            *reinterpret_cast<float2*>(out) = make_float2(o[jn][0], o[jn][1]);
            *reinterpret_cast<float2*>(out + 8 * DK) = make_float2(o[jn][2], o[jn][3]);
        }
    }
}

// The outputs of `output` above on tensor cores: P = (Q K^T) * decay
// (j <= i), then o = exp(G) (Q S_in) + P v_new. Block: 256 threads (8 warps);
// warp w computes P's rows (w / 2) * 16.. for columns (w % 2) * 32.., and
// o's rows (w % 4) * 16.. for columns (w / 4) * DV/2...
extern "C" __global__ void __launch_bounds__(256, 2) output_tc(
    const in_t* __restrict__ q, const in_t* __restrict__ k, const float* __restrict__ Vnew, const float* __restrict__ Gc,
    const float* __restrict__ S_in, const i64* __restrict__ chunk_tok, const i64* __restrict__ chunk_len, int H, int HK,
    float* __restrict__ out) {
    constexpr int QP = DK + 4; // Qs and Ks rows
    constexpr int PP = L + 4;  // Ps rows
    constexpr int ON = DV / 16; // o's column tiles per warp
    extern __shared__ float4 smem4[];
    float* Qs = (float*)smem4; // [L][QP]
    float* Ks = Qs + L * QP;   // [L][QP]
    float* Ps = Ks + L * QP;   // [L][PP]
    float* Gs = Ps + L * PP;   // [L]
    const int c = blockIdx.x, h = blockIdx.y, kh = h / (H / HK);
    const int warp = threadIdx.x / 32, g = (threadIdx.x % 32) / 4, t4 = threadIdx.x % 4;
    const i64 t0 = chunk_tok[c];
    const int len = (int)chunk_len[c];
    const i64 base = (i64)c * H + h;
    {
        RowTile<DK> qr, kr;
        qr.fetch(q, t0, len, HK, kh);
        kr.fetch(k, t0, len, HK, kh);
        const float gi = threadIdx.x < L ? Gc[base * L + threadIdx.x] : 0.f;
        qr.store(Qs, QP);
        kr.store(Ks, QP);
        if (threadIdx.x < L) Gs[threadIdx.x] = gi;
    }
    __syncthreads();
    {
        const int mp = warp / 2, np = (warp % 2) * 4;
        float p[4][4] = {};
#pragma unroll 4
        for (int k0 = 0; k0 < DK; k0 += 8) {
            const Frag<4> a = frag_a(Qs, QP, mp * 16, k0);
#pragma unroll
            for (int jn = 0; jn < 4; jn++) mma(p[jn], a, frag_bt(Ks, QP, k0, (np + jn) * 8));
        }
#pragma unroll
        for (int jn = 0; jn < 4; jn++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int i = mp * 16 + g + (e / 2) * 8, j = (np + jn) * 8 + 2 * t4 + e % 2;
                Ps[i * PP + j] = j <= i ? p[jn][e] * expf(Gs[i] - Gs[j]) : 0.f;
            }
    }
    __syncthreads();
    const int mo = warp % 4, no = (warp / 4) * ON;
    float o[ON][4] = {};
    const float* S = S_in + base * DK * DV;
#pragma unroll 4
    for (int k0 = 0; k0 < DK; k0 += 8) {
        const Frag<4> a = frag_a(Qs, QP, mo * 16, k0);
#pragma unroll
        for (int jn = 0; jn < ON; jn++) mma(o[jn], a, frag_b(S, DV, k0, (no + jn) * 8));
    }
    const float e0 = expf(Gs[mo * 16 + g]), e1 = expf(Gs[mo * 16 + g + 8]);
#pragma unroll
    for (int jn = 0; jn < ON; jn++) {
        o[jn][0] *= e0;
        o[jn][1] *= e0;
        o[jn][2] *= e1;
        o[jn][3] *= e1;
    }
    const float* V = Vnew + base * L * DV;
#pragma unroll 4
    for (int k0 = 0; k0 < L; k0 += 8) {
        const Frag<4> a = frag_a(Ps, PP, mo * 16, k0);
#pragma unroll
        for (int jn = 0; jn < ON; jn++) mma(o[jn], a, frag_b(V, DV, k0, (no + jn) * 8));
    }
#pragma unroll
    for (int jn = 0; jn < ON; jn++) {
        const int i = mo * 16 + g, col = (no + jn) * 8 + 2 * t4;
        if (i < len) *reinterpret_cast<float2*>(out + ((t0 + i) * H + h) * DV + col) = make_float2(o[jn][0], o[jn][1]);
        if (i + 8 < len)
            *reinterpret_cast<float2*>(out + ((t0 + i + 8) * H + h) * DV + col) = make_float2(o[jn][2], o[jn][3]);
    }
}
#endif

#if IN_BF16
// Round to nearest even; Inf stays Inf and NaN a (quiet) NaN (rounding
// would carry a NaN's mantissa into its exponent or sign, or wrap it to zero).
__device__ __forceinline__ in_t st(float f) {
    unsigned b = __float_as_uint(f);
    if ((b & 0x7FFFFFFFu) > 0x7F800000u) return (in_t)((b >> 16) | 0x40u);
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

// The same for kernels of at most CK taps, each thread on eight
// consecutive channels (bf16) or four (f32) of a run of CT tokens: its
// channels' taps stay in registers, and so does the window of the last
// inputs, which slides one token at a time (one 16-byte load and one store
// per token and vector). Rows `stride` elements apart whose starts, like C,
// are whole vectors (the caller checks). Sums in the order of the kernel
// above: the same results. Grid: (C / (CVEC * blockDim), T / CT).
#if IN_BF16
#define CVEC 8
#else
#define CVEC 4
#endif
#define CK 4
#define CT 64
struct __align__(16) cvec_t {
    in_t v[CVEC];
};
extern "C" __global__ void causal_conv_silu_vec(const in_t* __restrict__ x, i64 stride, const in_t* __restrict__ w,
                                                const i64* __restrict__ pos, i64 T, int C, int K,
                                                in_t* __restrict__ y) {
    const int c0 = (blockIdx.x * blockDim.x + threadIdx.x) * CVEC;
    if (c0 >= C) return;
    const i64 t0 = (i64)blockIdx.y * CT;
    const i64 t1 = min(T, t0 + CT);
    float taps[CK][CVEC]; // taps[b]: the weight of the input b tokens back
    float win[CK][CVEC];  // win[b]: the input b tokens back
#pragma unroll
    for (int b = 0; b < CK; b++)
#pragma unroll
        for (int e = 0; e < CVEC; e++) {
            taps[b][e] = b < K ? ld(w + (i64)(c0 + e) * K + K - 1 - b) : 0.f;
            win[b][e] = 0.f;
        }
    // The window before t0 (win[1..] once shifted).
#pragma unroll
    for (int b = 0; b + 1 < CK; b++) {
        if (b + 1 < K && t0 - 1 - b >= 0) {
            const cvec_t a = *reinterpret_cast<const cvec_t*>(x + (t0 - 1 - b) * stride + c0);
#pragma unroll
            for (int e = 0; e < CVEC; e++) win[b][e] = ld(&a.v[e]);
        }
    }
    for (i64 t = t0; t < t1; t++) {
#pragma unroll
        for (int b = CK - 1; b > 0; b--)
#pragma unroll
            for (int e = 0; e < CVEC; e++) win[b][e] = win[b - 1][e];
        const cvec_t a = *reinterpret_cast<const cvec_t*>(x + t * stride + c0);
#pragma unroll
        for (int e = 0; e < CVEC; e++) win[0][e] = ld(&a.v[e]);
        const i64 p = pos[t];
        float acc[CVEC];
#pragma unroll
        for (int e = 0; e < CVEC; e++) acc[e] = 0.f;
#pragma unroll
        for (int b = 0; b < CK; b++) {
            if (b < K && b <= p) {
#pragma unroll
                for (int e = 0; e < CVEC; e++) acc[e] += win[b][e] * taps[b][e];
            }
        }
        cvec_t o;
#pragma unroll
        for (int e = 0; e < CVEC; e++) {
            in_t r = st(acc[e]);
            const float v = ld(&r);
            o.v[e] = st(v / (1.f + expf(-v)));
        }
        *reinterpret_cast<cvec_t*>(y + t * C + c0) = o;
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
