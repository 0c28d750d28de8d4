// The arithmetic of the attention kernels (attention.cu), shared with the host twin: how the
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

// Query heads one block takes at most for `head_dim`: 8, 4, 2 for 2, 4, 8 dims a lane. A
// KV group wider than that is taken by several blocks, each reading the group's K/V rows.
WL_HD int wl_att_block_heads(int head_dim) { return WL_ATT_HEADS(wl_att_lane_dims(head_dim)); }

// Keys per split when `n_keys` keys (those of the last query) are split `n_splits` ways.
WL_HD wl_u64 wl_att_split_keys(wl_u64 n_keys, wl_u64 n_splits) {
    return n_splits == 0 ? n_keys : (n_keys + n_splits - 1) / n_splits;
}

// Keys [lo, hi) of split `s` of `per` keys for a query that sees `total` keys (causal: query i
// at position start + i sees total = start + i + 1). An earlier query's last splits may be
// empty (lo >= hi).
WL_HD void wl_att_split_range(wl_u64 per, wl_u64 s, wl_u64 total, wl_u64* lo, wl_u64* hi) {
    wl_u64 a = s * per;
    wl_u64 b = a + per;
    *lo = a;
    *hi = b < total ? b : total;
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
