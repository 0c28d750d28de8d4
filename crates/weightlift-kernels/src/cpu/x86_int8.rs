//! AVX2 / AVX-512 forms of the LLM.int8 kernels: the i8 × i8 dot products (exact in i32, so
//! every form gives the same sums as the scalar loop) and the row quantiser.
//!
//! `vpdpbusd` multiplies unsigned by signed bytes, so the VNNI forms read the activations
//! biased by +128 (`q ^ 0x80`) and subtract `128 · Σ w` per weight row; the sums are taken
//! modulo 2³², which gives the exact result because the true one fits in i32
//! (`cols ≤ INT8_MAX_COLS`). Without VNNI, AVX2 moves the weight's sign onto the activation
//! (`pmaddubsw(|w|, sign(x, w))`, pairs at most 2·128·127 < 2¹⁵, no saturation) and AVX-512
//! widens both to i16 for `vpmaddwd`.
// std::arch loads take raw pointers; each says which bound makes it sound.

use std::arch::x86_64::*;

use super::{Isa, Vnni};

/// A dot-product form.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// `pmaddubsw` + `pmaddwd` on 256 bits.
    Avx2,
    /// AVX-VNNI `vpdpbusd` on 256 bits, biased activations.
    AvxVnni,
    /// `vpmovsxbw` + `vpmaddwd` on 512 bits.
    Avx512,
    /// AVX512-VNNI `vpdpbusd` on 512 bits, biased activations.
    Avx512Vnni,
}

impl Kind {
    /// The form for `isa` on this CPU (honouring `WEIGHTLIFT_CPU_VNNI`).
    pub(crate) fn pick(isa: Isa) -> Option<Kind> {
        match (isa.has_avx512(), isa.has_avx2(), isa.vnni()) {
            (true, _, Some(Vnni::Avx512Vnni)) => Some(Kind::Avx512Vnni),
            (true, _, _) => Some(Kind::Avx512),
            (false, true, Some(Vnni::AvxVnni)) => Some(Kind::AvxVnni),
            (false, true, _) => Some(Kind::Avx2),
            _ => None,
        }
    }

    /// Whether this form reads activations biased by +128.
    pub(crate) fn biased(self) -> bool {
        matches!(self, Kind::AvxVnni | Kind::Avx512Vnni)
    }

    /// Weight rows per register tile (16 accumulators fit AVX-512's 32 registers, 8 AVX2's 16).
    fn tile_rows(self) -> usize {
        match self {
            Kind::Avx2 | Kind::AvxVnni => 2,
            Kind::Avx512 | Kind::Avx512Vnni => 4,
        }
    }

    /// `acc[r * n_tok + t] = Σ_i w[r, i] · x_t[i]` for the `rows` weight rows of `w`
    /// (`rows × cols`) and the `n_tok = acc.len() / rows` token rows of `xq` (`n_tok × cols`
    /// bytes in this form's layout).
    pub(crate) fn dots(self, w: &[i8], rows: usize, xq: &[u8], acc: &mut [i32]) {
        assert!(
            rows > 0 && w.len().is_multiple_of(rows),
            "int8 dots: weight rows"
        );
        let cols = w.len() / rows;
        let nt = acc.len() / rows;
        assert!(
            acc.len() == rows * nt && xq.len() == nt * cols,
            "int8 dots: lengths"
        );
        let tile = self.tile_rows();
        let mut r = 0;
        while r < rows {
            let n = if r + tile <= rows { tile } else { 1 };
            let (w, a) = (&w[r * cols..(r + n) * cols], &mut acc[r * nt..(r + n) * nt]);
            // SAFETY: `pick` chose this form only where its features were detected at run
            // time (the unit tests' `all_on_this_cpu` likewise); lengths are asserted above.
            unsafe {
                match (self, n) {
                    (Kind::Avx2, 2) => dots_avx2::<2>(w, xq, a),
                    (Kind::Avx2, _) => dots_avx2::<1>(w, xq, a),
                    (Kind::AvxVnni, 2) => dots_avxvnni::<2>(w, xq, a),
                    (Kind::AvxVnni, _) => dots_avxvnni::<1>(w, xq, a),
                    (Kind::Avx512, 4) => dots_avx512::<4>(w, xq, a),
                    (Kind::Avx512, _) => dots_avx512::<1>(w, xq, a),
                    (Kind::Avx512Vnni, 4) => dots_avx512vnni::<4>(w, xq, a),
                    (Kind::Avx512Vnni, _) => dots_avx512vnni::<1>(w, xq, a),
                }
            }
            r += n;
        }
    }

    /// Every form this CPU runs (the unit tests compare each with the scalar loop).
    #[cfg(test)]
    fn all_on_this_cpu() -> Vec<Kind> {
        let f = |s: &str| std::arch::is_x86_feature_detected!("avx2") && feature(s);
        fn feature(s: &str) -> bool {
            match s {
                "avxvnni" => std::arch::is_x86_feature_detected!("avxvnni"),
                "avx512" => Isa::best_supported() >= Isa::Avx512,
                "avx512vnni" => {
                    Isa::best_supported() >= Isa::Avx512
                        && std::arch::is_x86_feature_detected!("avx512vnni")
                }
                _ => true,
            }
        }
        [
            (Kind::Avx2, "avx2"),
            (Kind::AvxVnni, "avxvnni"),
            (Kind::Avx512, "avx512"),
            (Kind::Avx512Vnni, "avx512vnni"),
        ]
        .into_iter()
        .filter(|(_, s)| f(s))
        .map(|(k, _)| k)
        .collect()
    }
}

/// The scalar tail `Σ w[i] · x[i]` over `from..`, reading `x` biased or not.
#[inline]
fn tail(w: &[i8], x: &[u8], from: usize, biased: bool) -> i32 {
    let bias = if biased { 0x80 } else { 0 };
    (from..w.len()).fold(0i32, |s, i| {
        s.wrapping_add(i32::from(w[i]) * i32::from((x[i] ^ bias) as i8))
    })
}

/// A tiled dot-product form: `R` weight rows × 4 tokens of accumulators (then × 1 for the
/// last tokens), each weight vector loaded once per 4 tokens and each activation vector once
/// per `R` rows. `$load` reads one step of bytes, `$step` adds the products of a weight and an
/// activation vector to an accumulator, `$hsum` sums an accumulator's i32 lanes (wrapping), and
/// `$wsum` (biased forms) adds a weight vector's bytes.
macro_rules! tile_kernel {
    ($name:ident, $feat:literal, $v:ty, $vw:literal, $biased:literal, $zero:path, $load:path,
     $step:path, $hsum:path, $wsum:path) => {
        #[target_feature(enable = $feat)]
        fn $name<const R: usize>(w: &[i8], xq: &[u8], acc: &mut [i32]) {
            #[inline]
            #[target_feature(enable = $feat)]
            fn tile<const R: usize, const G: usize>(
                wr: &[&[i8]; R],
                xr: &[&[u8]; G],
                main: usize,
            ) -> [[$v; G]; R] {
                let mut a = [[$zero(); G]; R];
                for c in (0..main).step_by($vw) {
                    // SAFETY: c + $vw <= main <= cols bytes in every weight and token row.
                    let xv: [$v; G] =
                        core::array::from_fn(|k| unsafe { $load(xr[k].as_ptr().add(c)) });
                    for r in 0..R {
                        // SAFETY: as above.
                        let wv = unsafe { $load(wr[r].as_ptr().add(c).cast()) };
                        for k in 0..G {
                            a[r][k] = $step(a[r][k], wv, xv[k]);
                        }
                    }
                }
                a
            }

            let cols = w.len() / R;
            let nt = acc.len() / R;
            let main = cols / $vw * $vw;
            let wr: [&[i8]; R] = core::array::from_fn(|r| &w[r * cols..(r + 1) * cols]);
            let mut bias = [0i32; R];
            if $biased {
                for (b, w) in bias.iter_mut().zip(&wr) {
                    let mut s = $zero();
                    for c in (0..main).step_by($vw) {
                        // SAFETY: c + $vw <= main <= cols.
                        s = $wsum(s, unsafe { $load(w.as_ptr().add(c).cast()) });
                    }
                    *b = $hsum(s).wrapping_mul(128);
                }
            }
            let mut t = 0;
            while t < nt {
                let row = |k: usize| &xq[(t + k) * cols..(t + k + 1) * cols];
                if t + 4 <= nt {
                    let xr: [&[u8]; 4] = core::array::from_fn(row);
                    let a = tile::<R, 4>(&wr, &xr, main);
                    for r in 0..R {
                        for k in 0..4 {
                            acc[r * nt + t + k] = $hsum(a[r][k])
                                .wrapping_sub(bias[r])
                                .wrapping_add(tail(wr[r], xr[k], main, $biased));
                        }
                    }
                    t += 4;
                } else {
                    let xr = [row(0)];
                    let a = tile::<R, 1>(&wr, &xr, main);
                    for r in 0..R {
                        acc[r * nt + t] = $hsum(a[r][0])
                            .wrapping_sub(bias[r])
                            .wrapping_add(tail(wr[r], xr[0], main, $biased));
                    }
                    t += 1;
                }
            }
        }
    };
}

#[inline]
#[target_feature(enable = "avx2")]
fn hsum256(v: __m256i) -> i32 {
    let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b01_00_11_10>(s));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b10_11_00_01>(s));
    _mm_cvtsi128_si32(s)
}

#[inline]
#[target_feature(enable = "avx512f")]
fn hsum512(v: __m512i) -> i32 {
    _mm512_reduce_add_epi32(v)
}

#[inline]
#[target_feature(enable = "avx2")]
fn zero256() -> __m256i {
    _mm256_setzero_si256()
}

#[inline]
#[target_feature(enable = "avx512f")]
fn zero512() -> __m512i {
    _mm512_setzero_si512()
}

/// # Safety
/// AVX2; 32 readable bytes at `p`.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn load256(p: *const u8) -> __m256i {
    // SAFETY: the caller's bound.
    unsafe { _mm256_loadu_si256(p.cast()) }
}

/// # Safety
/// AVX-512F; 64 readable bytes at `p`.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn load512(p: *const u8) -> __m512i {
    // SAFETY: the caller's bound.
    unsafe { _mm512_loadu_si512(p.cast()) }
}

/// # Safety
/// AVX-512BW; 32 readable bytes at `p`, widened to i16.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx2")]
unsafe fn load_widen512(p: *const u8) -> __m512i {
    // SAFETY: the caller's bound.
    _mm512_cvtepi8_epi16(unsafe { _mm256_loadu_si256(p.cast()) })
}

/// `a + Σ w·x` by `pmaddubsw(|w|, sign(x, w))` then `pmaddwd` by ones (pairs at most
/// 2·128·127 < 2¹⁵: no saturation).
#[inline]
#[target_feature(enable = "avx2")]
fn step_avx2(a: __m256i, w: __m256i, x: __m256i) -> __m256i {
    let p = _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(x, w));
    _mm256_add_epi32(a, _mm256_madd_epi16(p, _mm256_set1_epi16(1)))
}

/// `a + Σ (x + 128)·w`: activations biased to unsigned.
#[inline]
#[target_feature(enable = "avx2,avxvnni")]
fn step_avxvnni(a: __m256i, w: __m256i, x: __m256i) -> __m256i {
    _mm256_dpbusd_avx_epi32(a, x, w)
}

#[inline]
#[target_feature(enable = "avx2,avxvnni")]
fn wsum_avxvnni(a: __m256i, w: __m256i) -> __m256i {
    _mm256_dpbusd_avx_epi32(a, _mm256_set1_epi8(1), w)
}

/// `a + Σ w·x` on i16-widened bytes.
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
fn step_avx512(a: __m512i, w: __m512i, x: __m512i) -> __m512i {
    _mm512_add_epi32(a, _mm512_madd_epi16(w, x))
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
fn step_avx512vnni(a: __m512i, w: __m512i, x: __m512i) -> __m512i {
    _mm512_dpbusd_epi32(a, x, w)
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
fn wsum_avx512vnni(a: __m512i, w: __m512i) -> __m512i {
    _mm512_dpbusd_epi32(a, _mm512_set1_epi8(1), w)
}

/// Unused by the unbiased forms.
#[inline]
fn no_wsum<V>(a: V, _: V) -> V {
    a
}

tile_kernel!(
    dots_avx2, "avx2", __m256i, 32, false, zero256, load256, step_avx2, hsum256, no_wsum
);
tile_kernel!(
    dots_avxvnni,
    "avx2,avxvnni",
    __m256i,
    32,
    true,
    zero256,
    load256,
    step_avxvnni,
    hsum256,
    wsum_avxvnni
);
tile_kernel!(
    dots_avx512,
    "avx512f,avx512bw,avx2",
    __m512i,
    32,
    false,
    zero512,
    load_widen512,
    step_avx512,
    hsum512,
    no_wsum
);
tile_kernel!(
    dots_avx512vnni,
    "avx512f,avx512bw,avx512vnni,avx2",
    __m512i,
    64,
    true,
    zero512,
    load512,
    step_avx512vnni,
    hsum512,
    wsum_avx512vnni
);

/// `q[i] = round_half_even(x[i] · s)` saturated to i8, NaN to 0: Rust's `as i8` on the scalar
/// path, lane for lane.
///
/// # Safety
/// Needs AVX2 (checked by the caller at run time); `q.len() == x.len()`.
#[target_feature(enable = "avx2")]
pub(crate) unsafe fn scale_round_avx2(x: &[f32], s: f32, q: &mut [i8]) {
    assert_eq!(x.len(), q.len(), "int8 quantise: lengths");
    let n = x.len();
    let sv = _mm256_set1_ps(s);
    let (lo, hi) = (_mm256_set1_ps(-128.0), _mm256_set1_ps(127.0));
    let conv = |v: __m256| {
        let r = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm256_mul_ps(v, sv),
        );
        let r = _mm256_and_ps(r, _mm256_cmp_ps::<_CMP_ORD_Q>(r, r)); // NaN to 0
        _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(r, lo), hi))
    };
    let mut i = 0;
    while i + 32 <= n {
        // SAFETY: i + 32 <= n on both sides.
        unsafe {
            let p = x.as_ptr().add(i);
            let v = [0, 8, 16, 24].map(|k| conv(_mm256_loadu_ps(p.add(k))));
            let b = _mm256_packs_epi16(
                _mm256_packs_epi32(v[0], v[1]),
                _mm256_packs_epi32(v[2], v[3]),
            );
            let b = _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            _mm256_storeu_si256(q.as_mut_ptr().add(i).cast(), b);
        }
        i += 32;
    }
    for j in i..n {
        q[j] = (x[j] * s).round_ties_even() as i8;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rng(seed: &mut u64) -> u64 {
        *seed ^= *seed << 13;
        *seed ^= *seed >> 7;
        *seed ^= *seed << 17;
        *seed
    }

    #[test]
    fn every_dot_form_on_this_cpu_equals_the_scalar_sums() {
        let mut s = 0x1234_5678_9abc_def0u64;
        let kinds = Kind::all_on_this_cpu();
        eprintln!("int8 dot forms on this cpu: {kinds:?}");
        for cols in [1usize, 31, 32, 63, 64, 65, 200, 1024, 4100] {
            for (rows, nt) in [(1usize, 1usize), (3, 4), (4, 5), (5, 3), (9, 9), (2, 8)] {
                let mut w: Vec<i8> = (0..rows * cols)
                    .map(|_| (rng(&mut s) % 255) as i32 as i8)
                    .collect();
                w[0] = -127; // the extremes
                let x: Vec<i8> = (0..nt * cols)
                    .map(|i| {
                        if i % 7 == 0 {
                            127
                        } else {
                            ((rng(&mut s) % 255) as i32 - 127) as i8
                        }
                    })
                    .collect();
                let mut want = vec![0i32; rows * nt];
                for r in 0..rows {
                    for t in 0..nt {
                        want[r * nt + t] = (0..cols)
                            .map(|i| i32::from(w[r * cols + i]) * i32::from(x[t * cols + i]))
                            .sum();
                    }
                }
                for k in &kinds {
                    let xq: Vec<u8> = x
                        .iter()
                        .map(|v| {
                            if k.biased() {
                                (*v as u8) ^ 0x80
                            } else {
                                *v as u8
                            }
                        })
                        .collect();
                    let mut got = vec![0i32; rows * nt];
                    k.dots(&w, rows, &xq, &mut got);
                    assert_eq!(got, want, "{k:?} {rows} rows × {cols} cols, {nt} tokens");
                }
            }
        }
    }

    #[test]
    fn the_avx2_row_quantiser_equals_the_scalar_conversion() {
        if Isa::best_supported() < Isa::Avx2 {
            return;
        }
        let mut s = 99u64;
        let mut x: Vec<f32> = (0..1000)
            .map(|_| (rng(&mut s) >> 40) as f32 / 65536.0 - 128.0)
            .collect();
        x[3] = f32::NAN;
        x[4] = 1e30;
        x[5] = -1e30;
        x[6] = 0.5;
        x[7] = 1.5;
        x[8] = -2.5;
        for scale in [1.0f32, 0.37, 127.0 / 128.0] {
            let mut a = vec![0i8; x.len()];
            // SAFETY: AVX2 checked above; equal lengths.
            unsafe { scale_round_avx2(&x, scale, &mut a) };
            let b: Vec<i8> = x
                .iter()
                .map(|v| (v * scale).round_ties_even() as i8)
                .collect();
            assert_eq!(a, b, "scale {scale}");
        }
    }
}
