//! The host C++ build of `kernels/*.cuh` (the CUDA decode maths) against the Rust CPU kernels
//! and gguf-py's fixtures: block decoders, block layouts, the per-block NaN/inf scan of the
//! `scan_{type}` kernels, f16 rounding and the KV-cache quantisers. Without a C++ compiler
//! build.rs cannot build the shim, and the one test left fails, saying so.

// Reference loops index several arrays in lock-step; iterators would hide the maths.
#![allow(clippy::needless_range_loop)]

use crate::common;

#[cfg(not(wl_host_shim))]
#[test]
fn host_twin_needs_a_cpp_compiler() {
    panic!("build.rs found no C++ compiler for shim/host_shim.cpp, so the host twin was not built");
}

#[cfg(wl_host_shim)]
mod twin {
    use super::common::{NAMES, Rng, float_weights, load, tiled_rows};
    use weightlift_kernels::{KvFormat, KvType, QuantType, e4m3, host_shim, kv_decode, kv_encode};

    fn same(a: f32, b: f32) -> bool {
        a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
    }

    /// Byte offsets of the f16 scales in one block (ggml-common.h).
    fn scale_offsets(ty: QuantType) -> &'static [usize] {
        match ty {
            QuantType::Q4_1 | QuantType::Q5_1 | QuantType::Q4_K | QuantType::Q5_K => &[0, 2],
            QuantType::Q2_K => &[80, 82],
            QuantType::Q3_K => &[108],
            QuantType::Q6_K => &[208],
            _ => &[0],
        }
    }

    #[test]
    fn header_decoders_equal_gguf_py_fixtures() {
        for name in NAMES {
            let f = load(name);
            let mut out = vec![0f32; f.want.len()];
            host_shim::dequantize_f32(f.ty, &f.raw, &mut out).unwrap();
            for (i, (g, w)) in out.iter().zip(&f.want).enumerate() {
                assert!(
                    same(*g, *w),
                    "{name} element {i}: header {g:e}, gguf-py {w:e}"
                );
            }
        }
    }

    #[test]
    fn header_decoders_equal_rust_cpu_kernels_on_random_blocks() {
        let mut rng = Rng(0x5eed);
        for ty in QuantType::ALL {
            let n_blocks = if ty.block_size() == 1 { 4096 } else { 64 };
            let mut raw = rng.bytes(n_blocks * ty.block_bytes());
            if ty.block_size() > 1 {
                for blk in raw.chunks_exact_mut(ty.block_bytes()) {
                    for &o in scale_offsets(ty) {
                        // random finite f16: clear one exponent bit when all five are set
                        let mut h = u16::from_le_bytes([blk[o], blk[o + 1]]);
                        if h & 0x7c00 == 0x7c00 {
                            h &= 0xbbff;
                        }
                        blk[o..o + 2].copy_from_slice(&h.to_le_bytes());
                    }
                }
            }
            let n = n_blocks * ty.block_size();
            let (mut a, mut b) = (vec![0f32; n], vec![0f32; n]);
            host_shim::dequantize_f32(ty, &raw, &mut a).unwrap();
            for isa in weightlift_kernels::Isa::all_supported() {
                weightlift_kernels::cpu::dequantize_f32_with(isa, ty, &raw, &mut b).unwrap();
                for i in 0..n {
                    assert!(
                        same(a[i], b[i]),
                        "{ty} {isa:?} element {i}: header {:e}, rust {:e}",
                        a[i],
                        b[i]
                    );
                }
            }
        }
    }

    /// The dequantise kernels decode eight values at once, each block's scales once for the
    /// eight: every value keeps the bits of the one-value decoder, on random bytes (non-finite
    /// scales included) of every type, a float tensor's last group short of eight.
    #[test]
    fn header_decoders_by_eights_equal_them_value_by_value() {
        let mut rng = Rng(0xd8);
        for ty in QuantType::ALL {
            let n_blocks = if ty.block_size() == 1 { 4093 } else { 96 };
            let raw = rng.bytes(n_blocks * ty.block_bytes());
            let n = n_blocks * ty.block_size();
            let (mut one, mut eights) = (vec![0f32; n], vec![0f32; n]);
            host_shim::dequantize_f32(ty, &raw, &mut one).unwrap();
            host_shim::dequantize_f32_by_eights(ty, &raw, &mut eights).unwrap();
            for i in 0..n {
                assert!(
                    same(one[i], eights[i]),
                    "{ty} element {i}: by eights {:e}, one by one {:e}",
                    eights[i],
                    one[i]
                );
            }
            assert!(
                one.iter().any(|v| *v != 0.0),
                "{ty}: the random blocks decode to zeros"
            );
        }
    }

    #[test]
    fn header_f32_to_f16_rounds_like_the_half_crate() {
        let mut rng = Rng(99);
        let mut src: Vec<f32> = (0..200_000)
            .map(|_| f32::from_bits((rng.next_u64() >> 32) as u32))
            .collect();
        // every value in f16's range, around the rounding points
        src.extend((0..=u16::MAX).flat_map(|h| {
            let v = half::f16::from_bits(h).to_f32();
            [
                v,
                f32::from_bits(v.to_bits().wrapping_add(1)),
                f32::from_bits(v.to_bits().wrapping_sub(1)),
                v * 1.000_244_1,
            ]
        }));
        let mut out = vec![0u16; src.len()];
        host_shim::f32_to_f16(&src, &mut out);
        for (s, o) in src.iter().zip(&out) {
            let want = half::f16::from_f32(*s);
            assert!(
                want.to_bits() == *o || (want.is_nan() && half::f16::from_bits(*o).is_nan()),
                "{s:e}: header {o:#06x}, half {:#06x}",
                want.to_bits()
            );
        }
    }

    #[test]
    fn header_kv_quantisers_equal_rust_bytes_and_values() {
        let mut rng = Rng(41);
        let mut x = rng.vec(32 * 100, 5.0);
        x[33] = 1e6;
        x[64..96].fill(0.0);
        for kt in [KvType::Q8, KvType::Q4] {
            let (mut a, mut b) = (
                vec![0u8; kt.bytes_for(x.len())],
                vec![0u8; kt.bytes_for(x.len())],
            );
            host_shim::kv_quantize(kt, &x, &mut a).unwrap();
            weightlift_kernels::kv_quantize(kt, &x, &mut b).unwrap();
            assert_eq!(a, b, "{kt:?}");
            let (mut da, mut db) = (vec![0f32; x.len()], vec![0f32; x.len()]);
            host_shim::kv_dequantize(kt, &a, &mut da).unwrap();
            weightlift_kernels::kv_dequantize(kt, &b, &mut db).unwrap();
            assert_eq!(da, db, "{kt:?}");
        }
    }

    /// The cache codec's device half (`wl_kv.cuh`: the Hadamard turn, the turned q8/q4 groups,
    /// e4m3 and bf16) writes the Rust codec's bytes and reads back its values, bit for bit:
    /// groups with an outlier, zeros, subnormal and saturating magnitudes, e4m3 on every code,
    /// the midpoints between neighbouring codes (ties go to the even code) and one ulp either
    /// side, and bf16 on random bit patterns and on every tie of its rounding.
    #[test]
    fn header_cache_codec_equals_rust_bytes_and_values() {
        let mut rng = Rng(43);
        let mut x = rng.vec(32 * 100, 5.0);
        x[33] = 1e6;
        x[64..96].fill(0.0);
        x[96..128].iter_mut().for_each(|v| *v *= 1e-40);
        x[130] = -500.0;
        let mut e4m3_points = Vec::new();
        for code in 0u8..0x7E {
            let (lo, hi) = (e4m3::decode(code), e4m3::decode(code + 1));
            let mid = (lo + hi) / 2.0;
            for v in [lo, mid, hi] {
                for p in [
                    v,
                    f32::from_bits(v.to_bits() + 1),
                    f32::from_bits(v.to_bits().max(1) - 1),
                ] {
                    e4m3_points.extend([p, -p]);
                }
            }
        }
        e4m3_points.extend([
            448.0,
            449.0,
            464.0,
            1e9,
            f32::INFINITY,
            f32::NEG_INFINITY,
            -0.0,
        ]);
        let even = e4m3_points.len() / 32 * 32;
        // bf16: random bit patterns (NaN payloads, infinities, subnormals) and every rounding
        // tie of the kept half, odd and even, with one either side
        let mut bf16_points: Vec<f32> = (0..4096)
            .map(|_| f32::from_bits((rng.next_u64() >> 32) as u32))
            .collect();
        for hi in (0..=u16::MAX).step_by(5) {
            for lo in [0x7fffu32, 0x8000, 0x8001, 0] {
                bf16_points.push(f32::from_bits((u32::from(hi) << 16) | lo));
            }
        }
        for (format, xs) in [
            (KvFormat::Q8, &x[..]),
            (KvFormat::Q4, &x[..]),
            (KvFormat::E4M3, &x[..]),
            (KvFormat::E4M3, &e4m3_points[..even]),
            (KvFormat::BF16, &x[..]),
            (KvFormat::BF16, &bf16_points[..]),
        ] {
            let n = format.byte_at(xs.len());
            let (mut a, mut b) = (vec![0u8; n], vec![0u8; n]);
            host_shim::kv_store(format, xs, &mut a).unwrap();
            kv_encode(format, xs, &mut b).unwrap();
            for (i, (p, q)) in a.iter().zip(&b).enumerate() {
                assert_eq!(p, q, "{format:?}: byte {i}");
            }
            let (mut da, mut db) = (vec![0f32; xs.len()], vec![0f32; xs.len()]);
            host_shim::kv_load(format, &a, &mut da).unwrap();
            kv_decode(format, &b, &mut db).unwrap();
            for (i, (p, q)) in da.iter().zip(&db).enumerate() {
                assert!(same(*p, *q), "{format:?}: value {i}: {p} vs {q}");
            }
        }
        // every byte decodes alike (NaN codes included)
        let codes: Vec<u8> = (0..=255).collect();
        let (mut da, mut db) = (vec![0f32; 256], vec![0f32; 256]);
        host_shim::kv_load(KvFormat::E4M3, &codes, &mut da).unwrap();
        kv_decode(KvFormat::E4M3, &codes, &mut db).unwrap();
        for (c, (p, q)) in da.iter().zip(&db).enumerate() {
            assert!(same(*p, *q), "e4m3 code {c:#x}: {p} vs {q}");
        }
    }

    #[test]
    fn header_block_layouts_equal_gguf_py_and_ggml_common_h() {
        for name in NAMES {
            let f = load(name);
            let [bs, bb, o0, o1] = host_shim::block_layout(f.ty).unwrap();
            // gguf-py's GGML_QUANT_SIZES, through the fixture's header (checked in `load`)
            let n_blocks = f.raw.len() / f.ty.block_bytes();
            assert_eq!(
                bs as usize,
                f.want.len() / n_blocks,
                "{name} values per block"
            );
            assert_eq!(bb as usize, f.ty.block_bytes(), "{name} bytes per block");
            let offs: Vec<i32> = [o0, o1].into_iter().filter(|o| *o >= 0).collect();
            let want: Vec<i32> = if f.ty.block_size() == 1 {
                Vec::new()
            } else {
                scale_offsets(f.ty).iter().map(|o| *o as i32).collect()
            };
            assert_eq!(offs, want, "{name} f16 scale offsets");
        }
        assert_eq!(
            host_shim::block_layout(QuantType::F32),
            Some([1, 4, -1, -1])
        );
    }

    /// The `scan_{type}` kernels report the first element of the first block with a NaN/inf
    /// scale; that must be exactly the first non-finite value of the block decoders' output
    /// (which equals gguf-py bit for bit), for every scale field and every NaN/inf pattern.
    #[test]
    fn header_block_scan_finds_the_first_value_that_decodes_to_nan_or_inf() {
        let mut rng = Rng(0xbad5ca1e);
        let patterns = [0x7c00u16, 0xfc00, 0x7e00, 0x7c01, 0xffff];
        for ty in QuantType::ALL {
            if ty.block_size() == 1 {
                continue;
            }
            let n_blocks = 24;
            let mut clean = rng.bytes(n_blocks * ty.block_bytes());
            for blk in clean.chunks_exact_mut(ty.block_bytes()) {
                for &o in scale_offsets(ty) {
                    let mut h = u16::from_le_bytes([blk[o], blk[o + 1]]);
                    if h & 0x7c00 == 0x7c00 {
                        h &= 0xbbff;
                    }
                    blk[o..o + 2].copy_from_slice(&h.to_le_bytes());
                }
            }
            assert_eq!(host_shim::scan_blocks(ty, &clean).unwrap(), None, "{ty}");
            let mut decoded = vec![0f32; n_blocks * ty.block_size()];
            host_shim::dequantize_f32(ty, &clean, &mut decoded).unwrap();
            assert!(decoded.iter().all(|v| v.is_finite()), "{ty}: finite scales");
            for (k, &o) in scale_offsets(ty).iter().enumerate() {
                for (p, &bits) in patterns.iter().enumerate() {
                    let mut raw = clean.clone();
                    // two bad blocks; the scan must report the earlier one
                    let first = (k * 7 + p * 3 + 2) % (n_blocks - 1);
                    for b in [first + 1 + (p % (n_blocks - first - 1)), first] {
                        let at = b * ty.block_bytes() + o;
                        raw[at..at + 2].copy_from_slice(&bits.to_le_bytes());
                    }
                    host_shim::dequantize_f32(ty, &raw, &mut decoded).unwrap();
                    let want = decoded.iter().position(|v| !v.is_finite());
                    assert_eq!(
                        want,
                        Some(first * ty.block_size()),
                        "{ty} offset {o} {bits:#06x}"
                    );
                    assert_eq!(
                        host_shim::scan_blocks(ty, &raw).unwrap(),
                        want,
                        "{ty} scale at byte {o} = {bits:#06x}"
                    );
                }
            }
        }
    }

    /// The turned q8 and q4 cache groups of the device codec (`wl_kv.cuh`, what
    /// `kv_store_q8`/`kv_load_q8` run) meet the documented round-trip bound, which is stated on
    /// each group's L2 norm (√32·‖g‖/(2·qmax)·(1 + 2⁻⁹) + 2⁻¹⁷), not on its largest value: the
    /// Hadamard turn mixes the 32 roundings of a group. The first values are those of the
    /// `cuda:0` cache test in the engine (`sin(0.37 i)` for 2 heads × 64 × 3 tokens), which
    /// checked the pre-turn bound `amax/254`: on these values the turned groups' error exceeds
    /// that (asserted below), so that test failed on a GPU while the codec was right.
    #[test]
    fn header_turned_cache_groups_meet_the_norm_bound_not_the_absmax_one() {
        let mut rng = Rng(0x6008);
        let mut x: Vec<f32> = (0..2 * 64 * 3).map(|i| (i as f32 * 0.37).sin()).collect();
        x.extend(rng.vec(32 * 64, 4.0));
        for format in [KvFormat::Q8, KvFormat::Q4] {
            let qmax = f64::from(format.quant().unwrap().qmax());
            let mut bytes = vec![0u8; format.byte_at(x.len())];
            host_shim::kv_store(format, &x, &mut bytes).unwrap();
            let mut back = vec![0f32; x.len()];
            host_shim::kv_load(format, &bytes, &mut back).unwrap();
            let mut past_absmax = 0usize;
            for (gi, (g, b)) in x.chunks(32).zip(back.chunks(32)).enumerate() {
                let norm = g.iter().map(|v| f64::from(*v).powi(2)).sum::<f64>().sqrt();
                let amax = g.iter().fold(0f64, |m, v| m.max(f64::from(v.abs())));
                let bound =
                    32f64.sqrt() * norm / (2.0 * qmax) * (1.0 + 2f64.powi(-9)) + 2f64.powi(-17);
                for (v, w) in g.iter().zip(b) {
                    let err = (f64::from(*v) - f64::from(*w)).abs();
                    assert!(err <= bound, "{format:?} group {gi}: {err} > {bound}");
                    if gi < 12 && err > amax / (2.0 * qmax) * 1.01 + 1e-5 {
                        past_absmax += 1;
                    }
                }
            }
            eprintln!("{format:?}: {past_absmax} of the cuda test's values past the absmax bound");
            assert!(past_absmax > 0, "{format:?}");
        }
    }

    #[test]
    fn header_kv_quantisers_equal_rust_on_groups_with_nan_and_inf() {
        let mut rng = Rng(7);
        let mut x = rng.vec(32 * 8, 3.0);
        x[5] = f32::NAN; // group 0: NaN among finite values quantises to 0 (no UB cast)
        x[32 + 9] = f32::INFINITY; // group 1: inf saturates the scale
        x[64 + 1] = f32::NEG_INFINITY;
        x[64 + 2] = f32::NAN;
        x[96..128].fill(f32::NAN); // group 3: all NaN
        x[128 + 31] = 1e30; // group 4: past f16 range
        x[160..192].fill(-0.0);
        for kt in [KvType::Q8, KvType::Q4] {
            let (mut a, mut b) = (
                vec![0u8; kt.bytes_for(x.len())],
                vec![0u8; kt.bytes_for(x.len())],
            );
            host_shim::kv_quantize(kt, &x, &mut a).unwrap();
            for isa in weightlift_kernels::Isa::all_supported() {
                weightlift_kernels::cpu::kv::kv_quantize_with(isa, kt, &x, &mut b).unwrap();
                assert_eq!(a, b, "{kt:?} {isa:?}");
            }
            // group 0: the NaN went to q = 0, the stored f16 scale is finite
            let gb = kt.group_bytes();
            let q0 = match kt {
                KvType::Q8 => a[2 + 5] as i8 as i32,
                KvType::Q4 => (a[2 + 5] & 0x0f) as i32 - 8,
            };
            assert_eq!(q0, 0, "{kt:?}");
            let d1 = half::f16::from_le_bytes([a[gb], a[gb + 1]]);
            assert_eq!(
                d1.to_bits(),
                0x7bff,
                "{kt:?}: an inf saturates the scale at 65504"
            );
            let (mut da, mut db) = (vec![0f32; x.len()], vec![0f32; x.len()]);
            host_shim::kv_dequantize(kt, &a, &mut da).unwrap();
            weightlift_kernels::kv_dequantize(kt, &b, &mut db).unwrap();
            assert!(
                da.iter().zip(&db).all(|(p, q)| same(*p, *q)),
                "{kt:?} dequantised values"
            );
        }
    }

    /// The matvec/matmul kernels' arithmetic (per-lane strided FMA sums, then the warp
    /// butterfly), replayed on the host, against an f64 dot product of gguf-py's dequantised
    /// weights: row strides, lane striding, f16 activations and tails shorter than a warp.
    #[test]
    fn header_matmul_lanes_and_warp_sum_match_an_f64_dot_product() {
        use host_shim::Act;
        let mut rng = Rng(77);
        let check = |what: &str, w: &[f32], x: &[f32], got: &[f32], rows: usize, cols: usize| {
            let n_tok = x.len() / cols;
            let (want, mag) = super::common::reference(w, rows, cols, x, n_tok);
            for t in 0..n_tok {
                for r in 0..rows {
                    let (s, m) = (want[t * rows + r], mag[t * rows + r]);
                    let g = f64::from(got[t * rows + r]);
                    assert!(
                        (g - s).abs() <= 1e-5 * m + 1e-30,
                        "{what} token {t} row {r}: {g} vs f64 {s}"
                    );
                }
            }
        };
        for name in ["q4_0", "q4_1", "q8_0", "q4_k", "q6_k"] {
            let f = load(name);
            let cols = 256;
            let rows = f.want.len() / cols;
            assert!(rows >= 2, "{name}: fixture too small");
            let x = rng.vec(cols * 3, 1.0);
            let mut y = vec![0f32; rows * 3];
            host_shim::matmul(f.ty, &f.raw, Act::F32(&x), &mut y, rows, cols).unwrap();
            check(name, &f.want, &x, &y, rows, cols);
            // f16 activations: the reference sees the f16 values
            let x16: Vec<u16> = x
                .iter()
                .map(|v| half::f16::from_f32(*v).to_bits())
                .collect();
            let xr: Vec<f32> = x16
                .iter()
                .map(|h| half::f16::from_bits(*h).to_f32())
                .collect();
            host_shim::matmul(f.ty, &f.raw, Act::F16(&x16), &mut y, rows, cols).unwrap();
            check(&format!("{name} f16 act"), &f.want, &xr, &y, rows, cols);
        }
        // float weights have their own kernels (see the float test below)
        let err = host_shim::matmul(
            QuantType::F16,
            &[0u8; 64],
            Act::F32(&[0.0; 32]),
            &mut [0.0; 1],
            1,
            32,
        )
        .unwrap_err();
        assert!(err.to_string().contains("float_matmul"), "{err}");
        // no kernel for this weight type: a typed error, not a silent zero
        let iq4 = vec![0u8; QuantType::IQ4_NL.block_bytes() * 8];
        let err = host_shim::matmul(
            QuantType::IQ4_NL,
            &iq4,
            Act::F32(&[0.0; 32]),
            &mut [0.0; 8],
            8,
            32,
        )
        .unwrap_err();
        assert!(err.to_string().contains("iq4_nl"), "{err}");
    }

    /// The float-weight kernels (`matvec_`/`matmul_{f16,bf16,f32}_{f32,f16}`: 16-byte chunks
    /// spread over `tpr` threads a row, then the shuffle and cross-warp sums), replayed on the
    /// host with the header's own chunk decoding, for every threads-a-row choice, one token a
    /// pass (matvec) and four (matmul, with a short last pass): every output lies within
    /// 1e-5 · Σ|w·x| of an f64 dot of the weights as the `half` crate reads them, and within
    /// that of the CPU backend's exact product. Rows of 8, 100 (a tail of 4 values past 12 f16
    /// chunks, 25 f32 chunks), 256 (the tiny llama's rows), 1000 and 4099 values (longer than
    /// 256 threads' chunks, with a tail of 3), odd row counts, and weights with NaN, infinity,
    /// subnormals and bf16 ties.
    #[test]
    fn header_float_matvec_chunks_and_reductions_match_f64_and_the_cpu() {
        use host_shim::Act;
        use weightlift_kernels::sources::FLOAT_ROW_THREADS;
        use weightlift_kernels::{Isa, MatvecMode};
        let mut rng = Rng(0xf10a7);
        for (rows, cols) in [(3, 8), (7, 100), (5, 256), (4, 1000), (2, 4099)] {
            let wv = rng.vec(rows * cols, 2.0);
            for ty in [QuantType::F16, QuantType::BF16, QuantType::F32] {
                // the stored weights, and their values as the half crate reads them
                let (raw, w): (Vec<u8>, Vec<f32>) = match ty {
                    QuantType::F16 => {
                        let h: Vec<half::f16> =
                            wv.iter().map(|v| half::f16::from_f32(*v)).collect();
                        (
                            h.iter().flat_map(|v| v.to_le_bytes()).collect(),
                            h.iter().map(|v| v.to_f32()).collect(),
                        )
                    }
                    QuantType::BF16 => {
                        let h: Vec<half::bf16> =
                            wv.iter().map(|v| half::bf16::from_f32(*v)).collect();
                        (
                            h.iter().flat_map(|v| v.to_le_bytes()).collect(),
                            h.iter().map(|v| v.to_f32()).collect(),
                        )
                    }
                    _ => (
                        wv.iter().flat_map(|v| v.to_le_bytes()).collect(),
                        wv.clone(),
                    ),
                };
                for n_tok in [1usize, 3, 6] {
                    let x = rng.vec(cols * n_tok, 1.0);
                    let x16: Vec<u16> = x
                        .iter()
                        .map(|v| half::f16::from_f32(*v).to_bits())
                        .collect();
                    let xr: Vec<f32> = x16
                        .iter()
                        .map(|h| half::f16::from_bits(*h).to_f32())
                        .collect();
                    // the CPU backend's exact product, token by token
                    let mut cpu = vec![0f32; rows * n_tok];
                    for t in 0..n_tok {
                        weightlift_kernels::cpu::matvec::matvec_with(
                            Isa::detect(),
                            MatvecMode::Exact,
                            ty,
                            &raw,
                            rows,
                            cols,
                            &x[t * cols..(t + 1) * cols],
                            &mut cpu[t * rows..(t + 1) * rows],
                        )
                        .unwrap();
                    }
                    for tpr in FLOAT_ROW_THREADS {
                        for matmul in [false, true] {
                            if !matmul && n_tok > 1 {
                                continue;
                            }
                            for (act, xs) in [(Act::F32(&x), &x), (Act::F16(&x16), &xr)] {
                                let what = format!(
                                    "{ty} {rows}x{cols} {n_tok} tokens tpr {tpr} matmul {matmul} {}",
                                    if matches!(act, Act::F16(_)) {
                                        "f16 act"
                                    } else {
                                        "f32 act"
                                    }
                                );
                                let mut y = vec![f32::NAN; rows * n_tok];
                                host_shim::float_matmul(
                                    ty, &raw, act, &mut y, rows, cols, tpr, matmul,
                                )
                                .unwrap();
                                for t in 0..n_tok {
                                    for r in 0..rows {
                                        let (mut s, mut m) = (0f64, 0f64);
                                        for c in 0..cols {
                                            let p = f64::from(w[r * cols + c])
                                                * f64::from(xs[t * cols + c]);
                                            s += p;
                                            m += p.abs();
                                        }
                                        let g = f64::from(y[t * rows + r]);
                                        assert!(
                                            (g - s).abs() <= 1e-5 * m + 1e-30,
                                            "{what} token {t} row {r}: {g} vs f64 {s}"
                                        );
                                        if matches!(act, Act::F32(_)) {
                                            let c = f64::from(cpu[t * rows + r]);
                                            assert!(
                                                (g - c).abs() <= 1e-5 * m + 1e-30,
                                                "{what} token {t} row {r}: {g} vs cpu {c}"
                                            );
                                        }
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
        // non-finite weights poison exactly their rows' sums, at any threads a row
        let cols = 64;
        let mut wv = vec![0.5f32; 3 * cols];
        wv[5] = f32::NAN;
        wv[cols + 63] = f32::INFINITY;
        wv[2 * cols + 7] = 1e-40;
        let raw: Vec<u8> = wv
            .iter()
            .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
            .collect();
        let x = vec![1.0f32; cols];
        for tpr in FLOAT_ROW_THREADS {
            let mut y = vec![0f32; 3];
            host_shim::float_matmul(
                QuantType::BF16,
                &raw,
                Act::F32(&x),
                &mut y,
                3,
                cols,
                tpr,
                false,
            )
            .unwrap();
            assert!(y[0].is_nan() && y[1] == f32::INFINITY, "tpr {tpr}: {y:?}");
            assert!((f64::from(y[2]) - 31.5).abs() < 1e-6, "tpr {tpr}: {y:?}");
        }
        // quantised weights and unknown thread counts are refused, naming them
        let err = host_shim::float_matmul(
            QuantType::Q8_0,
            &[0u8; 34],
            Act::F32(&[0.0; 32]),
            &mut [0.0],
            1,
            32,
            32,
            false,
        )
        .unwrap_err();
        assert!(err.to_string().contains("q8_0"), "{err}");
        let err = host_shim::float_matmul(
            QuantType::F16,
            &[0u8; 64],
            Act::F32(&[0.0; 32]),
            &mut [0.0],
            1,
            32,
            48,
            false,
        )
        .unwrap_err();
        assert!(err.to_string().contains("48 threads a row"), "{err}");
    }

    /// A CPU `Q8Block` as the 40 bytes the device writes (`kernels/wl_q8.cuh`).
    fn q8_block_bytes(b: &weightlift_kernels::cpu::matvec::Q8Block) -> Vec<u8> {
        let mut v = b.d.to_le_bytes().to_vec();
        v.extend_from_slice(&b.sum.to_le_bytes());
        v.extend(b.qs.iter().map(|q| *q as u8));
        v
    }

    /// Per 32-value block of `xq`: (d, the 32 quants).
    fn q8_blocks(xq: &[u8]) -> Vec<(f32, [i8; 32])> {
        xq.chunks_exact(40)
            .map(|b| {
                let d = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                (d, std::array::from_fn(|i| b[8 + i] as i8))
            })
            .collect()
    }

    /// The activation quantiser against gguf-py's Q8_0 quantize() (llama.cpp's
    /// quantize_row_q8_0_ref): same f16 scale, same quants, bit for bit, on the fixture's
    /// blocks (exact halves, a zero block, tiny and large scales). The stored sum is the sum of
    /// the quants.
    #[test]
    fn header_q8_quantiser_equals_gguf_py_q8_0() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/q8_act.bin");
        let b = std::fs::read(&path).unwrap();
        assert_eq!(&b[..4], b"WLQ8");
        let n = u32::from_le_bytes([b[4], b[5], b[6], b[7]]) as usize;
        let x: Vec<f32> = b[8..8 + n * 128]
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        let want = &b[8 + n * 128..];
        assert_eq!(want.len(), n * 34);
        let mut xq = vec![0u8; n * 40];
        host_shim::q8_quantize(host_shim::Act::F32(&x), &mut xq).unwrap();
        for (k, (blk, g)) in xq.chunks_exact(40).zip(want.chunks_exact(34)).enumerate() {
            let d = f32::from_le_bytes([blk[0], blk[1], blk[2], blk[3]]);
            let gd = half::f16::from_le_bytes([g[0], g[1]]).to_f32();
            assert_eq!(d.to_bits(), gd.to_bits(), "block {k} scale");
            assert_eq!(&blk[8..40], &g[2..34], "block {k} quants");
            let sum: i32 = blk[8..40].iter().map(|q| i32::from(*q as i8)).sum();
            let got = i32::from_le_bytes([blk[4], blk[5], blk[6], blk[7]]);
            assert_eq!(got, sum, "block {k} sum");
        }
    }

    /// The activation quantiser writes exactly the bytes of the CPU's `quantize_q8_blocks`
    /// (as its `#[repr(C)] Q8Block`), including NaN, inf, -0.0, subnormal scales and f16
    /// inputs (widened first, as the CPU's f16 entry points do).
    #[test]
    fn header_q8_quantiser_writes_the_cpu_q8block_bytes() {
        use weightlift_kernels::cpu::matvec::quantize_q8_blocks;
        let mut rng = Rng(0x0a8);
        let mut x = rng.vec(32 * 64, 4.0);
        x[3] = f32::NAN; // ignored by amax, quantises to 0
        x[32 + 7] = f32::INFINITY; // d = inf, 1/d = 0: inf * 0 is NaN, so every q is 0
        x[64..96].fill(-0.0);
        for (i, v) in x[96..128].iter_mut().enumerate() {
            *v = f32::from_bits(1 + i as u32); // subnormal amax: d = 0 or 1/d = inf
        }
        x[128] = 1e-40;
        x[160..192].fill(f32::NAN);
        x[192 + 5] = 3e38;
        x[224] = f32::NEG_INFINITY;
        let want: Vec<u8> = quantize_q8_blocks(&x)
            .iter()
            .flat_map(q8_block_bytes)
            .collect();
        let mut got = vec![0u8; want.len()];
        host_shim::q8_quantize(host_shim::Act::F32(&x), &mut got).unwrap();
        for (k, (g, w)) in got.chunks_exact(40).zip(want.chunks_exact(40)).enumerate() {
            assert_eq!(g, w, "block {k}: header vs cpu quantize_q8_blocks");
        }
        let x16: Vec<u16> = x
            .iter()
            .map(|v| half::f16::from_f32(*v).to_bits())
            .collect();
        let xw: Vec<f32> = x16
            .iter()
            .map(|h| half::f16::from_bits(*h).to_f32())
            .collect();
        let want: Vec<u8> = quantize_q8_blocks(&xw)
            .iter()
            .flat_map(q8_block_bytes)
            .collect();
        host_shim::q8_quantize(host_shim::Act::F16(&x16), &mut got).unwrap();
        assert_eq!(got, want, "f16 activations");
    }

    /// Per 32-value group `g` of a row of `ty`, the min/offset `m` the group's values carry
    /// (w = d·q + m): Q4_1's m, Q4_K's −dmin·m; 0 for the symmetric types.
    fn group_min(ty: QuantType, row: &[u8], g: usize) -> f64 {
        let f16 =
            |b: &[u8], o: usize| f64::from(half::f16::from_le_bytes([b[o], b[o + 1]]).to_f32());
        match ty {
            QuantType::Q4_1 => f16(&row[g * 20..], 2),
            QuantType::Q5_1 => f16(&row[g * 24..], 2),
            QuantType::Q4_K => {
                let blk = &row[(g / 8) * 144..];
                let (j, q) = (g % 8, &blk[4..16]);
                let m = if j < 4 {
                    q[j + 4] & 63
                } else {
                    (q[j + 4] >> 4) | ((q[j] >> 6) << 4)
                };
                -f16(blk, 2) * f64::from(m)
            }
            _ => 0.0,
        }
    }

    /// The Q8-mode kernels' arithmetic replayed on the host (8 lanes per row, dp4a's integer
    /// sums, the shuffle tree): bit for bit the CPU's scalar Q8 mode for every token, and within
    /// 1e-5 of an f64 dot of gguf-py's dequantised weights with the Q8-dequantised activations
    /// (d·q), relative to Σ(|w| + 2|m|)·|x|, m the group's offset, which bounds every partial
    /// sum the f32 lanes see (8 groups per lane, so about 16 roundings; 1e-5 is ~80 ulps).
    #[test]
    fn header_q8_matmul_equals_the_cpu_q8_mode_and_an_f64_dot() {
        use weightlift_kernels::cpu::matvec::matvec_with;
        use weightlift_kernels::{Isa, MatvecMode};
        let mut rng = Rng(0x0a8d07);
        for name in ["q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_k", "q6_k"] {
            let f = load(name);
            let cols = 256;
            let rows = f.want.len() / cols;
            let row_bytes = f.raw.len() / rows;
            let n_tok = 5;
            let x = rng.vec(cols * n_tok, 2.0);
            let mut xq = vec![0u8; n_tok * cols / 32 * 40];
            host_shim::q8_quantize(host_shim::Act::F32(&x), &mut xq).unwrap();
            let mut y = vec![0f32; rows * n_tok];
            host_shim::q8_matmul(f.ty, &f.raw, &xq, &mut y, rows, cols).unwrap();
            let blocks = q8_blocks(&xq);
            for t in 0..n_tok {
                let mut cpu = vec![0f32; rows];
                let xt = &x[t * cols..(t + 1) * cols];
                matvec_with(
                    Isa::Scalar,
                    MatvecMode::Q8,
                    f.ty,
                    &f.raw,
                    rows,
                    cols,
                    xt,
                    &mut cpu,
                )
                .unwrap();
                for r in 0..rows {
                    let g = y[t * rows + r];
                    assert!(
                        same(g, cpu[r]),
                        "{name} token {t} row {r}: header {g:e}, cpu scalar q8 {:e}",
                        cpu[r]
                    );
                    let (mut s, mut mag) = (0f64, 0f64);
                    for c in 0..cols {
                        let (d, qs) = &blocks[t * cols / 32 + c / 32];
                        let xv = f64::from(*d) * f64::from(qs[c % 32]);
                        let w = f64::from(f.want[r * cols + c]);
                        let m = group_min(f.ty, &f.raw[r * row_bytes..], c / 32);
                        s += w * xv;
                        mag += (w.abs() + 2.0 * m.abs()) * xv.abs();
                    }
                    assert!(
                        (f64::from(g) - s).abs() <= 1e-5 * mag + 1e-30,
                        "{name} token {t} row {r}: {g} vs f64 {s} (magnitude {mag})"
                    );
                }
            }
        }
        // no Q8 kernel for this weight type: a typed error naming it
        let q2 = vec![0u8; QuantType::Q2_K.block_bytes()];
        let err = host_shim::q8_matmul(QuantType::Q2_K, &q2, &[0u8; 320], &mut [0.0], 1, 256)
            .unwrap_err();
        assert!(err.to_string().contains("q2_k"), "{err}");
    }

    /// Decode's Q8 kernel (`q8_matvec_{type}`: 32 lane chains per warp, 1, 2 or 4 warps a row,
    /// each warp's butterfly, the warps' sums in order), replayed on the host: its word loads
    /// and its byte-by-byte path give the same bits, and every row lies within 1e-5 of an f64 dot of gguf-py's dequantised weights with the
    /// Q8-dequantised activations, relative to Σ(|w| + 2|m|)·|x| (as the prompt kernel's). Rows
    /// of 1,024 values, so each lane's chain is several groups long and the unrolled loads run
    /// past the row's end in the last pass (32 groups; with one warp a row, 4 a pass of 16).
    #[test]
    fn header_q8_matvec_reads_words_and_matches_an_f64_dot() {
        let mut rng = Rng(0x0a8d08);
        for name in ["q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_k", "q6_k"] {
            let f = load(name);
            let row_bytes_256 = f.ty.block_bytes() * 256 / f.ty.block_size();
            // four fixture rows of 256 values side by side make one row of 1,024
            let cols = 1024;
            let rows = f.raw.len() / row_bytes_256 / 4;
            let row_bytes = row_bytes_256 * 4;
            let raw = &f.raw[..rows * row_bytes];
            let want = &f.want[..rows * cols];
            let x = rng.vec(cols, 2.0);
            let mut xq = vec![0u8; cols / 32 * 40];
            host_shim::q8_quantize(host_shim::Act::F32(&x), &mut xq).unwrap();
            let blocks = q8_blocks(&xq);
            for wpr in [1, 2, 4] {
                let mut y = vec![0f32; rows];
                let mut y_bytes = vec![0f32; rows];
                host_shim::q8_matvec(f.ty, true, wpr, raw, &xq, &mut y, cols).unwrap();
                host_shim::q8_matvec(f.ty, false, wpr, raw, &xq, &mut y_bytes, cols).unwrap();
                for r in 0..rows {
                    assert!(
                        same(y[r], y_bytes[r]),
                        "{name} {wpr} warps row {r}: words {} bytes {}",
                        y[r],
                        y_bytes[r]
                    );
                    let (mut s, mut mag) = (0f64, 0f64);
                    for c in 0..cols {
                        let (d, qs) = &blocks[c / 32];
                        let xv = f64::from(*d) * f64::from(qs[c % 32]);
                        let w = f64::from(want[r * cols + c]);
                        let m = group_min(f.ty, &raw[r * row_bytes..], c / 32);
                        s += w * xv;
                        mag += (w.abs() + 2.0 * m.abs()) * xv.abs();
                    }
                    assert!(
                        (f64::from(y[r]) - s).abs() <= 1e-5 * mag + 1e-30,
                        "{name} {wpr} warps row {r}: {} vs f64 {s} (magnitude {mag})",
                        y[r]
                    );
                }
            }
        }
        let q2 = vec![0u8; QuantType::Q2_K.block_bytes()];
        let err = host_shim::q8_matvec(QuantType::Q2_K, true, 1, &q2, &[0u8; 320], &mut [0.0], 256)
            .unwrap_err();
        assert!(err.to_string().contains("q2_k"), "{err}");
    }

    /// Decode's wide-lane Q4_K and Q6_K kernels (`q8_wide_matvec_{type}`: a lane takes 64
    /// values a step, `kernels/wl_q8w.cuh`'s order) replayed on the host, on rows of 1,024 values (half the
    /// lanes of a warp idle), 4,096 (two units a lane at one warp a row) and 5,632 (a lane's
    /// second unrolled pass runs past the row's end), at 1, 2 and 4 warps a row: its 128-bit
    /// loads and its byte-by-byte path give the same bits, and every row lies within 1e-5 of an
    /// f64 dot of gguf-py's dequantised weights with the Q8-dequantised activations, relative
    /// to Σ(|w| + 2|m|)·|x| (the narrow decode kernel's bound), as do the CPU's scalar Q8 mode
    /// and the narrow kernel's twin on the same rows. Other weight types are a typed error.
    #[test]
    fn header_q8_wide_matvec_reads_words_and_matches_f64_and_the_cpu() {
        use weightlift_kernels::cpu::matvec::matvec_with;
        use weightlift_kernels::{Isa, MatvecMode};
        let mut rng = Rng(0x0a8d0b);
        for (name, cols) in ["q4_k", "q6_k"]
            .into_iter()
            .flat_map(|n| [1024usize, 4096, 5632].map(|c| (n, c)))
        {
            let f = load(name);
            let rows = 5;
            let (raw, want) = tiled_rows(&f, rows, cols);
            let row_bytes = raw.len() / rows;
            let x = rng.vec(cols, 2.0);
            let mut xq = vec![0u8; cols / 32 * 40];
            host_shim::q8_quantize(host_shim::Act::F32(&x), &mut xq).unwrap();
            let blocks = q8_blocks(&xq);
            let mut cpu = vec![0f32; rows];
            matvec_with(
                Isa::Scalar,
                MatvecMode::Q8,
                f.ty,
                &raw,
                rows,
                cols,
                &x,
                &mut cpu,
            )
            .unwrap();
            let mut narrow = vec![0f32; rows];
            host_shim::q8_matvec(f.ty, true, 1, &raw, &xq, &mut narrow, cols).unwrap();
            for wpr in [1, 2, 4] {
                let mut y = vec![0f32; rows];
                let mut y_bytes = vec![0f32; rows];
                host_shim::q8_wide_matvec(f.ty, true, wpr, &raw, &xq, &mut y, cols).unwrap();
                host_shim::q8_wide_matvec(f.ty, false, wpr, &raw, &xq, &mut y_bytes, cols).unwrap();
                for r in 0..rows {
                    let what = format!("{name} {rows}x{cols} {wpr} warps row {r}");
                    assert!(
                        same(y[r], y_bytes[r]),
                        "{what}: words {} bytes {}",
                        y[r],
                        y_bytes[r]
                    );
                    let (mut s, mut mag) = (0f64, 0f64);
                    for c in 0..cols {
                        let (d, qs) = &blocks[c / 32];
                        let xv = f64::from(*d) * f64::from(qs[c % 32]);
                        let w = f64::from(want[r * cols + c]);
                        let m = group_min(f.ty, &raw[r * row_bytes..], c / 32);
                        s += w * xv;
                        mag += (w.abs() + 2.0 * m.abs()) * xv.abs();
                    }
                    for (who, v) in [("wide", y[r]), ("cpu", cpu[r]), ("narrow", narrow[r])] {
                        assert!(
                            (f64::from(v) - s).abs() <= 1e-5 * mag + 1e-30,
                            "{what}: {who} {v} vs f64 {s} (magnitude {mag})"
                        );
                    }
                    assert!(
                        (f64::from(y[r]) - f64::from(cpu[r])).abs() <= 1e-5 * mag + 1e-30,
                        "{what}: wide {} vs cpu scalar q8 {} (magnitude {mag})",
                        y[r],
                        cpu[r]
                    );
                }
            }
        }
        let q5 = vec![0u8; QuantType::Q5_K.block_bytes()];
        let err =
            host_shim::q8_wide_matvec(QuantType::Q5_K, true, 1, &q5, &[0u8; 320], &mut [0.0], 256)
                .unwrap_err();
        assert!(err.to_string().contains("q5_k"), "{err}");
    }

    /// SwiGLU's product as the fused gate/up kernels and `swiglu_inplace_f32` make it
    /// (`WL_SILU_MUL`): bit for bit the CPU's scalar `swiglu` (the same expression over the
    /// same libm `expf`), and within 4e-7 relative (or 1e-36, below which e^-g overflows f32
    /// and silu is -0) of an f64 closed form, on gates from -100 to 100, and NaN in, NaN out.
    #[test]
    fn header_silu_mul_equals_the_cpu_scalar_swiglu_and_f64() {
        use weightlift_kernels::Isa;
        use weightlift_kernels::cpu::ops::swiglu_with;
        let mut rng = Rng(0x5117);
        let mut g: Vec<f32> = (0..4000).map(|i| (i as f32 - 2000.0) / 20.0).collect();
        g.extend(rng.vec(1000, 8.0));
        g.extend([
            0.0,
            -0.0,
            1e-30,
            -1e-30,
            88.7,
            -88.7,
            89.0,
            -104.0,
            f32::NAN,
        ]);
        let u: Vec<f32> = (0..g.len()).map(|_| rng.unit() * 3.0).collect();
        let (mut dev, mut cpu) = (vec![0f32; g.len()], vec![0f32; g.len()]);
        host_shim::silu_mul(&g, &u, &mut dev).unwrap();
        swiglu_with(Isa::Scalar, &g, &u, &mut cpu).unwrap();
        for i in 0..g.len() {
            assert!(
                same(dev[i], cpu[i]),
                "g {} u {}: header {} cpu {}",
                g[i],
                u[i],
                dev[i],
                cpu[i]
            );
            if g[i].is_nan() {
                assert!(dev[i].is_nan(), "NaN gate gives {}", dev[i]);
                continue;
            }
            let (gf, uf) = (f64::from(g[i]), f64::from(u[i]));
            let want = gf / (1.0 + (-gf).exp()) * uf;
            assert!(
                (f64::from(dev[i]) - want).abs() <= 4e-7 * want.abs() + 1e-36,
                "g {} u {}: {} vs f64 {want}",
                g[i],
                u[i],
                dev[i]
            );
        }
        let err = host_shim::silu_mul(&g[..3], &u[..2], &mut dev[..3]).unwrap_err();
        assert!(err.to_string().contains("2 up"), "{err}");
    }

    /// RoPE fused with the cache store (`rope_kv_store_{format}`) replayed on the host, unit by
    /// unit with the header's functions: for every cache dtype (q8 keys with q4 values too),
    /// both pairings, whole and partial rotary dims, and heads of 80 values (quantised groups
    /// of 32 that straddle two heads), the rotated queries and both caches' bytes are bit for
    /// bit what the CPU backend's RoPE and cache stores give (the same expression over the
    /// same libm `cosf`/`sinf`).
    #[test]
    fn header_rope_kv_store_equals_the_cpu_rope_and_stores() {
        use weightlift_kernels::{Backend, CpuBackend, Op, RopeParams, RopeStyle, rope_inv_freqs};
        let mut rng = Rng(0x70e4);
        let b = CpuBackend::new();
        let upload = |bytes: &[u8]| {
            let mut buf = b.alloc(bytes.len()).unwrap();
            b.copy_from_host(bytes, &mut buf, 0).unwrap();
            buf
        };
        let bytes_of = |v: &[f32]| -> Vec<u8> { v.iter().flat_map(|x| x.to_le_bytes()).collect() };
        let download = |buf: &weightlift_kernels::CpuBuffer, n: usize| -> Vec<u8> {
            let mut out = vec![0u8; n];
            b.copy_to_host(buf, 0, &mut out).unwrap();
            out
        };
        let pos = [0i32, 7, 1000];
        let n_tok = pos.len();
        let pairs = [
            (KvFormat::F32, KvFormat::F32),
            (KvFormat::F16, KvFormat::F16),
            (KvFormat::BF16, KvFormat::BF16),
            (KvFormat::E4M3, KvFormat::E4M3),
            (KvFormat::Q8, KvFormat::Q8),
            (KvFormat::Q4, KvFormat::Q4),
            (KvFormat::Q8, KvFormat::Q4),
        ];
        for (head_dim, n_dims) in [(64usize, 64usize), (64, 32), (80, 80)] {
            let (n_heads, kv_heads) = (4, 2);
            let kvn = n_tok * kv_heads * head_dim;
            // LongRoPE's attention factor (1.5) as well as plain RoPE's 1
            for (style, attn_factor) in [
                (RopeStyle::Normal, 1.0),
                (RopeStyle::Neox, 1.0),
                (RopeStyle::Normal, 1.5),
                (RopeStyle::Neox, 1.5),
            ] {
                let params = RopeParams {
                    style,
                    head_dim,
                    n_dims,
                    freq_base: 10000.0,
                    freq_scale: 1.0,
                    attn_factor,
                };
                let freqs = rope_inv_freqs(&params, None).unwrap();
                for (kf, vf) in pairs {
                    let what = format!(
                        "{kf:?}/{vf:?} head_dim {head_dim} n_dims {n_dims} {style:?} \
                         attn_factor {attn_factor}"
                    );
                    let q = rng.vec(n_tok * n_heads * head_dim, 2.0);
                    let k = rng.vec(kvn, 2.0);
                    let v = rng.vec(kvn, 2.0);
                    // the twin
                    let (mut tq, mut tkc, mut tvc) = (
                        q.clone(),
                        vec![0u8; kf.byte_at(kvn)],
                        vec![0u8; vf.byte_at(kvn)],
                    );
                    host_shim::rope_kv_store(
                        &params,
                        (n_heads, kv_heads),
                        (kf, vf),
                        &mut tq,
                        &k,
                        &v,
                        &pos,
                        &freqs,
                        &mut tkc,
                        &mut tvc,
                        0,
                    )
                    .unwrap();
                    // the CPU backend's four ops
                    let mut qb = upload(&bytes_of(&q));
                    let mut kb = upload(&bytes_of(&k));
                    let vb = upload(&bytes_of(&v));
                    let pb = upload(&pos.iter().flat_map(|p| p.to_le_bytes()).collect::<Vec<_>>());
                    let fb = upload(&bytes_of(&freqs));
                    let mut kc = b.alloc(kf.byte_at(kvn)).unwrap();
                    let mut vc = b.alloc(vf.byte_at(kvn)).unwrap();
                    b.run(Op::RopeKvStore {
                        params,
                        n_tok,
                        n_heads,
                        kv_heads,
                        q: &mut qb,
                        k: &mut kb,
                        v: &vb,
                        positions: &pb,
                        inv_freqs: &fb,
                        k_format: kf,
                        v_format: vf,
                        k_cache: &mut kc,
                        v_cache: &mut vc,
                        cache_rows: None,
                    })
                    .unwrap();
                    assert_eq!(download(&qb, q.len() * 4), bytes_of(&tq), "{what}: queries");
                    assert_eq!(download(&kc, tkc.len()), tkc, "{what}: key cache bytes");
                    assert_eq!(download(&vc, tvc.len()), tvc, "{what}: value cache bytes");
                    // each token at the row of its position in caches of 1,001 rows
                    let cached = 1001 * kv_heads * head_dim;
                    let (mut tq, mut tkc, mut tvc) = (
                        q.clone(),
                        vec![0u8; kf.byte_at(cached)],
                        vec![0u8; vf.byte_at(cached)],
                    );
                    host_shim::rope_kv_store(
                        &params,
                        (n_heads, kv_heads),
                        (kf, vf),
                        &mut tq,
                        &k,
                        &v,
                        &pos,
                        &freqs,
                        &mut tkc,
                        &mut tvc,
                        1001,
                    )
                    .unwrap();
                    let mut qb = upload(&bytes_of(&q));
                    let mut kb = upload(&bytes_of(&k));
                    let mut kc = b.alloc(kf.byte_at(cached)).unwrap();
                    let mut vc = b.alloc(vf.byte_at(cached)).unwrap();
                    b.run(Op::RopeKvStore {
                        params,
                        n_tok,
                        n_heads,
                        kv_heads,
                        q: &mut qb,
                        k: &mut kb,
                        v: &vb,
                        positions: &pb,
                        inv_freqs: &fb,
                        k_format: kf,
                        v_format: vf,
                        k_cache: &mut kc,
                        v_cache: &mut vc,
                        cache_rows: Some(1001),
                    })
                    .unwrap();
                    assert_eq!(download(&qb, q.len() * 4), bytes_of(&tq), "{what}: queries");
                    assert_eq!(download(&kc, tkc.len()), tkc, "{what}: key cache at rows");
                    assert_eq!(download(&vc, tvc.len()), tvc, "{what}: value cache at rows");
                }
            }
        }
        // quantised caches need whole groups of 32 keys
        let params = RopeParams {
            style: RopeStyle::Neox,
            head_dim: 8,
            n_dims: 8,
            freq_base: 1e4,
            freq_scale: 1.0,
            attn_factor: 1.0,
        };
        let err = host_shim::rope_kv_store(
            &params,
            (1, 1),
            (KvFormat::Q8, KvFormat::Q8),
            &mut [0.0; 8],
            &[0.0; 8],
            &[0.0; 8],
            &[0],
            &[0.0; 4],
            &mut [0u8; 0],
            &mut [0u8; 0],
            0,
        )
        .unwrap_err();
        assert!(err.to_string().contains("whole groups of 32"), "{err}");
    }

    /// Decode's fused gate/up kernels (`swiglu_matvec_{f16,bf16,f32}_{act}`,
    /// `swiglu_q8_matvec_{type}`) replayed on the host: each row's gate and up sums by the
    /// matvec kernels' own replays at the threads (warps) a row the launch takes on a 132-SM
    /// device, then `WL_SILU_MUL`. Every output lies within the bound the sums' errors allow of
    /// `silu(g)·u` in f64 from gguf-py's dequantised weights (or the float weights as the `half`
    /// crate reads them), with the Q8-dequantised activations in Q8 mode: `1.1·|u|·εg +
    /// |silu(g)|·εu` plus 4e-7 relative, ε the matvec bound (1e-5 of Σ|w·x|, or of
    /// Σ(|w| + 2|m|)·|x| in Q8 mode) and 1.1 the most |silu'| reaches; and so does the CPU
    /// backend's `MatmulSwiGlu`, the reference the engine runs on the host. For Q4_K, the wide
    /// lanes' fused kernel (`swiglu_q8_wide_matvec_q4_k`, sums of `q8_wide_matvec_q4_k`) too.
    #[test]
    fn header_fused_swiglu_matvec_meets_f64_as_the_cpu_op_does() {
        use weightlift_kernels::sources::{float_row_threads, q8_matvec_warps};
        use weightlift_kernels::{
            Backend, CpuBackend, FloatType, MatvecMode, Op, Product, Result as KResult,
        };
        fn cpu_op(
            ty: QuantType,
            mode: MatvecMode,
            [wg, wu]: [&[u8]; 2],
            x: &[f32],
            rows: usize,
        ) -> KResult<Vec<f32>> {
            let b = CpuBackend::new();
            let up = |bytes: &[u8]| -> KResult<_> {
                let mut buf = b.alloc(bytes.len())?;
                b.copy_from_host(bytes, &mut buf, 0)?;
                Ok(buf)
            };
            let xbytes: Vec<u8> = x.iter().flat_map(|v| v.to_le_bytes()).collect();
            let (gw, uw, xb) = (up(wg)?, up(wu)?, up(&xbytes)?);
            let (mut gy, mut uy) = (b.alloc(rows * 4)?, b.alloc(rows * 4)?);
            b.run(Op::MatmulSwiGlu {
                mode,
                act: FloatType::F32,
                cols: x.len(),
                n_tok: 1,
                max_dq_size: 1 << 20,
                x: &xb,
                gate: Product {
                    ty,
                    rows,
                    w: &gw,
                    y: &mut gy,
                },
                up: Product {
                    ty,
                    rows,
                    w: &uw,
                    y: &mut uy,
                },
            })?;
            let mut out = vec![0u8; rows * 4];
            b.copy_to_host(&gy, 0, &mut out)?;
            Ok(out
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect())
        }
        // (sum, bound) of each row in f64
        let check = |what: &str, got: &[f32], g: &[(f64, f64)], u: &[(f64, f64)]| {
            for r in 0..got.len() {
                let ((gs, ge), (us, ue)) = (g[r], u[r]);
                let silu = gs / (1.0 + (-gs).exp());
                let want = silu * us;
                let bound = 1.1 * us.abs() * ge + silu.abs() * ue + 4e-7 * want.abs() + 1e-30;
                assert!(
                    (f64::from(got[r]) - want).abs() <= bound,
                    "{what} row {r}: {} vs f64 {want} (bound {bound})",
                    got[r]
                );
            }
        };
        let mut rng = Rng(0x6a7e);
        // float weights: 96 rows of 1,004 values (a tail of 4 values past whole 16-byte chunks
        // in f16 and bf16) and 2,048 of 256 (other threads-a-row choices)
        for (rows, cols) in [(96usize, 1004usize), (2048, 256)] {
            for ty in [QuantType::F16, QuantType::BF16, QuantType::F32] {
                let mats = [
                    float_weights(ty, &rng.vec(rows * cols, 0.5)),
                    float_weights(ty, &rng.vec(rows * cols, 0.5)),
                ];
                let x = rng.vec(cols, 1.0);
                let tpr = float_row_threads(rows, cols, ty.block_bytes(), 1, 132);
                let mut sums = Vec::new();
                let mut ys = Vec::new();
                for (raw, w) in &mats {
                    let mut y = vec![0f32; rows];
                    host_shim::float_matmul(
                        ty,
                        raw,
                        host_shim::Act::F32(&x),
                        &mut y,
                        rows,
                        cols,
                        tpr,
                        false,
                    )
                    .unwrap();
                    ys.push(y);
                    sums.push(
                        (0..rows)
                            .map(|r| {
                                let (mut s, mut m) = (0f64, 0f64);
                                for c in 0..cols {
                                    let p = f64::from(w[r * cols + c]) * f64::from(x[c]);
                                    s += p;
                                    m += p.abs();
                                }
                                (s, 1e-5 * m)
                            })
                            .collect::<Vec<_>>(),
                    );
                }
                let mut fused = vec![0f32; rows];
                host_shim::silu_mul(&ys[0], &ys[1], &mut fused).unwrap();
                let what = format!("{ty} {rows}x{cols} tpr {tpr}");
                check(&what, &fused, &sums[0], &sums[1]);
                let cpu =
                    cpu_op(ty, MatvecMode::Exact, [&mats[0].0, &mats[1].0], &x, rows).unwrap();
                check(&format!("cpu {what}"), &cpu, &sums[0], &sums[1]);
            }
        }
        // Q8 mode: the fixture's rows of 256 values, the first half the gate, the second the up
        for name in ["q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_k", "q6_k"] {
            let f = load(name);
            let cols = 256;
            let row_bytes = f.ty.block_bytes() * cols / f.ty.block_size();
            let rows = f.raw.len() / row_bytes / 2;
            let x = rng.vec(cols, 2.0);
            let mut xq = vec![0u8; cols / 32 * 40];
            host_shim::q8_quantize(host_shim::Act::F32(&x), &mut xq).unwrap();
            let blocks = q8_blocks(&xq);
            let wpr = q8_matvec_warps(rows, cols, 132);
            let mut ys = Vec::new();
            let mut sums = Vec::new();
            for m in 0..2 {
                let raw = &f.raw[m * rows * row_bytes..(m + 1) * rows * row_bytes];
                let want = &f.want[m * rows * cols..(m + 1) * rows * cols];
                let mut y = vec![0f32; rows];
                host_shim::q8_matvec(f.ty, true, wpr, raw, &xq, &mut y, cols).unwrap();
                ys.push(y);
                sums.push(
                    (0..rows)
                        .map(|r| {
                            let (mut s, mut mag) = (0f64, 0f64);
                            for c in 0..cols {
                                let (d, qs) = &blocks[c / 32];
                                let xv = f64::from(*d) * f64::from(qs[c % 32]);
                                let w = f64::from(want[r * cols + c]);
                                let gm = group_min(f.ty, &raw[r * row_bytes..], c / 32);
                                s += w * xv;
                                mag += (w.abs() + 2.0 * gm.abs()) * xv.abs();
                            }
                            (s, 1e-5 * mag)
                        })
                        .collect::<Vec<_>>(),
                );
            }
            let mut fused = vec![0f32; rows];
            host_shim::silu_mul(&ys[0], &ys[1], &mut fused).unwrap();
            let what = format!("{name} {rows}x{cols} {wpr} warps a row");
            check(&what, &fused, &sums[0], &sums[1]);
            let halves = [
                &f.raw[..rows * row_bytes],
                &f.raw[rows * row_bytes..2 * rows * row_bytes],
            ];
            let cpu = cpu_op(f.ty, MatvecMode::Q8, halves, &x, rows).unwrap();
            check(&format!("cpu {what}"), &cpu, &sums[0], &sums[1]);
            // the wide lanes (`swiglu_q8_wide_matvec_{type}`): each row's sums the wide
            // product's own, at its warps a row
            if weightlift_kernels::sources::Q8_WIDE_WEIGHT_TYPES.contains(&f.ty) {
                let wpr = weightlift_kernels::sources::q8_wide_matvec_warps(rows, cols, 132);
                let mut wide = Vec::new();
                for half in halves {
                    let mut y = vec![0f32; rows];
                    host_shim::q8_wide_matvec(f.ty, true, wpr, half, &xq, &mut y, cols).unwrap();
                    wide.push(y);
                }
                let mut fused = vec![0f32; rows];
                host_shim::silu_mul(&wide[0], &wide[1], &mut fused).unwrap();
                check(&format!("wide {what}"), &fused, &sums[0], &sums[1]);
            }
        }
    }

    /// The dequantised path (`dequantize_{type}_f32` into a chunk of rows bounded by
    /// `max_dq_size`, then `gemm_{act}` block by block and phase by phase), replayed on the host
    /// on sizes that are multiples of neither the 16-value K tile nor the 64 × 64 block, with
    /// the launch's grid.y and with a grid.y of 1 (token blocks striding): every output is
    /// written, equals one left-to-right FMA chain over k (the order the kernel documents, so
    /// tiles, blocks and chunks change nothing), and lies within 1e-5 · Σ|w·x| of an f64 dot of
    /// gguf-py's (or the given f32) weights.
    #[test]
    fn header_dequantised_gemm_in_chunks_matches_an_fma_chain_and_f64() {
        use host_shim::Act;
        use weightlift_kernels::sources::{GEMM_BLOCK_ROWS, GEMM_BLOCK_TOKENS, dq_chunk_rows};
        let mut rng = Rng(0x6e33);
        let f32_w = rng.vec(150 * 45, 1.5);
        let f32_raw: Vec<u8> = f32_w.iter().flat_map(|v| v.to_le_bytes()).collect();
        let q8 = load("q8_0");
        let q4k = load("q4_k");
        // (name, type, raw rows, gguf-py's values of them, rows, cols)
        type Case<'a> = (&'a str, QuantType, &'a [u8], &'a [f32], usize, usize);
        let cases: Vec<Case<'_>> = vec![
            ("f32", QuantType::F32, &f32_raw, &f32_w, 150, 45),
            // 13 of the fixture's rows of 96 values: an odd row count, 6 whole K tiles
            (
                "q8_0",
                q8.ty,
                &q8.raw[..13 * 3 * 34],
                &q8.want[..13 * 96],
                13,
                96,
            ),
            (
                "q4_k",
                q4k.ty,
                &q4k.raw[..11 * 144],
                &q4k.want[..11 * 256],
                11,
                256,
            ),
        ];
        for (name, ty, raw, want_w, rows, cols) in cases {
            let row_bytes = raw.len() / rows;
            for n_tok in [1usize, 19, 131] {
                let x = rng.vec(n_tok * cols, 1.0);
                let x16: Vec<u16> = x
                    .iter()
                    .map(|v| half::f16::from_f32(*v).to_bits())
                    .collect();
                let xw: Vec<f32> = x16
                    .iter()
                    .map(|h| half::f16::from_bits(*h).to_f32())
                    .collect();
                for max_dq in [cols * 5, cols * 70, 1 << 20] {
                    let chunk = dq_chunk_rows(rows, cols, max_dq).unwrap();
                    assert!(chunk * cols <= max_dq && chunk >= 1 && chunk <= rows);
                    let launch_y = n_tok.div_ceil(GEMM_BLOCK_TOKENS);
                    for (act, xr, grid_y) in [
                        (Act::F32(&x), &x, launch_y),
                        (Act::F16(&x16), &xw, launch_y),
                        (Act::F32(&x), &x, 1),
                    ] {
                        let mut y = vec![f32::NAN; rows * n_tok];
                        let mut wd = vec![0f32; chunk * cols];
                        for r0 in (0..rows).step_by(chunk) {
                            let nr = chunk.min(rows - r0);
                            let src = &raw[r0 * row_bytes..(r0 + nr) * row_bytes];
                            host_shim::dequantize_f32(ty, src, &mut wd[..nr * cols]).unwrap();
                            host_shim::gemm(&wd[..nr * cols], act, &mut y, cols, r0, rows, grid_y)
                                .unwrap();
                        }
                        for t in 0..n_tok {
                            for r in 0..rows {
                                let g = y[t * rows + r];
                                let wr = &want_w[r * cols..(r + 1) * cols];
                                let xt = &xr[t * cols..(t + 1) * cols];
                                let chain =
                                    wr.iter().zip(xt).fold(0f32, |a, (w, v)| w.mul_add(*v, a));
                                assert!(
                                    same(g, chain),
                                    "{name} max_dq {max_dq} token {t} row {r}: {g:e} vs fma chain {chain:e}"
                                );
                                let s: f64 = wr
                                    .iter()
                                    .zip(xt)
                                    .map(|(w, v)| f64::from(*w) * f64::from(*v))
                                    .sum();
                                let m: f64 = wr
                                    .iter()
                                    .zip(xt)
                                    .map(|(w, v)| (f64::from(*w) * f64::from(*v)).abs())
                                    .sum();
                                assert!(
                                    (f64::from(g) - s).abs() <= 1e-5 * m + 1e-30,
                                    "{name} token {t} row {r}: {g} vs f64 {s}"
                                );
                            }
                        }
                    }
                }
            }
        }
        // chunk plans: whole rows within max_dq_size, 16-row tiles, none when a row cannot fit
        assert_eq!(dq_chunk_rows(37, 45, 45 * 5), Some(5));
        assert_eq!(dq_chunk_rows(37, 45, 45 * 20), Some(20));
        assert_eq!(dq_chunk_rows(37, 45, 45 * 37), Some(37));
        assert_eq!(dq_chunk_rows(200, 45, 45 * 150), Some(2 * GEMM_BLOCK_ROWS));
        assert_eq!(dq_chunk_rows(150, 45, 45 * 150), Some(150));
        assert_eq!(dq_chunk_rows(37, 45, 44), None);
        assert_eq!(dq_chunk_rows(37, 0, 1000), None);
        assert_eq!(dq_chunk_rows(4096, 4096, 512 << 20), Some(4096));
        assert_eq!(dq_chunk_rows(1 << 17, 4096, 512 << 20), Some(4096));
    }

    /// The launch grid's heads per block (Rust) is the kernel's (`wl_att_block_heads`) for
    /// every head the kernel takes.
    #[test]
    fn attention_block_heads_are_the_kernels() {
        for hd in 1..=weightlift_kernels::sources::ATTENTION_MAX_HEAD_DIM {
            assert_eq!(
                host_shim::attention_block_heads(hd),
                weightlift_kernels::sources::attention_block_heads(hd),
                "head_dim {hd}"
            );
        }
    }

    /// The CPU backend's attention over the cache rows as stored (`rows` of them, the key at
    /// position `p` in row `p % rows`), with the shape's window and soft-cap.
    #[allow(clippy::too_many_arguments)]
    fn cpu_attention(
        (k_format, v_format): (KvFormat, KvFormat),
        (shape, rows): (weightlift_kernels::cpu::attention::AttnShape, usize),
        q: &[f32],
        k: &[u8],
        v: &[u8],
    ) -> Vec<f32> {
        use weightlift_kernels::{Backend, CpuBackend, Op};
        let b = CpuBackend::new();
        let up = |bytes: &[u8]| {
            let mut buf = b.alloc(bytes.len()).unwrap();
            b.copy_from_host(bytes, &mut buf, 0).unwrap();
            buf
        };
        let (qb, kb, vb) = (up(bytemuck::cast_slice(q)), up(k), up(v));
        let mut out = b.alloc(q.len() * 4).unwrap();
        b.run(Op::Attention {
            window: shape.window,
            softcap: shape.softcap,
            cache_rows: rows,
            k_format,
            v_format,
            n_heads: shape.n_heads,
            kv_heads: shape.kv_heads,
            head_dim: shape.head_dim,
            n_q: shape.n_q,
            start: shape.start,
            scale: shape.scale,
            tile: 256,
            f16_operands: shape.f16_operands,
            q: &qb,
            k: &kb,
            v: &vb,
            out: &mut out,
            scratch: None,
            start_at: None,
            q8_next: false,
        })
        .unwrap();
        let mut bytes = vec![0u8; q.len() * 4];
        b.copy_to_host(&out, 0, &mut bytes).unwrap();
        bytemuck::cast_slice(&bytes).to_vec()
    }

    /// The split attention (`attention_{format}` with its keys split across blocks, then
    /// `attention_reduce_f32`), replayed on the host, against the CPU backend's attention over
    /// the same stored rows: every cache format, heads of 64 and 128 (and 40 for the float
    /// caches), GQA ratios 1, 3, 8 and 12 (wider than one block's heads), splits that divide
    /// the keys and splits that do not, splits left empty for the early queries of a prompt
    /// and for every query (more splits than keys), with and without f16 operands. Within
    /// 2e-6 (1e-5 past 64 keys, whose sums are longer; 2e-3 with f16 operands, whose weights
    /// are rounded against each split's own running maximum).
    #[test]
    fn split_attention_matches_the_cpu_backend() {
        use weightlift_kernels::cpu::attention::AttnShape;
        let mut rng = Rng(0x5917);
        let formats = [
            (KvFormat::F32, KvFormat::F32),
            (KvFormat::F16, KvFormat::F16),
            (KvFormat::BF16, KvFormat::BF16),
            (KvFormat::E4M3, KvFormat::E4M3),
            (KvFormat::Q8, KvFormat::Q8),
            (KvFormat::Q4, KvFormat::Q4),
            (KvFormat::Q8, KvFormat::Q4),
        ];
        // (n_q, start, splits): 1 split is the unsplit kernel; 100 keys in 3 and 7 splits leave
        // a short last split; 4 prompt queries from 0 in 4 splits see 1 key a split, so query 0
        // meets three empty splits; 6 splits of 4 keys leave two empty for every query
        let calls = [
            (1, 0, 1),
            (1, 99, 1),
            (1, 99, 3),
            (1, 99, 7),
            (1, 299, 10),
            (3, 97, 7),
            (4, 0, 4),
            (4, 0, 6),
            (2, 40, 128),
        ];
        let mut checked = 0;
        for (nh, kvh) in [(4, 4), (6, 2), (8, 1), (12, 1)] {
            for hd in [40, 64, 128] {
                for &(n_q, start, splits) in &calls {
                    let rows = start + n_q;
                    let q = rng.vec(n_q * nh * hd, 2.0);
                    let kx = rng.vec(rows * kvh * hd, 2.0);
                    let vx = rng.vec(rows * kvh * hd, 1.0);
                    for &(kf, vf) in &formats {
                        if hd % 32 != 0 && (kf.quant().is_some() || kf == KvFormat::E4M3) {
                            continue;
                        }
                        let mut k = vec![0u8; kf.byte_at(kx.len())];
                        let mut v = vec![0u8; vf.byte_at(vx.len())];
                        kv_encode(kf, &kx, &mut k).unwrap();
                        kv_encode(vf, &vx, &mut v).unwrap();
                        for f16_operands in [false, true] {
                            let shape = AttnShape::new(
                                nh,
                                kvh,
                                hd,
                                n_q,
                                start,
                                1.0 / (hd as f32).sqrt(),
                                f16_operands,
                            )
                            .unwrap();
                            let want = cpu_attention((kf, vf), (shape, rows), &q, &k, &v);
                            // the position given at launch, then read from the device with the
                            // splits cut over a cache of 45 more rows (the later splits empty)
                            for span in [0, rows + 45] {
                                let mut got = vec![f32::NAN; q.len()];
                                host_shim::attention(
                                    kf,
                                    vf,
                                    shape,
                                    (splits, span, rows),
                                    &q,
                                    &k,
                                    &v,
                                    &mut got,
                                )
                                .unwrap();
                                let tol = match (f16_operands, rows > 64) {
                                    (true, _) => 2e-3,
                                    (false, false) => 2e-6,
                                    (false, true) => 1e-5,
                                };
                                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                                    assert!(
                                        (g - w).abs() <= tol,
                                        "{kf:?}/{vf:?} {nh}/{kvh} heads of {hd}, n_q {n_q} \
                                         start {start} in {splits} splits over {span} keys, \
                                         f16 ops {f16_operands}: value {i}: twin {g}, cpu {w}"
                                    );
                                }
                                checked += 1;
                            }
                        }
                    }
                }
            }
        }
        assert_eq!(checked, 2 * 4 * 9 * 2 * (3 + 7 + 7));
    }

    /// The twin refuses what the kernel does not take, naming it.
    #[test]
    fn split_attention_refuses_shapes_outside_the_kernel() {
        use weightlift_kernels::cpu::attention::AttnShape;
        let shape = AttnShape::new(2, 1, 64, 1, 0, 0.125, false).unwrap();
        let (q, kv, mut out) = (vec![0f32; 128], vec![0u8; 64 * 4], vec![0f32; 128]);
        let run = |splits, shape, out: &mut [f32]| {
            host_shim::attention(
                KvFormat::F32,
                KvFormat::F32,
                shape,
                (splits, 0, 1),
                &q,
                &kv,
                &kv,
                out,
            )
            .unwrap_err()
            .to_string()
        };
        let e = run(0, shape, &mut out);
        assert!(e.contains("0 splits: the kernel takes 1 to 128"), "{e}");
        let e = run(129, shape, &mut out);
        assert!(e.contains("129 splits"), "{e}");
        let e = run(1, shape, &mut out[..127]);
        assert!(e.contains("host attention output values"), "{e}");
        let wide = AttnShape::new(2, 1, 320, 1, 0, 0.125, false).unwrap();
        let e = run(1, wide, &mut out);
        assert!(e.contains("head_dim 320"), "{e}");
        // a position read from the device must leave its queries inside the span
        let late = AttnShape::new(2, 1, 64, 1, 4, 0.125, false).unwrap();
        let kv = vec![0u8; 5 * 64 * 4];
        let e = host_shim::attention(
            KvFormat::F32,
            KvFormat::F32,
            late,
            (1, 4, 5),
            &q,
            &kv,
            &kv,
            &mut out,
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("1 queries from 4 past a span of 4 keys"), "{e}");
    }

    /// A sliding-window layer's ring (`rows` rows, the key at position `p` in row `p % rows`)
    /// gives the kernels' replays, decode (split over blocks, with its position given and read
    /// from the device) and prompt, the bits they give over a cache holding every position, and
    /// the CPU backend's attention the same; the replays read the window and soft-cap as the
    /// kernels do (within the bounds of `split_attention_matches_the_cpu_backend` of the CPU
    /// backend's attention).
    #[test]
    fn attention_over_a_ring_replays_attention_over_every_position() {
        use weightlift_kernels::cpu::attention::AttnShape;
        let mut rng = Rng(0x21a6);
        let (nh, kvh, hd) = (4, 2, 64);
        let kvd = kvh * hd;
        // (window, ring rows, queries, first position, splits)
        for (window, ring, n_q, start, splits) in [
            (8, 16, 1, 57, 1),
            (8, 16, 1, 57, 5),
            (8, 16, 5, 60, 3),
            (8, 40, 24, 90, 1),
            (32, 64, 24, 250, 1),
        ] {
            let keys = start + n_q;
            let q = rng.vec(n_q * nh * hd, 2.0);
            let kx = rng.vec(keys * kvd, 2.0);
            let vx = rng.vec(keys * kvd, 1.0);
            for (kf, vf) in [(KvFormat::F16, KvFormat::F16), (KvFormat::Q8, KvFormat::Q4)] {
                let enc = |x: &[f32], f: KvFormat| {
                    let mut out = vec![0u8; f.byte_at(x.len())];
                    kv_encode(f, x, &mut out).unwrap();
                    out
                };
                let (kfull, vfull) = (enc(&kx, kf), enc(&vx, vf));
                let ring_of = |full: &[u8], f: KvFormat| {
                    let row = f.byte_at(kvd);
                    let mut out = vec![0u8; ring * row];
                    for p in keys - ring..keys {
                        let r = p % ring;
                        out[r * row..(r + 1) * row].copy_from_slice(&full[p * row..(p + 1) * row]);
                    }
                    out
                };
                let (kring, vring) = (ring_of(&kfull, kf), ring_of(&vfull, vf));
                for cap in [0.0f32, 3.0] {
                    let shape = AttnShape::new(nh, kvh, hd, n_q, start, 0.125, false)
                        .unwrap()
                        .masked(window, cap);
                    let what =
                        format!("{kf:?}/{vf:?} window {window} ring {ring} {n_q} at {start}");
                    let want = cpu_attention((kf, vf), (shape, keys), &q, &kfull, &vfull);
                    let got = cpu_attention((kf, vf), (shape, ring), &q, &kring, &vring);
                    assert!(
                        got.iter()
                            .zip(&want)
                            .all(|(g, w)| g.to_bits() == w.to_bits()),
                        "{what}: cpu backend"
                    );
                    let twin = |k: &[u8], v: &[u8], rows: usize, span: usize| {
                        let mut out = vec![f32::NAN; q.len()];
                        if n_q >= weightlift_kernels::sources::ATTENTION_PREFILL_MIN_QUERIES {
                            host_shim::attention_prefill(
                                kf,
                                vf,
                                shape,
                                (window, cap, rows),
                                &q,
                                k,
                                v,
                                &mut out,
                            )
                            .unwrap();
                        } else {
                            host_shim::attention(
                                kf,
                                vf,
                                shape,
                                (splits, span, rows),
                                &q,
                                k,
                                v,
                                &mut out,
                            )
                            .unwrap();
                        }
                        out
                    };
                    for span in [0, keys.next_power_of_two()] {
                        let full = twin(&kfull, &vfull, keys, span);
                        let got = twin(&kring, &vring, ring, span);
                        assert!(
                            got.iter()
                                .zip(&full)
                                .all(|(g, w)| g.to_bits() == w.to_bits()),
                            "{what}, span {span}: twin"
                        );
                        for (i, (g, w)) in full.iter().zip(&want).enumerate() {
                            assert!(
                                (g - w).abs() <= 1e-5,
                                "{what}: value {i}: twin {g}, cpu {w}"
                            );
                        }
                    }
                }
            }
        }
    }

    /// The positions a decode test visits with a window of `window` keys: before the window
    /// fills, the last before and the first after it does, far past it, and either side of each
    /// power of two from 256 (where the step's span changes).
    fn decode_positions(window: usize, far: usize) -> Vec<usize> {
        let mut ps = vec![
            0,
            1,
            2,
            window / 2,
            window.saturating_sub(2),
            window - 1,
            window,
        ];
        ps.extend([window + 1, 2 * window + 3, far - 1, far]);
        for b in [256, 512, 1024, 2048, 4096] {
            ps.extend([b - 1, b]);
        }
        ps.sort_unstable();
        ps.dedup();
        ps
    }

    /// A sliding-window layer's decode splits cover exactly its window's keys: with the span
    /// the engine gives it (`attention_window_span` of the step's `attention_decode_span`),
    /// the splits of every query hold positions `max(0, p + 1 - window) ..= p` once each, in
    /// order, none of them empty; once the window is full every split holds keys (a split
    /// count that divides the window), where a span over every position left most of them
    /// empty. Positions before, at and far past the window, either side of each span change,
    /// the position given at launch and read from the device, one query and three.
    #[test]
    fn a_sliding_layers_decode_splits_cover_its_window_once() {
        use weightlift_kernels::sources::{attention_decode_span, attention_window_span};
        let capacity = 1 << 17;
        for window in [64, 1024, 4096] {
            for p in decode_positions(window, 100_000) {
                for n_q in [1, 3] {
                    let full = attention_decode_span(p + n_q, capacity);
                    let span = attention_window_span(full, window, n_q);
                    assert!(
                        span < window + n_q && span <= full,
                        "{window} at {p}: {span}"
                    );
                    for splits in [1, 8, 16, 64] {
                        for at in [0, span] {
                            let what = format!(
                                "window {window}, {n_q} queries at {p}, {splits} splits over \
                                 {at} keys"
                            );
                            for i in 0..n_q {
                                let got =
                                    host_shim::attention_splits((p, n_q, window), (splits, at), i)
                                        .unwrap_or_else(|| panic!("{what}: refused"));
                                let first = (p + i + 1).saturating_sub(window);
                                let mut next = first;
                                // a later query's window starts after the first's: the splits
                                // wholly before it are empty for it
                                let empty = got.iter().take_while(|r| r.start >= r.end).count();
                                assert!(empty <= i, "{what}, query {i}: {got:?}");
                                for r in &got[empty..] {
                                    assert!(
                                        r.start == next && r.start < r.end,
                                        "{what}, query {i}: {got:?} from {first}"
                                    );
                                    next = r.end;
                                }
                                assert_eq!(next, p + i + 1, "{what}, query {i}: {got:?}");
                                if n_q == 1 && at > 0 && p + 1 >= window {
                                    assert_eq!(got.len(), splits, "{what}: {got:?}");
                                }
                            }
                            // the step's span over every position leaves the window's keys to
                            // the last of its splits
                            if n_q == 1
                                && splits > 1
                                && at > 0
                                && p + 1 >= window
                                && full >= 4 * window
                            {
                                let per = full.div_ceil(splits);
                                let old = (p + 1).div_ceil(per) - (p + 1 - window) / per;
                                assert!(old < splits, "{what}: {old} live before");
                            }
                        }
                    }
                }
            }
        }
        // a position read from the device whose window's keys pass the span computes nothing
        assert!(host_shim::attention_splits((5000, 1, 1024), (8, 1023), 0).is_none());
        assert!(host_shim::attention_splits((5000, 1, 1024), (8, 1024), 0).is_some());
        assert!(host_shim::attention_splits((300, 1, 0), (8, 256), 0).is_none());
    }

    /// Every position of one step's span gives a sliding-window layer the same span and so the
    /// same launch grid, and the kernel takes each of them: a graph captured at one position
    /// replays at all the others. Past the window the grid no longer follows the step's span.
    #[test]
    fn a_sliding_layers_decode_grid_is_one_per_span() {
        use weightlift_kernels::sources::{
            attention_decode_span, attention_grid, attention_scratch_values, attention_window_span,
        };
        let capacity = 1 << 17;
        // a gemma3 sliding layer's heads (8 over 4 kv heads of 256) on a 132-SM GPU
        let (nh, kvh, hd, sms) = (8, 4, 256, 132);
        let room = attention_scratch_values(1, nh, hd, 128).unwrap();
        for window in [64, 1024, 4096] {
            let mut seen: Vec<(usize, usize, weightlift_kernels::sources::AttentionGrid)> =
                Vec::new();
            for p in (0..20_000).chain([65_535, 65_536, 100_000, capacity - 1]) {
                let full = attention_decode_span(p + 1, capacity);
                let span = attention_window_span(full, window, 1);
                let grid = attention_grid([nh, kvh, hd, 1, span - 1], sms, room);
                match seen.iter().find(|s| s.0 == full) {
                    Some(&(_, s, g)) => assert!(
                        s == span && g == grid,
                        "window {window} at {p}: span {span} grid {grid:?}, {s} {g:?} before"
                    ),
                    None => seen.push((full, span, grid)),
                }
                assert!(
                    host_shim::attention_splits((p, 1, window), (grid.splits, span), 0).is_some(),
                    "window {window} at {p}: refused over {span} keys"
                );
            }
            // past the window, one grid for every step's span
            let past: Vec<_> = seen.iter().filter(|s| s.0 >= window).collect();
            assert!(past.len() > 3, "{window}: {past:?}");
            assert!(
                past.iter().all(|s| s.1 == window && s.2 == past[0].2),
                "{window}: {past:?}"
            );
        }
    }

    /// A sliding-window layer's decode over the span `attention_window_span` gives it (the
    /// splits cut from its window's start), replayed on the host with the position read from
    /// the device: over a ring the bits it gives over a cache of every position, and the CPU
    /// backend's attention within the bounds of `split_attention_matches_the_cpu_backend`, at
    /// positions before, at and past the window.
    #[test]
    fn a_sliding_layers_decode_over_its_window_span_is_its_attention() {
        use weightlift_kernels::cpu::attention::AttnShape;
        use weightlift_kernels::sources::{attention_decode_span, attention_window_span};
        let mut rng = Rng(0x5a11);
        let (nh, kvh, hd) = (4, 2, 64);
        let kvd = kvh * hd;
        let (window, ring) = (40, 48);
        for p in [0, 5, 38, 39, 40, 41, 255, 256, 700] {
            let keys = p + 1;
            let q = rng.vec(nh * hd, 2.0);
            let kx = rng.vec(keys * kvd, 2.0);
            let vx = rng.vec(keys * kvd, 1.0);
            let (kf, vf) = (KvFormat::Q8, KvFormat::Q4);
            let enc = |x: &[f32], f: KvFormat| {
                let mut out = vec![0u8; f.byte_at(x.len())];
                kv_encode(f, x, &mut out).unwrap();
                out
            };
            let (kfull, vfull) = (enc(&kx, kf), enc(&vx, vf));
            let ring_of = |full: &[u8], f: KvFormat| {
                let row = f.byte_at(kvd);
                let mut out = vec![0u8; ring * row];
                for j in keys.saturating_sub(ring)..keys {
                    let r = j % ring;
                    out[r * row..(r + 1) * row].copy_from_slice(&full[j * row..(j + 1) * row]);
                }
                out
            };
            let (kring, vring) = (ring_of(&kfull, kf), ring_of(&vfull, vf));
            let shape = AttnShape::new(nh, kvh, hd, 1, p, 0.125, false)
                .unwrap()
                .masked(window, 0.0);
            let want = cpu_attention((kf, vf), (shape, keys), &q, &kfull, &vfull);
            let span = attention_window_span(attention_decode_span(keys, 1 << 17), window, 1);
            for splits in [1, 4, 7] {
                let twin = |k: &[u8], v: &[u8], rows: usize| {
                    let mut out = vec![f32::NAN; q.len()];
                    host_shim::attention(kf, vf, shape, (splits, span, rows), &q, k, v, &mut out)
                        .unwrap();
                    out
                };
                let full = twin(&kfull, &vfull, keys);
                let got = twin(&kring, &vring, ring);
                let what = format!("window {window} at {p}, {splits} splits over {span} keys");
                assert!(
                    got.iter()
                        .zip(&full)
                        .all(|(g, w)| g.to_bits() == w.to_bits()),
                    "{what}: ring and full differ"
                );
                for (i, (g, w)) in full.iter().zip(&want).enumerate() {
                    assert!(
                        (g - w).abs() <= 1e-5,
                        "{what}: value {i}: twin {g}, cpu {w}"
                    );
                }
            }
        }
    }
}
