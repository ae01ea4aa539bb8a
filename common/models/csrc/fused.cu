// Row and elementwise kernels that replace chains of libtorch ops on the
// capture path, compiled at run time by NVRTC (src/fused_cuda.rs) for one
// input kind: -DIN_BF16=<1: bf16; 0: f32>. Each computes in f32 and rounds
// to the input kind where the ops it replaces write a tensor of that kind,
// so swapping them changes results by at most the order of a sum.
//
// Rows are read and written as 16-byte vectors (VEC elements): the callers
// check that rows are 16-byte aligned and their lengths multiples of VEC.

// (The kind's types and loads: vec_kind.cuh, prepended.)

// RMSNorm with an f32 scale (the zero-centred norms of Qwen3-Next and
// Qwen3.5 keep 1 + w in f32), over rows of `dim`:
//   y = st((x * rsqrt(mean(x^2) + eps)) * w), all in f32, rounded once,
// as transformers computes it in f32 and casts back. One warp per row.
extern "C" __global__ void rms_norm_f32_scale(const in_t* __restrict__ x, i64 rows, int dim,
                                              const float* __restrict__ w, float eps, in_t* __restrict__ y) {
    const i64 r = ((i64)blockIdx.x * blockDim.x + threadIdx.x) / 32;
    const int lane = threadIdx.x % 32;
    if (r >= rows) return; // whole warps
    const vec_t* xr = reinterpret_cast<const vec_t*>(x + r * dim);
    vec_t* yr = reinterpret_cast<vec_t*>(y + r * dim);
    const int n = dim / VEC;
    float ss = 0.f;
    for (int v = lane; v < n; v += 32) {
        const vec_t a = xr[v];
#pragma unroll
        for (int e = 0; e < VEC; e++) {
            const float f = ld(a.v[e]);
            ss += f * f;
        }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    const float inv = rsqrtf(ss / dim + eps);
    for (int v = lane; v < n; v += 32) {
        const vec_t a = xr[v]; // the second read of the row comes from cache
        vec_t o;
#pragma unroll
        for (int e = 0; e < VEC; e++) o.v[e] = st(ld(a.v[e]) * inv * w[v * VEC + e]);
        yr[v] = o;
    }
}

// The MoE block's un-permute: each token's weighted sum over its K expert
// rows, y[t] = st(sum_k w[t, k] out[inverse[t K + k]]), accumulated in f32
// (as the batched matmul it replaces accumulates), without writing the
// gathered [T, K, H] rows. Grid: tokens; threads across the row's vectors.
extern "C" __global__ void moe_unpermute(const in_t* __restrict__ out, const i64* __restrict__ inverse,
                                         const in_t* __restrict__ w, int K, int H, in_t* __restrict__ y) {
    const i64 t = blockIdx.x;
    const int n = H / VEC;
    for (int v = threadIdx.x; v < n; v += blockDim.x) {
        float acc[VEC];
#pragma unroll
        for (int e = 0; e < VEC; e++) acc[e] = 0.f;
        for (int k = 0; k < K; k++) {
            const i64 row = inverse[t * K + k];
            const float wk = ld(w[t * K + k]);
            const vec_t a = reinterpret_cast<const vec_t*>(out + row * H)[v];
#pragma unroll
            for (int e = 0; e < VEC; e++) acc[e] += wk * ld(a.v[e]);
        }
        vec_t o;
#pragma unroll
        for (int e = 0; e < VEC; e++) o.v[e] = st(acc[e]);
        reinterpret_cast<vec_t*>(y + t * H)[v] = o;
    }
}

// SwiGLU of fused gate/up rows [rows, 2I] (gate first) into [rows, I]:
//   act = st(ld(st(silu(g))) * u),
// silu rounded to the input kind as libtorch's silu writes it, then the
// product rounded as its multiply writes it. One thread per vector.
extern "C" __global__ void swiglu(const in_t* __restrict__ gu, i64 rows, int I, in_t* __restrict__ act) {
    const int n = I / VEC;
    const i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= rows * n) return;
    const i64 r = idx / n;
    const int v = (int)(idx - r * n);
    const vec_t g = reinterpret_cast<const vec_t*>(gu + r * 2 * I)[v];
    const vec_t u = reinterpret_cast<const vec_t*>(gu + r * 2 * I + I)[v];
    vec_t o;
#pragma unroll
    for (int e = 0; e < VEC; e++) {
        const float x = ld(g.v[e]);
        o.v[e] = st(ld(st(x / (1.f + expf(-x)))) * ld(u.v[e]));
    }
    reinterpret_cast<vec_t*>(act + r * I)[v] = o;
}

// The Qwen MoE router's softmax over E experts and its top K, one warp per
// token: probabilities in f32 (exp(l - max) / sum, as softmax computes
// them), the K largest in descending order (a tie to the lower expert),
// divided by their sum when `renorm`, the weights rounded to the input
// kind. E <= 32 * RPL.
#define RPL 16
extern "C" __global__ void route_softmax_topk(const in_t* __restrict__ logits, i64 T, int E, int K, int renorm,
                                              i64* __restrict__ chosen, in_t* __restrict__ weights) {
    const i64 t = ((i64)blockIdx.x * blockDim.x + threadIdx.x) / 32;
    const int lane = threadIdx.x % 32;
    if (t >= T) return; // whole warps
    const in_t* row = logits + t * E;
    float p[RPL];
    const float neg_inf = __int_as_float(0xff800000);
    float mx = neg_inf;
#pragma unroll
    for (int r = 0; r < RPL; r++) {
        const int e = lane + 32 * r;
        p[r] = e < E ? ld(row[e]) : neg_inf;
        mx = fmaxf(mx, p[r]);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    float sum = 0.f;
#pragma unroll
    for (int r = 0; r < RPL; r++) {
        p[r] = lane + 32 * r < E ? expf(p[r] - mx) : 0.f;
        sum += p[r];
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
#pragma unroll
    for (int r = 0; r < RPL; r++) p[r] = lane + 32 * r < E ? p[r] / sum : -1.f; // -1: not a candidate
    float picked = 0.f, total = 0.f;
    int picked_e = 0;
    for (int j = 0; j < K; j++) {
        float best = -1.f;
        int best_e = 0x7fffffff;
#pragma unroll
        for (int r = 0; r < RPL; r++) {
            if (p[r] > best) { // r ascending: the lower expert wins a tie
                best = p[r];
                best_e = lane + 32 * r;
            }
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float ob = __shfl_xor_sync(0xffffffffu, best, o);
            const int oe = __shfl_xor_sync(0xffffffffu, best_e, o);
            if (ob > best || (ob == best && oe < best_e)) {
                best = ob;
                best_e = oe;
            }
        }
        if (best_e % 32 == lane) {
#pragma unroll
            for (int r = 0; r < RPL; r++)
                if (lane + 32 * r == best_e) p[r] = -1.f;
        }
        total += best;
        if (lane == j) {
            picked = best;
            picked_e = best_e;
        }
    }
    if (lane < K) {
        chosen[t * K + lane] = picked_e;
        weights[t * K + lane] = st(renorm ? picked / total : picked);
    }
}

// How many (token, slot) pairs chose each expert (int32 counts, zeroed by
// the caller).
extern "C" __global__ void expert_counts(const i64* __restrict__ chosen, i64 N, int* __restrict__ counts) {
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < N; i += (i64)gridDim.x * blockDim.x)
        atomicAdd(&counts[chosen[i]], 1);
}

// A stable counting sort of the (token, slot) pairs by expert, as a stable
// sort of the chosen experts orders them: block e walks all pairs in order
// and places those of expert e from start[e] on: order[pos] = pair,
// inverse[pair] = pos, token[pos] = pair / K. Block: 1024 threads.
extern "C" __global__ void expert_order(const i64* __restrict__ chosen, i64 N, int K, const int* __restrict__ start,
                                        i64* __restrict__ order, i64* __restrict__ inverse, i64* __restrict__ token) {
    __shared__ int warp_base[33];
    const int e = blockIdx.x, lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
    i64 placed = start[e];
    for (i64 i0 = 0; i0 < N; i0 += blockDim.x) {
        const i64 i = i0 + threadIdx.x;
        const bool mine = i < N && chosen[i] == e;
        const unsigned ballot = __ballot_sync(0xffffffffu, mine);
        if (lane == 0) warp_base[warp] = __popc(ballot);
        __syncthreads();
        if (threadIdx.x == 0) {
            int acc = 0;
            for (int w = 0; w < warps; w++) {
                const int c = warp_base[w];
                warp_base[w] = acc;
                acc += c;
            }
            warp_base[32] = acc;
        }
        __syncthreads();
        if (mine) {
            const i64 pos = placed + warp_base[warp] + __popc(ballot & ((1u << lane) - 1u));
            order[pos] = i;
            inverse[i] = pos;
            token[pos] = i / K;
        }
        placed += warp_base[32];
        __syncthreads();
    }
}
