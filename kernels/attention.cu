// attention_{f32,f16}: causal grouped-query attention over the KV cache, with a running
// (online) softmax, so no score matrix is held.
//
// One block of WL_ATT_WARPS warps per (head, query); query i (at position start + i) meets keys
// 0..=start + i. Warp w takes keys w, w + WL_ATT_WARPS, ...: its lanes split the head's dims
// (lane l holds dims l, l + 32, ...), the dot product is a warp reduction, and the warp keeps its
// own running maximum m, sum l and weighted values acc. The warps' partial results are folded
// at the end: out = sum_w acc_w * e^(m_w - M) / sum_w l_w * e^(m_w - M), M the largest m_w.
// With f16_operands each query value and each weight is rounded to f16 first, as llama.cpp's
// CPU products meet an f16 cache (the CPU backend's reference does the same).
#include "wl_common.cuh"

#define WL_ATT_WARPS 4
#define WL_ATT_MAX_HD 256
#define WL_ATT_PER_LANE (WL_ATT_MAX_HD / 32)

__device__ __forceinline__ float wl_att_load(const float* p, wl_u64 i) { return p[i]; }
__device__ __forceinline__ float wl_att_load(const wl_u16* p, wl_u64 i) { return wl_f16_to_f32(p[i]); }
__device__ __forceinline__ float wl_att_round(float x) { return wl_f16_to_f32(wl_f32_to_f16(x)); }

template <typename T>
__device__ void wl_attention(const float* q, const T* k, const T* v, float* out, wl_u64 n_q,
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
                if (d < head_dim) s = fmaf(qr[r], wl_att_load(k, row + (wl_u64)d), s);
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
                if (d < head_dim) acc[r] = fmaf(p, wl_att_load(v, row + (wl_u64)d), acc[r] * keep);
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

extern "C" __global__ void attention_f32(const float* q, const float* k, const float* v, float* out,
                                         wl_u64 n_q, wl_u64 start, wl_u64 n_heads, wl_u64 kv_heads,
                                         int head_dim, float scale, int f16_operands) {
    wl_attention<float>(q, k, v, out, n_q, start, n_heads, kv_heads, head_dim, scale, f16_operands);
}

extern "C" __global__ void attention_f16(const float* q, const wl_u16* k, const wl_u16* v,
                                         float* out, wl_u64 n_q, wl_u64 start, wl_u64 n_heads,
                                         wl_u64 kv_heads, int head_dim, float scale,
                                         int f16_operands) {
    wl_attention<wl_u16>(q, k, v, out, n_q, start, n_heads, kv_heads, head_dim, scale, f16_operands);
}
