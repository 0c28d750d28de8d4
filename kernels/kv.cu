// The KV cache's storage formats (see the Rust codec `KvFormat`): kv_store_{fmt} encodes n f32
// values into cache bytes, kv_load_{fmt} decodes them. e4m3 and bf16: one thread per value.
// q8/q4: one thread per group of 32, turned by the Walsh-Hadamard transform before quantising
// and after dequantising. f32 and f16 are plain copies and conversions, launched from other
// modules. rope_kv_store_{format} (at the end) is a layer's RoPE and cache store in one launch.
#include "wl_rope_kv.cuh"

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

// rope_kv_store_{format}(q, k, v, pos, freqs, kc, vc, n_tok, n_heads, kv_heads, head_dim,
// n_dims, neox, mscale, cap): a decoder layer's RoPE on its queries and keys and its cache store in one
// launch, where rope_inplace twice and kv_store (or the copy, or the conversion) twice took
// four: the queries turned in place, the keys turned on their way into the cache rows kc (left
// unrotated in k), the values stored into vc, all with the arithmetic of those kernels (so the
// same bits). One thread per work unit of wl_rope_kv.cuh. `format` names the cache dtype, as
// the attention kernels do: q8_q4 is q8 keys with q4 values. `cap` 0: kc and vc are the rows
// being written; else whole cache layers of `cap` rows, each token written at the row of its
// position (wl_rope_kv_shape: a sliding-window layer's ring). Bytes per call: q read and
// written, k and v read, the cache rows written; a decode step's few KB make it a launch.
#define WL_ROPE_KV(NAME, KF, VF)                                                                   \
    extern "C" __global__ void rope_kv_store_##NAME(                                               \
        float* q, const float* k, const float* v, const int* pos, const float* freqs, wl_u8* kc,   \
        wl_u8* vc, wl_u64 n_tok, wl_u64 n_heads, wl_u64 kv_heads, int head_dim, int n_dims,        \
        int neox, float mscale, wl_u64 cap) {                                                      \
        wl_rope_kv_shape s = {n_tok, n_heads, kv_heads, head_dim, n_dims, neox, mscale, cap};      \
        wl_u64 u = (wl_u64)blockIdx.x * blockDim.x + threadIdx.x;                                  \
        if (u >= wl_rope_kv_units(s, KF, VF)) return;                                              \
        wl_rope_kv_unit(u, KF, VF, q, k, v, pos, freqs, kc, vc, s);                                \
    }

WL_ROPE_KV(f32, WL_KVF_F32, WL_KVF_F32)
WL_ROPE_KV(f16, WL_KVF_F16, WL_KVF_F16)
WL_ROPE_KV(bf16, WL_KVF_BF16, WL_KVF_BF16)
WL_ROPE_KV(e4m3, WL_KVF_E4M3, WL_KVF_E4M3)
WL_ROPE_KV(q8, WL_KVF_Q8, WL_KVF_Q8)
WL_ROPE_KV(q4, WL_KVF_Q4, WL_KVF_Q4)
WL_ROPE_KV(q8_q4, WL_KVF_Q8, WL_KVF_Q4)
