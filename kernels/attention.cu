// attention_{fmt}: causal grouped-query attention over the KV cache, with a running (online)
// softmax, so no score matrix is held. The cache rows are read in their storage format (f32,
// f16, e4m3, or Hadamard-turned q8/q4 groups; attention_q8_q4 is the q6 cache: K q8, V q4) and
// decoded as they are read, so no decoded copy of the cache exists.
//
// One block of WL_ATT_WARPS warps per (head, query); query i (at position start + i) meets keys
// 0..=start + i. Warp w takes keys w, w + WL_ATT_WARPS, ...: its lanes split the head's dims
// (lane l holds dims l, l + 32, ...), the dot product is a warp reduction, and the warp keeps its
// own running maximum m, sum l and weighted values acc. The warps' partial results are folded
// at the end: out = sum_w acc_w * e^(m_w - M) / sum_w l_w * e^(m_w - M), M the largest m_w.
// With f16_operands each query value and each weight is rounded to f16 first, as llama.cpp's
// CPU products meet an f16 cache (the CPU backend's reference does the same).
#include "wl_kv.cuh"

#define WL_ATT_WARPS 4
#define WL_ATT_MAX_HD 256
#define WL_ATT_PER_LANE (WL_ATT_MAX_HD / 32)

// Cache readers: `at(i, lane)` is value i of the cache half. The turned groups are decoded by
// the warp together: every lane of the warp calls `at` for the same group at once, lane l for
// value l of the group (the kernel's dims d = lane + 32 r with head_dim a multiple of 32), and
// the turn back is a butterfly over the lanes in the codec's order.
struct WlKvF32 {
    const float* p;
    __device__ __forceinline__ float at(wl_u64 i, int) const { return p[i]; }
};
struct WlKvF16 {
    const wl_u16* p;
    __device__ __forceinline__ float at(wl_u64 i, int) const { return wl_f16_to_f32(p[i]); }
};
struct WlKvE4M3 {
    const wl_u8* p;
    __device__ __forceinline__ float at(wl_u64 i, int) const { return wl_e4m3_decode(p[i]); }
};
template <int QMAX>
struct WlKvTurned {
    const wl_u8* p;
    __device__ __forceinline__ float at(wl_u64 i, int lane) const {
        float x = wl_kv_dequant(p + (i / 32) * (wl_u64)wl_kv_group_bytes(QMAX), lane, QMAX);
        for (int h = 1; h < 32; h *= 2) {
            float other = __shfl_xor_sync(0xffffffffu, x, h);
            // lane j (bit h clear) keeps a + b, lane j + h keeps a - b, as the codec's stage h
            x = (lane & h) ? WL_SUB(other, x) : WL_ADD(x, other);
        }
        return WL_MUL(x, wl_bits_to_f32(WL_KV_TURN_NORM));
    }
};

__device__ __forceinline__ float wl_att_round(float x) { return wl_f16_to_f32(wl_f32_to_f16(x)); }

template <typename K, typename V>
__device__ void wl_attention(const float* q, K k, V v, float* out, wl_u64 n_q,
                             wl_u64 start, wl_u64 n_heads, wl_u64 kv_heads, int head_dim,
                             float scale, int f16_operands) {
    __shared__ float s_acc[WL_ATT_WARPS][WL_ATT_MAX_HD];
    __shared__ float s_m[WL_ATT_WARPS];
    __shared__ float s_l[WL_ATT_WARPS];
    const int lane = threadIdx.x % 32;
    const int warp = threadIdx.x / 32;
    const wl_u64 h = blockIdx.x;
    const wl_u64 kh = h / (n_heads / kv_heads);
    const wl_u64 hd = (wl_u64)head_dim;
    const wl_u64 kvd = kv_heads * hd;
    const float neg_inf = wl_bits_to_f32(0xff800000u);
    for (wl_u64 i = blockIdx.y; i < n_q; i += gridDim.y) {
        const float* qi = q + (i * n_heads + h) * hd;
        float qr[WL_ATT_PER_LANE];
        float acc[WL_ATT_PER_LANE];
#pragma unroll
        for (int r = 0; r < WL_ATT_PER_LANE; r++) {
            int d = lane + 32 * r;
            float x = d < head_dim ? qi[d] : 0.0f;
            qr[r] = f16_operands ? wl_att_round(x) : x;
            acc[r] = 0.0f;
        }
        float m = neg_inf;
        float l = 0.0f;
        const wl_u64 total = start + i + 1;
        for (wl_u64 j = (wl_u64)warp; j < total; j += WL_ATT_WARPS) {
            const wl_u64 row = j * kvd + kh * hd;
            float s = 0.0f;
#pragma unroll
            for (int r = 0; r < WL_ATT_PER_LANE; r++) {
                int d = lane + 32 * r;
                if (d < head_dim) s = fmaf(qr[r], k.at(row + (wl_u64)d, lane), s);
            }
            for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
            s *= scale;
            float m_new = fmaxf(m, s);
            float keep = expf(m - m_new);
            float p = expf(s - m_new);
            if (f16_operands) p = wl_att_round(p);
            l = l * keep + p;
#pragma unroll
            for (int r = 0; r < WL_ATT_PER_LANE; r++) {
                int d = lane + 32 * r;
                if (d < head_dim) acc[r] = fmaf(p, v.at(row + (wl_u64)d, lane), acc[r] * keep);
            }
            m = m_new;
        }
#pragma unroll
        for (int r = 0; r < WL_ATT_PER_LANE; r++) {
            int d = lane + 32 * r;
            if (d < head_dim) s_acc[warp][d] = acc[r];
        }
        if (lane == 0) {
            s_m[warp] = m;
            s_l[warp] = l;
        }
        __syncthreads();
        float mm = neg_inf;
        for (int w = 0; w < WL_ATT_WARPS; w++) mm = fmaxf(mm, s_m[w]);
        float f[WL_ATT_WARPS];
        float ll = 0.0f;
        for (int w = 0; w < WL_ATT_WARPS; w++) {
            // a warp that met no key (fewer keys than warps) adds nothing
            f[w] = s_m[w] == neg_inf ? 0.0f : expf(s_m[w] - mm);
            ll += s_l[w] * f[w];
        }
        float inv = 1.0f / ll;
        float* o = out + (i * n_heads + h) * hd;
        for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
            float a = 0.0f;
            for (int w = 0; w < WL_ATT_WARPS; w++) a += s_acc[w][d] * f[w];
            o[d] = a * inv;
        }
        // the shared arrays are reused by the next query of this block
        __syncthreads();
    }
}

#define WL_ATTENTION(NAME, KT, KR, VT, VR)                                                         \
    extern "C" __global__ void attention_##NAME(const float* q, const KT* k, const VT* v, float* out, \
                                                wl_u64 n_q, wl_u64 start, wl_u64 n_heads,         \
                                                wl_u64 kv_heads, int head_dim, float scale,       \
                                                int f16_operands) {                               \
        wl_attention(q, KR{k}, VR{v}, out, n_q, start, n_heads, kv_heads, head_dim, scale,         \
                     f16_operands);                                                               \
    }

WL_ATTENTION(f32, float, WlKvF32, float, WlKvF32)
WL_ATTENTION(f16, wl_u16, WlKvF16, wl_u16, WlKvF16)
WL_ATTENTION(bf16, wl_u16, WlKvBf16, wl_u16, WlKvBf16)
WL_ATTENTION(e4m3, wl_u8, WlKvE4M3, wl_u8, WlKvE4M3)
WL_ATTENTION(q8, wl_u8, WlKvTurned<127>, wl_u8, WlKvTurned<127>)
WL_ATTENTION(q4, wl_u8, WlKvTurned<7>, wl_u8, WlKvTurned<7>)
WL_ATTENTION(q8_q4, wl_u8, WlKvTurned<127>, wl_u8, WlKvTurned<7>)
