//! The exact-mode matmul micro-kernels (f32 outer products over dequantised weight panels).

use std::arch::x86_64::*;

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
pub(crate) unsafe fn gemm_outer_avx512<const R: usize, const V: usize>(
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
pub(crate) unsafe fn gemm_outer_avx2<const R: usize, const V: usize>(
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
