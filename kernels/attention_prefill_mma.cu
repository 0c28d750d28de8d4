// attention_prefill_mma_{fmt}: attention_prefill_{fmt} (attention_prefill.cu) with f16 operands
// (fast mode) on tensor cores, for heads of 64 or 128 values on compute capability 8.0 and later
// (below that, and on any architecture the module is compiled for before 8.0, the body is empty and
// the host never launches it), one body for every cache format. Grid: x = kv_heads × ceil(n_q ×
// group / 64); block (kh, b) takes rows b × 64 .. of KV head kh (the same (query, head) rows as
// attention_prefill_{fmt}), warp w rows 16 w .. of those: one A fragment of m16n8k16 products
// (wl_fa_mma.cuh). The block stages its queries as f16 pairs once (rounded as wl_att_round rounds
// them), then for each tile of WL_FA_KEYS keys the keys as pairs along the dims and the values
// transposed, as pairs along the keys, so every fragment register is one 32-bit shared load. The
// tile is read through attention_prefill_{fmt}'s readers, a warp a pair of keys (lane l dims
// l + 32 r, so the turned formats' warps decode whole groups), and each value rounded to f16 as it
// is packed, as an f16 cache stores them: exact for f16, e4m3 and bf16 within f16's normal range, a
// rounding of 2⁻¹¹ relative for f32 and the turned groups' decoded values (a value below 6.1e-5
// keeps f16's subnormal steps of 6e-8; one past 65,504 becomes infinite). Exact mode never takes
// this kernel. Per tile a warp computes S = Q K^T (4 n-blocks of 8 keys × head_dim / 16 k-steps,
// the query fragments held in registers for the whole call), weighs and masks its scores, finds
// each row's maximum and probability sum over the 4 lanes that hold the row (two xor shuffles),
// rescales O and adds P V (the probabilities, f16 as attention_prefill_{fmt} rounds them, already
// lie in A's layout: no shared-memory round trip). Tiles wholly past the causal end of a warp's
// last row, or before the window of its first, are staged but not computed by it.
//
// Bytes read per call: as attention_prefill_{fmt} with 64 rows a block (a quarter of its block
// count at head_dim 128), the K/V rows in their cache format. The bound it should reach: 4 ×
// n_q² / 2 × n_heads × head_dim flops on tensor cores: 17 GFLOP a layer of a 1.1B llama at
// 2,048 tokens is about 30 µs at half the H200's dense f16 rate, where the f32 kernel's CUDA
// cores take milliseconds. NVRTC's sm_90 build holds 171 registers a thread for the float
// formats, 173 and 174 for q8 and q8_q4, 203 for q4 (no stack, no spills), and 35.5 KiB of
// shared memory a block: two blocks an SM for each.
#include "wl_fa_mma.cuh"

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
