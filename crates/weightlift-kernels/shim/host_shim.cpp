// Host build of the shared CUDA headers (kernels/*.cuh), linked into weightlift-kernels so the
// tests can compare the device decode maths with the Rust CPU kernels without a GPU.
// No C++ standard library: the crate links it with cc's cpp_link_stdlib(None).
#include <math.h>
#include <stddef.h>

#include "wl_dequant.cuh"
#include "wl_kv.cuh"

typedef float (*wl_dq_fn)(const wl_u8*, int);

static int wl_layout(int ty, int* bs, int* bb, wl_dq_fn* f) {
    switch (ty) {
        case WL_F32: *bs = 1; *bb = 4; *f = wl_dq_f32; return 1;
        case WL_F16: *bs = 1; *bb = 2; *f = wl_dq_f16; return 1;
        case WL_BF16: *bs = 1; *bb = 2; *f = wl_dq_bf16; return 1;
        case WL_Q4_0: *bs = 32; *bb = 18; *f = wl_dq_q4_0; return 1;
        case WL_Q4_1: *bs = 32; *bb = 20; *f = wl_dq_q4_1; return 1;
        case WL_Q5_0: *bs = 32; *bb = 22; *f = wl_dq_q5_0; return 1;
        case WL_Q5_1: *bs = 32; *bb = 24; *f = wl_dq_q5_1; return 1;
        case WL_Q8_0: *bs = 32; *bb = 34; *f = wl_dq_q8_0; return 1;
        case WL_IQ4_NL: *bs = 32; *bb = 18; *f = wl_dq_iq4_nl; return 1;
        case WL_Q2_K: *bs = 256; *bb = 84; *f = wl_dq_q2_k; return 1;
        case WL_Q3_K: *bs = 256; *bb = 110; *f = wl_dq_q3_k; return 1;
        case WL_Q4_K: *bs = 256; *bb = 144; *f = wl_dq_q4_k; return 1;
        case WL_Q5_K: *bs = 256; *bb = 176; *f = wl_dq_q5_k; return 1;
        case WL_Q6_K: *bs = 256; *bb = 210; *f = wl_dq_q6_k; return 1;
        default: return 0;
    }
}

// Dequantises `nblocks` blocks of ggml type `ty`; returns 0 for an unknown type.
extern "C" int wl_host_dequant(int ty, const wl_u8* src, float* dst, size_t nblocks) {
    int bs, bb;
    wl_dq_fn f;
    if (!wl_layout(ty, &bs, &bb, &f)) return 0;
    for (size_t b = 0; b < nblocks; ++b) {
        for (int i = 0; i < bs; ++i) dst[b * bs + i] = f(src + b * bb, i);
    }
    return 1;
}

extern "C" void wl_host_f32_to_f16(const float* src, wl_u16* dst, size_t n) {
    for (size_t i = 0; i < n; ++i) dst[i] = wl_f32_to_f16(src[i]);
}

// qmax 127 (q8, 34-byte groups) or 7 (q4, 18-byte groups).
extern "C" void wl_host_kv_quantize(const float* x, wl_u8* out, size_t n_groups, int qmax) {
    size_t gb = qmax == 127 ? 34 : 18;
    for (size_t g = 0; g < n_groups; ++g) {
        for (size_t k = 0; k < gb; ++k) out[g * gb + k] = 0;
        wl_kv_quantize_group(x + g * 32, out + g * gb, qmax);
    }
}

extern "C" void wl_host_kv_dequantize(const wl_u8* src, float* out, size_t n_groups, int qmax) {
    size_t gb = qmax == 127 ? 34 : 18;
    for (size_t g = 0; g < n_groups; ++g) {
        for (int i = 0; i < 32; ++i) out[g * 32 + i] = wl_kv_dequant(src + g * gb, i, qmax);
    }
}
