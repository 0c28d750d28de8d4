//! The matmul modes on every backend present (`test_device!`): the Q8-activation mode, and the
//! exact mode's dequantised path for prompts, chunked by `max_dq_size`. References: f64 dot
//! products of gguf-py's dequantised weights (with the Q8-dequantised activations in Q8 mode);
//! on CUDA also the bit-exact orders the kernels document (the CPU's scalar Q8 mode, and one
//! FMA chain over k for the dequantised GEMM). The CUDA cases skip, saying why, without a GPU.

// Reference loops index several arrays in lock-step; iterators would hide the maths.
#![allow(clippy::needless_range_loop)]

mod common;

use common::{
    Rng, download_f32, float_weights, group_offset, load, shared_and_alone, upload, weight_bytes,
};
use weightlift_kernels::cpu::matvec::{matvec_with, quantize_q8_blocks};
use weightlift_kernels::sources::{CUBLAS_MIN_TOKENS, DQ_PATH_MIN_TOKENS};
use weightlift_kernels::*;

/// Activations as uploaded (f32 or f16 bytes) and as the kernels see them (f32).
fn activations(x: &[f32], act: FloatType) -> (Vec<u8>, Vec<f32>) {
    match act {
        FloatType::F16 => {
            let h: Vec<half::f16> = x.iter().map(|v| half::f16::from_f32(*v)).collect();
            (
                h.iter().flat_map(|v| v.to_le_bytes()).collect(),
                h.iter().map(|v| v.to_f32()).collect(),
            )
        }
        _ => (x.iter().flat_map(|v| v.to_le_bytes()).collect(), x.to_vec()),
    }
}

/// `test_device!` with the CUDA case on a backend whose products never take cuBLAS: for tests
/// of the backend's own kernels at token counts the measured cuBLAS counts would take.
macro_rules! test_device_without_cublas {
    ($body:ident) => {
        mod $body {
            #[test]
            fn cpu() -> weightlift_kernels::Result<()> {
                super::$body(&weightlift_kernels::CpuBackend::new())
            }

            #[test]
            fn virtual_device() -> weightlift_kernels::Result<()> {
                super::$body(&weightlift_kernels::CpuBackend::with_capacity(
                    "virtual:0",
                    256 << 20,
                ))
            }

            #[test]
            #[ignore = "needs a CUDA GPU: cargo test --features cuda -- --ignored on a machine with one"]
            fn cuda() -> weightlift_kernels::Result<()> {
                use weightlift_kernels::sources::CublasMinTokens;
                let b = weightlift_kernels::CudaBackend::new(0)?
                    .with_cublas_min_tokens(CublasMinTokens::uniform(usize::MAX));
                super::$body(&b)
            }
        }
    };
}

/// The host twin of decode's Q8 kernel for one token's activations (`bytes`, as uploaded): the
/// wide lanes' where they are `ty`'s (the default; `WEIGHTLIFT_Q8V=narrow` keeps the narrow
/// ones, as it does for the CUDA backend `test_device!` makes), else the narrow lanes'.
#[cfg(wl_host_shim)]
fn decode_twin(
    ty: QuantType,
    w: &[u8],
    bytes: &[u8],
    act: FloatType,
    rows: usize,
    cols: usize,
) -> Vec<f32> {
    use weightlift_kernels::host_shim;
    let mut xq = vec![0u8; cols / 32 * weightlift_kernels::sources::Q8_BLOCK_BYTES];
    let h: Vec<u16> = bytes
        .chunks_exact(2)
        .map(|c| u16::from_le_bytes([c[0], c[1]]))
        .collect();
    let f: Vec<f32> = bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    let x = match act {
        FloatType::F16 => host_shim::Act::F16(&h),
        _ => host_shim::Act::F32(&f),
    };
    host_shim::q8_quantize(x, &mut xq).expect("host q8 quantise");
    let mut y = vec![0f32; rows];
    // a CUDA backend made by default runs the wide lanes for their types
    if weightlift_kernels::sources::Q8Decode::from_env().wide_for(ty) {
        let wpr = weightlift_kernels::sources::q8_wide_matvec_warps(rows, cols, 1024);
        host_shim::q8_wide_matvec(ty, true, wpr, w, &xq, &mut y, cols).expect("host wide matvec");
        return y;
    }
    // the device's choice for so few rows: any SM count asks for the most warps a row allows
    let wpr = weightlift_kernels::sources::q8_matvec_warps(rows, cols, 1024);
    assert!(
        wpr > 1,
        "{rows} x {cols}: the test means to cover several warps a row"
    );
    host_shim::q8_matvec(ty, true, wpr, w, &xq, &mut y, cols).expect("host q8 matvec");
    y
}

/// Q8 mode, 1 and 6 tokens (the CUDA prompt kernel carries 4 per pass), f32 and f16
/// activations, rows of 512 values: within 1e-5 · Σ(|w| + 2|m|)·|x| of the f64 dot with the Q8-dequantised
/// activations; on CUDA bit for bit the CPU's scalar Q8 mode for 6 tokens, and for one token
/// (decode's kernel, in an order of its own) the host twin of that kernel, as for each of the
/// 6 tokens of a type with wide lanes (which run that kernel once a token).
fn q8_mode_matches_an_f64_dot_of_q8_activations<B: Backend>(b: &B) -> Result<()> {
    let mut rng = Rng(0x0a81);
    let on_cuda = b.name().starts_with("cuda");
    for name in ["q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_k", "q6_k"] {
        let f = load(name);
        // rows of 512 values: decode's kernel spreads each over two warps
        let cols = 512;
        let rows = f.want.len() / cols;
        let row_bytes = f.raw.len() / rows;
        let w = upload(b, &f.raw)?;
        for n_tok in [1usize, 6] {
            // decode's kernel for each token alone: one token, or a few of a type whose wide
            // lanes run once a token
            let alone = n_tok == 1
                || (n_tok <= weightlift_kernels::sources::Q8_WIDE_ALONE_MAX_TOKENS
                    && weightlift_kernels::sources::Q8Decode::from_env().wide_for(f.ty));
            for act in [FloatType::F32, FloatType::F16] {
                let (bytes, xs) = activations(&rng.vec(cols * n_tok, 2.0), act);
                let x = upload(b, &bytes)?;
                let mut y = b.alloc(rows * n_tok * 4)?;
                b.run(Op::Matmul {
                    ty: f.ty,
                    mode: MatvecMode::Q8,
                    act,
                    rows,
                    cols,
                    n_tok,
                    max_dq_size: 1 << 20,
                    w: &w,
                    x: &x,
                    y: &mut y,
                })?;
                let got = download_f32(b, &y, rows * n_tok)?;
                for t in 0..n_tok {
                    let xt = &xs[t * cols..(t + 1) * cols];
                    let q = quantize_q8_blocks(xt);
                    let mut cpu = vec![0f32; rows];
                    matvec_with(
                        Isa::Scalar,
                        MatvecMode::Q8,
                        f.ty,
                        &f.raw,
                        rows,
                        cols,
                        xt,
                        &mut cpu,
                    )?;
                    for r in 0..rows {
                        let g = got[t * rows + r];
                        let (mut s, mut mag) = (0f64, 0f64);
                        for c in 0..cols {
                            let xv = f64::from(q[c / 32].d) * f64::from(q[c / 32].qs[c % 32]);
                            let wv = f64::from(f.want[r * cols + c]);
                            let m = group_offset(f.ty, &f.raw[r * row_bytes..], c / 32);
                            s += wv * xv;
                            mag += (wv.abs() + 2.0 * m.abs()) * xv.abs();
                        }
                        assert!(
                            (f64::from(g) - s).abs() <= 1e-5 * mag + 1e-30,
                            "{} {name} {act:?} token {t} row {r}: {g} vs f64 {s}",
                            b.name()
                        );
                        if on_cuda && !alone {
                            assert_eq!(
                                g.to_bits(),
                                cpu[r].to_bits(),
                                "{} {name} token {t} row {r}: {g:e} vs cpu scalar q8 {:e}",
                                b.name(),
                                cpu[r]
                            );
                        }
                        #[cfg(wl_host_shim)]
                        if on_cuda && alone {
                            let per = bytes.len() / n_tok;
                            let token = &bytes[t * per..(t + 1) * per];
                            let twin = decode_twin(f.ty, &f.raw, token, act, rows, cols);
                            assert_eq!(
                                g.to_bits(),
                                twin[r].to_bits(),
                                "{} {name} row {r}: {g:e} vs the decode kernel's host twin {:e}",
                                b.name(),
                                twin[r]
                            );
                        }
                    }
                }
            }
        }
    }
    Ok(())
}
// The backend's own Q8 kernels: the measured counts send rows of two tokens and more of some
// types (Q8_0) to cuBLAS on CUDA.
test_device_without_cublas!(q8_mode_matches_an_f64_dot_of_q8_activations);

/// Decode's Q4_K and Q6_K products with the wide lanes (`q8_wide_matvec_{type}` and
/// `swiglu_q8_wide_matvec_{type}`, the default, which `WEIGHTLIFT_Q8V=narrow` turns off; the
/// CUDA case sets them on its backend with `with_q8_decode`, whatever the process says): one token, 64
/// rows of 1,024, 5,632 and 14,336 values (one, two and four warps a row on any device of 8
/// SMs or more), f32 and f16 activations, the weights at offset 0 and at views 1 and 2 bytes in
/// (the kernels' byte-by-byte path; Q6_K keeps its realigned words at 2). Every product lies within 1e-5 · Σ(|w| + 2|m|)·|x| of the f64
/// dot with the Q8-dequantised activations; on CUDA it is bit for bit the wide kernel's host
/// twin, and the fused gate/up kernel bit for bit the product kernel twice then
/// `SwiGluInPlace`. On the CPU (no wide kernels) the same bounds hold for its own Q8 mode.
// Views of an uploaded buffer are unsafe (their lifetime is the caller's to keep).
#[allow(unsafe_code)]
fn q8_wide_decode_matches_its_twin_and_f64<B: Backend>(b: &B, wide: bool) -> Result<()> {
    let mut rng = Rng(0x0a8d0c);
    let rows = 64;
    for (name, cols) in ["q4_k", "q6_k"]
        .into_iter()
        .flat_map(|n| [1024usize, 5632, 14336].map(|c| (n, c)))
    {
        let f = load(name);
        let (graw, gwant) = common::tiled_rows(&f, rows, cols);
        // the up matrix: the same blocks a row later
        let (mut uraw, mut uwant) = common::tiled_rows(&f, rows + 1, cols);
        let row_bytes = graw.len() / rows;
        uraw.drain(..row_bytes);
        uwant.drain(..cols);
        for act in [FloatType::F32, FloatType::F16] {
            let (bytes, xs) = activations(&rng.vec(cols, 2.0), act);
            let q = quantize_q8_blocks(&xs);
            let x = upload(b, &bytes)?;
            for w_off in [0usize, 1, 2] {
                let pad = |raw: &[u8]| {
                    let mut v = vec![0u8; w_off];
                    v.extend_from_slice(raw);
                    v
                };
                let (gbuf, ubuf) = (upload(b, &pad(&graw))?, upload(b, &pad(&uraw))?);
                // SAFETY: the views are dropped at the end of this iteration, before the
                // buffers; nothing writes to either meanwhile.
                let wg = unsafe { b.view(&gbuf, w_off, graw.len()) }?;
                // SAFETY: as above.
                let wu = unsafe { b.view(&ubuf, w_off, uraw.len()) }?;
                let mut ys = Vec::new();
                for w in [&wg, &wu] {
                    let mut y = b.alloc(rows * 4)?;
                    b.run(Op::Matmul {
                        ty: f.ty,
                        mode: MatvecMode::Q8,
                        act,
                        rows,
                        cols,
                        n_tok: 1,
                        max_dq_size: 1 << 20,
                        w,
                        x: &x,
                        y: &mut y,
                    })?;
                    ys.push(download_f32(b, &y, rows)?);
                }
                let what = format!(
                    "{} q4_k {rows}x{cols} {act:?} weights at +{w_off}",
                    b.name()
                );
                for (m, (raw, want)) in [(&graw, &gwant), (&uraw, &uwant)].into_iter().enumerate() {
                    #[cfg(wl_host_shim)]
                    let twin = if wide {
                        use weightlift_kernels::host_shim;
                        let mut xq =
                            vec![0u8; cols / 32 * weightlift_kernels::sources::Q8_BLOCK_BYTES];
                        // the values the device quantises (f16 activations widened)
                        host_shim::q8_quantize(host_shim::Act::F32(&xs), &mut xq)?;
                        // 64 rows: a device of 8 SMs or more takes the most warps a row allows
                        let wpr = weightlift_kernels::sources::q8_wide_matvec_warps(rows, cols, 8);
                        let mut t = vec![0f32; rows];
                        host_shim::q8_wide_matvec(f.ty, true, wpr, raw, &xq, &mut t, cols)?;
                        Some(t)
                    } else {
                        None
                    };
                    for r in 0..rows {
                        let g = ys[m][r];
                        let (mut s, mut mag) = (0f64, 0f64);
                        for c in 0..cols {
                            let xv = f64::from(q[c / 32].d) * f64::from(q[c / 32].qs[c % 32]);
                            let wv = f64::from(want[r * cols + c]);
                            let off = common::group_offset(f.ty, &raw[r * row_bytes..], c / 32);
                            s += wv * xv;
                            mag += (wv.abs() + 2.0 * off.abs()) * xv.abs();
                        }
                        assert!(
                            (f64::from(g) - s).abs() <= 1e-5 * mag + 1e-30,
                            "{what} matrix {m} row {r}: {g} vs f64 {s}"
                        );
                        #[cfg(wl_host_shim)]
                        if let Some(t) = &twin {
                            assert_eq!(
                                g.to_bits(),
                                t[r].to_bits(),
                                "{what} matrix {m} row {r}: {g:e} vs the wide kernel's host twin {:e}",
                                t[r]
                            );
                        }
                    }
                }
                // gate and up with SwiGLU in one op: the two products' bits, then SwiGLU's
                let (mut gy, mut uy) = (b.alloc(rows * 4)?, b.alloc(rows * 4)?);
                b.run(Op::MatmulSwiGlu {
                    mode: MatvecMode::Q8,
                    act,
                    cols,
                    n_tok: 1,
                    max_dq_size: 1 << 20,
                    x: &x,
                    gate: Product {
                        ty: f.ty,
                        rows,
                        w: &wg,
                        y: &mut gy,
                    },
                    up: Product {
                        ty: f.ty,
                        rows,
                        w: &wu,
                        y: &mut uy,
                    },
                })?;
                let fused = download_f32(b, &gy, rows)?;
                let mut sep = b.alloc(rows * 4)?;
                let mut up = b.alloc(rows * 4)?;
                b.copy_from_host(bytemuck_f32(&ys[0]).as_slice(), &mut sep, 0)?;
                b.copy_from_host(bytemuck_f32(&ys[1]).as_slice(), &mut up, 0)?;
                b.run(Op::SwiGluInPlace {
                    n: rows,
                    gate: &mut sep,
                    up: &up,
                })?;
                let want = download_f32(b, &sep, rows)?;
                for r in 0..rows {
                    assert_eq!(
                        fused[r].to_bits(),
                        want[r].to_bits(),
                        "{what} row {r}: fused {} vs the products then SwiGLU {}",
                        fused[r],
                        want[r]
                    );
                }
            }
        }
    }
    // `wide` picks the twin, which needs the host shim
    let _ = wide;
    Ok(())
}

/// Little-endian bytes of `v`.
fn bytemuck_f32(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// The wide-lane test on the CPU backend (its own Q8 mode) and on `cuda:0` with the wide lanes
/// switched on for that backend alone.
mod q8_wide_decode_matches_its_twin_and_f64 {
    #[test]
    fn cpu() -> weightlift_kernels::Result<()> {
        super::q8_wide_decode_matches_its_twin_and_f64(
            &weightlift_kernels::CpuBackend::new(),
            false,
        )
    }

    #[test]
    #[ignore = "needs a CUDA GPU: cargo test --features cuda -- --ignored on a machine with one"]
    fn cuda() -> weightlift_kernels::Result<()> {
        let b = weightlift_kernels::CudaBackend::new(0)?
            .with_q8_decode(weightlift_kernels::sources::Q8Decode::Wide);
        super::q8_wide_decode_matches_its_twin_and_f64(&b, true)
    }
}

/// Exact mode for a prompt (DQ_PATH_MIN_TOKENS + 3 tokens) with `max_dq_size` of 5 rows (the
/// dequantised path in chunks), of 40 rows, and below one row (no scratch fits: CUDA takes
/// the in-register kernels, the CPU one row at a time): within 1e-5 · Σ|w·x| of the f64 dot of
/// gguf-py's weights; on CUDA's dequantised path bit for bit one FMA chain over k.
fn prompt_matmul_chunked_by_max_dq_size_matches_f64<B: Backend>(b: &B) -> Result<()> {
    let mut rng = Rng(0xd9);
    let on_cuda = b.name().starts_with("cuda");
    let n_tok = DQ_PATH_MIN_TOKENS + 3;
    for name in [
        "q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k",
    ] {
        let f = load(name);
        let cols = 256;
        let rows = f.want.len() / cols;
        let w = upload(b, &f.raw)?;
        for act in [FloatType::F32, FloatType::F16] {
            let (bytes, xs) = activations(&rng.vec(cols * n_tok, 1.0), act);
            let x = upload(b, &bytes)?;
            for max_dq_size in [cols * 5, cols * 40, cols - 1] {
                let mut y = b.alloc(rows * n_tok * 4)?;
                b.run(Op::Matmul {
                    ty: f.ty,
                    mode: MatvecMode::Exact,
                    act,
                    rows,
                    cols,
                    n_tok,
                    max_dq_size,
                    w: &w,
                    x: &x,
                    y: &mut y,
                })?;
                let got = download_f32(b, &y, rows * n_tok)?;
                for t in 0..n_tok {
                    for r in 0..rows {
                        let wr = &f.want[r * cols..(r + 1) * cols];
                        let xt = &xs[t * cols..(t + 1) * cols];
                        let (mut s, mut m) = (0f64, 0f64);
                        for c in 0..cols {
                            let p = f64::from(wr[c]) * f64::from(xt[c]);
                            s += p;
                            m += p.abs();
                        }
                        let g = got[t * rows + r];
                        assert!(
                            (f64::from(g) - s).abs() <= 1e-5 * m + 1e-30,
                            "{} {name} {act:?} max_dq_size {max_dq_size} token {t} row {r}: {g} vs f64 {s}",
                            b.name()
                        );
                        if on_cuda && max_dq_size >= cols {
                            let chain = wr
                                .iter()
                                .zip(xt)
                                .fold(0f32, |a, (wv, xv)| wv.mul_add(*xv, a));
                            assert_eq!(
                                g.to_bits(),
                                chain.to_bits(),
                                "{} {name} token {t} row {r}: gemm {g:e} vs fma chain {chain:e}",
                                b.name()
                            );
                        }
                    }
                }
            }
        }
    }
    Ok(())
}
// The dequantised path's own GEMM, whatever tokens cuBLAS takes from.
test_device_without_cublas!(prompt_matmul_chunked_by_max_dq_size_matches_f64);

/// A weight type without a Q8-mode kernel (IQ4_NL, on every backend) is a typed error naming
/// it.
fn q8_mode_refuses_other_weight_types<B: Backend>(b: &B) -> Result<()> {
    let f = load("iq4_nl");
    let (rows, cols) = (f.want.len() / 256, 256);
    let w = upload(b, &f.raw)?;
    let x = upload(b, &vec![0u8; cols * 4])?;
    let mut y = b.alloc(rows * 4)?;
    let err = b
        .run(Op::Matmul {
            ty: f.ty,
            mode: MatvecMode::Q8,
            act: FloatType::F32,
            rows,
            cols,
            n_tok: 1,
            max_dq_size: 1 << 20,
            w: &w,
            x: &x,
            y: &mut y,
        })
        .unwrap_err();
    assert!(
        matches!(err, KernelError::Unsupported { .. }) && err.to_string().contains("iq4_nl"),
        "{}: {err}",
        b.name()
    );
    Ok(())
}
weightlift_kernels::test_device!(q8_mode_refuses_other_weight_types);

/// Float weights (f16, bf16, f32) in exact mode on every backend: one token (the bandwidth
/// matvec), 3 and 6 tokens (a pass of four and a short one), DQ_PATH_MIN_TOKENS + 3 (the
/// dequantised path), CUBLAS_MIN_TOKENS + 1 (cuBLAS on CUDA, where the operands are aligned;
/// the dequantised path where they are not), rows of 100 values (a tail past whole 16-byte chunks) and of 256 and 600,
/// 7 and 37 rows (blocks with rows past the last), the weights and activations read in place
/// at 16-byte aligned offsets and through views at offsets that are not (the CUDA kernels'
/// byte-by-byte path): within 1e-5 · Σ|w·x| of an f64 dot of the values as the `half` crate
/// reads them.
// Views of an uploaded buffer are unsafe (their lifetime is the caller's to keep).
#[allow(unsafe_code)]
fn float_weights_match_f64_at_any_alignment<B: Backend>(b: &B) -> Result<()> {
    let mut rng = Rng(0xbf16_0001);
    for (rows, cols) in [(7usize, 100usize), (37, 256), (5, 600)] {
        let wv = rng.vec(rows * cols, 1.5);
        for ty in [QuantType::F16, QuantType::BF16, QuantType::F32] {
            let (raw, w) = float_weights(ty, &wv);
            for n_tok in [1usize, 3, 6, DQ_PATH_MIN_TOKENS + 3, CUBLAS_MIN_TOKENS + 1] {
                let x = rng.vec(n_tok * cols, 1.0);
                let xb: Vec<u8> = x.iter().flat_map(|v| v.to_le_bytes()).collect();
                // offsets 0 (aligned) and 2 and 4: still aligned to the element, not to 16 bytes
                for (w_off, x_off) in [(0usize, 0usize), (2, 4)] {
                    let mut wpad = vec![0u8; w_off];
                    wpad.extend_from_slice(&raw);
                    let mut xpad = vec![0u8; x_off];
                    xpad.extend_from_slice(&xb);
                    let (wbuf, xbuf) = (upload(b, &wpad)?, upload(b, &xpad)?);
                    // SAFETY: the views are dropped at the end of this iteration, before the
                    // buffers; nothing writes to either meanwhile.
                    let wv_ = unsafe { b.view(&wbuf, w_off, raw.len()) }?;
                    // SAFETY: as above.
                    let xv_ = unsafe { b.view(&xbuf, x_off, xb.len()) }?;
                    let mut y = b.alloc(rows * n_tok * 4)?;
                    b.run(Op::Matmul {
                        ty,
                        mode: MatvecMode::Exact,
                        act: FloatType::F32,
                        rows,
                        cols,
                        n_tok,
                        max_dq_size: 1 << 20,
                        w: &wv_,
                        x: &xv_,
                        y: &mut y,
                    })?;
                    let got = download_f32(b, &y, rows * n_tok)?;
                    let (want, mag) = common::reference(&w, rows, cols, &x, n_tok);
                    for t in 0..n_tok {
                        for r in 0..rows {
                            let (s, m) = (want[t * rows + r], mag[t * rows + r]);
                            let g = f64::from(got[t * rows + r]);
                            assert!(
                                (g - s).abs() <= 1e-5 * m + 1e-30,
                                "{} {ty} {rows}x{cols} {n_tok} tokens, offsets {w_off}/{x_off}: token {t} row {r}: {g} vs f64 {s}",
                                b.name()
                            );
                        }
                    }
                }
            }
        }
    }
    Ok(())
}
weightlift_kernels::test_device!(float_weights_match_f64_at_any_alignment);

/// Decode's gate and up products with SwiGLU in one op (`MatmulSwiGlu`) give the bits of the
/// two ops it stands for (`MatmulShared` of the gate and up, then `SwiGluInPlace`) on every
/// backend: on CUDA one fused kernel for one token (float weights in exact mode, the Q8 types
/// in Q8 mode, f32 and f16 activations) and for 3 tokens of the types with decode's wide lanes
/// (q4_k, q6_k: a grid row a token), and the two ops for 3 tokens of the others, for a gate
/// and up of different types, and for q5_k in exact mode (no fused kernel). The float cases also lie
/// within the sums' error bound of `silu(g)·u` in f64. Gate and up of different row counts are
/// a typed error naming both.
fn matmul_swiglu_is_the_products_then_swiglu<B: Backend>(b: &B) -> Result<()> {
    let mut rng = Rng(0x5e61);
    // (gate type, up type, mode, rows, cols): the f16 rows of 1,004 values end past whole
    // 16-byte chunks; 600 rows take several threads (warps) a row on a large device
    let mut cases = vec![
        (QuantType::F16, QuantType::F16, MatvecMode::Exact, 96, 1004),
        (
            QuantType::BF16,
            QuantType::BF16,
            MatvecMode::Exact,
            600,
            256,
        ),
        (QuantType::F32, QuantType::F32, MatvecMode::Exact, 37, 512),
        (QuantType::Q5_K, QuantType::Q5_K, MatvecMode::Exact, 0, 256),
        (QuantType::Q4_0, QuantType::Q8_0, MatvecMode::Q8, 0, 256),
    ];
    for name in ["q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_k", "q6_k"] {
        let ty = load(name).ty;
        cases.push((ty, ty, MatvecMode::Q8, 0, 256));
    }
    for (gty, uty, mode, rows, cols) in cases {
        // quantised weights from gguf-py's fixtures (as many rows as both hold), float ones
        // random
        let weights = |ty: QuantType, rng: &mut Rng| -> (Vec<u8>, Option<Vec<f32>>) {
            if ty.block_size() == 1 {
                let (raw, w) = float_weights(ty, &rng.vec(rows * cols, 0.5));
                return (raw, Some(w));
            }
            (load(ty.name()).raw, None)
        };
        let row_bytes = |ty: QuantType| cols / ty.block_size() * ty.block_bytes();
        let (mut graw, gw) = weights(gty, &mut rng);
        let (mut uraw, uw) = weights(uty, &mut rng);
        let rows = if rows > 0 {
            rows
        } else {
            (graw.len() / row_bytes(gty)).min(uraw.len() / row_bytes(uty))
        };
        graw.truncate(rows * row_bytes(gty));
        uraw.truncate(rows * row_bytes(uty));
        let (wg, wu) = (upload(b, &graw)?, upload(b, &uraw)?);
        for n_tok in [1usize, 3] {
            for act in [FloatType::F32, FloatType::F16] {
                let (xbytes, xs) = activations(&rng.vec(n_tok * cols, 1.0), act);
                let x = upload(b, &xbytes)?;
                let n = n_tok * rows;
                // fused
                let (mut gy, mut uy) = (b.alloc(n * 4)?, b.alloc(n * 4)?);
                b.run(Op::MatmulSwiGlu {
                    mode,
                    act,
                    cols,
                    n_tok,
                    max_dq_size: 1 << 20,
                    x: &x,
                    gate: Product {
                        ty: gty,
                        rows,
                        w: &wg,
                        y: &mut gy,
                    },
                    up: Product {
                        ty: uty,
                        rows,
                        w: &wu,
                        y: &mut uy,
                    },
                })?;
                let got = download_f32(b, &gy, n)?;
                // the two ops
                let (mut gy2, mut uy2) = (b.alloc(n * 4)?, b.alloc(n * 4)?);
                b.run(Op::MatmulShared {
                    mode,
                    act,
                    cols,
                    n_tok,
                    max_dq_size: 1 << 20,
                    x: &x,
                    products: vec![
                        Product {
                            ty: gty,
                            rows,
                            w: &wg,
                            y: &mut gy2,
                        },
                        Product {
                            ty: uty,
                            rows,
                            w: &wu,
                            y: &mut uy2,
                        },
                    ],
                })?;
                b.run(Op::SwiGluInPlace {
                    n,
                    gate: &mut gy2,
                    up: &uy2,
                })?;
                let want = download_f32(b, &gy2, n)?;
                let what = format!(
                    "{} {gty}/{uty} {mode:?} {rows}x{cols} {n_tok} tokens {act:?}",
                    b.name()
                );
                for i in 0..n {
                    assert_eq!(
                        got[i].to_bits(),
                        want[i].to_bits(),
                        "{what}: output {i}: fused {} vs the two ops {}",
                        got[i],
                        want[i]
                    );
                }
                let (Some(gw), Some(uw)) = (&gw, &uw) else {
                    continue;
                };
                let (gs, gm) = common::reference(gw, rows, cols, &xs, n_tok);
                let (us, um) = common::reference(uw, rows, cols, &xs, n_tok);
                for i in 0..n {
                    let silu = gs[i] / (1.0 + (-gs[i]).exp());
                    let want = silu * us[i];
                    let bound = 1.1 * us[i].abs() * 1e-5 * gm[i]
                        + silu.abs() * 1e-5 * um[i]
                        + 4e-7 * want.abs()
                        + 1e-30;
                    assert!(
                        (f64::from(got[i]) - want).abs() <= bound,
                        "{what}: output {i}: {} vs f64 {want}",
                        got[i]
                    );
                }
            }
        }
    }
    // gate and up rows must pair up
    let f = load("q8_0");
    let w = upload(b, &f.raw[..2 * 34 * 8])?;
    let x = upload(b, &vec![0u8; 256 * 4])?;
    let (mut gy, mut uy) = (b.alloc(2 * 4)?, b.alloc(2 * 4)?);
    let err = b
        .run(Op::MatmulSwiGlu {
            mode: MatvecMode::Q8,
            act: FloatType::F32,
            cols: 256,
            n_tok: 1,
            max_dq_size: 1 << 20,
            x: &x,
            gate: Product {
                ty: f.ty,
                rows: 2,
                w: &w,
                y: &mut gy,
            },
            up: Product {
                ty: f.ty,
                rows: 1,
                w: &w,
                y: &mut uy,
            },
        })
        .unwrap_err();
    assert!(
        err.to_string()
            .contains("gate matrix has 2 rows and the up matrix 1"),
        "{}: {err}",
        b.name()
    );
    Ok(())
}
weightlift_kernels::test_device!(matmul_swiglu_is_the_products_then_swiglu);

/// Decode's q, k and v as one [`Op::MatmulShared`] give each member the bits of its own
/// [`Op::Matmul`]: on CUDA one launch for the three where their own launches share a block
/// shape (`matvec3_*`, `q8_matvec3_*`, `q8_wide_matvec3_*`), each member's launch where they
/// do not (the long rows below spread their few k and v rows over more threads). Float
/// weights in exact mode (f32 and f16 activations), the Q8 types in Q8 mode at one token and,
/// for the wide-lane types, three (a batch's step).
fn decode_q_k_v_in_one_op_keep_each_members_bits<B: Backend>(b: &B) -> Result<()> {
    let mut rng = Rng(0x9_4e7);
    let mut cases = Vec::new();
    for ty in [QuantType::F16, QuantType::BF16, QuantType::F32] {
        for act in [FloatType::F32, FloatType::F16] {
            for cols in [256, 4096] {
                cases.push((ty, MatvecMode::Exact, act, cols, 1));
            }
        }
    }
    for ty in [
        QuantType::Q4_0,
        QuantType::Q8_0,
        QuantType::Q4_K,
        QuantType::Q6_K,
    ] {
        for n_tok in [1, 3] {
            cases.push((ty, MatvecMode::Q8, FloatType::F32, 512, n_tok));
        }
    }
    for (ty, mode, act, cols, n_tok) in cases {
        // q, then k and v of a quarter of its rows (grouped-query attention)
        let rows = [96, 24, 24];
        let mut ws = Vec::new();
        for r in rows {
            ws.push(upload(
                b,
                &weight_bytes(ty, &rng.vec(r * cols, 0.3), cols)?,
            )?);
        }
        let (xbytes, _) = activations(&rng.vec(n_tok * cols, 1.0), act);
        let x = upload(b, &xbytes)?;
        let members: Vec<_> = ws.iter().zip(rows).map(|(w, rows)| (ty, rows, w)).collect();
        let outs = shared_and_alone(b, (mode, act), (cols, n_tok, 1 << 20), &x, &members)?;
        for (m, ((shared, alone), rows)) in outs.iter().zip(rows).enumerate() {
            let what = format!(
                "{} {ty} {mode:?} {act:?} {cols} cols, {n_tok} tokens",
                b.name()
            );
            assert!(
                shared.iter().any(|v| *v != 0.0),
                "{what}: member {m} is all zeros"
            );
            for i in 0..rows * n_tok {
                assert_eq!(
                    shared[i].to_bits(),
                    alone[i].to_bits(),
                    "{what}: member {m} output {i}: shared {} vs alone {}",
                    shared[i],
                    alone[i]
                );
            }
        }
    }
    Ok(())
}
weightlift_kernels::test_device!(decode_q_k_v_in_one_op_keep_each_members_bits);
