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
// NaN and infinities give what softmax and argmax give: a NaN anywhere
// makes the row's sum, hence every probability, NaN (the step's check then
// sees it) and is the argmax; +inf makes the row NaN (inf - inf); a row all
// -inf is NaN (0 / 0). Rows are 16-byte aligned and V a whole number of
// vectors (the launcher checks).

// (vec_kind.cuh and order_key.cuh are prepended.)

#define THREADS 1024
// Vectors in flight per thread.
#define UNROLL 4
// No math.h under NVRTC.
#define NEG_INF __int_as_float(0xff800000)

// (max, sum of exp(x - max)) pairs merged; a side whose maximum is the
// merged one keeps its sum as is, so -inf maxima never make 0 * inf, and a
// NaN sum stays NaN.
__device__ __forceinline__ void merge(float& m, float& s, float m2, float s2) {
    const float mm = fmaxf(m, m2);
    s = s * (m == mm ? 1.f : expf(m - mm)) + s2 * (m2 == mm ? 1.f : expf(m2 - mm));
    m = mm;
}

extern "C" __global__ void __launch_bounds__(THREADS)
    softmax_rows(in_t* __restrict__ logits, int v, int cache_vecs, i64* __restrict__ argmax, float* __restrict__ sums) {
    extern __shared__ vec_t cache[]; // [cache_vecs]
    __shared__ float red_m[THREADS / 32], red_s[THREADS / 32];
    __shared__ u64 red_k[THREADS / 32];
    in_t* row = logits + (i64)blockIdx.x * v;
    const int nvec = v / VEC;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;

    // 1. Maximum, argmax, sum of exponentials.
    float m = NEG_INF, s = 0.f;
    u64 best = 0;
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
                // + 0: -0 ranks with +0, as argmax takes them (equal, the
                // lower position first), where order_key alone puts -0 below.
                const u64 p = pack(order_key(f[e] + 0.f), (u32)(i * VEC + e));
                best = p > best ? p : best;
            }
            if (vm > m) {
                s *= expf(m - vm);
                m = vm;
            }
#pragma unroll
            for (int e = 0; e < VEC; e++) s += f[e] == NEG_INF ? 0.f : expf(f[e] - m);
        }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) merge(m, s, __shfl_xor_sync(0xFFFFFFFFu, m, o), __shfl_xor_sync(0xFFFFFFFFu, s, o));
    best = warp_max(best);
    if (lane == 0) red_m[warp] = m, red_s[warp] = s, red_k[warp] = best;
    __syncthreads();
    if (warp == 0) {
        m = red_m[lane], s = red_s[lane], best = red_k[lane]; // THREADS / 32 == 32 warps
#pragma unroll
        for (int o = 16; o > 0; o >>= 1)
            merge(m, s, __shfl_xor_sync(0xFFFFFFFFu, m, o), __shfl_xor_sync(0xFFFFFFFFu, s, o));
        best = warp_max(best);
        if (lane == 0) {
            red_m[0] = m, red_s[0] = s;
            argmax[blockIdx.x] = (i64)unpack_pos(best);
        }
    }
    __syncthreads();
    const float row_max = red_m[0], row_sum = red_s[0];

    // 2. The probabilities, written over the logits; the sum of them as
    // rounded.
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
            vec_t p;
#pragma unroll
            for (int e = 0; e < VEC; e++) {
                p.v[e] = st(expf(ld(a[u].v[e]) - row_max) / row_sum);
                total += ld(p.v[e]);
            }
            *reinterpret_cast<vec_t*>(row + (i64)i * VEC) = p;
        }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) total += __shfl_xor_sync(0xFFFFFFFFu, total, o);
    __syncthreads(); // red_s[0] was read by every thread above
    if (lane == 0) red_s[warp] = total;
    __syncthreads();
    if (warp == 0) {
        total = red_s[lane];
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) total += __shfl_xor_sync(0xFFFFFFFFu, total, o);
        if (lane == 0) sums[blockIdx.x] = total;
    }
}
