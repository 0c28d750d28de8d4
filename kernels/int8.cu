// LLM.int8 (bitsandbytes' load_in_8bit), the CUDA twin of the CPU's cpu::int8:
//
//   int8_outliers_f32     the outlier columns of x (n_tok × cols): |x| >= threshold for some
//                         token, as a flag per column and an ascending list with its length.
//   int8_quantize_{f32,f16}  row-wise absmax int8: scale = max |x| over the values below the
//                         threshold (all values when threshold <= 0),
//                         q = rint(x * (127 * (1 / scale))) saturated to i8 (NaN to 0), 0 in flagged columns; weights are this
//                         with threshold 0 and no flags.
//   int8_matmul_f32       y[t * rows + o] = (acc * (sx[t] * sw[o])) * (1/127^2)
//                         + sum over outlier columns c, in list order, of x[t, c] * ((q[o, c] * sw[o]) * (1/127)),
//                         acc the exact i32 sum of q_x * q_w (dp4a). Every float operation is
//                         round-to-nearest and never fused, in the CPU kernel's order, so the
//                         two give the same bits.
#include "wl_common.cuh"

#define WL_INT8_MM_DEQUANT 6.200124e-05f   // 1/127^2 as bitsandbytes' CPU int8_mm_dequant writes it
#define WL_INT8_DEQUANT 7.874015718698502e-3f  // 1/127 as bitsandbytes' int8_vectorwise_dequant

// One block (any blockDim.x that is a multiple of 32, at most 1024). Column tiles of blockDim.x:
// each thread flags one column, and a warp ballot plus a prefix over the warps appends the
// flagged columns in ascending order.
extern "C" __global__ void int8_outliers_f32(const float* x, wl_u8* flags, wl_u32* out_cols,
                                             wl_u32* n_out, wl_u64 n_tok, wl_u64 cols,
                                             float threshold) {
    __shared__ wl_u32 warp_count[32];
    __shared__ wl_u32 base;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nw = blockDim.x / 32;
    if (threadIdx.x == 0) base = 0;
    __syncthreads();
    for (wl_u64 c0 = 0; c0 < cols; c0 += blockDim.x) {
        wl_u64 c = c0 + threadIdx.x;
        bool flag = false;
        if (c < cols && threshold > 0.0f) {
            for (wl_u64 t = 0; t < n_tok && !flag; ++t) flag = fabsf(x[t * cols + c]) >= threshold;
        }
        if (c < cols) flags[c] = flag ? 1 : 0;
        wl_u32 ballot = __ballot_sync(0xffffffffu, flag);
        if (lane == 0) warp_count[warp] = __popc(ballot);
        __syncthreads();
        wl_u32 before = base;
        for (int k = 0; k < warp; ++k) before += warp_count[k];
        if (flag) out_cols[before + __popc(ballot & ((1u << lane) - 1u))] = (wl_u32)c;
        __syncthreads();
        if (threadIdx.x == 0) {
            for (int k = 0; k < nw; ++k) base += warp_count[k];
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) *n_out = base;
}

// Block-wide max of non-negative values for blockDim.x a multiple of 32, at most 1024.
__device__ float wl_int8_block_max(float v) {
    __shared__ float part[32];
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    __syncthreads();
    if (lane == 0) part[warp] = v;
    __syncthreads();
    v = lane < (int)(blockDim.x / 32) ? part[lane] : 0.0f;
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

__device__ __forceinline__ float wl_int8_load(const float* x, wl_u64 i) { return x[i]; }
__device__ __forceinline__ float wl_int8_load(const wl_u16* x, wl_u64 i) { return wl_f16_to_f32(x[i]); }

// One block per row (grid.x = n_rows); `flags` may be null (no columns zeroed).
#define WL_INT8_QUANTIZE(NAME, T)                                                                  \
    extern "C" __global__ void int8_quantize_##NAME(const T* x, const wl_u8* flags, wl_i8* q,     \
                                                    float* scales, wl_u64 n_rows, wl_u64 cols,    \
                                                    float threshold) {                            \
        const wl_u64 r = blockIdx.x;                                                               \
        if (r >= n_rows) return;                                                                   \
        const bool thr = threshold > 0.0f;                                                         \
        float m = 0.0f;                                                                            \
        for (wl_u64 c = threadIdx.x; c < cols; c += blockDim.x) {                                  \
            float a = fabsf(wl_int8_load(x, r * cols + c));                                        \
            if (!thr || a < threshold) m = fmaxf(m, a);                                            \
        }                                                                                          \
        const float amax = wl_int8_block_max(m);                                                   \
        if (threadIdx.x == 0) scales[r] = amax;                                                    \
        const float s = amax != 0.0f ? __fmul_rn(127.0f, __frcp_rn(amax)) : 0.0f;                 \
        for (wl_u64 c = threadIdx.x; c < cols; c += blockDim.x) {                                  \
            float v = rintf(WL_MUL(wl_int8_load(x, r * cols + c), s));                             \
            if (v != v || amax == 0.0f || (flags != 0 && flags[c])) v = 0.0f;                      \
            q[r * cols + c] = (wl_i8)(int)fminf(fmaxf(v, -128.0f), 127.0f);                        \
        }                                                                                          \
    }

WL_INT8_QUANTIZE(f32, float)
WL_INT8_QUANTIZE(f16, wl_u16)

// Four bytes of p from i (a multiple of 4, i + 4 <= the row's length), little-endian, read a
// byte at a time: rows of any length start at any byte offset.
__device__ __forceinline__ wl_u32 wl_int8_word(const wl_i8* p, wl_u64 i) {
    return (wl_u32)(wl_u8)p[i] | ((wl_u32)(wl_u8)p[i + 1] << 8) | ((wl_u32)(wl_u8)p[i + 2] << 16) |
           ((wl_u32)(wl_u8)p[i + 3] << 24);
}

// One warp per (weight row, token): grid.x * (blockDim.x / 32) warps cover the rows, grid.y
// (at most 65535) strides over the tokens. Launch with blockDim.x a multiple of 32; a warp whose
// row is out of range returns as a whole.
extern "C" __global__ void int8_matmul_f32(const wl_i8* wq, const float* ws, const float* x,
                                           const wl_i8* xq, const float* xs,
                                           const wl_u32* out_cols, const wl_u32* n_out, float* y,
                                           wl_u64 rows, wl_u64 cols, wl_u64 n_tok) {
    const wl_u64 r = (wl_u64)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    if (r >= rows) return;
    const wl_i8* wr = wq + r * cols;
    const wl_u64 main = cols / 4 * 4;
    const wl_u32 no = *n_out;
    for (wl_u64 t = blockIdx.y; t < n_tok; t += gridDim.y) {
        const wl_i8* xr = xq + t * cols;
        int acc = 0;
        for (wl_u64 c = 4 * (wl_u64)lane; c < main; c += 128) {
            acc = __dp4a((int)wl_int8_word(wr, c), (int)wl_int8_word(xr, c), acc);
        }
        if (lane == 0) {
            for (wl_u64 c = main; c < cols; ++c) acc += (int)wr[c] * (int)xr[c];
        }
        for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
        if (lane == 0) {
            const float sw = ws[r];
            float v = WL_MUL(WL_MUL((float)acc, WL_MUL(xs[t], sw)), WL_INT8_MM_DEQUANT);
            if (no > 0) {
                float s = 0.0f;
                for (wl_u32 k = 0; k < no; ++k) {
                    const wl_u64 c = out_cols[k];
                    const float wd = WL_MUL(WL_MUL((float)wr[c], sw), WL_INT8_DEQUANT);
                    s = WL_ADD(s, WL_MUL(x[t * cols + c], wd));
                }
                v = WL_ADD(v, s);
            }
            y[t * rows + r] = v;
        }
    }
}
