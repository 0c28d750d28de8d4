// kv_quantize_{q8,q4}: one thread per group of 32; kv_dequantize_{q8,q4}: one thread per value.
#include "wl_kv.cuh"

extern "C" __global__ void kv_quantize_q8(const float* x, wl_u8* out, wl_u64 n_groups) {
    wl_u64 g = (wl_u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (g < n_groups) wl_kv_quantize_group(x + g * 32, out + g * 34, 127);
}

extern "C" __global__ void kv_quantize_q4(const float* x, wl_u8* out, wl_u64 n_groups) {
    wl_u64 g = (wl_u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (g < n_groups) wl_kv_quantize_group(x + g * 32, out + g * 18, 7);
}

extern "C" __global__ void kv_dequantize_q8(const wl_u8* src, float* out, wl_u64 n) {
    wl_u64 i = (wl_u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = wl_kv_dequant(src + (i / 32) * 34, (int)(i % 32), 127);
}

extern "C" __global__ void kv_dequantize_q4(const wl_u8* src, float* out, wl_u64 n) {
    wl_u64 i = (wl_u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = wl_kv_dequant(src + (i / 32) * 18, (int)(i % 32), 7);
}
