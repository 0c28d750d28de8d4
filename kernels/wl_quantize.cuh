// Block quantisers for quantise-on-load, shared by the CUDA kernels (quantize.cu) and the host
// C++ test shim: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K and Q6_K from f32 values, writing the bytes
// llama.cpp's reference quantisers (`quantize_row_*_ref`, no importance matrix) write, as the
// Rust scalar quantisers do (src/cpu/quantize_blocks.rs): the same float operations in the
// same order, each one rounded on its own, and the same integer conversions.
//
// Bit-identity on the device needs more than the shared header's uncontracted multiply-add:
// division and square root are the IEEE ones (__fdiv_rn, __fsqrt_rn, whatever the compile's
// precision options), rounding to an integer is written out in exact steps, and x86's
// float-to-int conversion (NaN and out-of-range to INT_MIN, which ggml's binaries give and the
// CPU path copies) is explicit, since a CUDA conversion saturates instead.
#pragma once
#include "wl_common.cuh"
#include "wl_dequant.cuh"

#if defined(__CUDA_ARCH__)
#define WL_DIV(a, b) __fdiv_rn((a), (b))
#define WL_SQRT(a) __fsqrt_rn(a)
#else
#define WL_DIV(a, b) ((a) / (b))
#define WL_SQRT(a) sqrtf(a)
#endif

// A block quantiser: compiled once per module and called by the kernels of each source type,
// rather than inlined three times (NVRTC's time and the module's code triple otherwise).
#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
#define WL_QZ_FN __host__ __device__ __noinline__
#else
#define WL_QZ_FN static
#endif

// ggml's GROUP_MAX_EPS: groups whose largest magnitude is below it quantise to zero.
#define WL_GROUP_MAX_EPS 1e-15f

WL_HD float wl_qz_fabs(float x) { return wl_bits_to_f32(wl_f32_to_bits(x) & 0x7fffffffu); }

// ggml's nearest_int: round to nearest even through the f32 mantissa (exact for |x| < 2^22;
// larger values give the same wrapped bits ggml gives).
WL_HD int wl_nearest_int(float x) {
    wl_u32 bits = wl_f32_to_bits(WL_ADD(x, 12582912.0f));
    return (int)(bits & 0x007fffffu) - 0x00400000;
}

// x86-64's cvttss2si: truncation toward zero, NaN and values outside the i32 range give INT_MIN.
WL_HD int wl_cvtt(float x) {
    if (!(x >= -2147483648.0f && x < 2147483648.0f)) return (int)0x80000000u;
    return (int)x;
}

// roundf (half away from zero), exactly: x minus its integer part is exact, so the comparison
// with one half decides the rounding without a rounded add. Infinities and NaN pass through.
WL_HD float wl_round_away(float x) {
    float t = truncf(x);
    if (wl_qz_fabs(WL_SUB(x, t)) >= 0.5f) t = WL_ADD(t, x < 0.0f ? -1.0f : 1.0f);
    return t;
}

// f32 to f16 bits as ggml's software GGML_FP32_TO_FP16 computes them: round to nearest even,
// overflow to +-inf, every NaN to the quiet 0x7e00 with its sign (wl_f32_to_f16 keeps a NaN's
// payload instead; the two agree on every other value). Scaling by 2^112 then 2^-110 rounds
// the magnitude into f16 range, and adding a power of two at the f16 mantissa's last bit makes
// the f32 addition round the mantissa, normal or subnormal.
WL_HD wl_u16 wl_ggml_f16(float f) {
    float base = WL_MUL(WL_MUL(wl_qz_fabs(f), wl_bits_to_f32(0x77800000u)), wl_bits_to_f32(0x08800000u));
    wl_u32 w = wl_f32_to_bits(f);
    wl_u32 shl1 = w + w;
    wl_u32 sign = w & 0x80000000u;
    wl_u32 bias = shl1 & 0xff000000u;
    if (bias < 0x71000000u) bias = 0x71000000u;
    wl_u32 rounded = wl_f32_to_bits(WL_ADD(wl_bits_to_f32((bias >> 1) + 0x07800000u), base));
    wl_u32 exp = (rounded >> 13) & 0x7c00u;
    wl_u32 man = rounded & 0x0fffu;
    wl_u32 nonsign = shl1 > 0xff000000u ? 0x7e00u : exp + man;
    return (wl_u16)((sign >> 16) | nonsign);
}

WL_HD void wl_put_f16(wl_u8* p, wl_u16 h) {
    p[0] = (wl_u8)(h & 0xffu);
    p[1] = (wl_u8)(h >> 8);
}

// The signed value of largest magnitude (the first such) of n values, as ggml's scans find it
// (its legacy types write `amax < ax`, Q6_K's `ax > amax`: the same test).
WL_HD float wl_signed_absmax(const float* x, int n, float* amax_out) {
    float amax = 0.0f, max = 0.0f;
    for (int i = 0; i < n; ++i) {
        float ax = wl_qz_fabs(x[i]);
        if (amax < ax) {
            amax = ax;
            max = x[i];
        }
    }
    *amax_out = amax;
    return max;
}

// The smallest and largest of 32 values as ggml's Q4_1 / Q5_1 scan finds them.
WL_HD void wl_min_max32(const float* x, float* min_out, float* max_out) {
    float min = wl_bits_to_f32(0x7f7fffffu), max = -wl_bits_to_f32(0x7f7fffffu);
    for (int i = 0; i < 32; ++i) {
        if (x[i] < min) min = x[i];
        if (x[i] > max) max = x[i];
    }
    *min_out = min;
    *max_out = max;
}

// Q8_0: d = amax / 127 (f16), q = roundf(x / d) as a signed byte.
WL_QZ_FN void wl_qz_q8_0(const float* x, wl_u8* dst) {
    float amax = 0.0f;
    for (int i = 0; i < 32; ++i) {
        float a = wl_qz_fabs(x[i]);
        amax = amax > a ? amax : a;
    }
    float d = WL_DIV(amax, 127.0f);
    float id = d != 0.0f ? WL_DIV(1.0f, d) : 0.0f;
    wl_put_f16(dst, wl_ggml_f16(d));
    for (int i = 0; i < 32; ++i) dst[2 + i] = (wl_u8)wl_cvtt(wl_round_away(WL_MUL(x[i], id)));
}

// Q4_0's quant of v: min(15, trunc(v / d + 8.5)) as a signed byte, then its bits.
WL_HD wl_u8 wl_q4_0_quant(float v, float id) {
    wl_i8 q = (wl_i8)wl_cvtt(WL_ADD(WL_MUL(v, id), 8.5f));
    return (wl_u8)(q < 15 ? q : 15);
}

// Q4_0: d = max / -8 (the signed value of largest magnitude).
WL_QZ_FN void wl_qz_q4_0(const float* x, wl_u8* dst) {
    float amax;
    float max = wl_signed_absmax(x, 32, &amax);
    float d = WL_DIV(max, -8.0f);
    float id = d != 0.0f ? WL_DIV(1.0f, d) : 0.0f;
    wl_put_f16(dst, wl_ggml_f16(d));
    for (int j = 0; j < 16; ++j) {
        dst[2 + j] = (wl_u8)(wl_q4_0_quant(x[j], id) | (wl_q4_0_quant(x[j + 16], id) << 4));
    }
}

// Q4_1's quant of v: min(15, trunc((v - min) / d + 0.5)).
WL_HD wl_u8 wl_q4_1_quant(float v, float min, float id) {
    wl_i8 q = (wl_i8)wl_cvtt(WL_ADD(WL_MUL(WL_SUB(v, min), id), 0.5f));
    return (wl_u8)(q < 15 ? q : 15);
}

// Q4_1: d = (max - min) / 15, m = min.
WL_QZ_FN void wl_qz_q4_1(const float* x, wl_u8* dst) {
    float min, max;
    wl_min_max32(x, &min, &max);
    float d = WL_DIV(WL_SUB(max, min), 15.0f);
    float id = d != 0.0f ? WL_DIV(1.0f, d) : 0.0f;
    wl_put_f16(dst, wl_ggml_f16(d));
    wl_put_f16(dst + 2, wl_ggml_f16(min));
    for (int j = 0; j < 16; ++j) {
        dst[4 + j] = (wl_u8)(wl_q4_1_quant(x[j], min, id) | (wl_q4_1_quant(x[j + 16], min, id) << 4));
    }
}

// Packs 32 five-bit quants as Q5_0 / Q5_1 store them: qh (u32 little-endian, bit j = fifth bit
// of value j), then 16 bytes of low nibbles (value j low, value j + 16 high).
WL_HD void wl_pack5(const wl_u8* q, wl_u8* out) {
    wl_u32 qh = 0;
    for (int j = 0; j < 16; ++j) {
        wl_u8 a = q[j], b = q[j + 16];
        out[4 + j] = (wl_u8)((a & 0x0f) | ((b & 0x0f) << 4));
        qh |= ((wl_u32)((a & 0x10) >> 4)) << j;
        qh |= ((wl_u32)((b & 0x10) >> 4)) << (j + 16);
    }
    for (int k = 0; k < 4; ++k) out[k] = (wl_u8)(qh >> (8 * k));
}

// Q5_0: d = max / -16, q = min(31, trunc(x / d + 16.5)).
WL_QZ_FN void wl_qz_q5_0(const float* x, wl_u8* dst) {
    float amax;
    float max = wl_signed_absmax(x, 32, &amax);
    float d = WL_DIV(max, -16.0f);
    float id = d != 0.0f ? WL_DIV(1.0f, d) : 0.0f;
    wl_put_f16(dst, wl_ggml_f16(d));
    wl_u8 q[32];
    for (int i = 0; i < 32; ++i) {
        wl_i8 v = (wl_i8)wl_cvtt(WL_ADD(WL_MUL(x[i], id), 16.5f));
        q[i] = (wl_u8)(v < 31 ? v : 31);
    }
    wl_pack5(q, dst + 2);
}

// Q5_1: d = (max - min) / 31, m = min, q = trunc((x - min) / d + 0.5) (no clamp in ggml).
WL_QZ_FN void wl_qz_q5_1(const float* x, wl_u8* dst) {
    float min, max;
    wl_min_max32(x, &min, &max);
    float d = WL_DIV(WL_SUB(max, min), 31.0f);
    float id = d != 0.0f ? WL_DIV(1.0f, d) : 0.0f;
    wl_put_f16(dst, wl_ggml_f16(d));
    wl_put_f16(dst + 2, wl_ggml_f16(min));
    wl_u8 q[32];
    for (int i = 0; i < 32; ++i) q[i] = (wl_u8)wl_cvtt(WL_ADD(WL_MUL(WL_SUB(x[i], min), id), 0.5f));
    wl_pack5(q, dst + 4);
}

WL_HD int wl_clamp_i(int v, int lo, int hi) { return v < lo ? lo : (v > hi ? hi : v); }

// ggml's make_qkx2_quants with Q4_K's parameters (nmax 15, rmin -1, rdelta 0.1, nstep 20,
// squared error): fits x ~ scale * l - the_min over 32 values with weights w by trying 21
// scales; writes the quants to l, the scale to *scale and the (positive) min to *the_min.
WL_HD void wl_make_qkx2_q4k(const float* x, const float* w, wl_u8* l, float* scale_out, float* min_out) {
    const int nmax = 15;
    float min = x[0], max = x[0];
    float sum_w = w[0];
    float sum_x = WL_MUL(sum_w, x[0]);
    for (int i = 1; i < 32; ++i) {
        if (x[i] < min) min = x[i];
        if (x[i] > max) max = x[i];
        sum_w = WL_ADD(sum_w, w[i]);
        sum_x = WL_ADD(sum_x, WL_MUL(w[i], x[i]));
    }
    if (min > 0.0f) min = 0.0f;
    if (max == min) {
        for (int i = 0; i < 32; ++i) l[i] = 0;
        *scale_out = 0.0f;
        *min_out = -min;
        return;
    }
    float iscale = WL_DIV((float)nmax, WL_SUB(max, min));
    float scale = WL_DIV(1.0f, iscale);
    float best_error = 0.0f;
    for (int i = 0; i < 32; ++i) {
        int q = wl_clamp_i(wl_nearest_int(WL_MUL(iscale, WL_SUB(x[i], min))), 0, nmax);
        l[i] = (wl_u8)q;
        float diff = WL_SUB(WL_ADD(WL_MUL(scale, (float)q), min), x[i]);
        best_error = WL_ADD(best_error, WL_MUL(w[i], WL_MUL(diff, diff)));
    }
    wl_u8 aux[32];
    for (int step = 0; step <= 20; ++step) {
        iscale = WL_DIV(WL_ADD(WL_ADD(-1.0f, WL_MUL(0.1f, (float)step)), (float)nmax), WL_SUB(max, min));
        float sum_l = 0.0f, sum_l2 = 0.0f, sum_xl = 0.0f;
        for (int i = 0; i < 32; ++i) {
            int q = wl_clamp_i(wl_nearest_int(WL_MUL(iscale, WL_SUB(x[i], min))), 0, nmax);
            aux[i] = (wl_u8)q;
            float lf = (float)q;
            sum_l = WL_ADD(sum_l, WL_MUL(w[i], lf));
            sum_l2 = WL_ADD(sum_l2, WL_MUL(WL_MUL(w[i], lf), lf));
            sum_xl = WL_ADD(sum_xl, WL_MUL(WL_MUL(w[i], lf), x[i]));
        }
        float det = WL_SUB(WL_MUL(sum_w, sum_l2), WL_MUL(sum_l, sum_l));
        if (det > 0.0f) {
            float this_scale = WL_DIV(WL_SUB(WL_MUL(sum_w, sum_xl), WL_MUL(sum_x, sum_l)), det);
            float this_min = WL_DIV(WL_SUB(WL_MUL(sum_l2, sum_x), WL_MUL(sum_l, sum_xl)), det);
            if (this_min > 0.0f) {
                this_min = 0.0f;
                this_scale = WL_DIV(sum_xl, sum_l2);
            }
            float cur_error = 0.0f;
            for (int i = 0; i < 32; ++i) {
                float diff = WL_SUB(WL_ADD(WL_MUL(this_scale, (float)aux[i]), this_min), x[i]);
                cur_error = WL_ADD(cur_error, WL_MUL(w[i], WL_MUL(diff, diff)));
            }
            if (cur_error < best_error) {
                for (int i = 0; i < 32; ++i) l[i] = aux[i];
                best_error = cur_error;
                scale = this_scale;
                min = this_min;
            }
        }
    }
    *scale_out = scale;
    *min_out = -min;
}

// Q4_K: eight sub-blocks of 32, each fitted by wl_make_qkx2_q4k with weights
// sqrt(mean(x^2)) + |x|; their scales and mins are quantised to 6 bits against the block's
// largest (d, dmin as f16), then every value is requantised against its sub-block's final scale
// and min.
WL_QZ_FN void wl_qz_q4_k(const float* x, wl_u8* dst) {
    wl_u8 l[256];
    float scales[8], mins[8];
    for (int j = 0; j < 8; ++j) {
        const float* xs = x + 32 * j;
        float sum_x2 = 0.0f;
        for (int i = 0; i < 32; ++i) sum_x2 = WL_ADD(sum_x2, WL_MUL(xs[i], xs[i]));
        float av_x = WL_SQRT(WL_DIV(sum_x2, 32.0f));
        float w[32];
        for (int i = 0; i < 32; ++i) w[i] = WL_ADD(av_x, wl_qz_fabs(xs[i]));
        wl_make_qkx2_q4k(xs, w, l + 32 * j, &scales[j], &mins[j]);
    }
    float max_scale = 0.0f, max_min = 0.0f;
    for (int j = 0; j < 8; ++j) {
        if (scales[j] > max_scale) max_scale = scales[j];
        if (mins[j] > max_min) max_min = mins[j];
    }
    float inv_scale = max_scale > 0.0f ? WL_DIV(63.0f, max_scale) : 0.0f;
    float inv_min = max_min > 0.0f ? WL_DIV(63.0f, max_min) : 0.0f;
    wl_u8* sc = dst + 4;
    for (int k = 0; k < 12; ++k) sc[k] = 0;
    for (int j = 0; j < 8; ++j) {
        // the low byte first, then the clamp (ggml stores the int in a uint8_t, then MIN)
        wl_u8 ls = (wl_u8)wl_nearest_int(WL_MUL(inv_scale, scales[j]));
        wl_u8 lm = (wl_u8)wl_nearest_int(WL_MUL(inv_min, mins[j]));
        if (ls > 63) ls = 63;
        if (lm > 63) lm = 63;
        if (j < 4) {
            sc[j] = ls;
            sc[j + 4] = lm;
        } else {
            sc[j + 4] = (wl_u8)((ls & 0x0f) | ((lm & 0x0f) << 4));
            sc[j - 4] |= (wl_u8)((ls >> 4) << 6);
            sc[j] |= (wl_u8)((lm >> 4) << 6);
        }
    }
    wl_u16 dh = wl_ggml_f16(WL_DIV(max_scale, 63.0f));
    wl_u16 mh = wl_ggml_f16(WL_DIV(max_min, 63.0f));
    wl_put_f16(dst, dh);
    wl_put_f16(dst + 2, mh);
    for (int j = 0; j < 8; ++j) {
        int s, m;
        wl_scale_min_k4(j, sc, &s, &m);
        float d = WL_MUL(wl_f16_to_f32(dh), (float)s);
        if (d == 0.0f) continue;  // ggml keeps the fit's quants for this sub-block
        float dm = WL_MUL(wl_f16_to_f32(mh), (float)m);
        for (int i = 0; i < 32; ++i) {
            int q = wl_nearest_int(WL_DIV(WL_ADD(x[32 * j + i], dm), d));
            l[32 * j + i] = (wl_u8)wl_clamp_i(q, 0, 15);
        }
    }
    wl_u8* qs = dst + 16;
    for (int half = 0; half < 4; ++half) {
        for (int i = 0; i < 32; ++i) {
            qs[32 * half + i] = (wl_u8)(l[64 * half + i] | (l[64 * half + i + 32] << 4));
        }
    }
}

// ggml's make_qx_quants with Q6_K's parameters (nmax 32, weights x^2, no importance matrix): a
// signed 6-bit fit of 16 values trying 19 scales; writes q + 32 to l and returns the scale.
WL_HD float wl_make_qx_q6k(const float* x, wl_u8* l) {
    const int nmax = 32;
    float amax;
    const float max = wl_signed_absmax(x, 16, &amax);
    if (amax < WL_GROUP_MAX_EPS) {
        for (int i = 0; i < 16; ++i) l[i] = 0;
        return 0.0f;
    }
    float iscale = WL_DIV(-(float)nmax, max);
    float sumlx = 0.0f, suml2 = 0.0f;
    for (int i = 0; i < 16; ++i) {
        int q = wl_clamp_i(wl_nearest_int(WL_MUL(iscale, x[i])), -nmax, nmax - 1);
        l[i] = (wl_u8)(q + nmax);
        float w = WL_MUL(x[i], x[i]);
        sumlx = WL_ADD(sumlx, WL_MUL(WL_MUL(w, x[i]), (float)q));
        suml2 = WL_ADD(suml2, WL_MUL(WL_MUL(w, (float)q), (float)q));
    }
    float scale = suml2 != 0.0f ? WL_DIV(sumlx, suml2) : 0.0f;
    float best = WL_MUL(scale, sumlx);
    for (int is = -9; is <= 9; ++is) {
        if (is == 0) continue;
        iscale = WL_DIV(-WL_ADD((float)nmax, WL_MUL(0.1f, (float)is)), max);
        sumlx = 0.0f;
        suml2 = 0.0f;
        for (int i = 0; i < 16; ++i) {
            float q = (float)wl_clamp_i(wl_nearest_int(WL_MUL(iscale, x[i])), -nmax, nmax - 1);
            float w = WL_MUL(x[i], x[i]);
            sumlx = WL_ADD(sumlx, WL_MUL(WL_MUL(w, x[i]), q));
            suml2 = WL_ADD(suml2, WL_MUL(WL_MUL(w, q), q));
        }
        if (suml2 > 0.0f && WL_MUL(sumlx, sumlx) > WL_MUL(best, suml2)) {
            for (int i = 0; i < 16; ++i) {
                l[i] = (wl_u8)(wl_clamp_i(wl_nearest_int(WL_MUL(iscale, x[i])), -nmax, nmax - 1) + nmax);
            }
            scale = WL_DIV(sumlx, suml2);
            best = WL_MUL(scale, sumlx);
        }
    }
    return scale;
}

// Q6_K: sixteen sub-blocks of 16, each fitted by wl_make_qx_q6k; the scales are quantised to
// signed bytes against the largest (d as f16), then every value is requantised against its
// sub-block's final scale. A block whose scales are all below GROUP_MAX_EPS is all zeros.
WL_QZ_FN void wl_qz_q6_k(const float* x, wl_u8* dst) {
    wl_u8 l[256];
    float scales[16];
    for (int ib = 0; ib < 16; ++ib) scales[ib] = wl_make_qx_q6k(x + 16 * ib, l + 16 * ib);
    float max_abs_scale;
    const float max_scale = wl_signed_absmax(scales, 16, &max_abs_scale);
    if (max_abs_scale < WL_GROUP_MAX_EPS) {
        for (int k = 0; k < 210; ++k) dst[k] = 0;
        return;
    }
    float iscale = WL_DIV(-128.0f, max_scale);
    wl_u16 dh = wl_ggml_f16(WL_DIV(1.0f, iscale));
    wl_put_f16(dst + 208, dh);
    for (int ib = 0; ib < 16; ++ib) {
        int q = wl_nearest_int(WL_MUL(iscale, scales[ib]));
        dst[192 + ib] = (wl_u8)(q < 127 ? q : 127);
    }
    for (int j = 0; j < 16; ++j) {
        float d = WL_MUL(wl_f16_to_f32(dh), (float)(wl_i8)dst[192 + j]);
        if (d == 0.0f) continue;  // ggml keeps the fit's quants for this sub-block
        for (int i = 0; i < 16; ++i) {
            int q = wl_clamp_i(wl_nearest_int(WL_DIV(x[16 * j + i], d)), -32, 31);
            l[16 * j + i] = (wl_u8)(q + 32);
        }
    }
    for (int half = 0; half < 2; ++half) {
        wl_u8* ql = dst + 64 * half;
        wl_u8* qh = dst + 128 + 32 * half;
        const wl_u8* lb = l + 128 * half;
        for (int i = 0; i < 32; ++i) {
            wl_u8 a = lb[i], b = lb[i + 32], c = lb[i + 64], e = lb[i + 96];
            ql[i] = (wl_u8)((a & 0x0f) | ((c & 0x0f) << 4));
            ql[i + 32] = (wl_u8)((b & 0x0f) | ((e & 0x0f) << 4));
            qh[i] = (wl_u8)((a >> 4) | ((b >> 4) << 2) | ((c >> 4) << 4) | ((e >> 4) << 6));
        }
    }
}

// Values per block and bytes per block of a type the quantisers write; 0 when there is none.
WL_HD int wl_qz_layout(int ty, int* bs, int* bb) {
    int o0, o1;
    switch (ty) {
        case WL_Q4_0:
        case WL_Q4_1:
        case WL_Q5_0:
        case WL_Q5_1:
        case WL_Q8_0:
        case WL_Q4_K:
        case WL_Q6_K:
            return wl_block_layout(ty, bs, bb, &o0, &o1);
        default:
            return 0;
    }
}

// The word that reports a non-finite source value: 0 when none, else the complement of
// (index << 2 | kind), kind 0 for NaN, 1 for +inf, 2 for -inf. The largest word names the
// smallest index, so reports from any number of blocks merge by max (atomicMax on the device).
WL_HD wl_u64 wl_qz_report(wl_u64 index, float v) {
    wl_u32 bits = wl_f32_to_bits(v);
    wl_u64 kind = (bits & 0x007fffffu) ? 0u : ((bits >> 31) ? 2u : 1u);
    return ~((index << 2) | kind);
}

// Quantises block `b` of `src` (little-endian values of float type `src_ty`: WL_F32, WL_F16 or
// WL_BF16) into block `b` of `dst` as ggml type `ty`. Returns 0, or, when the block holds a NaN
// or +-inf, the report (wl_qz_report) of its first one, with `first` added to the index (the
// position of src's first value in the tensor), and writes nothing.
WL_HD wl_u64 wl_quantize_block(int ty, int src_ty, const wl_u8* src, wl_u8* dst, wl_u64 b, wl_u64 first) {
    int bs, bb;
    if (!wl_qz_layout(ty, &bs, &bb)) return 0;
    float x[256];
    for (int i = 0; i < bs; ++i) {
        wl_u64 k = b * (wl_u64)bs + (wl_u64)i;
        // the offset may pass 2^31 values: the bytes are indexed in 64 bits, not by the
        // decoders' int
        float v;
        if (src_ty == WL_F32) v = wl_dq_f32(src + 4 * k, 0);
        else if (src_ty == WL_F16) v = wl_dq_f16(src + 2 * k, 0);
        else v = wl_dq_bf16(src + 2 * k, 0);
        if ((wl_f32_to_bits(v) & 0x7f800000u) == 0x7f800000u) return wl_qz_report(first + k, v);
        x[i] = v;
    }
    wl_u8* out = dst + b * (wl_u64)bb;
    switch (ty) {
        case WL_Q4_0: wl_qz_q4_0(x, out); break;
        case WL_Q4_1: wl_qz_q4_1(x, out); break;
        case WL_Q5_0: wl_qz_q5_0(x, out); break;
        case WL_Q5_1: wl_qz_q5_1(x, out); break;
        case WL_Q8_0: wl_qz_q8_0(x, out); break;
        case WL_Q4_K: wl_qz_q4_k(x, out); break;
        default: wl_qz_q6_k(x, out); break;
    }
    return 0;
}
