//! Prompt products on every backend present (`test_device!`), at token counts on both sides of
//! [`CUBLAS_MIN_TOKENS`] (where CUDA moves them to cuBLAS), in exact and fast mode, for f16 and
//! bf16 weights and q8_0 and q4_k (gguf-py's fixtures in exact mode). Reference: f64 dot
//! products of the weights as gguf-py dequantises them (or as the `half` crate reads the float
//! ones), within each mode's bound:
//!
//! - exact: `1e-5 · Σ|w·x|` (f32 products and sums in any order; cuBLAS's f32 GEMM runs with
//!   `CUBLAS_COMPUTE_32F_PEDANTIC`, so no TF32);
//! - fast, float weights: the activations rounded to the weights' type, `2⁻¹¹ · Σ|w·x|` for f16
//!   and `2⁻⁸` for bf16, plus the exact bound (the CPU and CUDA's short prompts round nothing);
//! - fast, quantised weights: the larger of the Q8 activations' bound (the Q8 kernels) and
//!   `2⁻¹⁰ · Σ|w·x|` (CUDA's cuBLAS route rounds the dequantised weights and the activations
//!   to f16 each), plus the exact bound.
//!
//! On CUDA, `cublas_is_ready_on_this_gpu` checks that the GPU machine found libcublas, so the
//! cases above ran the cuBLAS routes and not the fallback.

// Reference loops index several arrays in lock-step; iterators would hide the maths.
#![allow(clippy::needless_range_loop)]

mod common;

use common::{Rng, download_f32, float_weights, load, q8_bound, upload};
use weightlift_kernels::sources::CUBLAS_MIN_TOKENS;
use weightlift_kernels::*;

/// The token counts of every case: one short of the threshold, the threshold, and past it
/// with a tail that fills no tile.
fn token_counts() -> [usize; 3] {
    [
        CUBLAS_MIN_TOKENS - 1,
        CUBLAS_MIN_TOKENS,
        CUBLAS_MIN_TOKENS + 7,
    ]
}

/// Runs one `Op::Matmul` and returns its `n_tok × rows` outputs.
#[allow(clippy::too_many_arguments)]
fn run<B: Backend>(
    b: &B,
    ty: QuantType,
    mode: MatvecMode,
    (rows, cols, n_tok): (usize, usize, usize),
    max_dq_size: usize,
    w: &B::Buffer,
    x: &[f32],
) -> Result<Vec<f32>> {
    let xb = upload(b, bytemuck::cast_slice(x))?;
    let mut y = b.alloc(rows * n_tok * 4)?;
    b.run(Op::Matmul {
        ty,
        mode,
        act: FloatType::F32,
        rows,
        cols,
        n_tok,
        max_dq_size,
        w,
        x: &xb,
        y: &mut y,
    })?;
    download_f32(b, &y, rows * n_tok)
}

/// Asserts `got` within `bound(t, r, Σ|w·x|)` of the f64 reference of `w` (the values the
/// weights stand for) and `x`.
fn check(
    what: &str,
    got: &[f32],
    w: &[f32],
    x: &[f32],
    (rows, cols, n_tok): (usize, usize, usize),
    bound: impl Fn(usize, usize, f64) -> f64,
) {
    let (want, mag) = common::reference(w, rows, cols, x, n_tok);
    for t in 0..n_tok {
        for r in 0..rows {
            let i = t * rows + r;
            let (g, s) = (f64::from(got[i]), want[i]);
            let lim = bound(t, r, mag[i]) + 1e-30;
            assert!(
                (g - s).abs() <= lim,
                "{what}: token {t} row {r}: {g} vs f64 {s} (bound {lim:e})"
            );
        }
    }
}

/// Exact mode: f16, bf16, q8_0 and q4_k weights, in one chunk and in chunks of five rows (the
/// last one short), within `1e-5 · Σ|w·x|` of f64.
fn exact_prompt_products_match_f64<B: Backend>(b: &B) -> Result<()> {
    let mut rng = Rng(0x9e1f_0001);
    let cols = 256;
    let mut cases: Vec<(QuantType, Vec<u8>, Vec<f32>)> = Vec::new();
    for ty in [QuantType::F16, QuantType::BF16] {
        let (raw, w) = float_weights(ty, &rng.vec(37 * cols, 1.5));
        cases.push((ty, raw, w));
    }
    for name in ["q8_0", "q4_k"] {
        let f = load(name);
        cases.push((f.ty, f.raw, f.want));
    }
    for (ty, raw, wv) in &cases {
        let rows = wv.len() / cols;
        let w = upload(b, raw)?;
        for n_tok in token_counts() {
            let x = rng.vec(n_tok * cols, 1.0);
            for max_dq_size in [cols * 5, 1 << 20] {
                let shape = (rows, cols, n_tok);
                let got = run(b, *ty, MatvecMode::Exact, shape, max_dq_size, &w, &x)?;
                let what = format!(
                    "{} exact {ty} {n_tok} tokens, max_dq_size {max_dq_size}",
                    b.name()
                );
                check(&what, &got, wv, &x, shape, |_, _, m| 1e-5 * m);
            }
        }
    }
    Ok(())
}
weightlift_kernels::test_device!(exact_prompt_products_match_f64);

/// Fast mode (the mode that may round activations): f16 and bf16 weights (fast on CUDA; exact
/// on the CPU, which has no fast mode for them) and q8_0 and q4_k (every backend's Q8 mode),
/// within the fast bounds of the module docs.
fn fast_prompt_products_match_f64<B: Backend>(b: &B) -> Result<()> {
    let mut rng = Rng(0x9e1f_0002);
    let on_cuda = b.name().starts_with("cuda");
    let cols = 256;
    for ty in [QuantType::F16, QuantType::BF16] {
        let rows = 37;
        let (raw, wv) = float_weights(ty, &rng.vec(rows * cols, 1.5));
        let w = upload(b, &raw)?;
        let mode = if on_cuda {
            MatvecMode::Q8
        } else {
            MatvecMode::Exact
        };
        let rounding = if ty == QuantType::BF16 {
            2f64.powi(-8)
        } else {
            2f64.powi(-11)
        };
        for n_tok in token_counts() {
            let x = rng.vec(n_tok * cols, 1.0);
            let shape = (rows, cols, n_tok);
            let got = run(b, ty, mode, shape, 1 << 20, &w, &x)?;
            let what = format!("{} fast {ty} {n_tok} tokens", b.name());
            check(&what, &got, &wv, &x, shape, |_, _, m| (rounding + 1e-5) * m);
        }
    }
    // gguf-py's fixtures hold scales up to 1e38, past f16's range, which a model's weights
    // never reach: fast mode's weights are model-like values quantised by our quantiser (its
    // bytes checked against llama.cpp's in `quantize.rs`) and read back by our dequantiser
    // (checked against gguf-py in `known_answers.rs`).
    for ty in [QuantType::Q8_0, QuantType::Q4_K] {
        let name = ty.name();
        let rows = 19;
        let mut raw = vec![0u8; rows * quantized_row_bytes(ty, cols)?];
        quantize_rows(ty, &rng.vec(rows * cols, 0.2), cols, &mut raw)?;
        let mut want = vec![0f32; rows * cols];
        dequantize_f32(ty, &raw, &mut want)?;
        let f = common::Fixture { ty, raw, want };
        let w = upload(b, &f.raw)?;
        for n_tok in token_counts() {
            let x = rng.vec(n_tok * cols, 1.0);
            let shape = (rows, cols, n_tok);
            let q8 = q8_bound(&f.want, rows, cols, &x, n_tok);
            // the cuBLAS route's rounding on the host: weights and activations to f16, f32
            // products summed in f32, within the bound it is held to
            let h = |v: &f32| half::f16::from_f32(*v).to_f32();
            let (wh, xh): (Vec<f32>, Vec<f32>) =
                (f.want.iter().map(h).collect(), x.iter().map(h).collect());
            let twin: Vec<f32> = (0..n_tok * rows)
                .map(|i| {
                    let (t, r) = (i / rows, i % rows);
                    (0..cols).fold(0f32, |a, c| wh[r * cols + c].mul_add(xh[t * cols + c], a))
                })
                .collect();
            check(
                "the f16 route's rounding",
                &twin,
                &f.want,
                &x,
                shape,
                |_, _, m| (2f64.powi(-10) + 1e-5) * m,
            );
            for max_dq_size in [cols * 5, 1 << 20] {
                let got = run(b, f.ty, MatvecMode::Q8, shape, max_dq_size, &w, &x)?;
                let what = format!(
                    "{} fast {name} {n_tok} tokens, max_dq_size {max_dq_size}",
                    b.name()
                );
                check(&what, &got, &f.want, &x, shape, |t, r, m| {
                    q8[t * rows + r].max(2f64.powi(-10) * m) + 1e-5 * m
                });
            }
        }
    }
    Ok(())
}
weightlift_kernels::test_device!(fast_prompt_products_match_f64);

/// On a GPU machine, libcublas is found and a handle made, so the cases above ran the cuBLAS
/// routes past the threshold; a machine without it fails here, naming the library.
#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda -- --ignored on a machine with one"]
fn cublas_is_ready_on_this_gpu() -> Result<()> {
    let b = CudaBackend::new(0)?;
    b.cublas_ready()?;
    assert_eq!(
        b.cublas_min_tokens(),
        std::env::var("WEIGHTLIFT_CUBLAS_MIN_TOKENS")
            .ok()
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(CUBLAS_MIN_TOKENS)
    );
    Ok(())
}
