// The drafter loss's pass over one chunk of logits [rows, V], in one kernel
// (src/softmax_cuda.rs launches it; src/objective.rs runs the same as
// libtorch ops where it does not apply): each row's softmax written over
// the logits in their own kind, the row's argmax, and the f32 sum of the
// probabilities as written (rounded), from which the objective takes 1 - p
// of the label. As ops this was an argmax, a softmax and a sum: four passes
// over rows x vocab. Here: one read for the maximum, the argmax and the sum
// of exponentials (online: the sum is rescaled when the maximum grows),
// then one read and one write for the probabilities. The first `cache_vecs`
// vectors of the row stay in shared memory between the two, so the second
// read of them costs no memory traffic.
//
// The work per element is what bounds the kernel once the cache saves the
// second read, so the loops keep it small: exponentials by the hardware's
// ex2 (__expf: a few f32 ulps, where the probabilities are rounded to bf16
// or compared at 1e-5), one reciprocal of the sum per row, each thread's
// argmax as a float and a position (ranking keys built only for the
// reduction), and bf16 rounding by the converter instruction.
//
// NaN and infinities give what softmax and argmax give: a NaN anywhere
// makes the row's sum, hence every probability, NaN (the step's check then
// sees it); the argmax is then the first NaN, found by a second look at the
// row that only such rows take. +inf makes the row NaN (inf - inf); a row
// all -inf is NaN (0 / 0) with argmax 0. Rows are 16-byte aligned and V a
// whole number of vectors (the launcher checks).

// (vec_kind.cuh and order_key.cuh are prepended.)

// Vectors in flight per thread.
#define UNROLL 4
// No math.h under NVRTC.
#define NEG_INF __int_as_float(0xff800000)
// A thread that has seen no value above -inf.
#define NO_POS 0xFFFFFFFFu

// (max, sum of exp(x - max)) pairs merged; a side whose maximum is the
// merged one keeps its sum as is, so -inf maxima never make 0 * inf, and a
// NaN sum stays NaN.
__device__ __forceinline__ void merge(float& m, float& s, float m2, float s2) {
    const float mm = fmaxf(m, m2);
    s = s * (m == mm ? 1.f : __expf(m - mm)) + s2 * (m2 == mm ? 1.f : __expf(m2 - mm));
    m = mm;
}

__device__ __forceinline__ u32 warp_min(u32 v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = min(v, __shfl_xor_sync(0xFFFFFFFFu, v, o));
    return v;
}

// The probabilities of one vector rounded into the row, and their sum as
// rounded added to `total`.
__device__ __forceinline__ void store_probs(in_t* dst, const float* p, float& total) {
#if IN_BF16
    unsigned w[VEC / 2];
#pragma unroll
    for (int e = 0; e < VEC / 2; e++) {
        // cvt.rn.bf16x2.f32 d, a, b: a rounded into the upper half, b into
        // the lower; round to nearest even, NaN stays NaN.
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(w[e]) : "f"(p[2 * e + 1]), "f"(p[2 * e]));
        total += __uint_as_float(w[e] << 16) + __uint_as_float(w[e] & 0xFFFF0000u);
    }
    *reinterpret_cast<uint4*>(dst) = make_uint4(w[0], w[1], w[2], w[3]);
#else
    vec_t o;
#pragma unroll
    for (int e = 0; e < VEC; e++) {
        o.v[e] = p[e];
        total += p[e];
    }
    *reinterpret_cast<vec_t*>(dst) = o;
#endif
}

// THREADS per block, MIN_BLOCKS of them resident per SM (the launcher
// sizes the row cache so that they fit).
template <int THREADS, int MIN_BLOCKS>
__device__ __forceinline__ void softmax_rows(in_t* __restrict__ logits, int v, int cache_vecs, i64* __restrict__ argmax,
                                             float* __restrict__ sums) {
    extern __shared__ vec_t cache[]; // [cache_vecs]
    constexpr int WARPS = THREADS / 32;
    __shared__ float red_m[WARPS], red_s[WARPS];
    __shared__ u64 red_k[WARPS];
    __shared__ u32 red_nan[WARPS];
    in_t* row = logits + (i64)blockIdx.x * v;
    const int nvec = v / VEC;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;

    // 1. Maximum, argmax, sum of exponentials. Each thread sees its
    // positions in increasing order, so a strict > keeps the first of equal
    // values; NaN never compares greater (the rare pass below finds it).
    float m = NEG_INF, s = 0.f, best_v = NEG_INF;
    u32 best_i = NO_POS;
    for (int base = threadIdx.x; base < nvec; base += THREADS * UNROLL) {
        vec_t a[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; u++) {
            const int i = base + u * THREADS;
            if (i < nvec) a[u] = *reinterpret_cast<const vec_t*>(row + (i64)i * VEC);
        }
#pragma unroll
        for (int u = 0; u < UNROLL; u++) {
            const int i = base + u * THREADS;
            if (i >= nvec) continue;
            if (i < cache_vecs) cache[i] = a[u];
            float f[VEC];
            float vm = NEG_INF;
#pragma unroll
            for (int e = 0; e < VEC; e++) {
                f[e] = ld(a[u].v[e]);
                vm = fmaxf(vm, f[e]); // NaN is skipped here; the sum carries it
                if (f[e] > best_v) best_v = f[e], best_i = (u32)(i * VEC + e);
            }
            if (vm > m) {
                s *= __expf(m - vm);
                m = vm;
            }
            // While the maximum is -inf every value so far is -inf (or NaN):
            // their terms are exp(-inf - 0) = 0 (NaN stays NaN), not
            // exp(-inf + inf) = NaN.
            const float shift = m == NEG_INF ? 0.f : m;
#pragma unroll
            for (int e = 0; e < VEC; e++) s += __expf(f[e] - shift);
        }
    }
    // Ranking keys for the reduction: -0 ranks with +0 (+ 0.f), as argmax
    // takes them (equal, the lower position first).
    u64 best = pack(order_key(best_v + 0.f), best_i);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) merge(m, s, __shfl_xor_sync(0xFFFFFFFFu, m, o), __shfl_xor_sync(0xFFFFFFFFu, s, o));
    best = warp_max(best);
    if (lane == 0) red_m[warp] = m, red_s[warp] = s, red_k[warp] = best;
    __syncthreads();
    if (warp == 0) {
        const bool has = lane < WARPS;
        m = has ? red_m[lane] : NEG_INF, s = has ? red_s[lane] : 0.f, best = has ? red_k[lane] : 0;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1)
            merge(m, s, __shfl_xor_sync(0xFFFFFFFFu, m, o), __shfl_xor_sync(0xFFFFFFFFu, s, o));
        best = warp_max(best);
        if (lane == 0) {
            red_m[0] = m, red_s[0] = s;
            const u32 pos = unpack_pos(best);
            // Every value -inf (or NaN): the first position.
            argmax[blockIdx.x] = pos == NO_POS ? 0 : (i64)pos;
        }
    }
    __syncthreads();
    const float row_max = red_m[0], row_sum = red_s[0];

    // A NaN sum: the row holds a NaN (the argmax is the first) or +inf (the
    // argmax above stands). Only such rows read it a second time.
    if (row_sum != row_sum) {
        u32 first = NO_POS;
        for (int i = threadIdx.x; i < nvec && first == NO_POS; i += THREADS) {
            const vec_t a = i < cache_vecs ? cache[i] : *reinterpret_cast<const vec_t*>(row + (i64)i * VEC);
#pragma unroll
            for (int e = VEC - 1; e >= 0; e--)
                if (ld(a.v[e]) != ld(a.v[e])) first = (u32)(i * VEC + e);
        }
        first = warp_min(first);
        if (lane == 0) red_nan[warp] = first;
        __syncthreads();
        if (warp == 0) {
            first = warp_min(lane < WARPS ? red_nan[lane] : NO_POS);
            if (lane == 0 && first != NO_POS) argmax[blockIdx.x] = (i64)first;
        }
    }

    // 2. The probabilities, written over the logits; the sum of them as
    // rounded.
    const float inv = 1.f / row_sum;
    float total = 0.f;
    for (int base = threadIdx.x; base < nvec; base += THREADS * UNROLL) {
        vec_t a[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; u++) {
            const int i = base + u * THREADS;
            if (i < nvec) a[u] = i < cache_vecs ? cache[i] : *reinterpret_cast<const vec_t*>(row + (i64)i * VEC);
        }
#pragma unroll
        for (int u = 0; u < UNROLL; u++) {
            const int i = base + u * THREADS;
            if (i >= nvec) continue;
            float p[VEC];
#pragma unroll
            for (int e = 0; e < VEC; e++) p[e] = __expf(ld(a[u].v[e]) - row_max) * inv;
            store_probs(row + (i64)i * VEC, p, total);
        }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) total += __shfl_xor_sync(0xFFFFFFFFu, total, o);
    __syncthreads(); // red_s[0] was read by every thread above
    if (lane == 0) red_s[warp] = total;
    __syncthreads();
    if (warp == 0) {
        total = lane < WARPS ? red_s[lane] : 0.f;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) total += __shfl_xor_sync(0xFFFFFFFFu, total, o);
        if (lane == 0) sums[blockIdx.x] = total;
    }
}

// The block shapes the launcher chooses from (src/softmax_cuda.rs: Shape).
#define SHAPE(T, B)                                                                                                    \
    extern "C" __global__ void __launch_bounds__(T, B)                                                                 \
        softmax_rows_##T(in_t* __restrict__ logits, int v, int cache_vecs, i64* __restrict__ argmax,                   \
                         float* __restrict__ sums) {                                                                   \
        softmax_rows<T, B>(logits, v, cache_vecs, argmax, sums);                                                       \
    }
SHAPE(1024, 1)
SHAPE(512, 2)
SHAPE(256, 4)
