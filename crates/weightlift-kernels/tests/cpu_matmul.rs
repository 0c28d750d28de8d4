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
//!   the same 1e-5 · Σ|w·x|; and each token's result equals the matvec of that token on the
//!   same instruction set: bit for bit (the integer dot products are exact and the float
//!   operations the same), except the AVX2/AVX-512 path for Q4_0/Q4_1/Q5_0/Q5_1/Q4_K, which
//!   scales each 32-value group's exact integer dot once instead of each 4-value lane, and
//!   must agree within 1e-5 · Σ|w·x|.

// Reference loops index several arrays in lock-step; iterators would hide the maths.
#![allow(clippy::needless_range_loop)]

mod common;

use common::{Rng, load, q8_bound, reference};
use weightlift_kernels::cpu::matvec::{matmul_with, matvec_with};
use weightlift_kernels::{Isa, MatvecMode};

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

const TOKEN_COUNTS: [usize; 10] = [1, 2, 3, 4, 5, 9, 16, 17, 24, 33];

/// Types whose AVX2/AVX-512 Q8-mode matmul sums each group's integer products in full.
const NIBBLE_KERNEL: [&str; 5] = ["q4_0", "q4_1", "q5_0", "q5_1", "q4_k"];

#[test]
fn q8_matmul_equals_the_q8_matvec_of_each_token() {
    let mut rng = Rng(201);
    for (name, cols, rows) in [
        ("q4_0", 192, 7),
        ("q4_1", 96, 13),
        ("q5_0", 160, 9),
        ("q5_1", 96, 15),
        ("q8_0", 160, 9),
        ("q4_k", 256, 11),
        ("q6_k", 512, 6),
    ] {
        let (ty, raw, want) = cut(name, cols, rows);
        for n_tok in TOKEN_COUNTS {
            let x = rng.vec(cols * n_tok, 2.0);
            let (yref, mag) = reference(&want, rows, cols, &x, n_tok);
            let bound = q8_bound(&want, rows, cols, &x, n_tok);
            for isa in Isa::all_supported() {
                let mut y = vec![0f32; rows * n_tok];
                matmul_with(
                    isa,
                    MatvecMode::Q8,
                    ty,
                    &raw,
                    rows,
                    cols,
                    &x,
                    n_tok,
                    &mut y,
                    0,
                )
                .unwrap();
                for t in 0..n_tok {
                    let mut yv = vec![0f32; rows];
                    let xt = &x[t * cols..(t + 1) * cols];
                    matvec_with(isa, MatvecMode::Q8, ty, &raw, rows, cols, xt, &mut yv).unwrap();
                    for r in 0..rows {
                        let i = t * rows + r;
                        if isa >= Isa::Avx2 && NIBBLE_KERNEL.contains(&name) {
                            // one rounding per 32-value group instead of per 4-value lane
                            assert!(
                                (f64::from(y[i]) - f64::from(yv[r])).abs() <= 1e-5 * mag[i] + 1e-30,
                                "{name} {isa:?} n_tok {n_tok} token {t} row {r}: {} vs matvec {}",
                                y[i],
                                yv[r]
                            );
                        } else {
                            assert_eq!(
                                y[i].to_bits(),
                                yv[r].to_bits(),
                                "{name} {isa:?} n_tok {n_tok} token {t} row {r}: {} vs matvec {}",
                                y[i],
                                yv[r]
                            );
                        }
                        let err = (f64::from(y[i]) - yref[i]).abs();
                        assert!(
                            err <= bound[i] + 1e-5 * mag[i] + 1e-30
                                || !yref[i].is_finite()
                                || mag[i] > 1e37,
                            "{name} {isa:?} n_tok {n_tok} out {i}: {} vs {} (err {err:e})",
                            y[i],
                            yref[i]
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn exact_matmul_matches_f64_reference_for_ragged_tiles() {
    let mut rng = Rng(203);
    for (name, cols, rows) in [
        ("q4_0", 192, 7),
        ("q8_0", 96, 15),
        ("q4_k", 256, 11),
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
