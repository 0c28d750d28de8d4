// convert_{src}_f16 and scan_{type}: dtype conversion and the NaN/Inf scan.
#include "wl_common.cuh"

extern "C" __global__ void convert_f32_f16(const float* src, wl_u16* dst, wl_u64 n) {
    wl_u64 i = (wl_u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) dst[i] = wl_f32_to_f16(src[i]);
}

extern "C" __global__ void convert_bf16_f16(const wl_u16* src, wl_u16* dst, wl_u64 n) {
    wl_u64 i = (wl_u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) dst[i] = wl_f32_to_f16(wl_bf16_to_f32(src[i]));
}

extern "C" __global__ void convert_f16_f32(const wl_u16* src, float* dst, wl_u64 n) {
    wl_u64 i = (wl_u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) dst[i] = wl_f16_to_f32(src[i]);
}

// `first` must hold ~0ull before the launch; afterwards it is the first non-finite index.
extern "C" __global__ void scan_f32(const wl_u32* src, wl_u64 n, wl_u64* first) {
    wl_u64 i = (wl_u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n && (src[i] & 0x7f800000u) == 0x7f800000u) atomicMin(first, i);
}

extern "C" __global__ void scan_f16(const wl_u16* src, wl_u64 n, wl_u64* first) {
    wl_u64 i = (wl_u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n && (src[i] & 0x7c00u) == 0x7c00u) atomicMin(first, i);
}

extern "C" __global__ void scan_bf16(const wl_u16* src, wl_u64 n, wl_u64* first) {
    wl_u64 i = (wl_u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n && (src[i] & 0x7f80u) == 0x7f80u) atomicMin(first, i);
}
