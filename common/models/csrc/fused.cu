// Row and elementwise kernels that replace chains of libtorch ops on the
// capture path, compiled at run time by NVRTC (src/fused_cuda.rs) for one
// input kind: -DIN_BF16=<1: bf16; 0: f32>. Each computes in f32 and rounds
// to the input kind where the ops it replaces write a tensor of that kind,
// so swapping them changes results by at most the order of a sum.
//
// Rows are read and written as 16-byte vectors (VEC elements): the callers
// check that rows are 16-byte aligned and their lengths multiples of VEC.

#if IN_BF16
typedef unsigned short in_t;
#define VEC 8
__device__ __forceinline__ float ld(in_t x) { return __uint_as_float(((unsigned)x) << 16); }
// Round to nearest even (NaN and Inf stay NaN and Inf).
__device__ __forceinline__ in_t st(float f) {
    unsigned b = __float_as_uint(f);
    return (in_t)((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
}
#else
typedef float in_t;
#define VEC 4
__device__ __forceinline__ float ld(in_t x) { return x; }
__device__ __forceinline__ in_t st(float f) { return f; }
#endif

typedef long long i64;

struct __align__(16) vec_t {
    in_t v[VEC];
};

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

