// dequantize_{type}_{f32,f16}: one thread per output value.
#include "wl_dequant.cuh"

#define WL_DEQUANT(NAME, BS, BB)                                                                  \
    extern "C" __global__ void dequantize_##NAME##_f32(const wl_u8* src, float* dst, wl_u64 n) { \
        wl_u64 i = (wl_u64)blockIdx.x * blockDim.x + threadIdx.x;                                 \
        if (i >= n) return;                                                                       \
        dst[i] = wl_dq_##NAME(src + (i / (BS)) * (BB), (int)(i % (BS)));                          \
    }                                                                                             \
    extern "C" __global__ void dequantize_##NAME##_f16(const wl_u8* src, wl_u16* dst, wl_u64 n) { \
        wl_u64 i = (wl_u64)blockIdx.x * blockDim.x + threadIdx.x;                                 \
        if (i >= n) return;                                                                       \
        dst[i] = wl_f32_to_f16(wl_dq_##NAME(src + (i / (BS)) * (BB), (int)(i % (BS))));           \
    }

WL_DEQUANT(f32, 1, 4)
WL_DEQUANT(f16, 1, 2)
WL_DEQUANT(bf16, 1, 2)
WL_DEQUANT(q4_0, 32, 18)
WL_DEQUANT(q4_1, 32, 20)
WL_DEQUANT(q5_0, 32, 22)
WL_DEQUANT(q5_1, 32, 24)
WL_DEQUANT(q8_0, 32, 34)
WL_DEQUANT(iq4_nl, 32, 18)
WL_DEQUANT(q2_k, 256, 84)
WL_DEQUANT(q3_k, 256, 110)
WL_DEQUANT(q4_k, 256, 144)
WL_DEQUANT(q5_k, 256, 176)
WL_DEQUANT(q6_k, 256, 210)
