//! The host C++ build of `kernels/*.cuh` (the CUDA decode maths) against the Rust CPU kernels
//! and gguf-py's fixtures. Skips, saying why, when build.rs found no C++ compiler.

// Reference loops index several arrays in lock-step; iterators would hide the maths.
#![allow(clippy::needless_range_loop)]

mod common;

#[cfg(not(wl_host_shim))]
#[test]
fn host_twin_skipped() {
    if !weightlift_kernels::HAS_HOST_SHIM {
        eprintln!(
            "skipping host-twin tests: build.rs found no C++ compiler for shim/host_shim.cpp"
        );
    }
}

#[cfg(wl_host_shim)]
mod twin {
    use super::common::{NAMES, Rng, load};
    use weightlift_kernels::{KvType, QuantType, host_shim};

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
}
