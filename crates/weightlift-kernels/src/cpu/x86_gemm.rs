//! The Q8-mode matrix product (`matvec::matmul` with [`MatvecMode::Q8`](super::MatvecMode)) on
//! AVX2 and AVX-512: integer register tiles of 16 weight rows × up to 12 tokens, with VNNI
//! (`vpdpbusd`) where the CPU has it and `pmaddubsw` + `pmaddwd` where it has not.
//!
//! Two layouts are made once per call, so the inner loop only loads and multiplies:
//!
//! - **Panels** (per task, 16 weight rows): for each 32-value group, its 8 four-value steps as
//!   one 64-byte line each (row `r`'s 4 quants at bytes `4r..4r+4`), made unsigned (`q + off`,
//!   `off` = 8 for Q4_0, 16 for Q5_0, 128 for Q8_0 with VNNI, 4 for Q3_K, 32 for Q6_K; Q4_1,
//!   Q5_1, Q2_K, Q4_K and Q5_K are unsigned already), then the rows' f32 scales (two vectors
//!   for the 16-value scales of Q2_K, Q3_K and Q6_K) and, for the types with an offset, the
//!   rows' coefficients of the activation sum (Q4_1's and Q5_1's `m`, Q4_K's `−dmin·m`; two
//!   vectors for Q2_K's mins per 16 values).
//! - **Activation blocks** (per call, `TB` tokens): the tokens quantised as
//!   `matvec::quantize_q8_blocks` does (bit for bit), per group the tokens' 32 quants, their
//!   scales `d_x`, the integer bias `−off · Σq_x` (per 16 values for Q3_K and Q6_K) and
//!   `Σq_x` (per 16 values for Q2_K).
//!
//! A tile keeps one i32 accumulator per token (16 rows each): it starts at the token's bias,
//! and each step adds the row line (unsigned bytes) times the token's 4 quants broadcast
//! (signed bytes), so after a group it holds the exact integer dot `Σ q_w·q_x` of each row and
//! token. That is scaled once per group (per 16 values for Q2_K, Q3_K and Q6_K) into an f32
//! accumulator, `acc = fma(isum, s·d_x, acc)`. The types with an offset sum `(coef·d_x)·Σq_x`
//! over the groups (Q2_K's per 16 values, the first half first) apart and add it last, as
//! llama.cpp's `ggml_vec_dot_q4_1_q8_1` keeps its `summs`
//! (and as this crate's earlier 4-bit kernels did, whose bits these tiles reproduce for Q4_0,
//! Q4_1, Q5_0, Q5_1 and Q4_K). Every instruction set (and `matvec`'s scalar matmul) does
//! exactly these float operations in this order, so the matmul gives the same bits on all of
//! them.
//!
//! Without VNNI, Q8_0's signed quants would overflow `pmaddubsw`'s i16 pairs once made
//! unsigned, so that path keeps them signed and moves each sign onto the activation (the
//! usual `|w| · sign(w)·x`); every other type's unsigned quants are at most 63, and two
//! products of 63 · 127 fit in i16.
// The std::arch intrinsics are unsafe to call: they need the CPU features that `Isa` checked at
// run time, and raw pointers into slices whose bounds each kernel checks first.

use std::arch::x86_64::*;

use rayon::prelude::*;

use super::dequant_scalar::scale_min_k4;
use super::matvec::{k16_d_at, k16_scale_bytes, q2k_mins};
use super::x86::imp::{
    load32, nibbles32, q2k_group_at, q3k_group_at, q6k_group_at, quants5_u, rd_f16, rd_u32,
};
use super::x86_matvec::with_fifth_bits;
use super::{Isa, Vnni};
use crate::types::QuantType;

/// Flavour bit: the accumulators start at the tokens' integer bias (`−off · Σq_x`).
const BIAS: u8 = 1;
/// Flavour bit: a weight offset: a coefficient per row and group times `d_x · Σq_x`, summed apart.
const MIN: u8 = 2;
/// Flavour bit: two scales per group, one per 16 values (Q2_K, Q3_K, Q6_K), and with [`MIN`]
/// two coefficients.
const SUB16: u8 = 4;
/// Flavour bit: signed weight quants, signs moved onto the activations (Q8_0 without VNNI).
const SIGNED: u8 = 8;

/// Q4_0, Q5_0 and (with VNNI) Q8_0.
const FL_BIAS: u8 = BIAS;
/// Q4_1, Q5_1, Q4_K and Q5_K.
const FL_MIN: u8 = MIN;
/// Q3_K and Q6_K.
const FL_K16: u8 = BIAS | SUB16;
/// Q2_K.
const FL_K16_MIN: u8 = MIN | SUB16;
/// Q8_0 without VNNI.
const FL_SIGNED: u8 = SIGNED;

/// Weight rows per panel (one 512-bit vector of i32, or two 256-bit ones).
const PANEL_ROWS: usize = 16;
/// Tokens per activation block and largest tile, 512-bit kernels: 12 i32 and 12 f32
/// accumulators, the row line and temporaries fit AVX-512's 32 registers.
const TB512: usize = 12;
/// The same for the 256-bit kernels (two vectors of 8 rows per token, 16 registers).
const TB256: usize = 3;

/// Which flavour `ty` takes, and its weight quant offset.
fn flavour(ty: QuantType, vnni: bool) -> (u8, i32) {
    match ty {
        QuantType::Q4_0 => (FL_BIAS, 8),
        QuantType::Q5_0 => (FL_BIAS, 16),
        QuantType::Q8_0 if vnni => (FL_BIAS, 128),
        QuantType::Q8_0 => (FL_SIGNED, 0),
        QuantType::Q2_K => (FL_K16_MIN, 0),
        QuantType::Q3_K => (FL_K16, 4),
        QuantType::Q6_K => (FL_K16, 32),
        _ => (FL_MIN, 0),
    }
}

/// Scale groups per 32 values.
const fn subs(fl: u8) -> usize {
    if fl & SUB16 != 0 { 2 } else { 1 }
}

/// Bytes of one group in a panel: 8 lines of quants, the scale vectors, the coefficient
/// vectors.
const fn panel_group_bytes(fl: u8) -> usize {
    512 + 64 * subs(fl) + if fl & MIN != 0 { 64 * subs(fl) } else { 0 }
}

/// Byte offsets in one group of an activation block of `tb` tokens: the scales `d_x`, the
/// biases (`subs` × `tb` i32, sub-group major), the quant sums `Σq_x` as f32 (as many, alike),
/// and the group's size.
const fn pack_offsets(fl: u8, tb: usize) -> (usize, usize, usize, usize) {
    let d = 32 * tb;
    let bias = d + 4 * tb;
    let xs = bias + if fl & BIAS != 0 { 4 * tb * subs(fl) } else { 0 };
    let end = xs + if fl & MIN != 0 { 4 * tb * subs(fl) } else { 0 };
    (d, bias, xs, end)
}

/// A cache line: panels are built of them, so every row line load is aligned.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([u8; 64]);

/// The bytes of `lines`.
fn line_bytes_mut(lines: &mut [Line]) -> &mut [u8] {
    // SAFETY: Line is repr(C) around [u8; 64] (size 64, no padding), so the lines are
    // `64 · len` initialised bytes, borrowed mutably for the result's lifetime.
    unsafe { std::slice::from_raw_parts_mut(lines.as_mut_ptr().cast::<u8>(), lines.len() * 64) }
}

/// The bytes of `lines`.
fn line_bytes(lines: &[Line]) -> &[u8] {
    // SAFETY: as line_bytes_mut, shared.
    unsafe { std::slice::from_raw_parts(lines.as_ptr().cast::<u8>(), lines.len() * 64) }
}

// ------------------------------------------------------------------- activations

/// Up to 8 consecutive 32-value groups quantised as `quantize_q8_blocks` does: `d = amax/127`,
/// `q = roundf(x · (1/d))` (half away from zero, saturating as Rust's `as i8` does, NaN to 0),
/// `d` rounded through f16. The maxima, scales and reciprocals of the 8 groups are computed
/// side by side (one division each for all 8). Returns per group the quants, `d` and the
/// sums of quants 0..16 and 16..32; `x` holds `32 · n` values, `n` ≤ 8.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn quantize_groups(x: &[f32]) -> [(__m256i, f32, i32, i32); 8] {
    let n = x.len() / 32;
    assert!(
        n <= 8 && x.len() == 32 * n,
        "quantize_groups: up to 8 groups"
    );
    let xp = x.as_ptr();
    let sign = _mm256_set1_ps(-0.0);
    let m: [__m256; 8] = std::array::from_fn(|j| {
        // max(|v|, m) keeps m where v is NaN, as f32::max in the scalar fold does
        let mut m = _mm256_setzero_ps();
        for i in 0..4 * usize::from(j < n) {
            // SAFETY: value 32j + 8i < 32n is inside x.
            let v = unsafe { _mm256_loadu_ps(xp.add(32 * j + 8 * i)) };
            m = _mm256_max_ps(_mm256_andnot_ps(sign, v), m);
        }
        m
    });
    // SAFETY: AVX is enabled here; the maxima are NaN-free.
    let amax = unsafe { crate::cpu::x86_ops::imp::transpose_max8(m) };
    // the scalar path's operations, lane by lane: amax / 127, then 1/d where d is not 0
    let d = _mm256_div_ps(amax, _mm256_set1_ps(127.0));
    let id = _mm256_and_ps(
        _mm256_div_ps(_mm256_set1_ps(1.0), d),
        _mm256_cmp_ps::<_CMP_NEQ_OQ>(d, _mm256_setzero_ps()),
    );
    let dr = _mm256_cvtph_ps(_mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(d));
    let (mut ids, mut ds) = ([0f32; 8], [0f32; 8]);
    // SAFETY: both arrays hold 8 f32.
    unsafe {
        _mm256_storeu_ps(ids.as_mut_ptr(), id);
        _mm256_storeu_ps(ds.as_mut_ptr(), dr);
    }
    let half = _mm256_set1_ps(0.5);
    let one = _mm256_set1_ps(1.0);
    let (lo, hi) = (_mm256_set1_ps(-128.0), _mm256_set1_ps(127.0));
    let hsum = |a: __m256i| {
        let s = _mm_add_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256::<1>(a));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b01_00_11_10>(s));
        _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32::<0b10_11_00_01>(s)))
    };
    std::array::from_fn(|j| {
        if j >= n {
            return (_mm256_setzero_si256(), 0.0, 0, 0);
        }
        let idv = _mm256_set1_ps(ids[j]);
        let c: [__m256i; 4] = std::array::from_fn(|i| {
            // SAFETY: value 32j + 8i < 32n is inside x.
            let q = _mm256_mul_ps(unsafe { _mm256_loadu_ps(xp.add(32 * j + 8 * i)) }, idv);
            // roundf: truncate, then step away from zero when the dropped part is at least
            // 1/2 (q − trunc(q) is exact)
            let t = _mm256_round_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(q);
            let frac = _mm256_andnot_ps(sign, _mm256_sub_ps(q, t));
            let step = _mm256_or_ps(one, _mm256_and_ps(sign, q));
            let r = _mm256_add_ps(
                t,
                _mm256_and_ps(_mm256_cmp_ps::<_CMP_GE_OQ>(frac, half), step),
            );
            // `as i8` saturates (±inf when 1/d overflows) and sends NaN to 0
            let r = _mm256_min_ps(_mm256_max_ps(r, lo), hi);
            let r = _mm256_and_ps(r, _mm256_cmp_ps::<_CMP_ORD_Q>(q, q));
            _mm256_cvttps_epi32(r)
        });
        let s_lo = hsum(_mm256_add_epi32(c[0], c[1]));
        let s_hi = hsum(_mm256_add_epi32(c[2], c[3]));
        // packs interleave 128-bit lanes; the permute puts the four 8-value runs in order
        let b = _mm256_packs_epi16(
            _mm256_packs_epi32(c[0], c[1]),
            _mm256_packs_epi32(c[2], c[3]),
        );
        let q = _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        (q, ds[j], s_lo, s_hi)
    })
}

/// Quantises and lays out one block of `x.len() / cols` (at most `tb`) tokens; see the module
/// documentation.
#[target_feature(enable = "avx2,fma,f16c")]
fn pack_block(fl: u8, off: i32, tb: usize, x: &[f32], cols: usize, out: &mut [u8]) {
    let (od, ob, ox, xg) = pack_offsets(fl, tb);
    let groups = cols / 32;
    assert!(
        x.len() <= tb * cols && out.len() >= groups * xg,
        "pack_block: shapes"
    );
    for (t, xt) in x.chunks_exact(cols).enumerate() {
        for (g0, xs) in xt.chunks(256).enumerate() {
            for (j, (q, d, s_lo, s_hi)) in quantize_groups(xs)
                .into_iter()
                .take(xs.len() / 32)
                .enumerate()
            {
                let g = 8 * g0 + j;
                let o = &mut out[g * xg..(g + 1) * xg];
                let qs = &mut o[32 * t..32 * t + 32];
                // SAFETY: qs holds 32 bytes.
                unsafe { _mm256_storeu_si256(qs.as_mut_ptr().cast(), q) };
                o[od + 4 * t..od + 4 * t + 4].copy_from_slice(&d.to_ne_bytes());
                let sums: &[i32] = if fl & SUB16 != 0 {
                    &[s_lo, s_hi]
                } else {
                    &[s_lo + s_hi]
                };
                for (h, s) in sums.iter().enumerate() {
                    if fl & BIAS != 0 {
                        let at = ob + 4 * (h * tb + t);
                        o[at..at + 4].copy_from_slice(&(-off * s).to_ne_bytes());
                    }
                    if fl & MIN != 0 {
                        let at = ox + 4 * (h * tb + t);
                        o[at..at + 4].copy_from_slice(&(*s as f32).to_ne_bytes());
                    }
                }
            }
        }
    }
}

// ------------------------------------------------------------------- weights

/// Decodes group `g` of `row`: the 32 quants as the panel holds them (unsigned `q + off`, or
/// signed for [`SIGNED`]), the scale of values 0–15 and 16–31 (equal but for Q2_K, Q3_K and
/// Q6_K) and the coefficients of the tokens' quant sums (the group's in the first; Q2_K's of
/// values 0–15 and 16–31). The float operations are the scalar path's
/// (`matvec::decode_row_scalar`): `d · sc` rounded once.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn decode_group(ty: QuantType, fl: u8, row: &[u8], g: usize) -> (__m256i, f32, f32, [f32; 2]) {
    let gpb = ty.block_size() / 32;
    let (b, sub) = (g / gpb, g % gpb);
    let bb = ty.block_bytes();
    let blk = &row[b * bb..(b + 1) * bb];
    let m4 = _mm256_set1_epi8(0x0f);
    match ty {
        QuantType::Q4_0 => {
            let d = rd_f16(blk, 0);
            (nibbles32(blk[2..18].as_ptr(), 0), d, d, [0.0; 2])
        }
        QuantType::Q4_1 => {
            let (d, m) = (rd_f16(blk, 0), rd_f16(blk, 2));
            (nibbles32(blk[4..20].as_ptr(), 0), d, d, [m, 0.0])
        }
        QuantType::Q5_0 => {
            let d = rd_f16(blk, 0);
            (
                quants5_u(rd_u32(blk, 2), blk[6..22].as_ptr()),
                d,
                d,
                [0.0; 2],
            )
        }
        QuantType::Q5_1 => {
            let (d, m) = (rd_f16(blk, 0), rd_f16(blk, 2));
            (
                quants5_u(rd_u32(blk, 4), blk[8..24].as_ptr()),
                d,
                d,
                [m, 0.0],
            )
        }
        QuantType::Q8_0 => {
            let q = load32(blk[2..34].as_ptr());
            let q = if fl & SIGNED != 0 {
                q
            } else {
                // q + 128 as unsigned bytes
                _mm256_xor_si256(q, _mm256_set1_epi8(-128))
            };
            let d = rd_f16(blk, 0);
            (q, d, d, [0.0; 2])
        }
        QuantType::Q4_K | QuantType::Q5_K => {
            let (d, dmin) = (rd_f16(blk, 0), rd_f16(blk, 2));
            let (sc, m) = scale_min_k4(sub, &blk[4..16]);
            // Q5_K: the nibbles after the 32 fifth-bit bytes
            let k5 = ty == QuantType::Q5_K;
            let at = if k5 { 48 } else { 16 } + 32 * (sub / 2);
            let v = load32(blk[at..at + 32].as_ptr());
            let q = if sub % 2 == 1 {
                _mm256_and_si256(_mm256_srli_epi16::<4>(v), m4)
            } else {
                _mm256_and_si256(v, m4)
            };
            let q = if k5 {
                with_fifth_bits(q, load32(blk[16..48].as_ptr()), sub)
            } else {
                q
            };
            let s = d * sc as f32;
            (q, s, s, [-(dmin * m as f32), 0.0])
        }
        _ => {
            // Q2_K, Q3_K and Q6_K: group `sub` of the super-block, unsigned quants (q, q + 4,
            // q + 32), the group's two scales and Q2_K's two mins
            let (h, gq) = (sub / 4, sub % 4);
            let q = match ty {
                QuantType::Q2_K => q2k_group_at(blk, h, gq),
                QuantType::Q3_K => q3k_group_at(blk, h, gq),
                _ => q6k_group_at(blk, h, gq),
            };
            let (d, sc) = (rd_f16(blk, k16_d_at(ty)), k16_scale_bytes(ty, blk));
            let sc = [sc[2 * sub], sc[2 * sub + 1]];
            let (dmin, m) = q2k_mins(ty, blk);
            let coef = [
                -(dmin * f32::from(m[2 * sub])),
                -(dmin * f32::from(m[2 * sub + 1])),
            ];
            (q, d * f32::from(sc[0]), d * f32::from(sc[1]), coef)
        }
    }
}

/// `out[k]` = dword `k` of each of `r[0..8]`: an 8 × 8 transpose of 32-bit words.
#[inline]
#[target_feature(enable = "avx2")]
fn transpose8x8_epi32(r: [__m256i; 8]) -> [__m256i; 8] {
    // pairs of rows interleaved by word, then by two words, then the 128-bit halves swapped
    let t: [__m256i; 8] = std::array::from_fn(|i| {
        let (a, b) = (r[2 * (i / 2)], r[2 * (i / 2) + 1]);
        if i % 2 == 0 {
            _mm256_unpacklo_epi32(a, b)
        } else {
            _mm256_unpackhi_epi32(a, b)
        }
    });
    // u[4h + k] holds words k and k + 4 of rows 4h..4h + 4 (k < 4)
    let u: [__m256i; 8] = std::array::from_fn(|i| {
        let (h, k) = (i / 4, i % 4);
        let (a, b) = (t[4 * h + k / 2], t[4 * h + 2 + k / 2]);
        if k % 2 == 0 {
            _mm256_unpacklo_epi64(a, b)
        } else {
            _mm256_unpackhi_epi64(a, b)
        }
    });
    std::array::from_fn(|k| {
        if k < 4 {
            _mm256_permute2x128_si256::<0x20>(u[k], u[4 + k])
        } else {
            _mm256_permute2x128_si256::<0x31>(u[k - 4], u[k])
        }
    })
}

/// Decodes rows `r0..r0 + nr` (`nr` ≤ 16) of `w` into a panel (see the module documentation);
/// the panel's other rows are zero.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma,f16c")]
fn decode_panel(
    ty: QuantType,
    fl: u8,
    w: &[u8],
    row_bytes: usize,
    r0: usize,
    nr: usize,
    groups: usize,
    panel: &mut [u8],
) {
    let pg = panel_group_bytes(fl);
    let subs = subs(fl);
    assert!(
        nr <= PANEL_ROWS && panel.len() >= groups * pg && w.len() >= (r0 + nr) * row_bytes,
        "decode_panel: shapes"
    );
    let rows: [&[u8]; PANEL_ROWS] = std::array::from_fn(|r| {
        if r < nr {
            &w[(r0 + r) * row_bytes..(r0 + r + 1) * row_bytes]
        } else {
            &[]
        }
    });
    let put = |p: &mut [u8], at: usize, v: &[f32; PANEL_ROWS]| {
        for (r, x) in v.iter().enumerate() {
            p[at + 4 * r..at + 4 * r + 4].copy_from_slice(&x.to_ne_bytes());
        }
    };
    for g in 0..groups {
        let p = &mut panel[g * pg..(g + 1) * pg];
        let mut q = [_mm256_setzero_si256(); PANEL_ROWS];
        let (mut s_lo, mut s_hi) = ([0f32; PANEL_ROWS], [0f32; PANEL_ROWS]);
        let mut coef = [[0f32; PANEL_ROWS]; 2];
        for r in 0..nr {
            let c: [f32; 2];
            (q[r], s_lo[r], s_hi[r], c) = decode_group(ty, fl, rows[r], g);
            (coef[0][r], coef[1][r]) = (c[0], c[1]);
        }
        for half in 0..2 {
            let words = transpose8x8_epi32(std::array::from_fn(|i| q[8 * half + i]));
            for (k, v) in words.into_iter().enumerate() {
                let line = &mut p[64 * k + 32 * half..64 * k + 32 * half + 32];
                // SAFETY: line holds 32 bytes.
                unsafe { _mm256_storeu_si256(line.as_mut_ptr().cast(), v) };
            }
        }
        put(p, 512, &s_lo);
        if subs == 2 {
            put(p, 576, &s_hi);
        }
        if fl & MIN != 0 {
            for (h, c) in coef.iter().take(subs).enumerate() {
                put(p, 512 + 64 * subs + 64 * h, c);
            }
        }
    }
}

// ------------------------------------------------------------------- tiles

/// A tile kernel: `(panel, activation block, groups, first token, out)` writes, for tokens
/// `t0..t0 + T` of the block, the 16 rows' results into `out[0..T]`.
type Tile = unsafe fn(&[u8], &[u8], usize, usize, &mut [[f32; 16]]);

/// Reads the (native-endian) i32 at byte `at` of `p`.
///
/// # Safety
/// `p + at .. p + at + 4` is readable.
#[inline(always)]
unsafe fn rd_i32(p: *const u8, at: usize) -> i32 {
    // SAFETY: as this function's contract.
    unsafe { p.add(at).cast::<i32>().read_unaligned() }
}

/// Reads the f32 at byte `at` of `p`.
///
/// # Safety
/// `p + at .. p + at + 4` is readable.
#[inline(always)]
unsafe fn rd_f32(p: *const u8, at: usize) -> f32 {
    // SAFETY: as this function's contract.
    unsafe { p.add(at).cast::<f32>().read_unaligned() }
}

/// Generates a 512-bit tile kernel: `$dot(acc, w, x)` adds the products of the row line `w`
/// (unsigned bytes) and the broadcast token quants `x` (signed bytes) to `acc`, and
/// `$dot2(acc, w0, x0, w1, x1)` those of two steps, exactly for unsigned quants up to 63.
macro_rules! tile_512 {
    ($name:ident, $feat:literal, $dot:ident, $dot2:ident) => {
        /// One 512-bit tile: 16 rows × `T` tokens (see the module documentation).
        ///
        /// # Safety
        /// The CPU must support the enabled features. The shapes are asserted.
        #[allow(clippy::needless_range_loop)]
        #[target_feature(enable = $feat)]
        unsafe fn $name<const T: usize, const FL: u8>(
            panel: &[u8],
            xb: &[u8],
            groups: usize,
            t0: usize,
            out: &mut [[f32; 16]],
        ) {
            let pg = panel_group_bytes(FL);
            let (od, ob, ox, xg) = pack_offsets(FL, TB512);
            let subs = subs(FL);
            let steps = 8 / subs;
            assert!(
                t0 + T <= TB512
                    && out.len() >= T
                    && panel.len() >= groups * pg
                    && xb.len() >= groups * xg
                    && (panel.as_ptr() as usize).is_multiple_of(64)
                    && pg.is_multiple_of(64),
                "tile: shapes"
            );
            let (pp, xp) = (panel.as_ptr(), xb.as_ptr());
            let zero = _mm512_setzero_si512();
            let mut acc = [_mm512_setzero_ps(); T];
            for g in 0..groups {
                // SAFETY: group g's bytes lie inside the panel and the block (asserted), the
                // tokens t0..t0 + T inside the block's TB512, and the panel lines are aligned.
                unsafe {
                    let pw = pp.add(g * pg);
                    let px = xp.add(g * xg);
                    for h in 0..subs {
                        let mut ia = [zero; T];
                        if FL & BIAS != 0 {
                            for t in 0..T {
                                ia[t] =
                                    _mm512_set1_epi32(rd_i32(px, ob + 4 * (h * TB512 + t0 + t)));
                            }
                        }
                        // steps in pairs: the pair's products may share an i16 (see $dot2)
                        for k in (h * steps..(h + 1) * steps).step_by(2) {
                            let w0 = _mm512_load_si512(pw.add(64 * k).cast());
                            let w1 = _mm512_load_si512(pw.add(64 * k + 64).cast());
                            for t in 0..T {
                                let at = 32 * (t0 + t) + 4 * k;
                                let x0 = _mm512_set1_epi32(rd_i32(px, at));
                                let x1 = _mm512_set1_epi32(rd_i32(px, at + 4));
                                ia[t] = if FL & SIGNED != 0 {
                                    // |w| times x with w's sign
                                    let (n0, n1) =
                                        (_mm512_movepi8_mask(w0), _mm512_movepi8_mask(w1));
                                    let x0 = _mm512_mask_sub_epi8(x0, n0, zero, x0);
                                    let x1 = _mm512_mask_sub_epi8(x1, n1, zero, x1);
                                    let a = $dot(ia[t], _mm512_abs_epi8(w0), x0);
                                    $dot(a, _mm512_abs_epi8(w1), x1)
                                } else {
                                    $dot2(ia[t], w0, x0, w1, x1)
                                };
                            }
                        }
                        let s = _mm512_load_ps(pw.add(512 + 64 * h).cast());
                        for t in 0..T {
                            let dd =
                                _mm512_mul_ps(s, _mm512_set1_ps(rd_f32(px, od + 4 * (t0 + t))));
                            acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia[t]), dd, acc[t]);
                        }
                    }
                }
            }
            if FL & MIN != 0 {
                // the offset term, summed apart and added last (a second pass over the
                // groups: its accumulators would not fit beside the integer ones)
                let mut ext = [_mm512_setzero_ps(); T];
                for g in 0..groups {
                    for h in 0..subs {
                        // SAFETY: as above.
                        unsafe {
                            let c = _mm512_load_ps(pp.add(g * pg + 512 + 64 * (subs + h)).cast());
                            let px = xp.add(g * xg);
                            for t in 0..T {
                                let dx = _mm512_set1_ps(rd_f32(px, od + 4 * (t0 + t)));
                                let sf = _mm512_set1_ps(rd_f32(px, ox + 4 * (h * TB512 + t0 + t)));
                                let e = _mm512_mul_ps(_mm512_mul_ps(c, dx), sf);
                                ext[t] = _mm512_add_ps(ext[t], e);
                            }
                        }
                    }
                }
                for t in 0..T {
                    acc[t] = _mm512_add_ps(acc[t], ext[t]);
                }
            }
            for t in 0..T {
                // SAFETY: out[t] holds 16 f32.
                unsafe { _mm512_storeu_ps(out[t].as_mut_ptr(), acc[t]) };
            }
        }
    };
}

/// `acc + Σ w·x` per i32 lane (four byte products each) by VNNI.
#[inline]
#[target_feature(enable = "avx512f,avx512vnni")]
fn dot_512vnni(acc: __m512i, w: __m512i, x: __m512i) -> __m512i {
    _mm512_dpbusd_epi32(acc, w, x)
}

/// `acc + Σ w·x` per i32 lane by `pmaddubsw` + `pmaddwd` (exact: no i16 pair overflows, see
/// the module documentation).
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
fn dot_512bw(acc: __m512i, w: __m512i, x: __m512i) -> __m512i {
    let p = _mm512_maddubs_epi16(w, x);
    _mm512_add_epi32(acc, _mm512_madd_epi16(p, _mm512_set1_epi16(1)))
}

/// Two steps of [`dot_512vnni`].
#[inline]
#[target_feature(enable = "avx512f,avx512vnni")]
fn dot2_512vnni(acc: __m512i, w0: __m512i, x0: __m512i, w1: __m512i, x1: __m512i) -> __m512i {
    _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(acc, w0, x0), w1, x1)
}

/// Two steps of [`dot_512bw`] with one `pmaddwd`: the two steps' `pmaddubsw` pairs are added
/// in i16, exact for unsigned quants up to 63 (4 · 63 · 127 = 32004).
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
fn dot2_512bw(acc: __m512i, w0: __m512i, x0: __m512i, w1: __m512i, x1: __m512i) -> __m512i {
    let p = _mm512_add_epi16(_mm512_maddubs_epi16(w0, x0), _mm512_maddubs_epi16(w1, x1));
    _mm512_add_epi32(acc, _mm512_madd_epi16(p, _mm512_set1_epi16(1)))
}

tile_512!(
    tile_512_vnni,
    "avx512f,avx512bw,avx512vnni,avx2,fma",
    dot_512vnni,
    dot2_512vnni
);
tile_512!(
    tile_512_bw,
    "avx512f,avx512bw,avx2,fma",
    dot_512bw,
    dot2_512bw
);

/// Generates a 256-bit tile kernel: as [`tile_512!`], each token's 16 rows in two vectors.
macro_rules! tile_256 {
    ($name:ident, $feat:literal, $dot:ident, $dot2:ident) => {
        /// One 256-bit tile: 16 rows × `T` tokens (see the module documentation).
        ///
        /// # Safety
        /// The CPU must support the enabled features. The shapes are asserted.
        #[allow(clippy::needless_range_loop)]
        #[target_feature(enable = $feat)]
        unsafe fn $name<const T: usize, const FL: u8>(
            panel: &[u8],
            xb: &[u8],
            groups: usize,
            t0: usize,
            out: &mut [[f32; 16]],
        ) {
            let pg = panel_group_bytes(FL);
            let (od, ob, ox, xg) = pack_offsets(FL, TB256);
            let subs = subs(FL);
            let steps = 8 / subs;
            assert!(
                t0 + T <= TB256
                    && out.len() >= T
                    && panel.len() >= groups * pg
                    && xb.len() >= groups * xg
                    && (panel.as_ptr() as usize).is_multiple_of(64)
                    && pg.is_multiple_of(64),
                "tile: shapes"
            );
            let (pp, xp) = (panel.as_ptr(), xb.as_ptr());
            let zero = _mm256_setzero_si256();
            let mut acc = [[_mm256_setzero_ps(); 2]; T];
            for g in 0..groups {
                // SAFETY: as tile_512!.
                unsafe {
                    let pw = pp.add(g * pg);
                    let px = xp.add(g * xg);
                    for h in 0..subs {
                        let mut ia = [[zero; 2]; T];
                        if FL & BIAS != 0 {
                            for t in 0..T {
                                let b =
                                    _mm256_set1_epi32(rd_i32(px, ob + 4 * (h * TB256 + t0 + t)));
                                ia[t] = [b, b];
                            }
                        }
                        // steps in pairs: the pair's products may share an i16 (see $dot2)
                        for k in (h * steps..(h + 1) * steps).step_by(2) {
                            let w: [[__m256i; 2]; 2] = std::array::from_fn(|j| {
                                std::array::from_fn(|v| {
                                    _mm256_load_si256(pw.add(64 * (k + j) + 32 * v).cast())
                                })
                            });
                            for t in 0..T {
                                let at = 32 * (t0 + t) + 4 * k;
                                let x0 = _mm256_set1_epi32(rd_i32(px, at));
                                let x1 = _mm256_set1_epi32(rd_i32(px, at + 4));
                                for v in 0..2 {
                                    let (w0, w1) = (w[0][v], w[1][v]);
                                    ia[t][v] = if FL & SIGNED != 0 {
                                        // |w| times x with w's sign
                                        let a = $dot(
                                            ia[t][v],
                                            _mm256_sign_epi8(w0, w0),
                                            _mm256_sign_epi8(x0, w0),
                                        );
                                        $dot(a, _mm256_sign_epi8(w1, w1), _mm256_sign_epi8(x1, w1))
                                    } else {
                                        $dot2(ia[t][v], w0, x0, w1, x1)
                                    };
                                }
                            }
                        }
                        let s: [__m256; 2] = std::array::from_fn(|v| {
                            _mm256_load_ps(pw.add(512 + 64 * h + 32 * v).cast())
                        });
                        for t in 0..T {
                            let dx = _mm256_set1_ps(rd_f32(px, od + 4 * (t0 + t)));
                            for v in 0..2 {
                                let dd = _mm256_mul_ps(s[v], dx);
                                acc[t][v] =
                                    _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia[t][v]), dd, acc[t][v]);
                            }
                        }
                    }
                }
            }
            if FL & MIN != 0 {
                // the offset term, summed apart and added last, as tile_512!
                let mut ext = [[_mm256_setzero_ps(); 2]; T];
                for g in 0..groups {
                    for h in 0..subs {
                        // SAFETY: as above.
                        unsafe {
                            let px = xp.add(g * xg);
                            for v in 0..2 {
                                let at = g * pg + 512 + 64 * (subs + h) + 32 * v;
                                let c = _mm256_load_ps(pp.add(at).cast());
                                for t in 0..T {
                                    let dx = _mm256_set1_ps(rd_f32(px, od + 4 * (t0 + t)));
                                    let sf =
                                        _mm256_set1_ps(rd_f32(px, ox + 4 * (h * TB256 + t0 + t)));
                                    let e = _mm256_mul_ps(_mm256_mul_ps(c, dx), sf);
                                    ext[t][v] = _mm256_add_ps(ext[t][v], e);
                                }
                            }
                        }
                    }
                }
                for t in 0..T {
                    for v in 0..2 {
                        acc[t][v] = _mm256_add_ps(acc[t][v], ext[t][v]);
                    }
                }
            }
            for t in 0..T {
                for v in 0..2 {
                    // SAFETY: out[t] holds 16 f32.
                    unsafe { _mm256_storeu_ps(out[t].as_mut_ptr().add(8 * v), acc[t][v]) };
                }
            }
        }
    };
}

/// `acc + Σ w·x` per i32 lane by AVX-VNNI.
#[inline]
#[target_feature(enable = "avx2,avxvnni")]
fn dot_avxvnni(acc: __m256i, w: __m256i, x: __m256i) -> __m256i {
    _mm256_dpbusd_avx_epi32(acc, w, x)
}

/// `acc + Σ w·x` per i32 lane by `pmaddubsw` + `pmaddwd` (exact, as [`dot_512bw`]).
#[inline]
#[target_feature(enable = "avx2")]
fn dot_avx2(acc: __m256i, w: __m256i, x: __m256i) -> __m256i {
    let p = _mm256_maddubs_epi16(w, x);
    _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_set1_epi16(1)))
}

/// Two steps of [`dot_avxvnni`].
#[inline]
#[target_feature(enable = "avx2,avxvnni")]
fn dot2_avxvnni(acc: __m256i, w0: __m256i, x0: __m256i, w1: __m256i, x1: __m256i) -> __m256i {
    _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(acc, w0, x0), w1, x1)
}

/// Two steps of [`dot_avx2`] with one `pmaddwd` (exact as [`dot2_512bw`]).
#[inline]
#[target_feature(enable = "avx2")]
fn dot2_avx2(acc: __m256i, w0: __m256i, x0: __m256i, w1: __m256i, x1: __m256i) -> __m256i {
    let p = _mm256_add_epi16(_mm256_maddubs_epi16(w0, x0), _mm256_maddubs_epi16(w1, x1));
    _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_set1_epi16(1)))
}

tile_256!(tile_256_vnni, "avx2,fma,avxvnni", dot_avxvnni, dot2_avxvnni);
tile_256!(tile_256_avx2, "avx2,fma", dot_avx2, dot2_avx2);

/// The tile kernels of one family for flavour `fl`, `T` = 12, 8, 4, 2, 1 (512-bit) or 3, 2,
/// 1 (256-bit); [`run_tokens`] splits a block's tokens over them.
fn tiles(wide: bool, vnni: bool, fl: u8) -> &'static [(usize, Tile)] {
    macro_rules! set {
        ($f:ident, $fl:ident, [$($t:literal),*]) => {{
            const S: &[(usize, Tile)] = &[$(($t, $f::<$t, $fl> as Tile)),*];
            S
        }};
    }
    macro_rules! by_fl {
        ($f:ident, [$($t:literal),*]) => {
            match fl {
                FL_BIAS => set!($f, FL_BIAS, [$($t),*]),
                FL_MIN => set!($f, FL_MIN, [$($t),*]),
                FL_K16 => set!($f, FL_K16, [$($t),*]),
                FL_K16_MIN => set!($f, FL_K16_MIN, [$($t),*]),
                _ => set!($f, FL_SIGNED, [$($t),*]),
            }
        };
    }
    match (wide, vnni) {
        (true, true) => by_fl!(tile_512_vnni, [12, 8, 4, 2, 1]),
        (true, false) => by_fl!(tile_512_bw, [12, 8, 4, 2, 1]),
        (false, true) => by_fl!(tile_256_vnni, [3, 2, 1]),
        (false, false) => by_fl!(tile_256_avx2, [3, 2, 1]),
    }
}

// ------------------------------------------------------------------- driver

/// `y = W x` in Q8 mode with the tile kernels: `w` is `rows × cols` of `ty` (a Q8-mode type,
/// shapes checked by the caller), `x` is `n_tok × cols` and `y` is `n_tok × rows`. Uses the
/// 512-bit kernels at [`Isa::Avx512`] and the 256-bit ones at [`Isa::Avx2`], with VNNI when
/// `vnni` names the matching extension.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C (and AVX-512F/BW at [`Isa::Avx512`], and the VNNI
/// extension `vnni` names).
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn q8_matmul(
    isa: Isa,
    vnni: Option<Vnni>,
    ty: QuantType,
    w: &[u8],
    rows: usize,
    cols: usize,
    x: &[f32],
    n_tok: usize,
    y: &mut [f32],
) {
    if rows == 0 || cols == 0 || n_tok == 0 {
        y.fill(0.0);
        return;
    }
    let wide = isa.has_avx512();
    let use_vnni = matches!(
        (wide, vnni),
        (true, Some(Vnni::Avx512Vnni)) | (false, Some(Vnni::AvxVnni))
    );
    let (fl, off) = flavour(ty, use_vnni);
    let tb = if wide { TB512 } else { TB256 };
    let groups = cols / 32;
    let row_bytes = cols / ty.block_size() * ty.block_bytes();
    assert!(
        w.len() == rows * row_bytes && x.len() == n_tok * cols && y.len() == n_tok * rows,
        "q8_matmul: shapes"
    );
    // the activations, quantised and laid out once, a block of tb tokens per task
    let (.., xg) = pack_offsets(fl, tb);
    let blk_bytes = groups * xg;
    let n_blocks = n_tok.div_ceil(tb);
    let mut pack = vec![0u8; n_blocks * blk_bytes];
    pack.par_chunks_mut(blk_bytes)
        .zip(x.par_chunks(tb * cols))
        // SAFETY: AVX2, FMA and F16C (this function's contract).
        .for_each(|(o, xs)| unsafe { pack_block(fl, off, tb, xs, cols, o) });
    // Tasks: a panel of 16 rows × a run of token blocks. Each panel meets all tokens in one
    // task unless there are too few panels to keep every thread busy.
    let panels = rows.div_ceil(PANEL_ROWS);
    let want = 4 * rayon::current_num_threads();
    let per_chunk = n_blocks.div_ceil(want.div_ceil(panels).min(n_blocks));
    let chunks = n_blocks.div_ceil(per_chunk);
    let pg = panel_group_bytes(fl);
    let kernels = tiles(wide, use_vnni, fl);
    let out = super::SharedOut::new(y);
    (0..panels * chunks)
        .into_par_iter()
        .for_each_init(Vec::<Line>::new, |buf, task| {
            let (p, c) = (task / chunks, task % chunks);
            let (r0, nr) = (p * PANEL_ROWS, PANEL_ROWS.min(rows - p * PANEL_ROWS));
            buf.resize(groups * pg / 64, Line([0; 64]));
            let panel = line_bytes_mut(buf);
            // SAFETY: AVX2, FMA and F16C (this function's contract).
            unsafe { decode_panel(ty, fl, w, row_bytes, r0, nr, groups, panel) };
            let panel = line_bytes(buf);
            let mut tile = [[0f32; 16]; TB512];
            for b in c * per_chunk..((c + 1) * per_chunk).min(n_blocks) {
                let xb = &pack[b * blk_bytes..(b + 1) * blk_bytes];
                let nt = tb.min(n_tok - b * tb);
                let mut t = 0;
                for &(size, kernel) in kernels {
                    while nt - t >= size {
                        // SAFETY: the kernel's features are this function's contract (tiles
                        // picked the family from `wide` and `use_vnni`); it asserts its shapes.
                        unsafe { kernel(panel, xb, groups, t, &mut tile) };
                        for (j, tr) in tile[..size].iter().enumerate() {
                            let at = (b * tb + t + j) * rows + r0;
                            // SAFETY: this task alone writes rows r0..r0 + nr of token
                            // b·tb + t + j.
                            unsafe { out.write(at, &tr[..nr]) };
                        }
                        t += size;
                    }
                }
            }
        });
}
