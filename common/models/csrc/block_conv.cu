// DFlash2's in-block dynamic convolution on the GPU (csrc/block_conv.cpp
// calls these through src/block_conv_cuda.rs), compiled at run time by
// NVRTC for one input kind: -DIN_BF16=<1: bf16; 0: f32>; the backward is
// one kernel per bound on the taps (TAPS below).
//
//   out[r][c] = sum_{t <= pos(r)} (base[t][c] + dyn[r][t][c / gs]) * x[r - t][c]
//
// over rows r of blocks of `bl` consecutive rows (pos(r) = r % bl). As
// libtorch ops each tap made two passes over the output in the forward and
// three in the backward (`addcmul_`, the product, its sums); here the
// forward is one pass (x read, out written) and the backward one more (g
// and x read, the input's gradient written, the coefficients' gradients
// reduced on chip). All sums are in f32, in a fixed order: the result does
// not depend on scheduling.
//
// Each thread owns VEC consecutive channels (one 16-byte vector) of a chunk
// of whole blocks; blockIdx.y is the chunk. Rows are 16-byte aligned and h
// is a multiple of VEC (the launcher checks).

// (The kind's types and loads: vec_kind.cuh, prepended.)

// Tap t's kernel for row r at channels c0..c0+VEC: base[t] plus the row's
// dynamic coefficient of each channel's group (dyn rows are `ds` apart,
// [k, groups] within a row).
__device__ __forceinline__ void tap_kernel(const in_t* base, const in_t* dyn, i64 r, int t, i64 c0, i64 h,
                                           int groups, int gs, i64 ds, float* w) {
    load(base + t * h + c0, w);
    const in_t* d = dyn + r * ds + (i64)t * groups;
    if (gs >= VEC) {
        // One group holds the whole vector: one load, not VEC of the same
        // coefficient (the compiler cannot see that the indices agree).
        const float c = ld(d[c0 / gs]);
#pragma unroll
        for (int e = 0; e < VEC; e++) w[e] += c;
    } else {
#pragma unroll
        for (int e = 0; e < VEC; e++) w[e] += ld(d[(c0 + e) / gs]);
    }
}

extern "C" __global__ void block_conv_forward(const in_t* __restrict__ x, const in_t* __restrict__ dyn,
                                              const in_t* __restrict__ base, i64 rows, i64 h, int bl, int k,
                                              int groups, int gs, i64 ds, int chunk_rows, in_t* __restrict__ out) {
    const i64 c0 = ((i64)blockIdx.x * blockDim.x + threadIdx.x) * VEC;
    if (c0 >= h) return;
    const i64 first = (i64)blockIdx.y * chunk_rows;
    const i64 last = min(first + chunk_rows, rows);
    for (i64 r = first; r < last; r++) {
        const int pos = (int)(r % bl);
        float acc[VEC] = {};
        for (int t = 0; t < k && t <= pos; t++) {
            float w[VEC], v[VEC];
            tap_kernel(base, dyn, r, t, c0, h, groups, gs, ds, w);
            load(x + (r - t) * h + c0, v); // rows r - t are this block's, read moments ago: cached
#pragma unroll
            for (int e = 0; e < VEC; e++) acc[e] += w[e] * v[e];
        }
        store(out + r * h + c0, acc);
    }
}

// The backward, given the output's gradient g:
//   gx[r]          = sum_{t < k, pos(r) + t < bl} (base[t] + dyn[r + t][t]) * g[r + t]
//   gdyn[r][t][gr] = sum_{c in group gr} g[r][c] * x[r - t][c]   (0 where t > pos(r))
//   gbase[t][c]    = sum_r g[r][c] * x[r - t][c]
// gdyn is written [rows, k, groups]; gbase as one f32 partial per chunk,
// [chunks, k, h], that the caller sums. The arguments are the forward's,
// with x's gradient where its output was, then g, gdyn and gbase. A group spans `lanes` = gs / VEC
// adjacent threads (a power of two up to 32, reduced by shuffles) or, where
// gs < VEC, VEC / gs groups lie within one thread. Every thread of a warp
// takes part in the shuffles; those past h compute on zeros and write nothing.
//
// TAPS (>= k) is how many base-kernel gradients each thread keeps in
// registers: one kernel per bound (block_conv_backward_2, _4, _8; the
// launcher takes the smallest that holds k): an array sized for eight taps
// held the kernel at 141 registers, 12 resident warps per SM, where
// DFlash2's default two taps take 96 registers and 20 warps (bounding the
// registers further spills).
template <int TAPS>
__device__ __forceinline__ void backward(const in_t* __restrict__ x, const in_t* __restrict__ dyn,
                                         const in_t* __restrict__ base, i64 rows, i64 h, int bl, int k, int groups,
                                         int gs, i64 ds, int chunk_rows, in_t* __restrict__ gx,
                                         const in_t* __restrict__ g, in_t* __restrict__ gdyn,
                                         float* __restrict__ gbase) {
    const i64 c0 = ((i64)blockIdx.x * blockDim.x + threadIdx.x) * VEC;
    const bool live = c0 < h;
    const int lanes = gs >= VEC ? gs / VEC : 1;
    const i64 first = (i64)blockIdx.y * chunk_rows;
    const i64 last = min(first + chunk_rows, rows);
    float gb[TAPS][VEC];
#pragma unroll
    for (int t = 0; t < TAPS; t++)
#pragma unroll
        for (int e = 0; e < VEC; e++) gb[t][e] = 0.f;
    for (i64 r = first; r < last; r++) {
        const int pos = (int)(r % bl);
        float gr[VEC] = {}, acc[VEC] = {};
        if (live) load(g + r * h + c0, gr);
        // The input's gradient: rows r + t of the block read row r.
        if (live) {
            for (int t = 0; t < k && pos + t < bl; t++) {
                float w[VEC], v[VEC];
                tap_kernel(base, dyn, r + t, t, c0, h, groups, gs, ds, w);
                if (t == 0) {
#pragma unroll
                    for (int e = 0; e < VEC; e++) v[e] = gr[e];
                } else {
                    load(g + (r + t) * h + c0, v);
                }
#pragma unroll
                for (int e = 0; e < VEC; e++) acc[e] += w[e] * v[e];
            }
            store(gx + r * h + c0, acc);
        }
        // The coefficients' gradients: row r's product with each earlier row.
#pragma unroll
        for (int t = 0; t < TAPS; t++) {
            if (t >= k) break;
            float p[VEC] = {};
            if (live && t <= pos) {
                float v[VEC];
                load(x + (r - t) * h + c0, v);
#pragma unroll
                for (int e = 0; e < VEC; e++) {
                    p[e] = gr[e] * v[e];
                    gb[t][e] += p[e];
                }
            }
            in_t* d = gdyn + (r * k + t) * groups;
            if (gs >= VEC) {
                float s = 0.f;
#pragma unroll
                for (int e = 0; e < VEC; e++) s += p[e];
                for (int o = lanes / 2; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
                if (live && (c0 / VEC) % lanes == 0) d[c0 / gs] = st(s);
            } else if (live) {
                // Indices known at compile time keep p in registers (a
                // runtime index would put it in local memory for every path).
#pragma unroll
                for (int e0 = 0; e0 < VEC; e0++) {
                    if (e0 % gs != 0) continue;
                    float s = 0.f;
#pragma unroll
                    for (int e = 0; e < VEC; e++) s += e >= e0 && e < e0 + gs ? p[e] : 0.f;
                    d[(c0 + e0) / gs] = st(s);
                }
            }
        }
    }
    if (!live) return;
    float* partial = gbase + (i64)blockIdx.y * k * h;
#pragma unroll
    for (int t = 0; t < TAPS; t++) {
        if (t >= k) break;
#pragma unroll
        for (int e = 0; e < VEC; e++) partial[t * h + c0 + e] = gb[t][e];
    }
}

#define BACKWARD(T)                                                                                                    \
    extern "C" __global__ void block_conv_backward_##T(                                                                \
        const in_t* __restrict__ x, const in_t* __restrict__ dyn, const in_t* __restrict__ base, i64 rows, i64 h,      \
        int bl, int k, int groups, int gs, i64 ds, int chunk_rows, in_t* __restrict__ gx, const in_t* __restrict__ g, \
        in_t* __restrict__ gdyn, float* __restrict__ gbase) {                                                          \
        backward<T>(x, dyn, base, rows, h, bl, k, groups, gs, ds, chunk_rows, gx, g, gdyn, gbase);                     \
    }
BACKWARD(2)
BACKWARD(4)
BACKWARD(8)
