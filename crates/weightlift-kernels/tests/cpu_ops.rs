//! CPU kernels against independent references: gguf-py's dequantised weights (fixtures) with
//! f64 dot products for matvec/matmul, closed forms for the row operations, the `half` crate
//! for f16 rounding, and the documented error bound for the KV-cache quantisers.

// Reference loops index several arrays in lock-step; iterators would hide the maths.
#![allow(clippy::needless_range_loop)]

use crate::common;

use common::{Rng, group_offset, load, q8_bound, reference};
use weightlift_kernels::cpu::convert::{
    bf16_to_f16_slice_with, f32_to_bf16_slice_with, f32_to_f16_slice_with,
};
use weightlift_kernels::cpu::matvec::{
    matmul_with, matvec_with, matvec_with_vnni, quantize_q8_blocks,
};
use weightlift_kernels::*;

/// The weight types of [`MatvecMode::Q8`] (`Q8_WEIGHT_TYPES`).
const MATVEC_TYPES: [&str; 10] = [
    "q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k",
];

#[test]
fn matvec_matches_f64_reference_on_gguf_py_weights_in_both_modes_and_isas() {
    let mut rng = Rng(7);
    for name in MATVEC_TYPES {
        let f = load(name);
        let cols = 512;
        let rows = f.want.len() / cols;
        let x = rng.vec(cols, 2.0);
        let (yref, mag) = reference(&f.want, rows, cols, &x, 1);
        let bound = q8_bound(&f.want, rows, cols, &x, 1);
        let mut q8_results = Vec::new();
        for isa in Isa::all_supported() {
            for mode in [MatvecMode::Exact, MatvecMode::Q8] {
                let mut y = vec![0f32; rows];
                matvec_with(isa, mode, f.ty, &f.raw, rows, cols, &x, &mut y).unwrap();
                for r in 0..rows {
                    let err = (f64::from(y[r]) - yref[r]).abs();
                    let tol = match mode {
                        MatvecMode::Exact => 1e-5 * mag[r] + 1e-30,
                        MatvecMode::Q8 => bound[r] + 1e-5 * mag[r] + 1e-30,
                    };
                    assert!(
                        err <= tol || (y[r].is_infinite() && !yref[r].is_finite()),
                        "{name} {isa:?} {mode:?} row {r}: {} vs {} (err {err:e}, tol {tol:e})",
                        y[r],
                        yref[r]
                    );
                }
                if mode == MatvecMode::Q8 {
                    q8_results.push(y);
                }
            }
        }
        // the Q8 mode's integer dot products are exact, so every ISA gives the same bits
        for y in &q8_results[1..] {
            assert_eq!(
                y.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                q8_results[0]
                    .iter()
                    .map(|v| v.to_bits())
                    .collect::<Vec<_>>(),
                "{name}"
            );
        }
    }
}

#[test]
fn q8_matvec_vnni_and_plain_paths_give_the_same_bits_within_the_f64_bound() {
    let mut rng = Rng(19);
    let mut vnni_runs = 0;
    for name in MATVEC_TYPES {
        let f = load(name);
        let cols = 512;
        let rows = f.want.len() / cols;
        // the second vector saturates some quants at ±127 (the VNNI offset terms are largest)
        let mut x2 = rng.vec(cols, 1.0);
        for v in x2.iter_mut().step_by(3) {
            *v = if *v < 0.0 { -3.0 } else { 3.0 };
        }
        for x in [rng.vec(cols, 2.0), x2] {
            let (yref, mag) = reference(&f.want, rows, cols, &x, 1);
            let bound = q8_bound(&f.want, rows, cols, &x, 1);
            let mut bits: Vec<(Isa, bool, Vec<u32>)> = Vec::new();
            for isa in Isa::all_supported() {
                for vnni in [false, true] {
                    vnni_runs += usize::from(vnni && isa.vnni().is_some());
                    let mut y = vec![0f32; rows];
                    matvec_with_vnni(
                        isa,
                        vnni,
                        MatvecMode::Q8,
                        f.ty,
                        &f.raw,
                        rows,
                        cols,
                        &x,
                        &mut y,
                    )
                    .unwrap();
                    for r in 0..rows {
                        let err = (f64::from(y[r]) - yref[r]).abs();
                        let tol = bound[r] + 1e-5 * mag[r] + 1e-30;
                        assert!(
                            err <= tol,
                            "{name} {isa:?} vnni {vnni} row {r}: {} vs {} (err {err:e}, tol {tol:e})",
                            y[r],
                            yref[r]
                        );
                    }
                    bits.push((isa, vnni, y.iter().map(|v| v.to_bits()).collect()));
                }
            }
            for (isa, vnni, b) in &bits[1..] {
                assert!(
                    b == &bits[0].2,
                    "{name} {isa:?} vnni {vnni}: bits differ from scalar"
                );
            }
        }
    }
    // on a CPU with AVX-VNNI or AVX512-VNNI the VNNI kernels ran (unless switched off by env)
    let expected = Isa::all_supported()
        .into_iter()
        .filter(|i| i.vnni().is_some())
        .count();
    assert_eq!(vnni_runs, expected * MATVEC_TYPES.len() * 2);
}

/// Q8 mode on every instruction set against the f64 dot of gguf-py's dequantised weights
/// with the activations as `quantize_q8_blocks` rounds them (`d · q`), so the activation
/// rounding is not in the error: the matvec with VNNI on and off, and the matmul of 1 to 17
/// tokens (the matvec per token below 8, the register tiles from 8). Within 1e-5 · Σ(|w| + 2|m|)·|d·q|,
/// `m` the group's weight offset: that bounds every partial sum the f32 lanes and the offset
/// term see (about 80 f32 ulps of it).
#[test]
fn q8_mode_matches_an_f64_dot_of_the_quantised_activations_on_every_isa() {
    let mut rng = Rng(0x5a01);
    for name in MATVEC_TYPES {
        let f = load(name);
        let cols = 256;
        let rows = f.want.len() / cols;
        let row_bytes = f.raw.len() / rows;
        for n_tok in [1usize, 3, 8, 17] {
            let x = rng.vec(cols * n_tok, 2.0);
            let mut want = vec![0f64; n_tok * rows];
            let mut mag = vec![0f64; n_tok * rows];
            for t in 0..n_tok {
                let q = quantize_q8_blocks(&x[t * cols..(t + 1) * cols]);
                for r in 0..rows {
                    let i = t * rows + r;
                    for c in 0..cols {
                        let xv = f64::from(q[c / 32].d) * f64::from(q[c / 32].qs[c % 32]);
                        let wv = f64::from(f.want[r * cols + c]);
                        let m = group_offset(f.ty, &f.raw[r * row_bytes..], c / 32);
                        want[i] += wv * xv;
                        mag[i] += (wv.abs() + 2.0 * m.abs()) * xv.abs();
                    }
                }
            }
            let check = |what: &str, i: usize, got: f32| {
                let err = (f64::from(got) - want[i]).abs();
                assert!(
                    err <= 1e-5 * mag[i] + 1e-30,
                    "{name} {what} n_tok {n_tok} out {i}: {got} vs f64 {} (err {err:e})",
                    want[i]
                );
            };
            for isa in Isa::all_supported() {
                let mut y = vec![0f32; rows * n_tok];
                matmul_with(
                    isa,
                    MatvecMode::Q8,
                    f.ty,
                    &f.raw,
                    rows,
                    cols,
                    &x,
                    n_tok,
                    &mut y,
                    0,
                )
                .unwrap();
                for (i, v) in y.iter().enumerate() {
                    check(&format!("{isa:?} matmul"), i, *v);
                }
                for vnni in [false, true] {
                    for t in 0..n_tok {
                        let mut yv = vec![0f32; rows];
                        matvec_with_vnni(
                            isa,
                            vnni,
                            MatvecMode::Q8,
                            f.ty,
                            &f.raw,
                            rows,
                            cols,
                            &x[t * cols..(t + 1) * cols],
                            &mut yv,
                        )
                        .unwrap();
                        for (r, v) in yv.iter().enumerate() {
                            check(&format!("{isa:?} vnni {vnni} matvec"), t * rows + r, *v);
                        }
                    }
                }
            }
        }
    }
}

/// Q5_0 and Q5_1 blocks built at the extremes (every quant 31, every quant 0, the fifth bits
/// alternating, random) against activations saturating at ±127 in their blocks: the largest
/// integer sums the 5-bit kernels see (a group's 32 · 31 · 127 would overflow the i16 sums
/// of the 4-bit matmul kernel if it summed all 8 steps). Matvec and matmul of 17 tokens on
/// every instruction set, against the f64 dot of `dequantize_f32`'s weights with `d · q`.
#[test]
fn q5_q8_mode_is_exact_at_the_extreme_quants() {
    let mut rng = Rng(0x5a02);
    let (cols, n_tok) = (256, 17);
    for ty in [QuantType::Q5_0, QuantType::Q5_1] {
        let bb = ty.block_bytes();
        let at = if ty == QuantType::Q5_0 { 2 } else { 4 };
        // rows: all quants 31, all 0, alternating fifth bits with nibbles 15, random bytes
        let fills: [(u32, u8); 3] = [(u32::MAX, 0xff), (0, 0), (0x5555_5555, 0xff)];
        let mut raw = Vec::new();
        for row in 0..4 {
            for _ in 0..cols / 32 {
                let mut blk = if row < 3 {
                    let (qh, qs) = fills[row];
                    let mut b = vec![0u8; bb];
                    b[at..at + 4].copy_from_slice(&qh.to_le_bytes());
                    b[at + 4..].fill(qs);
                    b
                } else {
                    rng.bytes(bb)
                };
                // d = 0.5, m = -3.0 (f16)
                blk[0..2].copy_from_slice(&0x3800u16.to_le_bytes());
                if ty == QuantType::Q5_1 {
                    blk[2..4].copy_from_slice(&0xc200u16.to_le_bytes());
                }
                raw.extend_from_slice(&blk);
            }
        }
        let rows = 4;
        let mut w = vec![0f32; rows * cols];
        dequantize_f32(ty, &raw, &mut w).unwrap();
        // every activation at ±amax (all quants ±127), signs per token: all +, all −, mixed
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
        let mut want = vec![0f64; n_tok * rows];
        let mut mag = vec![0f64; n_tok * rows];
        for t in 0..n_tok {
            let q = quantize_q8_blocks(&x[t * cols..(t + 1) * cols]);
            assert!(q.iter().all(|b| b.qs.iter().all(|v| v.abs() == 127)));
            for r in 0..rows {
                for c in 0..cols {
                    let xv = f64::from(q[c / 32].d) * f64::from(q[c / 32].qs[c % 32]);
                    let wv = f64::from(w[r * cols + c]);
                    want[t * rows + r] += wv * xv;
                    mag[t * rows + r] += (wv.abs() + 6.0) * xv.abs();
                }
            }
        }
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
            let mut yv = vec![0f32; rows];
            for t in 0..n_tok {
                let xt = &x[t * cols..(t + 1) * cols];
                matvec_with(isa, MatvecMode::Q8, ty, &raw, rows, cols, xt, &mut yv).unwrap();
                for r in 0..rows {
                    let i = t * rows + r;
                    for (what, got) in [("matmul", y[i]), ("matvec", yv[r])] {
                        assert!(
                            (f64::from(got) - want[i]).abs() <= 1e-5 * mag[i],
                            "{ty} {isa:?} {what} token {t} row {r}: {got} vs f64 {}",
                            want[i]
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn matmul_chunked_by_max_dq_size_matches_reference_for_every_chunking() {
    let mut rng = Rng(11);
    for name in ["q4_0", "q4_k", "q6_k", "f16", "bf16", "q5_k"] {
        let f = load(name);
        let cols = 256;
        let rows = f.want.len() / cols;
        let n_tok = 5; // one pass of four tokens plus one
        let x = rng.vec(cols * n_tok, 1.0);
        let (yref, mag) = reference(&f.want, rows, cols, &x, n_tok);
        for isa in Isa::all_supported() {
            for max_dq in [1, cols * 2 + 7, usize::MAX] {
                let mut y = vec![0f32; rows * n_tok];
                matmul_with(
                    isa,
                    MatvecMode::Exact,
                    f.ty,
                    &f.raw,
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
                        "{name} {isa:?} dq {max_dq} out {i}: {} vs {}",
                        y[i],
                        yref[i]
                    );
                }
            }
            if matches!(
                f.ty,
                QuantType::Q4_0
                    | QuantType::Q2_K
                    | QuantType::Q3_K
                    | QuantType::Q4_K
                    | QuantType::Q6_K
            ) {
                let bound = q8_bound(&f.want, rows, cols, &x, n_tok);
                let mut y = vec![0f32; rows * n_tok];
                matmul_with(
                    isa,
                    MatvecMode::Q8,
                    f.ty,
                    &f.raw,
                    rows,
                    cols,
                    &x,
                    n_tok,
                    &mut y,
                    0,
                )
                .unwrap();
                for i in 0..y.len() {
                    let err = (f64::from(y[i]) - yref[i]).abs();
                    assert!(
                        err <= bound[i] + 1e-5 * mag[i] + 1e-30
                            || !yref[i].is_finite()
                            || mag[i] > 1e37,
                        "{name} q8 out {i}"
                    );
                }
            }
        }
    }
}

#[test]
fn matvec_shape_errors_are_typed() {
    let f = load("q4_0");
    let mut y = vec![0f32; 3];
    let err = matvec(MatvecMode::Exact, f.ty, &f.raw, 3, 100, &[0.0; 100], &mut y).unwrap_err();
    assert_eq!(
        err.to_string(),
        "invalid shape for matvec: row length 100 is not a multiple of the q4_0 block size 32"
    );
    let err = matvec(
        MatvecMode::Exact,
        f.ty,
        &f.raw,
        2,
        512,
        &[0.0; 512],
        &mut y[..2],
    )
    .unwrap_err();
    assert_eq!(
        err.to_string(),
        "matvec weight bytes: expected 576, got 864"
    );
    let iq4 = load("iq4_nl");
    let rows = iq4.want.len() / 512;
    let mut y = vec![0f32; rows];
    let err = matvec(
        MatvecMode::Q8,
        iq4.ty,
        &iq4.raw,
        rows,
        512,
        &[0.0; 512],
        &mut y,
    )
    .unwrap_err();
    assert_eq!(
        err.to_string(),
        "matvec (q8 mode) does not support iq4_nl; supported: q4_0, q4_1, q5_0, q5_1, q8_0, \
         q2_k, q3_k, q4_k, q5_k, q6_k"
    );
}

/// `q8_supports`, the `Q8_WEIGHT_TYPES` list in the error message and the types these tests
/// cover are one set.
#[test]
fn q8_supported_types_agree_with_their_list() {
    use weightlift_kernels::cpu::matvec::{Q8_WEIGHT_TYPES, q8_supports};
    let listed: Vec<&str> = Q8_WEIGHT_TYPES.split(", ").collect();
    assert_eq!(listed, MATVEC_TYPES);
    for name in common::NAMES {
        let ty = load(name).ty;
        assert_eq!(q8_supports(ty), listed.contains(&name), "{name}");
    }
}

#[test]
fn f16_activations_give_the_f32_result_of_their_values() {
    let f = load("q8_0");
    let cols = 256;
    let rows = f.want.len() / cols;
    let mut rng = Rng(3);
    let xh: Vec<u16> = rng
        .vec(cols, 1.0)
        .iter()
        .map(|v| half::f16::from_f32(*v).to_bits())
        .collect();
    let xf: Vec<f32> = xh
        .iter()
        .map(|h| half::f16::from_bits(*h).to_f32())
        .collect();
    let (mut a, mut b) = (vec![0f32; rows], vec![0f32; rows]);
    matvec_f16(MatvecMode::Exact, f.ty, &f.raw, rows, cols, &xh, &mut a).unwrap();
    matvec(MatvecMode::Exact, f.ty, &f.raw, rows, cols, &xf, &mut b).unwrap();
    assert_eq!(a, b);
}

#[test]
fn f32_and_bf16_to_f16_round_like_the_half_crate() {
    let mut rng = Rng(5);
    let src: Vec<f32> = (0..4099)
        .map(|_| f32::from_bits((rng.next_u64() >> 32) as u32))
        .collect();
    let bf: Vec<u16> = (0..4099).map(|_| (rng.next_u64() >> 48) as u16).collect();
    for isa in Isa::all_supported() {
        let mut out = vec![0u16; src.len()];
        f32_to_f16_slice_with(isa, &src, &mut out).unwrap();
        for (s, o) in src.iter().zip(&out) {
            let want = half::f16::from_f32(*s);
            assert!(
                want.to_bits() == *o || (want.is_nan() && half::f16::from_bits(*o).is_nan()),
                "{isa:?} {s:e}"
            );
        }
        let mut out = vec![0u16; bf.len()];
        bf16_to_f16_slice_with(isa, &bf, &mut out).unwrap();
        for (s, o) in bf.iter().zip(&out) {
            let want = half::f16::from_f32(half::bf16::from_bits(*s).to_f32());
            assert!(
                want.to_bits() == *o || (want.is_nan() && half::f16::from_bits(*o).is_nan()),
                "{isa:?} bf16 {s:#06x}"
            );
        }
    }
}

/// f32 to bf16 (the bf16 cache's encoder) on every instruction set, bit for bit the `half`
/// crate: random bit patterns (NaN payloads, infinities, subnormals), every rounding tie
/// (low half 0x8000, even and odd kept halves), one either side, and the largest finite values
/// (which round up to infinity past the last tie), at lengths that leave SIMD tails.
#[test]
fn f32_to_bf16_rounds_like_the_half_crate_on_every_isa() {
    let mut rng = Rng(0xbf16);
    let mut src: Vec<f32> = (0..4099)
        .map(|_| f32::from_bits((rng.next_u64() >> 32) as u32))
        .collect();
    for hi in (0..=u16::MAX).step_by(7) {
        for lo in [0x7fffu32, 0x8000, 0x8001] {
            src.push(f32::from_bits((u32::from(hi) << 16) | lo));
        }
    }
    src.extend([
        f32::MAX,
        -f32::MAX,
        f32::from_bits(0x7f7f_8000),
        f32::from_bits(0x7f7f_7fff),
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::from_bits(0x7f80_0001), // signalling NaN: must stay NaN, not become inf
        f32::from_bits(0xff80_0001),
        -0.0,
        f32::from_bits(1),
    ]);
    for len in [src.len(), 7, 9] {
        for isa in Isa::all_supported() {
            let mut out = vec![0u16; len];
            f32_to_bf16_slice_with(isa, &src[..len], &mut out).unwrap();
            for (s, o) in src.iter().zip(&out) {
                let want = half::bf16::from_f32(*s).to_bits();
                assert_eq!(*o, want, "{isa:?} {:#010x}", s.to_bits());
            }
        }
    }
    let e = f32_to_bf16_slice_with(Isa::Scalar, &src[..4], &mut [0u16; 3]).unwrap_err();
    assert_eq!(e.to_string(), "bf16 output values: expected 4, got 3");
}

#[test]
fn scan_returns_the_first_non_finite_index() {
    let mut v = vec![1.0f32; 100_003];
    assert_eq!(
        scan_non_finite(QuantType::F32, bytemuck::cast_slice(&v)).unwrap(),
        None
    );
    v[70_001] = f32::INFINITY;
    v[90_000] = f32::NAN;
    assert_eq!(
        scan_non_finite(QuantType::F32, bytemuck::cast_slice(&v)).unwrap(),
        Some(70_001)
    );
    let mut h = vec![0x3c00u16; 50_000];
    h[40_000] = 0x7e00; // f16 NaN
    assert_eq!(
        scan_non_finite(QuantType::F16, bytemuck::cast_slice(&h)).unwrap(),
        Some(40_000)
    );
    h[40_000] = 0x7f80; // finite as f16 (exponent 0x1f? no: 0x7f80 & 0x7c00 == 0x7c00, so inf/NaN)
    assert_eq!(
        scan_non_finite(QuantType::F16, bytemuck::cast_slice(&h)).unwrap(),
        Some(40_000)
    );
    let mut b = vec![0x3f80u16; 1000];
    b[999] = 0xff80; // bf16 -inf
    assert_eq!(
        scan_non_finite(QuantType::BF16, bytemuck::cast_slice(&b)).unwrap(),
        Some(999)
    );
    let mut q = load("q4_k").raw;
    assert_eq!(scan_non_finite(QuantType::Q4_K, &q).unwrap(), None);
    q[144 * 5 + 2..144 * 5 + 4].copy_from_slice(&0xfc00u16.to_le_bytes()); // dmin of block 5 = -inf
    assert_eq!(scan_non_finite(QuantType::Q4_K, &q).unwrap(), Some(5 * 256));
}

#[test]
fn rms_norm_matches_its_definition() {
    let mut rng = Rng(9);
    let n = 576;
    let x = rng.vec(n * 3, 3.0);
    let w = rng.vec(n, 1.0);
    let mut out = vec![0f32; x.len()];
    rms_norm(&x, &w, 1e-5, &mut out).unwrap();
    for r in 0..3 {
        let xr = &x[r * n..(r + 1) * n];
        let ms: f64 = xr.iter().map(|v| f64::from(*v).powi(2)).sum::<f64>() / n as f64;
        let s = 1.0 / (ms + 1e-5).sqrt();
        for i in 0..n {
            let want = f64::from(xr[i]) * s * f64::from(w[i]);
            assert!((f64::from(out[r * n + i]) - want).abs() <= 1e-5 * want.abs().max(1e-3));
        }
    }
    let err = rms_norm(&x[..100], &w, 1e-5, &mut out[..100]).unwrap_err();
    assert_eq!(
        err.to_string(),
        "invalid shape for rms_norm: 100 values are not whole rows of 576"
    );
}

#[test]
fn rope_rotates_pairs_as_llama_cpp_normal_and_neox_styles() {
    // head_dim 4, n_dims 4, base 10000: pair 0 turns by p, pair 1 by p/100.
    let x = [1.0f32, 2.0, 3.0, 4.0];
    let p = 3i32;
    let (t0, t1) = (3.0f64, 0.03f64);
    let rot = |a: f64, b: f64, t: f64| (a * t.cos() - b * t.sin(), a * t.sin() + b * t.cos());
    for (style, pairs) in [
        (RopeStyle::Normal, [(0, 1), (2, 3)]),
        (RopeStyle::Neox, [(0, 2), (1, 3)]),
    ] {
        let params = RopeParams {
            style,
            head_dim: 4,
            n_dims: 4,
            freq_base: 10000.0,
            freq_scale: 1.0,
            attn_factor: 1.0,
        };
        let mut out = [0f32; 4];
        rope(&x, &[p], &params, &mut out).unwrap();
        for ((ia, ib), t) in pairs.into_iter().zip([t0, t1]) {
            let (a, b) = rot(f64::from(x[ia]), f64::from(x[ib]), t);
            assert!(
                (f64::from(out[ia]) - a).abs() < 1e-5 && (f64::from(out[ib]) - b).abs() < 1e-5,
                "{style:?}"
            );
        }
    }
    // partial rotation: dims past n_dims pass through; two heads and two tokens
    let params = RopeParams {
        style: RopeStyle::Neox,
        head_dim: 8,
        n_dims: 4,
        freq_base: 10000.0,
        freq_scale: 1.0,
        attn_factor: 1.0,
    };
    let x: Vec<f32> = (0..32).map(|i| i as f32).collect();
    let mut out = vec![0f32; 32];
    rope(&x, &[0, 5], &params, &mut out).unwrap();
    assert_eq!(&out[..16], &x[..16]); // position 0: identity
    assert_eq!(&out[16 + 4..16 + 8], &x[16 + 4..16 + 8]);
    assert_ne!(&out[16..20], &x[16..20]);
}

#[test]
fn rope_attention_factor_scales_the_rotated_dims_only() {
    // LongRoPE's attention factor multiplies the cosine and sine: the rotated dims grow by it,
    // the dims past n_dims pass through as they are (transformers' `attention_scaling`).
    let m = 1.25f32;
    let params = RopeParams {
        style: RopeStyle::Neox,
        head_dim: 8,
        n_dims: 4,
        freq_base: 10000.0,
        freq_scale: 1.0,
        attn_factor: m,
    };
    let x: Vec<f32> = (0..16).map(|i| 0.5 + i as f32 * 0.25).collect();
    let positions = [0i32, 9];
    let mut out = vec![0f32; 16];
    rope(&x, &positions, &params, &mut out).unwrap();
    for (t, &p) in positions.iter().enumerate() {
        let h = &x[t * 8..t * 8 + 8];
        let o = &out[t * 8..t * 8 + 8];
        for i in 0..2 {
            let th = f64::from(p) * 10000f64.powf(-2.0 * i as f64 / 4.0);
            let (c, s) = (th.cos() * f64::from(m), th.sin() * f64::from(m));
            let (a, b) = (f64::from(h[i]), f64::from(h[i + 2]));
            assert!(
                (f64::from(o[i]) - (a * c - b * s)).abs() < 1e-5,
                "token {t} pair {i}"
            );
            assert!(
                (f64::from(o[i + 2]) - (a * s + b * c)).abs() < 1e-5,
                "token {t} pair {i}"
            );
        }
        assert_eq!(&o[4..], &h[4..], "token {t}: the unrotated dims");
    }
}

#[test]
fn softmax_swiglu_add_match_closed_forms() {
    let mut rng = Rng(13);
    let x = rng.vec(3 * 100, 20.0);
    let mut out = vec![0f32; x.len()];
    softmax(&x, 100, &mut out).unwrap();
    for r in 0..3 {
        let xr = &x[r * 100..(r + 1) * 100];
        let z: f64 = xr.iter().map(|v| f64::from(*v).exp()).sum();
        for i in 0..100 {
            let want = f64::from(xr[i]).exp() / z;
            assert!((f64::from(out[r * 100 + i]) - want).abs() <= 1e-6 * want.max(1e-6));
        }
    }
    let g = rng.vec(1000, 8.0);
    let u = rng.vec(1000, 2.0);
    let mut o = vec![0f32; 1000];
    swiglu(&g, &u, &mut o).unwrap();
    for i in 0..1000 {
        let (gg, uu) = (f64::from(g[i]), f64::from(u[i]));
        let want = gg / (1.0 + (-gg).exp()) * uu;
        assert!((f64::from(o[i]) - want).abs() <= 1e-6 * want.abs().max(1e-3));
    }
    add(&g, &u, &mut o).unwrap();
    assert!(
        o.iter()
            .zip(g.iter().zip(&u))
            .all(|(o, (a, b))| *o == a + b)
    );
    assert_eq!(
        add(&g, &u[..3], &mut o).unwrap_err().to_string(),
        "add rhs values: expected 1000, got 3"
    );
}

#[test]
fn kv_quantisers_meet_the_documented_error_bound() {
    let mut rng = Rng(17);
    let mut x = rng.vec(32 * 257, 4.0);
    x[5] = 3000.0; // an outlier
    x[32..64].fill(0.0); // an all-zero group
    x[64..96].iter_mut().for_each(|v| *v *= 1e-7); // subnormal-scale group
    for kt in [KvType::Q8, KvType::Q4] {
        let mut q = vec![0u8; kt.bytes_for(x.len())];
        kv_quantize(kt, &x, &mut q).unwrap();
        let mut back = vec![0f32; x.len()];
        kv_dequantize(kt, &q, &mut back).unwrap();
        for (g, (xs, bs)) in x.chunks(32).zip(back.chunks(32)).enumerate() {
            let gb = kt.group_bytes();
            let d = half::f16::from_le_bytes([q[g * gb], q[g * gb + 1]]).to_f32();
            let amax = xs.iter().fold(0f32, |m, v| m.max(v.abs()));
            // d is amax/qmax rounded up to the next f16
            let exact = f64::from(amax) / f64::from(kt.qmax());
            assert!(
                f64::from(d) >= exact,
                "{kt:?} group {g}: scale {d} below {exact}"
            );
            let next_down =
                half::f16::from_bits(half::f16::from_f32(d).to_bits().saturating_sub(1)).to_f32();
            assert!(
                d == 0.0 || f64::from(next_down) < exact,
                "{kt:?} group {g}: scale not the smallest f16 ≥ amax/qmax"
            );
            for (a, b) in xs.iter().zip(bs) {
                let err = f64::from((a - b).abs());
                assert!(
                    err <= f64::from(d) * (0.5 + 2f64.powi(-16)),
                    "{kt:?} group {g}: |{a} - {b}| > d/2 with d = {d}"
                );
            }
        }
        assert_eq!(&back[32..64], &[0.0; 32]);
    }
    assert_eq!(KvType::Q8.bytes_for(64), 68);
    assert_eq!(KvType::Q4.bytes_for(64), 36);
    let err = kv_quantize(KvType::Q8, &x[..33], &mut [0u8; 34]).unwrap_err();
    assert_eq!(
        err.to_string(),
        "invalid shape for kv quantize: 33 values are not whole groups of 32"
    );
}

#[test]
fn rope_of_queries_and_keys_together_turns_each_as_alone() {
    // a prompt's worth of tokens (several tasks), 4 query and 2 key heads, partial rotation
    let mut rng = Rng(17);
    for style in [RopeStyle::Normal, RopeStyle::Neox] {
        let params = RopeParams {
            style,
            head_dim: 16,
            n_dims: 12,
            freq_base: 10000.0,
            freq_scale: 0.5,
            attn_factor: 1.1,
        };
        let freqs = rope_inv_freqs(&params, None).unwrap();
        let positions: Vec<i32> = (0..300).map(|t| 7 + 3 * t).collect();
        let n = positions.len();
        let (q, k) = (rng.vec(n * 4 * 16, 2.0), rng.vec(n * 2 * 16, 2.0));
        let (mut q_alone, mut k_alone) = (q.clone(), k.clone());
        rope_in_place(&mut q_alone, &positions, &params, &freqs).unwrap();
        rope_in_place(&mut k_alone, &positions, &params, &freqs).unwrap();
        let (mut q_both, mut k_both) = (q.clone(), k.clone());
        rope_qk_in_place(&mut q_both, &mut k_both, &positions, &params, &freqs).unwrap();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&q_both), bits(&q_alone), "{style:?} queries");
        assert_eq!(bits(&k_both), bits(&k_alone), "{style:?} keys");
        assert_ne!(bits(&q_both), bits(&q), "{style:?}: turned");
        // keys that are not whole heads of every position are refused, naming the split
        let err = rope_qk_in_place(
            &mut q_both,
            &mut k_both[..16 * 3],
            &positions,
            &params,
            &freqs,
        )
        .unwrap_err();
        assert!(err.to_string().contains("3 heads of 16 values"), "{err}");
    }
}
