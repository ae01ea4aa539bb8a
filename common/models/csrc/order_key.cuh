// Ranking floats as torch's top-k and argmax rank them (top_k.cu,
// softmax_rows.cu; prepended after vec_kind.cuh): every NaN above every
// number, and among equal keys the lowest position first, so that a
// result does not depend on how threads were scheduled.

typedef unsigned int u32;
typedef unsigned long long u64;

// Monotone in the float's value; every NaN maps to the top key. No real
// value maps to 0, which marks a taken entry.
__device__ __forceinline__ u32 order_key(float f) {
    const u32 b = __float_as_uint(f);
    if ((b & 0x7FFFFFFFu) > 0x7F800000u) return 0xFFFFFFFFu;
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// A key with its position, so that one unsigned maximum picks the best key
// and, among equal keys, the lowest position.
__device__ __forceinline__ u64 pack(u32 key, u32 pos) { return ((u64)key << 32) | (u64)(0xFFFFFFFFu - pos); }
__device__ __forceinline__ u32 unpack_pos(u64 p) { return 0xFFFFFFFFu - (u32)p; }

__device__ __forceinline__ u64 warp_max(u64 v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const u64 other = __shfl_xor_sync(0xFFFFFFFFu, v, o);
        v = other > v ? other : v;
    }
    return v;
}
