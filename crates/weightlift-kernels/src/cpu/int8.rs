//! LLM.int8: row-wise absmax int8 weights, and the mixed int8 / f32 matmul of bitsandbytes'
//! `load_in_8bit` (Dettmers et al., "LLM.int8()", 2022), following bitsandbytes' CPU ops.
//!
//! **Quantiser** (`int8_vectorwise_quant` with threshold 0): per row, `absmax = max |w|`, kept as
//! the f32 scale, and `q = round_half_even(w · (127 · (1 / absmax)))`. A row of zeros has scale 0 and
//! quants 0 (bitsandbytes divides by zero there and converts NaN, which x86 makes 0).
//!
//! **Matmul** `y[t, o] = Σ_i x[t, i] · W[o, i]`:
//! 1. Outlier columns: input features `i` where some token has `|x[t, i]| ≥ threshold`
//!    (`threshold ≤ 0`: none).
//! 2. Each token is quantised as the weights are, its absmax taken over the values below the
//!    threshold (bitsandbytes zeroes the outliers first), and its outlier columns set to 0.
//! 3. `acc = Σ_i qx[t, i] · qw[o, i]` in i32 (exact), then
//!    `int_part = (acc as f32 · (sx[t] · sw[o])) · (1/127²)`, bitsandbytes' `int8_mm_dequant`
//!    with its constant `6.200124e-05`.
//! 4. The outlier columns in f32 against the dequantised weights
//!    `ŵ = (qw · sw) · (1/127)` (bitsandbytes' `7.874015718698502e-3`):
//!    `y = int_part + Σ_{c outlier} x[t, c] · ŵ[o, c]`, summed in column order.
//!
//! Every instruction set level computes the same i32 sums and the same float epilogue, so
//! results are bit-identical across levels. With no outlier columns the output equals
//! bitsandbytes' `int8_scaled_mm` on its CPU backend bit for bit; bitsandbytes sums the outlier
//! columns with a BLAS `addmm` (its own order), so there the two agree to rounding.

use rayon::prelude::*;

use super::Isa;
use super::quantize::{check_finite, widen};
use crate::error::{KernelError, Result};
use crate::types::FloatType;

/// bitsandbytes' default outlier threshold (`llm_int8_threshold`).
pub const INT8_DEFAULT_THRESHOLD: f32 = 6.0;

/// The largest `cols` whose i32 sums cannot overflow: `cols · 127² ≤ i32::MAX`.
pub const INT8_MAX_COLS: usize = i32::MAX as usize / (127 * 127);

/// `1/127²` as bitsandbytes' CPU `int8_mm_dequant` writes it.
const MM_DEQUANT: f32 = 6.200124e-05;

/// `1/127` as bitsandbytes' `int8_vectorwise_dequant` writes it (`7.874015718698502e-3`, the
/// same f32).
const DEQUANT: f32 = 7.874_016e-3;

/// Output rows per parallel task.
const ROWS_PER_TASK: usize = 16;

/// Row-wise int8 weights: `rows × cols` quants, row-major, and one f32 absmax per row.
#[derive(Debug, Clone, Copy)]
pub struct Int8Weights<'a> {
    /// `q[o * cols + i]`, in `-127..=127` as [`int8_quantize_rows`] writes them (the
    /// [`INT8_MAX_COLS`] bound on exact i32 sums assumes it).
    pub q: &'a [i8],
    /// `scales[o]`: the row's absmax (the value a quant of 127 stands for).
    pub scales: &'a [f32],
    /// Output features.
    pub rows: usize,
    /// Input features.
    pub cols: usize,
}

impl Int8Weights<'_> {
    fn check(&self) -> Result<()> {
        check_cols(self.cols)?;
        let n = self
            .rows
            .checked_mul(self.cols)
            .ok_or_else(|| KernelError::Shape {
                op: "int8 matmul",
                reason: format!("{} × {} weights overflow usize", self.rows, self.cols),
            })?;
        super::check_len("int8 weight quants", n, self.q.len())?;
        super::check_len(
            "int8 weight scales (one per row)",
            self.rows,
            self.scales.len(),
        )
    }
}

fn check_cols(cols: usize) -> Result<()> {
    if cols == 0 || cols > INT8_MAX_COLS {
        return Err(KernelError::Shape {
            op: "int8",
            reason: format!(
                "rows of {cols} values; int8 needs 1..={INT8_MAX_COLS} (the i32 sums of longer \
                 rows could overflow)"
            ),
        });
    }
    Ok(())
}

/// The instruction set paths of the i8 dot product (all exact, so all equal).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Dot {
    Scalar,
    #[cfg(target_arch = "x86_64")]
    X86(super::x86_int8::Kind),
}

impl Dot {
    fn pick(isa: Isa) -> Dot {
        #[cfg(target_arch = "x86_64")]
        if let Some(k) = super::x86_int8::Kind::pick(isa) {
            return Dot::X86(k);
        }
        let _ = isa;
        Dot::Scalar
    }
}

/// Quantises one row against a given `absmax` (the weights' is over all values, the
/// activations' only over those below the threshold): `q = round_half_even(x · s)`, saturated
/// to i8, with `s = 127 · (1 / absmax)` (all zeros when `absmax` is 0). The scale is rounded as
/// bitsandbytes' `127.0 / row_stats` is: torch divides a number by a tensor as the tensor's
/// reciprocal times the number, which differs from `127 / absmax` in the last bit for some
/// `absmax`, and then a weight that lands on `.5` rounds the other way.
fn quantize_row_i8(isa: Isa, x: &[f32], absmax: f32, q: &mut [i8]) {
    if absmax == 0.0 {
        q.fill(0);
        return;
    }
    let s = 127.0 * (1.0 / absmax);
    #[cfg(target_arch = "x86_64")]
    if isa.has_avx2() {
        // SAFETY: AVX2 detected at run time; `q` and `x` have the same length (callers).
        return unsafe { super::x86_int8::scale_round_avx2(x, s, q) };
    }
    let _ = isa;
    for (q, v) in q.iter_mut().zip(x) {
        *q = (v * s).round_ties_even() as i8;
    }
}

fn absmax(x: &[f32]) -> f32 {
    x.iter().fold(0f32, |m, v| m.max(v.abs()))
}

/// Quantises `src` (whole rows of `n_per_row` values) to int8 with one absmax per row, as
/// bitsandbytes' `int8_vectorwise_quant(w)` does: `q` gets `rows × n_per_row` quants, `scales`
/// one value per row. Non-finite values are refused with their index.
pub fn int8_quantize_rows(
    src: &[f32],
    n_per_row: usize,
    q: &mut [i8],
    scales: &mut [f32],
) -> Result<()> {
    int8_quantize_rows_with(Isa::detect(), src, n_per_row, q, scales)
}

/// [`int8_quantize_rows`] with a forced instruction set (every level writes the same bytes).
pub fn int8_quantize_rows_with(
    isa: Isa,
    src: &[f32],
    n_per_row: usize,
    q: &mut [i8],
    scales: &mut [f32],
) -> Result<()> {
    let rows = check_quantize(src.len(), n_per_row, q.len(), scales.len())?;
    q.par_chunks_mut(n_per_row)
        .zip(scales.par_iter_mut())
        .enumerate()
        .try_for_each(|(r, (q, s))| {
            let x = &src[r * n_per_row..(r + 1) * n_per_row];
            check_finite(x).map_err(|(i, v)| non_finite(r * n_per_row + i, v))?;
            *s = absmax(x);
            quantize_row_i8(isa, x, *s, q);
            Ok(())
        })?;
    assert_eq!(rows, scales.len());
    Ok(())
}

/// [`int8_quantize_rows`] from a checkpoint's little-endian f32, f16 or bf16 bytes, widened one
/// row at a time (exactly; bitsandbytes also computes in f32 for f16 and bf16 weights).
pub fn int8_quantize_rows_from(
    src_ty: FloatType,
    src: &[u8],
    n_per_row: usize,
    q: &mut [i8],
    scales: &mut [f32],
) -> Result<()> {
    int8_quantize_rows_from_with(Isa::detect(), src_ty, src, n_per_row, q, scales)
}

/// [`int8_quantize_rows_from`] with a forced instruction set.
pub fn int8_quantize_rows_from_with(
    isa: Isa,
    src_ty: FloatType,
    src: &[u8],
    n_per_row: usize,
    q: &mut [i8],
    scales: &mut [f32],
) -> Result<()> {
    let es = src_ty.size();
    if !src.len().is_multiple_of(es) {
        return Err(KernelError::Shape {
            op: "int8 quantize",
            reason: format!(
                "{} bytes of {src_ty} source are not whole values; the tensor is truncated",
                src.len()
            ),
        });
    }
    check_quantize(src.len() / es, n_per_row, q.len(), scales.len())?;
    q.par_chunks_mut(n_per_row)
        .zip(scales.par_iter_mut())
        .enumerate()
        .try_for_each_init(Vec::new, |buf, (r, (q, s))| {
            buf.resize(n_per_row, 0f32);
            let bytes = &src[r * n_per_row * es..(r + 1) * n_per_row * es];
            widen(src_ty, bytes, buf);
            check_finite(buf).map_err(|(i, v)| non_finite(r * n_per_row + i, v))?;
            *s = absmax(buf);
            quantize_row_i8(isa, buf, *s, q);
            Ok(())
        })
}

fn check_quantize(n: usize, n_per_row: usize, q_len: usize, s_len: usize) -> Result<usize> {
    check_cols(n_per_row)?;
    if !n.is_multiple_of(n_per_row) {
        return Err(KernelError::Shape {
            op: "int8 quantize",
            reason: format!("{n} source values are not whole rows of {n_per_row}"),
        });
    }
    super::check_len("int8 quants", n, q_len)?;
    super::check_len("int8 scales (one per row)", n / n_per_row, s_len)?;
    Ok(n / n_per_row)
}

fn non_finite(index: usize, value: f32) -> KernelError {
    KernelError::Unsupported {
        op: "int8 quantize",
        ty: format!("the non-finite source value {value} at index {index}"),
        supported: "finite values only; the tensor holds NaN or inf (a corrupted checkpoint, \
                    or one saved after an overflow?)",
    }
}

/// Quantised activations: the outlier columns, per-token quants (0 in outlier columns) and
/// per-token absmax scales, as bitsandbytes' `int8_vectorwise_quant(x, threshold)` returns
/// them.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Int8Activations {
    /// `n_tok × cols` quants.
    pub q: Vec<i8>,
    /// One absmax per token, over its values below the threshold.
    pub scales: Vec<f32>,
    /// The outlier columns, ascending.
    pub outliers: Vec<usize>,
}

/// Quantises `x` (`n_tok` rows of `cols`) for [`int8_matmul`]; see the module documentation.
pub fn int8_quantize_activations(
    x: &[f32],
    cols: usize,
    threshold: f32,
) -> Result<Int8Activations> {
    int8_quantize_activations_with(Isa::detect(), x, cols, threshold)
}

/// [`int8_quantize_activations`] with a forced instruction set.
pub fn int8_quantize_activations_with(
    isa: Isa,
    x: &[f32],
    cols: usize,
    threshold: f32,
) -> Result<Int8Activations> {
    check_cols(cols)?;
    if threshold.is_nan() {
        return Err(KernelError::Shape {
            op: "int8 matmul",
            reason: "the outlier threshold is NaN; give a number (6.0 is bitsandbytes' default, \
                     0 turns the outlier path off)"
                .into(),
        });
    }
    if !x.len().is_multiple_of(cols) {
        return Err(KernelError::Shape {
            op: "int8 matmul",
            reason: format!(
                "{} activation values are not whole tokens of {cols}",
                x.len()
            ),
        });
    }
    let n_tok = x.len() / cols;
    let mut outlier = vec![false; cols];
    if threshold > 0.0 {
        for t in x.chunks_exact(cols) {
            for (o, v) in outlier.iter_mut().zip(t) {
                *o |= v.abs() >= threshold;
            }
        }
    }
    let outliers: Vec<usize> = (0..cols).filter(|c| outlier[*c]).collect();
    let mut q = vec![0i8; n_tok * cols];
    let mut scales = vec![0f32; n_tok];
    q.par_chunks_mut(cols)
        .zip(scales.par_iter_mut())
        .zip(x.par_chunks(cols))
        .for_each(|((q, s), t)| {
            *s = if threshold > 0.0 {
                t.iter().fold(0f32, |m, v| {
                    if v.abs() < threshold {
                        m.max(v.abs())
                    } else {
                        m
                    }
                })
            } else {
                absmax(t)
            };
            quantize_row_i8(isa, t, *s, q);
            for c in &outliers {
                q[*c] = 0;
            }
        });
    Ok(Int8Activations {
        q,
        scales,
        outliers,
    })
}

/// The LLM.int8 product `y = x Wᵀ` (`x`: `n_tok × cols`, `y`: `n_tok × rows`, token-major as
/// [`matmul`](crate::matmul)) with outlier columns `|x| ≥ threshold` in f32; `threshold ≤ 0`
/// quantises every column. See the module documentation for the exact arithmetic.
pub fn int8_matmul(
    w: &Int8Weights<'_>,
    x: &[f32],
    n_tok: usize,
    threshold: f32,
    y: &mut [f32],
) -> Result<()> {
    int8_matmul_with(Isa::detect(), w, x, n_tok, threshold, y)
}

/// [`int8_matmul`] with a forced instruction set (bit-identical on every level).
pub fn int8_matmul_with(
    isa: Isa,
    w: &Int8Weights<'_>,
    x: &[f32],
    n_tok: usize,
    threshold: f32,
    y: &mut [f32],
) -> Result<()> {
    w.check()?;
    let too_many = || KernelError::Shape {
        op: "int8 matmul",
        reason: format!("{n_tok} tokens of {} × {} overflow usize", w.rows, w.cols),
    };
    let n_x = n_tok.checked_mul(w.cols).ok_or_else(too_many)?;
    let n_y = n_tok.checked_mul(w.rows).ok_or_else(too_many)?;
    super::check_len("int8 matmul activations (n_tok × cols)", n_x, x.len())?;
    super::check_len("int8 matmul output (n_tok × rows)", n_y, y.len())?;
    if n_tok == 0 || w.rows == 0 {
        return Ok(());
    }
    let act = int8_quantize_activations_with(isa, x, w.cols, threshold)?;
    let dot = Dot::pick(isa);
    let xq = layout(dot, &act.q);
    // the outlier activations, gathered per token
    let xo: Vec<f32> = x
        .chunks_exact(w.cols)
        .flat_map(|t| act.outliers.iter().map(move |c| t[*c]))
        .collect();
    let ctx = Ctx {
        w,
        n_tok,
        xq: &xq,
        sx: &act.scales,
        outliers: &act.outliers,
        xo: &xo,
        dot,
    };
    if n_tok == 1 {
        y.par_chunks_mut(ROWS_PER_TASK)
            .enumerate()
            .for_each(|(k, ys)| ctx.rows(k * ROWS_PER_TASK, ys));
        return Ok(());
    }
    // rows × tokens per task, then transposed into the token-major output
    let mut yt = vec![0f32; w.rows * n_tok];
    yt.par_chunks_mut(ROWS_PER_TASK * n_tok)
        .enumerate()
        .for_each(|(k, ys)| ctx.rows(k * ROWS_PER_TASK, ys));
    y.par_chunks_mut(w.rows).enumerate().for_each(|(t, yr)| {
        for (o, v) in yr.iter_mut().enumerate() {
            *v = yt[o * n_tok + t];
        }
    });
    Ok(())
}

/// What every task of one matmul reads.
struct Ctx<'a> {
    w: &'a Int8Weights<'a>,
    n_tok: usize,
    /// Token quants in the layout `dot` reads (the VNNI forms store `q + 128` as u8).
    xq: &'a [u8],
    sx: &'a [f32],
    outliers: &'a [usize],
    /// `n_tok × outliers.len()` outlier activations.
    xo: &'a [f32],
    dot: Dot,
}

impl Ctx<'_> {
    /// Outputs of weight rows `r0..`, `ys[(o - r0) * n_tok + t]`.
    fn rows(&self, r0: usize, ys: &mut [f32]) {
        let (cols, nt, no) = (self.w.cols, self.n_tok, self.outliers.len());
        let n_rows = ys.len() / nt;
        let wq = &self.w.q[r0 * cols..(r0 + n_rows) * cols];
        let mut acc = vec![0i32; n_rows * nt];
        match self.dot {
            Dot::Scalar => {
                for (k, a) in acc.chunks_exact_mut(nt).enumerate() {
                    let wr = &wq[k * cols..(k + 1) * cols];
                    for (a, xr) in a.iter_mut().zip(self.xq.chunks_exact(cols)) {
                        *a = wr
                            .iter()
                            .zip(xr)
                            .map(|(w, x)| i32::from(*w) * i32::from(*x as i8))
                            .sum();
                    }
                }
            }
            #[cfg(target_arch = "x86_64")]
            Dot::X86(kind) => kind.dots(wq, n_rows, self.xq, &mut acc),
        }
        for (k, (yo, a)) in ys
            .chunks_exact_mut(nt)
            .zip(acc.chunks_exact(nt))
            .enumerate()
        {
            let wr = &wq[k * cols..(k + 1) * cols];
            let sw = self.w.scales[r0 + k];
            for (t, y) in yo.iter_mut().enumerate() {
                let mut v = (a[t] as f32 * (self.sx[t] * sw)) * MM_DEQUANT;
                if no > 0 {
                    let xo = &self.xo[t * no..(t + 1) * no];
                    let mut s = 0f32;
                    for (c, xv) in self.outliers.iter().zip(xo) {
                        s += xv * ((f32::from(wr[*c]) * sw) * DEQUANT);
                    }
                    v += s;
                }
                *y = v;
            }
        }
    }
}

/// The token quants as bytes in the layout the dot path reads.
pub(crate) fn layout(dot: Dot, q: &[i8]) -> Vec<u8> {
    match dot {
        #[cfg(target_arch = "x86_64")]
        Dot::X86(kind) if kind.biased() => q.iter().map(|v| (*v as u8) ^ 0x80).collect(),
        _ => q.iter().map(|v| *v as u8).collect(),
    }
}

/// Bytes of a `rows × cols` int8 matrix in its one-buffer layout: the `rows · cols` quants,
/// row-major, then one little-endian f32 absmax per row (the engine's `DType::INT8`, which
/// keeps bitsandbytes' `CB` and `SCB` in one region). `None` on overflow.
pub fn int8_packed_bytes(rows: usize, cols: usize) -> Option<usize> {
    rows.checked_mul(cols)?.checked_add(rows.checked_mul(4)?)
}

/// Quantises `src` (whole rows of `n_per_row` values) as [`int8_quantize_rows`] into the
/// one-buffer layout of [`int8_packed_bytes`]: `out` must hold exactly that many bytes.
pub fn int8_pack_rows(src: &[f32], n_per_row: usize, out: &mut [u8]) -> Result<()> {
    check_cols(n_per_row)?;
    let rows = src.len() / n_per_row;
    let need = int8_packed_bytes(rows, n_per_row).unwrap_or(usize::MAX);
    super::check_len(
        "int8 packed bytes (quants, then a scale per row)",
        need,
        out.len(),
    )?;
    let (q, s) = out.split_at_mut(rows * n_per_row);
    let mut scales = vec![0f32; rows];
    int8_quantize_rows(src, n_per_row, bytemuck::cast_slice_mut(q), &mut scales)?;
    for (d, v) in s.chunks_exact_mut(4).zip(&scales) {
        d.copy_from_slice(&v.to_le_bytes());
    }
    Ok(())
}

/// [`int8_matmul`] over weights in the one-buffer layout of [`int8_packed_bytes`] (`w` may be
/// longer; its first bytes are read). The scales are read in place when they are 4-byte
/// aligned, else copied first (one f32 per row).
pub fn int8_matmul_packed(
    w: &[u8],
    rows: usize,
    cols: usize,
    x: &[f32],
    n_tok: usize,
    threshold: f32,
    y: &mut [f32],
) -> Result<()> {
    int8_matmul_packed_with(Isa::detect(), w, rows, cols, x, n_tok, threshold, y)
}

/// [`int8_matmul_packed`] with a forced instruction set.
#[allow(clippy::too_many_arguments)]
pub fn int8_matmul_packed_with(
    isa: Isa,
    w: &[u8],
    rows: usize,
    cols: usize,
    x: &[f32],
    n_tok: usize,
    threshold: f32,
    y: &mut [f32],
) -> Result<()> {
    check_cols(cols)?;
    let need = int8_packed_bytes(rows, cols).ok_or_else(|| KernelError::Shape {
        op: "int8 matmul",
        reason: format!("{rows} × {cols} weights overflow usize"),
    })?;
    if w.len() < need {
        return Err(KernelError::LengthMismatch {
            what: "int8 weight bytes (quants, then a scale per row)",
            expected: need,
            got: w.len(),
        });
    }
    let (q, s) = w[..need].split_at(rows * cols);
    let scales: std::borrow::Cow<'_, [f32]> = match bytemuck::try_cast_slice(s) {
        Ok(s) => std::borrow::Cow::Borrowed(s),
        Err(_) => s
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
    };
    let weights = Int8Weights {
        q: bytemuck::cast_slice(q),
        scales: &scales,
        rows,
        cols,
    };
    int8_matmul_with(isa, &weights, x, n_tok, threshold, y)
}
