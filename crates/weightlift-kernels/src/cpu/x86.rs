//! AVX2 + FMA + F16C kernels (and AVX-512 where it pays), selected at run time by [`Isa`]:
//! the matvec helpers and the f32 to f16 conversion. Dequantisation lives in `x86_dequant`.
//!
//! Every function here has a scalar twin in the parent module; tests run both.
// The std::arch intrinsics are unsafe to call: they need the CPU features that `Isa::detect`
// checked at run time and raw pointers into slices whose bounds each function checks first.

#[cfg(target_arch = "x86_64")]
pub(crate) mod imp {
    use crate::cpu::dequant_scalar::scale_min_k4;
    use crate::types::QuantType;
    use std::arch::x86_64::*;

    /// The little-endian f16 at `off` of `b` as f32 (exact), by F16C: the short dependency
    /// chain the per-block scales of the matvec loops want.
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    pub fn rd_f16(b: &[u8], off: usize) -> f32 {
        let bits = u16::from_le_bytes([b[off], b[off + 1]]);
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(bits))))
    }

    /// The two little-endian f16 at `off` and `off + 2` of `b` (a block's `d` and `m` or
    /// `dmin`) as f32 (exact), by one 4-byte load and F16C. The 4-byte load zeroes the rest of
    /// the register, where [`rd_f16`]'s 2-byte one can become a `vpinsrw` merging into
    /// whatever register LLVM picks: in a loop, a false dependency on the previous
    /// iteration's last write to it (Q4_K's Q8-mode matvec: 0.66 ms, against 1.01 ms with the
    /// two 2-byte loads). Use both values: with one, LLVM narrows the load back to 2 bytes.
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    pub fn rd_f16_pair(b: &[u8], off: usize) -> (f32, f32) {
        let bits = i32::from_le_bytes([b[off], b[off + 1], b[off + 2], b[off + 3]]);
        let v = _mm_cvtph_ps(_mm_cvtsi32_si128(bits));
        (_mm_cvtss_f32(v), _mm_cvtss_f32(_mm_movehdup_ps(v)))
    }

    /// The same value as [`rd_f16`], by integer bit manipulation. The dequantisers use this
    /// form: in their loops LLVM turns the one-lane F16C form into a `vpinsrw` that merges into
    /// whatever register it picks, chaining each block's scale load to the previous block's last
    /// result (about 2x slower Q8_0 to f16). In the matvec loops the F16C form is the faster
    /// (Q4_0 Q8-mode matvec, 1 thread: 1.25 ms against 1.42 ms).
    #[inline]
    pub fn rd_f16_int(b: &[u8], off: usize) -> f32 {
        crate::cpu::half::f16_to_f32(u16::from_le_bytes([b[off], b[off + 1]]))
    }

    /// The 32 unsigned 6-bit quants (q + 32) of a Q6_K group: `ql` holds its low nibbles (the
    /// low halves of its bytes for `g` < 2, the high halves after), `qh` the two high bits of
    /// the half-block's four groups; `g` is the group's place in its half-block (0..4).
    #[inline]
    #[target_feature(enable = "avx2")]
    pub fn q6k_group(ql: __m256i, qh: __m256i, g: usize) -> __m256i {
        let m4 = _mm256_set1_epi8(0x0f);
        let m2 = _mm256_set1_epi8(3);
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
        _mm256_or_si256(lo, _mm256_slli_epi16::<4>(hi))
    }

    /// Group `g` (0..4) of half-block `h` of a Q6_K block: its 32 unsigned quants (q + 32).
    #[inline]
    #[target_feature(enable = "avx2")]
    pub fn q6k_group_at(blk: &[u8], h: usize, g: usize) -> __m256i {
        let ql = load32(blk[64 * h + 32 * (g % 2)..64 * h + 32 * (g % 2) + 32].as_ptr());
        q6k_group(ql, load32(blk[128 + 32 * h..160 + 32 * h].as_ptr()), g)
    }

    /// Group `g` (0..4) of half-block `h` of a Q3_K block: its 32 unsigned quants (q + 4, in
    /// 0..8), the two low bits from `qs` (bytes `32 + 32h..`, shifted by `2g`) and the third
    /// from bit `4h + g` of the 32 `hmask` bytes (bytes 0..32).
    #[inline]
    #[target_feature(enable = "avx2")]
    pub fn q3k_group_at(blk: &[u8], h: usize, g: usize) -> __m256i {
        let qs = load32(blk[32 + 32 * h..64 + 32 * h].as_ptr());
        let hm = load32(blk[..32].as_ptr());
        // 16-bit shifts: the bits a byte takes from its neighbour fall outside the masks
        let shr = |v: __m256i, n: usize| _mm256_srl_epi16(v, _mm_cvtsi32_si128(n as i32));
        let lo = _mm256_and_si256(shr(qs, 2 * g), _mm256_set1_epi8(3));
        let hi = _mm256_and_si256(shr(hm, 4 * h + g), _mm256_set1_epi8(1));
        _mm256_or_si256(lo, _mm256_slli_epi16::<2>(hi))
    }

    /// Group `g` (0..4) of half-block `h` of a Q2_K block: its 32 unsigned quants (0..4), bits
    /// `2g, 2g + 1` of `qs` (bytes `16 + 32h..`).
    #[inline]
    #[target_feature(enable = "avx2")]
    pub fn q2k_group_at(blk: &[u8], h: usize, g: usize) -> __m256i {
        let qs = load32(blk[16 + 32 * h..48 + 32 * h].as_ptr());
        // a 16-bit shift: the bits a byte takes from its neighbour fall outside the mask
        let v = _mm256_srl_epi16(qs, _mm_cvtsi32_si128(2 * g as i32));
        _mm256_and_si256(v, _mm256_set1_epi8(3))
    }

    /// Four f32 vectors from the 32 unsigned bytes of `v`.
    #[inline]
    #[target_feature(enable = "avx2")]
    pub fn u8x32_to_f32(v: __m256i) -> [__m256; 4] {
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
    pub fn i8x32_to_f32(v: __m256i) -> [__m256; 4] {
        let lo = _mm256_castsi256_si128(v);
        let hi = _mm256_extracti128_si256::<1>(v);
        [
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo)),
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128::<8>(lo))),
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi)),
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128::<8>(hi))),
        ]
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

    /// f32 to bf16 bits, round to nearest even, NaN kept quiet: the integer form of
    /// [`crate::cpu::half::f32_to_bf16`], eight values at a time (AVX2 has no bf16
    /// conversion; AVX512-BF16's rounds the same way but is rarer than this is fast).
    ///
    /// # Safety
    /// The CPU must support AVX2; `out.len() >= src.len()`.
    #[target_feature(enable = "avx2")]
    pub unsafe fn f32_to_bf16_avx2(src: &[f32], out: &mut [u16]) {
        let n = src.len();
        assert!(out.len() >= n, "f32_to_bf16_avx2: output too short");
        let one = _mm256_set1_epi32(1);
        let half = _mm256_set1_epi32(0x7fff);
        let abs = _mm256_set1_epi32(0x7fff_ffff);
        let inf = _mm256_set1_epi32(0x7f80_0000);
        let quiet = _mm256_set1_epi32(0x0040_0000);
        let mut i = 0;
        while i + 8 <= n {
            // SAFETY: i + 8 <= n on both sides.
            unsafe {
                let v = _mm256_loadu_si256(src.as_ptr().add(i).cast());
                let lsb = _mm256_and_si256(_mm256_srli_epi32::<16>(v), one);
                let rounded = _mm256_add_epi32(v, _mm256_add_epi32(half, lsb));
                // |v| as a signed integer is non-negative, so the signed compare is exact
                let nan = _mm256_cmpgt_epi32(_mm256_and_si256(v, abs), inf);
                let r = _mm256_blendv_epi8(rounded, _mm256_or_si256(v, quiet), nan);
                let r = _mm256_srli_epi32::<16>(r);
                // every lane is below 2^16, so the saturating pack is exact; it packs within
                // 128-bit halves, and the permute brings the two halves' results together
                let p = _mm256_permute4x64_epi64::<0b00_00_10_00>(_mm256_packus_epi32(r, r));
                _mm_storeu_si128(out.as_mut_ptr().add(i).cast(), _mm256_castsi256_si128(p));
            }
            i += 8;
        }
        for j in i..n {
            out[j] = crate::cpu::half::f32_to_bf16(src[j]);
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
    /// The CPU must support AVX2, FMA and F16C (what `Isa`'s AVX2 level checks); `a.len() ==
    /// b.len()`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_f32_avx2(a: &[f32], b: &[f32]) -> f32 {
        let n = a.len().min(b.len());
        // SAFETY: dot_by_avx2 loads 8 values at `at` only while at + 8 <= n.
        let load = |at: usize| unsafe { _mm256_loadu_ps(b.as_ptr().add(at)) };
        dot_by_avx2(a, n, load, |j| b[j])
    }

    /// The sums of [`dot_f32_avx2`] over `a` and a row of `n` values whose 8 values at `at`
    /// `load(at)` reads and whose value `j` `value(j)` reads (an f32 row, or an f16 cache row
    /// widened in place): four accumulators 8 values apart, then one, then one by one. F16C
    /// too, so that a loader that widens f16 inlines here.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub fn dot_by_avx2(
        a: &[f32],
        n: usize,
        load: impl Fn(usize) -> __m256,
        value: impl Fn(usize) -> f32,
    ) -> f32 {
        let n = n.min(a.len());
        // SAFETY (each call): callers read at most n <= a.len() values from `at`.
        let x = |at: usize| unsafe { _mm256_loadu_ps(a.as_ptr().add(at)) };
        let mut acc = [_mm256_setzero_ps(); 4];
        let mut i = 0;
        while i + 32 <= n {
            for (k, acc_k) in acc.iter_mut().enumerate() {
                *acc_k = _mm256_fmadd_ps(x(i + 8 * k), load(i + 8 * k), *acc_k);
            }
            i += 32;
        }
        while i + 8 <= n {
            acc[0] = _mm256_fmadd_ps(x(i), load(i), acc[0]);
            i += 8;
        }
        let v = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
        let mut s = hsum(v);
        for (j, aj) in a.iter().enumerate().take(n).skip(i) {
            s += aj * value(j);
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

    /// The 32 quants of a Q4_0-style nibble block as signed bytes minus `offset`: the 16
    /// bytes loaded into both halves at once, the upper half shifted down a nibble (a 64-bit
    /// shift: the bits it brings in from the next byte fall in the masked-off upper nibble),
    /// then masked. Two vector operations where shifting, masking twice and inserting took
    /// four: the Q8-mode matvec runs this once per block and row.
    #[inline]
    #[target_feature(enable = "avx2")]
    pub fn nibbles32(p: *const u8, offset: i8) -> __m256i {
        // SAFETY: callers pass a pointer to 16 readable bytes.
        let v = _mm256_broadcastsi128_si256(unsafe { _mm_loadu_si128(p.cast()) });
        let v = _mm256_srlv_epi64(v, _mm256_setr_epi64x(0, 0, 4, 4));
        let q = _mm256_and_si256(v, _mm256_set1_epi8(0x0f));
        if offset == 0 {
            return q;
        }
        _mm256_sub_epi8(q, _mm256_set1_epi8(offset))
    }

    /// The little-endian `u32` at `off` of `b`: a Q5 block's `qh`, bit `j` the fifth bit of
    /// value `j`.
    #[inline(always)]
    pub fn rd_u32(b: &[u8], off: usize) -> u32 {
        u32::from_le_bytes([b[off], b[off + 1], b[off + 2], b[off + 3]])
    }

    /// Byte `j` is `0xff` where bit `j` of `qh` is set, else 0: each byte takes byte `j/8` of
    /// `qh` by `pshufb`, all its bits but bit `j%8` are set, and it is compared with all ones.
    #[inline]
    #[target_feature(enable = "avx2")]
    pub fn bits32_to_bytes(qh: u32) -> __m256i {
        let pick = _mm256_setr_epi64x(
            0,
            0x0101_0101_0101_0101,
            0x0202_0202_0202_0202,
            0x0303_0303_0303_0303,
        );
        let v = _mm256_shuffle_epi8(_mm256_set1_epi32(qh as i32), pick);
        let v = _mm256_or_si256(v, _mm256_set1_epi64x(0x7fbf_dfef_f7fb_fdfe_u64 as i64));
        _mm256_cmpeq_epi8(v, _mm256_set1_epi8(-1))
    }

    /// The 32 unsigned 5-bit quants (0..=31) of a Q5_0/Q5_1 block in value order: the
    /// nibbles of the 16 bytes at `qs` with bit `j` of `qh` as bit 4 of value `j`.
    #[inline]
    #[target_feature(enable = "avx2")]
    pub fn quants5_u(qh: u32, qs: *const u8) -> __m256i {
        let hi = _mm256_and_si256(bits32_to_bytes(qh), _mm256_set1_epi8(0x10));
        _mm256_or_si256(nibbles32(qs, 0), hi)
    }

    /// The 32 signed quants of a Q5_0 block (`q − 16`, −16..=15): where the fifth bit is clear
    /// the nibble gets `0xf0` on top, its two's complement value minus 16.
    #[inline]
    #[target_feature(enable = "avx2")]
    pub fn quants5_i(qh: u32, qs: *const u8) -> __m256i {
        let hi = _mm256_andnot_si256(bits32_to_bytes(qh), _mm256_set1_epi8(-16));
        _mm256_or_si256(nibbles32(qs, 0), hi)
    }

    /// [`quants5_u`] by AVX-512BW/VL: `qh` is the byte mask of a masked add of 16.
    #[inline]
    #[target_feature(enable = "avx2,avx512f,avx512bw,avx512vl")]
    pub fn quants5_u_avx512(qh: u32, qs: *const u8) -> __m256i {
        let q = nibbles32(qs, 0);
        _mm256_mask_add_epi8(q, qh, q, _mm256_set1_epi8(16))
    }

    /// Loads 32 bytes.
    #[inline]
    #[target_feature(enable = "avx2")]
    pub fn load32(p: *const u8) -> __m256i {
        // SAFETY: callers pass a pointer to 32 readable bytes.
        unsafe { _mm256_loadu_si256(p.cast()) }
    }

    /// The f16 at `off` of `b` as f32 (exact) in all 8 lanes, by F16C. With every lane used
    /// the load cannot become a `vpinsrw` merging into a register left by the previous loop
    /// iteration, as the scalar [`rd_f16`] can: a false loop-carried dependency through the
    /// scale that made the VNNI loops below slower than the AVX2 one.
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    pub fn splat_f16(b: &[u8], off: usize) -> __m256 {
        let bits = u16::from_le_bytes([b[off], b[off + 1]]);
        _mm256_cvtph_ps(_mm_set1_epi16(bits as i16))
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
        // One loop per type, so that nothing but the block's own work is in it: with the type's
        // match inside, the loop kept its vectors on the stack and read each scale through a
        // register merge that chained the blocks (see `splat_f16`). Release bench, 4096²,
        // 1 thread: Q8_0 2.9 → 2.1 ms, Q4_0 2.6 → 2.2 ms; Q4_1 and Q4_K within the noise.
        let blocks = row.chunks_exact(bb).enumerate();
        // SAFETY (each `xp`): the assert above holds `bs` activations for every block.
        let at = |b: usize| unsafe { x.as_ptr().add(b * bs) };
        match ty {
            QuantType::Q4_0 => {
                for (b, blk) in blocks {
                    let (s, _) = dot32(i8x32_to_f32(nibbles32(blk[2..18].as_ptr(), 8)), at(b));
                    acc = _mm256_fmadd_ps(splat_f16(blk, 0), s, acc);
                }
            }
            QuantType::Q8_0 => {
                for (b, blk) in blocks {
                    let (s, _) = dot32(i8x32_to_f32(load32(blk[2..34].as_ptr())), at(b));
                    acc = _mm256_fmadd_ps(splat_f16(blk, 0), s, acc);
                }
            }
            QuantType::Q4_1 => {
                for (b, blk) in blocks {
                    let (s, xs) = dot32(u8x32_to_f32(nibbles32(blk[4..20].as_ptr(), 0)), at(b));
                    acc = _mm256_fmadd_ps(splat_f16(blk, 0), s, acc);
                    accm = _mm256_fmadd_ps(splat_f16(blk, 2), xs, accm);
                }
            }
            _ => {
                // Q4_K
                let m4 = _mm256_set1_epi8(0x0f);
                for (b, blk) in blocks {
                    let (d, dmin) = (splat_f16(blk, 0), splat_f16(blk, 2));
                    let scales = &blk[4..16];
                    for c in 0..4 {
                        let v = load32(blk[16 + 32 * c..48 + 32 * c].as_ptr());
                        let halves = [
                            _mm256_and_si256(v, m4),
                            _mm256_and_si256(_mm256_srli_epi16::<4>(v), m4),
                        ];
                        for (h, q) in halves.into_iter().enumerate() {
                            let sb = 2 * c + h;
                            let (sc, m) = scale_min_k4(sb, scales);
                            // SAFETY: sub-block sb covers values 32·sb..32·sb+32 of this block.
                            let (s, xs) = dot32(u8x32_to_f32(q), unsafe { at(b).add(32 * sb) });
                            let (sc, m) = (_mm256_set1_ps(sc as f32), _mm256_set1_ps(m as f32));
                            acc = _mm256_fmadd_ps(_mm256_mul_ps(d, sc), s, acc);
                            accm = _mm256_fmadd_ps(_mm256_mul_ps(dmin, m), xs, accm);
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
    /// The CPU must support AVX-512F, AVX2 and F16C (what `Isa`'s AVX-512 level checks);
    /// `a.len() == b.len()`.
    #[target_feature(enable = "avx2,f16c,avx512f")]
    pub unsafe fn dot_f32_avx512(a: &[f32], b: &[f32]) -> f32 {
        let n = a.len().min(b.len());
        // SAFETY: dot_by_avx512 loads 16 values at `at` only while at + 16 <= n.
        let load = |at: usize| unsafe { _mm512_loadu_ps(b.as_ptr().add(at)) };
        dot_by_avx512(a, n, load, |j| b[j])
    }

    /// The sums of [`dot_f32_avx512`] over `a` and a row of `n` values read by `load` (16 at
    /// `at`) and `value` (value `j`), as [`dot_by_avx2`]: two accumulators 16 values apart,
    /// reduced by `_mm512_reduce_add_ps`, then one by one.
    #[inline]
    #[target_feature(enable = "avx2,f16c,avx512f")]
    pub fn dot_by_avx512(
        a: &[f32],
        n: usize,
        load: impl Fn(usize) -> __m512,
        value: impl Fn(usize) -> f32,
    ) -> f32 {
        let n = n.min(a.len());
        let mut acc = [_mm512_setzero_ps(); 2];
        let mut i = 0;
        while i + 32 <= n {
            for (k, acc_k) in acc.iter_mut().enumerate() {
                // SAFETY: i + 32 <= n <= a.len().
                let x = unsafe { _mm512_loadu_ps(a.as_ptr().add(i + 16 * k)) };
                *acc_k = _mm512_fmadd_ps(x, load(i + 16 * k), *acc_k);
            }
            i += 32;
        }
        let mut s = _mm512_reduce_add_ps(_mm512_add_ps(acc[0], acc[1]));
        for (j, aj) in a.iter().enumerate().take(n).skip(i) {
            s += aj * value(j);
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
    pub fn bytes16_to_f32x16(v: __m128i, signed: bool) -> __m512 {
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
