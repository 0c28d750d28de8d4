//! The device's block quantisers (`kernels/wl_quantize.cuh`, built for the host by the shim)
//! against the CPU's `quantize_rows_from` and llama.cpp's own bytes: every type the loader
//! quantises to, from f32, f16 and bf16 rows, on ggml's stored vectors, on random rows, and on
//! rows built to reach the corners (zeros, constants, tiny and huge magnitudes, rounding ties,
//! sub-blocks the K-quants' fits and requantisation treat apart), and the non-finite report
//! the kernels leave for the loader. Equal bytes here are the evidence that the
//! `quantize_{type}_{src}` kernels write the CPU's bytes; the `test_device!` case in
//! `backends.rs` runs the kernels themselves where a GPU is present.

use crate::common::Rng;

#[cfg(wl_host_shim)]
mod twin {
    use super::Rng;
    use crate::common::float_bytes;
    use crate::quantize::{data, expected, first_diff, fnv1a64, input, u32_at, xorshift_rows};
    use weightlift_kernels::cpu::quantize::{QUANTIZE_TYPES, check_non_finite_report};
    use weightlift_kernels::{FloatType, QuantType, host_shim, quantize_rows_from};

    const SOURCES: [FloatType; 3] = [FloatType::F32, FloatType::F16, FloatType::BF16];

    /// The header's bytes for `src` (rows of `n` values of `ft`) as `ty`, checked equal to
    /// `quantize_rows_from`'s; returns the bytes and the number of blocks compared.
    fn same_as_cpu(
        ty: QuantType,
        ft: FloatType,
        src: &[u8],
        n: usize,
        what: &str,
    ) -> (Vec<u8>, usize) {
        let values = src.len() / ft.size();
        let blocks = values / ty.block_size();
        let mut cpu = vec![0u8; blocks * ty.block_bytes()];
        quantize_rows_from(ty, ft, src, n, &mut cpu).unwrap();
        let mut dev = vec![0xa5u8; cpu.len()];
        let report = host_shim::quantize(ty, ft, src, &mut dev, 0).unwrap();
        assert_eq!(
            report,
            0,
            "{ty} from {} {what}: a finite row reported",
            ft.name()
        );
        assert!(
            dev == cpu,
            "{ty} from {} {what}: {}",
            ft.name(),
            first_diff(ty, &dev, &cpu)
        );
        (dev, blocks)
    }

    #[test]
    fn header_quantisers_write_ggml_s_bytes_for_its_stored_rows() {
        let mut compared = 0;
        for (ft, name) in [
            (FloatType::F32, "f32"),
            (FloatType::F16, "f16"),
            (FloatType::BF16, "bf16"),
        ] {
            let (rows, n, raw) = input(name);
            for ty in QUANTIZE_TYPES {
                let (dev, blocks) = same_as_cpu(ty, ft, &raw, n, "ggml's rows");
                compared += blocks;
                // ggml stored f16 and bf16 results for the types the loader defaults to
                let stored = ft == FloatType::F32
                    || matches!(ty, QuantType::Q8_0 | QuantType::Q4_K | QuantType::Q6_K);
                if stored {
                    let want = expected(ty, name, rows, n);
                    assert!(
                        dev == want,
                        "{ty} from {name}: {}",
                        first_diff(ty, &dev, &want)
                    );
                }
            }
        }
        eprintln!("{compared} blocks of ggml's rows");
    }

    #[test]
    fn two_thousand_random_blocks_hash_to_ggml_s_bytes() {
        let b = data("quant_hashes.bin");
        let seed = u64::from_le_bytes(b[4..12].try_into().unwrap());
        let n_blocks = u32_at(&b, 12);
        let x = xorshift_rows(seed, n_blocks);
        let src: Vec<u8> = x.iter().flat_map(|v| v.to_le_bytes()).collect();
        for rec in b[20..].chunks_exact(12) {
            let ty = QuantType::from_ggml_id(u32_at(rec, 0) as u32).unwrap();
            let want = u64::from_le_bytes(rec[4..12].try_into().unwrap());
            let mut dev = vec![0u8; x.len() / ty.block_size() * ty.block_bytes()];
            assert_eq!(
                host_shim::quantize(ty, FloatType::F32, &src, &mut dev, 0).unwrap(),
                0
            );
            assert_eq!(fnv1a64(&dev), want, "{ty}: header bytes differ from ggml's");
        }
    }

    #[test]
    fn header_quantisers_equal_the_cpu_on_random_rows_of_every_source_type() {
        // 64 rows of 1,024 values per source: 16 magnitudes from 1e-6 to 1e4, some rows
        // sparse, some shifted off zero (the min/max types' offsets, the K-quants' mins)
        let mut rng = Rng(0x9_0a_7e);
        let (rows, n) = (64usize, 1024usize);
        let mut x = Vec::with_capacity(rows * n);
        for r in 0..rows {
            let scale = 10f32.powi((r % 11) as i32 - 6);
            let shift = if r % 3 == 1 { 0.7 * scale } else { 0.0 };
            for _ in 0..n {
                let v = rng.unit() * scale + shift;
                x.push(if r % 5 == 4 && rng.unit() < 0.6 {
                    0.0
                } else {
                    v
                });
            }
        }
        let mut compared = 0;
        for ft in SOURCES {
            let src = float_bytes(ft, &x);
            for ty in QUANTIZE_TYPES {
                compared += same_as_cpu(ty, ft, &src, n, "random rows").1;
            }
        }
        eprintln!("{compared} random blocks");
    }

    /// Rows of 256 values (one K-quant block, eight of the 32-value types) that reach the
    /// corners of the quantisers; each is named for the failure message.
    fn corner_rows() -> Vec<(String, Vec<f32>)> {
        let mut rows: Vec<(String, Vec<f32>)> = Vec::new();
        let mut rng = Rng(0xc0_ffee);
        rows.push(("zeros".into(), vec![0.0; 256]));
        rows.push(("negative zeros".into(), vec![-0.0; 256]));
        for c in [1.0f32, -1.0, 0.5, -3.25, 65504.0, 1e-3] {
            rows.push((format!("constant {c}"), vec![c; 256]));
        }
        // tiny: subnormal scales (d = amax / 127 below f32's normal range makes 1/d inf),
        // f16 scales that underflow to zero or to f16 subnormals, and groups below ggml's
        // GROUP_MAX_EPS (1e-15)
        for amp in [
            1e-45f32, 1e-42, 1e-39, 1e-38, 3e-36, 1e-20, 1e-16, 1e-8, 6e-5, 6e-8,
        ] {
            rows.push((format!("tiny {amp:e}"), rng.vec(256, amp)));
        }
        // huge: f16 scales that overflow to inf, max - min past f32's range
        for amp in [7e4f32, 1e6, 8.3e6, 1e20, 1e37, 3.4e38] {
            rows.push((format!("huge {amp:e}"), rng.vec(256, amp)));
        }
        rows.push((
            "extremes".into(),
            (0..256)
                .map(|i| if i % 2 == 0 { f32::MAX } else { -f32::MAX })
                .collect(),
        ));
        // ties: integers and halves on a grid that makes x / d land on k + 0.5 (Q8_0's roundf
        // away from zero, the legacy types' + 0.5 truncation, nearest_int's ties to even)
        for (name, step) in [("halves", 0.5f32), ("quarters", 0.25), ("integers", 1.0)] {
            rows.push((
                format!("ties on {name}"),
                (0..256)
                    .map(|i| {
                        ((i % 64) as f32 - 31.5) * step * if i / 64 % 2 == 0 { 1.0 } else { -1.0 }
                    })
                    .collect(),
            ));
        }
        rows.push((
            "ties at 127".into(),
            (0..256)
                .map(|i| {
                    if i % 32 == 0 {
                        127.0
                    } else {
                        (i % 32) as f32 - 15.5
                    }
                })
                .collect(),
        ));
        rows.push((
            "ties at -8".into(),
            (0..256)
                .map(|i| {
                    if i % 32 == 0 {
                        -8.0
                    } else {
                        ((i % 16) as f32) - 7.5
                    }
                })
                .collect(),
        ));
        // the signed maximum: positive and negative peaks, first and last of equal magnitude
        let mut peaks = rng.vec(256, 1.0);
        for b in 0..8 {
            peaks[32 * b + b] = if b % 2 == 0 { 4.0 } else { -4.0 };
            peaks[32 * b + 31 - b] = if b % 2 == 0 { -4.0 } else { 4.0 };
        }
        rows.push(("equal peaks".into(), peaks));
        // one value alone in a block, at each end
        let mut lone = vec![0.0f32; 256];
        lone[0] = 3.0;
        lone[255] = -0.001;
        rows.push(("lone values".into(), lone));
        // all positive (the K-quants' min clamps to zero), all negative
        rows.push((
            "all positive".into(),
            rng.vec(256, 1.0).iter().map(|v| v.abs() + 0.5).collect(),
        ));
        rows.push((
            "all negative".into(),
            rng.vec(256, 1.0).iter().map(|v| -v.abs() - 2.0).collect(),
        ));
        // K-quant sub-blocks far below the block's largest: their 6-bit scale rounds to zero,
        // so the fit's own quants stay (the d == 0 path), and Q6_K's all-tiny sub-blocks
        let mut mixed = rng.vec(256, 1e-7);
        for v in &mut mixed[..32] {
            *v *= 1e9;
        }
        rows.push(("one loud sub-block".into(), mixed));
        let mut quiet = rng.vec(256, 1.0);
        for v in &mut quiet[16..48] {
            *v = 1e-17;
        }
        rows.push(("sub-blocks below GROUP_MAX_EPS".into(), quiet));
        // the fits' search: skewed and clustered values where a later scale beats the first
        for k in 0..6 {
            let skewed: Vec<f32> = rng
                .vec(256, 1.0)
                .iter()
                .map(|v| v * v * v * v.abs() * (1 + k) as f32 + if k % 2 == 0 { 0.1 } else { -0.3 })
                .collect();
            rows.push((format!("skewed {k}"), skewed));
            let clustered: Vec<f32> = rng
                .vec(256, 1.0)
                .iter()
                .map(|v| (v * (3 + k) as f32).round() / (3 + k) as f32 + v * 1e-3)
                .collect();
            rows.push((format!("clustered {k}"), clustered));
        }
        rows
    }

    #[test]
    fn header_quantisers_equal_the_cpu_on_rows_built_for_the_corners() {
        let rows = corner_rows();
        let mut compared = 0;
        for (name, x) in &rows {
            for ft in SOURCES {
                let src = float_bytes(ft, x);
                // a value f16 cannot hold widens to inf: that row is the non-finite test's
                let widened_finite = src.chunks_exact(ft.size()).all(|c| match ft {
                    FloatType::F32 => f32::from_le_bytes(c.try_into().unwrap()).is_finite(),
                    FloatType::F16 => u16::from_le_bytes([c[0], c[1]]) & 0x7c00 != 0x7c00,
                    FloatType::BF16 => u16::from_le_bytes([c[0], c[1]]) & 0x7f80 != 0x7f80,
                });
                if !widened_finite {
                    continue;
                }
                for ty in QUANTIZE_TYPES {
                    compared += same_as_cpu(ty, ft, &src, 256, name).1;
                }
            }
        }
        eprintln!("{compared} blocks of {} corner rows", rows.len());
    }

    #[test]
    fn non_finite_values_are_reported_with_the_cpu_s_error_at_their_tensor_index() {
        let first = 3 * 1024;
        for ty in QUANTIZE_TYPES {
            for ft in SOURCES {
                for (at, bad) in [
                    (300usize, f32::NAN),
                    (511, f32::INFINITY),
                    (0, f32::NEG_INFINITY),
                    (1023, -f32::NAN),
                ] {
                    let mut x = vec![0.25f32; 1024];
                    x[at] = bad;
                    // a later block holds a second bad value: the earliest is the one reported
                    x[(at + 600) % 1024] = f32::INFINITY;
                    let at_first = at.min((at + 600) % 1024);
                    let want_value = x[at_first];
                    let src = float_bytes(ft, &x);
                    let mut dev = vec![0u8; 1024 / ty.block_size() * ty.block_bytes()];
                    let word = host_shim::quantize(ty, ft, &src, &mut dev, first).unwrap();
                    let got = check_non_finite_report(word).unwrap_err().to_string();
                    // the CPU's message for the same value at the tensor index
                    let mut shifted = vec![0.25f32; first];
                    shifted.extend_from_slice(&x);
                    let whole = float_bytes(ft, &shifted);
                    let mut cpu_whole =
                        vec![0u8; shifted.len() / ty.block_size() * ty.block_bytes()];
                    let want = quantize_rows_from(ty, ft, &whole, 1024, &mut cpu_whole)
                        .unwrap_err()
                        .to_string();
                    assert_eq!(got, want, "{ty} from {}: bad value at {at}", ft.name());
                    assert!(
                        got.contains(&format!(
                            "the non-finite source value {want_value} at index {}",
                            first + at_first
                        )),
                        "{got}"
                    );
                }
            }
        }
        assert!(check_non_finite_report(0).is_ok());
    }
}
