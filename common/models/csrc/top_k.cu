// The k largest entries of each row of a [rows, V] logits tensor and their
// ids, best first, in one kernel per call (src/top_k_cuda.rs launches it;
// src/dflash2.rs's `top_k` is the same selection as libtorch ops). Compiled
// at run time by NVRTC for one input kind: -DIN_BF16=<1: bf16; 0: f32>.
//
// One thread block per row:
//   1. every thread streams the row once, 16 bytes a load, and each chunk of
//      CHUNK consecutive entries gets its maximum (a shuffle reduction over
//      the lanes that read it) into shared memory;
//   2. one warp takes the k best chunks: a chunk that holds one of the row's
//      k largest entries has a maximum at least that large, and fewer than k
//      other chunks can beat it;
//   3. the same warp reads those chunks' k * CHUNK entries again (from L2:
//      the row was read moments ago) and takes the k best of them.
// As libtorch ops this was an `amax` over [rows, V / CHUNK, CHUNK] that
// read the logits at about a fifth of the memory's rate, two `topk`s and a
// gather. Entries compare by an order key in which NaN ranks above
// everything, as `topk` ranks it; equal keys go to the lower position, so
// the result does not depend on scheduling. Rows are 16-byte aligned and V
// is a multiple of CHUNK (the launcher checks).

// (The kind's types and loads: vec_kind.cuh; the ranking keys: order_key.cuh;
// both prepended.)

#define CHUNK 128
#define THREADS 256
// Loads in flight per thread in the streaming pass.
#define UNROLL 4

// The best of this lane's entries of `keys[0..n]` (positions lane, lane +
// 32, ...).
__device__ __forceinline__ u64 lane_best(const u32* keys, int n, int lane) {
    u64 best = 0;
    for (int i = lane; i < n; i += 32) {
        const u64 p = pack(keys[i], (u32)i);
        best = p > best ? p : best;
    }
    return best;
}

// k rounds of a warp's maximum over `keys[0..n]` (n > k): `taken[j]` is
// the position of the j-th best. Each entry belongs to one lane, which marks
// it taken and rescans its own entries; no block-wide synchronization.
__device__ __forceinline__ void warp_select(u32* keys, int n, int k, int lane, int* taken) {
    u64 mine = lane_best(keys, n, lane);
    for (int j = 0; j < k; j++) {
        const u32 pos = unpack_pos(warp_max(mine));
        if (lane == 0) taken[j] = (int)pos;
        if ((int)(pos & 31u) == lane) {
            keys[pos] = 0;
            mine = lane_best(keys, n, lane);
        }
    }
    __syncwarp();
}

extern "C" __global__ void __launch_bounds__(THREADS)
    chunked_top_k(const in_t* __restrict__ logits, int v, int k, in_t* __restrict__ values, i64* __restrict__ ids) {
    extern __shared__ u32 shared[];
    const int chunks = v / CHUNK;
    u32* chunk_key = shared;                  // [chunks]
    u32* cand_key = shared + chunks;          // [k * CHUNK]
    int* best_chunk = (int*)(cand_key + k * CHUNK); // [k]
    int* best_cand = best_chunk + k;          // [k]
    const in_t* row = logits + (i64)blockIdx.x * v;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;

    // 1. Chunk maxima. LANES lanes read one chunk (a half warp in bf16, a
    // warp in f32); a warp's trips are uniform so that its shuffles are
    // whole.
    const int lanes = CHUNK / VEC;
    const int per_warp = 32 / lanes; // chunks a warp reads at once
    const int stride = (THREADS / 32) * per_warp * UNROLL;
    for (int base = warp * per_warp * UNROLL; base < chunks; base += stride) {
        vec_t a[UNROLL];
        bool valid[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; u++) {
            const int c = base + u * per_warp + lane / lanes;
            valid[u] = c < chunks;
            if (valid[u]) a[u] = *reinterpret_cast<const vec_t*>(row + (i64)c * CHUNK + (lane % lanes) * VEC);
        }
#pragma unroll
        for (int u = 0; u < UNROLL; u++) {
            u32 m = 0;
            if (valid[u]) {
#pragma unroll
                for (int e = 0; e < VEC; e++) m = max(m, order_key(ld(a[u].v[e])));
            }
            for (int o = lanes / 2; o > 0; o >>= 1) m = max(m, __shfl_xor_sync(0xFFFFFFFFu, m, o));
            const int c = base + u * per_warp + lane / lanes;
            if (valid[u] && lane % lanes == 0) chunk_key[c] = m;
        }
    }
    __syncthreads();
    if (warp != 0) return;

    // 2. The k best chunks.
    warp_select(chunk_key, chunks, k, lane, best_chunk);

    // 3. Their entries, and the k best of them.
    for (int i = lane; i < k * CHUNK; i += 32) {
        cand_key[i] = order_key(ld(row[(i64)best_chunk[i / CHUNK] * CHUNK + i % CHUNK]));
    }
    __syncwarp();
    warp_select(cand_key, k * CHUNK, k, lane, best_cand);
    for (int j = lane; j < k; j += 32) {
        const int p = best_cand[j];
        const i64 id = (i64)best_chunk[p / CHUNK] * CHUNK + p % CHUNK;
        ids[(i64)blockIdx.x * k + j] = id;
        values[(i64)blockIdx.x * k + j] = row[id]; // the entry itself, NaN's bits too
    }
}
