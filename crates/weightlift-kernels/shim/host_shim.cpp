// Host build of the shared CUDA headers (kernels/*.cuh), linked into weightlift-kernels so the
// tests can compare the device decode maths with the Rust CPU kernels without a GPU.
// No C++ standard library: the crate links it with cc's cpp_link_stdlib(None).
#include <math.h>
#include <stddef.h>

#include "wl_attention.cuh"
#include "wl_fa_mma.cuh"
#include "wl_dequant.cuh"
#include "wl_kv.cuh"
#include "wl_rope_kv.cuh"
#include "wl_matvec.cuh"
#include "wl_q8.cuh"
#include "wl_q8w.cuh"
#include "wl_mmq.cuh"
#include "wl_quantize.cuh"

typedef float (*wl_dq_fn)(const wl_u8*, int);

// The decoder of ggml type `ty`, with its block layout from wl_block_layout; 0 when unknown.
static int wl_layout(int ty, int* bs, int* bb, wl_dq_fn* f) {
    int o0, o1;
    if (!wl_block_layout(ty, bs, bb, &o0, &o1)) return 0;
    switch (ty) {
        case WL_F32: *f = wl_dq_f32; return 1;
        case WL_F16: *f = wl_dq_f16; return 1;
        case WL_BF16: *f = wl_dq_bf16; return 1;
        case WL_Q4_0: *f = wl_dq_q4_0; return 1;
        case WL_Q4_1: *f = wl_dq_q4_1; return 1;
        case WL_Q5_0: *f = wl_dq_q5_0; return 1;
        case WL_Q5_1: *f = wl_dq_q5_1; return 1;
        case WL_Q8_0: *f = wl_dq_q8_0; return 1;
        case WL_IQ4_NL: *f = wl_dq_iq4_nl; return 1;
        case WL_Q2_K: *f = wl_dq_q2_k; return 1;
        case WL_Q3_K: *f = wl_dq_q3_k; return 1;
        case WL_Q4_K: *f = wl_dq_q4_k; return 1;
        case WL_Q5_K: *f = wl_dq_q5_k; return 1;
        case WL_Q6_K: *f = wl_dq_q6_k; return 1;
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

typedef void (*wl_dq8_fn)(const wl_u8*, int, float*);

static wl_dq8_fn wl_dq8_of(int ty) {
    switch (ty) {
        case WL_F32: return wl_dq8_f32;
        case WL_F16: return wl_dq8_f16;
        case WL_BF16: return wl_dq8_bf16;
        case WL_Q4_0: return wl_dq8_q4_0;
        case WL_Q4_1: return wl_dq8_q4_1;
        case WL_Q5_0: return wl_dq8_q5_0;
        case WL_Q5_1: return wl_dq8_q5_1;
        case WL_Q8_0: return wl_dq8_q8_0;
        case WL_IQ4_NL: return wl_dq8_iq4_nl;
        case WL_Q2_K: return wl_dq8_q2_k;
        case WL_Q3_K: return wl_dq8_q3_k;
        case WL_Q4_K: return wl_dq8_q4_k;
        case WL_Q5_K: return wl_dq8_q5_k;
        case WL_Q6_K: return wl_dq8_q6_k;
        default: return 0;
    }
}

// What the dequantize_{type} kernels (dequant.cu) compute for `n` values of type `ty`: eight
// at a time through wl_dq8_<type>, a last group of fewer value by value; 0 for an unknown type.
extern "C" int wl_host_dequant8(int ty, const wl_u8* src, float* dst, size_t n) {
    int bs, bb;
    wl_dq_fn f;
    wl_dq8_fn f8 = wl_dq8_of(ty);
    if (!wl_layout(ty, &bs, &bb, &f) || !f8) return 0;
    for (size_t i0 = 0; i0 < n; i0 += 8) {
        if (i0 + 8 <= n) {
            f8(src + (i0 / bs) * bb, (int)(i0 % bs), dst + i0);
        } else {
            for (size_t i = i0; i < n; ++i) dst[i] = f(src + (i / bs) * bb, (int)(i % bs));
        }
    }
    return 1;
}

// The block layout of `ty` (wl_block_layout) as {bs, bb, o0, o1}; returns 0 when unknown.
extern "C" int wl_host_block_layout(int ty, int* out) {
    return wl_block_layout(ty, &out[0], &out[1], &out[2], &out[3]);
}

// What the scan_{type} kernels compute for `nblocks` blocks of quantised type `ty`: the first
// element of the first block with a non-finite scale, or ~0 when there is none (or `ty` has no
// scales).
extern "C" unsigned long long wl_host_scan_blocks(int ty, const wl_u8* src, size_t nblocks) {
    int bs, bb, o0, o1;
    if (!wl_block_layout(ty, &bs, &bb, &o0, &o1) || o0 < 0) return ~0ull;
    for (size_t b = 0; b < nblocks; ++b) {
        if (wl_block_scales_non_finite(src + b * bb, o0, o1)) return (unsigned long long)(b * bs);
    }
    return ~0ull;
}

extern "C" void wl_host_f32_to_f16(const float* src, wl_u16* dst, size_t n) {
    for (size_t i = 0; i < n; ++i) dst[i] = wl_f32_to_f16(src[i]);
}

// qmax 127 (q8, 34-byte groups) or 7 (q4, 18-byte groups).
extern "C" void wl_host_kv_quantize(const float* x, wl_u8* out, size_t n_groups, int qmax) {
    size_t gb = (size_t)wl_kv_group_bytes(qmax);
    for (size_t g = 0; g < n_groups; ++g) {
        for (size_t k = 0; k < gb; ++k) out[g * gb + k] = 0;
        wl_kv_quantize_group(x + g * 32, out + g * gb, qmax);
    }
}

extern "C" void wl_host_kv_dequantize(const wl_u8* src, float* out, size_t n_groups, int qmax) {
    size_t gb = (size_t)wl_kv_group_bytes(qmax);
    for (size_t g = 0; g < n_groups; ++g) {
        for (int i = 0; i < 32; ++i) out[g * 32 + i] = wl_kv_dequant(src + g * gb, i, qmax);
    }
}

// The cache codec's device half: qmax 127 or 7 for the turned q8/q4 groups, 0 for e4m3 (one
// byte per value) and 1 for bf16 (two little-endian bytes per value); n_groups counts values
// for those two.
extern "C" void wl_host_kv_store(const float* x, wl_u8* out, size_t n_groups, int qmax) {
    if (qmax == 0) {
        for (size_t i = 0; i < n_groups; ++i) out[i] = wl_e4m3_encode(x[i]);
        return;
    }
    if (qmax == 1) {
        for (size_t i = 0; i < n_groups; ++i) {
            wl_u16 h = wl_kv_store_bf16(x[i]);
            out[2 * i] = (wl_u8)(h & 0xffu);
            out[2 * i + 1] = (wl_u8)(h >> 8);
        }
        return;
    }
    size_t gb = (size_t)wl_kv_group_bytes(qmax);
    for (size_t g = 0; g < n_groups; ++g) wl_kv_store_group(x + g * 32, out + g * gb, qmax);
}

extern "C" void wl_host_kv_load(const wl_u8* src, float* out, size_t n_groups, int qmax) {
    if (qmax == 0) {
        for (size_t i = 0; i < n_groups; ++i) out[i] = wl_e4m3_decode(src[i]);
        return;
    }
    if (qmax == 1) {
        for (size_t i = 0; i < n_groups; ++i) out[i] = wl_kv_load_bf16(wl_rd_u16(src + 2 * i));
        return;
    }
    size_t gb = (size_t)wl_kv_group_bytes(qmax);
    for (size_t g = 0; g < n_groups; ++g) wl_kv_load_group(src + g * gb, out + g * 32, qmax);
}

typedef const wl_u8* (*wl_row_fn)(const wl_u8*, wl_u64, wl_u64);
typedef float (*wl_lane_f32_fn)(const wl_u8*, const float*, wl_u64, int);
typedef float (*wl_lane_f16_fn)(const wl_u8*, const wl_u16*, wl_u64, int);

#define WL_MV_CASE(NAME, TY)                 \
    case TY:                                 \
        *row = wl_row_##NAME;                \
        *f32 = wl_lane_dot_##NAME##_f32;     \
        *f16 = wl_lane_dot_##NAME##_f16;     \
        return 1;

static int wl_matvec_fns(int ty, wl_row_fn* row, wl_lane_f32_fn* f32, wl_lane_f16_fn* f16) {
    switch (ty) {
        WL_MV_CASE(q4_0, WL_Q4_0)
        WL_MV_CASE(q4_1, WL_Q4_1)
        WL_MV_CASE(q5_0, WL_Q5_0)
        WL_MV_CASE(q5_1, WL_Q5_1)
        WL_MV_CASE(q8_0, WL_Q8_0)
        WL_MV_CASE(q2_k, WL_Q2_K)
        WL_MV_CASE(q3_k, WL_Q3_K)
        WL_MV_CASE(q4_k, WL_Q4_K)
        WL_MV_CASE(q5_k, WL_Q5_K)
        WL_MV_CASE(q6_k, WL_Q6_K)
        default: return 0;
    }
}

// What matmul_{type}_{act} computes (matvec_ for n_tok 1 is the same per output): for every
// token t and row r, the 32 lane partial sums of wl_lane_dot, added with the xor butterfly of
// wl_warp_sum (lane l takes v[l] + v[l ^ o] for o = 16, 8, 4, 2, 1), lane 0's result stored at
// y[t * rows + r]. `x` holds f32 values, or f16 bits when `act_f16`. Returns 0 for a weight
// type without a kernel.
extern "C" int wl_host_matmul(int ty, int act_f16, const wl_u8* w, const void* x, float* y,
                              size_t rows, size_t cols, size_t n_tok) {
    wl_row_fn row_of;
    wl_lane_f32_fn lane_f32;
    wl_lane_f16_fn lane_f16;
    if (!wl_matvec_fns(ty, &row_of, &lane_f32, &lane_f16)) return 0;
    for (size_t t = 0; t < n_tok; ++t) {
        for (size_t r = 0; r < rows; ++r) {
            const wl_u8* row = row_of(w, r, cols);
            float v[32], next[32];
            for (int l = 0; l < 32; ++l) {
                v[l] = act_f16 ? lane_f16(row, (const wl_u16*)x + t * cols, cols, l)
                               : lane_f32(row, (const float*)x + t * cols, cols, l);
            }
            for (int o = 16; o > 0; o >>= 1) {
                for (int l = 0; l < 32; ++l) next[l] = v[l] + v[l ^ o];
                for (int l = 0; l < 32; ++l) v[l] = next[l];
            }
            y[t * rows + r] = v[0];
        }
    }
    return 1;
}

typedef void (*wl_fv_f32_fn)(const wl_u8*, const float*, wl_u64, int, int, int, float*);
typedef void (*wl_fv_f16_fn)(const wl_u8*, const wl_u16*, wl_u64, int, int, int, float*);

#define WL_FV_CASE(NAME, TY, ES)            \
    case TY:                                \
        *f32 = wl_fv_lane_##NAME##_f32;     \
        *f16 = wl_fv_lane_##NAME##_f16;     \
        *es = ES;                           \
        return 1;

static int wl_fv_fns(int ty, wl_fv_f32_fn* f32, wl_fv_f16_fn* f16, int* es) {
    switch (ty) {
        WL_FV_CASE(f16, WL_F16, 2)
        WL_FV_CASE(bf16, WL_BF16, 2)
        WL_FV_CASE(f32, WL_F32, 4)
        default: return 0;
    }
}

// What matvec_/matmul_{f16,bf16,f32}_{act} compute with `tpr` threads a row (16, 32, 64, 128 or
// 256): per pass of `nt_max` tokens (1 for matvec_, WL_FV_NT for matmul_) and per row, every
// thread's chains from wl_fv_lane_*, then the kernel's sum: within each warp's share of the
// row an xor butterfly over min(tpr, 32) threads (thread l takes v[l] + v[l ^ o], o halving
// from half that width), and for tpr > 32 the warps' results added in warp order. Returns 0
// for a type without a float kernel or an unsupported tpr.
extern "C" int wl_host_float_matmul(int ty, int act_f16, const wl_u8* w, const void* x, float* y,
                                    size_t rows, size_t cols, size_t n_tok, int tpr, int nt_max) {
    wl_fv_f32_fn lane_f32;
    wl_fv_f16_fn lane_f16;
    int es;
    if (!wl_fv_fns(ty, &lane_f32, &lane_f16, &es)) return 0;
    if (tpr != 16 && tpr != 32 && tpr != 64 && tpr != 128 && tpr != 256) return 0;
    if (nt_max < 1 || nt_max > WL_FV_NT) return 0;
    int width = tpr < 32 ? tpr : 32;
    // the partial sums of one row: 256 threads by WL_FV_NT tokens (tests call this from several
    // threads at once, so nothing is static)
    float v[256][WL_FV_NT], next[32];
    for (size_t t0 = 0; t0 < n_tok; t0 += (size_t)nt_max) {
        int nt = n_tok - t0 < (size_t)nt_max ? (int)(n_tok - t0) : nt_max;
        for (size_t r = 0; r < rows; ++r) {
            const wl_u8* row = w + r * cols * (size_t)es;
            for (int l = 0; l < tpr; ++l) {
                if (act_f16) {
                    lane_f16(row, (const wl_u16*)x + t0 * cols, cols, nt, l, tpr, v[l]);
                } else {
                    lane_f32(row, (const float*)x + t0 * cols, cols, nt, l, tpr, v[l]);
                }
            }
            for (int k = 0; k < nt; ++k) {
                float total = 0.0f;
                for (int g = 0; g < tpr / width; ++g) {
                    float* s = &v[g * width][0];
                    float cur[32];
                    for (int l = 0; l < width; ++l) cur[l] = s[l * WL_FV_NT + k];
                    for (int o = width / 2; o > 0; o >>= 1) {
                        for (int l = 0; l < width; ++l) next[l] = cur[l] + cur[l ^ o];
                        for (int l = 0; l < width; ++l) cur[l] = next[l];
                    }
                    total = g == 0 ? cur[0] : total + cur[0];
                }
                y[(t0 + (size_t)k) * rows + r] = total;
            }
        }
    }
    return 1;
}

// What the fused gate/up kernels (swiglu_matvec_*, swiglu_q8_matvec_*) and swiglu_inplace_f32
// make of each row's two sums: WL_SILU_MUL(gate[i], up[i]) into out[i].
extern "C" void wl_host_silu_mul(const float* gate, const float* up, float* out, size_t n) {
    for (size_t i = 0; i < n; ++i) out[i] = WL_SILU_MUL(gate[i], up[i]);
}

// What rope_kv_store_{format} computes (kf, vf: the WL_KVF_ codes of the keys and values; cap
// as the kernel's): its threads' work units one after another.
extern "C" void wl_host_rope_kv_store(int kf, int vf, float* q, const float* k, const float* v,
                                      const int* pos, const float* freqs, wl_u8* kc, wl_u8* vc,
                                      size_t n_tok, size_t n_heads, size_t kv_heads, int head_dim,
                                      int n_dims, int neox, float mscale, size_t cap) {
    wl_rope_kv_shape s = {n_tok, n_heads, kv_heads, head_dim, n_dims, neox, mscale, cap};
    wl_u64 units = wl_rope_kv_units(s, kf, vf);
    for (wl_u64 u = 0; u < units; ++u) wl_rope_kv_unit(u, kf, vf, q, k, v, pos, freqs, kc, vc, s);
}

// What quantize_{type}_{src} computes for `n_blocks` blocks of ggml type `ty` from source
// float type `src_ty` (WL_F32, WL_F16, WL_BF16): the blocks in `dst`, and the merged
// non-finite report (wl_qz_report, 0 when none) that the kernels leave by atomicMax. Returns
// ~0 for a type the quantisers do not write (no report is all ones).
extern "C" unsigned long long wl_host_quantize(int ty, int src_ty, const wl_u8* src, wl_u8* dst,
                                               size_t n_blocks, unsigned long long first) {
    int bs, bb;
    if (!wl_qz_layout(ty, &bs, &bb)) return ~0ull;
    wl_u64 found = 0;
    for (size_t b = 0; b < n_blocks; ++b) {
        wl_u64 r = wl_quantize_block(ty, src_ty, src, dst, b, first);
        if (r > found) found = r;
    }
    return found;
}

// What q8_quantize_{f32,f16} computes: `n_blocks` blocks of 32 activations (f32 values, or f16
// bits when `act_f16`) into 40-byte Q8 blocks.
extern "C" void wl_host_q8_quantize(int act_f16, const void* x, wl_u8* out, size_t n_blocks) {
    for (size_t b = 0; b < n_blocks; ++b) {
        float v[32];
        for (int i = 0; i < 32; ++i) {
            v[i] = act_f16 ? wl_f16_to_f32(((const wl_u16*)x)[b * 32 + i]) : ((const float*)x)[b * 32 + i];
        }
        wl_q8_quantize_block(v, out + b * WL_Q8_BLOCK_BYTES);
    }
}

typedef void (*wl_q8_lane_fn)(const wl_u8*, const wl_u8*, wl_u64, int, float*, float*);
typedef void (*wl_q8v_lane_fn)(const wl_u8*, const wl_u8*, wl_u64, int, int, int, float*, float*);

#define WL_Q8_CASE(NAME, TY, BS, BB)  \
    case TY:                          \
        *f = wl_q8_lane_##NAME;       \
        *fv = wl_q8v_lane_##NAME;     \
        *kind = WL_Q8_KIND_##NAME;    \
        *bs = BS;                     \
        *bb = BB;                     \
        return 1;

static int wl_q8_fns(int ty, wl_q8_lane_fn* f, wl_q8v_lane_fn* fv, int* kind, int* bs, int* bb) {
    switch (ty) {
        WL_Q8_CASE(q4_0, WL_Q4_0, 32, 18)
        WL_Q8_CASE(q4_1, WL_Q4_1, 32, 20)
        WL_Q8_CASE(q5_0, WL_Q5_0, 32, 22)
        WL_Q8_CASE(q5_1, WL_Q5_1, 32, 24)
        WL_Q8_CASE(q8_0, WL_Q8_0, 32, 34)
        WL_Q8_CASE(q4_k, WL_Q4_K, 256, 144)
        WL_Q8_CASE(q6_k, WL_Q6_K, 256, 210)
        default: return 0;
    }
}

// What q8_matmul_{type} computes: for every token t and row r, the 8 lanes' sums of wl_q8.cuh
// (lane 0's extra term), met in the shuffle tree, which is wl_q8_finish's order; stored at
// y[t * rows + r]. `xq` holds n_tok * cols / 32 blocks from wl_host_q8_quantize. Returns 0 for
// a weight type without a Q8 kernel.
extern "C" int wl_host_q8_matmul(int ty, const wl_u8* w, const wl_u8* xq, float* y, size_t rows,
                                 size_t cols, size_t n_tok) {
    wl_q8_lane_fn f;
    wl_q8v_lane_fn fv;
    int kind, bs, bb;
    if (!wl_q8_fns(ty, &f, &fv, &kind, &bs, &bb)) return 0;
    size_t row_bytes = cols / (size_t)bs * (size_t)bb;
    for (size_t t = 0; t < n_tok; ++t) {
        for (size_t r = 0; r < rows; ++r) {
            float acc[8], extra[8];
            for (int j = 0; j < 8; ++j) {
                f(w + r * row_bytes, xq + t * (cols / 32) * WL_Q8_BLOCK_BYTES, cols, j, &acc[j], &extra[j]);
            }
            y[t * rows + r] = wl_q8_finish(acc, extra[0]);
        }
    }
    return 1;
}

// The xor butterfly of a warp's 32 values (lane l takes v[l] + v[l ^ o] for o = 16, 8, 4, 2,
// 1), in place; every lane ends with the same sum.
static void wl_host_butterfly(float* v) {
    for (int o = 16; o > 0; o >>= 1) {
        float t[32];
        for (int l = 0; l < 32; ++l) t[l] = WL_ADD(v[l], v[l ^ o]);
        for (int l = 0; l < 32; ++l) v[l] = t[l];
    }
}

// What q8_matvec_{type} computes for one token with `wpr` warps a row: every row's 32 * wpr
// lane chains of wl_q8v_lane_* (with `al` as the kernel finds it: 1 for the word loads, 0 byte
// by byte; the same words), each warp's butterfly over its chains, the warps' sums in warp
// order, and the same for the extra chains, added when the type has them. Returns 0 for a
// weight type without a Q8 kernel.
extern "C" int wl_host_q8_matvec(int ty, int al, int wpr, const wl_u8* w, const wl_u8* xq, float* y,
                                 size_t rows, size_t cols) {
    wl_q8_lane_fn f;
    wl_q8v_lane_fn fv;
    int kind, bs, bb;
    if (!wl_q8_fns(ty, &f, &fv, &kind, &bs, &bb)) return 0;
    size_t row_bytes = cols / (size_t)bs * (size_t)bb;
    for (size_t r = 0; r < rows; ++r) {
        float a = 0.0f, e = 0.0f;
        for (int k = 0; k < wpr; ++k) {
            float acc[32], extra[32];
            for (int l = 0; l < 32; ++l) {
                fv(w + r * row_bytes, xq, cols, 32 * k + l, wpr, al, &acc[l], &extra[l]);
            }
            wl_host_butterfly(acc);
            wl_host_butterfly(extra);
            a = k == 0 ? acc[0] : WL_ADD(a, acc[0]);
            e = k == 0 ? extra[0] : WL_ADD(e, extra[0]);
        }
        y[r] = kind != 0 ? WL_ADD(a, e) : a;
    }
    return 1;
}

// What q8_wide_matvec_{type} computes for one token with `wpr` warps a row (wl_q8w.cuh's
// order): every row's 32 * wpr lane chains of wl_q8w_lane_* (`al` 1 for the wide loads, 0
// byte by byte; the same words), each warp's butterfly over its chains, the warps' sums in warp
// order, the same for the extra chains, then their sum when the type has them. Returns 0 for a
// weight type without a wide kernel (all but Q4_K and Q6_K).
extern "C" int wl_host_q8_wide_matvec(int ty, int al, int wpr, const wl_u8* w, const wl_u8* xq,
                                      float* y, size_t rows, size_t cols) {
    wl_q8v_lane_fn fv;
    int kind;
    size_t bb;
    switch (ty) {
        case WL_Q4_K: fv = wl_q8w_lane_q4_k; kind = WL_Q8_KIND_q4_k; bb = 144; break;
        case WL_Q6_K: fv = wl_q8w_lane_q6_k; kind = WL_Q8_KIND_q6_k; bb = 210; break;
        default: return 0;
    }
    size_t row_bytes = cols / 256 * bb;
    for (size_t r = 0; r < rows; ++r) {
        float a = 0.0f, e = 0.0f;
        for (int k = 0; k < wpr; ++k) {
            float acc[32], extra[32];
            for (int l = 0; l < 32; ++l) {
                fv(w + r * row_bytes, xq, cols, 32 * k + l, wpr, al, &acc[l], &extra[l]);
            }
            wl_host_butterfly(acc);
            wl_host_butterfly(extra);
            a = k == 0 ? acc[0] : WL_ADD(a, acc[0]);
            e = k == 0 ? extra[0] : WL_ADD(e, extra[0]);
        }
        y[r] = kind != 0 ? WL_ADD(a, e) : a;
    }
    return 1;
}

// What gemm_{f32,f16} computes, replayed block by block and phase by phase with the kernel's
// header functions: every thread of a block stages its share of a K tile before any thread
// computes (the kernel's __syncthreads), then every thread computes. `grid_y` token tiles run
// side by side and stride as the kernel's grid.y does. wd holds n_rows f32 rows of cols values,
// x n_tok activation rows (f32, or f16 bits when `act_f16`); writes y[t * rows + row0 + r].
extern "C" void wl_host_gemm(int act_f16, const float* wd, const void* x, float* y, size_t n_rows,
                             size_t cols, size_t n_tok, size_t row0, size_t rows, size_t grid_y) {
    // the block's shared tiles and registers (21 KiB of stack; tests call this from several
    // threads at once, so nothing is static)
    float ws[WL_GEMM_BM * WL_GEMM_LD], xs[WL_GEMM_BN * WL_GEMM_LD];
    float acc[WL_GEMM_THREADS][16];
    size_t grid_x = (n_rows + WL_GEMM_BM - 1) / WL_GEMM_BM;
    for (size_t bx = 0; bx < grid_x; ++bx) {
        for (size_t by = 0; by < grid_y; ++by) {
            wl_u64 rbase = bx * WL_GEMM_BM;
            for (wl_u64 tbase = by * WL_GEMM_BN; tbase < n_tok; tbase += grid_y * WL_GEMM_BN) {
                for (int tid = 0; tid < WL_GEMM_THREADS; ++tid) {
                    for (int a = 0; a < 16; ++a) acc[tid][a] = 0.0f;
                }
                for (wl_u64 k0 = 0; k0 < cols; k0 += WL_GEMM_TILE) {
                    int kl = cols - k0 < WL_GEMM_TILE ? (int)(cols - k0) : WL_GEMM_TILE;
                    for (int tid = 0; tid < WL_GEMM_THREADS; ++tid) {
                        wl_gemm_stage_w(tid, ws, wd, n_rows, cols, rbase, k0, kl);
                        if (act_f16) {
                            wl_gemm_stage_x_f16(tid, xs, (const wl_u16*)x, n_tok, cols, tbase, k0, kl);
                        } else {
                            wl_gemm_stage_x_f32(tid, xs, (const float*)x, n_tok, cols, tbase, k0, kl);
                        }
                    }
                    for (int tid = 0; tid < WL_GEMM_THREADS; ++tid) {
                        wl_gemm_compute(tid % 16, tid / 16, ws, xs, kl, acc[tid]);
                    }
                }
                for (int tid = 0; tid < WL_GEMM_THREADS; ++tid) {
                    wl_gemm_store(tid % 16, tid / 16, acc[tid], y, n_rows, n_tok, rbase, tbase, row0, rows);
                }
            }
        }
    }
}

// wl_att_block_heads, for the test that the host's launch grid agrees with it.
extern "C" int wl_host_att_block_heads(int head_dim) { return wl_att_block_heads(head_dim); }

// `head_dim` values of a cache half stored as `fmt` (0 f32, 1 f16, 2 e4m3, 3 turned q8, 4 turned
// q4, 5 bf16) from value `first`, decoded as the kernel's readers decode them (the turned groups with the
// codec's butterflies, then the norm).
static void wl_att_row(int fmt, const void* base, wl_u64 first, int head_dim, float* out) {
    if (fmt == 0) {
        for (int d = 0; d < head_dim; d++) out[d] = ((const float*)base)[first + d];
    } else if (fmt == 1) {
        for (int d = 0; d < head_dim; d++) out[d] = wl_f16_to_f32(((const wl_u16*)base)[first + d]);
    } else if (fmt == 2) {
        for (int d = 0; d < head_dim; d++) out[d] = wl_e4m3_decode(((const wl_u8*)base)[first + d]);
    } else if (fmt == 5) {
        for (int d = 0; d < head_dim; d++) out[d] = wl_kv_load_bf16(((const wl_u16*)base)[first + d]);
    } else {
        int qmax = fmt == 3 ? 127 : 7;
        wl_u64 gb = (wl_u64)wl_kv_group_bytes(qmax);
        for (int g = 0; g < head_dim / 32; g++) {
            wl_kv_load_group((const wl_u8*)base + (first / 32 + (wl_u64)g) * gb, out + g * 32, qmax);
        }
    }
}

// What attention_{fmt} and attention_reduce_f32 compute, block by block, warp by warp and lane
// by lane: for every query i, KV head, chunk of its query heads and split s, warp w folds keys
// lo + w, lo + w + WL_ATT_WARPS, ... of the split (each score the 32 lanes' fmaf chains over
// dims lane + 32 r, met in the xor butterfly), the warps are merged as the block merges them,
// and the result is the output (one split) or the split's partial results in `part` (laid out
// by wl_att_part_*), which are then merged as the reduce kernel merges them. Formats as
// wl_att_row; `pos` and `span` as the kernel's (wl_att_where); `window`, `softcap` and `rows`
// (the cache's rows, position j in row wl_kv_cache_row(j, rows)) as the kernel's. Returns 0 when
// the shape is outside the kernel's (the Rust wrapper checks it) or the position outside the
// span.
extern "C" int wl_host_attention(int k_fmt, int v_fmt, const float* q, const void* k, const void* v,
                                 float* out, float* part, size_t n_q, size_t start_arg, size_t n_heads,
                                 size_t kv_heads, int head_dim, float scale, int f16_operands,
                                 size_t n_splits, const int* pos, size_t span, size_t window,
                                 float softcap, size_t rows) {
    if (n_splits == 0 || n_splits > WL_ATT_MAX_SPLITS || head_dim <= 0 || head_dim > WL_ATT_MAX_HD ||
        kv_heads == 0 || n_heads % kv_heads != 0 || rows == 0) {
        return 0;
    }
    wl_u64 start = 0, base = 0, keys = 0;
    if (!wl_att_where(pos, start_arg, n_q, window, span, &start, &base, &keys)) return 0;
    const float neg_inf = wl_bits_to_f32(0xff800000u);
    const int R = wl_att_lane_dims(head_dim);
    const int hb = wl_att_block_heads(head_dim);
    const wl_u64 hd = (wl_u64)head_dim;
    const wl_u64 group = n_heads / kv_heads;
    const wl_u64 chunks = (group + (wl_u64)hb - 1) / (wl_u64)hb;
    const wl_u64 kvd = kv_heads * hd;
    const wl_u64 per = wl_att_split_keys(keys, n_splits);
    float* dst = n_splits == 1 ? out : part;
    // one block's registers, per warp (kept off the static area: tests run in parallel)
    float qr[WL_ATT_MAX_GROUP][WL_ATT_MAX_HD];
    float acc[WL_ATT_WARPS][WL_ATT_MAX_GROUP][WL_ATT_MAX_HD];
    float m[WL_ATT_WARPS * WL_ATT_MAX_GROUP], l[WL_ATT_WARPS * WL_ATT_MAX_GROUP];
    float kr[WL_ATT_MAX_HD], vr[WL_ATT_MAX_HD], t[32], next[32];
    for (wl_u64 i = 0; i < n_q; i++) {
        for (wl_u64 kh = 0; kh < kv_heads; kh++) {
            for (wl_u64 c = 0; c < chunks; c++) {
                const wl_u64 first = c * (wl_u64)hb;
                const wl_u64 h0 = kh * group + first;
                const int ng = group - first < (wl_u64)hb ? (int)(group - first) : hb;
                for (int g = 0; g < ng; g++) {
                    for (int e = 0; e < R * 32; e++) {
                        float x = e < head_dim ? q[(i * n_heads + h0 + (wl_u64)g) * hd + (wl_u64)e] : 0.0f;
                        qr[g][e] = f16_operands ? wl_att_round(x) : x;
                    }
                }
                // the blocks of the splits past this query's keys write nothing
                const wl_u64 live = wl_att_live_splits(per, base, start + i + 1, n_splits);
                for (wl_u64 s = 0; s < live; s++) {
                    wl_u64 lo, hi;
                    wl_att_split_range(per, s, base, start, i, window, &lo, &hi);
                    for (int w = 0; w < WL_ATT_WARPS; w++) {
                        for (int g = 0; g < ng; g++) {
                            m[w * WL_ATT_MAX_GROUP + g] = neg_inf;
                            l[w * WL_ATT_MAX_GROUP + g] = 0.0f;
                            for (int e = 0; e < R * 32; e++) acc[w][g][e] = 0.0f;
                        }
                        for (wl_u64 j = lo + (wl_u64)w; j < hi; j += WL_ATT_WARPS) {
                            const wl_u64 row = wl_kv_cache_row(j, rows) * kvd + kh * hd;
                            for (int e = 0; e < WL_ATT_MAX_HD; e++) kr[e] = vr[e] = 0.0f;
                            wl_att_row(k_fmt, k, row, head_dim, kr);
                            wl_att_row(v_fmt, v, row, head_dim, vr);
                            for (int g = 0; g < ng; g++) {
                                for (int ln = 0; ln < 32; ln++) {
                                    t[ln] = 0.0f;
                                    for (int r = 0; r < R; r++) t[ln] = fmaf(qr[g][ln + 32 * r], kr[ln + 32 * r], t[ln]);
                                }
                                for (int o = 16; o > 0; o >>= 1) {
                                    for (int ln = 0; ln < 32; ln++) next[ln] = t[ln] + t[ln ^ o];
                                    for (int ln = 0; ln < 32; ln++) t[ln] = next[ln];
                                }
                                float keep, p;
                                float sc = WL_MUL(t[0], scale);
                                if (softcap > 0.0f) sc = WL_MUL(softcap, tanhf(sc / softcap));
                                wl_att_step(sc, f16_operands, &m[w * WL_ATT_MAX_GROUP + g],
                                            &l[w * WL_ATT_MAX_GROUP + g], &keep, &p);
                                for (int e = 0; e < R * 32; e++) {
                                    acc[w][g][e] = wl_att_accumulate(acc[w][g][e], keep, p, vr[e]);
                                }
                            }
                        }
                    }
                    for (int g = 0; g < ng; g++) {
                        float mm = wl_att_merge_max(m + g, WL_ATT_WARPS, WL_ATT_MAX_GROUP);
                        float f[WL_ATT_WARPS];
                        float ll = 0.0f;
                        for (int w = 0; w < WL_ATT_WARPS; w++) {
                            f[w] = wl_att_merge_factor(m[w * WL_ATT_MAX_GROUP + g], mm);
                            ll = fmaf(l[w * WL_ATT_MAX_GROUP + g], f[w], ll);
                        }
                        const wl_u64 h = h0 + (wl_u64)g;
                        wl_u64 rec = wl_att_part_record(i, h, s, n_heads, n_splits);
                        for (int d = 0; d < head_dim; d++) {
                            float a = 0.0f;
                            for (int w = 0; w < WL_ATT_WARPS; w++) a = fmaf(acc[w][g][d], f[w], a);
                            if (n_splits == 1) {
                                dst[(i * n_heads + h) * hd + (wl_u64)d] = WL_MUL(a, 1.0f / ll);
                            } else {
                                dst[wl_att_part_acc(rec, head_dim) + (wl_u64)d] = a;
                            }
                        }
                        if (n_splits > 1) {
                            wl_u64 ml = wl_att_part_ml(rec, n_q, n_heads, n_splits, head_dim);
                            dst[ml] = mm;
                            dst[ml + 1] = ll;
                        }
                    }
                }
            }
        }
    }
    if (n_splits == 1) return 1;
    float f[WL_ATT_MAX_SPLITS];
    for (wl_u64 i = 0; i < n_q; i++) {
        const wl_u64 live = wl_att_live_splits(per, base, start + i + 1, n_splits);
        for (wl_u64 h = 0; h < n_heads; h++) {
            const wl_u64 rec0 = wl_att_part_record(i, h, 0, n_heads, n_splits);
            const float* ml = part + wl_att_part_ml(rec0, n_q, n_heads, n_splits, head_dim);
            float mm = wl_att_merge_max(ml, (int)live, 2);
            for (wl_u64 s = 0; s < live; s++) f[s] = wl_att_merge_factor(ml[2 * s], mm);
            float ll = 0.0f;
            for (wl_u64 s = 0; s < live; s++) ll = fmaf(ml[2 * s + 1], f[s], ll);
            float inv = 1.0f / ll;
            const float* a0 = part + wl_att_part_acc(rec0, head_dim);
            for (wl_u64 d = 0; d < hd; d++) {
                float a = 0.0f;
                for (wl_u64 s = 0; s < live; s++) a = fmaf(a0[s * hd + d], f[s], a);
                out[(i * n_heads + h) * hd + d] = WL_MUL(a, inv);
            }
        }
    }
    return 1;
}

// The keys each split of attention_{fmt} folds for query i of a call, found as the kernel finds
// them (wl_att_where, wl_att_live_splits, wl_att_split_range): [lo, hi) of live split s in
// ranges[2 s] and ranges[2 s + 1] (2 × n_splits values). Returns the live splits, or -1 when the
// kernel computes nothing (a position outside the span) or the call is outside its shapes.
extern "C" long long wl_host_att_splits(const int* pos, size_t start_arg, size_t n_q, size_t window,
                                        size_t span, size_t n_splits, size_t i, size_t* ranges) {
    if (n_splits == 0 || n_splits > WL_ATT_MAX_SPLITS || i >= n_q) return -1;
    wl_u64 start = 0, base = 0, keys = 0;
    if (!wl_att_where(pos, start_arg, n_q, window, span, &start, &base, &keys)) return -1;
    const wl_u64 per = wl_att_split_keys(keys, n_splits);
    const wl_u64 live = wl_att_live_splits(per, base, start + i + 1, n_splits);
    for (wl_u64 s = 0; s < live; s++) {
        wl_u64 lo, hi;
        wl_att_split_range(per, s, base, start, i, window, &lo, &hi);
        ranges[2 * s] = lo;
        ranges[2 * s + 1] = hi;
    }
    return (long long)live;
}

// wl_fa_rows, for the test that the host's launch grid agrees with it.
extern "C" int wl_host_fa_rows(int head_dim) { return wl_fa_rows(head_dim); }

// What attention_prefill_{fmt} computes, block by block, tile by tile and lane by lane: for
// every KV head and block of wl_fa_rows(head_dim) rows (the group's (query, head) pairs), the
// key tiles of WL_FA_KEYS from the window start of its first query to the causal end of its
// last, each row scoring key 32 t + lane with one fmaf chain over the dims, the tile's maximum
// and probability sum met in the xor butterfly, and the accumulators updated in key order.
// Formats as wl_att_row, the cache's rows as the decode replay's. Returns 0 when the shape is
// outside the kernel's.
extern "C" int wl_host_attention_prefill(int k_fmt, int v_fmt, const float* q, const void* k,
                                         const void* v, float* out, size_t n_q, size_t start,
                                         size_t n_heads, size_t kv_heads, int head_dim,
                                         float scale, int f16_operands, size_t window,
                                         float softcap, size_t cache_rows) {
    if (head_dim <= 0 || head_dim > WL_FA_MAX_HD || kv_heads == 0 || n_heads % kv_heads != 0 ||
        cache_rows == 0) {
        return 0;
    }
    const float neg_inf = wl_bits_to_f32(0xff800000u);
    const wl_u64 rows = (wl_u64)wl_fa_rows(head_dim);
    const wl_u64 hd = (wl_u64)head_dim;
    const wl_u64 group = n_heads / kv_heads;
    const wl_u64 n_rows = n_q * group;
    const wl_u64 kvd = kv_heads * hd;
    // one block's staged rows and state (kept off the static area: tests run in parallel)
    float qs[32][WL_FA_MAX_HD], ks[WL_FA_KEYS][WL_FA_MAX_HD], vs[WL_FA_KEYS][WL_FA_MAX_HD];
    float acc[32][WL_FA_MAX_HD], m[32], l[32];
    float w[32], p[32], next[32];
    for (wl_u64 kh = 0; kh < kv_heads; kh++) {
        for (wl_u64 r0 = 0; r0 < n_rows; r0 += rows) {
            const wl_u64 r_end = r0 + rows < n_rows ? r0 + rows : n_rows;
            for (wl_u64 r = r0; r < r_end; r++) {
                const wl_u64 i = r / group, h = kh * group + r % group;
                for (wl_u64 d = 0; d < hd; d++) {
                    float x = q[(i * n_heads + h) * hd + d];
                    qs[r - r0][d] = f16_operands ? wl_att_round(x) : x;
                    acc[r - r0][d] = 0.0f;
                }
                m[r - r0] = neg_inf;
                l[r - r0] = 0.0f;
            }
            const wl_u64 key_end = start + (r_end - 1) / group + 1;
            const wl_u64 key_lo = wl_fa_first_key(start, r0 / group, window);
            for (wl_u64 t0 = key_lo / WL_FA_KEYS * WL_FA_KEYS; t0 < key_end; t0 += WL_FA_KEYS) {
                for (int jj = 0; jj < WL_FA_KEYS; jj++) {
                    const wl_u64 j = t0 + (wl_u64)jj;
                    for (int d = 0; d < WL_FA_MAX_HD; d++) ks[jj][d] = vs[jj][d] = 0.0f;
                    if (j < key_end) {
                        const wl_u64 row = wl_kv_cache_row(j, cache_rows) * kvd + kh * hd;
                        wl_att_row(k_fmt, k, row, head_dim, ks[jj]);
                        wl_att_row(v_fmt, v, row, head_dim, vs[jj]);
                    }
                }
                for (wl_u64 r = r0; r < r_end; r++) {
                    const wl_u64 b = r - r0, i = r / group;
                    float mt = neg_inf;
                    int valid[32];
                    for (int ln = 0; ln < 32; ln++) {
                        const wl_u64 j = t0 + (wl_u64)ln;
                        valid[ln] = j < start + i + 1 && j >= wl_fa_first_key(start, i, window);
                        float t = 0.0f;
                        for (int d = 0; d < head_dim; d++) t = fmaf(qs[b][d], ks[ln][d], t);
                        w[ln] = valid[ln] ? wl_fa_weight(t, scale, softcap) : neg_inf;
                        mt = fmaxf(mt, w[ln]);
                    }
                    const float m_new = fmaxf(m[b], mt);
                    if (m_new == neg_inf) continue;
                    for (int ln = 0; ln < 32; ln++) p[ln] = wl_fa_p(w[ln], valid[ln], m_new, f16_operands);
                    float ps[32];
                    for (int ln = 0; ln < 32; ln++) ps[ln] = p[ln];
                    for (int o = 16; o > 0; o >>= 1) {
                        for (int ln = 0; ln < 32; ln++) next[ln] = WL_ADD(ps[ln], ps[ln ^ o]);
                        for (int ln = 0; ln < 32; ln++) ps[ln] = next[ln];
                    }
                    const float keep = wl_fa_keep(m[b], m_new);
                    l[b] = wl_fa_sum(l[b], keep, ps[0]);
                    m[b] = m_new;
                    for (wl_u64 d = 0; d < hd; d++) {
                        float a = WL_MUL(acc[b][d], keep);
                        for (int jj = 0; jj < WL_FA_KEYS; jj++) a = fmaf(p[jj], vs[jj][d], a);
                        acc[b][d] = a;
                    }
                }
            }
            for (wl_u64 r = r0; r < r_end; r++) {
                const wl_u64 i = r / group, h = kh * group + r % group;
                const float inv = 1.0f / l[r - r0];
                for (wl_u64 d = 0; d < hd; d++) out[(i * n_heads + h) * hd + d] = WL_MUL(acc[r - r0][d], inv);
            }
        }
    }
    return 1;
}

// ---- attention_prefill_mma_{fmt}'s lane arithmetic (wl_fa_mma.cuh), for the twin's software
// warp: the fragment maps, the staged words, the fragment loads and a lane's softmax steps. ----

extern "C" void wl_host_mma_a(int lane, int reg, int hf, int* row, int* col) {
    *row = wl_mma_a_row(lane, reg);
    *col = wl_mma_a_col(lane, reg, hf);
}
extern "C" void wl_host_mma_b(int lane, int reg, int hf, int* k, int* n) {
    *k = wl_mma_b_k(lane, reg, hf);
    *n = wl_mma_b_n(lane);
}
extern "C" void wl_host_mma_c(int lane, int reg, int* row, int* col) {
    *row = wl_mma_c_row(lane, reg);
    *col = wl_mma_c_col(lane, reg);
}
// The words of the kernel's three shared arrays, and its rows a block.
extern "C" void wl_host_fam_shape(int* q_words, int* k_words, int* v_words, int* rows) {
    *q_words = WL_FAM_Q_WORDS;
    *k_words = WL_FAM_K_WORDS;
    *v_words = WL_FAM_V_WORDS;
    *rows = WL_FAM_ROWS;
}
extern "C" wl_u32 wl_host_fam_pack(float lo, float hi) { return wl_fam_pack(lo, hi); }
extern "C" int wl_host_fam_q_word(int row, int d, int head_dim) {
    return wl_fam_q_word(row, d, head_dim);
}
extern "C" int wl_host_fam_k_word(int key, int d, int head_dim) {
    return wl_fam_k_word(key, d, head_dim);
}
extern "C" int wl_host_fam_v_word(int d, int key) { return wl_fam_v_word(d, key); }
extern "C" void wl_host_fam_q_frag(const wl_u32* sq, int row0, int head_dim, int lane, int ks,
                                   wl_u32* a) {
    wl_fam_q_frag(sq, row0, head_dim, lane, ks, a);
}
extern "C" void wl_host_fam_k_frag(const wl_u32* sk, int head_dim, int lane, int nb, int ks,
                                   wl_u32* b) {
    wl_fam_k_frag(sk, head_dim, lane, nb, ks, b);
}
extern "C" void wl_host_fam_v_frag(const wl_u32* svt, int lane, int db, int kk, wl_u32* b) {
    wl_fam_v_frag(svt, lane, db, kk, b);
}
extern "C" void wl_host_fam_p_frag(const float* p, int kk, wl_u32* a) { wl_fam_p_frag(p, kk, a); }
extern "C" void wl_host_fam_weigh(float* s, int lane, wl_u64 t0, const wl_u64* qi, wl_u64 start,
                                  wl_u64 window, wl_u64 key_end, float scale, float softcap,
                                  float* mx) {
    wl_fam_weigh(s, lane, t0, qi, start, window, key_end, scale, softcap, mx);
}
extern "C" void wl_host_fam_probs(float* s, const float* m, const float* mt, float* m_new,
                                  float* keep, float* ps) {
    wl_fam_probs(s, m, mt, m_new, keep, ps);
}
extern "C" void wl_host_fam_fold(float* m, float* l, const float* m_new, const float* keep,
                                 const float* psum) {
    wl_fam_fold(m, l, m_new, keep, psum);
}
extern "C" void wl_host_fam_rescale(float* o, const float* keep) { wl_fam_rescale(o, keep); }

// ---- q8_mma_{type}'s lane arithmetic (wl_mmq.cuh), for the twin's software warp: the
// m16n8k32 s8 fragment maps, the staged words, the fragment loads and a lane's epilogue. ----

extern "C" void wl_host_mmq_a(int lane, int reg, int byte, int* row, int* col) {
    *row = wl_mmq_a_row(lane, reg);
    *col = wl_mmq_a_col(lane, reg, byte);
}
extern "C" void wl_host_mmq_b(int lane, int reg, int byte, int* k, int* n) {
    *k = wl_mmq_b_k(lane, reg, byte);
    *n = wl_mmq_b_n(lane);
}
extern "C" void wl_host_mmq_c(int lane, int reg, int* row, int* col) {
    *row = wl_mma_c_row(lane, reg);
    *col = wl_mma_c_col(lane, reg);
}
// The kernel's block shape and shared arrays: rows, tokens and groups a pass, threads, words of
// staged weights and activations, entries of a per-group array of rows and of tokens.
extern "C" void wl_host_mmq_shape(int* v) {
    v[0] = WL_MMQ_ROWS;
    v[1] = WL_MMQ_WARP_ROWS;
    v[2] = WL_MMQ_TOKS;
    v[3] = WL_MMQ_GROUPS;
    v[4] = WL_MMQ_THREADS;
    v[5] = WL_MMQ_W_WORDS;
    v[6] = WL_MMQ_X_WORDS;
    v[7] = WL_MMQ_W_GROUPS;
    v[8] = WL_MMQ_X_GROUPS;
}

typedef void (*wl_mmq_stage_fn)(const wl_u8*, wl_u64, wl_u64, wl_u64, wl_u64, int, int, wl_u32*,
                                float*, float*);
#define WL_MMQ_CASE(NAME, ID)                 \
    case ID:                                  \
        *f = wl_mmq_stage_w_##NAME;           \
        *kind = WL_Q8_KIND_##NAME;            \
        *halves = WL_MMQ_HALVES_##NAME;       \
        return 1;
static int wl_mmq_fns(int ty, wl_mmq_stage_fn* f, int* kind, int* halves) {
    switch (ty) {
        WL_MMQ_CASE(q4_0, WL_Q4_0)
        WL_MMQ_CASE(q4_1, WL_Q4_1)
        WL_MMQ_CASE(q5_0, WL_Q5_0)
        WL_MMQ_CASE(q5_1, WL_Q5_1)
        WL_MMQ_CASE(q8_0, WL_Q8_0)
        WL_MMQ_CASE(q4_k, WL_Q4_K)
        WL_MMQ_CASE(q6_k, WL_Q6_K)
        default: return 0;
    }
}
// The type's min-term kind and products a group; 0 for a type without a q8_mma_ kernel.
extern "C" int wl_host_mmq_kind(int ty, int* kind, int* halves) {
    wl_mmq_stage_fn f;
    return wl_mmq_fns(ty, &f, kind, halves);
}
// Element e of a weight pass of type `ty` (byte by byte: al = 0); 0 for an unknown type.
extern "C" int wl_host_mmq_stage_w(int ty, const wl_u8* w, wl_u64 rows, wl_u64 cols, wl_u64 r0,
                                   wl_u64 g0, int e, wl_u32* sw, float* sdw, float* smw) {
    wl_mmq_stage_fn f;
    int kind, halves;
    if (!wl_mmq_fns(ty, &f, &kind, &halves)) return 0;
    f(w, rows, cols, r0, g0, 0, e, sw, sdw, smw);
    return 1;
}
extern "C" void wl_host_mmq_stage_x(const wl_u8* xq, wl_u64 n_tok, wl_u64 n_groups, wl_u64 t0,
                                    wl_u64 g0, int e, wl_u32* sx, float* sxd, int* sxs) {
    wl_mmq_stage_x(xq, n_tok, n_groups, t0, g0, 0, e, sx, sxd, sxs);
}
extern "C" void wl_host_mmq_a_frag(const wl_u32* sw, int row0, int kk, int lane, int halves,
                                   int h, wl_u32* a) {
    wl_mmq_a_frag(sw, row0, kk, lane, halves, h, a);
}
extern "C" void wl_host_mmq_b_frag(const wl_u32* sx, int tok0, int kk, int lane, wl_u32* b) {
    wl_mmq_b_frag(sx, tok0, kk, lane, b);
}
extern "C" void wl_host_mmq_epilogue(const int* c, int lane, int row0, int tok0, int kk, int h,
                                     int kind, const float* sdw, const float* smw,
                                     const float* sxd, const int* sxs, float* acc, float* ext) {
    wl_mmq_epilogue(c, lane, row0, tok0, kk, h, kind, sdw, smw, sxd, sxs, acc, ext);
}
