// dequantize_{type}_{f32,f16}: eight output values per thread (one 16-byte store of f16, two
// of f32), the block's scales decoded once for the eight (wl_dq8_<type>). One thread per value
// spent most of its time decoding the same scales again and made the q4_k prompt products wait
// on this kernel more than on their GEMMs. Block sizes come from wl_block_layout (checked
// against gguf-py by the host twin), folded to constants per kernel.
#include "wl_dequant.cuh"

#define WL_DQ_PER_THREAD 8

// Eight f16 values into p: one 16-byte store where p is 16-byte aligned (a scratch buffer's
// start, and every eighth value after it), else value by value.
__device__ __forceinline__ void wl_store8_f16(wl_u16* p, const float* v) {
    wl_u16 h[8];
    for (int k = 0; k < 8; ++k) h[k] = wl_f32_to_f16(v[k]);
    if (((wl_u64)p & 15) == 0) {
        uint4 u;
        u.x = (wl_u32)h[0] | ((wl_u32)h[1] << 16);
        u.y = (wl_u32)h[2] | ((wl_u32)h[3] << 16);
        u.z = (wl_u32)h[4] | ((wl_u32)h[5] << 16);
        u.w = (wl_u32)h[6] | ((wl_u32)h[7] << 16);
        *(uint4*)p = u;
    } else {
        for (int k = 0; k < 8; ++k) p[k] = h[k];
    }
}

__device__ __forceinline__ void wl_store8_f32(float* p, const float* v) {
    if (((wl_u64)p & 15) == 0) {
        *(float4*)p = make_float4(v[0], v[1], v[2], v[3]);
        *(float4*)(p + 4) = make_float4(v[4], v[5], v[6], v[7]);
    } else {
        for (int k = 0; k < 8; ++k) p[k] = v[k];
    }
}

// Thread t writes values 8t..8t + 7 of the n. A quantised tensor's n is whole blocks (a
// multiple of 32), so its eight share a block; a float tensor's last thread may have fewer
// than eight, which it writes one at a time.
#define WL_DEQUANT_TO(NAME, TY, OUT, OUT_T, CONV)                                                 \
    extern "C" __global__ void dequantize_##NAME##_##OUT(                                         \
        const wl_u8* __restrict__ src, OUT_T* __restrict__ dst, wl_u64 n) {                       \
        wl_u64 i0 = ((wl_u64)blockIdx.x * blockDim.x + threadIdx.x) * WL_DQ_PER_THREAD;           \
        if (i0 >= n) return;                                                                      \
        int bs, bb, o0, o1;                                                                       \
        wl_block_layout(TY, &bs, &bb, &o0, &o1);                                                  \
        if (i0 + WL_DQ_PER_THREAD <= n) {                                                         \
            float v[WL_DQ_PER_THREAD];                                                            \
            wl_dq8_##NAME(src + (i0 / (wl_u64)bs) * (wl_u64)bb, (int)(i0 % (wl_u64)bs), v);       \
            wl_store8_##OUT(dst + i0, v);                                                         \
        } else {                                                                                  \
            for (wl_u64 i = i0; i < n; ++i)                                                       \
                dst[i] = CONV(wl_dq_##NAME(src + (i / (wl_u64)bs) * (wl_u64)bb, (int)(i % (wl_u64)bs))); \
        }                                                                                         \
    }

#define WL_AS_F32(x) (x)
#define WL_DEQUANT(NAME, TY)                                \
    WL_DEQUANT_TO(NAME, TY, f32, float, WL_AS_F32)          \
    WL_DEQUANT_TO(NAME, TY, f16, wl_u16, wl_f32_to_f16)

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
