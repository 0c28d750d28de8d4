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
//!
//! The Q8 mode's third prompt route, the int8 tensor-core kernels `q8_mma_{type}`, is replayed
//! on the host (`mmq_twin`) for every Q8 type against the CPU backend: its bits past the CPU's
//! batch of 16 tokens (the same order of additions), within the order bound below, and exact
//! wherever the sums are; its GPU case compares the device with the replay bit for bit.

// Reference loops index several arrays in lock-step; iterators would hide the maths.
#![allow(clippy::needless_range_loop)]

mod common;

use common::{
    Rng, download_f32, float_weights, load, q8_bound, shared_and_alone, upload, weight_bytes,
};
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

/// A shared prompt product ([`Op::MatmulShared`]: a layer's q, k and v, or its gate and up)
/// gives each member the bits of its own [`Op::Matmul`], in both modes, on both sides of the
/// cuBLAS threshold and with the weights dequantised in one chunk or in chunks of five rows.
/// The members have f16, bf16, q8_0 and q4_k weights of different row counts: on CUDA's fast
/// cuBLAS route the activations are rounded once to f16 for three of them and once to bf16 for
/// the bf16 one, where each product alone rounds them again. Fast mode takes the float members
/// only where it has a fast mode for them (CUDA).
fn shared_prompt_products_are_each_members_own<B: Backend>(b: &B) -> Result<()> {
    let mut rng = Rng(0x9e1f_0004);
    let on_cuda = b.name().starts_with("cuda");
    let cols = 256;
    let mut members: Vec<(QuantType, usize, B::Buffer)> = Vec::new();
    for (ty, rows) in [
        (QuantType::F16, 37),
        (QuantType::Q8_0, 19),
        (QuantType::BF16, 11),
        (QuantType::Q4_K, 23),
    ] {
        let raw = weight_bytes(ty, &rng.vec(rows * cols, 0.2), cols)?;
        members.push((ty, rows, upload(b, &raw)?));
    }
    for mode in [MatvecMode::Exact, MatvecMode::Q8] {
        let these: Vec<&(QuantType, usize, B::Buffer)> = members
            .iter()
            .filter(|(ty, ..)| {
                mode == MatvecMode::Exact
                    || on_cuda
                    || !matches!(ty, QuantType::F16 | QuantType::BF16)
            })
            .collect();
        for n_tok in token_counts() {
            let x = rng.vec(n_tok * cols, 1.0);
            let xb = upload(b, bytemuck::cast_slice(&x))?;
            for max_dq_size in [cols * 5, 1 << 20] {
                let members: Vec<_> = these.iter().map(|(ty, rows, w)| (*ty, *rows, w)).collect();
                let shape = (cols, n_tok, max_dq_size);
                let outs = shared_and_alone(b, (mode, FloatType::F32), shape, &xb, &members)?;
                for ((shared, alone), (ty, ..)) in outs.iter().zip(&these) {
                    let what = format!(
                        "{} {mode:?} {ty} {n_tok} tokens, max_dq_size {max_dq_size}",
                        b.name()
                    );
                    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(shared), bits(alone), "{what}: shared vs alone");
                }
            }
        }
    }
    Ok(())
}
weightlift_kernels::test_device!(shared_prompt_products_are_each_members_own);

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
    /// The cache's rows: the key at position p is in row p % rows (a sliding window's ring
    /// when fewer than the positions).
    rows: usize,
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
                            rows,
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
        cache_rows: c.rows,
        tile: 256,
        f16_operands: s.f16_operands,
        q: &qb,
        k: &kb,
        v: &vb,
        out: &mut out,
        scratch: None,
        start_at: None,
        q8_next: false,
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
            (c.window, c.softcap, c.rows),
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

/// The cases of the tensor-core prompt kernel (`attention_prefill_mma_{format}`: fast mode,
/// heads of 64 and 128 values), for each cache format of [`KV_FORMATS`]: GQA groups 8, 3 and
/// 1; prompts of 37 queries from position 0 and of 70 continuing a cache of 45 rows (row
/// counts no multiple of 16 or 64); no mask, a window of 20 keys, gemma's soft-cap, and a
/// window of 24 over a ring of `window + n_q - 1` rows (fewer than the 115 positions of the
/// chunked prompt).
fn mma_cases(rng: &mut Rng) -> Vec<AttCase> {
    let mut out = Vec::new();
    for (nh, kvh) in [(8usize, 1usize), (6, 2), (4, 4)] {
        for hd in [64usize, 128] {
            for (n_q, start) in [(37usize, 0usize), (70, 45)] {
                let keys = start + n_q;
                let kvd = kvh * hd;
                let q = rng.vec(n_q * nh * hd, 2.0);
                let (kx, vx) = (rng.vec(keys * kvd, 2.0), rng.vec(keys * kvd, 1.0));
                for (kf, vf) in KV_FORMATS {
                    let enc = |f: KvFormat, x: &[f32]| {
                        let mut b = vec![0u8; f.byte_at(x.len())];
                        kv_encode(f, x, &mut b).unwrap();
                        b
                    };
                    let (k, v) = (enc(kf, &kx), enc(vf, &vx));
                    for (window, softcap, ring) in [
                        (0, 0.0, false),
                        (20, 0.0, false),
                        (0, 30.0, false),
                        (24, 0.0, true),
                    ] {
                        let rows = if ring { window + n_q - 1 } else { keys };
                        // position p in row p % rows: the last `rows` positions survive
                        let ring_of = |f: KvFormat, full: &[u8]| {
                            let row = f.byte_at(kvd);
                            let mut b = vec![0u8; rows * row];
                            for p in keys.saturating_sub(rows)..keys {
                                let r = p % rows;
                                b[r * row..(r + 1) * row]
                                    .copy_from_slice(&full[p * row..(p + 1) * row]);
                            }
                            b
                        };
                        let shape = cpu::attention::AttnShape::new(
                            nh,
                            kvh,
                            hd,
                            n_q,
                            start,
                            1.0 / (hd as f32).sqrt(),
                            true,
                        )
                        .unwrap();
                        out.push(AttCase {
                            formats: (kf, vf),
                            shape,
                            window,
                            softcap,
                            rows,
                            q: q.clone(),
                            k: ring_of(kf, &k),
                            v: ring_of(vf, &v),
                        });
                    }
                }
            }
        }
    }
    out
}

/// The largest |got - want| of two outputs.
fn max_diff(got: &[f32], want: &[f32]) -> f32 {
    got.iter()
        .zip(want)
        .map(|(g, w)| (g - w).abs())
        .fold(0.0, f32::max)
}

#[cfg(wl_host_shim)]
mod mma_twin {
    use super::*;
    use rayon::prelude::*;
    use weightlift_kernels::host_shim::fa_mma as fm;

    /// One register file a lane, for the 32 lanes of a warp.
    type Regs<T, const N: usize> = [[T; N]; 32];

    /// The fragment maps read once from the header: A (lane, register, half) -> (row, col),
    /// B -> (k, n), C -> (row, col).
    struct Maps {
        a: Regs<[(usize, usize); 2], 4>,
        b: Regs<[(usize, usize); 2], 2>,
        c: Regs<(usize, usize), 4>,
    }

    impl Maps {
        fn new() -> Maps {
            let mut m = Maps {
                a: [[[(0, 0); 2]; 4]; 32],
                b: [[[(0, 0); 2]; 2]; 32],
                c: [[(0, 0); 4]; 32],
            };
            for lane in 0..32 {
                for reg in 0..4 {
                    for hf in 0..2 {
                        m.a[lane][reg][hf] = fm::a_elem(lane, reg, hf).unwrap();
                        if reg < 2 {
                            m.b[lane][reg][hf] = fm::b_elem(lane, reg, hf).unwrap();
                        }
                    }
                    m.c[lane][reg] = fm::c_elem(lane, reg).unwrap();
                }
            }
            m
        }

        /// One m16n8k16 product of the warp, D = A B + C in place: A, B and C built from the
        /// 32 lanes' registers through the maps, each D element the f32 sum of C and the exact
        /// f16 products in k order, written back through the C map.
        fn mma(&self, d: &mut Regs<f32, 4>, a: &Regs<u32, 4>, b: &Regs<u32, 2>) {
            let half = |w: u32, hf: usize| half::f16::from_bits((w >> (16 * hf)) as u16).to_f32();
            let (mut am, mut bm, mut cm) = ([[0f32; 16]; 16], [[0f32; 8]; 16], [[0f32; 8]; 16]);
            for lane in 0..32 {
                for reg in 0..4 {
                    for hf in 0..2 {
                        let (r, c) = self.a[lane][reg][hf];
                        am[r][c] = half(a[lane][reg], hf);
                        if reg < 2 {
                            let (k, n) = self.b[lane][reg][hf];
                            bm[k][n] = half(b[lane][reg], hf);
                        }
                    }
                    let (r, c) = self.c[lane][reg];
                    cm[r][c] = d[lane][reg];
                }
            }
            for lane in 0..32 {
                for reg in 0..4 {
                    let (r, c) = self.c[lane][reg];
                    d[lane][reg] = (0..16).fold(cm[r][c], |s, k| s + am[r][k] * bm[k][c]);
                }
            }
        }
    }

    /// The largest and the sum of each row half over the 4 lanes of its quad, as the kernel's
    /// two xor shuffles leave them in every lane: max, and (a0 + a1) + (a2 + a3).
    fn quad_max(x: &Regs<f32, 2>) -> Regs<f32, 2> {
        std::array::from_fn(|lane| {
            let q = lane & !3;
            std::array::from_fn(|hf| {
                (q..q + 4)
                    .map(|l| x[l][hf])
                    .fold(f32::NEG_INFINITY, f32::max)
            })
        })
    }
    fn quad_sum(x: &Regs<f32, 2>) -> Regs<f32, 2> {
        std::array::from_fn(|lane| {
            let q = lane & !3;
            std::array::from_fn(|hf| (x[q][hf] + x[q + 1][hf]) + (x[q + 2][hf] + x[q + 3][hf]))
        })
    }

    /// One warp's registers: the query fragments of each k-step, S, O of each 8-dim block,
    /// and the two rows' running maximum and sum, per lane.
    struct Warp {
        qa: Vec<Regs<u32, 4>>,
        qi: Regs<u64, 2>,
        o: Vec<Regs<f32, 4>>,
        m: Regs<f32, 2>,
        l: Regs<f32, 2>,
    }

    /// `n` values of a cache half stored as `f` from value `first`, as the kernels' readers
    /// decode them: f32 as stored, f16 widened exactly, the others through the shim's
    /// `kv_load` (the device codec: e4m3 and bf16 widened, the turned groups' butterflies and
    /// norm).
    fn decode_row(f: KvFormat, b: &[u8], first: usize, n: usize) -> Vec<f32> {
        let bytes = &b[f.byte_at(first)..f.byte_at(first + n)];
        match f {
            KvFormat::F32 => bytes
                .chunks_exact(4)
                .map(|x| f32::from_le_bytes([x[0], x[1], x[2], x[3]]))
                .collect(),
            KvFormat::F16 => bytes
                .chunks_exact(2)
                .map(|x| half::f16::from_le_bytes([x[0], x[1]]).to_f32())
                .collect(),
            _ => {
                let mut out = vec![0.0; n];
                weightlift_kernels::host_shim::kv_load(f, bytes, &mut out).unwrap();
                out
            }
        }
    }

    /// What `attention_prefill_mma_{format}` computes for case `c`, its blocks replayed on the
    /// host step for step: the staging (the readers' values packed into f16 pairs) through the
    /// header's word maps, each warp's products through
    /// [`Maps::mma`], its lanes' softmax steps through the header, the shuffles as quad
    /// reductions.
    pub(super) fn replay(c: &AttCase) -> Vec<f32> {
        let maps = Maps::new();
        let s = c.shape;
        let (hd, group) = (s.head_dim, s.n_heads / s.kv_heads);
        let sh = fm::shape();
        assert_eq!(
            sh.rows,
            weightlift_kernels::sources::ATTENTION_PREFILL_MMA_ROWS
        );
        let n_rows = s.n_q * group;
        let kvd = s.kv_heads * hd;
        let first_key = |i: usize| match c.window {
            w if w != 0 && s.start + i + 1 > w => s.start + i + 1 - w,
            _ => 0,
        };
        let mut out = vec![f32::NAN; c.q.len()];
        for kh in 0..s.kv_heads {
            for r0 in (0..n_rows).step_by(sh.rows) {
                let r_end = (r0 + sh.rows).min(n_rows);
                let q_at = |r: usize| ((r / group) * s.n_heads + kh * group + r % group) * hd;
                let mut sq = vec![0u32; sh.q_words];
                for row in 0..sh.rows {
                    for d in (0..hd).step_by(2) {
                        let r = r0 + row;
                        let (x0, x1) = if r < r_end {
                            (c.q[q_at(r) + d], c.q[q_at(r) + d + 1])
                        } else {
                            (0.0, 0.0)
                        };
                        sq[fm::q_word(row, d, hd).unwrap()] = fm::pack(x0, x1);
                    }
                }
                let mut warps: Vec<Warp> = (0..sh.rows / 16)
                    .map(|w| Warp {
                        qa: (0..hd / 16)
                            .map(|ks| {
                                std::array::from_fn(|lane| {
                                    fm::q_frag(&sq, 16 * w, hd, lane, ks).unwrap()
                                })
                            })
                            .collect(),
                        qi: std::array::from_fn(|lane| {
                            std::array::from_fn(|hf| {
                                ((r0 + 16 * w + maps.c[lane][2 * hf].0) / group) as u64
                            })
                        }),
                        o: vec![[[0.0; 4]; 32]; hd / 8],
                        m: [[f32::NEG_INFINITY; 2]; 32],
                        l: [[0.0; 2]; 32],
                    })
                    .collect();
                let key_end = s.start + (r_end - 1) / group + 1;
                let mut t0 = first_key(r0 / group) / 32 * 32;
                while t0 < key_end {
                    let mut sk = vec![0u32; sh.k_words];
                    let mut svt = vec![0u32; sh.v_words];
                    // the tile's keys and values as the kernel's readers decode them (zero
                    // past key_end), then packed into f16 pairs as the kernel packs them
                    let tile = |f: KvFormat, b: &[u8]| -> Vec<Vec<f32>> {
                        (t0..t0 + 32)
                            .map(|j| match j < key_end {
                                true => decode_row(f, b, (j % c.rows) * kvd + kh * hd, hd),
                                false => vec![0.0; hd],
                            })
                            .collect()
                    };
                    let (kt, vt) = (tile(c.formats.0, &c.k), tile(c.formats.1, &c.v));
                    for jj in 0..32 {
                        for d in (0..hd).step_by(2) {
                            sk[fm::k_word(jj, d, hd).unwrap()] = fm::pack(kt[jj][d], kt[jj][d + 1]);
                        }
                    }
                    for jj in (0..32).step_by(2) {
                        for d in 0..hd {
                            svt[fm::v_word(d, jj).unwrap()] = fm::pack(vt[jj][d], vt[jj + 1][d]);
                        }
                    }
                    for (w, warp) in warps.iter_mut().enumerate() {
                        let wr0 = r0 + 16 * w;
                        if wr0 >= r_end {
                            continue;
                        }
                        let wr_last = (wr0 + 15).min(r_end - 1);
                        // keys from the first row's window start to the last row's causal end
                        let warp_end = s.start + wr_last / group + 1;
                        if t0 >= warp_end || t0 + 32 <= first_key(wr0 / group) {
                            continue;
                        }
                        let mut sc: Regs<f32, 16> = [[0.0; 16]; 32];
                        for nb in 0..4 {
                            let mut d: Regs<f32, 4> = std::array::from_fn(|l| {
                                sc[l][4 * nb..4 * nb + 4].try_into().unwrap()
                            });
                            for ks in 0..hd / 16 {
                                let b = std::array::from_fn(|l| {
                                    fm::k_frag(&sk, hd, l, nb, ks).unwrap()
                                });
                                maps.mma(&mut d, &warp.qa[ks], &b);
                            }
                            for l in 0..32 {
                                sc[l][4 * nb..4 * nb + 4].copy_from_slice(&d[l]);
                            }
                        }
                        let masks = (
                            s.start as u64,
                            c.window as u64,
                            key_end as u64,
                            s.scale,
                            c.softcap,
                        );
                        let mt: Regs<f32, 2> = std::array::from_fn(|l| {
                            fm::weigh(&mut sc[l], l, t0 as u64, warp.qi[l], masks).unwrap()
                        });
                        let mt = quad_max(&mt);
                        let mut m_new = [[0f32; 2]; 32];
                        let mut keep = [[0f32; 2]; 32];
                        let mut ps = [[0f32; 2]; 32];
                        for l in 0..32 {
                            (m_new[l], keep[l], ps[l]) = fm::probs(&mut sc[l], warp.m[l], mt[l]);
                        }
                        let ps = quad_sum(&ps);
                        for l in 0..32 {
                            fm::fold(&mut warp.m[l], &mut warp.l[l], m_new[l], keep[l], ps[l]);
                            for o in warp.o.iter_mut() {
                                fm::rescale(&mut o[l], keep[l]);
                            }
                        }
                        for kk in 0..2 {
                            let pa = std::array::from_fn(|l| fm::p_frag(&sc[l], kk).unwrap());
                            for (db, o) in warp.o.iter_mut().enumerate() {
                                let b = std::array::from_fn(|l| {
                                    fm::v_frag(&svt, hd, l, db, kk).unwrap()
                                });
                                maps.mma(o, &pa, &b);
                            }
                        }
                    }
                    t0 += 32;
                }
                for (w, warp) in warps.iter().enumerate() {
                    for l in 0..32 {
                        for hf in 0..2 {
                            let r = r0 + 16 * w + maps.c[l][2 * hf].0;
                            if r >= r_end {
                                continue;
                            }
                            let inv = 1.0 / warp.l[l][hf];
                            for (db, o) in warp.o.iter().enumerate() {
                                for reg in [2 * hf, 2 * hf + 1] {
                                    out[q_at(r) + 8 * db + maps.c[l][reg].1] = o[l][reg] * inv;
                                }
                            }
                        }
                    }
                }
            }
        }
        out
    }

    /// Every element of A (16 × 16), B (16 × 8) and C (16 × 8) is held by exactly one (lane,
    /// register, half), and P's A fragment of k-step kk takes each element from the register
    /// of the same lane that holds it in S's n-blocks 2 kk and 2 kk + 1.
    #[test]
    fn mma_fragment_maps_hold_each_element_once() {
        let maps = Maps::new();
        let (mut a, mut b, mut c) = ([[0; 16]; 16], [[0; 8]; 16], [[0; 8]; 16]);
        for lane in 0..32 {
            for reg in 0..4 {
                for hf in 0..2 {
                    let (r, col) = maps.a[lane][reg][hf];
                    a[r][col] += 1;
                    if reg < 2 {
                        let (k, n) = maps.b[lane][reg][hf];
                        b[k][n] += 1;
                    }
                }
                let (r, col) = maps.c[lane][reg];
                c[r][col] += 1;
            }
        }
        assert!(a.iter().flatten().all(|&n| n == 1), "A: {a:?}");
        assert!(b.iter().flatten().all(|&n| n == 1), "B: {b:?}");
        assert!(c.iter().flatten().all(|&n| n == 1), "C: {c:?}");
        for lane in 0..32 {
            // distinct values exact in f16: n-block nb, register reg
            let p: [f32; 16] = std::array::from_fn(|x| (x + 1) as f32);
            for kk in 0..2 {
                let pa = fm::p_frag(&p, kk).unwrap();
                for reg in 0..4 {
                    for hf in 0..2 {
                        let (r, col) = maps.a[lane][reg][hf];
                        let got = half::f16::from_bits((pa[reg] >> (16 * hf)) as u16).to_f32();
                        let nb = 2 * kk + col / 8;
                        let held = (0..4)
                            .find(|&cr| maps.c[lane][cr] == (r, col % 8))
                            .expect("the lane holds the element in S");
                        assert_eq!(got, p[4 * nb + held], "lane {lane} kk {kk} reg {reg}");
                    }
                }
            }
        }
    }

    /// The maps are the PTX ISA's fragment layouts of `mma.m16n8k16` with f16 A/B and f32
    /// C/D, written out here from its figures (lane l, g = l / 4, t = l % 4): a consistent
    /// permutation of them would still pass the replay, whose loads and products share them.
    #[test]
    fn mma_fragment_maps_are_the_ptx_layouts() {
        let maps = Maps::new();
        for lane in 0..32 {
            let (g, t) = (lane / 4, lane % 4);
            let a = [
                [(g, 2 * t), (g, 2 * t + 1)],
                [(g + 8, 2 * t), (g + 8, 2 * t + 1)],
                [(g, 2 * t + 8), (g, 2 * t + 9)],
                [(g + 8, 2 * t + 8), (g + 8, 2 * t + 9)],
            ];
            let b = [
                [(2 * t, g), (2 * t + 1, g)],
                [(2 * t + 8, g), (2 * t + 9, g)],
            ];
            let c = [
                (g, 2 * t),
                (g, 2 * t + 1),
                (g + 8, 2 * t),
                (g + 8, 2 * t + 1),
            ];
            assert_eq!(maps.a[lane], a, "A, lane {lane}");
            assert_eq!(maps.b[lane], b, "B, lane {lane}");
            assert_eq!(maps.c[lane], c, "C, lane {lane}");
        }
    }

    /// The kernel's blocks replayed on the host ([`replay`]) against the CPU backend's fast-mode
    /// attention over the same cache, for every case of [`mma_cases`] (every cache format),
    /// within the f16 operands' bound of [`attention_close`]; and against the
    /// f32 prompt kernel's twin. Prints the largest differences of each format.
    #[test]
    fn prompt_attention_mma_twin_matches_the_cpu_backend() {
        use weightlift_kernels::host_shim;
        let cpu = CpuBackend::new();
        let cases = mma_cases(&mut Rng(0xfa03));
        let formats = KV_FORMATS;
        // per format: the largest |twin - cpu| and |twin - f32 kernel's twin|
        let mut worst = vec![(0f32, 0f32); formats.len()];
        // the cases are independent and the replay is single-threaded: one case a core
        let outputs: Vec<(Vec<f32>, Vec<f32>, Vec<f32>)> = cases
            .par_iter()
            .map(|c| {
                let want = attention_on(&cpu, c).unwrap();
                let got = replay(c);
                let mut f32_twin = vec![f32::NAN; c.q.len()];
                host_shim::attention_prefill(
                    c.formats.0,
                    c.formats.1,
                    c.shape,
                    (c.window, c.softcap, c.rows),
                    &c.q,
                    &c.k,
                    &c.v,
                    &mut f32_twin,
                )
                .unwrap();
                (got, want, f32_twin)
            })
            .collect();
        for (c, (got, want, f32_twin)) in cases.iter().zip(&outputs) {
            let at = formats.iter().position(|&f| f == c.formats).unwrap();
            worst[at].0 = worst[at].0.max(max_diff(got, want));
            worst[at].1 = worst[at].1.max(max_diff(got, f32_twin));
        }
        for (f, (cpu, f32k)) in formats.iter().zip(&worst) {
            eprintln!(
                "mma twin {:?}/{:?}: max |twin - cpu| {cpu:e}, max |twin - f32 kernel's twin| \
                 {f32k:e}",
                f.0, f.1
            );
        }
        for (c, (got, want, _)) in cases.iter().zip(&outputs) {
            attention_close("mma twin", c, got, want);
        }
        // formats × 3 groups × 2 heads × 2 prompts × 4 masks
        assert_eq!(cases.len(), formats.len() * 48);
    }
}

/// On a GPU of compute capability 8.0 or later: the tensor-core prompt kernel against the f32
/// prompt kernel (`WEIGHTLIFT_FA_MMA=0`'s) and the CPU backend for every case of
/// [`mma_cases`] (every cache format), within the f16 operands' bound; its output is not the f32 kernel's bits (so
/// it ran), the same calls in exact mode (which the tensor-core kernel never takes) give both
/// backends the f32 kernel's bits, and a backend left to the environment runs what
/// [`PrefillAttention::from_env`] picks.
#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda -- --ignored on a machine with one"]
fn prompt_attention_on_tensor_cores_matches_the_f32_kernel_and_the_cpu() -> Result<()> {
    use weightlift_kernels::sources::PrefillAttention;
    let mma = CudaBackend::new(0)?.with_prefill_attention(PrefillAttention::Mma);
    let off = CudaBackend::new(0)?.with_prefill_attention(PrefillAttention::F32);
    let env = CudaBackend::new(0)?;
    assert!(
        mma.compute_capability() >= (8, 0),
        "the tensor-core kernel needs 8.0; this GPU is {:?}",
        mma.compute_capability()
    );
    assert_eq!(env.prefill_attention(), PrefillAttention::from_env());
    let cpu = CpuBackend::new();
    let (mut worst_cpu, mut worst_f32, mut differ) = (0f32, 0f32, 0);
    for c in &mma_cases(&mut Rng(0xfa04)) {
        let want = attention_on(&cpu, c)?;
        let got = attention_on(&mma, c)?;
        let f32k = attention_on(&off, c)?;
        attention_close("cuda mma", c, &got, &want);
        attention_close("cuda f32 prompt kernel", c, &f32k, &want);
        worst_cpu = worst_cpu.max(max_diff(&got, &want));
        worst_f32 = worst_f32.max(max_diff(&got, &f32k));
        differ += usize::from(got != f32k);
        let exact = AttCase {
            formats: c.formats,
            shape: cpu::attention::AttnShape::new(
                c.shape.n_heads,
                c.shape.kv_heads,
                c.shape.head_dim,
                c.shape.n_q,
                c.shape.start,
                c.shape.scale,
                false,
            )?,
            window: c.window,
            softcap: c.softcap,
            rows: c.rows,
            q: c.q.clone(),
            k: c.k.clone(),
            v: c.v.clone(),
        };
        let (a, b) = (attention_on(&mma, &exact)?, attention_on(&off, &exact)?);
        assert!(
            a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()),
            "exact mode: the switch changed the f32 kernel's bits"
        );
        let by_env = attention_on(&env, c)?;
        let picked = match env.prefill_attention() {
            PrefillAttention::Mma => &got,
            PrefillAttention::F32 => &f32k,
        };
        assert!(
            by_env
                .iter()
                .zip(picked)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "the environment's backend ran another kernel"
        );
    }
    eprintln!("cuda mma: max |mma - cpu| {worst_cpu:e}, max |mma - f32 kernel| {worst_f32:e}");
    assert!(
        differ > 0,
        "the tensor-core backend gave the f32 kernel's bits in every case"
    );
    Ok(())
}

/// The tensor-core kernel's output against its host replay, case by case (every cache
/// format; the replay stages the tiles through the shim's decoders): an mma may add its
/// products in another order (or width) than the replay's f32 chain, and a score a last bit
/// off may round a probability to the next f16 (2⁻¹¹ relative), so within 1e-3 rather than bit
/// for bit; a wrong fragment layout is off by the values themselves.
#[cfg(all(feature = "cuda", wl_host_shim))]
#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda -- --ignored on a machine with one"]
fn prompt_attention_on_tensor_cores_matches_its_twin() -> Result<()> {
    use weightlift_kernels::sources::PrefillAttention;
    let mma = CudaBackend::new(0)?.with_prefill_attention(PrefillAttention::Mma);
    let mut worst = 0f32;
    for c in &mma_cases(&mut Rng(0xfa05)) {
        let got = attention_on(&mma, c)?;
        let twin = mma_twin::replay(c);
        let d = max_diff(&got, &twin);
        assert!(
            d <= 1e-3,
            "{:?} {:?} window {} softcap {}: {d}",
            c.formats,
            c.shape,
            c.window,
            c.softcap
        );
        worst = worst.max(d);
    }
    eprintln!("cuda mma against its twin: max difference {worst:e}");
    Ok(())
}

/// Shapes of the int8 tensor-core cases as (rows, tokens): neither a whole number of the
/// kernel's 64-row or 64-token tiles, one with a second token tile and a warp of rows wholly
/// past the end; the first two past the CPU's batch of [`cpu::matvec::Q8_BATCH_MAX_TOKENS`]
/// (its integer tiles, whose order the kernel shares), the last within it (the matvec order).
const MMQ_SHAPES: [(usize, usize); 3] = [(70, 37), (45, 70), (37, 12)];

/// Columns of the int8 tensor-core cases of `ty`: 9 groups for the 32-value blocks (the last
/// pass of 4 groups short), 8 for the k-quants (one block of 256).
fn mmq_cols(ty: QuantType) -> usize {
    if ty.block_size() == 32 { 288 } else { 256 }
}

/// Weights of `ty` whose every scale and min is a small power-of-two multiple: random quant
/// bytes with each f16 factor replaced (d, and Q4_1's, Q5_1's and Q4_K's min factor). With
/// integer activations of block scale 1 every product and partial sum of the Q8 mode is then a
/// multiple of 2⁻³ below 2²¹, exact in f32 in any order.
fn mmq_integer_weights(rng: &mut Rng, ty: QuantType, rows: usize, cols: usize) -> Vec<u8> {
    let mut raw = rng.bytes(rows * cols / ty.block_size() * ty.block_bytes());
    let f16 = |v: f32| half::f16::from_f32(v).to_le_bytes();
    for blk in raw.chunks_exact_mut(ty.block_bytes()) {
        let fields: &[(usize, f32)] = match ty {
            QuantType::Q4_1 | QuantType::Q5_1 => &[(0, 0.5), (2, -2.0)],
            QuantType::Q4_K => &[(0, 0.25), (2, 0.5)],
            QuantType::Q6_K => &[(208, 0.125)],
            _ => &[(0, 1.0)],
        };
        for &(at, v) in fields {
            blk[at..at + 2].copy_from_slice(&f16(v));
        }
    }
    raw
}

/// Integer activations whose every 32-value block has its largest magnitude 127 (so its
/// scale is exactly 1 and its quants the values) and the rest in -3..=3.
fn mmq_integer_activations(rng: &mut Rng, n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| {
            let v = (rng.next_u64() % 7) as f32 - 3.0;
            match i % 32 {
                0 if rng.next_u64().is_multiple_of(2) => 127.0,
                0 => -127.0,
                _ => v,
            }
        })
        .collect()
}

/// The Q8 mode's prompt product on int8 tensor cores (`q8_mma_{type}`) replayed on the host:
/// its blocks staged through the header's word maps, each warp's m16n8k32 products through
/// [`Maps::mma`], its lanes' epilogues through the header.
#[cfg(wl_host_shim)]
mod mmq_twin {
    use super::*;
    use weightlift_kernels::host_shim::{self, mmq};

    /// One register file a lane, for the 32 lanes of a warp.
    type Regs<T, const N: usize> = [[T; N]; 32];

    /// The fragment maps read once from the header: A (lane, register, byte) -> (row, col),
    /// B -> (k, n), C -> (row, col).
    pub(super) struct Maps {
        a: Regs<[(usize, usize); 4], 4>,
        b: Regs<[(usize, usize); 4], 2>,
        c: Regs<(usize, usize), 4>,
    }

    impl Maps {
        pub(super) fn new() -> Maps {
            let mut m = Maps {
                a: [[[(0, 0); 4]; 4]; 32],
                b: [[[(0, 0); 4]; 2]; 32],
                c: [[(0, 0); 4]; 32],
            };
            for lane in 0..32 {
                for reg in 0..4 {
                    for byte in 0..4 {
                        m.a[lane][reg][byte] = mmq::a_elem(lane, reg, byte).unwrap();
                        if reg < 2 {
                            m.b[lane][reg][byte] = mmq::b_elem(lane, reg, byte).unwrap();
                        }
                    }
                    m.c[lane][reg] = mmq::c_elem(lane, reg).unwrap();
                }
            }
            m
        }

        /// One m16n8k32 s8 product of the warp from zero, D = A B: A and B built from the 32
        /// lanes' registers through the maps (each byte a signed 8-bit value), each D element
        /// the exact i32 dot of its row and column, written back through the C map.
        fn mma(&self, a: &Regs<u32, 4>, b: &Regs<u32, 2>) -> Regs<i32, 4> {
            let byte = |w: u32, i: usize| i32::from((w >> (8 * i)) as u8 as i8);
            let (mut am, mut bm) = ([[0i32; 32]; 16], [[0i32; 8]; 32]);
            for lane in 0..32 {
                for reg in 0..4 {
                    for i in 0..4 {
                        let (r, c) = self.a[lane][reg][i];
                        am[r][c] = byte(a[lane][reg], i);
                        if reg < 2 {
                            let (k, n) = self.b[lane][reg][i];
                            bm[k][n] = byte(b[lane][reg], i);
                        }
                    }
                }
            }
            std::array::from_fn(|lane| {
                std::array::from_fn(|reg| {
                    let (r, c) = self.c[lane][reg];
                    (0..32).map(|k| am[r][k] * bm[k][c]).sum()
                })
            })
        }
    }

    /// What `q8_mma_{type}` computes for the `rows × cols` weights `w` of `ty` and the
    /// activation blocks `xq` of `n_tok` tokens (from `q8_quantize`): `y[t * rows + r]`, its
    /// blocks replayed step for step.
    pub(super) fn replay(
        ty: QuantType,
        w: &[u8],
        xq: &[u8],
        (rows, cols, n_tok): (usize, usize, usize),
    ) -> Vec<f32> {
        let maps = Maps::new();
        let sh = mmq::shape();
        let (kind, halves) = mmq::kind(ty).unwrap();
        let n_groups = cols / 32;
        let warps = sh.rows / sh.warp_rows;
        let mut y = vec![f32::NAN; rows * n_tok];
        let mut s = mmq::Staged::default();
        for r0 in (0..rows).step_by(sh.rows) {
            for t0 in (0..n_tok).step_by(sh.tokens) {
                let mut acc = vec![[[[0f32; 4]; 32]; 8]; warps];
                let mut ext = acc.clone();
                for g0 in (0..n_groups).step_by(sh.groups) {
                    for e in 0..sh.rows * sh.groups * 8 {
                        mmq::stage_w(ty, w, (rows, cols), r0, g0, e, &mut s).unwrap();
                    }
                    for e in 0..sh.tokens * sh.groups * 10 {
                        mmq::stage_x(xq, (n_tok, n_groups), t0, g0, e, &mut s).unwrap();
                    }
                    for wp in 0..warps {
                        let row0 = wp * sh.warp_rows;
                        if r0 + row0 >= rows {
                            continue;
                        }
                        for kk in 0..sh.groups.min(n_groups - g0) {
                            for h in 0..halves {
                                let a = std::array::from_fn(|lane| {
                                    mmq::a_frag(&s, row0, kk, lane, (halves, h)).unwrap()
                                });
                                for nb in 0..8 {
                                    let b = std::array::from_fn(|lane| {
                                        mmq::b_frag(&s, 8 * nb, kk, lane).unwrap()
                                    });
                                    let d = maps.mma(&a, &b);
                                    for lane in 0..32 {
                                        mmq::epilogue(
                                            &d[lane],
                                            lane,
                                            (row0, 8 * nb),
                                            (kk, h),
                                            kind,
                                            &s,
                                            &mut acc[wp][nb][lane],
                                            &mut ext[wp][nb][lane],
                                        )
                                        .unwrap();
                                    }
                                }
                            }
                        }
                    }
                }
                for wp in 0..warps {
                    for nb in 0..8 {
                        for lane in 0..32 {
                            for reg in 0..4 {
                                let (rr, tc) = maps.c[lane][reg];
                                let (r, t) = (r0 + wp * sh.warp_rows + rr, t0 + 8 * nb + tc);
                                if r < rows && t < n_tok {
                                    y[t * rows + r] =
                                        acc[wp][nb][lane][reg] + ext[wp][nb][lane][reg];
                                }
                            }
                        }
                    }
                }
            }
        }
        y
    }

    /// `x`'s activation blocks as the device's `q8_quantize_f32` writes them.
    pub(super) fn quantised(x: &[f32]) -> Vec<u8> {
        let mut xq = vec![0u8; x.len() / 32 * 40];
        host_shim::q8_quantize(host_shim::Act::F32(x), &mut xq).unwrap();
        xq
    }

    /// Per output, Σ (|w| + 2|m|)·|x| over its row and token: `w` the weights as the CPU
    /// dequantises them, `m` each group's min/offset, `x` the Q8-dequantised activations
    /// (d·q). It bounds every partial sum of either order.
    pub(super) fn magnitudes(
        ty: QuantType,
        raw: &[u8],
        xq: &[u8],
        (rows, cols, n_tok): (usize, usize, usize),
    ) -> Vec<f64> {
        let mut w = vec![0f32; rows * cols];
        dequantize_f32(ty, raw, &mut w).unwrap();
        let row_bytes = raw.len() / rows;
        let x: Vec<f64> = xq
            .chunks_exact(40)
            .flat_map(|b| {
                let d = f64::from(f32::from_le_bytes([b[0], b[1], b[2], b[3]]));
                b[8..40].iter().map(move |q| d * f64::from(*q as i8))
            })
            .collect();
        let mut mag = vec![0f64; rows * n_tok];
        for t in 0..n_tok {
            for r in 0..rows {
                let row = &raw[r * row_bytes..(r + 1) * row_bytes];
                mag[t * rows + r] = (0..cols)
                    .map(|c| {
                        let m = common::group_offset(ty, row, c / 32).abs();
                        (f64::from(w[r * cols + c]).abs() + 2.0 * m) * x[t * cols + c].abs()
                    })
                    .sum();
            }
        }
        mag
    }

    /// The largest difference between the tensor-core route and the CPU's Q8 order, relative
    /// to [`magnitudes`]: both add the same rounded terms (dw·xd)·isum, the route in one FMA
    /// chain of g·h terms (g groups, h products a group), the CPU in 8 chains of g and a tree
    /// of 3 additions; the min terms' chain is the same in both, and each adds it once. So
    /// |route − cpu| ≤ (g·h + g + 3 + 2)·2⁻²⁴ of the magnitude, to first order (×1.01 for the
    /// rest).
    pub(super) fn order_bound(ty: QuantType, cols: usize) -> f64 {
        let g = (cols / 32) as f64;
        let h = mmq::kind(ty).unwrap().1 as f64;
        (g * h + g + 5.0) * 2f64.powi(-24) * 1.01
    }

    /// Every element of A (16 × 32), B (32 × 8) and C (16 × 8) is held by exactly one (lane,
    /// register, byte).
    #[test]
    fn mmq_fragment_maps_hold_each_element_once() {
        let maps = Maps::new();
        let (mut a, mut b, mut c) = ([[0; 32]; 16], [[0; 8]; 32], [[0; 8]; 16]);
        for lane in 0..32 {
            for reg in 0..4 {
                for byte in 0..4 {
                    let (r, col) = maps.a[lane][reg][byte];
                    a[r][col] += 1;
                    if reg < 2 {
                        let (k, n) = maps.b[lane][reg][byte];
                        b[k][n] += 1;
                    }
                }
                let (r, col) = maps.c[lane][reg];
                c[r][col] += 1;
            }
        }
        assert!(a.iter().flatten().all(|&n| n == 1), "A: {a:?}");
        assert!(b.iter().flatten().all(|&n| n == 1), "B: {b:?}");
        assert!(c.iter().flatten().all(|&n| n == 1), "C: {c:?}");
    }

    /// The maps are the PTX ISA's fragment layouts of `mma.m16n8k32` with s8 A/B and s32 C/D,
    /// written out here from its figures (lane l, g = l / 4, t = l % 4): a consistent
    /// permutation of them would still pass the replay, whose loads and products share them.
    #[test]
    fn mmq_fragment_maps_are_the_ptx_layouts() {
        let maps = Maps::new();
        for lane in 0..32 {
            let (g, t) = (lane / 4, lane % 4);
            let a: [[(usize, usize); 4]; 4] = std::array::from_fn(|reg| {
                std::array::from_fn(|i| match reg {
                    0 => (g, 4 * t + i),
                    1 => (g + 8, 4 * t + i),
                    2 => (g, 16 + 4 * t + i),
                    _ => (g + 8, 16 + 4 * t + i),
                })
            });
            let b: [[(usize, usize); 4]; 2] =
                std::array::from_fn(|reg| std::array::from_fn(|i| (16 * reg + 4 * t + i, g)));
            let c = [
                (g, 2 * t),
                (g, 2 * t + 1),
                (g + 8, 2 * t),
                (g + 8, 2 * t + 1),
            ];
            assert_eq!(maps.a[lane], a, "A, lane {lane}");
            assert_eq!(maps.b[lane], b, "B, lane {lane}");
            assert_eq!(maps.c[lane], c, "C, lane {lane}");
        }
        let sh = mmq::shape();
        assert_eq!(sh.rows, weightlift_kernels::sources::MMQ_BLOCK_ROWS);
        assert_eq!(sh.tokens, weightlift_kernels::sources::MMQ_BLOCK_TOKENS);
        assert_eq!(sh.threads, weightlift_kernels::sources::MMQ_THREADS);
        assert_eq!(
            sh.threads / 32 * sh.warp_rows,
            sh.rows,
            "a warp per 16 rows"
        );
    }

    /// Where every product and sum is exact in f32 ([`mmq_integer_weights`] and
    /// [`mmq_integer_activations`]), the replayed kernel equals the CPU backend's Q8 mode bit
    /// for bit for every type: its integer dots, scales, min terms and stores are the CPU's,
    /// whatever the order of the additions.
    #[test]
    fn q8_mma_twin_equals_the_cpu_backend_where_the_sums_are_exact() {
        let cpu = CpuBackend::new();
        let mut rng = Rng(0x88a_0001);
        for &ty in weightlift_kernels::sources::MMQ_TYPES {
            let cols = mmq_cols(ty);
            for (rows, n_tok) in MMQ_SHAPES {
                let shape = (rows, cols, n_tok);
                let raw = mmq_integer_weights(&mut rng, ty, rows, cols);
                let x = mmq_integer_activations(&mut rng, n_tok * cols);
                let xq = quantised(&x);
                let got = replay(ty, &raw, &xq, shape);
                let w = upload(&cpu, &raw).unwrap();
                let want = run(&cpu, ty, MatvecMode::Q8, shape, 1 << 20, &w, &x).unwrap();
                for (i, (g, c)) in got.iter().zip(&want).enumerate() {
                    assert!(
                        g.to_bits() == c.to_bits(),
                        "{ty} {rows} x {cols}, {n_tok} tokens: token {} row {}: twin {g:e}, \
                         cpu {c:e}",
                        i / rows,
                        i % rows
                    );
                }
            }
        }
    }

    /// Model-like weights (our quantiser's, as the fast-mode tests use) and activations, for
    /// every type: the replayed kernel is the CPU backend's Q8 mode bit for bit past its batch
    /// of [`cpu::matvec::Q8_BATCH_MAX_TOKENS`] tokens (its integer tiles scale each group's
    /// whole integer dot once, in group order, as the kernel does), within [`order_bound`] of it
    /// below (the matvec's order), and within the Q8 mode's documented 1e-5 of the magnitude
    /// of an f64 dot of the same dequantised operands.
    #[test]
    fn q8_mma_twin_matches_the_cpu_backend() {
        let cpu = CpuBackend::new();
        let mut rng = Rng(0x88a_0002);
        let (mut worst, mut differ, mut n) = (0f64, 0usize, 0usize);
        for &ty in weightlift_kernels::sources::MMQ_TYPES {
            let cols = mmq_cols(ty);
            for (rows, n_tok) in MMQ_SHAPES {
                let shape = (rows, cols, n_tok);
                let mut raw = vec![0u8; rows * quantized_row_bytes(ty, cols).unwrap()];
                quantize_rows(ty, &rng.vec(rows * cols, 0.2), cols, &mut raw).unwrap();
                let x = rng.vec(n_tok * cols, 1.0);
                let xq = quantised(&x);
                let got = replay(ty, &raw, &xq, shape);
                let w = upload(&cpu, &raw).unwrap();
                let want = run(&cpu, ty, MatvecMode::Q8, shape, 1 << 20, &w, &x).unwrap();
                let mag = magnitudes(ty, &raw, &xq, shape);
                let mut wd = vec![0f32; rows * cols];
                dequantize_f32(ty, &raw, &mut wd).unwrap();
                let bound = order_bound(ty, cols);
                for t in 0..n_tok {
                    for r in 0..rows {
                        let i = t * rows + r;
                        let (g, c, m) = (f64::from(got[i]), f64::from(want[i]), mag[i]);
                        assert!(
                            n_tok <= cpu::matvec::Q8_BATCH_MAX_TOKENS
                                || got[i].to_bits() == want[i].to_bits(),
                            "{ty} {rows} x {cols}, {n_tok} tokens: token {t} row {r}: twin {g}, \
                             cpu tiles {c}"
                        );
                        assert!(
                            (g - c).abs() <= bound * m + 1e-30,
                            "{ty} {rows} x {cols}, {n_tok} tokens: token {t} row {r}: twin {g}, \
                             cpu {c} (bound {:e})",
                            bound * m
                        );
                        let xs = &xq[t * cols / 32 * 40..(t + 1) * cols / 32 * 40];
                        let f64_dot: f64 = (0..cols)
                            .map(|k| {
                                let b = &xs[k / 32 * 40..];
                                let d = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                                f64::from(wd[r * cols + k])
                                    * f64::from(d)
                                    * f64::from(b[8 + k % 32] as i8)
                            })
                            .sum();
                        assert!(
                            (g - f64_dot).abs() <= 1e-5 * m + 1e-30,
                            "{ty}: token {t} row {r}: twin {g}, f64 {f64_dot} (magnitude {m})"
                        );
                        if m > 0.0 {
                            worst = worst.max((g - c).abs() / m);
                        }
                        differ += usize::from(got[i].to_bits() != want[i].to_bits());
                        n += 1;
                    }
                }
            }
        }
        eprintln!(
            "q8 mma twin: {differ} of {n} outputs differ from the cpu's bits, max |twin - cpu| \
             / magnitude {worst:e}"
        );
    }
}

/// On a GPU of compute capability 8.0 or later, with the int8 tensor-core route forced from
/// one token: every type's prompt product is its host replay bit for bit (the integer dots are
/// exact and the epilogue's FMA chain and stores are the same operations), the CPU backend's
/// Q8 mode bit for bit past its batch of 16 tokens (its integer tiles' order) and within the
/// order bound below it, within that bound of the dp4a kernels (the same backend with the
/// route off), and not their bits everywhere (so it ran).
#[cfg(all(feature = "cuda", wl_host_shim))]
#[test]
#[ignore = "needs a CUDA GPU: cargo test --features cuda -- --ignored on a machine with one"]
fn q8_mma_on_tensor_cores_matches_its_twin_and_the_cpu() -> Result<()> {
    use weightlift_kernels::sources::{CublasMinTokens, MMQ_TYPES, PromptRoute};
    let mma = CudaBackend::new(0)?
        .with_cublas_min_tokens(CublasMinTokens::uniform(usize::MAX).with_mma_every(1));
    let dp4a = CudaBackend::new(0)?.with_cublas_min_tokens(CublasMinTokens::uniform(usize::MAX));
    assert!(
        mma.compute_capability() >= (8, 0),
        "the int8 tensor-core kernels need 8.0; this GPU is {:?}",
        mma.compute_capability()
    );
    let cpu = CpuBackend::new();
    let mut rng = Rng(0x88a_0003);
    let (mut differ, mut worst) = (0usize, 0f64);
    for &ty in MMQ_TYPES {
        let cols = mmq_cols(ty);
        for (rows, n_tok) in MMQ_SHAPES {
            assert_eq!(
                mma.prompt_route(ty, MatvecMode::Q8, n_tok),
                PromptRoute::Mma
            );
            assert_eq!(
                dp4a.prompt_route(ty, MatvecMode::Q8, n_tok),
                PromptRoute::Kernels
            );
            let shape = (rows, cols, n_tok);
            let mut raw = vec![0u8; rows * quantized_row_bytes(ty, cols)?];
            quantize_rows(ty, &rng.vec(rows * cols, 0.2), cols, &mut raw)?;
            let x = rng.vec(n_tok * cols, 1.0);
            let xq = mmq_twin::quantised(&x);
            let got = run(
                &mma,
                ty,
                MatvecMode::Q8,
                shape,
                1 << 20,
                &upload(&mma, &raw)?,
                &x,
            )?;
            let old = run(
                &dp4a,
                ty,
                MatvecMode::Q8,
                shape,
                1 << 20,
                &upload(&dp4a, &raw)?,
                &x,
            )?;
            let want = run(
                &cpu,
                ty,
                MatvecMode::Q8,
                shape,
                1 << 20,
                &upload(&cpu, &raw)?,
                &x,
            )?;
            let twin = mmq_twin::replay(ty, &raw, &xq, shape);
            let mag = mmq_twin::magnitudes(ty, &raw, &xq, shape);
            let bound = mmq_twin::order_bound(ty, cols);
            for i in 0..rows * n_tok {
                let (t, r) = (i / rows, i % rows);
                assert_eq!(
                    got[i].to_bits(),
                    twin[i].to_bits(),
                    "{ty}: token {t} row {r}: device {:e}, twin {:e}",
                    got[i],
                    twin[i]
                );
                assert!(
                    n_tok <= cpu::matvec::Q8_BATCH_MAX_TOKENS
                        || got[i].to_bits() == want[i].to_bits(),
                    "{ty}: token {t} row {r}: device {:e}, cpu tiles {:e}",
                    got[i],
                    want[i]
                );
                for (what, other) in [("cpu", want[i]), ("q8_matmul", old[i])] {
                    let d = (f64::from(got[i]) - f64::from(other)).abs();
                    assert!(
                        d <= bound * mag[i] + 1e-30,
                        "{ty}: token {t} row {r}: device {}, {what} {other}",
                        got[i]
                    );
                }
                if mag[i] > 0.0 {
                    worst = worst.max((f64::from(got[i]) - f64::from(want[i])).abs() / mag[i]);
                }
                differ += usize::from(got[i].to_bits() != old[i].to_bits());
            }
        }
    }
    eprintln!(
        "cuda q8 mma: {differ} outputs off q8_matmul's bits; max |mma - cpu| / magnitude {worst:e}"
    );
    assert!(
        differ > 0,
        "the tensor-core route gave q8_matmul's bits everywhere"
    );
    Ok(())
}
