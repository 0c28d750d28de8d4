// dequantize_{type}_{f32,f16}: one thread per output value. Block sizes come from
// wl_block_layout (checked against gguf-py by the host twin), folded to constants per kernel.
#include "wl_dequant.cuh"

#define WL_DEQUANT(NAME, TY)                                                                      \
    extern "C" __global__ void dequantize_##NAME##_f32(const wl_u8* src, float* dst, wl_u64 n) { \
        wl_u64 i = (wl_u64)blockIdx.x * blockDim.x + threadIdx.x;                                 \
        if (i >= n) return;                                                                       \
        int bs, bb, o0, o1;                                                                       \
        wl_block_layout(TY, &bs, &bb, &o0, &o1);                                                  \
        dst[i] = wl_dq_##NAME(src + (i / (wl_u64)bs) * (wl_u64)bb, (int)(i % (wl_u64)bs));        \
    }                                                                                             \
    extern "C" __global__ void dequantize_##NAME##_f16(const wl_u8* src, wl_u16* dst, wl_u64 n) { \
        wl_u64 i = (wl_u64)blockIdx.x * blockDim.x + threadIdx.x;                                 \
        if (i >= n) return;                                                                       \
        int bs, bb, o0, o1;                                                                       \
        wl_block_layout(TY, &bs, &bb, &o0, &o1);                                                  \
        dst[i] = wl_f32_to_f16(wl_dq_##NAME(src + (i / (wl_u64)bs) * (wl_u64)bb, (int)(i % (wl_u64)bs))); \
    }

WL_DEQUANT(f32, WL_F32)
WL_DEQUANT(f16, WL_F16)
WL_DEQUANT(bf16, WL_BF16)
WL_DEQUANT(q4_0, WL_Q4_0)
WL_DEQUANT(q4_1, WL_Q4_1)
WL_DEQUANT(q5_0, WL_Q5_0)
WL_DEQUANT(q5_1, WL_Q5_1)
WL_DEQUANT(q8_0, WL_Q8_0)
WL_DEQUANT(iq4_nl, WL_IQ4_NL)
WL_DEQUANT(q2_k, WL_Q2_K)
WL_DEQUANT(q3_k, WL_Q3_K)
WL_DEQUANT(q4_k, WL_Q4_K)
WL_DEQUANT(q5_k, WL_Q5_K)
WL_DEQUANT(q6_k, WL_Q6_K)
