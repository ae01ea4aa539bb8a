// The drafter's per-head QK norm followed by RoPE, each direction one pass
// (csrc/fused_layers.cpp holds the autograd function; src/fused_layers.rs
// launches these): y = rope(x / rms(x) * w) over heads of d = 32 * VPL
// elements, one warp per head vector, lane l holding elements
// [l * VPL, (l + 1) * VPL). RoPE pairs element i with i + d/2, which is lane
// l ^ 16's. All math in f32, one rounding per output.

// (The kind's types and loads: vec_kind.cuh, prepended.)

// A lane's elements, loaded at once (aligned to at most 16 bytes: a wider
// f32 lane is two loads, and x need only be 16-byte aligned).
template <int VPL>
struct alignas(sizeof(in_t) * VPL > 16 ? 16 : sizeof(in_t) * VPL) lane_t {
    in_t v[VPL];
};

template <int VPL>
__device__ __forceinline__ void load_lane(const in_t* p, float* f) {
    const lane_t<VPL> a = *reinterpret_cast<const lane_t<VPL>*>(p);
#pragma unroll
    for (int e = 0; e < VPL; e++) f[e] = ld(a.v[e]);
}

template <int VPL>
__device__ __forceinline__ void store_lane(in_t* p, const float* f) {
    lane_t<VPL> a;
#pragma unroll
    for (int e = 0; e < VPL; e++) a.v[e] = st(f[e]);
    *reinterpret_cast<lane_t<VPL>*>(p) = a;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Forward: x [vectors = rows * heads, d], w [d], tables [table_rows, d]
// (vector v's row v / heads reads table row (v / heads) % table_rows);
// writes y and each vector's 1 / rms (f32) for the backward.
template <int VPL>
__device__ void norm_rope_forward(const in_t* __restrict__ x, const in_t* __restrict__ w,
                                  const in_t* __restrict__ cos, const in_t* __restrict__ sin, i64 vectors,
                                  int heads, i64 table_rows, float eps, in_t* __restrict__ y,
                                  float* __restrict__ rstd) {
    constexpr int D = 32 * VPL;
    const int lane = threadIdx.x & 31;
    const i64 v = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    if (v >= vectors) return; // whole warps leave together: blockDim is a multiple of 32
    const int at = lane * VPL;
    const i64 table = (v / heads) % table_rows * D + at;
    float xv[VPL], wv[VPL], c[VPL], s[VPL];
    load_lane<VPL>(x + v * D + at, xv);
    load_lane<VPL>(w + at, wv);
    load_lane<VPL>(cos + table, c);
    load_lane<VPL>(sin + table, s);
    float ss = 0.f;
#pragma unroll
    for (int e = 0; e < VPL; e++) ss += xv[e] * xv[e];
    const float r = rsqrtf(warp_sum(ss) / D + eps);
    float out[VPL];
#pragma unroll
    for (int e = 0; e < VPL; e++) {
        const float z = xv[e] * r * wv[e];
        const float zp = __shfl_xor_sync(0xffffffffu, z, 16);
        // first half: z1 c1 - z2 s1; second half: z2 c2 + z1 s2
        out[e] = lane < 16 ? z * c[e] - zp * s[e] : z * c[e] + zp * s[e];
    }
    store_lane<VPL>(y + v * D + at, out);
    if (lane == 0) rstd[v] = r;
}

// Backward: dy of y, x and rstd as the forward saw and wrote them. Writes
// dx, and each block's partial sum of w's gradient to dw_part[blockIdx.x]
// (f32 [gridDim.x, d]; the caller sums the rows): warps walk the vectors
// with a grid stride, so every block's partial covers a fixed set.
template <int VPL>
__device__ void norm_rope_backward(const in_t* __restrict__ dy, const in_t* __restrict__ x,
                                   const float* __restrict__ rstd, const in_t* __restrict__ w,
                                   const in_t* __restrict__ cos, const in_t* __restrict__ sin, i64 vectors,
                                   int heads, i64 table_rows, in_t* __restrict__ dx, float* __restrict__ dw_part) {
    constexpr int D = 32 * VPL;
    __shared__ float part[8][D]; // blockDim.x == 256: eight warps
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int at = lane * VPL;
    float wv[VPL], acc[VPL];
    load_lane<VPL>(w + at, wv);
#pragma unroll
    for (int e = 0; e < VPL; e++) acc[e] = 0.f;
    const i64 warps = (i64)gridDim.x * 8;
    for (i64 v = (i64)blockIdx.x * 8 + warp; v < vectors; v += warps) {
        const i64 table = (v / heads) % table_rows * D + at;
        float g[VPL], xv[VPL], c[VPL], s[VPL];
        load_lane<VPL>(dy + v * D + at, g);
        load_lane<VPL>(x + v * D + at, xv);
        load_lane<VPL>(cos + table, c);
        load_lane<VPL>(sin + table, s);
        const float r = rstd[v];
        float dot = 0.f;
#pragma unroll
        for (int e = 0; e < VPL; e++) {
            // RoPE's transpose: first half g1 c1 + g2 s2; second half g2 c2 - g1 s1.
            const float gp = __shfl_xor_sync(0xffffffffu, g[e], 16);
            const float sp = __shfl_xor_sync(0xffffffffu, s[e], 16);
            const float dz = lane < 16 ? g[e] * c[e] + gp * sp : g[e] * c[e] - gp * sp;
            const float xh = xv[e] * r;
            acc[e] += dz * xh;
            g[e] = dz * wv[e]; // the normalized value's gradient
            xv[e] = xh;
            dot += g[e] * xh;
        }
        dot = warp_sum(dot) / D;
#pragma unroll
        for (int e = 0; e < VPL; e++) g[e] = r * (g[e] - xv[e] * dot);
        store_lane<VPL>(dx + v * D + at, g);
    }
#pragma unroll
    for (int e = 0; e < VPL; e++) part[warp][at + e] = acc[e];
    __syncthreads();
    for (int i = threadIdx.x; i < D; i += blockDim.x) {
        float t = 0.f;
#pragma unroll
        for (int k = 0; k < 8; k++) t += part[k][i];
        dw_part[(i64)blockIdx.x * D + i] = t;
    }
}

#define NORM_ROPE_ENTRIES(VPL)                                                                                    \
    extern "C" __global__ void norm_rope_forward_##VPL(const in_t* x, const in_t* w, const in_t* cos,           \
                                                       const in_t* sin, i64 vectors, int heads, i64 table_rows, \
                                                       float eps, in_t* y, float* rstd) {                       \
        norm_rope_forward<VPL>(x, w, cos, sin, vectors, heads, table_rows, eps, y, rstd);                       \
    }                                                                                                           \
    extern "C" __global__ void __launch_bounds__(256)                                                          \
        norm_rope_backward_##VPL(const in_t* dy, const in_t* x, const float* rstd, const in_t* w,              \
                                 const in_t* cos, const in_t* sin, i64 vectors, int heads, i64 table_rows,     \
                                 in_t* dx, float* dw_part) {                                                   \
        norm_rope_backward<VPL>(dy, x, rstd, w, cos, sin, vectors, heads, table_rows, dx, dw_part);            \
    }

NORM_ROPE_ENTRIES(2)
NORM_ROPE_ENTRIES(4)
NORM_ROPE_ENTRIES(8)
