//! The KV-cache quantisers' AVX2+F16C twins of `kv`, and the 8×8 transpose-max the Q8
//! GEMM's activation quantiser shares.

use std::arch::x86_64::*;

/// The f16 scale of a group, as `kv::kv_scale`: `amax/qmax` rounded to nearest even by
/// F16C, bumped to the next f16 when that fell below, and capped at 65504.
#[inline]
#[target_feature(enable = "avx2,f16c")]
pub(crate) fn kv_scale_f16c(amax: f32, qmax: f32) -> u16 {
    let d = amax / qmax;
    let hv = _mm_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm_set_ss(d));
    let mut h = _mm_extract_epi16::<0>(hv) as u16;
    if _mm_cvtss_f32(_mm_cvtph_ps(hv)) < d && h < 0x7bff {
        h += 1; // positive finite f16: the next pattern is the next value up
    }
    if h >= 0x7c00 && !d.is_nan() {
        h = 0x7bff;
    }
    h
}

/// Quantises whole groups of 32 values; the bytes equal `kv::kv_quantize`'s scalar path:
/// the same `amax` (NaN ignored), the same f16 scale, `q = round(x · (1/d))` with ties away
/// from zero (as `f32::round`), clamped to ±qmax, NaN to 0.
///
/// # Safety
/// The CPU must support AVX2 and F16C; `x.len()` is a multiple of 32 and `out` holds
/// `x.len() / 32` groups of `group_bytes` (34 for q8, 18 for q4).
#[target_feature(enable = "avx2,f16c")]
pub(crate) unsafe fn kv_quantize_avx2(q4: bool, x: &[f32], out: &mut [u8]) {
    let gb = if q4 { 18 } else { 34 };
    let groups = x.len() / 32;
    assert!(
        out.len() >= groups * gb,
        "kv_quantize_avx2: output too short"
    );
    let qmax = if q4 { 7.0f32 } else { 127.0 };
    let mut g = 0;
    // eight groups at a time: their maxima, scales and reciprocals as one vector each
    while g + 8 <= groups {
        // SAFETY: groups g..g+8 cover x[32g..32g+256] and out[gb·g..gb·(g+8)].
        unsafe {
            let xp = x.as_ptr().add(32 * g);
            let mut m = [_mm256_setzero_ps(); 8];
            for (j, mj) in m.iter_mut().enumerate() {
                *mj = group_absmax(xp.add(32 * j));
            }
            let amax = transpose_max8(m);
            let d = _mm256_div_ps(amax, _mm256_set1_ps(qmax));
            let h = kv_scales_f16c(d);
            let dv = _mm256_cvtph_ps(h);
            let id = _mm256_and_ps(
                _mm256_div_ps(_mm256_set1_ps(1.0), dv),
                _mm256_cmp_ps::<_CMP_NEQ_OQ>(dv, _mm256_setzero_ps()),
            );
            let mut hs = [0u16; 8];
            _mm_storeu_si128(hs.as_mut_ptr().cast(), h);
            let mut ids = [0f32; 8];
            _mm256_storeu_ps(ids.as_mut_ptr(), id);
            for j in 0..8 {
                let op = out.as_mut_ptr().add(gb * (g + j));
                op.cast::<[u8; 2]>().write_unaligned(hs[j].to_le_bytes());
                quantize_group(q4, xp.add(32 * j), _mm256_set1_ps(ids[j]), op.add(2));
            }
        }
        g += 8;
    }
    for g in g..groups {
        // SAFETY: group g covers x[32g..32g+32] and out[gb·g..gb·g+gb], both in bounds.
        unsafe {
            let xp = x.as_ptr().add(32 * g);
            let m = group_absmax(xp);
            let s = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
            let s = _mm_max_ps(s, _mm_movehl_ps(s, s));
            let s = _mm_max_ss(s, _mm_shuffle_ps::<1>(s, s));
            let h = kv_scale_f16c(_mm_cvtss_f32(s), qmax);
            let op = out.as_mut_ptr().add(gb * g);
            op.cast::<[u8; 2]>().write_unaligned(h.to_le_bytes());
            let d = _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(h))));
            let id = _mm256_set1_ps(if d != 0.0 { 1.0 / d } else { 0.0 });
            quantize_group(q4, xp, id, op.add(2));
        }
    }
}

/// Lane-wise max of |x| over a group's four vectors; `max(a, m)` returns `m` when `a` is
/// NaN, so NaN is skipped as `f32::max` does.
///
/// # Safety
/// AVX enabled by the caller (it is inlined); `xp` points to 32 readable f32.
#[inline(always)]
pub(crate) unsafe fn group_absmax(xp: *const f32) -> __m256 {
    // SAFETY: as the contract.
    unsafe {
        let absm = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff));
        let mut m = _mm256_setzero_ps();
        for k in 0..4 {
            m = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(xp.add(8 * k)), absm), m);
        }
        m
    }
}

/// The horizontal maxima of eight NaN-free vectors, as lanes 0..8 of one vector.
///
/// # Safety
/// AVX enabled by the caller (it is inlined).
#[inline(always)]
pub(crate) unsafe fn transpose_max8(m: [__m256; 8]) -> __m256 {
    // SAFETY: register-only intrinsics; AVX is enabled by the caller.
    unsafe {
        let p = |a: __m256, b: __m256| {
            _mm256_max_ps(_mm256_unpacklo_ps(a, b), _mm256_unpackhi_ps(a, b))
        };
        // per 128-bit half: [a0∨a2, b0∨b2, a1∨a3, b1∨b3]
        let s01 = p(m[0], m[1]);
        let s23 = p(m[2], m[3]);
        let s45 = p(m[4], m[5]);
        let s67 = p(m[6], m[7]);
        // per half: [m0, m1, m2, m3] reduced over that half
        let t0 = _mm256_max_ps(
            _mm256_shuffle_ps::<0b01_00_01_00>(s01, s23),
            _mm256_shuffle_ps::<0b11_10_11_10>(s01, s23),
        );
        let t1 = _mm256_max_ps(
            _mm256_shuffle_ps::<0b01_00_01_00>(s45, s67),
            _mm256_shuffle_ps::<0b11_10_11_10>(s45, s67),
        );
        _mm256_max_ps(
            _mm256_permute2f128_ps::<0x20>(t0, t1),
            _mm256_permute2f128_ps::<0x31>(t0, t1),
        )
    }
}

/// Eight f16 scales from eight `d = amax/qmax` (never NaN), as [`kv_scale_f16c`]: round to
/// nearest even, bump to the next f16 where that fell below `d`, cap at 65504.
///
/// # Safety
/// AVX2 and F16C enabled by the caller (it is inlined).
#[inline(always)]
pub(crate) unsafe fn kv_scales_f16c(d: __m256) -> __m128i {
    // SAFETY: register-only intrinsics; AVX2/F16C are enabled by the caller.
    unsafe {
        let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(d);
        let below = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_LT_OQ>(_mm256_cvtph_ps(h), d));
        // the 32-bit masks as 16-bit masks, in lane order
        let below16 = _mm_packs_epi32(
            _mm256_castsi256_si128(below),
            _mm256_extracti128_si256::<1>(below),
        );
        let room = _mm_cmplt_epi16(h, _mm_set1_epi16(0x7bff));
        let h = _mm_sub_epi16(h, _mm_and_si128(below16, room)); // mask −1: h + 1
        _mm_min_epu16(h, _mm_set1_epi16(0x7bff))
    }
}

/// Quantises one group with reciprocal scale `id` and writes its quants at `op` (32 bytes
/// for q8, 16 for q4): `q = trunc(x·id + copysign(0.49999997, x·id))` — ties away from
/// zero, as `f32::round`, for every |x·id| < 2²³ (larger values are integers already) —
/// clamped to ±qmax, NaN to 0.
///
/// # Safety
/// AVX2 enabled by the caller (it is inlined); `xp` points to 32 readable f32 and `op` to
/// 32 (q8) or 16 (q4) writable bytes.
#[inline(always)]
pub(crate) unsafe fn quantize_group(q4: bool, xp: *const f32, id: __m256, op: *mut u8) {
    // SAFETY: as the contract.
    unsafe {
        let qmax = if q4 { 7.0f32 } else { 127.0 };
        let signm = _mm256_set1_ps(-0.0);
        let half = _mm256_set1_ps(0.499_999_97);
        let (qhi, qlo) = (_mm256_set1_ps(qmax), _mm256_set1_ps(-qmax));
        let mut qi = [_mm256_setzero_si256(); 4];
        for (k, qk) in qi.iter_mut().enumerate() {
            let q = _mm256_mul_ps(_mm256_loadu_ps(xp.add(8 * k)), id);
            let t = _mm256_add_ps(q, _mm256_or_ps(_mm256_and_ps(q, signm), half));
            let r = _mm256_round_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(t);
            // min/max return their second operand on NaN, so NaN passes to the mask
            let c = _mm256_max_ps(qlo, _mm256_min_ps(qhi, r));
            let c = _mm256_and_ps(c, _mm256_cmp_ps::<_CMP_ORD_Q>(c, c));
            *qk = _mm256_cvttps_epi32(c);
        }
        let w16a = _mm256_packs_epi32(qi[0], qi[1]);
        let w16b = _mm256_packs_epi32(qi[2], qi[3]);
        let perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
        let b = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(w16a, w16b), perm);
        if q4 {
            let b = _mm256_add_epi8(b, _mm256_set1_epi8(8));
            let lo = _mm256_castsi256_si128(b);
            let hi = _mm256_extracti128_si256::<1>(b);
            _mm_storeu_si128(op.cast(), _mm_or_si128(lo, _mm_slli_epi16::<4>(hi)));
        } else {
            _mm256_storeu_si256(op.cast(), b);
        }
    }
}

/// Dequantises whole groups: `x̂ = q · d`, bit-identical to `kv::kv_dequantize`'s scalar path.
///
/// # Safety
/// The CPU must support AVX2 and F16C; `src.len()` is a multiple of the group bytes and
/// `out` holds 32 values per group.
#[target_feature(enable = "avx2,f16c")]
pub(crate) unsafe fn kv_dequantize_avx2(q4: bool, src: &[u8], out: &mut [f32]) {
    let gb = if q4 { 18 } else { 34 };
    let groups = src.len() / gb;
    assert!(
        out.len() >= groups * 32,
        "kv_dequantize_avx2: output too short"
    );
    let m4 = _mm_set1_epi8(0x0f);
    let eight = _mm_set1_epi8(8);
    for g in 0..groups {
        // SAFETY: group g covers src[gb·g..gb·g+gb] and out[32g..32g+32], both in bounds.
        unsafe {
            let sp = src.as_ptr().add(gb * g);
            let h = u16::from_le_bytes(sp.cast::<[u8; 2]>().read_unaligned());
            let d = _mm256_cvtph_ps(_mm_set1_epi16(h as i16));
            let (a, b) = if q4 {
                let v = _mm_loadu_si128(sp.add(2).cast());
                let lo = _mm_sub_epi8(_mm_and_si128(v, m4), eight);
                let hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16::<4>(v), m4), eight);
                (lo, hi)
            } else {
                (
                    _mm_loadu_si128(sp.add(2).cast()),
                    _mm_loadu_si128(sp.add(18).cast()),
                )
            };
            let op = out.as_mut_ptr().add(32 * g);
            for (k, v) in [a, b].into_iter().enumerate() {
                let f0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v));
                let f1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128::<8>(v)));
                _mm256_storeu_ps(op.add(16 * k), _mm256_mul_ps(f0, d));
                _mm256_storeu_ps(op.add(16 * k + 8), _mm256_mul_ps(f1, d));
            }
        }
    }
}
