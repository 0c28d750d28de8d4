// matvec_{type}_{f32,f16} and matmul_{type}_{f32,f16}: exact mode (weights dequantised in
// registers, f32 accumulation). One warp per output value; lanes stride over the row and the
// partial sums meet through warp shuffles.
#include "wl_dequant.cuh"

__device__ __forceinline__ float wl_warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float wl_act_f32(const float* x, wl_u64 i) { return x[i]; }
__device__ __forceinline__ float wl_act_f16(const wl_u16* x, wl_u64 i) { return wl_f16_to_f32(x[i]); }

// y[t * rows + r] = dot(W[r], x[t]); grid.x * (blockDim.x / 32) warps cover rows, grid.y tokens.
#define WL_MATMUL(NAME, BS, BB, ACT, ACT_T)                                                        \
    extern "C" __global__ void matmul_##NAME##_##ACT(const wl_u8* w, const ACT_T* x, float* y,     \
                                                     wl_u64 rows, wl_u64 cols) {                   \
        wl_u64 r = (wl_u64)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;                      \
        wl_u64 t = blockIdx.y;                                                                     \
        int lane = threadIdx.x % 32;                                                               \
        if (r >= rows) return;                                                                     \
        const wl_u8* row = w + r * (cols / (BS)) * (BB);                                           \
        const ACT_T* xt = x + t * cols;                                                            \
        float acc = 0.0f;                                                                          \
        for (wl_u64 c = lane; c < cols; c += 32) {                                                 \
            acc += wl_dq_##NAME(row + (c / (BS)) * (BB), (int)(c % (BS))) * wl_act_##ACT(xt, c);   \
        }                                                                                          \
        acc = wl_warp_sum(acc);                                                                    \
        if (lane == 0) y[t * rows + r] = acc;                                                      \
    }                                                                                              \
    extern "C" __global__ void matvec_##NAME##_##ACT(const wl_u8* w, const ACT_T* x, float* y,     \
                                                     wl_u64 rows, wl_u64 cols) {                   \
        wl_u64 r = (wl_u64)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;                      \
        int lane = threadIdx.x % 32;                                                               \
        if (r >= rows) return;                                                                     \
        const wl_u8* row = w + r * (cols / (BS)) * (BB);                                           \
        float acc = 0.0f;                                                                          \
        for (wl_u64 c = lane; c < cols; c += 32) {                                                 \
            acc += wl_dq_##NAME(row + (c / (BS)) * (BB), (int)(c % (BS))) * wl_act_##ACT(x, c);    \
        }                                                                                          \
        acc = wl_warp_sum(acc);                                                                    \
        if (lane == 0) y[r] = acc;                                                                 \
    }

#define WL_MATMUL_BOTH(NAME, BS, BB)          \
    WL_MATMUL(NAME, BS, BB, f32, float)       \
    WL_MATMUL(NAME, BS, BB, f16, wl_u16)

WL_MATMUL_BOTH(q4_0, 32, 18)
WL_MATMUL_BOTH(q4_1, 32, 20)
WL_MATMUL_BOTH(q8_0, 32, 34)
WL_MATMUL_BOTH(q4_k, 256, 144)
WL_MATMUL_BOTH(q6_k, 256, 210)
WL_MATMUL_BOTH(f16, 1, 2)
WL_MATMUL_BOTH(f32, 1, 4)
