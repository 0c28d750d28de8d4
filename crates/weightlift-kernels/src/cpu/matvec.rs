//! Quantised matrix–vector and matrix–matrix products, `y = W x`, as ggml's `mul_mat`:
//! `W` is `rows × cols` stored row-major in blocks of its type, `x` holds `n_tok` vectors of
//! `cols` values, and `y[t * rows + r] = dot(W[r], x[t])`.
//!
//! Two modes, chosen by the caller:
//!
//! - [`MatvecMode::Exact`]: each weight block is dequantised in registers (bit-identical to
//!   [`dequantize_f32`](super::dequantize_f32)) and multiplied with the f32 activations,
//!   accumulating in f32. The only error is f32 summation rounding. Every weight type works.
//! - [`MatvecMode::Q8`]: llama.cpp's CPU scheme (`ggml_vec_dot_q4_0_q8_0` and friends). The
//!   activations are first quantised per 32 values to int8 with one scale
//!   (`d = amax/127`, `q = roundf(x/d)`, `d` stored rounded to f16 as in `block_q8_0`), then
//!   each block's integer dot product is exact and scaled by `d_w · d_x` in f32. It moves less
//!   data and uses integer SIMD, but adds the activation rounding error (≤ `d_x/2` per
//!   value, about 0.4 % of the block's largest activation). Weight types: Q4_0, Q4_1, Q8_0,
//!   Q4_K and Q6_K. Unlike llama.cpp, K-quants also use 32-value activation blocks (llama.cpp
//!   uses 256-value `block_q8_K` with an f32 scale), so results differ from llama.cpp's in the
//!   last bits. The scalar and AVX2 paths of this mode give bit-identical results.

use rayon::prelude::*;

use super::dequant_scalar::scale_min_k4;
use super::half::{f16_to_f32, f32_to_f16, rd_f16};
use super::{Isa, dequant_seq};
use crate::error::{KernelError, Result};
use crate::types::QuantType;

/// How activations are treated; see the module documentation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum MatvecMode {
    /// Dequantise weights in registers, f32 activations, f32 accumulation.
    #[default]
    Exact,
    /// Quantise activations to 8-bit blocks of 32, as llama.cpp's CPU backend does.
    Q8,
}

/// The weight types [`MatvecMode::Q8`] supports.
pub const Q8_WEIGHT_TYPES: &str = "q4_0, q4_1, q8_0, q4_k, q6_k";

/// 32 activations quantised to int8: `x ≈ d * qs`.
#[derive(Debug, Clone, Copy)]
#[repr(C)]
pub struct Q8Block {
    /// The scale, already rounded through f16 as llama.cpp's `block_q8_0` stores it.
    pub d: f32,
    /// The sum of `qs`.
    pub sum: i32,
    /// The quants, in [-127, 127].
    pub qs: [i8; 32],
}

/// Quantises `x` (a multiple of 32 long) to [`Q8Block`]s, as llama.cpp's
/// `quantize_row_q8_0_ref`: `d = amax/127`, `q = roundf(x * (1/d))` (half away from zero),
/// then `d` is stored as f16.
pub fn quantize_q8_blocks(x: &[f32]) -> Vec<Q8Block> {
    x.chunks_exact(32)
        .map(|c| {
            let amax = c.iter().fold(0f32, |m, v| m.max(v.abs()));
            let d = amax / 127.0;
            let id = if d != 0.0 { 1.0 / d } else { 0.0 };
            let mut qs = [0i8; 32];
            let mut sum = 0i32;
            for (q, v) in qs.iter_mut().zip(c) {
                *q = (v * id).round() as i8;
                sum += i32::from(*q);
            }
            Q8Block {
                d: f16_to_f32(f32_to_f16(d)),
                sum,
                qs,
            }
        })
        .collect()
}

fn check_shapes(
    ty: QuantType,
    w: &[u8],
    rows: usize,
    cols: usize,
    x_len: usize,
    n_tok: usize,
    y_len: usize,
) -> Result<()> {
    let bs = ty.block_size();
    if !cols.is_multiple_of(bs) {
        return Err(KernelError::Shape {
            op: "matvec",
            reason: format!("row length {cols} is not a multiple of the {ty} block size {bs}"),
        });
    }
    let row_bytes = cols / bs * ty.block_bytes();
    let expected = rows
        .checked_mul(row_bytes)
        .ok_or_else(|| KernelError::Shape {
            op: "matvec",
            reason: format!("{rows} rows of {row_bytes} bytes overflow"),
        })?;
    if w.len() != expected {
        return Err(KernelError::LengthMismatch {
            what: "matvec weight bytes",
            expected,
            got: w.len(),
        });
    }
    let xe = n_tok.saturating_mul(cols);
    if x_len != xe {
        return Err(KernelError::LengthMismatch {
            what: "matvec activation values",
            expected: xe,
            got: x_len,
        });
    }
    let ye = n_tok.saturating_mul(rows);
    if y_len != ye {
        return Err(KernelError::LengthMismatch {
            what: "matvec output values",
            expected: ye,
            got: y_len,
        });
    }
    Ok(())
}

fn check_q8_type(ty: QuantType) -> Result<()> {
    match ty {
        QuantType::Q4_0 | QuantType::Q4_1 | QuantType::Q8_0 | QuantType::Q4_K | QuantType::Q6_K => {
            Ok(())
        }
        _ => Err(KernelError::Unsupported {
            op: "matvec (q8 mode)",
            ty: ty.to_string(),
            supported: Q8_WEIGHT_TYPES,
        }),
    }
}

/// Values dequantised per step of the exact row dot (fits in L1 with the activations).
const EXACT_TILE: usize = 1024;

/// Exact dot of one quantised row with `x`.
fn row_dot_exact(isa: Isa, ty: QuantType, row: &[u8], x: &[f32], tmp: &mut [f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if isa.has_avx512() && super::x86::imp::exact_has_fused(ty) {
        // SAFETY: AVX-512F/BW/VL, AVX2 and F16C detected; check_shapes made x as long as the row.
        return unsafe { super::x86::imp::row_dot_exact_avx512(ty, row, x) };
    }
    #[cfg(target_arch = "x86_64")]
    if isa.has_avx2() && super::x86::imp::exact_has_fused(ty) {
        // SAFETY: AVX2/FMA/F16C detected; check_shapes made x as long as the row's values.
        return unsafe { super::x86::imp::row_dot_exact_avx2(ty, row, x) };
    }
    let (bb, bs) = (ty.block_bytes(), ty.block_size());
    let per = (EXACT_TILE / bs).max(1);
    let mut acc = 0f32;
    for (wb, xs) in row.chunks(per * bb).zip(x.chunks(per * bs)) {
        let t = &mut tmp[..xs.len()];
        dequant_seq(isa, ty, wb, t);
        acc += dot_f32(isa, t, xs);
    }
    acc
}

/// f32 dot product with the chosen instruction set.
pub fn dot_f32(isa: Isa, a: &[f32], b: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if isa.has_avx512() {
        // SAFETY: AVX-512F detected at run time.
        return unsafe { super::x86::imp::dot_f32_avx512(a, b) };
    }
    #[cfg(target_arch = "x86_64")]
    if isa.has_avx2() {
        // SAFETY: AVX2 and FMA detected at run time.
        return unsafe { super::x86::imp::dot_f32_avx2(a, b) };
    }
    let _ = isa;
    // eight partial sums, as a vector unit would, so long rows lose less to rounding
    let mut s = [0f32; 8];
    let mut ca = a.chunks_exact(8);
    let mut cb = b.chunks_exact(8);
    for (pa, pb) in (&mut ca).zip(&mut cb) {
        for k in 0..8 {
            s[k] += pa[k] * pb[k];
        }
    }
    let mut t: f32 = s.iter().sum();
    for (p, q) in ca.remainder().iter().zip(cb.remainder()) {
        t += p * q;
    }
    t
}

/// Sums each block's integer products in 8 lanes of 4 consecutive values (lane `j` covers
/// values `4j..4j+4`, the layout of x86's `pmaddubsw` + `pmaddwd`), scales each lane by the
/// block's `d_w · d_x` with a fused multiply-add into 8 f32 accumulators, and adds the lanes in
/// a fixed tree at the end. The scalar path does exactly these operations, so both paths give
/// the same bits; min/offset terms go to a separate sequential scalar sum.
pub(crate) fn finish_lanes(acc: &[f32; 8], extra: f32) -> f32 {
    let s: [f32; 4] = [
        acc[0] + acc[4],
        acc[1] + acc[5],
        acc[2] + acc[6],
        acc[3] + acc[7],
    ];
    ((s[0] + s[2]) + (s[1] + s[3])) + extra
}

/// Lane sums of Σ w·x over 32 values: lane j = Σ_{i=4j}^{4j+3} w_i x_i.
#[inline(always)]
fn lanes(w: &[i32; 32], x: &[i8; 32]) -> [i32; 8] {
    let mut l = [0i32; 8];
    for (i, (a, b)) in w.iter().zip(x).enumerate() {
        l[i / 4] += a * i32::from(*b);
    }
    l
}

/// The 32 nibbles of a 16-byte Q4 quant array in value order, minus `off`.
#[inline(always)]
fn nibbles(qs: &[u8], off: i32) -> [i32; 32] {
    let mut w = [0i32; 32];
    for j in 0..16 {
        w[j] = i32::from(qs[j] & 0x0f) - off;
        w[j + 16] = i32::from(qs[j] >> 4) - off;
    }
    w
}

/// Scalar Q8-mode dot of one weight row with quantised activations.
fn row_dot_q8_scalar(ty: QuantType, row: &[u8], xq: &[Q8Block]) -> f32 {
    let bb = ty.block_bytes();
    let mut acc = [0f32; 8];
    let mut extra = 0f32;
    let fma_lanes = |dd: [f32; 8], l: [i32; 8], acc: &mut [f32; 8]| {
        for j in 0..8 {
            acc[j] = dd[j].mul_add(l[j] as f32, acc[j]);
        }
    };
    match ty {
        QuantType::Q4_0 | QuantType::Q4_1 | QuantType::Q8_0 => {
            for (blk, xb) in row.chunks_exact(bb).zip(xq) {
                let d = rd_f16(blk, 0);
                let w: [i32; 32] = match ty {
                    QuantType::Q4_0 => nibbles(&blk[2..18], 8),
                    QuantType::Q4_1 => nibbles(&blk[4..20], 0),
                    _ => std::array::from_fn(|i| i32::from(blk[2 + i] as i8)),
                };
                fma_lanes([d * xb.d; 8], lanes(&w, &xb.qs), &mut acc);
                if ty == QuantType::Q4_1 {
                    extra += (rd_f16(blk, 2) * xb.d) * xb.sum as f32;
                }
            }
        }
        QuantType::Q4_K => {
            for (blk, xbs) in row.chunks_exact(bb).zip(xq.chunks_exact(8)) {
                let d = rd_f16(blk, 0);
                let dmin = rd_f16(blk, 2);
                let scales = &blk[4..16];
                for (sb, xb) in xbs.iter().enumerate() {
                    let (sc, m) = scale_min_k4(sb, scales);
                    let (c, shift) = (sb / 2, 4 * (sb % 2));
                    let w: [i32; 32] =
                        std::array::from_fn(|l| i32::from((blk[16 + 32 * c + l] >> shift) & 0x0f));
                    fma_lanes([d * sc as f32 * xb.d; 8], lanes(&w, &xb.qs), &mut acc);
                    extra -= (dmin * m as f32 * xb.d) * xb.sum as f32;
                }
            }
        }
        QuantType::Q6_K => {
            let mut q = [0i8; 256];
            for (blk, xbs) in row.chunks_exact(bb).zip(xq.chunks_exact(8)) {
                let d = rd_f16(blk, 208);
                q6k_quants(blk, &mut q);
                for (g, xb) in xbs.iter().enumerate() {
                    let w: [i32; 32] = std::array::from_fn(|l| i32::from(q[32 * g + l]));
                    let s0 = d * f32::from(blk[192 + 2 * g] as i8) * xb.d;
                    let s1 = d * f32::from(blk[193 + 2 * g] as i8) * xb.d;
                    fma_lanes(
                        [s0, s0, s0, s0, s1, s1, s1, s1],
                        lanes(&w, &xb.qs),
                        &mut acc,
                    );
                }
            }
        }
        _ => {}
    }
    finish_lanes(&acc, extra)
}

/// Q8-mode dot of one weight row with quantised activations (see [`finish_lanes`]).
fn row_dot_q8(isa: Isa, ty: QuantType, row: &[u8], xq: &[Q8Block]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if isa.has_avx2() {
        // SAFETY: AVX2 and FMA detected at run time; the row holds whole blocks matched by xq.
        return unsafe { super::x86::imp::row_dot_q8_avx2(ty, row, xq) };
    }
    let _ = isa;
    row_dot_q8_scalar(ty, row, xq)
}

/// The 256 signed 6-bit quants (minus 32) of a Q6_K block, in element order.
pub(crate) fn q6k_quants(blk: &[u8], q: &mut [i8; 256]) {
    for (e, qe) in q.iter_mut().enumerate() {
        let h = e / 128;
        let r = e % 128;
        let lo = (blk[h * 64 + r % 64] >> (4 * (r / 64))) & 0x0f;
        let hi = (blk[128 + h * 32 + r % 32] >> (2 * (r / 32))) & 3;
        *qe = (lo | (hi << 4)) as i8 - 32;
    }
}

/// Values dequantised per matmul task (256 KiB of f32: stays in L2 while every token uses it).
const DQ_TILE: usize = 64 * 1024;

/// Rows per parallel task.
const ROWS_PER_TASK: usize = 16;

/// `y = W x` for one f32 activation vector (`x.len() == cols`, `y.len() == rows`).
pub fn matvec(
    mode: MatvecMode,
    ty: QuantType,
    w: &[u8],
    rows: usize,
    cols: usize,
    x: &[f32],
    y: &mut [f32],
) -> Result<()> {
    matvec_with(Isa::detect(), mode, ty, w, rows, cols, x, y)
}

/// [`matvec`] with a forced instruction set.
#[allow(clippy::too_many_arguments)]
pub fn matvec_with(
    isa: Isa,
    mode: MatvecMode,
    ty: QuantType,
    w: &[u8],
    rows: usize,
    cols: usize,
    x: &[f32],
    y: &mut [f32],
) -> Result<()> {
    check_shapes(ty, w, rows, cols, x.len(), 1, y.len())?;
    if rows == 0 || cols == 0 {
        y.fill(0.0);
        return Ok(());
    }
    let row_bytes = w.len() / rows;
    match mode {
        MatvecMode::Exact => {
            y.par_chunks_mut(ROWS_PER_TASK)
                .enumerate()
                .for_each(|(i, ys)| {
                    let mut tmp = vec![0f32; EXACT_TILE.max(ty.block_size())];
                    for (k, yv) in ys.iter_mut().enumerate() {
                        let r = i * ROWS_PER_TASK + k;
                        *yv = row_dot_exact(
                            isa,
                            ty,
                            &w[r * row_bytes..(r + 1) * row_bytes],
                            x,
                            &mut tmp,
                        );
                    }
                });
        }
        MatvecMode::Q8 => {
            check_q8_type(ty)?;
            let xq = quantize_q8_blocks(x);
            y.par_chunks_mut(ROWS_PER_TASK)
                .enumerate()
                .for_each(|(i, ys)| {
                    for (k, yv) in ys.iter_mut().enumerate() {
                        let r = i * ROWS_PER_TASK + k;
                        *yv = row_dot_q8(isa, ty, &w[r * row_bytes..(r + 1) * row_bytes], &xq);
                    }
                });
        }
    }
    Ok(())
}

/// [`matvec`] with f16 activations (bit patterns); they are widened to f32 first.
pub fn matvec_f16(
    mode: MatvecMode,
    ty: QuantType,
    w: &[u8],
    rows: usize,
    cols: usize,
    x: &[u16],
    y: &mut [f32],
) -> Result<()> {
    let xf: Vec<f32> = x.iter().map(|h| f16_to_f32(*h)).collect();
    matvec(mode, ty, w, rows, cols, &xf, y)
}

/// `y = W x` for `n_tok` activation vectors: `x` is `n_tok × cols`, `y` is `n_tok × rows`.
///
/// In [`MatvecMode::Exact`] the weights are dequantised to f32 in tiles of whole rows holding
/// at most `min(max_dq_size, 65536)` values (exllamav2's `max_dq_size` bounds it; a tile is at
/// least one row), one tile per parallel task, and each tile is multiplied with every token
/// four at a time; peak scratch is one tile per worker thread. In
/// [`MatvecMode::Q8`] the tokens are quantised once and each weight row meets every token.
#[allow(clippy::too_many_arguments)]
pub fn matmul(
    mode: MatvecMode,
    ty: QuantType,
    w: &[u8],
    rows: usize,
    cols: usize,
    x: &[f32],
    n_tok: usize,
    y: &mut [f32],
    max_dq_size: usize,
) -> Result<()> {
    matmul_with(
        Isa::detect(),
        mode,
        ty,
        w,
        rows,
        cols,
        x,
        n_tok,
        y,
        max_dq_size,
    )
}

/// [`matmul`] with a forced instruction set.
#[allow(clippy::too_many_arguments)]
pub fn matmul_with(
    isa: Isa,
    mode: MatvecMode,
    ty: QuantType,
    w: &[u8],
    rows: usize,
    cols: usize,
    x: &[f32],
    n_tok: usize,
    y: &mut [f32],
    max_dq_size: usize,
) -> Result<()> {
    check_shapes(ty, w, rows, cols, x.len(), n_tok, y.len())?;
    if rows == 0 || cols == 0 || n_tok == 0 {
        y.fill(0.0);
        return Ok(());
    }
    let row_bytes = w.len() / rows;
    // results gathered row-major by weight row, transposed into y at the end
    let mut yt = vec![0f32; rows * n_tok];
    match mode {
        MatvecMode::Exact => {
            // Each parallel task dequantises a tile of whole rows into its own scratch (kept in
            // L2 when max_dq_size allows) and meets it with every token.
            let tile_rows = (max_dq_size.min(DQ_TILE) / cols).clamp(1, rows);
            let dq_seq = |src: &[u8], out: &mut [f32]| {
                let (bb, bs) = (ty.block_bytes(), ty.block_size());
                let per = (super::CHUNK_ELEMS / bs).max(1);
                for (s, o) in src.chunks(per * bb).zip(out.chunks_mut(per * bs)) {
                    dequant_seq(isa, ty, s, o);
                }
            };
            yt.par_chunks_mut(tile_rows * n_tok)
                .enumerate()
                .for_each(|(ti, yc)| {
                    let r0 = ti * tile_rows;
                    let nr = yc.len() / n_tok;
                    let mut wd = vec![0f32; nr * cols];
                    dq_seq(&w[r0 * row_bytes..(r0 + nr) * row_bytes], &mut wd);
                    for (r, yr) in yc.chunks_mut(n_tok).enumerate() {
                        let wr = &wd[r * cols..(r + 1) * cols];
                        let xt = |t: usize| &x[t * cols..(t + 1) * cols];
                        let mut t = 0;
                        #[cfg(target_arch = "x86_64")]
                        if isa.has_avx2() {
                            // four tokens per pass share each load of the weight row
                            while t + 4 <= n_tok {
                                let xs = [xt(t), xt(t + 1), xt(t + 2), xt(t + 3)];
                                let v = if isa.has_avx512() {
                                    // SAFETY: AVX-512F detected; each token row has `cols` values.
                                    unsafe { super::x86::imp::dot4_f32_avx512(wr, xs) }
                                } else {
                                    // SAFETY: AVX2/FMA detected; each token row has `cols` values.
                                    unsafe { super::x86::imp::dot4_f32_avx2(wr, xs) }
                                };
                                yr[t..t + 4].copy_from_slice(&v);
                                t += 4;
                            }
                        }
                        for (k, yv) in yr.iter_mut().enumerate().skip(t) {
                            *yv = dot_f32(isa, wr, xt(k));
                        }
                    }
                });
        }
        MatvecMode::Q8 => {
            check_q8_type(ty)?;
            let xq = quantize_q8_blocks(x);
            let per_tok = cols / 32;
            yt.par_chunks_mut(n_tok).enumerate().for_each(|(r, yr)| {
                let wr = &w[r * row_bytes..(r + 1) * row_bytes];
                for (t, yv) in yr.iter_mut().enumerate() {
                    *yv = row_dot_q8(isa, ty, wr, &xq[t * per_tok..(t + 1) * per_tok]);
                }
            });
        }
    }
    for (r, yr) in yt.chunks_exact(n_tok).enumerate() {
        for (t, v) in yr.iter().enumerate() {
            y[t * rows + r] = *v;
        }
    }
    Ok(())
}

/// [`matmul`] with f16 activations (bit patterns).
#[allow(clippy::too_many_arguments)]
pub fn matmul_f16(
    mode: MatvecMode,
    ty: QuantType,
    w: &[u8],
    rows: usize,
    cols: usize,
    x: &[u16],
    n_tok: usize,
    y: &mut [f32],
    max_dq_size: usize,
) -> Result<()> {
    let xf: Vec<f32> = x.iter().map(|h| f16_to_f32(*h)).collect();
    matmul(mode, ty, w, rows, cols, &xf, n_tok, y, max_dq_size)
}
