// kv_quantize_{q8,q4}: one thread per group of 32; kv_dequantize_{q8,q4}: one thread per value.
#include "wl_kv.cuh"

#define WL_KV(NAME, QMAX)                                                                          \
    extern "C" __global__ void kv_quantize_##NAME(const float* x, wl_u8* out, wl_u64 n_groups) {  \
        wl_u64 g = (wl_u64)blockIdx.x * blockDim.x + threadIdx.x;                                  \
        if (g < n_groups) {                                                                        \
            wl_kv_quantize_group(x + g * 32, out + g * (wl_u64)wl_kv_group_bytes(QMAX), QMAX);     \
        }                                                                                          \
    }                                                                                              \
    extern "C" __global__ void kv_dequantize_##NAME(const wl_u8* src, float* out, wl_u64 n) {     \
        wl_u64 i = (wl_u64)blockIdx.x * blockDim.x + threadIdx.x;                                  \
        if (i < n) {                                                                               \
            out[i] = wl_kv_dequant(src + (i / 32) * (wl_u64)wl_kv_group_bytes(QMAX), (int)(i % 32), QMAX); \
        }                                                                                          \
    }

WL_KV(q8, 127)
WL_KV(q4, 7)
