//! One test body per operation, run on every backend present through `test_device!`: the CPU
//! backend, a capacity-limited virtual device, and CUDA device 0 when there is one (the CUDA
//! cases skip with a printed reason on this machine). References: gguf-py fixtures, f64 closed
//! forms, the documented KV error bound.

// Reference loops index several arrays in lock-step; iterators would hide the maths.
#![allow(clippy::needless_range_loop)]

mod common;

use common::{NAMES, Rng, download_f32, f32s, load, upload};
use weightlift_kernels::*;

fn dequantize_matches_gguf_py<B: Backend>(b: &B) -> Result<()> {
    for name in NAMES {
        let f = load(name);
        let n = f.want.len();
        let src = upload(b, &f.raw)?;
        let mut dst = b.alloc(n * 4)?;
        b.run(Op::Dequantize {
            ty: f.ty,
            out: FloatType::F32,
            n,
            src: &src,
            dst: &mut dst,
        })?;
        let got = download_f32(b, &dst, n)?;
        for (i, (g, w)) in got.iter().zip(&f.want).enumerate() {
            assert!(
                g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan()),
                "{} {name} element {i}: {g:e} vs gguf-py {w:e}",
                b.name()
            );
        }
        let mut d16 = b.alloc(n * 2)?;
        b.run(Op::Dequantize {
            ty: f.ty,
            out: FloatType::F16,
            n,
            src: &src,
            dst: &mut d16,
        })?;
        let mut bytes = vec![0u8; n * 2];
        b.copy_to_host(&d16, 0, &mut bytes)?;
        for (i, (c, w)) in bytes.chunks_exact(2).zip(&f.want).enumerate() {
            let want = half::f16::from_f32(*w);
            let got = half::f16::from_le_bytes([c[0], c[1]]);
            assert!(
                got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                "{} {name} f16 element {i}",
                b.name()
            );
        }
    }
    Ok(())
}
test_device!(dequantize_matches_gguf_py);

fn matmul_matches_f64_reference<B: Backend>(b: &B) -> Result<()> {
    let mut rng = Rng(21);
    for name in ["q4_0", "q4_1", "q8_0", "q4_k", "q6_k"] {
        let f = load(name);
        let cols = 256;
        let rows = f.want.len() / cols;
        for n_tok in [1usize, 3] {
            let x = rng.vec(cols * n_tok, 1.0);
            let w = upload(b, &f.raw)?;
            let xb = f32s(b, &x)?;
            let mut y = b.alloc(rows * n_tok * 4)?;
            b.run(Op::Matmul {
                ty: f.ty,
                mode: MatvecMode::Exact,
                act: FloatType::F32,
                rows,
                cols,
                n_tok,
                max_dq_size: 300,
                w: &w,
                x: &xb,
                y: &mut y,
            })?;
            let got = download_f32(b, &y, rows * n_tok)?;
            for t in 0..n_tok {
                for r in 0..rows {
                    let (mut s, mut m) = (0f64, 0f64);
                    for c in 0..cols {
                        let p = f64::from(f.want[r * cols + c]) * f64::from(x[t * cols + c]);
                        s += p;
                        m += p.abs();
                    }
                    let g = f64::from(got[t * rows + r]);
                    assert!(
                        (g - s).abs() <= 1e-5 * m + 1e-30 || !s.is_finite(),
                        "{} {name} tok {t} row {r}: {g} vs {s}",
                        b.name()
                    );
                }
            }
        }
    }
    Ok(())
}
test_device!(matmul_matches_f64_reference);

fn row_ops_match_closed_forms<B: Backend>(b: &B) -> Result<()> {
    let mut rng = Rng(23);
    let (rows, n) = (3, 64);
    let x = rng.vec(rows * n, 2.0);
    let w = rng.vec(n, 1.0);
    let (xb, wb) = (f32s(b, &x)?, f32s(b, &w)?);
    let mut out = b.alloc(rows * n * 4)?;
    b.run(Op::RmsNorm {
        n_rows: rows,
        n_cols: n,
        eps: 1e-6,
        x: &xb,
        weight: &wb,
        out: &mut out,
    })?;
    let got = download_f32(b, &out, rows * n)?;
    for r in 0..rows {
        let ms = x[r * n..(r + 1) * n]
            .iter()
            .map(|v| f64::from(*v).powi(2))
            .sum::<f64>()
            / n as f64;
        for i in 0..n {
            let want = f64::from(x[r * n + i]) / (ms + 1e-6).sqrt() * f64::from(w[i]);
            assert!(
                (f64::from(got[r * n + i]) - want).abs() <= 2e-6 * want.abs().max(1.0),
                "{} rms_norm",
                b.name()
            );
        }
    }
    b.run(Op::Softmax {
        n_rows: rows,
        n_cols: n,
        x: &xb,
        out: &mut out,
    })?;
    let got = download_f32(b, &out, rows * n)?;
    for r in 0..rows {
        let z: f64 = x[r * n..(r + 1) * n]
            .iter()
            .map(|v| f64::from(*v).exp())
            .sum();
        for i in 0..n {
            let want = f64::from(x[r * n + i]).exp() / z;
            assert!(
                (f64::from(got[r * n + i]) - want).abs() <= 1e-6,
                "{} softmax",
                b.name()
            );
        }
    }
    // RoPE, neox and normal: 2 tokens × 2 heads × head_dim 8, rotating 4 dims
    let pos = [0i32, 7];
    let pb = upload(b, bytemuck::cast_slice(&pos))?;
    let xr = rng.vec(2 * 2 * 8, 1.0);
    let xrb = f32s(b, &xr)?;
    for style in [RopeStyle::Normal, RopeStyle::Neox] {
        let params = RopeParams {
            style,
            head_dim: 8,
            n_dims: 4,
            freq_base: 10000.0,
            freq_scale: 1.0,
            attn_factor: 1.0,
        };
        let mut o = b.alloc(xr.len() * 4)?;
        b.run(Op::Rope {
            params,
            n_tok: 2,
            n_heads: 2,
            x: &xrb,
            positions: &pb,
            out: &mut o,
        })?;
        let got = download_f32(b, &o, xr.len())?;
        for t in 0..2 {
            for h in 0..2 {
                let base = (t * 2 + h) * 8;
                for i in 0..2 {
                    let th = f64::from(pos[t]) * 10000f64.powf(-2.0 * i as f64 / 4.0);
                    let (ia, ib) = if style == RopeStyle::Neox {
                        (i, i + 2)
                    } else {
                        (2 * i, 2 * i + 1)
                    };
                    let (a, c) = (f64::from(xr[base + ia]), f64::from(xr[base + ib]));
                    assert!(
                        (f64::from(got[base + ia]) - (a * th.cos() - c * th.sin())).abs() < 1e-5,
                        "{} rope {style:?}",
                        b.name()
                    );
                    assert!(
                        (f64::from(got[base + ib]) - (a * th.sin() + c * th.cos())).abs() < 1e-5,
                        "{} rope {style:?}",
                        b.name()
                    );
                }
                assert_eq!(&got[base + 4..base + 8], &xr[base + 4..base + 8]);
            }
        }
    }
    let g = rng.vec(1000, 6.0);
    let u = rng.vec(1000, 2.0);
    let (gb, ub) = (f32s(b, &g)?, f32s(b, &u)?);
    let mut o = b.alloc(4000)?;
    b.run(Op::SwiGlu {
        n: 1000,
        gate: &gb,
        up: &ub,
        out: &mut o,
    })?;
    let got = download_f32(b, &o, 1000)?;
    for i in 0..1000 {
        let (gg, uu) = (f64::from(g[i]), f64::from(u[i]));
        let want = gg / (1.0 + (-gg).exp()) * uu;
        assert!(
            (f64::from(got[i]) - want).abs() <= 1e-6 * want.abs().max(1.0),
            "{} swiglu",
            b.name()
        );
    }
    b.run(Op::Add {
        n: 1000,
        a: &gb,
        b: &ub,
        out: &mut o,
    })?;
    let got = download_f32(b, &o, 1000)?;
    assert!(
        got.iter()
            .zip(g.iter().zip(&u))
            .all(|(o, (a, c))| *o == a + c),
        "{} add",
        b.name()
    );
    b.synchronize()
}
test_device!(row_ops_match_closed_forms);

/// Every cache storage format through the backend's store and load: the bytes and the values
/// of the cache codec, to the bit, and each value within its format's bound (per value `x` of
/// group `g`: f16 `|x|·2⁻¹¹ + 2⁻²⁵`, bf16 `|x|·2⁻⁸`, e4m3 `|x|·2⁻⁴ + 2⁻¹⁰`, turned q8/q4
/// `√32·‖g‖/(2·qmax)·(1 + 2⁻⁹) + 2⁻¹⁷`).
fn kv_cache_formats_store_and_load_as_the_codec<B: Backend>(b: &B) -> Result<()> {
    let mut rng = Rng(29);
    let mut x = rng.vec(32 * 64, 3.0);
    x[5] = 40.0; // an outlier channel
    let xb = f32s(b, &x)?;
    for format in [
        KvFormat::F32,
        KvFormat::F16,
        KvFormat::BF16,
        KvFormat::E4M3,
        KvFormat::Q8,
        KvFormat::Q4,
    ] {
        let nb = format.byte_at(x.len());
        let mut stored = b.alloc(nb)?;
        b.run(Op::KvStore {
            format,
            n: x.len(),
            src: &xb,
            dst: &mut stored,
        })?;
        let mut back = b.alloc(x.len() * 4)?;
        b.run(Op::KvLoad {
            format,
            n: x.len(),
            src: &stored,
            dst: &mut back,
        })?;
        let got = download_f32(b, &back, x.len())?;
        let mut bytes = vec![0u8; nb];
        b.copy_to_host(&stored, 0, &mut bytes)?;
        let mut want_bytes = vec![0u8; nb];
        kv_encode(format, &x, &mut want_bytes)?;
        assert!(bytes == want_bytes, "{} {format:?}: stored bytes", b.name());
        let mut want = vec![0f32; x.len()];
        kv_decode(format, &bytes, &mut want)?;
        assert!(
            got.iter()
                .zip(&want)
                .all(|(a, w)| a.to_bits() == w.to_bits()),
            "{} {format:?}: loaded values",
            b.name()
        );
        for (gi, g) in x.chunks(32).enumerate() {
            let norm = g.iter().map(|v| f64::from(*v).powi(2)).sum::<f64>().sqrt();
            for (i, v) in g.iter().enumerate() {
                let v = f64::from(*v);
                let bound = match format {
                    KvFormat::F32 => 0.0,
                    KvFormat::F16 => v.abs() * 2f64.powi(-11) + 2f64.powi(-25),
                    KvFormat::BF16 => v.abs() * 2f64.powi(-8),
                    KvFormat::E4M3 => v.abs() * 2f64.powi(-4) + 2f64.powi(-10),
                    KvFormat::Q8 | KvFormat::Q4 => {
                        let qmax = f64::from(format.quant().unwrap().qmax());
                        32f64.sqrt() * norm / (2.0 * qmax) * (1.0 + 2f64.powi(-9)) + 2f64.powi(-17)
                    }
                };
                let err = (v - f64::from(got[gi * 32 + i])).abs();
                assert!(
                    err <= bound,
                    "{} {format:?} group {gi}: {err} > {bound}",
                    b.name()
                );
            }
        }
    }
    // a partial group is refused, naming it
    let mut out = b.alloc(64)?;
    let e = b
        .run(Op::KvStore {
            format: KvFormat::Q8,
            n: 16,
            src: &xb,
            dst: &mut out,
        })
        .unwrap_err();
    assert!(e.to_string().contains("not whole groups of 32"), "{e}");
    Ok(())
}
test_device!(kv_cache_formats_store_and_load_as_the_codec);

fn convert_scan_and_copies<B: Backend>(b: &B) -> Result<()> {
    let mut v: Vec<f32> = (0..5000).map(|i| i as f32 * 0.37 - 900.0).collect();
    v[4321] = f32::NAN;
    v[4999] = f32::INFINITY;
    let vb = f32s(b, &v)?;
    assert_eq!(
        b.scan_non_finite(QuantType::F32, &vb, v.len() * 4)?,
        Some(4321)
    );
    assert_eq!(b.scan_non_finite(QuantType::F32, &vb, 4321 * 4)?, None);
    let mut h = b.alloc(v.len() * 2)?;
    b.run(Op::ConvertToF16 {
        from: FloatType::F32,
        n: v.len(),
        src: &vb,
        dst: &mut h,
    })?;
    let mut hb = vec![0u8; v.len() * 2];
    b.copy_to_host(&h, 0, &mut hb)?;
    for (i, c) in hb.chunks_exact(2).enumerate() {
        let want = half::f16::from_f32(v[i]);
        let got = half::f16::from_le_bytes([c[0], c[1]]);
        assert!(
            got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
            "{} f16 {i}",
            b.name()
        );
    }
    // device-to-device copy at offsets, then back
    let mut other = b.alloc(100)?;
    b.copy(&vb, 40, &mut other, 8, 80)?;
    let mut back = vec![0u8; 80];
    b.copy_to_host(&other, 8, &mut back)?;
    assert_eq!(&back[..], &bytemuck::cast_slice::<f32, u8>(&v)[40..120]);
    let err = b.copy(&vb, 0, &mut other, 50, 80).unwrap_err();
    assert_eq!(
        err.to_string(),
        "copy destination bytes: expected 130, got 100"
    );
    Ok(())
}
test_device!(convert_scan_and_copies);

#[test]
fn virtual_device_allocation_past_capacity_is_out_of_memory() {
    let v = CpuBackend::with_capacity("virtual:1", 1000);
    let a = v.alloc(600).unwrap();
    let err = v.alloc(600).unwrap_err();
    assert_eq!(
        err.to_string(),
        "out of memory on virtual:1: could not allocate 600 bytes"
    );
    assert_eq!(v.allocated(), 600);
    drop(a);
    assert_eq!(v.allocated(), 0);
    let b = v.alloc(1000).unwrap();
    // a buffer of one device cannot be used with another
    let cpu = CpuBackend::new();
    let mut c = cpu.alloc(10).unwrap();
    let err = cpu.copy(&b, 0, &mut c, 0, 10).unwrap_err();
    assert_eq!(
        err.to_string(),
        "buffer of 1000 bytes on virtual:1 was used with backend cpu"
    );
}

#[test]
fn cuda_without_the_feature_or_driver_is_a_typed_error() {
    match CudaBackend::new(0) {
        Ok(b) => assert_eq!(b.name(), "cuda:0"),
        Err(e) => {
            let msg = e.to_string();
            assert!(
                matches!(
                    e,
                    KernelError::NotCompiledWithCuda { .. }
                        | KernelError::CudaUnavailable { .. }
                        | KernelError::LibraryNotFound { .. }
                ),
                "unexpected error {msg}"
            );
            // no driver at all: the library and the fix are named
            if let KernelError::LibraryNotFound { library, .. } = &e {
                assert_eq!(library, "libcuda.so.1");
                assert!(
                    msg.starts_with("libcuda.so.1 not found: install the NVIDIA driver"),
                    "{msg}"
                );
            }
            eprintln!("{msg}");
        }
    }
}

/// Quantise-on-load into device memory (`quantize_rows`, the loader's CUDA path): every type
/// from f32, f16 and bf16 rows, in two chunks written at their offsets into one tensor, equals
/// the CPU's `quantize_rows_from` byte for byte; a NaN in the second chunk and an inf in a
/// later block give the CPU's error for the NaN at its index in the tensor.
fn quantize_rows_match_the_cpu_quantiser<B: Backend>(b: &B) -> Result<()> {
    let (rows, n) = (6usize, 512usize);
    let mut rng = Rng(0x0a_d1ce);
    let mut x = rng.vec(rows * n, 1.0);
    for (r, row) in x.chunks_exact_mut(n).enumerate() {
        let scale = [1.0f32, 0.01, 30.0][r % 3];
        for v in row {
            *v *= scale;
        }
    }
    for ft in [FloatType::F32, FloatType::F16, FloatType::BF16] {
        let src = common::float_bytes(ft, &x);
        let split = 4 * n * ft.size();
        for ty in QUANTIZE_TYPES {
            let row_bytes = quantized_row_bytes(ty, n)?;
            let mut want = vec![0u8; rows * row_bytes];
            quantize_rows_from(ty, ft, &src, n, &mut want)?;
            let mut dst = b.alloc(want.len())?;
            let mut found = b.alloc(8)?;
            b.quantize_rows(ty, ft, &src[..split], n, &mut dst, 0, 0, &mut found)?;
            let at = 4 * row_bytes;
            b.quantize_rows(ty, ft, &src[split..], n, &mut dst, at, 4 * n, &mut found)?;
            b.check_quantized(&found)?;
            let mut got = vec![0u8; want.len()];
            b.copy_to_host(&dst, 0, &mut got)?;
            assert!(got == want, "{} {ty} from {}", b.name(), ft.name());
        }
    }
    x[4 * n + 77] = f32::NAN;
    x[5 * n + 3] = f32::INFINITY;
    for ft in [FloatType::F32, FloatType::BF16] {
        let src = common::float_bytes(ft, &x);
        let split = 4 * n * ft.size();
        let ty = QuantType::Q4_K;
        let mut dst = b.alloc(rows * quantized_row_bytes(ty, n)?)?;
        let mut found = b.alloc(8)?;
        b.quantize_rows(ty, ft, &src[..split], n, &mut dst, 0, 0, &mut found)?;
        let at = 4 * quantized_row_bytes(ty, n)?;
        b.quantize_rows(ty, ft, &src[split..], n, &mut dst, at, 4 * n, &mut found)?;
        let got = b.check_quantized(&found).unwrap_err().to_string();
        let mut whole = vec![0u8; rows * quantized_row_bytes(ty, n)?];
        let want = quantize_rows_from(ty, ft, &src, n, &mut whole)
            .unwrap_err()
            .to_string();
        assert_eq!(got, want, "{} from {}", b.name(), ft.name());
        assert!(
            got.contains(&format!("value NaN at index {}", 4 * n + 77)),
            "{got}"
        );
    }
    // a type the quantisers do not write is refused before anything is queued
    let mut dst = b.alloc(1024)?;
    let mut found = b.alloc(8)?;
    let e = b
        .quantize_rows(
            QuantType::Q5_K,
            FloatType::F32,
            &[0u8; 1024],
            256,
            &mut dst,
            0,
            0,
            &mut found,
        )
        .unwrap_err();
    assert!(
        e.to_string().contains("quantize does not support q5_k"),
        "{e}"
    );
    Ok(())
}

test_device!(quantize_rows_match_the_cpu_quantiser);
