// The per-lane half of the warp-per-row dot product in matvec.cu, shared with the host C++
// test shim: lane `lane` of 32 sums values lane, lane + 32, lane + 64, ... of one weight row
// against the activations, in that order, with fused multiply-adds (explicit on both sides, so
// the device and the host twin round identically). The kernel then adds the 32 partial sums
// with an xor butterfly (wl_warp_sum), which the host shim replays in the same order.
#pragma once
#include "wl_dequant.cuh"

#if defined(__CUDA_ARCH__)
#define WL_FMA(a, b, c) __fmaf_rn((a), (b), (c))
#else
#define WL_FMA(a, b, c) fmaf((a), (b), (c))
#endif

WL_HD float wl_act_f32(const float* x, wl_u64 i) { return x[i]; }
WL_HD float wl_act_f16(const wl_u16* x, wl_u64 i) { return wl_f16_to_f32(x[i]); }

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
WL_LANE_DOT_BOTH(q8_0, 32, 34)
WL_LANE_DOT_BOTH(q4_k, 256, 144)
WL_LANE_DOT_BOTH(q6_k, 256, 210)
WL_LANE_DOT_BOTH(f16, 1, 2)
WL_LANE_DOT_BOTH(f32, 1, 4)

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

#if defined(__CUDA_ARCH__)
#define WL_UNROLL _Pragma("unroll")
#else
#define WL_UNROLL
#endif

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
