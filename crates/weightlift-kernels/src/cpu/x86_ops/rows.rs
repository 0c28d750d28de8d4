//! RMSNorm, softmax and SwiGLU rows: the AVX2+FMA and AVX-512 twins of `ops`.

use std::arch::x86_64::*;

use super::math::*;

/// Σ x² of a row in f64 (the scalar twin's accumulator width), four independent sums.
#[inline]
#[target_feature(enable = "avx2,fma")]
pub(crate) fn sum_sq_f64_256(x: &[f32]) -> f64 {
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
pub(crate) fn scale_mul_256(x: &[f32], w: &[f32], scale: f32, out: &mut [f32]) {
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
pub(crate) unsafe fn rms_norm_row_avx2(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
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
pub(crate) unsafe fn rms_norm_row_avx512(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
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
pub(crate) unsafe fn softmax_row_avx2(x: &[f32], out: &mut [f32]) {
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
pub(crate) fn scale_in_place_256(o: &mut [f32], s: __m256) {
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
pub(crate) unsafe fn softmax_row_avx512(x: &[f32], out: &mut [f32]) {
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
pub(crate) unsafe fn swiglu_avx2(g: &[f32], u: &[f32], out: &mut [f32]) {
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
pub(crate) unsafe fn swiglu_avx512(g: &[f32], u: &[f32], out: &mut [f32]) {
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
