//! AVX2 + FMA + F16C kernels (and AVX-512 where it pays), selected at run time by [`Isa`].
//!
//! Every function here has a scalar twin in the parent module; tests run both.
// The std::arch intrinsics are unsafe to call: they need the CPU features that `Isa::detect`
// checked at run time and raw pointers into slices whose bounds each function checks first.

#[cfg(target_arch = "x86_64")]
pub(crate) mod imp {
    use crate::cpu::dequant_scalar::{IQ4NL_VALUES, scale_min_k4};
    use crate::types::QuantType;
    use std::arch::x86_64::*;

    /// The little-endian f16 at `off` of `b` as f32, through F16C (exact, like the scalar twin).
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    pub fn rd_f16(b: &[u8], off: usize) -> f32 {
        let h = u16::from_le_bytes([b[off], b[off + 1]]);
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(h))))
    }

    /// Whether [`dequant_avx2`] has a vector path for `ty`.
    pub fn dequant_has_avx2(ty: QuantType) -> bool {
        matches!(
            ty,
            QuantType::F16
                | QuantType::BF16
                | QuantType::Q4_0
                | QuantType::Q4_1
                | QuantType::Q8_0
                | QuantType::Q4_K
                | QuantType::Q5_K
                | QuantType::Q5_0
                | QuantType::Q5_1
                | QuantType::Q6_K
                | QuantType::IQ4_NL
        )
    }

    /// The 32 fifth bits of a Q5_0/Q5_1 block (u32 `qh`, bit i for value i) as bytes 0 or 16.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn q5_high_bits(qh: u32) -> __m256i {
        // byte i takes byte i/8 of qh, then tests bit i%8
        let v = _mm256_set1_epi32(qh as i32);
        let spread = _mm256_shuffle_epi8(
            v,
            _mm256_setr_epi8(
                0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3,
                3, 3, 3, 3,
            ),
        );
        let bits = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
        let set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bits), bits);
        _mm256_and_si256(set, _mm256_set1_epi8(16))
    }

    /// Four f32 vectors from the 32 unsigned bytes of `v`.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn u8x32_to_f32(v: __m256i) -> [__m256; 4] {
        let lo = _mm256_castsi256_si128(v);
        let hi = _mm256_extracti128_si256::<1>(v);
        [
            _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)),
            _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128::<8>(lo))),
            _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)),
            _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128::<8>(hi))),
        ]
    }

    /// Four f32 vectors from the 32 signed bytes of `v`.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn i8x32_to_f32(v: __m256i) -> [__m256; 4] {
        let lo = _mm256_castsi256_si128(v);
        let hi = _mm256_extracti128_si256::<1>(v);
        [
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo)),
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128::<8>(lo))),
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi)),
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128::<8>(hi))),
        ]
    }

    /// Nibbles of 16 bytes: (low nibbles, high nibbles) as 16-byte vectors.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn nibbles16(p: *const u8) -> (__m128i, __m128i) {
        // SAFETY: callers pass a pointer to at least 16 readable bytes.
        let v = unsafe { _mm_loadu_si128(p.cast()) };
        let m = _mm_set1_epi8(0x0f);
        (
            _mm_and_si128(v, m),
            _mm_and_si128(_mm_srli_epi16::<4>(v), m),
        )
    }

    /// Stores 8 floats: plain unaligned, or as two non-temporal 16-byte stores.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn st<const NT: bool>(p: *mut f32, v: __m256) {
        // SAFETY: callers pass a pointer to 8 writable f32 (16-byte aligned when NT).
        unsafe {
            if NT {
                _mm_stream_ps(p, _mm256_castps256_ps128(v));
                _mm_stream_ps(p.add(4), _mm256_extractf128_ps::<1>(v));
            } else {
                _mm256_storeu_ps(p, v);
            }
        }
    }

    /// Writes the 16 bytes of `v` (unsigned or signed per `signed`) times `d`, plus `m` when given.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn store16<const NT: bool>(
        v: __m128i,
        signed: bool,
        d: __m256,
        m: Option<__m256>,
        out: *mut f32,
    ) {
        let (a, b) = if signed {
            (
                _mm256_cvtepi8_epi32(v),
                _mm256_cvtepi8_epi32(_mm_srli_si128::<8>(v)),
            )
        } else {
            (
                _mm256_cvtepu8_epi32(v),
                _mm256_cvtepu8_epi32(_mm_srli_si128::<8>(v)),
            )
        };
        let mut fa = _mm256_mul_ps(d, _mm256_cvtepi32_ps(a));
        let mut fb = _mm256_mul_ps(d, _mm256_cvtepi32_ps(b));
        if let Some(m) = m {
            fa = _mm256_add_ps(fa, m);
            fb = _mm256_add_ps(fb, m);
        }
        // SAFETY: callers pass a pointer to at least 16 writable f32.
        unsafe {
            st::<NT>(out, fa);
            st::<NT>(out.add(8), fb);
        }
    }

    /// Vector dequantisation of whole blocks. Same float operations in the same order as the
    /// scalar decoders (multiply then add, never fused), so the results are bit-identical.
    ///
    /// With `NT`, stores bypass the cache (`movntps`): for outputs far larger than L2 this
    /// saves the read-for-ownership of every output line. `NT` needs `out` 16-byte aligned.
    ///
    /// # Safety
    /// The CPU must support AVX2, FMA and F16C, `dequant_has_avx2(ty)` must hold, and
    /// `src.len() / ty.block_bytes() * ty.block_size() <= out.len()`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dequant_avx2<const NT: bool>(ty: QuantType, src: &[u8], out: &mut [f32]) {
        let (bb, bs) = (ty.block_bytes(), ty.block_size());
        let n = src.len() / bb;
        assert!(out.len() >= n * bs, "dequant_avx2: output too short");
        let sp = src.as_ptr();
        let op = out.as_mut_ptr();
        match ty {
            QuantType::F16 => {
                let mut i = 0;
                while i + 8 <= n {
                    // SAFETY: i + 8 <= n elements of 2 bytes in, 8 f32 out.
                    unsafe {
                        let h = _mm_loadu_si128(sp.add(2 * i).cast());
                        st::<NT>(op.add(i), _mm256_cvtph_ps(h));
                    }
                    i += 8;
                }
                for (j, o) in out.iter_mut().enumerate().take(n).skip(i) {
                    *o = rd_f16(src, 2 * j);
                }
            }
            QuantType::BF16 => {
                let mut i = 0;
                while i + 8 <= n {
                    // SAFETY: as above.
                    unsafe {
                        let h = _mm_loadu_si128(sp.add(2 * i).cast());
                        let w = _mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h));
                        st::<NT>(op.add(i), _mm256_castsi256_ps(w));
                    }
                    i += 8;
                }
                for j in i..n {
                    out[j] = f32::from_bits(
                        u32::from(u16::from_le_bytes([src[2 * j], src[2 * j + 1]])) << 16,
                    );
                }
            }
            QuantType::Q4_0 | QuantType::Q4_1 | QuantType::IQ4_NL => {
                let eight = _mm_set1_epi8(8);
                // SAFETY: the table is 16 bytes.
                let table = unsafe { _mm_loadu_si128(IQ4NL_VALUES.as_ptr().cast()) };
                for b in 0..n {
                    let blk = &src[b * bb..(b + 1) * bb];
                    let d = _mm256_set1_ps(rd_f16(blk, 0));
                    // SAFETY: each block has 16 bytes of nibbles at its end, and 32 f32 of
                    // output; `b < n` keeps both in bounds.
                    unsafe {
                        let o = op.add(b * 32);
                        match ty {
                            QuantType::Q4_0 => {
                                let (lo, hi) = nibbles16(blk.as_ptr().add(2));
                                store16::<NT>(_mm_sub_epi8(lo, eight), true, d, None, o);
                                store16::<NT>(_mm_sub_epi8(hi, eight), true, d, None, o.add(16));
                            }
                            QuantType::Q4_1 => {
                                let m = Some(_mm256_set1_ps(rd_f16(blk, 2)));
                                let (lo, hi) = nibbles16(blk.as_ptr().add(4));
                                store16::<NT>(lo, false, d, m, o);
                                store16::<NT>(hi, false, d, m, o.add(16));
                            }
                            _ => {
                                let (lo, hi) = nibbles16(blk.as_ptr().add(2));
                                store16::<NT>(_mm_shuffle_epi8(table, lo), true, d, None, o);
                                store16::<NT>(
                                    _mm_shuffle_epi8(table, hi),
                                    true,
                                    d,
                                    None,
                                    o.add(16),
                                );
                            }
                        }
                    }
                }
            }
            QuantType::Q8_0 => {
                for b in 0..n {
                    let blk = &src[b * bb..(b + 1) * bb];
                    let d = _mm256_set1_ps(rd_f16(blk, 0));
                    // SAFETY: 32 bytes of quants at offset 2 of a 34-byte block; 32 f32 out.
                    unsafe {
                        let q = _mm256_loadu_si256(blk.as_ptr().add(2).cast());
                        let f = i8x32_to_f32(q);
                        let o = op.add(b * 32);
                        for (k, v) in f.iter().enumerate() {
                            st::<NT>(o.add(8 * k), _mm256_mul_ps(*v, d));
                        }
                    }
                }
            }
            QuantType::Q4_K => {
                let mask = _mm256_set1_epi8(0x0f);
                for b in 0..n {
                    let blk = &src[b * bb..(b + 1) * bb];
                    let d = rd_f16(blk, 0);
                    let dmin = rd_f16(blk, 2);
                    let scales = &blk[4..16];
                    for c in 0..4 {
                        // SAFETY: qs starts at 16 and holds 4 chunks of 32 bytes; 256 f32 out.
                        unsafe {
                            let v = _mm256_loadu_si256(blk.as_ptr().add(16 + 32 * c).cast());
                            let halves = [
                                _mm256_and_si256(v, mask),
                                _mm256_and_si256(_mm256_srli_epi16::<4>(v), mask),
                            ];
                            for (h, q) in halves.into_iter().enumerate() {
                                let sb = 2 * c + h;
                                let (sc, m) = scale_min_k4(sb, scales);
                                let d1 = _mm256_set1_ps(d * sc as f32);
                                let m1 = _mm256_set1_ps(dmin * m as f32);
                                let o = op.add(b * 256 + sb * 32);
                                for (k, f) in u8x32_to_f32(q).iter().enumerate() {
                                    st::<NT>(
                                        o.add(8 * k),
                                        _mm256_sub_ps(_mm256_mul_ps(d1, *f), m1),
                                    );
                                }
                            }
                        }
                    }
                }
            }
            QuantType::Q5_0 | QuantType::Q5_1 => {
                let m4 = _mm_set1_epi8(0x0f);
                let k16 = _mm256_set1_epi8(16);
                let (qh_at, qs_at) = if ty == QuantType::Q5_0 {
                    (2, 6)
                } else {
                    (4, 8)
                };
                for b in 0..n {
                    let blk = &src[b * bb..(b + 1) * bb];
                    let d = _mm256_set1_ps(rd_f16(blk, 0));
                    let qh = u32::from_le_bytes([
                        blk[qh_at],
                        blk[qh_at + 1],
                        blk[qh_at + 2],
                        blk[qh_at + 3],
                    ]);
                    // SAFETY: 16 bytes of nibbles at qs_at inside the block; 32 f32 out.
                    unsafe {
                        let v = _mm_loadu_si128(blk.as_ptr().add(qs_at).cast());
                        let lo = _mm_and_si128(v, m4);
                        let hi = _mm_and_si128(_mm_srli_epi16::<4>(v), m4);
                        let q = _mm256_or_si256(_mm256_set_m128i(hi, lo), q5_high_bits(qh));
                        let o = op.add(b * 32);
                        if ty == QuantType::Q5_0 {
                            let f = i8x32_to_f32(_mm256_sub_epi8(q, k16));
                            for (k, v) in f.iter().enumerate() {
                                st::<NT>(o.add(8 * k), _mm256_mul_ps(d, *v));
                            }
                        } else {
                            let m = _mm256_set1_ps(rd_f16(blk, 2));
                            let f = u8x32_to_f32(q);
                            for (k, v) in f.iter().enumerate() {
                                st::<NT>(o.add(8 * k), _mm256_add_ps(_mm256_mul_ps(d, *v), m));
                            }
                        }
                    }
                }
            }
            QuantType::Q5_K => {
                let mask = _mm256_set1_epi8(0x0f);
                let one = _mm256_set1_epi8(1);
                for b in 0..n {
                    let blk = &src[b * bb..(b + 1) * bb];
                    let d = rd_f16(blk, 0);
                    let dmin = rd_f16(blk, 2);
                    let scales = &blk[4..16];
                    // SAFETY: qh is bytes 16..48 and qs 48..176 of the 176-byte block; 256 f32 out.
                    unsafe {
                        let qh = _mm256_loadu_si256(blk.as_ptr().add(16).cast());
                        for c in 0..4 {
                            let v = _mm256_loadu_si256(blk.as_ptr().add(48 + 32 * c).cast());
                            let halves = [
                                _mm256_and_si256(v, mask),
                                _mm256_and_si256(_mm256_srli_epi16::<4>(v), mask),
                            ];
                            for (h, q) in halves.into_iter().enumerate() {
                                let sb = 2 * c + h;
                                let bit = _mm256_and_si256(
                                    _mm256_srl_epi16(qh, _mm_cvtsi32_si128(sb as i32)),
                                    one,
                                );
                                let q = _mm256_or_si256(q, _mm256_slli_epi16::<4>(bit));
                                let (sc, m) = scale_min_k4(sb, scales);
                                let d1 = _mm256_set1_ps(d * sc as f32);
                                let m1 = _mm256_set1_ps(dmin * m as f32);
                                let o = op.add(b * 256 + sb * 32);
                                for (k, f) in u8x32_to_f32(q).iter().enumerate() {
                                    st::<NT>(
                                        o.add(8 * k),
                                        _mm256_sub_ps(_mm256_mul_ps(d1, *f), m1),
                                    );
                                }
                            }
                        }
                    }
                }
            }
            QuantType::Q6_K => {
                let m4 = _mm256_set1_epi8(0x0f);
                let m2 = _mm256_set1_epi8(3);
                let k32 = _mm256_set1_epi8(32);
                for b in 0..n {
                    let blk = &src[b * bb..(b + 1) * bb];
                    let d = rd_f16(blk, 208);
                    for h in 0..2 {
                        // SAFETY: ql is bytes 0..128, qh 128..192; each load is 32 bytes inside
                        // them; 256 f32 out per block.
                        unsafe {
                            let qh = _mm256_loadu_si256(blk.as_ptr().add(128 + 32 * h).cast());
                            for g in 0..4 {
                                let ql = _mm256_loadu_si256(
                                    blk.as_ptr().add(64 * h + 32 * (g % 2)).cast(),
                                );
                                let lo = if g < 2 {
                                    _mm256_and_si256(ql, m4)
                                } else {
                                    _mm256_and_si256(_mm256_srli_epi16::<4>(ql), m4)
                                };
                                let hi = match g {
                                    0 => _mm256_and_si256(qh, m2),
                                    1 => _mm256_and_si256(_mm256_srli_epi16::<2>(qh), m2),
                                    2 => _mm256_and_si256(_mm256_srli_epi16::<4>(qh), m2),
                                    _ => _mm256_and_si256(_mm256_srli_epi16::<6>(qh), m2),
                                };
                                let q = _mm256_sub_epi8(
                                    _mm256_or_si256(lo, _mm256_slli_epi16::<4>(hi)),
                                    k32,
                                );
                                let f = i8x32_to_f32(q);
                                let e0 = 128 * h + 32 * g;
                                let s0 = d * (blk[192 + e0 / 16] as i8) as f32;
                                let s1 = d * (blk[192 + e0 / 16 + 1] as i8) as f32;
                                let (d0, d1) = (_mm256_set1_ps(s0), _mm256_set1_ps(s1));
                                let o = op.add(b * 256 + e0);
                                st::<NT>(o, _mm256_mul_ps(d0, f[0]));
                                st::<NT>(o.add(8), _mm256_mul_ps(d0, f[1]));
                                st::<NT>(o.add(16), _mm256_mul_ps(d1, f[2]));
                                st::<NT>(o.add(24), _mm256_mul_ps(d1, f[3]));
                            }
                        }
                    }
                }
            }
            _ => crate::cpu::dequant_scalar::dequant_blocks(ty, src, out),
        }
        if NT {
            // order the non-temporal stores before anything that follows
            _mm_sfence();
        }
    }

    /// f32 to f16 bits, round to nearest even.
    ///
    /// # Safety
    /// The CPU must support AVX2 and F16C; `out.len() >= src.len()`.
    #[target_feature(enable = "avx2,f16c")]
    pub unsafe fn f32_to_f16_avx2(src: &[f32], out: &mut [u16]) {
        let n = src.len();
        assert!(out.len() >= n, "f32_to_f16_avx2: output too short");
        let mut i = 0;
        while i + 8 <= n {
            // SAFETY: i + 8 <= n on both sides.
            unsafe {
                let v = _mm256_loadu_ps(src.as_ptr().add(i));
                let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(v);
                _mm_storeu_si128(out.as_mut_ptr().add(i).cast(), h);
            }
            i += 8;
        }
        for j in i..n {
            out[j] = crate::cpu::half::f32_to_f16(src[j]);
        }
    }

    /// Horizontal sum of 8 lanes.
    #[inline]
    #[target_feature(enable = "avx2")]
    pub fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps::<1>(s, s));
        _mm_cvtss_f32(s)
    }

    /// f32 dot product.
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA; `a.len() == b.len()`.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot_f32_avx2(a: &[f32], b: &[f32]) -> f32 {
        let n = a.len().min(b.len());
        let (pa, pb) = (a.as_ptr(), b.as_ptr());
        let mut acc = [_mm256_setzero_ps(); 4];
        let mut i = 0;
        while i + 32 <= n {
            for (k, acc_k) in acc.iter_mut().enumerate() {
                // SAFETY: i + 32 <= n.
                unsafe {
                    *acc_k = _mm256_fmadd_ps(
                        _mm256_loadu_ps(pa.add(i + 8 * k)),
                        _mm256_loadu_ps(pb.add(i + 8 * k)),
                        *acc_k,
                    );
                }
            }
            i += 32;
        }
        while i + 8 <= n {
            // SAFETY: i + 8 <= n.
            unsafe {
                acc[0] = _mm256_fmadd_ps(
                    _mm256_loadu_ps(pa.add(i)),
                    _mm256_loadu_ps(pb.add(i)),
                    acc[0],
                );
            }
            i += 8;
        }
        let v = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
        let mut s = hsum(v);
        for j in i..n {
            s += a[j] * b[j];
        }
        s
    }

    /// Unsigned-by-signed byte dot products of 32 lanes, summed into 8 i32 lanes
    /// (`x` holds values 0..=127 or is made non-negative by the sign trick).
    #[inline]
    #[target_feature(enable = "avx2")]
    pub fn mul_sum_i8(x: __m256i, y: __m256i) -> __m256i {
        // |x| * sign(x)·y keeps maddubs's unsigned-by-signed form exact for x in [-127, 127]
        let ax = _mm256_sign_epi8(x, x);
        let sy = _mm256_sign_epi8(y, x);
        let p16 = _mm256_maddubs_epi16(ax, sy);
        _mm256_madd_epi16(p16, _mm256_set1_epi16(1))
    }

    /// The 32 quants of a Q4_0-style nibble block as signed bytes minus `offset`.
    #[inline]
    #[target_feature(enable = "avx2")]
    pub fn nibbles32(p: *const u8, offset: i8) -> __m256i {
        // SAFETY: callers pass a pointer to 16 readable bytes.
        let v = unsafe { _mm_loadu_si128(p.cast()) };
        let m = _mm_set1_epi8(0x0f);
        let lo = _mm_and_si128(v, m);
        let hi = _mm_and_si128(_mm_srli_epi16::<4>(v), m);
        let q = _mm256_set_m128i(hi, lo);
        _mm256_sub_epi8(q, _mm256_set1_epi8(offset))
    }

    /// Loads 32 bytes.
    #[inline]
    #[target_feature(enable = "avx2")]
    pub fn load32(p: *const u8) -> __m256i {
        // SAFETY: callers pass a pointer to 32 readable bytes.
        unsafe { _mm256_loadu_si256(p.cast()) }
    }

    /// Q8-mode row dot (see `matvec::finish_lanes`): integer lane sums per block, FMA into 8
    /// f32 lanes, same operations as the scalar path.
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA; `row` holds whole blocks of `ty` and `xq` at least
    /// as many 32-value activation blocks as the row has values / 32.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn row_dot_q8_avx2(
        ty: QuantType,
        row: &[u8],
        xq: &[crate::cpu::matvec::Q8Block],
    ) -> f32 {
        let bb = ty.block_bytes();
        let mut acc = _mm256_setzero_ps();
        let mut extra = 0f32;
        let ones = _mm256_set1_epi16(1);
        let m4 = _mm256_set1_epi8(0x0f);
        match ty {
            QuantType::Q4_0 | QuantType::Q4_1 | QuantType::Q8_0 => {
                for (blk, xb) in row.chunks_exact(bb).zip(xq) {
                    let d = rd_f16(blk, 0);
                    let xv = load32(xb.qs.as_ptr().cast());
                    let l = match ty {
                        QuantType::Q4_0 => mul_sum_i8(nibbles32(blk[2..].as_ptr(), 8), xv),
                        QuantType::Q4_1 => {
                            extra += (rd_f16(blk, 2) * xb.d) * xb.sum as f32;
                            // unsigned nibbles × signed activations: maddubs is exact
                            _mm256_madd_epi16(
                                _mm256_maddubs_epi16(nibbles32(blk[4..].as_ptr(), 0), xv),
                                ones,
                            )
                        }
                        _ => mul_sum_i8(load32(blk[2..].as_ptr()), xv),
                    };
                    acc = _mm256_fmadd_ps(_mm256_set1_ps(d * xb.d), _mm256_cvtepi32_ps(l), acc);
                }
            }
            QuantType::Q4_K => {
                for (blk, xbs) in row.chunks_exact(bb).zip(xq.chunks_exact(8)) {
                    let d = rd_f16(blk, 0);
                    let dmin = rd_f16(blk, 2);
                    let scales = &blk[4..16];
                    for c in 0..4 {
                        let v = load32(blk[16 + 32 * c..].as_ptr());
                        let halves = [
                            _mm256_and_si256(v, m4),
                            _mm256_and_si256(_mm256_srli_epi16::<4>(v), m4),
                        ];
                        for (h, q) in halves.into_iter().enumerate() {
                            let sb = 2 * c + h;
                            let xb = &xbs[sb];
                            let (sc, m) = scale_min_k4(sb, scales);
                            let xv = load32(xb.qs.as_ptr().cast());
                            let l = _mm256_madd_epi16(_mm256_maddubs_epi16(q, xv), ones);
                            acc = _mm256_fmadd_ps(
                                _mm256_set1_ps(d * sc as f32 * xb.d),
                                _mm256_cvtepi32_ps(l),
                                acc,
                            );
                            extra -= (dmin * m as f32 * xb.d) * xb.sum as f32;
                        }
                    }
                }
            }
            QuantType::Q6_K => {
                let m2 = _mm256_set1_epi8(3);
                let k32 = _mm256_set1_epi8(32);
                for (blk, xbs) in row.chunks_exact(bb).zip(xq.chunks_exact(8)) {
                    let d = rd_f16(blk, 208);
                    for h in 0..2 {
                        let qh = load32(blk[128 + 32 * h..].as_ptr());
                        for g in 0..4 {
                            let ql = load32(blk[64 * h + 32 * (g % 2)..].as_ptr());
                            let lo = if g < 2 {
                                _mm256_and_si256(ql, m4)
                            } else {
                                _mm256_and_si256(_mm256_srli_epi16::<4>(ql), m4)
                            };
                            let hi = match g {
                                0 => _mm256_and_si256(qh, m2),
                                1 => _mm256_and_si256(_mm256_srli_epi16::<2>(qh), m2),
                                2 => _mm256_and_si256(_mm256_srli_epi16::<4>(qh), m2),
                                _ => _mm256_and_si256(_mm256_srli_epi16::<6>(qh), m2),
                            };
                            let q = _mm256_sub_epi8(
                                _mm256_or_si256(lo, _mm256_slli_epi16::<4>(hi)),
                                k32,
                            );
                            let gi = 4 * h + g;
                            let xb = &xbs[gi];
                            let l = mul_sum_i8(q, load32(xb.qs.as_ptr().cast()));
                            let s0 = d * f32::from(blk[192 + 2 * gi] as i8) * xb.d;
                            let s1 = d * f32::from(blk[193 + 2 * gi] as i8) * xb.d;
                            let dd = _mm256_setr_ps(s0, s0, s0, s0, s1, s1, s1, s1);
                            acc = _mm256_fmadd_ps(dd, _mm256_cvtepi32_ps(l), acc);
                        }
                    }
                }
            }
            _ => {}
        }
        let mut lanes = [0f32; 8];
        // SAFETY: lanes holds 8 f32.
        unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), acc) };
        crate::cpu::matvec::finish_lanes(&lanes, extra)
    }

    /// Σ_k q_k · x_k over 32 values: four 8-lane products summed with FMA.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn dot32(q: [__m256; 4], x: *const f32) -> (__m256, __m256) {
        // SAFETY: callers pass a pointer to 32 readable f32.
        unsafe {
            let x0 = _mm256_loadu_ps(x);
            let x1 = _mm256_loadu_ps(x.add(8));
            let x2 = _mm256_loadu_ps(x.add(16));
            let x3 = _mm256_loadu_ps(x.add(24));
            let s = _mm256_fmadd_ps(q[1], x1, _mm256_mul_ps(q[0], x0));
            let s = _mm256_fmadd_ps(q[3], x3, _mm256_fmadd_ps(q[2], x2, s));
            let xs = _mm256_add_ps(_mm256_add_ps(x0, x1), _mm256_add_ps(x2, x3));
            (s, xs)
        }
    }

    /// Whether [`row_dot_exact_avx2`] has a fused path for `ty`.
    pub fn exact_has_fused(ty: QuantType) -> bool {
        matches!(
            ty,
            QuantType::Q4_0 | QuantType::Q4_1 | QuantType::Q8_0 | QuantType::Q4_K
        )
    }

    /// Exact-mode row dot with the dequantisation fused into the FMA loop: per (sub-)block
    /// `d · Σ q·x (+ m · Σ x)`, f32 throughout, no activation rounding.
    ///
    /// # Safety
    /// The CPU must support AVX2, FMA and F16C; `exact_has_fused(ty)`; `row` holds whole
    /// blocks of `ty` and `x` at least as many values as they decode to.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn row_dot_exact_avx2(ty: QuantType, row: &[u8], x: &[f32]) -> f32 {
        let bb = ty.block_bytes();
        let bs = ty.block_size();
        assert!(
            x.len() >= row.len() / bb * bs,
            "row_dot_exact_avx2: activations too short"
        );
        let mut acc = _mm256_setzero_ps();
        let mut accm = _mm256_setzero_ps();
        let m4 = _mm256_set1_epi8(0x0f);
        for (b, blk) in row.chunks_exact(bb).enumerate() {
            let xp = x[b * bs..].as_ptr();
            match ty {
                QuantType::Q4_0 => {
                    let (s, _) = dot32(i8x32_to_f32(nibbles32(blk[2..].as_ptr(), 8)), xp);
                    acc = _mm256_fmadd_ps(_mm256_set1_ps(rd_f16(blk, 0)), s, acc);
                }
                QuantType::Q8_0 => {
                    let (s, _) = dot32(i8x32_to_f32(load32(blk[2..].as_ptr())), xp);
                    acc = _mm256_fmadd_ps(_mm256_set1_ps(rd_f16(blk, 0)), s, acc);
                }
                QuantType::Q4_1 => {
                    let (s, xs) = dot32(u8x32_to_f32(nibbles32(blk[4..].as_ptr(), 0)), xp);
                    acc = _mm256_fmadd_ps(_mm256_set1_ps(rd_f16(blk, 0)), s, acc);
                    accm = _mm256_fmadd_ps(_mm256_set1_ps(rd_f16(blk, 2)), xs, accm);
                }
                _ => {
                    // Q4_K
                    let d = rd_f16(blk, 0);
                    let dmin = rd_f16(blk, 2);
                    let scales = &blk[4..16];
                    for c in 0..4 {
                        let v = load32(blk[16 + 32 * c..].as_ptr());
                        let halves = [
                            _mm256_and_si256(v, m4),
                            _mm256_and_si256(_mm256_srli_epi16::<4>(v), m4),
                        ];
                        for (h, q) in halves.into_iter().enumerate() {
                            let sb = 2 * c + h;
                            let (sc, m) = scale_min_k4(sb, scales);
                            // SAFETY: sub-block sb covers values 32·sb..32·sb+32 of this block.
                            let (s, xs) = dot32(u8x32_to_f32(q), unsafe { xp.add(32 * sb) });
                            acc = _mm256_fmadd_ps(_mm256_set1_ps(d * sc as f32), s, acc);
                            accm = _mm256_fmadd_ps(_mm256_set1_ps(dmin * m as f32), xs, accm);
                        }
                    }
                }
            }
        }
        match ty {
            QuantType::Q4_1 => hsum(acc) + hsum(accm),
            QuantType::Q4_K => hsum(acc) - hsum(accm),
            _ => hsum(acc),
        }
    }

    /// Four dot products of `w` with `x[0..4]` sharing each load of `w`.
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA; every `x[k]` is at least as long as `w`.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot4_f32_avx2(w: &[f32], x: [&[f32]; 4]) -> [f32; 4] {
        let n = w.len();
        assert!(
            x.iter().all(|v| v.len() >= n),
            "dot4: activations too short"
        );
        let mut acc = [_mm256_setzero_ps(); 4];
        let mut i = 0;
        while i + 8 <= n {
            // SAFETY: i + 8 <= n for w and every x[k].
            unsafe {
                let wv = _mm256_loadu_ps(w.as_ptr().add(i));
                for k in 0..4 {
                    acc[k] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x[k].as_ptr().add(i)), acc[k]);
                }
            }
            i += 8;
        }
        let mut out = [hsum(acc[0]), hsum(acc[1]), hsum(acc[2]), hsum(acc[3])];
        for j in i..n {
            for k in 0..4 {
                out[k] += w[j] * x[k][j];
            }
        }
        out
    }

    /// f32 dot product with 512-bit FMAs.
    ///
    /// # Safety
    /// The CPU must support AVX-512F; `a.len() == b.len()`.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn dot_f32_avx512(a: &[f32], b: &[f32]) -> f32 {
        let n = a.len().min(b.len());
        let (pa, pb) = (a.as_ptr(), b.as_ptr());
        let mut acc = [_mm512_setzero_ps(); 2];
        let mut i = 0;
        while i + 32 <= n {
            // SAFETY: i + 32 <= n.
            unsafe {
                acc[0] = _mm512_fmadd_ps(
                    _mm512_loadu_ps(pa.add(i)),
                    _mm512_loadu_ps(pb.add(i)),
                    acc[0],
                );
                acc[1] = _mm512_fmadd_ps(
                    _mm512_loadu_ps(pa.add(i + 16)),
                    _mm512_loadu_ps(pb.add(i + 16)),
                    acc[1],
                );
            }
            i += 32;
        }
        let mut s = _mm512_reduce_add_ps(_mm512_add_ps(acc[0], acc[1]));
        for j in i..n {
            s += a[j] * b[j];
        }
        s
    }

    /// Four dot products of `w` with `x[0..4]` with 512-bit FMAs, sharing each load of `w`.
    ///
    /// # Safety
    /// The CPU must support AVX-512F; every `x[k]` is at least as long as `w`.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn dot4_f32_avx512(w: &[f32], x: [&[f32]; 4]) -> [f32; 4] {
        let n = w.len();
        assert!(
            x.iter().all(|v| v.len() >= n),
            "dot4: activations too short"
        );
        let mut acc = [_mm512_setzero_ps(); 4];
        let mut i = 0;
        while i + 16 <= n {
            // SAFETY: i + 16 <= n for w and every x[k].
            unsafe {
                let wv = _mm512_loadu_ps(w.as_ptr().add(i));
                for k in 0..4 {
                    acc[k] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x[k].as_ptr().add(i)), acc[k]);
                }
            }
            i += 16;
        }
        let mut out = [
            _mm512_reduce_add_ps(acc[0]),
            _mm512_reduce_add_ps(acc[1]),
            _mm512_reduce_add_ps(acc[2]),
            _mm512_reduce_add_ps(acc[3]),
        ];
        for j in i..n {
            for k in 0..4 {
                out[k] += w[j] * x[k][j];
            }
        }
        out
    }

    /// 16 signed or unsigned bytes as 16 f32 lanes.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn bytes16_to_f32x16(v: __m128i, signed: bool) -> __m512 {
        if signed {
            _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v))
        } else {
            _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(v))
        }
    }

    /// Σ q·x over 32 values held as two 16-lane halves; also returns Σ x.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn dot32_512(q0: __m512, q1: __m512, x: *const f32) -> (__m512, __m512) {
        // SAFETY: callers pass a pointer to 32 readable f32.
        let (x0, x1) = unsafe { (_mm512_loadu_ps(x), _mm512_loadu_ps(x.add(16))) };
        (
            _mm512_fmadd_ps(q1, x1, _mm512_mul_ps(q0, x0)),
            _mm512_add_ps(x0, x1),
        )
    }

    /// [`row_dot_exact_avx2`] with 512-bit conversions and FMAs (half the instructions).
    ///
    /// # Safety
    /// The CPU must support AVX-512F/BW, AVX2 and F16C; `exact_has_fused(ty)`; `row` holds
    /// whole blocks of `ty` and `x` at least as many values as they decode to.
    #[target_feature(enable = "avx512f,avx512bw,avx2,f16c")]
    pub unsafe fn row_dot_exact_avx512(ty: QuantType, row: &[u8], x: &[f32]) -> f32 {
        let bb = ty.block_bytes();
        let bs = ty.block_size();
        assert!(
            x.len() >= row.len() / bb * bs,
            "row_dot_exact_avx512: activations too short"
        );
        let mut acc = _mm512_setzero_ps();
        let mut accm = _mm512_setzero_ps();
        let m4 = _mm_set1_epi8(0x0f);
        let eight = _mm_set1_epi8(8);
        let ld16 = |p: &[u8]| {
            // SAFETY: every caller slices at least 16 bytes from inside the block.
            unsafe { _mm_loadu_si128(p.as_ptr().cast()) }
        };
        for (b, blk) in row.chunks_exact(bb).enumerate() {
            let xp = x[b * bs..].as_ptr();
            match ty {
                QuantType::Q4_0 | QuantType::Q4_1 => {
                    let at = if ty == QuantType::Q4_0 { 2 } else { 4 };
                    let v = ld16(&blk[at..at + 16]);
                    let (mut lo, mut hi) = (
                        _mm_and_si128(v, m4),
                        _mm_and_si128(_mm_srli_epi16::<4>(v), m4),
                    );
                    if ty == QuantType::Q4_0 {
                        lo = _mm_sub_epi8(lo, eight);
                        hi = _mm_sub_epi8(hi, eight);
                    }
                    let (s, xs) =
                        dot32_512(bytes16_to_f32x16(lo, true), bytes16_to_f32x16(hi, true), xp);
                    acc = _mm512_fmadd_ps(_mm512_set1_ps(rd_f16(blk, 0)), s, acc);
                    if ty == QuantType::Q4_1 {
                        accm = _mm512_fmadd_ps(_mm512_set1_ps(rd_f16(blk, 2)), xs, accm);
                    }
                }
                QuantType::Q8_0 => {
                    let q0 = bytes16_to_f32x16(ld16(&blk[2..18]), true);
                    let q1 = bytes16_to_f32x16(ld16(&blk[18..34]), true);
                    let (s, _) = dot32_512(q0, q1, xp);
                    acc = _mm512_fmadd_ps(_mm512_set1_ps(rd_f16(blk, 0)), s, acc);
                }
                _ => {
                    // Q4_K
                    let d = rd_f16(blk, 0);
                    let dmin = rd_f16(blk, 2);
                    let scales = &blk[4..16];
                    for c in 0..4 {
                        let a = ld16(&blk[16 + 32 * c..32 + 32 * c]);
                        let bq = ld16(&blk[32 + 32 * c..48 + 32 * c]);
                        for h in 0..2 {
                            let (qa, qb) = if h == 0 {
                                (_mm_and_si128(a, m4), _mm_and_si128(bq, m4))
                            } else {
                                (
                                    _mm_and_si128(_mm_srli_epi16::<4>(a), m4),
                                    _mm_and_si128(_mm_srli_epi16::<4>(bq), m4),
                                )
                            };
                            let sb = 2 * c + h;
                            let (sc, m) = scale_min_k4(sb, scales);
                            // SAFETY: sub-block sb covers values 32·sb..32·sb+32 of this block.
                            let (s, xs) = dot32_512(
                                bytes16_to_f32x16(qa, false),
                                bytes16_to_f32x16(qb, false),
                                unsafe { xp.add(32 * sb) },
                            );
                            acc = _mm512_fmadd_ps(_mm512_set1_ps(d * sc as f32), s, acc);
                            accm = _mm512_fmadd_ps(_mm512_set1_ps(dmin * m as f32), xs, accm);
                        }
                    }
                }
            }
        }
        let (a, m) = (_mm512_reduce_add_ps(acc), _mm512_reduce_add_ps(accm));
        match ty {
            QuantType::Q4_1 => a + m,
            QuantType::Q4_K => a - m,
            _ => a,
        }
    }
}
