//! Elementwise and row operations on f32: RMSNorm, RoPE, softmax, SwiGLU, residual add.
//!
//! Conventions follow llama.cpp's CPU backend (ggml-cpu/ops.cpp); each function names the
//! operation it mirrors.
//!
//! RMSNorm, softmax and SwiGLU have AVX2+FMA and AVX-512 forms (`x86_ops`), chosen by
//! [`Isa::detect`] or forced with their `*_with` twins; the scalar loops stay as the fallback.
//! RoPE and the residual add are plain loops.

use rayon::prelude::*;

use super::{Isa, check_len};
use crate::error::{KernelError, Result};

/// Rows per parallel task for row operations.
const ROW_TASK_ELEMS: usize = 16 * 1024;

fn rows_of(op: &'static str, len: usize, row: usize) -> Result<usize> {
    if row == 0 || !len.is_multiple_of(row) {
        return Err(KernelError::Shape {
            op,
            reason: format!("{len} values are not whole rows of {row}"),
        });
    }
    Ok(len / row)
}

fn rows_per_task(row: usize) -> usize {
    (ROW_TASK_ELEMS / row.max(1)).max(1)
}

/// RMSNorm with a weight: `out = x / sqrt(mean(x²) + eps) * weight`, per row of
/// `weight.len()` values (ggml's `rms_norm` followed by `mul`, as llama.cpp builds it).
/// The sum of squares is accumulated in f64, as ggml's `ggml_float` does.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) -> Result<()> {
    rms_norm_with(Isa::detect(), x, weight, eps, out)
}

/// [`rms_norm`] with a forced instruction set. Every level computes `(x · s) · w` with the same
/// two roundings; only the order of the f64 sum of squares differs, so results agree to a few
/// f32 ulp.
pub fn rms_norm_with(isa: Isa, x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) -> Result<()> {
    let n = weight.len();
    rows_of("rms_norm", x.len(), n)?;
    check_len("rms_norm output values", x.len(), out.len())?;
    let per = rows_per_task(n) * n;
    x.par_chunks(per)
        .zip(out.par_chunks_mut(per))
        .for_each(|(xs, os)| {
            for (xr, or) in xs.chunks_exact(n).zip(os.chunks_exact_mut(n)) {
                rms_norm_row(isa, xr, weight, eps, or);
            }
        });
    Ok(())
}

fn rms_norm_row(isa: Isa, xr: &[f32], weight: &[f32], eps: f32, or: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        use super::x86_ops::imp;
        if isa.has_avx512() {
            // SAFETY: AVX-512F, AVX2 and FMA detected at run time; the row, weight and output
            // are all `n` long.
            return unsafe { imp::rms_norm_row_avx512(xr, weight, eps, or) };
        }
        if isa.has_avx2() {
            // SAFETY: AVX2 and FMA detected at run time; lengths as above.
            return unsafe { imp::rms_norm_row_avx2(xr, weight, eps, or) };
        }
    }
    let _ = isa;
    let ss: f64 = xr.iter().map(|v| f64::from(*v) * f64::from(*v)).sum();
    let mean = (ss / xr.len() as f64) as f32;
    let scale = 1.0 / (mean + eps).sqrt();
    for ((o, v), w) in or.iter_mut().zip(xr).zip(weight) {
        *o = (v * scale) * w;
    }
}

/// Which dimensions RoPE rotates together.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RopeStyle {
    /// GPT-J style, llama.cpp's `LLAMA_ROPE_TYPE_NORM` (0): pairs `(x[2i], x[2i+1])`.
    Normal,
    /// GPT-NeoX style, `LLAMA_ROPE_TYPE_NEOX` (2): pairs `(x[i], x[i + n_dims/2])`.
    Neox,
}

/// RoPE parameters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RopeParams {
    /// Normal or NeoX pairing.
    pub style: RopeStyle,
    /// Values per head.
    pub head_dim: usize,
    /// Leading dimensions of each head that are rotated (even, ≤ `head_dim`); the rest pass through.
    pub n_dims: usize,
    /// Base of the frequencies (`rope_freq_base`, 10000 for Llama 2).
    pub freq_base: f32,
    /// Linear position scale (`rope_freq_scale`, 1.0 unless the context is stretched).
    pub freq_scale: f32,
    /// Multiplier of the cosine and sine (so of the rotated dims' magnitude; the dims past
    /// `n_dims` pass through unscaled): LongRoPE's attention factor, ggml's `attn_factor`,
    /// transformers' `attention_scaling`. 1.0 for plain RoPE, which it leaves bit for bit.
    pub attn_factor: f32,
}

impl RopeParams {
    /// Checks that `n_dims` is even, non-zero and at most `head_dim`, as every backend needs.
    pub fn check(&self) -> Result<()> {
        let hd = self.head_dim;
        if !self.n_dims.is_multiple_of(2) || self.n_dims > hd || self.n_dims == 0 {
            return Err(KernelError::Shape {
                op: "rope",
                reason: format!(
                    "n_dims {} must be even, non-zero and at most head_dim {hd}",
                    self.n_dims
                ),
            });
        }
        Ok(())
    }
}

/// Rotary position embedding. `x` is `n_tok × n_heads × head_dim` (token-major), `positions`
/// holds one position per token. Pair `i` of a head at position `p` turns by
/// `θ = p · freq_scale · freq_base^(−2i/n_dims)`: `(a, b) → (a c − b s, a s + b c)` with
/// `c = cos θ · attn_factor`, `s = sin θ · attn_factor`, as ggml's `rope_yarn` with
/// extrapolation factor 0.
pub fn rope(x: &[f32], positions: &[i32], p: &RopeParams, out: &mut [f32]) -> Result<()> {
    check_len("rope output values", x.len(), out.len())?;
    out.copy_from_slice(x);
    rope_in_place(out, positions, p, &rope_inv_freqs(p, None)?)
}

/// The angle per position of each rotated pair: `freq_scale · freq_base^(−2i/n_dims)`, divided
/// by `factors[i]` when given (Llama 3's `rope_freqs`, as ggml's `rope` with freq factors).
pub fn rope_inv_freqs(p: &RopeParams, factors: Option<&[f32]>) -> Result<Vec<f32>> {
    let half = p.n_dims / 2;
    if let Some(f) = factors {
        check_len("rope frequency factors", half, f.len())?;
    }
    Ok((0..half)
        .map(|i| {
            let inv = p.freq_scale * p.freq_base.powf(-2.0 * i as f32 / p.n_dims as f32);
            factors.map_or(inv, |f| inv / f[i])
        })
        .collect())
}

/// [`rope`] in place, with the per-pair angles of [`rope_inv_freqs`] (`n_dims / 2` of them):
/// pair `i` at position `p` turns by `θ = p · inv_freqs[i]`.
pub fn rope_in_place(
    x: &mut [f32],
    positions: &[i32],
    p: &RopeParams,
    inv_freqs: &[f32],
) -> Result<()> {
    let tok_len = rope_token_len(x.len(), positions.len(), p, inv_freqs)?;
    // a task takes whole tokens, enough of them to be worth handing to another thread (a
    // decode step's few tokens run on the calling thread)
    x.par_chunks_mut(tok_len)
        .zip(positions.par_iter())
        .with_min_len(rows_per_task(tok_len))
        .for_each(|(xt, pos)| with_turns(*pos, p, inv_freqs, |cs| turn_heads(xt, cs, p)));
    Ok(())
}

/// [`rope_in_place`] of a layer's queries `q` and keys `k` at the same `positions`, each
/// token's angles worked out once for both (the same bits as two calls).
pub fn rope_qk_in_place(
    q: &mut [f32],
    k: &mut [f32],
    positions: &[i32],
    p: &RopeParams,
    inv_freqs: &[f32],
) -> Result<()> {
    let q_len = rope_token_len(q.len(), positions.len(), p, inv_freqs)?;
    let k_len = rope_token_len(k.len(), positions.len(), p, inv_freqs)?;
    q.par_chunks_mut(q_len)
        .zip(k.par_chunks_mut(k_len))
        .zip(positions.par_iter())
        .with_min_len(rows_per_task(q_len + k_len))
        .for_each(|((qt, kt), pos)| {
            with_turns(*pos, p, inv_freqs, |cs| {
                turn_heads(qt, cs, p);
                turn_heads(kt, cs, p);
            })
        });
    Ok(())
}

/// The values a token of `len` values over `n_tok` positions holds, checked.
fn rope_token_len(len: usize, n_tok: usize, p: &RopeParams, inv_freqs: &[f32]) -> Result<usize> {
    p.check()?;
    let hd = p.head_dim;
    check_len("rope frequencies", p.n_dims / 2, inv_freqs.len())?;
    let heads = rows_of("rope", len, hd)?;
    if n_tok == 0 || heads % n_tok != 0 {
        return Err(KernelError::Shape {
            op: "rope",
            reason: format!(
                "{heads} heads of {hd} values do not split evenly over {n_tok} positions"
            ),
        });
    }
    Ok(heads / n_tok * hd)
}

/// `f` of each pair's `(cos θ, sin θ) · attn_factor` at position `pos`.
fn with_turns(pos: i32, p: &RopeParams, inv_freqs: &[f32], f: impl FnOnce(&[(f32, f32)])) {
    let half = p.n_dims / 2;
    let mut cs = [(0f32, 0f32); 256];
    let mut cs_vec = Vec::new();
    let cs: &mut [(f32, f32)] = if half <= cs.len() {
        &mut cs[..half]
    } else {
        cs_vec.resize(half, (0.0, 0.0));
        &mut cs_vec
    };
    for (c, f) in cs.iter_mut().zip(inv_freqs) {
        let th = pos as f32 * f;
        *c = (th.cos() * p.attn_factor, th.sin() * p.attn_factor);
    }
    f(cs)
}

/// Each head of one token's `xt` turned by the pairs' `cs`.
fn turn_heads(xt: &mut [f32], cs: &[(f32, f32)], p: &RopeParams) {
    let turn = |a: &mut f32, b: &mut f32, (c, s): (f32, f32)| {
        let (x, y) = (*a, *b);
        *a = x * c - y * s;
        *b = x * s + y * c;
    };
    for xh in xt.chunks_exact_mut(p.head_dim) {
        let rotated = &mut xh[..p.n_dims];
        match p.style {
            RopeStyle::Normal => {
                for (pair, &cs) in rotated.chunks_exact_mut(2).zip(cs) {
                    let [a, b] = pair else {
                        unreachable!("pairs of two")
                    };
                    turn(a, b, cs);
                }
            }
            RopeStyle::Neox => {
                let (lo, hi) = rotated.split_at_mut(p.n_dims / 2);
                for ((a, b), &cs) in lo.iter_mut().zip(hi).zip(cs) {
                    turn(a, b, cs);
                }
            }
        }
    }
}

/// Softmax of each row of `n_cols` values (max-subtracted, as ggml's `soft_max`; the sum of
/// the exponentials is accumulated in f64, as ggml's `ggml_float`).
pub fn softmax(x: &[f32], n_cols: usize, out: &mut [f32]) -> Result<()> {
    softmax_with(Isa::detect(), x, n_cols, out)
}

/// [`softmax`] with a forced instruction set. The scalar level uses libm's `expf`; the AVX2
/// and AVX-512 levels use a vectorised `exp` within 1.5 ulp of the exact value (Cephes-style
/// range reduction and polynomial), so each output is within about 4e-7 relative of the
/// scalar one.
pub fn softmax_with(isa: Isa, x: &[f32], n_cols: usize, out: &mut [f32]) -> Result<()> {
    rows_of("softmax", x.len(), n_cols)?;
    check_len("softmax output values", x.len(), out.len())?;
    let per = rows_per_task(n_cols) * n_cols;
    x.par_chunks(per)
        .zip(out.par_chunks_mut(per))
        .for_each(|(xs, os)| {
            for (xr, or) in xs.chunks_exact(n_cols).zip(os.chunks_exact_mut(n_cols)) {
                softmax_row(isa, xr, or);
            }
        });
    Ok(())
}

fn softmax_row(isa: Isa, xr: &[f32], or: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        use super::x86_ops::imp;
        if isa.has_avx512() {
            // SAFETY: AVX-512F, AVX2 and FMA detected at run time; `or` is as long as `xr`.
            return unsafe { imp::softmax_row_avx512(xr, or) };
        }
        if isa.has_avx2() {
            // SAFETY: AVX2 and FMA detected at run time; `or` is as long as `xr`.
            return unsafe { imp::softmax_row_avx2(xr, or) };
        }
    }
    let _ = isa;
    let m = xr.iter().fold(f32::NEG_INFINITY, |a, b| a.max(*b));
    let mut sum = 0f64;
    for (o, v) in or.iter_mut().zip(xr) {
        *o = (v - m).exp();
        sum += f64::from(*o);
    }
    let inv = (1.0 / sum) as f32;
    for o in or.iter_mut() {
        *o *= inv;
    }
}

/// SwiGLU: `out = silu(gate) * up` with `silu(g) = g / (1 + e^(−g))` (ggml's `swiglu`).
pub fn swiglu(gate: &[f32], up: &[f32], out: &mut [f32]) -> Result<()> {
    swiglu_with(Isa::detect(), gate, up, out)
}

/// [`swiglu`] with a forced instruction set. The SIMD levels use the vectorised `exp` (≤ 1.5 ulp)
/// and a true division, so each output is within about 4e-7 relative of the scalar one.
pub fn swiglu_with(isa: Isa, gate: &[f32], up: &[f32], out: &mut [f32]) -> Result<()> {
    check_len("swiglu up values", gate.len(), up.len())?;
    check_len("swiglu output values", gate.len(), out.len())?;
    gate.par_chunks(ROW_TASK_ELEMS)
        .zip(up.par_chunks(ROW_TASK_ELEMS))
        .zip(out.par_chunks_mut(ROW_TASK_ELEMS))
        .for_each(|((g, u), o)| {
            #[cfg(target_arch = "x86_64")]
            {
                use super::x86_ops::imp;
                if isa.has_avx512() {
                    // SAFETY: AVX-512F detected at run time; the three chunks have one length.
                    return unsafe { imp::swiglu_avx512(g, u, o) };
                }
                if isa.has_avx2() {
                    // SAFETY: AVX2 and FMA detected at run time; lengths as above.
                    return unsafe { imp::swiglu_avx2(g, u, o) };
                }
            }
            let _ = isa;
            for ((o, g), u) in o.iter_mut().zip(g).zip(u) {
                *o = g / (1.0 + (-g).exp()) * u;
            }
        });
    Ok(())
}

/// `√(2/π)`, the tanh GELU's inner factor.
const SQRT_2_OVER_PI: f32 = 0.797_884_6;
/// The tanh GELU's cubic coefficient.
const GELU_COEF_A: f32 = 0.044_715;

/// The tanh approximation of GELU, `0.5·g·(1 + tanh(√(2/π)·g·(1 + 0.044715·g²)))` (torch's
/// `gelu(approximate="tanh")`, transformers' `gelu_pytorch_tanh`, ggml's `gelu`).
#[inline]
pub fn gelu_tanh(g: f32) -> f32 {
    0.5 * g * (1.0 + (SQRT_2_OVER_PI * g * (1.0 + GELU_COEF_A * g * g)).tanh())
}

/// GeGLU in place (gemma's MLP): `gate = gelu_tanh(gate) · up`. Scalar on every machine: the
/// MLP's products dominate, and one order of operations keeps every path's bits equal.
pub fn geglu_tanh_in_place(gate: &mut [f32], up: &[f32]) -> Result<()> {
    check_len("geglu up values", gate.len(), up.len())?;
    gate.par_chunks_mut(ROW_TASK_ELEMS)
        .zip(up.par_chunks(ROW_TASK_ELEMS))
        .for_each(|(g, u)| {
            for (g, u) in g.iter_mut().zip(u) {
                *g = gelu_tanh(*g) * u;
            }
        });
    Ok(())
}

/// `x *= s` (gemma's embedding scale).
pub fn scale_in_place(x: &mut [f32], s: f32) {
    x.par_chunks_mut(ROW_TASK_ELEMS)
        .for_each(|c| c.iter_mut().for_each(|v| *v *= s));
}

/// `x = cap · tanh(x / cap)` (gemma2's logit soft-capping).
pub fn softcap_in_place(x: &mut [f32], cap: f32) {
    x.par_chunks_mut(ROW_TASK_ELEMS)
        .for_each(|c| c.iter_mut().for_each(|v| *v = cap * (*v / cap).tanh()));
}

/// Residual add: `out = a + b`.
pub fn add(a: &[f32], b: &[f32], out: &mut [f32]) -> Result<()> {
    check_len("add rhs values", a.len(), b.len())?;
    check_len("add output values", a.len(), out.len())?;
    a.par_chunks(ROW_TASK_ELEMS)
        .zip(b.par_chunks(ROW_TASK_ELEMS))
        .zip(out.par_chunks_mut(ROW_TASK_ELEMS))
        .for_each(|((a, b), o)| {
            for ((o, a), b) in o.iter_mut().zip(a).zip(b) {
                *o = a + b;
            }
        });
    Ok(())
}

#[cfg(test)]
mod gemma_tests {
    use super::*;

    #[test]
    fn gelu_tanh_matches_its_definition() {
        // values of torch.nn.functional.gelu(x, approximate="tanh") in float64, rounded
        for (x, want) in [
            (0.0f32, 0.0f64),
            (1.0, 0.841_191_990_608_276_8),
            (-1.0, -0.158_808_009_391_723_24),
            (3.0, 2.996_362_607_918_227),
            (-0.5, -0.154_285_990_174_856_06),
        ] {
            let got = f64::from(gelu_tanh(x));
            assert!((got - want).abs() < 2e-7, "{x}: {got} vs {want}");
        }
        let mut g = vec![1.0f32, -1.0, 2.0];
        geglu_tanh_in_place(&mut g, &[2.0, 3.0, 0.0]).unwrap();
        assert_eq!(g, [2.0 * gelu_tanh(1.0), 3.0 * gelu_tanh(-1.0), 0.0]);
        assert!(geglu_tanh_in_place(&mut g, &[1.0]).is_err());
        let mut x = vec![100.0f32, -3.0, 0.0];
        softcap_in_place(&mut x, 30.0);
        assert!((x[0] - 30.0 * (100.0f32 / 30.0).tanh()).abs() == 0.0 && x[0] < 30.0);
        assert_eq!(x[2], 0.0);
    }
}
