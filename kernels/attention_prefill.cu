// attention_prefill_{fmt}: the causal grouped-query attention of attention.cu for prompts,
// flash-attention style. Grid: x = kv_heads × ceil(n_q × group / rows), y = 1; block (kh, b) takes rows
// b × rows .. of KV head kh (wl_attention.cuh: the (query, head) pairs of the group), stages
// their queries in shared memory once, then for each tile of WL_FA_KEYS keys up to the causal
// end of its last query (from the window start of its first) loads the K and V rows, decoded
// from the cache format, into shared memory, and folds them into every row's running softmax:
// lane j scores key j of the tile (one fmaf chain over the dims), the row's tile maximum and
// probability sum are warp butterflies, and each lane updates the accumulators of its dims
// lane + 32 r with the 32 probabilities in key order. Each warp takes a quarter of the rows.
// No score matrix and no partial results reach global memory. The argument `rows` counts the
// cache layer's rows: the key at position j is in its row j % rows (wl_kv_cache_row), as
// attention_{fmt} reads it.
//
// Bytes read per call: each block reads the K/V rows of its keys once for all its rows, so the
// cache is read ceil(n_q × group / rows) / n_q × (causal half) times per KV head, against once
// per query in attention_{fmt}: for a 1.1B llama at 512 tokens (group 8, 32 rows a block) a
// quarter of the query-by-query reads. The bound it should reach is compute, not memory: about
// 4 × n_q² / 2 × n_heads × head_dim flops in f32 (1.1 GFLOP a layer at 512 tokens, tens of µs
// on an H200's CUDA cores); attention_prefill_mma_{fmt} (attention_prefill_mma.cu) is the same in
// fast mode on tensor cores.
#include "wl_attention.cuh"

template <int R, typename K, typename V>
__device__ __forceinline__ void wl_attention_prefill_body(
    const float* q, K k, V v, float* out, wl_u64 n_q, wl_u64 start, wl_u64 n_heads,
    wl_u64 kv_heads, int head_dim, float scale, int f16_operands, wl_u64 window, float softcap,
    wl_u64 rows, float* s_q, float* s_k, float* s_v) {
    constexpr int ROWS = WL_FA_ROWS(R);
    constexpr int RW = ROWS / WL_ATT_WARPS;
    constexpr int QS = R * 32;      // staged query stride
    constexpr int KS = R * 32 + 1;  // staged key stride (bank offset per key)
    constexpr int VS = R * 32;      // staged value stride
    const int lane = threadIdx.x % 32;
    const int warp = threadIdx.x / 32;
    const wl_u64 group = n_heads / kv_heads;
    const wl_u64 n_rows = n_q * group;
    const wl_u64 tiles = (n_rows + ROWS - 1) / ROWS;
    const wl_u64 kh = blockIdx.x / tiles;
    const wl_u64 r0 = (blockIdx.x % tiles) * (wl_u64)ROWS;
    if (kh >= kv_heads) return;
    const wl_u64 r_end = r0 + ROWS < n_rows ? r0 + ROWS : n_rows;
    const wl_u64 hd = (wl_u64)head_dim;
    const wl_u64 kvd = kv_heads * hd;
    const float neg_inf = wl_bits_to_f32(0xff800000u);
    // the block's queries, rounded as attention_{fmt} rounds them
    for (int e = (int)threadIdx.x; e < ROWS * QS; e += (int)blockDim.x) {
        const wl_u64 r = r0 + (wl_u64)(e / QS);
        const int d = e % QS;
        float x = 0.0f;
        if (r < r_end && d < head_dim) {
            const wl_u64 i = r / group;
            const wl_u64 h = kh * group + r % group;
            x = q[(i * n_heads + h) * hd + (wl_u64)d];
        }
        s_q[e] = f16_operands ? wl_att_round(x) : x;
    }
    const wl_u64 key_end = start + (r_end - 1) / group + 1;
    const wl_u64 key_lo = wl_fa_first_key(start, r0 / group, window);
    float m[RW];
    float l[RW];
    float acc[RW][R];
#pragma unroll
    for (int w = 0; w < RW; w++) {
        m[w] = neg_inf;
        l[w] = 0.0f;
#pragma unroll
        for (int r = 0; r < R; r++) acc[w][r] = 0.0f;
    }
    for (wl_u64 t0 = key_lo / WL_FA_KEYS * WL_FA_KEYS; t0 < key_end; t0 += WL_FA_KEYS) {
        // the previous tile's readers are done before it is overwritten
        __syncthreads();
        for (int jj = warp; jj < WL_FA_KEYS; jj += WL_ATT_WARPS) {
            const wl_u64 j = t0 + (wl_u64)jj;
            // j < key_end is the same for the whole warp, and so is d < head_dim whenever a
            // reader shuffles (the turned formats need head_dim a multiple of 32)
            const bool in = j < key_end;
            const wl_u64 row = wl_kv_cache_row(j, rows) * kvd + kh * hd;
#pragma unroll
            for (int r = 0; r < R; r++) {
                const int d = lane + 32 * r;
                s_k[jj * KS + d] = in && d < head_dim ? k.at(row + (wl_u64)d, lane) : 0.0f;
                s_v[jj * VS + d] = in && d < head_dim ? v.at(row + (wl_u64)d, lane) : 0.0f;
            }
        }
        __syncthreads();
#pragma unroll
        for (int w = 0; w < RW; w++) {
            const wl_u64 r = r0 + (wl_u64)(warp * RW + w);
            if (r >= r_end) continue;
            const wl_u64 i = r / group;
            const wl_u64 j = t0 + (wl_u64)lane;
            const int valid = j < start + i + 1 && j >= wl_fa_first_key(start, i, window);
            const float* qs = s_q + (warp * RW + w) * QS;
            const float* ks = s_k + lane * KS;
            float t = 0.0f;
            for (int d = 0; d < head_dim; d++) t = fmaf(qs[d], ks[d], t);
            const float wt = valid ? wl_fa_weight(t, scale, softcap) : neg_inf;
            float mt = wt;
            for (int o = 16; o > 0; o >>= 1) mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, o));
            const float m_new = fmaxf(m[w], mt);
            // a tile with no key of this row yet (its window starts later): nothing to fold
            if (m_new == neg_inf) continue;
            const float p = wl_fa_p(wt, valid, m_new, f16_operands);
            float ps = p;
            for (int o = 16; o > 0; o >>= 1) ps = WL_ADD(ps, __shfl_xor_sync(0xffffffffu, ps, o));
            const float keep = wl_fa_keep(m[w], m_new);
            l[w] = wl_fa_sum(l[w], keep, ps);
            m[w] = m_new;
            // each accumulator: rescaled, then the tile's keys in order (one shuffle a key for
            // all of the lane's dims)
#pragma unroll
            for (int r = 0; r < R; r++) acc[w][r] = WL_MUL(acc[w][r], keep);
            for (int jj = 0; jj < WL_FA_KEYS; jj++) {
                const float pj = __shfl_sync(0xffffffffu, p, jj);
                const float* vs = s_v + jj * VS + lane;
#pragma unroll
                for (int r = 0; r < R; r++) acc[w][r] = fmaf(pj, vs[32 * r], acc[w][r]);
            }
        }
    }
#pragma unroll
    for (int w = 0; w < RW; w++) {
        const wl_u64 r = r0 + (wl_u64)(warp * RW + w);
        if (r >= r_end) continue;
        const wl_u64 i = r / group;
        const wl_u64 h = kh * group + r % group;
        const float inv = 1.0f / l[w];
#pragma unroll
        for (int rr = 0; rr < R; rr++) {
            const int d = lane + 32 * rr;
            if (d < head_dim) out[(i * n_heads + h) * hd + (wl_u64)d] = WL_MUL(acc[w][rr], inv);
        }
    }
}

template <typename K, typename V>
__device__ __forceinline__ void wl_attention_prefill(const float* q, K k, V v, float* out,
                                                     wl_u64 n_q, wl_u64 start, wl_u64 n_heads,
                                                     wl_u64 kv_heads, int head_dim, float scale,
                                                     int f16_operands, wl_u64 window,
                                                     float softcap, wl_u64 rows) {
    __shared__ float s_q[WL_FA_Q_FLOATS];
    __shared__ float s_k[WL_FA_K_FLOATS];
    __shared__ float s_v[WL_FA_V_FLOATS];
    // the host checks these; a launch that breaks them writes nothing rather than out of bounds
    if (head_dim <= 0 || head_dim > WL_FA_MAX_HD || kv_heads == 0 || n_heads % kv_heads != 0 ||
        rows == 0)
        return;
    if (wl_att_lane_dims(head_dim) == 2) {
        wl_attention_prefill_body<2>(q, k, v, out, n_q, start, n_heads, kv_heads, head_dim, scale,
                                     f16_operands, window, softcap, rows, s_q, s_k, s_v);
    } else {
        wl_attention_prefill_body<4>(q, k, v, out, n_q, start, n_heads, kv_heads, head_dim, scale,
                                     f16_operands, window, softcap, rows, s_q, s_k, s_v);
    }
}

#define WL_ATTENTION_PREFILL(NAME, KT, KR, VT, VR)                                                 \
    extern "C" __global__ void __launch_bounds__(WL_ATT_THREADS)                                   \
        attention_prefill_##NAME(const float* q, const KT* k, const VT* v, float* out, wl_u64 n_q, \
                                 wl_u64 start, wl_u64 n_heads, wl_u64 kv_heads, int head_dim,      \
                                 float scale, int f16_operands, wl_u64 window, float softcap,      \
                                 wl_u64 rows) {                                                    \
        wl_attention_prefill(q, KR{k}, VR{v}, out, n_q, start, n_heads, kv_heads, head_dim, scale, \
                             f16_operands, window, softcap, rows);                                 \
    }

WL_ATTENTION_PREFILL(f32, float, WlKvF32, float, WlKvF32)
WL_ATTENTION_PREFILL(f16, wl_u16, WlKvF16, wl_u16, WlKvF16)
WL_ATTENTION_PREFILL(bf16, wl_u16, WlKvBf16, wl_u16, WlKvBf16)
WL_ATTENTION_PREFILL(e4m3, wl_u8, WlKvE4M3, wl_u8, WlKvE4M3)
WL_ATTENTION_PREFILL(q8, wl_u8, WlKvTurned<127>, wl_u8, WlKvTurned<127>)
WL_ATTENTION_PREFILL(q4, wl_u8, WlKvTurned<7>, wl_u8, WlKvTurned<7>)
WL_ATTENTION_PREFILL(q8_q4, wl_u8, WlKvTurned<127>, wl_u8, WlKvTurned<7>)
