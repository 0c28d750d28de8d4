//! AVX2 forms of the ggml block quantisers (used at the AVX2 and AVX-512 levels), writing the
//! same bytes as the scalar reference in `quantize_blocks`.
//!
//! - Q8_0: the block maximum by vector max (exact), the quants by the same `x · (1/d)` product
//!   and a round-half-away-from-zero built from truncation (exact); blocks whose `1/d`
//!   overflows take the scalar path, which reproduces x86's conversion of infinities.
//! - Q4_K and Q6_K: the per-sub-block fits (`make_qkx2_quants`, `make_qx_quants`) are
//!   sequential sums, so they are not split along a sub-block: instead one vector lane runs one
//!   sub-block, eight side by side, each lane doing the scalar's operations in the scalar's order
//!   (plain multiplies and adds, no FMA; C's comparisons as compare-and-blend). The 6-bit scale
//!   packing and the final requantisation stay scalar.
// std::arch loads take raw pointers; each says which bound makes it sound.

use std::arch::x86_64::*;

use super::Isa;
use super::quantize_blocks::{self as blocks, ggml_f16};
use crate::types::{FloatType, QuantType};

/// The source of a run of blocks.
#[derive(Clone, Copy)]
pub(crate) enum Src<'a> {
    F32(&'a [f32]),
    Bytes(FloatType, &'a [u8]),
}

/// A quantiser with an AVX2 form.
#[derive(Clone, Copy)]
pub(crate) struct Simd {
    ty: QuantType,
}

/// The AVX2 form of `ty` at `isa`, if there is one.
pub(crate) fn pick(isa: Isa, ty: QuantType) -> Option<Simd> {
    let has = matches!(ty, QuantType::Q8_0 | QuantType::Q4_K | QuantType::Q6_K);
    (has && isa.has_avx2()).then_some(Simd { ty })
}

impl Simd {
    /// Quantises whole blocks of `src` into `dst`; `Err((index, value))` names the first
    /// non-finite value of the first bad block.
    pub(crate) fn run(self, src: Src<'_>, dst: &mut [u8]) -> Result<(), (usize, f32)> {
        // SAFETY: `pick` returned this only where `Isa::has_avx2` saw AVX2, FMA and F16C.
        unsafe { run_avx2(self.ty, src, dst) }
    }
}

#[repr(C, align(32))]
struct Aligned<const N: usize>([f32; N]);

#[target_feature(enable = "avx2,fma,f16c")]
fn run_avx2(ty: QuantType, src: Src<'_>, dst: &mut [u8]) -> Result<(), (usize, f32)> {
    let (bs, bb) = (ty.block_size(), ty.block_bytes());
    let mut buf = Aligned([0f32; 256]);
    for (b, out) in dst.chunks_exact_mut(bb).enumerate() {
        let x: &[f32] = match src {
            Src::F32(s) => &s[b * bs..(b + 1) * bs],
            Src::Bytes(ft, bytes) => {
                let es = ft.size();
                widen(ft, &bytes[b * bs * es..(b + 1) * bs * es], &mut buf.0[..bs]);
                &buf.0[..bs]
            }
        };
        if !all_finite(x) {
            return super::quantize::check_finite(x).map_err(|(i, v)| (b * bs + i, v));
        }
        match ty {
            QuantType::Q8_0 => q8_0(x, out),
            QuantType::Q4_K => q4_k(x, out),
            _ => q6_k(x, out),
        }
    }
    Ok(())
}

/// Widens little-endian `ft` bytes (a multiple of 8 values) into `out`, exactly.
#[target_feature(enable = "avx2,fma,f16c")]
fn widen(ft: FloatType, bytes: &[u8], out: &mut [f32]) {
    let n = out.len();
    assert!(
        n.is_multiple_of(8) && bytes.len() == n * ft.size(),
        "widen: lengths"
    );
    for i in (0..n).step_by(8) {
        // SAFETY: i + 8 <= n values on both sides (asserted above); loads are unaligned.
        unsafe {
            let v = match ft {
                FloatType::F32 => _mm256_loadu_ps(bytes.as_ptr().add(4 * i).cast()),
                FloatType::F16 => {
                    _mm256_cvtph_ps(_mm_loadu_si128(bytes.as_ptr().add(2 * i).cast()))
                }
                FloatType::BF16 => {
                    let h = _mm_loadu_si128(bytes.as_ptr().add(2 * i).cast());
                    _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
                }
            };
            _mm256_storeu_ps(out.as_mut_ptr().add(i), v);
        }
    }
}

/// Whether no value of `x` (a multiple of 8) is NaN or ±inf.
#[target_feature(enable = "avx2,fma,f16c")]
fn all_finite(x: &[f32]) -> bool {
    let exp = _mm256_set1_epi32(0x7f80_0000);
    let mut bad = _mm256_setzero_si256();
    for c in x.chunks_exact(8) {
        // SAFETY: `c` holds 8 values.
        let v = unsafe { _mm256_castps_si256(_mm256_loadu_ps(c.as_ptr())) };
        bad = _mm256_or_si256(bad, _mm256_cmpeq_epi32(_mm256_and_si256(v, exp), exp));
    }
    _mm256_testz_si256(bad, bad) == 1
}

/// Loads 8 values at `x[i..i + 8]`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn load(x: &[f32], i: usize) -> __m256 {
    assert!(i + 8 <= x.len());
    // SAFETY: bounds asserted above.
    unsafe { _mm256_loadu_ps(x.as_ptr().add(i)) }
}

/// `roundf` per lane: half away from zero, exact (the fraction `v - trunc(v)` is exact).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn round_away(v: __m256) -> __m256 {
    let t = _mm256_round_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(v);
    let frac = _mm256_andnot_ps(_mm256_set1_ps(-0.0), _mm256_sub_ps(v, t));
    let away = _mm256_cmp_ps::<_CMP_GE_OQ>(frac, _mm256_set1_ps(0.5));
    let one = _mm256_or_ps(_mm256_and_ps(v, _mm256_set1_ps(-0.0)), _mm256_set1_ps(1.0));
    _mm256_add_ps(t, _mm256_and_ps(away, one))
}

/// Q8_0 of one block, as `quantize_blocks::q8_0`.
#[target_feature(enable = "avx2,fma,f16c")]
fn q8_0(x: &[f32], dst: &mut [u8]) {
    let abs = |v: __m256| _mm256_andnot_ps(_mm256_set1_ps(-0.0), v);
    let v = [load(x, 0), load(x, 8), load(x, 16), load(x, 24)];
    // finite values: the maximum is the same whatever the order of comparison
    let m = _mm256_max_ps(
        _mm256_max_ps(abs(v[0]), abs(v[1])),
        _mm256_max_ps(abs(v[2]), abs(v[3])),
    );
    let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
    let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    let amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    if !id.is_finite() {
        return blocks::q8_0(x, dst);
    }
    dst[..2].copy_from_slice(&ggml_f16(d).to_le_bytes());
    let idv = _mm256_set1_ps(id);
    let q = v.map(|v| _mm256_cvttps_epi32(round_away(_mm256_mul_ps(v, idv))));
    let w = _mm256_packs_epi16(
        _mm256_packs_epi32(q[0], q[1]),
        _mm256_packs_epi32(q[2], q[3]),
    );
    let w = _mm256_permutevar8x32_epi32(w, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    let out = &mut dst[2..34];
    // SAFETY: `out` is 32 bytes.
    unsafe { _mm256_storeu_si256(out.as_mut_ptr().cast(), w) };
}

/// ggml's `nearest_int` per lane.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn nearest(v: __m256) -> __m256i {
    let b = _mm256_castps_si256(_mm256_add_ps(v, _mm256_set1_ps(12_582_912.0)));
    _mm256_sub_epi32(
        _mm256_and_si256(b, _mm256_set1_epi32(0x007f_ffff)),
        _mm256_set1_epi32(0x0040_0000),
    )
}

/// `nearest(v)` clamped to `lo..=hi`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn nearest_clamped(v: __m256, lo: i32, hi: i32) -> __m256i {
    let l = _mm256_min_epi32(nearest(v), _mm256_set1_epi32(hi));
    _mm256_max_epi32(l, _mm256_set1_epi32(lo))
}

/// `if mask { b } else { a }` per lane.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn pick_ps(a: __m256, b: __m256, mask: __m256) -> __m256 {
    _mm256_blendv_ps(a, b, mask)
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn pick_epi32(a: __m256i, b: __m256i, mask: __m256) -> __m256i {
    _mm256_blendv_epi8(a, b, _mm256_castps_si256(mask))
}

/// Lane `j` of `out[i]` is `x[stride * j + i]`: sub-block `j` of eight into lane `j`.
#[target_feature(enable = "avx2,fma,f16c")]
fn transpose8(x: &[f32], stride: usize, out: &mut [__m256]) {
    let mut t = Aligned([0f32; 8]);
    for (i, o) in out.iter_mut().enumerate() {
        for j in 0..8 {
            t.0[j] = x[stride * j + i];
        }
        *o = load(&t.0, 0);
    }
}

/// Lanes of `v` as an array.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn lanes_i(v: __m256i) -> [i32; 8] {
    let mut a = [0i32; 8];
    // SAFETY: `a` holds 8 i32.
    unsafe { _mm256_storeu_si256(a.as_mut_ptr().cast(), v) };
    a
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn lanes_f(v: __m256) -> [f32; 8] {
    let mut a = [0f32; 8];
    // SAFETY: `a` holds 8 f32.
    unsafe { _mm256_storeu_ps(a.as_mut_ptr(), v) };
    a
}

/// Q4_K of one block: the eight `make_qkx2_quants` fits side by side, then the scalar finish.
#[target_feature(enable = "avx2,fma,f16c")]
fn q4_k(x: &[f32], dst: &mut [u8]) {
    let zero = _mm256_setzero_ps();
    let abs = |v: __m256| _mm256_andnot_ps(_mm256_set1_ps(-0.0), v);
    let mut xs = [zero; 32];
    transpose8(x, 32, &mut xs);
    // weights: sqrt(mean(x²)) + |x|
    let mut sum_x2 = zero;
    for v in &xs {
        sum_x2 = _mm256_add_ps(sum_x2, _mm256_mul_ps(*v, *v));
    }
    let av_x = _mm256_sqrt_ps(_mm256_div_ps(sum_x2, _mm256_set1_ps(32.0)));
    let w = xs.map(|v| _mm256_add_ps(av_x, abs(v)));

    let (mut min, mut max) = (xs[0], xs[0]);
    let mut sum_w = w[0];
    let mut sum_x = _mm256_mul_ps(sum_w, xs[0]);
    for i in 1..32 {
        min = _mm256_min_ps(xs[i], min); // x < min ? x : min
        max = _mm256_max_ps(xs[i], max); // x > max ? x : max
        sum_w = _mm256_add_ps(sum_w, w[i]);
        sum_x = _mm256_add_ps(sum_x, _mm256_mul_ps(w[i], xs[i]));
    }
    min = pick_ps(min, zero, _mm256_cmp_ps::<_CMP_GT_OQ>(min, zero));
    let flat = _mm256_cmp_ps::<_CMP_EQ_OQ>(max, min);
    let flat_min = min;
    let iscale = _mm256_div_ps(_mm256_set1_ps(15.0), _mm256_sub_ps(max, min));
    let mut scale = _mm256_div_ps(_mm256_set1_ps(1.0), iscale);
    let mut l = [_mm256_setzero_si256(); 32];
    let mut best_error = zero;
    for i in 0..32 {
        l[i] = nearest_clamped(_mm256_mul_ps(iscale, _mm256_sub_ps(xs[i], min)), 0, 15);
        let lf = _mm256_cvtepi32_ps(l[i]);
        let diff = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(scale, lf), min), xs[i]);
        best_error = _mm256_add_ps(best_error, _mm256_mul_ps(w[i], _mm256_mul_ps(diff, diff)));
    }
    let mut aux = [_mm256_setzero_si256(); 32];
    for step in 0..=20 {
        // ggml divides by `max - min` with the best fit's min so far, as the scalar form does
        let num = -1.0f32 + 0.1 * step as f32 + 15.0;
        let iscale = _mm256_div_ps(_mm256_set1_ps(num), _mm256_sub_ps(max, min));
        let (mut sum_l, mut sum_l2, mut sum_xl) = (zero, zero, zero);
        for i in 0..32 {
            aux[i] = nearest_clamped(_mm256_mul_ps(iscale, _mm256_sub_ps(xs[i], min)), 0, 15);
            let lf = _mm256_cvtepi32_ps(aux[i]);
            let wl = _mm256_mul_ps(w[i], lf);
            sum_l = _mm256_add_ps(sum_l, wl);
            sum_l2 = _mm256_add_ps(sum_l2, _mm256_mul_ps(wl, lf));
            sum_xl = _mm256_add_ps(sum_xl, _mm256_mul_ps(wl, xs[i]));
        }
        let det = _mm256_sub_ps(_mm256_mul_ps(sum_w, sum_l2), _mm256_mul_ps(sum_l, sum_l));
        let det_pos = _mm256_cmp_ps::<_CMP_GT_OQ>(det, zero);
        if _mm256_movemask_ps(det_pos) == 0 {
            continue;
        }
        let num_s = _mm256_sub_ps(_mm256_mul_ps(sum_w, sum_xl), _mm256_mul_ps(sum_x, sum_l));
        let num_m = _mm256_sub_ps(_mm256_mul_ps(sum_l2, sum_x), _mm256_mul_ps(sum_l, sum_xl));
        let mut this_scale = _mm256_div_ps(num_s, det);
        let mut this_min = _mm256_div_ps(num_m, det);
        let min_pos = _mm256_cmp_ps::<_CMP_GT_OQ>(this_min, zero);
        this_min = pick_ps(this_min, zero, min_pos);
        this_scale = pick_ps(this_scale, _mm256_div_ps(sum_xl, sum_l2), min_pos);
        let mut cur_error = zero;
        for i in 0..32 {
            let lf = _mm256_cvtepi32_ps(aux[i]);
            let diff = _mm256_sub_ps(
                _mm256_add_ps(_mm256_mul_ps(this_scale, lf), this_min),
                xs[i],
            );
            cur_error = _mm256_add_ps(cur_error, _mm256_mul_ps(w[i], _mm256_mul_ps(diff, diff)));
        }
        let better = _mm256_and_ps(det_pos, _mm256_cmp_ps::<_CMP_LT_OQ>(cur_error, best_error));
        if _mm256_movemask_ps(better) == 0 {
            continue;
        }
        for i in 0..32 {
            l[i] = pick_epi32(l[i], aux[i], better);
        }
        best_error = pick_ps(best_error, cur_error, better);
        scale = pick_ps(scale, this_scale, better);
        min = pick_ps(min, this_min, better);
    }
    // lanes whose sub-block is flat: scale 0, quants 0, the (clamped) minimum
    scale = pick_ps(scale, zero, flat);
    min = pick_ps(min, flat_min, flat);
    let scales = lanes_f(scale);
    let mins = lanes_f(_mm256_xor_ps(min, _mm256_set1_ps(-0.0)));
    let mut lq = [0u8; 256];
    for (i, v) in l.iter().enumerate() {
        let v = pick_epi32(*v, _mm256_setzero_si256(), flat);
        for (j, q) in lanes_i(v).into_iter().enumerate() {
            lq[32 * j + i] = q as u8;
        }
    }
    blocks::q4_k_finish(x, &scales, &mins, &mut lq, dst);
}

/// Eight `make_qx_quants` fits of Q6_K (sub-blocks `8h..8h + 8`) side by side: writes `q + 32`
/// into `l` and the scales into `scales`.
#[target_feature(enable = "avx2,fma,f16c")]
fn q6_k_fits(x: &[f32], h: usize, l: &mut [u8; 256], scales: &mut [f32; 16]) {
    let zero = _mm256_setzero_ps();
    let abs = |v: __m256| _mm256_andnot_ps(_mm256_set1_ps(-0.0), v);
    let mut xs = [zero; 16];
    transpose8(&x[128 * h..], 16, &mut xs);
    let (mut amax, mut max) = (zero, zero);
    for v in &xs {
        let gt = _mm256_cmp_ps::<_CMP_GT_OQ>(abs(*v), amax);
        amax = pick_ps(amax, abs(*v), gt);
        max = pick_ps(max, *v, gt);
    }
    let tiny = _mm256_cmp_ps::<_CMP_LT_OQ>(amax, _mm256_set1_ps(1e-15));
    let w = xs.map(|v| _mm256_mul_ps(v, v));
    let wx = core::array::from_fn::<__m256, 16, _>(|i| _mm256_mul_ps(w[i], xs[i]));
    let offset = _mm256_set1_epi32(32);

    let iscale = _mm256_div_ps(_mm256_set1_ps(-32.0), max);
    let mut lq = [_mm256_setzero_si256(); 16];
    let (mut sumlx, mut suml2) = (zero, zero);
    for i in 0..16 {
        let q = nearest_clamped(_mm256_mul_ps(iscale, xs[i]), -32, 31);
        lq[i] = _mm256_add_epi32(q, offset);
        let qf = _mm256_cvtepi32_ps(q);
        sumlx = _mm256_add_ps(sumlx, _mm256_mul_ps(wx[i], qf));
        suml2 = _mm256_add_ps(suml2, _mm256_mul_ps(_mm256_mul_ps(w[i], qf), qf));
    }
    // C's `suml2 ? sumlx/suml2 : 0`: NaN counts as true
    let nonzero = _mm256_cmp_ps::<_CMP_NEQ_UQ>(suml2, zero);
    let mut scale = pick_ps(zero, _mm256_div_ps(sumlx, suml2), nonzero);
    let mut best = _mm256_mul_ps(scale, sumlx);
    for is in (-9i32..=9).filter(|is| *is != 0) {
        let num = -(32.0f32 + 0.1 * is as f32);
        let iscale = _mm256_div_ps(_mm256_set1_ps(num), max);
        let mut q = [_mm256_setzero_si256(); 16];
        let (mut sumlx, mut suml2) = (zero, zero);
        for i in 0..16 {
            q[i] = nearest_clamped(_mm256_mul_ps(iscale, xs[i]), -32, 31);
            let qf = _mm256_cvtepi32_ps(q[i]);
            sumlx = _mm256_add_ps(sumlx, _mm256_mul_ps(wx[i], qf));
            suml2 = _mm256_add_ps(suml2, _mm256_mul_ps(_mm256_mul_ps(w[i], qf), qf));
        }
        let better = _mm256_and_ps(
            _mm256_cmp_ps::<_CMP_GT_OQ>(suml2, zero),
            _mm256_cmp_ps::<_CMP_GT_OQ>(_mm256_mul_ps(sumlx, sumlx), _mm256_mul_ps(best, suml2)),
        );
        if _mm256_movemask_ps(better) == 0 {
            continue;
        }
        for i in 0..16 {
            lq[i] = pick_epi32(lq[i], _mm256_add_epi32(q[i], offset), better);
        }
        scale = pick_ps(scale, _mm256_div_ps(sumlx, suml2), better);
        best = pick_ps(best, _mm256_mul_ps(scale, sumlx), better);
    }
    scale = pick_ps(scale, zero, tiny);
    scales[8 * h..8 * h + 8].copy_from_slice(&lanes_f(scale));
    for (i, v) in lq.iter().enumerate() {
        let v = pick_epi32(*v, _mm256_setzero_si256(), tiny);
        for (j, q) in lanes_i(v).into_iter().enumerate() {
            l[128 * h + 16 * j + i] = q as u8;
        }
    }
}

/// Q6_K of one block: sixteen `make_qx_quants` fits, eight at a time, then the scalar finish.
#[target_feature(enable = "avx2,fma,f16c")]
fn q6_k(x: &[f32], dst: &mut [u8]) {
    let mut l = [0u8; 256];
    let mut scales = [0f32; 16];
    q6_k_fits(x, 0, &mut l, &mut scales);
    q6_k_fits(x, 1, &mut l, &mut scales);
    blocks::q6_k_finish(x, &scales, &mut l, dst);
}
