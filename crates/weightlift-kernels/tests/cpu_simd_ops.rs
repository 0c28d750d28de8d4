//! RMSNorm, softmax, SwiGLU and the KV-cache quantisers on every instruction set this CPU has
//! (`Isa::all_supported()`: the scalar fallback, AVX2, AVX-512), against references computed
//! here: f64 closed forms for the row operations, and for the KV cache the storage format as
//! `kv.rs` documents it, rebuilt with the `half` crate. Lengths include 1, odd sizes and tails
//! that are not a multiple of any vector width, and inputs large enough to split over tasks.
//!
//! Tolerances (relative to the f64 value, plus an absolute floor for results that underflow):
//! - rms_norm: 1e-6 (the scale is rounded to f32 four times, the output twice: ≤ 6 ulp);
//! - softmax: 1e-6 (the SIMD `exp` is within 1.5 ulp of exact, libm's `expf` within 0.5 ulp,
//!   plus the f32 reciprocal and product) plus |x − max|·6e-8 (x − max is rounded to f32
//!   before the exponential, as ggml does), absolute floor 1e-37;
//! - swiglu: 1e-6 (exp, add, divide, multiply), absolute floor 1e-30;
//! - KV cache: bytes identical to the documented format on every ISA; dequantisation
//!   bit-identical to `q · d`.

// Reference loops index several arrays in lock-step; iterators would hide the maths.
#![allow(clippy::needless_range_loop)]

use crate::common;

use common::Rng;
use half::f16;
use weightlift_kernels::Isa;
use weightlift_kernels::cpu::kv::{KvType, kv_dequantize_with, kv_quantize_with};
use weightlift_kernels::cpu::ops::{rms_norm_with, softmax_with, swiglu_with};

const ROW_LENS: [usize; 12] = [1, 3, 7, 8, 15, 16, 17, 31, 33, 100, 576, 4099];

fn close(got: f32, want: f64, rel: f64, abs: f64) -> bool {
    f64::from(got) == want || (f64::from(got) - want).abs() <= rel * want.abs() + abs
}

#[test]
fn rms_norm_matches_f64_on_every_isa_and_length() {
    let mut rng = Rng(101);
    for n in ROW_LENS {
        let rows = 3;
        let mut x = rng.vec(n * rows, 3.0);
        x[0] = 1e-20; // a tiny value next to normal ones
        let w = rng.vec(n, 1.5);
        let eps = 1e-5f32;
        for isa in Isa::all_supported() {
            let mut out = vec![0f32; x.len()];
            rms_norm_with(isa, &x, &w, eps, &mut out).unwrap();
            for r in 0..rows {
                let xr = &x[r * n..(r + 1) * n];
                let ms = xr.iter().map(|v| f64::from(*v).powi(2)).sum::<f64>() / n as f64;
                let s = 1.0 / (ms + f64::from(eps)).sqrt();
                for i in 0..n {
                    let want = f64::from(xr[i]) * s * f64::from(w[i]);
                    let got = out[r * n + i];
                    assert!(
                        close(got, want, 1e-6, 1e-37),
                        "{isa:?} n {n} row {r} [{i}]: {got:e} vs {want:e}"
                    );
                }
            }
        }
    }
    // many rows: the parallel split
    let n = 64;
    let x = rng.vec(n * 3001, 2.0);
    let w = rng.vec(n, 1.0);
    for isa in Isa::all_supported() {
        let mut out = vec![0f32; x.len()];
        rms_norm_with(isa, &x, &w, 1e-6, &mut out).unwrap();
        for (r, (xr, or)) in x.chunks(n).zip(out.chunks(n)).enumerate() {
            let ms = xr.iter().map(|v| f64::from(*v).powi(2)).sum::<f64>() / n as f64;
            let s = 1.0 / (ms + 1e-6f64).sqrt();
            for i in 0..n {
                let want = f64::from(xr[i]) * s * f64::from(w[i]);
                assert!(close(or[i], want, 1e-6, 1e-37), "{isa:?} row {r}");
            }
        }
    }
}

#[test]
fn softmax_matches_f64_on_every_isa_and_length() {
    let mut rng = Rng(103);
    for n in ROW_LENS {
        for scale in [1.0f32, 20.0, 60.0] {
            let rows = 2;
            let mut x = rng.vec(n * rows, scale);
            if n > 4 {
                x[2] = f32::NEG_INFINITY; // a masked position, as attention masks write
                x[n + 3] = -1e30;
            }
            for isa in Isa::all_supported() {
                let mut out = vec![0f32; x.len()];
                softmax_with(isa, &x, n, &mut out).unwrap();
                for r in 0..rows {
                    let xr = &x[r * n..(r + 1) * n];
                    let m = xr
                        .iter()
                        .fold(f64::NEG_INFINITY, |a, b| a.max(f64::from(*b)));
                    let z: f64 = xr.iter().map(|v| (f64::from(*v) - m).exp()).sum();
                    let mut total = 0f64;
                    for i in 0..n {
                        let want = (f64::from(xr[i]) - m).exp() / z;
                        let got = out[r * n + i];
                        total += f64::from(got);
                        // x − max is rounded to f32 before exp (ggml's order): |x − max|·2⁻²⁴
                        let rel = 1e-6 + (f64::from(xr[i]) - m).abs() * 6e-8;
                        assert!(
                            close(got, want, rel, 1e-37),
                            "{isa:?} n {n} scale {scale} row {r} [{i}]: {got:e} vs {want:e}"
                        );
                    }
                    assert!((total - 1.0).abs() < 1e-5, "{isa:?} n {n}: sum {total}");
                }
            }
        }
    }
    // many rows: the parallel split
    let n = 100;
    let x = rng.vec(n * 700, 10.0);
    for isa in Isa::all_supported() {
        let mut out = vec![0f32; x.len()];
        softmax_with(isa, &x, n, &mut out).unwrap();
        for (xr, or) in x.chunks(n).zip(out.chunks(n)) {
            let m = xr
                .iter()
                .fold(f64::NEG_INFINITY, |a, b| a.max(f64::from(*b)));
            let z: f64 = xr.iter().map(|v| (f64::from(*v) - m).exp()).sum();
            for i in 0..n {
                let want = (f64::from(xr[i]) - m).exp() / z;
                let rel = 1e-6 + (f64::from(xr[i]) - m).abs() * 6e-8;
                assert!(close(or[i], want, rel, 1e-37), "{isa:?}");
            }
        }
    }
}

#[test]
fn swiglu_matches_f64_on_every_isa_and_length() {
    let mut rng = Rng(107);
    for n in ROW_LENS.into_iter().chain([40_001]) {
        let mut g = rng.vec(n, 12.0);
        let u = rng.vec(n, 3.0);
        // saturating gates: e^(−g) overflows (→ −0) or vanishes (→ g·u)
        for (i, v) in [-100.0f32, 100.0, -88.0, 89.0, 0.0, -0.0, 1e-30]
            .iter()
            .enumerate()
        {
            if i < n {
                g[i] = *v;
            }
        }
        for isa in Isa::all_supported() {
            let mut o = vec![0f32; n];
            swiglu_with(isa, &g, &u, &mut o).unwrap();
            for i in 0..n {
                let (gg, uu) = (f64::from(g[i]), f64::from(u[i]));
                let want = gg / (1.0 + (-gg).exp()) * uu;
                assert!(
                    close(o[i], want, 1e-6, 1e-30),
                    "{isa:?} n {n} [{i}]: silu({gg}) * {uu} = {} vs {want:e}",
                    o[i]
                );
            }
        }
    }
}

/// The documented q8/q4 format, written from `kv.rs`'s table: `d` is the smallest f16 ≥
/// amax/qmax (amax ignoring NaN, capped at 65504), `q = round(x · (1/d))` with ties away from
/// zero, clamped to ±qmax, NaN stored as 0; q4 stores `q + 8`, value j in the low nibble of
/// byte j and value j + 16 in its high nibble.
fn reference_kv(kt: KvType, x: &[f32]) -> Vec<u8> {
    let qmax = kt.qmax() as f32;
    let mut out = Vec::new();
    for g in x.chunks(32) {
        let amax = g
            .iter()
            .filter(|v| !v.is_nan())
            .fold(0f32, |m, v| m.max(v.abs()));
        let exact = amax / qmax;
        let mut h = f16::from_f32(exact);
        if h.to_f32() < exact && h < f16::MAX {
            h = f16::from_bits(h.to_bits() + 1);
        }
        if h.is_infinite() || h > f16::MAX {
            h = f16::MAX;
        }
        out.extend_from_slice(&h.to_le_bytes());
        let d = h.to_f32();
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let q: Vec<i32> = g
            .iter()
            .map(|v| {
                let t = v * id;
                if t.is_nan() {
                    0
                } else {
                    t.round().clamp(-qmax, qmax) as i32
                }
            })
            .collect();
        match kt {
            KvType::Q8 => out.extend(q.iter().map(|v| *v as i8 as u8)),
            KvType::Q4 => {
                out.extend((0..16).map(|j| ((q[j] + 8) as u8) | (((q[j + 16] + 8) as u8) << 4)))
            }
        }
    }
    out
}

#[test]
fn kv_quantize_writes_the_documented_bytes_on_every_isa() {
    let mut rng = Rng(109);
    for groups in [1usize, 3, 257, 1100] {
        let mut x = rng.vec(32 * groups, 4.0);
        if groups >= 3 {
            x[5] = 3000.0; // an outlier
            x[32..64].fill(0.0); // an all-zero group
            x[70] = f32::NAN; // NaN is skipped by amax and stored as 0
            x[90] = f32::INFINITY; // inf: scale capped at 65504, the value clamped
        }
        if groups >= 257 {
            // exact ties: amax 63.5 gives d = 0.5, so x = ±0.25, ±0.75 sit on .5 quants
            let g = &mut x[96 * 32..97 * 32];
            g.fill(0.25);
            g[0] = 63.5;
            g[1] = -0.75;
            g[2] = 0.75;
            g[3] = -0.25;
            x[100 * 32..101 * 32].iter_mut().for_each(|v| *v *= 1e-7); // scale in the f16 subnormals
            x[101 * 32..102 * 32].iter_mut().for_each(|v| *v *= 1e6); // past the f16 range for q4
        }
        for kt in [KvType::Q8, KvType::Q4] {
            let want = reference_kv(kt, &x);
            for isa in Isa::all_supported() {
                let mut q = vec![0u8; kt.bytes_for(x.len())];
                kv_quantize_with(isa, kt, &x, &mut q).unwrap();
                for (gi, (a, b)) in q
                    .chunks(kt.group_bytes())
                    .zip(want.chunks(kt.group_bytes()))
                    .enumerate()
                {
                    assert_eq!(a, b, "{kt:?} {isa:?} {groups} groups: group {gi}");
                }
                // dequantisation: q · d exactly
                let mut back = vec![0f32; x.len()];
                kv_dequantize_with(isa, kt, &q, &mut back).unwrap();
                for (gi, (gb, vals)) in q.chunks(kt.group_bytes()).zip(back.chunks(32)).enumerate()
                {
                    let d = f16::from_le_bytes([gb[0], gb[1]]).to_f32();
                    for j in 0..32 {
                        let qv = match kt {
                            KvType::Q8 => i32::from(gb[2 + j] as i8),
                            KvType::Q4 => {
                                let b = gb[2 + j % 16];
                                i32::from(if j < 16 { b & 0x0f } else { b >> 4 }) - 8
                            }
                        };
                        let want = qv as f32 * d;
                        assert_eq!(
                            vals[j].to_bits(),
                            want.to_bits(),
                            "{kt:?} {isa:?} group {gi} [{j}]"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn kv_ties_round_away_from_zero() {
    // d = 0.5 exactly (amax 63.5 / 127): 0.25 → 0.5 → 1, −0.75 → −1.5 → −2
    let mut x = [0.25f32; 32];
    x[0] = 63.5;
    x[1] = -0.75;
    for isa in Isa::all_supported() {
        let mut q = [0u8; 34];
        kv_quantize_with(isa, KvType::Q8, &x, &mut q).unwrap();
        assert_eq!(f16::from_le_bytes([q[0], q[1]]).to_f32(), 0.5, "{isa:?}");
        assert_eq!(q[2] as i8, 127, "{isa:?}");
        assert_eq!(q[3] as i8, -2, "{isa:?}");
        assert_eq!(q[4] as i8, 1, "{isa:?}");
    }
}
