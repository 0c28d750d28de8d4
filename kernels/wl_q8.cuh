// The Q8-activation matvec mode (llama.cpp's `ggml_vec_dot_*_q8_0` scheme), shared by
// matvec.cu and the host C++ test shim. It replays the Rust CPU kernel's arithmetic
// (cpu/matvec.rs: quantize_q8_blocks, row_dot_q8_scalar, finish_lanes) operation for operation,
// so device, host twin and CPU give the same bits:
//
// - Activations are quantised per 32 values into 40-byte blocks laid out as the CPU's
//   `#[repr(C)] Q8Block`: f32 d | i32 sum | i8 qs[32], little-endian. d = amax / 127,
//   q = roundf(x * (1/d)) (half away from zero, NaN -> 0, saturated to i8), sum = sum of q, and
//   d is then rounded through f16 (block_q8_0 stores an f16).
// - A weight row's dot runs in 8 lanes per 32-value group: lane j covers values 4j..4j+3, whose
//   integer products are summed exactly (dp4a), then acc_j = fma(dw * d_x, isum, acc_j) in
//   group order. Min/offset terms (Q4_1's m, Q4_K's dmin) go to a separate sequential sum.
//   The 8 lane sums meet in a fixed tree, ((a0+a4)+(a2+a6)) + ((a1+a5)+(a3+a7)), then + extra.
#pragma once
#include "wl_matvec.cuh"

// Bytes of one quantised activation block of 32 values.
#define WL_Q8_BLOCK_BYTES 40

#if defined(__CUDA_ARCH__)
#define WL_DIV(a, b) __fdiv_rn((a), (b))
#else
#define WL_DIV(a, b) ((a) / (b))
#endif

WL_HD wl_u32 wl_rd_u32(const wl_u8* p) {
    return (wl_u32)p[0] | ((wl_u32)p[1] << 8) | ((wl_u32)p[2] << 16) | ((wl_u32)p[3] << 24);
}

WL_HD void wl_wr_u32(wl_u8* p, wl_u32 v) {
    p[0] = (wl_u8)(v & 0xffu);
    p[1] = (wl_u8)((v >> 8) & 0xffu);
    p[2] = (wl_u8)((v >> 16) & 0xffu);
    p[3] = (wl_u8)(v >> 24);
}

#if defined(__CUDA_ARCH__)
// One 32-value block quantised by a warp, lane i holding value i: the bytes of
// wl_q8_quantize_block (neither the maximum nor the integer sum depends on the order). For
// q8_quantize_{f32,f16} (matvec.cu) and the norm kernels that quantise their output (ops.cu).
__device__ __forceinline__ void wl_q8_quantize_warp(float v, wl_u8* out, int lane) {
    // |v|, with NaN as 0: a NaN never becomes wl_q8_quantize_block's maximum, which starts at 0
    float a = wl_bits_to_f32(wl_f32_to_bits(v) & 0x7fffffffu);
    if (!(a > 0.0f)) a = 0.0f;
    for (int o = 16; o > 0; o >>= 1) {
        float b = __shfl_xor_sync(0xffffffffu, a, o);
        a = b > a ? b : a;
    }
    float d = WL_DIV(a, 127.0f);
    float id = d != 0.0f ? WL_DIV(1.0f, d) : 0.0f;
    float t = roundf(WL_MUL(v, id));
    int q = t != t ? 0 : (t >= 127.0f ? 127 : (t <= -128.0f ? -128 : (int)t));
    out[8 + lane] = (wl_u8)(wl_i8)q;
    int sum = q;
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    if (lane == 0) {
        wl_wr_u32(out, wl_f32_to_bits(wl_f16_to_f32(wl_f32_to_f16(d))));
        wl_wr_u32(out + 4, (wl_u32)sum);
    }
}

// The n values at `x` (a multiple of 32) quantised into n / 32 blocks at `out` by the warps of
// a block, after a barrier: values other threads of the block wrote before it are read.
__device__ __forceinline__ void wl_q8_quantize_row(const float* x, wl_u8* out, wl_u64 n) {
    __syncthreads();
    const int lane = threadIdx.x % 32;
    for (wl_u64 b = threadIdx.x / 32; b < n / 32; b += blockDim.x / 32) {
        wl_q8_quantize_warp(x[b * 32 + (wl_u64)lane], out + b * WL_Q8_BLOCK_BYTES, lane);
    }
}
#endif

// Quantises 32 values `x` into one 40-byte activation block `out`.
WL_HD void wl_q8_quantize_block(const float* x, wl_u8* out) {
    float amax = 0.0f;
    for (int i = 0; i < 32; ++i) {
        float a = wl_bits_to_f32(wl_f32_to_bits(x[i]) & 0x7fffffffu);
        amax = a > amax ? a : amax;  // NaN-ignoring, as Rust's f32::max
    }
    float d = WL_DIV(amax, 127.0f);
    float id = d != 0.0f ? WL_DIV(1.0f, d) : 0.0f;
    int sum = 0;
    for (int i = 0; i < 32; ++i) {
        float v = roundf(WL_MUL(x[i], id));
        // Rust's saturating `as i8`: NaN -> 0, out of range -> the nearest bound
        int q = v != v ? 0 : (v >= 127.0f ? 127 : (v <= -128.0f ? -128 : (int)v));
        out[8 + i] = (wl_u8)(wl_i8)q;
        sum += q;
    }
    wl_wr_u32(out, wl_f32_to_bits(wl_f16_to_f32(wl_f32_to_f16(d))));
    wl_wr_u32(out + 4, (wl_u32)sum);
}

WL_HD float wl_q8_d(const wl_u8* xb) { return wl_bits_to_f32(wl_rd_u32(xb)); }
WL_HD int wl_q8_sum(const wl_u8* xb) { return (int)wl_rd_u32(xb + 4); }

// Four signed bytes packed little-endian into a 32-bit word, as dp4a takes them.
WL_HD wl_u32 wl_pack4(int a, int b, int c, int d) {
    return (wl_u32)(wl_u8)(wl_i8)a | ((wl_u32)(wl_u8)(wl_i8)b << 8) | ((wl_u32)(wl_u8)(wl_i8)c << 16) |
           ((wl_u32)(wl_u8)(wl_i8)d << 24);
}

// c + the dot product of the four signed bytes of a and b (exact in 32-bit integers).
WL_HD int wl_dot4_i8(wl_u32 a, wl_u32 b, int c) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 610
    return __dp4a((int)a, (int)b, c);
#else
    for (int k = 0; k < 4; ++k) {
        c += (int)(wl_i8)(wl_u8)(a >> (8 * k)) * (int)(wl_i8)(wl_u8)(b >> (8 * k));
    }
    return c;
#endif
}

// Little-endian weight words. A kernel passes `al` = its weight base is 4-byte aligned (a
// buffer may be a view at any offset, so it checks at run time); every block and row size is
// even, so then every block starts 2-byte aligned, and the loads below are 16- or 32-bit loads
// through the read-only path. Otherwise, and on the host, byte by byte: the same words.
WL_HD wl_u32 wl_wld16(const wl_u8* p, int al) {
#if defined(__CUDA_ARCH__)
    if (al) {
        unsigned short v;
        asm("ld.global.nc.u16 %0, [%1];" : "=h"(v) : "l"(p));
        return v;
    }
#endif
    (void)al;
    return (wl_u32)p[0] | ((wl_u32)p[1] << 8);
}
// Four bytes at p, 2-byte aligned when al.
WL_HD wl_u32 wl_wld32(const wl_u8* p, int al) { return wl_wld16(p, al) | (wl_wld16(p + 2, al) << 16); }
// Four bytes at p, 4-byte aligned when al.
WL_HD wl_u32 wl_wld32a(const wl_u8* p, int al) {
#if defined(__CUDA_ARCH__)
    if (al) {
        wl_u32 v;
        asm("ld.global.nc.u32 %0, [%1];" : "=r"(v) : "l"(p));
        return v;
    }
#endif
    (void)al;
    return wl_rd_u32(p);
}
WL_HD float wl_wf16(const wl_u8* p, int al) { return wl_f16_to_f32_fast((wl_u16)wl_wld16(p, al)); }

// Each byte of v (all below 128) minus k, as signed bytes: the top bit set first, so no byte
// borrows from its neighbour, then flipped back.
WL_HD wl_u32 wl_sub_bytes(wl_u32 v, wl_u32 k) {
    return ((v | 0x80808080u) - k * 0x01010101u) ^ 0x80808080u;
}

// Bits 0..3 of `h` moved to bit 4 of bytes 0..3 (the fifth bit of four Q5 quants).
WL_HD wl_u32 wl_q5_high(wl_u32 h) {
    return ((h & 1u) << 4) | ((h & 2u) << 11) | ((h & 4u) << 18) | ((h & 8u) << 25);
}

// wl_q8w_{type}(blk, g, j, al, &dw, &mw): lane j's four weights (values 4j..4j+3 of 32-value
// group g of weight block `blk`), packed as signed bytes; dw is the group's weight-side scale
// (d, d*sc, d*scale) and mw its min/offset factor (Q4_1's and Q5_1's m, Q4_K's dmin*m; 0 for
// the other types).
WL_HD wl_u32 wl_q8w_q4_0(const wl_u8* blk, int g, int j, int al, float* dw, float* mw) {
    (void)g;
    *dw = wl_wf16(blk, al);
    *mw = 0.0f;
    return wl_sub_bytes((wl_wld32(blk + 2 + 4 * (j % 4), al) >> (4 * (j / 4))) & 0x0f0f0f0fu, 8);
}

WL_HD wl_u32 wl_q8w_q4_1(const wl_u8* blk, int g, int j, int al, float* dw, float* mw) {
    (void)g;
    *dw = wl_wf16(blk, al);
    *mw = wl_wf16(blk + 2, al);
    return (wl_wld32(blk + 4 + 4 * (j % 4), al) >> (4 * (j / 4))) & 0x0f0f0f0fu;
}

WL_HD wl_u32 wl_q8w_q5_0(const wl_u8* blk, int g, int j, int al, float* dw, float* mw) {
    (void)g;
    *dw = wl_wf16(blk, al);
    *mw = 0.0f;
    wl_u32 lo = (wl_wld32(blk + 6 + 4 * (j % 4), al) >> (4 * (j / 4))) & 0x0f0f0f0fu;
    wl_u32 hi = wl_q5_high((wl_wld32(blk + 2, al) >> (4 * j)) & 15u);
    return wl_sub_bytes(lo | hi, 16);
}

WL_HD wl_u32 wl_q8w_q5_1(const wl_u8* blk, int g, int j, int al, float* dw, float* mw) {
    (void)g;
    *dw = wl_wf16(blk, al);
    *mw = wl_wf16(blk + 2, al);
    wl_u32 lo = (wl_wld32(blk + 8 + 4 * (j % 4), al) >> (4 * (j / 4))) & 0x0f0f0f0fu;
    return lo | wl_q5_high((wl_wld32(blk + 4, al) >> (4 * j)) & 15u);
}

WL_HD wl_u32 wl_q8w_q8_0(const wl_u8* blk, int g, int j, int al, float* dw, float* mw) {
    (void)g;
    *dw = wl_wf16(blk, al);
    *mw = 0.0f;
    return wl_wld32(blk + 2 + 4 * j, al);
}

WL_HD wl_u32 wl_q8w_q4_k(const wl_u8* blk, int g, int j, int al, float* dw, float* mw) {
    int sc, m;
    wl_scale_min_k4(g, blk + 4, &sc, &m);
    *dw = WL_MUL(wl_wf16(blk, al), (float)sc);
    *mw = WL_MUL(wl_wf16(blk + 2, al), (float)m);
    // 144-byte blocks: the quants' words are 4-byte aligned when the base is
    return (wl_wld32a(blk + 16 + 32 * (g / 2) + 4 * j, al) >> (4 * (g % 2))) & 0x0f0f0f0fu;
}

// Q6_K value e of the block as a signed 6-bit quant (the same bits as wl_dq_q6_k).
WL_HD int wl_q6k_quant(const wl_u8* b, int e) {
    int h = e / 128, r = e % 128;
    int lo = (b[h * 64 + r % 64] >> (4 * (r / 64))) & 0x0f;
    int hi = (b[128 + h * 32 + r % 32] >> (2 * (r / 32))) & 3;
    return (lo | (hi << 4)) - 32;
}

WL_HD wl_u32 wl_q8w_q6_k(const wl_u8* blk, int g, int j, int al, float* dw, float* mw) {
    // values e..e+3 share their low-nibble byte run and their high-bit byte run (e % 4 == 0)
    int e = 32 * g + 4 * j, h = e / 128, r = e % 128;
    wl_u32 lo = (wl_wld32(blk + h * 64 + r % 64, al) >> (4 * (r / 64))) & 0x0f0f0f0fu;
    wl_u32 hi = (wl_wld32(blk + 128 + h * 32 + r % 32, al) >> (2 * (r / 32))) & 0x03030303u;
    // scales are per 16 values: lanes 0..3 take scale 2g, lanes 4..7 scale 2g + 1
    *dw = WL_MUL(wl_wf16(blk + 208, al), (float)(wl_i8)blk[192 + 2 * g + j / 4]);
    *mw = 0.0f;
    return wl_sub_bytes(lo | (hi << 4), 32);
}

// One group of one lane: the integer dot of the lane's weight word w4 with its activation word
// xw, scaled into `acc` with one FMA (xd the activation block's scale); `kind` > 0 adds
// (mw * xd) * xsum to `extra` (Q4_1, Q5_1), < 0 subtracts it (Q4_K), 0 leaves it.
WL_HD void wl_q8_step_v(wl_u32 w4, float dw, float mw, float xd, int xsum, wl_u32 xw, int kind,
                        float* acc, float* extra) {
    int isum = wl_dot4_i8(w4, xw, 0);
    *acc = WL_FMA(WL_MUL(dw, xd), (float)isum, *acc);
    if (kind != 0) {
        float t = WL_MUL(WL_MUL(mw, xd), (float)xsum);
        *extra = kind > 0 ? WL_ADD(*extra, t) : WL_SUB(*extra, t);
    }
}

// The same against activation block `xb` (lane j's word at 8 + 4j), read byte by byte.
WL_HD void wl_q8_step(wl_u32 w4, float dw, float mw, const wl_u8* xb, int j, int kind, float* acc,
                      float* extra) {
    wl_q8_step_v(w4, dw, mw, wl_q8_d(xb), wl_q8_sum(xb), wl_rd_u32(xb + 8 + 4 * j), kind, acc,
                 extra);
}

// The lane sums and the extra term in the CPU's fixed order (finish_lanes).
WL_HD float wl_q8_finish(const float* acc, float extra) {
    float s0 = WL_ADD(acc[0], acc[4]), s1 = WL_ADD(acc[1], acc[5]);
    float s2 = WL_ADD(acc[2], acc[6]), s3 = WL_ADD(acc[3], acc[7]);
    return WL_ADD(WL_ADD(WL_ADD(s0, s2), WL_ADD(s1, s3)), extra);
}

// wl_q8_lane_{type}(row, xq, cols, j, &acc, &extra): lane j's whole share of one weight row
// (cols / BS blocks of BB bytes) against one token's cols / 32 activation blocks `xq`, groups in
// order. The kernel runs the same steps, several tokens per decoded group.
#define WL_Q8_KIND_q4_0 0
#define WL_Q8_KIND_q4_1 1
#define WL_Q8_KIND_q5_0 0
#define WL_Q8_KIND_q5_1 1
#define WL_Q8_KIND_q8_0 0
#define WL_Q8_KIND_q4_k (-1)
#define WL_Q8_KIND_q6_k 0

#define WL_Q8_LANE(NAME, BS, BB)                                                                  \
    WL_HD void wl_q8_lane_##NAME(const wl_u8* row, const wl_u8* xq, wl_u64 cols, int j, float* acc, \
                                 float* extra) {                                                  \
        float a = 0.0f, e = 0.0f;                                                                 \
        for (wl_u64 b = 0; b < cols / (BS); ++b) {                                                \
            for (int g = 0; g < (BS) / 32; ++g) {                                                 \
                float dw, mw;                                                                     \
                wl_u32 w4 = wl_q8w_##NAME(row + b * (BB), g, j, 0, &dw, &mw);                     \
                const wl_u8* xb = xq + (b * ((BS) / 32) + (wl_u64)g) * WL_Q8_BLOCK_BYTES;         \
                wl_q8_step(w4, dw, mw, xb, j, WL_Q8_KIND_##NAME, &a, &e);                         \
            }                                                                                     \
        }                                                                                         \
        *acc = a;                                                                                 \
        *extra = e;                                                                               \
    }

WL_Q8_LANE(q4_0, 32, 18)
WL_Q8_LANE(q4_1, 32, 20)
WL_Q8_LANE(q5_0, 32, 22)
WL_Q8_LANE(q5_1, 32, 24)
WL_Q8_LANE(q8_0, 32, 34)
WL_Q8_LANE(q4_k, 256, 144)
WL_Q8_LANE(q6_k, 256, 210)

// The decode kernels' order (q8_matvec_{type}, for memory bandwidth): a weight row belongs to
// `wpr` warps (1, 2, 4 or 8, chosen by the host to fill the device), 32 * wpr lanes in all.
// Lane L of the row (warp L / 32, lane L % 32) takes word j = L % 8 of the row's 32-value
// groups L / 8, L / 8 + 4 * wpr, L / 8 + 8 * wpr, ..., in that order, in one FMA chain of
// wl_q8_step_v (the lanes of word 0 also keep the groups' extra terms, in a chain of their
// own). Each warp adds its 32 chains by an xor butterfly (offsets 16, 8, 4, 2, 1), its extra
// chains likewise; the row's result is then the warps' sums added in warp order, plus the
// warps' extra sums added in warp order. This is not the CPU's order (q8_matmul_{type} keeps
// that one for prompts); it spreads a row over up to 32 times the threads and reads words.
// wl_q8v_lane_{type}(row, xq, cols, L, wpr, al, &acc, &extra) is lane L's two chains; it
// loads WL_Q8V_UNROLL groups' words before it uses any, so their loads are in flight together.
#define WL_Q8V_UNROLL 4

#define WL_Q8V_LANE(NAME, BS, BB)                                                                  \
    WL_HD void wl_q8v_lane_##NAME(const wl_u8* row, const wl_u8* xq, wl_u64 cols, int lane, int wpr, \
                                  int al, float* acc, float* extra) {                              \
        const int j = lane % 8;                                                                    \
        const wl_u64 step = 4 * (wl_u64)wpr;                                                       \
        /* a group's extra term is the whole block's: word 0's lane adds it */                     \
        const int kind = j == 0 ? WL_Q8_KIND_##NAME : 0;                                           \
        const wl_u64 n_groups = cols / 32;                                                         \
        float a = 0.0f, e = 0.0f;                                                                  \
        for (wl_u64 g0 = (wl_u64)(lane / 8); g0 < n_groups; g0 += step * WL_Q8V_UNROLL) {          \
            wl_u32 w4[WL_Q8V_UNROLL], xw[WL_Q8V_UNROLL];                                           \
            float dw[WL_Q8V_UNROLL], mw[WL_Q8V_UNROLL], xd[WL_Q8V_UNROLL];                         \
            int xs[WL_Q8V_UNROLL];                                                                 \
            WL_UNROLL                                                                              \
            for (int u = 0; u < WL_Q8V_UNROLL; ++u) {                                              \
                wl_u64 g = g0 + step * (wl_u64)u;                                                  \
                w4[u] = xw[u] = 0u;                                                                \
                dw[u] = mw[u] = xd[u] = 0.0f;                                                      \
                xs[u] = 0;                                                                         \
                if (g < n_groups) {                                                                \
                    w4[u] = wl_q8w_##NAME(row + (g / ((BS) / 32)) * (BB), (int)(g % ((BS) / 32)), j, \
                                          al, &dw[u], &mw[u]);                                     \
                    const wl_u8* xb = xq + g * WL_Q8_BLOCK_BYTES;                                  \
                    /* activation blocks are 40 bytes: 4-byte aligned when al */                  \
                    xd[u] = wl_bits_to_f32(wl_wld32a(xb, al));                                     \
                    xs[u] = (int)wl_wld32a(xb + 4, al);                                            \
                    xw[u] = wl_wld32a(xb + 8 + 4 * j, al);                                         \
                }                                                                                  \
            }                                                                                      \
            WL_UNROLL                                                                              \
            for (int u = 0; u < WL_Q8V_UNROLL; ++u) {                                              \
                if (g0 + step * (wl_u64)u < n_groups) {                                            \
                    wl_q8_step_v(w4[u], dw[u], mw[u], xd[u], xs[u], xw[u], kind, &a, &e);          \
                }                                                                                  \
            }                                                                                      \
        }                                                                                          \
        *acc = a;                                                                                  \
        *extra = e;                                                                                \
    }

WL_Q8V_LANE(q4_0, 32, 18)
WL_Q8V_LANE(q4_1, 32, 20)
WL_Q8V_LANE(q5_0, 32, 22)
WL_Q8V_LANE(q5_1, 32, 24)
WL_Q8V_LANE(q8_0, 32, 34)
WL_Q8V_LANE(q4_k, 256, 144)
WL_Q8V_LANE(q6_k, 256, 210)
