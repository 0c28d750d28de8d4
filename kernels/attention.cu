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
#include "wl_q8.cuh"

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
        // WL_ATT_KEYS_AHEAD(R) keys a warp at a time: the K and V rows of all of them are read
        // before the first meets the queries, so their loads are in flight together (one key
        // at a time, each key's loads waited out a memory round trip of their own); the keys
        // then meet the heads one after another in the order of one key at a time, the same
        // operations, so the same bits. j == lo + warp + WL_ATT_WARPS * (u + U * pass), the
        // keys the warp took one at a time, in order.
        constexpr int U = WL_ATT_KEYS_AHEAD(R);
        for (wl_u64 j0 = lo + (wl_u64)warp; j0 < hi; j0 += (wl_u64)WL_ATT_WARPS * U) {
            // d < head_dim and j < hi are the same for all lanes of a warp whenever the reader
            // shuffles (the turned formats need head_dim a multiple of 32)
            float kr[U][R];
            float vr[U][R];
#pragma unroll
            for (int u = 0; u < U; u++) {
                const wl_u64 j = j0 + (wl_u64)u * WL_ATT_WARPS;
                const wl_u64 row = j < hi ? wl_kv_cache_row(j, rows) * kvd + kh * hd : 0;
#pragma unroll
                for (int r = 0; r < R; r++) {
                    int d = lane + 32 * r;
                    kr[u][r] = j < hi && d < head_dim ? k.at(row + (wl_u64)d, lane) : 0.0f;
                }
#pragma unroll
                for (int r = 0; r < R; r++) {
                    int d = lane + 32 * r;
                    vr[u][r] = j < hi && d < head_dim ? v.at(row + (wl_u64)d, lane) : 0.0f;
                }
            }
#pragma unroll
            for (int u = 0; u < U; u++) {
                if (j0 + (wl_u64)u * WL_ATT_WARPS >= hi) continue;
#pragma unroll
                for (int g = 0; g < HB; g++) {
                    if (g < ng) {
                        float t = 0.0f;
#pragma unroll
                        for (int r = 0; r < R; r++) t = fmaf(qr[g][r], kr[u][r], t);
                        for (int o = 16; o > 0; o >>= 1) t = WL_ADD(t, __shfl_xor_sync(0xffffffffu, t, o));
                        float keep, p;
                        float w = WL_MUL(t, scale);
                        // soft-capping (gemma2): softcap * tanh(w / softcap)
                        if (softcap > 0.0f) w = WL_MUL(softcap, tanhf(w / softcap));
                        wl_att_step(w, f16_operands, &m[g], &l[g], &keep, &p);
#pragma unroll
                        for (int r = 0; r < R; r++) {
                            acc[g][r] = wl_att_accumulate(acc[g][r], keep, p, vr[u][r]);
                        }
                    }
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
// `xq` non-null: each block then quantises the head_dim values it wrote (a multiple of 32) into
// Q8 activation blocks at xq, the same bytes q8_quantize_f32 writes for them (attention_reduce_
// q8_f32: the output projection's activations quantised in this launch, see Op::Attention's
// q8_next).
__device__ __forceinline__ void wl_attention_reduce(
    const float* part, float* out, wl_u8* xq, wl_u64 n_q, wl_u64 n_heads, int head_dim,
    wl_u64 n_splits, wl_u64 start_arg, const int* pos, wl_u64 span, wl_u64 window) {
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
        if (xq != nullptr) {
            // the block's output row, after the barrier in wl_q8_quantize_row
            const wl_u64 first = (i * n_heads + h) * hd;
            wl_q8_quantize_row(out + first, xq + first / 32 * WL_Q8_BLOCK_BYTES, hd);
        }
        // s_f and s_inv are reused by the next query of this block
        __syncthreads();
    }
}

extern "C" __global__ __launch_bounds__(WL_ATT_THREADS) void attention_reduce_f32(
    const float* part, float* out, wl_u64 n_q, wl_u64 n_heads, int head_dim, wl_u64 n_splits,
    wl_u64 start_arg, const int* pos, wl_u64 span, wl_u64 window) {
    wl_attention_reduce(part, out, nullptr, n_q, n_heads, head_dim, n_splits, start_arg, pos, span,
                        window);
}

extern "C" __global__ __launch_bounds__(WL_ATT_THREADS) void attention_reduce_q8_f32(
    const float* part, float* out, wl_u8* xq, wl_u64 n_q, wl_u64 n_heads, int head_dim,
    wl_u64 n_splits, wl_u64 start_arg, const int* pos, wl_u64 span, wl_u64 window) {
    wl_attention_reduce(part, out, xq, n_q, n_heads, head_dim, n_splits, start_arg, pos, span,
                        window);
}
