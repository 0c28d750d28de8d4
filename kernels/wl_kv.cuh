// KV-cache groups of 32 values with one f16 scale, shared by the CUDA kernels and the host
// shim. q8: 34 bytes (f16 d, 32 x int8), q = round(x/d) in [-127, 127], d = amax/127.
// q4: 18 bytes (f16 d, 16 bytes of nibbles in Q4_0 order), q in [-7, 7] stored as q + 8,
// d = amax/7. d is rounded *up* to the next f16, so |x - q*d| <= d * (1/2 + 2^-16).
#pragma once
#include "wl_common.cuh"

// Bytes per group of 32: 34 for q8 (qmax 127), 18 for q4 (qmax 7).
WL_HD int wl_kv_group_bytes(int qmax) { return qmax == 127 ? 34 : 18; }

// amax / qmax rounded up to an f16 (saturating at 65504).
WL_HD wl_u16 wl_kv_scale(float amax, int qmax) {
    float d = amax / (float)qmax;
    wl_u16 h = wl_f32_to_f16(d);
    if (wl_f16_to_f32(h) < d && h < 0x7bffu) {
        h = (wl_u16)(h + 1u);
    }
    if (h >= 0x7c00u && d == d) {
        h = 0x7bffu;
    }
    return h;
}

// Quantises one group of 32 values `x` into `out` (34 bytes for qmax 127, 18 bytes for qmax 7).
WL_HD void wl_kv_quantize_group(const float* x, wl_u8* out, int qmax) {
    float amax = 0.0f;
    for (int i = 0; i < 32; ++i) {
        float a = x[i] < 0.0f ? -x[i] : x[i];
        amax = a > amax ? a : amax;
    }
    wl_u16 h = wl_kv_scale(amax, qmax);
    out[0] = (wl_u8)(h & 0xffu);
    out[1] = (wl_u8)(h >> 8);
    float d = wl_f16_to_f32(h);
    float id = d != 0.0f ? 1.0f / d : 0.0f;
    float fq = (float)qmax;
    for (int i = 0; i < 32; ++i) {
        float v = roundf(WL_MUL(x[i], id));
        v = v > fq ? fq : (v < -fq ? -fq : v);
        // NaN quantises to 0, as Rust's saturating `as i32` does (a C cast of NaN is undefined).
        int q = v == v ? (int)v : 0;
        if (qmax == 127) {
            out[2 + i] = (wl_u8)(wl_i8)q;
        } else if (i < 16) {
            out[2 + i] = (wl_u8)(q + 8);
        } else {
            out[2 + i - 16] = (wl_u8)(out[2 + i - 16] | ((q + 8) << 4));
        }
    }
}

WL_HD float wl_kv_dequant(const wl_u8* g, int i, int qmax) {
    float d = wl_rd_f16(g);
    int q = qmax == 127 ? (int)(wl_i8)g[2 + i] : ((i < 16 ? (g[2 + i] & 0x0f) : (g[2 + i - 16] >> 4)) - 8);
    return WL_MUL((float)q, d);
}
