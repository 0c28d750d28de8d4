//! The vector `e^x` the row operations share, and lane helpers (masks, horizontal sums).

use std::arch::x86_64::*;

use crate::cpu::exp::{EXP_HI, EXP_LO, EXP_POLY, LN2_HI, LN2_LO, LOG2E};

/// Vectorised `e^x` (Cephes-style range reduction `x = n·ln2 + r`, degree-7 polynomial,
/// scaling by 2ⁿ in two exact steps so subnormal results are rounded once).
///
/// Error against the exact value for results ≥ 2⁻¹²⁶: at most 1.01 ulp measured (every 7th
/// f32 of [−87.3, 88.72]), 1.5 ulp (1.8e-7 relative) asserted by the unit test below (so within 2 ulp
/// of the scalar twins' correctly rounded libm `expf`). Subnormal results are within one
/// subnormal step plus that. `x > 88.7228` gives +inf, `x < −103.972` gives 0,
/// NaN stays NaN, as libm's `expf`.
#[inline]
#[target_feature(enable = "avx2,fma")]
pub(crate) fn exp8(x: __m256) -> __m256 {
    let xc = _mm256_max_ps(
        _mm256_min_ps(x, _mm256_set1_ps(EXP_HI)),
        _mm256_set1_ps(EXP_LO),
    );
    let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(
        xc,
        _mm256_set1_ps(LOG2E),
    ));
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_HI), xc);
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_LO), r);
    let mut p = _mm256_set1_ps(EXP_POLY[0]);
    for c in EXP_POLY[1..].iter().copied() {
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
    }
    let r2 = _mm256_mul_ps(r, r);
    let y = _mm256_add_ps(_mm256_fmadd_ps(p, r2, r), _mm256_set1_ps(1.0));
    // 2ⁿ = 2^(n>>1) · 2^(n − n>>1): both factors normal for n in [−150, 128]
    let ni = _mm256_cvtps_epi32(n);
    let n1 = _mm256_srai_epi32::<1>(ni);
    let n2 = _mm256_sub_epi32(ni, n1);
    let bias = _mm256_set1_epi32(127);
    let s1 = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(n1, bias)));
    let s2 = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(n2, bias)));
    let mut e = _mm256_mul_ps(_mm256_mul_ps(y, s1), s2);
    let over = _mm256_cmp_ps::<_CMP_GT_OQ>(x, _mm256_set1_ps(EXP_HI));
    e = _mm256_blendv_ps(e, _mm256_set1_ps(f32::INFINITY), over);
    let under = _mm256_cmp_ps::<_CMP_LT_OQ>(x, _mm256_set1_ps(EXP_LO));
    e = _mm256_andnot_ps(under, e);
    let nan = _mm256_cmp_ps::<_CMP_UNORD_Q>(x, x);
    _mm256_blendv_ps(e, x, nan)
}

/// [`exp8`] on 16 lanes.
#[inline]
#[target_feature(enable = "avx512f")]
pub(crate) fn exp16(x: __m512) -> __m512 {
    let xc = _mm512_max_ps(
        _mm512_min_ps(x, _mm512_set1_ps(EXP_HI)),
        _mm512_set1_ps(EXP_LO),
    );
    let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
        _mm512_mul_ps(xc, _mm512_set1_ps(LOG2E)),
    );
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_HI), xc);
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_LO), r);
    let mut p = _mm512_set1_ps(EXP_POLY[0]);
    for c in EXP_POLY[1..].iter().copied() {
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
    }
    let r2 = _mm512_mul_ps(r, r);
    let y = _mm512_add_ps(_mm512_fmadd_ps(p, r2, r), _mm512_set1_ps(1.0));
    let ni = _mm512_cvtps_epi32(n);
    let n1 = _mm512_srai_epi32::<1>(ni);
    let n2 = _mm512_sub_epi32(ni, n1);
    let bias = _mm512_set1_epi32(127);
    let s1 = _mm512_castsi512_ps(_mm512_slli_epi32::<23>(_mm512_add_epi32(n1, bias)));
    let s2 = _mm512_castsi512_ps(_mm512_slli_epi32::<23>(_mm512_add_epi32(n2, bias)));
    let e = _mm512_mul_ps(_mm512_mul_ps(y, s1), s2);
    let over = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(x, _mm512_set1_ps(EXP_HI));
    let e = _mm512_mask_mov_ps(e, over, _mm512_set1_ps(f32::INFINITY));
    let under = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(x, _mm512_set1_ps(EXP_LO));
    let e = _mm512_mask_mov_ps(e, under, _mm512_setzero_ps());
    let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(x, x);
    _mm512_mask_mov_ps(e, nan, x)
}

/// `exp` of each value of `x` into `out` (the test hook for [`exp8`]/[`exp16`]).
///
/// # Safety
/// The CPU must support AVX-512F, AVX2 and FMA; `out.len() >= x.len()`.
#[cfg(test)]
#[target_feature(enable = "avx2,fma,avx512f")]
pub(crate) unsafe fn exp_slice_512(x: &[f32], out: &mut [f32]) {
    assert!(out.len() >= x.len(), "exp_slice: output too short");
    let n = x.len();
    let mut i = 0;
    while i + 16 <= n {
        // SAFETY: i + 16 <= n on both sides.
        unsafe {
            let v = exp16(_mm512_loadu_ps(x.as_ptr().add(i)));
            _mm512_storeu_ps(out.as_mut_ptr().add(i), v);
        }
        i += 16;
    }
    if i < n {
        let m: __mmask16 = (1u32 << (n - i)).wrapping_sub(1) as u16;
        // SAFETY: the mask covers only the n − i values left.
        unsafe {
            let v = exp16(_mm512_maskz_loadu_ps(m, x.as_ptr().add(i)));
            _mm512_mask_storeu_ps(out.as_mut_ptr().add(i), m, v);
        }
    }
}

/// [`exp_slice_512`] with [`exp8`].
///
/// # Safety
/// The CPU must support AVX2 and FMA; `out.len() >= x.len()`.
#[cfg(test)]
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn exp_slice_256(x: &[f32], out: &mut [f32]) {
    assert!(out.len() >= x.len(), "exp_slice: output too short");
    let n = x.len();
    let mut i = 0;
    while i + 8 <= n {
        // SAFETY: i + 8 <= n on both sides.
        unsafe {
            let v = exp8(_mm256_loadu_ps(x.as_ptr().add(i)));
            _mm256_storeu_ps(out.as_mut_ptr().add(i), v);
        }
        i += 8;
    }
    if i < n {
        let mut t = [0f32; 8];
        t[..n - i].copy_from_slice(&x[i..]);
        // SAFETY: t holds 8 f32.
        let v = unsafe { exp8(_mm256_loadu_ps(t.as_ptr())) };
        // SAFETY: as above.
        unsafe { _mm256_storeu_ps(t.as_mut_ptr(), v) };
        out[i..n].copy_from_slice(&t[..n - i]);
    }
}

/// Integer mask of the first `k` (< 8) lanes, for `maskload`/`maskstore`.
#[inline]
#[target_feature(enable = "avx2")]
pub(crate) fn mask8(k: usize) -> __m256i {
    let idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    _mm256_cmpgt_epi32(_mm256_set1_epi32(k as i32), idx)
}

/// Mask of the first `k` (< 16) lanes.
#[inline]
pub(crate) fn mask16(k: usize) -> __mmask16 {
    ((1u32 << k) - 1) as u16
}

/// Horizontal sum of 4 f64 lanes.
#[inline]
#[target_feature(enable = "avx2")]
pub(crate) fn hsum_pd(v: __m256d) -> f64 {
    let s = _mm_add_pd(_mm256_castpd256_pd128(v), _mm256_extractf128_pd::<1>(v));
    _mm_cvtsd_f64(_mm_add_sd(s, _mm_unpackhi_pd(s, s)))
}

/// Horizontal max of 8 lanes (none NaN).
#[inline]
#[target_feature(enable = "avx2")]
pub(crate) fn hmax8(v: __m256) -> f32 {
    let s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_max_ss(s, _mm_shuffle_ps::<1>(s, s));
    _mm_cvtss_f32(s)
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super as imp;
    use crate::cpu::Isa;

    /// Error of `got` against the exact `e^x` (f64), in units of the f32 ulp at the exact value.
    fn ulp_err(x: f32, got: f32) -> f64 {
        let want = f64::from(x).exp();
        let w32 = want as f32;
        if !w32.is_finite() || w32 < f32::MIN_POSITIVE {
            return 0.0;
        }
        let ulp = f64::from(f32::from_bits(w32.to_bits() + 1) - w32);
        (f64::from(got) - want).abs() / ulp
    }

    fn run(isa: Isa, x: &[f32], out: &mut [f32]) {
        if isa.has_avx512() {
            // SAFETY: AVX-512F/AVX2/FMA detected; out is as long as x.
            unsafe { imp::exp_slice_512(x, out) }
        } else {
            // SAFETY: AVX2/FMA detected; out is as long as x.
            unsafe { imp::exp_slice_256(x, out) }
        }
    }

    /// `exp8`, `exp16` and the scalar `exp_twin` give the same bits everywhere, specials
    /// included (the attention kernel relies on it).
    #[test]
    fn vector_exp_and_its_scalar_twin_agree_bit_for_bit() {
        let mut xs: Vec<f32> = (0..=u32::MAX / 7919)
            .map(|i| f32::from_bits(i * 7919))
            .filter(|x| x.abs() < 120.0 || !x.is_finite())
            .collect();
        xs.extend([88.722_83, 88.722_84, -103.972_08, -103.972_09, -0.0, 0.0]);
        let want: Vec<u32> = xs
            .iter()
            .map(|x| crate::cpu::exp::exp_twin(*x).to_bits())
            .collect();
        for isa in Isa::all_supported().into_iter().filter(|i| i.has_avx2()) {
            let mut out = vec![0f32; xs.len()];
            run(isa, &xs, &mut out);
            for ((x, w), g) in xs.iter().zip(&want).zip(&out) {
                let same = *w == g.to_bits() || (g.is_nan() && f32::from_bits(*w).is_nan());
                assert!(
                    same,
                    "{isa:?} exp({x:e}): {g:e} against {:e}",
                    f32::from_bits(*w)
                );
            }
        }
    }

    /// The documented bound of `exp8`/`exp16`: ≤ 1.5 ulp of the exact value for normal results,
    /// over a dense sample of [−87.3, 88.72] (every 61st f32 bit pattern), plus the special cases.
    #[test]
    fn vector_exp_is_within_one_and_a_half_ulp_of_the_exact_value() {
        for isa in Isa::all_supported().into_iter().filter(|i| i.has_avx2()) {
            let mut worst = 0f64;
            let mut xs = Vec::new();
            for start in [0u32, 0x8000_0000] {
                let lim = if start == 0 { 88.72f32 } else { 87.3f32 };
                let mut b = start;
                loop {
                    let x = f32::from_bits(b);
                    if x.abs() > lim {
                        break;
                    }
                    xs.push(x);
                    b += 61;
                }
            }
            let mut out = vec![0f32; xs.len()];
            run(isa, &xs, &mut out);
            for (x, e) in xs.iter().zip(&out) {
                let u = ulp_err(*x, *e);
                assert!(u <= 1.5, "{isa:?} exp({x:e}) = {e:e}, {u} ulp");
                worst = worst.max(u);
            }
            assert!(worst > 0.0);
            let special = [
                f32::NAN,
                f32::INFINITY,
                f32::NEG_INFINITY,
                89.0,
                88.722_84,
                88.722_83,
                -103.98,
                -104.0,
                -100.0,
                -90.0,
                0.0,
                -0.0,
                1.0,
            ];
            let mut out = [0f32; 13];
            run(isa, &special, &mut out);
            for (x, e) in special.iter().zip(&out) {
                let want = x.exp(); // libm expf, correctly rounded in this range
                if want.is_nan() {
                    assert!(e.is_nan(), "{isa:?} exp({x})");
                } else if want < f32::MIN_POSITIVE {
                    // subnormal results: within one subnormal step plus the 2-ulp bound
                    let step = f32::from_bits(1);
                    assert!(
                        (e - want).abs() <= step + want * 3e-7,
                        "{isa:?} exp({x}) = {e:e}"
                    );
                } else {
                    assert!(
                        e == &want || (e - want).abs() <= want * 2.5e-7,
                        "{isa:?} exp({x}) = {e:e}, libm {want:e}"
                    );
                }
            }
        }
    }
}
