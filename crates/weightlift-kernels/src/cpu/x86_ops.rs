//! AVX2/FMA/F16C and AVX-512 twins of the row operations ([`ops`](super::ops)), the KV-cache
//! quantisers ([`kv`](super::kv)) and the exact-mode matmul micro-kernels
//! ([`matvec`](super::matvec)); the Q8-mode ones are in `x86_gemm`.
//!
//! Each function has a scalar twin in those modules; tests run every level in
//! [`Isa::all_supported`](super::Isa::all_supported). The std::arch intrinsics are unsafe to
//! call: they need the CPU features that `Isa` checked at run time and raw pointers into slices
//! whose bounds each function checks first.

#[cfg(target_arch = "x86_64")]
pub(crate) mod imp {
    use std::arch::x86_64::*;

    // ---------------------------------------------------------------- exp

    /// Above this `exp` overflows to +inf (the f32 just below ln(f32::MAX)).
    const EXP_HI: f32 = 88.722_83;
    /// Below this `exp` rounds to 0 (ln of 2⁻¹⁵⁰, half the smallest subnormal).
    const EXP_LO: f32 = -103.972_08;
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    // ln 2 split so that n·LN2_HI is exact for |n| ≤ 2⁹ (Cephes' C1, C2)
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // Cephes expf: e^r ≈ 1 + r + r²·P(r) on |r| ≤ ln2/2
    const P0: f32 = 1.987_569_1e-4;
    const P1: f32 = 1.398_199_9e-3;
    const P2: f32 = 8.333_452e-3;
    const P3: f32 = 4.166_579_6e-2;
    const P4: f32 = 1.666_666_5e-1;
    const P5: f32 = 0.5; // Cephes 5.0000001201e-1, which rounds to 0.5 in f32

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
    pub fn exp8(x: __m256) -> __m256 {
        let xc = _mm256_max_ps(
            _mm256_min_ps(x, _mm256_set1_ps(EXP_HI)),
            _mm256_set1_ps(EXP_LO),
        );
        let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm256_mul_ps(xc, _mm256_set1_ps(LOG2E)),
        );
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_HI), xc);
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_LO), r);
        let mut p = _mm256_set1_ps(P0);
        for c in [P1, P2, P3, P4, P5] {
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
    pub fn exp16(x: __m512) -> __m512 {
        let xc = _mm512_max_ps(
            _mm512_min_ps(x, _mm512_set1_ps(EXP_HI)),
            _mm512_set1_ps(EXP_LO),
        );
        let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm512_mul_ps(xc, _mm512_set1_ps(LOG2E)),
        );
        let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_HI), xc);
        let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_LO), r);
        let mut p = _mm512_set1_ps(P0);
        for c in [P1, P2, P3, P4, P5] {
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
    pub unsafe fn exp_slice_512(x: &[f32], out: &mut [f32]) {
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
    pub unsafe fn exp_slice_256(x: &[f32], out: &mut [f32]) {
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
    fn mask8(k: usize) -> __m256i {
        let idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        _mm256_cmpgt_epi32(_mm256_set1_epi32(k as i32), idx)
    }

    /// Mask of the first `k` (< 16) lanes.
    #[inline]
    fn mask16(k: usize) -> __mmask16 {
        ((1u32 << k) - 1) as u16
    }

    /// Horizontal sum of 4 f64 lanes.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn hsum_pd(v: __m256d) -> f64 {
        let s = _mm_add_pd(_mm256_castpd256_pd128(v), _mm256_extractf128_pd::<1>(v));
        _mm_cvtsd_f64(_mm_add_sd(s, _mm_unpackhi_pd(s, s)))
    }

    /// Horizontal max of 8 lanes (none NaN).
    #[inline]
    #[target_feature(enable = "avx2")]
    fn hmax8(v: __m256) -> f32 {
        let s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_max_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_max_ss(s, _mm_shuffle_ps::<1>(s, s));
        _mm_cvtss_f32(s)
    }

    // ---------------------------------------------------------------- RMSNorm

    /// Σ x² of a row in f64 (the scalar twin's accumulator width), four independent sums.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn sum_sq_f64_256(x: &[f32]) -> f64 {
        let n = x.len();
        let p = x.as_ptr();
        let mut acc = [_mm256_setzero_pd(); 4];
        let mut i = 0;
        while i + 16 <= n {
            // SAFETY: i + 16 <= n.
            let (a, b) = unsafe { (_mm256_loadu_ps(p.add(i)), _mm256_loadu_ps(p.add(i + 8))) };
            let v = [
                _mm256_cvtps_pd(_mm256_castps256_ps128(a)),
                _mm256_cvtps_pd(_mm256_extractf128_ps::<1>(a)),
                _mm256_cvtps_pd(_mm256_castps256_ps128(b)),
                _mm256_cvtps_pd(_mm256_extractf128_ps::<1>(b)),
            ];
            for k in 0..4 {
                acc[k] = _mm256_fmadd_pd(v[k], v[k], acc[k]);
            }
            i += 16;
        }
        let s = _mm256_add_pd(_mm256_add_pd(acc[0], acc[1]), _mm256_add_pd(acc[2], acc[3]));
        let mut t = hsum_pd(s);
        for v in &x[i..] {
            t += f64::from(*v) * f64::from(*v);
        }
        t
    }

    /// `out[i] = (x[i] · scale) · w[i]`, the scalar twin's two roundings.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn scale_mul_256(x: &[f32], w: &[f32], scale: f32, out: &mut [f32]) {
        let n = x.len();
        assert!(w.len() >= n && out.len() >= n, "scale_mul: lengths");
        let s = _mm256_set1_ps(scale);
        let mut i = 0;
        while i + 8 <= n {
            // SAFETY: i + 8 <= n for all three slices.
            unsafe {
                let v = _mm256_mul_ps(_mm256_loadu_ps(x.as_ptr().add(i)), s);
                let v = _mm256_mul_ps(v, _mm256_loadu_ps(w.as_ptr().add(i)));
                _mm256_storeu_ps(out.as_mut_ptr().add(i), v);
            }
            i += 8;
        }
        for j in i..n {
            out[j] = (x[j] * scale) * w[j];
        }
    }

    /// One RMSNorm row: Σx² in f64, `scale` in f32 as the scalar twin, then `(x·scale)·w`.
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA; `w` and `out` are at least as long as `x`.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn rms_norm_row_avx2(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
        let ss = sum_sq_f64_256(x);
        let mean = (ss / x.len() as f64) as f32;
        let scale = 1.0 / (mean + eps).sqrt();
        scale_mul_256(x, w, scale, out);
    }

    /// [`rms_norm_row_avx2`] with 512-bit loads and f64 FMAs.
    ///
    /// # Safety
    /// The CPU must support AVX-512F, AVX2 and FMA; `w` and `out` are at least as long as `x`.
    #[target_feature(enable = "avx512f,avx2,fma")]
    pub unsafe fn rms_norm_row_avx512(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
        let n = x.len();
        assert!(w.len() >= n && out.len() >= n, "rms_norm_row: lengths");
        let p = x.as_ptr();
        let mut acc = [_mm512_setzero_pd(); 4];
        let mut i = 0;
        while i + 32 <= n {
            // SAFETY: i + 32 <= n.
            let (a, b) = unsafe { (_mm512_loadu_ps(p.add(i)), _mm512_loadu_ps(p.add(i + 16))) };
            let v = [
                _mm512_cvtps_pd(_mm512_castps512_ps256(a)),
                _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(
                    _mm512_castps_pd(a),
                ))),
                _mm512_cvtps_pd(_mm512_castps512_ps256(b)),
                _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(
                    _mm512_castps_pd(b),
                ))),
            ];
            for k in 0..4 {
                acc[k] = _mm512_fmadd_pd(v[k], v[k], acc[k]);
            }
            i += 32;
        }
        let s = _mm512_add_pd(_mm512_add_pd(acc[0], acc[1]), _mm512_add_pd(acc[2], acc[3]));
        let ss = _mm512_reduce_add_pd(s) + sum_sq_f64_256(&x[i..]);
        let mean = (ss / n as f64) as f32;
        let scale = 1.0 / (mean + eps).sqrt();
        let sv = _mm512_set1_ps(scale);
        let mut i = 0;
        while i + 16 <= n {
            // SAFETY: i + 16 <= n for all three slices.
            unsafe {
                let v = _mm512_mul_ps(_mm512_loadu_ps(p.add(i)), sv);
                let v = _mm512_mul_ps(v, _mm512_loadu_ps(w.as_ptr().add(i)));
                _mm512_storeu_ps(out.as_mut_ptr().add(i), v);
            }
            i += 16;
        }
        scale_mul_256(&x[i..], &w[i..n], scale, &mut out[i..n]);
    }

    // ---------------------------------------------------------------- softmax

    /// One softmax row: max (NaN ignored, as `f32::max`), `e^(x − max)` with [`exp8`], the sum
    /// in f64, then a multiply by the f32 reciprocal, as the scalar twin.
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA; `out.len() >= x.len()`.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn softmax_row_avx2(x: &[f32], out: &mut [f32]) {
        let n = x.len();
        assert!(out.len() >= n, "softmax_row: output too short");
        let (xp, op) = (x.as_ptr(), out.as_mut_ptr());
        let mut mv = _mm256_set1_ps(f32::NEG_INFINITY);
        let mut i = 0;
        while i + 8 <= n {
            // SAFETY: i + 8 <= n. `max(v, acc)` returns acc when v is NaN.
            mv = _mm256_max_ps(unsafe { _mm256_loadu_ps(xp.add(i)) }, mv);
            i += 8;
        }
        let m = x[i..].iter().fold(hmax8(mv), |a, b| a.max(*b));
        let mb = _mm256_set1_ps(m);
        let mut sum = [_mm256_setzero_pd(); 2];
        let mut i = 0;
        while i + 8 <= n {
            // SAFETY: i + 8 <= n on both sides.
            unsafe {
                let e = exp8(_mm256_sub_ps(_mm256_loadu_ps(xp.add(i)), mb));
                _mm256_storeu_ps(op.add(i), e);
                sum[0] = _mm256_add_pd(sum[0], _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
                sum[1] = _mm256_add_pd(sum[1], _mm256_cvtps_pd(_mm256_extractf128_ps::<1>(e)));
            }
            i += 8;
        }
        let mut s = hsum_pd(_mm256_add_pd(sum[0], sum[1]));
        if i < n {
            let k = mask8(n - i);
            // SAFETY: the mask covers only the n − i values left.
            unsafe {
                let v = _mm256_sub_ps(_mm256_maskload_ps(xp.add(i), k), mb);
                let e = _mm256_and_ps(exp8(v), _mm256_castsi256_ps(k));
                _mm256_maskstore_ps(op.add(i), k, e);
                let mut t = [0f32; 8];
                _mm256_storeu_ps(t.as_mut_ptr(), e);
                s += t[..n - i].iter().map(|v| f64::from(*v)).sum::<f64>();
            }
        }
        let inv = _mm256_set1_ps((1.0 / s) as f32);
        scale_in_place_256(&mut out[..n], inv);
    }

    #[inline]
    #[target_feature(enable = "avx2")]
    fn scale_in_place_256(o: &mut [f32], s: __m256) {
        let n = o.len();
        let op = o.as_mut_ptr();
        let mut i = 0;
        while i + 8 <= n {
            // SAFETY: i + 8 <= n.
            unsafe { _mm256_storeu_ps(op.add(i), _mm256_mul_ps(_mm256_loadu_ps(op.add(i)), s)) };
            i += 8;
        }
        let s0 = _mm256_cvtss_f32(s);
        for v in &mut o[i..] {
            *v *= s0;
        }
    }

    /// [`softmax_row_avx2`] with 512-bit vectors and [`exp16`].
    ///
    /// # Safety
    /// The CPU must support AVX-512F, AVX2 and FMA; `out.len() >= x.len()`.
    #[target_feature(enable = "avx512f,avx2,fma")]
    pub unsafe fn softmax_row_avx512(x: &[f32], out: &mut [f32]) {
        let n = x.len();
        assert!(out.len() >= n, "softmax_row: output too short");
        let (xp, op) = (x.as_ptr(), out.as_mut_ptr());
        let mut mv = _mm512_set1_ps(f32::NEG_INFINITY);
        let mut i = 0;
        while i + 16 <= n {
            // SAFETY: i + 16 <= n. `max(v, acc)` returns acc when v is NaN.
            mv = _mm512_max_ps(unsafe { _mm512_loadu_ps(xp.add(i)) }, mv);
            i += 16;
        }
        let m = x[i..]
            .iter()
            .fold(_mm512_reduce_max_ps(mv), |a, b| a.max(*b));
        let mb = _mm512_set1_ps(m);
        let mut sum = [_mm512_setzero_pd(); 2];
        let mut i = 0;
        let step = |e: __m512, sum: &mut [__m512d; 2]| {
            sum[0] = _mm512_add_pd(sum[0], _mm512_cvtps_pd(_mm512_castps512_ps256(e)));
            sum[1] = _mm512_add_pd(
                sum[1],
                _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(
                    _mm512_castps_pd(e),
                ))),
            );
        };
        while i + 16 <= n {
            // SAFETY: i + 16 <= n on both sides.
            unsafe {
                let e = exp16(_mm512_sub_ps(_mm512_loadu_ps(xp.add(i)), mb));
                _mm512_storeu_ps(op.add(i), e);
                step(e, &mut sum);
            }
            i += 16;
        }
        if i < n {
            let k = mask16(n - i);
            // SAFETY: the mask covers only the n − i values left.
            unsafe {
                let v = _mm512_sub_ps(_mm512_maskz_loadu_ps(k, xp.add(i)), mb);
                let e = _mm512_maskz_mov_ps(k, exp16(v));
                _mm512_mask_storeu_ps(op.add(i), k, e);
                step(e, &mut sum);
            }
        }
        let s = _mm512_reduce_add_pd(_mm512_add_pd(sum[0], sum[1]));
        let inv = (1.0 / s) as f32;
        let iv = _mm512_set1_ps(inv);
        let mut i = 0;
        while i + 16 <= n {
            // SAFETY: i + 16 <= n.
            unsafe { _mm512_storeu_ps(op.add(i), _mm512_mul_ps(_mm512_loadu_ps(op.add(i)), iv)) };
            i += 16;
        }
        for v in &mut out[i..n] {
            *v *= inv;
        }
    }

    // ---------------------------------------------------------------- SwiGLU

    /// `out = g / (1 + e^(−g)) · u`, the scalar twin's operations with [`exp8`] (a true
    /// division, not a reciprocal estimate).
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA; `u` and `out` are at least as long as `g`.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn swiglu_avx2(g: &[f32], u: &[f32], out: &mut [f32]) {
        let n = g.len();
        assert!(u.len() >= n && out.len() >= n, "swiglu: lengths");
        let one = _mm256_set1_ps(1.0);
        let neg = _mm256_set1_ps(-0.0);
        let f = |gv: __m256, uv: __m256| {
            let e = exp8(_mm256_xor_ps(gv, neg));
            _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(one, e)), uv)
        };
        let mut i = 0;
        while i + 8 <= n {
            // SAFETY: i + 8 <= n for all three slices.
            unsafe {
                let v = f(
                    _mm256_loadu_ps(g.as_ptr().add(i)),
                    _mm256_loadu_ps(u.as_ptr().add(i)),
                );
                _mm256_storeu_ps(out.as_mut_ptr().add(i), v);
            }
            i += 8;
        }
        if i < n {
            let k = mask8(n - i);
            // SAFETY: the mask covers only the n − i values left.
            unsafe {
                let v = f(
                    _mm256_maskload_ps(g.as_ptr().add(i), k),
                    _mm256_maskload_ps(u.as_ptr().add(i), k),
                );
                _mm256_maskstore_ps(out.as_mut_ptr().add(i), k, v);
            }
        }
    }

    /// [`swiglu_avx2`] with 512-bit vectors and [`exp16`].
    ///
    /// # Safety
    /// The CPU must support AVX-512F; `u` and `out` are at least as long as `g`.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn swiglu_avx512(g: &[f32], u: &[f32], out: &mut [f32]) {
        let n = g.len();
        assert!(u.len() >= n && out.len() >= n, "swiglu: lengths");
        let one = _mm512_set1_ps(1.0);
        let f = |gv: __m512, uv: __m512| {
            let e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv));
            _mm512_mul_ps(_mm512_div_ps(gv, _mm512_add_ps(one, e)), uv)
        };
        let mut i = 0;
        while i + 16 <= n {
            // SAFETY: i + 16 <= n for all three slices.
            unsafe {
                let v = f(
                    _mm512_loadu_ps(g.as_ptr().add(i)),
                    _mm512_loadu_ps(u.as_ptr().add(i)),
                );
                _mm512_storeu_ps(out.as_mut_ptr().add(i), v);
            }
            i += 16;
        }
        if i < n {
            let k = mask16(n - i);
            // SAFETY: the mask covers only the n − i values left.
            unsafe {
                let v = f(
                    _mm512_maskz_loadu_ps(k, g.as_ptr().add(i)),
                    _mm512_maskz_loadu_ps(k, u.as_ptr().add(i)),
                );
                _mm512_mask_storeu_ps(out.as_mut_ptr().add(i), k, v);
            }
        }
    }

    // ---------------------------------------------------------------- KV cache

    /// The f16 scale of a group, as `kv::kv_scale`: `amax/qmax` rounded to nearest even by
    /// F16C, bumped to the next f16 when that fell below, and capped at 65504.
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    fn kv_scale_f16c(amax: f32, qmax: f32) -> u16 {
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
    pub unsafe fn kv_quantize_avx2(q4: bool, x: &[f32], out: &mut [u8]) {
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
    unsafe fn group_absmax(xp: *const f32) -> __m256 {
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
    unsafe fn kv_scales_f16c(d: __m256) -> __m128i {
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
    unsafe fn quantize_group(q4: bool, xp: *const f32, id: __m256, op: *mut u8) {
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
    pub unsafe fn kv_dequantize_avx2(q4: bool, src: &[u8], out: &mut [f32]) {
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

    // ---------------------------------------------------------------- matmul, exact mode

    /// `out[r·os + t0 + j] (+)= Σ_{k in k0..k0+kl} w[r·cols + k] · xt[k·xs + t0 + j]` for `R`
    /// dequantised weight rows and `16·V` tokens (`xt` is the activations transposed, token
    /// fastest): an outer-product register tile, one broadcast weight per row and `V` token
    /// vectors per `k`, `R·V` accumulators and no horizontal sums. Each lane sums its `kl`
    /// products in order; with `add` the chunk's sums are added to `out`, else stored.
    ///
    /// # Safety
    /// The CPU must support AVX-512F; `w` holds `R` rows of `cols` with `k0 + kl <= cols`, `xt`
    /// holds rows `k0..k0+kl` of stride `xs` with `t0 + 16·V <= xs`, and `out` holds `R` rows
    /// of stride `os` with `t0 + 16·V <= os`.
    #[allow(clippy::too_many_arguments, clippy::needless_range_loop)]
    #[target_feature(enable = "avx512f")]
    pub unsafe fn gemm_outer_avx512<const R: usize, const V: usize>(
        w: &[f32],
        cols: usize,
        xt: &[f32],
        xs: usize,
        t0: usize,
        k0: usize,
        kl: usize,
        out: &mut [f32],
        os: usize,
        add: bool,
    ) {
        assert!(
            k0 + kl <= cols
                && w.len() >= R * cols
                && t0 + 16 * V <= xs
                && xt.len() >= (k0 + kl) * xs
                && t0 + 16 * V <= os
                && out.len() >= (R - 1) * os + t0 + 16 * V,
            "gemm_outer: shapes"
        );
        let (wp, xp, op) = (w.as_ptr(), xt.as_ptr(), out.as_mut_ptr());
        let mut acc = [[_mm512_setzero_ps(); V]; R];
        for k in k0..k0 + kl {
            // SAFETY: k < cols and every index is inside the bounds asserted above.
            unsafe {
                let mut xv = [_mm512_setzero_ps(); V];
                for v in 0..V {
                    xv[v] = _mm512_loadu_ps(xp.add(k * xs + t0 + 16 * v));
                }
                for r in 0..R {
                    let wb = _mm512_set1_ps(*wp.add(r * cols + k));
                    for v in 0..V {
                        acc[r][v] = _mm512_fmadd_ps(wb, xv[v], acc[r][v]);
                    }
                }
            }
        }
        for r in 0..R {
            for v in 0..V {
                // SAFETY: inside `out` as asserted.
                unsafe {
                    let p = op.add(r * os + t0 + 16 * v);
                    let a = if add {
                        _mm512_add_ps(_mm512_loadu_ps(p), acc[r][v])
                    } else {
                        acc[r][v]
                    };
                    _mm512_storeu_ps(p, a);
                }
            }
        }
    }

    /// [`gemm_outer_avx512`] with 8-lane AVX2 FMAs (`8·V` tokens).
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA; shapes as [`gemm_outer_avx512`] with `8·V` tokens.
    #[allow(clippy::too_many_arguments, clippy::needless_range_loop)]
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn gemm_outer_avx2<const R: usize, const V: usize>(
        w: &[f32],
        cols: usize,
        xt: &[f32],
        xs: usize,
        t0: usize,
        k0: usize,
        kl: usize,
        out: &mut [f32],
        os: usize,
        add: bool,
    ) {
        assert!(
            k0 + kl <= cols
                && w.len() >= R * cols
                && t0 + 8 * V <= xs
                && xt.len() >= (k0 + kl) * xs
                && t0 + 8 * V <= os
                && out.len() >= (R - 1) * os + t0 + 8 * V,
            "gemm_outer: shapes"
        );
        let (wp, xp, op) = (w.as_ptr(), xt.as_ptr(), out.as_mut_ptr());
        let mut acc = [[_mm256_setzero_ps(); V]; R];
        for k in k0..k0 + kl {
            // SAFETY: k < cols and every index is inside the bounds asserted above.
            unsafe {
                let mut xv = [_mm256_setzero_ps(); V];
                for v in 0..V {
                    xv[v] = _mm256_loadu_ps(xp.add(k * xs + t0 + 8 * v));
                }
                for r in 0..R {
                    let wb = _mm256_set1_ps(*wp.add(r * cols + k));
                    for v in 0..V {
                        acc[r][v] = _mm256_fmadd_ps(wb, xv[v], acc[r][v]);
                    }
                }
            }
        }
        for r in 0..R {
            for v in 0..V {
                // SAFETY: inside `out` as asserted.
                unsafe {
                    let p = op.add(r * os + t0 + 8 * v);
                    let a = if add {
                        _mm256_add_ps(_mm256_loadu_ps(p), acc[r][v])
                    } else {
                        acc[r][v]
                    };
                    _mm256_storeu_ps(p, a);
                }
            }
        }
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::imp;
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
