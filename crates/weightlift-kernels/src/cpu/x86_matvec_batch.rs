//! The Q8-mode product of one weight row with a few tokens at once (`matvec::matmul` for small
//! token counts): each weight block is read and decoded once, then met with every token's
//! quantised activation block in registers, one accumulator per token. Per token the integer
//! lane sums are those of the single-token kernels (`x86_matvec`), and the float operations,
//! in their order, are the scalar path's (`matvec::row_dot_q8_scalar`, see
//! `matvec::finish_lanes`): `d · d_x` rounded per block (or `(d · sc) · d_x` for the K-quants,
//! `d · sc` being the same first product the single-token kernels round), one FMA per block and
//! lane, the offset term summed apart. So each token's result has the bits of `matvec` of that
//! token alone, on every instruction set and VNNI choice. Only the loop order differs: the
//! weight decode is hoisted out of the token loop.
// The std::arch intrinsics are unsafe to call: they need the CPU features that `Isa` checked at
// run time and raw pointers into slices whose bounds the callers check.

use std::arch::x86_64::*;

use super::dequant_scalar::scale_min_k4;
use super::matvec::{TokenScales, k16_d_at, k16_scale_bytes, q2k_mins};
use super::x86::imp::{
    load32, mul_sum_i8, nibbles32, q2k_group_at, q3k_group_at, q6k_group_at, quants5_i, quants5_u,
    quants5_u_avx512, rd_f16, rd_f16_pair, rd_u32, splat_f16,
};
use super::x86_matvec::{block, dm_f16, finish, with_fifth_bits};
use crate::types::QuantType;

/// `v`, through a barrier the optimiser cannot see past: the kernels store each block's
/// `d · d_x` for all tokens with one vector multiply and read each token's back as a broadcast
/// load (a load port, or the FMA's own broadcast operand), where LLVM would otherwise forward
/// the stored vector through one or two shuffles per token, on the ports the products need.
#[inline(always)]
fn opaque(v: &mut [f32; 16]) -> &mut [f32; 16] {
    std::hint::black_box(v)
}

/// The lanes of signed quants `q` times `x` (`pmaddubsw` with the sign trick + `pmaddwd`).
#[inline]
#[target_feature(enable = "avx2")]
fn dot_s_avx2(q: __m256i, x: __m256i, _bias: __m256i) -> __m256i {
    mul_sum_i8(q, x)
}

/// The lanes of unsigned quants `q` (at most 31) times `x`: `pmaddubsw` is exact for them.
#[inline]
#[target_feature(enable = "avx2")]
fn dot_u_avx2(q: __m256i, x: __m256i) -> __m256i {
    _mm256_madd_epi16(_mm256_maddubs_epi16(q, x), _mm256_set1_epi16(1))
}

/// The lanes of the quants made unsigned (`q + off`) times `x`, plus the token's lane offsets
/// `bias` (`−off · Σx`), by AVX-VNNI.
#[inline]
#[target_feature(enable = "avx2,avxvnni")]
fn dot_s_avxvnni(q: __m256i, x: __m256i, bias: __m256i) -> __m256i {
    _mm256_dpbusd_avx_epi32(bias, q, x)
}

/// The lanes of unsigned quants times `x` by AVX-VNNI.
#[inline]
#[target_feature(enable = "avx2,avxvnni")]
fn dot_u_avxvnni(q: __m256i, x: __m256i) -> __m256i {
    _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), q, x)
}

/// [`dot_s_avxvnni`] by AVX512-VNNI (EVEX).
#[inline]
#[target_feature(enable = "avx2,avx512f,avx512vl,avx512vnni")]
fn dot_s_avx512vnni(q: __m256i, x: __m256i, bias: __m256i) -> __m256i {
    _mm256_dpbusd_epi32(bias, q, x)
}

/// [`dot_u_avxvnni`] by AVX512-VNNI (EVEX).
#[inline]
#[target_feature(enable = "avx2,avx512f,avx512vl,avx512vnni")]
fn dot_u_avx512vnni(q: __m256i, x: __m256i) -> __m256i {
    _mm256_dpbusd_epi32(_mm256_setzero_si256(), q, x)
}

/// Each token's 8 lanes and offset term, finished as `matvec::finish_lanes` does, two tokens
/// per vector: `s_k = l_k + l_(k+4)`, then `(s_0 + s_2) + (s_1 + s_3)`, then the offset term.
#[inline]
#[target_feature(enable = "avx2")]
fn finish_tokens<const T: usize>(acc: [__m256; T], extra: &[f32; 16]) -> [f32; T] {
    let mut out = [0f32; T];
    for p in 0..T / 2 {
        let (a, b) = (acc[2 * p], acc[2 * p + 1]);
        // each 128-bit half a token's s_0..s_3
        let s = _mm256_add_ps(
            _mm256_permute2f128_ps::<0x20>(a, b),
            _mm256_permute2f128_ps::<0x31>(a, b),
        );
        let v = _mm256_add_ps(s, _mm256_permute_ps::<0b01_00_11_10>(s));
        let w = _mm256_add_ps(v, _mm256_permute_ps::<0b10_11_00_01>(v));
        out[2 * p] = _mm256_cvtss_f32(w) + extra[2 * p];
        out[2 * p + 1] = _mm_cvtss_f32(_mm256_extractf128_ps::<1>(w)) + extra[2 * p + 1];
    }
    if T % 2 == 1 {
        out[T - 1] = finish([acc[T - 1]], [extra[T - 1]])[0];
    }
    out
}

/// Generates one instruction set's kernel. `$signed`: the types with signed quants (Q4_0,
/// Q5_0, Q8_0, Q3_K, Q6_K) keep them signed for `$dot_s` (AVX2's sign trick) rather than offset to
/// unsigned with the token's lane offsets (VNNI; `bias` must then hold them, from
/// `matvec::vnni_offset`). `$q5u` builds Q5_1's unsigned quants (and Q5_0's under VNNI).
macro_rules! row_tokens_q8 {
    ($name:ident, $feat:literal, $signed:literal, $dot_s:ident, $dot_u:ident, $q5u:ident) => {
        /// The Q8-mode dots of one weight row with `T` tokens' quantised activations, each with
        /// the bits of the single-token kernels (see the module documentation). The tokens'
        /// blocks come interleaved, `xq[i · T + t]` the quants of token `t`'s block `i` (and
        /// `bias` alike, the lane offsets), and `scales[i]` their scales and quant sums.
        ///
        /// # Safety
        /// The CPU must support the enabled features; `row` holds whole blocks of `ty` for the
        /// `32 · scales.len()` values of each token, and unless the kernel keeps the quants
        /// signed `bias` holds as many lane offsets as `xq` has blocks for the types with a
        /// VNNI quant offset (Q4_0, Q5_0, Q8_0, Q3_K, Q6_K). At most 16 tokens.
        #[target_feature(enable = $feat)]
        pub(crate) unsafe fn $name<const T: usize>(
            ty: QuantType,
            row: &[u8],
            xq: &[[i8; 32]],
            bias: &[[i32; 8]],
            scales: &[TokenScales],
        ) -> [f32; T] {
            let nb = scales.len();
            let bb = ty.block_bytes();
            assert!(
                nb * 32 % ty.block_size() == 0
                    && row.len() == nb * 32 / ty.block_size() * bb
                    && T <= 16
                    && scales.len() == nb
                    && xq.len() == nb * T
                    && ($signed
                        || matches!(
                            ty,
                            QuantType::Q4_1
                                | QuantType::Q5_1
                                | QuantType::Q2_K
                                | QuantType::Q4_K
                                | QuantType::Q5_K
                        )
                        || bias.len() == nb * T),
                "row_tokens_q8: shapes"
            );
            let mut acc = [_mm256_setzero_ps(); T];
            // the offset terms, token t in lane t % 8 of half t / 8
            let mut ext = [_mm256_setzero_ps(); 2];
            // the halves of 16 lanes that hold tokens
            let halves = T.div_ceil(8);
            // per block, each token's `d · d_x` (lane t), read back one token at a time
            let mut dd = [0f32; 16];
            // block i's token scales (checked above: nb of them)
            let tab = |i: usize| -> &TokenScales {
                // SAFETY: i < nb.
                unsafe { scales.get_unchecked(i) }
            };
            // `f(s, h)` for each half `h` holding tokens, `s` the half's 8 lanes of `v`
            macro_rules! lanes_of {
                ($v:expr, $h:ident) => {
                    // SAFETY: a half of 16 f32 holds 8.
                    unsafe { _mm256_loadu_ps($v.as_ptr().add(8 * $h)) }
                };
            }
            // token t's lane offsets for block i (zero where the quants stay signed)
            let bias_at = |t: usize, i: usize| -> __m256i {
                if $signed {
                    _mm256_setzero_si256()
                } else {
                    // SAFETY: checked above: bias holds nb · T rows of 8 i32.
                    unsafe { _mm256_loadu_si256(bias.get_unchecked(i * T + t).as_ptr().cast()) }
                }
            };
            // token t's activation block i (checked above: every token has nb)
            let xv = |t: usize, i: usize| -> __m256i {
                // SAFETY: i < nb and t < T (checked above: nb · T blocks of 32 quants).
                load32(unsafe { xq.get_unchecked(i * T + t) }.as_ptr().cast())
            };
            // The types without a weight offset: per block `fma(d · d_x, lanes, acc)`.
            macro_rules! plain {
                (|$blk:ident| $quants:expr) => {
                    for i in 0..nb {
                        // SAFETY: the row holds nb blocks of 32 values.
                        let $blk = unsafe { block(row, i, bb) };
                        let q = $quants;
                        let d = splat_f16($blk, 0);
                        for h in 0..halves {
                            let v = _mm256_mul_ps(d, lanes_of!(tab(i).d, h));
                            // SAFETY: dd holds 16 f32.
                            unsafe { _mm256_storeu_ps(dd.as_mut_ptr().add(8 * h), v) };
                        }
                        let dd = opaque(&mut dd);
                        for (t, a) in acc.iter_mut().enumerate() {
                            let l = $dot_s(q, xv(t, i), bias_at(t, i));
                            let d = _mm256_broadcast_ss(&dd[t]);
                            *a = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(l), *a);
                        }
                    }
                };
            }
            // Q4_1 and Q5_1: unsigned quants; `(m · d_x) · Σq_x` summed apart.
            macro_rules! offset {
                (|$blk:ident| $quants:expr) => {
                    for i in 0..nb {
                        // SAFETY: the row holds nb blocks of 32 values.
                        let $blk = unsafe { block(row, i, bb) };
                        let q = $quants;
                        let (d, m) = dm_f16($blk);
                        let m = _mm256_set1_ps(m);
                        for (h, e) in ext.iter_mut().enumerate().take(halves) {
                            let (xd, xs) = (lanes_of!(tab(i).d, h), lanes_of!(tab(i).s, h));
                            // SAFETY: dd holds 16 f32.
                            unsafe {
                                _mm256_storeu_ps(dd.as_mut_ptr().add(8 * h), _mm256_mul_ps(d, xd))
                            };
                            *e = _mm256_add_ps(*e, _mm256_mul_ps(_mm256_mul_ps(m, xd), xs));
                        }
                        let dd = opaque(&mut dd);
                        for (t, a) in acc.iter_mut().enumerate() {
                            let l = $dot_u(q, xv(t, i));
                            let d = _mm256_broadcast_ss(&dd[t]);
                            *a = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(l), *a);
                        }
                    }
                };
            }
            // Q3_K and Q6_K: scales per 16 values, two a group; `$group` gives a group's
            // quants plus `$off`, which the signed kernels take off again
            macro_rules! k16 {
                ($group:ident, $off:literal) => {{
                    let koff = _mm256_set1_epi8($off);
                    for i in 0..nb / 8 {
                        // SAFETY: the row holds nb / 8 blocks of 256 values.
                        let blk = unsafe { block(row, i, bb) };
                        let d = rd_f16(blk, k16_d_at(ty));
                        let scales = k16_scale_bytes(ty, blk);
                        let sc = |j: usize| scales[j];
                        for h in 0..2 {
                            for g in 0..4 {
                                let q = $group(blk, h, g);
                                let q = if $signed { _mm256_sub_epi8(q, koff) } else { q };
                                let gi = 4 * h + g;
                                // the first products of `d · sc · d_x`, one per 16 values
                                let s0 = d * f32::from(sc(2 * gi));
                                let s1 = d * f32::from(sc(2 * gi + 1));
                                let ds = _mm256_setr_ps(s0, s0, s0, s0, s1, s1, s1, s1);
                                let xd = &tab(8 * i + gi).d;
                                for (t, a) in acc.iter_mut().enumerate() {
                                    let l = $dot_s(q, xv(t, 8 * i + gi), bias_at(t, 8 * i + gi));
                                    let dd = _mm256_mul_ps(ds, _mm256_set1_ps(xd[t]));
                                    *a = _mm256_fmadd_ps(dd, _mm256_cvtepi32_ps(l), *a);
                                }
                            }
                        }
                    }
                }};
            }
            match ty {
                QuantType::Q4_0 => {
                    plain!(|blk| nibbles32(blk[2..18].as_ptr(), if $signed { 8 } else { 0 }))
                }
                QuantType::Q5_0 => plain!(|blk| if $signed {
                    quants5_i(rd_u32(blk, 2), blk[6..22].as_ptr())
                } else {
                    $q5u(rd_u32(blk, 2), blk[6..22].as_ptr())
                }),
                QuantType::Q8_0 => plain!(|blk| {
                    let v = load32(blk[2..34].as_ptr());
                    if $signed {
                        v
                    } else {
                        _mm256_xor_si256(v, _mm256_set1_epi8(-128))
                    }
                }),
                QuantType::Q4_1 => offset!(|blk| nibbles32(blk[4..20].as_ptr(), 0)),
                QuantType::Q5_1 => offset!(|blk| $q5u(rd_u32(blk, 4), blk[8..24].as_ptr())),
                QuantType::Q4_K | QuantType::Q5_K => {
                    let m4 = _mm256_set1_epi8(0x0f);
                    // Q5_K: the nibbles after the 32 fifth-bit bytes
                    let k5 = ty == QuantType::Q5_K;
                    let qs_at = if k5 { 48 } else { 16 };
                    for i in 0..nb / 8 {
                        // SAFETY: the row holds nb / 8 blocks of 256 values.
                        let blk = unsafe { block(row, i, bb) };
                        let (d, dmin) = rd_f16_pair(blk, 0);
                        let scales = &blk[4..16];
                        let qh = if k5 {
                            load32(blk[16..48].as_ptr())
                        } else {
                            _mm256_setzero_si256()
                        };
                        for c in 0..4 {
                            let v = load32(blk[qs_at + 32 * c..qs_at + 32 + 32 * c].as_ptr());
                            let nib = [
                                _mm256_and_si256(v, m4),
                                _mm256_and_si256(_mm256_srli_epi16::<4>(v), m4),
                            ];
                            for (h, q) in nib.into_iter().enumerate() {
                                let sb = 2 * c + h;
                                let q = if k5 { with_fifth_bits(q, qh, sb) } else { q };
                                let (sc, m) = scale_min_k4(sb, scales);
                                // the first products of `d · sc · d_x` and `dmin · m · d_x`
                                let (ds, dm) = (d * sc as f32, dmin * m as f32);
                                let (ds, dm) = (_mm256_set1_ps(ds), _mm256_set1_ps(dm));
                                let ts = tab(8 * i + sb);
                                for (h, e) in ext.iter_mut().enumerate().take(halves) {
                                    let (xd, xs) = (lanes_of!(ts.d, h), lanes_of!(ts.s, h));
                                    let v = _mm256_mul_ps(ds, xd);
                                    // SAFETY: dd holds 16 f32.
                                    unsafe { _mm256_storeu_ps(dd.as_mut_ptr().add(8 * h), v) };
                                    *e =
                                        _mm256_sub_ps(*e, _mm256_mul_ps(_mm256_mul_ps(dm, xd), xs));
                                }
                                let dd = opaque(&mut dd);
                                for (t, a) in acc.iter_mut().enumerate() {
                                    let l = $dot_u(q, xv(t, 8 * i + sb));
                                    let d = _mm256_broadcast_ss(&dd[t]);
                                    *a = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(l), *a);
                                }
                            }
                        }
                    }
                }
                // Q2_K: Q3_K's loop with unsigned quants and a min per 16 values, each token's
                // `(dmin · d_x) · (m_lo · Σq_lo + m_hi · Σq_hi)` (the integer exact in f32)
                // taken off its min sum of the group's lane by one fused multiply-add (tokens
                // in lanes here: a vector a group), the lanes added by `lane_tree`'s tree
                QuantType::Q2_K => {
                    let mut mins_acc = [[_mm256_setzero_ps(); 2]; 8];
                    for i in 0..nb / 8 {
                        // SAFETY: the row holds nb / 8 blocks of 256 values.
                        let blk = unsafe { block(row, i, bb) };
                        let d = rd_f16(blk, k16_d_at(ty));
                        let scales = k16_scale_bytes(ty, blk);
                        let (dmin, m) = q2k_mins(ty, blk);
                        let dmin = _mm256_set1_ps(dmin);
                        for h in 0..2 {
                            for g in 0..4 {
                                let q = q2k_group_at(blk, h, g);
                                let gi = 4 * h + g;
                                let s0 = d * f32::from(scales[2 * gi]);
                                let s1 = d * f32::from(scales[2 * gi + 1]);
                                let ds = _mm256_setr_ps(s0, s0, s0, s0, s1, s1, s1, s1);
                                let m0 = _mm256_set1_ps(f32::from(m[2 * gi]));
                                let m1 = _mm256_set1_ps(f32::from(m[2 * gi + 1]));
                                let ts = tab(8 * i + gi);
                                for (half, e) in mins_acc[gi].iter_mut().enumerate().take(halves) {
                                    let xd = lanes_of!(ts.d, half);
                                    let xs = lanes_of!(ts.s, half);
                                    let xl = lanes_of!(ts.lo, half);
                                    let mins = _mm256_fmadd_ps(
                                        m1,
                                        _mm256_sub_ps(xs, xl),
                                        _mm256_mul_ps(m0, xl),
                                    );
                                    *e = _mm256_fnmadd_ps(_mm256_mul_ps(dmin, xd), mins, *e);
                                }
                                for (t, a) in acc.iter_mut().enumerate() {
                                    let l = $dot_u(q, xv(t, 8 * i + gi));
                                    let dd = _mm256_mul_ps(ds, _mm256_set1_ps(ts.d[t]));
                                    *a = _mm256_fmadd_ps(dd, _mm256_cvtepi32_ps(l), *a);
                                }
                            }
                        }
                    }
                    for (h, e) in ext.iter_mut().enumerate().take(halves) {
                        let m = |g: usize| mins_acc[g][h];
                        let s: [__m256; 4] = std::array::from_fn(|k| _mm256_add_ps(m(k), m(k + 4)));
                        *e = _mm256_add_ps(_mm256_add_ps(s[0], s[2]), _mm256_add_ps(s[1], s[3]));
                    }
                }
                QuantType::Q3_K => k16!(q3k_group_at, 4),
                QuantType::Q6_K => k16!(q6k_group_at, 32),
                _ => {}
            }
            let mut extra = [0f32; 16];
            for (h, e) in ext.iter().enumerate().take(halves) {
                // SAFETY: extra holds 16 f32.
                unsafe { _mm256_storeu_ps(extra.as_mut_ptr().add(8 * h), *e) };
            }
            finish_tokens(acc, &extra)
        }
    };
}

row_tokens_q8!(
    row_tokens_q8_avx2,
    "avx2,fma,f16c",
    true,
    dot_s_avx2,
    dot_u_avx2,
    quants5_u
);
row_tokens_q8!(
    row_tokens_q8_avxvnni,
    "avx2,fma,f16c,avxvnni",
    false,
    dot_s_avxvnni,
    dot_u_avxvnni,
    quants5_u
);
// AVX512-VNNI is used only at Isa::Avx512, which also detected AVX-512BW; with AVX-512VL the
// kernel has 32 vector registers, room for 16 tokens' accumulators.
row_tokens_q8!(
    row_tokens_q8_avx512vnni,
    "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni",
    false,
    dot_s_avx512vnni,
    dot_u_avx512vnni,
    quants5_u_avx512
);
