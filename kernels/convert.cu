// convert_{src}_{dst} and scan_{type}: dtype conversion and the NaN/Inf scan.
#include "wl_dequant.cuh"

extern "C" __global__ void convert_f32_f16(const float* src, wl_u16* dst, wl_u64 n) {
    wl_u64 i = (wl_u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) dst[i] = wl_f32_to_f16(src[i]);
}

// The activations of a bf16 prompt product on tensor cores (cuBLAS), rounded to nearest even.
extern "C" __global__ void convert_f32_bf16(const float* src, wl_u16* dst, wl_u64 n) {
    wl_u64 i = (wl_u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) dst[i] = wl_f32_to_bf16(src[i]);
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

// scan_{quantised type}: one thread per block, which checks the block's f16 scales (see
// wl_block_scales_non_finite); `first` as above, set to the first element of the first bad block.
#define WL_SCAN_BLOCKS(NAME, TY)                                                                 \
    extern "C" __global__ void scan_##NAME(const wl_u8* src, wl_u64 n_blocks, wl_u64* first) { \
        wl_u64 b = (wl_u64)blockIdx.x * blockDim.x + threadIdx.x;                                \
        int bs, bb, o0, o1;                                                                      \
        wl_block_layout(TY, &bs, &bb, &o0, &o1);                                                 \
        if (b < n_blocks && wl_block_scales_non_finite(src + b * (wl_u64)bb, o0, o1)) {          \
            atomicMin(first, b * (wl_u64)bs);                                                    \
        }                                                                                        \
    }

WL_SCAN_BLOCKS(q4_0, WL_Q4_0)
WL_SCAN_BLOCKS(q4_1, WL_Q4_1)
WL_SCAN_BLOCKS(q5_0, WL_Q5_0)
WL_SCAN_BLOCKS(q5_1, WL_Q5_1)
WL_SCAN_BLOCKS(q8_0, WL_Q8_0)
WL_SCAN_BLOCKS(iq4_nl, WL_IQ4_NL)
WL_SCAN_BLOCKS(q2_k, WL_Q2_K)
WL_SCAN_BLOCKS(q3_k, WL_Q3_K)
WL_SCAN_BLOCKS(q4_k, WL_Q4_K)
WL_SCAN_BLOCKS(q5_k, WL_Q5_K)
WL_SCAN_BLOCKS(q6_k, WL_Q6_K)
