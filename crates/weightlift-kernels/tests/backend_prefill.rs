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

/// The kernel bench's route table forces each route with a backend of its own: with cuBLAS
/// never, a fast-mode f16 prompt of 4 tokens is the exact kernels' result bit for bit (f16
/// weights take the exact kernels below the threshold); with cuBLAS from one token it is not
/// (cuBLAS rounds the activations to f16) and stays within the fast bound; and a count of its
/// own for f16 in fast mode sends those products back to the kernels.
#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda -- --ignored on a machine with one"]
fn cublas_min_tokens_force_each_route() -> Result<()> {
    use weightlift_kernels::sources::CublasMinTokens;
    let never = CudaBackend::new(0)?.with_cublas_min_tokens(CublasMinTokens::uniform(usize::MAX));
    let always = CudaBackend::new(0)?.with_cublas_min_tokens(CublasMinTokens::uniform(1));
    let f16_own = CudaBackend::new(0)?.with_cublas_min_tokens(CublasMinTokens::uniform(1).with(
        QuantType::F16,
        MatvecMode::Q8,
        usize::MAX,
    ));
    always.cublas_ready()?;
    assert_eq!(
        f16_own.cublas_min_tokens_for(QuantType::F16, MatvecMode::Q8),
        usize::MAX
    );
    assert_eq!(
        f16_own.cublas_min_tokens_for(QuantType::F16, MatvecMode::Exact),
        1
    );
    let mut rng = Rng(0x9e1f_0003);
    let (rows, cols, n_tok) = (37, 256, 4);
    let (raw, wv) = float_weights(QuantType::F16, &rng.vec(rows * cols, 1.5));
    let x = rng.vec(n_tok * cols, 1.0);
    let shape = (rows, cols, n_tok);
    let on = |b: &CudaBackend, mode: MatvecMode| -> Result<Vec<f32>> {
        let w = upload(b, &raw)?;
        run(b, QuantType::F16, mode, shape, 1 << 20, &w, &x)
    };
    let exact = on(&never, MatvecMode::Exact)?;
    assert_eq!(
        on(&never, MatvecMode::Q8)?,
        exact,
        "cuBLAS never: the kernels"
    );
    assert_eq!(
        on(&f16_own, MatvecMode::Q8)?,
        exact,
        "f16's own count: the kernels"
    );
    let tensor_cores = on(&always, MatvecMode::Q8)?;
    assert_ne!(
        tensor_cores, exact,
        "cuBLAS from one token: not the kernels"
    );
    check(
        "cuBLAS from one token",
        &tensor_cores,
        &wv,
        &x,
        shape,
        |_, _, m| (2f64.powi(-11) + 1e-5) * m,
    );
    Ok(())
}

/// The cache formats every attention kernel reads, as (keys, values).
const KV_FORMATS: [(KvFormat, KvFormat); 7] = [
    (KvFormat::F32, KvFormat::F32),
    (KvFormat::F16, KvFormat::F16),
    (KvFormat::BF16, KvFormat::BF16),
    (KvFormat::E4M3, KvFormat::E4M3),
    (KvFormat::Q8, KvFormat::Q8),
    (KvFormat::Q4, KvFormat::Q4),
    (KvFormat::Q8, KvFormat::Q4),
];

/// One prompt-attention case: its shape, window, soft-cap, queries and stored cache rows.
struct AttCase {
    formats: (KvFormat, KvFormat),
    shape: cpu::attention::AttnShape,
    window: usize,
    softcap: f32,
    q: Vec<f32>,
    k: Vec<u8>,
    v: Vec<u8>,
}

/// Every case the prompt-attention tests run: each cache format; heads of 64 and 128 values
/// (40 for the float caches: a partial lane layout) with GQA ratios 1, 3 and 8; prompts of
/// 17 and 40 queries from position 0 and continuing a cache of 37 rows (a chunked prompt);
/// no window and a window of 20 keys (shorter than a key tile, so early tiles are skipped for
/// the late rows); gemma's soft-cap; with and without f16 operands.
fn attention_cases(rng: &mut Rng) -> Vec<AttCase> {
    let mut out = Vec::new();
    for (nh, kvh) in [(4usize, 4usize), (6, 2), (8, 1)] {
        for hd in [40usize, 64, 128] {
            for (n_q, start) in [(17usize, 0usize), (40, 37)] {
                let rows = start + n_q;
                let q = rng.vec(n_q * nh * hd, 2.0);
                let kx = rng.vec(rows * kvh * hd, 2.0);
                let vx = rng.vec(rows * kvh * hd, 1.0);
                for (ci, &(kf, vf)) in KV_FORMATS.iter().enumerate() {
                    if hd % 32 != 0 && (kf.quant().is_some() || kf == KvFormat::E4M3) {
                        continue;
                    }
                    let mut k = vec![0u8; kf.byte_at(kx.len())];
                    let mut v = vec![0u8; vf.byte_at(vx.len())];
                    kv_encode(kf, &kx, &mut k).unwrap();
                    kv_encode(vf, &vx, &mut v).unwrap();
                    // the window, soft-cap and f16 operands vary with the case, not all at once
                    let (window, softcap) = match (ci + n_q) % 3 {
                        0 => (0, 0.0),
                        1 => (20, 0.0),
                        _ => (0, 30.0),
                    };
                    for f16_operands in [false, true] {
                        let shape = cpu::attention::AttnShape::new(
                            nh,
                            kvh,
                            hd,
                            n_q,
                            start,
                            1.0 / (hd as f32).sqrt(),
                            f16_operands,
                        )
                        .unwrap();
                        out.push(AttCase {
                            formats: (kf, vf),
                            shape,
                            window,
                            softcap,
                            q: q.clone(),
                            k: k.clone(),
                            v: v.clone(),
                        });
                    }
                }
            }
        }
    }
    out
}

/// `Op::Attention` of case `c` on backend `b`.
fn attention_on<B: Backend>(b: &B, c: &AttCase) -> Result<Vec<f32>> {
    let (qb, kb, vb) = (
        upload(b, bytemuck::cast_slice(&c.q))?,
        upload(b, &c.k)?,
        upload(b, &c.v)?,
    );
    let mut out = b.alloc(c.q.len() * 4)?;
    let s = c.shape;
    b.run(Op::Attention {
        k_format: c.formats.0,
        v_format: c.formats.1,
        n_heads: s.n_heads,
        kv_heads: s.kv_heads,
        head_dim: s.head_dim,
        n_q: s.n_q,
        start: s.start,
        scale: s.scale,
        window: c.window,
        softcap: c.softcap,
        cache_rows: s.start + s.n_q,
        tile: 256,
        f16_operands: s.f16_operands,
        q: &qb,
        k: &kb,
        v: &vb,
        out: &mut out,
        scratch: None,
        start_at: None,
    })?;
    download_f32(b, &out, c.q.len())
}

/// Within 2e-6 (1e-5 past 64 keys, whose sums are longer; 2e-3 with f16 operands, whose
/// weights are rounded against each tile's running maximum, not the CPU's).
fn attention_close(what: &str, c: &AttCase, got: &[f32], want: &[f32]) {
    let s = c.shape;
    let tol = match (s.f16_operands, s.start + s.n_q > 64) {
        (true, _) => 2e-3,
        (false, false) => 2e-6,
        (false, true) => 1e-5,
    };
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= tol,
            "{what} {:?}/{:?} {}/{} heads of {}, n_q {} start {}, window {} softcap {}, f16 ops \
             {}: value {i}: {g} vs cpu {w}",
            c.formats.0,
            c.formats.1,
            s.n_heads,
            s.kv_heads,
            s.head_dim,
            s.n_q,
            s.start,
            c.window,
            c.softcap,
            s.f16_operands
        );
    }
}

/// The prompt attention kernel's tile algorithm (`attention_prefill_{format}`), replayed on the
/// host with its own header functions, against the CPU backend's attention over the same
/// stored rows, for every case of [`attention_cases`].
#[cfg(wl_host_shim)]
#[test]
fn prompt_attention_twin_matches_the_cpu_backend() {
    use weightlift_kernels::host_shim;
    let cpu = CpuBackend::new();
    let cases = attention_cases(&mut Rng(0xfa01));
    for c in &cases {
        let want = attention_on(&cpu, c).unwrap();
        let mut got = vec![f32::NAN; c.q.len()];
        host_shim::attention_prefill(
            c.formats.0,
            c.formats.1,
            c.shape,
            (c.window, c.softcap, c.shape.start + c.shape.n_q),
            &c.q,
            &c.k,
            &c.v,
            &mut got,
        )
        .unwrap();
        attention_close("twin", c, &got, &want);
    }
    // 3 head layouts × (3 + 7 + 7 formats) × 2 prompts × 2 operand roundings
    assert_eq!(cases.len(), 3 * 17 * 2 * 2);
}

/// The twin's rows a block and the launch's agree for every head the kernel takes, and it
/// refuses wider heads, naming them.
#[cfg(wl_host_shim)]
#[test]
fn prompt_attention_blocks_are_the_kernels() {
    use weightlift_kernels::host_shim;
    use weightlift_kernels::sources::{ATTENTION_PREFILL_MAX_HEAD_DIM, attention_prefill_rows};
    for hd in 1..=ATTENTION_PREFILL_MAX_HEAD_DIM {
        assert_eq!(
            host_shim::attention_prefill_rows(hd),
            attention_prefill_rows(hd),
            "head_dim {hd}"
        );
    }
    let wide = cpu::attention::AttnShape::new(2, 1, 160, 1, 0, 0.1, false).unwrap();
    let (q, kv, mut out) = (vec![0f32; 320], vec![0u8; 160 * 4], vec![0f32; 320]);
    let e = host_shim::attention_prefill(
        KvFormat::F32,
        KvFormat::F32,
        wide,
        (0, 0.0, 1),
        &q,
        &kv,
        &kv,
        &mut out,
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("head_dim 160: the kernel takes at most 128"),
        "{e}"
    );
}

/// Prompt attention on every backend against the CPU backend, for the cases of
/// [`attention_cases`]: on CUDA `attention_prefill_{format}` (at least
/// `ATTENTION_PREFILL_MIN_QUERIES` queries, heads up to 128), with its chunked prompts
/// continuing a cache, windows and soft-cap.
fn prompt_attention_matches_the_cpu_backend<B: Backend>(b: &B) -> Result<()> {
    use weightlift_kernels::sources::ATTENTION_PREFILL_MIN_QUERIES;
    let cpu = CpuBackend::new();
    let cases = attention_cases(&mut Rng(0xfa02));
    assert!(
        cases
            .iter()
            .all(|c| c.shape.n_q >= ATTENTION_PREFILL_MIN_QUERIES)
    );
    for c in &cases {
        let want = attention_on(&cpu, c)?;
        let got = attention_on(b, c)?;
        attention_close(&b.name(), c, &got, &want);
    }
    Ok(())
}
weightlift_kernels::test_device!(prompt_attention_matches_the_cpu_backend);
