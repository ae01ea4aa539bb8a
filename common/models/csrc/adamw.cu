// One AdamW step of one half-precision parameter with f32 master weights
// (src/adamw_cuda.rs launches it), in one pass: the gradient read in its
// own kind, the f32 master and moments updated in place, the parameter
// rewritten from the new master. Where libtorch's fused kernel takes f32
// gradients and leaves the parameter to refresh, that was a cast of every
// gradient to f32 and a copy of every master back: two more passes.
// The arithmetic is `_fused_adamw_`'s (ATen's fused_adam_utils.cuh, ADAMW
// mode), in f32:
//   g = grad / divisor;  master -= lr * weight_decay * master
//   m = beta1 m + (1 - beta1) g;  v = beta2 v + (1 - beta2) g^2
//   master -= step_size * m / (sqrt(v) / bias2_sqrt + eps)
// with step_size = lr / (1 - beta1^step), bias2_sqrt = sqrt(1 - beta2^step).
// Each thread owns VEC consecutive elements (the launcher checks that the
// tensor is whole, aligned vectors).

// (The kind's types and loads: vec_kind.cuh, prepended.)

__device__ __forceinline__ void load_f32(const float* p, float* f) {
#pragma unroll
    for (int e = 0; e < VEC; e += 4) {
        const float4 a = *reinterpret_cast<const float4*>(p + e);
        f[e] = a.x, f[e + 1] = a.y, f[e + 2] = a.z, f[e + 3] = a.w;
    }
}

__device__ __forceinline__ void store_f32(float* p, const float* f) {
#pragma unroll
    for (int e = 0; e < VEC; e += 4) *reinterpret_cast<float4*>(p + e) = make_float4(f[e], f[e + 1], f[e + 2], f[e + 3]);
}

extern "C" __global__ void adamw_step(float* __restrict__ master, float* __restrict__ exp_avg,
                                      float* __restrict__ exp_avg_sq, const in_t* __restrict__ grad,
                                      in_t* __restrict__ param, i64 vectors, float divisor, float lr, float beta1,
                                      float beta2, float weight_decay, float eps, float step_size, float bias2_sqrt) {
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= vectors) return;
    const i64 at = i * VEC;
    float g[VEC], w[VEC], m[VEC], v[VEC];
    load(grad + at, g);
    load_f32(master + at, w);
    load_f32(exp_avg + at, m);
    load_f32(exp_avg_sq + at, v);
#pragma unroll
    for (int e = 0; e < VEC; e++) {
        const float gr = g[e] / divisor;
        w[e] -= lr * weight_decay * w[e];
        m[e] = beta1 * m[e] + (1.0f - beta1) * gr;
        v[e] = beta2 * v[e] + (1.0f - beta2) * gr * gr;
        const float denom = sqrtf(v[e]) / bias2_sqrt + eps;
        w[e] -= step_size * m[e] / denom;
    }
    store_f32(master + at, w);
    store_f32(exp_avg + at, m);
    store_f32(exp_avg_sq + at, v);
    store(param + at, w);
}
