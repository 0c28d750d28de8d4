// RoPE fused with the KV-cache store (kv.cu's rope_kv_store_{format}), shared with the host
// shim: one work unit per thread, so the kernel is a thin wrapper and the host twin replays it
// unit by unit (no unit reads what another writes, so any order gives the same bytes).
// The units of one call, in order:
// - a rotated pair of the queries (n_tok * n_heads * n_dims / 2), turned in place with the
//   arithmetic of rope_inplace_{norm,neox}_f32 (ops.cu): theta = pos * freqs[i], then
//   (a cos - b sin, a sin + b cos), never contracted;
// - a value (f32, f16, bf16, e4m3) or group of 32 values (q8, q4) of the keys' cache rows: each
//   key value rotated as that kernel rotates it (wl_rope_value: the same expression over the
//   unrotated pair, which stays unwritten), then encoded as kv_store_{format} (or the f32 copy
//   and the f16 conversion) encodes it;
// - a value or group of the values' cache rows, encoded as it is.
#pragma once
#include "wl_kv.cuh"

// Cache storage codes of the fused kernels (KvFormat's order).
#define WL_KVF_F32 0
#define WL_KVF_F16 1
#define WL_KVF_BF16 2
#define WL_KVF_E4M3 3
#define WL_KVF_Q8 4
#define WL_KVF_Q4 5

// Values per work unit of a cache format: a group of 32 for the turned quantised ones.
WL_HD int wl_kvf_granule(int f) { return f >= WL_KVF_Q8 ? 32 : 1; }

// Dim d of one head `xh` after RoPE at position p with the per-pair angles `freqs` (n_dims
// rotated dims, NeoX pairing when `neox`): dims past n_dims pass through.
WL_HD float wl_rope_value(const float* xh, int d, float p, const float* freqs, int n_dims,
                          int neox, float mscale) {
    if (d >= n_dims) return xh[d];
    int half = n_dims / 2;
    int i = neox ? (d < half ? d : d - half) : d / 2;
    int first = neox ? d < half : (d % 2) == 0;
    int ia = neox ? i : 2 * i;
    int ib = neox ? i + half : 2 * i + 1;
    float theta = WL_MUL(p, freqs[i]);
    float c = WL_MUL(cosf(theta), mscale), s = WL_MUL(sinf(theta), mscale);
    float a = xh[ia], b = xh[ib];
    return first ? WL_SUB(WL_MUL(a, c), WL_MUL(b, s)) : WL_ADD(WL_MUL(a, s), WL_MUL(b, c));
}

// Value i of a per-value cache format `f` (f32, f16, bf16, e4m3) written as kv_store_{format},
// the f32 copy or convert_f32_f16 writes it: the same bits, stored little-endian byte by byte
// (the cache rows are one byte buffer for every format; no pointer is cast to a wider type).
WL_HD void wl_kvf_put(int f, wl_u8* out, wl_u64 i, float x) {
    if (f == WL_KVF_F32) {
        wl_u32 b = wl_f32_to_bits(x);
        wl_u8* p = out + 4 * i;
        p[0] = (wl_u8)(b & 0xffu);
        p[1] = (wl_u8)((b >> 8) & 0xffu);
        p[2] = (wl_u8)((b >> 16) & 0xffu);
        p[3] = (wl_u8)(b >> 24);
    } else if (f == WL_KVF_F16 || f == WL_KVF_BF16) {
        wl_u16 h = f == WL_KVF_F16 ? wl_f32_to_f16(x) : wl_kv_store_bf16(x);
        out[2 * i] = (wl_u8)(h & 0xffu);
        out[2 * i + 1] = (wl_u8)(h >> 8);
    } else {
        out[i] = wl_e4m3_encode(x);
    }
}

// The shape of one call: n_tok tokens of n_heads query heads and kv_heads key/value heads of
// head_dim values, n_dims of them rotated. `cap` 0: kc and vc are the n_tok cache rows being
// written (token t at row t); else they are whole cache layers of `cap` rows and token t goes
// to row pos[t] % cap (wl_kv_cache_row: a sliding-window layer's ring; a layer of every
// position has cap past its positions), pos read on the device, so a captured graph replays at
// any position.
typedef struct {
    wl_u64 n_tok, n_heads, kv_heads;
    int head_dim, n_dims, neox;
    float mscale;
    wl_u64 cap;
} wl_rope_kv_shape;

// The value index in kc (or vc) of value e of the call's keys (or values): its token's row
// (see wl_rope_kv_shape), then its place in the row; -1 for a token at a negative position,
// which writes nothing (the host cannot check positions it does not read).
WL_HD long long wl_rope_kv_at(const int* pos, wl_rope_kv_shape s, wl_u64 e) {
    wl_u64 kvd = s.kv_heads * (wl_u64)s.head_dim;
    wl_u64 tok = e / kvd;
    if (s.cap == 0) return (long long)e;
    int p = pos[tok];
    if (p < 0) return -1;
    return (long long)(wl_kv_cache_row((wl_u64)p, s.cap) * kvd + e % kvd);
}

// Work units of one call: query pairs, then key units, then value units.
WL_HD wl_u64 wl_rope_kv_units(wl_rope_kv_shape s, int kf, int vf) {
    wl_u64 kvn = s.n_tok * s.kv_heads * (wl_u64)s.head_dim;
    return s.n_tok * s.n_heads * (wl_u64)(s.n_dims / 2) + kvn / (wl_u64)wl_kvf_granule(kf) +
           kvn / (wl_u64)wl_kvf_granule(vf);
}

// Key value e of the call (token-major rows of kv_heads * head_dim) after RoPE.
WL_HD float wl_rope_key(const float* k, const int* pos, const float* freqs, wl_rope_kv_shape s,
                        wl_u64 e) {
    wl_u64 kvd = s.kv_heads * (wl_u64)s.head_dim;
    wl_u64 tok = e / kvd, head = (e % kvd) / (wl_u64)s.head_dim;
    int d = (int)(e % (wl_u64)s.head_dim);
    return wl_rope_value(k + tok * kvd + head * (wl_u64)s.head_dim, d, (float)pos[tok], freqs,
                         s.n_dims, s.neox, s.mscale);
}

// Work unit u of one call with keys stored as kf and values as vf (see the top of this file).
WL_HD void wl_rope_kv_unit(wl_u64 u, int kf, int vf, float* q, const float* k, const float* v,
                           const int* pos, const float* freqs, wl_u8* kc, wl_u8* vc,
                           wl_rope_kv_shape s) {
    int half = s.n_dims / 2;
    wl_u64 nq = s.n_tok * s.n_heads * (wl_u64)half;
    wl_u64 kvn = s.n_tok * s.kv_heads * (wl_u64)s.head_dim;
    if (u < nq) {
        // rope_inplace's thread for pair i of one query head
        wl_u64 head = u / (wl_u64)half;
        int i = (int)(u % (wl_u64)half);
        wl_u64 tok = head / s.n_heads;
        float* xh = q + head * (wl_u64)s.head_dim;
        float theta = WL_MUL((float)pos[tok], freqs[i]);
        float c = WL_MUL(cosf(theta), s.mscale), sn = WL_MUL(sinf(theta), s.mscale);
        int ia = s.neox ? i : 2 * i;
        int ib = s.neox ? i + half : 2 * i + 1;
        float a = xh[ia], b = xh[ib];
        xh[ia] = WL_SUB(WL_MUL(a, c), WL_MUL(b, sn));
        xh[ib] = WL_ADD(WL_MUL(a, sn), WL_MUL(b, c));
        return;
    }
    u -= nq;
    wl_u64 nk = kvn / (wl_u64)wl_kvf_granule(kf);
    if (u < nk) {
        // a group of 32 stays inside its row (the cache rows are whole groups)
        long long at = wl_rope_kv_at(pos, s, u * (wl_u64)wl_kvf_granule(kf));
        if (at < 0) return;
        if (kf >= WL_KVF_Q8) {
            float g[32];
            for (int j = 0; j < 32; ++j) g[j] = wl_rope_key(k, pos, freqs, s, u * 32 + (wl_u64)j);
            int qmax = kf == WL_KVF_Q8 ? 127 : 7;
            wl_kv_store_group(g, kc + (wl_u64)at / 32 * (wl_u64)wl_kv_group_bytes(qmax), qmax);
        } else {
            wl_kvf_put(kf, kc, (wl_u64)at, wl_rope_key(k, pos, freqs, s, u));
        }
        return;
    }
    u -= nk;
    long long at = wl_rope_kv_at(pos, s, u * (wl_u64)wl_kvf_granule(vf));
    if (at < 0) return;
    if (vf >= WL_KVF_Q8) {
        int qmax = vf == WL_KVF_Q8 ? 127 : 7;
        wl_kv_store_group(v + u * 32, vc + (wl_u64)at / 32 * (wl_u64)wl_kv_group_bytes(qmax), qmax);
    } else {
        wl_kvf_put(vf, vc, (wl_u64)at, v[u]);
    }
}
