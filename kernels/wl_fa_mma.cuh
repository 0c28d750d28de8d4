// The lane arithmetic of attention_prefill_mma_{fmt} (attention_prefill_mma.cu), shared with the
// host twin: which matrix element each lane's registers hold in an m16n8k16 tensor-core product,
// where the block's staged queries, keys and values sit in shared memory, how a lane's fragments
// are read from there, and each lane's share of a tile's online-softmax step. The kernel runs these
// with the warp's shuffles between them; the twin replays 32 lanes with the shuffles as sums over
// the 4 lanes of a row and the products built through the same maps.
//
// Fragments of mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 (PTX ISA), lane l,
// g = l / 4, t = l % 4; a .b32 register holds two f16, the lower-indexed element in its low
// half:
//   A (16 x 16, row-major), four registers: a[0] row g, cols 2t, 2t + 1; a[1] row g + 8, the
//     same cols; a[2] row g, cols 8 + 2t, 8 + 2t + 1; a[3] row g + 8, those cols.
//   B (16 x 8, col-major; element (k, n)), two registers: b[0] n = g, k = 2t, 2t + 1; b[1]
//     n = g, k = 8 + 2t, 8 + 2t + 1.
//   C and D (16 x 8, f32), four registers: c[0] (g, 2t), c[1] (g, 2t + 1), c[2] (g + 8, 2t),
//     c[3] (g + 8, 2t + 1).
#pragma once
#include "wl_attention.cuh"

// Rows a block takes (four warps of 16 rows), and rows a warp takes (one A fragment's).
#define WL_FAM_ROWS 64
#define WL_FAM_WARP_ROWS 16
// The widest head (head_dim 64 or 128: whole k-steps of 16 and 8-dim output blocks).
#define WL_FAM_MAX_HD 128
// Words (f16 pairs) of padding after each staged row: a row of 32 or 64 words would put the 8
// rows a fragment load meets on one bank; 4 more spreads them over 8 × 4 banks.
#define WL_FAM_PAD 4
// Words of the staged queries (64 rows of up to 64 pairs), keys (32 rows) and transposed
// values (up to 128 dims of 16 key pairs): 35 KiB in all.
#define WL_FAM_Q_WORDS (WL_FAM_ROWS * (WL_FAM_MAX_HD / 2 + WL_FAM_PAD))
#define WL_FAM_K_WORDS (WL_FA_KEYS * (WL_FAM_MAX_HD / 2 + WL_FAM_PAD))
#define WL_FAM_V_WORDS (WL_FAM_MAX_HD * (WL_FA_KEYS / 2 + WL_FAM_PAD))

// ---- The fragment maps ----

// A: the row and column of half `hf` (0 low, 1 high) of register `reg` of lane `lane`.
WL_HD int wl_mma_a_row(int lane, int reg) { return lane / 4 + 8 * (reg & 1); }
WL_HD int wl_mma_a_col(int lane, int reg, int hf) { return 2 * (lane % 4) + 8 * (reg >> 1) + hf; }
// B: element (k, n) of half `hf` of register `reg`.
WL_HD int wl_mma_b_k(int lane, int reg, int hf) { return 2 * (lane % 4) + 8 * reg + hf; }
WL_HD int wl_mma_b_n(int lane) { return lane / 4; }
// C and D: wl_mma_c_row and wl_mma_c_col (wl_common.cuh), the layout every m16n8 shape shares.

// x as f16 bits, rounded to nearest even (wl_att_round's rounding: the same instruction on the
// device).
WL_HD wl_u16 wl_fam_half(float x) {
#if defined(__CUDA_ARCH__)
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
    return h;
#else
    return wl_f32_to_f16(x);
#endif
}

// Two values as one register of f16 pairs, `lo` the lower-indexed element.
WL_HD wl_u32 wl_fam_pack(float lo, float hi) {
    return (wl_u32)wl_fam_half(lo) | ((wl_u32)wl_fam_half(hi) << 16);
}

// ---- Shared memory: word indices ----

// The word of staged query row `row` (of the block's 64) holding dims d and d + 1 (d even):
// rows along the dims, as A wants them.
WL_HD int wl_fam_q_word(int row, int d, int head_dim) {
    return row * (head_dim / 2 + WL_FAM_PAD) + d / 2;
}
// The word of key `key` (of the tile's 32) holding dims d and d + 1 (d even): each key's dims
// in order, as B (k = dim, n = key) wants them for S = Q K^T.
WL_HD int wl_fam_k_word(int key, int d, int head_dim) {
    return key * (head_dim / 2 + WL_FAM_PAD) + d / 2;
}
// The word of dim `d` holding keys `key` and key + 1 (key even) of the tile's values: the
// values transposed, so B (k = key, n = dim) of O += P V is one word a register.
WL_HD int wl_fam_v_word(int d, int key) { return d * (WL_FA_KEYS / 2 + WL_FAM_PAD) + key / 2; }

// ---- Fragment loads ----

// Lane `lane`'s A fragment of k-step `ks` (dims 16 ks ..) of the warp's 16 query rows, whose
// first row is staged row `row0`.
WL_HD void wl_fam_q_frag(const wl_u32* sq, int row0, int head_dim, int lane, int ks, wl_u32 a[4]) {
    for (int reg = 0; reg < 4; reg++) {
        a[reg] = sq[wl_fam_q_word(row0 + wl_mma_a_row(lane, reg),
                                  16 * ks + wl_mma_a_col(lane, reg, 0), head_dim)];
    }
}
// Lane `lane`'s B fragment of S's n-block `nb` (keys 8 nb ..) and k-step `ks`.
WL_HD void wl_fam_k_frag(const wl_u32* sk, int head_dim, int lane, int nb, int ks, wl_u32 b[2]) {
    for (int reg = 0; reg < 2; reg++) {
        b[reg] = sk[wl_fam_k_word(8 * nb + wl_mma_b_n(lane), 16 * ks + wl_mma_b_k(lane, reg, 0),
                                  head_dim)];
    }
}
// Lane `lane`'s B fragment of O's n-block `db` (dims 8 db ..) and k-step `kk` (keys 16 kk ..).
WL_HD void wl_fam_v_frag(const wl_u32* svt, int lane, int db, int kk, wl_u32 b[2]) {
    for (int reg = 0; reg < 2; reg++) {
        b[reg] = svt[wl_fam_v_word(8 * db + wl_mma_b_n(lane), 16 * kk + wl_mma_b_k(lane, reg, 0))];
    }
}
// P's A fragment of k-step `kk` from the probabilities `p` in S's accumulator layout (four
// n-blocks of four registers): n-blocks 2 kk and 2 kk + 1 hold, register for register, the
// rows and keys of A's k-step kk, so the probabilities stay in the lane that computed them.
WL_HD void wl_fam_p_frag(const float p[16], int kk, wl_u32 a[4]) {
    const float* lo = p + 4 * (2 * kk);
    const float* hi = p + 4 * (2 * kk + 1);
    a[0] = wl_fam_pack(lo[0], lo[1]);
    a[1] = wl_fam_pack(lo[2], lo[3]);
    a[2] = wl_fam_pack(hi[0], hi[1]);
    a[3] = wl_fam_pack(hi[2], hi[3]);
}

// ---- A tile's online-softmax step, one lane's share ----
//
// A lane holds two rows of the warp: row g (half 0, S registers 0 and 1 of each n-block) and
// row g + 8 (half 1, registers 2 and 3), 8 keys of the tile each. The rows' running maximum m,
// sum l and the accumulators are the same in the 4 lanes of a row.

// The scores `s` (S's accumulators for keys t0 ..) turned into weights in place
// (wl_fa_weight), -inf where the key is outside the row's causal range, window or the block's
// keys (key_end); `qi` holds the query of each half's row. Writes each half's largest weight
// among the lane's 8 (the row's maximum is then the largest of its 4 lanes').
WL_HD void wl_fam_weigh(float s[16], int lane, wl_u64 t0, const wl_u64 qi[2], wl_u64 start,
                        wl_u64 window, wl_u64 key_end, float scale, float softcap, float mx[2]) {
    const float neg_inf = wl_bits_to_f32(0xff800000u);
    mx[0] = neg_inf;
    mx[1] = neg_inf;
    for (int nb = 0; nb < 4; nb++) {
        for (int reg = 0; reg < 4; reg++) {
            const int hf = reg >> 1;
            const wl_u64 i = qi[hf];
            const wl_u64 j = t0 + (wl_u64)(8 * nb + wl_mma_c_col(lane, reg));
            const int valid = j < start + i + 1 && j >= wl_fa_first_key(start, i, window) &&
                              j < key_end;
            const float w = valid ? wl_fa_weight(s[4 * nb + reg], scale, softcap) : neg_inf;
            s[4 * nb + reg] = w;
            mx[hf] = fmaxf(mx[hf], w);
        }
    }
}

// The weights `s` turned into probabilities in place (wl_fa_p, f16-rounded), against each
// half's new maximum m_new = max(m, tile maximum `mt`): a row that has met no key yet
// (m_new = -inf) takes none (its probabilities 0, keep 1: its accumulators stay 0). Writes
// m_new, keep (wl_fa_keep: what the row's sum and accumulators are scaled by) and each half's
// sum of the lane's 8 probabilities.
WL_HD void wl_fam_probs(float s[16], const float m[2], const float mt[2], float m_new[2],
                        float keep[2], float ps[2]) {
    const float neg_inf = wl_bits_to_f32(0xff800000u);
    for (int hf = 0; hf < 2; hf++) {
        m_new[hf] = fmaxf(m[hf], mt[hf]);
        keep[hf] = m_new[hf] == neg_inf ? 1.0f : wl_fa_keep(m[hf], m_new[hf]);
        ps[hf] = 0.0f;
    }
    for (int nb = 0; nb < 4; nb++) {
        for (int reg = 0; reg < 4; reg++) {
            const int hf = reg >> 1;
            const float w = s[4 * nb + reg];
            const float p = m_new[hf] == neg_inf ? 0.0f : wl_fa_p(w, w != neg_inf, m_new[hf], 1);
            s[4 * nb + reg] = p;
            ps[hf] = WL_ADD(ps[hf], p);
        }
    }
}

// The rows' running state after the tile: the sum (wl_fa_sum with the row's probability sum
// `psum`, the 4 lanes' sums added) and the maximum; a row with no key yet keeps both.
WL_HD void wl_fam_fold(float m[2], float l[2], const float m_new[2], const float keep[2],
                       const float psum[2]) {
    const float neg_inf = wl_bits_to_f32(0xff800000u);
    for (int hf = 0; hf < 2; hf++) {
        if (m_new[hf] == neg_inf) continue;
        l[hf] = wl_fa_sum(l[hf], keep[hf], psum[hf]);
        m[hf] = m_new[hf];
    }
}

// One 8-dim block of O's accumulators scaled by their rows' keep, before the tile's P V adds.
WL_HD void wl_fam_rescale(float o[4], const float keep[2]) {
    for (int reg = 0; reg < 4; reg++) o[reg] = WL_MUL(o[reg], keep[reg >> 1]);
}
