// Sums of gathered rows back into their source rows, on the GPU
// (csrc/split_attention.cpp's backward calls this through
// src/gather_sum_cuda.rs), compiled at run time by NVRTC for one input kind:
// -DIN_BF16=<1: bf16; 0: f32>.
//
//   out[r] = sum over e in [offsets[r], offsets[r + 1]) of src(order[e])
//   src(s) = a[s] for s < rows_a, else b[s - rows_a]
//
// The split attention gathers each key row once per sequence of a flash
// call that reads it (a context row near a sequence's start is in every
// group's prefix), so the backward gets one gradient row per gathered row.
// As libtorch ops each part's gradients were cast to f32 and `index_add_`ed
// into an f32 buffer, then cast back: five passes and atomics whose order
// varies. Here each output row is read-summed in f32 in the order given
// (`order` is a stable sort of the gathered rows by their source row) and
// rounded once: one pass over the gradients, the same bits every run.
//
// One thread block per output row; each thread owns 16-byte vectors of it.
// Rows are 16-byte aligned and `width` is a multiple of VEC (the launcher
// checks).

// (The kind's types and loads: vec_kind.cuh, prepended.)

extern "C" __global__ void gather_sum(const in_t* __restrict__ a, const in_t* __restrict__ b, i64 rows_a,
                                      const i64* __restrict__ order, const i64* __restrict__ offsets, i64 width,
                                      in_t* __restrict__ out) {
    const i64 r = blockIdx.x;
    const i64 first = offsets[r], last = offsets[r + 1];
    for (i64 c0 = (i64)threadIdx.x * VEC; c0 < width; c0 += (i64)blockDim.x * VEC) {
        float acc[VEC] = {};
#pragma unroll 4
        for (i64 e = first; e < last; e++) {
            const i64 s = order[e];
            const in_t* src = s < rows_a ? a + s * width : b + (s - rows_a) * width;
            const vec_t v = *reinterpret_cast<const vec_t*>(src + c0);
#pragma unroll
            for (int i = 0; i < VEC; i++) acc[i] += ld(v.v[i]);
        }
        vec_t o;
#pragma unroll
        for (int i = 0; i < VEC; i++) o.v[i] = st(acc[i]);
        *reinterpret_cast<vec_t*>(out + r * width + c0) = o;
    }
}
