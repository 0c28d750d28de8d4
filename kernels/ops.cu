// rms_norm_f32, add_rms_norm_f32 (and add_rms_norm_q8_f32, its output quantised too),
// rope_{norm,neox}_f32, softmax_f32, swiglu_f32, add_f32, and the in-place
// forms the forward pass uses: rope_inplace_{norm,neox}_f32, add_inplace_f32,
// swiglu_inplace_f32, geglu_tanh_inplace_f32, scale_inplace_f32, gather_rows_f32,
// scatter_add_rows_f32, add_bias_f32.
#include "wl_common.cuh"
#include "wl_q8.cuh"

// Block-wide sum for blockDim.x a multiple of 32, at most 1024; every thread must call it, and
// every thread gets the total. In double, as the CPU kernels sum rows (a row of a few thousand
// values costs a few thousand FP64 adds, which even consumer GPUs do in a blink).
__device__ double wl_block_sum(double v) {
    __shared__ double part[32];
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    __syncthreads();
    if (lane == 0) part[warp] = v;
    __syncthreads();
    int nw = blockDim.x / 32;
    v = lane < nw ? part[lane] : 0.0;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Block-wide max, as wl_block_sum (NaN-ignoring, as fmaxf and Rust's f32::max are).
__device__ float wl_block_max(float v) {
    __shared__ float part[32];
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    __syncthreads();
    if (lane == 0) part[warp] = v;
    __syncthreads();
    int nw = blockDim.x / 32;
    v = lane < nw ? part[lane] : wl_bits_to_f32(0xff800000u);
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// One block per row of n values: out = x / sqrt(mean(x^2) + eps) * w, with the CPU kernel's
// rounding steps (sum of squares in double, mean rounded to f32, then f32 maths).
// The norms keep a row in registers, WL_NORM_VALS values a thread (rows of up to 2,048 values
// with the 256 threads of per_row's launch; longer rows loop over chunks of that many): every
// load of a chunk is issued before any value is used, where a plain loop would wait on each
// load in turn (its stores may alias the next load). The sums keep their order: each thread
// adds its values' squares in value order, in double, then wl_block_sum.
#define WL_NORM_VALS 8

// x[i] (+ h[i] stored to xout[i], when h is given) for the chunk of values `base +
// threadIdx.x + k * blockDim.x`; `w` loaded alongside; `ss` gains the squares in order.
__device__ __forceinline__ void wl_norm_chunk(const float* x, const float* h, float* xout,
                                              const float* w, wl_u64 n, wl_u64 base, float* v,
                                              float* wv, double* ss) {
#pragma unroll
    for (int k = 0; k < WL_NORM_VALS; ++k) {
        wl_u64 i = base + threadIdx.x + (wl_u64)k * blockDim.x;
        v[k] = i < n ? (h ? WL_ADD(x[i], h[i]) : x[i]) : 0.0f;
        wv[k] = i < n ? w[i] : 0.0f;
    }
#pragma unroll
    for (int k = 0; k < WL_NORM_VALS; ++k) {
        wl_u64 i = base + threadIdx.x + (wl_u64)k * blockDim.x;
        if (i < n) {
            if (h) xout[i] = v[k];
            *ss += (double)v[k] * (double)v[k];
        }
    }
}

// One row: rms_norm (h and xout null: out = rms_norm(x) * w) or add_rms_norm (xout = x + h,
// then out = rms_norm(xout) * w; xout is x and out is h), one block per row.
__device__ __forceinline__ void wl_norm_row(const float* xr, const float* hr, float* xout,
                                            const float* w, float* orow, wl_u64 n, float eps) {
    const wl_u64 chunk = (wl_u64)WL_NORM_VALS * blockDim.x;
    float v[WL_NORM_VALS], wv[WL_NORM_VALS];
    double ss = 0.0;
    for (wl_u64 base = 0; base < n; base += chunk) {
        wl_norm_chunk(xr, hr, xout, w, n, base, v, wv, &ss);
    }
    ss = wl_block_sum(ss);
    float mean = (float)(ss / (double)n);
    float scale = 1.0f / sqrtf(mean + eps);
    if (n <= chunk) {
        // the row is still in registers
#pragma unroll
        for (int k = 0; k < WL_NORM_VALS; ++k) {
            wl_u64 i = threadIdx.x + (wl_u64)k * blockDim.x;
            if (i < n) orow[i] = (v[k] * scale) * wv[k];
        }
        return;
    }
    // a long row: the summed values again, from xout where they were stored (a thread rereads
    // only values it wrote)
    const float* src = hr ? xout : xr;
    for (wl_u64 i = threadIdx.x; i < n; i += blockDim.x) orow[i] = (src[i] * scale) * w[i];
}

extern "C" __global__ void rms_norm_f32(const float* x, const float* w, float* out, wl_u64 n, float eps) {
    wl_norm_row(x + (wl_u64)blockIdx.x * n, nullptr, nullptr, w, out + (wl_u64)blockIdx.x * n, n,
                eps);
}

// add_rms_norm_f32(x, h, w, n, eps): x += h, then h = rms_norm(x) * w, one block per row: the
// arithmetic of add_inplace_f32 and then rms_norm_f32, in one pass (each thread rewrites only
// the values it read, so the in-place writes race with nothing).
extern "C" __global__ void add_rms_norm_f32(float* x, float* h, const float* w, wl_u64 n, float eps) {
    float* xr = x + (wl_u64)blockIdx.x * n;
    float* hr = h + (wl_u64)blockIdx.x * n;
    wl_norm_row(xr, hr, xr, w, hr, n, eps);
}

// add_rms_norm_q8_f32(x, h, w, xq, n, eps): add_rms_norm_f32, then the normed row quantised into
// n / 32 Q8 activation blocks at xq (q8_quantize_f32's bytes of the same values) for the products
// that read it next, in the one launch where decode had two. n a multiple of 32.
extern "C" __global__ void add_rms_norm_q8_f32(float* x, float* h, const float* w, wl_u8* xq,
                                               wl_u64 n, float eps) {
    float* xr = x + (wl_u64)blockIdx.x * n;
    float* hr = h + (wl_u64)blockIdx.x * n;
    wl_norm_row(xr, hr, xr, w, hr, n, eps);
    wl_q8_quantize_row(hr, xq + (wl_u64)blockIdx.x * (n / 32) * WL_Q8_BLOCK_BYTES, n);
}

// One thread per rotated pair. x: n_tok x n_heads x head_dim; pos: one per token.
__device__ __forceinline__ void wl_rope(const float* x, const int* pos, float* out, wl_u64 n_heads,
                                        int head_dim, int n_dims, float base, float scale, int neox) {
    wl_u64 idx = (wl_u64)blockIdx.x * blockDim.x + threadIdx.x;
    int half = n_dims / 2;
    wl_u64 head = idx / (wl_u64)half;
    int i = (int)(idx % (wl_u64)half);
    wl_u64 tok = head / n_heads;
    const float* xh = x + head * head_dim;
    float* oh = out + head * head_dim;
    float theta = (float)pos[tok] * scale * powf(base, -2.0f * (float)i / (float)n_dims);
    float c = cosf(theta), s = sinf(theta);
    int ia = neox ? i : 2 * i;
    int ib = neox ? i + half : 2 * i + 1;
    float a = xh[ia], b = xh[ib];
    oh[ia] = a * c - b * s;
    oh[ib] = a * s + b * c;
    // the dims past n_dims pass through; thread i of the head copies dims n_dims + i, + half, ...
    for (int k = n_dims + i; k < head_dim; k += half) oh[k] = xh[k];
}

extern "C" __global__ void rope_norm_f32(const float* x, const int* pos, float* out, wl_u64 n_pairs,
                                         wl_u64 n_heads, int head_dim, int n_dims, float base, float scale) {
    if ((wl_u64)blockIdx.x * blockDim.x + threadIdx.x >= n_pairs) return;
    wl_rope(x, pos, out, n_heads, head_dim, n_dims, base, scale, 0);
}

extern "C" __global__ void rope_neox_f32(const float* x, const int* pos, float* out, wl_u64 n_pairs,
                                         wl_u64 n_heads, int head_dim, int n_dims, float base, float scale) {
    if ((wl_u64)blockIdx.x * blockDim.x + threadIdx.x >= n_pairs) return;
    wl_rope(x, pos, out, n_heads, head_dim, n_dims, base, scale, 1);
}

// One block per row of n values: max-subtracted, the sum of exponentials in double and its
// reciprocal rounded to f32, as the CPU kernel does.
extern "C" __global__ void softmax_f32(const float* x, float* out, wl_u64 n) {
    const float* xr = x + (wl_u64)blockIdx.x * n;
    float* orow = out + (wl_u64)blockIdx.x * n;
    float m = wl_bits_to_f32(0xff800000u);
    for (wl_u64 i = threadIdx.x; i < n; i += blockDim.x) m = fmaxf(m, xr[i]);
    m = wl_block_max(m);
    double sum = 0.0;
    for (wl_u64 i = threadIdx.x; i < n; i += blockDim.x) {
        float e = expf(xr[i] - m);
        orow[i] = e;
        sum += (double)e;
    }
    sum = wl_block_sum(sum);
    float inv = (float)(1.0 / sum);
    for (wl_u64 i = threadIdx.x; i < n; i += blockDim.x) orow[i] *= inv;
}

extern "C" __global__ void swiglu_f32(const float* gate, const float* up, float* out, wl_u64 n) {
    wl_u64 i = (wl_u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        float g = gate[i];
        out[i] = g / (1.0f + expf(-g)) * up[i];
    }
}

extern "C" __global__ void add_f32(const float* a, const float* b, float* out, wl_u64 n) {
    wl_u64 i = (wl_u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = a[i] + b[i];
}

// RoPE in place with a table of per-pair angles (Llama 3's and LongRoPE's frequency factors are
// folded into it on the host): one thread per rotated pair; pair i at position p turns by
// p * freqs[i], its cosine and sine times mscale (LongRoPE's attention factor; 1 leaves the
// bits), as the CPU's rope_in_place. Dims past n_dims are left as they are.
__device__ __forceinline__ void wl_rope_inplace(float* x, const int* pos, const float* freqs,
                                                wl_u64 n_heads, int head_dim, int n_dims, int neox,
                                                float mscale) {
    wl_u64 idx = (wl_u64)blockIdx.x * blockDim.x + threadIdx.x;
    int half = n_dims / 2;
    wl_u64 head = idx / (wl_u64)half;
    int i = (int)(idx % (wl_u64)half);
    wl_u64 tok = head / n_heads;
    float* xh = x + head * head_dim;
    float theta = WL_MUL((float)pos[tok], freqs[i]);
    float c = WL_MUL(cosf(theta), mscale), s = WL_MUL(sinf(theta), mscale);
    int ia = neox ? i : 2 * i;
    int ib = neox ? i + half : 2 * i + 1;
    float a = xh[ia], b = xh[ib];
    xh[ia] = WL_SUB(WL_MUL(a, c), WL_MUL(b, s));
    xh[ib] = WL_ADD(WL_MUL(a, s), WL_MUL(b, c));
}

extern "C" __global__ void rope_inplace_norm_f32(float* x, const int* pos, const float* freqs,
                                                 wl_u64 n_pairs, wl_u64 n_heads, int head_dim,
                                                 int n_dims, float mscale) {
    if ((wl_u64)blockIdx.x * blockDim.x + threadIdx.x >= n_pairs) return;
    wl_rope_inplace(x, pos, freqs, n_heads, head_dim, n_dims, 0, mscale);
}

extern "C" __global__ void rope_inplace_neox_f32(float* x, const int* pos, const float* freqs,
                                                 wl_u64 n_pairs, wl_u64 n_heads, int head_dim,
                                                 int n_dims, float mscale) {
    if ((wl_u64)blockIdx.x * blockDim.x + threadIdx.x >= n_pairs) return;
    wl_rope_inplace(x, pos, freqs, n_heads, head_dim, n_dims, 1, mscale);
}

// x += y (the residual add).
extern "C" __global__ void add_inplace_f32(float* x, const float* y, wl_u64 n) {
    wl_u64 i = (wl_u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = WL_ADD(x[i], y[i]);
}

// gate = silu(gate) * up.
extern "C" __global__ void swiglu_inplace_f32(float* gate, const float* up, wl_u64 n) {
    wl_u64 i = (wl_u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        float g = gate[i];
        gate[i] = WL_SILU_MUL(g, up[i]);
    }
}

// gate = gelu_tanh(gate) * up (GeGLU): 0.5 g (1 + tanh(sqrt(2/pi) g (1 + 0.044715 g^2))), the
// CPU reference's order of operations.
extern "C" __global__ void geglu_tanh_inplace_f32(float* gate, const float* up, wl_u64 n) {
    wl_u64 i = (wl_u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        float g = gate[i];
        float inner = WL_MUL(WL_MUL(0.7978846f, g), WL_ADD(1.0f, WL_MUL(WL_MUL(0.044715f, g), g)));
        float gelu = WL_MUL(WL_MUL(0.5f, g), WL_ADD(1.0f, tanhf(inner)));
        gate[i] = WL_MUL(gelu, up[i]);
    }
}

// x *= s (gemma's embedding scale).
extern "C" __global__ void scale_inplace_f32(float* x, float s, wl_u64 n) {
    wl_u64 i = (wl_u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = WL_MUL(x[i], s);
}

// dst[k * n_cols + c] = src[rows[k] * n_cols + c] over n = n_rows * n_cols values: the rows
// routed to one expert, gathered. An index at or past src_rows (which the router never gives)
// leaves its row unwritten rather than read out of bounds. One thread a value; the bound is
// 2 n × 4 bytes moved, a copy's bandwidth.
extern "C" __global__ void gather_rows_f32(float* dst, const unsigned int* rows, const float* src,
                                           wl_u64 n, wl_u64 n_cols, wl_u64 src_rows) {
    wl_u64 i = (wl_u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    wl_u64 k = i / n_cols;
    wl_u64 r = rows[k];
    if (r < src_rows) dst[i] = src[r * n_cols + i % n_cols];
}

// dst[rows[k] * n_cols + c] += weights[k] * src[k * n_cols + c] over n = n_rows * n_cols
// values, the product rounded before the sum (the CPU reference's order): an expert's output
// rows added into their tokens' sums. The rows are distinct, so no two threads write one
// value; an index at or past dst_rows is skipped. One thread a value; 3 n × 4 bytes moved.
extern "C" __global__ void scatter_add_rows_f32(float* dst, const unsigned int* rows,
                                                const float* weights, const float* src, wl_u64 n,
                                                wl_u64 n_cols, wl_u64 dst_rows) {
    wl_u64 i = (wl_u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    wl_u64 k = i / n_cols;
    wl_u64 r = rows[k];
    if (r < dst_rows) {
        wl_u64 at = r * n_cols + i % n_cols;
        dst[at] = WL_ADD(dst[at], WL_MUL(weights[k], src[i]));
    }
}

// x[r * n_cols + c] += bias[c] over n = rows * n_cols values.
extern "C" __global__ void add_bias_f32(float* x, const float* bias, wl_u64 n, wl_u64 n_cols) {
    wl_u64 i = (wl_u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = WL_ADD(x[i], bias[i % n_cols]);
}
