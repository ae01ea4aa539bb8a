// The drafter layer's RoPE and SwiGLU, each direction one pass
// (csrc/fused_layers.cpp holds the autograd functions; src/fused_layers.rs
// launches these), compiled at run time by NVRTC for one input kind:
// -DIN_BF16=<1: bf16; 0: f32>. All math in f32, one rounding per output.
// Rows are 16-byte aligned and whole vectors (the launcher checks).

// (The kind's types and loads: vec_kind.cuh, prepended.)

// x [rows, heads, d], tables [table_rows, d] (row r reads r % table_rows).
// Each thread owns one vector of a head's first half and the same vector
// of its second half:
//   forward  (backward = 0): y1 = x1 c1 - x2 s1, y2 = x2 c2 + x1 s2
//   backward (backward = 1): y1 = x1 c1 + x2 s2, y2 = x2 c2 - x1 s1
// (the backward is the forward's transpose, x then being the output's
// gradient).
extern "C" __global__ void rope(const in_t* __restrict__ x, const in_t* __restrict__ cos,
                                const in_t* __restrict__ sin, i64 rows, int heads, int d, i64 table_rows,
                                int backward, in_t* __restrict__ y) {
    const int half = d / 2, per_head = half / VEC;
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= rows * heads * per_head) return;
    const i64 head_row = i / per_head; // row * heads + head
    const int at = (int)(i % per_head) * VEC;
    const i64 table = (head_row / heads) % table_rows * d + at;
    const i64 first = head_row * d + at;
    float x1[VEC], x2[VEC], c1[VEC], c2[VEC], s1[VEC], s2[VEC], y1[VEC], y2[VEC];
    load(x + first, x1);
    load(x + first + half, x2);
    load(cos + table, c1);
    load(cos + table + half, c2);
    load(sin + table, s1);
    load(sin + table + half, s2);
#pragma unroll
    for (int e = 0; e < VEC; e++) {
        if (backward) {
            y1[e] = x1[e] * c1[e] + x2[e] * s2[e];
            y2[e] = x2[e] * c2[e] - x1[e] * s1[e];
        } else {
            y1[e] = x1[e] * c1[e] - x2[e] * s1[e];
            y2[e] = x2[e] * c2[e] + x1[e] * s2[e];
        }
    }
    store(y + first, y1);
    store(y + first + half, y2);
}

// out = silu(gate) * up over `vectors` vectors.
extern "C" __global__ void swiglu_forward(const in_t* __restrict__ gate, const in_t* __restrict__ up, i64 vectors,
                                          in_t* __restrict__ out) {
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= vectors) return;
    float g[VEC], u[VEC], o[VEC];
    load(gate + i * VEC, g);
    load(up + i * VEC, u);
#pragma unroll
    for (int e = 0; e < VEC; e++) o[e] = g[e] / (1.0f + __expf(-g[e])) * u[e];
    store(out + i * VEC, o);
}

// With s = sigmoid(gate): d_up = dy silu(gate), d_gate = dy up s (1 + gate (1 - s)).
extern "C" __global__ void swiglu_backward(const in_t* __restrict__ dy, const in_t* __restrict__ gate,
                                           const in_t* __restrict__ up, i64 vectors, in_t* __restrict__ d_gate,
                                           in_t* __restrict__ d_up) {
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= vectors) return;
    float g[VEC], u[VEC], d[VEC], dg[VEC], du[VEC];
    load(dy + i * VEC, d);
    load(gate + i * VEC, g);
    load(up + i * VEC, u);
#pragma unroll
    for (int e = 0; e < VEC; e++) {
        const float s = 1.0f / (1.0f + __expf(-g[e]));
        du[e] = d[e] * g[e] * s;
        dg[e] = d[e] * u[e] * s * (1.0f + g[e] * (1.0f - s));
    }
    store(d_gate + i * VEC, dg);
    store(d_up + i * VEC, du);
}
