// The per-thread halves of matvec.cu's dot products, shared with the host C++ test shim:
// - quantised weights: lane `lane` of 32 sums values lane, lane + 32, lane + 64, ... of one
//   weight row against the activations, in that order, with fused multiply-adds (explicit on
//   both sides, so the device and the host twin round identically). The kernel then adds the
//   32 partial sums with an xor butterfly (wl_warp_sum), which the host shim replays in the
//   same order.
// - float weights (f16, bf16, f32): 16-byte chunks of a row spread over `tpr` threads
//   (wl_fv_lane_*, below), for the bandwidth kernels.
#pragma once
#include "wl_dequant.cuh"

#if defined(__CUDA_ARCH__)
#define WL_FMA(a, b, c) __fmaf_rn((a), (b), (c))
#else
#define WL_FMA(a, b, c) fmaf((a), (b), (c))
#endif

#if defined(__CUDA_ARCH__)
#define WL_UNROLL _Pragma("unroll")
#else
#define WL_UNROLL
#endif

WL_HD float wl_act_f32(const float* x, wl_u64 i) { return x[i]; }
WL_HD float wl_act_f16(const wl_u16* x, wl_u64 i) { return wl_f16_to_f32_fast(x[i]); }

// wl_lane_dot_{type}_{act}(row, x, cols, lane): `row` is one weight row of cols / BS blocks of
// BB bytes, `x` the cols activations of one token.
#define WL_LANE_DOT(NAME, BS, BB, ACT, ACT_T)                                                      \
    WL_HD float wl_lane_dot_##NAME##_##ACT(const wl_u8* row, const ACT_T* x, wl_u64 cols,         \
                                            int lane) {                                            \
        float acc = 0.0f;                                                                          \
        for (wl_u64 c = (wl_u64)lane; c < cols; c += 32) {                                         \
            acc = WL_FMA(wl_dq_##NAME(row + (c / (BS)) * (BB), (int)(c % (BS))), wl_act_##ACT(x, c), \
                         acc);                                                                     \
        }                                                                                          \
        return acc;                                                                                \
    }

// wl_row_{type}(w, r, cols): the start of weight row r (cols a multiple of BS).
#define WL_LANE_DOT_BOTH(NAME, BS, BB)                                                  \
    WL_HD const wl_u8* wl_row_##NAME(const wl_u8* w, wl_u64 r, wl_u64 cols) {          \
        return w + r * (cols / (BS)) * (BB);                                            \
    }                                                                                   \
    WL_LANE_DOT(NAME, BS, BB, f32, float)                                               \
    WL_LANE_DOT(NAME, BS, BB, f16, wl_u16)

WL_LANE_DOT_BOTH(q4_0, 32, 18)
WL_LANE_DOT_BOTH(q4_1, 32, 20)
WL_LANE_DOT_BOTH(q5_0, 32, 22)
WL_LANE_DOT_BOTH(q5_1, 32, 24)
WL_LANE_DOT_BOTH(q8_0, 32, 34)
WL_LANE_DOT_BOTH(q2_k, 256, 84)
WL_LANE_DOT_BOTH(q3_k, 256, 110)
WL_LANE_DOT_BOTH(q4_k, 256, 144)
WL_LANE_DOT_BOTH(q5_k, 256, 176)
WL_LANE_DOT_BOTH(q6_k, 256, 210)

// Float weights (f16, bf16, f32) for matvec.cu's bandwidth kernels. A row is read in chunks of
// WL_FV_CHUNK bytes (E values: 8 f16 or bf16, 4 f32), one 128-bit load each where the row and
// the activations are 16-byte aligned and byte by byte otherwise (the same values either way,
// so alignment never changes a result). A row belongs to `tpr` threads (16: half a warp; 32; or
// 64, 128, 256: several warps); thread `lane` takes chunks lane, lane + tpr, lane + 2 tpr, ...
// (loading WL_FV_UNROLL of them before it uses any, so their loads are in flight together) and
// then, when cols is not a whole number of chunks, the value n_chunks * E + lane if that is
// below cols. Each thread keeps one FMA chain per token, in value order within a chunk; the
// kernel adds the tpr chains of a row in the order wl_fv_rows (matvec.cu) states, and the host
// shim replays that sum.
#define WL_FV_CHUNK 16
#define WL_FV_UNROLL 4
// Tokens one thread carries per pass (each weight chunk loaded once meets this many tokens).
#define WL_FV_NT 4

// The WL_FV_CHUNK bytes at p as four little-endian words: when `wide` (p 16-byte aligned,
// which the caller checked: wl_fv_wide) one 128-bit load through the read-only path, written
// in PTX so no pointer is cast to a wider type; else byte by byte.
WL_HD void wl_fv_load(const wl_u8* p, int wide, wl_u32* w) {
#if defined(__CUDA_ARCH__)
    if (wide) {
        asm("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];"
            : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3])
            : "l"(p));
        return;
    }
#endif
    (void)wide;
    for (int k = 0; k < 4; ++k) {
        const wl_u8* q = p + 4 * k;
        w[k] = (wl_u32)q[0] | ((wl_u32)q[1] << 8) | ((wl_u32)q[2] << 16) | ((wl_u32)q[3] << 24);
    }
}

// Value e of a chunk held as four little-endian words.
WL_HD float wl_fv_w_f16(const wl_u32* w, int e) {
    return wl_f16_to_f32_fast((wl_u16)(w[e >> 1] >> (16 * (e & 1))));
}
WL_HD float wl_fv_w_bf16(const wl_u32* w, int e) {
    wl_u32 v = w[e >> 1];
    return wl_bits_to_f32((e & 1) ? (v & 0xffff0000u) : (v << 16));
}
WL_HD float wl_fv_w_f32(const wl_u32* w, int e) { return wl_bits_to_f32(w[e]); }

// The n (4 or 8) activations at x into v: 128-bit loads when `wide` (x 16-byte aligned, as
// the caller checked), else one at a time.
WL_HD void wl_fv_x_f32(const float* x, int wide, float* v, int n) {
#if defined(__CUDA_ARCH__)
    if (wide) {
        for (int k = 0; k < n; k += 4) {
            asm("ld.global.nc.v4.f32 {%0, %1, %2, %3}, [%4];"
                : "=f"(v[k]), "=f"(v[k + 1]), "=f"(v[k + 2]), "=f"(v[k + 3])
                : "l"(x + k));
        }
        return;
    }
#endif
    (void)wide;
    for (int k = 0; k < n; ++k) v[k] = x[k];
}
WL_HD void wl_fv_x_f16(const wl_u16* x, int, float* v, int n) {
    for (int k = 0; k < n; ++k) v[k] = wl_f16_to_f32_fast(x[k]);
}

// Whether the 128-bit loads may be used: the row and the first token's activations 16-byte
// aligned, and every later token's too (rows of cols values a multiple of 16 bytes apart).
WL_HD int wl_fv_wide(const void* row, const void* x, wl_u64 x_row_bytes, int nt) {
    wl_u64 a = (wl_u64)row | (wl_u64)x;
    return (a % 16 == 0) && (nt == 1 || x_row_bytes % 16 == 0);
}

// wl_fv_lane_{type}_{act}(row, x, cols, nt, lane, tpr, acc): thread `lane` of the `tpr`
// threads of weight row `row` (cols values of ES bytes): its partial dot products with nt <=
// WL_FV_NT tokens (token k's activations at x + k * cols) into acc[0..nt).
#define WL_FV_LANE(NAME, ES, ACT, ACT_T)                                                           \
    WL_HD void wl_fv_chains_##NAME##_##ACT(const wl_u8* row, const ACT_T* x, wl_u64 cols, int nt, \
                                           int lane, int tpr, float* acc, const int wide) {        \
        const int E = WL_FV_CHUNK / (ES);                                                          \
        const wl_u64 nc = cols / (wl_u64)E;                                                        \
        WL_UNROLL                                                                                  \
        for (int k = 0; k < WL_FV_NT; ++k) acc[k] = 0.0f;                                          \
        for (wl_u64 c0 = (wl_u64)lane; c0 < nc; c0 += (wl_u64)tpr * WL_FV_UNROLL) {               \
            wl_u32 w[WL_FV_UNROLL][4];                                                             \
            WL_UNROLL                                                                              \
            for (int u = 0; u < WL_FV_UNROLL; ++u) {                                               \
                wl_u64 c = c0 + (wl_u64)u * (wl_u64)tpr;                                           \
                if (c < nc) wl_fv_load(row + c * WL_FV_CHUNK, wide, w[u]);                         \
            }                                                                                      \
            WL_UNROLL                                                                              \
            for (int u = 0; u < WL_FV_UNROLL; ++u) {                                               \
                wl_u64 c = c0 + (wl_u64)u * (wl_u64)tpr;                                           \
                if (c >= nc) break;                                                                \
                WL_UNROLL                                                                          \
                for (int k = 0; k < WL_FV_NT; ++k) {                                               \
                    if (k >= nt) break;                                                            \
                    float xv[WL_FV_CHUNK / (ES)];                                                  \
                    wl_fv_x_##ACT(x + (wl_u64)k * cols + c * (wl_u64)E, wide, xv, E);              \
                    WL_UNROLL                                                                      \
                    for (int e = 0; e < E; ++e) acc[k] = WL_FMA(wl_fv_w_##NAME(w[u], e), xv[e], acc[k]); \
                }                                                                                  \
            }                                                                                      \
        }                                                                                          \
        wl_u64 t = nc * (wl_u64)E + (wl_u64)lane;                                                  \
        if (t < cols) {                                                                            \
            for (int k = 0; k < nt; ++k) {                                                         \
                acc[k] = WL_FMA(wl_dq_##NAME(row + t * (ES), 0),                                   \
                                wl_act_##ACT(x + (wl_u64)k * cols, t), acc[k]);                    \
            }                                                                                      \
        }                                                                                          \
    }                                                                                              \
    /* the two inlined calls give a loop without the alignment test and one without wide loads */ \
    WL_HD void wl_fv_lane_##NAME##_##ACT(const wl_u8* row, const ACT_T* x, wl_u64 cols, int nt,   \
                                         int lane, int tpr, float* acc) {                          \
        if (wl_fv_wide(row, x, cols * sizeof(ACT_T), nt)) {                                        \
            wl_fv_chains_##NAME##_##ACT(row, x, cols, nt, lane, tpr, acc, 1);                      \
        } else {                                                                                   \
            wl_fv_chains_##NAME##_##ACT(row, x, cols, nt, lane, tpr, acc, 0);                      \
        }                                                                                          \
    }

#define WL_FV_LANE_BOTH(NAME, ES)       \
    WL_FV_LANE(NAME, ES, f32, float)    \
    WL_FV_LANE(NAME, ES, f16, wl_u16)

WL_FV_LANE_BOTH(f16, 2)
WL_FV_LANE_BOTH(bf16, 2)
WL_FV_LANE_BOTH(f32, 4)

// The dequantised path of matmul (gemm_{act} in matvec.cu), as phases the kernel separates
// with __syncthreads and the host twin replays thread by thread: a block of WL_GEMM_THREADS
// threads owns WL_GEMM_BM weight rows x WL_GEMM_BN tokens, thread (tx, ty) = (tid % 16,
// tid / 16) the 4 x 4 outputs rows tx + 16i, tokens ty + 16j (consecutive tx: consecutive rows,
// so stores coalesce). Per K tile of WL_GEMM_TILE values every thread stages its share of the
// weight and activation tiles in shared memory (wl_gemm_stage_*), then adds the tile's products
// (wl_gemm_compute). A short last tile runs only its own length, so each output is exactly one
// left-to-right chain of fused multiply-adds over k, whatever the tiling.
#define WL_GEMM_TILE 16
#define WL_GEMM_BM 64
#define WL_GEMM_BN 64
#define WL_GEMM_THREADS 256
// Shared-tile row stride: one padding column, so a warp's column reads hit distinct banks.
#define WL_GEMM_LD (WL_GEMM_TILE + 1)


// Thread `tid` stages elements tid, tid + 256, ... of the BM x TILE weight tile at (rbase, k0):
// ws[lr * LD + kk] = wd[(rbase + lr) * cols + k0 + kk], 0 past the rows or the tile's length.
WL_HD void wl_gemm_stage_w(int tid, float* ws, const float* wd, wl_u64 n_rows, wl_u64 cols,
                           wl_u64 rbase, wl_u64 k0, int kl) {
    WL_UNROLL
    for (int s = 0; s < WL_GEMM_BM * WL_GEMM_TILE / WL_GEMM_THREADS; ++s) {
        int e = tid + WL_GEMM_THREADS * s;
        int lr = e / WL_GEMM_TILE, kk = e % WL_GEMM_TILE;
        wl_u64 r = rbase + (wl_u64)lr;
        ws[lr * WL_GEMM_LD + kk] = (r < n_rows && kk < kl) ? wd[r * cols + k0 + (wl_u64)kk] : 0.0f;
    }
}

// The same for the BN x TILE activation tile at (tbase, k0), widened to f32.
#define WL_GEMM_STAGE_X(ACT, ACT_T)                                                                \
    WL_HD void wl_gemm_stage_x_##ACT(int tid, float* xs, const ACT_T* x, wl_u64 n_tok, wl_u64 cols, \
                                     wl_u64 tbase, wl_u64 k0, int kl) {                            \
        WL_UNROLL                                                                                  \
        for (int s = 0; s < WL_GEMM_BN * WL_GEMM_TILE / WL_GEMM_THREADS; ++s) {                    \
            int e = tid + WL_GEMM_THREADS * s;                                                     \
            int lt = e / WL_GEMM_TILE, kk = e % WL_GEMM_TILE;                                      \
            wl_u64 t = tbase + (wl_u64)lt;                                                         \
            xs[lt * WL_GEMM_LD + kk] =                                                             \
                (t < n_tok && kk < kl) ? wl_act_##ACT(x, t * cols + k0 + (wl_u64)kk) : 0.0f;       \
        }                                                                                          \
    }
WL_GEMM_STAGE_X(f32, float)
WL_GEMM_STAGE_X(f16, wl_u16)

// Thread (tx, ty) adds the first kl products of the staged tiles to its 16 outputs, k in order:
// acc[4i + j] is row tx + 16i, token ty + 16j.
WL_HD void wl_gemm_compute(int tx, int ty, const float* ws, const float* xs, int kl, float* acc) {
    for (int kk = 0; kk < kl; ++kk) {
        float xv[4];
        WL_UNROLL
        for (int j = 0; j < 4; ++j) xv[j] = xs[(ty + 16 * j) * WL_GEMM_LD + kk];
        WL_UNROLL
        for (int i = 0; i < 4; ++i) {
            float wv = ws[(tx + 16 * i) * WL_GEMM_LD + kk];
            WL_UNROLL
            for (int j = 0; j < 4; ++j) acc[4 * i + j] = WL_FMA(wv, xv[j], acc[4 * i + j]);
        }
    }
}

// Thread (tx, ty) writes its outputs inside the chunk: y[t * rows + row0 + r].
WL_HD void wl_gemm_store(int tx, int ty, const float* acc, float* y, wl_u64 n_rows, wl_u64 n_tok,
                         wl_u64 rbase, wl_u64 tbase, wl_u64 row0, wl_u64 rows) {
    WL_UNROLL
    for (int i = 0; i < 4; ++i) {
        WL_UNROLL
        for (int j = 0; j < 4; ++j) {
            wl_u64 r = rbase + (wl_u64)(tx + 16 * i), t = tbase + (wl_u64)(ty + 16 * j);
            if (r < n_rows && t < n_tok) y[t * rows + row0 + r] = acc[4 * i + j];
        }
    }
}
