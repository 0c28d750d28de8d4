// KV-cache groups of 32 values with one f16 scale, shared by the CUDA kernels and the host
// shim (and the bf16 cache's codec and attention reader, at the end). q8: 34 bytes (f16 d, 32 x int8), q = round(x/d) in [-127, 127], d = amax/127.
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

// 1/sqrt(32) as an f32 (the bits Rust's `1.0 / 32f32.sqrt()` gives), so no compiler flag can
// change the turn's last step.
#define WL_KV_TURN_NORM 0x3e3504f3u

// The orthonormal Walsh-Hadamard transform of a group of 32 values, in place, with the
// butterflies in the Rust codec's order (stage h pairs value j with j + h for every j whose bit
// h is clear): the quantised caches store each group turned by it, and it is its own inverse.
WL_HD void wl_kv_turn(float* g) {
    for (int h = 1; h < 32; h *= 2) {
        for (int i = 0; i < 32; i += 2 * h) {
            for (int j = i; j < i + h; ++j) {
                float a = g[j];
                float b = g[j + h];
                g[j] = WL_ADD(a, b);
                g[j + h] = WL_SUB(a, b);
            }
        }
    }
    float norm = wl_bits_to_f32(WL_KV_TURN_NORM);
    for (int i = 0; i < 32; ++i) g[i] = WL_MUL(g[i], norm);
}

// OCP FP8 E4M3 (bias 7, no infinities, 0x7f/0xff NaN, largest 448): exact decode.
WL_HD float wl_e4m3_decode(wl_u8 b) {
    wl_u32 e = (b >> 3) & 0x0fu;
    wl_u32 m = b & 0x07u;
    if (e == 0x0fu && m == 0x07u) {
        return wl_bits_to_f32(0x7fc00000u);
    }
    wl_u32 sign = (b & 0x80u) ? 0x80000000u : 0u;
    if (e == 0u) {
        // m * 2^-9, exact
        return wl_bits_to_f32(sign | wl_f32_to_bits(WL_MUL((float)m, 0.001953125f)));
    }
    return wl_bits_to_f32(sign | ((e + 120u) << 23) | (m << 20));
}

// Round to nearest even, saturating at +-448; NaN gives 0x7f.
WL_HD wl_u8 wl_e4m3_encode(float x) {
    if (x != x) {
        return 0x7fu;
    }
    wl_u32 bits = wl_f32_to_bits(x);
    wl_u8 sign = (bits >> 31) ? 0x80u : 0u;
    wl_u32 abits = bits & 0x7fffffffu;
    float a = wl_bits_to_f32(abits);
    if (a >= 448.0f) {
        return (wl_u8)(sign | 0x7eu);
    }
    if (a < 0.015625f) {
        // below 2^-6 the codes are m * 2^-9; a rounding up to 8 is the smallest normal's code
        return (wl_u8)(sign | (wl_u8)(int)rintf(WL_MUL(a, 512.0f)));
    }
    int e = (int)(abits >> 23) - 127;
    float scaled = wl_bits_to_f32((abits & 0x007fffffu) | 0x3f800000u);
    int m = (int)rintf(WL_MUL(WL_SUB(scaled, 1.0f), 8.0f));
    // a mantissa rounding up to 8 carries into the exponent, as the codes are ordered
    int code = ((e + 7) << 3) + m;
    return (wl_u8)(sign | (wl_u8)(code > 0x7e ? 0x7e : code));
}

// One cache group of a turned quantised format (q8: qmax 127, q4: qmax 7): turn, then quantise.
WL_HD void wl_kv_store_group(const float* x, wl_u8* out, int qmax) {
    float t[32];
    for (int i = 0; i < 32; ++i) t[i] = x[i];
    wl_kv_turn(t);
    wl_kv_quantize_group(t, out, qmax);
}

// The inverse of wl_kv_store_group: dequantise, then turn back.
WL_HD void wl_kv_load_group(const wl_u8* g, float* out, int qmax) {
    for (int i = 0; i < 32; ++i) out[i] = wl_kv_dequant(g, i, qmax);
    wl_kv_turn(out);
}

// The bf16 cache: one value per 2 bytes, rounded to nearest even on the way in
// (wl_f32_to_bf16) and widened exactly on the way out, as the Rust codec's KvFormat::BF16.
WL_HD wl_u16 wl_kv_store_bf16(float x) { return wl_f32_to_bf16(x); }
WL_HD float wl_kv_load_bf16(wl_u16 h) { return wl_bf16_to_f32(h); }

// The row of a cache layer of `rows` rows that holds position `j`: a sliding-window layer's
// cache is a ring of its window and one chunk of input (weightlift-plan's SlidingWindow::cells),
// position j in row j % rows; a layer of every position has rows past its last position, so j
// itself (the test skips the division there). The attention kernels read and rope_kv_store
// writes by it.
WL_HD wl_u64 wl_kv_cache_row(wl_u64 j, wl_u64 rows) { return j < rows ? j : j % rows; }

#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
// The attention kernels' cache readers (attention.cu, attention_prefill.cu,
// attention_prefill_mma.cu): `at(i, lane)` is value i of the cache half. The turned groups are
// decoded by the warp together: every lane of the warp calls `at` for the same group at once,
// lane l for value l of the group (the kernel's dims d = lane + 32 r with head_dim a multiple of
// 32), and the turn back is a butterfly over the lanes in the codec's order.
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

// The reader of a bf16 cache half: `at(i, lane)` is value i, whichever lane asks.
struct WlKvBf16 {
    const wl_u16* p;
    __device__ __forceinline__ float at(wl_u64 i, int) const { return wl_kv_load_bf16(p[i]); }
};
#endif
