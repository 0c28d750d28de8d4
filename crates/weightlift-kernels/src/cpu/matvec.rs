//! Quantised matrix–vector and matrix–matrix products, `y = W x`, as ggml's `mul_mat`:
//! `W` is `rows × cols` stored row-major in blocks of its type, `x` holds `n_tok` vectors of
//! `cols` values, and `y[t * rows + r] = dot(W[r], x[t])`.
//!
//! Two modes, chosen by the caller:
//!
//! - [`MatvecMode::Exact`]: each weight block is dequantised in registers (bit-identical to
//!   [`dequantize_f32`](super::dequantize_f32)) and multiplied with the f32 activations,
//!   accumulating in f32. The only error is f32 summation rounding. Every weight type works.
//! - [`MatvecMode::Q8`]: llama.cpp's CPU scheme (`ggml_vec_dot_q4_0_q8_0`,
//!   `ggml_vec_dot_q5_0_q8_0` and friends). The activations are first quantised per 32
//!   values to int8 with one scale (`d = amax/127`, `q = roundf(x/d)`, `d` stored rounded to
//!   f16 as in `block_q8_0`), then each block's integer dot product is exact and scaled by
//!   `d_w · d_x` in f32. It moves less data and uses integer SIMD, but adds the activation
//!   rounding error (≤ `d_x/2` per value, about 0.4 % of the block's largest activation).
//!   Weight types: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K and Q6_K. The types with
//!   an offset (Q4_1's and Q5_1's `m`, Q4_K's and Q5_K's mins) add `m · d_x · Σq_x` per 32
//!   values, from the activation block's quant sum ([`Q8Block::sum`]; llama.cpp's `block_q8_1`
//!   carries `d · Σq` for this). Q2_K's mins are per 16 values: the matvec takes off
//!   `(dmin · d_x) · (m_lo · Σq_lo + m_hi · Σq_hi)` per 32 values, the integer in parentheses
//!   exact, from the sums of the block's two halves, with one fused multiply-add into an
//!   8-lane sum (a lane per 32-value group of the block, as one vector holds them) that the
//!   lane tree of [`finish_lanes`] adds at the end. Unlike llama.cpp, K-quants also use
//!   32-value activation blocks (llama.cpp uses 256-value `block_q8_K` with an f32 scale), so
//!   results differ from
//!   llama.cpp's in the last bits. In [`matvec`] every instruction set gives bit-identical
//!   results (its SIMD kernels take four rows at a time, two per 512-bit vector with
//!   AVX512-VNNI, each row with the scalar path's operations, prefetching ahead because the
//!   hardware prefetchers do not follow four interleaved rows), and so does [`matmul`].
//!
//! [`matmul`] in [`MatvecMode::Q8`] takes one of three paths by token count:
//!
//! - 1 token: [`matvec`].
//! - 2 to 16 tokens (a decode step of continuous batching, one token per sequence, or a short
//!   prompt): the tokens are quantised once, and each weight row is read and decoded once per
//!   pass of up to 16 tokens (8 without AVX512-VNNI, whose 16 vector registers hold fewer
//!   accumulators) and met with every token's activation block in registers
//!   (`x86_matvec_batch`, one accumulator per token). Each token gets the integer lane sums
//!   and the float operations, in their order, of [`matvec`] of that token alone (per block
//!   `fma(d · d_x, lane, acc)`, `(d · sc) · d_x` for the K-quants, the offset term summed
//!   apart, the same final tree): only the loop order changes, so **a token's result has the
//!   bits of its own [`matvec`]**, on every instruction set and VNNI choice, whatever the
//!   other tokens are: a sequence decoded in a batch gets the products it gets alone.
//! - More tokens (prompts): integer register tiles (`x86_gemm`: 16 weight rows × up to 12
//!   tokens, VNNI where the CPU has it) that sum each 32-value group's integer products in
//!   full (16 values for Q2_K, Q3_K and Q6_K, whose scales are per 16) and scale them once, where the matvec
//!   scales eight 4-value lanes: one f32 rounding per group instead of eight, so those results
//!   differ from the matvec's in the last bits (tested within 1e-5 of Σ(|w| + 2|m|)·|x|); the
//!   scalar path does the tiles' float operations in their order.

use rayon::prelude::*;

use super::dequant_scalar::{q3k_scales, scale_min_k4};
use super::half::{f16_to_f32, f32_to_f16, rd_f16};
use super::{Isa, Vnni, dequant_seq};
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
pub const Q8_WEIGHT_TYPES: &str = "q4_0, q4_1, q5_0, q5_1, q8_0, q2_k, q3_k, q4_k, q5_k, q6_k";

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
    x.chunks_exact(32).map(q8_block).collect()
}

/// One [`Q8Block`] of [`quantize_q8_blocks`].
fn q8_block(c: &[f32]) -> Q8Block {
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
}

/// The quant offset of the VNNI Q8-mode kernels for `ty` (they multiply the weight quants made
/// unsigned, `q + off`), or 0 where they need none: the types whose quants are unsigned
/// already (Q4_1, Q5_1, Q4_K), and every type without VNNI.
fn vnni_offset(vnni: Option<Vnni>, ty: QuantType) -> i32 {
    match (vnni, ty) {
        (None, _) => 0,
        (_, QuantType::Q4_0) => 8,
        (_, QuantType::Q5_0) => 16,
        (_, QuantType::Q8_0) => 128,
        (_, QuantType::Q3_K) => 4,
        (_, QuantType::Q6_K) => 32,
        _ => 0,
    }
}

/// The quant offset of the Q8-mode matvec's kernels for `ty`: [`vnni_offset`]'s, and without
/// VNNI Q3_K's and Q6_K's (their AVX2 form multiplies the quants made unsigned with
/// `pmaddubsw` and adds the lane offsets, two instructions a group fewer than moving each
/// quant's sign onto the activations).
fn matvec_offset(vnni: Option<Vnni>, ty: QuantType) -> i32 {
    match (vnni, ty) {
        (None, QuantType::Q3_K) => 4,
        (None, QuantType::Q6_K) => 32,
        _ => vnni_offset(vnni, ty),
    }
}

/// One matvec call's activations, quantised: the blocks, the kernels' lane offsets (for
/// [`matvec_offset`], or none) and the sums of each block's first and last 16 quants (Q2_K's
/// mins; the kernels load eight blocks' sums as one vector).
#[derive(Default)]
struct Q8Activations {
    q: Vec<Q8Block>,
    bias: Vec<[i32; 8]>,
    lo: Vec<i32>,
    hi: Vec<i32>,
}

impl Q8Activations {
    /// Quantises `x` as [`quantize_q8_blocks`] (bit for bit: the SIMD quantiser is tested
    /// against it), with each block's half sum and, when `off` is not 0, the lane offsets,
    /// `−off · Σ x` over each lane's 4 values.
    fn fill(&mut self, isa: Isa, x: &[f32], off: i32) {
        let n = x.len() / 32;
        let zero = Q8Block {
            d: 0.0,
            sum: 0,
            qs: [0; 32],
        };
        self.q.clear();
        self.q.resize(n, zero);
        self.bias.clear();
        self.bias.resize(if off != 0 { n } else { 0 }, [0; 8]);
        self.lo.clear();
        self.lo.resize(n, 0);
        quantize_q8_into(isa, x, off, &mut self.q, &mut self.bias, &mut self.lo);
        self.hi.clear();
        self.hi
            .extend(self.q.iter().zip(&self.lo).map(|(b, lo)| b.sum - lo));
    }
}

/// `x` quantised into the blocks `q` as [`quantize_q8_blocks`] (bit for bit: the SIMD
/// quantiser is tested against it), when `off` is not 0 the lane offsets `bias` (one per
/// block; empty otherwise), `−off · Σ x` over each lane's 4 values, and each block's
/// [`half_sum`] into `lo` (one per block, or empty).
pub(super) fn quantize_q8_into(
    isa: Isa,
    x: &[f32],
    off: i32,
    q: &mut [Q8Block],
    bias: &mut [[i32; 8]],
    lo: &mut [i32],
) {
    #[cfg(target_arch = "x86_64")]
    if isa.has_avx2() {
        // SAFETY: AVX2, FMA and F16C detected at run time; q holds x.len() / 32 blocks, bias
        // and lo as many or none (the kernel checks them).
        return unsafe { super::x86_matvec::quantize_q8_avx2(x, off, q, bias, lo) };
    }
    let _ = isa;
    for (b, c) in q.iter_mut().zip(x.chunks_exact(32)) {
        *b = q8_block(c);
    }
    for (l, b) in lo.iter_mut().zip(q.iter()) {
        *l = half_sum(b);
    }
    for (l, b) in bias.iter_mut().zip(q.iter()) {
        *l = std::array::from_fn(|j| {
            -off * b.qs[4 * j..4 * j + 4]
                .iter()
                .map(|v| i32::from(*v))
                .sum::<i32>()
        });
    }
}

/// Runs `f` on `x` quantised by [`Q8Activations::fill`], in buffers each thread keeps, so a
/// decode step's matvecs allocate nothing (fresh ones when the thread's are in use, as when
/// a matvec runs inside another's parallel loop).
fn with_q8_activations<T>(isa: Isa, x: &[f32], off: i32, f: impl FnOnce(&Q8Activations) -> T) -> T {
    thread_local! {
        static BUFFERS: std::cell::RefCell<Q8Activations> =
            std::cell::RefCell::new(Q8Activations::default());
    }
    BUFFERS.with(|cell| match cell.try_borrow_mut() {
        Ok(mut held) => {
            held.fill(isa, x, off);
            f(&held)
        }
        Err(_) => {
            let mut fresh = Q8Activations::default();
            fresh.fill(isa, x, off);
            f(&fresh)
        }
    })
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

/// Whether the CPU's [`MatvecMode::Q8`] has kernels for weights of `ty` (the types of
/// [`Q8_WEIGHT_TYPES`]); [`matvec`] and [`matmul`] refuse the others in that mode.
pub fn q8_supports(ty: QuantType) -> bool {
    matches!(
        ty,
        QuantType::Q4_0
            | QuantType::Q4_1
            | QuantType::Q5_0
            | QuantType::Q5_1
            | QuantType::Q8_0
            | QuantType::Q2_K
            | QuantType::Q3_K
            | QuantType::Q4_K
            | QuantType::Q5_K
            | QuantType::Q6_K
    )
}

fn check_q8_type(ty: QuantType) -> Result<()> {
    if q8_supports(ty) {
        return Ok(());
    }
    Err(KernelError::Unsupported {
        op: "matvec (q8 mode)",
        ty: ty.to_string(),
        supported: Q8_WEIGHT_TYPES,
    })
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
    if let Some(values) = f32_values(ty, row) {
        // The same tiles and sums as below, without copying the values out first (the copy
        // made f32 weights eight times slower than their dot products).
        for (ws, xs) in values.chunks(EXACT_TILE).zip(x.chunks(EXACT_TILE)) {
            acc += dot_f32(isa, ws, xs);
        }
        return acc;
    }
    for (wb, xs) in row.chunks(per * bb).zip(x.chunks(per * bs)) {
        let t = &mut tmp[..xs.len()];
        dequant_seq(isa, ty, wb, t);
        acc += dot_f32(isa, t, xs);
    }
    acc
}

/// An F32 row's bytes as values, where they are aligned for it (a mapped GGUF or safetensors
/// tensor is); `None` for other types or an unaligned row.
fn f32_values(ty: QuantType, row: &[u8]) -> Option<&[f32]> {
    if ty != QuantType::F32 || cfg!(target_endian = "big") {
        return None;
    }
    // SAFETY: every bit pattern is a valid f32; align_to only hands out the aligned middle.
    let (head, values, tail) = unsafe { row.align_to::<f32>() };
    (head.is_empty() && tail.is_empty()).then_some(values)
}

/// f32 dot product with the chosen instruction set. Inlined: attention calls it once per
/// query and key, on 64 values, where an out-of-line dispatch cost as much as the dot.
#[inline]
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
    dot_f32_scalar(a, b)
}

/// [`dot_f32`]'s scalar level: eight partial sums, as a vector unit would, so long rows lose
/// less to rounding.
fn dot_f32_scalar(a: &[f32], b: &[f32]) -> f32 {
    dot_scalar_of(a, b, |x| x)
}

/// [`dot_f32`]'s scalar level of `a` with `b`, each value of `b` read as f32 by `value` (the
/// identity, or an f16 cache row's widening).
pub(super) fn dot_scalar_of<T: Copy>(a: &[f32], b: &[T], value: impl Fn(T) -> f32) -> f32 {
    let mut s = [0f32; 8];
    let mut ca = a.chunks_exact(8);
    let mut cb = b.chunks_exact(8);
    for (pa, pb) in (&mut ca).zip(&mut cb) {
        for k in 0..8 {
            s[k] += pa[k] * value(pb[k]);
        }
    }
    let mut t: f32 = s.iter().sum();
    for (p, q) in ca.remainder().iter().zip(cb.remainder()) {
        t += p * value(*q);
    }
    t
}

/// Sums each block's integer products in 8 lanes of 4 consecutive values (lane `j` covers
/// values `4j..4j+4`, the layout of x86's `pmaddubsw` + `pmaddwd`), scales each lane by the
/// block's `d_w · d_x` with a fused multiply-add into 8 f32 accumulators, and adds the lanes in
/// a fixed tree at the end. The scalar path does exactly these operations, so both paths give
/// the same bits; min/offset terms go to a separate sequential scalar sum.
pub(crate) fn finish_lanes(acc: &[f32; 8], extra: f32) -> f32 {
    lane_tree(acc) + extra
}

/// The fixed tree that adds 8 lanes: `s_k = l_k + l_(k+4)`, then `(s_0 + s_2) + (s_1 + s_3)`.
#[inline(always)]
pub(crate) fn lane_tree(l: &[f32; 8]) -> f32 {
    let s: [f32; 4] = std::array::from_fn(|k| l[k] + l[k + 4]);
    (s[0] + s[2]) + (s[1] + s[3])
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

/// The 32 five-bit quants of a Q5_0/Q5_1 block's `qh` (4 bytes, bit `j` the fifth bit of
/// value `j`) and `qs` (16 bytes of nibbles, as Q4's) in value order, minus `off`.
#[inline(always)]
fn quants5(qh_qs: &[u8], off: i32) -> [i32; 32] {
    let qh = u32::from_le_bytes([qh_qs[0], qh_qs[1], qh_qs[2], qh_qs[3]]);
    let mut w = nibbles(&qh_qs[4..20], 0);
    for (j, v) in w.iter_mut().enumerate() {
        *v = (*v | (((qh >> j) & 1) as i32) << 4) - off;
    }
    w
}

/// Scalar Q8-mode dot of one weight row with quantised activations.
fn row_dot_q8_scalar(ty: QuantType, row: &[u8], xq: &[Q8Block]) -> f32 {
    let mut y = [0f32];
    row_tokens_q8_scalar(ty, row, &[xq], &mut y);
    y[0]
}

/// Most tokens one call of the batched Q8-mode row kernels takes.
pub(super) const BATCH_PASS_MAX: usize = 16;

/// One activation block's scale and quant sum for each token of a pass (token `t` in lane
/// `t`), laid out once per product so the SIMD row kernels take every token's `d · d_x` and
/// offset term with a few vector operations per weight block.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
pub(crate) struct TokenScales {
    /// Each token's [`Q8Block::d`].
    pub(crate) d: [f32; BATCH_PASS_MAX],
    /// Each token's [`Q8Block::sum`], as f32 (exact: at most 32 · 127).
    pub(crate) s: [f32; BATCH_PASS_MAX],
    /// Each token's [`half_sum`] (the first 16 quants), as f32, for Q2_K's mins.
    pub(crate) lo: [f32; BATCH_PASS_MAX],
}

/// The sum of the first 16 quants of `b` (the rest of [`Q8Block::sum`] is the last 16's).
#[inline]
pub(crate) fn half_sum(b: &Q8Block) -> i32 {
    b.qs[..16].iter().map(|&q| i32::from(q)).sum()
}

/// Scalar Q8-mode dots of one weight row with up to [`BATCH_PASS_MAX`] tokens' quantised
/// activations (`xs[t]`, into `out[t]`). Each block's quants and scales are decoded once,
/// then every token takes the single-token operations in their order: per block the 8 lane
/// sums of [`lanes`], `fma(d · d_x, lane, acc)` (`(d · sc) · d_x` for the K-quants), the
/// offset term apart, [`finish_lanes`] at the end.
fn row_tokens_q8_scalar<X: AsRef<[Q8Block]>>(ty: QuantType, row: &[u8], xs: &[X], out: &mut [f32]) {
    let n = xs.len();
    assert!(
        n <= BATCH_PASS_MAX && out.len() == n,
        "row_tokens_q8_scalar: tokens"
    );
    let bb = ty.block_bytes();
    let mut acc = [[0f32; 8]; BATCH_PASS_MAX];
    let mut extra = [0f32; BATCH_PASS_MAX];
    let (acc, extra) = (&mut acc[..n], &mut extra[..n]);
    // Q2_K's min terms, a lane a group (the SIMD kernels' vector of them), added by
    // `lane_tree` at the end
    let mut mins_acc = [[0f32; 8]; BATCH_PASS_MAX];
    let mins_acc = &mut mins_acc[..n];
    let fma_lanes = |dd: [f32; 8], l: [i32; 8], acc: &mut [f32; 8]| {
        for j in 0..8 {
            acc[j] = dd[j].mul_add(l[j] as f32, acc[j]);
        }
    };
    match ty {
        QuantType::Q4_0 | QuantType::Q4_1 | QuantType::Q5_0 | QuantType::Q5_1 | QuantType::Q8_0 => {
            for (i, blk) in row.chunks_exact(bb).enumerate() {
                let d = rd_f16(blk, 0);
                let w: [i32; 32] = match ty {
                    QuantType::Q4_0 => nibbles(&blk[2..18], 8),
                    QuantType::Q4_1 => nibbles(&blk[4..20], 0),
                    QuantType::Q5_0 => quants5(&blk[2..22], 16),
                    QuantType::Q5_1 => quants5(&blk[4..24], 0),
                    _ => std::array::from_fn(|i| i32::from(blk[2 + i] as i8)),
                };
                let m = matches!(ty, QuantType::Q4_1 | QuantType::Q5_1).then(|| rd_f16(blk, 2));
                for ((a, e), x) in acc.iter_mut().zip(extra.iter_mut()).zip(xs) {
                    let xb = &x.as_ref()[i];
                    fma_lanes([d * xb.d; 8], lanes(&w, &xb.qs), a);
                    if let Some(m) = m {
                        *e += (m * xb.d) * xb.sum as f32;
                    }
                }
            }
        }
        QuantType::Q4_K | QuantType::Q5_K => {
            for (i, blk) in row.chunks_exact(bb).enumerate() {
                let d = rd_f16(blk, 0);
                let dmin = rd_f16(blk, 2);
                let scales = &blk[4..16];
                for sb in 0..8 {
                    let (sc, m) = scale_min_k4(sb, scales);
                    let w = k_quants(ty, blk, sb);
                    // the first products of `d · sc · d_x` and `dmin · m · d_x`
                    let (ds, dm) = (d * sc as f32, dmin * m as f32);
                    for ((a, e), x) in acc.iter_mut().zip(extra.iter_mut()).zip(xs) {
                        let xb = &x.as_ref()[8 * i + sb];
                        fma_lanes([ds * xb.d; 8], lanes(&w, &xb.qs), a);
                        *e -= (dm * xb.d) * xb.sum as f32;
                    }
                }
            }
        }
        QuantType::Q2_K | QuantType::Q3_K | QuantType::Q6_K => {
            let mut q = [0i8; 256];
            for (i, blk) in row.chunks_exact(bb).enumerate() {
                let (d, sc) = k16_scales(ty, blk);
                k16_quants(ty, blk, &mut q);
                // Q2_K: `dmin` and the 16 mins (0 for the others, which have none)
                let (dmin, m) = q2k_mins(ty, blk);
                for g in 0..8 {
                    let w: [i32; 32] = std::array::from_fn(|l| i32::from(q[32 * g + l]));
                    // the first products of `d · sc · d_x`, one per 16 values
                    let s0 = d * f32::from(sc[2 * g]);
                    let s1 = d * f32::from(sc[2 * g + 1]);
                    let (m0, m1) = (i32::from(m[2 * g]), i32::from(m[2 * g + 1]));
                    for ((a, e), x) in acc.iter_mut().zip(mins_acc.iter_mut()).zip(xs) {
                        let xb = &x.as_ref()[8 * i + g];
                        let (s0, s1) = (s0 * xb.d, s1 * xb.d);
                        fma_lanes([s0, s0, s0, s0, s1, s1, s1, s1], lanes(&w, &xb.qs), a);
                        if ty == QuantType::Q2_K {
                            // `e − (dmin · d_x) · mins` in one rounding (the integer is exact
                            // in f32: at most 2 · 15 · 16 · 127)
                            let lo = half_sum(xb);
                            let mins = m0 * lo + m1 * (xb.sum - lo);
                            e[g] = (-(dmin * xb.d)).mul_add(mins as f32, e[g]);
                        }
                    }
                }
            }
        }
        _ => {}
    }
    if ty == QuantType::Q2_K {
        for (e, m) in extra.iter_mut().zip(mins_acc.iter()) {
            *e = lane_tree(m);
        }
    }
    for ((o, a), e) in out.iter_mut().zip(acc.iter()).zip(extra.iter()) {
        *o = finish_lanes(a, *e);
    }
}

/// Q8-mode dots of `R` weight rows with quantised activations (see [`finish_lanes`]); `bias`
/// holds the lane offsets for [`matvec_offset`]`(vnni, ty)`. Every `R` gives each row the bits
/// of the scalar path.
fn rows_dot_q8<const R: usize>(
    isa: Isa,
    vnni: Option<Vnni>,
    ty: QuantType,
    rows: [&[u8]; R],
    a: &Q8Activations,
) -> [f32; R] {
    let (xq, bias) = (&a.q[..], &a.bias[..]);
    #[cfg(target_arch = "x86_64")]
    {
        use super::x86_matvec as k;
        match vnni {
            // SAFETY (all three): Isa::vnni detected AVX2, FMA, F16C and the VNNI extension
            // (with AVX-512F/BW/VL for the EVEX forms, which it returns only at Isa::Avx512) at
            // run time; each row holds whole blocks matched by xq, and bias matches xq where the
            // type uses it.
            Some(Vnni::Avx512Vnni)
                if R.is_multiple_of(2) && super::x86_matvec512::matvec_takes(ty) =>
            {
                return unsafe { super::x86_matvec512::rows_dot_q8_512::<R>(ty, rows, xq, bias) };
            }
            // Q2_K's, Q4_K's and Q5_K's 256-bit forms: their quants are unsigned already, so
            // VNNI saves one instruction in ten there, and measured slower than the AVX2 form
            // (Q4_K)
            _ if matches!(ty, QuantType::Q2_K | QuantType::Q4_K | QuantType::Q5_K) => {}
            Some(Vnni::AvxVnni) => {
                return unsafe { k::rows_dot_q8_avxvnni::<R>(ty, rows, xq, bias) };
            }
            Some(Vnni::Avx512Vnni) => {
                return unsafe { k::rows_dot_q8_avx512vnni::<R>(ty, rows, xq, bias) };
            }
            None => {}
        }
        if isa.has_avx2() {
            // SAFETY: AVX2, FMA and F16C detected at run time; the rows hold whole blocks
            // matched by xq, bias matches xq for Q3_K and Q6_K (matvec_offset), and so do the
            // half sums (Q8Activations::fill).
            return unsafe { k::rows_dot_q8_avx2::<R>(ty, rows, xq, bias, [&a.lo, &a.hi]) };
        }
    }
    let _ = (isa, vnni, bias);
    rows.map(|row| row_dot_q8_scalar(ty, row, xq))
}

/// Q8-mode dots of one weight row with the tokens of `pass` into `out`, each token's with the
/// bits [`rows_dot_q8`] gives it alone.
fn row_tokens_q8(
    isa: Isa,
    vnni: Option<Vnni>,
    ty: QuantType,
    row: &[u8],
    pass: &super::token_pass::TokenPass,
    out: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    if isa.has_avx2() {
        use super::x86_matvec_batch as k;
        let (qs, bias, scales) = (&pass.qs[..], &pass.bias[..], &pass.scales[..]);
        macro_rules! by_tokens {
            ($f:ident, $($t:literal)*) => {
                match out.len() {
                    $($t => {
                        // SAFETY: the caller's Isa and Vnni were detected at run time (Vnni
                        // names the extension, with AVX-512F/BW/VL for the EVEX form, which
                        // Isa::vnni returns only at Isa::Avx512); the row holds whole blocks for
                        // the pass's tokens, laid out by token_passes, with the lane offsets
                        // of vnni_offset(vnni, ty).
                        out.copy_from_slice(&unsafe { k::$f::<$t>(ty, row, qs, bias, scales) });
                    })*
                    _ => unreachable!("row_tokens_q8: at most {BATCH_PASS_MAX} tokens"),
                }
            };
        }
        match vnni {
            Some(Vnni::Avx512Vnni) => {
                by_tokens!(row_tokens_q8_avx512vnni, 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16)
            }
            Some(Vnni::AvxVnni) => by_tokens!(row_tokens_q8_avxvnni, 1 2 3 4 5 6 7 8),
            None => by_tokens!(row_tokens_q8_avx2, 1 2 3 4 5 6 7 8),
        }
        return;
    }
    let _ = (isa, vnni);
    row_tokens_q8_scalar(ty, row, &pass.xs, out);
}

/// Whether [`q8_matmul_batch`] takes the rows of `ty` in pairs ([`row_pair_tokens_q8`]): the
/// 32-value types under AVX512-VNNI, one row in each half of a 512-bit vector.
fn takes_row_pairs(vnni: Option<Vnni>, ty: QuantType) -> bool {
    #[cfg(target_arch = "x86_64")]
    if vnni == Some(Vnni::Avx512Vnni) {
        return super::x86_matvec512::takes(ty);
    }
    let _ = (vnni, ty);
    false
}

/// [`row_tokens_q8`] of two rows at once, where [`takes_row_pairs`] says so: each token's
/// results have the same bits. They go into `tile`, token-major with `stride` values a token:
/// the pass's token `t` (token `t0 + t` of the product) at `(t0 + t) · stride + slot` for the
/// first row and `+ 1` for the second.
fn row_pair_tokens_q8(
    ty: QuantType,
    rows: [&[u8]; 2],
    pass: &super::token_pass::TokenPass,
    tile: &mut [f32],
    (stride, t0, slot): (usize, usize, usize),
) {
    #[cfg(target_arch = "x86_64")]
    {
        use super::x86_matvec512::row_pair_tokens_q8_512 as k;
        let scales = &pass.scales[..];
        let x = pass
            .pairs
            .as_ref()
            .expect("row_pair_tokens_q8: a pass laid out for row pairs");
        macro_rules! by_tokens {
            ($($t:literal)*) => {
                match pass.tokens {
                    $($t => {
                        // SAFETY: takes_row_pairs saw AVX512-VNNI detected at run time (with
                        // AVX-512F/BW/VL: Isa::vnni returns it only at Isa::Avx512) and a type
                        // the kernel takes; both rows hold whole blocks for the pass's tokens,
                        // laid out for ty by token_passes; the kernel
                        // checks that the tile holds every token's pair.
                        unsafe { k::<$t>(ty, rows, x, scales, tile, (stride, t0, slot)) };
                    })*
                    _ => unreachable!("row_pair_tokens_q8: at most {BATCH_PASS_MAX} tokens"),
                }
            };
        }
        by_tokens!(1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (rows, pass, tile, stride, t0, slot);
        unreachable!("row_pair_tokens_q8 {ty}: only x86-64 takes rows in pairs");
    }
}

/// Tokens per pass of the batched row kernels at this level: their accumulators stay in
/// registers (16 vector registers without AVX-512, 32 with it).
fn batch_pass(isa: Isa, vnni: Option<Vnni>) -> usize {
    if vnni == Some(Vnni::Avx512Vnni) || !isa.has_avx2() {
        BATCH_PASS_MAX
    } else {
        8
    }
}

/// The fewest tokens from which [`q8_matmul_batch`] runs the batched row kernels for `ty`
/// rather than one matvec a token. Both give each token the same bits, so this is speed only.
/// The 256-bit batched kernels without VNNI carry work a block for their token layout (each
/// token's scales read, the block's scale products formed for every token) that the matvec's
/// kernel, four rows against one token, does not; for the K-quants, at two tokens (to four
/// for Q2_K) it outweighs the weight decoding the batch shares. Measured on 2 cores of an
/// AMD EPYC with AVX2 (`decode_q*_k_2048x2048_x{n}` against `..._matvec_x{n}`, 1 and 2
/// threads), the batched form's time over the matvecs': at 2 tokens 1.3-1.8x (Q2_K),
/// 1.0-1.6x (Q3_K) and 1.3-1.8x (Q4_K); for Q2_K 1.3-1.5x at 3 and 1.0-1.2x at 4; below 1x
/// from there; Q5_K and Q6_K even at 2 tokens.
fn batch_min_tokens(isa: Isa, vnni: Option<Vnni>, ty: QuantType) -> usize {
    if vnni.is_some() || !isa.has_avx2() {
        return 2;
    }
    match ty {
        QuantType::Q2_K => 5,
        QuantType::Q3_K | QuantType::Q4_K => 3,
        _ => 2,
    }
}

/// The Q8-mode matmul of a few tokens ([`Q8_BATCH_MAX_TOKENS`] at most): the tokens are
/// quantised once, each weight row is decoded once per pass of up to [`batch_pass`] tokens
/// and met with every token of the pass in registers ([`row_tokens_q8`]), so each token's
/// result has the bits of [`matvec`] of that token alone (below [`batch_min_tokens`], one
/// matvec a token). Every matrix of `parts` (all of `ty`, `cols` columns) multiplies the same
/// tokens, their row tasks in one parallel loop.
fn q8_matmul_batch(
    (isa, vnni, ty): (Isa, Option<Vnni>, QuantType),
    parts: &mut [SharedInput<'_>],
    cols: usize,
    x: &[f32],
    n_tok: usize,
) {
    if n_tok < batch_min_tokens(isa, vnni, ty) {
        q8_matvecs_by_token((isa, vnni, ty), parts, cols, x);
        return;
    }
    let per_tok = cols / 32;
    // balanced passes: 12 tokens at 8 per pass go as 6 + 6
    let n_passes = n_tok.div_ceil(batch_pass(isa, vnni));
    let pass = n_tok.div_ceil(n_passes);
    let paired = takes_row_pairs(vnni, ty);
    let key = super::token_pass::PassKey {
        isa,
        ty,
        paired,
        pass,
        per_tok,
        offset: vnni_offset(vnni, ty),
    };
    // each matrix's rows, bytes a row and output; its first task in the loop over all
    let mut first_task = Vec::with_capacity(parts.len() + 1);
    let mut tasks = 0;
    let outs: Vec<(&[u8], usize, usize, super::SharedOut<'_>)> = parts
        .iter_mut()
        .map(|p| {
            first_task.push(tasks);
            tasks += p.rows.div_ceil(ROWS_PER_TASK);
            (p.w, p.rows, p.w.len() / p.rows, super::SharedOut::new(p.y))
        })
        .collect();
    first_task.push(tasks);
    let passes = super::token_pass::token_passes(key, x);
    // Each task's rows go into its matrix's y token by token from a buffer of its own (y
    // is token-major, so a task's rows are a run of every token's row, and no transpose
    // of the whole output is needed afterwards).
    (0..tasks).into_par_iter().for_each(|g| {
        let m = first_task.partition_point(|&f| f <= g) - 1;
        let (w, rows, row_bytes, out) = &outs[m];
        let (rows, row_bytes) = (*rows, *row_bytes);
        let row = |r: usize| &w[r * row_bytes..(r + 1) * row_bytes];
        let i = g - first_task[m];
        let (first, n) = (
            i * ROWS_PER_TASK,
            ROWS_PER_TASK.min(rows - i * ROWS_PER_TASK),
        );
        // the task's results token-major, ROWS_PER_TASK values a token
        let mut by_token = [0f32; ROWS_PER_TASK * Q8_BATCH_MAX_TOKENS];
        let mut k = 0;
        while k < n {
            let r = first + k;
            if paired && k + 1 < n {
                for (j, p) in passes.iter().enumerate() {
                    let at = (ROWS_PER_TASK, j * pass, k);
                    row_pair_tokens_q8(ty, [row(r), row(r + 1)], p, &mut by_token, at);
                }
                k += 2;
            } else {
                let mut one = [0f32; Q8_BATCH_MAX_TOKENS];
                for (o, p) in one[..n_tok].chunks_mut(pass).zip(&passes) {
                    row_tokens_q8(isa, vnni, ty, row(r), p, o);
                }
                for (t, v) in one[..n_tok].iter().enumerate() {
                    by_token[t * ROWS_PER_TASK + k] = *v;
                }
                k += 1;
            }
        }
        for (t, run) in by_token.chunks_exact(ROWS_PER_TASK).take(n_tok).enumerate() {
            // SAFETY: this task alone writes rows first..first + n of every token.
            unsafe { out.write(t * rows + first, &run[..n]) };
        }
    });
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

/// The 256 signed 3-bit quants (in -4..=3) of a Q3_K block, in element order: value
/// `e = 128h + 32s + l` takes bits `2s, 2s + 1` of `qs[32h + l]` (bytes 32..96) as its low
/// bits, and bit `4h + s` of `hmask[l]` (bytes 0..32) set means 4 is not subtracted.
pub(crate) fn q3k_quants(blk: &[u8], q: &mut [i8; 256]) {
    for (e, qe) in q.iter_mut().enumerate() {
        let (h, s, l) = (e / 128, e % 128 / 32, e % 32);
        let lo = (blk[32 + 32 * h + l] >> (2 * s)) & 3;
        let hi = (blk[l] >> (4 * h + s)) & 1;
        *qe = (lo | (hi << 2)) as i8 - 4;
    }
}

/// The 256 unsigned 2-bit quants (in 0..=3) of a Q2_K block, in element order: value
/// `e = 128h + 32s + l` is bits `2s, 2s + 1` of `qs[32h + l]` (bytes 16..80).
pub(crate) fn q2k_quants(blk: &[u8], q: &mut [i8; 256]) {
    for (e, qe) in q.iter_mut().enumerate() {
        let (h, s, l) = (e / 128, e % 128 / 32, e % 32);
        *qe = ((blk[16 + 32 * h + l] >> (2 * s)) & 3) as i8;
    }
}

/// The quants of a block whose scales are per 16 values (Q2_K, Q3_K or Q6_K), in element
/// order: signed for Q3_K and Q6_K, Q2_K's unsigned.
pub(crate) fn k16_quants(ty: QuantType, blk: &[u8], q: &mut [i8; 256]) {
    match ty {
        QuantType::Q2_K => q2k_quants(blk, q),
        QuantType::Q3_K => q3k_quants(blk, q),
        _ => q6k_quants(blk, q),
    }
}

/// The super-block scale `d` and the 16 scales (one per 16 values) of a Q2_K, Q3_K or Q6_K
/// block: a value is `d · sc · q` (less Q2_K's min, [`q2k_mins`]).
#[inline]
pub(crate) fn k16_scales(ty: QuantType, blk: &[u8]) -> (f32, [i8; 16]) {
    (rd_f16(blk, k16_d_at(ty)), k16_scale_bytes(ty, blk))
}

/// Where a Q2_K, Q3_K or Q6_K block keeps its f16 `d` (the SIMD kernels read it with F16C);
/// Q2_K's `dmin` follows it.
#[inline(always)]
pub(crate) fn k16_d_at(ty: QuantType) -> usize {
    match ty {
        QuantType::Q2_K => 80,
        QuantType::Q3_K => 108,
        _ => 208,
    }
}

/// The 16 scales of a Q2_K block (the low nibbles of its first 16 bytes), a Q3_K block
/// (signed, unpacked from its 12 bytes at 96) or a Q6_K block (signed, its 16 bytes at 192).
#[inline(always)]
pub(crate) fn k16_scale_bytes(ty: QuantType, blk: &[u8]) -> [i8; 16] {
    match ty {
        QuantType::Q2_K => std::array::from_fn(|j| (blk[j] & 0x0f) as i8),
        QuantType::Q3_K => q3k_scales(&blk[96..108]),
        _ => {
            let b: [u8; 16] = blk[192..208].try_into().expect("a Q6_K block's scales");
            b.map(|v| v as i8)
        }
    }
}

/// A Q2_K block's `dmin` and its 16 mins (the high nibbles of its first 16 bytes): value `e`
/// is `d · sc · q − dmin · m`, scale and min `e / 16`. `(0, 0s)` for the other types.
#[inline(always)]
pub(crate) fn q2k_mins(ty: QuantType, blk: &[u8]) -> (f32, [u8; 16]) {
    if ty == QuantType::Q2_K {
        (rd_f16(blk, 82), std::array::from_fn(|j| blk[j] >> 4))
    } else {
        (0.0, [0; 16])
    }
}

/// From 2 up to this many tokens take [`q8_matmul_batch`] in [`MatvecMode::Q8`] (one token
/// takes [`matvec`]), more the integer tiles of `x86_gemm`. The batch decodes the weights
/// once per 16 tokens and gives each token its matvec bits; the tiles decode them into panels
/// first (a fixed cost of about one matvec) and round differently. Measured (1 thread,
/// process CPU time, medians, an AMD EPYC with AVX512-VNNI, SmolLM2-135M's 210 Q4_1 layer matrices;
/// 2 to 4 tokens against a matvec per token, 8 to 16 against the tiles): one token 10.4 ms;
/// 2 tokens 19.4 → 13.2 ms, 4: 36.2 → 15.9, 8: 34.5 → 23.1, 12: 38.9 → 30.3, 16: 44.9 →
/// 39.5. Its Q8_0 head (49152 × 576): 2 tokens 8.5 → 3.8 ms, 8: 17.3 → 6.7, 16: 17.3 → 13.9.
/// Q4_K and Q6_K (2048 × 2048) at 16 tokens are about even with the tiles (12.6 → 12.9 and
/// 16.4 → 13.8 ms), and faster below.
pub const Q8_BATCH_MAX_TOKENS: usize = 16;

/// Values dequantised per matmul task (256 KiB of f32: stays in L2 while every token uses it).
const DQ_TILE: usize = 64 * 1024;

/// Rows per parallel task.
const ROWS_PER_TASK: usize = 16;

/// Tasks of [`ROWS_PER_TASK`] rows that rayon keeps together in one job (a decode step's small
/// matrices would otherwise be split into more jobs than threads).
const TASKS_PER_JOB: usize = 4;

/// Rows the Q8-mode matvec kernels take at once (their multiply-add chains run side by side).
const ROWS_PER_DOT: usize = 4;

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
    matvec_with_vnni(isa, true, mode, ty, w, rows, cols, x, y)
}

/// [`matvec_with`], with the VNNI form of the Q8 mode ([`Isa::vnni`]) allowed or not (so
/// tests and benchmarks can run both; the results have the same bits).
#[allow(clippy::too_many_arguments)]
pub fn matvec_with_vnni(
    isa: Isa,
    vnni: bool,
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
            let vnni = isa.vnni().filter(|_| vnni);
            let row = |r: usize| &w[r * row_bytes..(r + 1) * row_bytes];
            with_q8_activations(isa, x, matvec_offset(vnni, ty), |act| {
                y.par_chunks_mut(ROWS_PER_TASK)
                    .with_min_len(TASKS_PER_JOB)
                    .enumerate()
                    .for_each(|(i, ys)| {
                        q8_matvec_task((isa, vnni, ty), row, act, i * ROWS_PER_TASK, ys);
                    });
            });
        }
    }
    Ok(())
}

/// One task of the Q8-mode matvec: rows `r0..r0 + ys.len()` (`row(r)` their bytes) into `ys`,
/// [`ROWS_PER_DOT`] rows at a time.
fn q8_matvec_task<'w>(
    (isa, vnni, ty): (Isa, Option<Vnni>, QuantType),
    row: impl Fn(usize) -> &'w [u8],
    act: &Q8Activations,
    r0: usize,
    ys: &mut [f32],
) {
    let whole = ys.len() / ROWS_PER_DOT * ROWS_PER_DOT;
    let (quads, rest) = ys.split_at_mut(whole);
    for (k, yq) in quads.chunks_exact_mut(ROWS_PER_DOT).enumerate() {
        let rows: [&[u8]; ROWS_PER_DOT] = std::array::from_fn(|j| row(r0 + ROWS_PER_DOT * k + j));
        yq.copy_from_slice(&rows_dot_q8(isa, vnni, ty, rows, act));
    }
    for (k, yv) in rest.iter_mut().enumerate() {
        *yv = rows_dot_q8(isa, vnni, ty, [row(r0 + whole + k)], act)[0];
    }
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
/// least one row), one tile per parallel task; peak scratch is one tile per worker thread.
/// With AVX2/AVX-512 each tile meets the tokens in register tiles of up to 8 rows × 32
/// tokens over the transposed activations, k in chunks of 128, so each dequantised weight is
/// loaded once per 32 tokens; each output sums its products in f32, in order within a chunk.
///
/// In [`MatvecMode::Q8`] one token takes [`matvec`]; 2 to 16 tokens decode each weight row
/// once per pass of up to 16 tokens and give each token the bits of its own [`matvec`] (a
/// K-quant's fewest tokens on AVX2 without VNNI take one matvec a token: see
/// `batch_min_tokens`); from
/// 17 tokens the tokens are quantised and laid out once, each task decodes 16 weight rows once
/// into a panel of unsigned 8-bit quants and per-row scales, and meets it with up to 12 tokens
/// at a time in integer registers (see the module documentation).
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

/// One matrix of [`matmul_shared`]: `rows` rows of weights and its output (`n_tok × rows`,
/// token-major).
pub struct SharedInput<'a> {
    pub w: &'a [u8],
    pub rows: usize,
    pub y: &'a mut [f32],
}

/// [`matmul`] of several matrices of one type that multiply the same `n_tok` tokens `x` (a
/// layer's query, key and value; its gate and up), each result with the bits [`matmul`] gives
/// it. A fast-mode product of 1 to [`Q8_BATCH_MAX_TOKENS`] tokens quantises the tokens once
/// and runs all the matrices' row tasks in one parallel loop (the matvec's tasks for one token,
/// the batched product's for more): a decode step's key and value products are a few
/// microseconds of work each, and on their own each pays a fork and a join across the threads.
pub fn matmul_shared(
    mode: MatvecMode,
    ty: QuantType,
    parts: &mut [SharedInput<'_>],
    cols: usize,
    x: &[f32],
    n_tok: usize,
    max_dq_size: usize,
) -> Result<()> {
    matmul_shared_with_vnni(
        Isa::detect(),
        true,
        mode,
        ty,
        parts,
        cols,
        x,
        n_tok,
        max_dq_size,
    )
}

/// [`matmul_shared`] with a forced instruction set, the VNNI forms allowed or not.
#[allow(clippy::too_many_arguments)]
pub fn matmul_shared_with_vnni(
    isa: Isa,
    vnni: bool,
    mode: MatvecMode,
    ty: QuantType,
    parts: &mut [SharedInput<'_>],
    cols: usize,
    x: &[f32],
    n_tok: usize,
    max_dq_size: usize,
) -> Result<()> {
    for p in parts.iter() {
        check_shapes(ty, p.w, p.rows, cols, x.len(), n_tok, p.y.len())?;
    }
    let together = mode == MatvecMode::Q8
        && (1..=Q8_BATCH_MAX_TOKENS).contains(&n_tok)
        && cols > 0
        && parts.iter().all(|p| p.rows > 0);
    if !together {
        for p in parts {
            let (w, rows) = (p.w, p.rows);
            matmul_with_vnni(
                isa,
                vnni,
                mode,
                ty,
                w,
                rows,
                cols,
                x,
                n_tok,
                p.y,
                max_dq_size,
            )?;
        }
        return Ok(());
    }
    check_q8_type(ty)?;
    let vnni = isa.vnni().filter(|_| vnni);
    if n_tok > 1 {
        q8_matmul_batch((isa, vnni, ty), parts, cols, x, n_tok);
        return Ok(());
    }
    // one token: the matvec's tasks of every matrix in one loop
    with_q8_activations(isa, x, matvec_offset(vnni, ty), |act| {
        let mats = parts.iter_mut().map(|p| (p.w, p.rows, &mut *p.y, act));
        q8_matvecs_together((isa, vnni, ty), mats);
    });
    Ok(())
}

/// The one-token Q8-mode products of several matrices (each its weights, rows, output and
/// quantised token), their row tasks in one parallel loop.
fn q8_matvecs_together<'a>(
    cfg: (Isa, Option<Vnni>, QuantType),
    mats: impl Iterator<Item = (&'a [u8], usize, &'a mut [f32], &'a Q8Activations)>,
) {
    let tasks: Vec<MatvecTask<'a>> = mats
        .flat_map(|(w, rows, y, act)| {
            let row_bytes = w.len() / rows;
            y.chunks_mut(ROWS_PER_TASK)
                .enumerate()
                .map(move |(i, ys)| (w, row_bytes, i * ROWS_PER_TASK, ys, act))
        })
        .collect();
    tasks
        .into_par_iter()
        .with_min_len(TASKS_PER_JOB)
        .for_each(|(w, row_bytes, r0, ys, act)| {
            let row = |r: usize| &w[r * row_bytes..(r + 1) * row_bytes];
            q8_matvec_task(cfg, row, act, r0, ys);
        });
}

/// [`q8_matmul_batch`]'s tokens as one matvec a token: each token quantised once, the
/// matvec's row tasks of every matrix and token in one parallel loop.
fn q8_matvecs_by_token(
    cfg: (Isa, Option<Vnni>, QuantType),
    parts: &mut [SharedInput<'_>],
    cols: usize,
    x: &[f32],
) {
    let acts = &q8_activations(cfg, x.chunks_exact(cols));
    let mats = parts.iter_mut().flat_map(|p| {
        let (w, rows) = (p.w, p.rows);
        // y is token-major: token t's rows at t · rows
        p.y.chunks_exact_mut(rows)
            .zip(acts)
            .map(move |(y, act)| (w, rows, y, act))
    });
    q8_matvecs_together(cfg, mats);
}

/// Each token of `xs` quantised for the matvec's kernels ([`Q8Activations::fill`]), in
/// buffers of its own (they are held together, where [`with_q8_activations`] holds one).
fn q8_activations<'x>(
    (isa, vnni, ty): (Isa, Option<Vnni>, QuantType),
    xs: impl Iterator<Item = &'x [f32]>,
) -> Vec<Q8Activations> {
    xs.map(|x| {
        let mut act = Q8Activations::default();
        act.fill(isa, x, matvec_offset(vnni, ty));
        act
    })
    .collect()
}

/// A task of [`q8_matvecs_together`]: weights, row bytes, first row, outputs, the quantised
/// token.
type MatvecTask<'a> = (&'a [u8], usize, usize, &'a mut [f32], &'a Q8Activations);

/// One matrix of [`matmul_grouped`]: `rows` rows of weights, its own tokens (`n_tok × cols`)
/// and its output (`n_tok × rows`, token-major).
pub struct GroupedInput<'a> {
    pub w: &'a [u8],
    pub rows: usize,
    pub x: &'a [f32],
    pub y: &'a mut [f32],
}

/// [`matmul`] of several matrices of one type, each on tokens of its own: the down products
/// of the experts a token was routed to, each on its own gated rows. A fast-mode product of
/// one token each quantises each matrix's token and runs every matrix's row tasks in one
/// parallel loop (a decode step's experts are a few microseconds of work each, and on their
/// own each pays a fork and a join across the threads); other products run one after the
/// other. Each result has the bits [`matmul`] gives it.
pub fn matmul_grouped(
    mode: MatvecMode,
    ty: QuantType,
    parts: &mut [GroupedInput<'_>],
    cols: usize,
    n_tok: usize,
    max_dq_size: usize,
) -> Result<()> {
    matmul_grouped_with(Isa::detect(), mode, ty, parts, cols, n_tok, max_dq_size)
}

/// [`matmul_grouped`] with a forced instruction set.
#[allow(clippy::too_many_arguments)]
pub fn matmul_grouped_with(
    isa: Isa,
    mode: MatvecMode,
    ty: QuantType,
    parts: &mut [GroupedInput<'_>],
    cols: usize,
    n_tok: usize,
    max_dq_size: usize,
) -> Result<()> {
    for p in parts.iter() {
        check_shapes(ty, p.w, p.rows, cols, p.x.len(), n_tok, p.y.len())?;
    }
    let together =
        mode == MatvecMode::Q8 && n_tok == 1 && cols > 0 && parts.iter().all(|p| p.rows > 0);
    if !together {
        for p in parts {
            matmul_with(
                isa,
                mode,
                ty,
                p.w,
                p.rows,
                cols,
                p.x,
                n_tok,
                p.y,
                max_dq_size,
            )?;
        }
        return Ok(());
    }
    check_q8_type(ty)?;
    let vnni = isa.vnni();
    let acts = q8_activations((isa, vnni, ty), parts.iter().map(|p| p.x));
    let mats = parts
        .iter_mut()
        .zip(&acts)
        .map(|(p, act)| (p.w, p.rows, &mut *p.y, act));
    q8_matvecs_together((isa, vnni, ty), mats);
    Ok(())
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
    matmul_with_vnni(isa, true, mode, ty, w, rows, cols, x, n_tok, y, max_dq_size)
}

/// [`matmul_with`], with the VNNI form of the Q8-mode kernels ([`Isa::vnni`]) allowed or not
/// (so tests and benchmarks can run both; the results have the same bits).
#[allow(clippy::too_many_arguments)]
pub fn matmul_with_vnni(
    isa: Isa,
    vnni: bool,
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
    if mode == MatvecMode::Q8 {
        check_q8_type(ty)?;
        if n_tok == 1 {
            return matvec_with_vnni(isa, vnni, mode, ty, w, rows, cols, x, y);
        }
        if n_tok <= Q8_BATCH_MAX_TOKENS {
            let vnni = isa.vnni().filter(|_| vnni);
            q8_matmul_batch(
                (isa, vnni, ty),
                &mut [SharedInput { w, rows, y }],
                cols,
                x,
                n_tok,
            );
            return Ok(());
        }
        #[cfg(target_arch = "x86_64")]
        if isa.has_avx2() {
            let vnni = isa.vnni().filter(|_| vnni);
            // SAFETY: AVX2, FMA and F16C detected (has_avx2), AVX-512F/BW with has_avx512, and
            // the extension Isa::vnni names; check_shapes checked the shapes.
            unsafe { super::x86_gemm::q8_matmul(isa, vnni, ty, w, rows, cols, x, n_tok, y) };
            return Ok(());
        }
        let _ = vnni;
        q8_matmul_scalar(ty, w, rows, cols, x, n_tok, y);
        return Ok(());
    }
    let row_bytes = w.len() / rows;
    // results gathered row-major by weight row, transposed into y at the end
    let mut yt = vec![0f32; rows * n_tok];
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
    // the activations transposed (token fastest) for the outer-product tiles
    let vw = outer_width(isa);
    let xt: Vec<f32> = if vw > 0 && n_tok >= vw {
        let mut xt = vec![0f32; cols * n_tok];
        for (t, xr) in x.chunks_exact(cols).enumerate() {
            for (k, v) in xr.iter().enumerate() {
                xt[k * n_tok + t] = *v;
            }
        }
        xt
    } else {
        Vec::new()
    };
    // the scratch tile is reused by every tile a worker takes (no zero-fill per tile)
    yt.par_chunks_mut(tile_rows * n_tok)
        .enumerate()
        .for_each_init(Vec::new, |wd: &mut Vec<f32>, (ti, yc)| {
            let r0 = ti * tile_rows;
            let nr = yc.len() / n_tok;
            if wd.len() < nr * cols {
                wd.resize(nr * cols, 0.0);
            }
            let wd = &mut wd[..nr * cols];
            dq_seq(&w[r0 * row_bytes..(r0 + nr) * row_bytes], wd);
            tile_products(isa, wd, x, &xt, cols, nr, n_tok, yc);
        });
    transpose_into(&yt, rows, n_tok, y);
    Ok(())
}

/// The 32 unsigned quants of sub-block `sb` of a Q4_K block (its nibbles at 16) or a Q5_K
/// block (its nibbles at 48, with bit `sb` of each `qh` byte at 16 as the fifth bit).
fn k_quants(ty: QuantType, blk: &[u8], sb: usize) -> [i32; 32] {
    let (c, shift) = (sb / 2, 4 * (sb % 2));
    if ty == QuantType::Q5_K {
        std::array::from_fn(|l| {
            let lo = (blk[48 + 32 * c + l] >> shift) & 0x0f;
            i32::from(lo | (((blk[16 + l] >> sb) & 1) << 4))
        })
    } else {
        std::array::from_fn(|l| i32::from((blk[16 + 32 * c + l] >> shift) & 0x0f))
    }
}

/// One 32-value weight group decoded for the scalar Q8-mode matmul: the signed quants, the
/// scale of values 0–15 and 16–31 (they differ only for Q2_K, Q3_K and Q6_K) and the
/// coefficients of the token's quant sums (Q4_1's and Q5_1's `m`, Q4_K's `−dmin·m`, of the
/// group's sum, in `coef[0]`; Q2_K's `−dmin·m` of each 16 values' sum; else 0).
#[derive(Clone, Copy)]
struct ScalarGroup {
    w: [i32; 32],
    s_lo: f32,
    s_hi: f32,
    coef: [f32; 2],
}

/// Decodes a Q8-mode weight row into `out`, one entry per 32 values, with the float
/// operations of [`row_dot_q8_scalar`] and the SIMD tiles (`d · sc` rounded once).
fn decode_row_scalar(ty: QuantType, row: &[u8], out: &mut Vec<ScalarGroup>) {
    out.clear();
    let bb = ty.block_bytes();
    let one = |w: [i32; 32], s: f32, coef: f32| ScalarGroup {
        w,
        s_lo: s,
        s_hi: s,
        coef: [coef, 0.0],
    };
    for blk in row.chunks_exact(bb) {
        match ty {
            QuantType::Q4_0 => out.push(one(nibbles(&blk[2..18], 8), rd_f16(blk, 0), 0.0)),
            QuantType::Q4_1 => {
                out.push(one(nibbles(&blk[4..20], 0), rd_f16(blk, 0), rd_f16(blk, 2)))
            }
            QuantType::Q5_0 => out.push(one(quants5(&blk[2..22], 16), rd_f16(blk, 0), 0.0)),
            QuantType::Q5_1 => {
                out.push(one(quants5(&blk[4..24], 0), rd_f16(blk, 0), rd_f16(blk, 2)))
            }
            QuantType::Q8_0 => out.push(one(
                std::array::from_fn(|i| i32::from(blk[2 + i] as i8)),
                rd_f16(blk, 0),
                0.0,
            )),
            QuantType::Q4_K | QuantType::Q5_K => {
                let (d, dmin) = (rd_f16(blk, 0), rd_f16(blk, 2));
                for sb in 0..8 {
                    let (sc, m) = scale_min_k4(sb, &blk[4..16]);
                    out.push(one(
                        k_quants(ty, blk, sb),
                        d * sc as f32,
                        -(dmin * m as f32),
                    ));
                }
            }
            QuantType::Q2_K | QuantType::Q3_K | QuantType::Q6_K => {
                let (d, sc) = k16_scales(ty, blk);
                let (dmin, m) = q2k_mins(ty, blk);
                let mut q = [0i8; 256];
                k16_quants(ty, blk, &mut q);
                for g in 0..8 {
                    out.push(ScalarGroup {
                        w: std::array::from_fn(|l| i32::from(q[32 * g + l])),
                        s_lo: d * f32::from(sc[2 * g]),
                        s_hi: d * f32::from(sc[2 * g + 1]),
                        coef: [
                            -(dmin * f32::from(m[2 * g])),
                            -(dmin * f32::from(m[2 * g + 1])),
                        ],
                    });
                }
            }
            _ => {}
        }
    }
}

/// The scalar Q8-mode matmul. Each token's result takes the float operations of the SIMD
/// tiles (`x86_gemm`), in their order, so every instruction set gives the same bits: per
/// 32-value group (16 values for Q2_K, Q3_K and Q6_K, with their two scales) the exact integer
/// dot `i`, then `acc = fma(i, s · d_x, acc)`; for the types with an offset,
/// `ext += (coef · d_x) · Σq_x` apart (per 16 values for Q2_K, first half first), and
/// `acc + ext` at the end.
fn q8_matmul_scalar(
    ty: QuantType,
    w: &[u8],
    rows: usize,
    cols: usize,
    x: &[f32],
    n_tok: usize,
    y: &mut [f32],
) {
    let xq = quantize_q8_blocks(x);
    let per_tok = cols / 32;
    let row_bytes = w.len() / rows;
    let with_coef = matches!(
        ty,
        QuantType::Q4_1 | QuantType::Q5_1 | QuantType::Q4_K | QuantType::Q5_K
    );
    // values per scale: Q2_K's, Q3_K's and Q6_K's 16, else the group's 32
    let span = if matches!(ty, QuantType::Q2_K | QuantType::Q3_K | QuantType::Q6_K) {
        16
    } else {
        32
    };
    let mut yt = vec![0f32; rows * n_tok];
    yt.par_chunks_mut(n_tok)
        .enumerate()
        .for_each_init(Vec::new, |groups, (r, yr)| {
            decode_row_scalar(ty, &w[r * row_bytes..(r + 1) * row_bytes], groups);
            for (t, yv) in yr.iter_mut().enumerate() {
                let (mut acc, mut ext) = (0f32, 0f32);
                for (g, xb) in groups.iter().zip(&xq[t * per_tok..(t + 1) * per_tok]) {
                    for h in 0..32 / span {
                        let vals = h * span..(h + 1) * span;
                        let i: i32 = g.w[vals.clone()]
                            .iter()
                            .zip(&xb.qs[vals])
                            .map(|(a, b)| a * i32::from(*b))
                            .sum();
                        let s = if h == 0 { g.s_lo } else { g.s_hi };
                        acc = (s * xb.d).mul_add(i as f32, acc);
                    }
                    if with_coef {
                        ext += (g.coef[0] * xb.d) * xb.sum as f32;
                    } else if ty == QuantType::Q2_K {
                        let lo = half_sum(xb);
                        ext += (g.coef[0] * xb.d) * lo as f32;
                        ext += (g.coef[1] * xb.d) * (xb.sum - lo) as f32;
                    }
                }
                *yv = acc + ext;
            }
        });
    transpose_into(&yt, rows, n_tok, y);
}

/// Writes `yt` (row-major by weight row) into `y` (row-major by token), a block of rows at a
/// time: the block's values stay in L1 while each token's run of it is written in order (a
/// plain strided loop costs a cache miss a value on the head's 49k rows).
fn transpose_into(yt: &[f32], rows: usize, n_tok: usize, y: &mut [f32]) {
    const BLOCK: usize = 64;
    for (b, block) in yt[..rows * n_tok].chunks(BLOCK * n_tok).enumerate() {
        let r0 = b * BLOCK;
        let nr = block.len() / n_tok;
        for (t, run) in y.chunks_exact_mut(rows).enumerate().take(n_tok) {
            for (dst, src) in run[r0..r0 + nr]
                .iter_mut()
                .zip(block[t..].iter().step_by(n_tok))
            {
                *dst = *src;
            }
        }
    }
}

/// The four token rows of `xs` (`4 · cols` values).
#[cfg(target_arch = "x86_64")]
fn tok4(xs: &[f32], cols: usize) -> [&[f32]; 4] {
    std::array::from_fn(|k| &xs[k * cols..(k + 1) * cols])
}

/// Activation values per k-chunk of the outer-product tiles: a chunk of 32 tokens (16 KiB)
/// and of the tile's weight rows stay in L1, and each lane sums at most this many products
/// before they are added to the output.
#[cfg(target_arch = "x86_64")]
const KC: usize = 128;

/// Tokens per outer-product vector: 16 with AVX-512, 8 with AVX2 (0: no outer-product path).
fn outer_width(isa: Isa) -> usize {
    if isa.has_avx512() {
        16
    } else if isa.has_avx2() {
        8
    } else {
        0
    }
}

/// `yc[r·n_tok + t] = dot(wd[r], x[t])` for `nr` dequantised rows of `cols` values.
///
/// With AVX2/AVX-512 and at least one vector of tokens, whole vectors of tokens use
/// outer-product register tiles over the transposed activations `xt` (`cols × n_tok`): up to
/// 8 rows (4 with AVX2) × 2 token vectors of accumulators per tile, k in chunks of [`KC`], so
/// each decoded weight is reused by up to 32 tokens from registers and nothing is summed
/// horizontally. The remaining tokens, and the scalar level, take per-row dot products
/// (four tokens per pass with x86's `dot4`).
#[allow(clippy::too_many_arguments)]
#[cfg_attr(not(target_arch = "x86_64"), allow(unused_mut))]
fn tile_products(
    isa: Isa,
    wd: &[f32],
    x: &[f32],
    xt: &[f32],
    cols: usize,
    nr: usize,
    n_tok: usize,
    yc: &mut [f32],
) {
    let mut t_dot = 0;
    #[cfg(target_arch = "x86_64")]
    {
        let vw = outer_width(isa);
        if vw > 0 && n_tok >= vw && xt.len() == cols * n_tok {
            use super::x86_ops::imp;
            let wide = isa.has_avx512();
            let t_outer = n_tok / vw * vw;
            let max_r = if wide { 8 } else { 4 };
            for k0 in (0..cols).step_by(KC) {
                let kl = KC.min(cols - k0);
                let mut r = 0;
                while r < nr {
                    let rr = [8, 4, 2, 1]
                        .into_iter()
                        .find(|m| *m <= max_r && *m <= nr - r)
                        .unwrap_or(1);
                    let ws = &wd[r * cols..(r + rr) * cols];
                    let out = &mut yc[r * n_tok..];
                    let mut t = 0;
                    while t < t_outer {
                        let v = if t_outer - t >= 2 * vw { 2 } else { 1 };
                        macro_rules! go {
                            ($f:ident, $r:literal, $v:literal) => {
                                // SAFETY: AVX-512F (wide) or AVX2+FMA detected at run time;
                                // `ws` holds `rr` rows of `cols`, `xt` all `cols` rows of
                                // `n_tok` tokens, `t + v·vw <= n_tok`, and `out` holds `rr`
                                // rows of `n_tok` from row r.
                                unsafe {
                                    imp::$f::<$r, $v>(
                                        ws,
                                        cols,
                                        xt,
                                        n_tok,
                                        t,
                                        k0,
                                        kl,
                                        out,
                                        n_tok,
                                        k0 > 0,
                                    )
                                }
                            };
                        }
                        match (wide, rr, v) {
                            (true, 8, 2) => go!(gemm_outer_avx512, 8, 2),
                            (true, 8, _) => go!(gemm_outer_avx512, 8, 1),
                            (true, 4, 2) => go!(gemm_outer_avx512, 4, 2),
                            (true, 4, _) => go!(gemm_outer_avx512, 4, 1),
                            (true, 2, 2) => go!(gemm_outer_avx512, 2, 2),
                            (true, 2, _) => go!(gemm_outer_avx512, 2, 1),
                            (true, _, 2) => go!(gemm_outer_avx512, 1, 2),
                            (true, _, _) => go!(gemm_outer_avx512, 1, 1),
                            (false, 4, 2) => go!(gemm_outer_avx2, 4, 2),
                            (false, 4, _) => go!(gemm_outer_avx2, 4, 1),
                            (false, 2, 2) => go!(gemm_outer_avx2, 2, 2),
                            (false, 2, _) => go!(gemm_outer_avx2, 2, 1),
                            (false, _, 2) => go!(gemm_outer_avx2, 1, 2),
                            (false, _, _) => go!(gemm_outer_avx2, 1, 1),
                        }
                        t += v * vw;
                    }
                    r += rr;
                }
            }
            t_dot = t_outer;
        }
    }
    let _ = xt;
    for (r, yr) in yc.chunks_mut(n_tok).enumerate().take(nr) {
        let wr = &wd[r * cols..(r + 1) * cols];
        let mut t = t_dot;
        #[cfg(target_arch = "x86_64")]
        if isa.has_avx2() {
            while t + 4 <= n_tok {
                let xs = tok4(&x[t * cols..(t + 4) * cols], cols);
                yr[t..t + 4].copy_from_slice(&if isa.has_avx512() {
                    // SAFETY: AVX-512F detected; each token row has `cols` values.
                    unsafe { super::x86::imp::dot4_f32_avx512(wr, xs) }
                } else {
                    // SAFETY: AVX2/FMA detected; each token row has `cols` values.
                    unsafe { super::x86::imp::dot4_f32_avx2(wr, xs) }
                });
                t += 4;
            }
        }
        for (k, yv) in yr.iter_mut().enumerate().skip(t) {
            *yv = dot_f32(isa, wr, &x[k * cols..(k + 1) * cols]);
        }
    }
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

#[cfg(test)]
#[path = "matvec_tests.rs"]
mod tests;
