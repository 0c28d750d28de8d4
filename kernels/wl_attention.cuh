// The arithmetic of the attention kernels (attention*.cu), shared with the host twin: how the
// keys are split across blocks, how many query heads a block takes, one key folded into a
// running softmax, and how running states (of warps, then of splits) are merged. The kernels
// and the host shim lay the work out differently (warps and lanes there, loops here) but call
// these for every rounding step, so both round alike; only expf may differ (CUDA's is within
// 2 ulp of libm's).
#pragma once
#include "wl_kv.cuh"

// Warps per block; warp w of a block takes keys lo + w, lo + w + WL_ATT_WARPS, ... of its split.
#define WL_ATT_WARPS 4
#define WL_ATT_THREADS (WL_ATT_WARPS * 32)
// The widest head (the lanes hold dims lane + 32 r, r < 8).
#define WL_ATT_MAX_HD 256
// Query values (and as many accumulators) one lane holds for all the heads of its block:
// heads per block × dims per lane. 16 of each keeps the kernel under 100 registers a thread.
#define WL_ATT_REGS 16
// The most query heads of one KV group that a block takes.
#define WL_ATT_MAX_GROUP 8
// The most key splits of one call (the reduce kernel holds one weight per split in shared
// memory; the plan reserves partial results for this many: weightlift-plan's workspace).
#define WL_ATT_MAX_SPLITS 128

// Dims per lane for a head of `head_dim` values: 2, 4 or 8 (ceil(head_dim / 32), rounded up to a
// power of two and at least 2, so the kernel instantiates three register layouts; heads of 32
// or fewer take the 2-dim layout with the second dim idle, which costs registers, not reads).
WL_HD int wl_att_lane_dims(int head_dim) {
    int r = (head_dim + 31) / 32;
    return r <= 2 ? 2 : (r <= 4 ? 4 : 8);
}

// Query heads one block takes at most with R dims a lane (a constant, for the kernel's
// template arguments).
#define WL_ATT_HEADS(R) (WL_ATT_REGS / (R) < WL_ATT_MAX_GROUP ? WL_ATT_REGS / (R) : WL_ATT_MAX_GROUP)

// Keys a decode warp reads ahead with R dims a lane (attention.cu): their K and V rows in
// flight together, at most 16 more registers a lane (2 · keys · R).
#define WL_ATT_KEYS_AHEAD(R) ((R) >= 8 ? 1 : 8 / (R))

// Query heads one block takes at most for `head_dim`: 8, 4, 2 for 2, 4, 8 dims a lane. A
// KV group wider than that is taken by several blocks, each reading the group's K/V rows.
WL_HD int wl_att_block_heads(int head_dim) { return WL_ATT_HEADS(wl_att_lane_dims(head_dim)); }

// Keys per split when `n_keys` keys (wl_att_where's) are split `n_splits` ways.
WL_HD wl_u64 wl_att_split_keys(wl_u64 n_keys, wl_u64 n_splits) {
    return n_splits == 0 ? n_keys : (n_keys + n_splits - 1) / n_splits;
}

// The first key query i (at position start + i) meets: past a sliding window of `window` keys,
// else 0.
WL_HD wl_u64 wl_fa_first_key(wl_u64 start, wl_u64 i, wl_u64 window) {
    return window != 0 && start + i + 1 > window ? start + i + 1 - window : 0;
}

// Where a call's queries are and which keys its splits cut: `keys` keys from position `base`,
// the first query's window start (0 without a window), so a sliding-window layer's splits cover
// its window's keys rather than every position before it (each later query's window starts
// later still, and its keys end later: the splits reach them). A call given its first position
// by the host (`pos` null) splits the keys from `base` to its last query, `start + n_q`. A call
// that reads it from device memory (`pos`: the i32 positions RoPE reads, pos[0] the first
// query's) splits `span` keys from `base`, so its grid and splits stay the same at every
// position and a captured graph replays at any: the splits past the current length are empty.
// Writes the first query's position, the first key split and the keys split; 0 when the
// position read is negative or its queries see more than `span` keys from `base` (the call then
// computes nothing).
WL_HD int wl_att_where(const int* pos, wl_u64 start_arg, wl_u64 n_q, wl_u64 window, wl_u64 span,
                       wl_u64* start, wl_u64* base, wl_u64* keys) {
    if (pos == 0) {
        *start = start_arg;
        *base = wl_fa_first_key(start_arg, 0, window);
        *keys = start_arg + n_q - *base;
        return 1;
    }
    const int p = pos[0];
    if (p < 0) return 0;
    const wl_u64 first = wl_fa_first_key((wl_u64)p, 0, window);
    if ((wl_u64)p + n_q - first > span) return 0;
    *start = (wl_u64)p;
    *base = first;
    *keys = span;
    return 1;
}

// The splits of `per` keys from `base` holding at least one key of a query whose keys end
// before position `end`: the first ceil((end - base) / per), at most n_splits. The blocks of the
// later, empty, splits exit before they write anything, and the reduce merges only these.
WL_HD wl_u64 wl_att_live_splits(wl_u64 per, wl_u64 base, wl_u64 end, wl_u64 n_splits) {
    const wl_u64 total = end > base ? end - base : 0;
    const wl_u64 n = per == 0 ? 0 : (total + per - 1) / per;
    return n < n_splits ? n : n_splits;
}

// Keys [lo, hi) that split `s` of `per` keys from `base` folds for query i (at position
// start + i: causal, it sees keys up to start + i, and with a window only the last `window` of
// them). An earlier query's last splits may be empty (lo >= hi), and so may a later query's
// first ones, whose keys come before its own window.
WL_HD void wl_att_split_range(wl_u64 per, wl_u64 s, wl_u64 base, wl_u64 start, wl_u64 i,
                              wl_u64 window, wl_u64* lo, wl_u64* hi) {
    const wl_u64 end = start + i + 1;
    const wl_u64 first = wl_fa_first_key(start, i, window);
    const wl_u64 a = base + s * per;
    const wl_u64 b = a + per;
    *lo = a < first ? first : a;
    *hi = b < end ? b : end;
}

// x rounded to f16 and back (the f16_operands rule: llama.cpp's CPU products convert the f32
// operand to an f16 cache's type). On the device it is the conversion instruction pair (round
// to nearest even, as wl_f32_to_f16; only a NaN's payload may differ): the bit-by-bit form,
// inlined for every head of the kernel's four register layouts, made ptxas spend most of a
// minute on the module.
WL_HD float wl_att_round(float x) {
#if defined(__CUDA_ARCH__)
    unsigned short h;
    float y;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
    asm("cvt.f32.f16 %0, %1;" : "=f"(y) : "h"(h));
    return y;
#else
    return wl_f16_to_f32(wl_f32_to_f16(x));
#endif
}

// One key of (already scaled) score `s` folded into the running maximum `m` and sum `l`:
// `keep` rescales the accumulators, `p` weighs the key's value row (acc = p * v + acc * keep).
WL_HD void wl_att_step(float s, int f16_operands, float* m, float* l, float* keep, float* p) {
    float m_new = fmaxf(*m, s);
    float k = expf(WL_SUB(*m, m_new));
    float q = expf(WL_SUB(s, m_new));
    if (f16_operands) q = wl_att_round(q);
    *l = fmaf(*l, k, q);
    *m = m_new;
    *keep = k;
    *p = q;
}

// One accumulator after a key: p * v + acc * keep (the product of acc and keep rounded first).
WL_HD float wl_att_accumulate(float acc, float keep, float p, float v) {
    return fmaf(p, v, WL_MUL(acc, keep));
}

// The weight of a running state of maximum m in a merge whose largest maximum is `mm`: a state
// that met no key (m = -inf: a warp past its split's end, an empty split) adds nothing.
WL_HD float wl_att_merge_factor(float m, float mm) {
    return m == wl_bits_to_f32(0xff800000u) ? 0.0f : expf(WL_SUB(m, mm));
}

// The largest of n maxima at stride `stride`.
WL_HD float wl_att_merge_max(const float* m, int n, int stride) {
    float mm = wl_bits_to_f32(0xff800000u);
    for (int w = 0; w < n; w++) mm = fmaxf(mm, m[w * stride]);
    return mm;
}

// Partial results of split `s` of (query i, head h) in the scratch of a split call of `n_q`
// queries, `n_heads` heads and `n_splits` splits: its `head_dim` unnormalised accumulators
// start at value wl_att_part_acc(...), its maximum and sum at wl_att_part_ml(...) and + 1. The
// scratch holds n_q * n_heads * n_splits * (head_dim + 2) values (the accumulators first, so
// every split's row starts where the row before it ends).
WL_HD wl_u64 wl_att_part_record(wl_u64 i, wl_u64 h, wl_u64 s, wl_u64 n_heads, wl_u64 n_splits) {
    return (i * n_heads + h) * n_splits + s;
}
WL_HD wl_u64 wl_att_part_acc(wl_u64 rec, int head_dim) { return rec * (wl_u64)head_dim; }
WL_HD wl_u64 wl_att_part_ml(wl_u64 rec, wl_u64 n_q, wl_u64 n_heads, wl_u64 n_splits,
                            int head_dim) {
    return n_q * n_heads * n_splits * (wl_u64)head_dim + 2 * rec;
}

// ---- Prompt attention (attention_prefill_{fmt}): the flash-attention tiling. ----
//
// The rows of one KV head are the (query, query head) pairs of its group, row r = i * group + g
// (query i, head kh * group + g); a block takes WL_FA_ROWS(R) consecutive rows, so the K/V tiles
// it stages in shared memory meet every head of the group and several queries at once. Keys
// are folded in tiles of WL_FA_KEYS, aligned to multiples of it from key 0, in ascending order;
// in a tile, lane j scores key 32 t + j, and each row's running state takes the whole tile in
// one update (wl_fa_*), so the host twin replays the same sums.

// Keys per K/V tile (one a lane when scoring).
#define WL_FA_KEYS 32
// The widest head the prompt kernel takes; wider heads (gemma's 256) take attention_{fmt}.
#define WL_FA_MAX_HD 128
// Rows a block takes with R dims a lane: 32 for heads up to 64 values, 16 up to 128 (the
// staged queries stay at 2,048 floats; each warp holds WL_FA_ROWS(R) / 4 rows' accumulators).
#define WL_FA_ROWS(R) ((R) <= 2 ? 32 : 16)
// Floats of staged queries, keys (one more than a row per key, so the lanes of a score read
// different banks) and values in one block's shared memory: at most 41 KiB.
#define WL_FA_Q_FLOATS 2048
#define WL_FA_K_FLOATS (WL_FA_KEYS * (WL_FA_MAX_HD + 1))
#define WL_FA_V_FLOATS (WL_FA_KEYS * WL_FA_MAX_HD)

// Rows a block takes for heads of `head_dim` (the host sizes the grid with the same rule).
WL_HD int wl_fa_rows(int head_dim) { return WL_FA_ROWS(wl_att_lane_dims(head_dim)); }

// A key's weight before the softmax from its dot product `t`: scaled, then soft-capped
// (gemma2: softcap * tanh(w / softcap)) when softcap > 0, as attention_{fmt} does.
WL_HD float wl_fa_weight(float t, float scale, float softcap) {
    float w = WL_MUL(t, scale);
    if (softcap > 0.0f) w = WL_MUL(softcap, tanhf(w / softcap));
    return w;
}

// A key of weight `w` (valid: inside the row's causal and window range) in a tile whose row
// maximum becomes `m_new`: its unnormalised probability, rounded to f16 with f16_operands.
WL_HD float wl_fa_p(float w, int valid, float m_new, int f16_operands) {
    if (!valid) return 0.0f;
    float p = expf(WL_SUB(w, m_new));
    return f16_operands ? wl_att_round(p) : p;
}

// A row's running state after one tile: `keep` rescales what it had, `psum` is the tile's
// probabilities summed (the lanes' xor butterfly).
WL_HD float wl_fa_keep(float m, float m_new) { return expf(WL_SUB(m, m_new)); }
WL_HD float wl_fa_sum(float l, float keep, float psum) { return fmaf(l, keep, psum); }
