// The input kind of the row kernels (fused.cu, block_conv.cu, top_k.cu,
// gather_sum.cu, fused_layers.cu, softmax_rows.cu), prepended to their source by the Rust side
// (NVRTC is given one string, no include path): -DIN_BF16=<1: bf16; 0: f32>.
// Loads widen to f32; stores round to nearest even. Rows move as 16-byte
// vectors of VEC elements.

#if IN_BF16
typedef unsigned short in_t;
#define VEC 8
__device__ __forceinline__ float ld(in_t x) { return __uint_as_float(((unsigned)x) << 16); }
// Round to nearest even; Inf stays Inf and NaN a (quiet) NaN: rounding
// would carry NaN's mantissa into the exponent, the sign, or wrap it to zero,
// and a NaN must reach the step's check.
__device__ __forceinline__ in_t st(float f) {
    unsigned b = __float_as_uint(f);
    if ((b & 0x7FFFFFFFu) > 0x7F800000u) return (in_t)((b >> 16) | 0x40u);
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

// One 16-byte vector of a row, widened to f32; and stored back, rounded.
__device__ __forceinline__ void load(const in_t* p, float* f) {
    const vec_t a = *reinterpret_cast<const vec_t*>(p);
#pragma unroll
    for (int e = 0; e < VEC; e++) f[e] = ld(a.v[e]);
}

__device__ __forceinline__ void store(in_t* p, const float* f) {
    vec_t a;
#pragma unroll
    for (int e = 0; e < VEC; e++) a.v[e] = st(f[e]);
    *reinterpret_cast<vec_t*>(p) = a;
}
