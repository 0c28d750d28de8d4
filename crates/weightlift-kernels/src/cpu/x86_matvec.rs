//! The Q8-mode matvec's row dots on AVX2 and VNNI, `R` weight rows at a time: the rows share
//! each activation block's loads and keep one accumulator each, so the multiply-add chains of
//! `R` rows run side by side (one row's chain alone left the core waiting on the FMA latency).
//! Each row's operations, and their order, are the single-row scalar path's
//! (`matvec::row_dot_q8_scalar`, see `matvec::finish_lanes`), so every `R`, instruction set
//! and VNNI choice gives the same bits.
// The std::arch intrinsics are unsafe to call: they need the CPU features that `Isa` checked at
// run time and raw pointers into slices whose bounds the callers check.

use std::arch::x86_64::*;

use super::matvec::{Q8Block, finish_lanes, k16_d_at, k16_scale_bytes, lane_tree};
use super::x86::imp::{
    load32, mul_sum_i8, nibbles32, q2k_group_at, q3k_group_at, q6k_group_at, quants5_i, quants5_u,
    quants5_u_avx512, rd_f16, rd_f16_pair, rd_u32, splat_f16,
};
use super::x86_gemm::quantize_groups;
use crate::types::QuantType;

/// Block `i` (of `bb` bytes) of `row`.
///
/// # Safety
/// `row` holds at least `(i + 1) · bb` bytes.
#[inline(always)]
pub(crate) unsafe fn block(row: &[u8], i: usize, bb: usize) -> &[u8] {
    debug_assert!(row.len() >= (i + 1) * bb);
    // SAFETY: as the contract.
    unsafe { std::slice::from_raw_parts(row.as_ptr().add(i * bb), bb) }
}

/// `d` and `m` of a Q4_1/Q5_1 block by one 4-byte load, both used: with one lane used LLVM
/// narrows the load back to a 2-byte one that merges into a register the previous block wrote
/// (a false dependency: Q4_1 measured 1.7 ms against 0.5 ms).
#[inline]
#[target_feature(enable = "avx2,f16c")]
pub(crate) fn dm_f16(blk: &[u8]) -> (__m256, f32) {
    let dm = _mm_cvtph_ps(_mm_cvtsi32_si128(i32::from_le_bytes([
        blk[0], blk[1], blk[2], blk[3],
    ])));
    (
        _mm256_broadcastss_ps(dm),
        _mm_cvtss_f32(_mm_movehdup_ps(dm)),
    )
}

/// How far ahead of each block the kernels prefetch. The rows of a group are read side by
/// side, four interleaved streams the hardware prefetchers do not follow as they follow one
/// row read after another (without this, 4 rows at a time ran at a third of the speed of 1 on
/// matrices streamed from DRAM). Rows are contiguous, so this is the same block of a row read
/// a few groups later; 14 KiB measured best (Zen 5, 1 thread, SmolLM2's matrices: 8–20 KiB
/// within 3 %), and a multiple of 4 KiB is avoided so the prefetched lines do not land in the
/// L1 sets being read.
const PREFETCH_BYTES: usize = 14 * 1024 + 512;

/// Prefetches the line [`PREFETCH_BYTES`] past `blk` into L1 (a prefetch never faults, so
/// running past the matrix is harmless).
#[inline(always)]
pub(crate) fn prefetch_ahead(blk: &[u8]) {
    let at = blk.as_ptr().wrapping_add(PREFETCH_BYTES);
    // SAFETY: a prefetch never faults, whatever the address.
    unsafe { _mm_prefetch::<_MM_HINT_T0>(at.cast()) };
}

/// [`prefetch_ahead`] for every line of a 256-value block (K-quants: 110 to 210 bytes).
#[inline(always)]
fn prefetch_block(blk: &[u8]) {
    for off in (0..blk.len()).step_by(64) {
        prefetch_ahead(&blk[off..]);
    }
}

/// Quantises `x` into `q` as `matvec::quantize_q8_blocks` does, bit for bit (with the Q8-mode
/// matmul's quantiser, eight blocks at a time), when `off` is not 0 writes each block's lane
/// offsets, `−off` times the sums of its four-quant runs, into `bias`, and when `lo` is not
/// empty each block's sum of its first 16 quants into it.
///
/// # Safety
/// AVX2, FMA and F16C; `x.len()` a multiple of 32, `q` holding `x.len() / 32` blocks,
/// `bias` as many when `off` is not 0, `lo` as many or none.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn quantize_q8_avx2(
    x: &[f32],
    off: i32,
    q: &mut [Q8Block],
    bias: &mut [[i32; 8]],
    lo: &mut [i32],
) {
    assert!(
        q.len() * 32 == x.len()
            && (off == 0 || bias.len() == q.len())
            && (lo.is_empty() || lo.len() == q.len()),
        "quantize_q8_avx2: shapes"
    );
    let ones8 = _mm256_set1_epi8(1);
    let ones16 = _mm256_set1_epi16(1);
    let neg_off = _mm256_set1_epi32(-off);
    for (g0, (xs, qs)) in x.chunks(256).zip(q.chunks_mut(8)).enumerate() {
        for (j, (b, (v, d, s_lo, s_hi))) in qs.iter_mut().zip(quantize_groups(xs)).enumerate() {
            b.d = d;
            b.sum = s_lo + s_hi;
            if let Some(l) = lo.get_mut(8 * g0 + j) {
                *l = s_lo;
            }
            // SAFETY: qs holds 32 bytes.
            unsafe { _mm256_storeu_si256(b.qs.as_mut_ptr().cast(), v) };
            if off != 0 {
                // the sums of four quants (1 · q in pairs, then pairs of pairs), times −off
                let runs = _mm256_madd_epi16(_mm256_maddubs_epi16(ones8, v), ones16);
                let l = _mm256_mullo_epi32(runs, neg_off);
                // SAFETY: the lane offsets hold 8 i32.
                unsafe { _mm256_storeu_si256(bias[8 * g0 + j].as_mut_ptr().cast(), l) };
            }
        }
    }
}

/// Q5_K's quants of sub-block `sb`: the nibbles `q` with bit `sb` of each of the block's 32
/// `qh` bytes as their fifth bit (at most 31, so `pmaddubsw` stays exact).
#[inline]
#[target_feature(enable = "avx2")]
pub(crate) fn with_fifth_bits(q: __m256i, qh: __m256i, sb: usize) -> __m256i {
    let bit = _mm256_and_si256(
        _mm256_srl_epi16(qh, _mm_cvtsi32_si128(sb as i32)),
        _mm256_set1_epi8(1),
    );
    _mm256_or_si256(q, _mm256_slli_epi16::<4>(bit))
}

/// A Q4_K block's eight 6-bit scales and eight mins (its 12 scale bytes, as
/// [`scale_min_k4`](super::dequant_scalar::scale_min_k4) reads them one sub-block at a time) as f32 lanes, sub-block `j` in lane `j`.
#[inline]
#[target_feature(enable = "avx2")]
pub(crate) fn scales_mins_k4(q: &[u8]) -> (__m256, __m256) {
    let w = |k: usize| u32::from_le_bytes([q[4 * k], q[4 * k + 1], q[4 * k + 2], q[4 * k + 3]]);
    let (w0, w1, w2) = (w(0), w(1), w(2));
    let (low6, low4, top2) = (0x3f3f_3f3f_u32, 0x0f0f_0f0f_u32, 0x0303_0303_u32);
    // sub-blocks 0-3: the low six bits of bytes 0-3 (scales) and 4-7 (mins); 4-7: the nibbles
    // of bytes 8-11 below the top two bits of bytes 0-3 (scales) and 4-7 (mins)
    let sc = u64::from(w0 & low6) | u64::from((w2 & low4) | (((w0 >> 6) & top2) << 4)) << 32;
    let m = u64::from(w1 & low6) | u64::from(((w2 >> 4) & low4) | (((w1 >> 6) & top2) << 4)) << 32;
    let lanes = |v: u64| _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(v as i64)));
    (lanes(sc), lanes(m))
}

/// A Q3_K or Q6_K block's sixteen `(d · sc) · d_x` (two a 32-value group, one per 16 values;
/// `xd` holds each group's `d_x` twice, lanes `2g` and `2g + 1` of the 16), groups 0-3 in the
/// first vector and 4-7 in the second: the scalar path's two products, lane by lane.
#[inline]
#[target_feature(enable = "avx2,f16c")]
pub(crate) fn k16_scales_x(ty: QuantType, blk: &[u8], xd: [__m256; 2]) -> [__m256; 2] {
    let sc = if ty == QuantType::Q2_K {
        // the low nibbles of the first 16 bytes, in one operation (a loop a byte measured
        // 9 % of the matvec)
        // SAFETY: a Q2_K block starts with its 16 scale bytes.
        let v = unsafe { _mm_loadu_si128(blk[..16].as_ptr().cast()) };
        _mm_and_si128(v, _mm_set1_epi8(0x0f))
    } else if ty == QuantType::Q3_K {
        q3k_scales_x(blk)
    } else {
        let sc = k16_scale_bytes(ty, blk);
        // SAFETY: sc holds 16 bytes.
        unsafe { _mm_loadu_si128(sc.as_ptr().cast()) }
    };
    let d = rd_f16(blk, k16_d_at(ty));
    let d = _mm256_set1_ps(d);
    let lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc));
    let hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128::<8>(sc)));
    [
        _mm256_mul_ps(_mm256_mul_ps(d, lo), xd[0]),
        _mm256_mul_ps(_mm256_mul_ps(d, hi), xd[1]),
    ]
}

/// A Q3_K block's 16 signed scales (`dequant_scalar::q3k_scales`'s words, a 32-bit lane
/// each), decoded in registers: built byte by byte on the stack and loaded as one vector, they
/// stalled each block's load on the stores before it.
#[inline]
#[target_feature(enable = "avx2")]
fn q3k_scales_x(blk: &[u8]) -> __m128i {
    // the 12 scale bytes (96..108) from the 16 that end the block, moved to the bottom
    // SAFETY: a Q3_K block is 110 bytes.
    let v = _mm_srli_si128::<2>(unsafe { _mm_loadu_si128(blk[94..110].as_ptr().cast()) });
    // lanes [a0, a1, a0, a1] and [a2; 4] of the scalar decode's words
    let a = _mm_shuffle_epi32::<0b01_00_01_00>(v);
    let top = _mm_shuffle_epi32::<0b10_10_10_10>(v);
    let low4 = _mm_and_si128(
        _mm_srlv_epi32(a, _mm_setr_epi32(0, 0, 4, 4)),
        _mm_set1_epi8(0x0f),
    );
    let top2 = _mm_and_si128(
        _mm_srlv_epi32(top, _mm_setr_epi32(0, 2, 4, 6)),
        _mm_set1_epi8(3),
    );
    _mm_sub_epi8(
        _mm_or_si128(low4, _mm_slli_epi32::<4>(top2)),
        _mm_set1_epi8(32),
    )
}

/// A Q2_K block's mins as f32 lanes, group `g`'s in lane `g`: those of its first 16 values
/// (the high nibbles of the even scale bytes) and of its last 16 (the odd ones).
#[inline]
#[target_feature(enable = "avx2")]
pub(crate) fn q2k_mins_x(blk: &[u8]) -> (__m256, __m256) {
    // SAFETY: a Q2_K block starts with its 16 scale bytes.
    let v = unsafe { _mm_loadu_si128(blk[..16].as_ptr().cast()) };
    let m = _mm_and_si128(_mm_srli_epi16::<4>(v), _mm_set1_epi8(0x0f));
    // the even bytes in the low half, the odd ones in the high half
    let m = _mm_shuffle_epi8(
        m,
        _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15),
    );
    let f = |b: __m128i| _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b));
    (f(m), f(_mm_srli_si128::<8>(m)))
}

/// Each group's `d_x` twice (lanes `2g` and `2g + 1`), for [`k16_scales_x`].
#[inline]
#[target_feature(enable = "avx2")]
pub(crate) fn k16_token_scales(xbs: &[Q8Block]) -> [__m256; 2] {
    let two = |g: usize| {
        let (a, b, c, e) = (xbs[g].d, xbs[g + 1].d, xbs[g + 2].d, xbs[g + 3].d);
        _mm256_setr_ps(a, a, b, b, c, c, e, e)
    };
    [two(0), two(4)]
}

/// The lanes that take group `g`'s pair of scales from [`k16_scales_x`]'s vector (lanes 0-3
/// the first 16 values' scale, 4-7 the second's).
#[inline]
#[target_feature(enable = "avx2")]
pub(crate) fn k16_lanes(g: usize) -> __m256i {
    let (a, b) = (2 * (g % 4) as i32, 2 * (g % 4) as i32 + 1);
    _mm256_setr_epi32(a, a, a, a, b, b, b, b)
}

/// Each row's 8 lanes and offset sum, finished as the scalar path does.
#[inline]
#[target_feature(enable = "avx2")]
pub(crate) fn finish<const R: usize>(acc: [__m256; R], extra: [f32; R]) -> [f32; R] {
    let mut out = [0f32; R];
    for ((o, a), e) in out.iter_mut().zip(acc).zip(extra) {
        let mut lanes = [0f32; 8];
        // SAFETY: lanes holds 8 f32.
        unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), a) };
        *o = finish_lanes(&lanes, e);
    }
    out
}

/// The Q8-mode dots of `R` rows with the activations, AVX2 (`pmaddubsw` + `pmaddwd`): per
/// block the integer lane sums, then `fma(d · d_x, lanes, acc)`; Q4_1, Q5_1, Q2_K, Q4_K and
/// Q5_K add their offset term apart. Q3_K's and Q6_K's quants are made unsigned (q + 4,
/// q + 32) and `bias` holds each activation block's lane offsets, `−off · Σx` over each
/// lane's 4 values; `halves` hold each block's sums of its first and last 16 quants (Q2_K's
/// mins).
///
/// # Safety
/// AVX2, FMA and F16C; every row holds whole blocks of `ty` for all of `xq` (as many
/// 32-value activation blocks as a row has values / 32). The kernel checks that `bias` (for
/// Q3_K and Q6_K) and `halves` (for Q2_K) match `xq`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn rows_dot_q8_avx2<const R: usize>(
    ty: QuantType,
    rows: [&[u8]; R],
    xq: &[Q8Block],
    bias: &[[i32; 8]],
    halves: [&[i32]; 2],
) -> [f32; R] {
    let bb = ty.block_bytes();
    let mut acc = [_mm256_setzero_ps(); R];
    let mut extra = [0f32; R];
    let ones = _mm256_set1_epi16(1);
    let m4 = _mm256_set1_epi8(0x0f);
    // SAFETY (every `block` below): the contract gives each row a block per activation block.
    // One loop per type; the block's `d · d_x` in every lane from a full-register load
    // (`splat_f16`: a one-lane f16 load can merge into a register the previous block wrote
    // last, a false dependency that made Q4_0 2.5x slower).
    macro_rules! blocks {
        (|$blk:ident, $xv:ident| $lanes:expr) => {
            for (i, xb) in xq.iter().enumerate() {
                let $xv = load32(xb.qs.as_ptr().cast());
                let xd = _mm256_set1_ps(xb.d);
                for (a, row) in acc.iter_mut().zip(rows) {
                    let $blk = unsafe { block(row, i, bb) };
                    prefetch_ahead($blk);
                    let dd = _mm256_mul_ps(splat_f16($blk, 0), xd);
                    let l: __m256i = $lanes;
                    *a = _mm256_fmadd_ps(dd, _mm256_cvtepi32_ps(l), *a);
                }
            }
        };
    }
    // unsigned quants × signed activations: `maddubs` is exact (2 · 31 · 128 fits its i16)
    macro_rules! offset_blocks {
        (|$blk:ident| $quants:expr) => {
            for (i, xb) in xq.iter().enumerate() {
                let xv = load32(xb.qs.as_ptr().cast());
                let xd = _mm256_set1_ps(xb.d);
                let xs = xb.sum as f32;
                for ((a, e), row) in acc.iter_mut().zip(&mut extra).zip(rows) {
                    let $blk = unsafe { block(row, i, bb) };
                    prefetch_ahead($blk);
                    let (d, m) = dm_f16($blk);
                    let dd = _mm256_mul_ps(d, xd);
                    *e += (m * xb.d) * xs;
                    let l = _mm256_madd_epi16(_mm256_maddubs_epi16($quants, xv), ones);
                    *a = _mm256_fmadd_ps(dd, _mm256_cvtepi32_ps(l), *a);
                }
            }
        };
    }
    // Q4_K's and Q5_K's loop ($k5: Q5_K, its nibbles at $qs_at)
    macro_rules! k_min_blocks {
        ($k5:literal, $qs_at:literal) => {{
            // Each sub-block's `(d · sc) · d_x` and `((dmin · m) · d_x) · Σq_x` come from one
            // 8-lane product per block, a lane a sub-block (the scalar path's operations, in
            // its order, lane by lane); the first is spread over the accumulator's lanes by a
            // permute, the second subtracted from the row's offset sum sub-block by sub-block.
            let lane: [__m256i; 8] = std::array::from_fn(|s| _mm256_set1_epi32(s as i32));
            for (i, xbs) in xq.chunks_exact(8).enumerate() {
                let xv: [__m256i; 8] = std::array::from_fn(|s| load32(xbs[s].qs.as_ptr().cast()));
                let xd = _mm256_setr_ps(
                    xbs[0].d, xbs[1].d, xbs[2].d, xbs[3].d, xbs[4].d, xbs[5].d, xbs[6].d, xbs[7].d,
                );
                let xs = _mm256_cvtepi32_ps(_mm256_setr_epi32(
                    xbs[0].sum, xbs[1].sum, xbs[2].sum, xbs[3].sum, xbs[4].sum, xbs[5].sum,
                    xbs[6].sum, xbs[7].sum,
                ));
                for ((a, e), row) in acc.iter_mut().zip(&mut extra).zip(rows) {
                    let blk = unsafe { block(row, i, bb) };
                    prefetch_block(blk);
                    let (d, dmin) = rd_f16_pair(blk, 0);
                    let (sc, m) = scales_mins_k4(&blk[4..16]);
                    let dsx = _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(d), sc), xd);
                    let dmx = _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(dmin), m), xd);
                    let mut mins = [0f32; 8];
                    // SAFETY: mins holds 8 f32.
                    unsafe { _mm256_storeu_ps(mins.as_mut_ptr(), _mm256_mul_ps(dmx, xs)) };
                    let qh = if $k5 {
                        load32(blk[16..].as_ptr())
                    } else {
                        _mm256_setzero_si256()
                    };
                    // the row's lanes in a register for the block (through `*a` LLVM stored
                    // them after every sub-block)
                    let mut av = *a;
                    for c in 0..4 {
                        let v = load32(blk[$qs_at + 32 * c..].as_ptr());
                        let halves = [
                            _mm256_and_si256(v, m4),
                            _mm256_and_si256(_mm256_srli_epi16::<4>(v), m4),
                        ];
                        for (h, q) in halves.into_iter().enumerate() {
                            let sb = 2 * c + h;
                            let q = if $k5 { with_fifth_bits(q, qh, sb) } else { q };
                            let l = _mm256_madd_epi16(_mm256_maddubs_epi16(q, xv[sb]), ones);
                            let dd = _mm256_permutevar8x32_ps(dsx, lane[sb]);
                            av = _mm256_fmadd_ps(dd, _mm256_cvtepi32_ps(l), av);
                            *e -= mins[sb];
                        }
                    }
                    *a = av;
                }
            }
        }};
    }
    // Q3_K's and Q6_K's loop: scales per 16 values, two a group; `$group` gives a group's
    // quants plus the offset (at most 63: `pmaddubsw`'s pairs stay exact), which each
    // activation block's lane offsets take off again
    assert!(
        !matches!(ty, QuantType::Q3_K | QuantType::Q6_K) || bias.len() == xq.len(),
        "rows_dot_q8_avx2: lane offsets"
    );
    macro_rules! k16_blocks {
        ($ty:expr, $group:ident) => {{
            let lanes: [__m256i; 4] = std::array::from_fn(|g| k16_lanes(g));
            for (i, (xbs, bs)) in xq.chunks_exact(8).zip(bias.chunks_exact(8)).enumerate() {
                let xd = k16_token_scales(xbs);
                for (a, row) in acc.iter_mut().zip(rows) {
                    let blk = unsafe { block(row, i, bb) };
                    prefetch_block(blk);
                    let dsx = k16_scales_x($ty, blk, xd);
                    // the row's lanes in a register for the block (through `*a` LLVM stored
                    // them after every group)
                    let mut av = *a;
                    for h in 0..2 {
                        for g in 0..4 {
                            let q = $group(blk, h, g);
                            let (xb, b) = (&xbs[4 * h + g], &bs[4 * h + g]);
                            let p = _mm256_maddubs_epi16(q, load32(xb.qs.as_ptr().cast()));
                            // SAFETY: b holds 8 i32.
                            let bv = unsafe { _mm256_loadu_si256(b.as_ptr().cast()) };
                            let l = _mm256_add_epi32(_mm256_madd_epi16(p, ones), bv);
                            let dd = _mm256_permutevar8x32_ps(dsx[h], lanes[g]);
                            av = _mm256_fmadd_ps(dd, _mm256_cvtepi32_ps(l), av);
                        }
                    }
                    *a = av;
                }
            }
        }};
    }
    // Q2_K's loop: Q3_K's and Q6_K's with unsigned quants (`pmaddubsw` takes them as they
    // are) and a min per 16 values. A block's 8 groups' `(dmin · d_x) · (m_lo · Σq_lo +
    // m_hi · Σq_hi)` (the integer exact in f32) are taken off the row's 8-lane min sum, a
    // lane a group, by one fused multiply-add: the scalar path's operations, lane by lane.
    macro_rules! k2_blocks {
        () => {{
            assert!(
                halves.iter().all(|h| h.len() == xq.len()),
                "rows_dot_q8_avx2: half sums"
            );
            let lanes: [__m256i; 4] = std::array::from_fn(|g| k16_lanes(g));
            let mut mins = [_mm256_setzero_ps(); R];
            for (i, xbs) in xq.chunks_exact(8).enumerate() {
                let xd = k16_token_scales(xbs);
                let xd8 = _mm256_setr_ps(
                    xbs[0].d, xbs[1].d, xbs[2].d, xbs[3].d, xbs[4].d, xbs[5].d, xbs[6].d, xbs[7].d,
                );
                // SAFETY: each of halves holds 8 i32 from 8 · i (checked above).
                let [x_lo, x_hi] = halves.map(|h| unsafe {
                    _mm256_cvtepi32_ps(_mm256_loadu_si256(h[8 * i..8 * i + 8].as_ptr().cast()))
                });
                let xv: [__m256i; 8] = std::array::from_fn(|g| load32(xbs[g].qs.as_ptr().cast()));
                for ((a, e), row) in acc.iter_mut().zip(&mut mins).zip(rows) {
                    // SAFETY: the contract gives each row a block per 8 activation blocks.
                    let blk = unsafe { block(row, i, bb) };
                    prefetch_block(blk);
                    let dsx = k16_scales_x(QuantType::Q2_K, blk, xd);
                    let (m_lo, m_hi) = q2k_mins_x(blk);
                    let m = _mm256_fmadd_ps(m_hi, x_hi, _mm256_mul_ps(m_lo, x_lo));
                    let dmx = _mm256_mul_ps(_mm256_set1_ps(rd_f16(blk, 82)), xd8);
                    *e = _mm256_fnmadd_ps(dmx, m, *e);
                    // the row's lanes in a register for the block (through `*a` LLVM stored
                    // them after every group)
                    let mut av = *a;
                    for h in 0..2 {
                        for g in 0..4 {
                            let q = q2k_group_at(blk, h, g);
                            let l = _mm256_madd_epi16(_mm256_maddubs_epi16(q, xv[4 * h + g]), ones);
                            let dd = _mm256_permutevar8x32_ps(dsx[h], lanes[g]);
                            av = _mm256_fmadd_ps(dd, _mm256_cvtepi32_ps(l), av);
                        }
                    }
                    *a = av;
                }
            }
            for (e, m) in extra.iter_mut().zip(mins) {
                let mut l = [0f32; 8];
                // SAFETY: l holds 8 f32.
                unsafe { _mm256_storeu_ps(l.as_mut_ptr(), m) };
                *e = lane_tree(&l);
            }
        }};
    }
    match ty {
        QuantType::Q4_0 => blocks!(|blk, xv| mul_sum_i8(nibbles32(blk[2..18].as_ptr(), 8), xv)),
        QuantType::Q5_0 => {
            blocks!(|blk, xv| mul_sum_i8(quants5_i(rd_u32(blk, 2), blk[6..22].as_ptr()), xv))
        }
        QuantType::Q8_0 => blocks!(|blk, xv| mul_sum_i8(load32(blk[2..34].as_ptr()), xv)),
        QuantType::Q4_1 => offset_blocks!(|blk| nibbles32(blk[4..20].as_ptr(), 0)),
        QuantType::Q5_1 => offset_blocks!(|blk| quants5_u(rd_u32(blk, 4), blk[8..24].as_ptr())),
        // Q5_K is Q4_K with its quants' fifth bits apart (`qh`) and the nibbles after them; one
        // loop for each, so that neither pays the other's branch
        QuantType::Q4_K => k_min_blocks!(false, 16),
        QuantType::Q5_K => k_min_blocks!(true, 48),
        QuantType::Q2_K => k2_blocks!(),
        // the type as a constant, so the scale decode of the other types folds away
        QuantType::Q3_K => k16_blocks!(QuantType::Q3_K, q3k_group_at),
        QuantType::Q6_K => k16_blocks!(QuantType::Q6_K, q6k_group_at),
        _ => {}
    }
    finish(acc, extra)
}

/// The VNNI loop of the types with a weight offset of zero (Q4_0, Q5_0, Q8_0): per activation
/// block its quants, scale and bias once, then each row's `fma(d · d_x, dp(bias, q, x), acc)`
/// with `$quants` the row block's unsigned quants.
macro_rules! vnni_blocks {
    ($dp:ident, $acc:ident, $rows:ident, $xq:ident, $bias:ident, $bb:ident, |$blk:ident| $quants:expr) => {
        for (i, (xb, b)) in $xq.iter().zip($bias).enumerate() {
            let xv = load32(xb.qs.as_ptr().cast());
            let xd = _mm256_set1_ps(xb.d);
            // SAFETY: b holds 8 i32.
            let bv = unsafe { _mm256_loadu_si256(b.as_ptr().cast()) };
            for (a, row) in $acc.iter_mut().zip($rows) {
                // SAFETY: the caller gives each row a block per activation block.
                let $blk = unsafe { block(row, i, $bb) };
                prefetch_ahead($blk);
                // d · d_x in every lane: the same rounding as the scalar product
                let dd = _mm256_mul_ps(splat_f16($blk, 0), xd);
                let l = $dp(bv, $quants, xv);
                *a = _mm256_fmadd_ps(dd, _mm256_cvtepi32_ps(l), *a);
            }
        }
    };
}

/// The VNNI loop of Q4_1 and Q5_1: unsigned quants (no bias), the offset term apart.
macro_rules! vnni_offset_blocks {
    ($dp:ident, $acc:ident, $extra:ident, $rows:ident, $xq:ident, $bb:ident, |$blk:ident| $quants:expr) => {
        for (i, xb) in $xq.iter().enumerate() {
            let xv = load32(xb.qs.as_ptr().cast());
            let xd = _mm256_set1_ps(xb.d);
            let xs = xb.sum as f32;
            for ((a, e), row) in $acc.iter_mut().zip(&mut $extra).zip($rows) {
                // SAFETY: the caller gives each row a block per activation block.
                let $blk = unsafe { block(row, i, $bb) };
                prefetch_ahead($blk);
                let (d, m) = dm_f16($blk);
                let dd = _mm256_mul_ps(d, xd);
                *e += (m * xb.d) * xs;
                let l = $dp(_mm256_setzero_si256(), $quants, xv);
                *a = _mm256_fmadd_ps(dd, _mm256_cvtepi32_ps(l), *a);
            }
        }
    };
}

/// The VNNI loop of Q3_K and Q6_K: the unsigned quants `$group` gives (q + 4, q + 32) against
/// the activation blocks' lane offsets, two scales a group.
macro_rules! vnni_k16_blocks {
    ($dp:ident, $acc:ident, $rows:ident, $xq:ident, $bias:ident, $bb:ident, $ty:expr, $group:ident) => {{
        let lanes: [__m256i; 4] = std::array::from_fn(|g| k16_lanes(g));
        let blocks = $xq.chunks_exact(8).zip($bias.chunks_exact(8));
        for (i, (xbs, bs)) in blocks.enumerate() {
            let xd = k16_token_scales(xbs);
            for (a, row) in $acc.iter_mut().zip($rows) {
                // SAFETY: the contract gives each row a block per 8 activation
                // blocks.
                let blk = unsafe { block(row, i, $bb) };
                prefetch_block(blk);
                let dsx = k16_scales_x($ty, blk, xd);
                for h in 0..2 {
                    for g in 0..4 {
                        let q = $group(blk, h, g);
                        let gi = 4 * h + g;
                        let xb = &xbs[gi];
                        // SAFETY: bs[gi] holds 8 i32.
                        let bv = unsafe { _mm256_loadu_si256(bs[gi].as_ptr().cast()) };
                        let l = $dp(bv, q, load32(xb.qs.as_ptr().cast()));
                        let dd = _mm256_permutevar8x32_ps(dsx[h], lanes[g]);
                        *a = _mm256_fmadd_ps(dd, _mm256_cvtepi32_ps(l), *a);
                    }
                }
            }
        }
    }};
}

/// Generates [`rows_dot_q8_avx2`]'s VNNI twin for one VNNI extension: `vpdpbusd` sums four
/// unsigned-by-signed byte products per i32 lane in one instruction, so each block's lanes are
/// `bias + Σ u·x` with the weight quants made unsigned (`q + off`) and `bias` the activation
/// block's `−off · (lane sums of x)` from `matvec::vnni_bias`. The integers equal the AVX2
/// path's exactly, and the float operations are the same, so the result has the same bits.
/// Q4_K is left to the AVX2 form: its quants are unsigned already, so VNNI saves one
/// instruction in ten there, and measured slower. `$q5` builds the unsigned 5-bit quants of
/// Q5_0/Q5_1 ([`quants5_u`], or with AVX-512BW a masked add).
macro_rules! rows_dot_q8_vnni {
    ($name:ident, $feat:literal, $dp:ident, $q5:ident) => {
        /// VNNI Q8-mode dots of `R` rows for Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q3_K and Q6_K (0 for
        /// other types); see the macro above.
        ///
        /// # Safety
        /// The CPU must support the enabled features; every row holds whole blocks of `ty`
        /// for all of `xq`, and `bias` matches `xq` where the type uses it.
        #[target_feature(enable = $feat)]
        pub(crate) unsafe fn $name<const R: usize>(
            ty: QuantType,
            rows: [&[u8]; R],
            xq: &[Q8Block],
            bias: &[[i32; 8]],
        ) -> [f32; R] {
            let bb = ty.block_bytes();
            let mut acc = [_mm256_setzero_ps(); R];
            let mut extra = [0f32; R];
            match ty {
                QuantType::Q4_0 => vnni_blocks!($dp, acc, rows, xq, bias, bb, |blk| {
                    nibbles32(blk[2..].as_ptr(), 0)
                }),
                // q + 16 as unsigned bytes; the bias takes 16 · Σx off
                QuantType::Q5_0 => vnni_blocks!($dp, acc, rows, xq, bias, bb, |blk| {
                    $q5(rd_u32(blk, 2), blk[6..22].as_ptr())
                }),
                // q + 128 as unsigned bytes
                QuantType::Q8_0 => vnni_blocks!($dp, acc, rows, xq, bias, bb, |blk| {
                    _mm256_xor_si256(load32(blk[2..].as_ptr()), _mm256_set1_epi8(-128))
                }),
                QuantType::Q4_1 => vnni_offset_blocks!($dp, acc, extra, rows, xq, bb, |blk| {
                    nibbles32(blk[4..].as_ptr(), 0)
                }),
                QuantType::Q5_1 => vnni_offset_blocks!($dp, acc, extra, rows, xq, bb, |blk| {
                    $q5(rd_u32(blk, 4), blk[8..24].as_ptr())
                }),
                QuantType::Q3_K => {
                    vnni_k16_blocks!($dp, acc, rows, xq, bias, bb, QuantType::Q3_K, q3k_group_at)
                }
                QuantType::Q6_K => {
                    vnni_k16_blocks!($dp, acc, rows, xq, bias, bb, QuantType::Q6_K, q6k_group_at)
                }
                _ => {}
            }
            finish(acc, extra)
        }
    };
}

rows_dot_q8_vnni!(
    rows_dot_q8_avxvnni,
    "avx2,fma,f16c,avxvnni",
    _mm256_dpbusd_avx_epi32,
    quants5_u
);
// AVX512-VNNI is used only at Isa::Avx512, which also detected AVX-512BW
rows_dot_q8_vnni!(
    rows_dot_q8_avx512vnni,
    "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni",
    _mm256_dpbusd_epi32,
    quants5_u_avx512
);
