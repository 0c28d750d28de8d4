//! The register kernels of the attention fold's SIMD forms ([`super::attention`]): a fold
//! step's keys transposed so that keys share a vector, the scores of four query rows against
//! them, and the values pass with head dimensions in lanes.
// The std::arch intrinsics are unsafe to call: they need the CPU features that `Isa` checked at
// run time and raw pointers into slices whose bounds the callers check.

use std::arch::x86_64::*;

use super::attention::{BLOCK, Weights};
use crate::cpu::attention::Fold;

/// Sixteen rows of sixteen values, transposed.
#[inline]
#[target_feature(enable = "avx512f")]
fn transpose16(r: [__m512; 16]) -> [__m512; 16] {
    let mut t = [_mm512_setzero_ps(); 16];
    for i in 0..8 {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    // u[4a + c] holds, in 128-bit lane L, column 4L + c of rows 4a..4a + 4
    let mut u = [_mm512_setzero_ps(); 16];
    for a in 0..4 {
        let x = _mm512_castps_pd(t[4 * a]);
        let y = _mm512_castps_pd(t[4 * a + 2]);
        let z = _mm512_castps_pd(t[4 * a + 1]);
        let w = _mm512_castps_pd(t[4 * a + 3]);
        u[4 * a] = _mm512_castpd_ps(_mm512_unpacklo_pd(x, y));
        u[4 * a + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(x, y));
        u[4 * a + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(z, w));
        u[4 * a + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(z, w));
    }
    // a 4 × 4 transpose of 128-bit lanes per column offset c
    let mut out = [_mm512_setzero_ps(); 16];
    for c in 0..4 {
        let x0 = _mm512_shuffle_f32x4::<0x88>(u[c], u[4 + c]);
        let x1 = _mm512_shuffle_f32x4::<0xdd>(u[c], u[4 + c]);
        let y0 = _mm512_shuffle_f32x4::<0x88>(u[8 + c], u[12 + c]);
        let y1 = _mm512_shuffle_f32x4::<0xdd>(u[8 + c], u[12 + c]);
        out[c] = _mm512_shuffle_f32x4::<0x88>(x0, y0);
        out[4 + c] = _mm512_shuffle_f32x4::<0x88>(x1, y1);
        out[8 + c] = _mm512_shuffle_f32x4::<0xdd>(x0, y0);
        out[12 + c] = _mm512_shuffle_f32x4::<0xdd>(x1, y1);
    }
    out
}

/// Eight rows of eight values, transposed.
#[inline]
#[target_feature(enable = "avx2")]
fn transpose8(r: [__m256; 8]) -> [__m256; 8] {
    let mut out = [_mm256_setzero_ps(); 8];
    // per half h: u[c] holds, in 128-bit lane L, column 4L + c of rows 4h..4h + 4
    let mut u = [[_mm256_setzero_ps(); 4]; 2];
    for (h, uh) in u.iter_mut().enumerate() {
        let b = 4 * h;
        let lo01 = _mm256_unpacklo_ps(r[b], r[b + 1]);
        let hi01 = _mm256_unpackhi_ps(r[b], r[b + 1]);
        let lo23 = _mm256_unpacklo_ps(r[b + 2], r[b + 3]);
        let hi23 = _mm256_unpackhi_ps(r[b + 2], r[b + 3]);
        uh[0] = _mm256_shuffle_ps::<0x44>(lo01, lo23);
        uh[1] = _mm256_shuffle_ps::<0xee>(lo01, lo23);
        uh[2] = _mm256_shuffle_ps::<0x44>(hi01, hi23);
        uh[3] = _mm256_shuffle_ps::<0xee>(hi01, hi23);
    }
    for c in 0..4 {
        out[c] = _mm256_permute2f128_ps::<0x20>(u[0][c], u[1][c]);
        out[4 + c] = _mm256_permute2f128_ps::<0x31>(u[0][c], u[1][c]);
    }
    out
}

/// Keys `c0..c0 + kn` of kv head `kh`, transposed into `kt` (`head_dim` rows of `kp` keys;
/// keys past `kn` are zero), in blocks of 16 × 16.
///
/// # Safety
/// AVX-512F; `kp` a multiple of 16 with `head_dim · kp` within `kt`, `head_dim` a multiple
/// of 16, and the tile holding keys `c0..c0 + kn`.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn transpose_keys_512(
    f: &Fold<'_>,
    kh: usize,
    c0: usize,
    kn: usize,
    kp: usize,
    kt: &mut [f32],
) {
    assert!(f.k.len() >= (c0 + kn) * f.kv_dim && kt.len() >= f.head_dim * kp);
    let out = kt.as_mut_ptr();
    for j0 in (0..kp).step_by(16) {
        for d0 in (0..f.head_dim).step_by(16) {
            let mut r = [_mm512_setzero_ps(); 16];
            // SAFETY: row c0 + j0 + i < c0 + kn lies in the tile and d0 + 16 <= head_dim; the
            // stores stay within head_dim · kp values of kt.
            unsafe {
                for (i, ri) in r.iter_mut().enumerate().take(kn.saturating_sub(j0)) {
                    let at = (c0 + j0 + i) * f.kv_dim + kh * f.head_dim + d0;
                    *ri = _mm512_loadu_ps(f.k.as_ptr().add(at));
                }
                for (i, c) in transpose16(r).into_iter().enumerate() {
                    _mm512_storeu_ps(out.add((d0 + i) * kp + j0), c);
                }
            }
        }
    }
}

/// [`transpose_keys_512`] in blocks of 8 × 8.
///
/// # Safety
/// AVX2; as [`transpose_keys_512`] with `head_dim` a multiple of 8.
#[target_feature(enable = "avx2")]
pub(super) unsafe fn transpose_keys_256(
    f: &Fold<'_>,
    kh: usize,
    c0: usize,
    kn: usize,
    kp: usize,
    kt: &mut [f32],
) {
    assert!(f.k.len() >= (c0 + kn) * f.kv_dim && kt.len() >= f.head_dim * kp);
    let out = kt.as_mut_ptr();
    for j0 in (0..kp).step_by(8) {
        for d0 in (0..f.head_dim).step_by(8) {
            let mut r = [_mm256_setzero_ps(); 8];
            // SAFETY: as in transpose_keys_512, with 8-value rows.
            unsafe {
                for (i, ri) in r.iter_mut().enumerate().take(kn.saturating_sub(j0)) {
                    let at = (c0 + j0 + i) * f.kv_dim + kh * f.head_dim + d0;
                    *ri = _mm256_loadu_ps(f.k.as_ptr().add(at));
                }
                for (i, c) in transpose8(r).into_iter().enumerate() {
                    _mm256_storeu_ps(out.add((d0 + i) * kp + j0), c);
                }
            }
        }
    }
}

/// `s · scale` of the block's four query rows (`qb`, `head_dim` each) against `NV` vectors of
/// 16 transposed keys, into `w`.
///
/// # Safety
/// AVX-512F; `kt` holds `head_dim` rows of `kp >= 16·NV` keys and `qb` four rows.
#[inline]
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn scores_512<const NV: usize>(
    qb: &[f32],
    hd: usize,
    kt: &[f32],
    kp: usize,
    scale: f32,
    w: &mut Weights,
) {
    let mut acc = [[_mm512_setzero_ps(); NV]; BLOCK];
    let mut kv = [_mm512_setzero_ps(); NV];
    for d in 0..hd {
        // SAFETY: d < head_dim and 16·NV <= kp, within kt; i·hd + d within qb.
        unsafe {
            for (v, kvv) in kv.iter_mut().enumerate() {
                *kvv = _mm512_loadu_ps(kt.as_ptr().add(d * kp + 16 * v));
            }
            for (i, ai) in acc.iter_mut().enumerate() {
                let b = _mm512_set1_ps(*qb.get_unchecked(i * hd + d));
                for (a, k) in ai.iter_mut().zip(kv) {
                    *a = _mm512_fmadd_ps(b, k, *a);
                }
            }
        }
    }
    let s = _mm512_set1_ps(scale);
    for (ai, wi) in acc.iter().zip(w.iter_mut()) {
        for (v, a) in ai.iter().enumerate() {
            // SAFETY: 16·v + 16 <= 64 values of the row.
            unsafe { _mm512_storeu_ps(wi.as_mut_ptr().add(16 * v), _mm512_mul_ps(*a, s)) };
        }
    }
}

/// [`scores_512`] with 8-lane vectors, 16 keys per pass (eight accumulators: AVX2 has 16
/// registers).
///
/// # Safety
/// AVX2 and FMA; as [`scores_512`] with `kp` keys.
#[inline]
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn scores_256(
    qb: &[f32],
    hd: usize,
    kt: &[f32],
    kp: usize,
    scale: f32,
    w: &mut Weights,
) {
    let s = _mm256_set1_ps(scale);
    for j0 in (0..kp).step_by(16) {
        let mut acc = [[_mm256_setzero_ps(); 2]; BLOCK];
        for d in 0..hd {
            // SAFETY: j0 + 16 <= kp and d < head_dim, within kt; i·hd + d within qb.
            unsafe {
                let k0 = _mm256_loadu_ps(kt.as_ptr().add(d * kp + j0));
                let k1 = _mm256_loadu_ps(kt.as_ptr().add(d * kp + j0 + 8));
                for (i, ai) in acc.iter_mut().enumerate() {
                    let b = _mm256_broadcast_ss(qb.get_unchecked(i * hd + d));
                    ai[0] = _mm256_fmadd_ps(b, k0, ai[0]);
                    ai[1] = _mm256_fmadd_ps(b, k1, ai[1]);
                }
            }
        }
        for (ai, wi) in acc.iter().zip(w.iter_mut()) {
            // SAFETY: j0 + 16 <= kp <= 64 values of the row.
            unsafe {
                _mm256_storeu_ps(wi.as_mut_ptr().add(j0), _mm256_mul_ps(ai[0], s));
                _mm256_storeu_ps(wi.as_mut_ptr().add(j0 + 8), _mm256_mul_ps(ai[1], s));
            }
        }
    }
}

/// The values pass over head dimensions `d0..d0 + 16·ND` for the block's rows: `o · keep`,
/// then `+ p_j · v_j` for `j < reach` in order (fused with `FUSED`, for f16 operands whose
/// products are exact); with `SUM` also each row's sum of its weights in the same order.
///
/// # Safety
/// AVX-512F; `pp[i]` holds `reach` weights, `op[i]` the row's output at `d0..d0 + 16·ND`, and
/// `vrow` the value row of tile key `c0` at `d0` with `reach` rows of stride `kvd` after it.
#[inline]
#[target_feature(enable = "avx512f")]
#[allow(clippy::too_many_arguments)]
unsafe fn values_512<const ND: usize, const SUM: bool, const FUSED: bool>(
    pp: &[*const f32; BLOCK],
    op: &[*mut f32; BLOCK],
    keep: &[f32; BLOCK],
    vrow: *const f32,
    kvd: usize,
    reach: usize,
    sums: &mut [f32; BLOCK],
) {
    let mut acc = [[_mm512_setzero_ps(); ND]; BLOCK];
    let mut vv = [_mm512_setzero_ps(); ND];
    // SAFETY: as the contract.
    unsafe {
        for (i, ai) in acc.iter_mut().enumerate() {
            let k = _mm512_set1_ps(keep[i]);
            for (u, a) in ai.iter_mut().enumerate() {
                *a = _mm512_mul_ps(_mm512_loadu_ps(op[i].add(16 * u)), k);
            }
        }
        for j in 0..reach {
            for (u, x) in vv.iter_mut().enumerate() {
                *x = _mm512_loadu_ps(vrow.add(j * kvd + 16 * u));
            }
            for (i, ai) in acc.iter_mut().enumerate() {
                let p = *pp[i].add(j);
                if SUM {
                    sums[i] += p;
                }
                let b = _mm512_set1_ps(p);
                for (a, x) in ai.iter_mut().zip(vv) {
                    *a = if FUSED {
                        _mm512_fmadd_ps(b, x, *a)
                    } else {
                        _mm512_add_ps(*a, _mm512_mul_ps(b, x))
                    };
                }
            }
        }
        for (i, ai) in acc.iter().enumerate() {
            for (u, a) in ai.iter().enumerate() {
                _mm512_storeu_ps(op[i].add(16 * u), *a);
            }
        }
    }
}

/// [`values_512`] with 8-lane vectors (`ND` of them).
///
/// # Safety
/// AVX2 and FMA; as [`values_512`] with `8·ND` dimensions.
#[inline]
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn values_256<const ND: usize, const SUM: bool, const FUSED: bool>(
    pp: &[*const f32; BLOCK],
    op: &[*mut f32; BLOCK],
    keep: &[f32; BLOCK],
    vrow: *const f32,
    kvd: usize,
    reach: usize,
    sums: &mut [f32; BLOCK],
) {
    let mut acc = [[_mm256_setzero_ps(); ND]; BLOCK];
    let mut vv = [_mm256_setzero_ps(); ND];
    // SAFETY: as the contract.
    unsafe {
        for (i, ai) in acc.iter_mut().enumerate() {
            let k = _mm256_set1_ps(keep[i]);
            for (u, a) in ai.iter_mut().enumerate() {
                *a = _mm256_mul_ps(_mm256_loadu_ps(op[i].add(8 * u)), k);
            }
        }
        for j in 0..reach {
            for (u, x) in vv.iter_mut().enumerate() {
                *x = _mm256_loadu_ps(vrow.add(j * kvd + 8 * u));
            }
            for (i, ai) in acc.iter_mut().enumerate() {
                let p = *pp[i].add(j);
                if SUM {
                    sums[i] += p;
                }
                let b = _mm256_set1_ps(p);
                for (a, x) in ai.iter_mut().zip(vv) {
                    *a = if FUSED {
                        _mm256_fmadd_ps(b, x, *a)
                    } else {
                        _mm256_add_ps(*a, _mm256_mul_ps(b, x))
                    };
                }
            }
        }
        for (i, ai) in acc.iter().enumerate() {
            for (u, a) in ai.iter().enumerate() {
                _mm256_storeu_ps(op[i].add(8 * u), *a);
            }
        }
    }
}

/// Calls `$f::<$nd, SUM, FUSED>` with the run-time `sum` and `fused`.
macro_rules! values_pass {
    ($f:ident, $nd:literal, $sum:expr, $fused:expr, ($($arg:expr),*)) => {
        match ($sum, $fused) {
            (true, true) => $f::<$nd, true, true>($($arg),*),
            (true, false) => $f::<$nd, true, false>($($arg),*),
            (false, true) => $f::<$nd, false, true>($($arg),*),
            (false, false) => $f::<$nd, false, false>($($arg),*),
        }
    };
}

/// [`values_512`] over `nd` (1 to 4) vectors of 16 dimensions, with the run-time flags.
///
/// # Safety
/// As [`values_512`].
#[inline]
#[target_feature(enable = "avx512f")]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn values_by_512(
    nd: usize,
    sum: bool,
    fused: bool,
    pp: &[*const f32; BLOCK],
    op: &[*mut f32; BLOCK],
    keep: &[f32; BLOCK],
    vrow: *const f32,
    kvd: usize,
    reach: usize,
    sums: &mut [f32; BLOCK],
) {
    // SAFETY: as this function's contract.
    unsafe {
        match nd {
            1 => values_pass!(
                values_512,
                1,
                sum,
                fused,
                (pp, op, keep, vrow, kvd, reach, sums)
            ),
            2 => values_pass!(
                values_512,
                2,
                sum,
                fused,
                (pp, op, keep, vrow, kvd, reach, sums)
            ),
            3 => values_pass!(
                values_512,
                3,
                sum,
                fused,
                (pp, op, keep, vrow, kvd, reach, sums)
            ),
            _ => values_pass!(
                values_512,
                4,
                sum,
                fused,
                (pp, op, keep, vrow, kvd, reach, sums)
            ),
        }
    }
}

/// [`values_256`] over `nd` (1 or 2) vectors of 8 dimensions, with the run-time flags.
///
/// # Safety
/// As [`values_256`].
#[inline]
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn values_by_256(
    nd: usize,
    sum: bool,
    fused: bool,
    pp: &[*const f32; BLOCK],
    op: &[*mut f32; BLOCK],
    keep: &[f32; BLOCK],
    vrow: *const f32,
    kvd: usize,
    reach: usize,
    sums: &mut [f32; BLOCK],
) {
    // SAFETY: as this function's contract.
    unsafe {
        match nd {
            1 => values_pass!(
                values_256,
                1,
                sum,
                fused,
                (pp, op, keep, vrow, kvd, reach, sums)
            ),
            _ => values_pass!(
                values_256,
                2,
                sum,
                fused,
                (pp, op, keep, vrow, kvd, reach, sums)
            ),
        }
    }
}
