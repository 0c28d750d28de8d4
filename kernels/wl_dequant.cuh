// Per-element decoders for ggml block types (layouts from llama.cpp's ggml-common.h), shared by
// the CUDA kernels and the host C++ test shim. `wl_dq_<type>(blk, i)` returns value `i` of the
// block starting at `blk`. Float operations follow gguf-py's order (multiply, then add or
// subtract, never fused), so results equal the Rust CPU kernels bit for bit.
#pragma once
#include "wl_common.cuh"

// ggml type ids (enum ggml_type)
#define WL_F32 0
#define WL_F16 1
#define WL_Q4_0 2
#define WL_Q4_1 3
#define WL_Q5_0 6
#define WL_Q5_1 7
#define WL_Q8_0 8
#define WL_Q2_K 10
#define WL_Q3_K 11
#define WL_Q4_K 12
#define WL_Q5_K 13
#define WL_Q6_K 14
#define WL_IQ4_NL 20
#define WL_BF16 30

WL_HD float wl_dq_f32(const wl_u8* b, int i) {
    const wl_u8* p = b + 4 * i;
    return wl_bits_to_f32((wl_u32)p[0] | ((wl_u32)p[1] << 8) | ((wl_u32)p[2] << 16) | ((wl_u32)p[3] << 24));
}

WL_HD float wl_dq_f16(const wl_u8* b, int i) { return wl_rd_f16(b + 2 * i); }

WL_HD float wl_dq_bf16(const wl_u8* b, int i) { return wl_bf16_to_f32(wl_rd_u16(b + 2 * i)); }

// Nibble `i` (0..32) of a 16-byte quant array: low nibbles are values 0..16, high nibbles 16..32.
WL_HD int wl_nibble(const wl_u8* qs, int i) { return i < 16 ? (qs[i] & 0x0f) : (qs[i - 16] >> 4); }

WL_HD float wl_dq_q4_0(const wl_u8* b, int i) {
    float d = wl_rd_f16(b);
    return WL_MUL(d, (float)(wl_nibble(b + 2, i) - 8));
}

WL_HD float wl_dq_q4_1(const wl_u8* b, int i) {
    float d = wl_rd_f16(b);
    float m = wl_rd_f16(b + 2);
    return WL_ADD(WL_MUL(d, (float)wl_nibble(b + 4, i)), m);
}

WL_HD int wl_q5_bit(const wl_u8* qh, int i) { return (qh[i / 8] >> (i % 8)) & 1; }

WL_HD float wl_dq_q5_0(const wl_u8* b, int i) {
    float d = wl_rd_f16(b);
    int q = wl_nibble(b + 6, i) | (wl_q5_bit(b + 2, i) << 4);
    return WL_MUL(d, (float)(q - 16));
}

WL_HD float wl_dq_q5_1(const wl_u8* b, int i) {
    float d = wl_rd_f16(b);
    float m = wl_rd_f16(b + 2);
    int q = wl_nibble(b + 8, i) | (wl_q5_bit(b + 4, i) << 4);
    return WL_ADD(WL_MUL(d, (float)q), m);
}

WL_HD float wl_dq_q8_0(const wl_u8* b, int i) {
    float d = wl_rd_f16(b);
    return WL_MUL((float)(wl_i8)b[2 + i], d);
}

WL_HD float wl_dq_iq4_nl(const wl_u8* b, int i) {
    const wl_i8 kv[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
    float d = wl_rd_f16(b);
    return WL_MUL(d, (float)kv[wl_nibble(b + 2, i)]);
}

// Q2_K: scales[16] | qs[64] | d | dmin
WL_HD float wl_dq_q2_k(const wl_u8* b, int e) {
    int h = e / 128, s = (e / 32) % 4, l = e % 32;
    int q = (b[16 + h * 32 + l] >> (2 * s)) & 3;
    int sc = b[e / 16];
    float d = wl_rd_f16(b + 80);
    float dmin = wl_rd_f16(b + 82);
    float dl = WL_MUL(d, (float)(sc & 0x0f));
    float ml = WL_MUL(dmin, (float)(sc >> 4));
    return WL_SUB(WL_MUL(dl, (float)q), ml);
}

// Q3_K: hmask[32] | qs[64] | scales[12] | d
WL_HD int wl_q3k_scale(const wl_u8* s, int i) {
    int lo = i < 8 ? (s[i] & 0x0f) : (s[i - 8] >> 4);
    int hi = (s[8 + i % 4] >> (2 * (i / 4))) & 3;
    return (lo | (hi << 4)) - 32;
}

WL_HD float wl_dq_q3_k(const wl_u8* b, int e) {
    int h = e / 128, s = (e / 32) % 4, l = e % 32;
    int ql = (b[32 + h * 32 + l] >> (2 * s)) & 3;
    int hbit = (b[l] >> (e / 32)) & 1;
    int q = ql - (hbit ? 0 : 4);
    float d = wl_rd_f16(b + 108);
    float dl = WL_MUL(d, (float)wl_q3k_scale(b + 96, e / 16));
    return WL_MUL(dl, (float)q);
}

// 6-bit scale and min of sub-block j of a Q4_K/Q5_K block (get_scale_min_k4)
WL_HD void wl_scale_min_k4(int j, const wl_u8* q, int* sc, int* m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

// Sub-block `sb`'s scale d · sc and min dmin · m of a Q4_K/Q5_K block (d | dmin | scales[12]).
WL_HD void wl_k4_scale_min(const wl_u8* b, int sb, float* d1, float* m1) {
    int sc, m;
    wl_scale_min_k4(sb, b + 4, &sc, &m);
    *d1 = WL_MUL(wl_rd_f16(b), (float)sc);
    *m1 = WL_MUL(wl_rd_f16(b + 2), (float)m);
}

// Q4_K: d | dmin | scales[12] | qs[128]
WL_HD float wl_dq_q4_k(const wl_u8* b, int e) {
    int sb = e / 32, l = e % 32;
    float d1, m1;
    wl_k4_scale_min(b, sb, &d1, &m1);
    int q = (b[16 + (sb / 2) * 32 + l] >> (4 * (sb % 2))) & 0x0f;
    return WL_SUB(WL_MUL(d1, (float)q), m1);
}

// Q5_K: d | dmin | scales[12] | qh[32] | qs[128]
WL_HD float wl_dq_q5_k(const wl_u8* b, int e) {
    int sb = e / 32, l = e % 32;
    float d1, m1;
    wl_k4_scale_min(b, sb, &d1, &m1);
    int q = ((b[48 + (sb / 2) * 32 + l] >> (4 * (sb % 2))) & 0x0f) | (((b[16 + l] >> sb) & 1) << 4);
    return WL_SUB(WL_MUL(d1, (float)q), m1);
}

// Q6_K: ql[128] | qh[64] | scales[16] (int8) | d
WL_HD float wl_dq_q6_k(const wl_u8* b, int e) {
    int h = e / 128, r = e % 128;
    int lo = (b[h * 64 + r % 64] >> (4 * (r / 64))) & 0x0f;
    int hi = (b[128 + h * 32 + r % 32] >> (2 * (r / 32))) & 3;
    int q = (lo | (hi << 4)) - 32;
    float dl = WL_MUL(wl_rd_f16(b + 208), (float)(wl_i8)b[192 + e / 16]);
    return WL_MUL(dl, (float)q);
}

// Eight values at once: `wl_dq8_<type>(b, e0, out)` writes values e0..e0 + 7 of the block at
// `b` (e0 a multiple of 8), each the bits `wl_dq_<type>(b, e0 + k)` gives, so the dequantise
// kernels can decode a block's scales once for eight values instead of once per value. Eight
// divides every block size here (32 or 256), so the eight share a block, and in the K-quants a
// 16- or 32-value sub-block, whose scale they share. A float type's "block" is one value: its
// eight read the eight values from `b` on (e0 is 0).
#define WL_DQ8_EACH(NAME)                                                      \
    WL_HD void wl_dq8_##NAME(const wl_u8* b, int e0, float* out) {             \
        for (int k = 0; k < 8; ++k) out[k] = wl_dq_##NAME(b, e0 + k);           \
    }
WL_DQ8_EACH(f32)
WL_DQ8_EACH(f16)
WL_DQ8_EACH(bf16)
WL_DQ8_EACH(q4_0)
WL_DQ8_EACH(q4_1)
WL_DQ8_EACH(q5_0)
WL_DQ8_EACH(q5_1)
WL_DQ8_EACH(q8_0)
WL_DQ8_EACH(iq4_nl)

WL_HD void wl_dq8_q2_k(const wl_u8* b, int e0, float* out) {
    int h = e0 / 128, s = (e0 / 32) % 4, l0 = e0 % 32;
    int sc = b[e0 / 16];
    float dl = WL_MUL(wl_rd_f16(b + 80), (float)(sc & 0x0f));
    float ml = WL_MUL(wl_rd_f16(b + 82), (float)(sc >> 4));
    const wl_u8* q = b + 16 + h * 32 + l0;
    for (int k = 0; k < 8; ++k) out[k] = WL_SUB(WL_MUL(dl, (float)((q[k] >> (2 * s)) & 3)), ml);
}

WL_HD void wl_dq8_q3_k(const wl_u8* b, int e0, float* out) {
    int h = e0 / 128, s = (e0 / 32) % 4, l0 = e0 % 32, sb = e0 / 32;
    float dl = WL_MUL(wl_rd_f16(b + 108), (float)wl_q3k_scale(b + 96, e0 / 16));
    const wl_u8* q = b + 32 + h * 32 + l0;
    const wl_u8* hm = b + l0;
    for (int k = 0; k < 8; ++k) {
        int v = ((q[k] >> (2 * s)) & 3) - (((hm[k] >> sb) & 1) ? 0 : 4);
        out[k] = WL_MUL(dl, (float)v);
    }
}

WL_HD void wl_dq8_q4_k(const wl_u8* b, int e0, float* out) {
    int sb = e0 / 32, l0 = e0 % 32;
    float d1, m1;
    wl_k4_scale_min(b, sb, &d1, &m1);
    const wl_u8* q = b + 16 + (sb / 2) * 32 + l0;
    for (int k = 0; k < 8; ++k) out[k] = WL_SUB(WL_MUL(d1, (float)((q[k] >> (4 * (sb % 2))) & 0x0f)), m1);
}

WL_HD void wl_dq8_q5_k(const wl_u8* b, int e0, float* out) {
    int sb = e0 / 32, l0 = e0 % 32;
    float d1, m1;
    wl_k4_scale_min(b, sb, &d1, &m1);
    const wl_u8* q = b + 48 + (sb / 2) * 32 + l0;
    const wl_u8* qh = b + 16 + l0;
    for (int k = 0; k < 8; ++k) {
        int v = ((q[k] >> (4 * (sb % 2))) & 0x0f) | (((qh[k] >> sb) & 1) << 4);
        out[k] = WL_SUB(WL_MUL(d1, (float)v), m1);
    }
}

WL_HD void wl_dq8_q6_k(const wl_u8* b, int e0, float* out) {
    int h = e0 / 128, r0 = e0 % 128;
    const wl_u8* lo = b + h * 64 + r0 % 64;
    const wl_u8* hi = b + 128 + h * 32 + r0 % 32;
    float dl = WL_MUL(wl_rd_f16(b + 208), (float)(wl_i8)b[192 + e0 / 16]);
    for (int k = 0; k < 8; ++k) {
        int v = (((lo[k] >> (4 * (r0 / 64))) & 0x0f) | (((hi[k] >> (2 * (r0 / 32))) & 3) << 4)) - 32;
        out[k] = WL_MUL(dl, (float)v);
    }
}

// Values and bytes per block of ggml type `ty`, and the byte offsets of its f16 scale fields
// (ggml-common.h: d, and dmin or m where the type has one; `*o1` is -1 when it has not).
// Returns 0 for a type this file does not decode; the float types have no scale fields.
WL_HD int wl_block_layout(int ty, int* bs, int* bb, int* o0, int* o1) {
    *o0 = 0;
    *o1 = -1;
    switch (ty) {
        case WL_F32: *bs = 1; *bb = 4; *o0 = -1; return 1;
        case WL_F16: *bs = 1; *bb = 2; *o0 = -1; return 1;
        case WL_BF16: *bs = 1; *bb = 2; *o0 = -1; return 1;
        case WL_Q4_0: *bs = 32; *bb = 18; return 1;
        case WL_Q4_1: *bs = 32; *bb = 20; *o1 = 2; return 1;
        case WL_Q5_0: *bs = 32; *bb = 22; return 1;
        case WL_Q5_1: *bs = 32; *bb = 24; *o1 = 2; return 1;
        case WL_Q8_0: *bs = 32; *bb = 34; return 1;
        case WL_IQ4_NL: *bs = 32; *bb = 18; return 1;
        case WL_Q2_K: *bs = 256; *bb = 84; *o0 = 80; *o1 = 82; return 1;
        case WL_Q3_K: *bs = 256; *bb = 110; *o0 = 108; return 1;
        case WL_Q4_K: *bs = 256; *bb = 144; *o1 = 2; return 1;
        case WL_Q5_K: *bs = 256; *bb = 176; *o1 = 2; return 1;
        case WL_Q6_K: *bs = 256; *bb = 210; *o0 = 208; return 1;
        default: return 0;
    }
}

// Whether block `blk` of a quantised type has a NaN or +-inf f16 scale (offsets from
// wl_block_layout). Finite scales decode to finite f32 values (at most 65504 * 127 * 32 in
// magnitude), and a non-finite scale makes the block's first value NaN or inf (inf * 0 is NaN),
// so the first such block holds the first non-finite value, at its first element.
WL_HD int wl_block_scales_non_finite(const wl_u8* blk, int o0, int o1) {
    return wl_f16_bits_non_finite(wl_rd_u16(blk + o0)) ||
           (o1 >= 0 && wl_f16_bits_non_finite(wl_rd_u16(blk + o1)));
}
