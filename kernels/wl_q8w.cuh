// Wide lanes for decode's Q8-mode products of Q4_K and Q6_K weights (q8_wide_matvec_{type} and
// swiglu_q8_wide_matvec_{type} in matvec.cu), shared with the host C++ test shim. Q4_K first;
// Q6_K at the end of this file.
//
// Why: the lanes of q8_matvec_q4_k (wl_q8.cuh) take one 4-byte quant word of one 32-value group
// a step and issue about nine loads for it (d and dmin, the scale bytes, the word, three words
// of the activation block): the kernel is bound by load instructions, not by bytes. Here a lane
// takes a *unit*, one pair of groups of one block (64 values), with 8 loads of 16 bytes:
// - the block's 16-byte head (d | dmin | 12 scale bytes) in one load: d and dmin are its first
//   word, and the pair's two 6-bit scales and mins come out of the other three words;
// - the pair's 32 quant bytes in two loads: their low nibbles are the first group's values,
//   their high nibbles the second's (Q4_K stores groups 2p and 2p + 1 in bytes 32p..32p + 31);
// - the two 40-byte Q8 activation blocks of those groups, 80 bytes in five loads (the first
//   of the two is an even block, so they start 16-byte aligned);
// then 16 dp4a (8 a group) and one FMA a group. About 0.25 loads a quant byte where the narrow
// lanes took about 4.5.
//
// Sum order (its own; the host twin replays it): unit u of a row is block u / 4, pair u % 4.
// A row belongs to `wpr` warps (32 * wpr lanes); lane L takes units L, L + 32 * wpr,
// L + 64 * wpr, ..., in that order, and for each its first group, then its second:
//   acc   = fma(d * sc * xd, isum, acc)          (isum: the group's exact integer dot)
//   extra = extra - (dmin * m * xd) * xsum       (xsum: the activation block's sum of quants)
// Each warp then adds its 32 acc chains by an xor butterfly (offsets 16, 8, 4, 2, 1), and its
// extra chains likewise; the row's value is the warps' acc sums in warp order plus the warps'
// extra sums in warp order (matvec.cu's wl_q8v_row_sum, as for q8_matvec_*). A group's terms
// are the narrow kernel's (d * sc and dmin * m rounded the same way), so the two differ only in
// the order of the additions.
#pragma once
#include "wl_q8.cuh"

// Units each lane loads before it uses any, so their loads are in flight together.
#define WL_Q8W_UNROLL 2

// 16 bytes at p as four little-endian words: one 128-bit load through the read-only path when
// `al` (the caller checked that p is 16-byte aligned), else byte by byte (the same words).
WL_HD void wl_q8w_ld128(const wl_u8* p, int al, wl_u32* v) {
#if defined(__CUDA_ARCH__)
    if (al) {
        asm("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];"
            : "=r"(v[0]), "=r"(v[1]), "=r"(v[2]), "=r"(v[3])
            : "l"(p));
        return;
    }
#endif
    (void)al;
    for (int k = 0; k < 4; ++k) v[k] = wl_rd_u32(p + 4 * k);
}

WL_HD int wl_q8w_byte(wl_u32 w, int k) { return (int)((w >> (8 * k)) & 0xffu); }

// Scale and min of group j (0..7) from the block head's words h[1..3] (scale bytes 0..3, 4..7,
// 8..11): wl_scale_min_k4's bits, read from registers.
WL_HD void wl_q8w_scale_min(const wl_u32* h, int j, int* sc, int* m) {
    const int k = j & 3;
    const int b0 = wl_q8w_byte(h[1], k), b1 = wl_q8w_byte(h[2], k), b2 = wl_q8w_byte(h[3], k);
    if (j < 4) {
        *sc = b0 & 63;
        *m = b1 & 63;
    } else {
        *sc = (b2 & 0x0f) | ((b0 >> 6) << 4);
        *m = (b2 >> 4) | ((b1 >> 6) << 4);
    }
}

// One unit's loads: the block head, the pair's quants, the two activation blocks.
typedef struct {
    wl_u32 h[4];
    wl_u32 q[8];
    wl_u32 x[20];
} wl_q8w_unit;

// Unit u of the Q4_K row `row` against the token's activation blocks `xq`.
WL_HD void wl_q8w_load_q4_k(const wl_u8* row, const wl_u8* xq, wl_u64 u, int al, wl_q8w_unit* t) {
    const wl_u8* blk = row + (u / 4) * 144;
    const wl_u8* qs = blk + 16 + 32 * (u % 4);
    const wl_u8* xb = xq + u * (2 * WL_Q8_BLOCK_BYTES);
    wl_q8w_ld128(blk, al, t->h);
    wl_q8w_ld128(qs, al, t->q);
    wl_q8w_ld128(qs + 16, al, t->q + 4);
    for (int k = 0; k < 5; ++k) wl_q8w_ld128(xb + 16 * k, al, t->x + 4 * k);
}

// One group's terms into the two chains: isum its integer dot, xd and xsum its activation
// block's scale and sum, dw and mw its weight scale (d * sc) and min (dmin * m).
WL_HD void wl_q8w_group(int isum, float dw, float mw, float xd, int xsum, float* acc, float* extra) {
    *acc = WL_FMA(WL_MUL(dw, xd), (float)isum, *acc);
    *extra = WL_SUB(*extra, WL_MUL(WL_MUL(mw, xd), (float)xsum));
}

// A loaded unit (pair p of its block) into the chains.
WL_HD void wl_q8w_use_q4_k(const wl_q8w_unit* t, int p, float* acc, float* extra) {
    const float d = wl_f16_to_f32_fast((wl_u16)(t->h[0] & 0xffffu));
    const float dmin = wl_f16_to_f32_fast((wl_u16)(t->h[0] >> 16));
    // activation words: block A's d, sum and 8 quant words at 0, 1, 2..9; block B's at 10, 11,
    // 12..19
    for (int s = 0; s < 2; ++s) {
        int isum = 0;
        WL_UNROLL
        for (int i = 0; i < 8; ++i) {
            isum = wl_dot4_i8((t->q[i] >> (4 * s)) & 0x0f0f0f0fu, t->x[10 * s + 2 + i], isum);
        }
        int sc, m;
        wl_q8w_scale_min(t->h, 2 * p + s, &sc, &m);
        wl_q8w_group(isum, WL_MUL(d, (float)sc), WL_MUL(dmin, (float)m),
                     wl_bits_to_f32(t->x[10 * s]), (int)t->x[10 * s + 1], acc, extra);
    }
}

// Lane `lane` of a row of `wpr` warps: its acc and extra chains over the row's units, in the
// order above.
WL_HD void wl_q8w_lane_q4_k(const wl_u8* row, const wl_u8* xq, wl_u64 cols, int lane, int wpr,
                            int al, float* acc, float* extra) {
    const wl_u64 n_units = cols / 64, step = 32 * (wl_u64)wpr;
    float a = 0.0f, e = 0.0f;
    for (wl_u64 u0 = (wl_u64)lane; u0 < n_units; u0 += step * WL_Q8W_UNROLL) {
        wl_q8w_unit t[WL_Q8W_UNROLL];
        WL_UNROLL
        for (int k = 0; k < WL_Q8W_UNROLL; ++k) {
            const wl_u64 u = u0 + step * (wl_u64)k;
            if (u < n_units) wl_q8w_load_q4_k(row, xq, u, al, &t[k]);
        }
        WL_UNROLL
        for (int k = 0; k < WL_Q8W_UNROLL; ++k) {
            const wl_u64 u = u0 + step * (wl_u64)k;
            if (u < n_units) wl_q8w_use_q4_k(&t[k], (int)(u % 4), &a, &e);
        }
    }
    *acc = a;
    *extra = e;
}

// Q6_K (210-byte blocks: ql[128] | qh[64] | scales[16] (int8, one per 16 values) | d). Value e
// of a block is half e / 128, r = e % 128: its low 4 bits in ql[64 * half + r % 64] (the low
// nibble when r < 64), its high 2 bits in qh[32 * half + r % 32] at bit 2 * (r / 32) (as
// wl_dq_q6_k). So quarters k and k + 2 of a half (32 values each: groups 4 * half + k and
// 4 * half + k + 2) share the 32 ql bytes at 64 * half + 32 * k (low and high nibbles), and
// all four quarters share the half's 32 qh bytes.
//
// A unit here is such a pair: unit u of a row is block u / 4, half (u / 2) % 2, k = u % 2, and
// a lane meets it with 32 ql bytes, 32 qh bytes, its four scales, d, and its two activation
// blocks (not adjacent: 5 eight-byte loads each). Blocks of 210 bytes are only 2-byte aligned,
// so the quant bytes come as 9 aligned 32-bit words each, realigned by a byte permute: about
// 31 loads for 48 quant bytes (0.65 a byte) where the narrow lanes take about 3.
// Sum order: as for Q4_K (lane L takes units L, L + 32 * wpr, ...), and in a unit group
// 4 * half + k, then group 4 * half + k + 2; a group adds two terms, its first 16 values and
// then its last 16 (each with its own scale): acc = fma(d * sc * xd, isum16, acc). No extra
// chain (Q6_K has no min).

// N little-endian words from p (any alignment): on the device N + 1 aligned 32-bit loads and
// a byte permute each (the words at p & ~3 shifted by p & 3 bytes; the load past the last word
// reads at most 3 bytes past p + 4N, inside the block for every caller), bytes on the host.
template <int N>
WL_HD void wl_q8w_ld_words(const wl_u8* p, int al, wl_u32* v) {
#if defined(__CUDA_ARCH__)
    if (al) {
        const wl_u8* b = (const wl_u8*)((wl_u64)p & ~(wl_u64)3);
        const wl_u32 sel = 0x3210u + 0x1111u * (wl_u32)((wl_u64)p & 3);
        wl_u32 w0 = wl_wld32a(b, 1);
        WL_UNROLL
        for (int i = 0; i < N; ++i) {
            const wl_u32 w1 = wl_wld32a(b + 4 * (i + 1), 1);
            v[i] = __byte_perm(w0, w1, sel);
            w0 = w1;
        }
        return;
    }
#endif
    (void)al;
    for (int i = 0; i < N; ++i) v[i] = wl_rd_u32(p + 4 * i);
}

// 40 bytes at p as ten words: five 64-bit loads when `al` (p 8-byte aligned), else bytes.
WL_HD void wl_q8w_ld_xblock(const wl_u8* p, int al, wl_u32* v) {
#if defined(__CUDA_ARCH__)
    if (al) {
        WL_UNROLL
        for (int k = 0; k < 5; ++k) {
            asm("ld.global.nc.v2.u32 {%0, %1}, [%2];"
                : "=r"(v[2 * k]), "=r"(v[2 * k + 1])
                : "l"(p + 8 * k));
        }
        return;
    }
#endif
    (void)al;
    for (int k = 0; k < 10; ++k) v[k] = wl_rd_u32(p + 4 * k);
}

typedef struct {
    wl_u32 ql[8];
    wl_u32 qh[8];
    wl_u32 sc[2];  // the two groups' scale pairs (low 16 bits)
    wl_u32 d;      // f16 bits
    wl_u32 x[20];  // the two activation blocks
} wl_q8w_unit6;

WL_HD void wl_q8w_load_q6_k(const wl_u8* row, const wl_u8* xq, wl_u64 u, int al,
                            wl_q8w_unit6* t) {
    const wl_u8* blk = row + (u / 4) * 210;
    const int half = (int)((u / 2) % 2), k = (int)(u % 2);
    const int ga = 4 * half + k;
    wl_q8w_ld_words<8>(blk + 64 * half + 32 * k, al, t->ql);
    wl_q8w_ld_words<8>(blk + 128 + 32 * half, al, t->qh);
    t->sc[0] = wl_wld16(blk + 192 + 2 * ga, al);
    t->sc[1] = wl_wld16(blk + 192 + 2 * (ga + 2), al);
    t->d = wl_wld16(blk + 208, al);
    const wl_u8* xb = xq + ((u / 4) * 8 + (wl_u64)ga) * WL_Q8_BLOCK_BYTES;
    wl_q8w_ld_xblock(xb, al, t->x);
    wl_q8w_ld_xblock(xb + 2 * WL_Q8_BLOCK_BYTES, al, t->x + 10);
}

WL_HD void wl_q8w_use_q6_k(const wl_q8w_unit6* t, int k, float* acc) {
    const float d = wl_f16_to_f32_fast((wl_u16)t->d);
    for (int s = 0; s < 2; ++s) {
        // group s of the unit: quarter k (low nibbles) or k + 2 (high nibbles)
        const int hs = 2 * (k + 2 * s);
        const float xd = wl_bits_to_f32(t->x[10 * s]);
        for (int part = 0; part < 2; ++part) {
            int isum = 0;
            WL_UNROLL
            for (int i = 4 * part; i < 4 * part + 4; ++i) {
                wl_u32 lo = (t->ql[i] >> (4 * s)) & 0x0f0f0f0fu;
                wl_u32 hi = (t->qh[i] >> hs) & 0x03030303u;
                isum = wl_dot4_i8(wl_sub_bytes(lo | (hi << 4), 32), t->x[10 * s + 2 + i], isum);
            }
            const float sc = (float)(wl_i8)(wl_u8)(t->sc[s] >> (8 * part));
            *acc = WL_FMA(WL_MUL(WL_MUL(d, sc), xd), (float)isum, *acc);
        }
    }
}

WL_HD void wl_q8w_lane_q6_k(const wl_u8* row, const wl_u8* xq, wl_u64 cols, int lane, int wpr,
                            int al, float* acc, float* extra) {
    const wl_u64 n_units = cols / 64, step = 32 * (wl_u64)wpr;
    float a = 0.0f;
    for (wl_u64 u0 = (wl_u64)lane; u0 < n_units; u0 += step * WL_Q8W_UNROLL) {
        wl_q8w_unit6 t[WL_Q8W_UNROLL];
        WL_UNROLL
        for (int k = 0; k < WL_Q8W_UNROLL; ++k) {
            const wl_u64 u = u0 + step * (wl_u64)k;
            if (u < n_units) wl_q8w_load_q6_k(row, xq, u, al, &t[k]);
        }
        WL_UNROLL
        for (int k = 0; k < WL_Q8W_UNROLL; ++k) {
            const wl_u64 u = u0 + step * (wl_u64)k;
            if (u < n_units) wl_q8w_use_q6_k(&t[k], (int)(u % 2), &a);
        }
    }
    *acc = a;
    *extra = 0.0f;
}
