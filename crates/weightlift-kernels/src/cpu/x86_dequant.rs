//! AVX2 and AVX-512 dequantisation of every block type to f32 or f16, selected at run time by
//! [`Isa`](super::Isa).
//!
//! Each kernel decodes a block in registers with the same float operations, in the same order,
//! as the scalar decoders in `dequant_scalar` (multiply, then add or subtract, never fused; Rust
//! does not contract `mul` + `add` into FMA), so the f32 results are bit-identical to them and
//! to gguf-py. The f16 form rounds those same f32 vectors with `vcvtps2ph` and an immediate
//! round-to-nearest-even mode (MXCSR plays no part), which is what the scalar `half`
//! conversion does, so it equals converting the f32 result afterwards, without the second pass.
// The std::arch intrinsics are unsafe to call: they need the CPU features that `Isa` checked at
// run time, and raw pointers into slices whose bounds each kernel checks first.

use std::arch::x86_64::*;

use super::DqOut;
use super::dequant_scalar::{IQ4NL_VALUES, scale_min_k4};
use super::x86::imp::{bytes16_to_f32x16, i8x32_to_f32, q6k_group, rd_f16_int, u8x32_to_f32};
use crate::types::QuantType;

/// Whether [`dequant_avx2`] has a vector path for `ty` (every type but F32).
pub(crate) fn has_avx2(ty: QuantType) -> bool {
    ty != QuantType::F32
}

/// Whether [`dequant_avx512`] runs for `ty` with output `T` at the AVX-512 level: where it
/// measured faster than [`dequant_avx2`] (1 thread, on the bench machine, values in L2).
///
/// - To f16, the types whose (sub-)blocks have at most 64 codes go through per-block f16 code
///   tables and `vpermw` ([`dequant_f16_lut`]): 7 % (Q5_K) to 58 % (Q4_1) faster than the
///   256-bit form. Q8_0 (256 codes per block) and Q6_K (64 codes per 16 values) gain nothing
///   from tables or 512-bit conversion; F16 and BF16 are bound by memory at 256 bits.
/// - To f32, every type is bound by the stores at 256 bits already; the 512-bit forms
///   measured 0-30 % slower (Q2_K and Q3_K included), so they are not dispatched.
///
/// Every type has a 512-bit form all the same, tested bit-exact against gguf-py below, so
/// this choice can change with the hardware.
pub(crate) fn has_avx512<T: DqOut>(ty: QuantType) -> bool {
    T::F16 && has_lut(ty)
}

/// Stores 8 values at element `i` of `out`: f32 as they are, or rounded to f16.
///
/// # Safety
/// `out.add(i)` has 8 writable elements, 16-byte aligned when `NT`; AVX2 and F16C are present.
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn put8<T: DqOut, const NT: bool>(out: *mut T, i: usize, v: __m256) {
    // SAFETY: the caller's contract above.
    unsafe {
        if T::F16 {
            let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(v);
            let p = out.add(i).cast::<__m128i>();
            if NT {
                _mm_stream_si128(p, h);
            } else {
                _mm_storeu_si128(p, h);
            }
        } else {
            let p = out.add(i).cast::<f32>();
            if NT {
                _mm_stream_ps(p, _mm256_castps256_ps128(v));
                _mm_stream_ps(p.add(4), _mm256_extractf128_ps::<1>(v));
            } else {
                _mm256_storeu_ps(p, v);
            }
        }
    }
}

/// Stores one value at element `i` of `out` (the tails of F16 and BF16 input).
///
/// # Safety
/// `out.add(i)` is writable.
#[inline]
unsafe fn put1<T: DqOut>(out: *mut T, i: usize, x: f32) {
    // SAFETY: the caller's contract above.
    unsafe { out.add(i).write(T::from_f32(x)) }
}

/// Nibbles of 16 bytes: (low nibbles, high nibbles) as 16-byte vectors.
///
/// # Safety
/// `p` points at 16 readable bytes.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn nibbles16(p: *const u8) -> (__m128i, __m128i) {
    // SAFETY: the caller's contract above.
    let v = unsafe { _mm_loadu_si128(p.cast()) };
    let m = _mm_set1_epi8(0x0f);
    (
        _mm_and_si128(v, m),
        _mm_and_si128(_mm_srli_epi16::<4>(v), m),
    )
}

/// Writes the 16 bytes of `v` (signed or unsigned per `signed`) times `d`, plus `m` when given,
/// at element `i` of `out`.
///
/// # Safety
/// As [`put8`], for 16 elements.
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn store16<T: DqOut, const NT: bool>(
    v: __m128i,
    signed: bool,
    d: __m256,
    m: Option<__m256>,
    out: *mut T,
    i: usize,
) {
    let (a, b) = if signed {
        (
            _mm256_cvtepi8_epi32(v),
            _mm256_cvtepi8_epi32(_mm_srli_si128::<8>(v)),
        )
    } else {
        (
            _mm256_cvtepu8_epi32(v),
            _mm256_cvtepu8_epi32(_mm_srli_si128::<8>(v)),
        )
    };
    let mut fa = _mm256_mul_ps(d, _mm256_cvtepi32_ps(a));
    let mut fb = _mm256_mul_ps(d, _mm256_cvtepi32_ps(b));
    if let Some(m) = m {
        fa = _mm256_add_ps(fa, m);
        fb = _mm256_add_ps(fb, m);
    }
    // SAFETY: the caller's contract above.
    unsafe {
        put8::<T, NT>(out, i, fa);
        put8::<T, NT>(out, i + 8, fb);
    }
}

/// The 32 fifth bits of a Q5_0/Q5_1 block (u32 `qh`, bit i for value i) as bytes 0 or 16.
#[inline]
#[target_feature(enable = "avx2")]
fn q5_high_bits(qh: u32) -> __m256i {
    // byte i takes byte i/8 of qh, then tests bit i%8
    let v = _mm256_set1_epi32(qh as i32);
    let spread = _mm256_shuffle_epi8(
        v,
        _mm256_setr_epi8(
            0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3,
            3, 3, 3,
        ),
    );
    let bits = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
    let set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bits), bits);
    _mm256_and_si256(set, _mm256_set1_epi8(16))
}

/// Loads 32 bytes from the start of `b` (which holds at least 32).
#[inline]
#[target_feature(enable = "avx2")]
fn load32(b: &[u8]) -> __m256i {
    assert!(b.len() >= 32);
    // SAFETY: 32 readable bytes, checked above.
    unsafe { _mm256_loadu_si256(b.as_ptr().cast()) }
}

/// The 16 products `d · float(byte_k)` of 16 signed or unsigned bytes, in block order.
#[inline]
#[target_feature(enable = "avx2")]
fn scaled16(d: f32, v: __m128i, signed: bool) -> [f32; 16] {
    let (a, b) = if signed {
        (
            _mm256_cvtepi8_epi32(v),
            _mm256_cvtepi8_epi32(_mm_srli_si128::<8>(v)),
        )
    } else {
        (
            _mm256_cvtepu8_epi32(v),
            _mm256_cvtepu8_epi32(_mm_srli_si128::<8>(v)),
        )
    };
    let dv = _mm256_set1_ps(d);
    let mut out = [0f32; 16];
    // SAFETY: `out` holds 16 f32.
    unsafe {
        _mm256_storeu_ps(out.as_mut_ptr(), _mm256_mul_ps(dv, _mm256_cvtepi32_ps(a)));
        _mm256_storeu_ps(
            out.as_mut_ptr().add(8),
            _mm256_mul_ps(dv, _mm256_cvtepi32_ps(b)),
        );
    }
    out
}

/// Q2_K's 16 sub-block factors: `d · (scale & 15)` and `dmin · (scale >> 4)` per 16 values,
/// the same f32 products as the scalar decoder.
#[inline]
#[target_feature(enable = "avx2,f16c")]
fn q2k_factors(blk: &[u8]) -> ([f32; 16], [f32; 16]) {
    let d = rd_f16_int(blk, 80);
    let dmin = rd_f16_int(blk, 82);
    // SAFETY: the 16 scale bytes open the block.
    let sc = unsafe { _mm_loadu_si128(blk[..16].as_ptr().cast()) };
    let m4 = _mm_set1_epi8(0x0f);
    (
        scaled16(d, _mm_and_si128(sc, m4), false),
        scaled16(dmin, _mm_and_si128(_mm_srli_epi16::<4>(sc), m4), false),
    )
}

/// Q3_K's 16 signed 6-bit scales (bytes 96..108, ggml-common.h's packing) minus 32, as
/// bytes of one vector: the same values as `q3k_scales`, unpacked in registers (a byte-wise
/// array on the stack read back as a vector stalls on store forwarding).
#[inline]
#[target_feature(enable = "avx2")]
fn q3k_scales_vec(blk: &[u8]) -> __m128i {
    let s = &blk[96..108];
    let a = u64::from_le_bytes([s[0], s[1], s[2], s[3], s[4], s[5], s[6], s[7]]);
    let b = u64::from(u32::from_le_bytes([s[8], s[9], s[10], s[11]]));
    const NIB: u64 = 0x0f0f_0f0f_0f0f_0f0f;
    const TWO: u64 = 0x0303_0303;
    // scale i: low 4 bits from byte i (i < 8) or the high nibble of byte i - 8; high 2 bits
    // are bits 2(i/4)..2(i/4)+2 of byte 8 + i%4
    let lo0 = a & NIB;
    let lo1 = (a >> 4) & NIB;
    let hi0 = (b & TWO) | (((b >> 2) & TWO) << 32);
    let hi1 = ((b >> 4) & TWO) | (((b >> 6) & TWO) << 32);
    let v = _mm_set_epi64x((lo1 | (hi1 << 4)) as i64, (lo0 | (hi0 << 4)) as i64);
    _mm_sub_epi8(v, _mm_set1_epi8(32))
}

/// Q3_K's 16 sub-block factors `d · scale`.
#[inline]
#[target_feature(enable = "avx2,f16c")]
fn q3k_factors(blk: &[u8]) -> [f32; 16] {
    scaled16(rd_f16_int(blk, 108), q3k_scales_vec(blk), true)
}

/// 256-bit dequantisation of whole blocks into f32 or f16 elements.
///
/// With `NT`, stores bypass the cache (`movntps` / `movntdq`): for outputs far larger than L2
/// this saves the read-for-ownership of every output line. `NT` needs `out` 16-byte aligned.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C, and `has_avx2(ty)` must hold.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn dequant_avx2<T: DqOut, const NT: bool>(
    ty: QuantType,
    src: &[u8],
    out: &mut [T],
) {
    let (bb, bs) = (ty.block_bytes(), ty.block_size());
    let n = src.len() / bb;
    assert!(out.len() >= n * bs, "dequant_avx2: output too short");
    assert!(
        !NT || (out.as_ptr() as usize).is_multiple_of(16),
        "dequant_avx2: streaming stores need 16-byte alignment"
    );
    let sp = src.as_ptr();
    let op = out.as_mut_ptr();
    match ty {
        QuantType::F16 | QuantType::BF16 => {
            let mut i = 0;
            while i + 8 <= n {
                // SAFETY: i + 8 <= n elements of 2 bytes in, 8 elements out.
                unsafe {
                    let h = _mm_loadu_si128(sp.add(2 * i).cast());
                    let v = if ty == QuantType::F16 {
                        _mm256_cvtph_ps(h)
                    } else {
                        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
                    };
                    put8::<T, NT>(op, i, v);
                }
                i += 8;
            }
            for j in i..n {
                let h = u16::from_le_bytes([src[2 * j], src[2 * j + 1]]);
                let x = if ty == QuantType::F16 {
                    crate::cpu::half::f16_to_f32(h)
                } else {
                    crate::cpu::half::bf16_to_f32(h)
                };
                // SAFETY: j < n <= out.len().
                unsafe { put1(op, j, x) };
            }
        }
        QuantType::Q4_0 | QuantType::Q4_1 | QuantType::IQ4_NL => {
            let eight = _mm_set1_epi8(8);
            // SAFETY: the table is 16 bytes.
            let table = unsafe { _mm_loadu_si128(IQ4NL_VALUES.as_ptr().cast()) };
            for (b, blk) in src.chunks_exact(bb).enumerate() {
                let d = _mm256_set1_ps(rd_f16_int(blk, 0));
                let o = b * 32;
                // SAFETY: each block has 16 bytes of nibbles at its end and 32 elements of
                // output; b < n keeps both in bounds.
                unsafe {
                    match ty {
                        QuantType::Q4_0 => {
                            let (lo, hi) = nibbles16(blk.as_ptr().add(2));
                            store16::<T, NT>(_mm_sub_epi8(lo, eight), true, d, None, op, o);
                            store16::<T, NT>(_mm_sub_epi8(hi, eight), true, d, None, op, o + 16);
                        }
                        QuantType::Q4_1 => {
                            let m = Some(_mm256_set1_ps(rd_f16_int(blk, 2)));
                            let (lo, hi) = nibbles16(blk.as_ptr().add(4));
                            store16::<T, NT>(lo, false, d, m, op, o);
                            store16::<T, NT>(hi, false, d, m, op, o + 16);
                        }
                        _ => {
                            let (lo, hi) = nibbles16(blk.as_ptr().add(2));
                            let (lo, hi) =
                                (_mm_shuffle_epi8(table, lo), _mm_shuffle_epi8(table, hi));
                            store16::<T, NT>(lo, true, d, None, op, o);
                            store16::<T, NT>(hi, true, d, None, op, o + 16);
                        }
                    }
                }
            }
        }
        QuantType::Q8_0 => {
            for (b, blk) in src.chunks_exact(bb).enumerate() {
                let d = _mm256_set1_ps(rd_f16_int(blk, 0));
                let f = i8x32_to_f32(load32(&blk[2..]));
                for (k, v) in f.iter().enumerate() {
                    // SAFETY: 32 elements out per block, b < n.
                    unsafe { put8::<T, NT>(op, b * 32 + 8 * k, _mm256_mul_ps(*v, d)) };
                }
            }
        }
        QuantType::Q5_0 | QuantType::Q5_1 => {
            let m4 = _mm_set1_epi8(0x0f);
            let k16 = _mm256_set1_epi8(16);
            let (qh_at, qs_at) = if ty == QuantType::Q5_0 {
                (2, 6)
            } else {
                (4, 8)
            };
            for (b, blk) in src.chunks_exact(bb).enumerate() {
                let d = _mm256_set1_ps(rd_f16_int(blk, 0));
                let qh = u32::from_le_bytes([
                    blk[qh_at],
                    blk[qh_at + 1],
                    blk[qh_at + 2],
                    blk[qh_at + 3],
                ]);
                // SAFETY: 16 bytes of nibbles at qs_at inside the block.
                let v = unsafe { _mm_loadu_si128(blk[qs_at..qs_at + 16].as_ptr().cast()) };
                let lo = _mm_and_si128(v, m4);
                let hi = _mm_and_si128(_mm_srli_epi16::<4>(v), m4);
                let q = _mm256_or_si256(_mm256_set_m128i(hi, lo), q5_high_bits(qh));
                let o = b * 32;
                if ty == QuantType::Q5_0 {
                    let f = i8x32_to_f32(_mm256_sub_epi8(q, k16));
                    for (k, v) in f.iter().enumerate() {
                        // SAFETY: 32 elements out per block, b < n.
                        unsafe { put8::<T, NT>(op, o + 8 * k, _mm256_mul_ps(d, *v)) };
                    }
                } else {
                    let m = _mm256_set1_ps(rd_f16_int(blk, 2));
                    let f = u8x32_to_f32(q);
                    for (k, v) in f.iter().enumerate() {
                        let x = _mm256_add_ps(_mm256_mul_ps(d, *v), m);
                        // SAFETY: as above.
                        unsafe { put8::<T, NT>(op, o + 8 * k, x) };
                    }
                }
            }
        }
        QuantType::Q2_K => {
            // value 128h + 32s + l is bits 2s..2s+2 of qs[32h + l]; factors per 16 values
            let m3 = _mm256_set1_epi8(3);
            for (b, blk) in src.chunks_exact(bb).enumerate() {
                let (dl, ml) = q2k_factors(blk);
                for h in 0..2 {
                    let mut v = load32(&blk[16 + 32 * h..]);
                    for s in 0..4 {
                        let f = u8x32_to_f32(_mm256_and_si256(v, m3));
                        let e0 = 128 * h + 32 * s;
                        let k = e0 / 16;
                        let (d0, m0) = (_mm256_set1_ps(dl[k]), _mm256_set1_ps(ml[k]));
                        let (d1, m1) = (_mm256_set1_ps(dl[k + 1]), _mm256_set1_ps(ml[k + 1]));
                        let o = b * 256 + e0;
                        // SAFETY: 256 elements out per block, b < n.
                        unsafe {
                            put8::<T, NT>(op, o, _mm256_sub_ps(_mm256_mul_ps(d0, f[0]), m0));
                            put8::<T, NT>(op, o + 8, _mm256_sub_ps(_mm256_mul_ps(d0, f[1]), m0));
                            put8::<T, NT>(op, o + 16, _mm256_sub_ps(_mm256_mul_ps(d1, f[2]), m1));
                            put8::<T, NT>(op, o + 24, _mm256_sub_ps(_mm256_mul_ps(d1, f[3]), m1));
                        }
                        // each 16-bit lane shifts its two bytes alike; the mask drops the spill
                        v = _mm256_srli_epi16::<2>(v);
                    }
                }
            }
        }
        QuantType::Q3_K => {
            // value 128h + 32s + l: low bits from qs[32h + l] >> 2s, high bit (inverted: clear
            // means minus 4) from bit 4h + s of hmask[l]
            let m3 = _mm256_set1_epi8(3);
            let four = _mm256_set1_epi8(4);
            let zero = _mm256_setzero_si256();
            for (b, blk) in src.chunks_exact(bb).enumerate() {
                let dl = q3k_factors(blk);
                let hm = load32(blk);
                let mut bit = _mm256_set1_epi8(1);
                for h in 0..2 {
                    let mut v = load32(&blk[32 + 32 * h..]);
                    for s in 0..4 {
                        let clear = _mm256_cmpeq_epi8(_mm256_and_si256(hm, bit), zero);
                        let q =
                            _mm256_sub_epi8(_mm256_and_si256(v, m3), _mm256_and_si256(clear, four));
                        let f = i8x32_to_f32(q);
                        let e0 = 128 * h + 32 * s;
                        let k = e0 / 16;
                        let (d0, d1) = (_mm256_set1_ps(dl[k]), _mm256_set1_ps(dl[k + 1]));
                        let o = b * 256 + e0;
                        // SAFETY: 256 elements out per block, b < n.
                        unsafe {
                            put8::<T, NT>(op, o, _mm256_mul_ps(d0, f[0]));
                            put8::<T, NT>(op, o + 8, _mm256_mul_ps(d0, f[1]));
                            put8::<T, NT>(op, o + 16, _mm256_mul_ps(d1, f[2]));
                            put8::<T, NT>(op, o + 24, _mm256_mul_ps(d1, f[3]));
                        }
                        v = _mm256_srli_epi16::<2>(v);
                        bit = _mm256_add_epi8(bit, bit);
                    }
                }
            }
        }
        QuantType::Q4_K | QuantType::Q5_K => {
            let mask = _mm256_set1_epi8(0x0f);
            let one = _mm256_set1_epi8(1);
            let qs_at = if ty == QuantType::Q4_K { 16 } else { 48 };
            for (b, blk) in src.chunks_exact(bb).enumerate() {
                let d = rd_f16_int(blk, 0);
                let dmin = rd_f16_int(blk, 2);
                let scales = &blk[4..16];
                // Q5_K's fifth bits: bit sb of qh[l] for value 32·sb + l
                let mut qh = if ty == QuantType::Q5_K {
                    load32(&blk[16..48])
                } else {
                    _mm256_setzero_si256()
                };
                for c in 0..4 {
                    let v = load32(&blk[qs_at + 32 * c..]);
                    let halves = [
                        _mm256_and_si256(v, mask),
                        _mm256_and_si256(_mm256_srli_epi16::<4>(v), mask),
                    ];
                    for (h, mut q) in halves.into_iter().enumerate() {
                        let sb = 2 * c + h;
                        if ty == QuantType::Q5_K {
                            let bit = _mm256_and_si256(qh, one);
                            q = _mm256_or_si256(q, _mm256_slli_epi16::<4>(bit));
                            qh = _mm256_srli_epi16::<1>(qh);
                        }
                        let (sc, m) = scale_min_k4(sb, scales);
                        let d1 = _mm256_set1_ps(d * sc as f32);
                        let m1 = _mm256_set1_ps(dmin * m as f32);
                        for (k, f) in u8x32_to_f32(q).iter().enumerate() {
                            let x = _mm256_sub_ps(_mm256_mul_ps(d1, *f), m1);
                            // SAFETY: 256 elements out per block, b < n.
                            unsafe { put8::<T, NT>(op, b * 256 + sb * 32 + 8 * k, x) };
                        }
                    }
                }
            }
        }
        QuantType::Q6_K => {
            let k32 = _mm256_set1_epi8(32);
            for (b, blk) in src.chunks_exact(bb).enumerate() {
                let d = rd_f16_int(blk, 208);
                for h in 0..2 {
                    // ql is bytes 0..128, qh 128..192
                    let qh = load32(&blk[128 + 32 * h..]);
                    for g in 0..4 {
                        let ql = load32(&blk[64 * h + 32 * (g % 2)..]);
                        let q = _mm256_sub_epi8(q6k_group(ql, qh, g), k32);
                        let f = i8x32_to_f32(q);
                        let e0 = 128 * h + 32 * g;
                        let s0 = d * (blk[192 + e0 / 16] as i8) as f32;
                        let s1 = d * (blk[192 + e0 / 16 + 1] as i8) as f32;
                        let (d0, d1) = (_mm256_set1_ps(s0), _mm256_set1_ps(s1));
                        let o = b * 256 + e0;
                        // SAFETY: 256 elements out per block, b < n.
                        unsafe {
                            put8::<T, NT>(op, o, _mm256_mul_ps(d0, f[0]));
                            put8::<T, NT>(op, o + 8, _mm256_mul_ps(d0, f[1]));
                            put8::<T, NT>(op, o + 16, _mm256_mul_ps(d1, f[2]));
                            put8::<T, NT>(op, o + 24, _mm256_mul_ps(d1, f[3]));
                        }
                    }
                }
            }
        }
        QuantType::F32 => {
            for (j, c) in src.chunks_exact(4).enumerate() {
                // SAFETY: j < n <= out.len().
                unsafe { put1(op, j, f32::from_le_bytes([c[0], c[1], c[2], c[3]])) };
            }
        }
    }
    if NT {
        // order the non-temporal stores before anything that follows
        _mm_sfence();
    }
}

/// Stores 16 values at element `i` of `out`: f32 as they are, or rounded to f16.
///
/// # Safety
/// `out.add(i)` has 16 writable elements, 16-byte aligned when `NT`; AVX-512F/VL is present.
#[inline]
#[target_feature(enable = "avx512f,avx512vl,avx2,f16c")]
unsafe fn put16<T: DqOut, const NT: bool>(out: *mut T, i: usize, v: __m512) {
    // SAFETY: the caller's contract above. Streaming stores go out 16 bytes at a time: large
    // allocations are only 16-byte aligned, and 512-bit `movntps` needs 64.
    unsafe {
        if T::F16 {
            let h = _mm512_cvtps_ph::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(v);
            let p = out.add(i).cast::<__m128i>();
            if NT {
                _mm_stream_si128(p, _mm256_castsi256_si128(h));
                _mm_stream_si128(p.add(1), _mm256_extracti128_si256::<1>(h));
            } else {
                _mm256_storeu_si256(p.cast(), h);
            }
        } else {
            let p = out.add(i).cast::<f32>();
            if NT {
                _mm_stream_ps(p, _mm512_castps512_ps128(v));
                _mm_stream_ps(p.add(4), _mm512_extractf32x4_ps::<1>(v));
                _mm_stream_ps(p.add(8), _mm512_extractf32x4_ps::<2>(v));
                _mm_stream_ps(p.add(12), _mm512_extractf32x4_ps::<3>(v));
            } else {
                _mm512_storeu_ps(p, v);
            }
        }
    }
}

/// 32 bytes as two 16-lane f32 vectors (values 0..16 and 16..32).
#[inline]
#[target_feature(enable = "avx512f,avx2")]
fn bytes32_f32(v: __m256i, signed: bool) -> [__m512; 2] {
    [
        bytes16_to_f32x16(_mm256_castsi256_si128(v), signed),
        bytes16_to_f32x16(_mm256_extracti128_si256::<1>(v), signed),
    ]
}

/// 512-bit dequantisation of whole blocks into f32 or f16 elements. To f16, the types
/// [`has_lut`] accepts go through [`dequant_f16_lut`]. Otherwise each type unpacks its quants
/// as its 256-bit form does (Q3_K's high bits through AVX-512BW mask registers) and converts,
/// scales and stores 16 lanes at a time, in output order.
///
/// # Safety
/// The CPU must support AVX-512F/BW/VL, AVX2, FMA and F16C.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
pub(crate) unsafe fn dequant_avx512<T: DqOut, const NT: bool>(
    ty: QuantType,
    src: &[u8],
    out: &mut [T],
) {
    let (bb, bs) = (ty.block_bytes(), ty.block_size());
    let n = src.len() / bb;
    assert!(out.len() >= n * bs, "dequant_avx512: output too short");
    assert!(
        !NT || (out.as_ptr() as usize).is_multiple_of(16),
        "dequant_avx512: streaming stores need 16-byte alignment"
    );
    if T::F16 && has_lut(ty) {
        const { assert!(!T::F16 || std::mem::size_of::<T>() == 2 && std::mem::align_of::<T>() == 2) };
        // SAFETY: f16 elements are u16 bit patterns (size and alignment asserted at compile
        // time above), so this is the same memory, borrowed mutably once, under its own type.
        let o16 =
            unsafe { std::slice::from_raw_parts_mut(out.as_mut_ptr().cast::<u16>(), out.len()) };
        // SAFETY: the caller's contract; lengths and alignment checked above.
        unsafe { dequant_f16_lut::<NT>(ty, src, o16) };
        return;
    }
    let op = out.as_mut_ptr();
    match ty {
        QuantType::Q2_K => {
            // as the 256-bit form, values in order (so the streaming stores fill whole lines
            // one after another), each 32 converted as two 16-lane vectors
            let m3 = _mm256_set1_epi8(3);
            for (b, blk) in src.chunks_exact(bb).enumerate() {
                let (dl, ml) = q2k_factors(blk);
                for h in 0..2 {
                    let mut v = load32(&blk[16 + 32 * h..]);
                    for s in 0..4 {
                        let f = bytes32_f32(_mm256_and_si256(v, m3), false);
                        let e0 = 128 * h + 32 * s;
                        for (k, x) in f.into_iter().enumerate() {
                            let i = e0 / 16 + k;
                            let (d, m) = (_mm512_set1_ps(dl[i]), _mm512_set1_ps(ml[i]));
                            let x = _mm512_sub_ps(_mm512_mul_ps(d, x), m);
                            // SAFETY: 256 elements out per block, b < n.
                            unsafe { put16::<T, NT>(op, b * 256 + e0 + 16 * k, x) };
                        }
                        v = _mm256_srli_epi16::<2>(v);
                    }
                }
            }
        }
        QuantType::Q3_K => {
            // as the 256-bit form: low bits from qs[32h + l] >> 2s, the inverted high bit from
            // bit 4h + s of hmask[l] (clear means minus 4)
            let m3 = _mm256_set1_epi8(3);
            let four = _mm256_set1_epi8(4);
            for (b, blk) in src.chunks_exact(bb).enumerate() {
                let dl = q3k_factors(blk);
                let hm = load32(blk);
                let mut bit = _mm256_set1_epi8(1);
                for h in 0..2 {
                    let mut v = load32(&blk[32 + 32 * h..]);
                    for s in 0..4 {
                        let clear = _mm256_testn_epi8_mask(hm, bit);
                        let ql = _mm256_and_si256(v, m3);
                        let q = _mm256_mask_sub_epi8(ql, clear, ql, four);
                        let e0 = 128 * h + 32 * s;
                        for (k, x) in bytes32_f32(q, true).into_iter().enumerate() {
                            let x = _mm512_mul_ps(_mm512_set1_ps(dl[e0 / 16 + k]), x);
                            // SAFETY: 256 elements out per block, b < n.
                            unsafe { put16::<T, NT>(op, b * 256 + e0 + 16 * k, x) };
                        }
                        v = _mm256_srli_epi16::<2>(v);
                        bit = _mm256_add_epi8(bit, bit);
                    }
                }
            }
        }
        QuantType::F16 | QuantType::BF16 => {
            let sp = src.as_ptr();
            let mut i = 0;
            while i + 16 <= n {
                // SAFETY: i + 16 <= n elements of 2 bytes in, 16 elements out.
                unsafe {
                    let h = _mm256_loadu_si256(sp.add(2 * i).cast());
                    let v = if ty == QuantType::F16 {
                        _mm512_cvtph_ps(h)
                    } else {
                        _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
                    };
                    put16::<T, NT>(op, i, v);
                }
                i += 16;
            }
            for j in i..n {
                let h = u16::from_le_bytes([src[2 * j], src[2 * j + 1]]);
                let x = if ty == QuantType::F16 {
                    crate::cpu::half::f16_to_f32(h)
                } else {
                    crate::cpu::half::bf16_to_f32(h)
                };
                // SAFETY: j < n <= out.len().
                unsafe { put1(op, j, x) };
            }
        }
        QuantType::Q4_0 | QuantType::Q4_1 | QuantType::IQ4_NL => {
            let eight = _mm_set1_epi8(8);
            // SAFETY: the table is 16 bytes.
            let table = unsafe { _mm_loadu_si128(IQ4NL_VALUES.as_ptr().cast()) };
            let at = if ty == QuantType::Q4_1 { 4 } else { 2 };
            for (b, blk) in src.chunks_exact(bb).enumerate() {
                let d = _mm512_set1_ps(rd_f16_int(blk, 0));
                // SAFETY: 16 bytes of nibbles at `at`, inside the block.
                let (lo, hi) = unsafe { nibbles16(blk[at..at + 16].as_ptr()) };
                let f = match ty {
                    QuantType::Q4_0 => [
                        bytes16_to_f32x16(_mm_sub_epi8(lo, eight), true),
                        bytes16_to_f32x16(_mm_sub_epi8(hi, eight), true),
                    ],
                    QuantType::Q4_1 => [bytes16_to_f32x16(lo, false), bytes16_to_f32x16(hi, false)],
                    _ => [
                        bytes16_to_f32x16(_mm_shuffle_epi8(table, lo), true),
                        bytes16_to_f32x16(_mm_shuffle_epi8(table, hi), true),
                    ],
                };
                let m = _mm512_set1_ps(if ty == QuantType::Q4_1 {
                    rd_f16_int(blk, 2)
                } else {
                    0.0
                });
                for (k, v) in f.into_iter().enumerate() {
                    let mut x = _mm512_mul_ps(d, v);
                    if ty == QuantType::Q4_1 {
                        x = _mm512_add_ps(x, m);
                    }
                    // SAFETY: 32 elements out per block, b < n.
                    unsafe { put16::<T, NT>(op, b * 32 + 16 * k, x) };
                }
            }
        }
        QuantType::Q8_0 => {
            for (b, blk) in src.chunks_exact(bb).enumerate() {
                let d = _mm512_set1_ps(rd_f16_int(blk, 0));
                let f = bytes32_f32(load32(&blk[2..]), true);
                for (k, v) in f.into_iter().enumerate() {
                    // SAFETY: 32 elements out per block, b < n.
                    unsafe { put16::<T, NT>(op, b * 32 + 16 * k, _mm512_mul_ps(v, d)) };
                }
            }
        }
        QuantType::Q5_0 | QuantType::Q5_1 => {
            let m4 = _mm_set1_epi8(0x0f);
            let k16 = _mm256_set1_epi8(16);
            let (qh_at, qs_at) = if ty == QuantType::Q5_0 {
                (2, 6)
            } else {
                (4, 8)
            };
            for (b, blk) in src.chunks_exact(bb).enumerate() {
                let d = _mm512_set1_ps(rd_f16_int(blk, 0));
                let qh = u32::from_le_bytes([
                    blk[qh_at],
                    blk[qh_at + 1],
                    blk[qh_at + 2],
                    blk[qh_at + 3],
                ]);
                // SAFETY: 16 bytes of nibbles at qs_at inside the block.
                let v = unsafe { _mm_loadu_si128(blk[qs_at..qs_at + 16].as_ptr().cast()) };
                let lo = _mm_and_si128(v, m4);
                let hi = _mm_and_si128(_mm_srli_epi16::<4>(v), m4);
                let q = _mm256_or_si256(_mm256_set_m128i(hi, lo), q5_high_bits(qh));
                if ty == QuantType::Q5_0 {
                    let f = bytes32_f32(_mm256_sub_epi8(q, k16), true);
                    for (k, v) in f.into_iter().enumerate() {
                        // SAFETY: 32 elements out per block, b < n.
                        unsafe { put16::<T, NT>(op, b * 32 + 16 * k, _mm512_mul_ps(d, v)) };
                    }
                } else {
                    let m = _mm512_set1_ps(rd_f16_int(blk, 2));
                    let f = bytes32_f32(q, false);
                    for (k, v) in f.into_iter().enumerate() {
                        let x = _mm512_add_ps(_mm512_mul_ps(d, v), m);
                        // SAFETY: as above.
                        unsafe { put16::<T, NT>(op, b * 32 + 16 * k, x) };
                    }
                }
            }
        }
        QuantType::Q4_K | QuantType::Q5_K => {
            let mask = _mm256_set1_epi8(0x0f);
            let one = _mm256_set1_epi8(1);
            let qs_at = if ty == QuantType::Q4_K { 16 } else { 48 };
            for (b, blk) in src.chunks_exact(bb).enumerate() {
                let d = rd_f16_int(blk, 0);
                let dmin = rd_f16_int(blk, 2);
                let scales = &blk[4..16];
                let mut qh = if ty == QuantType::Q5_K {
                    load32(&blk[16..48])
                } else {
                    _mm256_setzero_si256()
                };
                for c in 0..4 {
                    let v = load32(&blk[qs_at + 32 * c..]);
                    let halves = [
                        _mm256_and_si256(v, mask),
                        _mm256_and_si256(_mm256_srli_epi16::<4>(v), mask),
                    ];
                    for (h, mut q) in halves.into_iter().enumerate() {
                        let sb = 2 * c + h;
                        if ty == QuantType::Q5_K {
                            let bit = _mm256_and_si256(qh, one);
                            q = _mm256_or_si256(q, _mm256_slli_epi16::<4>(bit));
                            qh = _mm256_srli_epi16::<1>(qh);
                        }
                        let (sc, m) = scale_min_k4(sb, scales);
                        let d1 = _mm512_set1_ps(d * sc as f32);
                        let m1 = _mm512_set1_ps(dmin * m as f32);
                        for (k, f) in bytes32_f32(q, false).into_iter().enumerate() {
                            let x = _mm512_sub_ps(_mm512_mul_ps(d1, f), m1);
                            // SAFETY: 256 elements out per block, b < n.
                            unsafe { put16::<T, NT>(op, b * 256 + sb * 32 + 16 * k, x) };
                        }
                    }
                }
            }
        }
        QuantType::Q6_K => {
            let k32 = _mm256_set1_epi8(32);
            for (b, blk) in src.chunks_exact(bb).enumerate() {
                let d = rd_f16_int(blk, 208);
                for h in 0..2 {
                    let qh = load32(&blk[128 + 32 * h..]);
                    for g in 0..4 {
                        let ql = load32(&blk[64 * h + 32 * (g % 2)..]);
                        let q = _mm256_sub_epi8(q6k_group(ql, qh, g), k32);
                        let e0 = 128 * h + 32 * g;
                        let f = bytes32_f32(q, true);
                        for (k, v) in f.into_iter().enumerate() {
                            let s = d * (blk[192 + e0 / 16 + k] as i8) as f32;
                            let x = _mm512_mul_ps(_mm512_set1_ps(s), v);
                            // SAFETY: 256 elements out per block, b < n.
                            unsafe { put16::<T, NT>(op, b * 256 + e0 + 16 * k, x) };
                        }
                    }
                }
            }
        }
        QuantType::F32 => {
            // SAFETY: the caller's contract covers AVX2's; F32 has no vector form.
            unsafe { dequant_avx2::<T, NT>(ty, src, out) }
        }
    }
    if NT {
        // order the non-temporal stores before anything that follows
        _mm_sfence();
    }
}

/// The two little-endian f16 at `off` and `off + 2` of `b`, each broadcast to 16 f32 lanes
/// (exact). One zero-extending 32-bit load and one `vcvtph2ps`; the second value may be
/// whatever bytes follow when a type has one scale only, and is then unused.
#[inline]
#[target_feature(enable = "avx512f,avx2,f16c")]
fn rd_f16x2(b: &[u8], off: usize) -> (__m512, __m512) {
    let w = u32::from_le_bytes([b[off], b[off + 1], b[off + 2], b[off + 3]]);
    let f = _mm_cvtph_ps(_mm_cvtsi32_si128(w as i32));
    (
        _mm512_broadcastss_ps(f),
        _mm512_broadcastss_ps(_mm_movehdup_ps(f)),
    )
}

/// Whether [`dequant_f16_lut`] handles `ty`: the types whose values within a block or
/// sub-block take at most 64 distinct codes.
fn has_lut(ty: QuantType) -> bool {
    matches!(
        ty,
        QuantType::Q4_0
            | QuantType::Q4_1
            | QuantType::IQ4_NL
            | QuantType::Q5_0
            | QuantType::Q5_1
            | QuantType::Q2_K
            | QuantType::Q3_K
            | QuantType::Q4_K
            | QuantType::Q5_K
    )
}

/// 32 f16 values (one vector of words) stored at element `i` of `out`.
///
/// # Safety
/// `out.add(i)` has 32 writable elements, 16-byte aligned when `NT`; AVX-512F is present.
#[inline]
#[target_feature(enable = "avx512f,avx2")]
unsafe fn put32h<const NT: bool>(out: *mut u16, i: usize, v: __m512i) {
    // SAFETY: the caller's contract above.
    unsafe {
        let p = out.add(i).cast::<__m128i>();
        if NT {
            _mm_stream_si128(p, _mm512_castsi512_si128(v));
            _mm_stream_si128(p.add(1), _mm512_extracti32x4_epi32::<1>(v));
            _mm_stream_si128(p.add(2), _mm512_extracti32x4_epi32::<2>(v));
            _mm_stream_si128(p.add(3), _mm512_extracti32x4_epi32::<3>(v));
        } else {
            _mm512_storeu_si512(p.cast(), v);
        }
    }
}

/// f16 bits of 16 f32 lanes, round to nearest even.
#[inline]
#[target_feature(enable = "avx512f")]
fn to_f16(x: __m512) -> __m256i {
    _mm512_cvtps_ph::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(x)
}

/// Two 16-word halves as one 32-word vector.
#[inline]
#[target_feature(enable = "avx512f")]
fn join(lo: __m256i, hi: __m256i) -> __m512i {
    _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi)
}

/// The f32 lanes 0, 1, ..., 15 plus `base`.
#[inline]
#[target_feature(enable = "avx512f")]
fn ramp(base: f32) -> __m512 {
    _mm512_add_ps(
        _mm512_setr_ps(
            0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0, 12.0, 13.0, 14.0, 15.0,
        ),
        _mm512_set1_ps(base),
    )
}

/// Dequantisation to f16 through per-block code tables: a (sub-)block's values take at most
/// 64 distinct codes, so the f32 value of each code is computed once, with the scalar
/// decoder's operations in its order, rounded to f16, and the values are looked up with
/// `vpermw` / `vpermt2w`. Each output is the f16 rounding of the same f32 the per-value path
/// computes (same operands, same operations), so the bits are identical to it, NaN included.
///
/// # Safety
/// The CPU must support AVX-512F/BW/VL, AVX2 and F16C; `has_lut(ty)`; `out` holds the values
/// of `src`'s whole blocks and is 16-byte aligned when `NT`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn dequant_f16_lut<const NT: bool>(ty: QuantType, src: &[u8], out: &mut [u16]) {
    let (bb, bs) = (ty.block_bytes(), ty.block_size());
    let n = src.len() / bb;
    assert!(out.len() >= n * bs, "dequant_f16_lut: output too short");
    let op = out.as_mut_ptr();
    let m4 = _mm_set1_epi8(0x0f);
    match ty {
        QuantType::Q4_0 | QuantType::Q4_1 | QuantType::IQ4_NL => {
            // 16 codes per block: Q4_0 d·(q - 8), Q4_1 d·q + m, IQ4_NL d·kvalues[q]
            let codes = match ty {
                QuantType::Q4_0 => ramp(-8.0),
                QuantType::Q4_1 => ramp(0.0),
                // SAFETY: the table is 16 bytes.
                _ => bytes16_to_f32x16(
                    unsafe { _mm_loadu_si128(IQ4NL_VALUES.as_ptr().cast()) },
                    true,
                ),
            };
            let at = if ty == QuantType::Q4_1 { 4 } else { 2 };
            for (b, blk) in src.chunks_exact(bb).enumerate() {
                let (d, m) = rd_f16x2(blk, 0);
                let mut x = _mm512_mul_ps(d, codes);
                if ty == QuantType::Q4_1 {
                    x = _mm512_add_ps(x, m);
                }
                let table = _mm512_castsi256_si512(to_f16(x));
                // SAFETY: 16 bytes of nibbles at `at`, inside the block.
                let v = unsafe { _mm_loadu_si128(blk[at..at + 16].as_ptr().cast()) };
                let idx = _mm256_set_m128i(
                    _mm_and_si128(_mm_srli_epi16::<4>(v), m4),
                    _mm_and_si128(v, m4),
                );
                let h = _mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(idx), table);
                // SAFETY: 32 elements out per block, b < n.
                unsafe { put32h::<NT>(op, b * 32, h) };
            }
        }
        QuantType::Q5_0 | QuantType::Q5_1 => {
            // 32 codes per block: Q5_0 d·(q - 16), Q5_1 d·q + m
            let (qh_at, qs_at, base) = if ty == QuantType::Q5_0 {
                (2, 6, -16.0)
            } else {
                (4, 8, 0.0)
            };
            let (c0, c1) = (ramp(base), ramp(base + 16.0));
            let k16 = _mm256_set1_epi8(16);
            for (b, blk) in src.chunks_exact(bb).enumerate() {
                let (d, m) = rd_f16x2(blk, 0);
                let (mut x0, mut x1) = (_mm512_mul_ps(d, c0), _mm512_mul_ps(d, c1));
                if ty == QuantType::Q5_1 {
                    x0 = _mm512_add_ps(x0, m);
                    x1 = _mm512_add_ps(x1, m);
                }
                let table = join(to_f16(x0), to_f16(x1));
                let qh = u32::from_le_bytes([
                    blk[qh_at],
                    blk[qh_at + 1],
                    blk[qh_at + 2],
                    blk[qh_at + 3],
                ]);
                // SAFETY: 16 bytes of nibbles at qs_at inside the block.
                let v = unsafe { _mm_loadu_si128(blk[qs_at..qs_at + 16].as_ptr().cast()) };
                let lo = _mm_and_si128(v, m4);
                let hi = _mm_and_si128(_mm_srli_epi16::<4>(v), m4);
                let nib = _mm256_set_m128i(hi, lo);
                // the fifth bit of value i is bit i of qh: a byte mask, as it stands
                let q = _mm256_mask_add_epi8(nib, qh, nib, k16);
                let h = _mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(q), table);
                // SAFETY: 32 elements out per block, b < n.
                unsafe { put32h::<NT>(op, b * 32, h) };
            }
        }
        QuantType::Q4_K | QuantType::Q5_K => {
            // per 32-value sub-block, 16 (Q4_K) or 32 (Q5_K) codes: d·sc·q - dmin·m
            let mask = _mm256_set1_epi8(0x0f);
            let k16 = _mm256_set1_epi8(16);
            let (c0, c1) = (ramp(0.0), ramp(16.0));
            let q5 = ty == QuantType::Q5_K;
            let qs_at = if q5 { 48 } else { 16 };
            for (b, blk) in src.chunks_exact(bb).enumerate() {
                let d = rd_f16_int(blk, 0);
                let dmin = rd_f16_int(blk, 2);
                let scales = &blk[4..16];
                let qh = if q5 {
                    load32(&blk[16..48])
                } else {
                    _mm256_setzero_si256()
                };
                let mut bit = _mm256_set1_epi8(1);
                for c in 0..4 {
                    let v = load32(&blk[qs_at + 32 * c..]);
                    let halves = [
                        _mm256_and_si256(v, mask),
                        _mm256_and_si256(_mm256_srli_epi16::<4>(v), mask),
                    ];
                    for (h, mut q) in halves.into_iter().enumerate() {
                        let sb = 2 * c + h;
                        let (sc, m) = scale_min_k4(sb, scales);
                        let d1 = _mm512_set1_ps(d * sc as f32);
                        let m1 = _mm512_set1_ps(dmin * m as f32);
                        let lo = to_f16(_mm512_sub_ps(_mm512_mul_ps(d1, c0), m1));
                        let table = if q5 {
                            // bit sb of qh[l] is value 32·sb + l's fifth bit
                            q = _mm256_mask_add_epi8(q, _mm256_test_epi8_mask(qh, bit), q, k16);
                            bit = _mm256_add_epi8(bit, bit);
                            join(lo, to_f16(_mm512_sub_ps(_mm512_mul_ps(d1, c1), m1)))
                        } else {
                            _mm512_castsi256_si512(lo)
                        };
                        let x = _mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(q), table);
                        // SAFETY: 256 elements out per block, b < n.
                        unsafe { put32h::<NT>(op, b * 256 + 32 * sb, x) };
                    }
                }
            }
        }
        QuantType::Q3_K => {
            // per 32 values, two scales of 8 codes each: entry 8j + k is dl_j·(k - 4)
            let codes = _mm512_setr_ps(
                -4.0, -3.0, -2.0, -1.0, 0.0, 1.0, 2.0, 3.0, -4.0, -3.0, -2.0, -1.0, 0.0, 1.0, 2.0,
                3.0,
            );
            let m3 = _mm256_set1_epi8(3);
            let four = _mm256_set1_epi8(4);
            // bytes 16..32 of each 32 take the second scale's codes
            let second = _mm256_set_m128i(_mm_set1_epi8(8), _mm_setzero_si128());
            for (b, blk) in src.chunks_exact(bb).enumerate() {
                let dl = q3k_factors(blk);
                let hm = load32(blk);
                let mut bit = _mm256_set1_epi8(1);
                for h in 0..2 {
                    let mut v = load32(&blk[32 + 32 * h..]);
                    for s in 0..4 {
                        let k = 8 * h + 2 * s;
                        let dv = _mm512_mask_blend_ps(
                            0xff00,
                            _mm512_set1_ps(dl[k]),
                            _mm512_set1_ps(dl[k + 1]),
                        );
                        let table = _mm512_castsi256_si512(to_f16(_mm512_mul_ps(dv, codes)));
                        // code + 4 = low bits + 4 when the high bit is set
                        let set = _mm256_test_epi8_mask(hm, bit);
                        let ql = _mm256_and_si256(v, m3);
                        let idx = _mm256_add_epi8(_mm256_mask_add_epi8(ql, set, ql, four), second);
                        let x = _mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(idx), table);
                        // SAFETY: 256 elements out per block, b < n.
                        unsafe { put32h::<NT>(op, b * 256 + 128 * h + 32 * s, x) };
                        v = _mm256_srli_epi16::<2>(v);
                        bit = _mm256_add_epi8(bit, bit);
                    }
                }
            }
        }
        QuantType::Q2_K => {
            // 64 codes per block: entry 4j + k is d·(scale_j & 15)·k - dmin·(scale_j >> 4)
            let codes = _mm512_setr_ps(
                0.0, 1.0, 2.0, 3.0, 0.0, 1.0, 2.0, 3.0, 0.0, 1.0, 2.0, 3.0, 0.0, 1.0, 2.0, 3.0,
            );
            let m3 = _mm256_set1_epi8(3);
            // bytes 16..32 of each 32 take the next scale's codes
            let second = _mm256_set_m128i(_mm_set1_epi8(4), _mm_setzero_si128());
            let m4 = _mm_set1_epi8(0x0f);
            for (b, blk) in src.chunks_exact(bb).enumerate() {
                // the 16 factors as q2k_factors computes them, kept in registers
                // SAFETY: the 16 scale bytes open the block.
                let sc = unsafe { _mm_loadu_si128(blk[..16].as_ptr().cast()) };
                let (d, dmin) = rd_f16x2(blk, 80);
                let dlv = _mm512_mul_ps(d, bytes16_to_f32x16(_mm_and_si128(sc, m4), false));
                let mlv = _mm512_mul_ps(
                    dmin,
                    bytes16_to_f32x16(_mm_and_si128(_mm_srli_epi16::<4>(sc), m4), false),
                );
                let mut t = [_mm256_setzero_si256(); 4];
                for (g, tg) in t.iter_mut().enumerate() {
                    // lanes 4i..4i+4 take scale 4g + i
                    let g4 = 4 * g as i32;
                    let sel = _mm512_setr_epi32(
                        g4,
                        g4,
                        g4,
                        g4,
                        g4 + 1,
                        g4 + 1,
                        g4 + 1,
                        g4 + 1,
                        g4 + 2,
                        g4 + 2,
                        g4 + 2,
                        g4 + 2,
                        g4 + 3,
                        g4 + 3,
                        g4 + 3,
                        g4 + 3,
                    );
                    let d = _mm512_permutexvar_ps(sel, dlv);
                    let m = _mm512_permutexvar_ps(sel, mlv);
                    *tg = to_f16(_mm512_sub_ps(_mm512_mul_ps(d, codes), m));
                }
                let (t0, t1) = (join(t[0], t[1]), join(t[2], t[3]));
                for h in 0..2 {
                    let mut v = load32(&blk[16 + 32 * h..]);
                    for s in 0..4 {
                        // values 128h + 32s + l use scale 8h + 2s + (l >= 16)
                        let base = _mm256_set1_epi8((4 * (8 * h + 2 * s)) as i8);
                        let idx =
                            _mm256_add_epi8(_mm256_add_epi8(_mm256_and_si256(v, m3), base), second);
                        let x = _mm512_permutex2var_epi16(t0, _mm512_cvtepu8_epi16(idx), t1);
                        // SAFETY: 256 elements out per block, b < n.
                        unsafe { put32h::<NT>(op, b * 256 + 128 * h + 32 * s, x) };
                        v = _mm256_srli_epi16::<2>(v);
                    }
                }
            }
        }
        // SAFETY: the caller's contract covers AVX2's.
        _ => unsafe { dequant_avx2::<u16, NT>(ty, src, out) },
    }
    if NT {
        // order the non-temporal stores before anything that follows
        _mm_sfence();
    }
}

#[cfg(test)]
mod tests {
    //! Both kernel families called directly, every form (f32 and f16 output, ordinary and
    //! streaming stores), on gguf-py's fixtures, including the 512-bit forms that
    //! `has_avx512` does not dispatch to on this hardware.
    use super::*;
    use crate::cpu::Isa;

    const NAMES: [&str; 13] = [
        "f16", "bf16", "q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q2_k", "q3_k", "q4_k", "q5_k",
        "q6_k", "iq4_nl",
    ];

    /// `tests/data/<name>.bin` (written by `tests/gen_vectors.py` from `gguf.quants`): the type,
    /// the raw blocks and gguf-py's f32 values.
    fn fixture(name: &str) -> (QuantType, Vec<u8>, Vec<f32>) {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/data")
            .join(format!("{name}.bin"));
        let b = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        assert_eq!(&b[..4], b"WLKV");
        let u = |o: usize| u32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]]) as usize;
        let ty = QuantType::from_ggml_id(u(4) as u32).expect("known ggml id");
        let raw_len = u(8) * u(12);
        let raw = b[20..20 + raw_len].to_vec();
        let want = b[20 + raw_len..]
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        (ty, raw, want)
    }

    /// A 64-byte aligned window of `n` elements inside a fresh buffer.
    fn aligned<T: Copy>(buf: &mut Vec<T>, n: usize, fill: T) -> &mut [T] {
        *buf = vec![fill; n + 64];
        let off = buf.as_ptr().align_offset(64).min(64);
        &mut buf[off..off + n]
    }

    fn check(name: &str, form: &str, ty: QuantType, raw: &[u8], want: &[f32], run: Runner) {
        let n = want.len();
        let (mut b32, mut b16) = (Vec::new(), Vec::new());
        let o32 = aligned(&mut b32, n, f32::NAN);
        let o16 = aligned(&mut b16, n, 0xffffu16);
        run(ty, raw, o32, o16);
        for i in 0..n {
            let w = want[i];
            assert!(
                o32[i].to_bits() == w.to_bits() || (o32[i].is_nan() && w.is_nan()),
                "{name} {form} element {i}: got {:e}, gguf-py {w:e}",
                o32[i]
            );
            let w16 = half::f16::from_f32(w);
            assert!(
                o16[i] == w16.to_bits() || (w16.is_nan() && half::f16::from_bits(o16[i]).is_nan()),
                "{name} {form} f16 element {i}: got {:#06x}, want {:#06x}",
                o16[i],
                w16.to_bits()
            );
        }
    }

    type Runner = fn(QuantType, &[u8], &mut [f32], &mut [u16]);

    #[test]
    fn every_kernel_form_matches_gguf_py() {
        let best = Isa::best_supported();
        // The scalar fallback always runs, so a CPU without AVX2 still checks something.
        let mut forms: Vec<(&str, Runner)> = vec![("scalar", |ty, raw, o32, o16| {
            crate::cpu::dequantize_f32_with(Isa::Scalar, ty, raw, o32).unwrap();
            crate::cpu::dequantize_f16_with(Isa::Scalar, ty, raw, o16).unwrap();
        })];
        if best >= Isa::Avx2 {
            forms.push(("avx2", |ty, raw, o32, o16| {
                // SAFETY: AVX2, FMA and F16C were detected; the outputs are aligned and long enough.
                unsafe {
                    dequant_avx2::<f32, false>(ty, raw, o32);
                    dequant_avx2::<u16, false>(ty, raw, o16);
                }
            }));
            forms.push(("avx2 streaming", |ty, raw, o32, o16| {
                // SAFETY: as above; both outputs are 64-byte aligned.
                unsafe {
                    dequant_avx2::<f32, true>(ty, raw, o32);
                    dequant_avx2::<u16, true>(ty, raw, o16);
                }
            }));
        }
        if best >= Isa::Avx512 {
            forms.push(("avx512", |ty, raw, o32, o16| {
                // SAFETY: AVX-512F/BW/VL, AVX2, FMA and F16C were detected; outputs as above.
                unsafe {
                    dequant_avx512::<f32, false>(ty, raw, o32);
                    dequant_avx512::<u16, false>(ty, raw, o16);
                }
            }));
            forms.push(("avx512 streaming", |ty, raw, o32, o16| {
                // SAFETY: as above; both outputs are 64-byte aligned.
                unsafe {
                    dequant_avx512::<f32, true>(ty, raw, o32);
                    dequant_avx512::<u16, true>(ty, raw, o16);
                }
            }));
        }
        for name in NAMES {
            let (ty, raw, want) = fixture(name);
            for (form, run) in &forms {
                check(name, form, ty, &raw, &want, *run);
                // an odd window: blocks 1..n-1, so the F16/BF16 tails are not whole vectors
                let (bb, bs) = (ty.block_bytes(), ty.block_size());
                let blocks = raw.len() / bb;
                let (r, w) = (&raw[bb..(blocks - 2) * bb], &want[bs..(blocks - 2) * bs]);
                check(name, form, ty, r, w, *run);
            }
        }
    }
}
