// The lane arithmetic of q8_mma_{type} (matvec.cu), the Q8 mode's prompt product on int8
// tensor cores, shared with the host twin: the m16n8k32 s8 fragment maps, where a block's
// staged weight and activation groups sit in shared memory, how a lane's fragments are read
// from there, and a lane's share of a group's epilogue. The kernel runs these with mma.sync
// between them; the twin replays the 32 lanes with the products built through the same maps.
//
// The arithmetic is the Q8 mode's (wl_q8.cuh) per (token t, weight row r) and 32-value group g:
// isum = the exact integer dot of the row's 32 values (wl_q8w_{type}'s words, lane j's word
// being values 4j..4j+3) with the token's 32 quants, then, in group order,
//   acc   = fma(dw * xd, isum, acc)            (dw the group's weight scale, xd the block's)
//   extra = extra +- (mw * xd) * xsum          (Q4_1 and Q5_1 add, Q4_K subtracts; xsum the
//                                               activation block's sum of quants)
// and y = acc + extra. The integer dot is the tensor core's (exact: 32 products of at most
// 2^14 each). This is the order of the CPU's Q8 prompt tiles (cpu/matvec.rs, past its batch of
// 16 tokens), so for those prompts the route gives the CPU's bits; q8_matmul_{type} and the
// CPU's matvec and batch (wl_q8_finish) instead keep 8 lane chains of 4 values each and add
// them in a tree, so the route differs from them in the float additions only, never in a
// product's terms (within the Q8 mode's bound, not bit-equal). Q6_K's scales are per 16
// values, so its groups take two products, one per half (the other half's registers zero), and
// two terms in acc, first half first.
//
// Fragments of mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 (PTX ISA), lane l, g = l / 4,
// t = l % 4; a .b32 register holds four s8, the lowest-indexed element in its low byte:
//   A (16 x 32, row-major: weight rows by the group's 32 values), four registers: a[0] row g,
//     cols 4t .. 4t + 3; a[1] row g + 8, the same cols; a[2] row g, cols 16 + 4t ..;
//     a[3] row g + 8, those cols.
//   B (32 x 8, col-major; element (k, n): value k of token n), two registers: b[0] n = g,
//     k = 4t .. 4t + 3; b[1] n = g, k = 16 + 4t ...
//   C and D (16 x 8, s32), four registers: c[0] (g, 2t), c[1] (g, 2t + 1), c[2] (g + 8, 2t),
//     c[3] (g + 8, 2t + 1).
// So a register of A or B is one whole word of the Q8 mode's lanes: cols 4t.. are word t and
// cols 16 + 4t.. word 4 + t, staged as they are, with no byte shuffling.
#pragma once
#include "wl_q8.cuh"

// Weight rows a block takes (four warps of 16: one A fragment each) and tokens (eight n-blocks
// of 8, every warp all of them).
#define WL_MMQ_ROWS 64
#define WL_MMQ_WARP_ROWS 16
#define WL_MMQ_TOKS 64
#define WL_MMQ_THREADS 128
// 32-value groups staged a pass.
#define WL_MMQ_GROUPS 4
// Words of padding after each staged row (token): a row of 32 words would put the 8 rows a
// fragment load meets on one bank; 4 more spreads them over 8 x 4 banks.
#define WL_MMQ_PAD 4
#define WL_MMQ_LD (WL_MMQ_GROUPS * 8 + WL_MMQ_PAD)
// Words of the staged weights and activations, and entries of each per-group scale array.
#define WL_MMQ_W_WORDS (WL_MMQ_ROWS * WL_MMQ_LD)
#define WL_MMQ_X_WORDS (WL_MMQ_TOKS * WL_MMQ_LD)
#define WL_MMQ_W_GROUPS (WL_MMQ_ROWS * WL_MMQ_GROUPS)
#define WL_MMQ_X_GROUPS (WL_MMQ_TOKS * WL_MMQ_GROUPS)

// Products a group takes: two for Q6_K (a scale per 16 values), one for the other types.
#define WL_MMQ_HALVES_q4_0 1
#define WL_MMQ_HALVES_q4_1 1
#define WL_MMQ_HALVES_q5_0 1
#define WL_MMQ_HALVES_q5_1 1
#define WL_MMQ_HALVES_q8_0 1
#define WL_MMQ_HALVES_q4_k 1
#define WL_MMQ_HALVES_q6_k 2

// ---- The fragment maps ----

// A: the row and column of byte `byte` of register `reg` of lane `lane`.
WL_HD int wl_mmq_a_row(int lane, int reg) { return lane / 4 + 8 * (reg & 1); }
WL_HD int wl_mmq_a_col(int lane, int reg, int byte) {
    return 4 * (lane % 4) + 16 * (reg >> 1) + byte;
}
// B: element (k, n) of byte `byte` of register `reg`.
WL_HD int wl_mmq_b_k(int lane, int reg, int byte) { return 4 * (lane % 4) + 16 * reg + byte; }
WL_HD int wl_mmq_b_n(int lane) { return lane / 4; }
// C and D: wl_mma_c_row and wl_mma_c_col (wl_common.cuh), the layout every m16n8 shape shares.

// ---- Shared memory ----

// The word of staged row (or token) `row` holding values 4j .. 4j + 3 of the pass's group kk.
WL_HD int wl_mmq_word(int row, int kk, int j) { return row * WL_MMQ_LD + kk * 8 + j; }
// The entry of (row or token, group kk) in a per-group array.
WL_HD int wl_mmq_slot(int row, int kk) { return row * WL_MMQ_GROUPS + kk; }

// Element e (0 .. WL_MMQ_ROWS * WL_MMQ_GROUPS * 8) of a weight pass: word j = e % 8 of group
// g0 + (e / 8) % WL_MMQ_GROUPS of row r0 + e / (8 * WL_MMQ_GROUPS), so the 8 threads of a group
// read its bytes side by side. `sdw` holds each group's two half scales (equal but for Q6_K),
// `smw` its min factor; a row or group past the end stages zeros (its products are zero and
// its scales zero, so it adds nothing; no output of it is stored).
#define WL_MMQ_STAGE_W(NAME, BS, BB)                                                               \
    WL_HD void wl_mmq_stage_w_##NAME(const wl_u8* w, wl_u64 rows, wl_u64 cols, wl_u64 r0,         \
                                     wl_u64 g0, int al, int e, wl_u32* sw, float* sdw,             \
                                     float* smw) {                                                 \
        const int row = e / (8 * WL_MMQ_GROUPS), kk = (e / 8) % WL_MMQ_GROUPS, j = e % 8;          \
        const wl_u64 r = r0 + (wl_u64)row, g = g0 + (wl_u64)kk;                                    \
        wl_u32 w4 = 0u;                                                                            \
        float dw = 0.0f, mw = 0.0f;                                                                \
        if (r < rows && g < cols / 32) {                                                           \
            const wl_u8* blk = w + r * (cols / (BS)) * (BB) + (g / ((BS) / 32)) * (BB);            \
            w4 = wl_q8w_##NAME(blk, (int)(g % ((BS) / 32)), j, al, &dw, &mw);                      \
        }                                                                                          \
        sw[wl_mmq_word(row, kk, j)] = w4;                                                          \
        const int s = wl_mmq_slot(row, kk);                                                        \
        if (j == 0) {                                                                              \
            sdw[2 * s] = dw;                                                                       \
            smw[s] = mw;                                                                           \
        } else if (j == 4) {                                                                       \
            sdw[2 * s + 1] = dw;                                                                   \
        }                                                                                          \
    }

WL_MMQ_STAGE_W(q4_0, 32, 18)
WL_MMQ_STAGE_W(q4_1, 32, 20)
WL_MMQ_STAGE_W(q5_0, 32, 22)
WL_MMQ_STAGE_W(q5_1, 32, 24)
WL_MMQ_STAGE_W(q8_0, 32, 34)
WL_MMQ_STAGE_W(q4_k, 256, 144)
WL_MMQ_STAGE_W(q6_k, 256, 210)

// Element e (0 .. WL_MMQ_TOKS * WL_MMQ_GROUPS * 10) of an activation pass: word k = e % 10 of
// the 40-byte block of group g0 + (e / 10) % WL_MMQ_GROUPS of token t0 + e / (10 *
// WL_MMQ_GROUPS) (word 0 its scale, 1 its sum, 2 .. 9 its quants), 32-bit loads when `al` (xq
// 4-byte aligned; every block is then). A token or group past the end stages zeros.
WL_HD void wl_mmq_stage_x(const wl_u8* xq, wl_u64 n_tok, wl_u64 n_groups, wl_u64 t0, wl_u64 g0,
                          int al, int e, wl_u32* sx, float* sxd, int* sxs) {
    const int tok = e / (10 * WL_MMQ_GROUPS), kk = (e / 10) % WL_MMQ_GROUPS, k = e % 10;
    const wl_u64 t = t0 + (wl_u64)tok, g = g0 + (wl_u64)kk;
    wl_u32 v = 0u;
    if (t < n_tok && g < n_groups) {
        v = wl_wld32a(xq + (t * n_groups + g) * WL_Q8_BLOCK_BYTES + 4 * k, al);
    }
    const int s = wl_mmq_slot(tok, kk);
    if (k == 0) {
        sxd[s] = wl_bits_to_f32(v);
    } else if (k == 1) {
        sxs[s] = (int)v;
    } else {
        sx[wl_mmq_word(tok, kk, k - 2)] = v;
    }
}

// ---- Fragment loads ----

// Lane `lane`'s A fragment of group kk for the warp's 16 rows from staged row `row0`; with
// `halves` 2, only the registers of half `h` (cols 16 h ..), the others zero.
WL_HD void wl_mmq_a_frag(const wl_u32* sw, int row0, int kk, int lane, int halves, int h,
                         wl_u32 a[4]) {
    for (int reg = 0; reg < 4; reg++) {
        const wl_u32 v =
            sw[wl_mmq_word(row0 + wl_mmq_a_row(lane, reg), kk, wl_mmq_a_col(lane, reg, 0) / 4)];
        a[reg] = (halves == 1 || (reg >> 1) == h) ? v : 0u;
    }
}
// Lane `lane`'s B fragment of group kk for the 8 tokens from staged token `tok0`.
WL_HD void wl_mmq_b_frag(const wl_u32* sx, int tok0, int kk, int lane, wl_u32 b[2]) {
    for (int reg = 0; reg < 2; reg++) {
        b[reg] = sx[wl_mmq_word(tok0 + wl_mmq_b_n(lane), kk, wl_mmq_b_k(lane, reg, 0) / 4)];
    }
}

// ---- The epilogue, one lane's share ----

// Product `c` (D of group kk, half h, of the warp's rows from `row0` and the n-block's tokens
// from `tok0`) into the lane's chains: acc[reg] and ext[reg] are (row, token) of C register reg.
// `kind` is WL_Q8_KIND_{type}; the min term is the group's, added with its first half.
WL_HD void wl_mmq_epilogue(const int c[4], int lane, int row0, int tok0, int kk, int h, int kind,
                           const float* sdw, const float* smw, const float* sxd, const int* sxs,
                           float acc[4], float ext[4]) {
    for (int reg = 0; reg < 4; reg++) {
        const int sw = wl_mmq_slot(row0 + wl_mma_c_row(lane, reg), kk);
        const int sx = wl_mmq_slot(tok0 + wl_mma_c_col(lane, reg), kk);
        const float xd = sxd[sx];
        acc[reg] = WL_FMA(WL_MUL(sdw[2 * sw + h], xd), (float)c[reg], acc[reg]);
        if (kind != 0 && h == 0) {
            const float t = WL_MUL(WL_MUL(smw[sw], xd), (float)sxs[sx]);
            ext[reg] = kind > 0 ? WL_ADD(ext[reg], t) : WL_SUB(ext[reg], t);
        }
    }
}
