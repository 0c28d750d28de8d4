//! The Q8-mode matvec's AVX-512 row dots for the 32-value types (Q4_0, Q4_1, Q5_0, Q5_1,
//! Q8_0) and the K-quants Q4_K, Q5_K and Q6_K: rows in pairs, one row's 8 lanes in each half of a 512-bit vector, so each
//! operation on the quants, the scales and the accumulators serves two rows (the 256-bit
//! forms of `x86_matvec` spent about seven vector operations per block and row, which bound a
//! decode step on Zen-class cores before memory did). Lanes never mix: every lane runs the
//! scalar path's operations in its order, so the bits are those of every other form.
// The std::arch intrinsics are unsafe to call: they need the CPU features that `Isa` checked at
// run time and raw pointers into slices whose bounds the callers check.

use std::arch::x86_64::*;

use super::matvec::{Q8Block, TokenScales};
use super::x86::imp::{rd_f16_pair, rd_u32};
use super::x86_matvec::{prefetch_ahead, scales_mins_k4};
use crate::types::QuantType;

/// Whether [`row_pair_tokens_q8_512`] takes `ty`.
pub(crate) fn takes(ty: QuantType) -> bool {
    matches!(
        ty,
        QuantType::Q4_0 | QuantType::Q4_1 | QuantType::Q5_0 | QuantType::Q5_1 | QuantType::Q8_0
    )
}

/// Whether [`rows_dot_q8_512`] takes `ty`: those of [`takes`] and the K-quants Q4_K, Q5_K and
/// Q6_K.
pub(crate) fn matvec_takes(ty: QuantType) -> bool {
    takes(ty) || matches!(ty, QuantType::Q4_K | QuantType::Q5_K | QuantType::Q6_K)
}

/// `a` in the low half and `b` in the high half.
#[inline]
#[target_feature(enable = "avx512f")]
fn pair(a: __m256i, b: __m256i) -> __m512i {
    _mm512_inserti64x4::<1>(_mm512_castsi256_si512(a), b)
}

/// The 32 unsigned nibble quants of a Q4-style block in each half (the 16 bytes at `a` and at
/// `b`): both halves of each half hold the bytes, the upper quarter shifted down a nibble
/// (its bits from the next byte fall in the masked-off upper nibble), then masked.
///
/// # Safety
/// AVX-512F/BW; `a` and `b` point to 16 readable bytes.
#[inline]
#[target_feature(enable = "avx2,avx512f,avx512bw")]
unsafe fn nibbles_pair(a: *const u8, b: *const u8) -> __m512i {
    // SAFETY: as the contract.
    let (va, vb) = unsafe { (_mm_loadu_si128(a.cast()), _mm_loadu_si128(b.cast())) };
    let v = pair(
        _mm256_broadcastsi128_si256(va),
        _mm256_broadcastsi128_si256(vb),
    );
    let v = _mm512_srlv_epi64(v, _mm512_setr_epi64(0, 0, 4, 4, 0, 0, 4, 4));
    _mm512_and_si512(v, _mm512_set1_epi8(0x0f))
}

/// The f16 at `a` in the low 8 lanes and at `b` in the high 8, as f32.
///
/// # Safety
/// AVX-512F and F16C; both point to 2 readable bytes.
#[inline]
#[target_feature(enable = "avx2,f16c,avx512f")]
unsafe fn scales_pair(a: *const u8, b: *const u8) -> __m512 {
    // SAFETY: as the contract.
    let (ha, hb) = unsafe {
        (
            a.cast::<u16>().read_unaligned() as i16,
            b.cast::<u16>().read_unaligned() as i16,
        )
    };
    _mm512_cvtph_ps(_mm256_set_m128i(_mm_set1_epi16(hb), _mm_set1_epi16(ha)))
}

/// `lo` in the low half and `hi` in the high half.
#[inline]
#[target_feature(enable = "avx512f")]
fn pair_ps(lo: __m256, hi: __m256) -> __m512 {
    let v = _mm512_castpd256_pd512(_mm256_castps_pd(lo));
    _mm512_castpd_ps(_mm512_insertf64x4::<1>(v, _mm256_castps_pd(hi)))
}

/// Group `g` (0-3) of a Q6_K half-block's unsigned 6-bit quants (`q + 32`) in each half, from
/// the pair's low-bit bytes `ql` and high-bit bytes `qh` (the 256-bit `q6k_group`, per half).
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
fn q6k_group_pair(ql: __m512i, qh: __m512i, g: usize) -> __m512i {
    let (m4, m2) = (_mm512_set1_epi8(0x0f), _mm512_set1_epi8(3));
    let lo = if g < 2 {
        _mm512_and_si512(ql, m4)
    } else {
        _mm512_and_si512(_mm512_srli_epi16::<4>(ql), m4)
    };
    let hi = match g {
        0 => _mm512_and_si512(qh, m2),
        1 => _mm512_and_si512(_mm512_srli_epi16::<2>(qh), m2),
        2 => _mm512_and_si512(_mm512_srli_epi16::<4>(qh), m2),
        _ => _mm512_and_si512(_mm512_srli_epi16::<6>(qh), m2),
    };
    _mm512_or_si512(lo, _mm512_slli_epi16::<4>(hi))
}

/// `finish_lanes`'s sum of each half's 8 lanes, `((s0 + s2) + (s1 + s3))` with
/// `s_k = l_k + l_(k+4)`, for both halves at once (before the offset term is added).
#[inline]
#[target_feature(enable = "avx512f")]
fn finish_pair(acc: __m512) -> [f32; 2] {
    // lanes 4..8 of each half onto 0..4: s_k = l_k + l_(k+4)
    let s = _mm512_add_ps(acc, _mm512_shuffle_f32x4::<0b10_11_00_01>(acc, acc));
    // s_0 + s_2 and s_1 + s_3
    let t = _mm512_add_ps(s, _mm512_permute_ps::<0b01_00_11_10>(s));
    // (s_0 + s_2) + (s_1 + s_3)
    let u = _mm512_add_ps(t, _mm512_permute_ps::<0b10_11_00_01>(t));
    [
        _mm512_cvtss_f32(u),
        _mm_cvtss_f32(_mm512_extractf32x4_ps::<2>(u)),
    ]
}

/// The VNNI Q8-mode dots of `R` rows (an even number) for Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0
/// (0 for other types), rows `2p` and `2p + 1` sharing vectors; `bias` holds the lane offsets
/// for the type's quant offset (none for Q4_1 and Q5_1).
///
/// # Safety
/// AVX2, FMA, F16C, AVX-512F/BW/VL and AVX512-VNNI; every row holds whole blocks of `ty` for
/// all of `xq`, and `bias` matches `xq` where the type uses it.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(crate) unsafe fn rows_dot_q8_512<const R: usize>(
    ty: QuantType,
    rows: [&[u8]; R],
    xq: &[Q8Block],
    bias: &[[i32; 8]],
) -> [f32; R] {
    assert!(R.is_multiple_of(2), "rows_dot_q8_512: rows in pairs");
    let bb = ty.block_bytes();
    // one accumulator per pair (the upper half of the array is not used)
    let mut acc = [_mm512_setzero_ps(); R];
    let mut extra = [0f32; R];
    // block i of row r (whole blocks, by the contract)
    let at = |r: usize, i: usize| -> *const u8 {
        debug_assert!(rows[r].len() >= (i + 1) * bb);
        // SAFETY: as the contract.
        unsafe { rows[r].as_ptr().add(i * bb) }
    };
    // The loop of the types without a weight offset: per activation block its quants, scale
    // and lane offsets in both halves, then per pair `fma(d · d_x, dp(bias, q, x), acc)` with
    // `$quants` the pair's unsigned quants from its two blocks.
    macro_rules! blocks {
        (|$a:ident, $b:ident| $quants:expr) => {
            for (i, (xb, lb)) in xq.iter().zip(bias).enumerate() {
                // SAFETY: a block's quants and a lane-offset row hold 32 bytes each.
                let (xv, bv) = unsafe {
                    (
                        _mm512_broadcast_i64x4(_mm256_loadu_si256(xb.qs.as_ptr().cast())),
                        _mm512_broadcast_i64x4(_mm256_loadu_si256(lb.as_ptr().cast())),
                    )
                };
                let xd = _mm512_set1_ps(xb.d);
                for (p, a) in acc.iter_mut().enumerate().take(R / 2) {
                    let ($a, $b) = (at(2 * p, i), at(2 * p + 1, i));
                    // SAFETY: both are whole blocks; a prefetch never faults.
                    unsafe {
                        prefetch_ahead(std::slice::from_raw_parts($a, 1));
                        prefetch_ahead(std::slice::from_raw_parts($b, 1));
                        let dd = _mm512_mul_ps(scales_pair($a, $b), xd);
                        let l = _mm512_dpbusd_epi32(bv, $quants, xv);
                        *a = _mm512_fmadd_ps(dd, _mm512_cvtepi32_ps(l), *a);
                    }
                }
            }
        };
    }
    // Q4_1 and Q5_1: unsigned quants, no lane offsets; `(m · d_x) · Σq_x` summed apart, in
    // every lane of the row's half (each lane does the scalar path's sequence)
    let mut offsets = [_mm512_setzero_ps(); R];
    macro_rules! offset_blocks {
        (|$a:ident, $b:ident| $quants:expr) => {{
            for (i, xb) in xq.iter().enumerate() {
                // SAFETY: a block's quants hold 32 bytes.
                let xv =
                    unsafe { _mm512_broadcast_i64x4(_mm256_loadu_si256(xb.qs.as_ptr().cast())) };
                let xd = _mm512_set1_ps(xb.d);
                let xs = _mm512_set1_ps(xb.sum as f32);
                let pairs = acc.iter_mut().zip(&mut offsets).enumerate().take(R / 2);
                for (p, (a, o)) in pairs {
                    let ($a, $b) = (at(2 * p, i), at(2 * p + 1, i));
                    // SAFETY: both are whole blocks (d at 0, m at 2); a prefetch never faults.
                    unsafe {
                        prefetch_ahead(std::slice::from_raw_parts($a, 1));
                        prefetch_ahead(std::slice::from_raw_parts($b, 1));
                        let dd = _mm512_mul_ps(scales_pair($a, $b), xd);
                        let m = scales_pair($a.add(2), $b.add(2));
                        *o = _mm512_add_ps(*o, _mm512_mul_ps(_mm512_mul_ps(m, xd), xs));
                        let l = _mm512_dpbusd_epi32(_mm512_setzero_si512(), $quants, xv);
                        *a = _mm512_fmadd_ps(dd, _mm512_cvtepi32_ps(l), *a);
                    }
                }
            }
            for (p, o) in offsets.iter().enumerate().take(R / 2) {
                let mut lanes = [0f32; 16];
                // SAFETY: lanes holds 16 f32.
                unsafe { _mm512_storeu_ps(lanes.as_mut_ptr(), *o) };
                extra[2 * p] = lanes[0];
                extra[2 * p + 1] = lanes[8];
            }
        }};
    }
    // 16 added to the quants whose fifth bit is set: bit j of a block's `qh` is value j's
    let fifth = |a: *const u8, b: *const u8, off: usize| -> __mmask64 {
        // SAFETY: `off + 4` bytes of each block are readable.
        let (ha, hb) = unsafe {
            (
                rd_u32(std::slice::from_raw_parts(a, off + 4), off),
                rd_u32(std::slice::from_raw_parts(b, off + 4), off),
            )
        };
        u64::from(ha) | (u64::from(hb) << 32)
    };
    let k16 = _mm512_set1_epi8(16);
    // Q4_K's and Q5_K's loop ($k5: Q5_K, its nibbles at $qs_at)
    macro_rules! k_min_blocks {
        ($k5:literal, $qs_at:literal) => {{
            let block_len = bb;
            let m4 = _mm512_set1_epi8(0x0f);
            let lane: [__m512i; 8] = std::array::from_fn(|s| {
                let (lo, hi) = (_mm256_set1_epi32(s as i32), _mm256_set1_epi32(8 + s as i32));
                _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi)
            });
            for (i, xbs) in xq.chunks_exact(8).enumerate() {
                // SAFETY: a block's quants hold 32 bytes.
                let xv: [__m512i; 8] = std::array::from_fn(|s| unsafe {
                    _mm512_broadcast_i64x4(_mm256_loadu_si256(xbs[s].qs.as_ptr().cast()))
                });
                let d8 = std::array::from_fn::<f32, 8, _>(|s| xbs[s].d);
                let s8 = std::array::from_fn::<i32, 8, _>(|s| xbs[s].sum);
                // SAFETY: both hold 8 lanes.
                let (xd, xs) = unsafe {
                    let d = _mm256_loadu_ps(d8.as_ptr());
                    let s = _mm256_cvtepi32_ps(_mm256_loadu_si256(s8.as_ptr().cast()));
                    (pair_ps(d, d), pair_ps(s, s))
                };
                let pairs = acc.iter_mut().enumerate().take(R / 2);
                for (p, a) in pairs {
                    let (ra, rb) = (2 * p, 2 * p + 1);
                    // SAFETY: both are whole blocks (144 or 176 bytes); a prefetch never faults.
                    let (ba, bb) = unsafe {
                        (
                            std::slice::from_raw_parts(at(ra, i), block_len),
                            std::slice::from_raw_parts(at(rb, i), block_len),
                        )
                    };
                    for off in (0..block_len).step_by(64) {
                        prefetch_ahead(&ba[off..]);
                        prefetch_ahead(&bb[off..]);
                    }
                    let ((da, mina), (db, minb)) = (rd_f16_pair(ba, 0), rd_f16_pair(bb, 0));
                    let ((sca, ma), (scb, mb)) =
                        (scales_mins_k4(&ba[4..16]), scales_mins_k4(&bb[4..16]));
                    let d = pair_ps(_mm256_set1_ps(da), _mm256_set1_ps(db));
                    let dmin = pair_ps(_mm256_set1_ps(mina), _mm256_set1_ps(minb));
                    let dsx = _mm512_mul_ps(_mm512_mul_ps(d, pair_ps(sca, scb)), xd);
                    let dmx = _mm512_mul_ps(_mm512_mul_ps(dmin, pair_ps(ma, mb)), xd);
                    let mut mins = [0f32; 16];
                    // SAFETY: mins holds 16 f32.
                    unsafe { _mm512_storeu_ps(mins.as_mut_ptr(), _mm512_mul_ps(dmx, xs)) };
                    // SAFETY: 32 bytes at each offset of both blocks.
                    let load = |off: usize| unsafe {
                        pair(
                            _mm256_loadu_si256(ba[off..].as_ptr().cast()),
                            _mm256_loadu_si256(bb[off..].as_ptr().cast()),
                        )
                    };
                    let qh = if $k5 {
                        load(16)
                    } else {
                        _mm512_setzero_si512()
                    };
                    for c in 0..4 {
                        let v = load($qs_at + 32 * c);
                        let halves = [
                            _mm512_and_si512(v, m4),
                            _mm512_and_si512(_mm512_srli_epi16::<4>(v), m4),
                        ];
                        for (h, q) in halves.into_iter().enumerate() {
                            let sb = 2 * c + h;
                            let q = if $k5 {
                                // bit `sb` of each `qh` byte, as the quant's fifth bit
                                let sh = _mm_cvtsi32_si128(sb as i32);
                                let bit =
                                    _mm512_and_si512(_mm512_srl_epi16(qh, sh), _mm512_set1_epi8(1));
                                _mm512_or_si512(q, _mm512_slli_epi16::<4>(bit))
                            } else {
                                q
                            };
                            let l = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q, xv[sb]);
                            let dd = _mm512_permutexvar_ps(lane[sb], dsx);
                            *a = _mm512_fmadd_ps(dd, _mm512_cvtepi32_ps(l), *a);
                            extra[ra] -= mins[sb];
                            extra[rb] -= mins[8 + sb];
                        }
                    }
                }
            }
        }};
    }
    match ty {
        QuantType::Q4_0 => blocks!(|a, b| nibbles_pair(a.add(2), b.add(2))),
        // q + 16 as unsigned bytes; the lane offsets take 16 · Σx off
        QuantType::Q5_0 => blocks!(|a, b| {
            let q = nibbles_pair(a.add(6), b.add(6));
            _mm512_mask_add_epi8(q, fifth(a, b, 2), q, k16)
        }),
        // q + 128 as unsigned bytes
        QuantType::Q8_0 => blocks!(|a, b| _mm512_xor_si512(
            pair(
                _mm256_loadu_si256(a.add(2).cast()),
                _mm256_loadu_si256(b.add(2).cast())
            ),
            _mm512_set1_epi8(-128)
        )),
        QuantType::Q4_1 => offset_blocks!(|a, b| nibbles_pair(a.add(4), b.add(4))),
        QuantType::Q5_1 => offset_blocks!(|a, b| {
            let q = nibbles_pair(a.add(8), b.add(8));
            _mm512_mask_add_epi8(q, fifth(a, b, 4), q, k16)
        }),
        // A pair's eight sub-block scales `(d · sc) · d_x` come from one product per block (the
        // first row's sub-blocks in the low 8 lanes, the second's in the high 8), each spread
        // over its half by a permute; the offsets `((dmin · m) · d_x) · Σq_x` are subtracted
        // from each row's sum sub-block by sub-block: the scalar path's operations in its order.
        // Q5_K is Q4_K with its quants' fifth bits apart (`qh`) and the nibbles after them; one
        // loop for each, so that neither pays the other's branch
        QuantType::Q4_K => k_min_blocks!(false, 16),
        QuantType::Q5_K => k_min_blocks!(true, 48),
        // A row's sixteen `(d · sc) · d_x` (two a 32-value group, one per 16 values) from one
        // product per block; each group's pair of them goes to lanes 0-3 and 4-7 of the row's
        // half by one two-source permute. The quants are unsigned (`q + 32`) and the lane
        // offsets take `32 · Σx` off, as the 256-bit VNNI form does.
        QuantType::Q6_K => {
            let idx: [__m512i; 8] = std::array::from_fn(|g| {
                let (s0, s1) = (2 * g as i32, 2 * g as i32 + 1);
                _mm512_setr_epi32(
                    s0,
                    s0,
                    s0,
                    s0,
                    s1,
                    s1,
                    s1,
                    s1,
                    16 + s0,
                    16 + s0,
                    16 + s0,
                    16 + s0,
                    16 + s1,
                    16 + s1,
                    16 + s1,
                    16 + s1,
                )
            });
            let blocks = xq.chunks_exact(8).zip(bias.chunks_exact(8));
            for (i, (xbs, bs)) in blocks.enumerate() {
                // SAFETY: a block's quants and a lane-offset row hold 32 bytes each.
                let (xv, bv): ([__m512i; 8], [__m512i; 8]) = unsafe {
                    (
                        std::array::from_fn(|g| {
                            _mm512_broadcast_i64x4(_mm256_loadu_si256(xbs[g].qs.as_ptr().cast()))
                        }),
                        std::array::from_fn(|g| {
                            _mm512_broadcast_i64x4(_mm256_loadu_si256(bs[g].as_ptr().cast()))
                        }),
                    )
                };
                // each group's d_x twice: lanes 2g and 2g + 1
                let xd2 = std::array::from_fn::<f32, 16, _>(|k| xbs[k / 2].d);
                // SAFETY: xd2 holds 16 f32.
                let xd = unsafe { _mm512_loadu_ps(xd2.as_ptr()) };
                for (p, a) in acc.iter_mut().enumerate().take(R / 2) {
                    // SAFETY: both are whole 210-byte blocks; a prefetch never faults.
                    let (ba, bb) = unsafe {
                        (
                            std::slice::from_raw_parts(at(2 * p, i), 210),
                            std::slice::from_raw_parts(at(2 * p + 1, i), 210),
                        )
                    };
                    for off in [0, 64, 128, 192] {
                        prefetch_ahead(&ba[off..]);
                        prefetch_ahead(&bb[off..]);
                    }
                    let dsx = |blk: &[u8]| {
                        // SAFETY: the 16 scale bytes at 192.
                        let sc = unsafe { _mm_loadu_si128(blk[192..].as_ptr().cast()) };
                        let sc = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sc));
                        let d = _mm512_set1_ps(f32::from(half::f16::from_le_bytes([
                            blk[208], blk[209],
                        ])));
                        _mm512_mul_ps(_mm512_mul_ps(d, sc), xd)
                    };
                    let (sa, sb) = (dsx(ba), dsx(bb));
                    for h in 0..2 {
                        // SAFETY: 32 bytes at each offset of both blocks.
                        let load = |off: usize| unsafe {
                            pair(
                                _mm256_loadu_si256(ba[off..].as_ptr().cast()),
                                _mm256_loadu_si256(bb[off..].as_ptr().cast()),
                            )
                        };
                        let qh = load(128 + 32 * h);
                        let ql = [load(64 * h), load(64 * h + 32)];
                        for g in 0..4 {
                            let gi = 4 * h + g;
                            let q = q6k_group_pair(ql[g % 2], qh, g);
                            let l = _mm512_dpbusd_epi32(bv[gi], q, xv[gi]);
                            let dd = _mm512_permutex2var_ps(sa, idx[gi], sb);
                            *a = _mm512_fmadd_ps(dd, _mm512_cvtepi32_ps(l), *a);
                        }
                    }
                }
            }
        }
        _ => {}
    }
    let mut out = [0f32; R];
    for (p, a) in acc.into_iter().enumerate().take(R / 2) {
        let [lo, hi] = finish_pair(a);
        out[2 * p] = lo + extra[2 * p];
        out[2 * p + 1] = hi + extra[2 * p + 1];
    }
    out
}

/// The tokens of a pass laid out for [`row_pair_tokens_q8_512`], whose vectors hold the two
/// rows' lanes interleaved (lane `2k + r` row `r`'s lane `k`): each token's quants with every
/// 4-quant group twice, and each block's token scales and quant sums twice, so a token's
/// operands are one whole load and one 64-bit broadcast of its two `d · d_x`, with no shuffle
/// per token. For the types with signed weight quants (Q4_0, Q5_0, Q8_0) the token's quants
/// are stored plus 128 (unsigned, for `vpdpbusd`'s unsigned operand) and the weight side takes
/// the offset off, once per block for every token: no lane offsets per token.
pub(crate) struct PairTokens {
    /// `qs[i · T + t]`: token `t`'s block `i`, quants `4k..4k + 4` at bytes `8k` and `8k + 4`.
    qs: Vec<[i8; 64]>,
    /// `d[i]`, lanes `2t` and `2t + 1`: token `t`'s scale of block `i` (0 past the last token).
    d: Vec<Lanes32>,
    /// `s[i]`: token `t`'s quant sum of block `i` alike, as f32 (exact).
    s: Vec<Lanes32>,
    /// Whether the quants are stored plus 128 (the types with signed weight quants).
    unsigned: bool,
}

/// 32 f32, aligned for whole-vector loads and the 64-bit broadcasts of a token's pair.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Lanes32([f32; 32]);

impl PairTokens {
    /// Room for `n` tokens of `blocks` blocks each, for weights of `ty`: every value 0 until
    /// [`PairBlocks::set`] lays a token's block out.
    pub(crate) fn zeroed(ty: QuantType, n: usize, blocks: usize) -> PairTokens {
        PairTokens {
            qs: vec![[0; 64]; blocks * n],
            d: vec![Lanes32([0.0; 32]); blocks],
            s: vec![Lanes32([0.0; 32]); blocks],
            unsigned: !matches!(ty, QuantType::Q4_1 | QuantType::Q5_1),
        }
    }

    /// Every block, as a view that splits into runs of blocks to fill apart.
    pub(crate) fn blocks(&mut self) -> PairBlocks<'_> {
        PairBlocks {
            qs: &mut self.qs,
            d: &mut self.d,
            s: &mut self.s,
            unsigned: self.unsigned,
        }
    }
}

/// A run of blocks of a [`PairTokens`], to lay out.
pub(crate) struct PairBlocks<'a> {
    qs: &'a mut [[i8; 64]],
    d: &'a mut [Lanes32],
    s: &'a mut [Lanes32],
    unsigned: bool,
}

impl<'a> PairBlocks<'a> {
    /// The first `count` blocks of the run (each of `n` tokens), taken off its front.
    pub(crate) fn split_front(&mut self, count: usize, n: usize) -> PairBlocks<'a> {
        let (qs, qs_rest) = std::mem::take(&mut self.qs).split_at_mut(count * n);
        let (d, d_rest) = std::mem::take(&mut self.d).split_at_mut(count);
        let (s, s_rest) = std::mem::take(&mut self.s).split_at_mut(count);
        (self.qs, self.d, self.s) = (qs_rest, d_rest, s_rest);
        PairBlocks {
            qs,
            d,
            s,
            unsigned: self.unsigned,
        }
    }

    /// Token `t` (of `n`) of the run's block `i` is `b`: its quants with every 4-quant group
    /// twice (plus 128 where the weights' quants are signed), its scale and quant sum in lanes
    /// `2t` and `2t + 1`.
    pub(crate) fn set(&mut self, i: usize, n: usize, t: usize, b: &Q8Block) {
        // each byte's sign bit flipped: q + 128 as an unsigned byte
        let flip = if self.unsigned { 0x8080_8080u32 } else { 0 };
        let groups: [u32; 8] = bytemuck::cast(b.qs);
        self.qs[i * n + t] = bytemuck::cast(groups.map(|g| {
            let g = u64::from(g ^ flip);
            g | (g << 32)
        }));
        self.d[i].0[2 * t..2 * t + 2].fill(b.d);
        self.s[i].0[2 * t..2 * t + 2].fill(b.sum as f32);
    }
}

/// `v`, through a barrier the optimiser cannot see past: each block's `d · d_x` of every
/// token are stored with one or two vector multiplies and read back one token at a time as a
/// broadcast load, where LLVM would otherwise forward the stored vectors through a shuffle
/// per token, on the ports the products need.
#[inline(always)]
fn opaque(v: &mut Lanes32) -> &mut Lanes32 {
    std::hint::black_box(v)
}

/// The f16 at `a` in the even lanes and at `b` in the odd lanes, as f32.
///
/// # Safety
/// AVX-512F and F16C; both point to 2 readable bytes.
#[inline]
#[target_feature(enable = "avx2,f16c,avx512f")]
unsafe fn scales_interleaved(a: *const u8, b: *const u8) -> __m512 {
    // SAFETY: as the contract.
    let (ha, hb) = unsafe {
        (
            a.cast::<u16>().read_unaligned(),
            b.cast::<u16>().read_unaligned(),
        )
    };
    _mm512_cvtph_ps(_mm256_set1_epi32(
        (u32::from(ha) | (u32::from(hb) << 16)) as i32,
    ))
}

/// The batched form of [`rows_dot_q8_512`]: the VNNI Q8-mode dots of two rows with `T`
/// tokens, each row's block decoded once for all of them. The two rows' lanes are interleaved
/// in one 512-bit vector (lane `2k + r` row `r`'s lane `k`), so one 64-bit broadcast of a
/// token's two `d · d_x` (stored for every token by one multiply per 8 tokens and block)
/// scales both rows' lanes, and a token costs a dot, a conversion and an FMA per block. The
/// tokens come as [`PairTokens`] lays them out for `ty`, `scales` one entry per block. Every
/// lane runs the operations of the single-token kernels in their order (the same integer lane
/// sums, `d · d_x` rounded per block, one FMA per block and lane, the offset term
/// `(m · d_x) · Σq_x` summed apart in block order), so each token's two results have the bits
/// of [`rows_dot_q8_512`] for that token alone. Token `t`'s two results (row 0's, row 1's) go
/// to `tile` at `(t0 + t) · stride + slot` and the next value: each token's pair is stored
/// straight from the vector lanes that hold it.
///
/// # Safety
/// AVX2, FMA, F16C, AVX-512F/BW/VL and AVX512-VNNI; `ty` is one [`takes`]; both rows hold
/// `scales.len()` whole blocks; `x` was laid out for `ty` from `T` tokens' blocks per scale
/// entry; at most 16 tokens.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(crate) unsafe fn row_pair_tokens_q8_512<const T: usize>(
    ty: QuantType,
    rows: [&[u8]; 2],
    x: &PairTokens,
    scales: &[TokenScales],
    tile: &mut [f32],
    (stride, t0, slot): (usize, usize, usize),
) {
    let (nb, bb) = (scales.len(), ty.block_bytes());
    let offset = matches!(ty, QuantType::Q4_1 | QuantType::Q5_1);
    assert!(
        takes(ty)
            && T <= 16
            && rows.iter().all(|r| r.len() == nb * bb)
            && x.qs.len() == nb * T
            && x.d.len() == nb
            && x.s.len() == nb
            && x.unsigned != offset
            && (t0 + T - 1) * stride + slot + 2 <= tile.len(),
        "row_pair_tokens_q8_512: shapes"
    );
    // the halves of 16 tokens that hold tokens, 8 tokens of both rows in each
    let halves = T.div_ceil(8);
    let mut acc = [_mm512_setzero_ps(); T];
    // the offset terms of Q4_1 and Q5_1: token 8h + j of row r in lane 2j + r of half h
    let mut ext = [_mm512_setzero_ps(); 2];
    // per block, each token's two `d · d_x` at 2t and 2t + 1
    let mut dd = Lanes32([0.0; 32]);
    // [row 0's 8 lanes | row 1's] to lane 2k + r
    let inter = _mm512_setr_epi32(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15);
    // block i of row r (whole blocks, checked above)
    let at = |r: usize, i: usize| -> *const u8 {
        // SAFETY: i < nb, and the row holds nb blocks of bb bytes.
        unsafe { rows[r].as_ptr().add(i * bb) }
    };
    // 16 added to the quants whose fifth bit is set: bit j of a block's `qh` is value j's
    let fifth = |a: *const u8, b: *const u8, off: usize| -> __mmask64 {
        // SAFETY: `off + 4` bytes of each block are readable.
        let (ha, hb) = unsafe {
            (
                a.add(off).cast::<u32>().read_unaligned(),
                b.add(off).cast::<u32>().read_unaligned(),
            )
        };
        u64::from(ha) | (u64::from(hb) << 32)
    };
    let k16 = _mm512_set1_epi8(16);
    // Every block: `$quants` the pair's quants from its blocks `$a` and `$b` (unsigned for the
    // offset types, signed for the others), interleaved; each token's two `d · d_x`; the
    // offset term or the weight side of the quant offset; then per token one dot, one
    // conversion and one FMA.
    macro_rules! blocks {
        ($offset:literal, |$a:ident, $b:ident| $quants:expr) => {
            for i in 0..nb {
                let ($a, $b) = (at(0, i), at(1, i));
                // SAFETY: both are whole blocks; a prefetch never faults.
                unsafe {
                    prefetch_ahead(std::slice::from_raw_parts($a, 1));
                    prefetch_ahead(std::slice::from_raw_parts($b, 1));
                }
                // SAFETY: whole blocks of `ty`, so each field is readable.
                let q = _mm512_permutexvar_epi32(inter, unsafe { $quants });
                // SAFETY: d is the first field of every block.
                let sp = unsafe { scales_interleaved($a, $b) };
                let (xd, xs) = (&x.d[i].0, &x.s[i].0);
                for h in 0..halves {
                    // SAFETY: each holds 32 f32, 64-byte aligned.
                    unsafe {
                        let d = _mm512_load_ps(xd.as_ptr().add(16 * h));
                        _mm512_store_ps(dd.0.as_mut_ptr().add(16 * h), _mm512_mul_ps(sp, d));
                        if $offset {
                            // m follows d in Q4_1 and Q5_1
                            let m = scales_interleaved($a.add(2), $b.add(2));
                            let s = _mm512_load_ps(xs.as_ptr().add(16 * h));
                            let e = &mut ext[h];
                            *e = _mm512_add_ps(*e, _mm512_mul_ps(_mm512_mul_ps(m, d), s));
                        }
                    }
                }
                let dd = opaque(&mut dd);
                // the signed quants' side of the tokens' +128: −128 · Σq per lane
                let base = if $offset {
                    _mm512_setzero_si512()
                } else {
                    let sum =
                        _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8(-128), q);
                    _mm512_sub_epi32(_mm512_setzero_si512(), sum)
                };
                for (t, acc) in acc.iter_mut().enumerate() {
                    // SAFETY: i · T + t < nb · T (checked above), 64 bytes of quants each;
                    // dd's pair at 2t is 8-byte aligned (dd is 64-byte aligned).
                    let (xv, d) = unsafe {
                        let xv = _mm512_loadu_si512(x.qs.get_unchecked(i * T + t).as_ptr().cast());
                        let d = dd.0.as_ptr().add(2 * t).cast::<f64>().read();
                        (xv, _mm512_castpd_ps(_mm512_set1_pd(d)))
                    };
                    let l = if $offset {
                        _mm512_dpbusd_epi32(base, q, xv)
                    } else {
                        _mm512_dpbusd_epi32(base, xv, q)
                    };
                    *acc = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(l), *acc);
                }
            }
        };
    }
    let k8 = _mm512_set1_epi8(8);
    match ty {
        QuantType::Q4_0 => blocks!(false, |a, b| _mm512_sub_epi8(
            nibbles_pair(a.add(2), b.add(2)),
            k8
        )),
        QuantType::Q5_0 => blocks!(false, |a, b| {
            let q = nibbles_pair(a.add(6), b.add(6));
            _mm512_sub_epi8(_mm512_mask_add_epi8(q, fifth(a, b, 2), q, k16), k16)
        }),
        QuantType::Q8_0 => blocks!(false, |a, b| pair(
            _mm256_loadu_si256(a.add(2).cast()),
            _mm256_loadu_si256(b.add(2).cast())
        )),
        QuantType::Q4_1 => blocks!(true, |a, b| nibbles_pair(a.add(4), b.add(4))),
        QuantType::Q5_1 => blocks!(true, |a, b| {
            let q = nibbles_pair(a.add(8), b.add(8));
            _mm512_mask_add_epi8(q, fifth(a, b, 4), q, k16)
        }),
        _ => {}
    }
    let at = tile.as_mut_ptr();
    for (h, e) in ext.iter().enumerate().take(halves) {
        let sums = finish_interleaved(std::array::from_fn(|j| {
            acc.get(8 * h + j).copied().unwrap_or(_mm512_setzero_ps())
        }));
        // token 8h + j's pair in lanes 2j and 2j + 1: one 64-bit store each
        let v = _mm512_add_ps(sums, *e);
        let quarters = [
            _mm_castps_pd(_mm512_castps512_ps128(v)),
            _mm_castps_pd(_mm512_extractf32x4_ps::<1>(v)),
            _mm_castps_pd(_mm512_extractf32x4_ps::<2>(v)),
            _mm_castps_pd(_mm512_extractf32x4_ps::<3>(v)),
        ];
        for j in 0..8.min(T - 8 * h) {
            let q = quarters[j / 2];
            // SAFETY: token 8h + j < T, and the pair of token T - 1 ends inside the tile
            // (checked above).
            unsafe {
                let to = at.add((t0 + 8 * h + j) * stride + slot).cast::<f64>();
                if j % 2 == 0 {
                    _mm_storel_pd(to, q);
                } else {
                    _mm_storeh_pd(to, q);
                }
            }
        }
    }
}

/// `finish_lanes`'s sum of each row's 8 lanes, `((s0 + s2) + (s1 + s3))` with
/// `s_k = l_k + l_(k+4)`, for eight interleaved vectors (lane `2k + r` row `r`'s lane `k`) at
/// once: token `j`'s row `r` in lane `2j + r` of the result, before the offset term is added.
/// Each shuffle and add serves two or four tokens (about a third of the operations of eight
/// reductions one by one), and the same lanes meet in the same tree, so the bits are those of
/// one token's reduction (IEEE addition is commutative: which operand holds a lane does not
/// matter).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
fn finish_interleaved(acc: [__m512; 8]) -> __m512 {
    // lanes 8..16 onto 0..8, two tokens a vector: token a's in lanes 0..8, b's in 8..16
    let halves = |a: __m512, b: __m512| {
        _mm512_add_ps(
            _mm512_shuffle_f32x4::<0b01_00_01_00>(a, b),
            _mm512_shuffle_f32x4::<0b11_10_11_10>(a, b),
        )
    };
    // lanes 4..8 onto 0..4, four tokens a vector, token i in lanes 4i..4i + 4
    let quarters = |ab: __m512, cd: __m512| {
        _mm512_add_ps(
            _mm512_shuffle_f32x4::<0b10_00_10_00>(ab, cd),
            _mm512_shuffle_f32x4::<0b11_01_11_01>(ab, cd),
        )
    };
    let first = quarters(halves(acc[0], acc[1]), halves(acc[2], acc[3]));
    let second = quarters(halves(acc[4], acc[5]), halves(acc[6], acc[7]));
    // lanes 2, 3 onto 0, 1 of each token: token i's rows in lanes 4i, 4i + 1, token i + 4's
    // in 4i + 2, 4i + 3
    let sums = _mm512_add_ps(
        _mm512_shuffle_ps::<0b01_00_01_00>(first, second),
        _mm512_shuffle_ps::<0b11_10_11_10>(first, second),
    );
    let order = _mm512_setr_epi32(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
    _mm512_permutexvar_ps(order, sums)
}
