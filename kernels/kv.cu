// The KV cache's storage formats (see the Rust codec `KvFormat`): kv_store_{fmt} encodes n f32
// values into cache bytes, kv_load_{fmt} decodes them. e4m3 and bf16: one thread per value.
// q8/q4: one thread per group of 32, turned by the Walsh-Hadamard transform before quantising
// and after dequantising. f32 and f16 are plain copies and conversions, launched from other
// modules.
#include "wl_kv.cuh"

extern "C" __global__ void kv_store_e4m3(const float* x, wl_u8* out, wl_u64 n) {
    wl_u64 i = (wl_u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = wl_e4m3_encode(x[i]);
}

extern "C" __global__ void kv_load_e4m3(const wl_u8* src, float* out, wl_u64 n) {
    wl_u64 i = (wl_u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = wl_e4m3_decode(src[i]);
}

extern "C" __global__ void kv_store_bf16(const float* x, wl_u16* out, wl_u64 n) {
    wl_u64 i = (wl_u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = wl_kv_store_bf16(x[i]);
}

extern "C" __global__ void kv_load_bf16(const wl_u16* src, float* out, wl_u64 n) {
    wl_u64 i = (wl_u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = wl_kv_load_bf16(src[i]);
}

#define WL_KV(NAME, QMAX)                                                                          \
    extern "C" __global__ void kv_store_##NAME(const float* x, wl_u8* out, wl_u64 n) {            \
        wl_u64 g = (wl_u64)blockIdx.x * blockDim.x + threadIdx.x;                                  \
        if (g < n / 32) {                                                                          \
            wl_kv_store_group(x + g * 32, out + g * (wl_u64)wl_kv_group_bytes(QMAX), QMAX);        \
        }                                                                                          \
    }                                                                                              \
    extern "C" __global__ void kv_load_##NAME(const wl_u8* src, float* out, wl_u64 n) {           \
        wl_u64 g = (wl_u64)blockIdx.x * blockDim.x + threadIdx.x;                                  \
        if (g < n / 32) {                                                                          \
            wl_kv_load_group(src + g * (wl_u64)wl_kv_group_bytes(QMAX), out + g * 32, QMAX);       \
        }                                                                                          \
    }

WL_KV(q8, 127)
WL_KV(q4, 7)
