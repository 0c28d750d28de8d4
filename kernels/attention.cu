// attention_{fmt}: causal grouped-query attention over the KV cache, with a running (online)
// softmax, so no score matrix is held, and the keys split across blocks (flash-decoding), so a
// decode step fills the GPU however few KV heads there are. The cache rows are read in their
// storage format (f32, f16, e4m3, or Hadamard-turned q8/q4 groups; attention_q8_q4 is the q6
// cache: K q8, V q4) and decoded as they are read, so no decoded copy of the cache exists.
//
// Grid: x = n_splits × kv_heads × chunks, y = queries (striding past 65535). Block (s, g, i)
// takes split s of the keys of query i (at position start + i, seeing keys 0..=start + i, or
// its sliding window's last `window` of them; the splits cut the keys from the first query's
// window start, so a sliding-window layer's blocks all meet keys of its window) for
// the query heads of KV head g, all of them (GQA), or wl_att_block_heads(head_dim) of them per
// chunk when the group is wider: every K/V row it reads meets all its heads, so the cache is
// read once per block, not once per query head. Warp w takes keys lo + w, lo + w + 4, ... of the
// split; its lanes split the head's dims (lane l holds dims l, l + 32, ...), each score is a warp
// reduction, and the warp keeps a running maximum m, sum l and weighted values acc per head.
// That lane layout is the turned groups' (a 32-value group decodes by a butterfly across the
// warp), so a row is read as whole 32-byte sectors rather than 128-bit loads a lane.
// The four warps are merged at the end (out = sum_w acc_w e^(m_w - M) / sum_w l_w e^(m_w - M),
// M the largest m_w). With one split the block writes the output; with several it writes the
// merged (m, l, acc) of its split to the scratch (wl_att_part_*) and attention_reduce_f32 merges
// the splits in order the same way. With f16_operands each query value and each weight is
// rounded to f16 first, as llama.cpp's CPU products meet an f16 cache (the CPU backend's
// reference does the same).
//
// Why a second kernel and not the last block to finish: the reduce reads every split in a fixed
// order, so the result does not depend on which block ends last, no counter has to be zeroed
// before a call (or survive a failed one) in the scratch, and a captured graph runs the pair as
// two nodes with no host work between them. It costs one launch of n_q × n_heads small blocks.
//
// A decode step replayed from a CUDA graph cannot pass its position at launch: the graph keeps
// the arguments it was captured with. Such a call passes `pos` (the device positions RoPE
// reads) and `span` (the keys split, from the first query's window start): the first query's
// position is read on the device, and the keys are split over the whole span, a count fixed
// for many positions (the engine's span of the step, and for a sliding-window layer at most
// its window: attention_window_span in weightlift-kernels), so the grid never changes. The
// blocks of splits past the current length exit at once, and the reduce merges only the splits
// that hold keys (wl_att_live_splits). A call with `pos` null splits the keys it sees, as before.
//
// Bytes read per call: the K and V rows 0..start + n_q of every KV head, once per chunk of its
// group (decode on a 1.1B llama at 2,048 positions, f16 cache: 2,048 × 4 heads × 64 × 2 B × 2 =
// 2 MiB a layer), the queries, and, split, n_q × n_heads × splits × (head_dim + 2) × 4 B of
// partial results written once and read back once (64 splits: 0.5 MiB each way). The host picks
// the splits (attention_grid in weightlift-kernels) so that every SM gets about two blocks of at
// least 32 keys each, so a block costs about the same at 2,048 positions as at 64. The bound it
// should reach: those 3 MiB take under 1 µs at the H200's 4.2 TB/s copy rate, so the call should
// cost two launches plus a few memory round trips per block (a few µs), not one SM walking all
// the keys of a head (1.1 ms a layer at 2,048 positions before). Target, measured on a GPU:
// decode at 2,048 positions at ≥ 90 % of the rate at 64 positions.
#include "wl_attention.cuh"
#include "wl_fa_mma.cuh"

// Cache readers: `at(i, lane)` is value i of the cache half. The turned groups are decoded by
// the warp together: every lane of the warp calls `at` for the same group at once, lane l for
// value l of the group (the kernel's dims d = lane + 32 r with head_dim a multiple of 32), and
// the turn back is a butterfly over the lanes in the codec's order.
struct WlKvF32 {
    const float* p;
    __device__ __forceinline__ float at(wl_u64 i, int) const { return p[i]; }
};
struct WlKvF16 {
    const wl_u16* p;
    __device__ __forceinline__ float at(wl_u64 i, int) const { return wl_f16_to_f32_fast(p[i]); }
};
struct WlKvE4M3 {
    const wl_u8* p;
    __device__ __forceinline__ float at(wl_u64 i, int) const { return wl_e4m3_decode(p[i]); }
};
template <int QMAX>
struct WlKvTurned {
    const wl_u8* p;
    __device__ __forceinline__ float at(wl_u64 i, int lane) const {
        float x = wl_kv_dequant(p + (i / 32) * (wl_u64)wl_kv_group_bytes(QMAX), lane, QMAX);
        for (int h = 1; h < 32; h *= 2) {
            float other = __shfl_xor_sync(0xffffffffu, x, h);
            // lane j (bit h clear) keeps a + b, lane j + h keeps a - b, as the codec's stage h
            x = (lane & h) ? WL_SUB(other, x) : WL_ADD(x, other);
        }
        return WL_MUL(x, wl_bits_to_f32(WL_KV_TURN_NORM));
    }
};

// Shared memory of one block, declared once in the kernel (a __shared__ array inside the body
// would be allocated once per register layout it is instantiated for).
struct WlAttShared {
    float* acc;  // [WL_ATT_WARPS][WL_ATT_REGS * 32]: warp w, head g, dim d at g * R * 32 + d
    float* m;    // [WL_ATT_WARPS][WL_ATT_MAX_GROUP]
    float* l;    // [WL_ATT_WARPS][WL_ATT_MAX_GROUP]
    float* f;    // [WL_ATT_WARPS][WL_ATT_MAX_GROUP]: each warp's weight in the merge
    float* mm;   // [WL_ATT_MAX_GROUP]: the merged maximum
    float* ll;   // [WL_ATT_MAX_GROUP]: the merged sum
};

// The block body for R dims a lane and at most HB heads a block (R * HB <= WL_ATT_REGS), so the
// queries and accumulators of every head stay in registers.
template <int R, int HB, typename K, typename V>
__device__ __forceinline__ void wl_attention_body(const float* q, K k, V v, float* out,
                                                  wl_u64 n_q, wl_u64 start, wl_u64 base, wl_u64 keys,
                                                  wl_u64 n_heads, wl_u64 kv_heads, int head_dim,
                                                  float scale, int f16_operands, wl_u64 n_splits,
                                                  wl_u64 window, float softcap, wl_u64 rows,
                                                  WlAttShared sh) {
    const int lane = threadIdx.x % 32;
    const int warp = threadIdx.x / 32;
    const wl_u64 group = n_heads / kv_heads;
    const wl_u64 chunks = (group + HB - 1) / HB;
    const wl_u64 s = blockIdx.x % n_splits;
    const wl_u64 hc = blockIdx.x / n_splits;
    const wl_u64 kh = hc / chunks;
    const wl_u64 first = (hc % chunks) * HB;
    const wl_u64 h0 = kh * group + first;
    const int ng = group - first < (wl_u64)HB ? (int)(group - first) : HB;
    const wl_u64 hd = (wl_u64)head_dim;
    const wl_u64 kvd = kv_heads * hd;
    const wl_u64 per = wl_att_split_keys(keys, n_splits);
    const float neg_inf = wl_bits_to_f32(0xff800000u);
    for (wl_u64 i = blockIdx.y; i < n_q; i += gridDim.y) {
        // a split past this query's keys holds none: the block writes nothing for it, and the
        // reduce does not read it (the same for every thread of the block)
        if (s >= wl_att_live_splits(per, base, start + i + 1, n_splits)) continue;
        float qr[HB][R];
        float acc[HB][R];
        float m[HB];
        float l[HB];
#pragma unroll
        for (int g = 0; g < HB; g++) {
            const float* qi = q + (i * n_heads + h0 + (wl_u64)g) * hd;
#pragma unroll
            for (int r = 0; r < R; r++) {
                int d = lane + 32 * r;
                float x = g < ng && d < head_dim ? qi[d] : 0.0f;
                qr[g][r] = f16_operands ? wl_att_round(x) : x;
                acc[g][r] = 0.0f;
            }
            m[g] = neg_inf;
            l[g] = 0.0f;
        }
        wl_u64 lo, hi;
        wl_att_split_range(per, s, base, start, i, window, &lo, &hi);
        for (wl_u64 j = lo + (wl_u64)warp; j < hi; j += WL_ATT_WARPS) {
            const wl_u64 row = wl_kv_cache_row(j, rows) * kvd + kh * hd;
            // d < head_dim is the same for all lanes of a warp whenever the reader shuffles
            // (the turned formats need head_dim a multiple of 32)
            float kr[R];
            float vr[R];
#pragma unroll
            for (int r = 0; r < R; r++) {
                int d = lane + 32 * r;
                kr[r] = d < head_dim ? k.at(row + (wl_u64)d, lane) : 0.0f;
            }
#pragma unroll
            for (int r = 0; r < R; r++) {
                int d = lane + 32 * r;
                vr[r] = d < head_dim ? v.at(row + (wl_u64)d, lane) : 0.0f;
            }
#pragma unroll
            for (int g = 0; g < HB; g++) {
                if (g < ng) {
                    float t = 0.0f;
#pragma unroll
                    for (int r = 0; r < R; r++) t = fmaf(qr[g][r], kr[r], t);
                    for (int o = 16; o > 0; o >>= 1) t = WL_ADD(t, __shfl_xor_sync(0xffffffffu, t, o));
                    float keep, p;
                    float w = WL_MUL(t, scale);
                    // soft-capping (gemma2): softcap * tanh(w / softcap)
                    if (softcap > 0.0f) w = WL_MUL(softcap, tanhf(w / softcap));
                    wl_att_step(w, f16_operands, &m[g], &l[g], &keep, &p);
#pragma unroll
                    for (int r = 0; r < R; r++) acc[g][r] = wl_att_accumulate(acc[g][r], keep, p, vr[r]);
                }
            }
        }
        // merge the warps: each warp's state to shared memory, the weights per head, then the
        // accumulators of every (head, dim) of the block
        float* wacc = sh.acc + warp * (WL_ATT_REGS * 32);
#pragma unroll
        for (int g = 0; g < HB; g++) {
#pragma unroll
            for (int r = 0; r < R; r++) wacc[g * R * 32 + r * 32 + lane] = acc[g][r];
            if (lane == 0) {
                sh.m[warp * WL_ATT_MAX_GROUP + g] = m[g];
                sh.l[warp * WL_ATT_MAX_GROUP + g] = l[g];
            }
        }
        __syncthreads();
        if (threadIdx.x < (unsigned)ng) {
            int g = threadIdx.x;
            float mm = wl_att_merge_max(sh.m + g, WL_ATT_WARPS, WL_ATT_MAX_GROUP);
            float ll = 0.0f;
            for (int w = 0; w < WL_ATT_WARPS; w++) {
                float f = wl_att_merge_factor(sh.m[w * WL_ATT_MAX_GROUP + g], mm);
                sh.f[w * WL_ATT_MAX_GROUP + g] = f;
                ll = fmaf(sh.l[w * WL_ATT_MAX_GROUP + g], f, ll);
            }
            sh.mm[g] = mm;
            sh.ll[g] = ll;
        }
        __syncthreads();
        const wl_u64 n_out = (wl_u64)ng * hd;
        for (wl_u64 e = threadIdx.x; e < n_out; e += blockDim.x) {
            int g = (int)(e / hd);
            int d = (int)(e % hd);
            float a = 0.0f;
            for (int w = 0; w < WL_ATT_WARPS; w++) {
                a = fmaf(sh.acc[w * (WL_ATT_REGS * 32) + g * R * 32 + d],
                         sh.f[w * WL_ATT_MAX_GROUP + g], a);
            }
            const wl_u64 h = h0 + (wl_u64)g;
            if (n_splits == 1) {
                out[(i * n_heads + h) * hd + (wl_u64)d] = WL_MUL(a, 1.0f / sh.ll[g]);
            } else {
                wl_u64 rec = wl_att_part_record(i, h, s, n_heads, n_splits);
                out[wl_att_part_acc(rec, head_dim) + (wl_u64)d] = a;
                if (d == 0) {
                    wl_u64 ml = wl_att_part_ml(rec, n_q, n_heads, n_splits, head_dim);
                    out[ml] = sh.mm[g];
                    out[ml + 1] = sh.ll[g];
                }
            }
        }
        // the shared arrays are reused by the next query of this block
        __syncthreads();
    }
}

template <typename K, typename V>
__device__ __forceinline__ void wl_attention(const float* q, K k, V v, float* out, wl_u64 n_q,
                                             wl_u64 start_arg, wl_u64 n_heads, wl_u64 kv_heads,
                                             int head_dim, float scale, int f16_operands,
                                             wl_u64 n_splits, wl_u64 window, float softcap,
                                             const int* pos, wl_u64 span, wl_u64 rows) {
    __shared__ float s_acc[WL_ATT_WARPS * WL_ATT_REGS * 32];
    __shared__ float s_m[WL_ATT_WARPS * WL_ATT_MAX_GROUP];
    __shared__ float s_l[WL_ATT_WARPS * WL_ATT_MAX_GROUP];
    __shared__ float s_f[WL_ATT_WARPS * WL_ATT_MAX_GROUP];
    __shared__ float s_mm[WL_ATT_MAX_GROUP];
    __shared__ float s_ll[WL_ATT_MAX_GROUP];
    WlAttShared sh = {s_acc, s_m, s_l, s_f, s_mm, s_ll};
    // the host checks these; a launch that breaks them writes nothing rather than out of bounds
    if (n_splits == 0 || n_splits > WL_ATT_MAX_SPLITS || head_dim > WL_ATT_MAX_HD || kv_heads == 0 ||
        rows == 0)
        return;
    wl_u64 start, base, keys;
    if (!wl_att_where(pos, start_arg, n_q, window, span, &start, &base, &keys)) return;
    // the head counts are wl_att_block_heads(head_dim), which the host's grid uses too
    switch (wl_att_lane_dims(head_dim)) {
        case 2:
            wl_attention_body<2, WL_ATT_HEADS(2)>(q, k, v, out, n_q, start, base, keys, n_heads,
                                                  kv_heads, head_dim, scale, f16_operands,
                                                  n_splits, window, softcap, rows, sh);
            break;
        case 4:
            wl_attention_body<4, WL_ATT_HEADS(4)>(q, k, v, out, n_q, start, base, keys, n_heads,
                                                  kv_heads, head_dim, scale, f16_operands,
                                                  n_splits, window, softcap, rows, sh);
            break;
        default:
            wl_attention_body<8, WL_ATT_HEADS(8)>(q, k, v, out, n_q, start, base, keys, n_heads,
                                                  kv_heads, head_dim, scale, f16_operands,
                                                  n_splits, window, softcap, rows, sh);
            break;
    }
}

// `out` is the output (n_q × n_heads × head_dim) when n_splits is 1, else the scratch of partial
// results that attention_reduce_f32 merges into the output. `pos` null: the queries start at
// `start`; else at pos[0], read on the device, with `span` keys split from the first query's
// window start (wl_att_where).
// `rows`: the rows k and v hold; the key at position j is read from row j % rows
// (wl_kv_cache_row: a sliding-window layer's ring), and the host checks that the ring still
// holds every key the window lets a query see.
#define WL_ATTENTION(NAME, KT, KR, VT, VR)                                                         \
    extern "C" __global__ void __launch_bounds__(WL_ATT_THREADS)                                   \
        attention_##NAME(const float* q, const KT* k, const VT* v, float* out, wl_u64 n_q,         \
                         wl_u64 start, wl_u64 n_heads, wl_u64 kv_heads, int head_dim, float scale, \
                         int f16_operands, wl_u64 n_splits, wl_u64 window, float softcap,          \
                         const int* pos, wl_u64 span, wl_u64 rows) {                               \
        wl_attention(q, KR{k}, VR{v}, out, n_q, start, n_heads, kv_heads, head_dim, scale,         \
                     f16_operands, n_splits, window, softcap, pos, span, rows);                    \
    }

WL_ATTENTION(f32, float, WlKvF32, float, WlKvF32)
WL_ATTENTION(f16, wl_u16, WlKvF16, wl_u16, WlKvF16)
WL_ATTENTION(bf16, wl_u16, WlKvBf16, wl_u16, WlKvBf16)
WL_ATTENTION(e4m3, wl_u8, WlKvE4M3, wl_u8, WlKvE4M3)
WL_ATTENTION(q8, wl_u8, WlKvTurned<127>, wl_u8, WlKvTurned<127>)
WL_ATTENTION(q4, wl_u8, WlKvTurned<7>, wl_u8, WlKvTurned<7>)
WL_ATTENTION(q8_q4, wl_u8, WlKvTurned<127>, wl_u8, WlKvTurned<7>)

// The splits of attention_{fmt} merged: block (h, i) merges the partial states of head h of
// query i in split order (weights e^(m_s - M), M the largest m_s, splits that met no key
// weighing 0) and writes out = sum_s acc_s e^(m_s - M) / sum_s l_s e^(m_s - M). It reads only
// the splits that hold keys of the query (wl_att_live_splits; the blocks of the others wrote
// nothing), found from the same position, span, start and window as attention_{fmt}'s. Reads at most
// n_q × n_heads × n_splits × (head_dim + 2) values, writes n_q × n_heads × head_dim.
extern "C" __global__ __launch_bounds__(WL_ATT_THREADS) void attention_reduce_f32(
    const float* part, float* out, wl_u64 n_q, wl_u64 n_heads, int head_dim, wl_u64 n_splits,
    wl_u64 start_arg, const int* pos, wl_u64 span, wl_u64 window) {
    __shared__ float s_f[WL_ATT_MAX_SPLITS];
    __shared__ float s_inv;
    if (n_splits == 0 || n_splits > WL_ATT_MAX_SPLITS) return;
    wl_u64 start, base, keys;
    if (!wl_att_where(pos, start_arg, n_q, window, span, &start, &base, &keys)) return;
    const wl_u64 per = wl_att_split_keys(keys, n_splits);
    const wl_u64 h = blockIdx.x;
    const wl_u64 hd = (wl_u64)head_dim;
    for (wl_u64 i = blockIdx.y; i < n_q; i += gridDim.y) {
        const wl_u64 live = wl_att_live_splits(per, base, start + i + 1, n_splits);
        const wl_u64 rec0 = wl_att_part_record(i, h, 0, n_heads, n_splits);
        const float* ml = part + wl_att_part_ml(rec0, n_q, n_heads, n_splits, head_dim);
        // every thread finds the same maximum; the weights are then one a thread
        float mm = wl_att_merge_max(ml, (int)live, 2);
        for (wl_u64 t = threadIdx.x; t < live; t += blockDim.x) {
            s_f[t] = wl_att_merge_factor(ml[2 * t], mm);
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            float ll = 0.0f;
            for (wl_u64 t = 0; t < live; t++) ll = fmaf(ml[2 * t + 1], s_f[t], ll);
            s_inv = 1.0f / ll;
        }
        __syncthreads();
        const float* acc = part + wl_att_part_acc(rec0, head_dim);
        for (wl_u64 d = threadIdx.x; d < hd; d += blockDim.x) {
            float a = 0.0f;
            for (wl_u64 t = 0; t < live; t++) a = fmaf(acc[t * hd + d], s_f[t], a);
            out[(i * n_heads + h) * hd + d] = WL_MUL(a, s_inv);
        }
        // s_f and s_inv are reused by the next query of this block
        __syncthreads();
    }
}

// attention_prefill_{fmt}: the same causal grouped-query attention for prompts, flash-attention
// style. Grid: x = kv_heads × ceil(n_q × group / rows), y = 1; block (kh, b) takes rows
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
// on an H200's CUDA cores); attention_prefill_mma_{fmt} below is the same in fast mode on
// tensor cores.
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

// attention_prefill_mma_{fmt}: attention_prefill_{fmt} with f16 operands (fast mode) on tensor
// cores, for heads of 64 or 128 values on compute capability 8.0 and later (below that, and on
// any architecture the module is compiled for before 8.0, the body is empty and the host never
// launches it), one body for every cache format. Grid: x = kv_heads × ceil(n_q × group / 64);
// block (kh, b) takes rows b × 64 .. of KV head kh (the same (query, head) rows as
// attention_prefill_{fmt}), warp w rows 16 w .. of those: one A fragment of m16n8k16 products
// (wl_fa_mma.cuh). The block stages its queries as f16 pairs once (rounded as wl_att_round
// rounds them), then for each tile of WL_FA_KEYS keys the keys as pairs along the dims and the
// values transposed, as pairs along the keys, so every fragment register is one 32-bit shared
// load. The tile is read through attention_prefill_{fmt}'s readers, a warp a pair of keys (lane
// l dims l + 32 r, so the turned formats' warps decode whole groups), and each value rounded to
// f16 as it is packed, as an f16 cache stores them: exact for f16, e4m3 and bf16 within f16's
// normal range, a rounding of 2⁻¹¹ relative for f32 and the turned groups' decoded values (a
// value below 6.1e-5 keeps f16's subnormal steps of 6e-8; one past 65,504 becomes infinite).
// Exact mode never takes this kernel. Per tile a warp computes S = Q K^T (4 n-blocks of 8 keys
// × head_dim / 16 k-steps, the query fragments held in registers for the whole call), weighs
// and masks its scores, finds each row's maximum and probability sum over the 4 lanes that hold
// the row (two xor shuffles), rescales O and adds P V (the probabilities, f16 as
// attention_prefill_{fmt} rounds them, already lie in A's layout: no shared-memory round
// trip). Tiles wholly past the causal end of a warp's last row, or before the window of its
// first, are staged but not computed by it.
//
// Bytes read per call: as attention_prefill_{fmt} with 64 rows a block (a quarter of its block
// count at head_dim 128), the K/V rows in their cache format. The bound it should reach: 4 ×
// n_q² / 2 × n_heads × head_dim flops on tensor cores: 17 GFLOP a layer of a 1.1B llama at
// 2,048 tokens is about 30 µs at half the H200's dense f16 rate, where the f32 kernel's CUDA
// cores take milliseconds. NVRTC's sm_90 build holds 171 registers a thread for the float
// formats, 173 and 174 for q8 and q8_q4, 203 for q4 (no stack, no spills), and 35.5 KiB of
// shared memory a block: two blocks an SM for each.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
// D += A B, one m16n8k16 product with f32 accumulators.
__device__ __forceinline__ void wl_mma_16816(float d[4], const wl_u32 a[4], const wl_u32 b[2]) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

template <int HD, typename K, typename V>
__device__ __forceinline__ void wl_attention_prefill_mma(
    const float* q, K k, V v, float* out, wl_u64 n_q, wl_u64 start,
    wl_u64 n_heads, wl_u64 kv_heads, float scale, wl_u64 window, float softcap, wl_u64 rows,
    wl_u32* sq, wl_u32* sk, wl_u32* svt) {
    constexpr int KSTEPS = HD / 16;  // k-steps of S = Q K^T
    constexpr int DBLOCKS = HD / 8;  // n-blocks of O
    constexpr int PAIRS = HD / 2;
    const int lane = threadIdx.x % 32;
    const int warp = threadIdx.x / 32;
    const wl_u64 group = n_heads / kv_heads;
    const wl_u64 n_rows = n_q * group;
    const wl_u64 tiles = (n_rows + WL_FAM_ROWS - 1) / WL_FAM_ROWS;
    const wl_u64 kh = blockIdx.x / tiles;
    const wl_u64 r0 = (blockIdx.x % tiles) * (wl_u64)WL_FAM_ROWS;
    if (kh >= kv_heads) return;
    const wl_u64 r_end = r0 + WL_FAM_ROWS < n_rows ? r0 + WL_FAM_ROWS : n_rows;
    const wl_u64 hd = (wl_u64)HD;
    const wl_u64 kvd = kv_heads * hd;
    const float neg_inf = wl_bits_to_f32(0xff800000u);
    for (int e = (int)threadIdx.x; e < WL_FAM_ROWS * PAIRS; e += (int)blockDim.x) {
        const int row = e / PAIRS;
        const int d = 2 * (e % PAIRS);
        const wl_u64 r = r0 + (wl_u64)row;
        float x0 = 0.0f, x1 = 0.0f;
        if (r < r_end) {
            const float* qr = q + ((r / group) * n_heads + kh * group + r % group) * hd;
            x0 = qr[d];
            x1 = qr[d + 1];
        }
        sq[wl_fam_q_word(row, d, HD)] = wl_fam_pack(x0, x1);
    }
    __syncthreads();
    const int wrow0 = warp * WL_FAM_WARP_ROWS;
    const wl_u64 wr0 = r0 + (wl_u64)wrow0;
    const bool live = wr0 < r_end;
    const wl_u64 wr_next = wr0 + WL_FAM_WARP_ROWS < r_end ? wr0 + WL_FAM_WARP_ROWS : r_end;
    const wl_u64 wr_last = wr_next - 1;
    // the keys any row of the warp meets: from its first row's window start to its last row's
    // causal end
    const wl_u64 warp_lo = wl_fa_first_key(start, wr0 / group, window);
    const wl_u64 warp_end = start + wr_last / group + 1;
    wl_u32 qa[KSTEPS][4];
#pragma unroll
    for (int ks = 0; ks < KSTEPS; ks++) wl_fam_q_frag(sq, wrow0, HD, lane, ks, qa[ks]);
    wl_u64 qi[2];
#pragma unroll
    for (int hf = 0; hf < 2; hf++) qi[hf] = (wr0 + (wl_u64)wl_mma_c_row(lane, 2 * hf)) / group;
    float o[DBLOCKS][4];
#pragma unroll
    for (int db = 0; db < DBLOCKS; db++) {
#pragma unroll
        for (int reg = 0; reg < 4; reg++) o[db][reg] = 0.0f;
    }
    float m[2] = {neg_inf, neg_inf};
    float l[2] = {0.0f, 0.0f};
    const wl_u64 key_end = start + (r_end - 1) / group + 1;
    const wl_u64 key_lo = wl_fa_first_key(start, r0 / group, window);
    for (wl_u64 t0 = key_lo / WL_FA_KEYS * WL_FA_KEYS; t0 < key_end; t0 += WL_FA_KEYS) {
        // the previous tile's readers are done before it is overwritten
        __syncthreads();
        // a warp a pair of keys jp, jp + 1, read through the readers of attention_prefill_{fmt}
        // (lane l holds dims l + 32 r of both; whether a key is below key_end is the same for
        // the whole warp, as the turned readers' shuffles need): a lane's two values of dim d
        // are one word of the transposed values as they stand, and each key's dims are paired
        // with the neighbour lane's by one shuffle
        for (int jp = 2 * warp; jp < WL_FA_KEYS; jp += 2 * WL_ATT_WARPS) {
            const wl_u64 j = t0 + (wl_u64)jp;
            const bool in0 = j < key_end;
            const bool in1 = j + 1 < key_end;
            const wl_u64 row0 = wl_kv_cache_row(j, rows) * kvd + kh * hd;
            const wl_u64 row1 = wl_kv_cache_row(j + 1, rows) * kvd + kh * hd;
#pragma unroll
            for (int r = 0; r < HD / 32; r++) {
                const int d = lane + 32 * r;
                const float k0 = in0 ? k.at(row0 + (wl_u64)d, lane) : 0.0f;
                const float k1 = in1 ? k.at(row1 + (wl_u64)d, lane) : 0.0f;
                const float v0 = in0 ? v.at(row0 + (wl_u64)d, lane) : 0.0f;
                const float v1 = in1 ? v.at(row1 + (wl_u64)d, lane) : 0.0f;
                svt[wl_fam_v_word(d, jp)] = wl_fam_pack(v0, v1);
                // an even lane pairs key jp's dims d, d + 1; an odd lane key jp + 1's d - 1, d
                const float other = __shfl_xor_sync(0xffffffffu, (lane & 1) ? k0 : k1, 1);
                if (lane & 1) {
                    sk[wl_fam_k_word(jp + 1, d - 1, HD)] = wl_fam_pack(other, k1);
                } else {
                    sk[wl_fam_k_word(jp, d, HD)] = wl_fam_pack(k0, other);
                }
            }
        }
        __syncthreads();
        if (!live || t0 >= warp_end || t0 + WL_FA_KEYS <= warp_lo) continue;
        float s[16];
#pragma unroll
        for (int x = 0; x < 16; x++) s[x] = 0.0f;
#pragma unroll
        for (int nb = 0; nb < 4; nb++) {
#pragma unroll
            for (int ks = 0; ks < KSTEPS; ks++) {
                wl_u32 b[2];
                wl_fam_k_frag(sk, HD, lane, nb, ks, b);
                wl_mma_16816(s + 4 * nb, qa[ks], b);
            }
        }
        float mt[2], m_new[2], keep[2], ps[2];
        wl_fam_weigh(s, lane, t0, qi, start, window, key_end, scale, softcap, mt);
#pragma unroll
        for (int hf = 0; hf < 2; hf++) {
            mt[hf] = fmaxf(mt[hf], __shfl_xor_sync(0xffffffffu, mt[hf], 1));
            mt[hf] = fmaxf(mt[hf], __shfl_xor_sync(0xffffffffu, mt[hf], 2));
        }
        wl_fam_probs(s, m, mt, m_new, keep, ps);
#pragma unroll
        for (int hf = 0; hf < 2; hf++) {
            ps[hf] = WL_ADD(ps[hf], __shfl_xor_sync(0xffffffffu, ps[hf], 1));
            ps[hf] = WL_ADD(ps[hf], __shfl_xor_sync(0xffffffffu, ps[hf], 2));
        }
        wl_fam_fold(m, l, m_new, keep, ps);
#pragma unroll
        for (int db = 0; db < DBLOCKS; db++) wl_fam_rescale(o[db], keep);
#pragma unroll
        for (int kk = 0; kk < WL_FA_KEYS / 16; kk++) {
            wl_u32 pa[4];
            wl_fam_p_frag(s, kk, pa);
#pragma unroll
            for (int db = 0; db < DBLOCKS; db++) {
                wl_u32 b[2];
                wl_fam_v_frag(svt, lane, db, kk, b);
                wl_mma_16816(o[db], pa, b);
            }
        }
    }
    if (!live) return;
#pragma unroll
    for (int hf = 0; hf < 2; hf++) {
        const wl_u64 r = wr0 + (wl_u64)wl_mma_c_row(lane, 2 * hf);
        if (r >= r_end) continue;
        float* orow = out + ((r / group) * n_heads + kh * group + r % group) * hd;
        const float inv = 1.0f / l[hf];
#pragma unroll
        for (int db = 0; db < DBLOCKS; db++) {
#pragma unroll
            for (int c = 0; c < 2; c++) {
                const int reg = 2 * hf + c;
                orow[8 * db + wl_mma_c_col(lane, reg)] = WL_MUL(o[db][reg], inv);
            }
        }
    }
}
#endif

// The arguments are attention_prefill_{fmt}'s; f16_operands must be set (the kernel rounds as
// fast mode does) and head_dim 64 or 128, or it writes nothing.
template <typename K, typename V>
__device__ __forceinline__ void wl_attention_prefill_mma_entry(
    const float* q, K k, V v, float* out, wl_u64 n_q, wl_u64 start, wl_u64 n_heads,
    wl_u64 kv_heads, int head_dim, float scale, int f16_operands, wl_u64 window, float softcap,
    wl_u64 rows) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    __shared__ wl_u32 s_q[WL_FAM_Q_WORDS];
    __shared__ wl_u32 s_k[WL_FAM_K_WORDS];
    __shared__ wl_u32 s_vt[WL_FAM_V_WORDS];
    // the host checks these; a launch that breaks them writes nothing rather than out of bounds
    if (!f16_operands || kv_heads == 0 || n_heads % kv_heads != 0 || rows == 0) return;
    if (head_dim == 64) {
        wl_attention_prefill_mma<64>(q, k, v, out, n_q, start, n_heads, kv_heads, scale, window,
                                     softcap, rows, s_q, s_k, s_vt);
    } else if (head_dim == 128) {
        wl_attention_prefill_mma<128>(q, k, v, out, n_q, start, n_heads, kv_heads, scale, window,
                                      softcap, rows, s_q, s_k, s_vt);
    }
#endif
}

#define WL_ATTENTION_PREFILL_MMA(NAME, KT, KR, VT, VR)                                             \
    extern "C" __global__ void __launch_bounds__(WL_ATT_THREADS) attention_prefill_mma_##NAME(     \
        const float* q, const KT* k, const VT* v, float* out, wl_u64 n_q, wl_u64 start,            \
        wl_u64 n_heads, wl_u64 kv_heads, int head_dim, float scale, int f16_operands,              \
        wl_u64 window, float softcap, wl_u64 rows) {                                               \
        wl_attention_prefill_mma_entry(q, KR{k}, VR{v}, out, n_q, start, n_heads, kv_heads,        \
                                       head_dim, scale, f16_operands, window, softcap, rows);      \
    }

WL_ATTENTION_PREFILL_MMA(f32, float, WlKvF32, float, WlKvF32)
WL_ATTENTION_PREFILL_MMA(f16, wl_u16, WlKvF16, wl_u16, WlKvF16)
WL_ATTENTION_PREFILL_MMA(bf16, wl_u16, WlKvBf16, wl_u16, WlKvBf16)
WL_ATTENTION_PREFILL_MMA(e4m3, wl_u8, WlKvE4M3, wl_u8, WlKvE4M3)
WL_ATTENTION_PREFILL_MMA(q8, wl_u8, WlKvTurned<127>, wl_u8, WlKvTurned<127>)
WL_ATTENTION_PREFILL_MMA(q4, wl_u8, WlKvTurned<7>, wl_u8, WlKvTurned<7>)
WL_ATTENTION_PREFILL_MMA(q8_q4, wl_u8, WlKvTurned<127>, wl_u8, WlKvTurned<7>)
