//! Scalar block quantisers that write the bytes llama.cpp's reference quantisers write
//! (`quantize_row_*_ref`, which `ggml_quantize_chunk` runs when no importance matrix is given).
//!
//! Bit-identity means the same float operations in the same order, no fused multiply-add, and
//! the same integer conversions:
//!
//! - ggml's `nearest_int` (add 1.5·2²³ and read the mantissa bits) for the K-quants, `roundf`
//!   (half away from zero) for Q8_0, and truncation after `+ 0.5` for Q4_0..Q5_1;
//! - float to small-integer casts as x86-64 performs them (`cvttss2si`: NaN and out-of-range
//!   values become `i32::MIN`, then the low byte is kept), where Rust's `as` would saturate;
//! - C's `MAX`/`MIN` macros (`a > b ? a : b`), whose NaN behaviour differs from `f32::max`;
//! - ggml's own f32 to f16 rounding ([`ggml_f16`]).
//!
//! Each function takes exactly one block of values and writes exactly one block of bytes.

// The loops follow ggml's index by index over several arrays in lock-step; iterators would hide
// the order of operations that bit-identity depends on.
#![allow(clippy::needless_range_loop)]

use super::dequant_scalar::scale_min_k4;
use super::half::f16_to_f32;

/// ggml's `GROUP_MAX_EPS`: groups whose largest magnitude is below it quantise to zero.
const GROUP_MAX_EPS: f32 = 1e-15;

/// ggml's `nearest_int`: round to nearest (ties to even) through the f32 mantissa, exact for
/// |x| < 2²²; larger values give the same wrapped bits ggml gives.
#[inline(always)]
pub(crate) fn nearest_int(x: f32) -> i32 {
    let bits = (x + 12_582_912.0).to_bits() as i32;
    (bits & 0x007f_ffff) - 0x0040_0000
}

/// A float to 32-bit integer conversion as x86-64's `cvttss2si` does it: truncation, with NaN
/// and out-of-range values giving `i32::MIN` (C leaves them undefined; ggml's binaries do this).
#[inline(always)]
pub(crate) fn cvtt(x: f32) -> i32 {
    if x.is_nan() || !(-2_147_483_648.0..2_147_483_648.0).contains(&x) {
        i32::MIN
    } else {
        x as i32
    }
}

/// C's `MAX(a, b)`: `a > b ? a : b`.
#[inline(always)]
fn c_max(a: f32, b: f32) -> f32 {
    if a > b { a } else { b }
}

/// f32 to f16 bits as ggml's `GGML_FP32_TO_FP16` computes them in software: round to nearest
/// even, overflow to ±inf, and every NaN to the quiet NaN `0x7e00` (with the sign kept).
#[inline]
pub(crate) fn ggml_f16(f: f32) -> u16 {
    // Scaling by 2¹¹² then 2⁻¹¹⁰ rounds the magnitude into f16 range (saturating to inf), and
    // adding a power of two placed at the f16 mantissa's last bit makes the f32 addition round
    // the mantissa to f16 precision, normal or subnormal.
    let base = (f.abs() * f32::from_bits(0x7780_0000)) * f32::from_bits(0x0880_0000);
    let w = f.to_bits();
    let shl1 = w.wrapping_add(w);
    let sign = w & 0x8000_0000;
    let bias = (shl1 & 0xff00_0000).max(0x7100_0000);
    let rounded = (f32::from_bits((bias >> 1) + 0x0780_0000) + base).to_bits();
    let exp = (rounded >> 13) & 0x7c00;
    let man = rounded & 0x0fff;
    let nonsign = if shl1 > 0xff00_0000 {
        0x7e00
    } else {
        exp + man
    };
    ((sign >> 16) | nonsign) as u16
}

/// Writes f16 bits `h` at `off`, little-endian.
#[inline(always)]
fn put_f16(dst: &mut [u8], off: usize, h: u16) {
    dst[off..off + 2].copy_from_slice(&h.to_le_bytes());
}

/// The value of largest magnitude (the first such, as ggml scans), and that magnitude.
#[inline(always)]
fn signed_absmax(x: &[f32]) -> (f32, f32) {
    let (mut amax, mut max) = (0f32, 0f32);
    for &v in x {
        if amax < v.abs() {
            amax = v.abs();
            max = v;
        }
    }
    (amax, max)
}

/// The smallest and largest value as ggml's Q4_1 / Q5_1 scan finds them.
#[inline(always)]
fn min_max(x: &[f32]) -> (f32, f32) {
    let (mut min, mut max) = (f32::MAX, -f32::MAX);
    for &v in x {
        if v < min {
            min = v;
        }
        if v > max {
            max = v;
        }
    }
    (min, max)
}

/// Q8_0: 32 values to `d` (f16) and 32 signed bytes, `q = roundf(x / d)` with `d = amax/127`.
pub(crate) fn q8_0(x: &[f32], dst: &mut [u8]) {
    let amax = x.iter().fold(0f32, |m, v| c_max(m, v.abs()));
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    put_f16(dst, 0, ggml_f16(d));
    for (q, &v) in dst[2..34].iter_mut().zip(x) {
        *q = cvtt((v * id).round()) as u8;
    }
}

/// Q4_0: `d = max / -8` (the signed value of largest magnitude), `q = min(15, trunc(x/d + 8.5))`.
pub(crate) fn q4_0(x: &[f32], dst: &mut [u8]) {
    let (_, max) = signed_absmax(x);
    let d = max / -8.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    put_f16(dst, 0, ggml_f16(d));
    let q = |v: f32| (cvtt(v * id + 8.5) as i8).min(15) as u8;
    for j in 0..16 {
        dst[2 + j] = q(x[j]) | (q(x[j + 16]) << 4);
    }
}

/// Q4_1: `d = (max - min)/15`, `m = min`, `q = min(15, trunc((x - min)/d + 0.5))`.
pub(crate) fn q4_1(x: &[f32], dst: &mut [u8]) {
    let (min, max) = min_max(x);
    let d = (max - min) / 15.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    put_f16(dst, 0, ggml_f16(d));
    put_f16(dst, 2, ggml_f16(min));
    let q = |v: f32| (cvtt((v - min) * id + 0.5) as i8).min(15) as u8;
    for j in 0..16 {
        dst[4 + j] = q(x[j]) | (q(x[j + 16]) << 4);
    }
}

/// Q5_0: `d = max / -16`, `q = min(31, trunc(x/d + 16.5))`, the fifth bits packed into `qh`.
pub(crate) fn q5_0(x: &[f32], dst: &mut [u8]) {
    let (_, max) = signed_absmax(x);
    let d = max / -16.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    put_f16(dst, 0, ggml_f16(d));
    let q = |v: f32| (cvtt(v * id + 16.5) as i8).min(31) as u8;
    pack5(x, q, &mut dst[2..22]);
}

/// Q5_1: `d = (max - min)/31`, `m = min`, `q = trunc((x - min)/d + 0.5)` (no clamp in ggml).
pub(crate) fn q5_1(x: &[f32], dst: &mut [u8]) {
    let (min, max) = min_max(x);
    let d = (max - min) / 31.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    put_f16(dst, 0, ggml_f16(d));
    put_f16(dst, 2, ggml_f16(min));
    let q = |v: f32| cvtt((v - min) * id + 0.5) as u8;
    pack5(x, q, &mut dst[4..24]);
}

/// Packs 32 five-bit quants as Q5_0 / Q5_1 store them: `qh` (u32, bit j = fifth bit of value
/// j), then 16 bytes of low nibbles (value j low, value j + 16 high).
#[inline(always)]
fn pack5(x: &[f32], q: impl Fn(f32) -> u8, out: &mut [u8]) {
    let mut qh = 0u32;
    for j in 0..16 {
        let (a, b) = (q(x[j]), q(x[j + 16]));
        out[4 + j] = (a & 0x0f) | ((b & 0x0f) << 4);
        qh |= u32::from((a & 0x10) >> 4) << j;
        qh |= u32::from((b & 0x10) >> 4) << (j + 16);
    }
    out[..4].copy_from_slice(&qh.to_le_bytes());
}

/// ggml's `make_qkx2_quants` with Q4_K's parameters (`nmax` 15, `rmin` -1, `rdelta` 0.1,
/// `nstep` 20, squared error): fits `x ≈ scale·l - the_min` with weights `w` by trying 21
/// scales; writes the quants into `l` and returns `(scale, the_min)`.
pub(crate) fn make_qkx2_q4k(x: &[f32; 32], w: &[f32; 32], l: &mut [u8]) -> (f32, f32) {
    const NMAX: i32 = 15;
    let (mut min, mut max) = (x[0], x[0]);
    let mut sum_w = w[0];
    let mut sum_x = sum_w * x[0];
    for i in 1..32 {
        if x[i] < min {
            min = x[i];
        }
        if x[i] > max {
            max = x[i];
        }
        sum_w += w[i];
        sum_x += w[i] * x[i];
    }
    if min > 0.0 {
        min = 0.0;
    }
    if max == min {
        l[..32].fill(0);
        return (0.0, -min);
    }
    let mut iscale = NMAX as f32 / (max - min);
    let mut scale = 1.0 / iscale;
    let mut best_error = 0f32;
    for i in 0..32 {
        let q = nearest_int(iscale * (x[i] - min)).clamp(0, NMAX);
        l[i] = q as u8;
        let diff = scale * q as f32 + min - x[i];
        best_error += w[i] * (diff * diff);
    }
    let mut aux = [0u8; 32];
    for step in 0..=20 {
        iscale = (-1.0 + 0.1 * step as f32 + NMAX as f32) / (max - min);
        let (mut sum_l, mut sum_l2, mut sum_xl) = (0f32, 0f32, 0f32);
        for i in 0..32 {
            let q = nearest_int(iscale * (x[i] - min)).clamp(0, NMAX);
            aux[i] = q as u8;
            let lf = q as f32;
            sum_l += w[i] * lf;
            sum_l2 += w[i] * lf * lf;
            sum_xl += w[i] * lf * x[i];
        }
        let det = sum_w * sum_l2 - sum_l * sum_l;
        if det > 0.0 {
            let mut this_scale = (sum_w * sum_xl - sum_x * sum_l) / det;
            let mut this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det;
            if this_min > 0.0 {
                this_min = 0.0;
                this_scale = sum_xl / sum_l2;
            }
            let mut cur_error = 0f32;
            for i in 0..32 {
                let diff = this_scale * aux[i] as f32 + this_min - x[i];
                cur_error += w[i] * (diff * diff);
            }
            if cur_error < best_error {
                l[..32].copy_from_slice(&aux);
                best_error = cur_error;
                scale = this_scale;
                min = this_min;
            }
        }
    }
    (scale, -min)
}

/// The per-value weights Q4_K's fit uses: `sqrt(mean(x²)) + |x|`.
#[inline(always)]
pub(crate) fn q4k_weights(x: &[f32; 32]) -> [f32; 32] {
    let mut sum_x2 = 0f32;
    for v in x {
        sum_x2 += v * v;
    }
    let av_x = (sum_x2 / 32.0).sqrt();
    x.map(|v| av_x + v.abs())
}

/// Q4_K: eight sub-blocks of 32, each fitted by [`make_qkx2_q4k`]; their scales and mins are
/// quantised to 6 bits against the block's largest (`d`, `dmin` as f16), then every value is
/// requantised against its sub-block's final scale and min.
pub(crate) fn q4_k(x: &[f32], dst: &mut [u8]) {
    let mut l = [0u8; 256];
    let mut scales = [0f32; 8];
    let mut mins = [0f32; 8];
    for j in 0..8 {
        let xs: &[f32; 32] = x[32 * j..32 * j + 32].try_into().expect("32 values");
        let w = q4k_weights(xs);
        (scales[j], mins[j]) = make_qkx2_q4k(xs, &w, &mut l[32 * j..]);
    }
    q4_k_finish(x, &scales, &mins, &mut l, dst);
}

/// The part of Q4_K after the per-sub-block fits (shared with the SIMD fits).
pub(crate) fn q4_k_finish(
    x: &[f32],
    scales: &[f32; 8],
    mins: &[f32; 8],
    l: &mut [u8; 256],
    dst: &mut [u8],
) {
    let (mut max_scale, mut max_min) = (0f32, 0f32);
    for j in 0..8 {
        if scales[j] > max_scale {
            max_scale = scales[j];
        }
        if mins[j] > max_min {
            max_min = mins[j];
        }
    }
    let inv_scale = if max_scale > 0.0 {
        63.0 / max_scale
    } else {
        0.0
    };
    let inv_min = if max_min > 0.0 { 63.0 / max_min } else { 0.0 };
    let sc = &mut dst[4..16];
    sc.fill(0);
    for j in 0..8 {
        let ls = (nearest_int(inv_scale * scales[j]) as u8).min(63);
        let lm = (nearest_int(inv_min * mins[j]) as u8).min(63);
        if j < 4 {
            sc[j] = ls;
            sc[j + 4] = lm;
        } else {
            sc[j + 4] = (ls & 0x0f) | ((lm & 0x0f) << 4);
            sc[j - 4] |= (ls >> 4) << 6;
            sc[j] |= (lm >> 4) << 6;
        }
    }
    let dh = ggml_f16(max_scale / 63.0);
    let mh = ggml_f16(max_min / 63.0);
    put_f16(dst, 0, dh);
    put_f16(dst, 2, mh);
    for j in 0..8 {
        let (s, m) = scale_min_k4(j, &dst[4..16]);
        let d = f16_to_f32(dh) * s as f32;
        if d == 0.0 {
            continue; // ggml keeps the fit's quants for this sub-block
        }
        let dm = f16_to_f32(mh) * m as f32;
        for i in 0..32 {
            l[32 * j + i] = nearest_int((x[32 * j + i] + dm) / d).clamp(0, 15) as u8;
        }
    }
    let qs = &mut dst[16..144];
    for (half, out) in qs.chunks_exact_mut(32).enumerate() {
        let base = 64 * half;
        for i in 0..32 {
            out[i] = l[base + i] | (l[base + i + 32] << 4);
        }
    }
}

/// ggml's `make_qx_quants` with Q6_K's parameters (`nmax` 32, weights `x²`, no importance
/// matrix): a signed 6-bit fit of 16 values trying 19 scales; writes `q + 32` into `l` and
/// returns the scale.
pub(crate) fn make_qx_q6k(x: &[f32; 16], l: &mut [u8]) -> f32 {
    const NMAX: i32 = 32;
    let (amax, max) = signed_absmax_strict(x);
    if amax < GROUP_MAX_EPS {
        l[..16].fill(0);
        return 0.0;
    }
    let quant = |iscale: f32, v: f32| nearest_int(iscale * v).clamp(-NMAX, NMAX - 1);
    let mut iscale = -NMAX as f32 / max;
    let (mut sumlx, mut suml2) = (0f32, 0f32);
    for i in 0..16 {
        let q = quant(iscale, x[i]);
        l[i] = (q + NMAX) as u8;
        let w = x[i] * x[i];
        sumlx += w * x[i] * q as f32;
        suml2 += w * q as f32 * q as f32;
    }
    let mut scale = if suml2 != 0.0 { sumlx / suml2 } else { 0.0 };
    let mut best = scale * sumlx;
    for is in -9..=9 {
        if is == 0 {
            continue;
        }
        iscale = -(NMAX as f32 + 0.1 * is as f32) / max;
        sumlx = 0.0;
        suml2 = 0.0;
        for i in 0..16 {
            let q = quant(iscale, x[i]) as f32;
            let w = x[i] * x[i];
            sumlx += w * x[i] * q;
            suml2 += w * q * q;
        }
        if suml2 > 0.0 && sumlx * sumlx > best * suml2 {
            for i in 0..16 {
                l[i] = (quant(iscale, x[i]) + NMAX) as u8;
            }
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    scale
}

/// [`signed_absmax`] with ggml's `ax > amax` test (the K-quant helpers' form; the same result
/// for finite values, kept literal so the two scans cannot be confused).
#[inline(always)]
fn signed_absmax_strict(x: &[f32]) -> (f32, f32) {
    let (mut amax, mut max) = (0f32, 0f32);
    for &v in x {
        let ax = v.abs();
        if ax > amax {
            amax = ax;
            max = v;
        }
    }
    (amax, max)
}

/// Q6_K: sixteen sub-blocks of 16, each fitted by [`make_qx_q6k`]; the scales are quantised to
/// signed bytes against the largest (`d` as f16), then every value is requantised against its
/// sub-block's final scale. A block whose scales are all below `GROUP_MAX_EPS` is all zeros.
pub(crate) fn q6_k(x: &[f32], dst: &mut [u8]) {
    let mut l = [0u8; 256];
    let mut scales = [0f32; 16];
    for ib in 0..16 {
        let xs: &[f32; 16] = x[16 * ib..16 * ib + 16].try_into().expect("16 values");
        scales[ib] = make_qx_q6k(xs, &mut l[16 * ib..]);
    }
    q6_k_finish(x, &scales, &mut l, dst);
}

/// The part of Q6_K after the per-sub-block fits (shared with the SIMD fits).
pub(crate) fn q6_k_finish(x: &[f32], scales: &[f32; 16], l: &mut [u8; 256], dst: &mut [u8]) {
    let (mut max_scale, mut max_abs_scale) = (0f32, 0f32);
    for &s in scales {
        if s.abs() > max_abs_scale {
            max_abs_scale = s.abs();
            max_scale = s;
        }
    }
    if max_abs_scale < GROUP_MAX_EPS {
        dst[..210].fill(0);
        return;
    }
    let iscale = -128.0 / max_scale;
    let dh = ggml_f16(1.0 / iscale);
    put_f16(dst, 208, dh);
    for (ib, &s) in scales.iter().enumerate() {
        dst[192 + ib] = nearest_int(iscale * s).min(127) as u8;
    }
    for j in 0..16 {
        let d = f16_to_f32(dh) * (dst[192 + j] as i8) as f32;
        if d == 0.0 {
            continue; // ggml keeps the fit's quants for this sub-block
        }
        for i in 0..16 {
            l[16 * j + i] = (nearest_int(x[16 * j + i] / d).clamp(-32, 31) + 32) as u8;
        }
    }
    let (ql, rest) = dst[..192].split_at_mut(128);
    let qh = &mut rest[..64];
    for half in 0..2 {
        let (ql, qh, lb) = (&mut ql[64 * half..], &mut qh[32 * half..], 128 * half);
        for i in 0..32 {
            let (a, b) = (l[lb + i], l[lb + i + 32]);
            let (c, e) = (l[lb + i + 64], l[lb + i + 96]);
            ql[i] = (a & 0x0f) | ((c & 0x0f) << 4);
            ql[i + 32] = (b & 0x0f) | ((e & 0x0f) << 4);
            qh[i] = (a >> 4) | ((b >> 4) << 2) | ((c >> 4) << 4) | ((e >> 4) << 6);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ggml_f16_rounds_as_ieee_for_every_finite_value_and_quiets_nan() {
        // `half` is an independent IEEE binary16 implementation; ggml's software conversion
        // must agree with it on every finite value and infinity (a stride through all f32 bit
        // patterns, plus the neighbourhood of every f16 rounding boundary near 1 and 65504).
        let mut bits = 0u32;
        loop {
            let f = f32::from_bits(bits);
            if f.is_nan() {
                assert_eq!(ggml_f16(f) & 0x7fff, 0x7e00, "{bits:#010x}");
            } else {
                assert_eq!(
                    ggml_f16(f),
                    half::f16::from_f32(f).to_bits(),
                    "{bits:#010x}"
                );
            }
            match bits.checked_add(4093) {
                Some(b) => bits = b,
                None => break,
            }
        }
        for base in [1.0f32, 65504.0, 6.1e-5, 5.96e-8] {
            let b = base.to_bits();
            for k in b - 9000..b + 9000 {
                let f = f32::from_bits(k);
                assert_eq!(ggml_f16(f), half::f16::from_f32(f).to_bits(), "{k:#010x}");
            }
        }
    }

    #[test]
    fn nearest_int_rounds_ties_to_even_and_cvtt_gives_the_x86_sentinel() {
        assert_eq!(nearest_int(2.5), 2);
        assert_eq!(nearest_int(3.5), 4);
        assert_eq!(nearest_int(-2.5), -2);
        assert_eq!(nearest_int(-0.4), 0);
        assert_eq!(cvtt(f32::NAN), i32::MIN);
        assert_eq!(cvtt(f32::INFINITY), i32::MIN);
        assert_eq!(cvtt(-3e9), i32::MIN);
        assert_eq!(cvtt(-2.9), -2);
    }
}
