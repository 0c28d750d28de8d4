//! The matrix–matrix product (prompt path) on every instruction set this CPU has, against an
//! f64 reference computed from gguf-py's dequantisation of the fixtures (`tests/data`), with
//! shapes that exercise every remainder of the register tiles: row counts that are not a
//! multiple of 4, token counts from 1 to 33 (odd counts, one past a pass of 16 or 32, every
//! combination of one and two token vectors), and for F16
//! a row length of 100 (not a multiple of any vector width).
//!
//! Tolerances:
//! - exact mode: |y − y₆₄| ≤ 1e-5 · Σ|w·x| (f32 products and sums);
//! - Q8 mode: the activation rounding bound of `cpu_ops.rs` (Σ|w| · 0.57 · d_x per block) plus
//!   the same 1e-5 · Σ|w·x|. Every instruction set, with VNNI and without, gives the scalar
//!   matmul's bits (the integer dot products are exact and the tiles do the scalar path's
//!   float operations in its order). From 8 tokens the matmul scales each 32-value group once
//!   where the matvec scales each 4-value lane, so the two agree within
//!   1e-5 · Σ(|w| + 2|m|)·|x| (`m` the group's weight offset, which bounds every partial sum
//!   either one sees); below 8 the matmul is the matvec of each token.

// Reference loops index several arrays in lock-step; iterators would hide the maths.
#![allow(clippy::needless_range_loop)]

use crate::common;

use common::{Rng, group_offset, load, q8_bound, reference};
use weightlift_kernels::cpu::matvec::{
    matmul_with, matmul_with_vnni, matvec_with, quantize_q8_blocks,
};
use weightlift_kernels::{Isa, MatvecMode, QuantType, dequantize_f32};

/// A fixture cut to `rows × cols` (whole blocks), with gguf-py's values for those rows.
fn cut(name: &str, cols: usize, rows: usize) -> (weightlift_kernels::QuantType, Vec<u8>, Vec<f32>) {
    let f = load(name);
    let row_bytes = cols / f.ty.block_size() * f.ty.block_bytes();
    assert!(rows * cols <= f.want.len(), "{name}: fixture too small");
    (
        f.ty,
        f.raw[..rows * row_bytes].to_vec(),
        f.want[..rows * cols].to_vec(),
    )
}

/// Token counts: below 8 the Q8 mode runs the matvec per token; from 8, every tail of the
/// 12-token (512-bit) and 3-token (256-bit) tiles.
const TOKEN_COUNTS: [usize; 14] = [1, 2, 3, 4, 5, 8, 9, 10, 12, 13, 14, 16, 17, 33];

/// The Q8-mode weight types.
const Q8_TYPES: [QuantType; 10] = [
    QuantType::Q4_0,
    QuantType::Q4_1,
    QuantType::Q5_0,
    QuantType::Q5_1,
    QuantType::Q8_0,
    QuantType::Q2_K,
    QuantType::Q3_K,
    QuantType::Q4_K,
    QuantType::Q5_K,
    QuantType::Q6_K,
];

/// The Q8-mode matmul on `isa`, VNNI allowed or not.
#[allow(clippy::too_many_arguments)]
fn q8_matmul(
    isa: Isa,
    vnni: bool,
    ty: QuantType,
    raw: &[u8],
    rows: usize,
    cols: usize,
    x: &[f32],
    n_tok: usize,
) -> Vec<f32> {
    let mut y = vec![0f32; rows * n_tok];
    matmul_with_vnni(
        isa,
        vnni,
        MatvecMode::Q8,
        ty,
        raw,
        rows,
        cols,
        x,
        n_tok,
        &mut y,
        0,
    )
    .unwrap();
    y
}

/// Asserts that the matmul has the scalar matmul's bits on every instruction set, VNNI on
/// and off; returns the scalar result.
fn same_bits_on_every_isa(
    what: &str,
    ty: QuantType,
    raw: &[u8],
    rows: usize,
    cols: usize,
    x: &[f32],
    n_tok: usize,
) -> Vec<f32> {
    let want = q8_matmul(Isa::Scalar, false, ty, raw, rows, cols, x, n_tok);
    for isa in Isa::all_supported() {
        for vnni in [false, true] {
            let y = q8_matmul(isa, vnni, ty, raw, rows, cols, x, n_tok);
            for (i, (a, b)) in y.iter().zip(&want).enumerate() {
                assert_eq!(
                    a.to_bits(),
                    b.to_bits(),
                    "{what} {isa:?} vnni {vnni} n_tok {n_tok} out {i}: {a} vs scalar {b}"
                );
            }
        }
    }
    want
}

/// The f64 dot of `w` (dequantised weights) with the activations as the Q8 mode rounds them,
/// and Σ(|w| + 2|m|)·|x| per output.
fn q8_reference(
    ty: QuantType,
    raw: &[u8],
    w: &[f32],
    rows: usize,
    cols: usize,
    x: &[f32],
    n_tok: usize,
) -> (Vec<f64>, Vec<f64>) {
    let row_bytes = raw.len() / rows;
    let mut want = vec![0f64; rows * n_tok];
    let mut mag = vec![0f64; rows * n_tok];
    for t in 0..n_tok {
        let q = quantize_q8_blocks(&x[t * cols..(t + 1) * cols]);
        for r in 0..rows {
            let i = t * rows + r;
            for c in 0..cols {
                let xv = f64::from(q[c / 32].d) * f64::from(q[c / 32].qs[c % 32]);
                let wv = f64::from(w[r * cols + c]);
                let m = group_offset(ty, &raw[r * row_bytes..], c / 32);
                want[i] += wv * xv;
                mag[i] += (wv.abs() + 2.0 * m.abs()) * xv.abs();
            }
        }
    }
    (want, mag)
}

#[test]
fn q8_matmul_has_the_same_bits_on_every_isa_and_matches_the_reference() {
    let mut rng = Rng(201);
    for (name, cols, rows) in [
        ("q4_0", 192, 7),
        ("q4_1", 96, 13),
        ("q5_0", 160, 9),
        ("q5_1", 96, 15),
        ("q8_0", 160, 9),
        ("q2_k", 256, 11),
        ("q3_k", 256, 11),
        ("q4_k", 256, 11),
        ("q5_k", 256, 11),
        ("q6_k", 512, 6),
    ] {
        let (ty, raw, want) = cut(name, cols, rows);
        for n_tok in TOKEN_COUNTS {
            let x = rng.vec(cols * n_tok, 2.0);
            let (yref, mag) = reference(&want, rows, cols, &x, n_tok);
            let bound = q8_bound(&want, rows, cols, &x, n_tok);
            let (_, mag_q) = q8_reference(ty, &raw, &want, rows, cols, &x, n_tok);
            let y = same_bits_on_every_isa(name, ty, &raw, rows, cols, &x, n_tok);
            for isa in Isa::all_supported() {
                for t in 0..n_tok {
                    let mut yv = vec![0f32; rows];
                    let xt = &x[t * cols..(t + 1) * cols];
                    matvec_with(isa, MatvecMode::Q8, ty, &raw, rows, cols, xt, &mut yv).unwrap();
                    for r in 0..rows {
                        let i = t * rows + r;
                        // up to 16 tokens: each token's own matvec, bit for bit
                        assert!(
                            n_tok > 16 || y[i].to_bits() == yv[r].to_bits(),
                            "{name} {isa:?} n_tok {n_tok} token {t} row {r}: {} vs matvec {}",
                            y[i],
                            yv[r]
                        );
                        // from 17 (the tiles): one rounding per 32-value group instead of per
                        // 4-value lane
                        assert!(
                            (f64::from(y[i]) - f64::from(yv[r])).abs() <= 1e-5 * mag_q[i] + 1e-30,
                            "{name} {isa:?} n_tok {n_tok} token {t} row {r}: {} vs matvec {}",
                            y[i],
                            yv[r]
                        );
                    }
                }
            }
            for i in 0..y.len() {
                let err = (f64::from(y[i]) - yref[i]).abs();
                assert!(
                    err <= bound[i] + 1e-5 * mag[i] + 1e-30
                        || !yref[i].is_finite()
                        || mag[i] > 1e37,
                    "{name} n_tok {n_tok} out {i}: {} vs {} (err {err:e})",
                    y[i],
                    yref[i]
                );
            }
        }
    }
}

/// Byte offsets of a block's f16 scales (ggml-common.h).
fn scale_offsets(ty: QuantType) -> &'static [usize] {
    match ty {
        QuantType::Q4_1 | QuantType::Q5_1 | QuantType::Q4_K | QuantType::Q5_K => &[0, 2],
        QuantType::Q2_K => &[80, 82],
        QuantType::Q3_K => &[108],
        QuantType::Q6_K => &[208],
        _ => &[0],
    }
}

/// `rows × cols` random blocks of `ty` with every f16 scale set to `scale` (f16 bits).
fn random_blocks(rng: &mut Rng, ty: QuantType, rows: usize, cols: usize, scale: u16) -> Vec<u8> {
    let mut raw = rng.bytes(rows * cols / ty.block_size() * ty.block_bytes());
    for blk in raw.chunks_exact_mut(ty.block_bytes()) {
        for &o in scale_offsets(ty) {
            blk[o..o + 2].copy_from_slice(&scale.to_le_bytes());
        }
    }
    raw
}

/// The K-quants' matvec on random blocks with random scales (`d` and `dmin` of Q4_K between
/// 2⁻⁸ and 1) against activations around +2, so that Q4_K's offset term (`dmin · m · d_x · Σq`
/// per sub-block) is as large as the quants' term and its rounding reaches the result: every
/// instruction set, VNNI allowed or not, gives the scalar path's bits in every row.
#[test]
fn k_quant_matvecs_give_the_scalar_bits_where_the_offsets_weigh() {
    let mut rng = Rng(223);
    let (rows, cols) = (512, 1024);
    for ty in [
        QuantType::Q2_K,
        QuantType::Q3_K,
        QuantType::Q4_K,
        QuantType::Q5_K,
        QuantType::Q6_K,
    ] {
        let mut raw = rng.bytes(rows * cols / 256 * ty.block_bytes());
        for blk in raw.chunks_exact_mut(ty.block_bytes()) {
            for &o in scale_offsets(ty) {
                // f16 exponents 7 to 14 (2⁻⁸ to 2⁻¹), any mantissa, positive
                let bits = (((7 + rng.next_u64() % 8) << 10) | (rng.next_u64() % 1024)) as u16;
                blk[o..o + 2].copy_from_slice(&bits.to_le_bytes());
            }
        }
        for v in 0..4 {
            let x: Vec<f32> = rng.vec(cols, 1.0).iter().map(|e| 2.0 + e).collect();
            let mut by_isa: Vec<(Isa, bool, Vec<u32>)> = Vec::new();
            for isa in Isa::all_supported() {
                for vnni in [false, true] {
                    let mut y = vec![0f32; rows];
                    weightlift_kernels::cpu::matvec::matvec_with_vnni(
                        isa,
                        vnni,
                        MatvecMode::Q8,
                        ty,
                        &raw,
                        rows,
                        cols,
                        &x,
                        &mut y,
                    )
                    .unwrap();
                    by_isa.push((isa, vnni, y.iter().map(|v| v.to_bits()).collect()));
                }
            }
            let (scalar, others) = by_isa.split_first().unwrap();
            assert_eq!(scalar.0, Isa::Scalar);
            for (isa, vnni, bits) in others {
                let differ = bits.iter().zip(&scalar.2).filter(|(a, b)| a != b).count();
                assert_eq!(
                    differ, 0,
                    "{ty} vector {v} {isa:?} vnni {vnni}: rows differ"
                );
            }
        }
    }
}

/// The grouped product (a mixture-of-experts layer's down products, each matrix on tokens of
/// its own) gives each matrix the bits of its own product, in both modes and on every
/// instruction set, for one token each (one parallel loop) and for several (one after the
/// other).
#[test]
fn grouped_products_give_each_matrix_the_bits_of_its_own() {
    use weightlift_kernels::cpu::matvec::{GroupedInput, matmul_grouped_with};
    let mut rng = Rng(227);
    let (rows, cols) = (40, 512);
    for ty in [
        QuantType::Q4_K,
        QuantType::Q5_K,
        QuantType::Q6_K,
        QuantType::Q8_0,
    ] {
        let mats: Vec<Vec<u8>> = (0..3)
            .map(|_| random_blocks(&mut rng, ty, rows, cols, 0x2c00))
            .collect();
        for n_tok in [1, 3] {
            let xs: Vec<Vec<f32>> = (0..3).map(|_| rng.vec(cols * n_tok, 2.0)).collect();
            for isa in Isa::all_supported() {
                for mode in [MatvecMode::Q8, MatvecMode::Exact] {
                    let mut ys = vec![vec![0f32; rows * n_tok]; 3];
                    let mut parts: Vec<GroupedInput<'_>> = mats
                        .iter()
                        .zip(&xs)
                        .zip(&mut ys)
                        .map(|((w, x), y)| GroupedInput { w, rows, x, y })
                        .collect();
                    matmul_grouped_with(isa, mode, ty, &mut parts, cols, n_tok, 1 << 16).unwrap();
                    for ((w, x), y) in mats.iter().zip(&xs).zip(&ys) {
                        let mut want = vec![0f32; rows * n_tok];
                        matmul_with(isa, mode, ty, w, rows, cols, x, n_tok, &mut want, 1 << 16)
                            .unwrap();
                        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                        assert_eq!(bits(y), bits(&want), "{ty} {isa:?} {mode:?} n_tok {n_tok}");
                    }
                }
            }
        }
    }
}

/// Several panels of 16 rows and a ragged last one, token counts around the tiles' 12 (and
/// 3) tokens (the tiles take more than 16 tokens: 20, 23 and 25 end in 8, 11 and 1), random
/// blocks: the same bits everywhere, and within 1e-5 · Σ(|w| + 2|m|)·|x| of the f64 dot with
/// the Q8-rounded activations.
#[test]
fn q8_matmul_of_several_panels_has_the_same_bits_on_every_isa() {
    let mut rng = Rng(207);
    for ty in Q8_TYPES {
        let cols = if ty.block_size() == 256 { 512 } else { 160 };
        let rows = 37;
        let raw = random_blocks(&mut rng, ty, rows, cols, 0x2c00);
        let mut w = vec![0f32; rows * cols];
        dequantize_f32(ty, &raw, &mut w).unwrap();
        for n_tok in [6, 8, 11, 12, 13, 20, 23, 25, 26, 40] {
            let x = rng.vec(cols * n_tok, 3.0);
            let y = same_bits_on_every_isa(&ty.to_string(), ty, &raw, rows, cols, &x, n_tok);
            let (want, mag) = q8_reference(ty, &raw, &w, rows, cols, &x, n_tok);
            for i in 0..y.len() {
                let err = (f64::from(y[i]) - want[i]).abs();
                assert!(
                    err <= 1e-5 * mag[i] + 1e-30,
                    "{ty} n_tok {n_tok} out {i}: {} vs f64 {} (err {err:e})",
                    y[i],
                    want[i]
                );
            }
        }
    }
}

/// The largest integer sums each path sees: weight quants at their extremes (all bits set,
/// none set, Q8_0's −128 and 127, Q6_K's sub-scales at ±127 and −128) against activations
/// saturating at ±127. Without VNNI, two products of 128 · 127 (Q8_0) or 63 · 127 (Q6_K) share
/// one i16 of `pmaddubsw`: exact only if nothing saturates.
#[test]
fn q8_matmul_is_exact_at_the_extreme_quants() {
    let mut rng = Rng(211);
    let rows = 20;
    // 14 tokens take the batched matvec kernels, 30 the tiles
    for (ty, n_tok) in Q8_TYPES.into_iter().flat_map(|ty| [(ty, 14), (ty, 30)]) {
        let cols = 256;
        let bb = ty.block_bytes();
        let mut raw = Vec::new();
        for r in 0..rows {
            for _ in 0..cols / ty.block_size() {
                let fill = match r % 4 {
                    0 => vec![0xffu8; bb],
                    1 => vec![0u8; bb],
                    2 => (0..bb)
                        .map(|i| if i % 2 == 0 { 0x80 } else { 0x7f })
                        .collect(),
                    _ => rng.bytes(bb),
                };
                raw.extend_from_slice(&fill);
            }
        }
        for blk in raw.chunks_exact_mut(bb) {
            for &o in scale_offsets(ty) {
                blk[o..o + 2].copy_from_slice(&0x3800u16.to_le_bytes()); // 0.5
            }
        }
        let mut w = vec![0f32; rows * cols];
        dequantize_f32(ty, &raw, &mut w).unwrap();
        // every activation at ±amax (all quants ±127): all +, all −, mixed
        let x: Vec<f32> = (0..n_tok * cols)
            .map(|i| match (i / cols) % 3 {
                0 => 1.5,
                1 => -1.5,
                _ => {
                    if rng.unit() < 0.0 {
                        -1.5
                    } else {
                        1.5
                    }
                }
            })
            .collect();
        let y = same_bits_on_every_isa(&ty.to_string(), ty, &raw, rows, cols, &x, n_tok);
        let (want, mag) = q8_reference(ty, &raw, &w, rows, cols, &x, n_tok);
        for i in 0..y.len() {
            assert!(
                (f64::from(y[i]) - want[i]).abs() <= 1e-5 * mag[i] + 1e-30,
                "{ty} out {i}: {} vs f64 {}",
                y[i],
                want[i]
            );
        }
    }
}

/// Activations the quantiser must round as `quantize_q8_blocks` (llama.cpp's `roundf`, half
/// away from zero, then Rust's saturating `as i8`) does: halves at the amax scale of 127
/// (d = 1, so x · (1/d) is x), values just below a half, subnormals whose 1/d overflows to
/// infinity (±inf and NaN quants), zeros, and NaN: the SIMD quantiser's results are the scalar
/// matmul's bits.
#[test]
fn q8_matmul_quantises_activations_as_the_scalar_path() {
    let ty = QuantType::Q8_0;
    let (rows, cols) = (16, 160);
    let mut rng = Rng(213);
    let raw = random_blocks(&mut rng, ty, rows, cols, 0x2c00);
    let mut x = Vec::new();
    let n_tok = 9;
    for t in 0..n_tok {
        for g in 0..cols / 32 {
            for i in 0..32usize {
                let v = match (t + g) % 5 {
                    0 => {
                        if i == 0 {
                            127.0
                        } else {
                            (i as f32 - 16.0) + 0.5
                        }
                    }
                    1 => {
                        if i == 0 {
                            -127.0
                        } else {
                            (i as f32 - 16.0) * 0.999_999_9 + 0.499_999_97
                        }
                    }
                    // subnormal: d = amax/127 is not 0 but 1/d is infinite
                    2 => 1e-40 * (i % 4) as f32 * if i % 2 == 0 { 1.0 } else { -1.0 },
                    3 => 0.0,
                    _ => {
                        if i == 5 {
                            f32::NAN
                        } else {
                            rng.unit()
                        }
                    }
                };
                x.push(v);
            }
        }
    }
    same_bits_on_every_isa("rounding", ty, &raw, rows, cols, &x, n_tok);
}

#[test]
fn exact_matmul_matches_f64_reference_for_ragged_tiles() {
    let mut rng = Rng(203);
    for (name, cols, rows) in [
        ("q4_0", 192, 7),
        ("q8_0", 96, 15),
        ("q4_k", 256, 11),
        ("q5_k", 256, 11),
        ("q6_k", 512, 6),
        ("q5_k", 256, 9),
        ("f16", 100, 10),
        ("bf16", 37, 27),
    ] {
        let (ty, raw, want) = cut(name, cols, rows);
        for n_tok in TOKEN_COUNTS {
            let x = rng.vec(cols * n_tok, 1.0);
            let (yref, mag) = reference(&want, rows, cols, &x, n_tok);
            for isa in Isa::all_supported() {
                for max_dq in [1, 3 * cols, usize::MAX] {
                    let mut y = vec![0f32; rows * n_tok];
                    matmul_with(
                        isa,
                        MatvecMode::Exact,
                        ty,
                        &raw,
                        rows,
                        cols,
                        &x,
                        n_tok,
                        &mut y,
                        max_dq,
                    )
                    .unwrap();
                    for i in 0..y.len() {
                        let err = (f64::from(y[i]) - yref[i]).abs();
                        assert!(
                            err <= 1e-5 * mag[i] + 1e-30 || !yref[i].is_finite() || mag[i] > 1e37,
                            "{name} {isa:?} n_tok {n_tok} dq {max_dq} out {i}: {} vs {}",
                            y[i],
                            yref[i]
                        );
                    }
                }
            }
        }
    }
}
